//! OpenBLAS for the pip-installed `mlx-cpu` wheel (x86_64 Linux), used by `build.rs`.
//!
//! The `mlx-cpu` wheel bundles the reference (netlib) BLAS and LAPACK in `mlx_cpu.libs/`, which makes
//! float32 matmul on the CPU very slow. `libmlx.so` finds them through its `DT_RPATH`
//! (`$ORIGIN/../../mlx_cpu.libs`), so swapping the files in that folder is enough:
//!
//! - OpenBLAS comes from the PyPI wheel `scipy-openblas32` (fetched with `pip download
//!   --require-hashes`, so exactly the pinned file), whose symbols are all prefixed `scipy_`;
//! - a generated stub library named like the bundled BLAS forwards each of the symbols `libmlx.so`
//!   imports to its `scipy_` twin (one `jmp` each) and finds OpenBLAS through `RUNPATH $ORIGIN`;
//!   the bundled LAPACK's name becomes a symlink to the same stub;
//! - the originals stay beside them as `*.reference`, and OpenBLAS's licence as
//!   `LICENSE.scipy-openblas32.txt`;
//! - `libmlx.so` is then loaded with every symbol bound (`RTLD_NOW`) and `cblas_sgemm` is called
//!   once through the stub, so a broken result fails here and not at the first matmul.

use std::env;
use std::fs;
use std::path::Path;
use std::process::Command;

/// The PyPI wheel that provides OpenBLAS: name, version, sha256 of the manylinux x86_64 wheel.
const WHEEL: (&str, &str, &str) =
    ("scipy-openblas32", "0.3.34.481.3", "0595f94cd58c1f8a0d90c975621f4587337a003916b1979e834ebdf2cb5d9504");

/// The BLAS and LAPACK that the `mlx-cpu` 0.32.4 wheel bundles (and `libmlx.so` lists as `NEEDED`).
const BLAS: &str = "libblas-bd8a282c.so.3.10.0";
const LAPACK: &str = "liblapack-86b2c207.so.3.10.0";

/// The OpenBLAS library inside the wheel, and its name in `mlx_cpu.libs/`.
const OPENBLAS: &str = "libscipy_openblas.so";

/// Exactly the BLAS, CBLAS and LAPACK symbols `libmlx.so` 0.32.4 imports
/// (`nm -D --undefined-only libmlx.so`); the `RTLD_NOW` check catches any that goes missing.
const SYMBOLS: [&str; 24] = [
    "cblas_cgemm",
    "cblas_dgemm",
    "cblas_sgemm",
    "cgeev_",
    "cgesdd_",
    "cheevd_",
    "dgeev_",
    "dgeqrf_",
    "dgesdd_",
    "dgetrf_",
    "dgetri_",
    "dorgqr_",
    "dpotrf_",
    "dsyevd_",
    "dtrtri_",
    "sgeev_",
    "sgeqrf_",
    "sgesdd_",
    "sgetrf_",
    "sgetri_",
    "sorgqr_",
    "spotrf_",
    "ssyevd_",
    "strtri_",
];

/// Suffix of the cache directory that holds `mlx-cpu` with OpenBLAS (beside the plain one).
pub const CACHE_SUFFIX: &str = "-openblas";

/// Whether to put OpenBLAS into a `package` install: only `mlx-cpu` for an x86_64 Linux target,
/// built on such a host, and not when `RMLX_BLAS=reference`.
pub fn wanted(package: &str) -> bool {
    let target_ok = env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux")
        && env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("x86_64");
    let host_ok = cfg!(all(target_os = "linux", target_arch = "x86_64"));
    if package != "mlx-cpu" || !target_ok || !host_ok {
        return false;
    }
    match env::var("RMLX_BLAS").as_deref() {
        Err(_) | Ok("") | Ok("openblas") => true,
        Ok("reference") => false,
        Ok(other) => {
            println!("cargo:warning=rmlx-sys: RMLX_BLAS={other} is not `openblas` or `reference`; using openblas");
            true
        }
    }
}

/// Replaces the reference BLAS/LAPACK of the `mlx-cpu` install in `root` (a `pip install --target`
/// directory) by OpenBLAS. `scratch` is a private directory for the download and the stub's source.
/// On error `root` may be left half-changed: the caller discards it.
pub fn install(python: &str, root: &Path, scratch: &Path) -> Result<(), String> {
    let libs = root.join("mlx_cpu.libs");
    let libmlx = root.join("mlx/lib/libmlx.so");
    for name in [BLAS, LAPACK] {
        let file = libs.join(name);
        if !file.is_file() {
            return Err(format!("{} is missing (not the mlx-cpu wheel this was written for?)", file.display()));
        }
        if libs.join(format!("{name}.reference")).exists() {
            return Err(format!("{} already has a {name}.reference", libs.display()));
        }
    }
    let _ = fs::remove_dir_all(scratch);
    fs::create_dir_all(scratch).map_err(|e| format!("cannot create {}: {e}", scratch.display()))?;

    let wheel = download_wheel(python, scratch)?;
    extract(python, &wheel, &libs)?;
    for name in [BLAS, LAPACK] {
        let file = libs.join(name);
        fs::rename(&file, libs.join(format!("{name}.reference")))
            .map_err(|e| format!("cannot rename {}: {e}", file.display()))?;
    }
    build_stub(&libs, scratch)?;
    std::os::unix::fs::symlink(BLAS, libs.join(LAPACK))
        .map_err(|e| format!("cannot symlink {LAPACK} to {BLAS}: {e}"))?;
    verify(python, &libmlx, &libs.join(BLAS))?;
    let (name, version, _) = WHEEL;
    let note = format!(
        "mlx_cpu.libs/{BLAS} is a stub forwarding to OpenBLAS ({OPENBLAS}, from the PyPI wheel {name}=={version},\n\
         licence in LICENSE.{name}.txt); {LAPACK} is a symlink to it. The wheel's reference BLAS and LAPACK are\n\
         kept as *.reference. Written by rmlx-sys's build script; build with RMLX_BLAS=reference to use the\n\
         plain install instead.\n"
    );
    fs::write(root.join("RMLX-BLAS.txt"), note).map_err(|e| format!("cannot write RMLX-BLAS.txt: {e}"))?;
    let _ = fs::remove_dir_all(scratch);
    Ok(())
}

/// `pip download`s the pinned wheel (hash-checked) into `dir` and returns its path.
fn download_wheel(python: &str, dir: &Path) -> Result<std::path::PathBuf, String> {
    let (name, version, sha256) = WHEEL;
    let requirements = dir.join("requirements.txt");
    fs::write(&requirements, format!("{name}=={version} --hash=sha256:{sha256}\n"))
        .map_err(|e| format!("cannot write {}: {e}", requirements.display()))?;
    run(
        Command::new(python)
            .args(["-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--retries", "2"])
            .args(["--no-deps", "--only-binary=:all:", "--require-hashes", "-r"])
            .arg(&requirements)
            .arg("-d")
            .arg(dir),
        &format!("`{python} -m pip download {name}=={version}`"),
    )?;
    let prefix = format!("{}-{version}-", name.replace('-', "_"));
    fs::read_dir(dir)
        .map_err(|e| format!("cannot list {}: {e}", dir.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .find(|p| {
            let file = p.file_name().and_then(|f| f.to_str()).unwrap_or("");
            file.starts_with(&prefix) && file.ends_with(".whl")
        })
        .ok_or_else(|| format!("pip download left no {prefix}*.whl in {}", dir.display()))
}

/// Copies OpenBLAS and its licence out of the wheel (a zip) into `libs`.
fn extract(python: &str, wheel: &Path, libs: &Path) -> Result<(), String> {
    let (name, version, _) = WHEEL;
    let package = name.replace('-', "_");
    let script = "import sys, os, zipfile\n\
                  whl, libs, pkg, ver, lib, lic = sys.argv[1:]\n\
                  with zipfile.ZipFile(whl) as z:\n\
                  \x20   open(os.path.join(libs, lib), 'wb').write(z.read(pkg + '/lib/' + lib))\n\
                  \x20   open(os.path.join(libs, lic), 'wb').write(z.read(pkg + '-' + ver + '.dist-info/licenses/LICENSE.txt'))\n";
    run(
        Command::new(python).args(["-c", script]).arg(wheel).arg(libs).args([
            package.as_str(),
            version,
            OPENBLAS,
            &format!("LICENSE.{name}.txt"),
        ]),
        &format!("extracting {OPENBLAS} from {}", wheel.display()),
    )
}

/// Generates the forwarding stub's assembly and links it as `libs/BLAS` against OpenBLAS.
fn build_stub(libs: &Path, scratch: &Path) -> Result<(), String> {
    let mut asm = String::from(".text\n");
    for s in SYMBOLS {
        asm += &format!(".globl {s}\n.type {s},@function\n{s}:\n\tjmp scipy_{s}@PLT\n.size {s},.-{s}\n");
    }
    asm += ".section .note.GNU-stack,\"\",@progbits\n";
    let source = scratch.join("blas_stub.S");
    fs::write(&source, asm).map_err(|e| format!("cannot write {}: {e}", source.display()))?;

    let compiler = c_compiler();
    let (program, args) = compiler.split_first().ok_or("empty C compiler command")?;
    run(
        Command::new(program)
            .args(args)
            .args(["-shared", "-nostdlib", "-o"])
            .arg(libs.join(BLAS))
            .arg(&source)
            .arg("-L")
            .arg(libs)
            .arg(format!("-l:{OPENBLAS}"))
            .arg(format!("-Wl,-soname,{BLAS}"))
            .args(["-Wl,-rpath,$ORIGIN", "-Wl,--enable-new-dtags", "-Wl,--no-undefined"]),
        &format!("building the BLAS stub with `{}`", compiler.join(" ")),
    )
}

/// The C compiler command, the way the `cc` crate picks it for a native build: `CC_<target>`,
/// `TARGET_CC`, `CC`, else `cc`.
fn c_compiler() -> Vec<String> {
    let target = env::var("TARGET").unwrap_or_default();
    let names = [format!("CC_{target}"), format!("CC_{}", target.replace('-', "_")), "TARGET_CC".into(), "CC".into()];
    for name in &names {
        println!("cargo:rerun-if-env-changed={name}");
    }
    names
        .iter()
        .find_map(|name| env::var(name).ok().filter(|v| !v.trim().is_empty()))
        .unwrap_or_else(|| "cc".into())
        .split_whitespace()
        .map(String::from)
        .collect()
}

/// Loads `libmlx` with every symbol bound now and multiplies two 2×2 matrices through the stub.
fn verify(python: &str, libmlx: &Path, stub: &Path) -> Result<(), String> {
    let script = "import ctypes, os, sys\n\
                  ctypes.CDLL(sys.argv[1], mode=os.RTLD_NOW)\n\
                  blas = ctypes.CDLL(sys.argv[2], mode=os.RTLD_NOW)\n\
                  F = ctypes.c_float * 4\n\
                  a, b, c = F(1, 2, 3, 4), F(5, 6, 7, 8), F()\n\
                  i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p\n\
                  blas.cblas_sgemm.restype = None\n\
                  blas.cblas_sgemm.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]\n\
                  blas.cblas_sgemm(101, 111, 111, 2, 2, 2, 1.0, a, 2, b, 2, 0.0, c, 2)\n\
                  assert list(c) == [19, 22, 43, 50], list(c)\n";
    run(
        Command::new(python).args(["-c", script]).arg(libmlx).arg(stub).env("OPENBLAS_NUM_THREADS", "1"),
        &format!("loading {} with OpenBLAS and calling cblas_sgemm", libmlx.display()),
    )
}

/// Runs `command`; on failure says `what` failed, with its exit status and the end of its stderr
/// (a build script's own output is shown only when the build fails, and this failure does not fail it).
fn run(command: &mut Command, what: &str) -> Result<(), String> {
    let output = command.output().map_err(|e| format!("{what}: cannot run it: {e}"))?;
    if output.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<&str> = stderr.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    let tail = lines[lines.len().saturating_sub(2)..].join(" | ");
    Err(format!(
        "{what} failed ({}){}",
        output.status,
        if tail.is_empty() { String::new() } else { format!(": {tail}") }
    ))
}
