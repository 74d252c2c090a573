//! Run-time soundness of generation and scoring: ids are checked against the embedding before
//! they reach the model, non-finite logits and losses are errors, sizes are never truncated to
//! 32 bits, `max_tokens = 0` generates nothing, and chat templates cannot hang or recurse without
//! bound.

mod common;
mod synth;

use common::TempDir;
use rmlx_lm::chat::{ChatTemplate, Message};
use rmlx_lm::generate::negative_log_likelihood;
use rmlx_lm::KvCache;
use rmlx_lm::{Error, FinishReason, GenerateOptions, LoadOptions, LoadedModel};
use serde_json::{json, Value};
use synth::{Arch, Spec};

fn load(dir: &std::path::Path) -> LoadedModel {
    rmlx_lm::loader::load(dir, &LoadOptions::default()).unwrap()
}

fn greedy(lm: &LoadedModel, prompt: &[u32], opts: GenerateOptions) -> Vec<u32> {
    lm.generate(prompt, &opts).unwrap().map(|t| t.unwrap().id).collect()
}

fn opts(n: usize) -> GenerateOptions {
    GenerateOptions { max_tokens: n, ignore_eos: true, ..GenerateOptions::default() }
}

/// A word-level tokenizer `t0 … t{rows-1}` plus `near` → 1000 and `far` → 100000000, over a
/// 384-row model (llama_gqa).
fn model_with_far_ids() -> (TempDir, LoadedModel) {
    let dir = common::fixture_with_tokenizer("llama_gqa");
    let path = dir.path().join("tokenizer.json");
    let mut tok: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let vocab = tok["model"]["vocab"].as_object_mut().unwrap();
    vocab.insert("near".into(), json!(1000));
    vocab.insert("far".into(), json!(100_000_000));
    std::fs::write(&path, tok.to_string()).unwrap();
    let lm = load(dir.path());
    (dir, lm)
}

fn assert_out_of_range<T: std::fmt::Debug>(r: rmlx_lm::Result<T>, id: u32, position: usize) {
    match r {
        Err(Error::Prompt(m)) => assert!(
            m.contains(&format!("token id {id} (position {position})")) && m.contains("embedding of 384 rows"),
            "{m}"
        ),
        other => panic!("expected Error::Prompt for id {id}, got {other:?}"),
    }
}

#[test]
fn ids_beyond_the_embedding_are_rejected_everywhere() {
    let (_dir, lm) = model_with_far_ids();
    assert_eq!(lm.vocab.rows(), 384);
    for (word, id) in [("near", 1000u32), ("far", 100_000_000)] {
        let text = format!("t1 t2 {word} t3");
        let ids = lm.tokenizer.encode(&text, true).unwrap();
        assert_eq!(ids, vec![1, 2, id, 3]);
        // perplexity (the CLI encodes then scores), at any chunk size
        for chunk in [1, 2, 512] {
            assert_out_of_range(negative_log_likelihood(&lm, &ids, chunk), id, 2);
        }
        // generate: raw and chat-template encodings, and ids given directly
        assert_out_of_range(lm.encode_prompt(&text, true, None), id, 2);
        assert!(
            matches!(lm.encode_prompt(&text, false, None), Err(Error::Prompt(m)) if m.contains(&format!("token id {id} ")))
        );
        assert!(matches!(lm.chat_prompt(&[Message::user(text.as_str())]), Err(Error::Prompt(_))));
        assert_out_of_range(lm.generate(&ids, &opts(4)).map(|_| ()), id, 2);
        assert_out_of_range(lm.vocab.check(&ids), id, 2);
    }
    // The largest valid id goes through.
    assert_eq!(greedy(&lm, &[1, 383], opts(3)).len(), 3);
    let (nll, n) = negative_log_likelihood(&lm, &[1, 383, 2], 2).unwrap();
    assert!(nll.is_finite() && n == 2);
}

#[test]
fn max_tokens_zero_generates_nothing() {
    let dir = common::fixture_with_tokenizer("llama_gqa");
    let lm = load(dir.path());
    let mut g = lm.generate(&[1, 2, 3], &opts(0)).unwrap();
    assert!(g.next().is_none());
    assert_eq!(g.finish_reason(), Some(FinishReason::Length));
    assert_eq!((g.metrics().generated_tokens, g.metrics().prompt_tokens), (0, 3));
    assert_eq!(greedy(&lm, &[1, 2, 3], opts(1)).len(), 1);
    // Still validated: an over-long prompt or a bad id is an error even with no tokens wanted.
    assert!(matches!(lm.generate(&[1, 400], &opts(0)), Err(Error::Prompt(_))));
}

#[test]
fn perplexity_chunk_zero_is_an_error() {
    let dir = common::fixture_with_tokenizer("llama_gqa");
    let lm = load(dir.path());
    match negative_log_likelihood(&lm, &[1, 2, 3], 0) {
        Err(Error::InvalidParameter(m)) => assert!(m.contains("chunk") && m.contains("got 0"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn huge_context_limits_are_not_truncated() {
    let dir = common::fixture_with_tokenizer("llama_gqa");
    let lm = load(dir.path());
    let prompt: Vec<u32> = (0..20).map(|i| (i * 37 + 11) % 384).collect();
    let base = greedy(&lm, &prompt, opts(12));
    for limit in [1usize << 31, (1 << 32) + 16, usize::MAX, i32::MAX as usize] {
        let o = GenerateOptions { context_limit: Some(limit), ..opts(12) };
        assert_eq!(greedy(&lm, &prompt, o), base, "context limit {limit}");
    }
    // A real bound still bounds (and changes the output once the window is exceeded).
    let small = greedy(&lm, &prompt, GenerateOptions { context_limit: Some(20), ..opts(12) });
    assert_eq!(small.len(), 12);
    assert!(matches!(KvCache::bounded(1 << 31, 4), KvCache::Standard(_)));
    assert!(matches!(KvCache::bounded(i32::MAX as usize, 0), KvCache::Standard(_)));
    assert!(matches!(KvCache::bounded(i32::MAX as usize - 1, 0), KvCache::Rotating(_)));
}

#[test]
fn huge_sliding_window_is_not_truncated() {
    // Gemma 3 (sliding layers): the largest window MLX positions can express (2^31 - 1) acts like
    // any window larger than the text; beyond it the config is refused, never wrapped to 32 bits.
    let write = |window: u64| {
        let dir = TempDir::new("window");
        let spec =
            Spec { arch: Arch::Gemma3, vocab: 64, padding_from: None, config: json!({"sliding_window": window}) };
        synth::write(dir.path(), &spec);
        std::fs::write(dir.path().join("tokenizer.json"), common::word_tokenizer(64)).unwrap();
        dir
    };
    let ids = |window: u64| {
        let dir = write(window);
        let lm = load(dir.path());
        let prompt: Vec<u32> = (0..24).map(|i| (i * 7 + 3) % 64).collect();
        greedy(&lm, &prompt, opts(10))
    };
    assert_eq!(ids((1 << 31) - 1), ids(4096));
    for window in [1u64 << 31, (1 << 32) + 8] {
        let dir = write(window);
        match rmlx_lm::loader::load(dir.path(), &LoadOptions::default()) {
            Err(Error::Config(m)) => assert!(m.contains("sliding_window"), "{m}"),
            other => panic!("sliding_window {window}: expected a config error, got {:?}", other.map(|_| ())),
        }
    }
}

/// A tiny untied Llama with a word tokenizer, and its weights.
fn untied_llama() -> (Spec, std::collections::BTreeMap<String, rmlx::Array>) {
    let spec = Spec { arch: Arch::Llama, vocab: 64, padding_from: None, config: json!({"tie_word_embeddings": false}) };
    let w = synth::weights(&spec);
    (spec, w)
}

fn write_model(spec: &Spec, w: std::collections::BTreeMap<String, rmlx::Array>) -> (TempDir, LoadedModel) {
    let dir = TempDir::new("nan");
    synth::write_with(dir.path(), spec, w);
    std::fs::write(dir.path().join("tokenizer.json"), common::word_tokenizer(spec.vocab)).unwrap();
    let lm = load(dir.path());
    (dir, lm)
}

#[test]
fn nan_logits_are_an_error_on_the_step_they_appear() {
    let (spec, w) = untied_llama();
    let prompt = [1u32, 5, 9];
    let (_clean_dir, clean) = write_model(&spec, w.clone());
    let base = greedy(&clean, &prompt, opts(16));
    // The first generated token not seen before: poisoning its embedding row makes the step that
    // takes it as input produce NaN, and only that one (the untied head keeps earlier logits clean).
    let k =
        (0..base.len()).find(|&k| !prompt.contains(&base[k]) && !base[..k].contains(&base[k])).expect("a fresh token");
    let mut poisoned = w;
    synth::poison_row(&mut poisoned, "model.embed_tokens.weight", base[k] as usize, f32::NAN);
    let (_dir, lm) = write_model(&spec, poisoned);
    let mut g = lm.generate(&prompt, &opts(16)).unwrap();
    for (i, &expected) in base[..=k].iter().enumerate() {
        assert_eq!(g.next().unwrap().unwrap().id, expected, "token {i}");
    }
    match g.next() {
        Some(Err(Error::NonFinite(m))) => {
            assert!(m.contains(&format!("generated token {}", k + 2)) && m.contains("NaN or infinite"), "{m}")
        }
        other => panic!("{other:?}"),
    }
    assert!(g.next().is_none(), "generation ends after the error");

    // Perplexity over a text holding the poisoned token: an error, not a NaN result.
    let text = [1u32, 5, base[k], 9, 3];
    match negative_log_likelihood(&lm, &text, 512) {
        Err(Error::NonFinite(m)) => assert!(m.contains("loss of positions 1..5 is NaN"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(negative_log_likelihood(&lm, &[1, 5, 9, 3], 512).unwrap().0.is_finite());
}

#[test]
fn infinite_weights_are_an_error_at_the_first_token() {
    let (spec, mut w) = untied_llama();
    synth::poison_row(&mut w, "lm_head.weight", 7, f32::INFINITY);
    let (_dir, lm) = write_model(&spec, w);
    let mut g = lm.generate(&[1, 2, 3], &opts(4)).unwrap();
    assert!(matches!(g.next(), Some(Err(Error::NonFinite(m))) if m.contains("generated token 1 ")));
    assert!(matches!(negative_log_likelihood(&lm, &[1, 2, 3], 2), Err(Error::NonFinite(_))));
}

#[test]
fn template_loops_run_out_of_steps() {
    let started = std::time::Instant::now();
    let t = ChatTemplate::new(
        "{% for a in range(100000) %}{% for b in range(100000) %}{{ a }}{% endfor %}{% endfor %}",
        None,
        None,
    )
    .unwrap();
    match t.render(&[Message::user("hi")], true, None, None) {
        Err(Error::Template(m)) => assert!(m.contains("exceeded its step budget (default 20000000 steps"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed().as_secs() < 60, "{:?}", started.elapsed());
}

#[test]
fn recursive_templates_stop_cleanly() {
    for source in [
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{% macro f(n) %}x{{ caller() if false }}{{ f(n) }}{% endmacro %}{{ f(0) }}",
    ] {
        let t = ChatTemplate::new(source, None, None).unwrap();
        match t.render(&[Message::user("hi")], true, None, None) {
            Err(Error::Template(m)) => assert!(m.contains("recursed deeper than 64 levels"), "{m}"),
            other => panic!("{source}: {other:?}"),
        }
    }
}

/// The real templates (transformers goldens) render long conversations with tools within a
/// hundredth of the step budget.
#[test]
fn real_templates_fit_the_step_budget() {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/goldens.json");
    let goldens: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]);
    let mut messages = vec![json!({"role": "system", "content": "Be brief."})];
    for i in 0..200 {
        messages.push(json!({"role": "user", "content": format!("Question {i}: what is the weather in Paris?")}));
        messages.push(json!({"role": "assistant", "content": format!("Answer {i}: sunny, 21 degrees.")}));
    }
    messages.push(json!({"role": "user", "content": "And tomorrow?"}));
    let templates: Vec<String> =
        goldens["templates"].as_object().unwrap().values().map(|t| t.as_str().unwrap().to_owned()).collect();
    assert!(templates.len() >= 3, "{}", templates.len());
    for source in templates {
        let mut t = ChatTemplate::new(&source, Some("<s>"), Some("</s>")).unwrap();
        t.set_step_budget(Some(rmlx_lm::chat::TEMPLATE_FUEL / 100));
        let text = t.render_json(&json!(messages), true, Some(&tools), None);
        assert!(text.as_ref().is_ok_and(|s| s.contains("Answer 199")), "{}: {text:?}", &source[..80.min(source.len())]);
    }
}

#[test]
fn a_model_folder_with_an_endless_template_fails_cleanly() {
    // The budget applies to templates from model files (chat_template.jinja here; GGUF metadata
    // templates are built by the same `ChatTemplate::new`).
    let dir = common::fixture_with_tokenizer("llama_gqa");
    let endless = "{% for m in messages %}{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}\
                   {% endfor %}{% endfor %}";
    std::fs::write(dir.path().join("chat_template.jinja"), endless).unwrap();
    let lm = load(dir.path());
    match lm.chat_prompt(&[Message::user("hi")]) {
        Err(Error::Template(m)) => assert!(m.contains("exceeded its step budget"), "{m}"),
        other => panic!("{other:?}"),
    }
    let recursive = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}";
    std::fs::write(dir.path().join("chat_template.jinja"), recursive).unwrap();
    match load(dir.path()).encode_prompt("hi", false, None) {
        Err(Error::Template(m)) => assert!(m.contains("recursed deeper than 64 levels"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_request_whose_first_token_overflows_fails_alone_in_the_engine() {
    use rmlx_lm::engine::{Engine, EngineOptions, Request, Update};
    let (spec, mut w) = untied_llama();
    synth::poison_row(&mut w, "model.embed_tokens.weight", 11, f32::NAN);
    let (_dir, lm) = write_model(&spec, w);
    let clean = [1u32, 5, 9];
    let alone = greedy(&lm, &clean, opts(6));
    assert!(!alone.contains(&11), "the clean request never feeds the poisoned token: {alone:?}");
    let mut engine = Engine::new(&lm, EngineOptions::default());
    let (mut tokens, mut failed) = (Vec::new(), None);
    let mut collect = |updates: Vec<Update>, ok| {
        for u in updates {
            match u {
                Update::Token { seq, id, .. } if seq == ok => tokens.push(id),
                Update::Token { seq, .. } => panic!("request {seq} produced a token"),
                Update::Failed { seq, error } => failed = Some((seq, error)),
                _ => {}
            }
        }
    };
    let ok = engine.submit(Request { prompt: clean.to_vec(), options: opts(6), ..Default::default() }).unwrap();
    collect(engine.step().unwrap(), ok);
    // Its prompt holds the poisoned token: NaN logits for its first token, while `ok` runs.
    let bad = engine.submit(Request { prompt: vec![1, 11, 2], options: opts(6), ..Default::default() }).unwrap();
    while !engine.is_idle() {
        collect(engine.step().unwrap(), ok);
    }
    assert_eq!(tokens, alone, "the running request is untouched");
    match failed {
        Some((seq, Error::NonFinite(m))) => assert!(seq == bad && m.contains("NaN or infinite"), "{m}"),
        other => panic!("{other:?}"),
    }
}
