//! OpenAI's Responses API, `POST /v1/responses` (the default of OpenAI's own SDKs), whole or
//! streamed as its typed events, and `GET /v1/responses/{id}`: input as text or items (messages,
//! `function_call`, `function_call_output`), `instructions`, flat function tools, `tool_choice`,
//! `text.format` (JSON schema), `reasoning.effort`, and `previous_response_id` over the responses
//! this server keeps (the last [`KEPT`], in memory). Output items: `reasoning`, `message` with
//! `output_text`, `function_call`.

use super::api::{self, ApiError, ChatRequest, Settings};
use super::engine::{Event, Prompt};
use super::respond::{call_id_prefix, malformed, shutting_down, start_jobs};
use super::{adapters, error, Shared};
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream};
use rmlx_lm::chat::{ReplyEvent, ReplyParser};
use rmlx_lm::engine::Usage;
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

/// Responses kept for `previous_response_id` and `GET /v1/responses/{id}`.
pub const KEPT: usize = 1000;

/// Stored responses: id, the conversation that led to it (chat messages, its output included),
/// and the response object.
#[derive(Default)]
pub struct Store(Mutex<VecDeque<(String, Vec<Value>, Value)>>);

impl Store {
    fn get(&self, id: &str) -> Option<(Vec<Value>, Value)> {
        let kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        kept.iter().find(|(k, _, _)| k == id).map(|(_, m, r)| (m.clone(), r.clone()))
    }

    fn put(&self, id: String, messages: Vec<Value>, response: Value) {
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() == KEPT {
            kept.pop_front();
        }
        kept.push_back((id, messages, response));
    }
}

pub(super) async fn retrieve(State(s): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    match s.responses.get(&id) {
        Some((_, response)) => Json(response).into_response(),
        None => error(ApiError { status: 404, message: format!("no response `{id}` is kept"), param: None }),
    }
}

pub(super) async fn create(State(s): State<Arc<Shared>>, body: Result<Json<Value>, JsonRejection>) -> Response {
    let body = match body {
        Ok(Json(b)) => b,
        Err(e) => return malformed(e),
    };
    match prepare(&s, &body) {
        Ok((chat, settings, messages)) => run(s, body, chat, settings, messages).await,
        Err(e) => error(e),
    }
}

/// The request as a chat request: the conversation (the previous response's, then `instructions`
/// and `input`), the chat fields, and the sampling settings.
fn prepare(s: &Shared, body: &Value) -> Result<(rmlx_lm::chat::ChatRequest, Settings, Vec<Value>), ApiError> {
    let bad = |m: String, p: &'static str| ApiError::bad_request(m, Some(p));
    let mut messages = Vec::new();
    if let Some(prev) = body.get("previous_response_id").and_then(Value::as_str) {
        let (kept, _) = s.responses.get(prev).ok_or_else(|| ApiError {
            status: 404,
            message: format!("previous_response_id `{prev}` is not kept by this server"),
            param: Some("previous_response_id"),
        })?;
        messages.extend(kept.into_iter().filter(|m| m["role"] != "system"));
    }
    if let Some(i) = body.get("instructions").and_then(Value::as_str) {
        messages.insert(0, json!({"role": "system", "content": i}));
    }
    match body.get("input") {
        Some(Value::String(t)) => messages.push(json!({"role": "user", "content": t})),
        Some(Value::Array(items)) => {
            for (k, item) in items.iter().enumerate() {
                input_item(item, &mut messages).map_err(|m| bad(format!("input[{k}]: {m}"), "input"))?;
            }
        }
        _ => return Err(bad("input must be a string or a list of items".into(), "input")),
    }
    // The chat request's own fields, from the Responses API's.
    let tools: Vec<Value> = match body.get("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(t)) => t
            .iter()
            .map(|t| match t.get("type").and_then(Value::as_str) {
                Some("function") if t.get("function").is_none() => Ok(json!({"type": "function", "function": {
                    "name": t.get("name"), "description": t.get("description"), "parameters": t.get("parameters")}})),
                Some("function") => Ok(t.clone()),
                other => Err(bad(format!("only tools of type `function` are supported, not {other:?}"), "tools")),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(bad("tools must be a list".into(), "tools")),
    };
    let mut chat = json!({"messages": messages, "tools": tools});
    for key in ["tool_choice", "parallel_tool_calls", "model", "temperature", "top_p", "stream", "top_logprobs", "user"]
    {
        if let Some(v) = body.get(key).filter(|v| !v.is_null()) {
            chat[key] = v.clone();
        }
    }
    if let Some(m) = body.get("max_output_tokens").filter(|v| !v.is_null()) {
        chat["max_tokens"] = m.clone();
    }
    if let Some(e) = body.get("reasoning").and_then(|r| r.get("effort")).and_then(Value::as_str) {
        chat["reasoning_effort"] = json!(e);
    }
    if let Some(f) = body.get("text").and_then(|t| t.get("format")).filter(|f| !f.is_null()) {
        // The Responses API's format is flat: {type: json_schema, name, schema}.
        chat["response_format"] = match f.get("type").and_then(Value::as_str) {
            Some("json_schema") => {
                json!({"type": "json_schema", "json_schema": {"name": f.get("name"), "schema": f.get("schema")}})
            }
            _ => f.clone(),
        };
    }
    if let Some(kw) = body.get("chat_template_kwargs") {
        chat["chat_template_kwargs"] = kw.clone();
    }
    let request: ChatRequest = serde_json::from_value(chat).map_err(|e| ApiError::bad_request(e.to_string(), None))?;
    let prepared = request.chat(&s.chat_defaults)?;
    let settings = request.common.settings(s.default_max_tokens)?;
    Ok((prepared.clone(), settings, prepared.messages))
}

/// One input item into chat messages: a message, a call (joined to the assistant message before
/// it, or a new one), a call's output (a tool message); reasoning items are skipped.
fn input_item(item: &Value, messages: &mut Vec<Value>) -> Result<(), String> {
    let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
    match kind {
        "message" => {
            let role = item.get("role").and_then(Value::as_str).ok_or("a message needs a `role`")?;
            let content = api::content_text(item.get("content"))?.unwrap_or_default();
            messages.push(json!({"role": role, "content": content}));
        }
        "function_call" => {
            let name = item.get("name").and_then(Value::as_str).ok_or("a function_call needs `name`")?;
            let call = json!({"id": item.get("call_id").or(item.get("id")), "type": "function",
                "function": {"name": name, "arguments": item.get("arguments").cloned().unwrap_or(json!("{}"))}});
            match messages.last_mut() {
                Some(m) if m["role"] == "assistant" && m.get("tool_calls").is_some() => {
                    m["tool_calls"].as_array_mut().expect("a list").push(call)
                }
                _ => messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
            }
        }
        "function_call_output" => {
            let output = match item.get("output") {
                Some(Value::String(s)) => s.clone(),
                Some(other) => api::content_text(Some(other))?.unwrap_or_default(),
                None => return Err("a function_call_output needs `output`".into()),
            };
            messages.push(json!({"role": "tool", "tool_call_id": item.get("call_id"), "content": output}));
        }
        "reasoning" => {}
        other => return Err(format!("input items of type `{other}` are not supported")),
    }
    Ok(())
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The response object around `output`.
fn response_object(
    id: &str,
    body: &Value,
    model: &str,
    status: &str,
    output: Vec<Value>,
    usage: Option<&Usage>,
) -> Value {
    let field = |k: &str, default: Value| body.get(k).filter(|v| !v.is_null()).cloned().unwrap_or(default);
    let incomplete = (status == "incomplete").then(|| json!({"reason": "max_output_tokens"}));
    json!({
        "id": id, "object": "response", "created_at": now(), "status": status, "model": model,
        "output": output, "error": null, "incomplete_details": incomplete,
        "instructions": field("instructions", Value::Null),
        "max_output_tokens": field("max_output_tokens", Value::Null),
        "parallel_tool_calls": field("parallel_tool_calls", json!(true)),
        "previous_response_id": field("previous_response_id", Value::Null),
        "temperature": field("temperature", json!(1.0)), "top_p": field("top_p", json!(1.0)),
        "tool_choice": field("tool_choice", json!("auto")), "tools": field("tools", json!([])),
        "text": field("text", json!({"format": {"type": "text"}})),
        "reasoning": field("reasoning", json!({"effort": null, "summary": null})),
        "metadata": field("metadata", json!({})), "store": field("store", json!(true)), "truncation": "disabled",
        "usage": usage.map(|u| json!({
            "input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens})),
    })
}

/// The output items as a reply's events build them.
#[derive(Default)]
struct Output {
    items: Vec<Value>,
    next: u64,
    base: String,
}

/// What changed in the output with one event: the stream's events for it.
impl Output {
    fn new(base: &str) -> Output {
        Output { base: base.to_string(), ..Output::default() }
    }

    fn item_id(&mut self, prefix: &str) -> String {
        self.next += 1;
        format!("{prefix}_{}_{}", self.base, self.next)
    }

    /// Applies `e`; returns the streaming events (type, payload) it makes.
    fn add(&mut self, e: ReplyEvent) -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        let (kind, text) = match &e {
            ReplyEvent::Reasoning(t) => ("reasoning", t.clone()),
            ReplyEvent::Content(t) => ("message", t.clone()),
            ReplyEvent::ToolCall { .. } => ("function_call", String::new()),
            ReplyEvent::Arguments { text, .. } => ("arguments", text.clone()),
        };
        let open = self
            .items
            .last()
            .filter(|i| i["status"] == "in_progress")
            .map(|i| i["type"].as_str().unwrap_or("").to_string());
        let continues = match kind {
            "arguments" => true,
            "function_call" => false,
            k => open.as_deref() == Some(k),
        };
        if !continues {
            out.extend(self.close());
            let index = self.items.len();
            let item = match &e {
                ReplyEvent::Reasoning(_) => {
                    json!({"type": "reasoning", "id": self.item_id("rs"), "summary": [], "content": [], "status": "in_progress"})
                }
                ReplyEvent::Content(_) => {
                    json!({"type": "message", "id": self.item_id("msg"), "status": "in_progress", "role": "assistant", "content": []})
                }
                ReplyEvent::ToolCall { id, name, .. } => {
                    json!({"type": "function_call", "id": self.item_id("fc"), "call_id": id, "name": name, "arguments": "", "status": "in_progress"})
                }
                ReplyEvent::Arguments { .. } => unreachable!("arguments continue their call"),
            };
            out.push(("response.output_item.added", json!({"output_index": index, "item": item})));
            if kind == "message" {
                let part = json!({"type": "output_text", "text": "", "annotations": []});
                out.push((
                    "response.content_part.added",
                    json!({"item_id": item["id"], "output_index": index, "content_index": 0, "part": part}),
                ));
            }
            self.items.push(item);
            if kind == "function_call" {
                return out;
            }
        }
        let index = self.items.len() - 1;
        let item = &mut self.items[index];
        let item_id = item["id"].clone();
        match kind {
            "reasoning" => {
                push_text(item, "reasoning_text", &text);
                out.push((
                    "response.reasoning_text.delta",
                    json!({"item_id": item_id, "output_index": index, "content_index": 0, "delta": text}),
                ));
            }
            "message" => {
                push_text(item, "output_text", &text);
                out.push(("response.output_text.delta", json!({"item_id": item_id, "output_index": index, "content_index": 0, "delta": text, "logprobs": []})));
            }
            _ => {
                let args = format!("{}{text}", item["arguments"].as_str().unwrap_or(""));
                item["arguments"] = json!(args);
                out.push((
                    "response.function_call_arguments.delta",
                    json!({"item_id": item_id, "output_index": index, "delta": text}),
                ));
            }
        }
        out
    }

    /// Completes the open item.
    fn close(&mut self) -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        let index = self.items.len().wrapping_sub(1);
        let Some(item) = self.items.last_mut().filter(|i| i["status"] == "in_progress") else { return out };
        let id = item["id"].clone();
        match item["type"].as_str() {
            Some("reasoning") => {
                let text = item["content"][0]["text"].clone();
                out.push((
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
                ));
            }
            Some("message") => {
                let part = item["content"][0].clone();
                out.push(("response.output_text.done", json!({"item_id": id, "output_index": index, "content_index": 0, "text": part["text"], "logprobs": []})));
                out.push((
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                ));
            }
            _ => out.push((
                "response.function_call_arguments.done",
                json!({"item_id": id, "output_index": index, "name": item["name"], "arguments": item["arguments"]}),
            )),
        }
        item["status"] = json!("completed");
        if item["type"] == "reasoning" {
            item.as_object_mut().expect("an object").remove("status");
        }
        out.push(("response.output_item.done", json!({"output_index": index, "item": item.clone()})));
        out
    }
}

/// Appends to an item's single content part of type `kind`.
fn push_text(item: &mut Value, kind: &str, text: &str) {
    let content = item["content"].as_array_mut().expect("a list");
    if content.is_empty() {
        let mut part = json!({"type": kind, "text": ""});
        if kind == "output_text" {
            part["annotations"] = json!([]);
        }
        content.push(part);
    }
    let t = format!("{}{text}", content[0]["text"].as_str().unwrap_or(""));
    content[0]["text"] = json!(t);
}

/// The conversation after the response: its messages and the reply as chat messages.
fn conversation(mut messages: Vec<Value>, output: &[Value]) -> Vec<Value> {
    let mut assistant = json!({"role": "assistant", "content": ""});
    for item in output {
        match item["type"].as_str() {
            Some("message") => assistant["content"] = item["content"][0]["text"].clone(),
            Some("reasoning") => assistant["reasoning_content"] = item["content"][0]["text"].clone(),
            Some("function_call") => {
                let call = json!({"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}});
                match assistant["tool_calls"].as_array_mut() {
                    Some(calls) => calls.push(call),
                    None => assistant["tool_calls"] = json!([call]),
                }
            }
            _ => {}
        }
    }
    messages.push(assistant);
    messages
}

async fn run(
    s: Arc<Shared>,
    body: Value,
    chat: rmlx_lm::chat::ChatRequest,
    settings: Settings,
    messages: Vec<Value>,
) -> Response {
    if settings.n != 1 {
        return error(ApiError::bad_request("the Responses API makes one reply", Some("n")));
    }
    let adapter = match adapters::resolve_model(&s, body.get("model").and_then(Value::as_str)) {
        Ok(a) => a,
        Err(e) => return error(e),
    };
    let model = body.get("model").and_then(Value::as_str).map(str::to_string).unwrap_or_else(|| s.model_id.clone());
    let number = s.next_id.fetch_add(1, Ordering::Relaxed);
    let id = format!("resp_{number}");
    let (mut receivers, formats) = match start_jobs(&s, &id, &Prompt::Chat(chat), &settings, adapter).await {
        Ok(started) => started,
        Err(e) => return error(e),
    };
    let rx = receivers.pop().expect("one job");
    let format = formats.into_iter().next().flatten().unwrap_or_default();
    let parser = ReplyParser::new(format, &call_id_prefix(&id));
    let store = body.get("store").and_then(Value::as_bool).unwrap_or(true);
    let state =
        Run { s, body, id, model, rx, parser, output: Output::new(&number.to_string()), messages, store, seq: 0 };
    if settings.stream {
        return Sse::new(state.stream()).into_response();
    }
    state.whole().await
}

struct Run {
    s: Arc<Shared>,
    body: Value,
    id: String,
    model: String,
    rx: tokio::sync::mpsc::UnboundedReceiver<Event>,
    parser: ReplyParser,
    output: Output,
    messages: Vec<Value>,
    store: bool,
    seq: u64,
}

impl Run {
    /// The next event of the generation, or the error that ends it.
    async fn next(&mut self) -> Result<Option<(String, Option<(&'static str, Usage)>)>, ApiError> {
        let mut cut = self.s.cut.clone();
        let event = tokio::select! {
            e = self.rx.recv() => e,
            _ = cut.wait_for(|&c| c) => return Err(shutting_down()),
        };
        match event {
            Some(Event::Token { text, .. }) => Ok(Some((text, None))),
            Some(Event::Done { finish_reason, usage }) => Ok(Some((String::new(), Some((finish_reason, usage))))),
            Some(Event::Failed(e)) => Err(e),
            Some(Event::Started { .. }) => Ok(Some((String::new(), None))),
            None => Err(ApiError { status: 500, message: "the generation loop stopped".into(), param: None }),
        }
    }

    /// The finished response (kept for `previous_response_id` when `store` is on).
    fn finish(&mut self, reason: &str, usage: &Usage) -> Value {
        self.output.close();
        let status = if reason == "length" { "incomplete" } else { "completed" };
        let response =
            response_object(&self.id, &self.body, &self.model, status, self.output.items.clone(), Some(usage));
        if self.store {
            let conversation = conversation(std::mem::take(&mut self.messages), &self.output.items);
            self.s.responses.put(self.id.clone(), conversation, response.clone());
        }
        response
    }

    async fn whole(mut self) -> Response {
        loop {
            match self.next().await {
                Err(e) => return error(e),
                Ok(None) => {}
                Ok(Some((text, done))) => {
                    let mut events = self.parser.push(&text);
                    if done.is_some() {
                        events.extend(self.parser.finish());
                    }
                    for e in events {
                        self.output.add(e);
                    }
                    if let Some((reason, usage)) = done {
                        return Json(self.finish(reason, &usage)).into_response();
                    }
                }
            }
        }
    }

    fn event(&mut self, kind: &str, mut payload: Value) -> Result<SseEvent, Infallible> {
        payload["type"] = json!(kind);
        payload["sequence_number"] = json!(self.seq);
        self.seq += 1;
        Ok(SseEvent::default().event(kind).data(payload.to_string()))
    }

    fn stream(self) -> impl Stream<Item = Result<SseEvent, Infallible>> {
        use futures_util::StreamExt;
        stream::unfold((self, 0u8), |(mut st, phase)| async move {
            match phase {
                0 => {
                    let r = response_object(&st.id, &st.body, &st.model, "in_progress", Vec::new(), None);
                    let items = vec![
                        st.event("response.created", json!({"response": r.clone()})),
                        st.event("response.in_progress", json!({"response": r})),
                    ];
                    Some((stream::iter(items), (st, 1)))
                }
                1 => loop {
                    match st.next().await {
                        Err(e) => {
                            let mut body = e.body();
                            body["message"] = body["error"]["message"].clone();
                            let items = vec![st.event("error", body)];
                            return Some((stream::iter(items), (st, 2)));
                        }
                        Ok(None) => {}
                        Ok(Some((text, done))) => {
                            let mut events = st.parser.push(&text);
                            if done.is_some() {
                                events.extend(st.parser.finish());
                            }
                            let mut changes = Vec::new();
                            for e in events {
                                changes.extend(st.output.add(e));
                            }
                            if let Some((reason, usage)) = done {
                                changes.extend(st.output.close());
                                let response = st.finish(reason, &usage);
                                let kind = if response["status"] == "incomplete" {
                                    "response.incomplete"
                                } else {
                                    "response.completed"
                                };
                                changes.push((kind, json!({"response": response})));
                                let items: Vec<_> = changes.into_iter().map(|(k, p)| st.event(k, p)).collect();
                                return Some((stream::iter(items), (st, 2)));
                            }
                            if changes.is_empty() {
                                continue;
                            }
                            let items: Vec<_> = changes.into_iter().map(|(k, p)| st.event(k, p)).collect();
                            return Some((stream::iter(items), (st, 1)));
                        }
                    }
                },
                _ => None,
            }
        })
        .flatten()
    }
}
