//! `rmlx batch`: a jsonl file of prompts through the continuous-batching engine, one jsonl result
//! per prompt in input order; `--classify` stops after each prompt and reports the next token's
//! most likely values instead.

use crate::common::{count, KvCacheArgs, ModelArgs, SamplingArgs, SpeculativeArgs};
use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use rmlx_lm::backend::{ClassifyOptions, LanguageModel, Prompt};
use rmlx_lm::chat::Message;
use rmlx_lm::engine::{Engine, EngineOptions, Lockstep, Request, Update};
use rmlx_lm::grammar::Grammar;
use rmlx_lm::progress::Progress;
use rmlx_lm::{GenerateOptions, LoadedModel};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;

#[derive(ClapArgs, Debug)]
#[command(allow_negative_numbers = true)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    kv_cache: KvCacheArgs,
    /// A jsonl file: one `{"prompt": "..."}` (encoded as is) or `{"messages": [...]}` (chat
    /// template) per line, optionally with `"id"`, `"max_tokens"`, `"temperature"`, `"seed"` and
    /// `"response_format"` (as OpenAI's, plus `{"type": "regex", "regex": …}` and `lark`).
    #[arg(long)]
    prompts: PathBuf,
    /// Where the results go (default: stdout), one JSON object per prompt, in input order.
    #[arg(long, short)]
    output: Option<PathBuf>,
    /// Most tokens per prompt, for lines that do not set it.
    #[arg(long, short = 'm', default_value_t = 256, value_parser = count)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    speculative: SpeculativeArgs,
    /// With speculative decoding: the most running prompts a step drafts for (the batch's tail).
    #[arg(long, default_value_t = 8, value_parser = count)]
    speculative_max_batch: usize,
    /// Stop when this string is generated (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Most prompts decoded together.
    #[arg(long, default_value_t = 32, value_parser = count)]
    max_batch: usize,
    /// Most prompts computed together in one forward pass before they join the batch (padded to
    /// end together, within 2048 tokens); 1 computes them one at a time.
    #[arg(long, default_value_t = 8, value_parser = count)]
    prefill_batch: usize,
    /// Keep generating past end-of-sequence tokens (every prompt gets its `max_tokens`: what a
    /// throughput benchmark compares).
    #[arg(long)]
    ignore_eos: bool,
    /// Report the next token's distribution after each prompt (its `--top` most likely tokens
    /// with their log-probabilities) instead of generating.
    #[arg(long)]
    classify: bool,
    /// Tokens reported per prompt with `--classify`.
    #[arg(long, default_value_t = 5, value_parser = count)]
    top: usize,
    /// Who runs the model: `native` (the batching engine), `mlx-lm` (its own batch generation,
    /// lines grouped by their settings; no `response_format`), or `auto`.
    #[arg(long, default_value = "auto")]
    backend: String,
}

/// One line of the prompts file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    id: Option<Value>,
    prompt: Option<String>,
    messages: Option<Vec<Message>>,
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    seed: Option<u64>,
    /// OpenAI's `response_format` (`json_object`, `json_schema`) or rmlx's `regex` / `lark`: the
    /// output is constrained to it during sampling.
    response_format: Option<Value>,
    #[serde(skip)]
    grammar: Option<Grammar>,
}

/// Reads and checks every line before anything runs: an error names the line.
fn read_lines(path: &PathBuf) -> Result<Vec<Line>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut lines = Vec::new();
    for (i, raw) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let at = || format!("{}, line {}", path.display(), i + 1);
        let mut line: Line = serde_json::from_str(raw).with_context(at)?;
        if let Some(f) = &line.response_format {
            line.grammar = Grammar::from_response_format(f).with_context(at)?;
        }
        match (&line.prompt, &line.messages) {
            (Some(_), None) => {}
            (None, Some(m)) if m.is_empty() => bail!("{}: \"messages\" is empty", at()),
            (None, Some(_)) => {}
            _ => bail!("{}: a line needs exactly one of \"prompt\" and \"messages\"", at()),
        }
        lines.push(line);
    }
    if lines.is_empty() {
        bail!("{} holds no prompt", path.display());
    }
    Ok(lines)
}

fn encode(lm: &LoadedModel, line: &Line) -> rmlx_lm::Result<Vec<u32>> {
    match (&line.prompt, &line.messages) {
        (Some(p), _) => lm.encode_prompt(p, true, None),
        (_, Some(m)) => lm.chat_prompt(m),
        _ => unreachable!("checked when read"),
    }
}

pub fn run(a: Args) -> Result<()> {
    let base = a.sampling.checked_config()?;
    let lines = read_lines(&a.prompts)?;
    let mut model = a.model.open(&a.backend)?;
    let kv_quantization = a.kv_cache.quantization()?;
    let options = EngineOptions {
        max_batch: a.max_batch,
        prefill_batch: a.prefill_batch,
        kv_quantization,
        speculative_max_batch: a.speculative_max_batch,
        ..EngineOptions::default()
    };
    // Over the ranks of a split model, rank 0 runs the batch and writes the results;
    // the others compute their share of each step it decides.
    if let Some(ranks) = model.as_native().and_then(|lm| lm.ranks().cloned()).filter(|r| r.rank() != 0) {
        let lm = model.as_native().expect("native");
        return Ok(Lockstep::follow(Engine::new(lm, options), &ranks)?);
    }
    let mut out = Output::new(&a, &lines)?;
    let Some(lm) = model.as_native() else {
        through_interface(&a, model.as_mut(), &lines, &base, &mut out)?;
        return out.finish();
    };
    let draft = a.speculative.load_draft(&a.model)?;
    let mut engine = Engine::new(lm, options);
    if a.speculative.enabled() {
        engine = engine.with_speculation(a.speculative.speculation(draft.as_ref()))?;
    }
    let mut engine = Lockstep::new(engine, lm.ranks().cloned());
    let start = std::time::Instant::now();
    rmlx::memory::reset_peak_memory();
    let (mut prompt_tokens, mut cached_tokens, mut generated) = (0, 0, 0);
    let mut index = HashMap::new();
    let progress = Progress::new(true, if a.classify { "classifying" } else { "generating" }, lines.len() as u64);
    for (i, line) in lines.iter().enumerate() {
        let mut sampler = base.clone();
        sampler.temperature = line.temperature.unwrap_or(sampler.temperature);
        sampler.seed = line.seed.or(sampler.seed);
        let (max_tokens, top_logprobs) =
            if a.classify { (1, a.top) } else { (line.max_tokens.unwrap_or(a.max_tokens), 0) };
        // Classifying reports the first token's distribution even when that token is an EOS.
        let options = GenerateOptions {
            max_tokens,
            sampler,
            stop_strings: a.stop.clone(),
            ignore_eos: a.classify || a.ignore_eos,
            ..GenerateOptions::default()
        };
        // A prompt that cannot run (too long, a template or grammar that fails) gets its error
        // in its place; the others run.
        let submitted = encode(lm, line).and_then(|prompt| {
            engine.submit(Request {
                prompt,
                options,
                top_logprobs,
                grammar: line.grammar.clone(),
                ..Default::default()
            })
        });
        match submitted {
            Ok(seq) => {
                index.insert(seq, i);
            }
            Err(e) => {
                out.fail(i, &e)?;
                progress.inc(1);
            }
        }
    }
    let mut texts = vec![String::new(); lines.len()];
    while !engine.engine().is_idle() {
        for update in engine.step()? {
            match update {
                Update::Token { seq, text, top, .. } => {
                    let i = index[&seq];
                    texts[i].push_str(&text);
                    if a.classify {
                        let piece = |t: u32| lm.tokenizer.decode(&[t], false).unwrap_or_default();
                        out.results[i]["top"] =
                            top.iter().map(|&(t, lp)| json!({"id": t, "token": piece(t), "logprob": lp})).collect();
                    }
                }
                Update::Text { seq, text } => texts[index[&seq]].push_str(&text),
                Update::Finished { seq, reason, usage } => {
                    let i = index[&seq];
                    let r = &mut out.results[i];
                    r["prompt_tokens"] = json!(usage.prompt_tokens);
                    r["cached_tokens"] = json!(usage.cached_tokens);
                    prompt_tokens += usage.prompt_tokens;
                    cached_tokens += usage.cached_tokens;
                    generated += usage.completion_tokens;
                    if !a.classify {
                        r["text"] = json!(std::mem::take(&mut texts[i]));
                        r["completion_tokens"] = json!(usage.completion_tokens);
                        r["finish_reason"] = json!(reason.as_str());
                        if a.speculative.enabled() {
                            r["draft_tokens"] = json!(usage.draft_tokens);
                            r["accepted_draft_tokens"] = json!(usage.accepted_draft_tokens);
                        }
                    }
                    out.done(i)?;
                    progress.inc(1);
                }
                Update::Failed { seq, error } => {
                    out.fail(index[&seq], &error)?;
                    progress.inc(1);
                }
                Update::Started { .. } => {}
            }
        }
    }
    engine.stop()?;
    progress.finish();
    // The whole batch, prefill included, after loading.
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "{} prompts, {prompt_tokens} prompt tokens ({cached_tokens} cached), {generated} generated in {secs:.2} s: \
         {:.1} generated tokens/s, peak memory {:.2} GB",
        lines.len(),
        generated as f64 / secs.max(1e-9),
        rmlx::memory::peak_memory() as f64 / 1e9
    );
    out.finish()
}

/// The results, one JSON line per prompt in input order, to `--output` or stdout: each is
/// written as soon as it and every line before it are complete (a run stopped half way keeps what
/// it finished). A prompt that failed gets `{"index", "id", "error"}` in its place.
struct Output {
    results: Vec<Value>,
    complete: Vec<bool>,
    written: usize,
    failed: usize,
    sink: Box<dyn Write>,
}

impl Output {
    fn new(a: &Args, lines: &[Line]) -> Result<Output> {
        let sink: Box<dyn Write> = match &a.output {
            Some(p) => Box::new(std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?),
            None => Box::new(std::io::stdout()),
        };
        Ok(Output {
            results: lines.iter().enumerate().map(|(i, l)| json!({"index": i, "id": l.id})).collect(),
            complete: vec![false; lines.len()],
            written: 0,
            failed: 0,
            sink,
        })
    }

    /// Line `i` is complete: writes it and the complete lines after it, in order.
    fn done(&mut self, i: usize) -> Result<()> {
        self.complete[i] = true;
        let mut text = String::new();
        while self.written < self.results.len() && self.complete[self.written] {
            text.push_str(&format!("{}\n", self.results[self.written]));
            self.written += 1;
        }
        if !text.is_empty() {
            self.sink.write_all(text.as_bytes())?;
            self.sink.flush()?;
        }
        Ok(())
    }

    /// Line `i` failed with `error`.
    fn fail(&mut self, i: usize, error: &dyn std::fmt::Display) -> Result<()> {
        let r = &mut self.results[i];
        *r = json!({"index": r["index"], "id": r["id"], "error": error.to_string()});
        self.failed += 1;
        self.done(i)
    }

    /// Every line is written; an error (exit status 1) when any prompt failed.
    fn finish(mut self) -> Result<()> {
        self.sink.flush()?;
        if self.failed > 0 {
            bail!("{} of {} prompts failed (their lines carry \"error\")", self.failed, self.results.len());
        }
        Ok(())
    }
}

/// A backend other than the native one: `classify`, or `batch_generate` once per group of lines
/// that share their settings (token budget, temperature, seed).
fn through_interface(
    a: &Args,
    lm: &mut dyn LanguageModel,
    lines: &[Line],
    base: &rmlx_lm::sample::SamplerConfig,
    out: &mut Output,
) -> Result<()> {
    if let Some(i) = lines.iter().position(|l| l.response_format.is_some()) {
        bail!("{}, line {}: response_format needs the native backend", a.prompts.display(), i + 1);
    }
    let prompt = |l: &Line| match (&l.prompt, &l.messages) {
        (Some(p), _) => Prompt::Text(p.clone()),
        (_, Some(m)) => Prompt::Chat(m.clone()),
        _ => unreachable!("checked when read"),
    };
    let start = std::time::Instant::now();
    if a.classify {
        let prompts: Vec<Prompt> = lines.iter().map(prompt).collect();
        let opts = ClassifyOptions { top_logprobs: a.top, ..ClassifyOptions::default() };
        for (i, c) in lm.classify(&prompts, &opts)?.into_iter().enumerate() {
            let r = &mut out.results[i];
            r["prompt_tokens"] = json!(c.prompt_tokens);
            r["top"] = c.top.iter().map(|t| json!({"id": t.id, "token": t.token, "logprob": t.logprob})).collect();
            out.done(i)?;
        }
    } else {
        // Lines that share (max_tokens, temperature bits, seed) go together.
        type Settings = (usize, u32, Option<u64>);
        let mut groups: Vec<(Settings, Vec<usize>)> = Vec::new();
        for (i, l) in lines.iter().enumerate() {
            let key = (
                l.max_tokens.unwrap_or(a.max_tokens),
                l.temperature.unwrap_or(base.temperature).to_bits(),
                l.seed.or(base.seed),
            );
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, members)) => members.push(i),
                None => groups.push((key, vec![i])),
            }
        }
        let progress = Progress::new(true, "generating", lines.len() as u64);
        for ((max_tokens, temperature, seed), members) in groups {
            let mut sampler = base.clone();
            sampler.temperature = f32::from_bits(temperature);
            sampler.seed = seed;
            let opts = GenerateOptions {
                max_tokens,
                sampler,
                stop_strings: a.stop.clone(),
                ignore_eos: a.ignore_eos,
                kv_quantization: a.kv_cache.quantization()?,
                ..GenerateOptions::default()
            };
            let prompts: Vec<Prompt> = members.iter().map(|&i| prompt(&lines[i])).collect();
            for (&i, c) in members.iter().zip(lm.batch_generate(&prompts, &opts)?) {
                match c {
                    Ok(c) => {
                        let r = &mut out.results[i];
                        r["prompt_tokens"] = json!(c.prompt_tokens);
                        r["text"] = json!(c.text);
                        r["completion_tokens"] = json!(c.token_ids.len());
                        r["finish_reason"] = json!(c.finish_reason.as_str());
                        out.done(i)?;
                    }
                    Err(e) => out.fail(i, &e)?,
                }
                progress.inc(1);
            }
        }
        progress.finish();
    }
    eprintln!(
        "{} prompts through the {} backend in {:.2} s",
        lines.len(),
        lm.info().backend,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
