//! Finds or provisions MLX, compiles the C++ shim and links `libmlx` with a runpath.
//!
//! Where MLX comes from, in order:
//! 1. `MLX_DIR`: a directory holding `include/mlx/mlx.h` and `lib/libmlx.{so,dylib}`.
//! 2. An MLX already installed for `python3` (the `mlx` package's directory), if its version matches.
//! 3. The official prebuilt distribution installed with `python3 -m pip install --target` into a
//!    per-user cache (`$RMLX_CACHE_DIR`, else `$XDG_CACHE_HOME/rmlx`, else `~/.cache/rmlx`) and reused
//!    by later builds. `RMLX_MLX_FLAVOR` picks it: `cpu` (Linux default), `metal` (macOS default),
//!    `cuda13` or `cuda12`.
//!
//!    On x86_64 Linux the `cpu` flavour's bundled reference BLAS/LAPACK (slow float32 matmul) is
//!    replaced by OpenBLAS from the pinned PyPI wheel `scipy-openblas32` behind a small generated stub
//!    (see `blas.rs`), in a cache directory of its own, `mlx-cpu-<version>-openblas`, set up from the
//!    plain one. If that fails for any reason the build warns and uses the plain install;
//!    `RMLX_BLAS=reference` skips it. MLX from `MLX_DIR` or from Python is never changed.
//!
//! MLX is never built from source here.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

mod blas;

/// The MLX release this crate's shim is written against.
const MLX_VERSION: &str = "0.32.4";

fn main() {
    for var in ["MLX_DIR", "RMLX_MLX_FLAVOR", "RMLX_CACHE_DIR", "XDG_CACHE_HOME", "RMLX_PYTHON", "RMLX_BLAS"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=src/shim.h");
    println!("cargo:rerun-if-changed=src/shim.cc");
    println!("cargo:rerun-if-changed=src/lib.rs");
    for file in [
        "src/transforms.h",
        "src/transforms.cc",
        "src/transforms.rs",
        "src/cuda.h",
        "src/cuda.cc",
        "src/cuda.rs",
        "src/distributed.h",
        "src/distributed.cc",
        "src/distributed.rs",
    ] {
        println!("cargo:rerun-if-changed={file}");
    }

    let mlx = match locate_mlx() {
        Ok(dir) => dir,
        Err(message) => {
            eprintln!("\nerror: rmlx-sys could not find or install MLX {MLX_VERSION}.\n{message}\n");
            std::process::exit(1);
        }
    };
    let include = mlx.join("include");
    let lib = mlx.join("lib");
    println!("cargo:warning=rmlx-sys: using MLX from {}", mlx.display());

    let mut build = cxx_build::bridges(["src/lib.rs", "src/transforms.rs", "src/cuda.rs", "src/distributed.rs"]);
    build
        .file("src/shim.cc")
        .file("src/transforms.cc")
        .file("src/cuda.cc")
        .file("src/distributed.cc")
        .include(&include)
        .include("src")
        .std("c++20")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        .opt_level(2);
    build.compile("rmlx_shim");

    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    // `links = "mlx"` publishes these to direct dependents as DEP_MLX_LIB_DIR / DEP_MLX_INCLUDE_DIR,
    // so that crates producing binaries can add the runpath (see `rmlx`'s build script).
    println!("cargo:lib_dir={}", lib.display());
    println!("cargo:include_dir={}", include.display());
    // Runpath for this crate's own tests and examples.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
}

/// Returns the MLX prefix (the directory with `include/` and `lib/`).
fn locate_mlx() -> Result<PathBuf, String> {
    if let Some(dir) = env::var_os("MLX_DIR") {
        let dir = PathBuf::from(dir);
        return if is_mlx_prefix(&dir) {
            Ok(dir)
        } else {
            Err(format!("MLX_DIR={} does not contain include/mlx/mlx.h and lib/libmlx.{}.", dir.display(), dylib_ext()))
        };
    }
    let python = env::var("RMLX_PYTHON").unwrap_or_else(|_| "python3".to_string());
    if let Some(dir) = python_mlx(&python) {
        match header_version(&dir) {
            Some(v) if v == MLX_VERSION => return Ok(dir),
            found => println!(
                "cargo:warning=rmlx-sys: ignoring the MLX installed for {python} at {} (version {}, need {MLX_VERSION})",
                dir.display(),
                found.unwrap_or_else(|| "unknown".into())
            ),
        }
    }
    provision(&python)
}

/// Installs (once) the prebuilt MLX distribution into the per-user cache and returns its prefix.
fn provision(python: &str) -> Result<PathBuf, String> {
    let flavor = env::var("RMLX_MLX_FLAVOR").unwrap_or_else(|_| default_flavor().to_string());
    let package = match flavor.as_str() {
        "cpu" => "mlx-cpu",
        "metal" => "mlx-metal",
        "cuda13" | "cuda-13" | "cuda" => "mlx-cuda-13",
        "cuda12" | "cuda-12" => "mlx-cuda-12",
        other => return Err(format!("RMLX_MLX_FLAVOR={other} is not one of: cpu, metal, cuda13, cuda12.")),
    };
    let root = cache_root()?.join(format!("{package}-{MLX_VERSION}"));
    if blas::wanted(package) {
        match provision_openblas(python, package, &root) {
            Ok(prefix) => return Ok(prefix),
            Err(message) => {
                let text = format!(
                    "could not set up OpenBLAS for {package} ({message}); falling back to the bundled \
                     reference BLAS, which makes float32 matmul much slower. Set RMLX_BLAS=reference \
                     to skip this attempt."
                );
                for line in text.lines() {
                    println!("cargo:warning=rmlx-sys: {line}");
                }
            }
        }
    }
    let prefix = root.join("mlx");
    if is_mlx_prefix(&prefix) {
        return Ok(prefix);
    }
    let staging = staging_dir(&root);
    announce(package, "", &root);
    if let Err(message) = pip_install(python, package, &staging) {
        let _ = fs::remove_dir_all(&staging);
        return Err(message);
    }
    commit(&staging, &root)
}

/// `mlx-cpu` with the reference BLAS replaced by OpenBLAS (see `blas.rs`), in its own cache
/// directory beside the plain install `plain` (copied from it when present, else installed afresh).
fn provision_openblas(python: &str, package: &str, plain: &Path) -> Result<PathBuf, String> {
    let mut name = plain.file_name().ok_or("bad cache directory")?.to_os_string();
    name.push(blas::CACHE_SUFFIX);
    let root = plain.with_file_name(name);
    let prefix = root.join("mlx");
    if is_mlx_prefix(&prefix) {
        return Ok(prefix);
    }
    let staging = staging_dir(&root);
    let scratch = PathBuf::from(env::var_os("OUT_DIR").ok_or("OUT_DIR is not set")?).join("openblas");
    let result = (|| {
        if is_mlx_prefix(&plain.join("mlx")) {
            println!(
                "cargo:warning=rmlx-sys: setting up {package}=={MLX_VERSION} with OpenBLAS in {} (first build only)",
                root.display()
            );
            let _ = fs::remove_dir_all(&staging);
            copy_dir(plain, &staging)?;
        } else {
            announce(package, " with OpenBLAS", &root);
            pip_install(python, package, &staging)?;
        }
        blas::install(python, &staging, &scratch)
    })();
    if let Err(message) = result {
        let _ = fs::remove_dir_all(&staging);
        let _ = fs::remove_dir_all(&scratch);
        return Err(message);
    }
    commit(&staging, &root)
}

/// Says (once per install) that `package` is being installed into `root`; `extra` follows the version.
fn announce(package: &str, extra: &str, root: &Path) {
    let line = format!("installing {package}=={MLX_VERSION}{extra} into {}", root.display());
    eprintln!("rmlx-sys: {line}");
    println!("cargo:warning=rmlx-sys: {line} (first build only)");
}

/// A fresh private directory beside `root` to install into; `commit` renames it into place, so
/// concurrent builds never see half an install.
fn staging_dir(root: &Path) -> PathBuf {
    let mut name = root.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp{}", std::process::id()));
    root.with_file_name(name)
}

/// Renames the finished `staging` to `root` and returns the MLX prefix in it.
fn commit(staging: &Path, root: &Path) -> Result<PathBuf, String> {
    if fs::rename(staging, root).is_err() {
        // Another build finished first; use its copy.
        let _ = fs::remove_dir_all(staging);
    }
    let prefix = root.join("mlx");
    if is_mlx_prefix(&prefix) {
        Ok(prefix)
    } else {
        Err(format!("the install in {} is incomplete; delete it and build again", root.display()))
    }
}

/// `python -m pip install --target dest package==MLX_VERSION` into a new directory `dest`.
fn pip_install(python: &str, package: &str, dest: &Path) -> Result<(), String> {
    let pip_ok =
        Command::new(python).args(["-m", "pip", "--version"]).output().map(|o| o.status.success()).unwrap_or(false);
    if !pip_ok {
        return Err(format!(
            "`{python} -m pip` is not available, so the prebuilt MLX cannot be installed.\n\
             Install Python 3 with pip (Debian/Ubuntu: `apt-get install python3 python3-pip`), or\n\
             point MLX_DIR at an MLX {MLX_VERSION} prefix (a directory with include/mlx/mlx.h and lib/libmlx.{}).",
            dylib_ext()
        ));
    }
    let _ = fs::remove_dir_all(dest);
    fs::create_dir_all(dest).map_err(|e| format!("cannot create {}: {e}", dest.display()))?;
    let status = Command::new(python)
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", "--target"])
        .arg(dest)
        .arg(format!("{package}=={MLX_VERSION}"))
        .status()
        .map_err(|e| format!("could not run {python}: {e}"))?;
    if !status.success() || !is_mlx_prefix(&dest.join("mlx")) {
        return Err(format!(
            "`{python} -m pip install --target ... {package}=={MLX_VERSION}` failed (see its output above).\n\
             Check that PyPI is reachable, or set MLX_DIR to an MLX {MLX_VERSION} prefix."
        ));
    }
    Ok(())
}

/// Copies the tree `from` to a new directory `to`, keeping symlinks as symlinks.
fn copy_dir(from: &Path, to: &Path) -> Result<(), String> {
    let fail = |e: std::io::Error, p: &Path| format!("cannot copy {}: {e}", p.display());
    fs::create_dir_all(to).map_err(|e| fail(e, to))?;
    for entry in fs::read_dir(from).map_err(|e| fail(e, from))? {
        let entry = entry.map_err(|e| fail(e, from))?;
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        let kind = entry.file_type().map_err(|e| fail(e, &src))?;
        if kind.is_dir() {
            copy_dir(&src, &dst)?;
        } else if kind.is_symlink() {
            let target = fs::read_link(&src).map_err(|e| fail(e, &src))?;
            #[cfg(unix)]
            std::os::unix::fs::symlink(target, &dst).map_err(|e| fail(e, &src))?;
            #[cfg(not(unix))]
            let _ = target;
        } else {
            fs::copy(&src, &dst).map_err(|e| fail(e, &src))?;
        }
    }
    Ok(())
}

fn default_flavor() -> &'static str {
    if cfg!(target_os = "macos") {
        "metal"
    } else {
        "cpu"
    }
}

fn dylib_ext() -> &'static str {
    if cfg!(target_os = "macos") {
        "dylib"
    } else {
        "so"
    }
}

fn cache_root() -> Result<PathBuf, String> {
    if let Some(dir) = env::var_os("RMLX_CACHE_DIR") {
        return Ok(PathBuf::from(dir));
    }
    if let Some(dir) = env::var_os("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(dir).join("rmlx"));
    }
    if let Some(home) = env::var_os("HOME") {
        let base = if cfg!(target_os = "macos") { "Library/Caches" } else { ".cache" };
        return Ok(PathBuf::from(home).join(base).join("rmlx"));
    }
    Err("cannot choose a cache directory: set RMLX_CACHE_DIR or HOME".into())
}

fn is_mlx_prefix(dir: &Path) -> bool {
    dir.join("include/mlx/mlx.h").is_file() && dir.join(format!("lib/libmlx.{}", dylib_ext())).is_file()
}

/// The directory of the `mlx` Python package for `python`, if it ships headers and the library.
fn python_mlx(python: &str) -> Option<PathBuf> {
    let script = "import importlib.util as u\n\
                  s = u.find_spec('mlx')\n\
                  print('\\n'.join(s.submodule_search_locations or []) if s else '')";
    let out = Command::new(python).args(["-c", script]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout).lines().map(PathBuf::from).find(|dir| is_mlx_prefix(dir))
}

fn header_version(prefix: &Path) -> Option<String> {
    let text = fs::read_to_string(prefix.join("include/mlx/version.h")).ok()?;
    let field = |name: &str| -> Option<String> {
        text.lines().find_map(|l| l.strip_prefix(&format!("#define MLX_VERSION_{name} "))).map(|v| v.trim().to_string())
    };
    Some(format!("{}.{}.{}", field("MAJOR")?, field("MINOR")?, field("PATCH")?))
}
