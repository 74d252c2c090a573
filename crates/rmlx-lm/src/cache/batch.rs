//! One layer's keys and values for a batch of sequences of different lengths (continuous batching).
//!
//! Rows share one write position: a sequence shorter than the others is padded on the left, and
//! the padding is masked out of every attention call. Each row has its own RoPE offset (its own
//! length), so a sequence sees the same positions in a batch as alone. Sequences join a running
//! batch ([`BatchCache::extend`]) and leave it ([`BatchCache::filter`]) at token boundaries, and a
//! finished sequence's keys and values can be copied out for a prompt cache
//! ([`BatchCache::extract`]). This is mlx-lm's `BatchKVCache` design.

use super::{grow, positions, write_at, Mask, STEP};
use crate::{Error, Result};
use rmlx::{ops, Array};
use std::cell::RefCell;

/// What a mask or an offsets array is computed from: every layer of a step asks for the same one.
#[derive(PartialEq)]
struct Key {
    /// 0: a mask, 1: RoPE offsets.
    kind: u8,
    padding: Vec<i32>,
    start: i32,
    len: i32,
    window: Option<i32>,
}

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

/// The keys and values of `rows` sequences, `[rows, kv_heads, capacity, head_dim]`.
pub struct BatchCache {
    keys: Option<Array>,
    values: Option<Array>,
    /// Per row, the leading positions that belong to no sequence.
    padding: Vec<i32>,
    /// Positions written, the same for every row (padding included).
    written: i32,
    /// A sliding window (Gemma 3's local layers): a query sees at most this many positions,
    /// itself included. The buffers keep every position; the mask bounds what is seen.
    window: Option<i32>,
}

impl BatchCache {
    /// An empty batch of `rows` sequences, none of them started.
    pub fn new(rows: usize, window: Option<usize>) -> BatchCache {
        let window = window.map(|w| w.min(i32::MAX as usize) as i32);
        BatchCache { keys: None, values: None, padding: vec![0; rows], written: 0, window }
    }

    /// One sequence whose first positions are `keys`, `values` (`[1, kv_heads, n, head_dim]`, as
    /// [`BatchCache::extract`] returns them): a prompt cache hit.
    pub fn from_prefix(keys: &Array, values: &Array, window: Option<usize>) -> BatchCache {
        let mut c = BatchCache::new(1, window);
        c.written = keys.shape()[2];
        c.keys = Some(keys.clone());
        c.values = Some(values.clone());
        c
    }

    /// Newcomers prefilled together: row `i` starts with `padding[i]` positions that belong to no
    /// sequence, then its `prefixes[i]` from a prompt cache (`[1, kv_heads, width - padding[i],
    /// head_dim]`, or `None` when that width is not positive). `width` positions are written; a
    /// row whose padding passes `width` has the rest of it in the next update's tokens, masked
    /// like the rest. Rows padded on the left end together, so every row's last position is its
    /// own last token.
    pub fn padded(
        prefixes: Vec<Option<(Array, Array)>>,
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
            let got = prefix.as_ref().map_or(0, |(k, _)| k.shape()[2]);
            if got != want {
                return Err(Error::InvalidParameter(format!(
                    "a row padded by {pad} of a batch {width} wide needs a prefix of {want} positions, not {got}"
                )));
            }
        }
        c.padding = padding;
        if width > 0 {
            let like = prefixes
                .iter()
                .flatten()
                .next()
                .ok_or_else(|| Error::InvalidParameter(format!("a batch {width} wide with no row's prefix")))?;
            let row = |prefix: &Option<(Array, Array)>, pick: fn(&(Array, Array)) -> &Array| -> Result<Array> {
                let like = pick(like);
                let s = like.shape();
                let known = prefix.as_ref().map_or(0, |p| pick(p).shape()[2]);
                let zeros = ops::zeros(&[1, s[1], width - known, s[3]], like.dtype())?;
                Ok(match prefix {
                    Some(p) if known == width => pick(p).clone(),
                    Some(p) => ops::concatenate(&[&zeros, pick(p)], 2)?,
                    None => zeros,
                })
            };
            let stack = |pick: fn(&(Array, Array)) -> &Array| -> Result<Array> {
                let rows = prefixes.iter().map(|p| row(p, pick)).collect::<Result<Vec<_>>>()?;
                Ok(ops::concatenate(&rows.iter().collect::<Vec<_>>(), 0)?)
            };
            c.keys = Some(stack(|p| &p.0)?);
            c.values = Some(stack(|p| &p.1)?);
            c.written = width;
        }
        Ok(c)
    }

    /// The sliding window, if any.
    pub fn window(&self) -> Option<usize> {
        self.window.map(|w| w as usize)
    }

    /// Sequences in the batch.
    pub fn rows(&self) -> usize {
        self.padding.len()
    }

    /// Each sequence's length (positions cached).
    pub fn lengths(&self) -> Vec<usize> {
        self.padding.iter().map(|&p| (self.written - p).max(0) as usize).collect()
    }

    /// Positions written, padding included (the buffers' used width).
    pub fn width(&self) -> usize {
        self.written as usize
    }

    /// The RoPE offset of each row's next position, `[rows]` int32.
    pub fn offsets(&self) -> Result<Array> {
        let key = Key { kind: 1, padding: self.padding.clone(), start: self.written, len: 0, window: None };
        memoized(key, || {
            let o: Vec<i32> = self.padding.iter().map(|&p| self.written - p).collect();
            Ok(Array::from_slice(&o, &[o.len() as i32])?)
        })
    }

    /// Bytes held by the buffers.
    pub fn nbytes(&self) -> usize {
        self.keys.iter().chain(self.values.iter()).map(Array::nbytes).sum()
    }

    /// The arrays held.
    pub fn state(&self) -> Vec<&Array> {
        self.keys.iter().chain(self.values.iter()).collect()
    }

    /// Appends `k, v: [rows, H, L, D]`; returns the visible keys and values and the mask of the
    /// `L` new queries: causal, without the padding, within the window. A padding query sees
    /// itself only, so that no row of the softmax is empty.
    pub fn update(&mut self, k: &Array, v: &Array) -> Result<(Array, Array, Mask)> {
        if k.shape()[0] as usize != self.rows() {
            return Err(Error::InvalidParameter(format!(
                "a batch cache of {} rows got keys for {} sequences",
                self.rows(),
                k.shape()[0]
            )));
        }
        let (start, len) = (self.written, k.shape()[2]);
        let capacity = self.keys.as_ref().map_or(0, |b| b.shape()[2]);
        if self.keys.is_none() || start + len > capacity {
            let extra = (len + STEP - 1) / STEP * STEP;
            self.keys = Some(grow(self.keys.take(), k, start, extra)?);
            self.values = Some(grow(self.values.take(), v, start, extra)?);
        }
        let end = start + len;
        let keys = positions(&write_at(&mut self.keys, k, start)?, 0, end)?;
        let values = positions(&write_at(&mut self.values, v, start)?, 0, end)?;
        self.written = end;
        Ok((keys, values, self.mask(start, len)?))
    }

    fn mask(&self, start: i32, len: i32) -> Result<Mask> {
        let padded = self.padding.iter().any(|&p| p > 0);
        let windowed = self.window.is_some_and(|w| start + len > w);
        if !padded && !windowed {
            return Ok(if len == 1 { Mask::None } else { Mask::Causal });
        }
        let memo = Key { kind: 0, padding: self.padding.clone(), start, len, window: self.window };
        let mask = memoized(memo, || {
            let end = start + len;
            let key = ops::arange(0.0, end as f64, 1.0, rmlx::Dtype::Int32)?.reshape(&[1, 1, 1, end])?;
            let query = ops::arange(start as f64, end as f64, 1.0, rmlx::Dtype::Int32)?.reshape(&[1, 1, len, 1])?;
            let pad = Array::from_slice(&self.padding, &[self.rows() as i32, 1, 1, 1])?;
            let mut visible = key.greater_equal(&pad)?.logical_and(&key.less_equal(&query)?)?;
            if let Some(w) = self.window {
                visible = visible.logical_and(&(&query - &key)?.less(&Array::scalar(w))?)?;
            }
            Ok(visible.logical_or(&key.equal(&query)?)?)
        })?;
        Ok(Mask::Array(mask))
    }

    /// Keeps the rows `keep` (in that order) and drops the padding no row needs any more.
    pub fn filter(&mut self, keep: &[usize]) -> Result<()> {
        if keep.iter().any(|&r| r >= self.rows()) {
            return Err(Error::InvalidParameter(format!("filter names a row past the {} of the batch", self.rows())));
        }
        self.padding = keep.iter().map(|&r| self.padding[r]).collect();
        if keep.is_empty() {
            *self = BatchCache::new(0, self.window());
            return Ok(());
        }
        let idx: Vec<i32> = keep.iter().map(|&r| r as i32).collect();
        let idx = Array::from_slice(&idx, &[idx.len() as i32])?;
        let trim = self.padding.iter().copied().min().unwrap_or(0);
        let end = self.written;
        let pick = |b: &Option<Array>| -> Result<Option<Array>> {
            let Some(b) = b else { return Ok(None) };
            let b = b.take(&idx, Some(0))?;
            Ok(Some(if trim > 0 { positions(&b, trim, end)? } else { b }))
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
    /// left so that both write at the same position.
    pub fn extend(&mut self, other: BatchCache) -> Result<()> {
        if other.rows() == 0 {
            return Ok(());
        }
        if self.rows() == 0 {
            *self = other;
            return Ok(());
        }
        let (Some(mk), Some(mv), Some(ok), Some(ov)) = (&self.keys, &self.values, &other.keys, &other.values) else {
            return Err(Error::InvalidParameter("a batch cache joined before its first update".into()));
        };
        let width = self.written.max(other.written);
        let room = STEP;
        let align = |b: &Array, written: i32| -> Result<Array> {
            let used = positions(b, 0, written)?;
            let s = used.shape();
            let zeros = |n: i32| ops::zeros(&[s[0], s[1], n, s[3]], b.dtype());
            Ok(ops::concatenate(&[&zeros(width - written)?, &used, &zeros(room)?], 2)?)
        };
        let keys = ops::concatenate(&[&align(mk, self.written)?, &align(ok, other.written)?], 0)?;
        let values = ops::concatenate(&[&align(mv, self.written)?, &align(ov, other.written)?], 0)?;
        let (shift_mine, shift_theirs) = (width - self.written, width - other.written);
        self.padding.iter_mut().for_each(|p| *p += shift_mine);
        self.padding.extend(other.padding.iter().map(|p| p + shift_theirs));
        self.keys = Some(keys);
        self.values = Some(values);
        self.written = width;
        Ok(())
    }

    /// A copy of row `row`'s keys and values, `[1, H, length, D]` each (not sharing the batch's
    /// buffers, so the batch's memory is freed when it shrinks).
    pub fn extract(&self, row: usize) -> Result<Option<(Array, Array)>> {
        if row >= self.rows() {
            return Err(Error::InvalidParameter(format!("row {row} is past the {} of the batch", self.rows())));
        }
        let (Some(k), Some(v)) = (&self.keys, &self.values) else { return Ok(None) };
        let (r, pad) = (row as i32, self.padding[row]);
        if pad == self.written {
            return Ok(None);
        }
        // An elementwise op writes a new buffer; a slice, `contiguous` or `copy` could share the
        // batch's (a row of a one-head cache is already contiguous).
        let cut = |b: &Array| -> Result<Array> {
            let row = positions(&b.slice_axis(0, r, r + 1, 1)?, pad, self.written)?;
            Ok((&row * Array::scalar_as(1.0, row.dtype())?)?)
        };
        Ok(Some((cut(k)?, cut(v)?)))
    }
}
