//! Loading a model from a Hugging Face folder (config.json, safetensors shards, tokenizer files,
//! generation_config.json; plain or MLX-quantised) or a GGUF file (see [`crate::gguf_model`]),
//! into a [`LoadedModel`]: the model, its tokenizer, chat template and stop ids.
//!
//! A model file is untrusted input: safetensors headers are validated before MLX reads them
//! ([`crate::safetensors_header`]), config values are type- and range-checked by name
//! ([`crate::config`]), and the checkpoint is checked against the config ([`crate::checkpoint`]),
//! so that a broken or lying file gets an [`Error`] rather than a panic, an abort or garbage.

use crate::chat::ChatTemplate;
use crate::config::{Architecture, ModelConfig};
use crate::models::{self, Model};
use crate::nn::Builder;
use crate::tokenizer::Tokenizer;
use crate::vocab::VocabBounds;
use crate::weights::{Weight, Weights};
use crate::{Error, Result};
use rmlx::quantization::{QuantMode, Quantized};
use rmlx::{Array, Dtype};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// How to load.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Compute dtype; default: the checkpoint's (for GGUF files: float32 on the CPU, else bfloat16).
    pub dtype: Option<Dtype>,
    /// Dequantise quantised weights at load (`Some(true)`) or keep them all quantised
    /// (`Some(false)`). Default: keep them, except on the CPU those rmlx's CPU products do not
    /// take ([`crate::nn::cpu_qmm::serves`]: affine 4- and 8-bit ones), where MLX's quantised
    /// matmul is slow.
    pub dequantize: Option<bool>,
    /// Show progress and a summary on stderr.
    pub progress: bool,
    /// Load a folder without tokenizer.json, with a placeholder tokenizer whose tokens are `<id>`
    /// (benchmarks of random-weight checkpoints).
    pub allow_missing_tokenizer: bool,
}

/// A model ready to generate with.
pub struct LoadedModel {
    pub model: Box<dyn Model>,
    pub tokenizer: Tokenizer,
    /// The checkpoint's chat template, else the family's built-in one.
    pub chat_template: ChatTemplate,
    /// Token ids that end generation (config, generation_config and tokenizer EOS).
    pub eos_ids: Vec<u32>,
    /// The compute dtype.
    pub dtype: Dtype,
    /// Parameters (quantised matrices counted unpacked).
    pub parameters: u64,
    /// Bytes of weights held.
    pub weight_bytes: u64,
    /// Where it came from.
    pub source: PathBuf,
    /// Checkpoint tensors the model did not use (also reported on stderr at load).
    pub unused_tensors: Vec<String>,
    /// Embedding rows versus tokenizer ids: the id check every input goes through and the mask
    /// that keeps padding ids from being sampled.
    pub vocab: VocabBounds,
}

impl LoadedModel {
    /// Each layer's sliding window (`None`: the layer attends to every position).
    pub fn layer_windows(&self) -> Vec<Option<usize>> {
        self.model.new_caches(None).iter().map(crate::cache::KvCache::window).collect()
    }

    /// Bytes of one position's keys and values in one layer, in the compute dtype.
    pub fn kv_bytes_per_layer_position(&self) -> usize {
        let cfg = self.model.config();
        2 * cfg.kv_heads() as usize * cfg.head_dim() as usize * self.dtype.size()
    }
}

/// Loads a Hugging Face folder or a GGUF file (recognised by its magic bytes `GGUF`, whatever its
/// extension; a `.gguf` file without them gets [`Error::Corrupt`]).
pub fn load(path: impl AsRef<Path>, opts: &LoadOptions) -> Result<LoadedModel> {
    let path = path.as_ref();
    if path.is_file() {
        if is_gguf(path)? || path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
            return crate::gguf_model::load(path, opts);
        }
        return Err(Error::Corrupt {
            path: path.display().to_string(),
            reason: "not a GGUF file (no `GGUF` magic) and not a model folder".into(),
        });
    }
    if !path.is_dir() {
        return Err(Error::MissingFile(format!("{} is neither a model folder nor a GGUF file", path.display())));
    }
    load_dir(path, opts)
}

/// Whether a file starts with GGUF's magic bytes.
fn is_gguf(path: &Path) -> Result<bool> {
    use std::io::Read;
    let mut magic = [0u8; 4];
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let n = f.read(&mut magic).map_err(|e| Error::io(path, e))?;
    Ok(n == 4 && &magic == b"GGUF")
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::Config(format!("{} is not valid JSON: {e}", path.display())))
}

fn load_dir(dir: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    let config_path = dir.join("config.json");
    if !config_path.is_file() {
        return Err(Error::MissingFile(format!("{} (a model folder needs config.json)", config_path.display())));
    }
    let mut cfg = ModelConfig::from_value(read_json(&config_path)?)?;
    let mut weights = read_weights(dir, opts.progress)?;
    normalize_names(&mut weights);
    if cfg.model_type.is_empty() {
        cfg.model_type = guess_from_weights(&weights).into();
    }
    group_quantized(&mut weights, &cfg)?;
    infer_head_dim(&mut cfg, &weights);
    let dtype = opts.dtype.unwrap_or_else(|| checkpoint_dtype(&cfg, &weights));

    let mut tokenizer = if opts.allow_missing_tokenizer && !dir.join("tokenizer.json").is_file() {
        // The placeholder holds one entry per id: size it from the checkpoint, not the config alone.
        let embed = "model.embed_tokens.weight";
        let rows = weights.get(embed).ok_or_else(|| Error::MissingTensor(embed.into()))?.shape();
        if rows.first() != Some(&cfg.vocab_size) {
            let expected = vec![cfg.vocab_size, cfg.hidden_size];
            return Err(Error::ShapeMismatch { name: embed.into(), expected, found: rows });
        }
        placeholder_tokenizer(cfg.vocab_size as usize)?
    } else {
        Tokenizer::from_dir(dir)?
    };
    let mut eos = cfg.eos_ids();
    let gen_config = dir.join("generation_config.json");
    if gen_config.is_file() {
        eos.extend(crate::config::ids_of(read_json(&gen_config)?.get("eos_token_id")));
    }
    let template = match ChatTemplate::from_dir(dir, tokenizer.bos_token(), tokenizer.eos_token())? {
        Some(t) => t,
        None => ChatTemplate::fallback(family(&cfg)?, tokenizer.bos_token(), tokenizer.eos_token())?,
    };
    for &id in &eos {
        tokenizer.add_eos_id(id);
    }
    finish(cfg, weights, tokenizer, template, dtype, opts, dir)
}

/// Builds the model, evaluates its weights (with progress) and checks the tokenizer fits.
pub(crate) fn finish(
    cfg: ModelConfig,
    weights: Weights,
    tokenizer: Tokenizer,
    chat_template: ChatTemplate,
    dtype: Dtype,
    opts: &LoadOptions,
    source: &Path,
) -> Result<LoadedModel> {
    let started = Instant::now();
    let on_cpu = rmlx::default_device().kind == rmlx::DeviceType::Cpu;
    crate::checkpoint::check_layers(&cfg, &weights, source)?;
    let mut b = Builder::new(weights, dtype, opts.dequantize == Some(true));
    b.dequantize_unserved = opts.dequantize.is_none() && on_cpu;
    let model = models::build(&cfg, &mut b)?;
    let unused_tensors = crate::checkpoint::unused_tensors(&b.remaining());
    crate::checkpoint::warn_unused(&unused_tensors, source);
    let arrays = b.take_built();
    let bar = crate::progress::Progress::new(opts.progress, "loading weights", arrays.len() as u64);
    let mut weight_bytes = 0u64;
    for chunk in arrays.chunks(16) {
        rmlx::eval(chunk.iter())?;
        weight_bytes += chunk.iter().map(|a| a.nbytes() as u64).sum::<u64>();
        bar.inc(chunk.len() as u64);
    }
    bar.finish();
    let parameters = b.parameters();
    // The tokenizer may be larger than the embedding (Gemma 3's `<image_soft_token>`) or smaller
    // (padding rows): see `crate::vocab`.
    let vocab = VocabBounds::new(cfg.vocab_size.max(0) as usize, &tokenizer, dtype)?;
    let mut eos_ids: Vec<u32> = tokenizer.eos_ids().to_vec();
    eos_ids.sort_unstable();
    eos_ids.dedup();
    if opts.progress {
        let quantized = match (b.quantized_kept, b.quantized_dequantized) {
            (_, 0) => String::new(),
            (0, _) => ", dequantised".to_string(),
            (kept, dense) => format!(", {dense} of {} quantised matrices dequantised", kept + dense),
        };
        tracing::info!(
            "loaded {} ({}, {:.1}M parameters, {:.2} GB of weights as {}{}) in {:.1}s",
            source.display(),
            cfg.model_type,
            parameters as f64 / 1e6,
            weight_bytes as f64 / 1e9,
            dtype.name(),
            quantized,
            started.elapsed().as_secs_f64()
        );
    }
    Ok(LoadedModel {
        model,
        tokenizer,
        chat_template,
        eos_ids,
        dtype,
        parameters,
        weight_bytes,
        source: source.to_path_buf(),
        unused_tensors,
        vocab,
    })
}

/// A word-level tokenizer whose tokens are `<0>`, `<1>`, … (decoding shows the ids).
fn placeholder_tokenizer(vocab: usize) -> Result<Tokenizer> {
    let map: serde_json::Map<String, Value> = (0..vocab).map(|i| (format!("<{i}>"), Value::from(i))).collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": map, "unk_token": "<0>"}
    });
    let inner: tokenizers::Tokenizer =
        json.to_string().parse().map_err(|e| Error::Tokenizer(format!("placeholder: {e}")))?;
    Ok(Tokenizer::from_parts(inner, None, None))
}

/// The built-in chat template family of an architecture.
pub(crate) fn family(cfg: &ModelConfig) -> Result<&'static str> {
    Ok(match cfg.architecture()? {
        Architecture::Llama => "llama3",
        Architecture::Qwen2 | Architecture::Qwen3 => "chatml",
        Architecture::Gemma3 => "gemma",
    })
}

/// The safetensors files: those the index names (all must exist), else every `*.safetensors`.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let map = read_json(&index)?;
        let Some(Value::Object(m)) = map.get("weight_map") else {
            return Err(Error::Config(format!("{}: no `weight_map`", index.display())));
        };
        let mut files: Vec<String> = m.values().filter_map(Value::as_str).map(str::to_string).collect();
        files.sort();
        files.dedup();
        return files
            .into_iter()
            .map(|f| {
                // A shard is a file of the folder: no paths out of it.
                let mut parts = Path::new(&f).components();
                if !matches!((parts.next(), parts.next()), (Some(std::path::Component::Normal(_)), None)) {
                    return Err(Error::Config(format!(
                        "{}: shard `{f}` is not a file name in the model folder",
                        index.display()
                    )));
                }
                let p = dir.join(&f);
                if p.is_file() {
                    Ok(p)
                } else {
                    Err(Error::MissingFile(format!(
                        "shard {f} (named by model.safetensors.index.json) is not in {}",
                        dir.display()
                    )))
                }
            })
            .collect();
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::MissingFile(format!("no *.safetensors weights in {}", dir.display())));
    }
    Ok(files)
}

fn read_weights(dir: &Path, progress: bool) -> Result<Weights> {
    let files = shard_files(dir)?;
    let mut weights = Weights::new();
    for f in &files {
        let header = crate::safetensors_header::check_file(f)?;
        let st = rmlx::io::load_safetensors(f)?;
        for t in header {
            let a =
                st.arrays.get(&t.name).filter(|a| a.shape() == t.shape.as_slice()).ok_or_else(|| Error::Corrupt {
                    path: f.display().to_string(),
                    reason: format!("MLX did not read tensor `{}` as its header describes it ({:?})", t.name, t.shape),
                })?;
            weights.insert(t.name, Weight::Dense(a.clone()));
        }
    }
    if progress {
        tracing::info!(
            "reading {} ({} file{}, {} tensors)",
            dir.display(),
            files.len(),
            if files.len() == 1 { "" } else { "s" },
            weights.len()
        );
    }
    Ok(weights)
}

/// Multimodal and wrapped checkpoints keep the text model under `language_model.`: bring those
/// names back to `model.*` / `lm_head.*` and drop the other towers.
fn normalize_names(w: &mut Weights) {
    let names: Vec<String> = w.names().map(str::to_string).collect();
    let wrapped = !names.iter().any(|n| n.starts_with("model.layers.") || n.starts_with("model.embed_tokens."));
    for name in names {
        let renamed = if let Some(rest) = name.strip_prefix("model.language_model.") {
            Some(format!("model.{rest}"))
        } else if let Some(rest) = name.strip_prefix("language_model.") {
            Some(if rest.starts_with("model.") || rest.starts_with("lm_head.") {
                rest.to_string()
            } else {
                format!("model.{rest}")
            })
        } else if wrapped && !name.starts_with("lm_head.") {
            None
        } else {
            continue;
        };
        let t = w.take_opt(&name).expect("listed");
        if let Some(new) = renamed {
            w.insert(new, t);
        } else if !(name.starts_with("vision_tower.")
            || name.starts_with("multi_modal_projector.")
            || name.starts_with("model.vision"))
        {
            w.insert(name, t);
        }
    }
    for name in w.names().filter(|n| n.contains("rotary_emb.inv_freq")).map(str::to_string).collect::<Vec<_>>() {
        w.take_opt(&name);
    }
}

fn guess_from_weights(w: &Weights) -> &'static str {
    if w.contains("model.layers.0.self_attn.q_norm.weight") {
        "qwen3"
    } else if w.contains("model.layers.0.self_attn.q_proj.bias") {
        "qwen2"
    } else {
        "llama"
    }
}

/// `X.weight` + `X.scales` (+ `X.biases`) → one quantised weight, with the bits and group size of
/// the config's `quantization` block (per-layer entries override), checked against the shapes.
fn group_quantized(w: &mut Weights, cfg: &ModelConfig) -> Result<()> {
    let prefixes: Vec<String> = w.names().filter_map(|n| n.strip_suffix(".scales")).map(str::to_string).collect();
    if prefixes.is_empty() {
        return Ok(());
    }
    let block = cfg.quantization_block().ok_or_else(|| {
        Error::Config(format!(
            "tensor `{}.scales` is quantised but config.json has no `quantization` block",
            prefixes[0]
        ))
    })?;
    if let Some(mode) = block.get("mode").and_then(Value::as_str) {
        if mode != "affine" {
            return Err(Error::Config(format!("quantization mode `{mode}` is not supported (affine only)")));
        }
    }
    for p in prefixes {
        let (gs, bits) = cfg.quantization_of(&p)?.expect("the block exists");
        crate::checkpoint::check_quantization(&p, bits, gs)?;
        let Weight::Dense(weight) = w.take(&format!("{p}.weight"))? else { unreachable!("safetensors are dense") };
        let Weight::Dense(scales) = w.take(&format!("{p}.scales"))? else { unreachable!() };
        let biases = match w.take_opt(&format!("{p}.biases")) {
            Some(Weight::Dense(b)) => Some(b),
            _ => None,
        };
        check_quantized_shapes(&p, &weight, &scales, gs, bits)?;
        let q = Quantized { weight, scales, biases, group_size: gs, bits, mode: QuantMode::Affine };
        w.insert(format!("{p}.weight"), Weight::Quantized(q));
    }
    Ok(())
}

fn check_quantized_shapes(p: &str, weight: &Array, scales: &Array, gs: i32, bits: i32) -> Result<()> {
    if weight.dtype() != Dtype::Uint32 {
        return Err(Error::Config(format!(
            "`{p}.weight` has dtype {} but quantised weights are uint32",
            weight.dtype().name()
        )));
    }
    let (ws, ss) = (weight.shape(), scales.shape());
    let groups = ws.last().map_or(0, |&w| w as i64 * 32 / bits.max(1) as i64 / gs.max(1) as i64);
    let expected = [&ws[..ws.len().saturating_sub(1)], &[i32::try_from(groups).unwrap_or(i32::MAX)]].concat();
    if ss != expected.as_slice() {
        return Err(Error::ShapeMismatch { name: format!("{p}.scales"), expected, found: ss.to_vec() });
    }
    Ok(())
}

/// A missing `head_dim` is read off q_proj (`out = heads · head_dim`).
fn infer_head_dim(cfg: &mut ModelConfig, w: &Weights) {
    if cfg.head_dim.is_some() {
        return;
    }
    if let Some(q) = w.get("model.layers.0.self_attn.q_proj.weight") {
        let rows = q.shape()[0];
        if rows % cfg.num_attention_heads == 0 {
            cfg.head_dim = Some(rows / cfg.num_attention_heads);
        }
    }
}

fn checkpoint_dtype(cfg: &ModelConfig, w: &Weights) -> Dtype {
    match cfg.dtype_name() {
        Some("float32") => return Dtype::Float32,
        Some("float16") => return Dtype::Float16,
        Some("bfloat16") => return Dtype::Bfloat16,
        _ => {}
    }
    match w.get("model.embed_tokens.weight") {
        Some(Weight::Dense(a)) if a.dtype().is_floating() => a.dtype(),
        Some(Weight::Quantized(q)) => q.scales.dtype(),
        _ => Dtype::Float32,
    }
}
