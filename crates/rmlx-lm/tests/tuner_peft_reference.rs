//! rmlx's LoRA against transformers + PEFT (`scripts/make_peft_fixtures.py`), in float32:
//!
//! - adapters PEFT saved (LoRA and DoRA) load into rmlx with PEFT's logits;
//! - on the same batch and the same adapter weights, rmlx's loss and its gradient for every `A` and
//!   `B` equal PEFT's, and one AdamW step (with bias correction, as `torch.optim.AdamW`) gives
//!   PEFT's weights;
//! - an adapter trained by rmlx and written in PEFT's layout gives, in transformers + PEFT, the
//!   logits rmlx computes with it (`peft_logits.json`, made by the script's `--check`).

mod common;

use common::{fixture_with_tokenizer, TempDir};
use rmlx::{Array, Dtype};
use rmlx_lm::nn::ModuleExt;
use rmlx_lm::tuner::optim::{Optimizer, OptimizerKind, Schedule};
use rmlx_lm::tuner::{self, loss_and_grad, peft, Batch, Sequence};
use rmlx_lm::{LoadOptions, LoadedModel};
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn case_dir(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/adapters").join(case)
}

fn reference(case: &str) -> (Value, HashMap<String, Array>) {
    let dir = case_dir(case);
    let json = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let arrays = rmlx::io::load_safetensors(dir.join("reference.safetensors")).unwrap().arrays;
    (json, arrays.into_iter().collect())
}

/// The fixture model in float32 with the PEFT adapter of `adapter_dir` attached.
fn model_with(fixture: &str, adapter_dir: &Path) -> (TempDir, LoadedModel) {
    let dir = fixture_with_tokenizer(fixture);
    let mut lm =
        rmlx_lm::loader::load(dir.path(), &LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() })
            .unwrap();
    peft::load(lm.model.as_mut(), adapter_dir, Dtype::Float32).unwrap();
    (dir, lm)
}

fn logits(lm: &LoadedModel, ids: &[i32]) -> Array {
    let x = Array::from_slice(ids, &[1, ids.len() as i32]).unwrap();
    lm.model.forward(&x, &mut lm.model.new_caches(None)).unwrap().reshape(&[ids.len() as i32, -1]).unwrap()
}

/// PEFT's name of rmlx's `<module>.lora_a` / `.lora_b` (whose arrays are PEFT's transposed) and
/// DoRA's `<module>.m`.
fn peft_name(rmlx: &str) -> String {
    let (module, factor) = rmlx.rsplit_once('.').unwrap();
    match factor {
        "lora_a" => format!("base_model.model.{module}.lora_A.weight"),
        "lora_b" => format!("base_model.model.{module}.lora_B.weight"),
        "m" => format!("base_model.model.{module}.lora_magnitude_vector"),
        other => panic!("not an adapter weight: {other}"),
    }
}

/// max |a - b| / max |b|, after transposing `a` (rmlx's orientation) to `b`'s.
fn rel_err_t(a: &Array, b: &Array) -> f32 {
    let a = a.transpose().unwrap().to_vec::<f32>().unwrap();
    let b = b.to_vec::<f32>().unwrap();
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
    a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn max_abs_diff(a: &Array, b: &Array) -> f32 {
    let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    assert_eq!(a.len(), b.len());
    a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

fn ids_of(json: &Value) -> Vec<i32> {
    json["ids"].as_array().unwrap().iter().map(|v| v.as_i64().unwrap() as i32).collect()
}

#[test]
fn peft_made_adapters_give_transformers_logits() {
    for case in ["peft_llama_gqa", "peft_llama_gqa_dora", "peft_qwen2"] {
        let (json, arrays) = reference(case);
        let (_d, lm) = model_with(json["fixture"].as_str().unwrap(), &case_dir(case));
        let err = max_abs_diff(&logits(&lm, &ids_of(&json)), &arrays["logits"]);
        // The fixtures' float32 tolerance (models/README.md): 5e-4.
        assert!(err < 5e-4, "{case}: max |Δlogit| = {err}");
    }
}

#[test]
fn lora_gradients_and_one_adamw_step_equal_peft() {
    for case in ["peft_llama_gqa", "peft_llama_gqa_dora", "peft_qwen2"] {
        let (json, arrays) = reference(case);
        let (_d, mut lm) = model_with(json["fixture"].as_str().unwrap(), &case_dir(case));
        let seqs: Vec<Sequence> = json["sequences"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| Sequence {
                tokens: s["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect(),
                offset: s["offset"].as_u64().unwrap() as usize,
            })
            .collect();
        let batch = Batch::new(&seqs.iter().collect::<Vec<_>>(), 2048);
        let trainable = tuner::lora_parameter_names(lm.model.as_ref());
        assert_eq!(2 * trainable.len(), arrays.keys().filter(|k| !k.starts_with("logits")).count(), "{case}");
        assert_eq!(case.ends_with("dora"), trainable.iter().any(|n| n.ends_with(".m")), "{case}");
        let step = loss_and_grad(lm.model.as_mut(), &trainable, &batch).unwrap();
        let loss = step.loss.item::<f32>().unwrap();
        let want = json["loss"].as_f64().unwrap() as f32;
        assert!((loss - want).abs() < 1e-6 * want, "{case}: loss {loss} vs PEFT {want}");
        for name in &trainable {
            let err = rel_err_t(&step.grads[name], &arrays[&format!("grad.{}", peft_name(name))]);
            assert!(err < 2e-5, "{case}: gradient of {name}: relative error {err}");
        }
        let adamw = &json["adamw"];
        let f = |k: &str| adamw[k].as_f64().unwrap() as f32;
        let betas = adamw["betas"].as_array().unwrap();
        let kind = OptimizerKind::AdamW {
            betas: (betas[0].as_f64().unwrap() as f32, betas[1].as_f64().unwrap() as f32),
            eps: f("eps"),
            weight_decay: f("weight_decay"),
            bias_correction: true,
        };
        let mut opt = Optimizer::new(kind, Schedule::Constant(f("lr")));
        let params: HashMap<String, Array> =
            lm.model.parameters("").into_iter().filter(|(n, _)| step.grads.contains_key(n)).collect();
        let new = opt.update(&params, &step.grads).unwrap();
        for name in &trainable {
            let after = &arrays[&format!("adamw.{}", peft_name(name))];
            let err = max_abs_diff(&new[name].transpose().unwrap(), after);
            // A first Adam step moves each weight by about lr · sign(g) (1e-2): 1e-7 is 1e-5 of it.
            assert!(err < 1e-7, "{case}: {name} after one AdamW step: max |Δ| = {err}");
        }
    }
}

#[test]
fn rmlx_trained_peft_adapters_give_transformers_logits() {
    for case in ["rmlx_llama_gqa_peft", "rmlx_llama_gqa_dora_peft"] {
        check_rmlx_trained(case);
    }
}

fn check_rmlx_trained(case: &str) {
    let dir = case_dir(case);
    let json: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("peft_logits.json")).unwrap()).unwrap();
    let (_d, lm) = model_with("llama_gqa", &dir);
    let ids = ids_of(&json);
    let want: Vec<f32> = json["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| row.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32))
        .collect();
    let vocab = (want.len() / ids.len()) as i32;
    let want = Array::from_slice(&want, &[ids.len() as i32, vocab]).unwrap();
    let err = max_abs_diff(&logits(&lm, &ids), &want);
    assert!(err < 5e-4, "{case}: max |Δlogit| = {err}");
    // Trained, not fresh: the adapter changes the logits.
    let base_dir = fixture_with_tokenizer("llama_gqa");
    let base =
        rmlx_lm::loader::load(base_dir.path(), &LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() })
            .unwrap();
    assert!(max_abs_diff(&logits(&base, &ids), &want) > 1e-2);
}

/// Writes `tests/fixtures/adapters/rmlx_llama_gqa_peft` (LoRA on every linear of `llama_gqa`)
/// and `rmlx_llama_gqa_dora_peft` (DoRA), each trained by rmlx for 20 steps on a fixed random
/// batch and saved in PEFT's layout. Then run `python scripts/make_peft_fixtures.py --check
/// <folder> --model llama_gqa` on each for `peft_logits.json`.
/// Run: `cargo test -p rmlx-lm --test tuner_peft_reference -- --ignored`.
#[test]
#[ignore]
fn make_rmlx_trained_peft_fixtures() {
    make_rmlx_trained("rmlx_llama_gqa_peft", false);
    make_rmlx_trained("rmlx_llama_gqa_dora_peft", true);
}

fn make_rmlx_trained(case: &str, dora: bool) {
    let src = fixture_with_tokenizer("llama_gqa");
    let mut lm =
        rmlx_lm::loader::load(src.path(), &LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() })
            .unwrap();
    let config = tuner::LoraConfig { rank: 4, scale: 2.0, dropout: 0.0, keys: None };
    if dora {
        tuner::apply_dora(lm.model.as_mut(), None, &config, Dtype::Float32, 7).unwrap();
    } else {
        tuner::apply_lora(lm.model.as_mut(), None, &config, Dtype::Float32, 7).unwrap();
    }
    let trainable = tuner::lora_parameter_names(lm.model.as_ref());
    let seqs: Vec<Sequence> = (0..2u32)
        .map(|r| Sequence { tokens: (0..20).map(|i| 1 + (i * 13 + r * 5) % 60).collect(), offset: 0 })
        .collect();
    let batch = Batch::new(&seqs.iter().collect::<Vec<_>>(), 2048);
    let mut opt = Optimizer::new(OptimizerKind::adam(), Schedule::Constant(1e-2));
    for _ in 0..20 {
        let step = loss_and_grad(lm.model.as_mut(), &trainable, &batch).unwrap();
        let params: HashMap<String, Array> =
            lm.model.parameters("").into_iter().filter(|(n, _)| step.grads.contains_key(n)).collect();
        let new = opt.update(&params, &step.grads).unwrap();
        lm.model.update("", new).unwrap();
    }
    let out = case_dir(case);
    peft::save(lm.model.as_mut(), &out, "llama_gqa").unwrap();
}
