//! Which layers a conversion quantises and how, as mlx-lm's `quantize_model` decides: every
//! linear and embedding weight (2-D, or 3-D for stacked experts) whose input features the group
//! size divides, at the mode's defaults (affine 4 bits in groups of 64, `mxfp4` 4/32, `nvfp4`
//! 4/16, `mxfp8` 8/32) or the asked bits and group size; a mixed recipe or the architecture's own
//! choice (a router at 8 bits) overriding them per layer, each such layer with its config entry.

use super::source::Source;
use crate::{Error, Result};
use rmlx::quantization::{quantize, QuantMode};
use serde_json::{json, Value};

/// `-q` and its flags.
#[derive(Clone, Debug, Default)]
pub struct QuantizeOptions {
    /// `--q-bits` (`None`: the mode's default).
    pub bits: Option<i32>,
    /// `--q-group-size` (`None`: the mode's default).
    pub group_size: Option<i32>,
    /// `--q-mode`.
    pub mode: QuantMode,
    /// `--quant-predicate`: one of mlx-lm's mixed-precision recipes (affine only).
    pub recipe: Option<MixedRecipe>,
}

/// mlx-lm's mixed recipes (`mixed_2_6` …): most layers at the low bits; the value projections and
/// feed-forward down projections of the first and last eighth of the blocks and of every third
/// block between, and the output head, at the high bits (as llama.cpp's `Q4_K_M` chooses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixedRecipe {
    Mixed2_6,
    Mixed3_4,
    Mixed3_6,
    Mixed4_6,
}

impl MixedRecipe {
    /// `(low, high)` bits.
    pub fn bits(self) -> (i32, i32) {
        match self {
            MixedRecipe::Mixed2_6 => (2, 6),
            MixedRecipe::Mixed3_4 => (3, 4),
            MixedRecipe::Mixed3_6 => (3, 6),
            MixedRecipe::Mixed4_6 => (4, 6),
        }
    }
}

impl std::str::FromStr for MixedRecipe {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "mixed_2_6" => MixedRecipe::Mixed2_6,
            "mixed_3_4" => MixedRecipe::Mixed3_4,
            "mixed_3_6" => MixedRecipe::Mixed3_6,
            "mixed_4_6" => MixedRecipe::Mixed4_6,
            other => {
                return Err(Error::InvalidParameter(format!(
                    "unknown quantisation recipe `{other}` (mixed_2_6, mixed_3_4, mixed_3_6, mixed_4_6)"
                )))
            }
        })
    }
}

/// The checked settings of a quantising conversion.
pub(super) struct Plan {
    group_size: i32,
    bits: i32,
    mode: QuantMode,
    recipe: Option<MixedRecipe>,
    /// The group size the recipe's entries name (`None` where none was asked: mlx-lm writes null).
    recipe_group_size: Option<i32>,
}

impl QuantizeOptions {
    /// The mode's defaults filled in and the combination checked.
    pub(super) fn plan(&self) -> Result<Plan> {
        let (group_size, bits) = match self.mode {
            QuantMode::Affine => (64, 4),
            QuantMode::Mxfp4 => (32, 4),
            QuantMode::Nvfp4 => (16, 4),
            QuantMode::Mxfp8 => (32, 8),
        };
        let (group_size, bits) = (self.group_size.unwrap_or(group_size), self.bits.unwrap_or(bits));
        let what = "the quantisation";
        let checked = crate::checkpoint::quantization_mode(what, self.mode.name(), bits, group_size)
            .map_err(|e| Error::InvalidParameter(e.to_string()))?;
        if checked == QuantMode::Affine {
            crate::checkpoint::check_quantization(what, bits, group_size)
                .map_err(|e| Error::InvalidParameter(e.to_string()))?;
        }
        if self.recipe.is_some() && self.mode != QuantMode::Affine {
            return Err(Error::InvalidParameter("mixed quantisation recipes are affine only (--q-mode affine)".into()));
        }
        Ok(Plan { group_size, bits, mode: self.mode, recipe: self.recipe, recipe_group_size: self.group_size })
    }
}

impl Plan {
    /// Quantises the source's layers and writes the config's `quantization` block (and its copy
    /// `quantization_config`); `fixed` is the architecture's own choice per layer.
    pub(super) fn apply(
        &self,
        src: &mut Source,
        fixed: fn(&str) -> Option<Value>,
        blocks: i32,
        progress: bool,
    ) -> Result<()> {
        let mut block = json!({"group_size": self.group_size, "bits": self.bits, "mode": self.mode.name()});
        let layers: Vec<String> = src
            .tensors
            .iter()
            .filter(|(name, a)| {
                name.ends_with(".weight")
                    && a.dtype().is_floating()
                    && matches!(a.ndim(), 2 | 3)
                    && a.shape().last().is_some_and(|&f| f % self.group_size == 0)
            })
            .map(|(name, _)| name.trim_end_matches(".weight").to_string())
            .collect();
        let location = match self.recipe {
            Some(_) => Some(layer_index_location(&src.tensors)?),
            None => None,
        };
        let bar = crate::progress::Progress::new(progress, "quantising", layers.len() as u64);
        for path in &layers {
            let entry = match (self.recipe, location) {
                (Some(recipe), Some(at)) => Some(self.recipe_entry(recipe, path, at, blocks)),
                _ => fixed(path),
            };
            // An entry is all its layer gets: what it leaves out takes MLX's defaults, as mlx-lm's
            // `to_quantized(**entry)` does.
            let (group_size, bits, mode) = match &entry {
                Some(e) => {
                    let mode = e.get("mode").and_then(Value::as_str).unwrap_or("affine");
                    let int = |k: &str, default: i32| e.get(k).and_then(Value::as_i64).map_or(default, |v| v as i32);
                    let mode = crate::checkpoint::quantization_mode(path, mode, int("bits", 4), int("group_size", 64))?;
                    let (gs, b) = if mode == QuantMode::Affine { (64, 4) } else { (self.group_size, self.bits) };
                    (int("group_size", gs), int("bits", b), mode)
                }
                None => (self.group_size, self.bits, self.mode),
            };
            let name = format!("{path}.weight");
            let w = src.tensors.remove(&name).expect("listed");
            let q = quantize(&w, group_size, bits, mode)?;
            src.tensors.insert(name, q.weight);
            src.tensors.insert(format!("{path}.scales"), q.scales);
            if let Some(b) = q.biases {
                src.tensors.insert(format!("{path}.biases"), b);
            }
            if let Some(e) = entry {
                block[path] = e;
            }
            bar.inc(1);
        }
        bar.finish();
        src.config.insert("quantization".into(), block.clone());
        src.config.insert("quantization_config".into(), block);
        Ok(())
    }

    /// The recipe's entry for layer `path`, whose block index is its name's part `at`.
    fn recipe_entry(&self, recipe: MixedRecipe, path: &str, at: usize, blocks: i32) -> Value {
        let (low, high) = recipe.bits();
        let index: i32 = path.split('.').nth(at).and_then(|i| i.parse().ok()).unwrap_or(0);
        let eighth = blocks / 8;
        let more = index < eighth || index >= 7 * blocks / 8 || (index - eighth).rem_euclid(3) == 2;
        let value = ["v_proj", "v_a_proj", "v_b_proj"].iter().any(|v| path.contains(v));
        let high_bits = (more && (value || path.contains("down_proj"))) || path.contains("lm_head");
        json!({"group_size": self.recipe_group_size, "bits": if high_bits { high } else { low }, "mode": "affine"})
    }
}

/// Where a layer's name holds its block index: the first all-digit part of the first
/// `down_proj` layer's name (`model.layers.0.mlp.down_proj`: 2).
fn layer_index_location(t: &crate::models::spec::Tensors) -> Result<usize> {
    let first = t.keys().find(|n| n.contains("down_proj")).ok_or_else(|| {
        Error::InvalidParameter("the model has no `down_proj` layers, which the mixed recipes need".into())
    })?;
    Ok(first.split('.').position(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())).unwrap_or(0))
}
