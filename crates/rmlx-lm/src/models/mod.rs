//! The architectures, one file each, and what they share: the [`Model`] trait, rotary embeddings
//! and the cached attention call.

pub mod attention;
pub mod decoder;
pub mod gemma2;
pub mod gemma3;
pub mod gpt_oss;
pub mod llama;
pub mod moe;
pub mod phi3;
pub mod qwen2;
pub mod qwen3;
pub mod spec;

use crate::cache::{KvCache, Offset};
use crate::config::{llama3_rope_divisors, ModelConfig, RopeScaling};
use crate::nn::cuda_fast::Rotation;
use crate::nn::pipeline::Stage;
use crate::nn::{Builder, Module};
use crate::Result;
use rmlx::fast::{self, RopeFreqs};
use rmlx::{Array, Dtype};

/// A causal language model, whose parameters carry the checkpoint's names ([`Module`]).
pub trait Model: Module + Send {
    /// Token ids `[B, L]` (int32) → final hidden states `[B, L, hidden]`, reading and extending the
    /// per-layer `caches` (one per layer, from [`Model::new_caches`]).
    ///
    /// The ids are not checked here (that would cost a host round trip): every id must be below
    /// `config().vocab_size`, or the embedding gather reads out of bounds. The `LoadedModel` entry
    /// points check them ([`crate::vocab::VocabBounds::check`]).
    ///
    /// Inside [`crate::nn::with_grad_checkpoint`], every block runs checkpointed
    /// ([`crate::nn::checkpointed`]) and leaves its cache empty if it was empty.
    fn forward_hidden(&self, ids: &Array, caches: &mut [KvCache]) -> Result<Array>;

    /// Hidden states → logits `[..., vocab]` (the output head).
    fn logits(&self, hidden: &Array) -> Result<Array>;

    /// The output head when [`Model::logits`] is exactly a linear map of the hidden states (no
    /// softcapping, no adapter): the training loss then takes the logits' gradient itself, a few
    /// rows at a time, without keeping the `[B, L, vocab]` logits ([`crate::tuner::batch_loss`]).
    fn linear_head(&self) -> Option<crate::nn::Head<'_>> {
        None
    }

    /// Fresh caches, one per layer. `context_limit` bounds every cache to that many positions
    /// (rotating, keeping the first 4); sliding-window layers are always bounded by their window.
    /// Bounds of `crate::cache::MAX_POSITIONS` or more bound nothing ([`KvCache::bounded`]).
    fn new_caches(&self, context_limit: Option<usize>) -> Vec<KvCache>;

    /// The configuration the model was built from.
    fn config(&self) -> &ModelConfig;

    /// A second handle on the same model: its arrays are shared (cheap), its structure separate,
    /// so parameters set in one are not seen by the other.
    fn boxed_clone(&self) -> Box<dyn Model>;

    /// Token ids `[B, L]` → logits `[B, L, vocab]`.
    fn forward(&self, ids: &Array, caches: &mut [KvCache]) -> Result<Array> {
        let h = self.forward_hidden(ids, caches)?;
        self.logits(&h)
    }
}

/// [`Module`] for a decoder model with the fields `embed_tokens`, `layers` (blocks that are
/// modules), `norm`, `lm_head: Option<Linear>` and `steps` (its [`crate::nn::CapturedSteps`]),
/// under the checkpoint's names (`model.*`, `lm_head.*`): the output head is a linear layer
/// (adapters may go there), the embedding is not. The captured step is forgotten whenever
/// parameters or linear layers may change.
macro_rules! decoder_module {
    ($model:ident) => {
        $crate::nn::module_fields!(
            $model {
                embed_tokens: "model.embed_tokens",
                layers: $crate::models::BLOCKS,
                norm: "model.norm",
                lm_head,
            },
            on_change: |m: &mut $model| m.steps.forget(),
        );
    };
}
pub(crate) use decoder_module;

/// Where every decoder's blocks live in its parameter names: `model.layers.<i>.…`.
pub const BLOCKS: &str = "model.layers";

/// The block index and the path inside the block of a parameter or layer name
/// (`model.layers.3.self_attn.q_proj` → `(3, "self_attn.q_proj")`); `None` outside the blocks.
pub fn block_path(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix(BLOCKS)?.strip_prefix('.')?;
    match rest.split_once('.') {
        Some((i, inner)) => Some((i.parse().ok()?, inner)),
        None => Some((rest.parse().ok()?, "")),
    }
}

/// Builds the model of `cfg.model_type` from the checkpoint's tensors ([`spec::ARCHITECTURES`]).
pub fn build(cfg: &ModelConfig, b: &mut Builder) -> Result<Box<dyn Model>> {
    let spec = spec::of(cfg)?;
    tracing::debug!("building the {} architecture for model_type {:?}", spec.name, cfg.model_type);
    (spec.build)(cfg, b)
}

/// One cache per layer of `cfg` that `stage` holds: a layer with a sliding window
/// ([`ModelConfig::layer_window`]) keeps the window (or `context_limit`, when smaller); another is
/// bounded by `context_limit` (keeping the first 4 positions) or unbounded.
pub(crate) fn layer_caches(cfg: &ModelConfig, stage: &Stage, context_limit: Option<usize>) -> Vec<KvCache> {
    stage
        .layers()
        .map(|i| match (cfg.layer_window(i), context_limit) {
            (Some(window), limit) => KvCache::bounded(window.min(limit.unwrap_or(usize::MAX)), 0),
            (None, Some(n)) => KvCache::bounded(n, 4),
            (None, None) => KvCache::standard(),
        })
        .collect()
}

/// Rotary position embedding over the first `dims` features of each head (all of them but in the
/// Phi-3 family), in non-interleaved halves as in HF checkpoints.
#[derive(Clone)]
pub struct Rope {
    dims: i32,
    base: f32,
    /// The divisor of the position for each rotated pair (`[dims / 2]`, float32): `base^(2i/dims)`,
    /// or scaled frequency-dependently (Llama 3, GGUF frequency factors).
    divisors: Array,
    /// Whether `divisors` differ from the plain ones (MLX's kernel is then given them, not `base`).
    explicit: bool,
    /// Position multiplier (linear scaling: `1 / factor`).
    scale: f32,
    /// LongRoPE's attention factor multiplying the `dims` rotated features of each head before
    /// they turn: `[1]` when they are the whole head, else `[head_dim]` (the factor, then ones).
    features: Option<Array>,
    /// That attention factor as one number (1: none).
    factor: f32,
}

impl Rope {
    /// RoPE with base `theta` and optional scaling (LongRoPE's attention factor over whole heads;
    /// [`Rope::global`] builds it for part of a head too).
    pub fn new(dims: i32, theta: f32, scaling: Option<&RopeScaling>) -> Result<Self> {
        let divisors = crate::nn::cpu_fast::base_divisors(theta, dims)?;
        let mut rope = Rope { dims, base: theta, divisors, explicit: false, scale: 1.0, features: None, factor: 1.0 };
        match scaling {
            Some(RopeScaling::Linear { factor }) => rope.scale = 1.0 / factor,
            Some(
                RopeScaling::LongRope { long_factor, attention_factor }
                | RopeScaling::Yarn { factors: long_factor, attention_factor },
            ) => {
                let plain = rope.divisors.to_vec::<f32>()?;
                if long_factor.len() != plain.len() {
                    return Err(crate::Error::Config(format!(
                        "rope_scaling: {} frequency factors for {} rotated pairs",
                        long_factor.len(),
                        plain.len()
                    )));
                }
                let d: Vec<f32> = plain.iter().zip(long_factor).map(|(d, f)| d * f).collect();
                rope.divisors = Array::from_slice(&d, &[d.len() as i32])?;
                rope.explicit = true;
                if *attention_factor != 1.0 {
                    rope.features = Some(Array::from_slice(&[*attention_factor], &[1])?);
                    rope.factor = *attention_factor;
                }
            }
            Some(s @ RopeScaling::Llama3 { .. }) => {
                let d = llama3_rope_divisors(dims, theta, s);
                rope.divisors = Array::from_slice(&d, &[d.len() as i32])?;
                rope.explicit = true;
            }
            None => {}
        }
        Ok(rope)
    }

    /// The model's global RoPE over [`ModelConfig::rotary_dims`]: `rope_theta` with
    /// `rope_scaling`, or GGUF frequency factors.
    pub fn global(cfg: &ModelConfig) -> Result<Self> {
        let d = cfg.rotary_dims();
        let Some(factors) = &cfg.rope_freq_factors else {
            let mut rope = Rope::new(d, cfg.rope_theta, cfg.rope_scaling()?.as_ref())?;
            if let (Some(factor), true) = (&rope.features, d < cfg.head_dim()) {
                let ones = rmlx::ops::ones(&[cfg.head_dim() - d], Dtype::Float32)?;
                rope.features = Some(rmlx::ops::concatenate(&[&factor.broadcast_to(&[d])?, &ones], 0)?);
            }
            return Ok(rope);
        };
        let divisors: Vec<f32> = (0..d / 2)
            .map(|i| {
                (cfg.rope_theta as f64).powf(2.0 * i as f64 / d as f64) as f32
                    * factors.get(i as usize).copied().unwrap_or(1.0)
            })
            .collect();
        let divisors = Array::from_slice(&divisors, &[d / 2])?;
        Ok(Rope { dims: d, base: cfg.rope_theta, divisors, explicit: true, scale: 1.0, features: None, factor: 1.0 })
    }

    /// Rotates `x: [B, H, L, D]` at positions `offset..offset + L` (per row of `B` for
    /// [`Offset::PerRow`]).
    pub fn apply(&self, x: &Array, offset: &Offset) -> Result<Array> {
        let scaled;
        let x = match &self.features {
            Some(features) => {
                let head = x.shape().last().copied().unwrap_or(0);
                if features.size() == 1 && head != self.dims {
                    return Err(crate::Error::InvalidParameter(format!(
                        "LongRoPE over {} of a head's {head} features: build it with Rope::global",
                        self.dims
                    )));
                }
                scaled = (x * &features.astype(x.dtype())?)?;
                &scaled
            }
            None => x,
        };
        if crate::nn::cpu_fast::applies(x) && x.ndim() == 4 {
            let positions = offset.positions()?;
            return Ok(crate::nn::cpu_fast::rope(x, self.dims, &self.divisors, self.scale, &positions)?);
        }
        let freqs = if self.explicit { RopeFreqs::Explicit(&self.divisors) } else { RopeFreqs::Base(self.base) };
        Ok(match offset {
            Offset::Uniform(o) => fast::rope(x, self.dims, false, freqs, self.scale, *o as i32)?,
            Offset::PerRow(o) => fast::rope(x, self.dims, false, freqs, self.scale, o)?,
        })
    }
}

impl Rope {
    /// This embedding at `positions` as the CUDA kernels take it, when it rotates whole heads of
    /// `head_dim` (the kernels rotate nothing less), with its attention factor.
    pub(crate) fn rotation<'a>(&'a self, head_dim: i32, offset: &'a Offset) -> Option<Rotation<'a>> {
        (self.dims == head_dim).then_some(Rotation {
            divisors: &self.divisors,
            scale: self.scale,
            offset,
            factor: self.factor,
        })
    }

    /// The divisors and position multiplier, when the rotation covers all `head_dim` features.
    pub(crate) fn whole_head(&self, head_dim: i32) -> Option<(&Array, f32)> {
        (self.dims == head_dim && self.features.is_none()).then_some((&self.divisors, self.scale))
    }
}

/// Rows `[B·L, H·D]` of `batch` sequences → heads `[B, H, L, D]`. One position per sequence (a
/// decoding step) is a single reshape: the transpose would move an axis of length 1.
pub(crate) fn split_heads(x: &Array, batch: i32, heads: i32, head_dim: i32) -> Result<Array> {
    let length = x.shape()[0] / batch.max(1);
    if length == 1 {
        return Ok(x.reshape(&[batch, heads, 1, head_dim])?);
    }
    Ok(x.reshape(&[batch, length, heads, head_dim])?.transpose_axes(&[0, 2, 1, 3])?)
}

/// Heads `[B, H, L, D]` → rows `[B·L, H·D]` (one reshape when `L` is 1).
pub(crate) fn merge_heads(x: &Array) -> Result<Array> {
    let s = x.shape();
    let rows = [s[0] * s[2], s[1] * s[3]];
    if s[2] == 1 {
        return Ok(x.reshape(&rows)?);
    }
    Ok(x.transpose_axes(&[0, 2, 1, 3])?.reshape(&rows)?)
}

/// The decoder blocks in turn over the rows `h` (of `batch` sequences), each checkpointed where
/// training asks for it, as one captured launch where `steps` serves a decoding step
/// ([`crate::nn::CapturedSteps::layers`]). The blocks of a pipeline stage run between the previous
/// stage's output and the whole pipeline's ([`Stage::receive`], [`Stage::pass_on`]).
pub(crate) fn decoder_layers<B: crate::nn::Module + Clone + 'static>(
    steps: &crate::nn::CapturedSteps,
    blocks: &crate::nn::pipeline::Blocks<B>,
    h: &Array,
    caches: &mut [KvCache],
    batch: i32,
    forward: fn(&B, &Array, i32, &mut KvCache) -> Result<Array>,
) -> Result<Array> {
    let stage = blocks.stage();
    let h = stage.receive(h)?;
    let h = steps.layers(&h, batch, caches, |h, caches| {
        let mut h = h.clone();
        for (block, cache) in blocks.iter().zip(caches.iter_mut()) {
            h = crate::nn::checkpointed(block, &h, cache, move |b, x, c| forward(b, x, batch, c))?;
        }
        Ok(h)
    })?;
    stage.pass_on(&h, caches)
}

/// `(B, L)` of token ids `[B, L]`. The blocks work on the rows `[B·L, hidden]` of all sequences,
/// so that every product is a plain 2-D one (a 3-D input costs two more graph nodes per product,
/// to flatten and unflatten it), and the hidden states become `[B, L, hidden]` after the last block.
pub(crate) fn token_grid(ids: &Array) -> Result<(i32, i32)> {
    match ids.shape() {
        &[batch, length] => Ok((batch, length)),
        s => Err(crate::Error::InvalidParameter(format!("token ids must be [batch, length], not {s:?}"))),
    }
}

/// Writes `k, v` (`[B, Hkv, L, D]`, already rotated) into `cache` and attends `q` over everything
/// visible: `[B, Hq, L, D]`; with `softcap`, the scores soft-capped first (Gemma 2); with `sinks`
/// (`[Hq]`), each head's sink logit joining its softmax (gpt-oss).
pub(crate) fn cached_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    cache: &mut KvCache,
    scale: f32,
    softcap: Option<f32>,
    sinks: Option<&Array>,
) -> Result<Array> {
    // On MLX's CUDA backend, a decoding step over a quantised cache: the position packed and
    // written and the attention over the packed positions in one launch.
    let packed = crate::nn::cuda_packed_attention::quantized_cache_attention;
    if let Some(attention) = packed(q, k, v, cache, scale, softcap, sinks)? {
        return Ok(attention);
    }
    if let Some((keys, values, mask)) = cache.update_packed(k, v)? {
        if q.shape().get(2) == Some(&1) {
            // A decoding step: keys and values stay packed; on MLX's CUDA backend one launch reads
            // them, elsewhere two quantised products per group of query heads.
            let fused = crate::nn::cuda_packed_attention::packed_decode_attention;
            if let Some(attention) = fused(q, &keys, &values, scale, &mask, softcap, sinks)? {
                return Ok(attention);
            }
            return crate::cache::quantized_attention(q, &keys, &values, scale, &mask, softcap, sinks);
        }
        // A prompt's piece: unpacked once for its many queries (MLX's CUDA quantised product
        // has no kernel for so many rows), then attended as at full precision.
        let (keys, values) = (keys.unpack(q.dtype())?, values.unpack(q.dtype())?);
        return attend(q, &keys, &values, &mask, scale, softcap, sinks);
    }
    if let Some(cap) = softcap {
        if sinks.is_some() {
            return Err(crate::Error::InvalidParameter("attention with both soft-capping and sinks".into()));
        }
        // On MLX's CUDA backend, one position: the cache write and the attention in one node.
        let heads = crate::nn::cuda_attention::StepHeads::Ready { q, k, v };
        let scores = crate::nn::cuda_attention::Scores { softcap: Some(cap), sinks: None };
        if let Some(attention) = crate::nn::cuda_attention::kv_cache_attention(&heads, cache, scale, scores)? {
            return Ok(attention);
        }
        let (keys, values, mask) = cache.update(k, v)?;
        return attend(q, &keys, &values, &mask, scale, softcap, None);
    }
    if let Some(sinks) = sinks {
        // On MLX's CUDA backend, one position: the cache write and the attention in one node.
        let heads = crate::nn::cuda_attention::StepHeads::Ready { q, k, v };
        let scores = crate::nn::cuda_attention::Scores::sinks(Some(sinks));
        if let Some(attention) = crate::nn::cuda_attention::kv_cache_attention(&heads, cache, scale, scores)? {
            return Ok(attention);
        }
        let (keys, values, mask) = cache.update(k, v)?;
        return attend(q, &keys, &values, &mask, scale, None, Some(sinks));
    }
    if let KvCache::Standard(c) = cache {
        // On the CPU: causal attention over the cache's buffers in one primitive.
        if q.ndim() == 4 && q.shape()[2] > 0 && crate::nn::cpu_fast::applies(q) {
            let (keys, values, valid) = c.write(k, v)?;
            return Ok(crate::nn::cpu_fast::cache_attention(q, &keys, &values, valid, scale)?);
        }
    }
    // On MLX's CUDA backend, one position: the cache write and the attention in one node.
    let heads = crate::nn::cuda_attention::StepHeads::Ready { q, k, v };
    if let Some(attention) = crate::nn::cuda_attention::kv_cache_attention(&heads, cache, scale, Default::default())? {
        return Ok(attention);
    }
    let (keys, values, mask) = cache.update(k, v)?;
    attend(q, &keys, &values, &mask, scale, None, None)
}

/// `q` over every visible key and value: MLX's fused attention, with sinks where given, or the
/// soft-capped scores made explicitly.
fn attend(
    q: &Array,
    keys: &Array,
    values: &Array,
    mask: &crate::cache::Mask,
    scale: f32,
    softcap: Option<f32>,
    sinks: Option<&Array>,
) -> Result<Array> {
    match (softcap, sinks) {
        (Some(_), Some(_)) => Err(crate::Error::InvalidParameter("attention with both soft-capping and sinks".into())),
        (Some(cap), None) => softcapped_attention(q, keys, values, scale, cap, mask),
        (None, Some(sinks)) => {
            let sinks = sinks.astype(q.dtype())?;
            Ok(fast::scaled_dot_product_attention_with_sinks(q, keys, values, scale, mask.as_attention(), &sinks)?)
        }
        (None, None) if few_queries_on_gpu(q) => few_query_attention(q, keys, values, scale, mask),
        (None, None) => Ok(fast::scaled_dot_product_attention(q, keys, values, scale, mask.as_attention())?),
    }
}

/// Whether `q: [B, H, L, D]` is a short run of 2 to 16 queries (a speculative verification pass)
/// on a GPU. MLX's CUDA fused attention plans such a shape anew for every key length — measured
/// on an H100 (qwen3-8b, 512 cached positions): 55–90 ms a call at each new length against
/// 13–27 ms when the length repeats — so every verification pass would pay it.
fn few_queries_on_gpu(q: &Array) -> bool {
    q.ndim() == 4 && (2..=16).contains(&q.shape()[2]) && rmlx::default_device().kind == rmlx::DeviceType::Gpu
}

/// Attention of a few queries made of plain products: `softmax(q kᵀ · scale, visible) v`, each
/// group of query heads against its key/value head, the products in the heads' dtype and the
/// softmax in float32.
pub(crate) fn few_query_attention(
    q: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    mask: &crate::cache::Mask,
) -> Result<Array> {
    let (&[b, hq, l, d], &[_, hkv, k, _]) = (q.shape(), keys.shape()) else {
        return Err(crate::Error::InvalidParameter(format!(
            "attention takes [B, H, L, D] heads, not {:?} and {:?}",
            q.shape(),
            keys.shape()
        )));
    };
    let grouped = (q * scale)?.reshape(&[b, hkv, hq / hkv, l, d])?;
    let scores = grouped.matmul(&keys.expand_dims(2)?.swapaxes(-1, -2)?)?;
    let scores = hide_invisible(&scores.astype(Dtype::Float32)?, mask, l, k)?;
    let weights = rmlx::ops::softmax(&scores, -1, true)?.astype(values.dtype())?;
    Ok(weights.matmul(&values.expand_dims(2)?)?.reshape(&[b, hq, l, d])?)
}

/// `softmax(cap · tanh(q kᵀ · scale / cap), visible) v` for `q: [B, Hq, L, D]` and `keys, values:
/// [B, Hkv, K, D]`, as transformers' eager Gemma 2 attention computes it (scores, cap and softmax in
/// float32): MLX's fused attention has no cap, so the scores are made explicitly, each group of
/// query heads against its key/value head.
pub(crate) fn softcapped_attention(
    q: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    cap: f32,
    mask: &crate::cache::Mask,
) -> Result<Array> {
    let (&[b, hq, l, d], &[_, hkv, k, _]) = (q.shape(), keys.shape()) else {
        return Err(crate::Error::InvalidParameter(format!(
            "attention takes [B, H, L, D] heads, not {:?} and {:?}",
            q.shape(),
            keys.shape()
        )));
    };
    let q = q.astype(Dtype::Float32)?.reshape(&[b, hkv, hq / hkv, l, d])?;
    let keys = keys.astype(Dtype::Float32)?.expand_dims(2)?;
    let scores = (q.matmul(&keys.swapaxes(-1, -2)?)? * scale)?;
    let scores = softcap(&scores, cap)?;
    let scores = hide_invisible(&scores, mask, l, k)?;
    let weights = rmlx::ops::softmax(&scores, -1, true)?.astype(values.dtype())?;
    let out = weights.matmul(&values.expand_dims(2)?)?;
    Ok(out.reshape(&[b, hq, l, d])?)
}

/// Grouped scores `[B, Hkv, G, L, K]` with the keys `mask` hides from each query set to `-inf`.
fn hide_invisible(scores: &Array, mask: &crate::cache::Mask, l: i32, k: i32) -> Result<Array> {
    use crate::cache::Mask;
    let visible = match mask {
        Mask::None => None,
        Mask::Causal => {
            let key = rmlx::ops::arange(0.0, k as f64, 1.0, Dtype::Int32)?.reshape(&[1, k])?;
            let last = rmlx::ops::arange((k - l) as f64, k as f64, 1.0, Dtype::Int32)?.reshape(&[l, 1])?;
            Some(key.less_equal(&last)?)
        }
        // `[L, K]`, or `[B, 1, L, K]` from a batch cache: one more axis for the query groups.
        Mask::Array(m) if m.ndim() == 4 => Some(m.expand_dims(2)?),
        Mask::Array(m) => Some(m.clone()),
    };
    Ok(match visible {
        Some(v) => rmlx::ops::r#where(&v, scores, &Array::scalar(f32::NEG_INFINITY))?,
        None => scores.clone(),
    })
}

/// `cap · tanh(x / cap)`, computed in float32.
pub(crate) fn softcap(x: &Array, cap: f32) -> Result<Array> {
    let dtype = x.dtype();
    let y = ((x.astype(Dtype::Float32)? / cap)?.tanh()? * cap)?;
    Ok(y.astype(dtype)?)
}
