//! Checks of a raw `config.json` object before it is deserialised: every field rmlx reads has the
//! right JSON type, sizes are integers within bounds that no real model exceeds (so nothing is
//! allocated from an absurd size), and floats that divide or exponentiate are positive and finite
//! in `f32`. Each error names the field: serde's own messages do not.

use crate::{Error, Result};
use serde_json::{Map, Value};

/// What a field must hold.
enum Kind {
    /// An integer in `[min, max]`.
    Int(i64, i64),
    /// A number that is positive and finite as `f32`.
    Positive,
    /// A number at least 1 and finite as `f32` (RoPE bases: a smaller base sends frequencies to
    /// infinity, and the rotations to NaN).
    AtLeastOne,
    Bool,
    Str,
    StrList,
    /// A list of numbers, each positive and finite as `f32`.
    PositiveList,
    /// A token id (a non-negative integer) or a list of them.
    Ids,
}

const MAX_I32: i64 = i32::MAX as i64;

/// The fields and their kinds. A field that is absent or `null` is left to the defaults (or to
/// serde's "missing field" error, which names it).
const FIELDS: &[(&str, Kind)] = &[
    ("hidden_size", Kind::Int(1, 1 << 17)),
    ("intermediate_size", Kind::Int(1, 1 << 20)),
    ("num_hidden_layers", Kind::Int(1, 1 << 12)),
    ("num_attention_heads", Kind::Int(1, 1 << 12)),
    ("num_key_value_heads", Kind::Int(1, 1 << 12)),
    ("head_dim", Kind::Int(1, 1 << 13)),
    ("vocab_size", Kind::Int(1, 1 << 24)),
    ("max_position_embeddings", Kind::Int(1, MAX_I32)),
    ("sliding_window", Kind::Int(1, MAX_I32)),
    ("use_sliding_window", Kind::Bool),
    ("max_window_layers", Kind::Int(0, 1 << 12)),
    ("sliding_window_pattern", Kind::Int(1, 1 << 12)),
    ("rms_norm_eps", Kind::Positive),
    ("rope_theta", Kind::AtLeastOne),
    ("rope_local_base_freq", Kind::AtLeastOne),
    ("query_pre_attn_scalar", Kind::Positive),
    ("final_logit_softcapping", Kind::Positive),
    ("attn_logit_softcapping", Kind::Positive),
    ("tie_word_embeddings", Kind::Bool),
    ("attention_bias", Kind::Bool),
    ("model_type", Kind::Str),
    ("torch_dtype", Kind::Str),
    ("dtype", Kind::Str),
    ("layer_types", Kind::StrList),
    ("rope_freq_factors", Kind::PositiveList),
    ("partial_rotary_factor", Kind::Positive),
    ("original_max_position_embeddings", Kind::Int(1, MAX_I32)),
    ("eos_token_id", Kind::Ids),
    ("bos_token_id", Kind::Ids),
];

/// Checks the fields of a config object (after defaults are filled in).
pub(super) fn check_fields(top: &Map<String, Value>) -> Result<()> {
    for (name, kind) in FIELDS {
        let Some(v) = top.get(*name).filter(|v| !v.is_null()) else { continue };
        check(kind, v).map_err(|why| Error::Config(format!("`{name}` {why}")))?;
    }
    for key in ["quantization", "quantization_config", "rope_scaling"] {
        if let Some(v) = top.get(key).filter(|v| !v.is_null() && !v.is_object()) {
            return Err(Error::Config(format!("`{key}` must be an object, got {}", short(v))));
        }
    }
    Ok(())
}

fn check(kind: &Kind, v: &Value) -> std::result::Result<(), String> {
    match *kind {
        Kind::Int(min, max) => {
            if let (None, Some(n)) = (v.as_i64(), v.as_u64()) {
                return Err(format!("is {n}, more than the {max} rmlx accepts"));
            }
            let n = v.as_i64().ok_or_else(|| format!("must be an integer, got {}", short(v)))?;
            if n < min {
                let what = if min == 1 { "positive".to_string() } else { format!("at least {min}") };
                return Err(format!("must be {what}, got {n}"));
            }
            if n > max {
                return Err(format!("is {n}, more than the {max} rmlx accepts"));
            }
        }
        Kind::Positive => positive(v)?,
        Kind::AtLeastOne => at_least_one(v)?,
        Kind::Bool if !v.is_boolean() => return Err(format!("must be true or false, got {}", short(v))),
        Kind::Str if !v.is_string() => return Err(format!("must be a string, got {}", short(v))),
        Kind::StrList => {
            if !v.as_array().is_some_and(|a| a.iter().all(Value::is_string)) {
                return Err(format!("must be a list of strings, got {}", short(v)));
            }
        }
        Kind::PositiveList => {
            let a = v.as_array().ok_or_else(|| format!("must be a list of numbers, got {}", short(v)))?;
            for (i, x) in a.iter().enumerate() {
                positive(x).map_err(|why| format!("element {i} {why}"))?;
            }
        }
        Kind::Ids => {
            let id = |x: &Value| x.as_u64().is_some_and(|n| n <= u32::MAX as u64);
            let ok = id(v) || v.as_array().is_some_and(|a| a.iter().all(|x| id(x) || x.is_null()));
            if !ok {
                return Err(format!("must be a token id or a list of them, got {}", short(v)));
            }
        }
        Kind::Bool | Kind::Str => {}
    }
    Ok(())
}

/// A number that stays positive and finite once rounded to `f32`.
pub(super) fn positive(v: &Value) -> std::result::Result<(), String> {
    let x = v.as_f64().ok_or_else(|| format!("must be a number, got {}", short(v)))?;
    let f = x as f32;
    if !(f.is_finite() && f > 0.0) {
        return Err(format!("must be positive and finite, got {}", short(v)));
    }
    Ok(())
}

/// A number at least 1 and finite once rounded to `f32`.
pub(super) fn at_least_one(v: &Value) -> std::result::Result<(), String> {
    let x = v.as_f64().ok_or_else(|| format!("must be a number, got {}", short(v)))?;
    let f = x as f32;
    if !(f.is_finite() && f >= 1.0) {
        return Err(format!("must be at least 1 and finite, got {}", short(v)));
    }
    Ok(())
}

/// A value for a message, cut to a readable length.
fn short(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(40) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s,
    }
}
