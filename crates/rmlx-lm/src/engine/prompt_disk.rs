//! The prompt cache's second tier (`serve --prompt-cache-dir`): entries the memory tier lets go
//! (least recently used first, and every entry still held when the engine ends) are written to a
//! directory as prompt-cache files, within a byte budget of the directory's own (the least
//! recently used files are deleted first), and read back when a prompt shares more with one than
//! with anything in memory. The files
//! outlive the server: a restarted one finds them (ordered by when each was last used: its file
//! time).
//!
//! Each file is a prompt-cache file in mlx-lm's format ([`crate::cache::save_prompt_cache`]):
//! every layer's keys and values of the entry's positions (a windowed layer's last ones as a
//! `RotatingKVCache` whose ring starts at them), with the entry's tokens and what they were
//! computed with in its metadata (`rmlx.model`, `rmlx.dtype`, `rmlx.kv`): files of another model,
//! dtype or key/value quantisation are left alone and not counted. Only the base model's entries
//! are written (an adapter's slot is not the same in the next process).

use super::prompt_cache::shared_prefix;
use crate::cache::{self, KvCache, KvQuantization, QuantizedCache, RotatingCache, RowKv, StandardCache, Stored};
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One file: what it holds, its size and when it was last used.
struct DiskEntry {
    file: PathBuf,
    tokens: Vec<u32>,
    min_reuse: usize,
    bytes: u64,
    last_used: u64,
}

/// A directory of entries within a byte budget.
pub struct DiskTier {
    dir: PathBuf,
    budget: u64,
    /// What this engine's entries are computed with (files that differ are not ours).
    identity: BTreeMap<String, String>,
    windows: Vec<Option<usize>>,
    quantization: Option<KvQuantization>,
    entries: Vec<DiskEntry>,
    bytes: u64,
    clock: u64,
}

/// Where the tier keeps its files and how much it may hold.
#[derive(Clone, Debug)]
pub struct PromptCacheDir {
    pub dir: PathBuf,
    pub budget: u64,
}

impl DiskTier {
    /// The tier over `dir` (created if missing), its files of the same `identity` indexed (their
    /// metadata only; the oldest dropped while they pass `budget`).
    pub fn open(
        spec: &PromptCacheDir,
        identity: BTreeMap<String, String>,
        windows: Vec<Option<usize>>,
        quantization: Option<KvQuantization>,
    ) -> Result<DiskTier> {
        let dir = spec.dir.clone();
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        let mut found = Vec::new();
        for e in std::fs::read_dir(&dir).map_err(|e| Error::io(&dir, e))? {
            let file = e.map_err(|e| Error::io(&dir, e))?.path();
            if file.extension().and_then(|x| x.to_str()) != Some("safetensors") {
                continue;
            }
            let Ok(meta) = std::fs::metadata(&file) else { continue };
            let Some(entry) = read_index(&file, &identity) else { continue };
            let modified = meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
            found.push((modified.unwrap_or_default(), DiskEntry { bytes: meta.len(), ..entry }));
        }
        found.sort_by_key(|(t, _)| *t);
        let mut tier = DiskTier {
            dir,
            budget: spec.budget,
            identity,
            windows,
            quantization,
            entries: Vec::new(),
            bytes: 0,
            clock: 0,
        };
        for (_, mut e) in found {
            tier.clock += 1;
            e.last_used = tier.clock;
            tier.bytes += e.bytes;
            tier.entries.push(e);
        }
        tier.make_room(0);
        Ok(tier)
    }

    /// Files held and their bytes.
    pub fn usage(&self) -> (usize, u64) {
        (self.entries.len(), self.bytes)
    }

    /// The entry sharing the longest beginning with `prompt` (at most `usable` tokens, at least
    /// its `min_reuse`): its index and the tokens shared.
    pub fn best(&self, prompt: &[u32], usable: usize) -> Option<(usize, usize)> {
        self.entries
            .iter()
            .enumerate()
            .map(|(i, e)| (i, shared_prefix(&e.tokens, prompt).min(usable)))
            .filter(|&(i, n)| n > 0 && n >= self.entries[i].min_reuse)
            .max_by_key(|&(_, n)| n)
    }

    /// Reads entry `i`: its tokens, layers and `min_reuse`. A file that cannot be read any more
    /// is dropped from the index (and the error returned).
    pub fn read(&mut self, i: usize) -> Result<(Vec<u32>, Vec<RowKv>, usize)> {
        let read = cache::load_prompt_cache(&self.entries[i].file)
            .and_then(|f| f.caches.into_iter().map(row_of).collect::<Result<Vec<RowKv>>>());
        match read {
            Ok(layers) => {
                self.clock += 1;
                let e = &mut self.entries[i];
                e.last_used = self.clock;
                if let Ok(f) = std::fs::File::options().append(true).open(&e.file) {
                    let _ = f.set_modified(std::time::SystemTime::now());
                }
                Ok((e.tokens.clone(), layers, e.min_reuse))
            }
            Err(err) => {
                let e = self.entries.swap_remove(i);
                self.bytes -= e.bytes;
                Err(err)
            }
        }
    }

    /// Writes an entry (unless one of these tokens is held already, it is larger than the budget,
    /// or a windowed layer holds packed positions, which mlx-lm's format has no class for): the
    /// oldest files go first to make room. Returns whether it was written.
    pub fn write(&mut self, tokens: &[u32], layers: &[RowKv], min_reuse: usize) -> Result<bool> {
        if self.entries.iter().any(|e| e.tokens == tokens && e.min_reuse <= min_reuse) {
            return Ok(false);
        }
        let Some(caches) = layers
            .iter()
            .zip(&self.windows)
            .map(|(l, w)| cache_of(l, *w, self.quantization))
            .collect::<Option<Vec<_>>>()
        else {
            return Ok(false);
        };
        let estimate: u64 = layers.iter().map(|l| (l.keys.nbytes() + l.values.nbytes()) as u64).sum();
        if estimate > self.budget {
            return Ok(false);
        }
        self.make_room(estimate);
        let mut metadata = self.identity.clone();
        metadata.insert("rmlx.tokens".into(), serde_json::to_string(tokens).expect("ids serialise"));
        metadata.insert("rmlx.min_reuse".into(), min_reuse.to_string());
        let file = self.dir.join(format!("{}.safetensors", name_of(tokens, min_reuse)));
        cache::save_prompt_cache(&file, &caches, &metadata)?;
        let bytes = std::fs::metadata(&file).map_err(|e| Error::io(&file, e))?.len();
        self.clock += 1;
        self.bytes += bytes;
        self.entries.push(DiskEntry { file, tokens: tokens.to_vec(), min_reuse, bytes, last_used: self.clock });
        self.make_room(0);
        Ok(true)
    }

    /// Deletes the least recently used files until `more` bytes fit the budget.
    fn make_room(&mut self, more: u64) {
        while self.bytes + more > self.budget && !self.entries.is_empty() {
            let oldest = (0..self.entries.len()).min_by_key(|&i| self.entries[i].last_used).expect("not empty");
            let e = self.entries.swap_remove(oldest);
            self.bytes -= e.bytes;
            if let Err(err) = std::fs::remove_file(&e.file) {
                tracing::warn!(file = %e.file.display(), %err, "could not delete a prompt-cache file");
            }
        }
    }
}

/// The index entry of a file of ours (its metadata read, not its arrays), or `None`.
fn read_index(file: &Path, identity: &BTreeMap<String, String>) -> Option<DiskEntry> {
    crate::safetensors_header::check_file(file).ok()?;
    let meta = rmlx::io::load_safetensors(file).ok()?.metadata;
    if identity.iter().any(|(k, v)| meta.get(&format!("0.{k}")) != Some(v)) {
        return None;
    }
    let tokens: Vec<u32> = serde_json::from_str(meta.get("0.rmlx.tokens")?).ok()?;
    let min_reuse = meta.get("0.rmlx.min_reuse")?.parse().ok()?;
    Some(DiskEntry { file: file.to_path_buf(), tokens, min_reuse, bytes: 0, last_used: 0 })
}

/// A file name for an entry: a hash of its tokens and `min_reuse`, and its length.
fn name_of(tokens: &[u32], min_reuse: usize) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.update((min_reuse as u64).to_le_bytes());
    let digest: String = h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect();
    format!("prompt-{}-{digest}", tokens.len())
}

/// A layer's entry as a cache mlx-lm's format holds: positions from 0 as a plain or quantised
/// cache, a window's last positions as a ring starting at them; `None` for packed positions of a
/// window.
fn cache_of(l: &RowKv, window: Option<usize>, q: Option<KvQuantization>) -> Option<KvCache> {
    let n = l.len();
    Some(match (&l.keys, &l.values) {
        (Stored::Plain(k), Stored::Plain(v)) if l.start == 0 => {
            KvCache::Standard(StandardCache { keys: Some(k.clone()), values: Some(v.clone()), offset: n, done: None })
        }
        (Stored::Plain(k), Stored::Plain(v)) => {
            KvCache::Rotating(RotatingCache::from_state(k.clone(), v.clone(), l.start + n, window?, 0, n))
        }
        (Stored::Packed(k), Stored::Packed(v)) if l.start == 0 => {
            KvCache::Quantized(QuantizedCache::from_packed(q.unwrap_or(k.quantization), k.clone(), v.clone(), n))
        }
        _ => return None,
    })
}

/// A layer read back ([`cache_of`]'s inverse).
fn row_of(c: KvCache) -> Result<RowKv> {
    c.held_rows()?
        .ok_or_else(|| Error::InvalidParameter("a prompt-cache file of the server's holds an empty layer".into()))
}
