//! Output constrained during sampling (structured output): any JSON object, JSON that matches a
//! schema, a regular expression or a Lark grammar. The grammar is compiled by
//! [llguidance](https://github.com/guidance-ai/llguidance) against the model's tokenizer; at each
//! step a [`Constraint`] gives the tokens that keep the output inside the grammar (the others'
//! logits become `-inf`) and follows the token sampled. End of sequence is allowed only where
//! the grammar may end, and a finished grammar ends the sequence.
//!
//! ```
//! use rmlx_lm::grammar::{Grammar, GrammarCompiler};
//! let lm = rmlx_lm::loader::load(rmlx_lm::registry::default_model()?, &Default::default())?;
//! let compiler = GrammarCompiler::new(&lm)?;
//! let mut c = compiler.compile(&Grammar::Regex("(yes|no)".into()))?;
//! let allowed = c.allowed()?;
//! let yes = lm.tokenizer.encode("yes", false)?[0];
//! assert!(allowed.contains(&yes));
//! assert!(!allowed.contains(&lm.tokenizer.encode("maybe", false)?[0]));
//! c.accept(yes)?;
//! assert!(c.is_finished() || c.allowed()?.iter().all(|t| lm.eos_ids.contains(t)));
//! # Ok::<(), rmlx_lm::Error>(())
//! ```

use crate::loader::LoadedModel;
use crate::{Error, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use rmlx::Array;
use std::sync::Arc;

/// What the output must be.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Grammar {
    /// Any JSON object (OpenAI's `json_object`).
    JsonObject,
    /// JSON matching this JSON Schema (OpenAI's `json_schema`).
    JsonSchema(serde_json::Value),
    /// Text matching this regular expression, whole.
    Regex(String),
    /// Text of this Lark grammar (llguidance's dialect, with `%json` and regex terminals).
    Lark(String),
}

impl Grammar {
    /// The grammar of an OpenAI `response_format` object: `text` (none), `json_object`,
    /// `json_schema` (`{"json_schema": {"schema": …}}`), and rmlx's `regex` (`{"regex": …}`) and
    /// `lark` (`{"lark": …}`). [`Error::InvalidParameter`] says what is wrong with another.
    ///
    /// ```
    /// use rmlx_lm::grammar::Grammar;
    /// use serde_json::json;
    /// let rx = json!({"type": "regex", "regex": "[0-9]+"});
    /// assert_eq!(Grammar::from_response_format(&rx)?, Some(Grammar::Regex("[0-9]+".into())));
    /// assert_eq!(Grammar::from_response_format(&json!({"type": "text"}))?, None);
    /// assert!(Grammar::from_response_format(&json!({"type": "xml"})).is_err());
    /// # Ok::<(), rmlx_lm::Error>(())
    /// ```
    pub fn from_response_format(f: &serde_json::Value) -> Result<Option<Grammar>> {
        use serde_json::Value;
        let bad = |m: &str| Err(Error::InvalidParameter(m.to_string()));
        let text = |key: &str| f.get(key).and_then(Value::as_str).map(str::to_string);
        match f.get("type").and_then(Value::as_str) {
            Some("text") => Ok(None),
            Some("json_object") => Ok(Some(Grammar::JsonObject)),
            Some("json_schema") => match f.get("json_schema").and_then(|j| j.get("schema")) {
                Some(schema) if schema.is_object() || schema.is_boolean() => {
                    Ok(Some(Grammar::JsonSchema(schema.clone())))
                }
                _ => bad("response_format json_schema needs `json_schema.schema`, a JSON Schema object"),
            },
            Some("regex") => match text("regex") {
                Some(rx) => Ok(Some(Grammar::Regex(rx))),
                None => bad("response_format regex needs `regex`, a string"),
            },
            Some("lark") => match text("lark") {
                Some(lark) => Ok(Some(Grammar::Lark(lark))),
                None => bad("response_format lark needs `lark`, a string"),
            },
            other => bad(&format!(
                "response_format type {} is not one of text, json_object, json_schema, regex, lark",
                other.map_or("(missing)".to_string(), |t| format!("`{t}`"))
            )),
        }
    }
}

/// Compiles grammars for one model's tokenizer (building it reads the whole vocabulary once).
#[derive(Clone)]
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
    vocab: usize,
}

impl GrammarCompiler {
    /// A compiler for `lm`'s tokenizer and logits (the embedding may have more rows than the
    /// tokenizer has tokens: those are never allowed).
    pub fn new(lm: &LoadedModel) -> Result<GrammarCompiler> {
        let err = |e: String| {
            Error::Tokenizer(format!("structured output needs a byte-level or byte-fallback tokenizer: {e}"))
        };
        let mut bytes = toktrie_hf_tokenizers::ByteTokenizer::from_tokenizer(lm.tokenizer.inner().clone())
            .map_err(|e| err(e.to_string()))?;
        if !lm.eos_ids.is_empty() {
            bytes.set_eos_tokens(&lm.eos_ids);
        }
        let vocab = lm.vocab.rows();
        let env = bytes.into_tok_env(Some(vocab)).map_err(|e| err(e.to_string()))?;
        let factory = ParserFactory::new_simple(&env).map_err(|e| err(e.to_string()))?;
        Ok(GrammarCompiler { factory: Arc::new(factory), vocab })
    }

    /// A fresh constraint for one sequence. Errors: [`Error::InvalidParameter`] naming what the
    /// grammar (a schema, a regex) got wrong.
    pub fn compile(&self, grammar: &Grammar) -> Result<Constraint> {
        let parser = self.parser(grammar)?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(Error::InvalidParameter(format!("the grammar does not compile: {}", one_line(&e))));
        }
        let constraint = Constraint { matcher, vocab: self.vocab };
        // Some grammars compile and fail at their first token (an empty language such as
        // `[^\s\S]`, `$ref`s that loop): find out now, so that the request is refused, not its batch.
        // The probe runs on an independent copy; the request keeps the untouched matcher.
        let mut probe = constraint.matcher.deep_clone();
        match probe.compute_mask() {
            Err(e) => Err(Error::InvalidParameter(format!("the grammar admits no text: {}", one_line(&e)))),
            Ok(mask) if mask.is_zero() && !constraint.is_finished() => {
                Err(Error::InvalidParameter("the grammar admits no text: no token can start it".into()))
            }
            Ok(_) => Ok(constraint),
        }
    }
}

/// An error from the grammar engine on one line, at most 300 characters: its messages span lines
/// (a regex error points at the character), and some end with the parser's internal state,
/// which a client has no use for.
fn one_line(e: &dyn std::fmt::Display) -> String {
    let text = e.to_string().split_whitespace().collect::<Vec<_>>().join(" ");
    match text.char_indices().nth(300) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text,
    }
}

impl GrammarCompiler {
    fn parser(&self, grammar: &Grammar) -> Result<llguidance::TokenParser> {
        let top = match grammar {
            Grammar::JsonObject => TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"})),
            Grammar::JsonSchema(schema) => TopLevelGrammar::from_json_schema(schema.clone()),
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Grammar::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        };
        self.factory
            .create_parser(top)
            .map_err(|e| Error::InvalidParameter(format!("the grammar does not compile: {}", one_line(&e))))
    }
}

/// One sequence's place in its grammar.
pub struct Constraint {
    matcher: Matcher,
    vocab: usize,
}

impl Constraint {
    /// The tokens allowed next, ascending.
    pub fn allowed(&mut self) -> Result<Vec<u32>> {
        let mask = self.matcher.compute_mask().map_err(|e| self.failed(e))?;
        let mut out = Vec::new();
        mask.iter_set_entries(|i| {
            if i < self.vocab {
                out.push(i as u32)
            }
        });
        Ok(out)
    }

    /// `[1, vocab]` float32: 0 for the allowed tokens, `-inf` for the rest (added to the logits).
    pub fn mask(&mut self) -> Result<Array> {
        let mut row = vec![f32::NEG_INFINITY; self.vocab];
        for t in self.allowed()? {
            row[t as usize] = 0.0;
        }
        Ok(Array::from_slice(&row, &[1, self.vocab as i32])?)
    }

    /// Follows the sampled `token` (one of [`Constraint::allowed`]).
    pub fn accept(&mut self, token: u32) -> Result<()> {
        self.matcher.consume_token(token).map_err(|e| self.failed(e))
    }

    /// Whether the grammar is complete: nothing more may follow.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }

    fn failed(&self, e: impl std::fmt::Display) -> Error {
        Error::InvalidParameter(format!("structured output failed: {}", one_line(&e)))
    }
}
