//! The bridge process: where mlx-lm and the script live in the cache, installing mlx-lm, starting
//! the script and talking to it line by line with timeouts.

use super::{MlxLmBackend, BRIDGE_SCRIPT, MLX_LM_VERSION, MLX_VERSION, NAME};
use crate::cache_dir::cache_dir;
use crate::{Error, Result};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// Where [`install`] puts mlx-lm: a pip `--target` folder in the per-user cache.
pub fn install_dir() -> PathBuf {
    cache_dir().join(format!("mlx-lm-{MLX_LM_VERSION}"))
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
    let path = cache_dir().join("bridge").join(format!("mlx_lm_bridge-{hash:016x}.py"));
    if !path.is_file() {
        let dir = path.parent().expect("has a parent");
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        std::fs::write(&tmp, BRIDGE_SCRIPT).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
    }
    Ok(path)
}

pub(super) fn backend_error(message: impl Into<String>) -> Error {
    Error::Backend { backend: NAME.into(), message: message.into() }
}

/// A running bridge: its stdin, and its stdout lines read on a thread (so that waiting can time out).
pub(super) struct Process {
    pub(super) child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    next_id: u64,
    /// The `ready` line.
    ready: Value,
}

impl Process {
    pub(super) fn start(backend: &MlxLmBackend) -> Result<Process> {
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
    pub(super) fn send(&mut self, mut request: Value) -> Result<u64> {
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
    pub(super) fn recv(&mut self, timeout: Duration) -> Result<Value> {
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
    pub(super) fn reply(&mut self, id: u64, timeout: Duration) -> Result<Value> {
        loop {
            let v = self.recv(timeout)?;
            if v.get("id").and_then(Value::as_u64) == Some(id) {
                return check(v);
            }
        }
    }

    pub(super) fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub(super) fn kill(&mut self) {
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
pub(super) fn check(v: Value) -> Result<Value> {
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
