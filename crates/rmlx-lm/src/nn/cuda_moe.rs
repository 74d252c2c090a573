//! A mixture-of-experts feed-forward of a decoding step as one launch of rmlx's kernels (MLX's
//! CUDA backend): `h + Σₖ wₖ · downₑₖ(act(gateₑₖ(n(h)), upₑₖ(n(h))))` for a few rows `h`, `act`
//! SwiGLU or gpt-oss's clamped SwiGLU, each projection with a bias per expert where the model has
//! them.
//!
//! MLX composes a routed feed-forward from about fifteen operations (softmax, argpartition,
//! slices, gathers, three gathered quantised products, the activation, the weighting and the sum),
//! each a node of its graph with a few microseconds of host work, and none of them a launch a
//! captured step can take ([`super::CapturedSteps`]). Here it is four kernels in one node, given the
//! router's logits (a fused product of its own):
//! 1. *route*: one block a row: the softmax over the `E` logits in float32 (rounded to the
//!    activations' type, as MLX's softmax returns it), the `k` largest (ties to the lower expert),
//!    renormalised to sum to one where the model says so;
//! 2. *gate and up*: one row product a (row, chosen expert), the norm folded in, the biases and
//!    the activation fused (`cuda_qmv`'s float form over the expert's matrices, found from the
//!    index the route wrote);
//! 3. *down*: one row product a (row, chosen expert), its bias added;
//! 4. *combine*: each row's `k` outputs weighted, summed and added to `h`, rounded where MLX's
//!    operations round.
//!
//! Each step rounds as the composed operations do, but sums in another order: results agree
//! within the activations' precision, not bit for bit (`src/tests/cuda_moe.rs`).

use super::cuda_fast::{cuda_type, kernel_cache, launch_once, on_cuda, Launches, CUDA_TYPES};
use super::cuda_qmv::{row_product, RowEpilogue, RowProduct, MAX_ROWS};
use super::{training, ExpertActivation};
use crate::weights::Weight;
use crate::Result;
use rmlx::cuda::{self, CudaLaunch, KernelArg, KernelNode, OVERLAP};
use rmlx::quantization::QuantMode;
use rmlx::{Array, Dtype};
use std::sync::{LazyLock, Mutex};

/// The most experts the route kernel chooses from, and the most it chooses.
const MAX_EXPERTS: i32 = 4096;
const MAX_TOP_K: i32 = 64;

/// Threads of the route and combine kernels' blocks.
const THREADS: i32 = 256;

/// A block's experts as the kernels read them: stacked `[E, out, in]` matrices of a gated
/// feed-forward (dense of the activations' type, or affine-quantised with 4 or 8 bits), `top_k`
/// chosen per row.
pub struct Experts<'a> {
    pub gate: &'a Weight,
    pub up: &'a Weight,
    pub down: &'a Weight,
    /// Biases `[E, out]` of gate, up and down (all three or none).
    pub biases: Option<[&'a Array; 3]>,
    pub activation: ExpertActivation,
    pub top_k: i32,
    /// The chosen experts' probabilities renormalised to sum to one.
    pub norm_topk_prob: bool,
}

/// What an instance is specialised for.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Shape {
    dtype: Dtype,
    rows: i32,
    hidden: i32,
    width: i32,
    experts: i32,
    top_k: i32,
    /// 0: dense.
    bits: i32,
    group_size: i32,
    eps: u32,
    norm_topk_prob: bool,
    biased: bool,
    /// The clamped SwiGLU's slope and clamp as float bits; `None`: SwiGLU.
    clamp: Option<(u32, u32)>,
}

/// `h + moe(n(h))` for `h: [rows, hidden]` (at most [`MAX_ROWS`] rows) and `n` the RMSNorm of
/// weight `norm.0` and epsilon `norm.1`, as one node of MLX's graph (see the module docs), with the
/// router's logits of `n(h)` (`[rows, E]`) from `router`, called only where the kernels serve.
/// `Ok(None)` where they do not (not MLX's CUDA backend, training or a transform, more rows, other
/// types or layouts): the caller composes the feed-forward.
pub fn experts_residual(
    h: &Array,
    norm: (&Array, f32),
    e: &Experts,
    router: impl FnOnce() -> Result<Array>,
) -> Result<Option<Array>> {
    let Some(shape) = serves(h, norm, e) else {
        return Ok(None);
    };
    let logits = router()?;
    if logits.shape() != [shape.rows, shape.experts] || logits.dtype() != shape.dtype || logits.is_tracer() {
        return Ok(None);
    }
    let mut inputs = vec![h.clone(), logits, norm.0.clone()];
    for w in [e.gate, e.up, e.down] {
        match w {
            Weight::Dense(a) => inputs.push(a.clone()),
            Weight::Quantized(q) => {
                inputs.extend([q.weight.clone(), q.scales.clone()]);
                inputs.extend(q.biases.clone());
            }
        }
    }
    inputs.extend(e.biases.iter().flatten().map(|&b| b.clone()));
    static LAUNCHES: Launches<Shape> = LazyLock::new(Mutex::default);
    let launch = launch_once(&LAUNCHES, "rmlx_moe", &shape, || make_launch(&shape))?;
    Ok(Some(launch.call(&inputs)?.swap_remove(4)))
}

/// The instance for `h` and these experts, if the kernels serve them.
fn serves(h: &Array, (norm, eps): (&Array, f32), e: &Experts) -> Option<Shape> {
    let dtype = h.dtype();
    let &[rows, hidden] = h.shape() else { return None };
    let experts = e.gate.shape().first().copied()?;
    let fits = on_cuda()
        && !training()
        && !h.is_tracer()
        && matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        && (1..=MAX_ROWS).contains(&rows)
        && (1..=MAX_EXPERTS).contains(&experts)
        && (1..=MAX_TOP_K.min(experts)).contains(&e.top_k)
        && norm.dtype() == dtype
        && norm.shape() == [hidden];
    if !fits {
        return None;
    }
    let (bits, group_size, width) = expert_layout(e.gate, dtype, experts, hidden)?;
    let same = expert_layout(e.up, dtype, experts, hidden)? == (bits, group_size, width)
        && expert_layout(e.down, dtype, experts, width)? == (bits, group_size, hidden);
    let biases_fit = e.biases.is_none_or(|b| {
        let outputs = [width, width, hidden];
        b.iter().zip(outputs).all(|(b, out)| b.dtype() == dtype && b.shape() == [experts, out] && !b.is_tracer())
    });
    let clamp = match e.activation {
        ExpertActivation::Silu => None,
        ExpertActivation::ClampedSwiglu { alpha, limit } => Some((alpha.to_bits(), limit.to_bits())),
    };
    (same && biases_fit).then_some(Shape {
        dtype,
        rows,
        hidden,
        width,
        experts,
        top_k: e.top_k,
        bits,
        group_size,
        eps: eps.to_bits(),
        norm_topk_prob: e.norm_topk_prob,
        biased: e.biases.is_some(),
        clamp,
    })
}

/// `(bits, group size, outputs)` of stacked experts `[experts, out, in]` read against activations
/// of `dtype` with `input` features (0 bits: dense), if the row product reads them.
fn expert_layout(w: &Weight, dtype: Dtype, experts: i32, input: i32) -> Option<(i32, i32, i32)> {
    match w {
        Weight::Dense(a) => {
            let s = a.shape();
            let fits = a.dtype() == dtype && s.len() == 3 && s[0] == experts && s[2] == input;
            (fits && input % (16 / dtype.size() as i32) == 0).then_some((0, 32, s[1]))
        }
        Weight::Quantized(q) => {
            let s = q.weight.shape();
            let per_word = 32 / q.bits.max(1);
            let groups = input / q.group_size.max(1);
            let fits = q.mode == QuantMode::Affine
                && matches!(q.bits, 4 | 8)
                && matches!(q.group_size, 32 | 64 | 128)
                && q.weight.dtype() == Dtype::Uint32
                && s.len() == 3
                && s[0] == experts
                && input % q.group_size == 0
                && s[2] * per_word == input
                && q.scales.dtype() == dtype
                && q.scales.shape() == [experts, s[1], groups]
                && q.biases.as_ref().is_some_and(|b| b.dtype() == dtype && b.shape() == q.scales.shape());
            fits.then_some((q.bits, q.group_size, s[1]))
        }
    }
}

/// Block-wide reductions of a 256-thread block through `red` (8 floats of shared memory); every
/// thread gets the result.
const REDUCE: &str = r#"
__device__ __forceinline__ float rmlx_block_max(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    }
    if ((threadIdx.x & 31) == 0) {
        red[threadIdx.x >> 5] = v;
    }
    __syncthreads();
    float r = red[0];
    for (int w = 1; w < 8; ++w) {
        r = fmaxf(r, red[w]);
    }
    __syncthreads();
    return r;
}
__device__ __forceinline__ float rmlx_block_sum(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffff, v, o);
    }
    if ((threadIdx.x & 31) == 0) {
        red[threadIdx.x >> 5] = v;
    }
    __syncthreads();
    float r = 0.0f;
    for (int w = 0; w < 8; ++w) {
        r += red[w];
    }
    __syncthreads();
    return r;
}
"#;

/// The route kernel (one block of 256 threads a row): MLX's softmax (float32, `__expf`, times
/// the inverse of the sum) rounded to `T`, then `TOPK` rounds of a block-wide arg-max (ties to the
/// lower expert), the chosen experts and their weights written in the order chosen.
const ROUTE: &str = r#"
extern "C" __global__ void __launch_bounds__(256) rmlx_moe_route(const T* logits, int* chosen, float* weights) {
    __shared__ float p[E];
    __shared__ float red[8];
    __shared__ float best_v[8];
    __shared__ int best_i[8];
    __shared__ float picked[TOPK];
    __shared__ int picked_i[TOPK];
    rmlx_wait_previous();
    rmlx_release_next();
    const int t = threadIdx.x;
    const T* l = logits + static_cast<long long>(blockIdx.x) * E;
    float mx = -3.402823466e38f;
    for (int i = t; i < E; i += 256) {
        const float v = static_cast<float>(l[i]);
        p[i] = v;
        mx = fmaxf(mx, v);
    }
    mx = rmlx_block_max(mx, red);
    float sum = 0.0f;
    for (int i = t; i < E; i += 256) {
        const float v = __expf(p[i] - mx);
        p[i] = v;
        sum += v;
    }
    const float inv = 1.0f / rmlx_block_sum(sum, red);
    for (int i = t; i < E; i += 256) {
        p[i] = static_cast<float>(static_cast<T>(p[i] * inv));
    }
    __syncthreads();
    for (int j = 0; j < TOPK; ++j) {
        float bv = -1.0f;
        int bi = E;
        for (int i = t; i < E; i += 256) {
            if (p[i] > bv) {
                bv = p[i];
                bi = i;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffff, bv, o);
            const int oi = __shfl_xor_sync(0xffffffff, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if ((t & 31) == 0) {
            best_v[t >> 5] = bv;
            best_i[t >> 5] = bi;
        }
        __syncthreads();
        if (t == 0) {
            for (int w = 1; w < 8; ++w) {
                if (best_v[w] > best_v[0] || (best_v[w] == best_v[0] && best_i[w] < best_i[0])) {
                    best_v[0] = best_v[w];
                    best_i[0] = best_i[w];
                }
            }
            // Logits that are not numbers leave nothing to choose: expert 0 stands in.
            const int i = best_i[0] < E ? best_i[0] : 0;
            picked[j] = best_v[0] >= 0.0f ? best_v[0] : 0.0f;
            picked_i[j] = i;
            p[i] = -2.0f;
        }
        __syncthreads();
    }
    if (t == 0) {
        float total = 0.0f;
        for (int j = 0; j < TOPK; ++j) {
            total += picked[j];
        }
        const float s = static_cast<float>(static_cast<T>(total));
        for (int j = 0; j < TOPK; ++j) {
            const long long o = static_cast<long long>(blockIdx.x) * TOPK + j;
            chosen[o] = picked_i[j];
            weights[o] = RENORM ? static_cast<float>(static_cast<T>(picked[j] / s)) : picked[j];
        }
    }
}
"#;

/// An expert's product: `cuda_qmv`'s row product (its body) over the matrices (and bias rows) of
/// expert `chosen[slot]` for slot `blockIdx.y`, reading row `slot / XDIV` of `xs` (the token's row
/// for gate and up, `XDIV = k`; the slot's own activation for down, 1) and writing row `slot` of
/// `ys`.
const EXPERT: &str = r#"
extern "C" __global__ void __launch_bounds__(128) rmlx_moe_expert(const T* xs, const unsigned* w_all,
        const T* scales_all, const T* biases_all, const unsigned* w2_all, const T* scales2_all,
        const T* biases2_all, const T* nw, const T* bias_all, const T* bias2_all, const int* chosen, T* ys) {
    // The chosen expert is the route kernel's output.
    rmlx_wait_previous();
    const int slot = blockIdx.y;
    const long long expert = chosen[slot];
    constexpr long long WORDS = BITS == 0 ? static_cast<long long>(N) * K * static_cast<long long>(sizeof(T)) / 4
                                          : static_cast<long long>(N) * K * BITS / 32;
    constexpr long long GROUPS_ALL = BITS == 0 ? 0 : static_cast<long long>(N) * (K / GS);
    const T* x = xs + static_cast<long long>(slot / XDIV) * K;
    const unsigned* w = w_all + expert * WORDS;
    const unsigned* w2 = w2_all + expert * WORDS;
    const T* scales = scales_all + expert * GROUPS_ALL;
    const T* biases = biases_all + expert * GROUPS_ALL;
    const T* scales2 = scales2_all + expert * GROUPS_ALL;
    const T* biases2 = biases2_all + expert * GROUPS_ALL;
    const T* res = x;
    const T* bias = BIAS ? bias_all + expert * N : x;
    const T* bias2 = BIAS ? bias2_all + expert * N : x;
    T* y = ys + static_cast<long long>(slot) * N;
    const int rows = 1;
    {
BODY
    }
}
"#;

/// The combine kernel: `out[m, j] = h[m, j] + Σᵢ wᵢ · ys[m·k + i, j]`, each product rounded to
/// `T`, the sum in float32 rounded to `T`, then the residual (MLX's multiply, sum and add).
const COMBINE: &str = r#"
extern "C" __global__ void __launch_bounds__(256) rmlx_moe_combine(const T* h, const T* ys, const float* weights,
        T* out) {
    rmlx_wait_previous();
    rmlx_release_next();
    const int j = blockIdx.x * 256 + threadIdx.x;
    const int m = blockIdx.y;
    if (j >= H) {
        return;
    }
    float acc = 0.0f;
    for (int i = 0; i < TOPK; ++i) {
        const long long slot = static_cast<long long>(m) * TOPK + i;
        acc += static_cast<float>(static_cast<T>(static_cast<float>(ys[slot * H + j]) * weights[slot]));
    }
    const long long o = static_cast<long long>(m) * H + j;
    out[o] = static_cast<T>(static_cast<float>(h[o]) + static_cast<float>(static_cast<T>(acc)));
}
"#;

/// The launch of instance `s`: route, gate and up, down, combine (see the module docs). Inputs:
/// `h`, the logits, the norm's weight, then each matrix's packed weight, scales and biases (a
/// dense one's weight alone) for gate, up and down, then (biased) the three biases. Outputs: the chosen experts `[rows·k]`
/// (int32), their weights `[rows·k]` (float32), the activations `[rows·k, width]`, the experts'
/// outputs `[rows·k, hidden]` and the result `[rows, hidden]`.
fn make_launch(s: &Shape) -> rmlx::Result<CudaLaunch> {
    use KernelArg::{Input, Output};
    let [route, gate_up, down, combine] = sources(s);
    let compile = |(name, source): (&str, String)| {
        Ok::<_, rmlx::Error>(cuda::compile(name, &source, Some(&kernel_cache()))?.overlapping())
    };
    let slots = (s.rows * s.top_k) as u32;
    let per_matrix = if s.bits == 0 { 1 } else { 3 };
    let matrix = |i: u32| -> [KernelArg; 3] {
        let base = 3 + i * per_matrix;
        match per_matrix {
            1 => [Input(base), Input(0), Input(0)],
            _ => [Input(base), Input(base + 1), Input(base + 2)],
        }
    };
    // The biases after the matrices; unbiased, `xs` stands in.
    let bias = |i: u32, xs: KernelArg| if s.biased { Input(3 + 3 * per_matrix + i) } else { xs };
    let mut gate_up_args = vec![Input(0)];
    gate_up_args.extend(matrix(0));
    gate_up_args.extend(matrix(1));
    gate_up_args.extend([Input(2), bias(0, Input(0)), bias(1, Input(0)), Output(0), Output(2)]);
    let mut down_args = vec![Output(2)];
    down_args.extend(matrix(2));
    down_args.extend([Output(2), Output(2), Output(2), Output(2), bias(2, Output(2)), Output(2), Output(0), Output(3)]);
    let [gate_up_blocks, down_blocks] = expert_blocks(s);
    let node = |function, grid: [u32; 3], threads: i32, args| KernelNode {
        function,
        grid,
        block: [threads as u32, 1, 1],
        shared_bytes: 0,
        args,
    };
    let nodes = [
        node(compile(route)?, [s.rows as u32, 1, 1], THREADS, vec![Input(1), Output(0), Output(1)]),
        node(compile(gate_up)?, [gate_up_blocks as u32, slots, 1], 128, gate_up_args),
        node(compile(down)?, [down_blocks as u32, slots, 1], 128, down_args),
        node(
            compile(combine)?,
            [((s.hidden + THREADS - 1) / THREADS) as u32, s.rows as u32, 1],
            THREADS,
            vec![Input(0), Output(3), Output(1), Output(4)],
        ),
    ];
    let slots = slots as i32;
    let outputs = [
        (vec![slots], Dtype::Int32),
        (vec![slots], Dtype::Float32),
        (vec![slots, s.width], s.dtype),
        (vec![slots, s.hidden], s.dtype),
        (vec![s.rows, s.hidden], s.dtype),
    ];
    CudaLaunch::new("rmlx_moe", &nodes, &outputs)
}

/// The row products of gate and up (the norm folded in, the activation) and of down.
fn expert_products(s: &Shape) -> [RowProduct; 2] {
    let layout = (s.bits, s.group_size);
    let activation = match s.clamp {
        None => RowEpilogue::SwiGlu,
        Some((alpha, limit)) => {
            RowEpilogue::ClampedSwiGlu { alpha: f32::from_bits(alpha), limit: f32::from_bits(limit) }
        }
    };
    let eps = Some(f32::from_bits(s.eps));
    [
        row_product(s.dtype, (s.hidden, s.width), layout, eps, activation, s.biased),
        row_product(s.dtype, (s.width, s.hidden), layout, None, RowEpilogue::Product, s.biased),
    ]
}

/// The blocks of the gate/up and down kernels' grids' first axis.
fn expert_blocks(s: &Shape) -> [i32; 2] {
    expert_products(s).map(|p| p.blocks)
}

/// The four kernels' names and complete sources: route, gate and up, down, combine.
fn sources(s: &Shape) -> [(&'static str, String); 4] {
    let t = cuda_type(s.dtype);
    let small = |body: &str| {
        format!(
            "{CUDA_TYPES}{OVERLAP}{REDUCE}typedef {t} T;\nconstexpr int E = {};\nconstexpr int TOPK = {};\n\
             constexpr int H = {};\nconstexpr bool RENORM = {};\n{body}",
            s.experts, s.top_k, s.hidden, s.norm_topk_prob
        )
    };
    let [gate_up, down] = expert_products(s);
    let expert = |p: RowProduct, xdiv: i32| {
        format!("{}constexpr int XDIV = {xdiv};\n{}", p.prelude, EXPERT.replace("BODY", p.body))
    };
    [
        ("rmlx_moe_route", small(ROUTE)),
        ("rmlx_moe_expert", expert(gate_up, s.top_k)),
        ("rmlx_moe_expert", expert(down, 1)),
        ("rmlx_moe_combine", small(COMBINE)),
    ]
}
