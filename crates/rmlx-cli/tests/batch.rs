//! `rmlx batch` with the default model: each result equals `rmlx generate`'s for the same prompt
//! (raw and chat), in input order with the ids passed through; `--classify` reports the token
//! `generate` would start with, as the most likely of `--top`; `--ignore-eos` generates every
//! prompt's `max_tokens` and the totals go to stderr; a `response_format` constrains its line; a
//! bad line is named.

use serde_json::{json, Value};
use std::process::{Command, Output, Stdio};

const RMLX: &str = env!("CARGO_BIN_EXE_rmlx");

fn rmlx(args: &[&str]) -> Output {
    Command::new(RMLX).args(args).stdin(Stdio::null()).output().unwrap()
}

/// `rmlx generate --json` (greedy): (text, token ids, prompt tokens).
fn generate(prompt: &str, raw: bool, max_tokens: usize) -> (String, Vec<u64>, u64) {
    let m = max_tokens.to_string();
    let mut args = vec!["generate", "--prompt", prompt, "--max-tokens", &m, "--json"];
    if raw {
        args.push("--raw");
    }
    let out = rmlx(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids = v["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    (v["text"].as_str().unwrap().to_string(), ids, v["prompt_tokens"].as_u64().unwrap())
}

fn write_prompts(name: &str, lines: &[Value]) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("rmlx-batch-{name}-{}.jsonl", std::process::id()));
    std::fs::write(&p, lines.iter().map(|l| format!("{l}\n")).collect::<String>()).unwrap();
    p
}

fn results(out: &Output) -> Vec<Value> {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout.clone()).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn batch_results_equal_generate_in_input_order() {
    let prompts = write_prompts(
        "gen",
        &[
            json!({"id": "capital", "prompt": "The capital of France is", "max_tokens": 10}),
            json!({"id": 7, "messages": [{"role": "user", "content": "What is the capital of France?"}]}),
            json!({"prompt": "Once upon a time", "max_tokens": 3}),
        ],
    );
    let r = results(&rmlx(&["batch", "--prompts", prompts.to_str().unwrap(), "--max-tokens", "12", "--temp", "0"]));
    assert_eq!(r.len(), 3);
    let expected = [
        generate("The capital of France is", true, 10),
        generate("What is the capital of France?", false, 12),
        generate("Once upon a time", true, 3),
    ];
    for (i, (text, ids, prompt_tokens)) in expected.iter().enumerate() {
        assert_eq!(r[i]["index"], i);
        assert_eq!(r[i]["text"].as_str().unwrap(), text, "prompt {i}");
        assert_eq!(r[i]["completion_tokens"].as_u64(), Some(ids.len() as u64));
        assert_eq!(r[i]["prompt_tokens"].as_u64(), Some(*prompt_tokens));
    }
    assert_eq!((r[0]["id"].clone(), r[1]["id"].clone(), r[2]["id"].clone()), (json!("capital"), json!(7), Value::Null));
    assert_eq!(r[2]["finish_reason"], "length");
    // With speculative decoding (prompt lookup): the same texts, and the drafts counted.
    let fast = results(&rmlx(&[
        "batch",
        "--prompts",
        prompts.to_str().unwrap(),
        "--max-tokens",
        "12",
        "--temp",
        "0",
        "--prompt-lookup",
    ]));
    for (i, (text, ..)) in expected.iter().enumerate() {
        assert_eq!(fast[i]["text"].as_str().unwrap(), text, "prompt {i}");
        assert!(fast[i]["accepted_draft_tokens"].as_u64().unwrap() <= fast[i]["draft_tokens"].as_u64().unwrap());
    }

    // --ignore-eos: every prompt gets its max_tokens; the totals go to stderr.
    let out = rmlx(&["batch", "--prompts", prompts.to_str().unwrap(), "--max-tokens", "12", "--ignore-eos"]);
    let long = results(&out);
    for (i, n) in [10, 12, 3].into_iter().enumerate() {
        assert_eq!((long[i]["completion_tokens"].as_u64(), &long[i]["finish_reason"]), (Some(n), &json!("length")));
    }
    let prompt_total: u64 = expected.iter().map(|e| e.2).sum();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("3 prompts, {prompt_total} prompt tokens (")), "{stderr}");
    assert!(stderr.contains(" 25 generated in "), "{stderr}");

    // --classify: the first token generate takes is the most likely; three, best first.
    let out = rmlx(&["batch", "--prompts", prompts.to_str().unwrap(), "--classify", "--top", "3"]);
    let c = results(&out);
    for (i, (_, ids, _)) in expected.iter().enumerate() {
        let top = c[i]["top"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0]["id"].as_u64(), Some(ids[0]), "prompt {i}");
        assert!(
            top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64()
                && top[1]["logprob"].as_f64() >= top[2]["logprob"].as_f64()
        );
        assert!(c[i].get("text").is_none());
    }
    let _ = std::fs::remove_file(prompts);
}

#[test]
fn a_bad_line_is_named_before_anything_runs() {
    for (lines, expected) in [
        (vec![json!({"prompt": "hi"}), json!({"promt": "typo"})], "line 2"),
        (vec![json!({"prompt": "hi", "messages": []})], "exactly one of \"prompt\" and \"messages\""),
        (vec![json!({"prompt": "hi"}), json!({"messages": []})], "line 2: \"messages\" is empty"),
        (vec![json!({"prompt": "hi"}), json!({"prompt": "x", "response_format": {"type": "xml"}})], "line 2"),
        (vec![json!({"prompt": "x", "response_format": {"type": "regex"}})], "needs `regex`, a string"),
    ] {
        let p = write_prompts("bad", &lines);
        let out = rmlx(&["batch", "--prompts", p.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(err.contains(expected), "{err}");
        assert!(out.stdout.is_empty());
        let _ = std::fs::remove_file(p);
    }
}

/// `response_format` per line: a regex-constrained line gives a whole match and stops there, in the
/// same batch as an unconstrained line that still gives `generate`'s text.
#[test]
fn a_line_with_a_response_format_is_constrained() {
    let prompts = write_prompts(
        "format",
        &[
            json!({"prompt": "A product code:", "max_tokens": 20,
                   "response_format": {"type": "regex", "regex": "[A-Z]{3}-[0-9]{4}"}}),
            json!({"prompt": "The capital of France is", "max_tokens": 6}),
        ],
    );
    let r = results(&rmlx(&["batch", "--prompts", prompts.to_str().unwrap(), "--temp", "0"]));
    let code = r[0]["text"].as_str().unwrap();
    let b = code.as_bytes();
    assert!(
        b.len() == 8
            && b[..3].iter().all(u8::is_ascii_uppercase)
            && b[3] == b'-'
            && b[4..].iter().all(u8::is_ascii_digit),
        "{code:?}"
    );
    assert_eq!(r[0]["finish_reason"], "stop");
    assert_eq!(r[1]["text"].as_str().unwrap(), generate("The capital of France is", true, 6).0);
    let _ = std::fs::remove_file(prompts);
}

/// A prompt that cannot run gets its own error object, in its place; the others complete with
/// what they give alone, and the run exits with status 1 naming how many failed.
#[test]
fn a_failing_prompt_gets_its_error_and_the_others_complete() {
    let prompts = write_prompts(
        "isolated",
        &[
            json!({"id": "a", "prompt": "The capital of France is", "max_tokens": 5}),
            json!({"id": "zero", "prompt": "Hello", "max_tokens": 0}),
            json!({"id": "empty", "prompt": "x", "response_format": {"type": "regex", "regex": "[^\\s\\S]"}}),
            json!({"id": "b", "prompt": "Once upon a time", "max_tokens": 4}),
        ],
    );
    let out = rmlx(&["batch", "--prompts", prompts.to_str().unwrap(), "--temp", "0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("2 of 4 prompts failed"), "{err}");
    let r: Vec<Value> =
        String::from_utf8(out.stdout.clone()).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(
        r.iter().map(|l| l["id"].clone()).collect::<Vec<_>>(),
        vec![json!("a"), json!("zero"), json!("empty"), json!("b")]
    );
    assert!(r[1]["error"].as_str().unwrap().contains("max_tokens must be at least 1"), "{}", r[1]);
    assert!(r[2]["error"].as_str().unwrap().contains("grammar admits no text"), "{}", r[2]);
    assert_eq!(r[0]["text"].as_str().unwrap(), generate("The capital of France is", true, 5).0);
    assert_eq!(r[3]["text"].as_str().unwrap(), generate("Once upon a time", true, 4).0);
    let _ = std::fs::remove_file(prompts);
}

/// `--kv-bits`: the batch's keys and values packed from the first position. At 8 bits the default
/// model's short answers are the full cache's, token for token; at 4 bits every line still gets
/// one; settings MLX cannot pack are errors naming the flag.
#[test]
fn a_quantised_cache_keeps_short_answers() {
    let lines: Vec<Value> = ["The capital of France is", "Once upon a time", "List three colours:"]
        .iter()
        .map(|p| json!({"prompt": p, "max_tokens": 8}))
        .collect();
    let path = write_prompts("kv", &lines);
    let texts = |extra: &[&str]| -> Vec<String> {
        let mut args = vec!["batch", "--prompts", path.to_str().unwrap(), "--temp", "0"];
        args.extend_from_slice(extra);
        let out = rmlx(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        results(&out).iter().map(|r| r["text"].as_str().unwrap().to_string()).collect()
    };
    let full = texts(&[]);
    assert_eq!(texts(&["--kv-bits", "8", "--quantized-kv-start", "0"]), full);
    let four = texts(&["--kv-bits", "4", "--quantized-kv-start", "0"]);
    assert!(four.iter().all(|t| !t.is_empty()), "{four:?}");
    for (flags, message) in [
        (["--kv-bits", "7", "--kv-group-size", "64"], "--kv-bits 7 is not supported"),
        (["--kv-bits", "4", "--kv-group-size", "96"], "--kv-group-size 96 is not supported"),
    ] {
        let mut args = vec!["batch", "--prompts", path.to_str().unwrap()];
        args.extend_from_slice(&flags);
        let out = rmlx(&args);
        assert_eq!(out.status.code(), Some(1));
        assert!(String::from_utf8_lossy(&out.stderr).contains(message), "{}", String::from_utf8_lossy(&out.stderr));
    }
}
