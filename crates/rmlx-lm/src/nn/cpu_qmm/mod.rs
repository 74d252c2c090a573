//! Products with MLX affine-quantised matrices on the CPU, for the few rows of a decoding step.
//!
//! MLX's CPU `quantized_matmul` runs one thread and no SIMD; decoding a quantised model on the
//! CPU was slower than decoding it dequantised to float32, which reads six times the bytes. This
//! primitive reads the packed weights (4 or 8 bits, MLX's layout: values packed low bits first
//! in `uint32` words, a scale and a bias per group of the row) and multiplies them with `x`, with
//! AVX2 and FMA (and AVX-512 for the float form) where the processor has them (detected at run
//! time), in one of three forms:
//!
//! - up to [`CPU_QMM_MAX_ROWS`] rows (a decoding step) of bfloat16 or float16: the integer form
//!   ([`int8`]), `x` rounded to 8 bits per block of 32 as llama.cpp rounds its activations,
//!   integer dot products, about three times fewer instructions per value;
//! - up to [`CPU_QMM_MAX_ROWS`] rows of float32: the float form ([`float`](mod@float)), every
//!   weight unpacked to a float, exact to float32 summation (the integer form moved the default
//!   model's logits by up to 0.5 against transformers' and changed greedy tokens: float32 stays
//!   exact);
//! - more rows (a prompt): the panel form ([`gemm`]), exact to float32 summation.
//!
//! Large products (the output head over the vocabulary) split their columns over the cores
//! ([`super::cpu_pool`]); a layer's projections alone run on the evaluating thread (the fused
//! decoding step, [`super::cpu_layer`], splits them too, through [`row_products`]).
//!
//! [`serves`] says which quantised matrices these products take: the loader keeps those
//! quantised on the CPU and dequantises the others.

pub(crate) mod float;
mod gemm;
mod int8;

use super::cpu_fast::Floats;
use half::{bf16, f16};
use rmlx::custom::{apply, CpuTensor, CpuTensorMut, CustomPrimitive};
use rmlx::fast::TensorSpec;
use rmlx::quantization::{QuantMode, Quantized};
use rmlx::{Array, Dtype, Error, Result};
use std::borrow::Cow;

/// The most rows of `x` multiplied row by row; more (a prompt) take the panel form ([`gemm`]), in
/// float32 whatever the input dtype.
pub const CPU_QMM_MAX_ROWS: usize = 8;

/// `x @ dequantize(q).T` on the CPU for affine 4- or 8-bit `q`, or `None` where this primitive
/// does not apply (another mode or width, a group size that does not divide into words, an input
/// dtype other than float32, bfloat16 or float16).
pub fn cpu_quantized_matmul(x: &Array, q: &Quantized) -> Result<Option<Array>> {
    let rows: i64 = x.shape()[..x.ndim().saturating_sub(1)].iter().map(|&d| d as i64).product();
    if !serves(q) || !float(x.dtype()) {
        return Ok(None);
    }
    let Some(biases) = &q.biases else { return Ok(None) };
    let group = q.group_size as usize;
    // A decoding step's few half-precision rows take the integer form (see `int8`), float32 rows
    // the float one.
    let integer = x.dtype() != Dtype::Float32 && group.is_multiple_of(int8::BLOCK) && rows as usize <= CPU_QMM_MAX_ROWS;
    let op = CpuQmm { group, bits: q.bits as usize, integer };
    let out = apply(op, &[x.clone(), q.weight.clone(), q.scales.clone(), biases.clone()])?;
    Ok(out.into_iter().next())
}

/// Whether [`cpu_quantized_matmul`] takes products with `q` (for float inputs): affine 4- or
/// 8-bit values with biases, groups that fill whole `uint32` words, float scales.
pub fn serves(q: &Quantized) -> bool {
    q.mode == QuantMode::Affine
        && matches!(q.bits, 4 | 8)
        && q.group_size > 0
        && q.group_size % (32 / q.bits) == 0
        && float(q.scales.dtype())
        && q.biases.is_some()
}

fn float(d: Dtype) -> bool {
    matches!(d, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
}

struct CpuQmm {
    group: usize,
    bits: usize,
    /// The integer form ([`int8`]) rather than the float one.
    integer: bool,
}

impl CustomPrimitive for CpuQmm {
    fn name(&self) -> String {
        let form = if self.integer { "Int8" } else { "" };
        format!("CpuAffineQmm{}x{}{form}", self.bits, self.group)
    }

    fn output_specs(&self, inputs: &[TensorSpec]) -> Result<Vec<TensorSpec>> {
        let (x, w) = (&inputs[0], &inputs[1]);
        let k = *x.shape.last().unwrap_or(&0);
        let per_word = (32 / self.bits) as i32;
        if w.shape.len() != 2 || w.shape[1] * per_word != k || k % self.group as i32 != 0 {
            return Err(Error::InvalidArgument(format!(
                "quantised weights {:?} ({} bits) do not fit inputs of {k} features",
                w.shape, self.bits
            )));
        }
        let mut shape = x.shape.clone();
        *shape.last_mut().expect("checked") = w.shape[0];
        Ok(vec![TensorSpec::new(&shape, x.dtype)])
    }

    fn eval_cpu(&self, inputs: &[CpuTensor<'_>], outputs: &mut [CpuTensorMut<'_>]) -> Result<()> {
        let k = *inputs[0].shape().last().unwrap_or(&0) as usize;
        let x = to_f32(&inputs[0])?;
        let packed = Packed::of(&inputs[1], &inputs[2], &inputs[3], self.bits, self.group)?;
        let (n, m) = (packed.n, x.len() / k.max(1));
        let y = if m > CPU_QMM_MAX_ROWS {
            packed.gemm(&x)
        } else {
            packed.product(&x, self.integer, n * k * m >= PARALLEL_MIN_PRODUCTS)
        };
        // `y` is [n, m]; the output [m, n].
        let out = &mut outputs[0];
        match out.dtype() {
            Dtype::Float32 => write_transposed(out.as_mut_slice::<f32>()?, &y, m, n, |v| v),
            Dtype::Bfloat16 => write_transposed(out.as_mut_slice::<bf16>()?, &y, m, n, bf16::from_f32),
            Dtype::Float16 => write_transposed(out.as_mut_slice::<f16>()?, &y, m, n, f16::from_f32),
            d => return Err(Error::InvalidArgument(format!("output of dtype {d:?}"))),
        }
        Ok(())
    }

    fn is_equivalent(&self, other: &Self) -> bool {
        self.group == other.group && self.bits == other.bits && self.integer == other.integer
    }
}

/// A float element of a tensor (a scale, a bias, an activation, a cached key).
pub(crate) trait Scalar: Copy + Send + Sync {
    fn f(self) -> f32;

    /// `values` as float32: borrowed if they are float32, widened otherwise.
    fn widened(values: &[Self]) -> Cow<'_, [f32]> {
        Cow::Owned(values.iter().map(|v| v.f()).collect())
    }
}

impl Scalar for f32 {
    #[inline(always)]
    fn f(self) -> f32 {
        self
    }

    fn widened(values: &[Self]) -> Cow<'_, [f32]> {
        Cow::Borrowed(values)
    }
}

impl Scalar for bf16 {
    /// The upper half of the float32 (NaN included), without `to_f32`'s branches.
    #[inline(always)]
    fn f(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

impl Scalar for f16 {
    #[inline(always)]
    fn f(self) -> f32 {
        self.to_f32()
    }

    /// With the processor's conversion instructions where it has them.
    fn widened(values: &[Self]) -> Cow<'_, [f32]> {
        use half::slice::HalfFloatSliceExt;
        let mut out = vec![0f32; values.len()];
        values.convert_to_f32_slice(&mut out);
        Cow::Owned(out)
    }
}

/// A float tensor's values as float32.
pub(crate) fn to_f32(t: &CpuTensor<'_>) -> Result<Vec<f32>> {
    Ok(match t.dtype() {
        Dtype::Float32 => t.as_slice::<f32>()?.to_vec(),
        Dtype::Bfloat16 => bf16::widened(t.as_slice()?).into_owned(),
        Dtype::Float16 => f16::widened(t.as_slice()?).into_owned(),
        d => return Err(Error::InvalidArgument(format!("input of dtype {d:?}"))),
    })
}

fn write_transposed<T>(out: &mut [T], y: &[f32], m: usize, n: usize, cast: impl Fn(f32) -> T) {
    for r in 0..m {
        for c in 0..n {
            out[r * n + c] = cast(y[c * m + r]);
        }
    }
}

/// Products (`rows × columns × inputs`) from which the columns are split over threads. Below it,
/// waking the pool costs more than it saves: a decoding step's projections (under a million
/// products each) run on the evaluating thread, the output head over the vocabulary in parallel.
const PARALLEL_MIN_PRODUCTS: usize = 1 << 22;

/// Output columns per task.
const COLUMNS_PER_TASK: usize = 64;

/// Output columns per task of [`row_products`]. Measured on the 2-core development machine
/// (default model, bfloat16): 16 columns decoded ~15 % slower than 64, and 128 ~5 % faster,
/// within the noise (the threads' parts of the output meet in fewer cache lines).
const ROW_COLUMNS_PER_TASK: usize = 128;

/// A packed matrix as a primitive's CPU evaluation receives it: `[n, k]` values of `bits` bits
/// (MLX's affine layout) with a scale and a bias per group of `group` values of a row.
pub(crate) struct Packed<'a> {
    words: &'a [u32],
    scales: Floats<'a>,
    biases: Floats<'a>,
    bits: usize,
    group: usize,
    /// Rows (output features) and values per row (input features).
    pub n: usize,
    pub k: usize,
}

impl<'a> Packed<'a> {
    /// The matrix of the packed `words` (`[n, k · bits / 32]`) and its `scales` and `biases`
    /// (`[n, k / group]`, of one dtype).
    pub fn of(
        words: &'a CpuTensor<'_>,
        scales: &'a CpuTensor<'_>,
        biases: &'a CpuTensor<'_>,
        bits: usize,
        group: usize,
    ) -> Result<Self> {
        let shape = words.shape();
        let (n, k) = match shape {
            [n, words] => (*n as usize, *words as usize * 32 / bits),
            _ => (0, 0),
        };
        let groups = n * k / group.max(1);
        let (scales, biases) = (Floats::of(scales)?, Floats::of(biases)?);
        let alike = std::mem::discriminant(&scales) == std::mem::discriminant(&biases);
        if shape.len() != 2
            || group == 0
            || k % group != 0
            || scales.len() != groups
            || biases.len() != groups
            || !alike
        {
            return Err(Error::InvalidArgument(format!(
                "packed weights {shape:?} ({bits} bits, groups of {group}) do not match their scales or biases"
            )));
        }
        Ok(Packed { words: words.as_slice()?, scales, biases, bits, group, n, k })
    }

    /// `[n, m]`: every output feature for every row of `x` (`[m, k]`), in the integer form
    /// ([`int8`], `k` a multiple of its block) or the float one, the columns split over threads
    /// with `parallel`.
    pub fn product(&self, x: &[f32], integer: bool, parallel: bool) -> Vec<f32> {
        let prepared = Prepared::new(x, self, integer);
        let mut y = vec![0f32; self.n * prepared.m];
        let chunk = COLUMNS_PER_TASK * prepared.m;
        let work = |task: usize, out: &mut [f32]| self.columns(&prepared, task * COLUMNS_PER_TASK, out);
        if parallel {
            super::cpu_pool::for_each_part(&mut y, chunk, work);
        } else {
            y.chunks_mut(chunk).enumerate().for_each(|(task, out)| work(task, out));
        }
        y
    }

    /// Output features `first..` (as many as `out` holds, `[columns, m]`) for every row of `x`.
    fn columns(&self, x: &Prepared, first: usize, out: &mut [f32]) {
        match (&self.scales, &self.biases) {
            (Floats::F32(s), Floats::F32(b)) => self.columns_of(x, s, b, first, out),
            (Floats::Bf16(s), Floats::Bf16(b)) => self.columns_of(x, s, b, first, out),
            (Floats::F16(s), Floats::F16(b)) => self.columns_of(x, s, b, first, out),
            _ => unreachable!("`Packed::of` checks that scales and biases share a dtype"),
        }
    }

    fn columns_of<S: Scalar>(&self, x: &Prepared, scales: &[S], biases: &[S], first: usize, out: &mut [f32]) {
        let (m, k, bits, group) = (x.m, self.k, self.bits, self.group);
        let columns = out.len() / m;
        let rows = match &x.form {
            Form::Float(rows) => rows,
            Form::Integer(xq) => {
                let matrix = int8::Matrix { words: self.words, scales, biases, bits, group, k };
                let mut dots = [0f32; COLUMNS_PER_TASK];
                for start in (0..columns).step_by(COLUMNS_PER_TASK) {
                    let count = (columns - start).min(COLUMNS_PER_TASK);
                    for r in 0..m {
                        matrix.dots(avx2_fma(), xq, r, first + start, &mut dots[..count]);
                        for (i, v) in dots[..count].iter().enumerate() {
                            out[(start + i) * m + r] = *v;
                        }
                    }
                }
                return;
            }
        };
        let (groups, words) = (k / group, k * bits / 32);
        let (from, to) = (first * groups, (first + columns) * groups);
        let (scales, biases) = (S::widened(&scales[from..to]), S::widened(&biases[from..to]));
        let features = float::Columns {
            w: &self.words[first * words..(first + columns) * words],
            scales: &scales,
            biases: &biases,
        };
        features.dots(rows, out);
    }
}

/// Rows of `x` made ready for products with matrices of one layout, in the form they take.
struct Prepared {
    form: Form,
    m: usize,
}

enum Form {
    /// Unpacked weights times `x` ([`float`](mod@float)).
    Float(float::FloatRows),
    /// `x` quantised for integer products ([`int8`]).
    Integer(int8::QuantizedRows),
}

impl Prepared {
    fn new(x: &[f32], like: &Packed<'_>, integer: bool) -> Self {
        let (k, bits, group) = (like.k, like.bits, like.group);
        let m = x.len() / k.max(1);
        let form = if integer && group % int8::BLOCK == 0 {
            Form::Integer(int8::QuantizedRows::new(x, k, bits, group))
        } else {
            Form::Float(float::FloatRows::new(x, k, bits, group, float::Simd::detect()))
        };
        Prepared { form, m }
    }
}

/// The products of the rows `x` (`[m, k]`, `k` every matrix's input length) with each of
/// `matrices`, computed together: `x` prepared once per layout and all the columns split over the
/// threads at once; each product `[m, n]`. Each row's products are what it gets alone.
pub(crate) fn row_products(x: &[f32], integer: bool, matrices: &[&Packed<'_>]) -> Vec<Vec<f32>> {
    let mut prepared: Vec<((usize, usize), Prepared)> = Vec::new();
    let mut which = Vec::with_capacity(matrices.len());
    for w in matrices {
        let layout = (w.bits, w.group);
        let at = prepared.iter().position(|(l, _)| *l == layout).unwrap_or_else(|| {
            prepared.push((layout, Prepared::new(x, w, integer)));
            prepared.len() - 1
        });
        which.push(at);
    }
    let m = prepared.first().map_or(1, |(_, p)| p.m);
    // `[n, m]` each: a task's columns are one piece of it.
    let mut outputs: Vec<Vec<f32>> = matrices.iter().map(|w| vec![0f32; w.n * m]).collect();
    // Every task: a matrix and a range of its columns.
    let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
    for (i, out) in outputs.iter_mut().enumerate() {
        for (t, part) in out.chunks_mut(ROW_COLUMNS_PER_TASK * m).enumerate() {
            tasks.push((i, t * ROW_COLUMNS_PER_TASK, part));
        }
    }
    let (places, parts): (Vec<(usize, usize)>, Vec<&mut [f32]>) =
        tasks.into_iter().map(|(i, f, p)| ((i, f), p)).unzip();
    super::cpu_pool::for_each(parts, |task, out| {
        let (i, first) = places[task];
        matrices[i].columns(&prepared[which[i]].1, first, out);
    });
    if m > 1 {
        for (out, w) in outputs.iter_mut().zip(matrices) {
            *out = (0..m).flat_map(|r| (0..w.n).map(move |c| (r, c))).map(|(r, c)| out[c * m + r]).collect();
        }
    }
    outputs
}

/// Whether the processor has AVX2 and FMA (checked once per product, not per column).
pub(crate) fn avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    false
}
