//! The routed feed-forward's kernels (`nn::cuda_moe`, through `SparseMoe::forward_residual`)
//! against MLX's composed feed-forward (`h + moe(norm(h))`: softmax, argpartition, gathered
//! products) computed on the CPU (on the GPU, MLX's gathered products of several rows run as TF32:
//! 1.4e-4 off in float32): float32 and bfloat16; 4-bit, 8-bit and dense experts; 1, 3 and 8 rows;
//! renormalised or not; expert counts and widths that leave partial blocks. Router weights spread
//! the logits so that no two of a row's top experts tie in bfloat16 (with a tie, either choice is
//! right and the two paths may differ). And what the kernels leave to MLX: expert adapters,
//! training, more than 8 rows, and everything off MLX's CUDA backend (the CPU CI), where
//! `forward_residual` is the composed feed-forward bit for bit.

use crate::nn::{with_training, Builder, ExpertNames, Module, RmsNorm, SparseMoe, SwitchLora};
use crate::weights::{Weight, Weights};
use rmlx::fast::{self, GpuBackend};
use rmlx::quantization::{quantize, QuantMode};
use rmlx::{random, Array, Axes, Device, Dtype};

fn cuda() -> bool {
    fast::gpu_backend() == Some(GpuBackend::Cuda)
}

fn normal(shape: &[i32], std: f32, seed: u64) -> Array {
    random::normal(shape, Dtype::Float32, 0.0, std, Some(&random::key(seed).unwrap())).unwrap()
}

const NAMES: ExpertNames = ExpertNames {
    router: "gate",
    experts: "experts",
    projections: ["gate_proj", "up_proj", "down_proj"],
    ..ExpertNames::SWITCH_MLP
};

/// A routed feed-forward of `experts` experts `hidden → width → hidden` (`bits`: quantised
/// experts, in groups of 64; `None`: dense), `top_k` chosen, in `dtype`.
fn sparse_moe(
    dtype: Dtype,
    bits: Option<i32>,
    (experts, top_k): (i32, i32),
    (hidden, width): (i32, i32),
    renorm: bool,
) -> SparseMoe {
    let mut w = Weights::new();
    // Logits of a few units' spread: the top experts' probabilities far apart.
    w.insert("m.gate.weight", Weight::Dense(normal(&[experts, hidden], 3.0 / (hidden as f32).sqrt(), 1)));
    for (i, (name, shape)) in [
        ("gate_proj", [experts, width, hidden]),
        ("up_proj", [experts, width, hidden]),
        ("down_proj", [experts, hidden, width]),
    ]
    .into_iter()
    .enumerate()
    {
        let m = normal(&shape, 1.0 / (shape[2] as f32).sqrt(), 2 + i as u64);
        let weight = match bits {
            Some(b) => Weight::Quantized(quantize(&m, 64, b, QuantMode::Affine).unwrap()),
            None => Weight::Dense(m),
        };
        w.insert(format!("m.switch_mlp.{name}.weight"), weight);
    }
    let mut b = Builder::new(w, dtype, false);
    SparseMoe::load(&mut b, "m", &NAMES, (hidden, width), (experts, top_k), renorm).unwrap()
}

/// `max |a − b|` over `max |b|`, in float32.
fn relative_error(a: &Array, b: &Array) -> f32 {
    let (a, b) = (a.astype(Dtype::Float32).unwrap(), b.astype(Dtype::Float32).unwrap());
    let d = (&a - &b).unwrap().abs().unwrap().max(Axes::All, false).unwrap().item::<f32>().unwrap();
    d / b.abs().unwrap().max(Axes::All, false).unwrap().item::<f32>().unwrap().max(1e-30)
}

fn composed(moe: &SparseMoe, h: &Array, norm: &RmsNorm) -> Array {
    (h + moe.forward(&norm.forward(h).unwrap()).unwrap()).unwrap()
}

#[test]
fn the_kernels_match_the_composed_feed_forward_on_cuda_and_decline_elsewhere() {
    let mut checked = 0;
    for (dtype, tolerance) in [(Dtype::Float32, 1e-5), (Dtype::Bfloat16, 4e-2)] {
        for bits in [Some(4), Some(8), None] {
            for (shape, counts, renorm) in
                [((256, 128), (16, 4), true), ((512, 192), (128, 8), true), ((320, 64), (40, 3), false)]
            {
                let moe = sparse_moe(dtype, bits, counts, shape, renorm);
                let norm = RmsNorm::new((normal(&[shape.0], 0.2, 7) + 1.0).unwrap().astype(dtype).unwrap(), 1e-6);
                for rows in [1, 3, 8] {
                    let h = normal(&[rows, shape.0], 1.0, 10 + rows as u64).astype(dtype).unwrap();
                    let want = rmlx::with_device(Device::cpu(), || composed(&moe, &h, &norm));
                    let got = moe.forward_residual(&h, &norm).unwrap();
                    assert_eq!((got.shape(), got.dtype()), (want.shape(), want.dtype()));
                    let err = relative_error(&got, &want);
                    let case = format!("{dtype:?} bits {bits:?} {shape:?} {counts:?} rows {rows}");
                    if cuda() {
                        assert!(err <= tolerance, "{case}: relative error {err} > {tolerance}");
                        checked += 1;
                    } else {
                        assert_eq!(err, 0.0, "{case}: off CUDA the feed-forward is the composed one");
                    }
                }
            }
        }
    }
    if cuda() {
        assert_eq!(checked, 54);
    }
}

#[test]
fn adapters_training_and_many_rows_take_the_composed_path() {
    let moe = sparse_moe(Dtype::Float32, Some(4), (16, 4), (256, 128), true);
    let norm = RmsNorm::new(rmlx::ops::ones(&[256], Dtype::Float32).unwrap(), 1e-6);
    // Nine rows: more than the kernels take.
    let h = normal(&[9, 256], 1.0, 3);
    assert_eq!(relative_error(&moe.forward_residual(&h, &norm).unwrap(), &composed(&moe, &h, &norm)), 0.0);
    let h = normal(&[2, 256], 1.0, 4);
    let trained = with_training(|| moe.forward_residual(&h, &norm).unwrap());
    assert_eq!(relative_error(&trained, &with_training(|| composed(&moe, &h, &norm))), 0.0);
    // An adapter on every expert's down projection: the kernels would leave it out.
    let mut adapted = moe.clone();
    let mut attached = 0;
    adapted.visit_switches("", &mut |name, layer| {
        if name.ends_with("down_proj") {
            let lora = SwitchLora::init(16, 128, 256, 4, 2.0, Dtype::Float32, Some(&random::key(5).unwrap())).unwrap();
            let lora = SwitchLora { b: normal(&[16, 256, 4], 0.5, 6), ..lora };
            layer.set_lora(Some(lora)).unwrap();
            attached += 1;
        }
    });
    assert_eq!(attached, 1);
    let with_adapter = adapted.forward_residual(&h, &norm).unwrap();
    assert_eq!(relative_error(&with_adapter, &composed(&adapted, &h, &norm)), 0.0);
    assert!(relative_error(&with_adapter, &composed(&moe, &h, &norm)) > 1e-3, "the adapter changes the output");
}
