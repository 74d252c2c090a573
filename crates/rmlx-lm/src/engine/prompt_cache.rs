//! Keys and values of earlier sequences, kept so that a new prompt sharing their beginning (a
//! system prompt, the earlier turns of a conversation) does not recompute it. Bounded by a byte
//! budget: an entry that would pass it evicts the least recently used ones first, and an entry
//! larger than the whole budget is not kept. Entries are kept apart by the adapter that computed
//! them (its slot; 0 for the base model): keys and values depend on it. A layer with a sliding
//! window may hold only the last positions of an entry: such an entry serves prompts that reuse
//! enough of it for the window to start within what is held. With a [`DiskTier`], entries the
//! budget lets go (and those held when the cache is dropped) are written to disk, and a prompt
//! that shares more with a file than with any entry in memory reads it back.

use super::prompt_disk::DiskTier;
use crate::cache::RowKv;

struct Entry {
    adapter: usize,
    tokens: Vec<u32>,
    layers: Vec<RowKv>,
    /// The fewest tokens a hit may reuse (0: any number).
    min_reuse: usize,
    bytes: usize,
    last_used: u64,
    /// Written to (or read from) the disk tier already.
    on_disk: bool,
}

/// The entries, their bytes and the budget.
pub struct PromptCache {
    entries: Vec<Entry>,
    budget: usize,
    bytes: usize,
    clock: u64,
    disk: Option<DiskTier>,
}

/// What a lookup found: the keys and values of the first `tokens` positions of the prompt (all
/// of them, or in a windowed layer the last ones).
pub struct Hit {
    pub tokens: usize,
    pub layers: Vec<RowKv>,
}

impl Hit {
    /// Whether only all its `tokens` can be reused (a windowed layer dropped the first ones).
    pub fn whole(&self) -> bool {
        self.layers.iter().any(|l| l.start > 0)
    }
}

impl PromptCache {
    /// An empty cache holding at most `budget` bytes (0: nothing is kept).
    pub fn new(budget: usize) -> PromptCache {
        PromptCache { entries: Vec::new(), budget, bytes: 0, clock: 0, disk: None }
    }

    /// [`PromptCache::new`] spilling to (and reading from) `disk`.
    pub fn with_disk(budget: usize, disk: DiskTier) -> PromptCache {
        PromptCache { entries: Vec::new(), budget, bytes: 0, clock: 0, disk: Some(disk) }
    }

    /// Files of the disk tier and their bytes (`None`: no disk tier).
    pub fn disk_usage(&self) -> Option<(usize, u64)> {
        self.disk.as_ref().map(DiskTier::usage)
    }

    /// The most bytes it holds.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The longest cached beginning of `prompt`, leaving at least its last token to compute (the
    /// next token's logits need it): `None` when no entry shares a token with it.
    pub fn lookup(&mut self, adapter: usize, prompt: &[u32]) -> Option<Hit> {
        if adapter == 0 {
            self.read_from_disk(prompt);
        }
        let usable = prompt.len().saturating_sub(1);
        let (best, shared) = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.adapter == adapter)
            .map(|(i, e)| (i, shared_prefix(&e.tokens, prompt).min(usable)))
            .filter(|&(i, n)| n >= self.entries[i].min_reuse)
            .max_by_key(|&(_, n)| n)?;
        if shared == 0 {
            return None;
        }
        self.clock += 1;
        let e = &mut self.entries[best];
        e.last_used = self.clock;
        let layers = e.layers.iter().map(|l| l.before(shared)).collect::<crate::Result<Vec<_>>>().ok()?;
        Some(Hit { tokens: shared, layers })
    }

    /// Brings the disk tier's entry sharing the most with `prompt` into memory, where it shares
    /// more than any entry there (the base model's entries only).
    fn read_from_disk(&mut self, prompt: &[u32]) {
        let usable = prompt.len().saturating_sub(1);
        let Some((i, shared)) = self.disk.as_ref().and_then(|d| d.best(prompt, usable)) else { return };
        let in_memory = self
            .entries
            .iter()
            .filter(|e| e.adapter == 0)
            .map(|e| shared_prefix(&e.tokens, prompt).min(usable))
            .filter(|&n| n > 0)
            .max()
            .unwrap_or(0);
        if shared <= in_memory {
            return;
        }
        match self.disk.as_mut().expect("checked").read(i) {
            Ok((tokens, layers, min_reuse)) => {
                if self.insert(0, tokens, layers, min_reuse) {
                    self.entries.last_mut().expect("kept").on_disk = true;
                }
            }
            Err(err) => tracing::warn!(%err, "a prompt-cache file could not be read; dropped from the index"),
        }
    }

    /// Writes an entry to the disk tier, if there is one and it is the base model's.
    fn spill(&mut self, e: &Entry) {
        let Some(disk) = self.disk.as_mut().filter(|_| e.adapter == 0 && !e.on_disk) else { return };
        if let Err(err) = disk.write(&e.tokens, &e.layers, e.min_reuse) {
            tracing::warn!(%err, "a prompt-cache entry could not be written to the disk tier");
        }
    }

    /// Keeps the keys and values of `tokens` (evaluated arrays, not views of a larger buffer),
    /// to serve prompts that reuse at least `min_reuse` of them. Entries that are a beginning of
    /// `tokens` are dropped where this one serves every prompt they serve.
    /// Returns whether it was kept (not when larger than the budget or served by an entry held).
    pub fn insert(&mut self, adapter: usize, tokens: Vec<u32>, layers: Vec<RowKv>, min_reuse: usize) -> bool {
        let bytes: usize = layers.iter().map(|l| l.keys.nbytes() + l.values.nbytes()).sum();
        if tokens.is_empty() || bytes > self.budget {
            return false;
        }
        self.entries.retain(|e| {
            let covered = e.adapter == adapter
                && e.tokens.len() <= tokens.len()
                && tokens.starts_with(&e.tokens)
                && min_reuse <= e.min_reuse;
            if covered {
                self.bytes -= e.bytes;
            }
            !covered
        });
        if self
            .entries
            .iter()
            .any(|e| e.adapter == adapter && e.tokens.starts_with(&tokens) && e.min_reuse <= min_reuse)
        {
            return false;
        }
        while self.bytes + bytes > self.budget {
            let oldest = (0..self.entries.len()).min_by_key(|&i| self.entries[i].last_used).expect("bytes > 0");
            let e = self.entries.swap_remove(oldest);
            self.bytes -= e.bytes;
            self.spill(&e);
        }
        self.clock += 1;
        self.bytes += bytes;
        let on_disk = false;
        self.entries.push(Entry { adapter, tokens, layers, min_reuse, bytes, last_used: self.clock, on_disk });
        true
    }

    /// Forgets every entry in memory without writing it to the disk tier (the warm-up's).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.bytes = 0;
    }

    /// Drops the entries computed with the adapter in slot `adapter` (it was unloaded).
    pub fn forget(&mut self, adapter: usize) {
        let bytes = &mut self.bytes;
        self.entries.retain(|e| {
            if e.adapter == adapter {
                *bytes -= e.bytes;
            }
            e.adapter != adapter
        });
    }
}

/// How many tokens `a` and `b` share at their start.
pub(super) fn shared_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Drop for PromptCache {
    /// Entries still in memory go to the disk tier (a server's shutdown keeps them).
    fn drop(&mut self) {
        for e in std::mem::take(&mut self.entries) {
            self.spill(&e);
        }
    }
}
