//! `rmlx inspect`: the post-RoPE attention keys of every layer and KV head after one prefill of a
//! prompt, written as safetensors or `.npy`, with a per-layer summary on stderr.

use crate::common::ModelArgs;
use anyhow::{Context, Result};
use clap::Args as ClapArgs;
use rmlx_lm::inspect::AttentionInspector;
use std::path::PathBuf;

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt.
    #[arg(long, short)]
    prompt: String,
    /// Encode the prompt as-is (default special tokens) instead of applying the chat template.
    #[arg(long)]
    raw: bool,
    /// Where the keys go: `.safetensors` (tensor `keys`) or `.npy`, float32
    /// `[layer, kv_head, position, head_dim]`.
    #[arg(long, short)]
    out: PathBuf,
}

pub fn run(a: Args) -> Result<()> {
    let lm = a.model.load()?;
    let prompt = lm.encode_prompt(&a.prompt, a.raw, None)?;
    let keys = AttentionInspector::new(&lm).keys(&prompt)?;
    keys.save(&a.out).with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!(
        "{} layers x {} KV heads x {} positions x {} dims -> {}",
        keys.layers,
        keys.kv_heads,
        keys.positions,
        keys.head_dim,
        a.out.display()
    );
    eprintln!("{:>5}  {:>10}  per-head mean cosine between positions", "layer", "mean |k|");
    for (l, s) in keys.summary().iter().enumerate() {
        let cos: Vec<String> =
            s.head_cosine.iter().map(|c| c.map_or_else(|| "-".to_string(), |c| format!("{c:.3}"))).collect();
        eprintln!("{l:>5}  {:>10.3}  {}", s.mean_norm, cos.join(" "));
    }
    Ok(())
}
