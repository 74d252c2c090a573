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
