//! Where rmlx keeps files per user (downloads, the mlx-lm installation, the bridge script): the
//! rule rmlx-sys's build script follows for the MLX distribution, so that everything lands together.

use std::path::PathBuf;

/// Per-user cache root: `$RMLX_CACHE_DIR`, else `$XDG_CACHE_HOME/rmlx`, else `~/.cache/rmlx`
/// (`~/Library/Caches/rmlx` on macOS); the same rule as rmlx-sys's build script, which keeps the
/// MLX distribution there. Falls back to `./.rmlx-cache` when not even `HOME` is set.
pub fn cache_dir() -> PathBuf {
    let var = |name| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    cache_dir_from(var("RMLX_CACHE_DIR"), var("XDG_CACHE_HOME"), var("HOME"))
}

/// [`cache_dir`]'s rule applied to given values of `RMLX_CACHE_DIR`, `XDG_CACHE_HOME` and `HOME`.
pub fn cache_dir_from(
    rmlx_cache_dir: Option<PathBuf>,
    xdg_cache_home: Option<PathBuf>,
    home: Option<PathBuf>,
) -> PathBuf {
    if let Some(dir) = rmlx_cache_dir {
        return dir;
    }
    if let Some(dir) = xdg_cache_home {
        return dir.join("rmlx");
    }
    match home {
        Some(home) if cfg!(target_os = "macos") => home.join("Library/Caches/rmlx"),
        Some(home) => home.join(".cache/rmlx"),
        None => PathBuf::from(".rmlx-cache"),
    }
}

/// The variable that names where MLX's CUDA backend keeps the kernels it compiles at run time.
const MLX_KERNEL_VARIABLE: &str = "MLX_PTX_CACHE_DIR";

/// Keeps the kernels MLX's CUDA backend compiles at run time in `mlx-kernels/<MLX version>` of
/// [`cache_dir`], where MLX would keep them in the system's temporary directory, which many
/// systems empty at boot. They are worth keeping: on an H200, MLX compiling the kernels a
/// qwen3-8b 4-bit model needs took 56 s of its first 320-token prompt, and 72 s more of a
/// server's first batch of 32 requests. Sets `MLX_PTX_CACHE_DIR` unless it is set already (or
/// MLX runs no CUDA), so call it before the GPU's first use, while no other thread runs: MLX
/// reads it once. Returns the directory it chose, logging (at info) when it is still empty.
pub fn persist_mlx_kernels() -> Option<PathBuf> {
    if rmlx::fast::gpu_backend() != Some(rmlx::fast::GpuBackend::Cuda)
        || std::env::var_os(MLX_KERNEL_VARIABLE).is_some()
    {
        return None;
    }
    let dir = cache_dir().join("mlx-kernels").join(rmlx::mlx_version());
    std::fs::create_dir_all(&dir).ok()?;
    if std::fs::read_dir(&dir).ok()?.next().is_none() {
        tracing::info!(
            "MLX compiles its CUDA kernels as they are first needed (a minute or more for a quantised \
             model, once per machine); they are kept in {}",
            dir.display()
        );
    }
    std::env::set_var(MLX_KERNEL_VARIABLE, &dir);
    Some(dir)
}
