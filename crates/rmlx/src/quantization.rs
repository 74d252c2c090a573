//! Quantized weights: quantize, dequantize, quantized matmul and its gathered (MoE) form.
//!
//! Modes are MLX's: `affine` (scale and bias per group of `group_size` elements along the last axis,
//! 1–8 bits) and the floating-point micro-scaled formats `mxfp4`, `mxfp8`, `nvfp4`.

use crate::array::from_array_vec;
use crate::device::current;
use crate::ops::wrap;
use crate::{Array, Dtype, Error, Result};
use rmlx_sys::ffi;

/// A quantization format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QuantMode {
    /// `w ≈ scale · q + bias` per group; bits 1, 2, 3, 4, 5, 6 or 8; group size 32, 64 or 128.
    #[default]
    Affine,
    /// OCP MX FP4 (group 32, shared power-of-two scale).
    Mxfp4,
    /// OCP MX FP8 (group 32).
    Mxfp8,
    /// NVIDIA FP4 (group 16, FP8 scales).
    Nvfp4,
}

impl QuantMode {
    /// MLX's name of the mode (`affine`, `mxfp4`, `mxfp8`, `nvfp4`), as configs write it.
    pub fn name(self) -> &'static str {
        match self {
            QuantMode::Affine => "affine",
            QuantMode::Mxfp4 => "mxfp4",
            QuantMode::Mxfp8 => "mxfp8",
            QuantMode::Nvfp4 => "nvfp4",
        }
    }
}

/// A quantized matrix: packed `weight` (uint32), `scales`, and `biases` in affine mode.
#[derive(Clone, Debug)]
pub struct Quantized {
    pub weight: Array,
    pub scales: Array,
    pub biases: Option<Array>,
    pub group_size: i32,
    pub bits: i32,
    pub mode: QuantMode,
}

/// Quantizes `w` along its last axis.
///
/// ```
/// use rmlx::{quantization::{quantize, dequantize, QuantMode}, ops, Dtype};
/// let w = ops::linspace(-1.0, 1.0, 2 * 64, Dtype::Float32)?.reshape(&[2, 64])?;
/// let q = quantize(&w, 64, 8, QuantMode::Affine)?;
/// let back = dequantize(&q, None)?;
/// let err = (&back - &w)?.abs()?.max(rmlx::ops::Axes::All, false)?.item::<f32>()?;
/// assert!(err <= 2.0 / 255.0 / 2.0 + 1e-6);
/// # Ok::<(), rmlx::Error>(())
/// ```
pub fn quantize(w: &Array, group_size: i32, bits: i32, mode: QuantMode) -> Result<Quantized> {
    if bits <= 0 || group_size <= 0 {
        return Err(Error::InvalidArgument(format!(
            "quantize: bits ({bits}) and group_size ({group_size}) must be positive"
        )));
    }
    // SAFETY: no global scale (null).
    let parts = from_array_vec(&crate::lock::locked(|| unsafe {
        ffi::quantize(w.raw(), group_size, bits, mode.name(), std::ptr::null(), current())
    })?);
    let mut it = parts.into_iter();
    let (Some(weight), Some(scales)) = (it.next(), it.next()) else {
        return Err(Error::Mlx("quantize returned fewer than two arrays".into()));
    };
    Ok(Quantized { weight, scales, biases: it.next(), group_size, bits, mode })
}

/// The dense matrix that `q` represents, in `dtype` (default: the scales' dtype).
pub fn dequantize(q: &Quantized, dtype: Option<Dtype>) -> Result<Array> {
    let code = dtype.map_or(-1, |d| d as i32);
    // SAFETY: optional arrays are live pointers or null.
    wrap(|| unsafe {
        ffi::dequantize(
            q.weight.raw(),
            q.scales.raw(),
            Array::ptr(q.biases.as_ref()),
            q.group_size,
            q.bits,
            q.mode.name(),
            std::ptr::null(),
            code,
            current(),
        )
    })
}

/// `x @ wᵀ` (`transpose = true`, the layout of linear layers) or `x @ w` with a quantized `w`.
pub fn quantized_matmul(x: &Array, q: &Quantized, transpose: bool) -> Result<Array> {
    wrap(|| unsafe {
        ffi::quantized_matmul(
            x.raw(),
            q.weight.raw(),
            q.scales.raw(),
            Array::ptr(q.biases.as_ref()),
            transpose,
            q.group_size,
            q.bits,
            q.mode.name(),
            current(),
        )
    })
}

/// Quantized matmul with gathered operands (mixture-of-experts): row `i` of the output multiplies
/// `x[lhs_indices[i]]` by expert `w[rhs_indices[i]]`. Missing indices mean "in order".
pub fn gather_qmm(
    x: &Array,
    q: &Quantized,
    lhs_indices: Option<&Array>,
    rhs_indices: Option<&Array>,
    transpose: bool,
    sorted_indices: bool,
) -> Result<Array> {
    wrap(|| unsafe {
        ffi::gather_qmm(
            x.raw(),
            q.weight.raw(),
            q.scales.raw(),
            Array::ptr(q.biases.as_ref()),
            Array::ptr(lhs_indices),
            Array::ptr(rhs_indices),
            transpose,
            q.group_size,
            q.bits,
            q.mode.name(),
            sorted_indices,
            current(),
        )
    })
}
