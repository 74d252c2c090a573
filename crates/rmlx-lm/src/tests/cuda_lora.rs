//! The LoRA branch's kernels (`nn::cuda_lora::lora_add`) against the composed branch
//! `base + s · (x A) B` computed by MLX on the CPU, forward and gradient (for the base, the input
//! and both factors), plain, inside a compiled function and through a training layer
//! (`Lora::add_to`): float32 within float32 rounding, the half types within their rounding; odd
//! sizes (rows, features and ranks that fill no block or warp), ranks 1 to 64, inputs of three
//! axes. Where MLX has no CUDA backend (the CPU CI) the kernels must decline.

use crate::nn::cuda_lora::{lora_add, MAX_RANK};
use crate::nn::{with_training, Lora};
use rmlx::fast::{self, GpuBackend};
use rmlx::{random, transforms, Array, Axes, Device, Dtype};

fn cuda() -> bool {
    fast::gpu_backend() == Some(GpuBackend::Cuda)
}

/// `|a - b|` at its largest over `|b|` at its largest (float32).
fn relative_error(a: &Array, b: &Array) -> f32 {
    let (a, b) = (a.astype(Dtype::Float32).unwrap(), b.astype(Dtype::Float32).unwrap());
    let d = (&a - &b).unwrap().abs().unwrap().max(Axes::All, false).unwrap().item::<f32>().unwrap();
    let m = b.abs().unwrap().max(Axes::All, false).unwrap().item::<f32>().unwrap();
    d / m.max(1e-30)
}

/// The composed branch in float32 on the CPU.
fn composed(p: &[Array], scale: f32) -> rmlx::Result<Vec<Array>> {
    let f32 = |a: &Array| a.astype(Dtype::Float32);
    let (base, x, a, b) = (f32(&p[0])?, f32(&p[1])?, f32(&p[2])?, f32(&p[3])?);
    Ok(vec![(&base + &(&x.matmul(&a)?.matmul(&b)? * scale)?)?])
}

fn on_cpu(arrays: &[Array]) -> Vec<Array> {
    let copy: Vec<Array> = arrays.iter().map(|a| a.astype(Dtype::Float32).unwrap()).collect();
    rmlx::eval(&copy).unwrap();
    copy
}

#[test]
fn the_branch_and_its_gradient_match_the_composed_one_on_cuda_and_decline_elsewhere() {
    let cuda = cuda();
    let device = if cuda { Device::gpu() } else { rmlx::default_device() };
    let mut checked = 0;
    // (leading axes of x, k, m, r)
    let shapes: [(&[i32], i32, i32, i32); 6] = [
        (&[37], 100, 70, 5),
        (&[300], 256, 512, 8),
        (&[2, 33], 96, 200, 16),
        (&[1], 64, 32, 1),
        (&[130], 1024, 48, MAX_RANK),
        (&[4, 416], 1024, 2048, 8),
    ];
    for (i, &(lead, k, m, r)) in shapes.iter().enumerate() {
        let key = |j: u64| random::key(100 * i as u64 + j).unwrap();
        let with = |last: i32| [lead, &[last]].concat();
        let x = random::normal(&with(k), Dtype::Float32, 0.0, 1.0, Some(&key(1))).unwrap();
        let base = random::normal(&with(m), Dtype::Float32, 0.0, 1.0, Some(&key(2))).unwrap();
        let a = random::normal(&[k, r], Dtype::Float32, 0.0, 1.0 / (k as f32).sqrt(), Some(&key(3))).unwrap();
        let b = random::normal(&[r, m], Dtype::Float32, 0.0, 0.5, Some(&key(4))).unwrap();
        let g = random::normal(&with(m), Dtype::Float32, 0.0, 1.0, Some(&key(5))).unwrap();
        let scale = 2.5;
        for (dtype, tol) in [(Dtype::Float32, 2e-5), (Dtype::Bfloat16, 2e-2), (Dtype::Float16, 4e-3)] {
            let what = format!("{lead:?}×{k} → {m}, rank {r}, {dtype:?}");
            let inputs: Vec<Array> = [&base, &x, &a, &b].iter().map(|t| t.astype(dtype).unwrap()).collect();
            let g = g.astype(dtype).unwrap();
            // The reference from the rounded inputs, in float32 on the CPU.
            let (want, want_grads) = rmlx::with_device(Device::cpu(), || {
                let (p, c) = (on_cpu(&inputs), on_cpu(std::slice::from_ref(&g)));
                let (out, grads) = transforms::vjp(|p| composed(p, scale), &p, &c).unwrap();
                (out[0].clone(), grads)
            });
            rmlx::with_device(device, || {
                let fused = move |p: &[Array]| -> rmlx::Result<Vec<Array>> {
                    Ok(vec![lora_add(&p[0], &p[1], &p[2], &p[3], scale).unwrap().expect("served")])
                };
                if !cuda {
                    let got = lora_add(&inputs[0], &inputs[1], &inputs[2], &inputs[3], scale).unwrap();
                    assert!(got.is_none(), "{what}: the kernels ran without CUDA");
                    return;
                }
                let (out, grads) = transforms::vjp(fused, &inputs, std::slice::from_ref(&g)).unwrap();
                assert_eq!((out[0].shape(), out[0].dtype()), (base.shape(), dtype), "{what}");
                let err = relative_error(&out[0], &want);
                assert!(err <= tol, "{what}: output off by {err}");
                for (name, got, want) in
                    ["base", "x", "a", "b"].iter().zip(&grads).zip(&want_grads).map(|((n, g), w)| (n, g, w))
                {
                    assert_eq!((got.shape(), got.dtype()), (want.shape(), dtype), "{what}: ∂{name}");
                    let err = relative_error(got, want);
                    assert!(err <= tol, "{what}: ∂{name} off by {err}");
                }
                // Compiled (as the training step is), the same values.
                let compiled = rmlx::compile::compile(move |p: &[Array]| {
                    let (out, grads) = transforms::vjp(fused, &p[..4], &p[4..])?;
                    Ok([out, grads].concat())
                });
                let all = compiled.call(&[inputs.clone(), vec![g.clone()]].concat()).unwrap();
                assert_eq!(relative_error(&all[0], &out[0]), 0.0, "{what}: compiled output");
                for (c, e) in all[1..].iter().zip(&grads) {
                    assert_eq!(relative_error(c, e), 0.0, "{what}: compiled gradient");
                }
                checked += 1;
            });
        }
    }
    assert_eq!(checked, if cuda { 18 } else { 0 });
    if !cuda {
        return;
    }
    rmlx::with_device(Device::gpu(), || {
        let x = Array::from_slice(&[0.5f32; 6 * 8], &[6, 8]).unwrap();
        let base = Array::from_slice(&[0.0f32; 6 * 4], &[6, 4]).unwrap();
        let wide = Array::from_slice(&vec![0.1f32; 8 * 65], &[8, 65]).unwrap();
        let b65 = Array::from_slice(&vec![0.1f32; 65 * 4], &[65, 4]).unwrap();
        assert!(lora_add(&base, &x, &wide, &b65, 1.0).unwrap().is_none(), "rank above MAX_RANK");
        let a = Array::from_slice(&[0.1f32; 8 * 2], &[8, 2]).unwrap();
        let b = Array::from_slice(&[0.1f32; 2 * 4], &[2, 4]).unwrap();
        let half = base.astype(Dtype::Bfloat16).unwrap();
        assert!(lora_add(&half, &x, &a, &b, 1.0).unwrap().is_none(), "mixed dtypes");
        assert!(lora_add(&base, &x, &b, &a, 1.0).unwrap().is_none(), "factors that do not match");
    });
}

/// A training layer's branch (`Lora::add_to`) with `kernels` takes the kernels on CUDA (and
/// without, or outside training, the composed branch) and gives the composed branch's values and
/// factor gradients (float32 factors cast to the bfloat16 activations, as in
/// training).
#[test]
fn a_training_layer_takes_the_kernels_with_the_composed_values() {
    if !cuda() {
        return;
    }
    rmlx::with_device(Device::gpu(), || {
        let key = |j: u64| random::key(900 + j).unwrap();
        let mut lora = Lora::init(192, 320, 8, 2.0, Dtype::Float32, Some(&key(0))).unwrap();
        lora.kernels = true;
        lora.b = random::normal(&[8, 320], Dtype::Float32, 0.0, 0.2, Some(&key(1))).unwrap();
        let x = random::normal(&[3, 50, 192], Dtype::Bfloat16, 0.0, 1.0, Some(&key(2))).unwrap();
        let y = random::normal(&[3, 50, 320], Dtype::Bfloat16, 0.0, 1.0, Some(&key(3))).unwrap();
        let loss = |lora: &Lora, train: bool| {
            let lora = lora.clone();
            let (x, y) = (x.clone(), y.clone());
            move |p: &[Array]| -> rmlx::Result<Vec<Array>> {
                let l = Lora { a: p[0].clone(), b: p[1].clone(), ..lora.clone() };
                let run = || -> rmlx::Result<Array> {
                    let out = l.add_to(&y, &x).map_err(|e| rmlx::Error::InvalidArgument(e.to_string()))?;
                    (&out * &out)?.astype(Dtype::Float32)?.sum(Axes::All, false)
                };
                Ok(vec![if train { with_training(run)? } else { run()? }])
            }
        };
        let census = |train: bool| {
            let out = loss(&lora, train)(&[lora.a.clone(), lora.b.clone()]).unwrap();
            rmlx::graph_census(&out).unwrap()
        };
        assert!(census(true).contains_key("rmlx_lora_forward"), "{:?}", census(true));
        assert!(!census(false).contains_key("rmlx_lora_forward"));
        let off = Lora { kernels: false, ..lora.clone() };
        let out = loss(&off, true)(&[lora.a.clone(), lora.b.clone()]).unwrap();
        assert!(!rmlx::graph_census(&out).unwrap().contains_key("rmlx_lora_forward"), "kernels off");
        let grads = |train: bool| {
            transforms::value_and_grad(loss(&lora, train), &[0, 1])(&[lora.a.clone(), lora.b.clone()]).unwrap()
        };
        let ((v1, g1), (v0, g0)) = (grads(true), grads(false));
        assert!(relative_error(&v1[0], &v0[0]) < 1e-2, "loss");
        for (name, a, b) in [("a", &g1[0], &g0[0]), ("b", &g1[1], &g0[1])] {
            assert_eq!(a.dtype(), Dtype::Float32, "∂{name} in the factor's dtype");
            let err = relative_error(a, b);
            assert!(err < 3e-2, "∂{name} off by {err}");
        }
    });
}
