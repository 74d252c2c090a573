//! The completion endpoints: a request's settings handed to the generation loop as one job per
//! choice, and the answer assembled from the loop's events, whole (`chat.completion`,
//! `text_completion`) or streamed as server-sent events, ending with an error event when the
//! shutdown's drain deadline passes.

use super::api::{self, ApiError, ChatRequest, CompletionRequest, Settings, TokenLogprob};
use super::engine::{Event, Job, Prompt};
use super::{adapters, error, Shared, MAX_BODY};
use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream};
use rmlx_lm::chat::{Reply, ReplyEvent, ReplyFormat, ReplyParser};
use rmlx_lm::engine::Usage;
use rmlx_lm::GenerateOptions;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::mpsc::TrySendError;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// Which endpoint a response is for: the object names and where the text goes.
#[derive(Clone, Copy)]
enum Kind {
    Chat,
    Text,
}

pub(super) async fn chat(State(s): State<Arc<Shared>>, body: Result<Json<ChatRequest>, JsonRejection>) -> Response {
    match body {
        Ok(Json(request)) => {
            let chat = request.chat(&s.chat_defaults).map(Prompt::Chat);
            respond(s, Kind::Chat, chat, request.common).await
        }
        Err(e) => malformed(e),
    }
}

pub(super) async fn completions(
    State(s): State<Arc<Shared>>,
    body: Result<Json<CompletionRequest>, JsonRejection>,
) -> Response {
    match body {
        Ok(Json(request)) => respond(s, Kind::Text, request.prompt().map(Prompt::Text), request.common).await,
        Err(e) => malformed(e),
    }
}

/// A body that is not JSON or not the request's shape: 400 with serde's reason.
/// A body over [`MAX_BODY`] gets 413.
pub(super) fn malformed(e: JsonRejection) -> Response {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        let message = format!("the request body is larger than {} MiB", MAX_BODY >> 20);
        return error(ApiError { status: 413, message, param: None });
    }
    error(ApiError::bad_request(e.body_text(), None))
}

/// What a response still being sent gets when the drain deadline passes.
pub(super) fn shutting_down() -> ApiError {
    ApiError { status: 503, message: "the server is shutting down: its drain deadline passed".into(), param: None }
}

async fn respond(s: Arc<Shared>, kind: Kind, prompt: Result<Prompt, ApiError>, common: api::Common) -> Response {
    let adapter = match adapters::resolve_model(&s, common.model.as_deref()) {
        Ok(a) => a,
        Err(e) => return error(e),
    };
    let model = common.model.clone().unwrap_or_else(|| s.model_id.clone());
    let (prompt, settings) = match (prompt, common.settings(s.default_max_tokens)) {
        (Ok(p), Ok(settings)) => (p, settings),
        (Err(e), _) | (_, Err(e)) => return error(e),
    };
    let id = format!(
        "{}-{}",
        if matches!(kind, Kind::Chat) { "chatcmpl" } else { "cmpl" },
        s.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let (receivers, formats) = match start_jobs(&s, &id, &prompt, &settings, adapter).await {
        Ok(started) => started,
        Err(e) => return error(e),
    };
    // Each choice's reply is read by its own parser; call ids name the request and the choice.
    let call_ids = call_id_prefix(&id);
    let parsers: Vec<Option<ReplyParser>> = formats
        .into_iter()
        .enumerate()
        .map(|(i, f)| f.map(|f| ReplyParser::new(f, &format!("{call_ids}{i}_"))))
        .collect();
    let head = Head {
        id,
        created: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        model,
        kind,
    };
    if settings.stream {
        return Sse::new(stream_events(head, receivers, parsers, settings, s.cut.clone())).into_response();
    }
    let mut choices = Vec::with_capacity(receivers.len());
    let mut total: Option<Usage> = None;
    for ((index, mut rx), parser) in receivers.into_iter().enumerate().zip(parsers) {
        let mut text = String::new();
        let mut logprobs = Vec::new();
        let (finish_reason, usage) = loop {
            let mut cut = s.cut.clone();
            let event = tokio::select! {
                e = rx.recv() => e,
                _ = cut.wait_for(|&c| c) => return error(shutting_down()),
            };
            match event {
                Some(Event::Token { text: t, logprob }) => {
                    text.push_str(&t);
                    logprobs.extend(logprob);
                }
                Some(Event::Done { finish_reason, usage }) => break (finish_reason, usage),
                Some(Event::Failed(e)) => return error(e),
                Some(Event::Started { .. }) => {}
                None => {
                    return error(ApiError { status: 500, message: "the generation loop stopped".into(), param: None })
                }
            }
        };
        let lp = match (settings.logprobs, kind) {
            (None, _) => Value::Null,
            (Some(_), Kind::Chat) => api::chat_logprobs(&logprobs.iter().collect::<Vec<_>>()),
            (Some(_), Kind::Text) => api::text_logprobs(&logprobs.iter().collect::<Vec<_>>(), 0),
        };
        choices.push(match (kind, parser) {
            (Kind::Chat, Some(mut parser)) => {
                let mut events = parser.push(&text);
                events.extend(parser.finish());
                let reply = Reply::collect(events);
                let finish_reason = reply_finish_reason(finish_reason, !reply.tool_calls.is_empty());
                json!({"index": index, "message": chat_message(reply), "logprobs": lp, "finish_reason": finish_reason})
            }
            (Kind::Chat, None) => json!({"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp, "finish_reason": finish_reason}),
            (Kind::Text, _) => json!({"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}),
        });
        add_usage(&mut total, usage);
    }
    let mut body = head.object(false);
    body["choices"] = Value::Array(choices);
    body["usage"] = api::usage(&total.unwrap_or_default());
    Json(body).into_response()
}

/// Hands the engine one job per choice (`n` sequences of the batch; a seeded request's choice `i`
/// uses seed + i) and waits until each is accepted: its events, and how to read each reply. A
/// refusal keeps its status even for streamed requests.
pub(super) async fn start_jobs(
    s: &Shared,
    id: &str,
    prompt: &Prompt,
    settings: &Settings,
    adapter: Option<String>,
) -> Result<(Vec<UnboundedReceiver<Event>>, Vec<Option<ReplyFormat>>), ApiError> {
    let mut receivers = Vec::with_capacity(settings.n);
    for i in 0..settings.n {
        let (tx, rx) = unbounded_channel();
        let mut sampler = settings.sampler.clone();
        sampler.seed = sampler.seed.map(|seed| seed.wrapping_add(i as u64));
        let options = GenerateOptions {
            max_tokens: settings.max_tokens,
            sampler,
            stop_strings: settings.stop.clone(),
            ..GenerateOptions::default()
        };
        let job_id = if settings.n == 1 { id.to_string() } else { format!("{id}/{i}") };
        s.stats.queued.fetch_add(1, Ordering::Relaxed);
        let job = Job {
            id: job_id,
            prompt: prompt.clone(),
            options,
            logprobs: settings.logprobs,
            adapter: adapter.clone(),
            grammar: settings.grammar.clone(),
            speculative: settings.speculative,
            events: tx,
        };
        if let Err(e) = s.jobs.try_send(job) {
            // The choices already queued are cancelled when their receivers drop.
            s.stats.queued.fetch_sub(1, Ordering::Relaxed);
            let message = match e {
                TrySendError::Full(_) => "the server is busy: too many requests are waiting; retry later",
                TrySendError::Disconnected(_) => "the server is shutting down",
            };
            return Err(ApiError { status: 503, message: message.into(), param: None });
        }
        receivers.push(rx);
    }
    let mut formats = Vec::with_capacity(receivers.len());
    for rx in &mut receivers {
        match rx.recv().await {
            Some(Event::Started { reply }) => formats.push(reply),
            Some(Event::Failed(e)) => return Err(e),
            _ => return Err(ApiError { status: 500, message: "the generation loop stopped".into(), param: None }),
        }
    }
    Ok((receivers, formats))
}

/// OpenAI's finish reason `tool_calls` for a reply that ended by itself with calls.
fn reply_finish_reason(reason: &'static str, calls: bool) -> &'static str {
    if calls && reason == "stop" {
        "tool_calls"
    } else {
        reason
    }
}

/// An assistant message: `content` (null when the reply is only calls), `reasoning_content`,
/// `tool_calls`.
pub(super) fn chat_message(reply: Reply) -> Value {
    let mut m = json!({"role": "assistant", "content": reply.content});
    if !reply.tool_calls.is_empty() {
        if reply.content.is_empty() {
            m["content"] = Value::Null;
        }
        m["tool_calls"] = reply
            .tool_calls
            .into_iter()
            .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
            .collect();
    }
    if let Some(r) = reply.reasoning {
        m["reasoning_content"] = json!(r);
    }
    m
}

/// `call_` and a number unique to this server's run and request.
pub(super) fn call_id_prefix(request_id: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write(request_id.as_bytes());
    format!("call_{:012x}_", h.finish() & 0xffff_ffff_ffff)
}

/// The chat chunks' `delta`s of a reply's events (several in a row of the same kind merged).
fn deltas(events: Vec<ReplyEvent>) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    for e in events {
        let d = match e {
            ReplyEvent::Content(t) => json!({"content": t}),
            ReplyEvent::Reasoning(t) => json!({"reasoning_content": t}),
            ReplyEvent::ToolCall { index, id, name } => json!({"tool_calls": [
                {"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}),
            ReplyEvent::Arguments { index, text } => {
                json!({"tool_calls": [{"index": index, "function": {"arguments": text}}]})
            }
        };
        out.push(d);
    }
    out
}

/// Adds a choice's usage to the request's: the prompt once, the completions summed.
fn add_usage(total: &mut Option<Usage>, choice: Usage) {
    match total {
        None => *total = Some(choice),
        Some(t) => t.completion_tokens += choice.completion_tokens,
    }
}

/// The fields every response and chunk of one request repeats.
struct Head {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
}

impl Head {
    fn object(&self, chunk: bool) -> Value {
        let object = match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Text, _) => "text_completion",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model})
    }

    /// A chunk with one choice: `delta` (chat) or `text` (completions), and a finish reason.
    fn chunk(&self, index: usize, text: Option<&str>, first: bool, finish_reason: Option<&str>) -> Value {
        self.chunk_with(index, text, first, finish_reason, None, 0)
    }

    /// A chat chunk of one choice with this `delta`.
    fn delta(&self, index: usize, delta: Value) -> Value {
        let mut chunk = self.object(true);
        chunk["choices"] =
            json!([{"index": index, "delta": delta, "logprobs": Value::Null, "finish_reason": Value::Null}]);
        chunk
    }

    /// A chunk whose token carries its log-probability (`offset`: where its text starts).
    fn chunk_with(
        &self,
        index: usize,
        text: Option<&str>,
        first: bool,
        finish_reason: Option<&str>,
        logprob: Option<&TokenLogprob>,
        offset: usize,
    ) -> Value {
        let lp = match (logprob, self.kind) {
            (None, _) => Value::Null,
            (Some(t), Kind::Chat) => api::chat_logprobs(&[t]),
            (Some(t), Kind::Text) => api::text_logprobs(&[t], offset),
        };
        let mut chunk = self.object(true);
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = json!({});
                if first {
                    delta["role"] = json!("assistant");
                }
                if let Some(t) = text {
                    delta["content"] = json!(t);
                }
                json!({"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason})
            }
            Kind::Text => {
                json!({"index": index, "text": text.unwrap_or(""), "logprobs": lp, "finish_reason": finish_reason})
            }
        };
        chunk["choices"] = json!([choice]);
        chunk
    }
}

/// The server-sent events of a streamed request: a chunk per piece of text (each naming its
/// choice), a chunk with each choice's finish reason, the usage chunk when asked for, then
/// `[DONE]`.
fn stream_events(
    head: Head,
    receivers: Vec<UnboundedReceiver<Event>>,
    parsers: Vec<Option<ReplyParser>>,
    settings: Settings,
    cut: tokio::sync::watch::Receiver<bool>,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    use futures_util::StreamExt;
    let data = |v: Value| Ok(SseEvent::default().data(v.to_string()));
    let n = receivers.len();
    let opening: Vec<_> = match head.kind {
        Kind::Chat => (0..n).map(|i| data(head.chunk(i, Some(""), true, None))).collect(),
        Kind::Text => Vec::new(),
    };
    let tagged = receivers
        .into_iter()
        .enumerate()
        .map(|(i, rx)| stream::unfold(rx, move |mut rx| async move { rx.recv().await.map(|e| ((i, e), rx)) }).boxed());
    let merged = stream::select_all(tagged);
    struct State<S> {
        head: Head,
        events: S,
        offsets: Vec<usize>,
        finished: usize,
        usage: Option<Usage>,
        over: bool,
        cut: tokio::sync::watch::Receiver<bool>,
        parsers: Vec<Option<ReplyParser>>,
    }
    let state =
        State { head, events: merged, offsets: vec![0; n], finished: 0, usage: None, over: false, cut, parsers };
    let body = stream::unfold(state, move |mut st| async move {
        if st.over {
            return None;
        }
        loop {
            let event = tokio::select! {
                e = st.events.next() => Some(e),
                _ = st.cut.wait_for(|&c| c) => None,
            };
            let Some(event) = event else {
                st.over = true;
                let items = vec![data(shutting_down().body()), Ok(SseEvent::default().data("[DONE]"))];
                return Some((stream::iter(items), st));
            };
            let items: Vec<Result<SseEvent, Infallible>> = match event {
                Some((_, Event::Token { text, logprob: None })) if text.is_empty() => continue,
                Some((i, Event::Token { text, logprob })) if st.parsers[i].is_some() => {
                    let events = st.parsers[i].as_mut().map(|p| p.push(&text)).unwrap_or_default();
                    let mut chunks: Vec<Value> = deltas(events).into_iter().map(|d| st.head.delta(i, d)).collect();
                    if let Some(lp) = &logprob {
                        // The token's log-probability rides on its first chunk (an empty delta
                        // while its text is held back).
                        if chunks.is_empty() {
                            chunks.push(st.head.delta(i, json!({})));
                        }
                        chunks[0]["choices"][0]["logprobs"] = api::chat_logprobs(&[lp]);
                    }
                    if chunks.is_empty() {
                        continue;
                    }
                    chunks.into_iter().map(data).collect()
                }
                Some((i, Event::Token { text, logprob })) => {
                    let chunk = st.head.chunk_with(i, Some(&text), false, None, logprob.as_ref(), st.offsets[i]);
                    st.offsets[i] += text.len();
                    vec![data(chunk)]
                }
                Some((i, Event::Done { finish_reason, usage })) => {
                    let mut items = Vec::new();
                    let mut reason = finish_reason;
                    if let Some(p) = st.parsers[i].as_mut() {
                        items.extend(deltas(p.finish()).into_iter().map(|d| data(st.head.delta(i, d))));
                        reason = reply_finish_reason(reason, p.tool_calls() > 0);
                    }
                    items.push(data(st.head.chunk(i, None, false, Some(reason))));
                    add_usage(&mut st.usage, usage);
                    st.finished += 1;
                    if st.finished == n {
                        if settings.include_usage {
                            let mut chunk = st.head.object(true);
                            chunk["choices"] = json!([]);
                            chunk["usage"] = api::usage(&st.usage.clone().unwrap_or_default());
                            items.push(data(chunk));
                        }
                        items.push(Ok(SseEvent::default().data("[DONE]")));
                        st.over = true;
                    }
                    items
                }
                Some((_, Event::Failed(e))) => {
                    st.over = true;
                    vec![data(e.body()), Ok(SseEvent::default().data("[DONE]"))]
                }
                Some((_, Event::Started { .. })) => continue,
                None => return None,
            };
            return Some((stream::iter(items), st));
        }
    });
    stream::iter(opening).chain(body.flatten())
}
