//! Shape manipulation: reshape, transpose, broadcast, concatenate/stack/split, pad, repeat, tile,
//! strided views, triangles.

use super::{axis_parts, wrap, Axes};
use crate::array::{array_vec, from_array_vec};
use crate::device::current;
use crate::{Array, Error, Result};
use rmlx_sys::ffi;

/// Same data in a new shape; one dimension may be `-1` (inferred).
///
/// ```
/// let a = rmlx::ops::arange(0.0, 6.0, 1.0, rmlx::Dtype::Int32)?;
/// assert_eq!(a.reshape(&[2, -1])?.shape(), &[2, 3]);
/// assert!(a.reshape(&[4]).is_err()); // MLX's message says why
/// # Ok::<(), rmlx::Error>(())
/// ```
pub fn reshape(a: &Array, shape: &[i32]) -> Result<Array> {
    wrap(|| ffi::reshape(a.raw(), shape, current()))
}

/// Reverses the order of the axes.
pub fn transpose(a: &Array) -> Result<Array> {
    wrap(|| ffi::transpose(a.raw(), &[], true, current()))
}

/// Permutes the axes: output axis `i` is input axis `axes[i]`.
pub fn transpose_axes(a: &Array, axes: &[i32]) -> Result<Array> {
    wrap(|| ffi::transpose(a.raw(), axes, false, current()))
}

/// Exchanges two axes.
pub fn swapaxes(a: &Array, axis1: i32, axis2: i32) -> Result<Array> {
    wrap(|| ffi::swapaxes(a.raw(), axis1, axis2, current()))
}

/// Moves axis `source` to position `destination`.
pub fn moveaxis(a: &Array, source: i32, destination: i32) -> Result<Array> {
    wrap(|| ffi::moveaxis(a.raw(), source, destination, current()))
}

/// Inserts size-1 axes at `axes` (positions in the output).
pub fn expand_dims(a: &Array, axes: impl Into<Axes>) -> Result<Array> {
    match axes.into() {
        Axes::All => Err(Error::InvalidArgument("expand_dims needs explicit axes".into())),
        Axes::List(v) => wrap(|| ffi::expand_dims(a.raw(), &v, current())),
    }
}

/// Removes size-1 axes (`Axes::All`: every size-1 axis).
pub fn squeeze(a: &Array, axes: impl Into<Axes>) -> Result<Array> {
    let axes = axes.into();
    let (list, all) = axes.parts();
    wrap(|| ffi::squeeze(a.raw(), list, all, current()))
}

/// Merges axes `start_axis..=end_axis` into one.
pub fn flatten(a: &Array, start_axis: i32, end_axis: i32) -> Result<Array> {
    wrap(|| ffi::flatten(a.raw(), start_axis, end_axis, current()))
}

/// Splits `axis` into `shape`.
pub fn unflatten(a: &Array, axis: i32, shape: &[i32]) -> Result<Array> {
    wrap(|| ffi::unflatten(a.raw(), axis, shape, current()))
}

/// Broadcasts to `shape` (a view: no copy).
pub fn broadcast_to(a: &Array, shape: &[i32]) -> Result<Array> {
    wrap(|| ffi::broadcast_to(a.raw(), shape, current()))
}

/// Joins arrays along an existing axis.
pub fn concatenate(arrays: &[&Array], axis: i32) -> Result<Array> {
    wrap(|| ffi::concatenate(&array_vec(arrays.iter().copied()), axis, current()))
}

/// Joins arrays of one shape along a new axis.
pub fn stack(arrays: &[&Array], axis: i32) -> Result<Array> {
    wrap(|| ffi::stack(&array_vec(arrays.iter().copied()), axis, current()))
}

/// Splits into `sections` equal parts along `axis`.
pub fn split(a: &Array, sections: i32, axis: i32) -> Result<Vec<Array>> {
    Ok(from_array_vec(&crate::lock::locked(|| ffi::split_sections(a.raw(), sections, axis, current()))?))
}

/// `inputs` unchanged, but computed only after `dependencies`: in a gradient, the cotangents
/// flowing on from `inputs` wait for the `dependencies` (MLX's `depends`), which fixes the order
/// the scheduler runs them in.
///
/// ```
/// use rmlx::{ops, Array};
/// let x = Array::from_slice(&[1.0f32, 2.0], &[2])?;
/// let side = (&x * 3.0)?;
/// let out = ops::depends(&[&x], &[&side])?;
/// assert_eq!(out[0].to_vec::<f32>()?, vec![1.0, 2.0]);
/// # Ok::<(), rmlx::Error>(())
/// ```
pub fn depends(inputs: &[&Array], dependencies: &[&Array]) -> Result<Vec<Array>> {
    let (i, d) = (array_vec(inputs.iter().copied()), array_vec(dependencies.iter().copied()));
    Ok(from_array_vec(&crate::lock::locked(|| ffi::depends(&i, &d))?))
}

/// Splits along `axis` before each of `indices`.
pub fn split_at(a: &Array, indices: &[i32], axis: i32) -> Result<Vec<Array>> {
    Ok(from_array_vec(&crate::lock::locked(|| ffi::split_indices(a.raw(), indices, axis, current()))?))
}

/// How [`pad`] fills the new elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PadMode {
    /// With the given value.
    Constant,
    /// By repeating the edge element.
    Edge,
}

/// Pads every axis `i` with `widths[i].0` elements before and `widths[i].1` after.
pub fn pad(a: &Array, widths: &[(i32, i32)], value: &Array, mode: PadMode) -> Result<Array> {
    if widths.len() != a.ndim() {
        return Err(Error::InvalidArgument(format!(
            "pad: {} (before, after) pairs given for {} dimensions",
            widths.len(),
            a.ndim()
        )));
    }
    let axes: Vec<i32> = (0..widths.len() as i32).collect();
    let low: Vec<i32> = widths.iter().map(|w| w.0).collect();
    let high: Vec<i32> = widths.iter().map(|w| w.1).collect();
    let mode = match mode {
        PadMode::Constant => "constant",
        PadMode::Edge => "edge",
    };
    wrap(|| ffi::pad(a.raw(), &axes, &low, &high, value.raw(), mode, current()))
}

/// Repeats each element `repeats` times along `axis` (`None`: of the flattened array).
pub fn repeat(a: &Array, repeats: i32, axis: Option<i32>) -> Result<Array> {
    let (ax, all) = axis_parts(axis);
    wrap(|| ffi::repeat(a.raw(), repeats, ax, all, current()))
}

/// Repeats the whole array `reps[i]` times along axis `i`.
pub fn tile(a: &Array, reps: &[i32]) -> Result<Array> {
    wrap(|| ffi::tile(a.raw(), reps, current()))
}

/// A view with explicit shape, element strides and element offset into `a`'s (row-major) data.
pub fn as_strided(a: &Array, shape: &[i32], strides: &[i64], offset: usize) -> Result<Array> {
    wrap(|| ffi::as_strided(a.raw(), shape, strides, offset, current()))
}

/// A row-major copy if `a` is not already row-contiguous.
pub fn contiguous(a: &Array) -> Result<Array> {
    wrap(|| ffi::contiguous(a.raw(), false, current()))
}

/// Reverses the order of elements along `axes`.
pub fn flip(a: &Array, axes: &[i32]) -> Result<Array> {
    wrap(|| ffi::flip(a.raw(), axes, current()))
}

/// Rotates elements by `shift` along `axis` (`None`: of the flattened array, shape kept).
pub fn roll(a: &Array, shift: i32, axis: Option<i32>) -> Result<Array> {
    let (ax, all) = axis_parts(axis);
    wrap(|| ffi::roll(a.raw(), shift, ax, all, current()))
}

/// Keeps elements at and below diagonal `k` of the last two axes, zeroing the rest.
pub fn tril(a: &Array, k: i32) -> Result<Array> {
    wrap(|| ffi::tril(a.raw(), k, current()))
}

/// Keeps elements at and above diagonal `k` of the last two axes, zeroing the rest.
pub fn triu(a: &Array, k: i32) -> Result<Array> {
    wrap(|| ffi::triu(a.raw(), k, current()))
}

impl Array {
    /// Same data in a new shape.
    pub fn reshape(&self, shape: &[i32]) -> Result<Array> {
        reshape(self, shape)
    }
    /// Reverses the axes.
    pub fn transpose(&self) -> Result<Array> {
        transpose(self)
    }
    /// Permutes the axes.
    pub fn transpose_axes(&self, axes: &[i32]) -> Result<Array> {
        transpose_axes(self, axes)
    }
    /// Exchanges two axes.
    pub fn swapaxes(&self, axis1: i32, axis2: i32) -> Result<Array> {
        swapaxes(self, axis1, axis2)
    }
    /// Inserts size-1 axes.
    pub fn expand_dims(&self, axes: impl Into<Axes>) -> Result<Array> {
        expand_dims(self, axes)
    }
    /// Removes size-1 axes.
    pub fn squeeze(&self, axes: impl Into<Axes>) -> Result<Array> {
        squeeze(self, axes)
    }
    /// Flattens to one dimension.
    pub fn flatten(&self) -> Result<Array> {
        flatten(self, 0, -1)
    }
    /// Broadcasts to `shape`.
    pub fn broadcast_to(&self, shape: &[i32]) -> Result<Array> {
        broadcast_to(self, shape)
    }
}
