//! What `compile` saves on chains of element-wise ops.
//!
//! Three chains on float32 arrays of several sizes:
//! - `gelu_tanh`: `ops::gelu_approx`, 9 element-wise ops;
//! - `affine20`: 10 rounds of `0.999·y + 0.001`, 20 cheap ops (memory-bound uncompiled);
//! - `chain20`: 5 rounds of `tanh(0.9·y + 0.1)` then `exp`, 20 ops (2 of 4 transcendental).
//!
//! Each is timed uncompiled (every op its own kernel and intermediate array), compiled with
//! `compile::compile` (one trace per shape, the chain fused into one kernel) and compiled with
//! `shapeless: true` (one trace for every size). One iteration builds the graph (or replays the
//! trace) and evaluates it; the figure is the median over the iterations after a warm-up, which
//! also absorbs tracing and building the fused kernel. Results are checked against the uncompiled
//! ones.
//!
//! Run: `cargo run --release -p rmlx --example compile_bench -- [--device cpu|gpu] [--json]`
//! Prints a markdown table on stdout (or, with `--json`, one JSON object instead); progress goes to
//! stderr.
use rmlx::compile::{compile_with, CompileOptions, Compiled};
use rmlx::{ops, Array, Device, Dtype, Result};
use std::time::{Duration, Instant};

/// `gelu_approx`: 9 element-wise ops.
fn gelu_tanh(x: &[Array]) -> Result<Vec<Array>> {
    Ok(vec![ops::gelu_approx(&x[0])?])
}

/// 10 × (multiply, add): 20 element-wise ops.
fn affine20(x: &[Array]) -> Result<Vec<Array>> {
    let mut y = x[0].clone();
    for _ in 0..10 {
        y = ((&y * 0.999)? + 0.001)?;
    }
    Ok(vec![y])
}

/// 5 × (multiply, add, tanh, exp): 20 element-wise ops.
fn chain20(x: &[Array]) -> Result<Vec<Array>> {
    let mut y = x[0].clone();
    for _ in 0..5 {
        y = ((&y * 0.9)? + 0.1)?.tanh()?.exp()?;
    }
    Ok(vec![y])
}

type Chain = fn(&[Array]) -> Result<Vec<Array>>;

/// Seconds per iteration of each of `steps`: the median after `warmup` rounds, over at least 7
/// rounds and until `budget` is spent (at most 200). A round runs every step once, so drift in the
/// machine's speed affects all of them alike.
fn median_secs(steps: &mut [&mut dyn FnMut() -> Result<()>], warmup: usize, budget: Duration) -> Result<Vec<f64>> {
    let (min_rounds, max_rounds) = (7, 200);
    for _ in 0..warmup {
        for step in steps.iter_mut() {
            step()?;
        }
    }
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); steps.len()];
    let start = Instant::now();
    let mut rounds = 0;
    while rounds < min_rounds || (start.elapsed() < budget && rounds < max_rounds) {
        for (step, t) in steps.iter_mut().zip(&mut times) {
            let t0 = Instant::now();
            step()?;
            t.push(t0.elapsed().as_secs_f64());
        }
        rounds += 1;
    }
    Ok(times
        .into_iter()
        .map(|mut t| {
            t.sort_by(|a, b| a.partial_cmp(b).unwrap());
            t[t.len() / 2]
        })
        .collect())
}

fn run(f: Chain, x: &Array) -> Result<()> {
    f(std::slice::from_ref(x))?[0].eval()
}

fn run_compiled(c: &Compiled, x: &Array) -> Result<()> {
    c.call(std::slice::from_ref(x))?[0].eval()
}

fn max_abs_diff(a: &Array, b: &Array) -> Result<f32> {
    Ok(a.to_vec::<f32>()?.iter().zip(b.to_vec::<f32>()?).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max))
}

struct Row {
    chain: &'static str,
    ops: usize,
    shape: Vec<i32>,
    uncompiled: f64,
    compiled: f64,
    shapeless: f64,
    first_call: f64,
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let json = args.iter().any(|a| a == "--json");
    let device = match arg("--device").as_deref() {
        Some("cpu") => Device::cpu(),
        Some("gpu") => Device::gpu(),
        Some(other) => return Err(rmlx::Error::InvalidArgument(format!("--device {other}: expected cpu or gpu"))),
        None => rmlx::default_device(),
    };
    if !device.is_available() {
        return Err(rmlx::Error::InvalidArgument(format!("{device:?} is not available in this MLX")));
    }
    let chains: [(&'static str, usize, Chain); 3] =
        [("gelu_tanh", 9, gelu_tanh), ("affine20", 20, affine20), ("chain20", 20, chain20)];
    let shapes: [&[i32]; 3] = [&[1024], &[256, 256], &[1024, 1024]];
    let budget = Duration::from_millis(2000);

    let rows = rmlx::with_device(device, || -> Result<Vec<Row>> {
        let mut rows = Vec::new();
        for (name, n_ops, f) in chains {
            let compiled = compile_with(f, CompileOptions { name: Some(name.into()), ..Default::default() });
            let shapeless = compile_with(f, CompileOptions { shapeless: true, name: Some(name.into()) });
            for shape in shapes {
                let size: i32 = shape.iter().product();
                let x = ops::linspace(-3.0, 3.0, size, Dtype::Float32)?.reshape(shape)?;
                x.eval()?;
                let input = std::slice::from_ref(&x);
                // The first compiled call traces and builds the fused kernel (unless an earlier
                // shape or run already did).
                let t0 = Instant::now();
                run_compiled(&compiled, &x)?;
                let first_call = t0.elapsed().as_secs_f64();
                let want = f(input)?.remove(0);
                let diff = max_abs_diff(&compiled.call(input)?[0], &want)?
                    .max(max_abs_diff(&shapeless.call(input)?[0], &want)?);
                eprintln!(
                    "{name} {shape:?}: first compiled call {:.2} ms, compiled vs uncompiled max |diff| {diff:e}",
                    first_call * 1e3
                );
                if diff > 1e-4 {
                    return Err(rmlx::Error::InvalidArgument(format!(
                        "{name} {shape:?}: compiled result differs by {diff}"
                    )));
                }
                let times = median_secs(
                    &mut [&mut || run(f, &x), &mut || run_compiled(&compiled, &x), &mut || {
                        run_compiled(&shapeless, &x)
                    }],
                    3,
                    budget,
                )?;
                let (uncompiled, compiled_t, shapeless_t) = (times[0], times[1], times[2]);
                eprintln!(
                    "  uncompiled {:.3} ms, compiled {:.3} ms, shapeless {:.3} ms",
                    uncompiled * 1e3,
                    compiled_t * 1e3,
                    shapeless_t * 1e3
                );
                rows.push(Row {
                    chain: name,
                    ops: n_ops,
                    shape: shape.to_vec(),
                    uncompiled,
                    compiled: compiled_t,
                    shapeless: shapeless_t,
                    first_call,
                });
            }
            eprintln!(
                "{name}: traced {} times (per shape), {} times (shapeless)",
                compiled.trace_count(),
                shapeless.trace_count()
            );
        }
        Ok(rows)
    })?;

    if json {
        let items: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"chain\":\"{}\",\"ops\":{},\"shape\":{:?},\"uncompiled_ms\":{:.4},\"compiled_ms\":{:.4},\"shapeless_ms\":{:.4},\"first_call_ms\":{:.3}}}",
                    r.chain,
                    r.ops,
                    r.shape,
                    r.uncompiled * 1e3,
                    r.compiled * 1e3,
                    r.shapeless * 1e3,
                    r.first_call * 1e3
                )
            })
            .collect();
        println!(
            "{{\"mlx\":\"{}\",\"device\":\"{:?}\",\"rows\":[{}]}}",
            rmlx::mlx_version(),
            device.kind,
            items.join(",")
        );
        return Ok(());
    }
    println!("MLX {} on {:?}, float32, median time per evaluated call", rmlx::mlx_version(), device.kind);
    println!();
    println!("| chain | ops | shape | uncompiled (ms) | compiled (ms) | speedup | shapeless (ms) | speedup |");
    println!("|---|---:|---|---:|---:|---:|---:|---:|");
    for r in &rows {
        let shape = r.shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("×");
        println!(
            "| {} | {} | {} | {:.3} | {:.3} | {:.2}× | {:.3} | {:.2}× |",
            r.chain,
            r.ops,
            shape,
            r.uncompiled * 1e3,
            r.compiled * 1e3,
            r.uncompiled / r.compiled,
            r.shapeless * 1e3,
            r.uncompiled / r.shapeless
        );
    }
    Ok(())
}
