//! rmlx's CUDA quantised matrix-vector product (`nn::cuda_qmv`) against the product with the
//! weights dequantised, computed in float32 on the CPU, and against MLX's own `quantized_matmul` on
//! the GPU: 4 and 8 bits, groups of 32, 64 and 128, float32, bfloat16 and float16, 1 to 8 rows
//! (leading axes flattened), input sizes that leave a partial step (1,152) and output counts that
//! leave a partial warp or block. And what it leaves to MLX: 9 rows, 3 bits, no biases, scales of
//! another type, training, traced transforms, and everything off MLX's CUDA backend (the CPU CI).

use crate::nn::cuda_qmv::{matvec_kernel, MAX_ROWS};
use crate::nn::with_training;
use rmlx::fast::{self, GpuBackend};
use rmlx::quantization::{dequantize, quantize, quantized_matmul, QuantMode, Quantized};
use rmlx::{random, Array, Device, Dtype};

fn cuda() -> bool {
    fast::gpu_backend() == Some(GpuBackend::Cuda)
}

fn normal(shape: &[i32], std: f32, seed: u64) -> Array {
    random::normal(shape, Dtype::Float32, 0.0, std, Some(&random::key(seed).unwrap())).unwrap()
}

fn values(a: &Array) -> Vec<f32> {
    a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
}

/// `q` with its scales and biases in `dtype`.
fn cast(q: &Quantized, dtype: Dtype) -> Quantized {
    Quantized {
        scales: q.scales.astype(dtype).unwrap(),
        biases: q.biases.as_ref().map(|b| b.astype(dtype).unwrap()),
        ..q.clone()
    }
}

/// `x Wᵀ` with `W` dequantised, in float32 on the CPU (no TF32).
fn reference(x: &Array, q: &Quantized) -> Vec<f32> {
    rmlx::with_device(Device::cpu(), || {
        let w = dequantize(q, Some(Dtype::Float32)).unwrap();
        values(&x.astype(Dtype::Float32).unwrap().matmul(&w.transpose().unwrap()).unwrap())
    })
}

/// The largest difference over the largest magnitude of `want`.
fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let err = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(scale > 0.0 && err.is_finite(), "error {err}, scale {scale}");
    err / scale
}

#[test]
fn matches_the_dequantised_product_and_mlx() {
    if !cuda() {
        return;
    }
    let (f32_, bf16, f16) = (Dtype::Float32, Dtype::Bfloat16, Dtype::Float16);
    // (x's shape, output features, bits, group, dtype): every bit width, group and dtype, 1 to 8
    // rows, a partial step (1,152 inputs), partial warps and blocks (37, 70, 5, 1 outputs).
    let cases: &[(&[i32], i32, i32, i32, Dtype)] = &[
        (&[1, 4096], 96, 4, 64, bf16),
        (&[1, 4096], 96, 4, 64, f32_),
        (&[1, 4096], 96, 4, 64, f16),
        (&[1, 1152], 37, 4, 32, bf16),
        (&[1, 1152], 37, 8, 128, f32_),
        (&[3, 256], 70, 4, 128, f16),
        (&[3, 256], 70, 8, 32, bf16),
        (&[2, 1, 2048], 64, 8, 64, f16),
        (&[2, 1, 2048], 64, 4, 32, f32_),
        (&[8, 128], 5, 4, 64, bf16),
        (&[8, 128], 5, 8, 64, f32_),
        (&[1, 1, 512], 1, 8, 128, bf16),
    ];
    rmlx::with_device(Device::gpu(), || {
        for (i, &(xshape, n, bits, group, dtype)) in cases.iter().enumerate() {
            let k = *xshape.last().unwrap();
            let x = normal(xshape, 1.0, 100 + i as u64).astype(dtype).unwrap();
            let q = quantize(&normal(&[n, k], 0.05, 200 + i as u64), group, bits, QuantMode::Affine).unwrap();
            let q = cast(&q, dtype);
            let what = format!("x {xshape:?}, n {n}, {bits} bits, group {group}, {dtype:?}");
            let got = matvec_kernel(&x, &q).unwrap().unwrap_or_else(|| panic!("{what}: declined"));
            let mut want_shape = xshape.to_vec();
            *want_shape.last_mut().unwrap() = n;
            assert_eq!((got.shape(), got.dtype()), (&want_shape[..], dtype), "{what}");
            let got = values(&got);
            // Float32 sums in another order; the half types round the output once.
            let tol = match dtype {
                Dtype::Float32 => 1e-5,
                Dtype::Bfloat16 => 1e-2,
                _ => 2e-3,
            };
            let err = relative_error(&got, &reference(&x, &q));
            assert!(err <= tol, "{what}: {err} from the dequantised product");
            let err = relative_error(&got, &values(&quantized_matmul(&x, &q, true).unwrap()));
            assert!(err <= tol, "{what}: {err} from MLX's quantized_matmul");
        }
    })
}

#[test]
fn leaves_the_rest_to_mlx() {
    let device = if cuda() { Device::gpu() } else { rmlx::default_device() };
    rmlx::with_device(device, || {
        let w = normal(&[16, 256], 0.05, 1);
        let q4 = quantize(&w, 64, 4, QuantMode::Affine).unwrap();
        let x = normal(&[1, 256], 1.0, 2);
        let served = matvec_kernel(&x, &q4).unwrap();
        assert_eq!(served.is_some(), cuda(), "served only on MLX's CUDA backend");
        let declines = |x: &Array, q: &Quantized, what: &str| {
            assert!(matvec_kernel(x, q).unwrap().is_none(), "{what}");
        };
        declines(&normal(&[MAX_ROWS + 1, 256], 1.0, 3), &q4, "9 rows");
        declines(&x, &quantize(&w, 64, 3, QuantMode::Affine).unwrap(), "3 bits");
        declines(&x, &Quantized { biases: None, ..q4.clone() }, "no biases");
        declines(&x, &cast(&q4, Dtype::Bfloat16), "scales of another type");
        declines(&x.astype(Dtype::Int32).unwrap(), &q4, "integer input");
        with_training(|| declines(&x, &q4, "training"));
        let traced = rmlx::transforms::grad(
            |a: &[Array]| {
                assert!(matvec_kernel(&a[0], &q4).unwrap().is_none(), "a traced input");
                a[0].sum(rmlx::Axes::All, false)
            },
            &[0],
        );
        traced(std::slice::from_ref(&x)).unwrap();
    })
}

/// Quantised fixtures (4-bit layers, an 8-bit tied embedding and down projection) decoded one
/// token at a time in float32 with every quantised product on rmlx's kernel: the step's graph
/// has no MLX quantised product left, and each position's logits and the greedy tokens are
/// transformers' (computed from the dequantised weights), as with MLX's product.
#[test]
fn quantised_models_decode_through_the_kernel() {
    use super::common::{fixture_with_tokenizer, floats, ids, reference, tf32};
    use crate::nn::QuantizedMatvec;
    use crate::{GenerateOptions, LoadOptions};
    if !cuda() {
        return;
    }
    rmlx::with_device(Device::gpu(), || {
        for name in ["llama_gqa_q4", "qwen3_q4"] {
            let dir = fixture_with_tokenizer(name);
            let r = reference(name);
            let prompt = ids(&r["prompt_ids"]);
            let tolerance = r["tolerance"][if tf32() { "float32_tf32" } else { "float32" }].as_f64().unwrap() as f32;
            let vocab = r["logits"][0].as_array().unwrap().len();
            let want = floats(&r["logits"]);
            for matvec in [QuantizedMatvec::Rmlx, QuantizedMatvec::Mlx] {
                let what = format!("{name}, {matvec:?}");
                let opts = LoadOptions {
                    dtype: Some(Dtype::Float32),
                    dequantize: Some(false),
                    quantized_matvec: matvec,
                    ..LoadOptions::default()
                };
                let lm = crate::loader::load(dir.path(), &opts).unwrap();
                let census = crate::profile::decode_steps(&lm, &prompt, 1).unwrap().operations;
                let mlx_products = census.get("QuantizedMatmul").copied().unwrap_or(0);
                assert_eq!(mlx_products == 0, matvec == QuantizedMatvec::Rmlx, "{what}: {census:?}");
                let mut caches = lm.model.new_caches(None);
                for (position, &t) in prompt.iter().enumerate() {
                    let x = Array::from_slice(&[t as i32], &[1, 1]).unwrap();
                    let got = values(&lm.model.forward(&x, &mut caches).unwrap());
                    let want = &want[position * vocab..(position + 1) * vocab];
                    let diff = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    assert!(diff <= tolerance, "{what}, position {position}: max |Δlogit| {diff}");
                }
                let opts = GenerateOptions { max_tokens: 12, ignore_eos: true, ..GenerateOptions::default() };
                let greedy: Vec<u32> = lm.generate(&prompt, &opts).unwrap().map(|t| t.unwrap().id).collect();
                assert_eq!(greedy, ids(&r["greedy"]), "{what}: greedy tokens");
            }
        }
    })
}
