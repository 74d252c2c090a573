//! The continuous-batching engine with a quantised key/value cache (`EngineOptions::kv_quantization`,
//! `--kv-bits` in serve, batch and chat): a batch packs its keys and values and still decodes what
//! each request decodes alone in the same engine (requests joining mid-way, padding, Gemma 3's
//! sliding windows), 8 bits keep a full cache's tokens where mlx-lm's do, the
//! batch holds about a quarter of the bytes at 4 bits, packed rows go to the prompt cache and come
//! back, and a cache quantised from position 20 packs once the batch has written 20 columns.

mod common;

use common::fixture_with_tokenizer;
use rmlx::Dtype;
use rmlx_lm::engine::{Engine, EngineOptions, Request, SeqId, Update};
use rmlx_lm::{GenerateOptions, KvQuantization, LoadOptions, LoadedModel};
use std::collections::HashMap;

fn load(name: &str) -> (common::TempDir, LoadedModel) {
    let dir = fixture_with_tokenizer(name);
    let opts = LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() };
    let lm = rmlx_lm::loader::load(dir.path(), &opts).unwrap();
    (dir, lm)
}

fn greedy(max_tokens: usize) -> GenerateOptions {
    GenerateOptions { max_tokens, ignore_eos: true, ..GenerateOptions::default() }
}

fn kv(bits: i32, start: usize) -> Option<KvQuantization> {
    Some(KvQuantization { bits, group_size: 32, start })
}

/// Per request: its tokens and how many prompt tokens came from the prompt cache.
#[derive(Default, Debug)]
struct Outcome {
    tokens: Vec<u32>,
    cached: usize,
}

fn step(engine: &mut Engine, out: &mut HashMap<SeqId, Outcome>) {
    for u in engine.step().unwrap() {
        match u {
            Update::Token { seq, id, .. } => out.entry(seq).or_default().tokens.push(id),
            Update::Started { seq, cached_tokens, .. } => out.entry(seq).or_default().cached = cached_tokens,
            Update::Failed { seq, error } => panic!("request {seq} failed: {error}"),
            _ => {}
        }
    }
}

fn drain(engine: &mut Engine, out: &mut HashMap<SeqId, Outcome>) {
    while !engine.is_idle() {
        step(engine, out);
    }
}

fn submit(engine: &mut Engine, prompt: &[u32], opts: &GenerateOptions) -> SeqId {
    engine.submit(Request { prompt: prompt.to_vec(), options: opts.clone(), ..Request::default() }).unwrap()
}

/// The tokens of `prompt` alone in a fresh engine with `options`.
fn alone(lm: &LoadedModel, options: &EngineOptions, prompt: &[u32], opts: &GenerateOptions) -> Vec<u32> {
    let mut engine = Engine::new(lm, options.clone());
    let mut out = HashMap::new();
    let seq = submit(&mut engine, prompt, opts);
    drain(&mut engine, &mut out);
    out.remove(&seq).unwrap().tokens
}

fn prompts() -> Vec<Vec<u32>> {
    vec![(1..25).collect(), (40..47).collect(), (100..115).rev().collect(), vec![7, 3, 9]]
}

#[test]
fn a_quantised_batch_decodes_what_each_request_decodes_alone() {
    for (name, bits) in [("qwen3", 4), ("qwen3", 8), ("gemma3_text", 4)] {
        let (_d, lm) = load(name);
        // Requests joining a batch that already decodes. (Each prompt in one piece: a cache packed
        // from the start packs after the prompt's first piece, so pieces of other sizes, as a
        // batch's shared prefill budget cuts them, change the numbers, as in mlx-lm.)
        let options = EngineOptions { kv_quantization: kv(bits, 0), ..EngineOptions::default() };
        let opts = greedy(12);
        let mut engine = Engine::new(&lm, options.clone());
        let mut out = HashMap::new();
        let p = prompts();
        let mut seqs = vec![submit(&mut engine, &p[1], &opts), submit(&mut engine, &p[3], &opts)];
        for _ in 0..4 {
            step(&mut engine, &mut out);
        }
        seqs.push(submit(&mut engine, &p[0], &opts));
        seqs.push(submit(&mut engine, &p[2], &opts));
        drain(&mut engine, &mut out);
        for (seq, prompt) in seqs.iter().zip([&p[1], &p[3], &p[0], &p[2]]) {
            let want = alone(&lm, &options, prompt, &opts);
            assert_eq!(out[seq].tokens, want, "{name}, {bits} bits, prompt of {}", prompt.len());
        }
        assert_eq!(engine.kv_bytes(), 0, "the batch is empty once every request ended");
    }
}

#[test]
fn eight_bits_keep_a_full_caches_tokens_in_a_quarter_of_the_bytes_at_four() {
    let (_d, lm) = load("qwen3");
    let opts = greedy(12);
    let prompt: Vec<u32> = (1..12).collect();
    let full = EngineOptions::default();
    let eight = EngineOptions { kv_quantization: kv(8, 0), ..EngineOptions::default() };
    assert_eq!(alone(&lm, &eight, &prompt, &opts), alone(&lm, &full, &prompt, &opts));
    // Bytes held mid-decoding: float32 rows of 32 dimensions take 128 bytes; 4-bit ones 16, plus
    // a float32 scale and bias per group of 32: 24 bytes, 3/16 of the full cache's.
    let held = |options: EngineOptions| {
        let mut engine = Engine::new(&lm, options);
        let mut out = HashMap::new();
        submit(&mut engine, &prompt, &opts);
        for _ in 0..3 {
            step(&mut engine, &mut out);
        }
        engine.kv_bytes()
    };
    let (f, q) = (held(full), held(EngineOptions { kv_quantization: kv(4, 0), ..EngineOptions::default() }));
    assert_eq!(q * 16, f * 3, "{q} of {f} bytes");
}

#[test]
fn packed_rows_go_to_the_prompt_cache_and_come_back() {
    let (_d, lm) = load("qwen3");
    let options = EngineOptions { kv_quantization: kv(4, 0), ..EngineOptions::default() };
    let opts = greedy(6);
    let mut engine = Engine::new(&lm, options);
    let mut out = HashMap::new();
    let prompt: Vec<u32> = (1..20).collect();
    let first = submit(&mut engine, &prompt, &opts);
    drain(&mut engine, &mut out);
    let next: Vec<u32> = prompt.iter().chain(&out[&first].tokens).chain(&[3, 4]).copied().collect();
    let second = submit(&mut engine, &next, &opts);
    drain(&mut engine, &mut out);
    assert_eq!(out[&second].cached, prompt.len() + 5);
    let third = submit(&mut engine, &next, &opts);
    drain(&mut engine, &mut out);
    assert_eq!(out[&third].cached, next.len() - 1);
    assert_eq!(out[&third].tokens, out[&second].tokens);
    assert!(engine.prompt_cache_usage().0 > 0);
}

#[test]
fn a_batch_packs_once_it_has_written_the_start() {
    let (_d, lm) = load("qwen3");
    let options = EngineOptions { kv_quantization: kv(4, 20), ..EngineOptions::default() };
    let full = EngineOptions::default();
    let opts = greedy(16);
    let prompt: Vec<u32> = (1..12).collect();
    let bytes_after = |options: &EngineOptions, steps: usize| {
        let mut engine = Engine::new(&lm, options.clone());
        let mut out = HashMap::new();
        submit(&mut engine, &prompt, &opts);
        for _ in 0..steps {
            step(&mut engine, &mut out);
        }
        engine.kv_bytes()
    };
    // 11 prompt positions and one per step: below 20 the cache is the full one; past it, packed.
    assert_eq!(bytes_after(&options, 3), bytes_after(&full, 3));
    assert!(bytes_after(&options, 12) * 4 < bytes_after(&full, 12));
    // The tokens before the switch are the full cache's.
    let quantized = alone(&lm, &options, &prompt, &opts);
    assert_eq!(quantized[..8], alone(&lm, &full, &prompt, &opts)[..8]);
}
