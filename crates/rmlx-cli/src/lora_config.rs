//! `rmlx lora -c config.yaml`: mlx-lm's YAML training config. Its top-level keys are the flags'
//! names (`batch_size`, `iters`, `learning_rate`, ...), plus `lora_parameters {rank, scale,
//! dropout, keys}`, `optimizer_config.<name>` and `lr_schedule {name, arguments, warmup,
//! warmup_init}`. A flag given on the command line beats the YAML, which beats the defaults.

use anyhow::{bail, Context, Result};
use clap::parser::ValueSource;
use clap::ArgMatches;
use rmlx_lm::tuner::optim::{Adafactor, OptimizerKind, Schedule};
use serde_json::{Map, Value};
use std::path::Path;
use yaml_rust2::{Yaml, YamlLoader};

/// The YAML document as JSON (numbers stay numbers, strings strings).
fn to_json(y: &Yaml) -> Value {
    match y {
        Yaml::Real(s) => s.parse::<f64>().map_or_else(|_| Value::String(s.clone()), Value::from),
        Yaml::Integer(i) => Value::from(*i),
        Yaml::String(s) => Value::String(s.clone()),
        Yaml::Boolean(b) => Value::Bool(*b),
        Yaml::Array(a) => Value::Array(a.iter().map(to_json).collect()),
        Yaml::Hash(h) => Value::Object(
            h.iter().map(|(k, v)| (k.as_str().map_or_else(|| format!("{k:?}"), str::to_string), to_json(v))).collect(),
        ),
        Yaml::Null | Yaml::BadValue | Yaml::Alias(_) => Value::Null,
    }
}

/// Reads a YAML config file into its top-level map.
pub fn read(path: &Path) -> Result<Map<String, Value>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let docs = YamlLoader::load_from_str(&text).with_context(|| format!("{}: not valid YAML", path.display()))?;
    match docs.first().map(to_json) {
        Some(Value::Object(m)) => Ok(m),
        None => Ok(Map::new()),
        Some(_) => bail!("{}: the config must be a mapping of settings", path.display()),
    }
}

/// Whether the flag `id` was given on the command line (then the YAML does not override it).
pub fn given(matches: Option<&ArgMatches>, id: &str) -> bool {
    matches.and_then(|m| m.value_source(id)) == Some(ValueSource::CommandLine)
}

/// A setting's value as `T`, naming the file and key when it has the wrong type.
pub fn get<T: serde::de::DeserializeOwned>(cfg: &Map<String, Value>, key: &str, file: &Path) -> Result<Option<T>> {
    match cfg.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => serde_json::from_value(v.clone())
            .map(Some)
            .with_context(|| format!("{}: `{key}` has the wrong type ({v})", file.display())),
    }
}

/// `optimizer_config.<name>` applied to MLX's defaults for `name`. Its keys are the keyword
/// arguments of MLX's optimizer (mlx-lm passes them on as they are), so another key is an error,
/// as is a value of the wrong type.
pub fn optimizer(name: &str, cfg: &Map<String, Value>, file: &Path) -> Result<OptimizerKind> {
    let known: &[&str] = match name {
        "adam" => &["betas", "eps", "bias_correction"],
        "adamw" => &["betas", "eps", "weight_decay", "bias_correction"],
        "sgd" => &["momentum", "weight_decay", "dampening", "nesterov"],
        "adafactor" => &[
            "eps",
            "clip_threshold",
            "decay_rate",
            "beta_1",
            "weight_decay",
            "scale_parameter",
            "relative_step",
            "warmup_init",
        ],
        other => bail!("unknown optimizer `{other}` (adam, adamw, sgd or adafactor; muon is not implemented yet)"),
    };
    let at = |k: &str| format!("{}: optimizer_config.{name}.{k}", file.display());
    let own = match cfg.get("optimizer_config").and_then(|o| o.get(name)) {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(v) => bail!("{}: optimizer_config.{name} must be a mapping of settings, got {v}", file.display()),
    };
    if let Some(k) = own.keys().find(|k| !known.contains(&k.as_str())) {
        bail!("{} is no setting of MLX's {name} optimizer (it takes {})", at(k), known.join(", "));
    }
    let num = |k: &str, default: f64| -> Result<f64> {
        own.get(k).map_or(Ok(default), |v| v.as_f64().with_context(|| format!("{} must be a number, got {v}", at(k))))
    };
    let flag = |k: &str, default: bool| -> Result<bool> {
        own.get(k)
            .map_or(Ok(default), |v| v.as_bool().with_context(|| format!("{} must be true or false, got {v}", at(k))))
    };
    let pair = |k: &str, default: (f64, f64)| -> Result<(f64, f64)> {
        match own.get(k) {
            None => Ok(default),
            Some(Value::Array(b)) if b.len() == 2 && b.iter().all(Value::is_number) => {
                Ok((b[0].as_f64().unwrap_or(0.0), b[1].as_f64().unwrap_or(0.0)))
            }
            Some(v) => bail!("{} must be two numbers, got {v}", at(k)),
        }
    };
    let betas = || -> Result<(f32, f32)> { pair("betas", (0.9, 0.999)).map(|(a, b)| (a as f32, b as f32)) };
    Ok(match name {
        "adam" => OptimizerKind::Adam {
            betas: betas()?,
            eps: num("eps", 1e-8)? as f32,
            bias_correction: flag("bias_correction", false)?,
        },
        "adamw" => OptimizerKind::AdamW {
            betas: betas()?,
            eps: num("eps", 1e-8)? as f32,
            weight_decay: num("weight_decay", 0.01)? as f32,
            bias_correction: flag("bias_correction", false)?,
        },
        "sgd" => OptimizerKind::Sgd {
            momentum: num("momentum", 0.0)? as f32,
            weight_decay: num("weight_decay", 0.0)? as f32,
            dampening: num("dampening", 0.0)? as f32,
            nesterov: flag("nesterov", false)?,
        },
        _ => {
            let d = Adafactor::default();
            OptimizerKind::Adafactor(Adafactor {
                eps: pair("eps", d.eps)?,
                clip_threshold: num("clip_threshold", d.clip_threshold)?,
                decay_rate: num("decay_rate", d.decay_rate)?,
                // `beta_1: null` is MLX's default: no first moment.
                beta_1: match own.get("beta_1") {
                    None | Some(Value::Null) => None,
                    Some(_) => Some(num("beta_1", 0.0)?),
                },
                weight_decay: num("weight_decay", d.weight_decay)?,
                scale_parameter: flag("scale_parameter", d.scale_parameter)?,
                relative_step: flag("relative_step", d.relative_step)?,
                warmup_init: flag("warmup_init", d.warmup_init)?,
            })
        }
    })
}

/// `lr_schedule`, when the config has one.
pub fn schedule(cfg: &Map<String, Value>, file: &Path) -> Result<Option<Schedule>> {
    let Some(s) = cfg.get("lr_schedule").filter(|v| !v.is_null()) else { return Ok(None) };
    let name = s
        .get("name")
        .and_then(Value::as_str)
        .with_context(|| format!("{}: lr_schedule needs a `name`", file.display()))?;
    let arguments: Vec<f64> = s
        .get("arguments")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .with_context(|| format!("{}: lr_schedule needs `arguments` (a list of numbers)", file.display()))?;
    let warmup = s.get("warmup").and_then(Value::as_u64).unwrap_or(0);
    let warmup_init = s.get("warmup_init").and_then(Value::as_f64).unwrap_or(0.0) as f32;
    Ok(Some(
        Schedule::from_config(name, &arguments, warmup, warmup_init)
            .with_context(|| format!("{}: lr_schedule", file.display()))?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The config file's text (YAML, as mlx-lm writes it) parsed as `optimizer(name, ...)` does.
    fn parse(name: &str, yaml: &str) -> Result<OptimizerKind> {
        let docs = YamlLoader::load_from_str(yaml).unwrap();
        let Value::Object(cfg) = to_json(&docs[0]) else { panic!("a mapping") };
        optimizer(name, &cfg, Path::new("lora.yaml"))
    }

    #[test]
    fn adafactor_settings_apply_to_mlx_defaults() {
        assert_eq!(parse("adafactor", "optimizer: adafactor\n").unwrap(), OptimizerKind::adafactor());
        assert_eq!(parse("adafactor", "optimizer_config:\n  adafactor: {}\n").unwrap(), OptimizerKind::adafactor());
        assert_eq!(
            parse("adafactor", "optimizer_config:\n  adafactor:\n    beta_1: null\n").unwrap(),
            OptimizerKind::adafactor()
        );
        let yaml = "optimizer_config:\n  adam:\n    eps: 1.0\n  adafactor:\n    eps: [1e-30, 2.0e-3]\n    clip_threshold: 2\n    \
                    decay_rate: -0.5\n    beta_1: 0.9\n    weight_decay: 0.01\n    scale_parameter: false\n    relative_step: false\n    \
                    warmup_init: true\n";
        let want = Adafactor {
            eps: (1e-30, 2e-3),
            clip_threshold: 2.0,
            decay_rate: -0.5,
            beta_1: Some(0.9),
            weight_decay: 0.01,
            scale_parameter: false,
            relative_step: false,
            warmup_init: true,
        };
        assert_eq!(parse("adafactor", yaml).unwrap(), OptimizerKind::Adafactor(want));
        // Only the chosen optimizer's settings apply.
        assert_eq!(parse("adamw", yaml).unwrap(), OptimizerKind::adamw());
    }

    #[test]
    fn unknown_keys_and_wrong_types_are_errors_naming_them() {
        let err = |name: &str, yaml: &str| format!("{:#}", parse(name, yaml).unwrap_err());
        let e = err("adafactor", "optimizer_config:\n  adafactor:\n    beta1: 0.9\n");
        assert!(
            e.contains("lora.yaml: optimizer_config.adafactor.beta1 is no setting of MLX's adafactor optimizer"),
            "{e}"
        );
        assert!(e.contains("beta_1"), "lists the settings: {e}");
        let e = err("adafactor", "optimizer_config:\n  adafactor:\n    relative_step: \"no\"\n");
        assert!(e.contains("optimizer_config.adafactor.relative_step must be true or false, got \"no\""), "{e}");
        let e = err("adafactor", "optimizer_config:\n  adafactor:\n    eps: 1e-30\n");
        assert!(e.contains("optimizer_config.adafactor.eps must be two numbers, got 1e-30"), "{e}");
        let e = err("adafactor", "optimizer_config:\n  adafactor:\n    beta_1: high\n");
        assert!(e.contains("optimizer_config.adafactor.beta_1 must be a number, got \"high\""), "{e}");
        let e = err("adafactor", "optimizer_config:\n  adafactor: 3\n");
        assert!(e.contains("optimizer_config.adafactor must be a mapping of settings"), "{e}");
        // The other optimizers take MLX's arguments only, too.
        let e = err("adam", "optimizer_config:\n  adam:\n    weight_decay: 0.1\n");
        assert!(e.contains("optimizer_config.adam.weight_decay is no setting of MLX's adam optimizer"), "{e}");
        let e = err("sgd", "optimizer_config:\n  sgd:\n    momentum: fast\n");
        assert!(e.contains("optimizer_config.sgd.momentum must be a number"), "{e}");
        assert!(err("muon", "{}\n").contains("unknown optimizer `muon`"));
    }
}
