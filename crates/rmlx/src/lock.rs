//! One process-wide lock around every call into MLX, and the entry to the evaluation thread.
//!
//! MLX's graphs, caches and streams are not safe to use from two threads at once, so rmlx
//! serialises all of its MLX calls, and records all work on one stream per device shared by every
//! thread (rmlx-sys `shared_stream`): a graph built on one thread can be evaluated on any other.
//! Calls that evaluate go further: they run on rmlx's evaluation thread (see [`crate::evaluator`]),
//! while the caller holds the lock for it. The lock is reentrant (dropping an array inside a
//! locked call is fine) and uncontended in single-threaded programs, where it costs a few tens of
//! nanoseconds per call.

use crate::evaluator;
use parking_lot::{const_reentrant_mutex, ReentrantMutex};

static MLX: ReentrantMutex<()> = const_reentrant_mutex(());

/// Runs `f`, a call into MLX, while holding the MLX lock.
pub(crate) fn locked<T>(f: impl FnOnce() -> T) -> T {
    if evaluator::on_evaluator() {
        // The evaluation thread works for a caller that holds the lock.
        return f();
    }
    crate::blas::configure_once();
    crate::cuda_graphs::configure_once();
    evaluator::start();
    let _guard = MLX.lock();
    f()
}

/// Runs `f`, a call into MLX that evaluates arrays, on the evaluation thread under the MLX lock.
pub(crate) fn evaluating<T>(f: impl FnOnce() -> T) -> T {
    locked(|| evaluator::run(f))
}
