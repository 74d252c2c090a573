//! `axpby` as a custom primitive: values against hand-computed and f64 references, gradients and
//! JVPs against central finite differences (in float64) and against the composed version, vmap
//! against a loop, compile against uncompiled, errors, and (on a CUDA machine) the GPU kernel.

use rmlx::custom::{apply, CustomPrimitive};
use rmlx::fast::{gpu_backend, GpuBackend, TemplateArg, TensorSpec};
use rmlx::{compile::compile, ops, transforms, Array, Axes, Dtype, Result};
use rmlx_axpby::{axpby, axpby_composed, Axpby};

/// Coefficients used throughout; exact in f32, so `A as f64` is the same number.
const A: f32 = 1.5;
const B: f32 = -0.75;

/// Deterministic values in about [-1.5, 1.5].
fn data(n: usize, seed: f64) -> Vec<f64> {
    (0..n).map(|i| (i as f64 * 0.731 + seed).sin() * 1.3 + (i as f64 * 0.117 + 2.0 * seed).cos() * 0.2).collect()
}

fn f32s(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

fn arr32(v: &[f64], shape: &[i32]) -> Array {
    Array::from_slice(&f32s(v), shape).unwrap()
}

fn arr64(v: &[f64], shape: &[i32]) -> Array {
    Array::from_slice(v, shape).unwrap()
}

/// The elements of any real array as f64.
fn values(a: &Array) -> Vec<f64> {
    // Through float32 unless already float64: MLX's GPU backends have no float64.
    match a.dtype() {
        Dtype::Float64 => a.to_vec::<f64>().unwrap(),
        _ => a.to_vec_f32().unwrap().into_iter().map(f64::from).collect(),
    }
}

/// Runs `f` on the CPU: tests in float64 (which MLX's GPU backends lack).
fn on_cpu<T>(f: impl FnOnce() -> T) -> T {
    rmlx::with_device(rmlx::Device::cpu(), f)
}

/// `|got - want| <= rtol * max(|want|, 1)` element by element.
fn assert_close(got: &[f64], want: &[f64], rtol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        assert!(err <= rtol * w.abs().max(1.0), "{what}: element {i}: got {g}, want {w} (err {err:e})");
    }
}

/// `alpha * x + beta * y` in f64, `y` repeated to the length of `x` (row broadcasting).
fn reference(x: &[f64], y: &[f64]) -> Vec<f64> {
    x.iter().enumerate().map(|(i, &x)| A as f64 * x + B as f64 * y[i % y.len()]).collect()
}

// -------------------------------------------------------------------------------------------------
// values

#[test]
fn guide_example_and_hand_computed_values() {
    on_cpu(guide_example_and_hand_computed_values_in_f64)
}

fn guide_example_and_hand_computed_values_in_f64() {
    // The guide's usage example: ones * 4 + ones * 2 == 6 everywhere.
    let ones = ops::ones(&[3, 4], Dtype::Float32).unwrap();
    let c = axpby(&ones, &ones, 4.0, 2.0).unwrap();
    assert_eq!((c.shape(), c.dtype()), (&[3, 4][..], Dtype::Float32));
    assert_eq!(c.to_vec::<f32>().unwrap(), vec![6.0; 12]);

    let x = Array::from_slice(&[1.0f32, -2.0, 0.5, 4.0], &[2, 2]).unwrap();
    let y = Array::from_slice(&[3.0f32, 1.0, -1.0, 0.0], &[2, 2]).unwrap();
    // 1.5 * x - 0.75 * y
    assert_eq!(axpby(&x, &y, A, B).unwrap().to_vec::<f32>().unwrap(), vec![-0.75, -3.75, 1.5, 6.0]);
    let x64 = x.astype(Dtype::Float64).unwrap();
    let y64 = y.astype(Dtype::Float64).unwrap();
    let z64 = axpby(&x64, &y64, A, B).unwrap();
    assert_eq!(z64.dtype(), Dtype::Float64);
    assert_eq!(z64.to_vec::<f64>().unwrap(), vec![-0.75, -3.75, 1.5, 6.0]);
}

#[test]
fn f32_and_f64_match_f64_reference() {
    on_cpu(f32_and_f64_match_f64_reference_in_f64)
}

fn f32_and_f64_match_f64_reference_in_f64() {
    let (xv, yv) = (data(60, 0.3), data(60, 1.7));
    let want = reference(&xv, &yv);
    // float64 computes exactly what the reference computes.
    let z64 = axpby(&arr64(&xv, &[6, 10]), &arr64(&yv, &[6, 10]), A, B).unwrap();
    assert_eq!(z64.dtype(), Dtype::Float64);
    assert_eq!(z64.to_vec::<f64>().unwrap(), want);
    // float32: the inputs are rounded to f32 first, then one rounding per operation.
    let (x32, y32) = (arr32(&xv, &[6, 10]), arr32(&yv, &[6, 10]));
    let z32 = axpby(&x32, &y32, A, B).unwrap();
    assert_eq!(z32.dtype(), Dtype::Float32);
    assert_close(&values(&z32), &reference(&values(&x32), &values(&y32)), 1e-6, "f32");
    // And the composed version agrees.
    assert_close(&values(&z32), &values(&axpby_composed(&x32, &y32, A, B).unwrap()), 1e-6, "f32 vs composed");
}

#[test]
fn broadcasting() {
    let x = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
    let y = Array::from_slice(&[10.0f32, 20.0, 30.0], &[3]).unwrap();
    // [2,3] with [3]
    let z = axpby(&x, &y, 2.0, 0.5).unwrap();
    assert_eq!(z.shape(), &[2, 3]);
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![7.0, 14.0, 21.0, 13.0, 20.0, 27.0]);
    // [3] with [2,3]: the broadcast input may be either one.
    let z = axpby(&y, &x, 0.5, 2.0).unwrap();
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![7.0, 14.0, 21.0, 13.0, 20.0, 27.0]);
    // scalar with array
    let s = Array::scalar(2.0f32);
    let z = axpby(&s, &x, 3.0, 1.0).unwrap();
    assert_eq!(z.shape(), &[2, 3]);
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![7.0, 8.0, 9.0, 10.0, 11.0, 12.0]);
    // scalar with scalar
    let z = axpby(&s, &Array::scalar(1.0f32), 3.0, 1.0).unwrap();
    assert_eq!((z.shape(), z.item::<f32>().unwrap()), (&[][..], 7.0));
    // [2,1] with [1,3]: both broadcast.
    let col = Array::from_slice(&[1.0f32, 2.0], &[2, 1]).unwrap();
    let row = Array::from_slice(&[10.0f32, 20.0, 30.0], &[1, 3]).unwrap();
    let z = axpby(&col, &row, 1.0, 1.0).unwrap();
    assert_eq!(z.shape(), &[2, 3]);
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![11.0, 21.0, 31.0, 12.0, 22.0, 32.0]);
}

#[test]
fn integer_and_bool_inputs_upcast_to_float32() {
    on_cpu(integer_and_bool_inputs_upcast_to_float32_in_f64)
}

fn integer_and_bool_inputs_upcast_to_float32_in_f64() {
    let x = Array::from_slice(&[1i32, -2, 3], &[3]).unwrap();
    let y = Array::from_slice(&[4i32, 5, -6], &[3]).unwrap();
    let z = axpby(&x, &y, A, B).unwrap();
    assert_eq!(z.dtype(), Dtype::Float32);
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![-1.5, -6.75, 9.0]);

    let b = Array::from_slice(&[true, false, true], &[3]).unwrap();
    let z = axpby(&b, &x, 2.0, 1.0).unwrap();
    assert_eq!(z.dtype(), Dtype::Float32);
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![3.0, -2.0, 5.0]);

    let u = Array::from_slice(&[200u8, 7], &[2]).unwrap();
    let z = axpby(&u, &Array::scalar(1i64), 0.5, 3.0).unwrap();
    assert_eq!(z.dtype(), Dtype::Float32);
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![103.0, 6.5]);

    // Promotion keeps the floating type of the other input.
    let h = Array::from_slice(&[rmlx::f16::from_f32(0.5); 3], &[3]).unwrap();
    assert_eq!(axpby(&x, &h, 1.0, 2.0).unwrap().dtype(), Dtype::Float16);
    let d = Array::from_slice(&[0.25f64; 3], &[3]).unwrap();
    let z = axpby(&x, &d, 1.0, 4.0).unwrap();
    assert_eq!(z.dtype(), Dtype::Float64);
    assert_eq!(z.to_vec::<f64>().unwrap(), vec![2.0, -1.0, 4.0]);
    // f32 with f64 gives f64.
    let f = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]).unwrap();
    assert_eq!(axpby(&f, &d, 1.0, 1.0).unwrap().dtype(), Dtype::Float64);
}

#[test]
fn half_precision_within_rounding() {
    let (xv, yv) = (data(40, 0.9), data(40, 2.3));
    for (dtype, eps) in [(Dtype::Float16, 2f64.powi(-11)), (Dtype::Bfloat16, 2f64.powi(-8))] {
        let x = arr32(&xv, &[4, 10]).astype(dtype).unwrap();
        let y = arr32(&yv, &[4, 10]).astype(dtype).unwrap();
        let z = axpby(&x, &y, A, B).unwrap();
        assert_eq!(z.dtype(), dtype);
        assert_eq!(z.shape(), &[4, 10]);
        // The reference takes the rounded inputs; the result is rounded once more, by at most the
        // unit roundoff `eps` relative to |z| <= |alpha x| + |beta y| (plus f32's tiny errors).
        let (xr, yr) = (values(&x), values(&y));
        let want = reference(&xr, &yr);
        for (i, (g, w)) in values(&z).iter().zip(&want).enumerate() {
            let scale = 1.001 * ((A as f64 * xr[i]).abs() + (B as f64 * yr[i]).abs());
            assert!((g - w).abs() <= eps * scale, "{dtype}: element {i}: got {g}, want {w}");
        }
        let composed = values(&axpby_composed(&x, &y, A, B).unwrap());
        assert_close(&values(&z), &composed, 4.0 * eps, &format!("{dtype} vs composed"));
    }
}

#[test]
fn non_contiguous_inputs() {
    // x is the transpose of a [3,2] array, y is every other column of a [2,6] array.
    let base = data(6, 0.1);
    let xt = arr32(&base, &[3, 2]).transpose().unwrap();
    let wide = arr32(&data(12, 0.5), &[2, 6]);
    let y = wide.slice_axis(1, 0, 6, 2).unwrap();
    assert_eq!((xt.shape(), y.shape()), (&[2, 3][..], &[2, 3][..]));
    let (xv, yv) = (values(&xt), values(&y));
    assert_eq!(xv[1], base[2] as f32 as f64); // really transposed
    let z = axpby(&xt, &y, A, B).unwrap();
    let want: Vec<f64> = xv.iter().zip(&yv).map(|(x, y)| A as f64 * x + B as f64 * y).collect();
    assert_close(&values(&z), &want, 1e-6, "non-contiguous");
}

#[test]
fn errors() {
    on_cpu(errors_in_f64)
}

fn errors_in_f64() {
    let x = ops::zeros(&[2, 3], Dtype::Float32).unwrap();
    for bad in [&[2][..], &[3, 2], &[4, 2, 2]] {
        let y = ops::zeros(bad, Dtype::Float32).unwrap();
        assert!(matches!(axpby(&x, &y, 1.0, 1.0), Err(rmlx::Error::InvalidArgument(_))), "{bad:?}");
    }
    // Complex input is refused rather than computed wrongly.
    let c = x.astype(Dtype::Complex64).unwrap();
    assert!(matches!(axpby(&c, &x, 1.0, 1.0), Err(rmlx::Error::Unsupported(_))));
    // The primitive itself insists on inputs of one shape and dtype.
    let y = ops::zeros(&[3], Dtype::Float32).unwrap();
    assert!(apply(Axpby { alpha: 1.0, beta: 1.0 }, &[x.clone(), y]).is_err());
    let y64 = ops::zeros(&[2, 3], Dtype::Float64).unwrap();
    assert!(apply(Axpby { alpha: 1.0, beta: 1.0 }, &[x, y64]).is_err());
}

// -------------------------------------------------------------------------------------------------
// gradients

/// `sum(axpby(x, y)^2)` in f64, from host data.
fn loss_at(x: &[f64], xs: &[i32], y: &[f64], ys: &[i32]) -> f64 {
    let z = axpby(&arr64(x, xs), &arr64(y, ys), A, B).unwrap();
    (&z * &z).unwrap().sum(Axes::All, false).unwrap().item::<f64>().unwrap()
}

/// Central differences of `loss_at` with respect to every element of `x` (`wrt_x`) or `y`.
fn finite_difference(x: &[f64], xs: &[i32], y: &[f64], ys: &[i32], wrt_x: bool) -> Vec<f64> {
    let h = 1e-5;
    let n = if wrt_x { x.len() } else { y.len() };
    (0..n)
        .map(|i| {
            let (mut xp, mut yp) = (x.to_vec(), y.to_vec());
            let (mut xm, mut ym) = (x.to_vec(), y.to_vec());
            if wrt_x {
                xp[i] += h;
                xm[i] -= h;
            } else {
                yp[i] += h;
                ym[i] -= h;
            }
            (loss_at(&xp, xs, &yp, ys) - loss_at(&xm, xs, &ym, ys)) / (2.0 * h)
        })
        .collect()
}

fn squared_loss(f: fn(&Array, &Array, f32, f32) -> Result<Array>) -> impl Fn(&[Array]) -> Result<Vec<Array>> {
    move |a: &[Array]| {
        let z = f(&a[0], &a[1], A, B)?;
        Ok(vec![(&z * &z)?.sum(Axes::All, false)?])
    }
}

#[test]
fn gradients_match_finite_differences_and_composed() {
    on_cpu(gradients_match_finite_differences_and_composed_in_f64)
}

fn gradients_match_finite_differences_and_composed_in_f64() {
    // y broadcasts over the rows of x, so its gradient sums over them.
    let (xs, ys) = ([2, 3], [3]);
    let (xv, yv) = (data(6, 0.4), data(3, 1.1));
    let inputs = [arr64(&xv, &xs), arr64(&yv, &ys)];

    let (value, grads) = transforms::value_and_grad(squared_loss(axpby), &[0, 1])(&inputs).unwrap();
    assert_eq!(value[0].item::<f64>().unwrap(), loss_at(&xv, &xs, &yv, &ys));
    assert_eq!((grads[0].shape(), grads[1].shape()), (&xs[..], &ys[..]));
    assert_eq!((grads[0].dtype(), grads[1].dtype()), (Dtype::Float64, Dtype::Float64));
    let (gx, gy) = (grads[0].to_vec::<f64>().unwrap(), grads[1].to_vec::<f64>().unwrap());

    // Central differences in f64: the loss is quadratic, so the only error is rounding,
    // about 1e-16 * |loss| / h ~ 1e-11. Tolerance: 1e-6 relative.
    assert_close(&gx, &finite_difference(&xv, &xs, &yv, &ys, true), 1e-6, "d/dx vs finite differences");
    assert_close(&gy, &finite_difference(&xv, &xs, &yv, &ys, false), 1e-6, "d/dy vs finite differences");

    // Analytically: d/dx = 2 alpha z, d/dy = 2 beta sum_rows(z).
    let z = reference(&xv, &yv);
    let gx_exact: Vec<f64> = z.iter().map(|z| 2.0 * A as f64 * z).collect();
    let gy_exact: Vec<f64> = (0..3).map(|j| 2.0 * B as f64 * (z[j] + z[j + 3])).collect();
    assert_close(&gx, &gx_exact, 1e-12, "d/dx analytic");
    assert_close(&gy, &gy_exact, 1e-12, "d/dy analytic");

    // The composed version's gradient (MLX's own multiply/add rules).
    let (_, composed) = transforms::value_and_grad(squared_loss(axpby_composed), &[0, 1])(&inputs).unwrap();
    assert_close(&gx, &values(&composed[0]), 1e-12, "d/dx vs composed");
    assert_close(&gy, &values(&composed[1]), 1e-12, "d/dy vs composed");
}

#[test]
fn gradient_of_one_input_in_f32() {
    let x = arr32(&data(12, 0.2), &[3, 4]);
    let y = arr32(&data(12, 0.8), &[3, 4]);
    for argnum in [0usize, 1] {
        let f = |f: fn(&Array, &Array, f32, f32) -> Result<Array>| {
            move |a: &[Array]| -> Result<Array> { (f(&a[0], &a[1], A, B)?.sin()?).sum(Axes::All, false) }
        };
        let g = transforms::grad(f(axpby), &[argnum])(&[x.clone(), y.clone()]).unwrap();
        let gc = transforms::grad(f(axpby_composed), &[argnum])(&[x.clone(), y.clone()]).unwrap();
        assert_eq!(g.len(), 1);
        assert_eq!(g[0].dtype(), Dtype::Float32);
        // d/dx sum(sin(z)) = alpha cos(z) (beta for y).
        let scale = if argnum == 0 { A } else { B } as f64;
        let want: Vec<f64> = reference(&values(&x), &values(&y)).iter().map(|z| scale * z.cos()).collect();
        assert_close(&values(&g[0]), &want, 1e-5, "f32 grad vs analytic");
        assert_close(&values(&g[0]), &values(&gc[0]), 1e-6, "f32 grad vs composed");
    }
}

#[test]
fn jvp_matches_directional_derivative_and_composed() {
    on_cpu(jvp_matches_directional_derivative_and_composed_in_f64)
}

fn jvp_matches_directional_derivative_and_composed_in_f64() {
    let shape = [2, 5];
    let (xv, yv) = (data(10, 0.6), data(10, 1.9));
    let (tx, ty) = (data(10, 3.1), data(10, 4.7));
    // f(x, y) = axpby(x, y)^2, element-wise: its directional derivative is 2 z (alpha tx + beta ty).
    let sq = |f: fn(&Array, &Array, f32, f32) -> Result<Array>| {
        move |a: &[Array]| -> Result<Vec<Array>> {
            let z = f(&a[0], &a[1], A, B)?;
            Ok(vec![(&z * &z)?])
        }
    };
    let primals = [arr64(&xv, &shape), arr64(&yv, &shape)];
    let tangents = [arr64(&tx, &shape), arr64(&ty, &shape)];
    let (out, jv) = transforms::jvp(sq(axpby), &primals, &tangents).unwrap();
    assert_eq!(out[0].shape(), &shape);
    let jv = jv[0].to_vec::<f64>().unwrap();

    let h = 1e-5;
    let shifted = |s: f64| {
        let x: Vec<f64> = xv.iter().zip(&tx).map(|(x, t)| x + s * t).collect();
        let y: Vec<f64> = yv.iter().zip(&ty).map(|(y, t)| y + s * t).collect();
        values(&sq(axpby)(&[arr64(&x, &shape), arr64(&y, &shape)]).unwrap()[0])
    };
    let (plus, minus) = (shifted(h), shifted(-h));
    let fd: Vec<f64> = plus.iter().zip(&minus).map(|(p, m)| (p - m) / (2.0 * h)).collect();
    assert_close(&jv, &fd, 1e-6, "jvp vs finite differences");

    let z = reference(&xv, &yv);
    let exact: Vec<f64> = (0..10).map(|i| 2.0 * z[i] * (A as f64 * tx[i] + B as f64 * ty[i])).collect();
    assert_close(&jv, &exact, 1e-12, "jvp analytic");

    let (_, jc) = transforms::jvp(sq(axpby_composed), &primals, &tangents).unwrap();
    assert_close(&jv, &values(&jc[0]), 1e-12, "jvp vs composed");
}

#[test]
fn jvp_with_respect_to_one_input() {
    on_cpu(jvp_with_respect_to_one_input_in_f64)
}

fn jvp_with_respect_to_one_input_in_f64() {
    // With the other input a constant, the primitive's jvp sees a single argnum.
    let (x, y) = (arr64(&data(4, 0.1), &[4]), arr64(&data(4, 0.2), &[4]));
    let t = arr64(&[1.0, -2.0, 0.5, 4.0], &[4]);
    let (yc, xc) = (y.clone(), x.clone());
    let (_, dx) =
        transforms::jvp(|a: &[Array]| Ok(vec![axpby(&a[0], &yc, A, B)?]), &[x], std::slice::from_ref(&t)).unwrap();
    let (_, dy) = transforms::jvp(|a: &[Array]| Ok(vec![axpby(&xc, &a[0], A, B)?]), &[y], &[t]).unwrap();
    assert_eq!(dx[0].to_vec::<f64>().unwrap(), vec![1.5, -3.0, 0.75, 6.0]);
    assert_eq!(dy[0].to_vec::<f64>().unwrap(), vec![-0.75, 1.5, -0.375, -3.0]);
}

// -------------------------------------------------------------------------------------------------
// vmap

fn axpby_fn(a: &[Array]) -> Result<Vec<Array>> {
    Ok(vec![axpby(&a[0], &a[1], A, B)?])
}

#[test]
fn vmap_over_axis_0_and_axis_1() {
    // x: [4,3] mapped over axis 0; y: [3] shared by every slice.
    let x = arr32(&data(12, 0.3), &[4, 3]);
    let y = arr32(&data(3, 0.7), &[3]);
    let mapped = transforms::vmap(axpby_fn, &[Some(0), None], &[])(&[x.clone(), y.clone()]).unwrap();
    let rows: Vec<Array> =
        (0..4).map(|i| axpby(&x.slice_axis(0, i, i + 1, 1).unwrap().squeeze(0).unwrap(), &y, A, B).unwrap()).collect();
    let looped = ops::stack(&rows.iter().collect::<Vec<_>>(), 0).unwrap();
    assert_eq!(mapped[0].shape(), &[4, 3]);
    assert_eq!(mapped[0].to_vec::<f32>().unwrap(), looped.to_vec::<f32>().unwrap());

    // x: [3,5] mapped over axis 1, y: [5,3] mapped over axis 0; slice i is x[:, i] and y[i].
    let x = arr32(&data(15, 1.3), &[3, 5]);
    let y = arr32(&data(15, 2.1), &[5, 3]);
    let mapped = transforms::vmap(axpby_fn, &[Some(1), Some(0)], &[])(&[x.clone(), y.clone()]).unwrap();
    let slices: Vec<Array> = (0..5)
        .map(|i| {
            let xi = x.slice_axis(1, i, i + 1, 1).unwrap().squeeze(1).unwrap();
            let yi = y.slice_axis(0, i, i + 1, 1).unwrap().squeeze(0).unwrap();
            axpby(&xi, &yi, A, B).unwrap()
        })
        .collect();
    let looped = ops::stack(&slices.iter().collect::<Vec<_>>(), 0).unwrap();
    assert_eq!(mapped[0].shape(), &[5, 3]);
    assert_eq!(mapped[0].to_vec::<f32>().unwrap(), looped.to_vec::<f32>().unwrap());

    // Only y mapped (over axis 1), output axis 1: mapped[:, i] = axpby(x, y[:, i]).
    let x = arr32(&data(3, 0.9), &[3]);
    let y = arr32(&data(6, 1.4), &[3, 2]);
    let mapped = transforms::vmap(axpby_fn, &[None, Some(1)], &[1])(&[x.clone(), y.clone()]).unwrap();
    let cols: Vec<Array> =
        (0..2).map(|i| axpby(&x, &y.slice_axis(1, i, i + 1, 1).unwrap().squeeze(1).unwrap(), A, B).unwrap()).collect();
    let looped = ops::stack(&cols.iter().collect::<Vec<_>>(), 1).unwrap();
    assert_eq!(mapped[0].shape(), &[3, 2]);
    assert_eq!(mapped[0].to_vec::<f32>().unwrap(), looped.to_vec::<f32>().unwrap());
}

#[test]
fn grad_through_vmap() {
    // loss = sum(vmap(axpby)(x, y)): d/dx = alpha, d/dy = beta * (number of slices).
    let x = arr32(&data(8, 0.3), &[4, 2]);
    let y = arr32(&data(2, 0.7), &[2]);
    let g = transforms::grad(
        |a: &[Array]| transforms::vmap(axpby_fn, &[Some(0), None], &[])(a)?[0].sum(Axes::All, false),
        &[0, 1],
    )(&[x, y])
    .unwrap();
    assert_eq!(g[0].to_vec::<f32>().unwrap(), vec![A; 8]);
    assert_eq!(g[1].to_vec::<f32>().unwrap(), vec![4.0 * B; 2]);
}

// -------------------------------------------------------------------------------------------------
// compile

#[test]
fn compiled_equals_uncompiled() {
    // Three nodes, two of them equivalent: compile may merge those two but not the third.
    let f = |a: &[Array]| -> Result<Vec<Array>> {
        let p = axpby(&a[0], &a[1], A, B)?;
        let q = axpby(&a[0], &a[1], 2.0, 0.5)?;
        let r = axpby(&a[0], &a[1], A, B)?;
        Ok(vec![(&(&p * &q)? + &r)?, ops::stack(&[&p, &q, &r], 0)?])
    };
    let compiled = compile(f);
    for seed in [0.1, 0.2] {
        let inputs = [arr32(&data(12, seed), &[3, 4]), arr32(&data(4, seed + 1.0), &[4])];
        let want = f(&inputs).unwrap();
        let got = compiled.call(&inputs).unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.shape(), w.shape());
            if rmlx::default_device() == rmlx::Device::cpu() {
                assert_eq!(g.to_vec::<f32>().unwrap(), w.to_vec::<f32>().unwrap());
            } else {
                // MLX's fused GPU kernels contract `p * q + r` into an FMA: one rounding less.
                assert_close(&values(g), &values(w), 1e-6, "compiled vs uncompiled on the GPU");
            }
        }
        // The stacked slices really are the three different results.
        let (x, y) = (values(&inputs[0]), values(&inputs[1]));
        let q_want: Vec<f64> = x.iter().enumerate().map(|(i, x)| 2.0 * x + 0.5 * y[i % 4]).collect();
        assert_close(&values(&got[1])[12..24], &q_want, 1e-6, "compiled q");
        assert_close(&values(&got[1])[..12], &reference(&x, &y), 1e-6, "compiled p");
    }
    assert_eq!(compiled.trace_count(), 1);
}

// -------------------------------------------------------------------------------------------------
// GPU

#[test]
fn gpu_kernel_description() {
    let op = Axpby { alpha: A, beta: B };
    let spec = TensorSpec::new(&[3, 7], Dtype::Float32);
    for backend in [GpuBackend::Cuda, GpuBackend::Metal] {
        let (kernel, launch) =
            op.gpu_kernel(backend, &[spec.clone(), spec.clone()], std::slice::from_ref(&spec)).unwrap();
        assert_eq!(kernel.backend(), backend);
        assert_eq!((launch.grid, launch.threadgroup), ([21, 1, 1], [256, 1, 1]));
        assert_eq!(launch.outputs, vec![spec.clone()]);
        assert_eq!(launch.template, vec![("T".to_string(), TemplateArg::Dtype(Dtype::Float32))]);
        for half in [Dtype::Float16, Dtype::Bfloat16] {
            let h = TensorSpec::new(&[5], half);
            assert!(op.gpu_kernel(backend, &[h.clone(), h.clone()], &[h]).is_some());
        }
        // Scalars have no `x_shape` to read the size from: they run on the CPU.
        let s = TensorSpec::new(&[], Dtype::Float32);
        assert!(op.gpu_kernel(backend, &[s.clone(), s.clone()], &[s]).is_none());
        // float64 has no GPU kernel: it runs on the CPU.
        let d = TensorSpec::new(&[3, 7], Dtype::Float64);
        assert!(op.gpu_kernel(backend, &[d.clone(), d.clone()], &[d]).is_none());
    }
    // One kernel name per coefficient bit pattern (MLX caches compiled kernels by name).
    assert_eq!(op.kernel_name(), Axpby { alpha: A, beta: B }.kernel_name());
    assert_ne!(op.kernel_name(), Axpby { alpha: B, beta: A }.kernel_name());
    assert_ne!(Axpby { alpha: 0.0, beta: 1.0 }.kernel_name(), Axpby { alpha: -0.0, beta: 1.0 }.kernel_name());
    assert_ne!(
        Axpby { alpha: 0.1, beta: 1.0 }.kernel_name(),
        Axpby { alpha: 0.1 + f32::EPSILON, beta: 1.0 }.kernel_name()
    );
    assert!(op.is_equivalent(&Axpby { alpha: A, beta: B }));
    assert!(!op.is_equivalent(&Axpby { alpha: A, beta: 0.5 }));
}

/// Runs only where MLX has its CUDA backend; elsewhere it passes without checking anything.
#[test]
fn gpu_results_on_cuda() {
    if gpu_backend() != Some(GpuBackend::Cuda) {
        eprintln!("skipped: MLX has no CUDA backend here");
        return;
    }
    rmlx::with_device(rmlx::Device::gpu(), || {
        // 1000 elements: not a multiple of the 256-thread groups, so the tail guard matters.
        let (xv, yv) = (data(1000, 0.3), data(1000, 1.1));
        let (x, y) = (arr32(&xv, &[10, 100]), arr32(&yv, &[10, 100]));
        let want = reference(&values(&x), &values(&y));
        assert_close(&values(&axpby(&x, &y, A, B).unwrap()), &want, 1e-6, "gpu f32");
        // Other coefficients must not reuse the first kernel.
        let z2 = axpby(&x, &y, 0.1, 3.0).unwrap();
        let want2: Vec<f64> = values(&x).iter().zip(values(&y)).map(|(x, y)| 0.1f32 as f64 * x + 3.0 * y).collect();
        assert_close(&values(&z2), &want2, 1e-6, "gpu f32, other coefficients");
        // Broadcasting and a transposed input.
        let row = arr32(&yv[..100], &[100]);
        assert_close(
            &values(&axpby(&x, &row, A, B).unwrap()),
            &reference(&values(&x), &values(&row)),
            1e-6,
            "gpu broadcast",
        );
        let xt = x.transpose().unwrap();
        let yt = y.transpose().unwrap();
        let zt = axpby(&xt, &yt, A, B).unwrap();
        assert_close(&values(&zt), &values(&axpby_composed(&xt, &yt, A, B).unwrap()), 1e-6, "gpu transposed");
        // Half types.
        for (dtype, tol) in [(Dtype::Float16, 2e-3), (Dtype::Bfloat16, 1.6e-2)] {
            let (xh, yh) = (x.astype(dtype).unwrap(), y.astype(dtype).unwrap());
            let z = axpby(&xh, &yh, A, B).unwrap();
            assert_eq!(z.dtype(), dtype);
            assert_close(&values(&z), &reference(&values(&xh), &values(&yh)), tol, &format!("gpu {dtype}"));
        }
        // A float64 node has no GPU kernel: with the GPU as the current device it runs on the CPU.
        // (`axpby` itself cannot be used here: its broadcasting ops would run on the GPU, which has
        // no float64.)
        let (x64, y64) = (arr64(&xv, &[1000]), arr64(&yv, &[1000]));
        let z64 = rmlx::custom::apply(Axpby { alpha: A, beta: B }, &[x64, y64]).unwrap().remove(0);
        assert_eq!(z64.to_vec::<f64>().unwrap(), reference(&xv, &yv));
        // Transforms and compile on the GPU.
        let g = transforms::grad(|a: &[Array]| axpby(&a[0], &a[1], A, B)?.sum(Axes::All, false), &[0, 1])(&[
            x.clone(),
            y.clone(),
        ])
        .unwrap();
        assert_eq!(g[0].to_vec::<f32>().unwrap(), vec![A; 1000]);
        assert_eq!(g[1].to_vec::<f32>().unwrap(), vec![B; 1000]);
        let compiled = compile(axpby_fn);
        assert_close(&values(&compiled.call(&[x.clone(), y.clone()]).unwrap()[0]), &want, 1e-6, "gpu compiled");
    });
}
