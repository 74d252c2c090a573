//! A key/value cache kept quantised (`--kv-bits`), as mlx-lm's `QuantizedKVCache` keeps it: each
//! position's key and value rows packed by MLX's affine quantize along the head dimension (`bits`
//! 2–8, `group_size` 32/64/128: packed `uint32` words, a scale and a bias per group in the
//! activations' dtype), written in place into buffers grown 256 positions at a time, and read by
//! attention through quantised matrix products without unpacking the cache
//! ([`quantized_attention`]). Unlike mlx-lm's, a cache bounded to a window (sliding-window layers,
//! a context limit) quantises too: its positions are kept in temporal order, the oldest beyond
//! the window (after the first `keep`) dropped at each update, and the new queries' mask says
//! which keys each sees.

use super::{dim, keep_and_tail, positions, window_mask, Mask, STEP};
use crate::{Error, Result};
use rmlx::quantization::{quantize, quantized_matmul, QuantMode, Quantized};
use rmlx::{ops, Array, Dtype};

/// How a cache is quantised, and from which position on.
///
/// ```
/// use rmlx_lm::KvQuantization;
/// let q = KvQuantization::new(8);
/// assert_eq!((q.group_size, q.start), (64, 5000));
/// // 1,024 bytes of bfloat16 keys (512 elements) packed at 8 bits: 512 bytes, and a scale and
/// // a bias for each of the 8 groups.
/// assert_eq!(q.packed_bytes(1024, rmlx::Dtype::Bfloat16), 512 + 8 * 2 * 2);
/// assert!(KvQuantization { bits: 7, ..q }.check().is_err());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvQuantization {
    /// Bits per element: 2, 3, 4, 5, 6 or 8.
    pub bits: i32,
    /// Elements sharing a scale and bias: 32, 64 or 128 (it must divide the head dimension).
    pub group_size: i32,
    /// A cache is quantised once it holds this many positions (mlx-lm's `quantized_kv_start`,
    /// default 5000): shorter contexts keep full precision and the fast attention kernels.
    pub start: usize,
}

impl KvQuantization {
    /// mlx-lm's defaults for `bits`: groups of 64 from position 5000.
    pub fn new(bits: i32) -> Self {
        KvQuantization { bits, group_size: 64, start: 5000 }
    }

    /// What `full` bytes of keys and values in `dtype` take packed: `bits` per element, and a
    /// scale and a bias in `dtype` per group.
    pub fn packed_bytes(&self, full: usize, dtype: Dtype) -> usize {
        let elements = full / dtype.size();
        elements * self.bits as usize / 8 + elements / self.group_size as usize * 2 * dtype.size()
    }

    /// `Err` naming what MLX's affine quantisation cannot do.
    pub fn check(&self) -> Result<()> {
        if !crate::checkpoint::QUANT_BITS.contains(&self.bits) {
            return Err(Error::InvalidParameter(format!(
                "--kv-bits {} is not supported (MLX quantises to {:?} bits)",
                self.bits,
                crate::checkpoint::QUANT_BITS
            )));
        }
        if ![32, 64, 128].contains(&self.group_size) {
            return Err(Error::InvalidParameter(format!(
                "--kv-group-size {} is not supported (32, 64 or 128)",
                self.group_size
            )));
        }
        Ok(())
    }
}

/// Packed rows: `[B, H, S, D·bits/32]` words, `[B, H, S, D/group]` scales and biases, and how
/// they were packed.
#[derive(Clone)]
pub struct Packed {
    pub words: Array,
    pub scales: Array,
    pub biases: Array,
    pub quantization: KvQuantization,
}

impl Packed {
    /// `f` on each of the three arrays (which share their first three axes).
    pub fn map(&self, f: impl Fn(&Array) -> Result<Array>) -> Result<Packed> {
        Ok(Packed { words: f(&self.words)?, scales: f(&self.scales)?, biases: f(&self.biases)?, ..self.clone() })
    }

    /// `f` on each of the three arrays and the matching one of `other`.
    pub fn zip(&self, other: &Packed, f: impl Fn(&Array, &Array) -> Result<Array>) -> Result<Packed> {
        Ok(Packed {
            words: f(&self.words, &other.words)?,
            scales: f(&self.scales, &other.scales)?,
            biases: f(&self.biases, &other.biases)?,
            ..self.clone()
        })
    }

    /// The arrays, for evaluation.
    pub fn arrays(&self) -> [&Array; 3] {
        [&self.words, &self.scales, &self.biases]
    }

    /// The arrays, mutably.
    pub fn arrays_mut(&mut self) -> [&mut Array; 3] {
        [&mut self.words, &mut self.scales, &mut self.biases]
    }

    /// As MLX's quantised matrix.
    pub fn as_quantized(&self) -> Quantized {
        Quantized {
            weight: self.words.clone(),
            scales: self.scales.clone(),
            biases: Some(self.biases.clone()),
            group_size: self.quantization.group_size,
            bits: self.quantization.bits,
            mode: QuantMode::Affine,
        }
    }

    /// The rows unpacked, in `dtype`.
    pub fn unpack(&self, dtype: Dtype) -> Result<Array> {
        Ok(rmlx::quantization::dequantize(&self.as_quantized(), Some(dtype))?)
    }
}

/// `rows: [B, H, L, D]` quantised along `D`.
pub fn pack(rows: &Array, q: &KvQuantization) -> Result<Packed> {
    let d = rows.shape().last().copied().unwrap_or(0);
    if d % q.group_size != 0 {
        return Err(Error::InvalidParameter(format!(
            "--kv-group-size {} does not divide the head dimension {d}",
            q.group_size
        )));
    }
    let p = quantize(rows, q.group_size, q.bits, QuantMode::Affine)?;
    let biases = p.biases.expect("affine quantisation has biases");
    Ok(Packed { words: p.weight, scales: p.scales, biases, quantization: *q })
}

/// One layer's quantised cache.
pub struct QuantizedCache {
    pub quantization: KvQuantization,
    keys: Option<Packed>,
    values: Option<Packed>,
    /// Positions seen so far.
    pub offset: usize,
    /// `(max_size, keep)` of a cache bounded to a window; `None`: unbounded.
    pub window: Option<(usize, usize)>,
}

impl QuantizedCache {
    /// An empty cache (`window`: see [`QuantizedCache::window`]).
    pub fn new(quantization: KvQuantization, window: Option<(usize, usize)>) -> Self {
        QuantizedCache { quantization, keys: None, values: None, offset: 0, window }
    }

    /// The cache holding `offset` positions, `keys, values: [B, H, n, D]` in temporal order (for
    /// a window, the first `keep` positions then the last `n - keep`), quantised.
    pub fn from_rows(
        quantization: KvQuantization,
        window: Option<(usize, usize)>,
        keys: &Array,
        values: &Array,
        offset: usize,
    ) -> Result<Self> {
        let (keys, values) = (pack(keys, &quantization)?, pack(values, &quantization)?);
        Ok(QuantizedCache { quantization, keys: Some(keys), values: Some(values), offset, window })
    }

    /// The unbounded cache holding `offset` positions of packed `keys, values` (`[B, H, n, ·]`,
    /// `n ≥ offset`; mlx-lm's `QuantizedKVCache` state).
    pub fn from_packed(quantization: KvQuantization, keys: Packed, values: Packed, offset: usize) -> Self {
        QuantizedCache { quantization, keys: Some(keys), values: Some(values), offset, window: None }
    }

    /// The positions held, packed (in temporal order), or `None` when empty.
    pub fn held(&self) -> Option<(Packed, Packed)> {
        let n = match self.window {
            None => self.offset as i32,
            Some(_) => dim(&self.keys.as_ref()?.words, 2),
        };
        let cut = |p: &Packed| p.map(|a| positions(a, 0, n)).ok();
        Some((cut(self.keys.as_ref()?)?, cut(self.values.as_ref()?)?))
    }

    /// The arrays held (to evaluate them with a step's output).
    pub fn state(&self) -> Vec<&Array> {
        self.keys.iter().chain(self.values.iter()).flat_map(Packed::arrays).collect()
    }

    /// The same arrays, mutably (see `KvCache::wait_for`).
    pub(super) fn state_mut(&mut self) -> Vec<&mut Array> {
        let mut out = Vec::new();
        for p in self.keys.iter_mut().chain(self.values.iter_mut()) {
            out.extend(p.arrays_mut());
        }
        out
    }

    /// Forgets everything.
    pub fn reset(&mut self) {
        *self = QuantizedCache::new(self.quantization, self.window);
    }

    /// Appends `k, v: [B, H, L, D]` (quantised here); returns every visible key and value,
    /// packed, and the mask of the `L` new queries.
    pub fn update(&mut self, k: &Array, v: &Array) -> Result<(Packed, Packed, Mask)> {
        let (k, v) = (pack(k, &self.quantization)?, pack(v, &self.quantization)?);
        match self.window {
            None => self.append(&k, &v),
            Some((max_size, keep)) => self.slide(&k, &v, max_size, keep),
        }
    }

    /// Grows the unbounded buffers (allocating them first) so that `len` more positions packed as
    /// `like` (`[B, H, ·, ·]`) fit after the valid ones, by whole steps.
    fn reserve(&mut self, like: (&Packed, &Packed), len: i32) -> Result<()> {
        let (k, v) = like;
        let prev = self.offset as i32;
        let capacity = self.keys.as_ref().map_or(0, |p| dim(&p.words, 2));
        if self.keys.is_none() || prev + len > capacity {
            let extra = (len + STEP - 1) / STEP * STEP;
            let grow = |old: Option<Packed>, like: &Packed| -> Result<Packed> {
                like.map(|a| {
                    let s = a.shape();
                    let fresh = ops::zeros(&[s[0], s[1], extra, s[3]], a.dtype())?;
                    Ok(fresh)
                })
                .and_then(|fresh| match old {
                    Some(o) => o.zip(&fresh, |o, f| Ok(ops::concatenate(&[&positions(o, 0, prev)?, f], 2)?)),
                    None => Ok(fresh),
                })
            };
            self.keys = Some(grow(self.keys.take(), k)?);
            self.values = Some(grow(self.values.take(), v)?);
        }
        Ok(())
    }

    /// For a kernel that packs and writes a decoding step's position itself: an unbounded
    /// cache's buffers grown so that one more position of `[B, H, 1, D]` rows of `dtype` fits,
    /// lent (`[B, H, capacity, ·]` keys and values) until [`QuantizedCache::give_back`].
    pub(crate) fn lend_for_one(&mut self, rows: [i32; 4], dtype: Dtype) -> Result<Option<(Packed, Packed)>> {
        if self.window.is_some() || rows[2] != 1 {
            return Ok(None);
        }
        let capacity = self.keys.as_ref().map_or(0, |p| dim(&p.words, 2) as usize);
        if self.offset + 1 > capacity {
            let like = pack(&ops::zeros(&rows, dtype)?, &self.quantization)?;
            self.reserve((&like, &like), 1)?;
        }
        Ok(self.keys.take().zip(self.values.take()))
    }

    /// Takes back the buffers lent by [`QuantizedCache::lend_for_one`], with `written` positions
    /// (0 or 1) more held.
    pub(crate) fn give_back(&mut self, keys: Packed, values: Packed, written: usize) {
        (self.keys, self.values) = (Some(keys), Some(values));
        self.offset += written;
    }

    /// Unbounded: written in place after the valid positions, the buffers grown by whole steps.
    fn append(&mut self, k: &Packed, v: &Packed) -> Result<(Packed, Packed, Mask)> {
        let (prev, len) = (self.offset as i32, dim(&k.words, 2));
        self.reserve((k, v), len)?;
        let write = |buf: &Packed, new: &Packed| -> Result<Packed> {
            buf.zip(new, |b, n| {
                let s = b.shape();
                Ok(ops::slice_update(b, n, &[0, 0, prev, 0], &[s[0], s[1], prev + len, s[3]], &[1, 1, 1, 1])?)
            })
        };
        let keys = write(self.keys.as_ref().expect("allocated"), k)?;
        let values = write(self.values.as_ref().expect("allocated"), v)?;
        self.keys = Some(keys.clone());
        self.values = Some(values.clone());
        self.offset += len as usize;
        let (end, capacity) = (self.offset as i32, dim(&keys.words, 2));
        if len > 1 {
            // A prompt's piece (attended unpacked): the valid positions, causally.
            let valid = |p: &Packed| p.map(|a| positions(a, 0, end));
            return Ok((valid(&keys)?, valid(&values)?, Mask::Causal));
        }
        // A decoding step: the whole buffers (a multiple of 256 positions, as MLX's CUDA
        // quantised product wants them: no copy), the positions past the valid ones masked.
        let key = ops::arange(0.0, capacity as f64, 1.0, Dtype::Int32)?.reshape(&[1, capacity])?;
        Ok((keys, values, Mask::Array(key.less(&Array::scalar(end))?)))
    }

    /// Bounded to `max_size` positions: the kept ones (all but those each new query can no longer
    /// see, the first `keep` always) in temporal order, then the new ones.
    fn slide(&mut self, k: &Packed, v: &Packed, max_size: usize, keep: usize) -> Result<(Packed, Packed, Mask)> {
        let len = dim(&k.words, 2) as usize;
        let mut key_pos: Vec<i32> = Vec::new();
        let (keys, values) = match (self.keys.take(), self.values.take()) {
            (Some(ok), Some(ov)) => {
                let n = dim(&ok.words, 2) as usize;
                let target = (max_size - 1).max(keep);
                let (ok, ov, first_tail) = if n > target {
                    let (kp, start) = (keep as i32, (n - (target - keep)) as i32);
                    let cut = |p: &Packed| p.map(|a| keep_and_tail(a, kp, start, n as i32));
                    (cut(&ok)?, cut(&ov)?, self.offset - (target - keep))
                } else {
                    (ok, ov, self.offset - (n - keep.min(n)))
                };
                let held = keep.min(n);
                key_pos.extend(0..held as i32);
                key_pos.extend(first_tail as i32..self.offset as i32);
                let cat = |a: &Packed, b: &Packed| a.zip(b, |x, y| Ok(ops::concatenate(&[x, y], 2)?));
                (cat(&ok, k)?, cat(&ov, v)?)
            }
            _ => (k.clone(), v.clone()),
        };
        let start = self.offset as i32;
        key_pos.extend(start..start + len as i32);
        // One query sees every key held (the oldest was dropped to make room for it).
        let mask = if len == 1 { Mask::None } else { window_mask(max_size, keep, &key_pos, start, len)? };
        self.offset += len;
        self.keys = Some(keys.clone());
        self.values = Some(values.clone());
        Ok((keys, values, mask))
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        self.state().iter().map(|a| a.nbytes()).sum()
    }
}

/// `softmax(q kᵀ · scale [capped], masked [with sinks]) v` for `q: [B, Hq, L, D]` over packed
/// `keys, values` of `Hkv` heads, as mlx-lm's quantised attention computes it: each group of
/// query heads against its key/value head through two quantised products, the softmax in
/// float32. The products take the `B·Hkv` heads as their batch and each group's `Hq/Hkv · L`
/// queries as rows (MLX's CUDA backend has no quantised product that broadcasts a batch axis,
/// which stops mlx-lm's there). Gemma 2's soft cap and gpt-oss's sinks too, which mlx-lm's does
/// not take.
pub fn quantized_attention(
    q: &Array,
    keys: &Packed,
    values: &Packed,
    scale: f32,
    mask: &Mask,
    softcap: Option<f32>,
    sinks: Option<&Array>,
) -> Result<Array> {
    let (&[b, hq, l, d], hkv) = (q.shape(), dim(&keys.words, 1)) else {
        return Err(Error::InvalidParameter(format!("attention takes [B, H, L, D] queries, not {:?}", q.shape())));
    };
    let (repeats, valid) = (hq / hkv, dim(&keys.words, 2));
    // MLX's CUDA quantised product takes whole tiles of keys: pad to a multiple of 64, masked.
    let pad = (64 - valid % 64) % 64;
    let k = valid + pad;
    let padded = |p: &Packed| -> Result<Packed> {
        if pad == 0 {
            return Ok(p.clone());
        }
        p.map(|a| {
            let s = a.shape();
            Ok(ops::concatenate(&[a, &ops::zeros(&[s[0], s[1], pad, s[3]], a.dtype())?], 2)?)
        })
    };
    let heads = |p: &Packed| padded(p)?.map(|a| Ok(a.reshape(&[b * hkv, k, a.shape()[3]])?));
    let (keys, values) = (heads(keys)?.as_quantized(), heads(values)?.as_quantized());
    let q = (q * scale)?.reshape(&[b * hkv, repeats * l, d])?;
    let mut scores = quantized_matmul(&q, &keys, true)?.reshape(&[b, hkv, repeats, l, k])?;
    if let Some(cap) = softcap {
        scores = (ops::tanh(&(&scores / cap)?)? * cap)?;
    }
    let ki = ops::arange(0.0, k as f64, 1.0, Dtype::Int32)?.reshape(&[1, k])?;
    let visible = match mask {
        Mask::None if pad == 0 => None,
        Mask::None => Some(ki.less(&Array::scalar(valid))?),
        Mask::Causal => {
            let qi = ops::arange((valid - l) as f64, valid as f64, 1.0, Dtype::Int32)?.reshape(&[l, 1])?;
            Some(qi.greater_equal(&ki)?)
        }
        Mask::Array(m) => {
            let m = match pad {
                0 => m.clone(),
                _ => {
                    let mut s = m.shape().to_vec();
                    *s.last_mut().expect("a mask has axes") = pad;
                    ops::concatenate(&[m, &ops::zeros(&s, Dtype::Bool)?], -1)?
                }
            };
            // A batch's mask `[B, 1, L, K]` gets the axis of the query heads' groups.
            Some(if m.ndim() > 3 { m.expand_dims(-3)? } else { m })
        }
    };
    if let Some(m) = visible {
        scores = ops::r#where(&m, &scores, &Array::scalar_as(lowest(scores.dtype()), scores.dtype())?)?;
    }
    let weights = match sinks {
        None => ops::softmax(&scores, -1, true)?,
        Some(s) => {
            // The sink's logit joins each row's softmax and takes its share of the weight.
            let s = s.astype(scores.dtype())?.reshape(&[1, hkv, repeats, 1, 1])?;
            let s = ops::broadcast_to(&s, &[b, hkv, repeats, l, 1])?;
            let with = ops::softmax(&ops::concatenate(&[&s, &scores], -1)?, -1, true)?;
            with.slice_axis(-1, 1, k + 1, 1)?
        }
    };
    let weights = weights.reshape(&[b * hkv, repeats * l, k])?;
    let out = quantized_matmul(&weights, &values, false)?;
    Ok(out.reshape(&[b, hq, l, d])?)
}

/// The lowest finite value of a floating dtype (what masked scores become).
fn lowest(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::Float16 => -65504.0,
        Dtype::Bfloat16 => -3.389_531_389_251_535_5e38,
        _ => f32::MIN as f64,
    }
}
