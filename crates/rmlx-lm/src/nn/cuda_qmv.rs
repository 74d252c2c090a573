//! rmlx's own matrix-vector product for MLX's CUDA backend: `y = x Wᵀ` for a few rows of `x`
//! (decoding, small batches) and `W` dense or in MLX's affine layout (4 or 8 bits), with what
//! surrounds it in a decoder block fused in ([`fused_matvec`]: an RMSNorm of `x`, a bias, a
//! residual, a gated activation over two matrices).
//!
//! A decoding step of a 4-bit model reads its weights once; MLX's CUDA `quantized_matmul` reads
//! them at a fraction of the memory bandwidth. [`matvec_kernel`] reads them faster (BENCHMARKS.md);
//! quantised layers take it for the weights [`super::QuantizedMatvec`] names (by default those of
//! 16 MiB and more, a rule measured when the kernel still went through MLX's custom-kernel path).
//! The fused forms take every layer (`nn::fused`): each one replaces two to four of MLX's
//! operations. Each instance is a complete source compiled by [`rmlx::cuda`] (kept in rmlx's cache
//! directory) and launched as a node of MLX's graph. `rmlx bench-kernels` measures the plain product. Each
//! warp owns `R` output rows: every lane reads 16 bytes of each row per step (32 values at 4 bits,
//! 16 at 8, always inside one quantisation group; 8 of a 16-bit dense row, 4 of a float32 one).
//! A quantised value `q` is unpacked into the top of a float's mantissa (`1 + q/2^bits`, a shift
//! and a mask: no integer-to-float conversion), and each row and input row keeps
//! `Σ (1 + q/2^bits)·x` and `Σ x`, applied per group as
//! `scale · 2^bits · (Σ (1 + q/2^bits)·x − Σ x) + bias · Σ x`, in float32. The lanes' sums meet
//! through warp shuffles, and the warps that split a row's inputs through shared memory. GGUF
//! Q4_0/Q4_1/Q8_0 weights arrive in the same layout (`gguf::to_mlx`) and take the same kernel.
//!
//! Quantised products of 16-bit activations with many output rows (a feed-forward's gate/up, a
//! vocabulary head) take the kernel's integer form instead ([`ix`]: `x` as 16-bit fixed point,
//! four 4- or 8-bit values multiplied at once with `dp4a`), which issues about a fifth of the
//! instructions; those of 1 or 2 rows of `x` with fewer output rows and no gate (q/k/v, output and
//! down projections) its split form (a row's inputs split between a block's warps, `x` in
//! registers, the weights copied ahead into shared memory).

use super::cuda_fast::{cuda_type, kernel_cache, launch_once, on_cuda, Launches, CUDA_TYPES};
use super::cuda_qmv_ix as ix;
use super::training;
use rmlx::cuda::{self, CudaLaunch, KernelArg, KernelNode, OVERLAP};
use rmlx::quantization::{QuantMode, Quantized};
use rmlx::{Array, Dtype, Result};
use std::sync::{Arc, LazyLock, Mutex};

/// The most rows of `x` the kernel takes (more: MLX's quantised matmul, made for them).
pub const MAX_ROWS: i32 = 8;

/// Warps a block (the kernel's `WARPS`).
const WARPS: i32 = 4;

/// The kernel's body. Constants (see [`source`]): `T` the activations' (and scales') type, `K` input
/// features, `N` outputs, `M` rows computed (`x`'s row count rounded up to 1, 2, 4 or 8, so that
/// one instance serves several batch sizes; the real count is the `rows` parameter), `BITS` 4 or 8 (affine-quantised `w`) or 0 (`w` dense, of type `T`), `GS` the
/// group size, `R` output rows a warp, `KW` warps that split one row's inputs between them (their
/// sums meet in shared memory); what is fused: `NORM` (`x` RMS-normalised with the weight `nw`
/// and the epsilon whose float bits are `EPS`), `BIAS` (`bias` added; gated, `bias2` to the second
/// product), `EPI` 0 (the product), 1 (`res` added), 2 (`silu(x w) · (x w2)`), 3 (the same with the
/// tanh GELU) or 4 (gpt-oss's clamped SwiGLU of slope `ALPHA` and clamp `LIMIT`).
///
/// The norm is folded into the sums: `Σ w·(x·r·nw) = r · Σ w·(x·nw)`, with `r` the inverse root
/// mean square of the row, whose sum of squares the lanes gather from the `x` they read anyway.
const SOURCE: &str = r#"
    constexpr bool DENSE = BITS == 0;
    constexpr int QB = DENSE ? 8 : BITS;
    constexpr int PER_WORD = DENSE ? 1 : 32 / QB;
    constexpr int VALS = DENSE ? 16 / static_cast<int>(sizeof(T)) : 4 * PER_WORD;
    constexpr int STEP = 32 * VALS;
    constexpr int STEPS = (K + STEP - 1) / STEP;
    constexpr long long ROW_BYTES = DENSE ? static_cast<long long>(K) * sizeof(T) : static_cast<long long>(K) * QB / 8;
    constexpr int GROUPS = K / GS;
    constexpr unsigned MASK = DENSE ? 0u : (1u << QB) - 1u;
    constexpr bool GATED = EPI >= 2;
    constexpr int RR = GATED ? 2 * R : R;
    constexpr int WARPS = 4;
    __shared__ float partial[KW > 1 ? WARPS * M * (RR + 1) : 1];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int part = warp % KW;
    const int row0 = (blockIdx.x * (WARPS / KW) + warp / KW) * R;
    // `M` rows are computed, `rows` of them real: the others read the last real row.
    const char* wsrc[2] = {reinterpret_cast<const char*>(w), reinterpret_cast<const char*>(w2)};
    const T* ssrc[2] = {reinterpret_cast<const T*>(scales), reinterpret_cast<const T*>(scales2)};
    const T* bsrc[2] = {reinterpret_cast<const T*>(biases), reinterpret_cast<const T*>(biases2)};
    // Nothing is read before this (see `rmlx::cuda::OVERLAP`): asking the first step's weights
    // into the L2 here made bf16 decoding 2-4 % slower (BENCHMARKS.md).
    rmlx_wait_previous();
    rmlx_release_next();
    float acc[M][RR];
    float sq[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        sq[m] = 0.0f;
#pragma unroll
        for (int r = 0; r < RR; ++r) {
            acc[m][r] = 0.0f;
        }
    }
    if (row0 < N) {
#pragma unroll 2
        for (int step = part; step < STEPS; step += KW) {
            const int k0 = step * STEP + lane * VALS;
            if (k0 >= K) {
                break;
            }
            uint4 packed[RR];
            float scale[RR];
            float bias_[RR];
#pragma unroll
            for (int r = 0; r < RR; ++r) {
                const long long row = min(row0 + r % R, N - 1);
                const int src = r / R;
                const long long offset = DENSE ? static_cast<long long>(k0) * sizeof(T) : static_cast<long long>(k0) * QB / 8;
                packed[r] = *reinterpret_cast<const uint4*>(wsrc[src] + row * ROW_BYTES + offset);
                if constexpr (!DENSE) {
                    scale[r] = static_cast<float>(ssrc[src][row * GROUPS + k0 / GS]);
                    bias_[r] = static_cast<float>(bsrc[src][row * GROUPS + k0 / GS]);
                }
            }
            if constexpr (DENSE) {
                float xv[M][VALS];
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    rmlx_load_x<T, VALS, NORM>(x + static_cast<long long>(min(m, rows - 1)) * K + k0, nw + k0, xv[m], sq[m]);
                }
#pragma unroll
                for (int r = 0; r < RR; ++r) {
                    const T* e = reinterpret_cast<const T*>(&packed[r]);
#pragma unroll
                    for (int j = 0; j < VALS; ++j) {
                        const float f = static_cast<float>(e[j]);
#pragma unroll
                        for (int m = 0; m < M; ++m) {
                            acc[m][r] = fmaf(f, xv[m][j], acc[m][r]);
                        }
                    }
                }
            } else {
                float dot[M][RR];
                float xsum[M];
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    xsum[m] = 0.0f;
#pragma unroll
                    for (int r = 0; r < RR; ++r) {
                        dot[m][r] = 0.0f;
                    }
                }
#pragma unroll
                for (int word = 0; word < 4; ++word) {
                    float xv[M][PER_WORD];
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        const int k = k0 + word * PER_WORD;
                        rmlx_load_x<T, PER_WORD, NORM>(x + static_cast<long long>(min(m, rows - 1)) * K + k, nw + k, xv[m], sq[m]);
#pragma unroll
                        for (int j = 0; j < PER_WORD; ++j) {
                            xsum[m] += xv[m][j];
                        }
                    }
#pragma unroll
                    for (int r = 0; r < RR; ++r) {
                        const unsigned u = word == 0 ? packed[r].x
                                         : word == 1 ? packed[r].y
                                         : word == 2 ? packed[r].z
                                                     : packed[r].w;
#pragma unroll
                        for (int j = 0; j < PER_WORD; ++j) {
                            // 1 + q / 2^BITS: the value moved to the top of a float's mantissa.
                            constexpr int TOP = 23 - QB;
                            const int shift = TOP - QB * j;
                            const unsigned moved = shift >= 0 ? u << shift : u >> -shift;
                            const float f = __uint_as_float((moved & (MASK << TOP)) | 0x3F800000u);
#pragma unroll
                            for (int m = 0; m < M; ++m) {
                                dot[m][r] = fmaf(f, xv[m][j], dot[m][r]);
                            }
                        }
                    }
                }
#pragma unroll
                for (int m = 0; m < M; ++m) {
#pragma unroll
                    for (int r = 0; r < RR; ++r) {
                        // Σ q·x = 2^BITS · (Σ (1 + q / 2^BITS)·x − Σ x).
                        const float qdot = static_cast<float>(1 << QB) * (dot[m][r] - xsum[m]);
                        acc[m][r] += scale[r] * qdot + bias_[r] * xsum[m];
                    }
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            if constexpr (NORM) {
                sq[m] += __shfl_xor_sync(0xffffffff, sq[m], o);
            }
#pragma unroll
            for (int r = 0; r < RR; ++r) {
                acc[m][r] += __shfl_xor_sync(0xffffffff, acc[m][r], o);
            }
        }
    }
    if constexpr (KW > 1) {
        if (lane == 0) {
#pragma unroll
            for (int m = 0; m < M; ++m) {
#pragma unroll
                for (int r = 0; r < RR; ++r) {
                    partial[(warp * M + m) * (RR + 1) + r] = acc[m][r];
                }
                partial[(warp * M + m) * (RR + 1) + RR] = sq[m];
            }
        }
        __syncthreads();
        if (lane == 0 && part == 0) {
#pragma unroll
            for (int m = 0; m < M; ++m) {
#pragma unroll
                for (int r = 0; r <= RR; ++r) {
                    float v = 0.0f;
#pragma unroll
                    for (int p = 0; p < KW; ++p) {
                        v += partial[((warp + p) * M + m) * (RR + 1) + r];
                    }
                    if (r < RR) {
                        acc[m][r] = v;
                    } else {
                        sq[m] = v;
                    }
                }
            }
        }
    }
    if (lane == 0 && part == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            if (m >= rows) {
                break;
            }
            const float inv_rms = NORM ? rsqrtf(sq[m] / K + __int_as_float(EPS)) : 1.0f;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (row0 + r < N) {
                    rmlx_finish<T, EPI, BIAS>(acc[m][r], acc[m][GATED ? R + r : r], inv_rms, bias, bias2, res, y, m, row0 + r, N);
                }
            }
        }
    }
"#;

/// Output `row` of `x`'s row `m` from its sum `a` (and, gated, the second matrix's `b`), times
/// the norm's `inv_rms`: each step rounded to `T`, as the operations it replaces round their
/// outputs; then the biases, the residual or the gated activation (`EPI`, see [`SOURCE`]). The
/// clamped SwiGLU rounds each of its operations (minimum, clip, the products, the sigmoid, the
/// `+ 1`) to `T`, with `ALPHA` and `LIMIT` in `T` as the composed operations' scalars are.
const FINISH: &str = r#"
template <typename T, int EPI, bool BIAS>
__device__ __forceinline__ void rmlx_finish(float a, float b, float inv_rms, const T* bias, const T* bias2,
                                            const T* res, T* y, int m, int row, int N) {
    float v = static_cast<float>(static_cast<T>(a * inv_rms));
    if constexpr (BIAS) {
        v = static_cast<float>(static_cast<T>(v + static_cast<float>(bias[row])));
    }
    if constexpr (EPI == 1) {
        v += static_cast<float>(res[static_cast<long long>(m) * N + row]);
    } else if constexpr (EPI >= 2) {
        float u = static_cast<float>(static_cast<T>(b * inv_rms));
        if constexpr (BIAS) {
            u = static_cast<float>(static_cast<T>(u + static_cast<float>(bias2[row])));
        }
        if constexpr (EPI == 2) {
            v = v / (1.0f + expf(-v)) * u;
        } else if constexpr (EPI == 3) {
            v = 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v))) * u;
        } else {
            const float alpha = static_cast<float>(static_cast<T>(ALPHA));
            const float limit = static_cast<float>(static_cast<T>(LIMIT));
            const float g = fminf(v, limit);
            u = fminf(fmaxf(u, -limit), limit);
            const float s = static_cast<float>(static_cast<T>(1.0f / (1.0f + expf(-static_cast<float>(static_cast<T>(g * alpha))))));
            const float glu = static_cast<float>(static_cast<T>(g * s));
            v = glu * static_cast<float>(static_cast<T>(u + 1.0f));
        }
    }
    y[static_cast<long long>(m) * N + row] = static_cast<T>(v);
}
"#;

/// `N` consecutive values of type `T` at `p` (aligned to their size) as floats, read with 16- or
/// 8-byte loads; with `NORM`, multiplied by the norm's weights at `nw` (of type `T` too) and their
/// squares (before the weights) added to `sq`.
const HEADER: &str = r#"
template <typename T, int N>
__device__ __forceinline__ void rmlx_load_floats(const T* p, float* out) {
    constexpr int BYTES = N * sizeof(T);
    if constexpr (BYTES % 16 == 0) {
        constexpr int PER = 16 / sizeof(T);
#pragma unroll
        for (int i = 0; i < BYTES / 16; ++i) {
            const uint4 v = reinterpret_cast<const uint4*>(p)[i];
            const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
            for (int t = 0; t < PER; ++t) {
                out[i * PER + t] = static_cast<float>(e[t]);
            }
        }
    } else {
        static_assert(BYTES == 8, "8 or a multiple of 16 bytes");
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int t = 0; t < N; ++t) {
            out[t] = static_cast<float>(e[t]);
        }
    }
}

template <typename T, int N, bool NORM>
__device__ __forceinline__ void rmlx_load_x(const T* p, const T* nw, float* out, float& sq) {
    rmlx_load_floats<T, N>(p, out);
    if constexpr (NORM) {
        float wv[N];
        rmlx_load_floats<T, N>(nw, wv);
#pragma unroll
        for (int t = 0; t < N; ++t) {
            sq = fmaf(out[t], out[t], sq);
            out[t] *= wv[t];
        }
    }
}
"#;

/// The kernel's parameters, in order: `x`, the weight's packed values (or dense values), scales
/// and biases, the second (gated) matrix's three, the norm's weight, the residual, the bias, then
/// `y` and `rows`. A product that has no use for some of them gets `x`'s address there.
const INPUTS: usize = 10;

/// The residual's place among [`INPUTS`].
const RESIDUAL: usize = 8;

/// The complete source of the instance for `s`: CUDA's 16-bit types, the loads, the constants and
/// the kernel `rmlx_fused_matvec`.
fn source(s: &Shape) -> String {
    let t = cuda_type(s.dtype);
    let split = s.split();
    let (body, ix_header, bounds) = match s.form {
        Form::Integer => (ix::SOURCE, ix::HEADER.to_string(), format!("128, {}", ix::BLOCKS_PER_SM)),
        Form::SplitInteger => (
            ix::SPLIT_SOURCE,
            format!("{}{}", ix::HEADER, ix::SPLIT_HEADER),
            format!("{}, {}", 32 * split, ix::split_blocks_per_sm(split)),
        ),
        Form::Float => (SOURCE, String::new(), "128".to_string()),
    };
    let constants = constants(s);
    format!(
        "{CUDA_TYPES}{constants}{OVERLAP}{HEADER}{FINISH}{ix_header}typedef {t} T;\n\
         extern \"C\" __global__ void __launch_bounds__({bounds}) rmlx_fused_matvec(const T* x, const unsigned* w, \
         const T* scales, const T* biases, const unsigned* w2, const T* scales2, const T* biases2, const T* nw, \
         const T* res, const T* bias, T* y, int rows) {{\nconst T* bias2 = bias;\n{body}}}\n"
    )
}

/// The constants an instance of shape `s` is compiled with (see [`SOURCE`]).
fn constants(s: &Shape) -> String {
    let (r, split) = (s.rows_per_warp(), s.split());
    let constants = [
        ("K", s.input),
        ("N", s.output),
        ("M", s.computed_rows()),
        ("BITS", s.bits),
        ("GS", s.group_size),
        ("R", r),
        ("KW", split),
        ("NORM", i32::from(s.norm.is_some())),
        ("EPS", s.norm.unwrap_or(0) as i32),
        ("BIAS", i32::from(s.bias)),
        ("EPI", s.epilogue),
        ("DEPTH", if s.form == Form::SplitInteger { ix::split_depth(s.bits, s.input, r) } else { 1 }),
    ];
    let (alpha, limit) = s.clamp.map_or((0.0, 0.0), |(a, l)| (f32::from_bits(a), f32::from_bits(l)));
    // Rust writes the shortest decimal that reads back as the same f32; CUDA reads it so too.
    let floats = format!("constexpr float ALPHA = {alpha:e}f;\nconstexpr float LIMIT = {limit:e}f;\n");
    constants.iter().map(|(n, v)| format!("constexpr int {n} = {v};\n")).chain([floats]).collect()
}

/// One row's product in the float form, for kernels of other modules that run one such product
/// per row of their grid's second axis (a token's experts, `cuda_moe`): what goes before their
/// kernel's signature (types, loads, epilogue, typedef `T` and the constants), the body to put
/// inside it, and the blocks of the grid's first axis. The body reads `x`, `w`, `scales`,
/// `biases`, `w2`, `scales2`, `biases2`, `nw`, `res`, `bias`, `y` and `rows`, which the kernel
/// declares; it waits for the kernel before ([`rmlx::cuda::OVERLAP`]) before reading them.
pub(super) struct RowProduct {
    pub prelude: String,
    pub body: &'static str,
    pub blocks: i32,
}

/// What a [`RowProduct`] makes of its sums.
#[derive(Clone, Copy, PartialEq, Debug)]
pub(super) enum RowEpilogue {
    /// The product `x Wᵀ`.
    Product,
    /// `silu(x Wᵀ) · (x W2ᵀ)`.
    SwiGlu,
    /// gpt-oss's `g · σ(alpha · g) · (u + 1)`, `g = min(x Wᵀ, limit)`, `u = clip(x W2ᵀ, ±limit)`.
    ClampedSwiGlu { alpha: f32, limit: f32 },
}

/// [`RowProduct`] of `W: [output, input]` (dense of `dtype`, or `bits`-bit affine in groups of
/// `group_size`), with the norm of `norm_eps` folded in where set, a bias per output (`bias`, and
/// `bias2` for a gated epilogue's second matrix) where `biased`, and `epilogue`.
pub(super) fn row_product(
    dtype: Dtype,
    (input, output): (i32, i32),
    (bits, group_size): (i32, i32),
    norm_eps: Option<f32>,
    epilogue: RowEpilogue,
    biased: bool,
) -> RowProduct {
    let (epilogue, clamp) = match epilogue {
        RowEpilogue::Product => (0, None),
        RowEpilogue::SwiGlu => (2, None),
        RowEpilogue::ClampedSwiGlu { alpha, limit } => (4, Some((alpha.to_bits(), limit.to_bits()))),
    };
    let s = Shape {
        dtype,
        rows: 1,
        input,
        output,
        bits,
        group_size,
        norm: norm_eps.map(f32::to_bits),
        bias: biased,
        epilogue,
        clamp,
        form: Form::Float,
    };
    let t = cuda_type(dtype);
    RowProduct {
        prelude: format!("{CUDA_TYPES}{}{OVERLAP}{HEADER}{FINISH}typedef {t} T;\n", constants(&s)),
        body: SOURCE,
        blocks: s.row_blocks(),
    }
}

/// The launch of the products `chain` (each after the first reading the previous one's output as
/// its `x`; step `i` adds step `residuals[i]`'s output, where set), compiled or read from the cache
/// once per process and prepared once.
fn launch_for(chain: &[Shape], residuals: &[Option<usize>]) -> Result<Arc<CudaLaunch>> {
    static LAUNCHES: Launches<(Vec<Shape>, Vec<Option<usize>>)> = LazyLock::new(Mutex::default);
    launch_once(&LAUNCHES, "rmlx_fused_matvec", &(chain.to_vec(), residuals.to_vec()), || make_launch(chain, residuals))
}

/// The launch of the products `chain` with `residuals` (their kernels compiled, or read from the
/// cache).
fn make_launch(chain: &[Shape], residuals: &[Option<usize>]) -> Result<CudaLaunch> {
    let mut nodes = Vec::new();
    let mut next = 0;
    for (i, s) in chain.iter().enumerate() {
        // The first product's `x` is input 0; a later one's is the previous product's output.
        let x = match i {
            0 => {
                next = 1;
                KernelArg::Input(0)
            }
            _ => KernelArg::Output(i as u32 - 1),
        };
        let residual = residuals[i].map(|j| KernelArg::Output(j as u32));
        nodes.push(kernel_node(s, x, residual, &mut next, i as u32)?);
    }
    let outputs: Vec<_> = chain.iter().map(|s| (vec![s.rows, s.output], s.dtype)).collect();
    CudaLaunch::new("rmlx_fused_matvec", &nodes, &outputs)
}

/// The kernel node of product `s` reading `x` (and `residual`, where given), then its other inputs
/// numbered from `next` on (each one it has no use for gets `x`'s address), writing output `output`.
fn kernel_node(
    s: &Shape,
    x: KernelArg,
    residual: Option<KernelArg>,
    next: &mut u32,
    output: u32,
) -> Result<KernelNode> {
    let function = cuda::compile("rmlx_fused_matvec", &source(s), Some(&kernel_cache()))?.overlapping();
    let (blocks, threads) = match s.form {
        Form::Integer => (ix::grid(s.row_blocks(), ix::BLOCKS_PER_SM)?, WARPS * 32),
        Form::SplitInteger => (ix::grid(s.row_blocks(), ix::split_blocks_per_sm(s.split()))?, 32 * s.split()),
        Form::Float => (s.row_blocks(), WARPS * 32),
    };
    let reads = s.reads();
    let mut args = vec![x];
    for i in 1..INPUTS {
        match (reads & (1 << i) != 0, residual) {
            (true, Some(r)) if i == RESIDUAL => args.push(r),
            (true, _) => {
                args.push(KernelArg::Input(*next));
                *next += 1;
            }
            (false, _) => args.push(x),
        }
    }
    args.extend([KernelArg::Output(output), KernelArg::I32(s.rows)]);
    let (grid, block) = ([blocks as u32, 1, 1], [threads as u32, 1, 1]);
    Ok(KernelNode { function, grid, block, shared_bytes: 0, args })
}

/// A matrix `W` `[N, K]` the kernel multiplies by: dense (of the activations' type) or quantised.
#[derive(Clone, Copy)]
pub enum Matrix<'a> {
    Dense(&'a Array),
    Quantized(&'a Quantized),
}

/// One product `y = x Wᵀ` of a decoding step and what is fused around it: `y = act(n(x) Wᵀ + b) + res`,
/// where `n` is an RMSNorm (`norm`: its weight `[K]` and epsilon), `b` a bias `[N]`, `res` a
/// residual of `y`'s shape, and `act(z) = silu(z) · (n(x) W2ᵀ)` (or the tanh GELU's, with
/// `gated: Some((W2, true))`) for a gated feed-forward's gate and up projections. Every fused step
/// rounds to the activations' type where the operations it replaces would.
#[derive(Clone, Copy)]
pub struct Fused<'a> {
    pub weight: Matrix<'a>,
    pub gated: Option<(Matrix<'a>, bool)>,
    pub norm: Option<(&'a Array, f32)>,
    pub bias: Option<&'a Array>,
    pub residual: Option<&'a Array>,
}

impl<'a> Fused<'a> {
    /// The plain product by `weight`.
    pub fn product(weight: Matrix<'a>) -> Self {
        Fused { weight, gated: None, norm: None, bias: None, residual: None }
    }
}

/// What a kernel instance is specialised for.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Shape {
    dtype: Dtype,
    rows: i32,
    input: i32,
    output: i32,
    /// 4 or 8, or 0 for a dense matrix.
    bits: i32,
    group_size: i32,
    /// The norm's epsilon as float bits, when one is fused.
    norm: Option<u32>,
    bias: bool,
    /// 0 the product, 1 a residual added, 2 SwiGLU, 3 GeGLU, 4 clamped SwiGLU.
    epilogue: i32,
    /// The clamped SwiGLU's slope and clamp as float bits.
    clamp: Option<(u32, u32)>,
    /// Which kernel computes it.
    form: Form,
}

/// The kernel a product takes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Form {
    /// Float sums, three instructions a 4-bit value ([`SOURCE`]): float32 activations, dense
    /// weights, gated products of few rows.
    Float,
    /// `x` as fixed point in shared memory, `dp4a` ([`ix::SOURCE`]): 16-bit activations and many
    /// output rows.
    Integer,
    /// `x` as fixed point in registers, a row's inputs split between a block's warps
    /// ([`ix::SPLIT_SOURCE`]): 16-bit activations and fewer output rows.
    SplitInteger,
}

impl Shape {
    /// The inputs this product reads, a mask over [`INPUTS`].
    fn reads(&self) -> u16 {
        let quantized = self.bits > 0;
        let gated = self.epilogue >= 2;
        let bits = [
            true,
            true,
            quantized,
            quantized,
            gated,
            gated && quantized,
            gated && quantized,
            self.norm.is_some(),
            self.epilogue == 1,
            self.bias,
        ];
        bits.iter().enumerate().fold(0, |m, (i, &b)| m | (u16::from(b) << i))
    }

    /// The rows the kernel instance computes: [`Shape::rows`] rounded up to a power of two, so
    /// that batches of 2 to 8 sequences share three instances.
    fn computed_rows(&self) -> i32 {
        (self.rows as u32).next_power_of_two() as i32
    }

    /// Weight rows a warp reads per output row.
    fn matrices(&self) -> i32 {
        if self.epilogue >= 2 {
            2
        } else {
            1
        }
    }

    /// Output rows a warp (the kernels' `R`): more for large outputs (fewer loads of `x` per weight
    /// byte), fewer as the input rows grow (each keeps `rows × R` sums) and for gated products (two
    /// weight rows an output row). In the split form every warp of a block takes the same `R` rows
    /// (a tile), each over its own inputs.
    fn rows_per_warp(&self) -> i32 {
        match self.form {
            Form::Integer => return ix::rows_per_warp(self.matrices(), self.computed_rows()),
            Form::SplitInteger => return ix::split_rows(self.bits, self.input, self.computed_rows()),
            Form::Float => {}
        }
        let r = match self.computed_rows() {
            1 if self.output >= 32768 => 4,
            1..=4 => 2,
            _ => 1,
        };
        (r / self.matrices()).max(1)
    }

    /// Values a lane reads of a weight row per step (16 bytes).
    fn values_per_load(&self) -> i32 {
        match self.bits {
            0 => 16 / self.dtype.size() as i32,
            bits => 4 * 32 / bits,
        }
    }

    /// Blocks of [`WARPS`] warps' output rows (the integer form's tiles); the split form's tiles.
    fn row_blocks(&self) -> i32 {
        if self.form == Form::SplitInteger {
            return (self.output + self.rows_per_warp() - 1) / self.rows_per_warp();
        }
        let rows_per_block = WARPS / self.split() * self.rows_per_warp();
        (self.output + rows_per_block - 1) / rows_per_block
    }

    /// Warps splitting one row's inputs: enough warps in all to keep the memory busy (about 32 a
    /// multiprocessor of an H100), at most one a step of 32 lanes' loads, and at most a block's.
    fn split(&self) -> i32 {
        const WANTED_WARPS: i32 = 132 * 32;
        match self.form {
            Form::Integer => return 1,
            Form::SplitInteger => return ix::split_warps(self.bits, self.input),
            Form::Float => {}
        }
        let per_step = 32 * self.values_per_load();
        let steps = (self.input + per_step - 1) / per_step;
        let row_groups = (self.output + self.rows_per_warp() - 1) / self.rows_per_warp();
        let mut split = 1;
        while split < WARPS && split * 2 <= steps && row_groups * split < WANTED_WARPS {
            split *= 2;
        }
        split
    }
}

/// `x Wᵀ` for `x: [..., in]` with at most [`MAX_ROWS`] rows and `W` affine-quantised with 4 or 8
/// bits (groups of 32, 64 or 128; scales and biases of `x`'s type), on MLX's CUDA backend.
/// `Ok(None)` where the kernel does not serve (another backend or device, training or a
/// transform, other layouts or types, more rows): the caller takes MLX's product instead.
pub fn matvec_kernel(x: &Array, q: &Quantized) -> Result<Option<Array>> {
    fused_matvec(x, &Fused::product(Matrix::Quantized(q)))
}

/// [`Fused`]'s product of `x: [..., in]` (at most [`MAX_ROWS`] rows) as one kernel, on MLX's CUDA
/// backend: `W` (and `W2`) dense of `x`'s type with `in` a multiple of 16 bytes' values, or
/// quantised as [`matvec_kernel`] takes them; the norm's weight, the bias and the residual of
/// `x`'s type. `Ok(None)` where it does not serve (as [`matvec_kernel`], and a gated product with a
/// bias or residual): the caller composes the operations instead.
pub fn fused_matvec(x: &Array, f: &Fused) -> Result<Option<Array>> {
    let Some(shape) = serves(x, f) else {
        return Ok(None);
    };
    let mut inputs = vec![x.reshape(&[shape.rows, shape.input])?];
    side_inputs(f, &shape, false, &mut inputs)?;
    let y = launch_for(&[shape], &[None])?.call(&inputs)?;
    let mut out_shape = x.shape().to_vec();
    *out_shape.last_mut().expect("checked by serves") = shape.output;
    Ok(Some(y[0].reshape(&out_shape)?))
}

/// Whether [`fused_matvec`] computes `f`'s product of `x` in the integer form ([`ix`]).
#[cfg(test)]
pub(crate) fn takes_integer_form(x: &Array, f: &Fused) -> bool {
    serves(x, f).is_some_and(|s| s.form == Form::Integer)
}

/// Whether [`fused_matvec`] computes `f`'s product of `x` in the split integer form.
#[cfg(test)]
pub(crate) fn takes_split_form(x: &Array, f: &Fused) -> bool {
    serves(x, f).is_some_and(|s| s.form == Form::SplitInteger)
}

/// `second` applied to `first`'s product of `x` (`second`'s residual, if any, an array of its
/// output's shape, `x` itself for a feed-forward's residual), as one node of MLX's graph running
/// both kernels: a feed-forward half is `x + down(act(gate(n(x))) · up(n(x)))` in one node instead
/// of two. `Ok(None)` where either product does not serve.
pub fn fused_pair(x: &Array, first: &Fused, second: &Fused) -> Result<Option<Array>> {
    fused_chain(x, &[(*first, None), (*second, None)])
}

/// Products applied in turn, as one node of MLX's graph: the first reads `x`, each later one the
/// previous one's output; a step `(f, Some(j))` adds step `j`'s output as its residual (`f`'s own
/// residual then unset), `(f, None)` takes `f` as it is. Returns the last product (of `x`'s shape
/// but for the last axis); `Ok(None)` where a step does not serve.
pub fn fused_chain(x: &Array, steps: &[(Fused, Option<usize>)]) -> Result<Option<Array>> {
    let mut shapes: Vec<Shape> = Vec::new();
    let mut xs = x.shape().to_vec();
    if x.is_tracer() || steps.is_empty() {
        return Ok(None);
    }
    for (i, (f, from)) in steps.iter().enumerate() {
        let Some(mut s) = shape_for(x.dtype(), &xs, f) else {
            return Ok(None);
        };
        if let Some(j) = *from {
            // Only an unfused epilogue takes a step's output, of this step's output shape.
            let fits = j < i && f.residual.is_none() && s.epilogue == 0 && shapes[j].output == s.output;
            if !fits {
                return Ok(None);
            }
            s.epilogue = 1;
        }
        *xs.last_mut().expect("checked by shape_for") = s.output;
        shapes.push(s);
    }
    let mut inputs = vec![x.reshape(&[shapes[0].rows, shapes[0].input])?];
    for ((f, from), s) in steps.iter().zip(&shapes) {
        side_inputs(f, s, from.is_some(), &mut inputs)?;
    }
    let wiring: Vec<Option<usize>> = steps.iter().map(|(_, from)| *from).collect();
    let y = launch_for(&shapes, &wiring)?.call(&inputs)?;
    Ok(Some(y[steps.len() - 1].reshape(&xs)?))
}

/// Appends the inputs `f` reads besides `x` (and its residual, with `residual_from_step`), in the
/// kernel's parameter order.
fn side_inputs(f: &Fused, s: &Shape, residual_from_step: bool, inputs: &mut Vec<Array>) -> Result<()> {
    let res = f.residual.map(|r| r.reshape(&[s.rows, s.output])).transpose()?;
    let mut all: [Option<&Array>; INPUTS - 1] = [None; INPUTS - 1];
    [all[0], all[1], all[2]] = matrix_inputs(f.weight);
    if let Some((up, _)) = f.gated {
        [all[3], all[4], all[5]] = matrix_inputs(up);
    }
    [all[6], all[7], all[8]] = [f.norm.map(|n| n.0), res.as_ref(), f.bias];
    let reads = s.reads() & !(u16::from(residual_from_step) << 8);
    debug_assert_eq!(all.map(|a| a.is_some()), std::array::from_fn(|i| reads & (1 << (i + 1)) != 0));
    inputs.extend(all.iter().flatten().map(|&a| a.clone()));
    Ok(())
}

/// A matrix's packed weight, scales and biases (a dense one's weight alone).
fn matrix_inputs<'a>(m: Matrix<'a>) -> [Option<&'a Array>; 3] {
    match m {
        Matrix::Dense(w) => [Some(w), None, None],
        Matrix::Quantized(q) => [Some(&q.weight), Some(&q.scales), q.biases.as_ref()],
    }
}

/// `(bits, group size, outputs)` of `m` as the kernel reads it against inputs of `dtype` and `in`
/// features, if it can.
fn matrix_layout(m: Matrix, dtype: Dtype, input: i32) -> Option<(i32, i32, i32)> {
    match m {
        Matrix::Dense(w) => {
            let per_load = 16 / dtype.size() as i32;
            let ws = w.shape();
            let fits = w.dtype() == dtype && ws.len() == 2 && ws[1] == input && input % per_load == 0;
            fits.then_some((0, 32, ws[0]))
        }
        Matrix::Quantized(q) => {
            let ws = q.weight.shape();
            let per_word = 32 / q.bits.max(1);
            let fits = q.mode == QuantMode::Affine
                && matches!(q.bits, 4 | 8)
                && matches!(q.group_size, 32 | 64 | 128)
                && ws.len() == 2
                && q.weight.dtype() == Dtype::Uint32
                && input % q.group_size == 0
                && ws[1] * per_word == input
                && q.scales.dtype() == dtype
                && q.scales.shape() == [ws[0], input / q.group_size]
                && q.biases.as_ref().is_some_and(|b| b.dtype() == dtype && b.shape() == q.scales.shape());
            fits.then_some((q.bits, q.group_size, ws[0]))
        }
    }
}

/// The kernel's shape for this product, if it serves it.
fn serves(x: &Array, f: &Fused) -> Option<Shape> {
    (!x.is_tracer()).then(|| shape_for(x.dtype(), x.shape(), f)).flatten()
}

/// The kernel's shape for the product `f` of an `x` of type `dtype` and shape `xs`, if it serves it.
fn shape_for(dtype: Dtype, xs: &[i32], f: &Fused) -> Option<Shape> {
    let input = *xs.last()?;
    let rows: i32 = xs[..xs.len() - 1].iter().product();
    let fits = on_cuda()
        && !training()
        && matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        && (1..=MAX_ROWS).contains(&rows)
        && input > 0;
    if !fits {
        return None;
    }
    let (bits, group_size, output) = matrix_layout(f.weight, dtype, input)?;
    let epilogue = match (f.gated, f.residual) {
        (Some((up, gelu)), None) if f.bias.is_none() => {
            (matrix_layout(up, dtype, input)? == (bits, group_size, output)).then_some(())?;
            if gelu {
                3
            } else {
                2
            }
        }
        (Some(_), _) => return None,
        (None, Some(_)) => 1,
        (None, None) => 0,
    };
    let mut out_shape = xs.to_vec();
    *out_shape.last_mut()? = output;
    let of_x = |a: &Array, shape: &[i32]| a.dtype() == dtype && a.shape() == shape && !a.is_tracer();
    let side_inputs = f.norm.is_none_or(|(w, _)| of_x(w, &[input]))
        && f.bias.is_none_or(|b| of_x(b, &[output]))
        && f.residual.is_none_or(|r| of_x(r, &out_shape));
    if !side_inputs {
        return None;
    }
    let mut shape = Shape {
        dtype,
        rows,
        input,
        output,
        bits,
        group_size,
        norm: f.norm.map(|(_, eps)| eps.to_bits()),
        bias: f.bias.is_some(),
        epilogue,
        clamp: None,
        form: Form::Integer,
    };
    // Tiles counted with the integer form's layout, which it keeps where it serves.
    let integer = ix::serves(dtype, bits, shape.computed_rows(), input);
    shape.form = if integer && shape.row_blocks() >= ix::min_tiles(shape.computed_rows()) {
        Form::Integer
    } else if ix::split_serves(dtype, bits, shape.computed_rows(), input, epilogue) {
        Form::SplitInteger
    } else {
        Form::Float
    };
    Some(shape)
}
