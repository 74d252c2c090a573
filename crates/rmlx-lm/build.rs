//! Runpath to libmlx for this crate's tests and doc-tests (see rmlx's build script).
fn main() {
    let lib = std::env::var("DEP_RMLX_LIB_DIR").expect("rmlx publishes DEP_RMLX_LIB_DIR");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
}
