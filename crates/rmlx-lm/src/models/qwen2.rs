//! Qwen 2 / 2.5: the Llama block with biased query, key and value projections (the output
//! projection has none), grouped-query attention, SwiGLU, tied or separate output head.

use super::llama::output_head;
use super::{cached_attention, merge_heads, split_heads, uniform_caches, Rope};
use crate::cache::KvCache;
use crate::config::ModelConfig;
use crate::nn::{Builder, Embedding, GatedMlp, Linear, RmsNorm};
use crate::Result;
use rmlx::Array;

/// Multi-head attention with `kv_heads` key/value heads shared by groups of query heads.
pub struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    rope: Rope,
}

impl Attention {
    fn load(cfg: &ModelConfig, b: &mut Builder, p: &str) -> Result<Self> {
        let (h, heads, kv, d) = (cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads(), cfg.head_dim());
        let bias = true;
        Ok(Self {
            q_proj: b.linear(&format!("{p}.q_proj"), h, heads * d, bias)?,
            k_proj: b.linear(&format!("{p}.k_proj"), h, kv * d, bias)?,
            v_proj: b.linear(&format!("{p}.v_proj"), h, kv * d, bias)?,
            o_proj: b.linear(&format!("{p}.o_proj"), heads * d, h, false)?,
            heads,
            kv_heads: kv,
            head_dim: d,
            rope: Rope::global(cfg)?,
        })
    }

    fn forward(&self, x: &Array, cache: &mut KvCache) -> Result<Array> {
        let q = split_heads(&self.q_proj.forward(x)?, self.heads, self.head_dim)?;
        let k = split_heads(&self.k_proj.forward(x)?, self.kv_heads, self.head_dim)?;
        let v = split_heads(&self.v_proj.forward(x)?, self.kv_heads, self.head_dim)?;
        let offset = cache.offset();
        let (q, k) = (self.rope.apply(&q, offset)?, self.rope.apply(&k, offset)?);
        let scale = (self.head_dim as f32).powf(-0.5);
        let o = cached_attention(&q, &k, &v, cache, scale)?;
        self.o_proj.forward(&merge_heads(&o)?)
    }
}

/// `x + attn(norm(x))`, then `h + mlp(norm(h))`.
pub struct Block {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: GatedMlp,
}

impl Block {
    fn load(cfg: &ModelConfig, b: &mut Builder, p: &str) -> Result<Self> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        Ok(Self {
            input_layernorm: b.rms_norm(&format!("{p}.input_layernorm"), h, eps, false)?,
            self_attn: Attention::load(cfg, b, &format!("{p}.self_attn"))?,
            post_attention_layernorm: b.rms_norm(&format!("{p}.post_attention_layernorm"), h, eps, false)?,
            mlp: GatedMlp::load(b, &format!("{p}.mlp"), h, cfg.intermediate_size, false)?,
        })
    }

    fn forward(&self, x: &Array, cache: &mut KvCache) -> Result<Array> {
        let h = (x + self.self_attn.forward(&self.input_layernorm.forward(x)?, cache)?)?;
        Ok((&h + self.mlp.forward(&self.post_attention_layernorm.forward(&h)?)?)?)
    }
}

/// Embedding, blocks, final norm and the output head (tied to the embedding or separate).
pub struct Model {
    cfg: ModelConfig,
    embed_tokens: Embedding,
    layers: Vec<Block>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
}

impl Model {
    /// Builds the model from `model.*` / `lm_head.*` tensors.
    pub fn load(cfg: &ModelConfig, b: &mut Builder) -> Result<Self> {
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Block::load(cfg, b, &format!("model.layers.{i}")))
            .collect::<Result<_>>()?;
        Ok(Self {
            embed_tokens: b.embedding("model.embed_tokens", cfg.vocab_size, cfg.hidden_size)?,
            layers,
            norm: b.rms_norm("model.norm", cfg.hidden_size, cfg.rms_norm_eps, false)?,
            lm_head: output_head(cfg, b)?,
            cfg: cfg.clone(),
        })
    }
}

impl super::Model for Model {
    fn forward_hidden(&self, ids: &Array, caches: &mut [KvCache]) -> Result<Array> {
        let mut h = self.embed_tokens.forward(ids)?;
        for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
            h = layer.forward(&h, cache)?;
        }
        self.norm.forward(&h)
    }

    fn logits(&self, hidden: &Array) -> Result<Array> {
        match &self.lm_head {
            Some(head) => head.forward(hidden),
            None => self.embed_tokens.as_linear(hidden),
        }
    }

    fn new_caches(&self, context_limit: Option<usize>) -> Vec<KvCache> {
        uniform_caches(self.layers.len(), context_limit)
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }
}
