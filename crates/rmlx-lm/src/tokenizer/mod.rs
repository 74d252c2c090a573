//! Tokenizers: Hugging Face `tokenizer.json` folders and GGUF vocabularies, on the `tokenizers`
//! crate, with the special-token bookkeeping generation needs (BOS, the set of EOS ids) and an
//! incremental detokeniser for streaming output.
//!
//! Encoding follows `transformers`: `encode(text, true)` equals `tokenizer(text)["input_ids"]` of
//! `AutoTokenizer` (the post-processor of `tokenizer.json`, rebuilt from `tokenizer_config.json`'s
//! explicit `add_bos_token` / `add_eos_token` as transformers 5 does), and `decode` equals
//! `tokenizer.decode` (transformers 5 applies no clean-up of spaces to BPE tokenizers).

mod gguf;

pub(crate) use gguf::gguf_vocab;
pub use gguf::GgufVocab;

use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use crate::{Error, Result};

pub(crate) fn tk_err(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(e.to_string())
}

/// A tokenizer with its special tokens.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    bos: Option<String>,
    bos_id: Option<u32>,
    eos: Option<String>,
    eos_ids: Vec<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

/// A special token in `tokenizer_config.json`: a string, or an AddedToken object `{"content": ...}`.
fn config_token(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| tk_err(format!("{}: {e}", path.display())))
}

impl Tokenizer {
    /// From a Hugging Face folder: `tokenizer.json` (required) and `tokenizer_config.json`
    /// (optional: `bos_token`, `eos_token`, `add_bos_token`, `add_eos_token`), like `AutoTokenizer`.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        let file = dir.join("tokenizer.json");
        if !file.is_file() {
            return Err(Error::MissingFile(file.display().to_string()));
        }
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = if cfg_path.is_file() { Some(read_json(&cfg_path)?) } else { None };
        let inner = load_tokenizer_json(&file)?;
        Self::assemble(inner, cfg.as_ref())
    }

    /// From a `tokenizer.json` alone (special tokens taken from its post-processor and added
    /// tokens: see [`Tokenizer::bos_token`]).
    pub fn from_file(tokenizer_json: &Path) -> Result<Tokenizer> {
        Self::assemble(load_tokenizer_json(tokenizer_json)?, None)
    }

    /// From GGUF tokenizer metadata (see [`GgufVocab`]).
    pub fn from_gguf_vocab(v: &GgufVocab) -> Result<Tokenizer> {
        let inner = gguf::build(v)?;
        let name = |id: Option<u32>| id.and_then(|i| v.tokens.get(i as usize).cloned());
        Ok(Tokenizer {
            inner: Arc::new(inner),
            bos: name(v.bos_id),
            bos_id: v.bos_id,
            eos: name(v.eos_id),
            eos_ids: v.eos_id.into_iter().collect(),
        })
    }

    /// Wraps an already built `tokenizers::Tokenizer`, with its special tokens.
    pub fn from_parts(inner: tokenizers::Tokenizer, bos: Option<&str>, eos: Option<&str>) -> Tokenizer {
        let bos_id = bos.and_then(|b| inner.token_to_id(b));
        let eos_ids = eos.and_then(|e| inner.token_to_id(e)).into_iter().collect();
        Tokenizer { inner: Arc::new(inner), bos: bos.map(str::to_owned), bos_id, eos: eos.map(str::to_owned), eos_ids }
    }

    fn assemble(mut inner: tokenizers::Tokenizer, cfg: Option<&Value>) -> Result<Tokenizer> {
        let (mut bos, mut eos) = (None, None);
        if let Some(cfg) = cfg {
            bos = config_token(cfg.get("bos_token"));
            eos = config_token(cfg.get("eos_token"));
        } else {
            // No config: the BOS the post-processor adds, if any.
            let with = inner.encode("a", true).map_err(tk_err)?;
            let without = inner.encode("a", false).map_err(tk_err)?;
            if with.get_ids().len() > without.get_ids().len() && with.get_ids()[0] != without.get_ids()[0] {
                bos = inner.id_to_token(with.get_ids()[0]);
            }
        }
        let bos_id = bos.as_deref().and_then(|b| inner.token_to_id(b));
        let eos_id = eos.as_deref().and_then(|e| inner.token_to_id(e));
        if let Some(cfg) = cfg {
            let flag = |k: &str| cfg.get(k).and_then(Value::as_bool);
            let (add_bos, add_eos) = (flag("add_bos_token"), flag("add_eos_token"));
            if add_bos.is_some() || add_eos.is_some() {
                apply_bos_eos(&mut inner, bos.as_deref().zip(bos_id), eos.as_deref().zip(eos_id), add_bos, add_eos)?;
            }
        }
        Ok(Tokenizer { inner: Arc::new(inner), bos, bos_id, eos, eos_ids: eos_id.into_iter().collect() })
    }

    /// Token ids of `text`; `add_special_tokens = true` is `tokenizer(text)` (BOS etc. added by the
    /// post-processor), `false` is `tokenizer(text, add_special_tokens=False)`. Special tokens written
    /// in the text (`<|im_start|>`) are recognised in both cases.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        Ok(self.inner.encode(text, add_special_tokens).map_err(tk_err)?.get_ids().to_vec())
    }

    /// The text of `ids` (`tokenizer.decode(ids, skip_special_tokens=...)`).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(tk_err)
    }

    /// Number of ids, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The BOS token (`tokenizer_config.json`'s `bos_token`; GGUF `bos_token_id`; without either,
    /// the token the post-processor puts first).
    pub fn bos_token(&self) -> Option<&str> {
        self.bos.as_deref()
    }

    /// The EOS token named by `tokenizer_config.json` or the GGUF metadata.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos.as_deref()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Every id that ends generation: the tokenizer's EOS plus those added by [`Tokenizer::add_eos_id`].
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Adds an id that ends generation (from `config.json` / `generation_config.json`).
    pub fn add_eos_id(&mut self, id: u32) {
        if !self.eos_ids.contains(&id) {
            self.eos_ids.push(id);
        }
    }

    /// Whether `id` is a special (control) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.inner
            .get_added_vocabulary()
            .simple_id_to_token(id)
            .is_some_and(|t| self.inner.get_added_vocabulary().is_special_token(&t))
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// An incremental detokeniser that leaves special tokens out of the text.
    pub fn stream(&self) -> StreamDecoder {
        self.stream_with(true)
    }

    /// An incremental detokeniser; `skip_special_tokens` as in [`Tokenizer::decode`].
    pub fn stream_with(&self, skip_special_tokens: bool) -> StreamDecoder {
        StreamDecoder {
            tok: self.inner.clone(),
            skip: skip_special_tokens,
            keep: Vec::new(),
            ids: Vec::new(),
            prefix: String::new(),
            prefix_index: 0,
        }
    }

    /// An incremental detokeniser that leaves special tokens out of the text, except `keep`
    /// (markers a reply is read by: tool-call and channel tokens), whose text it writes.
    pub fn stream_keeping(&self, keep: &[u32]) -> StreamDecoder {
        StreamDecoder { keep: keep.to_vec(), ..self.stream_with(true) }
    }
}

fn load_tokenizer_json(path: &Path) -> Result<tokenizers::Tokenizer> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| tk_err(format!("{}: {e}", path.display())))
}

/// The post-processor transformers 5 builds from explicit `add_bos_token` / `add_eos_token`:
/// `[bos] $A [eos]` (installed only where the tokenizer.json one does otherwise).
fn apply_bos_eos(
    inner: &mut tokenizers::Tokenizer,
    bos: Option<(&str, u32)>,
    eos: Option<(&str, u32)>,
    add_bos: Option<bool>,
    add_eos: Option<bool>,
) -> Result<()> {
    let with = inner.encode("a", true).map_err(tk_err)?.get_ids().to_vec();
    let plain = inner.encode("a", false).map_err(tk_err)?.get_ids().to_vec();
    let has_bos = bos.is_some_and(|(_, id)| with.first() == Some(&id) && plain.first() != Some(&id));
    let has_eos = eos.is_some_and(|(_, id)| with.last() == Some(&id) && plain.last() != Some(&id));
    let want_bos = add_bos.unwrap_or(has_bos) && bos.is_some();
    let want_eos = add_eos.unwrap_or(has_eos) && eos.is_some();
    if want_bos == has_bos && want_eos == has_eos && with.len() == plain.len() + has_bos as usize + has_eos as usize {
        return Ok(());
    }
    let pp = template_processing(bos.filter(|_| want_bos), eos.filter(|_| want_eos));
    inner.with_post_processor(pp);
    Ok(())
}

/// `TemplateProcessing` `[bos] $A [eos]` (pair: `[bos] $A [eos] [bos] $B:1 [eos]`), or `None` when
/// neither is added.
pub(crate) fn template_processing(
    bos: Option<(&str, u32)>,
    eos: Option<(&str, u32)>,
) -> Option<tokenizers::processors::PostProcessorWrapper> {
    if bos.is_none() && eos.is_none() {
        return None;
    }
    let special = |t: &str, ty: u32| serde_json::json!({"SpecialToken": {"id": t, "type_id": ty}});
    let seq = |s: &str, ty: u32| serde_json::json!({"Sequence": {"id": s, "type_id": ty}});
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut specials = serde_json::Map::new();
    for (i, s) in ["A", "B"].iter().enumerate() {
        let ty = i as u32;
        let part = if i == 0 { &mut single } else { &mut pair };
        if let Some((t, _)) = bos {
            part.push(special(t, ty));
        }
        part.push(seq(s, ty));
        if let Some((t, _)) = eos {
            part.push(special(t, ty));
        }
    }
    let pair: Vec<Value> = single.iter().cloned().chain(pair).collect();
    for (t, id) in bos.into_iter().chain(eos) {
        specials.insert(t.to_owned(), serde_json::json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    let v =
        serde_json::json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials});
    Some(serde_json::from_value(v).expect("valid TemplateProcessing"))
}

/// Incremental detokeniser: [`StreamDecoder::push`] one id at a time and get the text it adds.
///
/// The text of a window of recent ids is decoded as a whole and only its growth is returned, so
/// SentencePiece `▁` spaces, stripped leading spaces, byte-fallback tokens (`<0xE2>`) and byte-level
/// BPE fragments come out exactly as [`Tokenizer::decode`] renders them: the concatenation of all
/// pieces and [`StreamDecoder::finish`] equals `decode(all ids)`. While the window's text ends in
/// U+FFFD (an incomplete UTF-8 sequence) nothing is returned; the bytes wait for the ids that
/// complete them. Special tokens are left out unless made with `stream_with(false)`.
#[derive(Clone)]
pub struct StreamDecoder {
    tok: Arc<tokenizers::Tokenizer>,
    skip: bool,
    /// Special tokens written even though `skip` leaves the others out.
    keep: Vec<u32>,
    /// ids since the start of the window; `ids[..prefix_index]` is context already returned.
    ids: Vec<u32>,
    /// decode(ids[..]) as of the last returned piece.
    prefix: String,
    prefix_index: usize,
}

impl StreamDecoder {
    /// Adds `id`; returns the new text (empty while it waits for more bytes or when `id` is skipped).
    pub fn push(&mut self, id: u32) -> Result<String> {
        if self.skip && self.keep.contains(&id) {
            let mut text = self.finish()?;
            text.push_str(&self.tok.decode(&[id], false).map_err(tk_err)?);
            return Ok(text);
        }
        self.ids.push(id);
        let text = self.tok.decode(&self.ids, self.skip).map_err(tk_err)?;
        if text.len() > self.prefix.len() && !text.ends_with('\u{FFFD}') {
            // The window's text extends the previous one (for every decoder of these tokenizers);
            // should it not, return what follows the common part.
            let start = common_prefix(&text, &self.prefix);
            let piece = text[start..].to_owned();
            self.advance()?;
            Ok(piece)
        } else {
            Ok(String::new())
        }
    }

    /// Keeps only the ids since the previous piece as context for the next one.
    fn advance(&mut self) -> Result<()> {
        let drop = self.prefix_index;
        self.ids.drain(..drop);
        self.prefix_index = self.ids.len();
        self.prefix = self.tok.decode(&self.ids, self.skip).map_err(tk_err)?;
        Ok(())
    }

    /// The text still held back (bytes that never formed a complete character come out as U+FFFD,
    /// as in [`Tokenizer::decode`]); the decoder is then empty.
    pub fn finish(&mut self) -> Result<String> {
        let text = self.tok.decode(&self.ids, self.skip).map_err(tk_err)?;
        let piece = text[common_prefix(&text, &self.prefix)..].to_owned();
        self.ids.clear();
        self.prefix.clear();
        self.prefix_index = 0;
        Ok(piece)
    }
}

/// Length in bytes of the longest common prefix of `a` and `b`, on a character boundary.
fn common_prefix(a: &str, b: &str) -> usize {
    a.char_indices().zip(b.chars()).find(|((_, x), y)| x != y).map_or(a.len().min(b.len()), |((i, _), _)| i)
}
