//! The evaluation thread: one thread, owned by rmlx, runs every evaluation in the process.
//!
//! MLX 0.32's CUDA backend is built around one thread: the first thread that uses MLX becomes its
//! "main" thread, only that thread recycles CUDA events, and cuBLAS/cuDNN handles and kernel caches
//! are kept per thread. Evaluating from several threads, even one at a time under a lock, made MLX
//! end the process ("cudaStreamEndCapture failed: operation failed due to a previous error during
//! capture") in 32 of 120 runs of a four-thread test on an H100. So rmlx starts a thread before MLX
//! is first used, lets it start MLX (it becomes MLX's main thread), and hands it every call that
//! evaluates: `eval`, `async_eval`, reading data, synchronising, saving. Building graphs stays on
//! the calling thread: it never touches the device.
//!
//! The caller holds the MLX lock while the evaluation thread works for it, and waits. So at most
//! one job exists at a time, the job may borrow the caller's data, and the evaluation thread calls
//! into MLX without taking the lock, which is held on its behalf. An evaluation started on the
//! evaluation thread itself runs inline. The hand-off costs one thread wake-up per evaluation
//! (measured in `BENCHMARKS.md`); `RMLX_EVAL_THREAD=0` evaluates on the calling thread instead,
//! which is safe on the CPU backend only.

use parking_lot::{Condvar, Mutex, MutexGuard};
use rmlx_sys::tffi;
use std::any::Any;
use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, OnceLock};
use std::time::{Duration, Instant};

/// How long a caller stays awake waiting for its job before it sleeps.
const SPIN: Duration = Duration::from_millis(5);

thread_local! {
    static ON_EVALUATOR: Cell<bool> = const { Cell::new(false) };
}

/// Whether this is the evaluation thread (whose MLX calls are covered by its caller's lock).
pub(crate) fn on_evaluator() -> bool {
    ON_EVALUATOR.with(Cell::get)
}

/// A job with its lifetime erased (see [`Evaluator::run`]).
struct Job(*mut (dyn FnMut() + 'static));

// SAFETY: the pointee is only used by the evaluation thread, while the thread that owns it waits
// for it under the slot's mutex (which orders every access), so it is never used by two threads.
unsafe impl Send for Job {}

#[derive(Default)]
struct Slot {
    job: Option<Job>,
    outcome: Option<Result<(), Box<dyn Any + Send>>>,
}

struct Evaluator {
    slot: Mutex<Slot>,
    posted: Condvar,
    finished: Condvar,
    /// Set with the outcome, so that a caller can poll for it without the slot's mutex.
    done: AtomicBool,
}

impl Evaluator {
    /// The evaluation thread's loop.
    fn serve(&self) -> ! {
        let mut slot = self.slot.lock();
        loop {
            let Some(Job(job)) = slot.job.take() else {
                self.posted.wait(&mut slot);
                continue;
            };
            let outcome = MutexGuard::unlocked(&mut slot, || {
                // SAFETY: `run` keeps the closure alive, and does not touch it, until the outcome
                // below is stored.
                let outcome = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)() }));
                tffi::set_eval_caller(0);
                outcome
            });
            slot.outcome = Some(outcome);
            self.done.store(true, Ordering::Release);
            self.finished.notify_one();
        }
    }

    /// Runs `f` on the evaluation thread and returns its result (or resumes its panic here). The
    /// caller must hold the MLX lock.
    fn run<T>(&self, f: impl FnOnce() -> T) -> T {
        let caller = tffi::eval_thread_token();
        // The caller's placement of new ops (device or stream) and execution mode apply in the job.
        let (spec, mode) = (crate::device::current(), crate::mode::override_mode());
        let mut f = Some(f);
        let mut out = None;
        let mut job = || {
            tffi::set_eval_caller(caller);
            let f = f.take().expect("a job runs once");
            out = Some(crate::device::with_stream_spec(spec, || crate::mode::with_override(mode, f)));
        };
        let job: *mut (dyn FnMut() + '_) = &mut job;
        // SAFETY: only the lifetime changes. The evaluation thread calls the job once and stores
        // its outcome before this function reads it; until then this function neither returns nor
        // unwinds (waiting on a condition variable does not panic), so the job and what it
        // borrows outlive its use.
        let job: *mut (dyn FnMut() + 'static) = unsafe { std::mem::transmute(job) };
        let mut slot = self.slot.lock();
        self.done.store(false, Ordering::Relaxed);
        slot.job = Some(Job(job));
        self.posted.notify_one();
        drop(slot);
        // Stay awake (yielding the core to runnable threads) for jobs that take a few
        // milliseconds, such as queueing a decode step: once asleep, waking this thread again
        // would delay the caller by a scheduler wake-up each time.
        let spin_until = Instant::now() + SPIN;
        while !self.done.load(Ordering::Acquire) && Instant::now() < spin_until {
            std::thread::yield_now();
        }
        let mut slot = self.slot.lock();
        let outcome = loop {
            if let Some(outcome) = slot.outcome.take() {
                break outcome;
            }
            self.finished.wait(&mut slot);
        };
        drop(slot);
        if let Err(panic) = outcome {
            resume_unwind(panic);
        }
        out.expect("the job ran")
    }
}

/// Whether evaluations go to the evaluation thread (`RMLX_EVAL_THREAD=0` turns it off).
fn wanted() -> bool {
    !matches!(std::env::var("RMLX_EVAL_THREAD").as_deref().map(str::trim), Ok("0" | "false" | "off" | "no"))
}

/// The evaluation thread, started (and MLX started on it) on first use; `None` when it is turned
/// off or could not be started, and evaluations run on the calling thread.
fn evaluator() -> Option<&'static Evaluator> {
    static EVALUATOR: OnceLock<Option<&'static Evaluator>> = OnceLock::new();
    *EVALUATOR.get_or_init(|| {
        if !wanted() {
            return None;
        }
        let e: &'static Evaluator = Box::leak(Box::new(Evaluator {
            slot: Mutex::default(),
            posted: Condvar::new(),
            finished: Condvar::new(),
            done: AtomicBool::new(false),
        }));
        let (ready, started) = mpsc::channel();
        let spawned = std::thread::Builder::new().name("rmlx-eval".into()).spawn(move || {
            ON_EVALUATOR.with(|on| on.set(true));
            // A failure here (no device at all) resurfaces, with its message, at the first op.
            let _ = rmlx_sys::ffi::init_runtime();
            let _ = ready.send(());
            e.serve()
        });
        match spawned {
            Ok(_) if started.recv().is_ok() => Some(e),
            _ => None,
        }
    })
}

/// Starts the evaluation thread if it is not running yet. Called before any call into MLX, so that
/// MLX starts on that thread.
pub(crate) fn start() {
    evaluator();
}

/// Runs `f`, a call into MLX that evaluates, on the evaluation thread. The caller must hold the
/// MLX lock.
pub(crate) fn run<T>(f: impl FnOnce() -> T) -> T {
    match evaluator() {
        Some(e) if !on_evaluator() => e.run(f),
        _ => f(),
    }
}

/// Whether evaluations run on the evaluation thread in this process (see
/// [`on_evaluation_thread`]); false when `RMLX_EVAL_THREAD=0` turned it off.
pub fn evaluation_thread() -> bool {
    evaluator().is_some()
}

/// Runs `f` on rmlx's evaluation thread, where every call into MLX runs directly, and returns its
/// result (a panic in `f` resumes here).
///
/// rmlx hands each evaluation (`eval`, `async_eval`, reading an array) made on another thread to
/// that thread, which costs a thread wake-up each time, and graphs built on one thread and
/// evaluated on another cost cache misses and cross-thread frees. A loop that does little else,
/// such as generating tokens, runs fastest inside this function: it builds and evaluates every
/// graph where MLX runs, as a single-threaded program would. The current device or stream and the
/// execution mode of the calling thread apply inside `f`.
///
/// While `f` runs, the calling thread holds the MLX lock: other threads' calls into rmlx wait until
/// `f` returns, so `f` must not wait for a thread that uses rmlx. Called on the evaluation thread
/// (from inside `f`), it runs `f` directly.
///
/// ```
/// use rmlx::Array;
/// let x = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3])?;
/// let total = rmlx::on_evaluation_thread(move || (&x * 2.0)?.sum(rmlx::Axes::All, false)?.item::<f32>())?;
/// assert_eq!(total, 12.0);
/// # Ok::<(), rmlx::Error>(())
/// ```
pub fn on_evaluation_thread<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    crate::lock::evaluating(f)
}
