//! `rmlx bench`: the protocol of mlx-lm's peer benchmark (`peer_bench.py`), so the two can be
//! compared side by side: prompt ids `(i·7919) mod 50000 + 10` (folded into the vocabulary when it
//! is smaller), greedy decoding past EOS, one warm-up run of 8 tokens, then `-n` runs; medians of
//! the time to first token, prefill and decode speeds, and the peak memory (beside the memory the
//! loaded model holds before any run, `loaded_gb`). Decoding is also put
//! beside its bandwidth floor ([`rmlx_lm::roofline`]): the bytes a token reads over the device's
//! bandwidth, measured by a copy before the runs. `--json` also lists the greedy ids of the first
//! run, so that two builds (or devices) can be checked to decode the same tokens.

use crate::common::{count, gb, positive, KvCacheArgs, ModelArgs};
use anyhow::Result;
use clap::Args as ClapArgs;
use rmlx_lm::{GenerateOptions, KvQuantization, LoadedModel};

#[derive(ClapArgs, Debug)]
#[command(allow_negative_numbers = true)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    kv_cache: KvCacheArgs,
    /// Prompt tokens.
    #[arg(short = 'p', default_value_t = 512, value_parser = positive)]
    prompt_tokens: usize,
    /// Generated tokens.
    #[arg(short = 'g', default_value_t = 256, value_parser = count)]
    gen_tokens: usize,
    /// Timed runs.
    #[arg(short = 'n', default_value_t = 3, value_parser = positive)]
    trials: usize,
    /// One JSON line (the keys of peer_bench.py).
    #[arg(long)]
    json: bool,
    /// Also time this many decoding steps one at a time, split into building the graph, launching
    /// it and waiting, with the operations of a step by kind (0: off).
    #[arg(long, default_value_t = 0, value_parser = count)]
    profile: usize,
    /// With --profile: also time as many speculative verification passes of this many drafts
    /// (the last token and the drafts in one pass, all rejected: the drafts' positions taken back).
    #[arg(long, default_value_t = 0, value_parser = count, requires = "profile")]
    profile_drafts: usize,
}

/// (TTFT seconds, decode tokens/s, the greedy token ids) of one run.
fn run_once(lm: &LoadedModel, prompt: &[u32], n: usize, kv: Option<KvQuantization>) -> Result<(f64, f64, Vec<u32>)> {
    let opts = GenerateOptions { max_tokens: n, ignore_eos: true, kv_quantization: kv, ..GenerateOptions::default() };
    let mut g = lm.generate(prompt, &opts)?;
    let mut ids = Vec::with_capacity(n);
    for t in g.by_ref() {
        ids.push(t?.id);
    }
    let m = g.metrics();
    Ok((m.time_to_first_token.as_secs_f64(), m.generation_tps(), ids))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub fn run(a: Args) -> Result<()> {
    anyhow::ensure!(a.trials > 0 && a.gen_tokens > 1 && a.prompt_tokens > 0, "need -n ≥ 1, -g ≥ 2, -p ≥ 1");
    let lm = a.model.load_interruptible(true)?;
    // What the loaded model holds (weights and anything kept beside them), before any run.
    let resident = gb(rmlx::memory::active_memory());
    let vocab = lm.model.config().vocab_size as usize;
    let prompt: Vec<u32> = (0..a.prompt_tokens).map(|i| (((i * 7919) % 50000 + 10) % vocab) as u32).collect();
    let bandwidth = rmlx_lm::roofline::measure_bandwidth()?;
    let floor = rmlx_lm::roofline::floor(&lm, a.prompt_tokens, a.gen_tokens, bandwidth);
    let kv = a.kv_cache.quantization()?;
    run_once(&lm, &prompt, 8, kv)?;
    rmlx::memory::reset_peak_memory();
    let mut runs = Vec::new();
    for _ in 0..a.trials {
        runs.push(run_once(&lm, &prompt, a.gen_tokens, kv)?);
    }
    let ttft = median(runs.iter().map(|r| r.0).collect());
    let decode = median(runs.iter().map(|r| r.1).collect());
    let peak = gb(rmlx::memory::peak_memory());
    let profile = match a.profile {
        0 => None,
        n => Some(rmlx_lm::profile::decode_steps(&lm, &prompt, n)?),
    };
    let verify = match (a.profile, a.profile_drafts) {
        (0, _) | (_, 0) => None,
        (n, k) => Some(rmlx_lm::profile::verify_passes(&lm, &prompt, k, n)?),
    };
    let profile_json = |p: &rmlx_lm::profile::StepProfile| {
        serde_json::json!({"steps": p.steps,
            "build_us": p.build_us.round(), "launch_us": p.launch_us.round(), "wait_us": p.wait_us.round(),
            "operations": p.operation_count(), "operations_by_kind": p.operations})
    };
    let name = lm.source.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let device = format!("{:?}", rmlx::default_device().kind).to_lowercase();
    if a.json {
        println!(
            "{}",
            serde_json::json!({"peer": "rmlx", "model": name, "prompt_tokens": a.prompt_tokens, "gen_tokens": a.gen_tokens,
            "ttft_ms": (ttft * 1e5).round() / 100.0, "prefill_tok_s": (a.prompt_tokens as f64 / ttft * 10.0).round() / 10.0,
            "decode_tok_s": (decode * 10.0).round() / 10.0, "peak_gb": (peak * 1000.0).round() / 1000.0,
            "loaded_gb": (resident * 1000.0).round() / 1000.0,
            "dtype": lm.dtype.name(), "device": device, "cuda_graph_ops": rmlx::cuda_graph_ops(),
            "bytes_per_token": floor.bytes(), "weight_bytes_per_token": floor.weight_bytes,
            "kv_bytes_per_token": floor.kv_bytes, "bandwidth_gb_s": (bandwidth / 1e8).round() / 10.0,
            "floor_tok_s": (floor.tokens_per_second() * 10.0).round() / 10.0,
            "floor_fraction": (floor.fraction(decode) * 1e4).round() / 1e4,
            "token_ids": runs[0].2, "runs_identical": runs.iter().all(|r| r.2 == runs[0].2),
            "profile": profile.as_ref().map(profile_json),
            "profile_verify": verify.as_ref().map(|p| {
                let mut v = profile_json(p);
                v["drafts"] = serde_json::json!(a.profile_drafts);
                v
            })})
        );
    } else {
        println!("model       {name} ({}, {device})", lm.dtype.name());
        println!(
            "prompt      {} tokens, TTFT {:.2} ms, prefill {:.1} tok/s",
            a.prompt_tokens,
            ttft * 1e3,
            a.prompt_tokens as f64 / ttft
        );
        println!("generation  {} tokens, decode {:.1} tok/s (median of {})", a.gen_tokens, decode, a.trials);
        println!(
            "floor       {:.1} MB read per token ({:.1} MB weights, {:.2} MB keys and values), {:.1} GB/s copy: \
             {:.0} tok/s at most, decode at {:.1} % of it",
            floor.bytes() as f64 / 1e6,
            floor.weight_bytes as f64 / 1e6,
            floor.kv_bytes as f64 / 1e6,
            bandwidth / 1e9,
            floor.tokens_per_second(),
            100.0 * floor.fraction(decode)
        );
        println!("peak memory {peak:.3} GB ({resident:.3} GB held after loading)");
        let show = |label: &str, p: &rmlx_lm::profile::StepProfile| {
            println!(
                "{label:<11} {:.0} µs = build {:.0} + launch {:.0} + wait {:.0} ({} steps one at a time); \
                 {} operations, {:.1} a layer",
                p.total_us(),
                p.build_us,
                p.launch_us,
                p.wait_us,
                p.steps,
                p.operation_count(),
                p.operation_count() as f64 / p.layers.max(1) as f64
            );
            let mut kinds: Vec<_> = p.operations.iter().collect();
            kinds.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
            let kinds: Vec<String> = kinds.iter().map(|(k, n)| format!("{k} {n}")).collect();
            println!("operations  {}", kinds.join(", "));
        };
        if let Some(p) = &profile {
            show("profile", p);
        }
        if let Some(p) = &verify {
            show(&format!("verify +{}", a.profile_drafts), p);
        }
    }
    Ok(())
}
