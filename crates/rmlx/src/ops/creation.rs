//! Arrays made from shapes and ranges: zeros, ones, full, arange, linspace, eye, tri.

use super::wrap;
use crate::device::current;
use crate::{Array, Dtype, Result};
use rmlx_sys::ffi;

/// The dtype that `a` and `b` promote to in a binary op (NumPy-like promotion, e.g. int32 with
/// float16 gives float16).
pub fn result_type(a: &Array, b: &Array) -> Result<Dtype> {
    Ok(Dtype::from_code(ffi::result_type(a.raw(), b.raw())))
}

/// An array of zeros.
///
/// ```
/// let z = rmlx::ops::zeros(&[2, 3], rmlx::Dtype::Float32)?;
/// assert_eq!(z.to_vec::<f32>()?, vec![0.0; 6]);
/// # Ok::<(), rmlx::Error>(())
/// ```
pub fn zeros(shape: &[i32], dtype: Dtype) -> Result<Array> {
    wrap(|| ffi::zeros(shape, dtype as u8, current()))
}

/// An array of ones.
pub fn ones(shape: &[i32], dtype: Dtype) -> Result<Array> {
    wrap(|| ffi::ones(shape, dtype as u8, current()))
}

/// An array filled with `value` (a scalar or any array broadcastable to `shape`), cast to `dtype`.
pub fn full(shape: &[i32], value: &Array, dtype: Dtype) -> Result<Array> {
    wrap(|| ffi::full(shape, value.raw(), dtype as u8, current()))
}

/// Zeros with the shape and dtype of `a`.
pub fn zeros_like(a: &Array) -> Result<Array> {
    zeros(a.shape(), a.dtype())
}

/// Ones with the shape and dtype of `a`.
pub fn ones_like(a: &Array) -> Result<Array> {
    ones(a.shape(), a.dtype())
}

/// `value` with the shape and dtype of `a`.
pub fn full_like(a: &Array, value: f64) -> Result<Array> {
    full(a.shape(), &Array::scalar_as(value, a.dtype())?, a.dtype())
}

/// Values from `start` (inclusive) to `stop` (exclusive) in steps of `step`.
///
/// ```
/// let r = rmlx::ops::arange(0.0, 5.0, 2.0, rmlx::Dtype::Int32)?;
/// assert_eq!(r.to_vec::<i32>()?, vec![0, 2, 4]);
/// # Ok::<(), rmlx::Error>(())
/// ```
pub fn arange(start: f64, stop: f64, step: f64, dtype: Dtype) -> Result<Array> {
    wrap(|| ffi::arange(start, stop, step, dtype as u8, current()))
}

/// `num` evenly spaced values from `start` to `stop`, both included.
pub fn linspace(start: f64, stop: f64, num: i32, dtype: Dtype) -> Result<Array> {
    wrap(|| ffi::linspace(start, stop, num, dtype as u8, current()))
}

/// An `n × m` matrix with ones on diagonal `k` (0 main, > 0 above, < 0 below).
pub fn eye(n: i32, m: i32, k: i32, dtype: Dtype) -> Result<Array> {
    wrap(|| ffi::eye(n, m, k, dtype as u8, current()))
}

/// The `n × n` identity matrix.
pub fn identity(n: i32, dtype: Dtype) -> Result<Array> {
    eye(n, n, 0, dtype)
}

/// An `n × m` matrix with ones at and below diagonal `k`.
pub fn tri(n: i32, m: i32, k: i32, dtype: Dtype) -> Result<Array> {
    wrap(|| ffi::tri(n, m, k, dtype as u8, current()))
}
