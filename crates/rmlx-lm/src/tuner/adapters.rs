//! Adapter files as mlx-lm writes and reads them: `adapters.safetensors` (the adapters' arrays
//! under the model's names, `…q_proj.lora_a: [in, r]`, `…lora_b: [r, out]`) and
//! `adapter_config.json` (`fine_tune_type`, `num_layers`, `lora_parameters {rank, scale, dropout,
//! keys}`). With full fine-tuning the file holds the trained weights themselves. Files are written
//! to a temporary name and renamed, so a reader never sees half a file.

use super::lora::{apply_lora, lora_parameter_names, LoraConfig};
use crate::models::{block_path, Model};
use crate::nn::{ModuleExt, Role};
use crate::{Error, Result};
use rmlx::{Array, Dtype};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

/// The adapter weights file of a folder.
pub const WEIGHTS: &str = "adapters.safetensors";
/// The adapter config file of a folder.
pub const CONFIG: &str = super::ADAPTER_CONFIG;

/// mlx-lm's `fine_tune_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FineTuneType {
    /// Low-rank adapters; the file holds their `lora_a`/`lora_b` arrays.
    Lora,
    /// DoRA: low-rank adapters with a learned magnitude per output row (`m`).
    Dora,
    /// The weights themselves; the file holds every trained array of the model.
    Full,
}

/// What `adapter_config.json` says about the adapters.
#[derive(Clone, Debug, PartialEq)]
pub struct AdapterConfig {
    pub fine_tune_type: FineTuneType,
    /// Blocks from the end that carry adapters or are trained (`None`: all, mlx-lm's `-1`).
    pub num_layers: Option<usize>,
    pub lora: LoraConfig,
}

impl AdapterConfig {
    /// The JSON mlx-lm reads (extra keys, such as training settings, may be merged in).
    pub fn to_json(&self) -> Value {
        json!({
            "fine_tune_type": match self.fine_tune_type {
                FineTuneType::Lora => "lora",
                FineTuneType::Dora => "dora",
                FineTuneType::Full => "full",
            },
            "num_layers": self.num_layers.map_or(-1, |n| n as i64),
            "lora_parameters": {
                "rank": self.lora.rank,
                "scale": self.lora.scale,
                "dropout": self.lora.dropout,
                "keys": self.lora.keys,
            },
        })
    }

    /// Reads mlx-lm's `adapter_config.json`; `file` names it in errors.
    pub fn from_json(v: &Value, file: &str) -> Result<AdapterConfig> {
        let bad = |what: String| Error::Config(format!("{file}: {what}"));
        let fine_tune_type = match v.get("fine_tune_type").and_then(Value::as_str).unwrap_or("lora") {
            "lora" => FineTuneType::Lora,
            "dora" => FineTuneType::Dora,
            "full" => FineTuneType::Full,
            other => return Err(bad(format!("fine_tune_type `{other}` is not supported (lora, dora and full are)"))),
        };
        let num_layers = match v.get("num_layers").and_then(Value::as_i64) {
            None | Some(-1) => None,
            Some(n) if n > 0 => Some(n as usize),
            Some(n) => return Err(bad(format!("num_layers must be positive or -1, got {n}"))),
        };
        let none = json!({"rank": 8, "scale": 20.0});
        let p = match (v.get("lora_parameters"), fine_tune_type) {
            (Some(p), _) => p,
            (None, FineTuneType::Full) => &none,
            (None, _) => return Err(bad("no `lora_parameters`".into())),
        };
        let rank =
            p.get("rank").and_then(Value::as_i64).ok_or_else(|| bad("`lora_parameters.rank` is missing".into()))?;
        let scale =
            p.get("scale").and_then(Value::as_f64).ok_or_else(|| bad("`lora_parameters.scale` is missing".into()))?;
        let keys = match p.get("keys") {
            None | Some(Value::Null) => None,
            Some(Value::Array(a)) => Some(
                a.iter()
                    .map(|k| {
                        k.as_str()
                            .map(str::to_string)
                            .ok_or_else(|| bad("`lora_parameters.keys` must hold strings".into()))
                    })
                    .collect::<Result<_>>()?,
            ),
            Some(_) => return Err(bad("`lora_parameters.keys` must be a list".into())),
        };
        let rank = i32::try_from(rank).map_err(|_| bad(format!("rank {rank} is out of range")))?;
        Ok(AdapterConfig {
            fine_tune_type,
            num_layers,
            lora: LoraConfig {
                rank,
                scale: scale as f32,
                dropout: p.get("dropout").and_then(Value::as_f64).unwrap_or(0.0) as f32,
                keys,
            },
        })
    }
}

/// Writes `path` through a temporary file in the same folder, renamed into place. The temporary
/// name ends with the real one (MLX's writer appends `.safetensors` to names without it).
fn write_atomically(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".tmp{}-{name}", std::process::id()));
    let result = write(&tmp).and_then(|()| std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e)));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Writes `adapter_config.json` (with `extra` keys merged in) into `dir`.
pub fn save_config(dir: &Path, config: &AdapterConfig, extra: &serde_json::Map<String, Value>) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let mut v = config.to_json();
    if let Value::Object(o) = &mut v {
        for (k, x) in extra {
            o.entry(k.clone()).or_insert_with(|| x.clone());
        }
    }
    let text = serde_json::to_string_pretty(&v).expect("JSON values serialise");
    write_atomically(&dir.join(CONFIG), |tmp| std::fs::write(tmp, text).map_err(|e| Error::io(tmp, e)))
}

/// Writes the model's arrays named in `names` (the trained ones) to `path` (a `.safetensors` file).
pub fn save_weights(model: &dyn Model, names: &[String], path: &Path) -> Result<()> {
    let all: HashMap<String, Array> = model.parameters("").into_iter().collect();
    let arrays: BTreeMap<String, Array> = names
        .iter()
        .map(|n| {
            all.get(n)
                .map(|a| (n.clone(), a.clone()))
                .ok_or_else(|| Error::InvalidParameter(format!("no parameter named `{n}`")))
        })
        .collect::<Result<_>>()?;
    if arrays.is_empty() {
        return Err(Error::InvalidParameter("there is nothing to save: no trained array".into()));
    }
    write_atomically(path, |tmp| Ok(rmlx::io::save_safetensors(tmp, &arrays, &BTreeMap::new())?))
}

/// Attaches the adapters of an adapter folder to `model` (in `dtype`): mlx-lm's layout, or PEFT's
/// (`adapter_model.safetensors`, see [`super::peft`]). Returns the config.
pub fn load(model: &mut dyn Model, dir: &Path, dtype: Dtype) -> Result<AdapterConfig> {
    if super::peft::is_peft_dir(dir) && !dir.join(WEIGHTS).exists() {
        let lora = super::peft::load(model, dir, dtype)?;
        return Ok(AdapterConfig { fine_tune_type: FineTuneType::Lora, num_layers: None, lora });
    }
    let config_path = dir.join(CONFIG);
    let text = std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
    let file = config_path.display().to_string();
    let v: Value = serde_json::from_str(&text).map_err(|e| Error::Config(format!("{file}: {e}")))?;
    let mut config = AdapterConfig::from_json(&v, &file)?;
    // mlx-lm's Phi-3 adapters name the fused projections rmlx splits at load.
    let phi3 = crate::models::spec::of(model.config())?.architecture == crate::config::Architecture::Phi3;
    if let Some(keys) = config.lora.keys.as_mut().filter(|_| phi3) {
        *keys = crate::models::phi3::split_fused_keys(keys);
    }
    match config.fine_tune_type {
        FineTuneType::Lora => {
            apply_lora(model, config.num_layers, &config.lora, dtype, 0)?;
        }
        FineTuneType::Dora => {
            super::lora::apply_dora(model, config.num_layers, &config.lora, dtype, 0)?;
        }
        FineTuneType::Full => {}
    }
    let weights = dir.join(WEIGHTS);
    if !weights.exists() {
        return Err(Error::MissingFile(weights.display().to_string()));
    }
    let mut arrays = rmlx::io::load_safetensors(&weights)?.arrays;
    if phi3 {
        crate::models::phi3::split_fused_adapters(model.config(), &mut arrays)?;
    }
    let arrays = rank_part(model, arrays, config.fine_tune_type == FineTuneType::Full)?;
    if config.fine_tune_type != FineTuneType::Full {
        let expected = lora_parameter_names(model);
        if let Some(missing) = expected.iter().find(|n| !arrays.contains_key(*n)) {
            return Err(Error::MissingTensor(format!("{missing} (in {})", weights.display())));
        }
    }
    // DoRA's magnitudes stay float32, as the adapters keep them.
    let roles: HashMap<String, Role> = model.roles("").into_iter().collect();
    let new: HashMap<String, Array> = arrays
        .into_iter()
        .map(|(n, a)| Ok(if roles.get(&n) == Some(&Role::DoraMagnitude) { (n, a) } else { (n, a.astype(dtype)?) }))
        .collect::<Result<_>>()?;
    model.update("", new)?;
    Ok(config)
}

/// The blocks of the model `model` holds: all of them, or a pipeline stage's.
pub(crate) fn held_blocks(model: &dyn Model) -> BTreeSet<usize> {
    let mut held = BTreeSet::new();
    model.visit("", &mut |name, _, _| {
        if let Some((block, _)) = block_path(name) {
            held.insert(block);
        }
    });
    held
}

/// Whether the array or layer `name` belongs to a block of the model that another stage of a
/// pipeline holds (not to one this model holds, nor to none the model has).
pub(crate) fn held_elsewhere(model: &dyn Model, held: &BTreeSet<usize>, name: &str) -> bool {
    let blocks = model.config().num_hidden_layers;
    block_path(name).is_some_and(|(block, _)| block < blocks && !held.contains(&block))
}

/// The arrays of an adapter file trained on the whole model, as this rank of a split model
/// holds them: those of its pipeline stage's blocks, each cut to its layer's features under
/// tensor parallelism ([`crate::nn::Linear::adapter_part`]). `full`: the file holds fully
/// fine-tuned weights, which a tensor-parallel rank does not cut (fuse them into a model).
fn rank_part(
    model: &mut dyn Model,
    mut arrays: BTreeMap<String, Array>,
    full: bool,
) -> Result<BTreeMap<String, Array>> {
    let held = held_blocks(model);
    arrays.retain(|name, _| !held_elsewhere(model, &held, name));
    let mut split = false;
    let mut failure = Ok(());
    let mut cut = |path: &str, part: &mut dyn FnMut(&str, &Array) -> Result<Array>| {
        for what in ["lora_a", "lora_b", "m"] {
            if let Some(a) = arrays.get_mut(&format!("{path}.{what}")) {
                match part(what, a) {
                    Ok(p) => *a = p,
                    Err(e) => failure = Err(e),
                }
            }
        }
    };
    model.visit_linears("", &mut |path, linear| {
        split |= linear.share().is_some();
        cut(path, &mut |what, a| linear.adapter_part(what, a));
    });
    model.visit_switches("", &mut |path, switch| cut(path, &mut |what, a| switch.adapter_part(path, what, a)));
    failure?;
    if full && split {
        return Err(Error::TensorParallel(
            "fully fine-tuned weights are not split over the ranks of a tensor-parallel model: fuse them \
             into a model folder (`rmlx fuse`) and load that"
                .into(),
        ));
    }
    Ok(arrays)
}

/// The adapters of an adapter folder (mlx-lm's or PEFT's layout), layer name → factors, without
/// attaching them: what [`crate::nn::AdapterBank`] serves per request. Read through a copy of
/// `model` (which shares its arrays) stripped of any adapter it carries.
pub fn read(model: &dyn Model, dir: &Path, dtype: Dtype) -> Result<HashMap<String, crate::nn::Lora>> {
    let mut scratch = model.boxed_clone();
    let mut stripped = Ok(());
    scratch.visit_linears("", &mut |_, l| {
        if stripped.is_ok() {
            stripped = l.set_lora(None).map(drop);
        }
    });
    stripped?;
    let config = load(scratch.as_mut(), dir, dtype)?;
    if config.fine_tune_type == FineTuneType::Full {
        return Err(Error::InvalidParameter(format!(
            "{} holds fully fine-tuned weights, not adapters: serve it as a model of its own",
            dir.display()
        )));
    }
    let mut experts = None;
    scratch.visit_switches("", &mut |path, s| {
        if s.lora().is_some() {
            experts.get_or_insert(path.to_string());
        }
    });
    if let Some(path) = experts {
        return Err(Error::InvalidParameter(format!(
            "{} adapts a mixture of experts' stacked layers (`{path}`), which adapters chosen per request do not \
             take: fuse them into the model (`rmlx fuse`) or attach them at load",
            dir.display()
        )));
    }
    let mut layers = HashMap::new();
    scratch.visit_linears("", &mut |path, l| {
        if let Some(lora) = l.lora() {
            layers.insert(path.to_string(), lora.clone());
        }
    });
    Ok(layers)
}
