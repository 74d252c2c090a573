//! The layers the model files are built from — linear (dense or MLX affine-quantised), embedding,
//! RMSNorm — and [`Builder`], which takes a checkpoint's tensors by name, checks their shapes and
//! converts them to the compute dtype.

use crate::weights::{Weight, Weights};
use crate::{Error, Result};
use rmlx::quantization::{dequantize, quantized_matmul, Quantized};
use rmlx::{fast, ops, Array, Dtype};

/// `y = x Wᵀ (+ b)`, with `W` dense or quantised.
pub struct Linear {
    weight: LinearWeight,
    bias: Option<Array>,
}

enum LinearWeight {
    /// `Wᵀ`, `[in, out]` (a transposed view of the stored `[out, in]`).
    Dense(Array),
    Quantized(Quantized),
}

impl Linear {
    /// Applies the layer to `x: [..., in]`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let y = match &self.weight {
            LinearWeight::Dense(wt) => x.matmul(wt)?,
            LinearWeight::Quantized(q) => quantized_matmul(x, q, true)?,
        };
        Ok(match &self.bias {
            Some(b) => (&y + b)?,
            None => y,
        })
    }

    /// Whether the weight is kept quantised.
    pub fn is_quantized(&self) -> bool {
        matches!(self.weight, LinearWeight::Quantized(_))
    }
}

/// A token embedding table `[vocab, hidden]`, dense or quantised, usable as the output head when
/// the checkpoint ties them.
pub struct Embedding {
    weight: Weight,
    dtype: Dtype,
}

impl Embedding {
    /// Looks up `ids: [...]` → `[..., hidden]`.
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        match &self.weight {
            Weight::Dense(w) => Ok(w.take(ids, Some(0))?),
            Weight::Quantized(q) => {
                let rows = Quantized {
                    weight: q.weight.take(ids, Some(0))?,
                    scales: q.scales.take(ids, Some(0))?,
                    biases: q.biases.as_ref().map(|b| b.take(ids, Some(0))).transpose()?,
                    ..q.clone()
                };
                Ok(dequantize(&rows, Some(self.dtype))?)
            }
        }
    }

    /// `x Eᵀ`: the tied output head.
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        match &self.weight {
            Weight::Dense(w) => Ok(x.matmul(&w.transpose()?)?),
            Weight::Quantized(q) => Ok(quantized_matmul(x, q, true)?),
        }
    }
}

/// Root-mean-square normalisation over the last axis with a learned scale.
pub struct RmsNorm {
    weight: Array,
    eps: f32,
}

impl RmsNorm {
    /// A norm with the given scale.
    pub fn new(weight: Array, eps: f32) -> Self {
        Self { weight, eps }
    }

    /// Normalises `x`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(fast::rms_norm(x, Some(&self.weight), self.eps)?)
    }
}

/// How a checkpoint's tensors become layers.
pub struct Builder {
    weights: Weights,
    /// The compute dtype: dense weights, scales and biases are converted to it.
    pub dtype: Dtype,
    /// Dequantise quantised matrices at load (faster on MLX's CPU backend).
    pub dequantize: bool,
    /// Every array handed to a layer so far (to evaluate them all at load).
    built: Vec<Array>,
    /// Parameters handed out so far (logical elements: quantised matrices count unpacked).
    parameters: u64,
}

impl Builder {
    /// A builder over `weights`.
    pub fn new(weights: Weights, dtype: Dtype, dequantize: bool) -> Self {
        Self { weights, dtype, dequantize, built: Vec::new(), parameters: 0 }
    }

    /// The arrays of the layers built so far, emptying the list.
    pub fn take_built(&mut self) -> Vec<Array> {
        std::mem::take(&mut self.built)
    }

    /// Parameters (logical elements) of the layers built so far.
    pub fn parameters(&self) -> u64 {
        self.parameters
    }

    fn record(&mut self, w: Weight) -> Weight {
        self.parameters += w.shape().iter().map(|&d| d as u64).product::<u64>();
        match &w {
            Weight::Dense(a) => self.built.push(a.clone()),
            Weight::Quantized(q) => {
                self.built.extend([q.weight.clone(), q.scales.clone()]);
                self.built.extend(q.biases.clone());
            }
        }
        w
    }

    /// Whether the checkpoint has a tensor.
    pub fn has(&self, name: &str) -> bool {
        self.weights.contains(name)
    }

    /// The tensors not taken so far.
    pub fn remaining(&self) -> Vec<String> {
        let mut v: Vec<String> = self.weights.names().map(str::to_string).collect();
        v.sort();
        v
    }

    /// Takes a tensor, checking its (logical) shape.
    fn take_shaped(&mut self, name: &str, shape: &[i32]) -> Result<Weight> {
        let w = self.weights.take(name)?;
        let found = w.shape();
        if found != shape {
            return Err(Error::ShapeMismatch { name: name.to_string(), expected: shape.to_vec(), found });
        }
        Ok(w)
    }

    /// Takes a tensor, checks its shape and converts it to the compute dtype.
    fn checked(&mut self, name: &str, shape: &[i32]) -> Result<Weight> {
        let w = self.take_shaped(name, shape)?;
        self.convert(w)
    }

    fn convert(&mut self, w: Weight) -> Result<Weight> {
        let w = match w {
            Weight::Dense(a) => Weight::Dense(a.astype(self.dtype)?),
            Weight::Quantized(q) => {
                // Scales and biases first (MLX dequantises in their dtype).
                let q = Quantized {
                    scales: q.scales.astype(self.dtype)?,
                    biases: q.biases.map(|b| b.astype(self.dtype)).transpose()?,
                    ..q
                };
                if self.dequantize {
                    Weight::Dense(dequantize(&q, Some(self.dtype))?)
                } else {
                    Weight::Quantized(q)
                }
            }
        };
        Ok(self.record(w))
    }

    /// A dense tensor of the given shape (quantised ones are dequantised).
    pub fn dense(&mut self, name: &str, shape: &[i32]) -> Result<Array> {
        match self.checked(name, shape)? {
            Weight::Dense(a) => Ok(a),
            Weight::Quantized(q) => Ok(dequantize(&q, Some(self.dtype))?),
        }
    }

    /// `prefix.weight` `[out, in]` and, when `bias`, `prefix.bias` `[out]`.
    pub fn linear(&mut self, prefix: &str, input: i32, output: i32, bias: bool) -> Result<Linear> {
        let weight = match self.checked(&format!("{prefix}.weight"), &[output, input])? {
            Weight::Dense(w) => LinearWeight::Dense(w.transpose()?),
            Weight::Quantized(q) => LinearWeight::Quantized(q),
        };
        let bias = if bias { Some(self.dense(&format!("{prefix}.bias"), &[output])?) } else { None };
        Ok(Linear { weight, bias })
    }

    /// `prefix.weight` `[vocab, hidden]`.
    pub fn embedding(&mut self, prefix: &str, vocab: i32, hidden: i32) -> Result<Embedding> {
        let weight = self.checked(&format!("{prefix}.weight"), &[vocab, hidden])?;
        Ok(Embedding { weight, dtype: self.dtype })
    }

    /// `prefix.weight` `[dim]` as an RMSNorm; `plus_one` stores `1 + w` (Gemma's parametrisation),
    /// computed in float32 before the conversion to the compute dtype.
    pub fn rms_norm(&mut self, prefix: &str, dim: i32, eps: f32, plus_one: bool) -> Result<RmsNorm> {
        let name = format!("{prefix}.weight");
        let Weight::Dense(w) = self.take_shaped(&name, &[dim])? else {
            return Err(Error::Config(format!("norm `{name}` is quantised")));
        };
        let w = if plus_one { (w.astype(Dtype::Float32)? + 1.0)? } else { w };
        match self.convert(Weight::Dense(w))? {
            Weight::Dense(w) => Ok(RmsNorm::new(w, eps)),
            Weight::Quantized(_) => unreachable!("dense weights stay dense"),
        }
    }
}

/// SwiGLU feed-forward (`down(silu(gate(x)) · up(x))`) or, with `gelu`, GeGLU with tanh GELU.
pub struct GatedMlp {
    gate: Linear,
    up: Linear,
    down: Linear,
    gelu: bool,
}

impl GatedMlp {
    /// `prefix.{gate,up,down}_proj`.
    pub fn load(b: &mut Builder, prefix: &str, hidden: i32, intermediate: i32, gelu: bool) -> Result<Self> {
        Ok(Self {
            gate: b.linear(&format!("{prefix}.gate_proj"), hidden, intermediate, false)?,
            up: b.linear(&format!("{prefix}.up_proj"), hidden, intermediate, false)?,
            down: b.linear(&format!("{prefix}.down_proj"), intermediate, hidden, false)?,
            gelu,
        })
    }

    /// Applies the block.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let g = self.gate.forward(x)?;
        let g = if self.gelu { ops::gelu_approx(&g)? } else { ops::silu(&g)? };
        self.down.forward(&(g * self.up.forward(x)?)?)
    }
}
