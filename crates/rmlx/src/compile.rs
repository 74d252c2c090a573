//! Compilation: tracing a function once into a graph that MLX simplifies and fuses (runs of
//! element-wise ops become one kernel), then replaying it.
//!
//! A [`Compiled`] function is traced on its first call and again only when the inputs' shapes or
//! dtypes change (with [`CompileOptions::shapeless`], only when their dtypes or ranks change); the
//! traces are kept in MLX's cache under a key that belongs to this `Compiled` value, and removed when
//! it is dropped. [`Compiled::trace_count`] says how often it was traced; [`clear_cache`] empties the
//! cache of the current thread.
//!
//! A compiled function must receive every array it uses as an input. An array captured from outside
//! would be frozen into the trace, and later calls would silently keep using its old value. So the
//! closure must be `Sync` — which an [`Array`] (and anything holding one) is not, so capturing one
//! does not compile:
//!
//! ```compile_fail
//! let w = rmlx::Array::from_slice(&[2.0f32], &[1]).unwrap();
//! let f = rmlx::compile::compile(move |x: &[rmlx::Array]| Ok(vec![(&x[0] * &w)?]));
//! ```
//!
//! and an array smuggled in some other way (through a `Mutex`) is caught when the function is traced:
//! the call fails with [`Error::CapturedArray`].
//!
//! ```
//! use rmlx::{compile::compile, Array};
//! let gelu_ish = compile(|x: &[Array]| {
//!     let x = &x[0];
//!     Ok(vec![(x * &(x * 1.702)?.sigmoid()?)?])
//! });
//! let x = Array::from_slice(&[-1.0f32, 0.0, 1.0], &[3])?;
//! let y = gelu_ish.call(&[x.clone()])?;
//! let y2 = gelu_ish.call(&[(&x * 2.0)?])?;  // same shape: replayed, not traced again
//! assert_eq!(gelu_ish.trace_count(), 1);
//! assert!((y[0].to_vec::<f32>()?[2] - 0.8457).abs() < 1e-3);
//! # let _ = y2;
//! # Ok::<(), rmlx::Error>(())
//! ```

use crate::array::array_vec;
use crate::array::from_array_vec as arrays;
use crate::callback;
use crate::{Array, Error, Result};
use rmlx_sys::cxx::UniquePtr;
use rmlx_sys::tffi;
use std::cell::Cell;
use std::marker::PhantomData;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Options of [`compile_with`].
#[derive(Clone, Debug, Default)]
pub struct CompileOptions {
    /// Trace once for all input shapes of the same ranks and dtypes (the function must not depend
    /// on shapes in ways a graph cannot express, such as a reshape to a shape computed in Rust).
    pub shapeless: bool,
    /// A name for error messages.
    pub name: Option<String>,
}

type DynFn = dyn Fn(&[Array]) -> Result<Vec<Array>>;

struct Inner {
    f: Box<DynFn>,
    name: String,
    traces: AtomicUsize,
    /// Arrays the function captures are constants of the trace ([`compile_with_constants`]).
    constants: bool,
}

/// A compiled function (see the module docs). Not `Send`: MLX keeps compiled traces per thread.
pub struct Compiled {
    raw: UniquePtr<tffi::ArrayFunction>,
    inner: Rc<Inner>,
    _not_send: PhantomData<*const ()>,
}

/// Compiles `f` (see the module docs).
pub fn compile(f: impl Fn(&[Array]) -> Result<Vec<Array>> + Sync + 'static) -> Compiled {
    compile_with(f, CompileOptions::default())
}

/// Compiles `f` with `options`.
pub fn compile_with(f: impl Fn(&[Array]) -> Result<Vec<Array>> + Sync + 'static, options: CompileOptions) -> Compiled {
    build(Box::new(f), options, false)
}

/// Compiles `f`, which may use arrays it captures: they become **constants** of each trace, kept
/// alive by it and never read again, so a later change to them is not seen (the function must be
/// dropped or [`Compiled::clear`]ed instead). Meant for large fixed inputs, such as the frozen
/// weights of a model being fine-tuned, that would otherwise be passed on every call; everything
/// that changes between calls must still be an input.
///
/// ```
/// use rmlx::{compile::{compile_with_constants, CompileOptions}, Array};
/// let w = Array::from_slice(&[2.0f32, 3.0], &[2])?;
/// let scaled = compile_with_constants(move |x: &[Array]| Ok(vec![(&x[0] * &w)?]), CompileOptions::default());
/// let y = scaled.call(&[Array::from_slice(&[1.0f32, 1.0], &[2])?])?;
/// assert_eq!(y[0].to_vec::<f32>()?, vec![2.0, 3.0]);
/// # Ok::<(), rmlx::Error>(())
/// ```
pub fn compile_with_constants(
    f: impl Fn(&[Array]) -> Result<Vec<Array>> + 'static,
    options: CompileOptions,
) -> Compiled {
    build(Box::new(f), options, true)
}

fn build(f: Box<DynFn>, options: CompileOptions, constants: bool) -> Compiled {
    let inner = Rc::new(Inner {
        f,
        name: options.name.unwrap_or_else(|| "<closure>".into()),
        traces: AtomicUsize::new(0),
        constants,
    });
    let traced = inner.clone();
    let cb = callback::owned_fn(move |args: &[Array]| trace(&traced, args));
    let id = Rc::as_ptr(&inner) as usize;
    let raw = crate::lock::locked(|| tffi::compile(cb, id, options.shapeless)).expect("compile never fails to wrap");
    Compiled { raw, inner, _not_send: PhantomData }
}

impl Compiled {
    /// Applies the function. In [`ExecutionMode::Eager`](crate::ExecutionMode) it runs uncompiled, op
    /// by op.
    pub fn call(&self, inputs: &[Array]) -> Result<Vec<Array>> {
        if crate::mode::execution_mode() == crate::ExecutionMode::Eager {
            return self.call_uncompiled(inputs);
        }
        let v = array_vec(inputs);
        let raw = self.raw.as_ref().expect("compiled function handle");
        let out = callback::call(|| tffi::call_function(raw, &v, crate::device::current()))?;
        Ok(arrays(&out))
    }

    /// Applies the function without compiling it.
    pub(crate) fn call_uncompiled(&self, inputs: &[Array]) -> Result<Vec<Array>> {
        callback::guard(|| (self.inner.f)(inputs))
    }

    /// How many times the function has been traced (compiled): once per new input signature.
    pub fn trace_count(&self) -> usize {
        self.inner.traces.load(Ordering::Relaxed)
    }

    /// Drops this function's traces (of the current thread); the next call traces again.
    pub fn clear(&self) {
        crate::lock::locked(|| tffi::compile_erase(self.id()));
    }

    fn id(&self) -> usize {
        Rc::as_ptr(&self.inner) as usize
    }
}

impl Drop for Compiled {
    fn drop(&mut self) {
        let raw = std::mem::replace(&mut self.raw, UniquePtr::null());
        let id = self.id();
        crate::lock::locked(move || {
            tffi::compile_erase(id);
            drop(raw);
        });
    }
}

/// Drops the compiled traces of every function on the current thread; each traces again on its
/// next call.
pub fn clear_cache() {
    crate::lock::locked(tffi::compile_clear_cache);
}

/// Runs the user's function on MLX's tracer inputs, watching for arrays it did not receive.
fn trace(inner: &Inner, args: &[Array]) -> Result<Vec<Array>> {
    inner.traces.fetch_add(1, Ordering::Relaxed);
    // Fresh handles to the tracer inputs, all stamped at or after `floor`.
    let floor = STAMP.load(Ordering::Relaxed);
    let fresh: Vec<Array> = args.iter().map(Array::clone).collect();
    let outer = TRACE.with(|t| t.replace(Trace { floor, captured: false }));
    let result = callback::guard(|| (inner.f)(&fresh));
    let traced = TRACE.with(|t| t.replace(outer));
    if traced.captured && !inner.constants {
        return Err(Error::CapturedArray(inner.name.clone()));
    }
    result
}

/// Creation stamps of array handles, to tell a compiled function's own arrays from captured ones.
static STAMP: AtomicU64 = AtomicU64::new(1);

#[derive(Clone, Copy)]
struct Trace {
    /// Handles stamped before this were made outside the function being traced (0: not tracing).
    floor: u64,
    captured: bool,
}

thread_local! {
    static TRACE: Cell<Trace> = const { Cell::new(Trace { floor: 0, captured: false }) };
}

/// The stamp of a new array handle.
pub(crate) fn next_stamp() -> u64 {
    STAMP.fetch_add(1, Ordering::Relaxed)
}

/// Called whenever an array handle is used: while tracing, a handle older than the trace is a
/// capture.
#[inline]
pub(crate) fn note_use(stamp: u64) {
    TRACE.with(|t| {
        let cur = t.get();
        if cur.floor != 0 && stamp < cur.floor && !cur.captured {
            t.set(Trace { captured: true, ..cur });
        }
    });
}
