//! GPU kernels from source: [`cuda_kernel`] and [`metal_kernel`] (MLX's `fast::cuda_kernel` /
//! `fast::metal_kernel`), re-exported from [`crate::fast`].
//!
//! A [`CustomKernel`] names its inputs and outputs and holds the body of the kernel; MLX writes the
//! signature (arrays by name, plus `<name>_shape`, `_strides`, `_ndim` when the body uses them) and
//! compiles it once per name and template instantiation — so give different sources different
//! names. A kernel called many times with the same launch and input layout can be made once
//! ([`CustomKernel::prepare`]): a call then only makes output arrays over the primitive made
//! once. [`KernelLaunch`] gives the grid (total threads per dimension, rounded up to whole thread
//! groups: guard the tail), thread group, template arguments and output shapes/dtypes of one call.
//!
//! A kernel runs on the backend it was written for. Calling it where that backend is absent (a CUDA
//! kernel on a Mac, any kernel on a CPU-only MLX) is an [`Error::Unsupported`] naming the backend
//! this MLX has; [`gpu_backend`] tells which one that is.
//!
//! ```
//! use rmlx::fast::{cuda_kernel, gpu_backend, GpuBackend, KernelLaunch, TemplateArg};
//! use rmlx::{Array, Dtype};
//! let scale = cuda_kernel("doc_scale2", &["x"], &["y"], r#"
//!     auto i = cg::this_grid().thread_rank();
//!     if (i < N) y[i] = x[i] * 2;"#);
//! let x = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3])?;
//! let launch = KernelLaunch::new([3, 1, 1], [32, 1, 1])
//!     .output(&[3], Dtype::Float32)
//!     .template("N", TemplateArg::Int(3));
//! match gpu_backend() {
//!     Some(GpuBackend::Cuda) => {
//!         assert_eq!(scale.call(&[x.clone()], &launch)?[0].to_vec::<f32>()?, vec![2.0, 4.0, 6.0]);
//!         // Made once, called many times: no source assembled per call.
//!         let prepared = scale.prepare(&[x.clone()], &launch)?;
//!         assert_eq!(prepared.call(&[x])?[0].to_vec::<f32>()?, vec![2.0, 4.0, 6.0]);
//!     }
//!     _ => assert!(matches!(scale.call(&[x], &launch), Err(rmlx::Error::Unsupported(_)))),
//! }
//! # Ok::<(), rmlx::Error>(())
//! ```

use crate::array::array_vec;
use crate::device::{current, current_device, device_spec};
use crate::{Array, Device, DeviceType, Dtype, Error, Result};
use rmlx_sys::ffi::StreamSpec;
use rmlx_sys::tffi::{self, KernelSpec, ShapeDtype};

/// A GPU backend of MLX.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuBackend {
    Cuda,
    Metal,
}

impl GpuBackend {
    pub(crate) fn code(self) -> u8 {
        match self {
            GpuBackend::Cuda => 1,
            GpuBackend::Metal => 2,
        }
    }
    pub(crate) fn from_code(c: u8) -> Option<GpuBackend> {
        match c {
            1 => Some(GpuBackend::Cuda),
            2 => Some(GpuBackend::Metal),
            _ => None,
        }
    }
}

/// The GPU backend of the MLX in use, if it has one.
pub fn gpu_backend() -> Option<GpuBackend> {
    GpuBackend::from_code(tffi::gpu_backend())
}

/// A template argument of a kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TemplateArg {
    Int(i32),
    Bool(bool),
    Dtype(Dtype),
}

/// The shape and dtype of an array.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub shape: Vec<i32>,
    pub dtype: Dtype,
}

impl TensorSpec {
    pub fn new(shape: &[i32], dtype: Dtype) -> TensorSpec {
        TensorSpec { shape: shape.to_vec(), dtype }
    }
    /// Number of elements.
    pub fn size(&self) -> usize {
        self.shape.iter().map(|&d| d as usize).product()
    }
    pub(crate) fn to_ffi(&self) -> ShapeDtype {
        ShapeDtype { shape: self.shape.clone(), dtype: self.dtype as u8 }
    }
    pub(crate) fn from_ffi(s: &ShapeDtype) -> TensorSpec {
        TensorSpec { shape: s.shape.clone(), dtype: Dtype::from_code(s.dtype) }
    }
    pub(crate) fn of(a: &Array) -> TensorSpec {
        TensorSpec { shape: a.shape().to_vec(), dtype: a.dtype() }
    }
}

/// A kernel written for one GPU backend (see the module docs).
#[derive(Clone, Debug)]
pub struct CustomKernel {
    backend: GpuBackend,
    name: String,
    input_names: Vec<String>,
    output_names: Vec<String>,
    source: String,
    header: String,
    ensure_row_contiguous: bool,
    atomic_outputs: bool,
    shared_memory: i32,
}

/// A CUDA kernel: `source` is the body of a `__global__` function whose parameters are the named
/// inputs (`const T*`) and outputs (`T*`).
pub fn cuda_kernel(name: &str, input_names: &[&str], output_names: &[&str], source: &str) -> CustomKernel {
    CustomKernel::new(GpuBackend::Cuda, name, input_names, output_names, source)
}

/// A Metal kernel: `source` is the body of a `[[kernel]]` function whose parameters are the named
/// inputs (`const device T*`) and outputs (`device T*`).
pub fn metal_kernel(name: &str, input_names: &[&str], output_names: &[&str], source: &str) -> CustomKernel {
    CustomKernel::new(GpuBackend::Metal, name, input_names, output_names, source)
}

impl CustomKernel {
    fn new(backend: GpuBackend, name: &str, inputs: &[&str], outputs: &[&str], source: &str) -> CustomKernel {
        CustomKernel {
            backend,
            name: name.to_string(),
            input_names: inputs.iter().map(|s| s.to_string()).collect(),
            output_names: outputs.iter().map(|s| s.to_string()).collect(),
            source: source.to_string(),
            header: String::new(),
            ensure_row_contiguous: true,
            atomic_outputs: false,
            shared_memory: 0,
        }
    }

    /// Code placed before the kernel (helper functions, includes).
    pub fn header(mut self, header: &str) -> Self {
        self.header = header.to_string();
        self
    }

    /// Copy inputs to row-major order first (default `true`); when `false` the body must use the
    /// `<name>_strides` of each input.
    pub fn ensure_row_contiguous(mut self, yes: bool) -> Self {
        self.ensure_row_contiguous = yes;
        self
    }

    /// Metal only: declare the outputs `device atomic<T>*`.
    pub fn atomic_outputs(mut self, yes: bool) -> Self {
        self.atomic_outputs = yes;
        self
    }

    /// CUDA only: bytes of dynamic shared memory per block.
    pub fn shared_memory(mut self, bytes: i32) -> Self {
        self.shared_memory = bytes;
        self
    }

    /// The backend this kernel is written for.
    pub fn backend(&self) -> GpuBackend {
        self.backend
    }

    /// Checks that this MLX can run the kernel.
    fn check_backend(&self) -> Result<()> {
        match gpu_backend() {
            Some(b) if b == self.backend => Ok(()),
            other => Err(Error::Unsupported(format!(
                "{:?} kernel `{}` needs MLX's {:?} backend; this MLX has {}",
                self.backend,
                self.name,
                self.backend,
                other.map_or("no GPU backend".to_string(), |b| format!("the {b:?} backend"))
            ))),
        }
    }

    pub(crate) fn spec(&self, launch: &KernelLaunch) -> Result<KernelSpec> {
        if launch.outputs.len() != self.output_names.len() {
            return Err(Error::InvalidArgument(format!(
                "kernel `{}` has {} outputs but the launch describes {}",
                self.name,
                self.output_names.len(),
                launch.outputs.len()
            )));
        }
        let mut spec = KernelSpec {
            backend: self.backend.code(),
            name: self.name.clone(),
            input_names: self.input_names.clone(),
            output_names: self.output_names.clone(),
            source: self.source.clone(),
            header: self.header.clone(),
            ensure_row_contiguous: self.ensure_row_contiguous,
            atomic_outputs: self.atomic_outputs,
            shared_memory: self.shared_memory,
            grid: launch.grid,
            threadgroup: launch.threadgroup,
            has_init_value: launch.init_value.is_some(),
            init_value: launch.init_value.unwrap_or(0.0),
            ..Default::default()
        };
        for (name, arg) in &launch.template {
            let (kind, value) = match *arg {
                TemplateArg::Int(v) => (0, v),
                TemplateArg::Bool(b) => (1, b as i32),
                TemplateArg::Dtype(d) => (2, d as i32),
            };
            spec.template_names.push(name.clone());
            spec.template_kinds.push(kind);
            spec.template_values.push(value);
        }
        Ok(spec)
    }

    /// Runs the kernel on `inputs` (one per input name) on the GPU: the current stream if it is a
    /// GPU stream, else the GPU's default stream.
    pub fn call(&self, inputs: &[Array], launch: &KernelLaunch) -> Result<Vec<Array>> {
        let (spec, outs) = self.checked_launch(inputs, launch)?;
        let v = array_vec(inputs);
        let out = crate::lock::locked(|| tffi::custom_kernel(&spec, &v, &outs, kernel_stream()))?;
        Ok(crate::array::from_array_vec(&out))
    }

    /// The kernel made once for `launch` and for inputs of the shapes and dtypes of `inputs` (the
    /// kernel does not run on them), on the stream [`CustomKernel::call`] would take now. Each
    /// [`CustomKernel::call`] has MLX assemble the kernel's source and signature; each
    /// [`PreparedKernel::call`] only makes the output arrays over the primitive made here, as
    /// MLX's own operations do. (Evaluating either still has MLX's CUDA backend hash the whole
    /// source once per node.)
    pub fn prepare(&self, inputs: &[Array], launch: &KernelLaunch) -> Result<PreparedKernel> {
        let (spec, outs) = self.checked_launch(inputs, launch)?;
        let (v, stream) = (array_vec(inputs), kernel_stream());
        let inner = crate::lock::locked(|| tffi::prepare_kernel(&spec, &v, &outs, stream))?;
        Ok(PreparedKernel {
            inner,
            name: self.name.clone(),
            inputs: inputs.iter().map(TensorSpec::of).collect(),
            stream,
        })
    }

    /// The kernel's spec and output specs for `launch`, after checking the backend and the number
    /// of inputs.
    fn checked_launch(&self, inputs: &[Array], launch: &KernelLaunch) -> Result<(KernelSpec, Vec<ShapeDtype>)> {
        self.check_backend()?;
        if inputs.len() != self.input_names.len() {
            return Err(Error::InvalidArgument(format!(
                "kernel `{}` takes {} inputs, got {}",
                self.name,
                self.input_names.len(),
                inputs.len()
            )));
        }
        let outs = launch.outputs.iter().map(TensorSpec::to_ffi).collect();
        Ok((self.spec(launch)?, outs))
    }
}

/// Where a kernel runs: the current stream if it is a GPU stream, else the GPU's default stream.
pub(crate) fn kernel_stream() -> StreamSpec {
    if current_device().kind == DeviceType::Gpu {
        current()
    } else {
        device_spec(Device::gpu())
    }
}

/// A [`CustomKernel`] made once for one launch, one stream and inputs of fixed shapes and dtypes
/// ([`CustomKernel::prepare`]), to be called many times.
pub struct PreparedKernel {
    inner: rmlx_sys::cxx::UniquePtr<tffi::PreparedKernel>,
    name: String,
    inputs: Vec<TensorSpec>,
    stream: StreamSpec,
}

impl PreparedKernel {
    /// Runs the kernel on `inputs`, which must have the shapes and dtypes it was prepared for,
    /// on the stream it was prepared for (that [`CustomKernel::call`] would take now).
    pub fn call(&self, inputs: &[Array]) -> Result<Vec<Array>> {
        let fits = inputs.len() == self.inputs.len()
            && inputs.iter().zip(&self.inputs).all(|(a, s)| a.dtype() == s.dtype && a.shape() == s.shape.as_slice());
        if !fits {
            let got: Vec<TensorSpec> = inputs.iter().map(TensorSpec::of).collect();
            return Err(Error::InvalidArgument(format!(
                "kernel `{}` was prepared for inputs {:?}, got {:?}",
                self.name, self.inputs, got
            )));
        }
        if kernel_stream() != self.stream {
            return Err(Error::InvalidArgument(format!(
                "kernel `{}` was prepared for another stream than the current one",
                self.name
            )));
        }
        let v = array_vec(inputs);
        let out = crate::lock::locked(|| tffi::call_prepared(&self.inner, &v))?;
        Ok(crate::array::from_array_vec(&out))
    }
}

/// How to launch a [`CustomKernel`]: grid and thread-group sizes (in threads, per dimension),
/// output shapes and dtypes, template arguments, and an optional value to fill the outputs with
/// first.
#[derive(Clone, Debug)]
pub struct KernelLaunch {
    pub grid: [i32; 3],
    pub threadgroup: [i32; 3],
    pub outputs: Vec<TensorSpec>,
    pub template: Vec<(String, TemplateArg)>,
    pub init_value: Option<f32>,
}

impl KernelLaunch {
    pub fn new(grid: [i32; 3], threadgroup: [i32; 3]) -> KernelLaunch {
        KernelLaunch { grid, threadgroup, outputs: Vec::new(), template: Vec::new(), init_value: None }
    }
    /// Adds an output.
    pub fn output(mut self, shape: &[i32], dtype: Dtype) -> Self {
        self.outputs.push(TensorSpec::new(shape, dtype));
        self
    }
    /// Adds a template argument.
    pub fn template(mut self, name: &str, arg: TemplateArg) -> Self {
        self.template.push((name.to_string(), arg));
        self
    }
    /// Fills the outputs with `value` before the kernel runs.
    pub fn init_value(mut self, value: f32) -> Self {
        self.init_value = Some(value);
        self
    }
}
