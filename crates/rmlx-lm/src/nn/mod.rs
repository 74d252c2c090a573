//! The layers the model files are built from — linear (dense or MLX affine-quantised, optionally
//! with a LoRA adapter), embedding, RMSNorm — and [`Builder`], which takes a checkpoint's tensors by
//! name, checks their shapes and converts them to the compute dtype. Every layer is a [`Module`]:
//! its parameters are listed and replaced by the checkpoint's names.

mod adapter_bank;
pub(crate) mod cpu_attention;
pub(crate) mod cpu_fast;
pub(crate) mod cpu_layer;
mod cpu_pool;
pub(crate) mod cpu_qmm;
mod cpu_rows;
pub(crate) mod cuda_attention;
pub(crate) mod cuda_fast;
pub(crate) mod cuda_lora;
pub(crate) mod cuda_moe;
pub(crate) mod cuda_packed_attention;
pub(crate) mod cuda_qmv;
mod cuda_qmv_ix;
pub(crate) mod cuda_sample;
mod cuda_step;
mod fused;
mod gated;
mod grad_checkpoint;
mod head;
mod lora;
mod module;
pub mod pipeline;
mod quantized_matvec;
mod sharding;
mod stacked;
mod switch;

pub use adapter_bank::{with_row_adapters, AdapterBank};
pub use cuda_step::{CapturedSteps, StepCapture};
pub use gated::gated_activation;
pub use grad_checkpoint::{checkpointed, grad_checkpointing, with_grad_checkpoint};
pub use head::Head;
pub use lora::{training, with_dropout_key, with_training, Lora};
pub(crate) use module::module_fields;
pub use module::{join, Module, ModuleExt, Role};
pub use quantized_matvec::QuantizedMatvec;
pub use sharding::{FeatureShare, HeadShare, Split};
pub use stacked::Stacked;
pub use switch::{ExpertActivation, ExpertNames, SparseMoe, SwitchLinear, SwitchLora};

use crate::ranks::Ranks;
use crate::weights::{Weight, Weights};
use crate::{Error, Result};
use rmlx::quantization::{dequantize, quantized_matmul, QuantMode, Quantized};
use rmlx::{fast, ops, Array, DeviceType, Dtype};

/// `y = x Wᵀ (+ b) (+ scale · (x A) B)`, with `W` dense or quantised and an optional adapter.
#[derive(Clone)]
pub struct Linear {
    weight: LinearWeight,
    bias: Option<Array>,
    lora: Option<Lora>,
    input: i32,
    output: i32,
    /// The layer's name in the checkpoint (`model.layers.0.self_attn.q_proj`): where an
    /// [`AdapterBank`] finds its adapters.
    path: std::sync::Arc<str>,
    /// Which decoding products take rmlx's CUDA kernels ([`QuantizedMatvec`]).
    matvec: QuantizedMatvec,
    /// Under tensor parallelism, the ranks this layer's partial output (it holds a share of the
    /// input features) is all-summed over ([`Split::Inputs`]).
    reduce: Option<Ranks>,
    /// Under tensor parallelism, the features of the whole layer this rank's weight holds (what
    /// an adapter is cut to).
    share: Option<FeatureShare>,
    /// Under tensor parallelism, the ranks whose outputs (each its share of the output features,
    /// in rank order) make the layer's output: the output head split by vocabulary.
    gather: Option<Ranks>,
}

#[derive(Clone)]
enum LinearWeight {
    /// `W` `[out, in]` as stored, and `Wᵀ` (a transposed view, made once).
    Dense {
        w: Array,
        wt: Array,
    },
    Quantized(Quantized),
}

impl Linear {
    /// Applies the layer to `x: [..., in]`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let mut y = match &self.weight {
            LinearWeight::Dense { wt, .. } => x.matmul(wt)?,
            LinearWeight::Quantized(q) if training() => dequantized_matmul(x, q)?,
            LinearWeight::Quantized(q) => quantized_product(x, q, self.matvec)?,
        };
        if let Some(z) = adapter_bank::row_adapters(&self.path, x)? {
            y = (&y + z)?;
        }
        if let Some(lora) = &self.lora {
            y = lora.add_to(&y, x)?;
            if let Some(m) = &lora.magnitude {
                // DoRA: every output row rescaled to the learned magnitude over the norm of the
                // adapted weight (a constant for the gradient, as in mlx-lm).
                let adapted = (self.dense_weight()? + lora.delta()?)?.astype(Dtype::Float32)?;
                let norm = ops::stop_gradient(&self.row_norms(&adapted)?)?;
                y = (y * (m / &norm)?.astype(x.dtype())?)?;
            }
        }
        if let Some(b) = &self.bias {
            y = (&y + b)?;
        }
        match (&self.reduce, &self.gather) {
            (Some(tp), _) => tp.all_sum(&y),
            (None, Some(tp)) => sharding::gather_last_axis(tp, &y),
            (None, None) => Ok(y),
        }
    }

    /// A layer of `(in, out)` features named `path`, without an adapter, over a weight as the
    /// [`Builder`] hands it out.
    /// `matvec` decides whether a quantised weight takes rmlx's decoding kernel.
    fn built(
        weight: Weight,
        bias: Option<Array>,
        (input, output): (i32, i32),
        path: &str,
        matvec: QuantizedMatvec,
    ) -> Result<Linear> {
        let weight = match weight {
            Weight::Dense(w) => LinearWeight::Dense { wt: w.transpose()?, w },
            Weight::Quantized(q) => LinearWeight::Quantized(q),
        };
        Ok(Linear {
            weight,
            bias,
            lora: None,
            input,
            output,
            path: path.into(),
            matvec,
            reduce: None,
            share: None,
            gather: None,
        })
    }

    /// The base weight `[out, in]`, dequantised if it is quantised.
    fn dense_weight(&self) -> Result<Array> {
        Ok(match &self.weight {
            LinearWeight::Dense { w, .. } => w.clone(),
            LinearWeight::Quantized(q) => dequantize(q, Some(q.scales.dtype()))?,
        })
    }

    /// Whether the weight is kept quantised.
    pub fn is_quantized(&self) -> bool {
        matches!(self.weight, LinearWeight::Quantized(_))
    }

    /// `(in, out)` features.
    pub fn dims(&self) -> (i32, i32) {
        (self.input, self.output)
    }

    /// Under tensor parallelism, the features of the whole layer this rank holds.
    pub fn share(&self) -> Option<FeatureShare> {
        self.share
    }

    /// The adapter, if one is attached.
    pub fn lora(&self) -> Option<&Lora> {
        self.lora.as_ref()
    }

    /// Attaches (or, with `None`, removes) an adapter; returns the previous one.
    pub fn set_lora(&mut self, lora: Option<Lora>) -> Result<Option<Lora>> {
        if let Some(l) = &lora {
            let (a, b) = (l.a.shape(), l.b.shape());
            if a.len() != 2 || b.len() != 2 || a[0] != self.input || b[1] != self.output || a[1] != b[0] {
                return Err(Error::InvalidParameter(format!(
                    "a LoRA adapter with A {a:?} and B {b:?} does not fit a linear layer of {} → {} features",
                    self.input, self.output
                )));
            }
        }
        Ok(std::mem::replace(&mut self.lora, lora))
    }

    /// The dense weight `[out, in]` with the adapter merged in (quantised weights dequantised):
    /// what `fuse` writes.
    pub fn fused_weight(&self) -> Result<Array> {
        let w = self.dense_weight()?;
        let Some(lora) = &self.lora else { return Ok(w) };
        let fused = (&w + lora.delta()?.astype(w.dtype())?)?;
        match &lora.magnitude {
            // DoRA: rows rescaled to the learned magnitudes.
            Some(m) => {
                let norm = ops::square(&fused.astype(Dtype::Float32)?)?.sum(-1, true)?.sqrt()?;
                let rows = (m.reshape(&[-1, 1])? / norm)?;
                Ok((fused.astype(Dtype::Float32)? * rows)?.astype(w.dtype())?)
            }
            None => Ok(fused),
        }
    }

    /// The row norms of the base weight (a fresh DoRA adapter's magnitudes), in float32.
    pub fn weight_norms(&self) -> Result<Array> {
        self.row_norms(&self.dense_weight()?.astype(Dtype::Float32)?)
    }

    /// The norms of the rows of `w` `[out, in]`, a weight of this layer's shape: of the whole
    /// layer's rows where this rank holds a share of their input features (the ranks' squares
    /// summed).
    fn row_norms(&self, w: &Array) -> Result<Array> {
        let squares = ops::square(w)?.sum(-1, false)?;
        let squares = match &self.reduce {
            Some(tp) => tp.all_sum(&squares)?,
            None => squares,
        };
        Ok(squares.sqrt()?)
    }

    /// This rank's part of the adapter array `<layer>.<what>` (`lora_a`, `lora_b` or DoRA's `m`)
    /// trained on the whole layer: the rows of `A` or columns of `B` (and magnitudes) of the
    /// features it holds under tensor parallelism; `a` itself otherwise.
    pub fn adapter_part(&self, what: &str, a: &Array) -> Result<Array> {
        let Some(share) = &self.share else { return Ok(a.clone()) };
        let name = join(&self.path, what);
        match what {
            "lora_a" => share.cut(&name, a, Some(0), None),
            "lora_b" => share.cut(&name, a, None, Some(1)),
            "m" => share.cut(&name, a, None, Some(0)),
            _ => Ok(a.clone()),
        }
    }
}

impl Module for Linear {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, Role, &Array)) {
        match &self.weight {
            LinearWeight::Dense { w, .. } => f(&join(prefix, "weight"), Role::Weight, w),
            LinearWeight::Quantized(q) => visit_quantized(prefix, Role::Weight, q, f),
        }
        if let Some(b) = &self.bias {
            f(&join(prefix, "bias"), Role::Bias, b);
        }
        if let Some(l) = &self.lora {
            f(&join(prefix, "lora_a"), Role::LoraA, &l.a);
            f(&join(prefix, "lora_b"), Role::LoraB, &l.b);
            if let Some(m) = &l.magnitude {
                f(&join(prefix, "m"), Role::DoraMagnitude, m);
            }
        }
    }

    fn visit_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Array)) {
        match &mut self.weight {
            LinearWeight::Dense { w, wt } => {
                f(&join(prefix, "weight"), w);
                // The transposed view follows the (possibly replaced) weight.
                if let Ok(t) = w.transpose() {
                    *wt = t;
                }
            }
            LinearWeight::Quantized(q) => {
                f(&join(prefix, "weight"), &mut q.weight);
                f(&join(prefix, "scales"), &mut q.scales);
                if let Some(b) = &mut q.biases {
                    f(&join(prefix, "biases"), b);
                }
            }
        }
        if let Some(b) = &mut self.bias {
            f(&join(prefix, "bias"), b);
        }
        if let Some(l) = &mut self.lora {
            f(&join(prefix, "lora_a"), &mut l.a);
            f(&join(prefix, "lora_b"), &mut l.b);
            if let Some(m) = &mut l.magnitude {
                f(&join(prefix, "m"), m);
            }
        }
    }

    fn visit_linears(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Linear)) {
        f(prefix, self);
    }
}

/// A quantised matrix's arrays under `prefix`: its packed values in `role`, then its scales and
/// biases ([`Role::Quantization`]).
fn visit_quantized(prefix: &str, role: Role, q: &Quantized, f: &mut dyn FnMut(&str, Role, &Array)) {
    f(&join(prefix, "weight"), role, &q.weight);
    f(&join(prefix, "scales"), Role::Quantization, &q.scales);
    if let Some(b) = &q.biases {
        f(&join(prefix, "biases"), Role::Quantization, b);
    }
}

/// A token embedding table `[vocab, hidden]`, dense or quantised, usable as the output head when
/// the checkpoint ties them.
#[derive(Clone)]
pub struct Embedding {
    /// Which decoding products of the tied head take rmlx's CUDA kernel ([`QuantizedMatvec`]).
    matvec: QuantizedMatvec,
    weight: Weight,
    dtype: Dtype,
    /// Under tensor parallelism, the vocabulary rows this rank holds (`weight` is those rows).
    share: Option<sharding::VocabShare>,
}

impl Embedding {
    /// Looks up `ids: [...]` → `[..., hidden]`. Split by vocabulary, each rank looks up the ids
    /// among its rows (zeros for the others) and the ranks' rows are summed.
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        let Some(share) = &self.share else { return self.rows(ids) };
        let (local, held) = share.local_ids(ids)?;
        let rows = ops::r#where(&held.expand_dims(-1)?, &self.rows(&local)?, &Array::scalar_as(0.0, self.dtype)?)?;
        share.ranks.all_sum(&rows)
    }

    /// Rows `ids` of the weight held.
    fn rows(&self, ids: &Array) -> Result<Array> {
        match &self.weight {
            Weight::Dense(w) => Ok(w.take(ids, Some(0))?),
            Weight::Quantized(q) => quantized_rows(q, ids, self.dtype),
        }
    }

    /// `x Eᵀ`: the tied output head (split by vocabulary, each rank's logits gathered).
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        let y = match &self.weight {
            Weight::Dense(w) => x.matmul(&w.transpose()?)?,
            Weight::Quantized(q) if training() => dequantized_matmul(x, q)?,
            Weight::Quantized(q) => quantized_product(x, q, self.matvec)?,
        };
        match &self.share {
            Some(share) => sharding::gather_last_axis(&share.ranks, &y),
            None => Ok(y),
        }
    }

    /// Whether the ranks of a tensor-parallel model share its rows.
    pub fn is_split(&self) -> bool {
        self.share.is_some()
    }
}

/// `x Wᵀ` for a quantised `W` outside training. On the CPU, MLX's quantised product is slow (one
/// thread, no SIMD): affine 4- and 8-bit products go through [`cpu_qmm`], others through `W`
/// dequantised and a BLAS product. On MLX's CUDA backend, a few rows go through rmlx's kernel
/// ([`cuda_qmv`]) when `matvec` takes it for `W`'s size and it serves the layout. Elsewhere, MLX's
/// quantised product.
pub(crate) fn quantized_product(x: &Array, q: &Quantized, matvec: QuantizedMatvec) -> Result<Array> {
    if rmlx::current_device().kind != DeviceType::Cpu {
        if matvec.takes_kernel(q.weight.nbytes()) {
            if let Some(y) = cuda_qmv::matvec_kernel(x, q)? {
                return Ok(y);
            }
        }
        return Ok(quantized_matmul(x, q, true)?);
    }
    // rmlx's CPU products have no derivatives: traced transforms keep MLX's operations.
    if !x.is_tracer() {
        if let Some(y) = cpu_qmm::cpu_quantized_matmul(x, q)? {
            return Ok(y);
        }
    }
    // MLX's CPU products of half types do not go through BLAS: those run in float32.
    let dtype = x.dtype();
    let wide = if dtype == Dtype::Float64 { dtype } else { Dtype::Float32 };
    let y = x.astype(wide)?.matmul(&dequantize(q, Some(wide))?.transpose()?)?;
    Ok(y.astype(dtype)?)
}

/// `x Wᵀ` for a quantised `W` in training mode (QLoRA): `W` is dequantised for the product and
/// the product is a dense one, in the forward pass and again in the backward pass (a custom vjp,
/// `∂x = g W`), where the dense matrix is made anew instead of being kept. MLX's quantised matmul
/// is made for decoding: on CUDA its backward orientation (`transpose = false`) runs a naive kernel,
/// and at training's thousands of rows both orientations are slower than dequantising and
/// multiplying (llama3.2-1b 4-bit LoRA on an H100: 15.9k → 21.5k tokens/s). Each dense matrix
/// lives only for its product; the base stays frozen (no gradient for `W`).
fn dequantized_matmul(x: &Array, q: &Quantized) -> Result<Array> {
    let (forward_q, backward_q) = (q.clone(), q.clone());
    let f = rmlx::transforms::CustomFunction::new(move |inputs: &[Array]| {
        let x = &inputs[0];
        Ok(vec![x.matmul(&dequantize(&forward_q, Some(x.dtype()))?.transpose()?)?])
    })
    .vjp(move |_primals: &[Array], cotangents: &[Array], _outputs: &[Array]| {
        let g = &cotangents[0];
        Ok(vec![g.matmul(&dequantize(&backward_q, Some(g.dtype()))?)?])
    })
    .build();
    Ok(f.call(std::slice::from_ref(x))?.remove(0))
}

/// Rows `ids` of a quantised matrix, dequantised to `dtype` (one operation on the CPU).
fn quantized_rows(q: &Quantized, ids: &Array, dtype: Dtype) -> Result<Array> {
    if let Some(rows) = cpu_rows::cpu_quantized_rows(q, ids, dtype)? {
        return Ok(rows);
    }
    let rows = Quantized {
        weight: q.weight.take(ids, Some(0))?,
        scales: q.scales.take(ids, Some(0))?,
        biases: q.biases.as_ref().map(|b| b.take(ids, Some(0))).transpose()?,
        ..q.clone()
    };
    Ok(dequantize(&rows, Some(dtype))?)
}

impl Module for Embedding {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, Role, &Array)) {
        match &self.weight {
            Weight::Dense(w) => f(&join(prefix, "weight"), Role::Embedding, w),
            Weight::Quantized(q) => visit_quantized(prefix, Role::Embedding, q, f),
        }
    }

    fn visit_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Array)) {
        match &mut self.weight {
            Weight::Dense(w) => f(&join(prefix, "weight"), w),
            Weight::Quantized(q) => {
                f(&join(prefix, "weight"), &mut q.weight);
                f(&join(prefix, "scales"), &mut q.scales);
                if let Some(b) = &mut q.biases {
                    f(&join(prefix, "biases"), b);
                }
            }
        }
    }
}

/// Root-mean-square normalisation over the last axis with a learned scale.
#[derive(Clone)]
pub struct RmsNorm {
    weight: Array,
    eps: f32,
    plus_one: bool,
}

impl RmsNorm {
    /// A norm with the given scale.
    pub fn new(weight: Array, eps: f32) -> Self {
        Self { weight, eps, plus_one: false }
    }

    /// The kept scale (`1 + w` when [`RmsNorm::plus_one`]).
    pub fn weight(&self) -> &Array {
        &self.weight
    }

    /// The epsilon added to the mean square.
    pub fn eps(&self) -> f32 {
        self.eps
    }

    /// Whether the kept scale is `1 + w` of the checkpoint's `w` (Gemma).
    pub fn plus_one(&self) -> bool {
        self.plus_one
    }

    /// Normalises `x`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        if cpu_fast::applies(x) && self.weight.dtype() == x.dtype() {
            return Ok(cpu_fast::rms_norm(x, &self.weight, self.eps)?);
        }
        Ok(fast::rms_norm(x, Some(&self.weight), self.eps)?)
    }
}

impl Module for RmsNorm {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, Role, &Array)) {
        f(&join(prefix, "weight"), Role::Norm, &self.weight);
    }

    fn visit_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Array)) {
        f(&join(prefix, "weight"), &mut self.weight);
    }
}

/// How a checkpoint's tensors become layers (the loaders make one over the checkpoint's tensors).
pub struct Builder {
    weights: Weights,
    /// The compute dtype: dense weights, scales and biases are converted to it.
    pub dtype: Dtype,
    /// Dequantise quantised matrices at load.
    pub dequantize: bool,
    /// Dequantise at load the quantised matrices rmlx's CPU products do not take
    /// (`cpu_qmm::serves`), keeping the others quantised.
    pub dequantize_unserved: bool,
    /// Which product decoding takes for quantised weights on MLX's CUDA backend.
    pub quantized_matvec: QuantizedMatvec,
    /// Whether decoding steps replay their layers as one captured launch on MLX's CUDA backend.
    pub step_capture: StepCapture,
    /// The ranks the model is split over (tensor parallelism), each building its share.
    pub tensor_parallel: Option<Ranks>,
    /// Under tensor parallelism, keep the embedding and the output head whole on every rank
    /// rather than split by vocabulary rows ([`Builder::vocab_share`]).
    pub whole_vocabulary: bool,
    /// The blocks this process builds, on a stage of a pipeline ([`Builder::set_stage`]).
    stage: Option<pipeline::Stage>,
    /// Every array handed to a layer so far (to evaluate them all at load).
    built: Vec<Array>,
    /// Parameters handed out so far (logical elements: quantised matrices count unpacked).
    parameters: u64,
    /// Quantised matrices kept quantised and dequantised so far.
    pub quantized_kept: usize,
    pub quantized_dequantized: usize,
}

impl Builder {
    /// A builder over `weights`.
    pub(crate) fn new(weights: Weights, dtype: Dtype, dequantize: bool) -> Self {
        Self {
            weights,
            dtype,
            dequantize,
            dequantize_unserved: false,
            quantized_matvec: QuantizedMatvec::default(),
            step_capture: StepCapture::default(),
            tensor_parallel: None,
            whole_vocabulary: false,
            stage: None,
            built: Vec::new(),
            parameters: 0,
            quantized_kept: 0,
            quantized_dequantized: 0,
        }
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

    /// Builds the blocks of `stage` alone: the other blocks' tensors are dropped unread.
    pub fn set_stage(&mut self, stage: pipeline::Stage) {
        let others: Vec<String> = self
            .weights
            .names()
            .filter(|n| crate::models::block_path(n).is_some_and(|(i, _)| !stage.layers().contains(&i)))
            .map(str::to_string)
            .collect();
        for name in others {
            self.weights.forget_source(&name);
            self.weights.take_opt(&name);
        }
        self.stage = Some(stage);
    }

    /// The blocks to build of a model of `layers`: all of them, or those of the pipeline stage
    /// [`Builder::set_stage`] gave.
    pub fn stage(&self, layers: usize) -> pipeline::Stage {
        self.stage.clone().unwrap_or_else(|| pipeline::Stage::whole(layers))
    }

    /// The tensors not taken so far.
    pub fn remaining(&self) -> Vec<String> {
        let mut v: Vec<String> = self.weights.names().map(str::to_string).collect();
        v.sort();
        v
    }

    /// Splits the checkpoint's fused projection `fused` (`fused.weight`, dense or quantised, and
    /// `fused.bias` when present) by rows into `parts` (`(prefix, rows)` in order), which the model
    /// then takes as separate layers: Phi-3's `qkv_proj` becomes `q_proj`, `k_proj` and `v_proj`.
    /// A fused weight whose rows are not the parts' sum is a [`Error::ShapeMismatch`].
    pub fn split_rows(&mut self, fused: &str, parts: &[(String, i32)]) -> Result<()> {
        let total: i32 = parts.iter().map(|(_, rows)| rows).sum();
        let mut cuts: Vec<i32> =
            parts.iter().scan(0, |at, (_, rows)| Some(std::mem::replace(at, *at + rows))).collect();
        cuts.remove(0);
        let split = |a: &Array| rmlx::ops::split_at(a, &cuts, 0);
        for suffix in ["weight", "bias"] {
            let name = format!("{fused}.{suffix}");
            let Some(w) = self.weights.take_opt(&name) else { continue };
            let shape = w.shape();
            if shape.first() != Some(&total) {
                let mut expected = shape.clone();
                if let Some(rows) = expected.first_mut() {
                    *rows = total;
                }
                return Err(Error::ShapeMismatch { name, expected, found: shape });
            }
            let pieces: Vec<Weight> = match w {
                Weight::Dense(a) => split(&a)?.into_iter().map(Weight::Dense).collect(),
                Weight::Quantized(q) => {
                    let biases = match &q.biases {
                        Some(b) => split(b)?.into_iter().map(Some).collect(),
                        None => vec![None; parts.len()],
                    };
                    let pieces = split(&q.weight)?.into_iter().zip(split(&q.scales)?).zip(biases);
                    pieces
                        .map(|((weight, scales), biases)| {
                            Weight::Quantized(Quantized { weight, scales, biases, ..q.clone() })
                        })
                        .collect()
                }
            };
            for ((prefix, _), piece) in parts.iter().zip(pieces) {
                self.weights.insert(format!("{prefix}.{suffix}"), piece);
            }
        }
        Ok(())
    }

    /// A family's renaming hook: takes the checkpoint's tensor `name`, when present, and puts back
    /// what `f` makes of it, under the names the model's layers read (gpt-oss's fused experts
    /// become three stacked projections). Returns whether `name` was there.
    pub fn rewrite(&mut self, name: &str, f: impl FnOnce(Weight) -> Result<Vec<(String, Weight)>>) -> Result<bool> {
        let Some(w) = self.take_raw(name) else { return Ok(false) };
        for (new, w) in f(w)? {
            self.insert(&new, w);
        }
        Ok(true)
    }

    /// Takes the checkpoint's tensor `name` as stored (no conversion), if present: for a family's
    /// renaming hook that reads several tensors together.
    pub fn take_raw(&mut self, name: &str) -> Option<Weight> {
        self.weights.take_opt(name)
    }

    /// Puts a tensor (rewritten by a family's hook) where the layers will take it.
    pub fn insert(&mut self, name: &str, w: Weight) {
        self.weights.forget_source(name);
        self.weights.insert(name, w);
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
        let w = self.converted(w)?;
        Ok(self.record(w))
    }

    /// A dense array handed to a layer as it is.
    fn record_dense(&mut self, a: Array) -> Array {
        match self.record(Weight::Dense(a)) {
            Weight::Dense(a) => a,
            Weight::Quantized(_) => unreachable!("recorded as given"),
        }
    }

    /// `w` in the compute dtype (dequantised if the builder dequantises), not yet recorded.
    fn converted(&mut self, w: Weight) -> Result<Weight> {
        Ok(match w {
            Weight::Dense(a) => Weight::Dense(a.astype(self.dtype)?),
            Weight::Quantized(q) => {
                // Scales and biases first (MLX dequantises in their dtype); the microscaling
                // formats' scales are 8-bit exponents or floats, kept as they are.
                let q = match q.mode {
                    QuantMode::Affine => Quantized {
                        scales: q.scales.astype(self.dtype)?,
                        biases: q.biases.map(|b| b.astype(self.dtype)).transpose()?,
                        ..q
                    },
                    _ => q,
                };
                if self.dequantize || (self.dequantize_unserved && !cpu_qmm::serves(&q)) {
                    self.quantized_dequantized += 1;
                    Weight::Dense(dequantize(&q, Some(self.dtype))?)
                } else {
                    self.quantized_kept += 1;
                    Weight::Quantized(q)
                }
            }
        })
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
        self.linear_split(prefix, input, output, bias, Split::Whole)
    }

    /// [`Builder::linear`] of `(input, output)` features in the checkpoint, of which this rank
    /// holds the part `split` gives it under tensor parallelism.
    pub fn linear_split(&mut self, prefix: &str, input: i32, output: i32, bias: bool, split: Split) -> Result<Linear> {
        let name = format!("{prefix}.weight");
        let weight = self.take_shaped(&name, &[output, input])?;
        let weight = self.split_weight(&name, weight, split)?;
        let weight = self.convert(weight)?;
        let bias = match bias {
            true => {
                let name = format!("{prefix}.bias");
                let b = self.dense(&name, &[output])?;
                Some(self.split_bias(&name, b, split)?)
            }
            false => None,
        };
        let dims = local_dims(&weight);
        let mut linear = Linear::built(weight, bias, dims, prefix, self.quantized_matvec)?;
        linear.reduce = self.reduction(split);
        linear.share = self.feature_share(&name, (input, output), split)?;
        Ok(linear)
    }

    /// `prefix.weight` `[vocab, hidden]` (this rank's rows of it, where a tensor-parallel model
    /// splits its vocabulary: [`Builder::vocab_share`]).
    pub fn embedding(&mut self, prefix: &str, vocab: i32, hidden: i32) -> Result<Embedding> {
        let name = format!("{prefix}.weight");
        let share = self.vocab_share(vocab);
        let weight = self.take_shaped(&name, &[vocab, hidden])?;
        let weight = match &share {
            Some(s) => self.split_weight(&name, weight, Split::Rows { start: s.start, count: s.count })?,
            None => weight,
        };
        let weight = self.convert(weight)?;
        Ok(Embedding { matvec: self.quantized_matvec, weight, dtype: self.dtype, share })
    }

    /// The output head `prefix` (`[vocab, hidden]`): whole, or this rank's rows of it and the
    /// ranks' logits gathered where a tensor-parallel model splits its vocabulary.
    pub fn output_head(&mut self, prefix: &str, hidden: i32, vocab: i32) -> Result<Linear> {
        let Some(share) = self.vocab_share(vocab) else { return self.linear(prefix, hidden, vocab, false) };
        let split = Split::Rows { start: share.start, count: share.count };
        let mut head = self.linear_split(prefix, hidden, vocab, false, split)?;
        head.gather = Some(share.ranks);
        Ok(head)
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
            Weight::Dense(w) => Ok(RmsNorm { weight: w, eps, plus_one }),
            Weight::Quantized(_) => unreachable!("dense weights stay dense"),
        }
    }
}

/// `(in, out)` features of a weight `[out, in]`.
fn local_dims(w: &Weight) -> (i32, i32) {
    let shape = w.shape();
    (shape[shape.len() - 1], shape[shape.len() - 2])
}

/// SwiGLU feed-forward (`down(silu(gate(x)) · up(x))`) or, with `gelu`, GeGLU with tanh GELU.
#[derive(Clone)]
pub struct GatedMlp {
    gate: Linear,
    up: Linear,
    down: Linear,
    gelu: bool,
}

impl GatedMlp {
    /// `prefix.{gate,up,down}_proj`; under tensor parallelism each rank holds its share of the
    /// intermediate features (gate and up by outputs, down by inputs).
    pub fn load(b: &mut Builder, prefix: &str, hidden: i32, intermediate: i32, gelu: bool) -> Result<Self> {
        Ok(Self {
            gate: b.linear_split(&format!("{prefix}.gate_proj"), hidden, intermediate, false, Split::Outputs)?,
            up: b.linear_split(&format!("{prefix}.up_proj"), hidden, intermediate, false, Split::Outputs)?,
            down: b.linear_split(&format!("{prefix}.down_proj"), intermediate, hidden, false, Split::Inputs)?,
            gelu,
        })
    }

    /// Applies the block.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let (gate, up) = (self.gate.forward(x)?, self.up.forward(x)?);
        self.down.forward(&gated_activation(&gate, &up, self.gelu)?)
    }
}

module_fields!(GatedMlp { gate: "gate_proj", up: "up_proj", down: "down_proj" });
