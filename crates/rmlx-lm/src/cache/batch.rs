//! One layer's keys and values for a batch of sequences of different lengths (continuous batching).
//!
//! Rows share one write position: a sequence shorter than the others is padded on the left, and
//! the padding is masked out of every attention call. Each row has its own RoPE offset (its own
//! length), so a sequence sees the same positions in a batch as alone. Sequences join a running
//! batch ([`BatchCache::extend`]) and leave it ([`BatchCache::filter`]) at token boundaries, and a
//! finished sequence's keys and values can be copied out for a prompt cache
//! ([`BatchCache::extract`]). This is mlx-lm's `BatchKVCache` design. Speculative decoding takes
//! back each row's rejected drafts on its own ([`BatchCache::trim_rows`]): a row then ends before
//! the shared write position, its next keys go right after its own last position, and the columns
//! past it are hidden by causality until they are written over. A layer with a sliding window
//! (Gemma 3's local layers) drops the positions no query can see any more, so that its memory
//! stays bounded by the window however long the sequences grow. With a quantisation
//! ([`BatchCache::quantize`]) the keys and values are kept packed ([`Stored::Packed`]).

use super::quantized::KvQuantization;
use super::stored::Stored;
use super::{positions, Mask, STEP};
use crate::{Error, Result};
use rmlx::{ops, Array};
use std::cell::RefCell;

/// What a mask or an offsets array is computed from: every layer of a step asks for the same one.
#[derive(PartialEq)]
struct Key {
    /// 0: a mask, 1: RoPE offsets.
    kind: u8,
    padding: Vec<i32>,
    shift: Vec<i32>,
    behind: Vec<i32>,
    start: i32,
    len: i32,
    window: Option<i32>,
}

/// A windowed layer drops the positions no query sees any more once there are this many of them
/// (and at least a window's worth): one copy of the kept positions every so many tokens.
const MIN_DROP: i32 = 64;

/// How many masks and offsets arrays are remembered (Gemma's local and global layers alternate).
const MEMO_SIZE: usize = 4;

thread_local! {
    /// The last masks and offsets built on this thread, reused by the step's other layers (one
    /// set of small ops per step instead of one per layer).
    static MEMO: RefCell<Vec<(Key, Array)>> = const { RefCell::new(Vec::new()) };
}

/// `build()`, or the array built on this thread for the same `key` if it is still remembered.
fn memoized(key: Key, build: impl FnOnce() -> Result<Array>) -> Result<Array> {
    let hit = MEMO.with(|m| m.borrow().iter().find(|(k, _)| *k == key).map(|(_, a)| a.clone()));
    if let Some(a) = hit {
        return Ok(a);
    }
    let a = build()?;
    MEMO.with(|m| {
        let mut m = m.borrow_mut();
        if m.len() == MEMO_SIZE {
            m.remove(0);
        }
        m.push((key, a.clone()));
    });
    Ok(a)
}

/// One sequence's keys and values in one layer, `[1, kv_heads, n, head_dim]` each (or packed):
/// its positions `start..start + n` (`start` > 0 where a sliding window dropped the earlier ones).
#[derive(Clone)]
pub struct RowKv {
    pub keys: Stored,
    pub values: Stored,
    pub start: usize,
}

impl RowKv {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.keys.dim(2) as usize
    }

    /// Whether no position is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The positions before `end` (which must be past `start`), as views.
    pub fn before(&self, end: usize) -> Result<RowKv> {
        let n = end.checked_sub(self.start).filter(|&n| n > 0 && n <= self.len()).ok_or_else(|| {
            Error::InvalidParameter(format!(
                "positions before {end} of a row holding {}..{}",
                self.start,
                self.start + self.len()
            ))
        })? as i32;
        let before = |s: &Stored| s.map(|a| positions(a, 0, n));
        Ok(RowKv { keys: before(&self.keys)?, values: before(&self.values)?, start: self.start })
    }
}

/// The keys and values of `rows` sequences, `[rows, kv_heads, capacity, head_dim]` (or packed).
pub struct BatchCache {
    keys: Option<Stored>,
    values: Option<Stored>,
    /// How new keys and values are packed (`None`: kept at full precision).
    quantization: Option<KvQuantization>,
    /// Per row, the leading positions (columns) that belong to no sequence.
    padding: Vec<i32>,
    /// Per row, its positions no longer held (dropped out of the sliding window): column `c` of
    /// row `i` holds position `c - padding[i] + shift[i]`.
    shift: Vec<i32>,
    /// Per row, the columns before `written` that are past its last position (drafts taken back
    /// by [`BatchCache::trim_rows`]); at least one row has none.
    behind: Vec<i32>,
    /// Columns written, the same for every row (padding included) but for `behind`.
    written: i32,
    /// A sliding window (Gemma 3's local layers): a query sees at most this many positions,
    /// itself included. The mask bounds what is seen; positions before every row's window are
    /// dropped from time to time.
    window: Option<i32>,
    /// The decoding attention kernel's chunk counts while the batch's one sequence decodes as a
    /// standard cache ([`BatchCache::take_lone`]), kept for its next step.
    lone_done: Option<Array>,
}

impl BatchCache {
    /// An empty batch of `rows` sequences, none of them started.
    pub fn new(rows: usize, window: Option<usize>) -> BatchCache {
        let window = window.map(|w| w.min(i32::MAX as usize) as i32);
        let (padding, shift, behind) = (vec![0; rows], vec![0; rows], vec![0; rows]);
        BatchCache {
            keys: None,
            values: None,
            quantization: None,
            padding,
            shift,
            behind,
            written: 0,
            window,
            lone_done: None,
        }
    }

    /// One sequence whose positions so far are `prefix` (as [`BatchCache::extract`] returns
    /// them): a prompt cache hit.
    pub fn from_prefix(prefix: &RowKv, window: Option<usize>) -> BatchCache {
        let mut c = BatchCache::new(1, window);
        c.written = prefix.len() as i32;
        c.shift = vec![prefix.start as i32];
        c.keys = Some(prefix.keys.clone());
        c.values = Some(prefix.values.clone());
        c.quantization = prefix.keys.quantization();
        c
    }

    /// Newcomers prefilled together: row `i`'s positions before `width - padding[i]` are its
    /// `prefixes[i]` from a prompt cache (`None` when there are none), and rows padded on the
    /// left end together, so every row's last position is its own last token. A row whose
    /// padding passes `width` has the rest of it in the next update's tokens, masked like the
    /// rest. A prefix whose window dropped its first positions takes only the columns it holds:
    /// rows are aligned on their last cached position, not their first.
    pub fn padded(
        prefixes: Vec<Option<RowKv>>,
        padding: Vec<i32>,
        width: i32,
        window: Option<usize>,
    ) -> Result<BatchCache> {
        let mut c = BatchCache::new(padding.len(), window);
        if prefixes.len() != padding.len() {
            return Err(Error::InvalidParameter(format!(
                "{} prefixes for {} rows of padding",
                prefixes.len(),
                padding.len()
            )));
        }
        for (prefix, &pad) in prefixes.iter().zip(&padding) {
            let want = (width - pad).max(0);
            let (start, got) = prefix.as_ref().map_or((0, 0), |p| (p.start as i32, p.len() as i32));
            if start + got != want || (prefix.is_some() && got == 0) {
                return Err(Error::InvalidParameter(format!(
                    "a row padded by {pad} of a batch {width} wide needs positions up to {want}, not {start}..{}",
                    start + got
                )));
            }
        }
        // Columns before the computed ones: the longest prefix held.
        let held = |p: &Option<RowKv>| p.as_ref().map_or(0, |p| p.len() as i32);
        let columns = prefixes.iter().map(held).max().unwrap_or(0);
        for (i, prefix) in prefixes.iter().enumerate() {
            c.padding[i] = columns - held(prefix) + (padding[i] - width).max(0);
            c.shift[i] = prefix.as_ref().map_or(0, |p| p.start as i32);
        }
        // Packed if any prefix is (the others packed alike).
        c.quantization = prefixes.iter().flatten().find_map(|p| p.keys.quantization());
        let stored = |s: &Stored| match &c.quantization {
            Some(q) => s.packed(q),
            None => Ok(s.clone()),
        };
        let Some(like) = prefixes.iter().flatten().next() else { return Ok(c) };
        let like = (stored(&like.keys)?, stored(&like.values)?);
        let row = |prefix: &Option<RowKv>, values: bool| -> Result<Stored> {
            let zeros = if values { &like.1 } else { &like.0 }.zeros(1, columns - held(prefix))?;
            Ok(match prefix {
                Some(p) => {
                    let own = stored(if values { &p.values } else { &p.keys })?;
                    if held(prefix) == columns {
                        own
                    } else {
                        zeros.zip(&own, |z, o| Ok(ops::concatenate(&[z, o], 2)?))?
                    }
                }
                None => zeros,
            })
        };
        let stack = |values: bool| -> Result<Stored> {
            let rows = prefixes.iter().map(|p| row(p, values)).collect::<Result<Vec<_>>>()?;
            let mut all = rows[0].clone();
            for r in &rows[1..] {
                all = all.zip(r, |a, b| Ok(ops::concatenate(&[a, b], 0)?))?;
            }
            Ok(all)
        };
        c.keys = Some(stack(false)?);
        c.values = Some(stack(true)?);
        c.written = columns;
        Ok(c)
    }

    /// The most columns a layer with a sliding window of `window` holds when no update passes
    /// `update` positions: the window, the positions waiting to be dropped, the update and the
    /// buffers' room to grow.
    pub fn held_bound(window: usize, update: usize) -> usize {
        window + window.max(MIN_DROP as usize) + update + STEP as usize
    }

    /// The sliding window, if any.
    pub fn window(&self) -> Option<usize> {
        self.window.map(|w| w as usize)
    }

    /// Sequences in the batch.
    pub fn rows(&self) -> usize {
        self.padding.len()
    }

    /// Each sequence's length (its positions so far, held or dropped out of the window).
    pub fn lengths(&self) -> Vec<usize> {
        (0..self.rows()).map(|i| ((self.end(i) - self.padding[i]).max(0) + self.shift[i]) as usize).collect()
    }

    /// The column after row `i`'s last position.
    fn end(&self, i: usize) -> i32 {
        self.written - self.behind[i]
    }

    /// Takes back the last `drop[i]` positions of each row `i` (speculative decoding's rejected
    /// drafts and padding tokens): the row's next update writes where they were. Exact for the
    /// positions of the last update; further back, a windowed layer may have dropped positions
    /// the row's window must see again.
    ///
    /// ```
    /// use rmlx_lm::cache::BatchCache;
    /// let mut c = BatchCache::new(2, None);
    /// let k = rmlx::ops::zeros(&[2, 1, 5, 4], rmlx::Dtype::Float32)?;
    /// c.update(&k, &k)?;
    /// c.trim_rows(&[3, 1])?;
    /// assert_eq!(c.lengths(), vec![2, 4]);
    /// assert_eq!(c.offsets()?.to_vec::<i32>()?, vec![2, 4]);
    /// # Ok::<(), rmlx_lm::Error>(())
    /// ```
    ///
    /// Errors: [`crate::Error::InvalidParameter`] for a count per row that is not one per row or
    /// more than a row holds in its columns.
    pub fn trim_rows(&mut self, drop: &[usize]) -> Result<()> {
        if drop.len() != self.rows() {
            return Err(Error::InvalidParameter(format!("{} counts to trim for {} rows", drop.len(), self.rows())));
        }
        for (i, &n) in drop.iter().enumerate() {
            let held = self.end(i) - self.padding[i].min(self.end(i));
            if n as i32 > held {
                return Err(Error::InvalidParameter(format!("row {i} holds {held} columns, not {n} to trim")));
            }
        }
        for (b, &n) in self.behind.iter_mut().zip(drop) {
            *b += n as i32;
        }
        self.settle();
        Ok(())
    }

    /// The buffers of a batch of one sequence that the batch layout adds nothing to (no padding,
    /// nothing dropped out of a window or taken back, nothing packed), handed over as a standard
    /// cache's: the engine decodes a sequence alone as `generate` does, its steps replayed as one
    /// captured launch (`nn::cuda_step`). `None`, and nothing changed, for any other batch;
    /// [`BatchCache::put_lone`] takes the buffers back.
    ///
    /// ```
    /// use rmlx_lm::cache::BatchCache;
    /// let mut c = BatchCache::new(1, None);
    /// let k = rmlx::ops::zeros(&[1, 2, 3, 4], rmlx::Dtype::Float32)?;
    /// c.update(&k, &k)?;
    /// let mut lone = c.take_lone().unwrap();
    /// assert_eq!(lone.offset, 3);
    /// lone.write(&k, &k)?;
    /// c.put_lone(lone);
    /// assert_eq!(c.lengths(), vec![6]);
    /// # Ok::<(), rmlx_lm::Error>(())
    /// ```
    pub fn take_lone(&mut self) -> Option<super::StandardCache> {
        self.is_lone().then(|| self.lend())
    }

    /// `f` over the batch's buffers as one standard cache of all its rows (its offset the columns
    /// written) and each row's first column (its padding): the fused CPU step
    /// (`nn::cpu_layer::decode_step`) writes one position of every row, or a lone row's next
    /// positions, straight into them. `Ok(None)` without calling `f` for a batch the layout of a
    /// standard cache does not describe (a sliding window, packed keys, rows taken back apart,
    /// nothing written yet); `f` returns `None` when it wrote nothing.
    pub(crate) fn with_plain<T>(
        &mut self,
        f: impl FnOnce(&mut super::StandardCache, &[usize]) -> Result<Option<T>>,
    ) -> Result<Option<T>> {
        if !self.plain() {
            return Ok(None);
        }
        let starts: Vec<usize> = self.padding.iter().map(|&p| p.max(0) as usize).collect();
        let mut standard = self.lend();
        let out = f(&mut standard, &starts);
        self.put_lone(standard);
        out
    }

    /// Whether [`BatchCache::take_lone`] takes this batch.
    pub fn is_lone(&self) -> bool {
        self.rows() == 1 && self.padding[0] == 0 && self.plain()
    }

    /// Takes back what [`BatchCache::take_lone`] handed over, with the positions written since.
    pub fn put_lone(&mut self, lone: super::StandardCache) {
        self.written = lone.offset as i32;
        self.keys = lone.keys.map(Stored::Plain);
        self.values = lone.values.map(Stored::Plain);
        self.lone_done = lone.done;
    }

    /// Whether the buffers are what a standard cache of the batch's rows holds: written, nothing
    /// packed, no window (nothing dropped), no row taken back apart.
    fn plain(&self) -> bool {
        self.window.is_none()
            && self.quantization.is_none()
            && !self.ragged()
            && self.shift.iter().all(|&s| s == 0)
            && matches!((&self.keys, &self.values), (Some(Stored::Plain(_)), Some(Stored::Plain(_))))
    }

    /// The buffers lent as a standard cache's ([`BatchCache::plain`] ones), until
    /// [`BatchCache::put_lone`] takes them back.
    fn lend(&mut self) -> super::StandardCache {
        let (Some(Stored::Plain(keys)), Some(Stored::Plain(values))) = (self.keys.take(), self.values.take()) else {
            unreachable!("plain buffers")
        };
        let (offset, done) = (self.written as usize, self.lone_done.take());
        super::StandardCache { keys: Some(keys), values: Some(values), offset, done }
    }

    /// Moves the shared write position back to the longest row.
    fn settle(&mut self) {
        let common = self.behind.iter().copied().min().unwrap_or(0);
        if common > 0 {
            self.behind.iter_mut().for_each(|b| *b -= common);
            self.written -= common;
        }
    }

    /// Whether some row ends before the shared write position.
    fn ragged(&self) -> bool {
        self.behind.iter().any(|&b| b > 0)
    }

    /// Columns written, padding included (the buffers' used width).
    pub fn width(&self) -> usize {
        self.written as usize
    }

    /// The RoPE offset of each row's next position, `[rows]` int32.
    pub fn offsets(&self) -> Result<Array> {
        let key = Key {
            kind: 1,
            padding: self.padding.clone(),
            shift: self.shift.clone(),
            behind: self.behind.clone(),
            start: self.written,
            len: 0,
            window: None,
        };
        memoized(key, || {
            let o: Vec<i32> = (0..self.rows()).map(|i| self.end(i) - self.padding[i] + self.shift[i]).collect();
            Ok(Array::from_slice(&o, &[o.len() as i32])?)
        })
    }

    /// Bytes held by the buffers.
    pub fn nbytes(&self) -> usize {
        self.keys.iter().chain(self.values.iter()).map(Stored::nbytes).sum()
    }

    /// The arrays held.
    pub fn state(&self) -> Vec<&Array> {
        self.keys.iter().chain(self.values.iter()).flat_map(Stored::arrays).collect()
    }

    /// The arrays held, mutably.
    pub(super) fn state_mut(&mut self) -> Vec<&mut Array> {
        self.keys.iter_mut().chain(self.values.iter_mut()).flat_map(Stored::arrays_mut).collect()
    }

    /// The quantisation new keys and values are packed with, if any.
    pub fn quantization(&self) -> Option<KvQuantization> {
        self.quantization
    }

    /// Packs the batch's keys and values as `q` says from now on, once it has `q.start` columns
    /// written (a packed batch stays so).
    pub fn quantize(&mut self, q: &KvQuantization) -> Result<()> {
        if self.quantization.is_some() || (self.written as usize) < q.start {
            return Ok(());
        }
        self.keys = self.keys.as_ref().map(|s| s.packed(q)).transpose()?;
        self.values = self.values.as_ref().map(|s| s.packed(q)).transpose()?;
        self.quantization = Some(*q);
        Ok(())
    }

    /// Appends `k, v: [rows, H, L, D]`; returns the visible keys and values (packed in a
    /// quantised batch) and the mask of the `L` new queries: causal, without the padding, within
    /// the window. A padding query sees itself only, so that no row of the softmax is empty.
    pub fn update(&mut self, k: &Array, v: &Array) -> Result<(Stored, Stored, Mask)> {
        if k.shape()[0] as usize != self.rows() {
            return Err(Error::InvalidParameter(format!(
                "a batch cache of {} rows got keys for {} sequences",
                self.rows(),
                k.shape()[0]
            )));
        }
        if let Some(w) = self.window {
            // The new queries see no column before this one, nor will any later query.
            let shortest = (0..self.rows()).map(|i| self.end(i)).min().unwrap_or(self.written);
            let dead = shortest - w + 1;
            if dead >= w.max(MIN_DROP) {
                self.drop_columns(dead, k.shape()[2])?;
            }
        }
        let (start, len) = (self.written, k.shape()[2]);
        let (k, v) = (Stored::new(k, self.quantization.as_ref())?, Stored::new(v, self.quantization.as_ref())?);
        let capacity = self.keys.as_ref().map_or(0, |b| b.dim(2));
        if self.keys.is_none() || start + len > capacity {
            let extra = (len + STEP - 1) / STEP * STEP;
            let rows = self.rows() as i32;
            let grow = |old: Option<Stored>, like: &Stored| -> Result<Stored> {
                let fresh = like.zeros(rows, extra)?;
                match old {
                    Some(o) => o.zip(&fresh, |o, f| Ok(ops::concatenate(&[&positions(o, 0, start)?, f], 2)?)),
                    None => Ok(fresh),
                }
            };
            self.keys = Some(grow(self.keys.take(), &k)?);
            self.values = Some(grow(self.values.take(), &v)?);
        }
        let end = start + len;
        // A row that ends before `start` writes right after its own last position.
        let at = if self.ragged() {
            let cols: Vec<i32> = self.behind.iter().flat_map(|&b| (0..len).map(move |l| l - b)).collect();
            Some((Array::from_slice(&cols, &[self.rows() as i32, 1, len, 1])? + Array::scalar(start))?)
        } else {
            None
        };
        let write = |buf: &Stored, new: &Stored| -> Result<Stored> {
            buf.zip(new, |b, n| {
                let s = b.shape();
                Ok(match &at {
                    Some(at) => ops::put_along_axis(b, at, n, Some(2))?,
                    None => ops::slice_update(b, n, &[0, 0, start, 0], &[s[0], s[1], end, s[3]], &[1, 1, 1, 1])?,
                })
            })
        };
        let keys = write(self.keys.as_ref().expect("allocated"), &k)?;
        let values = write(self.values.as_ref().expect("allocated"), &v)?;
        self.keys = Some(keys.clone());
        self.values = Some(values.clone());
        self.written = end;
        let visible = |s: &Stored| s.map(|a| positions(a, 0, end));
        Ok((visible(&keys)?, visible(&values)?, self.mask(start, len)?))
    }

    fn mask(&self, start: i32, len: i32) -> Result<Mask> {
        let padded = self.padding.iter().any(|&p| p > 0);
        let windowed = self.window.is_some_and(|w| start + len > w);
        if !padded && !windowed && !self.ragged() {
            return Ok(if len == 1 { Mask::None } else { Mask::Causal });
        }
        let memo = Key {
            kind: 0,
            padding: self.padding.clone(),
            shift: Vec::new(),
            behind: self.behind.clone(),
            start,
            len,
            window: self.window,
        };
        let mask = memoized(memo, || {
            let end = start + len;
            let key = ops::arange(0.0, end as f64, 1.0, rmlx::Dtype::Int32)?.reshape(&[1, 1, 1, end])?;
            let query = ops::arange(start as f64, end as f64, 1.0, rmlx::Dtype::Int32)?.reshape(&[1, 1, len, 1])?;
            // Each row's queries sit right after its own last position.
            let query = if self.ragged() {
                let behind = Array::from_slice(&self.behind, &[self.rows() as i32, 1, 1, 1])?;
                (&query - &behind)?
            } else {
                query
            };
            let pad = Array::from_slice(&self.padding, &[self.rows() as i32, 1, 1, 1])?;
            let mut visible = key.greater_equal(&pad)?.logical_and(&key.less_equal(&query)?)?;
            if let Some(w) = self.window {
                visible = visible.logical_and(&(&query - &key)?.less(&Array::scalar(w))?)?;
            }
            Ok(visible.logical_or(&key.equal(&query)?)?)
        })?;
        Ok(Mask::Array(mask))
    }

    /// Drops the first `n` columns of every row (out of every row's window), keeping room for
    /// `len` new ones: the kept columns are copied, so the old buffers are freed.
    fn drop_columns(&mut self, n: i32, len: i32) -> Result<()> {
        let room = (len + STEP - 1) / STEP * STEP;
        let end = self.written;
        let keep = |b: &Option<Stored>| -> Result<Option<Stored>> {
            let Some(b) = b else { return Ok(None) };
            let kept = b.map(|a| {
                let s = a.shape();
                let zeros = ops::zeros(&[s[0], s[1], room, s[3]], a.dtype())?;
                Ok(ops::concatenate(&[&positions(a, n, end)?, &zeros], 2)?)
            })?;
            Ok(Some(kept))
        };
        self.keys = keep(&self.keys)?;
        self.values = keep(&self.values)?;
        for (p, s) in self.padding.iter_mut().zip(&mut self.shift) {
            *s += (n - *p).max(0);
            *p = (*p - n).max(0);
        }
        self.written -= n;
        Ok(())
    }

    /// Keeps the rows `keep` (in that order) and drops the padding no row needs any more.
    pub fn filter(&mut self, keep: &[usize]) -> Result<()> {
        if keep.iter().any(|&r| r >= self.rows()) {
            return Err(Error::InvalidParameter(format!("filter names a row past the {} of the batch", self.rows())));
        }
        self.padding = keep.iter().map(|&r| self.padding[r]).collect();
        self.shift = keep.iter().map(|&r| self.shift[r]).collect();
        self.behind = keep.iter().map(|&r| self.behind[r]).collect();
        self.settle();
        if keep.is_empty() {
            let quantization = self.quantization;
            *self = BatchCache::new(0, self.window());
            self.quantization = quantization;
            return Ok(());
        }
        let idx: Vec<i32> = keep.iter().map(|&r| r as i32).collect();
        let idx = Array::from_slice(&idx, &[idx.len() as i32])?;
        let trim = self.padding.iter().copied().min().unwrap_or(0);
        let end = self.written;
        let pick = |b: &Option<Stored>| -> Result<Option<Stored>> {
            let Some(b) = b else { return Ok(None) };
            let picked = b.map(|a| {
                let a = a.take(&idx, Some(0))?;
                Ok(if trim > 0 { positions(&a, trim, end)? } else { a })
            })?;
            Ok(Some(picked))
        };
        self.keys = pick(&self.keys)?;
        self.values = pick(&self.values)?;
        if trim > 0 {
            self.padding.iter_mut().for_each(|p| *p -= trim);
            self.written -= trim;
        }
        Ok(())
    }

    /// Appends the rows of `other` after this batch's, padding whichever batch is shorter on the
    /// left so that both write at the same position. Rows not started yet (a batch of rows that
    /// has had no update) join as rows holding nothing, all padding: speculative decoding's draft
    /// cache gives a sequence that will not speculate such a row, without computing anything.
    ///
    /// ```
    /// use rmlx_lm::cache::BatchCache;
    /// let mut c = BatchCache::new(1, None);
    /// let k = rmlx::ops::zeros(&[1, 2, 3, 4], rmlx::Dtype::Float32)?;
    /// c.update(&k, &k)?;
    /// c.extend(BatchCache::new(1, None))?;
    /// assert_eq!(c.lengths(), vec![3, 0]);
    /// assert_eq!(c.offsets()?.to_vec::<i32>()?, vec![3, 0]);
    /// # Ok::<(), rmlx_lm::Error>(())
    /// ```
    pub fn extend(&mut self, mut other: BatchCache) -> Result<()> {
        if other.rows() == 0 {
            return Ok(());
        }
        if self.rows() == 0 {
            let quantization = self.quantization;
            *self = other;
            if let Some(q) = quantization {
                self.quantization = None;
                self.quantize(&KvQuantization { start: 0, ..q })?;
            }
            return Ok(());
        }
        // Both packed if either is.
        match (self.quantization, other.quantization) {
            (Some(q), None) => other.quantize(&KvQuantization { start: 0, ..q })?,
            (None, Some(q)) => self.quantize(&KvQuantization { start: 0, ..q })?,
            _ => {}
        }
        // A side with no update yet takes buffers of no columns shaped like the other's.
        match (&self.keys, &self.values, &other.keys, &other.values) {
            (None, None, None, None) => {
                self.padding.extend(other.padding);
                self.shift.extend(other.shift);
                self.behind.extend(other.behind);
                return Ok(());
            }
            (Some(k), Some(v), None, None) => {
                other.keys = Some(k.zeros(other.rows() as i32, 0)?);
                other.values = Some(v.zeros(other.rows() as i32, 0)?);
            }
            (None, None, Some(k), Some(v)) => {
                self.keys = Some(k.zeros(self.rows() as i32, 0)?);
                self.values = Some(v.zeros(self.rows() as i32, 0)?);
            }
            _ => {}
        }
        let (Some(mk), Some(mv), Some(ok), Some(ov)) = (&self.keys, &self.values, &other.keys, &other.values) else {
            unreachable!("both sides have buffers")
        };
        let width = self.written.max(other.written);
        let room = STEP;
        let align = |b: &Stored, written: i32| -> Result<Stored> {
            b.map(|a| {
                let used = positions(a, 0, written)?;
                let s = used.shape();
                let zeros = |n: i32| ops::zeros(&[s[0], s[1], n, s[3]], a.dtype());
                Ok(ops::concatenate(&[&zeros(width - written)?, &used, &zeros(room)?], 2)?)
            })
        };
        let rows = |a: &Stored, b: &Stored| a.zip(b, |x, y| Ok(ops::concatenate(&[x, y], 0)?));
        let keys = rows(&align(mk, self.written)?, &align(ok, other.written)?)?;
        let values = rows(&align(mv, self.written)?, &align(ov, other.written)?)?;
        let (shift_mine, shift_theirs) = (width - self.written, width - other.written);
        self.padding.iter_mut().for_each(|p| *p += shift_mine);
        self.padding.extend(other.padding.iter().map(|p| p + shift_theirs));
        self.shift.extend(other.shift);
        self.behind.extend(other.behind);
        self.keys = Some(keys);
        self.values = Some(values);
        self.written = width;
        Ok(())
    }

    /// A copy of row `row`'s keys and values (not sharing the batch's buffers, so the batch's
    /// memory is freed when it shrinks); `None` when it holds no position.
    pub fn extract(&self, row: usize) -> Result<Option<RowKv>> {
        if row >= self.rows() {
            return Err(Error::InvalidParameter(format!("row {row} is past the {} of the batch", self.rows())));
        }
        let (Some(k), Some(v)) = (&self.keys, &self.values) else { return Ok(None) };
        let (r, pad, end) = (row as i32, self.padding[row], self.end(row));
        if pad >= end {
            return Ok(None);
        }
        // An elementwise op writes a new buffer; a slice, `contiguous` or `copy` could share the
        // batch's (a row of a one-head cache is already contiguous).
        let cut = |b: &Stored| -> Result<Stored> {
            b.map(|a| {
                let row = positions(&a.slice_axis(0, r, r + 1, 1)?, pad, end)?;
                Ok((&row * Array::scalar_as(1.0, row.dtype())?)?)
            })
        };
        Ok(Some(RowKv { keys: cut(k)?, values: cut(v)?, start: self.shift[row] as usize }))
    }
}
