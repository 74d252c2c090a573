//! `mlx_lm.convert` in Rust: a Hugging Face model folder (or a GGUF file) written as an MLX model
//! folder the way mlx-lm writes one: mlx-lm's tensor names (experts stacked, a tied head and
//! other towers dropped), floating tensors cast to the asked or configured dtype, and, with
//! quantisation, every linear and embedding layer packed by MLX's own `quantize` (affine 2–8 bits,
//! `mxfp4`, `mxfp8`, `nvfp4`; mlx-lm's mixed recipes), `config.json` with its `quantization` block
//! and per-layer entries, `model.safetensors` (or shards of at most 5 GB) with an index, and the
//! tokenizer, template and generation files beside them. The folder appears whole or not at all:
//! it is written under a temporary name and renamed.
//!
//! ```no_run
//! use rmlx_lm::convert::{convert, ConvertOptions, QuantizeOptions};
//! let opts = ConvertOptions { quantize: Some(QuantizeOptions { bits: Some(4), ..Default::default() }), ..Default::default() };
//! let done = convert("Qwen3-0.6B".as_ref(), "Qwen3-0.6B-4bit".as_ref(), &opts)?;
//! println!("{} tensors, {:.2} bits per weight", done.tensors, done.bits_per_weight);
//! # Ok::<(), rmlx_lm::Error>(())
//! ```

mod quantize;
mod source;
mod write;

pub use quantize::{MixedRecipe, QuantizeOptions};

use crate::models::spec::{self, Tensors};
use crate::{Error, Result};
use rmlx::quantization::{dequantize, Quantized};
use rmlx::Dtype;
use serde_json::Value;
use std::path::Path;

/// mlx-lm's largest shard: 5 GiB.
pub const MAX_SHARD_BYTES: u64 = 5 << 30;

/// What [`convert`] does beyond renaming.
#[derive(Clone, Debug)]
pub struct ConvertOptions {
    /// Quantise the linear and embedding layers (`-q`).
    pub quantize: Option<QuantizeOptions>,
    /// Unpack quantised layers to dense weights (`-d`).
    pub dequantize: bool,
    /// The dtype of floating tensors; `None`: the config's `torch_dtype` (as mlx-lm reads it),
    /// else as stored.
    pub dtype: Option<Dtype>,
    /// Progress on stderr.
    pub progress: bool,
    /// Bytes of tensors a safetensors file holds at most (a larger tensor gets a file of its own).
    pub max_shard_bytes: u64,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            quantize: None,
            dequantize: false,
            dtype: None,
            progress: false,
            max_shard_bytes: MAX_SHARD_BYTES,
        }
    }
}

/// What a conversion wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct Converted {
    /// Tensors written.
    pub tensors: usize,
    /// Layers stored quantised.
    pub quantized_layers: usize,
    /// The safetensors files, in order.
    pub files: Vec<String>,
    /// Bytes of tensors written.
    pub bytes: u64,
    /// Parameters, quantised ones counted unpacked (mlx-lm's `total_parameters`).
    pub parameters: u64,
    /// Bits stored per parameter.
    pub bits_per_weight: f64,
}

/// Converts the model at `src` (a Hugging Face folder, an MLX folder, or a `.gguf` file) into the
/// new folder `dst` (which must not exist).
pub fn convert(src: &Path, dst: &Path, opts: &ConvertOptions) -> Result<Converted> {
    if opts.quantize.is_some() && opts.dequantize {
        return Err(Error::InvalidParameter("choose either quantize or dequantize, not both".into()));
    }
    if dst.exists() {
        return Err(Error::InvalidParameter(format!(
            "{} exists already: give a new folder to write the converted model to",
            dst.display()
        )));
    }
    let plan = opts.quantize.as_ref().map(QuantizeOptions::plan).transpose()?;
    let mut source = source::read(src, opts.progress)?;
    let cfg = spec::parse_config(Value::Object(source.config.clone()))?;
    let arch = spec::of(&cfg)?;
    shared_sanitize(&cfg, &mut source.tensors);
    (arch.mlx_lm.sanitize)(&cfg, &mut source.tensors)?;

    let quantized: Vec<String> =
        source.tensors.keys().filter_map(|n| n.strip_suffix(".scales")).map(str::to_string).collect();
    // A GGUF file has only llama.cpp's blocks: quantising it as asked unpacks them first.
    let unpack = opts.dequantize || (plan.is_some() && source.from_gguf);
    if let (Some(_), false, Some(p)) = (&plan, unpack, quantized.first()) {
        return Err(Error::InvalidParameter(format!(
            "`{p}` is quantised already: convert from the unquantised checkpoint, or dequantise it first (-d)"
        )));
    }
    if let Some(dtype) = opts.dtype.or_else(|| configured_dtype(&source.config)) {
        for a in source.tensors.values_mut() {
            if a.dtype().is_floating() {
                *a = a.astype(dtype)?;
            }
        }
    }
    if unpack && !quantized.is_empty() {
        if !opts.dequantize {
            tracing::info!("unpacking llama.cpp's {} quantised layers to quantise them as asked", quantized.len());
        }
        for p in &quantized {
            let q = quantized_layer(&cfg, &mut source.tensors, p)?;
            source.tensors.insert(format!("{p}.weight"), dequantize(&q, None)?);
        }
        source.config.remove("quantization");
        source.config.remove("quantization_config");
    }
    if let Some(plan) = &plan {
        plan.apply(&mut source, arch.mlx_lm.quantization, cfg.num_hidden_layers as i32, opts.progress)?;
    }
    source.config.remove("_name_or_path");
    source.config.remove("vision_config");
    write::folder(dst, &source, opts)
}

/// The steps of mlx-lm's `sanitize` every architecture shares: rotary frequency tables, vision
/// towers and a tied output head go.
fn shared_sanitize(cfg: &crate::config::ModelConfig, t: &mut Tensors) {
    let tied = cfg.tied();
    t.retain(|name, _| {
        let tower = ["vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."]
            .iter()
            .any(|p| name.starts_with(p));
        let head = tied && matches!(name.as_str(), "lm_head.weight" | "language_model.lm_head.weight");
        !(tower || head || name.contains("rotary_emb.inv_freq"))
    });
}

/// The dtype mlx-lm casts to when none is asked: the config's `torch_dtype`, else its text
/// config's `dtype`, when it is one of float16, bfloat16 and float32.
fn configured_dtype(config: &serde_json::Map<String, Value>) -> Option<Dtype> {
    let name = config
        .get("torch_dtype")
        .and_then(Value::as_str)
        .or_else(|| config.get("text_config")?.get("dtype")?.as_str())?;
    Some(match name {
        "float16" => Dtype::Float16,
        "bfloat16" => Dtype::Bfloat16,
        "float32" => Dtype::Float32,
        _ => return None,
    })
}

/// The quantised layer `prefix` (its packed weight, scales and biases taken out of `t`), with
/// the bits, group size and mode the config gives it.
fn quantized_layer(cfg: &crate::config::ModelConfig, t: &mut Tensors, prefix: &str) -> Result<Quantized> {
    let take = |t: &mut Tensors, part: &str| t.remove(&format!("{prefix}.{part}"));
    let (group_size, bits) = cfg.quantization_of(prefix)?.ok_or_else(|| {
        Error::Config(format!("tensor `{prefix}.scales` is quantised but config.json has no `quantization` block"))
    })?;
    let mode = cfg.quantization_mode_of(prefix).unwrap_or_else(|| "affine".into());
    let mode = crate::checkpoint::quantization_mode(prefix, &mode, bits, group_size)?;
    let weight = take(t, "weight").ok_or_else(|| Error::MissingTensor(format!("{prefix}.weight")))?;
    let scales = take(t, "scales").expect("listed by its scales");
    let biases = take(t, "biases");
    Ok(Quantized { weight, scales, biases, group_size, bits, mode })
}
