//! Continuous batching: many requests decoded together, joining and leaving the batch at token
//! boundaries. What `rmlx serve` and `rmlx batch` run.
//!
//! Each [`Engine::step`] spends up to [`EngineOptions::prefill_tokens`] prompt tokens on the
//! requests waiting to start (up to [`EngineOptions::prefill_batch`] short prompts together in one
//! forward pass, or a long prompt alone over several steps), then decodes one token for every
//! running sequence in a single forward pass. A sequence whose prompt is done joins the running
//! batch (`crate::cache::BatchCache`); one that ends leaves it, its keys and values kept in the
//! [`PromptCache`] for later prompts that begin the same way.
//! Every sequence samples with its own settings and its own random key, so a seeded request gives
//! the same tokens alone or in a batch, up to rounding: a sequence batched with a longer one is
//! padded, its attention then sums in another order, and a token's log-probability may differ by
//! ~3e-5 (so a draw, or a greedy choice, that close to a tie between two tokens can go either
//! way); batched with sequences no longer than itself, it decodes bit for bit as alone.
//! A request may name a LoRA adapter loaded into the engine ([`Engine::load_adapter`]): the batch
//! mixes adapters row by row over the one base model ([`crate::nn::AdapterBank`]). With
//! speculative decoding ([`Engine::with_speculation`]), a step drafts tokens for the running
//! sequences and checks them all in its one forward pass.
//!
//! ```
//! # fn main() -> rmlx_lm::Result<()> {
//! use rmlx_lm::engine::{Engine, EngineOptions, Request, Update};
//! use rmlx_lm::GenerateOptions;
//! let lm = rmlx_lm::loader::load(rmlx_lm::registry::default_model()?, &Default::default())?;
//! let mut engine = Engine::new(&lm, EngineOptions::default());
//! let options = GenerateOptions { max_tokens: 4, ..Default::default() };
//! for text in ["The capital of France is", "One, two, three,"] {
//!     let prompt = lm.encode_prompt(text, true, None)?;
//!     engine.submit(Request { prompt, options: options.clone(), ..Default::default() })?;
//! }
//! let mut finished = 0;
//! while !engine.is_idle() {
//!     for update in engine.step()? {
//!         if let Update::Finished { usage, .. } = update {
//!             assert_eq!(usage.completion_tokens, 4);
//!             finished += 1;
//!         }
//!     }
//! }
//! assert_eq!(finished, 2);
//! # Ok(()) }
//! ```

mod budget;
mod lockstep;
mod prefill;
mod prompt_cache;
mod prompt_disk;
mod sampling;
mod sequence;
mod speculate;
mod warm_up;

pub use budget::{device_kv_budget, kv_budget};
pub use lockstep::Lockstep;
pub use prompt_cache::PromptCache;
pub use prompt_disk::{DiskTier, PromptCacheDir};

use crate::cache::{with_lone_caches, BatchCache, KvCache};
use crate::generate::{ids_array, FinishReason, GenerateOptions};
use crate::grammar::{Grammar, GrammarCompiler};
use crate::loader::LoadedModel;
use crate::nn::{with_row_adapters, AdapterBank, Lora};
use crate::speculative::Speculation;
use crate::{Error, Result};
use prefill::Prefill;
use rmlx::{ops, Dtype};
use sampling::{sample_rows, Sampled};
use sequence::Sequence;
use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

/// Bytes of freed buffers MLX may keep for reuse before the engine gives them back.
const CACHE_SLACK: usize = 4 << 30;

/// A request's handle in the engine.
pub type SeqId = u64;

/// How the engine batches and what it may hold.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Most sequences decoded together; more wait.
    pub max_batch: usize,
    /// Prompt tokens computed per step, before the step's decoding: bounds how long running
    /// sequences wait for a newcomer's prompt.
    pub prefill_tokens: usize,
    /// Most newcomers whose prompts are computed together in one forward pass (padded on the
    /// left to end together, within [`EngineOptions::prefill_tokens`] padded tokens); 1: one
    /// sequence at a time. A prompt longer than the budget is computed alone over several steps.
    pub prefill_batch: usize,
    /// Bytes of the prompt cache (0: off).
    pub prompt_cache_bytes: usize,
    /// Bytes the running batch's keys and values may take, a draft model's included (`None`:
    /// unbounded). A request that would pass it waits; one that cannot fit even alone is refused
    /// at [`Engine::submit`].
    pub max_kv_bytes: Option<usize>,
    /// Positions a sequence may reach (prompt plus generated tokens); `None`: the model's
    /// `max_position_embeddings`.
    pub context: Option<usize>,
    /// With speculative decoding ([`Engine::with_speculation`]): the most running sequences a
    /// step drafts for; a larger batch takes plain steps (verifying drafts costs more than it
    /// saves once the batch keeps the device busy).
    pub speculative_max_batch: usize,
    /// Build each decoding step on the tokens still in flight, as mlx-lm does. Off by default:
    /// on an H100 (qwen3-0.6b, 32 streams) it gave 935 tokens/s against 2,163 for the step that
    /// waits for its tokens, because of the evaluation thread's hand-off (level, 2,273 against
    /// 2,301, with `RMLX_EVAL_THREAD=0`; BENCHMARKS.md).
    pub pipelined: bool,
    /// Keep the batch's keys and values quantised (`--kv-bits`) once it has written
    /// [`KvQuantization::start`] positions (from the start: every batch). The memory accounting
    /// ([`EngineOptions::max_kv_bytes`]) counts packed bytes where quantisation starts at 0 and
    /// full-precision ones otherwise (an upper bound).
    pub kv_quantization: Option<crate::cache::KvQuantization>,
    /// A directory the prompt cache spills to, with its own byte budget (`None`: memory only);
    /// see [`DiskTier`].
    pub prompt_cache_dir: Option<PromptCacheDir>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_batch: 32,
            prefill_tokens: 2048,
            prefill_batch: 8,
            prompt_cache_bytes: 1 << 30,
            max_kv_bytes: None,
            context: None,
            speculative_max_batch: 8,
            pipelined: false,
            kv_quantization: None,
            prompt_cache_dir: None,
        }
    }
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct Request {
    /// Token ids of the prompt.
    pub prompt: Vec<u32>,
    /// Token budget, sampling, stop strings (`prefill_chunk` and `context_limit` are the
    /// engine's: [`EngineOptions`]).
    pub options: GenerateOptions,
    /// How many of the most likely tokens to report beside each sampled one (0: none).
    pub top_logprobs: usize,
    /// The name of a LoRA adapter loaded with [`Engine::load_adapter`] to generate with
    /// (`None`: the base model).
    pub adapter: Option<String>,
    /// A grammar the output must follow (structured output), enforced during sampling.
    pub grammar: Option<Grammar>,
    /// Whether an engine with speculative decoding ([`Engine::with_speculation`]) may draft for
    /// it (default: yes). Greedy output is the same either way; sampled output is distributed
    /// the same.
    pub speculative: bool,
}

impl Default for Request {
    fn default() -> Self {
        Request {
            prompt: Vec::new(),
            options: GenerateOptions::default(),
            top_logprobs: 0,
            adapter: None,
            grammar: None,
            speculative: true,
        }
    }
}

/// Token counts and timing of a finished request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Prompt tokens whose keys and values came from the prompt cache.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// From submission to the first sampled token.
    pub time_to_first_token: Option<Duration>,
    /// With speculative decoding: tokens drafted for the request, and those the model kept.
    pub draft_tokens: usize,
    pub accepted_draft_tokens: usize,
}

/// What a step produced for one request.
#[derive(Debug)]
pub enum Update {
    /// The prompt starts being computed (`cached_tokens` of it come from the prompt cache).
    Started { seq: SeqId, prompt_tokens: usize, cached_tokens: usize },
    /// A sampled token, the text it completes (possibly empty), its log-probability and, when
    /// asked for, the most likely tokens with theirs.
    Token { seq: SeqId, id: u32, text: String, logprob: f32, top: Vec<(u32, f32)> },
    /// Text held back until the end (an incomplete character, a possible stop string).
    Text { seq: SeqId, text: String },
    /// The request ended; nothing more comes for it.
    Finished { seq: SeqId, reason: FinishReason, usage: Usage },
    /// The request failed (its logits overflowed, or its grammar refused the sampled token);
    /// nothing more comes for it. The other requests go on.
    Failed { seq: SeqId, error: Error },
}

/// The batch scheduler: owns the running sequences' caches; not thread-safe (MLX work stays on
/// the thread that calls [`Engine::step`]).
pub struct Engine<'m> {
    lm: &'m LoadedModel,
    opts: EngineOptions,
    next_id: SeqId,
    waiting: VecDeque<Sequence>,
    prefill: Option<Prefill>,
    running: Vec<Sequence>,
    /// One per layer, a row per running sequence.
    caches: Vec<KvCache>,
    windows: Vec<Option<usize>>,
    cancelled: HashSet<SeqId>,
    /// The decoding step being computed: tokens for the first rows of `running`.
    inflight: Option<Sampled>,
    prompt_cache: PromptCache,
    context: usize,
    /// Bytes of one position's keys and values in one layer.
    kv_bytes_per_layer_position: usize,
    adapters: AdapterBank,
    /// Made for the first request with a grammar.
    grammars: Option<GrammarCompiler>,
    /// Speculative decoding ([`Engine::with_speculation`]).
    speculation: Option<Speculation<'m>>,
    /// The draft model's caches: one per layer, a row per running sequence.
    draft_caches: Vec<KvCache>,
    /// The draft model's layers' windows and bytes of one position in one layer, which the keys
    /// and values' budget counts beside the model's.
    draft_kv: Option<(Vec<Option<usize>>, usize)>,
}

impl<'m> Engine<'m> {
    pub fn new(lm: &'m LoadedModel, opts: EngineOptions) -> Engine<'m> {
        let cfg = lm.model.config();
        let windows = lm.layer_windows();
        let context = opts.context.or(cfg.max_position_embeddings).unwrap_or(crate::cache::MAX_POSITIONS);
        let kv_bytes_per_layer_position = match &opts.kv_quantization {
            Some(q) if q.start == 0 => q.packed_bytes(lm.kv_bytes_per_layer_position(), lm.dtype),
            _ => lm.kv_bytes_per_layer_position(),
        };
        let prompt_cache = match &opts.prompt_cache_dir {
            None => PromptCache::new(opts.prompt_cache_bytes),
            Some(dir) => match disk_tier(lm, dir, &windows, opts.kv_quantization) {
                Ok(disk) => PromptCache::with_disk(opts.prompt_cache_bytes, disk),
                Err(err) => {
                    tracing::warn!(%err, dir = %dir.dir.display(), "the prompt cache stays in memory");
                    PromptCache::new(opts.prompt_cache_bytes)
                }
            },
        };
        Engine {
            lm,
            prompt_cache,
            opts,
            next_id: 0,
            waiting: VecDeque::new(),
            prefill: None,
            running: Vec::new(),
            caches: windows.iter().map(|&w| KvCache::Batch(BatchCache::new(0, w))).collect(),
            kv_bytes_per_layer_position,
            windows,
            cancelled: HashSet::new(),
            inflight: None,
            context,
            adapters: AdapterBank::new(lm.dtype),
            grammars: None,
            speculation: None,
            draft_caches: Vec::new(),
            draft_kv: None,
        }
    }

    /// Loads a LoRA adapter (layer name → factors, as [`crate::tuner::adapters::read`] returns
    /// them) under `name`, for requests that name it; the base model is untouched.
    pub fn load_adapter(&mut self, name: &str, layers: HashMap<String, Lora>) -> Result<()> {
        self.adapters.insert(name, layers).map(drop)
    }

    /// Reads the adapter folder `dir` (mlx-lm's or PEFT's layout: see
    /// [`crate::tuner::adapters::read`]) and loads it under `name`, as
    /// [`Engine::load_adapter`] does; a split model's rank reads its share of it.
    pub fn load_adapter_dir(&mut self, name: &str, dir: &std::path::Path) -> Result<()> {
        let layers = crate::tuner::adapters::read(self.lm.model.as_ref(), dir, self.lm.dtype)?;
        self.load_adapter(name, layers)
    }

    /// Unloads the adapter `name`. Refused while a request that names it waits or runs.
    pub fn unload_adapter(&mut self, name: &str) -> Result<()> {
        let slot =
            self.adapters.slot(name).ok_or_else(|| Error::InvalidParameter(format!("no adapter named `{name}`")))?;
        let mut all = self.running.iter().chain(self.waiting.iter()).chain(self.prefill.as_ref().map(|p| &p.seq));
        if all.any(|s| s.adapter == slot) {
            return Err(Error::InvalidParameter(format!("the adapter `{name}` is in use by a running request")));
        }
        self.adapters.remove(name)?;
        self.prompt_cache.forget(slot);
        Ok(())
    }

    /// The loaded adapters' names.
    pub fn adapter_names(&self) -> Vec<String> {
        self.adapters.names()
    }

    /// Queues a request; its updates come from later [`Engine::step`]s.
    ///
    /// Errors: [`Error::Prompt`] for an empty prompt, one with an id the model has no embedding
    /// for, one that leaves no room in the context, or one whose keys and values cannot fit in
    /// [`EngineOptions::max_kv_bytes`]; [`Error::InvalidParameter`] for bad sampler settings, an
    /// adapter that is not loaded or a grammar that does not compile.
    pub fn submit(&mut self, request: Request) -> Result<SeqId> {
        let adapter = match &request.adapter {
            Some(name) => self
                .adapters
                .slot(name)
                .ok_or_else(|| Error::InvalidParameter(format!("no adapter named `{name}` is loaded")))?,
            None => 0,
        };
        let n = request.prompt.len();
        if n == 0 {
            return Err(Error::Prompt("the prompt is empty".into()));
        }
        self.lm.vocab.check(&request.prompt)?;
        request.options.sampler.validate()?;
        request.options.sampler.check_vocab(self.lm.model.config().vocab_size as usize)?;
        if request.options.max_tokens == 0 {
            return Err(Error::InvalidParameter("max_tokens must be at least 1".into()));
        }
        let max_tokens = request.options.max_tokens.min(crate::generate::room_after_prompt(n, self.context)?);
        if let Some(limit) = self.opts.max_kv_bytes {
            let need = self.kv_bytes_for(1, n + max_tokens);
            if need > limit {
                return Err(Error::Prompt(format!(
                    "{n} prompt tokens and {max_tokens} to generate need {} of keys and values; the limit is {}",
                    human_bytes(need),
                    human_bytes(limit)
                )));
            }
        }
        let id = self.next_id;
        let constraint = match &request.grammar {
            Some(g) => {
                if self.grammars.is_none() {
                    self.grammars = Some(GrammarCompiler::new(self.lm)?);
                }
                Some(self.grammars.as_ref().expect("made above").compile(g)?)
            }
            None => None,
        };
        let seq = Sequence::new(self.lm, id, request, max_tokens, adapter, constraint)?;
        self.next_id += 1;
        self.waiting.push_back(seq);
        Ok(id)
    }

    /// Ends request `seq` at the next step (its keys and values are freed then).
    pub fn cancel(&mut self, seq: SeqId) {
        self.cancelled.insert(seq);
    }

    /// Whether no request is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.prefill.is_none() && self.running.is_empty()
    }

    /// Sequences decoding, and requests not started yet (including the one being prefilled).
    pub fn load(&self) -> (usize, usize) {
        (self.running.len(), self.waiting.len() + usize::from(self.prefill.is_some()))
    }

    /// The prompt cache's bytes and entries.
    pub fn prompt_cache_usage(&self) -> (usize, usize) {
        (self.prompt_cache.bytes(), self.prompt_cache.len())
    }

    /// Puts the caches of a prompt's `tokens` (one a layer, one sequence's: a prompt-cache
    /// file's) in the prompt cache, so that prompts beginning with them reuse them (as the
    /// base model's; packed or unpacked as this engine keeps its keys and values). Returns
    /// whether they were kept (not when larger than the prompt cache's budget).
    pub fn seed_prompt_cache(&mut self, tokens: Vec<u32>, caches: &[KvCache]) -> Result<bool> {
        if caches.len() != self.windows.len() {
            return Err(Error::InvalidParameter(format!("{} caches for {} layers", caches.len(), self.windows.len())));
        }
        let (mut layers, mut min_reuse) = (Vec::with_capacity(caches.len()), 0);
        for (c, window) in caches.iter().zip(&self.windows) {
            let row = c.held_rows()?.ok_or_else(|| Error::InvalidParameter("an empty cache".into()))?;
            if row.start + row.len() != tokens.len() {
                return Err(Error::InvalidParameter(format!(
                    "caches of {} positions for {} tokens",
                    row.start + row.len(),
                    tokens.len()
                )));
            }
            if let (true, Some(w)) = (row.start > 0, window) {
                min_reuse = min_reuse.max(row.start + w - 1);
            }
            let q = self.opts.kv_quantization.filter(|q| q.start == 0);
            let convert = |s: &crate::cache::Stored| -> Result<crate::cache::Stored> {
                Ok(match (s, &q) {
                    (crate::cache::Stored::Plain(_), Some(q)) => s.packed(q)?,
                    (crate::cache::Stored::Packed(_), None) => crate::cache::Stored::Plain(s.unpacked(self.lm.dtype)?),
                    _ => s.clone(),
                })
            };
            layers.push(crate::cache::RowKv {
                keys: convert(&row.keys)?,
                values: convert(&row.values)?,
                start: row.start,
            });
        }
        rmlx::eval(layers.iter().flat_map(|l| l.keys.arrays().into_iter().chain(l.values.arrays())))?;
        Ok(self.prompt_cache.insert(0, tokens, layers, min_reuse))
    }

    /// Files of the prompt cache's directory and their bytes (`None`: no
    /// [`EngineOptions::prompt_cache_dir`]).
    pub fn prompt_cache_disk_usage(&self) -> Option<(usize, u64)> {
        self.prompt_cache.disk_usage()
    }

    /// Bytes held by the running batch's keys and values.
    pub fn kv_bytes(&self) -> usize {
        let caches = self.caches.iter().chain(&self.draft_caches);
        caches.map(|c| if let KvCache::Batch(b) = c { b.nbytes() } else { 0 }).sum()
    }

    /// Prefills what the budget allows, then decodes one token for every running sequence.
    ///
    /// After an error the batch's state is not consistent: call [`Engine::abort`], which ends
    /// every request (each gets an [`Update::Finished`] with [`FinishReason::Cancelled`]).
    pub fn step(&mut self) -> Result<Vec<Update>> {
        let mut out = Vec::new();
        self.drop_cancelled(&mut out)?;
        let start = Instant::now();
        let prefilled = self.prefill_some(&mut out)?;
        let (prefill_time, rows) = (start.elapsed(), self.running.len());
        self.decode(&mut out)?;
        if prefilled > 0 || rows > 0 {
            tracing::debug!(
                prefill_tokens = prefilled,
                prefill_ms = prefill_time.as_secs_f64() * 1e3,
                decode_rows = rows,
                decode_ms = (start.elapsed() - prefill_time).as_secs_f64() * 1e3,
                waiting = self.waiting.len(),
                "engine step"
            );
        }
        Ok(out)
    }

    /// Ends every request (after an error): the updates that say so.
    pub fn abort(&mut self) -> Vec<Update> {
        let mut out = Vec::new();
        let all = self.running.drain(..).chain(self.prefill.take().map(|p| p.seq)).chain(self.waiting.drain(..));
        for mut s in all.collect::<Vec<_>>() {
            let _ = s.end(FinishReason::Cancelled, &mut out);
        }
        self.caches = self.windows.iter().map(|&w| KvCache::Batch(BatchCache::new(0, w))).collect();
        for c in &mut self.draft_caches {
            *c = KvCache::Batch(BatchCache::new(0, c.window()));
        }
        self.cancelled.clear();
        self.inflight = None;
        out
    }

    fn drop_cancelled(&mut self, out: &mut Vec<Update>) -> Result<()> {
        if self.cancelled.is_empty() {
            return Ok(());
        }
        let cancelled = std::mem::take(&mut self.cancelled);
        let (mut gone, waiting): (Vec<_>, Vec<_>) = self.waiting.drain(..).partition(|s| cancelled.contains(&s.id));
        self.waiting = waiting.into();
        for seq in &mut gone {
            seq.end(FinishReason::Cancelled, out)?;
        }
        if self.prefill.as_ref().is_some_and(|p| cancelled.contains(&p.seq.id)) {
            let mut p = self.prefill.take().expect("checked");
            p.seq.end(FinishReason::Cancelled, out)?;
        }
        let keep: Vec<usize> = (0..self.running.len()).filter(|&i| !cancelled.contains(&self.running[i].id)).collect();
        if keep.len() < self.running.len() {
            for s in self.running.iter_mut().filter(|s| cancelled.contains(&s.id)) {
                s.end(FinishReason::Cancelled, out)?;
            }
            self.keep_rows(&keep)?;
        }
        Ok(())
    }

    /// Whether `seq` can join the running batch without passing the key/value budget, counting
    /// every running sequence at its longest.
    fn fits(&self, seq: &Sequence, joining: usize) -> bool {
        let Some(limit) = self.opts.max_kv_bytes else { return true };
        let width = self.caches.iter().map(KvCache::offset).max().unwrap_or(0).max(seq.history.len());
        // Newcomers not joined yet are counted at this one's length and budget.
        let longest_rest = self.running.iter().chain([seq]).map(|s| s.max_tokens - s.generated).max().unwrap_or(0);
        self.kv_bytes_for(self.running.len() + joining + 1, width + longest_rest) <= limit
    }

    /// The most bytes of keys and values `rows` sequences of `positions` hold, the draft model's
    /// included: a windowed layer holds no more than [`BatchCache::held_bound`].
    fn kv_bytes_for(&self, rows: usize, positions: usize) -> usize {
        let update = self.opts.prefill_tokens.max(1);
        let held = |w: &Option<usize>| w.map_or(positions, |w| positions.min(BatchCache::held_bound(w, update)));
        let draft =
            self.draft_kv.as_ref().map_or(0, |(windows, bytes)| windows.iter().map(held).sum::<usize>() * bytes);
        rows * (self.windows.iter().map(held).sum::<usize>() * self.kv_bytes_per_layer_position + draft)
    }

    /// Decodes one token for every running sequence. With [`EngineOptions::pipelined`], the
    /// step's graph is built on the previous step's tokens before they are read, unless a
    /// sequence's sampling needs its history on the host (a repetition penalty); a sequence that
    /// ends was then computed one step too far, and that row is dropped.
    fn decode(&mut self, out: &mut Vec<Update>) -> Result<()> {
        let pipelined =
            self.opts.pipelined && self.speculation.is_none() && !self.running.iter().any(Sequence::processes_logits);
        if !pipelined {
            self.read_inflight(None, out)?;
        }
        if self.speculate(out)? {
            return Ok(());
        }
        if self.running.is_empty() {
            return Ok(());
        }
        let rows = self.running.len() as i32;
        let covered = self.inflight.as_ref().map_or(0, Sampled::rows);
        let host: Vec<u32> = self.running[covered..]
            .iter()
            .map(|s| s.next.expect("a sequence not in flight has its next token"))
            .collect();
        let host = ids_array(&host)?.reshape(&[-1])?;
        let ids = match &self.inflight {
            Some(prev) => ops::concatenate(&[&prev.tokens.astype(Dtype::Int32)?, &host], 0)?,
            None => host,
        };
        let slots: Vec<usize> = self.running.iter().map(|s| s.adapter).collect();
        let (model, caches, ids) = (&self.lm.model, &mut self.caches, ids.reshape(&[rows, 1])?);
        // A sequence alone decodes through standard caches, as `generate` does (captured on a GPU).
        let logits = with_lone_caches(caches, |caches| {
            with_row_adapters(&self.adapters, &slots, || model.logits(&model.forward_hidden(&ids, caches)?))
        })??;
        quantize_caches(caches, self.opts.kv_quantization.as_ref())?;
        let logits = logits.reshape(&[rows, -1])?;
        let mut next = sample_rows(self.lm, &mut self.running, &logits, &[])?;
        rmlx::async_eval(next.arrays().chain(self.caches.iter().flat_map(KvCache::state)))?;
        self.read_inflight(Some(&mut next), out)?;
        if pipelined {
            self.inflight = Some(next);
        } else {
            self.inflight = Some(next);
            self.read_inflight(None, out)?;
        }
        Ok(())
    }

    /// Reads the step in flight and hands its tokens to their sequences; the sequences that end
    /// leave the batch (and `newer`, a step built after it, loses their rows).
    fn read_inflight(&mut self, newer: Option<&mut Sampled>, out: &mut Vec<Update>) -> Result<()> {
        let Some(mut step) = self.inflight.take() else { return Ok(()) };
        let read = step.read()?;
        let mut errors = std::mem::take(&mut step.errors);
        for (i, seq) in self.running.iter_mut().enumerate().take(step.rows()) {
            if let Some(error) = errors[i].take() {
                seq.finish = Some(FinishReason::Cancelled);
                out.push(Update::Failed { seq: seq.id, error });
                continue;
            }
            if !read.finite[i] {
                seq.finish = Some(FinishReason::Cancelled);
                out.push(Update::Failed { seq: seq.id, error: non_finite(seq) });
                continue;
            }
            seq.accept(self.lm, read.tokens[i], read.logprobs[i], read.top(i), out)?;
        }
        self.retire_ended(newer)
    }

    /// The sequences that ended leave the batch, their keys and values kept in the prompt cache
    /// (and `newer`, a step built after it, loses their rows).
    fn retire_ended(&mut self, newer: Option<&mut Sampled>) -> Result<()> {
        let ended: Vec<usize> = (0..self.running.len()).filter(|&i| self.running[i].finish.is_some()).collect();
        if ended.is_empty() {
            return Ok(());
        }
        for &i in &ended {
            remember(&mut self.prompt_cache, &self.running[i], &self.caches, i)?;
        }
        let keep: Vec<usize> = (0..self.running.len()).filter(|i| !ended.contains(i)).collect();
        if let Some(n) = newer {
            n.keep_rows(&keep)?;
        }
        self.keep_rows(&keep)
    }

    /// Keeps running rows `keep` (their sequences, cache rows and tokens in flight).
    fn keep_rows(&mut self, keep: &[usize]) -> Result<()> {
        if let Some(step) = &mut self.inflight {
            let covered: Vec<usize> = keep.iter().copied().filter(|&i| i < step.rows()).collect();
            step.keep_rows(&covered)?;
            if step.rows() == 0 {
                self.inflight = None;
            }
        }
        for c in self.caches.iter_mut().chain(&mut self.draft_caches) {
            let KvCache::Batch(b) = c else { unreachable!("batch caches") };
            b.filter(keep)?;
        }
        let mut old: Vec<Option<Sequence>> = self.running.drain(..).map(Some).collect();
        self.running = keep.iter().map(|&i| old[i].take().expect("each row kept once")).collect();
        self.trim_allocator_cache();
        Ok(())
    }

    /// Gives MLX's cache of freed buffers back when it outgrows the keys and values in use (and
    /// [`CACHE_SLACK`]): every join and leave copies the batch's cache into buffers of a new
    /// size, and without this the old ones pile up (40 GB held for 3 GB of keys and values on an
    /// H100, 32 streams). Clearing at every join cost 40 % of the throughput there.
    fn trim_allocator_cache(&self) {
        let cached = rmlx::memory::cache_memory();
        if cached > CACHE_SLACK && cached > 2 * self.kv_bytes() {
            rmlx::memory::clear_cache();
        }
    }
}

/// The disk tier over `dir` for `lm`'s entries computed with `quantization`.
fn disk_tier(
    lm: &LoadedModel,
    dir: &PromptCacheDir,
    windows: &[Option<usize>],
    quantization: Option<crate::cache::KvQuantization>,
) -> Result<DiskTier> {
    let mut identity = lm.prompt_cache_metadata(None)?;
    identity.retain(|k, _| k.starts_with("rmlx."));
    let kv = quantization.map_or("none".to_string(), |q| format!("{}/{}/{}", q.bits, q.group_size, q.start));
    identity.insert("rmlx.kv".into(), kv);
    DiskTier::open(dir, identity, windows.to_vec(), quantization)
}

/// Puts row `row` of `caches` (sequence `seq`) in the prompt cache.
fn remember(cache: &mut PromptCache, seq: &Sequence, caches: &[KvCache], row: usize) -> Result<()> {
    if cache.budget() == 0 {
        return Ok(());
    }
    let (mut layers, mut min_reuse) = (Vec::with_capacity(caches.len()), 0);
    for c in caches {
        let KvCache::Batch(b) = c else { unreachable!("batch caches") };
        match b.extract(row)? {
            Some(kv) => {
                // A layer that dropped positions serves hits whose window starts within it.
                if let (true, Some(w)) = (kv.start > 0, b.window()) {
                    min_reuse = min_reuse.max(kv.start + w - 1);
                }
                layers.push(kv)
            }
            None => return Ok(()),
        }
    }
    // A pipelined step may have fed the end-of-sequence token too: keep what `history` names.
    let positions = (layers[0].start + layers[0].len()).min(seq.history.len());
    if layers.iter().any(|l| l.start >= positions) || min_reuse > positions {
        return Ok(());
    }
    let layers = layers.iter().map(|l| l.before(positions)).collect::<Result<Vec<_>>>()?;
    rmlx::eval(layers.iter().flat_map(|l| l.keys.arrays().into_iter().chain(l.values.arrays())))?;
    cache.insert(seq.adapter, seq.history[..positions].to_vec(), layers, min_reuse);
    Ok(())
}

/// `1.5 GB`, `14.3 kB`.
fn human_bytes(n: usize) -> String {
    let n = n as f64;
    match n {
        n if n >= 1e9 => format!("{:.2} GB", n / 1e9),
        n if n >= 1e6 => format!("{:.1} MB", n / 1e6),
        n => format!("{:.1} kB", n / 1e3),
    }
}

fn non_finite(seq: &Sequence) -> Error {
    Error::NonFinite(format!(
        "the logits of token {} of request {} are NaN or infinite (the weights or activations overflow)",
        seq.generated + 1,
        seq.id
    ))
}

/// After a forward pass: the caches that reached `q`'s start are quantised (see
/// [`EngineOptions::kv_quantization`]).
pub(crate) fn quantize_caches(caches: &mut [KvCache], q: Option<&crate::cache::KvQuantization>) -> Result<()> {
    if let Some(q) = q {
        for c in caches {
            c.quantize(q)?;
        }
    }
    Ok(())
}
