//! Linear layers that read the same input (an attention layer's q, k and v projections) kept as one
//! matrix stacked by rows, so that outside training a step runs one product for all of them instead
//! of one each: a decoding step is bound by the number of graph nodes MLX launches, not by the bytes
//! of the weights. Each layer keeps its own name, parameters and adapters: its weights are row
//! ranges (views) of the stacked ones, so the weights are held once.

use super::{adapter_bank, training, Builder, Linear, LinearWeight, Split};
use crate::weights::Weight;
use crate::Result;
use rmlx::quantization::Quantized;
use rmlx::{ops, Array};

/// The stacked layer of a group and what it was stacked from.
#[derive(Clone)]
pub struct Stacked {
    linear: Linear,
    /// The group's weights when they were stacked: a layer whose weight was replaced since (full
    /// fine-tuning, loaded parameters) makes the group run layer by layer.
    weight_ids: Vec<usize>,
}

impl Stacked {
    /// `x` through every layer of `group` (as [`Linear::forward`] each would give), as one product
    /// `[..., Σ out]`, when the group is still what was stacked and no adapter changes any layer of
    /// it; else `None`.
    pub fn forward(&self, group: &[&Linear], x: &Array) -> Result<Option<Array>> {
        match self.intact(group) {
            Some(linear) => Ok(Some(linear.forward(x)?)),
            None => Ok(None),
        }
    }

    /// The stacked layer, when `group` is still what was stacked, no adapter changes any layer
    /// of it and training is off.
    pub fn intact(&self, group: &[&Linear]) -> Option<&Linear> {
        let intact = group.len() == self.weight_ids.len()
            && group.iter().zip(&self.weight_ids).all(|(l, &id)| l.lora.is_none() && l.weight_id() == id)
            && !group.iter().any(|l| adapter_bank::has_row_adapters(&l.path));
        (intact && !training()).then_some(&self.linear)
    }
}

impl Linear {
    /// An identifier of the base weight (the packed matrix when quantised).
    fn weight_id(&self) -> usize {
        match &self.weight {
            LinearWeight::Dense { w, .. } => w.id(),
            LinearWeight::Quantized(q) => q.weight.id(),
        }
    }
}

impl Builder {
    /// The layers `prefixes[i]` (`.weight` `[outputs[i], input]`, and `.bias` when `bias`), as
    /// [`Builder::linear`] builds them, and, when their weights are alike (all dense, or all
    /// quantised the same way), their stacked layer: the weights are then kept stacked and each
    /// layer's are row ranges of them. Under tensor parallelism, layer `i` is split as
    /// `splits[i]` (by its rows: this rank's rows of each, stacked).
    pub fn linear_group(
        &mut self,
        prefixes: &[&str],
        input: i32,
        outputs: &[i32],
        bias: bool,
        splits: &[Split],
    ) -> Result<(Vec<Linear>, Option<Stacked>)> {
        if splits.len() != prefixes.len() || splits.contains(&Split::Inputs) {
            return Err(crate::Error::TensorParallel("a group of layers reading one input splits by outputs".into()));
        }
        let mut weights = Vec::with_capacity(prefixes.len());
        let mut biases = Vec::with_capacity(prefixes.len());
        let mut local = Vec::with_capacity(prefixes.len());
        for ((p, &out), &split) in prefixes.iter().zip(outputs).zip(splits) {
            let name = format!("{p}.weight");
            let w = self.take_shaped(&name, &[out, input])?;
            let w = self.split_weight(&name, w, split)?;
            local.push(w.shape()[0]);
            weights.push(self.converted(w)?);
            if bias {
                let name = format!("{p}.bias");
                let b = self.take_shaped(&name, &[out])?;
                let b = match self.converted(b)? {
                    Weight::Dense(b) => b,
                    Weight::Quantized(q) => rmlx::quantization::dequantize(&q, Some(self.dtype))?,
                };
                biases.push(self.split_bias(&name, b, split)?);
            }
        }
        let shares = (prefixes.iter().zip(outputs).zip(splits))
            .map(|((p, &out), &split)| self.feature_share(&format!("{p}.weight"), (input, out), split))
            .collect::<Result<Vec<_>>>()?;
        let outputs = &local[..];
        let Some(stacked) = stack(&weights)? else {
            let mut layers = Vec::with_capacity(prefixes.len());
            for (i, w) in weights.into_iter().enumerate() {
                let w = self.record(w);
                let b = biases.get(i).map(|b| self.record_dense(b.clone()));
                let mut layer = Linear::built(w, b, (input, outputs[i]), prefixes[i], self.quantized_matvec)?;
                layer.share = shares[i];
                layers.push(layer);
            }
            return Ok((layers, None));
        };
        // Only the stacked arrays are evaluated at load; the layers' row ranges are views of them.
        let stacked = self.record(stacked);
        let stacked_bias = match biases.is_empty() {
            true => None,
            false => Some(self.record_dense(ops::concatenate(&biases.iter().collect::<Vec<_>>(), 0)?)),
        };
        let (mut layers, mut start) = (Vec::with_capacity(prefixes.len()), 0);
        for (i, (p, &out)) in prefixes.iter().zip(outputs).enumerate() {
            let end = start + out;
            let w = rows(&stacked, start, end)?;
            let b = stacked_bias.as_ref().map(|b| ops::slice(b, &[start], &[end], &[1])).transpose()?;
            let mut layer = Linear::built(w, b, (input, out), p, self.quantized_matvec)?;
            layer.share = shares[i];
            layers.push(layer);
            start = end;
        }
        let weight_ids = layers.iter().map(Linear::weight_id).collect();
        let linear = Linear::built(stacked, stacked_bias, (input, start), &prefixes.join("+"), self.quantized_matvec)?;
        Ok((layers, Some(Stacked { linear, weight_ids })))
    }
}

/// The weights stacked by rows, when they are alike.
fn stack(weights: &[Weight]) -> Result<Option<Weight>> {
    let cat = |arrays: Vec<&Array>| ops::concatenate(&arrays, 0);
    match weights {
        [] | [_] => Ok(None),
        [Weight::Dense(first), ..] => {
            let dense: Option<Vec<&Array>> = weights
                .iter()
                .map(|w| match w {
                    Weight::Dense(a) if a.dtype() == first.dtype() => Some(a),
                    _ => None,
                })
                .collect();
            dense.map(|d| Ok(Weight::Dense(cat(d)?))).transpose()
        }
        [Weight::Quantized(first), ..] => {
            let alike = |q: &Quantized| {
                (q.bits, q.group_size, q.mode, q.biases.is_some(), q.scales.dtype())
                    == (first.bits, first.group_size, first.mode, first.biases.is_some(), first.scales.dtype())
            };
            let quantized: Option<Vec<&Quantized>> = weights
                .iter()
                .map(|w| match w {
                    Weight::Quantized(q) if alike(q) => Some(q),
                    _ => None,
                })
                .collect();
            let Some(q) = quantized else { return Ok(None) };
            Ok(Some(Weight::Quantized(Quantized {
                weight: cat(q.iter().map(|q| &q.weight).collect())?,
                scales: cat(q.iter().map(|q| &q.scales).collect())?,
                biases: match first.biases.is_some() {
                    true => Some(cat(q.iter().filter_map(|q| q.biases.as_ref()).collect())?),
                    false => None,
                },
                ..first.clone()
            })))
        }
    }
}

/// Rows `start..end` of a (possibly quantised) matrix, as views.
fn rows(w: &Weight, start: i32, end: i32) -> Result<Weight> {
    let cut = |a: &Array| -> Result<Array> {
        let width = a.shape()[1];
        Ok(ops::slice(a, &[start, 0], &[end, width], &[1, 1])?)
    };
    Ok(match w {
        Weight::Dense(a) => Weight::Dense(cut(a)?),
        Weight::Quantized(q) => Weight::Quantized(Quantized {
            weight: cut(&q.weight)?,
            scales: cut(&q.scales)?,
            biases: q.biases.as_ref().map(cut).transpose()?,
            ..q.clone()
        }),
    })
}
