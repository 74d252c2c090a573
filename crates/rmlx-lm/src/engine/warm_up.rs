//! A start-up pass over the shapes a server's steps take. MLX's CUDA backend compiles some kernels
//! the first time a shape of work needs them, and rmlx's own kernels are made per batch size: on
//! a fresh machine a qwen3-8b 4-bit server spent 72 s of its first burst of 32 requests in MLX's
//! compiler (BENCHMARKS.md). [`Engine::warm_up`] pays that before the first client waits for it.

use super::{Engine, Request};
use crate::generate::GenerateOptions;
use crate::{Error, Result};

impl Engine<'_> {
    /// Runs requests of made-up tokens to their ends, greedily: first a prompt of a whole
    /// prefill step ([`super::EngineOptions::prefill_tokens`], within the context) alone, for
    /// one token (so that it never pads the batch to its length); then
    /// [`super::EngineOptions::max_batch`] prompts of 4 to 11 tokens, computed together
    /// [`super::EngineOptions::prefill_batch`] at a time, the `i`-th (from 1) generating `i + 1`
    /// tokens, so that, when they fit one step, the batch decodes at every size from
    /// `max_batch` down to 1. The prompt cache is emptied after, so that nothing of it is
    /// reused, and so is MLX's cache of freed buffers. A request the key/value budget or the
    /// context refuses is left out. Returns the steps taken.
    ///
    /// Errors: [`Error::InvalidParameter`] when a request is waiting or running (its updates
    /// would be lost); any error of a step.
    ///
    /// ```
    /// # fn main() -> rmlx_lm::Result<()> {
    /// use rmlx_lm::engine::{Engine, EngineOptions};
    /// let lm = rmlx_lm::loader::load(rmlx_lm::registry::default_model()?, &Default::default())?;
    /// let options = EngineOptions { max_batch: 4, prefill_tokens: 64, ..Default::default() };
    /// let mut engine = Engine::new(&lm, options);
    /// // The long prompt alone, then the batch of 4 down to 1.
    /// assert_eq!(engine.warm_up()?, 5);
    /// assert!(engine.is_idle());
    /// assert_eq!(engine.prompt_cache_usage(), (0, 0));
    /// # Ok(()) }
    /// ```
    pub fn warm_up(&mut self) -> Result<usize> {
        if !self.is_idle() {
            return Err(Error::InvalidParameter("the engine warms up only while no request waits or runs".into()));
        }
        // Ids spread over the tokenizer's (as `rmlx bench-batch` makes them), past the first ten
        // where special tokens usually sit when there are that many.
        let vocab = self.lm.vocab.sampleable().max(1);
        let skip = if vocab > 20 { 10 } else { 0 };
        let token = |i: usize, j: usize| ((i * 7919 + j * 104_729) % (vocab - skip) + skip) as u32;
        let rows = self.opts.max_batch.max(1);
        let long = self.opts.prefill_tokens.min(self.context.saturating_sub(2)).max(1);
        for i in 0..=rows {
            let len = if i == 0 { long } else { 4 + i % 8 };
            let prompt = (0..len).map(|j| token(i, j)).collect();
            let max_tokens = if i == 0 { 1 } else { i + 1 };
            let options = GenerateOptions { max_tokens, ignore_eos: true, ..Default::default() };
            match self.submit(Request { prompt, options, ..Default::default() }) {
                // One the key/value budget or the context refuses would be refused when served.
                Ok(_) | Err(Error::Prompt(_)) => {}
                Err(e) => return Err(e),
            }
        }
        let mut steps = 0;
        while !self.is_idle() {
            for update in self.step()? {
                if let super::Update::Failed { error, .. } = update {
                    return Err(error);
                }
            }
            steps += 1;
        }
        self.prompt_cache.clear();
        rmlx::memory::clear_cache();
        Ok(steps)
    }
}
