//! Raw bindings for MLX's distributed layer (`mlx::core::distributed`): a group of processes
//! (MLX's ring backend over TCP, NCCL on CUDA, MPI, JACCL on Macs) and its collective operations,
//! which are lazy array operations like any other.

#[cxx::bridge(namespace = "rmlx_shim")]
pub mod dffi {
    unsafe extern "C++" {
        include!("rmlx-sys/src/distributed.h");
        #[namespace = "mlx::core"]
        #[cxx_name = "array"]
        type Array = crate::ffi::Array;
        type StreamSpec = crate::ffi::StreamSpec;

        /// MLX's `distributed::Group`.
        type Group;

        /// Whether backend `backend` ("any", "ring", "nccl", "mpi", "jaccl") was built in.
        fn distributed_available(backend: &str) -> bool;
        /// `distributed::init(strict, backend)`: the group of every process the backend finds
        /// (without `strict`, a group of one where none is configured).
        fn distributed_init(strict: bool, backend: &str) -> Result<UniquePtr<Group>>;
        fn group_rank(g: &Group) -> i32;
        fn group_size(g: &Group) -> i32;
        /// `g.split(color, key)`.
        fn group_split(g: &Group, color: i32, key: i32) -> Result<UniquePtr<Group>>;

        /// `op`: 0 all_sum, 1 all_gather, 2 all_max, 3 all_min, 4 sum_scatter.
        fn collective(op: u8, a: &Array, g: &Group, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn send(a: &Array, dst: i32, g: &Group, s: StreamSpec) -> Result<UniquePtr<Array>>;
        fn recv(shape: &[i32], dtype: u8, src: i32, g: &Group, s: StreamSpec) -> Result<UniquePtr<Array>>;
    }
}
