//! Keys and values of earlier sequences, kept so that a new prompt sharing their beginning (a
//! system prompt, the earlier turns of a conversation) does not recompute it. Bounded by a byte
//! budget: an entry that would pass it evicts the least recently used ones first, and an entry
//! larger than the whole budget is not kept. Entries are kept apart by the adapter that computed
//! them (its slot; 0 for the base model): keys and values depend on it. A layer with a sliding
//! window may hold only the last positions of an entry: such an entry serves prompts that reuse
//! enough of it for the window to start within what is held.

use crate::cache::RowKv;

struct Entry {
    adapter: usize,
    tokens: Vec<u32>,
    layers: Vec<RowKv>,
    /// The fewest tokens a hit may reuse (0: any number).
    min_reuse: usize,
    bytes: usize,
    last_used: u64,
}

/// The entries, their bytes and the budget.
pub struct PromptCache {
    entries: Vec<Entry>,
    budget: usize,
    bytes: usize,
    clock: u64,
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
        PromptCache { entries: Vec::new(), budget, bytes: 0, clock: 0 }
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
        let usable = prompt.len().saturating_sub(1);
        let (best, shared) = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.adapter == adapter)
            .map(|(i, e)| (i, e.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count().min(usable)))
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

    /// Keeps the keys and values of `tokens` (evaluated arrays, not views of a larger buffer),
    /// to serve prompts that reuse at least `min_reuse` of them. Entries that are a beginning of
    /// `tokens` are dropped where this one serves every prompt they serve.
    pub fn insert(&mut self, adapter: usize, tokens: Vec<u32>, layers: Vec<RowKv>, min_reuse: usize) {
        let bytes: usize = layers.iter().map(|l| l.keys.nbytes() + l.values.nbytes()).sum();
        if tokens.is_empty() || bytes > self.budget {
            return;
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
            return;
        }
        while self.bytes + bytes > self.budget {
            let oldest = (0..self.entries.len()).min_by_key(|&i| self.entries[i].last_used).expect("bytes > 0");
            self.bytes -= self.entries.swap_remove(oldest).bytes;
        }
        self.clock += 1;
        self.bytes += bytes;
        self.entries.push(Entry { adapter, tokens, layers, min_reuse, bytes, last_used: self.clock });
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
