//! Building a model from a GGUF file: the configuration from `<arch>.*` metadata, llama.cpp tensor
//! names mapped to Hugging Face ones (what llama.cpp's converter did undone by each architecture's
//! [`GgufSpec::fix_up`]), and the tokenizer and chat template from `tokenizer.*` metadata.

use super::{family, finish, LoadOptions, LoadedModel};
use crate::chat::ChatTemplate;
use crate::gguf::{GgufFile, MetaValue};
use crate::models::spec::{self, GgufSpec, HeadCounts};
use crate::progress::Progress;
use crate::tokenizer::Tokenizer;
use crate::weights::{Weight, Weights};
use crate::{Error, Result};
use rmlx::Dtype;
use serde_json::{json, Map, Value};
use std::path::Path;

/// Loads a `.gguf` file.
pub fn load(path: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    let GgufCheckpoint { config, weights, tokenizer, template } = read(path, opts.progress)?;
    let cfg = crate::models::spec::parse_config(config)?;
    let (bos, eos) = (tokenizer.bos_token().map(str::to_string), tokenizer.eos_token().map(str::to_string));
    let template = match template {
        Some(src) => ChatTemplate::new(&src, bos.as_deref(), eos.as_deref())?,
        None => ChatTemplate::fallback(family(&cfg)?, bos.as_deref(), eos.as_deref())?,
    };
    // GGUF has no compute dtype. On the CPU float32: rmlx's packed products there are exact in it
    // (bfloat16 rounds activations to 8 bits for the products of a decoding step); elsewhere
    // bfloat16.
    let on_cpu = rmlx::current_device().kind == rmlx::DeviceType::Cpu;
    let dtype = opts.dtype.unwrap_or(if on_cpu { Dtype::Float32 } else { Dtype::Bfloat16 });
    finish(cfg, weights, tokenizer, template, dtype, opts, path)
}

/// What a GGUF file holds, as a Hugging Face checkpoint would: the configuration, the tensors
/// under Hugging Face names (llama.cpp's changes undone), the tokenizer (with the family's
/// end-of-turn markers among its end ids) and the chat template's source, if the file has one.
pub(crate) struct GgufCheckpoint {
    pub config: Value,
    pub weights: Weights,
    pub tokenizer: Tokenizer,
    pub template: Option<String>,
}

/// Reads a `.gguf` file (with a progress bar over its tensors when `progress`).
pub(crate) fn read(path: &Path, progress: bool) -> Result<GgufCheckpoint> {
    let file = GgufFile::open(path)?;
    let arch = file
        .get("general.architecture")
        .and_then(MetaValue::as_str)
        .ok_or_else(|| Error::Config(format!("{}: no `general.architecture`", path.display())))?
        .to_string();
    let Some(gguf) = spec::for_gguf(&arch).and_then(|s| s.gguf.as_ref()) else {
        return Err(Error::UnsupportedArchitecture {
            model_type: format!("{arch} (GGUF)"),
            supported: spec::gguf_list(),
        });
    };
    let mut raw = config_from_metadata(&file, gguf)?;
    crate::config::ModelConfig::check_fields(&raw).map_err(|e| match e {
        Error::Config(m) => Error::Config(format!("{}: {m} (from the GGUF metadata)", path.display())),
        other => other,
    })?;
    let heads = HeadCounts {
        heads: raw["num_attention_heads"].as_u64().unwrap_or(1) as usize,
        kv_heads: raw["num_key_value_heads"].as_u64().unwrap_or(1) as usize,
    };

    let bar = Progress::new(progress, "reading GGUF tensors", file.tensors().len() as u64);
    let mut weights = Weights::new();
    // A tensor of RoPE frequency factors, as the configuration's list.
    let factors = |info| match file.load(info)? {
        Weight::Dense(f) => Ok(json!(f.astype(Dtype::Float32)?.to_vec::<f32>()?)),
        Weight::Quantized(_) => Err(Error::Config(format!("{}: {} is quantised", path.display(), info.name))),
    };
    for info in file.tensors() {
        bar.inc(1);
        if info.name == "rope_freqs.weight" {
            // Llama 3.1's scaled RoPE, stored as per-frequency divisors of the frequencies.
            raw["rope_freq_factors"] = factors(info)?;
            continue;
        }
        let longrope = info.name.strip_prefix("rope_factors_").and_then(|n| n.strip_suffix(".weight"));
        if let Some(which) = longrope.filter(|w| matches!(*w, "long" | "short")) {
            // LongRoPE's per-pair frequency factors (Phi-3's long-context checkpoints). Without
            // `rope.scaling.attn_factor` (older converters) the attention factor follows from the
            // original and extended contexts, as transformers computes it.
            if !raw["rope_scaling"].is_object() {
                raw["rope_scaling"] = json!({"type": "longrope"});
            }
            raw["rope_scaling"][format!("{which}_factor")] = factors(info)?;
            continue;
        }
        let Some(name) = hf_name(&info.name, gguf) else {
            return Err(Error::Config(format!(
                "{}: unexpected tensor `{}` for a {arch} model",
                path.display(),
                info.name
            )));
        };
        let w = (gguf.fix_up)(&name, file.load(info)?, &heads)?;
        weights.insert(name, w);
    }
    bar.finish();
    if raw.get("vocab_size").is_none_or(Value::is_null) {
        let rows = weights.get("model.embed_tokens.weight").map(|w| w.shape()[0]).unwrap_or(0);
        raw["vocab_size"] = json!(rows);
    }
    raw["tie_word_embeddings"] = json!(!weights.contains("lm_head.weight"));

    let vocab = crate::tokenizer::gguf_vocab(&file)?;
    let mut tokenizer = Tokenizer::from_gguf_vocab(&vocab)?;
    let template = file.get("tokenizer.chat_template").and_then(MetaValue::as_str).map(str::to_string);
    // End-of-turn markers the family's generation_config would list (gpt-oss: the reply's end and
    // a tool call's).
    for marker in ["<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|return|>", "<|call|>"] {
        if let Some(id) = tokenizer.token_to_id(marker) {
            tokenizer.add_eos_id(id);
        }
    }
    Ok(GgufCheckpoint { config: raw, weights, tokenizer, template })
}

/// The Hugging Face config a GGUF's metadata describes.
fn config_from_metadata(file: &GgufFile, gguf: &GgufSpec) -> Result<Value> {
    let arch = gguf.arch;
    // A NaN or infinite number would become JSON null, silently replaced by a default.
    let prefix = format!("{arch}.");
    for (k, v) in file.metadata().range(prefix.clone()..).take_while(|(k, _)| k.starts_with(&prefix)) {
        if matches!(v, MetaValue::F32(_) | MetaValue::F64(_)) && !v.as_f64().is_some_and(f64::is_finite) {
            return Err(Error::Config(format!(
                "{}: GGUF metadata `{k}` is {v:?}, not a finite number",
                file.path().display()
            )));
        }
    }
    let key = |k: &str| format!("{arch}.{k}");
    let num = |k: &str| file.get(&key(k)).and_then(MetaValue::as_f64);
    let need = |k: &str| num(k).ok_or_else(|| Error::Config(format!("GGUF metadata lacks `{}`", key(k))));
    let heads = need("attention.head_count")?;
    let mut c = Map::new();
    c.insert("model_type".into(), json!(gguf.model_type));
    c.insert("hidden_size".into(), json!(need("embedding_length")? as i64));
    c.insert("num_hidden_layers".into(), json!(need("block_count")? as i64));
    c.insert("intermediate_size".into(), json!(need("feed_forward_length")? as i64));
    c.insert("num_attention_heads".into(), json!(heads as i64));
    c.insert("num_key_value_heads".into(), json!(num("attention.head_count_kv").unwrap_or(heads) as i64));
    if let Some(d) = num("attention.key_length") {
        c.insert("head_dim".into(), json!(d as i64));
    }
    c.insert("rms_norm_eps".into(), json!(num("attention.layer_norm_rms_epsilon").unwrap_or(1e-6)));
    c.insert("rope_theta".into(), json!(num("rope.freq_base").unwrap_or(10000.0)));
    if let Some(n) = num("context_length") {
        c.insert("max_position_embeddings".into(), json!(n as i64));
    }
    if let Some(t) = file.get("tokenizer.ggml.tokens").and_then(MetaValue::as_array) {
        c.insert("vocab_size".into(), json!(t.len()));
    }
    let scaling = file.get(&key("rope.scaling.type")).and_then(MetaValue::as_str);
    if let (Some("linear"), Some(f)) = (scaling, num("rope.scaling.factor")) {
        c.insert("rope_scaling".into(), json!({"rope_type": "linear", "factor": f}));
    }
    (gguf.config)(&num, &mut c);
    if let Some(id) = file.get("tokenizer.ggml.eos_token_id").and_then(MetaValue::as_u64) {
        c.insert("eos_token_id".into(), json!(id));
    }
    Ok(Value::Object(c))
}

/// llama.cpp's tensor name → the Hugging Face name the model files take.
fn hf_name(gguf_name: &str, spec: &GgufSpec) -> Option<String> {
    let global = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(g) = global {
        return Some(g.to_string());
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, tensor) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (base, suffix) = tensor.rsplit_once('.')?;
    if let Some((_, module)) = spec.modules.iter().find(|(m, _)| *m == base) {
        return Some(format!("model.layers.{layer}.{module}.{suffix}"));
    }
    let module = match base {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_norm" => spec.ffn_norm,
        "post_attention_norm" => "post_attention_layernorm",
        "post_ffw_norm" => "post_feedforward_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        // A mixture of experts' router and stacked experts (`qwen3moe`), under mlx-lm's names.
        "ffn_gate_inp" => "mlp.gate",
        "ffn_gate_exps" => "mlp.switch_mlp.gate_proj",
        "ffn_up_exps" => "mlp.switch_mlp.up_proj",
        "ffn_down_exps" => "mlp.switch_mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{module}.{suffix}"))
}
