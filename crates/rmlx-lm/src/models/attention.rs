//! Grouped-query self-attention as every architecture uses it: q/k/v projections (optionally
//! biased), optional RMSNorm on every query and key head, rotary embeddings, the cached attention
//! call and the output projection. What differs per architecture is an [`AttentionSpec`].

use super::{cached_attention, merge_heads, split_heads, Rope};
use crate::cache::{KvCache, Offset};
use crate::config::ModelConfig;
use crate::nn::cpu_layer::AttentionParts;
use crate::nn::cuda_attention::{self, StepHeads};
use crate::nn::cuda_fast::{self, HeadNorms};
use crate::nn::{Builder, Linear, RmsNorm, Split, Stacked};
use crate::Result;
use rmlx::{ops, Array};

/// The per-architecture choices of an attention layer.
pub struct AttentionSpec {
    /// Biases on the q/k/v projections.
    pub qkv_bias: bool,
    /// RMSNorm over each query and key head before RoPE: `None`, or `Some(plus_one)` where
    /// `plus_one` selects Gemma's `(1 + w)` weights.
    pub qk_norm: Option<bool>,
    /// Multiplier of the scores.
    pub scale: f32,
    /// The rotary embedding of this layer.
    pub rope: Rope,
    /// Gemma 2's soft-capping of the attention scores (`cap · tanh(s / cap)`).
    pub logit_softcap: Option<f32>,
    /// gpt-oss's attention sinks: a learned logit per query head (`p.sinks`, `[heads]`) that takes
    /// part in the softmax's sum and attends to nothing.
    pub sinks: bool,
    /// A bias on the output projection (gpt-oss).
    pub o_bias: bool,
}

/// A learned logit per query head joining every softmax of its scores (`p.sinks`, `[heads]`).
#[derive(Clone)]
pub struct Sinks(pub Array);

impl crate::nn::Module for Sinks {
    fn visit(&self, p: &str, f: &mut dyn FnMut(&str, crate::nn::Role, &Array)) {
        f(p, crate::nn::Role::Bias, &self.0)
    }
    fn visit_mut(&mut self, p: &str, f: &mut dyn FnMut(&str, &mut Array)) {
        f(p, &mut self.0)
    }
    fn visit_linears(&mut self, _: &str, _: &mut dyn FnMut(&str, &mut Linear)) {}
    fn visit_switches(&mut self, _: &str, _: &mut dyn FnMut(&str, &mut crate::nn::SwitchLinear)) {}
}

/// Multi-head attention with `kv_heads` key/value heads shared by groups of query heads.
#[derive(Clone)]
pub struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    /// q, k and v stacked into one product (when their weights are alike).
    qkv: Option<Stacked>,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    scale: f32,
    rope: Rope,
    logit_softcap: Option<f32>,
    sinks: Option<Sinks>,
}

impl Attention {
    /// `p.{q,k,v,o}_proj` and, with `qk_norm`, `p.{q,k}_norm`. Under tensor parallelism the
    /// layer keeps this rank's heads ([`Builder::rank_heads`]): their rows of q, k and v, their
    /// columns of the output projection (which all-sums), their sinks.
    pub fn load(cfg: &ModelConfig, b: &mut Builder, p: &str, spec: AttentionSpec) -> Result<Self> {
        let (h, heads, kv, d) = (cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads(), cfg.head_dim());
        let share = b.rank_heads(heads, kv)?;
        let bias = spec.qkv_bias;
        let names = ["q_proj", "k_proj", "v_proj"].map(|n| format!("{p}.{n}"));
        let names = names.each_ref().map(String::as_str);
        let parallel = b.tensor_parallel.as_ref().is_some_and(|tp| tp.size() > 1);
        let (q_rows, kv_rows) = (share.rows(false, d, parallel), share.rows(true, d, parallel));
        let splits = [q_rows, kv_rows, kv_rows];
        let (projections, qkv) = b.linear_group(&names, h, &[heads * d, kv * d, kv * d], bias, &splits)?;
        let [q_proj, k_proj, v_proj]: [Linear; 3] = projections.try_into().ok().expect("three layers");
        let o_proj = b.linear_split(&format!("{p}.o_proj"), heads * d, h, spec.o_bias, Split::Inputs)?;
        let sinks = match spec.sinks {
            true => {
                let name = format!("{p}.sinks");
                let sinks = b.dense(&name, &[heads])?;
                Some(Sinks(b.split_bias(&name, sinks, Split::Outputs)?))
            }
            false => None,
        };
        let mut norm = |name: &str| -> Result<Option<RmsNorm>> {
            spec.qk_norm.map(|plus_one| b.rms_norm(&format!("{p}.{name}"), d, cfg.rms_norm_eps, plus_one)).transpose()
        };
        let (q_norm, k_norm) = (norm("q_norm")?, norm("k_norm")?);
        Ok(Self {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            qkv,
            q_norm,
            k_norm,
            heads: share.heads,
            kv_heads: share.kv_heads,
            head_dim: d,
            scale: spec.scale,
            rope: spec.rope,
            logit_softcap: spec.logit_softcap,
            sinks,
        })
    }

    /// The attention's merged heads `[B·L, H·D]` for `norm(x)`, before the output projection
    /// ([`Attention::o_proj`]).
    pub fn attend(&self, x: &Array, norm: &RmsNorm, batch: i32, cache: &mut KvCache) -> Result<Array> {
        let offset = cache.rope_offset()?;
        let group = [&self.q_proj, &self.k_proj, &self.v_proj];
        let stacked = match &self.qkv {
            Some(s) => s.forward_normed(&group, x, norm)?,
            None => None,
        };
        let sinks = self.sinks.as_ref().map(|s| &s.0);
        if let Some(y) = &stacked {
            let scores = cuda_attention::Scores { softcap: self.logit_softcap, sinks };
            if let Some(attention) = self.decode_attention(y, batch, &offset, cache, scores)? {
                return Ok(attention);
            }
        }
        let [q, k, v] = self.heads(stacked, x, norm, batch, &offset)?;
        merge_heads(&cached_attention(&q, &k, &v, cache, self.scale, self.logit_softcap, sinks)?)
    }

    /// The output projection, which a block may fuse with what follows
    /// (`GatedMlp::forward_after_attention`).
    pub fn o_proj(&self) -> &Linear {
        &self.o_proj
    }

    /// The query, key and value heads `[B, H, L, D]` of `norm(x)` (or of `stacked`, the q/k/v
    /// product of `norm(x)` stacked, where it was made), queries and keys normalised (with q/k
    /// norms) and rotated to their positions.
    fn heads(
        &self,
        stacked: Option<Array>,
        x: &Array,
        norm: &RmsNorm,
        batch: i32,
        offset: &Offset,
    ) -> Result<[Array; 3]> {
        let (q_heads, kv_heads, d) = (self.heads, self.kv_heads, self.head_dim);
        let [q, k, v] = match stacked {
            Some(y) => {
                if let Some(heads) = self.fused_heads(&y, batch, offset)? {
                    return Ok(heads);
                }
                let heads = split_heads(&y, batch, q_heads + 2 * kv_heads, d)?;
                let parts = ops::split_at(&heads, &[q_heads, q_heads + kv_heads], 1)?;
                parts.try_into().expect("three parts")
            }
            None => {
                let x = norm.forward(x)?;
                let heads = |proj: &Linear, n: i32| split_heads(&proj.forward(&x)?, batch, n, d);
                [heads(&self.q_proj, q_heads)?, heads(&self.k_proj, kv_heads)?, heads(&self.v_proj, kv_heads)?]
            }
        };
        let norm = |t: Array, norm: &Option<RmsNorm>| match norm {
            Some(norm) => norm.forward(&t),
            None => Ok(t),
        };
        let (q, k) = (norm(q, &self.q_norm)?, norm(k, &self.k_norm)?);
        Ok([self.rope.apply(&q, offset)?, self.rope.apply(&k, offset)?, v])
    }

    /// What the fused CPU decoding step reads of this layer (see [`crate::nn::cpu_layer`]): q, k
    /// and v stacked and packed, the output projection packed, none of them adapted.
    pub(crate) fn packed_parts(&self) -> Option<AttentionParts<'_>> {
        if self.logit_softcap.is_some() {
            return None;
        }
        let qkv = self.qkv.as_ref()?.intact(&[&self.q_proj, &self.k_proj, &self.v_proj])?.packed()?;
        let head_norms = match (&self.q_norm, &self.k_norm) {
            (Some(q), Some(k)) => Some((q, k)),
            (None, None) => None,
            _ => return None,
        };
        Some(AttentionParts {
            qkv,
            head_norms,
            heads: (self.heads as usize, self.kv_heads as usize, self.head_dim as usize),
            rope: self.rope.whole_head(self.head_dim)?,
            scale: self.scale,
            o: self.o_proj.packed()?,
        })
    }

    /// The q/k norms as the CUDA kernels take them: `Ok(None)` without norms, `Err(())` where the
    /// kernels cannot take them (one norm alone, or two epsilons).
    fn head_norms(&self) -> std::result::Result<Option<HeadNorms<'_>>, ()> {
        match (&self.q_norm, &self.k_norm) {
            (Some(q), Some(k)) if q.eps() == k.eps() => {
                Ok(Some(HeadNorms { query: q.weight(), key: k.weight(), eps: q.eps() }))
            }
            (None, None) => Ok(None),
            _ => Err(()),
        }
    }

    /// [`heads`](Self::heads) of the stacked product `y` as one CUDA kernel, where it serves.
    fn fused_heads(&self, y: &Array, batch: i32, offset: &Offset) -> Result<Option<[Array; 3]>> {
        let Ok(norms) = self.head_norms() else { return Ok(None) };
        let Some(rotation) = self.rope.rotation(self.head_dim, offset) else { return Ok(None) };
        let dims = (self.heads, self.kv_heads, self.head_dim);
        Ok(cuda_fast::qkv_heads(y, batch, dims, norms, &rotation)?)
    }

    /// A decoding step's heads, cache write and attention (merged heads `[B·L, Hq·D]`, its scores
    /// shaped by `scores`) from the stacked product `y` as one CUDA kernel, where it serves: one
    /// position a sequence, or up to [`cuda_attention::MAX_QUERIES`] of one sequence (a
    /// speculative verification pass, a short prompt) over an unbounded cache.
    fn decode_attention(
        &self,
        y: &Array,
        batch: i32,
        offset: &Offset,
        cache: &mut KvCache,
        scores: cuda_attention::Scores,
    ) -> Result<Option<Array>> {
        let Ok(norms) = self.head_norms() else { return Ok(None) };
        let Some(rotation) = self.rope.rotation(self.head_dim, offset) else { return Ok(None) };
        let heads = (self.heads, self.kv_heads, self.head_dim);
        let step = StepHeads::Stacked { y, batch, heads, norms, rotation: &rotation };
        cuda_attention::merged_cache_attention(&step, cache, self.scale, scores)
    }
}

crate::nn::module_fields!(Attention { q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, sinks });
