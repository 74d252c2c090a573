//! CUDA kernels for a decoding step where MLX's CUDA backend has no fused op.
//!
//! A decoding step is bound by the host work MLX does per graph node (a few µs each), not by the
//! GPU: every node saved is time saved. [`qkv_heads`] turns the stacked q/k/v product of one
//! position per sequence into rotated query and key heads and value heads in one kernel, where the
//! composed path takes a reshape, a split, two RMSNorms (Qwen 3, Gemma 3) and two RoPEs.

use super::training;
use rmlx::compile::{compile_with, CompileOptions, Compiled};
use rmlx::fast::{cuda_kernel, gpu_backend, CustomKernel, GpuBackend, KernelLaunch, TemplateArg};
use rmlx::{Array, DeviceType, Dtype, Result};
use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::Hash;
use std::mem::ManuallyDrop;
use std::sync::LazyLock;
use std::thread::LocalKey;

/// One block per (head, sequence), one thread per rotated pair `(i, i + D/2)` (whole warps: the
/// threads past the pairs only take part in the sum of squares). Query and key heads
/// are RMS-normalised (with `NORM`; the product rounded to `T` before the weight, as MLX's kernel
/// does) and rotated at position `pos[b]` (`pos[0]` for all without `PER_ROW`): angle
/// `(params[1] · pos) · (1 / divisors[i])`, in the order MLX's RoPE kernel takes. Value heads are copied.
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
        float ss = x0 * x0 + x1 * x1;
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
        const float r = rsqrtf(total / D + params[0]);
        const T* w = h < HQ ? qw : kw;
        x0 = static_cast<float>(static_cast<T>(x0 * r)) * static_cast<float>(w[t]);
        x1 = static_cast<float>(static_cast<T>(x1 * r)) * static_cast<float>(w[t + HALF]);
        x0 = static_cast<float>(static_cast<T>(x0));
        x1 = static_cast<float>(static_cast<T>(x1));
    }
    if (!active) {
        return;
    }
    const float theta = (params[1] * static_cast<float>(pos[PER_ROW ? b : 0])) * (1.0f / divisors[t]);
    const float c = cos(theta);
    const float s = sin(theta);
    T* out = h < HQ ? q + (static_cast<long long>(b) * HQ + h) * D
                    : k + (static_cast<long long>(b) * HKV + (h - HQ)) * D;
    out[t] = static_cast<T>(x0 * c - x1 * s);
    out[t + HALF] = static_cast<T>(x0 * s + x1 * c);
"#;

static KERNEL: LazyLock<CustomKernel> = LazyLock::new(|| {
    cuda_kernel("rmlx_qkv_heads", &["y", "qw", "kw", "divisors", "pos", "params"], &["q", "k", "v"], SOURCE)
});

/// The per-head RMSNorm of queries and keys: their weights (`[D]`, of the activations' dtype) and
/// epsilon.
pub struct HeadNorms<'a> {
    pub query: &'a Array,
    pub key: &'a Array,
    pub eps: f32,
}

/// The rotary embedding of [`qkv_heads`]: the divisor of the position for each pair (`[D/2]`
/// float32), the position multiplier, and the positions (`[1]` for all sequences, or `[B]`; int32).
pub struct Rotation<'a> {
    pub divisors: &'a Array,
    pub scale: f32,
    pub positions: &'a Array,
}

/// The stacked q/k/v product `y: [B, (Hq + 2·Hkv)·D]` of one position per sequence → query, key
/// and value heads `[B, H, 1, D]`, the queries and keys normalised (with `norms`) and rotated over
/// the whole head. `None` where the kernel does not serve (not MLX's CUDA backend, training or a
/// transform, more than one position, an odd head size or one above 2048, other dtypes):
/// the caller composes the step instead.
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
        && matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        && head_dim % 2 == 0
        && (2..=2048).contains(&head_dim)
        && y.shape() == [batch, (heads + 2 * kv_heads) * head_dim]
        && rotation.divisors.shape() == [head_dim / 2]
        && (rotation.positions.size() == 1 || rotation.positions.size() == batch as usize)
        && norms.as_ref().is_none_or(|n| n.query.dtype() == dtype && n.key.dtype() == dtype);
    if !serves {
        return Ok(None);
    }
    let per_row = rotation.positions.size() > 1;
    let eps = norms.as_ref().map_or(0.0, |n| n.eps);
    let params = Array::from_slice(&[eps, rotation.scale], &[2])?;
    // Without norms the kernel never reads its weights: `y` stands in (an input of type `T`).
    let (qw, kw) = match &norms {
        Some(n) => (n.query.clone(), n.key.clone()),
        None => (y.clone(), y.clone()),
    };
    let inputs = [y.clone(), qw, kw, rotation.divisors.clone(), rotation.positions.astype(Dtype::Int32)?, params];
    let shape = KernelShape { heads, kv_heads, head_dim, norm: norms.is_some(), per_row };
    let out = call_compiled(&COMPILED, shape, "qkv heads", launch, &inputs)?;
    Ok(Some(out.try_into().expect("three outputs")))
}

/// What a kernel instance is specialised for.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct KernelShape {
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    norm: bool,
    per_row: bool,
}

/// Runs the kernel on `[y, qw, kw, divisors, pos, params]`.
fn launch(inputs: &[Array], s: KernelShape) -> Result<Vec<Array>> {
    let (y, dtype) = (&inputs[0], inputs[0].dtype());
    let (batch, threads) = (y.shape()[0], (s.head_dim / 2 + 31) / 32 * 32);
    let head = |n: i32| [batch, n, 1, s.head_dim];
    let launch = KernelLaunch::new([threads, s.heads + 2 * s.kv_heads, batch], [threads, 1, 1])
        .output(&head(s.heads), dtype)
        .output(&head(s.kv_heads), dtype)
        .output(&head(s.kv_heads), dtype)
        .template("T", TemplateArg::Dtype(dtype))
        .template("D", TemplateArg::Int(s.head_dim))
        .template("HQ", TemplateArg::Int(s.heads))
        .template("HKV", TemplateArg::Int(s.kv_heads))
        .template("NORM", TemplateArg::Bool(s.norm))
        .template("PER_ROW", TemplateArg::Bool(s.per_row));
    KERNEL.call(inputs, &launch)
}

thread_local! {
    static COMPILED: CompiledKernels<KernelShape> = RefCell::new(HashMap::new());
}

/// Whether work placed now runs on MLX's CUDA backend.
pub(super) fn on_cuda() -> bool {
    rmlx::current_device().kind == DeviceType::Gpu && gpu_backend() == Some(GpuBackend::Cuda)
}

/// One thread's compiled kernel calls, one per kernel instance (kept for the thread's life, as
/// `nn::gated` keeps its functions).
pub(super) type CompiledKernels<K> = RefCell<HashMap<K, ManuallyDrop<Compiled>>>;

/// Runs `launch(inputs, key)` through a function compiled once per `key` and thread: MLX then
/// replays the traced kernel node instead of assembling the kernel's source and signature on
/// every call.
pub(super) fn call_compiled<K: Copy + Eq + Hash + Send + Sync + 'static>(
    cache: &'static LocalKey<CompiledKernels<K>>,
    key: K,
    name: &str,
    launch: fn(&[Array], K) -> Result<Vec<Array>>,
    inputs: &[Array],
) -> Result<Vec<Array>> {
    cache.with(|c| {
        let mut c = c.borrow_mut();
        let f = c.entry(key).or_insert_with(|| {
            let options = CompileOptions { shapeless: false, name: Some(name.into()) };
            ManuallyDrop::new(compile_with(move |x: &[Array]| launch(x, key), options))
        });
        f.call(inputs)
    })
}
