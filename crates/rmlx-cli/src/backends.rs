//! `rmlx backends`: the inference backends, whether each can run here, and the installation of
//! the mlx-lm one into the per-user cache.

use anyhow::Result;
use clap::Args as ClapArgs;
use rmlx_lm::backend::mlx_lm::{self, MlxLmBackend};
use std::io::Write;

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Install mlx-lm (the pinned version, with MLX) into the per-user cache first.
    #[arg(long)]
    install_mlx_lm: bool,
    /// Check a model folder or GGUF file: which backends support it, and why not.
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// One JSON object on stdout.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let python = MlxLmBackend::default().python;
    if a.install_mlx_lm {
        let dir = mlx_lm::install(&python)?;
        eprintln!("mlx-lm {} is in {}", mlx_lm::MLX_LM_VERSION, dir.display());
    }
    let mut rows = Vec::new();
    for b in rmlx_lm::backend::backends() {
        let verdict = a.model.as_ref().map(|m| b.supports(m));
        rows.push(serde_json::json!({
            "name": b.name(),
            "supports_model": verdict.as_ref().map(|v| v.is_ok()),
            "why_not": verdict.and_then(|v| v.err()),
        }));
    }
    let ready = mlx_lm::probe(&MlxLmBackend::default());
    if a.json {
        let obj = serde_json::json!({
            "backends": rows,
            "mlx_lm": match &ready {
                Ok(r) => serde_json::json!({"available": true, "version": r["mlx_lm_version"], "python": python}),
                Err(e) => serde_json::json!({"available": false, "error": e, "python": python}),
            },
        });
        writeln!(std::io::stdout().lock(), "{obj}")?;
        return Ok(());
    }
    for r in &rows {
        let name = r["name"].as_str().unwrap_or("");
        let state = match name {
            "mlx-lm" => match &ready {
                Ok(r) => {
                    format!("available (mlx-lm {}, {})", r["mlx_lm_version"].as_str().unwrap_or("?"), python.display())
                }
                Err(e) => format!("not available: {e}"),
            },
            _ => "available".to_string(),
        };
        println!("{name:<8} {state}");
        if let Some(ok) = r["supports_model"].as_bool() {
            let why = r["why_not"].as_str().map(|w| format!(" ({w})")).unwrap_or_default();
            println!("         {}{why}", if ok { "supports the model" } else { "does not support the model" });
        }
    }
    Ok(())
}
