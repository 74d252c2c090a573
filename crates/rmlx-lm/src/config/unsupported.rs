//! Config fields that change what a model computes, checked against what each family implements:
//! a value rmlx would otherwise drop silently (an MLP bias, a partial rotary embedding, attention
//! soft-capping, another activation) is refused with an error naming the field. Fields a family
//! implements are read by its model file; the rest must hold their neutral value (or be absent).

use crate::{Error, Result};
use serde_json::{Map, Value};

/// Whether `v` is what a family without the feature means by it (absent counts as neutral).
type Neutral = fn(&Value) -> bool;

fn null_or_false(v: &Value) -> bool {
    v.is_null() || v == &Value::Bool(false)
}
fn null_or_one(v: &Value) -> bool {
    v.is_null() || v.as_f64() == Some(1.0)
}
fn null(v: &Value) -> bool {
    v.is_null()
}

/// `(field, neutral value, the model types that implement other values)`.
const FIELDS: &[(&str, Neutral, &[&str])] = &[
    ("mlp_bias", null_or_false, &[]),
    ("partial_rotary_factor", null_or_one, &["phi3"]),
    ("attn_logit_softcapping", null, &["gemma2"]),
    ("final_logit_softcapping", null, &["gemma3", "gemma3_text", "gemma2"]),
    ("use_bidirectional_attention", null_or_false, &[]),
];

/// The activation of the feed-forward gate each family computes, and the config keys naming it.
fn activation(model_type: &str) -> (&'static [&'static str], &'static [&'static str]) {
    match model_type {
        // transformers' Gemma 3 reads `hidden_activation`; GELU's tanh approximation either way.
        "gemma3" | "gemma3_text" | "gemma2" => {
            (&["hidden_activation", "hidden_act"], &["gelu_pytorch_tanh", "gelu_new"])
        }
        _ => (&["hidden_act"], &["silu", "swish"]),
    }
}

/// Refuses a config that sets a field its family does not implement (see the module doc).
pub(super) fn check(model_type: &str, top: &Map<String, Value>) -> Result<()> {
    for (field, neutral, implemented) in FIELDS {
        if let Some(v) = top.get(*field) {
            if !neutral(v) && !implemented.contains(&model_type) {
                return Err(Error::Config(format!(
                    "`{field}`: {v} is not supported for model_type `{model_type}` (rmlx would ignore it and compute \
                     another model)"
                )));
            }
        }
    }
    let (keys, allowed) = activation(model_type);
    if let Some((key, name)) = keys.iter().find_map(|k| Some((*k, top.get(*k)?.as_str()?))) {
        if !allowed.contains(&name) {
            return Err(Error::Config(format!(
                "`{key}`: `{name}` is not supported for model_type `{model_type}` (supported: {})",
                allowed.join(", ")
            )));
        }
    }
    Ok(())
}
