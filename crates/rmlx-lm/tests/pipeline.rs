//! Pipeline parallelism over MLX's ring backend, two and three processes on this machine: each
//! rank holds a run of consecutive blocks of every native fixture model, and its logits (the
//! prompt in one pass, then one token at a time through the caches), greedy tokens and perplexity
//! must be exactly those of the whole model in one process: every block computes what it would
//! whole, and the last stage's output reaches every rank unchanged. Quantised models whose layers
//! tensor parallelism cannot cut split by blocks too; more ranks than blocks is an error. The
//! stages hand over by send and receive, or by all-sums alone (as over NCCL).

mod common;

use common::ranks::{adapted_pair, greedy, logits, AdapterForm};
use common::{fixture_with_tokenizer, max_abs_diff};
use rmlx::distributed::{Backend, Group};
use rmlx::Dtype;
use rmlx_lm::{LoadOptions, LoadedModel, Ranks};

/// Every native fixture, its blocks (2 to 6: runs of one to three blocks a rank).
const FIXTURES: &[(&str, usize)] = &[
    ("llama_gqa", 2),
    ("llama_gqa_q4", 2),
    ("llama_mqa_untied", 3),
    ("mistral", 2),
    ("mistral_window", 2),
    ("mistral_q4_mlx_lm", 2),
    ("qwen2", 2),
    ("qwen2_window", 2),
    ("qwen3", 2),
    ("qwen3_q4", 2),
    ("phi3", 2),
    ("phi3_q4", 2),
    ("phi3_mlx_lm", 2),
    ("gemma2", 4),
    ("gemma2_q4", 4),
    ("gemma3_text", 6),
    ("gemma3_text_pattern", 6),
    ("gemma3_multimodal_prefix", 6),
    ("qwen3_moe", 3),
    ("qwen3_moe_q4", 3),
    ("mixtral", 2),
    ("mixtral_q4_mlx_lm", 2),
    ("gpt_oss", 2),
    ("gpt_oss_mlx_lm", 2),
    ("gpt_oss_mxfp4_mlx_lm", 2),
];

fn load(dir: &std::path::Path, pipeline: Option<&Ranks>) -> rmlx_lm::Result<LoadedModel> {
    let opts = LoadOptions {
        dtype: Some(Dtype::Float32),
        dequantize: Some(false),
        pipeline_parallel: pipeline.cloned(),
        ..LoadOptions::default()
    };
    rmlx_lm::loader::load(dir, &opts)
}

/// The block a parameter is of (`model.layers.<i>.…`).
fn block_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?.split('.').next()?.parse().ok()
}

fn parameter_names(lm: &LoadedModel) -> Vec<String> {
    let mut names = Vec::new();
    lm.model.visit("", &mut |n, _, _| names.push(n.to_string()));
    names
}

/// One rank's checks, each fixture printing `ok <name>`; run by the tests below as every rank.
#[test]
#[ignore = "a rank of the pipeline tests below"]
fn pipeline_rank() {
    check_every_fixture(Ranks::new(Group::init(Backend::Ring, true).unwrap(), Backend::Ring));
}

/// The same, the stages handing over by all-sums only (as over NCCL, which has no send or receive).
#[test]
#[ignore = "a rank of the pipeline tests below"]
fn pipeline_rank_collectives_only() {
    let ranks = Ranks::new(Group::init(Backend::Ring, true).unwrap(), Backend::Ring).without_send_recv();
    check_every_fixture(ranks);
}

fn check_every_fixture(ranks: Ranks) {
    let (n, r) = (ranks.size(), ranks.rank());
    for &(name, blocks) in FIXTURES {
        let dir = fixture_with_tokenizer(name);
        if blocks < n {
            match load(dir.path(), Some(&ranks)) {
                Err(rmlx_lm::Error::Pipeline(why)) => {
                    assert_eq!(
                        why,
                        format!("{n} ranks cannot share a pipeline of {blocks} blocks (at most one rank a block)")
                    )
                }
                Err(e) => panic!("{name}: another error: {e}"),
                Ok(_) => panic!("{name}: {blocks} blocks split over {n} ranks"),
            }
            println!("ok {name}");
            continue;
        }
        let whole = load(dir.path(), None).unwrap();
        let split = load(dir.path(), Some(&ranks)).unwrap_or_else(|e| panic!("{name}: {e}"));
        // Runs as even as they can be, the first ranks one block longer.
        let (first, held) = (r * (blocks / n) + r.min(blocks % n), blocks / n + usize::from(r < blocks % n));
        assert_eq!(split.model.new_caches(None).len(), held, "{name}: caches of rank {r}");
        assert_eq!(
            split.layer_windows(),
            whole.layer_windows()[..].iter().skip(first).take(held).copied().collect::<Vec<_>>(),
            "{name}"
        );
        assert!(
            split.weight_bytes < whole.weight_bytes,
            "{name}: {} of {} bytes",
            split.weight_bytes,
            whole.weight_bytes
        );
        // The blocks held keep their checkpoint names (`model.layers.<i>.…` with i of the whole).
        let in_stage = |p: &String| block_of(p).is_none_or(|i| (first..first + held).contains(&i));
        let held_names: Vec<String> = parameter_names(&whole).into_iter().filter(in_stage).collect();
        assert_eq!(parameter_names(&split), held_names, "{name}");
        let prompt: Vec<u32> = (0..12u32).map(|i| (i * 7 + 3) % 30).collect();
        let (split_whole, split_steps) = logits(&split, &prompt);
        let (one_whole, one_steps) = logits(&whole, &prompt);
        assert_eq!(max_abs_diff(&split_whole, &one_whole), 0.0, "{name}: logits");
        assert_eq!(max_abs_diff(&split_steps, &one_steps), 0.0, "{name}: logits through the caches");
        assert_eq!(greedy(&split, &prompt, 8), greedy(&whole, &prompt, 8), "{name}: greedy tokens");
        let nll = |lm| rmlx_lm::generate::negative_log_likelihood(lm, &prompt, 4).unwrap();
        assert_eq!(nll(&split), nll(&whole), "{name}: negative log-likelihood");
        println!("ok {name}");
    }
}

fn names() -> Vec<&'static str> {
    FIXTURES.iter().map(|&(name, _)| name).collect()
}

#[test]
fn two_ranks_pipeline_every_fixture() {
    common::ranks::run_ranks("pipeline_rank", 2, &names());
}

#[test]
fn three_ranks_pipeline_every_fixture_with_three_blocks() {
    common::ranks::run_ranks("pipeline_rank", 3, &names());
}

#[test]
fn three_ranks_hand_over_by_all_sums_alone() {
    common::ranks::run_ranks("pipeline_rank_collectives_only", 3, &names());
}

/// Adapters trained on the whole model, loaded by the stages of a pipeline: (fixture, form,
/// blocks adapted from the end), so that some stages hold adapted blocks and others not.
const ADAPTED: &[(&str, AdapterForm, usize)] = &[
    ("llama_mqa_untied", AdapterForm::Peft, 1),
    ("qwen3_moe", AdapterForm::Lora, 2),
    ("gemma2_q4", AdapterForm::Lora, 2),
    ("gemma3_text", AdapterForm::Dora, 4),
];

/// One rank's checks of [`ADAPTED`]: every stage reads its own blocks' adapters from the whole
/// model's file, and the logits are exactly the whole adapted model's.
#[test]
#[ignore = "a rank of three_ranks_pipeline_adapted_models"]
fn pipeline_adapters_rank() {
    let ranks = Ranks::new(Group::init(Backend::Ring, true).unwrap(), Backend::Ring);
    for (i, &(name, form, num_layers)) in ADAPTED.iter().enumerate() {
        let load = |dir: &std::path::Path, split: bool| load(dir, split.then_some(&ranks)).unwrap();
        let (whole, split, prompt) = adapted_pair(name, form, num_layers, i as u64 + 1, load);
        let (adapted, adapted_steps) = logits(&whole, &prompt);
        let (split_logits, split_steps) = logits(&split, &prompt);
        assert_eq!(max_abs_diff(&split_logits, &adapted), 0.0, "{name} ({form:?}): logits");
        assert_eq!(max_abs_diff(&split_steps, &adapted_steps), 0.0, "{name} ({form:?}): through the caches");
        println!("ok {name}");
    }
}

#[test]
fn three_ranks_pipeline_adapted_models() {
    let names: Vec<&str> = ADAPTED.iter().map(|a| a.0).collect();
    common::ranks::run_ranks("pipeline_adapters_rank", 3, &names);
}
