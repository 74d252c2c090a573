//! LoRA adapters per request in `rmlx serve` (the default model, real HTTP): requests for two
//! adapters and for the base model, sent together, each return what `rmlx generate
//! --adapter-path` returns; `/v1/models` lists the adapters; vLLM's load and unload endpoints work
//! behind `--allow-adapter-loading` and do not exist without it. Over the ranks of a split model
//! (`rmlx launch`), each rank adds its share of every adapter and the answers are one process's.

mod support;

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use support::{Server, MODEL, RMLX};

/// A folder of adapters trained for a few steps on a tiny text set (`learning_rate` decides how
/// far they move the output).
fn train(root: &Path, name: &str, learning_rate: &str) -> PathBuf {
    let data = root.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let lines: String = (0..8).map(|i| format!("{{\"text\": \"number {i} is a number like any other\"}}\n")).collect();
    std::fs::write(data.join("train.jsonl"), &lines).unwrap();
    std::fs::write(data.join("valid.jsonl"), &lines).unwrap();
    let out = root.join(name);
    let status = Command::new(RMLX)
        .args(["lora", "--train", "--iters", "4", "--batch-size", "2", "--num-layers", "4", "--val-batches", "1"])
        .args(["--learning-rate", learning_rate, "--data"])
        .arg(&data)
        .arg("--adapter-path")
        .arg(&out)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    out
}

const PROMPT: &str = "Say something about cats.";

/// `rmlx generate --json`'s text for the chat prompt, with an adapter folder or without.
fn generate(adapter: Option<&Path>) -> String {
    generate_as(&[], adapter)
}

/// [`generate`] run as `launch` (`rmlx launch … --` and what follows `generate`), whose rank 0
/// writes the result.
fn generate_as(launch: &[&str], adapter: Option<&Path>) -> String {
    let (prefix, split) = launch.split_at(launch.iter().position(|a| *a == "--").map_or(0, |i| i + 1));
    let mut cmd = Command::new(RMLX);
    cmd.args(prefix).args(["generate", "--prompt", PROMPT, "--max-tokens", "10", "--json"]).args(split);
    if let Some(a) = adapter {
        cmd.arg("--adapter-path").arg(a);
    }
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.strip_prefix("[rank 0] ").unwrap_or(&stdout);
    serde_json::from_str::<Value>(line).unwrap()["text"].as_str().unwrap().to_string()
}

fn chat(addr: &str, model: &str) -> (u16, Value) {
    let body =
        json!({"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 10, "temperature": 0});
    support::post(addr, "/v1/chat/completions", &body)
}

fn text(v: &Value) -> &str {
    v["choices"][0]["message"]["content"].as_str().unwrap_or_else(|| panic!("no text in {v}"))
}

#[test]
fn adapters_are_chosen_per_request_and_loaded_while_serving() {
    let root = std::env::temp_dir().join(format!("rmlx-serve-adapters-{}", std::process::id()));
    let (a, b) = (train(&root, "a", "5e-3"), train(&root, "b", "2e-2"));
    let expected = [generate(None), generate(Some(&a)), generate(Some(&b))];
    assert!(expected[0] != expected[1] && expected[1] != expected[2], "the adapters change the text: {expected:?}");

    let (arg_a, arg_b) = (format!("a={}", a.display()), format!("b={}", b.display()));
    let server = Server::start(&["--adapter", &arg_a, "--adapter", &arg_b, "--allow-adapter-loading"]);
    // Sent together: one batch with the base model and both adapters.
    let models = [MODEL.to_string(), "a".to_string(), format!("{MODEL}:b")];
    let answers: Vec<(u16, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = models.iter().map(|m| s.spawn(|| chat(&server.addr, m))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for ((model, (status, v)), want) in models.iter().zip(&answers).zip(&expected) {
        assert_eq!(*status, 200, "{v}");
        assert_eq!(text(v), want, "model {model}");
        assert_eq!(v["model"], model.as_str());
    }
    let (status, listed) = server.request("GET", "/v1/models", None, &[]);
    assert_eq!(status, 200);
    let listed: Value = serde_json::from_str(&listed).unwrap();
    let ids: Vec<&str> = listed["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, [MODEL, "a", "b"]);
    assert_eq!(listed["data"][1]["parent"], MODEL);

    let (status, v) = chat(&server.addr, "c");
    assert_eq!(status, 404, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("`a`, `b`"), "{v}");

    // vLLM's endpoints: unload a, load a's folder again as c.
    let (status, body) = server.request("POST", "/v1/unload_lora_adapter", Some(&json!({"lora_name": "a"})), &[]);
    assert_eq!((status, body.as_str()), (200, "Success: LoRA adapter 'a' removed successfully."));
    assert_eq!(chat(&server.addr, "a").0, 404);
    let load = json!({"lora_name": "c", "lora_path": a});
    assert_eq!(server.request("POST", "/v1/load_lora_adapter", Some(&load), &[]).0, 200);
    let (status, v) = chat(&server.addr, "c");
    assert_eq!((status, text(&v)), (200, expected[1].as_str()));
    // Refusals name the problem.
    let (status, v) = server.post("/v1/load_lora_adapter", &json!({"lora_name": "c", "lora_path": b}));
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("already"), "{v}");
    // A folder that does not exist and one that holds something else get the same answer: the
    // client learns nothing of the server's files.
    let missing = root.join("missing");
    let (status, v) = server.post("/v1/load_lora_adapter", &json!({"lora_name": "d", "lora_path": missing}));
    assert_eq!(status, 400, "{v}");
    let message = v["error"]["message"].as_str().unwrap().to_string();
    assert!(message.contains("not an adapter folder") && !message.contains(root.to_str().unwrap()), "{v}");
    let (status, v) = server.post("/v1/load_lora_adapter", &json!({"lora_name": "d", "lora_path": "/etc"}));
    assert_eq!((status, v["error"]["message"].as_str().unwrap()), (400, message.as_str()), "{v}");
    let (status, v) = server.post("/v1/unload_lora_adapter", &json!({"lora_name": "zz"}));
    assert_eq!(status, 404, "{v}");
    drop(server);

    // --adapter-dir: only folders inside it load.
    let (dir_a, dir_root) = (format!("{}", a.display()), format!("{}", a.parent().unwrap().display()));
    let confined = Server::start(&["--allow-adapter-loading", "--adapter-dir", &dir_a]);
    let (status, v) = confined.post("/v1/load_lora_adapter", &json!({"lora_name": "b", "lora_path": b}));
    assert_eq!((status, v["error"]["param"].as_str()), (403, Some("lora_path")), "{v}");
    let (status, v) =
        confined.request("POST", "/v1/load_lora_adapter", Some(&json!({"lora_name": "a", "lora_path": a})), &[]);
    assert_eq!(status, 200, "{v}");
    let escape = format!("{dir_a}/../{}", b.file_name().unwrap().to_string_lossy());
    let (status, v) = confined.post("/v1/load_lora_adapter", &json!({"lora_name": "e", "lora_path": escape}));
    assert_eq!(status, 403, "{dir_root}: {v}");
    drop(confined);

    // Without the flag the endpoints do not exist; a bad --adapter stops the start-up.
    let plain = Server::start(&[]);
    let (status, v) = plain.post("/v1/load_lora_adapter", &json!({"lora_name": "c", "lora_path": a}));
    assert_eq!(status, 404, "{v}");
    drop(plain);
    let out = Command::new(RMLX)
        .args(["serve", "--port", "0", "--adapter"])
        .arg(format!("x={}", missing.display()))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("reading the adapter `x`"), "{err}");
    let _ = std::fs::remove_dir_all(&root);
}

/// Over the ranks of a split model, by tensors (3 ranks) and by blocks (2 ranks, warming up
/// first): `generate --adapter-path` and the server's adapters, chosen per request, loaded and
/// unloaded while serving, give one process's text; a folder no rank can read is refused as in one
/// process, and the server goes on.
#[test]
fn adapters_over_the_ranks_of_a_split_model() {
    let root = std::env::temp_dir().join(format!("rmlx-serve-adapters-ranks-{}", std::process::id()));
    let (a, b) = (train(&root, "a", "5e-3"), train(&root, "b", "2e-2"));
    let expected = [generate(None), generate(Some(&a)), generate(Some(&b))];
    assert!(expected[0] != expected[1] && expected[1] != expected[2], "the adapters change the text: {expected:?}");
    for (n, split) in [("3", None), ("2", Some("--pipeline"))] {
        let launch: Vec<&str> = ["launch", "-n", n, "--"].into_iter().chain(split).collect();
        assert_eq!(generate_as(&launch, Some(&a)), expected[1], "{launch:?}");

        let arg_a = format!("a={}", a.display());
        let warm_up = if split.is_some() { "on" } else { "off" };
        let mut extra = vec!["--adapter", &arg_a, "--allow-adapter-loading", "--warm-up", warm_up];
        extra.extend(split);
        let server = Server::launch(n.parse().unwrap(), &extra);
        let models = [MODEL, "a"];
        let answers: Vec<(u16, Value)> = std::thread::scope(|s| {
            let handles: Vec<_> = models.iter().map(|m| s.spawn(|| chat(&server.addr, m))).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for ((model, (status, v)), want) in models.iter().zip(&answers).zip(&expected) {
            assert_eq!((*status, text(v)), (200, want.as_str()), "{launch:?}, model {model}");
        }
        let load = json!({"lora_name": "b", "lora_path": b});
        assert_eq!(server.request("POST", "/v1/load_lora_adapter", Some(&load), &[]).0, 200);
        let unload = json!({"lora_name": "a"});
        assert_eq!(server.request("POST", "/v1/unload_lora_adapter", Some(&unload), &[]).0, 200);
        let (status, v) = chat(&server.addr, "b");
        assert_eq!((status, text(&v)), (200, expected[2].as_str()), "{launch:?}");
        assert_eq!(chat(&server.addr, "a").0, 404);
        let (status, v) = server.post("/v1/load_lora_adapter", &json!({"lora_name": "d", "lora_path": "/etc"}));
        assert_eq!(status, 400, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("not an adapter folder"), "{v}");
        let (status, v) = chat(&server.addr, MODEL);
        assert_eq!((status, text(&v)), (200, expected[0].as_str()), "{launch:?}");
    }
    let _ = std::fs::remove_dir_all(&root);
}
