//! Speculative decoding: a cheap drafter proposes the next few tokens, the model checks them all
//! in one forward pass, and keeps the longest run it agrees with plus one token of its own — so a
//! step can yield several tokens for about the price of one.
//!
//! The drafter is a smaller model with the same vocabulary ([`Drafter::Model`], mlx-lm's
//! `--draft-model`), or the text so far ([`Drafter::PromptLookup`]: the tokens that followed the
//! latest earlier occurrence of the last few tokens — edits and summaries repeat their input).
//! Greedy output is the plain run's token for token (up to the rounding of computing several
//! positions at once); sampled output is distributed exactly as the model's own (rejection
//! sampling: a drafted token `x` is kept with probability `min(1, p(x)/q(x))`, else a token is
//! drawn from `max(p − q, 0)`, normalised). The batching engine speculates the same way for
//! each running request, all of them verified in one pass
//! ([`crate::engine::Engine::with_speculation`]).
//!
//! ```
//! use rmlx_lm::speculative::{Drafter, Speculation};
//! let lm = rmlx_lm::loader::load(rmlx_lm::registry::default_model()?, &Default::default())?;
//! let prompt = lm.encode_prompt("one two three one two three one two", true, None)?;
//! let opts = rmlx_lm::GenerateOptions { max_tokens: 8, ..Default::default() };
//! let plain: Vec<u32> = lm.generate(&prompt, &opts)?.map(|t| t.map(|t| t.id)).collect::<Result<_, _>>()?;
//! let lookup = Speculation { drafter: Drafter::PromptLookup { max_ngram: 3, min_ngram: 1 }, num_draft_tokens: 4 };
//! let mut g = lm.generate_speculative(&prompt, &opts, lookup)?;
//! let fast: Vec<u32> = g.by_ref().map(|t| t.map(|t| t.id)).collect::<Result<_, _>>()?;
//! assert_eq!(fast, plain);
//! assert!(g.acceptance().drafted > 0);
//! # Ok::<(), rmlx_lm::Error>(())
//! ```

use crate::cache::KvCache;
use crate::generate::{ids_array, room_after_prompt, FinishReason, GenerateOptions, Metrics, Token};
use crate::loader::LoadedModel;
use crate::sample::Sampler;
use crate::text_stream::TextStream;
use crate::{Error, Result};
use rmlx::{ops, Array, Dtype};
use std::collections::VecDeque;
use std::time::Instant;

/// Where drafts come from.
#[derive(Clone, Copy)]
pub enum Drafter<'d> {
    /// A smaller model sharing the vocabulary (checked at the start).
    Model(&'d LoadedModel),
    /// The tokens that followed the latest earlier occurrence of the last `max_ngram` tokens (or
    /// fewer, down to `min_ngram`) of the prompt and output so far.
    PromptLookup { max_ngram: usize, min_ngram: usize },
}

/// How to speculate.
#[derive(Clone, Copy)]
pub struct Speculation<'d> {
    pub drafter: Drafter<'d>,
    /// Tokens drafted per step (mlx-lm's `--num-draft-tokens`).
    pub num_draft_tokens: usize,
}

impl Speculation<'_> {
    /// Whether `lm` can speculate this way: at least one draft token, a draft model with the
    /// same vocabulary, a non-empty n-gram range, no model split over ranks.
    pub(crate) fn check(&self, lm: &LoadedModel) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidParameter(m));
        if self.num_draft_tokens == 0 {
            return bad("speculative decoding needs at least 1 draft token".into());
        }
        if lm.ranks().is_some() {
            return bad("speculative decoding needs a model on one device (not split over ranks)".into());
        }
        match &self.drafter {
            Drafter::Model(d) => {
                if d.ranks().is_some() {
                    return bad("the draft model must be on one device".into());
                }
                same_vocabulary(lm, d)?;
                let (ours, theirs) = (lm.model.config().vocab_size, d.model.config().vocab_size);
                if ours != theirs {
                    return bad(format!(
                        "the draft model scores {theirs} tokens and the model {ours}: they must share the vocabulary"
                    ));
                }
            }
            Drafter::PromptLookup { max_ngram, min_ngram } if *min_ngram == 0 || min_ngram > max_ngram => {
                return bad(format!("prompt lookup needs 1 <= min n-gram <= max n-gram, got {min_ngram}..{max_ngram}"));
            }
            Drafter::PromptLookup { .. } => {}
        }
        Ok(())
    }
}

/// Drafted and kept tokens so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Acceptance {
    /// Verification passes of the model.
    pub steps: usize,
    pub drafted: usize,
    pub accepted: usize,
}

impl Acceptance {
    /// The share of drafted tokens kept (0 when none were drafted).
    pub fn rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

impl LoadedModel {
    /// Starts generating after `prompt` with speculative decoding; iterate to get tokens, as
    /// [`LoadedModel::generate`].
    ///
    /// Errors as [`LoadedModel::generate`], and [`Error::InvalidParameter`] for a draft model
    /// whose vocabulary differs, no draft tokens, an n-gram range that is empty, or a model split
    /// over ranks.
    pub fn generate_speculative<'m>(
        &'m self,
        prompt: &[u32],
        opts: &GenerateOptions,
        speculation: Speculation<'m>,
    ) -> Result<SpeculativeGeneration<'m>> {
        SpeculativeGeneration::new(self, None, prompt, opts, speculation)
    }

    /// [`LoadedModel::generate_speculative`] continuing from the caches an earlier speculative
    /// generation left ([`SpeculativeGeneration::into_state`]: a conversation's turns): the part
    /// of `prompt` they already hold is not computed again.
    pub fn generate_speculative_after<'m>(
        &'m self,
        state: SpeculativeState,
        prompt: &[u32],
        opts: &GenerateOptions,
        speculation: Speculation<'m>,
    ) -> Result<SpeculativeGeneration<'m>> {
        SpeculativeGeneration::new(self, Some(state), prompt, opts, speculation)
    }
}

/// The caches a speculative generation leaves, and the tokens they hold: what the next turn of a
/// conversation starts from.
pub struct SpeculativeState {
    caches: Vec<KvCache>,
    draft_caches: Vec<KvCache>,
    /// The tokens the model's caches hold.
    tokens: Vec<u32>,
    /// How many of them the draft model's caches hold.
    draft_len: usize,
}

impl SpeculativeState {
    /// The tokens the caches hold.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

/// A speculative generation in progress: an iterator of [`Token`]s.
pub struct SpeculativeGeneration<'m> {
    lm: &'m LoadedModel,
    opts: GenerateOptions,
    spec: Speculation<'m>,
    caches: Vec<KvCache>,
    draft_caches: Vec<KvCache>,
    sampler: Sampler,
    draft_sampler: Sampler,
    /// Prompt and tokens handed out or waiting to be.
    history: Vec<u32>,
    /// Tokens the model has not seen yet (the last kept one).
    pending: Vec<u32>,
    /// Tokens the draft model has not seen yet.
    draft_pending: Vec<u32>,
    ready: VecDeque<(u32, f32)>,
    text: TextStream,
    finish: Option<FinishReason>,
    metrics: Metrics,
    /// Prompt tokens whose keys and values came from an earlier state.
    cached: usize,
    acceptance: Acceptance,
    started: Instant,
    first_token_at: Option<Instant>,
}

impl<'m> SpeculativeGeneration<'m> {
    fn new(
        lm: &'m LoadedModel,
        state: Option<SpeculativeState>,
        prompt: &[u32],
        opts: &GenerateOptions,
        spec: Speculation<'m>,
    ) -> Result<Self> {
        let bad = |m: String| Err(Error::InvalidParameter(m));
        if prompt.is_empty() {
            return Err(Error::Prompt("the prompt is empty".into()));
        }
        spec.check(lm)?;
        opts.sampler.validate()?;
        if let Some(q) = &opts.kv_quantization {
            q.check()?;
        }
        if opts.prefill_chunk == 0 {
            return bad("prefill_chunk must be positive".into());
        }
        let cfg = lm.model.config();
        let room = match (opts.context_limit, cfg.max_position_embeddings) {
            (Some(limit), _) if prompt.len() > limit => {
                room_after_prompt(prompt.len(), limit)?;
                usize::MAX
            }
            (Some(_), _) => usize::MAX,
            (None, Some(limit)) => room_after_prompt(prompt.len(), limit)?,
            (None, None) => usize::MAX,
        };
        lm.vocab.check(prompt)?;
        opts.sampler.check_vocab(cfg.vocab_size as usize)?;
        let mut sampler = Sampler::new(opts.sampler.clone())?;
        sampler.set_prompt_len(prompt.len());
        // The draft's draws are its own: another stream of the same seed.
        let mut draft_sampler = Sampler::new(opts.sampler.clone())?;
        draft_sampler.reseed(sampler.seed().wrapping_add(0x5EED))?;
        draft_sampler.set_prompt_len(prompt.len());
        let fresh_draft = || match &spec.drafter {
            Drafter::Model(d) => d.model.new_caches(opts.context_limit),
            Drafter::PromptLookup { .. } => Vec::new(),
        };
        // What the earlier caches hold of this prompt (all but its last token at most).
        let body = &prompt[..prompt.len() - 1];
        let (caches, draft_caches, held, draft_held) = match state {
            Some(mut st) => {
                let shared = st.tokens.iter().zip(body).take_while(|(a, b)| a == b).count();
                let (caches, held) = if st.caches.iter_mut().all(|c| c.trim(st.tokens.len() - shared)) {
                    (st.caches, shared)
                } else {
                    (lm.model.new_caches(opts.context_limit), 0)
                };
                let draft_shared = held.min(st.draft_len);
                let draft_fits = st.draft_caches.len() == fresh_draft().len();
                let (draft_caches, draft_held) =
                    if draft_fits && st.draft_caches.iter_mut().all(|c| c.trim(st.draft_len - draft_shared)) {
                        (st.draft_caches, draft_shared)
                    } else {
                        (fresh_draft(), 0)
                    };
                (caches, draft_caches, held, draft_held)
            }
            None => (lm.model.new_caches(opts.context_limit), fresh_draft(), 0, 0),
        };
        let cached = held;
        let mut g = SpeculativeGeneration {
            lm,
            opts: GenerateOptions { max_tokens: opts.max_tokens.min(room), ..opts.clone() },
            caches,
            draft_caches,
            sampler,
            draft_sampler,
            history: prompt.to_vec(),
            pending: vec![*prompt.last().expect("not empty")],
            draft_pending: vec![*prompt.last().expect("not empty")],
            ready: VecDeque::new(),
            text: TextStream::new(lm.tokenizer.stream_keeping(&opts.keep_special), opts.stop_strings.clone()),
            finish: None,
            metrics: Metrics { prompt_tokens: prompt.len(), ..Metrics::default() },
            cached,
            acceptance: Acceptance::default(),
            spec,
            started: Instant::now(),
            first_token_at: None,
        };
        if opts.max_tokens == 0 {
            g.finish = Some(FinishReason::Length);
            return Ok(g);
        }
        prefill(lm, &mut g.caches, &body[held..], &g.opts)?;
        if let Drafter::Model(d) = &g.spec.drafter {
            prefill(d, &mut g.draft_caches, &body[draft_held..], &g.opts)?;
        }
        Ok(g)
    }

    /// Counters so far.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Drafted and kept tokens so far.
    pub fn acceptance(&self) -> Acceptance {
        self.acceptance
    }

    /// Prompt tokens that an earlier state's caches already held.
    pub fn cached_tokens(&self) -> usize {
        self.cached
    }

    /// The caches, holding the prompt and the tokens handed out (those computed past them are
    /// taken back), for [`LoadedModel::generate_speculative_after`].
    pub fn into_state(mut self) -> SpeculativeState {
        let prompt = self.metrics.prompt_tokens;
        let keep = (prompt + self.metrics.generated_tokens).min(self.history.len());
        let held = self.history.len() - self.pending.len();
        let draft_held = self.history.len() - self.draft_pending.len();
        let (mut len, mut draft_len) = (held.min(keep), draft_held.min(keep));
        if !self.caches.iter_mut().all(|c| c.trim(held - len)) {
            (self.caches, len) = (self.lm.model.new_caches(self.opts.context_limit), 0);
        }
        if !self.draft_caches.iter_mut().all(|c| c.trim(draft_held - draft_len)) {
            self.draft_caches.clear();
            draft_len = 0;
        }
        self.history.truncate(len);
        SpeculativeState { caches: self.caches, draft_caches: self.draft_caches, tokens: self.history, draft_len }
    }

    /// Why generation ended, once it has.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Up to `k` drafted tokens and, for a sampling draft model, the distributions they were drawn
    /// from.
    fn draft(&mut self, k: usize) -> Result<(Vec<u32>, Option<Vec<Array>>)> {
        match &self.spec.drafter {
            Drafter::PromptLookup { max_ngram, min_ngram } => {
                Ok((lookup(&self.history, *max_ngram, *min_ngram, k), None))
            }
            Drafter::Model(d) => {
                let d: &LoadedModel = d;
                let mut input = ids_array(&self.draft_pending)?;
                // Penalties read the drafts before each one, from the host; without them every
                // draft stays on the device as the next step's input, read back once at the end.
                let cfg = self.draft_sampler.config();
                let reads_history = cfg.penalizes_generated() || cfg.repetition_penalty != 1.0;
                let greedy = cfg.is_greedy();
                let (mut tokens, mut dists) = (Vec::with_capacity(k), Vec::with_capacity(k));
                let mut on_device = Vec::with_capacity(k);
                let mut history = self.history.clone();
                for i in 0..k {
                    let h = d.model.forward_hidden(&input, &mut self.draft_caches)?;
                    let len = h.shape()[1];
                    let logits = d.model.logits(&h.slice_axis(1, len - 1, len, 1)?)?.reshape(&[1, -1])?;
                    let logits = d.vocab.mask_logits(&logits)?;
                    let lp = self.draft_sampler.logprobs(&logits, &history)?;
                    // Greedy drafts are checked against the model's argmax: no distribution.
                    let token = if greedy {
                        lp.argmax(Some(-1), false)?.astype(Dtype::Uint32)?
                    } else {
                        let q = self.draft_sampler.distribution(&lp)?;
                        let token = self.draft_sampler.draw(&q.log()?)?;
                        dists.push(q);
                        token
                    };
                    if !reads_history {
                        input = token.astype(Dtype::Int32)?.reshape(&[1, 1])?;
                        on_device.push(token);
                        continue;
                    }
                    rmlx::eval(std::iter::once(&token).chain(dists.last()))?;
                    let id = token.item::<u32>()?;
                    tokens.push(id);
                    history.push(id);
                    if i + 1 < k {
                        input = ids_array(&[id])?;
                    }
                }
                if !reads_history {
                    let all = ops::concatenate(&on_device.iter().collect::<Vec<_>>(), 0)?;
                    rmlx::eval(std::iter::once(&all).chain(&dists))?;
                    tokens = all.to_vec::<u32>()?;
                }
                Ok((tokens, (!greedy).then_some(dists)))
            }
        }
    }

    /// One verification pass: drafts, the model over them, the tokens kept.
    fn round(&mut self) -> Result<()> {
        let left = self.opts.max_tokens - self.metrics.generated_tokens;
        let mut k = self.spec.num_draft_tokens.min(left.saturating_sub(1));
        let writes = self.pending.len() + k;
        if !self.caches.iter().chain(&self.draft_caches).all(|c| c.trimmable_after(writes)) {
            k = 0; // a window that slides cannot take positions back: a plain step
        }
        let (drafts, dists) = if k > 0 { self.draft(k)? } else { (Vec::new(), None) };
        let k = drafts.len();
        let mut input = self.pending.clone();
        input.extend(&drafts);
        let h = self.lm.model.forward_hidden(&ids_array(&input)?, &mut self.caches)?;
        quantize(&mut self.caches, &self.opts)?;
        let len = h.shape()[1];
        let logits = self.lm.model.logits(&h.slice_axis(1, len - 1 - k as i32, len, 1)?)?;
        let finite = ops::isfinite(&logits)?.all(rmlx::Axes::All, false)?;
        // Each position's processed log-probabilities see the drafts before it (penalties).
        let mut history = self.history.clone();
        let mut lps = Vec::with_capacity(k + 1);
        for i in 0..=k {
            let row = logits.slice_axis(1, i as i32, i as i32 + 1, 1)?.reshape(&[1, -1])?;
            let row = self.lm.vocab.mask_logits(&row)?;
            lps.push(self.sampler.logprobs(&row, &history)?);
            history.extend(drafts.get(i));
        }
        let (kept, last) = if self.sampler.config().is_greedy() {
            let best = ops::concatenate(&lps.iter().collect::<Vec<_>>(), 0)?.argmax(Some(-1), false)?;
            rmlx::eval([&best, &finite])?;
            let best = best.astype(Dtype::Uint32)?.to_vec::<u32>()?;
            let kept = drafts.iter().zip(&best).take_while(|(d, b)| d == b).count();
            (kept, best[kept])
        } else {
            accept_sampled(&mut self.sampler, &drafts, dists.as_deref(), &lps, &finite)?
        };
        if !finite.item::<bool>()? {
            return Err(Error::NonFinite(format!(
                "the logits after generated token {} are NaN or infinite (the weights or activations overflow)",
                self.metrics.generated_tokens
            )));
        }
        // The model saw pending + k drafts; it keeps pending + the first `kept`.
        let rejected = k - kept;
        if rejected > 0 {
            for c in &mut self.caches {
                c.trim(rejected);
            }
        }
        if let Drafter::Model(_) = self.spec.drafter {
            // The draft saw its pending tokens and every draft but the last.
            if k == 0 {
                self.draft_pending.push(last);
            } else if kept < k {
                for c in &mut self.draft_caches {
                    c.trim(k - 1 - kept);
                }
                self.draft_pending = vec![last];
            } else {
                self.draft_pending = vec![drafts[k - 1], last];
            }
        }
        self.pending = vec![last];
        self.acceptance.steps += 1;
        self.acceptance.drafted += k;
        self.acceptance.accepted += kept;
        let tokens: Vec<u32> = drafts[..kept].iter().copied().chain([last]).collect();
        let gathered: Vec<Array> = tokens
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                lps[i].slice_axis(1, t as i32, t as i32 + 1, 1).and_then(|a| a.reshape(&[1])).map_err(Error::from)
            })
            .collect::<Result<_>>()?;
        let logprobs = ops::concatenate(&gathered.iter().collect::<Vec<_>>(), 0)?.to_vec::<f32>()?;
        for (t, lp) in tokens.into_iter().zip(logprobs) {
            self.history.push(t);
            self.ready.push_back((t, lp));
        }
        Ok(())
    }

    fn next_token(&mut self) -> Result<Option<Token>> {
        if self.finish.is_some() {
            return Ok(None);
        }
        if self.ready.is_empty() {
            self.round()?;
        }
        let Some((id, logprob)) = self.ready.pop_front() else { return Ok(None) };
        let now = Instant::now();
        if self.first_token_at.is_none() {
            self.first_token_at = Some(now);
            self.metrics.time_to_first_token = now - self.started;
        }
        self.metrics.decode_time = now - self.first_token_at.expect("set above");
        self.metrics.peak_memory = rmlx::memory::peak_memory();
        if !self.opts.ignore_eos && self.lm.eos_ids.contains(&id) {
            self.finish = Some(FinishReason::Eos);
            return Ok(None);
        }
        self.metrics.generated_tokens += 1;
        let budget_left = self.metrics.generated_tokens < self.opts.max_tokens;
        let (text, end) = self.text.token(id, budget_left)?;
        self.finish = end;
        Ok(Some(Token { id, text, logprob }))
    }
}

impl Iterator for SpeculativeGeneration<'_> {
    type Item = Result<Token>;

    fn next(&mut self) -> Option<Result<Token>> {
        match self.next_token() {
            Ok(Some(t)) => Some(Ok(t)),
            Ok(None) => None,
            Err(e) => {
                self.finish = Some(FinishReason::Cancelled);
                Some(Err(e))
            }
        }
    }
}

/// Rejection sampling over `drafts`: `(kept, the token after them)`. `lps[i]` (`[1, vocab]`) are
/// the model's processed log-probabilities at draft `i` (and after the last draft), `dists[i]` the
/// draft model's distributions the drafts were drawn from (`None`: prompt lookup, certain
/// drafts); `finite` is evaluated with them.
pub(crate) fn accept_sampled(
    sampler: &mut Sampler,
    drafts: &[u32],
    dists: Option<&[Array]>,
    lps: &[Array],
    finite: &Array,
) -> Result<(usize, u32)> {
    let k = drafts.len();
    let ps: Vec<Array> = lps.iter().map(|lp| sampler.distribution(lp)).collect::<Result<_>>()?;
    // p(x) and q(x) of each draft (a prompt-lookup draft is certain: q(x) = 1).
    let mut pick = Vec::with_capacity(2 * k);
    for (i, &d) in drafts.iter().enumerate() {
        pick.push(ps[i].slice_axis(1, d as i32, d as i32 + 1, 1)?.reshape(&[1])?);
        if let Some(q) = dists {
            pick.push(q[i].slice_axis(1, d as i32, d as i32 + 1, 1)?.reshape(&[1])?);
        }
    }
    let values = if pick.is_empty() {
        rmlx::eval([finite])?;
        Vec::new()
    } else {
        let all = ops::concatenate(&pick.iter().collect::<Vec<_>>(), 0)?;
        rmlx::eval([&all, finite])?;
        all.to_vec::<f32>()?
    };
    let u = if k == 0 { Vec::new() } else { sampler.uniforms(k)? };
    let per = if dists.is_some() { 2 } else { 1 };
    for i in 0..k {
        let p = values[i * per];
        let q = if dists.is_some() { values[i * per + 1] } else { 1.0 };
        if u[i] * q < p {
            continue; // kept with probability min(1, p/q)
        }
        // Rejected: a token from max(p − q, 0), normalised.
        let q_full = match dists {
            Some(q) => q[i].clone(),
            None => ops::one_hot(&Array::from_slice(&[drafts[i] as i32], &[1])?, ps[i].shape()[1], Dtype::Float32)?,
        };
        let residual = ops::maximum(&(&ps[i] - &q_full)?, &Array::scalar(0.0f32))?;
        let token = sampler.draw(&residual.log()?)?.item::<u32>()?;
        return Ok((i, token));
    }
    let token = sampler.draw(&ps[k].log()?)?.item::<u32>()?;
    Ok((k, token))
}

/// Runs `ids` into `caches` in chunks, evaluating the caches only.
fn prefill(lm: &LoadedModel, caches: &mut [KvCache], ids: &[u32], opts: &GenerateOptions) -> Result<()> {
    for part in ids.chunks(opts.prefill_chunk) {
        lm.model.forward_hidden(&ids_array(part)?, caches)?;
        quantize(caches, opts)?;
        rmlx::eval(caches.iter().flat_map(KvCache::state).collect::<Vec<_>>())?;
    }
    Ok(())
}

fn quantize(caches: &mut [KvCache], opts: &GenerateOptions) -> Result<()> {
    if let Some(q) = &opts.kv_quantization {
        for c in caches {
            c.quantize(q)?;
        }
    }
    Ok(())
}

/// Prompt lookup: the (up to `k`) tokens after the latest earlier occurrence of the longest
/// suffix of `history` of `max..=min` tokens.
pub fn lookup(history: &[u32], max: usize, min: usize, k: usize) -> Vec<u32> {
    let n = history.len();
    for size in (min..=max.min(n.saturating_sub(1))).rev() {
        let tail = &history[n - size..];
        // Latest first, not the suffix itself.
        for start in (0..n - size).rev() {
            if &history[start..start + size] == tail {
                let from = start + size;
                return history[from..(from + k).min(n)].to_vec();
            }
        }
    }
    Vec::new()
}

/// The draft model must read and write the same tokens: the same vocabulary, id for id.
pub(crate) fn same_vocabulary(lm: &LoadedModel, draft: &LoadedModel) -> Result<()> {
    let (a, b) = (lm.tokenizer.inner().get_vocab(true), draft.tokenizer.inner().get_vocab(true));
    if a.len() != b.len() {
        return Err(Error::InvalidParameter(format!(
            "the draft model's tokenizer has {} tokens and the model's {}: they must share the vocabulary",
            b.len(),
            a.len()
        )));
    }
    if let Some((t, id)) = a.iter().find(|(t, id)| b.get(*t) != Some(id)) {
        return Err(Error::InvalidParameter(format!(
            "the draft model's tokenizer differs from the model's (`{t}` is {id} in the model's, {:?} in the draft's): they must share the vocabulary",
            b.get(t)
        )));
    }
    Ok(())
}
