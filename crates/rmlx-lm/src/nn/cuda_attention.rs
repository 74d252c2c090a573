//! A decoding step's attention over an unbounded KV cache as one kernel, one node of MLX's graph:
//! the step's heads made from the stacked q/k/v product (normalised and rotated), the new keys
//! and values written into the cache's buffers in place, and one query a sequence attending over
//! the positions written so far.
//!
//! The composed step takes a split, two norms and two rotations, two slice updates, two slices of
//! the buffers and MLX's attention (ten nodes or more with their copies); a decoding step of a
//! small model is bound by the host work MLX does per node, and every kernel of a step costs the
//! GPU a launch's gap. Here flash-decoding in one kernel: one block per (query head, sequence,
//! chunk of 32 or more positions) scores its chunk, keeps the chunk's maximum, sum of exponentials
//! and weighted values (float32), and the last block of a head to finish merges the chunks. The
//! block holding the new position makes the new key and value itself and one block per KV head
//! writes them into the cache, so nothing waits for the write.

use super::cuda_fast::{cuda_type, kernel_cache, launch_once, on_cuda, HeadNorms, Launches, Rotation, CUDA_TYPES};
use super::training;
use crate::cache::{KvCache, Offset, Ring, RotatingCache, StandardCache};
use rmlx::cuda::{self, CudaLaunch, InPlace, KernelArg, KernelNode, OVERLAP};
use rmlx::{ops, Array, Dtype, Result};
use std::sync::{Arc, LazyLock, Mutex};

/// The largest cache the kernels take, in positions (a block's chunk, and the scores it keeps in
/// shared memory, grow with the cache: 8,192 positions, 32 KB, at this size).
pub const MAX_CAPACITY: usize = 1 << 20;

/// Threads of a block.
const THREADS: u32 = 128;

/// Head `row` normalised (with `NORM`: weight `w`, epsilon `eps`) and rotated by `angle` over the
/// divisors into `dst`, as `cuda_fast::qkv_heads` makes a head: thread i < D/2 of the block takes
/// the pair (i, i + D/2). Every thread of the block calls it (it synchronises).
const ROTATED: &str = r#"
__device__ __forceinline__ void rmlx_rotated(const T* row, const T* w, T* dst, float* red, const float* divisors,
                                             float angle, float eps) {
    constexpr int HALF = D / 2;
    const int t = threadIdx.x;
    const bool active = t < HALF;
    float x0 = active ? static_cast<float>(row[t]) : 0.0f;
    float x1 = active ? static_cast<float>(row[t + HALF]) : 0.0f;
    if constexpr (NORM) {
        float ss = x0 * x0 + x1 * x1;
        for (int o = 16; o > 0; o >>= 1) {
            ss += __shfl_xor_sync(0xffffffff, ss, o);
        }
        if ((t & 31) == 0) {
            red[t >> 5] = ss;
        }
        __syncthreads();
        float total = 0.0f;
        for (int i = 0; i < (HALF + 31) / 32; ++i) {
            total += red[i];
        }
        __syncthreads();
        const float r = rsqrtf(total / D + eps);
        x0 = static_cast<float>(static_cast<T>(x0 * r)) * (active ? static_cast<float>(w[t]) : 0.0f);
        x1 = static_cast<float>(static_cast<T>(x1 * r)) * (active ? static_cast<float>(w[t + HALF]) : 0.0f);
        x0 = static_cast<float>(static_cast<T>(x0));
        x1 = static_cast<float>(static_cast<T>(x1));
    }
    if (active) {
        const float theta = angle * (1.0f / divisors[t]);
        const float c = cosf(theta);
        const float s = sinf(theta);
        dst[t] = static_cast<T>(x0 * c - x1 * s);
        dst[t + HALF] = static_cast<T>(x0 * s + x1 * c);
    }
}
"#;

/// Block `(hq, b, c)`: query head `hq` of sequence `b` over positions `[c·CHUNK, (c+1)·CHUNK)` of
/// the valid ones. The query head, and in the block holding the new position the new key and
/// value heads, come from the step's heads (`a0, a1, a2` = q, k, v) or, with `STACKED`, from the
/// stacked q/k/v product (`a0` = y), normalised and rotated here as `cuda_fast::qkv_heads` does
/// (same operations, same roundings). The first query head of each KV head writes the new
/// position into the cache. The last block of a head to finish (`done` counts them, and wraps
/// to zero) merges the chunks.
const SOURCE: &str = r#"
    constexpr int PER = D / 32;
    constexpr int WARPS = NT / 32;
    // The weighted values: TPR threads a row, four elements each; RG row groups take every
    // RG-th position.
    constexpr int TPR = D / 4;
    constexpr int RG = NT / TPR;
    const int hq = blockIdx.x;
    const int b = blockIdx.y;
    const int c = blockIdx.z;
    const int hk = hq / (HQ / HKV);
    const int t = threadIdx.x;
    const int lane = t & 31;
    const int warp = t >> 5;
    const int p = PER_ROW ? pos[b] : position;
    // The slot written and the positions attended: position p and every one before it, or (a
    // window) the ring of `capacity` slots, whose first KEEP are never overwritten.
    int slot = p;
    int valid = p + 1;
    if constexpr (WINDOW > 0) {
        slot = p < WINDOW ? p : KEEP + (p - KEEP) % (WINDOW - KEEP);
        valid = min(p + 1, capacity);
    }
    const int first = c * CHUNK;
    if (first >= valid) {
        return;
    }
    const int n = min(CHUNK, valid - first);
    const int fresh = slot - first;  // the new position within the chunk, when in [0, n)
    const bool holds = fresh >= 0 && fresh < n;
    const long long kv_row = static_cast<long long>(b) * HKV + hk;
    __shared__ Vec4 qh4[D / 4];
    __shared__ Vec4 knew4[D / 4];
    __shared__ Vec4 vnew4[D / 4];
    __shared__ float red[WARPS];
    __shared__ float score[CHUNK];
    __shared__ float part[WARPS];
    __shared__ float sacc[RG][D];
    __shared__ bool last;
    T* qh = reinterpret_cast<T*>(qh4);
    T* knew = reinterpret_cast<T*>(knew4);
    T* vnew = reinterpret_cast<T*>(vnew4);
    const float angle = rope_scale * static_cast<float>(p);
    const T* y = a0 + static_cast<long long>(b) * (HQ + 2 * HKV) * D;
    if constexpr (STACKED) {
        rmlx_rotated(y + hq * D, a1, qh, red, divisors, angle, eps);
    } else {
        for (int i = t; i < D; i += NT) {
            qh[i] = a0[(static_cast<long long>(b) * HQ + hq) * D + i];
        }
    }
    if (holds) {
        if constexpr (STACKED) {
            rmlx_rotated(y + (HQ + hk) * D, a2, knew, red, divisors, angle, eps);
            for (int i = t; i < D; i += NT) {
                vnew[i] = y[(HQ + HKV + hk) * D + i];
            }
        } else {
            for (int i = t; i < D; i += NT) {
                knew[i] = a1[kv_row * D + i];
                vnew[i] = a2[kv_row * D + i];
            }
        }
    }
    __syncthreads();
    if (holds && hq % (HQ / HKV) == 0) {
        for (int i = t; i < D; i += NT) {
            keys[(kv_row * capacity + slot) * D + i] = knew[i];
            values[(kv_row * capacity + slot) * D + i] = vnew[i];
        }
    }
    const T* kbase = keys + (kv_row * capacity + first) * D;
    const T* vbase = values + (kv_row * capacity + first) * D;
    float qv[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        qv[i] = static_cast<float>(qh[lane + 32 * i]) * scale;
    }
    // Each warp scores positions warp, warp + WARPS, …: BATCH rows loaded before any is used.
    for (int j0 = warp; j0 < n; j0 += WARPS * BATCH) {
        float kv[BATCH][PER];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const int j = j0 + u * WARPS;
            const T* kr = j == fresh ? knew : kbase + static_cast<long long>(j) * D;
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                kv[u][i] = j < n ? static_cast<float>(kr[lane + 32 * i]) : 0.0f;
            }
        }
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            float s = 0.0f;
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                s = fmaf(qv[i], kv[u][i], s);
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                s += __shfl_xor_sync(0xffffffffu, s, o);
            }
            if (lane == 0 && j0 + u * WARPS < n) {
                score[j0 + u * WARPS] = s;
            }
        }
    }
    __syncthreads();
    // The chunk's maximum, then its weights and their sum.
    float m = __int_as_float(0xff800000);
    for (int j = t; j < n; j += NT) {
        m = fmaxf(m, score[j]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    }
    if (lane == 0) {
        part[warp] = m;
    }
    __syncthreads();
    m = part[0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) {
        m = fmaxf(m, part[w]);
    }
    __syncthreads();
    float l = 0.0f;
    for (int j = t; j < n; j += NT) {
        const float e = expf(score[j] - m);
        score[j] = e;
        l += e;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        l += __shfl_xor_sync(0xffffffffu, l, o);
    }
    if (lane == 0) {
        part[warp] = l;
    }
    __syncthreads();
    const int r = t / TPR;
    const int e0 = 4 * (t % TPR);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (r < RG) {
        for (int j0 = r; j0 < n; j0 += RG * BATCH) {
            Vec4 vv[BATCH];
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const int j = j0 + u * RG;
                const T* vr = j == fresh ? vnew : vbase + static_cast<long long>(j) * D;
                if (j < n) {
                    vv[u] = *reinterpret_cast<const Vec4*>(vr + e0);
                }
            }
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                if (j0 + u * RG < n) {
                    const float w = score[j0 + u * RG];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        acc[i] = fmaf(w, static_cast<float>(vv[u].v[i]), acc[i]);
                    }
                }
            }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            sacc[r][e0 + i] = acc[i];
        }
    }
    __syncthreads();
    const long long head_rows = (static_cast<long long>(b) * HQ + hq) * ((capacity + CHUNK - 1) / CHUNK);
    const long long row = head_rows + c;
    for (int e = t; e < D; e += NT) {
        float total = 0.0f;
#pragma unroll
        for (int i = 0; i < RG; ++i) {
            total += sacc[i][e];
        }
        partial[row * D + e] = total;
    }
    const int chunks = (valid + CHUNK - 1) / CHUNK;
    if (t == 0) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            sum += part[w];
        }
        stats[row * 2] = m;
        stats[row * 2 + 1] = sum;
    }
    // The last of the head's blocks to get here merges every chunk (in order: the same bits
    // whichever block is last).
    __threadfence();
    __syncthreads();
    if (t == 0) {
        last = atomicInc(done + b * HQ + hq, chunks - 1) == static_cast<unsigned>(chunks - 1);
    }
    __syncthreads();
    if (!last) {
        return;
    }
    __threadfence();
    for (int e = t; e < D; e += NT) {
        // One pass with a running maximum; BATCH chunks loaded before any is used.
        float top = __int_as_float(0xff800000);
        float total = 0.0f;
        float o = 0.0f;
        for (int c0 = 0; c0 < chunks; c0 += BATCH) {
            float cm[BATCH], cl[BATCH], cx[BATCH];
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const bool in = c0 + u < chunks;
                cm[u] = in ? __ldcg(stats + (head_rows + c0 + u) * 2) : __int_as_float(0xff800000);
                cl[u] = in ? __ldcg(stats + (head_rows + c0 + u) * 2 + 1) : 0.0f;
                cx[u] = in ? __ldcg(partial + (head_rows + c0 + u) * D + e) : 0.0f;
            }
            float next = top;
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                next = fmaxf(next, cm[u]);
            }
            const float rescale = expf(top - next);
            total *= rescale;
            o *= rescale;
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const float w = c0 + u < chunks ? expf(cm[u] - next) : 0.0f;
                total = fmaf(cl[u], w, total);
                o = fmaf(cx[u], w, o);
            }
            top = next;
        }
        out[(static_cast<long long>(b) * HQ + hq) * D + e] = static_cast<T>(o / total);
    }
"#;

/// What an instance is specialised for.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Shape {
    dtype: Dtype,
    batch: i32,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    capacity: i32,
    /// The ring's window and kept slots (`window` 0: the buffers hold every position).
    window: i32,
    keep: i32,
    per_row: bool,
    /// The heads come from the stacked q/k/v product (normalised with `norm`, then rotated).
    stacked: bool,
    norm: bool,
    /// The scores' multiplier, the norms' epsilon and the rotation's position multiplier, as bits.
    scale: u32,
    eps: u32,
    rope_scale: u32,
}

impl Shape {
    /// Positions a block takes: at most 128 chunks a head, of at least 32 positions.
    fn chunk(&self) -> i32 {
        (self.capacity.max(1) as u32).div_ceil(128).next_power_of_two().max(32) as i32
    }
}

/// Where a decoding step's query, key and value heads come from.
pub enum StepHeads<'a> {
    /// Made already: `q: [B, Hq, 1, D]`, `k, v: [B, Hkv, 1, D]`, queries and keys rotated.
    Ready { q: &'a Array, k: &'a Array, v: &'a Array },
    /// The stacked q/k/v product `y: [B, (Hq + 2·Hkv)·D]` of one position a sequence, turned into
    /// heads inside the kernel as [`qkv_heads`](super::cuda_fast::qkv_heads) does: queries and
    /// keys normalised (with `norms`) and rotated over the whole head at the cache's position,
    /// the rotation's own `offset` aside.
    Stacked { y: &'a Array, heads: (i32, i32, i32), norms: Option<HeadNorms<'a>>, rotation: &'a Rotation<'a> },
}

impl StepHeads<'_> {
    /// `(batch, query heads, KV heads, head size)` and the dtype, where the arrays agree on them.
    fn dims(&self) -> Option<([i32; 4], Dtype)> {
        match self {
            StepHeads::Ready { q, k, v } => {
                let (qs, ks) = (q.shape(), k.shape());
                let fits = qs.len() == 4
                    && ks.len() == 4
                    && qs[2] == 1
                    && ks[2] == 1
                    && ks[0] == qs[0]
                    && ks[3] == qs[3]
                    && v.shape() == ks
                    && k.dtype() == q.dtype()
                    && v.dtype() == q.dtype();
                fits.then(|| ([qs[0], qs[1], ks[1], qs[3]], q.dtype()))
            }
            StepHeads::Stacked { y, heads: (hq, hkv, d), norms, rotation } => {
                let ys = y.shape();
                let fits = ys.len() == 2
                    && ys[1] == (hq + 2 * hkv) * d
                    && d % 2 == 0
                    && rotation.divisors.shape() == [d / 2]
                    && norms.as_ref().is_none_or(|n| n.query.dtype() == y.dtype() && n.key.dtype() == y.dtype());
                fits.then(|| ([ys[0], *hq, *hkv, *d], y.dtype()))
            }
        }
    }
}

/// Attends a decoding step's queries (one position a sequence, from `heads`) over the cache
/// buffers `(keys, values)` (`[B, Hkv, capacity, D]`) after writing its keys and values into them
/// at `position` (one for every sequence, or one each: `[B]` int32, each below `capacity`), scores
/// scaled by `scale`. With a `ring` (one position for every sequence), the buffers are a
/// rotating cache's, laid out as [`Ring::slot`] says: the new position goes to its slot and the
/// query attends every slot written (at most `capacity`, which must not exceed the window).
/// `done` (`[B·Hq]` uint32, zero) is the buffers' companion: the kernel counts finished chunks in
/// it and leaves it zero. Returns `[attention ([B, Hq, 1, D]), keys', values', done']`.
///
/// The buffers are the caller's alone ([`InPlace::Owned`]): `keys'`, `values'` and `done'` are
/// the same buffers, updated in place even while work queued earlier still reads them, and any
/// other array over them sees the new position (a buffer that is not row-contiguous is copied
/// first). `None` where it does not serve (not MLX's CUDA backend, training, other shapes or
/// types, a head size not a multiple of 32 or above 256, a capacity above [`MAX_CAPACITY`]).
pub fn cache_attention(
    heads: &StepHeads,
    (keys, values, done): (&Array, &Array, &Array),
    position: &Offset,
    ring: Option<Ring>,
    scale: f32,
) -> Result<Option<[Array; 4]>> {
    let Some(([batch, hq, hkv, d], dtype)) = heads.dims() else { return Ok(None) };
    let cs = keys.shape();
    let tracer = match heads {
        StepHeads::Ready { q, .. } => q.is_tracer(),
        StepHeads::Stacked { y, .. } => y.is_tracer(),
    };
    let serves = on_cuda()
        && !training()
        && !tracer
        && matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        && d % 32 == 0
        && d <= 256
        && hkv > 0
        && hq % hkv == 0
        && cs.len() == 4
        && cs == [batch, hkv, cs[2], d]
        && cs[2] as usize <= MAX_CAPACITY
        && values.shape() == cs
        && keys.dtype() == dtype
        && values.dtype() == dtype
        && done.shape() == [batch * hq]
        && done.dtype() == Dtype::Uint32
        && match (position, ring) {
            (Offset::Uniform(p), None) => *p < cs[2] as usize,
            (Offset::Uniform(p), Some(r)) => {
                *p < i32::MAX as usize
                    && r.keep < r.window
                    && r.window <= i32::MAX as usize
                    && cs[2] as usize <= r.window
                    && r.slot(*p) < cs[2] as usize
            }
            (Offset::PerRow(a), None) => a.dtype() == Dtype::Int32 && a.size() == batch as usize,
            (Offset::PerRow(_), Some(_)) => false,
        };
    if !serves {
        return Ok(None);
    }
    let (stacked, norm, eps, rope_scale) = match heads {
        StepHeads::Ready { .. } => (false, false, 0.0, 0.0),
        StepHeads::Stacked { norms, rotation, .. } => {
            (true, norms.is_some(), norms.as_ref().map_or(0.0, |n| n.eps), rotation.scale)
        }
    };
    let s = Shape {
        dtype,
        batch,
        heads: hq,
        kv_heads: hkv,
        head_dim: d,
        capacity: cs[2],
        window: ring.map_or(0, |r| r.window as i32),
        keep: ring.map_or(0, |r| r.keep as i32),
        per_row: matches!(position, Offset::PerRow(_)),
        stacked,
        norm,
        scale: scale.to_bits(),
        eps: f32::to_bits(eps),
        rope_scale: f32::to_bits(rope_scale),
    };
    // Inputs the kernel does not read (a Ready step's weights and divisors, a Stacked step's
    // missing norms) are stood in for by an array of the step.
    let [a0, a1, a2, a3] = match heads {
        StepHeads::Ready { q, k, v } => [(*q).clone(), (*k).clone(), (*v).clone(), (*q).clone()],
        StepHeads::Stacked { y, norms, rotation, .. } => {
            let (qw, kw) = match norms {
                Some(n) => (n.query.clone(), n.key.clone()),
                None => ((*y).clone(), (*y).clone()),
            };
            let divisors = match rotation.divisors.dtype() {
                Dtype::Float32 => rotation.divisors.clone(),
                _ => rotation.divisors.astype(Dtype::Float32)?,
            };
            [(*y).clone(), qw, kw, divisors]
        }
    };
    let (rows, at) = match position {
        Offset::Uniform(p) => (a0.clone(), *p as i32),
        Offset::PerRow(a) => (a.clone(), 0),
    };
    let inputs = [a0, a1, a2, a3, keys.clone(), values.clone(), done.clone(), rows];
    let out = launch_for(s)?.call_with(&inputs, &[KernelArg::I32(at)])?;
    let [keys, values, done, attention, _partial, _stats]: [Array; 6] = out.try_into().expect("six outputs");
    Ok(Some([attention, keys, values, done]))
}

/// [`cache_attention`] over an unbounded cache: its buffers grown to hold the new position
/// first, updated in place, and its offset advanced. `None` (the cache as it was, but for
/// buffers grown) where the kernel does not serve.
pub fn standard_cache_attention(
    heads: &StepHeads,
    cache: &mut StandardCache,
    scale: f32,
) -> crate::Result<Option<Array>> {
    let Some(([batch, hq, hkv, d], dtype)) = heads.dims() else { return Ok(None) };
    if !on_cuda() {
        return Ok(None);
    }
    cache.reserve_for([batch, hkv, 1, d], dtype)?;
    let buffers = [&mut cache.keys, &mut cache.values, &mut cache.done];
    let attention = attend_buffers(heads, buffers, batch * hq, cache.offset, None, scale)?;
    if attention.is_some() {
        cache.offset += 1;
    }
    Ok(attention)
}

/// [`cache_attention`] over a rotating cache: its buffers made ready to take the new position in
/// its ring slot first ([`RotatingCache::prepare_write`]), updated in place, and its offset
/// advanced. `None` (the cache as it was, but for buffers made ready) where the kernel does not
/// serve.
pub fn rotating_cache_attention(
    heads: &StepHeads,
    cache: &mut RotatingCache,
    scale: f32,
) -> crate::Result<Option<Array>> {
    let Some(([batch, hq, hkv, d], dtype)) = heads.dims() else { return Ok(None) };
    if !on_cuda() {
        return Ok(None);
    }
    let rows = ([batch, hkv, 1, d], dtype);
    let slot = cache.prepare_write(rows, rows)?;
    if slot != cache.ring().slot(cache.offset) {
        return Ok(None);
    }
    let ring = Some(cache.ring());
    let buffers = [&mut cache.keys, &mut cache.values, &mut cache.done];
    let attention = attend_buffers(heads, buffers, batch * hq, cache.offset, ring, scale)?;
    if attention.is_some() {
        cache.advance();
    }
    Ok(attention)
}

/// [`cache_attention`] at `position` over a cache's buffers `[keys, values, done]` (the chunk
/// counts made for `counts` query heads first), lent to the kernel and given back: updated in
/// place where it served, as they were where it did not.
fn attend_buffers(
    heads: &StepHeads,
    [keys, values, done]: [&mut Option<Array>; 3],
    counts: i32,
    position: usize,
    ring: Option<Ring>,
    scale: f32,
) -> crate::Result<Option<Array>> {
    if done.as_ref().is_none_or(|a| a.shape() != [counts]) {
        *done = Some(ops::zeros(&[counts], Dtype::Uint32)?);
    }
    let lent = [keys.take(), values.take(), done.take()];
    let [k, v, c] = lent.map(|a| a.expect("allocated by the caller"));
    match cache_attention(heads, (&k, &v, &c), &Offset::Uniform(position), ring, scale) {
        Ok(Some([attention, k, v, c])) => {
            (*keys, *values, *done) = (Some(k), Some(v), Some(c));
            Ok(Some(attention))
        }
        other => {
            (*keys, *values, *done) = (Some(k), Some(v), Some(c));
            Ok(other?.map(|[attention, ..]| attention))
        }
    }
}

/// [`standard_cache_attention`] or [`rotating_cache_attention`], as `cache` is; `None` for a
/// batch's cache (or where the kernel does not serve).
pub fn kv_cache_attention(heads: &StepHeads, cache: &mut KvCache, scale: f32) -> crate::Result<Option<Array>> {
    match cache {
        KvCache::Standard(c) => standard_cache_attention(heads, c, scale),
        KvCache::Rotating(c) => rotating_cache_attention(heads, c, scale),
        KvCache::Batch(_) => Ok(None),
    }
}

/// The source of the kernel for `s`.
fn source(s: &Shape) -> String {
    let t = cuda_type(s.dtype);
    format!(
        "{CUDA_TYPES}{OVERLAP}typedef {t} T;\nstruct alignas(4 * sizeof(T)) Vec4 {{ T v[4]; }};\n\
         constexpr int D = {};\nconstexpr int HQ = {};\nconstexpr int HKV = {};\n\
         constexpr bool PER_ROW = {};\nconstexpr bool STACKED = {};\nconstexpr bool NORM = {};\n\
         constexpr int WINDOW = {};\nconstexpr int KEEP = {};\nconstexpr int CHUNK = {};\nconstexpr int NT = {THREADS};\nconstexpr int BATCH = 8;\n{ROTATED}\
         extern \"C\" __global__ void __launch_bounds__({THREADS}) rmlx_decode_attention(const T* a0, \
         const T* a1, const T* a2, const float* divisors, T* keys, T* values, unsigned* done, const int* pos, \
         int position, T* out, float* partial, float* stats, int capacity, float scale, float eps, float rope_scale) \
         {{\nrmlx_wait_previous();\nrmlx_release_next();\n{SOURCE}}}\n",
        s.head_dim,
        s.heads,
        s.kv_heads,
        s.per_row,
        s.stacked,
        s.norm,
        s.window,
        s.keep,
        s.chunk(),
    )
}

/// The launch over `[a0, a1, a2, divisors, keys, values, done, positions]` (see [`SOURCE`]:
/// positions per row, or any array when one position, the call's value, serves every row) for
/// `s`, made once per process: outputs `[keys', values', done', attention, chunks' weighted
/// values, chunks' maxima and sums]`, the first three the buffers of inputs 4 to 6, updated in
/// place.
fn launch_for(s: Shape) -> Result<Arc<CudaLaunch>> {
    static LAUNCHES: Launches<Shape> = LazyLock::new(Mutex::default);
    launch_once(&LAUNCHES, "rmlx_decode_attention", &s, || make_launch(&s))
}

/// The launch for `s` (its kernel compiled, or read from the cache).
fn make_launch(s: &Shape) -> Result<CudaLaunch> {
    let function = cuda::compile("rmlx_decode_attention", &source(s), Some(&kernel_cache()))?.overlapping();
    use KernelArg::{Input, Output, Value, F32, I32};
    let chunk = s.chunk();
    let (batch, chunks) = (s.batch as u32, (s.capacity + chunk - 1) / chunk);
    let node = KernelNode {
        function,
        grid: [s.heads as u32, batch, chunks as u32],
        block: [THREADS, 1, 1],
        shared_bytes: 0,
        args: vec![
            Input(0),
            Input(1),
            Input(2),
            Input(3),
            Output(0),
            Output(1),
            Output(2),
            Input(7),
            Value(0),
            Output(3),
            Output(4),
            Output(5),
            I32(s.capacity),
            F32(f32::from_bits(s.scale)),
            F32(f32::from_bits(s.eps)),
            F32(f32::from_bits(s.rope_scale)),
        ],
    };
    let buffer = (vec![s.batch, s.kv_heads, s.capacity, s.head_dim], s.dtype);
    let outputs = [
        buffer.clone(),
        buffer,
        (vec![s.batch * s.heads], Dtype::Uint32),
        (vec![s.batch, s.heads, 1, s.head_dim], s.dtype),
        (vec![s.batch, s.heads, chunks, s.head_dim], Dtype::Float32),
        (vec![s.batch, s.heads, chunks, 2], Dtype::Float32),
    ];
    let in_place = [(0, 4), (1, 5), (2, 6)];
    CudaLaunch::updating("rmlx_decode_attention", &[node], &outputs, &in_place, InPlace::Owned)
}
