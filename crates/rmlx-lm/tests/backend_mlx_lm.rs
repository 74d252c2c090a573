//! The mlx-lm backend against Python's mlx-lm, installed by this test into the per-user cache
//! (the versions pinned in scripts/requirements.txt): the same greedy tokens, classifications and
//! batch results as the native backend on a fixture both implement, an architecture only mlx-lm
//! has through `auto`, cancel and stop strings over the bridge, and a dead or hung bridge.

mod common;

use common::{fixture_dir, fixture_with_tokenizer, ids, reference, word_tokenizer, TempDir};
use rmlx_lm::backend::mlx_lm::{self, MlxLmBackend, Timeouts};
use rmlx_lm::backend::{BackendChoice, ClassifyOptions, LanguageModel, Prompt};
use rmlx_lm::{Error, FinishReason, GenerateOptions, LoadOptions};
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

/// Installs mlx-lm once per test process (a no-op when the cache has it).
fn mlx_lm_installed() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        mlx_lm::install(Path::new("python3")).expect("pip-installing mlx-lm into the cache");
    });
}

/// mlx-lm reads the word-level tokenizer through transformers' generic fast tokenizer.
/// The template writes the messages' contents one after another.
fn with_tokenizer_config(dir: &TempDir) {
    let config = r#"{"tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}"#;
    std::fs::write(dir.path().join("tokenizer_config.json"), config).unwrap();
}

fn load(dir: &Path, backend: &str) -> Box<dyn LanguageModel> {
    mlx_lm_installed();
    let opts = backend.parse::<BackendChoice>().unwrap();
    rmlx_lm::backend::load_with(dir, &opts, &LoadOptions::default()).unwrap_or_else(|e| panic!("{backend}: {e}"))
}

fn greedy(lm: &mut dyn LanguageModel, prompt: &Prompt, n: usize) -> Vec<u32> {
    let opts = GenerateOptions { max_tokens: n, ..GenerateOptions::default() };
    lm.generate(prompt, &opts).unwrap().map(|t| t.unwrap().id).collect()
}

#[test]
fn pins_agree_with_requirements_txt() {
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/requirements.txt")).unwrap();
    let pins: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("# mlx-lm-backend: ")).collect();
    assert_eq!(pins, [format!("mlx[cpu]=={}", mlx_lm::MLX_VERSION), format!("mlx-lm=={}", mlx_lm::MLX_LM_VERSION)]);
}

#[test]
fn same_greedy_tokens_classification_and_batch_as_native() {
    let dir = fixture_with_tokenizer("llama_gqa");
    with_tokenizer_config(&dir);
    let r = reference("llama_gqa");
    let prompt = ids(&r["prompt_ids"]);
    let mut native = load(dir.path(), "native");
    let mut bridge = load(dir.path(), "mlx-lm");
    let info = bridge.info();
    assert_eq!((info.backend.as_str(), info.architecture.as_str()), ("mlx-lm", "llama"));
    assert_eq!((info.vocab_size, info.layers, info.hidden_size, info.heads, info.kv_heads), (384, 2, 64, 4, 2));
    assert_eq!(info.dtype, "float32");

    // transformers' greedy continuation, from both backends, as ids and as text.
    let tokens = Prompt::Tokens(prompt.clone());
    assert_eq!(greedy(bridge.as_mut(), &tokens, 12), ids(&r["greedy"]));
    assert_eq!(greedy(native.as_mut(), &tokens, 12), ids(&r["greedy"]));
    let text: Vec<String> = prompt.iter().map(|t| format!("t{t}")).collect();
    let as_text = Prompt::Text(text.join(" "));
    assert_eq!(greedy(bridge.as_mut(), &as_text, 12), ids(&r["greedy"]));
    let m = bridge.metrics().unwrap();
    assert_eq!((m.prompt_tokens, m.generated_tokens), (24, 12));

    // Classification: prefixes of different lengths, batched on both sides.
    let prompts: Vec<Prompt> = [24usize, 3, 17, 1].iter().map(|&n| Prompt::Tokens(prompt[..n].to_vec())).collect();
    let opts = ClassifyOptions { top_logprobs: 4, logits: true, ..ClassifyOptions::default() };
    let a = native.classify(&prompts, &opts).unwrap();
    let b = bridge.classify(&prompts, &opts).unwrap();
    for (x, y) in a.iter().zip(&b) {
        assert_eq!((x.token_id, &x.token, x.prompt_tokens), (y.token_id, &y.token, y.prompt_tokens));
        let top =
            |c: &rmlx_lm::backend::Classification| c.top.iter().map(|t| (t.id, t.token.clone())).collect::<Vec<_>>();
        assert_eq!(top(x), top(y));
        let (lx, ly) = (x.logits.as_ref().unwrap(), y.logits.as_ref().unwrap());
        let d = lx.iter().zip(ly).map(|(p, q)| (p - q).abs()).fold(0.0, f32::max);
        assert!(d < 1e-4, "max |Δlogit| {d}");
        assert!((x.logprob - y.logprob).abs() < 1e-4);
    }

    // Batch generation: each prompt's greedy tokens equal the native backend's.
    let gen = GenerateOptions { max_tokens: 6, ..GenerateOptions::default() };
    let a = native.batch_generate(&prompts, &gen).unwrap();
    let b = bridge.batch_generate(&prompts, &gen).unwrap();
    for (x, y) in a.iter().zip(&b) {
        let (x, y) = (x.as_ref().unwrap(), y.as_ref().unwrap());
        assert_eq!((&x.token_ids, &x.text, x.finish_reason), (&y.token_ids, &y.text, y.finish_reason));
    }
    // Conversations and mixed kinds of prompts: both backends render the folder's chat template.
    let chat = vec![rmlx_lm::chat::Message::user("t16 t377"), rmlx_lm::chat::Message::user("t147")];
    let mixed = vec![Prompt::Chat(chat.clone()), Prompt::Tokens(prompt[..5].to_vec()), Prompt::from("t3 t4 t5")];
    let a = native.batch_generate(&mixed, &gen).unwrap();
    let b = bridge.batch_generate(&mixed, &gen).unwrap();
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.as_ref().unwrap().token_ids, y.as_ref().unwrap().token_ids);
    }
    // The conversation renders to "t16 t377 t147 ": the reference prompt's first three ids.
    assert_eq!(a[0].as_ref().unwrap().prompt_tokens, 3);
    assert_eq!(b[0].as_ref().unwrap().prompt_tokens, 3);
    let x = native.classify(&mixed, &opts).unwrap();
    let y = bridge.classify(&mixed, &opts).unwrap();
    assert_eq!(x.iter().map(|c| c.token_id).collect::<Vec<_>>(), y.iter().map(|c| c.token_id).collect::<Vec<_>>());
    let streamed: Vec<u32> = bridge.generate(&Prompt::Chat(chat), &gen).unwrap().map(|t| t.unwrap().id).collect();
    assert_eq!(streamed, a[0].as_ref().unwrap().token_ids);

    // Past end-of-sequence tokens: batch generation (mlx-lm's BatchGenerator without stop tokens)
    // takes it, streamed generation refuses it by name.
    let past = GenerateOptions { ignore_eos: true, ..gen.clone() };
    let c = bridge.batch_generate(&prompts, &past).unwrap();
    assert!(c.iter().all(|r| r.as_ref().unwrap().token_ids.len() == 6));
    let err = bridge.generate(&tokens, &past).err().unwrap();
    assert!(matches!(err, Error::InvalidParameter(ref m) if m.contains("ignore_eos")), "{err}");
    // Sampling the bridge does not do is refused by name, not ignored.
    let mut penalised = gen.clone();
    penalised.sampler.repetition_penalty = 1.3;
    let err = bridge.batch_generate(&prompts, &penalised).err().unwrap();
    assert!(matches!(err, Error::InvalidParameter(ref m) if m.contains("repetition_penalty")), "{err}");
    bridge.close().unwrap();
}

/// starcoder2 is an architecture the native backend lacks: `auto` runs it through mlx-lm.
#[test]
fn auto_falls_back_to_mlx_lm_for_an_architecture_native_lacks() {
    let dir = TempDir::new("starcoder2");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture_dir("starcoder2_mlx_lm").join(f), dir.path().join(f)).unwrap();
    }
    std::fs::write(dir.path().join("tokenizer.json"), word_tokenizer(512)).unwrap();
    // A template that refuses system messages.
    let config = r#"{"tokenizer_class": "PreTrainedTokenizerFast", "chat_template":
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system messages') }}{% endif %}{{ m['content'] }} {% endfor %}"}"#;
    std::fs::write(dir.path().join("tokenizer_config.json"), config).unwrap();
    let native_only = "native".parse::<BackendChoice>().unwrap();
    assert!(matches!(
        rmlx_lm::backend::load_with(dir.path(), &native_only, &LoadOptions::default()),
        Err(Error::UnsupportedArchitecture { .. })
    ));
    let mut lm = load(dir.path(), "auto");
    assert_eq!((lm.info().backend.as_str(), lm.info().architecture.as_str()), ("mlx-lm", "starcoder2"));
    // mlx-lm's own greedy tokens (scripts/make_mlx_lm_fixture.py chose the seed for wide margins).
    let got = greedy(lm.as_mut(), &Prompt::from("t1 t2 t3"), 8);
    assert_eq!(got, [58, 161, 458, 353, 74, 94, 300, 92]);

    // A stop string ends the text before it, and the bridge stops generating.
    let opts = GenerateOptions { max_tokens: 8, stop_strings: vec![" t94".into()], ..GenerateOptions::default() };
    let mut stream = lm.generate(&Prompt::from("t1 t2 t3"), &opts).unwrap();
    let text: String = stream.by_ref().map(|t| t.unwrap().text).collect();
    assert_eq!(text.split_whitespace().collect::<Vec<_>>(), ["t58", "t161", "t458", "t353", "t74"]);
    assert_eq!(stream.finish_reason(), Some(FinishReason::StopString));
    drop(stream);

    // Cancelled mid-stream, then the bridge serves the next request.
    let long = GenerateOptions { max_tokens: 500, ..GenerateOptions::default() };
    let mut stream = lm.generate(&Prompt::from("t1 t2 t3"), &long).unwrap();
    let cancel = stream.cancel_handle();
    let first: Vec<u32> = stream.by_ref().take(3).map(|t| t.unwrap().id).collect();
    assert_eq!(first, [58, 161, 458]);
    cancel.cancel();
    assert!(stream.next().is_none());
    assert_eq!(stream.finish_reason(), Some(FinishReason::Cancelled));
    drop(stream);
    assert_eq!(greedy(lm.as_mut(), &Prompt::from("t1 t2 t3"), 2), [58, 161]);

    // A chat template that fails: the bridge's error, as an Err.
    let err = match lm.chat(&[rmlx_lm::chat::Message::system("t5")], &opts) {
        Err(e) => e,
        Ok(mut s) => s.next().unwrap().unwrap_err(),
    };
    assert!(matches!(err, Error::Backend { ref message, .. } if message.contains("no system messages")), "{err}");
}

#[test]
fn a_killed_bridge_is_reported_and_restarted() {
    mlx_lm_installed();
    let dir = TempDir::new("starcoder2-kill");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture_dir("starcoder2_mlx_lm").join(f), dir.path().join(f)).unwrap();
    }
    std::fs::write(dir.path().join("tokenizer.json"), word_tokenizer(512)).unwrap();
    with_tokenizer_config(&dir);
    let mut lm = MlxLmBackend::default().open(dir.path()).unwrap();
    let pid = lm.pid().unwrap();
    std::process::Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let opts = GenerateOptions { max_tokens: 2, ..GenerateOptions::default() };
    let err = match lm.generate(&Prompt::from("t1 t2 t3"), &opts) {
        Err(e) => e,
        Ok(mut s) => s.next().unwrap().unwrap_err(),
    };
    assert!(
        matches!(err, Error::Backend { ref message, .. } if message.contains("exited") || message.contains("gone")),
        "{err}"
    );
    let again: Vec<u32> = lm.generate(&Prompt::from("t1 t2 t3"), &opts).unwrap().map(|t| t.unwrap().id).collect();
    assert_eq!(again, [58, 161]);
    assert_ne!(lm.pid(), Some(pid));
}

#[test]
fn a_hung_or_missing_interpreter_is_an_error() {
    let dir = fixture_with_tokenizer("llama_gqa");
    // An "interpreter" that announces itself and then never answers.
    let fake = TempDir::new("fake-python");
    let script = fake.path().join("python");
    std::fs::write(&script, "#!/bin/sh\necho '{\"ready\": true}'\nexec sleep 30\n").unwrap();
    std::process::Command::new("chmod").arg("+x").arg(&script).status().unwrap();
    let timeouts =
        Timeouts { start: Duration::from_secs(5), load: Duration::from_secs(1), step: Duration::from_secs(1) };
    let hung = MlxLmBackend { python: script, timeouts: timeouts.clone() };
    let started = std::time::Instant::now();
    let err = hung.open(dir.path()).err().unwrap();
    assert!(
        matches!(err, Error::Backend { ref message, .. } if message.contains("did not answer within 1 s")),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));

    let missing = MlxLmBackend { python: "/nonexistent/python3".into(), timeouts };
    let err = missing.open(dir.path()).err().unwrap();
    assert!(matches!(err, Error::Backend { ref message, .. } if message.contains("cannot start")), "{err}");
    let err = missing.open(&dir.path().join("nothing")).err().unwrap();
    assert!(matches!(err, Error::MissingFile(_)), "{err}");
}
