//! `rmlx_lm::convert` against mlx-lm's own conversions of the same fixture folders
//! (`fixtures/convert/reference.json`, written by `scripts/make_convert_references.py` with
//! mlx-lm 0.32.2): the same tensor names, dtypes, shapes and bytes (packed weights, scales and
//! biases by MLX's quantize), the same `config.json` (with mlx-lm's per-layer entries for mixed
//! recipes and routers) and index. Then what the converted folders are for: rmlx loads them
//! (sharded too, and from the default model's GGUF) and generates what the source generates.

mod common;

use common::{fixture_with_tokenizer, TempDir};
use rmlx::quantization::QuantMode;
use rmlx::Dtype;
use rmlx_lm::convert::{convert, ConvertOptions, QuantizeOptions};
use rmlx_lm::{GenerateOptions, LoadOptions, LoadedModel};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::Path;

fn references() -> Value {
    let p = common::fixture_dir("../convert").join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

/// `rmlx convert`'s flags (as the reference lists them) as options.
fn options(flags: &[&str]) -> ConvertOptions {
    let mut opts = ConvertOptions::default();
    let mut q = QuantizeOptions::default();
    let mut it = flags.iter();
    while let Some(&flag) = it.next() {
        let mut value = || *it.next().unwrap();
        match flag {
            "-q" => opts.quantize = Some(QuantizeOptions::default()),
            "-d" => opts.dequantize = true,
            "--q-bits" => q.bits = Some(value().parse().unwrap()),
            "--q-group-size" => q.group_size = Some(value().parse().unwrap()),
            "--q-mode" => {
                q.mode = match value() {
                    "mxfp4" => QuantMode::Mxfp4,
                    "nvfp4" => QuantMode::Nvfp4,
                    "mxfp8" => QuantMode::Mxfp8,
                    other => panic!("{other}"),
                }
            }
            "--quant-predicate" => q.recipe = Some(value().parse().unwrap()),
            "--dtype" => {
                opts.dtype = Some(match value() {
                    "bfloat16" => Dtype::Bfloat16,
                    "float16" => Dtype::Float16,
                    other => panic!("{other}"),
                })
            }
            other => panic!("unknown flag {other}"),
        }
    }
    if opts.quantize.is_some() {
        opts.quantize = Some(q);
    }
    opts
}

/// Every tensor of a safetensors file (dtype, shape, sha256 of its bytes) and its metadata.
fn tensors_of(path: &Path) -> (BTreeMap<String, Value>, Value) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let metadata = header.remove("__metadata__").unwrap_or(Value::Null);
    let data = &bytes[8 + n..];
    let tensors = header
        .into_iter()
        .map(|(name, t)| {
            let (a, b) =
                (t["data_offsets"][0].as_u64().unwrap() as usize, t["data_offsets"][1].as_u64().unwrap() as usize);
            let sha = Sha256::digest(&data[a..b]).iter().map(|b| format!("{b:02x}")).collect::<String>();
            (name, serde_json::json!({"dtype": t["dtype"], "shape": t["shape"], "sha256": sha}))
        })
        .collect();
    (tensors, metadata)
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Converts the fixture `fixture` (with a word-level tokenizer) with `flags` into a new folder.
fn converted(fixture: &str, flags: &[&str]) -> (TempDir, TempDir) {
    let src = fixture_with_tokenizer(fixture);
    let out = TempDir::new("converted");
    let dst = out.path().join("model");
    convert(src.path(), &dst, &options(flags)).unwrap_or_else(|e| panic!("{fixture} {flags:?}: {e}"));
    (src, out)
}

#[test]
fn conversions_write_what_mlx_lm_writes() {
    let refs = references();
    let cases = refs["cases"].as_object().unwrap();
    assert_eq!(cases.len(), 16);
    for (case, want) in cases {
        let flags: Vec<&str> = want["flags"].as_array().unwrap().iter().map(|f| f.as_str().unwrap()).collect();
        let (_src, out) = converted(want["fixture"].as_str().unwrap(), &flags);
        let dir = out.path().join("model");
        assert_eq!(read_json(&dir.join("config.json")), want["config"], "{case}: config.json");
        assert_eq!(read_json(&dir.join("model.safetensors.index.json")), want["index"], "{case}: index");
        let files: Vec<String> = want["files"].as_object().unwrap().keys().cloned().collect();
        for (name, file) in want["files"].as_object().unwrap() {
            let (tensors, metadata) = tensors_of(&dir.join(name));
            assert_eq!(metadata, file["metadata"], "{case}: {name} metadata");
            let expected = file["tensors"].as_object().unwrap();
            assert_eq!(tensors.keys().collect::<Vec<_>>(), expected.keys().collect::<Vec<_>>(), "{case}: names");
            for (t, v) in &tensors {
                assert_eq!(v, &expected[t], "{case}: tensor {t}");
            }
        }
        let mut written: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".safetensors"))
            .collect();
        written.sort();
        assert_eq!(written, files, "{case}");
        // The tokenizer and generation config come along; nothing half-written is left.
        assert!(dir.join("tokenizer.json").is_file(), "{case}");
        assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 1, "{case}");
    }
}

fn load(dir: &Path) -> LoadedModel {
    let opts = LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() };
    rmlx_lm::loader::load(dir, &opts).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

fn logits(lm: &LoadedModel, prompt: &[u32]) -> Vec<f32> {
    let ids = rmlx::Array::from_slice(prompt, &[1, prompt.len() as i32]).unwrap();
    let out = lm.model.forward(&ids, &mut lm.model.new_caches(None)).unwrap();
    out.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
}

fn greedy(lm: &LoadedModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let opts = GenerateOptions { max_tokens: n, ignore_eos: true, ..GenerateOptions::default() };
    lm.generate(prompt, &opts).unwrap().map(|t| t.unwrap().id).collect()
}

#[test]
fn converted_folders_load_and_generate_as_their_source() {
    let prompt: Vec<u32> = (1..9).collect();
    // 8 bits keeps the source's logits close (within 5 % of the largest: qwen3's bfloat16 scales
    // round each group's scale to 8 bits, 3 % measured; a misread layer is off by the whole
    // range); the dequantised folder is the quantised one unpacked, token for token.
    for (fixture, flags) in [("qwen3", &["-q", "--q-bits", "8"][..]), ("qwen3_moe", &["-q", "--q-bits", "8"])] {
        let (src, out) = converted(fixture, flags);
        let (source, q8) = (load(src.path()), load(&out.path().join("model")));
        let (a, b) = (logits(&source, &prompt), logits(&q8, &prompt));
        let range = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(d < 0.05 * range, "{fixture}: 8-bit logits {d} from the source's (largest {range})");
    }
    // In an mxfp4 model the routers mlx-lm keeps at 8 bits are affine (their entries name no
    // mode): the folder loads, and its logits are finite.
    let (_src, out) = converted("qwen3_moe", &["-q", "--q-mode", "mxfp4"]);
    let mx = load(&out.path().join("model"));
    assert!(logits(&mx, &prompt).iter().all(|x| x.is_finite()));
    let (src, out) = converted("llama_gqa_q4", &["-d"]);
    let (q4, dense) = (load(src.path()), load(&out.path().join("model")));
    assert_eq!(greedy(&dense, &prompt, 8), greedy(&q4, &prompt, 8));
}

#[test]
fn large_models_are_written_in_shards_with_an_index() {
    let src = fixture_with_tokenizer("qwen3");
    let out = TempDir::new("sharded");
    let dst = out.path().join("model");
    let opts = ConvertOptions { max_shard_bytes: 60_000, ..ConvertOptions::default() };
    let done = convert(src.path(), &dst, &opts).unwrap();
    assert!(done.files.len() > 2, "{:?}", done.files);
    let n = done.files.len();
    for (i, f) in done.files.iter().enumerate() {
        assert_eq!(f, &format!("model-{:05}-of-{n:05}.safetensors", i + 1));
        assert!(std::fs::metadata(dst.join(f)).unwrap().len() < 60_000 + 4096, "{f}");
    }
    let index = read_json(&dst.join("model.safetensors.index.json"));
    let map = index["weight_map"].as_object().unwrap();
    assert_eq!(map.len(), done.tensors);
    assert_eq!(index["metadata"]["total_size"].as_u64(), Some(done.bytes));
    for (tensor, file) in map {
        let (tensors, _) = tensors_of(&dst.join(file.as_str().unwrap()));
        assert!(tensors.contains_key(tensor), "{tensor} in {file}");
    }
    let prompt: Vec<u32> = (1..9).collect();
    assert_eq!(greedy(&load(&dst), &prompt, 8), greedy(&load(src.path()), &prompt, 8));
}

#[test]
fn the_default_models_gguf_converts_to_a_folder_that_generates_the_same() {
    let gguf = rmlx_lm::registry::default_model().unwrap();
    let out = TempDir::new("from-gguf");
    let dst = out.path().join("smollm2");
    let done = convert(&gguf, &dst, &ConvertOptions::default()).unwrap();
    // Q4_1 stays 4-bit affine in groups of 32, bit for bit (llama.cpp's blocks repacked).
    let config = read_json(&dst.join("config.json"));
    assert_eq!(config["quantization"]["bits"], 4);
    assert_eq!(config["quantization"]["group_size"], 32);
    assert_eq!(done.quantized_layers, 30 * 7 + 1, "every block's linears and the embedding");
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        assert!(dst.join(f).is_file(), "{f}");
    }
    let (from_gguf, from_folder) = (load(&gguf), load(&dst));
    let prompt = from_gguf.tokenizer.encode("The capital of France is", false).unwrap();
    assert_eq!(from_folder.tokenizer.encode("The capital of France is", false).unwrap(), prompt);
    assert_eq!(greedy(&from_folder, &prompt, 12), greedy(&from_gguf, &prompt, 12));
    assert_eq!(from_folder.chat_template.source(), from_gguf.chat_template.source());
}

#[test]
fn bad_conversions_are_refused_naming_the_problem() {
    let src = fixture_with_tokenizer("qwen3");
    let out = TempDir::new("refused");
    let q = |q: QuantizeOptions| ConvertOptions { quantize: Some(q), ..ConvertOptions::default() };
    let err = |opts: &ConvertOptions, from: &Path| convert(from, &out.path().join("m"), opts).unwrap_err().to_string();
    let both = ConvertOptions { dequantize: true, ..q(QuantizeOptions::default()) };
    assert_eq!(err(&both, src.path()), "invalid parameter: choose either quantize or dequantize, not both");
    let e = err(&q(QuantizeOptions { mode: QuantMode::Mxfp4, bits: Some(8), ..Default::default() }), src.path());
    assert!(e.contains("mxfp4") && e.contains("8"), "{e}");
    let e = err(&q(QuantizeOptions { bits: Some(7), ..Default::default() }), src.path());
    assert!(e.contains("bits 7 is not supported"), "{e}");
    let recipe =
        QuantizeOptions { mode: QuantMode::Nvfp4, recipe: Some("mixed_3_6".parse().unwrap()), ..Default::default() };
    assert!(err(&q(recipe), src.path()).contains("mixed quantisation recipes are affine only"));
    assert!("mixed_5_7".parse::<rmlx_lm::convert::MixedRecipe>().is_err());
    let quantized = fixture_with_tokenizer("qwen3_q4");
    let e = err(&q(QuantizeOptions::default()), quantized.path());
    assert!(e.contains("is quantised already") && e.contains("(-d)"), "{e}");
    let e = err(&ConvertOptions::default(), &out.path().join("nowhere"));
    assert!(e.contains("neither a model folder nor a GGUF file"), "{e}");
    let gpt_oss = fixture_with_tokenizer("gpt_oss");
    let e = err(&ConvertOptions::default(), gpt_oss.path());
    assert!(e.contains("fused experts"), "{e}");
    // An existing destination is left alone.
    std::fs::create_dir_all(out.path().join("m")).unwrap();
    let e = err(&ConvertOptions::default(), src.path());
    assert!(e.contains("exists already"), "{e}");
    assert_eq!(std::fs::read_dir(out.path()).unwrap().count(), 1);
}
