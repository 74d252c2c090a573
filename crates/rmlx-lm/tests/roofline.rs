//! The bandwidth floor's arithmetic on the fixtures: weight bytes per token against the
//! checkpoint's own tensor sizes, key/value bytes per token against a hand count (Gemma 3's
//! windows included), and a measured bandwidth that is a plausible number.

mod common;

use common::fixture_with_tokenizer;
use rmlx_lm::roofline::{kv_bytes_per_token, measure_bandwidth, weight_bytes_per_token};
use rmlx_lm::LoadOptions;

/// Each tensor's name and byte count, read straight from a safetensors header (8-byte length, then
/// JSON with `data_offsets`), independently of the loader's own parser.
fn check_file(path: &std::path::Path) -> Option<Vec<(String, u64)>> {
    let bytes = std::fs::read(path).ok()?;
    let len = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(bytes.get(8..8 + len)?).ok()?;
    let tensors = header.into_iter().filter(|(name, _)| name != "__metadata__");
    tensors
        .map(|(name, t)| {
            let off = t["data_offsets"].as_array()?;
            Some((name, off[1].as_u64()? - off[0].as_u64()?))
        })
        .collect()
}

#[test]
fn weight_bytes_are_every_tensor_but_an_untied_embedding_read_one_row() {
    let dir = fixture_with_tokenizer("llama_mqa_untied");
    let lm = rmlx_lm::loader::load(dir.path(), &LoadOptions::default()).unwrap();
    let (mut all, mut embedding) = (0, 0);
    for f in std::fs::read_dir(dir.path()).unwrap() {
        let path = f.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            for (name, bytes) in check_file(&path).unwrap() {
                all += bytes;
                if name.starts_with("model.embed_tokens.") {
                    embedding += bytes;
                }
            }
        }
    }
    // bf16, vocabulary 256, hidden 64: the table is 32,768 bytes, a row 128.
    assert_eq!(embedding, 256 * 64 * 2);
    assert_eq!(weight_bytes_per_token(&lm), all - embedding + 128);

    // A tied table is the output head too: read whole.
    let dir = fixture_with_tokenizer("llama_gqa");
    let lm = rmlx_lm::loader::load(dir.path(), &LoadOptions::default()).unwrap();
    let all: u64 = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|f| f.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .flat_map(|p| check_file(&p).unwrap())
        .map(|(_, bytes)| bytes)
        .sum();
    assert_eq!(weight_bytes_per_token(&lm), all);
}

/// The fixture `name` loaded (with its folder, which the model's lazily read weights need), and its
/// file's bytes: in all, of the input embedding, and of the experts (`.mlp.experts.` in the stored
/// names).
fn loaded_with_bytes(name: &str) -> (common::TempDir, rmlx_lm::LoadedModel, [u64; 3]) {
    let dir = fixture_with_tokenizer(name);
    let lm = rmlx_lm::loader::load(dir.path(), &LoadOptions::default()).unwrap();
    let mut bytes = [0; 3];
    for (name, b) in check_file(&dir.path().join("model.safetensors")).unwrap() {
        bytes[0] += b;
        if name.starts_with("model.embed_tokens.") {
            bytes[1] += b;
        }
        if name.contains(".mlp.experts.") {
            bytes[2] += b;
        }
    }
    (dir, lm, bytes)
}

/// A mixture of experts: a token reads the 4 experts it is routed to out of 8 (`qwen3_moe`'s
/// stacked `switch_mlp` tensors count half), everything else whole (untied: one embedding row).
#[test]
fn weight_bytes_count_the_routed_experts_only() {
    let (_dir, lm, [all, embedding, experts]) = loaded_with_bytes("qwen3_moe");
    // float32, vocabulary 320, hidden 64: a row is 256 bytes; 2 routed layers × 8 experts × 3
    // matrices of 64 × 32.
    assert_eq!(experts, 2 * 8 * 3 * 64 * 32 * 4);
    assert_eq!(weight_bytes_per_token(&lm), all - embedding + 256 - experts / 2);
}

/// gpt-oss: the experts under `mlp.experts` (transformers' fused `gate_up_proj`, `down_proj` and
/// their per-expert biases, rewritten at load into three projections of the same bytes): a token
/// reads 2 of 4.
#[test]
fn weight_bytes_count_gpt_oss_routed_experts_and_their_biases() {
    let (_dir, lm, [all, embedding, experts]) = loaded_with_bytes("gpt_oss");
    // float32, hidden 64, width 32, 4 experts, 2 layers: gate_up [4, 64, 64] and its bias [4, 64],
    // down [4, 32, 64] and its bias [4, 64].
    assert_eq!(experts, 2 * 4 * (64 * 64 + 64 + 32 * 64 + 64) * 4);
    assert_eq!(weight_bytes_per_token(&lm), all - embedding + 256 - experts / 2);
}

#[test]
fn key_value_bytes_count_each_layers_window() {
    // Gemma 3 fixture: 6 layers (2 global, 4 with a window of 8), 1 key/value head of 32, float32:
    // 256 bytes a position and layer. Decoding 4 tokens after 20 reads positions 21..=24 in the
    // global layers and 8 in the others: (2 × 90 + 4 × 4 × 8) / 4 × 256 = 19,712 bytes a token.
    let dir = fixture_with_tokenizer("gemma3_text");
    let lm = rmlx_lm::loader::load(dir.path(), &LoadOptions::default()).unwrap();
    assert_eq!(kv_bytes_per_token(&lm, 20, 4), 19_712);
    // Within the window every layer reads every position: 6 × (1 + 2 + 3) / 3 × 256.
    assert_eq!(kv_bytes_per_token(&lm, 0, 3), 3_072);
    assert_eq!(kv_bytes_per_token(&lm, 5, 0), 0);
}

#[test]
fn the_measured_bandwidth_is_plausible() {
    // Between 100 MB/s and 100 TB/s on any machine that runs the tests.
    let b = measure_bandwidth().unwrap();
    assert!(b > 1e8 && b < 1e14, "{b} bytes/s");
}
