//! How many operations MLX's CUDA backend records into one CUDA graph before it launches it.
//!
//! MLX keeps every buffer an operation reads alive until the graph holding the operation has run,
//! so the size of a graph bounds how long a prompt's intermediate activations outlive their last
//! use. MLX's default on an H100 is 100 operations a graph. rmlx takes 12: on an H200, a 1,024-token
//! prompt's peak memory falls from 1.139 to 0.755 GB on qwen3-0.6b 4-bit, from 1.78–1.85 to 1.365
//! GB on llama3.2-1b 4-bit and from 6.72 to 5.62 GB on qwen3-8b 4-bit against 30 operations a
//! graph, with prefill within 1–2 % and decoding unchanged (a decoding step's layers replay as one
//! operation); at 512 tokens the two small 4-bit models peak at 0.546 and 1.03 GB, under mlx-lm's
//! 0.636 and 1.171 (BENCHMARKS.md, "Smaller CUDA graphs"). rmlx therefore sets MLX's
//! `MLX_MAX_OPS_PER_BUFFER` to [`CUDA_GRAPH_OPS`] before its first call into MLX, on MLX's CUDA
//! build only, unless the variable is already set (a value of the user's stays in force) or the
//! program called [`keep_mlx_cuda_graph_ops`] first.
//!
//! ```
//! // `None` without MLX's CUDA backend (the CPU and Metal builds).
//! if let Some(n) = rmlx::cuda_graph_ops() {
//!     assert!(n >= 1);
//! }
//! ```

use crate::kernel::GpuBackend;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;

/// The operations a CUDA graph holds that rmlx chooses when the user has not.
pub const CUDA_GRAPH_OPS: usize = 12;

/// MLX's variable for the operations a CUDA graph (a Metal command buffer) holds.
const VARIABLE: &str = "MLX_MAX_OPS_PER_BUFFER";

/// The operations a CUDA graph holds in this process as set by the variable (the user's
/// `MLX_MAX_OPS_PER_BUFFER`, else [`CUDA_GRAPH_OPS`]), or `None` without MLX's CUDA backend, or
/// when the variable is unset (MLX's default is in force) or not a positive number.
pub fn cuda_graph_ops() -> Option<usize> {
    configure_once();
    if crate::kernel::gpu_backend() != Some(GpuBackend::Cuda) {
        return None;
    }
    std::env::var(VARIABLE).ok()?.trim().parse().ok().filter(|&n| n > 0)
}

static KEEP_MLX_DEFAULT: AtomicBool = AtomicBool::new(false);

/// Leaves MLX's own graph size (its per-GPU default, or the user's variable) in force: call it
/// before the first call into MLX. `rmlx lora` does, since training steps were measured with it.
pub fn keep_mlx_cuda_graph_ops() {
    KEEP_MLX_DEFAULT.store(true, Ordering::Relaxed);
}

/// The value to set, given the variable's current value: none when the user chose one.
fn chosen(current: Option<&str>) -> Option<String> {
    match current {
        Some(v) if !v.trim().is_empty() => None,
        _ => Some(CUDA_GRAPH_OPS.to_string()),
    }
}

/// Whether rmlx chooses the graph size: on MLX's CUDA build, unless the program keeps MLX's.
fn applies(backend: Option<GpuBackend>, keep_mlx_default: bool) -> bool {
    backend == Some(GpuBackend::Cuda) && !keep_mlx_default
}

/// Applies [`chosen`] once per process, on MLX's CUDA build (called before the first call into
/// MLX, before MLX creates its CUDA streams and reads the variable).
pub(crate) fn configure_once() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if !applies(crate::kernel::gpu_backend(), KEEP_MLX_DEFAULT.load(Ordering::Relaxed)) {
            return;
        }
        if let Some(v) = chosen(std::env::var(VARIABLE).ok().as_deref()) {
            std::env::set_var(VARIABLE, v);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_users_value_stays() {
        assert_eq!(chosen(None), Some("12".to_string()));
        assert_eq!(chosen(Some("")), Some("12".to_string()));
        assert_eq!(chosen(Some("100")), None);
        assert_eq!(chosen(Some(" 7 ")), None);
    }

    #[test]
    fn only_the_cuda_build_is_configured() {
        assert!(applies(Some(GpuBackend::Cuda), false));
        assert!(!applies(Some(GpuBackend::Cuda), true), "the program keeps MLX's size");
        assert!(!applies(Some(GpuBackend::Metal), false));
        assert!(!applies(None, false));
        let cuda = crate::kernel::gpu_backend() == Some(GpuBackend::Cuda);
        let set = std::env::var(VARIABLE).ok();
        match cuda {
            true => assert!(cuda_graph_ops().is_some() && set.is_some()),
            false => assert_eq!(cuda_graph_ops(), None),
        }
    }
}
