//! A decoding step's attention over packed keys and values in one launch
//! (`nn::cuda_packed_attention`), against attention composed in float32 over the same cache
//! unpacked: 2, 4 and 8 bits, groups of 32, 64 and 128, head sizes 64, 128 and 256, grouped heads
//! (a KV head's queries in one block or split over two), one chunk of positions or many, a mask
//! of the held positions (one for every sequence, or one a sequence), soft-capped scores and sink
//! logits. A quantised cache's decoding step in one launch packs its position exactly as MLX's
//! quantize and slice updates do and attends over it. Where MLX has no CUDA backend, or for what
//! the kernels do not take (3 bits, a head of 96), the launches must decline.

use crate::cache::{pack, KvCache, KvQuantization, Mask, QuantizedCache};
use crate::nn::cuda_packed_attention::{packed_decode_attention, quantized_cache_attention};
use rmlx::fast::{self, GpuBackend};
use rmlx::{ops, random, Array, Device, Dtype};

fn normal(shape: &[i32], seed: u64) -> Array {
    random::normal(shape, Dtype::Float32, 0.0, 1.0, Some(&random::key(seed).unwrap())).unwrap()
}

fn max_abs_diff(a: &Array, b: &Array) -> f32 {
    let d = (a.astype(Dtype::Float32).unwrap() - b.astype(Dtype::Float32).unwrap()).unwrap();
    d.abs().unwrap().max(rmlx::Axes::All, false).unwrap().item::<f32>().unwrap()
}

/// What shapes a case's scores besides the cache.
#[derive(Clone, Copy, Debug)]
enum Extra {
    Plain,
    /// The first `n` positions visible to every sequence (`[1, K]`).
    Held(i32),
    /// Sequence `b` sees its first `K - 97·b` positions (`[B, 1, 1, K]`).
    PerRow,
    Softcap(f32),
    Sinks,
}

/// (batch, heads, kv heads, head size, positions, bits, group, dtype, extra)
type Case = (i32, i32, i32, i32, i32, i32, i32, Dtype, Extra);

/// `softmax(q kᵀ · scale [capped], masked [with sinks]) v` in float32 on the CPU (MLX's CUDA
/// products in float32 may round through TF32), heads grouped as GQA groups them.
fn reference(q: &Array, k: &Array, v: &Array, scale: f32, mask: Option<&Array>, extra: Extra, sinks: &Array) -> Array {
    rmlx::with_device(Device::cpu(), || composed(q, k, v, scale, mask, extra, sinks))
}

fn composed(q: &Array, k: &Array, v: &Array, scale: f32, mask: Option<&Array>, extra: Extra, sinks: &Array) -> Array {
    let [b, hq, _, d] = q.shape().try_into().unwrap();
    let (hkv, n) = (k.shape()[1], k.shape()[2]);
    let q = q.astype(Dtype::Float32).unwrap().reshape(&[b, hkv, hq / hkv, d]).unwrap();
    let mut s = (ops::matmul(&q, &k.swapaxes(-1, -2).unwrap()).unwrap() * scale).unwrap();
    if let Extra::Softcap(cap) = extra {
        s = (ops::tanh(&(&s / cap).unwrap()).unwrap() * cap).unwrap();
    }
    if let Some(m) = mask {
        let m = m.reshape(&[-1, 1, 1, n]).unwrap();
        s = ops::r#where(&m, &s, &Array::scalar(f32::NEG_INFINITY)).unwrap();
    }
    let w = match extra {
        Extra::Sinks => {
            let col =
                ops::broadcast_to(&sinks.reshape(&[1, hkv, hq / hkv, 1]).unwrap(), &[b, hkv, hq / hkv, 1]).unwrap();
            let all = ops::softmax(&ops::concatenate(&[&col, &s], -1).unwrap(), -1, true).unwrap();
            all.slice_axis(-1, 1, n + 1, 1).unwrap()
        }
        _ => ops::softmax(&s, -1, true).unwrap(),
    };
    ops::matmul(&w, v).unwrap().reshape(&[b, hq, 1, d]).unwrap()
}

#[test]
fn packed_decode_attention_matches_float32_attention_over_the_unpacked_cache() {
    let cuda = fast::gpu_backend() == Some(GpuBackend::Cuda);
    let cases: &[Case] = &[
        (1, 16, 8, 128, 8192, 4, 64, Dtype::Bfloat16, Extra::Held(5000)),
        (2, 32, 8, 128, 300, 8, 64, Dtype::Float16, Extra::PerRow),
        (1, 4, 4, 64, 1000, 2, 32, Dtype::Float32, Extra::Plain),
        (1, 8, 2, 256, 512, 8, 128, Dtype::Bfloat16, Extra::Sinks),
        (1, 8, 4, 128, 700, 4, 32, Dtype::Float32, Extra::Softcap(2.0)),
        (1, 64, 8, 128, 40000, 4, 64, Dtype::Bfloat16, Extra::Held(20001)),
        (3, 8, 1, 64, 257, 8, 32, Dtype::Float32, Extra::PerRow),
    ];
    let device = if cuda { Device::gpu() } else { Device::cpu() };
    rmlx::with_device(device, || {
        for (i, &(b, hq, hkv, d, n, bits, group_size, dtype, extra)) in cases.iter().enumerate() {
            let seed = 100 * i as u64;
            let what = format!(
                "case {i}: {b}×{hq}/{hkv} heads of {d}, {n} positions, {bits} bits/{group_size}, {dtype:?}, {extra:?}"
            );
            let quantization = KvQuantization { bits, group_size, start: 0 };
            let q = normal(&[b, hq, 1, d], seed).astype(dtype).unwrap();
            let keys = pack(&normal(&[b, hkv, n, d], seed + 1).astype(dtype).unwrap(), &quantization).unwrap();
            let values = pack(&normal(&[b, hkv, n, d], seed + 2).astype(dtype).unwrap(), &quantization).unwrap();
            // Sinks large enough to take a share of the weight from hundreds of positions.
            let sinks = ((normal(&[hq], seed + 3) * 3.0).unwrap() + 6.0).unwrap();
            let key = ops::arange(0.0, n as f64, 1.0, Dtype::Int32).unwrap();
            let mask = match extra {
                Extra::Held(held) => Some(key.reshape(&[1, n]).unwrap().less(&Array::scalar(held)).unwrap()),
                Extra::PerRow => {
                    let held: Vec<i32> = (0..b).map(|r| n - 97 * r).collect();
                    let held = Array::from_slice(&held, &[b, 1, 1, 1]).unwrap();
                    Some(key.reshape(&[1, 1, 1, n]).unwrap().less(&held).unwrap())
                }
                _ => None,
            };
            // Scores of a unit or two: the weight goes to tens of positions, so that outputs are of
            // order one (not averages over thousands, near zero whatever the kernel did).
            let scale = 2.0 / (d as f32).sqrt();
            let softcap = match extra {
                Extra::Softcap(cap) => Some(cap),
                _ => None,
            };
            let sink_logits = matches!(extra, Extra::Sinks).then_some(&sinks);
            let as_mask = mask.clone().map_or(Mask::None, Mask::Array);
            let got = packed_decode_attention(&q, &keys, &values, scale, &as_mask, softcap, sink_logits).unwrap();
            assert_eq!(got.is_some(), cuda, "{what}: served exactly on MLX's CUDA backend");
            // The kernel keeps scores and sums in float32: only the output's rounding to the
            // half types. Elsewhere the composition of MLX's quantised products is held to the
            // reference (its scores rounded to the half types first: within 0.1 there).
            let kernel = match dtype {
                Dtype::Float32 => 1e-4,
                Dtype::Float16 => 2e-3,
                _ => 8e-3,
            };
            let (got, tolerance) = match got {
                Some(got) => (got, kernel),
                None => {
                    let composed =
                        crate::cache::quantized_attention(&q, &keys, &values, scale, &as_mask, softcap, sink_logits);
                    (composed.unwrap(), if dtype == Dtype::Float32 { kernel } else { 0.1 })
                }
            };
            assert_eq!((got.shape(), got.dtype()), (&[b, hq, 1, d][..], dtype), "{what}");
            let (k, v) = (keys.unpack(Dtype::Float32).unwrap(), values.unpack(Dtype::Float32).unwrap());
            let want = reference(&q, &k, &v, scale, mask.as_ref(), extra, &sinks);
            let diff = max_abs_diff(&got, &want);
            assert!(diff <= tolerance, "{what}: {diff} from float32 attention over the unpacked cache");
            // The cases tell their features apart: without the mask, cap or sinks the result moves.
            if !matches!(extra, Extra::Plain) {
                let plain = reference(&q, &k, &v, scale, None, Extra::Plain, &sinks);
                assert!(max_abs_diff(&plain, &want) > 10.0 * kernel, "{what}: the case's extra changes nothing");
            }
        }
    });
}

#[test]
fn packed_decode_attention_declines_what_it_does_not_take() {
    let run = |d: i32, bits: i32| {
        let quantization = KvQuantization { bits, group_size: 32, start: 0 };
        let q = normal(&[1, 4, 1, d], 1);
        let keys = pack(&normal(&[1, 2, 64, d], 2), &quantization).unwrap();
        let values = pack(&normal(&[1, 2, 64, d], 3), &quantization).unwrap();
        packed_decode_attention(&q, &keys, &values, 0.1, &Mask::None, None, None).unwrap()
    };
    let device = if fast::gpu_backend() == Some(GpuBackend::Cuda) { Device::gpu() } else { Device::cpu() };
    rmlx::with_device(device, || {
        assert!(run(128, 3).is_none(), "3-bit rows cross word boundaries");
        assert!(run(96, 4).is_none(), "a head of 96 at 4 bits is 6 pieces of 8 bytes");
    });
}

/// (batch, heads, kv heads, head size, positions held, bits, group, dtype)
type CacheCase = (i32, i32, i32, i32, i32, i32, i32, Dtype);

#[test]
fn a_quantised_cache_step_packs_its_position_as_mlx_quantizes_and_attends_over_it() {
    let cuda = fast::gpu_backend() == Some(GpuBackend::Cuda);
    let cases: &[CacheCase] = &[
        (1, 16, 8, 128, 300, 4, 64, Dtype::Bfloat16),
        (2, 32, 8, 128, 255, 8, 64, Dtype::Float16),
        (1, 8, 2, 64, 40, 2, 32, Dtype::Float32),
        (1, 8, 4, 256, 1000, 8, 128, Dtype::Bfloat16),
        (1, 4, 4, 128, 511, 4, 32, Dtype::Float32),
    ];
    let device = if cuda { Device::gpu() } else { Device::cpu() };
    rmlx::with_device(device, || {
        for (i, &(b, hq, hkv, d, n, bits, group_size, dtype)) in cases.iter().enumerate() {
            let seed = 1000 + 100 * i as u64;
            let what = format!("case {i}: {b}×{hq}/{hkv} heads of {d}, {n} held, {bits} bits/{group_size}, {dtype:?}");
            let quantization = KvQuantization { bits, group_size, start: 0 };
            let rows = |seed: u64, n: i32| normal(&[b, hkv, n, d], seed).astype(dtype).unwrap();
            let (keys, values) = (rows(seed, n), rows(seed + 1, n));
            let new = |c: &QuantizedCache| QuantizedCache::from_rows(c.quantization, None, &keys, &values, n as usize);
            let mut fused = KvCache::Quantized(new(&QuantizedCache::new(quantization, None)).unwrap());
            let mut composed = new(&QuantizedCache::new(quantization, None)).unwrap();
            let scale = 2.0 / (d as f32).sqrt();
            // Three steps: the first grows the buffers, the others write in place.
            for step in 0..3u64 {
                let q = normal(&[b, hq, 1, d], seed + 10 * step + 2).astype(dtype).unwrap();
                let (k, v) = (rows(seed + 10 * step + 3, 1), rows(seed + 10 * step + 4, 1));
                let got = quantized_cache_attention(&q, &k, &v, &mut fused, scale, None, None).unwrap();
                let (ck, cv, mask) = composed.update(&k, &v).unwrap();
                let Some(got) = got else {
                    assert!(!cuda, "{what}: declined on MLX's CUDA backend");
                    assert_eq!(fused.offset(), n as usize, "{what}: declined, nothing written");
                    break;
                };
                assert!(cuda, "{what}: served without MLX's CUDA backend");
                let held = n as usize + step as usize + 1;
                assert_eq!(fused.offset(), held, "{what}: step {step}: the offset advanced");
                // The buffers, position by position, as MLX's quantize and slice updates leave them.
                let (f, c) = (fused.state(), composed.state());
                for (a, (x, y)) in
                    ["key words", "key scales", "key biases", "value words", "value scales", "value biases"]
                        .iter()
                        .zip(f.iter().zip(&c))
                {
                    let bits = |a: &Array| -> Vec<u32> {
                        let a = a.slice_axis(2, 0, held as i32, 1).unwrap();
                        match a.dtype() {
                            Dtype::Uint32 => a.to_vec::<u32>().unwrap(),
                            _ => a.to_vec_f32().unwrap().iter().map(|x| x.to_bits()).collect(),
                        }
                    };
                    assert!(bits(x) == bits(y), "{what}: step {step}: {a} differ");
                }
                let (k, v) = (ck.unpack(Dtype::Float32).unwrap(), cv.unpack(Dtype::Float32).unwrap());
                let mask = match mask {
                    Mask::Array(m) => Some(m),
                    _ => None,
                };
                let want = reference(&q, &k, &v, scale, mask.as_ref(), Extra::Plain, &q);
                let tolerance = match dtype {
                    Dtype::Float32 => 1e-4,
                    Dtype::Float16 => 2e-3,
                    _ => 8e-3,
                };
                let diff = max_abs_diff(&got, &want);
                assert!(
                    diff <= tolerance,
                    "{what}: step {step}: {diff} from float32 attention over the unpacked cache"
                );
            }
        }
    });
}
