//! A decoding step's layers replayed as one captured launch (`nn::cuda_step`) against the same
//! steps built as they are: on MLX's CUDA backend, the fixture models of the Llama family and
//! Gemma 3 (dense and 4-bit, float32 and bfloat16, heads of 32) decode 300 positions past their
//! prompt, across the caches' growth and the sliding windows' wrapping, with every position's hidden states (the layers' output) equal bit for bit
//! and the replay's graph holding no launch of a layer. Off MLX's CUDA backend (the CPU CI) the
//! capture never serves, and the steps are the layers' own.

use super::common::{fixture_with_tokenizer, ids, reference};
use crate::nn::StepCapture;
use crate::{LoadOptions, LoadedModel};
use rmlx::fast::{self, GpuBackend};
use rmlx::{Array, Device, Dtype};

fn cuda() -> bool {
    fast::gpu_backend() == Some(GpuBackend::Cuda)
}

/// Operations of the layers' launches that a replayed step's graph must not hold.
const LAYER_LAUNCHES: [&str; 2] = ["rmlx_decode_attention", "rmlx_fused_matvec"];

/// The fixture in `dir` loaded in `dtype` twice: its steps built as they are, and captured.
fn built_and_replayed(dir: &std::path::Path, dtype: Dtype) -> (LoadedModel, LoadedModel) {
    let load = |step_capture| {
        let opts = LoadOptions { dtype: Some(dtype), dequantize: Some(false), step_capture, ..LoadOptions::default() };
        crate::loader::load(dir, &opts).unwrap()
    };
    (load(StepCapture::Off), load(StepCapture::On))
}

/// The ids `[1, L]` of one sequence.
fn row(ids: &[u32]) -> Array {
    Array::from_slice(&ids.iter().map(|&t| t as i32).collect::<Vec<_>>(), &[1, ids.len() as i32]).unwrap()
}

/// Whether `out`'s graph is a replay (the captured launch), which then holds none of the layers'
/// launches.
fn replays_in(out: &Array, what: &str) -> bool {
    let census = rmlx::graph_census([out]).unwrap();
    let replayed = census.contains_key("rmlx_decode_step");
    if replayed {
        for launch in LAYER_LAUNCHES {
            assert!(!census.contains_key(launch), "{what}: {census:?}");
        }
    }
    replayed
}

#[test]
fn replayed_steps_equal_the_built_ones_bit_for_bit() {
    if !cuda() {
        return;
    }
    rmlx::with_device(Device::gpu(), || {
        // Heads of 16 (llama_gqa, qwen2) are below the attention kernel's 32: their steps are the
        // layers' own graphs, which the capture does not take.
        // Gemma 3's sliding layers (a window of 8) take their rotating caches' ring slots.
        let fixtures = [
            ("llama_mqa_untied", true),
            ("qwen3", true),
            ("qwen3_q4", true),
            ("gemma3_text", true),
            ("llama_gqa", false),
            ("qwen2", false),
        ];
        for (name, captured) in fixtures {
            let dir = fixture_with_tokenizer(name);
            let prompt = ids(&reference(name)["prompt_ids"]);
            for dtype in [Dtype::Float32, Dtype::Bfloat16] {
                let what = format!("{name}, {dtype:?}");
                let (built, replayed) = built_and_replayed(dir.path(), dtype);
                let (mut built_caches, mut replayed_caches) =
                    (built.model.new_caches(None), replayed.model.new_caches(None));
                let x = row(&prompt);
                // The layers' outputs are compared (the head may take a product whose sums are not
                // in a fixed order); the tokens are the built model's greedy ones.
                let mut a = built.model.forward_hidden(&x, &mut built_caches).unwrap();
                let mut b = replayed.model.forward_hidden(&x, &mut replayed_caches).unwrap();
                let mut replays = 0;
                for position in 0..300 {
                    let (got, want) = (b.astype(Dtype::Float32).unwrap(), a.astype(Dtype::Float32).unwrap());
                    let (got, want) = (got.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
                    assert!(got == want, "{what}: hidden states differ at decoding position {position}");
                    let last = a.slice_axis(1, a.shape()[1] - 1, a.shape()[1], 1).unwrap();
                    let logits = built.model.logits(&last).unwrap().astype(Dtype::Float32).unwrap();
                    let logits = logits.to_vec::<f32>().unwrap();
                    let token =
                        logits.iter().enumerate().max_by(|p, q| p.1.total_cmp(q.1)).map(|(i, _)| i as i32).unwrap();
                    let x = Array::from_slice(&[token], &[1, 1]).unwrap();
                    a = built.model.forward_hidden(&x, &mut built_caches).unwrap();
                    b = replayed.model.forward_hidden(&x, &mut replayed_caches).unwrap();
                    replays += usize::from(replays_in(&b, &what));
                }
                match captured {
                    true => assert!(replays >= 300 - 6, "{what}: {replays} of 300 steps replayed"),
                    false => assert_eq!(replays, 0, "{what}"),
                }
            }
        }
    })
}

/// Verification passes (2 to 8 positions of one sequence, then some taken back as rejected
/// drafts are) replayed as captured launches equal the same passes built as they are, bit for
/// bit: the Llama family's fixtures, dense and 4-bit, in float32 and bfloat16, over 300
/// positions; every pass of several positions replayed but those that found no capture for their
/// length and the caches' capacity. Gemma 3's rotating caches take one position at a time: its
/// passes are built, and equal too.
#[test]
fn replayed_verification_passes_equal_the_built_ones() {
    if !cuda() {
        return;
    }
    rmlx::with_device(Device::gpu(), || {
        let fixtures = [("llama_mqa_untied", true), ("qwen3", true), ("qwen3_q4", true), ("gemma3_text", false)];
        for (name, captured) in fixtures {
            let dir = fixture_with_tokenizer(name);
            let prompt = ids(&reference(name)["prompt_ids"]);
            for dtype in [Dtype::Float32, Dtype::Bfloat16] {
                let what = format!("{name}, {dtype:?}");
                let (built, replayed) = built_and_replayed(dir.path(), dtype);
                let (mut built_caches, mut replayed_caches) =
                    (built.model.new_caches(None), replayed.model.new_caches(None));
                let x = row(&prompt);
                built.model.forward_hidden(&x, &mut built_caches).unwrap();
                replayed.model.forward_hidden(&x, &mut replayed_caches).unwrap();
                let (mut passes, mut replays, mut written) = (0, 0, prompt.len());
                let lengths: [usize; 7] = [3, 8, 2, 5, 4, 7, 6];
                for (n, &len) in lengths.iter().cycle().enumerate() {
                    if written >= prompt.len() + 300 {
                        break;
                    }
                    let tokens: Vec<i32> = (0..len).map(|i| ((n * 37 + i * 11) % 40 + 3) as i32).collect();
                    let x = Array::from_slice(&tokens, &[1, len as i32]).unwrap();
                    let a = built.model.forward_hidden(&x, &mut built_caches).unwrap();
                    let b = replayed.model.forward_hidden(&x, &mut replayed_caches).unwrap();
                    let replayed_pass = replays_in(&b, &what);
                    let (got, want) = (b.astype(Dtype::Float32).unwrap(), a.astype(Dtype::Float32).unwrap());
                    let (got, want) = (got.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
                    assert!(got == want, "{what}: hidden states differ in a pass of {len} at {written}");
                    passes += 1;
                    replays += usize::from(replayed_pass);
                    // Drafts rejected: all but the first `n % len + 1` positions taken back (where
                    // every cache can take them back: not a window past its length).
                    let trimmable = built_caches.iter().all(|c| c.trimmable_after(0));
                    let rejected = if trimmable { len - (n % len + 1) } else { 0 };
                    for cache in built_caches.iter_mut().chain(replayed_caches.iter_mut()) {
                        assert!(rejected == 0 || cache.trim(rejected), "{what}");
                    }
                    written += len - rejected;
                }
                // A pass finds no capture the first time its length meets the caches' capacity.
                match captured {
                    true => assert!(replays + 3 * lengths.len() >= passes, "{what}: {replays} of {passes} replayed"),
                    false => assert_eq!(replays, 0, "{what}"),
                }
            }
        }
    })
}
