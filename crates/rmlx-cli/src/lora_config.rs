//! `rmlx lora -c config.yaml`: mlx-lm's YAML training config. Its top-level keys are the flags'
//! names (`batch_size`, `iters`, `learning_rate`, ...), plus `lora_parameters {rank, scale,
//! dropout, keys}`, `optimizer_config.<name>` and `lr_schedule {name, arguments, warmup,
//! warmup_init}`. A flag given on the command line beats the YAML, which beats the defaults.

use anyhow::{bail, Context, Result};
use clap::parser::ValueSource;
use clap::ArgMatches;
use rmlx_lm::tuner::optim::{OptimizerKind, Schedule};
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
            h.iter()
                .map(|(k, v)| (k.as_str().map_or_else(|| format!("{k:?}"), str::to_string), to_json(v)))
                .collect(),
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

/// `optimizer_config.<name>` applied to MLX's defaults for `name`.
pub fn optimizer(name: &str, cfg: &Map<String, Value>, file: &Path) -> Result<OptimizerKind> {
    let own = cfg.get("optimizer_config").and_then(|o| o.get(name)).cloned().unwrap_or(Value::Null);
    let num = |k: &str| own.get(k).and_then(Value::as_f64);
    let betas = |d: (f32, f32)| -> Result<(f32, f32)> {
        match own.get("betas") {
            None => Ok(d),
            Some(Value::Array(b)) if b.len() == 2 && b.iter().all(Value::is_number) => {
                Ok((b[0].as_f64().unwrap_or(0.0) as f32, b[1].as_f64().unwrap_or(0.0) as f32))
            }
            Some(v) => bail!("{}: optimizer_config.{name}.betas must be two numbers, got {v}", file.display()),
        }
    };
    let bias_correction = own.get("bias_correction").and_then(Value::as_bool).unwrap_or(false);
    Ok(match name {
        "adam" => OptimizerKind::Adam { betas: betas((0.9, 0.999))?, eps: num("eps").unwrap_or(1e-8) as f32, bias_correction },
        "adamw" => OptimizerKind::AdamW {
            betas: betas((0.9, 0.999))?,
            eps: num("eps").unwrap_or(1e-8) as f32,
            weight_decay: num("weight_decay").unwrap_or(0.01) as f32,
            bias_correction,
        },
        "sgd" => OptimizerKind::Sgd {
            momentum: num("momentum").unwrap_or(0.0) as f32,
            weight_decay: num("weight_decay").unwrap_or(0.0) as f32,
            dampening: num("dampening").unwrap_or(0.0) as f32,
            nesterov: own.get("nesterov").and_then(Value::as_bool).unwrap_or(false),
        },
        other => bail!("unknown optimizer `{other}` (adam, adamw or sgd; adafactor and muon are not implemented yet)"),
    })
}

/// `lr_schedule`, when the config has one.
pub fn schedule(cfg: &Map<String, Value>, file: &Path) -> Result<Option<Schedule>> {
    let Some(s) = cfg.get("lr_schedule").filter(|v| !v.is_null()) else { return Ok(None) };
    let name = s.get("name").and_then(Value::as_str).with_context(|| format!("{}: lr_schedule needs a `name`", file.display()))?;
    let arguments: Vec<f64> = s
        .get("arguments")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .with_context(|| format!("{}: lr_schedule needs `arguments` (a list of numbers)", file.display()))?;
    let warmup = s.get("warmup").and_then(Value::as_u64).unwrap_or(0);
    let warmup_init = s.get("warmup_init").and_then(Value::as_f64).unwrap_or(0.0) as f32;
    Ok(Some(Schedule::from_config(name, &arguments, warmup, warmup_init).with_context(|| format!("{}: lr_schedule", file.display()))?))
}
