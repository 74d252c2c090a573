//! LoRA adapters chosen per request in the continuous-batching engine: a batch that mixes two
//! adapters (of different ranks and layers) and the base model decodes, row by row, exactly what
//! the model with that adapter attached decodes alone; the prompt cache keeps adapters apart; an
//! adapter in use cannot be unloaded, and an unknown one is refused.

mod common;

use common::{fixture_with_tokenizer, ids, reference};
use rmlx::Dtype;
use rmlx_lm::engine::{Engine, EngineOptions, Request, SeqId, Update};
use rmlx_lm::nn::{AdapterBank, Lora};
use rmlx_lm::tuner::{apply_dora, apply_lora, LoraConfig};
use rmlx_lm::{Error, GenerateOptions, LoadOptions, LoadedModel};
use std::collections::HashMap;

fn load() -> (common::TempDir, LoadedModel) {
    let dir = fixture_with_tokenizer("llama_gqa");
    let lm = rmlx_lm::loader::load(dir.path(), &LoadOptions::default()).unwrap();
    (dir, lm)
}

/// A LoRA adapter of `rank` on the last `layers` blocks, with B drawn away from zero so that it
/// changes the output: layer name → factors.
fn adapter(rank: i32, layers: usize, scale: f32, seed: u64) -> HashMap<String, Lora> {
    let (_d, mut lm) = load();
    let cfg = LoraConfig { rank, scale, dropout: 0.0, keys: None };
    apply_lora(lm.model.as_mut(), Some(layers), &cfg, lm.dtype, seed).unwrap();
    let mut out = HashMap::new();
    lm.model.visit_linears("", &mut |path, l| {
        if let Some(lora) = l.lora() {
            let key = rmlx::random::key(seed * 1000 + out.len() as u64).unwrap();
            let b = rmlx::random::normal(lora.b.shape(), Dtype::Float32, 0.0, 0.3, Some(&key)).unwrap();
            out.insert(path.to_string(), Lora { b, ..lora.clone() });
        }
    });
    out
}

/// The fixture with `layers` attached as its own adapters (what `--adapter-path` does).
fn with_adapter(layers: &HashMap<String, Lora>) -> (common::TempDir, LoadedModel) {
    let (d, mut lm) = load();
    lm.model.visit_linears("", &mut |path, l| {
        l.set_lora(layers.get(path).cloned()).unwrap();
    });
    (d, lm)
}

fn greedy() -> GenerateOptions {
    GenerateOptions { max_tokens: 10, ignore_eos: true, ..GenerateOptions::default() }
}

fn alone(lm: &LoadedModel, prompt: &[u32]) -> Vec<u32> {
    lm.generate(prompt, &greedy()).unwrap().map(|t| t.unwrap().id).collect()
}

fn request(prompt: &[u32], adapter: Option<&str>) -> Request {
    Request { prompt: prompt.to_vec(), options: greedy(), adapter: adapter.map(str::to_string), ..Default::default() }
}

/// Steps until idle: each request's tokens and the cached prompt tokens it started from.
fn drain(engine: &mut Engine) -> HashMap<SeqId, (Vec<u32>, usize)> {
    let mut out: HashMap<SeqId, (Vec<u32>, usize)> = HashMap::new();
    while !engine.is_idle() {
        for u in engine.step().unwrap() {
            match u {
                Update::Started { seq, cached_tokens, .. } => out.entry(seq).or_default().1 = cached_tokens,
                Update::Token { seq, id, .. } => out.entry(seq).or_default().0.push(id),
                Update::Failed { seq, error } => panic!("request {seq} failed: {error}"),
                _ => {}
            }
        }
    }
    out
}

#[test]
fn a_batch_mixing_adapters_decodes_what_each_adapter_decodes_alone() {
    let (_d, lm) = load();
    let r = reference("llama_gqa");
    let p = ids(&r["prompt_ids"]);
    let prompts = [p.clone(), p[3..12].to_vec(), p[2..17].iter().rev().copied().collect(), vec![p[5], p[1], p[9]]];
    // Rank 2 on the last two blocks, rank 4 on the last one only: the bank pads ranks and leaves layers
    // without an adapter alone.
    let (a, b) = (adapter(2, 2, 2.0, 1), adapter(4, 1, 1.0, 2));
    let ((_da, lm_a), (_db, lm_b)) = (with_adapter(&a), with_adapter(&b));
    let base_out = alone(&lm, &prompts[0]);
    assert_ne!(alone(&lm_a, &prompts[0]), base_out, "adapter a changes the output");
    assert_ne!(alone(&lm_b, &prompts[0]), base_out, "adapter b changes the output");

    // Prompts over several steps; three requests start together, the rest join a batch that is
    // already decoding.
    let mut engine = Engine::new(&lm, EngineOptions { prefill_tokens: 5, ..EngineOptions::default() });
    engine.load_adapter("a", a).unwrap();
    engine.load_adapter("b", b).unwrap();
    assert_eq!(engine.adapter_names(), ["a", "b"]);
    let plan = [(0, Some("a")), (1, None), (2, Some("b")), (3, Some("a")), (0, Some("b")), (0, None)];
    let mut seqs = Vec::new();
    let mut out = HashMap::new();
    for (i, &(prompt, adapter)) in plan.iter().enumerate() {
        seqs.push(engine.submit(request(&prompts[prompt], adapter)).unwrap());
        if i == 2 {
            for _ in 0..3 {
                for u in engine.step().unwrap() {
                    if let Update::Token { seq, id, .. } = u {
                        out.entry(seq).or_insert_with(Vec::new).push(id);
                    }
                }
            }
        }
    }
    for (seq, (tokens, _)) in drain(&mut engine) {
        out.entry(seq).or_insert_with(Vec::new).extend(tokens);
    }
    for (seq, &(prompt, adapter)) in seqs.iter().zip(&plan) {
        let expected = match adapter {
            Some("a") => alone(&lm_a, &prompts[prompt]),
            Some(_) => alone(&lm_b, &prompts[prompt]),
            None => alone(&lm, &prompts[prompt]),
        };
        assert_eq!(out[seq], expected, "prompt {prompt} with adapter {adapter:?}");
    }
}

#[test]
fn the_prompt_cache_keeps_adapters_apart_and_unloading_is_checked() {
    let (_d, lm) = load();
    let p = ids(&reference("llama_gqa")["prompt_ids"]);
    let a = adapter(2, 2, 2.0, 1);
    let (_da, lm_a) = with_adapter(&a);
    let mut engine = Engine::new(&lm, EngineOptions::default());
    engine.load_adapter("a", a.clone()).unwrap();
    assert!(matches!(engine.load_adapter("a", a.clone()), Err(Error::InvalidParameter(_))));

    // The base model computes the prompt; the same prompt with the adapter must not reuse it.
    engine.submit(request(&p, None)).unwrap();
    drain(&mut engine);
    let seq = engine.submit(request(&p, Some("a"))).unwrap();
    let err = engine.unload_adapter("a").unwrap_err();
    assert!(err.to_string().contains("in use"), "{err}");
    let out = drain(&mut engine);
    assert_eq!(out[&seq], (alone(&lm_a, &p), 0));
    // Again with the adapter: now all but the last prompt token come from the cache.
    let seq = engine.submit(request(&p, Some("a"))).unwrap();
    assert_eq!(drain(&mut engine)[&seq], (alone(&lm_a, &p), p.len() - 1));

    engine.unload_adapter("a").unwrap();
    assert!(engine.adapter_names().is_empty());
    let err = engine.submit(request(&p, Some("a"))).unwrap_err();
    assert!(matches!(&err, Error::InvalidParameter(m) if m.contains("no adapter named `a`")), "{err}");
    // Loaded again (a new slot's keys and values): nothing stale comes from the cache.
    engine.load_adapter("a", a).unwrap();
    let seq = engine.submit(request(&p, Some("a"))).unwrap();
    assert_eq!(drain(&mut engine)[&seq], (alone(&lm_a, &p), 0));
}

#[test]
fn dora_adapters_are_refused_per_request() {
    let (_d, mut lm) = load();
    let cfg = LoraConfig { rank: 2, scale: 1.0, dropout: 0.0, keys: None };
    apply_dora(lm.model.as_mut(), Some(1), &cfg, lm.dtype, 0).unwrap();
    let mut layers = HashMap::new();
    lm.model.visit_linears("", &mut |path, l| {
        layers.extend(l.lora().map(|d| (path.to_string(), d.clone())));
    });
    let err = AdapterBank::default().insert("d", layers).unwrap_err();
    assert!(err.to_string().contains("DoRA"), "{err}");
}
