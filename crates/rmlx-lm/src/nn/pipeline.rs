//! Pipeline parallelism over MLX's distributed layer, for models whose blocks do not fit one
//! device: each rank of a job holds a run of consecutive decoder blocks (rank 0 the first ones),
//! the hidden states go from each rank to the next by send and receive, and the last rank's
//! output reaches every rank in one all-sum (the others add zeros), so that every rank applies the
//! final norm and the output head (held whole by every rank, as the embedding is) and the ranks
//! sample as one. A token still passes through every block in turn: one sequence decodes no faster
//! than on one device, but each rank holds and reads only its blocks and their caches.
//!
//! Send and receive need a backend that has them: MLX's ring (TCP, CPUs or GPUs, one host or
//! several); its NCCL backend has none.

use crate::cache::KvCache;
use crate::ranks::Ranks;
use crate::{Error, Result};
use rmlx::distributed::Backend;
use rmlx::{ops, Array};
use std::ops::Range;

/// The decoder blocks this process holds and runs, and the ranks of the pipeline they are a stage
/// of (none: the whole model in one process).
#[derive(Clone, Debug)]
pub struct Stage {
    layers: Range<usize>,
    ranks: Option<Ranks>,
}

impl Stage {
    /// All `layers` blocks, in this process.
    pub fn whole(layers: usize) -> Self {
        Stage { layers: 0..layers, ranks: None }
    }

    /// This rank's share of `layers` blocks split over `ranks`: consecutive runs as even as they
    /// can be, the first `layers % n` ranks holding one more. More ranks than blocks, or a backend
    /// without send and receive, is an [`Error::Pipeline`].
    ///
    /// ```
    /// use rmlx::distributed::{Backend, Group};
    /// use rmlx_lm::{nn::pipeline::Stage, Ranks};
    /// // A group of one (outside a job) holds every block.
    /// let ranks = Ranks::new(Group::init(Backend::Any, false)?, Backend::Any);
    /// assert_eq!(Stage::of(&ranks, 28)?.layers(), 0..28);
    /// # Ok::<(), rmlx_lm::Error>(())
    /// ```
    pub fn of(ranks: &Ranks, layers: usize) -> Result<Self> {
        let (n, r) = (ranks.size(), ranks.rank());
        if n == 1 {
            return Ok(Stage::whole(layers));
        }
        if ranks.backend() == Backend::Nccl {
            return Err(Error::Pipeline(
                "the pipeline passes hidden states from rank to rank by send and receive, which MLX's \
                 NCCL backend does not have: launch the ranks with `--backend ring`"
                    .into(),
            ));
        }
        if n > layers {
            return Err(Error::Pipeline(format!(
                "{n} ranks cannot share a pipeline of {layers} blocks (at most one rank a block)"
            )));
        }
        let start = |rank: usize| rank * (layers / n) + rank.min(layers % n);
        Ok(Stage { layers: start(r)..start(r + 1), ranks: Some(ranks.clone()) })
    }

    /// The blocks held, by their index in the whole model.
    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// The input of this stage's blocks for rows shaped as `h` (the embedded tokens): `h` on the
    /// first stage, else what the previous rank sends (lazy).
    pub fn receive(&self, h: &Array) -> Result<Array> {
        match &self.ranks {
            Some(ranks) if ranks.rank() > 0 => ranks.recv(h.shape(), h.dtype(), ranks.rank() - 1),
            _ => Ok(h.clone()),
        }
    }

    /// The output of the whole pipeline on every rank, given this stage's output `h` (lazy): sent
    /// on to the next rank, then the last rank's output summed with everyone else's zeros (which
    /// wait for the send, so that no rank enters the sum before passing its part on). This
    /// stage's `caches` wait for it ([`KvCache::wait_for`]): a rank that evaluates only its caches
    /// (a prefill chunk) still sends, receives and sums with the others.
    pub fn pass_on(&self, h: &Array, caches: &mut [KvCache]) -> Result<Array> {
        let Some(ranks) = &self.ranks else { return Ok(h.clone()) };
        let next = ranks.rank() + 1;
        let out = match next == ranks.size() {
            true => ranks.all_sum(h)?,
            false => {
                let sent = ranks.send(h, next)?;
                let zeros = ops::depends(&[&ops::zeros_like(h)?], &[&sent])?.remove(0);
                ranks.all_sum(&zeros)?
            }
        };
        for cache in caches {
            cache.wait_for(&out)?;
        }
        Ok(out)
    }
}
