//! The rpath part of `tensor/build.rs`: the binaries of this crate (the
//! tensor suite's proc and every test binary, which link regent-tensor)
//! find libtorch's shared libraries through an rpath (torch-sys adds
//! none). libtorch's library directory is found as torch-sys finds it:
//! `LIBTORCH_LIB`, or `LIBTORCH` (from `.cargo/config.toml` or the
//! environment), or with `LIBTORCH_USE_PYTORCH` the Python torch package.
use std::path::PathBuf;
use std::process::Command;

fn env(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// The library directory of the Python torch package.
fn from_python() -> Option<PathBuf> {
    let python = env("PYTHON_SYS_EXECUTABLE").unwrap_or_else(|| "python3".into());
    let script = "from torch.utils import cpp_extension\n\
        [print('LIB', p) for p in cpp_extension.library_paths()]\n";
    let out = Command::new(&python)
        .arg("-c")
        .arg(script)
        .output()
        .unwrap_or_else(|e| panic!("running {python} to find torch: {e}"));
    assert!(
        out.status.success(),
        "{python} could not import torch: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("LIB ").map(PathBuf::from))
}

fn main() {
    let lib = if env("LIBTORCH_USE_PYTORCH").is_some() {
        from_python()
    } else {
        env("LIBTORCH_LIB")
            .map(PathBuf::from)
            .or_else(|| env("LIBTORCH").map(|r| PathBuf::from(r).join("lib")))
    };
    if let Some(lib) = lib {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    }
}
