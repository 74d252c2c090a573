//! Speculative decoding in the batching engine (`Engine::with_speculation`): every request of a
//! batch decodes, token for token, what it decodes alone with plain greedy decoding — rows with
//! drafts of different lengths, each keeping its own share of them, beside rows that do not
//! speculate (turned off, top log-probabilities, a repetition penalty), requests joining
//! mid-way, sliding-window layers, packed keys and values; sampled output distributed as the
//! model's own (chi-square of the first two tokens against the exact distribution).

mod common;

use common::{fixture_with_tokenizer, ids, reference};
use rmlx_lm::engine::{Engine, EngineOptions, Request, SeqId, Update, Usage};
use rmlx_lm::sample::SamplerConfig;
use rmlx_lm::speculative::{Drafter, Speculation};
use rmlx_lm::{GenerateOptions, LoadOptions, LoadedModel};
use std::collections::HashMap;

fn load(name: &str) -> (common::TempDir, LoadedModel) {
    let dir = fixture_with_tokenizer(name);
    let lm = rmlx_lm::loader::load(dir.path(), &LoadOptions::default()).unwrap();
    (dir, lm)
}

fn greedy(max_tokens: usize) -> GenerateOptions {
    GenerateOptions { max_tokens, ignore_eos: true, ..GenerateOptions::default() }
}

fn alone(lm: &LoadedModel, prompt: &[u32], opts: &GenerateOptions) -> Vec<u32> {
    lm.generate(prompt, opts).unwrap().map(|t| t.unwrap().id).collect()
}

/// Steps until idle: each request's tokens and usage.
fn drain(engine: &mut Engine, out: &mut HashMap<SeqId, (Vec<u32>, Usage)>) {
    while !engine.is_idle() {
        step(engine, out);
    }
}

fn step(engine: &mut Engine, out: &mut HashMap<SeqId, (Vec<u32>, Usage)>) {
    for u in engine.step().unwrap() {
        match u {
            Update::Token { seq, id, .. } => out.entry(seq).or_default().0.push(id),
            Update::Finished { seq, usage, .. } => out.entry(seq).or_default().1 = usage,
            Update::Failed { seq, error } => panic!("request {seq} failed: {error}"),
            _ => {}
        }
    }
}

/// The same tokens as `want`, where the products round alike. On a GPU with TF32 products (its
/// default) a pass of several rows and a step of one row round differently, and the float32
/// fixtures' near ties then go either way: there only the count is compared (this file passes on
/// an H100 with `MLX_ENABLE_TF32=0`, every token the same).
fn same_tokens(got: &[u32], want: &[u32], what: &str) {
    match common::tf32() {
        false => assert_eq!(got, want, "{what}"),
        true => assert_eq!(got.len(), want.len(), "{what}"),
    }
}

fn request(prompt: &[u32], options: GenerateOptions) -> Request {
    Request { prompt: prompt.to_vec(), options, ..Default::default() }
}

/// Four requests (two first, two joining after 3 steps, one of them with fewer tokens to go),
/// plus one that does not speculate, through an engine speculating with `drafter`: each decodes
/// what it decodes alone. Returns the drafted and kept tokens of the speculating ones.
fn batch_as_alone(lm: &LoadedModel, drafter: Drafter, k: usize, opts: EngineOptions) -> (usize, usize) {
    let r = reference("llama_gqa");
    let p = ids(&r["prompt_ids"]);
    let prompts: Vec<Vec<u32>> = vec![
        p.clone(),
        vec![1, 17, 42, 99, 5, 17, 42, 99, 5, 17, 42],
        p[2..17].iter().rev().copied().collect(),
        vec![p[5], p[1], p[9]],
        p[..9].to_vec(),
    ];
    let mut engine = Engine::new(lm, opts).with_speculation(Speculation { drafter, num_draft_tokens: k }).unwrap();
    let mut out = HashMap::new();
    let budgets = [20, 20, 20, 5, 20];
    let mut seqs = Vec::new();
    let submit = |engine: &mut Engine, i: usize| {
        let mut r = request(&prompts[i], greedy(budgets[i]));
        r.speculative = i != 4;
        engine.submit(r).unwrap()
    };
    seqs.push(submit(&mut engine, 0));
    seqs.push(submit(&mut engine, 4));
    seqs.push(submit(&mut engine, 1));
    for _ in 0..3 {
        step(&mut engine, &mut out);
    }
    seqs.push(submit(&mut engine, 2));
    seqs.push(submit(&mut engine, 3));
    drain(&mut engine, &mut out);
    let (mut drafted, mut kept) = (0, 0);
    for (seq, i) in seqs.iter().zip([0, 4, 1, 2, 3]) {
        let (tokens, usage) = &out[seq];
        same_tokens(tokens, &alone(lm, &prompts[i], &greedy(budgets[i])), &format!("prompt {i}: {usage:?}"));
        assert_eq!(usage.completion_tokens, budgets[i]);
        if i == 4 {
            assert_eq!(usage.draft_tokens, 0, "speculative: false drafts nothing");
        }
        drafted += usage.draft_tokens;
        kept += usage.accepted_draft_tokens;
    }
    assert_eq!(engine.kv_bytes(), 0);
    (drafted, kept)
}

#[test]
fn a_speculating_batch_decodes_what_each_request_decodes_alone() {
    let (_a, lm) = load("llama_gqa");
    let (_b, q4) = load("llama_gqa_q4");
    let (_c, other) = load("qwen3");
    let small = EngineOptions { prefill_tokens: 5, ..EngineOptions::default() };
    let mut rates = Vec::new();
    for (name, drafter, k) in [
        ("itself", Drafter::Model(&lm), 4),
        ("4-bit", Drafter::Model(&q4), 3),
        ("another model", Drafter::Model(&other), 5),
        ("prompt lookup", Drafter::PromptLookup { max_ngram: 3, min_ngram: 1 }, 4),
    ] {
        let (drafted, kept) = batch_as_alone(&lm, drafter, k, small.clone());
        assert!(drafted > 0, "{name}");
        rates.push((name, kept as f64 / drafted as f64));
    }
    assert!(rates[0].1 > 0.95 && rates[1].1 > 0.2 && rates[2].1 < 0.2 && rates[3].1 > 0.0, "{rates:?}");
    // Prompts computed together in one pass, and a batch too large to speculate.
    batch_as_alone(&lm, Drafter::Model(&q4), 2, EngineOptions::default());
    let (drafted, _) = batch_as_alone(
        &lm,
        Drafter::Model(&q4),
        2,
        EngineOptions { speculative_max_batch: 1, prefill_tokens: 5, ..EngineOptions::default() },
    );
    assert!(drafted > 0, "a request running alone speculates");
}

/// Sliding-window layers (Gemma 3's local layers, Mistral's window: 8 positions) and packed keys
/// and values: rows trimmed apart still see exactly their own positions.
#[test]
fn windows_and_packed_caches() {
    for name in ["gemma3_text", "mistral_window"] {
        let (_a, lm) = load(name);
        let a: Vec<u32> = (0..20).map(|i| (i * 37 + 11) % 256).collect();
        let b: Vec<u32> = [3, 9, 4, 3, 9, 4, 3, 9, 4, 3, 9].to_vec();
        for drafter in [Drafter::Model(&lm), Drafter::PromptLookup { max_ngram: 2, min_ngram: 1 }] {
            let spec = Speculation { drafter, num_draft_tokens: 3 };
            let mut engine = Engine::new(&lm, EngineOptions::default()).with_speculation(spec).unwrap();
            let mut out = HashMap::new();
            let sa = engine.submit(request(&a, greedy(90))).unwrap();
            step(&mut engine, &mut out);
            let sb = engine.submit(request(&b, greedy(90))).unwrap();
            drain(&mut engine, &mut out);
            same_tokens(&out[&sa].0, &alone(&lm, &a, &greedy(90)), name);
            same_tokens(&out[&sb].0, &alone(&lm, &b, &greedy(90)), name);
            assert!(out[&sa].1.draft_tokens > 0, "{name}");
        }
    }
    // 4-bit keys and values from the first position (and Gemma 3's windows): the same tokens as
    // the plain engine's. (A float32 model: in bfloat16, a pass over several positions rounds
    // unlike one over a single position, and greedy choices this close part ways.)
    let (_a, lm) = load("gemma3_text");
    let q = rmlx_lm::cache::KvQuantization { bits: 4, group_size: 32, start: 0 };
    let opts = EngineOptions { kv_quantization: Some(q), ..EngineOptions::default() };
    let prompts: [&[u32]; 2] = [&[1, 17, 42, 99, 5, 17, 42, 99, 5], &[7, 7, 3, 8]];
    let run = |spec: Option<Speculation>| {
        let mut engine = Engine::new(&lm, opts.clone());
        if let Some(s) = spec {
            engine = engine.with_speculation(s).unwrap();
        }
        let mut out = HashMap::new();
        let seqs: Vec<SeqId> = prompts.iter().map(|p| engine.submit(request(p, greedy(40))).unwrap()).collect();
        drain(&mut engine, &mut out);
        seqs.iter().map(|s| out[s].clone()).collect::<Vec<_>>()
    };
    let plain = run(None);
    let fast = run(Some(Speculation { drafter: Drafter::Model(&lm), num_draft_tokens: 3 }));
    for (p, f) in plain.iter().zip(&fast) {
        assert_eq!(p.0, f.0);
        assert!(f.1.draft_tokens > 0);
    }
}

/// Rows that cannot speculate (top log-probabilities asked for, a repetition penalty) take plain
/// steps inside a speculating batch, their log-probabilities and alternatives as alone.
#[test]
fn rows_that_do_not_speculate_share_the_batch() {
    let (_a, lm) = load("llama_gqa");
    let prompt: Vec<u32> = vec![1, 17, 42, 99, 5, 17, 42, 99, 5];
    let spec = Speculation { drafter: Drafter::Model(&lm), num_draft_tokens: 3 };
    let mut engine = Engine::new(&lm, EngineOptions::default()).with_speculation(spec).unwrap();
    let penalised = GenerateOptions {
        sampler: SamplerConfig { repetition_penalty: 1.3, ..SamplerConfig::default() },
        ..greedy(12)
    };
    let mut logprobs = HashMap::new();
    // The draft cache's first row holds nothing (a row that does not speculate), the next one
    // joins it; the third request joins a running batch.
    let with_top = engine.submit(Request { top_logprobs: 2, ..request(&prompt[2..], greedy(12)) }).unwrap();
    let fast = engine.submit(request(&prompt, greedy(12))).unwrap();
    let mut pen = None;
    let mut out: HashMap<SeqId, (Vec<u32>, Usage)> = HashMap::new();
    while !engine.is_idle() || pen.is_none() {
        if pen.is_none() && !out.is_empty() {
            pen = Some(engine.submit(request(&prompt[1..], penalised.clone())).unwrap());
        }
        for u in engine.step().unwrap() {
            match u {
                Update::Token { seq, id, logprob, top, .. } => {
                    out.entry(seq).or_default().0.push(id);
                    logprobs.entry(seq).or_insert_with(Vec::new).push((logprob, top.len()));
                }
                Update::Finished { seq, usage, .. } => out.entry(seq).or_default().1 = usage,
                Update::Failed { error, .. } => panic!("{error}"),
                _ => {}
            }
        }
    }
    let pen = pen.unwrap();
    same_tokens(&out[&fast].0, &alone(&lm, &prompt, &greedy(12)), "speculating");
    same_tokens(&out[&with_top].0, &alone(&lm, &prompt[2..], &greedy(12)), "top log-probabilities");
    same_tokens(&out[&pen].0, &alone(&lm, &prompt[1..], &penalised), "penalised");
    assert!(out[&fast].1.draft_tokens > 0);
    assert_eq!((out[&with_top].1.draft_tokens, out[&pen].1.draft_tokens), (0, 0));
    assert!(logprobs[&with_top].iter().all(|&(_, n)| n == 2));
    // The speculating row's log-probabilities are the plain run's.
    // (TF32 products round a pass and a step apart: 3.1e-4 on an H100.)
    let want: Vec<f32> = lm.generate(&prompt, &greedy(12)).unwrap().map(|t| t.unwrap().logprob).collect();
    let tol = if common::tf32() { 1e-2 } else { 1e-4 };
    for ((got, _), want) in logprobs[&fast].iter().zip(want) {
        assert!((got - want).abs() < tol, "{got} vs {want}");
    }
}

/// Seeded sampling through a speculating batch (8 requests at a time, a 4-bit draft): the first
/// three tokens over 900 seeds (the first comes from the prompt's pass, the next two from a
/// verification of one draft) against their exact probabilities, chi-square at the 0.1 % level
/// (outcomes expected fewer than 5 times pooled).
#[test]
fn sampled_output_is_distributed_as_the_models() {
    let (_a, lm) = load("llama_gqa");
    let (_b, q4) = load("llama_gqa_q4");
    let prompt: Vec<u32> = vec![1, 17, 42, 99, 5];
    let sampler = SamplerConfig { temperature: 1.0, top_k: 3, ..Default::default() };
    let dist = |ids: &[u32]| common::next_token_distribution(&lm, &sampler, ids);
    let mut expected = HashMap::new();
    for (t1, p1) in dist(&prompt) {
        for (t2, p2) in dist(&[&prompt[..], &[t1]].concat()) {
            for (t3, p3) in dist(&[&prompt[..], &[t1, t2]].concat()) {
                expected.insert(vec![t1, t2, t3], p1 * p2 * p3);
            }
        }
    }
    let runs = 900;
    let spec = Speculation { drafter: Drafter::Model(&q4), num_draft_tokens: 2 };
    let mut engine =
        Engine::new(&lm, EngineOptions { max_batch: 8, ..EngineOptions::default() }).with_speculation(spec).unwrap();
    let mut out = HashMap::new();
    for seed in 0..runs {
        let opts = GenerateOptions { sampler: SamplerConfig { seed: Some(seed), ..sampler.clone() }, ..greedy(3) };
        engine.submit(request(&prompt, opts)).unwrap();
    }
    drain(&mut engine, &mut out);
    let mut seen = HashMap::<Vec<u32>, usize>::new();
    let (mut drafted, mut kept) = (0, 0);
    for (tokens, usage) in out.values() {
        *seen.entry(tokens.clone()).or_default() += 1;
        drafted += usage.draft_tokens;
        kept += usage.accepted_draft_tokens;
    }
    assert!(seen.keys().all(|k| expected.contains_key(k)), "{seen:?}");
    // Bins expected at least 5 times, and one for the rest.
    let (mut chi2, mut bins, mut rest_e, mut rest_o) = (0.0, 0, 0.0, 0.0);
    for (k, p) in &expected {
        let (e, o) = (p * runs as f64, *seen.get(k).unwrap_or(&0) as f64);
        if e < 5.0 {
            (rest_e, rest_o) = (rest_e + e, rest_o + o);
        } else {
            chi2 += (o - e) * (o - e) / e;
            bins += 1;
        }
    }
    if rest_e > 0.0 {
        chi2 += (rest_o - rest_e) * (rest_o - rest_e) / rest_e;
        bins += 1;
    }
    // P(chi2 > x) = 0.001 for 1..=26 degrees of freedom.
    const CRITICAL: [f64; 26] = [
        10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26, 32.91, 34.53, 36.12, 37.70, 39.25,
        40.79, 42.31, 43.82, 45.31, 46.80, 48.27, 49.73, 51.18, 52.62, 54.05,
    ];
    assert!(bins >= 10, "{bins} bins");
    assert!(chi2 < CRITICAL[bins - 2], "chi2 {chi2:.2} over {bins} bins; seen {seen:?}; expected {expected:?}");
    assert!(kept > 0 && kept < drafted, "{kept} of {drafted} drafts kept");
}

#[test]
fn refusals() {
    let (_a, lm) = load("llama_gqa");
    let (_b, gemma) = load("gemma3_text");
    let err =
        |s: Speculation| Engine::new(&lm, EngineOptions::default()).with_speculation(s).err().unwrap().to_string();
    assert!(err(Speculation { drafter: Drafter::Model(&gemma), num_draft_tokens: 2 }).contains("share the vocabulary"));
    assert!(err(Speculation { drafter: Drafter::Model(&lm), num_draft_tokens: 0 }).contains("at least 1 draft token"));
}

/// The keys and values' budget counts the draft model's beside the model's: a request that
/// exactly fits the model's alone is refused when a draft model (here the model itself: twice
/// the bytes) speculates, and fits with prompt lookup, which keeps none.
#[test]
fn the_budget_counts_the_draft_models_keys_and_values() {
    let (_a, lm) = load("llama_gqa");
    assert!(lm.layer_windows().iter().all(Option::is_none));
    let (prompt, max_tokens) = (vec![1, 17, 42, 99, 5], 12);
    let need = lm.layer_windows().len() * (prompt.len() + max_tokens) * lm.kv_bytes_per_layer_position();
    let opts = EngineOptions { max_kv_bytes: Some(need), ..EngineOptions::default() };
    let plain = Engine::new(&lm, opts.clone()).submit(request(&prompt, greedy(max_tokens)));
    assert!(plain.is_ok(), "{plain:?}");
    let lookup = Speculation { drafter: Drafter::PromptLookup { max_ngram: 3, min_ngram: 1 }, num_draft_tokens: 2 };
    let mut engine = Engine::new(&lm, opts.clone()).with_speculation(lookup).unwrap();
    assert!(engine.submit(request(&prompt, greedy(max_tokens))).is_ok());
    let draft = Speculation { drafter: Drafter::Model(&lm), num_draft_tokens: 2 };
    let mut engine = Engine::new(&lm, opts).with_speculation(draft).unwrap();
    let err = engine.submit(request(&prompt, greedy(max_tokens))).unwrap_err();
    assert!(matches!(err, rmlx_lm::Error::Prompt(_)) && err.to_string().contains("keys and values"), "{err}");
}

/// A seeded, sampled request that speculates draws the same tokens beside a request that does
/// not as alone: a verification pass samples a plain token for the rows without drafts only, and
/// draws nothing from the speculating rows' streams there.
#[test]
fn a_speculating_rows_draws_do_not_depend_on_its_neighbours() {
    let (_a, lm) = load("llama_gqa");
    let spec = Speculation { drafter: Drafter::PromptLookup { max_ngram: 3, min_ngram: 1 }, num_draft_tokens: 3 };
    let sampler = SamplerConfig { temperature: 1.0, top_k: 3, ..Default::default() };
    let speculating = vec![1, 17, 42, 99, 5, 17, 42, 99, 5, 17, 42, 99, 5, 17, 42];
    let run = |seed: u64, beside: bool| {
        let mut engine = Engine::new(&lm, EngineOptions::default()).with_speculation(spec).unwrap();
        let mut out = HashMap::new();
        let opts = GenerateOptions { sampler: SamplerConfig { seed: Some(seed), ..sampler.clone() }, ..greedy(24) };
        let id = engine.submit(request(&speculating, opts)).unwrap();
        if beside {
            let mut plain = request(&[3, 8, 21, 60], GenerateOptions { sampler: sampler.clone(), ..greedy(24) });
            plain.speculative = false;
            engine.submit(plain).unwrap();
        }
        drain(&mut engine, &mut out);
        out[&id].clone()
    };
    let mut drafted = 0;
    for seed in 0..4 {
        let ((alone, usage), (beside, _)) = (run(seed, false), run(seed, true));
        drafted += usage.draft_tokens;
        assert_eq!(alone, beside, "seed {seed}: the same tokens beside a request that does not speculate");
    }
    assert!(drafted > 0, "the requests speculate");
}
