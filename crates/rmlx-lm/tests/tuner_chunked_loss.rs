//! The chunked cross-entropy (logits made a few rows at a time, their gradient written by hand)
//! against the cross-entropy of the whole logits, differentiated by MLX: same loss, same
//! gradients, for tied and untied, dense and quantised heads, and when the head itself trains.

mod common;
#[path = "common/training.rs"]
mod training;

use common::fixture_with_tokenizer;
use rmlx::{Array, Dtype};
use rmlx_lm::tuner::{
    apply_lora, batch_loss, full_parameter_names, logits_loss, lora_parameter_names, loss_and_grad,
    with_loss_chunk_rows, Batch, LoraConfig, LossAndGrad, Sequence,
};
use rmlx_lm::{LoadOptions, LoadedModel};
use training::{assert_same_step, move_lora_b};

fn load(name: &str, dequantize: bool) -> (common::TempDir, LoadedModel) {
    let dir = fixture_with_tokenizer(name);
    let opts = LoadOptions { dtype: Some(Dtype::Float32), dequantize: Some(dequantize), ..LoadOptions::default() };
    let lm = rmlx_lm::loader::load(dir.path(), &opts).unwrap();
    (dir, lm)
}

/// Three rows of different lengths (padding, a prompt mask): 3 × 8 = 24 targets, 14 counted.
fn batch() -> Batch {
    let a = Sequence { tokens: vec![3, 17, 42, 8, 99, 5, 61, 2, 77], offset: 3 };
    let b = Sequence { tokens: vec![12, 7, 88, 23], offset: 0 };
    let c = Sequence { tokens: vec![4, 4, 90, 31, 15, 6], offset: 1 };
    Batch::new(&[&a, &b, &c], 2048)
}

/// LoRA on every linear, with B moved away from zero so that every gradient is non-zero.
fn with_lora(lm: &mut LoadedModel) -> Vec<String> {
    let cfg = LoraConfig { rank: 2, scale: 2.0, dropout: 0.0, keys: None };
    apply_lora(lm.model.as_mut(), None, &cfg, Dtype::Float32, 3).unwrap();
    let trainable = lora_parameter_names(lm.model.as_ref());
    move_lora_b(lm, &trainable, 100);
    trainable
}

fn step(lm: &mut LoadedModel, trainable: &[String], rows: Option<usize>) -> LossAndGrad {
    with_loss_chunk_rows(rows, || loss_and_grad(lm.model.as_mut(), trainable, &batch()).unwrap())
}

/// Loss within 1e-6 relative; every gradient within 2e-5 of its largest entry.
fn assert_same(what: &str, whole: &LossAndGrad, chunked: &LossAndGrad) {
    assert_eq!(whole.ntoks.item::<f32>().unwrap(), 14.0);
    assert_same_step(what, whole, chunked, 1e-6, 2e-5);
}

#[test]
fn chunked_gradients_equal_those_of_the_whole_logits() {
    // Tied dense, untied dense, tied quantised, untied quantised, Gemma 3 (scaled embedding).
    for (name, dequantize) in
        [("llama_gqa", true), ("qwen3", true), ("llama_gqa_q4", false), ("qwen3_q4", false), ("gemma3_text", true)]
    {
        let (_d, mut lm) = load(name, dequantize);
        assert!(lm.model.linear_head().is_some(), "{name}: a linear head");
        let trainable = with_lora(&mut lm);
        let whole = step(&mut lm, &trainable, None);
        for rows in [1, 5, 24, 1000] {
            assert_same(&format!("{name}, {rows} rows per chunk"), &whole, &step(&mut lm, &trainable, Some(rows)));
        }
    }
}

#[test]
fn a_trained_head_gets_its_gradient() {
    // Full fine-tuning of every parameter, the untied output head included: the chunked loss
    // must not cut the head off the gradient.
    let (_d, mut lm) = load("qwen3", true);
    let trainable = full_parameter_names(lm.model.as_ref(), None).unwrap();
    assert!(trainable.iter().any(|n| n == "lm_head.weight"), "{trainable:?}");
    let whole = step(&mut lm, &trainable, None);
    assert_same("qwen3, full", &whole, &step(&mut lm, &trainable, Some(5)));
}

#[test]
fn chunked_loss_equals_the_loss_of_the_whole_logits() {
    let (_d, lm) = load("llama_gqa_q4", false);
    let b = batch();
    let (tokens, mask) = (b.to_array().unwrap(), b.mask_array().unwrap());
    let (whole, n) = logits_loss(lm.model.as_ref(), &tokens, &mask).unwrap();
    assert_eq!(n.item::<f32>().unwrap(), 14.0);
    let whole = whole.item::<f32>().unwrap();
    for rows in [None, Some(1), Some(7)] {
        let (chunked, _) = with_loss_chunk_rows(rows, || batch_loss(lm.model.as_ref(), &tokens, &mask)).unwrap();
        let chunked = chunked.item::<f32>().unwrap();
        assert!((chunked - whole).abs() <= 1e-6 * whole, "{rows:?} rows: {chunked} against {whole}");
    }
}

#[test]
fn a_batch_without_targets_is_an_error() {
    let (_d, lm) = load("llama_gqa", true);
    let tokens = Array::from_slice(&[3i32, 17], &[2, 1]).unwrap();
    let mask = Array::from_slice::<f32>(&[], &[2, 0]).unwrap();
    for rows in [None, Some(4)] {
        match with_loss_chunk_rows(rows, || batch_loss(lm.model.as_ref(), &tokens, &mask)) {
            Err(rmlx_lm::Error::InvalidParameter(m)) => {
                assert_eq!(m, "a batch needs at least one row of two tokens, not the shape [2, 1]")
            }
            other => panic!("expected InvalidParameter, got {:?}", other.map(|_| ())),
        }
    }
}

#[test]
fn a_forward_pass_over_no_tokens_does_not_panic() {
    // It used to panic in the KV cache (a write into a buffer never allocated).
    let (_d, lm) = load("llama_gqa", true);
    let ids = Array::from_slice::<i32>(&[], &[1, 0]).unwrap();
    let out = lm.model.forward(&ids, &mut lm.model.new_caches(None)).map(|l| l.shape().to_vec());
    assert_eq!(out.unwrap(), vec![1, 0, 384]);
}

#[test]
fn a_quantised_base_trains_as_its_dequantised_twin() {
    // QLoRA multiplies by the dequantised weight, with its own backward rule (`∂x = g W`); the
    // same checkpoint dequantised at load differentiates MLX's plain matmul. Same adapters, same
    // batch: the same loss and gradients, through whole and chunked logits.
    for name in ["llama_gqa_q4", "qwen3_q4"] {
        let (_d, mut quantised) = load(name, false);
        let (_e, mut dense) = load(name, true);
        let (q_names, d_names) = (with_lora(&mut quantised), with_lora(&mut dense));
        assert_eq!(q_names, d_names);
        for rows in [None, Some(5)] {
            let (q, d) = (step(&mut quantised, &q_names, rows), step(&mut dense, &d_names, rows));
            assert_same_step(&format!("{name}, {rows:?} rows per chunk"), &d, &q, 1e-5, 1e-4);
        }
    }
}
