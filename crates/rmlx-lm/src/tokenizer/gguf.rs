//! Tokenizers from GGUF metadata (`tokenizer.ggml.*`), built to reproduce the Hugging Face
//! tokenizer the GGUF was converted from.
//!
//! * `gpt2`: byte-level BPE from the vocabulary and merges; the pre-tokenizer is chosen by
//!   `tokenizer.ggml.pre` and uses the split regex of the original `tokenizer.json` (the same
//!   families llama.cpp's `llama-vocab.cpp` distinguishes).
//! * `llama`: SentencePiece (Llama 2, Gemma, ...) as transformers' SentencePiece converter turns it
//!   into a `tokenizer.json`: a BPE with byte fallback whose merges are every split of a piece into
//!   two pieces, ranked by the merged piece's score (then by the lengths of the two halves), with
//!   `▁` for spaces.
//!
//! Control tokens (type 3) become special added tokens and user-defined ones (type 4) plain added
//! tokens, so neither is ever split.

use serde_json::{json, Value};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper};

use super::{template_processing, tk_err};
use crate::{Error, Result};

/// Token types of `tokenizer.ggml.token_type`.
const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;

/// Tokenizer data from GGUF metadata (`tokenizer.ggml.*`).
#[derive(Clone, Debug, Default)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: `"gpt2"` (byte-level BPE) or `"llama"` (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: pre-tokenizer family (`"llama-bpe"`, `"qwen2"`, `"smollm"`, ...).
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub scores: Option<Vec<f32>>,
    /// 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    pub token_types: Option<Vec<i32>>,
    pub merges: Option<Vec<String>>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub unk_id: Option<u32>,
    pub pad_id: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
}

impl GgufVocab {
    /// The vocabulary in a GGUF file's metadata (the tensors are not read).
    pub fn read(path: &std::path::Path) -> Result<GgufVocab> {
        gguf_vocab(&crate::gguf::GgufFile::open(path)?)
    }

    fn token_type(&self, id: usize) -> i32 {
        self.token_types.as_ref().and_then(|t| t.get(id).copied()).unwrap_or(NORMAL)
    }
}

/// Reads a [`GgufVocab`] from a GGUF file's metadata.
pub(crate) fn gguf_vocab(file: &crate::gguf::GgufFile) -> Result<GgufVocab> {
    let get = |k: &str| file.get(&format!("tokenizer.ggml.{k}"));
    let missing = |k: &str| Error::Tokenizer(format!("GGUF metadata has no tokenizer.ggml.{k}"));
    let id = |k: &str| get(k).and_then(|v| v.as_u64()).map(|v| v as u32);
    let flag = |k: &str| get(k).and_then(|v| v.as_bool());
    let model = get("model").and_then(|v| v.as_str()).ok_or_else(|| missing("model"))?.to_owned();
    let tokens = get("tokens").and_then(|v| v.to_string_vec()).ok_or_else(|| missing("tokens"))?;
    Ok(GgufVocab {
        model,
        pre: get("pre").and_then(|v| v.as_str()).map(str::to_owned),
        tokens,
        scores: get("scores").and_then(|v| v.to_f32_vec()),
        token_types: get("token_type").and_then(|v| v.to_i64_vec()).map(|v| v.into_iter().map(|t| t as i32).collect()),
        merges: get("merges").and_then(|v| v.to_string_vec()),
        bos_id: id("bos_token_id"),
        eos_id: id("eos_token_id"),
        unk_id: id("unknown_token_id"),
        pad_id: id("padding_token_id"),
        add_bos: flag("add_bos_token"),
        add_eos: flag("add_eos_token"),
        add_space_prefix: flag("add_space_prefix"),
    })
}

// Split regexes of the original tokenizer.json files (llama.cpp rewrites the `(?i:...)` groups for
// its own engine; Oniguruma takes them as they are).
const RE_LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_QWEN2: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_QWEN35: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_DEEPSEEK3: [&str; 3] = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

// llama.cpp's sequential split lists for families whose tokenizer.json chains several splits.
const RE_DEEPSEEK_LLM: [&str; 6] = [
    "[\r\n]",
    "\\s?[A-Za-z\u{b5}\u{c0}-\u{d6}\u{d8}-\u{f6}\u{f8}-\u{1ba}\u{1bc}-\u{1bf}\u{1c4}-\u{293}\u{295}-\u{2af}\u{370}-\u{373}\u{376}\u{377}\u{37b}-\u{37d}\u{37f}\u{386}\u{388}-\u{38a}\u{38c}\u{38e}-\u{3a1}\u{3a3}-\u{3f5}\u{3f7}-\u{481}\u{48a}-\u{52f}\u{531}-\u{556}\u{10a0}-\u{10c5}\u{13a0}-\u{13f5}\u{13f8}-\u{13fd}\u{1c90}-\u{1cba}\u{1cbd}-\u{1cbf}\u{1d00}-\u{1d2b}\u{1d6b}-\u{1d77}\u{1d79}-\u{1d9a}\u{1e00}-\u{1f15}\u{1f18}-\u{1f1d}\u{1f20}-\u{1f45}\u{1f48}-\u{1f4d}\u{1f50}-\u{1f57}\u{1f59}\u{1f5b}\u{1f5d}\u{1f5f}-\u{1f7d}\u{1f80}-\u{1fb4}\u{1fb6}-\u{1fbc}\u{1fbe}\u{1fc2}-\u{1fc4}\u{1fc6}-\u{1fcc}\u{1fd0}-\u{1fd3}\u{1fd6}-\u{1fdb}\u{1fe0}-\u{1fec}\u{1ff2}-\u{1ff4}\u{1ff6}-\u{1ffc}\u{2102}\u{2107}\u{210a}-\u{2113}\u{2115}\u{2119}-\u{211d}\u{2124}\u{2126}\u{2128}\u{212a}-\u{212d}\u{212f}-\u{2134}\u{2139}\u{213c}-\u{213f}\u{2145}-\u{2149}\u{214e}\u{2183}\u{2184}\u{2c00}-\u{2c7b}\u{2c7e}-\u{2ce4}\u{2ceb}-\u{2cee}\u{2cf2}\u{2cf3}\u{a640}-\u{a66d}\u{a680}-\u{a69b}\u{a722}-\u{a76f}\u{a771}-\u{a787}\u{a78b}-\u{a78e}\u{ab70}-\u{abbf}\u{fb00}-\u{fb06}\u{fb13}-\u{fb17}\u{ff21}-\u{ff3a}\u{ff41}-\u{ff5a}\u{10400}-\u{1044f}\u{104b0}-\u{104d3}\u{104d8}-\u{104fb}\u{10c80}-\u{10cb2}\u{10cc0}-\u{10cf2}\u{118a0}-\u{118df}\u{1e900}-\u{1e943}]+",
    "\\s?[!-/:-~\u{ff01}-\u{ff0f}\u{ff1a}-\u{ff5e}\u{2018}-\u{201f}\u{3000}-\u{3002}]+",
    "\\s+$",
    "[\u{4e00}-\u{9fa5}\u{800}-\u{4e00}\u{ac00}-\u{d7ff}]+",
    "\\p{N}+",
];
const RE_DEEPSEEK_CODER: [&str; 5] = ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"];
const RE_FALCON: [&str; 3] = [
    r"[\p{P}\$\+<=>\^~\|`]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"[0-9][0-9][0-9]",
];

fn split(re: &str) -> Value {
    json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false})
}

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

/// Pre-tokenizer, NFC normaliser, and `ignore_merges` for a `tokenizer.ggml.pre` value.
fn bpe_pre(pre: &str) -> (Value, bool, bool) {
    let regexes = |res: &[&str]| {
        let mut v: Vec<Value> = res.iter().map(|r| split(r)).collect();
        v.push(byte_level(false));
        json!({"type": "Sequence", "pretokenizers": v})
    };
    match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2" => {
            (regexes(&[RE_LLAMA3]), false, true)
        }
        "dbrx" | "smaug-bpe" | "chatglm-bpe" => (regexes(&[RE_LLAMA3]), false, false),
        "glm4" | "glm5" => (regexes(&[RE_LLAMA3]), false, true),
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "hunyuan" | "kormo" => (regexes(&[RE_QWEN2]), true, false),
        "qwen35" => (regexes(&[RE_QWEN35]), false, false),
        "gpt-4o" | "llama4" | "minimax-m2" | "kanana2" => (regexes(&[RE_GPT4O]), false, false),
        "tekken" => (regexes(&[RE_TEKKEN]), false, true),
        "deepseek-v3" => (regexes(&RE_DEEPSEEK3), false, false),
        "deepseek-llm" => (regexes(&RE_DEEPSEEK_LLM), false, false),
        "deepseek-coder" => (regexes(&RE_DEEPSEEK_CODER), false, false),
        "falcon" => (regexes(&RE_FALCON), false, false),
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => (
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
            false,
            false,
        ),
        // "gpt-2", "default" and the rest: GPT-2's own regex inside ByteLevel.
        _ => (byte_level(true), false, false),
    }
}

fn wrap<T: serde::de::DeserializeOwned>(v: Value) -> Result<T> {
    serde_json::from_value(v).map_err(tk_err)
}

fn vocab_map(tokens: &[String]) -> Vocab {
    tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect()
}

/// Builds the `tokenizers` pipeline for `v`.
pub(crate) fn build(v: &GgufVocab) -> Result<tokenizers::Tokenizer> {
    if v.tokens.is_empty() {
        return Err(Error::Tokenizer("GGUF vocabulary is empty".into()));
    }
    if let Some(t) = &v.token_types {
        if t.len() != v.tokens.len() {
            return Err(Error::Tokenizer(format!("GGUF has {} tokens but {} token types", v.tokens.len(), t.len())));
        }
    }
    let (mut tok, tokens, add_bos_default) = match v.model.as_str() {
        "gpt2" => build_bpe(v)?,
        "llama" => build_spm(v)?,
        m => {
            return Err(Error::Tokenizer(format!(
                "GGUF tokenizer model `{m}` is not supported (supported: gpt2, llama)"
            )))
        }
    };
    let added: Vec<AddedToken> = (0..tokens.len())
        .filter_map(|i| match v.token_type(i) {
            CONTROL | UNKNOWN => Some(AddedToken::from(tokens[i].clone(), true).normalized(false)),
            USER_DEFINED => Some(AddedToken::from(tokens[i].clone(), false).normalized(false)),
            _ => None,
        })
        .collect();
    let (special, plain): (Vec<_>, Vec<_>) = added.into_iter().partition(|t| t.special);
    tok.add_special_tokens(&special);
    tok.add_tokens(&plain);
    let named = |id: Option<u32>| id.and_then(|i| tokens.get(i as usize).map(|t| (t.as_str(), i)));
    let bos = named(v.bos_id).filter(|_| v.add_bos.unwrap_or(add_bos_default));
    let eos = named(v.eos_id).filter(|_| v.add_eos.unwrap_or(false));
    tok.with_post_processor(template_processing(bos, eos));
    Ok(tok)
}

type Built = (tokenizers::Tokenizer, Vec<String>, bool);

fn build_bpe(v: &GgufVocab) -> Result<Built> {
    let merges = v.merges.as_ref().ok_or_else(|| Error::Tokenizer("GGUF gpt2 tokenizer has no merges".into()))?;
    let merges = merges
        .iter()
        .map(|m| m.split_once(' ').map(|(a, b)| (a.to_owned(), b.to_owned())))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| Error::Tokenizer("GGUF merge without a space".into()))?;
    let pre = v.pre.as_deref().unwrap_or("default");
    let (pre_tok, nfc, ignore_merges) = bpe_pre(pre);
    let bpe = BPE::builder()
        .vocab_and_merges(vocab_map(&v.tokens), merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(tk_err)?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    if nfc {
        tok.with_normalizer(Some(wrap::<NormalizerWrapper>(json!({"type": "NFC"}))?));
    }
    tok.with_pre_tokenizer(Some(wrap::<PreTokenizerWrapper>(pre_tok)?));
    tok.with_decoder(Some(wrap::<DecoderWrapper>(
        json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
    )?));
    let llama3 = matches!(pre, "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" | "tekken");
    Ok((tok, v.tokens.clone(), llama3))
}

/// transformers' `generate_merges`: every split of a piece into two pieces, ordered by the merged
/// piece's score (descending), then by the halves' lengths in characters (descending), ties kept
/// in (piece id, left id, right id) order.
fn spm_merges(tokens: &[String], scores: &[f32]) -> Vec<(String, String)> {
    let ids: std::collections::HashMap<&str, u32> =
        tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i as u32)).collect();
    // (score, left chars, right chars, left, right)
    let mut merges: Vec<(f32, usize, usize, u32, u32)> = Vec::new();
    let mut local = Vec::new();
    for (i, piece) in tokens.iter().enumerate() {
        if ids.get(piece.as_str()) != Some(&(i as u32)) {
            continue; // a duplicate: the dict of transformers keeps one entry
        }
        local.clear();
        for (n, (at, _)) in piece.char_indices().enumerate().skip(1) {
            let (l, r) = piece.split_at(at);
            if let (Some(&li), Some(&ri)) = (ids.get(l), ids.get(r)) {
                local.push((scores[i], n, piece[at..].chars().count(), li, ri));
            }
        }
        local.sort_by_key(|m| (m.3, m.4));
        merges.extend_from_slice(&local);
    }
    merges.sort_by(|a, b| {
        b.0.partial_cmp(&a.0).unwrap_or(std::cmp::Ordering::Equal).then(b.1.cmp(&a.1)).then(b.2.cmp(&a.2))
    });
    merges.into_iter().map(|m| (tokens[m.3 as usize].clone(), tokens[m.4 as usize].clone())).collect()
}

fn build_spm(v: &GgufVocab) -> Result<Built> {
    // llama.cpp's converter writes user-defined pieces with spaces for `▁` and gives control and
    // user-defined pieces the score -1000; the SentencePiece model (and so transformers) has `▁` and 0.
    let tokens: Vec<String> = (0..v.tokens.len())
        .map(|i| match v.token_type(i) {
            USER_DEFINED => v.tokens[i].replace(' ', "\u{2581}"),
            _ => v.tokens[i].clone(),
        })
        .collect();
    let scores: Vec<f32> = match &v.scores {
        Some(s) if s.len() == tokens.len() => (0..tokens.len())
            .map(|i| if matches!(v.token_type(i), CONTROL | USER_DEFINED) { 0.0 } else { s[i] })
            .collect(),
        Some(s) => return Err(Error::Tokenizer(format!("GGUF has {} tokens but {} scores", tokens.len(), s.len()))),
        None => (0..tokens.len()).map(|i| -(i as f32)).collect(),
    };
    let merges = spm_merges(&tokens, &scores);
    let unk = v
        .unk_id
        .and_then(|i| tokens.get(i as usize))
        .cloned()
        .or_else(|| (0..tokens.len()).find(|&i| v.token_type(i) == UNKNOWN).map(|i| tokens[i].clone()));
    let mut builder = BPE::builder().vocab_and_merges(vocab_map(&tokens), merges).byte_fallback(true).fuse_unk(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk);
    }
    let bpe = builder.build().map_err(tk_err)?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    let prefix = v.add_space_prefix.unwrap_or(true);
    let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"});
    let normalizer = if prefix {
        json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u{2581}"}, replace]})
    } else {
        replace
    };
    tok.with_normalizer(Some(wrap::<NormalizerWrapper>(normalizer)?));
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    tok.with_decoder(Some(wrap::<DecoderWrapper>(json!({"type": "Sequence", "decoders": decoders}))?));
    Ok((tok, tokens, true))
}
