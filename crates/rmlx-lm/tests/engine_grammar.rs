//! Structured output in the continuous-batching engine: sequences with a grammar produce text
//! in the grammar and stop where it ends, whatever the sampler draws, while the unconstrained
//! sequences of the same batch decode exactly what they decode alone; a grammar that does not
//! compile is refused at submission.

use rmlx_lm::engine::{Engine, EngineOptions, Request, SeqId, Update};
use rmlx_lm::grammar::Grammar;
use rmlx_lm::sample::SamplerConfig;
use rmlx_lm::{Error, FinishReason, GenerateOptions};
use std::collections::HashMap;

#[test]
fn constrained_rows_follow_their_grammar_and_the_others_are_untouched() {
    // The default model: grammars need a real (byte-level) tokenizer.
    let lm = rmlx_lm::loader::load(rmlx_lm::registry::default_model().unwrap(), &Default::default()).unwrap();
    let p = lm.encode_prompt("Name an animal and a number, then list some letters.", true, None).unwrap();
    let sampled = |seed| GenerateOptions {
        max_tokens: 40,
        sampler: SamplerConfig { temperature: 1.0, seed: Some(seed), ..SamplerConfig::default() },
        ..GenerateOptions::default()
    };
    let greedy = GenerateOptions { max_tokens: 12, ignore_eos: true, ..GenerateOptions::default() };
    let rx = "(cat|dog)-[0-9]{2}";
    let lark = r#"start: "[" item "," item "]"
item: /[a-c]/"#;
    let mut engine = Engine::new(&lm, EngineOptions { prefill_tokens: 7, ..EngineOptions::default() });
    let mut plan: Vec<(SeqId, Option<&str>)> = Vec::new();
    for seed in 0..4 {
        let r = Request {
            prompt: p.clone(),
            options: sampled(seed),
            grammar: Some(Grammar::Regex(rx.into())),
            ..Default::default()
        };
        plan.push((engine.submit(r).unwrap(), Some("regex")));
        let r = Request {
            prompt: p[2..9].to_vec(),
            options: sampled(seed),
            grammar: Some(Grammar::Lark(lark.into())),
            ..Default::default()
        };
        plan.push((engine.submit(r).unwrap(), Some("lark")));
    }
    let free = Request { prompt: p[3..12].to_vec(), options: greedy.clone(), ..Default::default() };
    plan.push((engine.submit(free).unwrap(), None));

    let mut text: HashMap<SeqId, String> = HashMap::new();
    let mut tokens: HashMap<SeqId, Vec<u32>> = HashMap::new();
    let mut finish = HashMap::new();
    while !engine.is_idle() {
        for u in engine.step().unwrap() {
            match u {
                Update::Token { seq, id, text: t, .. } => {
                    tokens.entry(seq).or_default().push(id);
                    *text.entry(seq).or_default() += &t;
                }
                Update::Text { seq, text: t } => *text.entry(seq).or_default() += &t,
                Update::Finished { seq, reason, .. } => drop(finish.insert(seq, reason)),
                Update::Failed { seq, error } => panic!("request {seq} failed: {error}"),
                Update::Started { .. } => {}
            }
        }
    }
    let whole = |re: &str, s: &str| {
        // A tiny matcher for the two shapes used here.
        match re {
            "regex" => {
                let (word, num) = s.split_once('-').unwrap_or(("", ""));
                ["cat", "dog"].contains(&word) && num.len() == 2 && num.bytes().all(|b| b.is_ascii_digit())
            }
            _ => {
                let inner = s.strip_prefix('[').and_then(|r| r.strip_suffix(']')).unwrap_or("");
                inner.split(',').count() == 2 && inner.split(',').all(|i| ["a", "b", "c"].contains(&i))
            }
        }
    };
    let mut distinct = std::collections::HashSet::new();
    for (seq, kind) in &plan {
        match kind {
            Some(kind) => {
                let t = &text[seq];
                assert!(whole(kind, t), "{kind}: {t:?}");
                assert_eq!(finish[seq], FinishReason::Eos, "{kind}: {t:?} ends with the grammar");
                distinct.insert(t.clone());
            }
            None => {
                let alone: Vec<u32> = lm.generate(&p[3..12], &greedy).unwrap().map(|t| t.unwrap().id).collect();
                assert_eq!(tokens[seq], alone, "the unconstrained row");
            }
        }
    }
    assert!(distinct.len() >= 3, "sampling still chooses within the grammar: {distinct:?}");

    let bad = Request { prompt: p.clone(), grammar: Some(Grammar::Regex("[a-".into())), ..Default::default() };
    let err = engine.submit(bad).unwrap_err();
    assert!(matches!(&err, Error::InvalidParameter(m) if m.contains("does not compile")), "{err}");
    let bad =
        Request { prompt: p, grammar: Some(Grammar::JsonSchema(serde_json::json!({"type": 7}))), ..Default::default() };
    assert!(matches!(engine.submit(bad), Err(Error::InvalidParameter(_))));
}

/// Requests that would fail a step (a bias on a token beyond the vocabulary, a regex whose
/// language is empty, a schema whose `$ref`s only loop) are refused at submission, naming what
/// is wrong in one line; the requests running beside them decode exactly what they decode alone.
#[test]
fn poisoned_requests_are_refused_and_the_others_keep_their_tokens() {
    let lm = rmlx_lm::loader::load(rmlx_lm::registry::default_model().unwrap(), &Default::default()).unwrap();
    let p = lm.encode_prompt("Write a short story about a robot.", true, None).unwrap();
    let greedy = GenerateOptions { max_tokens: 10, ignore_eos: true, ..GenerateOptions::default() };
    let seeded = GenerateOptions {
        sampler: SamplerConfig { temperature: 0.8, seed: Some(5), ..SamplerConfig::default() },
        ..greedy.clone()
    };
    let mut engine = Engine::new(&lm, EngineOptions::default());
    let good: Vec<(SeqId, GenerateOptions)> = [greedy.clone(), seeded.clone()]
        .into_iter()
        .map(|o| (engine.submit(Request { prompt: p.clone(), options: o.clone(), ..Default::default() }).unwrap(), o))
        .collect();
    let biased = GenerateOptions {
        sampler: SamplerConfig { logit_bias: vec![(9_999_999, 1.0)], ..SamplerConfig::default() },
        ..greedy.clone()
    };
    let looping = serde_json::json!({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}});
    let poisoned = [
        (Request { prompt: p.clone(), options: biased, ..Default::default() }, "logit_bias names token 9999999"),
        (
            Request { prompt: p.clone(), grammar: Some(Grammar::Regex(r"[^\s\S]".into())), ..Default::default() },
            "grammar",
        ),
        (Request { prompt: p.clone(), grammar: Some(Grammar::JsonSchema(looping)), ..Default::default() }, "grammar"),
    ];
    for (r, what) in poisoned {
        match engine.submit(r) {
            Err(Error::InvalidParameter(m)) => assert!(m.contains(what) && !m.contains('\n'), "{m}"),
            other => panic!("{what}: {other:?}"),
        }
    }
    let mut tokens: HashMap<SeqId, Vec<u32>> = HashMap::new();
    while !engine.is_idle() {
        for u in engine.step().unwrap() {
            match u {
                Update::Token { seq, id, .. } => tokens.entry(seq).or_default().push(id),
                Update::Failed { seq, error } => panic!("request {seq} failed: {error}"),
                _ => {}
            }
        }
    }
    for (seq, o) in good {
        let alone: Vec<u32> = lm.generate(&p, &o).unwrap().map(|t| t.unwrap().id).collect();
        assert_eq!(tokens[&seq], alone);
    }
}
