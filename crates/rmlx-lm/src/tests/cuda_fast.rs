//! The CUDA kernel that turns a stacked q/k/v product into normalised, rotated heads
//! (`nn::cuda_fast::qkv_heads`), against MLX's own split, `fast::rms_norm` and `fast::rope`: float32
//! within float32 rounding, the half types within a rounding or two; with and without q/k norms,
//! head sizes 16, 64, 128, 160 and 256 (a block of whole warps, some threads idle), grouped heads, one position for all sequences or one per sequence,
//! explicit divisors and a position scale. Where MLX has no CUDA backend (the CPU CI) the kernel must
//! decline, and the composed path runs. Also the post-norm's residual kernel (`norm_add`).

use crate::cache::Offset;
use crate::nn::cuda_fast::{qkv_heads, HeadNorms, Rotation};
use rmlx::fast::{self, GpuBackend, RopeFreqs};
use rmlx::{ops, random, Array, Dtype};

fn max_abs_diff(a: &Array, b: &Array) -> f32 {
    let d = (a.astype(Dtype::Float32).unwrap() - b.astype(Dtype::Float32).unwrap()).unwrap();
    d.abs().unwrap().max(rmlx::Axes::All, false).unwrap().item::<f32>().unwrap()
}

/// MLX's composition: split, normalise, rotate (each sequence `b` at `positions[b]`).
fn reference(
    y: &Array,
    (heads, kv, d): (i32, i32, i32),
    norms: Option<(&Array, &Array, f32)>,
    divisors: &Array,
    scale: f32,
    positions: &[i32],
) -> [Array; 3] {
    let b = y.shape()[0];
    let all = y.reshape(&[b, heads + 2 * kv, 1, d]).unwrap();
    let parts = ops::split_at(&all, &[heads, heads + kv], 1).unwrap();
    let (mut q, mut k, v) = (parts[0].clone(), parts[1].clone(), parts[2].clone());
    if let Some((qw, kw, eps)) = norms {
        q = fast::rms_norm(&q, Some(qw), eps).unwrap();
        k = fast::rms_norm(&k, Some(kw), eps).unwrap();
    }
    let rotate = |t: &Array| -> Array {
        let rows: Vec<Array> = (0..b)
            .map(|i| {
                let row = ops::slice(t, &[i, 0, 0, 0], &[i + 1, t.shape()[1], 1, d], &[1, 1, 1, 1]).unwrap();
                let p = positions[if positions.len() > 1 { i as usize } else { 0 }];
                fast::rope(&row, d, false, RopeFreqs::Explicit(divisors), scale, p).unwrap()
            })
            .collect();
        ops::concatenate(&rows.iter().collect::<Vec<_>>(), 0).unwrap()
    };
    [rotate(&q), rotate(&k), v]
}

#[test]
fn stacked_heads_match_mlx_on_cuda_and_decline_elsewhere() {
    let cuda = fast::gpu_backend() == Some(GpuBackend::Cuda);
    let device = if cuda { rmlx::Device::gpu() } else { rmlx::default_device() };
    rmlx::with_device(device, || {
        let mut checked = 0;
        for (heads, kv, d) in [(16, 8, 128), (32, 8, 64), (4, 1, 256), (4, 2, 16), (2, 1, 160)] {
            let batch = 3;
            let width = (heads + 2 * kv) * d;
            let y = random::normal(&[batch, width], Dtype::Float32, 0.0, 2.0, Some(&random::key(d as u64).unwrap()))
                .unwrap();
            let qw = random::normal(&[d], Dtype::Float32, 1.0, 0.3, Some(&random::key(1).unwrap())).unwrap();
            let kw = random::normal(&[d], Dtype::Float32, 1.0, 0.3, Some(&random::key(2).unwrap())).unwrap();
            let divisors: Vec<f32> =
                (0..d / 2).map(|i| 1e6f32.powf(2.0 * i as f32 / d as f32) * (1.0 + 0.1 * i as f32)).collect();
            let divisors = Array::from_slice(&divisors, &[d / 2]).unwrap();
            for (dtype, tol) in [(Dtype::Float32, 1e-4), (Dtype::Bfloat16, 0.1), (Dtype::Float16, 0.02)] {
                let (y, qw, kw) = (y.astype(dtype).unwrap(), qw.astype(dtype).unwrap(), kw.astype(dtype).unwrap());
                for norm in [true, false] {
                    for positions in [vec![4093], vec![0, 17, 40000]] {
                        let scale = if positions.len() > 1 { 0.5 } else { 1.0 };
                        let offset = match positions[..] {
                            [p] => Offset::Uniform(p as usize),
                            _ => Offset::PerRow(Array::from_slice(&positions, &[positions.len() as i32]).unwrap()),
                        };
                        let rotation = Rotation { divisors: &divisors, scale, offset: &offset, factor: 1.0 };
                        let norms = norm.then_some(HeadNorms { query: &qw, key: &kw, eps: 1e-6 });
                        let got = qkv_heads(&y, batch, (heads, kv, d), norms, &rotation).unwrap();
                        let Some(got) = got else {
                            assert!(!cuda, "the kernel declined on CUDA: {heads}/{kv}×{d} {dtype:?}");
                            continue;
                        };
                        assert!(cuda, "the kernel ran without CUDA");
                        let norms = norm.then_some((&qw, &kw, 1e-6));
                        let want = reference(&y, (heads, kv, d), norms, &divisors, scale, &positions);
                        for (name, g, w) in
                            [("q", &got[0], &want[0]), ("k", &got[1], &want[1]), ("v", &got[2], &want[2])]
                        {
                            assert_eq!((g.shape(), g.dtype()), (w.shape(), dtype), "{name}");
                            let err = max_abs_diff(g, w);
                            // An angle θ is known to about θ·2⁻²⁴ in float32, and MLX's base-free
                            // frequencies may round differently from these: values of a few units
                            // then differ by a few θ·2⁻²⁴.
                            let angle = *positions.iter().max().unwrap() as f32 * scale;
                            let tol = if name == "v" { 0.0 } else { tol + 8.0 * angle * f32::EPSILON / 2.0 };
                            assert!(
                                err <= tol,
                                "{name}, {heads}/{kv}×{d} {dtype:?}, norm {norm}, positions {positions:?}: off by {err}"
                            );
                        }
                        checked += 1;
                    }
                }
            }
        }
        assert_eq!(checked, if cuda { 60 } else { 0 });
        // An odd head size, and more than one position per sequence: declined.
        let y = Array::from_slice(&vec![0.5f32; 2 * 3 * 33], &[2, 3 * 33]).unwrap();
        let div = Array::from_slice(&[1.0f32; 16], &[16]).unwrap();
        let offset = Offset::Uniform(1);
        let rotation = Rotation { divisors: &div, scale: 1.0, offset: &offset, factor: 1.0 };
        assert!(qkv_heads(&y, 2, (1, 1, 33), None, &rotation).unwrap().is_none());
        let y = Array::from_slice(&vec![0.5f32; 4 * 3 * 64], &[4, 3 * 64]).unwrap();
        let div = Array::from_slice(&[1.0f32; 32], &[32]).unwrap();
        let rotation = Rotation { divisors: &div, scale: 1.0, offset: &offset, factor: 1.0 };
        assert!(qkv_heads(&y, 2, (1, 1, 64), None, &rotation).unwrap().is_none(), "two positions per sequence");
    })
}

/// `residual + rms_norm(a) · w` in one kernel (`nn::cuda_fast::norm_add`, Gemma's post-norms)
/// against MLX's `fast::rms_norm` and addition: float32 within float32 rounding, the half types
/// within a rounding of the sum; widths below, at and above a block's threads, one row and
/// several. Off MLX's CUDA backend it declines.
#[test]
fn norm_add_matches_mlx_on_cuda_and_declines_elsewhere() {
    let cuda = fast::gpu_backend() == Some(GpuBackend::Cuda);
    let device = if cuda { rmlx::Device::gpu() } else { rmlx::default_device() };
    rmlx::with_device(device, || {
        let mut checked = 0;
        for (rows, dim) in [(1, 64), (1, 1152), (3, 2560), (8, 100), (1, 5376)] {
            for dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
                let normal = |shape: &[i32], mean: f32, seed: u64| {
                    random::normal(shape, Dtype::Float32, mean, 1.0, Some(&random::key(seed).unwrap()))
                        .unwrap()
                        .astype(dtype)
                        .unwrap()
                };
                let (a, res, w) = (normal(&[rows, dim], 0.0, 1), normal(&[rows, dim], 0.0, 2), normal(&[dim], 1.0, 3));
                let got = crate::nn::cuda_fast::norm_add(&a, &w, 1e-6, &res).unwrap();
                let Some(got) = got else {
                    assert!(!cuda, "declined on MLX's CUDA backend");
                    return;
                };
                assert!(cuda, "served without MLX's CUDA backend");
                let want = (&res + fast::rms_norm(&a, Some(&w), 1e-6).unwrap()).unwrap();
                assert_eq!((got.shape(), got.dtype()), (want.shape(), dtype));
                // Relative to the value (plus one): a rounding of the norm's output and one of the sum.
                let tolerance = match dtype {
                    Dtype::Float32 => 1e-5,
                    Dtype::Bfloat16 => 2.0 / 128.0,
                    _ => 2.0 / 1024.0,
                };
                let f32s = |x: &Array| x.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
                let diff = f32s(&got)
                    .iter()
                    .zip(f32s(&want))
                    .map(|(g, w)| (g - w).abs() / (w.abs() + 1.0))
                    .fold(0.0, f32::max);
                assert!(diff <= tolerance, "{rows}×{dim} {dtype:?}: differs by {diff} of the value");
                checked += 1;
            }
        }
        assert_eq!(checked, 15);
    });
}
