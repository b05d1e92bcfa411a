//! Test and bench binaries of this crate find libtorch's shared libraries
//! through an rpath (torch-sys adds none); LIBTORCH comes from
//! `.cargo/config.toml` or the environment.
fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    if let Ok(dir) = std::env::var("LIBTORCH") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}/lib");
    }
}
