//! Process exit while work is still running on an MLX stream.
//!
//! MLX leaks its scheduler on purpose, so its stream threads keep computing while `exit` runs the
//! library destructors. Work left in flight (scheduled with `async_eval`, never waited for) then
//! raced with OpenBLAS's destructor, which frees its buffers and stops its thread pool under a
//! running sgemm: heap corruption ("corrupted double-linked list"), SIGSEGV, or a hang in
//! `blas_thread_shutdown_`. rmlx-sys drains every stream it uses in an `atexit` handler.
//!
//! The same race hit MLX's own allocator: its buffer cache is a function-local static, destroyed
//! at exit before any `atexit` handler registered ahead of it, so queued ops that allocate and free
//! buffers used the cache while it was torn down ("malloc_consolidate(): unaligned fastbin chunk
//! detected"). rmlx-sys creates the allocator before it registers its handler.
//!
//! Each test runs this test binary again as a child that queues work and exits at once, many
//! times, and requires every child to exit with status 0 within a time limit.

use rmlx::{Array, Device, Dtype};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "RMLX_EXIT_TEST_CHILD";
const CHILDREN: usize = 50;
const TIME_LIMIT: Duration = Duration::from_secs(30);

/// The child's body: queue several large CPU matmuls (each a multithreaded BLAS call) and return
/// from the process while they run.
fn queue_work_and_exit() -> ! {
    let x = rmlx::with_device(Device::cpu(), || {
        let a = rmlx::random::normal(&[768, 768], Dtype::Float32, 0.0, 1.0, None)?;
        a.eval()?; // so that the queued work starts with a BLAS call
        let mut x = a.clone();
        for _ in 0..12 {
            x = x.matmul(&a)?;
        }
        Ok::<Array, rmlx::Error>(x)
    })
    .expect("building the graph");
    rmlx::async_eval([&x]).expect("async_eval");
    // Leak the array so that nothing waits for it; `exit` runs the atexit handlers and then the
    // library destructors, exactly as when `main` returns.
    std::mem::forget(x);
    std::process::exit(0);
}

/// The other child: thousands of small products, each allocating its result and freeing its
/// input through MLX's allocator, queued before the process exits.
fn queue_allocations_and_exit() -> ! {
    let x = rmlx::with_device(Device::cpu(), || {
        let a = rmlx::random::normal(&[32, 32], Dtype::Float32, 0.0, 0.1, None)?;
        let mut x = a.clone();
        for _ in 0..3000 {
            x = (x.matmul(&a)? + 1.0)?;
        }
        Ok::<Array, rmlx::Error>(x)
    })
    .expect("building the graph");
    rmlx::async_eval([&x]).expect("async_eval");
    std::mem::forget(x);
    std::process::exit(0);
}

#[test]
fn child_entry() {
    match std::env::var(CHILD_ENV).as_deref() {
        Ok("matmul") => queue_work_and_exit(),
        Ok("alloc") => queue_allocations_and_exit(),
        _ => {}
    }
}

#[test]
fn exit_with_work_in_flight_is_clean() {
    run_children("matmul");
}

#[test]
fn exit_with_allocations_in_flight_is_clean() {
    run_children("alloc");
}

fn run_children(mode: &str) {
    let exe = std::env::current_exe().unwrap();
    let mut failures = Vec::new();
    for i in 0..CHILDREN {
        let start = Instant::now();
        let mut child = Command::new(&exe)
            .args(["--exact", "child_entry", "--test-threads", "1", "--nocapture"])
            .env(CHILD_ENV, mode)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if start.elapsed() > TIME_LIMIT {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        match status {
            None => failures.push(format!("child {i}: still running after {TIME_LIMIT:?} (hang at exit)")),
            Some(s) if !s.success() => {
                let mut err = String::new();
                use std::io::Read;
                let _ = child.stderr.take().unwrap().read_to_string(&mut err);
                let tail: Vec<&str> = err.lines().rev().take(3).collect();
                failures.push(format!("child {i}: {s}; stderr ends {tail:?}"));
            }
            Some(_) => {}
        }
    }
    assert!(failures.is_empty(), "{} of {CHILDREN} children failed:\n{}", failures.len(), failures.join("\n"));
}
