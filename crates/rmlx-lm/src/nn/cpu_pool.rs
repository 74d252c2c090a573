//! Splitting one CPU primitive's work over the cores, the calling thread included.
//!
//! A primitive runs on MLX's CPU worker thread, and a decoding step of the fused CPU layer
//! ([`super::cpu_layer`]) splits ~150 products and attentions a token over the cores. Two costs
//! decide how: a thread woken from sleep costs a system call and, in a virtual machine, an
//! interrupt to another processor (the 2-core development VM spent ~5 ms a token waking a
//! `rayon` worker for each region); and a thread more than the cores competes with the one
//! building the next step's graph. So the calling thread takes a share, the pool has one thread
//! fewer than the cores, and the helpers wait for the next region spinning, then yielding, and
//! sleep only after [`IDLE`] without work. Parts are taken from a shared counter, so a
//! descheduled thread delays no other part than its own.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a helper waits for the next region before it sleeps.
const IDLE: Duration = Duration::from_millis(2);

/// Busy-wait rounds before a waiting thread starts yielding its processor.
const SPINS: usize = 2000;

/// Calls `work(i, part)` for every part `i` of `out` cut into parts of `size` (the last may be
/// shorter), on this thread and the helpers at once.
pub fn for_each_part<T: Send>(out: &mut [T], size: usize, work: impl Fn(usize, &mut [T]) + Sync) {
    for_each(out.chunks_mut(size.max(1)).collect(), work)
}

/// Calls `work(i, parts[i])` for every part, on this thread and the helpers at once.
pub fn for_each<T: Send>(parts: Vec<&mut [T]>, work: impl Fn(usize, &mut [T]) + Sync) {
    let parts: Vec<Mutex<&mut [T]>> = parts.into_iter().map(Mutex::new).collect();
    let next = AtomicUsize::new(0);
    let run = || loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        let Some(part) = parts.get(i) else { break };
        // Each part is taken once: the lock is never contended.
        work(i, &mut part.lock().unwrap_or_else(|p| p.into_inner()));
    };
    match pool() {
        Some(pool) if parts.len() > 1 => pool.run(&run),
        _ => run(),
    }
}

/// The helper threads and the region they work on.
struct Pool {
    helpers: usize,
    /// One region at a time; a second caller meanwhile runs its region alone.
    region: Mutex<()>,
    /// The region's job (a `&(dyn Fn() + Sync)` on the caller's stack), valid while `pending`
    /// helpers have not finished it.
    job: AtomicPtr<Job<'static>>,
    /// Counts the regions: a helper runs the job when it sees the count move.
    generation: AtomicUsize,
    /// Helpers that have not finished the current region.
    pending: AtomicUsize,
    /// A helper's panic in the current region, re-raised on the caller.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    /// Sleeping helpers, woken through `wake`.
    sleeping: AtomicUsize,
    asleep: Mutex<()>,
    wake: Condvar,
}

struct Job<'a> {
    run: &'a (dyn Fn() + Sync),
}

/// The pool, with one helper fewer than the cores (none on one core).
fn pool() -> Option<&'static Pool> {
    static POOL: OnceLock<Option<&'static Pool>> = OnceLock::new();
    *POOL.get_or_init(|| {
        let helpers = std::thread::available_parallelism().map_or(1, |n| n.get()).saturating_sub(1);
        if helpers == 0 {
            return None;
        }
        let pool: &'static Pool = Box::leak(Box::new(Pool {
            helpers,
            region: Mutex::new(()),
            job: AtomicPtr::new(std::ptr::null_mut()),
            generation: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            panic: Mutex::new(None),
            sleeping: AtomicUsize::new(0),
            asleep: Mutex::new(()),
            wake: Condvar::new(),
        }));
        for i in 0..helpers {
            let spawned = std::thread::Builder::new().name(format!("rmlx-cpu-{i}")).spawn(move || pool.helper());
            if spawned.is_err() {
                // Without all its helpers the pool would wait for ever: run alone.
                return None;
            }
        }
        Some(pool)
    })
}

impl Pool {
    /// Runs `run` on this thread and every helper; returns when all have finished it.
    fn run(&self, run: &(dyn Fn() + Sync)) {
        let Ok(_region) = self.region.try_lock() else { return run() };
        let job = Job { run };
        // SAFETY (the lifetime): `Finish` below waits, even while unwinding, until no helper
        // uses the job any more.
        let job_ptr = &job as *const Job<'_> as *mut Job<'static>;
        self.job.store(job_ptr, Ordering::SeqCst);
        self.pending.store(self.helpers, Ordering::SeqCst);
        self.generation.fetch_add(1, Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) > 0 {
            let _asleep = self.asleep.lock().unwrap_or_else(|p| p.into_inner());
            self.wake.notify_all();
        }
        struct Finish<'a>(&'a Pool);
        impl Drop for Finish<'_> {
            fn drop(&mut self) {
                wait_until(|| self.0.pending.load(Ordering::Acquire) == 0);
            }
        }
        let finish = Finish(self);
        run();
        drop(finish);
        if let Some(p) = self.panic.lock().unwrap_or_else(|p| p.into_inner()).take() {
            resume_unwind(p);
        }
    }

    /// A helper: waits for each region, runs its job, reports it done.
    fn helper(&self) {
        // No region finishes without every helper, so a helper that starts late still sees the
        // first one from the count's first value.
        let mut seen = 0;
        loop {
            let started = Instant::now();
            let mut rounds = 0usize;
            while self.generation.load(Ordering::SeqCst) == seen {
                rounds += 1;
                if rounds < SPINS {
                    std::hint::spin_loop();
                } else if started.elapsed() < IDLE {
                    std::thread::yield_now();
                } else {
                    let mut asleep = self.asleep.lock().unwrap_or_else(|p| p.into_inner());
                    self.sleeping.fetch_add(1, Ordering::SeqCst);
                    while self.generation.load(Ordering::SeqCst) == seen {
                        asleep = self.wake.wait(asleep).unwrap_or_else(|p| p.into_inner());
                    }
                    self.sleeping.fetch_sub(1, Ordering::SeqCst);
                }
            }
            seen = self.generation.load(Ordering::SeqCst);
            // SAFETY: the caller keeps the job alive until `pending` reaches zero, which this
            // helper's decrement below is part of.
            let job = unsafe { &*self.job.load(Ordering::SeqCst) };
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| (job.run)())) {
                *self.panic.lock().unwrap_or_else(|p| p.into_inner()) = Some(p);
            }
            self.pending.fetch_sub(1, Ordering::Release);
        }
    }
}

/// Spins, then yields, until `done`.
fn wait_until(done: impl Fn() -> bool) {
    let mut rounds = 0usize;
    while !done() {
        rounds += 1;
        if rounds < SPINS {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_is_visited_once_with_its_index() {
        for len in [0usize, 1, 7, 64, 1000] {
            for _ in 0..200 {
                let mut out = vec![0usize; len];
                for_each_part(&mut out, 3, |i, part| part.iter_mut().for_each(|v| *v += i + 1));
                let want: Vec<usize> = (0..len).map(|j| j / 3 + 1).collect();
                assert_eq!(out, want, "{len} values");
            }
        }
    }

    #[test]
    fn a_panicking_part_reaches_the_caller_and_the_pool_goes_on() {
        for _ in 0..50 {
            let mut out = vec![0u32; 64];
            let result = catch_unwind(AssertUnwindSafe(|| {
                for_each_part(&mut out, 1, |i, _| {
                    if i % 8 == 7 {
                        panic!("part {i}");
                    }
                })
            }));
            assert!(result.is_err(), "the panic of a part is raised");
            let mut out = vec![0u32; 64];
            for_each_part(&mut out, 1, |i, part| part[0] = i as u32);
            assert_eq!(out, (0..64).collect::<Vec<u32>>());
        }
    }

    #[test]
    fn regions_after_the_helpers_went_to_sleep() {
        for _ in 0..20 {
            std::thread::sleep(IDLE * 2);
            let mut out = vec![0u8; 16];
            for_each_part(&mut out, 1, |_, part| part[0] = 1);
            assert!(out.iter().all(|&v| v == 1));
        }
    }

    #[test]
    fn regions_from_several_threads_all_finish() {
        std::thread::scope(|s| {
            for t in 0..4usize {
                s.spawn(move || {
                    for _ in 0..300 {
                        let mut out = vec![0usize; 40];
                        for_each_part(&mut out, 4, |i, part| part.iter_mut().for_each(|v| *v = i + t));
                        assert!(out.iter().enumerate().all(|(j, &v)| v == j / 4 + t));
                    }
                });
            }
        });
    }
}
