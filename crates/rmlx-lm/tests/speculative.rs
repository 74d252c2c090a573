//! Speculative decoding (`rmlx_lm::speculative`): greedy output equal to the plain run's, token
//! for token, with every drafter (the model itself: all kept; its 4-bit copy: some kept; another
//! model: few; prompt lookup), over caches that are trimmed back; sampled output distributed as the
//! model's own (a chi-square test of the first two tokens over 600 seeds against the exact
//! distribution); vocabulary mismatches and bad settings refused.

mod common;

use common::fixture_with_tokenizer;
use rmlx::Array;
use rmlx_lm::sample::SamplerConfig;
use rmlx_lm::speculative::{Drafter, Speculation};
use rmlx_lm::{GenerateOptions, LoadedModel};

fn load(name: &str) -> (common::TempDir, LoadedModel) {
    let dir = fixture_with_tokenizer(name);
    let lm = rmlx_lm::loader::load(dir.path(), &Default::default()).unwrap();
    (dir, lm)
}

fn plain(lm: &LoadedModel, prompt: &[u32], opts: &GenerateOptions) -> Vec<u32> {
    lm.generate(prompt, opts).unwrap().map(|t| t.unwrap().id).collect()
}

fn speculative(
    lm: &LoadedModel,
    prompt: &[u32],
    opts: &GenerateOptions,
    s: Speculation,
) -> (Vec<u32>, rmlx_lm::speculative::Acceptance) {
    let mut g = lm.generate_speculative(prompt, opts, s).unwrap();
    let ids = g.by_ref().map(|t| t.unwrap().id).collect();
    (ids, g.acceptance())
}

#[test]
fn greedy_output_is_the_plain_runs() {
    let (_a, lm) = load("llama_gqa");
    let (_b, q4) = load("llama_gqa_q4");
    let (_c, other) = load("qwen3");
    let opts = GenerateOptions { max_tokens: 40, ignore_eos: true, ..Default::default() };
    let prompt: Vec<u32> = vec![1, 17, 42, 99, 5, 17, 42, 99, 5, 17, 42];
    let want = plain(&lm, &prompt, &opts);
    assert_eq!(want.len(), 40);
    let mut rates = Vec::new();
    for (name, drafter, k) in [
        ("itself", Drafter::Model(&lm), 4),
        ("4-bit", Drafter::Model(&q4), 3),
        ("another model", Drafter::Model(&other), 5),
        ("prompt lookup", Drafter::PromptLookup { max_ngram: 3, min_ngram: 1 }, 4),
    ] {
        let (got, acc) = speculative(&lm, &prompt, &opts, Speculation { drafter, num_draft_tokens: k });
        assert_eq!(got, want, "{name}: {acc:?}");
        assert!(acc.drafted > 0, "{name}: {acc:?}");
        // Every kept draft saves a pass of the model.
        assert_eq!(acc.steps + acc.accepted, 40, "{name}: {acc:?}");
        rates.push((name, acc.rate()));
    }
    // The model drafting for itself keeps every draft, its 4-bit copy some, another model
    // (random weights) none; prompt lookup some.
    assert_eq!(rates[0].1, 1.0, "{rates:?}");
    assert!(rates[1].1 > 0.2 && rates[2].1 < 0.2 && rates[3].1 > 0.0, "{rates:?}");
    // A budget that ends inside a round, and one token.
    for max_tokens in [1, 2, 7] {
        let o = GenerateOptions { max_tokens, ..opts.clone() };
        let (got, _) = speculative(&lm, &prompt, &o, Speculation { drafter: Drafter::Model(&q4), num_draft_tokens: 4 });
        assert_eq!(got, want[..max_tokens], "max_tokens {max_tokens}");
    }
}

/// A window that slides (a context limit turns every cache into a rotating one) cannot take
/// positions back: rounds become plain steps there, and the output stays the plain run's.
#[test]
fn sliding_windows_fall_back_to_plain_steps() {
    let (_a, lm) = load("llama_gqa");
    let opts = GenerateOptions { max_tokens: 30, ignore_eos: true, context_limit: Some(20), ..Default::default() };
    let prompt: Vec<u32> = vec![3, 8, 13, 8, 13, 8];
    let want = plain(&lm, &prompt, &opts);
    let (got, acc) =
        speculative(&lm, &prompt, &opts, Speculation { drafter: Drafter::Model(&lm), num_draft_tokens: 3 });
    assert_eq!(got, want);
    assert!(acc.drafted > 0 && acc.steps > 10, "{acc:?}");
}

/// The first two sampled tokens (temperature 1, top-k 3: nine outcomes) over 600 seeds, against
/// their exact probabilities under the model: a chi-square test at the 0.1 % level. The 4-bit
/// draft disagrees with the model often enough that kept drafts, residual draws and bonus tokens
/// all occur.
#[test]
fn sampled_output_is_distributed_as_the_models() {
    let (_a, lm) = load("llama_gqa");
    let (_b, q4) = load("llama_gqa_q4");
    let prompt: Vec<u32> = vec![1, 17, 42, 99, 5];
    let sampler = SamplerConfig { temperature: 1.0, top_k: 3, ..Default::default() };
    // Exact p(t1) and p(t2 | t1) from the model's logits through the same sampling chain.
    let dist = |ids: &[u32]| common::next_token_distribution(&lm, &sampler, ids);
    let mut expected = std::collections::HashMap::new();
    for (t1, p1) in dist(&prompt) {
        let mut next = prompt.clone();
        next.push(t1);
        for (t2, p2) in dist(&next) {
            expected.insert((t1, t2), p1 * p2);
        }
    }
    assert_eq!(expected.len(), 9);
    let runs = 600;
    let mut seen = std::collections::HashMap::<(u32, u32), usize>::new();
    let (mut drafted, mut kept) = (0, 0);
    for seed in 0..runs {
        let opts = GenerateOptions {
            max_tokens: 2,
            ignore_eos: true,
            sampler: SamplerConfig { seed: Some(seed), ..sampler.clone() },
            ..Default::default()
        };
        let mut g = lm
            .generate_speculative(&prompt, &opts, Speculation { drafter: Drafter::Model(&q4), num_draft_tokens: 2 })
            .unwrap();
        let ids: Vec<u32> = g.by_ref().map(|t| t.unwrap().id).collect();
        drafted += g.acceptance().drafted;
        kept += g.acceptance().accepted;
        *seen.entry((ids[0], ids[1])).or_default() += 1;
    }
    assert!(seen.keys().all(|k| expected.contains_key(k)), "{seen:?}");
    let chi2: f64 = expected
        .iter()
        .map(|(k, p)| {
            let e = p * runs as f64;
            let o = *seen.get(k).unwrap_or(&0) as f64;
            (o - e) * (o - e) / e
        })
        .sum();
    // 8 degrees of freedom: P(chi2 > 26.12) = 0.001.
    assert!(chi2 < 26.12, "chi2 {chi2:.2}; seen {seen:?}; expected {expected:?}");
    assert!(kept > 0 && kept < drafted, "{kept} of {drafted} drafts kept");
    // Prompt lookup drafts certain tokens (q = 1): the same test of its acceptance rule, shorter.
    let lookup_prompt: Vec<u32> = vec![4, 9, 4, 9, 4, 9, 4];
    let exact = dist(&lookup_prompt);
    let mut counts = std::collections::HashMap::<u32, usize>::new();
    for seed in 0..300 {
        let opts = GenerateOptions {
            max_tokens: 1,
            sampler: SamplerConfig { seed: Some(seed), ..sampler.clone() },
            ignore_eos: true,
            ..Default::default()
        };
        let s = Speculation { drafter: Drafter::PromptLookup { max_ngram: 2, min_ngram: 1 }, num_draft_tokens: 2 };
        let ids: Vec<u32> = lm.generate_speculative(&lookup_prompt, &opts, s).unwrap().map(|t| t.unwrap().id).collect();
        *counts.entry(ids[0]).or_default() += 1;
    }
    let chi2: f64 = exact
        .iter()
        .map(|(t, p)| {
            let e = p * 300.0;
            let o = *counts.get(t).unwrap_or(&0) as f64;
            (o - e) * (o - e) / e
        })
        .sum();
    // 2 degrees of freedom: P(chi2 > 13.82) = 0.001.
    assert!(chi2 < 13.82, "chi2 {chi2:.2}; {counts:?} vs {exact:?}");
}

#[test]
fn prompt_lookup_finds_the_latest_match() {
    use rmlx_lm::speculative::lookup;
    assert_eq!(lookup(&[1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3, 1, 2), vec![7, 1]);
    assert_eq!(lookup(&[5, 6, 7, 5], 3, 1, 4), vec![6, 7, 5]);
    assert!(lookup(&[1, 2, 3], 2, 1, 4).is_empty());
    assert!(lookup(&[], 2, 1, 4).is_empty());
}

#[test]
fn refusals() {
    let (_a, lm) = load("llama_gqa");
    let (_b, gemma) = load("gemma3_text");
    let opts = GenerateOptions { max_tokens: 4, ..Default::default() };
    let err = |s: Speculation| lm.generate_speculative(&[1, 2], &opts, s).err().expect("refused").to_string();
    assert!(err(Speculation { drafter: Drafter::Model(&gemma), num_draft_tokens: 2 }).contains("share the vocabulary"));
    assert!(err(Speculation { drafter: Drafter::Model(&lm), num_draft_tokens: 0 }).contains("at least 1 draft token"));
    assert!(err(Speculation { drafter: Drafter::PromptLookup { max_ngram: 1, min_ngram: 2 }, num_draft_tokens: 2 })
        .contains("n-gram"));
    let _ = Array::scalar(0.0f32);
}

/// A conversation's second turn starts from the caches the first left: the shared prompt is not
/// computed again, and the tokens are the plain run's of the whole second prompt.
#[test]
fn a_conversation_continues_from_its_caches() {
    let (_a, lm) = load("llama_gqa");
    let (_b, q4) = load("llama_gqa_q4");
    let opts = GenerateOptions { max_tokens: 12, ignore_eos: true, ..Default::default() };
    let spec = || Speculation { drafter: Drafter::Model(&q4), num_draft_tokens: 3 };
    let first: Vec<u32> = vec![1, 17, 42, 99, 5, 17];
    let mut g = lm.generate_speculative(&first, &opts, spec()).unwrap();
    let reply: Vec<u32> = g.by_ref().map(|t| t.unwrap().id).collect();
    assert_eq!(reply, plain(&lm, &first, &opts));
    let state = g.into_state();
    // The caches hold the prompt and the reply but its last token (not computed yet).
    assert_eq!(state.tokens(), [&first[..], &reply[..11]].concat());
    let second: Vec<u32> = [&first[..], &reply[..], &[7, 8, 9]].concat();
    let mut g = lm.generate_speculative_after(state, &second, &opts, spec()).unwrap();
    let next: Vec<u32> = g.by_ref().map(|t| t.unwrap().id).collect();
    assert_eq!(g.cached_tokens(), first.len() + 11);
    assert_eq!(next, plain(&lm, &second, &opts));
    // A prompt that leaves the conversation (another first message) starts over where they part.
    let state = g.into_state();
    let other: Vec<u32> = vec![1, 17, 3, 3];
    let mut g = lm.generate_speculative_after(state, &other, &opts, spec()).unwrap();
    let ids: Vec<u32> = g.by_ref().map(|t| t.unwrap().id).collect();
    assert_eq!(g.cached_tokens(), 2);
    assert_eq!(ids, plain(&lm, &other, &opts));
}
