//! The built `rmlx` binary, end to end, many times in a row with the default model: every run must
//! exit with status 0 and print exactly what the first run of its kind printed.
//!
//! This guards the process-exit path. MLX leaks its scheduler, so work still queued on a stream
//! when `main` returns used to race with OpenBLAS's library destructor (heap corruption, SIGSEGV or a
//! hang after the answer had been printed, in roughly one run of ten). rmlx-sys now drains its
//! streams in an `atexit` handler; a regression shows up here as a signal, a non-zero status or a
//! time-out. Its own test binary, so that no other test competes for the cores meanwhile.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs in total, cycling through the four kinds below.
const RUNS: usize = 52;
/// A run that takes longer than this is a hang.
const TIME_LIMIT: Duration = Duration::from_secs(180);

const PROMPT: &str = "Write a haiku about the sea.";

/// One kind of run: its name, its arguments and the text it pipes into stdin.
struct Kind {
    name: &'static str,
    args: Vec<String>,
    stdin: &'static str,
}

fn kinds(text_file: &Path) -> Vec<Kind> {
    let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    vec![
        Kind {
            name: "generate --raw",
            args: args(&["generate", "--prompt", PROMPT, "--temp", "0", "--max-tokens", "24", "--raw"]),
            stdin: "",
        },
        Kind {
            name: "generate --json",
            args: args(&["generate", "--prompt", PROMPT, "--temp", "0", "--max-tokens", "24", "--json"]),
            stdin: "",
        },
        Kind {
            name: "chat (piped)",
            args: args(&["chat", "--temp", "0", "--max-tokens", "16"]),
            stdin: "Name a colour.\nAnd another one?\n",
        },
        Kind {
            name: "perplexity --json",
            args: {
                let mut a = args(&["perplexity", "--json", "--text-file"]);
                a.push(text_file.display().to_string());
                a
            },
            stdin: "",
        },
    ]
}

/// What a run printed that must not change between runs: stdout, minus the timing fields of
/// `generate --json` (speeds and memory differ from run to run).
fn stable_output(kind: &Kind, stdout: &[u8]) -> String {
    let text = String::from_utf8_lossy(stdout).into_owned();
    if kind.name != "generate --json" {
        return text;
    }
    let mut v: serde_json::Value = serde_json::from_str(text.trim())
        .unwrap_or_else(|e| panic!("generate --json printed something that is not JSON ({e}): {text:?}"));
    for field in ["prompt_tps", "generation_tps", "ttft_ms", "peak_memory_gb"] {
        v.as_object_mut().expect("a JSON object").remove(field);
    }
    v.to_string()
}

struct Outcome {
    status: std::process::ExitStatus,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    elapsed: Duration,
}

/// Runs `rmlx` once; `None` if it was still running after [`TIME_LIMIT`] (then it is killed).
fn run_once(bin: &Path, kind: &Kind) -> Option<Outcome> {
    let dir = std::env::temp_dir().join(format!("rmlx-repeat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Files rather than pipes: a child that hangs must not block the reader.
    let (out_path, err_path) = (dir.join("stdout"), dir.join("stderr"));
    let start = Instant::now();
    let mut child = Command::new(bin)
        .args(&kind.args)
        .stdin(Stdio::piped())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .expect("spawning rmlx");
    child.stdin.take().unwrap().write_all(kind.stdin.as_bytes()).unwrap();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(Outcome {
                status,
                stdout: std::fs::read(&out_path).unwrap(),
                stderr: std::fs::read(&err_path).unwrap(),
                elapsed: start.elapsed(),
            });
        }
        if start.elapsed() > TIME_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        _ => format!("{status:?}"),
    }
}

#[test]
fn every_run_exits_cleanly_with_identical_output() {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_rmlx"));
    let text_file = std::env::temp_dir().join(format!("rmlx-repeat-{}.txt", std::process::id()));
    std::fs::write(
        &text_file,
        "The sea is calm tonight. The tide is full, the moon lies fair upon the straits; on the French \
         coast the light gleams and is gone.\n",
    )
    .unwrap();
    let kinds = kinds(&text_file);
    let mut first: Vec<Option<String>> = vec![None; kinds.len()];
    let mut failures = Vec::new();
    let mut slowest = Duration::ZERO;
    for i in 0..RUNS {
        let kind = &kinds[i % kinds.len()];
        let Some(o) = run_once(&bin, kind) else {
            failures.push(format!("run {i} ({}): still running after {TIME_LIMIT:?}, killed", kind.name));
            continue;
        };
        slowest = slowest.max(o.elapsed);
        let stderr = String::from_utf8_lossy(&o.stderr);
        if !o.status.success() {
            let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
            failures.push(format!("run {i} ({}): {}; stderr ends {:?}", kind.name, describe(o.status), tail));
            continue;
        }
        let out = stable_output(kind, &o.stdout);
        assert!(!out.trim().is_empty(), "run {i} ({}) printed nothing; stderr: {stderr}", kind.name);
        match &first[i % kinds.len()] {
            None => first[i % kinds.len()] = Some(out),
            Some(expected) if *expected != out => failures
                .push(format!("run {i} ({}): output {out:?} differs from the first run's {expected:?}", kind.name)),
            Some(_) => {}
        }
    }
    let _ = std::fs::remove_file(&text_file);
    assert!(failures.is_empty(), "{} of {RUNS} runs failed:\n{}", failures.len(), failures.join("\n"));
    eprintln!("{RUNS} runs, all clean; slowest {slowest:.1?}");
}
