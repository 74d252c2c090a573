//! The model a conversion starts from, as one shape whatever its format: the configuration, the
//! tensors under Hugging Face's names (a quantised layer as its packed `weight`, `scales` and
//! `biases`, described by the configuration's `quantization` block), and the files that go beside
//! the weights (copied from a folder, or written from a GGUF file's tokenizer).

use crate::loader::{is_gguf_file, read_gguf, read_safetensors_dir, GgufCheckpoint};
use crate::models::spec::Tensors;
use crate::weights::{Weight, Weights};
use crate::{Error, Result};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A model about to be written.
pub(super) struct Source {
    pub config: Map<String, Value>,
    pub tensors: Tensors,
    /// Files copied as they are (tokenizer, template, generation config, code).
    pub copy: Vec<PathBuf>,
    /// Files written from what the source holds: name and contents.
    pub write: Vec<(String, String)>,
    /// Whether it was read from a GGUF file.
    pub from_gguf: bool,
}

/// Reads a model folder or a GGUF file.
pub(super) fn read(src: &Path, progress: bool) -> Result<Source> {
    if is_gguf_file(src)? {
        return from_gguf(read_gguf(src, progress)?);
    }
    if !src.is_dir() {
        return Err(Error::MissingFile(format!("{} is neither a model folder nor a GGUF file", src.display())));
    }
    let config_path = src.join("config.json");
    if !config_path.is_file() {
        return Err(Error::MissingFile(format!("{} (a model folder needs config.json)", config_path.display())));
    }
    let text = std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
    let config = match serde_json::from_str(&text) {
        Ok(Value::Object(c)) => c,
        Ok(_) => return Err(Error::Config(format!("{} must be a JSON object", config_path.display()))),
        Err(e) => return Err(Error::Config(format!("{} is not valid JSON: {e}", config_path.display()))),
    };
    let tensors = dense_tensors(read_safetensors_dir(src, progress)?)?;
    let mut copy = Vec::new();
    for entry in std::fs::read_dir(src).map_err(|e| Error::io(src, e))? {
        let path = entry.map_err(|e| Error::io(src, e))?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if path.is_file() && goes_beside_weights(&name) {
            copy.push(path);
        }
    }
    copy.sort();
    Ok(Source { config, tensors, copy, write: Vec::new(), from_gguf: false })
}

/// The files of a model folder that a conversion copies: tokenizer and template files, the
/// generation config, and code (`*.py`), as mlx-lm's conversion keeps them.
fn goes_beside_weights(name: &str) -> bool {
    name.starts_with("tokenizer")
        || name.starts_with("chat_template")
        || name.ends_with(".py")
        || name.ends_with(".tiktoken")
        || matches!(
            name,
            "generation_config.json"
                | "special_tokens_map.json"
                | "added_tokens.json"
                | "vocab.json"
                | "merges.txt"
                | "tiktoken.model"
        )
}

/// A folder's tensors, all dense as safetensors store them.
fn dense_tensors(mut w: Weights) -> Result<Tensors> {
    let names: Vec<String> = w.names().map(str::to_string).collect();
    let mut t = Tensors::new();
    for name in names {
        match w.take(&name)? {
            Weight::Dense(a) => drop(t.insert(name, a)),
            Weight::Quantized(_) => unreachable!("safetensors tensors are read dense"),
        }
    }
    Ok(t)
}

/// A GGUF file's model: its quantised tensors (MLX layouts of llama.cpp's blocks) as packed
/// arrays with a `quantization` block (the most common layout, other layouts per layer), its
/// tokenizer written as `tokenizer.json` with a `tokenizer_config.json` carrying the template and
/// special tokens, and its end-of-sequence ids in `generation_config.json`.
fn from_gguf(g: GgufCheckpoint) -> Result<Source> {
    let GgufCheckpoint { config, mut weights, tokenizer, template } = g;
    let Value::Object(mut config) = config else { unreachable!("the GGUF reader builds an object") };
    let mut tensors = Tensors::new();
    let mut layouts: BTreeMap<String, (i32, i32, &'static str)> = BTreeMap::new();
    for name in weights.names().map(str::to_string).collect::<Vec<_>>() {
        match weights.take(&name)? {
            Weight::Dense(a) => drop(tensors.insert(name, a)),
            Weight::Quantized(q) => {
                let prefix = name.strip_suffix(".weight").unwrap_or(&name).to_string();
                layouts.insert(prefix.clone(), (q.group_size, q.bits, q.mode.name()));
                tensors.insert(format!("{prefix}.scales"), q.scales);
                if let Some(b) = q.biases {
                    tensors.insert(format!("{prefix}.biases"), b);
                }
                tensors.insert(name, q.weight);
            }
        }
    }
    if !layouts.is_empty() {
        let mut counts: BTreeMap<(i32, i32, &str), usize> = BTreeMap::new();
        for l in layouts.values() {
            *counts.entry(*l).or_default() += 1;
        }
        let common = counts.iter().max_by_key(|(_, n)| **n).map(|(l, _)| *l).expect("some layout");
        let mut block = json!({"group_size": common.0, "bits": common.1, "mode": common.2});
        for (prefix, l) in layouts.iter().filter(|(_, l)| **l != common) {
            block[prefix] = json!({"group_size": l.0, "bits": l.1, "mode": l.2});
        }
        config.insert("quantization".into(), block.clone());
        config.insert("quantization_config".into(), block);
    }
    let tokenizer_json = tokenizer.inner().to_string(true).map_err(|e| Error::Tokenizer(e.to_string()))?;
    let mut tokenizer_config = json!({"tokenizer_class": "PreTrainedTokenizerFast"});
    if let Some(bos) = tokenizer.bos_token() {
        tokenizer_config["bos_token"] = json!(bos);
    }
    if let Some(eos) = tokenizer.eos_token() {
        tokenizer_config["eos_token"] = json!(eos);
    }
    if let Some(t) = template {
        tokenizer_config["chat_template"] = json!(t);
    }
    let generation = json!({"eos_token_id": tokenizer.eos_ids()});
    let pretty = |v: &Value| serde_json::to_string_pretty(v).expect("JSON values serialise");
    let write = vec![
        ("tokenizer.json".to_string(), tokenizer_json),
        ("tokenizer_config.json".to_string(), pretty(&tokenizer_config)),
        ("generation_config.json".to_string(), pretty(&generation)),
    ];
    Ok(Source { config, tensors, copy: Vec::new(), write, from_gguf: true })
}
