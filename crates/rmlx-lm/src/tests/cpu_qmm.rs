//! The CPU quantised product against MLX's: 4 and 8 bits, groups of 16, 32 and 64, float32,
//! bfloat16 and float16 inputs and scales. Up to eight half-precision rows (a decoding step) take the
//! integer form where the group is a multiple of 32 (activations rounded to 8 bits per block of
//! 32): checked against that definition computed here, and for NaN passing through; float32 rows
//! and groups of 16 the float form, and more rows (a prompt) the panel form, both exact to float32
//! summation (with partial register tiles and panels, and a column count that leaves a partial
//! task). And what it leaves to others (3 bits, integer inputs).

use crate::nn::cpu_qmm::{cpu_quantized_matmul, CPU_QMM_MAX_ROWS};
use rmlx::quantization::{dequantize, quantize, QuantMode};
use rmlx::{ops, random, Array, Dtype};

fn max_abs_diff(a: &Array, b: &Array) -> f32 {
    let d = (a.astype(Dtype::Float32).unwrap() - b.astype(Dtype::Float32).unwrap()).unwrap();
    d.abs().unwrap().max(rmlx::Axes::All, false).unwrap().item::<f32>().unwrap()
}

/// `w` quantised with `group` values per scale; MLX quantises in groups of 32 at least, so groups
/// of 16 are groups of 32 with every scale and bias given twice (the same values).
fn quantized(w: &Array, group: i32, bits: i32) -> rmlx::quantization::Quantized {
    if group >= 32 {
        return quantize(w, group, bits, QuantMode::Affine).unwrap();
    }
    let q = quantize(w, 32, bits, QuantMode::Affine).unwrap();
    let twice = |a: &Array| ops::repeat(a, 2, Some(1)).unwrap();
    rmlx::quantization::Quantized {
        scales: twice(&q.scales),
        biases: q.biases.as_ref().map(twice),
        group_size: group,
        ..q
    }
}

#[test]
fn matches_the_dequantised_product() {
    rmlx::with_device(rmlx::Device::cpu(), || {
        let key = random::key(7).unwrap();
        let (n, k) = (70, 256);
        let w = random::normal(&[n, k], Dtype::Float32, 0.0, 0.05, Some(&key)).unwrap();
        // Groups of 128 too, and 96 values (an odd number of groups of 32).
        let narrow = ops::slice(&w, &[0, 0], &[n, 96], &[1, 1]).unwrap();
        let cases = [(4, 16), (4, 32), (4, 64), (4, 128), (8, 16), (8, 32), (8, 64)].map(|c| (c, &w));
        for ((bits, group), w) in cases.into_iter().chain([((4, 32), &narrow)]) {
            let k = w.shape()[1];
            for dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
                let q = quantized(&w.astype(dtype).unwrap(), group, bits);
                let dense = dequantize(&q, Some(Dtype::Float32)).unwrap();
                // 13 and 40 rows: the panel form, whole blocks of 16 rows and a partial one; 70
                // features: whole panels of 6 and a partial one.
                // float32 rows and groups of 16 take the float form for a few rows; any take the panel
                // form for many.
                let few = dtype == Dtype::Float32 || group == 16;
                let rows: &[i32] = if few { &[1, 3, CPU_QMM_MAX_ROWS as i32, 13, 40] } else { &[13, 40] };
                for &rows in rows {
                    let x = random::normal(&[rows, k], Dtype::Float32, 0.0, 1.0, Some(&key)).unwrap();
                    let want = x.matmul(&dense.transpose().unwrap()).unwrap();
                    let got = cpu_quantized_matmul(&x.astype(dtype).unwrap(), &q).unwrap().expect("applies");
                    assert_eq!(got.shape(), &[rows, n]);
                    assert_eq!(got.dtype(), dtype);
                    // float32 within summation order; the half types within their own rounding.
                    let tol = if dtype == Dtype::Float32 { 1e-4 } else { 0.05 };
                    let err = max_abs_diff(&got, &want);
                    assert!(err < tol, "{bits} bits, group {group}, k {k}, {dtype:?}, {rows} rows: off by {err}");
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
    })
}

#[test]
fn leaves_what_it_does_not_serve_to_others() {
    let w = ops::ones(&[8, 128], Dtype::Float32).unwrap();
    let q4 = quantize(&w, 32, 4, QuantMode::Affine).unwrap();
    let q3 = quantize(&w, 32, 3, QuantMode::Affine).unwrap();
    let one = ops::ones(&[1, 128], Dtype::Float32).unwrap();
    assert!(cpu_quantized_matmul(&one, &q3).unwrap().is_none());
    let ints = ops::ones(&[1, 128], Dtype::Int32).unwrap();
    assert!(cpu_quantized_matmul(&ints, &q4).unwrap().is_none());
}

/// The integer form by its definition: each block of 32 inputs rounded to multiples of
/// `max|x| / 127` (`round(x · 127 / max|x|)`), times the dequantised weights.
fn integer_form_reference(x: &[f32], rows: usize, k: i32, q: &rmlx::quantization::Quantized) -> Vec<f32> {
    let rounded: Vec<f32> = x
        .chunks(32)
        .flat_map(|b| {
            let amax = b.iter().fold(0f32, |a, v| a.max(v.abs()));
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            b.iter().map(move |v| (v * inv).round() * (amax / 127.0))
        })
        .collect();
    let xr = Array::from_slice(&rounded, &[rows as i32, k]).unwrap();
    // `scale · q + bias` in float32 (MLX computes it in the scales' dtype).
    let wide = |a: &Array| a.astype(Dtype::Float32).unwrap();
    let q32 =
        rmlx::quantization::Quantized { scales: wide(&q.scales), biases: q.biases.as_ref().map(wide), ..q.clone() };
    let w = dequantize(&q32, Some(Dtype::Float32)).unwrap();
    xr.matmul(&w.transpose().unwrap()).unwrap().to_vec::<f32>().unwrap()
}

#[test]
fn half_rows_take_the_integer_form() {
    rmlx::with_device(rmlx::Device::cpu(), || {
        let key = random::key(11).unwrap();
        // 37 columns: whole passes of four and a remainder.
        let (n, k) = (37, 128);
        let w = random::normal(&[n, k], Dtype::Float32, 0.0, 0.05, Some(&key)).unwrap();
        for (bits, group) in [(4, 32), (4, 64), (8, 32), (8, 64)] {
            for dtype in [Dtype::Bfloat16, Dtype::Float16] {
                let q = quantize(&w.astype(dtype).unwrap(), group, bits, QuantMode::Affine).unwrap();
                for rows in [1usize, 5, CPU_QMM_MAX_ROWS] {
                    let x = random::normal(&[rows as i32, k], Dtype::Float32, 0.0, 1.0, Some(&key))
                        .unwrap()
                        .astype(dtype)
                        .unwrap();
                    let xs = x.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
                    let want = integer_form_reference(&xs, rows, k, &q);
                    let got = cpu_quantized_matmul(&x, &q).unwrap().unwrap();
                    assert_eq!(got.dtype(), dtype);
                    let got = got.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
                    // Computed in float32, then rounded once to the dtype (unit roundoff `u`).
                    let u = if dtype == Dtype::Bfloat16 { 2f32.powi(-8) } else { 2f32.powi(-11) };
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        let tol = u * w.abs() + 1e-4;
                        assert!((g - w).abs() <= tol, "{bits} bits, group {group}, {dtype:?}, element {i}: {g} vs {w}");
                    }
                }
            }
        }
        // A NaN input makes its row NaN, as the float form would; the other rows are untouched.
        let q = quantize(&w.astype(Dtype::Bfloat16).unwrap(), 32, 4, QuantMode::Affine).unwrap();
        let mut xs = vec![0.5f32; 2 * k as usize];
        xs[3] = f32::NAN;
        let x = Array::from_slice(&xs, &[2, k]).unwrap().astype(Dtype::Bfloat16).unwrap();
        let y = cpu_quantized_matmul(&x, &q).unwrap().unwrap().astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
        assert!(y[..n as usize].iter().all(|v| v.is_nan()), "{y:?}");
        assert!(y[n as usize..].iter().all(|v| v.is_finite()), "{y:?}");
    })
}

/// Every SIMD level of the float form this processor runs (CI's and the development machine's
/// may differ: each is forced here) against the dequantised weights times `x` summed in float64,
/// for 4 and 8 bits and groups of 16 (plain code), 32, 64 and 128 (block counts fixed in the
/// kernels) and 96 (any block count), two rows of `x`.
#[test]
fn every_simd_level_of_the_float_form_matches_float64() {
    use crate::nn::cpu_qmm::float::{Columns, FloatRows, Simd};
    let levels: Vec<Simd> = [Simd::Portable, Simd::Avx2, Simd::Avx512].into_iter().filter(|s| s.available()).collect();
    // A small deterministic generator: the values do not matter, only that every nibble occurs.
    let mut state = 0x2545_f491_u32;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        state
    };
    let (n, k, m) = (5usize, 384usize, 2usize);
    for bits in [4usize, 8] {
        for group in [16usize, 32, 64, 96, 128] {
            let groups = k / group;
            let words: Vec<u32> = (0..n * k * bits / 32).map(|_| next()).collect();
            let unit = |v: u32| (v % 2001) as f32 / 1000.0 - 1.0;
            let scales: Vec<f32> = (0..n * groups).map(|_| unit(next()) * 0.1).collect();
            let biases: Vec<f32> = (0..n * groups).map(|_| unit(next())).collect();
            let x: Vec<f32> = (0..m * k).map(|_| unit(next()) * 3.0).collect();
            let value = |c: usize, i: usize| {
                let per_word = 32 / bits;
                let q = (words[c * k / per_word + i / per_word] >> (bits * (i % per_word))) & ((1 << bits) - 1);
                let g = c * groups + i / group;
                scales[g] as f64 * q as f64 + biases[g] as f64
            };
            for &simd in &levels {
                let rows = FloatRows::new(&x, k, bits, group, simd);
                let mut out = vec![0f32; n * m];
                Columns { w: &words, scales: &scales, biases: &biases }.dots(&rows, &mut out);
                for c in 0..n {
                    for r in 0..m {
                        let xs = &x[r * k..(r + 1) * k];
                        let want: f64 = (0..k).map(|i| value(c, i) * xs[i] as f64).sum();
                        let magnitude: f64 = (0..k).map(|i| (value(c, i) * xs[i] as f64).abs()).sum();
                        let got = out[c * m + r] as f64;
                        assert!(
                            (got - want).abs() <= 1e-6 * magnitude,
                            "{simd:?}, {bits} bits, group {group}, column {c}, row {r}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

/// Each row of a few-row product (the float form, which takes rows two at a time with AVX2) is
/// the bits that row gets alone: 4 and 8 bits, groups of 32, 64 and 128, 96 inputs (three groups:
/// a sum of groups past the last four), 1 to 8 rows, 70 features (a partial task).
#[test]
fn rows_together_equal_rows_alone() {
    rmlx::with_device(rmlx::Device::cpu(), || {
        let key = random::key(11).unwrap();
        for (bits, group, k) in [(4, 32, 256), (4, 64, 256), (4, 128, 256), (8, 32, 256), (8, 64, 256), (4, 32, 96)] {
            let w = random::normal(&[70, k], Dtype::Float32, 0.0, 0.05, Some(&key)).unwrap();
            let q = quantize(&w, group, bits, QuantMode::Affine).unwrap();
            for rows in 1..=CPU_QMM_MAX_ROWS as i32 {
                let x = random::normal(&[rows, k], Dtype::Float32, 0.0, 1.0, Some(&key)).unwrap();
                let together = cpu_quantized_matmul(&x, &q).unwrap().expect("applies").to_vec::<f32>().unwrap();
                for r in 0..rows {
                    let row = ops::slice(&x, &[r, 0], &[r + 1, k], &[1, 1]).unwrap();
                    let alone = cpu_quantized_matmul(&row, &q).unwrap().expect("applies").to_vec::<f32>().unwrap();
                    let got = &together[(r * 70) as usize..((r + 1) * 70) as usize];
                    assert!(got == alone.as_slice(), "{bits} bits, groups of {group}: row {r} of {rows}");
                }
            }
        }
    });
}
