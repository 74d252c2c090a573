//! Reductions over axes, arg-reductions, softmax and cumulative scans.

use super::{axis_parts, wrap, Axes};
use crate::device::current;
use crate::{Array, Result};
use rmlx_sys::ffi::{self, ReduceOp, ScanOp};

macro_rules! reductions {
    ($($name:ident => $op:ident, $doc:literal;)*) => {
        $(
            #[doc = $doc]
            pub fn $name(a: &Array, axes: impl Into<Axes>, keepdims: bool) -> Result<Array> {
                let axes = axes.into();
                let (list, all) = axes.parts();
                wrap(|| ffi::reduce(ReduceOp::$op, a.raw(), list, all, keepdims, current()))
            }
        )*
        impl Array {
            $(
                #[doc = $doc]
                pub fn $name(&self, axes: impl Into<Axes>, keepdims: bool) -> Result<Array> {
                    $name(self, axes, keepdims)
                }
            )*
        }
    };
}

reductions! {
    sum => Sum, "Sum over `axes`.\n\n```\nuse rmlx::{Array, ops::Axes};\nlet a = Array::from_slice(&[1i32, 2, 3, 4], &[2, 2])?;\nassert_eq!(a.sum(0, false)?.to_vec::<i32>()?, vec![4, 6]);\nassert_eq!(a.sum(Axes::All, false)?.item::<i32>()?, 10);\n# Ok::<(), rmlx::Error>(())\n```";
    mean => Mean, "Mean over `axes`.";
    prod => Prod, "Product over `axes`.";
    max => Max, "Maximum over `axes`.";
    min => Min, "Minimum over `axes`.";
    all => All, "Whether all elements over `axes` are true (non-zero).";
    any => Any, "Whether any element over `axes` is true (non-zero).";
    logsumexp => LogSumExp, "`ln(Σ e^a)` over `axes`, computed stably.";
}

/// Variance over `axes` with `ddof` delta degrees of freedom (divides by `N - ddof`).
pub fn var(a: &Array, axes: impl Into<Axes>, keepdims: bool, ddof: i32) -> Result<Array> {
    let axes = axes.into();
    let (list, all) = axes.parts();
    wrap(|| ffi::var(a.raw(), list, all, keepdims, ddof, current()))
}

/// Standard deviation over `axes` with `ddof` delta degrees of freedom.
pub fn std(a: &Array, axes: impl Into<Axes>, keepdims: bool, ddof: i32) -> Result<Array> {
    let axes = axes.into();
    let (list, all) = axes.parts();
    wrap(|| ffi::std(a.raw(), list, all, keepdims, ddof, current()))
}

/// Softmax over `axes`. `precise` computes in float32 for half-precision inputs.
pub fn softmax(a: &Array, axes: impl Into<Axes>, precise: bool) -> Result<Array> {
    let axes = axes.into();
    let (list, all) = axes.parts();
    wrap(|| ffi::softmax(a.raw(), list, all, precise, current()))
}

/// Index of the maximum along `axis` (`None`: of the flattened array). Ties give the first index.
pub fn argmax(a: &Array, axis: Option<i32>, keepdims: bool) -> Result<Array> {
    let (ax, all) = axis_parts(axis);
    wrap(|| ffi::argmax(a.raw(), ax, all, keepdims, current()))
}

/// Index of the minimum along `axis` (`None`: of the flattened array). Ties give the first index.
pub fn argmin(a: &Array, axis: Option<i32>, keepdims: bool) -> Result<Array> {
    let (ax, all) = axis_parts(axis);
    wrap(|| ffi::argmin(a.raw(), ax, all, keepdims, current()))
}

macro_rules! scans {
    ($($name:ident => $op:ident, $doc:literal;)*) => {
        $(
            #[doc = $doc]
            ///
            /// `axis = None` scans the flattened array; `reverse` scans from the end; `inclusive = false`
            /// shifts the result by one (the first output is the identity element).
            pub fn $name(a: &Array, axis: Option<i32>, reverse: bool, inclusive: bool) -> Result<Array> {
                let (ax, all) = axis_parts(axis);
                wrap(|| ffi::scan(ScanOp::$op, a.raw(), ax, all, reverse, inclusive, current()))
            }
        )*
    };
}

scans! {
    cumsum => Cumsum, "Cumulative sum.";
    cumprod => Cumprod, "Cumulative product.";
    cummax => Cummax, "Cumulative maximum.";
    cummin => Cummin, "Cumulative minimum.";
    logcumsumexp => LogCumSumExp, "Cumulative `ln(Σ e^a)`.";
}

impl Array {
    /// Variance over `axes`.
    pub fn var(&self, axes: impl Into<Axes>, keepdims: bool, ddof: i32) -> Result<Array> {
        var(self, axes, keepdims, ddof)
    }
    /// Standard deviation over `axes`.
    pub fn std(&self, axes: impl Into<Axes>, keepdims: bool, ddof: i32) -> Result<Array> {
        std(self, axes, keepdims, ddof)
    }
    /// Softmax over `axes` (not precise).
    pub fn softmax(&self, axes: impl Into<Axes>) -> Result<Array> {
        softmax(self, axes, false)
    }
    /// Index of the maximum along `axis`.
    pub fn argmax(&self, axis: Option<i32>, keepdims: bool) -> Result<Array> {
        argmax(self, axis, keepdims)
    }
    /// Index of the minimum along `axis`.
    pub fn argmin(&self, axis: Option<i32>, keepdims: bool) -> Result<Array> {
        argmin(self, axis, keepdims)
    }
    /// Inclusive cumulative sum along `axis`.
    pub fn cumsum(&self, axis: Option<i32>) -> Result<Array> {
        cumsum(self, axis, false, true)
    }
}
