//! Kernels of your own on MLX's CUDA backend, compiled once and launched as nodes of MLX's graph.
//!
//! [`crate::fast::cuda_kernel`] hands MLX a source that MLX hashes and binds again on every
//! evaluation, and compiles again in every process. Here a kernel is a complete CUDA source with an
//! `extern "C" __global__` function: [`compile`] turns it into a cubin with NVRTC (kept in a cache
//! directory you name, so later processes only load it), and a [`CudaLaunch`] is a primitive
//! made once that runs one or more such kernels, in order, as kernel nodes of MLX's CUDA graph,
//! over the arrays it is called on. MLX has no source to hash and no argument list to rebuild for
//! it, and several kernels in one launch are one node of MLX's graph. A scalar that changes every
//! call (a decoding position) is a [`KernelArg::Value`] given to [`CudaLaunch::call_with`], not an
//! array made on the host (such small arrays live in CUDA managed memory, and a kernel reading one
//! waits for its page); an output may update an input in place ([`CudaLaunch::updating`]).
//!
//! Kernels that follow the [`OVERLAP`] protocol ([`CudaFunction::overlapping`]) start while the
//! kernel before them in a launch finishes (CUDA's programmatic dependent launch, on compute
//! capability 9.0 and later): each waits for its predecessor itself, after work that reads only
//! the launch's inputs (a product's first weights), so a chain of short kernels loses less to
//! each one's start and end.
//!
//! A graph whose operations are all such launches can be read back before it is evaluated and
//! merged into one launch replayed over new inputs ([`capture`]): a decoding step's layers as one
//! operation of MLX's graph.
//!
//! Available where MLX's CUDA backend is loaded ([`unavailable`] says why not elsewhere); the
//! inputs are made row-contiguous before the kernels run, and the kernels have no gradient.
//!
//! ```
//! use rmlx::cuda::{self, KernelArg, KernelNode};
//! use rmlx::{Array, Dtype};
//! # fn main() -> rmlx::Result<()> {
//! const SOURCE: &str = r#"
//! extern "C" __global__ void add_one(const float* x, float* y, int n) {
//!     int i = blockIdx.x * blockDim.x + threadIdx.x;
//!     if (i < n) y[i] = x[i] + 1.0f;
//! }"#;
//! if cuda::unavailable().is_none() {
//!     let f = cuda::compile("add_one", SOURCE, None)?;
//!     let args = vec![KernelArg::Input(0), KernelArg::Output(0), KernelArg::I32(4)];
//!     let node = KernelNode { function: f, grid: [1, 1, 1], block: [32, 1, 1], shared_bytes: 0, args };
//!     let launch = cuda::CudaLaunch::new("add_one", &[node], &[(vec![4], Dtype::Float32)])?;
//!     let x = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[4])?;
//!     let y = &launch.call(&[x])?[0];
//!     assert_eq!(y.to_vec::<f32>()?, [2.0, 3.0, 4.0, 5.0]);
//! }
//! # Ok(())
//! # }
//! ```

use crate::array::{array_vec, from_array_vec};
use crate::kernel::kernel_stream;
use crate::{Array, Dtype, Error, Result};
use rmlx_sys::cuda::cffi;
use rmlx_sys::ffi::StreamSpec;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{LazyLock, Mutex};

pub mod capture;

/// Why kernels of rmlx's own cannot run in this process (`None`: they can): MLX's CPU or Metal
/// backend, or a CUDA installation missing what they need.
pub fn unavailable() -> Option<String> {
    static WHY: LazyLock<String> = LazyLock::new(|| crate::lock::locked(cffi::cuda_unavailable));
    (!WHY.is_empty()).then(|| WHY.clone())
}

/// The multiprocessors of the GPU MLX uses by default (132 on an H100 SXM): a kernel whose blocks
/// loop over their work sizes its grid by them.
pub fn multiprocessors() -> Result<i32> {
    if let Some(why) = unavailable() {
        return Err(Error::Unsupported(format!("the GPU's multiprocessors: {why}")));
    }
    Ok(cffi::cuda_multiprocessors(crate::Device::gpu().index)?)
}

/// Why kernels marked [`CudaFunction::overlapping`] do not start early in this process (`None`:
/// they do): kernels of rmlx's own unavailable, a GPU before compute capability 9.0, MLX without
/// CUDA graphs, or a CUDA driver without graph edge data. They are then ordered as any other.
pub fn overlap_unavailable() -> Option<String> {
    if let Some(why) = unavailable() {
        return Some(why);
    }
    let why = crate::lock::locked(|| cffi::cuda_overlap_unavailable(crate::Device::gpu().index));
    (!why.is_empty()).then_some(why)
}

/// Device functions of the protocol that lets a kernel start before the kernel before it in a
/// launch ends (prepend it to the source; both are no-ops before compute capability 9.0 and when
/// the kernel was not started early):
///
/// - `rmlx_wait_previous()`: returns once the kernel before has ended and its writes are visible.
///   Every block calls it before it reads anything a kernel of the launch may write (the launch's
///   outputs, inputs it updates in place) and before it writes anything; before it, a block may
///   read only arrays no kernel of the launch writes (weights, the launch's other inputs).
/// - `rmlx_release_next()`: lets the kernel after start (once every block has called it or ended);
///   call it after `rmlx_wait_previous()`.
pub const OVERLAP: &str = r#"
__device__ __forceinline__ void rmlx_wait_previous() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void rmlx_release_next() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
"#;

/// A loaded kernel function (for the life of the process) and the device it was loaded on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaFunction {
    handle: u64,
    device: i32,
    name: String,
    overlap: bool,
}

impl CudaFunction {
    /// The function's name in its source.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The function, declared to follow the [`OVERLAP`] protocol: in a launch, a node running it
    /// may start before the node before it ends (where [`overlap_unavailable`] is `None`). A
    /// kernel that does not call `rmlx_wait_previous()` as the protocol says may read stale data.
    pub fn overlapping(mut self) -> CudaFunction {
        self.overlap = true;
        self
    }

    /// Whether [`CudaFunction::overlapping`] declared it.
    pub fn overlaps(&self) -> bool {
        self.overlap
    }
}

/// The source's `extern "C"` function `name`, compiled for the GPU MLX uses by default and loaded.
/// With `cache`, the compiled image is kept there in a file named after the source and read back by
/// later calls and processes (which compare the whole source, compiler and device before using
/// it); without, or if the directory cannot be written, it is compiled in every process. Errors
/// carry NVRTC's log.
pub fn compile(name: &str, source: &str, cache: Option<&Path>) -> Result<CudaFunction> {
    static LOADED: LazyLock<Mutex<HashMap<(String, String), CudaFunction>>> = LazyLock::new(Mutex::default);
    if let Some(why) = unavailable() {
        return Err(Error::Unsupported(format!("CUDA kernel `{name}`: {why}")));
    }
    let key = (name.to_string(), source.to_string());
    if let Some(f) = LOADED.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(f.clone());
    }
    let device = crate::Device::gpu().index;
    let arch = cffi::cuda_compute_capability(device)?;
    let stamp = format!("rmlx cubin 1\nname {name}\narch {arch}\nnvrtc {}\n", cffi::nvrtc_version()?);
    let file = cache.map(|dir| dir.join(format!("{name}-{:016x}.cubin", fnv1a(&[&stamp, source]))));
    let image = match file.as_deref().and_then(|f| cached_image(f, &stamp, source)) {
        Some(image) => image,
        None => {
            let image = cffi::nvrtc_compile(source, &format!("{name}.cu"), arch)?;
            if let Some(f) = &file {
                // A cache that cannot be written only costs the next process a compilation.
                let _ = write_cached(f, &stamp, source, &image);
            }
            image
        }
    };
    let handle = cffi::cuda_load_function(device, &image, name)?;
    let f = CudaFunction { handle, device, name: name.to_string(), overlap: false };
    LOADED.lock().unwrap_or_else(|e| e.into_inner()).insert(key, f.clone());
    Ok(f)
}

/// 64-bit FNV-1a over `parts` (a file name, not a check: the file holds the whole source).
fn fnv1a(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in parts.iter().flat_map(|p| p.bytes().chain([0])) {
        h = (h ^ u64::from(b)).wrapping_mul(0x100000001b3);
    }
    h
}

/// A cache file: the stamp, the source's length and the source, then the image.
fn cached_image(file: &Path, stamp: &str, source: &str) -> Option<Vec<u8>> {
    let bytes = std::fs::read(file).ok()?;
    let head = format!("{stamp}{}\n{source}", source.len());
    bytes.starts_with(head.as_bytes()).then(|| bytes[head.len()..].to_vec()).filter(|image| !image.is_empty())
}

/// Writes a cache file whole or not at all (a temporary file renamed into place).
fn write_cached(file: &Path, stamp: &str, source: &str, image: &[u8]) -> std::io::Result<()> {
    let dir = file.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut bytes = format!("{stamp}{}\n{source}", source.len()).into_bytes();
    bytes.extend_from_slice(image);
    let temporary = file.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&temporary, bytes)?;
    std::fs::rename(&temporary, file)
}

/// One parameter of a kernel, in its source's order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KernelArg {
    /// The device address of the launch's input `i` (row-contiguous).
    Input(u32),
    /// The device address of the launch's output `i`.
    Output(u32),
    I32(i32),
    U32(u32),
    F32(f32),
    I64(i64),
    /// Value `i` of the call: the `i`-th of [`CudaLaunch::call_with`]'s values (a position that
    /// changes every call, without an array to hold it).
    Value(u32),
}

/// When an output that takes over an input (see [`CudaLaunch::updating`]) updates the input's own
/// buffer rather than a copy. Either way an input that is not row-contiguous is copied first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InPlace {
    /// Arrays stay values: the input's buffer when nothing else holds it (MLX's donation rule:
    /// no other array, and no work still queued on the GPU, refers to it), else a copy.
    Unshared,
    /// The caller owns the buffer and writes only where no other holder reads: its own buffer
    /// always, even while work queued earlier still reads it (that work runs first on the
    /// stream). Any other array over the same buffer sees the update. For a KV cache written
    /// past its valid positions, which MLX's rule would copy whole whenever the previous step is
    /// still running.
    Owned,
}

/// One kernel run of a launch: its function, grid (in blocks), block (in threads), dynamic shared
/// memory and parameters.
#[derive(Clone, Debug)]
pub struct KernelNode {
    pub function: CudaFunction,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
    pub args: Vec<KernelArg>,
}

/// A primitive made once that runs its kernels in order over the arrays it is called on and gives
/// outputs of fixed shapes and dtypes (see the module docs).
pub struct CudaLaunch {
    inner: rmlx_sys::cxx::UniquePtr<cffi::PreparedLaunch>,
    name: String,
    inputs: usize,
    values: usize,
    stream: StreamSpec,
    nodes: Vec<cffi::KernelNode>,
    args: Vec<cffi::KernelArg>,
    outputs: Vec<cffi::LaunchOutput>,
    /// Whether MLX's graph is launched right after the kernels ([`CudaLaunch::committing`]).
    commit: bool,
}

impl CudaLaunch {
    /// The launch of `nodes` making `outputs` (shape, dtype), prepared for the stream
    /// [`crate::fast::CustomKernel::call`] would take now.
    pub fn new(name: &str, nodes: &[KernelNode], outputs: &[(Vec<i32>, Dtype)]) -> Result<CudaLaunch> {
        CudaLaunch::updating(name, nodes, outputs, &[], InPlace::Unshared)
    }

    /// [`CudaLaunch::new`] where each `(output, input)` of `in_place` names an output that takes
    /// over an input of its shape and dtype, which the kernels update in place (a KV cache
    /// written at one position); `mode` says when the input's own buffer is updated rather than
    /// a copy of it.
    pub fn updating(
        name: &str,
        nodes: &[KernelNode],
        outputs: &[(Vec<i32>, Dtype)],
        in_place: &[(u32, u32)],
        mode: InPlace,
    ) -> Result<CudaLaunch> {
        let (mut ffi_nodes, mut ffi_args, mut inputs, mut values) = (Vec::new(), Vec::new(), 0, 0);
        for node in nodes {
            if node.function.device != crate::Device::gpu().index {
                return Err(Error::InvalidArgument(format!(
                    "launch `{name}`: `{}` was loaded on another device",
                    node.function.name
                )));
            }
            ffi_nodes.push(cffi::KernelNode {
                function: node.function.handle,
                grid: node.grid,
                block: node.block,
                shared_bytes: node.shared_bytes,
                first_arg: ffi_args.len() as u32,
                arg_count: node.args.len() as u32,
                overlap: node.function.overlap,
            });
            for arg in &node.args {
                let (kind, index, bits) = match *arg {
                    KernelArg::Input(i) => (0, i, 0),
                    KernelArg::Output(i) => (1, i, 0),
                    KernelArg::I32(v) => (2, 0, u64::from(v as u32)),
                    KernelArg::U32(v) => (2, 0, u64::from(v)),
                    KernelArg::F32(v) => (2, 0, u64::from(v.to_bits())),
                    KernelArg::I64(v) => (3, 0, v as u64),
                    KernelArg::Value(i) => (4, i, 0),
                };
                if let KernelArg::Value(i) = arg {
                    values = values.max(*i as usize + 1);
                }
                if let KernelArg::Input(i) = arg {
                    inputs = inputs.max(*i as usize + 1);
                }
                if matches!(arg, KernelArg::Output(i) if *i as usize >= outputs.len()) {
                    return Err(Error::InvalidArgument(format!(
                        "launch `{name}` names output {index} of {}",
                        outputs.len()
                    )));
                }
                ffi_args.push(cffi::KernelArg { kind, index, bits });
            }
        }
        let mut outs: Vec<cffi::LaunchOutput> = outputs
            .iter()
            .map(|(shape, dtype)| cffi::LaunchOutput {
                shape: shape.clone(),
                dtype: *dtype as u8,
                alias: -1,
                owned: mode == InPlace::Owned,
            })
            .collect();
        for &(output, input) in in_place {
            match outs.get_mut(output as usize) {
                Some(o) => o.alias = input as i32,
                None => return Err(Error::InvalidArgument(format!("launch `{name}` updates missing output {output}"))),
            }
            inputs = inputs.max(input as usize + 1);
        }
        let stream = kernel_stream();
        let inner = crate::lock::locked(|| cffi::prepare_launch(name, &ffi_nodes, &ffi_args, &outs, false, stream))?;
        Ok(CudaLaunch {
            inner,
            name: name.to_string(),
            inputs,
            values,
            stream,
            nodes: ffi_nodes,
            args: ffi_args,
            outputs: outs,
            commit: false,
        })
    }

    /// A launch of nodes and arguments already in the bridge's form (a merged capture's), which
    /// launches MLX's graph right after its kernels.
    fn committing(
        name: &str,
        nodes: Vec<cffi::KernelNode>,
        args: Vec<cffi::KernelArg>,
        outputs: Vec<cffi::LaunchOutput>,
        inputs: usize,
        values: usize,
    ) -> Result<CudaLaunch> {
        let stream = kernel_stream();
        let inner = crate::lock::locked(|| cffi::prepare_launch(name, &nodes, &args, &outputs, true, stream))?;
        Ok(CudaLaunch { inner, name: name.to_string(), inputs, values, stream, nodes, args, outputs, commit: true })
    }

    /// The kernels a call runs.
    pub fn kernels(&self) -> usize {
        self.nodes.len()
    }

    /// The launch's outputs over `inputs` (lazy, as any operation), on the stream
    /// [`crate::fast::CustomKernel::call`] would take now (made for another stream than its own,
    /// the primitive is made again for this call).
    pub fn call(&self, inputs: &[Array]) -> Result<Vec<Array>> {
        self.call_with(inputs, &[])
    }

    /// [`CudaLaunch::call`] with the values its [`KernelArg::Value`] parameters take in this call
    /// (scalars: `I32`, `U32`, `F32` or `I64`).
    pub fn call_with(&self, inputs: &[Array], values: &[KernelArg]) -> Result<Vec<Array>> {
        if inputs.len() < self.inputs || values.len() < self.values {
            return Err(Error::InvalidArgument(format!(
                "launch `{}` reads {} inputs and {} values, got {} and {}",
                self.name,
                self.inputs,
                self.values,
                inputs.len(),
                values.len()
            )));
        }
        let bits: Vec<u64> = values.iter().map(|v| value_bits(&self.name, v)).collect::<Result<_>>()?;
        let v = array_vec(inputs);
        let stream = kernel_stream();
        let out = crate::lock::locked(|| match stream == self.stream {
            true => cffi::call_launch(&self.inner, &v, &bits),
            false => {
                let other =
                    cffi::prepare_launch(&self.name, &self.nodes, &self.args, &self.outputs, self.commit, stream)?;
                cffi::call_launch(&other, &v, &bits)
            }
        })?;
        Ok(from_array_vec(&out))
    }
}

/// A call value's bits as the kernels read them (`I32`, `U32`, `F32` or `I64`).
fn value_bits(launch: &str, value: &KernelArg) -> Result<u64> {
    Ok(match *value {
        KernelArg::I32(v) => u64::from(v as u32),
        KernelArg::U32(v) => u64::from(v),
        KernelArg::F32(v) => u64::from(v.to_bits()),
        KernelArg::I64(v) => v as u64,
        other => {
            return Err(Error::InvalidArgument(format!(
                "launch `{launch}`: a call's value must be a scalar, not {other:?}"
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cached image is read back only for the same stamp and source, and a truncated file is a
    /// miss (compiled again), never a wrong kernel.
    #[test]
    fn cache_files_are_used_only_for_their_source() {
        let dir = std::env::temp_dir().join(format!("rmlx-cuda-cache-test-{}", std::process::id()));
        let file = dir.join("k.cubin");
        let image = [0x7fu8, b'E', b'L', b'F', 1, 2, 3];
        write_cached(&file, "stamp\n", "source", &image).unwrap();
        assert_eq!(cached_image(&file, "stamp\n", "source").as_deref(), Some(&image[..]));
        assert_eq!(cached_image(&file, "stamp\n", "source2"), None, "another source");
        assert_eq!(cached_image(&file, "other\n", "source"), None, "another compiler or device");
        let bytes = std::fs::read(&file).unwrap();
        std::fs::write(&file, &bytes[..bytes.len() - image.len()]).unwrap();
        assert_eq!(cached_image(&file, "stamp\n", "source"), None, "no image left");
        std::fs::write(&file, &bytes[..5]).unwrap();
        assert_eq!(cached_image(&file, "stamp\n", "source"), None, "truncated inside the stamp");
        assert_eq!(cached_image(&dir.join("missing.cubin"), "stamp\n", "source"), None);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_ne!(fnv1a(&["ab", "c"]), fnv1a(&["a", "bc"]), "the parts are separated");
        assert_eq!(fnv1a(&[]), 0xcbf29ce484222325);
    }
}
