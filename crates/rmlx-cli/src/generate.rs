//! `rmlx generate`: one prompt, the completion streamed to stdout (or one JSON object).

use crate::common::{count, gb, positive, KvCacheArgs, ModelArgs, SamplingArgs};
use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use rmlx_lm::chat::Message;
use rmlx_lm::{GenerateOptions, Prompt};
use std::io::{Read, Write};

#[derive(ClapArgs, Debug)]
#[command(allow_negative_numbers = true)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt; `-` reads it from stdin.
    #[arg(long, short)]
    prompt: String,
    /// Most tokens to generate (0: none).
    #[arg(long, short = 'm', default_value_t = 256, value_parser = count)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    kv_cache: KvCacheArgs,
    /// Encode the prompt as-is (default special tokens) instead of applying the chat template.
    #[arg(long)]
    raw: bool,
    /// System message (chat template only).
    #[arg(long)]
    system: Option<String>,
    /// Stop when this string is generated (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Keep at most this many positions in the KV cache (rotating); the prompt must fit.
    #[arg(long, value_parser = positive)]
    context_limit: Option<usize>,
    /// Print one JSON object with the text, token ids and statistics instead of streaming.
    #[arg(long)]
    json: bool,
    /// Who runs the model: `native` (rmlx), `mlx-lm` (Python's mlx-lm in a subprocess), or
    /// `auto` (native when it has the architecture, else mlx-lm).
    #[arg(long, default_value = "auto")]
    backend: String,
}

pub fn run(a: Args) -> Result<()> {
    let sampler = a.sampling.checked_config()?;
    let prompt_text = if a.prompt == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).context("reading the prompt from stdin")?;
        s
    } else {
        a.prompt.clone()
    };
    let mut lm = a.model.open(&a.backend)?;
    let lm_backend = lm.info().backend;
    let opts = GenerateOptions {
        max_tokens: a.max_tokens,
        sampler,
        stop_strings: a.stop.clone(),
        context_limit: a.context_limit,
        kv_quantization: a.kv_cache.quantization()?,
        ..GenerateOptions::default()
    };
    let mut generation = if a.raw {
        lm.generate(&Prompt::Text(prompt_text), &opts)?
    } else {
        let mut messages = Vec::new();
        if let Some(s) = &a.system {
            messages.push(Message::system(s));
        }
        messages.push(Message::user(prompt_text.as_str()));
        lm.chat(&messages, &opts)?
    };
    let (mut text, mut ids) = (String::new(), Vec::new());
    let mut out = std::io::stdout().lock();
    for token in generation.by_ref() {
        let token = token?;
        ids.push(token.id);
        text.push_str(&token.text);
        if !a.json {
            out.write_all(token.text.as_bytes())?;
            out.flush()?;
        }
    }
    let m = generation.metrics();
    let reason = generation.finish_reason();
    if a.json {
        let obj = serde_json::json!({
            "text": text,
            "token_ids": ids,
            "prompt_tokens": m.prompt_tokens,
            "generation_tokens": m.generated_tokens,
            "prompt_tps": m.prompt_tps(),
            "generation_tps": m.generation_tps(),
            "ttft_ms": m.time_to_first_token.as_secs_f64() * 1e3,
            "peak_memory_gb": gb(m.peak_memory),
            "finish_reason": reason.map(|r| r.as_str()),
            "backend": lm_backend,
        });
        writeln!(out, "{obj}")?;
    } else {
        writeln!(out)?;
        eprintln!(
            "prompt: {} tokens, {:.1} tokens/s | generation: {} tokens, {:.1} tokens/s | peak memory: {:.3} GB",
            m.prompt_tokens,
            m.prompt_tps(),
            m.generated_tokens,
            m.generation_tps(),
            gb(m.peak_memory)
        );
    }
    Ok(())
}
