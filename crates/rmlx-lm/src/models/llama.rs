//! Llama 2/3 (and Mistral-style llama checkpoints): pre-norm decoder blocks of grouped-query
//! attention with rotary embeddings (plain, linear or Llama 3 scaled) and a SwiGLU feed-forward.
//! Qwen 2 and Qwen 3 are this model with a different [`AttentionSpec`].

use super::attention::{Attention, AttentionSpec};
use super::decoder::{Decoder, DecoderBlock};
use super::spec::{ArchitectureSpec, GgufSpec, HeadCounts, MetadataNumber};
use super::Rope;
use crate::cache::KvCache;
use crate::config::Architecture;
use crate::config::ModelConfig;
use crate::nn::cpu_layer::{self, BlockParts};
use crate::nn::{Builder, GatedMlp, RmsNorm};
use crate::weights::Weight;
use crate::Result;
use rmlx::quantization::Quantized;
use rmlx::Array;
use serde_json::{json, Map, Value};

/// Llama's attention: biases only when `attention_bias`, no q/k norms, `1/√head_dim` scale.
pub fn attention_spec(cfg: &ModelConfig) -> Result<AttentionSpec> {
    Ok(AttentionSpec {
        qkv_bias: cfg.attention_bias.unwrap_or(false),
        qk_norm: None,
        scale: (cfg.head_dim() as f32).powf(-0.5),
        rope: Rope::global(cfg)?,
        logit_softcap: None,
        sinks: false,
        o_bias: false,
    })
}

/// The Llama family in [`super::spec::ARCHITECTURES`].
pub static SPEC: ArchitectureSpec = ArchitectureSpec {
    name: "llama",
    architecture: Architecture::Llama,
    model_types: &["llama", "mistral"],
    hf_classes: &[("LlamaForCausalLM", "llama"), ("MistralForCausalLM", "mistral")],
    signature_tensor: None,
    chat_family: "llama3",
    gguf: Some(GgufSpec {
        arch: "llama",
        model_type: "llama",
        ffn_norm: "post_attention_layernorm",
        modules: &[],
        fix_up: gguf_fix_up,
        config: gguf_config,
    }),
    build: |cfg, b| Ok(Box::new(Model::load(cfg, b)?)),
    mlx_lm: super::spec::MLX_LM_AS_IS,
};

/// A window in the metadata (`llama.attention.sliding_window`, as llama.cpp writes Mistral's)
/// slides every layer; experts (`llama.expert_count`, `expert_used_count`: how llama.cpp writes
/// Mixtral) make it Mixtral.
fn gguf_config(num: MetadataNumber, c: &mut Map<String, Value>) {
    if let (Some(experts), Some(used)) = (num("expert_count"), num("expert_used_count")) {
        if experts >= 1.0 {
            c.insert("model_type".into(), json!("mixtral"));
            c.insert("num_local_experts".into(), json!(experts as i64));
            c.insert("num_experts_per_tok".into(), json!(used as i64));
        }
    }
    if let (Some(window), Some(layers)) = (num("attention.sliding_window"), num("block_count")) {
        c.insert("sliding_window".into(), json!(window as i64));
        if (1.0..=4096.0).contains(&layers) {
            c.insert("layer_types".into(), json!(vec!["sliding_attention"; layers as usize]));
        }
    }
}

/// llama.cpp permutes the rows of llama's query and key projections.
fn gguf_fix_up(name: &str, w: Weight, heads: &HeadCounts) -> Result<Weight> {
    if name.ends_with("q_proj.weight") {
        unpermute_llama_rows(w, heads.heads)
    } else if name.ends_with("k_proj.weight") {
        unpermute_llama_rows(w, heads.kv_heads)
    } else {
        Ok(w)
    }
}

/// Undoes llama.cpp's permutation of llama's Q/K projection rows. `convert_hf_to_gguf` stores
/// `w.reshape(n_head, 2, rows / n_head / 2, ...).swapaxes(1, 2).reshape(w.shape)`, so GGUF row
/// `h·hd + 2i + t` is Hugging Face row `h·hd + t·hd/2 + i` (`hd = rows / n_head`). A quantised
/// weight gets the same row permutation on its packed weight, scales and biases. Pass the number of
/// query heads for Q and of key/value heads for K.
pub fn unpermute_llama_rows(w: Weight, n_head: usize) -> Result<Weight> {
    let shape = w.shape();
    let rows =
        *shape.first().ok_or_else(|| crate::Error::Config("unpermute_llama_rows: a 0-d tensor".into()))? as usize;
    if n_head.checked_mul(2).is_none_or(|pair| pair == 0 || !rows.is_multiple_of(pair)) {
        return Err(crate::Error::Config(format!(
            "unpermute_llama_rows: {rows} rows cannot be split into {n_head} heads of pairs"
        )));
    }
    let perm = |a: &Array| -> Result<Array> {
        let orig = a.shape().to_vec();
        let mut s = vec![n_head as i32, (rows / n_head / 2) as i32, 2];
        s.extend_from_slice(&orig[1..]);
        Ok(a.reshape(&s)?.swapaxes(1, 2)?.reshape(&orig)?)
    };
    Ok(match w {
        Weight::Dense(a) => Weight::Dense(perm(&a)?),
        Weight::Quantized(q) => Weight::Quantized(Quantized {
            weight: perm(&q.weight)?,
            scales: perm(&q.scales)?,
            biases: q.biases.as_ref().map(perm).transpose()?,
            ..q
        }),
    })
}

/// `x + attn(norm(x))`, then `h + mlp(norm(h))`.
#[derive(Clone)]
pub struct Block {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: GatedMlp,
}

impl Block {
    fn load(cfg: &ModelConfig, b: &mut Builder, p: &str, attention: AttentionSpec) -> Result<Self> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        Ok(Self {
            input_layernorm: b.rms_norm(&format!("{p}.input_layernorm"), h, eps, false)?,
            self_attn: Attention::load(cfg, b, &format!("{p}.self_attn"), attention)?,
            post_attention_layernorm: b.rms_norm(&format!("{p}.post_attention_layernorm"), h, eps, false)?,
            mlp: GatedMlp::load(b, &format!("{p}.mlp"), h, cfg.intermediate_size, false)?,
        })
    }

    /// A decoding step (or a verification pass of up to 8 positions) of one sequence, or a step
    /// of up to 8 sequences of a batch, on the CPU with packed weights, as fused primitives
    /// ([`cpu_layer`]), where they serve.
    fn packed_cpu_step(&self, x: &Array, batch: i32, cache: &mut KvCache) -> Result<Option<Array>> {
        if !matches!(cache, KvCache::Standard(_) | KvCache::Batch(_)) {
            return Ok(None);
        }
        let Some(attention) = self.self_attn.packed_parts() else { return Ok(None) };
        let parts = BlockParts {
            input_norm: &self.input_layernorm,
            attention,
            post_norm: &self.post_attention_layernorm,
            mlp: &self.mlp,
        };
        match cache {
            KvCache::Standard(c) if batch == 1 => cpu_layer::decode_step(x, &parts, c, &[0]),
            KvCache::Batch(b) => b.with_plain(|c, starts| cpu_layer::decode_step(x, &parts, c, starts)),
            _ => Ok(None),
        }
    }
}

/// Llama's decoder: [`Decoder`] over Llama blocks.
pub type Model = Decoder<Block>;

impl DecoderBlock for Block {
    fn forward(&self, x: &Array, batch: i32, cache: &mut KvCache) -> Result<Array> {
        if let Some(h) = self.packed_cpu_step(x, batch, cache)? {
            return Ok(h);
        }
        let o = self.self_attn.attend(x, &self.input_layernorm, batch, cache)?;
        self.mlp.forward_after_attention(&o, x, self.self_attn.o_proj(), &self.post_attention_layernorm)
    }
}

impl Decoder<Block> {
    /// Builds a Llama model from `model.*` / `lm_head.*` tensors.
    pub fn load(cfg: &ModelConfig, b: &mut Builder) -> Result<Self> {
        Self::load_with(cfg, b, attention_spec)
    }

    /// Builds the model with the attention layers `spec` describes (the Llama-family variants).
    pub fn load_with(
        cfg: &ModelConfig,
        b: &mut Builder,
        spec: fn(&ModelConfig) -> Result<AttentionSpec>,
    ) -> Result<Self> {
        if cfg.model_type == "llama" && cfg.sliding_window.is_some() && cfg.layer_types.is_none() {
            tracing::warn!(
                "config.json sets `sliding_window` without `layer_types`: a llama model attends to the whole past \
                 (as transformers and mlx-lm do); use model_type `mistral` for a window on every layer"
            );
        }
        let layers = b
            .stage(cfg.num_hidden_layers)
            .layers()
            .map(|i| Block::load(cfg, b, &format!("model.layers.{i}"), spec(cfg)?))
            .collect::<Result<_>>()?;
        Decoder::new(cfg, b, layers)
    }
}

crate::nn::module_fields!(Block { input_layernorm, self_attn, post_attention_layernorm, mlp });
