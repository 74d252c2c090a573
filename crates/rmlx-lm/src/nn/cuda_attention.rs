//! A decoding step's attention over an unbounded KV cache as one kernel, one node of MLX's graph:
//! the step's heads made from the stacked q/k/v product (normalised and rotated), the new keys
//! and values written into the cache's buffers in place, and one query a sequence attending over
//! the positions written so far — or up to [`MAX_QUERIES`] queries of one sequence (a speculative
//! verification pass), each over the positions up to its own.
//!
//! The composed step takes a split, two norms and two rotations, two slice updates, two slices of
//! the buffers and MLX's attention (ten nodes or more with their copies); a decoding step of a
//! small model is bound by the host work MLX does per node, and every kernel of a step costs the
//! GPU a launch's gap. Here flash-decoding in one kernel: one block per (query head, query,
//! chunk of 32 or more positions) scores its chunk, keeps the chunk's maximum, sum of exponentials
//! and weighted values (float32), and the last block of a head to finish merges the chunks (with a
//! sink logit per head joining the softmax there, gpt-oss's; each score soft-capped where it is made,
//! Gemma 2's). A block whose chunk holds new positions makes their keys and values itself, and one
//! block per KV head and query writes its query's into the cache, so nothing waits for the write.

use super::cuda_fast::{
    cuda_type, kernel_cache, launch_once, on_cuda, HeadNorms, Launches, Rotation, CUDA_TYPES, HEAD_MATH,
};
use super::training;
use crate::cache::{KvCache, Offset, Ring, RotatingCache, StandardCache};
use rmlx::cuda::{self, CudaLaunch, InPlace, KernelArg, KernelNode, OVERLAP};
use rmlx::{ops, Array, Dtype, Result};
use std::sync::{Arc, LazyLock, Mutex};

/// What shapes a head's scaled scores before their softmax, besides the cache: Gemma 2's soft cap
/// on each score, gpt-oss's sink logit per head ([`Scores::default`]: neither).
#[derive(Clone, Copy, Debug, Default)]
pub struct Scores<'a> {
    /// Each scaled score `s` becomes `cap · tanh(s / cap)` (Gemma 2's `attn_logit_softcapping`).
    pub softcap: Option<f32>,
    /// `[Hq]`: each head's sink logit joins its softmax as a score with no value (gpt-oss).
    pub sinks: Option<&'a Array>,
}

impl<'a> Scores<'a> {
    /// Sink logits only.
    pub fn sinks(sinks: Option<&'a Array>) -> Self {
        Scores { softcap: None, sinks }
    }
}

/// The largest cache the kernels take, in positions (a block's chunk, and the scores it keeps in
/// shared memory, grow with the cache: 8,192 positions, 32 KB, at this size).
pub const MAX_CAPACITY: usize = 1 << 20;

/// The most positions of one sequence a call takes (a speculative verification pass's drafts and
/// pending token, a short prompt): each block makes the new keys it reads in shared memory.
pub const MAX_QUERIES: i32 = 8;

/// Threads of a block (also the most chunks a head has: the merge gives each a thread).
const THREADS: u32 = 128;

/// The most shared memory a block's copy of its chunk's keys and values may take (a larger
/// chunk is read from the cache's buffers where it is used).
const STAGE_BYTES: u32 = 32 * 1024;

/// Asynchronous 16-byte copies into shared memory (compute capability 8.0 on; `RMLX_STAGES`
/// says whether the kernel stages its chunk with them).
const STAGING: &str = r#"
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define RMLX_STAGES 1
#else
#define RMLX_STAGES 0
#endif
__device__ __forceinline__ void rmlx_stage16(void* dst, const void* src) {
#if RMLX_STAGES
    const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
#endif
}
__device__ __forceinline__ void rmlx_staged() {
#if RMLX_STAGES
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}
"#;

/// Block `(hq, b·L + i, c)`: query head `hq` of query `i` of sequence `b` (its `L` queries at
/// positions `p0 .. p0 + L`, query `i` at `p0 + i`) over positions `[c·CHUNK, (c+1)·CHUNK)` of
/// those it sees (its own and every one before it). The query head, and the new key and value
/// heads of the chunk's new positions, come from the step's heads (`a0, a1, a2` = q, k, v, each
/// `[B, H, L, D]`) or, with `STACKED`, from the stacked q/k/v product (`a0` = y, rows `[B·L, …]`),
/// normalised and rotated here as `cuda_fast::qkv_heads` does (same operations, same roundings;
/// with `SCALED`, queries and keys multiplied by `QK_FACTOR` in `T` before they turn, as YaRN's
/// attention factor multiplies them): a block makes every new key it reads itself, so no block
/// waits for another's write. The first query head of each KV head writes its query's position
/// into the cache. The last block of a query head to finish (`done` counts them, and wraps to
/// zero) merges the chunks, with `SINKS` the head's sink logit `sinks[hq]` joining the softmax as
/// a score with no value. The output is `[B, L, HQ, D]` (queries first: the merged heads' rows).
/// With a ring (`WINDOW`), one query a sequence.
///
/// Everything that does not depend on the kernel before is done before waiting for it (see
/// `rmlx::cuda::OVERLAP`): the chunk's keys and values are copied into shared memory (no kernel
/// of a launch writes a cache's earlier positions; the new positions' rows are taken from the
/// step's heads, never from the buffers), and the query's rotation and the norms' weights are read.
const SOURCE: &str = r#"
    constexpr int PER = D / 32;
    constexpr int WARPS = NT / 32;
    constexpr int HALF = D / 2;
    // The weighted values: TPR threads a row, four elements each; RG row groups take every
    // RG-th position (and in the merge every RG-th chunk).
    constexpr int TPR = D / 4;
    constexpr int RG = NT / TPR;
    // A row's 16-byte pieces, and whether a chunk's keys and values fit shared memory.
    constexpr int PIECES = D * static_cast<int>(sizeof(T)) / 16;
    constexpr bool STAGE = RMLX_STAGES && (D * sizeof(T)) % 16 == 0 && 2 * CHUNK * D * sizeof(T) <= STAGE_BYTES;
    const int hq = blockIdx.x;
    const int b = blockIdx.y / L;
    const int qi = blockIdx.y % L;
    const int c = blockIdx.z;
    const int hk = hq / (HQ / HKV);
    const int t = threadIdx.x;
    const int lane = t & 31;
    const int warp = t >> 5;
    const bool active = t < HALF;
    if constexpr (PER_ROW) {
        // The positions are an input the kernel before may have made.
        rmlx_wait_previous();
        rmlx_release_next();
    }
    // The sequence's first new position, and this query's: p0 + qi.
    const int p0 = PER_ROW ? pos[b] : position;
    const int p = p0 + qi;
    // The slot written and the positions attended: position p and every one before it, or (a
    // window, one query a sequence) the ring of `capacity` slots, whose first KEEP are never
    // overwritten.
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
    // The new positions within the chunk: indices fresh + r for the sequence's new rows r in
    // [r_lo, r_hi) (with L > 1 no ring: they follow one another, and end at this query's).
    const int fresh = slot - qi - first;
    const int r_lo = max(-fresh, 0);
    const int r_hi = min(n - fresh, L);
    const bool holds = r_lo < r_hi;
    const long long kv_row = static_cast<long long>(b) * HKV + hk;
    __shared__ Vec4 qh4[D / 4];
    __shared__ Vec4 knew4[L * D / 4];
    __shared__ Vec4 vnew4[L * D / 4];
    __shared__ float red[2][WARPS];
    __shared__ float score[CHUNK];
    __shared__ float part[WARPS];
    __shared__ float sacc[RG][D];
    __shared__ float chunk_weight[NT];
    __shared__ bool last;
    __shared__ uint4 kstage[STAGE ? CHUNK * PIECES : 1];
    __shared__ uint4 vstage[STAGE ? CHUNK * PIECES : 1];
    T* qh = reinterpret_cast<T*>(qh4);
    T* knew = reinterpret_cast<T*>(knew4);
    T* vnew = reinterpret_cast<T*>(vnew4);
    const T* kbase = keys + (kv_row * capacity + first) * D;
    const T* vbase = values + (kv_row * capacity + first) * D;
    const bool staged = STAGE && (reinterpret_cast<size_t>(keys) | reinterpret_cast<size_t>(values)) % 16 == 0;
    if (staged) {
        for (int i = t; i < n * PIECES; i += NT) {
            rmlx_stage16(kstage + i, reinterpret_cast<const uint4*>(kbase) + i);
            rmlx_stage16(vstage + i, reinterpret_cast<const uint4*>(vbase) + i);
        }
    }
    // The query's rotation at position p, and the norms' weights (0 past the pairs: those threads
    // only take part in the sums of squares).
    float cr = 1.0f, sr = 0.0f, wq0 = 0.0f, wq1 = 0.0f, wk0 = 0.0f, wk1 = 0.0f;
    if constexpr (STACKED) {
        if (active) {
            const float theta = (rope_scale * static_cast<float>(p)) * (1.0f / divisors[t]);
            cr = cosf(theta);
            sr = sinf(theta);
            if constexpr (NORM) {
                wq0 = static_cast<float>(a1[t]);
                wq1 = static_cast<float>(a1[t + HALF]);
                wk0 = static_cast<float>(a2[t]);
                wk1 = static_cast<float>(a2[t + HALF]);
            }
        }
    }
    if constexpr (!PER_ROW) {
        rmlx_wait_previous();
        rmlx_release_next();
    }
    if constexpr (STACKED) {
        // Query (and new key) heads: RMS-normalised (the product rounded to T before the weight,
        // as MLX's kernel does), then rotated over the pairs (i, i + D/2). Round 0 makes the
        // query and the chunk's first new key, each later round one more new key.
        const T* ys = a0 + static_cast<long long>(b) * L * (HQ + 2 * HKV) * D;
        for (int round = 0; round == 0 || r_lo + round < r_hi; ++round) {
            const int r = r_lo + round;
            const bool with_key = r < r_hi;
            const T* qrow = ys + (static_cast<long long>(qi) * (HQ + 2 * HKV) + hq) * D;
            const T* y = ys + static_cast<long long>(r) * (HQ + 2 * HKV) * D;
            const T* krow = y + (HQ + hk) * D;
            float q0 = round == 0 && active ? static_cast<float>(qrow[t]) : 0.0f;
            float q1 = round == 0 && active ? static_cast<float>(qrow[t + HALF]) : 0.0f;
            float k0 = with_key && active ? static_cast<float>(krow[t]) : 0.0f;
            float k1 = with_key && active ? static_cast<float>(krow[t + HALF]) : 0.0f;
            if (with_key) {
                for (int i = t; i < D; i += NT) {
                    vnew[r * D + i] = y[(HQ + HKV + hk) * D + i];
                }
            }
            if constexpr (NORM) {
                float ssq = rmlx_pair_squares(q0, q1);
                float ssk = rmlx_pair_squares(k0, k1);
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) {
                    ssq += __shfl_xor_sync(0xffffffffu, ssq, o);
                    ssk += __shfl_xor_sync(0xffffffffu, ssk, o);
                }
                if (round > 0) {
                    __syncthreads();
                }
                if (lane == 0) {
                    red[0][warp] = ssq;
                    red[1][warp] = ssk;
                }
                __syncthreads();
                float tq = 0.0f, tk = 0.0f;
                for (int i = 0; i < (HALF + 31) / 32; ++i) {
                    tq += red[0][i];
                    tk += red[1][i];
                }
                const float rq = rsqrtf(tq / D + eps);
                const float rk = rsqrtf(tk / D + eps);
                q0 = rmlx_normed<T>(q0, rq, wq0);
                q1 = rmlx_normed<T>(q1, rq, wq1);
                k0 = rmlx_normed<T>(k0, rk, wk0);
                k1 = rmlx_normed<T>(k1, rk, wk1);
            }
            if constexpr (SCALED) {
                const float f = static_cast<float>(static_cast<T>(QK_FACTOR));
                q0 = static_cast<float>(static_cast<T>(q0 * f));
                q1 = static_cast<float>(static_cast<T>(q1 * f));
                k0 = static_cast<float>(static_cast<T>(k0 * f));
                k1 = static_cast<float>(static_cast<T>(k1 * f));
            }
            if (active) {
                if (round == 0) {
                    qh[t] = static_cast<T>(rmlx_rotated_first(q0, q1, cr, sr));
                    qh[t + HALF] = static_cast<T>(rmlx_rotated_second(q0, q1, cr, sr));
                }
                if (with_key) {
                    // The key's own position: p0 + r (the query's, p, for its own row).
                    float ck = cr, sk = sr;
                    if (r != qi) {
                        const float theta = (rope_scale * static_cast<float>(p0 + r)) * (1.0f / divisors[t]);
                        ck = cosf(theta);
                        sk = sinf(theta);
                    }
                    knew[r * D + t] = static_cast<T>(rmlx_rotated_first(k0, k1, ck, sk));
                    knew[r * D + t + HALF] = static_cast<T>(rmlx_rotated_second(k0, k1, ck, sk));
                }
            }
        }
    } else {
        for (int i = t; i < D; i += NT) {
            qh[i] = a0[((static_cast<long long>(b) * HQ + hq) * L + qi) * D + i];
        }
        for (int r = r_lo; r < r_hi; ++r) {
            for (int i = t; i < D; i += NT) {
                knew[r * D + i] = a1[(kv_row * L + r) * D + i];
                vnew[r * D + i] = a2[(kv_row * L + r) * D + i];
            }
        }
    }
    if (staged) {
        rmlx_staged();
        kbase = reinterpret_cast<const T*>(kstage);
        vbase = reinterpret_cast<const T*>(vstage);
    }
    __syncthreads();
    // The query's own new key and value (in the chunk holding its position), written by the
    // first query head of their KV head.
    if (holds && r_lo <= qi && qi < r_hi && hq % (HQ / HKV) == 0) {
        for (int i = t; i < D; i += NT) {
            keys[(kv_row * capacity + slot) * D + i] = knew[qi * D + i];
            values[(kv_row * capacity + slot) * D + i] = vnew[qi * D + i];
        }
    }
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
            const T* kr = j >= fresh && j < fresh + L ? knew + (j - fresh) * D : kbase + static_cast<long long>(j) * D;
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
                score[j0 + u * WARPS] = CAPPED ? SOFTCAP * tanhf(s / SOFTCAP) : s;
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
                const T* vr = j >= fresh && j < fresh + L ? vnew + (j - fresh) * D : vbase + static_cast<long long>(j) * D;
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
    // This query head's row of the chunks' results, and of the chunk counts.
    const long long query_head = (static_cast<long long>(b) * HQ + hq) * L + qi;
    const long long head_rows = query_head * ((capacity + CHUNK - 1) / CHUNK);
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
        last = atomicInc(done + query_head, chunks - 1) == static_cast<unsigned>(chunks - 1);
    }
    __syncthreads();
    if (!last) {
        return;
    }
    __threadfence();
    // Every chunk's weight against the head's maximum (a thread a chunk: there are at most 128
    // chunks, NT), and the sum of exponentials, summed in a fixed order (the same bits whichever
    // block is last).
    const float cm = t < chunks ? __ldcg(stats + (head_rows + t) * 2) : __int_as_float(0xff800000);
    const float cl = t < chunks ? __ldcg(stats + (head_rows + t) * 2 + 1) : 0.0f;
    float top = cm;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    }
    if (lane == 0) {
        part[warp] = top;
    }
    __syncthreads();
    top = part[0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) {
        top = fmaxf(top, part[w]);
    }
    const float sink = SINKS ? static_cast<float>(sinks[hq]) : 0.0f;
    if constexpr (SINKS) {
        top = fmaxf(top, sink);
    }
    const float weight = t < chunks ? expf(cm - top) : 0.0f;
    chunk_weight[t] = weight;
    float total = weight * cl;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        total += __shfl_xor_sync(0xffffffffu, total, o);
    }
    __syncthreads();
    if (lane == 0) {
        part[warp] = total;
    }
    __syncthreads();
    total = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        total += part[w];
    }
    if constexpr (SINKS) {
        total += expf(sink - top);
    }
    // The weighted values: row group r takes chunks r, r + RG, …, BATCH of them loaded before any
    // is used; then the groups in order.
    if (r < RG) {
        float o4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int c0 = r; c0 < chunks; c0 += RG * BATCH) {
            float cx[BATCH][4];
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const int k = c0 + u * RG;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    cx[u][i] = k < chunks ? __ldcg(partial + (head_rows + k) * D + e0 + i) : 0.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < BATCH; ++u) {
                const int k = c0 + u * RG;
                const float w = k < chunks ? chunk_weight[k] : 0.0f;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    o4[i] = fmaf(cx[u][i], w, o4[i]);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            sacc[r][e0 + i] = o4[i];
        }
    }
    __syncthreads();
    for (int e = t; e < D; e += NT) {
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < RG; ++i) {
            o += sacc[i][e];
        }
        out[((static_cast<long long>(b) * L + qi) * HQ + hq) * D + e] = static_cast<T>(o / total);
    }
"#;

/// What an instance is specialised for.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Shape {
    dtype: Dtype,
    batch: i32,
    /// Positions a sequence (`L`).
    queries: i32,
    /// The chunk counts' length (at least `batch · heads · queries`).
    counters: i32,
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
    /// A sink logit per query head joins the softmax.
    sinks: bool,
    /// The scores' soft cap (float bits; 0: none).
    softcap: u32,
    /// The stacked heads' queries and keys multiplied by this before they turn (float bits; 1.0:
    /// not multiplied).
    qk_factor: u32,
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

    /// The shared memory a block declares (as [`SOURCE`] does), in bytes: the query, the new
    /// keys and values, the scores and sums, and the staged chunk where it fits.
    fn shared_bytes(&self) -> usize {
        let (d, t, chunk, threads) =
            (self.head_dim as usize, self.dtype.size(), self.chunk() as usize, THREADS as usize);
        let heads = (1 + 2 * self.queries as usize) * d * t;
        let sums = 4 * (2 * threads / 32 + chunk + threads / 32 + (threads / (d / 4)) * d + threads) + 1;
        let staged = 2 * chunk * d * t;
        heads + sums + if staged <= STAGE_BYTES as usize { staged } else { 0 }
    }
}

/// The shared memory a block may declare statically.
const SHARED_LIMIT: usize = 48 * 1024;

/// Where a decoding step's query, key and value heads come from.
pub enum StepHeads<'a> {
    /// Made already: `q: [B, Hq, L, D]`, `k, v: [B, Hkv, L, D]`, queries and keys rotated.
    Ready { q: &'a Array, k: &'a Array, v: &'a Array },
    /// The stacked q/k/v product `y: [B·L, (Hq + 2·Hkv)·D]` of `L` positions of each of `batch`
    /// sequences, turned into heads inside the kernel as [`qkv_heads`](super::cuda_fast::qkv_heads)
    /// does: queries and keys normalised (with `norms`) and rotated over the whole head at their
    /// positions in the cache, the rotation's own `offset` aside.
    Stacked {
        y: &'a Array,
        batch: i32,
        heads: (i32, i32, i32),
        norms: Option<HeadNorms<'a>>,
        rotation: &'a Rotation<'a>,
    },
}

impl StepHeads<'_> {
    /// `(batch, query heads, KV heads, head size)`, the positions a sequence (at most
    /// [`MAX_QUERIES`]) and the dtype, where the arrays agree on them.
    fn dims(&self) -> Option<([i32; 4], i32, Dtype)> {
        match self {
            StepHeads::Ready { q, k, v } => {
                let (qs, ks) = (q.shape(), k.shape());
                let fits = qs.len() == 4
                    && ks.len() == 4
                    && (1..=MAX_QUERIES).contains(&qs[2])
                    && ks[2] == qs[2]
                    && ks[0] == qs[0]
                    && ks[3] == qs[3]
                    && v.shape() == ks
                    && k.dtype() == q.dtype()
                    && v.dtype() == q.dtype();
                fits.then(|| ([qs[0], qs[1], ks[1], qs[3]], qs[2], q.dtype()))
            }
            StepHeads::Stacked { y, batch, heads: (hq, hkv, d), norms, rotation } => {
                let ys = y.shape();
                let fits = ys.len() == 2
                    && *batch > 0
                    && ys[0] % batch == 0
                    && (1..=MAX_QUERIES).contains(&(ys[0] / batch))
                    && ys[1] == (hq + 2 * hkv) * d
                    && d % 2 == 0
                    && rotation.divisors.shape() == [d / 2]
                    && norms.as_ref().is_none_or(|n| n.query.dtype() == y.dtype() && n.key.dtype() == y.dtype());
                fits.then(|| ([*batch, *hq, *hkv, *d], ys[0] / batch, y.dtype()))
            }
        }
    }
}

/// [`attend_rows`] with the attention heads first, `[B, Hq, L, D]` (what the tests compare
/// with MLX's attention).
#[cfg(test)]
pub fn cache_attention(
    heads: &StepHeads,
    buffers: (&Array, &Array, &Array),
    position: &Offset,
    ring: Option<Ring>,
    scale: f32,
    scores: Scores,
) -> Result<Option<[Array; 4]>> {
    let Some([attention, keys, values, done]) = attend_rows(heads, buffers, position, ring, scale, scores)? else {
        return Ok(None);
    };
    Ok(Some([heads_first(&attention)?, keys, values, done]))
}

/// `[B, L, Hq, D]` attention (queries first, as the kernel writes it) as `[B, Hq, L, D]`: a
/// reshape for one position, else a transposed view.
fn heads_first(attention: &Array) -> Result<Array> {
    match attention.shape() {
        &[b, 1, hq, d] => attention.reshape(&[b, hq, 1, d]),
        _ => attention.swapaxes(1, 2),
    }
}

/// Attends the queries of `L` new positions a sequence (one in a decoding step, the drafts and
/// pending token of a speculative verification pass; at most [`MAX_QUERIES`]; from `heads`) over
/// the cache buffers `(keys, values)` (`[B, Hkv, capacity, D]`) after writing their keys and values
/// into them at `position .. position + L` (one first position for every sequence, or one each:
/// `[B]` int32), each query seeing its own position and every one before it, scores scaled by
/// `scale`. With a `ring` (one position for every sequence, `L` = 1), the buffers are a rotating
/// cache's, laid out as [`Ring::slot`] says: the new position goes to its slot and the query
/// attends every slot written (at most `capacity`, which must not exceed the window). `done`
/// (`[n]` uint32 with `n ≥ B·Hq·L`, zero) is the buffers' companion: the kernel counts finished
/// chunks in it and leaves it zero. With `scores.sinks` (`[Hq]`), each head's sink logit joins its
/// softmax (as `fast::scaled_dot_product_attention_with_sinks` takes them); with `scores.softcap`,
/// each scaled score is soft-capped first (as `models::softcapped_attention`). Returns
/// `[attention ([B, L, Hq, D]: queries first, as the kernel writes it), keys', values', done']`.
///
/// The buffers are the caller's alone ([`InPlace::Owned`]): `keys'`, `values'` and `done'` are
/// the same buffers, updated in place even while work queued earlier still reads them, and any
/// other array over them sees the new positions (a buffer that is not row-contiguous is copied
/// first). `None` where it does not serve (not MLX's CUDA backend, training, other shapes or
/// types, a head size not a multiple of 32 or above 256, a capacity above [`MAX_CAPACITY`], new
/// positions past the buffers' end).
fn attend_rows(
    heads: &StepHeads,
    (keys, values, done): (&Array, &Array, &Array),
    position: &Offset,
    ring: Option<Ring>,
    scale: f32,
    scores: Scores,
) -> Result<Option<[Array; 4]>> {
    let sinks = scores.sinks;
    let Some(([batch, hq, hkv, d], queries, dtype)) = heads.dims() else { return Ok(None) };
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
        && done.ndim() == 1
        && done.shape()[0] >= batch * hq * queries
        && done.dtype() == Dtype::Uint32
        && sinks.is_none_or(|s| s.shape() == [hq] && !s.is_tracer())
        && scores.softcap.is_none_or(|cap| cap.is_finite() && cap > 0.0)
        && match (position, ring) {
            (Offset::Uniform(p), None) => p + queries as usize <= cs[2] as usize,
            (Offset::Uniform(p), Some(r)) => {
                queries == 1
                    && *p < i32::MAX as usize
                    && r.keep < r.window
                    && r.window <= i32::MAX as usize
                    && cs[2] as usize <= r.window
                    && r.slot(*p) < cs[2] as usize
            }
            (Offset::PerRow(a), None) => queries == 1 && a.dtype() == Dtype::Int32 && a.size() == batch as usize,
            (Offset::PerRow(_), Some(_)) => false,
        };
    if !serves {
        return Ok(None);
    }
    let (stacked, norm, eps, rope_scale, qk_factor) = match heads {
        StepHeads::Ready { .. } => (false, false, 0.0, 0.0, 1.0),
        StepHeads::Stacked { norms, rotation, .. } => {
            (true, norms.is_some(), norms.as_ref().map_or(0.0, |n| n.eps), rotation.scale, rotation.factor)
        }
    };
    let s = Shape {
        dtype,
        batch,
        queries,
        counters: done.shape()[0],
        heads: hq,
        kv_heads: hkv,
        head_dim: d,
        capacity: cs[2],
        window: ring.map_or(0, |r| r.window as i32),
        keep: ring.map_or(0, |r| r.keep as i32),
        per_row: matches!(position, Offset::PerRow(_)),
        stacked,
        norm,
        sinks: sinks.is_some(),
        softcap: scores.softcap.map_or(0, f32::to_bits),
        qk_factor: qk_factor.to_bits(),
        scale: scale.to_bits(),
        eps: f32::to_bits(eps),
        rope_scale: f32::to_bits(rope_scale),
    };
    if s.shared_bytes() > SHARED_LIMIT {
        // Many positions of a long cache's chunk with wide float32 heads.
        return Ok(None);
    }
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
    let sinks = match sinks {
        Some(s) if s.dtype() == dtype => s.clone(),
        Some(s) => s.astype(dtype)?,
        None => a0.clone(),
    };
    let inputs = [a0, a1, a2, a3, keys.clone(), values.clone(), done.clone(), rows, sinks];
    let out = launch_for(s)?.call_with(&inputs, &[KernelArg::I32(at)])?;
    let [keys, values, done, attention, _partial, _stats]: [Array; 6] = out.try_into().expect("six outputs");
    Ok(Some([attention, keys, values, done]))
}

/// [`standard_rows`] with the attention heads first, `[B, Hq, L, D]` (for the tests).
#[cfg(test)]
pub fn standard_cache_attention(
    heads: &StepHeads,
    cache: &mut StandardCache,
    scale: f32,
    scores: Scores,
) -> crate::Result<Option<Array>> {
    let Some(attention) = standard_rows(heads, cache, scale, scores)? else { return Ok(None) };
    Ok(Some(heads_first(&attention)?))
}

/// [`attend_rows`] over an unbounded cache: its buffers grown to hold the new positions first,
/// updated in place, and its offset advanced; the attention `[B, L, Hq, D]`. `None` (the cache as
/// it was, but for buffers grown) where the kernel does not serve.
fn standard_rows(
    heads: &StepHeads,
    cache: &mut StandardCache,
    scale: f32,
    scores: Scores,
) -> crate::Result<Option<Array>> {
    let Some(([batch, hq, hkv, d], queries, dtype)) = heads.dims() else { return Ok(None) };
    if !on_cuda() {
        return Ok(None);
    }
    cache.reserve_for([batch, hkv, queries, d], dtype)?;
    let buffers = [&mut cache.keys, &mut cache.values, &mut cache.done];
    let attention = attend_buffers(heads, buffers, batch * hq, (cache.offset, None), scale, scores)?;
    if attention.is_some() {
        cache.offset += queries as usize;
    }
    Ok(attention)
}

/// [`rotating_rows`] with the attention heads first, `[B, Hq, 1, D]` (for the tests).
#[cfg(test)]
pub fn rotating_cache_attention(
    heads: &StepHeads,
    cache: &mut RotatingCache,
    scale: f32,
    scores: Scores,
) -> crate::Result<Option<Array>> {
    let Some(attention) = rotating_rows(heads, cache, scale, scores)? else { return Ok(None) };
    Ok(Some(heads_first(&attention)?))
}

/// [`attend_rows`] over a rotating cache (one position a sequence): its buffers made ready to
/// take the new position in its ring slot first ([`RotatingCache::prepare_write`]), updated in
/// place, and its offset advanced; the attention `[B, 1, Hq, D]`. `None` (the cache as it was, but
/// for buffers made ready) where the kernel does not serve.
fn rotating_rows(
    heads: &StepHeads,
    cache: &mut RotatingCache,
    scale: f32,
    scores: Scores,
) -> crate::Result<Option<Array>> {
    let Some(([batch, hq, hkv, d], 1, dtype)) = heads.dims() else { return Ok(None) };
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
    let attention = attend_buffers(heads, buffers, batch * hq, (cache.offset, ring), scale, scores)?;
    if attention.is_some() {
        cache.advance();
    }
    Ok(attention)
}

/// [`attend_rows`] at `position` (in `ring`, if one) over a cache's buffers `[keys, values,
/// done]` (the chunk counts made first for `counts` query heads and up to [`MAX_QUERIES`]
/// positions each, so that steps and verification passes share them), lent to the kernel and
/// given back: updated in place where it served, as they were where it did not. The attention
/// as the kernel writes it: `[B, L, Hq, D]`.
fn attend_buffers(
    heads: &StepHeads,
    [keys, values, done]: [&mut Option<Array>; 3],
    counts: i32,
    (position, ring): (usize, Option<Ring>),
    scale: f32,
    scores: Scores,
) -> crate::Result<Option<Array>> {
    let counts = counts * MAX_QUERIES;
    if done.as_ref().is_none_or(|a| a.shape() != [counts]) {
        *done = Some(ops::zeros(&[counts], Dtype::Uint32)?);
    }
    let lent = [keys.take(), values.take(), done.take()];
    let [k, v, c] = lent.map(|a| a.expect("allocated by the caller"));
    match attend_rows(heads, (&k, &v, &c), &Offset::Uniform(position), ring, scale, scores) {
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

/// The new positions' attention over `cache` (`[B, Hq, L, D]`): an unbounded cache's
/// ([`standard_rows`]) or a rotating one's ([`rotating_rows`]); `None` for a batch's cache (or
/// where the kernel does not serve).
pub fn kv_cache_attention(
    heads: &StepHeads,
    cache: &mut KvCache,
    scale: f32,
    scores: Scores,
) -> crate::Result<Option<Array>> {
    kv_cache_rows(heads, cache, scale, scores)?.map(|a| heads_first(&a)).transpose().map_err(Into::into)
}

/// [`kv_cache_attention`] with the heads merged: `[B·L, Hq·D]`, the rows the output projection
/// takes (a reshape of what the kernel writes, where the heads-first form would be a transpose).
pub fn merged_cache_attention(
    heads: &StepHeads,
    cache: &mut KvCache,
    scale: f32,
    scores: Scores,
) -> crate::Result<Option<Array>> {
    let Some(attention) = kv_cache_rows(heads, cache, scale, scores)? else { return Ok(None) };
    let &[b, l, hq, d] = attention.shape() else { unreachable!("the kernel's output is 4-D") };
    Ok(Some(attention.reshape(&[b * l, hq * d])?))
}

/// [`kv_cache_attention`] as the kernel writes it: `[B, L, Hq, D]`.
fn kv_cache_rows(heads: &StepHeads, cache: &mut KvCache, scale: f32, scores: Scores) -> crate::Result<Option<Array>> {
    match cache {
        KvCache::Standard(c) => standard_rows(heads, c, scale, scores),
        KvCache::Rotating(c) => rotating_rows(heads, c, scale, scores),
        KvCache::Batch(_) | KvCache::Quantized(_) => Ok(None),
    }
}

/// The source of the kernel for `s`.
fn source(s: &Shape) -> String {
    let t = cuda_type(s.dtype);
    format!(
        "{CUDA_TYPES}{OVERLAP}{HEAD_MATH}typedef {t} T;\nstruct alignas(4 * sizeof(T)) Vec4 {{ T v[4]; }};\n\
         constexpr int D = {};\nconstexpr int L = {};\nconstexpr int HQ = {};\nconstexpr int HKV = {};\n\
         constexpr bool PER_ROW = {};\nconstexpr bool STACKED = {};\nconstexpr bool NORM = {};\n\
         constexpr bool SINKS = {};\nconstexpr bool SCALED = {};\nconstexpr float QK_FACTOR = {:e}f;\n\
         constexpr bool CAPPED = {};\nconstexpr float SOFTCAP = {:e}f;\n\
         constexpr int WINDOW = {};\nconstexpr int KEEP = {};\nconstexpr int CHUNK = {};\nconstexpr int NT = {THREADS};\nconstexpr int BATCH = 8;\n\
         constexpr int STAGE_BYTES = {STAGE_BYTES};\n{STAGING}\
         extern \"C\" __global__ void __launch_bounds__({THREADS}) rmlx_decode_attention(const T* a0, \
         const T* a1, const T* a2, const float* divisors, T* keys, T* values, unsigned* done, const int* pos, \
         const T* sinks, int position, T* out, float* partial, float* stats, int capacity, float scale, float eps, float rope_scale) \
         {{\n{SOURCE}}}\n",
        s.head_dim,
        s.queries,
        s.heads,
        s.kv_heads,
        s.per_row,
        s.stacked,
        s.norm,
        s.sinks,
        s.qk_factor != 1f32.to_bits(),
        f32::from_bits(s.qk_factor),
        s.softcap != 0,
        if s.softcap != 0 { f32::from_bits(s.softcap) } else { 1.0 },
        s.window,
        s.keep,
        s.chunk(),
    )
}

/// The launch over `[a0, a1, a2, divisors, keys, values, done, positions, sinks]` (see [`SOURCE`]:
/// positions per row, or any array when one position, the call's value, serves every row; any
/// array for sinks without them) for
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
        grid: [s.heads as u32, batch * s.queries as u32, chunks as u32],
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
            Input(8),
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
        (vec![s.counters], Dtype::Uint32),
        (vec![s.batch, s.queries, s.heads, s.head_dim], s.dtype),
        (vec![s.batch * s.heads * s.queries, chunks, s.head_dim], Dtype::Float32),
        (vec![s.batch * s.heads * s.queries, chunks, 2], Dtype::Float32),
    ];
    let in_place = [(0, 4), (1, 5), (2, 6)];
    CudaLaunch::updating("rmlx_decode_attention", &[node], &outputs, &in_place, InPlace::Owned)
}
