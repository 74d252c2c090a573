//! Mixed precision in the compiled training step: float32 LoRA factors on a bfloat16 model are
//! read through bfloat16 copies that the optimizer's fused update writes. The step, the update
//! and a whole training run give bit for bit what the float32 factors cast inside the step give,
//! with two fewer operations per factor in the step, and compiled Adam is one kernel per
//! parameter (fixture `llama_gqa` in bfloat16, CPU).

mod common;
#[path = "common/training.rs"]
mod training;

use common::{fixture_with_tokenizer, TempDir};
use rmlx::{Array, Dtype};
use rmlx_lm::nn::ModuleExt;
use rmlx_lm::tuner::optim::{Optimizer, OptimizerKind, Schedule};
use rmlx_lm::tuner::{
    apply_dora, apply_lora, lora_parameter_names, train, Batch, CompiledLossAndGrad, LoraConfig, Sequence, TrainConfig,
};
use rmlx_lm::{LoadOptions, LoadedModel};
use std::collections::HashMap;
use training::move_lora_b;

fn load() -> (TempDir, LoadedModel, Vec<String>) {
    load_adapted(false)
}

/// The bfloat16 model with float32 LoRA (or, with `dora`, DoRA) adapters on every block.
fn load_adapted(dora: bool) -> (TempDir, LoadedModel, Vec<String>) {
    let dir = fixture_with_tokenizer("llama_gqa");
    let mut lm =
        rmlx_lm::loader::load(dir.path(), &LoadOptions { dtype: Some(Dtype::Bfloat16), ..LoadOptions::default() })
            .unwrap();
    let cfg = LoraConfig { rank: 4, scale: 2.0, dropout: 0.0, keys: None };
    let apply = if dora { apply_dora } else { apply_lora };
    apply(lm.model.as_mut(), None, &cfg, Dtype::Float32, 0).unwrap();
    let trainable = lora_parameter_names(lm.model.as_ref());
    move_lora_b(&mut lm, &trainable, 1);
    (dir, lm, trainable)
}

fn bits(a: &Array) -> Vec<u32> {
    a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
}

fn params(lm: &LoadedModel, names: &[String]) -> HashMap<String, Array> {
    lm.model.parameters("").into_iter().filter(|(n, _)| names.contains(n)).collect()
}

fn count(graph: &[&Array], op: &str) -> usize {
    rmlx::graph_census(graph.iter().copied()).unwrap().get(op).copied().unwrap_or(0)
}

#[test]
fn the_step_on_copies_equals_the_step_on_float32_factors_with_two_fewer_casts_each() {
    let (_d, lm, trainable) = load();
    let a = Sequence { tokens: vec![3, 17, 42, 8, 99, 5, 61], offset: 3 };
    let b = Sequence { tokens: vec![12, 7, 88, 23], offset: 0 };
    let batch = Batch::new(&[&a, &b], 2048);
    let key = rmlx::random::key(0).unwrap();
    let compiled = CompiledLossAndGrad::new(lm.model.as_ref(), &trainable).unwrap();
    let masters = params(&lm, &trainable);
    let copies: HashMap<String, Array> =
        masters.iter().map(|(n, a)| (n.clone(), a.astype(Dtype::Bfloat16).unwrap())).collect();
    rmlx::eval(copies.values()).unwrap();

    let plain = compiled.call(lm.model.as_ref(), &batch, &key).unwrap();
    let fast = compiled.call_with_copies(lm.model.as_ref(), &batch, &key, &copies).unwrap();
    let graph =
        |s: &rmlx_lm::tuner::LossAndGrad| -> Vec<Array> { s.grads.values().cloned().chain([s.loss.clone()]).collect() };
    let (g_plain, g_fast) = (graph(&plain), graph(&fast));
    let casts_plain = count(&g_plain.iter().collect::<Vec<_>>(), "AsType");
    let casts_fast = count(&g_fast.iter().collect::<Vec<_>>(), "AsType");
    // Each factor was cast down for the forward pass and its gradient cast up.
    assert_eq!(casts_plain - casts_fast, 2 * trainable.len(), "{casts_plain} → {casts_fast} casts");

    assert_eq!(bits(&plain.loss), bits(&fast.loss));
    for n in &trainable {
        assert_eq!(fast.grads[n].dtype(), Dtype::Bfloat16, "{n}");
        assert_eq!(plain.grads[n].dtype(), Dtype::Float32, "{n}");
        assert_eq!(bits(&plain.grads[n]), bits(&fast.grads[n]), "{n}");
        // What the optimizer updates are still the float32 factors.
        assert_eq!(fast.params[n].dtype(), Dtype::Float32, "{n}");
    }
    assert!(plain.grads.values().any(|g| bits(g).iter().any(|&b| f32::from_bits(b) != 0.0)));

    // Compiled Adam from bfloat16 gradients, writing the copies: the float32 update of the cast
    // gradients, one fused kernel per parameter.
    let mut a = Optimizer::new(OptimizerKind::adam(), Schedule::Constant(1e-2));
    let mut b = Optimizer::new(OptimizerKind::adam(), Schedule::Constant(1e-2));
    a.set_compiled(true);
    b.set_compiled(true);
    let want = a.update(&plain.params, &plain.grads).unwrap();
    let (got, got_copies) = b.update_with_copies(&fast.params, &fast.grads, Some(Dtype::Bfloat16)).unwrap();
    let n = &trainable[0];
    let one: Vec<Array> = [&got[n], &got_copies[n]]
        .into_iter()
        .cloned()
        .chain(b.state_arrays().0.range(format!("{n}.")..).take(2).map(|(_, a)| a.clone()))
        .collect();
    let census = rmlx::graph_census(&one).unwrap();
    let kernels: usize =
        census.iter().filter(|(op, _)| !matches!(op.as_str(), "Broadcast" | "Full")).map(|(_, c)| c).sum();
    assert_eq!(kernels, 1, "one kernel updates `{n}`, its moments and its copy: {census:?}");
    for n in &trainable {
        assert_eq!(bits(&want[n]), bits(&got[n]), "{n}");
        assert_eq!(got_copies[n].dtype(), Dtype::Bfloat16);
        assert_eq!(bits(&got_copies[n]), bits(&want[n].astype(Dtype::Bfloat16).unwrap()), "{n}");
    }
}

/// Four compiled training steps, with and without copies (and with gradients accumulated over two
/// batches, summed in float32): the same losses and the same adapters, bit for bit.
#[test]
fn training_with_copies_equals_training_without() {
    let data: Vec<Sequence> = (0..8u32)
        .map(|i| Sequence { tokens: (0..12).map(|k| (i * 7 + 3 * k) % 60 + 2).collect(), offset: 0 })
        .collect();
    // DoRA computes its magnitudes from the float32 factors: it takes no copies, so the setting
    // changes nothing there either (its magnitudes, role `DoraMagnitude`, are recognised by role).
    for (accumulation, dora) in [(1, false), (2, false), (1, true)] {
        let mut runs = Vec::new();
        for copies in [false, true] {
            let (_d, mut lm, trainable) = load_adapted(dora);
            if dora {
                assert!(trainable.iter().any(|n| n.ends_with(".m")), "{trainable:?}");
            }
            let cfg = TrainConfig {
                iters: 4,
                batch_size: 2,
                steps_per_report: 1,
                steps_per_eval: 1000,
                save_every: 1000,
                compile: true,
                compute_copies: copies,
                grad_accumulation_steps: accumulation,
                ..TrainConfig::default()
            };
            let mut opt = Optimizer::new(OptimizerKind::adam(), Schedule::Constant(1e-2));
            opt.set_compiled(true);
            let mut losses = Vec::new();
            train(
                lm.model.as_mut(),
                &trainable,
                &mut opt,
                &data,
                &[],
                &cfg,
                &mut |r| {
                    if let rmlx_lm::tuner::Report::Train { loss, .. } = r {
                        losses.push(loss.to_bits());
                    }
                },
                &|| false,
            )
            .unwrap();
            let adapters: Vec<Vec<u32>> = trainable.iter().map(|n| bits(&params(&lm, &trainable)[n])).collect();
            runs.push((losses, adapters));
        }
        assert_eq!(runs[0].0.len(), 4);
        assert_eq!(runs[0], runs[1], "accumulating {accumulation}, dora {dora}");
    }
}
