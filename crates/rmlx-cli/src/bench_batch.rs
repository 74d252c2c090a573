//! `rmlx bench-batch`: classification and batch-generation throughput of a backend, so that the
//! native one and mlx-lm (through the bridge, its own batch generation) can be put side by side.
//! Prompts are token ids `(i·7919 + j·104729) mod (vocab − 20) + 10`, of lengths cycling through
//! 75–125 % of `--prompt-tokens`; one warm-up, then the median of `-n` timed runs (wall time on
//! this side, the bridge's JSON included).

use crate::common::{count, positive, ModelArgs};
use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use rmlx_lm::backend::{ClassifyOptions, LanguageModel, Prompt};
use rmlx_lm::GenerateOptions;
use std::time::Instant;

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// `native`, `mlx-lm` or `auto`.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Batch sizes to classify (comma-separated).
    #[arg(long, default_value = "4,32,256", value_delimiter = ',')]
    classify: Vec<usize>,
    /// Prompts completed together by batch generation (0: skip).
    #[arg(long, default_value_t = 32, value_parser = count)]
    generate: usize,
    /// Tokens each batch-generated prompt gets.
    #[arg(short = 'g', default_value_t = 64, value_parser = positive)]
    gen_tokens: usize,
    /// Mean prompt length in tokens.
    #[arg(short = 'p', long, default_value_t = 64, value_parser = positive)]
    prompt_tokens: usize,
    /// Timed runs per row.
    #[arg(short = 'n', default_value_t = 3, value_parser = positive)]
    trials: usize,
    /// One JSON line per row on stdout.
    #[arg(long)]
    json: bool,
}

fn prompts(n: usize, mean: usize, vocab: usize) -> Vec<Prompt> {
    let span = vocab.saturating_sub(20).max(1);
    (0..n)
        .map(|i| {
            let len = (mean * (75 + (i * 37) % 51) / 100).max(1);
            Prompt::Tokens((0..len).map(|j| ((i * 7919 + j * 104729) % span + 10) as u32).collect())
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn report(json: bool, backend: &str, row: serde_json::Value) {
    if json {
        println!("{row}");
    } else {
        eprintln!("{backend}: {row}");
    }
}

pub fn run(a: Args) -> Result<()> {
    let mut lm: Box<dyn LanguageModel> = a.model.open(&a.backend)?;
    let info = lm.info();
    let backend = info.backend.clone();
    let time = |f: &mut dyn FnMut() -> Result<usize>| -> Result<(f64, usize)> {
        f()?; // warm-up
        let mut secs = Vec::new();
        let mut units = 0;
        for _ in 0..a.trials {
            let t = Instant::now();
            units = f()?;
            secs.push(t.elapsed().as_secs_f64());
        }
        Ok((median(secs), units))
    };
    for &n in &a.classify {
        let batch = prompts(n, a.prompt_tokens, info.vocab_size);
        let tokens: usize = batch.iter().map(|p| if let Prompt::Tokens(t) = p { t.len() } else { 0 }).sum();
        let opts = ClassifyOptions { top_logprobs: 5, ..ClassifyOptions::default() };
        let (secs, _) = time(&mut || Ok(lm.classify(&batch, &opts).context("classify")?.len()))?;
        report(
            a.json,
            &backend,
            serde_json::json!({"backend": backend, "task": "classify", "prompts": n, "prompt_tokens": tokens,
                "seconds": secs, "prompts_per_s": n as f64 / secs, "prompt_tps": tokens as f64 / secs}),
        );
    }
    if a.generate > 0 {
        let batch = prompts(a.generate, a.prompt_tokens, info.vocab_size);
        let opts = GenerateOptions { max_tokens: a.gen_tokens, ignore_eos: true, ..GenerateOptions::default() };
        let (secs, generated) = time(&mut || {
            let results = lm.batch_generate(&batch, &opts).context("batch_generate")?;
            results.into_iter().map(|r| Ok(r?.token_ids.len())).sum::<Result<usize>>()
        })?;
        report(
            a.json,
            &backend,
            serde_json::json!({"backend": backend, "task": "batch_generate", "prompts": a.generate,
                "generated_tokens": generated, "seconds": secs, "generation_tps": generated as f64 / secs}),
        );
    }
    lm.close()?;
    Ok(())
}
