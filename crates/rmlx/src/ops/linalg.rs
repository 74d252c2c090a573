//! Matrix products beyond `matmul`: addmm, einsum, tensordot.

use super::wrap;
use crate::array::array_vec;
use crate::device::current;
use crate::{Array, Result};
use rmlx_sys::ffi;

/// `alpha * (a @ b) + beta * c`, fused.
pub fn addmm(c: &Array, a: &Array, b: &Array, alpha: f32, beta: f32) -> Result<Array> {
    wrap(|| ffi::addmm(c.raw(), a.raw(), b.raw(), alpha, beta, current()))
}

/// Einstein summation, e.g. `einsum("ij,jk->ik", &[&a, &b])`.
pub fn einsum(subscripts: &str, operands: &[&Array]) -> Result<Array> {
    wrap(|| ffi::einsum(subscripts, &array_vec(operands.iter().copied()), current()))
}

/// Sums products over `axes_a` of `a` and `axes_b` of `b`.
pub fn tensordot(a: &Array, b: &Array, axes_a: &[i32], axes_b: &[i32]) -> Result<Array> {
    wrap(|| ffi::tensordot(a.raw(), b.raw(), axes_a, axes_b, current()))
}
