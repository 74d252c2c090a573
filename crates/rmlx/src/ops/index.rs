//! Indexing: Python-style slicing ([`Idx`], [`idx!`](crate::idx)), dynamic slices, slice updates,
//! take/gather and scatter.

use super::{axis_parts, wrap};
use crate::array::array_vec;
use crate::device::current;
use crate::{Array, Error, Result};
use rmlx_sys::ffi;
use std::ops::{Range, RangeFrom, RangeFull, RangeInclusive, RangeTo};

/// One entry of a Python-style index: `a[2]`, `a[1:5:2]`, `a[::-1]`, `a[None]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Idx {
    /// A single position (removes the axis); negative counts from the end.
    At(i32),
    /// `start:stop:step` with Python's defaults and clamping; `step` may be negative, not 0.
    Slice { start: Option<i32>, stop: Option<i32>, step: i32 },
    /// Inserts a size-1 axis (`None` / `np.newaxis`).
    NewAxis,
}

impl Idx {
    /// `start:stop:step`.
    pub fn step(start: Option<i32>, stop: Option<i32>, step: i32) -> Idx {
        Idx::Slice { start, stop, step }
    }
}

impl From<i32> for Idx {
    fn from(i: i32) -> Idx {
        Idx::At(i)
    }
}
impl From<RangeFull> for Idx {
    fn from(_: RangeFull) -> Idx {
        Idx::Slice { start: None, stop: None, step: 1 }
    }
}
impl From<Range<i32>> for Idx {
    fn from(r: Range<i32>) -> Idx {
        Idx::Slice { start: Some(r.start), stop: Some(r.end), step: 1 }
    }
}
impl From<RangeFrom<i32>> for Idx {
    fn from(r: RangeFrom<i32>) -> Idx {
        Idx::Slice { start: Some(r.start), stop: None, step: 1 }
    }
}
impl From<RangeTo<i32>> for Idx {
    fn from(r: RangeTo<i32>) -> Idx {
        Idx::Slice { start: None, stop: Some(r.end), step: 1 }
    }
}
impl From<RangeInclusive<i32>> for Idx {
    fn from(r: RangeInclusive<i32>) -> Idx {
        Idx::Slice { start: Some(*r.start()), stop: Some(*r.end() + 1), step: 1 }
    }
}

/// Builds a `[Idx]` from Rust ranges and integers: `idx![.., 1..3, -1]`.
///
/// ```
/// use rmlx::{idx, Array};
/// let a = rmlx::ops::arange(0.0, 12.0, 1.0, rmlx::Dtype::Int32)?.reshape(&[3, 4])?;
/// assert_eq!(a.index(idx![1.., -1])?.to_vec::<i32>()?, vec![7, 11]);
/// assert_eq!(a.index(idx![0, rmlx::ops::Idx::step(None, None, -2)])?.to_vec::<i32>()?, vec![3, 1]);
/// # Ok::<(), rmlx::Error>(())
/// ```
#[macro_export]
macro_rules! idx {
    ($($e:expr),* $(,)?) => { &[$($crate::ops::Idx::from($e)),*][..] };
}

/// Python's `slice.indices(n)`: the normalised start, the count and the step.
fn resolve(start: Option<i32>, stop: Option<i32>, step: i32, n: i32) -> (i32, i32) {
    let norm = |v: i32, lo: i32, hi: i32| {
        let v = if v < 0 { v + n } else { v };
        v.clamp(lo, hi)
    };
    let (s, e) = if step > 0 {
        (start.map_or(0, |v| norm(v, 0, n)), stop.map_or(n, |v| norm(v, 0, n)))
    } else {
        (start.map_or(n - 1, |v| norm(v, -1, n - 1)), stop.map_or(-1, |v| norm(v, -1, n - 1)))
    };
    let count = if step > 0 { (e - s + step - 1).div_euclid(step) } else { (s - e - step - 1).div_euclid(-step) };
    (s, count.max(0))
}

/// Applies a Python-style index. Missing trailing entries select whole axes.
pub fn index(a: &Array, spec: &[Idx]) -> Result<Array> {
    let consumed = spec.iter().filter(|i| !matches!(i, Idx::NewAxis)).count();
    if consumed > a.ndim() {
        return Err(Error::InvalidArgument(format!("{consumed} indices for an array of {} dimensions", a.ndim())));
    }
    let shape = a.shape().to_vec();
    let (mut start, mut stop, mut strides) = (Vec::new(), Vec::new(), Vec::new());
    let (mut reverse, mut drop_axes, mut out_shape) = (Vec::new(), Vec::new(), Vec::new());
    let mut axis = 0usize;
    for item in spec {
        match *item {
            Idx::NewAxis => out_shape.push(1),
            Idx::At(i) => {
                let n = shape[axis];
                let j = if i < 0 { i + n } else { i };
                if j < 0 || j >= n {
                    return Err(Error::InvalidArgument(format!("index {i} out of range for axis {axis} of size {n}")));
                }
                start.push(j);
                stop.push(j + 1);
                strides.push(1);
                drop_axes.push(axis);
                axis += 1;
            }
            Idx::Slice { start: s0, stop: e0, step } => {
                if step == 0 {
                    return Err(Error::InvalidArgument("slice step cannot be zero".into()));
                }
                let n = shape[axis];
                let (s, count) = resolve(s0, e0, step, n);
                if step > 0 || count == 0 {
                    start.push(if count == 0 { 0 } else { s });
                    stop.push(if count == 0 { 0 } else { s + step * (count - 1) + 1 });
                    strides.push(step.max(1));
                } else {
                    // Take the same elements in ascending order, then flip the axis.
                    let lo = s + step * (count - 1);
                    start.push(lo);
                    stop.push(s + 1);
                    strides.push(-step);
                    reverse.push(axis as i32);
                }
                out_shape.push(count);
                axis += 1;
            }
        }
    }
    for &n in &shape[axis..] {
        start.push(0);
        stop.push(n);
        strides.push(1);
        out_shape.push(n);
    }
    let mut out = slice(a, &start, &stop, &strides)?;
    if !reverse.is_empty() {
        out = super::flip(&out, &reverse)?;
    }
    if !drop_axes.is_empty() || out_shape.len() != shape.len() {
        out = out.reshape(&out_shape)?;
    }
    Ok(out)
}

/// `a[start[i]:stop[i]:strides[i]]` on every axis (positive strides).
pub fn slice(a: &Array, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
    wrap(|| ffi::slice(a.raw(), start, stop, strides, current()))
}

/// A slice whose start positions are an array (`start[i]` for `axes[i]`), so the same compiled graph
/// can read different positions; `sizes` gives the extent on every axis.
pub fn slice_dynamic(a: &Array, start: &Array, axes: &[i32], sizes: &[i32]) -> Result<Array> {
    wrap(|| ffi::slice_dynamic(a.raw(), start.raw(), axes, sizes, current()))
}

/// A copy of `src` with `src[start:stop:strides] = update`.
///
/// ```
/// use rmlx::{Array, Dtype};
/// let src = rmlx::ops::zeros(&[4], Dtype::Int32)?;
/// let up = Array::from_slice(&[7i32, 8], &[2])?;
/// let out = rmlx::ops::slice_update(&src, &up, &[1], &[3], &[1])?;
/// assert_eq!(out.to_vec::<i32>()?, vec![0, 7, 8, 0]);
/// # Ok::<(), rmlx::Error>(())
/// ```
pub fn slice_update(src: &Array, update: &Array, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
    wrap(|| ffi::slice_update(src.raw(), update.raw(), start, stop, strides, current()))
}

/// A copy of `src` with `update` written at positions `start` (an integer array) on `axes`; the
/// extent comes from `update`'s shape. The KV-cache write of a compiled decode step.
pub fn slice_update_dynamic(src: &Array, update: &Array, start: &Array, axes: &[i32]) -> Result<Array> {
    wrap(|| ffi::slice_update_dynamic(src.raw(), update.raw(), start.raw(), axes, current()))
}

/// Elements at `indices` along `axis` (`None`: of the flattened array).
pub fn take(a: &Array, indices: &Array, axis: Option<i32>) -> Result<Array> {
    let (ax, all) = axis_parts(axis);
    wrap(|| ffi::take(a.raw(), indices.raw(), ax, all, current()))
}

/// `out[.., i, ..] = a[.., indices[.., i, ..], ..]` along `axis`.
pub fn take_along_axis(a: &Array, indices: &Array, axis: Option<i32>) -> Result<Array> {
    let (ax, all) = axis_parts(axis);
    wrap(|| ffi::take_along_axis(a.raw(), indices.raw(), ax, all, current()))
}

/// A copy of `a` with `values` written at `indices` along `axis`.
pub fn put_along_axis(a: &Array, indices: &Array, values: &Array, axis: Option<i32>) -> Result<Array> {
    let (ax, all) = axis_parts(axis);
    wrap(|| ffi::put_along_axis(a.raw(), indices.raw(), values.raw(), ax, all, current()))
}

/// A copy of `a` with `values` added at `indices` along `axis`; repeated indices accumulate.
pub fn scatter_add_axis(a: &Array, indices: &Array, values: &Array, axis: i32) -> Result<Array> {
    wrap(|| ffi::scatter_add_axis(a.raw(), indices.raw(), values.raw(), axis, current()))
}

/// A copy of `a` with `updates` written at the positions given by one index array per axis in `axes`.
/// `updates` has shape `indices.shape + slice shape` (the slice covers the remaining extents).
pub fn scatter(a: &Array, indices: &[&Array], updates: &Array, axes: &[i32]) -> Result<Array> {
    wrap(|| ffi::scatter(a.raw(), &array_vec(indices.iter().copied()), updates.raw(), axes, false, current()))
}

/// Like [`scatter`] but adds; repeated indices accumulate.
pub fn scatter_add(a: &Array, indices: &[&Array], updates: &Array, axes: &[i32]) -> Result<Array> {
    wrap(|| ffi::scatter(a.raw(), &array_vec(indices.iter().copied()), updates.raw(), axes, true, current()))
}

/// Slices of shape `slice_sizes` starting at the positions given by one index array per axis.
pub fn gather(a: &Array, indices: &[&Array], axes: &[i32], slice_sizes: &[i32]) -> Result<Array> {
    wrap(|| ffi::gather(a.raw(), &array_vec(indices.iter().copied()), axes, slice_sizes, current()))
}

impl Array {
    /// Python-style indexing; see [`idx!`](crate::idx).
    pub fn index(&self, spec: &[Idx]) -> Result<Array> {
        index(self, spec)
    }
    /// `self[start:stop:step]` along one axis.
    pub fn slice_axis(&self, axis: i32, start: i32, stop: i32, step: i32) -> Result<Array> {
        let nd = self.ndim() as i32;
        let ax = if axis < 0 { axis + nd } else { axis };
        if ax < 0 || ax >= nd {
            return Err(Error::InvalidArgument(format!("axis {axis} out of range for {nd} dimensions")));
        }
        let mut spec = vec![Idx::from(..); ax as usize];
        spec.push(Idx::step(Some(start), Some(stop), step));
        index(self, &spec)
    }
    /// Elements at `indices` along `axis`.
    pub fn take(&self, indices: &Array, axis: Option<i32>) -> Result<Array> {
        take(self, indices, axis)
    }
}
