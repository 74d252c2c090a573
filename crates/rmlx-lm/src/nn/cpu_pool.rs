//! Splitting one CPU primitive's work over the cores, the calling thread included.
//!
//! A primitive runs on MLX's CPU worker thread. Handing all its work to a pool of one thread per
//! core would leave that thread blocked and put one more busy thread than cores on the machine
//! (the thread building the next graph is one too): on the 2-core development machine the pool's
//! threads spent a third of their time yielding to each other. Here the calling thread takes its
//! share and the pool has one thread fewer than the cores; parts are taken from a shared counter,
//! so that a descheduled thread delays none of the others' parts.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// The helper threads: one fewer than the cores (none on one core).
fn helpers() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let builder = rayon::ThreadPoolBuilder::new().num_threads(cores - 1).thread_name(|i| format!("rmlx-cpu-{i}"));
        (cores > 1).then(|| builder.build().ok()).flatten()
    })
    .as_ref()
}

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
    match helpers() {
        Some(pool) if parts.len() > 1 => pool.in_place_scope(|s| {
            for _ in 0..pool.current_num_threads().min(parts.len() - 1) {
                s.spawn(|_| run());
            }
            run();
        }),
        _ => run(),
    }
}
