//! Integration tests of reductions (sum … logsumexp), arg-reductions, var/std, softmax and scans.
//!
//! Expected values are hand-computed or computed by a reference reduction written in Rust over f64;
//! integer and small float results are compared exactly, transcendental ones with a stated tolerance.

use rmlx::ops;
use rmlx::{f16, Array, Axes, Dtype, Result};

/// Tolerance for float32 results of exp/log based reductions.
const RTOL: f64 = 2e-6;

fn assert_close_tol(actual: &[f32], expected: &[f64], rtol: f64, atol: f64, what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: length");
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let a = a as f64;
        if e.is_infinite() {
            assert_eq!(a, e, "{what}[{i}]");
        } else {
            assert!((a - e).abs() <= atol + rtol * e.abs(), "{what}[{i}]: got {a}, expected {e}");
        }
    }
}

fn assert_close(actual: &[f32], expected: &[f64], what: &str) {
    assert_close_tol(actual, expected, RTOL, 1e-6, what);
}

/// `0..n` as int32 of `shape`.
fn iota(n: i32, shape: &[i32]) -> Result<Array> {
    ops::arange(0.0, n as f64, 1.0, Dtype::Int32)?.reshape(shape)
}

/// A reference reduction of row-major `data` of `shape` over `axes` (non-negative, any order).
/// Returns the values (row-major) and the shape without the reduced axes.
fn reference(
    data: &[f64],
    shape: &[usize],
    axes: &[usize],
    init: f64,
    f: impl Fn(f64, f64) -> f64,
) -> (Vec<f64>, Vec<i32>) {
    let out_shape: Vec<usize> = (0..shape.len()).filter(|d| !axes.contains(d)).map(|d| shape[d]).collect();
    let out_len: usize = out_shape.iter().product();
    let mut out = vec![init; out_len];
    for (flat, &v) in data.iter().enumerate() {
        // Unravel `flat`, then ravel over the kept axes.
        let mut rem = flat;
        let mut idx = vec![0usize; shape.len()];
        for d in (0..shape.len()).rev() {
            idx[d] = rem % shape[d];
            rem /= shape[d];
        }
        let mut o = 0;
        for d in 0..shape.len() {
            if !axes.contains(&d) {
                o = o * shape[d] + idx[d];
            }
        }
        out[o] = f(out[o], v);
    }
    (out, out_shape.iter().map(|&d| d as i32).collect())
}

const SHAPE: [usize; 3] = [2, 3, 4];

fn data24() -> Vec<f64> {
    (0..24).map(|v| v as f64).collect()
}

fn as_i32(v: &[f64]) -> Vec<i32> {
    v.iter().map(|&x| x as i32).collect()
}

// ---- sum / mean / prod / max / min ----------------------------------------------------------------

#[test]
fn sum_over_axes_and_keepdims() -> Result<()> {
    let a = iota(24, &[2, 3, 4])?;
    let cases: [(Axes, Vec<usize>); 8] = [
        (Axes::from(0), vec![0]),
        (Axes::from(1), vec![1]),
        (Axes::from(2), vec![2]),
        (Axes::from(-1), vec![2]),
        (Axes::from([0, 2]), vec![0, 2]),
        (Axes::from([-3, -1]), vec![0, 2]),
        (Axes::from(vec![2, 1]), vec![1, 2]),
        (Axes::from(&[0, 1][..]), vec![0, 1]),
    ];
    for (axes, pos) in cases {
        let (vals, shape) = reference(&data24(), &SHAPE, &pos, 0.0, |a, b| a + b);
        let s = a.sum(axes.clone(), false)?;
        assert_eq!(s.dtype(), Dtype::Int32);
        assert_eq!(s.shape(), &shape[..], "{axes:?}");
        assert_eq!(s.to_vec::<i32>()?, as_i32(&vals), "{axes:?}");
        let k = ops::sum(&a, axes.clone(), true)?;
        let kshape: Vec<i32> = (0..3).map(|d| if pos.contains(&d) { 1 } else { SHAPE[d] as i32 }).collect();
        assert_eq!(k.shape(), &kshape[..], "{axes:?} keepdims");
        assert_eq!(k.to_vec::<i32>()?, as_i32(&vals), "{axes:?} keepdims");
    }
    // Hand-computed spot checks.
    assert_eq!(a.sum(2, false)?.to_vec::<i32>()?, vec![6, 22, 38, 54, 70, 86]);
    assert_eq!(a.sum([0, 1], false)?.to_vec::<i32>()?, vec![60, 66, 72, 78]);
    // All axes.
    let t = a.sum(Axes::All, false)?;
    assert_eq!(t.ndim(), 0);
    assert_eq!(t.item::<i32>()?, 276);
    let tk = a.sum(Axes::All, true)?;
    assert_eq!(tk.shape(), &[1, 1, 1]);
    assert_eq!(tk.item::<i32>()?, 276);
    // An empty axis list reduces nothing.
    assert_eq!(a.sum(Vec::<i32>::new(), false)?.shape(), &[2, 3, 4]);
    Ok(())
}

#[test]
fn sum_dtypes() -> Result<()> {
    let b = Array::from_slice(&[true, true, false, true], &[4])?;
    let s = b.sum(Axes::All, false)?;
    assert_eq!(s.dtype(), Dtype::Int32);
    assert_eq!(s.item::<i32>()?, 3);
    let f = Array::from_slice(&[0.5f32, 0.25, -1.0], &[3])?.sum(0, false)?;
    assert_eq!(f.dtype(), Dtype::Float32);
    assert_eq!(f.item::<f32>()?, -0.25);
    let e = Array::from_slice::<f32>(&[], &[0])?.sum(0, false)?;
    assert_eq!(e.item::<f32>()?, 0.0);
    Ok(())
}

#[test]
fn mean_over_axes() -> Result<()> {
    let a = iota(24, &[2, 3, 4])?.astype(Dtype::Float32)?;
    for pos in [vec![0usize], vec![1], vec![2], vec![0, 2], vec![1, 2]] {
        let n: usize = pos.iter().map(|&d| SHAPE[d]).product();
        let (sums, shape) = reference(&data24(), &SHAPE, &pos, 0.0, |a, b| a + b);
        let axes: Vec<i32> = pos.iter().map(|&d| d as i32).collect();
        let m = a.mean(axes.clone(), false)?;
        assert_eq!(m.shape(), &shape[..]);
        let expected: Vec<f32> = sums.iter().map(|s| (s / n as f64) as f32).collect();
        assert_eq!(m.to_vec::<f32>()?, expected, "{axes:?}");
    }
    assert_eq!(a.mean(-1, true)?.shape(), &[2, 3, 1]);
    assert_eq!(a.mean(-1, false)?.to_vec::<f32>()?, vec![1.5, 5.5, 9.5, 13.5, 17.5, 21.5]);
    assert_eq!(a.mean(Axes::All, false)?.item::<f32>()?, 11.5);
    // Integer input gives float32.
    let mi = iota(4, &[4])?.mean(Axes::All, false)?;
    assert_eq!(mi.dtype(), Dtype::Float32);
    assert_eq!(mi.item::<f32>()?, 1.5);
    Ok(())
}

#[test]
fn prod_over_axes() -> Result<()> {
    let a = Array::from_slice(&[1i32, 2, 3, 4, 5, 6], &[2, 3])?;
    assert_eq!(a.prod(0, false)?.to_vec::<i32>()?, vec![4, 10, 18]);
    assert_eq!(a.prod(1, false)?.to_vec::<i32>()?, vec![6, 120]);
    assert_eq!(a.prod(-1, true)?.shape(), &[2, 1]);
    assert_eq!(a.prod(-1, true)?.to_vec::<i32>()?, vec![6, 120]);
    let all = a.prod(Axes::All, false)?;
    assert_eq!(all.dtype(), Dtype::Int32);
    assert_eq!(all.item::<i32>()?, 720);
    assert_eq!(a.prod([0, 1], true)?.shape(), &[1, 1]);
    let f = Array::from_slice(&[0.5f32, -4.0, 3.0], &[3])?;
    assert_eq!(f.prod(0, false)?.item::<f32>()?, -6.0);
    Ok(())
}

#[test]
fn max_min_over_axes() -> Result<()> {
    // A permutation with negatives so max/min positions differ by axis.
    let vals: Vec<f64> = (0..24).map(|i| ((i * 7) % 24) as f64 - 11.0).collect();
    let data: Vec<f32> = vals.iter().map(|&v| v as f32).collect();
    let a = Array::from_slice(&data, &[2, 3, 4])?;
    for pos in [vec![0usize], vec![1], vec![2], vec![0, 1], vec![0, 2], vec![0, 1, 2]] {
        let axes: Vec<i32> = pos.iter().map(|&d| d as i32 - 3).collect(); // negative spelling
        let (mx, shape) = reference(&vals, &SHAPE, &pos, f64::NEG_INFINITY, f64::max);
        let (mn, _) = reference(&vals, &SHAPE, &pos, f64::INFINITY, f64::min);
        let m = a.max(axes.clone(), false)?;
        assert_eq!(m.shape(), &shape[..]);
        assert_eq!(m.to_vec::<f32>()?, mx.iter().map(|&v| v as f32).collect::<Vec<_>>(), "max {axes:?}");
        let n = a.min(axes.clone(), true)?;
        assert_eq!(n.ndim(), 3);
        assert_eq!(n.to_vec::<f32>()?, mn.iter().map(|&v| v as f32).collect::<Vec<_>>(), "min {axes:?}");
    }
    assert_eq!(a.max(Axes::All, false)?.item::<f32>()?, 12.0);
    assert_eq!(a.min(Axes::All, false)?.item::<f32>()?, -11.0);
    let i = Array::from_slice(&[3i32, -7, 5, 0], &[2, 2])?;
    assert_eq!(i.max(1, false)?.to_vec::<i32>()?, vec![3, 5]);
    assert_eq!(i.min(0, false)?.to_vec::<i32>()?, vec![3, -7]);
    assert_eq!(i.max(0, false)?.dtype(), Dtype::Int32);
    Ok(())
}

#[test]
fn all_any() -> Result<()> {
    let b = Array::from_slice(&[true, true, false, true, false, false], &[2, 3])?;
    let r = b.all(1, false)?;
    assert_eq!(r.dtype(), Dtype::Bool);
    assert_eq!(r.to_vec::<bool>()?, vec![false, false]);
    assert_eq!(b.all(0, false)?.to_vec::<bool>()?, vec![true, false, false]);
    assert_eq!(b.any(1, false)?.to_vec::<bool>()?, vec![true, true]);
    assert_eq!(b.any(0, true)?.shape(), &[1, 3]);
    assert_eq!(b.any(0, true)?.to_vec::<bool>()?, vec![true, true, false]);
    assert!(b.any(Axes::All, false)?.item::<bool>()?);
    assert!(!b.all(Axes::All, false)?.item::<bool>()?);
    assert_eq!(b.all(-1, true)?.shape(), &[2, 1]);
    // Numbers are truthy when non-zero.
    let n = Array::from_slice(&[1.0f32, -2.0, 0.0, 0.5], &[2, 2])?;
    assert_eq!(n.all(1, false)?.to_vec::<bool>()?, vec![true, false]);
    assert_eq!(n.any(0, false)?.to_vec::<bool>()?, vec![true, true]);
    let z = Array::from_slice(&[0i32, 0], &[2])?;
    assert!(!z.any(Axes::All, false)?.item::<bool>()?);
    Ok(())
}

#[test]
fn logsumexp_over_axes() -> Result<()> {
    let vals: Vec<f64> = (0..24).map(|i| (i as f64) * 0.25 - 3.0).collect();
    let data: Vec<f32> = vals.iter().map(|&v| v as f32).collect();
    let a = Array::from_slice(&data, &[2, 3, 4])?;
    for pos in [vec![0usize], vec![2], vec![0, 2], vec![1, 2]] {
        let (sums, shape) = reference(&vals, &SHAPE, &pos, 0.0, |acc, v| acc + v.exp());
        let axes: Vec<i32> = pos.iter().map(|&d| d as i32).collect();
        let l = a.logsumexp(axes.clone(), false)?;
        assert_eq!(l.shape(), &shape[..]);
        assert_close(&l.to_vec::<f32>()?, &sums.iter().map(|s| s.ln()).collect::<Vec<_>>(), "logsumexp");
        assert_eq!(a.logsumexp(axes, true)?.ndim(), 3);
    }
    let total: f64 = vals.iter().map(|v| v.exp()).sum::<f64>().ln();
    assert_close(&[a.logsumexp(Axes::All, false)?.item::<f32>()?], &[total], "logsumexp all");
    // Stable for large inputs.
    let big = Array::from_slice(&[1000.0f32, 1000.0, -1000.0], &[3])?;
    assert_close(&[big.logsumexp(0, false)?.item::<f32>()?], &[1000.0 + std::f64::consts::LN_2], "stable");
    let ninf = Array::from_slice(&[f32::NEG_INFINITY, 0.0], &[2])?;
    assert_eq!(ninf.logsumexp(0, false)?.item::<f32>()?, 0.0);
    Ok(())
}

// ---- argmax / argmin ------------------------------------------------------------------------------

#[test]
fn argmax_argmin_with_axis() -> Result<()> {
    let a = Array::from_slice(&[1.0f32, 9.0, 3.0, 7.0, -2.0, 8.0], &[2, 3])?;
    let m = a.argmax(Some(1), false)?;
    assert_eq!(m.dtype(), Dtype::Uint32);
    assert_eq!(m.shape(), &[2]);
    assert_eq!(m.to_vec::<u32>()?, vec![1, 2]);
    assert_eq!(a.argmax(Some(0), false)?.to_vec::<u32>()?, vec![1, 0, 1]);
    assert_eq!(a.argmin(Some(1), false)?.to_vec::<u32>()?, vec![0, 1]);
    assert_eq!(a.argmin(Some(-2), false)?.to_vec::<u32>()?, vec![0, 1, 0]);
    let k = ops::argmax(&a, Some(-1), true)?;
    assert_eq!(k.shape(), &[2, 1]);
    assert_eq!(k.to_vec::<u32>()?, vec![1, 2]);
    assert_eq!(ops::argmin(&a, Some(0), true)?.shape(), &[1, 3]);
    Ok(())
}

#[test]
fn argmax_argmin_flattened() -> Result<()> {
    let a = Array::from_slice(&[1i32, 9, 3, 7, -2, 8], &[2, 3])?;
    let m = a.argmax(None, false)?;
    assert_eq!(m.ndim(), 0);
    assert_eq!(m.item::<u32>()?, 1);
    assert_eq!(a.argmin(None, false)?.item::<u32>()?, 4);
    let k = a.argmax(None, true)?;
    assert_eq!(k.shape(), &[1, 1]);
    assert_eq!(k.item::<u32>()?, 1);
    Ok(())
}

#[test]
fn argmax_argmin_ties_give_first_index() -> Result<()> {
    let a = Array::from_slice(&[1.0f32, 3.0, 3.0, 2.0], &[4])?;
    assert_eq!(a.argmax(Some(0), false)?.item::<u32>()?, 1);
    assert_eq!(a.argmax(None, false)?.item::<u32>()?, 1);
    let b = Array::from_slice(&[2i32, 0, 0, 1, 5, 5, 5, 5], &[2, 4])?;
    assert_eq!(b.argmin(Some(1), false)?.to_vec::<u32>()?, vec![1, 0]);
    assert_eq!(b.argmax(Some(1), false)?.to_vec::<u32>()?, vec![0, 0]);
    let c = Array::from_slice(&[4i32; 6], &[3, 2])?;
    assert_eq!(c.argmax(Some(0), false)?.to_vec::<u32>()?, vec![0, 0]);
    assert_eq!(c.argmin(None, false)?.item::<u32>()?, 0);
    Ok(())
}

// ---- var / std ------------------------------------------------------------------------------------

#[test]
fn var_std_with_ddof() -> Result<()> {
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[4])?;
    assert_eq!(a.var(Axes::All, false, 0)?.item::<f32>()?, 1.25);
    assert_eq!(ops::var(&a, 0, false, 1)?.item::<f32>()?, (5.0f64 / 3.0) as f32);
    assert_close(&[a.std(0, false, 0)?.item::<f32>()?], &[1.25f64.sqrt()], "std ddof 0");
    assert_close(&[ops::std(&a, Axes::All, false, 1)?.item::<f32>()?], &[(5.0f64 / 3.0).sqrt()], "std ddof 1");

    // Per row / per column of a matrix.
    let m = Array::from_slice(&[1.0f32, 3.0, 5.0, 2.0, 2.0, 8.0], &[2, 3])?;
    // rows: mean 3, ssd 8 ; mean 4, ssd 24. columns: ssd 0.5, 0.5, 4.5
    let v = m.var(1, false, 0)?;
    assert_eq!(v.shape(), &[2]);
    assert_close(&v.to_vec::<f32>()?, &[8.0 / 3.0, 24.0 / 3.0], "var rows ddof 0");
    assert_close(&m.var(-1, false, 1)?.to_vec::<f32>()?, &[4.0, 12.0], "var rows ddof 1");
    let vc = m.var(0, true, 1)?;
    assert_eq!(vc.shape(), &[1, 3]);
    assert_eq!(vc.to_vec::<f32>()?, vec![0.5, 0.5, 4.5]);
    assert_close(&m.std(0, false, 0)?.to_vec::<f32>()?, &[0.5, 0.5, 1.5], "std cols ddof 0");
    let all = m.var(Axes::All, true, 0)?;
    assert_eq!(all.shape(), &[1, 1]);
    // mean 3.5; squares: 6.25 0.25 2.25 2.25 2.25 20.25 = 33.5
    assert_close(&[all.item::<f32>()?], &[33.5 / 6.0], "var all");
    // Integer input gives float32.
    let vi = Array::from_slice(&[1i32, 3], &[2])?.var(0, false, 0)?;
    assert_eq!(vi.dtype(), Dtype::Float32);
    assert_eq!(vi.item::<f32>()?, 1.0);
    Ok(())
}

// ---- softmax --------------------------------------------------------------------------------------

fn softmax_ref(row: &[f64]) -> Vec<f64> {
    let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = row.iter().map(|v| (v - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

#[test]
fn softmax_over_axis() -> Result<()> {
    let data = [1.0f32, 2.0, 3.0, 0.0, 0.0, 0.0, -1.0, 5.0, 100.0];
    let a = Array::from_slice(&data, &[3, 3])?;
    let s = a.softmax(-1)?;
    assert_eq!(s.shape(), &[3, 3]);
    assert_eq!(s.dtype(), Dtype::Float32);
    let out = s.to_vec::<f32>()?;
    let mut expected = Vec::new();
    for r in data.chunks(3) {
        expected.extend(softmax_ref(&r.iter().map(|&v| v as f64).collect::<Vec<_>>()));
    }
    assert_close_tol(&out, &expected, 1e-5, 1e-7, "softmax rows");
    // Rows sum to 1.
    assert_close(&s.sum(1, false)?.to_vec::<f32>()?, &[1.0, 1.0, 1.0], "row sums");
    // Hand values: a uniform row, and [1,2,3] = e^k / (e + e^2 + e^3).
    assert_close(&out[3..6], &[1.0 / 3.0; 3], "uniform");
    let e = std::f64::consts::E;
    let z = e + e * e + e * e * e;
    assert_close(&out[0..3], &[e / z, e * e / z, e * e * e / z], "1,2,3");

    // Over axis 0: columns sum to 1.
    let c = ops::softmax(&a, 0, false)?;
    assert_close(&c.sum(0, false)?.to_vec::<f32>()?, &[1.0, 1.0, 1.0], "column sums");
    let col0 = softmax_ref(&[1.0, 0.0, -1.0]);
    let c_out = c.to_vec::<f32>()?;
    assert_close(&[c_out[0], c_out[3], c_out[6]], &col0, "column 0");

    // Over all axes: everything sums to 1.
    let all = ops::softmax(&a, Axes::All, false)?;
    let flat: Vec<f64> = data.iter().map(|&v| v as f64).collect();
    assert_close_tol(&all.to_vec::<f32>()?, &softmax_ref(&flat), 1e-5, 1e-7, "softmax all");
    Ok(())
}

#[test]
fn softmax_precise_on_f16() -> Result<()> {
    let xs = [0.5f64, 1.0, 2.0, 3.0, -1.0, 4.0];
    let h: Vec<f16> = xs.iter().map(|&v| f16::from_f64(v)).collect();
    let a = Array::from_slice(&h, &[6])?;
    let expected = softmax_ref(&xs);
    for precise in [true, false] {
        let s = ops::softmax(&a, 0, precise)?;
        assert_eq!(s.dtype(), Dtype::Float16, "precise={precise}");
        let out: Vec<f32> = s.to_vec::<f16>()?.iter().map(|v| v.to_f32()).collect();
        // f16 has an 11-bit significand: 2^-11 relative is half an ulp.
        let tol = if precise { 1.0 / 1024.0 } else { 4.0 / 1024.0 };
        assert_close_tol(&out, &expected, tol, 1e-4, &format!("softmax f16 precise={precise}"));
        let sum: f32 = out.iter().sum();
        assert!((sum - 1.0).abs() < 5e-3, "precise={precise}: sum {sum}");
    }
    // With precise=true the result is the f16 rounding of the exact value, give or take one ulp.
    let p = ops::softmax(&a, 0, true)?.to_vec::<f16>()?;
    for (got, e) in p.iter().zip(&expected) {
        let want = f16::from_f64(*e);
        assert!((got.to_bits() as i32 - want.to_bits() as i32).abs() <= 1, "{got} vs {want}");
    }
    Ok(())
}

// ---- scans ----------------------------------------------------------------------------------------

#[test]
fn cumsum_variants() -> Result<()> {
    let a = Array::from_slice(&[1i32, 2, 3, 4], &[4])?;
    assert_eq!(ops::cumsum(&a, Some(0), false, true)?.to_vec::<i32>()?, vec![1, 3, 6, 10]);
    assert_eq!(a.cumsum(Some(0))?.to_vec::<i32>()?, vec![1, 3, 6, 10]);
    assert_eq!(ops::cumsum(&a, Some(0), true, true)?.to_vec::<i32>()?, vec![10, 9, 7, 4]);
    assert_eq!(ops::cumsum(&a, Some(0), false, false)?.to_vec::<i32>()?, vec![0, 1, 3, 6]);
    assert_eq!(ops::cumsum(&a, Some(0), true, false)?.to_vec::<i32>()?, vec![9, 7, 4, 0]);

    let m = iota(6, &[2, 3])?; // [[0,1,2],[3,4,5]]
    assert_eq!(ops::cumsum(&m, Some(1), false, true)?.to_vec::<i32>()?, vec![0, 1, 3, 3, 7, 12]);
    assert_eq!(ops::cumsum(&m, Some(-1), false, true)?.to_vec::<i32>()?, vec![0, 1, 3, 3, 7, 12]);
    let c0 = ops::cumsum(&m, Some(0), false, true)?;
    assert_eq!(c0.shape(), &[2, 3]);
    assert_eq!(c0.to_vec::<i32>()?, vec![0, 1, 2, 3, 5, 7]);
    assert_eq!(ops::cumsum(&m, Some(1), true, false)?.to_vec::<i32>()?, vec![3, 2, 0, 9, 5, 0]);
    // None scans the flattened array.
    let f = ops::cumsum(&m, None, false, true)?;
    assert_eq!(f.shape(), &[6]);
    assert_eq!(f.to_vec::<i32>()?, vec![0, 1, 3, 6, 10, 15]);
    assert_eq!(ops::cumsum(&m, None, true, false)?.to_vec::<i32>()?, vec![15, 14, 12, 9, 5, 0]);
    // Floats, and a non-contiguous input.
    let t = m.transpose()?.astype(Dtype::Float32)?; // [[0,3],[1,4],[2,5]]
    assert_eq!(ops::cumsum(&t, Some(0), false, true)?.to_vec::<f32>()?, vec![0.0, 3.0, 1.0, 7.0, 3.0, 12.0]);
    Ok(())
}

#[test]
fn cumprod_variants() -> Result<()> {
    let a = Array::from_slice(&[1i32, 2, 3, 4], &[4])?;
    assert_eq!(ops::cumprod(&a, Some(0), false, true)?.to_vec::<i32>()?, vec![1, 2, 6, 24]);
    assert_eq!(ops::cumprod(&a, Some(0), true, true)?.to_vec::<i32>()?, vec![24, 24, 12, 4]);
    assert_eq!(ops::cumprod(&a, Some(0), false, false)?.to_vec::<i32>()?, vec![1, 1, 2, 6]);
    assert_eq!(ops::cumprod(&a, Some(0), true, false)?.to_vec::<i32>()?, vec![24, 12, 4, 1]);
    let m = Array::from_slice(&[1.0f32, 2.0, 3.0, 0.5, -2.0, 4.0], &[2, 3])?;
    assert_eq!(ops::cumprod(&m, Some(1), false, true)?.to_vec::<f32>()?, vec![1.0, 2.0, 6.0, 0.5, -1.0, -4.0]);
    assert_eq!(ops::cumprod(&m, Some(0), false, true)?.to_vec::<f32>()?, vec![1.0, 2.0, 3.0, 0.5, -4.0, 12.0]);
    assert_eq!(ops::cumprod(&m, None, false, true)?.to_vec::<f32>()?, vec![1.0, 2.0, 6.0, 3.0, -6.0, -24.0]);
    Ok(())
}

#[test]
fn cummax_cummin_variants() -> Result<()> {
    let a = Array::from_slice(&[1.0f32, 3.0, 2.0, 5.0, 4.0], &[5])?;
    assert_eq!(ops::cummax(&a, Some(0), false, true)?.to_vec::<f32>()?, vec![1.0, 3.0, 3.0, 5.0, 5.0]);
    assert_eq!(ops::cummin(&a, Some(0), false, true)?.to_vec::<f32>()?, vec![1.0, 1.0, 1.0, 1.0, 1.0]);
    assert_eq!(ops::cummax(&a, Some(0), true, true)?.to_vec::<f32>()?, vec![5.0, 5.0, 5.0, 5.0, 4.0]);
    assert_eq!(ops::cummin(&a, Some(0), true, true)?.to_vec::<f32>()?, vec![1.0, 2.0, 2.0, 4.0, 4.0]);
    // Exclusive scans start from the identity: -inf for max, +inf for min.
    assert_eq!(ops::cummax(&a, Some(0), false, false)?.to_vec::<f32>()?, vec![f32::NEG_INFINITY, 1.0, 3.0, 3.0, 5.0]);
    assert_eq!(ops::cummin(&a, Some(0), true, false)?.to_vec::<f32>()?, vec![2.0, 2.0, 4.0, 4.0, f32::INFINITY]);
    // Integers: the identity is the dtype's extreme.
    let i = Array::from_slice(&[3i32, -1, 4, -5], &[4])?;
    assert_eq!(ops::cummax(&i, Some(0), false, false)?.to_vec::<i32>()?, vec![i32::MIN, 3, 3, 4]);
    assert_eq!(ops::cummin(&i, Some(0), false, false)?.to_vec::<i32>()?, vec![i32::MAX, 3, -1, -1]);
    let m = Array::from_slice(&[2i32, 1, 3, 0, 5, 4], &[2, 3])?;
    assert_eq!(ops::cummax(&m, Some(1), false, true)?.to_vec::<i32>()?, vec![2, 2, 3, 0, 5, 5]);
    assert_eq!(ops::cummin(&m, Some(0), false, true)?.to_vec::<i32>()?, vec![2, 1, 3, 0, 1, 3]);
    assert_eq!(ops::cummax(&m, None, false, true)?.to_vec::<i32>()?, vec![2, 2, 3, 3, 5, 5]);
    Ok(())
}

#[test]
fn logcumsumexp_variants() -> Result<()> {
    let xs = [0.0f64, 1.0, -2.0, 3.0, 0.5];
    let data: Vec<f32> = xs.iter().map(|&v| v as f32).collect();
    let a = Array::from_slice(&data, &[5])?;
    let lse = |v: &[f64]| v.iter().map(|x| x.exp()).sum::<f64>().ln();
    let fwd: Vec<f64> = (1..=5).map(|k| lse(&xs[..k])).collect();
    let rev: Vec<f64> = (0..5).map(|k| lse(&xs[k..])).collect();
    assert_close(&ops::logcumsumexp(&a, Some(0), false, true)?.to_vec::<f32>()?, &fwd, "forward");
    assert_close(&ops::logcumsumexp(&a, Some(0), true, true)?.to_vec::<f32>()?, &rev, "reverse");
    // Exclusive: shifted by one, starting from ln(0) = -inf.
    let mut excl = vec![f64::NEG_INFINITY];
    excl.extend_from_slice(&fwd[..4]);
    assert_close(&ops::logcumsumexp(&a, Some(0), false, false)?.to_vec::<f32>()?, &excl, "exclusive");
    let mut rexcl = rev[1..].to_vec();
    rexcl.push(f64::NEG_INFINITY);
    assert_close(&ops::logcumsumexp(&a, Some(0), true, false)?.to_vec::<f32>()?, &rexcl, "reverse exclusive");
    // 2-D along each axis and flattened.
    let m = Array::from_slice(&[0.0f32, 1.0, 2.0, 3.0], &[2, 2])?;
    let l1 = ops::logcumsumexp(&m, Some(1), false, true)?;
    assert_close(&l1.to_vec::<f32>()?, &[0.0, lse(&[0.0, 1.0]), 2.0, lse(&[2.0, 3.0])], "axis 1");
    let l0 = ops::logcumsumexp(&m, Some(0), false, true)?;
    assert_close(&l0.to_vec::<f32>()?, &[0.0, 1.0, lse(&[0.0, 2.0]), lse(&[1.0, 3.0])], "axis 0");
    let lf = ops::logcumsumexp(&m, None, false, true)?;
    assert_eq!(lf.shape(), &[4]);
    assert_close(
        &lf.to_vec::<f32>()?,
        &[0.0, lse(&[0.0, 1.0]), lse(&[0.0, 1.0, 2.0]), lse(&[0.0, 1.0, 2.0, 3.0])],
        "flattened",
    );
    // Stable for large values.
    let big = Array::from_slice(&[1000.0f32, 1000.0], &[2])?;
    assert_close(
        &ops::logcumsumexp(&big, Some(0), false, true)?.to_vec::<f32>()?,
        &[1000.0, 1000.0 + std::f64::consts::LN_2],
        "large",
    );
    Ok(())
}
