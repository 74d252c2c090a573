//! Fusing adapters into the base weights: every adapted linear's weight becomes `W + scale·(A B)ᵀ`,
//! and the model is written as a Hugging Face folder (the source folder's config, tokenizer and
//! template files, plus `model.safetensors`, sharded with an index above 5 GB) that rmlx, mlx-lm and
//! transformers load.
//!
//! A quantised base is written dequantised (the `quantization` entries leave the config), in the
//! model's compute dtype. Gemma's norms go back to the checkpoint's `w` (rmlx keeps `1 + w`), and
//! Phi-3's projections are joined again under its fused names.

use crate::config::Architecture;
use crate::nn::Role;
use crate::{Error, LoadedModel, Result};
use rmlx::quantization::{dequantize, QuantMode, Quantized};
use rmlx::{Array, Dtype};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// Largest shard written.
const SHARD_BYTES: u64 = 5 << 30;

/// What [`fuse`] wrote.
#[derive(Debug, PartialEq)]
pub struct FuseSummary {
    /// Linear layers whose adapter was merged.
    pub fused: usize,
    /// Tensors written.
    pub tensors: usize,
    pub shards: usize,
    /// Whether quantised weights were dequantised.
    pub dequantized: bool,
}

/// The weights of the layers (linear or stacked experts) that an adapter or quantisation changes,
/// as fusing writes them.
#[derive(Default)]
struct FusedLayers {
    /// `<layer>.weight` → the dense weight with the adapter added.
    replaced: BTreeMap<String, Array>,
    /// The layers that had an adapter.
    adapted: Vec<String>,
    /// Whether any layer was quantised.
    quantized: bool,
    failure: Option<Error>,
}

impl FusedLayers {
    /// Layer `path`: its fused weight (`fused`) replaces its own when it is adapted or quantised.
    fn add(&mut self, path: &str, quantized: bool, adapted: bool, fused: impl FnOnce() -> Result<Array>) {
        self.quantized |= quantized;
        if !(adapted || quantized) || self.failure.is_some() {
            return;
        }
        match fused() {
            Ok(w) => {
                self.replaced.insert(format!("{path}.weight"), w);
                if adapted {
                    self.adapted.push(path.to_string());
                }
            }
            Err(e) => self.failure = Some(e),
        }
    }
}

/// The tensors of the fused model under the checkpoint's names.
pub fn fused_tensors(lm: &mut LoadedModel) -> Result<(BTreeMap<String, Array>, usize, bool)> {
    let mut layers = FusedLayers::default();
    lm.model
        .visit_linears("", &mut |path, l| layers.add(path, l.is_quantized(), l.lora().is_some(), || l.fused_weight()));
    lm.model
        .visit_switches("", &mut |path, s| layers.add(path, s.is_quantized(), s.lora().is_some(), || s.fused_weight()));
    let FusedLayers { replaced, adapted, mut quantized, failure } = layers;
    if let Some(e) = failure {
        return Err(e);
    }
    let gemma =
        matches!(crate::models::spec::of(lm.model.config())?.architecture, Architecture::Gemma3 | Architecture::Gemma2);
    let mut params = Vec::new();
    lm.model.visit("", &mut |name, role, a| params.push((name.to_string(), role, a.clone())));
    let mut out = BTreeMap::new();
    for (name, role, a) in params {
        let owner = name.rsplit_once('.').map_or("", |(p, _)| p);
        if role.is_adapter() {
            continue;
        }
        if role == Role::Quantization && replaced.contains_key(&format!("{owner}.weight")) {
            continue; // a dequantised linear's quantisation arrays
        }
        let a = match replaced.get(&name) {
            Some(w) => w.clone(),
            // Gemma's norms are kept as `1 + w`; checkpoints store `w`.
            None if gemma && role == Role::Norm => (a.astype(Dtype::Float32)? - 1.0)?.astype(a.dtype())?,
            None => a,
        };
        out.insert(name, a);
    }
    // Other quantised tensors (the embedding) are dequantised too, with the config's bits and
    // group size (a per-tensor entry of the `quantization` block overrides them).
    let packed: Vec<String> = out.keys().filter(|n| out[*n].dtype() == Dtype::Uint32).cloned().collect();
    for name in packed {
        let prefix = name.strip_suffix(".weight").unwrap_or(&name).to_string();
        let (gs, bits) = lm.model.config().quantization_of(&prefix)?.unwrap_or((64, 4));
        let scales =
            out.remove(&format!("{prefix}.scales")).ok_or_else(|| Error::MissingTensor(format!("{prefix}.scales")))?;
        let q = Quantized {
            weight: out.remove(&name).expect("listed above"),
            biases: out.remove(&format!("{prefix}.biases")),
            group_size: gs,
            bits,
            mode: QuantMode::Affine,
            scales: scales.clone(),
        };
        out.insert(name, dequantize(&q, Some(scales.dtype()))?);
        quantized = true;
    }
    // Phi-3's checkpoints keep q/k/v and gate/up fused; rmlx splits them at load.
    if crate::models::spec::of(lm.model.config())?.architecture == Architecture::Phi3 {
        crate::models::phi3::join_fused(&mut out, lm.model.config().num_hidden_layers)?;
    }
    Ok((out, adapted.len(), quantized))
}

/// Writes the fused model of `lm` (loaded from the folder `source`) into `dest`.
pub fn fuse(lm: &mut LoadedModel, source: &Path, dest: &Path) -> Result<FuseSummary> {
    if !source.is_dir() {
        return Err(Error::Config(format!(
            "{}: fusing needs a Hugging Face folder (GGUF files are not supported)",
            source.display()
        )));
    }
    let (tensors, fused, dequantized) = fused_tensors(lm)?;
    std::fs::create_dir_all(dest).map_err(|e| Error::io(dest, e))?;
    // Everything but the weights comes from the source folder.
    for entry in std::fs::read_dir(source).map_err(|e| Error::io(source, e))? {
        let p = entry.map_err(|e| Error::io(source, e))?.path();
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let weights =
            name.ends_with(".safetensors") || name == "model.safetensors.index.json" || name.ends_with(".gguf");
        if p.is_file() && !weights && name != "config.json" {
            std::fs::copy(&p, dest.join(&name)).map_err(|e| Error::io(dest.join(&name), e))?;
        }
    }
    let config_path = source.join("config.json");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?)
            .map_err(|e| Error::Config(format!("{}: {e}", config_path.display())))?;
    if let Value::Object(o) = &mut config {
        o.remove("quantization");
        o.remove("quantization_config");
    }
    std::fs::write(dest.join("config.json"), serde_json::to_string_pretty(&config).expect("JSON"))
        .map_err(|e| Error::io(dest.join("config.json"), e))?;
    // Shards of at most SHARD_BYTES, in name order.
    let mut shards: Vec<BTreeMap<String, Array>> = vec![BTreeMap::new()];
    let mut size = 0u64;
    for (name, a) in tensors.iter() {
        let bytes = a.nbytes() as u64;
        if size + bytes > SHARD_BYTES && !shards.last().expect("one shard").is_empty() {
            shards.push(BTreeMap::new());
            size = 0;
        }
        size += bytes;
        shards.last_mut().expect("one shard").insert(name.clone(), a.clone());
    }
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    if shards.len() == 1 {
        rmlx::io::save_safetensors(dest.join("model.safetensors"), &shards[0], &meta)?;
    } else {
        let n = shards.len();
        let mut map = serde_json::Map::new();
        let total: u64 = tensors.values().map(|a| a.nbytes() as u64).sum();
        for (i, shard) in shards.iter().enumerate() {
            let file = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
            rmlx::io::save_safetensors(dest.join(&file), shard, &meta)?;
            for name in shard.keys() {
                map.insert(name.clone(), json!(file));
            }
        }
        let index = json!({"metadata": {"total_size": total}, "weight_map": map});
        std::fs::write(dest.join("model.safetensors.index.json"), serde_json::to_string_pretty(&index).expect("JSON"))
            .map_err(|e| Error::io(dest, e))?;
    }
    Ok(FuseSummary { fused, tensors: tensors.len(), shards: shards.len(), dequantized })
}
