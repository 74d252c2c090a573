//! LoRA adapters chosen per request: `--adapter NAME=PATH`, the `model` field's `NAME` or
//! `BASE:NAME`, and vLLM's `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (behind
//! `--allow-adapter-loading`), which hand the work to the generation loop and wait for its answer.

use super::api::ApiError;
use super::engine::Control;
use super::{error, Shared};
use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::path::PathBuf;
use std::sync::Arc;

/// `NAME=PATH` of `--adapter`.
pub fn named_path(s: &str) -> std::result::Result<(String, PathBuf), String> {
    match s.split_once('=') {
        Some((name, path)) if valid_adapter_name(name) && !path.is_empty() => Ok((name.to_string(), path.into())),
        _ => Err(format!("`{s}` is not NAME=PATH (a name of letters, digits, `-`, `_` and `.`, then a folder)")),
    }
}

pub fn valid_adapter_name(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
}

/// vLLM's `POST /v1/load_lora_adapter` body.
#[derive(serde::Deserialize)]
pub struct LoraRequest {
    lora_name: String,
    lora_path: Option<PathBuf>,
}

pub async fn load_lora_adapter(
    State(s): State<Arc<Shared>>,
    body: Result<Json<LoraRequest>, JsonRejection>,
) -> Response {
    let r = match adapter_request(&s, body) {
        Ok(r) => r,
        Err(e) => return error(e),
    };
    let Some(path) = r.lora_path else {
        return error(ApiError::bad_request("`lora_path` is missing", Some("lora_path")));
    };
    if !valid_adapter_name(&r.lora_name) || r.lora_name == s.model_id {
        let message = format!(
            "`{}` is not a usable adapter name (letters, digits, `-`, `_`, `.`; not the base model's)",
            r.lora_name
        );
        return error(ApiError::bad_request(message, Some("lora_name")));
    }
    if !s.adapter_roots.is_empty() {
        let inside = path.canonicalize().is_ok_and(|p| s.adapter_roots.iter().any(|root| p.starts_with(root)));
        if !inside {
            let message = "`lora_path` is not inside the folders this server loads adapters from (--adapter-dir)";
            return error(ApiError { status: 403, message: message.into(), param: Some("lora_path") });
        }
    }
    let (reply, answer) = tokio::sync::oneshot::channel();
    let name = r.lora_name.clone();
    let control = Control::Load { name: name.clone(), path: path.clone(), reply };
    match send_control(&s, control, answer).await {
        Ok(()) => {
            s.adapters.write().expect("adapter names").insert(name.clone(), path);
            format!("Success: LoRA adapter '{name}' added successfully.").into_response()
        }
        Err(e) => error(e),
    }
}

pub async fn unload_lora_adapter(
    State(s): State<Arc<Shared>>,
    body: Result<Json<LoraRequest>, JsonRejection>,
) -> Response {
    let r = match adapter_request(&s, body) {
        Ok(r) => r,
        Err(e) => return error(e),
    };
    if !s.adapters.read().expect("adapter names").contains_key(&r.lora_name) {
        let message = format!("no adapter named `{}` is loaded", r.lora_name);
        return error(ApiError { status: 404, message, param: Some("lora_name") });
    }
    let (reply, answer) = tokio::sync::oneshot::channel();
    match send_control(&s, Control::Unload { name: r.lora_name.clone(), reply }, answer).await {
        Ok(()) => {
            s.adapters.write().expect("adapter names").remove(&r.lora_name);
            format!("Success: LoRA adapter '{}' removed successfully.", r.lora_name).into_response()
        }
        Err(e) => error(e),
    }
}

/// The checks both adapter endpoints make (the key was checked before): enabled (404 otherwise,
/// as if absent), a well-formed body.
fn adapter_request(s: &Shared, body: Result<Json<LoraRequest>, JsonRejection>) -> Result<LoraRequest, ApiError> {
    if !s.allow_adapter_loading {
        let message = "no such endpoint (start the server with --allow-adapter-loading)".into();
        return Err(ApiError { status: 404, message, param: None });
    }
    body.map(|Json(r)| r).map_err(|e| ApiError::bad_request(e.body_text(), None))
}

/// Hands a control message to the generation loop and waits for its answer (400 with its reason).
async fn send_control(
    s: &Shared,
    control: Control,
    answer: tokio::sync::oneshot::Receiver<Result<(), String>>,
) -> Result<(), ApiError> {
    let stopped = || ApiError { status: 503, message: "the server is shutting down".into(), param: None };
    s.control.lock().expect("control queue").send(control).map_err(|_| stopped())?;
    match answer.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(reason)) => Err(ApiError::bad_request(reason, None)),
        Err(_) => Err(stopped()),
    }
}

/// The adapter a request's `model` names: `None` for the base model (or no `model`), the
/// adapter's name for `NAME` or `BASE:NAME`; 404 for anything else.
pub fn resolve_model(s: &Shared, model: Option<&str>) -> Result<Option<String>, ApiError> {
    let Some(m) = model else { return Ok(None) };
    if m == s.model_id {
        return Ok(None);
    }
    let name = m.strip_prefix(&format!("{}:", s.model_id)).unwrap_or(m);
    let adapters = s.adapters.read().expect("adapter names");
    if adapters.contains_key(name) {
        return Ok(Some(name.to_string()));
    }
    let known: Vec<&str> = std::iter::once(s.model_id.as_str()).chain(adapters.keys().map(String::as_str)).collect();
    Err(ApiError {
        status: 404,
        message: format!(
            "model `{m}` does not exist; this server has {}",
            known.iter().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ")
        ),
        param: Some("model"),
    })
}
