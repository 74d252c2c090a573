//! How the tokenizer's ids relate to the rows of the model's embedding.
//!
//! The two need not agree. Gemma 3's tokenizer carries `<image_soft_token>` (id 262144) past its
//! 262144-row text embedding; Qwen's tokenizers stop well short of `vocab_size`, whose extra rows
//! are padding. So:
//!
//! - every id fed to the model must be below the number of embedding rows: [`VocabBounds::check`]
//!   is the one place that enforces it (prompts, perplexity texts, any id list the public API takes),
//!   because MLX's gather reads out of bounds silently (garbage or a crash);
//! - ids the tokenizer cannot decode (at or past the tokenizer's largest id + 1, below the embedding
//!   rows) are never sampled: [`VocabBounds::mask_logits`] adds a mask, built once per model, that
//!   sets their logits to `-inf`;
//! - tokenizer ids at or past the embedding rows are never sampled, since the logits have one entry
//!   per row.

use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use rmlx::{Array, Dtype};

/// The embedding size and the ids the tokenizer can produce, with the padding mask.
pub struct VocabBounds {
    rows: u32,
    decodable: u32,
    /// `[rows]`: 0 for decodable ids, `-inf` for padding ids; `None` when there are none.
    padding_mask: Option<Array>,
}

impl std::fmt::Debug for VocabBounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VocabBounds").field("rows", &self.rows).field("decodable", &self.decodable).finish()
    }
}

impl VocabBounds {
    /// Bounds for an embedding of `rows` rows and `tokenizer`'s ids; the mask has `dtype`.
    pub fn new(rows: usize, tokenizer: &Tokenizer, dtype: Dtype) -> Result<Self> {
        let decodable = tokenizer.inner().get_vocab(true).values().max().map_or(0, |&m| m as u64 + 1);
        Self::from_sizes(rows, decodable, dtype)
    }

    /// Bounds for `rows` embedding rows of which ids `0..decodable` are real tokens.
    pub fn from_sizes(rows: usize, decodable: u64, dtype: Dtype) -> Result<Self> {
        let rows = u32::try_from(rows)
            .ok()
            .filter(|&r| r > 0 && r <= i32::MAX as u32)
            .ok_or_else(|| Error::Config(format!("the embedding has {rows} rows; expected 1 to {}", i32::MAX)))?;
        let decodable = decodable.min(rows as u64) as u32;
        let padding_mask = if decodable < rows {
            let mask: Vec<f32> = (0..rows).map(|i| if i < decodable { 0.0 } else { f32::NEG_INFINITY }).collect();
            let mask = Array::from_slice(&mask, &[rows as i32])?.astype(dtype)?;
            rmlx::eval([&mask])?;
            Some(mask)
        } else {
            None
        };
        Ok(VocabBounds { rows, decodable, padding_mask })
    }

    /// Rows of the embedding: every id fed to the model must be below it.
    pub fn rows(&self) -> usize {
        self.rows as usize
    }

    /// The ids that may be sampled: `0..sampleable()` (the tokenizer's ids that have a row).
    pub fn sampleable(&self) -> usize {
        self.decodable as usize
    }

    /// Checks that every id has an embedding row; the error ([`Error::Prompt`]) names the first
    /// offending id, its position and the embedding size.
    pub fn check(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().position(|&t| t >= self.rows) {
            None => Ok(()),
            Some(at) => Err(Error::Prompt(format!(
                "token id {} (position {at}) is outside the model's embedding of {} rows",
                ids[at], self.rows
            ))),
        }
    }

    /// Whether some rows are padding (ids the tokenizer does not have, masked from sampling).
    pub fn pads(&self) -> bool {
        self.padding_mask.is_some()
    }

    /// `logits` (`[..., rows]`) with padding ids set to `-inf` (unchanged when there are none).
    pub fn mask_logits(&self, logits: &Array) -> Result<Array> {
        match &self.padding_mask {
            Some(m) => Ok((logits + m)?),
            None => Ok(logits.clone()),
        }
    }
}
