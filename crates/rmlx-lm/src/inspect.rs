//! Looking inside a forward pass: [`AttentionInspector`] runs a prompt through a native model and
//! returns the keys every layer's attention stored, after the rotary embedding, as float32
//! `[layer][kv head][position][head_dim]`, with a per-layer summary (mean key norm, how similar
//! each head's keys are across positions), and writes them as safetensors or NumPy `.npy`.
//!
//! ```
//! # fn main() -> rmlx_lm::Result<()> {
//! use rmlx_lm::inspect::AttentionInspector;
//! let lm = rmlx_lm::loader::load(rmlx_lm::registry::default_model()?, &Default::default())?;
//! let prompt = lm.encode_prompt("The keys of a short prompt", true, None)?;
//! let keys = AttentionInspector::new(&lm).keys(&prompt)?;
//! assert_eq!(keys.positions, prompt.len());
//! assert_eq!(keys.key(0, 0, 0).len(), keys.head_dim);
//! # Ok(()) }
//! ```

use crate::cache::KvCache;
use crate::generate::ids_array;
use crate::loader::LoadedModel;
use crate::{Error, Result};
use rmlx::{Array, Dtype};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

/// Runs prompts through a model and collects what its attention layers hold.
pub struct AttentionInspector<'m> {
    lm: &'m LoadedModel,
}

/// Post-RoPE keys of one prompt: `data` is `[layers][kv_heads][positions][head_dim]`, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Keys {
    pub layers: usize,
    pub kv_heads: usize,
    pub positions: usize,
    pub head_dim: usize,
    pub data: Vec<f32>,
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
}

/// One layer of [`Keys::summary`].
#[derive(Clone, Debug, PartialEq)]
pub struct LayerSummary {
    /// Mean L2 norm of the keys over heads and positions.
    pub mean_norm: f32,
    /// Per head: the mean cosine similarity between the keys of two different positions (1: all
    /// point the same way; about 0: unrelated). `None` for a one-position prompt.
    pub head_cosine: Vec<Option<f32>>,
}

impl<'m> AttentionInspector<'m> {
    pub fn new(lm: &'m LoadedModel) -> Self {
        AttentionInspector { lm }
    }

    /// Prefills `prompt` (one forward pass, fresh caches) and reads every layer's keys. Sliding-window
    /// layers hold the whole prompt after a single pass, so every layer has every position.
    pub fn keys(&self, prompt: &[u32]) -> Result<Keys> {
        if prompt.is_empty() {
            return Err(Error::Prompt("the prompt is empty".into()));
        }
        self.lm.vocab.check(prompt)?;
        let cfg = self.lm.model.config();
        let mut caches = self.lm.model.new_caches(None);
        self.lm.model.forward_hidden(&ids_array(prompt)?, &mut caches)?;
        let n = prompt.len() as i32;
        let per_layer = caches
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let keys = match c {
                    KvCache::Standard(_) | KvCache::Rotating(_) => c.state().first().copied().cloned(),
                    KvCache::Batch(_) | KvCache::Quantized(_) => None,
                }
                .ok_or_else(|| Error::InvalidParameter(format!("layer {i} holds no keys")))?;
                if keys.shape().get(2).is_none_or(|&held| held < n) {
                    return Err(Error::InvalidParameter(format!(
                        "layer {i} holds {:?} keys for a prompt of {n} positions",
                        keys.shape()
                    )));
                }
                Ok(keys.slice_axis(2, 0, n, 1)?.astype(Dtype::Float32)?)
            })
            .collect::<Result<Vec<Array>>>()?;
        let all = rmlx::ops::concatenate(&per_layer.iter().collect::<Vec<_>>(), 0)?;
        rmlx::eval([&all])?;
        let (kv_heads, head_dim) = (cfg.kv_heads() as usize, cfg.head_dim() as usize);
        let data = all.to_vec::<f32>()?;
        let keys =
            Keys { layers: caches.len(), kv_heads, positions: prompt.len(), head_dim, data, prompt: prompt.to_vec() };
        if keys.data.len() != keys.layers * kv_heads * keys.positions * head_dim {
            return Err(Error::InvalidParameter(format!("keys of shape {:?}", all.shape())));
        }
        Ok(keys)
    }
}

impl Keys {
    /// The key of `layer`, `head` at `position` (`head_dim` values).
    pub fn key(&self, layer: usize, head: usize, position: usize) -> &[f32] {
        let at = ((layer * self.kv_heads + head) * self.positions + position) * self.head_dim;
        &self.data[at..at + self.head_dim]
    }

    /// Per layer: the mean key norm and each head's mean cosine similarity between positions.
    pub fn summary(&self) -> Vec<LayerSummary> {
        (0..self.layers)
            .map(|l| {
                let mut norms = 0.0f64;
                let head_cosine = (0..self.kv_heads)
                    .map(|h| {
                        // Mean over pairs i ≠ j of u_i·u_j = (|Σ u|² − P) / (P(P − 1)), u unit keys.
                        let mut sum = vec![0.0f64; self.head_dim];
                        for p in 0..self.positions {
                            let k = self.key(l, h, p);
                            let norm = k.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
                            norms += norm;
                            for (s, &x) in sum.iter_mut().zip(k) {
                                *s += if norm > 0.0 { x as f64 / norm } else { 0.0 };
                            }
                        }
                        let p = self.positions as f64;
                        (self.positions > 1)
                            .then(|| ((sum.iter().map(|s| s * s).sum::<f64>() - p) / (p * (p - 1.0))) as f32)
                    })
                    .collect();
                let mean_norm = (norms / (self.kv_heads * self.positions).max(1) as f64) as f32;
                LayerSummary { mean_norm, head_cosine }
            })
            .collect()
    }

    /// The keys as one `[layers, kv_heads, positions, head_dim]` float32 array.
    pub fn to_array(&self) -> Result<Array> {
        let shape = [self.layers, self.kv_heads, self.positions, self.head_dim].map(|d| d as i32);
        Ok(Array::from_slice(&self.data, &shape)?)
    }

    /// Writes the keys: `.safetensors` (tensor `keys`, the prompt's ids under `prompt` as
    /// metadata) or `.npy` (NumPy's format, version 1.0, little-endian float32).
    pub fn save(&self, path: &Path) -> Result<()> {
        match path.extension().and_then(|e| e.to_str()) {
            Some("safetensors") => {
                let arrays = BTreeMap::from([("keys".to_string(), self.to_array()?)]);
                let ids = self.prompt.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
                let metadata = BTreeMap::from([
                    ("layout".to_string(), "layer,kv_head,position,head_dim".to_string()),
                    ("prompt".to_string(), ids),
                ]);
                Ok(rmlx::io::save_safetensors(path, &arrays, &metadata)?)
            }
            Some("npy") => self.save_npy(path),
            _ => Err(Error::InvalidParameter(format!(
                "{}: the keys are written as .safetensors or .npy",
                path.display()
            ))),
        }
    }

    fn save_npy(&self, path: &Path) -> Result<()> {
        let shape = format!("({}, {}, {}, {})", self.layers, self.kv_heads, self.positions, self.head_dim);
        let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}");
        // Magic (6) + version (2) + length (2) + header + '\n' is a multiple of 64.
        let total = (10 + header.len() + 1).div_ceil(64) * 64;
        header.push_str(&" ".repeat(total - 10 - header.len() - 1));
        header.push('\n');
        let mut out = Vec::with_capacity(total + self.data.len() * 4);
        out.extend_from_slice(b"\x93NUMPY\x01\x00");
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
        out.extend_from_slice(header.as_bytes());
        for x in &self.data {
            out.extend_from_slice(&x.to_le_bytes());
        }
        let mut f = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
        f.write_all(&out).map_err(|e| Error::io(path, e))
    }
}
