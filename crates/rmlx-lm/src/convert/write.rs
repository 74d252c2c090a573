//! Writing a converted model folder as mlx-lm's `save` does: the tensors in safetensors files of
//! at most [`super::ConvertOptions::max_shard_bytes`] (`model.safetensors`, or
//! `model-0000i-of-0000n.safetensors`) with `{"format": "mlx"}` metadata,
//! `model.safetensors.index.json` (total size, total parameters, the tensor → file map),
//! `config.json` with sorted keys, and the tokenizer and generation files. Everything goes into a
//! temporary folder beside the destination, renamed into place at the end.

use super::source::Source;
use super::{ConvertOptions, Converted};
use crate::config::ModelConfig;
use crate::models::spec::Tensors;
use crate::progress::Progress;
use crate::{Error, Result};
use rmlx::Array;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// Writes `src` as the folder `dst`.
pub(super) fn folder(dst: &Path, src: &Source, opts: &ConvertOptions) -> Result<Converted> {
    let name = dst.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    let tmp = dst.with_file_name(format!(".{name}.tmp{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let written = contents(&tmp, src, opts).and_then(|done| {
        std::fs::rename(&tmp, dst).map_err(|e| Error::io(dst, e))?;
        Ok(done)
    });
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    written
}

fn contents(dir: &Path, src: &Source, opts: &ConvertOptions) -> Result<Converted> {
    // The configuration as written: its `quantization` block gives each layer's bits.
    let cfg = crate::models::spec::parse_config(Value::Object(src.config.clone()))?;
    let shards = shards(&src.tensors, opts.max_shard_bytes);
    let count = shards.len();
    let file_name = |i: usize| match count {
        1 => "model.safetensors".to_string(),
        _ => format!("model-{:05}-of-{count:05}.safetensors", i + 1),
    };
    let bytes: u64 = src.tensors.values().map(|a| a.nbytes() as u64).sum();
    let parameters = parameters(&src.tensors, &cfg)?;
    let bar = Progress::new(opts.progress, "writing", bytes);
    let metadata = BTreeMap::from([("format".to_string(), "mlx".to_string())]);
    let mut weight_map = BTreeMap::new();
    let mut files = Vec::new();
    for (i, shard) in shards.iter().enumerate() {
        let name = file_name(i);
        let arrays: BTreeMap<String, Array> = shard.iter().map(|n| (n.clone(), src.tensors[n].clone())).collect();
        rmlx::io::save_safetensors(dir.join(&name), &arrays, &metadata)?;
        bar.inc(arrays.values().map(|a| a.nbytes() as u64).sum());
        for n in shard {
            weight_map.insert(n.clone(), Value::from(name.clone()));
        }
        files.push(name);
    }
    bar.finish();
    let index = json!({
        "metadata": {"total_size": bytes, "total_parameters": parameters},
        "weight_map": weight_map,
    });
    write_json(&dir.join("model.safetensors.index.json"), &index)?;
    // serde_json's maps are sorted: the keys come out as mlx-lm's sorted config has them.
    write_json(&dir.join("config.json"), &Value::Object(src.config.clone()))?;
    for f in &src.copy {
        let to = dir.join(f.file_name().expect("a file"));
        std::fs::copy(f, &to).map_err(|e| Error::io(f, e))?;
    }
    for (name, text) in &src.write {
        let to = dir.join(name);
        std::fs::write(&to, text).map_err(|e| Error::io(&to, e))?;
    }
    let quantized_layers = src.tensors.keys().filter(|n| n.ends_with(".scales")).count();
    Ok(Converted {
        tensors: src.tensors.len(),
        quantized_layers,
        files,
        bytes,
        parameters,
        bits_per_weight: if parameters == 0 { 0.0 } else { bytes as f64 * 8.0 / parameters as f64 },
    })
}

/// The tensors' names in files of at most `max` bytes, in name order (a larger tensor alone).
fn shards(t: &Tensors, max: u64) -> Vec<Vec<String>> {
    let mut shards: Vec<Vec<String>> = Vec::new();
    let mut size = 0u64;
    for (name, a) in t {
        let n = a.nbytes() as u64;
        if shards.is_empty() || size + n > max {
            shards.push(Vec::new());
            size = 0;
        }
        shards.last_mut().expect("one shard at least").push(name.clone());
        size += n;
    }
    shards
}

/// mlx-lm's `total_parameters`: every tensor's elements, except that a quantised layer counts its
/// weight unpacked (`elements · 32 / bits`) and its scales and biases not at all.
fn parameters(t: &Tensors, cfg: &ModelConfig) -> Result<u64> {
    let mut total = 0u64;
    for (name, a) in t {
        let size = a.shape().iter().map(|&d| d as u64).product::<u64>();
        let layer = name.rsplit_once('.').map_or(name.as_str(), |(p, _)| p);
        let quantized = t.contains_key(&format!("{layer}.scales"));
        total += match name.rsplit_once('.').map(|(_, leaf)| leaf) {
            Some("weight") if quantized => {
                let (_, bits) = cfg.quantization_of(layer)?.unwrap_or((64, 4));
                size * 32 / bits.max(1) as u64
            }
            Some("scales" | "biases") if quantized => 0,
            _ => size,
        };
    }
    Ok(total)
}

/// JSON with four-space indents, as Python's `json.dump(…, indent=4)` writes it.
fn write_json(path: &Path, v: &Value) -> Result<()> {
    let mut out = Vec::new();
    let formatter = serde_json::ser::PrettyFormatter::with_indent(b"    ");
    let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
    serde::Serialize::serialize(v, &mut ser).map_err(|e| Error::Config(e.to_string()))?;
    std::fs::write(path, out).map_err(|e| Error::io(path, e))
}
