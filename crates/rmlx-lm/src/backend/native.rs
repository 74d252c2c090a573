//! The native backend: rmlx's own model files (`crate::models`) on MLX. Generation streams are
//! [`Generation`]s; classification is a padded, batched prefill (the layout the engine uses for
//! newcomers, `BatchCache::padded`); batch generation runs the continuous-batching [`Engine`].

use super::{
    Backend, Candidate, Classification, ClassifyOptions, Completion, LanguageModel, ModelInfo, Prompt, TokenStream,
};
use crate::cache::{BatchCache, KvCache};
use crate::chat::Message;
use crate::engine::{Engine, EngineOptions, Request, Update};
use crate::generate::{CancelHandle, FinishReason, GenerateOptions, Generation, Metrics, Token};
use crate::gguf::{GgufFile, MetaValue};
use crate::loader::{LoadOptions, LoadedModel};
use crate::models::spec;
use crate::sample::{log_softmax, sort_candidates, top_candidates};
use crate::{Error, Result};
use rmlx::{ops, Array, Dtype};
use std::path::Path;
use std::time::Instant;

/// The native backend's name (what [`super::BackendChoice`] and `--backend` give).
pub const NAME: &str = "native";

/// rmlx's own implementation (`crate::models::spec::ARCHITECTURES`).
pub struct NativeBackend;

impl Backend for NativeBackend {
    fn name(&self) -> &str {
        NAME
    }

    fn supports(&self, path: &Path) -> std::result::Result<(), String> {
        if path.is_file() {
            let file = GgufFile::open(path).map_err(|e| e.to_string())?;
            let arch = file.get("general.architecture").and_then(MetaValue::as_str).unwrap_or("");
            return match spec::for_gguf(arch) {
                Some(_) => Ok(()),
                None => Err(format!("GGUF architecture `{arch}` is not implemented (have: {})", spec::gguf_list())),
            };
        }
        let config = path.join("config.json");
        let Ok(text) = std::fs::read_to_string(&config) else {
            return Err(format!("neither a GGUF file nor a folder with a config.json: {}", path.display()));
        };
        match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(v) if !spec::supports_config(&v) => {
                let t = v.get("model_type").and_then(|t| t.as_str()).unwrap_or("?");
                Err(format!("architecture `{t}` is not implemented (have: {})", spec::model_type_list()))
            }
            _ => Ok(()),
        }
    }

    fn load(&self, path: &Path, opts: &LoadOptions) -> Result<Box<dyn LanguageModel>> {
        Ok(Box::new(NativeModel::new(crate::loader::load(path, opts)?)))
    }
}

/// A [`LoadedModel`] behind the [`LanguageModel`] interface.
pub struct NativeModel {
    lm: LoadedModel,
    last: Option<Metrics>,
}

impl NativeModel {
    pub fn new(lm: LoadedModel) -> NativeModel {
        NativeModel { lm, last: None }
    }

    /// The model underneath.
    pub fn loaded(&self) -> &LoadedModel {
        &self.lm
    }

    fn encode(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        match prompt {
            Prompt::Text(text) => self.lm.encode_prompt(text, true, None),
            Prompt::Tokens(ids) => {
                self.lm.vocab.check(ids)?;
                Ok(ids.clone())
            }
            Prompt::Chat(messages) => self.lm.chat_prompt(messages),
        }
    }
}

/// A [`Generation`] that leaves its metrics with the model when it ends.
struct Stream<'a> {
    generation: Generation<'a>,
    last: &'a mut Option<Metrics>,
}

impl Iterator for Stream<'_> {
    type Item = Result<Token>;

    fn next(&mut self) -> Option<Result<Token>> {
        self.generation.next()
    }
}

impl TokenStream for Stream<'_> {
    fn cancel_handle(&self) -> CancelHandle {
        self.generation.cancel_handle()
    }

    fn metrics(&self) -> Metrics {
        self.generation.metrics().clone()
    }

    fn finish_reason(&self) -> Option<FinishReason> {
        self.generation.finish_reason()
    }
}

impl Drop for Stream<'_> {
    fn drop(&mut self) {
        *self.last = Some(self.generation.metrics().clone());
    }
}

impl LanguageModel for NativeModel {
    fn info(&self) -> ModelInfo {
        let cfg = self.lm.model.config();
        let quantization = cfg.quantization_block().map(|q| {
            let num = |k: &str| q.get(k).and_then(serde_json::Value::as_i64).unwrap_or(0);
            format!("affine {}-bit, group {}", num("bits"), num("group_size"))
        });
        let gguf = self.lm.source.is_file().then(|| "gguf".to_string());
        ModelInfo {
            backend: NAME.into(),
            architecture: cfg.model_type.clone(),
            vocab_size: cfg.vocab_size.max(0) as usize,
            layers: cfg.num_hidden_layers,
            hidden_size: cfg.hidden_size.max(0) as usize,
            heads: cfg.num_attention_heads.max(0) as usize,
            kv_heads: cfg.kv_heads().max(0) as usize,
            quantization: quantization.or(gguf),
            dtype: self.lm.dtype.name().to_string(),
            device: format!("{:?}", rmlx::current_device().kind).to_lowercase(),
            source: self.lm.source.clone(),
        }
    }

    fn generate<'a>(&'a mut self, prompt: &Prompt, opts: &GenerateOptions) -> Result<Box<dyn TokenStream + 'a>> {
        let ids = self.encode(prompt)?;
        let NativeModel { lm, last } = self;
        Ok(Box::new(Stream { generation: lm.generate(&ids, opts)?, last }))
    }

    fn chat<'a>(&'a mut self, messages: &[Message], opts: &GenerateOptions) -> Result<Box<dyn TokenStream + 'a>> {
        let ids = self.lm.chat_prompt(messages)?;
        let NativeModel { lm, last } = self;
        Ok(Box::new(Stream { generation: lm.generate(&ids, opts)?, last }))
    }

    fn classify(&mut self, prompts: &[Prompt], opts: &ClassifyOptions) -> Result<Vec<Classification>> {
        let started = Instant::now();
        let ids = prompts.iter().map(|p| self.encode(p)).collect::<Result<Vec<_>>>()?;
        if let Some(i) = ids.iter().position(Vec::is_empty) {
            return Err(Error::Prompt(format!("prompt {i} is empty")));
        }
        if let Some(limit) = self.lm.model.config().max_position_embeddings {
            if let Some(i) = ids.iter().position(|p| p.len() > limit) {
                return Err(Error::Prompt(format!(
                    "prompt {i} has {} tokens, more than the context limit of {limit}",
                    ids[i].len()
                )));
            }
        }
        let mut results: Vec<Option<Classification>> = vec![None; ids.len()];
        for group in groups(&ids, opts.max_batch_tokens) {
            let rows = group.iter().map(|&i| ids[i].as_slice()).collect::<Vec<_>>();
            for (&i, c) in group.iter().zip(classify_rows(&self.lm, &rows, opts)?) {
                let c = c.ok_or_else(|| Error::NonFinite(format!("the logits after prompt {i}")))?;
                results[i] = Some(c);
            }
        }
        let prompt_tokens = ids.iter().map(Vec::len).sum();
        self.last = Some(Metrics { prompt_tokens, time_to_first_token: started.elapsed(), ..Metrics::default() });
        Ok(results.into_iter().map(|c| c.expect("every prompt is in a group")).collect())
    }

    fn batch_generate(&mut self, prompts: &[Prompt], opts: &GenerateOptions) -> Result<Vec<Result<Completion>>> {
        let started = Instant::now();
        let mut engine = Engine::new(&self.lm, EngineOptions { prompt_cache_bytes: 0, ..EngineOptions::default() });
        let mut results: Vec<Result<Completion>> = Vec::with_capacity(prompts.len());
        let mut rows = std::collections::HashMap::new();
        for (i, prompt) in prompts.iter().enumerate() {
            let submitted = self
                .encode(prompt)
                .and_then(|prompt| engine.submit(Request { prompt, options: opts.clone(), ..Default::default() }));
            match submitted {
                Ok(seq) => {
                    rows.insert(seq, i);
                    let empty = Completion {
                        text: String::new(),
                        token_ids: Vec::new(),
                        prompt_tokens: 0,
                        finish_reason: FinishReason::Length,
                    };
                    results.push(Ok(empty));
                }
                Err(e) => results.push(Err(e)),
            }
        }
        let mut metrics = Metrics::default();
        while !engine.is_idle() {
            for update in engine.step()? {
                let seq = match &update {
                    Update::Started { seq, .. }
                    | Update::Token { seq, .. }
                    | Update::Text { seq, .. }
                    | Update::Finished { seq, .. }
                    | Update::Failed { seq, .. } => *seq,
                };
                let result = &mut results[rows[&seq]];
                match update {
                    Update::Token { id, text, .. } => {
                        if let Ok(c) = result {
                            c.token_ids.push(id);
                            c.text.push_str(&text);
                            if metrics.time_to_first_token.is_zero() {
                                metrics.time_to_first_token = started.elapsed();
                            }
                        }
                    }
                    Update::Text { text, .. } => {
                        if let Ok(c) = result {
                            c.text.push_str(&text);
                        }
                    }
                    Update::Finished { reason, usage, .. } => {
                        if let Ok(c) = result {
                            c.finish_reason = reason;
                            c.prompt_tokens = usage.prompt_tokens;
                        }
                        metrics.prompt_tokens += usage.prompt_tokens;
                        metrics.generated_tokens += usage.completion_tokens;
                    }
                    Update::Failed { error, .. } => *result = Err(error),
                    Update::Started { .. } => {}
                }
            }
        }
        metrics.decode_time = started.elapsed().saturating_sub(metrics.time_to_first_token);
        metrics.peak_memory = rmlx::memory::peak_memory();
        self.last = Some(metrics);
        Ok(results)
    }

    fn metrics(&self) -> Option<Metrics> {
        self.last.clone()
    }

    fn as_native(&self) -> Option<&LoadedModel> {
        Some(&self.lm)
    }

    fn close(self: Box<Self>) -> Result<()> {
        Ok(())
    }
}

/// Prompt indices grouped for batched prefills: by length (so that little is padding), each
/// group within `budget` padded tokens; a prompt longer than the budget alone.
fn groups(ids: &[Vec<u32>], budget: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_by_key(|&i| (ids[i].len(), i));
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    for i in order {
        // Sorted ascending: the newest prompt is the longest, so the padded size is rows × its length.
        if !current.is_empty() && (current.len() + 1) * ids[i].len() > budget.max(1) {
            groups.push(std::mem::take(&mut current));
        }
        current.push(i);
    }
    if !current.is_empty() {
        groups.push(current);
    }
    groups
}

/// One forward pass over `rows` padded on the left (so that all end at the last position, the
/// padding masked out), then each row's next-token distribution (`None`: its logits are not finite).
fn classify_rows(lm: &LoadedModel, rows: &[&[u32]], opts: &ClassifyOptions) -> Result<Vec<Option<Classification>>> {
    let width = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    let padding: Vec<i32> = rows.iter().map(|r| (width - r.len()) as i32).collect();
    let mut ids: Vec<i32> = Vec::with_capacity(rows.len() * width);
    for (r, &pad) in rows.iter().zip(&padding) {
        ids.extend(std::iter::repeat_n(0, pad as usize));
        ids.extend(r.iter().map(|&t| t as i32));
    }
    let ids = Array::from_slice(&ids, &[rows.len() as i32, width as i32])?;
    let mut caches = lm
        .layer_windows()
        .into_iter()
        .map(|w| Ok(KvCache::Batch(BatchCache::padded(rows.iter().map(|_| None).collect(), padding.clone(), 0, w)?)))
        .collect::<Result<Vec<_>>>()?;
    let h = lm.model.forward_hidden(&ids, &mut caches)?;
    let last = h.slice_axis(1, width as i32 - 1, width as i32, 1)?;
    let logits = lm.model.logits(&last)?.reshape(&[rows.len() as i32, -1])?.astype(Dtype::Float32)?;
    let logprobs = log_softmax(&lm.vocab.mask_logits(&logits)?)?;
    let best = logprobs.argmax(Some(-1), false)?.astype(Dtype::Int32)?;
    let best_lp = ops::take_along_axis(&logprobs, &best.reshape(&[rows.len() as i32, 1])?, Some(-1))?;
    let k = opts.top_logprobs.min(lm.vocab.sampleable()) as i32;
    let top = if k > 0 { Some(top_candidates(&logprobs, k)?) } else { None };
    let mut outputs = vec![&best, &best_lp];
    if let Some((i, v)) = &top {
        outputs.extend([i, v]);
    }
    if opts.logits {
        outputs.push(&logits);
    }
    rmlx::eval(outputs.iter().copied())?;
    let finite = ops::isfinite(&logits)?.all(rmlx::Axes::from(-1), false)?.to_vec::<bool>()?;
    let best = best.to_vec::<i32>()?;
    let best_lp = best_lp.to_vec::<f32>()?;
    let top = match &top {
        Some((i, v)) => Some((i.to_vec::<u32>()?, v.to_vec::<f32>()?)),
        None => None,
    };
    let all_logits = if opts.logits { Some(logits.to_vec::<f32>()?) } else { None };
    let vocab = logits.shape()[1] as usize;
    let mut out = Vec::with_capacity(rows.len());
    for (r, prompt) in rows.iter().enumerate() {
        if !finite[r] {
            out.push(None);
            continue;
        }
        let mut row_top: Vec<(u32, f32)> = match &top {
            Some((i, v)) => (0..k as usize).map(|j| (i[r * k as usize + j], v[r * k as usize + j])).collect(),
            None => Vec::new(),
        };
        sort_candidates(&mut row_top);
        let row_top = row_top
            .into_iter()
            .map(|(id, logprob)| Ok(Candidate { id, token: lm.tokenizer.decode(&[id], false)?, logprob }))
            .collect::<Result<Vec<_>>>()?;
        let id = best[r] as u32;
        out.push(Some(Classification {
            prompt_tokens: prompt.len(),
            token_id: id,
            token: lm.tokenizer.decode(&[id], false)?,
            logprob: best_lp[r],
            top: row_top,
            logits: all_logits.as_ref().map(|l| l[r * vocab..(r + 1) * vocab].to_vec()),
        }));
    }
    Ok(out)
}
