//! `rmlx bench-collective`: how long MLX's all-sum takes between the ranks of a job started by
//! `rmlx launch`, per message size (what tensor parallelism pays twice a layer), with its bus
//! bandwidth as NCCL's tests report it (`2 (n − 1) / n · bytes / time`). Every rank checks the
//! sum it received; rank 0 prints.

use crate::common::positive;
use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use rmlx::distributed::{Backend, Group};
use rmlx::{ops, Array, Dtype};
use std::time::Instant;

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Message sizes in bytes (float32 arrays; 8192 is one token's hidden state of an 8B model
    /// in bfloat16, twice).
    #[arg(long, value_delimiter = ',', default_values_t = [8192usize, 1 << 20, 16 << 20])]
    sizes: Vec<usize>,
    /// Timed all-sums per size (each evaluated on its own), after 3 untimed ones.
    #[arg(long, default_value_t = 20, value_parser = positive)]
    iters: usize,
    /// One JSON object per size on stdout.
    #[arg(long)]
    json: bool,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

pub fn run(a: Args) -> Result<()> {
    let Ok(name) = std::env::var("RMLX_DISTRIBUTED") else {
        bail!("bench-collective runs as the ranks of a job: rmlx launch -n 2 -- bench-collective");
    };
    let backend: Backend = name.parse()?;
    let group = Group::init(backend, true).with_context(|| format!("joining the {name} group"))?;
    // Every backend but NCCL sums host memory: its collectives run on the CPU.
    match backend {
        Backend::Nccl => measure(&a, &group, &name),
        _ => rmlx::with_device(rmlx::Device::cpu(), || measure(&a, &group, &name)),
    }
}

fn measure(a: &Args, group: &Group, name: &str) -> Result<()> {
    let (rank, n) = (group.rank(), group.size());
    // Rank r contributes r + 1 everywhere: every element of the sum is n (n + 1) / 2.
    let want = (n * (n + 1) / 2) as f32;
    for &bytes in &a.sizes {
        let len = (bytes / 4).max(1);
        let x = ops::full(&[len as i32], &Array::scalar((rank + 1) as f32), Dtype::Float32)?;
        for _ in 0..3 {
            let s = group.all_sum(&x)?;
            rmlx::eval([&s])?;
        }
        let mut times = Vec::with_capacity(a.iters);
        let mut last = None;
        for _ in 0..a.iters {
            let start = Instant::now();
            let s = group.all_sum(&x)?;
            rmlx::eval([&s])?;
            times.push(start.elapsed().as_secs_f64());
            last = Some(s);
        }
        let got = last.expect("at least one iteration").to_vec::<f32>()?;
        if let Some(bad) = got.iter().position(|&v| v != want) {
            bail!("rank {rank}: element {bad} of the all-sum is {}, not {want}", got[bad]);
        }
        times.sort_by(f64::total_cmp);
        let median = percentile(&times, 0.5);
        let bus = 2.0 * (n as f64 - 1.0) / n as f64 * (len * 4) as f64 / median / 1e9;
        if rank != 0 {
            continue;
        }
        if a.json {
            let row = serde_json::json!({"backend": name, "ranks": n, "bytes": len * 4,
                "median_us": median * 1e6, "p10_us": percentile(&times, 0.1) * 1e6,
                "p90_us": percentile(&times, 0.9) * 1e6, "bus_gb_s": bus, "iters": a.iters});
            println!("{row}");
        } else {
            println!(
                "all_sum over {n} ranks ({name}), {} bytes: median {:.1} µs (p10 {:.1}, p90 {:.1}), bus {bus:.2} GB/s",
                len * 4,
                median * 1e6,
                percentile(&times, 0.1) * 1e6,
                percentile(&times, 0.9) * 1e6,
            );
        }
    }
    Ok(())
}
