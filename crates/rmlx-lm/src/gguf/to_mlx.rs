//! Converting a GGUF tensor into an rmlx [`Weight`]: the float types as they are, `Q4_0`, `Q4_1`
//! and `Q8_0` repacked losslessly into MLX's affine layout (group size 32, float16 scales and
//! biases: `Q4_0`'s `d·(q−8)` becomes scale `d`, bias `−8d`; `Q4_1`'s `d·q + m` scale `d`, bias
//! `m`; `Q8_0`'s `d·q` the unsigned code `q + 128` with scale `d`, bias `−128d`; a bias that
//! overflows float16 makes the tensor dequantised instead), `MXFP4` repacked losslessly into MLX's
//! `mxfp4` mode (the same e2m1 codes and e8m0 exponents: ggml keeps a block's first 16 values in the
//! low nibbles of its 16 bytes and the next 16 in the high ones, MLX consecutive values in
//! consecutive nibbles), `Q4_K` and `Q5_K` into MLX's affine 4- and 5-bit layouts in groups of 32
//! with float32 scales and biases (a sub-block's `d·sc·q − dmin·m`: scale `d·sc`, bias `−dmin·m`,
//! both exact in float32, so the values are ggml's bit for bit), every other type dequantised on
//! the CPU by ggml's reference formulas (`dequant.rs`). The reader itself (`mod.rs`) only parses and checks.

use super::dequant::{self, threads_for};
use super::{GgmlType, GgufFile, TensorInfo};
use crate::weights::Weight;
use crate::{Error, Result};
use half::{bf16, f16};
use rmlx::quantization::{QuantMode, Quantized};
use rmlx::Array;

impl GgufFile {
    /// Converts a tensor (see [`crate::gguf`] for what each type becomes).
    /// [`Error::Config`] names the tensor and its type when the type is not supported.
    pub fn load(&self, info: &TensorInfo) -> Result<Weight> {
        let unsupported = || {
            Error::Config(format!(
                "{}: tensor `{}` has type {} ({}), which rmlx cannot convert",
                self.path.display(),
                info.name,
                info.ggml_type,
                info.ggml_type.id()
            ))
        };
        let Some((block_elems, block_bytes)) = info.ggml_type.block_layout() else { return Err(unsupported()) };
        let bytes = self.raw_bytes(info)?;
        let shape: Vec<i32> =
            info.shape.iter().map(|&d| i32::try_from(d)).collect::<std::result::Result<_, _>>().map_err(|_| {
                Error::Config(format!("tensor `{}`: dimension of {:?} exceeds i32", info.name, info.shape))
            })?;
        let n = info.numel();
        match info.ggml_type {
            GgmlType::F32 => return Ok(Weight::Dense(dense(bytes, &shape, f32::from_le_bytes)?)),
            GgmlType::F16 => return Ok(Weight::Dense(dense(bytes, &shape, f16::from_le_bytes)?)),
            GgmlType::BF16 => return Ok(Weight::Dense(dense(bytes, &shape, bf16::from_le_bytes)?)),
            GgmlType::Q4_K | GgmlType::Q5_K if !shape.is_empty() => {
                let bits = if info.ggml_type == GgmlType::Q4_K { 4 } else { 5 };
                let (words, scales, biases) = k_quant_to_affine(bytes, n, bits);
                return groups_of_32(&shape, (bits, QuantMode::Affine), &words, &scales, Some(&biases));
            }
            GgmlType::MXFP4 if !shape.is_empty() => {
                let (words, exponents) = to_mxfp4(bytes, n);
                return groups_of_32(&shape, (4, QuantMode::Mxfp4), &words, &exponents, None::<&[f32]>);
            }
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 if !shape.is_empty() => {
                if let Some(a) = to_affine(info.ggml_type, bytes, n) {
                    let mode = (a.bits, QuantMode::Affine);
                    return groups_of_32(&shape, mode, &a.weight, &a.scales, Some(&a.biases));
                }
            }
            _ => {}
        }
        let f = dequant::decoder(info.ggml_type).ok_or_else(unsupported)?;
        let values = dequant::dequantize(bytes, n, block_elems, block_bytes, f);
        Ok(Weight::Dense(Array::from_slice(&values, &shape)?))
    }
}

/// A quantised weight of (logical) `shape` in groups of 32 along its last axis: its packed `words`
/// (`bits` a value, in `mode`), one scale and (affine) one bias a group.
fn groups_of_32<S: rmlx::Element, B: rmlx::Element>(
    shape: &[i32],
    (bits, mode): (i32, QuantMode),
    words: &[u32],
    scales: &[S],
    biases: Option<&[B]>,
) -> Result<Weight> {
    let last = *shape.last().expect("a quantised tensor has an axis");
    let (mut ws, mut gs) = (shape.to_vec(), shape.to_vec());
    *ws.last_mut().expect("non-empty") = (last as i64 * bits as i64 / 32) as i32;
    *gs.last_mut().expect("non-empty") = last / 32;
    Ok(Weight::Quantized(Quantized {
        weight: Array::from_slice(words, &ws)?,
        scales: Array::from_slice(scales, &gs)?,
        biases: biases.map(|b| Array::from_slice(b, &gs)).transpose()?,
        group_size: 32,
        bits,
        mode,
    }))
}

/// A dense array from little-endian `F32`/`F16`/`BF16` data: straight from the map when aligned on a
/// little-endian host, else decoded element by element. `T` must be `f32`, `f16` or `bf16`.
fn dense<T: rmlx::Element, const N: usize>(bytes: &[u8], shape: &[i32], conv: fn([u8; N]) -> T) -> Result<Array> {
    debug_assert_eq!(std::mem::size_of::<T>(), N);
    if cfg!(target_endian = "little") && (bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) {
        // SAFETY: T is a plain float type of N bytes for which every bit pattern is valid, the
        // pointer is aligned, and the slice covers `bytes.len() / N` whole elements.
        let s = unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const T, bytes.len() / N) };
        return Ok(Array::from_slice(s, shape)?);
    }
    let v: Vec<T> = bytes.chunks_exact(N).map(|b| conv(b.try_into().expect("N bytes"))).collect();
    Ok(Array::from_slice(&v, shape)?)
}

/// A tensor repacked into MLX's affine layout with group size 32: `bits`-bit codes packed into
/// `uint32` (element `j` of a word at bits `[j·bits, (j+1)·bits)`), float16 scale and bias per group.
pub(super) struct Affine {
    pub bits: i32,
    pub weight: Vec<u32>,
    pub scales: Vec<f16>,
    pub biases: Vec<f16>,
}

/// `c · d` as float16 when exact; `None` when it overflows (or `d` is not finite).
fn f16_times(d: f16, c: f32) -> Option<f16> {
    let v = d.to_f32() * c;
    let h = f16::from_f32(v);
    (h.is_finite() && h.to_f32() == v).then_some(h)
}

/// One `Q4_0`/`Q4_1`/`Q8_0` block as 4 or 8 packed words, scale and bias (`None` on overflow).
fn affine_block(t: GgmlType, b: &[u8], words: &mut [u32]) -> Option<(f16, f16)> {
    let d = f16::from_bits(u16::from_le_bytes([b[0], b[1]]));
    let pack4 = |qs: &[u8], words: &mut [u32]| {
        // ggml: byte i holds element i (low nibble) and element i + 16 (high nibble).
        let mut q = [0u8; 32];
        for i in 0..16 {
            q[i] = qs[i] & 0x0F;
            q[i + 16] = qs[i] >> 4;
        }
        for (w, word) in words.iter_mut().enumerate() {
            *word = (0..8).fold(0u32, |acc, j| acc | (q[8 * w + j] as u32) << (4 * j));
        }
    };
    match t {
        GgmlType::Q4_0 => {
            pack4(&b[2..18], words);
            Some((d, f16_times(d, -8.0)?))
        }
        GgmlType::Q4_1 => {
            pack4(&b[4..20], words);
            Some((d, f16::from_bits(u16::from_le_bytes([b[2], b[3]]))))
        }
        GgmlType::Q8_0 => {
            // int8 q becomes the unsigned q + 128 (flipping the sign bit).
            for (w, word) in words.iter_mut().enumerate() {
                let q = &b[2 + 4 * w..6 + 4 * w];
                *word = u32::from_le_bytes([q[0] ^ 0x80, q[1] ^ 0x80, q[2] ^ 0x80, q[3] ^ 0x80]);
            }
            Some((d, f16_times(d, -128.0)?))
        }
        _ => None,
    }
}

/// A `Q4_K` (`bits` 4) or `Q5_K` (5) tensor of `n_elems` values as MLX's affine words, one
/// float32 scale `d·sc` and bias `−dmin·m` a group of 32. A super-block of 256 holds `d`, `dmin`,
/// twelve bytes of 6-bit sub-block scales and mins, (`Q5_K`) 32 bytes of fifth bits — bits `2k` and
/// `2k + 1` of byte `l` for value `l` of groups `2k` and `2k + 1` — then 128 bytes whose 32-byte run
/// `k` holds groups `2k` (low nibbles) and `2k + 1` (high nibbles). MLX reads a group's codes as
/// one little-endian stream of `bits`-bit fields over its words.
pub(super) fn k_quant_to_affine(data: &[u8], n_elems: usize, bits: i32) -> (Vec<u32>, Vec<f32>, Vec<f32>) {
    let (bits, block_bytes, high) = match bits {
        4 => (4usize, 144usize, 0usize),
        _ => (5, 176, 32),
    };
    let supers = n_elems / 256;
    let words_per_super = 8 * bits;
    let mut words = vec![0u32; supers * words_per_super];
    let (mut scales, mut biases) = (vec![0f32; supers * 8], vec![0f32; supers * 8]);
    let blocks = data.chunks_exact(block_bytes).zip(words.chunks_exact_mut(words_per_super));
    for (((b, w), sc), bi) in blocks.zip(scales.chunks_exact_mut(8)).zip(biases.chunks_exact_mut(8)) {
        let (d, dmin) = (dequant::f16_at(b, 0), dequant::f16_at(b, 2));
        let (packed, qh, qs) = (&b[4..16], &b[16..16 + high], &b[16 + high..block_bytes]);
        for group in 0..8 {
            let (s, m) = dequant::scale_min_k4(group, packed);
            (sc[group], bi[group]) = (d * s as f32, -(dmin * m as f32));
            let run = &qs[32 * (group / 2)..32 * (group / 2) + 32];
            let words = &mut w[bits * group..bits * (group + 1)];
            for (i, &byte) in run.iter().enumerate() {
                let nibble = if group % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                let fifth = if high > 0 { (qh[i] >> group) & 1 } else { 0 };
                let code = (nibble | fifth << 4) as u32;
                let at = bits * i;
                words[at / 32] |= code << (at % 32);
                if at % 32 + bits > 32 {
                    words[at / 32 + 1] |= code >> (32 - at % 32);
                }
            }
        }
    }
    (words, scales, biases)
}

/// An `MXFP4` tensor of `n_elems` values (blocks of 32: an e8m0 exponent, then 16 bytes whose low
/// nibbles are values 0–15 and high nibbles 16–31) as MLX's `mxfp4` words (value `i` of a block at
/// bits `4·(i mod 8)` of its word `i / 8`) and one exponent a block.
pub(super) fn to_mxfp4(data: &[u8], n_elems: usize) -> (Vec<u32>, Vec<u8>) {
    let blocks = n_elems / 32;
    let (mut words, mut exponents) = (vec![0u32; blocks * 4], vec![0u8; blocks]);
    for ((b, w), e) in data.chunks_exact(17).zip(words.chunks_exact_mut(4)).zip(&mut exponents) {
        *e = b[0];
        let code = |i: usize| if i < 16 { b[1 + i] & 0x0F } else { b[1 + i - 16] >> 4 };
        for (k, word) in w.iter_mut().enumerate() {
            *word = (0..8).fold(0u32, |acc, j| acc | (code(8 * k + j) as u32) << (4 * j));
        }
    }
    (words, exponents)
}

/// Repacks a `Q4_0`, `Q4_1` or `Q8_0` tensor into MLX's affine layout, losslessly: `None` when a
/// bias (`-8d`, `-128d`) does not fit in float16 (then the caller dequantises instead).
pub(super) fn to_affine(t: GgmlType, data: &[u8], n_elems: usize) -> Option<Affine> {
    let (bits, block_bytes) = match t {
        GgmlType::Q4_0 => (4usize, 18usize),
        GgmlType::Q4_1 => (4, 20),
        GgmlType::Q8_0 => (8, 34),
        _ => return None,
    };
    let n_blocks = n_elems / 32;
    let wpb = bits; // 32 elements · bits / 32 bits per word
    let mut a = Affine {
        bits: bits as i32,
        weight: vec![0; n_blocks * wpb],
        scales: vec![f16::ZERO; n_blocks],
        biases: vec![f16::ZERO; n_blocks],
    };
    if n_blocks == 0 {
        return Some(a);
    }
    let per = n_blocks.div_ceil(threads_for(n_blocks, 2048));
    let ok = std::thread::scope(|s| {
        let handles: Vec<_> = a
            .weight
            .chunks_mut(per * wpb)
            .zip(a.scales.chunks_mut(per))
            .zip(a.biases.chunks_mut(per))
            .zip(data.chunks(per * block_bytes))
            .map(|(((w, sc), bi), src)| {
                s.spawn(move || {
                    for (i, b) in src.chunks_exact(block_bytes).enumerate() {
                        let Some((scale, bias)) = affine_block(t, b, &mut w[i * wpb..(i + 1) * wpb]) else {
                            return false;
                        };
                        sc[i] = scale;
                        bi[i] = bias;
                    }
                    true
                })
            })
            .collect();
        handles.into_iter().all(|h| h.join().unwrap_or(false))
    });
    ok.then_some(a)
}
