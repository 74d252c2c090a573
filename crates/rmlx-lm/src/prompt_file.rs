//! Prompts kept in files (`rmlx cache-prompt`, `--prompt-cache-file`), as mlx-lm keeps them: a
//! prompt's caches made once ([`LoadedModel::cache_prompt`]) and written in mlx-lm's format
//! ([`crate::cache::save_prompt_cache`]), then checked against the model that reads them
//! ([`LoadedModel::check_prompt_cache`]) before generation continues after them
//! ([`LoadedModel::generate_after`]).
//!
//! A chat prompt is cached as mlx-lm's `cache_prompt` caches it: the user message rendered by the
//! chat template and cut right after its text ([`LoadedModel::open_user_prompt`]), so that a later
//! prompt continues the same message ([`LoadedModel::prompt_after_cache`]): a file cached from
//! `A` and then asked `B` gives the tokens of one message `A` + `B`.
//!
//! rmlx's files carry, besides mlx-lm's `model` and `tokenizer_config`, what they were made with:
//! `rmlx.model` (a fingerprint of the checkpoint's configuration and weight files), `rmlx.dtype`
//! and `rmlx.adapter` (the adapters' fingerprint, or `none`); a file made for another model,
//! dtype or adapter is refused. mlx-lm's files carry only the path it was given: their shapes and
//! dtype are checked.

use crate::cache::{KvCache, PromptCacheFile};
use crate::chat::Message;
use crate::generate::{ids_array, GenerateOptions};
use crate::loader::LoadedModel;
use crate::{Error, KvQuantization, Result};
use rmlx::Dtype;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::Path;

/// What marks the place of a later prompt in a rendered template (mlx-lm's marker).
const QUERY: &str = "<query>";

impl LoadedModel {
    /// rmlx's metadata for a prompt-cache file of this model with the adapters of `adapter`
    /// (`rmlx.model`, `rmlx.dtype`, `rmlx.adapter`), with mlx-lm's `model` (the checkpoint's
    /// path) and `tokenizer_config` (`{}`).
    pub fn prompt_cache_metadata(&self, adapter: Option<&Path>) -> Result<BTreeMap<String, String>> {
        Ok(BTreeMap::from([
            ("model".to_string(), self.source.display().to_string()),
            ("tokenizer_config".to_string(), "{}".to_string()),
            ("rmlx.model".to_string(), fingerprint(&self.source)?),
            ("rmlx.dtype".to_string(), dtype_name(self.dtype).to_string()),
            ("rmlx.adapter".to_string(), adapter.map_or(Ok("none".to_string()), fingerprint)?),
        ]))
    }

    /// The caches of `prompt` run whole through fresh caches, in pieces of `opts.prefill_chunk`
    /// tokens and its last token alone, quantised as `opts.kv_quantization` says and bounded by `opts.context_limit`
    /// (as generation would hold them); `progress(done, total)` after each piece.
    pub fn cache_prompt(
        &self,
        prompt: &[u32],
        opts: &GenerateOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Vec<KvCache>> {
        if prompt.is_empty() {
            return Err(Error::Prompt("the prompt is empty".into()));
        }
        self.check_unsplit("cached")?;
        self.vocab.check(prompt)?;
        if opts.prefill_chunk == 0 {
            return Err(Error::InvalidParameter("prefill_chunk must be positive".into()));
        }
        if let Some(q) = &opts.kv_quantization {
            q.check()?;
        }
        if let Some(limit) = opts.context_limit.filter(|&l| prompt.len() > l) {
            return Err(Error::Prompt(format!(
                "the prompt has {} tokens, more than the context limit of {limit}",
                prompt.len()
            )));
        }
        let mut caches = self.model.new_caches(opts.context_limit);
        let mut done = 0;
        // As generation (and mlx-lm's `generate_step`) runs a prompt: all but the last token in
        // pieces, then the last alone, so that the caches hold what they would then (a window
        // trimmed by the last step, as mlx-lm's files hold it).
        let (body, last) = prompt.split_at(prompt.len() - 1);
        for part in body.chunks(opts.prefill_chunk).chain([last]) {
            self.model.forward_hidden(&ids_array(part)?, &mut caches)?;
            if let Some(q) = &opts.kv_quantization {
                for c in &mut caches {
                    c.quantize(q)?;
                }
            }
            rmlx::eval(caches.iter().flat_map(KvCache::state))?;
            done += part.len();
            progress(done, prompt.len());
        }
        Ok(caches)
    }

    /// Checks that the caches of a prompt-cache file read from `path` fit this model with the
    /// adapters of `adapter` and a cache quantised as `kv` says: what rmlx wrote it with (model,
    /// dtype, adapter), else (mlx-lm's files) each layer's heads, head size, dtype and window.
    ///
    /// Errors: [`Error::PromptCache`] naming the first difference.
    pub fn check_prompt_cache(
        &self,
        path: &Path,
        file: &PromptCacheFile,
        adapter: Option<&Path>,
        kv: Option<&KvQuantization>,
    ) -> Result<()> {
        let refuse = |reason: String| Error::PromptCache { path: path.display().to_string(), reason };
        self.check_unsplit("read from a prompt-cache file")?;
        let ours = self.prompt_cache_metadata(adapter)?;
        let made_with = |key: &str| file.metadata.get(key).map(String::as_str);
        if let Some(model) = made_with("rmlx.model") {
            if model != ours["rmlx.model"] {
                let was = made_with("model").unwrap_or("another model");
                return Err(refuse(format!("made for {was}, not for {}", self.source.display())));
            }
        }
        if let Some(dtype) = made_with("rmlx.dtype").filter(|&d| d != ours["rmlx.dtype"]) {
            return Err(refuse(format!(
                "made in {dtype}; this model computes in {} (pass --dtype {dtype})",
                ours["rmlx.dtype"]
            )));
        }
        if let Some(made) = made_with("rmlx.adapter").filter(|&a| a != ours["rmlx.adapter"]) {
            let (was, is) = (made != "none", adapter.is_some());
            return Err(refuse(match (was, is) {
                (true, false) => "made with adapters; none are loaded now".to_string(),
                (false, _) => "made without adapters; these are loaded now".to_string(),
                (true, true) => "made with other adapters than these".to_string(),
            }));
        }
        // Each layer against what the model makes of one token.
        let mut probe = self.model.new_caches(None);
        if file.caches.len() != probe.len() {
            return Err(refuse(format!("{} layers' caches; this model has {} layers", file.caches.len(), probe.len())));
        }
        self.model.forward_hidden(&ids_array(&[0])?, &mut probe)?;
        for (i, (theirs, mine)) in file.caches.iter().zip(&probe).enumerate() {
            let rows = mine.state()[0].clone();
            let (heads, dim, dtype) = (rows.shape()[1], rows.shape()[3], rows.dtype());
            let (their_heads, their_dim, their_dtype) = layer_rows(theirs);
            if their_heads != heads || their_dim != dim {
                return Err(refuse(format!(
                    "layer {i} holds {their_heads} heads of {their_dim}; this model's have {heads} of {dim}"
                )));
            }
            if their_dtype != dtype {
                let name = dtype_name(their_dtype);
                return Err(refuse(format!(
                    "layer {i} holds {name}; this model computes in {} (pass --dtype {name})",
                    dtype_name(dtype)
                )));
            }
            if let Some(window) = mine.window() {
                if theirs.window() != Some(window) {
                    return Err(refuse(format!(
                        "layer {i} attends a window of {window} positions; the file's cache does not keep it"
                    )));
                }
            }
            if let (KvCache::Quantized(c), Some(q)) = (theirs, kv) {
                if (c.quantization.bits, c.quantization.group_size) != (q.bits, q.group_size) {
                    return Err(refuse(format!(
                        "quantised at {} bits in groups of {}, not --kv-bits {} --kv-group-size {}",
                        c.quantization.bits, c.quantization.group_size, q.bits, q.group_size
                    )));
                }
            }
        }
        if file.caches.windows(2).any(|w| w[0].offset() != w[1].offset()) {
            return Err(refuse("its layers hold different numbers of positions".into()));
        }
        Ok(())
    }

    /// A chat prompt to cache, as mlx-lm's `cache_prompt` renders it: `text` as the user message
    /// (after `system`), the template cut right after it, so that a later prompt continues it.
    pub fn open_user_prompt(&self, text: &str, system: Option<&str>) -> Result<Vec<u32>> {
        let rendered = self.chat_template.render(&chat(system, text), false, None, None)?;
        let text = text.trim();
        let end = rendered
            .rfind(text)
            .ok_or_else(|| Error::Template("the user message does not appear in the rendered chat template".into()))?
            + text.len();
        let ids = self.tokenizer.encode(&rendered[..end], false)?;
        self.vocab.check(&ids)?;
        Ok(ids)
    }

    /// The prompt after a cached [`open_user_prompt`](Self::open_user_prompt), as mlx-lm's
    /// `generate` makes it: the chat template over `text` as the user message (after `system`),
    /// from where the message's text starts on.
    pub fn prompt_after_cache(&self, text: &str, system: Option<&str>) -> Result<Vec<u32>> {
        let messages = chat(system, text);
        self.chat_prompt_after_cache(&messages, messages.len() - 1)
    }

    /// A conversation's prompt after a cached [`open_user_prompt`](Self::open_user_prompt): the
    /// chat template over `messages`, from where the text of message `first` (the user message
    /// the cached text opens) starts on.
    pub fn chat_prompt_after_cache(&self, messages: &[Message], first: usize) -> Result<Vec<u32>> {
        let full = self.chat_template.render(messages, true, None, None)?;
        let mut marked = messages.to_vec();
        let message = marked
            .get_mut(first)
            .ok_or_else(|| Error::Prompt(format!("no message {first} in a conversation of {}", messages.len())))?;
        message.content = QUERY.into();
        let marked = self.chat_template.render(&marked, true, None, None)?;
        let at = marked
            .find(QUERY)
            .ok_or_else(|| Error::Template("the user message does not appear in the rendered chat template".into()))?;
        let ids = self.tokenizer.encode(full.get(at..).unwrap_or_default(), false)?;
        self.vocab.check(&ids)?;
        Ok(ids)
    }

    /// Refuses a model split over ranks (its caches hold each rank's heads or blocks only).
    fn check_unsplit(&self, what: &str) -> Result<()> {
        if self.tensor_parallel.is_some() || self.pipeline_parallel.is_some() {
            return Err(Error::InvalidParameter(format!(
                "a model split over ranks cannot have its prompt {what} (each rank holds part of the caches)"
            )));
        }
        Ok(())
    }
}

fn chat(system: Option<&str>, text: &str) -> Vec<Message> {
    system.map(Message::system).into_iter().chain([Message::user(text)]).collect()
}

/// `(heads, head size, dtype)` of a layer's cache (a packed one's unpacked size).
fn layer_rows(cache: &KvCache) -> (i32, i32, Dtype) {
    match cache {
        KvCache::Quantized(c) => {
            let state = c.state();
            let (words, scales) = (state[0], state[1]);
            (words.shape()[1], words.shape()[3] * 32 / c.quantization.bits, scales.dtype())
        }
        other => {
            let keys = other.state()[0];
            (keys.shape()[1], keys.shape()[3], keys.dtype())
        }
    }
}

fn dtype_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::Bfloat16 => "bfloat16",
        Dtype::Float16 => "float16",
        Dtype::Float32 => "float32",
        _ => "another dtype",
    }
}

/// A fingerprint of the checkpoint (or adapter folder) at `path`: SHA-256 over its JSON files and,
/// for each weight file, its name and length and, of a safetensors file, its header and the
/// first and last 64 bytes of every tensor (two fine-tunes of one model differ there, and a
/// model's files are read in milliseconds); of a GGUF file, 4 KiB at its start, a third, two
/// thirds and its end. 16 hex digits.
pub fn fingerprint(path: &Path) -> Result<String> {
    let mut files: Vec<std::path::PathBuf> = if path.is_dir() {
        std::fs::read_dir(path)
            .map_err(|e| Error::io(path, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("json" | "safetensors" | "gguf")))
            .collect()
    } else {
        vec![path.to_path_buf()]
    };
    files.sort();
    let mut hash = Sha256::new();
    for file in files {
        let name = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        hash.update(name.as_bytes());
        hash_file(&mut hash, &file, &name)?;
    }
    Ok(hash.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect())
}

/// Adds what [`fingerprint`] takes of one file.
fn hash_file(hash: &mut Sha256, file: &Path, name: &str) -> Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let io = |e| Error::io(file, e);
    let mut f = std::fs::File::open(file).map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    hash.update(len.to_le_bytes());
    // A safetensors file's tensors (its header validated) and where its data section starts
    // (after the 8-byte length and the header).
    let safetensors = match name.ends_with(".safetensors") {
        true => {
            let tensors = crate::safetensors_header::check_file(file)?;
            let mut prefix = [0u8; 8];
            f.read_exact(&mut prefix).map_err(io)?;
            Some((tensors, 8 + u64::from_le_bytes(prefix)))
        }
        false => None,
    };
    // Up to `n` bytes from `at` (fewer at the end of the file).
    let mut read_at = |at: u64, n: usize, hash: &mut Sha256| -> Result<()> {
        let mut buf = Vec::with_capacity(n);
        f.seek(SeekFrom::Start(at)).map_err(io)?;
        (&mut f).take(n as u64).read_to_end(&mut buf).map_err(io)?;
        hash.update(&buf);
        Ok(())
    };
    if name.ends_with(".json") {
        read_at(0, len as usize, hash)
    } else if let Some((tensors, data)) = safetensors {
        read_at(0, data as usize, hash)?;
        for t in tensors {
            let (start, end) = (data + t.data_offsets.0, data + t.data_offsets.1);
            read_at(start, (end - start).min(64) as usize, hash)?;
            read_at(end.saturating_sub(64).max(start), (end - start).min(64) as usize, hash)?;
        }
        Ok(())
    } else {
        for at in [0, len / 3, 2 * len / 3, len.saturating_sub(4096)] {
            read_at(at, 4096, hash)?;
        }
        Ok(())
    }
}
