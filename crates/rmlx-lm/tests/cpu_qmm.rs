//! The CPU quantised product against MLX's: 4 and 8 bits, groups of 32 and 64, float32, bfloat16
//! and float16, one to eight rows, a column count that leaves a partial task; and what it leaves
//! to others (more rows, 3 bits).

use rmlx::quantization::{dequantize, quantize, QuantMode};
use rmlx::{ops, random, Array, Dtype};
use rmlx_lm::nn::cpu_qmm::{cpu_quantized_matmul, CPU_QMM_MAX_ROWS};

fn max_abs_diff(a: &Array, b: &Array) -> f32 {
    let d = (a.astype(Dtype::Float32).unwrap() - b.astype(Dtype::Float32).unwrap()).unwrap();
    d.abs().unwrap().max(rmlx::Axes::All, false).unwrap().item::<f32>().unwrap()
}

#[test]
fn matches_the_dequantised_product() {
    rmlx::set_default_device(rmlx::Device::cpu()).unwrap();
    let key = random::key(7).unwrap();
    let (n, k) = (70, 256);
    let w = random::normal(&[n, k], Dtype::Float32, 0.0, 0.05, Some(&key)).unwrap();
    for (bits, group) in [(4, 32), (4, 64), (8, 32), (8, 64)] {
        for dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
            let q = quantize(&w.astype(dtype).unwrap(), group, bits, QuantMode::Affine).unwrap();
            let dense = dequantize(&q, Some(Dtype::Float32)).unwrap();
            for rows in [1, 3, CPU_QMM_MAX_ROWS as i32] {
                let x = random::normal(&[rows, k], Dtype::Float32, 0.0, 1.0, Some(&key)).unwrap();
                let want = x.matmul(&dense.transpose().unwrap()).unwrap();
                let got = cpu_quantized_matmul(&x.astype(dtype).unwrap(), &q).unwrap().expect("applies");
                assert_eq!(got.shape(), &[rows, n]);
                assert_eq!(got.dtype(), dtype);
                // float32 within summation order; the half types within their own rounding.
                let tol = if dtype == Dtype::Float32 { 1e-4 } else { 0.05 };
                let err = max_abs_diff(&got, &want);
                assert!(err < tol, "{bits} bits, group {group}, {dtype:?}, {rows} rows: off by {err}");
            }
        }
    }
    // Leading axes are kept: [2, 1, k] → [2, 1, n].
    let q = quantize(&w, 32, 4, QuantMode::Affine).unwrap();
    let x = ops::ones(&[2, 1, k], Dtype::Float32).unwrap();
    let got = cpu_quantized_matmul(&x, &q).unwrap().unwrap();
    assert_eq!(got.shape(), &[2, 1, n]);
    let want = x.matmul(&dequantize(&q, None).unwrap().transpose().unwrap()).unwrap();
    assert!(max_abs_diff(&got, &want) < 1e-4);
}

#[test]
fn leaves_what_it_does_not_serve_to_others() {
    let w = ops::ones(&[8, 128], Dtype::Float32).unwrap();
    let q4 = quantize(&w, 32, 4, QuantMode::Affine).unwrap();
    let many = ops::ones(&[CPU_QMM_MAX_ROWS as i32 + 1, 128], Dtype::Float32).unwrap();
    assert!(cpu_quantized_matmul(&many, &q4).unwrap().is_none());
    let q3 = quantize(&w, 32, 3, QuantMode::Affine).unwrap();
    let one = ops::ones(&[1, 128], Dtype::Float32).unwrap();
    assert!(cpu_quantized_matmul(&one, &q3).unwrap().is_none());
    let ints = ops::ones(&[1, 128], Dtype::Int32).unwrap();
    assert!(cpu_quantized_matmul(&ints, &q4).unwrap().is_none());
}
