//! Greedy sampling of one sequence's logits as one launch of two kernels: the token (the first
//! index of the largest logit), its log-probability and whether every logit is finite.
//!
//! The composed step takes about ten of MLX's operations (a finiteness test and its reduction, a
//! cast, `logsumexp`, a subtraction, `argmax`, a cast, a gather, reshapes), and MLX's CUDA
//! reductions over one row run in a single block: on an H200 its `argmax` over qwen3's 151,936
//! logits takes 17.7 µs and its `logsumexp` 13.3 µs. Here the first kernel's blocks each take a
//! stretch of the row (its maximum, the maximum's first index, the sum of exponentials relative to
//! it, whether all were finite) and the second merges the blocks' results in a fixed order.
//!
//! The token is the argmax of the logits, which the composed step takes of the log-probabilities
//! (`logits − logsumexp`): the same index, but where two logits within a rounding of each other
//! would round to the same log-probability (the composed step then takes the first of them).

use super::cuda_fast::{cuda_type, kernel_cache, launch_once, on_cuda, Launches, CUDA_TYPES};
use super::training;
use rmlx::cuda::{self, CudaLaunch, KernelArg, KernelNode, OVERLAP};
use rmlx::{Array, Dtype, Result};
use std::sync::{LazyLock, Mutex};

/// Threads of a block (also the most blocks of the first kernel: the merge gives each a thread).
const THREADS: u32 = 256;

/// Logits a thread loads before using any, per pass over its block's stretch.
const PER_THREAD: i64 = 8;

/// The combination of two partial results `(maximum, its first index, sum of exponentials
/// relative to the maximum)`, and a block's reduction of its threads' (a fixed order: the same
/// bits every run). Every thread of the block calls `rmlx_block_reduce`; thread 0 gets the result.
const REDUCE: &str = r#"
#define RMLX_INF __int_as_float(0x7f800000)
__device__ __forceinline__ void rmlx_combine(float& m, int& i, float& l, float m2, int i2, float l2) {
    const float top = fmaxf(m, m2);
    float s = 0.0f;
    if (top > -RMLX_INF) {
        s = (m > -RMLX_INF ? l * expf(m - top) : 0.0f) + (m2 > -RMLX_INF ? l2 * expf(m2 - top) : 0.0f);
    }
    i = m > m2 ? i : (m2 > m ? i2 : min(i, i2));
    m = top;
    l = s;
}
__device__ __forceinline__ void rmlx_block_reduce(float& m, int& i, float& l) {
    __shared__ float sm[NT / 32], sl[NT / 32];
    __shared__ int si[NT / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
        const float l2 = __shfl_xor_sync(0xffffffffu, l, o);
        rmlx_combine(m, i, l, m2, i2, l2);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sm[warp] = m;
        si[warp] = i;
        sl[warp] = l;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < NT / 32; ++w) {
            rmlx_combine(m, i, l, sm[w], si[w], sl[w]);
        }
    }
}
"#;

/// Block `b` of the first kernel: logits `b·NT·PER + u·NT + t` (and the same a grid further on),
/// `u < PER`, for thread `t`; its result as four floats `(max, index bits, sum, finite)`.
const PART: &str = r#"
extern "C" __global__ void __launch_bounds__(NT) rmlx_greedy_part(const T* x, float* part) {
    rmlx_wait_previous();
    rmlx_release_next();
    const int t = threadIdx.x;
    float m = -RMLX_INF, l = 0.0f;
    int idx = 0x7fffffff;
    bool finite = true;
    for (long long base = static_cast<long long>(blockIdx.x) * NT * PER; base < V;
         base += static_cast<long long>(gridDim.x) * NT * PER) {
        float v[PER];
#pragma unroll
        for (int u = 0; u < PER; ++u) {
            const long long i = base + u * NT + t;
            v[u] = i < V ? static_cast<float>(x[i]) : -RMLX_INF;
        }
        // A thread's indices only grow: the first of equal maxima is the one kept.
        float top = m;
        int at = idx;
#pragma unroll
        for (int u = 0; u < PER; ++u) {
            const long long i = base + u * NT + t;
            if (i < V) {
                finite = finite && fabsf(v[u]) < RMLX_INF;
                if (v[u] > top) {
                    top = v[u];
                    at = static_cast<int>(i);
                }
            }
        }
        float s = m > -RMLX_INF ? l * expf(m - top) : 0.0f;
#pragma unroll
        for (int u = 0; u < PER; ++u) {
            if (v[u] > -RMLX_INF) {
                s += expf(v[u] - top);
            }
        }
        m = top;
        idx = at;
        l = s;
    }
    finite = __syncthreads_and(finite);
    rmlx_block_reduce(m, idx, l);
    if (t == 0) {
        part[blockIdx.x * 4] = m;
        part[blockIdx.x * 4 + 1] = __int_as_float(idx);
        part[blockIdx.x * 4 + 2] = l;
        part[blockIdx.x * 4 + 3] = finite ? 1.0f : 0.0f;
    }
}
"#;

/// The second kernel, one block: the blocks' results merged; the token, `max − logsumexp` (the
/// token's log-probability) and the finiteness written.
const MERGE: &str = r#"
extern "C" __global__ void __launch_bounds__(NT) rmlx_greedy_merge(const float* part, unsigned* token,
                                                                 float* logprob, unsigned char* finite) {
    rmlx_wait_previous();
    rmlx_release_next();
    const int t = threadIdx.x;
    float m = -RMLX_INF, l = 0.0f;
    int idx = 0x7fffffff;
    bool all = true;
    if (t < BLOCKS) {
        m = __ldcg(part + t * 4);
        idx = __float_as_int(__ldcg(part + t * 4 + 1));
        l = __ldcg(part + t * 4 + 2);
        all = __ldcg(part + t * 4 + 3) != 0.0f;
    }
    all = __syncthreads_and(all);
    rmlx_block_reduce(m, idx, l);
    if (t == 0) {
        token[0] = idx == 0x7fffffff ? 0u : static_cast<unsigned>(idx);
        const float lse = m + logf(l);
        logprob[0] = m - lse;
        finite[0] = all ? 1 : 0;
    }
}
"#;

/// What an instance is specialised for: the logits' dtype and count.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct Shape {
    dtype: Dtype,
    vocab: i64,
}

impl Shape {
    /// Blocks of the first kernel: one per `THREADS · PER_THREAD` logits, at most `THREADS`.
    fn blocks(&self) -> u32 {
        let per_block = THREADS as i64 * PER_THREAD;
        ((self.vocab + per_block - 1) / per_block).clamp(1, THREADS as i64) as u32
    }
}

/// The greedy token of `logits` (`[1, vocab]` or `[vocab]`, float32, bfloat16 or float16) as
/// `[token [1] uint32, log-probability [1] float32, all finite [] bool]`; `None` where the kernels
/// do not serve (not MLX's CUDA backend, training or a transform, another shape or dtype).
pub fn greedy(logits: &Array) -> Result<Option<[Array; 3]>> {
    let vocab = match *logits.shape() {
        [v] | [1, v] if v > 0 => v as i64,
        _ => return Ok(None),
    };
    let dtype = logits.dtype();
    if !on_cuda()
        || training()
        || logits.is_tracer()
        || !matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        || vocab >= i32::MAX as i64
    {
        return Ok(None);
    }
    static LAUNCHES: Launches<Shape> = LazyLock::new(Mutex::default);
    let s = Shape { dtype, vocab };
    let launch = launch_once(&LAUNCHES, "rmlx_greedy", &s, || make_launch(&s))?;
    let out = launch.call(&[logits.reshape(&[vocab as i32])?])?;
    let [token, logprob, finite, _part]: [Array; 4] = out.try_into().expect("four outputs");
    Ok(Some([token, logprob, finite.reshape(&[])?]))
}

/// The launch for `s`: both kernels compiled (or read from the cache) in one source.
fn make_launch(s: &Shape) -> Result<CudaLaunch> {
    let blocks = s.blocks();
    let source = format!(
        "{CUDA_TYPES}{OVERLAP}typedef {} T;\nconstexpr int NT = {THREADS};\nconstexpr int PER = {PER_THREAD};\n\
         constexpr long long V = {};\nconstexpr int BLOCKS = {blocks};\n{REDUCE}{PART}{MERGE}",
        cuda_type(s.dtype),
        s.vocab
    );
    let cache = kernel_cache();
    let part = cuda::compile("rmlx_greedy_part", &source, Some(&cache))?.overlapping();
    let merge = cuda::compile("rmlx_greedy_merge", &source, Some(&cache))?.overlapping();
    use KernelArg::{Input, Output};
    let nodes = [
        KernelNode {
            function: part,
            grid: [blocks, 1, 1],
            block: [THREADS, 1, 1],
            shared_bytes: 0,
            args: vec![Input(0), Output(3)],
        },
        KernelNode {
            function: merge,
            grid: [1, 1, 1],
            block: [THREADS, 1, 1],
            shared_bytes: 0,
            args: vec![Output(3), Output(0), Output(1), Output(2)],
        },
    ];
    let outputs = [
        (vec![1], Dtype::Uint32),
        (vec![1], Dtype::Float32),
        (vec![1], Dtype::Bool),
        (vec![blocks as i32 * 4], Dtype::Float32),
    ];
    CudaLaunch::new("rmlx_greedy", &nodes, &outputs)
}
