//! Shared machinery of the fuzz tests: a counting global allocator (peak bytes held per thread),
//! the fixed-seed proptest configuration, byte-level mutations of files, and outcome counters.

use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::PathBuf;

// ---------------------------------------------------------------------------------------------
// Allocation accounting: bytes allocated by this thread, and the peak since the last reset.

struct Counting;

thread_local! {
    static CURRENT: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn account(delta: isize) {
    let _ = CURRENT.try_with(|c| {
        let now = c.get() + delta;
        c.set(now);
        let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
    });
}

// SAFETY: defers to the system allocator; the thread-local cells are const-initialised and never
// allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        account(l.size() as isize);
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        account(-(l.size() as isize));
        System.dealloc(p, l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        account(l.size() as isize);
        System.alloc_zeroed(l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        account(new as isize - l.size() as isize);
        System.realloc(p, l, new)
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f`, returning its result and the peak number of bytes it held allocated at once.
pub fn peak_allocation<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let start = CURRENT.with(Cell::get);
    PEAK.with(|p| p.set(start));
    let out = f();
    (out, (PEAK.with(Cell::get) - start).max(0) as usize)
}

/// What a reader may allocate for a file of `len` bytes: parsed metadata costs a few dozen bytes
/// per byte of file at most (one `MetaValue` per one-byte array element, vectors grown by doubling).
pub fn allocation_bound(len: usize) -> usize {
    96 * len + (1 << 20)
}

/// `cases` cases from a fixed seed; `RMLX_FUZZ_SCALE` multiplies the cases and `RMLX_FUZZ_SEED`
/// replaces the seed, for longer exploratory runs.
pub fn config(cases: u32) -> Config {
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    Config {
        cases: cases.saturating_mul(env("RMLX_FUZZ_SCALE").unwrap_or(1) as u32),
        rng_seed: RngSeed::Fixed(env("RMLX_FUZZ_SEED").unwrap_or(0x726d_6c78)),
        failure_persistence: None,
        max_shrink_iters: 2000,
        ..Config::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Mutations of raw bytes.

/// Values that break sizes, counts and offsets.
pub const EXTREMES: &[u64] = &[
    0,
    1,
    7,
    31,
    255,
    (1 << 28),
    i32::MAX as u64,
    (1 << 31),
    u32::MAX as u64,
    (1 << 32) + 384,
    (1 << 40),
    i64::MAX as u64,
    (1 << 63),
    u64::MAX,
];

#[derive(Clone, Debug)]
pub enum Mutation {
    /// XOR one byte.
    Flip(usize, u8),
    /// Overwrite a little-endian u64 at a position.
    Put64(usize, u64),
    /// Overwrite a little-endian u32 at a position.
    Put32(usize, u32),
    /// Cut the file to a length.
    Truncate(usize),
}

/// Mutations aimed at the first `hot` bytes (the header) three times in four.
pub fn mutation(len: usize, hot: usize) -> impl Strategy<Value = Mutation> {
    let pos = prop_oneof![3 => 0..hot.max(1), 1 => 0..len.max(1)];
    let extreme = prop_oneof![3 => proptest::sample::select(EXTREMES), 1 => any::<u64>()];
    prop_oneof![
        4 => (pos.clone(), 1..=255u8).prop_map(|(p, x)| Mutation::Flip(p, x)),
        3 => (pos.clone(), extreme.clone()).prop_map(|(p, v)| Mutation::Put64(p, v)),
        2 => (pos, extreme).prop_map(|(p, v)| Mutation::Put32(p, v as u32)),
        1 => (0..=len).prop_map(Mutation::Truncate),
    ]
}

pub fn apply(bytes: &mut Vec<u8>, ms: &[Mutation]) {
    for m in ms {
        match *m {
            Mutation::Flip(p, x) if p < bytes.len() => bytes[p] ^= x,
            Mutation::Put64(p, v) => put(bytes, p, &v.to_le_bytes()),
            Mutation::Put32(p, v) => put(bytes, p, &v.to_le_bytes()),
            Mutation::Truncate(n) => bytes.truncate(n),
            Mutation::Flip(..) => {}
        }
    }
}

pub fn put(bytes: &mut [u8], p: usize, v: &[u8]) {
    let end = (p + v.len()).min(bytes.len());
    if p < end {
        bytes[p..end].copy_from_slice(&v[..end - p]);
    }
}

/// A scratch file path unique to this thread (proptest cases run one at a time per test).
pub fn scratch_file(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rmlx-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("{tag}-{:?}", std::thread::current().id()).replace(['(', ')'], ""))
}

/// Outcome counts of one target, printed at the end of its test (`--nocapture`).
pub struct Stats(std::sync::atomic::AtomicUsize, std::sync::atomic::AtomicUsize);

impl Stats {
    pub const fn new() -> Self {
        Stats(std::sync::atomic::AtomicUsize::new(0), std::sync::atomic::AtomicUsize::new(0))
    }
    pub fn ok(&self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    pub fn err(&self) {
        self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    pub fn report(&self, target: &str) {
        let (ok, err) =
            (self.0.load(std::sync::atomic::Ordering::Relaxed), self.1.load(std::sync::atomic::Ordering::Relaxed));
        eprintln!("{target}: {} cases, {ok} accepted, {err} rejected with a clean error", ok + err);
    }
}
