//! User-defined primitives: operations written in Rust that become real nodes of MLX's graph.
//!
//! Implement [`CustomPrimitive`] — the output shapes, a CPU evaluation over typed slices, optionally
//! a GPU kernel from source, and the transforms (`vjp`, `jvp`, `vmap`) you want to support — then
//! build nodes with [`apply`]. The node composes with everything else: [`grad`](crate::transforms::grad)
//! calls your `vjp`, [`vmap`](crate::transforms::vmap) your `vmap`, [`compile`](crate::compile::compile)
//! keeps the node in its trace (and merges equivalent ones using `is_equivalent`).
//!
//! Where it runs: on the GPU when the current device is the GPU and [`CustomPrimitive::gpu_kernel`]
//! returns a kernel for MLX's GPU backend; on the CPU otherwise (MLX moves the data as needed).
//! The CPU evaluation runs on MLX's CPU worker thread while the caller waits for the result: it gets
//! plain slices and must not call into rmlx. An `Err` (or panic) there cannot be thrown on that
//! thread; it is reported as [`Error::PrimitiveEval`] by the next evaluation (`eval`, `to_vec`, ...)
//! on the thread that scheduled the failed one, and the outputs' contents are unspecified.
//!
//! ```
//! use rmlx::custom::{apply, CpuTensor, CpuTensorMut, CustomPrimitive};
//! use rmlx::fast::TensorSpec;
//! use rmlx::{transforms, Array, Axes, Result};
//!
//! /// y = 3x, on f32.
//! struct Triple;
//! impl CustomPrimitive for Triple {
//!     fn name(&self) -> String { "Triple".into() }
//!     fn output_specs(&self, inputs: &[TensorSpec]) -> Result<Vec<TensorSpec>> { Ok(vec![inputs[0].clone()]) }
//!     fn eval_cpu(&self, inputs: &[CpuTensor<'_>], outputs: &mut [CpuTensorMut<'_>]) -> Result<()> {
//!         let x = inputs[0].as_slice::<f32>()?;
//!         for (y, x) in outputs[0].as_mut_slice::<f32>()?.iter_mut().zip(x) { *y = 3.0 * x; }
//!         Ok(())
//!     }
//!     fn vjp(&self, _p: &[Array], cotangents: &[Array], _argnums: &[usize], _o: &[Array]) -> Result<Vec<Array>> {
//!         Ok(vec![(&cotangents[0] * 3.0)?])
//!     }
//! }
//!
//! let x = Array::from_slice(&[1.0f32, 2.0], &[2])?;
//! assert_eq!(apply(Triple, &[x.clone()])?[0].to_vec::<f32>()?, vec![3.0, 6.0]);
//! let g = transforms::grad(|a: &[Array]| apply(Triple, a)?[0].sum(Axes::All, false), &[0]);
//! assert_eq!(g(&[x])?[0].to_vec::<f32>()?, vec![3.0, 3.0]);
//! # Ok::<(), rmlx::Error>(())
//! ```
//!
//! `examples/axpby` (the `rmlx-axpby` crate) walks through a complete primitive: MLX's `axpby` guide
//! in Rust, with a GPU kernel and all transforms.

use crate::array::array_vec;
use crate::array::arrays_of as arrays;
use crate::callback::{self, axes_from_i32, returned, returned_mapped};
pub use crate::cuda::InPlace;
use crate::device::{current, current_device, device_spec};
use crate::kernel::{CustomKernel, GpuBackend, KernelLaunch, TensorSpec};
use crate::{Array, Device, DeviceType, Dtype, Element, Error, Result};
use rmlx_sys::ffi;
use rmlx_sys::tffi::{self, CpuBuffer, KernelSpec, ShapeDtype};
use rmlx_sys::transforms::{CallbackResult, OpBox, PrimitiveCallbacks};
use std::any::Any;

/// A primitive written in Rust (see the module docs). Only `name`, `output_specs` and `eval_cpu`
/// are required; a transform left out fails with [`Error::Unsupported`] when something asks for it.
pub trait CustomPrimitive: Send + Sync + 'static {
    /// The name shown in graphs and errors.
    fn name(&self) -> String;

    /// Shapes and dtypes of the outputs for inputs of `inputs`' shapes and dtypes.
    fn output_specs(&self, inputs: &[TensorSpec]) -> Result<Vec<TensorSpec>>;

    /// Computes the outputs on the CPU. Inputs are row-major and contiguous; outputs are
    /// uninitialised buffers of the shapes from `output_specs`.
    fn eval_cpu(&self, inputs: &[CpuTensor<'_>], outputs: &mut [CpuTensorMut<'_>]) -> Result<()>;

    /// Outputs that update an input in place on the CPU, as `(output, input)` pairs (each output
    /// of its input's shape and dtype), and when the input's own buffer is updated rather than a
    /// copy ([`InPlace`]). In `eval_cpu` such an output starts as the input's contents and the
    /// input reads as empty. None by default; a primitive with any runs on the CPU only.
    fn in_place(&self) -> (Vec<(usize, usize)>, InPlace) {
        (Vec::new(), InPlace::Unshared)
    }

    /// A kernel (and its launch) computing the outputs on `backend`, or `None` to run on the CPU.
    fn gpu_kernel(
        &self,
        _backend: GpuBackend,
        _inputs: &[TensorSpec],
        _outputs: &[TensorSpec],
    ) -> Option<(CustomKernel, KernelLaunch)> {
        None
    }

    /// Vector-Jacobian products: one array per entry of `argnums` (the primals to differentiate).
    fn vjp(
        &self,
        _primals: &[Array],
        _cotangents: &[Array],
        _argnums: &[usize],
        _outputs: &[Array],
    ) -> Result<Vec<Array>> {
        Err(Error::Unsupported(format!("{} has no vjp", self.name())))
    }

    /// Jacobian-vector products: one array per output; `tangents[i]` belongs to primal `argnums[i]`.
    fn jvp(&self, _primals: &[Array], _tangents: &[Array], _argnums: &[usize]) -> Result<Vec<Array>> {
        Err(Error::Unsupported(format!("{} has no jvp", self.name())))
    }

    /// The vectorised op: inputs carry an extra axis (`axes[i]`, `None` if input `i` has none);
    /// returns the outputs and where their extra axis is.
    fn vmap(&self, _inputs: &[Array], _axes: &[Option<usize>]) -> Result<(Vec<Array>, Vec<Option<usize>>)> {
        Err(Error::Unsupported(format!("{} has no vmap", self.name())))
    }

    /// Whether `other` computes the same function (lets `compile` merge duplicate nodes).
    fn is_equivalent(&self, _other: &Self) -> bool
    where
        Self: Sized,
    {
        false
    }
}

/// A read-only input of [`CustomPrimitive::eval_cpu`].
pub struct CpuTensor<'a> {
    bytes: &'a [u8],
    shape: &'a [i32],
    dtype: Dtype,
}

/// An output of [`CustomPrimitive::eval_cpu`], to be filled.
pub struct CpuTensorMut<'a> {
    bytes: &'a mut [u8],
    shape: &'a [i32],
    dtype: Dtype,
}

fn typed<T: Element>(dtype: Dtype, bytes: &[u8]) -> Result<(*const T, usize)> {
    if T::DTYPE != dtype {
        return Err(Error::DtypeMismatch { expected: T::DTYPE, found: dtype });
    }
    let n = bytes.len() / std::mem::size_of::<T>();
    if !(bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) {
        return Err(Error::InvalidArgument("misaligned buffer".into()));
    }
    Ok((bytes.as_ptr() as *const T, n))
}

impl CpuTensor<'_> {
    pub fn shape(&self) -> &[i32] {
        self.shape
    }
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }
    /// The elements in row-major order; `T` must match the dtype.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        let (ptr, n) = typed::<T>(self.dtype, self.bytes)?;
        // SAFETY: aligned, in bounds, and every bit pattern of MLX's buffer is a valid `T`.
        Ok(unsafe { std::slice::from_raw_parts(ptr, n) })
    }
}

impl CpuTensorMut<'_> {
    pub fn shape(&self) -> &[i32] {
        self.shape
    }
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }
    /// The elements in row-major order, for writing; `T` must match the dtype.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        let (ptr, n) = typed::<T>(self.dtype, self.bytes)?;
        // SAFETY: as in `as_slice`; the buffer is exclusively this output's.
        Ok(unsafe { std::slice::from_raw_parts_mut(ptr as *mut T, n) })
    }
}

/// Adds a node computing `op` on `inputs` to the graph and returns its outputs.
pub fn apply<P: CustomPrimitive>(op: P, inputs: &[Array]) -> Result<Vec<Array>> {
    let in_specs: Vec<TensorSpec> = inputs.iter().map(TensorSpec::of).collect();
    let out_specs = op.output_specs(&in_specs)?;
    let (updates, mode) = op.in_place();
    let mut in_place = vec![-1i32; out_specs.len()];
    for &(output, input) in &updates {
        let (Some(out), Some(inp)) = (out_specs.get(output), in_specs.get(input)) else {
            return Err(Error::InvalidArgument(format!(
                "{}: output {output} updates input {input} of {} inputs and {} outputs",
                op.name(),
                in_specs.len(),
                out_specs.len()
            )));
        };
        if out.shape != inp.shape || out.dtype != inp.dtype {
            return Err(Error::InvalidArgument(format!(
                "{}: output {output} ({:?}, {:?}) updates input {input} of another shape or dtype ({:?}, {:?})",
                op.name(),
                out.shape,
                out.dtype,
                inp.shape,
                inp.dtype
            )));
        }
        in_place[output] = input as i32;
    }
    let device = current_device();
    let on_gpu = device.kind == DeviceType::Gpu
        && updates.is_empty()
        && crate::kernel::gpu_backend().is_some_and(|b| op.gpu_kernel(b, &in_specs, &out_specs).is_some());
    let stream = match (on_gpu, device.kind) {
        (true, _) | (false, DeviceType::Cpu) => current(),
        (false, DeviceType::Gpu) => device_spec(Device::cpu()),
    };
    // The CPU evaluation reads plain row-major buffers. Inputs computed so already (weights), or
    // to be made so (another custom primitive's outputs, a slice update of such a buffer: a KV
    // cache written at a position) are taken as they are: a `contiguous` node per input would be
    // a scheduled task per call.
    let contiguous = crate::device::with_stream_spec(stream, || {
        inputs
            .iter()
            .map(|a| {
                let known = crate::lock::locked(|| rmlx_sys::tffi::array_known_row_contiguous(a.raw()));
                if known {
                    Ok(a.clone())
                } else {
                    crate::ops::contiguous(a)
                }
            })
            .collect::<Result<Vec<_>>>()
    })?;
    let v = array_vec(&contiguous);
    let specs: Vec<ShapeDtype> = out_specs.iter().map(TensorSpec::to_ffi).collect();
    let boxed = Box::new(OpBox(Box::new(Adapter(op))));
    let owned = mode == InPlace::Owned;
    let out = callback::call(|| tffi::custom_primitive(boxed, &v, &specs, &in_place, owned, stream))?;
    crate::array::from_array_vec(&out).into_iter().map(crate::mode::after_op).collect()
}

/// Reports errors recorded by primitives' CPU evaluation (see the module docs).
pub(crate) fn check_eval_errors() -> Result<()> {
    let errors = rmlx_sys::transforms::take_eval_errors();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(Error::PrimitiveEval(errors.join("; ")))
    }
}

/// Bridges a [`CustomPrimitive`] to the shim's callbacks.
struct Adapter<P>(P);

fn usizes(v: &[i32]) -> Vec<usize> {
    v.iter().map(|&a| a as usize).collect()
}

fn specs(v: &[ShapeDtype]) -> Vec<TensorSpec> {
    v.iter().map(TensorSpec::from_ffi).collect()
}

impl<P: CustomPrimitive> PrimitiveCallbacks for Adapter<P> {
    fn name(&self) -> String {
        self.0.name()
    }

    fn output_specs(&self, inputs: &[ShapeDtype]) -> std::result::Result<Vec<ShapeDtype>, String> {
        match self.0.output_specs(&specs(inputs)) {
            Ok(outs) => Ok(outs.iter().map(TensorSpec::to_ffi).collect()),
            Err(e) => Err(callback::raise(e)),
        }
    }

    fn eval_cpu(&self, inputs: &[CpuBuffer], outputs: &[CpuBuffer]) -> std::result::Result<(), String> {
        // SAFETY: the shim passes live, row-contiguous MLX buffers of `nbytes` bytes; the outputs are
        // allocated for this evaluation or take over an input, which then comes with no bytes: no
        // input aliases an output.
        let ins: Vec<CpuTensor<'_>> = inputs
            .iter()
            .map(|b| CpuTensor {
                bytes: unsafe { std::slice::from_raw_parts(b.ptr as *const u8, b.nbytes) },
                shape: &b.shape,
                dtype: Dtype::from_code(b.dtype),
            })
            .collect();
        let mut outs: Vec<CpuTensorMut<'_>> = outputs
            .iter()
            .map(|b| CpuTensorMut {
                bytes: unsafe { std::slice::from_raw_parts_mut(b.ptr as *mut u8, b.nbytes) },
                shape: &b.shape,
                dtype: Dtype::from_code(b.dtype),
            })
            .collect();
        self.0.eval_cpu(&ins, &mut outs).map_err(|e| e.to_string())
    }

    fn gpu_kernel(
        &self,
        backend: u8,
        inputs: &[ShapeDtype],
        outputs: &[ShapeDtype],
    ) -> std::result::Result<Option<KernelSpec>, String> {
        let Some(backend) = GpuBackend::from_code(backend) else { return Ok(None) };
        match self.0.gpu_kernel(backend, &specs(inputs), &specs(outputs)) {
            None => Ok(None),
            Some((kernel, launch)) => kernel.spec(&launch).map(Some).map_err(callback::raise),
        }
    }

    fn vjp(
        &self,
        primals: &ffi::ArrayVec,
        cotangents: &ffi::ArrayVec,
        argnums: &[i32],
        outputs: &ffi::ArrayVec,
    ) -> CallbackResult {
        let (p, c, o) = (arrays(primals), arrays(cotangents), arrays(outputs));
        returned(callback::guard(|| self.0.vjp(&p, &c, &usizes(argnums), &o)))
    }

    fn jvp(&self, primals: &ffi::ArrayVec, tangents: &ffi::ArrayVec, argnums: &[i32]) -> CallbackResult {
        let (p, t) = (arrays(primals), arrays(tangents));
        returned(callback::guard(|| self.0.jvp(&p, &t, &usizes(argnums))))
    }

    fn vmap(
        &self,
        inputs: &ffi::ArrayVec,
        axes: &[i32],
    ) -> std::result::Result<(rmlx_sys::cxx::UniquePtr<ffi::ArrayVec>, Vec<i32>), String> {
        let x = arrays(inputs);
        returned_mapped(callback::guard(|| self.0.vmap(&x, &axes_from_i32(axes))))
    }

    fn equivalent(&self, other: &dyn PrimitiveCallbacks) -> bool {
        other.as_any().downcast_ref::<Adapter<P>>().is_some_and(|o| self.0.is_equivalent(&o.0))
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
