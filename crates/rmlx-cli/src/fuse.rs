//! `rmlx fuse`: merges LoRA adapters into the base weights and writes a Hugging Face folder that
//! rmlx, mlx-lm and transformers load (`mlx_lm.fuse`'s flags; the output is dequantised).

use crate::common::ModelArgs;
use anyhow::{ensure, Context, Result};
use clap::Args as ClapArgs;
use std::path::PathBuf;

#[derive(ClapArgs, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Where the fused model is written.
    #[arg(long, default_value = "fused_model")]
    save_path: PathBuf,
}

pub fn run(a: Args) -> Result<()> {
    let source = a.model.model.clone().context("--model: fusing needs the base model's Hugging Face folder")?;
    ensure!(
        source.is_dir(),
        "--model {}: fusing needs a Hugging Face folder (GGUF files are not supported)",
        source.display()
    );
    let adapters = a.model.adapter_path.clone().unwrap_or_else(|| PathBuf::from("adapters"));
    // The output is always dequantised (`--dequantize`, mlx_lm.fuse's flag, is accepted and changes
    // nothing); quantised weights stay packed in memory until they are written.
    let args = ModelArgs { adapter_path: Some(adapters), keep_quantized: true, dequantize: false, ..a.model.clone() };
    let mut lm = args.load()?;
    let s = rmlx_lm::tuner::fuse::fuse(&mut lm, &source, &a.save_path)?;
    eprintln!(
        "fused {} adapted layers; wrote {} tensors in {} file(s) to {}{}",
        s.fused,
        s.tensors,
        s.shards,
        a.save_path.display(),
        if s.dequantized { " (dequantised)" } else { "" }
    );
    Ok(())
}
