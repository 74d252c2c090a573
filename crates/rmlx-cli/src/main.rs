//! `rmlx`: generate, chat, perplexity, bench, fine-tune and serve large language models on MLX.
//!
//! Text goes to stdout, progress, statistics and errors to stderr; `--json` prints one
//! machine-readable object to stdout instead of the text.

mod backends;
mod batch;
mod bench;
mod bench_batch;
mod bench_collective;
mod bench_kernels;
mod cache_prompt;
mod chat;
mod common;
mod convert;
mod fuse;
mod generate;
mod inspect;
mod interrupt;
mod launch;
mod lora;
mod lora_config;
mod parallel;
mod perplexity;
mod serve;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

/// Large language models on MLX (CUDA, CPU, Metal).
#[derive(Parser)]
#[command(name = "rmlx", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt (streamed to stdout).
    Generate(generate::Args),
    /// Chat interactively (/reset, /stats, /exit).
    Chat(chat::Args),
    /// Perplexity of a text file under the model.
    Perplexity(perplexity::Args),
    /// Prefill and decode speed with the protocol of mlx-lm's peer benchmark.
    Bench(bench::Args),
    /// Classification and batch-generation throughput of a backend (native or mlx-lm).
    BenchBatch(bench_batch::Args),
    /// How fast the quantised matrix-vector products of a decoding step read their weights
    /// (rmlx's kernels and MLX's), beside the copy bandwidth.
    BenchKernels(bench_kernels::Args),
    /// Fine-tune LoRA adapters (--train) and test them (--test), with mlx_lm.lora's flags.
    Lora(lora::Args),
    /// Merge LoRA adapters into the base weights and write a Hugging Face folder.
    Fuse(fuse::Args),
    /// Run a prompt once and write its key/value caches to a file (mlx-lm's prompt-cache format)
    /// that `generate --prompt-cache-file` continues.
    CachePrompt(cache_prompt::Args),
    /// Convert a Hugging Face folder or GGUF file to an MLX folder: quantise (-q, mlx_lm.convert's
    /// flags), dequantise (-d) or cast (--dtype).
    Convert(convert::Args),
    /// Serve the model over HTTP with OpenAI's API (chat and text completions, streamed or not).
    Serve(serve::Args),
    /// Complete every prompt of a jsonl file, batched (or, with --classify, report each prompt's
    /// next-token distribution); one jsonl result per prompt.
    Batch(batch::Args),
    /// The post-RoPE attention keys of every layer after a prompt, to safetensors or .npy.
    Inspect(inspect::Args),
    /// The inference backends (native, mlx-lm) and whether each can run here or a given model.
    Backends(backends::Args),
    /// Start an rmlx command as several ranks, on this machine or the hosts of a hostfile (MLX's
    /// ring or NCCL), each rank's output prefixed, all stopped when one fails.
    Launch(launch::Args),
    /// Time MLX's all-sum between the ranks of a launched job, per message size.
    BenchCollective(bench_collective::Args),
}

fn main() {
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // `rmlx lora -c` needs to know which flags were given on the command line.
    let lora_matches = matches.subcommand_matches("lora").cloned();
    // The library reports through `tracing`: the server writes structured lines (it sets that up
    // itself); every other command prints the messages alone, as plain stderr lines, at `info`
    // unless `RMLX_LOG` says otherwise (`RMLX_LOG=debug` adds, for one, memory per training step).
    // The ranks of a job other than 0 write nothing but errors and warnings (to `errors`).
    let errors = match matches.subcommand_name().map_or(Ok(()), parallel::check_command) {
        Ok(()) => parallel::quiet_unless_rank0(),
        Err(e) => Err(e),
    };
    let errors = errors.unwrap_or_else(|e| {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    });
    if !matches!(cli.command, Command::Serve(_)) {
        use std::io::IsTerminal;
        use tracing_subscriber::fmt::writer::BoxMakeWriter;
        // A job's other ranks report warnings and errors only (rank 0 reports progress).
        let level = if parallel::job_rank() == 0 { "info" } else { "warn" };
        let filter = tracing_subscriber::EnvFilter::try_from_env("RMLX_LOG").unwrap_or_else(|_| level.into());
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(match errors.as_ref().and_then(|f| f.try_clone().ok()) {
                Some(f) => BoxMakeWriter::new(std::sync::Mutex::new(f)),
                None => BoxMakeWriter::new(std::io::stderr),
            })
            .with_ansi(std::io::stderr().is_terminal())
            .without_time()
            .with_level(false)
            .with_target(false)
            .init();
    }
    if matches!(cli.command, Command::Lora(_)) {
        lora::limit_gpu_graphs();
    }
    // MLX's run-time compiled CUDA kernels kept in rmlx's cache rather than the temporary
    // directory (set here, before any thread uses the GPU).
    rmlx_lm::persist_mlx_kernels();
    // Each command is one single-threaded loop over MLX: it runs where MLX evaluates, so that no
    // evaluation is handed from thread to thread.
    let result = rmlx::on_evaluation_thread(move || match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Bench(a) => bench::run(a),
        Command::BenchBatch(a) => bench_batch::run(a),
        Command::BenchKernels(a) => bench_kernels::run(a),
        Command::Lora(a) => lora::run(a, lora_matches),
        Command::Fuse(a) => fuse::run(a),
        Command::Convert(a) => convert::run(a),
        Command::CachePrompt(a) => cache_prompt::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Batch(a) => batch::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Backends(a) => backends::run(a),
        Command::Launch(a) => launch::run(a),
        Command::BenchCollective(a) => bench_collective::run(a),
    });
    if let Err(e) = result {
        match errors {
            Some(mut f) => {
                use std::io::Write;
                let _ = writeln!(f, "error: {e:#}");
            }
            None => eprintln!("error: {e:#}"),
        }
        std::process::exit(1);
    }
}
