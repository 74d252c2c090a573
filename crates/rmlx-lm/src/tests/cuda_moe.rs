//! The routed feed-forward's kernels (`nn::cuda_moe`, through `SparseMoe::forward_residual`)
//! against MLX's composed feed-forward (`h + moe(norm(h))`: softmax, argpartition, gathered
//! products) computed on the CPU (on the GPU, MLX's gathered products of several rows run as TF32:
//! 1.4e-4 off in float32): float32 and bfloat16; 4-bit, 8-bit and dense experts; 1, 3 and 8 rows;
//! renormalised or not; expert counts and widths that leave partial blocks; gpt-oss's experts
//! (a bias on the router and on every projection, the clamped SwiGLU). Router weights spread
//! the logits, and rows are drawn so that no row's last chosen expert ties in bfloat16 with the
//! next (with a tie, either choice is right and the two paths may differ). And what the kernels leave to MLX: expert adapters,
//! training, more than 8 rows, and everything off MLX's CUDA backend (the CPU CI), where
//! `forward_residual` is the composed feed-forward bit for bit.

use crate::nn::{with_training, Builder, ExpertActivation, ExpertNames, Module, RmsNorm, SparseMoe, SwitchLora};
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

/// gpt-oss's clamp: gate values past it occur with [`GPT_OSS_BIAS`].
const LIMIT: f32 = 7.0;

/// The spread of the gpt-oss case's gate and up biases: a few of every row's values past the clamp.
const GPT_OSS_BIAS: f32 = 4.0;

/// A routed feed-forward of `experts` experts `hidden → width → hidden` (`bits`: quantised
/// experts, in groups of 64; `None`: dense), `top_k` chosen, in `dtype`; with `gpt_oss`, biases
/// on the router and every projection and the clamped SwiGLU.
fn sparse_moe(
    dtype: Dtype,
    bits: Option<i32>,
    (experts, top_k): (i32, i32),
    (hidden, width): (i32, i32),
    renorm: bool,
    gpt_oss: bool,
) -> SparseMoe {
    let mut w = Weights::new();
    // Logits of a few units' spread: the top experts' probabilities far apart.
    w.insert("m.gate.weight", Weight::Dense(normal(&[experts, hidden], 3.0 / (hidden as f32).sqrt(), 1)));
    if gpt_oss {
        w.insert("m.gate.bias", Weight::Dense(normal(&[experts], 1.0, 8)));
        for (i, (name, out, std)) in
            [("gate_proj", width, GPT_OSS_BIAS), ("up_proj", width, GPT_OSS_BIAS), ("down_proj", hidden, 0.5)]
                .into_iter()
                .enumerate()
        {
            w.insert(format!("m.switch_mlp.{name}.bias"), Weight::Dense(normal(&[experts, out], std, 20 + i as u64)));
        }
    }
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
    let names = match gpt_oss {
        true => ExpertNames {
            biases: true,
            activation: ExpertActivation::ClampedSwiglu { alpha: 1.702, limit: LIMIT },
            ..NAMES
        },
        false => NAMES,
    };
    SparseMoe::load(&mut b, "m", &names, (hidden, width), (experts, top_k), renorm).unwrap()
}

/// `max |a − b|` over `max |b|`, in float32.
fn relative_error(a: &Array, b: &Array) -> f32 {
    let (a, b) = (a.astype(Dtype::Float32).unwrap(), b.astype(Dtype::Float32).unwrap());
    let d = (&a - &b).unwrap().abs().unwrap().max(Axes::All, false).unwrap().item::<f32>().unwrap();
    d / b.abs().unwrap().max(Axes::All, false).unwrap().item::<f32>().unwrap().max(1e-30)
}

/// Rows `[rows, hidden]` of `dtype` drawn from `seed` on: the first draw in which every row's
/// `top_k`-th and next router probabilities (float32, from the router's weights) lie 5 % or more
/// apart, so that bfloat16's roundings (of logits of a few units: up to ~3 % of a probability)
/// cannot swap or tie them. With a tie either choice is right, and the kernels and MLX's
/// `argpartition` may choose differently: a 128-expert case's first draw tied at 0.0354, and
/// MLX's own bfloat16 composition was then 0.049 off its float32 one (0.026 at most over the
/// untied draws).
fn untied_rows(
    moe: &SparseMoe,
    norm: &RmsNorm,
    (rows, hidden): (i32, i32),
    top_k: usize,
    dtype: Dtype,
    seed: u64,
) -> Array {
    let (mut weight, mut bias) = (None, None);
    moe.visit("", &mut |name, _, a| match name {
        "gate.weight" => weight = Some(a.astype(Dtype::Float32).unwrap()),
        "gate.bias" => bias = Some(a.astype(Dtype::Float32).unwrap()),
        _ => {}
    });
    let weight = weight.expect("a dense router").swapaxes(-1, -2).unwrap();
    let norm32 = RmsNorm::new(norm.weight().astype(Dtype::Float32).unwrap(), norm.eps());
    (0..50)
        .map(|i| normal(&[rows, hidden], 1.0, seed + 1000 * i).astype(dtype).unwrap())
        .find(|h| {
            rmlx::with_device(Device::cpu(), || {
                let mut logits = norm32.forward(&h.astype(Dtype::Float32).unwrap()).unwrap().matmul(&weight).unwrap();
                if let Some(b) = &bias {
                    logits = (logits + b).unwrap();
                }
                let p = rmlx::ops::softmax(&logits, -1, true).unwrap().to_vec::<f32>().unwrap();
                p.chunks(p.len() / rows as usize).all(|row| {
                    let mut row = row.to_vec();
                    row.sort_by(|a, b| b.total_cmp(a));
                    row[top_k] < 0.95 * row[top_k - 1]
                })
            })
        })
        .expect("an untied draw in 50")
}

fn composed(moe: &SparseMoe, h: &Array, norm: &RmsNorm) -> Array {
    (h + moe.forward(&norm.forward(h).unwrap()).unwrap()).unwrap()
}

/// `moe.forward_residual(h)` against the composed feed-forward on the CPU: within `tolerance`
/// (relative) on MLX's CUDA backend, where it counts as one case checked (the result), and bit
/// for bit elsewhere (0).
fn check_against_composed(moe: &SparseMoe, h: &Array, norm: &RmsNorm, tolerance: f32, case: &str) -> usize {
    let want = rmlx::with_device(Device::cpu(), || composed(moe, h, norm));
    let got = moe.forward_residual(h, norm).unwrap();
    assert_eq!((got.shape(), got.dtype()), (want.shape(), want.dtype()), "{case}");
    let err = relative_error(&got, &want);
    if !cuda() {
        assert_eq!(err, 0.0, "{case}: off CUDA the feed-forward is the composed one");
        return 0;
    }
    assert!(err <= tolerance, "{case}: relative error {err} > {tolerance}");
    1
}

#[test]
fn the_kernels_match_the_composed_feed_forward_on_cuda_and_decline_elsewhere() {
    let mut checked = 0;
    for (dtype, tolerance) in [(Dtype::Float32, 1e-5), (Dtype::Bfloat16, 4e-2)] {
        for bits in [Some(4), Some(8), None] {
            for (shape, counts, renorm) in
                [((256, 128), (16, 4), true), ((512, 192), (128, 8), true), ((320, 64), (40, 3), false)]
            {
                let moe = sparse_moe(dtype, bits, counts, shape, renorm, false);
                let norm = RmsNorm::new((normal(&[shape.0], 0.2, 7) + 1.0).unwrap().astype(dtype).unwrap(), 1e-6);
                for rows in [1, 3, 8] {
                    let h = untied_rows(&moe, &norm, (rows, shape.0), counts.1 as usize, dtype, 10 + rows as u64);
                    let case = format!("{dtype:?} bits {bits:?} {shape:?} {counts:?} rows {rows}");
                    checked += check_against_composed(&moe, &h, &norm, tolerance, &case);
                }
            }
        }
    }
    if cuda() {
        assert_eq!(checked, 54);
    }
}

#[test]
fn gpt_oss_experts_match_the_composed_feed_forward_on_cuda() {
    let (hidden, width, experts) = (320, 192, 32);
    let mut checked = 0;
    for (dtype, tolerance) in [(Dtype::Float32, 1e-5), (Dtype::Bfloat16, 4e-2)] {
        for bits in [Some(4), Some(8), None] {
            let moe = sparse_moe(dtype, bits, (experts, 4), (hidden, width), true, true);
            let norm = RmsNorm::new((normal(&[hidden], 0.2, 7) + 1.0).unwrap().astype(dtype).unwrap(), 1e-5);
            for rows in [1, 3, 8] {
                let h = untied_rows(&moe, &norm, (rows, hidden), 4, dtype, 30 + rows as u64);
                let case = format!("gpt-oss {dtype:?} bits {bits:?} rows {rows}");
                checked += check_against_composed(&moe, &h, &norm, tolerance, &case);
            }
        }
    }
    if cuda() {
        assert_eq!(checked, 18);
    }
    // The clamp is reached: a share of the gate projections (all experts, bias added) lie past it.
    let mut past = 0.0;
    rmlx::with_device(Device::cpu(), || {
        let moe = sparse_moe(Dtype::Float32, None, (experts, 4), (hidden, width), true, true);
        let (mut gate, mut bias) = (None, None);
        moe.visit("", &mut |name, _, a| match name {
            "switch_mlp.gate_proj.weight" => gate = Some(a.clone()),
            "switch_mlp.gate_proj.bias" => bias = Some(a.clone()),
            _ => {}
        });
        let x = normal(&[8, hidden], 1.0, 38);
        let x = (&x * &(x.square().unwrap().mean(Axes::All, false).unwrap().rsqrt().unwrap())).unwrap();
        let g = (x.matmul(&gate.unwrap().swapaxes(-1, -2).unwrap()).unwrap() + bias.unwrap().expand_dims(1).unwrap())
            .unwrap();
        let over = rmlx::ops::greater(&g, &Array::scalar(LIMIT)).unwrap().astype(Dtype::Float32).unwrap();
        past = over.mean(Axes::All, false).unwrap().item::<f32>().unwrap();
    });
    assert!((0.02..0.3).contains(&past), "share of gate values past the clamp: {past}");
}

#[test]
fn adapters_training_and_many_rows_take_the_composed_path() {
    let moe = sparse_moe(Dtype::Float32, Some(4), (16, 4), (256, 128), true, false);
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
