//! A whole fine-tuning run, as `mlx_lm.lora --train` does it: attach the adapters (LoRA, DoRA, or
//! unfreeze blocks for full fine-tuning), resume from an adapters file (exactly, when its training
//! state lies beside it), record `adapter_config.json`, train, and also write PEFT's layout when
//! asked. A library user calls [`run`]; the `rmlx lora` command parses flags and prints reports.

use super::adapters::{self, AdapterConfig, FineTuneType};
use super::data::Sequence;
use super::optim::Optimizer;
use super::trainer::{train, Report, TrainConfig, TrainState, TrainSummary};
use crate::models::Model;
use crate::nn::ModuleExt;
use crate::{Error, Result};
use rmlx::Dtype;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// What [`run`] does besides the training loop's own settings.
pub struct RunConfig {
    /// The adapters to train (their kind, blocks and LoRA parameters), as recorded in
    /// `adapter_config.json`.
    pub adapter: AdapterConfig,
    /// The training loop; its `adapter_dir` is where everything is written (required) and its
    /// `seed` also draws the adapters' initial weights. `resume` is set by [`run`].
    pub train: TrainConfig,
    /// Start from this adapters file: its weights, and with `NNNNNNN_state.safetensors` or
    /// `state.safetensors` beside it ([`TrainState::path_for`]) the optimizer, batch order and
    /// iteration, so that the run continues exactly.
    pub resume_from: Option<PathBuf>,
    /// Also write the adapters in PEFT's layout into `<adapter_dir>/peft`, naming this base model.
    pub peft_base_model: Option<String>,
    /// More fields for `adapter_config.json` (the run's settings, as mlx-lm records them).
    pub extra: Map<String, Value>,
}

/// What [`run`] did.
#[derive(Debug)]
pub struct RunSummary {
    pub training: TrainSummary,
    /// How many arrays were trained.
    pub trainable: usize,
    /// Where the adapters are.
    pub adapters: PathBuf,
    /// With [`RunConfig::peft_base_model`]: the PEFT folder and how many adapters it holds.
    pub peft: Option<(PathBuf, usize)>,
}

/// Runs a whole fine-tuning (see the module doc) of `model` on `train`, validating on `valid`, with
/// `optimizer`. Reports go to `report` ([`Report::Resumed`] first when resuming); `stop` ends the
/// run after the current step, with the adapters and (when exact) the state saved.
///
/// ```no_run
/// use rmlx_lm::tuner::adapters::{AdapterConfig, FineTuneType};
/// use rmlx_lm::tuner::optim::{Optimizer, OptimizerKind, Schedule};
/// use rmlx_lm::tuner::{self, DataOptions, LoraConfig, RunConfig, TrainConfig};
/// let mut lm = rmlx_lm::loader::load(rmlx_lm::registry::default_model()?, &Default::default())?;
/// let splits = tuner::load_dir("data".as_ref(), &DataOptions::default())?;
/// let tokenize = |d: &Option<tuner::Dataset>| d.as_ref().map(|d| d.tokenize(&lm.tokenizer, &lm.chat_template));
/// let (train, valid) = (tokenize(&splits.train).unwrap()?, tokenize(&splits.valid).unwrap()?);
/// let config = RunConfig {
///     adapter: AdapterConfig { fine_tune_type: FineTuneType::Lora, num_layers: None, lora: LoraConfig::default() },
///     train: TrainConfig { iters: 100, adapter_dir: Some("adapters".into()), ..TrainConfig::default() },
///     resume_from: None,
///     peft_base_model: None,
///     extra: Default::default(),
/// };
/// let mut optimizer = Optimizer::new(OptimizerKind::adam(), Schedule::Constant(1e-5));
/// let done = tuner::run(lm.model.as_mut(), config, &mut optimizer, &train, &valid, &mut |r| eprintln!("{r:?}"), &|| false)?;
/// println!("{} iterations, adapters in {}", done.training.iterations, done.adapters.display());
/// # Ok::<(), rmlx_lm::Error>(())
/// ```
pub fn run(
    model: &mut dyn Model,
    config: RunConfig,
    optimizer: &mut Optimizer,
    train_set: &[Sequence],
    valid: &[Sequence],
    report: &mut dyn FnMut(&Report),
    stop: &dyn Fn() -> bool,
) -> Result<RunSummary> {
    let dir = config
        .train
        .adapter_dir
        .clone()
        .ok_or_else(|| Error::InvalidParameter("a fine-tuning run needs an adapter folder".into()))?;
    if config.peft_base_model.is_some() && config.adapter.fine_tune_type == FineTuneType::Full {
        return Err(Error::InvalidParameter("PEFT's layout holds LoRA or DoRA adapters, not full fine-tuning".into()));
    }
    let (kind, num_layers, lora) = (config.adapter.fine_tune_type, config.adapter.num_layers, &config.adapter.lora);
    // Adapters in float32 whatever the model's dtype, as mlx-lm makes them: a bfloat16 weight
    // would lose every update below half its unit in the last place.
    let trainable = match kind {
        FineTuneType::Lora => {
            super::apply_lora(model, num_layers, lora, Dtype::Float32, config.train.seed)?;
            super::lora_parameter_names(model)
        }
        FineTuneType::Dora => {
            super::apply_dora(model, num_layers, lora, Dtype::Float32, config.train.seed)?;
            super::lora_parameter_names(model)
        }
        FineTuneType::Full => super::full_parameter_names(model, num_layers)?,
    };
    let mut train_config = config.train;
    if let Some(file) = &config.resume_from {
        let (iteration, arrays) = resume(model, file, &mut train_config)?;
        report(&Report::Resumed { path: file.clone(), iteration, arrays });
    }
    adapters::save_config(&dir, &config.adapter, &config.extra)?;
    let training = train(model, &trainable, optimizer, train_set, valid, &train_config, report, stop)?;
    let peft = match &config.peft_base_model {
        Some(base) => {
            let out = dir.join("peft");
            let n = super::peft::save(model, &out, base)?;
            Some((out, n))
        }
        None => None,
    };
    Ok(RunSummary { training, trainable: trainable.len(), adapters: dir.join(adapters::WEIGHTS), peft })
}

/// Loads an adapters file's weights into `model` and, when its state lies beside it, sets
/// `config.resume`: (the iteration it continues after, the arrays read).
fn resume(model: &mut dyn Model, file: &Path, config: &mut TrainConfig) -> Result<(Option<usize>, usize)> {
    let arrays = rmlx::io::load_safetensors(file)?.arrays;
    let n = model.update("", arrays.into_iter().collect())?;
    let state_path = TrainState::path_for(file);
    if !state_path.exists() {
        return Ok((None, n));
    }
    let state = TrainState::load(&state_path)?;
    let iteration = state.iteration;
    config.resume = Some(state);
    Ok((Some(iteration), n))
}
