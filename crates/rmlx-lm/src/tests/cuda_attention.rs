//! The decoding step's cache write and attention as one launch (`nn::cuda_attention`), against
//! MLX's composition (a slice update of each buffer, then `fast::scaled_dot_product_attention` over
//! the valid positions): float32 within float32 rounding, the half types within a rounding or
//! two; grouped heads, head sizes 64, 96, 128 and 256, one chunk of positions or many (the new
//! position first, last or inside one), two sequences at one position or one each. The buffers
//! are the caller's and written in place: the arrays passed in hold the new position afterwards
//! and nothing else changed, and the chunk counts are left at zero. The heads made inside the
//! kernel from the stacked q/k/v product match the heads kernel followed by the attention, bit for
//! bit, over hundreds of steps of one cache. Where MLX has no CUDA backend the launch must decline.

use crate::cache::{KvCache, Offset, StandardCache};
use crate::nn::cuda_attention::{
    cache_attention, rotating_cache_attention, standard_cache_attention, Scores, StepHeads, MAX_QUERIES,
};
use crate::nn::cuda_fast::{qkv_heads, HeadNorms, Rotation};
use rmlx::fast::{self, AttentionMask, GpuBackend};
use rmlx::{ops, random, Array, Device, Dtype};

fn normal(shape: &[i32], seed: u64) -> Array {
    random::normal(shape, Dtype::Float32, 0.0, 1.0, Some(&random::key(seed).unwrap())).unwrap()
}

fn max_abs_diff(a: &Array, b: &Array) -> f32 {
    let d = (a.astype(Dtype::Float32).unwrap() - b.astype(Dtype::Float32).unwrap()).unwrap();
    d.abs().unwrap().max(rmlx::Axes::All, false).unwrap().item::<f32>().unwrap()
}

/// (batch, heads, kv heads, head size, capacity, positions, dtype)
type Case = (i32, i32, i32, i32, i32, &'static [i32], Dtype);

#[test]
fn cache_attention_matches_the_composed_step() {
    let cuda = fast::gpu_backend() == Some(GpuBackend::Cuda);
    let cases: &[Case] = &[
        (1, 16, 8, 128, 256, &[37], Dtype::Bfloat16),
        (2, 8, 2, 64, 512, &[300], Dtype::Float16),
        (2, 4, 4, 64, 256, &[0, 200], Dtype::Float32),
        (1, 8, 8, 256, 1024, &[700], Dtype::Bfloat16),
        (1, 12, 4, 96, 8192, &[5000], Dtype::Float16),
        (1, 32, 8, 128, 4096, &[31], Dtype::Float32),
        (1, 4, 2, 32, 65536, &[40000], Dtype::Float32),
    ];
    let device = if cuda { Device::gpu() } else { Device::cpu() };
    rmlx::with_device(device, || {
        for (i, &(b, hq, hkv, d, cap, positions, dtype)) in cases.iter().enumerate() {
            let seed = 100 * i as u64;
            let what = format!("case {i}: {b}×{hq}/{hkv} heads of {d}, positions {positions:?}, {dtype:?}");
            let q = normal(&[b, hq, 1, d], seed).astype(dtype).unwrap();
            let k = normal(&[b, hkv, 1, d], seed + 1).astype(dtype).unwrap();
            let v = normal(&[b, hkv, 1, d], seed + 2).astype(dtype).unwrap();
            let keys = normal(&[b, hkv, cap, d], seed + 3).astype(dtype).unwrap();
            let values = normal(&[b, hkv, cap, d], seed + 4).astype(dtype).unwrap();
            let pos = match positions {
                [p] => Offset::Uniform(*p as usize),
                _ => Offset::PerRow(Array::from_slice(positions, &[positions.len() as i32]).unwrap()),
            };
            let scale = 1.0 / (d as f32).sqrt();
            let (mut keys_want, mut values_want) = (keys.to_vec_f32().unwrap(), values.to_vec_f32().unwrap());
            let (k_rows, v_rows) = (k.to_vec_f32().unwrap(), v.to_vec_f32().unwrap());
            for row in 0..b {
                let p = positions[if positions.len() > 1 { row as usize } else { 0 }];
                for h in 0..hkv {
                    let (at, from) = ((((row * hkv + h) * cap + p) * d) as usize, ((row * hkv + h) * d) as usize);
                    keys_want[at..at + d as usize].copy_from_slice(&k_rows[from..from + d as usize]);
                    values_want[at..at + d as usize].copy_from_slice(&v_rows[from..from + d as usize]);
                }
            }
            let done = ops::zeros(&[b * hq], Dtype::Uint32).unwrap();
            let heads = StepHeads::Ready { q: &q, k: &k, v: &v };
            let got = cache_attention(&heads, (&keys, &values, &done), &pos, None, scale, Scores::default()).unwrap();
            let Some([attention, new_keys, new_values, new_done]) = got else {
                assert!(!cuda, "{what}: declined on MLX's CUDA backend");
                continue;
            };
            assert!(cuda, "{what}: served without MLX's CUDA backend");
            assert!(new_keys.to_vec_f32().unwrap() == keys_want, "{what}: keys written at the position alone");
            assert!(new_values.to_vec_f32().unwrap() == values_want, "{what}: values written at the position alone");
            assert!(keys.to_vec_f32().unwrap() == keys_want, "{what}: the keys' buffer updated in place");
            assert!(values.to_vec_f32().unwrap() == values_want, "{what}: the values' buffer updated in place");
            assert!(new_done.to_vec_f32().unwrap().iter().all(|&c| c == 0.0), "{what}: the chunk counts left zero");
            for row in 0..b {
                let p = positions[if positions.len() > 1 { row as usize } else { 0 }];
                let one = |a: &Array, h: i32, l: i32| {
                    ops::slice(a, &[row, 0, 0, 0], &[row + 1, h, l, d], &[1, 1, 1, 1]).unwrap()
                };
                let valid = |a: &Array| one(a, hkv, p + 1);
                let want = fast::scaled_dot_product_attention(
                    &one(&q, hq, 1),
                    &valid(&new_keys),
                    &valid(&new_values),
                    scale,
                    AttentionMask::None,
                )
                .unwrap();
                let tolerance = match dtype {
                    Dtype::Float32 => 1e-5,
                    Dtype::Bfloat16 => 2e-2,
                    _ => 4e-3,
                };
                let diff = max_abs_diff(&one(&attention, hq, 1), &want);
                assert!(diff <= tolerance, "{what}, sequence {row}: max |Δ| {diff}");
            }
        }
        // Buffers of another rank are declined, not indexed.
        let (q, k) = (normal(&[1, 2, 1, 32], 1), normal(&[1, 2, 1, 32], 2));
        let (flat, done) = (normal(&[2, 64], 3), ops::zeros(&[2], Dtype::Uint32).unwrap());
        let heads = StepHeads::Ready { q: &q, k: &k, v: &k };
        assert!(cache_attention(&heads, (&flat, &flat, &done), &Offset::Uniform(0), None, 1.0, Scores::default())
            .unwrap()
            .is_none());
    });
}

/// The heads made inside the kernel from the stacked q/k/v product give the same bits as the
/// heads kernel followed by the attention over ready heads, step after step on one cache (the
/// chunk counts wrap back to zero whatever the number of chunks): positions across a chunk's end
/// and the cache's growth, with and without q/k norms, in every dtype.
#[test]
fn stacked_heads_attend_as_the_heads_kernel_then_the_attention() {
    let cuda = fast::gpu_backend() == Some(GpuBackend::Cuda);
    let device = if cuda { Device::gpu() } else { Device::cpu() };
    rmlx::with_device(device, || {
        let mut steps = 0;
        for (i, &(hq, hkv, d)) in [(16, 8, 128), (8, 2, 64), (4, 4, 256), (6, 2, 96)].iter().enumerate() {
            for dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
                for norm in [true, false] {
                    let batch = 2;
                    let seed = 1000 * i as u64;
                    let qw = normal(&[d], seed + 1).astype(dtype).unwrap();
                    let kw = normal(&[d], seed + 2).astype(dtype).unwrap();
                    let divisors: Vec<f32> = (0..d / 2).map(|j| 1e4f32.powf(2.0 * j as f32 / d as f32)).collect();
                    let divisors = Array::from_slice(&divisors, &[d / 2]).unwrap();
                    let (mut fused, mut split) = (StandardCache::default(), StandardCache::default());
                    for position in 0..300usize {
                        let y =
                            normal(&[batch, (hq + 2 * hkv) * d], seed + 10 + position as u64).astype(dtype).unwrap();
                        let offset = Offset::Uniform(position);
                        let rotation = Rotation { divisors: &divisors, scale: 1.0, offset: &offset, factor: 1.0 };
                        let norms = || norm.then_some(HeadNorms { query: &qw, key: &kw, eps: 1e-5 });
                        let scale = 1.0 / (d as f32).sqrt();
                        let stacked = StepHeads::Stacked {
                            y: &y,
                            batch: y.shape()[0],
                            heads: (hq, hkv, d),
                            norms: norms(),
                            rotation: &rotation,
                        };
                        let got = standard_cache_attention(&stacked, &mut fused, scale, Scores::default()).unwrap();
                        let Some(got) = got else {
                            assert!(!cuda, "declined on MLX's CUDA backend");
                            return;
                        };
                        let [q, k, v] = qkv_heads(&y, batch, (hq, hkv, d), norms(), &rotation).unwrap().unwrap();
                        let ready = StepHeads::Ready { q: &q, k: &k, v: &v };
                        let want =
                            standard_cache_attention(&ready, &mut split, scale, Scores::default()).unwrap().unwrap();
                        // Check some steps whole; evaluate the rest as a decoding loop would.
                        if position % 37 == 0 || (30..=34).contains(&position) || position >= 296 {
                            let what = format!("{hq}/{hkv}×{d} {dtype:?} norm {norm} at {position}");
                            assert_eq!(got.to_vec_f32().unwrap(), want.to_vec_f32().unwrap(), "{what}: attention");
                            let (a, b) = (fused.keys.as_ref().unwrap(), split.keys.as_ref().unwrap());
                            assert_eq!(a.to_vec_f32().unwrap(), b.to_vec_f32().unwrap(), "{what}: keys");
                            let (a, b) = (fused.values.as_ref().unwrap(), split.values.as_ref().unwrap());
                            assert_eq!(a.to_vec_f32().unwrap(), b.to_vec_f32().unwrap(), "{what}: values");
                            steps += 1;
                        } else {
                            rmlx::eval([&got, &want]).unwrap();
                        }
                    }
                    assert_eq!((fused.offset, split.offset), (300, 300));
                    let done = fused.done.as_ref().unwrap().to_vec_f32().unwrap();
                    let counts = (batch * hq * MAX_QUERIES) as usize;
                    assert!(done.len() == counts && done.iter().all(|&c| c == 0.0), "counts left zero");
                }
            }
        }
        assert_eq!(steps, if cuda { 4 * 3 * 2 * 17 } else { 0 });
    });
}

/// A verification pass (up to `MAX_QUERIES` positions of each sequence in one launch, each query
/// seeing its own position and those before it) gives the same bits as its positions taken one
/// step at a time: from the stacked product and from ready heads, two sequences, passes of 1 to
/// 8 positions across chunk ends and the cache's growth, with and without q/k norms, plain scores,
/// sinks and soft-capped scores; the buffers' valid positions equal and the counts left zero.
#[test]
fn verification_passes_attend_as_their_single_steps() {
    use crate::nn::cuda_attention::kv_cache_attention;
    let cuda = fast::gpu_backend() == Some(GpuBackend::Cuda);
    let device = if cuda { Device::gpu() } else { Device::cpu() };
    let lengths = [3, 8, 1, 5, 2, 7, 4, 6];
    assert_eq!(*lengths.iter().max().unwrap(), MAX_QUERIES);
    rmlx::with_device(device, || {
        let mut passes = 0;
        for (i, &(hq, hkv, d)) in [(16, 8, 128), (8, 2, 64), (4, 4, 256)].iter().enumerate() {
            let sinks = (normal(&[hq], 9) * 2.0).unwrap();
            for dtype in [Dtype::Float32, Dtype::Bfloat16] {
                for norm in [true, false] {
                    let (batch, seed) = (2, 7000 * i as u64);
                    let sinks = sinks.astype(dtype).unwrap();
                    let scores = match i {
                        0 => Scores::default(),
                        1 => Scores::sinks(Some(&sinks)),
                        _ => Scores { softcap: Some(5.0), sinks: None },
                    };
                    let qw = normal(&[d], seed + 1).astype(dtype).unwrap();
                    let kw = normal(&[d], seed + 2).astype(dtype).unwrap();
                    let divisors: Vec<f32> = (0..d / 2).map(|j| 1e4f32.powf(2.0 * j as f32 / d as f32)).collect();
                    let divisors = Array::from_slice(&divisors, &[d / 2]).unwrap();
                    let norms = || norm.then_some(HeadNorms { query: &qw, key: &kw, eps: 1e-5 });
                    let scale = 1.0 / (d as f32).sqrt();
                    let new = || KvCache::Standard(StandardCache::default());
                    let (mut stacked, mut ready, mut steps) = (new(), new(), new());
                    let mut position = 0usize;
                    for (n, &len) in lengths.iter().cycle().enumerate() {
                        if position >= 300 {
                            break;
                        }
                        let what = format!("{hq}/{hkv}×{d} {dtype:?} norm {norm}, {len} positions at {position}");
                        // Rows b·L + i: position `position + i` of sequence b.
                        let y = normal(&[batch * len, (hq + 2 * hkv) * d], seed + 10 + n as u64).astype(dtype).unwrap();
                        let at = Offset::Uniform(position);
                        let rotation = Rotation { divisors: &divisors, scale: 1.0, offset: &at, factor: 1.0 };
                        let pass = StepHeads::Stacked {
                            y: &y,
                            batch,
                            heads: (hq, hkv, d),
                            norms: norms(),
                            rotation: &rotation,
                        };
                        let Some(got) = kv_cache_attention(&pass, &mut stacked, scale, scores).unwrap() else {
                            assert!(!cuda, "{what}: declined on MLX's CUDA backend");
                            return;
                        };
                        // The same rows as single steps, and their heads as one ready pass.
                        let (mut want, mut heads) = (Vec::new(), Vec::new());
                        for q in 0..len {
                            let rows: Vec<i32> = (0..batch).map(|b| b * len + q).collect();
                            let y = y.take(&Array::from_slice(&rows, &[batch]).unwrap(), Some(0)).unwrap();
                            let at = Offset::Uniform(position + q as usize);
                            let rotation = Rotation { divisors: &divisors, scale: 1.0, offset: &at, factor: 1.0 };
                            let step = StepHeads::Stacked {
                                y: &y,
                                batch,
                                heads: (hq, hkv, d),
                                norms: norms(),
                                rotation: &rotation,
                            };
                            want.push(kv_cache_attention(&step, &mut steps, scale, scores).unwrap().unwrap());
                            heads.push(qkv_heads(&y, batch, (hq, hkv, d), norms(), &rotation).unwrap().unwrap());
                        }
                        let want = ops::concatenate(&want.iter().collect::<Vec<_>>(), 2).unwrap();
                        let joined =
                            |k: usize| ops::concatenate(&heads.iter().map(|h| &h[k]).collect::<Vec<_>>(), 2).unwrap();
                        let (q, k, v) = (joined(0), joined(1), joined(2));
                        let step = StepHeads::Ready { q: &q, k: &k, v: &v };
                        let from_ready = kv_cache_attention(&step, &mut ready, scale, scores).unwrap().unwrap();
                        assert_eq!(got.shape(), [batch, hq, len, d], "{what}");
                        let want = want.to_vec_f32().unwrap();
                        assert!(got.to_vec_f32().unwrap() == want, "{what}: the stacked pass's attention");
                        assert!(from_ready.to_vec_f32().unwrap() == want, "{what}: the ready pass's attention");
                        position += len as usize;
                        for cache in [&stacked, &ready] {
                            let (KvCache::Standard(a), KvCache::Standard(b)) = (cache, &steps) else { unreachable!() };
                            assert_eq!(a.offset, position, "{what}");
                            let valid = |x: &Option<Array>| {
                                let x = x.as_ref().unwrap();
                                x.slice_axis(2, 0, position as i32, 1).unwrap().to_vec_f32().unwrap()
                            };
                            assert!(valid(&a.keys) == valid(&b.keys), "{what}: keys");
                            assert!(valid(&a.values) == valid(&b.values), "{what}: values");
                            let done = a.done.as_ref().unwrap().to_vec_f32().unwrap();
                            assert!(done.iter().all(|&c| c == 0.0), "{what}: counts left zero");
                        }
                        passes += 1;
                    }
                }
            }
        }
        // 300 positions in passes of 4.5 on average: 67 passes a case.
        assert_eq!(passes, if cuda { 3 * 2 * 2 * 67 } else { 0 });
    });
}

/// (window, kept slots, heads, kv heads, head size, prompt lengths, dtype)
type RingCase = (usize, usize, i32, i32, i32, &'static [i32], Dtype);

/// A rotating cache's steps through the kernel (the slot computed from the position) against the
/// same cache updated as MLX composes it and MLX's attention (on the CPU) over what it returns: prompts longer
/// and shorter than the window between runs of single positions, kept slots or none, the buffers
/// equal bit for bit and the attention within the dtype's tolerance.
#[test]
fn ring_cache_attention_matches_the_composed_step() {
    let cuda = fast::gpu_backend() == Some(GpuBackend::Cuda);
    let device = if cuda { Device::gpu() } else { Device::cpu() };
    let cases: &[RingCase] = &[
        (8, 0, 4, 1, 32, &[3, 12], Dtype::Float32),
        (40, 4, 8, 2, 64, &[50, 5], Dtype::Bfloat16),
        (512, 0, 8, 1, 256, &[300, 400], Dtype::Bfloat16),
        (300, 4, 16, 8, 128, &[1, 700], Dtype::Float16),
    ];
    rmlx::with_device(device, || {
        let mut checked = 0;
        for (i, &(window, keep, hq, hkv, d, prompts, dtype)) in cases.iter().enumerate() {
            let (mut fused, mut composed) = (KvCache::rotating(window, keep), KvCache::rotating(window, keep));
            let scale = 1.0 / (d as f32).sqrt();
            let mut seed = 5000 * i as u64;
            for &prompt in prompts {
                let mut rows = |len: i32, h: i32| {
                    seed += 1;
                    normal(&[1, h, len, d], seed).astype(dtype).unwrap()
                };
                let (k, v) = (rows(prompt, hkv), rows(prompt, hkv));
                for cache in [&mut fused, &mut composed] {
                    cache.update(&k, &v).unwrap();
                }
                for step in 0..window + 40 {
                    let (q, k, v) = (rows(1, hq), rows(1, hkv), rows(1, hkv));
                    let what = format!("case {i}, after a prompt of {prompt}, step {step}");
                    let KvCache::Rotating(r) = &mut fused else { unreachable!() };
                    let got = rotating_cache_attention(
                        &StepHeads::Ready { q: &q, k: &k, v: &v },
                        r,
                        scale,
                        Scores::default(),
                    )
                    .unwrap();
                    let Some(got) = got else {
                        assert!(!cuda, "{what}: declined on MLX's CUDA backend");
                        return;
                    };
                    let (keys, values, mask) = composed.update(&k, &v).unwrap();
                    // MLX's attention on the CPU: on CUDA, heads it has no kernel for take matrix
                    // products in TF32.
                    rmlx::eval([&q, &keys, &values]).unwrap();
                    let want = rmlx::with_device(Device::cpu(), || {
                        fast::scaled_dot_product_attention(&q, &keys, &values, scale, mask.as_attention())
                    })
                    .unwrap();
                    let tolerance = match dtype {
                        Dtype::Float32 => 1e-5,
                        Dtype::Bfloat16 => 2e-2,
                        _ => 4e-3,
                    };
                    let diff = max_abs_diff(&got, &want);
                    assert!(diff <= tolerance, "{what}: attention differs by {diff}");
                    let (KvCache::Rotating(a), KvCache::Rotating(b)) = (&fused, &composed) else { unreachable!() };
                    assert_eq!((a.offset, a.next_slot()), (b.offset, b.next_slot()), "{what}");
                    if step % 17 == 0 || step >= window {
                        for (x, y) in [(&a.keys, &b.keys), (&a.values, &b.values)] {
                            let (x, y) = (x.as_ref().unwrap(), y.as_ref().unwrap());
                            assert_eq!(x.to_vec_f32().unwrap(), y.to_vec_f32().unwrap(), "{what}: buffers");
                        }
                        checked += 1;
                    }
                }
            }
            let KvCache::Rotating(r) = &fused else { unreachable!() };
            assert!(r.done.as_ref().unwrap().to_vec_f32().unwrap().iter().all(|&c| c == 0.0), "case {i}: counts");
        }
        // Per prompt: every 17th step before the window's length, every step after it.
        let per_prompt = |w: usize| (0..w + 40).filter(|s| s % 17 == 0 || *s >= w).count();
        let expected: usize = cases.iter().map(|c| per_prompt(c.0) * c.5.len()).sum();
        assert_eq!(checked, if cuda { expected } else { 0 });
    });
}

/// gpt-oss's step: a sink logit per query head joining the softmax, and the queries and keys made
/// from the stacked product multiplied by YaRN's attention factor before they turn, against the
/// same step composed on the CPU (heads split, multiplied, rotated by MLX's RoPE, the cache
/// updated, MLX's attention with sinks): over an unbounded cache and a ring of 16 slots, past the
/// ring's length, in float32 and bfloat16 (within 5e-2: MLX's own bfloat16 composition of these
/// steps is up to 0.037 off its float32 one on the same inputs, and the kernel rounds the heads
/// where MLX does, in another order). Sinks spread around the scores' size, so that they
/// change the result (by more than 0.1 somewhere at every step, 0.21 at least on the CPU).
#[test]
fn sinks_and_the_attention_factor_attend_as_the_composed_step() {
    let cuda = fast::gpu_backend() == Some(GpuBackend::Cuda);
    let device = if cuda { Device::gpu() } else { Device::cpu() };
    let (hq, hkv, d, factor) = (8, 2, 64, 1.3465736f32);
    let divisors: Vec<f32> = (0..d / 2).map(|j| 15e4f32.powf(2.0 * j as f32 / d as f32)).collect();
    let divisors = Array::from_slice(&divisors, &[d / 2]).unwrap();
    let scale = 1.0 / (d as f32).sqrt();
    let mut checked = 0;
    for (dtype, tolerance) in [(Dtype::Float32, 2e-5), (Dtype::Bfloat16, 5e-2)] {
        let sinks = (normal(&[hq], 77) * 2.0).unwrap().astype(dtype).unwrap();
        for window in [None, Some(16)] {
            let cache =
                || window.map_or_else(|| KvCache::Standard(StandardCache::default()), |w| KvCache::rotating(w, 0));
            let (mut fused, mut composed) = (cache(), cache());
            for position in 0..40usize {
                let what = format!("{dtype:?}, window {window:?}, position {position}");
                let y = normal(&[1, (hq + 2 * hkv) * d], 300 + position as u64).astype(dtype).unwrap();
                let offset = Offset::Uniform(position);
                let rotation = Rotation { divisors: &divisors, scale: 1.0, offset: &offset, factor };
                let step = StepHeads::Stacked {
                    y: &y,
                    batch: y.shape()[0],
                    heads: (hq, hkv, d),
                    norms: None,
                    rotation: &rotation,
                };
                let got = rmlx::with_device(device, || {
                    crate::nn::cuda_attention::kv_cache_attention(&step, &mut fused, scale, Scores::sinks(Some(&sinks)))
                        .unwrap()
                });
                let Some(got) = got else {
                    assert!(!cuda, "{what}: declined on MLX's CUDA backend");
                    return;
                };
                let (want, plain) = rmlx::with_device(Device::cpu(), || {
                    let heads = y.reshape(&[1, hq + 2 * hkv, 1, d]).unwrap();
                    let parts = ops::split_at(&heads, &[hq, hq + hkv], 1).unwrap();
                    let turned = |x: &Array| {
                        let x = (x * factor).unwrap();
                        fast::rope(&x, d, false, fast::RopeFreqs::Explicit(&divisors), 1.0, position as i32).unwrap()
                    };
                    let (q, k) = (turned(&parts[0]), turned(&parts[1]));
                    let (keys, values, mask) = composed.update(&k, &parts[2]).unwrap();
                    let attend = |s: Option<&Array>| match s {
                        Some(s) => fast::scaled_dot_product_attention_with_sinks(
                            &q,
                            &keys,
                            &values,
                            scale,
                            mask.as_attention(),
                            s,
                        ),
                        None => fast::scaled_dot_product_attention(&q, &keys, &values, scale, mask.as_attention()),
                    };
                    (attend(Some(&sinks)).unwrap(), attend(None).unwrap())
                });
                let diff = max_abs_diff(&got, &want);
                assert!(diff <= tolerance, "{what}: attention differs by {diff}");
                assert!(max_abs_diff(&got, &plain) > 0.1, "{what}: the sinks change little");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, if cuda { 2 * 2 * 40 } else { 0 });
}

/// Gemma 2's step: each scaled score soft-capped (`cap · tanh(s / cap)`) before the softmax,
/// against the same step composed on the CPU (the cache updated, `models::softcapped_attention`):
/// over an unbounded cache and a ring of 16 slots, past the ring's length, heads of 256 as Gemma
/// 2's, in float32 and bfloat16. Queries scaled so that scores reach beyond the cap: it changes
/// the result (by more than 0.05 somewhere at every step from the third).
#[test]
fn soft_capped_scores_attend_as_the_composed_step() {
    let cuda = fast::gpu_backend() == Some(GpuBackend::Cuda);
    let device = if cuda { Device::gpu() } else { Device::cpu() };
    let (hq, hkv, d, cap) = (8, 4, 256, 5.0f32);
    let scale = 1.0 / (d as f32).sqrt();
    let mut checked = 0;
    for (dtype, tolerance) in [(Dtype::Float32, 2e-5), (Dtype::Bfloat16, 5e-2)] {
        for window in [None, Some(16)] {
            let cache =
                || window.map_or_else(|| KvCache::Standard(StandardCache::default()), |w| KvCache::rotating(w, 0));
            let (mut fused, mut composed) = (cache(), cache());
            for position in 0..40usize {
                let what = format!("{dtype:?}, window {window:?}, position {position}");
                let seed = 500 + position as u64;
                let q = (normal(&[1, hq, 1, d], seed) * 8.0).unwrap().astype(dtype).unwrap();
                let k = normal(&[1, hkv, 1, d], seed + 1000).astype(dtype).unwrap();
                let v = normal(&[1, hkv, 1, d], seed + 2000).astype(dtype).unwrap();
                let step = StepHeads::Ready { q: &q, k: &k, v: &v };
                let scores = Scores { softcap: Some(cap), sinks: None };
                let got = rmlx::with_device(device, || {
                    crate::nn::cuda_attention::kv_cache_attention(&step, &mut fused, scale, scores).unwrap()
                });
                let Some(got) = got else {
                    assert!(!cuda, "{what}: declined on MLX's CUDA backend");
                    return;
                };
                let (want, plain) = rmlx::with_device(Device::cpu(), || {
                    let (keys, values, mask) = composed.update(&k, &v).unwrap();
                    let capped = crate::models::softcapped_attention(&q, &keys, &values, scale, cap, &mask).unwrap();
                    let plain = fast::scaled_dot_product_attention(&q, &keys, &values, scale, mask.as_attention());
                    (capped.astype(dtype).unwrap(), plain.unwrap())
                });
                let diff = max_abs_diff(&got, &want);
                assert!(diff <= tolerance, "{what}: attention differs by {diff}");
                // (One key takes all the weight, capped or not.)
                assert!(position < 2 || max_abs_diff(&got, &plain) > 0.05, "{what}: the cap changes little");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, if cuda { 2 * 2 * 40 } else { 0 });
}
