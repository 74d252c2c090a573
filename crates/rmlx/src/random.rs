//! Random numbers from explicit keys (counter-based, reproducible) or MLX's global key.
//!
//! Every sampler takes `key: Option<&Array>`. With a key, the result depends on the key alone; with
//! `None`, MLX's global key (set by [`seed`]) is split and advanced.
//!
//! ```
//! use rmlx::{random, Dtype};
//! let k = random::key(42)?;
//! let a = random::uniform(0.0, 1.0, &[3], Dtype::Float32, Some(&k))?;
//! let b = random::uniform(0.0, 1.0, &[3], Dtype::Float32, Some(&k))?;
//! assert_eq!(a.to_vec::<f32>()?, b.to_vec::<f32>()?);
//! # Ok::<(), rmlx::Error>(())
//! ```

use crate::device::current;
use crate::ops::wrap;
use crate::{Array, Dtype, Result};
use rmlx_sys::ffi;

/// Seeds MLX's global generator.
pub fn seed(seed: u64) {
    crate::lock::locked(|| ffi::random_seed(seed))
}

/// A key for the explicit-key samplers.
pub fn key(seed: u64) -> Result<Array> {
    wrap(|| ffi::random_key(seed))
}

/// `num` independent keys derived from `key` (shape `[num, 2]`); index with `take` or `index`.
pub fn split(key: &Array, num: i32) -> Result<Array> {
    wrap(|| ffi::random_split(key.raw(), num, current()))
}

// SAFETY (all `unsafe` blocks below): the key is a live pointer or null, as the shim expects.

/// Uniform in `[low, high)`.
pub fn uniform(low: f32, high: f32, shape: &[i32], dtype: Dtype, key: Option<&Array>) -> Result<Array> {
    let (lo, hi) = (Array::scalar(low), Array::scalar(high));
    wrap(|| unsafe { ffi::random_uniform(lo.raw(), hi.raw(), shape, dtype as u8, Array::ptr(key), current()) })
}

/// Normal with mean `loc` and standard deviation `scale`.
pub fn normal(shape: &[i32], dtype: Dtype, loc: f32, scale: f32, key: Option<&Array>) -> Result<Array> {
    wrap(|| unsafe { ffi::random_normal(shape, dtype as u8, loc, scale, Array::ptr(key), current()) })
}

/// Standard normal truncated to `[lower, upper]`.
pub fn truncated_normal(lower: f32, upper: f32, shape: &[i32], dtype: Dtype, key: Option<&Array>) -> Result<Array> {
    let (lo, hi) = (Array::scalar(lower), Array::scalar(upper));
    wrap(|| unsafe { ffi::random_truncated_normal(lo.raw(), hi.raw(), shape, dtype as u8, Array::ptr(key), current()) })
}

/// Integers in `[low, high)`.
pub fn randint(low: i32, high: i32, shape: &[i32], dtype: Dtype, key: Option<&Array>) -> Result<Array> {
    let (lo, hi) = (Array::scalar(low), Array::scalar(high));
    wrap(|| unsafe { ffi::random_randint(lo.raw(), hi.raw(), shape, dtype as u8, Array::ptr(key), current()) })
}

/// `true` with probability `p` (an array broadcast to `shape`).
pub fn bernoulli(p: &Array, shape: &[i32], key: Option<&Array>) -> Result<Array> {
    wrap(|| unsafe { ffi::random_bernoulli(p.raw(), shape, Array::ptr(key), current()) })
}

/// Samples class indices from unnormalised log-probabilities `logits` along `axis`.
/// `num_samples = None` draws one sample per distribution (the axis is removed); `Some(n)` draws `n`
/// (the axis is replaced by one of size `n`).
pub fn categorical(logits: &Array, axis: i32, num_samples: Option<i32>, key: Option<&Array>) -> Result<Array> {
    let n = num_samples.unwrap_or(0);
    if num_samples.is_some_and(|n| n <= 0) {
        return Err(crate::Error::InvalidArgument("categorical: num_samples must be positive".into()));
    }
    wrap(|| unsafe { ffi::random_categorical(logits.raw(), axis, n, Array::ptr(key), current()) })
}

/// Standard Gumbel samples.
pub fn gumbel(shape: &[i32], dtype: Dtype, key: Option<&Array>) -> Result<Array> {
    wrap(|| unsafe { ffi::random_gumbel(shape, dtype as u8, Array::ptr(key), current()) })
}

/// A random permutation of `x` along `axis`.
pub fn permutation(x: &Array, axis: i32, key: Option<&Array>) -> Result<Array> {
    wrap(|| unsafe { ffi::random_permutation(x.raw(), axis, Array::ptr(key), current()) })
}

/// A random permutation of `0..n` (int32).
pub fn permutation_n(n: i32, key: Option<&Array>) -> Result<Array> {
    permutation(&crate::ops::arange(0.0, n as f64, 1.0, Dtype::Int32)?, 0, key)
}
