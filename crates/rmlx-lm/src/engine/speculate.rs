//! Speculative decoding inside the running batch ([`Engine::with_speculation`]).
//!
//! A step drafts up to [`Speculation::num_draft_tokens`] tokens for each running sequence that
//! may speculate ([`Sequence::may_speculate`]): by prompt lookup over its own history, or with
//! the draft model, whose batch cache has a row per running sequence. The model then computes
//! every row's pending token and drafts in one forward pass, rows padded on the right to the
//! longest; each row keeps the drafts it agrees with and one token of its own, and takes back the
//! rest of its positions on its own ([`crate::cache::BatchCache::trim_rows`]). A row without
//! drafts (not asked for, a grammar, its last token) samples its one token as in a plain step.

use super::sampling::sample_rows;
use super::sequence::Sequence;
use super::{non_finite, Engine, Update};
use crate::cache::{with_lone_caches, BatchCache, KvCache};
use crate::generate::ids_array;
use crate::loader::LoadedModel;
use crate::nn::with_row_adapters;
use crate::sample::log_softmax;
use crate::speculative::{accept_sampled, lookup, Drafter, Speculation};
use crate::{Error, Result};
use rmlx::{ops, Array, Dtype};

/// Each running row's drafts and, from a draft model, the distributions they were drawn from.
struct Drafts {
    tokens: Vec<Vec<u32>>,
    dists: Vec<Option<Vec<Array>>>,
}

/// What verification decided for one row.
struct Verdict {
    /// Drafts kept.
    kept: usize,
    /// The kept drafts, then the model's own token, with their log-probabilities.
    tokens: Vec<(u32, f32)>,
    top: Vec<(u32, f32)>,
    error: Option<Error>,
}

impl<'m> Engine<'m> {
    /// Speculative decoding for the requests that allow it ([`super::Request::speculative`]) while at
    /// most [`super::EngineOptions::speculative_max_batch`] sequences run: each step drafts for every
    /// row and verifies all rows' drafts in one forward pass (see [`crate::speculative`]).
    /// Greedy output is the plain engine's; sampled output is distributed as the model's.
    ///
    /// ```
    /// # fn main() -> rmlx_lm::Result<()> {
    /// use rmlx_lm::engine::{Engine, EngineOptions, Request, Update};
    /// use rmlx_lm::speculative::{Drafter, Speculation};
    /// let lm = rmlx_lm::loader::load(rmlx_lm::registry::default_model()?, &Default::default())?;
    /// let lookup = Speculation { drafter: Drafter::PromptLookup { max_ngram: 3, min_ngram: 1 }, num_draft_tokens: 4 };
    /// let mut engine = Engine::new(&lm, EngineOptions::default()).with_speculation(lookup)?;
    /// let prompt = lm.encode_prompt("1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,", true, None)?;
    /// let options = rmlx_lm::GenerateOptions { max_tokens: 8, ..Default::default() };
    /// engine.submit(Request { prompt, options, ..Default::default() })?;
    /// let mut usage = None;
    /// while !engine.is_idle() {
    ///     for update in engine.step()? {
    ///         if let Update::Finished { usage: u, .. } = update {
    ///             usage = Some(u);
    ///         }
    ///     }
    /// }
    /// assert!(usage.unwrap().draft_tokens > 0);
    /// # Ok(()) }
    /// ```
    ///
    /// Errors ([`Error::InvalidParameter`]): as [`LoadedModel::generate_speculative`] refuses the
    /// speculation, or requests already submitted.
    pub fn with_speculation(mut self, speculation: Speculation<'m>) -> Result<Engine<'m>> {
        speculation.check(self.lm)?;
        if !self.is_idle() {
            return Err(Error::InvalidParameter("speculative decoding must be set before requests come".into()));
        }
        if let Drafter::Model(d) = speculation.drafter {
            let windows = d.layer_windows();
            self.draft_caches = windows.iter().map(|&w| KvCache::Batch(BatchCache::new(0, w))).collect();
            self.draft_kv = Some((windows, d.kv_bytes_per_layer_position()));
        }
        self.speculation = Some(speculation);
        Ok(self)
    }

    /// One speculative step over the running batch, if any row gets drafts; `false` when none
    /// does (the caller takes a plain step).
    pub(super) fn speculate(&mut self, out: &mut Vec<Update>) -> Result<bool> {
        let Some(spec) = self.speculation else { return Ok(false) };
        if self.running.is_empty() || self.running.len() > self.opts.speculative_max_batch {
            return Ok(false);
        }
        let want: Vec<usize> = self
            .running
            .iter()
            .map(|s| match s.may_speculate() {
                true => spec.num_draft_tokens.min((s.max_tokens - s.generated).saturating_sub(1)),
                false => 0,
            })
            .collect();
        if want.iter().all(|&k| k == 0) {
            return Ok(false);
        }
        let drafts = match spec.drafter {
            Drafter::PromptLookup { max_ngram, min_ngram } => Drafts {
                tokens: self
                    .running
                    .iter()
                    .zip(&want)
                    .map(|(s, &k)| lookup(&s.history, max_ngram, min_ngram, k))
                    .collect(),
                dists: want.iter().map(|_| None).collect(),
            },
            Drafter::Model(d) => self.draft_with(d, &want)?,
        };
        if drafts.tokens.iter().all(Vec::is_empty) {
            return Ok(false);
        }
        self.verify(drafts, out)?;
        Ok(true)
    }

    /// Drafts `want[i]` tokens for row `i` with the draft model: a first pass over every row's
    /// tokens the draft has not seen yet, then one position per pass. Rows drafting nothing are
    /// fed a placeholder that is taken back.
    fn draft_with(&mut self, d: &LoadedModel, want: &[usize]) -> Result<Drafts> {
        let rows = self.running.len();
        let pending: Vec<usize> = self.running.iter().map(|s| s.history.len() - s.draft_fed).collect();
        let width = (0..rows).filter(|&i| want[i] > 0).map(|i| pending[i]).max().unwrap_or(1);
        let mut ids = Vec::with_capacity(rows * width);
        for (s, &k) in self.running.iter().zip(want) {
            let last = *s.history.last().expect("a running sequence has a history");
            let own = if k > 0 { &s.history[s.draft_fed..] } else { &[][..] };
            ids.extend(own.iter().chain(std::iter::repeat(&last)).take(width).map(|&t| t as i32));
        }
        let ids = Array::from_slice(&ids, &[rows as i32, width as i32])?;
        let h = with_lone_caches(&mut self.draft_caches, |c| d.model.forward_hidden(&ids, c))?;
        // Each drafting row's last own position.
        let at: Vec<i32> = (0..rows).map(|i| if want[i] > 0 { pending[i] as i32 - 1 } else { 0 }).collect();
        let at = Array::from_slice(&at, &[rows as i32, 1, 1])?;
        let mut logits = d.model.logits(&ops::take_along_axis(&h, &at, Some(1))?)?.reshape(&[rows as i32, -1])?;
        let kept: Vec<usize> = (0..rows).map(|i| if want[i] > 0 { pending[i] } else { 0 }).collect();
        trim_rows(&mut self.draft_caches, &kept.iter().map(|&k| width - k).collect::<Vec<_>>())?;
        for (s, k) in self.running.iter_mut().zip(kept) {
            s.draft_fed += k;
        }
        let most = want.iter().copied().max().unwrap_or(0);
        let mut drafts = Drafts { tokens: vec![Vec::new(); rows], dists: want.iter().map(|_| None).collect() };
        let mut passes = Vec::with_capacity(most);
        for j in 0..most {
            let logits_now = d.vocab.mask_logits(&logits.astype(Dtype::Float32)?)?;
            let shared = log_softmax(&logits_now)?;
            let greedy = shared.argmax(Some(-1), false)?.astype(Dtype::Uint32)?;
            let mut picks = Vec::with_capacity(rows);
            for (i, s) in self.running.iter_mut().enumerate() {
                let row = i as i32;
                if want[i] <= j || s.sampler.config().is_greedy() {
                    picks.push(greedy.slice_axis(0, row, row + 1, 1)?);
                    continue;
                }
                let q = s.draft_sampler.distribution(&shared.slice_axis(0, row, row + 1, 1)?)?;
                picks.push(s.draft_sampler.draw(&q.log()?)?.reshape(&[1])?);
                drafts.dists[i].get_or_insert_with(Vec::new).push(q);
            }
            // Each pass's picks feed the next on the device; all are read back once, at the end.
            let picked = ops::concatenate(&picks.iter().collect::<Vec<_>>(), 0)?;
            passes.push(picked.reshape(&[1, rows as i32])?);
            if j + 1 == most {
                break;
            }
            // Rows wanting another draft feed this one; the others a placeholder taken back.
            let next = picked.astype(Dtype::Int32)?.reshape(&[rows as i32, 1])?;
            let h = with_lone_caches(&mut self.draft_caches, |c| d.model.forward_hidden(&next, c))?;
            logits = d.model.logits(&h)?.reshape(&[rows as i32, -1])?;
            let feeds: Vec<bool> = (0..rows).map(|i| want[i] > j + 1).collect();
            trim_rows(&mut self.draft_caches, &feeds.iter().map(|&f| usize::from(!f)).collect::<Vec<_>>())?;
            for (s, f) in self.running.iter_mut().zip(feeds) {
                s.draft_fed += usize::from(f);
            }
        }
        let picked = ops::concatenate(&passes.iter().collect::<Vec<_>>(), 0)?;
        rmlx::eval(std::iter::once(&picked).chain(drafts.dists.iter().flatten().flatten()))?;
        let picked = picked.to_vec::<u32>()?;
        for (j, pass) in picked.chunks(rows).enumerate() {
            for (i, &t) in pass.iter().enumerate() {
                if want[i] > j {
                    drafts.tokens[i].push(t);
                }
            }
        }
        Ok(drafts)
    }

    /// The model over every row's pending token and drafts in one pass; each row keeps what it
    /// agrees with, takes the rest back, and hands its tokens to its sequence.
    fn verify(&mut self, drafts: Drafts, out: &mut Vec<Update>) -> Result<()> {
        let rows = self.running.len();
        let width = 1 + drafts.tokens.iter().map(Vec::len).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(rows * width);
        for (s, d) in self.running.iter().zip(&drafts.tokens) {
            let next = s.next.expect("a running sequence has its next token");
            ids.extend(std::iter::once(&next).chain(d).chain(std::iter::repeat(&next)).take(width).map(|&t| t as i32));
        }
        let ids = Array::from_slice(&ids, &[rows as i32, width as i32])?;
        let slots: Vec<usize> = self.running.iter().map(|s| s.adapter).collect();
        let (model, caches) = (&self.lm.model, &mut self.caches);
        let logits = with_lone_caches(caches, |caches| {
            with_row_adapters(&self.adapters, &slots, || model.logits(&model.forward_hidden(&ids, caches)?))
        })??;
        super::quantize_caches(caches, self.opts.kv_quantization.as_ref())?;
        let finite = ops::isfinite(&logits)?.all(rmlx::Axes::from(&[1, 2][..]), false)?;
        let lp = log_softmax(&self.lm.vocab.mask_logits(&logits.astype(Dtype::Float32)?)?)?;
        // Rows without drafts sample as in a plain step (with their own settings); the others
        // draw nothing there.
        let plain = drafts.tokens.iter().any(Vec::is_empty);
        let sampled = match plain {
            true => Some(sample_rows(
                self.lm,
                &mut self.running,
                &logits.slice_axis(1, 0, 1, 1)?.reshape(&[rows as i32, -1])?,
                &drafts.tokens.iter().map(|d| !d.is_empty()).collect::<Vec<_>>(),
            )?),
            false => None,
        };
        let best = lp.argmax(Some(-1), false)?.astype(Dtype::Uint32)?;
        rmlx::eval(sampled.iter().flat_map(|s| s.arrays()).chain([&best, &finite]))?;
        let (best, finite) = (best.to_vec::<u32>()?, finite.to_vec::<bool>()?);
        let read = sampled.as_ref().map(|s| s.read()).transpose()?;
        let mut errors = sampled.map(|s| s.errors).unwrap_or_default();
        let mut verdicts = Vec::with_capacity(rows);
        for i in 0..rows {
            let d = &drafts.tokens[i];
            let verdict = if d.is_empty() {
                let read = read.as_ref().expect("sampled when a row has no drafts");
                let error = errors.get_mut(i).and_then(Option::take);
                Verdict { kept: 0, tokens: vec![(read.tokens[i], read.logprobs[i])], top: read.top(i), error }
            } else {
                let s = &mut self.running[i];
                let (kept, last) = if s.sampler.config().is_greedy() {
                    let best = &best[i * width..i * width + d.len() + 1];
                    let kept = d.iter().zip(best).take_while(|(a, b)| a == b).count();
                    (kept, best[kept])
                } else {
                    let row = lp.slice_axis(0, i as i32, i as i32 + 1, 1)?;
                    let lps: Vec<Array> = (0..=d.len() as i32)
                        .map(|p| row.slice_axis(1, p, p + 1, 1)?.reshape(&[1, -1]))
                        .collect::<std::result::Result<_, _>>()?;
                    let done = Array::scalar(true);
                    accept_sampled(&mut s.sampler, d, drafts.dists[i].as_deref(), &lps, &done)?
                };
                s.drafted += d.len();
                s.accepted += kept;
                // Log-probabilities filled in below, all rows' at once.
                let tokens = d[..kept].iter().copied().chain([last]).map(|t| (t, 0.0)).collect();
                Verdict { kept, tokens, top: Vec::new(), error: None }
            };
            verdicts.push(verdict);
        }
        // The kept tokens' log-probabilities, read with one gather over every row and position.
        let speculated: Vec<usize> = (0..rows).filter(|&i| !drafts.tokens[i].is_empty()).collect();
        if !speculated.is_empty() {
            let mut chosen = vec![0i32; rows * width];
            for &i in &speculated {
                for (p, (t, _)) in verdicts[i].tokens.iter().enumerate() {
                    chosen[i * width + p] = *t as i32;
                }
            }
            let chosen = Array::from_slice(&chosen, &[rows as i32, width as i32, 1])?;
            let values = ops::take_along_axis(&lp, &chosen, Some(-1))?.to_vec::<f32>()?;
            for &i in &speculated {
                for (p, (_, lp)) in verdicts[i].tokens.iter_mut().enumerate() {
                    *lp = values[i * width + p];
                }
            }
        }
        // The model computed `width` positions a row; each keeps its pending token and kept drafts.
        let back: Vec<usize> = verdicts.iter().map(|v| width - 1 - v.kept).collect();
        trim_rows(&mut self.caches, &back)?;
        if !self.draft_caches.is_empty() {
            // The draft saw every draft but the last: it keeps those the model kept.
            let back: Vec<usize> = (0..rows)
                .map(|i| match drafts.tokens[i].len() {
                    0 => 0,
                    n => n - 1 - verdicts[i].kept.min(n - 1),
                })
                .collect();
            trim_rows(&mut self.draft_caches, &back)?;
            for (s, b) in self.running.iter_mut().zip(back) {
                s.draft_fed -= b;
            }
        }
        for ((s, v), ok) in self.running.iter_mut().zip(verdicts).zip(finite) {
            if let Some(error) = v.error {
                s.finish = Some(crate::FinishReason::Cancelled);
                out.push(Update::Failed { seq: s.id, error });
                continue;
            }
            if !ok {
                s.finish = Some(crate::FinishReason::Cancelled);
                out.push(Update::Failed { seq: s.id, error: non_finite(s) });
                continue;
            }
            let mut top = Some(v.top);
            for (t, lp) in v.tokens {
                s.accept(self.lm, t, lp, top.take().unwrap_or_default(), out)?;
                if s.finish.is_some() {
                    break;
                }
            }
        }
        self.retire_ended(None)
    }

    /// The draft model's cache rows for sequences joining the batch: each one's history but its
    /// last token, computed alone (in chunks of the prefill budget); a sequence that will not
    /// speculate gets a row holding nothing, computed from nothing.
    pub(super) fn draft_rows(&self, seqs: &mut [Sequence]) -> Result<Vec<BatchCache>> {
        let Some(Drafter::Model(d)) = self.speculation.map(|s| s.drafter) else { return Ok(Vec::new()) };
        let windows = d.layer_windows();
        let mut all: Vec<BatchCache> = windows.iter().map(|&w| BatchCache::new(0, w)).collect();
        for s in seqs {
            let mut caches: Vec<KvCache> = windows.iter().map(|&w| KvCache::Batch(BatchCache::new(1, w))).collect();
            let body = if s.may_speculate() { &s.history[..s.history.len() - 1] } else { &[][..] };
            for part in body.chunks(self.opts.prefill_tokens.max(1)) {
                d.model.forward_hidden(&ids_array(part)?, &mut caches)?;
                rmlx::eval(caches.iter().flat_map(KvCache::state))?;
            }
            s.draft_fed = body.len();
            for (a, c) in all.iter_mut().zip(caches) {
                let KvCache::Batch(c) = c else { unreachable!("batch caches") };
                a.extend(c)?;
            }
        }
        Ok(all)
    }
}

/// Row `i` of every layer's batch cache takes back its last `back[i]` positions.
fn trim_rows(caches: &mut [KvCache], back: &[usize]) -> Result<()> {
    if back.iter().all(|&b| b == 0) {
        return Ok(());
    }
    for c in caches {
        let KvCache::Batch(b) = c else { unreachable!("batch caches") };
        b.trim_rows(back)?;
    }
    Ok(())
}
