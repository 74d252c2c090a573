//! One request inside the engine: its sampler, its text stream, its counters, and what happens to
//! each token it is given (end of sequence, stop string, budget).

use super::{Request, SeqId, Update, Usage};
use crate::generate::FinishReason;
use crate::grammar::Constraint;
use crate::loader::LoadedModel;
use crate::sample::Sampler;
use crate::text_stream::TextStream;
use crate::Result;
use std::time::Instant;

pub(super) struct Sequence {
    pub id: SeqId,
    /// The prompt, then every generated token fed back (what the cache holds, in order).
    pub history: Vec<u32>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub generated: usize,
    pub max_tokens: usize,
    pub ignore_eos: bool,
    pub top_logprobs: usize,
    pub sampler: Sampler,
    pub text: TextStream,
    /// The last sampled token, to feed at the next step.
    pub next: Option<u32>,
    pub submitted: Instant,
    pub first_token: Option<Instant>,
    pub finish: Option<FinishReason>,
    /// The slot of its adapter in the engine's [`crate::nn::AdapterBank`] (0: none).
    pub adapter: usize,
    /// Where the output is in its grammar (structured output).
    pub constraint: Option<Constraint>,
    /// Whether drafts may be made for it (see [`Sequence::may_speculate`]).
    pub speculative: bool,
    /// Positions of `history` the draft model's cache holds for it.
    pub draft_fed: usize,
    /// The draft model's draws: another stream of the sampler's seed.
    pub draft_sampler: Sampler,
    /// Tokens drafted for it, and those kept.
    pub drafted: usize,
    pub accepted: usize,
}

impl Sequence {
    pub fn new(
        lm: &LoadedModel,
        id: SeqId,
        request: Request,
        max_tokens: usize,
        adapter: usize,
        constraint: Option<Constraint>,
    ) -> Result<Sequence> {
        let opts = request.options;
        let mut sampler = Sampler::new(opts.sampler.clone())?;
        sampler.set_prompt_len(request.prompt.len());
        let mut draft_sampler = Sampler::new(opts.sampler)?;
        draft_sampler.reseed(sampler.seed().wrapping_add(0x5EED))?;
        Ok(Sequence {
            id,
            prompt_tokens: request.prompt.len(),
            history: request.prompt,
            cached_tokens: 0,
            generated: 0,
            max_tokens,
            ignore_eos: opts.ignore_eos,
            top_logprobs: request.top_logprobs,
            sampler,
            text: TextStream::new(lm.tokenizer.stream_keeping(&opts.keep_special), opts.stop_strings),
            next: None,
            submitted: Instant::now(),
            first_token: None,
            finish: None,
            adapter,
            constraint,
            speculative: request.speculative,
            draft_fed: 0,
            draft_sampler,
            drafted: 0,
            accepted: 0,
        })
    }

    /// Whether the engine may draft for it: asked for, and sampled from the plain
    /// log-probabilities (no grammar, bias or penalty), without alternatives to report.
    pub fn may_speculate(&self) -> bool {
        self.speculative && !self.processes_logits() && self.top_logprobs == 0
    }

    /// Whether sampling needs more than the shared log-softmax of the logits (a bias or a
    /// penalty of its own).
    pub fn processes_logits(&self) -> bool {
        let cfg = self.sampler.config();
        !cfg.logit_bias.is_empty()
            || cfg.repetition_penalty != 1.0
            || cfg.penalizes_generated()
            || self.constraint.is_some()
    }

    /// Takes the sampled token `id`: pushes the updates it makes, and sets `finish` when it ends
    /// the sequence.
    pub fn accept(
        &mut self,
        lm: &LoadedModel,
        id: u32,
        logprob: f32,
        top: Vec<(u32, f32)>,
        out: &mut Vec<Update>,
    ) -> Result<()> {
        self.first_token.get_or_insert_with(Instant::now);
        if !self.ignore_eos && lm.eos_ids.contains(&id) {
            self.end(FinishReason::Eos, out)?;
            return Ok(());
        }
        if let Some(c) = &mut self.constraint {
            if let Err(error) = c.accept(id) {
                self.finish = Some(FinishReason::Cancelled);
                self.next = None;
                out.push(Update::Failed { seq: self.id, error });
                return Ok(());
            }
        }
        self.generated += 1;
        self.history.push(id);
        let text = self.text.push(id)?;
        out.push(Update::Token { seq: self.id, id, text, logprob, top });
        if self.constraint.as_ref().is_some_and(Constraint::is_finished) {
            // The grammar is complete (a closed JSON value, a whole match): nothing may follow.
            self.end(FinishReason::Eos, out)?;
        } else if self.text.stopped() {
            self.end(FinishReason::StopString, out)?;
        } else if self.generated >= self.max_tokens {
            self.end(FinishReason::Length, out)?;
        } else {
            self.next = Some(id);
        }
        Ok(())
    }

    /// Ends the sequence for `reason`, flushing the text still held.
    pub fn end(&mut self, reason: FinishReason, out: &mut Vec<Update>) -> Result<()> {
        if reason != FinishReason::Cancelled {
            let rest = self.text.finish()?;
            if !rest.is_empty() {
                out.push(Update::Text { seq: self.id, text: rest });
            }
        }
        self.finish = Some(reason);
        self.next = None;
        out.push(Update::Finished { seq: self.id, reason, usage: self.usage() });
        Ok(())
    }

    pub fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            completion_tokens: self.generated,
            time_to_first_token: self.first_token.map(|t| t - self.submitted),
            draft_tokens: self.drafted,
            accepted_draft_tokens: self.accepted,
        }
    }
}
