//! The generation loop: the one thread that owns the model and MLX, running the continuous
//! batching [`Engine`]. HTTP handlers hand it [`Job`]s through a bounded queue and read [`Event`]s
//! back; a handler that goes away (the client disconnected) makes the next send fail, and the
//! request is cancelled at the next step, its cache rows freed.

use super::api::{ApiError, TokenLogprob};
use rmlx_lm::chat::{ChatRequest, ReplyFormat};
use rmlx_lm::engine::{Engine, EngineOptions, Lockstep, Request, SeqId, Update, Usage};
use rmlx_lm::{FinishReason, GenerateOptions, LoadedModel};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedSender;

/// What to complete.
#[derive(Clone)]
pub enum Prompt {
    /// A conversation (with tools, template variables), through the model's chat template.
    Chat(ChatRequest),
    /// Text encoded as is.
    Text(String),
}

pub struct Job {
    /// The response's id (`chatcmpl-7`), in the logs.
    pub id: String,
    pub prompt: Prompt,
    pub options: GenerateOptions,
    /// Most likely alternatives to report per token; `None`: no log-probabilities at all.
    pub logprobs: Option<usize>,
    /// The LoRA adapter to generate with (`None`: the base model).
    pub adapter: Option<String>,
    /// `response_format`'s grammar.
    pub grammar: Option<rmlx_lm::grammar::Grammar>,
    /// Whether the engine may draft for it (when it speculates).
    pub speculative: bool,
    pub events: UnboundedSender<Event>,
}

/// Adapter management, answered on `reply` with the error text of a refusal.
pub enum Control {
    Load { name: String, path: std::path::PathBuf, reply: tokio::sync::oneshot::Sender<Result<(), String>> },
    Unload { name: String, reply: tokio::sync::oneshot::Sender<Result<(), String>> },
}

pub enum Event {
    /// The prompt is encoded and fits: generation starts. For chat, how to read the reply.
    Started {
        reply: Option<ReplyFormat>,
    },
    /// The text of the next token (may be empty while a character or stop string is pending),
    /// with its log-probability when the request asked for them.
    Token {
        text: String,
        logprob: Option<TokenLogprob>,
    },
    Done {
        finish_reason: &'static str,
        usage: Usage,
    },
    Failed(ApiError),
}

/// What the loop does before it serves.
pub struct Start<'m> {
    /// LoRA adapters to load: name and folder.
    pub adapters: Vec<(String, std::path::PathBuf)>,
    /// Whether to run [`Engine::warm_up`] first.
    pub warm_up: bool,
    /// Speculative decoding (`--draft-model`, `--prompt-lookup`).
    pub speculation: Option<rmlx_lm::speculative::Speculation<'m>>,
    /// Told once the loop takes requests.
    pub ready: std::sync::mpsc::Sender<()>,
}

/// Counters for `/metrics`, shared with the HTTP side (plain atomics: no MLX there).
#[derive(Default)]
pub struct Stats {
    pub requests: AtomicU64,
    pub failed: AtomicU64,
    /// Requests whose client went away before the end.
    pub cancelled: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    /// Tokens drafted by speculative decoding, and those kept.
    pub draft_tokens: AtomicU64,
    pub accepted_draft_tokens: AtomicU64,
    /// Requests handed to the loop and not started yet.
    pub queued: AtomicUsize,
    /// Sequences in the running batch.
    pub running: AtomicUsize,
    /// The most sequences that ran together.
    pub peak_batch: AtomicUsize,
    pub ttft_micros_total: AtomicU64,
    pub peak_memory: AtomicU64,
    pub active_memory: AtomicU64,
    pub kv_bytes: AtomicU64,
    /// What the running batch's keys and values may take (`--max-kv-gb` or derived).
    pub kv_budget: AtomicU64,
    pub prompt_cache_bytes: AtomicU64,
    /// Files and bytes of `--prompt-cache-dir` (0 without one).
    pub prompt_cache_disk_files: AtomicU64,
    pub prompt_cache_disk_bytes: AtomicU64,
    /// The model's weights (MLX memory held for the whole run).
    pub weights_bytes: AtomicU64,
    /// MLX's cache of freed buffers (given back when the server goes idle).
    pub mlx_cache_bytes: AtomicU64,
}

/// A request in the engine: where its events go.
struct Live {
    id: String,
    events: UnboundedSender<Event>,
    logprobs: bool,
}

/// Serves jobs until every sender is gone. Runs on the evaluation thread. `adapters` are loaded
/// first (every rank read them once at start-up); `control` loads and unloads more, on every rank.
/// With `warm_up`, the engine first runs [`Engine::warm_up`]; then `ready` is told that requests
/// may come.
pub fn run<'m>(
    lm: &'m LoadedModel,
    jobs: Receiver<Job>,
    control: Receiver<Control>,
    opts: EngineOptions,
    start: Start<'m>,
    stats: Arc<Stats>,
) -> rmlx_lm::Result<()> {
    let max_batch = opts.max_batch.max(1);
    let mut engine = Engine::new(lm, opts);
    if let Some(s) = start.speculation {
        engine = engine.with_speculation(s)?;
    }
    // Over the ranks of a tensor-parallel model, the other ranks follow this engine's decisions.
    let mut engine = Lockstep::new(engine, lm.ranks().cloned());
    for (name, path) in &start.adapters {
        engine.load_adapter_dir(name, path)?;
    }
    if start.warm_up {
        let begun = std::time::Instant::now();
        tracing::info!(
            "warming up: one pass over every batch size up to {max_batch}, so that the GPU kernels are ready"
        );
        let steps = engine.warm_up()?;
        tracing::info!(steps, seconds = begun.elapsed().as_secs_f64(), "warmed up");
    }
    disk_usage(engine.engine(), &stats);
    let _ = start.ready.send(());
    let mut live: HashMap<SeqId, Live> = HashMap::new();
    let mut busy = false;
    loop {
        while let Ok(c) = control.try_recv() {
            manage(&mut engine, c);
        }
        if engine.engine().is_idle() && std::mem::take(&mut busy) {
            give_back_idle_memory(&stats);
        }
        if engine.engine().is_idle() {
            // Idle: wait for a job, looking at the control queue now and then.
            match jobs.recv_timeout(std::time::Duration::from_millis(50)) {
                Ok(job) => admit(lm, &mut engine, &mut live, job, &stats),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return engine.stop(),
            }
        }
        // Take only what a free row of the batch can start; the rest waits in the bounded queue
        // (`--max-queue`: 503 when it is full).
        while engine.engine().load().0 + engine.engine().load().1 < max_batch {
            match jobs.try_recv() {
                Ok(job) => admit(lm, &mut engine, &mut live, job, &stats),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) if engine.engine().is_idle() => return engine.stop(),
                Err(TryRecvError::Disconnected) => break,
            }
        }
        busy = true;
        let updates = match engine.step() {
            Ok(u) => u,
            Err(e) => {
                tracing::error!("generation step failed: {e}");
                let failure = ApiError { status: 500, message: format!("generation failed: {e}"), param: None };
                for (_, l) in live.drain() {
                    stats.failed.fetch_add(1, Ordering::Relaxed);
                    let _ = l.events.send(Event::Failed(failure.clone()));
                }
                engine.abort();
                continue;
            }
        };
        for u in updates {
            route(lm, &mut engine, &mut live, u, &stats);
        }
        let e = engine.engine();
        stats.running.store(e.load().0, Ordering::Relaxed);
        stats.peak_batch.fetch_max(e.load().0, Ordering::Relaxed);
        stats.kv_bytes.store(e.kv_bytes() as u64, Ordering::Relaxed);
        stats.prompt_cache_bytes.store(e.prompt_cache_usage().0 as u64, Ordering::Relaxed);
        disk_usage(e, &stats);
        stats.peak_memory.fetch_max(rmlx::memory::peak_memory() as u64, Ordering::Relaxed);
        stats.active_memory.store(rmlx::memory::active_memory() as u64, Ordering::Relaxed);
        stats.mlx_cache_bytes.store(rmlx::memory::cache_memory() as u64, Ordering::Relaxed);
    }
}

/// The prompt-cache directory's files and bytes, into the statistics.
fn disk_usage(e: &Engine, stats: &Stats) {
    let (files, bytes) = e.prompt_cache_disk_usage().unwrap_or((0, 0));
    stats.prompt_cache_disk_files.store(files as u64, Ordering::Relaxed);
    stats.prompt_cache_disk_bytes.store(bytes, Ordering::Relaxed);
}

/// Once the last request has ended: MLX's cache of freed buffers (the batch's keys and values,
/// activations) and the C allocator's free pages go back to the system, so that the process
/// shrinks back after a burst; the prompt cache keeps what it was configured to keep.
fn give_back_idle_memory(stats: &Stats) {
    rmlx::memory::clear_cache();
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap pages to the system.
    unsafe {
        libc::malloc_trim(0);
    }
    stats.active_memory.store(rmlx::memory::active_memory() as u64, Ordering::Relaxed);
    stats.mlx_cache_bytes.store(rmlx::memory::cache_memory() as u64, Ordering::Relaxed);
}

/// Loads or unloads an adapter; the reply says whether it worked.
fn manage(engine: &mut Lockstep, c: Control) {
    let (result, reply) = match c {
        Control::Load { name, path, reply } => {
            let r = engine.load_adapter_dir(&name, &path);
            if let Err(e) = &r {
                tracing::warn!(adapter = %name, path = %path.display(), error = %e, "load adapter failed");
            } else {
                tracing::info!(adapter = %name, path = %path.display(), "load adapter");
            }
            // The client learns whether it is an adapter rmlx can use, not what the server's
            // file system holds (the reason is in the server's log).
            let r = r.map_err(|e| match e {
                rmlx_lm::Error::Io { .. } | rmlx_lm::Error::MissingFile(_) | rmlx_lm::Error::Corrupt { .. } => {
                    "`lora_path` is not an adapter folder (adapter_config.json with adapters.safetensors, or \
                     PEFT's adapter_model.safetensors)"
                        .to_string()
                }
                e => format!("`lora_path` holds an adapter this model cannot use: {}", one_line(&e.to_string())),
            });
            (r, reply)
        }
        Control::Unload { name, reply } => {
            let r = engine.unload_adapter(&name).map_err(|e| e.to_string());
            tracing::info!(adapter = %name, ok = r.is_ok(), "unload adapter");
            (r, reply)
        }
    };
    let _ = reply.send(result);
}

/// Encodes a job's prompt and submits it; refusals go back to the handler as 400s.
fn admit(lm: &LoadedModel, engine: &mut Lockstep, live: &mut HashMap<SeqId, Live>, job: Job, stats: &Stats) {
    stats.queued.fetch_sub(1, Ordering::Relaxed);
    let mut options = job.options;
    let prompt = match &job.prompt {
        Prompt::Chat(chat) => lm.prepare_chat(chat).and_then(|ready| {
            options.keep_special = ready.keep_special;
            let grammar = match (ready.grammar, job.grammar) {
                (Some(_), Some(_)) => {
                    return Err(rmlx_lm::Error::InvalidParameter(
                        "response_format cannot be combined with a tool_choice that forces a call".into(),
                    ))
                }
                (forced, asked) => forced.or(asked),
            };
            Ok((ready.prompt, grammar, Some(ready.reply)))
        }),
        Prompt::Text(text) => lm.encode_prompt(text, true, None).map(|p| (p, job.grammar, None)),
    };
    let mut reply = None;
    let request = prompt.map(|(prompt, grammar, format)| {
        reply = format;
        Request {
            prompt,
            options,
            top_logprobs: job.logprobs.unwrap_or(0),
            adapter: job.adapter,
            grammar,
            speculative: job.speculative,
        }
    });
    let submitted = request.and_then(|r| {
        let n = r.prompt.len();
        engine.submit(r).map(|seq| (seq, n))
    });
    match submitted {
        Ok((seq, prompt_tokens)) => {
            tracing::debug!(request = %job.id, prompt_tokens, "queued");
            if job.events.send(Event::Started { reply }).is_err() {
                engine.cancel(seq);
            }
            live.insert(seq, Live { id: job.id, events: job.events, logprobs: job.logprobs.is_some() });
        }
        Err(e) => {
            tracing::info!(request = %job.id, error = %e, "refused");
            let param = match &e {
                rmlx_lm::Error::Prompt(_) | rmlx_lm::Error::Template(_) => Some("messages"),
                rmlx_lm::Error::InvalidParameter(m) if m.contains("tool_choice") => Some("tool_choice"),
                rmlx_lm::Error::InvalidParameter(m) if m.contains("tool") => Some("tools"),
                _ => None,
            };
            let _ = job.events.send(Event::Failed(ApiError::bad_request(e.to_string(), param)));
        }
    }
}

fn route(lm: &LoadedModel, engine: &mut Lockstep, live: &mut HashMap<SeqId, Live>, u: Update, stats: &Stats) {
    let (seq, event) = match u {
        Update::Started { .. } => return,
        Update::Token { seq, id, text, logprob, top } => {
            let Some(l) = live.get(&seq) else { return };
            let piece = |id: u32| lm.tokenizer.decode(&[id], false).unwrap_or_default();
            let logprob = l.logprobs.then(|| TokenLogprob {
                token: piece(id),
                logprob,
                top: top.into_iter().map(|(t, lp)| (piece(t), lp)).collect(),
            });
            (seq, Event::Token { text, logprob })
        }
        Update::Text { seq, text } => (seq, Event::Token { text, logprob: None }),
        Update::Finished { seq, reason, usage } => {
            let Some(l) = live.remove(&seq) else { return };
            let ttft_ms = usage.time_to_first_token.map(|d| d.as_secs_f64() * 1e3);
            stats.requests.fetch_add(1, Ordering::Relaxed);
            if reason == FinishReason::Cancelled {
                tracing::info!(request = %l.id, completion_tokens = usage.completion_tokens, "cancelled (client gone)");
                stats.cancelled.fetch_add(1, Ordering::Relaxed);
                return;
            }
            let finish_reason = reason.as_str();
            tracing::info!(
                request = %l.id,
                prompt_tokens = usage.prompt_tokens,
                cached_tokens = usage.cached_tokens,
                completion_tokens = usage.completion_tokens,
                draft_tokens = usage.draft_tokens,
                accepted_draft_tokens = usage.accepted_draft_tokens,
                ttft_ms = ttft_ms.unwrap_or(0.0),
                finish_reason,
                "done"
            );
            stats.prompt_tokens.fetch_add(usage.prompt_tokens as u64, Ordering::Relaxed);
            stats.cached_tokens.fetch_add(usage.cached_tokens as u64, Ordering::Relaxed);
            stats.completion_tokens.fetch_add(usage.completion_tokens as u64, Ordering::Relaxed);
            stats.draft_tokens.fetch_add(usage.draft_tokens as u64, Ordering::Relaxed);
            stats.accepted_draft_tokens.fetch_add(usage.accepted_draft_tokens as u64, Ordering::Relaxed);
            let ttft = usage.time_to_first_token.unwrap_or_default().as_micros() as u64;
            stats.ttft_micros_total.fetch_add(ttft, Ordering::Relaxed);
            let _ = l.events.send(Event::Done { finish_reason, usage });
            return;
        }
        Update::Failed { seq, error } => {
            stats.failed.fetch_add(1, Ordering::Relaxed);
            let Some(l) = live.remove(&seq) else { return };
            tracing::error!(request = %l.id, error = %error, "failed");
            let _ = l.events.send(Event::Failed(ApiError { status: 500, message: error.to_string(), param: None }));
            return;
        }
    };
    if let Some(l) = live.get(&seq) {
        if l.events.send(event).is_err() {
            engine.cancel(seq);
        }
    }
}

/// The first line of a message, without the paths it names (a client must not learn the server's
/// file layout from an error).
fn one_line(m: &str) -> String {
    m.lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .map(|w| if w.contains('/') { "<path>" } else { w })
        .collect::<Vec<_>>()
        .join(" ")
}
