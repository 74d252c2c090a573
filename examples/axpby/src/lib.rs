//! # `axpby` as a user-defined MLX primitive
//!
//! MLX's developer guide on custom operations builds one example from end to end: `axpby`,
//! `z = alpha * x + beta * y`. This crate follows the same walk-through with rmlx's
//! [`CustomPrimitive`] trait instead of C++:
//!
//! 1. **The operation** — [`axpby`] is what users call. Like the guide's C++ op, it only resolves
//!    the output dtype (integers and bools become `float32`), broadcasts the two inputs to one
//!    shape, and adds a node to the graph; nothing is computed yet.
//! 2. **The primitive** — [`Axpby`] holds `alpha` and `beta` and tells MLX the output's
//!    shape and dtype.
//! 3. **CPU evaluation** — typed loops over contiguous slices for `float32`, `float64`, `float16`
//!    and `bfloat16` (the half types compute in `f32`).
//! 4. **GPU kernel** — a CUDA (or Metal) kernel from source with `alpha` and `beta` baked into its
//!    text; `float64` stays on the CPU.
//! 5. **Transforms** — `vjp`, `jvp` and `vmap`, written with ordinary ops (and `axpby` itself), so
//!    [`grad`](rmlx::transforms::grad), [`jvp`](rmlx::transforms::jvp),
//!    [`vmap`](rmlx::transforms::vmap) and [`compile`](rmlx::compile::compile) all work.
//! 6. **Results** — the `rmlx-axpby` binary times the primitive against [`axpby_composed`], the
//!    same formula written with ordinary ops.
//!
//! ```
//! use rmlx::{transforms, Array, Axes};
//! use rmlx_axpby::axpby;
//!
//! let x = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
//! let y = Array::from_slice(&[10.0f32, 20.0, 30.0], &[3])?; // broadcast over the rows
//! let z = axpby(&x, &y, 4.0, 2.0)?;
//! assert_eq!(z.shape(), &[2, 3]);
//! assert_eq!(z.to_vec::<f32>()?, vec![24.0, 48.0, 72.0, 36.0, 60.0, 84.0]);
//!
//! // d/dy sum(z) = beta, summed over the broadcast rows.
//! let g = transforms::grad(|a: &[Array]| axpby(&a[0], &a[1], 4.0, 2.0)?.sum(Axes::All, false), &[1]);
//! assert_eq!(g(&[x, y])?[0].to_vec::<f32>()?, vec![4.0, 4.0, 4.0]);
//! # Ok::<(), rmlx::Error>(())
//! ```

use rmlx::custom::{apply, CpuTensor, CpuTensorMut, CustomPrimitive};
use rmlx::fast::{cuda_kernel, metal_kernel, CustomKernel, GpuBackend, KernelLaunch, TemplateArg, TensorSpec};
use rmlx::{bf16, f16, ops, Array, Dtype, Element, Error, Result};

// -------------------------------------------------------------------------------------------------
// 1. The operation

/// `alpha * x + beta * y`, computed by the [`Axpby`] primitive.
///
/// `x` and `y` broadcast against each other (NumPy rules) and promote to a common dtype; integer
/// and bool inputs give `float32`, while `float16`, `bfloat16`, `float32` and `float64` are kept.
/// Shapes that do not broadcast, and complex inputs, are an `Err`.
pub fn axpby(x: &Array, y: &Array, alpha: f32, beta: f32) -> Result<Array> {
    let dtype = match ops::result_type(x, y)? {
        d @ (Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float32 | Dtype::Float64) => d,
        Dtype::Complex64 => return Err(Error::Unsupported("axpby does not support complex64".into())),
        _ => Dtype::Float32,
    };
    let shape = broadcast_shapes(x.shape(), y.shape())?;
    let x = x.astype(dtype)?.broadcast_to(&shape)?;
    let y = y.astype(dtype)?.broadcast_to(&shape)?;
    let mut out = apply(Axpby { alpha, beta }, &[x, y])?;
    Ok(out.remove(0))
}

/// `alpha * x + beta * y` written with ordinary ops (two multiplies and an add), for comparison.
pub fn axpby_composed(x: &Array, y: &Array, alpha: f32, beta: f32) -> Result<Array> {
    (x * alpha)? + (y * beta)?
}

/// The shape two shapes broadcast to, or an error naming both.
fn broadcast_shapes(a: &[i32], b: &[i32]) -> Result<Vec<i32>> {
    let n = a.len().max(b.len());
    // Dimension `i` of the result, counting from the left, after padding with leading 1s.
    let dim = |s: &[i32], i: usize| if i + s.len() >= n { s[i + s.len() - n] } else { 1 };
    (0..n)
        .map(|i| match (dim(a, i), dim(b, i)) {
            (p, q) if p == q => Ok(p),
            (1, q) => Ok(q),
            (p, 1) => Ok(p),
            _ => Err(Error::InvalidArgument(format!("axpby: shapes {a:?} and {b:?} do not broadcast"))),
        })
        .collect()
}

// -------------------------------------------------------------------------------------------------
// 2. The primitive

/// The primitive behind [`axpby`]: two inputs of one shape and dtype, one output like them.
#[derive(Clone, Copy, Debug)]
pub struct Axpby {
    pub alpha: f32,
    pub beta: f32,
}

impl Axpby {
    /// The GPU kernel's name. MLX caches compiled kernels by name (and template arguments), and the
    /// source depends on `alpha` and `beta`, so the name carries their exact bit patterns.
    pub fn kernel_name(&self) -> String {
        format!("axpby_{:08x}_{:08x}", self.alpha.to_bits(), self.beta.to_bits())
    }

    /// `T(alpha * x[i] + beta * y[i])` with the coefficients written as exact bit patterns, for
    /// the given bit-cast spelling (`__uint_as_float` in CUDA, `as_type<float>` in Metal).
    fn kernel_body(&self, index: &str, bitcast: &str) -> String {
        let (a, b) = (self.alpha.to_bits(), self.beta.to_bits());
        format!(
            "
    {index}
    const float alpha = {bitcast}(0x{a:08x}u); // {alpha:e}
    const float beta = {bitcast}(0x{b:08x}u); // {beta:e}
    // The element count from the shape, so one compiled kernel serves every size.
    size_t n = 1;
    for (int d = 0; d < x_ndim; ++d) {{
        n *= x_shape[d];
    }}
    if (i < n) {{
        z[i] = T(alpha * static_cast<float>(x[i]) + beta * static_cast<float>(y[i]));
    }}
",
            alpha = self.alpha,
            beta = self.beta,
        )
    }
}

fn check_inputs(inputs: &[TensorSpec]) -> Result<()> {
    match inputs {
        [x, y] if x == y => Ok(()),
        _ => Err(Error::InvalidArgument(format!(
            "Axpby takes two inputs of one shape and dtype (use `axpby`, which broadcasts), got {inputs:?}"
        ))),
    }
}

/// `z[i] = f(x[i], y[i])` over the contiguous buffers of one dtype `T`.
fn elementwise<T: Element>(
    inputs: &[CpuTensor<'_>],
    outputs: &mut [CpuTensorMut<'_>],
    f: impl Fn(T, T) -> T,
) -> Result<()> {
    let (x, y) = (inputs[0].as_slice::<T>()?, inputs[1].as_slice::<T>()?);
    let z = outputs[0].as_mut_slice::<T>()?;
    if x.len() != z.len() || y.len() != z.len() {
        return Err(Error::InvalidArgument("Axpby: inputs and output differ in size".into()));
    }
    for ((z, &x), &y) in z.iter_mut().zip(x).zip(y) {
        *z = f(x, y);
    }
    Ok(())
}

impl CustomPrimitive for Axpby {
    fn name(&self) -> String {
        "Axpby".into()
    }

    fn output_specs(&self, inputs: &[TensorSpec]) -> Result<Vec<TensorSpec>> {
        check_inputs(inputs)?;
        Ok(vec![inputs[0].clone()])
    }

    // ---------------------------------------------------------------------------------------------
    // 3. CPU evaluation

    fn eval_cpu(&self, inputs: &[CpuTensor<'_>], outputs: &mut [CpuTensorMut<'_>]) -> Result<()> {
        let (a, b) = (self.alpha, self.beta);
        match outputs[0].dtype() {
            Dtype::Float32 => elementwise::<f32>(inputs, outputs, |x, y| a * x + b * y),
            Dtype::Float64 => {
                let (a, b) = (a as f64, b as f64);
                elementwise::<f64>(inputs, outputs, |x, y| a * x + b * y)
            }
            Dtype::Float16 => {
                elementwise::<f16>(inputs, outputs, |x, y| f16::from_f32(a * x.to_f32() + b * y.to_f32()))
            }
            Dtype::Bfloat16 => {
                elementwise::<bf16>(inputs, outputs, |x, y| bf16::from_f32(a * x.to_f32() + b * y.to_f32()))
            }
            other => Err(Error::Unsupported(format!("Axpby has no CPU implementation for {other}"))),
        }
    }

    // ---------------------------------------------------------------------------------------------
    // 4. GPU kernel

    fn gpu_kernel(
        &self,
        backend: GpuBackend,
        inputs: &[TensorSpec],
        outputs: &[TensorSpec],
    ) -> Option<(CustomKernel, KernelLaunch)> {
        let out = outputs.first()?;
        // float64 (which MLX's GPUs do not compute in) and anything unexpected run on the CPU.
        if check_inputs(inputs).is_err() || !matches!(out.dtype, Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float32) {
            return None;
        }
        // The kernel reads the element count from `x_shape`, which MLX passes only for arrays with
        // dimensions: scalars (and empty arrays) run on the CPU.
        if out.shape.is_empty() {
            return None;
        }
        let n = i32::try_from(out.size()).ok().filter(|&n| n > 0)?;
        let name = self.kernel_name();
        let kernel = match backend {
            GpuBackend::Cuda => cuda_kernel(
                &name,
                &["x", "y"],
                &["z"],
                &self.kernel_body("auto i = cg::this_grid().thread_rank();", "__uint_as_float"),
            ),
            GpuBackend::Metal => metal_kernel(
                &name,
                &["x", "y"],
                &["z"],
                &self.kernel_body("uint i = thread_position_in_grid.x;", "as_type<float>"),
            ),
        };
        let launch = KernelLaunch::new([n, 1, 1], [256, 1, 1])
            .output(&out.shape, out.dtype)
            .template("T", TemplateArg::Dtype(out.dtype));
        Some((kernel, launch))
    }

    // ---------------------------------------------------------------------------------------------
    // 5. Transforms

    /// `dz/dx = alpha`, `dz/dy = beta`: the cotangent scaled, once per requested input.
    fn vjp(
        &self,
        _primals: &[Array],
        cotangents: &[Array],
        argnums: &[usize],
        _outputs: &[Array],
    ) -> Result<Vec<Array>> {
        let cot = &cotangents[0];
        argnums.iter().map(|&arg| cot * if arg == 0 { self.alpha } else { self.beta }).collect()
    }

    /// `alpha * t_x + beta * t_y`, with only the tangents that are given.
    fn jvp(&self, _primals: &[Array], tangents: &[Array], argnums: &[usize]) -> Result<Vec<Array>> {
        let tangent_of = |arg: usize| argnums.iter().position(|&a| a == arg).map(|i| &tangents[i]);
        let out = match (tangent_of(0), tangent_of(1)) {
            (Some(tx), Some(ty)) => axpby(tx, ty, self.alpha, self.beta)?,
            (Some(tx), None) => (tx * self.alpha)?,
            (None, Some(ty)) => (ty * self.beta)?,
            (None, None) => return Err(Error::InvalidArgument("Axpby::jvp without tangents".into())),
        };
        Ok(vec![out])
    }

    /// Moves the mapped axis of each input to the front (an unmapped input gets a leading axis of
    /// 1 that broadcasts), then applies `axpby` once to the whole batch.
    fn vmap(&self, inputs: &[Array], axes: &[Option<usize>]) -> Result<(Vec<Array>, Vec<Option<usize>>)> {
        if axes.iter().all(Option::is_none) {
            return Ok((vec![axpby(&inputs[0], &inputs[1], self.alpha, self.beta)?], vec![None]));
        }
        let front = |a: &Array, axis: Option<usize>| match axis {
            Some(ax) => ops::moveaxis(a, ax as i32, 0),
            None => a.expand_dims(0),
        };
        let x = front(&inputs[0], axes[0])?;
        let y = front(&inputs[1], axes[1])?;
        Ok((vec![axpby(&x, &y, self.alpha, self.beta)?], vec![Some(0)]))
    }

    /// Same coefficients, bit for bit (so `0.0` and `-0.0` differ: they give differently signed
    /// zeros).
    fn is_equivalent(&self, other: &Self) -> bool {
        self.alpha.to_bits() == other.alpha.to_bits() && self.beta.to_bits() == other.beta.to_bits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_rules() {
        assert_eq!(broadcast_shapes(&[2, 3], &[3]).unwrap(), vec![2, 3]);
        assert_eq!(broadcast_shapes(&[], &[4, 1]).unwrap(), vec![4, 1]);
        assert_eq!(broadcast_shapes(&[4, 1], &[1, 5]).unwrap(), vec![4, 5]);
        assert_eq!(broadcast_shapes(&[0, 1], &[3]).unwrap(), vec![0, 3]);
        assert!(broadcast_shapes(&[2, 3], &[2]).is_err());
    }

    #[test]
    fn kernel_text_has_exact_coefficients() {
        let op = Axpby { alpha: 0.1, beta: -2.0 };
        assert_eq!(op.kernel_name(), "axpby_3dcccccd_c0000000");
        let body = op.kernel_body("auto i = 0;", "__uint_as_float");
        assert!(body.contains("__uint_as_float(0x3dcccccdu)"), "{body}");
        assert!(body.contains("__uint_as_float(0xc0000000u)"), "{body}");
    }
}
