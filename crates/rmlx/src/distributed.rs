//! MLX's distributed layer: a [`Group`] of processes and its collective operations.
//!
//! The transport is MLX's own: the ring backend over TCP (CPUs, and across hosts), NCCL between
//! CUDA GPUs, MPI, JACCL on Macs. A process learns its place from the environment MLX's backends
//! read (`MLX_RANK`, `MLX_HOSTFILE` for the ring; `MLX_WORLD_SIZE`, `NCCL_HOST_IP`, `NCCL_PORT` for
//! NCCL), which `rmlx launch` sets. The collectives are lazy array operations like any other:
//! they run when their result is evaluated, and their errors (a peer that went away, an operation
//! a backend lacks, such as NCCL's send and receive) come back from that evaluation as `Err`.
//!
//! ```
//! use rmlx::distributed::{Backend, Group};
//! use rmlx::Array;
//! // Outside a launched job: a group of one, whose collectives return their input.
//! let group = Group::init(Backend::Any, false)?;
//! assert_eq!((group.rank(), group.size()), (0, 1));
//! let total = group.all_sum(&Array::from_slice(&[1.0f32, 2.0], &[2])?)?;
//! assert_eq!(total.to_vec::<f32>()?, vec![1.0, 2.0]);
//! # Ok::<(), rmlx::Error>(())
//! ```

use crate::device::current;
use crate::ops::wrap;
use crate::{Array, Dtype, Error, Result};
use rmlx_sys::cxx::UniquePtr;
use rmlx_sys::distributed::dffi;

/// Which of MLX's distributed backends to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// The first one configured by the environment (MLX's order).
    Any,
    /// MLX's ring over TCP sockets (`MLX_HOSTFILE`, `MLX_RANK`).
    Ring,
    /// NVIDIA's NCCL between CUDA devices (`MLX_WORLD_SIZE`, `MLX_RANK`, `NCCL_HOST_IP`, `NCCL_PORT`).
    Nccl,
    /// MPI (a job started by `mpirun`).
    Mpi,
    /// JACCL, RDMA over Thunderbolt between Macs.
    Jaccl,
}

impl Backend {
    /// MLX's name of the backend.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Any => "any",
            Backend::Ring => "ring",
            Backend::Nccl => "nccl",
            Backend::Mpi => "mpi",
            Backend::Jaccl => "jaccl",
        }
    }

    /// Whether this MLX build has the backend.
    pub fn is_available(self) -> bool {
        crate::lock::locked(|| dffi::distributed_available(self.name()))
    }
}

impl std::str::FromStr for Backend {
    type Err = Error;
    fn from_str(s: &str) -> Result<Backend> {
        [Backend::Any, Backend::Ring, Backend::Nccl, Backend::Mpi, Backend::Jaccl]
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| {
                Error::InvalidArgument(format!("unknown distributed backend `{s}` (any, ring, nccl, mpi, jaccl)"))
            })
    }
}

/// A group of processes that communicate (MLX's `distributed::Group`); rank 0 … size − 1.
pub struct Group {
    raw: UniquePtr<dffi::Group>,
    rank: usize,
    size: usize,
}

// MLX's group is a shared pointer to its backend's state; rmlx's lock serialises the calls.
unsafe impl Send for Group {}
unsafe impl Sync for Group {}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Group {{ rank: {}, size: {} }}", self.rank, self.size)
    }
}

impl Group {
    fn from_raw(raw: UniquePtr<dffi::Group>) -> Group {
        let (rank, size) = (dffi::group_rank(&raw) as usize, dffi::group_size(&raw) as usize);
        Group { raw, rank, size }
    }

    /// The group of every process `backend` finds from the environment. With `strict`, a backend
    /// that cannot start (none configured, a peer unreachable) is an error; without it, such a
    /// process gets a group of one, whose collectives return their input.
    pub fn init(backend: Backend, strict: bool) -> Result<Group> {
        if backend != Backend::Any && !backend.is_available() {
            return Err(Error::Unsupported(format!("this MLX build has no `{}` distributed backend", backend.name())));
        }
        let raw = crate::lock::locked(|| dffi::distributed_init(strict, backend.name()))?;
        Ok(Group::from_raw(raw))
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many processes the group holds.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Splits the group: processes giving the same `color` form one new group, ranked by `key`
    /// (`None`: by their rank here). Every process of the group must call it. MLX's ring backend
    /// cannot split (an error).
    pub fn split(&self, color: i32, key: Option<i32>) -> Result<Group> {
        let raw = crate::lock::locked(|| dffi::group_split(&self.raw, color, key.unwrap_or(-1)))?;
        Ok(Group::from_raw(raw))
    }

    fn collective(&self, op: u8, a: &Array) -> Result<Array> {
        wrap(|| dffi::collective(op, a.raw(), &self.raw, current()))
    }

    /// The element-wise sum of `a` over every process.
    pub fn all_sum(&self, a: &Array) -> Result<Array> {
        self.collective(0, a)
    }

    /// Every process's `a` concatenated along the first axis, in rank order.
    pub fn all_gather(&self, a: &Array) -> Result<Array> {
        self.collective(1, a)
    }

    /// The element-wise maximum of `a` over every process.
    pub fn all_max(&self, a: &Array) -> Result<Array> {
        self.collective(2, a)
    }

    /// The element-wise minimum of `a` over every process.
    pub fn all_min(&self, a: &Array) -> Result<Array> {
        self.collective(3, a)
    }

    /// The sum of `a` over every process, scattered: rank `r` gets the `r`-th of `size` equal
    /// parts of the first axis (which the group's size must divide). MLX's ring backend has none:
    /// there the evaluation is an error.
    pub fn sum_scatter(&self, a: &Array) -> Result<Array> {
        if a.ndim() == 0 || !(a.shape()[0] as usize).is_multiple_of(self.size) {
            return Err(Error::InvalidArgument(format!(
                "sum_scatter over {} processes needs a first axis they divide, not {:?}",
                self.size,
                a.shape()
            )));
        }
        self.collective(4, a)
    }

    /// Sends `a` to rank `dst`; evaluating the result (an empty array) completes the send. MLX's
    /// NCCL backend has no send or receive: there the evaluation is an error.
    pub fn send(&self, a: &Array, dst: usize) -> Result<Array> {
        self.peer(dst)?;
        wrap(|| dffi::send(a.raw(), dst as i32, &self.raw, current()))
    }

    /// Receives an array of `shape` and `dtype` from rank `src` (see [`Group::send`]).
    pub fn recv(&self, shape: &[i32], dtype: Dtype, src: usize) -> Result<Array> {
        self.peer(src)?;
        wrap(|| dffi::recv(shape, dtype as u8, src as i32, &self.raw, current()))
    }

    fn peer(&self, rank: usize) -> Result<()> {
        if rank >= self.size || rank == self.rank {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} is not another process of this group of {} (this is rank {})",
                self.size, self.rank
            )));
        }
        Ok(())
    }
}
