//! The generation loop: the one thread that owns the model and MLX. HTTP handlers hand it
//! [`Job`]s through a bounded queue and read [`Event`]s back; a handler that goes away (the client
//! disconnected) makes the next send fail, and the job is cancelled at that token.
//!
//! Requests run one after another for now: no batching, no prompt cache.

use super::api::ApiError;
use rmlx_lm::chat::Message;
use rmlx_lm::{FinishReason, GenerateOptions, LoadedModel};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedSender;

/// What to complete.
pub enum Prompt {
    /// Messages, through the model's chat template.
    Chat(Vec<Message>),
    /// Text encoded as is.
    Text(String),
}

pub struct Job {
    pub prompt: Prompt,
    pub options: GenerateOptions,
    pub events: UnboundedSender<Event>,
}

pub enum Event {
    /// The prompt is encoded and fits: generation starts.
    Started { prompt_tokens: usize },
    /// The text of the next token (may be empty while a character or stop string is pending).
    Token(String),
    Done { finish_reason: &'static str, prompt_tokens: usize, completion_tokens: usize },
    Failed(ApiError),
}

/// Counters for `/metrics`, shared with the HTTP side (plain atomics: no MLX there).
#[derive(Default)]
pub struct Stats {
    pub requests: AtomicU64,
    pub failed: AtomicU64,
    /// Requests whose client went away before the end.
    pub cancelled: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub queued: AtomicUsize,
    pub running: AtomicUsize,
    pub ttft_micros_total: AtomicU64,
    pub peak_memory: AtomicU64,
}

/// Serves jobs until every sender is gone. Runs on the evaluation thread.
pub fn run(lm: &LoadedModel, jobs: std::sync::mpsc::Receiver<Job>, context: usize, stats: Arc<Stats>) {
    for job in jobs {
        stats.queued.fetch_sub(1, Ordering::Relaxed);
        stats.running.store(1, Ordering::Relaxed);
        let events = job.events.clone();
        if let Err(e) = serve(lm, job, context, &stats) {
            stats.failed.fetch_add(1, Ordering::Relaxed);
            let _ = events.send(Event::Failed(e));
        }
        stats.running.store(0, Ordering::Relaxed);
    }
}

fn serve(lm: &LoadedModel, job: Job, context: usize, stats: &Stats) -> Result<(), ApiError> {
    let prompt = match &job.prompt {
        Prompt::Chat(messages) => lm.chat_prompt(messages),
        Prompt::Text(text) => lm.encode_prompt(text, true, None),
    }
    .map_err(|e| ApiError::bad_request(format!("{e}"), None))?;
    if prompt.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty", None));
    }
    if prompt.len() + 1 > context {
        let message = format!("the prompt is {} tokens; this model's context is {context} tokens", prompt.len());
        return Err(ApiError::bad_request(message, Some("messages")));
    }
    let mut options = job.options;
    options.max_tokens = options.max_tokens.min(context - prompt.len());
    let internal = |e: rmlx_lm::Error| ApiError { status: 500, message: format!("generation failed: {e}"), param: None };
    let mut generation = lm.generate(&prompt, &options).map_err(internal)?;
    if job.events.send(Event::Started { prompt_tokens: prompt.len() }).is_err() {
        return Ok(());
    }
    let cancel = generation.cancel_handle();
    for token in generation.by_ref() {
        let token = token.map_err(internal)?;
        if job.events.send(Event::Token(token.text)).is_err() {
            cancel.cancel();
        }
    }
    let metrics = generation.metrics().clone();
    stats.requests.fetch_add(1, Ordering::Relaxed);
    stats.prompt_tokens.fetch_add(metrics.prompt_tokens as u64, Ordering::Relaxed);
    stats.completion_tokens.fetch_add(metrics.generated_tokens as u64, Ordering::Relaxed);
    stats.ttft_micros_total.fetch_add(metrics.time_to_first_token.as_micros() as u64, Ordering::Relaxed);
    stats.peak_memory.fetch_max(metrics.peak_memory as u64, Ordering::Relaxed);
    let finish_reason = match generation.finish_reason() {
        Some(FinishReason::Length) => "length",
        Some(FinishReason::Cancelled) => {
            stats.cancelled.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        _ => "stop",
    };
    let _ = job.events.send(Event::Done { finish_reason, prompt_tokens: metrics.prompt_tokens, completion_tokens: metrics.generated_tokens });
    Ok(())
}
