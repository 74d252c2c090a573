//! A generation streaming from the bridge: token lines until `done`, stop strings applied here,
//! cancel sent to the bridge, and its lines drained when the stream ends early.

use super::process::{backend_error, check};
use super::{finish_from, metrics_from, MlxLmModel};
use crate::backend::TokenStream;
use crate::generate::{CancelHandle, FinishReason, Metrics, Token};
use crate::text_stream::StopFilter;
use crate::{Error, Result};
use serde_json::{json, Value};

/// A generation streaming from the bridge.
pub(super) struct BridgeStream<'a> {
    model: &'a mut MlxLmModel,
    id: u64,
    cancel: CancelHandle,
    cancel_sent: bool,
    stop: StopFilter,
    finish: Option<FinishReason>,
    metrics: Metrics,
}

impl<'a> BridgeStream<'a> {
    /// The stream of request `id`, just sent to `model`'s bridge.
    pub(super) fn new(model: &'a mut MlxLmModel, id: u64, stop_strings: Vec<String>) -> Self {
        BridgeStream {
            model,
            id,
            cancel: CancelHandle::default(),
            cancel_sent: false,
            stop: StopFilter::new(stop_strings),
            finish: None,
            metrics: Metrics::default(),
        }
    }

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
