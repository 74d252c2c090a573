//! Consistency of a checkpoint with its configuration, checked where every loader meets: layers
//! the config does not declare are an error (not silently dropped), quantisation parameters must
//! be ones MLX implements, and tensors the model leaves unused are reported on stderr (benign
//! buffers such as RoPE's `inv_freq` excepted).

use crate::config::ModelConfig;
use crate::weights::Weights;
use crate::{Error, Result};
use rmlx::quantization::QuantMode;
use std::path::Path;

/// Bit widths of MLX's affine quantisation.
pub const QUANT_BITS: &[i32] = &[2, 3, 4, 5, 6, 8];
/// Group sizes of MLX's affine quantisation.
pub const QUANT_GROUP_SIZES: &[i32] = &[32, 64, 128];

/// Most unused tensor names listed in the warning.
const LISTED: usize = 8;

/// [`Error::Config`] when the checkpoint holds layers beyond the config's `num_hidden_layers`.
pub fn check_layers(cfg: &ModelConfig, w: &Weights, source: &Path) -> Result<()> {
    let Some(top) = w.names().filter_map(|n| crate::models::block_path(n).map(|(i, _)| i)).max() else {
        return Ok(());
    };
    if top >= cfg.num_hidden_layers {
        return Err(Error::Config(format!(
            "{}: config and checkpoint disagree: num_hidden_layers is {} but the checkpoint holds {} layers \
             (tensors `{}.{top}.*`)",
            source.display(),
            cfg.num_hidden_layers,
            top + 1,
            crate::models::BLOCKS
        )));
    }
    Ok(())
}

/// [`Error::Config`] unless `bits` and `group_size` are ones MLX's affine quantisation implements.
pub fn check_quantization(tensor: &str, bits: i32, group_size: i32) -> Result<()> {
    if !QUANT_BITS.contains(&bits) {
        return Err(Error::Config(format!(
            "`{tensor}`: quantization bits {bits} is not supported (MLX supports {QUANT_BITS:?})"
        )));
    }
    if !QUANT_GROUP_SIZES.contains(&group_size) {
        return Err(Error::Config(format!(
            "`{tensor}`: quantization group_size {group_size} is not supported (MLX supports {QUANT_GROUP_SIZES:?})"
        )));
    }
    Ok(())
}

/// The MLX quantisation mode `mode` of `tensor` with `bits` and `group_size`: `affine`, or one of
/// the microscaling formats with the bits and group size it implies (`mxfp4`: 4 bits in groups of
/// 32; `mxfp8`: 8 in 32; `nvfp4`: 4 in 16).
pub fn quantization_mode(tensor: &str, mode: &str, bits: i32, group_size: i32) -> Result<QuantMode> {
    let (m, implied) = match mode {
        "affine" => return Ok(QuantMode::Affine),
        "mxfp4" => (QuantMode::Mxfp4, (4, 32)),
        "mxfp8" => (QuantMode::Mxfp8, (8, 32)),
        "nvfp4" => (QuantMode::Nvfp4, (4, 16)),
        other => {
            return Err(Error::Config(format!(
                "`{tensor}`: quantization mode `{other}` is not supported (affine, mxfp4, mxfp8, nvfp4)"
            )))
        }
    };
    if (bits, group_size) != implied {
        return Err(Error::Config(format!(
            "`{tensor}`: quantization mode `{mode}` takes {} bits in groups of {}, not {bits} in groups of {group_size}",
            implied.0, implied.1
        )));
    }
    Ok(m)
}

/// The names among `remaining` (tensors the model did not take) worth a warning: all but known
/// benign buffers.
pub fn unused_tensors(remaining: &[String]) -> Vec<String> {
    let benign =
        |n: &str| n.ends_with(".inv_freq") || n.ends_with("num_batches_tracked") || n.ends_with(".masked_bias");
    remaining.iter().filter(|n| !benign(n)).cloned().collect()
}

/// Prints a warning naming the unused tensors, if any.
pub fn warn_unused(unused: &[String], source: &Path) {
    if unused.is_empty() {
        return;
    }
    let mut names = unused.iter().take(LISTED).map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ");
    if unused.len() > LISTED {
        names.push_str(&format!(" and {} more", unused.len() - LISTED));
    }
    tracing::warn!(
        "warning: {}: {} tensor{} of the checkpoint not used by the model: {names}",
        source.display(),
        unused.len(),
        if unused.len() == 1 { " is" } else { "s are" }
    );
}
