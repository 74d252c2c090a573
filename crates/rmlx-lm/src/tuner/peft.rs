//! LoRA adapters in Hugging Face PEFT's layout, read and written:
//!
//! - `adapter_model.safetensors`: `base_model.model.<module>.lora_A.weight: [r, in]` and
//!   `…lora_B.weight: [out, r]`, the transposes of mlx-lm's `lora_a`/`lora_b`;
//! - `adapter_config.json`: `peft_type: "LORA"`, `r`, `lora_alpha` (the scale is `lora_alpha / r`, or
//!   `lora_alpha / √r` with `use_rslora`), `target_modules`, `layers_to_transform`.
//!
//! DoRA (`use_dora: true`) adds `…lora_magnitude_vector: [out]` per module, the learned magnitude
//! of each output row (rmlx's `m`); PEFT's rescaling by `m / ‖W + scale·BA‖` per row is rmlx's.
//!
//! Reading attaches an adapter to each module the weights file names, and checks the config
//! against them as PEFT does (`r` against every factor's rank, `target_modules` and
//! `layers_to_transform` against the modules adapted); `fan_in_fan_out`, biases and per-module
//! rank or alpha patterns are refused with an error naming them.

use super::lora::LoraConfig;
use crate::models::Model;
use crate::nn::Lora;
use crate::{Error, Result};
use rmlx::{Array, Dtype};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// PEFT's weights file.
pub const WEIGHTS: &str = "adapter_model.safetensors";
const PREFIX: &str = "base_model.model.";

/// Whether `dir` holds a PEFT adapter (its weights file).
pub fn is_peft_dir(dir: &Path) -> bool {
    dir.join(WEIGHTS).exists()
}

/// Attaches the PEFT adapters of `dir` to `model` (in `dtype`); returns their rank and scale.
pub fn load(model: &mut dyn Model, dir: &Path, dtype: Dtype) -> Result<LoraConfig> {
    let config_path = dir.join(super::ADAPTER_CONFIG);
    let file = config_path.display().to_string();
    let text = std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
    let cfg: Value = serde_json::from_str(&text).map_err(|e| Error::Config(format!("{file}: {e}")))?;
    let bad = |what: String| Error::Config(format!("{file}: {what}"));
    if cfg.get("peft_type").and_then(Value::as_str) != Some("LORA") {
        return Err(bad(format!(
            "peft_type {} is not supported (LORA is)",
            cfg.get("peft_type").unwrap_or(&Value::Null)
        )));
    }
    let dora = cfg.get("use_dora").and_then(Value::as_bool).unwrap_or(false);
    for (key, ok) in [("fan_in_fan_out", json!(false)), ("bias", json!("none"))] {
        if let Some(v) = cfg.get(key).filter(|v| !v.is_null() && **v != ok) {
            return Err(bad(format!("`{key}: {v}` is not supported")));
        }
    }
    for key in ["rank_pattern", "alpha_pattern"] {
        if cfg.get(key).and_then(Value::as_object).is_some_and(|o| !o.is_empty()) {
            return Err(bad(format!("per-module `{key}` is not supported")));
        }
    }
    let r = match cfg.get("r") {
        None | Some(Value::Null) => return Err(bad("`r` is missing".into())),
        Some(v) => v
            .as_u64()
            .filter(|&r| (1..=1 << 16).contains(&r))
            .ok_or_else(|| bad(format!("`r` must be a positive integer, got {v}")))? as f64,
    };
    let alpha = cfg.get("lora_alpha").and_then(Value::as_f64).unwrap_or(8.0);
    let rslora = cfg.get("use_rslora").and_then(Value::as_bool).unwrap_or(false);
    let scale = (if rslora { alpha / r.sqrt() } else { alpha / r }) as f32;

    let weights_path = dir.join(WEIGHTS);
    let mut arrays = rmlx::io::load_safetensors(&weights_path)?.arrays;
    // Per module: lora_A, lora_B and (DoRA) the magnitude vector.
    let mut modules: BTreeMap<String, [Option<Array>; 3]> = BTreeMap::new();
    for (key, a) in std::mem::take(&mut arrays) {
        let path = key.strip_prefix(PREFIX).unwrap_or(&key);
        let suffixes = [".lora_A.weight", ".lora_B.weight", ".lora_magnitude_vector", ".lora_magnitude_vector.weight"];
        let Some((module, slot)) =
            suffixes.iter().enumerate().find_map(|(i, suffix)| Some((path.strip_suffix(suffix)?, i.min(2))))
        else {
            return Err(Error::Corrupt {
                path: weights_path.display().to_string(),
                reason: format!("`{key}` is not a LoRA weight"),
            });
        };
        if slot == 2 && !dora {
            return Err(bad(format!("`{key}` is a DoRA magnitude, but `use_dora` is not true")));
        }
        modules.entry(module.to_string()).or_default()[slot] = Some(a);
    }
    let mut attached = BTreeSet::new();
    let mut failure = None;
    model.visit_linears("", &mut |path, linear| {
        let Some([a, b, m]) = modules.get(path) else { return };
        if dora && m.is_none() {
            failure = Some(Error::MissingTensor(format!(
                "{PREFIX}{path}.lora_magnitude_vector (in {})",
                weights_path.display()
            )));
            return;
        }
        let lora = match (a, b) {
            (Some(a), Some(b)) => (|| -> Result<Lora> {
                let (a, b) = (a.transpose()?.astype(dtype)?, b.transpose()?.astype(dtype)?);
                // A tensor-parallel rank's share of the layer's features.
                let (a, b) = (linear.adapter_part("lora_a", &a)?, linear.adapter_part("lora_b", &b)?);
                let magnitude = m.as_ref().map(|m| m.astype(Dtype::Float32)).transpose()?;
                let magnitude = magnitude.map(|m| linear.adapter_part("m", &m)).transpose()?;
                Ok(Lora { a, b, scale, dropout: 0.0, magnitude, kernels: false })
            })(),
            _ => {
                failure =
                    Some(Error::MissingTensor(format!("{PREFIX}{path}.lora_A/lora_B (in {})", weights_path.display())));
                return;
            }
        };
        match lora.and_then(|l| linear.set_lora(Some(l))) {
            Ok(_) => {
                attached.insert(path.to_string());
            }
            Err(e) => failure = Some(e),
        }
    });
    if let Some(e) = failure {
        return Err(e);
    }
    // A pipeline stage holds some of the blocks: the others' modules are its peers'.
    let held = super::adapters::held_blocks(model);
    let unknown = modules.keys().find(|m| !attached.contains(*m) && !super::adapters::held_elsewhere(model, &held, m));
    if let Some(unknown) = unknown {
        return Err(Error::Config(format!("{}: `{unknown}` is no linear layer of this model", weights_path.display())));
    }
    check_targets(&cfg, &modules, model, r as usize).map_err(bad)?;
    Ok(LoraConfig { rank: r as i32, scale, dropout: 0.0, keys: None })
}

/// What PEFT checks of a config against its weights and the model: every module's factors have
/// rank `r`; `target_modules` (a list of module names, or a regular expression over the full
/// names) names a linear layer of the model and covers every module in the weights;
/// `layers_to_transform` (a block or a list) covers every module's block.
fn check_targets(
    cfg: &Value,
    modules: &BTreeMap<String, [Option<Array>; 3]>,
    model: &mut dyn Model,
    r: usize,
) -> std::result::Result<(), String> {
    for (module, [a, b, _]) in modules {
        let ranks = [a.as_ref().map(|a| a.shape()[0]), b.as_ref().map(|b| *b.shape().last().unwrap_or(&0))];
        if let Some(found) = ranks.into_iter().flatten().find(|&n| n as usize != r) {
            return Err(format!("`r` is {r} but the weights of `{module}` have rank {found}"));
        }
    }
    let mut linears = Vec::new();
    model.visit_linears("", &mut |path, _| linears.push(path.to_string()));
    let leaf = |path: &str| path.rsplit('.').next().unwrap_or(path).to_string();
    match cfg.get("target_modules") {
        None | Some(Value::Null) => {}
        Some(Value::String(rx)) => {
            let re = regex::Regex::new(&format!("^(?:{rx})$"))
                .map_err(|e| format!("`target_modules` is not a regular expression: {e}"))?;
            if let Some(m) = modules.keys().find(|m| !re.is_match(m)) {
                return Err(format!("`target_modules` ({rx}) does not match `{m}`, which the weights adapt"));
            }
        }
        Some(Value::Array(names)) => {
            let names: Vec<&str> = names.iter().filter_map(Value::as_str).collect();
            if let Some(n) = names.iter().find(|n| !linears.iter().any(|l| leaf(l) == **n)) {
                return Err(format!("`target_modules` names `{n}`, which is no linear layer of this model"));
            }
            if let Some(m) = modules.keys().find(|m| !names.contains(&leaf(m).as_str())) {
                return Err(format!("`{m}` is adapted in the weights but not in `target_modules` {names:?}"));
            }
        }
        Some(v) => return Err(format!("`target_modules` must be a list of names or a regular expression, got {v}")),
    }
    let layers: Option<Vec<u64>> = match cfg.get("layers_to_transform") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => n.as_u64().map(|n| vec![n]),
        Some(Value::Array(a)) => a.iter().map(Value::as_u64).collect(),
        Some(_) => None,
    }
    .or_else(|| cfg.get("layers_to_transform").filter(|v| !v.is_null()).map(|_| vec![u64::MAX]));
    if let Some(layers) = layers {
        if layers.contains(&u64::MAX) {
            return Err("`layers_to_transform` must be a block index or a list of them".into());
        }
        for m in modules.keys() {
            match crate::models::block_path(m) {
                Some((i, _)) if layers.contains(&(i as u64)) => {}
                _ => {
                    return Err(format!("`{m}` is adapted in the weights but outside `layers_to_transform` {layers:?}"))
                }
            }
        }
    }
    Ok(())
}

/// Writes the model's adapters into `dir` in PEFT's layout (`base_model` names the base model in
/// the config). Every adapter must have the same rank and scale, as PEFT's config holds one.
pub fn save(model: &mut dyn Model, dir: &Path, base_model: &str) -> Result<usize> {
    let mut experts = None;
    model.visit_switches("", &mut |path, s| {
        if s.lora().is_some() {
            experts.get_or_insert(path.to_string());
        }
    });
    if let Some(path) = experts {
        return Err(Error::InvalidParameter(format!(
            "`{path}` has adapters per expert, which PEFT's LoRA layout has no form for: keep mlx-lm's layout, or fuse them"
        )));
    }
    let mut arrays = BTreeMap::new();
    let (mut ranks, mut scales) = (BTreeSet::new(), Vec::new());
    let (mut targets, mut layers, mut doras) = (BTreeSet::new(), BTreeSet::new(), BTreeSet::new());
    let (mut failure, mut modules) = (None, 0usize);
    model.visit_linears("", &mut |path, linear| {
        let Some(l) = linear.lora() else { return };
        doras.insert(l.magnitude.is_some());
        if let Some(m) = &l.magnitude {
            arrays.insert(format!("{PREFIX}{path}.lora_magnitude_vector"), m.clone());
        }
        modules += 1;
        ranks.insert(l.rank());
        scales.push(l.scale);
        targets.insert(path.rsplit('.').next().unwrap_or(path).to_string());
        if let Some((i, _)) = crate::models::block_path(path) {
            layers.insert(i);
        }
        match (l.a.transpose(), l.b.transpose()) {
            (Ok(a), Ok(b)) => {
                arrays.insert(format!("{PREFIX}{path}.lora_A.weight"), a);
                arrays.insert(format!("{PREFIX}{path}.lora_B.weight"), b);
            }
            (Err(e), _) | (_, Err(e)) => failure = Some(Error::from(e)),
        }
    });
    if let Some(e) = failure {
        return Err(e);
    }
    if arrays.is_empty() {
        return Err(Error::InvalidParameter("the model carries no adapter to save".into()));
    }
    if ranks.len() > 1 || scales.windows(2).any(|w| w[0] != w[1]) {
        return Err(Error::InvalidParameter("PEFT's config holds one rank and scale; these adapters differ".into()));
    }
    if doras.len() > 1 {
        return Err(Error::InvalidParameter("PEFT's config says DoRA or not for all adapters; these are mixed".into()));
    }
    let dora = doras.contains(&true);
    let r = *ranks.iter().next().expect("one adapter at least");
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    rmlx::io::save_safetensors(
        dir.join(WEIGHTS),
        &arrays,
        &BTreeMap::from([("format".to_string(), "pt".to_string())]),
    )?;
    let config = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": r,
        "lora_alpha": scales[0] as f64 * r as f64,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": false,
        "use_dora": dora,
        "fan_in_fan_out": false,
        "target_modules": targets.into_iter().collect::<Vec<_>>(),
        "layers_to_transform": layers.into_iter().collect::<Vec<_>>(),
        "modules_to_save": null,
        "inference_mode": true,
    });
    let path = dir.join(super::ADAPTER_CONFIG);
    std::fs::write(&path, serde_json::to_string_pretty(&config).expect("JSON")).map_err(|e| Error::io(&path, e))?;
    Ok(modules)
}
