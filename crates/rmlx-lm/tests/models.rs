//! Every architecture and config variant against transformers: random-weight fixtures written by
//! `scripts/make_fixtures.py`, whose `reference.json` holds float32 logits for all prompt positions
//! and greedy continuations. Asserted: max |Δlogit| within a stated tolerance and exact greedy
//! tokens, in float32 and in the checkpoint dtype; the same logits position by position through
//! the KV cache (one token per step, exercising cache growth and rotating windows), and greedy
//! tokens unchanged by chunked prefill.

mod common;

use common::{fixture_with_tokenizer, floats, ids, ids_array, max_abs_diff, reference};
use rmlx::Dtype;
use rmlx_lm::{GenerateOptions, LoadOptions, LoadedModel};
use serde_json::Value;

fn load(dir: &std::path::Path, dtype: Dtype) -> LoadedModel {
    let opts = LoadOptions { dtype: Some(dtype), dequantize: Some(false), ..LoadOptions::default() };
    rmlx_lm::loader::load(dir, &opts).unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

fn dtype_of(name: &str) -> Dtype {
    match name {
        "float32" => Dtype::Float32,
        "bfloat16" => Dtype::Bfloat16,
        "float16" => Dtype::Float16,
        other => panic!("unexpected dtype {other}"),
    }
}

/// Logits of the whole prompt in one forward pass.
fn prompt_logits(lm: &LoadedModel, prompt: &[u32]) -> Vec<f32> {
    let mut caches = lm.model.new_caches(None);
    let logits = lm.model.forward(&ids_array(prompt), &mut caches).unwrap();
    logits.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
}

/// Logits of the prompt fed one token at a time through the cache.
fn stepwise_logits(lm: &LoadedModel, prompt: &[u32]) -> Vec<f32> {
    let mut caches = lm.model.new_caches(None);
    let mut out = Vec::new();
    for &t in prompt {
        let logits = lm.model.forward(&ids_array(&[t]), &mut caches).unwrap();
        out.extend(logits.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap());
    }
    out
}

fn greedy(lm: &LoadedModel, prompt: &[u32], n: usize, chunk: usize) -> Vec<u32> {
    let opts = GenerateOptions { max_tokens: n, ignore_eos: true, prefill_chunk: chunk, ..GenerateOptions::default() };
    lm.generate(prompt, &opts).unwrap().map(|t| t.unwrap().id).collect()
}

/// Checks one fixture against its reference, with the tolerances the generator measured and
/// recorded (float32 matmuls on the GPU run as TF32, so there the TF32 tolerance applies).
fn check(name: &str) {
    check_with_config(name, |_| {});
}

/// [`check`] with the fixture's config.json rewritten by `edit` first (another layout of the same
/// configuration: the reference is unchanged).
fn check_with_config(name: &str, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let r = reference(name);
    let tol = |k: &str| r["tolerance"][k].as_f64().unwrap_or_else(|| panic!("{name}: tolerance.{k}")) as f32;
    let on_gpu = rmlx::default_device().kind == rmlx::DeviceType::Gpu;
    let tol32 = if on_gpu { tol("float32_tf32") } else { tol("float32") };
    let tol_ckpt = tol("checkpoint_dtype").max(if on_gpu { tol32 } else { 0.0 });
    let dir = fixture_with_tokenizer(name);
    let path = dir.path().join("config.json");
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(cfg.as_object_mut().unwrap());
    std::fs::write(&path, cfg.to_string()).unwrap();
    let prompt = ids(&r["prompt_ids"]);
    let expected_logits = floats(&r["logits"]);
    let expected = ids(&r["greedy"]);
    let n = expected.len();

    let lm = load(dir.path(), Dtype::Float32);
    let d = max_abs_diff(&prompt_logits(&lm, &prompt), &expected_logits);
    assert!(d <= tol32, "{name} float32: max |Δlogit| {d} > {tol32}");
    let d = max_abs_diff(&stepwise_logits(&lm, &prompt), &expected_logits);
    assert!(d <= tol32, "{name} float32 step by step: max |Δlogit| {d} > {tol32}");
    assert_eq!(greedy(&lm, &prompt, n, 2048), expected, "{name} float32 greedy");
    assert_eq!(greedy(&lm, &prompt, n, 5), expected, "{name} float32 greedy, prefill in chunks of 5");

    let ckpt = dtype_of(r["dtype"].as_str().unwrap());
    if ckpt != Dtype::Float32 {
        let lm = load(dir.path(), ckpt);
        let d = max_abs_diff(&prompt_logits(&lm, &prompt), &expected_logits);
        assert!(d <= tol_ckpt, "{name} {}: max |Δlogit| {d} > {tol_ckpt}", ckpt.name());
        let want = r.get("greedy_checkpoint_dtype").map(ids).unwrap_or(expected);
        assert_eq!(greedy(&lm, &prompt, n, 2048), want, "{name} {} greedy", ckpt.name());
    }
}

#[test]
fn llama_gqa_tied_llama3_rope() {
    check("llama_gqa");
}

#[test]
fn llama_mqa_untied_head_dim_linear_rope_bf16_sharded_with_index() {
    check("llama_mqa_untied");
}

#[test]
fn mistral_alias_f16_shards_without_index() {
    check("mistral");
}

/// Mistral-7B-v0.1's layout: a window on every layer, no `layer_types` (transformers' MistralConfig).
/// Ignoring the window changes the logits of positions 8..24 by up to 16.8 (reference checks).
#[test]
fn mistral_sliding_window_on_every_layer() {
    check("mistral_window");
}

/// Qwen 2.5 with `use_sliding_window`: layers from `max_window_layers` on slide, the first does not.
#[test]
fn qwen2_sliding_window_from_max_window_layers() {
    check("qwen2_window");
}

#[test]
fn qwen2_qkv_bias() {
    check("qwen2");
}

#[test]
fn qwen3_qk_norm_bf16() {
    check("qwen3");
}

#[test]
fn gemma3_sliding_window_shorter_than_prompt() {
    check("gemma3_text");
}

/// Gemma 2: attention scores capped at 5 and logits at 10 (both reached by the fixture's weights),
/// layers 0 and 2 sliding by transformers' default alternation, no q/k norms.
#[test]
fn gemma2_softcapped_attention_and_logits_alternating_windows() {
    check("gemma2");
}

/// Gemma 2 quantised (MLX affine 4-bit, the embedding and one down projection 8-bit).
#[test]
fn gemma2_mlx_quantized() {
    check("gemma2_q4");
}

/// Qwen 3 MoE: 8 experts, 4 a token, renormalised; the prompt's token-expert pairs take the sorted
/// gathered products and each decoding step's the unsorted ones; layer 1 dense between routed ones.
#[test]
fn qwen3_moe_routed_experts_and_a_dense_layer() {
    check("qwen3_moe");
}

/// Qwen 3 MoE quantised as mlx-lm stores it: the experts stacked under `switch_mlp` (4-bit, through
/// MLX's `gather_qmm`), the routers 8-bit, the dense layer's down projection 8-bit.
#[test]
fn qwen3_moe_mlx_quantized_stacked_experts() {
    check("qwen3_moe_q4");
}

/// Mixtral: 6 experts (`w1`/`w3`/`w2`), 3 a token, softmax over the chosen scores.
#[test]
fn mixtral_routed_experts() {
    check("mixtral");
}

/// gpt-oss: attention sinks, biases on every projection, YaRN, a window on every other layer,
/// biased experts with the clamped SwiGLU, from transformers' fused `gate_up_proj` layout.
#[test]
fn gpt_oss_sinks_yarn_alternating_windows_clamped_biased_experts() {
    check("gpt_oss");
}

#[test]
fn gemma3_sliding_window_pattern() {
    check("gemma3_text_pattern");
}

#[test]
fn gemma3_multimodal_checkpoint_language_model_prefix() {
    check("gemma3_multimodal_prefix");
}

/// Phi-3: fused `qkv_proj` / `gate_up_proj` split at load, half of each head turned by the rotary
/// embedding, LongRoPE's factors and attention factor, a window on every layer.
#[test]
fn phi3_fused_projections_partial_rotary_longrope_window() {
    check("phi3");
}

/// Phi-3's configuration as transformers 5 writes it: `rope_theta`, the LongRoPE scaling and
/// `partial_rotary_factor` all inside `rope_parameters` (a Phi-4-mini saved so turns 3/4 of each
/// head; read as 1 it would turn all of it).
#[test]
fn phi3_config_in_the_transformers5_layout() {
    check_with_config("phi3", |c| {
        let mut rope = c.remove("rope_scaling").unwrap().as_object().unwrap().clone();
        rope.insert("rope_type".into(), rope["type"].clone());
        for key in ["rope_theta", "partial_rotary_factor"] {
            rope.insert(key.into(), c.remove(key).unwrap());
        }
        rope.insert("original_max_position_embeddings".into(), c["original_max_position_embeddings"].clone());
        c.insert("rope_parameters".into(), Value::Object(rope));
    });
}

/// Phi-3's fused projections quantised: the split keeps whole rows of packed weights, scales and biases.
#[test]
fn phi3_mlx_quantized_fused_projections() {
    check("phi3_q4");
}

/// The same architecture beside mlx-lm: `phi3_mlx_lm` (random weights drawn for mlx-lm's own
/// `phi3.Model` by `scripts/make_mlx_lm_fixture.py`, partial rotary factor 0.5, no scaling) greedily
/// continues `t1 t2 t3` as mlx-lm does, every top-1/top-2 margin at least 0.23 in mlx-lm.
#[test]
fn phi3_greedy_ids_equal_mlx_lm_on_its_own_checkpoint() {
    let dir = fixture_with_tokenizer("phi3_mlx_lm");
    let lm = load(dir.path(), Dtype::Float32);
    let mlx_lm = [381, 446, 277, 94, 168, 511, 488, 381, 420, 228, 258, 499, 293, 86, 276, 182];
    assert_eq!(greedy(&lm, &[1, 2, 3], mlx_lm.len(), 2048), mlx_lm);
}

/// mlx-lm's own gpt-oss checkpoint (random float32 weights from `gpt_oss.Model` by
/// `scripts/make_mlx_lm_fixture.py --arch gpt_oss`: experts stacked under `mlp.experts` with biases,
/// sinks, YaRN, a window of 4 on layer 0) greedily continues `t1 t2 t3` as mlx-lm does (every
/// top-1/top-2 margin at least 0.119 in mlx-lm; the window is passed at the fifth token).
#[test]
fn gpt_oss_greedy_ids_equal_mlx_lm_on_its_own_checkpoint() {
    let dir = fixture_with_tokenizer("gpt_oss_mlx_lm");
    let lm = load(dir.path(), Dtype::Float32);
    let mlx_lm = [495, 319, 478, 260, 43, 412, 421, 89, 273, 93, 478, 327, 273, 421, 96, 296];
    assert_eq!(greedy(&lm, &[1, 2, 3], mlx_lm.len(), 2048), mlx_lm);
}

/// The same architecture quantised by mlx-lm in MXFP4 (`--quantize mxfp4`: every linear layer, the
/// experts, the embedding and the head in groups of 32 with 8-bit power-of-two scales, the routers
/// dense): the quantised layers stay MXFP4 and rmlx's 16 greedy ids equal mlx-lm's (margins at
/// least 0.165).
#[test]
fn gpt_oss_mxfp4_greedy_ids_equal_mlx_lm() {
    let dir = fixture_with_tokenizer("gpt_oss_mxfp4_mlx_lm");
    let lm = load(dir.path(), Dtype::Float32);
    let mut modes = std::collections::BTreeSet::new();
    lm.model.visit("", &mut |name, role, a| {
        if role == rmlx_lm::nn::Role::Quantization {
            modes.insert((name.rsplit_once('.').map_or("", |p| p.1).to_string(), a.dtype().name()));
        }
    });
    assert_eq!(modes.into_iter().collect::<Vec<_>>(), [("scales".to_string(), "uint8")]);
    let mlx_lm = [323, 331, 156, 16, 132, 240, 318, 364, 414, 228, 258, 331, 506, 195, 235, 419];
    assert_eq!(greedy(&lm, &[1, 2, 3], mlx_lm.len(), 2048), mlx_lm);
}

/// OpenAI's published layout of the same MXFP4 experts (`gate_up_proj_blocks` `[E, 2·width,
/// hidden/32, 16]` bytes and `gate_up_proj_scales`, gate and up interleaved by row, the biases by
/// column; `down_proj_blocks`, `down_proj_scales`, `down_proj_bias`), made here from mlx-lm's
/// tensors: the experts load as the same MXFP4 matrices, so the logits are the same bits.
#[test]
fn gpt_oss_openai_mxfp4_experts_load_as_mlx_lms() {
    use rmlx::{ops, Array};
    let dir = fixture_with_tokenizer("gpt_oss_mxfp4_mlx_lm");
    let st = rmlx::io::load_safetensors(dir.path().join("model.safetensors")).unwrap();
    let mut out: std::collections::BTreeMap<String, Array> =
        st.arrays.iter().filter(|(n, _)| !n.contains(".mlp.experts.")).map(|(n, a)| (n.clone(), a.clone())).collect();
    // Gate and up side by side on a new axis after `axis`, merged into it: row (or column) 2i is
    // gate's i, 2i + 1 up's.
    let interleave = |g: &Array, u: &Array, axis: usize| {
        let mut shape = g.shape().to_vec();
        shape[axis] *= 2;
        ops::stack(&[g, u], axis as i32 + 1).unwrap().reshape(&shape).unwrap()
    };
    let blocks = |words: &Array| {
        let s = words.shape().to_vec();
        words.view_as(Dtype::Uint8).unwrap().reshape(&[s[0], s[1], s[2] / 4, 16]).unwrap()
    };
    for i in 0..2 {
        let p = format!("model.layers.{i}.mlp.experts");
        let a = |n: &str| st.arrays[&format!("{p}.{n}")].clone();
        let words = interleave(&a("gate_proj.weight"), &a("up_proj.weight"), 1);
        out.insert(format!("{p}.gate_up_proj_blocks"), blocks(&words));
        out.insert(format!("{p}.gate_up_proj_scales"), interleave(&a("gate_proj.scales"), &a("up_proj.scales"), 1));
        out.insert(format!("{p}.gate_up_proj_bias"), interleave(&a("gate_proj.bias"), &a("up_proj.bias"), 1));
        out.insert(format!("{p}.down_proj_blocks"), blocks(&a("down_proj.weight")));
        out.insert(format!("{p}.down_proj_scales"), a("down_proj.scales"));
        out.insert(format!("{p}.down_proj_bias"), a("down_proj.bias"));
    }
    let openai = common::TempDir::new("gpt_oss_openai");
    std::fs::copy(dir.path().join("tokenizer.json"), openai.path().join("tokenizer.json")).unwrap();
    // The fields of openai/gpt-oss-20b's config.json that the fixture's lacks.
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap()).unwrap();
    let extra = serde_json::json!({
        "attention_bias": true, "attention_dropout": 0.0, "experts_per_token": 2, "hidden_act": "silu",
        "initial_context_length": 32, "output_router_logits": false, "pad_token_id": 0,
        "router_aux_loss_coef": 0.9, "swiglu_limit": 7.0, "use_cache": true,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
            "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    });
    cfg.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    std::fs::write(openai.path().join("config.json"), cfg.to_string()).unwrap();
    // Blocks without their exponents, or blocks of another size, are named.
    let mut broken = out.clone();
    broken.remove("model.layers.1.mlp.experts.down_proj_scales");
    rmlx::io::save_safetensors(openai.path().join("model.safetensors"), &broken, &Default::default()).unwrap();
    let e = rmlx_lm::loader::load(openai.path(), &LoadOptions::default()).err().unwrap();
    assert!(
        matches!(&e, rmlx_lm::Error::MissingTensor(n) if n == "model.layers.1.mlp.experts.down_proj_scales"),
        "{e}"
    );
    let mut broken = out.clone();
    let blocks = broken["model.layers.0.mlp.experts.down_proj_blocks"].clone();
    let s = blocks.shape().to_vec();
    broken.insert(
        "model.layers.0.mlp.experts.down_proj_blocks".into(),
        blocks.reshape(&[s[0], s[1], s[2] * 2, 8]).unwrap(),
    );
    rmlx::io::save_safetensors(openai.path().join("model.safetensors"), &broken, &Default::default()).unwrap();
    let e = rmlx_lm::loader::load(openai.path(), &LoadOptions::default()).err().unwrap();
    assert!(matches!(&e, rmlx_lm::Error::Config(m) if m.contains("down_proj_blocks: MXFP4 blocks of 8 bytes")), "{e}");
    rmlx::io::save_safetensors(openai.path().join("model.safetensors"), &out, &Default::default()).unwrap();
    let (mlx_lm, published) = (load(dir.path(), Dtype::Float32), load(openai.path(), Dtype::Float32));
    let prompt: Vec<u32> = (1..=12).collect();
    assert_eq!(prompt_logits(&published, &prompt), prompt_logits(&mlx_lm, &prompt));
    let ids = [323, 331, 156, 16, 132, 240, 318, 364, 414, 228, 258, 331, 506, 195, 235, 419];
    assert_eq!(greedy(&published, &[1, 2, 3], ids.len(), 2048), ids);
}

/// `lm`'s greedy continuation of `t1 t2 t3` is `want` (mlx-lm's), with the prompt prefilled whole
/// and in chunks of 2.
fn continues_as_mlx_lm(lm: &LoadedModel, want: &[u32]) {
    assert_eq!(greedy(lm, &[1, 2, 3], want.len(), 2048), want);
    assert_eq!(greedy(lm, &[1, 2, 3], want.len(), 2), want, "prefill in chunks of 2");
}

/// Mixtral as `mlx_lm.convert -q` writes it (`scripts/make_mlx_lm_fixture.py --arch mixtral
/// --quantize affine`: every linear layer, the routers, the embedding and the head 4-bit in groups
/// of 32; 4 experts stacked under `block_sparse_moe.switch_mlp`, 2 a token) greedily continues
/// `t1 t2 t3` as mlx-lm does on the same quantised model (every top-1/top-2 margin at least 0.103
/// in mlx-lm), with its experts kept quantised.
#[test]
fn mixtral_mlx_quantized_greedy_ids_equal_mlx_lm() {
    let dir = fixture_with_tokenizer("mixtral_q4_mlx_lm");
    let lm = load(dir.path(), Dtype::Float32);
    let mut quantized = 0;
    lm.model.visit("", &mut |name, role, _| {
        quantized += (role == rmlx_lm::nn::Role::Quantization && name.contains("switch_mlp")) as usize;
    });
    assert!(quantized > 0, "the experts were dequantised at load");
    continues_as_mlx_lm(&lm, &[373, 143, 252, 405, 153, 239, 135, 257, 220, 375, 465, 101, 432, 416, 419, 415]);
}

/// Mistral 4-bit as `mlx_lm.convert -q` writes it (`--arch mistral --quantize affine`: a window of
/// 4 on layer 0, every linear layer, embedding and head 4-bit in groups of 32) greedily continues
/// `t1 t2 t3` as mlx-lm does (margins at least 0.123); without the window mlx-lm's ids part from
/// these at the fifth token.
#[test]
fn mistral_mlx_quantized_window_greedy_ids_equal_mlx_lm() {
    let dir = fixture_with_tokenizer("mistral_q4_mlx_lm");
    let lm = load(dir.path(), Dtype::Float32);
    continues_as_mlx_lm(&lm, &[3, 210, 76, 433, 262, 441, 433, 259, 469, 435, 265, 68, 175, 146, 42, 338]);
}

#[test]
fn llama_mlx_quantized_with_overrides() {
    check("llama_gqa_q4");
}

#[test]
fn qwen3_mlx_quantized_bf16() {
    check("qwen3_q4");
}

#[test]
fn head_dim_inferred_from_q_proj_when_absent() {
    // llama_mqa_untied has head_dim 32 ≠ hidden/heads = 16: without the field, q_proj's shape decides.
    let r = reference("llama_mqa_untied");
    let dir = fixture_with_tokenizer("llama_mqa_untied");
    let p = dir.path().join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    assert_eq!(cfg.as_object_mut().unwrap().remove("head_dim"), Some(serde_json::json!(32)));
    std::fs::write(&p, cfg.to_string()).unwrap();
    let lm = load(dir.path(), Dtype::Float32);
    assert_eq!(lm.model.config().head_dim(), 32);
    let prompt = ids(&r["prompt_ids"]);
    let on_gpu = rmlx::default_device().kind == rmlx::DeviceType::Gpu;
    let tol = r["tolerance"][if on_gpu { "float32_tf32" } else { "float32" }].as_f64().unwrap() as f32;
    let d = max_abs_diff(&prompt_logits(&lm, &prompt), &floats(&r["logits"]));
    assert!(d <= tol, "max |Δlogit| {d} > {tol}");
}

/// Parameters are declared once per module (`nn::module_fields!`): for every fixture family,
/// the three walks see the same names. Every parameter `visit` lists is reached by `visit_mut`
/// under the same name in the same order; every linear layer `visit_linears` hands out is one
/// whose weight `visit` lists, and there is one per projection: 7 a block (q, k, v, o, gate, up,
/// down), plus `lm_head` when the head is untied.
#[test]
fn the_three_parameter_walks_agree_on_every_family() {
    use rmlx_lm::nn::{ModuleExt, Role};
    for name in [
        "llama_gqa",
        "llama_gqa_q4",
        "llama_mqa_untied",
        "mistral_window",
        "qwen2",
        "qwen3_q4",
        "gemma3_text",
        "phi3_q4",
        "gemma2",
    ] {
        let dir = fixture_with_tokenizer(name);
        let mut lm = load(dir.path(), Dtype::Float32);
        let visited = lm.model.roles("");
        let mut mutated = Vec::new();
        lm.model.visit_mut("", &mut |n, _| mutated.push(n.to_string()));
        assert_eq!(visited.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(), mutated, "{name}");
        let weights: Vec<&String> = visited.iter().filter(|(_, r)| *r == Role::Weight).map(|(n, _)| n).collect();
        let mut linears = Vec::new();
        lm.model.visit_linears("", &mut |p, _| linears.push(format!("{p}.weight")));
        assert_eq!(linears.iter().collect::<Vec<_>>(), weights, "{name}: linear layers and weights");
        let blocks = lm.model.config().num_hidden_layers;
        let untied = visited.iter().any(|(n, _)| n == "lm_head.weight");
        assert_eq!(linears.len(), 7 * blocks + usize::from(untied), "{name}: {linears:?}");
        assert!(visited.iter().any(|(n, r)| n == "model.embed_tokens.weight" && *r == Role::Embedding), "{name}");
    }
}

/// A mixture of experts' parameters under mlx-lm's names, walked alike by `visit` and
/// `visit_mut`: the router as a linear layer (`mlp.gate`), the stacked experts as
/// `mlp.switch_mlp.{gate,up,down}_proj` (and their quantisation arrays), expert adapters as
/// `lora_a` / `lora_b` once attached; the dense layer keeps `mlp.{gate,up,down}_proj`.
#[test]
fn expert_parameters_carry_mlx_lm_names() {
    use rmlx_lm::nn::{ModuleExt, Role};
    for name in ["qwen3_moe", "qwen3_moe_q4", "mixtral"] {
        let dir = fixture_with_tokenizer(name);
        let mut lm = load(dir.path(), Dtype::Float32);
        let cfg = rmlx_lm::tuner::LoraConfig { rank: 2, ..rmlx_lm::tuner::LoraConfig::default() };
        rmlx_lm::tuner::apply_lora(lm.model.as_mut(), None, &cfg, Dtype::Float32, 0).unwrap();
        let visited = lm.model.roles("");
        let mut mutated = Vec::new();
        lm.model.visit_mut("", &mut |n, _| mutated.push(n.to_string()));
        assert_eq!(visited.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(), mutated, "{name}");
        let ffn = if name == "mixtral" { "block_sparse_moe" } else { "mlp" };
        let role = |n: &str| visited.iter().find(|(v, _)| v == n).map(|(_, r)| *r);
        for proj in ["gate_proj", "up_proj", "down_proj"] {
            let p = format!("model.layers.0.{ffn}.switch_mlp.{proj}");
            assert_eq!(role(&format!("{p}.weight")), Some(Role::Weight), "{name}: {p}");
            assert_eq!(role(&format!("{p}.lora_a")), Some(Role::LoraA), "{name}: {p}");
            assert_eq!(role(&format!("{p}.lora_b")), Some(Role::LoraB), "{name}: {p}");
            let quantized = name.ends_with("_q4");
            assert_eq!(role(&format!("{p}.scales")).is_some(), quantized, "{name}: {p}");
        }
        assert_eq!(role(&format!("model.layers.0.{ffn}.gate.weight")), Some(Role::Weight), "{name}: router");
        if name != "mixtral" {
            assert_eq!(role("model.layers.1.mlp.gate_proj.weight"), Some(Role::Weight), "{name}: dense layer");
            assert!(!visited.iter().any(|(n, _)| n.starts_with("model.layers.1.mlp.switch_mlp")), "{name}");
        }
    }
}
