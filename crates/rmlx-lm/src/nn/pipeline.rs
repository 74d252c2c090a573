//! Pipeline parallelism over MLX's distributed layer, for models whose blocks do not fit one
//! device: each rank of a job holds a run of consecutive decoder blocks (rank 0 the first ones),
//! each stage's output becomes the next stage's input, and the last stage's output reaches every
//! rank, so that every rank applies the final norm and the output head (held whole by every rank,
//! as the embedding is) and the ranks sample as one. A token still passes through every block in
//! turn: one sequence decodes no faster than on one device, but each rank holds and reads only its
//! blocks and their caches.
//!
//! The hand-over: by send and receive where the backend has them (MLX's ring: TCP, CPUs or GPUs,
//! one host or several), then one all-sum of the last stage's output (the others add zeros); over
//! NCCL, which has no send or receive, one all-sum per stage, every rank adding zeros but the stage
//! whose output it is ([`Ranks::without_send_recv`]).

use crate::cache::KvCache;
use crate::ranks::Ranks;
use crate::{Error, Result};
use rmlx::{ops, Array};
use std::ops::Range;

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
    /// can be, the first `layers % n` ranks holding one more. More ranks than blocks is an
    /// [`Error::Pipeline`].
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
    /// first stage, else the previous stage's output (lazy): received from it, or, without send
    /// and receive, the all-sum of every earlier stage's hand-over in turn, this rank adding zeros.
    pub fn receive(&self, h: &Array) -> Result<Array> {
        let Some(ranks) = self.ranks.as_ref().filter(|r| r.rank() > 0) else { return Ok(h.clone()) };
        if ranks.has_send_recv() {
            return ranks.recv(h.shape(), h.dtype(), ranks.rank() - 1);
        }
        let mut handed: Option<Array> = None;
        for _ in 0..ranks.rank() {
            handed = Some(ranks.all_sum(&zeros_after(h, handed.as_ref())?)?);
        }
        Ok(handed.expect("an earlier stage"))
    }

    /// The output of the whole pipeline on every rank, given this stage's output `h` (lazy): sent
    /// on to the next rank, then the last rank's output summed with everyone else's zeros (which
    /// wait for the send, so that no rank enters the sum before passing its part on); without send
    /// and receive, this stage's all-sum and every later one's. This
    /// stage's `caches` wait for it ([`KvCache::wait_for`]): a rank that evaluates only its caches
    /// (a prefill chunk) still sends, receives and sums with the others.
    pub fn pass_on(&self, h: &Array, caches: &mut [KvCache]) -> Result<Array> {
        let Some(ranks) = &self.ranks else { return Ok(h.clone()) };
        let next = ranks.rank() + 1;
        let out = match (next == ranks.size(), ranks.has_send_recv()) {
            (true, _) => ranks.all_sum(h)?,
            (false, true) => {
                let sent = ranks.send(h, next)?;
                ranks.all_sum(&zeros_after(h, Some(&sent))?)?
            }
            // This stage's hand-over, then the later stages', each waiting for the one before.
            (false, false) => {
                let mut handed = ranks.all_sum(h)?;
                for _ in next..ranks.size() {
                    handed = ranks.all_sum(&zeros_after(h, Some(&handed))?)?;
                }
                handed
            }
        };
        for cache in caches {
            cache.wait_for(&out)?;
        }
        Ok(out)
    }
}

/// Zeros shaped as `like`, evaluated only after `after` (so that the collectives of a rank run in
/// the order every other rank runs them).
fn zeros_after(like: &Array, after: Option<&Array>) -> Result<Array> {
    let zeros = ops::zeros_like(like)?;
    match after {
        Some(a) => Ok(ops::depends(&[&zeros], &[a])?.remove(0)),
        None => Ok(zeros),
    }
}

/// The decoder blocks a process holds: all of a model's, or a pipeline stage's, each named by its
/// index in the whole model (its parameters keep their checkpoint names).
#[derive(Clone)]
pub struct Blocks<B> {
    stage: Stage,
    list: Vec<B>,
}

impl<B> Blocks<B> {
    /// The blocks `list` of `stage`.
    pub fn new(stage: Stage, list: Vec<B>) -> Self {
        debug_assert_eq!(stage.layers().len(), list.len());
        Blocks { stage, list }
    }

    /// Which blocks these are.
    pub fn stage(&self) -> &Stage {
        &self.stage
    }

    /// The name of the `i`-th block held under `prefix`.
    fn name(&self, prefix: &str, i: usize) -> String {
        crate::nn::join(prefix, &(self.stage.layers().start + i).to_string())
    }
}

impl<B> std::ops::Deref for Blocks<B> {
    type Target = [B];
    fn deref(&self) -> &[B] {
        &self.list
    }
}

impl<B: crate::nn::Module> crate::nn::Module for Blocks<B> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, crate::nn::Role, &Array)) {
        for (i, m) in self.list.iter().enumerate() {
            m.visit(&self.name(prefix, i), f);
        }
    }

    fn visit_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Array)) {
        for i in 0..self.list.len() {
            let name = self.name(prefix, i);
            self.list[i].visit_mut(&name, f);
        }
    }

    fn visit_linears(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut crate::nn::Linear)) {
        for i in 0..self.list.len() {
            let name = self.name(prefix, i);
            self.list[i].visit_linears(&name, f);
        }
    }

    fn visit_switches(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut crate::nn::SwitchLinear)) {
        for i in 0..self.list.len() {
            let name = self.name(prefix, i);
            self.list[i].visit_switches(&name, f);
        }
    }
}
