//! `rmlx chat`: an interactive conversation that keeps its history. Commands: `/reset` forgets the
//! conversation, `/stats` toggles speed statistics after each reply, `/exit` (or end of input) quits.

use crate::common::{gb, ModelArgs, SamplingArgs};
use anyhow::Result;
use clap::Args as ClapArgs;
use rmlx_lm::chat::Message;
use rmlx_lm::GenerateOptions;
use std::io::{BufRead, Write};

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Most tokens per reply.
    #[arg(long, short = 'm', default_value_t = 512)]
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
    let lm = a.model.load()?;
    let opts = GenerateOptions { max_tokens: a.max_tokens, sampler: a.sampling.config(), ..GenerateOptions::default() };
    let start: Vec<Message> = a.system.iter().map(|s| Message::system(s.as_str())).collect();
    let mut messages = start.clone();
    let mut stats = a.stats;
    eprintln!("chatting with {} — /reset, /stats, /exit", lm.source.display());
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    loop {
        eprint!(">> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
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
        let prompt = match lm.chat_prompt(&messages) {
            Ok(p) => p,
            Err(e) => {
                messages.pop();
                eprintln!("error: {e}");
                continue;
            }
        };
        let mut generation = lm.generate(&prompt, &opts)?;
        let mut reply = String::new();
        for token in generation.by_ref() {
            let token = token?;
            reply.push_str(&token.text);
            out.write_all(token.text.as_bytes())?;
            out.flush()?;
        }
        writeln!(out)?;
        let m = generation.metrics();
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
        messages.push(Message::assistant(reply.trim()));
    }
    Ok(())
}
