//! Raw bindings for kernels of rmlx's own on MLX's CUDA backend: NVRTC compiles them, the CUDA
//! driver loads them, and a primitive of the shim adds them to MLX's CUDA graph as kernel nodes.
//!
//! MLX's own custom kernels (`fast::cuda_kernel`) hash their whole source and rebuild their
//! argument list on every evaluation and are compiled again in every process. These nodes carry a
//! loaded function and an argument layout and nothing else. The shim reaches the parts of MLX's CUDA
//! backend it needs (the command encoder, its allocator) by symbol at run time, so the binary
//! still builds against MLX's CPU library; [`cffi::cuda_unavailable`] says why they are missing.
#![allow(clippy::missing_safety_doc)]

#[cxx::bridge(namespace = "rmlx_shim")]
pub mod cffi {
    /// One kernel launch of a node: its arguments are `args[first_arg..first_arg + arg_count]`.
    #[derive(Clone, Debug, PartialEq, Eq)]
    struct KernelNode {
        /// A `CUfunction` from `cuda_load_function`.
        function: u64,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: u32,
        first_arg: u32,
        arg_count: u32,
        /// May start before the node before it ends: the kernel waits for that node itself
        /// (`griddepcontrol.wait`) before it reads what earlier nodes write or writes anything.
        overlap: bool,
    }

    /// One kernel parameter. `kind`: 0 = pointer to input `index`, 1 = pointer to output `index`,
    /// 2 = a 4-byte value (`bits`' low half), 3 = an 8-byte value, 4 = value `index` of the call
    /// (`call_launch`'s `values`, 4 or 8 bytes as the parameter is).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    struct KernelArg {
        kind: u8,
        index: u32,
        bits: u64,
    }

    /// The shape and dtype code of one output; `alias`: the input whose buffer it takes over and
    /// the kernels update in place, or -1; `owned`: that input's buffer always (the caller owns
    /// it), else only when nothing else holds it (MLX's donation rule) and a copy otherwise.
    #[derive(Clone, Debug, PartialEq, Eq)]
    struct LaunchOutput {
        shape: Vec<i32>,
        dtype: u8,
        alias: i32,
        owned: bool,
    }

    /// What computes an array that is still to be evaluated, for reading a graph of launches back.
    /// `kind`: 0 nothing (the array has data, or no operation), 1 a launch of `prepare_launch`
    /// (its nodes, arguments, outputs' aliases and ownership, and the call's values follow), 2 a
    /// reshape, 3 any other operation (`name`). `output`: the array's index among the operation's
    /// outputs.
    #[derive(Clone, Debug, Default)]
    struct GraphNode {
        kind: u8,
        name: String,
        output: i32,
        nodes: Vec<KernelNode>,
        args: Vec<KernelArg>,
        aliases: Vec<i32>,
        owned: Vec<bool>,
        values: Vec<u64>,
    }

    unsafe extern "C++" {
        include!("rmlx-sys/src/cuda.h");
        #[namespace = "mlx::core"]
        #[cxx_name = "array"]
        type Array = crate::ffi::Array;
        type ArrayVec = crate::ffi::ArrayVec;
        type StreamSpec = crate::ffi::StreamSpec;

        /// A primitive made once for a list of launches, with the outputs each call makes.
        type PreparedLaunch;

        /// Empty when kernels of rmlx's own can run (MLX's CUDA backend is loaded and everything
        /// the shim needs from it, the CUDA driver and NVRTC was found); else why not.
        fn cuda_unavailable() -> String;
        /// Empty when nodes marked `overlap` start early on CUDA device `device` (a launch's nodes
        /// as a child graph of rmlx's own, chained by programmatic edges; checked once by
        /// instantiating such a graph); else why not (they are then ordered as any other node).
        fn cuda_overlap_unavailable(device: i32) -> String;
        /// `major * 10 + minor` of CUDA device `device`.
        fn cuda_compute_capability(device: i32) -> Result<i32>;
        /// The multiprocessors of CUDA device `device`.
        fn cuda_multiprocessors(device: i32) -> Result<i32>;
        /// NVRTC's version as `major * 1000 + minor * 10`.
        fn nvrtc_version() -> Result<i32>;
        /// Compiles `source` for `arch` (`major * 10 + minor`) to a cubin; NVRTC's log on failure.
        fn nvrtc_compile(source: &str, name: &str, arch: i32) -> Result<Vec<u8>>;
        /// Loads `image` into `device`'s primary context and returns its function `name` (loaded
        /// for the life of the process).
        fn cuda_load_function(device: i32, image: &[u8], name: &str) -> Result<u64>;
        /// A primitive named `name` running `nodes` in order over row-contiguous inputs; with
        /// `commit`, MLX's graph so far is launched right after its kernels are added.
        fn prepare_launch(
            name: &str,
            nodes: &[KernelNode],
            args: &[KernelArg],
            outputs: &[LaunchOutput],
            commit: bool,
            s: StreamSpec,
        ) -> Result<UniquePtr<PreparedLaunch>>;
        /// The prepared launch's outputs over `inputs` (lazy, as any op), its kind-4 arguments
        /// taken from `values` (a copy of the primitive for this call when there are any).
        fn call_launch(launch: &PreparedLaunch, inputs: &ArrayVec, values: &[u64]) -> Result<UniquePtr<ArrayVec>>;
        /// The device address of `a`'s data (evaluated, on MLX's CUDA backend).
        fn cuda_device_address(a: &Array) -> Result<u64>;
        /// What computes `a` (see [`GraphNode`]).
        fn graph_node(a: &Array) -> GraphNode;
        /// The inputs of the operation computing `a`.
        fn node_inputs(a: &Array) -> UniquePtr<ArrayVec>;
        /// The outputs of the operation computing `a`, `a` among them (`a` alone without one).
        fn node_outputs(a: &Array) -> UniquePtr<ArrayVec>;
    }
}

// SAFETY: a prepared launch is immutable once made, and rmlx calls into MLX (which reads it) under
// one process-wide lock.
unsafe impl Send for cffi::PreparedLaunch {}
unsafe impl Sync for cffi::PreparedLaunch {}
