//! Computing newcomers' prompts before they join the running batch.
//!
//! Short prompts are computed together, up to [`EngineOptions::prefill_batch`] of them in one
//! forward pass: padded on the left so that all end at the same position (each row's last
//! position is its own last token), their prompt-cache hits placed before the positions computed.
//! A prompt longer than the step's budget is computed alone, one chunk per step. Then each
//! newcomer samples its first token and, unless that ended it, joins the batch.

use super::prompt_cache::Hit;
use super::sampling::sample_rows;
use super::sequence::Sequence;
use super::{non_finite, remember, Engine, Update};
use crate::cache::{BatchCache, KvCache};
use crate::generate::{ids_array, FinishReason};
use crate::nn::with_row_adapters;
use crate::Result;
use rmlx::Array;

/// A prompt being computed alone, one chunk per step.
pub(super) struct Prefill {
    pub seq: Sequence,
    caches: Vec<KvCache>,
    done: usize,
}

/// Newcomers whose prompts are done, with their caches (a row each), about to join the batch.
struct Joining {
    seqs: Vec<Sequence>,
    caches: Vec<KvCache>,
}

/// How newcomers computed together line up: `width` positions come from the prompt cache or are
/// padding, the `len` after them are computed, and row `i` starts after `padding[i]` positions.
struct Layout {
    padding: Vec<i32>,
    width: i32,
    len: i32,
}

impl Layout {
    /// For prompts of `lengths` with `cached` tokens of each found in the prompt cache.
    fn new(lengths: &[usize], cached: &[usize]) -> Layout {
        let end = lengths.iter().copied().max().unwrap_or(0) as i32;
        let padding: Vec<i32> = lengths.iter().map(|&n| end - n as i32).collect();
        // Positions before `width` are known for every row (cached, or padding).
        let width = padding.iter().zip(cached).map(|(&p, &c)| p + c as i32).min().unwrap_or(0);
        Layout { padding, width, len: end - width }
    }

    /// Padded tokens the forward pass computes.
    fn cost(&self) -> usize {
        self.padding.len() * self.len as usize
    }

    /// Tokens of row `i` taken from the prompt cache.
    fn reused(&self, i: usize) -> usize {
        (self.width - self.padding[i]).max(0) as usize
    }
}

impl Engine<'_> {
    /// Computes up to [`super::EngineOptions::prefill_tokens`] prompt tokens (padding included);
    /// the sequences whose prompt is done join the running batch together (one copy of the
    /// batch's cache per step, not one per newcomer). Returns the tokens computed.
    pub(super) fn prefill_some(&mut self, out: &mut Vec<Update>) -> Result<usize> {
        let full = self.opts.prefill_tokens.max(1);
        let mut budget = full;
        let mut joining: Vec<Joining> = Vec::new();
        while budget > 0 {
            if self.prefill.is_none() {
                let joined = joining.iter().map(|j| j.seqs.len()).sum();
                let mut group = self.gather(budget, joined);
                if group.is_empty() {
                    break;
                }
                let (n, cached) = (group[0].0.history.len(), group[0].1.as_ref().map_or(0, |h| h.tokens));
                if group.len() > 1 || n - cached <= budget {
                    let layout = Layout::new(
                        &group.iter().map(|(s, _)| s.history.len()).collect::<Vec<_>>(),
                        &group.iter().map(|(_, h)| h.as_ref().map_or(0, |h| h.tokens)).collect::<Vec<_>>(),
                    );
                    budget = budget.saturating_sub(layout.cost());
                    joining.extend(self.prefill_together(group, layout, out)?);
                    continue;
                }
                let (seq, hit) = group.pop().expect("one");
                self.prefill = Some(self.start(seq, hit, out));
            }
            let p = self.prefill.as_mut().expect("set above");
            let prompt_len = p.seq.history.len();
            let n = (prompt_len - p.done).min(budget);
            let ids = ids_array(&p.seq.history[p.done..p.done + n])?;
            let (model, caches) = (&self.lm.model, &mut p.caches);
            let h = with_row_adapters(&self.adapters, &[p.seq.adapter], || model.forward_hidden(&ids, caches))??;
            super::quantize_caches(caches, self.opts.kv_quantization.as_ref())?;
            p.done += n;
            budget -= n;
            if p.done < prompt_len {
                rmlx::eval(p.caches.iter().flat_map(KvCache::state))?;
                continue;
            }
            let p = self.prefill.take().expect("set above");
            joining.extend(self.first_tokens(vec![p.seq], p.caches, &h, out)?);
        }
        self.join(joining)?;
        Ok(full - budget)
    }

    /// Takes the waiting requests to compute together: as many as the batch, the key/value
    /// budget, [`super::EngineOptions::prefill_batch`] and `budget` padded tokens allow, each
    /// with its prompt-cache hit. A first one longer than `budget` comes alone, and so does one
    /// whose hit can only be reused whole (another row's layout could cut it).
    fn gather(&mut self, budget: usize, joined: usize) -> Vec<(Sequence, Option<Hit>)> {
        let mut group: Vec<(Sequence, Option<Hit>)> = Vec::new();
        let (mut lengths, mut cached) = (Vec::new(), Vec::new());
        while group.len() < self.opts.prefill_batch.max(1)
            && self.running.len() + joined + group.len() < self.opts.max_batch.max(1)
        {
            let Some(front) = self.waiting.front() else { break };
            if !self.fits(front, joined + group.len()) {
                break;
            }
            let hit = self.prompt_cache.lookup(front.adapter, &front.history);
            let whole = hit.as_ref().is_some_and(Hit::whole);
            if whole && !group.is_empty() {
                break;
            }
            lengths.push(front.history.len());
            cached.push(hit.as_ref().map_or(0, |h| h.tokens));
            if !group.is_empty() && Layout::new(&lengths, &cached).cost() > budget {
                break;
            }
            let seq = self.waiting.pop_front().expect("checked");
            let alone_too_long = group.is_empty() && seq.history.len() - cached[0] > budget;
            group.push((seq, hit));
            if alone_too_long || whole {
                break;
            }
        }
        group
    }

    /// One forward pass over the newcomers `group`, laid out by `layout`; then their first tokens.
    fn prefill_together(
        &mut self,
        group: Vec<(Sequence, Option<Hit>)>,
        layout: Layout,
        out: &mut Vec<Update>,
    ) -> Result<Option<Joining>> {
        let Layout { padding, width, len } = &layout;
        let mut ids: Vec<i32> = Vec::with_capacity(layout.cost());
        for ((seq, _), &pad) in group.iter().zip(padding) {
            // Padding positions get token 0; the mask hides them.
            ids.extend(
                (*width..*width + *len).map(|p| if p < pad { 0 } else { seq.history[(p - pad) as usize] as i32 }),
            );
        }
        let ids = Array::from_slice(&ids, &[group.len() as i32, *len])?;
        let mut caches = Vec::with_capacity(self.windows.len());
        for (layer, &window) in self.windows.iter().enumerate() {
            let prefixes = group
                .iter()
                .enumerate()
                .map(|(i, (_, hit))| match (hit, layout.reused(i)) {
                    (Some(hit), keep) if keep > 0 => Ok(Some(hit.layers[layer].before(keep)?)),
                    _ => Ok(None),
                })
                .collect::<Result<Vec<_>>>()?;
            caches.push(KvCache::Batch(BatchCache::padded(prefixes, padding.clone(), *width, window)?));
        }
        let mut seqs = Vec::with_capacity(group.len());
        for (i, (mut seq, _)) in group.into_iter().enumerate() {
            seq.cached_tokens = layout.reused(i);
            out.push(Update::Started {
                seq: seq.id,
                prompt_tokens: seq.prompt_tokens,
                cached_tokens: seq.cached_tokens,
            });
            seqs.push(seq);
        }
        let slots: Vec<usize> = seqs.iter().map(|s| s.adapter).collect();
        let model = &self.lm.model;
        let h = with_row_adapters(&self.adapters, &slots, || model.forward_hidden(&ids, &mut caches))??;
        super::quantize_caches(&mut caches, self.opts.kv_quantization.as_ref())?;
        self.first_tokens(seqs, caches, &h, out)
    }

    /// Begins `seq`'s prompt (alone) from its prompt-cache hit.
    fn start(&mut self, mut seq: Sequence, hit: Option<Hit>, out: &mut Vec<Update>) -> Prefill {
        let (done, caches) = match hit {
            Some(hit) => {
                let caches = hit.layers.iter().zip(&self.windows);
                (hit.tokens, caches.map(|(kv, &w)| KvCache::Batch(BatchCache::from_prefix(kv, w))).collect())
            }
            None => (0, self.windows.iter().map(|&w| KvCache::Batch(BatchCache::new(1, w))).collect()),
        };
        seq.cached_tokens = done;
        out.push(Update::Started { seq: seq.id, prompt_tokens: seq.prompt_tokens, cached_tokens: done });
        Prefill { seq, caches, done }
    }

    /// Samples each newcomer's first token from the last position of `h` (`[rows, L, hidden]`,
    /// every row ending there): those the token did not end are returned to join the batch.
    fn first_tokens(
        &mut self,
        mut seqs: Vec<Sequence>,
        mut caches: Vec<KvCache>,
        h: &Array,
        out: &mut Vec<Update>,
    ) -> Result<Option<Joining>> {
        let (rows, len) = (seqs.len(), h.shape()[1]);
        let last = h.slice_axis(1, len - 1, len, 1)?;
        let slots: Vec<usize> = seqs.iter().map(|s| s.adapter).collect();
        let logits = with_row_adapters(&self.adapters, &slots, || self.lm.model.logits(&last))??;
        let logits = logits.reshape(&[rows as i32, -1])?;
        let sampled = sample_rows(self.lm, &mut seqs, &logits, &[])?;
        rmlx::eval(sampled.arrays().chain(caches.iter().flat_map(KvCache::state)))?;
        let read = sampled.read()?;
        let mut keep = Vec::with_capacity(rows);
        for (i, seq) in seqs.iter_mut().enumerate() {
            if !read.finite[i] {
                // This request alone fails; the running batch goes on.
                seq.finish = Some(FinishReason::Cancelled);
                out.push(Update::Failed { seq: seq.id, error: non_finite(seq) });
                continue;
            }
            seq.accept(self.lm, read.tokens[i], read.logprobs[i], read.top(i), out)?;
            match seq.finish {
                None => keep.push(i),
                Some(_) => remember(&mut self.prompt_cache, seq, &caches, i)?,
            }
        }
        if keep.is_empty() {
            return Ok(None);
        }
        if keep.len() < rows {
            for c in &mut caches {
                let KvCache::Batch(b) = c else { unreachable!("batch caches") };
                b.filter(&keep)?;
            }
            let mut all: Vec<Option<Sequence>> = seqs.into_iter().map(Some).collect();
            seqs = keep.iter().map(|&i| all[i].take().expect("each row kept once")).collect();
        }
        Ok(Some(Joining { seqs, caches }))
    }

    /// Adds the prefilled sequences to the running batch.
    fn join(&mut self, joining: Vec<Joining>) -> Result<()> {
        if joining.is_empty() {
            return Ok(());
        }
        let mut newcomers: Vec<BatchCache> = self.windows.iter().map(|&w| BatchCache::new(0, w)).collect();
        for mut j in joining {
            for (all, theirs) in newcomers.iter_mut().zip(j.caches) {
                let KvCache::Batch(theirs) = theirs else { unreachable!("batch caches") };
                all.extend(theirs)?;
            }
            // The draft model's rows, in the same order.
            let draft_rows = self.draft_rows(&mut j.seqs)?;
            for (mine, theirs) in self.draft_caches.iter_mut().zip(draft_rows) {
                let KvCache::Batch(mine) = mine else { unreachable!("batch caches") };
                mine.extend(theirs)?;
            }
            self.running.extend(j.seqs);
        }
        for (mine, theirs) in self.caches.iter_mut().zip(newcomers) {
            let KvCache::Batch(mine) = mine else { unreachable!("batch caches") };
            mine.extend(theirs)?;
        }
        self.trim_allocator_cache();
        Ok(())
    }
}
