//! rmlx's own quantised matrix-vector product for MLX's CUDA backend: `y = x Wᵀ` for a few rows of
//! `x` (decoding, small batches) and `W` in MLX's affine layout, 4 or 8 bits.
//!
//! A decoding step of a 4-bit model reads its weights once; MLX's CUDA `quantized_matmul` reads
//! them at a fraction of the memory bandwidth. [`matvec_kernel`] reads them faster (BENCHMARKS.md);
//! quantised layers take it for the weights [`super::QuantizedMatvec`] names (by default those of
//! 16 MiB and more: MLX spends more host time on a custom kernel than on its own product, which
//! small matrices do not earn back). `rmlx bench-kernels` measures it. Each
//! warp owns `R` output rows: every lane reads 16 bytes of each row per step (32 values at 4 bits,
//! 16 at 8, always inside one quantisation group), unpacks each value `q` into the top of a float's
//! mantissa (`1 + q/2^bits`, a shift and a mask: no integer-to-float conversion), and keeps per
//! row and input row `Σ (1 + q/2^bits)·x` and `Σ x`, applied per group as
//! `scale · 2^bits · (Σ (1 + q/2^bits)·x − Σ x) + bias · Σ x`, in float32. The lanes' sums meet
//! through warp shuffles, and the warps that split a row's inputs through shared memory. GGUF Q4_0/Q4_1/Q8_0 weights arrive in the same layout
//! (`gguf::to_mlx`) and take the same kernel.

use super::cuda_fast::{call_compiled, on_cuda, CompiledKernels};
use super::training;
use rmlx::fast::{cuda_kernel, CustomKernel, KernelLaunch, TemplateArg};
use rmlx::quantization::{QuantMode, Quantized};
use rmlx::{Array, Dtype, Result};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::LazyLock;

/// The most rows of `x` the kernel takes (more: MLX's quantised matmul, made for them).
pub const MAX_ROWS: i32 = 8;

/// Warps a block (the kernel's `WARPS`).
const WARPS: i32 = 4;

/// Template arguments: `T` the activations' (and scales') type, `K` input features, `N` outputs,
/// `M` rows of `x`, `BITS` 4 or 8, `GS` the group size, `R` output rows a warp, `KW` warps that
/// split one row's inputs between them (their sums meet in shared memory).
const SOURCE: &str = r#"
    constexpr int PER_WORD = 32 / BITS;
    constexpr int VALS = 4 * PER_WORD;
    constexpr int STEP = 32 * VALS;
    constexpr int STEPS = (K + STEP - 1) / STEP;
    constexpr int WORDS = K * BITS / 32;
    constexpr int GROUPS = K / GS;
    constexpr unsigned MASK = (1u << BITS) - 1u;
    constexpr int WARPS = 4;
    __shared__ float partial[KW > 1 ? WARPS * M * R : 1];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int part = warp % KW;
    const int row0 = (blockIdx.x * (WARPS / KW) + warp / KW) * R;
    float acc[M][R];
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
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
            uint4 packed[R];
            float scale[R];
            float bias[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
                const int row = min(row0 + r, N - 1);
                packed[r] = *reinterpret_cast<const uint4*>(w + static_cast<long long>(row) * WORDS + k0 / PER_WORD);
                scale[r] = static_cast<float>(scales[static_cast<long long>(row) * GROUPS + k0 / GS]);
                bias[r] = static_cast<float>(biases[static_cast<long long>(row) * GROUPS + k0 / GS]);
            }
            float dot[M][R];
            float xsum[M];
#pragma unroll
            for (int m = 0; m < M; ++m) {
                xsum[m] = 0.0f;
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    dot[m][r] = 0.0f;
                }
            }
#pragma unroll
            for (int word = 0; word < 4; ++word) {
                float xv[M][PER_WORD];
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    rmlx_load_floats<T, PER_WORD>(x + static_cast<long long>(m) * K + k0 + word * PER_WORD, xv[m]);
#pragma unroll
                    for (int j = 0; j < PER_WORD; ++j) {
                        xsum[m] += xv[m][j];
                    }
                }
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const unsigned u = word == 0 ? packed[r].x
                                     : word == 1 ? packed[r].y
                                     : word == 2 ? packed[r].z
                                                 : packed[r].w;
#pragma unroll
                    for (int j = 0; j < PER_WORD; ++j) {
                        // 1 + q / 2^BITS: the value moved to the top of a float's mantissa.
                        constexpr int TOP = 23 - BITS;
                        const int shift = TOP - BITS * j;
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
                for (int r = 0; r < R; ++r) {
                    // Σ q·x = 2^BITS · (Σ (1 + q / 2^BITS)·x − Σ x).
                    const float qdot = static_cast<float>(1 << BITS) * (dot[m][r] - xsum[m]);
                    acc[m][r] += scale[r] * qdot + bias[r] * xsum[m];
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                acc[m][r] += __shfl_xor_sync(0xffffffff, acc[m][r], o);
            }
        }
    }
    if constexpr (KW > 1) {
        if (lane == 0) {
#pragma unroll
            for (int m = 0; m < M; ++m) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    partial[(warp * M + m) * R + r] = acc[m][r];
                }
            }
        }
        __syncthreads();
        if (lane == 0 && part == 0) {
#pragma unroll
            for (int m = 0; m < M; ++m) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    float v = 0.0f;
#pragma unroll
                    for (int p = 0; p < KW; ++p) {
                        v += partial[((warp + p) * M + m) * R + r];
                    }
                    acc[m][r] = v;
                }
            }
        }
    }
    if (lane == 0 && part == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (row0 + r < N) {
                    y[static_cast<long long>(m) * N + row0 + r] = static_cast<T>(acc[m][r]);
                }
            }
        }
    }
"#;

/// `N` consecutive values of type `T` at `p` (aligned to their size) as floats, read with 16- or
/// 8-byte loads.
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
"#;

static KERNEL: LazyLock<CustomKernel> =
    LazyLock::new(|| cuda_kernel("rmlx_qmv", &["x", "w", "scales", "biases"], &["y"], SOURCE).header(HEADER));

/// What a kernel instance is specialised for.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Shape {
    dtype: Dtype,
    rows: i32,
    input: i32,
    output: i32,
    bits: i32,
    group_size: i32,
}

impl Shape {
    /// Output rows a warp: more for large outputs (fewer loads of `x` per weight byte), fewer as
    /// the input rows grow (each keeps `rows × R` sums).
    fn rows_per_warp(&self) -> i32 {
        match self.rows {
            1 if self.output >= 32768 => 4,
            1..=4 => 2,
            _ => 1,
        }
    }

    /// Warps splitting one row's inputs: enough warps in all to keep the memory busy (about 32 a
    /// multiprocessor of an H100), at most one a step of 32 lanes' loads, and at most a block's.
    fn split(&self) -> i32 {
        const WANTED_WARPS: i32 = 132 * 32;
        let per_step = 32 * 4 * (32 / self.bits);
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
    let Some(shape) = serves(x, q) else {
        return Ok(None);
    };
    let biases = q.biases.as_ref().expect("checked by serves");
    let x2 = x.reshape(&[shape.rows, shape.input])?;
    let inputs = [x2, q.weight.clone(), q.scales.clone(), biases.clone()];
    let y = call_compiled(&COMPILED, shape, "quantized matvec", launch, &inputs)?;
    let mut out_shape = x.shape().to_vec();
    *out_shape.last_mut().expect("checked by serves") = shape.output;
    Ok(Some(y[0].reshape(&out_shape)?))
}

/// The kernel's shape for this product, if it serves it.
fn serves(x: &Array, q: &Quantized) -> Option<Shape> {
    let dtype = x.dtype();
    let xs = x.shape();
    let ws = q.weight.shape();
    let input = *xs.last()?;
    let rows: i32 = xs[..xs.len() - 1].iter().product();
    let per_word = 32 / q.bits.max(1);
    let fits = on_cuda()
        && !training()
        && !x.is_tracer()
        && q.mode == QuantMode::Affine
        && matches!(q.bits, 4 | 8)
        && matches!(q.group_size, 32 | 64 | 128)
        && matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        && (1..=MAX_ROWS).contains(&rows)
        && ws.len() == 2
        && q.weight.dtype() == Dtype::Uint32
        && input > 0
        && input % q.group_size == 0
        && ws[1] * per_word == input
        && q.scales.dtype() == dtype
        && q.scales.shape() == [ws[0], input / q.group_size]
        && q.biases.as_ref().is_some_and(|b| b.dtype() == dtype && b.shape() == q.scales.shape());
    fits.then_some(Shape { dtype, rows, input, output: ws[0], bits: q.bits, group_size: q.group_size })
}

/// Runs the kernel on `[x, w, scales, biases]`.
fn launch(inputs: &[Array], s: Shape) -> Result<Vec<Array>> {
    let (r, split) = (s.rows_per_warp(), s.split());
    let rows_per_block = WARPS / split * r;
    let blocks = (s.output + rows_per_block - 1) / rows_per_block;
    let launch = KernelLaunch::new([blocks * WARPS * 32, 1, 1], [WARPS * 32, 1, 1])
        .output(&[s.rows, s.output], s.dtype)
        .template("T", TemplateArg::Dtype(s.dtype))
        .template("K", TemplateArg::Int(s.input))
        .template("N", TemplateArg::Int(s.output))
        .template("M", TemplateArg::Int(s.rows))
        .template("BITS", TemplateArg::Int(s.bits))
        .template("GS", TemplateArg::Int(s.group_size))
        .template("R", TemplateArg::Int(r))
        .template("KW", TemplateArg::Int(split));
    KERNEL.call(inputs, &launch)
}

thread_local! {
    static COMPILED: CompiledKernels<Shape> = RefCell::new(HashMap::new());
}
