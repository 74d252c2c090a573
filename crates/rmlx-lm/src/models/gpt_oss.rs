//! gpt-oss (`gpt_oss`): OpenAI's open-weight mixture of experts. Pre-norm blocks of grouped-query
//! attention with biases on every projection, a learned sink logit per head joining each softmax,
//! YaRN-scaled rotary embeddings and a sliding window on every other layer; the feed-forward
//! routes each token to `num_experts_per_tok` of `num_local_experts` experts (top-k of the biased
//! router's logits, softmax over the chosen) whose SwiGLU is clamped (`g · σ(1.702 g) · (u + 1)`,
//! `g ≤ 7`, `|u| ≤ 7`) and biased. The blocks are [`moe`]'s; this file holds what differs.
//!
//! Checkpoints: mlx-lm's (`mlp.experts.{gate,up,down}_proj.{weight,bias}`, dense or quantised),
//! transformers' (`mlp.experts.gate_up_proj` `[E, hidden, 2·width]` with gate and up interleaved
//! by column, `down_proj` `[E, width, hidden]`, `*_bias`), or OpenAI's as published (the experts
//! in MXFP4: `gate_up_proj_blocks` `[E, 2·width, hidden/32, 16]` bytes with gate and up
//! interleaved by row, `gate_up_proj_scales` `[E, 2·width, hidden/32]` exponents, `down_proj_*`
//! likewise), all rewritten at load into mlx-lm's names; OpenAI's experts stay MXFP4 (MLX's
//! `mxfp4` mode reads the same bytes). GGUF `gpt-oss` files with float or MLX-mapped quantised
//! tensors (llama.cpp's names: `attn_sinks`, `ffn_gate_inp`, `ffn_{gate,up,down}_exps`).

use super::attention::AttentionSpec;
use super::moe::{self, Family};
use super::spec::{self, ArchitectureSpec, GgufSpec, MetadataNumber};
use super::Rope;
use crate::config::{Architecture, ModelConfig};
use crate::nn::{Builder, ExpertActivation, ExpertNames};
use crate::weights::Weight;
use crate::{Error, Result};
use rmlx::quantization::{QuantMode, Quantized};
use rmlx::{ops, Array, Dtype};
use serde_json::{json, Map, Value};

/// gpt-oss's attention: biases everywhere, sinks, `1/√head_dim`, the global (YaRN) rotation.
fn attention_spec(cfg: &ModelConfig) -> Result<AttentionSpec> {
    Ok(AttentionSpec {
        qkv_bias: true,
        qk_norm: None,
        scale: (cfg.head_dim() as f32).powf(-0.5),
        rope: Rope::global(cfg)?,
        logit_softcap: None,
        sinks: true,
        o_bias: true,
    })
}

/// The clamp of gpt-oss's experts' activation (`swiglu_limit`, 7 by default) and its slope.
fn activation(cfg: &ModelConfig) -> Result<ExpertActivation> {
    let limit = match cfg.raw.get("swiglu_limit") {
        None => 7.0,
        Some(v) => v
            .as_f64()
            .filter(|l| *l > 0.0)
            .ok_or_else(|| Error::Config(format!("config.json: swiglu_limit {v} must be a positive number")))?
            as f32,
    };
    Ok(ExpertActivation::ClampedSwiglu { alpha: 1.702, limit })
}

/// gpt-oss in [`super::spec::ARCHITECTURES`].
pub static SPEC: ArchitectureSpec = ArchitectureSpec {
    name: "gpt_oss",
    architecture: Architecture::Moe,
    model_types: &["gpt_oss"],
    hf_classes: &[("GptOssForCausalLM", "gpt_oss")],
    signature_tensor: Some("model.layers.0.mlp.router.weight"),
    chat_family: "harmony",
    gguf: Some(GgufSpec {
        arch: "gpt-oss",
        model_type: "gpt_oss",
        ffn_norm: "post_attention_layernorm",
        modules: &[
            ("attn_sinks", "self_attn.sinks"),
            ("ffn_gate_inp", "mlp.router"),
            ("ffn_gate_exps", "mlp.experts.gate_proj"),
            ("ffn_up_exps", "mlp.experts.up_proj"),
            ("ffn_down_exps", "mlp.experts.down_proj"),
        ],
        fix_up: spec::no_fix_up,
        config: gguf_config,
    }),
    build: |cfg, b| Ok(Box::new(load(cfg, b)?)),
    mlx_lm: spec::MlxLmLayout { sanitize: mlx_lm_layout, quantization: router_at_8_bits },
};

/// Only checkpoints in mlx-lm's layout (experts' gate and up apart) convert: transformers' fused
/// and MXFP4 experts are rewritten at load, not yet by `rmlx convert`.
fn mlx_lm_layout(_: &ModelConfig, t: &mut spec::Tensors) -> Result<()> {
    match t.keys().find(|n| n.contains(".gate_up_proj")) {
        Some(n) => Err(crate::Error::Config(format!(
            "`{n}`: gpt-oss's fused experts (transformers' layout) are not converted yet; rmlx loads \
             the checkpoint as it is, and converts gpt-oss in mlx-lm's layout"
        ))),
        None => Ok(()),
    }
}

/// mlx-lm keeps gpt-oss's routers at 8 bits in groups of 64.
fn router_at_8_bits(path: &str) -> Option<Value> {
    path.ends_with("router").then(|| json!({"group_size": 64, "bits": 8}))
}

/// llama.cpp's `gpt-oss.*` metadata: the experts (`expert_count`, `expert_used_count`, their width
/// `expert_feed_forward_length`), the window, and YaRN (`rope.scaling.factor` and
/// `original_context_length`; gpt-oss's `beta_fast` 32, `beta_slow` 1 and unrounded ramp, as its
/// config.json says: llama.cpp does not store them).
fn gguf_config(num: MetadataNumber, c: &mut Map<String, Value>) {
    for (key, field) in [
        ("expert_count", "num_local_experts"),
        ("expert_used_count", "num_experts_per_tok"),
        ("expert_feed_forward_length", "intermediate_size"),
        ("attention.sliding_window", "sliding_window"),
    ] {
        if let Some(n) = num(key) {
            c.insert(field.into(), json!(n as i64));
        }
    }
    if let Some(factor) = num("rope.scaling.factor").filter(|f| *f > 1.0) {
        let mut yarn =
            json!({"rope_type": "yarn", "factor": factor, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false});
        if let Some(n) = num("rope.scaling.original_context_length") {
            yarn["original_max_position_embeddings"] = json!(n as i64);
        }
        c.insert("rope_scaling".into(), yarn);
    }
}

/// Builds a gpt-oss model from `model.*` / `lm_head.*` tensors.
pub fn load(cfg: &ModelConfig, b: &mut Builder) -> Result<moe::Model> {
    for i in 0..cfg.num_hidden_layers {
        let experts = format!("model.layers.{i}.mlp.experts");
        rewrite_mxfp4_experts(b, &experts)?;
        rewrite_fused_experts(b, &experts)?;
        // llama.cpp names the sinks as a weight.
        let sinks = format!("model.layers.{i}.self_attn.sinks");
        b.rewrite(&format!("{sinks}.weight"), |w| Ok(vec![(sinks.clone(), w)]))?;
    }
    let family = Family {
        attention: attention_spec,
        ffn: "mlp",
        experts: ExpertNames {
            router: "router",
            stacked: "experts",
            biases: true,
            activation: activation(cfg)?,
            ..ExpertNames::SWITCH_MLP
        },
    };
    moe::Model::load(cfg, b, &family)
}

/// transformers' experts under `p` (`gate_up_proj` `[E, hidden, 2·width]`, columns alternating
/// gate and up, `down_proj` `[E, width, hidden]`, their biases) as mlx-lm's `[E, out, in]`
/// `gate_proj`, `up_proj` and `down_proj` with `bias`. Nothing where the checkpoint has mlx-lm's
/// names already.
fn rewrite_fused_experts(b: &mut Builder, p: &str) -> Result<()> {
    let dense = |w: Weight, name: &str| match w {
        Weight::Dense(a) if a.ndim() >= 2 => Ok(a),
        _ => Err(Error::Config(format!("{name}: expected a dense tensor of two or more axes"))),
    };
    // Every other element of the last axis, from `first`.
    let alternate = |a: &Array, first: i32| -> Result<Array> {
        let n = a.shape()[a.ndim() - 1];
        Ok(a.slice_axis(-1, first, n, 2)?)
    };
    let name = format!("{p}.gate_up_proj");
    b.rewrite(&name, |w| {
        let fused = dense(w, &name)?;
        let transposed = |first: i32| -> Result<Weight> {
            Ok(Weight::Dense(ops::contiguous(&alternate(&fused, first)?.swapaxes(-1, -2)?)?))
        };
        Ok(vec![(format!("{p}.gate_proj.weight"), transposed(0)?), (format!("{p}.up_proj.weight"), transposed(1)?)])
    })?;
    let name = format!("{p}.gate_up_proj_bias");
    b.rewrite(&name, |w| {
        let bias = match w {
            Weight::Dense(a) => a,
            Weight::Quantized(_) => return Err(Error::Config(format!("{name}: a quantised bias"))),
        };
        Ok(vec![
            (format!("{p}.gate_proj.bias"), Weight::Dense(ops::contiguous(&alternate(&bias, 0)?)?)),
            (format!("{p}.up_proj.bias"), Weight::Dense(ops::contiguous(&alternate(&bias, 1)?)?)),
        ])
    })?;
    let name = format!("{p}.down_proj");
    b.rewrite(&name, |w| {
        let t = ops::contiguous(&dense(w, &name)?.swapaxes(-1, -2)?)?;
        Ok(vec![(format!("{p}.down_proj.weight"), Weight::Dense(t))])
    })?;
    let name = format!("{p}.down_proj_bias");
    b.rewrite(&name, |w| Ok(vec![(format!("{p}.down_proj.bias"), w)]))?;
    Ok(())
}

/// OpenAI's MXFP4 experts under `p` (`{gate_up,down}_proj_{blocks,scales}`: 16 bytes of 32
/// 4-bit values a block, an 8-bit exponent a block; gate and up interleaved by row) as mlx-lm's
/// quantised `gate_proj`, `up_proj` and `down_proj` in MLX's `mxfp4` mode (the bytes read as
/// 32-bit words, 8 values each, the exponents as they are).
fn rewrite_mxfp4_experts(b: &mut Builder, p: &str) -> Result<()> {
    let bytes = |w: Option<Weight>, name: &str, axes: usize| -> Result<Array> {
        match w {
            Some(Weight::Dense(a)) if a.dtype() == Dtype::Uint8 && a.ndim() == axes => Ok(a),
            Some(_) => Err(Error::Config(format!("{name}: expected {axes} axes of bytes (MXFP4)"))),
            None => Err(Error::MissingTensor(name.to_string())),
        }
    };
    for fused in ["gate_up_proj", "down_proj"] {
        let (blocks, scales) = (format!("{p}.{fused}_blocks"), format!("{p}.{fused}_scales"));
        let Some(w) = b.take_raw(&blocks) else { continue };
        let packed = bytes(Some(w), &blocks, 4)?;
        let s = packed.shape().to_vec();
        let exponents = bytes(b.take_raw(&scales), &scales, 3)?;
        if s[3] != 16 {
            return Err(Error::Config(format!("{blocks}: MXFP4 blocks of {} bytes, not 16", s[3])));
        }
        if exponents.shape() != &s[..3] {
            return Err(Error::ShapeMismatch {
                name: scales,
                expected: s[..3].to_vec(),
                found: exponents.shape().to_vec(),
            });
        }
        let words = packed.reshape(&[s[0], s[1], s[2] * 16])?.view_as(Dtype::Uint32)?;
        let mxfp4 = |weight: Array, scales: Array| {
            Weight::Quantized(Quantized {
                weight,
                scales,
                biases: None,
                group_size: 32,
                bits: 4,
                mode: QuantMode::Mxfp4,
            })
        };
        if fused == "down_proj" {
            b.insert(&format!("{p}.down_proj.weight"), mxfp4(words, exponents));
            continue;
        }
        let rows = |a: &Array, first: i32| -> Result<Array> { Ok(ops::contiguous(&a.slice_axis(1, first, s[1], 2)?)?) };
        b.insert(&format!("{p}.gate_proj.weight"), mxfp4(rows(&words, 0)?, rows(&exponents, 0)?));
        b.insert(&format!("{p}.up_proj.weight"), mxfp4(rows(&words, 1)?, rows(&exponents, 1)?));
    }
    Ok(())
}
