//! Execution modes: how graphs get evaluated.
//!
//! - [`ExecutionMode::Lazy`] (the default): ops only record the graph; it is computed when a result
//!   is needed or [`eval`](crate::eval) is called, so MLX schedules the whole graph at once.
//! - [`ExecutionMode::Eager`]: every op is evaluated as soon as it is built, so an error that would
//!   surface at the final evaluation comes back from the op that caused it, as [`Error::Eager`]
//!   naming the primitive. [`Compiled`](crate::compile::Compiled) functions run uncompiled, op by op.
//!   Slow; for debugging. Ops recorded inside transforms (`grad`, `vmap`, `compile` traces) stay
//!   lazy, since MLX cannot evaluate tracers.
//! - [`ExecutionMode::Compiled`]: like lazy, and an [`Executable`] compiles its function (traced
//!   once per input signature, then replayed with fused kernels).
//!
//! The mode is process-wide: [`set_execution_mode`], or the environment variable
//! `RMLX_MODE=lazy|eager|compiled` read on first use. [`with_execution_mode`] overrides it for the
//! current thread within a closure, and an [`Executable`] may fix its own mode.
//!
//! ```
//! use rmlx::{Array, ExecutionMode, Executable};
//! let step = Executable::new(|x: &[Array]| Ok(vec![(&(&x[0] * 2.0)? + 1.0)?]));
//! let x = Array::from_slice(&[1.0f32, 2.0], &[2])?;
//! for mode in [ExecutionMode::Lazy, ExecutionMode::Eager, ExecutionMode::Compiled] {
//!     let y = step.run_with_mode(mode, &[x.clone()])?;
//!     assert_eq!(y[0].to_vec::<f32>()?, vec![3.0, 5.0]);
//! }
//! # Ok::<(), rmlx::Error>(())
//! ```

use crate::compile::{compile_with, CompileOptions, Compiled};
use crate::{Array, Error, Result};
use rmlx_sys::tffi;
use std::cell::Cell;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

thread_local! {
    static OVERRIDE: Cell<Option<ExecutionMode>> = const { Cell::new(None) };
}

/// How graphs are evaluated (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ExecutionMode {
    #[default]
    Lazy,
    Eager,
    Compiled,
}

impl std::str::FromStr for ExecutionMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<ExecutionMode> {
        match s.trim().to_ascii_lowercase().as_str() {
            "lazy" => Ok(ExecutionMode::Lazy),
            "eager" => Ok(ExecutionMode::Eager),
            "compiled" => Ok(ExecutionMode::Compiled),
            other => Err(Error::InvalidArgument(format!(
                "unknown execution mode `{other}` (expected lazy, eager or compiled)"
            ))),
        }
    }
}

const UNSET: u8 = u8::MAX;
static MODE: AtomicU8 = AtomicU8::new(UNSET);

fn code(mode: ExecutionMode) -> u8 {
    mode as u8
}

fn from_code(c: u8) -> ExecutionMode {
    match c {
        1 => ExecutionMode::Eager,
        2 => ExecutionMode::Compiled,
        _ => ExecutionMode::Lazy,
    }
}

/// The mode `RMLX_MODE` asks for; an unknown value is reported once on stderr and ignored.
fn from_env() -> ExecutionMode {
    static ENV: OnceLock<ExecutionMode> = OnceLock::new();
    *ENV.get_or_init(|| match std::env::var("RMLX_MODE") {
        Ok(v) => v.parse().unwrap_or_else(|e| {
            eprintln!("rmlx: ignoring RMLX_MODE: {e}");
            ExecutionMode::Lazy
        }),
        Err(_) => ExecutionMode::Lazy,
    })
}

/// The execution mode in effect on this thread: the [`with_execution_mode`] override, else the
/// process-wide mode.
pub fn execution_mode() -> ExecutionMode {
    OVERRIDE.with(|o| o.get()).unwrap_or_else(global_mode)
}

/// Runs `f` with `mode` in effect on the current thread.
pub fn with_execution_mode<T>(mode: ExecutionMode, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<ExecutionMode>);
    impl Drop for Restore {
        fn drop(&mut self) {
            OVERRIDE.with(|o| o.set(self.0));
        }
    }
    let _restore = Restore(OVERRIDE.with(|o| o.replace(Some(mode))));
    f()
}

/// This thread's override of the process-wide mode, if any.
pub(crate) fn override_mode() -> Option<ExecutionMode> {
    OVERRIDE.with(|o| o.get())
}

/// Runs `f` with this thread's override set to `mode` (carries a caller's override to the
/// evaluation thread).
pub(crate) fn with_override<T>(mode: Option<ExecutionMode>, f: impl FnOnce() -> T) -> T {
    match mode {
        Some(m) => with_execution_mode(m, f),
        None => {
            let saved = OVERRIDE.with(|o| o.replace(None));
            let out = f();
            OVERRIDE.with(|o| o.set(saved));
            out
        }
    }
}

fn global_mode() -> ExecutionMode {
    match MODE.load(Ordering::Relaxed) {
        UNSET => {
            let m = from_env();
            let _ = MODE.compare_exchange(UNSET, code(m), Ordering::Relaxed, Ordering::Relaxed);
            from_code(MODE.load(Ordering::Relaxed))
        }
        c => from_code(c),
    }
}

/// Sets the process-wide execution mode (overrides `RMLX_MODE`; threads inside
/// [`with_execution_mode`] keep their override).
pub fn set_execution_mode(mode: ExecutionMode) {
    MODE.store(code(mode), Ordering::Relaxed);
}

/// Eager mode's hook, run on the result of every op: evaluate it now unless it is being traced.
pub(crate) fn after_op(a: Array) -> Result<Array> {
    if execution_mode() != ExecutionMode::Eager || crate::lock::locked(|| tffi::array_is_tracer(a.raw())) {
        return Ok(a);
    }
    // Evaluation detaches the array from its primitive: take the name first.
    let op = crate::lock::locked(|| tffi::array_primitive_name(a.raw()));
    match a.eval() {
        Ok(()) => Ok(a),
        Err(e) => {
            let message = match e {
                Error::Mlx(m) | Error::PrimitiveEval(m) => m,
                other => other.to_string(),
            };
            Err(Error::Eager { op: if op.is_empty() { "a constant".into() } else { op }, message })
        }
    }
}

/// A function run as a unit under an execution mode: the process-wide one, or its own.
/// [`Executable::run`] evaluates the outputs before returning, so every failure shows up there.
pub struct Executable {
    compiled: Compiled,
    mode: Option<ExecutionMode>,
}

impl Executable {
    /// Wraps `f`. Like [`compile`](crate::compile::compile), `f` must receive every array it uses as
    /// an input.
    pub fn new(f: impl Fn(&[Array]) -> Result<Vec<Array>> + Sync + 'static) -> Executable {
        Executable { compiled: compile_with(f, CompileOptions::default()), mode: None }
    }

    /// Fixes this executable's mode, whatever the process-wide one.
    pub fn with_mode(mut self, mode: ExecutionMode) -> Executable {
        self.mode = Some(mode);
        self
    }

    /// Runs the function in this executable's mode and evaluates the outputs.
    pub fn run(&self, inputs: &[Array]) -> Result<Vec<Array>> {
        self.run_with_mode(self.mode.unwrap_or_else(execution_mode), inputs)
    }

    /// Runs the function in `mode` and evaluates the outputs.
    pub fn run_with_mode(&self, mode: ExecutionMode, inputs: &[Array]) -> Result<Vec<Array>> {
        let outputs = match mode {
            ExecutionMode::Compiled => self.compiled.call(inputs)?,
            ExecutionMode::Lazy => self.compiled.call_uncompiled(inputs)?,
            ExecutionMode::Eager => with_execution_mode(mode, || self.compiled.call_uncompiled(inputs))?,
        };
        crate::eval(&outputs)?;
        Ok(outputs)
    }

    /// How many times the function has been compiled (in compiled mode).
    pub fn trace_count(&self) -> usize {
        self.compiled.trace_count()
    }
}
