//! A Llama-family decoder block's decoding step on the CPU in two primitives, for weights kept
//! quantised (MLX affine, 4 or 8 bits).
//!
//! Composed of MLX operations and rmlx's single-purpose CPU primitives, one block's step is 22
//! operations. MLX runs the operations of a stream one after another on one worker thread, and
//! each costs a scheduling round trip and a graph node built on the calling thread: the 2-core
//! development machine spent more of a step on those than on the products, which could not use
//! the second core. Here a block's step is two operations (and the `contiguous` nodes
//! `rmlx::custom::apply` puts before inputs not known to be row-major):
//!
//! 1. the input norm, the stacked q/k/v product (and bias), per-head q/k
//!    norms and the rotary embedding → the query heads of the new position, and its key and value
//!    written into the cache's buffers in place (outputs that take over those inputs);
//! 2. attention of the query over the cache, the output
//!    projection and residual, the post-attention norm, the gated SiLU feed-forward and residual.
//!
//! The products split their columns over threads. Every intermediate is rounded to the input's
//! dtype where the composed graph rounds it, so that the step computes what the composed one
//! does, with the same kernels for the products, norms, rotation and attention.
//!
//! It serves up to [`MAX_POSITIONS`] rows: positions of one sequence (a decoding step of
//! `generate`, a speculative verification pass: each query seeing its own position and those
//! before it) or one position each of a batch's sequences (the engine's step: each row its own
//! cache row, rotary position and padding, [`StepRows`]), every row's products what it gets
//! alone, outside training and traced transforms, when no adapter changes a projection:
//! otherwise the block is composed.

use super::cpu_attention::attend_heads;
use super::cpu_fast::{rms_row, round, store, store_at, swiglu, Angles, Floats};
use super::cpu_qmm::{row_products, to_f32, Packed, CPU_QMM_MAX_ROWS};
use super::{GatedMlp, Linear, LinearWeight, RmsNorm};
use crate::cache::StandardCache;
use rmlx::custom::{apply, CpuTensor, CpuTensorMut, CustomPrimitive, InPlace};
use rmlx::fast::TensorSpec;
use rmlx::quantization::{QuantMode, Quantized};
use rmlx::{Array, Dtype, Error, Result};

/// The most positions a fused step takes: as many as the composed graph's products take row by
/// row (more take its panel form), so that a pass computes what its single steps do.
pub const MAX_POSITIONS: usize = CPU_QMM_MAX_ROWS;

/// Where each row of a step sits in the cache: its cache row, the column its key and value are
/// written to, its rotary position, and the first column it attends to (a batch's padding before
/// it); it attends to the columns from there up to its own.
#[derive(Clone, Copy, PartialEq, Debug)]
pub(crate) struct RowAt {
    pub cache_row: usize,
    pub column: usize,
    pub rope: usize,
    pub start: usize,
}

/// What the rows of a step are, for a cache whose buffers hold `starts.len()` sequences with
/// `written` columns each (`starts`: each one's first column, padding before it): one sequence's
/// next positions, or one position of every sequence.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StepRows<'a> {
    pub written: usize,
    pub starts: &'a [usize],
}

impl StepRows<'_> {
    /// Each of `n` rows' place, or `None` where `n` rows are not a step of these sequences.
    pub(crate) fn rows(&self, n: usize) -> Option<Vec<RowAt>> {
        let (w, starts) = (self.written, self.starts);
        match starts {
            [start] if *start <= w => Some(
                (0..n).map(|i| RowAt { cache_row: 0, column: w + i, rope: w + i - start, start: *start }).collect(),
            ),
            _ if starts.len() == n && starts.iter().all(|&s| s <= w) => Some(
                starts
                    .iter()
                    .enumerate()
                    .map(|(b, &s)| RowAt { cache_row: b, column: w, rope: w - s, start: s })
                    .collect(),
            ),
            _ => None,
        }
    }
}

/// How a packed matrix is laid out.
#[derive(Clone, Copy, PartialEq, Debug)]
struct Layout {
    bits: usize,
    group: usize,
}

/// A projection the primitives can compute: its packed weight and layout, and its bias.
pub struct PackedLinear<'a> {
    weight: &'a Quantized,
    bias: Option<&'a Array>,
    layout: Layout,
}

impl Linear {
    /// The packed weight of a layer whose output is its product alone (and bias): affine 4- or
    /// 8-bit with biases, groups a multiple of 32, no adapter of any kind.
    pub(crate) fn packed(&self) -> Option<PackedLinear<'_>> {
        let LinearWeight::Quantized(q) = &self.weight else { return None };
        let plain = self.lora.is_none() && self.reduce.is_none() && !super::adapter_bank::has_row_adapters(&self.path);
        let supported =
            q.mode == QuantMode::Affine && matches!(q.bits, 4 | 8) && q.group_size > 0 && q.group_size % 32 == 0;
        (plain && supported && q.biases.is_some()).then_some(PackedLinear {
            weight: q,
            bias: self.bias.as_ref(),
            layout: Layout { bits: q.bits as usize, group: q.group_size as usize },
        })
    }
}

impl PackedLinear<'_> {
    fn arrays(&self) -> [Array; 3] {
        let q = self.weight;
        [q.weight.clone(), q.scales.clone(), q.biases.clone().expect("checked by `packed`")]
    }
}

/// The attention half of a block as [`decode_step`] reads it.
pub struct AttentionParts<'a> {
    /// q, k and v stacked by rows.
    pub qkv: PackedLinear<'a>,
    /// The per-head RMSNorms of queries and keys (Qwen 3), both or neither.
    pub head_norms: Option<(&'a RmsNorm, &'a RmsNorm)>,
    /// Query heads, key/value heads, head size.
    pub heads: (usize, usize, usize),
    /// The rotary divisors (`[head_dim / 2]`, float32, the whole head rotated) and the position
    /// multiplier.
    pub rope: (&'a Array, f32),
    /// Multiplier of the scores.
    pub scale: f32,
    pub o: PackedLinear<'a>,
}

/// The rest of a block as [`decode_step`] reads it.
pub struct BlockParts<'a> {
    pub input_norm: &'a RmsNorm,
    pub attention: AttentionParts<'a>,
    pub post_norm: &'a RmsNorm,
    pub mlp: &'a GatedMlp,
}

/// The block's output for the rows `x` (`[L, hidden]`, `L` up to [`MAX_POSITIONS`]: positions of
/// the one sequence of `cache`, or one position of each of its sequences, as `starts` says, see
/// [`StepRows`]) of a decoding step or verification pass, their keys and values appended to
/// `cache`, or `None` (and the cache untouched) where the fused step does not serve.
pub fn decode_step(
    x: &Array,
    block: &BlockParts<'_>,
    cache: &mut StandardCache,
    starts: &[usize],
) -> crate::Result<Option<Array>> {
    let dtype = x.dtype();
    let attention = &block.attention;
    let (heads, kv_heads, d) = attention.heads;
    let alike = |n: &RmsNorm| n.weight().dtype() == dtype;
    let head_norms_fit = attention.head_norms.is_none_or(|(q, k)| alike(q) && alike(k) && q.eps() == k.eps());
    let rope_fits = attention.rope.0.shape() == [d as i32 / 2] && attention.rope.0.dtype() == Dtype::Float32;
    let mlp = block.mlp;
    let (Some(gate), Some(up), Some(down)) = (mlp.gate.packed(), mlp.up.packed(), mlp.down.packed()) else {
        return Ok(None);
    };
    let unbiased = [&attention.o, &gate, &up, &down].iter().all(|p| p.bias.is_none());
    let positions = x.shape().first().map_or(0, |&l| l as usize);
    let fits = super::cpu_fast::applies(x)
        && x.ndim() == 2
        && (1..=MAX_POSITIONS).contains(&positions)
        && x.shape()[1] == block.input_norm.weight().shape()[0]
        && alike(block.input_norm)
        && alike(block.post_norm)
        && head_norms_fit
        && rope_fits
        && d % 2 == 0
        && heads % kv_heads.max(1) == 0
        && !mlp.gelu
        && unbiased;
    let sequences = cache.keys.as_ref().map_or(1, |k| k.shape()[0] as usize);
    let rows = StepRows { written: cache.offset, starts }.rows(positions);
    let (Some(rows), true) = (rows, fits && sequences == starts.len()) else { return Ok(None) };
    // 1: the heads of the new positions.
    let op = AttentionInputs {
        eps: block.input_norm.eps(),
        head_eps: attention.head_norms.map(|(q, _)| q.eps()),
        heads: (heads, kv_heads, d),
        qkv: attention.qkv.layout,
        bias: attention.qkv.bias.is_some(),
        rows: rows.clone(),
        rope_scale: attention.rope.1,
    };
    let mut inputs = vec![x.clone(), block.input_norm.weight().clone()];
    inputs.extend(attention.qkv.arrays());
    inputs.extend(attention.qkv.bias.cloned());
    if let Some((q, k)) = attention.head_norms {
        inputs.extend([q.weight().clone(), k.weight().clone()]);
    }
    inputs.push(attention.rope.0.clone());
    // The new keys and values are written into the cache's buffers in place (the caller owns them).
    let written = rows.iter().map(|r| r.column + 1).max().expect("a row") - cache.offset;
    cache.reserve_for([sequences as i32, kv_heads as i32, written as i32, d as i32], dtype)?;
    let (keys, values) = (cache.keys.take().expect("reserved"), cache.values.take().expect("reserved"));
    inputs.extend([keys.clone(), values.clone()]);
    let [q, keys, values] = match apply(op, &inputs) {
        Ok(outputs) => <[Array; 3]>::try_from(outputs).expect("`output_specs` gives three outputs"),
        Err(e) => {
            (cache.keys, cache.values) = (Some(keys), Some(values));
            return Err(e.into());
        }
    };
    (cache.keys, cache.values) = (Some(keys.clone()), Some(values.clone()));
    cache.offset += written;
    // 2: attention, output projection, feed-forward.
    let op = AttentionOutputMlp {
        rows,
        scale: attention.scale,
        eps: block.post_norm.eps(),
        head_dim: d,
        layouts: [attention.o.layout, gate.layout, up.layout, down.layout],
    };
    let mut inputs = vec![x.clone(), q, keys, values, block.post_norm.weight().clone()];
    for p in [&attention.o, &gate, &up, &down] {
        inputs.extend(p.arrays());
    }
    Ok(apply(op, &inputs)?.into_iter().next())
}

/// `x @ Wᵀ` of the rows `x` (`[m, k]`) for each of `weights` (three tensors each: packed values,
/// scales, biases) of `layouts`, rounded to `dtype`, computed together over the threads: `[m, n]`
/// each.
fn products(x: &[f32], weights: &[CpuTensor<'_>], layouts: &[Layout], dtype: Dtype) -> Result<Vec<Vec<f32>>> {
    let packed = layouts
        .iter()
        .zip(weights.chunks_exact(3))
        .map(|(l, w)| Packed::of(&w[0], &w[1], &w[2], l.bits, l.group))
        .collect::<Result<Vec<_>>>()?;
    let k = packed.first().map_or(0, |p| p.k);
    if k == 0 || !x.len().is_multiple_of(k) || packed.iter().any(|p| p.k != k) {
        return Err(Error::InvalidArgument(format!("packed weights of {k} inputs for rows of {}", x.len())));
    }
    // The form the composed step's products take: the integer one for half-precision rows.
    let mut ys = row_products(x, dtype != Dtype::Float32, &packed.iter().collect::<Vec<_>>());
    ys.iter_mut().for_each(|y| round(y, dtype));
    Ok(ys)
}

fn product(x: &[f32], weights: &[CpuTensor<'_>], layout: Layout, dtype: Dtype) -> Result<Vec<f32>> {
    Ok(products(x, weights, &[layout], dtype)?.remove(0))
}

/// Primitive 1 (see the module docs).
struct AttentionInputs {
    eps: f32,
    head_eps: Option<f32>,
    heads: (usize, usize, usize),
    qkv: Layout,
    bias: bool,
    rows: Vec<RowAt>,
    rope_scale: f32,
}

impl AttentionInputs {
    /// x, the norm's weight, the packed q/k/v (3), the bias, the head norms' weights (2), the
    /// rotary divisors and the cache's two buffers.
    fn input_count(&self) -> usize {
        8 + self.bias as usize + 2 * self.head_eps.is_some() as usize
    }
}

impl CustomPrimitive for AttentionInputs {
    fn name(&self) -> String {
        "CpuAttentionInputs".into()
    }

    fn output_specs(&self, inputs: &[TensorSpec]) -> Result<Vec<TensorSpec>> {
        let (heads, kv_heads, d) = self.heads;
        let x = &inputs[0];
        let expected = self.input_count();
        let positions = x.shape.first().map_or(0, |&l| l.max(0) as usize);
        let buffer_fits = |t: &TensorSpec| {
            t.dtype == x.dtype
                && t.shape.len() == 4
                && t.shape[1] == kv_heads as i32
                && self.rows.iter().all(|r| (r.cache_row as i32) < t.shape[0] && (r.column as i32) < t.shape[2])
                && t.shape[3] == d as i32
        };
        if inputs.len() != expected
            || x.shape.len() != 2
            || !(1..=MAX_POSITIONS).contains(&positions)
            || self.rows.len() != positions
            || !inputs[expected - 2..].iter().all(buffer_fits)
        {
            return Err(Error::InvalidArgument(format!(
                "fused attention inputs: {} inputs, x {:?}, cache buffers {:?} for rows {:?}",
                inputs.len(),
                x.shape,
                inputs[inputs.len().saturating_sub(2)..].iter().map(|t| &t.shape).collect::<Vec<_>>(),
                self.rows
            )));
        }
        let n = inputs.len();
        Ok(vec![
            TensorSpec::new(&[1, heads as i32, positions as i32, d as i32], x.dtype),
            inputs[n - 2].clone(),
            inputs[n - 1].clone(),
        ])
    }

    /// The keys' and values' buffers (the last two inputs), written at the positions.
    fn in_place(&self) -> (Vec<(usize, usize)>, InPlace) {
        let n = self.input_count();
        (vec![(1, n - 2), (2, n - 1)], InPlace::Owned)
    }

    fn eval_cpu(&self, inputs: &[CpuTensor<'_>], outputs: &mut [CpuTensorMut<'_>]) -> Result<()> {
        let (heads, kv_heads, d) = self.heads;
        let dtype = inputs[0].dtype();
        let x = to_f32(&inputs[0])?;
        let (positions, hidden) = (inputs[0].shape()[0] as usize, inputs[0].shape()[1] as usize);
        let mut normed = vec![0f32; x.len()];
        let norm = to_f32(&inputs[1])?;
        for (row, out) in x.chunks_exact(hidden).zip(normed.chunks_exact_mut(hidden)) {
            rms_row(row, &norm, self.eps, out);
        }
        round(&mut normed, dtype);
        let mut y = product(&normed, &inputs[2..5], self.qkv, dtype)?;
        let mut next = 5;
        let width = (heads + 2 * kv_heads) * d;
        if y.len() != positions * width {
            return Err(Error::InvalidArgument(format!(
                "a q/k/v product of {} features for {positions} positions of {:?} heads",
                y.len(),
                self.heads
            )));
        }
        if self.bias {
            let bias = to_f32(&inputs[next])?;
            y.chunks_exact_mut(width).for_each(|row| row.iter_mut().zip(&bias).for_each(|(v, b)| *v += b));
            round(&mut y, dtype);
            next += 1;
        }
        let head_norms = match self.head_eps {
            Some(eps) => {
                next += 2;
                Some((to_f32(&inputs[next - 2])?, to_f32(&inputs[next - 1])?, eps))
            }
            None => None,
        };
        let divisors = to_f32(&inputs[next])?;
        let mut angles = Angles::new(d / 2);
        for (i, row) in y.chunks_exact_mut(width).enumerate() {
            let (q, rest) = row.split_at_mut(heads * d);
            let (k, v) = rest.split_at_mut(kv_heads * d);
            if let Some((qw, kw, eps)) = &head_norms {
                for (part, w) in [(&mut *q, qw), (&mut *k, kw)] {
                    for head in part.chunks_exact_mut(d) {
                        let plain = head.to_vec();
                        rms_row(&plain, w, *eps, head);
                    }
                    round(part, dtype);
                }
            }
            let at = self.rows[i];
            angles.at(at.rope as f64, self.rope_scale, &divisors);
            for part in [&mut *q, &mut *k] {
                for head in part.chunks_exact_mut(d) {
                    let plain = head.to_vec();
                    angles.rotate(&plain, head);
                }
                round(part, dtype);
            }
            // The queries `[1, heads, L, d]`: head h of position i at row h·L + i.
            for (h, head) in q.chunks_exact(d).enumerate() {
                store_at(&mut outputs[0], (h * positions + i) * d, head)?;
            }
            for (out, new) in outputs[1..].iter_mut().zip([&*k, &*v]) {
                let capacity = out.shape()[2] as usize;
                for (h, head) in new.chunks_exact(d).enumerate() {
                    store_at(out, ((at.cache_row * kv_heads + h) * capacity + at.column) * d, head)?;
                }
            }
        }
        Ok(())
    }
}

/// Primitive 2 (see the module docs).
struct AttentionOutputMlp {
    rows: Vec<RowAt>,
    scale: f32,
    eps: f32,
    head_dim: usize,
    /// o, gate, up, down.
    layouts: [Layout; 4],
}

impl CustomPrimitive for AttentionOutputMlp {
    fn name(&self) -> String {
        "CpuAttentionOutputMlp".into()
    }

    fn output_specs(&self, inputs: &[TensorSpec]) -> Result<Vec<TensorSpec>> {
        let (x, q, k, v) = (&inputs[0], &inputs[1], &inputs[2], &inputs[3]);
        let d = self.head_dim as i32;
        let positions = x.shape.first().copied().unwrap_or(0);
        let fits = inputs.len() == 17
            && x.shape.len() == 2
            && (1..=MAX_POSITIONS as i32).contains(&positions)
            && q.shape.len() == 4
            && q.shape[..1] == [1]
            && q.shape[2..] == [positions, d]
            && k.shape.len() == 4
            && k.shape == v.shape
            && k.shape[1] > 0
            && q.shape[1] % k.shape[1] == 0
            && k.shape[3] == d
            && self.rows.len() == positions as usize
            && self
                .rows
                .iter()
                .all(|r| (r.cache_row as i32) < k.shape[0] && r.start <= r.column && (r.column as i32) < k.shape[2])
            && [q, k, v].iter().all(|t| t.dtype == x.dtype);
        if !fits {
            return Err(Error::InvalidArgument(format!(
                "fused attention output: x {:?}, q {:?}, keys {:?}, values {:?}, rows {:?}",
                x.shape, q.shape, k.shape, v.shape, self.rows
            )));
        }
        Ok(vec![x.clone()])
    }

    fn eval_cpu(&self, inputs: &[CpuTensor<'_>], outputs: &mut [CpuTensorMut<'_>]) -> Result<()> {
        let dtype = inputs[0].dtype();
        let d = self.head_dim;
        let [o, gate, up, down] = self.layouts;
        let x = to_f32(&inputs[0])?;
        let q = to_f32(&inputs[1])?;
        let (positions, hidden) = (inputs[0].shape()[0] as usize, inputs[0].shape()[1] as usize);
        let (kv_heads, capacity) = (inputs[2].shape()[1] as usize, inputs[2].shape()[2] as usize);
        let (keys, values) = (Floats::of(&inputs[2])?, Floats::of(&inputs[3])?);
        // Each row's heads (`q` is `[1, heads, L, d]`) over its own cache row's columns from its
        // start up to its own: rows `[L, heads · d]`.
        let heads = q.len() / (positions * d);
        let mut attended = vec![0f32; q.len()];
        let mut query = vec![0f32; heads * d];
        for (i, out) in attended.chunks_exact_mut(heads * d).enumerate() {
            for (h, head) in query.chunks_exact_mut(d).enumerate() {
                head.copy_from_slice(&q[(h * positions + i) * d..(h * positions + i + 1) * d]);
            }
            let at = self.rows[i];
            let first = |h: usize| ((at.cache_row * kv_heads + h) * capacity + at.start) * d;
            let cache: Vec<_> = (0..kv_heads).map(|h| (keys.at(first(h)), values.at(first(h)))).collect();
            attend_heads(&query, &cache, at.column + 1 - at.start, d, self.scale, out);
        }
        round(&mut attended, dtype);
        let projected = product(&attended, &inputs[5..8], o, dtype)?;
        let mut h: Vec<f32> = x.iter().zip(&projected).map(|(a, b)| a + b).collect();
        round(&mut h, dtype);
        let mut normed = vec![0f32; h.len()];
        let norm = to_f32(&inputs[4])?;
        for (row, out) in h.chunks_exact(hidden).zip(normed.chunks_exact_mut(hidden)) {
            rms_row(row, &norm, self.eps, out);
        }
        round(&mut normed, dtype);
        let [g, u]: [Vec<f32>; 2] = products(&normed, &inputs[8..14], &[gate, up], dtype)?.try_into().expect("two");
        let activated = swiglu(&g, &u, dtype);
        let y = product(&activated, &inputs[14..17], down, dtype)?;
        h.iter_mut().zip(&y).for_each(|(h, y)| *h += y);
        store(&mut outputs[0], &h)
    }
}
