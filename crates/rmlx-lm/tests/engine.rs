//! The continuous-batching engine on the fixtures: a batch decodes exactly what each request
//! decodes alone (greedy and seeded sampling, requests joining mid-way, chunked prompts, Gemma 3's
//! sliding windows), the prompt cache reuses keys and values without changing the output and stays
//! in its byte budget, cancellation frees the batch, and bad requests get errors.

mod common;

use common::{fixture_with_tokenizer, ids, reference};
use rmlx_lm::engine::{Engine, EngineOptions, Request, SeqId, Update, Usage};
use rmlx_lm::sample::SamplerConfig;
use rmlx_lm::{Error, FinishReason, GenerateOptions, LoadOptions, LoadedModel};
use std::collections::HashMap;

fn load(name: &str) -> (common::TempDir, LoadedModel) {
    let dir = fixture_with_tokenizer(name);
    let lm = rmlx_lm::loader::load(dir.path(), &LoadOptions::default()).unwrap();
    (dir, lm)
}

fn options(max_tokens: usize, sampler: SamplerConfig) -> GenerateOptions {
    GenerateOptions { max_tokens, ignore_eos: true, sampler, ..GenerateOptions::default() }
}

fn seeded(seed: u64) -> SamplerConfig {
    SamplerConfig { temperature: 1.0, top_k: 20, seed: Some(seed), ..SamplerConfig::default() }
}

#[derive(Debug, Default)]
struct Outcome {
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    top: Vec<Vec<(u32, f32)>>,
    text: String,
    finish: Option<FinishReason>,
    usage: Usage,
    cached: Option<usize>,
}

/// Steps until idle, collecting each request's updates.
fn drain(engine: &mut Engine, outcomes: &mut HashMap<SeqId, Outcome>) {
    while !engine.is_idle() {
        step(engine, outcomes);
    }
}

fn step(engine: &mut Engine, outcomes: &mut HashMap<SeqId, Outcome>) {
    for u in engine.step().unwrap() {
        match u {
            Update::Started { seq, cached_tokens, .. } => outcomes.entry(seq).or_default().cached = Some(cached_tokens),
            Update::Token { seq, id, text, logprob, top } => {
                let o = outcomes.entry(seq).or_default();
                o.tokens.push(id);
                o.logprobs.push(logprob);
                o.top.push(top);
                o.text += &text;
            }
            Update::Text { seq, text } => outcomes.entry(seq).or_default().text += &text,
            Update::Finished { seq, reason, usage } => {
                let o = outcomes.entry(seq).or_default();
                assert!(o.finish.is_none(), "request {seq} finished twice");
                o.finish = Some(reason);
                o.usage = usage;
            }
            Update::Failed { seq, error } => panic!("request {seq} failed: {error}"),
        }
    }
}

fn request(prompt: &[u32], opts: GenerateOptions) -> Request {
    Request { prompt: prompt.to_vec(), options: opts, ..Default::default() }
}

/// What `rmlx generate`'s loop produces for one prompt alone.
fn alone(lm: &LoadedModel, prompt: &[u32], opts: &GenerateOptions) -> Vec<u32> {
    lm.generate(prompt, opts).unwrap().map(|t| t.unwrap().id).collect()
}

/// Prompts of 24, 7, 15 and 3 tokens: the reference prompt and pieces of it shuffled.
fn prompts(reference_prompt: &[u32]) -> Vec<Vec<u32>> {
    let p = reference_prompt;
    vec![p.to_vec(), p[3..10].to_vec(), p[2..17].iter().rev().copied().collect(), vec![p[5], p[1], p[9]]]
}

fn small_steps() -> EngineOptions {
    // Prompts over several steps, and sequences joining a batch that already decodes.
    EngineOptions { prefill_tokens: 5, ..EngineOptions::default() }
}

#[test]
fn a_batch_decodes_what_each_request_decodes_alone() {
    let (_d, lm) = load("llama_gqa");
    let r = reference("llama_gqa");
    let prompts = prompts(&ids(&r["prompt_ids"]));
    let greedy = options(12, SamplerConfig::default());
    let mut engine = Engine::new(&lm, small_steps());
    let mut out = HashMap::new();
    // Two start together; two more join after a few steps, one longer than the running batch.
    let mut seqs = vec![engine.submit(request(&prompts[1], greedy.clone())).unwrap()];
    seqs.push(engine.submit(request(&prompts[3], greedy.clone())).unwrap());
    for _ in 0..4 {
        step(&mut engine, &mut out);
    }
    seqs.push(engine.submit(request(&prompts[0], greedy.clone())).unwrap());
    seqs.push(engine.submit(request(&prompts[2], greedy.clone())).unwrap());
    drain(&mut engine, &mut out);
    for (seq, prompt) in seqs.iter().zip([&prompts[1], &prompts[3], &prompts[0], &prompts[2]]) {
        let o = &out[seq];
        assert_eq!(o.tokens, alone(&lm, prompt, &greedy), "prompt of {} tokens", prompt.len());
        assert_eq!(o.finish, Some(FinishReason::Length));
        assert_eq!((o.usage.prompt_tokens, o.usage.completion_tokens), (prompt.len(), 12));
        assert_eq!(o.text, lm.tokenizer.decode(&o.tokens, true).unwrap());
    }
    // The reference prompt continues as transformers computed.
    assert_eq!(out[&seqs[2]].tokens, ids(&r["greedy"]));
    assert_eq!(engine.kv_bytes(), 0, "the batch is empty once every request ended");
}

/// Log-probabilities through the engine, `prompts[0]` submitted first and all started together.
fn engine_logprobs(lm: &LoadedModel, prompts: &[&[u32]], opts: &GenerateOptions) -> Vec<Vec<f32>> {
    let mut engine = Engine::new(lm, EngineOptions::default());
    let seqs: Vec<SeqId> = prompts.iter().map(|p| engine.submit(request(p, opts.clone())).unwrap()).collect();
    let mut out = HashMap::new();
    drain(&mut engine, &mut out);
    seqs.iter().map(|s| out[s].logprobs.clone()).collect()
}

#[test]
fn the_longest_sequence_of_a_batch_decodes_as_alone() {
    let (_d, lm) = load("llama_gqa");
    let prompts = prompts(&ids(&reference("llama_gqa")["prompt_ids"]));
    let greedy = options(12, SamplerConfig::default());
    // The 24-token prompt with the 7- and 3-token ones: only the shorter rows are padded. The
    // longest row's values are the same up to the matrix products' rounding: bit for bit on the
    // Intel Xeons this was written on, up to 2e-6 apart on an AMD EPYC, where OpenBLAS picks
    // other kernels for a product of one row and one of three.
    let batched = engine_logprobs(&lm, &[&prompts[0], &prompts[1], &prompts[3]], &greedy);
    let alone = engine_logprobs(&lm, &[&prompts[0]], &greedy).remove(0);
    assert_eq!(alone.len(), 12);
    assert!(batched[0].iter().zip(&alone).all(|(a, b)| (a - b).abs() <= 1e-5), "{:?} against {alone:?}", batched[0]);
    // A padded row attends over its cache in another order: the same up to rounding.
    let short = engine_logprobs(&lm, &[&prompts[1]], &greedy).remove(0);
    assert_eq!(short.len(), 12);
    assert!(batched[1].iter().zip(&short).all(|(a, b)| (a - b).abs() < 1e-4), "{:?} against {short:?}", batched[1]);
}

#[test]
fn seeded_sampling_is_the_same_alone_or_in_a_batch() {
    let (_d, lm) = load("llama_gqa");
    let prompts = prompts(&ids(&reference("llama_gqa")["prompt_ids"]));
    let opts = |seed| options(10, seeded(seed));
    let mut engine = Engine::new(&lm, small_steps());
    let mut out = HashMap::new();
    let batched: Vec<SeqId> =
        prompts.iter().enumerate().map(|(i, p)| engine.submit(request(p, opts(i as u64))).unwrap()).collect();
    // A greedy request and one with a repetition penalty share the batch.
    let penalised = SamplerConfig { repetition_penalty: 1.3, ..seeded(99) };
    let extra = engine.submit(request(&prompts[0], options(10, penalised.clone()))).unwrap();
    let openai = SamplerConfig { presence_penalty: 0.7, frequency_penalty: 1.5, ..SamplerConfig::default() };
    let penalised_greedy = engine.submit(request(&prompts[2], options(10, openai.clone()))).unwrap();
    engine.submit(request(&prompts[1], options(10, SamplerConfig::default()))).unwrap();
    drain(&mut engine, &mut out);
    for (i, p) in prompts.iter().enumerate() {
        assert_eq!(out[&batched[i]].tokens, alone(&lm, p, &opts(i as u64)), "seed {i}");
    }
    assert_eq!(out[&extra].tokens, alone(&lm, &prompts[0], &options(10, penalised)));
    assert_eq!(out[&penalised_greedy].tokens, alone(&lm, &prompts[2], &options(10, openai)));
    // Different seeds draw different tokens (the test would not see a shared key otherwise).
    assert_ne!(out[&batched[0]].tokens, alone(&lm, &prompts[0], &opts(1)));
}

#[test]
fn sliding_window_layers_in_a_batch() {
    for name in ["gemma3_text", "mistral_window", "gemma2", "phi3"] {
        batched_decoding_as_alone(name);
    }
}

/// Routed experts: each token's experts are its own, whatever the batch around it (padding too).
#[test]
fn routed_experts_in_a_batch() {
    for name in ["qwen3_moe", "qwen3_moe_q4", "mixtral"] {
        batched_decoding_as_alone(name);
    }
}

fn batched_decoding_as_alone(name: &str) {
    // Windowed layers see 8 positions; prompts of 20 and 11 tokens and 16 generated.
    let (_d, lm) = load(name);
    let a: Vec<u32> = (0..20).map(|i| (i * 37 + 11) % 256).collect();
    let b: Vec<u32> = (0..11).map(|i| (i * 53 + 7) % 256).collect();
    let greedy = options(16, SamplerConfig::default());
    let mut engine = Engine::new(&lm, small_steps());
    let mut out = HashMap::new();
    let sa = engine.submit(request(&a, greedy.clone())).unwrap();
    step(&mut engine, &mut out);
    let sb = engine.submit(request(&b, greedy.clone())).unwrap();
    drain(&mut engine, &mut out);
    assert_eq!(out[&sa].tokens, alone(&lm, &a, &greedy));
    assert_eq!(out[&sb].tokens, alone(&lm, &b, &greedy));
    // Both prompts computed in one forward pass, the shorter padded by 9 positions.
    let mut engine = Engine::new(&lm, EngineOptions::default());
    let mut out = HashMap::new();
    let (sa, sb) =
        (engine.submit(request(&a, greedy.clone())).unwrap(), engine.submit(request(&b, greedy.clone())).unwrap());
    drain(&mut engine, &mut out);
    assert_eq!(out[&sa].tokens, alone(&lm, &a, &greedy));
    assert_eq!(out[&sb].tokens, alone(&lm, &b, &greedy));
}

#[test]
fn newcomers_computed_together_decode_as_alone() {
    let (_d, lm) = load("llama_gqa");
    let prompts = prompts(&ids(&reference("llama_gqa")["prompt_ids"]));
    let opts = |i: usize| match i {
        0 => options(8, SamplerConfig::default()),
        1 => options(8, seeded(1)),
        2 => options(8, SamplerConfig { repetition_penalty: 1.3, ..seeded(2) }),
        // Ends at its first token: its row leaves before the others join.
        _ => options(1, SamplerConfig::default()),
    };
    for prefill_batch in [1, 3, 8] {
        let mut engine = Engine::new(&lm, EngineOptions { prefill_batch, ..EngineOptions::default() });
        let mut out = HashMap::new();
        let seqs: Vec<SeqId> = (0..4).map(|i| engine.submit(request(&prompts[i], opts(i))).unwrap()).collect();
        step(&mut engine, &mut out);
        // Every prompt fits the step's budget: all have their first token (and a second one
        // from the step's decoding) after one step, whatever the grouping.
        assert_eq!(engine.load(), (3, 0), "prefill_batch {prefill_batch}");
        drain(&mut engine, &mut out);
        for (i, seq) in seqs.iter().enumerate() {
            assert_eq!(
                out[seq].tokens,
                alone(&lm, &prompts[i], &opts(i)),
                "prefill_batch {prefill_batch}, request {i}"
            );
        }
        assert_eq!(engine.kv_bytes(), 0);
    }
}

#[test]
fn newcomers_computed_together_reuse_the_prompt_cache_as_their_layout_allows() {
    let (_d, lm) = load("llama_gqa");
    let prompt = ids(&reference("llama_gqa")["prompt_ids"]);
    let greedy = options(5, SamplerConfig::default());
    let a: Vec<u32> = prompt.iter().chain(&[3, 4]).copied().collect();
    let b: Vec<u32> = prompt[..10].iter().chain(&[5, 6, 7, 8, 9]).copied().collect();
    let c: Vec<u32> = vec![200, 201, 202];
    assert_ne!(prompt[0], c[0]);
    let cached_with = |prefill_batch: usize| {
        let mut engine = Engine::new(&lm, EngineOptions { prefill_batch, ..EngineOptions::default() });
        let mut out = HashMap::new();
        engine.submit(request(&prompt, options(1, SamplerConfig::default()))).unwrap();
        drain(&mut engine, &mut out);
        let seqs: Vec<SeqId> =
            [&a, &b, &c].iter().map(|p| engine.submit(request(p, greedy.clone())).unwrap()).collect();
        drain(&mut engine, &mut out);
        for (seq, p) in seqs.iter().zip([&a, &b, &c]) {
            assert_eq!(out[seq].tokens, alone(&lm, p, &greedy), "prefill_batch {prefill_batch}, prompt of {}", p.len());
            assert_eq!(out[seq].usage.cached_tokens, out[seq].cached.unwrap());
        }
        seqs.iter().map(|s| out[s].cached.unwrap()).collect::<Vec<_>>()
    };
    // Alone, each prompt reuses all it shares with the cached one (24 and 10 tokens).
    assert_eq!(cached_with(1), [24, 10, 0]);
    // Together, the rows end at position 26: `b` starts at 11 and `c` at 23, so positions from
    // 21 on (where `b`'s cached 10 tokens end) are computed for every row, and `a` reuses 21.
    assert_eq!(cached_with(8), [21, 10, 0]);
}

#[test]
fn the_prompt_cache_reuses_a_shared_beginning() {
    let (_d, lm) = load("llama_gqa");
    let prompt = ids(&reference("llama_gqa")["prompt_ids"]);
    let greedy = options(6, SamplerConfig::default());
    let mut engine = Engine::new(&lm, EngineOptions::default());
    let mut out = HashMap::new();
    let first = engine.submit(request(&prompt, greedy.clone())).unwrap();
    drain(&mut engine, &mut out);
    assert_eq!(out[&first].cached, Some(0));
    let generated = out[&first].tokens.clone();
    // The next turn: the prompt, the answer, two more tokens. The cache holds the prompt and the
    // five answer tokens fed back (the sixth was never an input).
    let next: Vec<u32> = prompt.iter().chain(&generated).chain(&[3, 4]).copied().collect();
    let second = engine.submit(request(&next, greedy.clone())).unwrap();
    drain(&mut engine, &mut out);
    assert_eq!(out[&second].cached, Some(prompt.len() + 5));
    assert_eq!(out[&second].usage.cached_tokens, prompt.len() + 5);
    assert_eq!(out[&second].tokens, alone(&lm, &next, &greedy));
    // The same prompt again: all but its last token come from the cache.
    let third = engine.submit(request(&next, greedy.clone())).unwrap();
    drain(&mut engine, &mut out);
    assert_eq!(out[&third].cached, Some(next.len() - 1));
    assert_eq!(out[&third].tokens, out[&second].tokens);
}

#[test]
fn the_prompt_cache_stays_in_its_budget() {
    let (_d, lm) = load("llama_gqa");
    let prompt = ids(&reference("llama_gqa")["prompt_ids"]);
    // Room for about two entries of ~30 positions.
    let per_position = {
        let mut engine = Engine::new(&lm, EngineOptions::default());
        engine.submit(request(&prompt, options(1, SamplerConfig::default()))).unwrap();
        drain(&mut engine, &mut HashMap::new());
        engine.prompt_cache_usage().0 / prompt.len()
    };
    let budget = per_position * 65;
    let mut engine = Engine::new(&lm, EngineOptions { prompt_cache_bytes: budget, ..EngineOptions::default() });
    let mut out = HashMap::new();
    for i in 0..6u32 {
        let p: Vec<u32> = prompt.iter().map(|t| (t + i * 7) % 256).collect();
        engine.submit(request(&p, options(4, SamplerConfig::default()))).unwrap();
        drain(&mut engine, &mut out);
        let (bytes, entries) = engine.prompt_cache_usage();
        assert!(bytes <= budget, "{bytes} bytes held over a budget of {budget}");
        assert!(entries <= 2, "{entries} entries");
    }
    assert_eq!(engine.prompt_cache_usage().1, 2);
    // The least recently used went first: the first prompt is no longer cached, the last one is.
    let first = engine.submit(request(&prompt, options(1, SamplerConfig::default()))).unwrap();
    drain(&mut engine, &mut out);
    assert_eq!(out[&first].cached, Some(0));
    let off = Engine::new(&lm, EngineOptions { prompt_cache_bytes: 0, ..EngineOptions::default() });
    assert_eq!(off.prompt_cache_usage(), (0, 0));
}

#[test]
fn cancelled_requests_leave_the_batch() {
    let (_d, lm) = load("llama_gqa");
    let prompts = prompts(&ids(&reference("llama_gqa")["prompt_ids"]));
    let greedy = options(10, SamplerConfig::default());
    let mut engine = Engine::new(&lm, EngineOptions { max_batch: 2, ..EngineOptions::default() });
    let mut out = HashMap::new();
    let seqs: Vec<SeqId> = prompts.iter().map(|p| engine.submit(request(p, greedy.clone())).unwrap()).collect();
    step(&mut engine, &mut out);
    step(&mut engine, &mut out);
    assert_eq!(engine.load(), (2, 2), "two decode, two wait for a free row");
    engine.cancel(seqs[0]); // running
    engine.cancel(seqs[3]); // waiting
    drain(&mut engine, &mut out);
    for s in [seqs[0], seqs[3]] {
        assert_eq!(out[&s].finish, Some(FinishReason::Cancelled));
    }
    assert!(out[&seqs[0]].tokens.len() < 10);
    for i in [1, 2] {
        assert_eq!(out[&seqs[i]].tokens, alone(&lm, &prompts[i], &greedy));
    }
    assert_eq!(engine.kv_bytes(), 0);
}

#[test]
fn top_logprobs_and_token_logprobs() {
    let (_d, lm) = load("llama_gqa");
    let prompt = ids(&reference("llama_gqa")["prompt_ids"]);
    let greedy = options(5, SamplerConfig::default());
    let mut engine = Engine::new(&lm, EngineOptions::default());
    let mut out = HashMap::new();
    let seq = engine.submit(Request { top_logprobs: 3, ..request(&prompt, greedy.clone()) }).unwrap();
    let plain = engine.submit(request(&prompt[..10], greedy.clone())).unwrap();
    drain(&mut engine, &mut out);
    let expected: Vec<f32> = lm.generate(&prompt, &greedy).unwrap().map(|t| t.unwrap().logprob).collect();
    let o = &out[&seq];
    for (i, top) in o.top.iter().enumerate() {
        assert_eq!(top.len(), 3);
        assert_eq!(top[0].0, o.tokens[i], "greedy takes the most likely token");
        assert!(top[0].1 >= top[1].1 && top[1].1 >= top[2].1);
        assert!((top[0].1 - o.logprobs[i]).abs() < 1e-6);
        // A batch of two rows and a single row take different GEMM kernels; with TF32 products (a
        // GPU's default) their roundings differ (4.5e-4 and 2.3e-3 in two H100 runs; within 1e-4
        // with MLX_ENABLE_TF32=0).
        let tol = if common::tf32() { 1e-2 } else { 1e-4 };
        assert!((o.logprobs[i] - expected[i]).abs() < tol, "{} vs {}", o.logprobs[i], expected[i]);
    }
    assert!(out[&plain].top.iter().all(Vec::is_empty));
}

fn engine_err(e: &mut Engine, r: Request) -> Error {
    e.submit(r).unwrap_err()
}

#[test]
fn bad_requests_are_refused() {
    let (_d, lm) = load("llama_gqa");
    let prompt = ids(&reference("llama_gqa")["prompt_ids"]);
    let mut engine =
        Engine::new(&lm, EngineOptions { context: Some(30), max_kv_bytes: Some(10_000), ..EngineOptions::default() });
    let greedy = options(4, SamplerConfig::default());
    assert!(matches!(engine_err(&mut engine, request(&[], greedy.clone())), Error::Prompt(m) if m.contains("empty")));
    let long: Vec<u32> = (0..30).collect();
    let m = engine_err(&mut engine, request(&long, greedy.clone())).to_string();
    assert!(m.contains("the prompt has 30 tokens, all of the context limit of 30: no room for a reply"), "{m}");
    let m = engine_err(&mut engine, request(&[long.clone(), vec![1]].concat(), greedy.clone())).to_string();
    assert!(m.contains("the prompt has 31 tokens, more than the context limit of 30"), "{m}");
    assert!(matches!(engine_err(&mut engine, request(&[1, 9999], greedy.clone())), Error::Prompt(_)));
    let hot = options(4, SamplerConfig { temperature: -1.0, ..SamplerConfig::default() });
    assert!(
        matches!(engine_err(&mut engine, request(&prompt, hot)), Error::InvalidParameter(m) if m.contains("temperature"))
    );
    // 24 + 4 positions of this fixture's keys and values: 2 layers × (k, v) × 2 heads × 16 × 4 bytes each.
    let m = engine_err(&mut engine, request(&prompt, greedy.clone())).to_string();
    assert!(m.contains("need 14.3 kB of keys and values; the limit is 10.0 kB"), "{m}");
    let zero = options(0, SamplerConfig::default());
    let m = engine_err(&mut engine, request(&prompt[..3], zero)).to_string();
    assert!(m.contains("max_tokens must be at least 1"), "{m}");
    assert_eq!(engine.submit(request(&prompt[..15], greedy.clone())).unwrap(), 0, "refusals take no id");
    assert_eq!(engine.load(), (0, 1));
}

/// One context rule on both paths (the engine, a single generation): a prompt of the whole
/// context is refused, one position shorter generates exactly one token (`length`).
#[test]
fn the_context_boundary_is_the_same_for_the_engine_and_generate() {
    let (_d, lm) = load("llama_gqa"); // max_position_embeddings 256
    let limit = lm.model.config().max_position_embeddings.unwrap();
    let prompt = |n: usize| (0..n).map(|i| (i * 7 % 380 + 3) as u32).collect::<Vec<_>>();
    let many = options(50, SamplerConfig::default());
    let full = lm.generate(&prompt(limit), &many).err().expect("a prompt of the whole context is refused");
    assert!(full.to_string().contains(&format!("all of the context limit of {limit}: no room")), "{full}");
    let mut engine = Engine::new(&lm, EngineOptions::default());
    let e = engine_err(&mut engine, request(&prompt(limit), many.clone())).to_string();
    assert_eq!(e, full.to_string());
    let mut g = lm.generate(&prompt(limit - 1), &many).unwrap();
    assert_eq!(g.by_ref().count(), 1);
    assert_eq!(g.finish_reason(), Some(FinishReason::Length));
    let seq = engine.submit(request(&prompt(limit - 1), many)).unwrap();
    let mut out = HashMap::new();
    drain(&mut engine, &mut out);
    assert_eq!((out[&seq].tokens.len(), out[&seq].finish), (1, Some(FinishReason::Length)));
}

#[test]
fn pipelined_decoding_gives_the_same_tokens() {
    let (_d, lm) = load("llama_gqa");
    let prompts = prompts(&ids(&reference("llama_gqa")["prompt_ids"]));
    let mut engine = Engine::new(&lm, EngineOptions { pipelined: true, ..small_steps() });
    let mut out = HashMap::new();
    let opts = |i: usize| match i {
        0 => options(12, SamplerConfig::default()),
        1 => options(7, seeded(3)),
        // A repetition penalty needs the history on the host: those steps are not pipelined.
        2 => options(9, SamplerConfig { repetition_penalty: 1.3, ..seeded(5) }),
        _ => options(1, SamplerConfig::default()),
    };
    let seqs: Vec<SeqId> = (0..prompts.len()).map(|i| engine.submit(request(&prompts[i], opts(i))).unwrap()).collect();
    step(&mut engine, &mut out);
    let late = engine.submit(request(&prompts[0][..11], opts(0))).unwrap();
    drain(&mut engine, &mut out);
    for (i, p) in prompts.iter().enumerate() {
        assert_eq!(out[&seqs[i]].tokens, alone(&lm, p, &opts(i)), "request {i}");
        assert_eq!(out[&seqs[i]].finish, Some(FinishReason::Length));
    }
    assert_eq!(out[&late].tokens, alone(&lm, &prompts[0][..11], &opts(0)));
    assert_eq!(engine.kv_bytes(), 0);
    // Alone, a pipelined request has its step after the last token computed already: the cache
    // holds all 12 answer tokens.
    let mut engine = Engine::new(&lm, EngineOptions { pipelined: true, ..EngineOptions::default() });
    let mut out = HashMap::new();
    let first = engine.submit(request(&prompts[0], opts(0))).unwrap();
    drain(&mut engine, &mut out);
    let next: Vec<u32> = prompts[0].iter().chain(&out[&first].tokens).chain(&[3]).copied().collect();
    let again = engine.submit(request(&next, opts(0))).unwrap();
    drain(&mut engine, &mut out);
    assert_eq!(out[&again].cached, Some(prompts[0].len() + 12));
}

#[test]
fn sliding_window_layers_drop_what_no_query_sees() {
    // Gemma 3 fixture, window 8: sequences of ~170 positions pass the point where local layers
    // drop positions (64 beyond the window) twice; output stays what each gives alone.
    let (_d, lm) = load("gemma3_text");
    let a: Vec<u32> = (0..20).map(|i| (i * 37 + 11) % 256).collect();
    let long: Vec<u32> = (0..150).map(|i| (i * 53 + 7) % 256).collect();
    let greedy = options(150, SamplerConfig::default());
    let mut engine = Engine::new(&lm, small_steps());
    let mut out = HashMap::new();
    let sa = engine.submit(request(&a, greedy.clone())).unwrap();
    let sl = engine.submit(request(&long, options(20, seeded(3)))).unwrap();
    let mut peak_kv = 0;
    while !engine.is_idle() {
        step(&mut engine, &mut out);
        peak_kv = peak_kv.max(engine.kv_bytes());
    }
    let generated = out[&sa].tokens.clone();
    assert_eq!(generated, alone(&lm, &a, &greedy));
    assert_eq!(out[&sl].tokens, alone(&lm, &long, &options(20, seeded(3))));
    // 2 rows, 2 × 1 head × 32 dims × 4 bytes a position: the 2 global layers hold up to 170
    // positions and room to grow (512 in all), the 4 local ones at most 8 + 64 + 5 + 256 each.
    let per_position = 2 * 32 * 4;
    assert!(peak_kv <= 2 * per_position * (2 * 512 + 4 * 333), "{peak_kv}");

    // The next turn reuses the whole conversation, although local layers hold only its end.
    let turn: Vec<u32> = a.iter().chain(&generated).chain(&[5, 6, 7]).copied().collect();
    let more = options(10, SamplerConfig::default());
    let st = engine.submit(request(&turn, more.clone())).unwrap();
    // A prompt sharing only 15 tokens with it: that entry cannot serve it (the window would
    // start in dropped positions); computed from scratch.
    let sharing: Vec<u32> = a[..15].iter().chain(&[9, 9]).copied().collect();
    let ss = engine.submit(request(&sharing, more.clone())).unwrap();
    drain(&mut engine, &mut out);
    // The last generated token was never fed to the model: everything before it is cached.
    assert_eq!(out[&st].cached, Some(a.len() + generated.len() - 1));
    assert_eq!(out[&st].tokens, alone(&lm, &turn, &more));
    assert_eq!(out[&ss].cached, Some(0));
    assert_eq!(out[&ss].tokens, alone(&lm, &sharing, &more));
}

#[test]
fn a_warmed_up_engine_decodes_as_a_fresh_one() {
    let (_d, lm) = load("llama_gqa");
    let r = reference("llama_gqa");
    let prompt = ids(&r["prompt_ids"]);
    let greedy = options(12, SamplerConfig::default());
    let mut engine = Engine::new(&lm, EngineOptions { max_batch: 5, prefill_tokens: 48, ..EngineOptions::default() });
    // Refused while a request runs: its updates would be lost.
    let first = engine.submit(request(&prompt, greedy.clone())).unwrap();
    assert!(matches!(engine.warm_up(), Err(Error::InvalidParameter(_))));
    let mut out = HashMap::new();
    drain(&mut engine, &mut out);
    assert_eq!(out[&first].tokens, ids(&r["greedy"]));
    // The 48-token prompt alone, then the batch of 5 (45 padded prompt tokens) down to 1.
    assert_eq!(engine.warm_up().unwrap(), 6);
    assert!(engine.is_idle());
    assert_eq!((engine.prompt_cache_usage(), engine.kv_bytes()), ((0, 0), 0));
    // The same request again: nothing reused from before the warm-up, the same tokens.
    let again = engine.submit(request(&prompt, greedy.clone())).unwrap();
    drain(&mut engine, &mut out);
    assert_eq!((out[&again].cached, &out[&again].tokens), (Some(0), &ids(&r["greedy"])));
}
