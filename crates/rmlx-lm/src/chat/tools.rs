//! Tools: the call formats models write ([`ToolFormat`], told from the chat template), which
//! calls a request allows ([`ToolChoice`]), the grammar that makes a model call a tool when it
//! must (its arguments then satisfy the function's JSON schema), and, for templates that know
//! nothing of tools, the instructions and history rewriting that teach a model the Hermes format.

use super::scan::{CallScan, Span};
use crate::grammar::Grammar;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value as Json};

/// How a model writes its tool calls.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, one block per call (Qwen 2.5
    /// and 3, Hermes, SmolLM3, and rmlx's instructions for templates without tools).
    Hermes,
    /// Llama 3.1–3.3: the reply is `{"name": …, "parameters": {…}}` (after `<|python_tag|>` at
    /// times), several separated by `;`.
    Llama3,
    /// Mistral: `[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}`, or `name[ARGS]{…}`
    /// repeated (later templates).
    Mistral,
    /// FunctionGemma: `<start_function_call>call:name{key:<escape>text<escape>,n:1}<end_function_call>`.
    FunctionGemma,
    /// gpt-oss's harmony: `<|channel|>commentary to=functions.name <|constrain|>json<|message|>{…}`.
    Harmony,
}

impl ToolFormat {
    /// The format a chat template writes calls in, from the markers it mentions.
    ///
    /// ```
    /// use rmlx_lm::chat::ToolFormat;
    /// assert_eq!(ToolFormat::detect("{{ '<tool_call>\\n' }}{{ tool_call.name }}"), Some(ToolFormat::Hermes));
    /// assert_eq!(ToolFormat::detect("{{ messages }}"), None);
    /// ```
    pub fn detect(template: &str) -> Option<ToolFormat> {
        if template.contains("<|channel|>") {
            Some(ToolFormat::Harmony)
        } else if template.contains("<start_function_call>") {
            Some(ToolFormat::FunctionGemma)
        } else if template.contains("[TOOL_CALLS]") {
            Some(ToolFormat::Mistral)
        } else if template.contains("<tool_call>") {
            Some(ToolFormat::Hermes)
        } else if template.contains("<|python_tag|>")
            || (template.contains("<|start_header_id|>") && template.contains("tools"))
        {
            Some(ToolFormat::Llama3)
        } else {
            None
        }
    }

    /// A format by name: `hermes` (also `qwen`), `llama3`, `mistral`, `function_gemma`, `harmony`.
    pub fn from_name(name: &str) -> Result<ToolFormat> {
        Ok(match name {
            "hermes" | "qwen" | "json_tools" => ToolFormat::Hermes,
            "llama3" | "llama3_json" | "llama" => ToolFormat::Llama3,
            "mistral" => ToolFormat::Mistral,
            "function_gemma" | "gemma" => ToolFormat::FunctionGemma,
            "harmony" | "gpt_oss" | "openai" => ToolFormat::Harmony,
            other => {
                return Err(Error::InvalidParameter(format!(
                    "unknown tool-call format `{other}` (hermes, llama3, mistral, function_gemma, harmony)"
                )))
            }
        })
    }

    /// The text markers that open a call.
    pub(crate) fn call_markers(&self) -> &'static [&'static str] {
        match self {
            ToolFormat::Hermes => &["<tool_call>"],
            ToolFormat::Llama3 => &["<|python_tag|>"],
            ToolFormat::Mistral => &["[TOOL_CALLS]"],
            ToolFormat::FunctionGemma => &["<start_function_call>"],
            ToolFormat::Harmony => &[],
        }
    }

    /// The marker that ends a call opened by `marker` (`None`: it runs to the reply's end).
    pub(crate) fn call_end(&self, _marker: &str) -> Option<&'static str> {
        match self {
            ToolFormat::Hermes => Some("</tool_call>"),
            ToolFormat::FunctionGemma => Some("<end_function_call>"),
            _ => None,
        }
    }

    /// Whether a reply that is a JSON object is a call (Llama 3's).
    pub(crate) fn bare_json(&self) -> bool {
        *self == ToolFormat::Llama3
    }

    /// Whether the arguments are written in another notation than JSON (so they go out whole).
    pub(crate) fn converts_arguments(&self) -> bool {
        *self == ToolFormat::FunctionGemma
    }

    /// Markers whose tokens are special in some tokenizers and must stay in the text.
    pub(crate) fn special_markers(&self) -> &'static [&'static str] {
        match self {
            ToolFormat::Hermes => &["<tool_call>", "</tool_call>"],
            ToolFormat::Llama3 => &["<|python_tag|>"],
            ToolFormat::Mistral => &["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"],
            ToolFormat::FunctionGemma => &["<start_function_call>", "<end_function_call>", "<escape>"],
            ToolFormat::Harmony => &["<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|constrain|>"],
        }
    }

    /// The grammar of a reply that is only calls of `tools` (OpenAI tool objects) as `choice`
    /// allows (`Required`: any of them; `Function`: that one), one or, with `parallel`, several.
    /// `special` gives the id of a special token (`[TOOL_CALLS]`, harmony's markers).
    pub fn forced_grammar(
        &self,
        tools: &[Json],
        choice: &ToolChoice,
        parallel: bool,
        special: &dyn Fn(&str) -> Option<u32>,
    ) -> Result<Grammar> {
        let mut functions = Vec::new();
        for t in tools {
            let (name, params) = tool_signature(t)?;
            if matches!(choice, ToolChoice::Function(f) if *f != name) {
                continue;
            }
            functions.push((name, params));
        }
        if functions.is_empty() {
            let ToolChoice::Function(f) = choice else {
                return Err(Error::InvalidParameter("tool_choice `required` needs at least one tool".into()));
            };
            return Err(Error::InvalidParameter(format!("tool_choice names `{f}`, which is not one of the tools")));
        }
        let lit = |s: &str| serde_json::to_string(s).expect("a string");
        let token = |m: &str| {
            special(m).map(|id| format!("<[{id}]>")).ok_or_else(|| {
                Error::InvalidParameter(format!("this tokenizer has no `{m}` token for the {self:?} call format"))
            })
        };
        let mut rules = Vec::new();
        let mut alternatives = Vec::new();
        for (k, (name, params)) in functions.iter().enumerate() {
            // Arguments on one line, separated as Python's json.dumps does (fewer tokens than
            // the indented JSON a model may drift into).
            let mut params = params.clone();
            params["x-guidance"] = json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
            let schema = serde_json::to_string(&params).expect("JSON");
            let body = match self {
                ToolFormat::Hermes => format!(
                    "{} args{k} {}",
                    lit(&format!("<tool_call>\n{{\"name\": {}, \"arguments\": ", lit(name))),
                    lit("}\n</tool_call>")
                ),
                ToolFormat::Llama3 => {
                    format!("{} args{k} {}", lit(&format!("{{\"name\": {}, \"parameters\": ", lit(name))), lit("}"))
                }
                ToolFormat::Mistral => {
                    format!("{} args{k} {}", lit(&format!("{{\"name\": {}, \"arguments\": ", lit(name))), lit("}"))
                }
                ToolFormat::Harmony => format!(
                    "{} {} {} {} {} args{k}",
                    token("<|channel|>")?,
                    lit(&format!("commentary to=functions.{name} ")),
                    token("<|constrain|>")?,
                    lit("json"),
                    token("<|message|>")?
                ),
                ToolFormat::FunctionGemma => {
                    let body = format!(
                        "{} {} args{k} {}",
                        token("<start_function_call>")?,
                        lit(&format!("call:{name}")),
                        token("<end_function_call>")?
                    );
                    let args = super::gemma_calls::argument_rules(k, &params, &token("<escape>")?);
                    rules.push(format!("call{k}: {body}\n{args}"));
                    alternatives.push(format!("call{k}"));
                    continue;
                }
            };
            rules.push(format!("call{k}: {body}\nargs{k}: %json {schema}"));
            alternatives.push(format!("call{k}"));
        }
        let call = format!("call: {}", alternatives.join(" | "));
        let start = match (self, parallel) {
            (ToolFormat::Mistral, true) => format!("start: {} \"[\" call (\", \" call)* \"]\"", token("[TOOL_CALLS]")?),
            (ToolFormat::Mistral, false) => format!("start: {} \"[\" call \"]\"", token("[TOOL_CALLS]")?),
            (ToolFormat::Hermes, true) => "start: call (\"\\n\" call)*".to_string(),
            (ToolFormat::Llama3, true) => "start: call (\"; \" call)*".to_string(),
            (ToolFormat::FunctionGemma, true) => "start: call+".to_string(),
            _ => "start: call".to_string(),
        };
        Ok(Grammar::Lark(format!("{start}\n{call}\n{}\n", rules.join("\n"))))
    }
}

/// Which calls a request allows (OpenAI's `tool_choice`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum ToolChoice {
    /// The model chooses.
    #[default]
    Auto,
    /// No calls: the tools are not shown to the model.
    None,
    /// At least one call, of any tool.
    Required,
    /// A call of this function.
    Function(String),
}

impl ToolChoice {
    /// OpenAI's `tool_choice`: `"auto"`, `"none"`, `"required"`, or
    /// `{"type": "function", "function": {"name": …}}` (the Responses API's `{"type": "function",
    /// "name": …}` too).
    pub fn from_json(v: &Json) -> Result<ToolChoice> {
        match v {
            Json::Null => Ok(ToolChoice::Auto),
            Json::String(s) => match s.as_str() {
                "auto" => Ok(ToolChoice::Auto),
                "none" => Ok(ToolChoice::None),
                "required" | "any" => Ok(ToolChoice::Required),
                other => Err(Error::InvalidParameter(format!(
                    "tool_choice `{other}` is not auto, none, required or a function"
                ))),
            },
            Json::Object(o) => {
                let name =
                    o.get("function").and_then(|f| f.get("name")).or_else(|| o.get("name")).and_then(Json::as_str);
                match name {
                    Some(n) => Ok(ToolChoice::Function(n.to_string())),
                    None => Err(Error::InvalidParameter(
                        "tool_choice as an object needs {\"type\": \"function\", \"function\": {\"name\": …}}".into(),
                    )),
                }
            }
            other => Err(Error::InvalidParameter(format!("tool_choice must be a string or an object, got {other}"))),
        }
    }

    /// Whether the reply must be calls.
    pub fn forces(&self) -> bool {
        matches!(self, ToolChoice::Required | ToolChoice::Function(_))
    }
}

/// A tool's function name and parameters schema (`{"type": "object"}` when it gives none), from
/// OpenAI's `{"type": "function", "function": {…}}` or the Responses API's flat form.
pub fn tool_signature(tool: &Json) -> Result<(String, Json)> {
    let f = tool.get("function").unwrap_or(tool);
    let name = f
        .get("name")
        .and_then(Json::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| Error::InvalidParameter(format!("a tool needs `function.name`: {}", short(tool))))?;
    let params = match f.get("parameters") {
        None | Some(Json::Null) => json!({"type": "object"}),
        Some(p) if p.is_object() => p.clone(),
        Some(p) => {
            return Err(Error::InvalidParameter(format!(
                "tool `{name}`: parameters must be a JSON Schema object, got {}",
                short(p)
            )))
        }
    };
    Ok((name.to_string(), params))
}

fn short(v: &Json) -> String {
    let s = v.to_string();
    match s.char_indices().nth(120) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s,
    }
}

/// The instructions that teach the Hermes call format to a model whose template has no place for
/// tools (a system message's opening).
pub fn hermes_instructions(tools: &[Json]) -> String {
    let mut s = String::from(
        "# Tools\n\nWhen they help you answer, you can call the functions described (as JSON) between \
         <tools> and </tools>:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&t.to_string());
    }
    s.push_str(
        "\n</tools>\n\nTo call one, write a JSON object with the function's name and its arguments \
         between <tool_call> and </tool_call>, one block per call:\n<tool_call>\n{\"name\": \"function name\", \
         \"arguments\": {the arguments}}\n</tool_call>",
    );
    s
}

/// Messages for a template without tools: the instructions open the system message, earlier
/// calls become `<tool_call>` blocks of the assistant's text, and tool results user messages of
/// `<tool_response>` blocks (consecutive results in one message).
pub fn messages_without_tool_support(messages: &[Json], tools: &[Json]) -> Vec<Json> {
    let mut out: Vec<Json> = Vec::with_capacity(messages.len() + 1);
    let mut rest = messages;
    if !tools.is_empty() {
        let intro = hermes_instructions(tools);
        match messages.first() {
            Some(m) if m.get("role").and_then(Json::as_str) == Some("system") => {
                let own = m.get("content").and_then(Json::as_str).unwrap_or("");
                let mut m = m.clone();
                m["content"] = json!(if own.is_empty() { intro } else { format!("{own}\n\n{intro}") });
                out.push(m);
                rest = &messages[1..];
            }
            _ => out.push(json!({"role": "system", "content": intro})),
        }
    }
    for m in rest {
        let role = m.get("role").and_then(Json::as_str).unwrap_or("");
        let content = m.get("content").and_then(Json::as_str).unwrap_or("");
        match role {
            "assistant" if m.get("tool_calls").is_some_and(|c| c.as_array().is_some_and(|a| !a.is_empty())) => {
                let mut text = content.to_string();
                for c in m["tool_calls"].as_array().into_iter().flatten() {
                    let f = c.get("function").unwrap_or(c);
                    let call = json!({"name": f.get("name").cloned().unwrap_or(Json::Null), "arguments": f.get("arguments").cloned().unwrap_or(json!({}))});
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(&format!("<tool_call>\n{call}\n</tool_call>"));
                }
                out.push(json!({"role": "assistant", "content": text}));
            }
            "tool" => {
                let block = format!("<tool_response>\n{content}\n</tool_response>");
                match out.last_mut() {
                    Some(last) if last.get("tool_results").is_some() => {
                        let t = format!("{}\n{block}", last["content"].as_str().unwrap_or(""));
                        last["content"] = json!(t);
                    }
                    _ => out.push(json!({"role": "user", "content": block, "tool_results": true})),
                }
            }
            _ => out.push(m.clone()),
        }
    }
    for m in &mut out {
        if let Some(o) = m.as_object_mut() {
            o.remove("tool_results");
        }
    }
    out
}

/// FunctionGemma's calls: `call:name{…}` (the marker already taken off).
pub(crate) fn scan_function_gemma(text: &str) -> std::result::Result<Vec<CallScan>, ()> {
    let t = text.trim_start();
    let off = text.len() - t.len();
    if t.is_empty() || "call:".starts_with(t) {
        return Ok(Vec::new());
    }
    let Some(rest) = t.strip_prefix("call:") else { return Err(()) };
    let name_len = rest.find('{').unwrap_or(rest.len());
    let name = &rest[..name_len];
    if !name.chars().all(|c| c.is_alphanumeric() || "_-.".contains(c)) {
        return Err(());
    }
    if name_len == rest.len() {
        return Ok(Vec::new());
    }
    let start = off + 5 + name_len;
    let mut call = CallScan { name: Some(name.to_string()), ..Default::default() };
    // The arguments run to the last `}` (values are not JSON: `<escape>` quotes strings).
    match text.rfind('}') {
        Some(e) if e > start => {
            call.args = Some(Span { start, end: e + 1, complete: true });
            call.end = Some(e + 1);
        }
        _ => call.args = Some(Span { start, end: text.len(), complete: false }),
    }
    Ok(vec![call])
}

/// FunctionGemma's `{key:<escape>text<escape>,n:1}` as a JSON object's text.
pub(crate) fn function_gemma_arguments(text: &str, call: &CallScan) -> String {
    const ESC: &str = "<escape>";
    let Some(a) = call.args else { return "{}".into() };
    let inner = text[a.start..a.end].trim();
    let mut rest = inner.strip_prefix('{').and_then(|r| r.strip_suffix('}')).unwrap_or(inner);
    let mut map = serde_json::Map::new();
    while !rest.is_empty() {
        let Some(colon) = rest.find(':') else { break };
        let key = rest[..colon].trim().to_string();
        rest = &rest[colon + 1..];
        let value = if let Some(r) = rest.strip_prefix(ESC) {
            let end = r.find(ESC).unwrap_or(r.len());
            let v = Json::String(r[..end].to_string());
            rest = r.get(end + ESC.len()..).unwrap_or("");
            rest = rest.strip_prefix(',').unwrap_or(rest);
            v
        } else {
            let end = scan_plain_value(rest);
            let raw = rest[..end].trim();
            rest = rest.get(end + 1..).unwrap_or("");
            serde_json::from_str(raw).unwrap_or_else(|_| Json::String(raw.to_string()))
        };
        map.insert(key, value);
    }
    Json::Object(map).to_string()
}

/// Where a FunctionGemma value that is not a string ends: the next comma outside brackets.
fn scan_plain_value(s: &str) -> usize {
    let b = s.as_bytes();
    let mut depth = 0i32;
    for (i, &c) in b.iter().enumerate() {
        match c {
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth -= 1,
            b',' if depth == 0 => return i,
            _ => {}
        }
    }
    s.len()
}
