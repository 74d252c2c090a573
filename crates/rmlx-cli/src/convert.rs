//! `rmlx convert`: `mlx_lm.convert`'s flags over [`rmlx_lm::convert`]: a Hugging Face folder (or a
//! GGUF file, the default model's when `--model` is absent) written as an MLX folder, quantised
//! (`-q`), dequantised (`-d`) or cast (`--dtype`), as mlx-lm writes it.

use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use rmlx::quantization::QuantMode;
use rmlx_lm::convert::{ConvertOptions, MixedRecipe, QuantizeOptions};
use std::path::PathBuf;

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// The model to convert: a Hugging Face folder, an MLX folder or a GGUF file (default: the
    /// default model's GGUF).
    #[arg(long, visible_alias = "hf-path")]
    model: Option<PathBuf>,
    /// Where to write the converted model (a new folder).
    #[arg(long, default_value = "mlx_model")]
    mlx_path: PathBuf,
    /// Quantise the linear and embedding layers.
    #[arg(short = 'q', long)]
    quantize: bool,
    /// Quantisation group size (default: the mode's, 64 for affine).
    #[arg(long)]
    q_group_size: Option<i32>,
    /// Bits per weight (default: the mode's, 4 for affine).
    #[arg(long)]
    q_bits: Option<i32>,
    /// Quantisation mode.
    #[arg(long, default_value = "affine", value_parser = ["affine", "mxfp4", "nvfp4", "mxfp8"])]
    q_mode: String,
    /// A mixed-bit recipe (mlx-lm's): value and down projections of some blocks, and the head, at
    /// more bits.
    #[arg(long, value_parser = ["mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6"])]
    quant_predicate: Option<String>,
    /// The dtype of the floating tensors (default: config.json's `torch_dtype`, else as stored).
    #[arg(long, value_parser = ["float16", "bfloat16", "float32"])]
    dtype: Option<String>,
    /// Unpack a quantised model's layers to dense weights.
    #[arg(short = 'd', long)]
    dequantize: bool,
    /// Print a JSON summary on stdout.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let mode = match a.q_mode.as_str() {
        "mxfp4" => QuantMode::Mxfp4,
        "nvfp4" => QuantMode::Nvfp4,
        "mxfp8" => QuantMode::Mxfp8,
        _ => QuantMode::Affine,
    };
    let recipe = a.quant_predicate.as_deref().map(str::parse::<MixedRecipe>).transpose()?;
    let quantize_flags = a.q_bits.is_some() || a.q_group_size.is_some() || recipe.is_some() || a.q_mode != "affine";
    anyhow::ensure!(a.quantize || !quantize_flags, "--q-bits, --q-group-size, --q-mode and --quant-predicate need -q");
    let opts = ConvertOptions {
        quantize: a.quantize.then_some(QuantizeOptions { bits: a.q_bits, group_size: a.q_group_size, mode, recipe }),
        dequantize: a.dequantize,
        dtype: a.dtype.as_deref().map(crate::common::parse_dtype).transpose()?,
        progress: true,
        ..ConvertOptions::default()
    };
    let source = match a.model {
        Some(p) => p,
        None => {
            eprintln!("no --model given: converting the default model, {}", rmlx_lm::registry::DEFAULT_MODEL_NAME);
            rmlx_lm::registry::default_model().context("fetching the default model")?
        }
    };
    let done = rmlx_lm::convert::convert(&source, &a.mlx_path, &opts)
        .with_context(|| format!("converting {}", source.display()))?;
    eprintln!(
        "wrote {} tensors ({} quantised layers, {:.3} bits per weight, {:.1} MB) in {} file(s) to {}",
        done.tensors,
        done.quantized_layers,
        done.bits_per_weight,
        done.bytes as f64 / 1e6,
        done.files.len(),
        a.mlx_path.display()
    );
    if a.json {
        let summary = serde_json::json!({
            "path": a.mlx_path,
            "tensors": done.tensors,
            "quantized_layers": done.quantized_layers,
            "bits_per_weight": done.bits_per_weight,
            "bytes": done.bytes,
            "parameters": done.parameters,
            "files": done.files,
        });
        println!("{summary}");
    }
    Ok(())
}
