//! `--backend` on `rmlx generate` (native and auto give the same tokens; an architecture only
//! mlx-lm has runs through it), `rmlx backends` (listing, installing mlx-lm), and `rmlx inspect`
//! (the keys file and the summary table).

mod support;

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const RMLX: &str = env!("CARGO_BIN_EXE_rmlx");

fn rmlx(args: &[&str]) -> Output {
    Command::new(RMLX).args(args).stdin(Stdio::null()).output().unwrap()
}

fn json_of(out: &Output) -> Value {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn temp(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("rmlx-cli-backends-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).unwrap();
    p
}

#[test]
fn generate_native_and_auto_agree_and_name_the_backend() {
    let run = |backend: &str| {
        json_of(&rmlx(&[
            "generate",
            "-p",
            "The capital of France is",
            "--raw",
            "-m",
            "6",
            "--json",
            "--backend",
            backend,
        ]))
    };
    let (native, auto) = (run("native"), run("auto"));
    assert_eq!(native["token_ids"], auto["token_ids"]);
    assert_eq!(native["token_ids"].as_array().unwrap().len(), 6);
    assert_eq!((native["backend"].as_str(), auto["backend"].as_str()), (Some("native"), Some("native")));
    let out = rmlx(&["generate", "-p", "x", "--backend", "bogus"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown backend `bogus`") && err.contains("mlx-lm"), "{err}");
}

/// A starcoder2 fixture (an architecture rmlx does not implement) with a word-level tokenizer.
fn starcoder2_folder() -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../rmlx-lm/tests/fixtures/models/starcoder2_mlx_lm");
    let dir = temp("starcoder2");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let vocab: serde_json::Map<String, Value> = (0..512).map(|i| (format!("t{i}"), Value::from(i))).collect();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    // A chat template that writes the messages' contents one after another.
    let config = r#"{"tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}"#;
    std::fs::write(dir.join("tokenizer_config.json"), config).unwrap();
    dir
}

#[test]
fn backends_installs_mlx_lm_and_generate_falls_back_to_it() {
    let listed = json_of(&rmlx(&["backends", "--install-mlx-lm", "--json"]));
    let names: Vec<&str> = listed["backends"].as_array().unwrap().iter().map(|b| b["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["native", "mlx-lm"]);
    assert_eq!(listed["mlx_lm"]["available"], true, "{listed}");
    assert_eq!(listed["mlx_lm"]["version"], "0.32.2");

    let model = starcoder2_folder();
    let m = model.to_str().unwrap();
    let checked = json_of(&rmlx(&["backends", "--model", m, "--json"]));
    assert_eq!(checked["backends"][0]["supports_model"], false);
    assert!(checked["backends"][0]["why_not"].as_str().unwrap().contains("starcoder2"));
    assert_eq!(checked["backends"][1]["supports_model"], true);

    let v = json_of(&rmlx(&["generate", "--model", m, "-p", "t1 t2 t3", "--raw", "-m", "8", "--json"]));
    assert_eq!(v["backend"], "mlx-lm");
    assert_eq!(v["token_ids"], serde_json::json!([58, 161, 458, 353, 74, 94, 300, 92]));
    assert_eq!(v["finish_reason"], "length");
    // A conversation through the bridge: the template gives the prompt "t1 t2 t3 ".
    let mut chat = Command::new(RMLX)
        .args(["chat", "--model", m, "-m", "4"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write as _;
    chat.stdin.take().unwrap().write_all(b"t1 t2 t3\n/exit\n").unwrap();
    let out = chat.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let reply = String::from_utf8_lossy(&out.stdout);
    assert_eq!(reply.split_whitespace().collect::<Vec<_>>(), ["t58", "t161", "t458", "t353"], "{reply}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("(mlx-lm)"));

    // rmlx batch through mlx-lm: lines grouped by their settings, in input order; --classify.
    let prompts = model.join("prompts.jsonl");
    std::fs::write(
        &prompts,
        concat!(
            r#"{"id": "a", "prompt": "t1 t2 t3", "max_tokens": 4}"#,
            "\n",
            r#"{"id": "b", "messages": [{"role": "user", "content": "t1 t2 t3"}], "max_tokens": 4}"#,
            "\n",
            r#"{"id": "c", "prompt": "t1 t2 t3", "max_tokens": 2}"#,
            "\n"
        ),
    )
    .unwrap();
    let p = prompts.to_str().unwrap();
    let out = rmlx(&["batch", "--model", m, "--prompts", p]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let texts: Vec<&str> = lines.iter().map(|l| l["text"].as_str().unwrap().trim()).collect();
    assert_eq!(texts, ["t58 t161 t458 t353", "t58 t161 t458 t353", "t58 t161"]);
    assert_eq!(lines[2]["id"], "c");
    assert_eq!(lines[0]["finish_reason"], "length");
    let out = rmlx(&["batch", "--model", m, "--prompts", p, "--classify", "--top", "2"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let first: Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).lines().next().unwrap()).unwrap();
    assert_eq!(first["top"][0]["id"], 58);
    assert_eq!(first["top"][0]["token"], "t58");
    assert_eq!(first["top"].as_array().unwrap().len(), 2);

    let out = rmlx(&["generate", "--model", m, "-p", "t1", "--raw", "--backend", "native"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unsupported architecture `starcoder2`"));

    // rmlx serve through mlx-lm: the same HTTP API, one request at a time (said in /v1/models);
    // what only the native engine does is refused per request, adapters at start.
    let server = support::Server::start(&["--model", m]);
    let (status, models) = server.request("GET", "/v1/models", None, &[]);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(
        (status, &models["data"][0]["backend"], &models["data"][0]["max_concurrent_requests"]),
        (200, &Value::from("mlx-lm"), &Value::from(1)),
        "{models}"
    );
    let (status, v) =
        server.post("/v1/completions", &serde_json::json!({"prompt": "t1 t2 t3", "max_tokens": 8, "temperature": 0}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["choices"][0]["text"].as_str().unwrap().split_whitespace().collect::<Vec<_>>(),
        ["t58", "t161", "t458", "t353", "t74", "t94", "t300", "t92"]
    );
    assert_eq!(
        (v["choices"][0]["finish_reason"].as_str(), v["usage"]["completion_tokens"].as_u64()),
        (Some("length"), Some(8))
    );
    let chat = serde_json::json!({"messages": [{"role": "user", "content": "t1 t2 t3"}], "max_tokens": 4, "temperature": 0, "stream": true});
    let (status, events) = server.request("POST", "/v1/chat/completions", Some(&chat), &[]);
    assert_eq!(status, 200, "{events}");
    let pieces: String = events
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| {
            serde_json::from_str::<Value>(d).ok()?["choices"][0]["delta"]["content"].as_str().map(str::to_string)
        })
        .collect();
    assert_eq!(pieces.split_whitespace().collect::<Vec<_>>(), ["t58", "t161", "t458", "t353"], "{events}");
    assert!(events.trim_end().ends_with("data: [DONE]"), "{events}");
    let format = serde_json::json!({"prompt": "t1", "max_tokens": 2, "response_format": {"type": "json_object"}});
    let (status, v) = server.post("/v1/completions", &format);
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("response_format")), "{v}");
    drop(server);
    let out = rmlx(&["serve", "--model", m, "--port", "0", "--adapter", &format!("a={m}")]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("adapters need the native backend"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&model);
}

#[test]
fn inspect_writes_the_keys_and_a_summary() {
    let dir = temp("inspect");
    let out_path = dir.join("keys.npy");
    let out = rmlx(&["inspect", "-p", "Hello there, keys", "--raw", "--out", out_path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let bytes = std::fs::read(&out_path).unwrap();
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + header_len]).unwrap();
    // SmolLM2-135M: 30 layers, 3 KV heads of 64 dims.
    let shape = header.split("'shape': (").nth(1).unwrap().split(')').next().unwrap().to_string();
    let dims: Vec<usize> = shape.split(',').map(|d| d.trim().parse().unwrap()).collect();
    assert_eq!((dims[0], dims[1], dims[3]), (30, 3, 64));
    assert_eq!(bytes.len() - 10 - header_len, dims.iter().product::<usize>() * 4);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let rows = stderr
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|w| w.len() == 5 && w[0].parse::<usize>().is_ok() && w[1].parse::<f64>().is_ok())
        .count();
    assert_eq!(rows, 30, "{stderr}");
    let bad = rmlx(&["inspect", "-p", "x", "--raw", "--out", dir.join("keys.txt").to_str().unwrap()]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains(".safetensors or .npy"));
    let _ = std::fs::remove_dir_all(&dir);
}
