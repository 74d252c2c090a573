//! The ranks of a job started by `rmlx launch` as the library sees them: MLX's group, which
//! device its collectives run on, and the two collectives the models and the trainer need (an
//! all-sum, and rank 0's value everywhere).

use crate::Result;
use rmlx::distributed::{Backend, Group};
use rmlx::{ops, Array};
use std::sync::Arc;

/// The ranks of a job (`rmlx launch`) working on one model: split over them (tensor
/// parallelism) or each training on its share of every batch (data parallelism).
///
/// ```
/// use rmlx::distributed::{Backend, Group};
/// use rmlx_lm::Ranks;
/// // Outside a job: a group of one, whose collectives give back their input.
/// let ranks = Ranks::new(Group::init(Backend::Any, false)?, Backend::Any);
/// assert_eq!((ranks.rank(), ranks.size()), (0, 1));
/// let x = rmlx::Array::from_slice(&[1.5f32, -2.0], &[2])?;
/// assert_eq!(ranks.all_sum(&x)?.to_vec::<f32>()?, [1.5, -2.0]);
/// assert_eq!(ranks.from_rank0(&x)?.to_vec::<f32>()?, [1.5, -2.0]);
/// assert_eq!(ranks.broadcast_bytes(Some(b"step"))?, b"step");
/// # Ok::<(), rmlx_lm::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Ranks {
    group: Arc<Group>,
    /// The backend the group was joined with.
    backend: Backend,
    /// Whether data goes from rank to rank by send and receive (else by collectives only).
    send_recv: bool,
}

impl Ranks {
    /// The ranks of `group`, which `backend` joined.
    pub fn new(group: Group, backend: Backend) -> Self {
        Self { group: Arc::new(group), backend, send_recv: backend != Backend::Nccl }
    }

    /// These ranks passing data from one to another by all-sums only, as they must over MLX's
    /// NCCL backend (which has no send or receive); a pipeline's stages then hand over their
    /// output in one all-sum each ([`crate::nn::pipeline`]).
    pub fn without_send_recv(mut self) -> Self {
        self.send_recv = false;
        self
    }

    /// Whether data goes from rank to rank by send and receive.
    pub fn has_send_recv(&self) -> bool {
        self.send_recv
    }

    /// Whether the collectives run on the CPU: every backend but NCCL sums host memory (MLX's
    /// ring on a GPU stream fails inside CUDA graph capture and aborts the process).
    fn on_cpu(&self) -> bool {
        self.backend != Backend::Nccl
    }

    /// The backend the group was joined with.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// This process's rank (0 prints and serves).
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// How many ranks there are.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// The group.
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// The element-wise sum of `a` over the ranks (lazy).
    pub fn all_sum(&self, a: &Array) -> Result<Array> {
        self.on_collective_device(|| self.group.all_sum(a))
    }

    /// Every rank's `a` concatenated along the first axis, in rank order (lazy).
    pub fn all_gather(&self, a: &Array) -> Result<Array> {
        self.on_collective_device(|| self.group.all_gather(a))
    }

    /// Sends `a` to rank `dst` (lazy: evaluating the result completes the send). MLX's NCCL
    /// backend has none.
    pub fn send(&self, a: &Array, dst: usize) -> Result<Array> {
        self.on_collective_device(|| self.group.send(a, dst))
    }

    /// Receives an array of `shape` and `dtype` from rank `src` (lazy).
    pub fn recv(&self, shape: &[i32], dtype: rmlx::Dtype, src: usize) -> Result<Array> {
        self.on_collective_device(|| self.group.recv(shape, dtype, src))
    }

    /// `op` on the device the collectives run on.
    fn on_collective_device(&self, op: impl FnOnce() -> rmlx::Result<Array>) -> Result<Array> {
        match self.on_cpu() {
            true => Ok(rmlx::with_device(rmlx::Device::cpu(), op)?),
            false => Ok(op()?),
        }
    }

    /// Rank 0's `a` on every rank (lazy): every other rank contributes zeros to an all-sum. What
    /// makes the ranks take rank 0's decisions (a sampled token) rather than trust that their
    /// own, computed from the same numbers, agree.
    pub fn from_rank0(&self, a: &Array) -> Result<Array> {
        if self.size() == 1 {
            return Ok(a.clone());
        }
        // As int32 or float32, which every backend sums (token ids come as uint32).
        let dtype = a.dtype();
        let wide = if dtype.is_floating() { rmlx::Dtype::Float32 } else { rmlx::Dtype::Int32 };
        let own = if self.rank() == 0 { a.astype(wide)? } else { ops::zeros(a.shape(), wide)? };
        self.all_sum(&own)?.astype(dtype).map_err(Into::into)
    }

    /// The ranks that report `failed` (a blocking exchange: every rank calls it with its own),
    /// so that all of them take the same path after a step only some may fail (reading a file).
    pub fn failed_ranks(&self, failed: bool) -> Result<Vec<usize>> {
        if self.size() == 1 {
            return Ok(if failed { vec![0] } else { Vec::new() });
        }
        let mut own = vec![0i32; self.size()];
        own[self.rank()] = i32::from(failed);
        let all = self.all_sum(&Array::from_slice(&own, &[self.size() as i32])?)?.to_vec::<i32>()?;
        Ok(all.iter().enumerate().filter(|(_, &f)| f != 0).map(|(r, _)| r).collect())
    }

    /// Rank 0's `bytes` on every rank (the others pass `None`); a blocking exchange of two
    /// all-sums (the length, then the bytes), for the decisions rank 0 makes alone.
    pub fn broadcast_bytes(&self, bytes: Option<&[u8]>) -> Result<Vec<u8>> {
        let own = if self.rank() == 0 { bytes.unwrap_or_default() } else { &[] };
        let len = self.from_rank0(&Array::from_slice(&[own.len() as i32], &[1])?)?;
        let len = len.to_vec::<i32>()?[0].max(0) as usize;
        if len == 0 {
            return Ok(Vec::new());
        }
        let values: Vec<i32> = match self.rank() {
            0 => own.iter().map(|&b| b as i32).collect(),
            _ => vec![0; len],
        };
        let got = self.from_rank0(&Array::from_slice(&values, &[len as i32])?)?.to_vec::<i32>()?;
        Ok(got.into_iter().map(|v| v as u8).collect())
    }
}
