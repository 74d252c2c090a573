//! Greedy sampling in one launch (`nn::cuda_sample`) against MLX's composition (`argmax` of the
//! log-probabilities, `logits − logsumexp`, `isfinite(…).all()`): the same token, the
//! log-probability within float32 rounding, the same finiteness; vocabularies of one block's
//! stretch, of many, and of more than one pass of the grid; equal maxima (the first wins); a NaN
//! or an infinity anywhere. Where MLX has no CUDA backend the launch must decline.

use crate::nn::cuda_sample::greedy;
use rmlx::fast::{self, GpuBackend};
use rmlx::{ops, random, Array, Device, Dtype};

fn logits(vocab: i32, seed: u64) -> Vec<f32> {
    let a = random::normal(&[vocab], Dtype::Float32, 0.0, 3.0, Some(&random::key(seed).unwrap())).unwrap();
    a.to_vec_f32().unwrap()
}

/// MLX's composed step: (token, log-probability, all finite).
fn composed(x: &Array) -> (u32, f32, bool) {
    let x = x.reshape(&[1, -1]).unwrap();
    let finite = ops::isfinite(&x).unwrap().all(rmlx::Axes::All, false).unwrap().item::<bool>().unwrap();
    let f = x.astype(Dtype::Float32).unwrap();
    let logprobs = (&f - f.logsumexp(-1, true).unwrap()).unwrap();
    let token = logprobs.argmax(Some(-1), false).unwrap().astype(Dtype::Uint32).unwrap();
    let id = token.to_vec::<u32>().unwrap()[0];
    let lp = logprobs.to_vec_f32().unwrap()[id as usize];
    (id, lp, finite)
}

#[test]
fn greedy_launch_matches_the_composed_step() {
    let cuda = fast::gpu_backend() == Some(GpuBackend::Cuda);
    let device = if cuda { Device::gpu() } else { Device::cpu() };
    rmlx::with_device(device, || {
        let mut checked = 0;
        for (vocab, dtype) in [
            (7, Dtype::Float32),
            (49_152, Dtype::Bfloat16),
            (151_936, Dtype::Bfloat16),
            (151_936, Dtype::Float16),
            (262_208, Dtype::Float32),
            (1_200_001, Dtype::Float32),
        ] {
            for case in ["random", "tie", "nan", "inf"] {
                let mut v = logits(vocab, vocab as u64);
                let top = v.iter().cloned().fold(f32::MIN, f32::max) + 1.0;
                match case {
                    // Two equal maxima: the first is the token.
                    "tie" => {
                        v[vocab as usize / 3] = top;
                        v[vocab as usize - 1] = top;
                    }
                    "nan" => v[vocab as usize / 2] = f32::NAN,
                    "inf" => v[0] = f32::NEG_INFINITY,
                    _ => {}
                }
                let what = format!("{vocab} logits, {dtype:?}, {case}");
                let x = Array::from_slice(&v, &[1, vocab]).unwrap().astype(dtype).unwrap();
                let Some([token, logprob, finite]) = greedy(&x).unwrap() else {
                    assert!(!cuda, "{what}: declined on MLX's CUDA backend");
                    continue;
                };
                assert!(cuda, "{what}: served without MLX's CUDA backend");
                assert_eq!((token.shape(), token.dtype()), (&[1][..], Dtype::Uint32), "{what}");
                assert_eq!((finite.shape(), finite.dtype()), (&[][..], Dtype::Bool), "{what}");
                let (want_token, want_logprob, want_finite) = composed(&x);
                let finite = finite.item::<bool>().unwrap();
                assert_eq!(finite, want_finite, "{what}: finiteness");
                if !finite {
                    checked += 1;
                    continue;
                }
                let token = token.to_vec::<u32>().unwrap()[0];
                assert_eq!(token, want_token, "{what}: token");
                if case == "tie" {
                    assert_eq!(token, vocab as u32 / 3, "{what}: the first of equal maxima");
                }
                let logprob = logprob.to_vec_f32().unwrap()[0];
                // Both sum ~10⁵–10⁶ exponentials in float32, in different orders.
                let tolerance = 3e-5 * (1.0 + want_logprob.abs());
                assert!(
                    (logprob - want_logprob).abs() <= tolerance,
                    "{what}: log-probability {logprob} against {want_logprob}"
                );
                checked += 1;
            }
        }
        assert_eq!(checked, if cuda { 24 } else { 0 });
        // Two rows are not one sequence's logits.
        let two = Array::from_slice(&[0.0f32; 8], &[2, 4]).unwrap();
        assert!(greedy(&two).unwrap().is_none());
    });
}
