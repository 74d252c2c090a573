//! Mixture-of-experts feed-forward: a router scores `E` experts per token, the top `k` run, and
//! their outputs are summed by the (normalised) router probabilities. Each expert is a SwiGLU MLP;
//! the experts' weights are stacked `[E, out, in]` (mlx-lm's `SwitchGLU`, under its names
//! `<prefix>.switch_mlp.{gate,up,down}_proj`) and applied with MLX's gathered products
//! (`gather_mm`, or `gather_qmm` for quantised experts, which stay quantised), the tokens sorted
//! by expert when there are enough of them for the sort to pay.

use super::{cuda_moe, Builder, FeatureShare, Linear, Module, RmsNorm, Role, Split};
use crate::ranks::Ranks;
use crate::weights::Weight;
use crate::{Error, Result};
use rmlx::quantization::{gather_qmm, Quantized};
use rmlx::{ops, Array, DeviceType, Dtype};

/// Gathered products sort their tokens by expert from this many (token, expert) pairs on (as
/// mlx-lm does): one product per expert instead of one per pair.
const SORT_FROM: usize = 64;

/// `E` linear maps `[E, out, in]` applied per (token, expert) pair, with an optional adapter per
/// expert (mlx-lm's `LoRASwitchLinear`).
#[derive(Clone)]
pub struct SwitchLinear {
    weight: Weight,
    /// A bias per expert `[E, out]` (gpt-oss).
    bias: Option<Array>,
    lora: Option<SwitchLora>,
    /// Under tensor parallelism, the features of every expert this rank holds (what an adapter
    /// is cut to).
    share: Option<FeatureShare>,
}

/// One low-rank adapter per expert: `y += scale · (x Aₑᵀ) Bₑᵀ` for the token's expert `e`, with
/// `A: [E, r, in]` and `B: [E, out, r]` in mlx-lm's orientation and names (`<layer>.lora_a`,
/// `<layer>.lora_b`).
#[derive(Clone)]
pub struct SwitchLora {
    pub a: Array,
    pub b: Array,
    pub scale: f32,
    /// Probability of dropping an input element of the adapter's path, in training only.
    pub dropout: f32,
}

impl SwitchLora {
    /// Fresh adapters as mlx-lm initialises them: `A` uniform in `±1/√in`, `B` zero.
    pub fn init(
        experts: i32,
        input: i32,
        output: i32,
        rank: i32,
        scale: f32,
        dtype: Dtype,
        key: Option<&Array>,
    ) -> Result<Self> {
        let bound = 1.0 / (input as f32).sqrt();
        Ok(SwitchLora {
            a: rmlx::random::uniform(-bound, bound, &[experts, rank, input], dtype, key)?,
            b: ops::zeros(&[experts, output, rank], dtype)?,
            scale,
            dropout: 0.0,
        })
    }

    /// `scale · B A` per expert, `[E, out, in]` (what fusing adds).
    pub fn delta(&self) -> Result<Array> {
        Ok((self.b.matmul(&self.a)? * self.scale)?)
    }
}

impl SwitchLinear {
    /// `x: [N, 1, in]` (or broadcastable rows) times the experts `indices` (`[N]` or `[..., k]`).
    fn forward(&self, x: &Array, indices: &Array, sorted: bool) -> Result<Array> {
        let y = match &self.weight {
            // MLX's CPU gathered product takes float32 alone.
            Weight::Dense(w) if x.dtype() != Dtype::Float32 && rmlx::current_device().kind == DeviceType::Cpu => {
                let w = w.astype(Dtype::Float32)?.swapaxes(-1, -2)?;
                ops::gather_mm(&x.astype(Dtype::Float32)?, &w, None, Some(indices), sorted)?.astype(x.dtype())?
            }
            Weight::Dense(w) => ops::gather_mm(x, &w.swapaxes(-1, -2)?, None, Some(indices), sorted)?,
            Weight::Quantized(q) => gather_qmm(x, q, None, Some(indices), true, sorted)?,
        };
        let y = match &self.bias {
            Some(b) => (y + b.take(indices, Some(0))?.expand_dims(-2)?)?,
            None => y,
        };
        let Some(lora) = &self.lora else { return Ok(y) };
        let input = super::lora::dropout(x, lora.dropout)?;
        let (a, b) = (lora.a.astype(x.dtype())?, lora.b.astype(x.dtype())?);
        let z = ops::gather_mm(&input, &a.swapaxes(-1, -2)?, None, Some(indices), sorted)?;
        let z = ops::gather_mm(&z, &b.swapaxes(-1, -2)?, None, Some(indices), sorted)?;
        Ok((y + (z * lora.scale)?.astype(x.dtype())?)?)
    }

    /// `(experts, in, out)`.
    pub fn dims(&self) -> (i32, i32, i32) {
        let s = self.weight.shape();
        (s[0], s[2], s[1])
    }

    /// The adapters, if any.
    pub fn lora(&self) -> Option<&SwitchLora> {
        self.lora.as_ref()
    }

    /// This rank's part of the adapter array `<layer>.<what>` (`lora_a` `[E, r, in]`, `lora_b`
    /// `[E, out, r]`) trained on the whole layer: the features it holds under tensor parallelism.
    pub fn adapter_part(&self, path: &str, what: &str, a: &Array) -> Result<Array> {
        let Some(share) = &self.share else { return Ok(a.clone()) };
        let name = format!("{path}.{what}");
        match what {
            "lora_a" => share.cut(&name, a, Some(2), None),
            "lora_b" => share.cut(&name, a, None, Some(1)),
            _ => Ok(a.clone()),
        }
    }

    /// Attaches (or with `None` removes) adapters, returning the previous ones; factors of other
    /// shapes than `[E, r, in]` and `[E, out, r]` are an error.
    pub fn set_lora(&mut self, lora: Option<SwitchLora>) -> Result<Option<SwitchLora>> {
        if let Some(l) = &lora {
            let (e, i, o) = self.dims();
            let r = l.a.shape().get(1).copied().unwrap_or(0).max(1);
            for (name, a, expected) in [("lora_a", &l.a, [e, r, i]), ("lora_b", &l.b, [e, o, r])] {
                if a.shape() != expected {
                    let (expected, found) = (expected.to_vec(), a.shape().to_vec());
                    return Err(Error::ShapeMismatch { name: format!("expert adapters' {name}"), expected, found });
                }
            }
        }
        Ok(std::mem::replace(&mut self.lora, lora))
    }

    /// The experts' weights with the adapters added, dense `[E, out, in]` (a quantised layer
    /// dequantised in its scales' dtype).
    pub fn fused_weight(&self) -> Result<Array> {
        let w = match &self.weight {
            Weight::Dense(w) => w.clone(),
            Weight::Quantized(q) => rmlx::quantization::dequantize(q, Some(q.scales.dtype()))?,
        };
        match &self.lora {
            Some(l) => Ok((&w + l.delta()?.astype(w.dtype())?)?),
            None => Ok(w),
        }
    }

    /// Whether the experts' weights are quantised.
    pub fn is_quantized(&self) -> bool {
        matches!(self.weight, Weight::Quantized(_))
    }

    fn arrays(&self) -> Vec<(&'static str, Role, &Array)> {
        let mut v = match &self.weight {
            Weight::Dense(w) => vec![("weight", Role::Weight, w)],
            Weight::Quantized(q) => {
                let mut v = vec![("weight", Role::Weight, &q.weight), ("scales", Role::Quantization, &q.scales)];
                v.extend(q.biases.as_ref().map(|b| ("biases", Role::Quantization, b)));
                v
            }
        };
        v.extend(self.bias.as_ref().map(|b| ("bias", Role::Bias, b)));
        if let Some(l) = &self.lora {
            v.extend([("lora_a", Role::LoraA, &l.a), ("lora_b", Role::LoraB, &l.b)]);
        }
        v
    }

    fn arrays_mut(&mut self) -> Vec<(&'static str, &mut Array)> {
        let mut v = match &mut self.weight {
            Weight::Dense(w) => vec![("weight", w)],
            Weight::Quantized(Quantized { weight, scales, biases, .. }) => {
                let mut v = vec![("weight", weight), ("scales", scales)];
                v.extend(biases.as_mut().map(|b| ("biases", b)));
                v
            }
        };
        v.extend(self.bias.as_mut().map(|b| ("bias", b)));
        if let Some(l) = &mut self.lora {
            v.extend([("lora_a", &mut l.a), ("lora_b", &mut l.b)]);
        }
        v
    }
}

/// The router and the experts of one block.
#[derive(Clone)]
pub struct SparseMoe {
    /// `[hidden] → [E]` scores, and its name under the block's feed-forward.
    gate: Linear,
    router: &'static str,
    gate_proj: SwitchLinear,
    up_proj: SwitchLinear,
    down_proj: SwitchLinear,
    top_k: i32,
    /// Renormalise the top `k` probabilities to sum to one (Qwen 3's `norm_topk_prob`; Mixtral's
    /// and gpt-oss's softmax over the top `k` scores is the same).
    norm_topk_prob: bool,
    activation: ExpertActivation,
    /// The stacked experts' folder under the feed-forward (`switch_mlp`, gpt-oss's `experts`).
    stacked: &'static str,
    /// Under tensor parallelism, the ranks the experts' partial outputs are all-summed over (each
    /// rank holds its share of every expert's intermediate features).
    reduce: Option<Ranks>,
}

/// The experts' gated activation of `gate` and `up`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExpertActivation {
    /// `silu(gate) · up`.
    Silu,
    /// gpt-oss's: `g · σ(alpha · g) · (u + 1)` with `g = min(gate, limit)` and `u` = `up` clamped
    /// to `±limit`.
    ClampedSwiglu { alpha: f32, limit: f32 },
}

/// Where a checkpoint keeps the experts of a block: mlx-lm's stacked names are found first, then
/// Hugging Face's one tensor per expert.
pub struct ExpertNames {
    /// The router under the block's MLP prefix (`gate`).
    pub router: &'static str,
    /// The per-expert folder (`experts`).
    pub experts: &'static str,
    /// Hugging Face's names of an expert's gate, up and down projections (`gate_proj`, `up_proj`,
    /// `down_proj`; Mixtral's `w1`, `w3`, `w2`).
    pub projections: [&'static str; 3],
    /// The folder of the stacked experts (mlx-lm's `switch_mlp`; gpt-oss's `experts`).
    pub stacked: &'static str,
    /// Whether the router and each expert's projections have biases (`<router>.bias`,
    /// `<stacked>.<projection>.bias` `[E, out]`: gpt-oss).
    pub biases: bool,
    pub activation: ExpertActivation,
}

impl ExpertNames {
    /// mlx-lm's stacked `switch_mlp` experts without biases, SiLU-gated, Hugging Face's per-expert
    /// `experts.<e>.{gate,up,down}_proj` beside them.
    pub const SWITCH_MLP: ExpertNames = ExpertNames {
        router: "gate",
        experts: "experts",
        projections: ["gate_proj", "up_proj", "down_proj"],
        stacked: "switch_mlp",
        biases: false,
        activation: ExpertActivation::Silu,
    };
}

impl SparseMoe {
    /// The block's router `<prefix>.<router>` and its `experts` experts from `<prefix>.switch_mlp.*`
    /// or `<prefix>.<experts>.<e>.<projection>`, each `hidden → intermediate → hidden`. Under tensor
    /// parallelism every rank holds every expert's share of the intermediate features (the router
    /// whole).
    pub fn load(
        b: &mut Builder,
        prefix: &str,
        names: &ExpertNames,
        (hidden, intermediate): (i32, i32),
        (experts, top_k): (i32, i32),
        norm_topk_prob: bool,
    ) -> Result<Self> {
        if !(1..=experts).contains(&top_k) {
            return Err(Error::Config(format!("{top_k} experts per token out of {experts}")));
        }
        let gate = b.linear(&format!("{prefix}.{}", names.router), hidden, experts, names.biases)?;
        let mut switch = |i: usize, shape: [i32; 2]| -> Result<SwitchLinear> {
            let projection = ["gate_proj", "up_proj", "down_proj"][i];
            let split = if i == 2 { Split::Inputs } else { Split::Outputs };
            let stacked = format!("{prefix}.{}.{projection}.weight", names.stacked);
            let full = [experts, shape[0], shape[1]];
            let weight = if b.has(&stacked) {
                let w = b.take_shaped(&stacked, &full)?;
                b.split_weight(&stacked, w, split)?
            } else {
                let each = (0..experts)
                    .map(|e| {
                        let name = format!("{prefix}.{}.{e}.{}.weight", names.experts, names.projections[i]);
                        let w = b.take_shaped(&name, &shape)?;
                        b.split_weight(&name, w, split)
                    })
                    .collect::<Result<Vec<_>>>()?;
                stack_experts(each)?
            };
            let weight = b.convert(weight)?;
            let bias = match names.biases {
                true => {
                    let name = format!("{prefix}.{}.{projection}.bias", names.stacked);
                    let bias = b.dense(&name, &[experts, shape[0]])?;
                    Some(b.split_bias(&name, bias, split)?)
                }
                false => None,
            };
            let share = b.feature_share(&stacked, (shape[1], shape[0]), split)?;
            Ok(SwitchLinear { weight, bias, lora: None, share })
        };
        Ok(SparseMoe {
            gate_proj: switch(0, [intermediate, hidden])?,
            up_proj: switch(1, [intermediate, hidden])?,
            down_proj: switch(2, [hidden, intermediate])?,
            gate,
            router: names.router,
            top_k,
            norm_topk_prob,
            activation: names.activation,
            stacked: names.stacked,
            reduce: b.reduction(Split::Inputs),
        })
    }

    /// `x: [..., hidden]` → `[..., hidden]`.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let k = self.top_k;
        let probs = ops::softmax(&self.gate.forward(x)?, -1, true)?;
        let experts = probs.shape()[probs.ndim() - 1];
        let chosen = ops::stop_gradient(&ops::argpartition(&probs, experts - k, Some(-1))?)?;
        let chosen = chosen.slice_axis(-1, experts - k, experts, 1)?;
        let mut scores = ops::take_along_axis(&probs, &chosen, Some(-1))?;
        if self.norm_topk_prob {
            scores = (&scores / &scores.sum(-1, true)?)?;
        }
        let y = self.experts(x, &chosen)?;
        let weighted = (y * scores.astype(x.dtype())?.expand_dims(-1)?)?;
        let y = weighted.sum(-2, false)?;
        match &self.reduce {
            Some(tp) => tp.all_sum(&y),
            None => Ok(y),
        }
    }

    /// `h + self(norm(h))` for the rows `h: [rows, hidden]`: a block's routed feed-forward half,
    /// one launch of rmlx's kernels on a decoding step where they serve (`cuda_moe`: MLX's CUDA
    /// backend, a few rows, no expert adapters), else composed.
    pub fn forward_residual(&self, h: &Array, norm: &RmsNorm) -> Result<Array> {
        let layers = [&self.gate_proj, &self.up_proj, &self.down_proj];
        let biases = match layers.map(|l| l.bias.as_ref()) {
            [Some(g), Some(u), Some(d)] => Some(Some([g, u, d])),
            [None, None, None] => Some(None),
            _ => None,
        };
        let plain = layers.iter().all(|l| l.lora.is_none()) && self.reduce.is_none();
        if let (Some(biases), true) = (biases, plain) {
            let experts = cuda_moe::Experts {
                gate: &self.gate_proj.weight,
                up: &self.up_proj.weight,
                down: &self.down_proj.weight,
                biases,
                activation: self.activation,
                top_k: self.top_k,
                norm_topk_prob: self.norm_topk_prob,
            };
            let router = || self.gate.forward_normed(h, norm);
            if let Some(y) = cuda_moe::experts_residual(h, (norm.weight(), norm.eps()), &experts, router)? {
                return Ok(y);
            }
        }
        Ok((h + self.forward(&norm.forward(h)?)?)?)
    }

    /// Each token's `k` experts' outputs `[..., k, hidden]`.
    fn experts(&self, x: &Array, chosen: &Array) -> Result<Array> {
        let hidden = x.shape()[x.ndim() - 1];
        let lead: Vec<i32> = chosen.shape().to_vec();
        let pairs = chosen.size();
        let swiglu = |x: &Array, idx: &Array, sorted: bool| -> Result<Array> {
            let gate = self.gate_proj.forward(x, idx, sorted)?;
            let up = self.up_proj.forward(x, idx, sorted)?;
            self.down_proj.forward(&self.activation.apply(&gate, &up)?, idx, sorted)
        };
        if pairs < SORT_FROM {
            // [..., 1, 1, hidden] against [..., k]: [..., k, 1, hidden].
            let rows = x.expand_dims(-2)?.expand_dims(-2)?;
            let y = swiglu(&rows, chosen, false)?;
            return Ok(y.squeeze(-2)?);
        }
        // Sorted by expert: row `order[j] / k` of the tokens meets expert `flat[order[j]]`.
        let flat = chosen.flatten()?;
        let order = ops::argsort(&flat, Some(0))?;
        let back = ops::argsort(&order, Some(0))?;
        let tokens = x.reshape(&[-1, 1, hidden])?;
        let per_token = Array::scalar_as(lead[lead.len() - 1] as f64, order.dtype())?;
        let rows = tokens.take(&ops::floor_divide(&order, &per_token)?, Some(0))?;
        let y = swiglu(&rows, &flat.take(&order, Some(0))?, true)?;
        let mut shape = lead;
        shape.push(hidden);
        Ok(y.take(&back, Some(0))?.reshape(&shape)?)
    }
}

impl ExpertActivation {
    fn apply(self, gate: &Array, up: &Array) -> Result<Array> {
        match self {
            ExpertActivation::Silu => Ok((ops::silu(gate)? * up)?),
            ExpertActivation::ClampedSwiglu { alpha, limit } => {
                let bound = |v: f32| Array::scalar_as(v as f64, gate.dtype());
                let g = ops::minimum(gate, &bound(limit)?)?;
                let u = ops::clip(up, Some(&bound(-limit)?), Some(&bound(limit)?))?;
                let glu = (&g * &ops::sigmoid(&(&g * alpha)?)?)?;
                Ok((glu * (u + 1.0)?)?)
            }
        }
    }
}

/// The experts' `[out, in]` matrices as one `[E, out, in]` (dense, or quantised alike).
fn stack_experts(each: Vec<Weight>) -> Result<Weight> {
    let stack = |arrays: Vec<&Array>| -> Result<Array> { Ok(ops::stack(&arrays, 0)?) };
    let quantized: Option<Vec<&Quantized>> = each
        .iter()
        .map(|w| match w {
            Weight::Quantized(q) => Some(q),
            Weight::Dense(_) => None,
        })
        .collect();
    if let Some(q) = quantized.filter(|q| q.windows(2).all(|p| same_format(p[0], p[1]))) {
        return Ok(Weight::Quantized(Quantized {
            weight: stack(q.iter().map(|q| &q.weight).collect())?,
            scales: stack(q.iter().map(|q| &q.scales).collect())?,
            biases: match q[0].biases.is_some() {
                true => Some(stack(q.iter().filter_map(|q| q.biases.as_ref()).collect())?),
                false => None,
            },
            ..q[0].clone()
        }));
    }
    let dense = each
        .iter()
        .map(|w| match w {
            Weight::Dense(a) => Ok(a.astype(Dtype::Float32)?),
            Weight::Quantized(q) => Ok(rmlx::quantization::dequantize(q, Some(Dtype::Float32))?),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Weight::Dense(stack(dense.iter().collect())?))
}

fn same_format(a: &Quantized, b: &Quantized) -> bool {
    (a.bits, a.group_size, a.mode, a.biases.is_some(), a.scales.dtype())
        == (b.bits, b.group_size, b.mode, b.biases.is_some(), b.scales.dtype())
}

impl Module for SparseMoe {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, Role, &Array)) {
        self.gate.visit(&super::join(prefix, self.router), f);
        for (name, layer) in
            [("gate_proj", &self.gate_proj), ("up_proj", &self.up_proj), ("down_proj", &self.down_proj)]
        {
            for (field, role, a) in layer.arrays() {
                f(&format!("{}.{name}.{field}", super::join(prefix, self.stacked)), role, a);
            }
        }
    }

    fn visit_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Array)) {
        self.gate.visit_mut(&super::join(prefix, self.router), f);
        let switch = super::join(prefix, self.stacked);
        for (name, layer) in
            [("gate_proj", &mut self.gate_proj), ("up_proj", &mut self.up_proj), ("down_proj", &mut self.down_proj)]
        {
            for (field, a) in layer.arrays_mut() {
                f(&format!("{switch}.{name}.{field}"), a);
            }
        }
    }

    fn visit_linears(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Linear)) {
        self.gate.visit_linears(&super::join(prefix, self.router), f);
    }

    fn visit_switches(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut SwitchLinear)) {
        let switch = super::join(prefix, self.stacked);
        for (name, layer) in
            [("gate_proj", &mut self.gate_proj), ("up_proj", &mut self.up_proj), ("down_proj", &mut self.down_proj)]
        {
            f(&format!("{switch}.{name}"), layer);
        }
    }
}
