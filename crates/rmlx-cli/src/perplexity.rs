//! `rmlx perplexity`: mean negative log-likelihood and perplexity of a text file, encoded like
//! `tokenizer(text)` (default special tokens), scored at positions 1..N-1.

use crate::common::{positive, ModelArgs};
use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use std::path::PathBuf;

#[derive(ClapArgs, Debug)]
#[command(allow_negative_numbers = true)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// The text to score.
    #[arg(long)]
    text_file: PathBuf,
    /// Positions per forward pass (at least 1).
    #[arg(long, default_value_t = 512, value_parser = positive)]
    chunk: usize,
    /// Print `{"tokens":..,"nll":..,"ppl":..}`.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let text = std::fs::read_to_string(&a.text_file).with_context(|| format!("reading {}", a.text_file.display()))?;
    let lm = a.model.load()?;
    let ids = lm.tokenizer.encode(&text, true)?;
    let (nll, _) = rmlx_lm::generate::negative_log_likelihood(&lm, &ids, a.chunk)?;
    let ppl = nll.exp();
    // Never print a perplexity JSON cannot hold (`null`): exp overflows past a mean NLL of ~709.
    anyhow::ensure!(ppl.is_finite(), "the perplexity exp({nll}) overflows a 64-bit float (mean NLL {nll:.1} nats)");
    if a.json {
        println!("{}", serde_json::json!({"tokens": ids.len(), "nll": nll, "ppl": ppl}));
    } else {
        println!("tokens: {}  mean NLL: {nll:.4}  perplexity: {ppl:.3}", ids.len());
    }
    Ok(())
}
