//! The decoder the Llama-style families share: the token embedding, a stack of blocks, the final
//! RMSNorm and the output head (tied to the embedding or its own), with the decoding step
//! captured as one launch on MLX's CUDA backend. A family brings its block ([`DecoderBlock`]):
//! Llama, Mistral, Qwen 2/3 and Phi-3 theirs (`llama::Block`), the mixtures of experts theirs
//! (`moe::Block`).

use super::{layer_caches, BLOCKS};
use crate::cache::KvCache;
use crate::config::ModelConfig;
use crate::nn::pipeline::Blocks;
use crate::nn::{Builder, CapturedSteps, Embedding, Head, Linear, Module, RmsNorm};
use crate::Result;
use rmlx::Array;

/// One block of a [`Decoder`]: the rows `x` `[B·L, hidden]` of `batch` sequences through it,
/// reading and extending its cache.
pub trait DecoderBlock: Module + Clone + Send + 'static {
    fn forward(&self, x: &Array, batch: i32, cache: &mut KvCache) -> Result<Array>;
}

/// Embedding, blocks, final norm and the output head, under the checkpoint's names (`model.*`,
/// `lm_head.*`).
#[derive(Clone)]
pub struct Decoder<B> {
    cfg: ModelConfig,
    embed_tokens: Embedding,
    /// All blocks, or a pipeline stage's.
    layers: Blocks<B>,
    norm: RmsNorm,
    lm_head: Option<Linear>,
    /// The decoding step's layers as one launch, on MLX's CUDA backend.
    steps: CapturedSteps,
}

impl<B: DecoderBlock> Decoder<B> {
    /// The decoder around `layers` (built already from `b`: those of `b.stage(..)`), with
    /// `model.embed_tokens`, `model.norm` and the output head ([`output_head`]) from `b`.
    pub fn new(cfg: &ModelConfig, b: &mut Builder, layers: Vec<B>) -> Result<Self> {
        Ok(Self {
            embed_tokens: b.embedding("model.embed_tokens", cfg.vocab_size, cfg.hidden_size)?,
            layers: Blocks::new(b.stage(cfg.num_hidden_layers), layers),
            norm: b.rms_norm("model.norm", cfg.hidden_size, cfg.rms_norm_eps, false)?,
            lm_head: output_head(cfg, b)?,
            steps: CapturedSteps::new(b.step_capture),
            cfg: cfg.clone(),
        })
    }
}

/// `lm_head` when the checkpoint has one or the config says it is not tied; else the embedding.
pub(crate) fn output_head(cfg: &ModelConfig, b: &mut Builder) -> Result<Option<Linear>> {
    if b.has("lm_head.weight") || !cfg.tied() {
        return Ok(Some(b.output_head("lm_head", cfg.hidden_size, cfg.vocab_size)?));
    }
    Ok(None)
}

impl<B: DecoderBlock> super::Model for Decoder<B> {
    fn forward_hidden(&self, ids: &Array, caches: &mut [KvCache]) -> Result<Array> {
        let (batch, length) = super::token_grid(ids)?;
        let h = self.embed_tokens.forward(&ids.reshape(&[batch * length])?)?;
        let h = super::decoder_layers(&self.steps, &self.layers, &h, caches, batch, B::forward)?;
        Ok(self.norm.forward(&h)?.reshape(&[batch, length, self.cfg.hidden_size])?)
    }

    fn logits(&self, hidden: &Array) -> Result<Array> {
        match &self.lm_head {
            Some(head) => head.forward(hidden),
            None => self.embed_tokens.as_linear(hidden),
        }
    }

    fn linear_head(&self) -> Option<Head<'_>> {
        Head::of(self.lm_head.as_ref(), &self.embed_tokens)
    }

    fn new_caches(&self, context_limit: Option<usize>) -> Vec<KvCache> {
        layer_caches(&self.cfg, self.layers.stage(), context_limit)
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn boxed_clone(&self) -> Box<dyn super::Model> {
        Box::new(self.clone())
    }
}

crate::nn::module_fields!(
    <B: DecoderBlock> Decoder<B> {
        embed_tokens: "model.embed_tokens",
        layers: BLOCKS,
        norm: "model.norm",
        lm_head,
    },
    on_change: |m: &mut Decoder<B>| m.steps.forget(),
);
