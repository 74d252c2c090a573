//! Tensor parallelism over MLX's ring backend, two processes on this machine: the test runs its
//! own binary as both ranks (the ignored `tensor_parallel_rank` test) with the environment
//! `rmlx launch` sets, and each rank checks every fixture model split over the two against the
//! same model whole in that process and against transformers' float32 reference: the logits of
//! the prompt in one pass and one token at a time through the caches (sliding windows, replicated
//! key/value heads where the ranks outnumber them), the greedy tokens, and the perplexity.
//! Fixtures that cannot be split over two ranks must say why.

mod common;

use common::ranks::{adapted_pair, attach_adapters, greedy, logits, AdapterForm};
use common::{fixture_dir, fixture_with_tokenizer, floats, ids, max_abs_diff, reference};
use rmlx::distributed::{Backend, Group};
use rmlx::Dtype;
use rmlx_lm::Ranks;
use rmlx_lm::{LoadOptions, LoadedModel};

/// Native fixtures with transformers references: split, they must still match them.
const WITH_REFERENCE: &[&str] = &[
    "llama_gqa",
    "llama_gqa_q4",
    "llama_mqa_untied",
    "mistral",
    "mistral_window",
    "qwen2",
    "qwen2_window",
    "qwen3",
    "qwen3_q4",
    "phi3",
    "phi3_q4",
    "gemma2",
    "gemma2_q4",
    "gemma3_text",
    "gemma3_text_pattern",
    "gemma3_multimodal_prefix",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
];

/// Native fixtures written by mlx-lm (no transformers reference): split against whole.
const MLX_LM: &[&str] = &["mistral_q4_mlx_lm", "mixtral_q4_mlx_lm", "phi3_mlx_lm", "gpt_oss_mlx_lm"];

/// Fixtures whose quantised layers two ranks cannot split: each rank would hold 16 of an expert's
/// 32 intermediate features, half a quantisation group of 32.
const UNSPLITTABLE: &[&str] = &["qwen3_moe_q4", "gpt_oss_mxfp4_mlx_lm"];

fn load(dir: &std::path::Path, tp: Option<&Ranks>) -> rmlx_lm::Result<LoadedModel> {
    load_with(dir, tp, false)
}

/// With `whole_vocabulary`, the embedding and head stay whole on every rank.
fn load_with(dir: &std::path::Path, tp: Option<&Ranks>, whole_vocabulary: bool) -> rmlx_lm::Result<LoadedModel> {
    let opts = LoadOptions {
        dtype: Some(Dtype::Float32),
        dequantize: Some(false),
        tensor_parallel: tp.cloned(),
        whole_vocabulary,
        ..LoadOptions::default()
    };
    rmlx_lm::loader::load(dir, &opts)
}

/// One rank's checks, each fixture printing `ok <name>`; run only by `two_ranks_split_every_fixture`.
#[test]
#[ignore = "a rank of two_ranks_split_every_fixture"]
fn tensor_parallel_rank() {
    let tp = Ranks::new(Group::init(Backend::Ring, true).unwrap(), Backend::Ring);
    assert_eq!(tp.size(), 2);
    for &name in WITH_REFERENCE.iter().chain(MLX_LM) {
        let dir = fixture_with_tokenizer(name);
        let whole = load(dir.path(), None).unwrap();
        let split = load(dir.path(), Some(&tp)).unwrap_or_else(|e| panic!("{name}: {e}"));
        // Split: this rank holds less than the whole (the norms stay whole).
        assert!(
            split.weight_bytes < whole.weight_bytes,
            "{name}: {} of {} bytes",
            split.weight_bytes,
            whole.weight_bytes
        );
        let has_reference = fixture_dir(name).join("reference.json").is_file();
        let (prompt, reference) = match has_reference {
            true => {
                let r = reference(name);
                (ids(&r["prompt_ids"]), Some(r))
            }
            false => ((0..12u32).map(|i| (i * 7 + 3) % 30).collect(), None),
        };
        let (split_whole, split_steps) = logits(&split, &prompt);
        let (one_whole, one_steps) = logits(&whole, &prompt);
        // Every fixture's vocabulary splits over two ranks: each holds half the embedding's rows
        // (and the head's), so less than with them whole; the logits are the same either way.
        let whole_vocab = load_with(dir.path(), Some(&tp), true).unwrap();
        assert!(
            split.weight_bytes < whole_vocab.weight_bytes,
            "{name}: {} vs {}",
            split.weight_bytes,
            whole_vocab.weight_bytes
        );
        let (wv_whole, _) = logits(&whole_vocab, &prompt);
        assert!(max_abs_diff(&wv_whole, &split_whole) < 1e-4, "{name}: vocabulary split or whole");
        // The split model adds its halves in another order: float32 rounding apart, which some
        // models amplify (gpt-oss's float32 logits are 1.3e-4 from float64's): twice what the
        // reference measured between float32 and float64, at least 1e-4.
        let rounding =
            reference.as_ref().map_or(0.0, |r| r["measured"]["float32_vs_float64_max_abs"].as_f64().unwrap());
        let close = (2.0 * rounding as f32).max(1e-4);
        let d = max_abs_diff(&split_whole, &one_whole);
        assert!(d < close, "{name}: split vs whole logits differ by {d} (tolerance {close})");
        let d = max_abs_diff(&split_steps, &one_steps);
        assert!(d < close, "{name}: split vs whole logits through the caches differ by {d} (tolerance {close})");
        let tokens = greedy(&split, &prompt, 8);
        assert_eq!(tokens, greedy(&whole, &prompt, 8), "{name}: greedy tokens");
        if let Some(r) = reference {
            let tolerance = r["tolerance"]["float32"].as_f64().unwrap() as f32;
            let d = max_abs_diff(&split_whole, &floats(&r["logits"]));
            assert!(d <= tolerance, "{name}: split vs transformers logits differ by {d} (tolerance {tolerance})");
            assert_eq!(tokens, ids(&r["greedy"])[..8], "{name}: greedy tokens vs transformers");
        }
        let (nll_split, n) = rmlx_lm::generate::negative_log_likelihood(&split, &prompt, 4).unwrap();
        let (nll_whole, m) = rmlx_lm::generate::negative_log_likelihood(&whole, &prompt, 4).unwrap();
        assert_eq!(n, m);
        assert!((nll_split - nll_whole).abs() < 1e-5 * nll_whole.abs().max(1.0), "{name}: {nll_split} vs {nll_whole}");
        println!("ok {name}");
    }
    for &name in UNSPLITTABLE {
        let dir = fixture_with_tokenizer(name);
        match load(dir.path(), Some(&tp)) {
            Err(rmlx_lm::Error::TensorParallel(why)) => {
                assert!(why.contains("quantisation groups of 32"), "{name}: {why}");
            }
            Err(e) => panic!("{name}: another error: {e}"),
            Ok(_) => panic!("{name}: split where it cannot be"),
        }
        println!("ok {name}");
    }
}

#[test]
fn two_ranks_split_every_fixture() {
    let names: Vec<&str> = WITH_REFERENCE.iter().chain(MLX_LM).chain(UNSPLITTABLE).copied().collect();
    common::ranks::run_ranks("tensor_parallel_rank", 2, &names);
}

/// Adapters trained on the whole model, loaded by the ranks of a split one: (fixture, form,
/// blocks adapted from the end). Dense and quantised bases, shared key/value heads, Phi-3's fused
/// projections, expert adapters, DoRA (whose norms span both ranks' columns) and PEFT's layout.
const ADAPTED: &[(&str, AdapterForm, usize)] = &[
    ("llama_gqa", AdapterForm::Lora, 2),
    ("qwen3_q4", AdapterForm::Lora, 1),
    ("phi3", AdapterForm::Lora, 2),
    ("qwen3_moe", AdapterForm::Lora, 2),
    ("gemma3_text", AdapterForm::Lora, 3),
    ("qwen2", AdapterForm::Dora, 2),
    ("llama_mqa_untied", AdapterForm::Peft, 2),
];

/// One rank's checks of [`ADAPTED`]; run only by `two_ranks_split_adapted_models`.
#[test]
#[ignore = "a rank of two_ranks_split_adapted_models"]
fn tensor_parallel_adapters_rank() {
    let tp = Ranks::new(Group::init(Backend::Ring, true).unwrap(), Backend::Ring);
    for (i, &(name, form, num_layers)) in ADAPTED.iter().enumerate() {
        let load = |dir: &std::path::Path, split: bool| load(dir, split.then_some(&tp)).unwrap();
        let (whole, split, prompt) = adapted_pair(name, form, num_layers, i as u64 + 1, load);
        let (adapted, adapted_steps) = logits(&whole, &prompt);
        let (split_logits, split_steps) = logits(&split, &prompt);
        let d = max_abs_diff(&split_logits, &adapted);
        assert!(d < 1e-4, "{name} ({form:?}): split and adapted vs whole and adapted differ by {d}");
        let d = max_abs_diff(&split_steps, &adapted_steps);
        assert!(d < 1e-4, "{name} ({form:?}): through the caches, {d}");
        assert_eq!(greedy(&split, &prompt, 6), greedy(&whole, &prompt, 6), "{name}: greedy tokens");
        println!("ok {name}");
    }
}

#[test]
fn two_ranks_split_adapted_models() {
    let names: Vec<&str> = ADAPTED.iter().map(|a| a.0).collect();
    common::ranks::run_ranks("tensor_parallel_adapters_rank", 2, &names);
}

/// One rank of `an_adapter_some_rank_cannot_read_is_loaded_nowhere`: each rank works in its own
/// folder and the adapter's folder is given relative to it, so that rank 0 reads it and rank 1
/// finds nothing there.
#[test]
#[ignore = "a rank of an_adapter_some_rank_cannot_read_is_loaded_nowhere"]
fn adapter_agreement_rank() {
    use rmlx_lm::engine::{Engine, EngineOptions, Lockstep, Request, Update};
    let tp = Ranks::new(Group::init(Backend::Ring, true).unwrap(), Backend::Ring);
    let dir = fixture_with_tokenizer("llama_gqa");
    let own = common::TempDir::new("adapter-agreement");
    std::env::set_current_dir(own.path()).unwrap();
    let mut whole = load(dir.path(), None).unwrap();
    if tp.rank() == 0 {
        attach_adapters(&mut whole, &own.path().join("adapter"), AdapterForm::Lora, 2, 9);
    }
    let split = load(dir.path(), Some(&tp)).unwrap();
    let engine = Engine::new(&split, EngineOptions::default());
    if tp.rank() != 0 {
        Lockstep::follow(engine, &tp).unwrap();
        println!("ok followed");
        return;
    }
    let mut engine = Lockstep::new(engine, Some(tp.clone()));
    let err = engine.load_adapter_dir("tuned", std::path::Path::new("adapter")).unwrap_err();
    assert_eq!(
        err.to_string(),
        "over the ranks of a split model: rank(s) 1 could not load the adapter `tuned` (their logs say why): no rank holds it"
    );
    assert!(engine.engine().adapter_names().is_empty());
    // The ranks are still in step: a request runs to its end on both.
    let prompt: Vec<u32> = (0..6).collect();
    let options = rmlx_lm::GenerateOptions { max_tokens: 4, ignore_eos: true, ..Default::default() };
    let seq = engine.submit(Request { prompt: prompt.clone(), options, ..Request::default() }).unwrap();
    let mut tokens = Vec::new();
    while !engine.engine().is_idle() {
        for u in engine.step().unwrap() {
            match u {
                Update::Token { seq: s, id, .. } if s == seq => tokens.push(id),
                Update::Failed { error, .. } => panic!("{error}"),
                _ => {}
            }
        }
    }
    engine.stop().unwrap();
    assert_eq!(tokens, greedy(&load(dir.path(), None).unwrap(), &prompt, 4), "the base model's tokens");
    println!("ok followed");
}

#[test]
fn an_adapter_some_rank_cannot_read_is_loaded_nowhere() {
    common::ranks::run_ranks("adapter_agreement_rank", 2, &["followed"]);
}
