//! Tests of the sampling chain (`rmlx_lm::sample`) with hand-computed expectations.

use rmlx::{Array, Dtype};
use rmlx_lm::sample::{
    apply_logit_bias, apply_min_p, apply_repetition_penalty, apply_top_k, apply_top_p, log_softmax, Sampler,
    SamplerConfig,
};
use rmlx_lm::Error;

const NEG_INF: f32 = f32::NEG_INFINITY;

/// A `[1, n]` float32 row.
fn row(v: &[f32]) -> Array {
    Array::from_slice(v, &[1, v.len() as i32]).unwrap()
}

/// `ln p` of each probability, as a `[1, n]` row of log-probabilities.
fn log_row(p: &[f64]) -> (Vec<f32>, Array) {
    let l: Vec<f32> = p.iter().map(|&x| x.ln() as f32).collect();
    let a = row(&l);
    (l, a)
}

fn vals(a: &Array) -> Vec<f32> {
    a.to_vec::<f32>().unwrap()
}

fn token(a: &Array) -> u32 {
    assert_eq!(a.dtype(), Dtype::Uint32);
    assert_eq!(a.shape(), &[1]);
    a.item::<u32>().unwrap()
}

fn is_invalid_param<T: std::fmt::Debug>(r: rmlx_lm::Result<T>, field: &str) {
    match r {
        Err(Error::InvalidParameter(msg)) => {
            assert!(msg.contains(field), "message `{msg}` should name `{field}`")
        }
        other => panic!("expected InvalidParameter about {field}, got {other:?}"),
    }
}

/// `expected` with `None` for entries that must be -inf and `Some(x)` for exact survivors.
fn assert_masked(got: &[f32], expected: &[Option<f32>]) {
    assert_eq!(got.len(), expected.len());
    for (i, (&g, &e)) in got.iter().zip(expected).enumerate() {
        match e {
            None => assert_eq!(g, NEG_INF, "entry {i} should be -inf, got {g} (all: {got:?})"),
            Some(x) => assert_eq!(g, x, "entry {i} should survive unchanged (all: {got:?})"),
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// top-k

#[test]
fn top_k_keeps_the_k_largest() {
    let x = row(&[1.0, 5.0, 3.0, -2.0, 4.0]);
    assert_masked(&vals(&apply_top_k(&x, 2).unwrap()), &[None, Some(5.0), None, None, Some(4.0)]);
    assert_masked(&vals(&apply_top_k(&x, 1).unwrap()), &[None, Some(5.0), None, None, None]);
    assert_masked(&vals(&apply_top_k(&x, 4).unwrap()), &[Some(1.0), Some(5.0), Some(3.0), None, Some(4.0)]);
    // k >= vocab: unchanged.
    assert_eq!(vals(&apply_top_k(&x, 5).unwrap()), vec![1.0, 5.0, 3.0, -2.0, 4.0]);
    assert_eq!(vals(&apply_top_k(&x, 100).unwrap()), vec![1.0, 5.0, 3.0, -2.0, 4.0]);
    is_invalid_param(apply_top_k(&x, 0), "top_k");
}

#[test]
fn top_k_works_per_row_and_on_1d() {
    let x = Array::from_slice(&[1.0f32, 5.0, 3.0, 9.0, 0.0, -1.0], &[2, 3]).unwrap();
    assert_masked(&vals(&apply_top_k(&x, 1).unwrap()), &[None, Some(5.0), None, Some(9.0), None, None]);
    let v = Array::from_slice(&[0.5f32, -0.5, 2.0], &[3]).unwrap();
    let out = apply_top_k(&v, 2).unwrap();
    assert_eq!(out.shape(), &[3]);
    assert_masked(&vals(&out), &[Some(0.5), None, Some(2.0)]);
}

// ---------------------------------------------------------------------------------------------------
// top-p

#[test]
fn top_p_keeps_the_smallest_nucleus() {
    // Probabilities 0.1, 0.5, 0.15, 0.25. Sorted descending: 0.5 (id 1), 0.25 (id 3), 0.15 (id 2),
    // 0.1 (id 0); running totals 0.5, 0.75, 0.9, 1.0.
    let (l, x) = log_row(&[0.1, 0.5, 0.15, 0.25]);
    let case = |p: f32| vals(&apply_top_p(&x, p).unwrap());
    // Up to 0.5 the first token alone reaches p.
    assert_masked(&case(0.3), &[None, Some(l[1]), None, None]);
    assert_masked(&case(0.49), &[None, Some(l[1]), None, None]);
    // Just over 0.5 needs the second token; 0.75 covers up to p = 0.75.
    assert_masked(&case(0.51), &[None, Some(l[1]), None, Some(l[3])]);
    assert_masked(&case(0.74), &[None, Some(l[1]), None, Some(l[3])]);
    // Just over 0.75 needs the third.
    assert_masked(&case(0.76), &[None, Some(l[1]), Some(l[2]), Some(l[3])]);
    assert_masked(&case(0.89), &[None, Some(l[1]), Some(l[2]), Some(l[3])]);
    assert_masked(&case(0.91), &[Some(l[0]), Some(l[1]), Some(l[2]), Some(l[3])]);
    // 1.0 = off.
    assert_eq!(case(1.0), l);
    // A tiny top_p still keeps the most probable token (1 - 1e-9 rounds to 1.0 in float32, above
    // every cumulative total).
    assert_masked(&case(1e-9), &[None, Some(l[1]), None, None]);
    is_invalid_param(apply_top_p(&x, 0.0), "top_p");
    is_invalid_param(apply_top_p(&x, 1.5), "top_p");
    is_invalid_param(apply_top_p(&x, f32::NAN), "top_p");
}

#[test]
fn top_p_leaves_banned_tokens_banned() {
    // Token 2 is already -inf (probability 0): it stays -inf even when every other token survives.
    let (l, _) = log_row(&[0.6, 0.4, 1.0]);
    let x = row(&[l[0], l[1], NEG_INF]);
    assert_masked(&vals(&apply_top_p(&x, 0.99).unwrap()), &[Some(l[0]), Some(l[1]), None]);
    assert_masked(&vals(&apply_top_p(&x, 0.5).unwrap()), &[Some(l[0]), None, None]);
}

// ---------------------------------------------------------------------------------------------------
// min-p

#[test]
fn min_p_drops_tokens_below_the_scaled_maximum() {
    // Probabilities 0.5, 0.3, 0.12, 0.08 (max 0.5).
    let (l, x) = log_row(&[0.5, 0.3, 0.12, 0.08]);
    // min_p 0.2: threshold 0.1, only 0.08 goes.
    assert_masked(&vals(&apply_min_p(&x, 0.2, 1).unwrap()), &[Some(l[0]), Some(l[1]), Some(l[2]), None]);
    // min_p 0.25: threshold 0.125, 0.12 and 0.08 go.
    assert_masked(&vals(&apply_min_p(&x, 0.25, 1).unwrap()), &[Some(l[0]), Some(l[1]), None, None]);
    // min_p 0.9: threshold 0.45, only the top token stays.
    assert_masked(&vals(&apply_min_p(&x, 0.9, 1).unwrap()), &[Some(l[0]), None, None, None]);
    // 0 = off.
    assert_eq!(vals(&apply_min_p(&x, 0.0, 1).unwrap()), l);
}

#[test]
fn min_p_keeps_at_least_min_tokens_to_keep() {
    let (l, x) = log_row(&[0.08, 0.5, 0.12, 0.3]);
    // Alone, min_p 0.9 keeps only id 1; with min_tokens_to_keep 3 the three most probable survive.
    assert_masked(&vals(&apply_min_p(&x, 0.9, 1).unwrap()), &[None, Some(l[1]), None, None]);
    assert_masked(&vals(&apply_min_p(&x, 0.9, 2).unwrap()), &[None, Some(l[1]), None, Some(l[3])]);
    assert_masked(&vals(&apply_min_p(&x, 0.9, 3).unwrap()), &[None, Some(l[1]), Some(l[2]), Some(l[3])]);
    // Keeping more than min_p would drop does not remove anything min_p keeps.
    assert_masked(&vals(&apply_min_p(&x, 0.2, 2).unwrap()), &[None, Some(l[1]), Some(l[2]), Some(l[3])]);
    // At or above the vocabulary size: nothing is dropped.
    assert_eq!(vals(&apply_min_p(&x, 0.9, 4).unwrap()), l);
    assert_eq!(vals(&apply_min_p(&x, 0.9, 10).unwrap()), l);
    is_invalid_param(apply_min_p(&x, 0.5, 0), "min_tokens_to_keep");
    is_invalid_param(apply_min_p(&x, 1.0, 1), "min_p");
    is_invalid_param(apply_min_p(&x, -0.1, 1), "min_p");
}

// ---------------------------------------------------------------------------------------------------
// logit processors

#[test]
fn repetition_penalty_is_sign_aware_and_windowed() {
    let x = row(&[2.0, -1.0, 0.5, -3.0, 4.0, 0.0]);
    // Window of the last 3 ids: [1, 4, 1] → id 1 (negative) ×2, id 4 (positive) ÷2, once each.
    // Id 0 is in the history but outside the window; id 3 never occurs.
    let out = apply_repetition_penalty(&x, &[0, 3, 1, 4, 1], 2.0, 3).unwrap();
    assert_eq!(vals(&out), vec![2.0, -2.0, 0.5, -3.0, 2.0, 0.0]);
    // A window wider than the history covers all of it; zero is divided (stays 0).
    let out = apply_repetition_penalty(&x, &[5, 0, 3, 2], 1.5, 20).unwrap();
    assert_eq!(vals(&out), vec![2.0 / 1.5, -1.0, 0.5 / 1.5, -4.5, 4.0, 0.0]);
    // Penalty below 1 rewards repetition the same sign-aware way.
    let out = apply_repetition_penalty(&x, &[1, 4], 0.5, 20).unwrap();
    assert_eq!(vals(&out), vec![2.0, -0.5, 0.5, -3.0, 8.0, 0.0]);
    // Empty history or penalty 1: unchanged.
    assert_eq!(vals(&apply_repetition_penalty(&x, &[], 2.0, 20).unwrap()), vals(&x));
    assert_eq!(vals(&apply_repetition_penalty(&x, &[0, 1], 1.0, 20).unwrap()), vals(&x));
    // Ids outside the window are not checked against the vocabulary; ids inside are.
    assert_eq!(vals(&apply_repetition_penalty(&x, &[99, 4], 2.0, 1).unwrap()), vec![2.0, -1.0, 0.5, -3.0, 2.0, 0.0]);
    is_invalid_param(apply_repetition_penalty(&x, &[6], 2.0, 20), "vocabulary");
    is_invalid_param(apply_repetition_penalty(&x, &[1], 0.0, 20), "repetition_penalty");
    is_invalid_param(apply_repetition_penalty(&x, &[1], 2.0, 0), "repetition_context");
}

#[test]
fn logit_bias_adds_and_bans() {
    let x = row(&[1.0, 2.0, 3.0]);
    let out = apply_logit_bias(&x, &[(0, 1.5), (2, NEG_INF), (0, 0.5)]).unwrap();
    assert_eq!(vals(&out), vec![3.0, 2.0, NEG_INF]);
    assert_eq!(vals(&apply_logit_bias(&x, &[]).unwrap()), vec![1.0, 2.0, 3.0]);
    is_invalid_param(apply_logit_bias(&x, &[(3, 1.0)]), "vocabulary");
    is_invalid_param(apply_logit_bias(&x, &[(0, f32::NAN)]), "logit_bias");
    is_invalid_param(apply_logit_bias(&x, &[(0, f32::INFINITY)]), "logit_bias");
}

#[test]
fn log_softmax_normalises() {
    let x = row(&[0.3, -1.2, 4.0, 2.5, 0.0]);
    let p: Vec<f32> = vals(&log_softmax(&x).unwrap()).iter().map(|l| l.exp()).collect();
    assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-5);
    // Differences of logits are preserved.
    let l = vals(&log_softmax(&x).unwrap());
    assert!((l[2] - l[3] - 1.5).abs() < 1e-5);
}

// ---------------------------------------------------------------------------------------------------
// the sampler

#[test]
fn greedy_is_argmax_with_first_index_on_ties() {
    let mut s = Sampler::new(SamplerConfig::default()).unwrap();
    let (t, _) = s.sample(&row(&[1.0, 3.0, 3.0, 2.0]), &[]).unwrap();
    assert_eq!(token(&t), 1, "MLX argmax returns the first of equal maxima");
    let (t, _) = s.sample(&row(&[-5.0, -4.0, -4.5]), &[1, 2]).unwrap();
    assert_eq!(token(&t), 1);
    // A [vocab] input gives the same [1] token.
    let v = Array::from_slice(&[0.0f32, 0.1, 7.0, 7.0], &[4]).unwrap();
    let (t, lp) = s.sample(&v, &[]).unwrap();
    assert_eq!(token(&t), 2);
    assert_eq!(lp.shape(), &[1, 4]);
}

#[test]
fn processors_apply_before_greedy() {
    // Repetition penalty: id 0 (3.0) was just generated and becomes 1.5 < 2.5.
    let cfg = SamplerConfig { repetition_penalty: 2.0, ..Default::default() };
    let mut s = Sampler::new(cfg).unwrap();
    let x = row(&[3.0, 2.5, -1.0]);
    assert_eq!(token(&s.sample(&x, &[0]).unwrap().0), 1);
    assert_eq!(token(&s.sample(&x, &[]).unwrap().0), 0);
    // Logit bias: a ban on the argmax.
    let cfg = SamplerConfig { logit_bias: vec![(0, NEG_INF), (2, 4.0)], ..Default::default() };
    let mut s = Sampler::new(cfg).unwrap();
    assert_eq!(token(&s.sample(&x, &[]).unwrap().0), 2);
    // A bias id outside the vocabulary is an error at sampling time.
    let cfg = SamplerConfig { logit_bias: vec![(3, 1.0)], ..Default::default() };
    let mut s = Sampler::new(cfg).unwrap();
    is_invalid_param(s.sample(&x, &[]), "vocabulary");
}

#[test]
fn logprobs_are_the_processed_distribution_before_filtering() {
    let cfg = SamplerConfig {
        temperature: 0.5,
        top_k: 1,
        repetition_penalty: 2.0,
        repetition_context: 2,
        logit_bias: vec![(3, 1.0)],
        seed: Some(1),
        ..Default::default()
    };
    let mut s = Sampler::new(cfg).unwrap();
    let x = Array::from_slice(&[1.0f32, 2.0, -2.0, 0.5], &[1, 4]).unwrap().astype(Dtype::Bfloat16).unwrap();
    let (_, lp) = s.sample(&x, &[7, 1, 2]).unwrap();
    assert_eq!(lp.dtype(), Dtype::Float32);
    assert_eq!(lp.shape(), &[1, 4]);
    // Processed logits (id 7 is outside the window of 2): id 1 → 2/2 = 1, id 2 → -2*2 = -4, id 3 → 0.5 + 1 = 1.5.
    let processed = [1.0f64, 1.0, -4.0, 1.5];
    let lse = processed.iter().map(|v| v.exp()).sum::<f64>().ln();
    let got = vals(&lp);
    for (g, p) in got.iter().zip(processed) {
        assert!((*g as f64 - (p - lse)).abs() < 1e-5, "{got:?}");
    }
    // No -inf from top_k and no temperature scaling; the probabilities sum to 1.
    let total: f64 = got.iter().map(|&l| (l as f64).exp()).sum();
    assert!((total - 1.0).abs() < 1e-5);
}

#[test]
fn shape_errors() {
    let mut s = Sampler::new(SamplerConfig::default()).unwrap();
    let x = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
    is_invalid_param(s.sample(&x, &[]), "shape");
    let x = Array::from_slice(&[1.0f32, 2.0], &[1, 1, 2]).unwrap();
    is_invalid_param(s.sample(&x, &[]), "shape");
}

fn draws(cfg: &SamplerConfig, logits: &Array, n: usize) -> Vec<u32> {
    let mut s = Sampler::new(cfg.clone()).unwrap();
    (0..n).map(|_| token(&s.sample(logits, &[]).unwrap().0)).collect()
}

#[test]
fn same_seed_same_draws() {
    let logits = row(&[0.0; 10]);
    let cfg = SamplerConfig { temperature: 1.0, seed: Some(42), ..Default::default() };
    let a = draws(&cfg, &logits, 50);
    let b = draws(&cfg, &logits, 50);
    assert_eq!(a, b);
    // The key advances: 50 uniform draws over 10 tokens are not all one token.
    assert!(a.iter().any(|&t| t != a[0]), "{a:?}");
    let c = draws(&SamplerConfig { seed: Some(43), ..cfg.clone() }, &logits, 50);
    assert_ne!(a, c);
    // Reseeding restarts the stream.
    let mut s = Sampler::new(SamplerConfig { seed: Some(43), ..cfg.clone() }).unwrap();
    s.reseed(42).unwrap();
    assert_eq!(s.seed(), 42);
    let d: Vec<u32> = (0..50).map(|_| token(&s.sample(&logits, &[]).unwrap().0)).collect();
    assert_eq!(a, d);
    // Clock seeds differ between samplers.
    let s1 = Sampler::new(SamplerConfig { seed: None, ..cfg.clone() }).unwrap();
    let s2 = Sampler::new(SamplerConfig { seed: None, ..cfg }).unwrap();
    assert_ne!(s1.seed(), s2.seed());
}

/// Draw counts are within 3 sigma of the binomial expectation for every token.
fn check_frequencies(cfg: SamplerConfig, logits: &Array, expected: &[f64], n: usize) {
    let mut counts = vec![0usize; expected.len()];
    for t in draws(&cfg, logits, n) {
        counts[t as usize] += 1;
    }
    for (i, (&c, &p)) in counts.iter().zip(expected).enumerate() {
        let mean = n as f64 * p;
        let sigma = (n as f64 * p * (1.0 - p)).sqrt();
        if p == 0.0 {
            assert_eq!(c, 0, "token {i} has probability 0 but was drawn {c} times");
        } else {
            assert!(
                (c as f64 - mean).abs() <= 3.0 * sigma,
                "token {i}: {c} draws, expected {mean} ± {sigma} (counts {counts:?})"
            );
        }
    }
}

#[test]
fn temperature_one_draws_follow_the_distribution() {
    let (_, logits) = log_row(&[0.2, 0.3, 0.5]);
    let cfg = SamplerConfig { temperature: 1.0, seed: Some(2024), ..Default::default() };
    check_frequencies(cfg, &logits, &[0.2, 0.3, 0.5], 4000);
}

#[test]
fn temperature_half_squares_the_probabilities() {
    // p^(1/T) with T = 0.5: 0.04, 0.09, 0.25 over 0.38.
    let (_, logits) = log_row(&[0.2, 0.3, 0.5]);
    let cfg = SamplerConfig { temperature: 0.5, seed: Some(7), ..Default::default() };
    check_frequencies(cfg, &logits, &[0.04 / 0.38, 0.09 / 0.38, 0.25 / 0.38], 4000);
}

#[test]
fn filters_restrict_the_draws() {
    // Probabilities 0.4, 0.3, 0.2, 0.1. top_p 0.6 keeps ids 0, 1 (renormalised 4/7, 3/7).
    let (_, logits) = log_row(&[0.4, 0.3, 0.2, 0.1]);
    let cfg = SamplerConfig { temperature: 1.0, top_p: 0.6, seed: Some(3), ..Default::default() };
    check_frequencies(cfg, &logits, &[4.0 / 7.0, 3.0 / 7.0, 0.0, 0.0], 2000);
    // min_p 0.4: threshold 0.16 keeps ids 0..=2 (4/9, 3/9, 2/9).
    let cfg = SamplerConfig { temperature: 1.0, min_p: 0.4, seed: Some(4), ..Default::default() };
    check_frequencies(cfg, &logits, &[4.0 / 9.0, 3.0 / 9.0, 2.0 / 9.0, 0.0], 2000);
    // Chain: top_p 0.95 keeps ids 0..=3 (all), min_p 0.4 drops id 3, top_k 2 drops id 2.
    let cfg =
        SamplerConfig { temperature: 1.0, top_p: 0.95, min_p: 0.4, top_k: 2, seed: Some(5), ..Default::default() };
    check_frequencies(cfg, &logits, &[4.0 / 7.0, 3.0 / 7.0, 0.0, 0.0], 2000);
}

#[test]
fn top_k_one_is_greedy() {
    let values: Vec<f32> = (0..50).map(|i| ((i * 37 % 50) as f32 * 0.173).sin() * 3.0).collect();
    let logits = row(&values);
    let argmax = values.iter().enumerate().fold(0, |b, (i, &v)| if v > values[b] { i } else { b }) as u32;
    let mut greedy = Sampler::new(SamplerConfig::default()).unwrap();
    assert_eq!(token(&greedy.sample(&logits, &[]).unwrap().0), argmax);
    let cfg = SamplerConfig { temperature: 1.5, top_k: 1, seed: Some(9), ..Default::default() };
    assert!(draws(&cfg, &logits, 30).iter().all(|&t| t == argmax));
}

#[test]
fn validation_errors_by_field() {
    let ok = SamplerConfig::default();
    ok.validate().unwrap();
    SamplerConfig { temperature: 0.8, top_p: 0.9, top_k: 40, min_p: 0.05, min_tokens_to_keep: 2, ..ok.clone() }
        .validate()
        .unwrap();
    let bad = |cfg: SamplerConfig, field: &str| {
        is_invalid_param(cfg.validate(), field);
        is_invalid_param(Sampler::new(cfg), field);
    };
    bad(SamplerConfig { temperature: -0.1, ..ok.clone() }, "temperature");
    bad(SamplerConfig { temperature: f32::INFINITY, ..ok.clone() }, "temperature");
    bad(SamplerConfig { temperature: f32::NAN, ..ok.clone() }, "temperature");
    bad(SamplerConfig { temperature: 1e-45, ..ok.clone() }, "temperature");
    bad(SamplerConfig { top_p: 0.0, ..ok.clone() }, "top_p");
    bad(SamplerConfig { top_p: 1.01, ..ok.clone() }, "top_p");
    bad(SamplerConfig { min_p: 1.0, ..ok.clone() }, "min_p");
    bad(SamplerConfig { min_p: -0.5, ..ok.clone() }, "min_p");
    bad(SamplerConfig { min_tokens_to_keep: 0, ..ok.clone() }, "min_tokens_to_keep");
    bad(SamplerConfig { repetition_penalty: 0.0, ..ok.clone() }, "repetition_penalty");
    bad(SamplerConfig { repetition_penalty: -1.0, ..ok.clone() }, "repetition_penalty");
    bad(SamplerConfig { repetition_penalty: f32::NAN, ..ok.clone() }, "repetition_penalty");
    bad(SamplerConfig { repetition_context: 0, ..ok.clone() }, "repetition_context");
    bad(SamplerConfig { logit_bias: vec![(1, f32::NAN)], ..ok.clone() }, "logit_bias");
    bad(SamplerConfig { logit_bias: vec![(1, f32::INFINITY)], ..ok.clone() }, "logit_bias");
    // -inf bias (a ban) is allowed.
    SamplerConfig { logit_bias: vec![(1, NEG_INF)], ..ok }.validate().unwrap();
}

#[test]
fn presence_and_frequency_penalties_count_generated_tokens_only() {
    use rmlx_lm::sample::generation_penalties;
    assert_eq!(generation_penalties(&[4, 1, 4, 4], 0.5, 0.25), vec![(1, -0.75), (4, -1.25)]);
    // Prompt [2, 0], then 0 generated twice and 1 once: logits - (0.5 + 0.25 · count).
    let cfg = SamplerConfig { presence_penalty: 0.5, frequency_penalty: 0.25, ..Default::default() };
    let mut s = Sampler::new(cfg).unwrap();
    s.set_prompt_len(2);
    let logits = [3.0f32, 2.5, 1.0, -1.0];
    let got = vals(&s.logprobs(&row(&logits), &[2, 0, 0, 1, 0]).unwrap());
    let penalised = [3.0 - 1.0, 2.5 - 0.75, 1.0, -1.0];
    let lse = penalised.iter().map(|&x: &f32| (x as f64).exp()).sum::<f64>().ln();
    for (g, p) in got.iter().zip(penalised) {
        assert!((*g as f64 - (p as f64 - lse)).abs() < 1e-6, "{got:?}");
    }
    // Greedy turns from the repeated token to the next one.
    assert_eq!(token(&s.sample(&row(&[3.0, 2.5, 1.0, -1.0]), &[2, 0, 0]).unwrap().0), 1);
    // OpenAI's range.
    let bad = SamplerConfig { frequency_penalty: 2.5, ..Default::default() };
    is_invalid_param(bad.validate(), "frequency_penalty");
}
