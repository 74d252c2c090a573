//! `rmlx chat`: an interactive conversation that keeps its history. Commands: `/reset` forgets the
//! conversation, `/stats` toggles speed statistics after each reply, `/exit` (or end of input) quits.
//!
//! A message that cannot be used (not UTF-8, longer than the context, a template error, a failure
//! while generating) prints an error line and the session goes on without it. Ctrl-C stops the
//! reply being generated; at the prompt it ends the session (see [`crate::interrupt`]).

use crate::common::{count, gb, ModelArgs, SamplingArgs};
use crate::interrupt::{self, Replying};
use anyhow::Result;
use clap::Args as ClapArgs;
use rmlx_lm::chat::Message;
use rmlx_lm::{FinishReason, GenerateOptions, LoadedModel, Metrics};
use std::io::{BufRead, Write};

#[derive(ClapArgs, Debug)]
#[command(allow_negative_numbers = true)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
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
}

pub fn run(a: Args) -> Result<()> {
    let sampler = a.sampling.checked_config()?;
    let lm = a.model.load()?;
    let opts = GenerateOptions { max_tokens: a.max_tokens, sampler, ..GenerateOptions::default() };
    interrupt::install()?;
    let start: Vec<Message> = a.system.iter().map(|s| Message::system(s.as_str())).collect();
    let mut messages = start.clone();
    let mut stats = a.stats;
    eprintln!("chatting with {} — /reset, /stats, /exit; Ctrl-C stops a reply", lm.source.display());
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
        match reply(&lm, &messages, &opts, &mut out) {
            Ok((text, m)) => {
                if stats {
                    eprintln!(
                        "[prompt {} tokens at {:.1} tok/s, reply {} tokens at {:.1} tok/s, peak {:.3} GB]",
                        m.prompt_tokens,
                        m.prompt_tps(),
                        m.generated_tokens,
                        m.generation_tps(),
                        gb(m.peak_memory)
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

/// Generates and streams the reply to `messages`; returns its text (what was shown, also when
/// Ctrl-C stopped it) and the metrics.
fn reply(
    lm: &LoadedModel,
    messages: &[Message],
    opts: &GenerateOptions,
    out: &mut impl Write,
) -> Result<(String, Metrics)> {
    let prompt = lm.chat_prompt(messages)?;
    let _replying = Replying::start();
    let mut generation = lm.generate(&prompt, opts)?;
    let cancel = generation.cancel_handle();
    let mut text = String::new();
    let mut failed = None;
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
            cancel.cancel();
        }
    }
    if !text.is_empty() || generation.finish_reason() == Some(FinishReason::Cancelled) {
        writeln!(out)?;
    }
    if let Some(e) = failed {
        return Err(e.into());
    }
    if generation.finish_reason() == Some(FinishReason::Cancelled) {
        eprintln!("(reply stopped)");
    }
    Ok((text, generation.metrics().clone()))
}
