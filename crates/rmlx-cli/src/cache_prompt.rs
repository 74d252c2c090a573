//! `rmlx cache-prompt`: a prompt run through the model once and its key/value caches written to a
//! file in mlx-lm's format (`mlx_lm.cache_prompt`'s flags), for `rmlx generate` or mlx-lm's
//! `generate` to continue with `--prompt-cache-file`.

use crate::common::{gb, positive, prompt_text, KvCacheArgs, ModelArgs};
use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use rmlx_lm::GenerateOptions;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt to cache; `-` reads it from stdin. With a chat template it becomes the start of
    /// the user message, which the prompt of `generate --prompt-cache-file` continues.
    #[arg(long, short)]
    prompt: String,
    /// The file to write (safetensors, mlx-lm's prompt-cache format).
    #[arg(long)]
    prompt_cache_file: PathBuf,
    #[command(flatten)]
    kv_cache: KvCacheArgs,
    /// Keep at most this many positions in the KV cache (rotating; mlx-lm's --max-kv-size).
    #[arg(long, alias = "max-kv-size", value_parser = positive)]
    context_limit: Option<usize>,
    /// Encode the prompt as-is (default special tokens) instead of the chat template.
    #[arg(long)]
    raw: bool,
    /// System message (chat template only).
    #[arg(long)]
    system: Option<String>,
    /// Print one JSON object (file, tokens, time, peak memory) on stdout.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let text = prompt_text(&a.prompt)?;
    let lm = a.model.load()?;
    let folder = |p: &std::path::Path| p.canonicalize().ok();
    let target_dir =
        a.prompt_cache_file.parent().map(|d| if d.as_os_str().is_empty() { std::path::Path::new(".") } else { d });
    if lm.source.is_dir() && target_dir.and_then(folder) == folder(&lm.source) {
        anyhow::bail!(
            "--prompt-cache-file {}: inside the model's folder, where loading the model would read it as weights",
            a.prompt_cache_file.display()
        );
    }
    let prompt = match a.raw {
        true => lm.encode_prompt(&text, true, None)?,
        false => lm.open_user_prompt(&text, a.system.as_deref())?,
    };
    let opts = GenerateOptions {
        context_limit: a.context_limit,
        kv_quantization: a.kv_cache.quantization()?,
        ..GenerateOptions::default()
    };
    let start = Instant::now();
    let mut progress = |done: usize, total: usize| {
        let speed = done as f64 / start.elapsed().as_secs_f64().max(1e-9);
        eprint!("\rprocessed {done:6} of {total} tokens ({speed:.1} tokens/s)");
        let _ = std::io::stderr().flush();
    };
    let caches = lm.cache_prompt(&prompt, &opts, &mut progress)?;
    eprintln!();
    let seconds = start.elapsed().as_secs_f64();
    let peak = rmlx::memory::peak_memory();
    let mut metadata = lm.prompt_cache_metadata(a.model.adapter_path.as_deref())?;
    // The cached tokens, for `chat --prompt-cache-file` (mlx-lm ignores the key).
    metadata.insert("rmlx.tokens".into(), serde_json::to_string(&prompt)?);
    rmlx_lm::cache::save_prompt_cache(&a.prompt_cache_file, &caches, &metadata)
        .with_context(|| format!("writing {}", a.prompt_cache_file.display()))?;
    let bytes = std::fs::metadata(&a.prompt_cache_file).map(|m| m.len()).unwrap_or(0);
    if a.json {
        let obj = serde_json::json!({
            "prompt_cache_file": a.prompt_cache_file.display().to_string(),
            "prompt_tokens": prompt.len(),
            "seconds": seconds,
            "file_bytes": bytes,
            "peak_memory_gb": gb(peak),
        });
        println!("{obj}");
    } else {
        eprintln!(
            "cached {} tokens in {:.2} s into {} ({:.1} MB) | peak memory: {:.3} GB",
            prompt.len(),
            seconds,
            a.prompt_cache_file.display(),
            bytes as f64 / 1e6,
            gb(peak)
        );
    }
    Ok(())
}
