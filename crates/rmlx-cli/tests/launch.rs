//! `rmlx launch` over MLX's ring on this machine, with `rmlx bench-collective` as the ranks'
//! command: ranks join one group and sum across it; output comes back prefixed by rank; one
//! failing rank fails the launch, naming it.

use serde_json::Value;
use std::process::{Command, Output, Stdio};

const RMLX: &str = env!("CARGO_BIN_EXE_rmlx");

fn rmlx(args: &[&str]) -> Output {
    Command::new(RMLX).args(args).stdin(Stdio::null()).output().unwrap()
}

#[test]
fn ranks_sum_over_the_ring_and_rank_zero_reports() {
    let out = rmlx(&["launch", "-n", "3", "--", "bench-collective", "--sizes", "8,4096", "--iters", "3", "--json"]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // Every rank checked the sum it received (1 + 2 + 3 everywhere); rank 0 alone prints.
    let rows: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l.strip_prefix("[rank 0] ").unwrap_or_else(|| panic!("{l:?}"))).unwrap())
        .collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    for (row, bytes) in rows.iter().zip([8, 4096]) {
        assert_eq!(
            (row["backend"].as_str(), row["ranks"].as_u64(), row["bytes"].as_u64()),
            (Some("ring"), Some(3), Some(bytes))
        );
        assert!(row["median_us"].as_f64().unwrap() > 0.0);
    }
}

#[test]
fn a_failing_rank_fails_the_launch_naming_it() {
    let out = rmlx(&["launch", "-n", "2", "--", "generate", "--model", "/nonexistent/model", "--prompt", "hi"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    // The first rank to fail is named, and its own error came through whole (the other may have
    // been stopped before it printed anything).
    let last = stderr.lines().last().unwrap();
    let rank = last
        .strip_prefix("error: rank ")
        .and_then(|r| r.strip_suffix(" of 2 failed (exit status: 1); the other ranks were stopped"))
        .unwrap_or_else(|| panic!("{stderr}"));
    assert!(stderr.contains(&format!("[rank {rank}] error: loading /nonexistent/model")), "{stderr}");
}

#[test]
fn bench_collective_outside_a_launch_says_how_to_run_it() {
    let out = rmlx(&["bench-collective"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr.contains("rmlx launch -n 2 -- bench-collective"), "{stderr}");
}

/// The token ids a successful `generate --json` wrote (rank 0's line, under `rmlx launch`).
fn generated_ids(out: &Output) -> Vec<u64> {
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let line = stdout.strip_prefix("[rank 0] ").unwrap_or(&stdout);
    let v: Value = serde_json::from_str(line.trim()).unwrap_or_else(|e| panic!("{e}: {stdout:?}"));
    v["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
}

#[test]
fn generate_split_over_three_ranks_gives_the_tokens_of_one_process() {
    let args =
        ["generate", "--prompt", "Explain what photosynthesis is in simple terms.", "--max-tokens", "16", "--json"];
    let whole = generated_ids(&rmlx(&args));
    assert_eq!(whole.len(), 16);
    // SmolLM2-135M's 9 query and 3 key/value heads, 1536 feed-forward features and 4-bit groups of
    // 32 split over 3 ranks; rank 0 alone writes the result and progress.
    let mut launch = vec!["launch", "-n", "3", "--backend", "ring", "--"];
    launch.extend(args);
    let out = rmlx(&launch);
    assert!(out.stdout.starts_with(b"[rank 0] "), "{}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(generated_ids(&out), whole);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("[rank 0] rank 0 of 3 (ring)"), "{stderr}");
    assert!(!stderr.contains("[rank 1]") && !stderr.contains("[rank 2]"), "{stderr}");
}

#[test]
fn heads_the_ranks_cannot_share_are_an_error_at_load() {
    let out = rmlx(&["launch", "-n", "2", "--", "generate", "--prompt", "hi", "--max-tokens", "2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("tensor parallelism: 2 ranks cannot share 9 query heads and 3 key/value heads evenly"),
        "{stderr}"
    );
    assert!(stderr.contains("; `--pipeline` splits the model by blocks instead"), "{stderr}");
}

#[test]
fn generate_pipelined_over_two_ranks_gives_the_tokens_of_one_process() {
    let args =
        ["generate", "--prompt", "Explain what photosynthesis is in simple terms.", "--max-tokens", "16", "--json"];
    let whole = generated_ids(&rmlx(&args));
    // Two ranks cannot share SmolLM2-135M's 9 heads, but can its 30 blocks: 15 each.
    let mut launch = vec!["launch", "-n", "2", "--"];
    launch.extend(args);
    launch.push("--pipeline");
    let out = rmlx(&launch);
    assert!(out.stdout.starts_with(b"[rank 0] "), "{}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(generated_ids(&out), whole);
}

#[test]
fn pipeline_outside_a_job_or_to_train_is_an_error() {
    let out = rmlx(&["generate", "--pipeline", "--prompt", "hi", "--max-tokens", "2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr
            .contains("error: --pipeline splits a model over the ranks of `rmlx launch`, and this process is not one"),
        "{stderr}"
    );
    let dir = std::env::temp_dir().join(format!("rmlx-launch-blocks-{}", std::process::id()));
    let out = rmlx(&["launch", "-n", "2", "--", "lora", "--pipeline", "--train", "--data", dir.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--pipeline: the ranks of `rmlx lora` train data-parallel"), "{stderr}");
}
