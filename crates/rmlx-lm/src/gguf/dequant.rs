//! CPU decoding of ggml's block formats, following the reference `dequantize_row_*` functions of
//! ggml-quants.c term for term (same products in the same order, so the float32 results match
//! ggml's). The lossless repacking of some types into MLX's layout is `to_mlx.rs`.
//!
//! Blocks never straddle rows (a row's length is a multiple of the block size), so every function
//! here works on a flat run of blocks and splits it between threads at block boundaries.

use super::GgmlType;
use half::f16;

/// Elements per super-block of the k-quants.
const QK_K: usize = 256;

/// Decodes one block (`block_bytes` bytes) into its `block_elems` float32 values.
pub(super) type BlockFn = fn(&[u8], &mut [f32]);

/// The non-uniform 4-bit code book of `IQ4_NL` and `IQ4_XS` (`kvalues_iq4nl`).
const KVALUES_IQ4NL: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];
/// Doubled e2m1 values of `MXFP4` (`kvalues_mxfp4`).
const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

pub(super) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// The block decoder of a type that is dequantised on the CPU (not the plain float types).
pub(super) fn decoder(t: GgmlType) -> Option<BlockFn> {
    use GgmlType::*;
    Some(match t {
        Q4_0 => q4_0,
        Q4_1 => q4_1,
        Q5_0 => q5_0,
        Q5_1 => q5_1,
        Q8_0 => q8_0,
        Q8_1 => q8_1,
        Q2_K => q2_k,
        Q3_K => q3_k,
        Q4_K => q4_k,
        Q5_K => q5_k,
        Q6_K => q6_k,
        Q8_K => q8_k,
        IQ4_NL => iq4_nl,
        IQ4_XS => iq4_xs,
        MXFP4 => mxfp4,
        I8 => |b, y| y[0] = b[0] as i8 as f32,
        I16 => |b, y| y[0] = i16::from_le_bytes([b[0], b[1]]) as f32,
        I32 => |b, y| y[0] = u32_at(b, 0) as i32 as f32,
        I64 => |b, y| y[0] = i64::from_le_bytes(b[..8].try_into().unwrap()) as f32,
        F64 => |b, y| y[0] = f64::from_le_bytes(b[..8].try_into().unwrap()) as f32,
        _ => return None,
    })
}

fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0F) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0F) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32_at(b, 2);
    let qs = &b[6..22];
    for j in 0..16 {
        let xh0 = (((qh >> j) << 4) & 0x10) as u8;
        let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
        y[j] = (((qs[j] & 0x0F) | xh0) as i32 - 16) as f32 * d;
        y[j + 16] = (((qs[j] >> 4) | xh1) as i32 - 16) as f32 * d;
    }
}

fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32_at(b, 4);
    let qs = &b[8..24];
    for j in 0..16 {
        let xh0 = (((qh >> j) << 4) & 0x10) as u8;
        let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
        y[j] = ((qs[j] & 0x0F) | xh0) as f32 * d + m;
        y[j + 16] = ((qs[j] >> 4) | xh1) as f32 * d + m;
    }
}

fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = b[2 + j] as i8 as f32 * d;
    }
}

/// `Q8_1` as ggml lays it out (`d`, `s = d·Σq` as float16, 32 int8): the value is `d·q`.
fn q8_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..32 {
        y[j] = b[4 + j] as i8 as f32 * d;
    }
}

fn q2_k(b: &[u8], y: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, min) = (f16_at(b, 80), f16_at(b, 82));
    let (mut is, mut o) = (0, 0);
    for n in 0..QK_K / 128 {
        let q = &qs[n * 32..n * 32 + 32];
        for shift in [0, 2, 4, 6] {
            for half in 0..2 {
                let sc = scales[is];
                is += 1;
                let (dl, ml) = (d * (sc & 0x0F) as f32, min * (sc >> 4) as f32);
                for l in 0..16 {
                    y[o] = dl * ((q[l + 16 * half] >> shift) & 3) as f32 - ml;
                    o += 1;
                }
            }
        }
    }
}

fn q3_k(b: &[u8], y: &mut [f32]) {
    let (hm, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
    let d_all = f16_at(b, 108);
    let mut aux = [u32_at(sc, 0), u32_at(sc, 4), u32_at(sc, 8), 0];
    let (kmask1, kmask2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
    let tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
    aux[0] = (aux[0] & kmask2) | ((tmp & kmask1) << 4);
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
    let mut scales = [0i8; 16];
    for (i, w) in aux.iter().enumerate() {
        for (k, byte) in w.to_le_bytes().iter().enumerate() {
            scales[4 * i + k] = *byte as i8;
        }
    }
    let (mut is, mut o, mut m) = (0, 0, 1u8);
    for n in 0..QK_K / 128 {
        let q = &qs[n * 32..n * 32 + 32];
        for shift in [0, 2, 4, 6] {
            for half in 0..2 {
                let dl = d_all * (scales[is] as i32 - 32) as f32;
                is += 1;
                for l in 0..16 {
                    let k = l + 16 * half;
                    let low = ((q[k] >> shift) & 3) as i8;
                    let v = low - if hm[k] & m != 0 { 0 } else { 4 };
                    y[o] = dl * v as f32;
                    o += 1;
                }
            }
            m <<= 1;
        }
    }
}

/// `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` of a `Q4_K`/`Q5_K` super-block.
pub(super) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for (n, j) in (0..QK_K).step_by(64).enumerate() {
        let q = &qs[n * 32..n * 32 + 32];
        let (sc1, m1) = scale_min_k4(2 * n, scales);
        let (sc2, m2) = scale_min_k4(2 * n + 1, scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        for l in 0..32 {
            y[j + l] = d1 * (q[l] & 0x0F) as f32 - m1;
            y[j + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, min) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    let (mut u1, mut u2) = (1u8, 2u8);
    for (n, j) in (0..QK_K).step_by(64).enumerate() {
        let ql = &qs[n * 32..n * 32 + 32];
        let (sc1, m1) = scale_min_k4(2 * n, scales);
        let (sc2, m2) = scale_min_k4(2 * n + 1, scales);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[j + l] = d1 * ((ql[l] & 0x0F) + h1) as f32 - m1;
            y[j + 32 + l] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
        }
        u1 <<= 2;
        u2 <<= 2;
    }
}

fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for n in 0..QK_K / 128 {
        let ql = &b[n * 64..n * 64 + 64];
        let qh = &b[128 + n * 32..128 + n * 32 + 32];
        let sc = &b[192 + n * 8..192 + n * 8 + 8];
        let y = &mut y[n * 128..n * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i8 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
            y[l] = d * sc[is] as i8 as f32 * q1 as f32;
            y[l + 32] = d * sc[is + 2] as i8 as f32 * q2 as f32;
            y[l + 64] = d * sc[is + 4] as i8 as f32 * q3 as f32;
            y[l + 96] = d * sc[is + 6] as i8 as f32 * q4 as f32;
        }
    }
}

fn q8_k(b: &[u8], y: &mut [f32]) {
    let d = f32::from_bits(u32_at(b, 0));
    for j in 0..QK_K {
        y[j] = d * b[4 + j] as i8 as f32;
    }
}

fn iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = d * KVALUES_IQ4NL[(qs[j] & 0x0F) as usize] as f32;
        y[j + 16] = d * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
    }
}

fn iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let scales_h = u16::from_le_bytes([b[2], b[3]]) as u32;
    let (scales_l, qs) = (&b[4..8], &b[8..136]);
    for ib in 0..QK_K / 32 {
        let ls = ((scales_l[ib / 2] as u32 >> (4 * (ib % 2))) & 0x0F) | (((scales_h >> (2 * ib)) & 3) << 4);
        let dl = d * (ls as i32 - 32) as f32;
        let q = &qs[16 * ib..16 * ib + 16];
        for j in 0..16 {
            y[32 * ib + j] = dl * KVALUES_IQ4NL[(q[j] & 0x0F) as usize] as f32;
            y[32 * ib + j + 16] = dl * KVALUES_IQ4NL[(q[j] >> 4) as usize] as f32;
        }
    }
}

/// `ggml_e8m0_to_fp32_half`: `2^(e - 128)` (half the E8M0 scale), subnormal for `e < 2`.
fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { (e as u32 - 1) << 23 };
    f32::from_bits(bits)
}

fn mxfp4(b: &[u8], y: &mut [f32]) {
    let d = e8m0_half(b[0]);
    let qs = &b[1..17];
    for j in 0..16 {
        y[j] = KVALUES_MXFP4[(qs[j] & 0x0F) as usize] as f32 * d;
        y[j + 16] = KVALUES_MXFP4[(qs[j] >> 4) as usize] as f32 * d;
    }
}

/// Number of threads for `n_units` of work, at least `min_per_thread` units each.
pub(super) fn threads_for(n_units: usize, min_per_thread: usize) -> usize {
    let hw = std::thread::available_parallelism().map_or(1, |n| n.get());
    hw.min(n_units / min_per_thread.max(1)).max(1)
}

/// Decodes `data` (whole blocks, `n_elems` values) to float32, in parallel over runs of blocks.
pub(super) fn dequantize(data: &[u8], n_elems: usize, block_elems: usize, block_bytes: usize, f: BlockFn) -> Vec<f32> {
    let n_blocks = n_elems / block_elems;
    let mut out = vec![0f32; n_elems];
    if n_blocks == 0 {
        return out;
    }
    let per = n_blocks.div_ceil(threads_for(n_blocks, (1 << 16) / block_elems));
    let run = |y: &mut [f32], src: &[u8]| {
        for (o, b) in y.chunks_exact_mut(block_elems).zip(src.chunks_exact(block_bytes)) {
            f(b, o);
        }
    };
    std::thread::scope(|s| {
        for (y, src) in out.chunks_mut(per * block_elems).zip(data.chunks(per * block_bytes)) {
            s.spawn(move || run(y, src));
        }
    });
    out
}
