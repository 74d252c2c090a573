//! Attaching LoRA adapters to a model as mlx-lm's `linear_to_lora_layers` does: to the linear
//! layers of the last `num_layers` blocks (all of them, or those whose path inside the block is
//! one of `keys`, such as `self_attn.q_proj`), and to a mixture of experts' stacked expert layers
//! (`mlp.switch_mlp.gate_proj`: one adapter per expert, mlx-lm's `LoRASwitchLinear`), each
//! initialised fresh.

use crate::models::{block_path, Model};
use crate::nn::{Lora, Role, SwitchLora};
use crate::{Error, Result};
use rmlx::Dtype;

/// mlx-lm's `lora_parameters`.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    pub rank: i32,
    /// Multiplies the adapter's output directly (mlx-lm's `scale`; PEFT's `lora_alpha / r`).
    pub scale: f32,
    pub dropout: f32,
    /// Paths inside a block (`self_attn.q_proj`, `mlp.down_proj`); `None`: every linear layer.
    pub keys: Option<Vec<String>>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig { rank: 8, scale: 20.0, dropout: 0.0, keys: None }
    }
}

/// Attaches fresh adapters to the linears of the last `num_layers` blocks (`None`: all blocks)
/// that `config.keys` selects, with weights in `dtype` drawn from `seed`. Returns the adapted
/// paths; an error when nothing matched or a key names no linear layer.
pub fn apply_lora(
    model: &mut dyn Model,
    num_layers: Option<usize>,
    config: &LoraConfig,
    dtype: Dtype,
    seed: u64,
) -> Result<Vec<String>> {
    attach(model, num_layers, config, dtype, seed, false)
}

/// [`apply_lora`] with DoRA adapters: each also learns a magnitude per output row (`<linear>.m`),
/// initialised to the row norms of the base weight, as mlx-lm's `DoRALinear` does.
pub fn apply_dora(
    model: &mut dyn Model,
    num_layers: Option<usize>,
    config: &LoraConfig,
    dtype: Dtype,
    seed: u64,
) -> Result<Vec<String>> {
    attach(model, num_layers, config, dtype, seed, true)
}

fn attach(
    model: &mut dyn Model,
    num_layers: Option<usize>,
    config: &LoraConfig,
    dtype: Dtype,
    seed: u64,
    dora: bool,
) -> Result<Vec<String>> {
    if !(0.0..1.0).contains(&config.dropout) {
        return Err(Error::InvalidParameter(format!("LoRA dropout must be in [0, 1), got {}", config.dropout)));
    }
    if config.rank <= 0 {
        return Err(Error::InvalidParameter(format!("the LoRA rank must be positive, got {}", config.rank)));
    }
    let blocks = model.config().num_hidden_layers;
    let first = blocks - num_layers.unwrap_or(blocks).min(blocks);
    let mut adapted = Vec::new();
    let mut seen_keys = std::collections::BTreeSet::new();
    let mut failure = None;
    model.visit_linears("", &mut |path, linear| {
        let Some((block, inner)) = block_path(path) else { return };
        seen_keys.insert(inner.to_string());
        let wanted = config.keys.as_ref().is_none_or(|keys| keys.iter().any(|k| k == inner));
        if block < first || !wanted || failure.is_some() {
            return;
        }
        let (input, output) = linear.dims();
        // One key per adapter, in visiting order: the same seed gives the same adapters.
        let made = rmlx::random::key(seed.wrapping_add(adapted.len() as u64))
            .map_err(Error::from)
            .and_then(|key| Lora::init(input, output, config.rank, config.scale, dtype, Some(&key)))
            .and_then(|lora| {
                let magnitude = if dora { Some(linear.weight_norms()?) } else { None };
                Ok(Lora { dropout: config.dropout, magnitude, ..lora })
            })
            .and_then(|lora| linear.set_lora(Some(lora)));
        match made {
            Ok(_) => adapted.push(path.to_string()),
            Err(e) => failure = Some(e),
        }
    });
    if let Some(e) = failure {
        return Err(e);
    }
    model.visit_switches("", &mut |path, switch| {
        let Some((block, inner)) = block_path(path) else { return };
        seen_keys.insert(inner.to_string());
        let wanted = config.keys.as_ref().is_none_or(|keys| keys.iter().any(|k| k == inner));
        if block < first || !wanted || failure.is_some() {
            return;
        }
        if dora {
            failure = Some(Error::InvalidParameter(format!(
                "DoRA has no form for a mixture of experts' stacked layers (`{path}`), as in mlx-lm: \
                 choose LoRA, or `keys` without them"
            )));
            return;
        }
        let (experts, input, output) = switch.dims();
        let made = rmlx::random::key(seed.wrapping_add(adapted.len() as u64))
            .map_err(Error::from)
            .and_then(|key| SwitchLora::init(experts, input, output, config.rank, config.scale, dtype, Some(&key)))
            .and_then(|lora| switch.set_lora(Some(SwitchLora { dropout: config.dropout, ..lora })));
        match made {
            Ok(_) => adapted.push(path.to_string()),
            Err(e) => failure = Some(e),
        }
    });
    if let Some(e) = failure {
        return Err(e);
    }
    if let Some(keys) = &config.keys {
        if let Some(k) = keys.iter().find(|k| !seen_keys.contains(*k)) {
            let known: Vec<&str> = seen_keys.iter().map(String::as_str).collect();
            return Err(Error::InvalidParameter(format!(
                "LoRA key `{k}` names no linear or expert layer of a block (they are: {})",
                known.join(", ")
            )));
        }
    }
    // A pipeline stage may hold none of the blocks adapted: the others do.
    let stage = super::adapters::held_blocks(model).len() < blocks;
    if adapted.is_empty() && !stage {
        return Err(Error::InvalidParameter("no linear layer was selected for LoRA".into()));
    }
    Ok(adapted)
}

/// The names of the adapters' parameters (`<path>.lora_a`, `<path>.lora_b`, and DoRA's `<path>.m`:
/// every [`Role::is_adapter`]): what training updates.
pub fn lora_parameter_names(model: &dyn Model) -> Vec<String> {
    use crate::nn::ModuleExt;
    model.roles("").into_iter().filter(|(_, role)| role.is_adapter()).map(|(n, _)| n).collect()
}

/// The parameters full fine-tuning trains: every floating-point array of the last `num_layers`
/// blocks (`None`: all blocks, plus the embedding, final norm and output head, as mlx-lm unfreezes
/// the whole model for `-1`). Quantised weights cannot be trained and are an error.
pub fn full_parameter_names(model: &dyn Model, num_layers: Option<usize>) -> Result<Vec<String>> {
    let blocks = model.config().num_hidden_layers;
    let first = blocks - num_layers.unwrap_or(blocks).min(blocks);
    let mut names = Vec::new();
    let mut params = Vec::new();
    model.visit("", &mut |name, role, a| params.push((name.to_string(), role, a.dtype())));
    for (name, role, dtype) in params {
        let selected = match block_path(&name) {
            Some((block, _)) => block >= first,
            None => num_layers.is_none(),
        };
        if !selected {
            continue;
        }
        if !dtype.is_floating() || role == Role::Quantization {
            return Err(Error::InvalidParameter(format!(
                "`{name}` is quantised: full fine-tuning needs a dense model (load it without --keep-quantized, or dequantise it)"
            )));
        }
        names.push(name);
    }
    Ok(names)
}
