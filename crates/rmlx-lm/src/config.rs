//! A model's configuration: Hugging Face `config.json` (or GGUF metadata, see [`crate::loader`])
//! parsed into one struct, with each family's defaults and the derived quantities (head_dim,
//! RoPE frequencies, which layers slide).

mod limits;
mod unsupported;

use crate::{Error, Result};
use serde::Deserialize;
use serde_json::Value;

/// The architectures rmlx implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 2/3 and Mistral-style llama checkpoints.
    Llama,
    /// Qwen 2 / 2.5: biased q/k/v projections.
    Qwen2,
    /// Qwen 3: RMSNorm on queries and keys.
    Qwen3,
    /// Gemma 3 (text): sliding/global layers, `(1 + w)` norms, GELU-tanh.
    Gemma3,
    /// Phi-3 / Phi-3.5 / Phi-4-mini: fused q/k/v and gate/up projections, partial rotary
    /// embedding, LongRoPE.
    Phi3,
    /// Gemma 2: Gemma 3's blocks without q/k norms, with attention and final logit soft-capping,
    /// sliding and global layers alternating.
    Gemma2,
    /// Qwen 3 MoE and Mixtral: Llama-style attention, feed-forward by routed experts.
    Moe,
}

/// `rope_scaling`, the variants rmlx implements.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Positions divided by `factor`.
    Linear { factor: f32 },
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 { factor: f32, low_freq_factor: f32, high_freq_factor: f32, original_max_position_embeddings: f32 },
    /// LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini; `su` in older configs): each frequency's divisor
    /// multiplied by its `long_factor`, the rotated features by `attention_factor`. As mlx-lm and
    /// llama.cpp's long contexts do, the long factors serve every position; transformers takes the
    /// `short_factor`s while a sequence fits `original_max_position_embeddings`.
    LongRope { long_factor: Vec<f32>, attention_factor: f32 },
    /// YaRN (gpt-oss, DeepSeek-style long contexts): each pair's divisor multiplied by `factors[i]`
    /// (between 1 for the fast-turning pairs, extrapolated, and `factor` for the slow ones,
    /// interpolated, with a linear ramp between), the rotated features by `attention_factor`, as
    /// transformers' `_compute_yarn_parameters` computes them.
    Yarn { factors: Vec<f32>, attention_factor: f32 },
}

/// Everything the model files need, in one place.
#[derive(Clone, Debug, Deserialize)]
pub struct ModelConfig {
    #[serde(default)]
    pub model_type: String,
    pub hidden_size: i32,
    pub num_hidden_layers: usize,
    pub intermediate_size: i32,
    pub num_attention_heads: i32,
    #[serde(default)]
    pub num_key_value_heads: Option<i32>,
    #[serde(default)]
    pub head_dim: Option<i32>,
    pub vocab_size: i32,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "default_theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
    #[serde(default)]
    pub attention_bias: Option<bool>,
    /// The window of the layers that slide ([`ModelConfig::layer_window`] says which do).
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Qwen 2/3: whether `sliding_window` applies at all (from layer `max_window_layers` on).
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    /// Qwen 2/3: the first layer that slides when `use_sliding_window` (transformers' default 28).
    #[serde(default)]
    pub max_window_layers: Option<usize>,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub sliding_window_pattern: Option<usize>,
    #[serde(default)]
    pub rope_local_base_freq: Option<f32>,
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f32>,
    #[serde(default)]
    pub final_logit_softcapping: Option<f32>,
    /// Gemma 2: the attention scores become `cap · tanh(s / cap)` before the softmax.
    #[serde(default)]
    pub attn_logit_softcapping: Option<f32>,
    #[serde(default)]
    pub eos_token_id: Option<Value>,
    #[serde(default)]
    pub bos_token_id: Option<Value>,
    #[serde(default, alias = "dtype")]
    pub torch_dtype: Option<String>,
    /// MLX quantisation block (`quantization`, or `quantization_config`).
    #[serde(default)]
    pub quantization: Option<Value>,
    #[serde(default)]
    pub quantization_config: Option<Value>,
    /// GGUF `rope_freqs`: per-frequency factors multiplying the RoPE divisors (Llama 3.1 in GGUF).
    #[serde(default)]
    pub rope_freq_factors: Option<Vec<f32>>,
    /// The fraction of each head the rotary embedding turns (Phi-3 family; 1 when absent).
    #[serde(default)]
    pub partial_rotary_factor: Option<f32>,
    /// The context the model was trained with before LongRoPE extended it (Phi-3 family).
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
    /// The whole configuration as read (after the normalisations above): a family's own fields
    /// (experts, routing) are parsed from it by the family's file.
    #[serde(skip)]
    pub raw: serde_json::Map<String, Value>,
}

fn default_eps() -> f32 {
    1e-6
}
fn default_theta() -> f32 {
    10000.0
}

/// Gemma 3 text defaults (transformers' `Gemma3TextConfig`), for the fields real checkpoints omit.
const GEMMA3_DEFAULTS: &str = r#"{"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
 "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
 "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
 "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
 "tie_word_embeddings": true, "max_position_embeddings": 131072}"#;

/// Gemma 2 defaults (transformers' `Gemma2Config`), for the fields real checkpoints omit.
const GEMMA2_DEFAULTS: &str = r#"{"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
 "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
 "rope_theta": 10000.0, "tie_word_embeddings": true}"#;

impl ModelConfig {
    /// Parses a `config.json` text. A `gemma3` (multimodal) config contributes its `text_config`.
    /// Whether rmlx implements its `model_type` is not checked here: that is
    /// `crate::models::spec::parse_config`'s, which the loaders call.
    pub fn from_json(text: &str) -> Result<Self> {
        let raw: Value =
            serde_json::from_str(text).map_err(|e| Error::Config(format!("config.json is not valid JSON: {e}")))?;
        Self::from_value(raw)
    }

    /// Parses a configuration already read as JSON.
    pub fn from_value(raw: Value) -> Result<Self> {
        let Value::Object(mut top) = raw else {
            return Err(Error::Config("config.json must be a JSON object".into()));
        };
        let mut model_type = top.get("model_type").and_then(Value::as_str).map(str::to_string).unwrap_or_default();
        if let Some(Value::Object(text)) = top.remove("text_config") {
            // The text model's fields win; the wrapper's quantisation and special ids fill gaps.
            let mut merged = text;
            for key in ["quantization", "quantization_config", "eos_token_id", "bos_token_id", "torch_dtype", "dtype"] {
                if let (false, Some(v)) = (merged.contains_key(key), top.get(key)) {
                    merged.insert(key.to_string(), v.clone());
                }
            }
            top = merged;
            model_type = "gemma3_text".into();
        }
        normalize_rope_parameters(&mut top);
        if let (false, Some(p)) =
            (top.contains_key("sliding_window_pattern"), top.get("_sliding_window_pattern").cloned())
        {
            top.insert("sliding_window_pattern".into(), p);
        }
        if model_type == "gemma3_text" || model_type == "gemma3" {
            let defaults: serde_json::Map<String, Value> =
                serde_json::from_str(GEMMA3_DEFAULTS).expect("valid defaults");
            for (k, v) in defaults {
                top.entry(k).or_insert(v);
            }
            // An explicit `null` pattern or head_dim means "default" as well.
            for key in ["sliding_window_pattern", "head_dim", "query_pre_attn_scalar"] {
                if top.get(key).is_some_and(Value::is_null) {
                    top.remove(key);
                }
            }
        }
        if model_type == "gemma2" {
            // transformers' Gemma2Config, for the fields a config leaves out (an explicit `null`
            // cap means no capping there).
            let defaults: serde_json::Map<String, Value> =
                serde_json::from_str(GEMMA2_DEFAULTS).expect("valid defaults");
            for (k, v) in defaults {
                top.entry(k).or_insert(v);
            }
        }
        if model_type == "mistral" && !top.contains_key("sliding_window") {
            // transformers' MistralConfig: a window of 4096 unless the config says otherwise.
            top.insert("sliding_window".into(), Value::from(4096));
        }
        limits::check_fields(&top)?;
        unsupported::check(&model_type, &top)?;
        top.insert("model_type".into(), Value::String(model_type));
        let mut cfg: ModelConfig = serde_json::from_value(Value::Object(top.clone()))
            .map_err(|e| Error::Config(format!("config.json: {e}")))?;
        cfg.raw = top;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the types and ranges of a raw configuration's fields (what [`ModelConfig::from_value`]
    /// checks first), for loaders that want to refuse a bad configuration before reading weights.
    pub fn check_fields(raw: &Value) -> Result<()> {
        match raw {
            Value::Object(top) => limits::check_fields(top),
            _ => Err(Error::Config("config.json must be a JSON object".into())),
        }
    }

    fn validate(&self) -> Result<()> {
        let positive = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("vocab_size", self.vocab_size),
            ("num_key_value_heads", self.kv_heads()),
            ("head_dim", self.head_dim()),
        ];
        for (name, v) in positive {
            if v <= 0 {
                return Err(Error::Config(format!("`{name}` must be positive, got {v}")));
            }
        }
        if self.num_hidden_layers == 0 {
            return Err(Error::Config("`num_hidden_layers` must be positive".into()));
        }
        if self.num_attention_heads % self.kv_heads() != 0 {
            return Err(Error::Config(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_attention_heads,
                self.kv_heads()
            )));
        }
        if let Some(types) = &self.layer_types {
            if types.len() != self.num_hidden_layers {
                return Err(Error::Config(format!(
                    "`layer_types` has {} entries for {} layers",
                    types.len(),
                    self.num_hidden_layers
                )));
            }
        }
        let hd = self.head_dim();
        if hd % 2 != 0 {
            return Err(Error::Config(format!("`head_dim` ({hd}) must be even: RoPE rotates pairs of dimensions")));
        }
        let rotary = self.rotary_dims();
        if rotary <= 0 || rotary % 2 != 0 || rotary > hd || self.partial_rotary_factor.is_some_and(|f| f > 1.0) {
            return Err(Error::Config(format!(
                "`partial_rotary_factor` ({:?}) must turn an even number of a head's {hd} features, at least 2 \
                 (it gives {rotary})",
                self.partial_rotary_factor
            )));
        }
        self.rope_scaling()?;
        Ok(())
    }

    /// Key/value heads (defaults to the query heads).
    pub fn kv_heads(&self) -> i32 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Per-head dimension: `head_dim` when given, else `hidden_size / num_attention_heads`. (The
    /// loader replaces a missing `head_dim` with the one q_proj's shape implies.)
    pub fn head_dim(&self) -> i32 {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The features of each head the rotary embedding turns: `head_dim · partial_rotary_factor`
    /// rounded down (as transformers), all of them without a factor.
    pub fn rotary_dims(&self) -> i32 {
        match self.partial_rotary_factor {
            Some(f) => (self.head_dim() as f64 * f as f64) as i32,
            None => self.head_dim(),
        }
    }

    /// Whether the output head is the embedding (per-family default when unspecified).
    pub fn tied(&self) -> bool {
        self.tie_word_embeddings.unwrap_or(self.model_type.starts_with("gemma"))
    }

    /// The parsed `rope_scaling`.
    pub fn rope_scaling(&self) -> Result<Option<RopeScaling>> {
        let Some(Value::Object(s)) = &self.rope_scaling else { return Ok(None) };
        let kind = s.get("rope_type").or_else(|| s.get("type")).and_then(Value::as_str).unwrap_or("default");
        // `factor` stretches positions: below 1 it would shrink them (transformers refuses it too).
        let num = |k: &str| -> Result<f32> {
            let v = s.get(k).ok_or_else(|| Error::Config(format!("rope_scaling ({kind}) lacks numeric `{k}`")))?;
            let check = if k == "factor" { limits::at_least_one } else { limits::positive };
            check(v).map_err(|why| Error::Config(format!("rope_scaling ({kind}): `{k}` {why}")))?;
            Ok(v.as_f64().expect("a number") as f32)
        };
        match kind {
            "default" => Ok(None),
            "linear" => Ok(Some(RopeScaling::Linear { factor: num("factor")? })),
            "llama3" => {
                let (low, high) = (num("low_freq_factor")?, num("high_freq_factor")?);
                if high <= low {
                    return Err(Error::Config(format!(
                        "rope_scaling (llama3): `high_freq_factor` ({high}) must exceed `low_freq_factor` ({low})"
                    )));
                }
                Ok(Some(RopeScaling::Llama3 {
                    factor: num("factor")?,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: num("original_max_position_embeddings")?,
                }))
            }
            "longrope" | "su" => self.longrope(s),
            "yarn" => self.yarn(s, num("factor")?),
            other => Err(Error::Config(format!(
                "rope_scaling type `{other}` is not supported (supported: linear, llama3, longrope, yarn)"
            ))),
        }
    }

    /// LongRoPE from its `rope_scaling` block: one positive `long_factor` per rotated pair; the
    /// attention factor given, else `√(1 + ln(s) / ln(original))` for the extension
    /// `s = max_position_embeddings / original_max_position_embeddings` (1 without one), as
    /// transformers computes it.
    fn longrope(&self, s: &serde_json::Map<String, Value>) -> Result<Option<RopeScaling>> {
        let pairs = (self.rotary_dims() / 2) as usize;
        let factors = |key: &str| -> Result<Vec<f32>> {
            let list = s.get(key).and_then(Value::as_array);
            let values: Option<Vec<f32>> =
                list.and_then(|l| l.iter().map(|v| v.as_f64().filter(|f| *f > 0.0).map(|f| f as f32)).collect());
            match values {
                Some(v) if v.len() == pairs => Ok(v),
                _ => Err(Error::Config(format!(
                    "rope_scaling (longrope): `{key}` must list {pairs} positive numbers (one per rotated pair of \
                     features)"
                ))),
            }
        };
        factors("short_factor")?;
        let long_factor = factors("long_factor")?;
        let original = s
            .get("original_max_position_embeddings")
            .and_then(Value::as_u64)
            .map(|n| n as usize)
            .or(self.original_max_position_embeddings);
        let attention_factor = match s.get("attention_factor").and_then(Value::as_f64) {
            Some(f) if f > 0.0 => f as f32,
            Some(f) => {
                return Err(Error::Config(format!("rope_scaling (longrope): `attention_factor` {f} must be positive")))
            }
            None => match (original, self.max_position_embeddings) {
                (Some(orig), Some(max)) if orig > 1 && max > orig => {
                    let scale = max as f64 / orig as f64;
                    (1.0 + scale.ln() / (orig as f64).ln()).sqrt() as f32
                }
                _ => 1.0,
            },
        };
        Ok(Some(RopeScaling::LongRope { long_factor, attention_factor }))
    }

    /// YaRN from its `rope_scaling` block (`factor`; `beta_fast` 32, `beta_slow` 1, `truncate` true,
    /// `original_max_position_embeddings` else `max_position_embeddings`, by default): pair `i`
    /// turns at `1 / ((r_i / factor) + (1 − r_i))` of its plain frequency, `r_i` the ramp from 0 at
    /// the correction range's low end to 1 at its high end; the attention factor given, else
    /// `0.1 · ln(factor) + 1` (or the ratio of two such with `mscale` and `mscale_all_dim`).
    fn yarn(&self, s: &serde_json::Map<String, Value>, factor: f32) -> Result<Option<RopeScaling>> {
        let get = |k: &str| s.get(k).and_then(Value::as_f64);
        let factor = factor as f64;
        if !(factor.is_finite() && factor > 0.0) {
            return Err(Error::Config(format!("rope_scaling (yarn): `factor` {factor} must be positive")));
        }
        let mscale = |m: f64| if factor <= 1.0 { 1.0 } else { 0.1 * m * factor.ln() + 1.0 };
        let attention_factor = match (get("attention_factor"), get("mscale"), get("mscale_all_dim")) {
            (Some(f), _, _) => f,
            (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => mscale(m) / mscale(all),
            _ => mscale(1.0),
        };
        let dim = self.rotary_dims() as f64;
        let base = self.rope_theta as f64;
        let original = get("original_max_position_embeddings")
            .or(self.max_position_embeddings.map(|m| m as f64))
            .filter(|o| *o > 0.0)
            .ok_or_else(|| Error::Config("rope_scaling (yarn): no original_max_position_embeddings".into()))?;
        let correction =
            |rotations: f64| dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
        let (mut low, mut high) =
            (correction(get("beta_fast").unwrap_or(32.0)), correction(get("beta_slow").unwrap_or(1.0)));
        if s.get("truncate").and_then(Value::as_bool).unwrap_or(true) {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
        if low == high {
            high += 0.001;
        }
        let factors = (0..self.rotary_dims() / 2)
            .map(|i| {
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                (1.0 / (ramp / factor + (1.0 - ramp))) as f32
            })
            .collect();
        Ok(Some(RopeScaling::Yarn { factors, attention_factor: attention_factor as f32 }))
    }

    /// The sliding window of layer `i` (a query sees itself and the `window - 1` positions before
    /// it), or `None` when the layer attends to the whole past. Which layers slide follows each
    /// family's transformers class:
    /// - Gemma 3: [`ModelConfig::is_sliding`];
    /// - Mistral, Mixtral and Phi-3: every layer, unless `layer_types` names the sliding ones;
    /// - Gemma 2 and gpt-oss: those `layer_types` names, else every other layer from the first;
    /// - Qwen 2/3 (and Qwen 3 MoE): none unless `use_sliding_window`, then those `layer_types` names, else the
    ///   layers from `max_window_layers` (default 28) on;
    /// - Llama: those `layer_types` names (as mlx-lm's llama; transformers' has no window). A window
    ///   without `layer_types` is ignored by both, and by rmlx, with a warning at load.
    pub fn layer_window(&self, i: usize) -> Option<usize> {
        let window = self.sliding_window?;
        let listed = |i: usize| self.layer_types.as_ref().map(|t| t.get(i).is_some_and(|t| t == "sliding_attention"));
        let sliding = match self.model_type.as_str() {
            "gemma3" | "gemma3_text" => self.is_sliding(i),
            "mistral" | "phi3" | "mixtral" => listed(i).unwrap_or(true),
            "gemma2" | "gpt_oss" => listed(i).unwrap_or(i.is_multiple_of(2)),
            "qwen2" | "qwen3" | "qwen3_moe" => {
                self.use_sliding_window == Some(true) && listed(i).unwrap_or(i >= self.max_window_layers.unwrap_or(28))
            }
            _ => listed(i).unwrap_or(false),
        };
        sliding.then_some(window)
    }

    /// Gemma 3: whether layer `i` attends through a sliding window.
    pub fn is_sliding(&self, i: usize) -> bool {
        if let Some(types) = &self.layer_types {
            return types.get(i).is_some_and(|t| t == "sliding_attention");
        }
        match self.sliding_window_pattern {
            Some(p) if p > 0 => !(i + 1).is_multiple_of(p),
            _ => false,
        }
    }

    /// End-of-sequence ids from `eos_token_id` (a number or a list).
    pub fn eos_ids(&self) -> Vec<u32> {
        ids_of(self.eos_token_id.as_ref())
    }

    /// The checkpoint's dtype name (`torch_dtype` / `dtype`).
    pub fn dtype_name(&self) -> Option<&str> {
        self.torch_dtype.as_deref()
    }

    /// The MLX quantisation block, if any.
    pub fn quantization_block(&self) -> Option<&Value> {
        self.quantization.as_ref().or(self.quantization_config.as_ref()).filter(|q| q.get("bits").is_some())
    }

    /// The quantisation mode of layer `prefix` (`affine`, `mxfp4`, `mxfp8`, `nvfp4`): the block's
    /// (else `affine`), or where the layer has an entry of its own, the entry's (else `affine`:
    /// mlx-lm quantises such a layer with the entry's settings alone, so a router kept at 8 bits
    /// in an `mxfp4` model is affine).
    pub fn quantization_mode_of(&self, prefix: &str) -> Option<String> {
        let block = self.quantization_block()?;
        let own = block.get(prefix).filter(|e| e.is_object()).unwrap_or(block);
        Some(own.get("mode").and_then(Value::as_str).unwrap_or("affine").to_string())
    }

    /// `(group_size, bits)` of the tensor `prefix` (`model.layers.0.mlp.up_proj`): the
    /// `quantization` block's (defaults 64 and 4), or where the layer has an entry of its own,
    /// the entry's, what it leaves out at its mode's defaults (affine 64 and 4, `mxfp4` 32 and 4,
    /// `nvfp4` 16 and 4, `mxfp8` 32 and 8), as mlx-lm reads it; `None` without a block. A value
    /// that is not an integer is an error.
    pub fn quantization_of(&self, prefix: &str) -> Result<Option<(i32, i32)>> {
        let Some(block) = self.quantization_block() else { return Ok(None) };
        let get = |v: &Value, k: &str| -> Result<Option<i32>> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_i64()
                    .and_then(|n| i32::try_from(n).ok())
                    .map(Some)
                    .ok_or_else(|| Error::Config(format!("quantization `{k}` must be an integer, got {x}"))),
            }
        };
        Ok(Some(match block.get(prefix) {
            Some(o @ Value::Object(_)) => {
                let (gs, bits) = match o.get("mode").and_then(Value::as_str).unwrap_or("affine") {
                    "mxfp4" => (32, 4),
                    "nvfp4" => (16, 4),
                    "mxfp8" => (32, 8),
                    _ => (64, 4),
                };
                (get(o, "group_size")?.unwrap_or(gs), get(o, "bits")?.unwrap_or(bits))
            }
            _ => (get(block, "group_size")?.unwrap_or(64), get(block, "bits")?.unwrap_or(4)),
        }))
    }
}

/// A token id or list of ids in a config.
pub fn ids_of(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
        _ => Vec::new(),
    }
}

/// transformers ≥ 5 writes `rope_parameters` (`{rope_theta, rope_type, factor, ...}`, or one such
/// object per layer type for Gemma 3) instead of `rope_theta` + `rope_scaling`, and puts
/// `partial_rotary_factor` there too: map it back.
fn normalize_rope_parameters(top: &mut serde_json::Map<String, Value>) {
    let Some(Value::Object(params)) = top.remove("rope_parameters") else { return };
    let mut apply = |p: &serde_json::Map<String, Value>, theta_key: &str, scaling: bool| {
        if let Some(theta) = p.get("rope_theta") {
            top.entry(theta_key.to_string()).or_insert(theta.clone());
        }
        if scaling {
            // Fields of the model that transformers 5 files under RoPE (Phi-4-mini's 0.75).
            for key in ["partial_rotary_factor", "original_max_position_embeddings"] {
                if let Some(v) = p.get(key).filter(|v| !v.is_null()) {
                    top.entry(key.to_string()).or_insert(v.clone());
                }
            }
        }
        let kind = p.get("rope_type").and_then(Value::as_str).unwrap_or("default");
        if scaling && kind != "default" && top.get("rope_scaling").is_none_or(|v| v.is_null()) {
            let mut sc = p.clone();
            sc.remove("rope_theta");
            sc.remove("partial_rotary_factor");
            top.insert("rope_scaling".into(), Value::Object(sc));
        }
    };
    if let Some(Value::Object(full)) = params.get("full_attention") {
        apply(full, "rope_theta", true);
        if let Some(Value::Object(local)) = params.get("sliding_attention") {
            apply(local, "rope_local_base_freq", false);
        }
    } else {
        apply(&params, "rope_theta", true);
    }
}

/// RoPE divisors `base^(2i/dims)` for `i < dims/2`, with Llama 3 scaling applied (the form
/// [`rmlx::fast::RopeFreqs::Explicit`] takes).
pub fn llama3_rope_divisors(dims: i32, base: f32, s: &RopeScaling) -> Vec<f32> {
    let RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings: old } = *s
    else {
        return (0..dims / 2).map(|i| (base as f64).powf(2.0 * i as f64 / dims as f64) as f32).collect();
    };
    let (factor, low, high, old) = (factor as f64, low_freq_factor as f64, high_freq_factor as f64, old as f64);
    let (low_wavelen, high_wavelen) = (old / low, old / high);
    (0..dims / 2)
        .map(|i| {
            let d = (base as f64).powf(2.0 * i as f64 / dims as f64);
            let wavelen = 2.0 * std::f64::consts::PI * d;
            let out = if wavelen > low_wavelen {
                d * factor
            } else if wavelen < high_wavelen {
                d
            } else {
                let smooth = (old / wavelen - low) / (high - low);
                d / ((1.0 - smooth) / factor + smooth)
            };
            out as f32
        })
        .collect()
}
