//! Models driven from several threads at once: each thread loads its own copy of a fixture and
//! runs forward passes; every result must equal transformers' greedy continuation and the logits
//! the same pass gives on one thread. On the GPU this is the stress test for rmlx's thread-safety
//! promise (MLX's CUDA backend used to terminate the process when two threads drove it); on the
//! CPU it checks that threads taking turns inside MLX see no one else's state.

mod common;

use common::{fixture_with_tokenizer, ids, ids_array, reference};
use rmlx::Dtype;
use rmlx_lm::{LoadOptions, LoadedModel};
use std::sync::Arc;
use std::thread;

const THREADS: usize = 8;
/// Forward passes per thread (`RMLX_STRESS_PASSES` overrides, for longer soak runs).
const PASSES: usize = 100;

/// Last-position logits of `prompt` in one forward pass, as float32.
fn last_logits(lm: &LoadedModel, prompt: &[u32]) -> Vec<f32> {
    let mut caches = lm.model.new_caches(None);
    let logits = lm.model.forward(&ids_array(prompt), &mut caches).unwrap();
    let n = logits.shape()[1];
    logits.slice_axis(1, n - 1, n, 1).unwrap().astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().fold((0, f32::MIN), |best, (i, &x)| if x > best.1 { (i, x) } else { best }).0 as u32
}

#[test]
fn eight_threads_run_forward_passes_of_their_own_models() {
    let passes = std::env::var("RMLX_STRESS_PASSES").ok().and_then(|v| v.parse().ok()).unwrap_or(PASSES);
    let name = "qwen3";
    let r = reference(name);
    let dir = Arc::new(fixture_with_tokenizer(name));
    let prompt = ids(&r["prompt_ids"]);
    let greedy = ids(&r["greedy"]);
    let opts = LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() };

    // Each pass p of a thread feeds the prompt plus the first (p % 4) greedy tokens, so the next
    // token is known from transformers: greedy[p % 4].
    let lm = rmlx_lm::loader::load(dir.0.as_path(), &opts).unwrap();
    let inputs: Vec<Vec<u32>> = (0..4).map(|k| prompt.iter().chain(&greedy[..k]).copied().collect()).collect();
    let single: Vec<Vec<f32>> = inputs.iter().map(|x| last_logits(&lm, x)).collect();
    for (k, logits) in single.iter().enumerate() {
        assert_eq!(argmax(logits), greedy[k], "single thread, {k} greedy tokens appended");
    }
    drop(lm);
    let single = Arc::new(single);
    let inputs = Arc::new(inputs);

    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (dir, single, inputs, greedy, opts) =
                (dir.clone(), single.clone(), inputs.clone(), greedy.clone(), opts.clone());
            thread::spawn(move || {
                let lm = rmlx_lm::loader::load(dir.0.as_path(), &opts).unwrap();
                for p in 0..passes {
                    let k = (p + t) % 4;
                    let logits = last_logits(&lm, &inputs[k]);
                    assert_eq!(argmax(&logits), greedy[k], "thread {t} pass {p}");
                    let d = logits.iter().zip(&single[k]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                    assert!(d <= 1e-4, "thread {t} pass {p}: logits differ from the single-thread run by {d}");
                }
                passes
            })
        })
        .collect();
    let done: usize = handles.into_iter().map(|h| h.join().expect("a thread panicked")).sum();
    assert_eq!(done, THREADS * passes);
}
