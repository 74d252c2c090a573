//! Speculative decoding from the command line, on the default model: `generate --prompt-lookup`
//! and `--draft-model` give the plain run's token ids (greedy) and report their acceptance;
//! `chat --prompt-lookup` answers a two-turn conversation exactly as plain `chat` does.

use serde_json::Value;
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
