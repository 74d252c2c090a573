//! MLX's fused kernels: RMSNorm, LayerNorm, RoPE and scaled dot-product attention; and GPU
//! kernels of your own from source ([`cuda_kernel`], [`metal_kernel`]).

use crate::device::current;
use crate::ops::wrap;
use crate::{Array, Result};
use rmlx_sys::ffi;

pub use crate::kernel::{
    cuda_kernel, gpu_backend, metal_kernel, CustomKernel, GpuBackend, KernelLaunch, PreparedKernel, TemplateArg,
    TensorSpec,
};

/// `x / sqrt(mean(x², -1) + eps) * weight` over the last axis.
pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    // SAFETY (all `unsafe` blocks here): optional arrays are passed as live pointers or null.
    wrap(|| unsafe { ffi::rms_norm(x.raw(), Array::ptr(weight), eps, current()) })
}

/// `(x - mean) / sqrt(var + eps) * weight + bias` over the last axis.
pub fn layer_norm(x: &Array, weight: Option<&Array>, bias: Option<&Array>, eps: f32) -> Result<Array> {
    wrap(|| unsafe { ffi::layer_norm(x.raw(), Array::ptr(weight), Array::ptr(bias), eps, current()) })
}

/// The position offset of [`rope`]: a constant, or an array (a scalar, or one offset per batch row)
/// so that a compiled step can take the position as an input.
#[derive(Clone, Copy, Debug)]
pub enum RopeOffset<'a> {
    Fixed(i32),
    Array(&'a Array),
}

impl From<i32> for RopeOffset<'_> {
    fn from(v: i32) -> Self {
        RopeOffset::Fixed(v)
    }
}

impl<'a> From<&'a Array> for RopeOffset<'a> {
    fn from(a: &'a Array) -> Self {
        RopeOffset::Array(a)
    }
}

/// Where RoPE's frequencies come from.
#[derive(Clone, Copy, Debug)]
pub enum RopeFreqs<'a> {
    /// `base^(-2i/dims)`, scaled by nothing else.
    Base(f32),
    /// One value per rotated pair (`dims / 2` of them): the divisor of the position, i.e.
    /// `base^(2i/dims)` for plain RoPE. Used for scaled variants such as Llama 3's.
    Explicit(&'a Array),
}

/// Rotary position embedding on the first `dims` features of the last axis of `x`
/// (shape `[..., seq, features]`); positions are `offset + 0..seq`, multiplied by `scale`.
/// `traditional` rotates adjacent pairs `(2i, 2i+1)`; otherwise the halves `(i, i + dims/2)`.
pub fn rope<'a>(
    x: &Array,
    dims: i32,
    traditional: bool,
    freqs: RopeFreqs<'_>,
    scale: f32,
    offset: impl Into<RopeOffset<'a>>,
) -> Result<Array> {
    let (base, has_base, freqs) = match freqs {
        RopeFreqs::Base(b) => (b, true, None),
        RopeFreqs::Explicit(f) => (0.0, false, Some(f)),
    };
    let (off, off_arr) = match offset.into() {
        RopeOffset::Fixed(v) => (v, None),
        RopeOffset::Array(a) => (0, Some(a)),
    };
    wrap(|| unsafe {
        ffi::rope(
            x.raw(),
            dims,
            traditional,
            base,
            has_base,
            scale,
            off,
            Array::ptr(off_arr),
            Array::ptr(freqs),
            current(),
        )
    })
}

/// The mask of [`scaled_dot_product_attention`].
#[derive(Clone, Copy, Debug)]
pub enum AttentionMask<'a> {
    None,
    /// Query `i` sees keys `0..=i + (keys - queries)`.
    Causal,
    /// Added to the scores (float), or selecting visible keys (bool); broadcast to
    /// `[batch, heads, queries, keys]`.
    Array(&'a Array),
}

/// `softmax(q kᵀ · scale + mask) v` for `q: [B, Hq, L, D]`, `k, v: [B, Hkv, S, D]`.
/// Grouped-query attention: `Hq` must be a multiple of `Hkv`.
pub fn scaled_dot_product_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: AttentionMask<'_>,
) -> Result<Array> {
    attention(q, k, v, scale, mask, None)
}

/// [`scaled_dot_product_attention`] with a learned logit per query head (`sinks: [Hq]`) joining
/// each softmax's sum and attending to nothing (gpt-oss): its weight is taken from the keys'.
///
/// ```
/// use rmlx::fast::{scaled_dot_product_attention_with_sinks, AttentionMask};
/// use rmlx::Array;
/// // One head, one query, one key: softmax over (0, ln 3) gives the key a quarter.
/// let q = Array::from_slice(&[1.0f32], &[1, 1, 1, 1])?;
/// let k = Array::from_slice(&[0.0f32], &[1, 1, 1, 1])?;
/// let v = Array::from_slice(&[8.0f32], &[1, 1, 1, 1])?;
/// let sinks = Array::from_slice(&[3f32.ln()], &[1])?;
/// let o = scaled_dot_product_attention_with_sinks(&q, &k, &v, 1.0, AttentionMask::None, &sinks)?;
/// assert!((o.item::<f32>()? - 2.0).abs() < 1e-5);
/// # Ok::<(), rmlx::Error>(())
/// ```
pub fn scaled_dot_product_attention_with_sinks(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: AttentionMask<'_>,
    sinks: &Array,
) -> Result<Array> {
    attention(q, k, v, scale, mask, Some(sinks))
}

fn attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: AttentionMask<'_>,
    sinks: Option<&Array>,
) -> Result<Array> {
    let (mode, arr) = match mask {
        AttentionMask::None => ("", None),
        AttentionMask::Causal => ("causal", None),
        AttentionMask::Array(a) => ("array", Some(a)),
    };
    wrap(|| unsafe {
        ffi::scaled_dot_product_attention(
            q.raw(),
            k.raw(),
            v.raw(),
            scale,
            mode,
            Array::ptr(arr),
            Array::ptr(sinks),
            current(),
        )
    })
}
