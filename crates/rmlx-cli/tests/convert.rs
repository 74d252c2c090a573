//! `rmlx convert` on the default model's GGUF: quantised to 8 bits into a new folder (a JSON
//! summary on stdout, progress on stderr) that `rmlx generate` then runs; flags that need `-q`
//! without it, and an existing destination, are errors naming the problem.

use serde_json::Value;
use std::process::{Command, Output, Stdio};

const RMLX: &str = env!("CARGO_BIN_EXE_rmlx");

fn rmlx(args: &[&str]) -> Output {
    Command::new(RMLX).args(args).stdin(Stdio::null()).output().unwrap()
}

#[test]
fn the_default_model_converts_to_8_bits_and_generates() {
    let dir = std::env::temp_dir().join(format!("rmlx-cli-convert-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let out_dir = dir.join("smol-8bit");
    let out = rmlx(&["convert", "-q", "--q-bits", "8", "--mlx-path", out_dir.to_str().unwrap(), "--json"]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    let summary: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    // SmolLM2-135M: 30 blocks of 7 linears and the tied embedding, at 8 bits in groups of 64
    // (8.5 bits a weight with the float16 scales and biases).
    assert_eq!(summary["quantized_layers"], 211, "{summary}");
    let bpw = summary["bits_per_weight"].as_f64().unwrap();
    assert!((8.5..8.6).contains(&bpw), "{summary}");
    assert!(stderr.contains("wrote 694 tensors (211 quantised layers"), "{stderr}");
    let config: Value = serde_json::from_str(&std::fs::read_to_string(out_dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["quantization"], serde_json::json!({"bits": 8, "group_size": 64, "mode": "affine"}));
    let out =
        rmlx(&["generate", "--model", out_dir.to_str().unwrap(), "--prompt", "Hi", "--max-tokens", "4", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["token_ids"].as_array().unwrap().len(), 4, "{v}");

    let out = rmlx(&["convert", "--mlx-path", out_dir.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr.contains("exists already: give a new folder"), "{stderr}");
    let out = rmlx(&["convert", "--q-bits", "4", "--mlx-path", dir.join("x").to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr.contains("--q-bits, --q-group-size, --q-mode and --quant-predicate need -q"), "{stderr}");
    assert!(!dir.join("x").exists());
    let _ = std::fs::remove_dir_all(&dir);
}
