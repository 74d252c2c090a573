//! Training data files: `train.jsonl`, `valid.jsonl` and `test.jsonl` in a folder, one JSON object
//! per line in one of mlx-lm's three formats, and their tokenisation.
//!
//! - `{"text": ...}`: the text, tokenised with the tokenizer's special tokens, EOS appended unless
//!   it ends with it. Prompt masking does not apply.
//! - `{"prompt": ..., "completion": ...}`: a user turn and an assistant turn through the chat
//!   template; with masking, the loss starts after the prompt rendered with the generation prompt.
//! - `{"messages": [...]}` (optionally `"tools"`): the conversation through the chat template; with
//!   masking, the loss covers the last message only.
//!
//! The file's first line decides its format (as in mlx-lm); every other line must have the same
//! fields with the right types. Key names can be changed ([`DataOptions`]). Blank lines are skipped.
//!
//! ```
//! use rmlx_lm::tuner::{DataOptions, Dataset, Format};
//! let dir = std::env::temp_dir().join(format!("rmlx-data-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir)?;
//! std::fs::write(dir.join("train.jsonl"), "{\"text\": \"a\"}\n\n{\"text\": \"b\"}\n")?;
//! let train = Dataset::from_jsonl(&dir.join("train.jsonl"), &DataOptions::default())?.unwrap();
//! assert_eq!((train.format(), train.len()), (Format::Text, 2));
//! std::fs::write(dir.join("valid.jsonl"), "{\"text\": \"a\"}\n{\"prompt\": \"q\"}\n")?;
//! let err = Dataset::from_jsonl(&dir.join("valid.jsonl"), &DataOptions::default()).unwrap_err();
//! assert!(err.to_string().ends_with("valid.jsonl:2: missing field `text` (the file's format is {\"text\"}, from line 1)"));
//! # std::fs::remove_dir_all(&dir)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::chat::ChatTemplate;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};

/// Which of mlx-lm's formats a file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `{"text"}`.
    Text,
    /// `{"prompt", "completion"}`.
    Completions,
    /// `{"messages"}` (and optionally `"tools"`).
    Chat,
}

/// How examples are read and tokenised (mlx-lm's `mask_prompt` and `*_feature` settings).
#[derive(Clone, Debug)]
pub struct DataOptions {
    /// Compute the loss on the completion (last message) only.
    pub mask_prompt: bool,
    pub text_feature: String,
    pub prompt_feature: String,
    pub completion_feature: String,
    pub chat_feature: String,
}

impl Default for DataOptions {
    fn default() -> Self {
        DataOptions {
            mask_prompt: false,
            text_feature: "text".into(),
            prompt_feature: "prompt".into(),
            completion_feature: "completion".into(),
            chat_feature: "messages".into(),
        }
    }
}

/// A tokenised example: the loss covers the targets from `offset` on (0 without masking).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sequence {
    pub tokens: Vec<u32>,
    pub offset: usize,
}

/// One example and the line it came from.
#[derive(Clone, Debug)]
struct Record {
    line: usize,
    fields: Map<String, Value>,
}

/// The examples of one file, checked against its format.
#[derive(Clone, Debug)]
pub struct Dataset {
    path: PathBuf,
    format: Format,
    records: Vec<Record>,
    opts: DataOptions,
}

/// The three splits of a data folder; a missing file is an empty split.
#[derive(Debug, Default)]
pub struct Splits {
    pub train: Option<Dataset>,
    pub valid: Option<Dataset>,
    pub test: Option<Dataset>,
}

/// Reads `train.jsonl`, `valid.jsonl` and `test.jsonl` from `dir` (each optional).
pub fn load_dir(dir: &Path, opts: &DataOptions) -> Result<Splits> {
    if !dir.is_dir() {
        return Err(Error::MissingFile(format!(
            "{}: not a data folder (train.jsonl, valid.jsonl, test.jsonl)",
            dir.display()
        )));
    }
    let split = |name: &str| Dataset::from_jsonl(&dir.join(format!("{name}.jsonl")), opts);
    Ok(Splits { train: split("train")?, valid: split("valid")?, test: split("test")? })
}

impl Dataset {
    /// Reads and checks a JSON-lines file; `None` when it does not exist.
    pub fn from_jsonl(path: &Path, opts: &DataOptions) -> Result<Option<Dataset>> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(path, e)),
        };
        let file = path.display().to_string();
        let mut records = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let fail = |reason: String| Error::Data { file: file.clone(), line: i + 1, reason };
            let fields = match serde_json::from_str::<Value>(line) {
                Ok(Value::Object(m)) => m,
                Ok(other) => return Err(fail(format!("expected a JSON object, found {}", kind(&other)))),
                Err(e) => return Err(fail(format!("not JSON: {e}"))),
            };
            records.push(Record { line: i + 1, fields });
        }
        let format = match records.first() {
            None => Format::Text,
            Some(first) => detect(&first.fields, opts).ok_or_else(|| Error::Data {
                file: file.clone(),
                line: first.line,
                reason: format!(
                    "unsupported data format: expected {{\"{}\"}}, {{\"{}\", \"{}\"}} or {{\"{}\"}} (mlx-lm's formats)",
                    opts.text_feature, opts.prompt_feature, opts.completion_feature, opts.chat_feature
                ),
            })?,
        };
        if format == Format::Text && opts.mask_prompt && !records.is_empty() {
            return Err(Error::Data {
                file,
                line: records[0].line,
                reason: "prompt masking (--mask-prompt) needs prompt/completion or chat data, not text".into(),
            });
        }
        let dataset = Dataset { path: path.to_path_buf(), format, records, opts: opts.clone() };
        for r in &dataset.records {
            dataset.check(r).map_err(|reason| Error::Data { file: file.clone(), line: r.line, reason })?;
        }
        Ok(Some(dataset))
    }

    /// The file's format.
    pub fn format(&self) -> Format {
        self.format
    }

    /// Number of examples.
    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// Whether the file holds no example.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The file read.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tokenises every example (see the module docs); an error names the example's line.
    pub fn tokenize(&self, tokenizer: &Tokenizer, template: &ChatTemplate) -> Result<Vec<Sequence>> {
        self.records
            .iter()
            .map(|r| {
                self.tokenize_one(r, tokenizer, template).map_err(|e| Error::Data {
                    file: self.path.display().to_string(),
                    line: r.line,
                    reason: e.to_string(),
                })
            })
            .collect()
    }

    fn tokenize_one(&self, r: &Record, tok: &Tokenizer, template: &ChatTemplate) -> Result<Sequence> {
        let o = &self.opts;
        let f = &r.fields;
        let tools = f.get("tools").filter(|t| !t.is_null());
        let chat = |messages: &Value, add_generation_prompt: bool| -> Result<Vec<u32>> {
            tok.encode(&template.render_json(messages, add_generation_prompt, tools, None)?, false)
        };
        match self.format {
            Format::Text => {
                let mut tokens = tok.encode(f[&o.text_feature].as_str().unwrap_or_default(), true)?;
                if let Some(eos) = tok.eos_token().and_then(|t| tok.token_to_id(t)) {
                    if tokens.last() != Some(&eos) {
                        tokens.push(eos);
                    }
                }
                Ok(Sequence { tokens, offset: 0 })
            }
            Format::Completions => {
                let user = json!({"role": "user", "content": f[&o.prompt_feature]});
                let assistant = json!({"role": "assistant", "content": f[&o.completion_feature]});
                let tokens = chat(&json!([user.clone(), assistant]), false)?;
                let offset = if o.mask_prompt { chat(&json!([user]), true)?.len() } else { 0 };
                Ok(Sequence { tokens, offset })
            }
            Format::Chat => {
                let messages = &f[&o.chat_feature];
                let tokens = chat(messages, false)?;
                let offset = if o.mask_prompt {
                    let list = messages.as_array().map(Vec::as_slice).unwrap_or_default();
                    let (last, head) = list.split_last().expect("checked: at least one message");
                    let add_generation_prompt = last.get("role").and_then(Value::as_str) == Some("assistant");
                    chat(&Value::Array(head.to_vec()), add_generation_prompt)?.len()
                } else {
                    0
                };
                Ok(Sequence { tokens, offset })
            }
        }
    }

    /// Why a record does not fit the file's format, if it does not.
    fn check(&self, r: &Record) -> std::result::Result<(), String> {
        let o = &self.opts;
        let f = &r.fields;
        let string = |key: &str| match f.get(key) {
            Some(Value::String(_)) => Ok(()),
            Some(other) => Err(format!("field `{key}` must be a string, found {}", kind(other))),
            None => Err(format!(
                "missing field `{key}` (the file's format is {}, from line {})",
                self.describe(),
                self.records[0].line
            )),
        };
        match self.format {
            Format::Text => string(&o.text_feature)?,
            Format::Completions => {
                string(&o.prompt_feature)?;
                string(&o.completion_feature)?;
            }
            Format::Chat => {
                let key = &o.chat_feature;
                let Some(messages) = f.get(key) else {
                    return Err(format!(
                        "missing field `{key}` (the file's format is {}, from line {})",
                        self.describe(),
                        self.records[0].line
                    ));
                };
                let Value::Array(list) = messages else {
                    return Err(format!("field `{key}` must be an array of messages, found {}", kind(messages)));
                };
                if list.is_empty() {
                    return Err(format!("field `{key}` holds no message"));
                }
                for (i, m) in list.iter().enumerate() {
                    match m.get("role") {
                        Some(Value::String(_)) => {}
                        Some(other) => {
                            return Err(format!("message {i}: `role` must be a string, found {}", kind(other)))
                        }
                        None if m.is_object() => return Err(format!("message {i} has no `role`")),
                        None => return Err(format!("message {i} must be an object, found {}", kind(m))),
                    }
                }
            }
        }
        match f.get("tools") {
            None | Some(Value::Null) | Some(Value::Array(_)) => Ok(()),
            Some(other) => Err(format!("field `tools` must be an array, found {}", kind(other))),
        }
    }

    fn describe(&self) -> String {
        let o = &self.opts;
        match self.format {
            Format::Text => format!("{{\"{}\"}}", o.text_feature),
            Format::Completions => format!("{{\"{}\", \"{}\"}}", o.prompt_feature, o.completion_feature),
            Format::Chat => format!("{{\"{}\"}}", o.chat_feature),
        }
    }
}

/// mlx-lm's choice of format from one example's keys.
fn detect(fields: &Map<String, Value>, o: &DataOptions) -> Option<Format> {
    if fields.contains_key(&o.prompt_feature) && fields.contains_key(&o.completion_feature) {
        Some(Format::Completions)
    } else if fields.contains_key(&o.chat_feature) {
        Some(Format::Chat)
    } else if fields.contains_key(&o.text_feature) {
        Some(Format::Text)
    } else {
        None
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
