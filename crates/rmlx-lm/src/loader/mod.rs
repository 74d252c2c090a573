//! Loading a model from a Hugging Face folder (config.json, safetensors shards, tokenizer files,
//! generation_config.json; plain or MLX-quantised: `hf.rs`) or a GGUF file (`gguf.rs`),
//! into a [`LoadedModel`]: the model, its tokenizer, chat template and stop ids.
//!
//! A model file is untrusted input: safetensors headers are validated before MLX reads them
//! (`crate::safetensors_header`), config values are type- and range-checked by name
//! (`crate::config`), and the checkpoint is checked against the config (`crate::checkpoint`),
//! so that a broken or lying file gets an [`Error`] rather than a panic, an abort or garbage.

mod gguf;
mod hf;

use crate::chat::ChatTemplate;
use crate::config::ModelConfig;
use crate::models::{self, Model};
use crate::nn::Builder;
use crate::tokenizer::Tokenizer;
use crate::vocab::VocabBounds;
use crate::weights::Weights;
use crate::{Error, Result};
use rmlx::{Array, Dtype};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// How to load.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Compute dtype; default: the checkpoint's (for GGUF files: float32 on the CPU, else bfloat16).
    pub dtype: Option<Dtype>,
    /// Dequantise quantised weights at load (`Some(true)`) or keep them all quantised
    /// (`Some(false)`). Default: keep them, except on the CPU those rmlx's CPU products do not
    /// take (`crate::nn::cpu_qmm::serves`: affine 4- and 8-bit ones), where MLX's quantised
    /// matmul is slow.
    pub dequantize: Option<bool>,
    /// Show progress and a summary on stderr.
    pub progress: bool,
    /// Load a folder without tokenizer.json, with a placeholder tokenizer whose tokens are `<id>`
    /// (benchmarks of random-weight checkpoints).
    pub allow_missing_tokenizer: bool,
    /// Which product decoding takes for quantised weights on MLX's CUDA backend (default: rmlx's
    /// kernel for large weights).
    pub quantized_matvec: crate::nn::QuantizedMatvec,
    /// Whether decoding steps on MLX's CUDA backend replay their layers as one captured launch
    /// (default: where they can).
    pub step_capture: crate::nn::StepCapture,
    /// Split the model over these ranks (tensor parallelism: every rank of the group loads it
    /// with the same options and holds its share; see [`crate::Ranks`]).
    pub tensor_parallel: Option<crate::Ranks>,
    /// Under tensor parallelism, keep the embedding and output head whole on every rank. By
    /// default each rank holds its share of their vocabulary rows (where the ranks divide the
    /// vocabulary): a token's lookup becomes one all-sum and its logits one all-gather, and each
    /// rank reads 1/n of the head a step.
    pub whole_vocabulary: bool,
    /// Split the model's blocks over these ranks instead (pipeline parallelism: each rank holds a
    /// run of consecutive blocks; see [`crate::nn::pipeline`]).
    pub pipeline_parallel: Option<crate::Ranks>,
}

/// A model ready to generate with.
pub struct LoadedModel {
    pub model: Box<dyn Model>,
    pub tokenizer: Tokenizer,
    /// The checkpoint's chat template, else the family's built-in one.
    pub chat_template: ChatTemplate,
    /// Token ids that end generation (config, generation_config and tokenizer EOS).
    pub eos_ids: Vec<u32>,
    /// The compute dtype.
    pub dtype: Dtype,
    /// Parameters (quantised matrices counted unpacked).
    pub parameters: u64,
    /// Bytes of weights held.
    pub weight_bytes: u64,
    /// Where it came from.
    pub source: PathBuf,
    /// Checkpoint tensors the model did not use (also reported on stderr at load).
    pub unused_tensors: Vec<String>,
    /// Embedding rows versus tokenizer ids: the id check every input goes through and the mask
    /// that keeps padding ids from being sampled.
    pub vocab: VocabBounds,
    /// The ranks the model is split over, when it is (every rank generates in step with the
    /// others and takes rank 0's sampled tokens).
    pub tensor_parallel: Option<crate::Ranks>,
    /// The ranks whose pipeline the model's blocks are split over, when they are (as above).
    pub pipeline_parallel: Option<crate::Ranks>,
}

impl LoadedModel {
    /// Each layer's sliding window (`None`: the layer attends to every position).
    pub fn layer_windows(&self) -> Vec<Option<usize>> {
        self.model.new_caches(None).iter().map(crate::cache::KvCache::window).collect()
    }

    /// Bytes of one position's keys and values in one layer, in the compute dtype (this rank's
    /// heads, under tensor parallelism).
    pub fn kv_bytes_per_layer_position(&self) -> usize {
        let cfg = self.model.config();
        let ranks = self.tensor_parallel.as_ref().map_or(1, |tp| tp.size());
        let kv_heads = (cfg.kv_heads() as usize / ranks).max(1);
        2 * kv_heads * cfg.head_dim() as usize * self.dtype.size()
    }

    /// The ranks the model is split over (by tensors or by blocks), when it is: they run every
    /// step together.
    pub fn ranks(&self) -> Option<&crate::Ranks> {
        self.tensor_parallel.as_ref().or(self.pipeline_parallel.as_ref()).filter(|r| r.size() > 1)
    }

    /// Rank 0's `token` on every rank of a split model (lazy), else `token`.
    pub(crate) fn agreed(&self, token: Array) -> Result<Array> {
        match self.ranks() {
            Some(ranks) => ranks.from_rank0(&token),
            None => Ok(token),
        }
    }
}

/// Loads a Hugging Face folder or a GGUF file (recognised by its magic bytes `GGUF`, whatever its
/// extension; a `.gguf` file without them gets [`Error::Corrupt`]).
pub fn load(path: impl AsRef<Path>, opts: &LoadOptions) -> Result<LoadedModel> {
    let path = path.as_ref();
    if path.is_file() {
        if is_gguf(path)? || path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
            return gguf::load(path, opts);
        }
        return Err(Error::Corrupt {
            path: path.display().to_string(),
            reason: "not a GGUF file (no `GGUF` magic) and not a model folder".into(),
        });
    }
    if !path.is_dir() {
        return Err(Error::MissingFile(format!("{} is neither a model folder nor a GGUF file", path.display())));
    }
    hf::load_dir(path, opts)
}

pub(crate) use gguf::{read as read_gguf, GgufCheckpoint};
pub(crate) use hf::read_weights as read_safetensors_dir;

/// Whether `path` is a GGUF file (by its magic bytes or its extension).
pub(crate) fn is_gguf_file(path: &Path) -> Result<bool> {
    Ok(path.is_file() && (is_gguf(path)? || path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))))
}

/// Whether a file starts with GGUF's magic bytes.
fn is_gguf(path: &Path) -> Result<bool> {
    use std::io::Read;
    let mut magic = [0u8; 4];
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let n = f.read(&mut magic).map_err(|e| Error::io(path, e))?;
    Ok(n == 4 && &magic == b"GGUF")
}

/// Builds the model, evaluates its weights (with progress) and checks the tokenizer fits.
pub(super) fn finish(
    cfg: ModelConfig,
    weights: Weights,
    tokenizer: Tokenizer,
    chat_template: ChatTemplate,
    dtype: Dtype,
    opts: &LoadOptions,
    source: &Path,
) -> Result<LoadedModel> {
    let started = Instant::now();
    let on_cpu = rmlx::current_device().kind == rmlx::DeviceType::Cpu;
    crate::checkpoint::check_layers(&cfg, &weights, source)?;
    let mut b = Builder::new(weights, dtype, opts.dequantize == Some(true));
    b.dequantize_unserved = opts.dequantize.is_none() && on_cpu;
    b.quantized_matvec = opts.quantized_matvec;
    b.step_capture = opts.step_capture;
    b.tensor_parallel = opts.tensor_parallel.clone();
    b.whole_vocabulary = opts.whole_vocabulary;
    if let Some(ranks) = &opts.pipeline_parallel {
        if opts.tensor_parallel.is_some() {
            return Err(Error::Pipeline("a model is split by tensors or by blocks, not both".into()));
        }
        b.set_stage(crate::nn::pipeline::Stage::of(ranks, cfg.num_hidden_layers)?);
    }
    let model = models::build(&cfg, &mut b)?;
    let unused_tensors = crate::checkpoint::unused_tensors(&b.remaining());
    crate::checkpoint::warn_unused(&unused_tensors, source);
    let arrays = b.take_built();
    let bar = crate::progress::Progress::new(opts.progress, "loading weights", arrays.len() as u64);
    let mut weight_bytes = 0u64;
    for chunk in arrays.chunks(16) {
        rmlx::eval(chunk.iter())?;
        weight_bytes += chunk.iter().map(|a| a.nbytes() as u64).sum::<u64>();
        bar.inc(chunk.len() as u64);
    }
    bar.finish();
    let parameters = b.parameters();
    // The tokenizer may be larger than the embedding (Gemma 3's `<image_soft_token>`) or smaller
    // (padding rows): see `crate::vocab`.
    let vocab = VocabBounds::new(cfg.vocab_size.max(0) as usize, &tokenizer, dtype)?;
    let mut eos_ids: Vec<u32> = tokenizer.eos_ids().to_vec();
    eos_ids.sort_unstable();
    eos_ids.dedup();
    if opts.progress {
        let quantized = match (b.quantized_kept, b.quantized_dequantized) {
            (_, 0) => String::new(),
            (0, _) => ", dequantised".to_string(),
            (kept, dense) => format!(", {dense} of {} quantised matrices dequantised", kept + dense),
        };
        tracing::info!(
            "loaded {} ({}, {:.1}M parameters, {:.2} GB of weights as {}{}) in {:.1}s",
            source.display(),
            cfg.model_type,
            parameters as f64 / 1e6,
            weight_bytes as f64 / 1e9,
            dtype.name(),
            quantized,
            started.elapsed().as_secs_f64()
        );
    }
    Ok(LoadedModel {
        model,
        tokenizer,
        chat_template,
        eos_ids,
        dtype,
        parameters,
        weight_bytes,
        source: source.to_path_buf(),
        unused_tensors,
        vocab,
        tensor_parallel: opts.tensor_parallel.clone(),
        pipeline_parallel: opts.pipeline_parallel.clone(),
    })
}

/// The built-in chat template family of an architecture.
pub(super) fn family(cfg: &ModelConfig) -> Result<&'static str> {
    Ok(crate::models::spec::of(cfg)?.chat_family)
}
