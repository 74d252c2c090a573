//! Grouped-query self-attention as all four architectures use it: q/k/v projections (optionally
//! biased), optional RMSNorm on every query and key head, rotary embeddings, the cached attention
//! call and the output projection. What differs per architecture is an [`AttentionSpec`].

use super::{cached_attention, merge_heads, split_heads, Rope};
use crate::cache::KvCache;
use crate::config::ModelConfig;
use crate::nn::{join, Builder, Linear, Module, RmsNorm};
use crate::Result;
use rmlx::Array;

/// The per-architecture choices of an attention layer.
pub struct AttentionSpec {
    /// Biases on the q/k/v projections (never on the output projection).
    pub qkv_bias: bool,
    /// RMSNorm over each query and key head before RoPE: `None`, or `Some(plus_one)` where
    /// `plus_one` selects Gemma's `(1 + w)` weights.
    pub qk_norm: Option<bool>,
    /// Multiplier of the scores.
    pub scale: f32,
    /// The rotary embedding of this layer.
    pub rope: Rope,
}

/// Multi-head attention with `kv_heads` key/value heads shared by groups of query heads.
#[derive(Clone)]
pub struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    scale: f32,
    rope: Rope,
}

impl Attention {
    /// `p.{q,k,v,o}_proj` and, with `qk_norm`, `p.{q,k}_norm`.
    pub fn load(cfg: &ModelConfig, b: &mut Builder, p: &str, spec: AttentionSpec) -> Result<Self> {
        let (h, heads, kv, d) = (cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads(), cfg.head_dim());
        let bias = spec.qkv_bias;
        let q_proj = b.linear(&format!("{p}.q_proj"), h, heads * d, bias)?;
        let k_proj = b.linear(&format!("{p}.k_proj"), h, kv * d, bias)?;
        let v_proj = b.linear(&format!("{p}.v_proj"), h, kv * d, bias)?;
        let o_proj = b.linear(&format!("{p}.o_proj"), heads * d, h, false)?;
        let mut norm = |name: &str| -> Result<Option<RmsNorm>> {
            spec.qk_norm.map(|plus_one| b.rms_norm(&format!("{p}.{name}"), d, cfg.rms_norm_eps, plus_one)).transpose()
        };
        let (q_norm, k_norm) = (norm("q_norm")?, norm("k_norm")?);
        Ok(Self {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            q_norm,
            k_norm,
            heads,
            kv_heads: kv,
            head_dim: d,
            scale: spec.scale,
            rope: spec.rope,
        })
    }

    /// Attends `x: [B, L, hidden]` over the cache extended with its keys and values.
    pub fn forward(&self, x: &Array, cache: &mut KvCache) -> Result<Array> {
        let heads = |proj: &Linear, n: i32, norm: &Option<RmsNorm>| -> Result<Array> {
            let t = split_heads(&proj.forward(x)?, n, self.head_dim)?;
            match norm {
                Some(norm) => norm.forward(&t),
                None => Ok(t),
            }
        };
        let q = heads(&self.q_proj, self.heads, &self.q_norm)?;
        let k = heads(&self.k_proj, self.kv_heads, &self.k_norm)?;
        let v = heads(&self.v_proj, self.kv_heads, &None)?;
        let offset = cache.rope_offset()?;
        let (q, k) = (self.rope.apply(&q, &offset)?, self.rope.apply(&k, &offset)?);
        let o = cached_attention(&q, &k, &v, cache, self.scale)?;
        self.o_proj.forward(&merge_heads(&o)?)
    }
}

impl Module for Attention {
    fn visit(&self, p: &str, f: &mut dyn FnMut(&str, &Array)) {
        self.q_proj.visit(&join(p, "q_proj"), f);
        self.k_proj.visit(&join(p, "k_proj"), f);
        self.v_proj.visit(&join(p, "v_proj"), f);
        self.o_proj.visit(&join(p, "o_proj"), f);
        if let Some(n) = &self.q_norm {
            n.visit(&join(p, "q_norm"), f);
        }
        if let Some(n) = &self.k_norm {
            n.visit(&join(p, "k_norm"), f);
        }
    }

    fn visit_mut(&mut self, p: &str, f: &mut dyn FnMut(&str, &mut Array)) {
        self.q_proj.visit_mut(&join(p, "q_proj"), f);
        self.k_proj.visit_mut(&join(p, "k_proj"), f);
        self.v_proj.visit_mut(&join(p, "v_proj"), f);
        self.o_proj.visit_mut(&join(p, "o_proj"), f);
        if let Some(n) = &mut self.q_norm {
            n.visit_mut(&join(p, "q_norm"), f);
        }
        if let Some(n) = &mut self.k_norm {
            n.visit_mut(&join(p, "k_norm"), f);
        }
    }

    fn visit_linears(&mut self, p: &str, f: &mut dyn FnMut(&str, &mut Linear)) {
        self.q_proj.visit_linears(&join(p, "q_proj"), f);
        self.k_proj.visit_linears(&join(p, "k_proj"), f);
        self.v_proj.visit_linears(&join(p, "v_proj"), f);
        self.o_proj.visit_linears(&join(p, "o_proj"), f);
    }
}
