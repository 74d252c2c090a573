//! Key/value caches for autoregressive decoding.
//!
//! [`KvCache::Standard`] preallocates `[batch, kv_heads, capacity, head_dim]` buffers grown in steps
//! of 256 positions and writes each step's keys and values into them in place (`slice_update` on a
//! buffer nothing else references; on MLX's CUDA backend a decoding step writes through rmlx's
//! attention kernel, which updates the buffers as their only owner, so nothing outside the cache
//! may keep them: [`KvCache::state`] lends them for evaluation). [`KvCache::Rotating`] keeps at
//! most `max_size` positions (a sliding window; Gemma 3's local layers, or every layer when the
//! user sets a context limit), the first `keep` of them never evicted.
//!
//! Each update also returns the attention mask the new queries need, so that the model code never
//! reasons about positions. The buffers and the offset are plain fields a compiled, static-shape
//! decode step can take over: the write position is `offset`, the valid length `offset + 1`.

mod batch;
mod file;
mod quantized;
mod stored;

pub use batch::{BatchCache, RowKv};
pub use file::{load_prompt_cache, save_prompt_cache, PromptCacheFile};
pub use quantized::{pack, quantized_attention, KvQuantization, Packed, QuantizedCache};
pub use stored::Stored;

use crate::Result;
use rmlx::fast::AttentionMask;
use rmlx::{ops, Array};

/// Growth step of the preallocated buffers, in positions.
pub const STEP: i32 = 256;

/// Positions are 32-bit in MLX: a window this large or larger bounds nothing.
pub const MAX_POSITIONS: usize = i32::MAX as usize;

/// The mask for one attention call, owned (see [`Mask::as_attention`]).
#[derive(Clone)]
pub enum Mask {
    /// Every key is visible (a single query over a cache that holds only visible keys).
    None,
    /// Causal, bottom-right aligned (query `i` of `L` sees keys `0..=K-L+i`).
    Causal,
    /// Explicit visibility `[L, K]` (bool): sliding windows.
    Array(Array),
}

impl Mask {
    /// The form [`rmlx::fast::scaled_dot_product_attention`] takes.
    pub fn as_attention(&self) -> AttentionMask<'_> {
        match self {
            Mask::None => AttentionMask::None,
            Mask::Causal => AttentionMask::Causal,
            Mask::Array(a) => AttentionMask::Array(a),
        }
    }
}

/// One layer's cache.
pub enum KvCache {
    /// Unbounded, preallocated.
    Standard(StandardCache),
    /// Bounded to a window of positions.
    Rotating(RotatingCache),
    /// Several sequences of different lengths (continuous batching).
    Batch(BatchCache),
    /// Kept quantised (`--kv-bits`), unbounded or bounded to a window.
    Quantized(QuantizedCache),
}

/// `f` over a model's `caches`: where every layer's is a batch of one sequence that
/// [`BatchCache::take_lone`] takes, as standard caches (so that the steps of a sequence decoding
/// alone in the engine run as `generate`'s, captured on a GPU), then handed back; as they are
/// otherwise.
pub fn with_lone_caches<T>(caches: &mut [KvCache], f: impl FnOnce(&mut [KvCache]) -> T) -> T {
    let lone = !caches.is_empty() && caches.iter().all(|c| matches!(c, KvCache::Batch(b) if b.is_lone()));
    if !lone {
        return f(caches);
    }
    let mut batches = Vec::with_capacity(caches.len());
    for c in caches.iter_mut() {
        let KvCache::Batch(b) = c else { unreachable!("checked above") };
        let standard = b.take_lone().expect("checked above");
        batches.push(std::mem::replace(c, KvCache::Standard(standard)));
    }
    let out = f(caches);
    for (c, batch) in caches.iter_mut().zip(batches) {
        let standard = std::mem::replace(c, batch);
        let (KvCache::Batch(b), KvCache::Standard(s)) = (c, standard) else { unreachable!("swapped above") };
        b.put_lone(s);
    }
    out
}

/// Where the rotary embedding of a layer's new positions starts.
pub enum Offset {
    /// The same position for every sequence.
    Uniform(usize),
    /// One position per sequence, `[batch]` int32.
    PerRow(Array),
}

impl Offset {
    /// The positions as an int32 array: `[1]` for all sequences, or `[batch]`.
    pub fn positions(&self) -> Result<Array> {
        Ok(match self {
            Offset::Uniform(o) => Array::from_slice(&[*o as i32], &[1])?,
            Offset::PerRow(o) => o.astype(rmlx::Dtype::Int32)?,
        })
    }
}

impl KvCache {
    /// An unbounded cache.
    pub fn standard() -> Self {
        KvCache::Standard(StandardCache::default())
    }

    /// A cache of at most `max_size` positions whose first `keep` are never evicted.
    pub fn rotating(max_size: usize, keep: usize) -> Self {
        KvCache::Rotating(RotatingCache::new(max_size, keep))
    }

    /// A cache bounded to `max_size` positions (see [`KvCache::rotating`]), or an unbounded one when
    /// the bound is at least `MAX_POSITIONS`: MLX indexes positions with 32-bit integers, so no
    /// sequence can reach such a window, and the bound must never be cast down to 32 bits.
    pub fn bounded(max_size: usize, keep: usize) -> Self {
        if max_size >= MAX_POSITIONS {
            KvCache::standard()
        } else {
            KvCache::rotating(max_size, keep)
        }
    }

    /// A fresh, empty cache of the same kind and bounds (what a recomputed layer attends with).
    pub fn empty_like(&self) -> Self {
        match self {
            KvCache::Standard(_) => KvCache::standard(),
            KvCache::Rotating(c) => KvCache::rotating(c.max_size, c.keep),
            KvCache::Batch(c) => KvCache::Batch(BatchCache::new(c.rows(), c.window())),
            KvCache::Quantized(c) => KvCache::Quantized(QuantizedCache::new(c.quantization, c.window)),
        }
    }

    /// Positions seen so far (the RoPE offset of the next token); for a batch, the positions
    /// written, padding included.
    pub fn offset(&self) -> usize {
        match self {
            KvCache::Standard(c) => c.offset,
            KvCache::Rotating(c) => c.offset,
            KvCache::Batch(c) => c.width(),
            KvCache::Quantized(c) => c.offset,
        }
    }

    /// Whether [`KvCache::trim`] can still take back positions after `extra` more are written:
    /// an unbounded cache always; a window only while nothing has left it; a batch's always
    /// (within the last update: [`BatchCache::trim_rows`]).
    pub fn trimmable_after(&self, extra: usize) -> bool {
        match self {
            KvCache::Standard(_) => true,
            KvCache::Quantized(c) => c.window.is_none(),
            KvCache::Rotating(c) => c.idx == c.offset && c.offset + extra <= c.max_size,
            KvCache::Batch(_) => true,
        }
    }

    /// Forgets the last `n` positions (speculative decoding's rejected drafts); `false`, and
    /// nothing changed, where it cannot (see [`KvCache::trimmable_after`]).
    pub fn trim(&mut self, n: usize) -> bool {
        match self {
            KvCache::Standard(c) if n <= c.offset => c.offset -= n,
            KvCache::Quantized(c) if c.window.is_none() && n <= c.offset => c.offset -= n,
            KvCache::Rotating(c) if c.idx == c.offset && c.offset <= c.max_size && n <= c.offset => {
                c.offset -= n;
                c.idx -= n;
            }
            KvCache::Batch(c) => return c.trim_rows(&vec![n; c.rows()]).is_ok(),
            _ => return false,
        }
        true
    }

    /// The RoPE offset of the next position of each sequence.
    pub fn rope_offset(&self) -> Result<Offset> {
        Ok(match self {
            KvCache::Batch(c) => Offset::PerRow(c.offsets()?),
            _ => Offset::Uniform(self.offset()),
        })
    }

    /// The sliding window of this layer's positions (`None`: unbounded), as a batch cache of it
    /// must apply it (`BatchCache::new`).
    pub fn window(&self) -> Option<usize> {
        match self {
            KvCache::Standard(_) => None,
            KvCache::Rotating(c) => Some(c.max_size),
            KvCache::Batch(c) => c.window(),
            KvCache::Quantized(c) => c.window.map(|(max_size, _)| max_size),
        }
    }

    /// Appends `k, v: [B, H, L, D]`; returns all visible keys and values and the mask for the `L`
    /// new queries. (A quantised cache's are unpacked here: attention reads them packed through
    /// [`quantized_attention`] instead.)
    pub fn update(&mut self, k: &Array, v: &Array) -> Result<(Array, Array, Mask)> {
        match self {
            KvCache::Standard(c) => c.update(k, v),
            KvCache::Rotating(c) => c.update(k, v),
            KvCache::Batch(c) => {
                let (keys, values, mask) = c.update(k, v)?;
                Ok((keys.unpacked(k.dtype())?, values.unpacked(k.dtype())?, mask))
            }
            KvCache::Quantized(c) => {
                let (keys, values, mask) = c.update(k, v)?;
                Ok((keys.unpack(k.dtype())?, values.unpack(k.dtype())?, mask))
            }
        }
    }

    /// For a quantised cache (or batch): appends `k, v` and returns the visible keys and values
    /// packed, with the mask of the new queries; `None` for a full-precision one (left as it was).
    pub fn update_packed(&mut self, k: &Array, v: &Array) -> Result<Option<(Packed, Packed, Mask)>> {
        match self {
            KvCache::Quantized(c) => Ok(Some(c.update(k, v)?)),
            KvCache::Batch(c) if c.quantization().is_some() => match c.update(k, v)? {
                (Stored::Packed(keys), Stored::Packed(values), mask) => Ok(Some((keys, values, mask))),
                _ => unreachable!("a quantised batch packs what it is given"),
            },
            _ => Ok(None),
        }
    }

    /// Quantises this cache as `q` says once it holds `q.start` positions or more; a quantised
    /// one stays so.
    pub fn quantize(&mut self, q: &KvQuantization) -> Result<()> {
        if let KvCache::Batch(c) = self {
            return c.quantize(q);
        }
        if self.offset() < q.start {
            return Ok(());
        }
        let converted = match self {
            KvCache::Standard(c) => match (&c.keys, &c.values) {
                (Some(k), Some(v)) => {
                    let end = c.offset as i32;
                    QuantizedCache::from_rows(*q, None, &positions(k, 0, end)?, &positions(v, 0, end)?, c.offset)?
                }
                _ => QuantizedCache::new(*q, None),
            },
            KvCache::Rotating(c) => {
                let window = Some((c.max_size, c.keep));
                match (&c.keys, &c.values) {
                    (Some(k), Some(v)) => {
                        let (k, v) = (c.temporal(k)?, c.temporal(v)?);
                        QuantizedCache::from_rows(*q, window, &k, &v, c.offset)?
                    }
                    _ => QuantizedCache::new(*q, window),
                }
            }
            KvCache::Batch(_) | KvCache::Quantized(_) => return Ok(()),
        };
        *self = KvCache::Quantized(converted);
        Ok(())
    }

    /// The positions held, as one sequence's rows in temporal order (`start`: the first one
    /// held, past 0 where a window dropped earlier ones): what the engine's prompt cache keeps of
    /// a sequence. `None` for an empty cache; an error for a batch of several sequences or a
    /// window that keeps its first positions apart from its last ones.
    pub fn held_rows(&self) -> Result<Option<RowKv>> {
        let gap = |keep: usize, held: usize, offset: usize| keep > 0 && held < offset;
        let refused = || crate::Error::InvalidParameter("a window keeping its first positions apart".into());
        Ok(match self {
            KvCache::Standard(c) => match (&c.keys, &c.values) {
                (Some(k), Some(v)) => {
                    let n = c.offset as i32;
                    Some(RowKv {
                        keys: Stored::Plain(positions(k, 0, n)?),
                        values: Stored::Plain(positions(v, 0, n)?),
                        start: 0,
                    })
                }
                _ => None,
            },
            KvCache::Rotating(c) => match (&c.keys, &c.values) {
                (Some(k), Some(v)) => {
                    let (k, v) = (c.temporal(k)?, c.temporal(v)?);
                    let held = dim(&k, 2) as usize;
                    if gap(c.keep, held, c.offset) {
                        return Err(refused());
                    }
                    Some(RowKv { keys: Stored::Plain(k), values: Stored::Plain(v), start: c.offset - held })
                }
                _ => None,
            },
            KvCache::Quantized(c) => match c.held() {
                Some((k, v)) => {
                    let held = dim(&k.words, 2) as usize;
                    if gap(c.window.map_or(0, |w| w.1), held, c.offset) {
                        return Err(refused());
                    }
                    Some(RowKv { keys: Stored::Packed(k), values: Stored::Packed(v), start: c.offset - held })
                }
                None => None,
            },
            KvCache::Batch(b) if b.rows() == 1 => b.extract(0)?,
            KvCache::Batch(_) => {
                return Err(crate::Error::InvalidParameter(
                    "a batch of several sequences is not one sequence's rows".into(),
                ))
            }
        })
    }

    /// Forgets everything (buffers are kept for reuse).
    pub fn reset(&mut self) {
        match self {
            KvCache::Standard(c) => c.offset = 0,
            KvCache::Rotating(c) => {
                *c = RotatingCache::new(c.max_size, c.keep);
            }
            KvCache::Batch(c) => *c = BatchCache::new(c.rows(), c.window()),
            KvCache::Quantized(c) => c.reset(),
        }
    }

    /// The arrays held (to evaluate them together with a step's output).
    pub fn state(&self) -> Vec<&Array> {
        let (k, v) = match self {
            KvCache::Standard(c) => (&c.keys, &c.values),
            KvCache::Rotating(c) => (&c.keys, &c.values),
            KvCache::Batch(c) => return c.state(),
            KvCache::Quantized(c) => return c.state(),
        };
        k.iter().chain(v.iter()).collect()
    }

    /// Makes the arrays held wait for `done` (lazy): evaluating them evaluates it too. The caches
    /// of a pipeline stage wait for the whole pipeline's output, so that whichever a rank
    /// evaluates, its caches or the output, it takes part in the same collectives as the others.
    pub fn wait_for(&mut self, done: &Array) -> Result<()> {
        let arrays: Vec<&mut Array> = match self {
            KvCache::Standard(c) => [&mut c.keys, &mut c.values].into_iter().flatten().collect(),
            KvCache::Rotating(c) => [&mut c.keys, &mut c.values].into_iter().flatten().collect(),
            KvCache::Batch(c) => c.state_mut(),
            KvCache::Quantized(c) => c.state_mut(),
        };
        for a in arrays {
            *a = ops::depends(&[&*a], &[done])?.remove(0);
        }
        Ok(())
    }
}

fn dim(a: &Array, i: usize) -> i32 {
    a.shape()[i]
}

/// Along axis 2 (positions) of a `[B, H, S, D]` buffer.
fn positions(a: &Array, start: i32, stop: i32) -> Result<Array> {
    Ok(a.slice_axis(2, start, stop, 1)?)
}

/// Writes `new` (`[B, H, L, D]`) into the buffer at positions `at..at + L`; returns the buffer.
fn write_at(buf: &mut Option<Array>, new: &Array, at: i32) -> Result<Array> {
    let b = buf.take().expect("allocated before writing");
    let s = b.shape().to_vec();
    let b = ops::slice_update(&b, new, &[0, 0, at, 0], &[s[0], s[1], at + dim(new, 2), s[3]], &[1, 1, 1, 1])?;
    *buf = Some(b.clone());
    Ok(b)
}

/// The first `keep` positions followed by positions `start..end`.
fn keep_and_tail(a: &Array, keep: i32, start: i32, end: i32) -> Result<Array> {
    Ok(ops::concatenate(&[&positions(a, 0, keep)?, &positions(a, start, end)?], 2)?)
}

/// The mask of `len` queries from position `q_start` over keys at positions `key_pos` (in
/// order) in a window of `max_size` positions whose first `keep` stay visible.
fn window_mask(max_size: usize, keep: usize, key_pos: &[i32], q_start: i32, len: usize) -> Result<Mask> {
    // In 64 bits: a window of 2^31 or more must not wrap negative.
    let window = max_size as i64;
    let contiguous = key_pos.windows(2).all(|w| w[1] == w[0] + 1);
    let q_last = q_start + len as i32 - 1;
    if contiguous && i64::from(q_last - key_pos[0]) < window {
        return Ok(Mask::Causal);
    }
    let keep = keep as i64;
    let mut visible = Vec::with_capacity(len * key_pos.len());
    for q in q_start..=q_last {
        visible.extend(key_pos.iter().map(|&p| p <= q && (i64::from(q - p) < window || i64::from(p) < keep)));
    }
    let m = Array::from_slice(&visible, &[len as i32, key_pos.len() as i32])?;
    Ok(Mask::Array(m))
}

/// The shape (`[B, H, L, D]`) and dtype of rows a buffer holds.
pub(super) type Rows = ([i32; 4], rmlx::Dtype);

pub(super) fn rows_of(a: &Array) -> Rows {
    ([dim(a, 0), dim(a, 1), dim(a, 2), dim(a, 3)], a.dtype())
}

/// `buffer`'s first `used` positions followed by `extra` zero ones, for `like` rows.
fn grow(buffer: Option<Array>, (like, dtype): Rows, used: i32, extra: i32) -> Result<Array> {
    let shape = [like[0], like[1], extra, like[3]];
    let fresh = ops::zeros(&shape, dtype)?;
    Ok(match buffer {
        Some(b) => ops::concatenate(&[&positions(&b, 0, used)?, &fresh], 2)?,
        None => fresh,
    })
}

/// The unbounded cache: buffers of `capacity` positions, the first `offset` valid.
#[derive(Default)]
pub struct StandardCache {
    pub keys: Option<Array>,
    pub values: Option<Array>,
    pub offset: usize,
    /// The decoding attention kernel's count of finished chunks per sequence and query head
    /// (`nn::cuda_attention`), zero between its calls; made by its first call.
    pub done: Option<Array>,
}

impl StandardCache {
    /// Positions the buffers can hold before growing.
    pub fn capacity(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| dim(k, 2) as usize)
    }

    fn update(&mut self, k: &Array, v: &Array) -> Result<(Array, Array, Mask)> {
        let len = dim(k, 2);
        let (keys, values, end) = self.write(k, v)?;
        let (keys, values) = (positions(&keys, 0, end as i32)?, positions(&values, 0, end as i32)?);
        Ok((keys, values, if len == 1 { Mask::None } else { Mask::Causal }))
    }

    /// Grows the buffers (allocating them first) so that `k, v: [B, H, L, D]` fit after the
    /// valid positions.
    pub fn reserve(&mut self, k: &Array, v: &Array) -> Result<()> {
        self.reserve_rows(dim(k, 2), rows_of(k), rows_of(v))
    }

    /// [`reserve`](Self::reserve) for keys and values of `shape` (`[B, H, L, D]`) and `dtype`.
    pub fn reserve_for(&mut self, shape: [i32; 4], dtype: rmlx::Dtype) -> Result<()> {
        self.reserve_rows(shape[2], (shape, dtype), (shape, dtype))
    }

    fn reserve_rows(&mut self, len: i32, keys: Rows, values: Rows) -> Result<()> {
        let prev = self.offset as i32;
        if self.keys.is_none() || prev + len > self.capacity() as i32 {
            let extra = (len + STEP - 1) / STEP * STEP;
            self.keys = Some(grow(self.keys.take(), keys, prev, extra)?);
            self.values = Some(grow(self.values.take(), values, prev, extra)?);
        }
        Ok(())
    }

    /// Appends `k, v: [B, H, L, D]`; returns the whole buffers (`[B, H, capacity, D]`) and the
    /// positions now valid in them.
    pub fn write(&mut self, k: &Array, v: &Array) -> Result<(Array, Array, usize)> {
        let prev = self.offset as i32;
        let len = dim(k, 2);
        self.reserve(k, v)?;
        let end = prev + len;
        let keys = write_at(&mut self.keys, k, prev)?;
        let values = write_at(&mut self.values, v, prev)?;
        self.offset = end as usize;
        Ok((keys, values, end as usize))
    }
}

/// Where a rotating cache keeps each position: a ring of `window` slots whose first `keep` hold
/// the first positions for good (window 8, keep 2: positions 5, 7, 8, 13 and 14 in slots 5, 7,
/// 2, 7 and 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ring {
    pub window: usize,
    pub keep: usize,
}

impl Ring {
    /// The slot of position `p`: `p` itself below the window, then the slots after the kept ones
    /// in turn (the same formula as the CUDA attention kernel's).
    pub fn slot(&self, p: usize) -> usize {
        if p < self.window {
            p
        } else {
            self.keep + (p - self.keep) % (self.window - self.keep)
        }
    }
}

/// The bounded cache. Single-token updates write into a ring buffer of `max_size` positions (slots
/// `keep..max_size` rotate), position `p` always in slot [`Ring::slot`]`(p)`, so that a kernel
/// knows the slot from the position; multi-token updates (prefill) put the buffer in temporal
/// order, drop what falls out of the window and append, returning an explicit sliding-window mask
/// (the next single-token update puts the buffers back in ring order).
pub struct RotatingCache {
    pub keys: Option<Array>,
    pub values: Option<Array>,
    /// Positions seen so far.
    pub offset: usize,
    /// Window size.
    pub max_size: usize,
    /// Leading positions never evicted.
    pub keep: usize,
    /// The decoding attention kernel's count of finished chunks (see [`StandardCache::done`]).
    pub done: Option<Array>,
    /// Next write slot.
    idx: usize,
}

impl RotatingCache {
    fn new(max_size: usize, keep: usize) -> Self {
        Self {
            keys: None,
            values: None,
            offset: 0,
            max_size: max_size.max(1),
            keep: keep.min(max_size.saturating_sub(1)),
            done: None,
            idx: 0,
        }
    }

    /// The cache whose buffers `keys, values` (`[B, H, n, D]`, in ring order) hold positions up to
    /// `offset`, the next written to slot `idx` (mlx-lm's `RotatingKVCache` state).
    pub fn from_state(keys: Array, values: Array, offset: usize, max_size: usize, keep: usize, idx: usize) -> Self {
        let mut c = RotatingCache::new(max_size, keep);
        (c.keys, c.values, c.offset, c.idx) = (Some(keys), Some(values), offset, idx);
        c
    }

    /// `(offset, keep, max_size, next write slot)`: the fields of mlx-lm's state beside the buffers.
    pub fn state_fields(&self) -> (usize, usize, usize, usize) {
        (self.offset, self.keep, self.max_size, self.idx)
    }

    /// The ring the buffers form once they hold the window.
    pub fn ring(&self) -> Ring {
        Ring { window: self.max_size, keep: self.keep }
    }

    /// The slot the next single position goes to, where the buffers take it as they are (neither
    /// grown nor put back in ring order after a prefill).
    pub fn next_slot(&self) -> Option<usize> {
        let cap = self.capacity();
        let ready = self.keys.is_some() && cap <= self.max_size && (self.idx < cap || cap == self.max_size);
        let at = if self.idx == self.max_size { self.keep } else { self.idx };
        (ready && at == self.ring().slot(self.offset)).then_some(at)
    }

    /// Makes the buffers ready to take one position (`keys` and `values` rows as `[B, H, 1, D]`
    /// would be): allocated or grown, or back to the window in ring order after a prefill left
    /// more; returns its slot, [`Ring::slot`] of the offset.
    pub fn prepare_write(&mut self, keys: Rows, values: Rows) -> Result<usize> {
        let cap = self.capacity();
        if cap > self.max_size {
            // A prefill left more than the window in temporal order: back to `max_size`
            // positions, the last ones rolled so that each sits in its ring slot.
            let n = self.idx.min(cap);
            let (keep, start) = (self.keep as i32, (n - (self.max_size - self.keep)) as i32);
            let tail = (self.max_size - self.keep) as i32;
            // The oldest position kept after the first `keep` (at least `keep`: the offset is
            // past the window), and its place in the ring's tail.
            let oldest = self.offset - (self.max_size - self.keep);
            let shift = ((oldest - self.keep) % tail as usize) as i32;
            let ring_order = |a: &Array| -> Result<Array> {
                let kept = keep_and_tail(a, keep, start, n as i32)?;
                if shift == 0 {
                    return Ok(kept);
                }
                let parts = [
                    positions(&kept, 0, keep)?,
                    positions(&kept, keep + tail - shift, keep + tail)?,
                    positions(&kept, keep, keep + tail - shift)?,
                ];
                Ok(ops::concatenate(&parts.iter().collect::<Vec<_>>(), 2)?)
            };
            self.keys = Some(ring_order(self.keys.as_ref().expect("cap > 0"))?);
            self.values = Some(ring_order(self.values.as_ref().expect("cap > 0"))?);
            self.idx = self.keep + shift as usize;
        } else if self.idx >= cap && cap < self.max_size {
            let extra = (STEP as usize).min(self.max_size - cap) as i32;
            let used = self.idx as i32;
            self.keys = Some(grow(self.keys.take(), keys, used, extra)?);
            self.values = Some(grow(self.values.take(), values, used, extra)?);
        }
        if self.idx == self.max_size {
            self.idx = self.keep;
        }
        Ok(self.idx)
    }

    /// Counts the position written at [`RotatingCache::next_slot`] (by a kernel).
    pub fn advance(&mut self) {
        if self.idx == self.max_size {
            self.idx = self.keep;
        }
        self.idx += 1;
        self.offset += 1;
    }

    /// Positions the buffers hold before growing (at most the window, but after a prefill).
    pub fn capacity(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| dim(k, 2) as usize)
    }

    /// The valid entries in temporal order, and the absolute position of each.
    fn temporal(&self, buf: &Array) -> Result<Array> {
        let valid = self.offset.min(self.capacity());
        if self.idx == valid {
            return positions(buf, 0, valid as i32);
        }
        let (keep, idx, len) = (self.keep as i32, self.idx as i32, valid as i32);
        Ok(ops::concatenate(&[&positions(buf, 0, keep)?, &positions(buf, idx, len)?, &positions(buf, keep, idx)?], 2)?)
    }

    fn update(&mut self, k: &Array, v: &Array) -> Result<(Array, Array, Mask)> {
        if dim(k, 2) == 1 {
            self.update_in_place(k, v)
        } else {
            self.update_concat(k, v)
        }
    }

    fn update_concat(&mut self, k: &Array, v: &Array) -> Result<(Array, Array, Mask)> {
        let len = dim(k, 2) as usize;
        // Absolute positions of the old entries kept, in temporal order.
        let (old_k, old_v, mut key_pos) = match (&self.keys, &self.values) {
            (Some(kb), Some(vb)) => {
                let (kt, vt) = (self.temporal(kb)?, self.temporal(vb)?);
                let n = dim(&kt, 2) as usize;
                // Each new query may see up to `max_size - 1` earlier positions.
                let target = (self.max_size - 1).max(self.keep);
                let (kt, vt, pos) = if n > target {
                    let (keep, start) = (self.keep as i32, (n - (target - self.keep)) as i32);
                    let cut = |a: &Array| keep_and_tail(a, keep, start, n as i32);
                    let pos: Vec<i32> =
                        (0..keep).chain(self.offset as i32 - (n as i32 - start)..self.offset as i32).collect();
                    (cut(&kt)?, cut(&vt)?, pos)
                } else {
                    let pos = if self.offset > n && self.keep > 0 {
                        (0..self.keep as i32)
                            .chain((self.offset - (n - self.keep)) as i32..self.offset as i32)
                            .collect()
                    } else {
                        ((self.offset - n) as i32..self.offset as i32).collect()
                    };
                    (kt, vt, pos)
                };
                (Some(kt), Some(vt), pos)
            }
            _ => (None, None, Vec::new()),
        };
        let start = self.offset as i32;
        key_pos.extend(start..start + len as i32);
        let keys = match &old_k {
            Some(o) => ops::concatenate(&[o, k], 2)?,
            None => k.clone(),
        };
        let values = match &old_v {
            Some(o) => ops::concatenate(&[o, v], 2)?,
            None => v.clone(),
        };
        let mask = self.window_mask(&key_pos, start, len)?;
        self.offset += len;
        self.idx = dim(&keys, 2) as usize;
        self.keys = Some(keys.clone());
        self.values = Some(values.clone());
        Ok((keys, values, mask))
    }

    fn window_mask(&self, key_pos: &[i32], q_start: i32, len: usize) -> Result<Mask> {
        window_mask(self.max_size, self.keep, key_pos, q_start, len)
    }

    fn update_in_place(&mut self, k: &Array, v: &Array) -> Result<(Array, Array, Mask)> {
        let at = self.prepare_write(rows_of(k), rows_of(v))? as i32;
        let keys = write_at(&mut self.keys, k, at)?;
        let values = write_at(&mut self.values, v, at)?;
        self.advance();
        let valid = self.offset.min(self.capacity()) as i32;
        if valid < self.capacity() as i32 {
            return Ok((positions(&keys, 0, valid)?, positions(&values, 0, valid)?, Mask::None));
        }
        Ok((keys, values, Mask::None))
    }
}
