//! Speculative decoding from the command line, on the default model: `generate --prompt-lookup`
//! and `--draft-model` give the plain run's token ids (greedy) and report their acceptance;
//! `chat --prompt-lookup` answers a two-turn conversation exactly as plain `chat` does; `serve`
//! speculates per request, also for requests batched together, and answers as a plain server.

mod support;

use serde_json::{json, Value};
use std::io::Write;
use std::process::{Command, Stdio};

const RMLX: &str = env!("CARGO_BIN_EXE_rmlx");
const EDIT: &str = "Copy this sentence exactly: the quick brown fox jumps over the lazy dog, and the lazy dog sleeps.";

fn generate(extra: &[&str]) -> Value {
    let out =
        Command::new(RMLX).args(["generate", "--prompt", EDIT, "-m", "24", "--json"]).args(extra).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn generate_speculatively_gives_the_plain_tokens() {
    let plain = generate(&[]);
    let lookup = generate(&["--prompt-lookup", "--num-draft-tokens", "4"]);
    assert_eq!(lookup["token_ids"], plain["token_ids"]);
    assert!(lookup["accepted_draft_tokens"].as_u64().unwrap() > 0, "{lookup}");
    let passes = lookup["model_passes"].as_u64().unwrap();
    let tokens = lookup["generation_tokens"].as_u64().unwrap();
    assert!(passes < tokens, "{passes} passes for {tokens} tokens");
    // The model drafting for itself: every draft kept.
    let path = rmlx_lm::registry::default_model().unwrap();
    let drafted = generate(&["--draft-model", path.to_str().unwrap(), "--num-draft-tokens", "2"]);
    assert_eq!(drafted["token_ids"], plain["token_ids"]);
    assert_eq!(drafted["accepted_draft_tokens"], drafted["draft_tokens"], "{drafted}");
    let out = Command::new(RMLX)
        .args(["generate", "--prompt", "hi", "--prompt-lookup", "--draft-model", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("cannot be used with"));
    // A prompt-cache file holds no tokens to draft from: refused, not ignored.
    let out = Command::new(RMLX)
        .args(["generate", "--prompt", "hi", "--prompt-lookup", "--prompt-cache-file", "/nonexistent.safetensors"])
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("holds no tokens"));
}

fn chat(extra: &[&str]) -> String {
    let mut child = Command::new(RMLX)
        .args(["chat", "-m", "20"])
        .args(extra)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(format!("{EDIT}\nAnd once more, the same sentence.\n").as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn chat_speculatively_answers_as_plain_chat() {
    let plain = chat(&[]);
    assert_eq!(plain.lines().count(), 2, "{plain}");
    assert_eq!(chat(&["--prompt-lookup"]), plain);
}

/// Four greedy requests, one after the other and then all at once: the texts and the usage.
fn serve_four(server: &support::Server, speculative: bool) -> Vec<(String, Value)> {
    let body = |i: usize| {
        json!({"messages": [{"role": "user", "content": format!("{EDIT} ({i})")}], "max_tokens": 24,
            "temperature": 0, "speculative": speculative})
    };
    let answer = |v: Value| (v["choices"][0]["message"]["content"].as_str().unwrap().to_string(), v["usage"].clone());
    let mut out: Vec<(String, Value)> = (0..2)
        .map(|i| {
            let (status, v) = server.post("/v1/chat/completions", &body(i));
            assert_eq!(status, 200, "{v}");
            answer(v)
        })
        .collect();
    let together: Vec<_> = (2..4)
        .map(|i| {
            let (addr, b) = (server.addr.clone(), body(i));
            std::thread::spawn(move || support::post(&addr, "/v1/chat/completions", &b))
        })
        .collect();
    for t in together {
        let (status, v) = t.join().unwrap();
        assert_eq!(status, 200, "{v}");
        out.push(answer(v));
    }
    out
}

#[test]
fn serve_speculates_per_request_and_in_a_batch() {
    let plain = serve_four(&support::Server::start(&[]), true);
    let server = support::Server::start(&["--prompt-lookup", "--num-draft-tokens", "4"]);
    let fast = serve_four(&server, true);
    let accepted = |u: &Value| u["completion_tokens_details"]["accepted_prediction_tokens"].as_u64().unwrap();
    let rejected = |u: &Value| u["completion_tokens_details"]["rejected_prediction_tokens"].as_u64().unwrap();
    for ((text, usage), (want, plain_usage)) in fast.iter().zip(&plain) {
        assert_eq!(text, want);
        assert_eq!(usage["completion_tokens"], plain_usage["completion_tokens"]);
        assert!(accepted(usage) > 0, "{usage}");
        assert_eq!((accepted(plain_usage), rejected(plain_usage)), (0, 0));
    }
    // `speculative: false`: no drafts, the same answers.
    for ((text, usage), (want, _)) in serve_four(&server, false).iter().zip(&plain) {
        assert_eq!(text, want);
        assert_eq!((accepted(usage), rejected(usage)), (0, 0), "{usage}");
    }
    let (_, metrics) = server.request("GET", "/metrics", None, &[]);
    let counter = |name: &str| -> u64 {
        let line = metrics.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    let kept: u64 = fast.iter().map(|(_, u)| accepted(u)).sum();
    assert_eq!(counter("rmlx_accepted_draft_tokens_total"), kept);
    assert!(counter("rmlx_draft_tokens_total") >= kept);
    // The model drafting for itself.
    let path = rmlx_lm::registry::default_model().unwrap();
    let drafted = serve_four(&support::Server::start(&["--draft-model", path.to_str().unwrap()]), true);
    for ((text, usage), (want, _)) in drafted.iter().zip(&plain) {
        assert_eq!(text, want);
        assert!(accepted(usage) > 0, "{usage}");
    }
}

#[test]
fn serve_refuses_what_it_cannot_speculate_with() {
    // A draft model folder that holds no model: the server does not start, and says why.
    let dir = std::env::temp_dir().join(format!("rmlx-spec-draft-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out =
        Command::new(RMLX).args(["serve", "--port", "0", "--draft-model", dir.to_str().unwrap()]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("draft model"), "{}", String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}
