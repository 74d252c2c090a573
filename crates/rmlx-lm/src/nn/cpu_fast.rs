//! RMSNorm, RoPE, SwiGLU and the sampler's log-softmax on the CPU, as one primitive each (and
//! their arithmetic on slices, which the fused decoding step, [`super::cpu_layer`], shares);
//! attention over a key/value cache is [`super::cpu_attention`]'s, re-exported here.
//!
//! MLX's CPU backend has no kernels for its fused `rms_norm` and `rope`: it composes each from
//! a dozen or more small operations (squares, sums, broadcasts, `Arange`, `Sin`, `Cos`,
//! `Concatenate`…), and a decoding step of the default 30-layer model counted ~3,900 operations,
//! 131 a layer, each paying MLX's scheduling. These primitives do the same arithmetic in one pass,
//! in float32, and round once to the input's dtype.
//!
//! They have no derivatives: [`applies`] keeps them out of training and of traced transforms,
//! where MLX's operations (differentiable) stay in use. On the GPU, MLX's own kernels run.

pub use super::cpu_attention::cache_attention;
use crate::nn::cpu_qmm::{to_f32, Scalar};
use crate::nn::training;
use half::{bf16, f16};
use rmlx::custom::{apply, CpuTensor, CpuTensorMut, CustomPrimitive};
use rmlx::fast::TensorSpec;
use rmlx::{Array, DeviceType, Dtype, Error, Result};
use std::borrow::Cow;

/// A CPU tensor's values in their float type, borrowed: what rmlx's CPU primitives read of
/// caches, scales and biases without converting all of them.
#[derive(Clone, Copy)]
pub(crate) enum Floats<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

impl<'a> Floats<'a> {
    /// The values of `t` (float32, bfloat16 or float16).
    pub(crate) fn of(t: &'a CpuTensor<'_>) -> Result<Self> {
        Ok(match t.dtype() {
            Dtype::Float32 => Floats::F32(t.as_slice()?),
            Dtype::Bfloat16 => Floats::Bf16(t.as_slice()?),
            Dtype::Float16 => Floats::F16(t.as_slice()?),
            d => return Err(Error::InvalidArgument(format!("a tensor of dtype {d:?}"))),
        })
    }

    /// The values from element `at` on.
    pub(crate) fn at(self, at: usize) -> Self {
        match self {
            Floats::F32(s) => Floats::F32(&s[at..]),
            Floats::Bf16(s) => Floats::Bf16(&s[at..]),
            Floats::F16(s) => Floats::F16(&s[at..]),
        }
    }

    /// How many values there are.
    pub(crate) fn len(self) -> usize {
        match self {
            Floats::F32(s) => s.len(),
            Floats::Bf16(s) => s.len(),
            Floats::F16(s) => s.len(),
        }
    }

    /// Values `range` in float32: borrowed when they are, converted otherwise.
    pub(crate) fn widened(self, range: std::ops::Range<usize>) -> Cow<'a, [f32]> {
        match self {
            Floats::F32(s) => f32::widened(&s[range]),
            Floats::Bf16(s) => bf16::widened(&s[range]),
            Floats::F16(s) => f16::widened(&s[range]),
        }
    }
}

/// Whether the primitives serve `x` here: on the CPU, outside training and transforms, for a
/// float32, bfloat16 or float16 `x`.
pub fn applies(x: &Array) -> bool {
    rmlx::current_device().kind == DeviceType::Cpu
        && matches!(x.dtype(), Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        && !training()
        && !x.is_tracer()
}

/// `x / sqrt(mean(x²) + eps) · weight` over the last axis; `weight` `[D]` of `x`'s dtype.
pub fn rms_norm(x: &Array, weight: &Array, eps: f32) -> Result<Array> {
    let out = apply(RmsNormCpu { eps }, &[x.clone(), weight.clone()])?;
    Ok(out.into_iter().next().expect("one output"))
}

/// Rotary embedding of the halves `(i, i + dims/2)` of the first `dims` features of `x`
/// `[B, H, L, D]`: position `offsets[b] + l` (or `offsets[0]` for every row) times `scale`,
/// divided by `divisors[i]` (`[dims/2]`, float32), is the angle of pair `i`.
pub fn rope(x: &Array, dims: i32, divisors: &Array, scale: f32, offsets: &Array) -> Result<Array> {
    let out = apply(RopeCpu { dims: dims as usize, scale }, &[x.clone(), divisors.clone(), offsets.clone()])?;
    Ok(out.into_iter().next().expect("one output"))
}

/// `x - logsumexp(x)` along the last axis of a float32 `x`, computed as MLX's CPU backend computes
/// it (the maximum, then the sum of MLX's `exp` of `x - max` in order, then `ln(sum) + max`), in
/// one pass of vectorised exponentials: MLX's own composes it from calls into libm per element,
/// ~1 ms a step over a 49,152-token vocabulary.
pub fn log_softmax(x: &Array) -> Result<Array> {
    let out = apply(LogSoftmaxCpu, std::slice::from_ref(x))?;
    Ok(out.into_iter().next().expect("one output"))
}

/// `silu(gate) · up` of two arrays of one shape and dtype, computed as MLX's CPU backend computes
/// the composed graph (its sigmoid on its own `exp`, each intermediate rounded to the dtype), in
/// one vectorised pass split over the threads: MLX's composes it from calls into libm per
/// element, a sixth of a prompt's time on the default model.
pub fn swiglu_activation(gate: &Array, up: &Array) -> Result<Array> {
    let out = apply(SwiGluCpu, &[gate.clone(), up.clone()])?;
    Ok(out.into_iter().next().expect("one output"))
}

/// The divisors of plain RoPE: `base^(2i/dims)`.
pub fn base_divisors(base: f32, dims: i32) -> Result<Array> {
    let d: Vec<f32> = (0..dims / 2).map(|i| (base as f64).powf(2.0 * i as f64 / dims as f64) as f32).collect();
    Array::from_slice(&d, &[dims / 2])
}

struct RmsNormCpu {
    eps: f32,
}

impl CustomPrimitive for RmsNormCpu {
    fn name(&self) -> String {
        "CpuRmsNorm".into()
    }

    fn output_specs(&self, inputs: &[TensorSpec]) -> Result<Vec<TensorSpec>> {
        let (x, w) = (&inputs[0], &inputs[1]);
        if w.shape.len() != 1 || x.shape.last() != w.shape.first() || x.dtype != w.dtype {
            return Err(Error::InvalidArgument(format!(
                "rms_norm: weight {:?} ({:?}) does not fit x {:?} ({:?})",
                w.shape, w.dtype, x.shape, x.dtype
            )));
        }
        Ok(vec![x.clone()])
    }

    fn eval_cpu(&self, inputs: &[CpuTensor<'_>], outputs: &mut [CpuTensorMut<'_>]) -> Result<()> {
        let d = *inputs[0].shape().last().unwrap_or(&1) as usize;
        let (x, w) = (to_f32(&inputs[0])?, to_f32(&inputs[1])?);
        let mut y = vec![0f32; x.len()];
        for (xr, yr) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
            rms_row(xr, &w, self.eps, yr);
        }
        store(&mut outputs[0], &y)
    }

    fn is_equivalent(&self, other: &Self) -> bool {
        self.eps == other.eps
    }
}

struct LogSoftmaxCpu;

impl CustomPrimitive for LogSoftmaxCpu {
    fn name(&self) -> String {
        "CpuLogSoftmax".into()
    }

    fn output_specs(&self, inputs: &[TensorSpec]) -> Result<Vec<TensorSpec>> {
        let x = &inputs[0];
        if x.dtype != Dtype::Float32 || x.shape.last().is_none_or(|&v| v == 0) {
            return Err(Error::InvalidArgument(format!("log_softmax: x {:?} ({:?})", x.shape, x.dtype)));
        }
        Ok(vec![x.clone()])
    }

    fn eval_cpu(&self, inputs: &[CpuTensor<'_>], outputs: &mut [CpuTensorMut<'_>]) -> Result<()> {
        let v = *inputs[0].shape().last().unwrap_or(&1) as usize;
        let x = inputs[0].as_slice::<f32>()?;
        let out = outputs[0].as_mut_slice::<f32>()?;
        for (row, out) in x.chunks_exact(v).zip(out.chunks_exact_mut(v)) {
            log_softmax_row(row, out);
        }
        Ok(())
    }

    fn is_equivalent(&self, _other: &Self) -> bool {
        true
    }
}

fn log_softmax_row(x: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("fma") {
        // SAFETY: the processor has FMA.
        return unsafe { log_softmax_row_fma(x, out) };
    }
    log_softmax_row_portable(x, out)
}

/// [`log_softmax_row`] with the fused multiply-adds of MLX's `exp` as instructions.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn log_softmax_row_fma(x: &[f32], out: &mut [f32]) {
    log_softmax_row_portable(x, out)
}

#[inline(always)]
fn log_softmax_row_portable(x: &[f32], out: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    // The exponentials into `out` first (vectorised), then summed in order, as MLX sums them.
    out.iter_mut().zip(x).for_each(|(o, &v)| *o = mlx_exp(v - max));
    let sum = out.iter().fold(0f32, |s, &e| s + e);
    let lse = if max.is_infinite() { max } else { sum.ln() + max };
    out.iter_mut().zip(x).for_each(|(o, &v)| *o = v - lse);
}

struct SwiGluCpu;

/// Elements per parallel part of [`SwiGluCpu`].
const SWIGLU_PART: usize = 1 << 14;

impl CustomPrimitive for SwiGluCpu {
    fn name(&self) -> String {
        "CpuSwiGlu".into()
    }

    fn output_specs(&self, inputs: &[TensorSpec]) -> Result<Vec<TensorSpec>> {
        let (g, u) = (&inputs[0], &inputs[1]);
        if g.shape != u.shape || g.dtype != u.dtype {
            return Err(Error::InvalidArgument(format!(
                "swiglu: gate {:?} ({:?}) and up {:?} ({:?}) differ",
                g.shape, g.dtype, u.shape, u.dtype
            )));
        }
        Ok(vec![g.clone()])
    }

    fn eval_cpu(&self, inputs: &[CpuTensor<'_>], outputs: &mut [CpuTensorMut<'_>]) -> Result<()> {
        let dtype = inputs[0].dtype();
        let (g, u) = (to_f32(&inputs[0])?, to_f32(&inputs[1])?);
        let mut y = vec![0f32; g.len()];
        super::cpu_pool::for_each_part(&mut y, SWIGLU_PART, |part, out| {
            let at = part * SWIGLU_PART;
            let range = at..at + out.len();
            out.copy_from_slice(&swiglu(&g[range.clone()], &u[range], dtype));
        });
        store(&mut outputs[0], &y)
    }

    fn is_equivalent(&self, _other: &Self) -> bool {
        true
    }
}

struct RopeCpu {
    dims: usize,
    scale: f32,
}

impl CustomPrimitive for RopeCpu {
    fn name(&self) -> String {
        "CpuRope".into()
    }

    fn output_specs(&self, inputs: &[TensorSpec]) -> Result<Vec<TensorSpec>> {
        let (x, div, off) = (&inputs[0], &inputs[1], &inputs[2]);
        let fits = x.shape.len() == 4
            && self.dims.is_multiple_of(2)
            && self.dims <= x.shape[3] as usize
            && div.shape == [self.dims as i32 / 2]
            && div.dtype == Dtype::Float32
            && off.dtype == Dtype::Int32
            && off.shape.len() == 1
            && (off.shape[0] == 1 || off.shape[0] == x.shape[0]);
        if !fits {
            return Err(Error::InvalidArgument(format!(
                "rope: x {:?}, {} dims, divisors {:?} ({:?}), offsets {:?} ({:?})",
                x.shape, self.dims, div.shape, div.dtype, off.shape, off.dtype
            )));
        }
        Ok(vec![x.clone()])
    }

    fn eval_cpu(&self, inputs: &[CpuTensor<'_>], outputs: &mut [CpuTensorMut<'_>]) -> Result<()> {
        let s = inputs[0].shape();
        let (b, h, l, d) = (s[0] as usize, s[1] as usize, s[2] as usize, s[3] as usize);
        let x = to_f32(&inputs[0])?;
        let divisors = inputs[1].as_slice::<f32>()?;
        let offsets = inputs[2].as_slice::<i32>()?;
        let half = self.dims / 2;
        let mut y = x.clone();
        let mut angles = Angles::new(half);
        for bi in 0..b {
            let first = offsets[if offsets.len() == 1 { 0 } else { bi }] as f64;
            for p in 0..l {
                // The angles of this position, shared by the heads.
                angles.at(first + p as f64, self.scale, divisors);
                for head in 0..h {
                    let at = ((bi * h + head) * l + p) * d;
                    angles.rotate(&x[at..at + d], &mut y[at..at + d]);
                }
            }
        }
        store(&mut outputs[0], &y)
    }

    fn is_equivalent(&self, other: &Self) -> bool {
        self.dims == other.dims && self.scale == other.scale
    }
}

/// `silu(g) · u` as the composed graph computes it on the CPU: MLX's sigmoid (its own `exp`, the
/// exponential rounded to `dtype`), times `g`, times `u`, each result rounded to `dtype`.
pub(crate) fn swiglu(g: &[f32], u: &[f32], dtype: Dtype) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("fma") {
        // SAFETY: the processor has FMA.
        return unsafe { swiglu_fma(g, u, dtype) };
    }
    swiglu_portable(g, u, dtype)
}

/// [`swiglu`] with the fused multiply-adds of MLX's `exp` as instructions, not calls into libm.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn swiglu_fma(g: &[f32], u: &[f32], dtype: Dtype) -> Vec<f32> {
    swiglu_portable(g, u, dtype)
}

#[inline(always)]
fn swiglu_portable(g: &[f32], u: &[f32], dtype: Dtype) -> Vec<f32> {
    let mut exp: Vec<f32> = g.iter().map(|&g| mlx_exp(g.abs())).collect();
    round(&mut exp, dtype);
    let mut y: Vec<f32> = g
        .iter()
        .zip(&exp)
        .map(|(&g, &e)| {
            let s = 1.0 / (1.0 + e);
            if g < 0.0 {
                s
            } else {
                1.0 - s
            }
        })
        .collect();
    round(&mut y, dtype);
    y.iter_mut().zip(g).for_each(|(s, g)| *s *= g);
    round(&mut y, dtype);
    y.iter_mut().zip(u).for_each(|(a, u)| *a *= u);
    round(&mut y, dtype);
    y
}

/// Rounds every value to `dtype`, as storing it in an array of that dtype would.
pub(crate) fn round(v: &mut [f32], dtype: Dtype) {
    match dtype {
        Dtype::Bfloat16 => v.iter_mut().for_each(|x| *x = round_bf16(*x)),
        Dtype::Float16 => v.iter_mut().for_each(|x| *x = f16::from_f32(*x).to_f32()),
        _ => {}
    }
}

/// `x` rounded to the nearest bfloat16 (ties to even), as `bf16::from_f32` rounds, without its
/// branches (NaN stays NaN, overflow becomes infinity).
#[inline]
fn round_bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    let rounded = f32::from_bits((bits.wrapping_add(0x7FFF + ((bits >> 16) & 1))) & 0xFFFF_0000);
    if x.is_nan() {
        x
    } else {
        rounded
    }
}

/// MLX's CPU `exp` (a degree-6 polynomial of the fraction of `x / ln 2`, scaled by a power of
/// two), so that results built on it equal MLX's bit for bit.
#[inline(always)]
#[allow(clippy::excessive_precision, clippy::approx_constant)] // MLX's constants, as written there
pub(crate) fn mlx_exp(x: f32) -> f32 {
    let t = x * 1.442695;
    let whole = (t + 0.5).floor();
    let f = t - whole;
    let mut p = 1.535336188319500e-4f32;
    for c in [
        1.339887440266574e-3,
        9.618437357674640e-3,
        5.550332471162809e-2,
        2.402264791363012e-1,
        6.931472028550421e-1,
        1.0,
    ] {
        p = p.mul_add(f, c);
    }
    let power = f32::from_bits(((whole as i32).wrapping_add(127) << 23) as u32);
    if x.is_nan() {
        x
    } else if x > 88.0 {
        f32::INFINITY
    } else if x < -88.0 {
        0.0
    } else {
        power * p
    }
}

/// `x / sqrt(mean(x²) + eps) · w` of one row, in float32.
pub(crate) fn rms_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let mean = dot(x, x) / x.len() as f32;
    let r = 1.0 / (mean + eps).sqrt();
    for ((o, v), g) in out.iter_mut().zip(x).zip(w) {
        *o = v * r * g;
    }
}

/// `Σ a·b` with eight independent sums, which the compiler keeps in one vector register.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    dot_as::<false>(a, b)
}

/// [`dot`] with fused multiply-adds (`FMA`) or a product and a sum: eight lanes, then the lanes
/// summed in order, then the tail past a multiple of eight.
#[inline(always)]
pub(crate) fn dot_as<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail = ac.remainder().iter().zip(bc.remainder()).fold(0f32, |t, (x, y)| madd::<FMA>(*x, *y, t));
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            lanes[i] = madd::<FMA>(x[i], y[i], lanes[i]);
        }
    }
    lanes.iter().fold(0f32, |t, &l| t + l) + tail
}

/// `a · b + c`, fused or not.
#[inline(always)]
pub(crate) fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// The cosines and sines of one position's rotary angles.
pub(crate) struct Angles {
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Angles {
    pub fn new(pairs: usize) -> Self {
        Angles { cos: vec![0f32; pairs], sin: vec![0f32; pairs] }
    }

    /// The angles of `position · scale / divisors[i]`, computed in float64.
    pub fn at(&mut self, position: f64, scale: f32, divisors: &[f32]) {
        let position = position * scale as f64;
        for (i, div) in divisors.iter().enumerate() {
            let (s, c) = (position / *div as f64).sin_cos();
            (self.cos[i], self.sin[i]) = (c as f32, s as f32);
        }
    }

    /// Rotates the pairs `(i, i + pairs)` of `x` into `y` (features past `2 · pairs` are left).
    pub fn rotate(&self, x: &[f32], y: &mut [f32]) {
        let half = self.cos.len();
        for i in 0..half {
            let (c, s) = (self.cos[i], self.sin[i]);
            let (a, z) = (x[i], x[i + half]);
            y[i] = a * c - z * s;
            y[i + half] = a * s + z * c;
        }
    }
}

/// Writes `y` into `out`, rounded once to its dtype.
pub(crate) fn store(out: &mut CpuTensorMut<'_>, y: &[f32]) -> Result<()> {
    store_at(out, 0, y)
}

/// Writes `y` into `out` from element `start` on, in `out`'s dtype (`y` must fit).
pub(crate) fn store_at(out: &mut CpuTensorMut<'_>, start: usize, y: &[f32]) -> Result<()> {
    fn part<T>(all: &mut [T], start: usize, len: usize) -> Result<&mut [T]> {
        let total = all.len();
        all.get_mut(start..start + len)
            .ok_or_else(|| Error::InvalidArgument(format!("{len} values from {start} in an output of {total}")))
    }
    match out.dtype() {
        Dtype::Float32 => part(out.as_mut_slice::<f32>()?, start, y.len())?.copy_from_slice(y),
        Dtype::Bfloat16 => part(out.as_mut_slice::<bf16>()?, start, y.len())?
            .iter_mut()
            .zip(y)
            .for_each(|(o, v)| *o = bf16::from_f32(*v)),
        Dtype::Float16 => part(out.as_mut_slice::<f16>()?, start, y.len())?
            .iter_mut()
            .zip(y)
            .for_each(|(o, v)| *o = f16::from_f32(*v)),
        d => return Err(Error::InvalidArgument(format!("an output of dtype {d:?}"))),
    }
    Ok(())
}
