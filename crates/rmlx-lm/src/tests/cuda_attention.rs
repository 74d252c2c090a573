//! The decoding step's cache write and attention as one launch (`nn::cuda_attention`), against
//! MLX's composition (a slice update of each buffer, then `fast::scaled_dot_product_attention` over
//! the valid positions): float32 within float32 rounding, the half types within a rounding or
//! two; grouped heads, head sizes 64, 96, 128 and 256, one chunk of positions or many (the new
//! position first, last or inside one), two sequences at one position or one each. The buffers
//! are the caller's and written in place: the arrays passed in hold the new position afterwards
//! and nothing else changed. Where MLX has no CUDA backend the launch must decline.

use crate::cache::Offset;
use crate::nn::cuda_attention::cache_attention;
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
            let got = cache_attention(&q, &k, &v, (&keys, &values), &pos, scale).unwrap();
            let Some([attention, new_keys, new_values]) = got else {
                assert!(!cuda, "{what}: declined on MLX's CUDA backend");
                continue;
            };
            assert!(cuda, "{what}: served without MLX's CUDA backend");
            assert!(new_keys.to_vec_f32().unwrap() == keys_want, "{what}: keys written at the position alone");
            assert!(new_values.to_vec_f32().unwrap() == values_want, "{what}: values written at the position alone");
            assert!(keys.to_vec_f32().unwrap() == keys_want, "{what}: the keys' buffer updated in place");
            assert!(values.to_vec_f32().unwrap() == values_want, "{what}: the values' buffer updated in place");
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
    });
}
