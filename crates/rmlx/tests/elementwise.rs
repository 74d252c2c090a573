#![allow(clippy::excessive_precision, clippy::approx_constant, clippy::bool_assert_comparison)]
//! Integration tests of the element-wise ops: unary math, binary arithmetic, comparisons, logic,
//! bitwise ops, products, rounding, `where`, `clip`, `isclose`, `array_equal` and activations.
//!
//! Exact results are compared exactly. Transcendental results are compared with values computed in
//! Rust from `f64` std math, with a relative tolerance of `RTOL` (plus `ATOL` near zero), unless a
//! test states another.

use rmlx::ops;
use rmlx::{Array, Complex32, Dtype, Error, Result};

/// Relative tolerance for float32 results of transcendental functions.
const RTOL: f64 = 2e-6;
/// Absolute tolerance for results near zero.
const ATOL: f64 = 1e-6;

fn f32s(v: &[f32]) -> Result<Array> {
    Array::from_slice(v, &[v.len() as i32])
}

fn i32s(v: &[i32]) -> Result<Array> {
    Array::from_slice(v, &[v.len() as i32])
}

fn bools(v: &[bool]) -> Result<Array> {
    Array::from_slice(v, &[v.len() as i32])
}

fn assert_close_tol(actual: &[f32], expected: &[f64], rtol: f64, atol: f64, what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: length");
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let a = a as f64;
        if e.is_nan() {
            assert!(a.is_nan(), "{what}[{i}]: got {a}, expected NaN");
        } else if e.is_infinite() {
            assert_eq!(a, e, "{what}[{i}]");
        } else {
            assert!(
                (a - e).abs() <= atol + rtol * e.abs(),
                "{what}[{i}]: got {a}, expected {e} (diff {:e})",
                (a - e).abs()
            );
        }
    }
}

fn assert_close(actual: &[f32], expected: &[f64], what: &str) {
    assert_close_tol(actual, expected, RTOL, ATOL, what);
}

/// Checks a float32 unary op against `f` applied in f64.
fn check_unary(op: fn(&Array) -> Result<Array>, x: &[f32], f: impl Fn(f64) -> f64, what: &str) -> Result<()> {
    check_unary_tol(op, x, f, RTOL, ATOL, what)
}

fn check_unary_tol(
    op: fn(&Array) -> Result<Array>,
    x: &[f32],
    f: impl Fn(f64) -> f64,
    rtol: f64,
    atol: f64,
    what: &str,
) -> Result<()> {
    let out = op(&f32s(x)?)?;
    assert_eq!(out.dtype(), Dtype::Float32, "{what}: dtype");
    assert_eq!(out.shape(), &[x.len() as i32], "{what}: shape");
    let expected: Vec<f64> = x.iter().map(|&v| f(v as f64)).collect();
    assert_close_tol(&out.to_vec::<f32>()?, &expected, rtol, atol, what);
    Ok(())
}

/// The error function in f64 (Maclaurin series, accurate to ~1e-15 for |x| <= 3).
fn erf(x: f64) -> f64 {
    let mut term = x;
    let mut sum = x;
    let x2 = x * x;
    for n in 1..200 {
        term *= -x2 / n as f64;
        let add = term / (2 * n + 1) as f64;
        sum += add;
        if add.abs() < 1e-17 * sum.abs() {
            break;
        }
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

// ---- unary ops ------------------------------------------------------------------------------------

#[test]
fn abs_negative_sign_exact() -> Result<()> {
    let x = f32s(&[-2.5, 0.0, 3.0, -0.0, f32::NEG_INFINITY])?;
    assert_eq!(ops::abs(&x)?.to_vec::<f32>()?, vec![2.5, 0.0, 3.0, 0.0, f32::INFINITY]);
    assert_eq!(x.abs()?.to_vec::<f32>()?, vec![2.5, 0.0, 3.0, 0.0, f32::INFINITY]);
    assert_eq!(ops::negative(&x)?.to_vec::<f32>()?, vec![2.5, -0.0, -3.0, 0.0, f32::INFINITY]);
    assert_eq!(ops::sign(&f32s(&[-2.5, 0.0, 7.0])?)?.to_vec::<f32>()?, vec![-1.0, 0.0, 1.0]);

    let i = i32s(&[-3, 0, 4, i32::MIN + 1])?;
    let a = ops::abs(&i)?;
    assert_eq!(a.dtype(), Dtype::Int32);
    assert_eq!(a.to_vec::<i32>()?, vec![3, 0, 4, i32::MAX]);
    assert_eq!(i.negative()?.to_vec::<i32>()?, vec![3, 0, -4, i32::MAX]);
    assert_eq!(ops::sign(&i)?.to_vec::<i32>()?, vec![-1, 0, 1, -1]);
    let u = Array::from_slice(&[0u8, 5], &[2])?;
    assert_eq!(ops::sign(&u)?.to_vec::<u8>()?, vec![0, 1]);
    assert_eq!(ops::abs(&u)?.to_vec::<u8>()?, vec![0, 5]);
    Ok(())
}

#[test]
fn square_reciprocal_sqrt_rsqrt() -> Result<()> {
    assert_eq!(ops::square(&f32s(&[-3.0, 0.5, 0.0])?)?.to_vec::<f32>()?, vec![9.0, 0.25, 0.0]);
    assert_eq!(ops::square(&i32s(&[-3, 4])?)?.to_vec::<i32>()?, vec![9, 16]);
    assert_eq!(ops::sqrt(&f32s(&[4.0, 9.0, 0.0, 0.25])?)?.to_vec::<f32>()?, vec![2.0, 3.0, 0.0, 0.5]);
    assert!(ops::sqrt(&f32s(&[-1.0])?)?.item::<f32>()?.is_nan());
    assert_eq!(ops::reciprocal(&f32s(&[2.0, -0.25, 0.0])?)?.to_vec::<f32>()?, vec![0.5, -4.0, f32::INFINITY]);
    check_unary(ops::sqrt, &[2.0, 3.0, 1e-3, 12345.0], f64::sqrt, "sqrt")?;
    check_unary(ops::rsqrt, &[4.0, 2.0, 3.0, 1e-3, 12345.0], |v| 1.0 / v.sqrt(), "rsqrt")?;
    check_unary(ops::reciprocal, &[3.0, -7.0, 1e-3], |v| 1.0 / v, "reciprocal")?;
    Ok(())
}

#[test]
fn exp_and_logs() -> Result<()> {
    let x = [-3.0f32, -0.5, 0.0, 0.5, 1.0, 10.0];
    check_unary(ops::exp, &x, f64::exp, "exp")?;
    check_unary(ops::expm1, &[-1.0, -1e-5, 1e-7, 1e-3, 2.0], f64::exp_m1, "expm1")?;
    let p = [1e-3f32, 0.5, 1.0, 2.0, 10.0, 1e6];
    check_unary(ops::log, &p, f64::ln, "log")?;
    check_unary(ops::log2, &p, f64::log2, "log2")?;
    check_unary(ops::log10, &p, f64::log10, "log10")?;
    check_unary(ops::log1p, &[-0.5, -1e-7, 1e-7, 1e-3, 3.0], f64::ln_1p, "log1p")?;
    // Exact special values.
    assert_eq!(ops::exp(&f32s(&[0.0, f32::NEG_INFINITY])?)?.to_vec::<f32>()?, vec![1.0, 0.0]);
    assert_eq!(ops::log(&f32s(&[1.0, 0.0])?)?.to_vec::<f32>()?, vec![0.0, f32::NEG_INFINITY]);
    assert!(ops::log(&f32s(&[-1.0])?)?.item::<f32>()?.is_nan());
    assert_eq!(ops::log2(&f32s(&[8.0, 0.5])?)?.to_vec::<f32>()?, vec![3.0, -1.0]);
    assert_eq!(ops::log10(&f32s(&[1000.0, 1.0])?)?.to_vec::<f32>()?, vec![3.0, 0.0]);
    // Integer input gives float32.
    let e = ops::exp(&i32s(&[0, 1])?)?;
    assert_eq!(e.dtype(), Dtype::Float32);
    assert_close(&e.to_vec::<f32>()?, &[1.0, std::f64::consts::E], "exp(int)");
    Ok(())
}

#[test]
fn trigonometric() -> Result<()> {
    let x = [-2.0f32, -0.5, 0.0, 0.3, 1.0, 3.0];
    check_unary(ops::sin, &x, f64::sin, "sin")?;
    check_unary(ops::cos, &x, f64::cos, "cos")?;
    check_unary(ops::tan, &[-1.2, -0.5, 0.0, 0.3, 1.0], f64::tan, "tan")?;
    let u = [-1.0f32, -0.7, 0.0, 0.25, 0.9, 1.0];
    check_unary(ops::arcsin, &u, f64::asin, "arcsin")?;
    check_unary(ops::arccos, &u, f64::acos, "arccos")?;
    check_unary(ops::arctan, &[-100.0, -1.0, 0.0, 0.5, 3.0], f64::atan, "arctan")?;
    assert!(ops::arcsin(&f32s(&[1.5])?)?.item::<f32>()?.is_nan());
    Ok(())
}

#[test]
fn hyperbolic() -> Result<()> {
    let x = [-3.0f32, -0.5, 0.0, 0.25, 1.0, 5.0];
    check_unary(ops::sinh, &x, f64::sinh, "sinh")?;
    check_unary(ops::cosh, &x, f64::cosh, "cosh")?;
    check_unary(ops::tanh, &x, f64::tanh, "tanh")?;
    check_unary(ops::arcsinh, &[-10.0, -0.5, 0.0, 0.25, 3.0], f64::asinh, "arcsinh")?;
    check_unary(ops::arccosh, &[1.0, 1.5, 2.0, 10.0], f64::acosh, "arccosh")?;
    check_unary(ops::arctanh, &[-0.9, -0.5, 0.0, 0.25, 0.75], f64::atanh, "arctanh")?;
    assert_eq!(ops::tanh(&f32s(&[100.0, -100.0])?)?.to_vec::<f32>()?, vec![1.0, -1.0]);
    assert_eq!(ops::arctanh(&f32s(&[1.0])?)?.item::<f32>()?, f32::INFINITY);
    Ok(())
}

#[test]
fn sigmoid_erf_erfinv() -> Result<()> {
    check_unary(ops::sigmoid, &[-20.0, -2.0, 0.0, 0.5, 3.0, 20.0], sigmoid, "sigmoid")?;
    assert_eq!(ops::sigmoid(&f32s(&[0.0])?)?.item::<f32>()?, 0.5);
    check_unary(ops::erf, &[-2.5, -1.0, -0.1, 0.0, 0.3, 1.0, 2.0], erf, "erf")?;
    // erfinv against known values, and erf(erfinv(y)) = y.
    let y = [-0.9f32, -0.5, 0.0, 0.25, 0.5, 0.99];
    let inv = ops::erfinv(&f32s(&y)?)?.to_vec::<f32>()?;
    let known =
        [-1.1630871536766741, -0.4769362762044699, 0.0, 0.2253120550121781, 0.4769362762044699, 1.8213863677184496];
    assert_close_tol(&inv, &known, 1e-5, 1e-6, "erfinv");
    let back: Vec<f32> = inv.iter().map(|&v| erf(v as f64) as f32).collect();
    assert_close_tol(&back, &y.map(|v| v as f64), 1e-5, 1e-6, "erf(erfinv)");
    assert_eq!(ops::erfinv(&f32s(&[1.0, -1.0])?)?.to_vec::<f32>()?, vec![f32::INFINITY, f32::NEG_INFINITY]);
    Ok(())
}

#[test]
fn floor_ceil_exact() -> Result<()> {
    let x = f32s(&[-1.5, -0.5, 0.0, 0.5, 1.5, 2.0, -2.0])?;
    assert_eq!(ops::floor(&x)?.to_vec::<f32>()?, vec![-2.0, -1.0, 0.0, 0.0, 1.0, 2.0, -2.0]);
    assert_eq!(ops::ceil(&x)?.to_vec::<f32>()?, vec![-1.0, -0.0, 0.0, 1.0, 2.0, 2.0, -2.0]);
    // Integer inputs are unchanged.
    let i = i32s(&[-3, 5])?;
    assert_eq!(ops::floor(&i)?.to_vec::<i32>()?, vec![-3, 5]);
    assert_eq!(ops::ceil(&i)?.to_vec::<i32>()?, vec![-3, 5]);
    Ok(())
}

#[test]
fn degrees_radians() -> Result<()> {
    use std::f64::consts::PI;
    check_unary(ops::degrees, &[0.0, 1.0, -0.5, PI as f32], |v| v * 180.0 / PI, "degrees")?;
    check_unary(ops::radians, &[0.0, 90.0, -45.0, 180.0], |v| v * PI / 180.0, "radians")?;
    Ok(())
}

#[test]
fn logical_not_and_bitwise_invert() -> Result<()> {
    assert_eq!(ops::logical_not(&bools(&[true, false])?)?.to_vec::<bool>()?, vec![false, true]);
    let n = ops::logical_not(&f32s(&[0.0, 2.0, -1.0])?)?;
    assert_eq!(n.dtype(), Dtype::Bool);
    assert_eq!(n.to_vec::<bool>()?, vec![true, false, false]);
    assert_eq!(ops::bitwise_invert(&i32s(&[0, 5, -1])?)?.to_vec::<i32>()?, vec![-1, -6, 0]);
    let u = Array::from_slice(&[0u8, 0x0f, 255], &[3])?;
    assert_eq!(ops::bitwise_invert(&u)?.to_vec::<u8>()?, vec![255, 0xf0, 0]);
    assert!(ops::bitwise_invert(&f32s(&[1.0])?).is_err());
    Ok(())
}

#[test]
fn isnan_isinf_isfinite() -> Result<()> {
    let x = f32s(&[1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -f32::MAX])?;
    assert_eq!(ops::isnan(&x)?.to_vec::<bool>()?, vec![false, true, false, false, false, false]);
    assert_eq!(ops::isinf(&x)?.to_vec::<bool>()?, vec![false, false, true, true, false, false]);
    assert_eq!(ops::isfinite(&x)?.to_vec::<bool>()?, vec![true, false, false, false, true, true]);
    assert_eq!(ops::isnan(&x)?.dtype(), Dtype::Bool);
    let i = i32s(&[1, 2])?;
    assert_eq!(ops::isnan(&i)?.to_vec::<bool>()?, vec![false, false]);
    assert_eq!(ops::isinf(&i)?.to_vec::<bool>()?, vec![false, false]);
    assert_eq!(ops::isfinite(&i)?.to_vec::<bool>()?, vec![true, true]);
    Ok(())
}

#[test]
fn stop_gradient_is_identity() -> Result<()> {
    let x = f32s(&[1.5, -2.0])?;
    assert_eq!(ops::stop_gradient(&x)?.to_vec::<f32>()?, vec![1.5, -2.0]);
    Ok(())
}

#[test]
fn complex_parts() -> Result<()> {
    let z = Array::from_slice(&[Complex32::new(1.0, -2.0), Complex32::new(-3.5, 0.5)], &[2])?;
    let re = ops::real(&z)?;
    assert_eq!(re.dtype(), Dtype::Float32);
    assert_eq!(re.to_vec::<f32>()?, vec![1.0, -3.5]);
    assert_eq!(ops::imag(&z)?.to_vec::<f32>()?, vec![-2.0, 0.5]);
    assert_eq!(ops::conjugate(&z)?.to_vec::<Complex32>()?, vec![Complex32::new(1.0, 2.0), Complex32::new(-3.5, -0.5)]);
    let p = ops::multiply(&z, &z)?; // (1-2i)^2 = -3-4i ; (-3.5+0.5i)^2 = 12-3.5i
    assert_eq!(p.to_vec::<Complex32>()?, vec![Complex32::new(-3.0, -4.0), Complex32::new(12.0, -3.5)]);
    assert_eq!(ops::abs(&z)?.to_vec::<f32>()?[0], 5.0f32.sqrt());
    Ok(())
}

// ---- binary arithmetic ----------------------------------------------------------------------------

#[test]
fn add_subtract_multiply_divide() -> Result<()> {
    let a = f32s(&[1.5, -2.0, 8.0])?;
    let b = f32s(&[0.5, 4.0, -0.25])?;
    assert_eq!(ops::add(&a, &b)?.to_vec::<f32>()?, vec![2.0, 2.0, 7.75]);
    assert_eq!(ops::subtract(&a, &b)?.to_vec::<f32>()?, vec![1.0, -6.0, 8.25]);
    assert_eq!(ops::multiply(&a, &b)?.to_vec::<f32>()?, vec![0.75, -8.0, -2.0]);
    assert_eq!(ops::divide(&a, &b)?.to_vec::<f32>()?, vec![3.0, -0.5, -32.0]);
    assert_eq!(a.add(&b)?.to_vec::<f32>()?, vec![2.0, 2.0, 7.75]);
    let d = ops::divide(&i32s(&[7, -7, 1])?, &i32s(&[2, 2, 0])?)?;
    assert_eq!(d.dtype(), Dtype::Float32);
    assert_eq!(d.to_vec::<f32>()?, vec![3.5, -3.5, f32::INFINITY]);
    // Type promotion: int32 + float32 -> float32, uint8 + int8 -> int16.
    let p = ops::add(&i32s(&[1])?, &f32s(&[0.5])?)?;
    assert_eq!((p.dtype(), p.item::<f32>()?), (Dtype::Float32, 1.5));
    let q = ops::add(&Array::from_slice(&[200u8], &[1])?, &Array::from_slice(&[-100i8], &[1])?)?;
    assert_eq!((q.dtype(), q.item::<i16>()?), (Dtype::Int16, 100));
    Ok(())
}

#[test]
fn floor_divide_python_semantics() -> Result<()> {
    let a = i32s(&[7, -7, 7, -7, 6, 0])?;
    let b = i32s(&[2, 2, -2, -2, 3, 5])?;
    let q = ops::floor_divide(&a, &b)?;
    assert_eq!(q.dtype(), Dtype::Int32);
    assert_eq!(q.to_vec::<i32>()?, vec![3, -4, -4, 3, 2, 0]);
    let f = ops::floor_divide(&f32s(&[7.5, -7.5, 7.5, 1.0])?, &f32s(&[2.0, 2.0, -2.0, 0.5])?)?;
    assert_eq!(f.dtype(), Dtype::Float32);
    assert_eq!(f.to_vec::<f32>()?, vec![3.0, -4.0, -4.0, 2.0]);
    Ok(())
}

#[test]
fn remainder_python_semantics() -> Result<()> {
    let a = i32s(&[7, -7, 7, -7, 6, 0])?;
    let b = i32s(&[3, 3, -3, -3, 3, 5])?;
    assert_eq!(ops::remainder(&a, &b)?.to_vec::<i32>()?, vec![1, 2, -2, -1, 0, 0]);
    // Python: 5.5 % 2 = 1.5, -5.5 % 2 = 0.5, 5.5 % -2 = -0.5, -5.5 % -2 = -1.5
    let f = ops::remainder(&f32s(&[5.5, -5.5, 5.5, -5.5])?, &f32s(&[2.0, 2.0, -2.0, -2.0])?)?;
    assert_eq!(f.to_vec::<f32>()?, vec![1.5, 0.5, -0.5, -1.5]);
    // a == floor_divide(a, b) * b + remainder(a, b)
    let q = ops::floor_divide(&a, &b)?;
    let r = ops::remainder(&a, &b)?;
    assert_eq!(ops::add(&ops::multiply(&q, &b)?, &r)?.to_vec::<i32>()?, vec![7, -7, 7, -7, 6, 0]);
    Ok(())
}

#[test]
fn power() -> Result<()> {
    let p = ops::power(&i32s(&[2, 3, -2, 5, 1])?, &i32s(&[3, 2, 3, 0, 100])?)?;
    assert_eq!(p.dtype(), Dtype::Int32);
    assert_eq!(p.to_vec::<i32>()?, vec![8, 9, -8, 1, 1]);
    let f = ops::power(&f32s(&[2.0, 4.0, 9.0, 0.0, 10.0])?, &f32s(&[0.5, -1.0, 0.5, 0.0, 3.0])?)?;
    assert_close(&f.to_vec::<f32>()?, &[2f64.sqrt(), 0.25, 3.0, 1.0, 1000.0], "power");
    assert!(ops::power(&f32s(&[-8.0])?, &f32s(&[1.0 / 3.0])?)?.item::<f32>()?.is_nan());
    Ok(())
}

#[test]
fn maximum_minimum() -> Result<()> {
    let a = f32s(&[1.0, 5.0, -2.0, f32::NAN, 0.0])?;
    let b = f32s(&[2.0, 3.0, -2.0, 0.0, f32::NAN])?;
    let mx = ops::maximum(&a, &b)?.to_vec::<f32>()?;
    let mn = ops::minimum(&a, &b)?.to_vec::<f32>()?;
    assert_eq!(&mx[..3], &[2.0, 5.0, -2.0]);
    assert_eq!(&mn[..3], &[1.0, 3.0, -2.0]);
    // NaN propagates from either side.
    assert!(mx[3].is_nan() && mx[4].is_nan());
    assert!(mn[3].is_nan() && mn[4].is_nan());
    let i = ops::maximum(&i32s(&[1, -5])?, &Array::scalar(0i32))?;
    assert_eq!(i.to_vec::<i32>()?, vec![1, 0]);
    assert_eq!(ops::minimum(&i32s(&[1, -5])?, &Array::scalar(0i32))?.to_vec::<i32>()?, vec![0, -5]);
    Ok(())
}

#[test]
fn comparisons() -> Result<()> {
    let a = f32s(&[1.0, 2.0, 3.0, f32::NAN])?;
    let b = f32s(&[2.0, 2.0, 2.0, f32::NAN])?;
    let cmp = |f: fn(&Array, &Array) -> Result<Array>| -> Result<Vec<bool>> {
        let r = f(&a, &b)?;
        assert_eq!(r.dtype(), Dtype::Bool);
        r.to_vec::<bool>()
    };
    assert_eq!(cmp(ops::equal)?, vec![false, true, false, false]);
    assert_eq!(cmp(ops::not_equal)?, vec![true, false, true, true]);
    assert_eq!(cmp(ops::less)?, vec![true, false, false, false]);
    assert_eq!(cmp(ops::less_equal)?, vec![true, true, false, false]);
    assert_eq!(cmp(ops::greater)?, vec![false, false, true, false]);
    assert_eq!(cmp(ops::greater_equal)?, vec![false, true, true, false]);
    // Mixed dtypes and broadcasting.
    let i = Array::from_slice(&[1i32, 2, 3, 4], &[2, 2])?;
    let r = ops::greater(&i, &Array::scalar(2.5f32))?;
    assert_eq!(r.shape(), &[2, 2]);
    assert_eq!(r.to_vec::<bool>()?, vec![false, false, true, true]);
    Ok(())
}

#[test]
fn logical_and_or() -> Result<()> {
    let a = bools(&[true, true, false, false])?;
    let b = bools(&[true, false, true, false])?;
    assert_eq!(ops::logical_and(&a, &b)?.to_vec::<bool>()?, vec![true, false, false, false]);
    assert_eq!(ops::logical_or(&a, &b)?.to_vec::<bool>()?, vec![true, true, true, false]);
    // Non-bool inputs are truthy when non-zero.
    let n = ops::logical_and(&f32s(&[0.0, 2.0])?, &i32s(&[1, -1])?)?;
    assert_eq!(n.dtype(), Dtype::Bool);
    assert_eq!(n.to_vec::<bool>()?, vec![false, true]);
    Ok(())
}

#[test]
fn bitwise_ops() -> Result<()> {
    let a = i32s(&[0b1100, 0b1010, -1, 0])?;
    let b = i32s(&[0b1010, 0b0110, 0x0f, 0])?;
    assert_eq!(ops::bitwise_and(&a, &b)?.to_vec::<i32>()?, vec![0b1000, 0b0010, 0x0f, 0]);
    assert_eq!(ops::bitwise_or(&a, &b)?.to_vec::<i32>()?, vec![0b1110, 0b1110, -1, 0]);
    assert_eq!(ops::bitwise_xor(&a, &b)?.to_vec::<i32>()?, vec![0b0110, 0b1100, -16, 0]);
    let u = Array::from_slice(&[0xf0u8, 0xff], &[2])?;
    let v = Array::from_slice(&[0x3cu8, 0x0f], &[2])?;
    assert_eq!(ops::bitwise_xor(&u, &v)?.to_vec::<u8>()?, vec![0xcc, 0xf0]);
    let t = ops::bitwise_and(&bools(&[true, true])?, &bools(&[true, false])?)?;
    assert_eq!(t.to_vec::<bool>()?, vec![true, false]);
    assert!(ops::bitwise_and(&f32s(&[1.0])?, &f32s(&[1.0])?).is_err());
    Ok(())
}

#[test]
fn shifts() -> Result<()> {
    assert_eq!(ops::left_shift(&i32s(&[1, 3, -1])?, &i32s(&[2, 4, 1])?)?.to_vec::<i32>()?, vec![4, 48, -2]);
    // Right shift of a signed integer is arithmetic.
    assert_eq!(ops::right_shift(&i32s(&[16, 7, -8])?, &i32s(&[2, 1, 1])?)?.to_vec::<i32>()?, vec![4, 3, -4]);
    let u = Array::from_slice(&[200u8, 1], &[2])?;
    let s = Array::from_slice(&[1u8, 7], &[2])?;
    let l = ops::left_shift(&u, &s)?;
    assert_eq!(l.dtype(), Dtype::Uint8);
    assert_eq!(l.to_vec::<u8>()?, vec![144, 128]); // wraps in 8 bits
    assert_eq!(ops::right_shift(&u, &s)?.to_vec::<u8>()?, vec![100, 0]);
    let w = Array::from_slice(&[u32::MAX], &[1])?;
    assert_eq!(ops::right_shift(&w, &Array::scalar(28u32))?.to_vec::<u32>()?, vec![15]);
    Ok(())
}

#[test]
fn arctan2_quadrants() -> Result<()> {
    let y = [1.0f32, 1.0, -1.0, -1.0, 0.0, 2.0, 0.0];
    let x = [1.0f32, -1.0, -1.0, 1.0, -1.0, 0.0, 1.0];
    let out = ops::arctan2(&f32s(&y)?, &f32s(&x)?)?.to_vec::<f32>()?;
    let expected: Vec<f64> = y.iter().zip(&x).map(|(&a, &b)| (a as f64).atan2(b as f64)).collect();
    assert_close(&out, &expected, "arctan2");
    assert_close(&out[..2], &[std::f64::consts::FRAC_PI_4, 3.0 * std::f64::consts::FRAC_PI_4], "arctan2 known");
    Ok(())
}

#[test]
fn logaddexp() -> Result<()> {
    let a = [0.0f32, 1.0, 100.0, -100.0, 1000.0, f32::NEG_INFINITY];
    let b = [0.0f32, 2.0, 100.0, 50.0, 1000.0, 3.0];
    let out = ops::logaddexp(&f32s(&a)?, &f32s(&b)?)?.to_vec::<f32>()?;
    let expected: Vec<f64> = a
        .iter()
        .zip(&b)
        .map(|(&x, &y)| {
            let (x, y) = (x as f64, y as f64);
            let m = x.max(y);
            m + ((x - m).exp() + (y - m).exp()).ln()
        })
        .collect();
    assert_close(&out, &expected, "logaddexp");
    assert_close(&out[..1], &[std::f64::consts::LN_2], "logaddexp(0,0)");
    assert!(out[4].is_finite(), "stable for large inputs");
    Ok(())
}

// ---- products -------------------------------------------------------------------------------------

#[test]
fn matmul_2d_batched_and_vectors() -> Result<()> {
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    let b = Array::from_slice(&[7.0f32, 8.0, 9.0, 10.0, 11.0, 12.0], &[3, 2])?;
    let c = ops::matmul(&a, &b)?;
    assert_eq!(c.shape(), &[2, 2]);
    assert_eq!(c.to_vec::<f32>()?, vec![58.0, 64.0, 139.0, 154.0]);
    assert_eq!(a.matmul(&b)?.to_vec::<f32>()?, vec![58.0, 64.0, 139.0, 154.0]);
    // Matrix @ vector and vector @ matrix drop the promoted axis.
    let v = f32s(&[1.0, 0.0, -1.0])?;
    let av = ops::matmul(&a, &v)?;
    assert_eq!(av.shape(), &[2]);
    assert_eq!(av.to_vec::<f32>()?, vec![-2.0, -2.0]);
    let w = f32s(&[1.0, 1.0])?;
    let wa = ops::matmul(&w, &a)?;
    assert_eq!(wa.shape(), &[3]);
    assert_eq!(wa.to_vec::<f32>()?, vec![5.0, 7.0, 9.0]);
    // Batched with broadcasting of the batch axis.
    let batch = Array::from_slice(&[1.0f32, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 2.0], &[2, 2, 2])?;
    let m = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
    let bm = ops::matmul(&batch, &m)?;
    assert_eq!(bm.shape(), &[2, 2, 2]);
    assert_eq!(bm.to_vec::<f32>()?, vec![1.0, 2.0, 3.0, 4.0, 2.0, 4.0, 6.0, 8.0]);
    // Transposed (non-contiguous) operand.
    let at = a.transpose()?; // [3, 2]
    assert_eq!(ops::matmul(&at, &a)?.to_vec::<f32>()?, vec![17.0, 22.0, 27.0, 22.0, 29.0, 36.0, 27.0, 36.0, 45.0]);
    // Inner dimensions that disagree are an error.
    assert!(matches!(ops::matmul(&a, &a), Err(Error::Mlx(_))));
    Ok(())
}

#[test]
fn outer_and_inner() -> Result<()> {
    let a = f32s(&[1.0, 2.0, 3.0])?;
    let b = f32s(&[10.0, -1.0])?;
    let o = ops::outer(&a, &b)?;
    assert_eq!(o.shape(), &[3, 2]);
    assert_eq!(o.to_vec::<f32>()?, vec![10.0, -1.0, 20.0, -2.0, 30.0, -3.0]);
    // Outer flattens its inputs.
    let o2 = ops::outer(&Array::from_slice(&[1i32, 2, 3, 4], &[2, 2])?, &i32s(&[1, 10])?)?;
    assert_eq!(o2.shape(), &[4, 2]);
    assert_eq!(o2.to_vec::<i32>()?, vec![1, 10, 2, 20, 3, 30, 4, 40]);
    let c = f32s(&[4.0, 5.0, 6.0])?;
    let i = ops::inner(&a, &c)?;
    assert_eq!(i.ndim(), 0);
    assert_eq!(i.item::<f32>()?, 32.0);
    // Inner of matrices contracts the last axes: a @ b.T.
    let m = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
    let n = Array::from_slice(&[1.0f32, 0.0, 1.0, 1.0, 0.0, 2.0], &[3, 2])?;
    let mi = ops::inner(&m, &n)?;
    assert_eq!(mi.shape(), &[2, 3]);
    assert_eq!(mi.to_vec::<f32>()?, vec![1.0, 3.0, 4.0, 3.0, 7.0, 8.0]);
    Ok(())
}

// ---- rounding, where, clip ------------------------------------------------------------------------

#[test]
fn round_half_to_even_and_decimals() -> Result<()> {
    let x = f32s(&[0.5, 1.5, 2.5, -0.5, -1.5, 2.4, -2.6])?;
    assert_eq!(ops::round(&x, 0)?.to_vec::<f32>()?, vec![0.0, 2.0, 2.0, -0.0, -2.0, 2.0, -3.0]);
    assert_eq!(x.round(0)?.to_vec::<f32>()?, vec![0.0, 2.0, 2.0, -0.0, -2.0, 2.0, -3.0]);
    let d = ops::round(&f32s(&[1.2345, -3.14159, 0.125, 9.999])?, 2)?.to_vec::<f32>()?;
    // MLX computes round(x * 100) * (1 / 100) in float32 (it multiplies by the reciprocal scale
    // rather than dividing, so -314 * 0.01f32 = -3.1399999, one ulp from NumPy's -3.14).
    // 0.125 * 100 = 12.5 rounds half to even -> 12.
    let expected: Vec<f32> = [123.0f32, -314.0, 12.0, 1000.0].iter().map(|k| k * (1.0f32 / 100.0)).collect();
    assert_eq!(d, expected);
    assert_eq!(d[0], 1.23f32);
    assert!((d[1] - -3.14f32).abs() <= f32::EPSILON * 4.0);
    let n = ops::round(&f32s(&[1234.5, -1250.0, 49.0])?, -2)?.to_vec::<f32>()?;
    assert_eq!(n, vec![1200.0, -1200.0, 0.0]);
    // Integers are unchanged.
    assert_eq!(ops::round(&i32s(&[3, -7])?, 0)?.to_vec::<i32>()?, vec![3, -7]);
    Ok(())
}

#[test]
fn where_broadcasts_all_three() -> Result<()> {
    let c = Array::from_slice(&[true, false, false, true], &[2, 2])?;
    let x = Array::from_slice(&[1.0f32, 2.0], &[2])?;
    let y = Array::scalar(-1.0f32);
    let w = ops::r#where(&c, &x, &y)?;
    assert_eq!(w.shape(), &[2, 2]);
    assert_eq!(w.to_vec::<f32>()?, vec![1.0, -1.0, -1.0, 2.0]);
    // A numeric condition is truthy when non-zero; dtypes promote.
    let cond = i32s(&[0, 3, -1])?;
    let r = ops::r#where(&cond, &i32s(&[1, 2, 3])?, &Array::scalar(0.5f32))?;
    assert_eq!(r.dtype(), Dtype::Float32);
    assert_eq!(r.to_vec::<f32>()?, vec![0.5, 2.0, 3.0]);
    assert!(ops::r#where(&bools(&[true, false])?, &f32s(&[1.0, 2.0, 3.0])?, &y).is_err());
    Ok(())
}

#[test]
fn clip_with_one_or_both_bounds() -> Result<()> {
    let x = f32s(&[-3.0, -1.0, 0.5, 2.0, 5.0])?;
    let lo = Array::scalar(-1.5f32);
    let hi = Array::scalar(2.5f32);
    assert_eq!(ops::clip(&x, Some(&lo), Some(&hi))?.to_vec::<f32>()?, vec![-1.5, -1.0, 0.5, 2.0, 2.5]);
    assert_eq!(ops::clip(&x, Some(&lo), None)?.to_vec::<f32>()?, vec![-1.5, -1.0, 0.5, 2.0, 5.0]);
    assert_eq!(x.clip(None, Some(&hi))?.to_vec::<f32>()?, vec![-3.0, -1.0, 0.5, 2.0, 2.5]);
    // Array bounds broadcast element-wise.
    let los = f32s(&[0.0, 0.0, 1.0, 3.0, 0.0])?;
    assert_eq!(ops::clip(&x, Some(&los), Some(&hi))?.to_vec::<f32>()?, vec![0.0, 0.0, 1.0, 2.5, 2.5]);
    let i = ops::clip(&i32s(&[-10, 5, 10])?, Some(&Array::scalar(0i32)), Some(&Array::scalar(7i32)))?;
    assert_eq!(i.to_vec::<i32>()?, vec![0, 5, 7]);
    // MLX requires at least one bound.
    assert!(matches!(ops::clip(&x, None, None), Err(Error::Mlx(_))));
    Ok(())
}

// ---- isclose, array_equal -------------------------------------------------------------------------

#[test]
fn isclose() -> Result<()> {
    let a = f32s(&[1.0, 100.0, f32::NAN, f32::INFINITY, f32::INFINITY, 0.0])?;
    let b = f32s(&[1.000005, 100.1, f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e-9])?;
    let r = ops::isclose(&a, &b, 1e-5, 1e-8, false)?;
    assert_eq!(r.dtype(), Dtype::Bool);
    assert_eq!(r.to_vec::<bool>()?, vec![true, false, false, true, false, true]);
    let r = ops::isclose(&a, &b, 1e-5, 1e-8, true)?;
    assert_eq!(r.to_vec::<bool>()?, vec![true, false, true, true, false, true]);
    // A larger rtol accepts 100 vs 100.1 (0.1 <= 1e-3 * 100.1).
    let r = ops::isclose(&a, &b, 1e-3, 0.0, false)?;
    assert_eq!(r.to_vec::<bool>()?[1], true);
    // atol alone.
    let r = ops::isclose(&f32s(&[0.0, 0.0])?, &f32s(&[0.05, 0.2])?, 0.0, 0.1, false)?;
    assert_eq!(r.to_vec::<bool>()?, vec![true, false]);
    Ok(())
}

#[test]
fn array_equal() -> Result<()> {
    let a = i32s(&[1, 2, 3])?;
    let t = ops::array_equal(&a, &i32s(&[1, 2, 3])?, false)?;
    assert_eq!(t.dtype(), Dtype::Bool);
    assert_eq!(t.ndim(), 0);
    assert_eq!(t.item::<bool>()?, true);
    assert_eq!(ops::array_equal(&a, &i32s(&[1, 2, 4])?, false)?.item::<bool>()?, false);
    // Different dtypes compare by value.
    assert_eq!(ops::array_equal(&a, &f32s(&[1.0, 2.0, 3.0])?, false)?.item::<bool>()?, true);
    // Different shapes are never equal (no broadcasting).
    assert_eq!(ops::array_equal(&a, &Array::from_slice(&[1i32, 2, 3], &[1, 3])?, false)?.item::<bool>()?, false);
    assert_eq!(ops::array_equal(&Array::scalar(1i32), &i32s(&[1, 1])?, false)?.item::<bool>()?, false);
    let n = f32s(&[1.0, f32::NAN])?;
    assert_eq!(ops::array_equal(&n, &n, false)?.item::<bool>()?, false);
    assert_eq!(ops::array_equal(&n, &n, true)?.item::<bool>()?, true);
    Ok(())
}

// ---- activations ----------------------------------------------------------------------------------

const ACT_X: [f32; 7] = [-5.0, -2.0, -0.5, 0.0, 0.5, 1.0, 3.0];

#[test]
fn relu() -> Result<()> {
    let r = ops::relu(&f32s(&ACT_X)?)?;
    assert_eq!(r.dtype(), Dtype::Float32);
    assert_eq!(r.to_vec::<f32>()?, vec![0.0, 0.0, 0.0, 0.0, 0.5, 1.0, 3.0]);
    let i = ops::relu(&i32s(&[-3, 0, 4])?)?;
    assert_eq!(i.dtype(), Dtype::Int32);
    assert_eq!(i.to_vec::<i32>()?, vec![0, 0, 4]);
    Ok(())
}

#[test]
fn silu() -> Result<()> {
    check_unary(ops::silu, &ACT_X, |v| v * sigmoid(v), "silu")?;
    assert_eq!(f32s(&[0.0])?.silu()?.item::<f32>()?, 0.0);
    Ok(())
}

#[test]
fn gelu_exact_and_approx() -> Result<()> {
    let exact = |v: f64| 0.5 * v * (1.0 + erf(v / 2f64.sqrt()));
    check_unary(ops::gelu, &ACT_X, exact, "gelu")?;
    let approx = |v: f64| 0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh());
    check_unary(ops::gelu_approx, &ACT_X, approx, "gelu_approx")?;
    // The two agree to ~1e-3 on this range.
    let e = f32s(&ACT_X)?.gelu()?.to_vec::<f32>()?;
    let a = ops::gelu_approx(&f32s(&ACT_X)?)?.to_vec::<f32>()?;
    for (x, y) in e.iter().zip(&a) {
        assert!((x - y).abs() < 1e-3, "{x} vs {y}");
    }
    // Half precision stays half precision.
    let h = Array::from_slice(&[rmlx::f16::from_f32(1.0)], &[1])?;
    let g = ops::gelu(&h)?;
    assert_eq!(g.dtype(), Dtype::Float16);
    assert_close_tol(&g.to_vec_f32()?, &[exact(1.0)], 2e-3, 0.0, "gelu f16");
    Ok(())
}

#[test]
fn softplus() -> Result<()> {
    let xs = [-30.0f32, -2.0, -0.5, 0.0, 0.5, 2.0, 30.0, 100.0];
    check_unary(ops::softplus, &xs, |v| v.max(0.0) + (-v.abs()).exp().ln_1p(), "softplus")?;
    assert_close(&ops::softplus(&f32s(&[0.0])?)?.to_vec::<f32>()?, &[std::f64::consts::LN_2], "softplus(0)");
    Ok(())
}

#[test]
fn one_hot() -> Result<()> {
    let i = i32s(&[2, 0, 3])?;
    let h = ops::one_hot(&i, 4, Dtype::Float32)?;
    assert_eq!(h.shape(), &[3, 4]);
    assert_eq!(h.dtype(), Dtype::Float32);
    assert_eq!(h.to_vec::<f32>()?, vec![0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]);
    // N-d indices, an out-of-range index gives an all-zero row, other dtypes.
    let j = Array::from_slice(&[1i32, 5, 0, 1], &[2, 2])?;
    let hj = ops::one_hot(&j, 2, Dtype::Int32)?;
    assert_eq!(hj.shape(), &[2, 2, 2]);
    assert_eq!(hj.to_vec::<i32>()?, vec![0, 1, 0, 0, 1, 0, 0, 1]);
    let hb = ops::one_hot(&Array::from_slice(&[1u32], &[1])?, 3, Dtype::Bool)?;
    assert_eq!(hb.to_vec::<bool>()?, vec![false, true, false]);
    Ok(())
}

/// Integer division by zero would trap (SIGFPE) and kill the process; rmlx returns 0 as NumPy does.
#[test]
fn integer_division_by_zero_gives_zero_not_a_crash() -> rmlx::Result<()> {
    let a = rmlx::Array::from_slice(&[7i32, -7, 5, 0], &[4])?;
    let b = rmlx::Array::from_slice(&[2i32, 0, 0, 3], &[4])?;
    assert_eq!(rmlx::ops::floor_divide(&a, &b)?.to_vec::<i32>()?, vec![3, 0, 0, 0]);
    assert_eq!(rmlx::ops::remainder(&a, &b)?.to_vec::<i32>()?, vec![1, 0, 0, 0]);
    assert_eq!((&a % 0)?.to_vec::<i32>()?, vec![0, 0, 0, 0]);
    // Floats keep IEEE semantics.
    let f = rmlx::Array::from_slice(&[1.0f32, -1.0], &[2])?;
    let z = rmlx::Array::from_slice(&[0.0f32, 0.0], &[2])?;
    assert_eq!(rmlx::ops::floor_divide(&f, &z)?.to_vec::<f32>()?, vec![f32::INFINITY, f32::NEG_INFINITY]);
    assert_eq!(rmlx::ops::result_type(&a, &f)?, rmlx::Dtype::Float32);
    Ok(())
}
