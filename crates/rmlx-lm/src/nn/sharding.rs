//! Tensor parallelism over MLX's distributed layer, as Megatron-LM lays it out and mlx-lm's
//! `shard_linear` does it: in every block, the layers that read the residual stream (q/k/v, the
//! feed-forward's gate and up, each expert's gate and up) keep 1/n of their output features on
//! each rank, and the layers that write it back (the output projection, down, each expert's down)
//! keep the matching 1/n of their input features, so that each rank's product is a partial sum
//! and one all-sum makes the whole. Attention heads split with their rows: each rank attends with
//! its own heads and keeps their cache. Norms stay whole; the embedding and the output head are
//! split by vocabulary rows (a lookup all-sums the ranks' rows, the logits are all-gathered), as
//! vLLM does, unless the builder keeps them whole.
//!
//! A model is split while it is built: the [`Builder`](super::Builder) of a rank slices each
//! tensor it hands out ([`Split`]), quantised ones along whole groups, and a layer split by inputs
//! all-sums its output ([`super::Linear`]). Shapes that do not split evenly are a
//! [`Error::TensorParallel`] naming the tensor, at load.

use super::Builder;
use crate::ranks::Ranks;
use crate::weights::Weight;
use crate::{Error, Result};
use rmlx::quantization::Quantized;
use rmlx::{ops, Array};

/// Which part of a layer's weight `[…, out, in]` a rank holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// All of it (or there is one rank).
    Whole,
    /// Its share of the output features (rows), with their biases: the layer's output is its
    /// share of the features.
    Outputs,
    /// The output features `start .. start + count` (a rank's key/value heads where ranks
    /// outnumber them and share heads: see [`HeadShare`]).
    Rows { start: i32, count: i32 },
    /// Its share of the input features (columns): the layer's output is a partial sum the layer
    /// all-sums; a bias is added on rank 0 only, so that the sum has it once.
    Inputs,
}

/// The attention heads one rank holds: `heads / n` query heads and their key/value heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadShare {
    pub heads: i32,
    pub kv_heads: i32,
    /// The first key/value head of this rank's.
    pub first_kv_head: i32,
}

impl HeadShare {
    /// The split of a projection whose rows are `head_dim` features per head: the query's or
    /// (`kv`) the keys' and values'.
    pub fn rows(&self, kv: bool, head_dim: i32, parallel: bool) -> Split {
        match (parallel, kv) {
            (false, _) => Split::Whole,
            (true, false) => Split::Outputs,
            (true, true) => Split::Rows { start: self.first_kv_head * head_dim, count: self.kv_heads * head_dim },
        }
    }
}

/// The features of a layer's checkpoint shape one rank holds, `start .. start + len` of `of`:
/// what an adapter trained on the whole layer is cut to ([`FeatureShare::cut`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FeatureShare {
    /// Whether the share is of the input features (`Split::Inputs`) or of the outputs.
    pub inputs: bool,
    pub start: i32,
    pub len: i32,
    /// The whole layer's count of those features.
    pub of: i32,
}

impl FeatureShare {
    /// This rank's part of `a`, an array trained on the whole layer `name` whose input features
    /// run along `input_axis` and output features along `output_axis` (`None`: it has none), or
    /// an error naming it when that axis is not the whole layer's.
    pub fn cut(&self, name: &str, a: &Array, input_axis: Option<i32>, output_axis: Option<i32>) -> Result<Array> {
        let Some(axis) = (if self.inputs { input_axis } else { output_axis }) else { return Ok(a.clone()) };
        let found = a.shape().get(axis as usize).copied();
        if found != Some(self.of) {
            let what = if self.inputs { "input" } else { "output" };
            return Err(Error::InvalidParameter(format!(
                "`{name}` has shape {:?}, not {} {what} features along axis {axis} as its layer",
                a.shape(),
                self.of
            )));
        }
        Ok(ops::contiguous(&a.slice_axis(axis, self.start, self.start + self.len, 1)?)?)
    }
}

/// The vocabulary rows `start .. start + count` of the embedding and output head one rank holds.
#[derive(Clone, Debug)]
pub struct VocabShare {
    pub start: i32,
    pub count: i32,
    pub ranks: Ranks,
}

impl VocabShare {
    /// `ids` as rows of this share (0 where outside it) and whether each is inside.
    pub(crate) fn local_ids(&self, ids: &Array) -> Result<(Array, Array)> {
        let local = ids.astype(rmlx::Dtype::Int32)?.subtract(&Array::scalar(self.start))?;
        let held = local.greater_equal(&Array::scalar(0i32))?.logical_and(&local.less(&Array::scalar(self.count))?)?;
        Ok((ops::r#where(&held, &local, &Array::scalar(0i32))?, held))
    }
}

/// The ranks' `y` `[..., f]` side by side along the last axis, in rank order: `[..., n · f]`.
pub(crate) fn gather_last_axis(ranks: &Ranks, y: &Array) -> Result<Array> {
    let n = ranks.size() as i32;
    let shape = y.shape().to_vec();
    let f = *shape.last().unwrap_or(&1);
    let rows: i32 = shape[..shape.len().saturating_sub(1)].iter().product();
    // MLX gathers along the first axis: [n · rows, f] → [rows, n, f] → [..., n · f].
    let all = ranks.all_gather(&y.reshape(&[rows, f])?)?;
    let all = all.reshape(&[n, rows, f])?.transpose_axes(&[1, 0, 2])?;
    let mut out = shape;
    if let Some(last) = out.last_mut() {
        *last = n * f;
    }
    Ok(all.reshape(&out)?)
}

impl Builder {
    /// This rank's rows of a vocabulary of `vocab` tokens, where the ranks of a tensor-parallel
    /// model split the embedding and output head by vocabulary (unless the builder keeps them
    /// whole, or the ranks do not divide `vocab`).
    pub(crate) fn vocab_share(&self, vocab: i32) -> Option<VocabShare> {
        let tp = self.parallel()?;
        let n = tp.size() as i32;
        if self.whole_vocabulary || vocab % n != 0 {
            return None;
        }
        Some(VocabShare { start: tp.rank() as i32 * (vocab / n), count: vocab / n, ranks: tp.clone() })
    }

    /// The ranks the model is split over, when there are several.
    pub(crate) fn parallel(&self) -> Option<&Ranks> {
        self.tensor_parallel.as_ref().filter(|tp| tp.size() > 1)
    }

    /// The heads this rank attends with: `heads / n` query heads, and `kv_heads / n` key/value
    /// heads or, where the ranks outnumber the key/value heads (and are a multiple of them), the
    /// one their query heads read, held by every rank of its group (as vLLM does). Counts that do
    /// not split so are an [`Error::TensorParallel`].
    pub fn rank_heads(&self, heads: i32, kv_heads: i32) -> Result<HeadShare> {
        let Some(tp) = self.parallel() else { return Ok(HeadShare { heads, kv_heads, first_kv_head: 0 }) };
        let (n, r) = (tp.size() as i32, tp.rank() as i32);
        let kv_split = kv_heads > 0 && (kv_heads % n == 0 || n % kv_heads == 0);
        if heads % n != 0 || !kv_split || heads % kv_heads != 0 {
            return Err(Error::TensorParallel(format!(
                "{n} ranks cannot share {heads} query heads and {kv_heads} key/value heads evenly \
                 (use a number of ranks that divides the query heads and divides or is a multiple \
                 of the key/value heads)"
            )));
        }
        let local_kv = (kv_heads / n).max(1);
        Ok(HeadShare { heads: heads / n, kv_heads: local_kv, first_kv_head: r * kv_heads / n })
    }

    /// `count` features this rank holds of a layer split over the ranks (`Split::Outputs` or
    /// `Split::Inputs`).
    pub fn rank_features(&self, name: &str, count: i32, split: Split) -> Result<i32> {
        Ok(self.range(name, count, split)?.map_or(count, |(_, len)| len))
    }

    /// The features `(start, len)` this rank holds of `count` under `split`; `None`: all.
    fn range(&self, name: &str, count: i32, split: Split) -> Result<Option<(i32, i32)>> {
        let Some(tp) = self.parallel() else { return Ok(None) };
        let (n, r) = (tp.size() as i32, tp.rank() as i32);
        match split {
            Split::Whole => Ok(None),
            Split::Rows { start, count: len } if start >= 0 && len > 0 && start + len <= count => {
                Ok(Some((start, len)))
            }
            Split::Rows { start, count: len } => {
                Err(Error::TensorParallel(format!("`{name}`: rows {start}..{} of {count}", start + len)))
            }
            Split::Outputs | Split::Inputs if count % n == 0 => Ok(Some((r * count / n, count / n))),
            Split::Outputs | Split::Inputs => Err(Error::TensorParallel(format!(
                "`{name}` has {count} features, which {n} ranks cannot share evenly"
            ))),
        }
    }

    /// The features this rank holds of a layer `name` of `(input, output)` features in the
    /// checkpoint split as `split`; `None`: all of them.
    pub(crate) fn feature_share(
        &self,
        name: &str,
        (input, output): (i32, i32),
        split: Split,
    ) -> Result<Option<FeatureShare>> {
        let (inputs, of) = match split {
            Split::Inputs => (true, input),
            _ => (false, output),
        };
        Ok(self.range(name, of, split)?.map(|(start, len)| FeatureShare { inputs, start, len, of }))
    }

    /// This rank's part of the weight `name` (`[…, out, in]`, as taken from the checkpoint).
    pub(crate) fn split_weight(&self, name: &str, w: Weight, split: Split) -> Result<Weight> {
        let shape = w.shape();
        let nd = shape.len() as i32;
        let axis = match split {
            Split::Inputs => nd - 1,
            _ => (nd - 2).max(0),
        };
        let Some((start, len)) = self.range(name, shape[axis as usize], split)? else { return Ok(w) };
        // This rank's part read from the file alone where the tensor is the file's (`part_name`
        // names the file's tensor of `a`), else the whole tensor read and a copy of the part kept.
        let prefix = name.strip_suffix(".weight").unwrap_or(name);
        let cut = |a: &Array, part_name: &str, start: i32, len: i32| -> Result<Array> {
            if let Some(source) = self.weights.source(part_name).filter(|s| s.shape == a.shape()) {
                if let Some(part) = crate::weights::read_part(source, axis as usize, start, len)? {
                    return Ok(part);
                }
            }
            Ok(ops::contiguous(&a.slice_axis(axis, start, start + len, 1)?)?)
        };
        let (weight, scales, biases) = (name.to_string(), format!("{prefix}.scales"), format!("{prefix}.biases"));
        Ok(match w {
            Weight::Dense(a) => Weight::Dense(cut(&a, &weight, start, len)?),
            Weight::Quantized(q) if split != Split::Inputs => Weight::Quantized(Quantized {
                weight: cut(&q.weight, &weight, start, len)?,
                scales: cut(&q.scales, &scales, start, len)?,
                biases: q.biases.as_ref().map(|b| cut(b, &biases, start, len)).transpose()?,
                ..q
            }),
            Weight::Quantized(q) => {
                let (gs, bits) = (q.group_size as i64, q.bits as i64);
                if len as i64 % gs != 0 || len as i64 * bits % 32 != 0 {
                    return Err(Error::TensorParallel(format!(
                        "`{name}`: its share of {len} input features would cut its quantisation groups of {gs}"
                    )));
                }
                let packed = |f: i32| (f as i64 * bits / 32) as i32;
                let groups = |f: i32| (f as i64 / gs) as i32;
                Weight::Quantized(Quantized {
                    weight: cut(&q.weight, &weight, packed(start), packed(len))?,
                    scales: cut(&q.scales, &scales, groups(start), groups(len))?,
                    biases: q.biases.as_ref().map(|b| cut(b, &biases, groups(start), groups(len))).transpose()?,
                    ..q
                })
            }
        })
    }

    /// This rank's part of the bias `name` (`[…, out]`) of a layer split as `split`: its features
    /// when split by outputs, all of it on rank 0 and zeros elsewhere under `Split::Inputs`.
    pub(crate) fn split_bias(&self, name: &str, bias: Array, split: Split) -> Result<Array> {
        let Some(tp) = self.parallel() else { return Ok(bias) };
        if split == Split::Inputs {
            return Ok(if tp.rank() == 0 { bias } else { ops::zeros_like(&bias)? });
        }
        let axis = bias.ndim() as i32 - 1;
        match self.range(name, bias.shape()[axis as usize], split)? {
            Some((start, len)) => Ok(ops::contiguous(&bias.slice_axis(axis, start, start + len, 1)?)?),
            None => Ok(bias),
        }
    }

    /// The group a layer split as `split` all-sums its output over (`Split::Inputs` on several
    /// ranks).
    pub(crate) fn reduction(&self, split: Split) -> Option<Ranks> {
        (split == Split::Inputs).then(|| self.parallel().cloned()).flatten()
    }
}
