//! OpenAI's shapes: the chat and text completion requests (the fields rmlx reads; fields it does
//! not implement that would change the answer — `echo`, `best_of`, `suffix`, tools in a text
//! completion — are refused with 400; unknown ones are ignored, as OpenAI-compatible servers do),
//! chat messages with tool calls and tool results, the responses and stream chunks, and the error
//! body.

use rmlx_lm::chat::{ToolChoice, ToolFormat};
use rmlx_lm::grammar::Grammar;
use rmlx_lm::sample::SamplerConfig;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashMap;

/// An error as OpenAI returns it: an HTTP status and `{"error": {message, type, param, code}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub param: Option<&'static str>,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError { status: 400, message: message.into(), param }
    }

    pub fn body(&self) -> Value {
        let kind = match self.status {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 | 503 => "server_overloaded",
            s if s >= 500 => "server_error",
            _ => "invalid_request_error",
        };
        json!({"error": {"message": self.message, "type": kind, "param": self.param, "code": Value::Null}})
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

#[derive(Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The fields both endpoints share.
#[derive(Deserialize)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<OneOrMany>,
    pub n: Option<usize>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub logit_bias: Option<HashMap<String, f32>>,
    /// Chat: `true` for each token's log-probability; completions: how many alternatives.
    pub logprobs: Option<Value>,
    /// Chat: how many alternatives per token (0 to 20), with `logprobs: true`.
    pub top_logprobs: Option<usize>,
    pub response_format: Option<Value>,
    /// Completions: echo the prompt before the completion (not supported: refused, not ignored).
    pub echo: Option<bool>,
    /// Completions: candidates generated server-side (only 1).
    pub best_of: Option<usize>,
    /// Completions: text after the insertion point (not supported).
    pub suffix: Option<Value>,
    /// Tool calling: read by chat requests (their own fields take these keys first), refused by
    /// text completions.
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
    /// rmlx's own: `false` keeps a server started with speculative decoding from drafting for
    /// this request (the output is the same either way; only its speed differs).
    pub speculative: Option<bool>,
}

/// A field rmlx does not implement and must not ignore: 400 naming it when it asks for anything.
fn refuse_unsupported(name: &'static str, v: &Option<Value>, neutral: &[Value]) -> Result<(), ApiError> {
    match v {
        Some(v) if !v.is_null() && !neutral.contains(v) && v.as_array().is_none_or(|a| !a.is_empty()) => {
            Err(ApiError::bad_request(format!("`{name}` is not supported by this server"), Some(name)))
        }
        _ => Ok(()),
    }
}

/// The most stop sequences a request may give (OpenAI's limit).
pub const MAX_STOP: usize = 4;

/// The most choices (`n`) one request may ask for.
pub const MAX_CHOICES: usize = 16;

/// The most alternatives per token a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// What a request asks the engine for, checked.
pub struct Settings {
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Alternatives per token when log-probabilities are asked for.
    pub logprobs: Option<usize>,
    /// Choices to generate.
    pub n: usize,
    /// What `response_format` constrains the output to.
    pub grammar: Option<Grammar>,
    /// Whether a speculating server may draft for it.
    pub speculative: bool,
}

impl Common {
    /// The generation settings, or a 400 naming the field that cannot be honoured. OpenAI's
    /// defaults: temperature 1, top_p 1; `max_tokens` defaults to `default_max_tokens`.
    pub fn settings(self, default_max_tokens: usize) -> Result<Settings, ApiError> {
        refuse_unsupported("echo", &self.echo.map(Value::Bool), &[Value::Bool(false)])?;
        refuse_unsupported("best_of", &self.best_of.map(Value::from), &[Value::from(1)])?;
        refuse_unsupported("suffix", &self.suffix, &[Value::from("")])?;
        // Chat requests take these fields themselves; text completions have no tools.
        refuse_unsupported("tools", &self.tools, &[])?;
        refuse_unsupported("tool_choice", &self.tool_choice, &[Value::from("none")])?;
        refuse_unsupported("functions", &self.functions, &[])?;
        refuse_unsupported("function_call", &self.function_call, &[Value::from("none")])?;
        let n = self.n.unwrap_or(1);
        if !(1..=MAX_CHOICES).contains(&n) {
            return Err(ApiError::bad_request(format!("n must be between 1 and {MAX_CHOICES}, got {n}"), Some("n")));
        }
        if self.top_logprobs.is_some() && !matches!(self.logprobs, Some(Value::Bool(true))) {
            return Err(ApiError::bad_request("top_logprobs needs logprobs: true", Some("top_logprobs")));
        }
        let logprobs = match &self.logprobs {
            None | Some(Value::Null) | Some(Value::Bool(false)) => None,
            Some(Value::Bool(true)) => Some(self.top_logprobs.unwrap_or(0)),
            Some(v) => match v.as_u64() {
                Some(n) => Some(n as usize),
                None => {
                    return Err(ApiError::bad_request(
                        format!("logprobs must be a boolean (chat) or a count (completions), got {v}"),
                        Some("logprobs"),
                    ))
                }
            },
        };
        if let Some(n) = logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return Err(ApiError::bad_request(
                format!("at most {MAX_TOP_LOGPROBS} alternatives per token, got {n}"),
                Some("top_logprobs"),
            ));
        }
        let grammar = match &self.response_format {
            None | Some(Value::Null) => None,
            Some(f) => response_format(f)?,
        };
        let mut logit_bias = Vec::new();
        for (id, bias) in self.logit_bias.unwrap_or_default() {
            let id = id.parse::<u32>().map_err(|_| {
                ApiError::bad_request(format!("logit_bias key `{id}` is not a token id"), Some("logit_bias"))
            })?;
            if !(-100.0..=100.0).contains(&bias) {
                return Err(ApiError::bad_request(
                    format!("logit_bias values must be between -100 and 100, got {bias} for token {id}"),
                    Some("logit_bias"),
                ));
            }
            logit_bias.push((id, bias));
        }
        logit_bias.sort_by_key(|&(id, _)| id);
        let defaults = SamplerConfig::default();
        let sampler = SamplerConfig {
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(0),
            min_p: self.min_p.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            logit_bias,
            seed: self.seed,
            ..defaults
        };
        sampler.validate().map_err(|e| ApiError::bad_request(e.to_string(), None))?;
        let (max_tokens, field) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) => (m, "max_completion_tokens"),
            (None, Some(m)) => (m, "max_tokens"),
            (None, None) => (default_max_tokens, "max_tokens"),
        };
        if max_tokens == 0 {
            return Err(ApiError::bad_request(format!("{field} must be at least 1"), Some(field)));
        }
        let stop = self.stop.map(OneOrMany::into_vec).unwrap_or_default();
        if stop.len() > MAX_STOP {
            return Err(ApiError::bad_request(
                format!("at most {MAX_STOP} stop sequences, got {}", stop.len()),
                Some("stop"),
            ));
        }
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::bad_request("stop sequences must not be empty", Some("stop")));
        }
        Ok(Settings {
            max_tokens,
            sampler,
            stop,
            stream: self.stream,
            include_usage: self.stream_options.is_some_and(|o| o.include_usage),
            logprobs,
            n,
            grammar,
            speculative: self.speculative.unwrap_or(true),
        })
    }
}

/// `response_format` ([`Grammar::from_response_format`]) as a 400 naming the field.
fn response_format(f: &Value) -> Result<Option<Grammar>, ApiError> {
    Grammar::from_response_format(f).map_err(|e| {
        let m = match e {
            rmlx_lm::Error::InvalidParameter(m) => m,
            e => e.to_string(),
        };
        ApiError::bad_request(m, Some("response_format"))
    })
}

/// A chat completion request: the messages and what the chat fields add to [`Common`].
#[derive(Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Value>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// The legacy form of `tools` and `tool_choice`.
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
    /// Template variables (vLLM's and SGLang's field): `{"enable_thinking": false}`, ...
    pub chat_template_kwargs: Option<Value>,
    /// Shorthands for the template variables of the same names.
    pub enable_thinking: Option<bool>,
    pub reasoning_effort: Option<String>,
    #[serde(flatten)]
    pub common: Common,
}

/// What the server adds to every chat request: `--chat-template-args` and `--tool-parser`.
#[derive(Clone, Default)]
pub struct ChatDefaults {
    pub template_args: serde_json::Map<String, Value>,
    pub tool_format: Option<ToolFormat>,
}

impl ChatRequest {
    /// The request for the template: messages in the shape templates read, tools, tool choice
    /// and template variables; a 400 naming what is wrong.
    pub fn chat(&self, defaults: &ChatDefaults) -> Result<rmlx_lm::chat::ChatRequest, ApiError> {
        let messages = self.messages()?;
        let legacy = self.functions.as_ref().filter(|f| !f.is_null());
        let (tools, choice_field) = match (&self.tools, legacy) {
            (Some(t), _) if !t.is_null() => (t.clone(), ("tool_choice", &self.tool_choice)),
            (_, Some(f)) => {
                let wrapped =
                    f.as_array().map(|fs| fs.iter().map(|f| json!({"type": "function", "function": f})).collect());
                (Value::Array(wrapped.unwrap_or_default()), ("function_call", &self.function_call))
            }
            _ => (Value::Array(Vec::new()), ("tool_choice", &self.tool_choice)),
        };
        let Value::Array(tools) = tools else {
            return Err(ApiError::bad_request("tools must be a list of tool objects", Some("tools")));
        };
        for (i, t) in tools.iter().enumerate() {
            if t.get("type").and_then(Value::as_str).is_some_and(|k| k != "function") {
                return Err(ApiError::bad_request(
                    format!("tools[{i}]: only tools of type `function` are supported"),
                    Some("tools"),
                ));
            }
            rmlx_lm::chat::tool_signature(t)
                .map_err(|e| ApiError::bad_request(format!("tools[{i}]: {}", invalid(e)), Some("tools")))?;
        }
        let tool_choice = match choice_field.1 {
            None => ToolChoice::Auto,
            Some(v) => ToolChoice::from_json(v).map_err(|e| ApiError::bad_request(invalid(e), Some(choice_field.0)))?,
        };
        let mut template_args = defaults.template_args.clone();
        match &self.chat_template_kwargs {
            None | Some(Value::Null) => {}
            Some(Value::Object(o)) => template_args.extend(o.clone()),
            Some(_) => {
                return Err(ApiError::bad_request(
                    "chat_template_kwargs must be an object",
                    Some("chat_template_kwargs"),
                ))
            }
        }
        if let Some(t) = self.enable_thinking {
            template_args.insert("enable_thinking".into(), Value::Bool(t));
        }
        if let Some(e) = &self.reasoning_effort {
            template_args.insert("reasoning_effort".into(), Value::String(e.clone()));
        }
        Ok(rmlx_lm::chat::ChatRequest {
            messages,
            tools,
            tool_choice,
            parallel_tool_calls: self.parallel_tool_calls.unwrap_or(true),
            template_args,
            tool_format: defaults.tool_format.clone(),
        })
    }

    /// The messages as templates read them: `developer` is `system`, content parts are joined,
    /// an assistant's `tool_calls` and a tool result's `tool_call_id` and `name` are kept.
    fn messages(&self) -> Result<Vec<Value>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::bad_request("messages must not be empty", Some("messages")));
        }
        self.messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                message(m).map_err(|why| ApiError::bad_request(format!("messages[{i}]: {why}"), Some("messages")))
            })
            .collect()
    }
}

/// The text of [`rmlx_lm::Error::InvalidParameter`] without its prefix.
fn invalid(e: rmlx_lm::Error) -> String {
    match e {
        rmlx_lm::Error::InvalidParameter(m) => m,
        e => e.to_string(),
    }
}

/// A message's content: a string, or a list of parts of which the text ones are joined; `None`
/// for a null or missing one.
pub fn content_text(content: Option<&Value>) -> Result<Option<String>, String> {
    match content {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(t)) => Ok(Some(t.clone())),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for p in parts {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("(none)");
                match (kind, p.get("text").and_then(Value::as_str)) {
                    ("text" | "input_text" | "output_text", Some(t)) => text.push_str(t),
                    ("text" | "input_text" | "output_text", None) => return Err("a text part has no `text`".into()),
                    (kind, _) => return Err(format!("content parts of type `{kind}` are not supported")),
                }
            }
            Ok(Some(text))
        }
        Some(other) => Err(format!("`content` must be a string or a list of parts, got {other}")),
    }
}

fn message(m: &Value) -> Result<Value, String> {
    let role = m.get("role").and_then(Value::as_str).ok_or("a message needs a `role`")?;
    let content = content_text(m.get("content"))?;
    let mut out = serde_json::Map::new();
    let role = match role {
        "system" | "developer" => "system",
        "user" => "user",
        "assistant" => {
            let calls = m.get("tool_calls").filter(|c| !c.is_null());
            if let Some(calls) = calls {
                let list = calls.as_array().ok_or("`tool_calls` must be a list")?;
                for (k, c) in list.iter().enumerate() {
                    let f = c.get("function").ok_or(format!("tool_calls[{k}] has no `function`"))?;
                    f.get("name").and_then(Value::as_str).ok_or(format!("tool_calls[{k}].function has no `name`"))?;
                }
                out.insert("tool_calls".into(), calls.clone());
            }
            if let Some(r) = ["reasoning_content", "reasoning"].iter().find_map(|k| m.get(*k).and_then(Value::as_str)) {
                out.insert("reasoning_content".into(), Value::String(r.to_string()));
            }
            if content.is_none() && calls.is_none() {
                return Err("`content` is missing or null (and there are no `tool_calls`)".into());
            }
            "assistant"
        }
        "tool" | "function" => {
            for key in ["tool_call_id", "name"] {
                if let Some(v) = m.get(key).filter(|v| !v.is_null()) {
                    out.insert(key.into(), v.clone());
                }
            }
            "tool"
        }
        other => return Err(format!("unknown role `{other}` (system, developer, user, assistant or tool)")),
    };
    let content = match content {
        Some(c) => c,
        None if role == "assistant" => String::new(),
        None => return Err("`content` is missing or null".into()),
    };
    out.insert("role".into(), Value::String(role.into()));
    out.insert("content".into(), Value::String(content));
    Ok(Value::Object(out))
}

#[derive(Deserialize)]
pub struct CompletionRequest {
    pub prompt: OneOrMany,
    #[serde(flatten)]
    pub common: Common,
}

impl CompletionRequest {
    pub fn prompt(&self) -> Result<String, ApiError> {
        match &self.prompt {
            OneOrMany::One(s) => Ok(s.clone()),
            OneOrMany::Many(v) if v.len() == 1 => Ok(v[0].clone()),
            OneOrMany::Many(_) => {
                Err(ApiError::bad_request("a list of several prompts is not supported yet", Some("prompt")))
            }
        }
    }
}

/// A token's log-probability and the most likely alternatives, with their texts.
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// `usage`, with the prompt tokens whose keys and values came from the prompt cache and, from
/// speculative decoding, the drafted tokens kept and rejected (OpenAI's prediction counts).
pub fn usage(u: &rmlx_lm::engine::Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {
            "accepted_prediction_tokens": u.accepted_draft_tokens,
            "rejected_prediction_tokens": u.draft_tokens - u.accepted_draft_tokens,
        },
    })
}

/// Chat's `logprobs` of some tokens: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
pub fn chat_logprobs(tokens: &[&TokenLogprob]) -> Value {
    let entry = |t: &str, lp: f32| json!({"token": t, "logprob": lp, "bytes": t.as_bytes()});
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(&t.token, t.logprob);
            e["top_logprobs"] = t.top.iter().map(|(s, lp)| entry(s, *lp)).collect();
            e
        })
        .collect();
    json!({"content": content})
}

/// Completions' `logprobs`: parallel lists of tokens, their log-probabilities, the alternatives
/// (a map per token) and each token's offset in the text.
pub fn text_logprobs(tokens: &[&TokenLogprob], start: usize) -> Value {
    let mut offset = start;
    let mut offsets = Vec::new();
    for t in tokens {
        offsets.push(offset);
        offset += t.token.len();
    }
    json!({
        "tokens": tokens.iter().map(|t| t.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": tokens.iter().map(|t| t.top.iter().map(|(s, lp)| (s.clone(), json!(lp))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}
