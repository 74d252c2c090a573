//! The mlx-lm backend: Python's mlx-lm in a subprocess, for the architectures the native backend
//! does not have.
//!
//! The bridge script (`bridge.py`) ships inside the binary; it is written to the cache on
//! first use and run as `python3 <script>`, with the per-user mlx-lm installation ([`install`])
//! on its `PYTHONPATH` when there is one. It speaks JSON lines over stdin/stdout:
//!
//! * it starts with `{"ready": true, "mlx_lm_version", "mlx_version", "model_types"}`;
//! * requests carry `"op"` and an integer `"id"`: `load {path}`, `info`, `generate {prompt |
//!   prompt_tokens, max_tokens, temperature, top_p, top_k, min_p, seed}`, `chat {messages, ...}`,
//!   `classify {inputs, top_logprobs, logits}` and `batch_generate {inputs, ...}` (each input
//!   `{prompt}`, `{prompt_tokens}` or `{messages}`), `cancel {target}`, `quit`;
//! * a generation streams `{"id", "token", "token_id", "logprob"}` lines and ends with
//!   `{"id", "done": true, "finish_reason", "metrics"}`; other requests get one `{"id", "ok": true,
//!   ...}` line; a failure is `{"id", "error", "kind"}`.
//!
//! A subprocess that exits, closes its stdout or does not answer in time is reported as
//! [`Error::Backend`] and killed; the next call starts a new one and loads the model again.
//! Stop strings are applied on this side (`crate::text_stream::StopFilter`).

mod process;
mod stream;

pub use process::{install, install_dir, probe};

use super::{
    Backend, Candidate, Classification, ClassifyOptions, Completion, LanguageModel, ModelInfo, Prompt, TokenStream,
};
use crate::chat::Message;
use crate::generate::{FinishReason, GenerateOptions, Metrics};
use crate::loader::LoadOptions;
use crate::text_stream::StopFilter;
use crate::{Error, Result};
use process::{backend_error, Process};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Duration;
use stream::BridgeStream;

/// The backend's name.
pub const NAME: &str = "mlx-lm";
/// The mlx-lm release [`install`] installs (and the tests run), pinned in `scripts/requirements.txt`.
pub const MLX_LM_VERSION: &str = "0.32.2";
/// The MLX release installed with it (the same as rmlx's own).
pub const MLX_VERSION: &str = "0.32.4";
/// The bridge script.
pub const BRIDGE_SCRIPT: &str = include_str!("bridge.py");

/// How long the bridge may take.
#[derive(Clone, Debug)]
pub struct Timeouts {
    /// From start to `ready` (importing mlx-lm and transformers).
    pub start: Duration,
    /// Loading a model.
    pub load: Duration,
    /// Between two lines of a generation, and for the other requests.
    pub step: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts { start: Duration::from_secs(120), load: Duration::from_secs(1800), step: Duration::from_secs(600) }
    }
}

/// Runs checkpoints with Python's mlx-lm.
#[derive(Clone, Debug)]
pub struct MlxLmBackend {
    /// The Python interpreter (default: `$RMLX_PYTHON`, else `python3`).
    pub python: PathBuf,
    pub timeouts: Timeouts,
}

impl Default for MlxLmBackend {
    fn default() -> Self {
        let python = std::env::var_os("RMLX_PYTHON").filter(|p| !p.is_empty()).unwrap_or_else(|| "python3".into());
        MlxLmBackend { python: PathBuf::from(python), timeouts: Timeouts::default() }
    }
}

impl Backend for MlxLmBackend {
    fn name(&self) -> &str {
        NAME
    }

    fn supports(&self, path: &Path) -> std::result::Result<(), String> {
        let config = path.join("config.json");
        let text = std::fs::read_to_string(&config)
            .map_err(|_| format!("mlx-lm loads model folders with a config.json; {} has none", path.display()))?;
        let model_type = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v.get("model_type").and_then(Value::as_str).map(str::to_string))
            .ok_or_else(|| format!("{} names no model_type", config.display()))?;
        let ready = probe(self)?;
        let known = ready.get("model_types").and_then(Value::as_array);
        if known.is_some_and(|k| !k.iter().any(|t| t.as_str() == Some(model_type.as_str()))) {
            let version = ready["mlx_lm_version"].as_str().unwrap_or("?");
            return Err(format!("mlx-lm {version} has no `{model_type}` model"));
        }
        Ok(())
    }

    fn load(&self, path: &Path, _opts: &LoadOptions) -> Result<Box<dyn LanguageModel>> {
        Ok(Box::new(self.open(path)?))
    }
}

impl MlxLmBackend {
    /// Starts a bridge and loads the model folder `path` in it.
    pub fn open(&self, path: &Path) -> Result<MlxLmModel> {
        if !path.join("config.json").is_file() {
            return Err(Error::MissingFile(format!(
                "{} (the mlx-lm backend loads model folders with a config.json)",
                path.join("config.json").display()
            )));
        }
        let mut model = MlxLmModel {
            backend: self.clone(),
            path: path.to_path_buf(),
            process: None,
            info: ModelInfo {
                backend: NAME.into(),
                architecture: String::new(),
                vocab_size: 0,
                layers: 0,
                hidden_size: 0,
                heads: 0,
                kv_heads: 0,
                quantization: None,
                dtype: String::new(),
                device: String::new(),
                source: path.to_path_buf(),
            },
            last: None,
        };
        model.running()?;
        Ok(model)
    }
}

/// A model loaded in an mlx-lm subprocess.
pub struct MlxLmModel {
    backend: MlxLmBackend,
    path: PathBuf,
    /// The running bridge (`None` after a failure, until the next call starts one).
    process: Option<Process>,
    info: ModelInfo,
    /// The last operation's counters.
    last: Option<Metrics>,
}

impl MlxLmModel {
    /// The process id of the running bridge (`None` between a failure and the next call).
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(|p| p.child.id())
    }

    /// The subprocess, started (and the model loaded) if it is not running.
    fn running(&mut self) -> Result<&mut Process> {
        if let Some(mut p) = self.process.take_if(|p| !p.alive()) {
            // Died since the last call: said once, and the next call starts a new one.
            let status = p.child.wait().map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
            return Err(backend_error(format!("the mlx-lm process exited ({status}); the next call starts a new one")));
        }
        if self.process.is_none() {
            let mut p = Process::start(&self.backend)?;
            let id = p.send(json!({"op": "load", "path": self.path}))?;
            let reply = p.reply(id, self.backend.timeouts.load)?;
            self.info = info_from(&reply["info"], &self.path);
            self.process = Some(p);
        }
        Ok(self.process.as_mut().expect("started above"))
    }

    /// Sends `request` and waits for its one reply; a failure of the process drops it.
    fn call(&mut self, request: Value) -> Result<Value> {
        let step = self.backend.timeouts.step;
        let p = self.running()?;
        let result = p.send(request).and_then(|id| p.reply(id, step));
        if result.is_err() && !p.alive() {
            self.process = None;
        }
        result
    }

    fn stream<'a>(&'a mut self, mut request: Value, opts: &GenerateOptions) -> Result<Box<dyn TokenStream + 'a>> {
        check_supported(opts)?;
        if opts.max_tokens == 0 {
            return Err(Error::InvalidParameter("the mlx-lm backend generates at least one token".into()));
        }
        if opts.ignore_eos {
            // mlx-lm's stream_generate always stops at end-of-sequence tokens.
            return Err(Error::InvalidParameter(
                "the mlx-lm backend's generation stops at end-of-sequence tokens (ignore_eos: native, or batch_generate)"
                    .into(),
            ));
        }
        sampling(&mut request, opts);
        let p = self.running()?;
        let id = p.send(request)?;
        Ok(Box::new(BridgeStream::new(self, id, opts.stop_strings.clone())))
    }
}

/// Refuses what the bridge does not do (rather than ignoring it): the penalties, logit bias and
/// a context limit.
fn check_supported(opts: &GenerateOptions) -> Result<()> {
    let s = &opts.sampler;
    let unsupported = [
        ("repetition_penalty", s.repetition_penalty != 1.0),
        ("presence_penalty", s.presence_penalty != 0.0),
        ("frequency_penalty", s.frequency_penalty != 0.0),
        ("logit_bias", !s.logit_bias.is_empty()),
        ("context_limit", opts.context_limit.is_some()),
    ];
    match unsupported.iter().find(|(_, set)| *set) {
        Some((name, _)) => Err(Error::InvalidParameter(format!(
            "{name} is not supported by the mlx-lm backend (it takes temperature, top_p, top_k, min_p, seed, stop strings)"
        ))),
        None => opts.sampler.validate(),
    }
}

/// The generation fields of a request.
fn sampling(request: &mut Value, opts: &GenerateOptions) {
    let s = &opts.sampler;
    request["max_tokens"] = json!(opts.max_tokens);
    request["temperature"] = json!(s.temperature);
    request["top_p"] = json!(s.top_p);
    request["top_k"] = json!(s.top_k);
    request["min_p"] = json!(s.min_p);
    request["seed"] = json!(s.seed);
    request["ignore_eos"] = json!(opts.ignore_eos);
    if let Some(q) = &opts.kv_quantization {
        request["kv_bits"] = json!(q.bits);
        request["kv_group_size"] = json!(q.group_size);
        request["quantized_kv_start"] = json!(q.start);
    }
}

/// One prompt as the bridge takes it: `{"prompt"}`, `{"prompt_tokens"}` or `{"messages"}`.
fn input_of(prompt: &Prompt) -> Value {
    match prompt {
        Prompt::Text(t) => json!({"prompt": t}),
        Prompt::Tokens(ids) => json!({"prompt_tokens": ids}),
        Prompt::Chat(messages) => json!({"messages": messages}),
    }
}

fn info_from(v: &Value, path: &Path) -> ModelInfo {
    let n = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0) as usize;
    let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    let quantization = v.get("quantization").filter(|q| q.is_object()).map(|q| {
        let g = |k: &str| q.get(k).and_then(Value::as_i64).unwrap_or(0);
        format!("affine {}-bit, group {}", g("bits"), g("group_size"))
    });
    ModelInfo {
        backend: NAME.into(),
        architecture: s("architecture"),
        vocab_size: n("vocab_size"),
        layers: n("layers"),
        hidden_size: n("hidden_size"),
        heads: n("heads"),
        kv_heads: n("kv_heads"),
        quantization,
        dtype: s("dtype"),
        device: s("device"),
        source: path.to_path_buf(),
    }
}

pub(super) fn metrics_from(v: &Value) -> Metrics {
    let f = |k: &str| v.get(k).and_then(Value::as_f64).unwrap_or(0.0);
    let n = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0) as usize;
    let (prompt_tokens, generated_tokens) = (n("prompt_tokens"), n("generation_tokens"));
    let secs = |tokens: usize, tps: f64| Duration::from_secs_f64(if tps > 0.0 { tokens as f64 / tps } else { 0.0 });
    Metrics {
        prompt_tokens,
        generated_tokens,
        time_to_first_token: secs(prompt_tokens, f("prompt_tps")),
        decode_time: secs(generated_tokens.saturating_sub(1), f("generation_tps")),
        peak_memory: (f("peak_memory_gb") * 1e9) as usize,
    }
}

pub(super) fn finish_from(name: Option<&str>) -> FinishReason {
    match name {
        Some("length") => FinishReason::Length,
        Some("cancelled") => FinishReason::Cancelled,
        _ => FinishReason::Eos,
    }
}

impl LanguageModel for MlxLmModel {
    fn info(&self) -> ModelInfo {
        self.info.clone()
    }

    fn generate<'a>(&'a mut self, prompt: &Prompt, opts: &GenerateOptions) -> Result<Box<dyn TokenStream + 'a>> {
        let mut request = input_of(prompt);
        request["op"] = json!(if matches!(prompt, Prompt::Chat(_)) { "chat" } else { "generate" });
        self.stream(request, opts)
    }

    fn chat<'a>(&'a mut self, messages: &[Message], opts: &GenerateOptions) -> Result<Box<dyn TokenStream + 'a>> {
        let request = json!({"op": "chat", "messages": messages});
        self.stream(request, opts)
    }

    fn classify(&mut self, prompts: &[Prompt], opts: &ClassifyOptions) -> Result<Vec<Classification>> {
        let inputs: Vec<Value> = prompts.iter().map(input_of).collect();
        let request =
            json!({"op": "classify", "inputs": inputs, "top_logprobs": opts.top_logprobs, "logits": opts.logits});
        let reply = self.call(request)?;
        let results = reply["results"].as_array().cloned().unwrap_or_default();
        if results.len() != prompts.len() {
            return Err(backend_error(format!("{} classifications for {} prompts", results.len(), prompts.len())));
        }
        let mut out = Vec::with_capacity(results.len());
        for r in &results {
            let top = r["top"]
                .as_array()
                .map(|t| {
                    t.iter()
                        .map(|p| Candidate {
                            id: p[0].as_u64().unwrap_or(0) as u32,
                            logprob: p[1].as_f64().map_or(f32::NAN, |x| x as f32),
                            token: p[2].as_str().unwrap_or("").to_string(),
                        })
                        .collect()
                })
                .unwrap_or_default();
            let logits = r
                .get("logits")
                .and_then(Value::as_array)
                .map(|l| l.iter().map(|x| x.as_f64().map_or(f32::NAN, |x| x as f32)).collect());
            out.push(Classification {
                prompt_tokens: r["prompt_tokens"].as_u64().unwrap_or(0) as usize,
                token_id: r["token_id"].as_u64().unwrap_or(0) as u32,
                token: r["token"].as_str().unwrap_or("").to_string(),
                logprob: r["logprob"].as_f64().map_or(f32::NAN, |x| x as f32),
                top,
                logits,
            });
        }
        self.last = Some(Metrics { prompt_tokens: out.iter().map(|c| c.prompt_tokens).sum(), ..Metrics::default() });
        Ok(out)
    }

    fn batch_generate(&mut self, prompts: &[Prompt], opts: &GenerateOptions) -> Result<Vec<Result<Completion>>> {
        check_supported(opts)?;
        if opts.kv_quantization.is_some() {
            return Err(Error::InvalidParameter(
                "kv_bits is not supported by the mlx-lm backend's batch generation (mlx-lm's BatchGenerator has none)"
                    .into(),
            ));
        }
        let inputs: Vec<Value> = prompts.iter().map(input_of).collect();
        let mut request = json!({"op": "batch_generate", "inputs": inputs});
        sampling(&mut request, opts);
        let reply = self.call(request)?;
        let results = reply["results"].as_array().cloned().unwrap_or_default();
        if results.len() != prompts.len() {
            return Err(backend_error(format!("{} results for {} prompts", results.len(), prompts.len())));
        }
        self.last = reply.get("metrics").map(metrics_from);
        Ok(results
            .iter()
            .map(|r| {
                if let Some(e) = r.get("error").and_then(Value::as_str) {
                    return Err(backend_error(e));
                }
                let mut stop = StopFilter::new(opts.stop_strings.clone());
                let mut text = stop.push(r["text"].as_str().unwrap_or(""));
                let finish = if stop.stopped() {
                    FinishReason::StopString
                } else {
                    text.push_str(&stop.finish());
                    finish_from(r["finish_reason"].as_str())
                };
                Ok(Completion {
                    text,
                    token_ids: r["token_ids"]
                        .as_array()
                        .map(|t| t.iter().filter_map(Value::as_u64).map(|t| t as u32).collect())
                        .unwrap_or_default(),
                    prompt_tokens: r["prompt_tokens"].as_u64().unwrap_or(0) as usize,
                    finish_reason: finish,
                })
            })
            .collect())
    }

    fn metrics(&self) -> Option<Metrics> {
        self.last.clone()
    }

    fn close(mut self: Box<Self>) -> Result<()> {
        if let Some(mut p) = self.process.take() {
            let id = p.send(json!({"op": "quit"}))?;
            p.reply(id, Duration::from_secs(10))?;
            let _ = p.child.wait();
        }
        Ok(())
    }
}
