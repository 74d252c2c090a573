//! The attention of a few queries made of plain products (`models::few_query_attention`, what a
//! speculative verification pass uses on a GPU) against MLX's fused attention: causal, no mask,
//! and an explicit window mask; grouped query heads; float32 and bfloat16.

use crate::cache::Mask;
use rmlx::fast::{self, AttentionMask};
use rmlx::{random, Array, Dtype};

fn heads(shape: &[i32], seed: u64, dtype: Dtype) -> Array {
    let key = random::key(seed).unwrap();
    random::normal(shape, Dtype::Float32, 0.0, 1.0, Some(&key)).unwrap().astype(dtype).unwrap()
}

fn max_diff(a: &Array, b: &Array) -> f32 {
    let d = (a.astype(Dtype::Float32).unwrap() - b.astype(Dtype::Float32).unwrap()).unwrap().abs().unwrap();
    d.max(rmlx::Axes::All, false).unwrap().item::<f32>().unwrap()
}

#[test]
fn matches_fused_attention() {
    for (dtype, tol) in [(Dtype::Float32, 2e-5), (Dtype::Bfloat16, 3e-2)] {
        for (l, k) in [(2, 2), (3, 40), (5, 513), (16, 300)] {
            let q = heads(&[1, 8, l, 64], 1, dtype);
            let keys = heads(&[1, 2, k, 64], 2, dtype);
            let values = heads(&[1, 2, k, 64], 3, dtype);
            let scale = 0.125;
            let window = {
                // each query sees its last 7 keys
                let key = rmlx::ops::arange(0.0, k as f64, 1.0, Dtype::Int32).unwrap().reshape(&[1, k]).unwrap();
                let last =
                    rmlx::ops::arange((k - l) as f64, k as f64, 1.0, Dtype::Int32).unwrap().reshape(&[l, 1]).unwrap();
                let seen = key.less_equal(&last).unwrap();
                let recent = key.greater(&(last - 7i32).unwrap()).unwrap();
                rmlx::ops::logical_and(&seen, &recent).unwrap()
            };
            for (name, mask, fused) in [
                ("causal", Mask::Causal, AttentionMask::Causal),
                ("none", Mask::None, AttentionMask::None),
                ("window", Mask::Array(window.clone()), AttentionMask::Array(&window)),
            ] {
                let got = crate::models::few_query_attention(&q, &keys, &values, scale, &mask).unwrap();
                let want = fast::scaled_dot_product_attention(&q, &keys, &values, scale, fused).unwrap();
                assert_eq!(got.shape(), want.shape());
                let d = max_diff(&got, &want);
                assert!(d < tol, "{dtype:?} L={l} K={k} {name}: {d}");
            }
        }
    }
}
