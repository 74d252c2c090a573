//! Rust closures as MLX callbacks, and errors raised inside them back into [`Error`]s.
//!
//! A closure given to a transform runs inside an MLX call. If it returns `Err` or panics, the
//! trampoline keeps the original [`Error`] in a thread-local slot and raises a C++ exception carrying
//! its message; MLX unwinds to the shim call, and [`call`] hands back the kept error — so the caller
//! sees exactly what the closure returned, and no panic ever unwinds through C++.

use crate::array::{array_vec, arrays_of};
use crate::lock::locked;
use crate::{Array, Error, Result};
use rmlx_sys::cxx::{Exception, UniquePtr};
use rmlx_sys::ffi;
use rmlx_sys::transforms::{panic_message, ArrayFn, CallbackResult};
use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};

thread_local! {
    static RAISED: RefCell<Option<Error>> = const { RefCell::new(None) };
}

/// A function over arrays, as transforms take it.
pub(crate) type DynFn<'a> = dyn Fn(&[Array]) -> Result<Vec<Array>> + 'a;

/// Keeps `e` as the error being raised through MLX and returns the message for the C++ exception.
pub(crate) fn raise(e: Error) -> String {
    let message = e.to_string();
    RAISED.with(|r| *r.borrow_mut() = Some(e));
    message
}

/// Runs `f`, turning a panic into [`Error::Callback`].
pub(crate) fn guard<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| Err(Error::Callback(panic_message(p.as_ref()))))
}

/// Runs a shim call that may run callbacks, under the MLX lock; a failure is the error a callback
/// raised if there was one, else MLX's own.
pub(crate) fn call<T>(f: impl FnOnce() -> std::result::Result<T, Exception>) -> Result<T> {
    RAISED.with(|r| r.borrow_mut().take());
    locked(f).map_err(|e| RAISED.with(|r| r.borrow_mut().take()).unwrap_or_else(|| Error::from(e)))
}

/// Calls `f` on the arrays of `args` and converts its result for C++.
pub(crate) fn invoke(f: &DynFn<'_>, args: &ffi::ArrayVec) -> CallbackResult {
    let args = arrays_of(args);
    match guard(|| f(&args)) {
        Ok(outs) => Ok(array_vec(&outs)),
        Err(e) => Err(raise(e)),
    }
}

/// Converts a callback's arrays for C++ (or raises its error).
pub(crate) fn returned(r: Result<Vec<Array>>) -> CallbackResult {
    match r {
        Ok(outs) => Ok(array_vec(&outs)),
        Err(e) => Err(raise(e)),
    }
}

/// An owned callback for transforms whose result keeps it (checkpoint, custom functions, compile).
pub(crate) fn owned_fn(f: impl Fn(&[Array]) -> Result<Vec<Array>> + 'static) -> Box<ArrayFn> {
    Box::new(ArrayFn(Box::new(move |args| invoke(&f, args))))
}

/// Runs `body` with a callback that borrows `f`. The callback is dropped when `body` returns, so it
/// must only be handed to shim calls that use it during the call (vjp, jvp, value_and_grad, vmap).
pub(crate) fn with_borrowed_fn<R>(f: &DynFn<'_>, body: impl FnOnce(&ArrayFn) -> R) -> R {
    // SAFETY: the erased reference lives in `callback`, which is dropped before this function
    // returns, and the shim calls `body` makes do not retain the callback past their return.
    let f: &'static DynFn<'static> = unsafe { std::mem::transmute::<&DynFn<'_>, &'static DynFn<'static>>(f) };
    let callback = ArrayFn(Box::new(move |args| invoke(f, args)));
    body(&callback)
}

/// Converts a vmap callback's result for C++ (or raises its error).
#[allow(clippy::type_complexity)]
pub(crate) fn returned_mapped(
    r: Result<(Vec<Array>, Vec<Option<usize>>)>,
) -> std::result::Result<(UniquePtr<ffi::ArrayVec>, Vec<i32>), String> {
    match r {
        Ok((outs, out_axes)) => Ok((array_vec(&outs), axes_to_i32(&out_axes))),
        Err(e) => Err(raise(e)),
    }
}

/// MLX marks an unmapped array with axis -1.
pub(crate) fn axes_from_i32(axes: &[i32]) -> Vec<Option<usize>> {
    axes.iter().map(|&a| if a < 0 { None } else { Some(a as usize) }).collect()
}

pub(crate) fn axes_to_i32(axes: &[Option<usize>]) -> Vec<i32> {
    axes.iter().map(|a| a.map_or(-1, |a| a as i32)).collect()
}
