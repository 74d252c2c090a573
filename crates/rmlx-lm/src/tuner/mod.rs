//! Fine-tuning, as mlx-lm's `tuner` does it: training data ([`load_dir`], [`Dataset`]) and its
//! batches ([`Batch`]), LoRA and DoRA adapters on a model ([`apply_lora`], [`apply_dora`]), the loss
//! with its gradient ([`loss_and_grad`]), the training loop ([`train`]) and a whole run from a data
//! folder to an adapter folder ([`run`]); adapter files ([`adapters`], PEFT's in [`peft`]), fusing
//! them into the base weights ([`fuse`]) and the optimisers ([`optim`]).
//!
//! The data side follows
//! mlx-lm 0.32 exactly where it is specified (formats, masking offsets, length-sorted batches padded
//! to a multiple of 32 plus one) and is stricter where mlx-lm fails late: every line of every file
//! is checked before training starts, and an error names the file, the line and the problem.

pub mod adapters;
mod batch;
mod data;
pub mod fuse;
mod lora;
mod loss;
pub mod optim;
pub mod peft;
mod run;
mod trainer;

/// The adapter folder's configuration file, in mlx-lm's layout and PEFT's alike.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";

pub use batch::{Batch, BatchOrder};
pub use data::{load_dir, DataOptions, Dataset, Format, Sequence, Splits};
pub use lora::{apply_dora, apply_lora, full_parameter_names, lora_parameter_names, LoraConfig};
pub use loss::{batch_loss, logits_loss, loss_and_grad, with_loss_chunk_rows, CompiledLossAndGrad, LossAndGrad};
pub use run::{run, RunConfig, RunSummary};
pub use trainer::{evaluate, train, Report, TrainConfig, TrainState, TrainSummary};
