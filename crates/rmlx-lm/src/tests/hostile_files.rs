//! Hostile and broken model files: lying safetensors headers, absurd or invalid config values,
//! unsupported quantisation, checkpoints that disagree with their config, a tokenizer.json that is
//! not JSON, and GGUF files found by content rather than name. Each gets a clear error of the
//! right kind naming the problem (never a panic, an abort or a huge allocation).

use super::common::{self, fixture_with_tokenizer, TempDir};
use super::gguf_model::{gguf_model, set_meta};
use crate::safetensors_header;
use crate::ModelConfig;
use crate::{Error, LoadOptions};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};

fn load(dir: &Path) -> crate::Result<crate::LoadedModel> {
    crate::loader::load(dir, &LoadOptions { progress: false, ..LoadOptions::default() })
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut Map<String, Value>)) {
    let p = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(v.as_object_mut().unwrap());
    std::fs::write(&p, v.to_string()).unwrap();
}

fn config_reason(e: Error) -> String {
    match e {
        Error::Config(m) => m,
        other => panic!("expected Error::Config, got {other:?}"),
    }
}

fn corrupt_reason(e: Error) -> String {
    match e {
        Error::Corrupt { reason, .. } => reason,
        other => panic!("expected Error::Corrupt, got {other:?}"),
    }
}

/// Splits a safetensors file into its header (as JSON) and its data section.
fn split(path: &Path) -> (Map<String, Value>, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (serde_json::from_slice(&bytes[8..8 + n]).unwrap(), bytes[8 + n..].to_vec())
}

/// A safetensors image from a header and a data section.
fn join(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header);
    out.extend(data);
    out
}

/// Rewrites the header of a fixture's `model.safetensors`, keeping its data.
fn edit_header(dir: &Path, f: impl FnOnce(&mut Map<String, Value>)) -> PathBuf {
    let p = dir.join("model.safetensors");
    let (mut header, data) = split(&p);
    f(&mut header);
    std::fs::write(&p, join(Value::Object(header).to_string().as_bytes(), &data)).unwrap();
    p
}

const EMBED: &str = "model.embed_tokens.weight";

#[test]
fn safetensors_dimension_beyond_i32_is_corrupt() {
    // MLX would read [2^32 + 384, 64] as [384, 64].
    let d = fixture_with_tokenizer("llama_gqa");
    edit_header(d.path(), |h| h[EMBED]["shape"] = json!([(1u64 << 32) + 384, 64]));
    let reason = corrupt_reason(load(d.path()).err().unwrap());
    assert!(reason.contains(EMBED) && reason.contains("4294967680") && reason.contains("exceeds"), "{reason}");
}

#[test]
fn safetensors_header_length_beyond_the_file() {
    let d = fixture_with_tokenizer("llama_gqa");
    let p = d.path().join("model.safetensors");
    let mut bytes = std::fs::read(&p).unwrap();
    let len = bytes.len() as u64;
    bytes[..8].copy_from_slice(&len.to_le_bytes());
    std::fs::write(&p, &bytes).unwrap();
    let reason = corrupt_reason(load(d.path()).err().unwrap());
    assert!(reason.contains(&format!("header length {len} exceeds the file size {len}")), "{reason}");
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&p, &bytes).unwrap();
    let reason = corrupt_reason(load(d.path()).err().unwrap());
    assert!(reason.contains("exceeds the limit"), "{reason}");
}

#[test]
fn safetensors_header_not_json() {
    let d = fixture_with_tokenizer("llama_gqa");
    let p = d.path().join("model.safetensors");
    let (_, data) = split(&p);
    std::fs::write(&p, join(b"{\"a\": [1, 2", &data)).unwrap();
    let e = load(d.path()).err().unwrap();
    assert!(e.to_string().contains("model.safetensors"), "{e}");
    assert!(corrupt_reason(e).contains("not a JSON object"));
}

#[test]
fn safetensors_unknown_dtype() {
    let d = fixture_with_tokenizer("llama_gqa");
    edit_header(d.path(), |h| h[EMBED]["dtype"] = json!("F4"));
    let reason = corrupt_reason(load(d.path()).err().unwrap());
    assert!(reason.contains(EMBED) && reason.contains("unknown dtype `F4`"), "{reason}");
}

#[test]
fn safetensors_size_disagrees_with_dtype() {
    // Float32 data declared float16: the byte range holds twice what the shape needs.
    let d = fixture_with_tokenizer("llama_gqa");
    edit_header(d.path(), |h| h[EMBED]["dtype"] = json!("F16"));
    let reason = corrupt_reason(load(d.path()).err().unwrap());
    assert!(
        reason.contains(EMBED) && reason.contains("hold 98304 bytes") && reason.contains("needs 49152"),
        "{reason}"
    );
}

#[test]
fn safetensors_overlap_gap_and_trailing_bytes() {
    let dir = TempDir::new("st-layout");
    let p = dir.path().join("x.safetensors");
    let check = |header: Value, data_len: usize| {
        std::fs::write(&p, join(header.to_string().as_bytes(), &vec![0u8; data_len])).unwrap();
        safetensors_header::check_file(&p)
    };
    let t = |b: u64, e: u64| json!({"dtype": "F32", "shape": [(e - b) / 4], "data_offsets": [b, e]});
    let ok = check(json!({"a": t(0, 16), "b": t(16, 32), "__metadata__": {"format": "pt"}}), 32).unwrap();
    assert_eq!(
        ok.iter().map(|t| (t.name.as_str(), t.data_offsets)).collect::<Vec<_>>(),
        [("a", (0, 16)), ("b", (16, 32))]
    );
    assert_eq!(ok[0].shape, [4]);
    // MLX writes `"__metadata__": null` for a file without metadata.
    assert_eq!(check(json!({"a": t(0, 16), "__metadata__": null}), 16).unwrap().len(), 1);
    let reason = corrupt_reason(check(json!({"a": t(0, 16), "b": t(8, 24)}), 24).unwrap_err());
    assert!(reason.contains("`b`") && reason.contains("overlaps tensor `a`"), "{reason}");
    let reason = corrupt_reason(check(json!({"a": t(0, 16), "b": t(20, 36)}), 36).unwrap_err());
    assert!(reason.contains("`b`") && reason.contains("gap after tensor `a`"), "{reason}");
    let reason = corrupt_reason(check(json!({"a": t(0, 16)}), 20).unwrap_err());
    assert!(reason.contains("end at byte 16 of a 20-byte data section"), "{reason}");
    let reason = corrupt_reason(check(json!({"a": t(0, 16)}), 12).unwrap_err());
    assert!(reason.contains("`a` ends at byte 16 of a 12-byte data section (truncated"), "{reason}");
    let reason =
        corrupt_reason(check(json!({"a": {"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}}), 16).unwrap_err());
    assert!(reason.contains("`a`") && reason.contains("hold -16 bytes"), "{reason}");
    let reason =
        corrupt_reason(check(json!({"a": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}), 16).unwrap_err());
    assert!(reason.contains("`a`") && reason.contains("not a size"), "{reason}");
    let reason = corrupt_reason(check(json!({"__metadata__": {"k": 1}}), 0).unwrap_err());
    assert!(reason.contains("__metadata__"), "{reason}");
    // Shapes whose element count overflows 64 bits.
    let big = i32::MAX as u64;
    let reason = corrupt_reason(
        check(json!({"a": {"dtype": "F64", "shape": [big, big, big], "data_offsets": [0, 8]}}), 8).unwrap_err(),
    );
    assert!(reason.contains("overflows"), "{reason}");
}

#[test]
fn safetensors_trailing_bytes_through_the_loader() {
    let d = fixture_with_tokenizer("llama_gqa");
    let p = d.path().join("model.safetensors");
    let mut bytes = std::fs::read(&p).unwrap();
    bytes.extend([0; 4]);
    std::fs::write(&p, &bytes).unwrap();
    let reason = corrupt_reason(load(d.path()).err().unwrap());
    assert!(reason.contains("disagrees with the file size"), "{reason}");
}

/// The llama_gqa config with one field replaced.
fn config_with(field: &str, v: Value) -> crate::Result<ModelConfig> {
    let text = std::fs::read_to_string(common::fixture_dir("llama_gqa").join("config.json")).unwrap();
    let mut c: Map<String, Value> = serde_json::from_str(&text).unwrap();
    c.insert(field.into(), v);
    ModelConfig::from_value(Value::Object(c))
}

#[test]
fn config_sizes_zero_negative_huge_or_mistyped() {
    ModelConfig::from_value(
        serde_json::from_str(&std::fs::read_to_string(common::fixture_dir("llama_gqa").join("config.json")).unwrap())
            .unwrap(),
    )
    .unwrap();
    for &field in common::CONFIG_SIZE_FIELDS {
        for (v, words) in [
            (json!(0), "must be positive, got 0"),
            (json!(-3), "must be positive, got -3"),
            (json!(1u64 << 40), "is 1099511627776, more than"),
            (json!(u64::MAX), "is 18446744073709551615, more than"),
            (json!("64"), "must be an integer"),
            (json!(64.5), "must be an integer"),
        ] {
            let m = config_reason(config_with(field, v.clone()).unwrap_err());
            assert!(m.contains(&format!("`{field}`")) && m.contains(words), "{field} = {v}: {m}");
        }
    }
    // Two billion tokens would build a 38 GB placeholder vocabulary: refused by bound.
    let m = config_reason(config_with("vocab_size", json!(i32::MAX)).unwrap_err());
    assert!(m.contains("`vocab_size` is 2147483647, more than the 16777216"), "{m}");
    let m = config_reason(config_with("tie_word_embeddings", json!("yes")).unwrap_err());
    assert!(m.contains("`tie_word_embeddings` must be true or false"), "{m}");
    let m = config_reason(config_with("eos_token_id", json!([-1])).unwrap_err());
    assert!(m.contains("`eos_token_id`"), "{m}");
    let m = config_reason(config_with("head_dim", json!(15)).unwrap_err());
    assert!(m.contains("`head_dim` (15) must be even"), "{m}");
    let m = config_reason(config_with("num_key_value_heads", json!(3)).unwrap_err());
    assert!(m.contains("num_key_value_heads (3)"), "{m}");
}

#[test]
fn config_invalid_floats() {
    for field in ["rms_norm_eps", "query_pre_attn_scalar", "final_logit_softcapping"] {
        for (v, shown) in [
            (json!(-1), "-1"),
            (json!(0), "0"),
            (json!(1e300), "1e+300"),
            (json!(1e-50), "1e-50"),
            (json!(-1.0), "-1.0"),
        ] {
            let m = config_reason(config_with(field, v).unwrap_err());
            assert!(m.contains(&format!("`{field}` must be positive and finite, got {shown}")), "{m}");
        }
        let m = config_reason(config_with(field, json!("x")).unwrap_err());
        assert!(m.contains(&format!("`{field}` must be a number")), "{m}");
    }
    // RoPE bases below 1 send the frequencies to infinity (found by fuzz_config_floats_through_the_loader).
    for field in ["rope_theta", "rope_local_base_freq"] {
        for (v, shown) in
            [(json!(0), "0"), (json!(-1), "-1"), (json!(1e-45), "1e-45"), (json!(0.5), "0.5"), (json!(1e39), "1e+39")]
        {
            let m = config_reason(config_with(field, v).unwrap_err());
            assert!(m.contains(&format!("`{field}` must be at least 1 and finite, got {shown}")), "{m}");
        }
    }
    config_with("rope_theta", json!(1)).unwrap();
    for factor in [json!(0), json!(0.5), json!(1e-45)] {
        let m =
            config_reason(config_with("rope_scaling", json!({"rope_type": "linear", "factor": factor})).unwrap_err());
        assert!(m.contains("rope_scaling (linear): `factor` must be at least 1"), "{m}");
    }
    let llama3 = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 32});
    let m = config_reason(config_with("rope_scaling", llama3).unwrap_err());
    assert!(m.contains("`high_freq_factor` (4) must exceed `low_freq_factor` (4)"), "{m}");
    let m = config_reason(config_with("rope_scaling", json!(2.0)).unwrap_err());
    assert!(m.contains("`rope_scaling` must be an object"), "{m}");
}

#[test]
fn invalid_floats_fail_the_load_instead_of_nan_logits() {
    for (field, v) in [("rms_norm_eps", json!(-1.0)), ("rope_theta", json!(0))] {
        let d = fixture_with_tokenizer("llama_gqa");
        edit_config(d.path(), |c| {
            c.insert(field.into(), v);
        });
        let m = config_reason(load(d.path()).err().unwrap());
        assert!(m.contains(field) && (m.contains("positive") || m.contains("at least 1")), "{m}");
    }
    let d = fixture_with_tokenizer("llama_gqa");
    edit_config(d.path(), |c| {
        c.insert("rope_scaling".into(), json!({"type": "linear", "factor": 0.0}));
    });
    let m = config_reason(load(d.path()).err().unwrap());
    assert!(m.contains("`factor` must be at least 1"), "{m}");
}

#[test]
fn placeholder_vocabulary_is_sized_from_the_checkpoint() {
    // vocab_size at the bound with no tokenizer.json: refused against the embedding's 384 rows
    // before any 16M-entry placeholder is built.
    let d = fixture_with_tokenizer("llama_gqa");
    std::fs::remove_file(d.path().join("tokenizer.json")).unwrap();
    edit_config(d.path(), |c| {
        c.insert("vocab_size".into(), json!(1 << 24));
    });
    let opts = LoadOptions { allow_missing_tokenizer: true, ..LoadOptions::default() };
    match crate::loader::load(d.path(), &opts).err().unwrap() {
        Error::ShapeMismatch { name, expected, found } => {
            assert_eq!((name.as_str(), expected, found), (EMBED, vec![1 << 24, 64], vec![384, 64]));
        }
        other => panic!("expected ShapeMismatch, got {other:?}"),
    }
    // The right size still loads.
    edit_config(d.path(), |c| {
        c.insert("vocab_size".into(), json!(384));
    });
    assert_eq!(crate::loader::load(d.path(), &opts).unwrap().tokenizer.vocab_size(), 384);
}

#[test]
fn unsupported_quantisation_parameters() {
    for (key, v, words) in [
        ("bits", 0, "bits 0 is not supported"),
        ("bits", 7, "bits 7 is not supported"),
        ("group_size", 16, "group_size 16"),
    ] {
        let d = fixture_with_tokenizer("llama_gqa_q4");
        edit_config(d.path(), |c| {
            for block in ["quantization", "quantization_config"] {
                let q = c[block].as_object_mut().unwrap();
                q.insert(key.into(), json!(v));
                for layer in ["model.embed_tokens", "model.layers.1.mlp.down_proj"] {
                    q[layer].as_object_mut().unwrap().insert(key.into(), json!(v));
                }
            }
        });
        let m = config_reason(load(d.path()).err().unwrap());
        assert!(m.contains(words) && m.contains("MLX supports"), "{key} = {v}: {m}");
    }
}

#[test]
fn fewer_layers_in_config_than_checkpoint() {
    let d = fixture_with_tokenizer("llama_gqa");
    edit_config(d.path(), |c| {
        c.insert("num_hidden_layers".into(), json!(1));
    });
    let m = config_reason(load(d.path()).err().unwrap());
    assert!(m.contains("config and checkpoint disagree") && m.contains("num_hidden_layers is 1"), "{m}");
    assert!(m.contains("holds 2 layers") && m.contains("model.layers.1."), "{m}");
}

#[test]
fn unused_tensors_are_reported_benign_ones_are_not() {
    let d = fixture_with_tokenizer("llama_gqa");
    let p = d.path().join("model.safetensors");
    let mut st = rmlx::io::load_safetensors(&p).unwrap();
    let extra = rmlx::Array::from_slice(&[1.0f32, 2.0], &[2]).unwrap();
    st.arrays.insert("model.layers.0.mlp.extra_gate.weight".into(), extra.clone());
    st.arrays.insert("model.layers.0.self_attn.rotary_emb.inv_freq".into(), extra);
    std::fs::remove_file(&p).unwrap();
    rmlx::io::save_safetensors(&p, &st.arrays, &st.metadata).unwrap();
    let lm = load(d.path()).unwrap();
    assert_eq!(lm.unused_tensors, ["model.layers.0.mlp.extra_gate.weight"]);
    let names = ["a.inv_freq", "bn.num_batches_tracked", "lm_head.bias"].map(String::from);
    assert_eq!(crate::checkpoint::unused_tensors(&names), ["lm_head.bias"]);
}

#[test]
fn tokenizer_json_that_is_not_json() {
    let d = fixture_with_tokenizer("llama_gqa");
    std::fs::write(d.path().join("tokenizer.json"), "{ \"model\": [1, 2").unwrap();
    match load(d.path()).err().unwrap() {
        Error::Tokenizer(m) => assert!(m.contains("tokenizer.json"), "{m}"),
        other => panic!("expected Error::Tokenizer, got {other:?}"),
    }
}

fn gguf_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/types.gguf")
}

#[test]
fn gguf_is_recognised_by_magic_not_extension() {
    let d = TempDir::new("magic");
    // A GGUF named .bin reaches the GGUF loader (this one has tensors but no model metadata).
    let bin = d.path().join("model.bin");
    std::fs::copy(gguf_fixture(), &bin).unwrap();
    let m = config_reason(load(&bin).err().unwrap());
    assert!(m.contains("GGUF metadata lacks `llama.attention.head_count`"), "{m}");
    // A .gguf without the magic is corrupt; any other file is neither kind of model.
    let fake = d.path().join("fake.gguf");
    std::fs::write(&fake, b"PK\x03\x04 not a gguf").unwrap();
    assert!(corrupt_reason(load(&fake).err().unwrap()).contains("magic"));
    let other = d.path().join("weights.pt");
    std::fs::write(&other, b"PK\x03\x04").unwrap();
    assert!(corrupt_reason(load(&other).err().unwrap()).contains("not a GGUF file"));
    let empty = d.path().join("empty.bin");
    std::fs::write(&empty, b"").unwrap();
    assert!(corrupt_reason(load(&empty).err().unwrap()).contains("not a GGUF file"));
}

#[test]
fn gguf_model_loads_whatever_its_name() {
    let d = TempDir::new("gguf-any-name");
    for name in ["model.gguf", "model.bin", "weights"] {
        let p = d.path().join(name);
        gguf_model(&p, |_| {});
        let lm = load(&p).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!((lm.model.config().num_hidden_layers, lm.model.config().vocab_size), (2, 384), "{name}");
        assert!(lm.unused_tensors.is_empty(), "{:?}", lm.unused_tensors);
    }
}

#[test]
fn gguf_block_count_below_the_checkpoint() {
    let d = TempDir::new("gguf-blocks");
    let p = d.path().join("m.gguf");
    gguf_model(&p, |kv| set_meta(kv, "llama.block_count", 4, 1u32.to_le_bytes().to_vec()));
    let m = config_reason(load(&p).err().unwrap());
    assert!(m.contains("config and checkpoint disagree") && m.contains("num_hidden_layers is 1"), "{m}");
    assert!(m.contains("holds 2 layers"), "{m}");
}

#[test]
fn gguf_non_finite_or_absurd_metadata() {
    let d = TempDir::new("gguf-meta");
    let p = d.path().join("m.gguf");
    gguf_model(&p, |kv| set_meta(kv, "llama.attention.layer_norm_rms_epsilon", 6, f32::NAN.to_le_bytes().to_vec()));
    let m = config_reason(load(&p).err().unwrap());
    assert!(m.contains("`llama.attention.layer_norm_rms_epsilon`") && m.contains("not a finite number"), "{m}");
    gguf_model(&p, |kv| set_meta(kv, "llama.rope.freq_base", 6, 0f32.to_le_bytes().to_vec()));
    let m = config_reason(load(&p).err().unwrap());
    assert!(m.contains("`rope_theta` must be at least 1"), "{m}");
    gguf_model(&p, |kv| set_meta(kv, "llama.attention.head_count", 4, 0u32.to_le_bytes().to_vec()));
    let m = config_reason(load(&p).err().unwrap());
    assert!(m.contains("`num_attention_heads` must be positive, got 0 (from the GGUF metadata)"), "{m}");
    gguf_model(&p, |kv| set_meta(kv, "llama.block_count", 10, u64::MAX.to_le_bytes().to_vec()));
    let m = config_reason(load(&p).err().unwrap());
    assert!(m.contains("`num_hidden_layers`") && m.contains("more than"), "{m}");
}

#[test]
fn quantisation_parameters_of_the_wrong_type() {
    let d = fixture_with_tokenizer("llama_gqa_q4");
    edit_config(d.path(), |c| {
        for block in ["quantization", "quantization_config"] {
            c[block].as_object_mut().unwrap().insert("bits".into(), json!("4"));
        }
    });
    let m = config_reason(load(d.path()).err().unwrap());
    assert!(m.contains("quantization `bits` must be an integer, got \"4\""), "{m}");
}

#[test]
fn index_naming_a_shard_outside_the_folder() {
    let d = fixture_with_tokenizer("llama_mqa_untied");
    let p = d.path().join("model.safetensors.index.json");
    let mut index: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    let map = index["weight_map"].as_object_mut().unwrap();
    let first = map.keys().next().unwrap().clone();
    map.insert(first, json!("../elsewhere/model.safetensors"));
    std::fs::write(&p, index.to_string()).unwrap();
    let m = config_reason(load(d.path()).err().unwrap());
    assert!(m.contains("shard `../elsewhere/model.safetensors` is not a file name in the model folder"), "{m}");
}

/// The unpacked width of a quantised matrix is computed in 64 bits: a packed width of 2^27
/// (never materialised: MLX arrays are lazy) would overflow i32 when multiplied by 32.
#[test]
fn quantised_width_beyond_i32_does_not_overflow() {
    use rmlx::quantization::{QuantMode, Quantized};
    let q = |bits| {
        crate::weights::Weight::Quantized(Quantized {
            weight: rmlx::ops::zeros(&[1, 1 << 27], rmlx::Dtype::Uint32).unwrap(),
            scales: rmlx::ops::zeros(&[1, 1], rmlx::Dtype::Float16).unwrap(),
            biases: None,
            group_size: 64,
            bits,
            mode: QuantMode::Affine,
        })
    };
    assert_eq!(q(8).shape(), [1, 1 << 29]);
    assert_eq!(q(2).shape(), [1, i32::MAX]);
}
