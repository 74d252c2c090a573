//! Prompt-cache files: a model's key/value caches after a prompt, saved and loaded in mlx-lm's
//! format (its `save_prompt_cache` / `load_prompt_cache`), so that files move between rmlx and
//! mlx-lm both ways.
//!
//! A file is one safetensors file. Layer `i`'s state is mlx-lm's cache `state` tuple flattened:
//! arrays `i.0`, `i.1`, … (`i.0.0`–`i.0.2` and `i.1.0`–`i.1.2` for a quantised cache's keys and
//! values as packed words, scales and biases), integer fields as 0-d int32 arrays:
//!
//! | class              | state                                                  |
//! |--------------------|--------------------------------------------------------|
//! | `KVCache`          | keys, values, offset                                   |
//! | `RotatingKVCache`  | keys, values, offset, keep, max_size, next write slot  |
//! | `QuantizedKVCache` | keys (3), values (3), offset, group_size, bits         |
//!
//! The metadata is mlx-lm's flattening of `[metadata, classes, scalars]`: `0.<key>` the caller's
//! metadata (mlx-lm's `cache_prompt` writes `model` and `tokenizer_config`), `1.<i>` each layer's
//! class, `2.0` an empty string and `2.<n>.0`/`2.<n>.1` each integer field's array name and
//! `scalar`. rmlx writes the valid positions of an unbounded cache only (mlx-lm writes its whole
//! buffers; either reads both), and refuses what mlx-lm has no class for (a quantised window).

use super::{KvCache, Packed, QuantizedCache, RotatingCache, StandardCache};
use crate::{Error, Result};
use rmlx::{Array, Dtype};
use std::collections::BTreeMap;
use std::path::Path;

/// A prompt-cache file's contents: one cache a layer, and the caller's metadata (`0.<key>`).
pub struct PromptCacheFile {
    pub caches: Vec<KvCache>,
    pub metadata: BTreeMap<String, String>,
}

/// Writes `caches` and `metadata` to `path` in mlx-lm's format, whole or not at all (a temporary
/// file renamed into place).
///
/// Errors: a batch's cache or a quantised window (mlx-lm has no class for them), an empty cache.
pub fn save_prompt_cache(path: &Path, caches: &[KvCache], metadata: &BTreeMap<String, String>) -> Result<()> {
    let mut arrays = BTreeMap::new();
    let mut meta: BTreeMap<String, String> = metadata.iter().map(|(k, v)| (format!("0.{k}"), v.clone())).collect();
    let mut scalars = Vec::new();
    for (i, cache) in caches.iter().enumerate() {
        let (class, state) =
            state_of(cache).map_err(|reason| Error::InvalidParameter(format!("layer {i}: {reason}")))?;
        meta.insert(format!("1.{i}"), class.to_string());
        for (j, field) in state.into_iter().enumerate() {
            match field {
                Field::Array(a) => {
                    arrays.insert(format!("{i}.{j}"), a);
                }
                Field::Packed(p) => {
                    for (k, a) in p.arrays().into_iter().enumerate() {
                        arrays.insert(format!("{i}.{j}.{k}"), a.clone());
                    }
                }
                Field::Int(n) => {
                    let n = i32::try_from(n)
                        .map_err(|_| Error::InvalidParameter(format!("layer {i}: {n} overflows int32")))?;
                    arrays.insert(format!("{i}.{j}"), Array::scalar(n));
                    scalars.push(format!("{i}.{j}"));
                }
            }
        }
    }
    meta.insert("2.0".into(), String::new());
    for (n, name) in scalars.into_iter().enumerate() {
        meta.insert(format!("2.{}.0", n + 1), name);
        meta.insert(format!("2.{}.1", n + 1), "scalar".into());
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let temporary = dir.join(format!(".{name}.tmp{}.safetensors", std::process::id()));
    rmlx::io::save_safetensors(&temporary, &arrays, &meta)?;
    std::fs::rename(&temporary, path).map_err(|e| {
        let _ = std::fs::remove_file(&temporary);
        Error::io(path, e)
    })
}

/// Reads a prompt-cache file written by rmlx or mlx-lm; the arrays are read whole (evaluated).
///
/// Errors: [`Error::Corrupt`] for a file that is not a whole safetensors file or whose metadata
/// and arrays do not form mlx-lm's caches (a missing array, a field of the wrong shape), naming
/// the problem; [`Error::PromptCache`] for a cache class rmlx does not read.
pub fn load_prompt_cache(path: &Path) -> Result<PromptCacheFile> {
    crate::safetensors_header::check_file(path)?;
    let file = rmlx::io::load_safetensors(path)?;
    let corrupt = |reason: String| Error::Corrupt { path: path.display().to_string(), reason };
    let metadata: BTreeMap<String, String> =
        file.metadata.iter().filter_map(|(k, v)| k.strip_prefix("0.").map(|k| (k.to_string(), v.clone()))).collect();
    let mut classes = Vec::new();
    while let Some(class) = file.metadata.get(&format!("1.{}", classes.len())) {
        classes.push(class.clone());
    }
    if classes.is_empty() {
        return Err(corrupt("no cache classes in its metadata (`1.0`, …): not a prompt-cache file".into()));
    }
    let array =
        |name: String| file.arrays.get(&name).cloned().ok_or_else(|| corrupt(format!("array `{name}` is missing")));
    let int = |name: String| -> Result<usize> {
        let a = array(name.clone())?;
        if a.size() != 1 || !matches!(a.dtype(), Dtype::Int32 | Dtype::Int64 | Dtype::Uint32) {
            return Err(corrupt(format!("`{name}` is not one integer")));
        }
        let n = a.astype(Dtype::Int64)?.item::<i64>()?;
        usize::try_from(n).map_err(|_| corrupt(format!("`{name}` is negative ({n})")))
    };
    let mut caches = Vec::with_capacity(classes.len());
    for (i, class) in classes.iter().enumerate() {
        let cache = match class.as_str() {
            "KVCache" => {
                let (keys, values, offset) =
                    (array(format!("{i}.0"))?, array(format!("{i}.1"))?, int(format!("{i}.2"))?);
                check_rows(&keys, &values, offset).map_err(|r| corrupt(format!("layer {i}: {r}")))?;
                KvCache::Standard(StandardCache { keys: Some(keys), values: Some(values), offset, done: None })
            }
            "RotatingKVCache" => {
                let (keys, values) = (array(format!("{i}.0"))?, array(format!("{i}.1"))?);
                let (offset, keep, max_size, idx) =
                    (int(format!("{i}.2"))?, int(format!("{i}.3"))?, int(format!("{i}.4"))?, int(format!("{i}.5"))?);
                check_rows(&keys, &values, offset.min(keys.shape().get(2).copied().unwrap_or(0) as usize))
                    .map_err(|r| corrupt(format!("layer {i}: {r}")))?;
                let held = keys.shape()[2] as usize;
                if max_size == 0 || (keep > 0 && keep >= max_size) || idx > held {
                    return Err(corrupt(format!(
                        "layer {i}: a window of {max_size} keeping {keep}, next slot {idx} of {held} held"
                    )));
                }
                KvCache::Rotating(RotatingCache::from_state(keys, values, offset, max_size, keep, idx))
            }
            "QuantizedKVCache" => {
                let (offset, group_size, bits) =
                    (int(format!("{i}.2"))?, int(format!("{i}.3"))?, int(format!("{i}.4"))?);
                let quantization = super::KvQuantization { bits: bits as i32, group_size: group_size as i32, start: 0 };
                quantization.check().map_err(|e| corrupt(format!("layer {i}: {e}")))?;
                let packed = |j: usize| -> Result<Packed> {
                    let [words, scales, biases] = [0, 1, 2].map(|k| array(format!("{i}.{j}.{k}")));
                    Ok(Packed { words: words?, scales: scales?, biases: biases?, quantization })
                };
                let (keys, values) = (packed(0)?, packed(1)?);
                check_packed(&keys, &values, offset).map_err(|r| corrupt(format!("layer {i}: {r}")))?;
                KvCache::Quantized(QuantizedCache::from_packed(quantization, keys, values, offset))
            }
            other => {
                return Err(Error::PromptCache {
                    path: path.display().to_string(),
                    reason: format!(
                        "layer {i} is a `{other}`; rmlx reads KVCache, RotatingKVCache and QuantizedKVCache"
                    ),
                })
            }
        };
        caches.push(cache);
    }
    let state: Vec<&Array> = caches.iter().flat_map(KvCache::state).collect();
    rmlx::eval(state)?;
    Ok(PromptCacheFile { caches, metadata })
}

/// One field of a cache's state, as mlx-lm's tuple holds it.
enum Field {
    Array(Array),
    Packed(Packed),
    Int(usize),
}

/// A cache's mlx-lm class and state.
fn state_of(cache: &KvCache) -> std::result::Result<(&'static str, Vec<Field>), String> {
    let held = |a: &Option<Array>, n: usize| -> std::result::Result<Array, String> {
        let a = a.as_ref().ok_or("the cache is empty")?;
        a.slice_axis(2, 0, n as i32, 1).map_err(|e| e.to_string())
    };
    Ok(match cache {
        KvCache::Standard(c) => {
            let (keys, values) = (held(&c.keys, c.offset)?, held(&c.values, c.offset)?);
            ("KVCache", vec![Field::Array(keys), Field::Array(values), Field::Int(c.offset)])
        }
        KvCache::Rotating(c) => {
            let (keys, values) =
                (c.keys.clone().ok_or("the cache is empty")?, c.values.clone().ok_or("the cache is empty")?);
            let (offset, keep, max_size, idx) = c.state_fields();
            let ints = [offset, keep, max_size, idx].map(Field::Int);
            let mut fields = vec![Field::Array(keys), Field::Array(values)];
            fields.extend(ints);
            ("RotatingKVCache", fields)
        }
        KvCache::Quantized(c) => {
            if c.window.is_some() {
                return Err("a quantised cache bounded to a window has no mlx-lm class".into());
            }
            let (keys, values) = c.held().ok_or("the cache is empty")?;
            let q = c.quantization;
            let mut fields = vec![Field::Packed(keys), Field::Packed(values)];
            fields.extend([c.offset, q.group_size as usize, q.bits as usize].map(Field::Int));
            ("QuantizedKVCache", fields)
        }
        KvCache::Batch(_) => return Err("a batch's cache is not saved".into()),
    })
}

/// Keys and values `[B, H, n, D]` alike, holding at least `offset` positions.
fn check_rows(keys: &Array, values: &Array, offset: usize) -> std::result::Result<(), String> {
    let (k, v) = (keys.shape(), values.shape());
    if k.len() != 4 || v.len() != 4 || k[..3] != v[..3] {
        return Err(format!("keys {k:?} and values {v:?} are not [batch, heads, positions, dim] alike"));
    }
    if (k[2] as usize) < offset {
        return Err(format!("{} positions held, offset {offset}", k[2]));
    }
    if !keys.dtype().is_floating() || keys.dtype() != values.dtype() {
        return Err(format!("keys of {:?} and values of {:?}", keys.dtype(), values.dtype()));
    }
    Ok(())
}

/// Packed keys and values as [`check_rows`] wants them, their words, scales and biases alike.
fn check_packed(keys: &Packed, values: &Packed, offset: usize) -> std::result::Result<(), String> {
    for p in [keys, values] {
        let (w, s, b) = (p.words.shape(), p.scales.shape(), p.biases.shape());
        if w.len() != 4 || s.len() != 4 || w[..3] != s[..3] || s != b || p.words.dtype() != Dtype::Uint32 {
            return Err(format!("packed words {w:?}, scales {s:?} and biases {b:?} do not go together"));
        }
        let elements = w[3] as i64 * 32 / p.quantization.bits as i64;
        if elements != s[3] as i64 * p.quantization.group_size as i64 {
            return Err(format!("{} words a row and {} groups of {}", w[3], s[3], p.quantization.group_size));
        }
        if (w[2] as usize) < offset {
            return Err(format!("{} positions held, offset {offset}", w[2]));
        }
    }
    if keys.words.shape()[..3] != values.words.shape()[..3] {
        return Err("keys and values hold different positions".into());
    }
    Ok(())
}
