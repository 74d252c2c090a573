//! Sampling a step's tokens for every row of the batch, each with its sequence's own settings,
//! lazily: the tokens, their log-probabilities and the finiteness check are evaluated with the
//! step's caches, then read.

use super::sequence::Sequence;
use crate::loader::LoadedModel;
use crate::sample::log_softmax;
use crate::{Error, Result};
use rmlx::{ops, Array, Dtype};

/// One step's sampled tokens for every row, lazily: evaluate [`Sampled::arrays`] together with
/// the caches, then [`Sampled::read`].
pub(super) struct Sampled {
    pub tokens: Array,
    logprobs: Array,
    finite: Array,
    /// The `k` most likely ids and their log-probabilities, `[rows, k]` each.
    top: Option<(Array, Array)>,
    wanted: Vec<usize>,
    /// Per row, the error its own settings raised while its token was built (a grammar that
    /// failed, a bias the vocabulary lacks): that row's token is a placeholder, and the row fails
    /// alone.
    pub errors: Vec<Option<Error>>,
}

pub(super) struct Read {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub finite: Vec<bool>,
    top: Option<(Vec<u32>, Vec<f32>, usize)>,
    wanted: Vec<usize>,
}

impl Sampled {
    pub fn rows(&self) -> usize {
        self.wanted.len()
    }

    /// Keeps rows `keep` (in order).
    pub fn keep_rows(&mut self, keep: &[usize]) -> Result<()> {
        let idx: Vec<i32> = keep.iter().map(|&i| i as i32).collect();
        let idx = Array::from_slice(&idx, &[idx.len() as i32])?;
        let take = |a: &Array| a.take(&idx, Some(0));
        self.tokens = take(&self.tokens)?;
        self.logprobs = take(&self.logprobs)?;
        self.finite = take(&self.finite)?;
        if let Some((ids, values)) = &self.top {
            self.top = Some((take(ids)?, take(values)?));
        }
        self.wanted = keep.iter().map(|&i| self.wanted[i]).collect();
        self.errors = keep.iter().map(|&i| self.errors[i].take()).collect();
        Ok(())
    }

    pub fn arrays(&self) -> impl Iterator<Item = &Array> {
        [&self.tokens, &self.logprobs, &self.finite].into_iter().chain(self.top.iter().flat_map(|(i, v)| [i, v]))
    }

    pub fn read(&self) -> Result<Read> {
        let top = match &self.top {
            Some((ids, values)) => Some((ids.to_vec::<u32>()?, values.to_vec::<f32>()?, ids.shape()[1] as usize)),
            None => None,
        };
        Ok(Read {
            tokens: self.tokens.to_vec::<u32>()?,
            logprobs: self.logprobs.to_vec::<f32>()?,
            finite: self.finite.to_vec::<bool>()?,
            top,
            wanted: self.wanted.clone(),
        })
    }
}

impl Read {
    /// Row `i`'s most likely tokens, most likely first, as many as its request asked for.
    pub fn top(&self, i: usize) -> Vec<(u32, f32)> {
        let Some((ids, values, k)) = &self.top else { return Vec::new() };
        let mut row: Vec<(u32, f32)> = (0..*k).map(|j| (ids[i * k + j], values[i * k + j])).collect();
        crate::sample::sort_candidates(&mut row);
        row.truncate(self.wanted[i]);
        row
    }
}

/// Samples a token for each row of `logits: [rows, vocab]` with each sequence's own sampler. Rows
/// without logit processors share one log-softmax (and one argmax when greedy); the others, and
/// every random draw, go row by row with the sequence's own history and key. A row `skipped`
/// (whose token the caller takes from elsewhere: a speculative pass's verdict) takes the argmax
/// and draws nothing, so that its sampler's stream does not depend on its neighbours.
pub(super) fn sample_rows(
    lm: &LoadedModel,
    seqs: &mut [Sequence],
    logits: &Array,
    skipped: &[bool],
) -> Result<Sampled> {
    let rows = seqs.len() as i32;
    let finite = ops::isfinite(logits)?.all(rmlx::Axes::from(-1), false)?;
    let logits = lm.vocab.mask_logits(&logits.astype(Dtype::Float32)?)?;
    let shared = log_softmax(&logits)?;
    let all_greedy = seqs.iter().all(|s| s.sampler.config().is_greedy() && !s.processes_logits());
    let mut errors: Vec<Option<Error>> = seqs.iter().map(|_| None).collect();
    let (tokens, logprobs) = if all_greedy {
        (shared.argmax(Some(-1), false)?.astype(Dtype::Uint32)?, shared)
    } else {
        let mut tokens = Vec::with_capacity(seqs.len());
        let mut rows_lp = Vec::with_capacity(seqs.len());
        let any_processed = seqs.iter().any(Sequence::processes_logits);
        for (i, s) in seqs.iter_mut().enumerate() {
            if skipped.get(i).copied().unwrap_or(false) {
                let lp = shared.slice_axis(0, i as i32, i as i32 + 1, 1)?;
                tokens.push(lp.argmax(Some(-1), false)?.astype(Dtype::Uint32)?.reshape(&[1])?);
                rows_lp.push(lp);
                continue;
            }
            let i = i as i32;
            let own = |s: &mut Sequence| -> Result<(Array, Array)> {
                let lp = if s.processes_logits() {
                    let row = logits.slice_axis(0, i, i + 1, 1)?;
                    let row = match &mut s.constraint {
                        // Structured output: only the grammar's tokens keep their logits.
                        Some(c) => (row + c.mask()?)?,
                        None => row,
                    };
                    s.sampler.logprobs(&row, &s.history)?
                } else {
                    shared.slice_axis(0, i, i + 1, 1)?
                };
                Ok((s.sampler.sample_logprobs(&lp)?.reshape(&[1])?, lp))
            };
            let (token, lp) = match own(s) {
                Ok(sampled) => sampled,
                Err(e) => {
                    // This row fails alone; the others keep exactly the tokens they would have.
                    errors[i as usize] = Some(e);
                    let lp = shared.slice_axis(0, i, i + 1, 1)?;
                    (lp.argmax(Some(-1), false)?.astype(Dtype::Uint32)?.reshape(&[1])?, lp)
                }
            };
            tokens.push(token);
            rows_lp.push(lp);
        }
        let lp = if any_processed { ops::concatenate(&rows_lp.iter().collect::<Vec<_>>(), 0)? } else { shared };
        (ops::concatenate(&tokens.iter().collect::<Vec<_>>(), 0)?, lp)
    };
    // Every rank of a tensor-parallel model takes rank 0's tokens.
    let tokens = lm.agreed(tokens)?;
    let chosen = ops::take_along_axis(&logprobs, &tokens.astype(Dtype::Int32)?.reshape(&[rows, 1])?, Some(-1))?;
    let wanted: Vec<usize> = seqs.iter().map(|s| s.top_logprobs).collect();
    let k = wanted.iter().copied().max().unwrap_or(0).min(logprobs.shape()[1] as usize) as i32;
    let top = if k > 0 { Some(crate::sample::top_candidates(&logprobs, k)?) } else { None };
    Ok(Sampled { tokens, logprobs: chosen.reshape(&[rows])?, finite, top, wanted, errors })
}
