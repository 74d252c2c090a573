//! Per-op overhead of the Rust binding, against the same loops written in C++ against `mlx::core`.
//!
//! Two loops over a chain of `N` element-wise adds on a 4-element array:
//! - build: record the `N` lazy ops (no evaluation) — the binding's cost per op is the difference
//!   between the Rust and the C++ figure;
//! - eval: record them and evaluate the chain once — the end-to-end cost per op on the device;
//! - step: evaluate after every add, as a decoding loop does once per token. The C++ loop runs on
//!   rmlx's evaluation thread, so the difference includes the hand-off to that thread.
//!
//! Run: `cargo run --release -p rmlx --example op_overhead -- [--device cpu|gpu] [-n 1000] [-r 20]`
use rmlx::{ops, Array, Device, Dtype};
use std::time::Instant;

fn rust_steps(n: i32) -> rmlx::Result<f64> {
    let mut x = ops::ones(&[4], Dtype::Float32)?;
    let one = Array::scalar(1.0f32);
    rmlx::eval([&x, &one])?;
    let t0 = Instant::now();
    for _ in 0..n {
        x = ops::add(&x, &one)?;
        x.eval()?;
    }
    Ok(t0.elapsed().as_secs_f64())
}

fn rust_chain(n: i32, eval: bool) -> rmlx::Result<f64> {
    let mut x = ops::ones(&[4], Dtype::Float32)?;
    let one = Array::scalar(1.0f32);
    if eval {
        rmlx::eval([&x, &one])?;
    }
    let t0 = Instant::now();
    for _ in 0..n {
        x = ops::add(&x, &one)?;
    }
    if eval {
        x.eval()?;
    }
    Ok(t0.elapsed().as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() -> rmlx::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let n: i32 = arg("-n").and_then(|v| v.parse().ok()).unwrap_or(1000);
    let reps: usize = arg("-r").and_then(|v| v.parse().ok()).unwrap_or(20);
    let device = match arg("--device").as_deref() {
        Some("cpu") => Device::cpu(),
        Some("gpu") => Device::gpu(),
        _ => rmlx::default_device(),
    };
    rmlx::with_device(device, || -> rmlx::Result<()> {
        // Warm up both paths (allocator, kernels, thread pools).
        for _ in 0..3 {
            rust_chain(n, true)?;
            rmlx::bench::cpp_eval_add_chain(n)?;
        }
        let per_op = |secs: f64| secs / n as f64 * 1e9;
        let mut rows = Vec::new();
        for name in ["build", "eval", "step"] {
            let (mut rust, mut cpp) = (Vec::new(), Vec::new());
            for _ in 0..reps {
                // Alternate so drift affects both equally.
                match name {
                    "build" => {
                        rust.push(rust_chain(n, false)?);
                        cpp.push(rmlx::bench::cpp_build_add_chain(n)?);
                    }
                    "eval" => {
                        rust.push(rust_chain(n, true)?);
                        cpp.push(rmlx::bench::cpp_eval_add_chain(n)?);
                    }
                    _ => {
                        rust.push(rust_steps(n)?);
                        cpp.push(rmlx::bench::cpp_eval_each_add(n)?);
                    }
                }
            }
            let (r, c) = (per_op(median(rust)), per_op(median(cpp)));
            rows.push((name, r, c));
        }
        println!("# mlx {} on {:?}, chain of {n} adds, median of {reps} runs", rmlx::mlx_version(), device);
        println!("{:<6} {:>12} {:>12} {:>14}", "loop", "rust ns/op", "c++ ns/op", "binding ns/op");
        for (name, r, c) in &rows {
            println!("{:<6} {:>12.1} {:>12.1} {:>14.1}", name, r, c, r - c);
        }
        if args.iter().any(|a| a == "--json") {
            let fields: Vec<String> = rows
                .iter()
                .map(|(name, r, c)| format!("\"{name}\":{{\"rust_ns\":{r:.1},\"cpp_ns\":{c:.1}}}"))
                .collect();
            println!("{{\"device\":\"{:?}\",\"n\":{n},{}}}", device.kind, fields.join(","));
        }
        Ok(())
    })
}
