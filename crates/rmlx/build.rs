//! Adds a runpath to `libmlx` for this crate's tests, examples and doc-tests, and passes the library
//! directory on to dependents as `DEP_RMLX_LIB_DIR`, so their binaries can do the same with one line:
//!
//! ```text
//! println!("cargo:rustc-link-arg=-Wl,-rpath,{}", std::env::var("DEP_RMLX_LIB_DIR").unwrap());
//! ```
fn main() {
    let lib = std::env::var("DEP_MLX_LIB_DIR").expect("rmlx-sys publishes DEP_MLX_LIB_DIR");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    println!("cargo:lib_dir={lib}");
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIB_DIR");
}
