//! `rmlx chat`: an interactive conversation that keeps its history. Commands: `/reset` forgets the
//! conversation, `/stats` toggles speed statistics after each reply, `/exit` (or end of input) quits.
//!
//! The conversation's keys and values are kept between turns (the engine's prompt cache): a
//! reply costs the new message's tokens, not the whole history again. With `--draft-model` or
//! `--prompt-lookup`, replies are decoded speculatively, the model's and the draft's caches kept
//! between turns the same way.
//!
//! A message that cannot be used (not UTF-8, longer than the context, a template error, a failure
//! while generating) prints an error line and the session goes on without it. Ctrl-C stops the
//! reply being generated; at the prompt it ends the session (see [`crate::interrupt`]).

use crate::common::{count, gb, KvCacheArgs, ModelArgs, SamplingArgs, SpeculativeArgs};
use crate::interrupt::{self, Replying};
use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use rmlx_lm::chat::Message;
use rmlx_lm::engine::{Engine, EngineOptions, Lockstep, Request, Update, Usage};
use rmlx_lm::{FinishReason, GenerateOptions, LanguageModel, LoadedModel};
use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

#[derive(ClapArgs, Debug)]
#[command(allow_negative_numbers = true)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    kv_cache: KvCacheArgs,
    /// Most tokens per reply.
    #[arg(long, short = 'm', default_value_t = 512, value_parser = count)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// System message at the start of the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Print statistics after each reply.
    #[arg(long)]
    stats: bool,
    /// Who runs the model: `native`, `mlx-lm` or `auto` (native when it has the architecture).
    /// Only the native backend keeps the conversation's keys and values between turns.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Start after the prompt cached in this file by `rmlx cache-prompt` (a document, a long
    /// system prompt): the first message continues the cached user message; `/reset` goes back
    /// to it.
    #[arg(long)]
    prompt_cache_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    speculative: SpeculativeArgs,
}

pub fn run(a: Args) -> Result<()> {
    let sampler = a.sampling.checked_config()?;
    anyhow::ensure!(
        a.prompt_cache_file.is_none() || a.backend != "mlx-lm",
        "--prompt-cache-file runs on rmlx's own backend (--backend native or auto)"
    );
    let mut model = a.model.open(&a.backend)?;
    let kv_quantization = a.kv_cache.quantization()?;
    let opts = GenerateOptions { max_tokens: a.max_tokens, sampler, kv_quantization, ..GenerateOptions::default() };
    interrupt::install()?;
    let info = model.info();
    eprintln!(
        "chatting with {} ({}) — /reset, /stats, /exit; Ctrl-C stops a reply",
        info.source.display(),
        info.backend
    );
    if a.speculative.enabled() {
        anyhow::ensure!(a.prompt_cache_file.is_none(), "--prompt-cache-file does not go with speculative decoding yet");
        let Some(lm) = model.as_native() else {
            anyhow::bail!("--draft-model and --prompt-lookup run on rmlx's own backend (--backend native or auto)");
        };
        anyhow::ensure!(lm.ranks().is_none(), "speculative decoding needs the model on one device");
        let draft = a.speculative.load_draft(&a.model)?;
        // The conversation's keys and values, the model's and the draft's, kept between turns.
        let mut state = None;
        return converse(&a, &mut |messages, out| {
            let prompt = lm.chat_prompt(messages)?;
            let speculation = a.speculative.speculation(draft.as_ref());
            let generation = match state.take() {
                Some(s) => lm.generate_speculative_after(s, &prompt, &opts, speculation)?,
                None => lm.generate_speculative(&prompt, &opts, speculation)?,
            };
            let (replied, next) = reply_speculative(generation, out)?;
            state = Some(next);
            Ok(replied)
        });
    }
    if let Some(lm) = model.as_native() {
        // One sequence at a time; the prompt cache holds the conversation so far.
        let mut engine = Engine::new(lm, EngineOptions { max_batch: 1, kv_quantization, ..EngineOptions::default() });
        let cached = match &a.prompt_cache_file {
            Some(file) => Some(seed(&a, lm, &mut engine, file, kv_quantization.as_ref())?),
            None => None,
        };
        // Over the ranks of a split model, rank 0 converses; the others compute their share of
        // every step it decides, and leave Ctrl-C to it.
        if let Some(ranks) = lm.ranks().filter(|r| r.rank() != 0) {
            interrupt::ignore()?;
            return Ok(Lockstep::follow(engine, ranks)?);
        }
        let mut engine = Lockstep::new(engine, lm.ranks().cloned());
        let talked = converse(&a, &mut |messages, out| {
            let prompt = match &cached {
                // After the cached tokens, from the first user message's text on.
                Some(tokens) => {
                    let first = messages.iter().position(|m| m.role == "user").unwrap_or(0);
                    let rest = lm.chat_prompt_after_cache(messages, first)?;
                    tokens.iter().chain(&rest).copied().collect()
                }
                None => lm.chat_prompt(messages)?,
            };
            reply(&mut engine, prompt, &opts, out)
        });
        engine.stop()?;
        talked
    } else {
        converse(&a, &mut |messages, out| reply_streamed(model.as_mut(), messages, &opts, out))
    }
}

/// What answers a turn: streams the reply to `messages` into the writer.
type Replier<'a> = dyn FnMut(&[Message], &mut std::io::Stdout) -> Result<(String, Usage, Duration)> + 'a;

/// The conversation loop: reads messages and commands, and prints the replies.
fn converse(a: &Args, reply: &mut Replier<'_>) -> Result<()> {
    let start: Vec<Message> = a.system.iter().map(|s| Message::system(s.as_str())).collect();
    let mut messages = start.clone();
    let mut stats = a.stats;
    let mut stdin = std::io::stdin().lock();
    let mut out = std::io::stdout();
    loop {
        eprint!(">> ");
        let mut raw = Vec::new();
        if stdin.read_until(b'\n', &mut raw)? == 0 {
            break;
        }
        let Ok(line) = String::from_utf8(raw) else {
            eprintln!("error: the message is not valid UTF-8; it was ignored");
            continue;
        };
        let line = line.trim();
        match line {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages = start.clone();
                eprintln!("(conversation reset)");
                continue;
            }
            "/stats" => {
                stats = !stats;
                eprintln!("(statistics {})", if stats { "on" } else { "off" });
                continue;
            }
            _ => {}
        }
        messages.push(Message::user(line));
        match reply(&messages, &mut out) {
            Ok((text, usage, decode_time)) => {
                if stats {
                    let ttft = usage.time_to_first_token.unwrap_or_default().as_secs_f64().max(1e-9);
                    let computed = usage.prompt_tokens - usage.cached_tokens;
                    let decoded = usage.completion_tokens.saturating_sub(1) as f64;
                    eprintln!(
                        "[prompt {} tokens ({} from the cache) at {:.1} tok/s, reply {} tokens at {:.1} tok/s, peak {:.3} GB]",
                        usage.prompt_tokens,
                        usage.cached_tokens,
                        computed as f64 / ttft,
                        usage.completion_tokens,
                        decoded / decode_time.as_secs_f64().max(1e-9),
                        gb(rmlx::memory::peak_memory())
                    );
                }
                messages.push(Message::assistant(text.trim()));
            }
            Err(e) => {
                messages.pop();
                eprintln!("error: {e:#}");
            }
        }
    }
    Ok(())
}

/// Reads a prompt-cache file of `rmlx cache-prompt`, checks it against the model and puts it in
/// the engine's prompt cache; returns its tokens.
fn seed(
    a: &Args,
    lm: &LoadedModel,
    engine: &mut Engine,
    file: &std::path::Path,
    kv: Option<&rmlx_lm::KvQuantization>,
) -> Result<Vec<u32>> {
    let cached = rmlx_lm::cache::load_prompt_cache(file).with_context(|| format!("reading {}", file.display()))?;
    lm.check_prompt_cache(file, &cached, a.model.adapter_path.as_deref(), kv)?;
    let tokens: Vec<u32> = match cached.metadata.get("rmlx.tokens") {
        Some(t) => serde_json::from_str(t).with_context(|| format!("{}: its token list", file.display()))?,
        None => anyhow::bail!(
            "{}: holds no token list (mlx-lm's files do not); `rmlx generate --prompt-cache-file` continues it",
            file.display()
        ),
    };
    if !engine.seed_prompt_cache(tokens.clone(), &cached.caches)? {
        eprintln!("{}: larger than the prompt cache; its prompt is computed again", file.display());
    }
    eprintln!("prompt cache: {} tokens from {}", tokens.len(), file.display());
    Ok(tokens)
}

/// A reply through the backend-neutral interface (the mlx-lm backend): the whole conversation
/// is the prompt each turn.
fn reply_streamed(
    lm: &mut dyn LanguageModel,
    messages: &[Message],
    opts: &GenerateOptions,
    out: &mut impl Write,
) -> Result<(String, Usage, Duration)> {
    let _replying = Replying::start();
    let mut stream = lm.chat(messages, opts)?;
    let cancel = stream.cancel_handle();
    let mut text = String::new();
    for token in stream.by_ref() {
        let token = match token {
            Ok(t) => t,
            Err(e) => {
                if !text.is_empty() {
                    writeln!(out)?;
                }
                return Err(e.into());
            }
        };
        text.push_str(&token.text);
        out.write_all(token.text.as_bytes())?;
        out.flush()?;
        if interrupt::requested() {
            cancel.cancel();
        }
    }
    let m = stream.metrics();
    let reason = stream.finish_reason();
    if !text.is_empty() || reason == Some(FinishReason::Cancelled) {
        writeln!(out)?;
    }
    if reason == Some(FinishReason::Cancelled) {
        eprintln!("(reply stopped)");
    }
    let usage = Usage {
        prompt_tokens: m.prompt_tokens,
        cached_tokens: 0,
        completion_tokens: m.generated_tokens,
        time_to_first_token: Some(m.time_to_first_token),
        ..Usage::default()
    };
    Ok((text, usage, m.decode_time))
}

/// Streams a speculative generation's reply; returns it as [`reply`] does, and the caches for the
/// next turn. Ctrl-C stops it.
fn reply_speculative(
    mut generation: rmlx_lm::speculative::SpeculativeGeneration<'_>,
    out: &mut impl Write,
) -> Result<((String, Usage, Duration), rmlx_lm::speculative::SpeculativeState)> {
    let _replying = Replying::start();
    let mut text = String::new();
    let mut failed = None;
    let mut stopped = false;
    for token in generation.by_ref() {
        match token {
            Ok(t) => {
                text.push_str(&t.text);
                out.write_all(t.text.as_bytes())?;
                out.flush()?;
            }
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
        if interrupt::requested() {
            stopped = true;
            break;
        }
    }
    if !text.is_empty() || stopped {
        writeln!(out)?;
    }
    if stopped {
        eprintln!("(reply stopped)");
    }
    if let Some(e) = failed {
        return Err(e.into());
    }
    let m = generation.metrics().clone();
    let usage = Usage {
        prompt_tokens: m.prompt_tokens,
        cached_tokens: generation.cached_tokens(),
        completion_tokens: m.generated_tokens,
        time_to_first_token: Some(m.time_to_first_token),
        draft_tokens: generation.acceptance().drafted,
        accepted_draft_tokens: generation.acceptance().accepted,
    };
    Ok(((text, usage, m.decode_time), generation.into_state()))
}

/// Generates and streams the reply to `prompt` (a conversation's); returns its text (what was shown, also when
/// Ctrl-C stopped it), the token counts and the time from the first token to the last.
fn reply(
    engine: &mut Lockstep,
    prompt: Vec<u32>,
    opts: &GenerateOptions,
    out: &mut impl Write,
) -> Result<(String, Usage, Duration)> {
    let _replying = Replying::start();
    let seq = engine.submit(Request { prompt, options: opts.clone(), ..Default::default() })?;
    let mut text = String::new();
    let mut first: Option<Instant> = None;
    let mut last = Instant::now();
    let mut cancelled = false;
    let (reason, usage) = 'run: loop {
        let updates = match engine.step() {
            Ok(u) => u,
            Err(e) => {
                engine.abort();
                if !text.is_empty() {
                    writeln!(out)?;
                }
                return Err(e.into());
            }
        };
        for u in updates {
            match u {
                Update::Token { text: t, .. } | Update::Text { text: t, .. } => {
                    last = Instant::now();
                    first.get_or_insert(last);
                    text.push_str(&t);
                    out.write_all(t.as_bytes())?;
                    out.flush()?;
                }
                Update::Finished { reason, usage, .. } => break 'run (reason, usage),
                Update::Failed { error, .. } => {
                    if !text.is_empty() {
                        writeln!(out)?;
                    }
                    return Err(error.into());
                }
                Update::Started { .. } => {}
            }
        }
        if interrupt::requested() && !cancelled {
            engine.cancel(seq);
            cancelled = true;
        }
    };
    if !text.is_empty() || reason == FinishReason::Cancelled {
        writeln!(out)?;
    }
    if reason == FinishReason::Cancelled {
        eprintln!("(reply stopped)");
    }
    Ok((text, usage, first.map_or(Duration::ZERO, |f| last - f)))
}
