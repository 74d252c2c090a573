//! The fused CPU decoding step of Llama-family blocks (`nn::cpu_layer`): a quantised model decodes
//! through it (two primitives a layer, counted in the step's graph), and its logits, step by step
//! through the cache, and its greedy tokens are those of the composed step; a batch's step (the
//! engine's, rows padded apart) computes what each sequence's own step does. The composed step is
//! the same model with a zero adapter on every output projection, which makes the fused step
//! decline and adds exactly zero to the products.

mod common;

use common::{fixture_with_tokenizer, ids, reference};
use rmlx::{Array, Dtype};
use rmlx_lm::cache::{BatchCache, KvCache, RowKv, Stored};
use rmlx_lm::nn::Lora;
use rmlx_lm::{GenerateOptions, LoadOptions, LoadedModel};

fn load(dir: &std::path::Path, dtype: Dtype) -> LoadedModel {
    let opts = LoadOptions { dtype: Some(dtype), dequantize: Some(false), ..LoadOptions::default() };
    rmlx_lm::loader::load(dir, &opts).unwrap()
}

/// Zero-valued adapters (`B = 0`) on every `o_proj`: the layer's output is unchanged, and the
/// fused step, which takes no adapters, declines.
fn decline_fused(lm: &mut LoadedModel, dtype: Dtype) {
    let mut attached = 0;
    lm.model.visit_linears("", &mut |path, linear| {
        if path.ends_with("o_proj") {
            let (input, output) = linear.dims();
            linear.set_lora(Some(Lora::init(input, output, 4, 2.0, dtype, None).unwrap())).unwrap();
            attached += 1;
        }
    });
    assert_eq!(attached, lm.model.config().num_hidden_layers);
}

/// Logits `[vocab]` of every position, the prompt fed one token at a time.
fn stepwise_logits(lm: &LoadedModel, prompt: &[u32]) -> Vec<Vec<f32>> {
    let mut caches = lm.model.new_caches(None);
    prompt
        .iter()
        .map(|&t| {
            let ids = Array::from_slice(&[t as i32], &[1, 1]).unwrap();
            let logits = lm.model.forward(&ids, &mut caches).unwrap();
            logits.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
        })
        .collect()
}

fn greedy(lm: &LoadedModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let opts = GenerateOptions { max_tokens: n, ignore_eos: true, ..GenerateOptions::default() };
    lm.generate(prompt, &opts).unwrap().map(|t| t.unwrap().id).collect()
}

/// How many of each fused primitive one decoding step runs.
fn fused_operations(lm: &LoadedModel, prompt: &[u32]) -> (usize, usize) {
    let census = rmlx_lm::profile::decode_steps(lm, prompt, 1).unwrap().operations;
    let count = |name: &str| census.get(name).copied().unwrap_or(0);
    (count("CpuAttentionInputs"), count("CpuAttentionOutputMlp"))
}

#[test]
fn fused_step_computes_the_composed_step() {
    rmlx::set_default_device(rmlx::Device::cpu()).unwrap();
    for name in ["llama_gqa_q4", "qwen3_q4"] {
        let dir = fixture_with_tokenizer(name);
        let prompt = ids(&reference(name)["prompt_ids"]);
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            let fused = load(dir.path(), dtype);
            let layers = fused.model.config().num_hidden_layers;
            assert_eq!(fused_operations(&fused, &prompt), (layers, layers), "{name} {dtype:?}: fused step");
            let mut composed = load(dir.path(), dtype);
            decline_fused(&mut composed, dtype);
            assert_eq!(fused_operations(&composed, &prompt), (0, 0), "{name} {dtype:?}: composed step");

            let (a, b) = (stepwise_logits(&fused, &prompt), stepwise_logits(&composed, &prompt));
            // The same kernels and MLX's exp, every intermediate rounded where the composed
            // graph rounds it: the same logits, bit for bit.
            for (position, (x, y)) in a.iter().zip(&b).enumerate() {
                let diff = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
                assert!(diff == 0.0, "{name} {dtype:?} position {position}: max |Δlogit| {diff}");
            }
            assert_eq!(greedy(&fused, &prompt, 24), greedy(&composed, &prompt, 24), "{name} {dtype:?} greedy");
        }
    }
}

/// Across the cache's growth (every 256 positions), where the fused step writes its keys and
/// values into a new buffer: 300 positions fed one at a time, the same logits as the composed step.
#[test]
fn fused_steps_write_the_cache_across_its_growth() {
    rmlx::set_default_device(rmlx::Device::cpu()).unwrap();
    let name = "qwen3_q4";
    let dir = fixture_with_tokenizer(name);
    let prompt = ids(&reference(name)["prompt_ids"]);
    let long: Vec<u32> = prompt.iter().copied().cycle().take(300).collect();
    let fused = load(dir.path(), Dtype::Float32);
    let mut composed = load(dir.path(), Dtype::Float32);
    decline_fused(&mut composed, Dtype::Float32);
    let (a, b) = (stepwise_logits(&fused, &long), stepwise_logits(&composed, &long));
    assert_eq!(a.len(), 300);
    for (position, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(x == y, "{name} position {position}: the fused step's logits differ");
    }
}

/// Batches, prompts of more than `MAX_POSITIONS` positions and adapters keep the composed graph:
/// the fused step serves one sequence's decoding steps and verification passes only.
#[test]
fn prompts_run_composed() {
    rmlx::set_default_device(rmlx::Device::cpu()).unwrap();
    let dir = fixture_with_tokenizer("llama_gqa_q4");
    let lm = load(dir.path(), Dtype::Bfloat16);
    let prompt = ids(&reference("llama_gqa_q4")["prompt_ids"]);
    let mut caches = lm.model.new_caches(None);
    let ids: Vec<i32> = prompt.iter().map(|&t| t as i32).collect();
    let logits = lm.model.forward(&Array::from_slice(&ids, &[1, ids.len() as i32]).unwrap(), &mut caches).unwrap();
    let census = rmlx::graph_census(&[logits]).unwrap();
    assert!(!census.contains_key("CpuAttentionInputs"), "a prompt of {} positions: {census:?}", ids.len());
    // The prompt's products take the panel form (float32, never the integer one), without BLAS.
    assert!(census.contains_key("CpuAffineQmm4x32") && !census.contains_key("Matmul"), "{census:?}");
    assert!(!census.contains_key("CpuAffineQmm4x32Int8"), "{census:?}");
}

/// A verification pass (2 to 8 positions of one sequence through the fused step) computes what
/// its positions compute one at a time: every position's hidden state equal bit for bit, passes
/// after a prompt and across the cache's growth, in float32 and bfloat16; each pass two fused
/// primitives a layer.
#[test]
fn fused_passes_compute_their_single_steps() {
    rmlx::set_default_device(rmlx::Device::cpu()).unwrap();
    for name in ["llama_gqa_q4", "qwen3_q4"] {
        let dir = fixture_with_tokenizer(name);
        let prompt: Vec<i32> = ids(&reference(name)["prompt_ids"]).iter().map(|&t| t as i32).collect();
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            let lm = load(dir.path(), dtype);
            let layers = lm.model.config().num_hidden_layers;
            let (mut passes, mut steps) = (lm.model.new_caches(None), lm.model.new_caches(None));
            let x = Array::from_slice(&prompt, &[1, prompt.len() as i32]).unwrap();
            lm.model.forward_hidden(&x, &mut passes).unwrap();
            lm.model.forward_hidden(&x, &mut steps).unwrap();
            let mut position = prompt.len();
            for (n, len) in [2, 8, 3, 5, 7, 4, 6].iter().cycle().take(56).enumerate() {
                let tokens: Vec<i32> = (0..*len).map(|i| ((n * 13 + i * 7) % 50 + 2) as i32).collect();
                let what = format!("{name} {dtype:?}: a pass of {len} at {position}");
                let h = lm.model.forward_hidden(&Array::from_slice(&tokens, &[1, *len as i32]).unwrap(), &mut passes);
                let h = h.unwrap();
                let census = rmlx::graph_census([&h]).unwrap();
                assert_eq!(census.get("CpuAttentionInputs"), Some(&layers), "{what}: {census:?}");
                assert_eq!(census.get("CpuAttentionOutputMlp"), Some(&layers), "{what}: {census:?}");
                let got = h.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
                let mut want = Vec::new();
                for &t in &tokens {
                    let h = lm.model.forward_hidden(&Array::from_slice(&[t], &[1, 1]).unwrap(), &mut steps).unwrap();
                    want.extend(h.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap());
                }
                assert!(got == want, "{what}: the hidden states differ");
                position += len;
            }
            assert!(position > 256, "{name}: the cache grew");
        }
    }
}

/// A step of a batch of sequences of different lengths (the engine's batch cache, rows padded on
/// the left): each row's hidden state is, bit for bit, what its sequence's own step computes
/// through a standard cache, step after step and across the buffers' growth; two fused
/// primitives a layer. Nine rows are more than the fused step takes: composed.
#[test]
fn a_batchs_step_computes_each_sequences_own() {
    rmlx::set_default_device(rmlx::Device::cpu()).unwrap();
    for (name, dtype) in [("llama_gqa_q4", Dtype::Float32), ("qwen3_q4", Dtype::Bfloat16)] {
        let dir = fixture_with_tokenizer(name);
        let lm = load(dir.path(), dtype);
        let layers = lm.model.config().num_hidden_layers;
        let prompt: Vec<i32> = ids(&reference(name)["prompt_ids"]).iter().map(|&t| t as i32).collect();
        for rows in [3usize, 9] {
            // Row r: the prompt's first 4 + 3r tokens (cycled past its end).
            let prompts: Vec<Vec<i32>> =
                (0..rows).map(|r| prompt.iter().copied().cycle().take(4 + 3 * r).collect()).collect();
            let mut alone: Vec<Vec<KvCache>> = Vec::new();
            let mut prefixes = Vec::new();
            for p in &prompts {
                let mut caches = lm.model.new_caches(None);
                lm.model.forward_hidden(&Array::from_slice(p, &[1, p.len() as i32]).unwrap(), &mut caches).unwrap();
                rmlx::eval(caches.iter().flat_map(KvCache::state)).unwrap();
                let row: Vec<RowKv> = caches
                    .iter()
                    .map(|c| {
                        let KvCache::Standard(s) = c else { panic!("a standard cache") };
                        let cut = |a: &Option<Array>| {
                            Stored::Plain(a.as_ref().unwrap().slice_axis(2, 0, s.offset as i32, 1).unwrap())
                        };
                        RowKv { keys: cut(&s.keys), values: cut(&s.values), start: 0 }
                    })
                    .collect();
                prefixes.push(row);
                alone.push(caches);
            }
            let width = prompts.iter().map(Vec::len).max().unwrap() as i32;
            let padding: Vec<i32> = prompts.iter().map(|p| width - p.len() as i32).collect();
            let mut batch: Vec<KvCache> = (0..layers)
                .map(|l| {
                    let rows = prefixes.iter().map(|p| Some(p[l].clone())).collect();
                    KvCache::Batch(BatchCache::padded(rows, padding.clone(), width, None).unwrap())
                })
                .collect();
            rmlx::eval(batch.iter().flat_map(KvCache::state)).unwrap();
            for step in 0..260 {
                let tokens: Vec<i32> = (0..rows).map(|r| ((step * 7 + r * 11) % 50 + 2) as i32).collect();
                let what = format!("{name} {dtype:?}, {rows} rows, step {step}");
                let h = lm.model.forward_hidden(&Array::from_slice(&tokens, &[rows as i32, 1]).unwrap(), &mut batch);
                let h = h.unwrap();
                let census = rmlx::graph_census([&h]).unwrap();
                let fused = if rows <= 8 { Some(&layers) } else { None };
                assert_eq!(census.get("CpuAttentionInputs"), fused, "{what}: {census:?}");
                assert_eq!(census.get("CpuAttentionOutputMlp"), fused, "{what}: {census:?}");
                if rows > 8 {
                    break; // the composed batch step: tests/engine.rs
                }
                let got = h.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
                let mut want = Vec::new();
                for (t, caches) in tokens.iter().zip(&mut alone) {
                    let h = lm.model.forward_hidden(&Array::from_slice(&[*t], &[1, 1]).unwrap(), caches).unwrap();
                    want.extend(h.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap());
                }
                assert!(got == want, "{what}: the hidden states differ");
            }
        }
    }
}
