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

/// Matrix products with gathered operands (mixture-of-experts): the product for batch position `i`
/// multiplies matrix `a[lhs_indices[i]]` by matrix `b[rhs_indices[i]]` (over `a`'s and `b`'s batch
/// axes; a missing index array means "in order"). `sorted_indices` promises `rhs_indices` sorted,
/// which lets MLX run one product per expert.
///
/// ```
/// use rmlx::{ops, Array};
/// // Two experts (2×2 each): the first doubles, the second swaps.
/// let experts = Array::from_slice(&[2.0f32, 0.0, 0.0, 2.0, 0.0, 1.0, 1.0, 0.0], &[2, 2, 2])?;
/// let x = Array::from_slice(&[1.0f32, 3.0, 1.0, 3.0], &[2, 1, 2])?;
/// let which = Array::from_slice(&[1u32, 0], &[2])?;
/// let y = ops::gather_mm(&x, &experts, None, Some(&which), false)?;
/// assert_eq!(y.shape(), [2, 1, 2]);
/// assert_eq!(y.to_vec::<f32>()?, [3.0, 1.0, 2.0, 6.0]);
/// # Ok::<(), rmlx::Error>(())
/// ```
pub fn gather_mm(
    a: &Array,
    b: &Array,
    lhs_indices: Option<&Array>,
    rhs_indices: Option<&Array>,
    sorted_indices: bool,
) -> Result<Array> {
    wrap(|| unsafe {
        ffi::gather_mm(a.raw(), b.raw(), Array::ptr(lhs_indices), Array::ptr(rhs_indices), sorted_indices, current())
    })
}

/// Einstein summation, e.g. `einsum("ij,jk->ik", &[&a, &b])`.
pub fn einsum(subscripts: &str, operands: &[&Array]) -> Result<Array> {
    wrap(|| ffi::einsum(subscripts, &array_vec(operands.iter().copied()), current()))
}

/// Sums products over `axes_a` of `a` and `axes_b` of `b`.
pub fn tensordot(a: &Array, b: &Array, axes_a: &[i32], axes_b: &[i32]) -> Result<Array> {
    wrap(|| ffi::tensordot(a.raw(), b.raw(), axes_a, axes_b, current()))
}
