//! A decoding step's attention over a quantised KV cache (`--kv-bits`) on MLX's CUDA backend, as
//! one launch that reads the packed keys and values where they lie: no unpacked copy of the cache
//! and none of MLX's quantised products (whose kernel for the values' product, not transposed,
//! takes several times what attention over a bfloat16 cache takes; see BENCHMARKS.md).
//!
//! Flash-decoding in two kernels of one node. The first takes a block per (group of query heads
//! sharing a KV head, sequence, chunk of [`CHUNK`] positions): a position's packed row is read by a
//! few threads, 8 bytes each (16 elements at 4 bits), which unpack their elements once for every
//! query head of the group; the scores go through the soft cap and the mask, then the chunk's
//! maximum, sum of exponentials and weighted values (float32) are written out. The second merges
//! a head's chunks (a sink logit per head joining the softmax there, gpt-oss's) into the output.
//! Scores and sums are float32 throughout (MLX's composition rounds the scores to the activations'
//! dtype first).

use super::cuda_fast::{cuda_type, kernel_cache, launch_once, on_cuda, Launches, CUDA_TYPES};
use super::training;
use crate::cache::{KvCache, Mask, Packed};
use rmlx::cuda::{self, CudaLaunch, InPlace, KernelArg, KernelNode};
use rmlx::{Array, Dtype, Result};
use std::sync::{LazyLock, Mutex};

/// Positions a block of the first kernel takes.
pub const CHUNK: i32 = 256;

/// Threads of a block.
const THREADS: u32 = 128;

/// The query heads' elements a block keeps, at most (its shared memory and registers grow with them).
const MAX_GROUP_ELEMENTS: i32 = 512;

/// The first kernel: block `(g, b, c)` for query heads `g·RB … g·RB + RB - 1` (KV head
/// `g / SPLIT`) of sequence `b`, over positions `[c·CHUNK, (c+1)·CHUNK)` of the `K` held.
/// Thread `t` reads the 8 bytes `e = t % TPP` of position row `s = t / TPP`, then of rows
/// `s + PPB`, `s + 2·PPB`, …
const CHUNK_SOURCE: &str = r#"
    constexpr int PER_WORD = 32 / BITS;
    constexpr int EPT = 2 * PER_WORD;       // elements a thread unpacks from its two words
    constexpr int TPP = D / EPT;            // threads a position's row
    constexpr int PPB = NT / TPP;           // positions the block takes at once
    constexpr int WPR = D / PER_WORD;       // words a row
    constexpr int GPR = D / G;              // groups a row
    constexpr int WARPS = NT / 32;
    constexpr unsigned LOW = (1u << BITS) - 1u;
    const float NEG = __int_as_float(0xff800000);
    const int g = blockIdx.x;
    const int b = blockIdx.y;
    const int c = blockIdx.z;
    const int hk = g / SPLIT;
    const int hq0 = g * RB;
    const int t = threadIdx.x;
    const int lane = t & 31;
    const int warp = t >> 5;
    const int e = t % TPP;
    const int s = t / TPP;
    const int d0 = e * EPT;
    const int group = d0 / G;
    __shared__ float qs[RB][D];
    __shared__ float score[RB][CHUNK];
    __shared__ float red[WARPS][RB][D];
    __shared__ float top[RB];
    __shared__ float total[RB];
    for (int i = t; i < RB * D; i += NT) {
        const int r = i / D;
        qs[r][i % D] = static_cast<float>(q[(static_cast<long long>(b) * HQ + hq0 + r) * D + i % D]) * scale;
    }
    __syncthreads();
    const int first = c * CHUNK;
    if (first >= valid) {
        return;
    }
    const int n = min(CHUNK, valid - first);
    const long long rows = (static_cast<long long>(b) * HKV + hk) * stride + first;
    // Scores: each thread's dot products over its elements, summed over the row's TPP threads.
    {
        float qr[RB][EPT];
        float qsum[RB];
#pragma unroll
        for (int r = 0; r < RB; ++r) {
            qsum[r] = 0.0f;
#pragma unroll
            for (int i = 0; i < EPT; ++i) {
                qr[r][i] = qs[r][d0 + i];
                qsum[r] += qr[r][i];
            }
        }
        // Every lane of a warp runs each round (the sums over a row shuffle across lanes).
        for (int j0 = 0; j0 < n; j0 += PPB) {
            const int j = j0 + s;
            const bool held = j < n;
            const long long row = rows + (held ? j : 0);
            const uint2 w = held ? *reinterpret_cast<const uint2*>(kw + row * WPR + e * 2) : make_uint2(0u, 0u);
            const float sc = held ? static_cast<float>(ks[row * GPR + group]) : 0.0f;
            const float bi = held ? static_cast<float>(kb[row * GPR + group]) : 0.0f;
            float dot[RB];
#pragma unroll
            for (int r = 0; r < RB; ++r) {
                dot[r] = 0.0f;
            }
#pragma unroll
            for (int i = 0; i < EPT; ++i) {
                const unsigned word = i < PER_WORD ? w.x : w.y;
                const float x = static_cast<float>((word >> ((i % PER_WORD) * BITS)) & LOW);
#pragma unroll
                for (int r = 0; r < RB; ++r) {
                    dot[r] = fmaf(qr[r][i], x, dot[r]);
                }
            }
            bool visible = held;
            if constexpr (MASKED) {
                visible = held && mask[static_cast<long long>(MASK_ROWS == 1 ? 0 : b) * stride + first + j];
            }
#pragma unroll
            for (int r = 0; r < RB; ++r) {
                float x = sc * dot[r] + bi * qsum[r];
#pragma unroll
                for (int o = TPP / 2; o > 0; o >>= 1) {
                    x += __shfl_xor_sync(0xffffffffu, x, o);
                }
                if constexpr (SOFTCAP) {
                    x = softcap * tanhf(x / softcap);
                }
                if (held && e == 0) {
                    score[r][j] = visible ? x : NEG;
                }
            }
        }
    }
    __syncthreads();
    // Each head's maximum and sum of exponentials over the chunk: a warp a head.
    for (int r = warp; r < RB; r += WARPS) {
        float m = NEG;
        for (int j = lane; j < n; j += 32) {
            m = fmaxf(m, score[r][j]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        }
        float l = 0.0f;
        for (int j = lane; j < n; j += 32) {
            const float p = m == NEG ? 0.0f : expf(score[r][j] - m);
            score[r][j] = p;
            l += p;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            l += __shfl_xor_sync(0xffffffffu, l, o);
        }
        if (lane == 0) {
            top[r] = m;
            total[r] = l;
        }
    }
    __syncthreads();
    // The weighted values: each thread over its elements of its positions, then summed over the
    // positions of a warp (lanes TPP apart) and over the warps.
    float acc[RB][EPT];
#pragma unroll
    for (int r = 0; r < RB; ++r) {
#pragma unroll
        for (int i = 0; i < EPT; ++i) {
            acc[r][i] = 0.0f;
        }
    }
    for (int j = s; j < n; j += PPB) {
        const long long row = rows + j;
        const uint2 w = *reinterpret_cast<const uint2*>(vw + row * WPR + e * 2);
        const float sc = static_cast<float>(vs[row * GPR + group]);
        const float bi = static_cast<float>(vb[row * GPR + group]);
        float p[RB];
#pragma unroll
        for (int r = 0; r < RB; ++r) {
            p[r] = score[r][j];
        }
#pragma unroll
        for (int i = 0; i < EPT; ++i) {
            const unsigned word = i < PER_WORD ? w.x : w.y;
            const float x = fmaf(sc, static_cast<float>((word >> ((i % PER_WORD) * BITS)) & LOW), bi);
#pragma unroll
            for (int r = 0; r < RB; ++r) {
                acc[r][i] = fmaf(p[r], x, acc[r][i]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RB; ++r) {
#pragma unroll
        for (int i = 0; i < EPT; ++i) {
#pragma unroll
            for (int o = TPP; o < 32; o <<= 1) {
                acc[r][i] += __shfl_xor_sync(0xffffffffu, acc[r][i], o);
            }
        }
    }
    if (lane < TPP) {
#pragma unroll
        for (int r = 0; r < RB; ++r) {
#pragma unroll
            for (int i = 0; i < EPT; ++i) {
                red[warp][r][d0 + i] = acc[r][i];
            }
        }
    }
    __syncthreads();
    for (int i = t; i < RB * D; i += NT) {
        const int r = i / D;
        const int d = i % D;
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            o += red[w][r][d];
        }
        float* out = partial + ((static_cast<long long>(b) * HQ + hq0 + r) * chunks + c) * (D + 2);
        out[2 + d] = o;
        if (d == 0) {
            out[0] = top[r];
            out[1] = total[r];
        }
    }
"#;

/// Before the others where the launch writes the step's position: block `(h, b, kv)` packs the new
/// key (`kv` 0) or value (1) row of KV head `h` of sequence `b` into the buffers at `position`, as
/// MLX's affine quantize packs (a warp a group: its minimum and maximum, the scale and bias from
/// the end of larger magnitude so that it is exact, each element rounded to the nearest level).
const WRITE_SOURCE: &str = r#"
    constexpr int VPT = G / 32;             // elements a thread
    constexpr int PER_WORD = 32 / BITS;
    constexpr int WPR = D / PER_WORD;
    constexpr int GPR = D / G;
    constexpr float LEVELS = static_cast<float>((1 << BITS) - 1);
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const bool value = blockIdx.z == 1;
    const int t = threadIdx.x;
    const int group = t / 32;
    const int lane = t & 31;
    const long long head = static_cast<long long>(b) * HKV + h;
    const T* src = (value ? v : k) + head * D + group * G + lane * VPT;
    const long long row = head * stride + position;
    __shared__ unsigned char level[D];
    float x[VPT];
    float lo = 3.402823466e38f;
    float hi = 0.0f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        x[i] = static_cast<float>(src[i]);
        lo = fminf(lo, x[i]);
        hi = fmaxf(hi, x[i]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
        hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    }
    float sc = fmaxf((hi - lo) / LEVELS, 1e-7f);
    const bool low_end = fabsf(lo) > fabsf(hi);
    sc = low_end ? sc : -sc;
    const float edge = low_end ? lo : hi;
    const float q0 = roundf(edge / sc);
    const bool at_zero = q0 == 0.0f;
    sc = at_zero ? sc : edge / q0;
    const float bi = at_zero ? 0.0f : edge;
    if (lane == 0) {
        (value ? vs : ks)[row * GPR + group] = static_cast<T>(sc);
        (value ? vb : kb)[row * GPR + group] = static_cast<T>(bi);
    }
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
        const float l = fminf(fmaxf(roundf((x[i] - bi) / sc), 0.0f), LEVELS);
        level[group * G + lane * VPT + i] = static_cast<unsigned char>(l);
    }
    __syncthreads();
    for (int w = t; w < WPR; w += blockDim.x) {
        unsigned word = 0u;
#pragma unroll
        for (int j = 0; j < PER_WORD; ++j) {
            word |= static_cast<unsigned>(level[w * PER_WORD + j]) << (j * BITS);
        }
        (value ? vw : kw)[row * WPR + w] = word;
    }
"#;

/// The second kernel: block `(hq, b)` merges the chunks of query head `hq` of sequence `b`.
const MERGE_SOURCE: &str = r#"
    const float NEG = __int_as_float(0xff800000);
    const int hq = blockIdx.x;
    const int b = blockIdx.y;
    const int t = threadIdx.x;
    const float* part = partial + (static_cast<long long>(b) * HQ + hq) * chunks * (D + 2);
    const int used = (valid + CHUNK - 1) / CHUNK;
    float m = SINKS ? sinks[hq] : NEG;
    for (int c = 0; c < used; ++c) {
        m = fmaxf(m, part[c * (D + 2)]);
    }
    float l = SINKS ? expf(sinks[hq] - m) : 0.0f;
    for (int c = 0; c < used; ++c) {
        const float cm = part[c * (D + 2)];
        if (cm != NEG) {
            l += part[c * (D + 2) + 1] * expf(cm - m);
        }
    }
    for (int d = t; d < D; d += NT) {
        float o = 0.0f;
        for (int c = 0; c < used; ++c) {
            const float cm = part[c * (D + 2)];
            if (cm != NEG) {
                o = fmaf(part[c * (D + 2) + 2 + d], expf(cm - m), o);
            }
        }
        out[(static_cast<long long>(b) * HQ + hq) * D + d] = static_cast<T>(l > 0.0f ? o / l : 0.0f);
    }
"#;

/// What an instance is specialised for (the position written is a parameter of each call, not
/// of the compiled kernels).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Shape {
    dtype: Dtype,
    batch: i32,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    bits: i32,
    group_size: i32,
    /// Positions the buffers hold (all attended, unless the launch writes one: then those
    /// before it and it).
    positions: i32,
    /// Rows of the mask (0: none; 1: one for every sequence; else one a sequence).
    mask_rows: i32,
    sinks: bool,
    softcap: bool,
    /// The launch packs the step's key and value rows into the buffers first.
    write: bool,
}

impl Shape {
    /// Query heads a block takes: the most of a KV head's group that divide it and fit
    /// [`MAX_GROUP_ELEMENTS`] and 64 accumulators a thread.
    fn block_heads(&self) -> i32 {
        let group = self.heads / self.kv_heads;
        let elements = 64 / self.bits;
        let most = (MAX_GROUP_ELEMENTS / self.head_dim).min(64 / elements).max(1);
        (1..=most.min(group)).rev().find(|r| group % r == 0).unwrap_or(1)
    }

    fn chunks(&self) -> i32 {
        (self.positions + CHUNK - 1) / CHUNK
    }
}

/// `softmax(q kᵀ · scale [capped], masked [with sinks]) v` for one query a sequence
/// (`q: [B, Hq, 1, D]`) over packed `keys, values` (`[B, Hkv, K, ·]`, as
/// [`crate::cache::quantized_attention`] takes them): `None` where it does not serve (not MLX's
/// CUDA backend, training or a transform, 3, 5 or 6 bits, head sizes whose rows do not split into
/// 8-byte pieces a power of two of threads, masks of other shapes, queries whose dtype is not the
/// scales'): the caller composes it.
pub fn packed_decode_attention(
    q: &Array,
    keys: &Packed,
    values: &Packed,
    scale: f32,
    mask: &Mask,
    softcap: Option<f32>,
    sinks: Option<&Array>,
) -> Result<Option<Array>> {
    let Some(shape) = serves(q, keys, values, mask, softcap, sinks, None) else {
        return Ok(None);
    };
    let mask = match mask {
        Mask::Array(m) if shape.mask_rows > 0 => m.reshape(&[shape.mask_rows, shape.positions])?,
        _ => Array::scalar(false),
    };
    let mut inputs = vec![q.clone()];
    for p in [keys, values] {
        inputs.extend(p.arrays().into_iter().cloned());
    }
    inputs.extend([mask, sink_logits(sinks)?]);
    let out = launch(&shape)?.call_with(&inputs, &call_values(0, scale, softcap))?;
    Ok(Some(out[0].clone()))
}

/// A decoding step over a quantised unbounded cache as one launch: the step's key and value rows
/// (`k, v: [B, Hkv, 1, D]`) packed into the cache's buffers at its offset (in place; grown by
/// whole steps first), then [`packed_decode_attention`] over the positions held. `None` (the
/// cache as it was, but for buffers grown) where the launch does not serve: other caches, a
/// window, shapes the kernels do not take.
pub fn quantized_cache_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    cache: &mut KvCache,
    scale: f32,
    softcap: Option<f32>,
    sinks: Option<&Array>,
) -> crate::Result<Option<Array>> {
    let KvCache::Quantized(cache) = cache else { return Ok(None) };
    let (&[b, hkv, 1, d], dtype) = (k.shape(), k.dtype()) else { return Ok(None) };
    if !on_cuda() || v.shape() != k.shape() || v.dtype() != dtype || k.is_tracer() || v.is_tracer() {
        return Ok(None);
    }
    let Some((keys, values)) = cache.lend_for_one([b, hkv, 1, d], dtype)? else { return Ok(None) };
    let position = cache.offset as i32;
    let Some(shape) = serves(q, &keys, &values, &Mask::None, softcap, sinks, Some(position)) else {
        cache.give_back(keys, values, 0);
        return Ok(None);
    };
    let mut inputs = vec![q.clone()];
    for p in [&keys, &values] {
        inputs.extend(p.arrays().into_iter().cloned());
    }
    inputs.extend([Array::scalar(false), sink_logits(sinks)?, k.clone(), v.clone()]);
    let called = launch(&shape).and_then(|l| l.call_with(&inputs, &call_values(position, scale, softcap)));
    let mut out = match called {
        Ok(out) => out,
        Err(e) => {
            cache.give_back(keys, values, 0);
            return Err(e.into());
        }
    };
    let attention = out[0].clone();
    let mut written = out.drain(2..);
    let mut next = |p: &Packed| Packed {
        words: written.next().expect("six buffers"),
        scales: written.next().expect("six buffers"),
        biases: written.next().expect("six buffers"),
        quantization: p.quantization,
    };
    let (keys, values) = (next(&keys), next(&values));
    cache.give_back(keys, values, 1);
    Ok(Some(attention))
}

/// Each head's sink logit in float32 (any array where there are none: the kernels do not read it).
fn sink_logits(sinks: Option<&Array>) -> Result<Array> {
    match sinks {
        Some(s) => s.astype(Dtype::Float32),
        None => Ok(Array::scalar(0.0f32)),
    }
}

/// A call's values: the position written, the scores' multiplier and soft cap, and the positions
/// attended where the launch writes (the position's and those before it).
fn call_values(position: i32, scale: f32, softcap: Option<f32>) -> [KernelArg; 4] {
    use KernelArg::{F32, I32};
    [I32(position), F32(scale), F32(softcap.unwrap_or(1.0)), I32(position + 1)]
}

/// The instance for these arrays, where the kernels serve them (`write`: the position a launch
/// writes the step's rows at, below the buffers' positions).
fn serves(
    q: &Array,
    keys: &Packed,
    values: &Packed,
    mask: &Mask,
    softcap: Option<f32>,
    sinks: Option<&Array>,
    write: Option<i32>,
) -> Option<Shape> {
    if !on_cuda() || training() || q.is_tracer() {
        return None;
    }
    let (&[batch, heads, 1, head_dim], dtype) = (q.shape(), q.dtype()) else { return None };
    let quantization = keys.quantization;
    let (bits, group_size) = (quantization.bits, quantization.group_size);
    let words = keys.words.shape();
    let (kv_heads, positions) = (*words.get(1)?, *words.get(2)?);
    let fits = matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        && matches!(bits, 2 | 4 | 8)
        && matches!(group_size, 32 | 64 | 128)
        && values.quantization == quantization
        && kv_heads > 0
        && heads % kv_heads == 0
        && positions > 0
        && write.is_none_or(|p| (0..positions).contains(&p))
        && head_dim % group_size == 0
        // A thread's two words: whole within one group, a power of two of them a row.
        && group_size % (64 / bits) == 0
        && head_dim % (64 / bits) == 0
        && matches!(head_dim / (64 / bits), 1 | 2 | 4 | 8 | 16 | 32)
        && words == [batch, kv_heads, positions, head_dim * bits / 32]
        && values.words.shape() == words
        && [&keys.scales, &keys.biases, &values.scales, &values.biases]
            .iter()
            .all(|a| a.shape() == [batch, kv_heads, positions, head_dim / group_size] && a.dtype() == dtype)
        && keys.words.dtype() == Dtype::Uint32
        && values.words.dtype() == Dtype::Uint32
        && sinks.is_none_or(|s| s.shape() == [heads] && !s.is_tracer())
        && softcap.is_none_or(|c| c.is_finite() && c > 0.0);
    if !fits {
        return None;
    }
    let mask_rows = match mask {
        Mask::None | Mask::Causal => 0,
        Mask::Array(_) if write.is_some() => return None,
        Mask::Array(m) => {
            let s = m.shape();
            let (&last, lead) = s.split_last()?;
            let rows: i32 = lead.iter().product();
            // `[K]`, `[1, K]`, `[B, 1, 1, K]`: one row for all, or one a sequence.
            let one_query = lead.len() < 2 || lead[lead.len() - 2..].iter().all(|&d| d == 1);
            if m.dtype() != Dtype::Bool || last != positions || !one_query || !(rows == 1 || rows == batch) {
                return None;
            }
            rows.max(1)
        }
    };
    Some(Shape {
        dtype,
        batch,
        heads,
        kv_heads,
        head_dim,
        bits,
        group_size,
        positions,
        mask_rows,
        sinks: sinks.is_some(),
        softcap: softcap.is_some(),
        write: write.is_some(),
    })
}

/// The launch for `s`, made once per process.
fn launch(s: &Shape) -> Result<std::sync::Arc<CudaLaunch>> {
    static LAUNCHES: Launches<Shape> = LazyLock::new(Mutex::default);
    launch_once(&LAUNCHES, "rmlx_packed_attention", s, || make(s))
}

/// The launch over `[q, key words, scales, biases, value words, scales, biases, mask, sinks]`
/// (and, where it writes, the step's `k, v`) with the call's values (position, scale, soft cap)
/// for `s`: outputs the attention `[B, Hq, 1, D]`, the chunks' partial results and, where it
/// writes, the six buffers updated in place.
fn make(s: &Shape) -> Result<CudaLaunch> {
    let block_heads = s.block_heads();
    let split = s.heads / s.kv_heads / block_heads;
    let chunks = s.chunks();
    let head = format!(
        "{CUDA_TYPES}typedef {} T;\nconstexpr int D = {};\nconstexpr int HQ = {};\nconstexpr int HKV = {};\n\
         constexpr int BITS = {};\nconstexpr int G = {};\nconstexpr int RB = {block_heads};\n\
         constexpr int SPLIT = {split};\nconstexpr int CHUNK = {CHUNK};\nconstexpr int NT = {THREADS};\n\
         constexpr bool MASKED = {};\nconstexpr int MASK_ROWS = {};\nconstexpr bool SOFTCAP = {};\n\
         constexpr bool SINKS = {};\n",
        cuda_type(s.dtype),
        s.head_dim,
        s.heads,
        s.kv_heads,
        s.bits,
        s.group_size,
        s.mask_rows > 0,
        s.mask_rows,
        s.softcap,
        s.sinks,
    );
    let buffers = "unsigned* kw, T* ks, T* kb, unsigned* vw, T* vs, T* vb";
    let chunk_source = format!(
        "{head}extern \"C\" __global__ void __launch_bounds__({THREADS}) rmlx_packed_attention_chunks(\
         const T* q, {buffers}, const bool* mask, float* partial, int stride, int valid, int chunks, \
         float scale, float softcap) {{\n{CHUNK_SOURCE}}}\n"
    );
    let merge_source = format!(
        "{head}extern \"C\" __global__ void __launch_bounds__({THREADS}) rmlx_packed_attention_merge(\
         const float* partial, const float* sinks, T* out, int chunks, int valid) {{\n{MERGE_SOURCE}}}\n"
    );
    let cache = kernel_cache();
    let chunk_fn = cuda::compile("rmlx_packed_attention_chunks", &chunk_source, Some(&cache))?;
    let merge_fn = cuda::compile("rmlx_packed_attention_merge", &merge_source, Some(&cache))?;
    use KernelArg::{Input, Output, Value, I32};
    // The buffers: the inputs, or where the launch writes, the outputs over them.
    let held: Vec<KernelArg> = match s.write {
        false => (1..=6).map(Input).collect(),
        true => (2..=7).map(Output).collect(),
    };
    // Where the launch writes, the positions attended are those before the call's position and it.
    let (position, valid) = (Value(0), if s.write { Value(3) } else { I32(s.positions) });
    let mut nodes = Vec::new();
    if s.write {
        let write_source = format!(
            "{head}extern \"C\" __global__ void __launch_bounds__(256) rmlx_packed_attention_write(\
             const T* k, const T* v, {buffers}, int stride, int position) {{\n{WRITE_SOURCE}}}\n"
        );
        let function = cuda::compile("rmlx_packed_attention_write", &write_source, Some(&cache))?;
        let mut args = vec![Input(9), Input(10)];
        args.extend(held.iter().copied());
        args.extend([I32(s.positions), position]);
        let threads = (s.head_dim / s.group_size * 32) as u32;
        nodes.push(KernelNode {
            function,
            grid: [s.kv_heads as u32, s.batch as u32, 2],
            block: [threads, 1, 1],
            shared_bytes: 0,
            args,
        });
    }
    let mut args = vec![Input(0)];
    args.extend(held.iter().copied());
    args.extend([Input(7), Output(1), I32(s.positions), valid, I32(chunks), Value(1), Value(2)]);
    nodes.push(KernelNode {
        function: chunk_fn,
        grid: [(s.kv_heads * split) as u32, s.batch as u32, chunks as u32],
        block: [THREADS, 1, 1],
        shared_bytes: 0,
        args,
    });
    nodes.push(KernelNode {
        function: merge_fn,
        grid: [s.heads as u32, s.batch as u32, 1],
        block: [THREADS, 1, 1],
        shared_bytes: 0,
        args: vec![Output(1), Input(8), Output(0), I32(chunks), valid],
    });
    let partials = s.batch * s.heads * chunks * (s.head_dim + 2);
    let mut outputs = vec![(vec![s.batch, s.heads, 1, s.head_dim], s.dtype), (vec![partials], Dtype::Float32)];
    if !s.write {
        return CudaLaunch::new("rmlx_packed_attention", &nodes, &outputs);
    }
    let (words, groups) = (s.head_dim * s.bits / 32, s.head_dim / s.group_size);
    for _ in 0..2 {
        outputs.push((vec![s.batch, s.kv_heads, s.positions, words], Dtype::Uint32));
        outputs.push((vec![s.batch, s.kv_heads, s.positions, groups], s.dtype));
        outputs.push((vec![s.batch, s.kv_heads, s.positions, groups], s.dtype));
    }
    let in_place: Vec<(u32, u32)> = (0..6).map(|i| (2 + i, 1 + i)).collect();
    CudaLaunch::updating("rmlx_packed_attention", &nodes, &outputs, &in_place, InPlace::Owned)
}
