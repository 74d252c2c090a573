//! Raw bindings for MLX's function transforms, custom kernels and user-defined primitives.
//!
//! These need calls from C++ back into Rust. Each callback is a boxed Rust closure over the bridge's
//! own types ([`ArrayFn`], [`VjpFn`], [`JvpFn`], [`VmapFn`]) or a trait object ([`OpBox`] over
//! [`PrimitiveCallbacks`]); the safe `rmlx` crate builds them from its typed closures. The call
//! trampolines below catch panics, so nothing ever unwinds into C++: an `Err` (or a caught panic)
//! becomes a C++ exception that MLX propagates to the outer shim call, which returns it as
//! `cxx::Exception`.
#![allow(clippy::missing_safety_doc, clippy::too_many_arguments)]

use crate::cxx::UniquePtr;
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

#[cxx::bridge(namespace = "rmlx_shim")]
pub mod tffi {
    /// Results of `vjp`, `jvp` and `value_and_grad`: the function's outputs and the products.
    struct TransformOut {
        outputs: UniquePtr<ArrayVec>,
        products: UniquePtr<ArrayVec>,
    }

    /// The shape and dtype code of one array.
    #[derive(Clone, Debug, PartialEq, Eq)]
    struct ShapeDtype {
        shape: Vec<i32>,
        dtype: u8,
    }

    /// One contiguous buffer handed to a primitive's CPU evaluation. `ptr` is the address of the
    /// first element, `nbytes` the length in bytes.
    struct CpuBuffer {
        ptr: usize,
        nbytes: usize,
        dtype: u8,
        shape: Vec<i32>,
    }

    /// A GPU kernel from source and how to launch it. `backend`: 1 = CUDA, 2 = Metal.
    /// `template_kinds`: 0 = int, 1 = bool, 2 = dtype code (value in `template_values`).
    #[derive(Clone, Debug, Default)]
    struct KernelSpec {
        backend: u8,
        name: String,
        input_names: Vec<String>,
        output_names: Vec<String>,
        source: String,
        header: String,
        ensure_row_contiguous: bool,
        atomic_outputs: bool,
        shared_memory: i32,
        grid: [i32; 3],
        threadgroup: [i32; 3],
        template_names: Vec<String>,
        template_kinds: Vec<u8>,
        template_values: Vec<i32>,
        has_init_value: bool,
        init_value: f32,
    }

    extern "Rust" {
        type ArrayFn;
        type VjpFn;
        type JvpFn;
        type VmapFn;
        type OpBox;

        fn call_array_fn(f: &ArrayFn, args: &ArrayVec) -> Result<UniquePtr<ArrayVec>>;
        fn call_vjp_fn(
            f: &VjpFn,
            primals: &ArrayVec,
            cotangents: &ArrayVec,
            outputs: &ArrayVec,
        ) -> Result<UniquePtr<ArrayVec>>;
        fn call_jvp_fn(
            f: &JvpFn,
            primals: &ArrayVec,
            tangents: &ArrayVec,
            argnums: &[i32],
        ) -> Result<UniquePtr<ArrayVec>>;
        fn call_vmap_fn(
            f: &VmapFn,
            inputs: &ArrayVec,
            axes: &[i32],
            out_axes: &mut Vec<i32>,
        ) -> Result<UniquePtr<ArrayVec>>;

        fn op_name(op: &OpBox) -> String;
        fn op_output_specs(op: &OpBox, inputs: &[ShapeDtype]) -> Result<Vec<ShapeDtype>>;
        fn op_eval_cpu(op: &OpBox, inputs: &[CpuBuffer], outputs: &[CpuBuffer], token: usize);
        fn op_gpu_kernel(
            op: &OpBox,
            backend: u8,
            inputs: &[ShapeDtype],
            outputs: &[ShapeDtype],
            spec: &mut KernelSpec,
        ) -> Result<bool>;
        fn op_vjp(
            op: &OpBox,
            primals: &ArrayVec,
            cotangents: &ArrayVec,
            argnums: &[i32],
            outputs: &ArrayVec,
        ) -> Result<UniquePtr<ArrayVec>>;
        fn op_jvp(op: &OpBox, primals: &ArrayVec, tangents: &ArrayVec, argnums: &[i32]) -> Result<UniquePtr<ArrayVec>>;
        fn op_vmap(op: &OpBox, inputs: &ArrayVec, axes: &[i32], out_axes: &mut Vec<i32>)
            -> Result<UniquePtr<ArrayVec>>;
        fn op_equivalent(op: &OpBox, other: &OpBox) -> bool;
    }

    unsafe extern "C++" {
        include!("rmlx-sys/src/transforms.h");
        #[namespace = "mlx::core"]
        #[cxx_name = "array"]
        type Array = crate::ffi::Array;
        type ArrayVec = crate::ffi::ArrayVec;
        type StreamSpec = crate::ffi::StreamSpec;

        /// A C++ `std::function` over arrays returned by a transform (checkpoint, custom function,
        /// compile).
        type ArrayFunction;
        /// A kernel's primitive made once for one launch, stream and input layout.
        type PreparedKernel;

        // `s`: the device whose default stream MLX's own ops inside the transform use.
        fn vjp(f: &ArrayFn, primals: &ArrayVec, cotangents: &ArrayVec, s: StreamSpec) -> Result<TransformOut>;
        fn jvp(f: &ArrayFn, primals: &ArrayVec, tangents: &ArrayVec, s: StreamSpec) -> Result<TransformOut>;
        fn value_and_grad(f: &ArrayFn, inputs: &ArrayVec, argnums: &[i32], s: StreamSpec) -> Result<TransformOut>;
        fn vmap(
            f: &ArrayFn,
            inputs: &ArrayVec,
            in_axes: &[i32],
            out_axes: &[i32],
            s: StreamSpec,
        ) -> Result<UniquePtr<ArrayVec>>;
        fn checkpoint(f: Box<ArrayFn>) -> UniquePtr<ArrayFunction>;
        fn custom_function(
            f: Box<ArrayFn>,
            vjp: Box<VjpFn>,
            has_vjp: bool,
            jvp: Box<JvpFn>,
            has_jvp: bool,
            vmap: Box<VmapFn>,
            has_vmap: bool,
        ) -> UniquePtr<ArrayFunction>;
        fn compile(f: Box<ArrayFn>, fun_id: usize, shapeless: bool) -> Result<UniquePtr<ArrayFunction>>;
        fn call_function(f: &ArrayFunction, inputs: &ArrayVec, s: StreamSpec) -> Result<UniquePtr<ArrayVec>>;
        fn compile_erase(fun_id: usize);
        fn compile_clear_cache();
        fn set_compile_enabled(enabled: bool);
        /// Whether `a` is a tracer of a transform being traced (MLX cannot evaluate those).
        fn array_is_tracer(a: &Array) -> bool;
        /// Whether `a` is, or once computed will be, row-major without gaps (computed so, made by
        /// a custom primitive, or a slice update of such an array).
        fn array_known_row_contiguous(a: &Array) -> bool;
        /// Identifies the calling thread (primitives' CPU failures are kept per evaluating thread).
        fn eval_thread_token() -> usize;
        /// Makes this thread's evaluations report primitives' failures to the thread whose token
        /// this is (0: to this thread again). rmlx's evaluation thread works on behalf of others.
        fn set_eval_caller(token: usize);

        /// 0 = no GPU backend, 1 = CUDA, 2 = Metal.
        fn gpu_backend() -> u8;
        fn custom_kernel(
            spec: &KernelSpec,
            inputs: &ArrayVec,
            outputs: &[ShapeDtype],
            s: StreamSpec,
        ) -> Result<UniquePtr<ArrayVec>>;
        fn prepare_kernel(
            spec: &KernelSpec,
            inputs: &ArrayVec,
            outputs: &[ShapeDtype],
            s: StreamSpec,
        ) -> Result<UniquePtr<PreparedKernel>>;
        fn call_prepared(kernel: &PreparedKernel, inputs: &ArrayVec) -> Result<UniquePtr<ArrayVec>>;
        /// A node of `op` over `inputs`; `in_place[j]` (where given, ≥ 0) is the input whose buffer
        /// output `j` takes over on the CPU: always with `owned`, else where MLX may donate it (a
        /// copy otherwise). Such an input reaches `op`'s evaluation empty.
        fn custom_primitive(
            op: Box<OpBox>,
            inputs: &ArrayVec,
            outputs: &[ShapeDtype],
            in_place: &[i32],
            owned: bool,
            s: StreamSpec,
        ) -> Result<UniquePtr<ArrayVec>>;
        fn array_primitive_name(a: &Array) -> String;
    }

    impl UniquePtr<ArrayFunction> {}
    impl Vec<CpuBuffer> {}
    impl Vec<ShapeDtype> {}
}

use tffi::{ArrayVec, CpuBuffer, KernelSpec, ShapeDtype};

/// Callback result: the arrays, or the message of the error to raise in C++.
pub type CallbackResult = Result<UniquePtr<ArrayVec>, String>;

/// A function over arrays (`fun` in MLX's transforms).
#[allow(clippy::type_complexity)]
pub struct ArrayFn(pub Box<dyn Fn(&ArrayVec) -> CallbackResult>);
/// A custom vjp: `(primals, cotangents, outputs) -> vjps`.
#[allow(clippy::type_complexity)]
pub struct VjpFn(pub Option<Box<dyn Fn(&ArrayVec, &ArrayVec, &ArrayVec) -> CallbackResult>>);
/// A custom jvp: `(primals, tangents, argnums) -> jvps`.
#[allow(clippy::type_complexity)]
pub struct JvpFn(pub Option<Box<dyn Fn(&ArrayVec, &ArrayVec, &[i32]) -> CallbackResult>>);
/// A custom vmap: `(inputs, axes) -> (outputs, out_axes)`; `-1` marks an unbatched array.
#[allow(clippy::type_complexity)]
pub struct VmapFn(pub Option<Box<dyn Fn(&ArrayVec, &[i32]) -> Result<(UniquePtr<ArrayVec>, Vec<i32>), String>>>);

/// What a user-defined primitive does, at the level of the bridge's types. `rmlx` implements it for
/// its typed `CustomPrimitive` trait.
pub trait PrimitiveCallbacks: Send + Sync + 'static {
    fn name(&self) -> String;
    fn output_specs(&self, inputs: &[ShapeDtype]) -> Result<Vec<ShapeDtype>, String>;
    fn eval_cpu(&self, inputs: &[CpuBuffer], outputs: &[CpuBuffer]) -> Result<(), String>;
    fn gpu_kernel(
        &self,
        backend: u8,
        inputs: &[ShapeDtype],
        outputs: &[ShapeDtype],
    ) -> Result<Option<KernelSpec>, String>;
    fn vjp(&self, primals: &ArrayVec, cotangents: &ArrayVec, argnums: &[i32], outputs: &ArrayVec) -> CallbackResult;
    fn jvp(&self, primals: &ArrayVec, tangents: &ArrayVec, argnums: &[i32]) -> CallbackResult;
    fn vmap(&self, inputs: &ArrayVec, axes: &[i32]) -> Result<(UniquePtr<ArrayVec>, Vec<i32>), String>;
    fn equivalent(&self, other: &dyn PrimitiveCallbacks) -> bool;
    fn as_any(&self) -> &dyn Any;
}

/// A user-defined primitive, owned by the C++ primitive object in MLX's graph.
pub struct OpBox(pub Box<dyn PrimitiveCallbacks>);

fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => Err(format!("panic in {what}: {}", panic_message(payload.as_ref()))),
    }
}

/// The message of a caught panic.
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_string()
    }
}

fn call_array_fn(f: &ArrayFn, args: &ArrayVec) -> CallbackResult {
    guarded("a transformed function", || (f.0)(args))
}

fn call_vjp_fn(f: &VjpFn, primals: &ArrayVec, cotangents: &ArrayVec, outputs: &ArrayVec) -> CallbackResult {
    guarded("a custom vjp", || match &f.0 {
        Some(g) => g(primals, cotangents, outputs),
        None => Err("no custom vjp was given".into()),
    })
}

fn call_jvp_fn(f: &JvpFn, primals: &ArrayVec, tangents: &ArrayVec, argnums: &[i32]) -> CallbackResult {
    guarded("a custom jvp", || match &f.0 {
        Some(g) => g(primals, tangents, argnums),
        None => Err("no custom jvp was given".into()),
    })
}

fn call_vmap_fn(f: &VmapFn, inputs: &ArrayVec, axes: &[i32], out_axes: &mut Vec<i32>) -> CallbackResult {
    let (outs, axes_out) = guarded("a custom vmap", || match &f.0 {
        Some(g) => g(inputs, axes),
        None => Err("no custom vmap was given".into()),
    })?;
    *out_axes = axes_out;
    Ok(outs)
}

fn op_name(op: &OpBox) -> String {
    guarded("a primitive's name", || Ok(op.0.name())).unwrap_or_else(|e| e)
}

fn op_output_specs(op: &OpBox, inputs: &[ShapeDtype]) -> Result<Vec<ShapeDtype>, String> {
    guarded("a primitive's output_specs", || op.0.output_specs(inputs))
}

/// Errors from primitives' CPU evaluation, which runs on MLX's worker thread where nothing can be
/// thrown, with the token of the thread whose evaluation ran the primitive. The safe layer checks
/// this after every evaluation.
static PENDING_EVAL_ERRORS: Mutex<Vec<(usize, String)>> = Mutex::new(Vec::new());
static PENDING_COUNT: AtomicUsize = AtomicUsize::new(0);

/// Takes the errors recorded by primitives' CPU evaluation for evaluations the calling thread asked
/// for. One atomic load when there are none.
pub fn take_eval_errors() -> Vec<String> {
    if PENDING_COUNT.load(Ordering::Acquire) == 0 {
        return Vec::new();
    }
    let token = tffi::eval_thread_token();
    let mut pending = PENDING_EVAL_ERRORS.lock().unwrap_or_else(|p| p.into_inner());
    let (mine, others): (Vec<_>, Vec<_>) = pending.drain(..).partition(|(t, _)| *t == token);
    *pending = others;
    PENDING_COUNT.store(pending.len(), Ordering::Release);
    mine.into_iter().map(|(_, e)| e).collect()
}

fn op_eval_cpu(op: &OpBox, inputs: &[CpuBuffer], outputs: &[CpuBuffer], token: usize) {
    if let Err(e) = guarded("a primitive's eval_cpu", || op.0.eval_cpu(inputs, outputs)) {
        let name = op_name(op);
        let mut pending = PENDING_EVAL_ERRORS.lock().unwrap_or_else(|p| p.into_inner());
        pending.push((token, format!("[{name}] {e}")));
        PENDING_COUNT.store(pending.len(), Ordering::Release);
    }
}

fn op_gpu_kernel(
    op: &OpBox,
    backend: u8,
    inputs: &[ShapeDtype],
    outputs: &[ShapeDtype],
    spec: &mut KernelSpec,
) -> Result<bool, String> {
    match guarded("a primitive's gpu_kernel", || op.0.gpu_kernel(backend, inputs, outputs))? {
        Some(s) => {
            *spec = s;
            Ok(true)
        }
        None => Ok(false),
    }
}

fn op_vjp(
    op: &OpBox,
    primals: &ArrayVec,
    cotangents: &ArrayVec,
    argnums: &[i32],
    outputs: &ArrayVec,
) -> CallbackResult {
    guarded("a primitive's vjp", || op.0.vjp(primals, cotangents, argnums, outputs))
}

fn op_jvp(op: &OpBox, primals: &ArrayVec, tangents: &ArrayVec, argnums: &[i32]) -> CallbackResult {
    guarded("a primitive's jvp", || op.0.jvp(primals, tangents, argnums))
}

fn op_vmap(op: &OpBox, inputs: &ArrayVec, axes: &[i32], out_axes: &mut Vec<i32>) -> CallbackResult {
    let (outs, axes_out) = guarded("a primitive's vmap", || op.0.vmap(inputs, axes))?;
    *out_axes = axes_out;
    Ok(outs)
}

fn op_equivalent(op: &OpBox, other: &OpBox) -> bool {
    guarded("a primitive's is_equivalent", || Ok(op.0.equivalent(other.0.as_ref()))).unwrap_or(false)
}
