//! The guide's "Results" section: the `Axpby` primitive against `alpha * x + beta * y` written with
//! ordinary ops (and that formula compiled, which fuses it into one kernel).
//!
//! ```text
//! cargo run --release -p rmlx-axpby -- [--device cpu|gpu] [--iters N] [--size N]... [--json]
//! ```
//!
//! Each function is called `--iters` times on float32 inputs of each size (after a warm-up), with
//! an evaluation per call; the table gives the median wall time per call. The markdown table (or
//! JSON with `--json`) goes to stdout, progress to stderr.

use rmlx::compile::compile;
use rmlx::{random, Array, Device, Dtype, Result};
use rmlx_axpby::{axpby, axpby_composed};
use std::process::ExitCode;
use std::time::Instant;

const ALPHA: f32 = 4.0;
const BETA: f32 = 2.0;

struct Options {
    device: Device,
    iters: usize,
    shapes: Vec<[i32; 2]>,
    json: bool,
}

fn usage() -> String {
    "usage: rmlx-axpby [--device cpu|gpu] [--iters N] [--size N]... [--json]\n\
     \x20 --size N    time N x N inputs (repeatable; default: 256x512 as in the guide, 1024x1024, 4096x4096)\n\
     \x20 --iters N   timed calls per function and size (default 100)"
        .into()
}

fn parse_args() -> std::result::Result<Options, String> {
    let mut opts = Options { device: Device::cpu(), iters: 100, shapes: Vec::new(), json: false };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match arg.as_str() {
            "--device" => {
                opts.device = match value("--device")?.as_str() {
                    "cpu" => Device::cpu(),
                    "gpu" => Device::gpu(),
                    other => return Err(format!("unknown device `{other}` (cpu or gpu)")),
                }
            }
            "--iters" => opts.iters = value("--iters")?.parse().map_err(|e| format!("--iters: {e}"))?,
            "--size" => {
                let n: i32 = value("--size")?.parse().map_err(|e| format!("--size: {e}"))?;
                opts.shapes.push([n, n]);
            }
            "--json" => opts.json = true,
            "-h" | "--help" => return Err(usage()),
            other => return Err(format!("unknown argument `{other}`\n{}", usage())),
        }
    }
    if opts.iters == 0 || opts.shapes.iter().any(|s| s[0] <= 0) {
        return Err("--iters and --size must be positive".into());
    }
    if opts.shapes.is_empty() {
        opts.shapes = vec![[256, 512], [1024, 1024], [4096, 4096]];
    }
    Ok(opts)
}

/// Median milliseconds of one `f()` plus its evaluation, over `iters` calls after a warm-up.
fn time_ms(iters: usize, f: &dyn Fn() -> Result<Array>) -> Result<f64> {
    for _ in 0..iters.min(10) {
        f()?.eval()?;
    }
    let mut ms: Vec<f64> = (0..iters)
        .map(|_| {
            let start = Instant::now();
            f()?.eval()?;
            Ok(start.elapsed().as_secs_f64() * 1e3)
        })
        .collect::<Result<_>>()?;
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

struct Row {
    shape: [i32; 2],
    custom_ms: f64,
    composed_ms: f64,
    compiled_ms: f64,
    max_abs_diff: f32,
}

fn bench(opts: &Options) -> Result<Vec<Row>> {
    let compiled = compile(|a: &[Array]| Ok(vec![axpby_composed(&a[0], &a[1], ALPHA, BETA)?]));
    let mut rows = Vec::new();
    for &shape in &opts.shapes {
        let x = random::normal(&shape, Dtype::Float32, 0.0, 1.0, None)?;
        let y = random::normal(&shape, Dtype::Float32, 0.0, 1.0, None)?;
        rmlx::eval([&x, &y])?;
        let diff = (&axpby(&x, &y, ALPHA, BETA)? - &axpby_composed(&x, &y, ALPHA, BETA)?)?;
        let max_abs_diff = diff.abs()?.max(rmlx::Axes::All, false)?.item::<f32>()?;
        eprintln!(
            "{}x{}: timing {} calls each (max |custom - composed| = {max_abs_diff:e})",
            shape[0], shape[1], opts.iters
        );
        let custom_ms = time_ms(opts.iters, &|| axpby(&x, &y, ALPHA, BETA))?;
        let composed_ms = time_ms(opts.iters, &|| axpby_composed(&x, &y, ALPHA, BETA))?;
        let compiled_ms = time_ms(opts.iters, &|| Ok(compiled.call(&[x.clone(), y.clone()])?.remove(0)))?;
        rows.push(Row { shape, custom_ms, composed_ms, compiled_ms, max_abs_diff });
    }
    Ok(rows)
}

/// Effective bandwidth of one call in GB/s: x and y read, z written, 4 bytes each.
fn gbps(shape: [i32; 2], ms: f64) -> f64 {
    3.0 * 4.0 * shape[0] as f64 * shape[1] as f64 / (ms * 1e-3) / 1e9
}

fn print_markdown(opts: &Options, rows: &[Row]) {
    println!(
        "axpby (alpha = {ALPHA}, beta = {BETA}), float32, device {:?}, median of {} calls (eval per call)\n",
        opts.device.kind, opts.iters
    );
    println!(
        "| shape | custom `Axpby` (ms) | composed (ms) | composed / custom | compiled composed (ms) | custom GB/s |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for r in rows {
        println!(
            "| {}x{} | {:.3} | {:.3} | {:.2}x | {:.3} | {:.1} |",
            r.shape[0],
            r.shape[1],
            r.custom_ms,
            r.composed_ms,
            r.composed_ms / r.custom_ms,
            r.compiled_ms,
            gbps(r.shape, r.custom_ms)
        );
    }
}

fn print_json(opts: &Options, rows: &[Row]) {
    let items: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "{{\"shape\":[{},{}],\"custom_ms\":{:.6},\"composed_ms\":{:.6},\"compiled_composed_ms\":{:.6},\"speedup\":{:.4},\"max_abs_diff\":{:e}}}",
                r.shape[0],
                r.shape[1],
                r.custom_ms,
                r.composed_ms,
                r.compiled_ms,
                r.composed_ms / r.custom_ms,
                r.max_abs_diff
            )
        })
        .collect();
    let device = if opts.device == Device::gpu() { "gpu" } else { "cpu" };
    println!(
        "{{\"device\":\"{device}\",\"dtype\":\"float32\",\"alpha\":{ALPHA},\"beta\":{BETA},\"iters\":{},\"rows\":[{}]}}",
        opts.iters,
        items.join(",")
    );
}

fn main() -> ExitCode {
    let opts = match parse_args() {
        Ok(o) => o,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(2);
        }
    };
    if !opts.device.is_available() {
        eprintln!("device {:?} is not available to this MLX", opts.device.kind);
        return ExitCode::from(2);
    }
    eprintln!("MLX {}, device {:?}", rmlx::mlx_version(), opts.device.kind);
    match rmlx::with_device(opts.device, || bench(&opts)) {
        Ok(rows) if opts.json => print_json(&opts, &rows),
        Ok(rows) => print_markdown(&opts, &rows),
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
