//! A decoding step's attention over an unbounded KV cache as one node of MLX's graph: the new
//! keys and values written into the cache's buffers in place, and one query a sequence attending
//! over the positions written so far.
//!
//! The composed step takes two slice updates, two slices of the buffers and MLX's attention (five
//! to seven nodes with their copies); a decoding step of a small model is bound by the host work
//! MLX does per node. Here two kernels (flash-decoding): one block per (query head, sequence,
//! chunk of 32 or more positions) scores its chunk, keeps the chunk's maximum, sum of exponentials
//! and weighted values (float32); a second kernel merges the chunks of each head. The block
//! holding the new position reads the new key and value from the step's inputs and one block per
//! KV head writes them into the cache, so nothing waits for the write.

use super::cuda_fast::{cuda_type, kernel_cache, launch_once, on_cuda, Launches, CUDA_TYPES};
use super::training;
use crate::cache::Offset;
use rmlx::cuda::{self, CudaLaunch, InPlace, KernelArg, KernelNode};
use rmlx::{Array, Dtype, Result};
use std::sync::{Arc, LazyLock, Mutex};

/// The largest cache the kernels take, in positions (a block's chunk, and the scores it keeps in
/// shared memory, grow with the cache: 8,192 positions, 32 KB, at this size).
pub const MAX_CAPACITY: usize = 1 << 20;

/// Threads of a block of the first kernel.
const THREADS: u32 = 128;

/// Block `(hq, b, c)`: query head `hq` of sequence `b` over positions `[c·CHUNK, (c+1)·CHUNK)` of
/// the valid ones; the block holding the new position reads it from `k`, `v` (and, for the first
/// query head of each KV head, writes it into the cache).
const PARTIAL: &str = r#"
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
    const int first = c * CHUNK;
    if (first > p) {
        return;
    }
    const int n = min(CHUNK, p + 1 - first);
    const int fresh = p - first;  // the new position within the chunk, when below n
    const long long kv_row = static_cast<long long>(b) * HKV + hk;
    const T* knew = k + kv_row * D;
    const T* vnew = v + kv_row * D;
    if (fresh < n && hq % (HQ / HKV) == 0) {
        for (int i = t; i < D; i += NT) {
            keys[(kv_row * capacity + p) * D + i] = knew[i];
            values[(kv_row * capacity + p) * D + i] = vnew[i];
        }
    }
    const T* kbase = keys + (kv_row * capacity + first) * D;
    const T* vbase = values + (kv_row * capacity + first) * D;
    const T* qrow = q + (static_cast<long long>(b) * HQ + hq) * D;
    __shared__ float score[CHUNK];
    __shared__ float part[WARPS];
    __shared__ float sacc[RG][D];
    float qv[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        qv[i] = static_cast<float>(qrow[lane + 32 * i]) * scale;
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
    const long long row = (static_cast<long long>(b) * HQ + hq) * ((capacity + CHUNK - 1) / CHUNK) + c;
    for (int e = t; e < D; e += NT) {
        float total = 0.0f;
#pragma unroll
        for (int i = 0; i < RG; ++i) {
            total += sacc[i][e];
        }
        partial[row * D + e] = total;
    }
    if (t == 0) {
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            sum += part[w];
        }
        stats[row * 2] = m;
        stats[row * 2 + 1] = sum;
    }
"#;

/// Block `(hq, b)`, thread `e`: element `e` of query head `hq`'s attention for sequence `b`, the
/// chunks' weighted values merged.
const MERGE: &str = r#"
    const int hq = blockIdx.x;
    const int b = blockIdx.y;
    const int e = threadIdx.x;
    const int chunks = ((PER_ROW ? pos[b] : position) + CHUNK) / CHUNK;
    const long long row = (static_cast<long long>(b) * HQ + hq) * ((capacity + CHUNK - 1) / CHUNK);
    // One pass with a running maximum; BATCH chunks loaded before any is used.
    float top = __int_as_float(0xff800000);
    float total = 0.0f;
    float o = 0.0f;
    for (int c0 = 0; c0 < chunks; c0 += BATCH) {
        float m[BATCH], l[BATCH], x[BATCH];
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const bool in = c0 + u < chunks;
            m[u] = in ? stats[(row + c0 + u) * 2] : __int_as_float(0xff800000);
            l[u] = in ? stats[(row + c0 + u) * 2 + 1] : 0.0f;
            x[u] = in ? partial[(row + c0 + u) * D + e] : 0.0f;
        }
        float next = top;
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            next = fmaxf(next, m[u]);
        }
        const float rescale = expf(top - next);
        total *= rescale;
        o *= rescale;
#pragma unroll
        for (int u = 0; u < BATCH; ++u) {
            const float w = c0 + u < chunks ? expf(m[u] - next) : 0.0f;
            total = fmaf(l[u], w, total);
            o = fmaf(x[u], w, o);
        }
        top = next;
    }
    out[(static_cast<long long>(b) * HQ + hq) * D + e] = static_cast<T>(o / total);
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
    per_row: bool,
    scale: u32,
}

impl Shape {
    /// Positions a block takes: at most 128 chunks a head, of at least 32 positions.
    fn chunk(&self) -> i32 {
        (self.capacity.max(1) as u32).div_ceil(128).next_power_of_two().max(32) as i32
    }
}

/// Writes `k, v` (`[B, Hkv, 1, D]`) into the cache buffers `(keys, values)` (`[B, Hkv, capacity,
/// D]`) at `position` (one for every sequence, or one each: `[B]` int32, each below `capacity`)
/// and attends `q` (`[B, Hq, 1, D]`, `Hq` a multiple of `Hkv`) over the positions up to it,
/// scores scaled by `scale`. Returns `[attention, keys', values']`.
///
/// The buffers are the caller's alone ([`InPlace::Owned`]): `keys'` and `values'` are the same
/// buffers, updated in place even while work queued earlier still reads them, and any other array
/// over them sees the new position (a buffer that is not row-contiguous is copied first). `None`
/// where it does not serve (not MLX's CUDA backend, training, other shapes or types, a head size
/// not a multiple of 32 or above 256, a capacity above [`MAX_CAPACITY`]).
pub fn cache_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    (keys, values): (&Array, &Array),
    position: &Offset,
    scale: f32,
) -> Result<Option<[Array; 3]>> {
    let dtype = q.dtype();
    let (qs, ks, cs) = (q.shape(), k.shape(), keys.shape());
    let serves = on_cuda()
        && !training()
        && !q.is_tracer()
        && matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        && qs.len() == 4
        && ks.len() == 4
        && cs.len() == 4
        && qs[2] == 1
        && ks[2] == 1
        && qs[3] % 32 == 0
        && qs[3] <= 256
        && ks[0] == qs[0]
        && ks[3] == qs[3]
        && ks[1] > 0
        && qs[1] % ks[1] == 0
        && v.shape() == ks
        && cs[0] == ks[0]
        && cs[1] == ks[1]
        && cs[3] == ks[3]
        && cs[2] as usize <= MAX_CAPACITY
        && values.shape() == cs
        && [k, v, keys, values].iter().all(|a| a.dtype() == dtype)
        && match position {
            Offset::Uniform(p) => *p < cs[2] as usize,
            Offset::PerRow(a) => a.dtype() == Dtype::Int32 && a.size() == qs[0] as usize,
        };
    if !serves {
        return Ok(None);
    }
    let s = Shape {
        dtype,
        batch: qs[0],
        heads: qs[1],
        kv_heads: ks[1],
        head_dim: qs[3],
        capacity: cs[2],
        per_row: matches!(position, Offset::PerRow(_)),
        scale: scale.to_bits(),
    };
    let (rows, at) = match position {
        Offset::Uniform(p) => (q.clone(), *p as i32),
        Offset::PerRow(a) => (a.clone(), 0),
    };
    let inputs = [q.clone(), k.clone(), v.clone(), keys.clone(), values.clone(), rows];
    let out = launch_for(s)?.call_with(&inputs, &[KernelArg::I32(at)])?;
    let [keys, values, attention, _partial, _stats]: [Array; 5] = out.try_into().expect("five outputs");
    Ok(Some([attention, keys, values]))
}

/// The source of both kernels for `s`.
fn source(s: &Shape) -> String {
    let t = cuda_type(s.dtype);
    format!(
        "{CUDA_TYPES}typedef {t} T;\nstruct alignas(4 * sizeof(T)) Vec4 {{ T v[4]; }};\n\
         constexpr int D = {};\nconstexpr int HQ = {};\nconstexpr int HKV = {};\n\
         constexpr bool PER_ROW = {};\nconstexpr int CHUNK = {};\nconstexpr int NT = {THREADS};\nconstexpr int BATCH = 8;\n\
         extern \"C\" __global__ void __launch_bounds__({THREADS}) rmlx_cache_partial(const T* q, const T* k, \
         const T* v, T* keys, T* values, const int* pos, int position, float* partial, float* stats, int capacity, \
         float scale) \
         {{\n{PARTIAL}}}\n\
         extern \"C\" __global__ void rmlx_cache_merge(const float* partial, const float* stats, const int* pos, \
         int position, T* out, int capacity) {{\n{MERGE}}}\n",
        s.head_dim,
        s.heads,
        s.kv_heads,
        s.per_row,
        s.chunk(),
    )
}

/// The launch over `[q, k, v, keys, values, positions]` (positions per row, or any array when
/// one position, the call's value, serves every row) for `s`, made once per process: outputs
/// `[keys', values', attention, chunks' weighted values, chunks' maxima and sums]`, the first two
/// the buffers of inputs 3 and 4, updated in place.
fn launch_for(s: Shape) -> Result<Arc<CudaLaunch>> {
    static LAUNCHES: Launches<Shape> = LazyLock::new(Mutex::default);
    launch_once(&LAUNCHES, &s, || make_launch(&s))
}

/// The launch for `s` (its kernels compiled, or read from the cache).
fn make_launch(s: &Shape) -> Result<CudaLaunch> {
    let source = source(s);
    let partial = cuda::compile("rmlx_cache_partial", &source, Some(&kernel_cache()))?;
    let merge = cuda::compile("rmlx_cache_merge", &source, Some(&kernel_cache()))?;
    use KernelArg::{Input, Output, Value, F32, I32};
    let chunk = s.chunk();
    let (batch, capacity, chunks) = (s.batch as u32, I32(s.capacity), (s.capacity + chunk - 1) / chunk);
    let nodes = [
        KernelNode {
            function: partial,
            grid: [s.heads as u32, batch, chunks as u32],
            block: [THREADS, 1, 1],
            shared_bytes: 0,
            args: vec![
                Input(0),
                Input(1),
                Input(2),
                Output(0),
                Output(1),
                Input(5),
                Value(0),
                Output(3),
                Output(4),
                capacity,
                F32(f32::from_bits(s.scale)),
            ],
        },
        KernelNode {
            function: merge,
            grid: [s.heads as u32, batch, 1],
            block: [s.head_dim as u32, 1, 1],
            shared_bytes: 0,
            args: vec![Output(3), Output(4), Input(5), Value(0), Output(2), capacity],
        },
    ];
    let buffer = (vec![s.batch, s.kv_heads, s.capacity, s.head_dim], s.dtype);
    let outputs = [
        buffer.clone(),
        buffer,
        (vec![s.batch, s.heads, 1, s.head_dim], s.dtype),
        (vec![s.batch, s.heads, chunks, s.head_dim], Dtype::Float32),
        (vec![s.batch, s.heads, chunks, 2], Dtype::Float32),
    ];
    CudaLaunch::updating("rmlx_cache_attention", &nodes, &outputs, &[(0, 3), (1, 4)], InPlace::Owned)
}
