//! A chat request made ready to generate: the messages (OpenAI's shapes: tool calls, tool
//! results, reasoning) and tools rendered through the model's template with the request's template
//! arguments (`enable_thinking`, `reasoning_effort`, …), the grammar a forced tool choice needs,
//! and what to read the reply by ([`ReplyFormat`]).
//!
//! ```
//! use rmlx_lm::chat::{ChatRequest, ToolChoice};
//! use serde_json::json;
//! let lm = rmlx_lm::loader::load(rmlx_lm::registry::default_model()?, &Default::default())?;
//! let weather = json!({"type": "function", "function": {"name": "weather",
//!     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}});
//! let request = ChatRequest {
//!     tools: vec![weather],
//!     tool_choice: ToolChoice::Required,
//!     ..ChatRequest::new(vec![json!({"role": "user", "content": "Weather in Oslo?"})])
//! };
//! let ready = lm.prepare_chat(&request)?;
//! assert!(ready.grammar.is_some()); // the reply must be a call of `weather`
//! assert!(ready.reply.tools.is_some());
//! # Ok::<(), rmlx_lm::Error>(())
//! ```

use super::reply::{ReplyFormat, Think};
use super::tools::{messages_without_tool_support, tool_signature, ToolChoice, ToolFormat};
use super::Message;
use crate::grammar::Grammar;
use crate::loader::LoadedModel;
use crate::{Error, Result};
use serde_json::{Map, Value as Json};

/// A conversation to continue.
#[derive(Clone, Debug, Default)]
pub struct ChatRequest {
    /// Messages as JSON objects: `role` and `content`, and `tool_calls` (assistant),
    /// `tool_call_id`/`name` (tool), `reasoning_content` where the conversation has them.
    pub messages: Vec<Json>,
    /// OpenAI tool objects (`{"type": "function", "function": {name, description, parameters}}`).
    pub tools: Vec<Json>,
    pub tool_choice: ToolChoice,
    /// Whether a forced reply may hold several calls.
    pub parallel_tool_calls: bool,
    /// Further template variables (`enable_thinking`, `reasoning_effort`, …).
    pub template_args: Map<String, Json>,
    /// The call format, when the template's markers do not tell it.
    pub tool_format: Option<ToolFormat>,
}

impl ChatRequest {
    /// A request of these messages, no tools.
    pub fn new(messages: Vec<Json>) -> ChatRequest {
        ChatRequest { messages, parallel_tool_calls: true, ..ChatRequest::default() }
    }

    /// A request of plain messages.
    pub fn from_messages(messages: &[Message]) -> ChatRequest {
        ChatRequest::new(messages.iter().map(|m| serde_json::json!({"role": m.role, "content": m.content})).collect())
    }
}

/// What generation needs for a [`ChatRequest`].
#[derive(Clone, Debug)]
pub struct PreparedChat {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// How to take the reply apart.
    pub reply: ReplyFormat,
    /// What a forced tool choice constrains the reply to.
    pub grammar: Option<Grammar>,
    /// Special tokens to keep in the reply's text ([`crate::GenerateOptions::keep_special`]).
    pub keep_special: Vec<u32>,
}

impl LoadedModel {
    /// Renders `request` through the chat template and says how to read the reply.
    ///
    /// A template that knows tools gets them as transformers passes them (`tools=`); one that
    /// does not (it never mentions `tools`) gets rmlx's instructions for the Hermes format in the
    /// system message, and earlier calls and results written in that format. Tool calls'
    /// `arguments` given as JSON text are passed to the template as objects.
    ///
    /// Errors: [`Error::InvalidParameter`] for a tool without a name or a schema that is not an
    /// object, a forced choice without tools or naming another function; [`Error::Template`],
    /// [`Error::Prompt`] as [`LoadedModel::chat_prompt`].
    pub fn prepare_chat(&self, request: &ChatRequest) -> Result<PreparedChat> {
        let source = self.chat_template.source();
        let tools: &[Json] = if request.tool_choice == ToolChoice::None { &[] } else { &request.tools };
        for t in tools {
            tool_signature(t)?;
        }
        if request.tool_choice.forces() && tools.is_empty() {
            return Err(Error::InvalidParameter("tool_choice forces a call, but the request has no tools".into()));
        }
        let knows_tools = source.contains("tools");
        let messages: Vec<Json> = request.messages.iter().map(arguments_as_objects).collect();
        let (messages, format) = if knows_tools {
            let format =
                request.tool_format.clone().or_else(|| ToolFormat::detect(source)).unwrap_or(ToolFormat::Hermes);
            (messages, format)
        } else {
            (messages_without_tool_support(&messages, tools), ToolFormat::Hermes)
        };
        let tools_arg = (knows_tools && !tools.is_empty()).then(|| Json::Array(tools.to_vec()));
        let args = Json::Object(request.template_args.clone());
        let text = self.chat_template.render_json(&Json::Array(messages), true, tools_arg.as_ref(), Some(&args))?;
        let prompt = self.tokenizer.encode(&text, false)?;
        self.vocab.check(&prompt)?;

        let token = |m: &str| self.tokenizer.inner().token_to_id(m);
        let harmony = format == ToolFormat::Harmony || source.contains("<|channel|>");
        let thinks =
            !harmony && (source.contains("</think>") || (token("<think>").is_some() && token("</think>").is_some()));
        let think = thinks.then(|| Think { open: text.trim_end().ends_with("<think>"), ..Think::default() });
        let mut markers: Vec<&str> = format.special_markers().to_vec();
        if harmony {
            markers.extend(ToolFormat::Harmony.special_markers());
        }
        if think.is_some() {
            markers.extend(["<think>", "</think>"]);
        }
        let mut keep_special: Vec<u32> =
            markers.iter().filter_map(|m| token(m)).filter(|&id| self.tokenizer.is_special(id)).collect();
        keep_special.sort_unstable();
        keep_special.dedup();
        let grammar = if request.tool_choice.forces() {
            let special = |m: &str| token(m);
            Some(format.forced_grammar(tools, &request.tool_choice, request.parallel_tool_calls, &special)?)
        } else {
            None
        };
        let reply = ReplyFormat { think, tools: (!tools.is_empty()).then_some(format), harmony };
        Ok(PreparedChat { prompt, reply, grammar, keep_special })
    }
}

/// A message whose calls' `arguments` are JSON text gets them as objects (templates write them
/// with `tojson`, which would quote the text again).
fn arguments_as_objects(m: &Json) -> Json {
    let Some(calls) = m.get("tool_calls").and_then(Json::as_array) else { return m.clone() };
    let mut m = m.clone();
    let fixed: Vec<Json> = calls
        .iter()
        .map(|c| {
            let mut c = c.clone();
            let slot = if c.get("function").is_some() { &mut c["function"] } else { &mut c };
            if let Some(Json::String(text)) = slot.get("arguments") {
                if let Ok(v) = serde_json::from_str::<Json>(text) {
                    slot["arguments"] = v;
                }
            }
            c
        })
        .collect();
    m["tool_calls"] = Json::Array(fixed);
    m
}
