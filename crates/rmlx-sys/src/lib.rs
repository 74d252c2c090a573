//! Raw bindings to MLX (`mlx::core`) through a thin C++ shim and the `cxx` crate.
//!
//! This crate does nothing clever: every function is one MLX call with its arguments converted.
//! Every call that can throw returns `Result`, and `cxx` turns the C++ exception into
//! `cxx::Exception` carrying MLX's message, so no MLX error can abort the process.
//! Use the safe `rmlx` crate instead of this one.
//!
//! Conventions:
//! - `dtype` arguments are `Dtype::Val` codes (bool=0 … complex64=13, see `rmlx::Dtype`).
//! - `StreamSpec` says where an op runs: the default stream, a device's default stream, or a stream.
//! - Optional arrays are raw pointers that may be null (hence the `unsafe fn`s).
#![allow(clippy::missing_safety_doc, clippy::too_many_arguments)]

pub use cxx;

pub mod cuda;
pub mod distributed;
pub mod transforms;
pub use transforms::tffi;

#[cxx::bridge(namespace = "rmlx_shim")]
pub mod ffi {
    /// Where an op runs. `kind`: 0 = default stream of the default device, 1 = default stream of
    /// `device_type`/`device_index`, 2 = the stream `stream_index` on that device.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    struct StreamSpec {
        kind: u8,
        device_type: u8,
        device_index: i32,
        stream_index: i32,
    }

    /// Named arrays with string metadata (safetensors) or typed metadata (GGUF).
    struct NamedArrays {
        names: Vec<String>,
        arrays: UniquePtr<ArrayVec>,
        meta_keys: Vec<String>,
        meta_values: Vec<String>,
        gguf_meta: Vec<GgufMeta>,
        meta_arrays: UniquePtr<ArrayVec>,
    }

    /// One GGUF metadata entry. `kind`: 0 = none, 1 = array (`meta_arrays[array_index]`),
    /// 2 = string (`strings[0]`), 3 = list of strings.
    struct GgufMeta {
        key: String,
        kind: u8,
        strings: Vec<String>,
        array_index: usize,
    }

    #[derive(Clone, Copy, Debug)]
    enum UnaryOp {
        Abs,
        Negative,
        Sign,
        Exp,
        Expm1,
        Log,
        Log1p,
        Log2,
        Log10,
        Sqrt,
        Rsqrt,
        Square,
        Reciprocal,
        Sin,
        Cos,
        Tan,
        Arcsin,
        Arccos,
        Arctan,
        Sinh,
        Cosh,
        Tanh,
        Arcsinh,
        Arccosh,
        Arctanh,
        Sigmoid,
        Erf,
        Erfinv,
        Floor,
        Ceil,
        LogicalNot,
        BitwiseInvert,
        IsNan,
        IsInf,
        IsFinite,
        StopGradient,
        Real,
        Imag,
        Conjugate,
        Degrees,
        Radians,
    }

    #[derive(Clone, Copy, Debug)]
    enum BinaryOp {
        Add,
        Subtract,
        Multiply,
        Divide,
        FloorDivide,
        Remainder,
        Power,
        Maximum,
        Minimum,
        Equal,
        NotEqual,
        Less,
        LessEqual,
        Greater,
        GreaterEqual,
        LogicalAnd,
        LogicalOr,
        BitwiseAnd,
        BitwiseOr,
        BitwiseXor,
        LeftShift,
        RightShift,
        Arctan2,
        LogAddExp,
        Matmul,
        Outer,
        Inner,
    }

    #[derive(Clone, Copy, Debug)]
    enum ReduceOp {
        Sum,
        Mean,
        Prod,
        Max,
        Min,
        All,
        Any,
        LogSumExp,
    }

    #[derive(Clone, Copy, Debug)]
    enum ScanOp {
        Cumsum,
        Cumprod,
        Cummax,
        Cummin,
        LogCumSumExp,
    }

    unsafe extern "C++" {
        include!("shim.h");

        #[namespace = "mlx::core"]
        #[cxx_name = "array"]
        type Array;
        /// `std::vector<mlx::core::array>`.
        type ArrayVec;

        // ---- version, devices, streams --------------------------------------------------------
        fn mlx_version() -> String;
        fn default_device() -> StreamSpec;
        fn set_default_device(device_type: u8, index: i32) -> Result<()>;
        fn is_available(device_type: u8, index: i32) -> bool;
        fn device_count(device_type: u8) -> i32;
        fn device_info(device_type: u8, index: i32) -> Result<Vec<String>>;
        fn default_stream(device_type: u8, index: i32) -> Result<StreamSpec>;
        fn new_stream(device_type: u8, index: i32) -> Result<StreamSpec>;
        fn synchronize(s: StreamSpec) -> Result<()>;
        /// Starts MLX on the calling thread (its scheduler, and with it MLX's notion of the main
        /// thread and the CUDA backend's per-thread state) and binds rmlx's streams there.
        fn init_runtime() -> Result<()>;
        /// OpenBLAS's thread count, where libmlx runs on OpenBLAS: sets it when `threads > 0`, and
        /// returns the count in force (0 when the process has no OpenBLAS).
        fn blas_threads(threads: i32) -> i32;

        // ---- array basics -----------------------------------------------------------------------
        fn array_from_data(data: &[u8], shape: &[i32], dtype: u8) -> Result<UniquePtr<Array>>;
        fn array_from_f64(value: f64, dtype: u8) -> Result<UniquePtr<Array>>;
        fn array_from_i64(value: i64, dtype: u8) -> Result<UniquePtr<Array>>;
        fn array_from_bool(value: bool) -> UniquePtr<Array>;
        fn array_from_complex(re: f32, im: f32) -> UniquePtr<Array>;
        fn array_clone(a: &Array) -> UniquePtr<Array>;
        fn array_shape(a: &Array) -> &[i32];
        fn array_strides(a: &Array) -> &[i64];
        fn array_dtype(a: &Array) -> u8;
        fn array_size(a: &Array) -> usize;
        fn array_nbytes(a: &Array) -> usize;
        fn array_itemsize(a: &Array) -> usize;
        fn array_id(a: &Array) -> usize;
        fn array_is_evaluated(a: &Array) -> bool;
        fn array_row_contiguous(a: &Array) -> bool;
        fn array_copy_to(a: &Array, out: &mut [u8]) -> Result<()>;
        /// The copy of `array_copy_to` when it needs no evaluation (the array was scheduled and is
        /// row-contiguous): waits for the array and copies; returns false, copying nothing, else.
        fn array_copy_ready(a: &Array, out: &mut [u8]) -> Result<bool>;
        /// Waits for an array that has been scheduled; returns false, doing nothing, for one that
        /// has not.
        fn array_wait(a: &Array) -> Result<bool>;
        fn array_to_string(a: &Array) -> Result<String>;
        fn graph_census(outputs: &ArrayVec) -> Result<String>;
        /// A hash of the pending graph's operations in evaluation order (see shim.cc).
        fn graph_signature(outputs: &ArrayVec) -> Result<u64>;
        fn array_eval(a: &Array) -> Result<()>;
        /// The dtype `a` and `b` promote to in a binary op.
        fn result_type(a: &Array, b: &Array) -> u8;

        fn vec_new() -> UniquePtr<ArrayVec>;
        fn vec_push(v: Pin<&mut ArrayVec>, a: &Array);
        fn vec_len(v: &ArrayVec) -> usize;
        fn vec_get(v: &ArrayVec, i: usize) -> UniquePtr<Array>;
        fn eval(v: &ArrayVec) -> Result<()>;
        fn async_eval(v: &ArrayVec) -> Result<()>;

        // ---- creation ---------------------------------------------------------------------------
        fn zeros(shape: &[i32], dtype: u8, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn ones(shape: &[i32], dtype: u8, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn full(shape: &[i32], value: &Array, dtype: u8, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn arange(start: f64, stop: f64, step: f64, dtype: u8, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn linspace(start: f64, stop: f64, num: i32, dtype: u8, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn eye(n: i32, m: i32, k: i32, dtype: u8, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn tri(n: i32, m: i32, k: i32, dtype: u8, s: StreamSpec) -> Result<UniquePtr<Array>>;

        // ---- element-wise -----------------------------------------------------------------------
        fn unary(op: UnaryOp, a: &Array, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn binary(op: BinaryOp, a: &Array, b: &Array, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn round(a: &Array, decimals: i32, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn where_(cond: &Array, x: &Array, y: &Array, s: StreamSpec) -> Result<UniquePtr<Array>>;
        unsafe fn clip(a: &Array, lo: *const Array, hi: *const Array, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn astype(a: &Array, dtype: u8, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn view(a: &Array, dtype: u8, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn isclose(
            a: &Array,
            b: &Array,
            rtol: f64,
            atol: f64,
            equal_nan: bool,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        fn array_equal(a: &Array, b: &Array, equal_nan: bool, s: StreamSpec) -> Result<UniquePtr<Array>>;

        // ---- reductions -------------------------------------------------------------------------
        fn reduce(
            op: ReduceOp,
            a: &Array,
            axes: &[i32],
            all_axes: bool,
            keepdims: bool,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        fn argmax(a: &Array, axis: i32, all_axes: bool, keepdims: bool, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn argmin(a: &Array, axis: i32, all_axes: bool, keepdims: bool, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn var(
            a: &Array,
            axes: &[i32],
            all_axes: bool,
            keepdims: bool,
            ddof: i32,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        fn std(
            a: &Array,
            axes: &[i32],
            all_axes: bool,
            keepdims: bool,
            ddof: i32,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        fn softmax(a: &Array, axes: &[i32], all_axes: bool, precise: bool, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn scan(
            op: ScanOp,
            a: &Array,
            axis: i32,
            all_axes: bool,
            reverse: bool,
            inclusive: bool,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;

        // ---- linear algebra ---------------------------------------------------------------------
        fn addmm(c: &Array, a: &Array, b: &Array, alpha: f32, beta: f32, s: StreamSpec) -> Result<UniquePtr<Array>>;
        unsafe fn gather_mm(
            a: &Array,
            b: &Array,
            lhs_indices: *const Array,
            rhs_indices: *const Array,
            sorted_indices: bool,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        fn einsum(subscripts: &str, operands: &ArrayVec, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn tensordot(a: &Array, b: &Array, axes_a: &[i32], axes_b: &[i32], s: StreamSpec) -> Result<UniquePtr<Array>>;

        // ---- shapes -----------------------------------------------------------------------------
        fn reshape(a: &Array, shape: &[i32], s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn transpose(a: &Array, axes: &[i32], all_axes: bool, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn swapaxes(a: &Array, axis1: i32, axis2: i32, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn moveaxis(a: &Array, source: i32, destination: i32, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn expand_dims(a: &Array, axes: &[i32], s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn squeeze(a: &Array, axes: &[i32], all_axes: bool, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn flatten(a: &Array, start_axis: i32, end_axis: i32, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn unflatten(a: &Array, axis: i32, shape: &[i32], s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn broadcast_to(a: &Array, shape: &[i32], s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn concatenate(arrays: &ArrayVec, axis: i32, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn stack(arrays: &ArrayVec, axis: i32, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn split_sections(a: &Array, num: i32, axis: i32, s: StreamSpec) -> Result<UniquePtr<ArrayVec>>;
        fn depends(inputs: &ArrayVec, dependencies: &ArrayVec) -> Result<UniquePtr<ArrayVec>>;
        fn split_indices(a: &Array, indices: &[i32], axis: i32, s: StreamSpec) -> Result<UniquePtr<ArrayVec>>;
        fn pad(
            a: &Array,
            axes: &[i32],
            low: &[i32],
            high: &[i32],
            value: &Array,
            mode: &str,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        fn repeat(a: &Array, repeats: i32, axis: i32, all_axes: bool, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn tile(a: &Array, reps: &[i32], s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn as_strided(
            a: &Array,
            shape: &[i32],
            strides: &[i64],
            offset: usize,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        fn contiguous(a: &Array, allow_col_major: bool, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn flip(a: &Array, axes: &[i32], s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn roll(a: &Array, shift: i32, axis: i32, all_axes: bool, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn tril(a: &Array, k: i32, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn triu(a: &Array, k: i32, s: StreamSpec) -> Result<UniquePtr<Array>>;

        // ---- indexing ---------------------------------------------------------------------------
        fn slice(a: &Array, start: &[i32], stop: &[i32], strides: &[i32], s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn slice_dynamic(
            a: &Array,
            start: &Array,
            axes: &[i32],
            sizes: &[i32],
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        fn slice_update(
            src: &Array,
            update: &Array,
            start: &[i32],
            stop: &[i32],
            strides: &[i32],
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        fn slice_update_dynamic(
            src: &Array,
            update: &Array,
            start: &Array,
            axes: &[i32],
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        fn take(a: &Array, indices: &Array, axis: i32, all_axes: bool, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn take_along_axis(
            a: &Array,
            indices: &Array,
            axis: i32,
            all_axes: bool,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        fn put_along_axis(
            a: &Array,
            indices: &Array,
            values: &Array,
            axis: i32,
            all_axes: bool,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        fn scatter_add_axis(
            a: &Array,
            indices: &Array,
            values: &Array,
            axis: i32,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        fn scatter(
            a: &Array,
            indices: &ArrayVec,
            updates: &Array,
            axes: &[i32],
            add: bool,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        fn gather(
            a: &Array,
            indices: &ArrayVec,
            axes: &[i32],
            slice_sizes: &[i32],
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;

        // ---- sorting ----------------------------------------------------------------------------
        fn sort(a: &Array, axis: i32, all_axes: bool, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn argsort(a: &Array, axis: i32, all_axes: bool, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn partition(a: &Array, kth: i32, axis: i32, all_axes: bool, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn argpartition(a: &Array, kth: i32, axis: i32, all_axes: bool, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn topk(a: &Array, k: i32, axis: i32, all_axes: bool, s: StreamSpec) -> Result<UniquePtr<Array>>;

        // ---- fast -------------------------------------------------------------------------------
        unsafe fn rms_norm(x: &Array, weight: *const Array, eps: f32, s: StreamSpec) -> Result<UniquePtr<Array>>;
        unsafe fn layer_norm(
            x: &Array,
            weight: *const Array,
            bias: *const Array,
            eps: f32,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        unsafe fn rope(
            x: &Array,
            dims: i32,
            traditional: bool,
            base: f32,
            has_base: bool,
            scale: f32,
            offset: i32,
            offset_array: *const Array,
            freqs: *const Array,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        unsafe fn scaled_dot_product_attention(
            q: &Array,
            k: &Array,
            v: &Array,
            scale: f32,
            mask_mode: &str,
            mask: *const Array,
            sinks: *const Array,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;

        // ---- quantization -----------------------------------------------------------------------
        unsafe fn quantize(
            w: &Array,
            group_size: i32,
            bits: i32,
            mode: &str,
            global_scale: *const Array,
            s: StreamSpec,
        ) -> Result<UniquePtr<ArrayVec>>;
        unsafe fn dequantize(
            w: &Array,
            scales: &Array,
            biases: *const Array,
            group_size: i32,
            bits: i32,
            mode: &str,
            global_scale: *const Array,
            dtype: i32,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        unsafe fn quantized_matmul(
            x: &Array,
            w: &Array,
            scales: &Array,
            biases: *const Array,
            transpose: bool,
            group_size: i32,
            bits: i32,
            mode: &str,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        unsafe fn gather_qmm(
            x: &Array,
            w: &Array,
            scales: &Array,
            biases: *const Array,
            lhs_indices: *const Array,
            rhs_indices: *const Array,
            transpose: bool,
            group_size: i32,
            bits: i32,
            mode: &str,
            sorted_indices: bool,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;

        // ---- random -----------------------------------------------------------------------------
        fn random_seed(seed: u64);
        fn random_key(seed: u64) -> Result<UniquePtr<Array>>;
        fn random_split(key: &Array, num: i32, s: StreamSpec) -> Result<UniquePtr<Array>>;
        unsafe fn random_uniform(
            low: &Array,
            high: &Array,
            shape: &[i32],
            dtype: u8,
            key: *const Array,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        unsafe fn random_normal(
            shape: &[i32],
            dtype: u8,
            loc: f32,
            scale: f32,
            key: *const Array,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        unsafe fn random_truncated_normal(
            lower: &Array,
            upper: &Array,
            shape: &[i32],
            dtype: u8,
            key: *const Array,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        unsafe fn random_randint(
            low: &Array,
            high: &Array,
            shape: &[i32],
            dtype: u8,
            key: *const Array,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        unsafe fn random_bernoulli(
            p: &Array,
            shape: &[i32],
            key: *const Array,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        unsafe fn random_categorical(
            logits: &Array,
            axis: i32,
            num_samples: i32,
            key: *const Array,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;
        unsafe fn random_gumbel(shape: &[i32], dtype: u8, key: *const Array, s: StreamSpec)
            -> Result<UniquePtr<Array>>;
        unsafe fn random_permutation(
            x: &Array,
            axis: i32,
            key: *const Array,
            s: StreamSpec,
        ) -> Result<UniquePtr<Array>>;

        // ---- io ---------------------------------------------------------------------------------
        fn load_safetensors(path: &str, s: StreamSpec) -> Result<NamedArrays>;
        fn save_safetensors(
            path: &str,
            names: &[String],
            arrays: &ArrayVec,
            meta_keys: &[String],
            meta_values: &[String],
        ) -> Result<()>;
        fn load_gguf(path: &str, s: StreamSpec) -> Result<NamedArrays>;
        fn save_gguf(
            path: &str,
            names: &[String],
            arrays: &ArrayVec,
            meta: &[GgufMeta],
            meta_arrays: &ArrayVec,
        ) -> Result<()>;
        fn load_npy(path: &str, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn save_npy(path: &str, a: &Array) -> Result<()>;

        // ---- memory -----------------------------------------------------------------------------
        fn get_active_memory() -> usize;
        fn get_peak_memory() -> usize;
        fn reset_peak_memory();
        fn get_cache_memory() -> usize;
        fn set_memory_limit(limit: usize) -> Result<usize>;
        fn get_memory_limit() -> usize;
        fn set_cache_limit(limit: usize) -> Result<usize>;
        fn set_wired_limit(limit: usize) -> Result<usize>;
        fn clear_cache();

        // ---- benchmarks: the same loops as the Rust benchmarks, in C++ --------------------------
        fn bench_build_add_chain(n: i32, s: StreamSpec) -> Result<f64>;
        fn bench_eval_add_chain(n: i32, s: StreamSpec) -> Result<f64>;
        fn bench_eval_each_add(n: i32, s: StreamSpec) -> Result<f64>;
    }

    impl UniquePtr<Array> {}
    impl UniquePtr<ArrayVec> {}
}

// SAFETY: an `mlx::core::array` is a handle (a `shared_ptr` to its descriptor) whose reference count
// is atomic; moving the handle to another thread is sound. Concurrent use of one handle from several
// threads is not (evaluation mutates the descriptor), so `Array` is deliberately not `Sync`.
unsafe impl Send for ffi::Array {}
unsafe impl Send for ffi::ArrayVec {}
