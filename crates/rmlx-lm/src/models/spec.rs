//! What the native backend knows about each architecture, in one table: the `model_type`s and
//! Hugging Face class names that select it, its built-in chat template, its GGUF architecture with
//! the fix-ups llama.cpp's conversion needs undone, and the function that builds it. Each model
//! file declares its own [`ArchitectureSpec`] (as mlx-lm keeps `sanitize` beside each model);
//! [`ARCHITECTURES`] lists them, and the loaders and [`crate::config`] only ever read this table.

use super::Model;
use crate::config::{Architecture, ModelConfig};
use crate::nn::Builder;
use crate::weights::Weight;
use crate::Result;
use rmlx::Array;
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// One architecture the native backend implements.
pub struct ArchitectureSpec {
    /// Short name (the first `model_type`).
    pub name: &'static str,
    pub architecture: Architecture,
    /// The config.json `model_type` values it serves.
    pub model_types: &'static [&'static str],
    /// config.json `architectures` class names, each with the `model_type` it implies (for configs
    /// that name only the class).
    pub hf_classes: &'static [(&'static str, &'static str)],
    /// A tensor whose presence identifies the architecture when a config names neither
    /// (`None`: not recognised that way; llama is the fallback).
    pub signature_tensor: Option<&'static str>,
    /// The built-in chat template (`crate::chat::ChatTemplate::fallback`) for checkpoints without one.
    pub chat_family: &'static str,
    /// How GGUF files of this architecture are read; `None`: not from GGUF.
    pub gguf: Option<GgufSpec>,
    /// Builds the model from the checkpoint's (Hugging Face–named) tensors.
    pub build: fn(&ModelConfig, &mut Builder) -> Result<Box<dyn Model>>,
    /// How mlx-lm writes checkpoints of this architecture (what `rmlx convert` writes).
    pub mlx_lm: MlxLmLayout,
}

/// Tensors by name, as a checkpoint holds them.
pub type Tensors = BTreeMap<String, Array>;

/// How mlx-lm lays out an architecture's checkpoint: its model's `sanitize` and
/// `quant_predicate`, for `rmlx convert` to write what `mlx_lm.convert` writes.
pub struct MlxLmLayout {
    /// Hugging Face's tensors renamed or stacked as mlx-lm's model holds them, after the steps
    /// every architecture shares (rotary frequencies, other towers and a tied head dropped).
    pub sanitize: fn(&ModelConfig, &mut Tensors) -> Result<()>,
    /// The quantisation the model fixes for the layer `path` (a router kept at 8 bits), as the
    /// config entry mlx-lm writes for it; `None`: the conversion's own.
    pub quantization: fn(&str) -> Option<Value>,
}

/// An architecture mlx-lm holds under Hugging Face's names, quantised as asked.
pub const MLX_LM_AS_IS: MlxLmLayout = MlxLmLayout { sanitize: |_, _| Ok(()), quantization: |_| None };

/// mlx-lm's stacking of a mixture's experts: every `<block>.<moe>.experts.<e>.<projection>.<part>`
/// becomes one `<block>.<moe>.switch_mlp.<renamed>.<part>` `[E, …]`, with `renames` mapping the
/// per-expert projections to mlx-lm's (Mixtral's `w1` → `gate_proj`; others keep their names).
pub fn stack_experts(t: &mut Tensors, moe: &str, renames: &[(&str, &str)]) -> Result<()> {
    let marker = format!(".{moe}.experts.");
    let mut groups: BTreeMap<String, BTreeMap<usize, String>> = BTreeMap::new();
    for name in t.keys() {
        let Some((block, rest)) = name.split_once(&marker) else { continue };
        let Some((e, leaf)) = rest.split_once('.') else { continue };
        let Ok(e) = e.parse::<usize>() else { continue };
        let (projection, part) = leaf.rsplit_once('.').unwrap_or((leaf, ""));
        let renamed = renames.iter().find(|(from, _)| *from == projection).map_or(projection, |(_, to)| *to);
        groups.entry(format!("{block}.{moe}.switch_mlp.{renamed}.{part}")).or_default().insert(e, name.clone());
    }
    for (stacked, experts) in groups {
        if experts.keys().copied().ne(0..experts.len()) {
            return Err(crate::Error::MissingTensor(format!("an expert of `{stacked}` (found {:?})", experts.keys())));
        }
        let arrays: Vec<Array> = experts.values().map(|n| t.remove(n).expect("listed")).collect();
        let refs: Vec<&Array> = arrays.iter().collect();
        t.insert(stacked, rmlx::ops::stack(&refs, 0)?);
    }
    Ok(())
}

/// The GGUF side of an architecture.
pub struct GgufSpec {
    /// `general.architecture`.
    pub arch: &'static str,
    /// The `model_type` the file's configuration gets.
    pub model_type: &'static str,
    /// The Hugging Face module of llama.cpp's `ffn_norm` (the norm before the feed-forward).
    pub ffn_norm: &'static str,
    /// llama.cpp's block modules this architecture names otherwise than the shared table (Phi-3's
    /// fused `attn_qkv` and `ffn_up`), looked up first.
    pub modules: &'static [(&'static str, &'static str)],
    /// Undoes what llama.cpp's converter did to a tensor (given its Hugging Face name).
    pub fix_up: fn(&str, Weight, &HeadCounts) -> Result<Weight>,
    /// Adds the configuration llama.cpp keeps implicit, from the `<arch>.*` number `num`.
    pub config: fn(MetadataNumber, &mut Map<String, Value>),
}

/// A GGUF file's `<arch>.<key>` number, by key.
pub type MetadataNumber<'a> = &'a dyn Fn(&str) -> Option<f64>;

/// Query and key/value heads, for fix-ups that permute rows per head.
pub struct HeadCounts {
    pub heads: usize,
    pub kv_heads: usize,
}

/// A fix-up that changes nothing.
pub fn no_fix_up(_: &str, w: Weight, _: &HeadCounts) -> Result<Weight> {
    Ok(w)
}

/// No configuration beyond the common keys.
pub fn no_config(_: MetadataNumber, _: &mut Map<String, Value>) {}

/// Every architecture the native backend implements. Order matters for
/// [`ArchitectureSpec::signature_tensor`]: the first match wins.
pub static ARCHITECTURES: &[&ArchitectureSpec] = &[
    &super::llama::SPEC,
    // Before Qwen 3, whose signature tensor (q/k norms) Qwen 3 MoE has too.
    &super::moe::QWEN3_MOE_SPEC,
    &super::moe::MIXTRAL_SPEC,
    &super::gpt_oss::SPEC,
    &super::qwen3::SPEC,
    &super::qwen2::SPEC,
    &super::gemma3::SPEC,
    &super::gemma2::SPEC,
    &super::phi3::SPEC,
];

/// Parses a `config.json` as the native backend reads it: its `model_type` (else the one its
/// `architectures` class name implies; a config with neither stays empty and the loader decides
/// from the weights) must be one rmlx implements ([`crate::Error::UnsupportedArchitecture`] lists them),
/// then [`ModelConfig::from_value`].
pub fn parse_config(raw: Value) -> Result<ModelConfig> {
    let Value::Object(mut top) = raw else {
        return Err(crate::Error::Config("config.json must be a JSON object".into()));
    };
    let given = top.get("model_type").and_then(Value::as_str).unwrap_or_default().to_string();
    if given.is_empty() {
        let class = top.get("architectures").and_then(Value::as_array).and_then(|a| a.first()).and_then(Value::as_str);
        if let Some((_, model_type)) = class.and_then(for_hf_class) {
            top.insert("model_type".into(), Value::from(model_type));
        }
    } else {
        for_type(&given)?;
    }
    ModelConfig::from_value(Value::Object(top))
}

/// The native architecture serving `model_type`, or [`crate::Error::UnsupportedArchitecture`].
pub fn for_type(model_type: &str) -> Result<&'static ArchitectureSpec> {
    for_model_type(model_type).ok_or_else(|| crate::Error::UnsupportedArchitecture {
        model_type: model_type.to_string(),
        supported: model_type_list(),
    })
}

/// The native architecture of a parsed configuration.
pub fn of(cfg: &ModelConfig) -> Result<&'static ArchitectureSpec> {
    for_type(&cfg.model_type)
}

/// The architecture serving a config.json `model_type`.
pub fn for_model_type(model_type: &str) -> Option<&'static ArchitectureSpec> {
    ARCHITECTURES.iter().copied().find(|s| s.model_types.contains(&model_type))
}

/// The architecture of a config.json class name, with the `model_type` the class implies.
pub fn for_hf_class(class: &str) -> Option<(&'static ArchitectureSpec, &'static str)> {
    ARCHITECTURES.iter().find_map(|s| s.hf_classes.iter().find(|(c, _)| *c == class).map(|(_, t)| (*s, *t)))
}

/// The architecture of a GGUF `general.architecture`.
pub fn for_gguf(arch: &str) -> Option<&'static ArchitectureSpec> {
    ARCHITECTURES.iter().copied().find(|s| s.gguf.as_ref().is_some_and(|g| g.arch == arch))
}

/// The `model_type` for a checkpoint whose config names no architecture, from its tensor names:
/// the first [`ArchitectureSpec::signature_tensor`] present, else `"llama"`.
pub fn guess_from_tensors(has: impl Fn(&str) -> bool) -> &'static str {
    ARCHITECTURES.iter().find(|s| s.signature_tensor.is_some_and(&has)).map_or("llama", |s| s.model_types[0])
}

/// Every supported `model_type`, comma-separated (for error messages).
pub fn model_type_list() -> String {
    ARCHITECTURES.iter().flat_map(|s| s.model_types.iter().copied()).collect::<Vec<_>>().join(", ")
}

/// Every supported GGUF architecture, comma-separated.
pub fn gguf_list() -> String {
    ARCHITECTURES.iter().filter_map(|s| s.gguf.as_ref().map(|g| g.arch)).collect::<Vec<_>>().join(", ")
}

/// Whether the native backend can build a Hugging Face folder, judged from its config.json alone
/// (`model_type`, else the class name in `architectures`; a config with neither is taken as
/// llama-like, as the loader does).
pub fn supports_config(config: &Value) -> bool {
    let model_type = config.get("model_type").and_then(Value::as_str).unwrap_or("");
    if !model_type.is_empty() {
        return for_model_type(model_type).is_some();
    }
    match config.get("architectures").and_then(Value::as_array).and_then(|a| a.first()).and_then(Value::as_str) {
        Some(class) => for_hf_class(class).is_some(),
        None => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_types_classes_and_gguf_names_select_their_architecture() {
        assert_eq!(for_model_type("mistral").unwrap().name, "llama");
        assert_eq!(for_hf_class("Qwen3ForCausalLM").unwrap().1, "qwen3");
        assert_eq!(for_gguf("gemma3").unwrap().name, "gemma3");
        assert_eq!(for_hf_class("Phi3ForCausalLM").unwrap().1, "phi3");
        assert!(for_model_type("starcoder2").is_none());
    }
}
