//! A decoding step's layers, captured once as one launch and replayed (MLX's CUDA backend).
//!
//! On MLX's CUDA backend a Llama or Qwen layer decodes in three launches of rmlx's kernels (the
//! normed q/k/v product, the attention over the cache, the rest of the block; a Gemma 3 layer in
//! seven, its post-norms among them), but each is a node of MLX's graph that the host builds and
//! MLX evaluates at every step: a few microseconds each, which bound the small models.
//! [`CapturedSteps::layers`] runs the layers as they are once, reads the graph they built back
//! ([`rmlx::cuda::capture`]) and, while the caches keep their buffers, runs every later step's
//! layers as that one launch over the step's hidden state and caches: the same kernels with the
//! same arguments, so the same results bit for bit. The same holds for a few positions of one
//! sequence over unbounded caches (up to [`MAX_QUERIES`]: a speculative verification pass, whose
//! attention kernel takes them all), each number of positions its own capture. Anything the
//! capture cannot take (another backend, training, adapters on rows, a batch, a long prompt, a
//! batch's cache, a cache that must grow or put a prefill's positions back in ring order, an
//! operation that is not one of rmlx's launches) runs the layers as they are. A rotating
//! cache's slot follows from the position (`cache::Ring`), which the attention kernel computes:
//! its replay takes the same value, the position, as an unbounded cache's.

use super::cuda_attention::MAX_QUERIES;
use super::cuda_fast::on_cuda;
use crate::cache::KvCache;
use crate::Result;
use rmlx::cuda::capture::{capture, Capture, Captured};
use rmlx::cuda::KernelArg;
use rmlx::{Array, Dtype};
use std::sync::{Arc, Mutex};

/// Whether decoding steps replay their layers as one captured launch where they can (see the
/// module docs): on by default; off builds every step's graph (for comparing the two).
///
/// ```
/// use rmlx_lm::nn::StepCapture;
/// assert_eq!("off".parse::<StepCapture>()?, StepCapture::Off);
/// assert_eq!(StepCapture::default(), StepCapture::On);
/// assert!(matches!("sometimes".parse::<StepCapture>(), Err(rmlx_lm::Error::InvalidParameter(_))));
/// # Ok::<(), rmlx_lm::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StepCapture {
    #[default]
    On,
    Off,
}

impl std::str::FromStr for StepCapture {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "on" => Ok(StepCapture::On),
            "off" => Ok(StepCapture::Off),
            other => Err(crate::Error::InvalidParameter(format!("step capture `{other}`: expected on or off"))),
        }
    }
}

/// What a capture is valid for: the hidden state's shape and dtype and every cache's capacity (the
/// rest of the caches' shapes is the model's).
#[derive(Clone, PartialEq, Debug)]
struct Key {
    hidden: (Vec<i32>, Dtype),
    capacities: Vec<usize>,
}

/// What became of the layers' graph for a key.
enum State {
    Captured(Captured),
    /// The layers built a graph the capture does not take, for this key: run them as they are.
    Refused,
}

/// The most keys held at once (a step and verification passes of several lengths); a new one
/// past them replaces the oldest.
const HELD: usize = 2 * MAX_QUERIES as usize;

/// A model's captured decoding steps (see the module docs). A clone starts empty (its layers may
/// change apart from the original's); [`CapturedSteps::forget`] empties it when the layers change.
pub struct CapturedSteps {
    mode: StepCapture,
    /// Each key's state, oldest first.
    states: Arc<Mutex<Vec<(Key, State)>>>,
}

impl Clone for CapturedSteps {
    fn clone(&self) -> Self {
        CapturedSteps::new(self.mode)
    }
}

impl CapturedSteps {
    /// An empty capture that takes the first step it can when `mode` is [`StepCapture::On`].
    pub fn new(mode: StepCapture) -> Self {
        CapturedSteps { mode, states: Arc::new(Mutex::new(Vec::new())) }
    }

    /// Drops the captures: the parameters they hold are no longer the layers'.
    pub fn forget(&mut self) {
        self.states.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// `run(h, caches)` (the layers over the rows `h` of `batch` sequences), or its captured
    /// replay where it serves.
    pub fn layers(
        &self,
        h: &Array,
        batch: i32,
        caches: &mut [KvCache],
        run: impl FnOnce(&Array, &mut [KvCache]) -> Result<Array>,
    ) -> Result<Array> {
        let Some((key, offset)) = self.eligible(h, batch, caches) else { return run(h, caches) };
        let positions = h.shape()[0];
        let mut states = self.states.lock().unwrap_or_else(|e| e.into_inner());
        match states.iter().find(|(k, _)| *k == key) {
            Some((_, State::Captured(captured))) => return replay(captured, h, caches, offset, positions),
            Some((_, State::Refused)) => return run(h, caches),
            None => {}
        }
        let varying = varying(h, caches);
        let out = run(h, caches)?;
        // Every cache must have taken the positions through the attention kernel.
        let advanced = caches.iter().all(|c| match c {
            KvCache::Standard(s) => s.offset as i32 == offset + positions,
            KvCache::Rotating(r) => r.offset as i32 == offset + positions,
            KvCache::Batch(_) | KvCache::Quantized(_) => false,
        });
        let captured = match advanced {
            true => capture("rmlx_decode_step", &out, &varying.iter().collect::<Vec<_>>(), &[KernelArg::I32(offset)])?,
            false => Capture::Refused("a cache did not take the positions through the attention kernel".into()),
        };
        let state = match captured {
            Capture::Captured(c) => {
                let (kernels, scratch_bytes) = (c.kernels(), c.scratch_bytes());
                tracing::debug!(positions, kernels, scratch_bytes, "decoding step captured");
                State::Captured(c)
            }
            Capture::Refused(why) => {
                tracing::debug!(positions, "decoding step not captured: {why}");
                State::Refused
            }
        };
        // A capture for other capacities than the caches' now will not serve again.
        states.retain(|(k, _)| k.capacities == key.capacities);
        if states.len() >= HELD {
            states.remove(0);
        }
        states.push((key, state));
        Ok(out)
    }

    /// The key and first position of a step the capture may take: one sequence on MLX's CUDA
    /// backend outside training and row adapters, one position (every cache an unbounded one with
    /// room for it or a rotating one ready to take it in its ring slot) or up to [`MAX_QUERIES`]
    /// (every cache an unbounded one with room for them), all caches at one position.
    fn eligible(&self, h: &Array, batch: i32, caches: &[KvCache]) -> Option<(Key, i32)> {
        let positions = *h.shape().first()?;
        let fits = self.mode == StepCapture::On
            && h.ndim() == 2
            && batch == 1
            && (1..=MAX_QUERIES).contains(&positions)
            && !caches.is_empty()
            && on_cuda()
            && !super::training()
            && !super::adapter_bank::rows_have_adapters()
            && !h.is_tracer();
        if !fits {
            return None;
        }
        let mut offset = None;
        let mut key = Key { hidden: (h.shape().to_vec(), h.dtype()), capacities: Vec::with_capacity(caches.len()) };
        for cache in caches {
            // The buffers must take the position as they are (no growth, a ring in its order).
            let (position, capacity) = match cache {
                KvCache::Standard(c) => {
                    let (Some(_), Some(_), Some(_)) = (&c.keys, &c.values, &c.done) else { return None };
                    (c.offset + positions as usize <= c.capacity()).then_some((c.offset, c.capacity()))?
                }
                KvCache::Rotating(_) if positions > 1 => return None,
                KvCache::Rotating(c) => {
                    let (Some(_), Some(_), Some(_)) = (&c.keys, &c.values, &c.done) else { return None };
                    c.next_slot().map(|_| (c.offset, c.capacity()))?
                }
                KvCache::Batch(_) | KvCache::Quantized(_) => return None,
            };
            if *offset.get_or_insert(position) != position {
                return None;
            }
            key.capacities.push(capacity);
        }
        Some((key, i32::try_from(offset?).ok()?))
    }
}

/// The step's varying arrays: the rows, then each cache's keys, values and chunk counts.
fn varying(h: &Array, caches: &[KvCache]) -> Vec<Array> {
    let mut v = vec![h.clone()];
    for cache in caches {
        let buffers = match cache {
            KvCache::Standard(c) => [&c.keys, &c.values, &c.done],
            KvCache::Rotating(c) => [&c.keys, &c.values, &c.done],
            KvCache::Batch(_) | KvCache::Quantized(_) => continue,
        };
        v.extend(buffers.into_iter().flatten().cloned());
    }
    v
}

/// The captured layers over `h` and `caches` at `offset` (the kernels write the caches' buffers in
/// place); the caches advance by `positions` (a rotating cache's by one: it takes no more).
fn replay(captured: &Captured, h: &Array, caches: &mut [KvCache], offset: i32, positions: i32) -> Result<Array> {
    let varying = varying(h, caches);
    let out = captured.call(&varying.iter().collect::<Vec<_>>(), &[KernelArg::I32(offset)])?;
    for cache in caches.iter_mut() {
        match cache {
            KvCache::Standard(c) => c.offset += positions as usize,
            KvCache::Rotating(c) => c.advance(),
            KvCache::Batch(_) | KvCache::Quantized(_) => {}
        }
    }
    Ok(out)
}
