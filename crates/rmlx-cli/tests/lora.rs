//! `rmlx lora` end to end on a tiny random-weight model (rmlx-lm's `llama_gqa` fixture with a
//! word-level tokenizer): training writes mlx-lm's adapter files and lowers the validation loss,
//! `--test` reports the same loss from the saved adapters, `generate --adapter-path` uses them,
//! and bad data is reported with its file and line before anything trains.

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

const RMLX: &str = env!("CARGO_BIN_EXE_rmlx");

/// A fresh temporary folder holding the model, the data and the adapters.
fn workspace(tag: &str) -> PathBuf {
    workspace_of(tag, "llama_gqa")
}

/// [`workspace`] over the fixture model `fixture`.
fn workspace_of(tag: &str, fixture: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rmlx-cli-lora-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../rmlx-lm/tests/fixtures/models").join(fixture);
    for f in ["config.json", "model.safetensors", "generation_config.json"] {
        std::fs::copy(src.join(f), model.join(f)).unwrap();
    }
    let vocab: serde_json::Map<String, Value> = (0..384).map(|i| (format!("t{i}"), json!(i))).collect();
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}
    });
    std::fs::write(model.join("tokenizer.json"), tok.to_string()).unwrap();
    // Texts counting up by 3 from different starts: a rule the adapters can learn.
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    for (name, n, start) in [("train", 24, 0), ("valid", 8, 1), ("test", 8, 2)] {
        let lines: Vec<String> = (0..n)
            .map(|i| {
                let words: Vec<String> = (0..10).map(|k| format!("t{}", (i * 7 + start + 3 * k) % 60 + 2)).collect();
                json!({"text": words.join(" ")}).to_string()
            })
            .collect();
        std::fs::write(data.join(format!("{name}.jsonl")), lines.join("\n") + "\n").unwrap();
    }
    dir
}

fn rmlx(args: &[&str]) -> Output {
    Command::new(RMLX).args(args).stdin(Stdio::null()).output().unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `rmlx generate` on `model` in float32, greedy, `max_tokens` after the raw prompt
/// `t2 t5 t8 t11`, with `extra` flags; must succeed.
fn greedy(model: &Path, max_tokens: &str, extra: &[&str]) -> Output {
    let mut args = vec!["generate", "--model", s(model), "--dtype", "float32", "--prompt", "t2 t5 t8 t11", "--raw"];
    args.extend_from_slice(&["--max-tokens", max_tokens, "--temp", "0"]);
    args.extend_from_slice(extra);
    let out = rmlx(&args);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    out
}

#[test]
fn train_then_test_then_generate_with_the_adapters() {
    let w = workspace("train");
    let (model, data, adapters) = (w.join("model"), w.join("data"), w.join("adapters"));
    let out = rmlx(&[
        "lora",
        "--model",
        s(&model),
        "--dtype",
        "float32",
        "--train",
        "--test",
        "--data",
        s(&data),
        "--adapter-path",
        s(&adapters),
        "--iters",
        "30",
        "--batch-size",
        "4",
        "--learning-rate",
        "1e-2",
        "--steps-per-report",
        "10",
        "--steps-per-eval",
        "15",
        "--save-every",
        "20",
        "--num-layers",
        "-1",
        "--val-batches",
        "-1",
        "--lora-rank",
        "4",
        "--lora-scale",
        "2",
        "--json",
        "--adapter-format",
        "peft",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let reports: Vec<Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let val: Vec<(u64, f64)> =
        reports.iter().filter_map(|r| Some((r["iter"].as_u64()?, r["val_loss"].as_f64()?))).collect();
    assert_eq!(val.iter().map(|v| v.0).collect::<Vec<_>>(), vec![1, 15, 30]);
    assert!(val[2].1 < 0.8 * val[0].1, "validation loss {val:?}");
    let train: Vec<&Value> = reports.iter().filter(|r| r.get("train_loss").is_some()).collect();
    assert_eq!(train.iter().map(|r| r["iter"].as_u64().unwrap()).collect::<Vec<_>>(), vec![10, 20, 30]);
    // Loss targets (mlx-lm's count): 9 of each 10-token example; every token in the other rate.
    assert_eq!(train[2]["trained_tokens"].as_u64(), Some(30 * 4 * 9));
    let (loss_rate, all_rate) =
        (train[2]["tokens_per_sec"].as_f64().unwrap(), train[2]["all_tokens_per_sec"].as_f64().unwrap());
    assert!((all_rate / loss_rate - 10.0 / 9.0).abs() < 1e-6, "{loss_rate} {all_rate}");
    assert_eq!(train[0]["learning_rate"].as_f64(), Some(0.01f32 as f64));
    let test_loss = reports.last().unwrap()["test_loss"].as_f64().expect("the test report comes last");
    for f in ["adapters.safetensors", "adapter_config.json", "0000020_adapters.safetensors"] {
        assert!(adapters.join(f).exists(), "{f}");
    }
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(adapters.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(cfg["fine_tune_type"], "lora");
    assert_eq!(cfg["num_layers"], -1);
    assert_eq!(cfg["lora_parameters"]["rank"], 4);
    assert_eq!(cfg["lora_parameters"]["scale"], 2.0);
    // Testing from the saved folder gives the same loss as right after training.
    let out = rmlx(&[
        "lora",
        "--model",
        s(&model),
        "--dtype",
        "float32",
        "--test",
        "--data",
        s(&data),
        "--adapter-path",
        s(&adapters),
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let again: Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
    assert_eq!(again["test_loss"].as_f64(), Some(test_loss));
    // generate with the adapters: announced, and the continuation differs from the base model's.
    let gen = |extra: &[&str]| {
        let out = greedy(&model, "6", extra);
        (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (tuned, err) = gen(&["--adapter-path", s(&adapters)]);
    assert!(err.contains("adapters: ") && err.contains("(rank 4, scale 2)"), "{err}");
    let (base, _) = gen(&[]);
    assert_ne!(tuned, base);
    // The PEFT copy (r 4, lora_alpha 8) gives the same continuation.
    let peft = adapters.join("peft");
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(peft.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!((cfg["r"].as_i64(), cfg["lora_alpha"].as_f64()), (Some(4), Some(8.0)));
    assert_eq!(gen(&["--adapter-path", s(&peft)]).0, tuned);
    let _ = std::fs::remove_dir_all(&w);
}

#[test]
fn bad_input_is_reported_before_training() {
    let w = workspace("bad");
    let (model, data) = (w.join("model"), w.join("data"));
    std::fs::write(data.join("valid.jsonl"), "{\"text\": \"t1 t2\"}\n{\"text\": 5}\n").unwrap();
    let out = rmlx(&["lora", "--model", s(&model), "--train", "--data", s(&data), "--adapter-path", s(&w.join("a"))]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("valid.jsonl:2: field `text` must be a string, found a number"), "{err}");
    assert!(!w.join("a").exists(), "nothing was written");
    let out = rmlx(&["lora", "--model", s(&model)]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("nothing to do: pass --train, --test or both"));
    let out = rmlx(&["lora", "--model", s(&model), "--train", "--data", s(&data), "--fine-tune-type", "vera"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--fine-tune-type vera is unknown (lora, dora or full)"));
    std::fs::write(data.join("valid.jsonl"), "{\"text\": \"t1 t2\"}\n").unwrap();
    let out = rmlx(&["lora", "--model", s(&model), "--test", "--data", s(&data), "--adapter-path", s(&w.join("none"))]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("adapter_config.json"));
    // Settings that cannot train, refused before anything is written.
    let a = w.join("refused");
    for (flags, says) in [
        (&["--learning-rate", "nan"][..], "--learning-rate must be a finite number, 0 or more, got NaN"),
        (&["--learning-rate", "inf"][..], "--learning-rate must be a finite number, 0 or more, got inf"),
        (&["--learning-rate", "-1"][..], "--learning-rate must be a finite number, 0 or more, got -1"),
        (&["--lora-scale", "nan"][..], "--lora-scale must be a finite number"),
        (&["--num-layers", "1000"][..], "--num-layers 1000: the model has 2 blocks"),
    ] {
        let mut args = vec!["lora", "--model", s(&model), "--train", "--data", s(&data), "--adapter-path", s(&a)];
        args.extend_from_slice(flags);
        let out = rmlx(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{flags:?}: {err}");
        assert!(err.contains(says), "{flags:?}: {err}");
        assert!(!a.join("adapters.safetensors").exists(), "{flags:?}");
    }
    // Training that overflows stops with an error instead of writing NaN adapters.
    let out = rmlx(&[
        "lora",
        "--model",
        s(&model),
        "--train",
        "--data",
        s(&data),
        "--adapter-path",
        s(&a),
        "--iters",
        "5",
        "--optimizer",
        "sgd",
        "--learning-rate",
        "1e38",
        "--lora-scale",
        "1e30",
        "--save-every",
        "1",
        "--batch-size",
        "1",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("NaN or infinite") && err.contains("training stopped before applying it"), "{err}");
    if a.join("adapters.safetensors").exists() {
        for (name, t) in rmlx::io::load_safetensors(a.join("adapters.safetensors")).unwrap().arrays {
            let values = t.astype(rmlx::Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
            assert!(values.iter().all(|v| v.is_finite()), "{name} holds non-finite values");
        }
    }
    // No validation set: refused, as mlx-lm does.
    std::fs::remove_file(data.join("valid.jsonl")).unwrap();
    let out = rmlx(&["lora", "--model", s(&model), "--train", "--data", s(&data), "--adapter-path", s(&a)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("valid.jsonl is missing or empty"), "{err}");
    let _ = std::fs::remove_dir_all(&w);
}

/// The default model (SmolLM2-135M-Instruct, the same one the README's `generate` uses) learns a
/// small task: additions written as `{"prompt": "What is A plus B?", "completion": "The answer is
/// C."}`, generated here deterministically, with the loss on the completion only. 30 steps on the
/// CPU took the validation loss from 1.37 to 0.40 when this was written; the test asserts a halving.
#[test]
fn the_default_model_learns_a_small_task() {
    let dir = std::env::temp_dir().join(format!("rmlx-cli-lora-default-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let mut state = 12345u64;
    let mut next = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) % 50 + 1
    };
    for (name, n) in [("train", 64), ("valid", 16)] {
        let lines: Vec<String> = (0..n)
            .map(|_| {
                let (a, b) = (next(), next());
                json!({"prompt": format!("What is {a} plus {b}?"), "completion": format!("The answer is {}.", a + b)})
                    .to_string()
            })
            .collect();
        std::fs::write(data.join(format!("{name}.jsonl")), lines.join("\n") + "\n").unwrap();
    }
    let out = rmlx(&[
        "lora",
        "--train",
        "--data",
        s(&data),
        "--adapter-path",
        s(&dir.join("adapters")),
        "--iters",
        "30",
        "--learning-rate",
        "1e-4",
        "--num-layers",
        "4",
        "--steps-per-eval",
        "30",
        "--val-batches",
        "-1",
        "--mask-prompt",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let val: Vec<f64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok()?.get("val_loss")?.as_f64())
        .collect();
    assert_eq!(val.len(), 2, "validation at iterations 1 and 30");
    assert!(val[1] < 0.5 * val[0], "validation loss {} -> {}", val[0], val[1]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--fine-tune-type full` trains the last blocks' own weights: the file holds exactly those
/// arrays, the loss falls, and `--test` / `generate --adapter-path` load them back.
#[test]
fn full_fine_tuning_of_the_last_block() {
    let w = workspace("full");
    let (model, data, out_dir) = (w.join("model"), w.join("data"), w.join("full"));
    let out = rmlx(&[
        "lora",
        "--model",
        s(&model),
        "--dtype",
        "float32",
        "--train",
        "--test",
        "--data",
        s(&data),
        "--adapter-path",
        s(&out_dir),
        "--fine-tune-type",
        "full",
        "--num-layers",
        "1",
        "--iters",
        "20",
        "--learning-rate",
        "1e-3",
        "--steps-per-eval",
        "20",
        "--val-batches",
        "-1",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let reports: Vec<Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let val: Vec<f64> = reports.iter().filter_map(|r| r["val_loss"].as_f64()).collect();
    assert!(val.len() == 2 && val[1] < val[0], "validation loss {val:?}");
    let test_loss = reports.last().unwrap()["test_loss"].as_f64().unwrap();
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!((cfg["fine_tune_type"].as_str(), cfg["num_layers"].as_i64()), (Some("full"), Some(1)));
    // The fixture has 2 blocks of 9 arrays each: the file holds block 1's.
    let header = std::fs::read(out_dir.join("adapters.safetensors")).unwrap();
    let n = u64::from_le_bytes(header[..8].try_into().unwrap()) as usize;
    let meta: Value = serde_json::from_slice(&header[8..8 + n]).unwrap();
    let mut names: Vec<&String> = meta.as_object().unwrap().keys().filter(|k| *k != "__metadata__").collect();
    names.sort();
    assert_eq!(names.len(), 9);
    assert!(names.iter().all(|n| n.starts_with("model.layers.1.")), "{names:?}");
    let out = rmlx(&[
        "lora",
        "--model",
        s(&model),
        "--dtype",
        "float32",
        "--test",
        "--data",
        s(&data),
        "--adapter-path",
        s(&out_dir),
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let again: Value = serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
    assert_eq!(again["test_loss"].as_f64(), Some(test_loss));
    let _ = std::fs::remove_dir_all(&w);
}

/// `--epochs 2` over 24 examples in batches of 4 is 12 iterations; accumulation is accepted.
#[test]
fn epochs_set_the_iteration_count() {
    let w = workspace("epochs");
    let (model, data) = (w.join("model"), w.join("data"));
    let out = rmlx(&[
        "lora",
        "--model",
        s(&model),
        "--train",
        "--data",
        s(&data),
        "--adapter-path",
        s(&w.join("a")),
        "--epochs",
        "2",
        "--grad-accumulation-steps",
        "2",
        "--learning-rate",
        "1e-3",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let iters: Vec<u64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let v: Value = serde_json::from_str(l).ok()?;
            v.get("train_loss")?;
            v["iter"].as_u64()
        })
        .collect();
    assert_eq!(iters, vec![10, 12]);
    let _ = std::fs::remove_dir_all(&w);
}

/// `-c config.yaml` as mlx-lm writes it: settings, lora_parameters (rank, scale, keys),
/// optimizer_config and an lr_schedule with warm-up; a flag on the command line beats the file.
#[test]
fn yaml_config_sets_what_the_flags_do_not() {
    let w = workspace("yaml");
    let (model, data) = (w.join("model"), w.join("data"));
    let yaml = format!(
        "model: {}\ntrain: true\ndata: {}\nadapter_path: {}\nbatch_size: 2\niters: 8\nsteps_per_report: 1\n\
         optimizer: adamw\noptimizer_config:\n  adamw:\n    weight_decay: 0.05\n\
         lora_parameters:\n  rank: 2\n  scale: 4.0\n  dropout: 0.0\n  keys: [\"self_attn.q_proj\", \"self_attn.v_proj\"]\n\
         lr_schedule:\n  name: cosine_decay\n  arguments: [1.0e-2, 10]\n  warmup: 2\n  warmup_init: 0.0\nwandb: null\n",
        s(&model),
        s(&data),
        s(&w.join("a"))
    );
    let cfg_path = w.join("lora.yaml");
    std::fs::write(&cfg_path, yaml).unwrap();
    let out = rmlx(&["lora", "-c", s(&cfg_path), "--iters", "4", "--json"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("ignoring `wandb`"), "{err}");
    let reports: Vec<Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let lrs: Vec<f64> = reports.iter().filter_map(|r| r["learning_rate"].as_f64()).collect();
    // The flag's 4 iterations, not the file's 8; warm-up 0 -> 1e-2 over 2 steps, then cosine from 1e-2.
    let want = [0.0, 5e-3, 1e-2, 1e-2];
    assert_eq!(lrs.len(), 4, "{reports:?}");
    for (got, want) in lrs.iter().zip(want) {
        assert!((got - want).abs() < 1e-7, "learning rates {lrs:?}");
    }
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(w.join("a/adapter_config.json")).unwrap()).unwrap();
    assert_eq!(
        cfg["lora_parameters"],
        json!({"rank": 2, "scale": 4.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "self_attn.v_proj"]})
    );
    assert_eq!(cfg["batch_size"], 2);
    // Settings it cannot honour are errors naming them.
    std::fs::write(&cfg_path, "optimizer: muon\n").unwrap();
    let out = rmlx(&["lora", "-c", s(&cfg_path), "--model", s(&model), "--train", "--data", s(&data)]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unknown optimizer `muon`"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(&cfg_path, "batch_size: four\n").unwrap();
    let out = rmlx(&["lora", "-c", s(&cfg_path), "--model", s(&model), "--train", "--data", s(&data)]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("lora.yaml: `batch_size` has the wrong type"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&w);
}

/// `--optimizer adafactor` (MLX's defaults: relative step sizes) trains the last block's own
/// weights, matrices with factored second moments and norms with whole ones. With `-c`,
/// `optimizer_config.adafactor` sets MLX's arguments: `relative_step: false` makes it follow the
/// learning rate, so a rate of 0 leaves the adapters as they start; a key MLX does not take is an
/// error.
#[test]
fn adafactor_from_the_flag_and_the_config() {
    let w = workspace("adafactor");
    let (model, data) = (w.join("model"), w.join("data"));
    let val_losses = |out: &Output| -> Vec<f64> {
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok()?.get("val_loss")?.as_f64())
            .collect()
    };
    let out = rmlx(&[
        "lora",
        "--model",
        s(&model),
        "--dtype",
        "float32",
        "--train",
        "--data",
        s(&data),
        "--adapter-path",
        s(&w.join("full")),
        "--fine-tune-type",
        "full",
        "--num-layers",
        "1",
        "--optimizer",
        "adafactor",
        "--iters",
        "20",
        "--steps-per-eval",
        "20",
        "--val-batches",
        "-1",
        "--json",
    ]);
    let val = val_losses(&out);
    assert!(val.len() == 2 && val[1] < val[0], "validation loss {val:?}");
    let cfg_path = w.join("lora.yaml");
    let lora = |relative_step: bool| {
        let yaml = format!(
            "model: {}\ntrain: true\ndata: {}\nadapter_path: {}\niters: 4\nsteps_per_eval: 4\nval_batches: -1\nlearning_rate: 0.0\n\
             optimizer: adafactor\noptimizer_config:\n  adafactor:\n    relative_step: {relative_step}\n    beta_1: 0.9\n    \
             weight_decay: 0.1\nlora_parameters:\n  rank: 4\n  scale: 20.0\n  dropout: 0.0\n",
            s(&model),
            s(&data),
            s(&w.join("lora"))
        );
        std::fs::write(&cfg_path, yaml).unwrap();
        val_losses(&rmlx(&["lora", "-c", s(&cfg_path), "--dtype", "float32", "--json"]))
    };
    let fixed = lora(false);
    assert!(fixed.len() == 2 && fixed[1] == fixed[0], "a learning rate of 0: {fixed:?}");
    let relative = lora(true);
    assert!(
        relative.len() == 2 && relative[0] == fixed[0] && relative[1] != relative[0],
        "relative steps: {relative:?}"
    );
    std::fs::write(&cfg_path, "optimizer: adafactor\noptimizer_config:\n  adafactor:\n    beta1: 0.9\n").unwrap();
    let out = rmlx(&["lora", "-c", s(&cfg_path), "--model", s(&model), "--train", "--data", s(&data)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("lora.yaml: optimizer_config.adafactor.beta1 is no setting of MLX's adafactor optimizer"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&w);
}

/// Ctrl-C during training saves the adapters and ends the run with status 0.
#[test]
fn ctrl_c_saves_the_adapters_and_stops() {
    use std::io::{BufRead, BufReader};
    let w = workspace("sigint");
    let (model, data, out_dir) = (w.join("model"), w.join("data"), w.join("a"));
    let mut child = Command::new(RMLX)
        .args(["lora", "--model", s(&model), "--train", "--data", s(&data), "--adapter-path", s(&out_dir)])
        .args(["--iters", "100000", "--steps-per-report", "1", "--save-every", "100000", "--json"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the first report, then interrupt.
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().expect("a report").unwrap();
    assert!(first.contains("train_loss") || first.contains("val_loss"), "{first}");
    // SAFETY: kill(2) on the pid of our own child.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) }, 0);
    let status = child.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(0), "{err}");
    assert!(err.contains("  save  ") && err.contains("adapters.safetensors"), "{err}");
    assert!(err.contains("interrupted at iteration"), "{err}");
    assert!(out_dir.join("adapters.safetensors").exists());
    assert!(out_dir.join("state.safetensors").exists());
    // The adapters written at the interruption resume the run.
    let last = out_dir.join("adapters.safetensors");
    let out = rmlx(&[
        "lora",
        "--model",
        s(&model),
        "--train",
        "--data",
        s(&data),
        "--adapter-path",
        s(&w.join("b")),
        "--resume-adapter-file",
        s(&last),
        "--iters",
        "100",
        "--json",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("resuming at iteration"), "{err}");
    let _ = std::fs::remove_dir_all(&w);
}

/// `--grad-checkpoint` (or `grad_checkpoint: true` in the `-c` file) trains as without it: the
/// same losses without dropout, and it is recorded in adapter_config.json. With LoRA dropout the
/// losses differ (a checkpointed block draws its masks from a key of its own): the setting from the
/// file reaches the training loop.
#[test]
fn grad_checkpoint_and_lora_kernels_train_as_without_them() {
    let w = workspace("checkpoint");
    let (model, data) = (w.join("model"), w.join("data"));
    let run = |name: &str, extra: &[&str]| -> (Vec<f64>, Value) {
        let dir = w.join(name);
        let mut args = vec![
            "lora",
            "--model",
            s(&model),
            "--dtype",
            "float32",
            "--train",
            "--data",
            s(&data),
            "--adapter-path",
            s(&dir),
            "--iters",
            "12",
            "--batch-size",
            "4",
            "--learning-rate",
            "1e-2",
            "--steps-per-report",
            "4",
            "--steps-per-eval",
            "12",
            "--val-batches",
            "-1",
            "--num-layers",
            "-1",
            "--lora-rank",
            "4",
            "--json",
        ];
        args.extend_from_slice(extra);
        let out = rmlx(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && !err.contains("ignoring"), "{err}");
        let losses = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok()?.get("train_loss")?.as_f64())
            .collect();
        (losses, serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap()).unwrap())
    };
    let (plain, cfg) = run("plain", &[]);
    assert_eq!(cfg["grad_checkpoint"], false);
    let (checkpointed, cfg) = run("flag", &["--grad-checkpoint"]);
    assert_eq!(cfg["grad_checkpoint"], true);
    assert_eq!(plain.len(), 3);
    assert!(plain[2] < plain[0], "training lowers the loss: {plain:?}");
    for (a, b) in plain.iter().zip(&checkpointed) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "train losses {plain:?} without checkpointing, {checkpointed:?} with");
    }
    // `--lora-kernels` asks for rmlx's CUDA kernels, which decline on the CPU: the same run.
    let (kernels, _) = run("kernels", &["--lora-kernels"]);
    assert_eq!(plain, kernels, "train losses without and with --lora-kernels on the CPU");
    let yaml = |checkpoint: bool| {
        let path = w.join(format!("{checkpoint}.yaml"));
        std::fs::write(&path, format!("grad_checkpoint: {checkpoint}\nlora_parameters:\n  dropout: 0.25\n")).unwrap();
        path
    };
    let (with_dropout, _) = run("dropout", &["-c", s(&yaml(false))]);
    let (both, cfg) = run("dropout-checkpointed", &["-c", s(&yaml(true))]);
    assert_eq!(
        (cfg["grad_checkpoint"].as_bool(), cfg["lora_parameters"]["dropout"].as_f64()),
        (Some(true), Some(0.25))
    );
    assert_ne!(with_dropout, both);
    let _ = std::fs::remove_dir_all(&w);
}

/// Every training step hands MLX the same operations in the same order (`RMLX_LOG=trace` logs each
/// step's `rmlx::graph_signature`): MLX's CUDA backend reuses a step's CUDA graphs only then, and
/// instantiated new ones for most of every step while the finiteness check took the updated
/// parameters in a hash map's order. The data's texts all have one length, so every batch has one
/// shape; the first step differs (the factors' compute copies are made before it), and with
/// gradient accumulation the accumulating and the applying steps differ from each other.
#[test]
fn every_training_step_evaluates_the_same_operations_in_the_same_order() {
    let w = workspace("signature");
    let (model, data) = (w.join("model"), w.join("data"));
    let signatures = |accumulate: &str| -> Vec<String> {
        let dir = w.join(format!("adapters-{accumulate}"));
        let out = Command::new(RMLX)
            .args(["lora", "--model", s(&model), "--train", "--data", s(&data), "--adapter-path", s(&dir)])
            .args(["--iters", "7", "--batch-size", "4", "--steps-per-eval", "100", "--val-batches", "1"])
            .args(["--num-layers", "-1", "--grad-accumulation-steps", accumulate])
            .env("RMLX_LOG", "trace")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        let found: Vec<String> =
            err.lines().filter_map(|l| Some(l.split_once("graph signature ")?.1.trim().to_string())).collect();
        assert_eq!(found.len(), 7, "one signature a step: {err}");
        found
    };
    let every = signatures("1");
    assert!(every[1..].iter().all(|g| *g == every[1]), "steps 2-7 differ: {every:?}");
    // Steps 1, 3, 5 accumulate (3 and 5 add to a sum), 2, 4, 6 apply the update, 7 is the last.
    let accumulating = signatures("2");
    assert_eq!(accumulating[2], accumulating[4], "{accumulating:?}");
    assert_eq!(accumulating[3], accumulating[5], "{accumulating:?}");
    assert_ne!(accumulating[2], accumulating[3], "{accumulating:?}");
    let _ = std::fs::remove_dir_all(&w);
}

/// `rmlx fuse` runs for real (bare, and with mlx_lm.fuse's `--dequantize`), and the fused folder
/// generates what the base model with the adapters generates.
#[test]
fn fuse_writes_a_model_that_generates_as_the_adapters_do() {
    let w = workspace("fuse");
    let (model, data, adapters) = (w.join("model"), w.join("data"), w.join("adapters"));
    let out = rmlx(&[
        "lora",
        "--model",
        s(&model),
        "--dtype",
        "float32",
        "--train",
        "--data",
        s(&data),
        "--adapter-path",
        s(&adapters),
        "--iters",
        "12",
        "--batch-size",
        "4",
        "--learning-rate",
        "1e-2",
        "--num-layers",
        "-1",
        "--lora-rank",
        "4",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let help = rmlx(&["fuse", "--help"]);
    assert_eq!(String::from_utf8_lossy(&help.stdout).matches("--dequantize").count(), 1);
    for (tag, extra) in [("bare", &[][..]), ("dequantize", &["--dequantize"][..])] {
        let fused = w.join(format!("fused-{tag}"));
        let mut args = vec!["fuse", "--model", s(&model), "--adapter-path", s(&adapters), "--save-path", s(&fused)];
        args.extend_from_slice(extra);
        let out = rmlx(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{tag}: {err}");
        assert!(err.contains("fused 14 adapted layers"), "{err}");
        std::fs::copy(model.join("tokenizer.json"), fused.join("tokenizer.json")).unwrap();
        let ids = |m: &Path, extra: &[&str]| {
            let out = greedy(m, "8", &[&["--json"][..], extra].concat());
            serde_json::from_slice::<Value>(&out.stdout).unwrap()["token_ids"].clone()
        };
        assert_eq!(ids(&fused, &[]), ids(&model, &["--adapter-path", s(&adapters)]), "{tag}");
    }
    let _ = std::fs::remove_dir_all(&w);
}

/// A mixture of experts (the `qwen3_moe` fixture: experts in layers 0 and 2, layer 1 dense) takes
/// adapters as mlx-lm's `LoRASwitchLinear`s: one per expert under `mlp.switch_mlp.<proj>.lora_a`
/// `[experts, rank, in]` and `lora_b` `[experts, out, rank]`, beside the linear layers' (routers
/// included); training lowers the loss, and the fused model generates what the adapters do. (mlx-lm
/// 0.32.2 loading these adapters, and the fused folder, decoded the same greedy ids as rmlx when
/// this was written.) DoRA and PEFT's layout have no form for them: clear errors.
#[test]
fn experts_take_adapters_as_mlx_lm_names_them() {
    let w = workspace_of("experts", "qwen3_moe");
    let (model, data, adapters) = (w.join("model"), w.join("data"), w.join("adapters"));
    let train = |dir: &Path, extra: &[&str]| {
        let mut args = vec!["lora", "--model", s(&model), "--dtype", "float32", "--train", "--data", s(&data)];
        args.extend_from_slice(&["--adapter-path", s(dir), "--iters", "12", "--batch-size", "4"]);
        args.extend_from_slice(&["--learning-rate", "1e-2", "--num-layers", "-1", "--lora-rank", "4"]);
        args.extend_from_slice(&["--steps-per-report", "4", "--json"]);
        args.extend_from_slice(extra);
        rmlx(&args)
    };
    let out = train(&adapters, &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let losses: Vec<f64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok()?.get("train_loss")?.as_f64())
        .collect();
    assert!(losses.len() == 3 && losses[2] < losses[0], "training lowers the loss: {losses:?}");
    let saved = rmlx::io::load_safetensors(adapters.join("adapters.safetensors")).unwrap().arrays;
    for layer in [0, 2] {
        for (proj, input, output) in [("gate_proj", 64, 32), ("up_proj", 64, 32), ("down_proj", 32, 64)] {
            let name = format!("model.layers.{layer}.mlp.switch_mlp.{proj}");
            assert_eq!(saved[&format!("{name}.lora_a")].shape(), [8, 4, input], "{name}");
            assert_eq!(saved[&format!("{name}.lora_b")].shape(), [8, output, 4], "{name}");
        }
        assert_eq!(saved[&format!("model.layers.{layer}.mlp.gate.lora_a")].shape(), [64, 4]);
    }
    assert!(!saved.keys().any(|n| n.starts_with("model.layers.1.mlp.switch_mlp")), "layer 1 is dense");
    // 2 routed blocks × (4 attention + router + 3 expert layers) + 1 dense block × (4 + 3).
    assert_eq!(saved.len(), 2 * 23);
    let fused = w.join("fused");
    let out = rmlx(&["fuse", "--model", s(&model), "--adapter-path", s(&adapters), "--save-path", s(&fused)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("fused 23 adapted layers"), "{err}");
    std::fs::copy(model.join("tokenizer.json"), fused.join("tokenizer.json")).unwrap();
    let ids = |m: &Path, extra: &[&str]| {
        let out = greedy(m, "8", &[&["--json"][..], extra].concat());
        serde_json::from_slice::<Value>(&out.stdout).unwrap()["token_ids"].clone()
    };
    let adapted = ids(&model, &["--adapter-path", s(&adapters)]);
    assert_eq!(ids(&fused, &[]), adapted);
    assert_ne!(ids(&model, &[]), adapted, "the adapters change what the model generates");
    let out = train(&w.join("dora"), &["--fine-tune-type", "dora"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("DoRA has no form for a mixture of experts"), "{err}");
    let _ = std::fs::remove_dir_all(&w);
}

/// `rmlx lora` arguments training `model` on `data` into `adapters` for 8 iterations of `batch`
/// examples, reporting every 4 as JSON.
fn short_training<'a>(model: &'a Path, data: &'a Path, adapters: &'a Path, batch: &'a str) -> Vec<&'a str> {
    let mut args = vec!["lora", "--model", s(model), "--dtype", "float32", "--train", "--data", s(data)];
    // Plain SGD with small steps: the two runs add their float32 sums in different orders, and
    // Adam (which turns the rounding noise of gradients that are zero in exact arithmetic into
    // whole steps) or large steps on this random model (losses of 11) grow that apart.
    args.extend(["--adapter-path", s(adapters), "--iters", "8", "--batch-size", batch, "--optimizer", "sgd"]);
    args.extend(["--learning-rate", "2e-3"]);
    args.extend(["--steps-per-report", "4", "--steps-per-eval", "8", "--val-batches", "-1", "--json"]);
    args
}

/// The JSON report lines of `stdout` (rank 0's, under `rmlx launch`).
fn reports(stdout: &[u8]) -> Vec<Value> {
    let text = String::from_utf8_lossy(stdout);
    text.lines().map(|l| serde_json::from_str(l.strip_prefix("[rank 0] ").unwrap_or(l)).unwrap()).collect()
}

#[test]
fn data_parallel_training_over_two_ranks_is_the_training_of_one_process() {
    let w = workspace("data-parallel");
    let (model, data) = (w.join("model"), w.join("data"));
    // Examples of 4 to 12 tokens: the two ranks' halves of a batch hold different numbers of loss
    // targets, which weigh their gradients.
    let lines: Vec<String> = (0..24)
        .map(|i| {
            let words: Vec<String> = (0..4 + i % 9).map(|k| format!("t{}", (i * 7 + 3 * k) % 60 + 2)).collect();
            json!({"text": words.join(" ")}).to_string()
        })
        .collect();
    std::fs::write(data.join("train.jsonl"), lines.join("\n") + "\n").unwrap();
    let (one, two) = (w.join("one"), w.join("two"));
    let single = rmlx(&short_training(&model, &data, &one, "4"));
    assert!(single.status.success(), "{}", String::from_utf8_lossy(&single.stderr));
    let mut launch = vec!["launch", "-n", "2", "--backend", "ring", "--"];
    launch.extend(short_training(&model, &data, &two, "4"));
    let split = rmlx(&launch);
    let stderr = String::from_utf8_lossy(&split.stderr);
    assert!(split.status.success(), "{stderr}");
    assert!(!String::from_utf8_lossy(&split.stdout).contains("[rank 1]"), "rank 1 reported");
    // The same losses, targets counted over the whole batch, and validation.
    let (a, b) = (reports(&single.stdout), reports(&split.stdout));
    assert_eq!(a.len(), b.len(), "{a:?}\n{b:?}");
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x["iter"], y["iter"]);
        assert_eq!(x["trained_tokens"], y["trained_tokens"]);
        for key in ["train_loss", "val_loss"] {
            if let (Some(p), Some(q)) = (x[key].as_f64(), y[key].as_f64()) {
                assert!((p - q).abs() < 1e-5 * p.abs().max(1.0), "{key} at {}: {p} vs {q}", x["iter"]);
            }
        }
    }
    assert!(a.iter().any(|r| r["trained_tokens"].as_u64().is_some()), "{a:?}");
    // The same adapters (written by rank 0 alone).
    let read = |dir: &Path| rmlx::io::load_safetensors(dir.join("adapters.safetensors")).unwrap().arrays;
    let (wa, wb) = (read(&one), read(&two));
    assert_eq!(wa.len(), wb.len());
    let mut moved = 0.0f32;
    for (name, x) in &wa {
        let (x, y) = (x.to_vec::<f32>().unwrap(), wb[name].to_vec::<f32>().unwrap());
        let d = x.iter().zip(&y).map(|(p, q)| (p - q).abs()).fold(0.0, f32::max);
        assert!(d < 1e-5, "{name} differs by {d}");
        if name.ends_with("lora_b") {
            moved = moved.max(x.iter().map(|v| v.abs()).fold(0.0, f32::max));
        }
    }
    assert!(moved > 1e-3, "the adapters did not train ({moved})");
    // A batch the ranks cannot share evenly is refused before training.
    let mut launch = vec!["launch", "-n", "2", "--backend", "ring", "--"];
    launch.extend(short_training(&model, &data, &two, "3"));
    let out = rmlx(&launch);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("batch size 3 does not split over 2 data-parallel ranks"), "{err}");
    let _ = std::fs::remove_dir_all(&w);
}
