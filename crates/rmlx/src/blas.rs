//! The thread count of the CPU BLAS under MLX's float32 matmuls (OpenBLAS, which rmlx-sys installs
//! under `mlx-cpu` on x86-64 Linux).
//!
//! OpenBLAS sizes its thread pool from the processors it can see, which ignores CPU quotas: in a
//! container limited to 2 CPUs of a 64-core host it starts 64 threads, and its idle threads spin
//! after every call, so oversubscription costs far more than the threads bring. rmlx therefore sets
//! the count once, at its first call into MLX, to the cores this process may use
//! ([`std::thread::available_parallelism`]: affinity mask and cgroup quota), unless the user chose:
//! `RMLX_BLAS_THREADS=N` sets it, and `OPENBLAS_NUM_THREADS` / `OMP_NUM_THREADS` (read by OpenBLAS
//! itself) are left in force. Several rmlx processes sharing the same cores should each get a share
//! (`RMLX_BLAS_THREADS=1` for two processes on two cores; see BENCHMARKS.md).
//!
//! ```
//! // `None` where MLX does not run on OpenBLAS (the CUDA or Metal build, or the reference BLAS).
//! if let Some(n) = rmlx::blas_threads() {
//!     assert!(n >= 1);
//! }
//! ```

use std::sync::Once;

/// OpenBLAS's thread count, or `None` when MLX does not run on OpenBLAS in this process.
pub fn blas_threads() -> Option<usize> {
    configure_once();
    positive(rmlx_sys::ffi::blas_threads(0))
}

/// Sets OpenBLAS's thread count (at least 1); returns the count now in force, or `None` when MLX
/// does not run on OpenBLAS in this process.
pub fn set_blas_threads(threads: usize) -> Option<usize> {
    configure_once();
    positive(rmlx_sys::ffi::blas_threads(threads.clamp(1, i32::MAX as usize) as i32))
}

fn positive(n: i32) -> Option<usize> {
    (n > 0).then_some(n as usize)
}

/// The thread count rmlx chooses when nobody else has: `RMLX_BLAS_THREADS` if it is a positive
/// number, nothing if OpenBLAS's own variables are set, else the cores available to the process.
fn chosen() -> Option<usize> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    if let Some(v) = var("RMLX_BLAS_THREADS") {
        match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => return Some(n),
            _ => eprintln!("rmlx: ignoring RMLX_BLAS_THREADS={v:?} (not a positive number)"),
        }
    }
    if var("OPENBLAS_NUM_THREADS").is_some() || var("OMP_NUM_THREADS").is_some() {
        return None;
    }
    std::thread::available_parallelism().ok().map(usize::from)
}

/// Applies [`chosen`] once per process (called before the first call into MLX).
pub(crate) fn configure_once() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if let Some(n) = chosen() {
            rmlx_sys::ffi::blas_threads(n.min(i32::MAX as usize) as i32);
        }
    });
}
