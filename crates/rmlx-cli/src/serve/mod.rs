//! `rmlx serve`: an OpenAI-compatible HTTP server (axum on tokio) in front of the generation
//! loop of [`engine`]: `POST /v1/chat/completions` (with tools and reasoning),
//! `POST /v1/completions`, `POST /v1/responses` (streamed as server-sent events or whole), `GET /v1/models`, `GET /health` and Prometheus text at
//! `GET /metrics`. Errors come in OpenAI's shape with their status. LoRA adapters loaded with
//! `--adapter NAME=PATH` (or, with `--allow-adapter-loading`, through vLLM's
//! `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`) are chosen per request by
//! `model: "NAME"` or `"BASE:NAME"`, and requests for different adapters share one batch.
//!
//! The pieces: [`api`] (OpenAI's shapes and what a request may ask), [`respond`] (the completion
//! endpoints), [`engine`] (the native batching loop) or [`interface`] (another backend, one
//! request at a time), [`listen`] (connections, timeouts, the drain), [`adapters`].

mod adapters;
mod api;
mod engine;
mod interface;
mod listen;
mod respond;
mod responses;

use crate::common::{count, KvCacheArgs, ModelArgs, SpeculativeArgs};
use anyhow::{Context, Result};
use api::ApiError;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Args as ClapArgs;
use engine::{Control, Job, Stats};
use rmlx_lm::engine::EngineOptions;
use serde_json::json;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Sender, SyncSender};
use std::sync::{Arc, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    kv_cache: KvCacheArgs,
    #[command(flatten)]
    speculative: SpeculativeArgs,
    /// With speculative decoding: the most running sequences a step drafts for; a larger batch
    /// decodes plainly (drafts cost more than they save once the batch keeps the device busy).
    #[arg(long, default_value_t = 8, value_parser = count)]
    speculative_max_batch: usize,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the address is printed to stderr).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// A file holding the API key clients must send as `Authorization: Bearer KEY`.
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// Requests that may wait for a free row of the batch; more are refused with 503 and
    /// `Retry-After`.
    #[arg(long, default_value_t = 64, value_parser = count)]
    max_queue: usize,
    /// `max_tokens` of requests that do not set it.
    #[arg(long, default_value_t = 512, value_parser = count)]
    default_max_tokens: usize,
    /// The context, in tokens (default: the model's `max_position_embeddings`, else 32768).
    #[arg(long, value_parser = count)]
    context: Option<usize>,
    /// Most sequences decoded together (continuous batching); more wait in the queue.
    #[arg(long, default_value_t = 32, value_parser = count)]
    max_batch: usize,
    /// Prompt tokens computed per decoding step: a newcomer's prompt is spread over steps so
    /// that running streams keep going.
    #[arg(long, default_value_t = 2048, value_parser = count)]
    prefill_step: usize,
    /// Most newcomers whose prompts are computed together in one forward pass (padded to end
    /// together, within `--prefill-step` tokens); 1 computes them one at a time.
    #[arg(long, default_value_t = 8, value_parser = count)]
    prefill_batch: usize,
    /// Gigabytes of keys and values kept for reuse by prompts that begin the same way (LRU;
    /// 0 turns the prompt cache off).
    #[arg(long, default_value_t = 2.0)]
    prompt_cache_gb: f64,
    /// Gigabytes the running batch's keys and values may take (a draft model's included);
    /// requests that would pass it wait, and one that cannot fit alone is refused (default: three
    /// quarters of what MLX's memory limit for the device leaves after the weights and the prompt
    /// cache).
    #[arg(long)]
    max_kv_gb: Option<f64>,
    /// A directory the prompt cache spills to: entries the memory budget lets go, and those held
    /// at shutdown, are written there as prompt-cache files (mlx-lm's format) and read back by
    /// prompts that begin the same way, also after a restart.
    #[arg(long)]
    prompt_cache_dir: Option<std::path::PathBuf>,
    /// Gigabytes the prompt-cache directory may hold (the least recently used files go first).
    #[arg(long, default_value_t = 16.0, requires = "prompt_cache_dir")]
    prompt_cache_dir_gb: f64,
    /// Build each decoding step before the previous one's tokens are read (experimental: slower
    /// through the evaluation thread, see BENCHMARKS.md).
    #[arg(long, hide = true)]
    pipelined_decode: bool,
    /// A LoRA adapter folder (mlx-lm's or PEFT's) that requests choose with `model: "NAME"` or
    /// `"BASE:NAME"`; repeatable. The base model stays as it is for the other requests.
    #[arg(long = "adapter", value_name = "NAME=PATH", value_parser = adapters::named_path)]
    adapters: Vec<(String, PathBuf)>,
    /// Enable `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's API: JSON
    /// `{"lora_name", "lora_path"}`), which load and unload adapters while serving.
    #[arg(long)]
    allow_adapter_loading: bool,
    /// With --allow-adapter-loading: `lora_path` must lie inside this folder (repeatable; default:
    /// anywhere the server can read).
    #[arg(long = "adapter-dir", value_name = "DIR")]
    adapter_dirs: Vec<PathBuf>,
    /// Who runs the model: `native` (the batching engine), `mlx-lm` (Python's mlx-lm, for the
    /// architectures rmlx lacks; one request at a time), or `auto` (native when it can).
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Most connections open at once; more are closed as they arrive.
    #[arg(long, default_value_t = 1024, value_parser = count)]
    max_connections: usize,
    /// Seconds a client has to send a request's headers (and between requests on a kept-alive
    /// connection) before the connection is closed.
    #[arg(long, default_value_t = 10, value_parser = count)]
    header_timeout: usize,
    /// Seconds a client has to send a request's body (408 past it).
    #[arg(long, default_value_t = 30, value_parser = count)]
    body_timeout: usize,
    /// Before taking requests, run one pass over every batch size (`auto`: when the model runs on
    /// a GPU), so that kernels compiled on first use (a minute or more for a quantised model on a
    /// fresh machine) are ready before the first clients wait: `auto`, `on` or `off`.
    #[arg(long, default_value = "auto", value_parser = ["auto", "on", "off"])]
    warm_up: String,
    /// Template variables every chat request gets (a JSON object, such as
    /// '{"enable_thinking": false}'); a request's `chat_template_kwargs` override them.
    #[arg(long, value_name = "JSON")]
    chat_template_args: Option<String>,
    /// How the model writes tool calls, when its chat template's markers do not tell: `hermes`,
    /// `llama3`, `mistral`, `function_gemma` or `harmony`.
    #[arg(long, value_name = "FORMAT")]
    tool_parser: Option<String>,
    /// Seconds the requests in progress may take to finish after Ctrl-C or SIGTERM; then the
    /// streams still open end with an error and the server exits (a second signal exits at once).
    #[arg(long, default_value_t = 30)]
    shutdown_timeout: u64,
}

/// What the handlers share. No MLX in here: only the queue to the engine and counters.
struct Shared {
    model_id: String,
    created: u64,
    jobs: SyncSender<Job>,
    control: std::sync::Mutex<Sender<Control>>,
    /// Loaded adapters: name → folder.
    adapters: RwLock<BTreeMap<String, PathBuf>>,
    allow_adapter_loading: bool,
    /// Folders `lora_path` must lie in (canonical; empty: anywhere).
    adapter_roots: Vec<PathBuf>,
    stats: Arc<Stats>,
    api_key: Option<String>,
    default_max_tokens: usize,
    next_id: AtomicU64,
    /// The backend serving (`native`, `mlx-lm`, ...); only the native one batches requests.
    backend: String,
    /// `--chat-template-args` and `--tool-parser`.
    chat_defaults: api::ChatDefaults,
    /// Responses kept for `previous_response_id`.
    responses: responses::Store,
    /// Turns true when the shutdown's drain deadline passes: responses still being sent end with
    /// an error.
    cut: tokio::sync::watch::Receiver<bool>,
}

pub fn run(a: Args) -> Result<()> {
    a.kv_cache.quantization()?;
    let api_key = match &a.api_key_file {
        Some(p) => {
            let key =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?.trim().to_string();
            // An empty key would start a server that refuses every request.
            anyhow::ensure!(!key.is_empty(), "--api-key-file {}: the file holds no key", p.display());
            Some(key)
        }
        None => None,
    };
    // Structured logs (one line per request, with its id) on stderr; `RMLX_LOG` filters them
    // (`RMLX_LOG=debug`, `RMLX_LOG=warn`).
    let filter = tracing_subscriber::EnvFilter::try_from_env("RMLX_LOG").unwrap_or_else(|_| "info".into());
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(filter)
        .with_target(false)
        .init();
    let model = a.model.open(&a.backend)?;
    let backend = model.info().backend;
    let model_id = match &a.model.model {
        Some(p) => p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| p.display().to_string()),
        // "SmolLM2-135M-Instruct (Q4_1 GGUF, ...)": the name before the description.
        None => rmlx_lm::registry::DEFAULT_MODEL_NAME.split(" (").next().unwrap_or_default().to_string(),
    };
    if let Some(lm) = model.as_native() {
        // The adapters are read before serving, so that a bad one stops the start-up.
        let mut seen = std::collections::BTreeSet::new();
        for (name, path) in &a.adapters {
            anyhow::ensure!(seen.insert(name), "two adapters are named `{name}`");
            anyhow::ensure!(
                *name != model_id,
                "the adapter `{name}` has the base model's name: requests for it would get the base model"
            );
            rmlx_lm::tuner::adapters::read(lm.model.as_ref(), path, lm.dtype)
                .with_context(|| format!("reading the adapter `{name}` from {}", path.display()))?;
        }
    } else {
        anyhow::ensure!(
            a.adapters.is_empty() && !a.allow_adapter_loading,
            "adapters need the native backend, and {model_id} is served by {backend}"
        );
    }
    anyhow::ensure!(
        !a.speculative.enabled() || model.as_native().is_some_and(|lm| lm.ranks().is_none()),
        "speculative decoding needs the native backend and a model on one device"
    );
    anyhow::ensure!(
        a.prompt_cache_dir.is_none() || model.as_native().is_some_and(|lm| lm.ranks().is_none()),
        "--prompt-cache-dir needs the native backend and a model on one device (split over ranks, each rank holds part of every entry)"
    );
    if let Some(lm) = model.as_native() {
        if let Some(ranks) = lm.ranks().filter(|r| r.rank() != 0) {
            // Rank 0 serves HTTP; this rank computes its share of every step rank 0 decides
            // (adapters and warm-up included).
            let (options, _) = engine_options(&a, lm, None);
            let engine = rmlx_lm::engine::Engine::new(lm, options);
            return Ok(rmlx_lm::engine::Lockstep::follow(engine, ranks)?);
        }
    }
    let chat_defaults = api::ChatDefaults {
        template_args: match &a.chat_template_args {
            None => Default::default(),
            Some(text) => match serde_json::from_str(text) {
                Ok(serde_json::Value::Object(o)) => o,
                _ => anyhow::bail!(
                    "--chat-template-args must be a JSON object, such as '{{\"enable_thinking\": false}}'"
                ),
            },
        },
        tool_format: a.tool_parser.as_deref().map(rmlx_lm::chat::ToolFormat::from_name).transpose()?,
    };
    let adapter_roots = a
        .adapter_dirs
        .iter()
        .map(|d| d.canonicalize().with_context(|| format!("--adapter-dir {}", d.display())))
        .collect::<Result<Vec<_>>>()?;
    let listener = std::net::TcpListener::bind((a.host.as_str(), a.port))
        .with_context(|| format!("binding {}:{}", a.host, a.port))?;
    listener.set_nonblocking(true)?;
    let one_at_a_time = if model.as_native().is_some() { "" } else { ", one request at a time" };
    eprintln!("serving {model_id} ({backend}{one_at_a_time}) on http://{}", listener.local_addr()?);
    let (cut_tx, cut) = tokio::sync::watch::channel(false);
    let limits = listen::Limits {
        max_connections: a.max_connections,
        header_timeout: std::time::Duration::from_secs(a.header_timeout as u64),
        body_timeout: std::time::Duration::from_secs(a.body_timeout as u64),
        drain_timeout: std::time::Duration::from_secs(a.shutdown_timeout),
    };
    let (jobs, queue) = std::sync::mpsc::sync_channel(a.max_queue);
    let (control, control_queue) = std::sync::mpsc::channel();
    let stats = Arc::new(Stats::default());
    let shared = Arc::new(Shared {
        model_id,
        created: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        jobs,
        control: std::sync::Mutex::new(control),
        adapters: RwLock::new(a.adapters.iter().cloned().collect()),
        allow_adapter_loading: a.allow_adapter_loading,
        adapter_roots,
        stats: stats.clone(),
        api_key,
        default_max_tokens: a.default_max_tokens,
        next_id: AtomicU64::new(1),
        backend,
        chat_defaults,
        responses: Default::default(),
        cut,
    });
    // HTTP on tokio's threads, once the engine is ready (connections wait in the listen backlog
    // until then); the model stays on this one (the evaluation thread).
    let (ready, engine_ready) = std::sync::mpsc::channel::<()>();
    let http = std::thread::Builder::new().name("rmlx-http".into()).spawn(move || -> Result<()> {
        if engine_ready.recv().is_err() {
            return Ok(()); // the engine did not start
        }
        let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener)?;
            listen::serve(listener, router(shared, limits.body_timeout), limits, cut_tx).await;
            Ok(())
        })
    })?;
    let Some(lm) = model.as_native() else {
        let _ = ready.send(());
        interface::run(model, queue, stats);
        return http.join().map_err(|_| anyhow::anyhow!("the HTTP thread panicked"))?;
    };
    let draft = a.speculative.load_draft(&a.model)?;
    let speculation = a.speculative.enabled().then(|| a.speculative.speculation(draft.as_ref()));
    if a.speculative.enabled() {
        let drafter = match &a.speculative.draft_model {
            Some(d) => format!("the draft model {}", d.display()),
            None => format!("prompt lookup (n-grams of up to {})", a.speculative.prompt_lookup.unwrap_or(3)),
        };
        eprintln!(
            "speculative decoding: {} tokens a step from {drafter}, while at most {} sequences run",
            a.speculative.num_draft_tokens, a.speculative_max_batch
        );
    }
    let (options, warm_up) = engine_options(&a, lm, Some(&stats));
    let start = engine::Start { adapters: a.adapters.clone(), warm_up, speculation, ready };
    let served = engine::run(lm, queue, control_queue, options, start, stats);
    if let Err(e) = served {
        // Only start-up can fail (loading the adapters, checked above, or the warm-up): nothing
        // was served.
        anyhow::bail!("starting the engine: {e}");
    }
    http.join().map_err(|_| anyhow::anyhow!("the HTTP thread panicked"))?
}

/// The engine's options from the flags and the model (every rank of a tensor-parallel model
/// derives the same ones), and whether it warms up first; with `stats`, the weights and the key
/// and value budget are recorded there and the derived budget is reported.
fn engine_options(a: &Args, lm: &rmlx_lm::LoadedModel, stats: Option<&Stats>) -> (EngineOptions, bool) {
    let context = a.context.or(lm.model.config().max_position_embeddings).unwrap_or(32768).max(1);
    let gb = |g: f64| (g.max(0.0) * 1e9) as usize;
    let weights: usize = {
        use rmlx_lm::nn::ModuleExt;
        lm.model.parameters("").iter().map(|(_, w)| w.nbytes()).sum()
    };
    let max_kv_bytes = match a.max_kv_gb {
        Some(g) => gb(g),
        None => {
            let derived = rmlx_lm::engine::device_kv_budget(weights, gb(a.prompt_cache_gb));
            if stats.is_some() {
                eprintln!(
                    "keys and values of the running batch: up to {:.2} GB (from the device's memory; --max-kv-gb sets it)",
                    derived as f64 / 1e9
                );
            }
            derived
        }
    };
    if let Some(stats) = stats {
        stats.weights_bytes.store(weights as u64, Ordering::Relaxed);
        stats.kv_budget.store(max_kv_bytes as u64, Ordering::Relaxed);
    }
    let options = EngineOptions {
        max_batch: a.max_batch,
        prefill_tokens: a.prefill_step,
        prefill_batch: a.prefill_batch,
        prompt_cache_bytes: gb(a.prompt_cache_gb),
        max_kv_bytes: Some(max_kv_bytes),
        context: Some(context),
        speculative_max_batch: a.speculative_max_batch,
        pipelined: a.pipelined_decode,
        // Checked when the server started.
        kv_quantization: a.kv_cache.quantization().unwrap_or(None),
        prompt_cache_dir: a
            .prompt_cache_dir
            .as_ref()
            .map(|dir| rmlx_lm::engine::PromptCacheDir { dir: dir.clone(), budget: gb(a.prompt_cache_dir_gb) as u64 }),
    };
    let warm_up = match a.warm_up.as_str() {
        "on" => true,
        "off" => false,
        _ => rmlx::default_device().kind == rmlx::DeviceType::Gpu,
    };
    (options, warm_up)
}

fn router(shared: Arc<Shared>, body_timeout: std::time::Duration) -> Router {
    Router::new()
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/v1/chat/completions", post(respond::chat))
        .route("/v1/completions", post(respond::completions))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/{id}", get(responses::retrieve))
        .route("/v1/load_lora_adapter", post(adapters::load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(adapters::unload_lora_adapter))
        .fallback(|| async { error(ApiError { status: 404, message: "no such endpoint".into(), param: None }) })
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .layer(axum::middleware::from_fn(move |r, next| listen::read_body(body_timeout, MAX_BODY, r, next)))
        .layer(axum::middleware::from_fn_with_state(shared.clone(), gate))
        .with_state(shared)
}

fn error(e: ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = (status, Json(e.body())).into_response();
    if e.status == 503 {
        response.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
    }
    response
}

/// `Authorization: Bearer KEY` against the server's key (the scheme's case does not matter, as
/// in HTTP), compared in constant time.
fn authorize(s: &Shared, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &s.api_key else { return Ok(()) };
    let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
        let (scheme, token) = v.trim().split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
    });
    let same = |g: &str| g.len() == key.len() && g.bytes().zip(key.bytes()).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0;
    match given {
        Some(g) if same(g) => Ok(()),
        _ => Err(ApiError {
            status: 401,
            message: "invalid or missing API key (Authorization: Bearer KEY)".into(),
            param: None,
        }),
    }
}

/// What every request passes before its handler reads the body: the API key (all but
/// `/health`), and a body that is not compressed (the server does not decompress).
async fn gate(State(s): State<Arc<Shared>>, request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    if request.uri().path() != "/health" {
        if let Err(e) = authorize(&s, request.headers()) {
            return error(e);
        }
    }
    if let Some(encoding) = request.headers().get(header::CONTENT_ENCODING) {
        if !encoding.as_bytes().eq_ignore_ascii_case(b"identity") {
            let message = format!(
                "Content-Encoding `{}` is not supported: send the body uncompressed",
                String::from_utf8_lossy(encoding.as_bytes())
            );
            return error(ApiError { status: 415, message, param: None });
        }
    }
    next.run(request).await
}

async fn models(State(s): State<Arc<Shared>>) -> Response {
    let mut base =
        json!({"id": s.model_id, "object": "model", "created": s.created, "owned_by": "rmlx", "backend": s.backend});
    if s.backend != rmlx_lm::backend::native::NAME {
        // Only the native engine batches: another backend answers one request at a time.
        base["max_concurrent_requests"] = json!(1);
    }
    let mut data = vec![base];
    for name in s.adapters.read().expect("adapter names").keys() {
        data.push(
            json!({"id": name, "object": "model", "created": s.created, "owned_by": "rmlx", "parent": s.model_id}),
        );
    }
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn metrics(State(s): State<Arc<Shared>>) -> String {
    let st = &s.stats;
    let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
    format!(
        "# TYPE rmlx_requests_total counter\nrmlx_requests_total {}\n\
         # TYPE rmlx_requests_failed_total counter\nrmlx_requests_failed_total {}\n\
         # TYPE rmlx_requests_cancelled_total counter\nrmlx_requests_cancelled_total {}\n\
         # TYPE rmlx_prompt_tokens_total counter\nrmlx_prompt_tokens_total {}\n\
         # TYPE rmlx_cached_prompt_tokens_total counter\nrmlx_cached_prompt_tokens_total {}\n\
         # TYPE rmlx_completion_tokens_total counter\nrmlx_completion_tokens_total {}\n\
         # TYPE rmlx_draft_tokens_total counter\nrmlx_draft_tokens_total {}\n\
         # TYPE rmlx_accepted_draft_tokens_total counter\nrmlx_accepted_draft_tokens_total {}\n\
         # TYPE rmlx_time_to_first_token_seconds_total counter\nrmlx_time_to_first_token_seconds_total {}\n\
         # TYPE rmlx_queue_length gauge\nrmlx_queue_length {}\n\
         # TYPE rmlx_batch_size gauge\nrmlx_batch_size {}\n\
         # TYPE rmlx_batch_size_peak gauge\nrmlx_batch_size_peak {}\n\
         # TYPE rmlx_peak_memory_bytes gauge\nrmlx_peak_memory_bytes {}\n\
         # TYPE rmlx_active_memory_bytes gauge\nrmlx_active_memory_bytes {}\n\
         # TYPE rmlx_kv_cache_bytes gauge\nrmlx_kv_cache_bytes {}\n\
         # TYPE rmlx_kv_budget_bytes gauge\nrmlx_kv_budget_bytes {}\n\
         # TYPE rmlx_prompt_cache_bytes gauge\nrmlx_prompt_cache_bytes {}\n\
         # TYPE rmlx_prompt_cache_disk_files gauge\nrmlx_prompt_cache_disk_files {}\n\
         # TYPE rmlx_prompt_cache_disk_bytes gauge\nrmlx_prompt_cache_disk_bytes {}\n\
         # HELP rmlx_memory_bytes MLX memory by what holds it: weights + kv_cache + prompt_cache + other_active = MLX's active memory; mlx_buffer_cache is freed buffers MLX keeps for reuse.\n\
         # TYPE rmlx_memory_bytes gauge\n\
         rmlx_memory_bytes{{kind=\"weights\"}} {}\n\
         rmlx_memory_bytes{{kind=\"kv_cache\"}} {}\n\
         rmlx_memory_bytes{{kind=\"prompt_cache\"}} {}\n\
         rmlx_memory_bytes{{kind=\"other_active\"}} {}\n\
         rmlx_memory_bytes{{kind=\"mlx_buffer_cache\"}} {}\n\
         # TYPE rmlx_resident_memory_bytes gauge\nrmlx_resident_memory_bytes {}\n",
        c(&st.requests),
        c(&st.failed),
        c(&st.cancelled),
        c(&st.prompt_tokens),
        c(&st.cached_tokens),
        c(&st.completion_tokens),
        c(&st.draft_tokens),
        c(&st.accepted_draft_tokens),
        c(&st.ttft_micros_total) as f64 / 1e6,
        st.queued.load(Ordering::Relaxed),
        st.running.load(Ordering::Relaxed),
        st.peak_batch.load(Ordering::Relaxed),
        c(&st.peak_memory),
        c(&st.active_memory),
        c(&st.kv_bytes),
        c(&st.kv_budget),
        c(&st.prompt_cache_bytes),
        c(&st.prompt_cache_disk_files),
        c(&st.prompt_cache_disk_bytes),
        c(&st.weights_bytes),
        c(&st.kv_bytes),
        c(&st.prompt_cache_bytes),
        c(&st.active_memory).saturating_sub(c(&st.weights_bytes) + c(&st.kv_bytes) + c(&st.prompt_cache_bytes)),
        c(&st.mlx_cache_bytes),
        resident_bytes(),
    )
}

/// The process's resident memory (Linux: /proc/self/statm; 0 elsewhere).
fn resident_bytes() -> u64 {
    let pages = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()))
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * page.max(0) as u64
}

/// The largest request body accepted (a prompt of a million tokens is about 4 MiB of text).
pub(super) const MAX_BODY: usize = 8 << 20;
