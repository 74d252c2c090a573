//! How far decoding is from the memory-bandwidth limit: the bytes one decoded token must read
//! (every weight once, one embedding row, the keys and values every layer attends to) and the
//! device's bandwidth measured by a copy. A token cannot come faster than bytes ÷ bandwidth; the
//! fraction of that floor a run reaches says how much is left to gain.
//!
//! ```
//! # fn main() -> rmlx_lm::Result<()> {
//! // 1.2 GB of weights, 20 MB of keys and values, 250 tokens/s on a 3.35 TB/s device.
//! let floor = rmlx_lm::roofline::Floor { weight_bytes: 1_200_000_000, kv_bytes: 20_000_000, bandwidth: 3.35e12 };
//! assert!((floor.tokens_per_second() - 2745.9).abs() < 0.1);
//! assert!((floor.fraction(250.0) - 0.091).abs() < 0.001);
//! # Ok(())
//! # }
//! ```

use crate::{LoadedModel, Result};
use rmlx::quantization::{quantize, quantized_matmul, QuantMode};
use rmlx::{ops, random, Array, DeviceType, Dtype};
use std::time::Instant;

/// What one decoded token reads, and how fast the device reads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Floor {
    /// Weight bytes read per token ([`weight_bytes_per_token`]).
    pub weight_bytes: u64,
    /// Key and value bytes read per token, averaged over the run ([`kv_bytes_per_token`]).
    pub kv_bytes: u64,
    /// Bytes per second ([`measure_bandwidth`]).
    pub bandwidth: f64,
}

impl Floor {
    /// Bytes read per token.
    pub fn bytes(&self) -> u64 {
        self.weight_bytes + self.kv_bytes
    }

    /// The most tokens per second the bandwidth allows.
    pub fn tokens_per_second(&self) -> f64 {
        self.bandwidth / self.bytes().max(1) as f64
    }

    /// The fraction of [`Floor::tokens_per_second`] that `tokens_per_second` reaches.
    pub fn fraction(&self, tokens_per_second: f64) -> f64 {
        tokens_per_second / self.tokens_per_second()
    }
}

/// Weight bytes one decoded token reads: every weight once, except that an input embedding
/// table not shared with the output head gives one row (a tied one is read whole, as the head),
/// and that of a mixture of experts' stacked experts (`switch_mlp`; gpt-oss's `mlp.experts`,
/// weights and per-expert biases) a token reads the
/// `num_experts_per_tok` it is routed to out of `num_experts`.
pub fn weight_bytes_per_token(lm: &LoadedModel) -> u64 {
    let (mut all, mut embedding, mut experts) = (0u64, 0u64, 0u64);
    let mut head = false;
    lm.model.visit("", &mut |name, _, a| {
        all += a.nbytes() as u64;
        if name.starts_with("model.embed_tokens.") {
            embedding += a.nbytes() as u64;
        }
        if name.contains(".switch_mlp.") || (name.contains(".mlp.experts.") && a.ndim() >= 2) {
            experts += a.nbytes() as u64;
        }
        head |= name.starts_with("lm_head.");
    });
    if let Ok(moe) = crate::models::moe::MoeConfig::of(lm.model.config()) {
        let (used, of) = (moe.num_experts_per_tok as u64, moe.num_experts as u64);
        all = all - experts + experts * used / of;
    }
    if head {
        let rows = lm.model.config().vocab_size.max(1) as u64;
        all - embedding + embedding / rows
    } else {
        all
    }
}

/// Key and value bytes read per token while decoding `generated` tokens after a prompt of
/// `prompt` tokens, averaged: at position `p` a layer reads `p + 1` positions' keys and values,
/// or its sliding window's.
pub fn kv_bytes_per_token(lm: &LoadedModel, prompt: usize, generated: usize) -> u64 {
    let per_position = lm.kv_bytes_per_layer_position() as u64;
    let windows = lm.layer_windows();
    if generated == 0 {
        return 0;
    }
    let total: u64 = (prompt..prompt + generated)
        .map(|p| windows.iter().map(|w| w.map_or(p + 1, |w| (p + 1).min(w)) as u64).sum::<u64>())
        .sum();
    total * per_position / generated as u64
}

/// The default device's memory bandwidth in bytes per second, the best of several copies of a
/// large buffer (each reads and writes every byte once): on a GPU an elementwise MLX op, on the
/// CPU a copy split over every core (MLX's CPU elementwise ops run on one thread, which would
/// measure one core's speed, not the memory's).
pub fn measure_bandwidth() -> Result<f64> {
    if rmlx::current_device().kind == DeviceType::Gpu {
        gpu_copy_bandwidth()
    } else {
        Ok(host_copy_bandwidth())
    }
}

fn gpu_copy_bandwidth() -> Result<f64> {
    let elements: i32 = 1 << 28;
    let x = ops::ones(&[elements], Dtype::Float32)?;
    rmlx::eval([&x])?;
    let mut best = f64::INFINITY;
    for i in 0..6 {
        // A different scalar each time, so that nothing is reused.
        let y = (&x * &Array::scalar(1.0 + i as f32))?;
        let t = Instant::now();
        rmlx::eval([&y])?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    drop(x);
    rmlx::memory::clear_cache();
    Ok(2.0 * 4.0 * elements as f64 / best)
}

fn host_copy_bandwidth() -> f64 {
    const BYTES: usize = 1 << 28;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let src = vec![1u8; BYTES];
    let mut dst = vec![0u8; BYTES];
    let chunk = BYTES.div_ceil(threads);
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for (d, from) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                s.spawn(move || d.copy_from_slice(from));
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    2.0 * BYTES as f64 / best
}

/// The floor of `lm` for a run of `generated` tokens after `prompt`, on a device of `bandwidth`.
pub fn floor(lm: &LoadedModel, prompt: usize, generated: usize, bandwidth: f64) -> Floor {
    Floor { weight_bytes: weight_bytes_per_token(lm), kv_bytes: kv_bytes_per_token(lm, prompt, generated), bandwidth }
}

/// One shape of quantised matrix-vector product, measured: a decoding step's product of one row
/// with a `[output, input]` weight in MLX's affine layout.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProductRate {
    pub output: i32,
    pub input: i32,
    /// Weight bytes one product reads: packed values, scales and biases.
    pub bytes: u64,
    /// Bytes per second through rmlx's own kernel (`nn::cuda_qmv`) where it serves the shape on
    /// this device, else through a quantised layer's product.
    pub rmlx: f64,
    /// Bytes per second through MLX's `quantized_matmul`.
    pub mlx: f64,
}

/// How fast products of `rows` rows with a `[output, input]` weight quantised to `bits` in groups of
/// `group` (scales of `dtype`) read their weights on the current device, through rmlx's kernel
/// (else a layer's product) and through MLX's: many products in one evaluation, over enough
/// copies of the weight that they do not stay in the caches, best of four. The host builds each
/// product while the device runs the ones before, so small products also measure the host's cost
/// per product.
pub fn quantized_matvec_rate(
    output: i32,
    input: i32,
    bits: i32,
    group: i32,
    dtype: Dtype,
    rows: i32,
) -> Result<ProductRate> {
    if rows < 1 {
        return Err(crate::Error::InvalidParameter(format!("products of {rows} rows")));
    }
    let key = random::key(0)?;
    let w = random::normal(&[output, input], Dtype::Float32, 0.0, 0.02, Some(&key))?.astype(dtype)?;
    let base = quantize(&w, group, bits, QuantMode::Affine)?;
    drop(w);
    let bytes = [Some(&base.weight), Some(&base.scales), base.biases.as_ref()]
        .into_iter()
        .flatten()
        .map(|a| a.nbytes() as u64)
        .sum::<u64>();
    // About 512 MB of weights (well past any cache), 2 to 64 copies.
    let copies = (512u64 << 20).div_ceil(bytes.max(1)).clamp(2, 64) as usize;
    let weights: Vec<_> = (0..copies)
        .map(|i| {
            let shift = Array::scalar(i as f32 * 1e-3).astype(dtype)?;
            let scales = (&base.scales + &shift)?;
            let q = rmlx::quantization::Quantized { scales, ..base.clone() };
            rmlx::eval([&q.scales])?;
            Ok(q)
        })
        .collect::<Result<_>>()?;
    let x = random::normal(&[rows, input], Dtype::Float32, 0.0, 1.0, Some(&random::key(1)?))?.astype(dtype)?;
    rmlx::eval([&x])?;
    let products = copies.max(32);
    let time = |layer: bool| -> Result<f64> {
        let mut best = f64::INFINITY;
        for _ in 0..4 {
            let t = Instant::now();
            let ys = (0..products)
                .map(|i| {
                    let q = &weights[i % copies];
                    if layer {
                        crate::nn::quantized_product(&x, q, crate::nn::QuantizedMatvec::Rmlx)
                    } else {
                        Ok(quantized_matmul(&x, q, true)?)
                    }
                })
                .collect::<Result<Vec<_>>>()?;
            rmlx::eval(ys.iter())?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(products as f64 * bytes as f64 / best)
    };
    let (rmlx_rate, mlx_rate) = (time(true)?, time(false)?);
    drop(weights);
    rmlx::memory::clear_cache();
    Ok(ProductRate { output, input, bytes, rmlx: rmlx_rate, mlx: mlx_rate })
}
