//! The training loop of mlx-lm's `lora` command: a batch per iteration, a validation loss at the
//! first iteration, every `steps_per_eval` and at the end, a report every `steps_per_report`
//! (mean loss of the window, tokens per second, tokens trained so far), and the adapters saved
//! every `save_every` iterations (`adapters.safetensors` plus `NNNNNNN_adapters.safetensors`) and at
//! the end. A stop request (Ctrl-C) saves the adapters and ends the loop after the current step.
//! With `grad_accumulation_steps = n`, each iteration still takes one batch and the optimizer
//! updates every `n` iterations (and at the last) with the mean of their gradients.

use super::adapters;
use super::batch::{Batch, BatchOrder};
use super::data::Sequence;
use super::loss::{batch_loss, loss_and_grad, CompiledLossAndGrad};
use super::optim::Optimizer;
use crate::models::Model;
use crate::nn::{with_grad_checkpoint, ModuleExt, Role};
use crate::{Error, Result};
use rmlx::Array;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// mlx-lm's training settings (its defaults in [`Default`]).
#[derive(Clone, Debug)]
pub struct TrainConfig {
    pub iters: usize,
    pub batch_size: usize,
    /// Validation batches per evaluation (`None`: the whole set).
    pub val_batches: Option<usize>,
    pub steps_per_report: usize,
    pub steps_per_eval: usize,
    pub save_every: usize,
    pub max_seq_length: usize,
    /// Batches whose gradients are averaged into one optimizer update.
    pub grad_accumulation_steps: usize,
    /// Recompute each block's activations for the backward pass instead of keeping them
    /// (less memory, about one more forward pass per step): [`crate::nn::with_grad_checkpoint`].
    pub grad_checkpoint: bool,
    /// Compile the loss and its gradient ([`CompiledLossAndGrad`]).
    pub compile: bool,
    /// With `compile`: the step reads the LoRA factors from copies in the activations' dtype,
    /// written by the optimizer's update, instead of casting the float32 factors and their
    /// gradients inside the step. The same values, two fewer operations per factor.
    pub compute_copies: bool,
    /// Sets every adapter's [`Lora::kernels`](crate::nn::Lora::kernels) for the run: the LoRA
    /// branches as rmlx's own CUDA kernels where they serve.
    pub lora_kernels: bool,
    pub seed: u64,
    /// Where adapters are saved (`None`: not saved).
    pub adapter_dir: Option<PathBuf>,
    /// Where to continue from (a checkpoint's [`TrainState`]); the model must hold that
    /// checkpoint's weights already.
    pub resume: Option<TrainState>,
    /// Train data-parallel over these ranks (`rmlx launch`): each takes its stride of every batch
    /// (sequences `rank, rank + n, …`), the gradients are averaged over the ranks weighted by
    /// their loss targets (the whole batch's gradient), every rank applies the same update, and
    /// rank 0 alone writes adapters and checkpoints. `batch_size` must be a multiple of the ranks.
    pub data_parallel: Option<crate::Ranks>,
}

/// Where a run stands, written beside each checkpoint (`NNNNNNN_state.safetensors`) so that a
/// resumed run continues exactly as the uninterrupted one: the optimizer's state and step count,
/// the batch order's random state and the batches left in its epoch, the iteration and the tokens
/// trained. (Written only at checkpoints where no accumulated gradient is pending.)
#[derive(Clone, Debug)]
pub struct TrainState {
    pub iteration: usize,
    pub trained_tokens: usize,
    pub optimizer_step: u64,
    pub optimizer: BTreeMap<String, Array>,
    pub rng: u64,
    /// Batches of the current epoch still to visit, the next last.
    pub queue: Vec<usize>,
}

const STATE_KEY: &str = "rmlx_train_state";

impl TrainState {
    /// The state beside an adapters file: `NNNNNNN_state.safetensors` beside
    /// `NNNNNNN_adapters.safetensors`, `state.safetensors` beside `adapters.safetensors`, and
    /// `<name>.state.safetensors` beside any other `<name>.safetensors`.
    pub fn path_for(adapters: &Path) -> PathBuf {
        let name = adapters.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let state = match name.strip_suffix("adapters.safetensors") {
            Some(stem) if stem.is_empty() || stem.ends_with('_') => format!("{stem}state.safetensors"),
            _ => format!("{}.state.safetensors", name.strip_suffix(".safetensors").unwrap_or(&name)),
        };
        adapters.with_file_name(state)
    }

    /// Writes the state (the optimizer's arrays, the rest as JSON metadata).
    pub fn save(&self, path: &Path) -> Result<()> {
        let meta = json!({"iteration": self.iteration, "trained_tokens": self.trained_tokens,
            "optimizer_step": self.optimizer_step, "rng": self.rng.to_string(), "queue": self.queue});
        let meta = BTreeMap::from([(STATE_KEY.to_string(), meta.to_string())]);
        Ok(rmlx::io::save_safetensors(path, &self.optimizer, &meta)?)
    }

    /// Reads what [`TrainState::save`] wrote.
    pub fn load(path: &Path) -> Result<TrainState> {
        let file = rmlx::io::load_safetensors(path)?;
        let bad =
            |what: &str| Error::Corrupt { path: path.display().to_string(), reason: format!("training state: {what}") };
        let meta: Value = serde_json::from_str(file.metadata.get(STATE_KEY).ok_or_else(|| bad("no metadata"))?)
            .map_err(|_| bad("metadata is not JSON"))?;
        let num = |k: &str| meta.get(k).and_then(Value::as_u64).ok_or_else(|| bad(k));
        Ok(TrainState {
            iteration: num("iteration")? as usize,
            trained_tokens: num("trained_tokens")? as usize,
            optimizer_step: num("optimizer_step")?,
            optimizer: file.arrays,
            rng: meta.get("rng").and_then(Value::as_str).and_then(|s| s.parse().ok()).ok_or_else(|| bad("rng"))?,
            queue: meta
                .get("queue")
                .and_then(Value::as_array)
                .map(|q| q.iter().filter_map(|v| v.as_u64().map(|n| n as usize)).collect())
                .ok_or_else(|| bad("queue"))?,
        })
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            iters: 1000,
            batch_size: 4,
            val_batches: Some(25),
            steps_per_report: 10,
            steps_per_eval: 200,
            save_every: 100,
            max_seq_length: 2048,
            grad_accumulation_steps: 1,
            grad_checkpoint: false,
            compile: false,
            compute_copies: true,
            lora_kernels: false,
            seed: 0,
            adapter_dir: None,
            resume: None,
            data_parallel: None,
        }
    }
}

/// What the loop reports as it goes.
#[derive(Clone, Debug, PartialEq)]
pub enum Report {
    /// The mean training loss over the iterations since the last report. Throughput is per second
    /// of training (validation excluded): `tokens_per_sec` counts the targets in the loss (what
    /// mlx-lm reports), `all_tokens_per_sec` every real token processed (prompts included,
    /// padding not); `trained_tokens` is the loss targets so far.
    Train {
        iter: usize,
        loss: f32,
        learning_rate: f32,
        tokens_per_sec: f64,
        all_tokens_per_sec: f64,
        trained_tokens: usize,
        peak_memory_gb: f64,
    },
    /// The validation loss.
    Val { iter: usize, loss: f32, seconds: f64 },
    /// Adapters written.
    Saved { iter: usize, path: PathBuf },
    /// A truncated batch (some example longer than `max_seq_length`).
    Truncated { iter: usize, longest: usize, max_seq_length: usize },
    /// An iteration finished (for progress bars).
    Step { iter: usize, iters: usize },
    /// [`super::run`] read the adapters file `path` (`arrays` of it) and, with its training state,
    /// continues after `iteration` exactly (`None`: weights only, the optimizer starts afresh).
    Resumed { path: PathBuf, iteration: Option<usize>, arrays: usize },
}

/// Mean loss over the masked targets of up to `num_batches` batches of `data` (in a fixed,
/// seeded order), and the number of targets counted.
pub fn evaluate(
    model: &dyn Model,
    data: &[Sequence],
    batch_size: usize,
    num_batches: Option<usize>,
    max_seq_length: usize,
) -> Result<(f32, usize)> {
    let lengths: Vec<usize> = data.iter().map(|s| s.tokens.len()).collect();
    let mut order = BatchOrder::new(&lengths, batch_size, 0)?;
    let (mut total, mut count) = (0.0f64, 0usize);
    let batches = order.batches().to_vec();
    for b in order.epoch().into_iter().take(num_batches.unwrap_or(usize::MAX)) {
        let seqs: Vec<&Sequence> = batches[b].iter().map(|&i| &data[i]).collect();
        let batch = Batch::new(&seqs, max_seq_length);
        let (loss, ntoks) = batch_loss(model, &batch.to_array()?, &batch.mask_array()?)?;
        rmlx::eval([&loss, &ntoks])?;
        let n = ntoks.item::<f32>()? as usize;
        total += loss.item::<f32>()? as f64 * n as f64;
        count += n;
    }
    Ok(((total / count.max(1) as f64) as f32, count))
}

/// What a finished (or stopped) run did.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainSummary {
    pub iterations: usize,
    pub trained_tokens: usize,
    pub last_val_loss: Option<f32>,
    /// Whether a stop request ended the run before its last iteration (the adapters, and the
    /// training state when it resumes exactly, were saved at the iteration it reached).
    pub interrupted: bool,
}

/// Trains the parameters named in `trainable` of `model` on `train`, validating on `valid`.
#[allow(clippy::too_many_arguments)]
pub fn train(
    model: &mut dyn Model,
    trainable: &[String],
    optimizer: &mut Optimizer,
    train: &[Sequence],
    valid: &[Sequence],
    cfg: &TrainConfig,
    report: &mut dyn FnMut(&Report),
    stop: &dyn Fn() -> bool,
) -> Result<TrainSummary> {
    let lengths: Vec<usize> = train.iter().map(|s| s.tokens.len()).collect();
    let mut order = BatchOrder::new(&lengths, cfg.batch_size, cfg.seed)?;
    // Whatever else draws from MLX's global key (LoRA dropout does not: see the step) is seeded.
    rmlx::random::seed(cfg.seed);
    let batches = order.batches().to_vec();
    let mut queue = Vec::new();
    let (mut window_loss, mut window_steps, mut window_tokens, mut window_all) = (0.0f64, 0usize, 0usize, 0usize);
    let mut trained_tokens = 0usize;
    let mut window_start = Instant::now();
    let mut last_val = None;
    let mut it = 0;
    let (mut accumulated, mut pending): (Option<HashMap<String, Array>>, usize) = (None, 0);
    if cfg.grad_accumulation_steps == 0 {
        return Err(crate::Error::InvalidParameter("grad_accumulation_steps must be positive".into()));
    }
    let ranks = cfg.data_parallel.as_ref().filter(|r| r.size() > 1);
    if let Some(r) = ranks {
        if !cfg.batch_size.is_multiple_of(r.size()) {
            return Err(crate::Error::InvalidParameter(format!(
                "batch size {} does not split over {} data-parallel ranks: use a multiple of {}",
                cfg.batch_size,
                r.size(),
                r.size()
            )));
        }
    }
    // `adapters.safetensors` and, when the state resumes exactly (no gradient pending),
    // `state.safetensors` beside it; at a checkpoint also `NNNNNNN_adapters.safetensors` and
    // `NNNNNNN_state.safetensors`.
    let save = |model: &dyn Model,
                it: usize,
                state: &TrainState,
                checkpoint: bool,
                report: &mut dyn FnMut(&Report)|
     -> Result<()> {
        let Some(dir) = &cfg.adapter_dir else { return Ok(()) };
        if cfg.data_parallel.as_ref().is_some_and(|r| r.rank() != 0) {
            return Ok(());
        }
        let mut paths = vec![dir.join(adapters::WEIGHTS)];
        if checkpoint {
            paths.push(dir.join(format!("{it:07}_adapters.safetensors")));
        }
        for path in paths {
            adapters::save_weights(model, trainable, &path)?;
            let state_path = TrainState::path_for(&path);
            if state.iteration == it {
                state.save(&state_path)?;
            } else if state_path.exists() {
                // An older state beside these weights would resume from the wrong place.
                std::fs::remove_file(&state_path).map_err(|e| crate::Error::io(&state_path, e))?;
            }
            report(&Report::Saved { iter: it, path });
        }
        Ok(())
    };
    if let Some(st) = &cfg.resume {
        it = st.iteration;
        trained_tokens = st.trained_tokens;
        optimizer.load_state(&st.optimizer, st.optimizer_step)?;
        order.set_rng_state(st.rng);
        queue = st.queue.clone();
    }
    set_lora_kernels(model, cfg.lora_kernels)?;
    let compiled = if cfg.compile { Some(CompiledLossAndGrad::new(model, trainable)?) } else { None };
    // The compiled step reads the LoRA factors from copies in the activations' dtype, which the
    // optimizer writes from its fused update: no cast of each factor, nor of its gradient, inside
    // the step (MLX casts them anyway: a bfloat16 model multiplies bfloat16 factors).
    let copy_dtype = if compiled.is_some() && cfg.compute_copies { lora_compute_dtype(model, trainable) } else { None };
    tracing::debug!("compute copies of the LoRA factors: {copy_dtype:?}");
    let mut copies: HashMap<String, Array> = HashMap::new();
    if let Some(d) = copy_dtype {
        for (name, a) in model.parameters("") {
            if trainable.contains(&name) && a.dtype() != d {
                copies.insert(name, a.astype(d)?);
            }
        }
    }
    log_memory("before training");
    while it < cfg.iters {
        it += 1;
        if !valid.is_empty() && (it == 1 || it % cfg.steps_per_eval == 0 || it == cfg.iters) {
            let start = Instant::now();
            let (loss, _) = evaluate(model, valid, cfg.batch_size, cfg.val_batches, cfg.max_seq_length)?;
            last_val = Some(loss);
            let took = start.elapsed();
            report(&Report::Val { iter: it, loss, seconds: took.as_secs_f64() });
            log_memory(&format!("validation at iteration {it}"));
            // Throughput counts training time only.
            window_start += took;
        }
        if queue.is_empty() {
            queue = order.epoch();
            queue.reverse();
        }
        let b = queue.pop().expect("an epoch has at least one batch");
        let seqs: Vec<&Sequence> = batches[b].iter().map(|&i| &train[i]).collect();
        // Data-parallel: this rank's stride of the batch, and every rank's loss targets (each
        // rank's gradient weighs its share of the batch's targets).
        let mine = match ranks {
            Some(r) => seqs.iter().skip(r.rank()).step_by(r.size()).copied().collect(),
            None => seqs.clone(),
        };
        let batch = Batch::new(&mine, cfg.max_seq_length);
        let (batch_loss_tokens, batch_real_tokens) = match ranks {
            Some(r) => data_parallel_shares(&seqs, r, cfg.max_seq_length),
            None => (batch.loss_tokens(), batch.real_tokens()),
        };
        if batch.truncated() {
            report(&Report::Truncated { iter: it, longest: batch.longest, max_seq_length: cfg.max_seq_length });
        }
        let learning_rate = optimizer.learning_rate();
        // LoRA dropout's masks come from a key of the iteration: a resumed run drops what the
        // uninterrupted one did, and the compiled step takes the key as an input.
        let key = rmlx::random::key(cfg.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ it as u64)?;
        let built = Instant::now();
        let step = with_grad_checkpoint(cfg.grad_checkpoint, || match &compiled {
            Some(c) => c.call_with_copies(model, &batch, &key, &copies),
            None => crate::nn::with_dropout_key(key.clone(), || loss_and_grad(model, trainable, &batch)),
        })?;
        let step = match ranks {
            Some(r) => {
                let weight = batch.loss_tokens() as f32 / batch_loss_tokens.max(1) as f32;
                average_over_ranks(step, r, weight)?
            }
            None => step,
        };
        // Gradients are summed over `grad_accumulation_steps` batches (in their parameters' dtype),
        // then averaged into one update.
        let grads = match accumulated.take() {
            None if cfg.grad_accumulation_steps == 1 => step.grads,
            None => step
                .grads
                .into_iter()
                .map(|(n, g)| Ok((n.clone(), g.astype(step.params[&n].dtype())?)))
                .collect::<Result<_>>()?,
            Some(mut sum) => {
                for (name, g) in step.grads {
                    let total = (&sum[&name] + &g.astype(step.params[&name].dtype())?)?;
                    sum.insert(name, total);
                }
                sum
            }
        };
        pending += 1;
        let mut to_eval: Vec<Array> = vec![step.loss.clone()];
        if pending == cfg.grad_accumulation_steps || it == cfg.iters {
            let grads: HashMap<String, Array> = if pending > 1 {
                grads.into_iter().map(|(n, g)| Ok((n, (g / pending as f32)?))).collect::<Result<_>>()?
            } else {
                grads
            };
            pending = 0;
            // The parameters have not changed since the gradient was taken.
            let (new, new_copies) = optimizer.update_with_copies(&step.params, &grads, copy_dtype)?;
            // Each parameter's new value and optimizer state, from the first block to the last:
            // MLX's scheduler then runs the last blocks' updates first, as the backward pass
            // reaches them, and frees their saved activations early (an H100 measured 10.1 GB peak
            // for llama3.2-1b against 12.8 GB in hash order and 15.0 GB from the last block).
            // Every array handed to the evaluation comes in this order, never a hash map's: the
            // step's operations then run in the same order every iteration, which MLX's CUDA
            // backend needs to reuse the step's CUDA graphs instead of instantiating new ones.
            let names = in_block_order(&new);
            // Whether every updated parameter is finite: one boolean, evaluated with the step.
            let finite = all_finite(names.iter().map(|n| &new[*n]), FINITE_RUN)?;
            to_eval.extend(finite.clone());
            let state = optimizer.state_arrays().0;
            for n in names {
                to_eval.push(new[n].clone());
                to_eval.extend(new_copies.get(n).filter(|_| copy_dtype.is_some()).cloned());
                let prefix = format!("{n}.");
                to_eval.extend(
                    state.range(prefix.clone()..).take_while(|(k, _)| k.starts_with(&prefix)).map(|(_, a)| a.clone()),
                );
            }
            timed_eval(&to_eval, built, it)?;
            finite_step(&step.loss, finite.as_ref(), it)?;
            model.update("", new)?;
            if copy_dtype.is_some() {
                copies = new_copies;
            }
        } else {
            // In the parameters' order, as above: the same operations in the same order each time.
            to_eval.extend(in_block_order(&grads).into_iter().map(|n| grads[n].clone()));
            timed_eval(&to_eval, built, it)?;
            finite_step(&step.loss, None, it)?;
            accumulated = Some(grads);
        }
        log_memory(&format!("iteration {it}"));
        report(&Report::Step { iter: it, iters: cfg.iters });
        window_loss += step.loss.item::<f32>()? as f64;
        window_steps += 1;
        window_tokens += batch_loss_tokens;
        window_all += batch_real_tokens;
        trained_tokens += batch_loss_tokens;
        if it % cfg.steps_per_report == 0 || it == cfg.iters {
            let secs = window_start.elapsed().as_secs_f64();
            report(&Report::Train {
                iter: it,
                loss: (window_loss / window_steps as f64) as f32,
                learning_rate,
                tokens_per_sec: window_tokens as f64 / secs.max(1e-9),
                all_tokens_per_sec: window_all as f64 / secs.max(1e-9),
                trained_tokens,
                peak_memory_gb: rmlx::memory::peak_memory() as f64 / 1e9,
            });
            (window_loss, window_steps, window_tokens, window_all) = (0.0, 0, 0, 0);
            window_start = Instant::now();
        }
        // With gradients pending, the state could not resume exactly: only the weights go.
        let state = |order: &BatchOrder, queue: &[usize]| {
            let (optimizer_state, optimizer_step) = optimizer.state_arrays();
            TrainState {
                iteration: if pending == 0 { it } else { 0 },
                trained_tokens,
                optimizer_step,
                optimizer: optimizer_state,
                rng: order.rng_state(),
                queue: queue.to_vec(),
            }
        };
        if stop() {
            save(model, it, &state(&order, &queue), false, report)?;
            return Ok(TrainSummary { iterations: it, trained_tokens, last_val_loss: last_val, interrupted: true });
        }
        if it % cfg.save_every == 0 {
            save(model, it, &state(&order, &queue), true, report)?;
        }
    }
    // The last iteration applied its gradient: the state resumes exactly.
    let (optimizer, optimizer_step) = optimizer.state_arrays();
    let state = TrainState { iteration: it, trained_tokens, optimizer_step, optimizer, rng: order.rng_state(), queue };
    save(model, it, &state, false, report)?;
    Ok(TrainSummary { iterations: it, trained_tokens, last_val_loss: last_val, interrupted: false })
}

/// The loss targets and real tokens of the whole batch `seqs` as the ranks split it by stride
/// (each rank counts every rank's share: they weigh the ranks' gradients).
fn data_parallel_shares(seqs: &[&Sequence], ranks: &crate::Ranks, max_seq_length: usize) -> (usize, usize) {
    (0..ranks.size())
        .map(|r| {
            let part: Vec<&Sequence> = seqs.iter().skip(r).step_by(ranks.size()).copied().collect();
            let b = Batch::new(&part, max_seq_length);
            (b.loss_tokens(), b.real_tokens())
        })
        .fold((0, 0), |(l, a), (bl, ba)| (l + bl, a + ba))
}

/// The whole batch's loss and gradients from each rank's on its share (`weight`: its share of
/// the batch's loss targets): `Σ_r weight_r · x_r` over the ranks, the gradients summed as one
/// float32 buffer (one all-sum a step), in the parameters' order.
fn average_over_ranks(
    step: super::loss::LossAndGrad,
    ranks: &crate::Ranks,
    weight: f32,
) -> Result<super::loss::LossAndGrad> {
    let names: Vec<String> = in_block_order(&step.grads).into_iter().cloned().collect();
    let mut flat = Vec::with_capacity(names.len() + 1);
    flat.push((&step.loss.astype(rmlx::Dtype::Float32)? * weight)?.reshape(&[1])?);
    for n in &names {
        flat.push((&step.grads[n].astype(rmlx::Dtype::Float32)?.flatten()? * weight)?);
    }
    let sizes: Vec<i32> = flat.iter().map(|a| a.size() as i32).collect();
    let summed = ranks.all_sum(&rmlx::ops::concatenate(&flat.iter().collect::<Vec<_>>(), 0)?)?;
    let cuts: Vec<i32> = sizes
        .iter()
        .scan(0, |at, s| {
            *at += s;
            Some(*at)
        })
        .collect();
    let mut parts = rmlx::ops::split_at(&summed, &cuts[..cuts.len() - 1], 0)?.into_iter();
    let loss = parts.next().expect("the loss").reshape(&[])?.astype(step.loss.dtype())?;
    let mut grads = HashMap::with_capacity(names.len());
    for (n, part) in names.into_iter().zip(parts) {
        let g = &step.grads[&n];
        grads.insert(n.clone(), part.reshape(g.shape())?.astype(g.dtype())?);
    }
    Ok(super::loss::LossAndGrad { loss, ntoks: step.ntoks, grads, params: step.params })
}

/// Sets [`Lora::kernels`](crate::nn::Lora::kernels) on every adapter of `model`.
fn set_lora_kernels(model: &mut dyn Model, on: bool) -> Result<()> {
    let mut failure = None;
    model.visit_linears("", &mut |_, linear| {
        if let Some(lora) = linear.lora().filter(|l| l.kernels != on).cloned() {
            if let Err(e) = linear.set_lora(Some(crate::nn::Lora { kernels: on, ..lora })) {
                failure.get_or_insert(e);
            }
        }
    });
    failure.map_or(Ok(()), Err)
}

/// Elements checked by one reduction of [`all_finite`] (256 MiB of float32): the parameters are
/// joined into runs of at most this many, so a full fine-tune's check does not copy them all.
const FINITE_RUN: usize = 64 << 20;

/// One boolean array: whether every element of `arrays` is finite (`None` for no arrays). The
/// arrays are flattened and joined by dtype into runs of at most `run` elements (one array larger
/// than that is a run of its own), each checked by one reduction: a LoRA step's 224 factors
/// (qwen3-0.6b, 16 blocks) take one join and one reduction instead of eight kernels each, which a
/// GPU's host encodes one by one.
fn all_finite<'a>(arrays: impl IntoIterator<Item = &'a Array>, run: usize) -> Result<Option<Array>> {
    let mut by_dtype: Vec<(rmlx::Dtype, Vec<Vec<Array>>)> = Vec::new();
    for a in arrays {
        let runs = match by_dtype.iter().position(|(d, _)| *d == a.dtype()) {
            Some(i) => &mut by_dtype[i].1,
            None => {
                by_dtype.push((a.dtype(), Vec::new()));
                &mut by_dtype.last_mut().expect("just pushed").1
            }
        };
        let full = runs.last().is_none_or(|r| r.iter().map(Array::size).sum::<usize>() + a.size() > run);
        if full {
            runs.push(Vec::new());
        }
        runs.last_mut().expect("a run was just pushed").push(a.flatten()?);
    }
    let mut finite: Option<Array> = None;
    for run in by_dtype.into_iter().flat_map(|(_, runs)| runs) {
        let joined = match run.as_slice() {
            [one] => one.clone(),
            _ => rmlx::ops::concatenate(&run.iter().collect::<Vec<_>>(), 0)?,
        };
        let f = rmlx::ops::isfinite(&joined)?.all(rmlx::Axes::All, false)?;
        finite = Some(match finite {
            Some(all) => rmlx::ops::logical_and(&all, &f)?,
            None => f,
        });
    }
    Ok(finite)
}

/// [`crate::Error::NonFinite`] when iteration `it`'s loss or (when given) its updated parameters,
/// all evaluated, hold NaN or infinity: training stops before that step's update reaches the
/// model, and the adapters saved last stay the last finite ones.
fn finite_step(loss: &Array, params_finite: Option<&Array>, it: usize) -> Result<()> {
    let value = loss.item::<f32>()?;
    let what = if !value.is_finite() {
        format!("the training loss of iteration {it} is {value}")
    } else if params_finite.is_some_and(|f| !f.item::<bool>().unwrap_or(false)) {
        format!("iteration {it}'s update makes parameters NaN or infinite")
    } else {
        return Ok(());
    };
    Err(crate::Error::NonFinite(format!(
        "{what}: training stopped before applying it (a learning rate too high, or weights that overflow \
         the dtype); the adapters saved last are unchanged"
    )))
}

/// Evaluates a step's outputs; at debug level (`RMLX_LOG=debug`) it logs where the step's time
/// went: building the graph (since `built`), handing it to the device (MLX encodes every
/// operation on the host: `async_eval`'s duration), and waiting for the device to finish; at trace
/// level also the operations of the step by kind ([`rmlx::graph_census`]).
fn timed_eval(outputs: &[Array], built: Instant, it: usize) -> Result<()> {
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return Ok(rmlx::eval(outputs)?);
    }
    let build = built.elapsed();
    if tracing::enabled!(tracing::Level::TRACE) {
        let census = rmlx::graph_census(outputs)?;
        let total: usize = census.values().sum();
        let mut rows: Vec<_> = census.into_iter().collect();
        rows.sort_by_key(|r| std::cmp::Reverse(r.1));
        let rows: Vec<String> = rows.iter().map(|(n, c)| format!("{n} {c}")).collect();
        tracing::trace!("iteration {it}: {total} operations: {}", rows.join(", "));
        tracing::trace!("iteration {it}: graph signature {:016x}", rmlx::graph_signature(outputs)?);
    }
    let start = Instant::now();
    rmlx::async_eval(outputs)?;
    let encode = start.elapsed();
    rmlx::eval(outputs)?;
    let wait = start.elapsed() - encode;
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    tracing::debug!("iteration {it}: build {:.1} ms, encode {:.1} ms, wait {:.1} ms", ms(build), ms(encode), ms(wait));
    Ok(())
}

/// MLX's memory counters at `when`, at debug level (`RMLX_LOG=debug`).
fn log_memory(when: &str) {
    use rmlx::memory::{active_memory, cache_memory, peak_memory};
    let gb = |b: usize| b as f64 / 1e9;
    tracing::debug!(
        "{when}: active {:.3} GB, peak {:.3} GB, cached {:.3} GB",
        gb(active_memory()),
        gb(peak_memory()),
        gb(cache_memory())
    );
}

/// The dtype the LoRA factors among `trainable` are multiplied in: the model's (its embedding's
/// values or, quantised, scales). `None` when nothing is to be copied: no LoRA factor, factors
/// already in that dtype, or DoRA (whose magnitudes are computed from the factors in float32).
fn lora_compute_dtype(model: &dyn Model, trainable: &[String]) -> Option<rmlx::Dtype> {
    let mut factor = None;
    let (mut dora, mut embedding, mut packed_embedding) = (false, None, false);
    model.visit("", &mut |name, role, a| match role {
        Role::DoraMagnitude if trainable.iter().any(|n| n == name) => dora = true,
        Role::LoraA | Role::LoraB if factor.is_none() && trainable.iter().any(|n| n == name) => {
            factor = Some(a.dtype())
        }
        Role::Embedding if embedding.is_none() => {
            if a.dtype().is_floating() {
                embedding = Some(a.dtype());
            } else {
                packed_embedding = true;
            }
        }
        // A quantised embedding's scales come right after its packed values.
        Role::Quantization if packed_embedding && embedding.is_none() => embedding = Some(a.dtype()),
        _ => packed_embedding = false,
    });
    if dora {
        return None;
    }
    let (factor, activations) = (factor?, embedding?);
    (activations != factor).then_some(activations)
}

/// The names of `params` from the first block to the last (by the block index in a name,
/// `model.layers.3.…` → 3; names outside blocks last), then by name.
fn in_block_order(params: &HashMap<String, Array>) -> Vec<&String> {
    let block_of = |name: &str| crate::models::block_path(name).map_or(usize::MAX, |(i, _)| i);
    let mut names: Vec<&String> = params.keys().collect();
    names.sort_by_key(|n| (block_of(n), n.as_str()));
    names
}

#[cfg(test)]
mod tests {
    use super::all_finite;
    use rmlx::{Array, Dtype};

    fn check(arrays: &[Array], run: usize) -> Option<bool> {
        all_finite(arrays, run).unwrap().map(|f| f.item::<bool>().unwrap())
    }

    #[test]
    fn all_finite_finds_any_nan_or_infinity_in_any_run() {
        let ok = |v: &[f32], shape: &[i32]| Array::from_slice(v, shape).unwrap();
        let finite = [ok(&[1.0, -2.0, 3.0, 4.0], &[2, 2]), ok(&[5.0; 3], &[3]), ok(&[0.5; 6], &[2, 3])];
        for run in [1, 4, 7, 1 << 20] {
            assert_eq!(check(&finite, run), Some(true), "run {run}");
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                for at in 0..finite.len() {
                    let mut arrays = finite.to_vec();
                    let mut v = arrays[at].to_vec::<f32>().unwrap();
                    let last = v.len() - 1;
                    v[last] = bad;
                    arrays[at] = ok(&v, arrays[at].shape());
                    assert_eq!(check(&arrays, run), Some(false), "{bad} in array {at}, run {run}");
                }
            }
        }
        // Arrays of another dtype are joined apart from the float32 ones, not promoted.
        let mixed = [finite[0].clone(), finite[1].astype(Dtype::Bfloat16).unwrap(), finite[2].clone()];
        assert_eq!(check(&mixed, 100), Some(true));
        let bad = ok(&[f32::NAN], &[1]).astype(Dtype::Bfloat16).unwrap();
        assert_eq!(check(&[mixed[0].clone(), bad, mixed[2].clone()], 100), Some(false));
        assert_eq!(check(&[], 4), None);
    }
}
