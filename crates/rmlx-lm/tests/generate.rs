//! Generation behaviour on the `llama_gqa` fixture (whose greedy continuation transformers
//! computed): token budget, EOS ids, stop strings, cancellation, a bounded (rotating) context,
//! seeded sampling, the unpipelined path taken with a repetition penalty, metrics, and perplexity
//! against the reference logits.

mod common;

use common::{fixture_with_tokenizer, floats, ids, reference};
use rmlx_lm::{FinishReason, GenerateOptions, LoadOptions, LoadedModel};

fn setup() -> (common::TempDir, LoadedModel, Vec<u32>, Vec<u32>) {
    let r = reference("llama_gqa");
    let dir = fixture_with_tokenizer("llama_gqa");
    let lm = rmlx_lm::loader::load(dir.path(), &LoadOptions::default()).unwrap();
    (dir, lm, ids(&r["prompt_ids"]), ids(&r["greedy"]))
}

fn greedy(n: usize) -> GenerateOptions {
    GenerateOptions { max_tokens: n, ignore_eos: true, ..GenerateOptions::default() }
}

#[test]
fn budget_metrics_and_text() {
    let (_d, lm, prompt, expected) = setup();
    let mut g = lm.generate(&prompt, &greedy(12)).unwrap();
    let tokens: Vec<_> = g.by_ref().map(Result::unwrap).collect();
    assert_eq!(tokens.iter().map(|t| t.id).collect::<Vec<_>>(), expected);
    assert_eq!(g.finish_reason(), Some(FinishReason::Length));
    let m = g.metrics();
    assert_eq!((m.prompt_tokens, m.generated_tokens), (24, 12));
    assert!(m.time_to_first_token.as_nanos() > 0 && m.prompt_tps() > 0.0 && m.generation_tps() > 0.0);
    let text: String = tokens.iter().map(|t| t.text.as_str()).collect();
    assert_eq!(text, lm.tokenizer.decode(&expected, true).unwrap());
    assert!(tokens.iter().all(|t| t.logprob < 0.0));
}

#[test]
fn stops_at_eos_without_emitting_it() {
    let (_d, mut lm, prompt, expected) = setup();
    lm.eos_ids = vec![expected[3]];
    let opts = GenerateOptions { max_tokens: 12, ..GenerateOptions::default() };
    let mut g = lm.generate(&prompt, &opts).unwrap();
    let got: Vec<u32> = g.by_ref().map(|t| t.unwrap().id).collect();
    let first = expected.iter().position(|&t| t == expected[3]).unwrap();
    assert_eq!(got, expected[..first]);
    assert_eq!(g.finish_reason(), Some(FinishReason::Eos));
}

#[test]
fn stops_at_a_stop_string_which_is_not_emitted() {
    let (_d, lm, prompt, expected) = setup();
    let stop = format!("t{}", expected[2]);
    let opts = GenerateOptions {
        max_tokens: 12,
        ignore_eos: true,
        stop_strings: vec![stop.clone()],
        ..GenerateOptions::default()
    };
    let mut g = lm.generate(&prompt, &opts).unwrap();
    let text: String = g.by_ref().map(|t| t.unwrap().text).collect();
    assert_eq!(g.finish_reason(), Some(FinishReason::StopString));
    let full = lm.tokenizer.decode(&expected, true).unwrap();
    assert_eq!(text, full[..full.find(&stop).unwrap()]);
}

#[test]
fn cancel_handle_stops_before_the_next_token() {
    let (_d, lm, prompt, expected) = setup();
    let mut g = lm.generate(&prompt, &greedy(12)).unwrap();
    let cancel = g.cancel_handle();
    let a = g.next().unwrap().unwrap();
    let b = g.next().unwrap().unwrap();
    cancel.cancel();
    assert!(g.next().is_none());
    assert_eq!(g.finish_reason(), Some(FinishReason::Cancelled));
    assert_eq!([a.id, b.id], expected[..2]);
}

#[test]
fn bounded_context_rotates_and_keeps_generating() {
    let (_d, lm, prompt, expected) = setup();
    // 28 positions: the first 4 new tokens still see the whole prompt, later ones a window.
    let opts = GenerateOptions { context_limit: Some(28), ..greedy(12) };
    let got: Vec<u32> = lm.generate(&prompt, &opts).unwrap().map(|t| t.unwrap().id).collect();
    assert_eq!(got.len(), 12);
    assert_eq!(got[..4], expected[..4]);
}

#[test]
fn seeded_sampling_is_reproducible() {
    let (_d, lm, prompt, _) = setup();
    let run = |seed| {
        let mut opts = greedy(12);
        opts.sampler.temperature = 1.5;
        opts.sampler.seed = Some(seed);
        lm.generate(&prompt, &opts).unwrap().map(|t| t.unwrap().id).collect::<Vec<u32>>()
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7), run(8));
}

#[test]
fn repetition_penalty_path_matches_greedy_when_negligible() {
    // A penalty ≠ 1 disables pipelining (the history must be known before the next step).
    let (_d, lm, prompt, expected) = setup();
    let mut opts = greedy(12);
    opts.sampler.repetition_penalty = 1.0001;
    let got: Vec<u32> = lm.generate(&prompt, &opts).unwrap().map(|t| t.unwrap().id).collect();
    assert_eq!(got, expected);
}

#[test]
fn perplexity_matches_reference_logits() {
    let (_d, lm, prompt, _) = setup();
    let r = reference("llama_gqa");
    let logits = floats(&r["logits"]);
    let vocab = logits.len() / prompt.len();
    // Mean over positions 1..N of -log softmax(logits[i-1])[token i], in f64.
    let mut total = 0.0f64;
    for i in 1..prompt.len() {
        let row = &logits[(i - 1) * vocab..i * vocab];
        let max = row.iter().cloned().fold(f32::MIN, f32::max) as f64;
        let lse = max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
        total += lse - row[prompt[i] as usize] as f64;
    }
    let expected = total / (prompt.len() - 1) as f64;
    // float32 matmuls run as TF32 on NVIDIA GPUs (logits off by up to ~0.03 here).
    let tol = if rmlx::default_device().kind == rmlx::DeviceType::Gpu { 2e-2 } else { 1e-4 };
    for chunk in [512, 5] {
        let (nll, n) = rmlx_lm::generate::negative_log_likelihood(&lm, &prompt, chunk).unwrap();
        assert_eq!(n, 23);
        assert!((nll - expected).abs() < tol, "chunk {chunk}: {nll} vs {expected}");
    }
}
