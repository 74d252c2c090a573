//! Batches as mlx-lm's trainer makes them: examples sorted by length and cut into groups of the
//! batch size (the remainder dropped), the groups visited in a new random order each epoch, each
//! padded with zeros to one more than the next multiple of 32 (at most the maximum sequence
//! length), longer sequences truncated.
//!
//! The loss covers the targets that predict a real token from the example's `offset` on. mlx-lm
//! 0.32's mask (`offset <= step <= length`) also scores the first padding position after each
//! sequence (token 0); rmlx leaves padding out, so its losses differ from mlx-lm's by that term.
//!
//! ```
//! use rmlx_lm::tuner::{Batch, Sequence};
//! let a = Sequence { tokens: vec![5, 6, 7], offset: 2 };
//! let b = Sequence { tokens: vec![8, 9], offset: 0 };
//! let batch = Batch::new(&[&a, &b], 2048);
//! assert_eq!((batch.rows, batch.len), (2, 33)); // 1 + 32
//! assert_eq!(&batch.tokens[..4], &[5, 6, 7, 0]);
//! // Targets 6, 7 (row 0, from offset 2: only 7) and 9 (row 1).
//! let mask = batch.loss_mask();
//! assert_eq!(&mask[..3], &[0.0, 1.0, 0.0]);
//! assert_eq!(&mask[32..34], &[1.0, 0.0]);
//! assert_eq!(batch.loss_tokens(), 2);
//! ```

use super::data::Sequence;
use crate::{Error, Result};
use rmlx::Array;

/// Batch widths are one more than a multiple of this.
const PAD_TO: usize = 32;

/// Padded token ids `[rows, len]` (row-major) with each row's loss span.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub tokens: Vec<i32>,
    pub rows: usize,
    pub len: usize,
    /// `(offset, length)` per row: the loss starts at token `offset`; `length` tokens are real.
    pub spans: Vec<(usize, usize)>,
    /// The longest example before truncation.
    pub longest: usize,
}

impl Batch {
    /// Pads (and truncates to `max_seq_length`) the sequences into one batch.
    pub fn new(seqs: &[&Sequence], max_seq_length: usize) -> Batch {
        let longest = seqs.iter().map(|s| s.tokens.len()).max().unwrap_or(0);
        let len = (1 + PAD_TO * longest.div_ceil(PAD_TO)).min(max_seq_length);
        let mut tokens = vec![0i32; seqs.len() * len];
        let mut spans = Vec::with_capacity(seqs.len());
        for (row, s) in seqs.iter().enumerate() {
            let n = s.tokens.len().min(len);
            for (dst, &t) in tokens[row * len..row * len + n].iter_mut().zip(&s.tokens) {
                *dst = t as i32;
            }
            spans.push((s.offset, n));
        }
        Batch { tokens, rows: seqs.len(), len, spans, longest }
    }

    /// Whether an example was cut to fit.
    pub fn truncated(&self) -> bool {
        self.longest > self.len
    }

    /// The loss weights of the targets `[rows, len - 1]`: target `t` predicts token `t + 1` and
    /// counts when `offset <= t + 1 < length`.
    pub fn loss_mask(&self) -> Vec<f32> {
        let targets = self.len.saturating_sub(1);
        let mut mask = vec![0.0f32; self.rows * targets];
        for (row, &(offset, length)) in self.spans.iter().enumerate() {
            for t in 0..targets {
                if offset <= t + 1 && t + 1 < length {
                    mask[row * targets + t] = 1.0;
                }
            }
        }
        mask
    }

    /// How many targets the loss covers.
    pub fn loss_tokens(&self) -> usize {
        self.spans.iter().map(|&(offset, length)| length.saturating_sub(offset.max(1))).sum()
    }

    /// All real tokens (padding excluded): the throughput count beside the loss tokens.
    pub fn real_tokens(&self) -> usize {
        self.spans.iter().map(|&(_, length)| length).sum()
    }

    /// The tokens as an int32 array `[rows, len]`.
    pub fn to_array(&self) -> Result<Array> {
        Ok(Array::from_slice(&self.tokens, &[self.rows as i32, self.len as i32])?)
    }

    /// [`Batch::loss_mask`] as a float32 array `[rows, len - 1]`.
    pub fn mask_array(&self) -> Result<Array> {
        Ok(Array::from_slice(&self.loss_mask(), &[self.rows as i32, self.len.saturating_sub(1) as i32])?)
    }
}

/// Which examples form each batch, and the order the batches are visited in.
#[derive(Clone, Debug)]
pub struct BatchOrder {
    batches: Vec<Vec<usize>>,
    rng: u64,
}

impl BatchOrder {
    /// Sorts the examples by `lengths` (stable: equal lengths keep file order) and cuts them into
    /// batches of `batch_size`, dropping the remainder. Fewer examples than one batch is an error.
    pub fn new(lengths: &[usize], batch_size: usize, seed: u64) -> Result<BatchOrder> {
        if batch_size == 0 {
            return Err(Error::InvalidParameter("the batch size must be positive".into()));
        }
        if lengths.len() < batch_size {
            return Err(Error::InvalidParameter(format!(
                "the dataset must have at least batch_size={batch_size} examples but has {}",
                lengths.len()
            )));
        }
        let mut idx: Vec<usize> = (0..lengths.len()).collect();
        idx.sort_by_key(|&i| lengths[i]);
        let batches = idx.chunks_exact(batch_size).map(<[usize]>::to_vec).collect();
        Ok(BatchOrder { batches, rng: seed })
    }

    /// The batches, shortest first.
    pub fn batches(&self) -> &[Vec<usize>] {
        &self.batches
    }

    /// The batch indices of the next epoch, a fresh random permutation each call.
    pub fn epoch(&mut self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.batches.len()).collect();
        for i in (1..order.len()).rev() {
            let j = (self.next_random() % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        order
    }

    /// The random state (saved with a checkpoint, for an exact resume).
    pub fn rng_state(&self) -> u64 {
        self.rng
    }

    /// Restores a random state from [`BatchOrder::rng_state`].
    pub fn set_rng_state(&mut self, state: u64) {
        self.rng = state;
    }

    /// SplitMix64: a fixed, seedable sequence, so that a run (and its resumption) is reproducible.
    fn next_random(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}
