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

#[test]
fn adapters_over_the_ranks_are_refused() {
    for how in [None, Some("--pipeline")] {
        let mut args = vec!["launch", "-n", "3", "--", "generate", "--prompt", "hi", "--adapter-path", "./adapters"];
        args.extend(how);
        let out = rmlx(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains("--adapter-path: adapters are not applied over the 3 ranks of a split model yet"),
            "{how:?}: {stderr}"
        );
    }
}

#[test]
fn commands_that_do_not_split_refuse_to_run_as_ranks() {
    let out = rmlx(&["launch", "-n", "2", "--", "inspect", "--prompt", "hi", "--out", "keys.npy"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("error: `rmlx inspect` does not run as the ranks of a job yet"), "{stderr}");
}

/// `rmlx chat`'s standard output for `input` on its standard input.
fn chat(args: &[&str], input: &str) -> Output {
    use std::io::Write;
    let mut child = Command::new(RMLX)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn chat_over_the_ranks_answers_as_one_process() {
    // Two turns (the second reusing the first's keys and values), a reset, a third, then /exit.
    let input = "What is 2+2?\nAnd 3+3?\n/reset\nName a colour.\n/exit\n";
    let one = chat(&["chat", "--max-tokens", "12"], input);
    assert!(one.status.success(), "{}", String::from_utf8_lossy(&one.stderr));
    let want: Vec<String> = String::from_utf8_lossy(&one.stdout).lines().map(|l| format!("[rank 0] {l}")).collect();
    assert_eq!(want.len(), 3, "{want:?}");
    // Split by tensors over 3 ranks, by blocks over 2: rank 0 reads the launcher's input.
    for how in [&["launch", "-n", "3", "--", "chat"][..], &["launch", "-n", "2", "--", "chat", "--pipeline"]] {
        let out = chat(&[how, &["--max-tokens", "12"]].concat(), input);
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{how:?}: {stdout}\n{stderr}");
        assert_eq!(stdout.lines().collect::<Vec<_>>(), want, "{how:?}");
        assert!(!stderr.contains("stopping rank"), "{how:?}: the other ranks ended with rank 0: {stderr}");
    }
}

#[test]
fn batch_split_over_three_ranks_writes_the_results_of_one_process() {
    let dir = std::env::temp_dir().join(format!("rmlx-launch-batch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prompts = dir.join("prompts.jsonl");
    let lines = [
        r#"{"prompt": "Name a colour.", "max_tokens": 8}"#,
        r#"{"prompt": "Say hi.", "temperature": 0.7, "seed": 3}"#,
        r#"{"messages": [{"role": "user", "content": "What is 2+2?"}]}"#,
    ];
    std::fs::write(&prompts, lines.join("\n") + "\n").unwrap();
    let args = ["batch", "--prompts", prompts.to_str().unwrap(), "--max-tokens", "12"];
    let one = rmlx(&args);
    assert!(one.status.success(), "{}", String::from_utf8_lossy(&one.stderr));
    // Rank 0 alone writes, in input order, what one process writes: split by tensors or by
    // blocks (3 runs of 10).
    let want: Vec<String> = String::from_utf8_lossy(&one.stdout).lines().map(|l| format!("[rank 0] {l}")).collect();
    assert_eq!(want.len(), 3);
    for how in [None, Some("--pipeline")] {
        let mut launch = vec!["launch", "-n", "3", "--backend", "ring", "--"];
        launch.extend(args);
        launch.extend(how);
        let split = rmlx(&launch);
        let stdout = String::from_utf8_lossy(&split.stdout);
        assert!(split.status.success(), "{how:?}: {stdout}\n{}", String::from_utf8_lossy(&split.stderr));
        assert_eq!(stdout.lines().collect::<Vec<_>>(), want, "{how:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn a_hostfile_of_this_machine_runs_one_rank_on_each_host() {
    let dir = std::env::temp_dir().join(format!("rmlx-launch-hosts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let hostfile = dir.join("hosts.json");
    // mlx.launch's object form: the backend and environment come from the file.
    let hosts = r#"{"backend": "ring", "envs": ["RMLX_LOG=info"],
        "hosts": [{"ssh": "localhost", "ips": ["127.0.0.1"]}, {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}]}"#;
    std::fs::write(&hostfile, hosts).unwrap();
    let args = ["generate", "--prompt", "Name a colour.", "--max-tokens", "8", "--json"];
    let whole = generated_ids(&rmlx(&args));
    let port = free_port().to_string();
    let mut launch = vec!["launch", "--hostfile", hostfile.to_str().unwrap(), "--starting-port", &port, "--"];
    launch.extend(args);
    launch.push("--pipeline");
    let out = rmlx(&launch);
    assert!(out.stdout.starts_with(b"[rank 0] "), "{}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(generated_ids(&out), whole);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("[rank 0] rank 0 of 2 (ring)"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn remote_hosts_are_reached_by_ssh() {
    // An `ssh` first on PATH that logs how it was called and runs the command here.
    let dir = std::env::temp_dir().join(format!("rmlx-launch-ssh-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("ssh.log");
    let ssh = dir.join("ssh");
    let script = format!(
        "#!/bin/sh\necho \"$1 $2 $3 $4\" >> '{}'\nfor last; do :; done\nexec /bin/sh -c \"$last\"\n",
        log.display()
    );
    std::fs::write(&ssh, script).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&ssh, std::fs::Permissions::from_mode(0o755)).unwrap();
    let hostfile = dir.join("hosts.json");
    std::fs::write(&hostfile, r#"[{"ssh": "node-a", "ips": ["127.0.0.1"]}, {"ssh": "node-b", "ips": ["127.0.0.1"]}]"#)
        .unwrap();
    let path = format!("{}:{}", dir.display(), std::env::var("PATH").unwrap());
    let port = free_port().to_string();
    let out = Command::new(RMLX)
        .args(["launch", "--hostfile", hostfile.to_str().unwrap(), "-n", "2", "--starting-port", &port, "--"])
        .args(["bench-collective", "--sizes", "8", "--iters", "2", "--json"])
        .env("PATH", path)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // Two ranks on each host: four in one ring, rank 0 reporting.
    let row: Value = serde_json::from_str(stdout.trim().strip_prefix("[rank 0] ").unwrap()).unwrap();
    assert_eq!((row["backend"].as_str(), row["ranks"].as_u64()), (Some("ring"), Some(4)), "{row}");
    let mut calls: Vec<String> = std::fs::read_to_string(&log).unwrap().lines().map(str::to_string).collect();
    calls.sort();
    let want = [
        "-tt -o LogLevel=QUIET node-a",
        "-tt -o LogLevel=QUIET node-a",
        "-tt -o LogLevel=QUIET node-b",
        "-tt -o LogLevel=QUIET node-b",
    ];
    assert_eq!(calls, want);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn hostfile_mistakes_are_errors_naming_them() {
    let dir = std::env::temp_dir().join(format!("rmlx-launch-badhosts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        ("[]", "the hostfile lists no hosts"),
        (r#"{"hosts": "node1"}"#, "not a hostfile (a JSON list of"),
        (r#"[{"ssh": "node1"}]"#, "host `node1` has no \"ips\": the ring backend needs the address it listens on"),
        (
            r#"{"backend": "jaccl", "hosts": [{"ssh": "node1", "ips": ["10.0.0.1"]}]}"#,
            "backend `jaccl`: rmlx launches `ring` and `nccl` jobs",
        ),
        (
            r#"{"envs": ["NOVALUE"], "hosts": [{"ssh": "node1", "ips": ["10.0.0.1"]}]}"#,
            "`NOVALUE` in \"envs\" is not NAME=VALUE",
        ),
    ];
    for (i, (text, want)) in cases.iter().enumerate() {
        let hostfile = dir.join(format!("hosts{i}.json"));
        std::fs::write(&hostfile, text).unwrap();
        let out = rmlx(&["launch", "--hostfile", hostfile.to_str().unwrap(), "--", "bench-collective"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{text}: {stderr}");
        assert!(stderr.contains(want), "{text}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
