//! Sorting, partitioning and top-k.

use super::{axis_parts, wrap};
use crate::device::current;
use crate::{Array, Result};
use rmlx_sys::ffi;

/// Sorted copy along `axis` (`None`: the flattened array), ascending.
pub fn sort(a: &Array, axis: Option<i32>) -> Result<Array> {
    let (ax, all) = axis_parts(axis);
    wrap(|| ffi::sort(a.raw(), ax, all, current()))
}

/// Indices that sort `a` along `axis`, ascending.
pub fn argsort(a: &Array, axis: Option<i32>) -> Result<Array> {
    let (ax, all) = axis_parts(axis);
    wrap(|| ffi::argsort(a.raw(), ax, all, current()))
}

/// Reorders along `axis` so that element `kth` is where a sort would put it, smaller elements before
/// it and larger ones after (in no particular order).
pub fn partition(a: &Array, kth: i32, axis: Option<i32>) -> Result<Array> {
    let (ax, all) = axis_parts(axis);
    wrap(|| ffi::partition(a.raw(), kth, ax, all, current()))
}

/// Indices that partition `a` around `kth` along `axis` (see [`partition`]).
pub fn argpartition(a: &Array, kth: i32, axis: Option<i32>) -> Result<Array> {
    let (ax, all) = axis_parts(axis);
    wrap(|| ffi::argpartition(a.raw(), kth, ax, all, current()))
}

/// The `k` largest values along `axis`, in no particular order.
pub fn topk(a: &Array, k: i32, axis: Option<i32>) -> Result<Array> {
    let (ax, all) = axis_parts(axis);
    wrap(|| ffi::topk(a.raw(), k, ax, all, current()))
}
