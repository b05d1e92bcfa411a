//! Compiles `src/blob.cpp` (a tensor over registered memory whose storage
//! releases the buffer when its last reference goes) against libtorch's
//! headers, with the flags torch-sys uses. Test and bench binaries of this
//! crate find libtorch's shared libraries through an rpath (torch-sys adds
//! none).
//!
//! libtorch is found as torch-sys finds it: `LIBTORCH` (from
//! `.cargo/config.toml` or the environment), or `LIBTORCH_INCLUDE` and
//! `LIBTORCH_LIB`, or with `LIBTORCH_USE_PYTORCH` the Python torch package.
use std::path::PathBuf;
use std::process::Command;

fn env(name: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={name}");
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// Include directories, library directory and C++11 ABI flag of the
/// Python torch package.
fn from_python() -> (Vec<PathBuf>, Option<PathBuf>, String) {
    let python = env("PYTHON_SYS_EXECUTABLE").unwrap_or_else(|| "python3".into());
    let script = "import torch\nfrom torch.utils import cpp_extension\n\
        print('ABI', int(torch._C._GLIBCXX_USE_CXX11_ABI))\n\
        [print('INC', p) for p in cpp_extension.include_paths()]\n\
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
    let (mut inc, mut lib, mut abi) = (Vec::new(), None, "1".to_owned());
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if let Some(p) = line.strip_prefix("INC ") {
            inc.push(PathBuf::from(p));
        } else if let Some(p) = line.strip_prefix("LIB ") {
            lib.get_or_insert(PathBuf::from(p));
        } else if let Some(a) = line.strip_prefix("ABI ") {
            abi = a.trim().to_owned();
        }
    }
    (inc, lib, abi)
}

fn main() {
    println!("cargo:rerun-if-changed=src/blob.cpp");
    let (includes, lib, abi) = if env("LIBTORCH_USE_PYTORCH").is_some() {
        from_python()
    } else {
        let root = env("LIBTORCH").map(PathBuf::from);
        let include = env("LIBTORCH_INCLUDE")
            .map(PathBuf::from)
            .or_else(|| root.clone())
            .expect("LIBTORCH is not set: run scripts/install-libtorch.sh (see README)");
        let lib = env("LIBTORCH_LIB")
            .map(PathBuf::from)
            .or_else(|| root.map(|r| r.join("lib")));
        let abi = env("LIBTORCH_CXX11_ABI").unwrap_or_else(|| "1".into());
        (
            vec![
                include.join("include"),
                include.join("include/torch/csrc/api/include"),
            ],
            lib,
            abi,
        )
    };
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .includes(&includes)
        // libtorch 2.13's headers use C++20 (bit-field initializers); with
        // -std=c++17 they compile with a warning per header.
        .flag("-std=c++20")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .file("src/blob.cpp")
        .compile("regent_tensor_blob");
    if let Some(lib) = lib {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    }
}
