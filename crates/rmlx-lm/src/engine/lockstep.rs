//! The engine as every rank of a split model runs it: in lockstep. Each rank holds a share of
//! every layer (tensor parallelism) or some of the blocks (a pipeline), so every forward pass
//! needs them all. Rank 0 decides alone (which requests join, which are cancelled, when the batch
//! is aborted, which adapters are loaded, when to warm up) and, before each step, sends the
//! decisions taken since the last one to the other ranks ([`Ranks::broadcast_bytes`]); they apply
//! them to their own engine ([`Lockstep::follow`]) and step with it. Given the same decisions the
//! engines make the same batches and forward passes, and every sampled token is rank 0's
//! (`LoadedModel::agreed`), so they stay the same engine. With one rank, [`Lockstep`] is the
//! engine itself.

use super::{Engine, Request, SeqId, Update};
use crate::generate::GenerateOptions;
use crate::grammar::Grammar;
use crate::ranks::Ranks;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// A decision of rank 0's, as the other ranks apply it.
#[derive(Debug, Serialize, Deserialize)]
enum Decision {
    Submit {
        prompt: Vec<u32>,
        options: Box<GenerateOptions>,
        top_logprobs: usize,
        grammar: Option<Grammar>,
        adapter: Option<String>,
    },
    Cancel(SeqId),
    /// Every rank reads its share of the adapter folder, then they agree whether all could.
    LoadAdapter {
        name: String,
        dir: PathBuf,
    },
    UnloadAdapter(String),
    /// Every rank runs [`Engine::warm_up`].
    WarmUp,
    Abort,
    /// Every rank steps its engine.
    Step,
    /// Serving ended: the other ranks return.
    Stop,
}

/// An [`Engine`] whose changes reach the other ranks of a split model.
pub struct Lockstep<'m> {
    engine: Engine<'m>,
    /// The ranks, when there are several (this is rank 0).
    ranks: Option<Ranks>,
    /// Decisions not sent yet.
    pending: Vec<Decision>,
}

impl<'m> Lockstep<'m> {
    /// Rank 0's engine (or the only rank's) over `ranks`.
    pub fn new(engine: Engine<'m>, ranks: Option<Ranks>) -> Self {
        Self { engine, ranks: ranks.filter(|r| r.size() > 1), pending: Vec::new() }
    }

    /// The engine, for what does not change it.
    pub fn engine(&self) -> &Engine<'m> {
        &self.engine
    }

    /// [`Engine::warm_up`] on every rank.
    pub fn warm_up(&mut self) -> Result<usize> {
        if self.ranks.is_some() {
            self.send(Decision::WarmUp)?;
        }
        self.engine.warm_up()
    }

    /// [`Engine::load_adapter_dir`] on every rank, each reading its share of the folder (which
    /// must be at the same path for every rank). Loaded everywhere or nowhere: where some rank
    /// cannot read it, the others unload it again and the error names those ranks.
    pub fn load_adapter_dir(&mut self, name: &str, dir: &Path) -> Result<()> {
        let Some(ranks) = self.ranks.clone() else { return self.engine.load_adapter_dir(name, dir) };
        self.send(Decision::LoadAdapter { name: name.to_string(), dir: dir.to_path_buf() })?;
        let loaded = self.engine.load_adapter_dir(name, dir);
        agree_on_adapter(&mut self.engine, &ranks, name, loaded)
    }

    /// [`Engine::unload_adapter`] on every rank.
    pub fn unload_adapter(&mut self, name: &str) -> Result<()> {
        self.engine.unload_adapter(name)?;
        if self.ranks.is_some() {
            // Every rank's engine is this one: it unloads the same way.
            self.pending.push(Decision::UnloadAdapter(name.to_string()));
        }
        Ok(())
    }

    /// [`Engine::submit`]. Over several ranks a request without a seed gets one here, so that
    /// every rank samples the same way; a grammar goes to every rank, which all mask the same
    /// logits and end the sequence where it completes; an adapter is named, each rank adding its
    /// share of it.
    pub fn submit(&mut self, mut request: Request) -> Result<SeqId> {
        if self.ranks.is_some() {
            let seed = request.options.sampler.seed.get_or_insert_with(clock_seed);
            tracing::trace!(seed, "request seeded for every rank");
            self.pending.push(Decision::Submit {
                prompt: request.prompt.clone(),
                options: Box::new(request.options.clone()),
                top_logprobs: request.top_logprobs,
                grammar: request.grammar.clone(),
                adapter: request.adapter.clone(),
            });
        }
        self.engine.submit(request)
    }

    /// [`Engine::cancel`].
    pub fn cancel(&mut self, seq: SeqId) {
        if self.ranks.is_some() {
            self.pending.push(Decision::Cancel(seq));
        }
        self.engine.cancel(seq)
    }

    /// [`Engine::abort`].
    pub fn abort(&mut self) -> Vec<Update> {
        if self.ranks.is_some() {
            self.pending.push(Decision::Abort);
        }
        self.engine.abort()
    }

    /// Sends the decisions so far, then [`Engine::step`] on every rank.
    pub fn step(&mut self) -> Result<Vec<Update>> {
        self.send(Decision::Step)?;
        self.engine.step()
    }

    /// Tells the other ranks that serving ended (they return from [`Lockstep::follow`]).
    pub fn stop(&mut self) -> Result<()> {
        self.send(Decision::Stop)
    }

    fn send(&mut self, last: Decision) -> Result<()> {
        let Some(ranks) = &self.ranks else { return Ok(()) };
        self.pending.push(last);
        let bytes = serde_json::to_vec(&std::mem::take(&mut self.pending)).expect("decisions serialise");
        ranks.broadcast_bytes(Some(&bytes)).map(drop)
    }

    /// A rank other than 0: applies rank 0's decisions to `engine` and steps with it until rank 0
    /// stops.
    pub fn follow(mut engine: Engine<'_>, ranks: &Ranks) -> Result<()> {
        loop {
            let bytes = ranks.broadcast_bytes(None)?;
            let decisions: Vec<Decision> = serde_json::from_slice(&bytes)
                .map_err(|e| Error::Ranks(format!("rank 0 sent decisions this rank cannot read: {e}")))?;
            for d in decisions {
                match d {
                    Decision::Submit { prompt, options, top_logprobs, grammar, adapter } => {
                        // A refusal here is rank 0's refusal too (same engine, same request).
                        let options = *options;
                        // A split model does not speculate.
                        let request = Request { prompt, options, top_logprobs, grammar, adapter, speculative: false };
                        let _ = engine.submit(request);
                    }
                    Decision::LoadAdapter { name, dir } => {
                        let loaded = engine.load_adapter_dir(&name, &dir);
                        if let Err(e) = &loaded {
                            tracing::error!(adapter = %name, dir = %dir.display(), "cannot load the adapter: {e}");
                        }
                        // Rank 0 answers the client; this rank only keeps in step.
                        let _ = agree_on_adapter(&mut engine, ranks, &name, loaded);
                    }
                    Decision::UnloadAdapter(name) => drop(engine.unload_adapter(&name)),
                    Decision::WarmUp => drop(engine.warm_up()?),
                    Decision::Cancel(seq) => engine.cancel(seq),
                    Decision::Abort => drop(engine.abort()),
                    Decision::Step => {
                        if engine.step().is_err() {
                            // Rank 0's step failed the same way: it aborts, and says so next.
                            engine.abort();
                        }
                    }
                    Decision::Stop => return Ok(()),
                }
            }
        }
    }
}

/// After every rank tried to load the adapter `name` (`loaded`): whether all of them could. If
/// not, the ranks that did unload it, and the error is this rank's own or names the others.
fn agree_on_adapter(engine: &mut Engine<'_>, ranks: &Ranks, name: &str, loaded: Result<()>) -> Result<()> {
    let failed = ranks.failed_ranks(loaded.is_err())?;
    if failed.is_empty() {
        return Ok(());
    }
    loaded?;
    engine.unload_adapter(name)?;
    let failed: Vec<String> = failed.iter().map(ToString::to_string).collect();
    Err(Error::Ranks(format!(
        "rank(s) {} could not load the adapter `{name}` (their logs say why): no rank holds it",
        failed.join(", ")
    )))
}

/// A seed from the clock, for a request that gives none.
fn clock_seed() -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    now.as_nanos() as u64 ^ 0x9E37_79B9_7F4A_7C15
}
