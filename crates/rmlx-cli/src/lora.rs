//! `rmlx lora`: LoRA fine-tuning and testing with mlx-lm's `mlx_lm.lora` flags and defaults.
//!
//! `--train` attaches fresh adapters (rank 8, scale 20 unless given) to the last `--num-layers`
//! blocks, trains them on `--data`/train.jsonl (validating on valid.jsonl), and writes
//! `adapter_config.json` and `adapters.safetensors` to `--adapter-path`. `--test` reports the loss
//! and perplexity on test.jsonl, with the adapters just trained or read from `--adapter-path`.
//! Ctrl-C during training saves the adapters and stops; a second Ctrl-C ends the process.

use crate::common::{count, positive, ModelArgs};
use crate::lora_config;
use anyhow::{bail, ensure, Context, Result};
use clap::{ArgMatches, Args as ClapArgs};
use rmlx_lm::tuner::adapters::{self, AdapterConfig, FineTuneType};
use rmlx_lm::tuner::optim::{Optimizer, OptimizerKind, Schedule};
use rmlx_lm::tuner::{self, DataOptions, LoraConfig, Report, Sequence, TrainConfig};
use serde_json::json;
use serde_json::Value;
use std::path::PathBuf;

#[derive(ClapArgs, Debug)]
#[command(allow_negative_numbers = true)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Train adapters.
    #[arg(long)]
    train: bool,
    /// Report the loss on test.jsonl.
    #[arg(long)]
    test: bool,
    /// A folder with train.jsonl, valid.jsonl and test.jsonl.
    #[arg(long, default_value = "data")]
    data: PathBuf,
    /// lora, dora (LoRA with a learned magnitude per output row), or full (the weights of the
    /// last --num-layers blocks themselves).
    #[arg(long, default_value = "lora")]
    fine_tune_type: String,
    /// Blocks, from the last, that get adapters (-1: all).
    #[arg(long, default_value_t = DEFAULT_NUM_LAYERS)]
    num_layers: i64,
    #[arg(long, default_value_t = 4, value_parser = positive)]
    batch_size: usize,
    #[arg(long, default_value_t = 1000, value_parser = positive)]
    iters: usize,
    /// Train for this many passes over the training set instead of --iters (each pass is every
    /// full batch once).
    #[arg(long, value_parser = positive)]
    epochs: Option<usize>,
    /// Batches whose gradients are averaged into one optimizer update.
    #[arg(long, default_value_t = 1, value_parser = positive)]
    grad_accumulation_steps: usize,
    /// Recompute each block's activations during the backward pass instead of keeping them: less
    /// memory, for one more forward pass per step.
    #[arg(long)]
    grad_checkpoint: bool,
    /// Run the training step op by op instead of compiled (on a GPU it is compiled, as mlx-lm's;
    /// on the CPU never).
    #[arg(long)]
    no_compile: bool,
    /// On a CUDA GPU, run each LoRA branch and its gradient as rmlx's own kernels (one operation
    /// forward and one backward instead of six cuBLAS products and their element-wise work).
    /// Off by default until measured faster in normal runs (BENCHMARKS.md).
    #[arg(long)]
    lora_kernels: bool,
    /// Validation batches per evaluation (-1: the whole set).
    #[arg(long, default_value_t = 25)]
    val_batches: i64,
    #[arg(long, default_value_t = 1e-5)]
    learning_rate: f32,
    #[arg(long, default_value_t = 10, value_parser = positive)]
    steps_per_report: usize,
    #[arg(long, default_value_t = 200, value_parser = positive)]
    steps_per_eval: usize,
    #[arg(long, default_value_t = 100, value_parser = positive)]
    save_every: usize,
    #[arg(long, default_value_t = 2048, value_parser = positive)]
    max_seq_length: usize,
    /// Compute the loss on the completion (last message) only.
    #[arg(long)]
    mask_prompt: bool,
    #[arg(long, default_value_t = 0, value_parser = count)]
    seed: usize,
    /// Test batches (-1: the whole set).
    #[arg(long, default_value_t = 500)]
    test_batches: i64,
    /// adam, adamw, sgd or adafactor (MLX's defaults for each).
    #[arg(long, default_value = "adam")]
    optimizer: String,
    /// Start from the adapter weights of this .safetensors file; a checkpoint's
    /// NNNNNNN_state.safetensors beside it also restores the optimizer, the batch order and the
    /// iteration, so the run continues exactly.
    #[arg(long)]
    resume_adapter_file: Option<PathBuf>,
    /// Adapter rank (mlx-lm's lora_parameters.rank).
    #[arg(long, default_value_t = 8, value_parser = positive)]
    lora_rank: usize,
    /// Adapter scale (mlx-lm's lora_parameters.scale; PEFT's lora_alpha / r).
    #[arg(long, default_value_t = 20.0)]
    lora_scale: f32,
    /// Also write the trained adapters in this layout: `peft` (Hugging Face PEFT, for transformers)
    /// into `<adapter-path>/peft`. mlx-lm's layout is always written.
    #[arg(long, default_value = "mlx")]
    adapter_format: String,
    /// One JSON object per report on stdout.
    #[arg(long)]
    json: bool,
    /// mlx-lm's YAML config (the flags' names as keys, plus lora_parameters, optimizer_config and
    /// lr_schedule); flags given on the command line beat it.
    #[arg(short = 'c', long = "config")]
    config: Option<PathBuf>,
}

/// What the YAML config sets beyond the flags.
#[derive(Default)]
struct Extra {
    schedule: Option<Schedule>,
    keys: Option<Vec<String>>,
    dropout: f32,
    optimizer: Option<OptimizerKind>,
}

/// Applies `-c config.yaml` to the flags that were not given on the command line.
fn apply_config(a: &mut Args, matches: Option<&ArgMatches>) -> Result<Extra> {
    let Some(file) = a.config.clone() else { return Ok(Extra::default()) };
    let cfg = lora_config::read(&file)?;
    macro_rules! set {
        ($($key:literal => $field:expr),* $(,)?) => {$(
            if !lora_config::given(matches, $key) {
                if let Some(v) = lora_config::get(&cfg, $key, &file)? {
                    $field = v;
                }
            }
        )*};
    }
    set!(
        "train" => a.train, "test" => a.test, "data" => a.data, "fine_tune_type" => a.fine_tune_type,
        "num_layers" => a.num_layers, "batch_size" => a.batch_size, "iters" => a.iters,
        "val_batches" => a.val_batches, "learning_rate" => a.learning_rate,
        "steps_per_report" => a.steps_per_report, "steps_per_eval" => a.steps_per_eval,
        "save_every" => a.save_every, "max_seq_length" => a.max_seq_length, "mask_prompt" => a.mask_prompt,
        "seed" => a.seed, "test_batches" => a.test_batches, "optimizer" => a.optimizer,
        "grad_accumulation_steps" => a.grad_accumulation_steps, "grad_checkpoint" => a.grad_checkpoint,
    );
    for (key, field) in [
        ("model", &mut a.model.model),
        ("adapter_path", &mut a.model.adapter_path),
        ("resume_adapter_file", &mut a.resume_adapter_file),
    ] {
        if !lora_config::given(matches, key) {
            if let Some(v) = lora_config::get::<PathBuf>(&cfg, key, &file)? {
                *field = Some(v);
            }
        }
    }
    if !lora_config::given(matches, "epochs") {
        if let Some(v) = lora_config::get::<usize>(&cfg, "epochs", &file)? {
            a.epochs = Some(v);
        }
    }
    let mut extra = Extra::default();
    if let Some(p) = cfg.get("lora_parameters").and_then(Value::as_object) {
        if !lora_config::given(matches, "lora_rank") {
            a.lora_rank = lora_config::get(p, "rank", &file)?.unwrap_or(a.lora_rank);
        }
        if !lora_config::given(matches, "lora_scale") {
            a.lora_scale = lora_config::get(p, "scale", &file)?.unwrap_or(a.lora_scale);
        }
        extra.dropout = lora_config::get(p, "dropout", &file)?.unwrap_or(0.0);
        extra.keys = lora_config::get(p, "keys", &file)?;
    }
    extra.schedule = lora_config::schedule(&cfg, &file)?;
    extra.optimizer = Some(lora_config::optimizer(&a.optimizer, &cfg, &file)?);
    const KNOWN: &[&str] = &[
        "model",
        "train",
        "test",
        "data",
        "fine_tune_type",
        "num_layers",
        "batch_size",
        "iters",
        "epochs",
        "val_batches",
        "learning_rate",
        "steps_per_report",
        "steps_per_eval",
        "save_every",
        "max_seq_length",
        "mask_prompt",
        "seed",
        "test_batches",
        "optimizer",
        "grad_accumulation_steps",
        "grad_checkpoint",
        "adapter_path",
        "resume_adapter_file",
        "lora_parameters",
        "optimizer_config",
        "lr_schedule",
    ];
    for key in cfg.keys().filter(|k| !KNOWN.contains(&k.as_str())) {
        eprintln!("warning: {}: ignoring `{key}` (not supported by rmlx lora)", file.display());
    }
    Ok(extra)
}

/// `-1` → all, a positive count → itself.
fn all_or(v: i64, what: &str) -> Result<Option<usize>> {
    match v {
        -1 => Ok(None),
        n if n > 0 => Ok(Some(n as usize)),
        n => bail!("--{what} must be positive or -1 (all), got {n}"),
    }
}

/// MLX's CUDA backend records up to 100 operations or 1,000 MB of their inputs into one CUDA graph
/// before it launches it, and every array that graph touches lives until it has run. With a
/// training step's activations that holds gigabytes: llama3.2-1b 4-bit LoRA peaked at 10.6 GB on
/// an H100 against 7.9 GB with graphs of at most 200 MB (BENCHMARKS.md). So `rmlx lora` sets
/// `MLX_MAX_MB_PER_BUFFER=200` unless it is set already (`=1000` restores MLX's default). MLX reads
/// it once, when it first uses the GPU: `main` calls this before anything runs. The number of
/// operations a graph holds stays MLX's (training was measured with it), where inference sets
/// [`rmlx::CUDA_GRAPH_OPS`] ([`rmlx::cuda_graph_ops`]).
pub fn limit_gpu_graphs() {
    const VAR: &str = "MLX_MAX_MB_PER_BUFFER";
    if std::env::var_os(VAR).is_none() {
        std::env::set_var(VAR, "200");
    }
    rmlx::keep_mlx_cuda_graph_ops();
}

/// `--num-layers` when not given (mlx-lm's).
const DEFAULT_NUM_LAYERS: i64 = 16;

pub fn run(mut a: Args, matches: Option<ArgMatches>) -> Result<()> {
    let yaml = apply_config(&mut a, matches.as_ref())?;
    ensure!(a.train || a.test, "nothing to do: pass --train, --test or both");
    ensure!(
        !a.model.pipeline,
        "--pipeline: the ranks of `rmlx lora` train data-parallel, each holding the whole model"
    );
    let fine_tune_type = match a.fine_tune_type.as_str() {
        "lora" => FineTuneType::Lora,
        "dora" => FineTuneType::Dora,
        "full" => FineTuneType::Full,
        other => bail!("--fine-tune-type {other} is unknown (lora, dora or full)"),
    };
    ensure!(
        matches!(a.adapter_format.as_str(), "mlx" | "peft"),
        "--adapter-format {} is unknown (mlx or peft)",
        a.adapter_format
    );
    ensure!(
        a.learning_rate.is_finite() && a.learning_rate >= 0.0,
        "--learning-rate must be a finite number, 0 or more, got {}",
        a.learning_rate
    );
    ensure!(a.lora_scale.is_finite(), "--lora-scale must be a finite number, got {}", a.lora_scale);
    let num_layers = all_or(a.num_layers, "num-layers")?;
    let (val_batches, test_batches) = (all_or(a.val_batches, "val-batches")?, all_or(a.test_batches, "test-batches")?);
    let kind = match (&yaml.optimizer, a.optimizer.as_str()) {
        (Some(kind), _) => kind.clone(),
        (None, "adam") => OptimizerKind::adam(),
        (None, "adamw") => OptimizerKind::adamw(),
        (None, "sgd") => OptimizerKind::sgd(),
        (None, "adafactor") => OptimizerKind::adafactor(),
        (None, other) => bail!("unknown --optimizer `{other}` (adam, adamw, sgd or adafactor)"),
    };
    let adapter_dir = a.model.adapter_path.clone().unwrap_or_else(|| PathBuf::from("adapters"));
    let splits = tuner::load_dir(&a.data, &DataOptions { mask_prompt: a.mask_prompt, ..DataOptions::default() })?;
    // Training on the CPU multiplies dense float32 weights (BLAS), forward and backward, faster
    // than dequantising quantised ones for every product: quantised weights are dequantised at
    // load there unless `--keep-quantized` asks for QLoRA.
    let on_cpu = rmlx::default_device().kind == rmlx::DeviceType::Cpu;
    let dequantize = a.model.dequantize || (on_cpu && !a.model.keep_quantized);
    // Under `rmlx launch`, every rank trains the whole model on its share of each batch.
    let base = ModelArgs { adapter_path: None, dequantize, data_parallel: true, ..a.model.clone() };
    let mut lm = base.load()?;
    let tokenize = |d: &Option<tuner::Dataset>| -> Result<Vec<Sequence>> {
        d.as_ref().map_or(Ok(Vec::new()), |d| Ok(d.tokenize(&lm.tokenizer, &lm.chat_template)?))
    };
    if a.train {
        let train = tokenize(&splits.train)?;
        ensure!(!train.is_empty(), "no training data: {} is missing or empty", a.data.join("train.jsonl").display());
        let valid = tokenize(&splits.valid)?;
        // As mlx-lm: training reports its validation loss, so the set must be there.
        ensure!(
            !valid.is_empty(),
            "no validation data: {} is missing or empty (training needs a validation set)",
            a.data.join("valid.jsonl").display()
        );
        // mlx-lm's default (16) adapts every block of a smaller model; a count asked for that the
        // model does not have is an error, not a number recorded in adapter_config.json.
        let blocks = lm.model.config().num_hidden_layers;
        let num_layers = match num_layers {
            Some(n) if n > blocks && a.num_layers == DEFAULT_NUM_LAYERS => Some(blocks),
            Some(n) if n > blocks => bail!("--num-layers {n}: the model has {blocks} blocks (-1 adapts them all)"),
            n => n,
        };
        let adapter = AdapterConfig {
            fine_tune_type,
            num_layers,
            lora: LoraConfig {
                rank: a.lora_rank as i32,
                scale: a.lora_scale,
                dropout: yaml.dropout,
                keys: yaml.keys.clone(),
            },
        };
        ensure!(
            a.adapter_format != "peft" || fine_tune_type != FineTuneType::Full,
            "--adapter-format peft needs --fine-tune-type lora or dora"
        );
        let extra = json!({"model": lm.source.display().to_string(), "data": a.data.display().to_string(),
            "batch_size": a.batch_size, "iters": a.iters, "learning_rate": a.learning_rate, "optimizer": a.optimizer,
            "max_seq_length": a.max_seq_length, "mask_prompt": a.mask_prompt, "seed": a.seed,
            "grad_checkpoint": a.grad_checkpoint});
        let iters = match a.epochs {
            Some(e) => e * (train.len() / a.batch_size).max(1),
            None => a.iters,
        };
        let config = tuner::RunConfig {
            adapter,
            train: TrainConfig {
                iters,
                grad_accumulation_steps: a.grad_accumulation_steps,
                grad_checkpoint: a.grad_checkpoint,
                // mlx-lm compiles its step; compiling on the CPU needs a C++ compiler at run time.
                compile: !a.no_compile && rmlx::default_device().kind == rmlx::DeviceType::Gpu,
                compute_copies: true,
                lora_kernels: a.lora_kernels,
                batch_size: a.batch_size,
                val_batches,
                steps_per_report: a.steps_per_report,
                steps_per_eval: a.steps_per_eval,
                save_every: a.save_every,
                max_seq_length: a.max_seq_length,
                seed: a.seed as u64,
                adapter_dir: Some(adapter_dir.clone()),
                resume: None,
                data_parallel: crate::parallel::ranks()?,
            },
            resume_from: a.resume_adapter_file.clone(),
            peft_base_model: (a.adapter_format == "peft").then(|| lm.source.display().to_string()),
            extra: extra.as_object().expect("an object").clone(),
        };
        let schedule = yaml.schedule.clone().unwrap_or(Schedule::Constant(a.learning_rate));
        let mut opt = Optimizer::new(kind, schedule);
        crate::interrupt::install()?;
        let _training = crate::interrupt::Replying::start();
        let json_out = a.json;
        // A bar on a terminal (plain percentages otherwise), with the report lines above it.
        let bar = rmlx_lm::progress::Progress::new(!json_out, "training", iters as u64);
        let mut reporter = Reporter { json: json_out, ..Reporter::default() };
        eprintln!("training on {} examples ({} validation)", train.len(), valid.len());
        let mut header = !json_out;
        let mut print = |r: &Report| {
            // The table's header comes after what resuming says.
            if header && !matches!(r, Report::Resumed { .. }) {
                bar.println(Reporter::HEADER);
                header = false;
            }
            match r {
                Report::Step { iter, .. } => bar.set(*iter as u64),
                r => reporter.print(r, &|line: &str| bar.println(line)),
            }
        };
        let result =
            tuner::run(lm.model.as_mut(), config, &mut opt, &train, &valid, &mut print, &crate::interrupt::requested);
        bar.finish();
        let done = result?;
        eprintln!("trained {} arrays", done.trainable);
        if done.training.interrupted {
            let state = tuner::TrainState::path_for(&done.adapters);
            if state.exists() {
                eprintln!(
                    "interrupted at iteration {}: adapters and training state saved ({}, {}); \
                     --resume-adapter-file {} continues the run exactly",
                    done.training.iterations,
                    done.adapters.display(),
                    state.display(),
                    done.adapters.display()
                );
            } else {
                eprintln!(
                    "interrupted at iteration {} with gradients still accumulating: adapters saved to {} \
                     (no training state: a resumed run starts its optimizer afresh)",
                    done.training.iterations,
                    done.adapters.display()
                );
            }
        }
        if let Some((dir, n)) = &done.peft {
            eprintln!("wrote {n} adapters in PEFT's layout to {}", dir.display());
        }
    } else {
        adapters::load(lm.model.as_mut(), &adapter_dir, lm.dtype)
            .with_context(|| format!("loading the adapters of {}", adapter_dir.display()))?;
    }
    if a.test {
        let test = tokenize(&splits.test)?;
        ensure!(!test.is_empty(), "no test data: {} is missing or empty", a.data.join("test.jsonl").display());
        let (loss, tokens) = tuner::evaluate(lm.model.as_ref(), &test, a.batch_size, test_batches, a.max_seq_length)?;
        if a.json {
            println!("{}", json!({"test_loss": loss, "test_ppl": loss.exp(), "tokens": tokens}));
        } else {
            println!("Test loss {loss:.3}, Test ppl {:.3}.", loss.exp());
        }
    }
    Ok(())
}

/// The report lines: mlx-lm 0.32's table (iteration, train loss with ▼/▲ against the last one,
/// tokens/s, trained tokens) plus peak memory, with `val` and `save` rows; or one JSON object per
/// report with `--json`.
#[derive(Default)]
struct Reporter {
    json: bool,
    last_loss: Option<f32>,
}

impl Reporter {
    const HEADER: &'static str = "  iter   train_loss     tok/s     tokens   peak mem";

    fn print(&mut self, r: &Report, line: &dyn Fn(&str)) {
        match r {
            &Report::Train { iter, loss, learning_rate, tokens_per_sec, all_tokens_per_sec, trained_tokens, peak_memory_gb } => {
                if self.json {
                    println!("{}", json!({"iter": iter, "train_loss": loss, "learning_rate": learning_rate,
                        "tokens_per_sec": tokens_per_sec, "all_tokens_per_sec": all_tokens_per_sec,
                        "trained_tokens": trained_tokens, "peak_memory_gb": peak_memory_gb}));
                    return;
                }
                let arrow = if self.last_loss.is_none_or(|last| loss <= last) { "▼" } else { "▲" };
                self.last_loss = Some(loss);
                line(&format!(
                    "  {iter:>4}    {loss:>5.3} {arrow}    {:>6}    {:>6.1}k   {peak_memory_gb:.2} GB",
                    thousands(tokens_per_sec),
                    trained_tokens as f64 / 1000.0
                ));
            }
            &Report::Val { iter, loss, seconds } => {
                if self.json {
                    let peak = rmlx::memory::peak_memory() as f64 / 1e9;
                    println!("{}", json!({"iter": iter, "val_loss": loss, "val_time": seconds, "peak_memory_gb": peak}));
                } else {
                    line(&format!("  {iter:>4}    val {loss:>5.3}    {seconds:.2}s"));
                }
            }
            Report::Saved { path, .. } => {
                line(&format!("  save  {}", path.display()));
            }
            &Report::Truncated { longest, max_seq_length, .. } => line(&format!(
                "warning: some sequences are longer than {max_seq_length} tokens; the longest ({longest}) is truncated. \
                 Consider pre-splitting your data to save memory."
            )),
            Report::Step { .. } => {}
            Report::Resumed { path, iteration: Some(i), .. } => {
                eprintln!("resuming at iteration {} from {} and its training state", i + 1, path.display())
            }
            Report::Resumed { path, iteration: None, arrays } => eprintln!(
                "resumed {arrays} arrays from {} (no training state beside it: the optimizer starts afresh)",
                path.display()
            ),
        }
    }
}

/// `12345.6` → `12,346`.
fn thousands(v: f64) -> String {
    let digits = format!("{:.0}", v.max(0.0));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn thousands_groups_digits() {
        assert_eq!(super::thousands(0.4), "0");
        assert_eq!(super::thousands(999.6), "1,000");
        assert_eq!(super::thousands(1234567.0), "1,234,567");
    }
}
