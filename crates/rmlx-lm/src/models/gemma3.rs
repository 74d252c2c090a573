//! Gemma 3 (the text model of `gemma3_text` and `gemma3` checkpoints): grouped-query attention with
//! RMSNorm on queries and keys, local layers attending through a sliding window with their own RoPE
//! base, `(1 + w)` RMSNorms (four per block: before and after attention and feed-forward), a GELU-tanh
//! gated feed-forward, and embeddings scaled by `√hidden`.

use super::attention::{Attention, AttentionSpec};
use super::decoder::output_head;
use super::spec::{ArchitectureSpec, GgufSpec, HeadCounts, MetadataNumber};
use super::{softcap, Rope};
use crate::cache::KvCache;
use crate::config::{Architecture, ModelConfig};
use crate::nn::{Builder, CapturedSteps, Embedding, GatedMlp, Head, Linear, RmsNorm};
use crate::weights::Weight;
use crate::{Error, Result};
use rmlx::{Array, Dtype};
use serde_json::{json, Map, Value};

/// Gemma 3 in [`super::spec::ARCHITECTURES`].
pub static SPEC: ArchitectureSpec = ArchitectureSpec {
    name: "gemma3",
    architecture: Architecture::Gemma3,
    model_types: &["gemma3_text", "gemma3"],
    hf_classes: &[("Gemma3ForCausalLM", "gemma3_text"), ("Gemma3ForConditionalGeneration", "gemma3")],
    signature_tensor: None,
    chat_family: "gemma",
    gguf: Some(GgufSpec {
        arch: "gemma3",
        model_type: "gemma3_text",
        ffn_norm: "pre_feedforward_layernorm",
        modules: &[],
        fix_up: gguf_fix_up,
        config: gguf_config,
    }),
    build: |cfg, b| Ok(Box::new(Model::load(cfg, b)?)),
    mlx_lm: super::spec::MlxLmLayout { sanitize: mlx_lm_names, quantization: |_| None },
};

/// mlx-lm holds the multimodal checkpoint's text model under `language_model.` (its own
/// `model.` and `lm_head.` inside), whichever of transformers' two layouts the checkpoint has.
fn mlx_lm_names(cfg: &ModelConfig, t: &mut super::spec::Tensors) -> Result<()> {
    if cfg.model_type != "gemma3" {
        return Ok(());
    }
    for name in t.keys().cloned().collect::<Vec<_>>() {
        let renamed = if let Some(rest) = name.strip_prefix("model.language_model.") {
            format!("language_model.model.{rest}")
        } else if name.starts_with("lm_head.") || name.starts_with("model.") {
            format!("language_model.{name}")
        } else {
            continue;
        };
        let a = t.remove(&name).expect("listed");
        t.insert(renamed, a);
    }
    Ok(())
}

/// llama.cpp stores Gemma's norm weights as `1 + w`.
pub(super) fn gguf_fix_up(name: &str, w: Weight, _: &HeadCounts) -> Result<Weight> {
    match w {
        Weight::Dense(a) if name.ends_with("norm.weight") => Ok(Weight::Dense((a.astype(Dtype::Float32)? - 1.0)?)),
        w => Ok(w),
    }
}

/// llama.cpp hard-codes Gemma 3's layout: every sixth layer global, local RoPE base 10⁴; the
/// window and the query scale (the key length) are in the metadata.
fn gguf_config(num: MetadataNumber, c: &mut Map<String, Value>) {
    if let Some(w) = num("attention.sliding_window") {
        c.insert("sliding_window".into(), json!(w as i64));
    }
    c.insert("sliding_window_pattern".into(), json!(6));
    c.insert("rope_local_base_freq".into(), json!(10000.0));
    if let Some(d) = num("attention.key_length") {
        c.insert("query_pre_attn_scalar".into(), json!(d));
    }
}

/// Gemma's attention: q/k norms with `(1 + w)` weights, `query_pre_attn_scalar^-½` scale;
/// `sliding` layers use the local RoPE base (and a rotating cache), global ones `rope_theta` with
/// the configured scaling.
fn attention_spec(cfg: &ModelConfig, sliding: bool) -> Result<AttentionSpec> {
    let rope = if sliding {
        Rope::new(cfg.head_dim(), cfg.rope_local_base_freq.unwrap_or(10000.0), None)?
    } else {
        Rope::global(cfg)?
    };
    Ok(AttentionSpec {
        qkv_bias: cfg.attention_bias.unwrap_or(false),
        qk_norm: Some(true),
        scale: cfg.query_pre_attn_scalar.unwrap_or(cfg.head_dim() as f32).powf(-0.5),
        rope,
        logit_softcap: None,
        sinks: false,
        o_bias: false,
    })
}

/// `h = x + norm(attn(norm(x)))`, then `h + norm(mlp(norm(h)))`.
#[derive(Clone)]
pub struct Block {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    pre_feedforward_layernorm: RmsNorm,
    mlp: GatedMlp,
    post_feedforward_layernorm: RmsNorm,
}

impl Block {
    fn load(cfg: &ModelConfig, b: &mut Builder, p: &str, attention: AttentionSpec) -> Result<Self> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let mut norm = |name: &str| b.rms_norm(&format!("{p}.{name}"), h, eps, true);
        let (input_layernorm, post_attention_layernorm) = (norm("input_layernorm")?, norm("post_attention_layernorm")?);
        let (pre_feedforward_layernorm, post_feedforward_layernorm) =
            (norm("pre_feedforward_layernorm")?, norm("post_feedforward_layernorm")?);
        Ok(Self {
            input_layernorm,
            self_attn: Attention::load(cfg, b, &format!("{p}.self_attn"), attention)?,
            post_attention_layernorm,
            pre_feedforward_layernorm,
            mlp: GatedMlp::load(b, &format!("{p}.mlp"), h, cfg.intermediate_size, true)?,
            post_feedforward_layernorm,
        })
    }

    fn forward(&self, x: &Array, batch: i32, cache: &mut KvCache) -> Result<Array> {
        let o = self.self_attn.attend(x, &self.input_layernorm, batch, cache)?;
        let a = self.self_attn.o_proj().forward_fused(&o)?;
        let h = self.post_attention_layernorm.forward_add(&a, x)?;
        let m = self.mlp.forward_normed(&h, &self.pre_feedforward_layernorm)?;
        self.post_feedforward_layernorm.forward_add(&m, &h)
    }
}

/// Scaled embedding, blocks, final norm, tied head, optional final logit soft-capping.
#[derive(Clone)]
pub struct Model {
    cfg: ModelConfig,
    embed_tokens: Embedding,
    embed_scale: Array,
    /// All blocks, or a pipeline stage's.
    layers: crate::nn::pipeline::Blocks<Block>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    /// The decoding step's layers as one launch, on MLX's CUDA backend.
    steps: CapturedSteps,
}

impl Model {
    /// Builds the model from `model.*` tensors.
    pub fn load(cfg: &ModelConfig, b: &mut Builder) -> Result<Self> {
        if cfg.layer_types.is_none() && cfg.sliding_window_pattern.is_none() {
            return Err(Error::Config("gemma3 needs `layer_types` or `sliding_window_pattern`".into()));
        }
        if (0..cfg.num_hidden_layers).any(|i| cfg.is_sliding(i)) && cfg.sliding_window.is_none() {
            return Err(Error::Config("gemma3 has sliding layers but no `sliding_window`".into()));
        }
        Self::load_with(cfg, b, |cfg, i| attention_spec(cfg, cfg.is_sliding(i)))
    }

    /// Builds the model with layer `i`'s attention as `spec(cfg, i)` describes it (the Gemma
    /// variants: Gemma 2's has no q/k norms, one RoPE and capped scores).
    pub fn load_with(
        cfg: &ModelConfig,
        b: &mut Builder,
        spec: fn(&ModelConfig, usize) -> Result<AttentionSpec>,
    ) -> Result<Self> {
        let layers = b
            .stage(cfg.num_hidden_layers)
            .layers()
            .map(|i| Block::load(cfg, b, &format!("model.layers.{i}"), spec(cfg, i)?))
            .collect::<Result<_>>()?;
        // transformers rounds the scale to the weights' dtype before multiplying.
        let embed_scale = Array::scalar_as((cfg.hidden_size as f64).sqrt(), b.dtype)?;
        Ok(Self {
            embed_tokens: b.embedding("model.embed_tokens", cfg.vocab_size, cfg.hidden_size)?,
            embed_scale,
            layers: crate::nn::pipeline::Blocks::new(b.stage(cfg.num_hidden_layers), layers),
            norm: b.rms_norm("model.norm", cfg.hidden_size, cfg.rms_norm_eps, true)?,
            lm_head: output_head(cfg, b)?,
            steps: CapturedSteps::new(b.step_capture),
            cfg: cfg.clone(),
        })
    }
}

impl super::Model for Model {
    fn forward_hidden(&self, ids: &Array, caches: &mut [KvCache]) -> Result<Array> {
        let (batch, length) = super::token_grid(ids)?;
        let h = (self.embed_tokens.forward(&ids.reshape(&[batch * length])?)? * &self.embed_scale)?;
        let h = super::decoder_layers(&self.steps, &self.layers, &h, caches, batch, Block::forward)?;
        Ok(self.norm.forward(&h)?.reshape(&[batch, length, self.cfg.hidden_size])?)
    }

    fn logits(&self, hidden: &Array) -> Result<Array> {
        let logits = match &self.lm_head {
            Some(head) => head.forward(hidden)?,
            None => self.embed_tokens.as_linear(hidden)?,
        };
        match self.cfg.final_logit_softcapping {
            Some(cap) if cap > 0.0 => softcap(&logits, cap),
            _ => Ok(logits),
        }
    }

    fn linear_head(&self) -> Option<Head<'_>> {
        match self.cfg.final_logit_softcapping {
            Some(cap) if cap > 0.0 => None,
            _ => Head::of(self.lm_head.as_ref(), &self.embed_tokens),
        }
    }

    fn new_caches(&self, context_limit: Option<usize>) -> Vec<KvCache> {
        super::layer_caches(&self.cfg, self.layers.stage(), context_limit)
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn boxed_clone(&self) -> Box<dyn super::Model> {
        Box::new(self.clone())
    }
}

crate::nn::module_fields!(Block {
    input_layernorm,
    self_attn,
    post_attention_layernorm,
    pre_feedforward_layernorm,
    mlp,
    post_feedforward_layernorm,
});

super::decoder_module!(Model);
