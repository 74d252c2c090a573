//! The output head as a loss that computes its own gradient needs it: `logits = h Wᵀ (+ b)`
//! applied to some rows of hidden states, its transpose `g ↦ g W` (the gradient with respect to
//! `h`), and single rows of `W` (the one-hot part of the cross-entropy's gradient), for a dense or
//! quantised `lm_head` or a tied embedding.

use super::{quantized_rows, Embedding, Linear, LinearWeight};
use crate::weights::Weight;
use crate::Result;
use rmlx::quantization::{dequantize, Quantized};
use rmlx::{Array, Dtype};

/// A linear output head: see [`crate::models::Model::linear_head`].
#[derive(Clone, Copy)]
pub enum Head<'a> {
    /// An `lm_head` layer without adapter.
    Linear(&'a Linear),
    /// The input embedding, tied.
    Tied(&'a Embedding),
}

impl Head<'_> {
    /// The head's own layer or the embedding if `lm_head` is `None` and adapter-free; `None` when
    /// `lm_head` carries an adapter (its gradient is not the transpose of its weight alone) or the
    /// ranks of a tensor-parallel model share its rows.
    pub fn of<'a>(lm_head: Option<&'a Linear>, embedding: &'a Embedding) -> Option<Head<'a>> {
        match lm_head {
            Some(l) if l.lora.is_some() || l.gather.is_some() => None,
            None if embedding.is_split() => None,
            Some(l) => Some(Head::Linear(l)),
            None => Some(Head::Tied(embedding)),
        }
    }

    /// Where its parameters are named (the prefix of `lm_head.weight` or the embedding's).
    pub fn path(&self) -> &'static str {
        match self {
            Head::Linear(_) => "lm_head",
            Head::Tied(_) => "model.embed_tokens",
        }
    }

    /// `h: [..., hidden]` → logits `[..., vocab]`.
    pub fn apply(&self, h: &Array) -> Result<Array> {
        match self {
            Head::Linear(l) => l.forward(h),
            Head::Tied(e) => e.as_linear(h),
        }
    }

    /// `g: [..., vocab]` → `g W`: `[..., hidden]`. A quantised `W` is dequantised for the product,
    /// as [`Linear`] does in training: MLX's quantised product in this orientation
    /// (`transpose = false`) runs a naive kernel on CUDA, 4.35 ms a call for qwen3-0.6b's tied
    /// 151,936 × 1,024 head and a 220-row chunk on an H200, 45 % of a 4-bit LoRA step's kernel
    /// time (BENCHMARKS.md); dequantising writes the matrix once and cuBLAS multiplies it.
    pub fn transpose(&self, g: &Array) -> Result<Array> {
        match self.weight() {
            HeadWeight::Dense(w) => Ok(g.matmul(w)?),
            HeadWeight::Quantized(q) => Ok(g.matmul(&dequantize(q, Some(g.dtype()))?)?),
        }
    }

    /// Rows `ids: [n]` of `W`: `[n, hidden]`, in `dtype`.
    pub fn rows(&self, ids: &Array, dtype: Dtype) -> Result<Array> {
        match self.weight() {
            HeadWeight::Dense(w) => Ok(w.take(ids, Some(0))?.astype(dtype)?),
            HeadWeight::Quantized(q) => quantized_rows(q, ids, dtype),
        }
    }

    /// `W` `[vocab, hidden]`, whichever layer holds it.
    fn weight(&self) -> HeadWeight<'_> {
        match self {
            Head::Linear(l) => match &l.weight {
                LinearWeight::Dense { w, .. } => HeadWeight::Dense(w),
                LinearWeight::Quantized(q) => HeadWeight::Quantized(q),
            },
            Head::Tied(e) => match &e.weight {
                Weight::Dense(w) => HeadWeight::Dense(w),
                Weight::Quantized(q) => HeadWeight::Quantized(q),
            },
        }
    }
}

enum HeadWeight<'a> {
    Dense(&'a Array),
    Quantized(&'a Quantized),
}
