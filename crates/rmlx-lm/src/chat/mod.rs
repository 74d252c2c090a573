//! Chat templates and what surrounds them: requests with tools ([`ChatRequest`],
//! [`LoadedModel::prepare_chat`](crate::LoadedModel::prepare_chat)), tool-call formats
//! ([`ToolFormat`]) and replies taken apart into reasoning, answer and calls ([`ReplyParser`]).
//!
//! The templates: the Jinja templates of Hugging Face checkpoints (`chat_template.jinja`,
//! `tokenizer_config.json`'s `chat_template`, GGUF `tokenizer.chat_template`), rendered with
//! minijinja the way `transformers`' `apply_chat_template(..., tokenize=False)` renders them.
//!
//! The environment matches transformers': `trim_blocks` and `lstrip_blocks` on, no trailing newline
//! kept; `raise_exception(msg)` (an [`Error::Template`] carrying `msg` exactly); `strftime_now(fmt)`
//! (UTC); a `tojson` filter that writes what Python's `json.dumps` writes (`ensure_ascii=False`,
//! `indent`, `separators`, `sort_keys`); Python string, list and dict methods (`.strip()`,
//! `.startswith()`, `.split()`, `.items()`, ...) through minijinja-contrib's pycompat; `namespace`.
//! The variables are `messages`, `tools` (none when absent), `documents` (none),
//! `add_generation_prompt`, `bos_token`, `eos_token`, and the extra keyword arguments. transformers'
//! `{% generation %}` blocks (assistant masks) are rendered as their content.
//!
//! Objects keep their keys in the order minijinja and serde_json keep them: sorted, unless both
//! crates' `preserve_order` features are enabled (Python keeps insertion order, which shows in
//! `tojson` of tool schemas).

mod gemma_calls;
mod pyjson;
mod reply;
mod request;
mod scan;
mod tools;

pub use reply::{Reply, ReplyEvent, ReplyFormat, ReplyParser, Think, ToolCall};
pub use request::{ChatRequest, PreparedChat};
pub use tools::{hermes_instructions, messages_without_tool_support, tool_signature, ToolChoice, ToolFormat};

use std::cell::RefCell;
use std::path::Path;

use minijinja::{Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use crate::{Error, Result};

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message { role: role.into(), content: content.into() }
    }
    pub fn system(content: impl Into<String>) -> Message {
        Message::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Message {
        Message::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Message {
        Message::new("assistant", content)
    }
}

thread_local! {
    /// The message of the `raise_exception` call that stopped the render in progress.
    static RAISED: RefCell<Option<String>> = const { RefCell::new(None) };
}

const NAME: &str = "chat_template";

/// A compiled chat template with the special tokens it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

/// Instructions one render may execute. Measured on the real templates of the test goldens with a
/// 401-message conversation and one tool: Qwen 3 22,359 steps (the most; about 56 per message),
/// Gemma 3 19,891, Llama 3.1 13,733, SmolLM2 9,260. So this allows conversations of hundreds of
/// thousands of messages, while a template looping far beyond that is stopped with an
/// [`Error::Template`] in about a second.
pub const TEMPLATE_FUEL: u64 = 20_000_000;

/// Nesting depth of macro calls and includes one render may reach (real templates nest a few
/// levels); deeper recursion is an [`Error::Template`], not a stack overflow.
pub const TEMPLATE_RECURSION_LIMIT: usize = 64;

fn template_error(e: minijinja::Error) -> Error {
    match e.kind() {
        ErrorKind::OutOfFuel => Error::Template(format!(
            "the template exceeded its step budget (default {TEMPLATE_FUEL} steps; an endless or exploding loop?): {e:#}"
        )),
        _ if e.to_string().contains("recursion") => Error::Template(format!(
            "the template recursed deeper than {TEMPLATE_RECURSION_LIMIT} levels: {e:#}"
        )),
        _ => Error::Template(format!("{e:#}")),
    }
}

/// transformers' `{% generation %}` / `{% endgeneration %}` (assistant-mask tracking) only mark a
/// span; they become `{% if true %}` / `{% endif %}` so that their content renders as is.
fn strip_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let Some(len) = rest[start..].find("%}") else {
            break;
        };
        let tag = &rest[start + 2..start + len];
        let word = tag.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        out.push_str(&rest[..start]);
        match word {
            // the same tag as a no-op block, whitespace control (`{%-`, `-%}`) kept
            "generation" => out.push_str(&format!("{{%{}%}}", tag.replacen("generation", "if true", 1))),
            "endgeneration" => out.push_str(&format!("{{%{}%}}", tag.replacen("endgeneration", "endif", 1))),
            _ => out.push_str(&rest[start..start + len + 2]),
        }
        rest = &rest[start + len + 2..];
    }
    out.push_str(rest);
    out
}

fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    RAISED.with(|r| *r.borrow_mut() = Some(msg.clone()));
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    /// Compiles `source`; a syntax error is an [`Error::Template`].
    pub fn new(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        // Templates come from model files: bound the work a render may do, so that a template with
        // nested loops or runaway recursion fails instead of hanging or overflowing the stack.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_recursion_limit(TEMPLATE_RECURSION_LIMIT);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", pyjson::tojson_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", pyjson::strftime_now);
        env.add_template_owned(NAME, strip_generation_tags(source)).map_err(template_error)?;
        Ok(ChatTemplate {
            env,
            source: source.to_owned(),
            bos_token: bos_token.map(str::to_owned),
            eos_token: eos_token.map(str::to_owned),
        })
    }

    /// The template of a Hugging Face folder: `chat_template.jinja`, else `chat_template.json`'s
    /// `chat_template`, else `tokenizer_config.json`'s `chat_template` (a string, or a list of
    /// `{name, template}` of which the one named `default` is taken); `None` when there is none.
    pub fn from_dir(dir: &Path, bos: Option<&str>, eos: Option<&str>) -> Result<Option<ChatTemplate>> {
        let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| Error::io(p, e));
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            return ChatTemplate::new(&read(&jinja)?, bos, eos).map(Some);
        }
        for file in ["chat_template.json", "tokenizer_config.json"] {
            let path = dir.join(file);
            if !path.is_file() {
                continue;
            }
            let cfg: Json =
                serde_json::from_str(&read(&path)?).map_err(|e| Error::Template(format!("{}: {e}", path.display())))?;
            if let Some(source) = template_of(cfg.get("chat_template")) {
                return ChatTemplate::new(&source, bos, eos).map(Some);
            }
        }
        Ok(None)
    }

    /// A built-in template for checkpoints that ship none: `"llama3"`, `"qwen"` and `"chatml"`
    /// (ChatML), `"gemma"`, `"phi3"`, `"harmony"` (gpt-oss: system, developer, user and final
    /// assistant messages; tools and reasoning need the checkpoint's own template).
    pub fn fallback(family: &str, bos: Option<&str>, eos: Option<&str>) -> Result<ChatTemplate> {
        let source = match family {
            "llama3" | "llama" => FALLBACK_LLAMA3,
            "qwen" | "qwen2" | "qwen3" | "chatml" | "smollm" => FALLBACK_CHATML,
            "gemma" | "gemma3" => FALLBACK_GEMMA,
            "phi3" => FALLBACK_PHI3,
            "harmony" | "gpt_oss" => FALLBACK_HARMONY,
            _ => {
                return Err(Error::Template(format!(
                    "no built-in chat template for `{family}` (built in: llama3, qwen, chatml, gemma, phi3, harmony)"
                )))
            }
        };
        ChatTemplate::new(source, bos, eos)
    }

    /// Another template with this one's special tokens (`--chat-template`).
    pub fn with_source(&self, source: &str) -> Result<ChatTemplate> {
        ChatTemplate::new(source, self.bos_token.as_deref(), self.eos_token.as_deref())
    }

    /// Sets the most instructions one render may execute (default [`TEMPLATE_FUEL`]; `None`: no
    /// bound). Running out is an [`Error::Template`].
    pub fn set_step_budget(&mut self, steps: Option<u64>) {
        self.env.set_fuel(steps);
    }

    /// The template source as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` (`apply_chat_template(messages, tokenize=False, add_generation_prompt=...,
    /// tools=..., **extra)`); `extra` is an object of further template variables (`enable_thinking`,
    /// `date_string`, ...).
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: Option<&Json>,
        extra: Option<&Json>,
    ) -> Result<String> {
        let messages = serde_json::to_value(messages).map_err(|e| Error::Template(e.to_string()))?;
        self.render_json(&messages, add_generation_prompt, tools, extra)
    }

    /// [`ChatTemplate::render`] with messages given as JSON (an array of objects), for fields beyond
    /// `role` and `content` (`tool_calls`, `reasoning_content`, content parts, ...).
    pub fn render_json(
        &self,
        messages: &Json,
        add_generation_prompt: bool,
        tools: Option<&Json>,
        extra: Option<&Json>,
    ) -> Result<String> {
        let Json::Array(list) = messages else {
            return Err(Error::Template("messages must be an array of objects".into()));
        };
        let list: Vec<Json> = list.iter().map(alias_reasoning).collect();
        let mut ctx = std::collections::BTreeMap::<String, Value>::new();
        if let Some(b) = &self.bos_token {
            ctx.insert("bos_token".into(), Value::from(b.as_str()));
        }
        if let Some(e) = &self.eos_token {
            ctx.insert("eos_token".into(), Value::from(e.as_str()));
        }
        ctx.insert("messages".into(), Value::from_serialize(&list));
        ctx.insert("tools".into(), tools.map_or(Value::from(()), Value::from_serialize));
        ctx.insert("documents".into(), Value::from(()));
        ctx.insert("add_generation_prompt".into(), Value::from(add_generation_prompt));
        match extra {
            None | Some(Json::Null) => {}
            Some(Json::Object(map)) => {
                for (k, v) in map {
                    ctx.insert(k.clone(), Value::from_serialize(v));
                }
            }
            Some(_) => return Err(Error::Template("extra template variables must be a JSON object".into())),
        }
        let tmpl = self.env.get_template(NAME).map_err(template_error)?;
        RAISED.with(|r| r.borrow_mut().take());
        tmpl.render(Value::from(ctx)).map_err(|e| match RAISED.with(|r| r.borrow_mut().take()) {
            Some(msg) => Error::Template(msg),
            None => template_error(e),
        })
    }
}

/// `chat_template` of a config: a string, or `[{name, template}]` (the `default` one).
fn template_of(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Array(items) => items
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Json::as_str)
            .map(str::to_owned),
        _ => None,
    }
}

/// transformers' `_alias_reasoning_fields`: a message with reasoning under `reasoning_content`,
/// `thinking` or `reasoning` gets it under `thinking` (if absent) and `reasoning_content`.
fn alias_reasoning(m: &Json) -> Json {
    let Json::Object(o) = m else { return m.clone() };
    let found = ["reasoning_content", "thinking", "reasoning"].iter().find_map(|k| o.get(*k).filter(|v| !v.is_null()));
    let Some(r) = found.cloned() else {
        return m.clone();
    };
    let mut o = o.clone();
    o.entry("thinking").or_insert_with(|| r.clone());
    o.insert("reasoning_content".into(), r);
    Json::Object(o)
}

const FALLBACK_CHATML: &str = "{%- for message in messages %}\
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{%- endfor %}\
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

const FALLBACK_LLAMA3: &str = "{%- for message in messages %}\
{%- set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' %}\
{%- if loop.index0 == 0 and bos_token %}{%- set content = bos_token + content %}{%- endif %}\
{{- content }}\
{%- endfor %}\
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}";

// Phi-3's turns: `<|role|>` on its own line, the content, `<|end|>`.
const FALLBACK_PHI3: &str = "{%- for message in messages %}\
{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}\
{%- endfor %}\
{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}";

/// OpenAI's harmony format as gpt-oss's own template renders plain conversations: the system
/// header (identity, knowledge cutoff, today's date, `reasoning_effort`, the channels), a leading
/// system or developer message as the developer's instructions, then user turns and the
/// assistant's final answers (the last one of a finished conversation closed by `<|return|>`).
const FALLBACK_HARMONY: &str = "{{- '<|start|>system<|message|>' }}\
{{- model_identity if model_identity is defined else 'You are ChatGPT, a large language model trained by OpenAI.' }}\
{{- '\\nKnowledge cutoff: 2024-06\\nCurrent date: ' + strftime_now('%Y-%m-%d') + '\\n\\nReasoning: ' }}\
{{- reasoning_effort if reasoning_effort is defined else 'medium' }}\
{{- '\\n\\n# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>' }}\
{%- set rest = messages %}\
{%- if messages and messages[0]['role'] in ['system', 'developer'] %}\
{{- '<|start|>developer<|message|># Instructions\\n\\n' + messages[0]['content'] + '\\n\\n<|end|>' }}\
{%- set rest = messages[1:] %}\
{%- endif %}\
{%- for message in rest %}\
{%- if message['role'] == 'user' %}{{- '<|start|>user<|message|>' + message['content'] + '<|end|>' }}\
{%- elif message['role'] == 'assistant' %}\
{{- '<|start|>assistant<|channel|>final<|message|>' + message['content'] }}\
{{- '<|return|>' if loop.last and not add_generation_prompt else '<|end|>' }}\
{%- else %}{{- raise_exception('the built-in harmony template takes system, developer, user and assistant \
messages (tools and reasoning need the checkpoint\\'s own template), not ' + message['role']) }}\
{%- endif %}\
{%- endfor %}\
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}";

const FALLBACK_GEMMA: &str = "{{- bos_token or '' }}\
{%- if messages and messages[0]['role'] == 'system' %}\
{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}{%- set loop_messages = messages[1:] %}\
{%- else %}{%- set first_user_prefix = '' %}{%- set loop_messages = messages %}{%- endif %}\
{%- for message in loop_messages %}\
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\
{%- endif %}\
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}\
{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}\
{%- endfor %}\
{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}";
