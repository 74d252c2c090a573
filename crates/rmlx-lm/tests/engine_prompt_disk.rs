//! The engine's prompt cache spilling to a directory (`serve --prompt-cache-dir`): an entry the
//! memory budget lets go is written there and read back by a prompt that shares more with it
//! than with anything in memory, giving the tokens the prompt gives uncached; the entries held
//! when the engine ends are written too, and a new engine over the directory reuses them (a
//! restart), for plain, sliding-window (Gemma 3) and quantised caches; the directory stays in its
//! byte budget, and files of another model are left alone.

mod common;

use common::{fixture_with_tokenizer, ids, reference, TempDir};
use rmlx_lm::engine::{Engine, EngineOptions, PromptCacheDir, Request, SeqId, Update};
use rmlx_lm::sample::SamplerConfig;
use rmlx_lm::{GenerateOptions, KvQuantization, LoadOptions, LoadedModel};

fn load(name: &str) -> (TempDir, LoadedModel) {
    let dir = fixture_with_tokenizer(name);
    let lm = rmlx_lm::loader::load(dir.path(), &LoadOptions::default()).unwrap();
    (dir, lm)
}

fn greedy(max_tokens: usize) -> GenerateOptions {
    GenerateOptions { max_tokens, ignore_eos: true, sampler: SamplerConfig::default(), ..GenerateOptions::default() }
}

/// Runs one request to its end: its tokens and the prompt tokens it took from the cache.
fn run(engine: &mut Engine, prompt: &[u32], max_tokens: usize) -> (Vec<u32>, usize) {
    let seq: SeqId =
        engine.submit(Request { prompt: prompt.to_vec(), options: greedy(max_tokens), ..Default::default() }).unwrap();
    let (mut tokens, mut cached) = (Vec::new(), None);
    while !engine.is_idle() {
        for u in engine.step().unwrap() {
            match u {
                Update::Started { seq: s, cached_tokens, .. } if s == seq => cached = Some(cached_tokens),
                Update::Token { seq: s, id, .. } if s == seq => tokens.push(id),
                Update::Failed { error, .. } => panic!("{error}"),
                _ => {}
            }
        }
    }
    (tokens, cached.expect("started"))
}

fn alone(lm: &LoadedModel, prompt: &[u32], n: usize) -> Vec<u32> {
    lm.generate(prompt, &greedy(n)).unwrap().map(|t| t.unwrap().id).collect()
}

/// Bytes of one entry of `prompt` with its answer of `n` tokens in memory.
fn entry_bytes(lm: &LoadedModel, prompt: &[u32], opts: &EngineOptions) -> usize {
    let mut engine = Engine::new(lm, EngineOptions { prompt_cache_dir: None, ..opts.clone() });
    run(&mut engine, prompt, 4);
    engine.prompt_cache_usage().0
}

/// Prompt `i`: the reference prompt shifted (no token shared with another `i`'s at its start).
fn prompt(base: &[u32], i: u32, vocab: u32) -> Vec<u32> {
    base.iter().map(|t| (t + i * 7 + 1) % vocab).collect()
}

/// Returns the directory (with the engine's files).
fn spills_and_survives_a_restart(fixture: &str, base: Vec<u32>, kv: Option<KvQuantization>) -> TempDir {
    let (_d, lm) = load(fixture);
    let vocab = lm.model.config().vocab_size as u32;
    let dir = TempDir::new("prompt-disk");
    let on_disk = Some(PromptCacheDir { dir: dir.path().to_path_buf(), budget: 1 << 30 });
    let base_opts = EngineOptions { kv_quantization: kv, ..EngineOptions::default() };
    let (a, b) = (prompt(&base, 0, vocab), prompt(&base, 1, vocab));
    // Room in memory for one entry.
    let one = entry_bytes(&lm, &a, &base_opts);
    let opts =
        EngineOptions { prompt_cache_bytes: one * 3 / 2, prompt_cache_dir: on_disk.clone(), ..base_opts.clone() };
    let continued =
        |p: &[u32], answer: &[u32]| -> Vec<u32> { p.iter().chain(answer).chain(&[5, 6]).copied().collect() };
    let mut engine = Engine::new(&lm, opts.clone());
    assert_eq!(engine.prompt_cache_disk_usage(), Some((0, 0)), "{fixture}: an empty directory");
    let (answer_a, cached) = run(&mut engine, &a, 4);
    assert_eq!(cached, 0);
    let (answer_b, _) = run(&mut engine, &b, 4);
    assert_eq!(engine.prompt_cache_usage().1, 1, "{fixture}: one entry in memory");
    assert_eq!(engine.prompt_cache_disk_usage().unwrap().0, 1, "{fixture}: the first one spilled");
    // `a`'s entry comes back from the disk: the prompt and the three answer tokens fed back.
    let next_a = continued(&a, &answer_a);
    let (tokens, cached) = run(&mut engine, &next_a, 4);
    assert_eq!(cached, a.len() + 3, "{fixture}: read back from the directory");
    assert_eq!(tokens, alone(&lm, &next_a, 4), "{fixture}: the uncached prompt's tokens");
    drop(engine);
    // A restart: what was in memory was written at the end.
    let mut engine = Engine::new(&lm, opts.clone());
    let (files, bytes) = engine.prompt_cache_disk_usage().unwrap();
    assert!(files >= 2 && bytes > 0, "{fixture}: {files} files after a restart");
    assert_eq!(engine.prompt_cache_usage(), (0, 0), "{fixture}: memory starts empty");
    let next_b = continued(&b, &answer_b);
    let (tokens, cached) = run(&mut engine, &next_b, 4);
    assert_eq!(cached, b.len() + 3, "{fixture}: b's entry reused after the restart");
    assert_eq!(tokens, alone(&lm, &next_b, 4), "{fixture}: the uncached prompt's tokens");
    dir
}

/// The cache classes of the files in `dir`.
fn classes(dir: &TempDir) -> Vec<String> {
    let files = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().path());
    files
        .flat_map(|f| rmlx::io::load_safetensors(&f).unwrap().metadata.into_iter())
        .filter(|(k, _)| k.starts_with("1."))
        .map(|(_, v)| v)
        .collect()
}

#[test]
fn the_prompt_cache_spills_to_disk_and_survives_a_restart() {
    let dir = spills_and_survives_a_restart("llama_gqa", ids(&reference("llama_gqa")["prompt_ids"]), None);
    assert!(classes(&dir).iter().all(|c| c == "KVCache"));
}

#[test]
fn sliding_window_entries_spill_as_rings() {
    // 100 tokens through Gemma 3's window of 8: its sliding layers keep the last positions only
    // (a batch drops 64 or more at a time).
    let base: Vec<u32> = (0..100).map(|i| (i * 13 + 5) % 200).collect();
    let dir = spills_and_survives_a_restart("gemma3_text", base, None);
    let classes = classes(&dir);
    assert!(classes.iter().any(|c| c == "RotatingKVCache"), "{classes:?}");
    assert!(classes.iter().any(|c| c == "KVCache"), "{classes:?}");
}

#[test]
fn quantised_entries_spill_packed() {
    // qwen3's heads of 32: groups of 32.
    let q = KvQuantization { bits: 8, group_size: 32, start: 0 };
    let base: Vec<u32> = (0..24).map(|i| (i * 11 + 3) % 300).collect();
    let dir = spills_and_survives_a_restart("qwen3", base, Some(q));
    assert!(classes(&dir).iter().all(|c| c == "QuantizedKVCache"));
}

#[test]
fn the_directory_stays_in_its_budget_and_leaves_other_files_alone() {
    let (_d, lm) = load("llama_gqa");
    let vocab = lm.model.config().vocab_size as u32;
    let base = ids(&reference("llama_gqa")["prompt_ids"]);
    let dir = TempDir::new("prompt-disk-budget");
    // A file of another model and a stray file: not ours, not counted, not deleted.
    let (_o, other) = load("qwen3");
    let caches = other.cache_prompt(&[1, 2, 3], &greedy(1), &mut |_, _| {}).unwrap();
    let foreign = dir.path().join("other.safetensors");
    rmlx_lm::cache::save_prompt_cache(&foreign, &caches, &other.prompt_cache_metadata(None).unwrap()).unwrap();
    std::fs::write(dir.path().join("notes.txt"), "kept").unwrap();
    let one = entry_bytes(&lm, &prompt(&base, 0, vocab), &EngineOptions::default()) as u64;
    let budget = one * 5 / 2;
    let opts = EngineOptions {
        prompt_cache_bytes: one as usize * 3 / 2,
        prompt_cache_dir: Some(PromptCacheDir { dir: dir.path().to_path_buf(), budget }),
        ..EngineOptions::default()
    };
    let mut engine = Engine::new(&lm, opts);
    assert_eq!(engine.prompt_cache_disk_usage(), Some((0, 0)), "another model's file is not counted");
    for i in 0..6 {
        run(&mut engine, &prompt(&base, i, vocab), 4);
        let (files, bytes) = engine.prompt_cache_disk_usage().unwrap();
        assert!(bytes <= budget && files <= 2, "{files} files, {bytes} bytes over a budget of {budget}");
    }
    assert_eq!(engine.prompt_cache_disk_usage().unwrap().0, 2, "the directory holds what fits");
    drop(engine);
    assert!(foreign.exists() && dir.path().join("notes.txt").exists(), "other files are left alone");
    let ours = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("prompt-"))
        .count();
    assert!(ours <= 2, "{ours} of the engine's files after it ended");
}
