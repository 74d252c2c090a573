//! One process-wide lock around every call into MLX.
//!
//! MLX 0.32.4's CUDA backend records work as CUDA graphs (stream capture). While one thread captures,
//! a CUDA call from another thread — an allocation for a new array, a free, another evaluation —
//! invalidates the capture, and MLX ends the process (`std::terminate` on "cudaStreamEndCapture
//! failed", reproduced on an H100 with four threads evaluating independent graphs). Since graph
//! building itself may allocate (scalar constants), rmlx serialises all of its MLX calls, and records
//! all work on one stream per device shared by every thread (rmlx-sys `shared_stream`), so no thread
//! leaves a capture open on a stream of its own while another thread works. The lock is
//! reentrant (dropping an array inside a locked call is fine) and uncontended in single-threaded
//! programs, where it costs a few tens of nanoseconds per call.

use parking_lot::{const_reentrant_mutex, ReentrantMutex};

static MLX: ReentrantMutex<()> = const_reentrant_mutex(());

/// Runs `f` while holding the MLX lock.
pub(crate) fn locked<T>(f: impl FnOnce() -> T) -> T {
    let _guard = MLX.lock();
    f()
}
