//! A LoRA branch in training on MLX's CUDA backend as rmlx's own kernels: `base + scale · (x A) B`
//! forward as one operation of MLX's graph, and its gradient (for the input, `A` and `B`) as one
//! more, where the composed branch takes six cuBLAS products and four element-wise operations.
//!
//! A training step is bound by the host work MLX does per operation, and a cuBLAS product costs
//! ~20 µs of it (MLX asks cuBLASLt for a plan and a heuristic every call, then captures the call
//! into its CUDA graph); a kernel node of a [`CudaLaunch`] costs under a microsecond. The products
//! of a LoRA branch are thin (the rank `r` is 8–64): each is a pass over its large operand that a
//! simple kernel does at memory speed. Five kernels, specialised by dtype and rank:
//! - `rmlx_lora_down`: `t = α · u C` for `u: [n, k]` and `C: [k, r]` read through strides (`A`, or
//!   `Bᵀ` for the gradient), one warp a row, float32 out;
//! - `rmlx_lora_up` / `rmlx_lora_up_add`: `out = (add +) α · t C` for `C: [r, m]` through strides
//!   (`B`, or `Aᵀ`), one thread a column over a band of rows;
//! - `rmlx_lora_cols` / `rmlx_lora_sum`: `out = α · uᵀ t` (`[k, r]`, written through strides), as
//!   float32 partial sums over bands of rows and their sum.
//!
//! The gradient of `y = base + s (x A) B` for the cotangent `g`: `t = x A`, `d = s g Bᵀ`,
//! `∂B = s tᵀ g`, `∂A = xᵀ d`, `∂x = d Aᵀ`, `∂base = g`.

use super::cuda_fast::{cuda_type, kernel_cache, launch_once, on_cuda, Launches, CUDA_TYPES};
use rmlx::cuda::{self, CudaFunction, CudaLaunch, KernelArg, KernelNode};
use rmlx::transforms::CustomFunction;
use rmlx::{Array, Dtype, Result};
use std::sync::{LazyLock, Mutex};

/// The largest rank the kernels take (their per-thread sums are `r` registers).
pub const MAX_RANK: i32 = 64;

const SOURCE: &str = r#"
template <bool ADD>
__device__ void lora_up(const float* t, const T* c, const T* add, T* out, int n, int m, long long sc_j,
                        long long sc_q, float alpha) {
    const int q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= m) {
        return;
    }
    float cq[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {
        cq[j] = static_cast<float>(c[j * sc_j + q * sc_q]);
    }
    const int i0 = blockIdx.y * ROWS;
    const int i1 = min(n, i0 + ROWS);
    for (int i = i0; i < i1; ++i) {
        const float* ti = t + static_cast<long long>(i) * R;
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < R; ++j) {
            acc = fmaf(ti[j], cq[j], acc);
        }
        const long long o = static_cast<long long>(i) * m + q;
        float v = alpha * acc;
        if (ADD) {
            v += static_cast<float>(add[o]);
        }
        out[o] = static_cast<T>(v);
    }
}

extern "C" __global__ void rmlx_lora_up_add(const float* t, const T* c, const T* add, T* out, int n, int m,
                                            long long sc_j, long long sc_q, float alpha) {
    lora_up<true>(t, c, add, out, n, m, sc_j, sc_q, alpha);
}

extern "C" __global__ void rmlx_lora_up(const float* t, const T* c, T* out, int n, int m, long long sc_j,
                                        long long sc_q, float alpha) {
    lora_up<false>(t, c, nullptr, out, n, m, sc_j, sc_q, alpha);
}

extern "C" __global__ void rmlx_lora_down(const T* u, const T* c, float* t, int n, int k, long long sc_p,
                                          long long sc_j, float alpha) {
    const int lane = threadIdx.x & 31;
    const long long i = static_cast<long long>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (i >= n) {
        return;
    }
    float acc[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {
        acc[j] = 0.0f;
    }
    const T* row = u + i * k;
    for (int p = lane; p < k; p += 32) {
        const float v = static_cast<float>(row[p]);
        const T* cp = c + p * sc_p;
#pragma unroll
        for (int j = 0; j < R; ++j) {
            acc[j] = fmaf(v, static_cast<float>(cp[j * sc_j]), acc[j]);
        }
    }
#pragma unroll
    for (int j = 0; j < R; ++j) {
        float s = acc[j];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            s += __shfl_xor_sync(0xffffffff, s, o);
        }
        if (lane == (j & 31)) {
            t[i * R + j] = alpha * s;
        }
    }
}

extern "C" __global__ void rmlx_lora_cols(const T* u, const float* t, float* part, int n, int k, int band) {
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= k) {
        return;
    }
    float acc[R];
#pragma unroll
    for (int j = 0; j < R; ++j) {
        acc[j] = 0.0f;
    }
    const int i0 = blockIdx.y * band;
    const int i1 = min(n, i0 + band);
    for (int i = i0; i < i1; ++i) {
        const float v = static_cast<float>(u[static_cast<long long>(i) * k + p]);
        const float* ti = t + static_cast<long long>(i) * R;
#pragma unroll
        for (int j = 0; j < R; ++j) {
            acc[j] = fmaf(v, ti[j], acc[j]);
        }
    }
    float* out = part + static_cast<long long>(blockIdx.y) * R * k + p;
#pragma unroll
    for (int j = 0; j < R; ++j) {
        out[static_cast<long long>(j) * k] = acc[j];
    }
}

extern "C" __global__ void rmlx_lora_sum(const float* part, T* out, int k, int bands, long long so_p, long long so_j,
                                         float alpha) {
    const long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (e >= static_cast<long long>(k) * R) {
        return;
    }
    float acc = 0.0f;
    for (int s = 0; s < bands; ++s) {
        acc += part[static_cast<long long>(s) * R * k + e];
    }
    const long long j = e / k;
    const long long p = e % k;
    out[p * so_p + j * so_j] = static_cast<T>(alpha * acc);
}
"#;

/// Threads of every block.
const THREADS: u32 = 256;
/// Rows a block of `rmlx_lora_up` covers (each thread reads its column of `C` once for them).
const ROWS: i32 = 16;
/// Rows a band of `rmlx_lora_cols` sums at least (fewer bands for fewer rows).
const MIN_BAND: i32 = 32;
/// Bands of `rmlx_lora_cols` at most.
const MAX_BANDS: i32 = 64;

/// `base + scale · (x a) b` for `x: [..., k]`, `a: [k, r]`, `b: [r, m]` and `base: [..., m]`, all of
/// one dtype (float32, bfloat16, float16), as one launch forward and one for the gradient
/// (see the module docs); `None` where the kernels do not serve (not MLX's CUDA backend, another
/// dtype, a rank above [`MAX_RANK`], shapes that do not match): the caller composes the branch.
pub fn lora_add(base: &Array, x: &Array, a: &Array, b: &Array, scale: f32) -> Result<Option<Array>> {
    let dtype = x.dtype();
    let (Some(&k), Some(&m)) = (x.shape().last(), base.shape().last()) else { return Ok(None) };
    let n: i32 = x.shape().iter().rev().skip(1).product();
    let r = a.shape().get(1).copied().unwrap_or(0);
    let serves = on_cuda()
        && matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        && [base.dtype(), a.dtype(), b.dtype()].iter().all(|&d| d == dtype)
        && a.shape() == [k, r]
        && b.shape() == [r, m]
        && (1..=MAX_RANK).contains(&r)
        && n > 0
        && k > 0
        && m > 0
        && base.shape()[..base.ndim() - 1] == x.shape()[..x.ndim() - 1]
        && (n + ROWS - 1) / ROWS <= 65_535;
    if !serves {
        return Ok(None);
    }
    let shape = BranchShape { dtype, n, k, m, r, scale: scale.to_bits() };
    static FORWARD: Launches<BranchShape> = LazyLock::new(Mutex::default);
    static BACKWARD: Launches<BranchShape> = LazyLock::new(Mutex::default);
    let forward = launch_once(&FORWARD, "rmlx_lora_forward", &shape, || make_forward(&shape))?;
    let backward = launch_once(&BACKWARD, "rmlx_lora_backward", &shape, || make_backward(&shape))?;
    let branch = CustomFunction::new(move |p: &[Array]| Ok(vec![forward.call(p)?.remove(0)]))
        .vjp(move |p: &[Array], cotangents: &[Array], _outputs: &[Array]| {
            let g = &cotangents[0];
            let mut grads = backward.call(&[g.clone(), p[1].clone(), p[2].clone(), p[3].clone()])?;
            grads.truncate(3);
            let mut all = vec![g.clone()];
            all.extend(grads);
            Ok(all)
        })
        .build();
    let y = branch.call(&[base.reshape(&[n, m])?, x.reshape(&[n, k])?, a.clone(), b.clone()])?.remove(0);
    Ok(Some(y.reshape(base.shape())?))
}

/// What a launch is made for (the scale as float bits).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct BranchShape {
    dtype: Dtype,
    n: i32,
    k: i32,
    m: i32,
    r: i32,
    scale: u32,
}

impl BranchShape {
    fn scale(&self) -> f32 {
        f32::from_bits(self.scale)
    }

    /// Bands of rows `rmlx_lora_cols` sums separately, and the rows of each.
    fn bands(&self) -> (i32, i32) {
        let bands = (self.n / MIN_BAND).clamp(1, MAX_BANDS);
        let band = (self.n + bands - 1) / bands;
        ((self.n + band - 1) / band, band)
    }
}

/// Kernel `name` of [`SOURCE`] for `s`'s dtype and rank.
fn function(name: &str, s: &BranchShape) -> Result<CudaFunction> {
    let source = format!(
        "{CUDA_TYPES}typedef {} T;\nconstexpr int R = {};\nconstexpr int ROWS = {ROWS};\n{SOURCE}",
        cuda_type(s.dtype),
        s.r
    );
    cuda::compile(name, &source, Some(&kernel_cache()))
}

fn blocks(items: i64, per: i64) -> u32 {
    ((items + per - 1) / per) as u32
}

/// `t = α · u C` over `u: [n, k]` (input `u`), `C` (input `c`) through strides `(sc_p, sc_j)`
/// of its element `(p, j)`, into output `t` (float32 `[n, r]`).
#[allow(clippy::too_many_arguments)]
fn down(s: &BranchShape, u: u32, c: u32, strides: (i64, i64), t: u32, k: i32, alpha: f32) -> Result<KernelNode> {
    use KernelArg::{Input, Output, F32, I32, I64};
    let args = vec![Input(u), Input(c), Output(t), I32(s.n), I32(k), I64(strides.0), I64(strides.1), F32(alpha)];
    let grid = [blocks(s.n.into(), i64::from(THREADS / 32)), 1, 1];
    Ok(KernelNode { function: function("rmlx_lora_down", s)?, grid, block: [THREADS, 1, 1], shared_bytes: 0, args })
}

/// `out = (add +) α · t C` over `t` (output `t`, float32 `[n, r]`), `C` (input `c`) through strides
/// `(sc_j, sc_q)` of its element `(j, q)`, `m` columns.
#[allow(clippy::too_many_arguments)]
fn up(
    s: &BranchShape,
    t: u32,
    c: u32,
    strides: (i64, i64),
    add: Option<u32>,
    out: u32,
    m: i32,
    alpha: f32,
) -> Result<KernelNode> {
    use KernelArg::{Input, Output, F32, I32, I64};
    let mut args = vec![Output(t), Input(c)];
    args.extend(add.map(Input));
    args.extend([Output(out), I32(s.n), I32(m), I64(strides.0), I64(strides.1), F32(alpha)]);
    let name = if add.is_some() { "rmlx_lora_up_add" } else { "rmlx_lora_up" };
    let grid = [blocks(m.into(), THREADS.into()), blocks(s.n.into(), ROWS.into()), 1];
    Ok(KernelNode { function: function(name, s)?, grid, block: [THREADS, 1, 1], shared_bytes: 0, args })
}

/// `out = α · uᵀ t` (`[k, r]`, element `(p, j)` at `p · so_p + j · so_j` of output `out`) over
/// `u: [n, k]` (input `u`) and `t` (output `t`, float32 `[n, r]`), through the partial sums of
/// output `part` (float32 `[bands, r, k]`): two kernels.
#[allow(clippy::too_many_arguments)]
fn cols(
    s: &BranchShape,
    u: u32,
    t: u32,
    part: u32,
    out: u32,
    k: i32,
    so: (i64, i64),
    alpha: f32,
) -> Result<[KernelNode; 2]> {
    use KernelArg::{Input, Output, F32, I32, I64};
    let (bands, band) = s.bands();
    let partial = KernelNode {
        function: function("rmlx_lora_cols", s)?,
        grid: [blocks(k.into(), THREADS.into()), bands as u32, 1],
        block: [THREADS, 1, 1],
        shared_bytes: 0,
        args: vec![Input(u), Output(t), Output(part), I32(s.n), I32(k), I32(band)],
    };
    let sum = KernelNode {
        function: function("rmlx_lora_sum", s)?,
        grid: [blocks(i64::from(k) * i64::from(s.r), THREADS.into()), 1, 1],
        block: [THREADS, 1, 1],
        shared_bytes: 0,
        args: vec![Output(part), Output(out), I32(k), I32(bands), I64(so.0), I64(so.1), F32(alpha)],
    };
    Ok([partial, sum])
}

/// Over `[base, x, a, b]`: outputs `[y, t]` (`t = x a`, float32, kept for nothing).
fn make_forward(s: &BranchShape) -> Result<CudaLaunch> {
    let (r, m) = (i64::from(s.r), i64::from(s.m));
    let nodes = [down(s, 1, 2, (r, 1), 1, s.k, 1.0)?, up(s, 1, 3, (m, 1), Some(0), 0, s.m, s.scale())?];
    let outputs = [(vec![s.n, s.m], s.dtype), (vec![s.n, s.r], Dtype::Float32)];
    CudaLaunch::new("rmlx_lora_forward", &nodes, &outputs)
}

/// Over `[g, x, a, b]`: outputs `[∂x, ∂a, ∂b]`, then the scratch `t = x a`, `d = s g bᵀ` and the
/// partial sums of `∂a` and `∂b`.
fn make_backward(s: &BranchShape) -> Result<CudaLaunch> {
    let (r, m) = (i64::from(s.r), i64::from(s.m));
    let (bands, _) = s.bands();
    let [db_part, db_sum] = cols(s, 0, 3, 6, 2, s.m, (1, m), s.scale())?;
    let [da_part, da_sum] = cols(s, 1, 4, 5, 1, s.k, (r, 1), 1.0)?;
    let nodes = [
        down(s, 1, 2, (r, 1), 3, s.k, 1.0)?,
        down(s, 0, 3, (1, m), 4, s.m, s.scale())?,
        db_part,
        db_sum,
        da_part,
        da_sum,
        up(s, 4, 2, (1, r), None, 0, s.k, 1.0)?,
    ];
    let scratch = |rows: i32, cols: i32| (vec![rows, cols], Dtype::Float32);
    let outputs = [
        (vec![s.n, s.k], s.dtype),
        (vec![s.k, s.r], s.dtype),
        (vec![s.r, s.m], s.dtype),
        scratch(s.n, s.r),
        scratch(s.n, s.r),
        (vec![bands, s.r, s.k], Dtype::Float32),
        (vec![bands, s.r, s.m], Dtype::Float32),
    ];
    CudaLaunch::new("rmlx_lora_backward", &nodes, &outputs)
}
