//! `rmlx cache-prompt` and `generate --prompt-cache-file` on a tiny random-weight model (rmlx-lm's
//! `llama_gqa` fixture with a word-level tokenizer and a ChatML template, no end-of-sequence id):
//! a cached user message continued by a later prompt gives exactly the tokens of the whole
//! message uncached (and raw text likewise); the file of another model, a truncated file and the
//! mlx-lm backend are refused with errors naming them.

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const RMLX: &str = env!("CARGO_BIN_EXE_rmlx");

const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
                      {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// A temporary copy of the `llama_gqa` fixture with tokenizer `t0 … t383` (ChatML's markers
/// and role words `t380`–`t383`), a ChatML template and no end-of-sequence id; `tag` names the
/// folder, `scale` multiplies its final norm (another model of the same shapes).
struct Model(PathBuf);

impl Model {
    fn new(tag: &str, scale: f32) -> Model {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../rmlx-lm/tests/fixtures/models/llama_gqa");
        let dir = std::env::temp_dir().join(format!("rmlx-cli-prompt-cache-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
        cfg["eos_token_id"] = Value::Null;
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        let mut st = rmlx::io::load_safetensors(src.join("model.safetensors")).unwrap();
        let norm = &st.arrays["model.norm.weight"];
        let scaled = (norm * scale).unwrap();
        st.arrays.insert("model.norm.weight".into(), scaled);
        rmlx::io::save_safetensors(dir.join("model.safetensors"), &st.arrays, &Default::default()).unwrap();
        let mut vocab: serde_json::Map<String, Value> = (0..380).map(|i| (format!("t{i}"), json!(i))).collect();
        for (i, w) in ["<|im_start|>", "<|im_end|>", "user", "assistant"].iter().enumerate() {
            vocab.insert(w.to_string(), json!(380 + i));
        }
        let added: Vec<Value> = ["<|im_start|>", "<|im_end|>"]
            .iter()
            .enumerate()
            .map(|(i, w)| json!({"id": 380 + i, "content": w, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
            .collect();
        let tok = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
            "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}
        });
        std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), json!({"chat_template": CHATML}).to_string()).unwrap();
        Model(dir)
    }

    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
        let _ = std::fs::remove_file(format!("{}.prefix.safetensors", self.path()));
    }
}

fn rmlx(args: &[&str]) -> Output {
    Command::new(RMLX).args(args).stdin(Stdio::null()).output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The JSON object `generate --json` printed.
fn generated(o: &Output) -> Value {
    assert!(o.status.success(), "generate failed: {}", stderr(o));
    serde_json::from_str(String::from_utf8_lossy(&o.stdout).trim()).unwrap()
}

#[test]
fn a_cached_prompt_continues_as_the_whole_prompt() {
    let m = Model::new("same", 1.0);
    // Beside the model's folder, not in it (the loader would read it as a shard).
    let file = format!("{}.prefix.safetensors", m.path());
    let file = file.as_str();
    let prefix = "t1 t2 t3 t4 t5 t6 t7 t8 t9 t10 t11";
    for raw in [false, true] {
        let mut args =
            vec!["cache-prompt", "--model", m.path(), "--prompt", prefix, "--prompt-cache-file", file, "--json"];
        if raw {
            args.push("--raw");
        }
        let made = rmlx(&args);
        assert!(made.status.success(), "cache-prompt failed: {}", stderr(&made));
        let made: Value = serde_json::from_str(String::from_utf8_lossy(&made.stdout).trim()).unwrap();
        // The open user message: `<|im_start|>user` and the eleven words; raw: the words alone.
        assert_eq!(made["prompt_tokens"], json!(if raw { 11 } else { 13 }), "raw {raw}");
        let mut after = vec!["generate", "--model", m.path(), "--prompt-cache-file", file, "-m", "8", "--json"];
        after.extend(["--prompt", " t12 t13"]);
        // One user message (or text) of the thirteen words.
        let mut whole = vec!["generate", "--model", m.path(), "-m", "8", "--json"];
        whole.extend(["--prompt", "t1 t2 t3 t4 t5 t6 t7 t8 t9 t10 t11 t12 t13"]);
        if raw {
            after.push("--raw");
            whole.push("--raw");
        }
        let (after, whole) = (generated(&rmlx(&after)), generated(&rmlx(&whole)));
        assert_eq!(after["token_ids"].as_array().unwrap().len(), 8, "raw {raw}");
        assert_eq!(after["token_ids"], whole["token_ids"], "raw {raw}: cached + suffix = the whole prompt");
        let cached = made["prompt_tokens"].as_u64().unwrap();
        assert_eq!(
            cached + after["prompt_tokens"].as_u64().unwrap(),
            whole["prompt_tokens"].as_u64().unwrap(),
            "raw {raw}: the suffix is the rest of the whole prompt"
        );
    }
}

#[test]
fn foreign_and_truncated_files_and_the_mlx_lm_backend_are_refused() {
    let (m, other) = (Model::new("mine", 1.0), Model::new("other", 1.5));
    let file = format!("{}.prefix.safetensors", m.path());
    let file = file.as_str();
    // Not into the model's folder, where the loader would read it as weights.
    let inside = m.0.join("prefix.safetensors");
    let o =
        rmlx(&["cache-prompt", "--model", m.path(), "--prompt", "t1", "--prompt-cache-file", inside.to_str().unwrap()]);
    assert!(!o.status.success() && stderr(&o).contains("read it as weights") && !inside.exists(), "{}", stderr(&o));
    let made = rmlx(&["cache-prompt", "--model", m.path(), "--prompt", "t1 t2 t3", "--prompt-cache-file", file]);
    assert!(made.status.success(), "{}", stderr(&made));
    let use_with = |model: &str, path: &str, extra: &[&str]| {
        let mut args = vec!["generate", "--model", model, "--prompt", "t4", "-m", "2", "--prompt-cache-file", path];
        args.extend(extra);
        rmlx(&args)
    };
    let o = use_with(other.path(), file, &[]);
    assert!(
        !o.status.success() && stderr(&o).contains("prompt cache") && stderr(&o).contains("made for"),
        "{}",
        stderr(&o)
    );
    let o = use_with(m.path(), file, &["--dtype", "bfloat16"]);
    assert!(!o.status.success() && stderr(&o).contains("made in float32"), "{}", stderr(&o));
    let o = use_with(m.path(), file, &["--backend", "mlx-lm"]);
    assert!(!o.status.success() && stderr(&o).contains("rmlx's own backend"), "{}", stderr(&o));
    let bytes = std::fs::read(file).unwrap();
    let cut = m.0.join("..").join(format!("{}.cut.safetensors", m.0.file_name().unwrap().to_str().unwrap()));
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let o = use_with(m.path(), cut.to_str().unwrap(), &[]);
    assert!(!o.status.success() && stderr(&o).contains("corrupt or truncated"), "{}", stderr(&o));
    let _ = std::fs::remove_file(&cut);
    let o = use_with(m.path(), "/nonexistent/prompt.safetensors", &[]);
    assert!(!o.status.success() && stderr(&o).contains("/nonexistent/prompt.safetensors"), "{}", stderr(&o));
}

#[test]
fn chat_continues_a_cached_prompt_as_generate_does() {
    let m = Model::new("chat", 1.0);
    let file = format!("{}.prefix.safetensors", m.path());
    let made = rmlx(&[
        "cache-prompt",
        "--model",
        m.path(),
        "--prompt",
        "t1 t2 t3 t4 t5 t6 t7 t8 t9 t10 t11",
        "--prompt-cache-file",
        &file,
    ]);
    assert!(made.status.success(), "{}", stderr(&made));
    let generated =
        rmlx(&["generate", "--model", m.path(), "--prompt-cache-file", &file, "--prompt", " t12 t13", "-m", "8"]);
    assert!(generated.status.success(), "{}", stderr(&generated));
    let mut child = Command::new(RMLX)
        .args(["chat", "--model", m.path(), "--prompt-cache-file", &file, "-m", "8", "--stats"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    // The first message continues the cached one; /reset goes back to the cached prompt.
    child.stdin.take().unwrap().write_all(b" t12 t13\n/reset\nt12 t13\n/exit\n").unwrap();
    let chat = child.wait_with_output().unwrap();
    assert!(chat.status.success(), "{}", stderr(&chat));
    let replies: Vec<String> = String::from_utf8_lossy(&chat.stdout).lines().map(str::to_string).collect();
    let want = String::from_utf8_lossy(&generated.stdout).trim().to_string();
    assert_eq!(replies.len(), 2, "{replies:?}");
    assert!(replies.iter().all(|r| r.trim() == want), "{replies:?} against generate's {want:?}");
    // The first turn reuses the file's 13 tokens; after /reset the same message reuses the first
    // turn's whole prompt but its last token.
    let err = stderr(&chat);
    assert!(
        err.contains("[prompt 18 tokens (13 from the cache)") && err.contains("[prompt 18 tokens (17 from the cache)"),
        "{err}"
    );
    // mlx-lm's files hold no token list: chat refuses them and says what continues them.
    let theirs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../rmlx-lm/tests/fixtures/prompt_cache/qwen3.safetensors");
    let o = rmlx(&["chat", "--model", m.path(), "--prompt-cache-file", theirs.to_str().unwrap()]);
    assert!(!o.status.success(), "{}", stderr(&o));
}
