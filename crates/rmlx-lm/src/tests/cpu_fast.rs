//! The CPU RMSNorm and RoPE primitives against MLX's own `fast::rms_norm` and `fast::rope` (which
//! MLX's CPU backend composes from small operations): float32 within float32 rounding, the half
//! types within one rounding; uniform and per-row offsets, explicit divisors, a position scale and
//! rotating fewer features than the head has. And where they stay out: training.

use crate::nn::{cpu_fast, with_training};
use rmlx::fast::{self, RopeFreqs};
use rmlx::{random, Array, Dtype};

fn max_abs_diff(a: &Array, b: &Array) -> f32 {
    let d = (a.astype(Dtype::Float32).unwrap() - b.astype(Dtype::Float32).unwrap()).unwrap();
    d.abs().unwrap().max(rmlx::Axes::All, false).unwrap().item::<f32>().unwrap()
}

#[test]
fn rms_norm_matches_mlx() {
    rmlx::with_device(rmlx::Device::cpu(), || {
        let key = random::key(3).unwrap();
        let x = random::normal(&[2, 5, 96], Dtype::Float32, 0.0, 3.0, Some(&key)).unwrap();
        let w = random::normal(&[96], Dtype::Float32, 1.0, 0.2, Some(&random::key(4).unwrap())).unwrap();
        for (dtype, tol) in [(Dtype::Float32, 1e-5), (Dtype::Bfloat16, 0.05), (Dtype::Float16, 0.01)] {
            let (x, w) = (x.astype(dtype).unwrap(), w.astype(dtype).unwrap());
            let got = cpu_fast::rms_norm(&x, &w, 1e-5).unwrap();
            let want = fast::rms_norm(&x, Some(&w), 1e-5).unwrap();
            assert_eq!((got.shape(), got.dtype()), (want.shape(), dtype));
            let err = max_abs_diff(&got, &want);
            assert!(err <= tol, "{dtype:?}: off by {err}");
        }
        let bad = cpu_fast::rms_norm(&x, &Array::from_slice(&[1.0f32; 8], &[8]).unwrap(), 1e-5);
        assert!(
            matches!(bad, Err(rmlx::Error::InvalidArgument(ref m)) if m.contains("does not fit")),
            "{:?}",
            bad.err()
        );
    })
}

#[test]
fn rope_matches_mlx() {
    rmlx::with_device(rmlx::Device::cpu(), || {
        let key = random::key(5).unwrap();
        // [B=2, H=3, L=4, D=16]; 12 of the 16 features rotated in one case.
        let x = random::normal(&[2, 3, 4, 16], Dtype::Float32, 0.0, 1.0, Some(&key)).unwrap();
        let divisors: Vec<f32> =
            (0..8).map(|i| 10000f32.powf(2.0 * i as f32 / 16.0) * (1.0 + i as f32 * 0.3)).collect();
        let divisors = Array::from_slice(&divisors, &[8]).unwrap();
        for (dtype, tol) in [(Dtype::Float32, 2e-5), (Dtype::Bfloat16, 0.04), (Dtype::Float16, 0.005)] {
            let x = x.astype(dtype).unwrap();
            for (dims, scale) in [(16, 1.0), (12, 0.25)] {
                // One offset for every row.
                let got = cpu_fast::rope(
                    &x,
                    dims,
                    &cpu_fast::base_divisors(10000.0, dims).unwrap(),
                    scale,
                    &Array::from_slice(&[37i32], &[1]).unwrap(),
                )
                .unwrap();
                let want = fast::rope(&x, dims, false, RopeFreqs::Base(10000.0), scale, 37).unwrap();
                assert_eq!((got.shape(), got.dtype()), (want.shape(), dtype));
                let err = max_abs_diff(&got, &want);
                assert!(err <= tol, "{dtype:?}, {dims} dims, scale {scale}: off by {err}");
            }
            // Explicit divisors, one offset per row.
            let offsets = Array::from_slice(&[3i32, 250], &[2]).unwrap();
            let got = cpu_fast::rope(&x, 16, &divisors, 1.0, &offsets).unwrap();
            let want = fast::rope(&x, 16, false, RopeFreqs::Explicit(&divisors), 1.0, &offsets).unwrap();
            let err = max_abs_diff(&got, &want);
            assert!(err <= tol, "{dtype:?}, explicit divisors, per-row offsets: off by {err}");
        }
    })
}

#[test]
fn training_keeps_mlx_operations() {
    rmlx::with_device(rmlx::Device::cpu(), || {
        let x = Array::from_slice(&[1.0f32, 2.0], &[1, 2]).unwrap();
        assert!(cpu_fast::applies(&x));
        with_training(|| assert!(!cpu_fast::applies(&x)));
        assert!(!cpu_fast::applies(&x.astype(Dtype::Int32).unwrap()));
    })
}

/// `cache_attention` of the first `queries` rows of `q` over `valid` positions, and MLX's
/// attention over those positions (causal for more than one query).
fn attention_and_mlx((q, k, v): (&Array, &Array, &Array), queries: i32, valid: usize, scale: f32) -> (Array, Array) {
    let q = q.slice_axis(2, 0, queries, 1).unwrap();
    let got = cpu_fast::cache_attention(&q, k, v, valid, scale).unwrap();
    let (kv, vv) = (k.slice_axis(2, 0, valid as i32, 1).unwrap(), v.slice_axis(2, 0, valid as i32, 1).unwrap());
    let mask = if queries == 1 { fast::AttentionMask::None } else { fast::AttentionMask::Causal };
    (got, fast::scaled_dot_product_attention(&q, &kv, &vv, scale, mask).unwrap())
}

#[test]
fn cache_attention_matches_mlx() {
    rmlx::with_device(rmlx::Device::cpu(), || {
        let key = random::key(9).unwrap();
        // Head sizes with rows of their own (64, 128, 256) and without (16).
        for d in [64, 128, 256] {
            // 6 query heads over 2 key/value heads: a step computes 3 rows together, a prompt of 7
            // positions 4 and 3.
            let q = random::normal(&[1, 6, 7, d], Dtype::Float32, 0.0, 1.0, Some(&key)).unwrap();
            let k = random::normal(&[1, 2, 23, d], Dtype::Float32, 0.0, 1.0, Some(&random::key(10).unwrap())).unwrap();
            let v = random::normal(&[1, 2, 23, d], Dtype::Float32, 0.0, 1.0, Some(&random::key(11).unwrap())).unwrap();
            // A row is computed the same in any company: the prompt's last row is the step's.
            let prompt = cpu_fast::cache_attention(&q, &k, &v, 23, 0.1).unwrap();
            let last = q.slice_axis(2, 6, 7, 1).unwrap();
            let step = cpu_fast::cache_attention(&last, &k, &v, 23, 0.1).unwrap();
            let prompt_last = prompt.slice_axis(2, 6, 7, 1).unwrap().to_vec::<f32>().unwrap();
            assert_eq!(prompt_last, step.to_vec::<f32>().unwrap(), "D = {d}");
            // Four keys at a time and the rest (1, 3, 4, 21 valid positions), a step and a prompt.
            for (queries, valid) in [(1, 1), (1, 3), (1, 4), (1, 21), (5, 5), (7, 23)] {
                let (got, want) = attention_and_mlx((&q, &k, &v), queries, valid, 0.1);
                let err = max_abs_diff(&got, &want);
                assert!(err <= 1e-5, "D = {d}, {queries} queries, {valid} valid: off by {err}");
            }
        }
        // Two sequences, 4 query heads over 2 key/value heads, buffers of 40 positions.
        let q = random::normal(&[2, 4, 7, 16], Dtype::Float32, 0.0, 1.0, Some(&key)).unwrap();
        let k = random::normal(&[2, 2, 40, 16], Dtype::Float32, 0.0, 1.0, Some(&random::key(10).unwrap())).unwrap();
        let v = random::normal(&[2, 2, 40, 16], Dtype::Float32, 0.0, 1.0, Some(&random::key(11).unwrap())).unwrap();
        for (dtype, tol) in [(Dtype::Float32, 1e-5), (Dtype::Bfloat16, 0.02), (Dtype::Float16, 0.004)] {
            let (q, k, v) = (q.astype(dtype).unwrap(), k.astype(dtype).unwrap(), v.astype(dtype).unwrap());
            // One query (a decoding step) over 1, 29 or 40 valid positions, then the last 7 of 7, 29
            // or 40 causally (a prompt, its first chunk or a later one).
            for (queries, valid) in [(1, 1), (1, 29), (1, 40), (7, 7), (7, 29), (7, 40)] {
                let (got, want) = attention_and_mlx((&q, &k, &v), queries, valid, 0.3);
                assert_eq!((got.shape(), got.dtype()), (want.shape(), dtype));
                let err = max_abs_diff(&got, &want);
                assert!(err <= tol, "{dtype:?}, {queries} queries, {valid} valid: off by {err}");
            }
        }
        let one = q.slice_axis(2, 0, 1, 1).unwrap();
        let bad = cpu_fast::cache_attention(&one, &k, &v, 41, 0.3);
        assert!(matches!(bad, Err(rmlx::Error::InvalidArgument(ref m)) if m.contains("41 valid")), "{:?}", bad.err());
        // More queries than valid positions.
        let bad = cpu_fast::cache_attention(&q, &k, &v, 6, 0.3);
        assert!(matches!(bad, Err(rmlx::Error::InvalidArgument(ref m)) if m.contains("6 valid")), "{:?}", bad.err());
    })
}

/// The sampler's log-probabilities: MLX's arithmetic (its `exp`, summed in order) in one
/// primitive, equal to `x - logsumexp(x)` bit for bit on x86-64, including rows with `-inf`
/// (banned tokens) and an all-`-inf` row.
#[test]
fn log_softmax_equals_mlx_bit_for_bit() {
    rmlx::with_device(rmlx::Device::cpu(), || {
        let key = random::key(8).unwrap();
        let x = random::normal(&[3, 49152], Dtype::Float32, 0.0, 4.0, Some(&key)).unwrap();
        let mut values = x.to_vec::<f32>().unwrap();
        values[7] = f32::NEG_INFINITY;
        values[49152..2 * 49152].iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
        values[2 * 49152 + 5] = 95.0;
        let x = Array::from_slice(&values, &[3, 49152]).unwrap();
        let got = cpu_fast::log_softmax(&x).unwrap().to_vec::<f32>().unwrap();
        let want = (&x - x.logsumexp(-1, true).unwrap()).unwrap().to_vec::<f32>().unwrap();
        // MLX sums one value at a time where it has no SIMD type (x86-64); elsewhere its sums may
        // be ordered otherwise, and the results agree within float32 rounding.
        let agree = |a: &f32, b: &f32| {
            let exact = a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
            exact || (!cfg!(target_arch = "x86_64") && (a - b).abs() <= 1e-5 * b.abs().max(1.0))
        };
        let first = got.iter().zip(&want).position(|(a, b)| !agree(a, b));
        assert!(first.is_none(), "differs at {first:?}");
        let bad = cpu_fast::log_softmax(&x.astype(Dtype::Bfloat16).unwrap());
        assert!(matches!(bad, Err(rmlx::Error::InvalidArgument(_))), "{:?}", bad.err());
    })
}
