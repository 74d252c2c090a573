//! Integration tests of arrays across threads, and of devices and streams.

use rmlx::{ops, Array, Device, DeviceType, Dtype, Error};
use std::sync::mpsc;
use std::thread;

/// Compiles only for `Send` types.
fn assert_send<T: Send>() {}

/// `Array` is `Send`: it may move to another thread.
#[allow(dead_code)]
const _: fn() = || assert_send::<Array>();

/// `Array` is deliberately *not* `Sync`: evaluating an array mutates MLX's shared descriptor, so
/// `&Array` must not be used from two threads at once (clone it instead; clones are cheap handles).
///
/// A negative bound cannot be written directly, so this uses the ambiguous-impl trick: for a
/// `Sync` type both impls below apply and `<T as AmbiguousIfSync<_>>::some_item` fails to compile
/// ("type annotations needed"); for a `!Sync` type only the blanket impl applies and it compiles.
/// If `Array` ever became `Sync`, this file would stop compiling.
trait AmbiguousIfSync<A> {
    fn some_item() {}
}
impl<T: ?Sized> AmbiguousIfSync<()> for T {}
impl<T: ?Sized + Sync> AmbiguousIfSync<u8> for T {}
#[allow(dead_code)]
const _: fn() = || {
    let _ = <Array as AmbiguousIfSync<_>>::some_item;
};

#[test]
fn array_moves_to_another_thread_and_back() {
    // Arrays made from data are materialised at once, so they carry no pending work.
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
    let b = Array::from_slice(&[10.0f32, 20.0], &[2]).unwrap();
    // A graph built here is evaluated here before it moves (see `lazy_graph_evaluates_on_another_thread`).
    let tripled = (&a * 3.0).unwrap();
    tripled.eval().unwrap();
    let (tx, rx) = mpsc::channel::<Array>();
    let worker = thread::spawn(move || {
        // New work on the moved arrays is built and computed there.
        let c = (&tripled + &b).unwrap();
        let d = c.matmul(&a.transpose().unwrap()).unwrap();
        assert!(!d.is_evaluated());
        d.eval().unwrap();
        tx.send(c).unwrap();
        tx.send(d).unwrap();
    });
    let c = rx.recv().unwrap();
    let d = rx.recv().unwrap();
    worker.join().unwrap();
    assert!(d.is_evaluated());
    assert_eq!(c.to_vec::<f32>().unwrap(), vec![13.0, 26.0, 19.0, 32.0]);
    // d = c @ a^T: rows of c dotted with rows of a.
    assert_eq!(d.to_vec::<f32>().unwrap(), vec![65.0, 143.0, 83.0, 185.0]);
    // The results keep working on this thread.
    assert_eq!((&d - 5.0).unwrap().to_vec::<f32>().unwrap(), vec![60.0, 138.0, 78.0, 180.0]);
}

/// rmlx puts all work on one stream per device shared by all threads, so a lazy graph built on one
/// thread evaluates on another (with MLX's per-thread default streams this fails with "There is no
/// Stream(...) in current thread").
#[test]
fn lazy_graph_evaluates_on_another_thread() {
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[4]).unwrap();
    let lazy = (&a * 3.0).unwrap();
    assert!(!lazy.is_evaluated());
    let moved = lazy.clone();
    let result = thread::spawn(move || (&moved + 1.0)?.to_vec::<f32>()).join().unwrap();
    assert_eq!(result.unwrap(), vec![4.0, 7.0, 10.0, 13.0]);
    // The original handle still evaluates here.
    assert_eq!(lazy.to_vec::<f32>().unwrap(), vec![3.0, 6.0, 9.0, 12.0]);
    // A graph on a stream made by another thread evaluates here too.
    let s = thread::spawn(|| Device::cpu().new_stream().unwrap()).join().unwrap();
    let on_s = rmlx::with_stream(s, || (&a - 1.0).unwrap());
    assert_eq!(on_s.to_vec::<f32>().unwrap(), vec![0.0, 1.0, 2.0, 3.0]);
}

#[test]
fn independent_graphs_on_four_threads() {
    let handles: Vec<_> = (0..4)
        .map(|t| {
            thread::spawn(move || {
                let n = 1000 + t * 100;
                let mut results = Vec::new();
                for round in 0..20 {
                    let x = ops::arange(0.0, n as f64, 1.0, Dtype::Int64).unwrap();
                    let y = ((&x * (t + 1)).unwrap() + round).unwrap();
                    let s = y.sum(rmlx::Axes::All, false).unwrap();
                    results.push(s.item::<i64>().unwrap());
                    let m = Array::from_slice(&[t as f32, 1.0, 2.0, 3.0], &[2, 2]).unwrap();
                    let mm = m.matmul(&m).unwrap();
                    assert_eq!(
                        mm.to_vec::<f32>().unwrap(),
                        vec![(t * t + 2) as f32, t as f32 + 3.0, 2.0 * t as f32 + 6.0, 11.0]
                    );
                }
                (t, n, results)
            })
        })
        .collect();
    for h in handles {
        let (t, n, results) = h.join().unwrap();
        let n = n as i64;
        let t = t as i64;
        for (round, s) in results.into_iter().enumerate() {
            // sum_{i<n} ((t+1) i + round) = (t+1) n(n-1)/2 + round n
            assert_eq!(s, (t + 1) * n * (n - 1) / 2 + round as i64 * n, "thread {t} round {round}");
        }
    }
}

#[test]
fn clone_used_on_another_thread_while_original_used_here() {
    let base = ops::arange(0.0, 10_000.0, 1.0, Dtype::Int32).unwrap();
    // Evaluated before the clone crosses threads (lazy arrays cannot, see above).
    base.eval().unwrap();
    let other = base.clone();
    assert_eq!(other.id(), base.id());
    let worker = thread::spawn(move || {
        let mut sums = Vec::new();
        for _ in 0..50 {
            let s = (&other * 2).unwrap().sum(rmlx::Axes::All, false).unwrap();
            sums.push(s.item::<i32>().unwrap());
        }
        sums
    });
    let mut here = Vec::new();
    for _ in 0..50 {
        let s = (&base + 1).unwrap().sum(rmlx::Axes::All, false).unwrap();
        here.push(s.item::<i32>().unwrap());
    }
    let there = worker.join().unwrap();
    // sum(0..10000) = 49_995_000, exact in int32.
    assert_eq!(here, vec![49_995_000 + 10_000; 50]);
    assert_eq!(there, vec![2 * 49_995_000; 50]);
    assert_eq!(base.to_vec::<i32>().unwrap()[9999], 9999);
}

#[test]
fn cpu_device_and_version() {
    assert_eq!(rmlx::mlx_version(), "0.32.4");
    assert!(Device::cpu().is_available());
    assert!(Device::count(DeviceType::Cpu) >= 1);
    if Device::gpu().is_available() {
        // A GPU build (CUDA or Metal): MLX makes the GPU the default device.
        assert_eq!(rmlx::default_device(), Device::gpu());
        assert!(Device::count(DeviceType::Gpu) >= 1);
        let info = Device::gpu().info().unwrap();
        assert!(info.iter().any(|(k, v)| k == "device_name" && !v.is_empty()), "{info:?}");
        return; // the process-wide default is left alone: other tests run concurrently
    }
    // The CPU build of MLX: no GPU.
    assert_eq!(rmlx::default_device(), Device::cpu());
    assert_eq!(Device::count(DeviceType::Gpu), 0);

    let y = rmlx::with_device(Device::cpu(), || {
        (Array::from_slice(&[1.0f32, 4.0, 9.0], &[3]).unwrap().sqrt().unwrap() + 1.0).unwrap()
    });
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![2.0, 3.0, 4.0]);

    // Switching the default to a missing GPU fails and leaves the default alone.
    assert!(matches!(rmlx::set_default_device(Device::gpu()), Err(Error::InvalidArgument(_))));
    assert_eq!(rmlx::default_device(), Device::cpu());
    rmlx::set_default_device(Device::cpu()).unwrap();
    assert_eq!(rmlx::default_device(), Device::cpu());
}

#[test]
fn new_stream_on_cpu() {
    let s = Device::cpu().new_stream().unwrap();
    assert_eq!(s.device(), Device::cpu());
    let default = Device::cpu().default_stream().unwrap();
    assert_eq!(default.device(), Device::cpu());
    assert_ne!(s, default);
    let s2 = Device::cpu().new_stream().unwrap();
    assert_ne!(s, s2);

    let z = rmlx::with_stream(s, || {
        let x = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
        let y = x.matmul(&x).unwrap();
        (&y * 0.5).unwrap()
    });
    rmlx::async_eval([&z]).unwrap();
    s.synchronize().unwrap();
    assert!(z.is_evaluated());
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![3.5, 5.0, 7.5, 11.0]);

    // Work on two streams combined on the default one.
    let a = rmlx::with_stream(s, || {
        ops::arange(0.0, 100.0, 1.0, Dtype::Int32).unwrap().sum(rmlx::Axes::All, false).unwrap()
    });
    let b = rmlx::with_stream(s2, || {
        ops::arange(0.0, 10.0, 1.0, Dtype::Int32).unwrap().sum(rmlx::Axes::All, false).unwrap()
    });
    let c = (&a + &b).unwrap();
    assert_eq!(c.item::<i32>().unwrap(), 4950 + 45);
    s2.synchronize().unwrap();
    rmlx::synchronize().unwrap();
}

#[test]
fn streams_per_thread() {
    // Each thread can make and use its own stream.
    let handles: Vec<_> = (0..4)
        .map(|t| {
            thread::spawn(move || {
                let s = Device::cpu().new_stream().unwrap();
                let r = rmlx::with_stream(s, || {
                    let x = ops::full(&[16], &Array::scalar(t as f32), Dtype::Float32).unwrap();
                    x.sum(rmlx::Axes::All, false).unwrap()
                });
                r.eval().unwrap();
                s.synchronize().unwrap();
                r.item::<f32>().unwrap()
            })
        })
        .collect();
    let results: Vec<f32> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(results, vec![0.0, 16.0, 32.0, 48.0]);
}

#[test]
fn float64_is_refused_on_the_gpu_before_it_runs_and_the_gpu_keeps_working() {
    let x = Array::from_slice(&[1.0f64, 2.0, 3.0], &[3]).unwrap();
    // The CPU computes in float64.
    let on_cpu = rmlx::with_device(Device::cpu(), || &x / 3.0).unwrap();
    assert_eq!(on_cpu.dtype(), Dtype::Float64);
    assert_eq!(on_cpu.to_vec::<f64>().unwrap(), vec![1.0 / 3.0, 2.0 / 3.0, 1.0]);
    if !Device::gpu().is_available() {
        eprintln!("no GPU in this process: the GPU half of this test did not run");
        return;
    }
    let f32s = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]).unwrap();
    for round in 0..20 {
        // Refused when the op is built: float64 input, or a cast that makes float64.
        for err in [
            rmlx::with_device(Device::gpu(), || x.exp()).unwrap_err(),
            rmlx::with_device(Device::gpu(), || f32s.astype(Dtype::Float64)).unwrap_err(),
        ] {
            assert!(matches!(err, Error::Mlx(_)), "round {round}: {err:?}");
            assert!(err.to_string().contains("float64 is not supported on the GPU"), "round {round}: {err}");
        }
        // The GPU still evaluates float32 work afterwards.
        let y = rmlx::with_device(Device::gpu(), || f32s.matmul(&f32s.reshape(&[3, 1])?)? + round as f32).unwrap();
        assert_eq!(y.to_vec::<f32>().unwrap(), vec![14.0 + round as f32], "round {round}");
    }
}

/// Evaluating inside a transform's closure, while the calling thread holds the MLX lock: the
/// evaluation thread works for it (no deadlock) and the value is right.
#[test]
fn evaluation_inside_a_transform_closure() {
    let f = |a: &[Array]| {
        let c = (Array::scalar(3.0f32) * 2.0)?.item::<f32>()?; // evaluated here, mid-trace
        (&a[0] * c)?.sum(rmlx::Axes::All, false)
    };
    let g = rmlx::transforms::grad(f, &[0]);
    let x = Array::from_slice(&[1.0f32, 2.0], &[2]).unwrap();
    assert_eq!(g(&[x]).unwrap()[0].to_vec::<f32>().unwrap(), vec![6.0, 6.0]);
}

/// Eight threads evaluate at once, mixing `async_eval`, `eval` and reads, as a server's request
/// threads would; every result is exact.
#[test]
fn eight_threads_mix_async_eval_eval_and_reads() {
    let handles: Vec<_> = (0..8i64)
        .map(|t| {
            thread::spawn(move || {
                for round in 0..25i64 {
                    let x = ops::arange(0.0, 64.0, 1.0, Dtype::Float32).unwrap();
                    let y = ((&x * (t + 1) as f32).unwrap() + round as f32).unwrap();
                    let s = y.sum(rmlx::Axes::All, false).unwrap();
                    let m = y.max(rmlx::Axes::All, false).unwrap();
                    rmlx::async_eval([&s, &m]).unwrap();
                    let z = (&y - 1.0).unwrap();
                    rmlx::eval([&z]).unwrap();
                    let want = ((t + 1) * 63 * 64 / 2 + round * 64) as f32;
                    assert_eq!(s.item::<f32>().unwrap(), want, "thread {t} round {round}");
                    assert_eq!(m.item::<f32>().unwrap(), ((t + 1) * 63 + round) as f32);
                    assert_eq!(z.to_vec::<f32>().unwrap()[1], (t + 1 + round - 1) as f32);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

const EVAL_CHILD_ENV: &str = "RMLX_EVAL_THREAD_TEST_CHILD";

#[test]
fn eval_thread_child_entry() {
    if std::env::var_os(EVAL_CHILD_ENV).is_some() {
        let x = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
        assert_eq!(x.matmul(&x).unwrap().to_vec::<f32>().unwrap(), vec![7.0, 10.0, 15.0, 22.0]);
        println!("EVALUATION_THREAD={}", rmlx::evaluation_thread());
    }
}

/// Evaluations go to the evaluation thread unless `RMLX_EVAL_THREAD=0` says otherwise; both ways
/// compute the same (each case is a child process: the choice is made once per process).
#[test]
fn evaluation_thread_is_on_unless_turned_off() {
    let report = |value: Option<&str>| {
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", "eval_thread_child_entry", "--nocapture", "--test-threads", "1"]).env(EVAL_CHILD_ENV, "1");
        match value {
            Some(v) => cmd.env("RMLX_EVAL_THREAD", v),
            None => cmd.env_remove("RMLX_EVAL_THREAD"),
        };
        let out = cmd.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "child failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        stdout
            .lines()
            .find_map(|l| l.split("EVALUATION_THREAD=").nth(1).map(|v| v.trim().to_owned()))
            .expect("the child's report")
    };
    assert_eq!(report(None), "true");
    assert_eq!(report(Some("1")), "true");
    assert_eq!(report(Some("0")), "false");
    assert_eq!(report(Some("off")), "false");
}
