//! The training loss: mean cross-entropy of next-token prediction over the masked targets of a
//! [`Batch`], and its gradient with respect to chosen parameters of the model.

use super::Batch;
use crate::models::Model;
use crate::nn::{Head, ModuleExt};
use crate::{Error, Result};
use rmlx::{ops, Array, Axes, Dtype};
use std::cell::RefCell;
use std::collections::HashMap;

/// `(loss, targets counted)` of `model` on `tokens: [B, L]` with `mask: [B, L - 1]` (float32):
/// the masked mean over targets of `logsumexp(logits) - logit[target]`. Both lazy.
///
/// As in mlx-lm, each target's cross-entropy is taken in the logits' dtype (MLX's `logsumexp`
/// accumulates in float32 whatever its input) and summed in float32: a float32 copy of the
/// `[B, L, vocab]` logits would cost 4 bytes per logit, and as much again for its gradient.
/// When the model's head is linear ([`Model::linear_head`]) the logits are made a few rows at a
/// time ([`with_loss_chunk_rows`]), so they never exist whole.
pub fn batch_loss(model: &dyn Model, tokens: &Array, mask: &Array) -> Result<(Array, Array)> {
    match (model.linear_head(), chunk_rows(model)) {
        (Some(head), Some(rows)) => chunked_loss(model, head, tokens, mask, rows, false),
        _ => logits_loss(model, tokens, mask),
    }
}

/// `(B, L)` of `tokens`, which must hold at least one row of two positions (one target).
fn batch_shape(tokens: &Array) -> Result<(i32, i32)> {
    match tokens.shape() {
        &[rows, len] if rows >= 1 && len >= 2 => Ok((rows, len)),
        s => Err(Error::InvalidParameter(format!("a batch needs at least one row of two tokens, not the shape {s:?}"))),
    }
}

/// [`batch_loss`] from the whole `[B, L - 1, vocab]` logits at once.
pub fn logits_loss(model: &dyn Model, tokens: &Array, mask: &Array) -> Result<(Array, Array)> {
    let (rows, len) = batch_shape(tokens)?;
    let inputs = tokens.slice_axis(1, 0, len - 1, 1)?;
    let targets = tokens.slice_axis(1, 1, len, 1)?;
    let logits = model.forward(&inputs, &mut model.new_caches(None))?;
    let picked = ops::take_along_axis(&logits, &targets.reshape(&[rows, len - 1, 1])?, Some(-1))?;
    let ce = (logits.logsumexp(-1, true)? - picked)?.reshape(&[rows, len - 1])?;
    let ntoks = mask.sum(Axes::All, false)?;
    let loss = ((ce * mask)?.astype(Dtype::Float32)?.sum(Axes::All, false)? / &ntoks)?;
    Ok((loss, ntoks))
}

/// Logits per chunk of the chunked loss: 32 Mi (64 MiB in bfloat16).
const CHUNK_LOGITS: usize = 1 << 25;

thread_local! {
    static CHUNK_ROWS: std::cell::Cell<Option<Option<usize>>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with the losses of this module taking `rows` targets per chunk of logits (`None`:
/// the whole logits at once, [`logits_loss`]), instead of as many as make 32 Mi logits. For
/// tests and memory experiments; the result is the same up to float rounding.
pub fn with_loss_chunk_rows<T>(rows: Option<usize>, f: impl FnOnce() -> T) -> T {
    let before = CHUNK_ROWS.with(|c| c.replace(Some(rows)));
    let out = f();
    CHUNK_ROWS.with(|c| c.set(before));
    out
}

fn chunk_rows(model: &dyn Model) -> Option<usize> {
    let vocab = model.config().vocab_size.max(1) as usize;
    CHUNK_ROWS.with(|c| c.get()).unwrap_or(Some((CHUNK_LOGITS / vocab).max(1)))
}

/// The loss whose gradient is taken: [`batch_loss`], with the gradient of the chunked
/// cross-entropy written by hand when the head is frozen (see [`chunked_loss`]).
fn training_loss(model: &dyn Model, trainable: &[String], tokens: &Array, mask: &Array) -> Result<(Array, Array)> {
    let head = model.linear_head().filter(|h| {
        let prefix = format!("{}.", h.path());
        !trainable.iter().any(|n| n.starts_with(&prefix))
    });
    match (head, chunk_rows(model)) {
        (Some(head), Some(rows)) => chunked_loss(model, head, tokens, mask, rows, true),
        _ => batch_loss(model, tokens, mask),
    }
}

/// The cross-entropy of [`logits_loss`] over chunks of `chunk` targets: each chunk's logits are
/// made, reduced and dropped before the next chunk's.
///
/// With `own_gradient`, each chunk also yields the loss's gradient with respect to its hidden
/// states, `(softmax(logits) - onehot(target)) · mask / ntoks · W` (the head's transpose and one
/// row of `W`), so the backward pass never rebuilds the logits. The loss returned is then
/// `stop_gradient(loss) + Σ h·stop_gradient(dh) - stop_gradient(Σ h·dh)`: its value is the loss, its
/// gradient with respect to `h` is `dh`, and no gradient reaches the (frozen) head.
fn chunked_loss(
    model: &dyn Model,
    head: Head<'_>,
    tokens: &Array,
    mask: &Array,
    chunk: usize,
    own_gradient: bool,
) -> Result<(Array, Array)> {
    let (rows, len) = batch_shape(tokens)?;
    let n = rows * (len - 1);
    let inputs = tokens.slice_axis(1, 0, len - 1, 1)?;
    let targets = tokens.slice_axis(1, 1, len, 1)?.reshape(&[n])?;
    let h = model.forward_hidden(&inputs, &mut model.new_caches(None))?;
    let flat = h.reshape(&[n, *h.shape().last().expect("[B, L, hidden]")])?;
    let flat = if own_gradient { ops::stop_gradient(&flat)? } else { flat };
    let mask = mask.reshape(&[n])?;
    let ntoks = mask.sum(Axes::All, false)?;
    let (mut total, mut grads) = (None::<Array>, Vec::new());
    for start in (0..n).step_by(chunk) {
        let stop = (start + chunk as i32).min(n);
        let (hc, tc, mc) = (
            flat.slice_axis(0, start, stop, 1)?,
            targets.slice_axis(0, start, stop, 1)?,
            mask.slice_axis(0, start, stop, 1)?,
        );
        let logits = head.apply(&hc)?;
        let lse = logits.logsumexp(-1, true)?;
        let picked = ops::take_along_axis(&logits, &tc.reshape(&[-1, 1])?, Some(-1))?;
        let ce = (&lse - picked)?.reshape(&[-1])?;
        let sum = (ce * &mc)?.astype(Dtype::Float32)?.sum(Axes::All, false)?;
        if own_gradient {
            let weight = (&mc / &ntoks)?.astype(logits.dtype())?.reshape(&[-1, 1])?;
            let softmax = (&logits - &lse)?.exp()?;
            let dh = head.transpose(&(softmax * &weight)?)?;
            let dh = (&dh - (head.rows(&tc, dh.dtype())? * &weight)?)?;
            // The chunk's loss first, so that its logits are freed once `dh` is made.
            grads.push(ops::depends(&[&dh], &[&sum])?.remove(0));
        }
        total = Some(match total {
            Some(t) => (t + sum)?,
            None => sum,
        });
    }
    let loss = (total.expect("n > 0 targets") / &ntoks)?;
    if !own_gradient {
        return Ok((loss, ntoks));
    }
    let dh = ops::concatenate(&grads.iter().collect::<Vec<_>>(), 0)?.reshape(h.shape())?.astype(h.dtype())?;
    let dot = (&h * ops::stop_gradient(&dh)?)?.astype(Dtype::Float32)?.sum(Axes::All, false)?;
    let loss = (ops::stop_gradient(&loss)? + (&dot - ops::stop_gradient(&dot)?)?)?;
    Ok((loss, ntoks))
}

/// The loss of a batch, the targets it counted, and the gradient of the loss for each parameter
/// named in `trainable` (the rest of the model is a constant), with the values it was taken at.
pub struct LossAndGrad {
    pub loss: Array,
    pub ntoks: Array,
    pub grads: HashMap<String, Array>,
    /// The trainable parameters' values the gradient was taken at (what an optimizer updates).
    pub params: HashMap<String, Array>,
}

impl LossAndGrad {
    fn new(trainable: &[String], params: Vec<Array>, outputs: Vec<Array>, grads: Vec<Array>) -> LossAndGrad {
        let mut outputs = outputs.into_iter();
        let (loss, ntoks) = (outputs.next().expect("the loss"), outputs.next().expect("the count"));
        let named = |arrays: Vec<Array>| trainable.iter().cloned().zip(arrays).collect();
        LossAndGrad { loss, ntoks, grads: named(grads), params: named(params) }
    }
}

/// The current values of the parameters named in `trainable`, in that order.
fn trainable_values(model: &dyn Model, trainable: &[String]) -> Result<Vec<Array>> {
    if trainable.is_empty() {
        return Err(Error::InvalidParameter("there is nothing to train: no trainable parameter".into()));
    }
    let mut current: HashMap<String, Array> = model.parameters("").into_iter().collect();
    trainable
        .iter()
        .map(|n| current.remove(n).ok_or_else(|| Error::InvalidParameter(format!("no parameter named `{n}`"))))
        .collect()
}

/// `[loss, targets]` of `model` with `params` set as the parameters named `names`, in training
/// mode (LoRA dropout active): the function whose gradient is taken.
fn loss_at(
    model: &mut dyn Model,
    names: &[String],
    params: &[Array],
    tokens: &Array,
    mask: &Array,
) -> rmlx::Result<Vec<Array>> {
    let set: HashMap<String, Array> = names.iter().cloned().zip(params.iter().cloned()).collect();
    model.update("", set).map_err(|e| rmlx::Error::Callback(e.to_string()))?;
    let (loss, ntoks) = crate::nn::with_training(|| training_loss(model, names, tokens, mask))
        .map_err(|e| rmlx::Error::Callback(e.to_string()))?;
    Ok(vec![loss, ntoks])
}

/// Differentiates [`batch_loss`] with respect to the parameters named in `trainable`. The model
/// holds its own parameters again when this returns (also after an error).
pub fn loss_and_grad(model: &mut dyn Model, trainable: &[String], batch: &Batch) -> Result<LossAndGrad> {
    let values = trainable_values(model, trainable)?;
    let (tokens, mask) = (batch.to_array()?, batch.mask_array()?);
    let cell = RefCell::new(&mut *model);
    let f = |params: &[Array]| loss_at(&mut **cell.borrow_mut(), trainable, params, &tokens, &mask);
    let argnums: Vec<usize> = (0..values.len()).collect();
    let result = rmlx::transforms::value_and_grad(f, &argnums)(&values);
    // Put the real parameters back in place of the tracers the function set.
    let restore: HashMap<String, Array> = trainable.iter().cloned().zip(values.iter().cloned()).collect();
    cell.into_inner().update("", restore)?;
    let (outs, grads) = result?;
    Ok(LossAndGrad::new(trainable, values, outs, grads))
}

/// [`loss_and_grad`] as one compiled function, as mlx-lm compiles its training step: the forward
/// and backward passes are traced once per batch shape, simplified, and their runs of element-wise
/// ops fused into single kernels. The model's frozen arrays are constants of the trace (a copy of
/// the model is kept for tracing, sharing its arrays); the trainable ones and the batch are the
/// inputs. Training mode and gradient checkpointing are read when a shape is first traced, so a
/// [`CompiledLossAndGrad`] must always be called in the same mode.
///
/// LoRA dropout draws its masks from the key given to each call (an input, so not frozen into
/// the trace); [`crate::nn::with_dropout_key`] does the same for the op-by-op step.
pub struct CompiledLossAndGrad {
    f: rmlx::compile::Compiled,
    trainable: Vec<String>,
}

impl CompiledLossAndGrad {
    /// Compiles the loss of `model` and its gradient for the parameters named in `trainable`.
    pub fn new(model: &dyn Model, trainable: &[String]) -> Result<Self> {
        trainable_values(model, trainable)?;
        let copy = RefCell::new(model.boxed_clone());
        let names = trainable.to_vec();
        let n = names.len();
        let step = move |inputs: &[Array]| -> rmlx::Result<Vec<Array>> {
            let (tokens, mask, key) = (&inputs[n], &inputs[n + 1], &inputs[n + 2]);
            let loss = |params: &[Array]| loss_at(&mut **copy.borrow_mut(), &names, params, tokens, mask);
            let argnums: Vec<usize> = (0..n).collect();
            let (outs, grads) = crate::nn::with_dropout_key(key.clone(), || {
                rmlx::transforms::value_and_grad(loss, &argnums)(&inputs[..n])
            })?;
            Ok(outs.into_iter().chain(grads).collect())
        };
        let options = rmlx::compile::CompileOptions { shapeless: false, name: Some("training step".into()) };
        Ok(CompiledLossAndGrad {
            f: rmlx::compile::compile_with_constants(step, options),
            trainable: trainable.to_vec(),
        })
    }

    /// The loss of `batch` and the gradients, with the trainable parameters' current values in
    /// `model` (the model given to [`CompiledLossAndGrad::new`] or one with the same frozen arrays)
    /// and LoRA dropout drawn from `dropout_key` ([`rmlx::random::key`]).
    pub fn call(&self, model: &dyn Model, batch: &Batch, dropout_key: &Array) -> Result<LossAndGrad> {
        self.call_with_copies(model, batch, dropout_key, &HashMap::new())
    }

    /// [`CompiledLossAndGrad::call`] with the trainable parameters read from `copies` where it
    /// has them (their compute copies, [`crate::tuner::optim::Optimizer::update_with_copies`]): the gradients
    /// come in the copies' dtype, and `params` are still the model's own values.
    pub fn call_with_copies(
        &self,
        model: &dyn Model,
        batch: &Batch,
        dropout_key: &Array,
        copies: &HashMap<String, Array>,
    ) -> Result<LossAndGrad> {
        let values = trainable_values(model, &self.trainable)?;
        let read = self.trainable.iter().zip(&values).map(|(n, v)| copies.get(n).unwrap_or(v).clone());
        let inputs: Vec<Array> = read.chain([batch.to_array()?, batch.mask_array()?, dropout_key.clone()]).collect();
        let mut out = self.f.call(&inputs)?;
        let grads = out.split_off(2);
        Ok(LossAndGrad::new(&self.trainable, values, out, grads))
    }

    /// How many batch shapes have been traced.
    pub fn traces(&self) -> usize {
        self.f.trace_count()
    }
}
