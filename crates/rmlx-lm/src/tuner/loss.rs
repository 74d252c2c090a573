//! The training loss: mean cross-entropy of next-token prediction over the masked targets of a
//! [`Batch`], and its gradient with respect to chosen parameters of the model.

use super::Batch;
use crate::models::Model;
use crate::nn::ModuleExt;
use crate::{Error, Result};
use rmlx::{Array, Axes, Dtype};
use std::cell::RefCell;
use std::collections::HashMap;

/// `(loss, targets counted)` of `model` on `tokens: [B, L]` with `mask: [B, L - 1]` (float32):
/// the masked mean over targets of `logsumexp(logits) - logit[target]`. Both lazy.
///
/// As in mlx-lm, each target's cross-entropy is taken in the logits' dtype (MLX's `logsumexp`
/// accumulates in float32 whatever its input) and summed in float32: a float32 copy of the
/// `[B, L, vocab]` logits would cost 4 bytes per logit, and as much again for its gradient.
pub fn batch_loss(model: &dyn Model, tokens: &Array, mask: &Array) -> Result<(Array, Array)> {
    let s = tokens.shape();
    let (rows, len) = (s[0], s[1]);
    let inputs = tokens.slice_axis(1, 0, len - 1, 1)?;
    let targets = tokens.slice_axis(1, 1, len, 1)?;
    let logits = model.forward(&inputs, &mut model.new_caches(None))?;
    let picked = rmlx::ops::take_along_axis(&logits, &targets.reshape(&[rows, len - 1, 1])?, Some(-1))?;
    let ce = (logits.logsumexp(-1, true)? - picked)?.reshape(&[rows, len - 1])?;
    let ntoks = mask.sum(Axes::All, false)?;
    let loss = ((ce * mask)?.astype(Dtype::Float32)?.sum(Axes::All, false)? / &ntoks)?;
    Ok((loss, ntoks))
}

/// The loss of a batch, the targets it counted, and the gradient of the loss for each parameter
/// named in `trainable` (the rest of the model is a constant).
pub struct LossAndGrad {
    pub loss: Array,
    pub ntoks: Array,
    pub grads: HashMap<String, Array>,
}

/// Differentiates [`batch_loss`] with respect to the parameters named in `trainable`. The model
/// holds its own parameters again when this returns (also after an error).
pub fn loss_and_grad(model: &mut dyn Model, trainable: &[String], batch: &Batch) -> Result<LossAndGrad> {
    if trainable.is_empty() {
        return Err(Error::InvalidParameter("there is nothing to train: no trainable parameter".into()));
    }
    let mut current: HashMap<String, Array> = model.parameters("").into_iter().collect();
    let values: Vec<Array> = trainable
        .iter()
        .map(|n| current.remove(n).ok_or_else(|| Error::InvalidParameter(format!("no parameter named `{n}`"))))
        .collect::<Result<_>>()?;
    let (tokens, mask) = (batch.to_array()?, batch.mask_array()?);
    let cell = RefCell::new(&mut *model);
    let f = |params: &[Array]| -> rmlx::Result<Vec<Array>> {
        let mut m = cell.borrow_mut();
        let set: HashMap<String, Array> = trainable.iter().cloned().zip(params.iter().cloned()).collect();
        m.update("", set).map_err(|e| rmlx::Error::Callback(e.to_string()))?;
        // Training mode: LoRA dropout is active while the gradient is taken.
        let (loss, ntoks) = crate::nn::with_training(|| batch_loss(&**m, &tokens, &mask))
            .map_err(|e| rmlx::Error::Callback(e.to_string()))?;
        Ok(vec![loss, ntoks])
    };
    let argnums: Vec<usize> = (0..values.len()).collect();
    let result = rmlx::transforms::value_and_grad(f, &argnums)(&values);
    // Put the real parameters back in place of the tracers the function set.
    let restore: HashMap<String, Array> = trainable.iter().cloned().zip(values).collect();
    cell.into_inner().update("", restore)?;
    let (outs, grads) = result?;
    let mut outs = outs.into_iter();
    let (loss, ntoks) = (outs.next().expect("two outputs"), outs.next().expect("two outputs"));
    Ok(LossAndGrad { loss, ntoks, grads: trainable.iter().cloned().zip(grads).collect() })
}
