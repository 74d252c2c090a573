//! Mixture-of-experts decoders: Qwen 3 MoE (`qwen3_moe`) and Mixtral (`mixtral`). Llama's
//! blocks (Qwen 3's attention with q/k norms for `qwen3_moe`) whose feed-forward is routed
//! experts ([`SparseMoe`]): the router's softmax picks the top `num_experts_per_tok` experts of
//! `num_experts` per token and weighs their SwiGLU outputs by the probabilities, renormalised to
//! sum to one where `norm_topk_prob` says so (Mixtral's softmax over the chosen scores is the
//! same). Qwen 3 MoE layers listed in `mlp_only_layers`, or off `decoder_sparse_step`, keep a
//! dense MLP (a layer routes when the checkpoint has its router, which the config, where it lists
//! the layers, must agree with). Experts load from mlx-lm's stacked `switch_mlp` tensors
//! (quantised ones stay quantised), from Hugging Face's one tensor per expert, or from a GGUF
//! `qwen3moe` file's `ffn_*_exps`.

use super::attention::{Attention, AttentionSpec};
use super::decoder::{Decoder, DecoderBlock};
use super::spec::{self, ArchitectureSpec, GgufSpec, MetadataNumber};
use super::{llama, qwen3};
use crate::cache::KvCache;
use crate::config::{Architecture, ModelConfig};
use crate::nn::{join, Builder, ExpertNames, GatedMlp, Linear, Module, RmsNorm};
use crate::nn::{Role, SparseMoe, SwitchLinear};
use crate::{Error, Result};
use rmlx::Array;
use serde::Deserialize;
use serde_json::{json, Map, Value};

/// The routing fields of a MoE `config.json` (transformers' defaults where a field may be left out).
#[derive(Debug, Deserialize)]
pub struct MoeConfig {
    /// Experts per MoE layer (Mixtral: `num_local_experts`).
    #[serde(alias = "num_local_experts")]
    pub num_experts: i32,
    pub num_experts_per_tok: i32,
    /// Each expert's hidden width (Qwen 3 MoE); Mixtral's experts take `intermediate_size`.
    #[serde(default)]
    pub moe_intermediate_size: Option<i32>,
    #[serde(default)]
    pub norm_topk_prob: bool,
    /// Every `decoder_sparse_step`-th layer is a MoE layer (Qwen 3 MoE; 1: all).
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    /// Layers with a dense MLP instead (Qwen 3 MoE).
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    /// Whether the config says which layers route (`mlp_only_layers` or `decoder_sparse_step`).
    #[serde(skip)]
    pub layers_listed: bool,
}

fn one() -> usize {
    1
}

impl MoeConfig {
    /// The routing fields of `cfg`; Mixtral's and gpt-oss's routing always renormalises (a softmax
    /// over the chosen experts' logits).
    pub fn of(cfg: &ModelConfig) -> Result<Self> {
        let mut moe: MoeConfig = serde_json::from_value(Value::Object(cfg.raw.clone()))
            .map_err(|e| Error::Config(format!("config.json ({}): {e}", cfg.model_type)))?;
        if matches!(cfg.model_type.as_str(), "mixtral" | "gpt_oss") {
            moe.norm_topk_prob = true;
        }
        moe.layers_listed = cfg.raw.contains_key("mlp_only_layers") || cfg.raw.contains_key("decoder_sparse_step");
        if moe.num_experts < 1 || !(1..=moe.num_experts).contains(&moe.num_experts_per_tok) {
            return Err(Error::Config(format!(
                "config.json: num_experts_per_tok {} must be in 1..={} (num_experts)",
                moe.num_experts_per_tok, moe.num_experts
            )));
        }
        if moe.moe_intermediate_size.is_some_and(|m| m < 1) || moe.decoder_sparse_step < 1 {
            return Err(Error::Config(
                "config.json: moe_intermediate_size and decoder_sparse_step must be positive".into(),
            ));
        }
        Ok(moe)
    }

    /// Whether layer `i` routes to experts.
    pub fn sparse(&self, i: usize) -> bool {
        !self.mlp_only_layers.contains(&i) && (i + 1).is_multiple_of(self.decoder_sparse_step)
    }
}

/// What differs between the families built on these blocks (Qwen 3 MoE, Mixtral, gpt-oss).
pub(crate) struct Family {
    pub attention: fn(&ModelConfig) -> Result<AttentionSpec>,
    /// The feed-forward's name in a block (`mlp`, `block_sparse_moe`).
    pub ffn: &'static str,
    pub experts: ExpertNames,
}

const QWEN3_MOE: Family = Family {
    attention: qwen3::attention_spec,
    ffn: "mlp",
    experts: ExpertNames {
        router: "gate",
        experts: "experts",
        projections: ["gate_proj", "up_proj", "down_proj"],
        ..ExpertNames::SWITCH_MLP
    },
};

const MIXTRAL: Family = Family {
    attention: llama::attention_spec,
    ffn: "block_sparse_moe",
    experts: ExpertNames {
        router: "gate",
        experts: "experts",
        projections: ["w1", "w3", "w2"],
        ..ExpertNames::SWITCH_MLP
    },
};

/// A block's feed-forward.
#[derive(Clone)]
enum Ffn {
    Dense(GatedMlp),
    Experts(SparseMoe),
}

/// `x + attn(norm(x))`, then `h + ffn(norm(h))`.
#[derive(Clone)]
pub struct Block {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    ffn: Ffn,
    ffn_name: &'static str,
}

impl Block {
    fn load(cfg: &ModelConfig, moe: &MoeConfig, family: &Family, b: &mut Builder, i: usize) -> Result<Self> {
        let (p, h, eps) = (format!("model.layers.{i}"), cfg.hidden_size, cfg.rms_norm_eps);
        let ffn_prefix = format!("{p}.{}", family.ffn);
        // A layer routes when the checkpoint holds its router (GGUF files say nothing of
        // `mlp_only_layers`); where the config says which layers route, the two must agree.
        let routed = b.has(&format!("{ffn_prefix}.{}.weight", family.experts.router));
        if moe.layers_listed && routed != moe.sparse(i) {
            return Err(Error::Config(format!(
                "layer {i}: config.json makes it {} (mlp_only_layers, decoder_sparse_step) but the checkpoint's {ffn_prefix} {}",
                if moe.sparse(i) { "routed" } else { "dense" },
                if routed { "has a router" } else { "has none" }
            )));
        }
        let ffn = if routed {
            let width = moe.moe_intermediate_size.unwrap_or(cfg.intermediate_size);
            let counts = (moe.num_experts, moe.num_experts_per_tok);
            Ffn::Experts(SparseMoe::load(b, &ffn_prefix, &family.experts, (h, width), counts, moe.norm_topk_prob)?)
        } else {
            Ffn::Dense(GatedMlp::load(b, &ffn_prefix, h, cfg.intermediate_size, false)?)
        };
        Ok(Self {
            input_layernorm: b.rms_norm(&format!("{p}.input_layernorm"), h, eps, false)?,
            self_attn: Attention::load(cfg, b, &format!("{p}.self_attn"), (family.attention)(cfg)?)?,
            post_attention_layernorm: b.rms_norm(&format!("{p}.post_attention_layernorm"), h, eps, false)?,
            ffn,
            ffn_name: family.ffn,
        })
    }
}

impl DecoderBlock for Block {
    fn forward(&self, x: &Array, batch: i32, cache: &mut KvCache) -> Result<Array> {
        let o = self.self_attn.attend(x, &self.input_layernorm, batch, cache)?;
        let o_proj = self.self_attn.o_proj();
        match &self.ffn {
            Ffn::Dense(mlp) => mlp.forward_after_attention(&o, x, o_proj, &self.post_attention_layernorm),
            Ffn::Experts(moe) => moe.forward_residual(&o_proj.forward_add(&o, x)?, &self.post_attention_layernorm),
        }
    }
}

impl Module for Block {
    fn visit(&self, p: &str, f: &mut dyn FnMut(&str, Role, &Array)) {
        self.input_layernorm.visit(&join(p, "input_layernorm"), f);
        self.self_attn.visit(&join(p, "self_attn"), f);
        self.post_attention_layernorm.visit(&join(p, "post_attention_layernorm"), f);
        match &self.ffn {
            Ffn::Dense(m) => m.visit(&join(p, self.ffn_name), f),
            Ffn::Experts(m) => m.visit(&join(p, self.ffn_name), f),
        }
    }

    fn visit_mut(&mut self, p: &str, f: &mut dyn FnMut(&str, &mut Array)) {
        self.input_layernorm.visit_mut(&join(p, "input_layernorm"), f);
        self.self_attn.visit_mut(&join(p, "self_attn"), f);
        self.post_attention_layernorm.visit_mut(&join(p, "post_attention_layernorm"), f);
        match &mut self.ffn {
            Ffn::Dense(m) => m.visit_mut(&join(p, self.ffn_name), f),
            Ffn::Experts(m) => m.visit_mut(&join(p, self.ffn_name), f),
        }
    }

    fn visit_linears(&mut self, p: &str, f: &mut dyn FnMut(&str, &mut Linear)) {
        self.self_attn.visit_linears(&join(p, "self_attn"), f);
        match &mut self.ffn {
            Ffn::Dense(m) => m.visit_linears(&join(p, self.ffn_name), f),
            Ffn::Experts(m) => m.visit_linears(&join(p, self.ffn_name), f),
        }
    }

    fn visit_switches(&mut self, p: &str, f: &mut dyn FnMut(&str, &mut SwitchLinear)) {
        if let Ffn::Experts(m) = &mut self.ffn {
            m.visit_switches(&join(p, self.ffn_name), f);
        }
    }
}

/// The mixtures of experts' decoder: [`Decoder`] over their blocks.
pub type Model = Decoder<Block>;

impl Decoder<Block> {
    /// The model of `family` from `model.*` / `lm_head.*` tensors.
    pub(crate) fn load(cfg: &ModelConfig, b: &mut Builder, family: &Family) -> Result<Self> {
        let moe = MoeConfig::of(cfg)?;
        let layers = b
            .stage(cfg.num_hidden_layers)
            .layers()
            .map(|i| Block::load(cfg, &moe, family, b, i))
            .collect::<Result<_>>()?;
        Decoder::new(cfg, b, layers)
    }
}

/// Qwen 3 MoE in [`super::spec::ARCHITECTURES`].
pub static QWEN3_MOE_SPEC: ArchitectureSpec = ArchitectureSpec {
    name: "qwen3_moe",
    architecture: Architecture::Moe,
    model_types: &["qwen3_moe"],
    hf_classes: &[("Qwen3MoeForCausalLM", "qwen3_moe")],
    signature_tensor: Some("model.layers.0.mlp.gate.weight"),
    chat_family: "chatml",
    gguf: Some(GgufSpec {
        arch: "qwen3moe",
        model_type: "qwen3_moe",
        ffn_norm: "post_attention_layernorm",
        modules: &[],
        fix_up: spec::no_fix_up,
        config: qwen3moe_gguf_config,
    }),
    build: |cfg, b| Ok(Box::new(Model::load(cfg, b, &QWEN3_MOE)?)),
    mlx_lm: spec::MlxLmLayout {
        sanitize: |_, t| spec::stack_experts(t, "mlp", &[]),
        // mlx-lm keeps Qwen 3 MoE's routers at 8 bits in groups of 64.
        quantization: |path| path.ends_with("mlp.gate").then(|| json!({"group_size": 64, "bits": 8})),
    },
};

/// llama.cpp's `qwen3moe.expert_count`, `expert_used_count` and `expert_feed_forward_length`;
/// its Qwen 3 MoE graph always renormalises the chosen experts' weights.
fn qwen3moe_gguf_config(num: MetadataNumber, c: &mut Map<String, Value>) {
    for (key, field) in [
        ("expert_count", "num_experts"),
        ("expert_used_count", "num_experts_per_tok"),
        ("expert_feed_forward_length", "moe_intermediate_size"),
    ] {
        if let Some(n) = num(key) {
            c.insert(field.into(), json!(n as i64));
        }
    }
    c.insert("norm_topk_prob".into(), json!(true));
}

/// Mixtral in [`super::spec::ARCHITECTURES`].
pub static MIXTRAL_SPEC: ArchitectureSpec = ArchitectureSpec {
    name: "mixtral",
    architecture: Architecture::Moe,
    model_types: &["mixtral"],
    hf_classes: &[("MixtralForCausalLM", "mixtral")],
    signature_tensor: Some("model.layers.0.block_sparse_moe.gate.weight"),
    chat_family: "llama3",
    gguf: None,
    build: |cfg, b| {
        mixtral_from_llama_names(cfg, b)?;
        Ok(Box::new(Model::load(cfg, b, &MIXTRAL)?))
    },
    mlx_lm: spec::MlxLmLayout {
        sanitize: |_, t| {
            spec::stack_experts(t, "block_sparse_moe", &[("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")])
        },
        quantization: |_| None,
    },
};

/// llama.cpp writes Mixtral as a `llama` file with experts, whose router and experts then come
/// under llama's feed-forward names (`mlp.gate`, `mlp.switch_mlp.*`): Mixtral reads them as its
/// `block_sparse_moe`.
fn mixtral_from_llama_names(cfg: &ModelConfig, b: &mut Builder) -> Result<()> {
    for i in 0..cfg.num_hidden_layers {
        for part in ["gate", "switch_mlp.gate_proj", "switch_mlp.up_proj", "switch_mlp.down_proj"] {
            let to = format!("model.layers.{i}.block_sparse_moe.{part}.weight");
            b.rewrite(&format!("model.layers.{i}.mlp.{part}.weight"), |w| Ok(vec![(to, w)]))?;
        }
    }
    Ok(())
}
