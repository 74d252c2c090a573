//! Where a decoding step's time goes, one token at a time and synchronously: building its graph
//! (rmlx, on the calling thread), handing it to MLX (`async_eval`: the evaluation thread walks
//! the graph and launches every operation on the device's stream), and waiting for the token;
//! with one step's operations counted by MLX primitive ([`rmlx::graph_census`]).
//!
//! A step is the one greedy decoding runs (`Generation`): the model over the last token with its
//! caches, the last position's logits, the finite check, the vocabulary mask and the greedy
//! sampler's log-probabilities and arg-max. Decoding itself overlaps the next step's building and
//! launching with the device's work on this one; here each part is timed alone, so the sum is
//! slower than `rmlx bench`'s decode and says which part bounds it.
//!
//! ```no_run
//! # fn main() -> rmlx_lm::Result<()> {
//! let lm = rmlx_lm::loader::load(std::path::Path::new("model-dir"), &rmlx_lm::LoadOptions::default())?;
//! let p = rmlx_lm::profile::decode_steps(&lm, &[1, 2, 3], 32)?;
//! println!("{:.0} µs to build, {:.0} to launch, {:.0} waiting; {} operations", p.build_us, p.launch_us, p.wait_us, p.operation_count());
//! # Ok(()) }
//! ```

use crate::generate::ids_array;
use crate::sample::{Sampler, SamplerConfig};
use crate::{Error, LoadedModel, Result};
use rmlx::{Array, Dtype};
use std::collections::BTreeMap;
use std::time::Instant;

/// Steps run before the timed ones (kernel compilation, caches growing into place).
const WARM_UP: usize = 3;

/// The mean time of one decoding step, split in three, and its operations.
#[derive(Clone, Debug)]
pub struct StepProfile {
    /// Timed steps.
    pub steps: usize,
    /// Building the step's graph, µs.
    pub build_us: f64,
    /// `async_eval`: MLX walking the graph and launching its operations, µs.
    pub launch_us: f64,
    /// Waiting for the token after the launch, µs.
    pub wait_us: f64,
    /// One step's operations by MLX primitive name (views and reshapes included).
    pub operations: BTreeMap<String, usize>,
    /// The model's layers.
    pub layers: usize,
}

impl StepProfile {
    /// A step, µs.
    pub fn total_us(&self) -> f64 {
        self.build_us + self.launch_us + self.wait_us
    }

    /// One step's operations.
    pub fn operation_count(&self) -> usize {
        self.operations.values().sum()
    }
}

/// Runs `prompt` through the model, then `WARM_UP` and `steps` timed greedy steps.
pub fn decode_steps(lm: &LoadedModel, prompt: &[u32], steps: usize) -> Result<StepProfile> {
    timed_passes(lm, prompt, steps, 0)
}

/// As [`decode_steps`], each step a speculative verification pass at acceptance 0: the last
/// token and `drafts` more computed in one pass, every position's logits (the last one's arg-max),
/// then the drafts' positions taken back from the caches (what a rejected round costs the model).
///
/// Errors: [`Error::InvalidParameter`] as [`decode_steps`], and for caches that cannot take
/// positions back (a window that slid).
pub fn verify_passes(lm: &LoadedModel, prompt: &[u32], drafts: usize, passes: usize) -> Result<StepProfile> {
    timed_passes(lm, prompt, passes, drafts)
}

/// `steps` timed passes over the last token and `drafts` copies of it (none: decoding steps).
fn timed_passes(lm: &LoadedModel, prompt: &[u32], steps: usize, drafts: usize) -> Result<StepProfile> {
    if prompt.is_empty() || steps == 0 {
        return Err(Error::InvalidParameter("profiling needs a prompt and at least one step".into()));
    }
    lm.vocab.check(prompt)?;
    let mut caches = lm.model.new_caches(None);
    let mut sampler = Sampler::new(SamplerConfig::default())?;
    let mut token = step(lm, &ids_array(prompt)?, &mut caches, &mut sampler)?;
    rmlx::eval(&token)?;
    let (mut build, mut launch, mut wait) = (0f64, 0f64, 0f64);
    let mut operations = BTreeMap::new();
    for i in 0..WARM_UP + steps {
        let started = Instant::now();
        let ids = token[0].reshape(&[1, 1])?.astype(Dtype::Int32)?;
        let ids = if drafts > 0 { rmlx::ops::repeat(&ids, drafts as i32 + 1, Some(1))? } else { ids };
        let next = step(lm, &ids, &mut caches, &mut sampler)?;
        let built = Instant::now();
        if i == WARM_UP {
            operations = rmlx::graph_census(&next)?;
        }
        rmlx::async_eval(&next)?;
        let launched = Instant::now();
        next[0].item::<u32>()?;
        let done = Instant::now();
        if drafts > 0 && !caches.iter_mut().all(|c| c.trim(drafts)) {
            return Err(Error::InvalidParameter("this model's caches cannot take positions back".into()));
        }
        if i >= WARM_UP {
            build += (built - started).as_secs_f64();
            launch += (launched - built).as_secs_f64();
            wait += (done - launched).as_secs_f64();
        }
        token = next;
    }
    let us = |s: f64| s * 1e6 / steps as f64;
    Ok(StepProfile {
        steps,
        build_us: us(build),
        launch_us: us(launch),
        wait_us: us(wait),
        operations,
        layers: lm.model.config().num_hidden_layers,
    })
}

/// One greedy step over `ids` `[1, L]`: `[token, log-probability, all logits finite]` of the last
/// position (every position's logits computed, as a verification pass needs them).
fn step(
    lm: &LoadedModel,
    ids: &Array,
    caches: &mut [crate::cache::KvCache],
    sampler: &mut Sampler,
) -> Result<Vec<Array>> {
    let h = lm.model.forward_hidden(ids, caches)?;
    let len = h.shape()[1];
    let all = lm.model.logits(&h)?;
    let logits = all.slice_axis(1, len - 1, len, 1)?.reshape(&[1, -1])?;
    let finite = rmlx::ops::isfinite(&logits)?.all(rmlx::Axes::All, false)?;
    let (token, logprobs) = sampler.sample(&lm.vocab.mask_logits(&logits)?, &[])?;
    let logprob = rmlx::ops::take_along_axis(&logprobs, &token.reshape(&[1, 1])?, Some(-1))?;
    Ok(vec![token.reshape(&[1])?, logprob.reshape(&[1])?, finite])
}
