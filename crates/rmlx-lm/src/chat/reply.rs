//! An assistant's reply taken apart as it arrives: its reasoning (`<think>…</think>`, or
//! gpt-oss's analysis channel), its answer, and the tool calls it makes in its model's format
//! ([`ToolFormat`]). [`ReplyParser`] turns text pieces into [`ReplyEvent`]s — what OpenAI's stream
//! sends as `delta.reasoning_content`, `delta.content` and `delta.tool_calls` (a call's id and
//! name first, then its arguments in pieces) — and [`Reply`] gathers them into the whole message.
//!
//! Text that may still become a marker is held back until it is known; a call whose text is not
//! a call after all (not JSON, no name) becomes part of the answer as written.
//!
//! ```
//! use rmlx_lm::chat::{Reply, ReplyFormat, ToolFormat};
//! let format = ReplyFormat { think: Some(Default::default()), tools: Some(ToolFormat::Hermes), ..Default::default() };
//! let text = "<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
//! let reply = Reply::parse(&format, text, "call_");
//! assert_eq!(reply.reasoning.as_deref(), Some("The user wants weather."));
//! assert_eq!(reply.content, "");
//! assert_eq!(reply.tool_calls[0].name, "weather");
//! assert_eq!(reply.tool_calls[0].arguments, r#"{"city": "Oslo"}"#);
//! ```

use super::scan::{self, partial_marker, CallScan};
use super::tools::ToolFormat;
use serde::{Deserialize, Serialize};

/// How a model marks its thinking.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Think {
    pub start: String,
    pub end: String,
    /// The prompt already opened the thinking (DeepSeek-R1's templates end with `<think>\n`):
    /// the reply starts inside it.
    pub open: bool,
}

impl Default for Think {
    fn default() -> Think {
        Think { start: "<think>".into(), end: "</think>".into(), open: false }
    }
}

/// What to look for in a reply.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplyFormat {
    /// Thinking to split off (`None`: the model does not think, or the format is harmony's).
    pub think: Option<Think>,
    /// The tool-call format, when the request offered tools.
    pub tools: Option<ToolFormat>,
    /// OpenAI's harmony channels (gpt-oss): analysis is reasoning, final is the answer,
    /// commentary addressed `to=functions.NAME` is a call.
    pub harmony: bool,
}

/// A tool call of the reply.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as the model wrote them (a JSON object's text).
    pub arguments: String,
}

/// One piece of a reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplyEvent {
    Reasoning(String),
    Content(String),
    /// A call begins: its index among the reply's calls, id and function name.
    ToolCall {
        index: usize,
        id: String,
        name: String,
    },
    /// More of call `index`'s arguments.
    Arguments {
        index: usize,
        text: String,
    },
}

/// A whole reply.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reply {
    pub reasoning: Option<String>,
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

impl Reply {
    /// Gathers events into the message they make.
    pub fn collect(events: impl IntoIterator<Item = ReplyEvent>) -> Reply {
        let mut r = Reply::default();
        for e in events {
            r.add(e);
        }
        r
    }

    /// Adds one event.
    pub fn add(&mut self, e: ReplyEvent) {
        match e {
            ReplyEvent::Reasoning(t) => self.reasoning.get_or_insert_with(String::new).push_str(&t),
            ReplyEvent::Content(t) => self.content.push_str(&t),
            ReplyEvent::ToolCall { id, name, .. } => {
                self.tool_calls.push(ToolCall { id, name, arguments: String::new() })
            }
            ReplyEvent::Arguments { index, text } => self.tool_calls[index].arguments.push_str(&text),
        }
    }

    /// A whole reply's text taken apart (call ids are `id_prefix` and a number).
    pub fn parse(format: &ReplyFormat, text: &str, id_prefix: &str) -> Reply {
        let mut p = ReplyParser::new(format.clone(), id_prefix);
        let mut events = p.push(text);
        events.extend(p.finish());
        Reply::collect(events)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Text,
    Thinking,
    /// Inside a call's text, begun by this marker (empty: a bare JSON call, Llama 3's).
    Call,
    /// Harmony: reading a message header up to `<|message|>`.
    Header,
    /// Harmony: a message body.
    Body,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Channel {
    Reasoning,
    Content,
    Call,
}

/// What one call of the current call text has sent.
#[derive(Clone, Debug, Default)]
struct Sent {
    begun: bool,
    args: usize,
    done: bool,
}

/// Takes a reply apart as its text arrives; see the module documentation.
pub struct ReplyParser {
    format: ReplyFormat,
    id_prefix: String,
    state: State,
    /// Text received and not yet handed out.
    held: String,
    /// The text of the current call (its marker excluded).
    call: String,
    marker: &'static str,
    sent: Vec<Sent>,
    /// Calls handed out before the current call text.
    calls: usize,
    /// Nothing but whitespace has been handed out as content yet.
    fresh: bool,
    trim_next: bool,
    harmony_channel: Channel,
}

const HARMONY_MESSAGE: &str = "<|message|>";
const HARMONY_ENDS: [&str; 3] = ["<|end|>", "<|call|>", "<|return|>"];

impl ReplyParser {
    /// A parser for one reply; call ids are `id_prefix` followed by the call's number.
    pub fn new(format: ReplyFormat, id_prefix: &str) -> ReplyParser {
        let state = if format.harmony {
            State::Text
        } else if format.think.as_ref().is_some_and(|t| t.open) {
            State::Thinking
        } else {
            State::Text
        };
        ReplyParser {
            trim_next: state == State::Thinking,
            format,
            id_prefix: id_prefix.to_string(),
            state,
            held: String::new(),
            call: String::new(),
            marker: "",
            sent: Vec::new(),
            calls: 0,
            fresh: true,
            harmony_channel: Channel::Content,
        }
    }

    /// The events `piece` completes.
    pub fn push(&mut self, piece: &str) -> Vec<ReplyEvent> {
        self.held.push_str(piece);
        let mut out = Vec::new();
        while self.step(&mut out, false) {}
        out
    }

    /// The events of what is still held, at the reply's end.
    pub fn finish(&mut self) -> Vec<ReplyEvent> {
        let mut out = Vec::new();
        while self.step(&mut out, true) {}
        out
    }

    /// The tool calls begun so far.
    pub fn tool_calls(&self) -> usize {
        self.calls + self.sent.iter().filter(|s| s.begun).count()
    }

    fn content(&mut self, out: &mut Vec<ReplyEvent>, text: &str) {
        let text = if self.trim_next { text.trim_start() } else { text };
        if text.is_empty() {
            return;
        }
        self.trim_next = false;
        if !text.trim().is_empty() {
            self.fresh = false;
        }
        match out.last_mut() {
            Some(ReplyEvent::Content(t)) => t.push_str(text),
            _ => out.push(ReplyEvent::Content(text.to_string())),
        }
    }

    fn reasoning(&mut self, out: &mut Vec<ReplyEvent>, text: &str) {
        let text = if self.trim_next { text.trim_start_matches('\n') } else { text };
        if text.is_empty() {
            return;
        }
        self.trim_next = false;
        match out.last_mut() {
            Some(ReplyEvent::Reasoning(t)) => t.push_str(text),
            _ => out.push(ReplyEvent::Reasoning(text.to_string())),
        }
    }

    /// The markers that open something in plain text: the thinking's (before any answer), and
    /// the calls'.
    fn openers(&self) -> Vec<String> {
        let mut m = Vec::new();
        if let Some(t) = self.format.think.as_ref().filter(|_| self.fresh) {
            // Only where the reply begins (after whitespace).
            let begun = self.held.trim_start();
            if begun.starts_with(&t.start) || t.start.starts_with(begun) {
                m.push(t.start.clone());
            }
        }
        if let Some(f) = &self.format.tools {
            m.extend(f.call_markers().iter().map(|s| s.to_string()));
        }
        m
    }

    /// Handles what it can of `held`; returns whether to go on.
    fn step(&mut self, out: &mut Vec<ReplyEvent>, end: bool) -> bool {
        if self.format.harmony {
            return self.harmony_step(out, end);
        }
        match self.state {
            State::Text => {
                let markers = self.openers();
                // Llama 3's calls are a bare JSON reply.
                if self.fresh && self.format.tools.as_ref().is_some_and(ToolFormat::bare_json) {
                    let t = self.held.trim_start();
                    if t.starts_with('{') {
                        self.held = t.to_string();
                        self.begin_call("");
                        return true;
                    }
                    if t.is_empty() && !end {
                        return false;
                    }
                }
                let found = markers.iter().filter_map(|m| self.held.find(m.as_str()).map(|i| (i, m.clone()))).min();
                if let Some((i, m)) = found {
                    let before = self.held[..i].to_string();
                    self.held.drain(..i + m.len());
                    self.content(out, &before);
                    let tools = self.format.tools.as_ref().map(ToolFormat::call_markers).unwrap_or_default();
                    match tools.iter().find(|t| **t == m) {
                        Some(call) => self.begin_call(call),
                        None => {
                            self.state = State::Thinking;
                            self.trim_next = true;
                        }
                    }
                    return true;
                }
                let refs: Vec<&str> = markers.iter().map(String::as_str).collect();
                let keep = if end { 0 } else { partial_marker(&self.held, &refs) };
                let ready = self.held[..self.held.len() - keep].to_string();
                self.held.drain(..ready.len());
                self.content(out, &ready);
                false
            }
            State::Thinking => {
                let close = self.format.think.as_ref().map(|t| t.end.clone()).unwrap_or_default();
                if let Some(i) = self.held.find(&close) {
                    let text = self.held[..i].trim_end_matches('\n').to_string();
                    self.held.drain(..i + close.len());
                    self.reasoning(out, &text);
                    self.state = State::Text;
                    self.trim_next = true;
                    return true;
                }
                // Newlines before the end (and before what may become it) are the template's, not
                // the reasoning's: held until more reasoning follows them.
                let keep = if end {
                    0
                } else {
                    let partial = partial_marker(&self.held, &[&close]);
                    let before = &self.held[..self.held.len() - partial];
                    partial + before.len() - before.trim_end_matches('\n').len()
                };
                let ready = self.held[..self.held.len() - keep].to_string();
                self.held.drain(..ready.len());
                self.reasoning(out, &ready);
                false
            }
            State::Call => self.call_step(out, end),
            State::Header | State::Body => unreachable!("harmony states without harmony"),
        }
    }

    fn begin_call(&mut self, marker: &'static str) {
        self.state = State::Call;
        self.marker = marker;
        self.call.clear();
        self.sent.clear();
    }

    /// Inside a call: read its text, hand out what is known, and leave it at its end marker.
    fn call_step(&mut self, out: &mut Vec<ReplyEvent>, end: bool) -> bool {
        let format = self.format.tools.clone().expect("a call without a tool format");
        let close = format.call_end(self.marker);
        let mut closed = false;
        match close.and_then(|c| self.held.find(c).map(|i| (i, c))) {
            Some((i, c)) => {
                self.call.push_str(&self.held[..i]);
                self.held.drain(..i + c.len());
                closed = true;
            }
            None => {
                let keep = match (close, end) {
                    (Some(c), false) => partial_marker(&self.held, &[c]),
                    _ => 0,
                };
                let take = self.held.len() - keep;
                self.call.push_str(&self.held[..take]);
                self.held.drain(..take);
            }
        }
        let last = closed || end;
        let calls = format.scan(&self.call);
        match calls {
            Ok(calls) => {
                let all_done = !calls.is_empty() && calls.iter().all(|c| c.end.is_some() && c.name.is_some());
                let any_begun = self.sent.iter().any(|s| s.begun);
                if last && !all_done && !any_begun {
                    self.abandon_call(out, close.filter(|_| closed));
                } else {
                    self.send_calls(&format, &calls, out);
                    if last {
                        self.finish_call(closed);
                    }
                }
            }
            Err(()) => {
                if self.sent.iter().any(|s| s.begun) {
                    // Text after the calls that is not a call: it is the answer's.
                    if last {
                        self.finish_call(closed);
                    }
                } else {
                    self.abandon_call(out, close.filter(|_| closed));
                }
            }
        }
        !end && self.state == State::Text
    }

    /// The call text was not a call: it is content, as written.
    fn abandon_call(&mut self, out: &mut Vec<ReplyEvent>, close: Option<&str>) {
        let mut text = format!("{}{}", self.marker, self.call);
        if let Some(c) = close {
            text.push_str(c);
        }
        self.call.clear();
        self.sent.clear();
        self.state = State::Text;
        // Handed out as it is: the marker it holds is not looked for again.
        self.content(out, &text);
    }

    fn finish_call(&mut self, closed: bool) {
        self.calls += self.sent.iter().filter(|s| s.begun).count();
        self.sent.clear();
        self.call.clear();
        self.state = State::Text;
        self.trim_next = closed;
        self.fresh = false;
    }

    fn send_calls(&mut self, format: &ToolFormat, calls: &[CallScan], out: &mut Vec<ReplyEvent>) {
        let bytes = self.call.as_bytes();
        for (k, call) in calls.iter().enumerate() {
            if self.sent.len() <= k {
                self.sent.push(Sent::default());
            }
            if self.sent[k].done {
                continue;
            }
            let Some(name) = &call.name else { continue };
            let complete = call.end.is_some();
            let string_args = call.args_are_string(bytes);
            // The arguments go out as they arrive when they are an object's text; a string holding
            // them, or none at all, once the call is whole.
            let streamable = call.args.is_some() && !string_args && !format.converts_arguments();
            if !(streamable || complete) {
                continue;
            }
            let index = self.calls + k;
            if !self.sent[k].begun {
                self.sent[k].begun = true;
                let id = format!("{}{index}", self.id_prefix);
                out.push(ReplyEvent::ToolCall { index, id, name: name.clone() });
            }
            let text = if streamable {
                let a = call.args.unwrap();
                let piece = self.call[a.start + self.sent[k].args..a.end].to_string();
                self.sent[k].args = a.end - a.start;
                piece
            } else {
                format.arguments(&self.call, call)
            };
            if !text.is_empty() {
                out.push(ReplyEvent::Arguments { index, text });
            }
            if complete {
                self.sent[k].done = true;
            }
        }
    }

    fn harmony_step(&mut self, out: &mut Vec<ReplyEvent>, end: bool) -> bool {
        match self.state {
            State::Text | State::Header => {
                // Before a message: a header (`<|channel|>final`, `<|start|>assistant to=…`), or
                // text of a model that writes no channels.
                let opener = ["<|channel|>", "<|start|>"].iter().filter_map(|m| self.held.find(m)).min();
                if self.state == State::Text {
                    if let Some(i) = opener {
                        let before = self.held[..i].to_string();
                        self.held.drain(..i);
                        self.content(out, &before);
                        self.state = State::Header;
                        return true;
                    }
                    let keep = if end { 0 } else { partial_marker(&self.held, &["<|channel|>", "<|start|>"]) };
                    let ready = self.held[..self.held.len() - keep].to_string();
                    self.held.drain(..ready.len());
                    self.content(out, &ready);
                    return false;
                }
                let Some(i) = self.held.find(HARMONY_MESSAGE) else { return false };
                let header = self.held[..i].to_string();
                self.held.drain(..i + HARMONY_MESSAGE.len());
                let channel = header
                    .split("<|channel|>")
                    .nth(1)
                    .map(|c| c.split(|ch: char| ch.is_whitespace() || ch == '<').next().unwrap_or("").to_string());
                let recipient = header
                    .split("to=")
                    .nth(1)
                    .map(|r| r.split(|ch: char| ch.is_whitespace() || ch == '<').next().unwrap_or("").to_string());
                self.harmony_channel = match (channel.as_deref(), recipient) {
                    (_, Some(r)) if r.starts_with("functions.") => {
                        let index = self.calls;
                        self.calls += 1;
                        let id = format!("{}{index}", self.id_prefix);
                        out.push(ReplyEvent::ToolCall { index, id, name: r["functions.".len()..].to_string() });
                        Channel::Call
                    }
                    (Some("analysis"), _) => Channel::Reasoning,
                    _ => Channel::Content,
                };
                self.state = State::Body;
                true
            }
            State::Body => {
                let found = HARMONY_ENDS.iter().filter_map(|m| self.held.find(m).map(|i| (i, *m))).min();
                let (text, done) = match found {
                    Some((i, m)) => {
                        let t = self.held[..i].to_string();
                        self.held.drain(..i + m.len());
                        (t, true)
                    }
                    None => {
                        let keep = if end { 0 } else { partial_marker(&self.held, &HARMONY_ENDS) };
                        let t = self.held[..self.held.len() - keep].to_string();
                        self.held.drain(..t.len());
                        (t, false)
                    }
                };
                if !text.is_empty() {
                    match self.harmony_channel {
                        Channel::Reasoning => self.reasoning(out, &text),
                        Channel::Content => self.content(out, &text),
                        Channel::Call => out.push(ReplyEvent::Arguments { index: self.calls - 1, text }),
                    }
                }
                if done {
                    self.state = State::Text;
                }
                done
            }
            State::Thinking | State::Call => unreachable!("no thinking or call state in harmony"),
        }
    }
}

/// Call scanning per format, shared by the parser.
impl ToolFormat {
    pub(crate) fn scan(&self, text: &str) -> Result<Vec<CallScan>, ()> {
        let b = text.as_bytes();
        match self {
            ToolFormat::Mistral => {
                let t = text.trim_start();
                if t.starts_with('[') || t.starts_with('{') {
                    scan::scan_calls(b)
                } else {
                    scan::scan_named_args(b)
                }
            }
            ToolFormat::FunctionGemma => super::tools::scan_function_gemma(text),
            _ => scan::scan_calls(b),
        }
    }

    /// The arguments of a complete call as a JSON object's text.
    pub(crate) fn arguments(&self, text: &str, call: &CallScan) -> String {
        match (self, call.args) {
            (ToolFormat::FunctionGemma, _) => super::tools::function_gemma_arguments(text, call),
            (_, Some(a)) => {
                let raw = &text[a.start..a.end];
                if raw.starts_with('"') {
                    serde_json::from_str::<String>(raw).unwrap_or_else(|_| raw.to_string())
                } else {
                    raw.to_string()
                }
            }
            (_, None) => "{}".to_string(),
        }
    }
}
