//! rmlx's CUDA quantised matrix-vector product (`nn::cuda_qmv`) against the product with the
//! weights dequantised, computed in float32 on the CPU, and against MLX's own `quantized_matmul` on
//! the GPU: 4 and 8 bits, groups of 32, 64 and 128, float32, bfloat16 and float16, 1 to 8 rows
//! (leading axes flattened), input sizes that leave a partial step (1,152) and output counts that
//! leave a partial warp or block; the integer forms of 16-bit products (many outputs; fewer, split
//! between warps), that they keep 16 bits of `x`, and scales read from a matrix sliced by rows.
//! And what it leaves to MLX: 9 rows, 3 bits, no biases, scales of another type, training, traced
//! transforms, and everything off MLX's CUDA backend (the CPU CI).

use crate::nn::cuda_qmv::{
    fused_chain, fused_matvec, fused_pair, matvec_kernel, takes_integer_form, takes_split_form, Fused, Matrix, MAX_ROWS,
};
use crate::nn::with_training;
use rmlx::fast::{self, GpuBackend};
use rmlx::quantization::{dequantize, quantize, quantized_matmul, QuantMode, Quantized};
use rmlx::{ops, random, Array, Device, Dtype};

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

/// What a fused product adds to the plain one.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fusion {
    Plain,
    Norm,
    NormBias,
    Residual,
    ResidualBias,
    NormSwiGlu,
    NormGeGlu,
    SwiGlu,
}

/// The fused kernel against MLX's composed operations (`fast::rms_norm`, the product, `+`, `silu`
/// / `gelu_approx` and `·`) in float32 on the CPU (MLX's CUDA float32 products may round through
/// TF32): dense and 4- and 8-bit weights, float32, bfloat16 and float16, 1 to 8 rows, every
/// fusion the decoder blocks use.
#[test]
fn fused_products_match_the_composed_operations() {
    if !cuda() {
        return;
    }
    let (f32_, bf16, f16) = (Dtype::Float32, Dtype::Bfloat16, Dtype::Float16);
    // (rows, in, out, bits (0: dense), group, dtype)
    let cases: &[(i32, i32, i32, i32, i32, Dtype)] = &[
        (1, 4096, 96, 4, 64, bf16),
        (1, 1024, 70, 0, 0, bf16),
        (3, 512, 37, 8, 32, f32_),
        (2, 256, 64, 0, 0, f32_),
        (8, 384, 5, 4, 128, f16),
        (1, 2048, 130, 0, 0, f16),
        (5, 1152, 33, 8, 128, bf16),
        (1, 1152, 40000, 4, 64, bf16),
        (2, 2048, 8192, 8, 32, f16),
        (1, 4096, 12288, 4, 128, f16),
        (1, 12288, 4096, 4, 64, bf16),
        (2, 4096, 1000, 4, 32, f16),
        (1, 3072, 300, 8, 64, bf16),
        (2, 12288, 130, 8, 128, f16),
        (2, 1152, 77, 4, 128, bf16),
        // A verification pass's 3 or 4 rows: the integer form past 2,048 tiles, the float form
        // below.
        (4, 2048, 8192, 4, 64, bf16),
        (3, 1024, 8192, 8, 32, f16),
        (4, 4096, 2048, 4, 64, bf16),
    ];
    let fusions = [
        Fusion::Plain,
        Fusion::Norm,
        Fusion::NormBias,
        Fusion::Residual,
        Fusion::ResidualBias,
        Fusion::NormSwiGlu,
        Fusion::NormGeGlu,
        Fusion::SwiGlu,
    ];
    rmlx::with_device(Device::gpu(), || {
        for (i, &(rows, k, n, bits, group, dtype)) in cases.iter().enumerate() {
            let seed = 1000 * i as u64;
            let x = normal(&[rows, k], 1.0, seed + 1).astype(dtype).unwrap();
            let dense =
                [normal(&[n, k], 0.05, seed + 2), normal(&[n, k], 0.05, seed + 3)].map(|w| w.astype(dtype).unwrap());
            let quantized = dense
                .each_ref()
                .map(|w| (bits > 0).then(|| cast(&quantize(w, group, bits, QuantMode::Affine).unwrap(), dtype)));
            let matrix = |j: usize| match &quantized[j] {
                Some(q) => Matrix::Quantized(q),
                None => Matrix::Dense(&dense[j]),
            };
            let nw = (normal(&[k], 0.2, seed + 4) + 1.0).unwrap().astype(dtype).unwrap();
            let bias = normal(&[n], 0.5, seed + 5).astype(dtype).unwrap();
            let res = normal(&[rows, n], 1.0, seed + 6).astype(dtype).unwrap();
            let eps = 1e-5;
            for fusion in fusions {
                use Fusion::*;
                let what = format!("{rows}×{k} → {n}, {bits} bits, group {group}, {dtype:?}, {fusion:?}");
                let normed = matches!(fusion, Norm | NormBias | NormSwiGlu | NormGeGlu);
                let biased = matches!(fusion, NormBias | ResidualBias);
                let residual = matches!(fusion, Residual | ResidualBias);
                let gated = match fusion {
                    NormSwiGlu | SwiGlu => Some(false),
                    NormGeGlu => Some(true),
                    _ => None,
                };
                let f = Fused {
                    weight: matrix(0),
                    gated: gated.map(|gelu| (matrix(1), gelu)),
                    norm: normed.then_some((&nw, eps)),
                    bias: biased.then_some(&bias),
                    residual: residual.then_some(&res),
                };
                // The integer form takes 1, 2 or 4 computed rows of 16 bits whose prepared `x` fits
                // its shared memory, of 512 tiles and more (of 4 warps' rows).
                let computed = (rows as u32).next_power_of_two() as i32;
                let rows_per_tile = 4 * (4 / if gated.is_some() { 2 } else { 1 } / computed).max(1);
                let vals = if bits == 4 { 32 } else { 16 };
                let fits = computed * (2 * k + 8 * (k / vals.max(1))) <= 40 * 1024;
                let min_tiles = if computed > 2 { 2048 } else { 512 };
                let integer = bits > 0 && dtype != f32_ && computed <= 4 && fits && n / rows_per_tile >= min_tiles;
                assert_eq!(takes_integer_form(&x, &f), integer, "{what}: the integer form");
                // The split form takes the other 16-bit products of 1 or 2 rows that are not gated.
                let split = bits > 0 && dtype != f32_ && rows <= 2 && !integer && gated.is_none();
                assert_eq!(takes_split_form(&x, &f), split, "{what}: the split form");
                let got = fused_matvec(&x, &f).unwrap().unwrap_or_else(|| panic!("{what}: declined"));
                assert_eq!((got.shape(), got.dtype()), (&[rows, n][..], dtype), "{what}");
                let want = rmlx::with_device(Device::cpu(), || {
                    let wide = |a: &Array| a.astype(f32_).unwrap();
                    let input = match normed {
                        true => fast::rms_norm(&wide(&x), Some(&wide(&nw)), eps).unwrap(),
                        false => wide(&x),
                    };
                    let product = |j: usize| match &quantized[j] {
                        Some(q) => quantized_matmul(&input, &cast(q, f32_), true).unwrap(),
                        None => input.matmul(&wide(&dense[j]).transpose().unwrap()).unwrap(),
                    };
                    let mut want = product(0);
                    if biased {
                        want = (&want + wide(&bias)).unwrap();
                    }
                    if residual {
                        want = (wide(&res) + &want).unwrap();
                    }
                    if let Some(gelu) = gated {
                        let act = if gelu { ops::gelu_approx(&want).unwrap() } else { ops::silu(&want).unwrap() };
                        want = (act * product(1)).unwrap();
                    }
                    values(&want)
                });
                // Float32 sums in another order; the half types round the output, and the
                // products' outputs before a bias, a residual or an activation, once each.
                let tol = match dtype {
                    Dtype::Float32 => 1e-5,
                    Dtype::Bfloat16 => 2e-2,
                    _ => 4e-3,
                };
                let err = relative_error(&values(&got), &want);
                assert!(err <= tol, "{what}: {err} from the composed operations");
            }
        }
    })
}

/// A feed-forward half as one launch of two kernels (`fused_pair`), and the output projection with
/// it as one launch of three (`fused_chain`, the projection's output the last residual), give
/// exactly what the fused products give one after the other: the same kernels over the same
/// values, bit for bit (dense and 4-bit, bf16 and f16, 1 and 3 rows, SwiGLU and GeGLU).
///
/// Off MLX's CUDA backend (the CPU CI) both decline, and the layers compose MLX's operations.
#[test]
fn fused_pairs_equal_their_products_in_turn() {
    if !cuda() {
        let x = normal(&[1, 64], 1.0, 1);
        let (gate, up, down) = (normal(&[128, 64], 0.1, 2), normal(&[128, 64], 0.1, 3), normal(&[64, 128], 0.1, 4));
        let first = Fused { gated: Some((Matrix::Dense(&up), false)), ..Fused::product(Matrix::Dense(&gate)) };
        let second = Fused { residual: Some(&x), ..Fused::product(Matrix::Dense(&down)) };
        assert!(fused_pair(&x, &first, &second).unwrap().is_none(), "a pair served without CUDA");
        let steps = [(first, None), (Fused::product(Matrix::Dense(&down)), None)];
        assert!(fused_chain(&x, &steps).unwrap().is_none(), "a chain served without CUDA");
        return;
    }
    // (rows, hidden, intermediate, bits, dtype, gelu)
    let cases: &[(i32, i32, i32, i32, Dtype, bool)] = &[
        (1, 1024, 2816, 0, Dtype::Bfloat16, false),
        (3, 1024, 2816, 4, Dtype::Bfloat16, false),
        (1, 512, 1536, 4, Dtype::Float16, true),
        // The gate/up product in the integer form, the others not.
        (1, 1024, 4608, 4, Dtype::Bfloat16, false),
    ];
    rmlx::with_device(Device::gpu(), || {
        for (i, &(rows, hidden, inter, bits, dtype, gelu)) in cases.iter().enumerate() {
            let seed = 7000 + 100 * i as u64;
            let x = normal(&[rows, hidden], 1.0, seed).astype(dtype).unwrap();
            let nw = (normal(&[hidden], 0.2, seed + 1) + 1.0).unwrap().astype(dtype).unwrap();
            let dense = [(inter, hidden), (inter, hidden), (hidden, inter), (hidden, hidden)]
                .iter()
                .enumerate()
                .map(|(j, &(n, k))| normal(&[n, k], 0.05, seed + 2 + j as u64).astype(dtype).unwrap())
                .collect::<Vec<_>>();
            let quantized: Vec<Option<Quantized>> = dense
                .iter()
                .map(|w| (bits > 0).then(|| cast(&quantize(w, 64, bits, QuantMode::Affine).unwrap(), dtype)))
                .collect();
            let matrix = |j: usize| match &quantized[j] {
                Some(q) => Matrix::Quantized(q),
                None => Matrix::Dense(&dense[j]),
            };
            let first = Fused { gated: Some((matrix(1), gelu)), norm: Some((&nw, 1e-5)), ..Fused::product(matrix(0)) };
            let second = Fused { residual: Some(&x), ..Fused::product(matrix(2)) };
            let what = format!("case {i}: {rows} rows, {bits} bits, {dtype:?}");
            let pair = fused_pair(&x, &first, &second).unwrap().unwrap_or_else(|| panic!("{what}: declined"));
            let a = fused_matvec(&x, &first).unwrap().unwrap();
            let in_turn = fused_matvec(&a, &second).unwrap().unwrap();
            assert_eq!(pair.shape(), &[rows, hidden][..], "{what}");
            assert_eq!(values(&pair), values(&in_turn), "{what}");
            // The output projection first, its result the feed-forward's residual (a step's output).
            let o = normal(&[rows, hidden], 1.0, seed + 9).astype(dtype).unwrap();
            let project = Fused { residual: Some(&x), ..Fused::product(matrix(3)) };
            let h = fused_matvec(&o, &project).unwrap();
            let down = Fused::product(matrix(2));
            let steps = [(project, None), (first, None), (down, Some(0))];
            let chain = fused_chain(&o, &steps).unwrap().unwrap_or_else(|| panic!("{what}: chain declined"));
            let h = h.unwrap();
            let a = fused_matvec(&h, &first).unwrap().unwrap();
            let in_turn = fused_matvec(&a, &Fused { residual: Some(&h), ..down }).unwrap().unwrap();
            assert_eq!(values(&chain), values(&in_turn), "{what}: chain");
        }
    });
}

#[test]
fn fused_products_decline_what_they_do_not_compute() {
    let device = if cuda() { Device::gpu() } else { rmlx::default_device() };
    rmlx::with_device(device, || {
        let w = normal(&[16, 256], 0.05, 1);
        let x = normal(&[2, 256], 1.0, 2);
        let res = normal(&[2, 16], 1.0, 3);
        let plain = Fused::product(Matrix::Dense(&w));
        assert_eq!(fused_matvec(&x, &plain).unwrap().is_some(), cuda(), "served only on MLX's CUDA backend");
        let declines = |x: &Array, f: &Fused, what: &str| {
            assert!(fused_matvec(x, f).unwrap().is_none(), "{what}");
        };
        let gated_residual = Fused { gated: Some((Matrix::Dense(&w), false)), residual: Some(&res), ..plain };
        declines(&x, &gated_residual, "a gated product with a residual");
        declines(&x, &Fused { residual: Some(&normal(&[2, 15], 1.0, 4)), ..plain }, "a residual of another shape");
        let half = normal(&[256], 1.0, 5).astype(Dtype::Float16).unwrap();
        declines(&x, &Fused { norm: Some((&half, 1e-5)), ..plain }, "a norm weight of another type");
        declines(&x, &Fused::product(Matrix::Dense(&w.astype(Dtype::Bfloat16).unwrap())), "a weight of another type");
        let odd = normal(&[16, 6], 0.05, 6);
        declines(&normal(&[1, 6], 1.0, 7), &Fused::product(Matrix::Dense(&odd)), "rows of 24 bytes");
        let up = normal(&[8, 256], 0.05, 8);
        declines(&x, &Fused { gated: Some((Matrix::Dense(&up), false)), ..plain }, "gate and up of other shapes");
        with_training(|| declines(&x, &plain, "training"));
    })
}

/// Both integer forms keep `x` to 16 bits a value, not 8. Every unit of 32 inputs holds +100 and
/// -100 at two inputs whose weight columns are equal (their products cancel) and values of about
/// 0.5 elsewhere: rounded to 8 bits of their unit's largest value (`hi` alone), the small values
/// move the product by over 10 times the tolerance (0.43 of the largest output); at 16 bits (an
/// error of up to 100 / 64,516 a value) each form stays within it of the float32 product of the
/// dequantised weights (with the float16 output's own rounding): 8,192 outputs take the integer
/// form, 1,024 the split one.
#[test]
fn the_integer_forms_keep_sixteen_bits_of_x() {
    if !cuda() {
        return;
    }
    let k = 2048;
    let mut xv = values(&normal(&[1, k], 0.5, 31));
    for unit in xv.chunks_mut(32) {
        unit[..2].copy_from_slice(&[100.0, -100.0]);
    }
    let x = Array::from_slice(&xv, &[1, k]).unwrap().astype(Dtype::Float16).unwrap();
    for n in [8192, 1024] {
        let mut wv = values(&normal(&[n, k], 0.05, 32));
        for row in wv.chunks_mut(k as usize) {
            for unit in row.chunks_mut(32) {
                unit[1] = unit[0];
            }
        }
        let w = Array::from_slice(&wv, &[n, k]).unwrap();
        let q = cast(&quantize(&w, 64, 4, QuantMode::Affine).unwrap(), Dtype::Float16);
        let want = reference(&x, &q);
        let tol = 5e-3;
        // What 8 bits a value would give: each unit rounded to multiples of its largest value / 127.
        let hi_only: Vec<f32> = values(&x)
            .chunks(32)
            .flat_map(|unit| {
                let d = unit.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                unit.iter().map(move |v| (v / d).round() * d)
            })
            .collect();
        let coarse = reference(&Array::from_slice(&hi_only, &[1, k]).unwrap(), &q);
        let coarse_err = relative_error(&coarse, &want);
        assert!(coarse_err > 10.0 * tol, "{n}: 8 bits a value give {coarse_err}: the test would not see them");
        rmlx::with_device(Device::gpu(), || {
            let plain = Fused::product(Matrix::Quantized(&q));
            let form = (takes_integer_form(&x, &plain), takes_split_form(&x, &plain));
            assert_eq!(form, (n == 8192, n == 1024), "{n} outputs of 16-bit x: (integer, split) form");
            let got = values(&matvec_kernel(&x, &q).unwrap().unwrap());
            let err = relative_error(&got, &want);
            assert!(err <= tol, "{n} outputs: {err} from the dequantised product");
        })
    }
}

/// The split form reads scales and biases as 4-byte words: those of a matrix sliced from a larger
/// one by rows may start at an odd element (9 groups a row here), and the last word may hold one
/// element of the array. The product over such a slice matches the dequantised product.
#[test]
fn the_split_form_reads_the_scales_of_a_slice() {
    if !cuda() {
        return;
    }
    let (k, n) = (1152, 301);
    let x = normal(&[1, k], 1.0, 41).astype(Dtype::Bfloat16).unwrap();
    let whole = cast(&quantize(&normal(&[n + 1, k], 0.05, 42), 128, 4, QuantMode::Affine).unwrap(), Dtype::Bfloat16);
    let rows = |a: &Array| {
        let cols = a.shape()[1];
        ops::slice(a, &[1, 0], &[n + 1, cols], &[1, 1]).unwrap()
    };
    let q = Quantized {
        weight: rows(&whole.weight),
        scales: rows(&whole.scales),
        biases: whole.biases.as_ref().map(rows),
        ..whole.clone()
    };
    let want = reference(&x, &q);
    rmlx::with_device(Device::gpu(), || {
        assert!(takes_split_form(&x, &Fused::product(Matrix::Quantized(&q))), "{n} outputs: the split form");
        let got = values(&matvec_kernel(&x, &q).unwrap().unwrap());
        let err = relative_error(&got, &want);
        assert!(err <= 2e-2, "a slice's scales: {err} from the dequantised product");
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
                // The blocks' norms are folded into the products that read them: the final norm is left.
                let norms = census.get("RMSNorm").copied().unwrap_or(0);
                assert_eq!(norms == 1, matvec == QuantizedMatvec::Rmlx, "{what}: {census:?}");
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
