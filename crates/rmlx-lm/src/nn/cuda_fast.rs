//! CUDA kernels for a decoding step where MLX's CUDA backend has no fused op.
//!
//! A decoding step is bound by the host work MLX does per graph node (a few µs each), not by the
//! GPU: every node saved is time saved. [`qkv_heads`] turns the stacked q/k/v product of one
//! position per sequence into rotated query and key heads and value heads in one kernel, where the
//! composed path takes a reshape, a split, two RMSNorms (Qwen 3, Gemma 3) and two RoPEs;
//! [`norm_add`] adds a normalised branch to the residual (Gemma's post-norms), which the composed
//! path does in two nodes and a captured step cannot take from MLX.

use super::training;
use crate::cache::Offset;
use rmlx::cuda::{self, CudaLaunch, KernelArg, KernelNode, OVERLAP};
use rmlx::fast::{gpu_backend, GpuBackend};
use rmlx::{Array, DeviceType, Dtype, Result};
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, LazyLock, Mutex};

/// One block per (head, sequence), one thread per rotated pair `(i, i + D/2)` (whole warps: the
/// threads past the pairs only take part in the sum of squares). Query and key heads
/// are RMS-normalised (with `NORM`, epsilon `eps`; the product rounded to `T` before the weight, as
/// MLX's kernel does) and rotated at position `pos[b]` (`position` for all without `PER_ROW`): angle
/// `(scale · pos) · (1 / divisors[i])`, in the order MLX's RoPE kernel takes. Value heads are copied.
const SOURCE: &str = r#"
    constexpr int HALF = D / 2;
    const int t = threadIdx.x;
    const bool active = t < HALF;
    const int h = blockIdx.y;
    const int b = blockIdx.z;
    const T* row = y + (static_cast<long long>(b) * (HQ + 2 * HKV) + h) * D;
    if (h >= HQ + HKV) {
        if (active) {
            T* out = v + (static_cast<long long>(b) * HKV + (h - HQ - HKV)) * D;
            out[t] = row[t];
            out[t + HALF] = row[t + HALF];
        }
        return;
    }
    float x0 = active ? static_cast<float>(row[t]) : 0.0f;
    float x1 = active ? static_cast<float>(row[t + HALF]) : 0.0f;
    if constexpr (NORM) {
        __shared__ float partial[32];
        float ss = rmlx_pair_squares(x0, x1);
        for (int o = 16; o > 0; o >>= 1) {
            ss += __shfl_xor_sync(0xffffffff, ss, o);
        }
        if ((t & 31) == 0) {
            partial[t >> 5] = ss;
        }
        __syncthreads();
        float total = 0.0f;
        for (int w = 0; w < (HALF + 31) / 32; ++w) {
            total += partial[w];
        }
        if (!active) {
            return;
        }
        const float r = rsqrtf(total / D + eps);
        const T* w = h < HQ ? qw : kw;
        x0 = rmlx_normed<T>(x0, r, static_cast<float>(w[t]));
        x1 = rmlx_normed<T>(x1, r, static_cast<float>(w[t + HALF]));
    }
    if (!active) {
        return;
    }
    const float theta = (scale * static_cast<float>(PER_ROW ? pos[b] : position)) * (1.0f / divisors[t]);
    const float c = cosf(theta);
    const float s = sinf(theta);
    T* out = h < HQ ? q + (static_cast<long long>(b) * HQ + h) * D
                    : k + (static_cast<long long>(b) * HKV + (h - HQ)) * D;
    out[t] = static_cast<T>(rmlx_rotated_first(x0, x1, c, s));
    out[t + HALF] = static_cast<T>(rmlx_rotated_second(x0, x1, c, s));
"#;

/// The arithmetic of a head's norm and rotation, shared by [`qkv_heads`] and the attention kernel
/// that makes its heads itself (`cuda_attention`), so that both give the same bits: every
/// product and sum written out (`__fmul_rn`, `__fmaf_rn`), which the compiler may not contract
/// differently in the two kernels.
/// - `rmlx_pair_squares(x0, x1)`: `x0² + x1²` (a thread's share of the sum of squares);
/// - `rmlx_normed<T>(x, r, w)`: `x · r` rounded to `T`, times the weight, rounded to `T` (MLX's
///   RMSNorm order);
/// - `rmlx_rotated_first/second(x0, x1, c, s)`: the pair `(x0, x1)` rotated by the angle whose
///   cosine and sine are `c, s`: `x0·c − x1·s` and `x0·s + x1·c`.
pub(super) const HEAD_MATH: &str = r#"
__device__ __forceinline__ float rmlx_pair_squares(float x0, float x1) {
    return __fmaf_rn(x0, x0, __fmul_rn(x1, x1));
}
template <typename T>
__device__ __forceinline__ float rmlx_normed(float x, float r, float w) {
    return static_cast<float>(static_cast<T>(__fmul_rn(static_cast<float>(static_cast<T>(__fmul_rn(x, r))), w)));
}
__device__ __forceinline__ float rmlx_rotated_first(float x0, float x1, float c, float s) {
    return __fmaf_rn(x0, c, -__fmul_rn(x1, s));
}
__device__ __forceinline__ float rmlx_rotated_second(float x0, float x1, float c, float s) {
    return __fmaf_rn(x0, s, __fmul_rn(x1, c));
}
"#;

/// The per-head RMSNorm of queries and keys: their weights (`[D]`, of the activations' dtype) and
/// epsilon.
pub struct HeadNorms<'a> {
    pub query: &'a Array,
    pub key: &'a Array,
    pub eps: f32,
}

/// The rotary embedding of [`qkv_heads`]: the divisor of the position for each pair (`[D/2]`
/// float32), the position multiplier, the position (one for all sequences, or one each), and the
/// factor queries and keys are multiplied by before they turn (YaRN's attention factor; 1: none).
pub struct Rotation<'a> {
    pub divisors: &'a Array,
    pub scale: f32,
    pub offset: &'a Offset,
    pub factor: f32,
}

/// The stacked q/k/v product `y: [B, (Hq + 2·Hkv)·D]` of one position per sequence → query, key
/// and value heads `[B, H, 1, D]`, the queries and keys normalised (with `norms`) and rotated over
/// the whole head. `None` where the kernel does not serve (not MLX's CUDA backend, training or a
/// transform, more than one position, an odd head size or one above 2048, other dtypes, a rotation
/// with a factor): the caller composes the step instead.
pub fn qkv_heads(
    y: &Array,
    batch: i32,
    (heads, kv_heads, head_dim): (i32, i32, i32),
    norms: Option<HeadNorms>,
    rotation: &Rotation,
) -> Result<Option<[Array; 3]>> {
    let dtype = y.dtype();
    let serves = on_cuda()
        && !training()
        && !y.is_tracer()
        && rotation.factor == 1.0
        && matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        && head_dim % 2 == 0
        && (2..=2048).contains(&head_dim)
        && y.shape() == [batch, (heads + 2 * kv_heads) * head_dim]
        && rotation.divisors.shape() == [head_dim / 2]
        && match rotation.offset {
            Offset::Uniform(p) => *p <= i32::MAX as usize,
            Offset::PerRow(a) => a.size() == batch as usize,
        }
        && norms.as_ref().is_none_or(|n| n.query.dtype() == dtype && n.key.dtype() == dtype);
    if !serves {
        return Ok(None);
    }
    let per_row = matches!(rotation.offset, Offset::PerRow(_));
    let eps = norms.as_ref().map_or(0.0, |n| n.eps);
    // Without norms the kernel never reads its weights: `y` stands in (an input of type `T`).
    let (qw, kw) = match &norms {
        Some(n) => (n.query.clone(), n.key.clone()),
        None => (y.clone(), y.clone()),
    };
    // One position for all is the call's value; `y` stands in for the positions' array.
    let (positions, at) = match rotation.offset {
        Offset::Uniform(p) => (y.clone(), *p as i32),
        Offset::PerRow(a) if a.dtype() == Dtype::Int32 => (a.clone(), 0),
        Offset::PerRow(a) => (a.astype(Dtype::Int32)?, 0),
    };
    let divisors = match rotation.divisors.dtype() {
        Dtype::Float32 => rotation.divisors.clone(),
        _ => rotation.divisors.astype(Dtype::Float32)?,
    };
    let inputs = [y.clone(), qw, kw, divisors, positions];
    let shape = KernelShape {
        dtype,
        batch,
        heads,
        kv_heads,
        head_dim,
        norm: norms.is_some(),
        per_row,
        eps: eps.to_bits(),
        scale: rotation.scale.to_bits(),
    };
    let out = launch_for(shape)?.call_with(&inputs, &[KernelArg::I32(at)])?;
    Ok(Some(out.try_into().expect("three outputs")))
}

/// What a kernel instance is specialised for.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct KernelShape {
    dtype: Dtype,
    batch: i32,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    norm: bool,
    per_row: bool,
    /// The norm's epsilon and the position multiplier, as float bits.
    eps: u32,
    scale: u32,
}

/// The complete source of the instance for `s`: the kernel `rmlx_qkv_heads`.
fn source(s: &KernelShape) -> String {
    let t = cuda_type(s.dtype);
    format!(
        "{CUDA_TYPES}{OVERLAP}{HEAD_MATH}typedef {t} T;\nconstexpr int D = {};\nconstexpr int HQ = {};\nconstexpr int HKV = {};\n\
         constexpr bool NORM = {};\nconstexpr bool PER_ROW = {};\n\
         extern \"C\" __global__ void rmlx_qkv_heads(const T* y, const T* qw, const T* kw, const float* divisors, \
         const int* pos, int position, T* q, T* k, T* v, float eps, float scale) {{\n\
         rmlx_wait_previous();\nrmlx_release_next();\n{SOURCE}}}\n",
        s.head_dim, s.heads, s.kv_heads, s.norm, s.per_row
    )
}

/// The launch over `[y, qw, kw, divisors (float32), pos (int32, per row)]` and the call's position
/// (for all rows) for `s`, made once per process.
fn launch_for(s: KernelShape) -> Result<Arc<CudaLaunch>> {
    static LAUNCHES: Launches<KernelShape> = LazyLock::new(Mutex::default);
    launch_once(&LAUNCHES, "rmlx_qkv_heads", &s, || make_launch(&s))
}

/// The launch for `s` (its kernel compiled, or read from the cache).
fn make_launch(s: &KernelShape) -> Result<CudaLaunch> {
    let function = cuda::compile("rmlx_qkv_heads", &source(s), Some(&kernel_cache()))?.overlapping();
    let threads = ((s.head_dim / 2 + 31) / 32 * 32) as u32;
    let mut args: Vec<KernelArg> = (0..5).map(KernelArg::Input).collect();
    args.push(KernelArg::Value(0));
    args.extend((0..3).map(KernelArg::Output));
    args.extend([KernelArg::F32(f32::from_bits(s.eps)), KernelArg::F32(f32::from_bits(s.scale))]);
    let grid = [1, (s.heads + 2 * s.kv_heads) as u32, s.batch as u32];
    let node = KernelNode { function, grid, block: [threads, 1, 1], shared_bytes: 0, args };
    let head = |n: i32| (vec![s.batch, n, 1, s.head_dim], s.dtype);
    let outputs = [head(s.heads), head(s.kv_heads), head(s.kv_heads)];
    CudaLaunch::new("rmlx_qkv_heads", &[node], &outputs)
}

/// One block per row: `out = res + norm(a)`, `norm(a) = (a · r) · w` with
/// `r = 1 / √(mean(a²) + eps)`, rounded as MLX's RMSNorm (`a · r` to `T`, then the product with
/// the weight) and MLX's addition (in float32, to `T`).
const NORM_ADD_SOURCE: &str = r#"
    constexpr int WARPS = NT / 32;
    __shared__ float red[WARPS];
    const int t = threadIdx.x;
    const long long base = static_cast<long long>(blockIdx.x) * N;
    rmlx_wait_previous();
    rmlx_release_next();
    float ss = 0.0f;
    for (int i = t; i < N; i += NT) {
        const float v = static_cast<float>(a[base + i]);
        ss = fmaf(v, v, ss);
    }
    for (int o = 16; o > 0; o >>= 1) {
        ss += __shfl_xor_sync(0xffffffff, ss, o);
    }
    if ((t & 31) == 0) {
        red[t >> 5] = ss;
    }
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
        total += red[w];
    }
    const float r = rsqrtf(total / N + eps);
    for (int i = t; i < N; i += NT) {
        const T normed = static_cast<T>(static_cast<float>(static_cast<T>(static_cast<float>(a[base + i]) * r)) *
                                        static_cast<float>(w[i]));
        out[base + i] = static_cast<T>(static_cast<float>(res[base + i]) + static_cast<float>(normed));
    }
"#;

/// Threads of a [`norm_add`] block.
const NORM_ADD_THREADS: u32 = 256;

/// `residual + rms_norm(a) · weight` over the last axis of `a` (a post-norm block's residual
/// branch, Gemma's), for at most [`cuda_qmv::MAX_ROWS`](super::cuda_qmv::MAX_ROWS) rows, as one
/// kernel: `None` where it does not serve (not MLX's CUDA backend, training or a transform, more
/// rows, other dtypes or shapes): the caller composes it.
pub fn norm_add(a: &Array, weight: &Array, eps: f32, residual: &Array) -> Result<Option<Array>> {
    let dtype = a.dtype();
    let dim = a.shape().last().copied().unwrap_or(0);
    let rows: i32 = a.shape().iter().rev().skip(1).product();
    let serves = on_cuda()
        && !training()
        && !a.is_tracer()
        && !residual.is_tracer()
        && matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        && dim > 0
        && (1..=super::cuda_qmv::MAX_ROWS).contains(&rows)
        && weight.shape() == [dim]
        && weight.dtype() == dtype
        && residual.shape() == a.shape()
        && residual.dtype() == dtype;
    if !serves {
        return Ok(None);
    }
    let shape = NormShape { dtype, rows, dim, eps: eps.to_bits() };
    static LAUNCHES: Launches<NormShape> = LazyLock::new(Mutex::default);
    let launch = launch_once(&LAUNCHES, "rmlx_norm_add", &shape, || make_norm_add(&shape))?;
    let flat = |x: &Array| x.reshape(&[rows, dim]);
    let out = launch.call(&[flat(a)?, weight.clone(), flat(residual)?])?;
    Ok(Some(out[0].reshape(a.shape())?))
}

/// What a [`norm_add`] instance is specialised for (the epsilon as float bits).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct NormShape {
    dtype: Dtype,
    rows: i32,
    dim: i32,
    eps: u32,
}

/// The launch of `rmlx_norm_add` over `[a, w, res]` for `s`.
fn make_norm_add(s: &NormShape) -> Result<CudaLaunch> {
    let source = format!(
        "{CUDA_TYPES}{OVERLAP}typedef {} T;\nconstexpr int N = {};\nconstexpr int NT = {NORM_ADD_THREADS};\n\
         extern \"C\" __global__ void __launch_bounds__({NORM_ADD_THREADS}) rmlx_norm_add(const T* a, const T* w, \
         const T* res, T* out, float eps) {{\n{NORM_ADD_SOURCE}}}\n",
        cuda_type(s.dtype),
        s.dim
    );
    let function = cuda::compile("rmlx_norm_add", &source, Some(&kernel_cache()))?.overlapping();
    use KernelArg::{Input, Output, F32};
    let args = vec![Input(0), Input(1), Input(2), Output(0), F32(f32::from_bits(s.eps))];
    let node =
        KernelNode { function, grid: [s.rows as u32, 1, 1], block: [NORM_ADD_THREADS, 1, 1], shared_bytes: 0, args };
    CudaLaunch::new("rmlx_norm_add", &[node], &[(vec![s.rows, s.dim], s.dtype)])
}

/// CUDA's 16-bit float types for kernels compiled without CUDA's headers (rmlx's own kernels are
/// compiled alone, in a fraction of the time MLX's headers take): bfloat16 and half as structs
/// converting to and from `float` with round-to-nearest-even, as `__nv_bfloat16` and `__half` do.
pub(super) const CUDA_TYPES: &str = r#"struct rmlx_bf16 {
    unsigned short bits;
    rmlx_bf16() = default;
    __device__ rmlx_bf16(float f) { asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(f)); }
    __device__ operator float() const { return __uint_as_float(static_cast<unsigned>(bits) << 16); }
};
struct rmlx_f16 {
    unsigned short bits;
    rmlx_f16() = default;
    __device__ rmlx_f16(float f) { asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(f)); }
    __device__ operator float() const { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits)); return f; }
};
"#;

/// The name [`CUDA_TYPES`] (or CUDA) gives `dtype` (float32, bfloat16 or float16).
pub(super) fn cuda_type(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::Bfloat16 => "rmlx_bf16",
        Dtype::Float16 => "rmlx_f16",
        _ => "float",
    }
}

/// The launches of one kernel family, one per instance, made once per process and shared by every
/// thread.
pub(super) type Launches<K> = LazyLock<Mutex<HashMap<K, Arc<CudaLaunch>>>>;

/// The launch of kernel `name` for `key` in `launches`, made by `make` the first time (how long
/// that took, its kernel compiled or read from the cache, is logged at debug level).
pub(super) fn launch_once<K: Eq + Hash + Clone>(
    launches: &Launches<K>,
    name: &str,
    key: &K,
    make: impl FnOnce() -> Result<CudaLaunch>,
) -> Result<Arc<CudaLaunch>> {
    if let Some(l) = launches.lock().unwrap_or_else(|e| e.into_inner()).get(key) {
        return Ok(l.clone());
    }
    let start = std::time::Instant::now();
    let launch = Arc::new(make()?);
    tracing::debug!(kernel = name, ms = start.elapsed().as_secs_f64() * 1e3, "CUDA launch made");
    launches.lock().unwrap_or_else(|e| e.into_inner()).insert(key.clone(), launch.clone());
    Ok(launch)
}

/// Where compiled kernels are kept between processes: `kernels/` in rmlx's cache directory.
pub(super) fn kernel_cache() -> std::path::PathBuf {
    crate::cache_dir::cache_dir().join("kernels")
}

/// Whether work placed now runs on MLX's CUDA backend, where rmlx's own kernels can run.
pub(super) fn on_cuda() -> bool {
    rmlx::current_device().kind == DeviceType::Gpu
        && gpu_backend() == Some(GpuBackend::Cuda)
        && cuda::unavailable().is_none()
}
