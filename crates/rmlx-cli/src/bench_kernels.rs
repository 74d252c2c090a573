//! `rmlx bench-kernels`: how fast the quantised matrix-vector products of a decoding step read their
//! weights, alone, through rmlx's own CUDA kernel (on other devices: a quantised layer's product)
//! and through MLX's `quantized_matmul`, beside the device's copy bandwidth
//! ([`rmlx_lm::roofline`]). One line a shape; the default shapes are Qwen3-8B's and
//! Llama-3.2-1B's projections and output heads. Products are timed from the host, many to an
//! evaluation: small ones measure the host's cost per product as much as the device's.

use crate::common::parse_dtype;
use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;

/// Qwen3-8B (q/o, k/v, gate/up, down, head) and Llama-3.2-1B (q/o, k/v, gate/up, down, head):
/// `output x input`.
const DEFAULT_SHAPES: &str = "4096x4096,1024x4096,12288x4096,4096x12288,151936x4096,\
                              2048x2048,512x2048,8192x2048,2048x8192,128256x2048";

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Bits a weight (4 or 8).
    #[arg(long, default_value_t = 4)]
    bits: i32,
    /// Values a quantisation group (32, 64 or 128).
    #[arg(long, default_value_t = 64)]
    group_size: i32,
    /// Activations and scales: bfloat16, float16 or float32 (bf16, f16, f32).
    #[arg(long, default_value = "bfloat16")]
    dtype: String,
    /// Weight shapes, `OUTPUTxINPUT`, comma-separated.
    #[arg(long, default_value = DEFAULT_SHAPES)]
    shapes: String,
    /// Rows of activations a product takes (1: a decoding step; a speculative verification pass
    /// of K drafts takes K + 1).
    #[arg(long, default_value_t = 1)]
    rows: i32,
    /// One JSON line a shape.
    #[arg(long)]
    json: bool,
}

fn parse_shape(s: &str) -> Result<(i32, i32)> {
    let parsed = s.trim().split_once('x').and_then(|(o, i)| Some((o.parse::<i32>().ok()?, i.parse::<i32>().ok()?)));
    match parsed {
        Some((o, i)) if o > 0 && i > 0 => Ok((o, i)),
        _ => bail!("--shapes: `{s}` is not OUTPUTxINPUT with two positive integers"),
    }
}

pub fn run(a: Args) -> Result<()> {
    let dtype = parse_dtype(&a.dtype).context("--dtype")?;
    if !matches!(a.bits, 4 | 8) || !matches!(a.group_size, 32 | 64 | 128) {
        bail!("--bits must be 4 or 8 and --group-size 32, 64 or 128");
    }
    let shapes = a.shapes.split(',').map(parse_shape).collect::<Result<Vec<_>>>()?;
    if let Some((o, i)) = shapes.iter().find(|(_, i)| i % a.group_size != 0) {
        bail!("--shapes: {o}x{i}: the input size is not a multiple of the group size {}", a.group_size);
    }
    let bandwidth = rmlx_lm::roofline::measure_bandwidth()?;
    let device = format!("{:?}", rmlx::default_device().kind).to_lowercase();
    if !a.json {
        eprintln!(
            "{device}: copy bandwidth {:.0} GB/s; {}-bit, group {}, {dtype:?}, {} rows",
            bandwidth / 1e9,
            a.bits,
            a.group_size,
            a.rows
        );
        println!("{:>14} {:>10} {:>16} {:>16} {:>8}", "shape", "MB", "rmlx GB/s", "mlx GB/s", "ratio");
    }
    for (output, input) in shapes {
        let r = rmlx_lm::roofline::quantized_matvec_rate(output, input, a.bits, a.group_size, dtype, a.rows)?;
        if a.json {
            println!(
                "{}",
                serde_json::json!({
                    "device": device, "shape": [output, input], "bits": a.bits, "group_size": a.group_size,
                    "dtype": format!("{dtype:?}").to_lowercase(), "rows": a.rows, "weight_bytes": r.bytes,
                    "copy_gbs": bandwidth / 1e9, "rmlx_gbs": r.rmlx / 1e9, "mlx_gbs": r.mlx / 1e9,
                    "rmlx_fraction": r.rmlx / bandwidth, "mlx_fraction": r.mlx / bandwidth,
                })
            );
        } else {
            println!(
                "{:>14} {:>10.1} {:>9.0} ({:>3.0} %) {:>9.0} ({:>3.0} %) {:>7.2}×",
                format!("{output}x{input}"),
                r.bytes as f64 / 1e6,
                r.rmlx / 1e9,
                100.0 * r.rmlx / bandwidth,
                r.mlx / 1e9,
                100.0 * r.mlx / bandwidth,
                r.rmlx / r.mlx
            );
        }
    }
    Ok(())
}
