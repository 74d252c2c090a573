//! # rmlx — Apple's MLX array framework from Rust
//!
//! Lazy n-dimensional arrays with automatic scheduling on MLX's backends: CUDA (Linux, NVIDIA), CPU
//! (Linux, macOS) and Metal (macOS). The same code runs on all of them; MLX picks the device.
//!
//! ```
//! use rmlx::{ops, Array, Dtype};
//! let x = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
//! let w = ops::eye(2, 2, 0, Dtype::Float32)?;
//! let y = (x.matmul(&w)? + 1.0)?;      // lazy: nothing computed yet
//! assert_eq!(y.to_vec::<f32>()?, vec![2.0, 3.0, 4.0, 5.0]);
//! # Ok::<(), rmlx::Error>(())
//! ```
//!
//! ## Errors
//! Every operation returns [`Result`]. MLX's C++ exceptions (shape mismatches, bad dtypes, I/O
//! failures found during evaluation) become [`Error::Mlx`] with MLX's message; nothing aborts.
//!
//! ## Transforms, compilation and extensions
//! [`transforms`] differentiates and vectorises Rust closures ([`transforms::grad`],
//! [`transforms::vjp`], [`transforms::jvp`], [`transforms::vmap`], ...); [`compile`] traces a function
//! into a fused graph; [`ExecutionMode`] switches between lazy, eager (debugging) and compiled
//! evaluation; [`fast::cuda_kernel`] / [`fast::metal_kernel`] run GPU kernels from source; and
//! [`custom::CustomPrimitive`] adds operations written in Rust as real MLX primitives. An `Err` or a
//! panic inside any closure comes back as the `Err` of the outer call.
//!
//! ## Threads
//! [`Array`] is `Send` but not `Sync`: move arrays (evaluated or not) to any thread, but do not use
//! one array from two threads at once (evaluation mutates it); clone it instead — clones are cheap
//! handles. All of rmlx's work goes to one stream per device shared by every thread (MLX's own
//! default streams are per thread, and a graph recorded on one cannot be evaluated from another), and
//! every call into MLX holds one process-wide lock: MLX's CUDA backend terminates the process when two
//! threads drive it at once. Threads therefore take turns inside MLX; the device still overlaps work
//! queued by [`async_eval`]. Every evaluation runs on one thread that rmlx owns, because MLX
//! 0.32.4's CUDA backend aborts when several threads evaluate, even one at a time; a loop that
//! evaluates often runs fastest inside [`on_evaluation_thread`], where nothing is handed over.
//!
//! ## Linking
//! `rmlx-sys` finds or installs MLX when it builds and links it with a runpath, so tests and binaries
//! of this workspace run without environment variables. A crate of yours that builds binaries adds
//! the same runpath from its build script with `DEP_RMLX_LIB_DIR` (see `build.rs` of this crate).

mod array;
mod blas;
mod callback;
pub mod compile;
pub mod cuda;
mod cuda_graphs;
pub mod custom;
mod device;
pub mod distributed;
mod dtype;
mod error;
mod evaluator;
pub mod fast;
pub mod io;
mod kernel;
mod lock;
pub mod memory;
mod mode;
mod operators;
pub mod ops;
pub mod quantization;
pub mod random;
pub mod transforms;

pub use array::{async_eval, eval, graph_census, graph_signature, Array};
pub use blas::{blas_threads, set_blas_threads};
pub use cuda_graphs::{cuda_graph_ops, keep_mlx_cuda_graph_ops, CUDA_GRAPH_OPS};
pub use device::{
    current_device, default_device, mlx_version, set_default_device, synchronize, with_device, with_stream, Device,
    DeviceType, Stream,
};
pub use dtype::{Dtype, Element};
pub use error::{Error, Result};
pub use evaluator::{evaluation_thread, on_evaluation_thread};
pub use half::{bf16, f16};
pub use mode::{execution_mode, set_execution_mode, with_execution_mode, Executable, ExecutionMode};
pub use num_complex::Complex32;
pub use ops::Axes;

#[doc(hidden)]
pub mod bench {
    //! The C++ side of the per-op overhead benchmark (the same loops written against `mlx::core`).
    use crate::device::current;
    use crate::Result;

    /// Seconds to build a chain of `n` lazy adds in C++ (no evaluation).
    pub fn cpp_build_add_chain(n: i32) -> Result<f64> {
        Ok(crate::lock::locked(|| rmlx_sys::ffi::bench_build_add_chain(n, current()))?)
    }

    /// Seconds to build and evaluate a chain of `n` adds in C++.
    pub fn cpp_eval_add_chain(n: i32) -> Result<f64> {
        let stream = current();
        Ok(crate::lock::evaluating(|| rmlx_sys::ffi::bench_eval_add_chain(n, stream))?)
    }

    /// Seconds to build and evaluate `n` adds in C++, evaluating after each one. Runs entirely on
    /// the evaluation thread: the single-threaded C++ baseline for rmlx's per-evaluation hand-off.
    pub fn cpp_eval_each_add(n: i32) -> Result<f64> {
        let stream = current();
        Ok(crate::lock::evaluating(|| rmlx_sys::ffi::bench_eval_each_add(n, stream))?)
    }
}
