//! Property tests over mutated model files: the GGUF reader, the safetensors header validator,
//! config parsing and GGUF model metadata get valid small inputs with bytes flipped, cuts, and counts, dimensions, offsets
//! and field values set to extremes. Every outcome must be `Ok` or a clean `Err`: no panic, and the
//! memory the reader allocates stays within a small multiple of the file's length (a counting
//! allocator measures each call). Whatever is accepted must also be sound: every GGUF tensor then
//! converts or fails cleanly, MLX reads an accepted safetensors file with exactly the header's
//! shapes, and a model loaded from an accepted config produces finite logits. Case counts are fixed
//! and the seed is fixed, so CI runs the same inputs every time; inputs that once failed are kept
//! as named regression tests at the end.

use super::fuzz::{allocation_bound, apply, config, mutation, peak_allocation, scratch_file, Stats, EXTREMES};
use super::{common, gguf_model};
use crate::config::{llama3_rope_divisors, ModelConfig, RopeScaling};
use crate::gguf::GgufFile;
use crate::{safetensors_header, Error};
use proptest::prelude::*;
use serde_json::{json, Map, Value};
use std::path::Path;

// ---------------------------------------------------------------------------------------------
// GGUF.

fn gguf_base() -> (Vec<u8>, usize) {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/types.gguf");
    let bytes = std::fs::read(&p).unwrap();
    let header = GgufFile::open(&p).unwrap().tensors().iter().map(|t| t.offset as usize).min().unwrap();
    (bytes, header)
}

/// Opens a GGUF image and converts every tensor: Ok or a clean error, allocation bounded.
fn check_gguf(bytes: &[u8], path: &Path) -> Result<(), TestCaseError> {
    std::fs::write(path, bytes).unwrap();
    let (opened, peak) = peak_allocation(|| GgufFile::open(path));
    prop_assert!(peak <= allocation_bound(bytes.len()), "open allocated {peak} bytes for a {}-byte file", bytes.len());
    match opened {
        Ok(file) => {
            for t in file.tensors() {
                prop_assert!(t.offset as usize + t.nbytes <= bytes.len());
                prop_assert!(t.shape.iter().all(|&d| d <= i32::MAX as usize));
                let _ = file.load(t);
            }
            GGUF_STATS.ok();
        }
        Err(Error::Corrupt { path: p, reason }) => {
            prop_assert!(!reason.is_empty() && p.ends_with(".gguf"));
            GGUF_STATS.err();
        }
        Err(Error::Config(m)) => {
            prop_assert!(m.contains("alignment"), "{m}");
            GGUF_STATS.err();
        }
        Err(other) => prop_assert!(false, "unexpected error kind: {other:?}"),
    }
    Ok(())
}

static GGUF_STATS: Stats = Stats::new();
static ST_STATS: Stats = Stats::new();
static CONFIG_STATS: Stats = Stats::new();
static LOAD_STATS: Stats = Stats::new();
static GGUF_MODEL_STATS: Stats = Stats::new();

#[test]
fn fuzz_gguf_reader() {
    let (base, header) = gguf_base();
    let path = scratch_file("g.gguf");
    let path = path.with_extension("gguf");
    let strategy = proptest::collection::vec(mutation(base.len(), header), 1..4);
    proptest::test_runner::TestRunner::new(config(5000))
        .run(&strategy, |ms| {
            let mut bytes = base.clone();
            apply(&mut bytes, &ms);
            check_gguf(&bytes, &path)
        })
        .unwrap();
    GGUF_STATS.report("gguf");
}

// ---------------------------------------------------------------------------------------------
// safetensors.

/// A small valid safetensors image: three float32 / float16 / int32 tensors.
fn safetensors_base() -> Vec<u8> {
    let header = json!({
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "F16", "shape": [4], "data_offsets": [24, 32]},
        "c": {"dtype": "I32", "shape": [1, 2, 1], "data_offsets": [32, 40]}
    });
    let data: Vec<u8> = (0..40u8).collect();
    let header = header.to_string();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header.as_bytes());
    out.extend(data);
    out
}

/// Changes one field of one tensor entry of a safetensors image, keeping the data.
#[derive(Clone, Debug)]
enum HeaderEdit {
    Dim(usize, usize, u64),
    Offset(usize, usize, u64),
    Dtype(usize, String),
}

fn edit_header(bytes: &[u8], e: &HeaderEdit) -> Vec<u8> {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut h: Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let names = ["a", "b", "c"];
    match e {
        HeaderEdit::Dim(t, i, v) => {
            let shape = h[names[*t % 3]]["shape"].as_array_mut().unwrap();
            let i = *i % (shape.len() + 1);
            if i == shape.len() {
                shape.push(json!(v));
            } else {
                shape[i] = json!(v);
            }
        }
        HeaderEdit::Offset(t, i, v) => h[names[*t % 3]]["data_offsets"][*i % 2] = json!(v),
        HeaderEdit::Dtype(t, d) => h[names[*t % 3]]["dtype"] = json!(d),
    }
    let header = Value::Object(h).to_string();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header.as_bytes());
    out.extend(&bytes[8 + n..]);
    out
}

fn header_edit() -> impl Strategy<Value = HeaderEdit> {
    let v = prop_oneof![3 => proptest::sample::select(EXTREMES), 2 => 0..64u64, 1 => any::<u64>()];
    let dtype = proptest::sample::select(vec!["F32", "F16", "BF16", "I8", "U64", "F64", "BOOL", "F4", "f32", ""])
        .prop_map(str::to_string);
    prop_oneof![
        (0..3usize, 0..4usize, v.clone()).prop_map(|(t, i, v)| HeaderEdit::Dim(t, i, v)),
        (0..3usize, 0..2usize, v).prop_map(|(t, i, v)| HeaderEdit::Offset(t, i, v)),
        (0..3usize, dtype).prop_map(|(t, d)| HeaderEdit::Dtype(t, d)),
    ]
}

/// Validates a safetensors image; when accepted, MLX must read exactly the header's shapes.
fn check_safetensors(bytes: &[u8], path: &Path) -> Result<(), TestCaseError> {
    let (r, peak) = peak_allocation(|| safetensors_header::parse(path, bytes, bytes.len() as u64));
    prop_assert!(peak <= allocation_bound(bytes.len()), "parse allocated {peak} bytes for a {}-byte file", bytes.len());
    match r {
        Ok(tensors) => {
            let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let data_len = (bytes.len() - 8 - header_len) as u64;
            let mut at = 0;
            for t in &tensors {
                prop_assert_eq!(t.data_offsets.0, at);
                at = t.data_offsets.1;
            }
            prop_assert_eq!(at, data_len);
            std::fs::write(path, bytes).unwrap();
            let reread = safetensors_header::check_file(path).ok();
            prop_assert_eq!(reread.as_ref(), Some(&tensors));
            let st = rmlx::io::load_safetensors(path).map_err(|e| TestCaseError::fail(format!("MLX: {e}")))?;
            for t in &tensors {
                prop_assert_eq!(st.arrays[&t.name].shape(), t.shape.as_slice(), "{}", t.name);
            }
            ST_STATS.ok();
        }
        Err(Error::Corrupt { reason, .. }) => {
            prop_assert!(!reason.is_empty());
            ST_STATS.err();
        }
        Err(Error::Config(m)) => {
            prop_assert!(m.contains("which MLX cannot load"), "{m}");
            ST_STATS.err();
        }
        Err(other) => prop_assert!(false, "unexpected error kind: {other:?}"),
    }
    Ok(())
}

#[test]
fn fuzz_safetensors_header() {
    let base = safetensors_base();
    let hot = 8 + u64::from_le_bytes(base[..8].try_into().unwrap()) as usize;
    let path = scratch_file("s.safetensors");
    let strategy =
        (proptest::collection::vec(header_edit(), 0..3), proptest::collection::vec(mutation(base.len(), hot), 0..3));
    proptest::test_runner::TestRunner::new(config(5000))
        .run(&strategy, |(edits, ms)| {
            let mut bytes = edits.iter().fold(base.clone(), |b, e| edit_header(&b, e));
            apply(&mut bytes, &ms);
            check_safetensors(&bytes, &path)
        })
        .unwrap();
    ST_STATS.report("safetensors");
}

// ---------------------------------------------------------------------------------------------
// config.json.

/// Fields set to random values besides [`common::CONFIG_SIZE_FIELDS`] (rope_scaling's fields
/// included through `rope_scaling.*`).
const OTHER_CONFIG_FIELDS: &[&str] = &[
    "rms_norm_eps",
    "rope_theta",
    "rope_local_base_freq",
    "query_pre_attn_scalar",
    "final_logit_softcapping",
    "tie_word_embeddings",
    "layer_types",
    "eos_token_id",
    "model_type",
    "torch_dtype",
    "rope_scaling",
    "rope_scaling.factor",
    "rope_scaling.low_freq_factor",
    "rope_scaling.high_freq_factor",
    "rope_scaling.original_max_position_embeddings",
    "rope_scaling.rope_type",
    "quantization",
];

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        (-4i64..70).prop_map(Value::from),
        proptest::sample::select(EXTREMES).prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        proptest::sample::select(vec![
            0.0,
            -1.0,
            1e-6,
            1e-50,
            0.5,
            8.0,
            1e4,
            1e38,
            1e39,
            1e300,
            -1e300,
            f64::MIN_POSITIVE
        ])
        .prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        proptest::sample::select(vec![
            "llama",
            "qwen3",
            "gemma3_text",
            "linear",
            "llama3",
            "yarn",
            "sliding_attention",
            ""
        ])
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(2, 8, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            proptest::collection::btree_map("[a-z_]{1,8}", inner, 0..3)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn base_config() -> Map<String, Value> {
    let p = common::fixture_dir("llama_gqa").join("config.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn set_field(c: &mut Map<String, Value>, field: &str, v: Value) {
    match field.split_once('.') {
        Some((outer, inner)) => {
            if !c.get(outer).is_some_and(Value::is_object) {
                c.insert(outer.into(), json!({}));
            }
            c[outer].as_object_mut().unwrap().insert(inner.into(), v);
        }
        None => {
            c.insert(field.into(), v);
        }
    }
}

/// What an accepted config guarantees.
fn check_accepted(cfg: &ModelConfig) -> Result<(), TestCaseError> {
    prop_assert!((1..=1 << 17).contains(&cfg.hidden_size));
    prop_assert!((1..=1 << 24).contains(&cfg.vocab_size));
    prop_assert!((1..=1 << 12).contains(&cfg.num_hidden_layers));
    prop_assert!(cfg.num_attention_heads > 0 && cfg.num_attention_heads % cfg.kv_heads() == 0);
    prop_assert!(cfg.head_dim() > 0 && cfg.head_dim() % 2 == 0);
    prop_assert!(cfg.rms_norm_eps.is_finite() && cfg.rms_norm_eps > 0.0);
    prop_assert!(cfg.rope_theta.is_finite() && cfg.rope_theta > 0.0);
    let scaling = cfg.rope_scaling().map_err(|e| TestCaseError::fail(format!("accepted, then: {e}")))?;
    let s = scaling.unwrap_or(RopeScaling::Linear { factor: 1.0 });
    for d in llama3_rope_divisors(cfg.head_dim(), cfg.rope_theta, &s) {
        prop_assert!(d > 0.0 && !d.is_nan(), "RoPE divisor {d} from {s:?}");
    }
    Ok(())
}

#[test]
fn fuzz_config_parsing() {
    let base = base_config();
    let fields: Vec<&str> = common::CONFIG_SIZE_FIELDS.iter().chain(OTHER_CONFIG_FIELDS).copied().collect();
    let strategy = proptest::collection::vec((proptest::sample::select(fields), json_value()), 1..4);
    proptest::test_runner::TestRunner::new(config(5000))
        .run(&strategy, |edits| {
            let mut c = base.clone();
            for (f, v) in edits {
                set_field(&mut c, f, v);
            }
            let text = Value::Object(c).to_string();
            let (r, peak) = peak_allocation(|| {
                serde_json::from_str(&text)
                    .map_err(|e| Error::Config(e.to_string()))
                    .and_then(crate::models::spec::parse_config)
            });
            prop_assert!(peak <= allocation_bound(text.len()), "{peak} bytes for a {}-byte config", text.len());
            match r {
                Ok(cfg) => {
                    check_accepted(&cfg)?;
                    CONFIG_STATS.ok();
                }
                Err(Error::Config(m)) => {
                    prop_assert!(!m.is_empty());
                    CONFIG_STATS.err();
                }
                Err(Error::UnsupportedArchitecture { .. }) => CONFIG_STATS.err(),
                Err(other) => prop_assert!(false, "unexpected error kind: {other:?}"),
            }
            Ok(())
        })
        .unwrap();
    CONFIG_STATS.report("config");
}

/// Float fields a model reads at run time: whatever the loader accepts must give finite logits.
const FLOAT_FIELDS: &[&str] = &[
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling.factor",
    "rope_scaling.low_freq_factor",
    "rope_scaling.high_freq_factor",
];

#[test]
fn fuzz_config_floats_through_the_loader() {
    let dir = common::fixture_with_tokenizer("llama_gqa");
    let base = base_config();
    let value = prop_oneof![
        proptest::sample::select(vec![0.0, -1.0, 1e-45, 1e-30, 1e-6, 0.5, 1.0, 4.0, 1e6, 1e30, 3e38, 1e39])
            .prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        (-2i64..10).prop_map(Value::from),
    ];
    let strategy = proptest::collection::vec((proptest::sample::select(FLOAT_FIELDS), value), 1..3);
    let ids = rmlx::Array::from_slice(&[1i32, 5, 9, 2], &[1, 4]).unwrap();
    proptest::test_runner::TestRunner::new(config(2000))
        .run(&strategy, |edits| {
            let mut c = base.clone();
            for (f, v) in edits {
                set_field(&mut c, f, v);
            }
            std::fs::write(dir.path().join("config.json"), Value::Object(c).to_string()).unwrap();
            match crate::loader::load(dir.path(), &crate::LoadOptions::default()) {
                Ok(lm) => {
                    let mut caches = lm.model.new_caches(None);
                    let logits = lm.model.forward(&ids, &mut caches).unwrap();
                    let v = logits.astype(rmlx::Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
                    prop_assert!(v.iter().all(|x| x.is_finite()), "non-finite logits from {:?}", lm.model.config());
                    LOAD_STATS.ok();
                }
                Err(Error::Config(m)) => {
                    prop_assert!(!m.is_empty());
                    LOAD_STATS.err();
                }
                Err(other) => prop_assert!(false, "unexpected error kind: {other:?}"),
            }
            Ok(())
        })
        .unwrap();
    LOAD_STATS.report("config floats through the loader");
}

// ---------------------------------------------------------------------------------------------
// GGUF models: metadata values of any type and size, through the whole loader.

/// `llama.*` keys a GGUF model's configuration comes from.
const GGUF_KEYS: &[&str] = &[
    "llama.embedding_length",
    "llama.block_count",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.key_length",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.freq_base",
    "llama.context_length",
    "llama.rope.scaling.type",
    "llama.rope.scaling.factor",
];

/// A metadata value: GGUF type and encoding.
fn meta_value() -> impl Strategy<Value = (u32, Vec<u8>)> {
    let floats = vec![0.0f32, -1.0, 1e-45, 1e-6, 0.5, 1.0, 2.0, 1e4, 3e38, f32::INFINITY, f32::NAN];
    prop_oneof![
        prop_oneof![0..70u32, proptest::sample::select(EXTREMES).prop_map(|v| v as u32)]
            .prop_map(|v| (4, v.to_le_bytes().to_vec())),
        any::<i32>().prop_map(|v| (5, v.to_le_bytes().to_vec())),
        proptest::sample::select(floats).prop_map(|v| (6, v.to_le_bytes().to_vec())),
        any::<f32>().prop_map(|v| (6, v.to_le_bytes().to_vec())),
        proptest::sample::select(EXTREMES).prop_map(|v| (10, v.to_le_bytes().to_vec())),
        any::<f64>().prop_map(|v| (12, v.to_le_bytes().to_vec())),
        any::<bool>().prop_map(|v| (7, vec![v as u8])),
        proptest::sample::select(vec!["linear", "yarn", ""]).prop_map(|v| {
            let mut b = (v.len() as u64).to_le_bytes().to_vec();
            b.extend(v.as_bytes());
            (8, b)
        }),
    ]
}

#[test]
fn fuzz_gguf_model_metadata_through_the_loader() {
    let dir = common::TempDir::new("fuzz-gguf-model");
    let path = dir.path().join("m.gguf");
    let strategy = proptest::collection::vec((proptest::sample::select(GGUF_KEYS), meta_value()), 1..3);
    let ids = rmlx::Array::from_slice(&[1i32, 5, 9, 2], &[1, 4]).unwrap();
    proptest::test_runner::TestRunner::new(config(500))
        .run(&strategy, |edits| {
            gguf_model::gguf_model(&path, |kv| {
                for (key, (ty, value)) in edits {
                    match kv.iter_mut().find(|e| e.0 == key) {
                        Some(e) => (e.1, e.2) = (ty, value),
                        None => kv.push((key.to_string(), ty, value)),
                    }
                }
            });
            match crate::loader::load(&path, &crate::LoadOptions::default()) {
                Ok(lm) => {
                    let mut caches = lm.model.new_caches(None);
                    let logits = lm.model.forward(&ids, &mut caches).unwrap();
                    let v = logits.astype(rmlx::Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
                    prop_assert!(v.iter().all(|x| x.is_finite()), "non-finite logits from {:?}", lm.model.config());
                    GGUF_MODEL_STATS.ok();
                }
                Err(Error::Config(_) | Error::ShapeMismatch { .. } | Error::MissingTensor(_)) => GGUF_MODEL_STATS.err(),
                Err(other) => prop_assert!(false, "unexpected error kind: {other:?}"),
            }
            Ok(())
        })
        .unwrap();
    GGUF_MODEL_STATS.report("GGUF model metadata through the loader");
}

// ---------------------------------------------------------------------------------------------
// Inputs that once failed, kept as regression tests.

/// `rope_theta: 1e-45` (a positive subnormal) was accepted and gave NaN logits: RoPE bases must be
/// at least 1. Found by `fuzz_config_floats_through_the_loader`.
#[test]
fn regression_subnormal_rope_theta() {
    let dir = common::fixture_with_tokenizer("llama_gqa");
    let mut c = base_config();
    c.insert("rope_theta".into(), json!(1e-45));
    std::fs::write(dir.path().join("config.json"), Value::Object(c).to_string()).unwrap();
    match crate::loader::load(dir.path(), &crate::LoadOptions::default()) {
        Err(Error::Config(m)) => assert!(m.contains("`rope_theta` must be at least 1"), "{m}"),
        Err(e) => panic!("expected Error::Config, got {e:?}"),
        Ok(_) => panic!("rope_theta 1e-45 accepted"),
    }
}

/// A linear RoPE factor of 1e-45 divides positions into infinity the same way.
#[test]
fn regression_subnormal_rope_factor() {
    let mut c = base_config();
    c.insert("rope_scaling".into(), json!({"rope_type": "linear", "factor": 1e-45}));
    match ModelConfig::from_value(Value::Object(c)) {
        Err(Error::Config(m)) => assert!(m.contains("`factor` must be at least 1"), "{m}"),
        other => panic!("expected Error::Config, got {other:?}"),
    }
}

/// A few bytes of header in a 2 GiB sparse file, declaring a u8 array of 2^30 elements: the file
/// could hold it, but no real array is that long. Refused before anything is reserved.
#[test]
fn sparse_gguf_with_a_huge_array() {
    let path = scratch_file("sparse.gguf").with_extension("gguf");
    let mut bytes = b"GGUF".to_vec();
    bytes.extend(3u32.to_le_bytes());
    bytes.extend(0u64.to_le_bytes());
    bytes.extend(1u64.to_le_bytes());
    bytes.extend(3u64.to_le_bytes());
    bytes.extend(b"big");
    bytes.extend(9u32.to_le_bytes());
    bytes.extend(0u32.to_le_bytes());
    bytes.extend((1u64 << 30).to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(1 << 31).unwrap();
    let (r, peak) = peak_allocation(|| GgufFile::open(&path));
    let _ = std::fs::remove_file(&path);
    match r {
        Err(Error::Corrupt { reason, .. }) => {
            assert!(reason.contains("`big`") && reason.contains("exceeds the limit of 4194304"), "{reason}")
        }
        other => panic!("expected Error::Corrupt, got {other:?}"),
    }
    assert!(peak < 1 << 20, "allocated {peak} bytes");
}

/// A safetensors header length of 2^40 in a sparse file larger than that is refused by the header
/// limit, without reading or reserving it.
#[test]
fn sparse_safetensors_with_a_huge_header() {
    let path = scratch_file("sparse.safetensors");
    std::fs::write(&path, (1u64 << 40).to_le_bytes()).unwrap();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len((1 << 40) + 64).unwrap();
    let (r, peak) = peak_allocation(|| safetensors_header::check_file(&path));
    let _ = std::fs::remove_file(&path);
    match r {
        Err(Error::Corrupt { reason, .. }) => assert!(reason.contains("exceeds the limit of 104857600"), "{reason}"),
        other => panic!("expected Error::Corrupt, got {other:?}"),
    }
    assert!(peak < 1 << 20, "allocated {peak} bytes");
}

/// A float64 tensor with consistent offsets passed the header check, and MLX then refused it
/// ("[safetensor] unsupported dtype F64"): the check now refuses the dtypes MLX cannot load.
/// Found by `fuzz_safetensors_header` (RMLX_FUZZ_SEED=99, shrunk to one tensor's dtype and shape).
#[test]
fn regression_f64_tensor_refused_before_mlx() {
    let header = json!({
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "F64", "shape": [1], "data_offsets": [24, 32]},
        "c": {"dtype": "I32", "shape": [1, 2, 1], "data_offsets": [32, 40]}
    })
    .to_string();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    bytes.extend([0u8; 40]);
    let path = scratch_file("f64.safetensors");
    std::fs::write(&path, &bytes).unwrap();
    let r = safetensors_header::check_file(&path);
    let _ = std::fs::remove_file(&path);
    match r {
        Err(Error::Config(m)) => assert!(m.contains("tensor `b` has dtype F64, which MLX cannot load"), "{m}"),
        other => panic!("expected Error::Config, got {other:?}"),
    }
}
