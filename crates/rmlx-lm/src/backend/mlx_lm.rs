//! The mlx-lm backend: Python's mlx-lm in a subprocess, for the architectures the native backend
//! does not have.
//!
//! The bridge script (`mlx_lm_bridge.py`) ships inside the binary; it is written to the cache on
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
//! Stop strings are applied on this side ([`crate::text_stream::StopFilter`]).

use super::{
    Backend, Candidate, Classification, ClassifyOptions, Completion, LanguageModel, ModelInfo, Prompt, TokenStream,
};
use crate::chat::Message;
use crate::generate::{CancelHandle, FinishReason, GenerateOptions, Metrics, Token};
use crate::loader::LoadOptions;
use crate::text_stream::StopFilter;
use crate::{Error, Result};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// The backend's name.
pub const NAME: &str = "mlx-lm";
/// The mlx-lm release [`install`] installs (and the tests run), pinned in `scripts/requirements.txt`.
pub const MLX_LM_VERSION: &str = "0.32.2";
/// The MLX release installed with it (the same as rmlx's own).
pub const MLX_VERSION: &str = "0.32.4";
/// The bridge script.
pub const BRIDGE_SCRIPT: &str = include_str!("mlx_lm_bridge.py");

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

/// The per-user cache root (the rule of rmlx-sys's build script).
fn cache_root() -> PathBuf {
    let var = |name| std::env::var_os(name).filter(|v: &std::ffi::OsString| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = var("RMLX_CACHE_DIR") {
        return dir;
    }
    if let Some(dir) = var("XDG_CACHE_HOME") {
        return dir.join("rmlx");
    }
    match var("HOME") {
        Some(home) if cfg!(target_os = "macos") => home.join("Library/Caches/rmlx"),
        Some(home) => home.join(".cache/rmlx"),
        None => PathBuf::from(".rmlx-cache"),
    }
}

/// Where [`install`] puts mlx-lm: a pip `--target` folder in the per-user cache.
pub fn install_dir() -> PathBuf {
    cache_root().join(format!("mlx-lm-{MLX_LM_VERSION}"))
}

/// Installs mlx-lm [`MLX_LM_VERSION`] with MLX [`MLX_VERSION`] (`mlx[cpu]` on Linux without CUDA)
/// into [`install_dir`] with `python -m pip install --target`, unless it is there already; pip's
/// output goes to stderr.
pub fn install(python: &Path) -> Result<PathBuf> {
    let dir = install_dir();
    if dir.join("mlx_lm").is_dir() {
        return Ok(dir);
    }
    let fail = |message: String| Error::Backend { backend: NAME.into(), message };
    let staging = dir.with_extension(format!("partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    let mlx =
        if cfg!(target_os = "linux") { format!("mlx[cpu]=={MLX_VERSION}") } else { format!("mlx=={MLX_VERSION}") };
    tracing::info!("installing mlx-lm {MLX_LM_VERSION} into {} (once)", dir.display());
    let status = Command::new(python)
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target"])
        .arg(&staging)
        .args([mlx, format!("mlx-lm=={MLX_LM_VERSION}")])
        .stdout(Stdio::from(std::io::stderr()))
        .status()
        .map_err(|e| fail(format!("cannot run `{} -m pip`: {e}", python.display())))?;
    if !status.success() {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(fail(format!("`{} -m pip install mlx-lm=={MLX_LM_VERSION}` failed ({status})", python.display())));
    }
    match std::fs::rename(&staging, &dir) {
        Ok(()) => Ok(dir),
        // Another process installed it meanwhile.
        Err(_) if dir.join("mlx_lm").is_dir() => {
            let _ = std::fs::remove_dir_all(&staging);
            Ok(dir)
        }
        Err(e) => Err(Error::io(&dir, e)),
    }
}

/// The bridge script in the cache (written once per content).
fn script_path() -> Result<PathBuf> {
    let hash = BRIDGE_SCRIPT.bytes().fold(0xcbf29ce484222325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3));
    let path = cache_root().join("bridge").join(format!("mlx_lm_bridge-{hash:016x}.py"));
    if !path.is_file() {
        let dir = path.parent().expect("has a parent");
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        std::fs::write(&tmp, BRIDGE_SCRIPT).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
    }
    Ok(path)
}

fn backend_error(message: impl Into<String>) -> Error {
    Error::Backend { backend: NAME.into(), message: message.into() }
}

/// A running bridge: its stdin, and its stdout lines read on a thread (so that waiting can time out).
struct Process {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    next_id: u64,
    /// The `ready` line.
    ready: Value,
}

impl Process {
    fn start(backend: &MlxLmBackend) -> Result<Process> {
        let script = script_path()?;
        let mut path = std::env::split_paths(&std::env::var_os("PYTHONPATH").unwrap_or_default()).collect::<Vec<_>>();
        let installed = install_dir();
        if installed.is_dir() {
            path.insert(0, installed);
        }
        let mut cmd = Command::new(&backend.python);
        cmd.arg(&script).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        if let Ok(joined) = std::env::join_paths(&path) {
            cmd.env("PYTHONPATH", joined);
        }
        let mut child =
            cmd.spawn().map_err(|e| backend_error(format!("cannot start `{}`: {e}", backend.python.display())))?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut p = Process { child, stdin, lines, next_id: 1, ready: Value::Null };
        let first = p.recv(backend.timeouts.start)?;
        if first.get("ready") != Some(&Value::Bool(true)) {
            let why = first.get("error").and_then(Value::as_str).unwrap_or("no `ready` line").to_string();
            p.kill();
            return Err(backend_error(format!(
                "`{}` cannot run mlx-lm: {why} (install it with `pip install mlx-lm`, or `rmlx backends --install-mlx-lm`)",
                backend.python.display()
            )));
        }
        p.ready = first;
        Ok(p)
    }

    /// Sends a request (its `id` is set here) and returns the id.
    fn send(&mut self, mut request: Value) -> Result<u64> {
        let id = self.next_id;
        self.next_id += 1;
        request["id"] = json!(id);
        let line = format!("{request}\n");
        self.stdin
            .write_all(line.as_bytes())
            .and_then(|()| self.stdin.flush())
            .map_err(|e| backend_error(format!("the mlx-lm process is gone ({e})")))?;
        Ok(id)
    }

    /// The next line, as JSON.
    fn recv(&mut self, timeout: Duration) -> Result<Value> {
        match self.lines.recv_timeout(timeout) {
            Ok(line) => serde_json::from_str(&line)
                .map_err(|e| backend_error(format!("the bridge wrote a line that is not JSON ({e}): {line}"))),
            Err(RecvTimeoutError::Timeout) => {
                self.kill();
                Err(backend_error(format!(
                    "the mlx-lm process did not answer within {:.0} s; it was stopped (the next call starts a new one)",
                    timeout.as_secs_f64()
                )))
            }
            Err(RecvTimeoutError::Disconnected) => {
                let status = self.child.wait().map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
                Err(backend_error(format!("the mlx-lm process exited ({status}); the next call starts a new one")))
            }
        }
    }

    /// The reply to request `id` (lines of other requests are skipped).
    fn reply(&mut self, id: u64, timeout: Duration) -> Result<Value> {
        loop {
            let v = self.recv(timeout)?;
            if v.get("id").and_then(Value::as_u64) == Some(id) {
                return check(v);
            }
        }
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if self.alive() {
            let _ = self.send(json!({"op": "quit"}));
            // A well-behaved bridge exits at once; give it a moment, then kill it.
            for _ in 0..20 {
                if !self.alive() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            self.kill();
        }
    }
}

/// An `{"error", "kind"}` reply as an [`Error`]; any other reply as is.
fn check(v: Value) -> Result<Value> {
    match v.get("error").and_then(Value::as_str) {
        Some(message) => {
            let kind = v.get("kind").and_then(Value::as_str).unwrap_or("error");
            Err(backend_error(format!("{message} ({kind})")))
        }
        None => Ok(v),
    }
}

/// What the backend's interpreter says when the bridge starts (its `ready` line: versions, model
/// types), or why it cannot run mlx-lm; asked once per process and interpreter.
pub fn probe(backend: &MlxLmBackend) -> std::result::Result<Value, String> {
    static PROBES: OnceLock<Mutex<HashMap<PathBuf, std::result::Result<Value, String>>>> = OnceLock::new();
    let mut probes = PROBES.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    probes
        .entry(backend.python.clone())
        .or_insert_with(|| Process::start(backend).map(|p| p.ready.clone()).map_err(|e| e.to_string()))
        .clone()
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
    process: Option<Process>,
    info: ModelInfo,
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
        Ok(Box::new(BridgeStream {
            model: self,
            id,
            cancel: CancelHandle::default(),
            cancel_sent: false,
            stop: StopFilter::new(opts.stop_strings.clone()),
            finish: None,
            metrics: Metrics::default(),
        }))
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

fn metrics_from(v: &Value) -> Metrics {
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

fn finish_from(name: Option<&str>) -> FinishReason {
    match name {
        Some("length") => FinishReason::Length,
        Some("cancelled") => FinishReason::Cancelled,
        _ => FinishReason::Eos,
    }
}

/// A generation streaming from the bridge.
struct BridgeStream<'a> {
    model: &'a mut MlxLmModel,
    id: u64,
    cancel: CancelHandle,
    cancel_sent: bool,
    stop: StopFilter,
    finish: Option<FinishReason>,
    metrics: Metrics,
}

impl BridgeStream<'_> {
    fn fail(&mut self, e: Error) -> Option<Result<Token>> {
        self.finish = Some(FinishReason::Cancelled);
        if self.model.process.as_mut().is_some_and(|p| !p.alive()) {
            self.model.process = None;
        }
        Some(Err(e))
    }

    /// Asks the bridge to stop this generation (once).
    fn send_cancel(&mut self) -> Result<()> {
        if !self.cancel_sent {
            self.cancel_sent = true;
            if let Some(p) = self.model.process.as_mut() {
                p.send(json!({"op": "cancel", "target": self.id}))?;
            }
        }
        Ok(())
    }

    /// Reads lines until this generation's `done` (after a stop string or a cancel).
    fn drain(&mut self) -> Result<()> {
        let step = self.model.backend.timeouts.step;
        let Some(p) = self.model.process.as_mut() else { return Ok(()) };
        loop {
            let v = p.recv(step)?;
            if v.get("id").and_then(Value::as_u64) != Some(self.id) {
                continue;
            }
            if v.get("done").is_some() || v.get("error").is_some() {
                if let Some(m) = v.get("metrics") {
                    self.metrics = metrics_from(m);
                }
                return Ok(());
            }
        }
    }
}

impl Iterator for BridgeStream<'_> {
    type Item = Result<Token>;

    fn next(&mut self) -> Option<Result<Token>> {
        if self.finish.is_some() {
            return None;
        }
        if self.cancel.is_cancelled() {
            if let Err(e) = self.send_cancel().and_then(|()| self.drain()) {
                return self.fail(e);
            }
            self.finish = Some(FinishReason::Cancelled);
            return None;
        }
        let step = self.model.backend.timeouts.step;
        loop {
            let Some(p) = self.model.process.as_mut() else {
                return self.fail(backend_error("the mlx-lm process is gone"));
            };
            let v = match p.recv(step) {
                Ok(v) => v,
                Err(e) => return self.fail(e),
            };
            if v.get("id").and_then(Value::as_u64) != Some(self.id) {
                continue;
            }
            let v = match check(v) {
                Ok(v) => v,
                Err(e) => return self.fail(e),
            };
            if v.get("done").is_some() {
                self.metrics = metrics_from(&v["metrics"]);
                self.finish = Some(finish_from(v.get("finish_reason").and_then(Value::as_str)));
                return None;
            }
            let id = v.get("token_id").and_then(Value::as_u64).unwrap_or(0) as u32;
            let piece = v.get("token").and_then(Value::as_str).unwrap_or("");
            let logprob = v.get("logprob").and_then(Value::as_f64).map_or(f32::NAN, |l| l as f32);
            let last = v.get("finish_reason").and_then(Value::as_str);
            let mut text = self.stop.push(piece);
            self.metrics.generated_tokens += 1;
            if self.stop.stopped() {
                // Ends here: the bridge is told to stop, and its remaining lines are read.
                if let Err(e) = self.send_cancel().and_then(|()| self.drain()) {
                    return self.fail(e);
                }
                self.finish = Some(FinishReason::StopString);
            } else if last.is_some() {
                text.push_str(&self.stop.finish());
            }
            return Some(Ok(Token { id, text, logprob }));
        }
    }
}

impl TokenStream for BridgeStream<'_> {
    fn cancel_handle(&self) -> CancelHandle {
        self.cancel.clone()
    }

    fn metrics(&self) -> Metrics {
        self.metrics.clone()
    }

    fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }
}

impl Drop for BridgeStream<'_> {
    fn drop(&mut self) {
        if self.finish.is_none() {
            // Dropped mid-stream: stop the generation so that the next request is not queued
            // behind it (a process that does not stop in time is killed).
            if self.send_cancel().and_then(|()| self.drain()).is_err() {
                self.model.process = None;
            }
        }
        self.model.last = Some(self.metrics.clone());
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
