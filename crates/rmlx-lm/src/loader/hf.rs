//! A Hugging Face model folder: `config.json`, the safetensors shards (plain or MLX-quantised,
//! with the index when there is one), the tokenizer files and `generation_config.json`.

use super::{family, finish, LoadOptions, LoadedModel};
use crate::chat::ChatTemplate;
use crate::config::ModelConfig;
use crate::tokenizer::Tokenizer;
use crate::weights::{TensorSource, Weight, Weights};
use crate::{Error, Result};
use rmlx::quantization::{QuantMode, Quantized};
use rmlx::{Array, Dtype};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::Config(format!("{} is not valid JSON: {e}", path.display())))
}

pub(super) fn load_dir(dir: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    let config_path = dir.join("config.json");
    if !config_path.is_file() {
        return Err(Error::MissingFile(format!("{} (a model folder needs config.json)", config_path.display())));
    }
    let mut cfg = crate::models::spec::parse_config(read_json(&config_path)?)?;
    let mut weights = read_weights(dir, opts.progress)?;
    normalize_names(&mut weights);
    if cfg.model_type.is_empty() {
        cfg.model_type = crate::models::spec::guess_from_tensors(|n| weights.contains(n)).into();
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

/// Every tensor of the folder's safetensors files, as stored (dense), each with where its bytes
/// lie in its file.
pub(crate) fn read_weights(dir: &Path, progress: bool) -> Result<Weights> {
    let files = shard_files(dir)?;
    let mut weights = Weights::new();
    for f in &files {
        let header = crate::safetensors_header::check_file(f)?;
        let st = rmlx::io::load_safetensors(f)?;
        let data_start = data_section(f)?;
        let path = std::sync::Arc::new(f.clone());
        for t in header {
            let a =
                st.arrays.get(&t.name).filter(|a| a.shape() == t.shape.as_slice()).ok_or_else(|| Error::Corrupt {
                    path: f.display().to_string(),
                    reason: format!("MLX did not read tensor `{}` as its header describes it ({:?})", t.name, t.shape),
                })?;
            let source = TensorSource {
                path: path.clone(),
                offset: data_start + t.data_offsets.0,
                dtype: t.dtype,
                shape: t.shape.clone(),
            };
            weights.set_source(t.name.clone(), source);
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

/// Where the data section of the safetensors file `f` starts (after its 8-byte header length and
/// the header, which `check_file` validated).
fn data_section(f: &Path) -> Result<u64> {
    use std::io::Read;
    let mut prefix = [0u8; 8];
    let mut file = std::fs::File::open(f).map_err(|e| Error::io(f, e))?;
    file.read_exact(&mut prefix).map_err(|e| Error::io(f, e))?;
    Ok(8 + u64::from_le_bytes(prefix))
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
            w.rename_source(&name, &new);
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

/// `X.weight` + `X.scales` (+ `X.biases`) → one quantised weight, with the bits and group size of
/// the config's `quantization` block (per-layer entries override), checked against the shapes.
fn group_quantized(w: &mut Weights, cfg: &ModelConfig) -> Result<()> {
    let prefixes: Vec<String> = w.names().filter_map(|n| n.strip_suffix(".scales")).map(str::to_string).collect();
    if prefixes.is_empty() {
        return Ok(());
    }
    cfg.quantization_block().ok_or_else(|| {
        Error::Config(format!(
            "tensor `{}.scales` is quantised but config.json has no `quantization` block",
            prefixes[0]
        ))
    })?;
    for p in prefixes {
        let (gs, bits) = cfg.quantization_of(&p)?.expect("the block exists");
        let mode = cfg.quantization_mode_of(&p).expect("the block exists");
        let mode = crate::checkpoint::quantization_mode(&p, &mode, bits, gs)?;
        if mode == QuantMode::Affine {
            crate::checkpoint::check_quantization(&p, bits, gs)?;
        }
        let Weight::Dense(weight) = w.take(&format!("{p}.weight"))? else { unreachable!("safetensors are dense") };
        let Weight::Dense(scales) = w.take(&format!("{p}.scales"))? else { unreachable!() };
        let biases = match w.take_opt(&format!("{p}.biases")) {
            Some(Weight::Dense(b)) => Some(b),
            _ => None,
        };
        check_quantized_shapes(&p, &weight, &scales, gs, bits)?;
        let q = Quantized { weight, scales, biases, group_size: gs, bits, mode };
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
