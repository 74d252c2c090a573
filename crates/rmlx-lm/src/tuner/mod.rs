//! Fine-tuning, as mlx-lm's `tuner` does it: training data ([`data`]) and its batches ([`batch`]),
//! LoRA adapters on a model ([`lora`]), and the loss with its gradient ([`loss`]).
//!
//! The trainer itself (LoRA layers, the loss, optimisers) builds on these; the data side follows
//! mlx-lm 0.32 exactly where it is specified (formats, masking offsets, length-sorted batches padded
//! to a multiple of 32 plus one) and is stricter where mlx-lm fails late: every line of every file
//! is checked before training starts, and an error names the file, the line and the problem.

pub mod adapters;
pub mod batch;
pub mod data;
pub mod fuse;
pub mod lora;
pub mod loss;
pub mod optim;
pub mod peft;
mod run;
pub mod trainer;

/// The adapter folder's configuration file, in mlx-lm's layout and PEFT's alike.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";

pub use batch::{Batch, BatchOrder};
pub use data::{load_dir, DataOptions, Dataset, Format, Sequence, Splits};
pub use lora::{apply_dora, apply_lora, full_parameter_names, lora_parameter_names, LoraConfig};
pub use loss::{batch_loss, logits_loss, loss_and_grad, with_loss_chunk_rows, CompiledLossAndGrad, LossAndGrad};
pub use run::{run, RunConfig, RunSummary};
pub use trainer::{evaluate, train, Report, TrainConfig, TrainState, TrainSummary};
