//! `rmlx generate`: one prompt, the completion streamed to stdout (or one JSON object).

use crate::common::{count, gb, positive, prompt_text, KvCacheArgs, ModelArgs, SamplingArgs, SpeculativeArgs};
use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use rmlx_lm::chat::Message;
use rmlx_lm::{GenerateOptions, Prompt};
use std::io::Write;

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
    /// Continue after the prompt cached in this file (`rmlx cache-prompt` or mlx-lm's
    /// `cache_prompt`): the prompt continues the cached user message (or, with --raw, the cached
    /// text). A file made for another model, dtype or adapter is refused.
    #[arg(long)]
    prompt_cache_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    speculative: SpeculativeArgs,
}

pub fn run(a: Args) -> Result<()> {
    let sampler = a.sampling.checked_config()?;
    let prompt_text = prompt_text(&a.prompt)?;
    let opts = GenerateOptions {
        max_tokens: a.max_tokens,
        sampler,
        stop_strings: a.stop.clone(),
        context_limit: a.context_limit,
        kv_quantization: a.kv_cache.quantization()?,
        ..GenerateOptions::default()
    };
    // A prompt-cache file holds the keys and values of its tokens, not the tokens: nothing a
    // drafter could read or a draft model could compute its own caches from.
    anyhow::ensure!(
        a.prompt_cache_file.is_none() || !a.speculative.enabled(),
        "--prompt-cache-file does not go with --draft-model or --prompt-lookup (the file holds no tokens to draft from)"
    );
    if let Some(file) = &a.prompt_cache_file {
        return after_cache(&a, file, &prompt_text, &opts);
    }
    if a.speculative.enabled() {
        return speculative(&a, &prompt_text, &opts);
    }
    let mut lm = a.model.open(&a.backend)?;
    let lm_backend = lm.info().backend;
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
    let tokens = generation.by_ref().map(|t| t.map_err(anyhow::Error::from));
    let (text, ids) = emit(&a, tokens)?;
    report(&a, &generation.metrics(), generation.finish_reason(), &text, &ids, lm_backend, None)
}

/// Generation after the caches of a prompt-cache file (rmlx's own model: the file holds its caches).
fn after_cache(a: &Args, file: &std::path::Path, prompt_text: &str, opts: &GenerateOptions) -> Result<()> {
    if a.backend == "mlx-lm" {
        anyhow::bail!("--prompt-cache-file runs on rmlx's own backend (--backend native or auto)");
    }
    let lm = a.model.load()?;
    let cached = rmlx_lm::cache::load_prompt_cache(file).with_context(|| format!("reading {}", file.display()))?;
    lm.check_prompt_cache(file, &cached, a.model.adapter_path.as_deref(), opts.kv_quantization.as_ref())?;
    if !cached.metadata.contains_key("rmlx.model") {
        let made_for = cached.metadata.get("model").map_or("an unnamed model", String::as_str);
        eprintln!("{}: made by mlx-lm for {made_for}: its shapes and dtype match this model", file.display());
    }
    let prompt = if a.raw {
        let ids = lm.tokenizer.encode(prompt_text, false)?;
        lm.vocab.check(&ids)?;
        ids
    } else {
        lm.prompt_after_cache(prompt_text, a.system.as_deref())?
    };
    let cached_tokens = cached.caches.first().map_or(0, |c| c.offset());
    let mut generation = lm.generate_after(cached.caches, &prompt, opts)?;
    let tokens = generation.by_ref().map(|t| t.map_err(anyhow::Error::from));
    let (text, ids) = emit(a, tokens)?;
    eprintln!("prompt cache: {cached_tokens} tokens from {}", file.display());
    report(a, generation.metrics(), generation.finish_reason(), &text, &ids, "native".into(), None)
}

/// Speculative decoding (rmlx's own backend: it checks drafts against the model's caches).
fn speculative(a: &Args, prompt_text: &str, opts: &GenerateOptions) -> Result<()> {
    if a.backend == "mlx-lm" {
        anyhow::bail!("--draft-model and --prompt-lookup run on rmlx's own backend (--backend native or auto)");
    }
    let lm = a.model.load()?;
    let draft = a.speculative.load_draft(&a.model)?;
    let prompt = lm.encode_prompt(prompt_text, a.raw, a.system.as_deref())?;
    let mut generation = lm.generate_speculative(&prompt, opts, a.speculative.speculation(draft.as_ref()))?;
    let tokens = generation.by_ref().map(|t| t.map_err(anyhow::Error::from));
    let (text, ids) = emit(a, tokens)?;
    let acc = generation.acceptance();
    if !a.json {
        eprintln!(
            "speculative decoding: {} of {} drafted tokens kept ({:.0} %), {} passes of the model for {} tokens",
            acc.accepted,
            acc.drafted,
            acc.rate() * 100.0,
            acc.steps,
            generation.metrics().generated_tokens
        );
    }
    let extra = serde_json::json!({"draft_tokens": acc.drafted, "accepted_draft_tokens": acc.accepted, "model_passes": acc.steps});
    report(a, generation.metrics(), generation.finish_reason(), &text, &ids, "native".into(), Some(extra))
}

/// Streams the tokens to stdout (unless `--json`); returns the text and ids.
fn emit(a: &Args, tokens: impl Iterator<Item = Result<rmlx_lm::Token>>) -> Result<(String, Vec<u32>)> {
    let (mut text, mut ids) = (String::new(), Vec::new());
    let mut out = std::io::stdout().lock();
    for token in tokens {
        let token = token?;
        ids.push(token.id);
        text.push_str(&token.text);
        if !a.json {
            out.write_all(token.text.as_bytes())?;
            out.flush()?;
        }
    }
    Ok((text, ids))
}

/// The JSON object (`--json`, with the fields of `extra` added) or the statistics line on stderr.
fn report(
    a: &Args,
    m: &rmlx_lm::Metrics,
    reason: Option<rmlx_lm::FinishReason>,
    text: &str,
    ids: &[u32],
    lm_backend: String,
    extra: Option<serde_json::Value>,
) -> Result<()> {
    let mut out = std::io::stdout().lock();
    if a.json {
        let mut obj = serde_json::json!({
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
        if let Some(serde_json::Value::Object(more)) = extra {
            obj.as_object_mut().expect("an object").extend(more);
        }
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
