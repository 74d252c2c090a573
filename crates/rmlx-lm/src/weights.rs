//! A checkpoint's tensors by name, before they are built into a model: dense arrays, or MLX affine
//! quantised matrices (packed weight, scales, biases). Loaders fill it, models take from it.

use crate::{Error, Result};
use rmlx::quantization::Quantized;
use rmlx::Array;
use std::collections::HashMap;

/// One tensor of a checkpoint.
#[derive(Clone, Debug)]
pub enum Weight {
    /// A plain array (any float dtype; converted to the compute dtype when a layer is built).
    Dense(Array),
    /// An MLX affine-quantised matrix `[out, in]` stored as packed `uint32` plus per-group scales and
    /// biases.
    Quantized(Quantized),
}

impl Weight {
    /// The logical shape: for a quantised matrix, `[out, in]` of the unpacked values.
    pub fn shape(&self) -> Vec<i32> {
        match self {
            Weight::Dense(a) => a.shape().to_vec(),
            Weight::Quantized(q) => {
                let mut s = q.weight.shape().to_vec();
                if let Some(last) = s.last_mut() {
                    // In 64 bits: a packed width beyond 2^26 would overflow i32 before the division.
                    let unpacked = *last as i64 * 32 / q.bits.max(1) as i64;
                    *last = i32::try_from(unpacked).unwrap_or(i32::MAX);
                }
                s
            }
        }
    }
}

/// The tensors of a checkpoint, by (Hugging Face) name.
#[derive(Default)]
pub struct Weights {
    map: HashMap<String, Weight>,
}

impl Weights {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a tensor.
    pub fn insert(&mut self, name: impl Into<String>, w: Weight) {
        self.map.insert(name.into(), w);
    }

    /// Whether a tensor is present.
    pub fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    /// The tensor names, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.map.keys().map(String::as_str)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Removes and returns a tensor; [`Error::MissingTensor`] names it when absent.
    pub fn take(&mut self, name: &str) -> Result<Weight> {
        self.map.remove(name).ok_or_else(|| Error::MissingTensor(name.to_string()))
    }

    /// Removes and returns a tensor if present.
    pub fn take_opt(&mut self, name: &str) -> Option<Weight> {
        self.map.remove(name)
    }

    /// Borrows a tensor if present.
    pub fn get(&self, name: &str) -> Option<&Weight> {
        self.map.get(name)
    }
}
