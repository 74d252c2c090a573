//! RMSNorm, RoPE and one query's attention over a key/value cache on the CPU, as one primitive
//! each.
//!
//! MLX's CPU backend has no kernels for its fused `rms_norm` and `rope`: it composes each from
//! a dozen or more small operations (squares, sums, broadcasts, `Arange`, `Sin`, `Cos`,
//! `Concatenate`…), and a decoding step of the default 30-layer model counted ~3,900 operations,
//! 131 a layer, each paying MLX's scheduling. These primitives do the same arithmetic in one pass,
//! in float32, and round once to the input's dtype.
//!
//! They have no derivatives: [`applies`] keeps them out of training and of traced transforms,
//! where MLX's operations (differentiable) stay in use. On the GPU, MLX's own kernels run.

use crate::nn::cpu_qmm::to_f32;
use crate::nn::training;
use half::{bf16, f16};
use rmlx::custom::{apply, CpuTensor, CpuTensorMut, CustomPrimitive};
use rmlx::fast::TensorSpec;
use rmlx::{Array, DeviceType, Dtype, Error, Result};

/// Whether the primitives serve `x` here: on the CPU, outside training and transforms, for a
/// float32, bfloat16 or float16 `x`.
pub fn applies(x: &Array) -> bool {
    rmlx::default_device().kind == DeviceType::Cpu
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

/// Attention of one query position, `q` `[B, Hq, 1, D]`, over the first `valid` positions of
/// the cache buffers `keys`, `values` `[B, Hkv, capacity, D]` (`Hq` a multiple of `Hkv`: query
/// head `h` reads key/value head `h / (Hq / Hkv)`), scores multiplied by `scale`. Softmax and
/// sums in float32.
pub fn decode_attention(q: &Array, keys: &Array, values: &Array, valid: usize, scale: f32) -> Result<Array> {
    let op = DecodeAttentionCpu { valid, scale };
    let out = apply(op, &[q.clone(), keys.clone(), values.clone()])?;
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
            let mean = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
            let r = 1.0 / (mean + self.eps).sqrt();
            for ((o, v), g) in yr.iter_mut().zip(xr).zip(&w) {
                *o = v * r * g;
            }
        }
        store(&mut outputs[0], &y)
    }

    fn is_equivalent(&self, other: &Self) -> bool {
        self.eps == other.eps
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
            && self.dims % 2 == 0
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
        let (mut cos, mut sin) = (vec![0f32; l * half], vec![0f32; l * half]);
        for bi in 0..b {
            // The angles of this row's positions, shared by its heads.
            let first = offsets[if offsets.len() == 1 { 0 } else { bi }] as f64;
            for p in 0..l {
                let position = (first + p as f64) * self.scale as f64;
                for (i, div) in divisors.iter().enumerate() {
                    let (s, c) = (position / *div as f64).sin_cos();
                    (cos[p * half + i], sin[p * half + i]) = (c as f32, s as f32);
                }
            }
            for row in 0..h * l {
                let p = row % l;
                let at = (bi * h * l + row) * d;
                let (xr, yr) = (&x[at..at + d], &mut y[at..at + d]);
                for i in 0..half {
                    let (c, s) = (cos[p * half + i], sin[p * half + i]);
                    let (a, z) = (xr[i], xr[i + half]);
                    yr[i] = a * c - z * s;
                    yr[i + half] = a * s + z * c;
                }
            }
        }
        store(&mut outputs[0], &y)
    }

    fn is_equivalent(&self, other: &Self) -> bool {
        self.dims == other.dims && self.scale == other.scale
    }
}

struct DecodeAttentionCpu {
    valid: usize,
    scale: f32,
}

impl CustomPrimitive for DecodeAttentionCpu {
    fn name(&self) -> String {
        "CpuDecodeAttention".into()
    }

    fn output_specs(&self, inputs: &[TensorSpec]) -> Result<Vec<TensorSpec>> {
        let (q, k, v) = (&inputs[0], &inputs[1], &inputs[2]);
        let fits = q.shape.len() == 4
            && q.shape[2] == 1
            && k.shape.len() == 4
            && k.shape == v.shape
            && k.shape[0] == q.shape[0]
            && k.shape[1] > 0
            && q.shape[1] % k.shape[1] == 0
            && k.shape[3] == q.shape[3]
            && self.valid >= 1
            && self.valid <= k.shape[2] as usize
            && q.dtype == k.dtype
            && k.dtype == v.dtype;
        if !fits {
            return Err(Error::InvalidArgument(format!(
                "decode attention: q {:?}, keys {:?}, values {:?}, {} valid positions",
                q.shape, k.shape, v.shape, self.valid
            )));
        }
        Ok(vec![q.clone()])
    }

    fn eval_cpu(&self, inputs: &[CpuTensor<'_>], outputs: &mut [CpuTensorMut<'_>]) -> Result<()> {
        let (qs, ks) = (inputs[0].shape(), inputs[1].shape());
        let (b, hq, d) = (qs[0] as usize, qs[1] as usize, qs[3] as usize);
        let (hkv, capacity) = (ks[1] as usize, ks[2] as usize);
        let q = to_f32(&inputs[0])?;
        let (keys, values) = (Rows::of(&inputs[1])?, Rows::of(&inputs[2])?);
        let mut y = vec![0f32; q.len()];
        let mut scores = vec![0f32; self.valid];
        let mut row = vec![0f32; d];
        for bi in 0..b {
            for h in 0..hq {
                let kv = bi * hkv + h / (hq / hkv);
                let qh = &q[(bi * hq + h) * d..][..d];
                for (j, s) in scores.iter_mut().enumerate() {
                    keys.read((kv * capacity + j) * d, &mut row);
                    *s = self.scale * qh.iter().zip(&row).map(|(a, b)| a * b).sum::<f32>();
                }
                let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                let mut total = 0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    total += *s;
                }
                let out = &mut y[(bi * hq + h) * d..][..d];
                for (j, p) in scores.iter().enumerate() {
                    values.read((kv * capacity + j) * d, &mut row);
                    let w = p / total;
                    out.iter_mut().zip(&row).for_each(|(o, v)| *o += w * v);
                }
            }
        }
        store(&mut outputs[0], &y)
    }

    fn is_equivalent(&self, other: &Self) -> bool {
        self.valid == other.valid && self.scale == other.scale
    }
}

/// A cache buffer read a row at a time, converted to float32 (only the rows attention reads).
enum Rows<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

impl<'a> Rows<'a> {
    fn of(t: &'a CpuTensor<'_>) -> Result<Rows<'a>> {
        Ok(match t.dtype() {
            Dtype::Float32 => Rows::F32(t.as_slice::<f32>()?),
            Dtype::Bfloat16 => Rows::Bf16(t.as_slice::<bf16>()?),
            Dtype::Float16 => Rows::F16(t.as_slice::<f16>()?),
            d => return Err(Error::InvalidArgument(format!("a tensor of dtype {d:?}"))),
        })
    }

    fn read(&self, at: usize, row: &mut [f32]) {
        let n = row.len();
        match self {
            Rows::F32(s) => row.copy_from_slice(&s[at..at + n]),
            Rows::Bf16(s) => row.iter_mut().zip(&s[at..at + n]).for_each(|(r, v)| *r = v.to_f32()),
            Rows::F16(s) => row.iter_mut().zip(&s[at..at + n]).for_each(|(r, v)| *r = v.to_f32()),
        }
    }
}

/// Writes `y` into `out`, rounded once to its dtype.
fn store(out: &mut CpuTensorMut<'_>, y: &[f32]) -> Result<()> {
    match out.dtype() {
        Dtype::Float32 => out.as_mut_slice::<f32>()?.copy_from_slice(y),
        Dtype::Bfloat16 => out.as_mut_slice::<bf16>()?.iter_mut().zip(y).for_each(|(o, v)| *o = bf16::from_f32(*v)),
        Dtype::Float16 => out.as_mut_slice::<f16>()?.iter_mut().zip(y).for_each(|(o, v)| *o = f16::from_f32(*v)),
        d => return Err(Error::InvalidArgument(format!("an output of dtype {d:?}"))),
    }
    Ok(())
}
