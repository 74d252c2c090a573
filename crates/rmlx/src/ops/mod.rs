//! Operations on arrays, as free functions (`ops::add(&a, &b)`) and as methods (`a.add(&b)`).
//!
//! Every op is lazy: it records a node in MLX's graph and returns at once. Shape and dtype errors are
//! found while building the graph and come back as `Err` from the op that caused them.

mod creation;
pub(crate) mod elementwise;
mod index;
mod linalg;
mod reduce;
mod shape;
mod sort;

pub use creation::*;
pub use elementwise::*;
pub use index::*;
pub use linalg::*;
pub use reduce::*;
pub use shape::*;
pub use sort::*;

use crate::{Array, Result};
use rmlx_sys::cxx::{Exception, UniquePtr};
use rmlx_sys::ffi;

/// Which axes an op works over: all of them, or a list (negative values count from the end).
///
/// Converts from an `i32`, an array or slice of them, or a `Vec`:
/// `a.sum(Axes::All, false)`, `a.sum(1, false)`, `a.sum([0, 2], true)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Axes {
    All,
    List(Vec<i32>),
}

impl Axes {
    pub(crate) fn parts(&self) -> (&[i32], bool) {
        match self {
            Axes::All => (&[], true),
            Axes::List(v) => (v, false),
        }
    }
}

impl From<i32> for Axes {
    fn from(a: i32) -> Axes {
        Axes::List(vec![a])
    }
}
impl From<&[i32]> for Axes {
    fn from(a: &[i32]) -> Axes {
        Axes::List(a.to_vec())
    }
}
impl<const N: usize> From<[i32; N]> for Axes {
    fn from(a: [i32; N]) -> Axes {
        Axes::List(a.to_vec())
    }
}
impl<const N: usize> From<&[i32; N]> for Axes {
    fn from(a: &[i32; N]) -> Axes {
        Axes::List(a.to_vec())
    }
}
impl From<Vec<i32>> for Axes {
    fn from(a: Vec<i32>) -> Axes {
        Axes::List(a)
    }
}

/// `None` means "over the flattened array", as in NumPy's `axis=None`.
pub(crate) fn axis_parts(axis: Option<i32>) -> (i32, bool) {
    match axis {
        Some(a) => (a, false),
        None => (0, true),
    }
}

/// Makes one shim call under the MLX lock and wraps the new array.
pub(crate) fn wrap(call: impl FnOnce() -> std::result::Result<UniquePtr<ffi::Array>, Exception>) -> Result<Array> {
    crate::mode::after_op(Array::from_raw(crate::lock::locked(call)?))
}
