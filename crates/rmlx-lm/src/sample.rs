//! Sampling: turning the logits of the last position into the next token.
//!
//! The chain follows mlx-lm (`make_logits_processors` + `make_sampler`):
//!
//! 1. **Logits processors**, on the raw logits: [`apply_logit_bias`] (additive bias per token id), then
//!    [`apply_repetition_penalty`] (tokens among the last `repetition_context` ids of the history:
//!    a negative logit is multiplied by the penalty, a non-negative one divided by it).
//! 2. **Log-probabilities**: `logprobs = logits - logsumexp(logits)` ([`log_softmax`]). These are
//!    returned next to the token, as mlx-lm's `logprobs` are: they describe the processed
//!    distribution *before* temperature and filtering.
//! 3. **Sampler**, on the log-probabilities: temperature 0 takes the argmax. Otherwise the filters
//!    [`apply_top_p`] → [`apply_min_p`] → [`apply_top_k`] set the tokens they drop to `-inf`, and a
//!    token is drawn from `categorical(logprobs / temperature)`.
//!
//! Everything is lazy: [`Sampler::sample`] only records MLX operations (no host round trip), so the
//! sampling of one step can be queued with the model's forward pass and evaluated together.
//!
//! Each filter is also a free function working along the last axis of an array of any rank, so it can
//! be used (and tested) alone.

use crate::{Error, Result};
use rmlx::{ops, random, Array, Dtype};

/// The settings of the sampling chain. The default is greedy decoding with every filter and
/// processor off.
///
/// | field | off / default | valid range |
/// |---|---|---|
/// | `temperature` | `0.0` = greedy (argmax) | finite, `>= 0` |
/// | `top_p` | `1.0` | `(0, 1]` |
/// | `top_k` | `0` | any; `>=` vocabulary size is also off |
/// | `min_p` | `0.0` | `[0, 1)` |
/// | `min_tokens_to_keep` | `1` | `>= 1` (used by `min_p`) |
/// | `repetition_penalty` | `1.0` | finite, `> 0` |
/// | `repetition_context` | `20` (as mlx-lm) | `>= 1` |
/// | `presence_penalty` | `0.0` | `[-2, 2]` (OpenAI's) |
/// | `frequency_penalty` | `0.0` | `[-2, 2]` (OpenAI's) |
/// | `logit_bias` | empty | values not NaN and not `+inf` (`-inf` bans a token); ids below the vocabulary size |
/// | `seed` | `None` (seeded from the clock) | any |
///
/// The filters only matter when `temperature > 0`; the logit processors (bias, repetition penalty)
/// apply to greedy decoding too.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplerConfig {
    /// Softmax temperature; `0` means greedy (argmax) decoding.
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of most probable tokens whose total probability
    /// reaches `top_p`. `1.0` turns it off.
    pub top_p: f32,
    /// Keep only the `top_k` most probable tokens. `0` turns it off.
    pub top_k: usize,
    /// Drop tokens whose probability is below `min_p` times the probability of the most likely token.
    /// `0.0` turns it off.
    pub min_p: f32,
    /// The fewest tokens `min_p` may leave (the most probable ones are kept).
    pub min_tokens_to_keep: usize,
    /// Sign-aware multiplicative penalty for tokens seen in the last `repetition_context` ids of the
    /// history (CTRL, arXiv:1909.05858). `1.0` turns it off.
    pub repetition_penalty: f32,
    /// How many of the most recent history ids the repetition penalty looks at.
    pub repetition_context: usize,
    /// Subtracted once from the logit of every token already generated (OpenAI's
    /// `presence_penalty`; the prompt's tokens do not count, as in vLLM). `0.0` turns it off.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated (OpenAI's
    /// `frequency_penalty`). `0.0` turns it off.
    pub frequency_penalty: f32,
    /// Additive biases `(token id, bias)` applied to the logits; repeated ids add up.
    pub logit_bias: Vec<(u32, f32)>,
    /// Seed of the sampler's random key; `None` seeds from the clock.
    pub seed: Option<u64>,
}

impl Default for SamplerConfig {
    /// Greedy decoding, no filters, no processors, clock seed.
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            min_tokens_to_keep: 1,
            repetition_penalty: 1.0,
            repetition_context: 20,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: None,
        }
    }
}

impl SamplerConfig {
    /// Checks every setting against the ranges in the table of [`SamplerConfig`]; the error
    /// ([`Error::InvalidParameter`]) names the field and the value.
    pub fn validate(&self) -> Result<()> {
        check_temperature(self.temperature)?;
        check_top_p(self.top_p)?;
        check_min_p(self.min_p)?;
        check_min_tokens_to_keep(self.min_tokens_to_keep)?;
        check_repetition_penalty(self.repetition_penalty)?;
        check_repetition_context(self.repetition_context)?;
        for (name, p) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&p) {
                return Err(invalid(format!("{name} must be in [-2, 2] (0 = off), got {p}")));
            }
        }
        for &(id, bias) in &self.logit_bias {
            check_bias(id, bias)?;
        }
        Ok(())
    }

    /// Checks what depends on the model: every `logit_bias` id must be below `vocab` (the
    /// logits' width). [`Error::InvalidParameter`] names the first that is not.
    pub fn check_vocab(&self, vocab: usize) -> Result<()> {
        match self.logit_bias.iter().find(|&&(id, _)| id as usize >= vocab) {
            Some(&(id, _)) => {
                Err(invalid(format!("logit_bias names token {id}, but the vocabulary has {vocab} tokens")))
            }
            None => Ok(()),
        }
    }

    /// Whether the presence or frequency penalty is on.
    pub fn penalizes_generated(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// Whether decoding is greedy (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Whether a token is the argmax of the logits as the model gives them: greedy, with no
    /// logit bias and no penalty changing them first.
    pub fn takes_argmax_of_logits(&self) -> bool {
        self.is_greedy() && self.logit_bias.is_empty() && !self.penalizes_generated() && self.repetition_penalty == 1.0
    }
}

fn invalid(msg: String) -> Error {
    Error::InvalidParameter(msg)
}

fn check_temperature(t: f32) -> Result<()> {
    if !(t.is_finite() && t >= 0.0) {
        return Err(invalid(format!("temperature must be finite and >= 0, got {t}")));
    }
    if t > 0.0 && !(1.0 / t).is_finite() {
        return Err(invalid(format!("temperature {t} is too small to invert; use 0 for greedy decoding")));
    }
    Ok(())
}

fn check_top_p(p: f32) -> Result<()> {
    if !(p > 0.0 && p <= 1.0) {
        return Err(invalid(format!("top_p must be in (0, 1] (1 = off), got {p}")));
    }
    Ok(())
}

fn check_min_p(p: f32) -> Result<()> {
    if !(0.0..1.0).contains(&p) {
        return Err(invalid(format!("min_p must be in [0, 1) (0 = off), got {p}")));
    }
    Ok(())
}

fn check_min_tokens_to_keep(n: usize) -> Result<()> {
    if n < 1 {
        return Err(invalid("min_tokens_to_keep must be at least 1, got 0".into()));
    }
    Ok(())
}

fn check_repetition_penalty(p: f32) -> Result<()> {
    if !(p.is_finite() && p > 0.0) {
        return Err(invalid(format!("repetition_penalty must be finite and > 0 (1 = off), got {p}")));
    }
    Ok(())
}

fn check_repetition_context(n: usize) -> Result<()> {
    if n < 1 {
        return Err(invalid("repetition_context must be at least 1, got 0".into()));
    }
    Ok(())
}

fn check_bias(id: u32, bias: f32) -> Result<()> {
    if bias.is_nan() || bias == f32::INFINITY {
        return Err(invalid(format!("logit_bias for token {id} must not be NaN or +inf, got {bias}")));
    }
    Ok(())
}

/// The size of the last axis (the vocabulary) of a logits-like array.
fn vocab_size(a: &Array, what: &str) -> Result<usize> {
    match a.shape().last() {
        Some(&v) if v > 0 => Ok(v as usize),
        _ => Err(invalid(format!("{what} must have a non-empty last (vocabulary) axis, got shape {:?}", a.shape()))),
    }
}

/// An int32 index array of shape `[1, .., 1, n]` (rank of `a`) broadcast to `a`'s leading dimensions,
/// as `put_along_axis` / `take_along_axis` along the last axis want.
fn last_axis_indices(a: &Array, ids: &[i32]) -> Result<Array> {
    let idx = Array::from_slice(ids, &[ids.len() as i32])?;
    let mut shape = a.shape().to_vec();
    *shape.last_mut().expect("rank >= 1 checked by vocab_size") = ids.len() as i32;
    Ok(idx.broadcast_to(&shape)?)
}

fn neg_inf(dtype: Dtype) -> Result<Array> {
    Ok(Array::scalar_as(f64::NEG_INFINITY, dtype)?)
}

/// `logits - logsumexp(logits)` along the last axis: log-probabilities that sum to 1 in probability
/// space.
pub fn log_softmax(logits: &Array) -> Result<Array> {
    if crate::nn::cpu_fast::applies(logits) && logits.dtype() == Dtype::Float32 && logits.ndim() >= 1 {
        // The same arithmetic as one CPU primitive (see `cpu_fast::log_softmax`).
        return Ok(crate::nn::cpu_fast::log_softmax(logits)?);
    }
    Ok((logits - logits.logsumexp(-1, true)?)?)
}

/// Adds `bias` to the logits of the given token ids (along the last axis); an id listed twice gets
/// both biases. A bias of `-inf` bans a token.
///
/// Errors: an id at or past the vocabulary size, or a NaN / `+inf` bias.
pub fn apply_logit_bias(logits: &Array, bias: &[(u32, f32)]) -> Result<Array> {
    let vocab = vocab_size(logits, "logits")?;
    if bias.is_empty() {
        return Ok(logits.clone());
    }
    let mut ids = Vec::with_capacity(bias.len());
    let mut values = Vec::with_capacity(bias.len());
    for &(id, b) in bias {
        check_bias(id, b)?;
        if id as usize >= vocab {
            return Err(invalid(format!("logit_bias names token {id}, but the vocabulary has {vocab} tokens")));
        }
        ids.push(id as i32);
        values.push(b);
    }
    let idx = last_axis_indices(logits, &ids)?;
    let vals = Array::from_slice(&values, &[values.len() as i32])?.astype(logits.dtype())?.broadcast_to(idx.shape())?;
    Ok(ops::scatter_add_axis(logits, &idx, &vals, -1)?)
}

/// The repetition penalty of CTRL as mlx-lm applies it: each distinct token among the last `context`
/// ids of `history` has its logit `x` replaced by `x * penalty` when `x < 0` and `x / penalty`
/// otherwise (once, however often it occurs). `penalty = 1` or an empty history changes nothing.
///
/// Errors: `penalty` not finite or `<= 0`, `context == 0`, or a history id in the window at or past
/// the vocabulary size.
pub fn apply_repetition_penalty(logits: &Array, history: &[u32], penalty: f32, context: usize) -> Result<Array> {
    check_repetition_penalty(penalty)?;
    check_repetition_context(context)?;
    let vocab = vocab_size(logits, "logits")?;
    let window = &history[history.len().saturating_sub(context)..];
    if window.is_empty() || penalty == 1.0 {
        return Ok(logits.clone());
    }
    let mut ids: Vec<u32> = window.to_vec();
    ids.sort_unstable();
    ids.dedup();
    if let Some(&bad) = ids.last().filter(|&&id| id as usize >= vocab) {
        return Err(invalid(format!("history holds token {bad}, but the vocabulary has {vocab} tokens")));
    }
    let ids: Vec<i32> = ids.into_iter().map(|id| id as i32).collect();
    let idx = last_axis_indices(logits, &ids)?;
    let selected = ops::take_along_axis(logits, &idx, Some(-1))?;
    let zero = Array::scalar_as(0.0, logits.dtype())?;
    let penalised = ops::r#where(&selected.less(&zero)?, &(&selected * penalty)?, &(&selected / penalty)?)?;
    Ok(ops::put_along_axis(logits, &idx, &penalised, Some(-1))?)
}

/// Nucleus (top-p) filter on log-probabilities: keeps the smallest set of most probable tokens whose
/// probabilities add up to at least `top_p`, and sets the others to `-inf`.
///
/// As in mlx-lm, a token survives when the cumulative probability of the ascending sort, up to and
/// including it, is `> 1 - top_p` — i.e. when the tokens more probable than it hold less than `top_p`.
/// A set that reaches exactly `top_p` is therefore complete. The most probable token is always kept.
/// `top_p = 1` returns the input unchanged.
///
/// Errors: `top_p` outside `(0, 1]`.
pub fn apply_top_p(logprobs: &Array, top_p: f32) -> Result<Array> {
    check_top_p(top_p)?;
    vocab_size(logprobs, "logprobs")?;
    if top_p >= 1.0 {
        return Ok(logprobs.clone());
    }
    let probs = logprobs.exp()?;
    let order = ops::argsort(logprobs, Some(-1))?;
    let sorted = ops::take_along_axis(&probs, &order, Some(-1))?;
    let cumulative = ops::cumsum(&sorted, Some(-1), false, true)?;
    // Back to vocabulary order: position order[i] receives cumulative[i].
    let cumulative = ops::put_along_axis(&ops::zeros_like(&cumulative)?, &order, &cumulative, Some(-1))?;
    let threshold = Array::scalar_as(1.0 - top_p as f64, cumulative.dtype())?;
    // The most probable token always survives, even when rounding leaves the total below 1 - top_p
    // for a tiny top_p (mlx-lm would then drop every token).
    let is_top = logprobs.greater_equal(&logprobs.max(-1, true)?)?;
    let keep = cumulative.greater(&threshold)?.logical_or(&is_top)?;
    Ok(ops::r#where(&keep, logprobs, &neg_inf(logprobs.dtype())?)?)
}

/// Min-p filter on log-probabilities: drops (sets to `-inf`) every token whose probability is below
/// `min_p` times the largest probability, i.e. whose log-probability is `< max + ln(min_p)`; the
/// `min_tokens_to_keep` most probable tokens always survive. `min_p = 0` returns the input unchanged.
///
/// Errors: `min_p` outside `[0, 1)`, `min_tokens_to_keep == 0`.
pub fn apply_min_p(logprobs: &Array, min_p: f32, min_tokens_to_keep: usize) -> Result<Array> {
    check_min_p(min_p)?;
    check_min_tokens_to_keep(min_tokens_to_keep)?;
    let vocab = vocab_size(logprobs, "logprobs")?;
    if min_p == 0.0 || min_tokens_to_keep >= vocab {
        return Ok(logprobs.clone());
    }
    let top = logprobs.max(-1, true)?;
    let threshold = (&top + Array::scalar_as((min_p as f64).ln(), logprobs.dtype())?)?;
    let mut remove = logprobs.less(&threshold)?;
    if min_tokens_to_keep > 1 {
        let keep = min_tokens_to_keep as i32;
        let v = vocab as i32;
        let top_idx = ops::argpartition(logprobs, v - keep, Some(-1))?.slice_axis(-1, v - keep, v, 1)?;
        remove = ops::put_along_axis(&remove, &top_idx, &Array::scalar(false), Some(-1))?;
    }
    Ok(ops::r#where(&remove, &neg_inf(logprobs.dtype())?, logprobs)?)
}

/// The `k` most likely tokens of each row of `logprobs: [rows, vocab]`, in no particular order:
/// their ids `[rows, k]` (uint32) and log-probabilities `[rows, k]`. `k` must be in `1..=vocab`.
pub fn top_candidates(logprobs: &Array, k: i32) -> Result<(Array, Array)> {
    let ids = ops::argpartition(&logprobs.negative()?, k - 1, Some(-1))?.slice_axis(-1, 0, k, 1)?;
    let values = ops::take_along_axis(logprobs, &ids, Some(-1))?;
    Ok((ids.astype(Dtype::Uint32)?, values))
}

/// `(id, log-probability)` pairs most likely first, ties by id.
pub fn sort_candidates(row: &mut [(u32, f32)]) {
    row.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
}

/// Top-k filter on log-probabilities: keeps the `k` largest entries and sets the others to `-inf`
/// (among equal values at the boundary, which ones survive is unspecified). `k` at or above the
/// vocabulary size returns the input unchanged.
///
/// Errors: `k == 0`.
pub fn apply_top_k(logprobs: &Array, k: usize) -> Result<Array> {
    if k == 0 {
        return Err(invalid("top_k must be at least 1 (0 = off in SamplerConfig)".into()));
    }
    let vocab = vocab_size(logprobs, "logprobs")?;
    if k >= vocab {
        return Ok(logprobs.clone());
    }
    let (k, v) = (k as i32, vocab as i32);
    let negated = logprobs.negative()?;
    let drop = ops::argpartition(&negated, k - 1, Some(-1))?.slice_axis(-1, k, v, 1)?;
    Ok(ops::put_along_axis(logprobs, &drop, &neg_inf(logprobs.dtype())?, Some(-1))?)
}

/// A seed from the clock, distinct for samplers made in the same instant.
/// The presence and frequency penalties of the `generated` ids as logit biases: each distinct id
/// gets `-(presence + frequency · count)`.
pub fn generation_penalties(generated: &[u32], presence: f32, frequency: f32) -> Vec<(u32, f32)> {
    let mut counts = std::collections::BTreeMap::new();
    for &id in generated {
        *counts.entry(id).or_insert(0u32) += 1;
    }
    counts.into_iter().map(|(id, n)| (id, -(presence + frequency * n as f32))).collect()
}

fn clock_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    // splitmix64 finaliser over time + counter.
    let mut z = nanos ^ COUNTER.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The sampling chain of one sequence: logit processors, log-probabilities, filters and the draw.
///
/// The sampler owns an MLX PRNG key, seeded from [`SamplerConfig::seed`] (or the clock) and split
/// for every random draw, so two samplers with the same seed and inputs draw the same tokens. It does
/// not touch MLX's global random state.
///
/// ```
/// use rmlx::Array;
/// use rmlx_lm::sample::{Sampler, SamplerConfig};
///
/// let logits = Array::from_slice(&[1.0f32, 3.0, 2.0, -1.0], &[1, 4])?;
///
/// // Greedy (the default): the argmax.
/// let mut greedy = Sampler::new(SamplerConfig::default())?;
/// let (token, logprobs) = greedy.sample(&logits, &[])?;
/// assert_eq!(token.to_vec::<u32>()?, vec![1]);
/// assert_eq!(logprobs.shape(), &[1, 4]);
///
/// // Temperature sampling restricted to the two most likely tokens, reproducible by seed.
/// let cfg = SamplerConfig { temperature: 0.7, top_k: 2, seed: Some(7), ..Default::default() };
/// let mut sampler = Sampler::new(cfg)?;
/// let history = [5u32, 1, 2];
/// let (token, _) = sampler.sample(&logits, &history)?;
/// assert!([1, 2].contains(&token.item::<u32>()?));
/// # Ok::<(), rmlx_lm::Error>(())
/// ```
pub struct Sampler {
    cfg: SamplerConfig,
    seed: u64,
    key: Array,
    /// How many leading ids of the history are the prompt (not counted by the presence and
    /// frequency penalties).
    prompt_len: usize,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler").field("cfg", &self.cfg).field("seed", &self.seed).finish_non_exhaustive()
    }
}

impl Sampler {
    /// Validates `cfg` and seeds the key.
    pub fn new(cfg: SamplerConfig) -> Result<Sampler> {
        cfg.validate()?;
        let seed = cfg.seed.unwrap_or_else(clock_seed);
        Ok(Sampler { cfg, seed, key: random::key(seed)?, prompt_len: 0 })
    }

    /// The configuration.
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// The seed in use (the configured one, or the one drawn from the clock), to reproduce a run.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Restarts the random stream from `seed`.
    pub fn reseed(&mut self, seed: u64) -> Result<()> {
        self.key = random::key(seed)?;
        self.seed = seed;
        Ok(())
    }

    /// Samples the next token.
    ///
    /// `logits`: the float logits of the last position, shape `[1, vocab]` or `[vocab]` (any float
    /// dtype; computed in float32). `history`: the token ids so far (prompt + generated); the repetition
    /// penalty looks at its last `repetition_context` ids.
    ///
    /// Returns `(token, logprobs)`: the token id as a **uint32** array of shape `[1]`, and the
    /// **float32** log-probabilities `[1, vocab]` of the processed distribution (log-softmax of the
    /// logits after bias and repetition penalty, before temperature and filtering — mlx-lm's
    /// `logprobs`). Both are lazy.
    ///
    /// Errors ([`Error::InvalidParameter`]): another shape, or a bias / history id outside the
    /// vocabulary.
    pub fn sample(&mut self, logits: &Array, history: &[u32]) -> Result<(Array, Array)> {
        let logprobs = self.logprobs(logits, history)?;
        let token = self.sample_logprobs(&logprobs)?;
        Ok((token, logprobs))
    }

    /// Steps 1 and 2 of the chain: the processed log-probabilities `[1, vocab]` (float32) that
    /// [`Sampler::sample`] returns.
    pub fn logprobs(&self, logits: &Array, history: &[u32]) -> Result<Array> {
        let shape = logits.shape();
        let vocab = match *shape {
            [v] | [1, v] if v > 0 => v,
            _ => {
                return Err(invalid(format!("sampler logits must have shape [1, vocab] or [vocab], got {shape:?}")));
            }
        };
        let mut x = logits.reshape(&[1, vocab])?.astype(Dtype::Float32)?;
        x = apply_logit_bias(&x, &self.cfg.logit_bias)?;
        if self.cfg.penalizes_generated() {
            let generated = &history[self.prompt_len.min(history.len())..];
            x = apply_logit_bias(
                &x,
                &generation_penalties(generated, self.cfg.presence_penalty, self.cfg.frequency_penalty),
            )?;
        }
        if self.cfg.repetition_penalty != 1.0 {
            x = apply_repetition_penalty(&x, history, self.cfg.repetition_penalty, self.cfg.repetition_context)?;
        }
        log_softmax(&x)
    }

    /// Step 3 of the chain: a token (uint32, shape `[1]` for `[1, vocab]` input) from
    /// log-probabilities, by argmax at temperature 0, else by the filters and a categorical draw.
    /// Advances the key when it draws.
    pub fn sample_logprobs(&mut self, logprobs: &Array) -> Result<Array> {
        if self.cfg.is_greedy() {
            return Ok(logprobs.argmax(Some(-1), false)?.astype(Dtype::Uint32)?);
        }
        let scaled = self.filtered(logprobs)?;
        self.draw(&scaled)
    }

    /// The filters and the temperature over log-probabilities: the unnormalised log-weights the
    /// draw of [`Sampler::sample_logprobs`] uses (not at temperature 0).
    fn filtered(&self, logprobs: &Array) -> Result<Array> {
        let cfg = &self.cfg;
        let mut x = logprobs.clone();
        if cfg.top_p < 1.0 {
            x = apply_top_p(&x, cfg.top_p)?;
        }
        if cfg.min_p > 0.0 {
            x = apply_min_p(&x, cfg.min_p, cfg.min_tokens_to_keep)?;
        }
        if cfg.top_k > 0 {
            x = apply_top_k(&x, cfg.top_k)?;
        }
        Ok((&x * (1.0 / cfg.temperature))?)
    }

    /// The probabilities (`[.., vocab]`, float32, summing to 1) that [`Sampler::sample_logprobs`]
    /// draws from, given [`Sampler::logprobs`]' output: the filters and the temperature applied;
    /// at temperature 0, all on the argmax.
    pub fn distribution(&self, logprobs: &Array) -> Result<Array> {
        if self.cfg.is_greedy() {
            let vocab = *logprobs.shape().last().expect("a vocabulary axis");
            let best = logprobs.argmax(Some(-1), false)?;
            return Ok(rmlx::ops::one_hot(&best, vocab, Dtype::Float32)?);
        }
        Ok(rmlx::ops::softmax(&self.filtered(logprobs)?, [-1], true)?)
    }

    /// A token drawn from unnormalised log-weights `[1, vocab]` (uint32 `[1]`), with the next key.
    pub fn draw(&mut self, log_weights: &Array) -> Result<Array> {
        let key = self.next_key()?;
        Ok(random::categorical(log_weights, -1, None, Some(&key))?.astype(Dtype::Uint32)?)
    }

    /// `n` numbers drawn uniformly from [0, 1), with the next key.
    pub fn uniforms(&mut self, n: usize) -> Result<Vec<f32>> {
        let key = self.next_key()?;
        Ok(random::uniform(0.0, 1.0, &[n as i32], Dtype::Float32, Some(&key))?.to_vec::<f32>()?)
    }

    /// Splits the key: one half is kept for later draws, the other is returned for this one.
    /// Says that the first `n` ids of the histories given to [`Sampler::logprobs`] are the prompt.
    pub fn set_prompt_len(&mut self, n: usize) {
        self.prompt_len = n;
    }

    fn next_key(&mut self) -> Result<Array> {
        let keys = random::split(&self.key, 2)?;
        self.key = keys.take(&Array::scalar(0i32), Some(0))?;
        Ok(keys.take(&Array::scalar(1i32), Some(0))?)
    }
}
