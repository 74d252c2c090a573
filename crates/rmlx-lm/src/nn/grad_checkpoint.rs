//! Gradient checkpointing of decoder blocks, as mlx-lm's `--grad-checkpoint` does it: inside
//! [`with_grad_checkpoint`], every block a model runs through [`checkpointed`] is a function under
//! MLX's `checkpoint`, whose intermediate activations are not kept for the backward pass but
//! recomputed from the block's input when the gradient needs them. Training then holds one hidden
//! state per block instead of every block's activations, for about one more forward pass of compute.
//!
//! Gradients flow only to a checkpointed function's explicit inputs, not to the arrays it captures.
//! The block's parameters being differentiated (the tracers of the enclosing transform: LoRA
//! factors, or the weights themselves in full fine-tuning) are therefore inputs of the function,
//! which sets them into its own copy of the block before running it (mlx-lm passes
//! `trainable_parameters()` the same way); frozen weights are captured as constants.

use super::lora::{next_dropout_key, training, with_dropout_key, with_training};
use super::Module;
use crate::cache::KvCache;
use crate::Result;
use rmlx::{random, transforms, Array, Dtype};
use std::cell::Cell;

thread_local! {
    static ENABLED: Cell<bool> = const { Cell::new(false) };
}

/// Whether blocks run on this thread are checkpointed (inside [`with_grad_checkpoint`]).
pub fn grad_checkpointing() -> bool {
    ENABLED.with(Cell::get)
}

/// Runs `f` with the decoder blocks of every model run on this thread checkpointed (`enabled`) or
/// not. Wrap the loss whose gradient is taken (for instance [`crate::tuner::loss_and_grad`]): a
/// forward pass without a gradient gains nothing from it.
pub fn with_grad_checkpoint<T>(enabled: bool, f: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            ENABLED.with(|e| e.set(self.0));
        }
    }
    let _restore = Restore(ENABLED.with(|e| e.replace(enabled)));
    f()
}

/// `forward(block, x, cache)`, under MLX's `checkpoint` when [`grad_checkpointing`] is on and
/// `cache` is empty (a training forward); otherwise as it is.
///
/// Checkpointed, the block attends through a throwaway cache of `cache`'s kind (a sliding-window
/// layer keeps its window) made inside the function: keys and values kept outside it would hold
/// exactly the memory checkpointing frees. `cache` itself stays empty. The function keeps the
/// training mode of the call ([`super::training`]), and in training mode draws LoRA dropout from a
/// key of its own, so that the recomputation drops what the forward pass dropped.
pub fn checkpointed<B, F>(block: &B, x: &Array, cache: &mut KvCache, forward: F) -> Result<Array>
where
    B: Module + Clone + 'static,
    F: Fn(&B, &Array, &mut KvCache) -> Result<Array> + 'static,
{
    if !grad_checkpointing() || cache.offset() > 0 {
        return forward(block, x, cache);
    }
    // The differentiated parameters, by position in visiting order, become explicit inputs.
    let mut differentiated = Vec::new();
    let mut inputs = vec![x.clone()];
    block.visit("", &mut |_, _, a| {
        let tracer = a.is_tracer();
        differentiated.push(tracer);
        if tracer {
            inputs.push(a.clone());
        }
    });
    // This block's dropout key (a uint32 pair, as MLX's keys are): the next of the caller's keys
    // inside `with_dropout_key`, else drawn from MLX's global key.
    let key = match training() {
        true => Some(match next_dropout_key()? {
            Some(k) => k,
            None => random::randint(0, i32::MAX, &[2], Dtype::Uint32, None)?,
        }),
        false => None,
    };
    let (template, fresh) = (block.clone(), cache.empty_like());
    let f = move |inputs: &[Array]| -> rmlx::Result<Vec<Array>> {
        let mut block = template.clone();
        let (mut position, mut given) = (0, inputs[1..].iter());
        block.visit_mut("", &mut |_, a| {
            if differentiated[position] {
                *a = given.next().expect("one input per differentiated parameter").clone();
            }
            position += 1;
        });
        let run = || forward(&block, &inputs[0], &mut fresh.empty_like());
        // The recomputation runs during the backward pass, outside the caller's training scope.
        let y = match &key {
            Some(key) => with_training(|| with_dropout_key(key.clone(), run)),
            None => run(),
        };
        Ok(vec![y.map_err(|e| rmlx::Error::Callback(e.to_string()))?])
    };
    let mut out = transforms::checkpoint(f).call(&inputs)?;
    Ok(out.remove(0))
}
