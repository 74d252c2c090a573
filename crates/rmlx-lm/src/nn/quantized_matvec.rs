//! The choice between rmlx's CUDA matrix-vector kernel and MLX's quantised product for decoding.

use crate::{Error, Result};

/// Which matrix-vector product decoding (1–8 rows) takes for a quantised weight on MLX's CUDA
/// backend: rmlx's kernel (`nn::cuda_qmv`, for 4- and 8-bit affine weights) reads weights faster
/// than MLX's `quantized_matmul`; the size rule of [`QuantizedMatvec::Large`] dates from when the
/// kernel went through MLX's custom-kernel path, which cost a few µs more of host time a node than
/// MLX's own product (small matrices did not earn it back). Except under
/// [`QuantizedMatvec::Mlx`], the decoder blocks' products of every size and type (dense ones
/// too) take the kernel's fused forms (`nn::fused`: a norm, a residual or a gated activation
/// folded in), which replace several of MLX's operations each. The choice changes the
/// rounding of sums, not what is computed (float32 decoding of random-weight Qwen3-8B and
/// Llama-3.2-1B 4-bit checkpoints gave the same 128 greedy ids either way; BENCHMARKS.md).
///
/// ```
/// use rmlx_lm::nn::QuantizedMatvec;
/// let large: QuantizedMatvec = "large".parse()?;
/// assert_eq!(large, QuantizedMatvec::default());
/// assert!(large.takes_kernel(16 << 20) && !large.takes_kernel((16 << 20) - 1));
/// assert!(QuantizedMatvec::Rmlx.takes_kernel(1) && !QuantizedMatvec::Mlx.takes_kernel(1 << 30));
/// assert!(matches!("fast".parse::<QuantizedMatvec>(), Err(rmlx_lm::Error::InvalidParameter(_))));
/// # Ok::<(), rmlx_lm::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QuantizedMatvec {
    /// rmlx's kernel for weights of at least [`QuantizedMatvec::LARGE_BYTES`], MLX's product for
    /// smaller ones.
    #[default]
    Large,
    /// rmlx's kernel wherever it serves.
    Rmlx,
    /// MLX's products everywhere, and none of the fused forms.
    Mlx,
}

impl QuantizedMatvec {
    /// The packed size from which [`QuantizedMatvec::Large`] takes rmlx's kernel (16 MiB: an 8B
    /// model's MLP matrices and head, a 1B model's head).
    pub const LARGE_BYTES: usize = 16 << 20;

    /// Whether a quantised weight of `bytes` packed bytes takes rmlx's kernel.
    pub fn takes_kernel(self, bytes: usize) -> bool {
        match self {
            QuantizedMatvec::Large => bytes >= Self::LARGE_BYTES,
            QuantizedMatvec::Rmlx => true,
            QuantizedMatvec::Mlx => false,
        }
    }
}

impl std::str::FromStr for QuantizedMatvec {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "large" => Ok(QuantizedMatvec::Large),
            "rmlx" => Ok(QuantizedMatvec::Rmlx),
            "mlx" => Ok(QuantizedMatvec::Mlx),
            other => Err(Error::InvalidParameter(format!(
                "unknown quantised matvec choice `{other}` (expected large, rmlx or mlx)"
            ))),
        }
    }
}
