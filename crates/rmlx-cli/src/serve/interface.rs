//! Serving through another backend (`rmlx serve --backend mlx-lm`): the same HTTP API over the
//! [`LanguageModel`] interface, for architectures the native backend lacks. The interface has no
//! batching engine, so requests run one at a time in arrival order (the others wait in the
//! queue); `/v1/models` says so. What only the native engine does is refused per request:
//! `response_format`, alternatives per token (`top_logprobs`), adapters.

use super::api::{ApiError, TokenLogprob};
use super::engine::{Event, Job, Prompt, Stats};
use rmlx_lm::backend::{self, LanguageModel};
use rmlx_lm::engine::Usage;
use rmlx_lm::FinishReason;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::Arc;

/// Serves jobs one at a time until every sender is gone.
pub fn run(mut lm: Box<dyn LanguageModel>, jobs: Receiver<Job>, stats: Arc<Stats>) {
    while let Ok(job) = jobs.recv() {
        stats.queued.fetch_sub(1, Ordering::Relaxed);
        stats.running.store(1, Ordering::Relaxed);
        serve_one(lm.as_mut(), job, &stats);
        stats.running.store(0, Ordering::Relaxed);
    }
    if let Err(e) = lm.close() {
        tracing::warn!(error = %e, "closing the backend");
    }
}

fn serve_one(lm: &mut dyn LanguageModel, job: Job, stats: &Stats) {
    let refuse = |message: &str, param: &'static str| {
        let _ = job.events.send(Event::Failed(ApiError::bad_request(message, Some(param))));
    };
    let backend = lm.info().backend;
    if job.grammar.is_some() {
        return refuse(
            &format!("response_format needs the native backend (this server runs {backend})"),
            "response_format",
        );
    }
    if job.logprobs.is_some_and(|k| k > 0) {
        return refuse(&format!("top_logprobs needs the native backend (this server runs {backend})"), "top_logprobs");
    }
    let prompt = match job.prompt {
        Prompt::Chat(chat) => match plain_messages(&chat) {
            Some(messages) => backend::Prompt::Chat(messages),
            None => {
                return refuse(
                    &format!(
                    "tools, tool calls and chat_template_kwargs need the native backend (this server runs {backend})"
                ),
                    "tools",
                )
            }
        },
        Prompt::Text(text) => backend::Prompt::Text(text),
    };
    let mut stream = match lm.generate(&prompt, &job.options) {
        Ok(s) => s,
        Err(e) => {
            tracing::info!(request = %job.id, error = %e, "refused");
            let status = match e {
                rmlx_lm::Error::Prompt(_) | rmlx_lm::Error::InvalidParameter(_) => 400,
                _ => 500,
            };
            let _ = job.events.send(Event::Failed(ApiError { status, message: e.to_string(), param: None }));
            return;
        }
    };
    let cancel = stream.cancel_handle();
    if job.events.send(Event::Started { reply: None }).is_err() {
        cancel.cancel();
    }
    for token in stream.by_ref() {
        match token {
            Ok(t) => {
                let logprob =
                    job.logprobs.map(|_| TokenLogprob { token: t.text.clone(), logprob: t.logprob, top: Vec::new() });
                if job.events.send(Event::Token { text: t.text, logprob }).is_err() {
                    cancel.cancel();
                }
            }
            Err(e) => {
                tracing::error!(request = %job.id, error = %e, "generation failed");
                stats.failed.fetch_add(1, Ordering::Relaxed);
                let failure = ApiError { status: 500, message: format!("generation failed: {e}"), param: None };
                let _ = job.events.send(Event::Failed(failure));
                return;
            }
        }
    }
    let m = stream.metrics();
    let reason = stream.finish_reason().unwrap_or(FinishReason::Length);
    drop(stream);
    stats.requests.fetch_add(1, Ordering::Relaxed);
    if reason == FinishReason::Cancelled {
        stats.cancelled.fetch_add(1, Ordering::Relaxed);
        return;
    }
    stats.prompt_tokens.fetch_add(m.prompt_tokens as u64, Ordering::Relaxed);
    stats.completion_tokens.fetch_add(m.generated_tokens as u64, Ordering::Relaxed);
    let usage = Usage {
        prompt_tokens: m.prompt_tokens,
        cached_tokens: 0,
        completion_tokens: m.generated_tokens,
        time_to_first_token: Some(m.time_to_first_token),
        ..Usage::default()
    };
    tracing::info!(request = %job.id, prompt_tokens = m.prompt_tokens, completion_tokens = m.generated_tokens, finish_reason = reason.as_str(), "done");
    let _ = job.events.send(Event::Done { finish_reason: reason.as_str(), usage });
}

/// The conversation as role and text alone, when that is all it is (no tools, calls or template
/// variables: the other backends take nothing more).
fn plain_messages(chat: &rmlx_lm::chat::ChatRequest) -> Option<Vec<rmlx_lm::chat::Message>> {
    if !chat.tools.is_empty() || !chat.template_args.is_empty() {
        return None;
    }
    chat.messages
        .iter()
        .map(|m| -> Option<rmlx_lm::chat::Message> {
            let o = m.as_object()?;
            let role = o.get("role")?.as_str()?;
            let content = o.get("content")?.as_str()?;
            (o.len() == 2 && role != "tool").then(|| rmlx_lm::chat::Message::new(role, content))
        })
        .collect()
}
