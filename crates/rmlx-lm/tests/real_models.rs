//! The real checkpoints registry packages ship — the default model (SmolLM2-135M-Instruct, GGUF
//! Q4_1) and Gemma 3 270M (GGUF Q4_K_M) — against transformers in float32 on the same dequantised
//! weights (`tests/fixtures/reference/*.json`, written by `scripts/make_fixtures.py --real`):
//! prompt token ids (raw and chat-templated), the last prompt position's top-20 logits, and 16
//! greedy tokens with their streamed text. The files are fetched once into the per-user cache.

use rmlx::Dtype;
use rmlx_lm::chat::Message;
use rmlx_lm::{GenerateOptions, LoadOptions, LoadedModel};
use serde_json::Value;
use std::path::Path;

fn reference(name: &str) -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/reference").join(format!("{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn check(lm: &LoadedModel, r: &Value) {
    for p in r["prompts"].as_array().unwrap() {
        let prompt = match p["kind"].as_str().unwrap() {
            "raw" => lm.tokenizer.encode(p["prompt_text"].as_str().unwrap(), true).unwrap(),
            _ => {
                let messages: Vec<Message> = serde_json::from_value(p["messages"].clone()).unwrap();
                assert_eq!(
                    lm.chat_template.render(&messages, true, None, None).unwrap(),
                    p["prompt_text"].as_str().unwrap()
                );
                lm.chat_prompt(&messages).unwrap()
            }
        };
        let what = p["prompt_text"].as_str().unwrap();
        assert_eq!(prompt, ids(&p["prompt_ids"]), "prompt ids of {what:?}");

        // Top-20 logits of the last prompt position.
        let mut caches = lm.model.new_caches(None);
        let input =
            rmlx::Array::from_slice(&prompt.iter().map(|&t| t as i32).collect::<Vec<_>>(), &[1, prompt.len() as i32])
                .unwrap();
        let logits =
            lm.model.forward(&input, &mut caches).unwrap().astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
        let vocab = logits.len() / prompt.len();
        let last = &logits[logits.len() - vocab..];
        let mut worst = 0.0f32;
        for pair in p["last_logits_top20"].as_array().unwrap() {
            let (id, v) = (pair[0].as_u64().unwrap() as usize, pair[1].as_f64().unwrap() as f32);
            worst = worst.max((last[id] - v).abs());
        }
        assert!(worst < 2e-3, "{what:?}: top-20 logits differ by up to {worst}");

        let opts = GenerateOptions { max_tokens: 16, ignore_eos: true, ..GenerateOptions::default() };
        let tokens: Vec<_> = lm.generate(&prompt, &opts).unwrap().map(Result::unwrap).collect();
        let got: Vec<u32> = tokens.iter().map(|t| t.id).collect();
        assert_eq!(got, ids(&p["greedy_ids"]), "greedy ids after {what:?}");
        let text: String = tokens.iter().map(|t| t.text.as_str()).collect();
        assert_eq!(text, p["greedy_text"].as_str().unwrap(), "greedy text after {what:?}");
        assert!(tokens.iter().all(|t| t.logprob <= 0.0 && t.logprob.is_finite()));
    }
}

fn load(path: &Path) -> LoadedModel {
    rmlx_lm::loader::load(path, &LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() }).unwrap()
}

#[test]
fn default_model_smollm2_matches_transformers() {
    let lm = load(&rmlx_lm::registry::default_model().unwrap());
    assert_eq!(lm.model.config().model_type, "llama");
    assert_eq!(lm.eos_ids, vec![2], "<|im_end|>");
    check(&lm, &reference("smollm2"));
}

#[test]
fn gemma3_270m_gguf_matches_transformers() {
    let lm = load(&rmlx_lm::registry::gemma3_270m().unwrap());
    let cfg = lm.model.config();
    assert_eq!((cfg.model_type.as_str(), cfg.num_hidden_layers, cfg.sliding_window), ("gemma3_text", 18, Some(512)));
    assert!(lm.eos_ids.contains(&1) && lm.eos_ids.contains(&106), "<eos> and <end_of_turn>: {:?}", lm.eos_ids);
    check(&lm, &reference("gemma3_270m"));
}
