//! Shape manipulation, indexing, scatter/gather, sorting and matrix products, with exact values.

use rmlx::ops::{self, Idx, PadMode};
use rmlx::{idx, Array, Axes, Dtype, Error};

fn ar(n: i32) -> Array {
    ops::arange(0.0, n as f64, 1.0, Dtype::Int32).unwrap()
}

fn ar2(r: i32, c: i32) -> Array {
    ar(r * c).reshape(&[r, c]).unwrap()
}

fn fa(data: &[f32], shape: &[i32]) -> Array {
    Array::from_slice(data, shape).unwrap()
}

fn ia(data: &[i32], shape: &[i32]) -> Array {
    Array::from_slice(data, shape).unwrap()
}

fn iv(a: &Array) -> Vec<i32> {
    a.to_vec::<i32>().unwrap()
}

fn fv(a: &Array) -> Vec<f32> {
    a.to_vec::<f32>().unwrap()
}

/// Checks shape and int32 contents.
fn check_i(a: &Array, shape: &[i32], data: &[i32]) {
    assert_eq!(a.shape(), shape, "shape");
    assert_eq!(a.dtype(), Dtype::Int32);
    assert_eq!(iv(a), data);
}

fn check_f(a: &Array, shape: &[i32], data: &[f32]) {
    assert_eq!(a.shape(), shape, "shape");
    assert_eq!(a.dtype(), Dtype::Float32);
    assert_eq!(fv(a), data);
}

// ---------------------------------------------------------------------------------------------------
// shape

#[test]
fn reshape_with_inferred_dim() {
    let a = ar(12);
    check_i(&a.reshape(&[3, 4]).unwrap(), &[3, 4], &(0..12).collect::<Vec<_>>());
    check_i(&a.reshape(&[-1, 6]).unwrap(), &[2, 6], &(0..12).collect::<Vec<_>>());
    check_i(&a.reshape(&[2, -1, 3]).unwrap(), &[2, 2, 3], &(0..12).collect::<Vec<_>>());
    assert!(matches!(a.reshape(&[5, -1]), Err(Error::Mlx(_))));
    assert!(matches!(a.reshape(&[-1, -1]), Err(Error::Mlx(_))));
}

#[test]
fn transposes() {
    let a = ar2(2, 3);
    check_i(&a.transpose().unwrap(), &[3, 2], &[0, 3, 1, 4, 2, 5]);
    let b = ar(24).reshape(&[2, 3, 4]).unwrap();
    let t = b.transpose_axes(&[1, 2, 0]).unwrap();
    assert_eq!(t.shape(), &[3, 4, 2]);
    let tv = iv(&t);
    // t[i, j, k] = b[k, i, j] = 12k + 4i + j
    for i in 0..3 {
        for j in 0..4 {
            for k in 0..2 {
                assert_eq!(tv[(i * 8 + j * 2 + k) as usize], 12 * k + 4 * i + j);
            }
        }
    }
    // full reverse equals transpose()
    assert_eq!(iv(&b.transpose().unwrap()), iv(&b.transpose_axes(&[2, 1, 0]).unwrap()));
    let s = b.swapaxes(0, 2).unwrap();
    assert_eq!(s.shape(), &[4, 3, 2]);
    assert_eq!(iv(&s), iv(&b.transpose_axes(&[2, 1, 0]).unwrap()));
    let m = ops::moveaxis(&b, 0, -1).unwrap();
    assert_eq!(m.shape(), &[3, 4, 2]);
    assert_eq!(iv(&m), tv);
    let m2 = ops::moveaxis(&b, 2, 0).unwrap();
    assert_eq!(m2.shape(), &[4, 2, 3]);
    assert_eq!(iv(&m2), iv(&b.transpose_axes(&[2, 0, 1]).unwrap()));
    assert!(matches!(b.transpose_axes(&[0, 1]), Err(Error::Mlx(_))));
}

#[test]
fn expand_and_squeeze() {
    let a = ar(6).reshape(&[2, 3]).unwrap();
    assert_eq!(a.expand_dims(0).unwrap().shape(), &[1, 2, 3]);
    assert_eq!(a.expand_dims(-1).unwrap().shape(), &[2, 3, 1]);
    let e = a.expand_dims([0, 2]).unwrap();
    check_i(&e, &[1, 2, 1, 3], &[0, 1, 2, 3, 4, 5]);
    assert!(matches!(a.expand_dims(Axes::All), Err(Error::InvalidArgument(_))));
    check_i(&e.squeeze(Axes::All).unwrap(), &[2, 3], &[0, 1, 2, 3, 4, 5]);
    assert_eq!(e.squeeze(0).unwrap().shape(), &[2, 1, 3]);
    assert_eq!(e.squeeze([0, 2]).unwrap().shape(), &[2, 3]);
    assert_eq!(e.squeeze(-2).unwrap().shape(), &[1, 2, 3]);
    // squeezing a non-unit axis is MLX's error
    assert!(matches!(e.squeeze(1), Err(Error::Mlx(_))));
}

#[test]
fn flatten_unflatten() {
    let a = ar(24).reshape(&[2, 3, 4]).unwrap();
    check_i(&a.flatten().unwrap(), &[24], &(0..24).collect::<Vec<_>>());
    assert_eq!(ops::flatten(&a, 1, 2).unwrap().shape(), &[2, 12]);
    assert_eq!(ops::flatten(&a, 0, 1).unwrap().shape(), &[6, 4]);
    let u = ops::unflatten(&ar(12), 0, &[3, 4]).unwrap();
    check_i(&u, &[3, 4], &(0..12).collect::<Vec<_>>());
    let u2 = ops::unflatten(&ar2(2, 6), 1, &[2, -1]).unwrap();
    assert_eq!(u2.shape(), &[2, 2, 3]);
    assert_eq!(iv(&u2), (0..12).collect::<Vec<_>>());
}

#[test]
fn broadcast() {
    let a = ia(&[1, 2, 3], &[3]);
    check_i(&a.broadcast_to(&[2, 3]).unwrap(), &[2, 3], &[1, 2, 3, 1, 2, 3]);
    let c = ia(&[1, 2], &[2, 1]);
    check_i(&c.broadcast_to(&[2, 3]).unwrap(), &[2, 3], &[1, 1, 1, 2, 2, 2]);
    assert!(matches!(a.broadcast_to(&[2, 4]), Err(Error::Mlx(_))));
}

#[test]
fn concatenate_stack() {
    let a = ia(&[1, 2, 3, 4], &[2, 2]);
    let b = ia(&[5, 6], &[1, 2]);
    check_i(&ops::concatenate(&[&a, &b], 0).unwrap(), &[3, 2], &[1, 2, 3, 4, 5, 6]);
    let c = ia(&[7, 8], &[2, 1]);
    check_i(&ops::concatenate(&[&a, &c], 1).unwrap(), &[2, 3], &[1, 2, 7, 3, 4, 8]);
    check_i(&ops::concatenate(&[&a, &c], -1).unwrap(), &[2, 3], &[1, 2, 7, 3, 4, 8]);
    assert!(matches!(ops::concatenate(&[&a, &b], 1), Err(Error::Mlx(_))));

    let x = ia(&[1, 2, 3], &[3]);
    let y = ia(&[4, 5, 6], &[3]);
    check_i(&ops::stack(&[&x, &y], 0).unwrap(), &[2, 3], &[1, 2, 3, 4, 5, 6]);
    check_i(&ops::stack(&[&x, &y], 1).unwrap(), &[3, 2], &[1, 4, 2, 5, 3, 6]);
    check_i(&ops::stack(&[&x, &y], -1).unwrap(), &[3, 2], &[1, 4, 2, 5, 3, 6]);
}

#[test]
fn split_sections_and_indices() {
    let a = ar2(4, 3);
    let parts = ops::split(&a, 2, 0).unwrap();
    assert_eq!(parts.len(), 2);
    check_i(&parts[0], &[2, 3], &[0, 1, 2, 3, 4, 5]);
    check_i(&parts[1], &[2, 3], &[6, 7, 8, 9, 10, 11]);
    let cols = ops::split(&a, 3, 1).unwrap();
    assert_eq!(cols.len(), 3);
    check_i(&cols[1], &[4, 1], &[1, 4, 7, 10]);
    assert!(matches!(ops::split(&a, 3, 0), Err(Error::Mlx(_))));

    let b = ar(10);
    let p = ops::split_at(&b, &[2, 5], 0).unwrap();
    assert_eq!(p.len(), 3);
    check_i(&p[0], &[2], &[0, 1]);
    check_i(&p[1], &[3], &[2, 3, 4]);
    check_i(&p[2], &[5], &[5, 6, 7, 8, 9]);
    let q = ops::split_at(&a, &[1], 1).unwrap();
    check_i(&q[0], &[4, 1], &[0, 3, 6, 9]);
    check_i(&q[1], &[4, 2], &[1, 2, 4, 5, 7, 8, 10, 11]);
}

#[test]
fn pad_constant_and_edge() {
    let a = ia(&[1, 2, 3, 4], &[2, 2]);
    let p = ops::pad(&a, &[(1, 0), (0, 2)], &Array::scalar(9i32), PadMode::Constant).unwrap();
    check_i(&p, &[3, 4], &[9, 9, 9, 9, 1, 2, 9, 9, 3, 4, 9, 9]);
    let z = ops::pad(&a, &[(0, 1), (1, 1)], &Array::scalar(0i32), PadMode::Constant).unwrap();
    check_i(&z, &[3, 4], &[0, 1, 2, 0, 0, 3, 4, 0, 0, 0, 0, 0]);
    let e = ops::pad(&a, &[(1, 1), (1, 2)], &Array::scalar(0i32), PadMode::Edge).unwrap();
    check_i(&e, &[4, 5], &[1, 1, 2, 2, 2, 1, 1, 2, 2, 2, 3, 3, 4, 4, 4, 3, 3, 4, 4, 4]);
    let f = ops::pad(&fa(&[1.5, 2.5], &[2]), &[(2, 1)], &Array::scalar(-1.0f32), PadMode::Constant).unwrap();
    check_f(&f, &[5], &[-1.0, -1.0, 1.5, 2.5, -1.0]);
    assert!(matches!(ops::pad(&a, &[(1, 1)], &Array::scalar(0i32), PadMode::Constant), Err(Error::InvalidArgument(_))));
}

#[test]
fn repeat_and_tile() {
    let a = ia(&[1, 2, 3, 4], &[2, 2]);
    check_i(&ops::repeat(&a, 2, Some(1)).unwrap(), &[2, 4], &[1, 1, 2, 2, 3, 3, 4, 4]);
    check_i(&ops::repeat(&a, 2, Some(0)).unwrap(), &[4, 2], &[1, 2, 1, 2, 3, 4, 3, 4]);
    check_i(&ops::repeat(&a, 3, None).unwrap(), &[12], &[1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]);
    check_i(&ops::tile(&a, &[2, 2]).unwrap(), &[4, 4], &[1, 2, 1, 2, 3, 4, 3, 4, 1, 2, 1, 2, 3, 4, 3, 4]);
    check_i(&ops::tile(&ia(&[1, 2], &[2]), &[3]).unwrap(), &[6], &[1, 2, 1, 2, 1, 2]);
    // reps longer than ndim prepends axes
    check_i(&ops::tile(&ia(&[1, 2], &[2]), &[2, 1]).unwrap(), &[2, 2], &[1, 2, 1, 2]);
}

#[test]
fn as_strided_windows_and_contiguous() {
    let a = ar(6);
    let w = ops::as_strided(&a, &[4, 3], &[1, 1], 0).unwrap();
    check_i(&w, &[4, 3], &[0, 1, 2, 1, 2, 3, 2, 3, 4, 3, 4, 5]);
    let w2 = ops::as_strided(&a, &[2, 2], &[2, 1], 1).unwrap();
    check_i(&w2, &[2, 2], &[1, 2, 3, 4]);
    // a window view of a 2-D array
    let b = ar2(3, 4);
    let w3 = ops::as_strided(&b, &[2, 2, 2], &[4, 4, 1], 1).unwrap();
    check_i(&w3, &[2, 2, 2], &[1, 2, 5, 6, 5, 6, 9, 10]);

    let t = ar2(2, 3).transpose().unwrap();
    let c = ops::contiguous(&t).unwrap();
    check_i(&c, &[3, 2], &[0, 3, 1, 4, 2, 5]);
    c.eval().unwrap();
    assert_eq!(c.strides(), &[2, 1]);
}

#[test]
fn flip_and_roll() {
    let a = ar2(2, 3);
    check_i(&ops::flip(&a, &[1]).unwrap(), &[2, 3], &[2, 1, 0, 5, 4, 3]);
    check_i(&ops::flip(&a, &[0]).unwrap(), &[2, 3], &[3, 4, 5, 0, 1, 2]);
    check_i(&ops::flip(&a, &[0, 1]).unwrap(), &[2, 3], &[5, 4, 3, 2, 1, 0]);

    check_i(&ops::roll(&ar(5), 2, Some(0)).unwrap(), &[5], &[3, 4, 0, 1, 2]);
    check_i(&ops::roll(&ar(5), -1, Some(0)).unwrap(), &[5], &[1, 2, 3, 4, 0]);
    check_i(&ops::roll(&a, 1, Some(1)).unwrap(), &[2, 3], &[2, 0, 1, 5, 3, 4]);
    check_i(&ops::roll(&a, 1, Some(0)).unwrap(), &[2, 3], &[3, 4, 5, 0, 1, 2]);
    check_i(&ops::roll(&a, 1, None).unwrap(), &[2, 3], &[5, 0, 1, 2, 3, 4]);
    check_i(&ops::roll(&a, 8, None).unwrap(), &[2, 3], &[4, 5, 0, 1, 2, 3]);
}

#[test]
fn tril_triu() {
    let a = ia(&[1, 2, 3, 4, 5, 6, 7, 8, 9], &[3, 3]);
    check_i(&ops::tril(&a, 0).unwrap(), &[3, 3], &[1, 0, 0, 4, 5, 0, 7, 8, 9]);
    check_i(&ops::tril(&a, -1).unwrap(), &[3, 3], &[0, 0, 0, 4, 0, 0, 7, 8, 0]);
    check_i(&ops::tril(&a, 1).unwrap(), &[3, 3], &[1, 2, 0, 4, 5, 6, 7, 8, 9]);
    check_i(&ops::triu(&a, 0).unwrap(), &[3, 3], &[1, 2, 3, 0, 5, 6, 0, 0, 9]);
    check_i(&ops::triu(&a, 1).unwrap(), &[3, 3], &[0, 2, 3, 0, 0, 6, 0, 0, 0]);
    check_i(&ops::triu(&a, -1).unwrap(), &[3, 3], &[1, 2, 3, 4, 5, 6, 0, 8, 9]);
    let f = ops::ones(&[2, 3], Dtype::Float32).unwrap();
    check_f(&ops::tril(&f, 0).unwrap(), &[2, 3], &[1.0, 0.0, 0.0, 1.0, 1.0, 0.0]);
}

// ---------------------------------------------------------------------------------------------------
// indexing

#[test]
fn index_ints_and_ranges() {
    let a = ar(10);
    let last = a.index(idx![-1]).unwrap();
    assert_eq!(last.shape(), &[] as &[i32]);
    assert_eq!(last.item::<i32>().unwrap(), 9);
    assert_eq!(a.index(idx![3]).unwrap().item::<i32>().unwrap(), 3);
    assert_eq!(a.index(idx![-10]).unwrap().item::<i32>().unwrap(), 0);
    check_i(&a.index(idx![2..5]).unwrap(), &[3], &[2, 3, 4]);
    check_i(&a.index(idx![7..]).unwrap(), &[3], &[7, 8, 9]);
    check_i(&a.index(idx![-3..]).unwrap(), &[3], &[7, 8, 9]);
    check_i(&a.index(idx![..3]).unwrap(), &[3], &[0, 1, 2]);
    check_i(&a.index(idx![..-7]).unwrap(), &[3], &[0, 1, 2]);
    check_i(&a.index(idx![2..=4]).unwrap(), &[3], &[2, 3, 4]);
    check_i(&a.index(idx![..]).unwrap(), &[10], &(0..10).collect::<Vec<_>>());
    // Python clamps out-of-range slice bounds
    check_i(&a.index(idx![-100..100]).unwrap(), &[10], &(0..10).collect::<Vec<_>>());
    check_i(&a.index(&[Idx::step(Some(5), Some(2), 1)]).unwrap(), &[0], &[]); // [5:2]
    check_i(&a.index(idx![12..]).unwrap(), &[0], &[]);

    let b = ar2(3, 4);
    check_i(&b.index(idx![1.., -1]).unwrap(), &[2], &[7, 11]);
    check_i(&b.index(idx![-1]).unwrap(), &[4], &[8, 9, 10, 11]);
    check_i(&b.index(idx![.., 1]).unwrap(), &[3], &[1, 5, 9]);
    check_i(&b.index(idx![0..2, 1..3]).unwrap(), &[2, 2], &[1, 2, 5, 6]);
    assert_eq!(b.index(idx![2, 3]).unwrap().item::<i32>().unwrap(), 11);
}

#[test]
fn index_steps_python_semantics() {
    let a = ar(10);
    let s = |st: Option<i32>, en: Option<i32>, step: i32| iv(&a.index(&[Idx::step(st, en, step)]).unwrap());
    // arange(10)[8:2:-3] == [8, 5]
    assert_eq!(s(Some(8), Some(2), -3), vec![8, 5]);
    // [::-1]
    assert_eq!(s(None, None, -1), vec![9, 8, 7, 6, 5, 4, 3, 2, 1, 0]);
    // [::-4] == [9, 5, 1]
    assert_eq!(s(None, None, -4), vec![9, 5, 1]);
    // [1:8:3] == [1, 4, 7]
    assert_eq!(s(Some(1), Some(8), 3), vec![1, 4, 7]);
    // [::3] == [0, 3, 6, 9]
    assert_eq!(s(None, None, 3), vec![0, 3, 6, 9]);
    // [100::-3] == [9, 6, 3, 0]
    assert_eq!(s(Some(100), None, -3), vec![9, 6, 3, 0]);
    // [-2:-8:-2] == [8, 6, 4]
    assert_eq!(s(Some(-2), Some(-8), -2), vec![8, 6, 4]);
    // [5::-2] == [5, 3, 1]
    assert_eq!(s(Some(5), None, -2), vec![5, 3, 1]);
    // [:5:-1] == [9, 8, 7, 6]
    assert_eq!(s(None, Some(5), -1), vec![9, 8, 7, 6]);
    // [2:8:-1] == []
    assert_eq!(s(Some(2), Some(8), -1), Vec::<i32>::new());
    // [-100::-1] == []   (start clamps to -1)
    assert_eq!(s(Some(-100), None, -1), Vec::<i32>::new());
    // [3:-100:-1] == [3, 2, 1, 0]
    assert_eq!(s(Some(3), Some(-100), -1), vec![3, 2, 1, 0]);

    let b = ar2(3, 4);
    let r = b.index(&[Idx::step(None, None, -1), Idx::step(None, None, 2)]).unwrap();
    check_i(&r, &[3, 2], &[8, 10, 4, 6, 0, 2]);
    let r2 = b.index(&[Idx::At(0), Idx::step(None, None, -2)]).unwrap();
    check_i(&r2, &[2], &[3, 1]);
    let r3 = b.index(&[Idx::step(Some(2), Some(0), -1), Idx::step(Some(3), Some(0), -2)]).unwrap();
    check_i(&r3, &[2, 2], &[11, 9, 7, 5]);
    assert!(matches!(a.index(&[Idx::step(None, None, 0)]), Err(Error::InvalidArgument(_))));
}

#[test]
fn index_new_axis() {
    let b = ar2(3, 4);
    check_i(&b.index(&[Idx::NewAxis, Idx::At(1)]).unwrap(), &[1, 4], &[4, 5, 6, 7]);
    let r = b.index(&[Idx::from(..), Idx::NewAxis, Idx::from(1..3)]).unwrap();
    check_i(&r, &[3, 1, 2], &[1, 2, 5, 6, 9, 10]);
    let r2 = b.index(&[Idx::NewAxis]).unwrap();
    check_i(&r2, &[1, 3, 4], &(0..12).collect::<Vec<_>>());
    let r3 = b.index(&[Idx::from(..), Idx::from(..), Idx::NewAxis]).unwrap();
    assert_eq!(r3.shape(), &[3, 4, 1]);
    let r4 = b.index(&[Idx::At(-1), Idx::NewAxis, Idx::At(0)]).unwrap();
    check_i(&r4, &[1], &[8]);
}

#[test]
fn index_errors() {
    let a = ar(10);
    assert!(matches!(a.index(idx![10]), Err(Error::InvalidArgument(_))));
    assert!(matches!(a.index(idx![-11]), Err(Error::InvalidArgument(_))));
    assert!(matches!(a.index(idx![0, 0]), Err(Error::InvalidArgument(_))));
    let b = ar2(3, 4);
    assert!(matches!(b.index(idx![.., 4]), Err(Error::InvalidArgument(_))));
    assert!(matches!(b.index(idx![3]), Err(Error::InvalidArgument(_))));
    assert!(matches!(b.slice_axis(2, 0, 1, 1), Err(Error::InvalidArgument(_))));
}

#[test]
fn slice_axis_and_slice() {
    let b = ar2(3, 4);
    check_i(&b.slice_axis(1, 3, 0, -2).unwrap(), &[3, 2], &[3, 1, 7, 5, 11, 9]);
    check_i(&b.slice_axis(0, 1, 3, 1).unwrap(), &[2, 4], &[4, 5, 6, 7, 8, 9, 10, 11]);
    check_i(&b.slice_axis(-1, 0, 4, 3).unwrap(), &[3, 2], &[0, 3, 4, 7, 8, 11]);

    check_i(&ops::slice(&b, &[0, 1], &[3, 4], &[2, 2]).unwrap(), &[2, 2], &[1, 3, 9, 11]);
    check_i(&ops::slice(&b, &[1, 0], &[2, 4], &[1, 1]).unwrap(), &[1, 4], &[4, 5, 6, 7]);
    check_i(&ops::slice(&ar(10), &[2], &[9], &[3]).unwrap(), &[3], &[2, 5, 8]);
}

#[test]
fn slice_updates() {
    let z = ops::zeros(&[3, 4], Dtype::Int32).unwrap();
    let up = ia(&[1, 2, 3, 4], &[2, 2]);
    let out = ops::slice_update(&z, &up, &[1, 1], &[3, 3], &[1, 1]).unwrap();
    check_i(&out, &[3, 4], &[0, 0, 0, 0, 0, 1, 2, 0, 0, 3, 4, 0]);
    // strided update
    let z6 = ops::zeros(&[6], Dtype::Int32).unwrap();
    let out2 = ops::slice_update(&z6, &ia(&[7, 8, 9], &[3]), &[0], &[6], &[2]).unwrap();
    check_i(&out2, &[6], &[7, 0, 8, 0, 9, 0]);
    // broadcast update
    let out3 = ops::slice_update(&z, &Array::scalar(5i32), &[0, 2], &[3, 4], &[1, 1]).unwrap();
    check_i(&out3, &[3, 4], &[0, 0, 5, 5, 0, 0, 5, 5, 0, 0, 5, 5]);
    // the source is unchanged
    check_i(&z, &[3, 4], &[0; 12]);
}

#[test]
fn slice_update_dynamic_array_start() {
    let z = ops::zeros(&[4, 4], Dtype::Float32).unwrap();
    let up = fa(&[5.0, 6.0], &[1, 2]);
    let start = ia(&[2, 1], &[2]);
    let out = ops::slice_update_dynamic(&z, &up, &start, &[0, 1]).unwrap();
    #[rustfmt::skip]
    let want = [
        0.0, 0.0, 0.0, 0.0,
        0.0, 0.0, 0.0, 0.0,
        0.0, 5.0, 6.0, 0.0,
        0.0, 0.0, 0.0, 0.0,
    ];
    check_f(&out, &[4, 4], &want);
    // one axis only: a KV-cache style row write
    let rows = ops::zeros(&[3, 2], Dtype::Int32).unwrap();
    let out2 = ops::slice_update_dynamic(&rows, &ia(&[8, 9], &[1, 2]), &ia(&[1], &[1]), &[0]).unwrap();
    check_i(&out2, &[3, 2], &[0, 0, 8, 9, 0, 0]);
    // a scalar start
    let out3 = ops::slice_update_dynamic(&rows, &ia(&[4, 4], &[1, 2]), &Array::scalar(2i32), &[0]).unwrap();
    check_i(&out3, &[3, 2], &[0, 0, 0, 0, 4, 4]);
}

#[test]
fn slice_dynamic_array_start() {
    let b = ar2(3, 4);
    let s = ops::slice_dynamic(&b, &ia(&[1], &[1]), &[1], &[3, 2]).unwrap();
    check_i(&s, &[3, 2], &[1, 2, 5, 6, 9, 10]);
    let s2 = ops::slice_dynamic(&b, &ia(&[1, 2], &[2]), &[0, 1], &[2, 2]).unwrap();
    check_i(&s2, &[2, 2], &[6, 7, 10, 11]);
    let s3 = ops::slice_dynamic(&b, &Array::scalar(2i32), &[0], &[1, 4]).unwrap();
    check_i(&s3, &[1, 4], &[8, 9, 10, 11]);
}

#[test]
fn take_variants() {
    let b = ar2(3, 4);
    let rows = ops::take(&b, &ia(&[2, 0], &[2]), Some(0)).unwrap();
    check_i(&rows, &[2, 4], &[8, 9, 10, 11, 0, 1, 2, 3]);
    let cols = b.take(&ia(&[3, 3, 0], &[3]), Some(1)).unwrap();
    check_i(&cols, &[3, 3], &[3, 3, 0, 7, 7, 4, 11, 11, 8]);
    let flat = ops::take(&b, &ia(&[0, 5, 11, 1], &[2, 2]), None).unwrap();
    check_i(&flat, &[2, 2], &[0, 5, 11, 1]);
    // a scalar index removes the axis
    let one = ops::take(&b, &Array::scalar(1i32), Some(1)).unwrap();
    check_i(&one, &[3], &[1, 5, 9]);
    // negative indices count from the end (MLX gather wraps them)
    let neg = ops::take(&ar(5), &ia(&[-1, -5], &[2]), Some(0)).unwrap();
    check_i(&neg, &[2], &[4, 0]);
}

#[test]
fn take_and_put_along_axis() {
    let a = ia(&[10, 30, 20, 60, 40, 50], &[2, 3]);
    let idx = ia(&[0, 2, 1, 1, 2, 0], &[2, 3]);
    check_i(&ops::take_along_axis(&a, &idx, Some(1)).unwrap(), &[2, 3], &[10, 20, 30, 40, 50, 60]);
    let idx0 = ia(&[1, 0, 1], &[1, 3]);
    check_i(&ops::take_along_axis(&a, &idx0, Some(0)).unwrap(), &[1, 3], &[60, 30, 50]);
    check_i(&ops::take_along_axis(&a, &ia(&[5, 0], &[2]), None).unwrap(), &[2], &[50, 10]);

    let z = ops::zeros(&[2, 3], Dtype::Int32).unwrap();
    let p = ops::put_along_axis(&z, &ia(&[1, 2], &[2, 1]), &ia(&[7, 8], &[2, 1]), Some(1)).unwrap();
    check_i(&p, &[2, 3], &[0, 7, 0, 0, 0, 8]);
    let p0 = ops::put_along_axis(&z, &ia(&[1, 0, 1], &[1, 3]), &ia(&[1, 2, 3], &[1, 3]), Some(0)).unwrap();
    check_i(&p0, &[2, 3], &[0, 2, 0, 1, 0, 3]);
    let pn = ops::put_along_axis(&z, &ia(&[0, 4], &[2]), &ia(&[1, 2], &[2]), None).unwrap();
    check_i(&pn, &[2, 3], &[1, 0, 0, 0, 2, 0]);
}

#[test]
fn scatter_add_axis_accumulates() {
    let z = ops::zeros(&[2, 3], Dtype::Float32).unwrap();
    let idx = ia(&[0, 0, 2, 1, 1, 1], &[2, 3]);
    let vals = fa(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let out = ops::scatter_add_axis(&z, &idx, &vals, 1).unwrap();
    check_f(&out, &[2, 3], &[3.0, 0.0, 3.0, 0.0, 15.0, 0.0]);
    let out0 = ops::scatter_add_axis(&z, &ia(&[1, 1, 0], &[1, 3]), &fa(&[1.0, 2.0, 3.0], &[1, 3]), 0).unwrap();
    check_f(&out0, &[2, 3], &[0.0, 0.0, 3.0, 1.0, 2.0, 0.0]);
}

#[test]
fn scatter_and_scatter_add() {
    let z = ops::zeros(&[4, 2], Dtype::Int32).unwrap();
    let rows = ia(&[3, 1], &[2]);
    let upd = ia(&[1, 2, 3, 4], &[2, 1, 2]);
    let s = ops::scatter(&z, &[&rows], &upd, &[0]).unwrap();
    check_i(&s, &[4, 2], &[0, 0, 3, 4, 0, 0, 1, 2]);

    let o = ops::ones(&[4, 2], Dtype::Int32).unwrap();
    let rep = ia(&[1, 1, 3], &[3]);
    let upd2 = ia(&[1, 1, 2, 2, 5, 5], &[3, 1, 2]);
    let sa = ops::scatter_add(&o, &[&rep], &upd2, &[0]).unwrap();
    check_i(&sa, &[4, 2], &[1, 1, 4, 4, 1, 1, 6, 6]);

    // two index arrays, one per axis: element updates
    let z3 = ops::zeros(&[3, 3], Dtype::Float32).unwrap();
    let r = ia(&[0, 2, 0], &[3]);
    let c = ia(&[1, 0, 1], &[3]);
    let u = fa(&[5.0, 6.0, 7.0], &[3, 1, 1]);
    let sa2 = ops::scatter_add(&z3, &[&r, &c], &u, &[0, 1]).unwrap();
    check_f(&sa2, &[3, 3], &[0.0, 12.0, 0.0, 0.0, 0.0, 0.0, 6.0, 0.0, 0.0]);
    let s2 =
        ops::scatter(&z3, &[&ia(&[0, 2], &[2]), &ia(&[1, 0], &[2])], &fa(&[5.0, 6.0], &[2, 1, 1]), &[0, 1]).unwrap();
    check_f(&s2, &[3, 3], &[0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 6.0, 0.0, 0.0]);
}

#[test]
fn gather_slices() {
    let b = ar2(3, 4);
    let g = ops::gather(&b, &[&ia(&[2, 0], &[2])], &[0], &[1, 4]).unwrap();
    check_i(&g, &[2, 1, 4], &[8, 9, 10, 11, 0, 1, 2, 3]);
    let g2 = ops::gather(&b, &[&ia(&[0, 1], &[2]), &ia(&[1, 2], &[2])], &[0, 1], &[2, 2]).unwrap();
    check_i(&g2, &[2, 2, 2], &[1, 2, 5, 6, 6, 7, 10, 11]);
    let g3 = ops::gather(&b, &[&ia(&[3, 0], &[2])], &[1], &[3, 1]).unwrap();
    check_i(&g3, &[2, 3, 1], &[3, 7, 11, 0, 4, 8]);
}

// ---------------------------------------------------------------------------------------------------
// sorting

#[test]
fn sort_argsort() {
    let a = ia(&[3, 1, 2, 0, 5, 4], &[2, 3]);
    check_i(&ops::sort(&a, Some(1)).unwrap(), &[2, 3], &[1, 2, 3, 0, 4, 5]);
    check_i(&ops::sort(&a, Some(-1)).unwrap(), &[2, 3], &[1, 2, 3, 0, 4, 5]);
    check_i(&ops::sort(&a, Some(0)).unwrap(), &[2, 3], &[0, 1, 2, 3, 5, 4]);
    check_i(&ops::sort(&a, None).unwrap(), &[6], &[0, 1, 2, 3, 4, 5]);

    let s = ops::argsort(&a, Some(1)).unwrap();
    assert_eq!(s.dtype(), Dtype::Uint32);
    assert_eq!(s.shape(), &[2, 3]);
    assert_eq!(s.to_vec::<u32>().unwrap(), vec![1, 2, 0, 0, 2, 1]);
    assert_eq!(ops::argsort(&a, Some(0)).unwrap().to_vec::<u32>().unwrap(), vec![1, 0, 0, 0, 1, 1]);
    let sn = ops::argsort(&a, None).unwrap();
    assert_eq!(sn.shape(), &[6]);
    assert_eq!(sn.to_vec::<u32>().unwrap(), vec![3, 1, 2, 0, 5, 4]);

    let f = fa(&[0.5, -1.0, 2.0, -3.5], &[4]);
    check_f(&ops::sort(&f, Some(0)).unwrap(), &[4], &[-3.5, -1.0, 0.5, 2.0]);
}

#[test]
fn partition_argpartition() {
    let data = [9, 1, 8, 2, 7, 3, 6, 4, 5, 0];
    let a = ia(&data, &[10]);
    for kth in [0, 4, 9] {
        let p = iv(&ops::partition(&a, kth, Some(0)).unwrap());
        let k = kth as usize;
        assert_eq!(p[k], kth, "partition kth={kth}: {p:?}");
        assert!(p[..k].iter().all(|&v| v <= p[k]));
        assert!(p[k + 1..].iter().all(|&v| v >= p[k]));
        let mut sorted = p.clone();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());

        let ap = ops::argpartition(&a, kth, Some(0)).unwrap();
        assert_eq!(ap.dtype(), Dtype::Uint32);
        let ap = ap.to_vec::<u32>().unwrap();
        let vals: Vec<i32> = ap.iter().map(|&i| data[i as usize]).collect();
        assert_eq!(vals[k], kth);
        assert!(vals[..k].iter().all(|&v| v <= kth));
        assert!(vals[k + 1..].iter().all(|&v| v >= kth));
        let mut perm = ap.clone();
        perm.sort();
        assert_eq!(perm, (0..10).collect::<Vec<u32>>());
    }
    // 2-D along axis 1 and flattened
    let m = ia(&[5, 3, 9, 1, 8, 0, 7, 2], &[2, 4]);
    let pm = iv(&ops::partition(&m, 1, Some(1)).unwrap());
    // row 0 sorted: [1,3,5,9] -> kth 1 is 3; row 1 sorted: [0,2,7,8] -> 2
    assert_eq!(pm[1], 3);
    assert!(pm[0] <= 3 && pm[2..4].iter().all(|&v| v >= 3));
    assert_eq!(pm[5], 2);
    assert!(pm[4] <= 2 && pm[6..8].iter().all(|&v| v >= 2));
    let pf = ops::partition(&m, 5, None).unwrap();
    assert_eq!(pf.shape(), &[8]);
    let pf = iv(&pf);
    // flattened sorted: [0,1,2,3,5,7,8,9] -> index 5 is 7
    assert_eq!(pf[5], 7);
    assert!(pf[..5].iter().all(|&v| v <= 7) && pf[6..].iter().all(|&v| v >= 7));
    let apf = ops::argpartition(&m, 5, None).unwrap().to_vec::<u32>().unwrap();
    let flat = [5, 3, 9, 1, 8, 0, 7, 2];
    assert_eq!(flat[apf[5] as usize], 7);
}

#[test]
fn topk_values() {
    let a = ia(&[9, 1, 8, 2, 7, 3, 6, 4, 5, 0], &[10]);
    let mut t = iv(&ops::topk(&a, 3, Some(0)).unwrap());
    t.sort();
    assert_eq!(t, vec![7, 8, 9]);
    let m = ia(&[5, 3, 9, 1, 8, 0, 7, 2], &[2, 4]);
    let tm = ops::topk(&m, 2, Some(1)).unwrap();
    assert_eq!(tm.shape(), &[2, 2]);
    let tm = iv(&tm);
    let (mut r0, mut r1) = (tm[0..2].to_vec(), tm[2..4].to_vec());
    r0.sort();
    r1.sort();
    assert_eq!(r0, vec![5, 9]);
    assert_eq!(r1, vec![7, 8]);
    let tn = ops::topk(&m, 3, None).unwrap();
    assert_eq!(tn.shape(), &[3]);
    let mut tn = iv(&tn);
    tn.sort();
    assert_eq!(tn, vec![7, 8, 9]);
    let tf = ops::topk(&fa(&[0.5, -1.0, 2.0, -3.5], &[4]), 2, Some(0)).unwrap();
    let mut tf = fv(&tf);
    tf.sort_by(|a, b| a.partial_cmp(b).unwrap());
    assert_eq!(tf, vec![0.5, 2.0]);
}

// ---------------------------------------------------------------------------------------------------
// products

fn matmul_ref(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|l| a[i * k + l] * b[l * n + j]).sum();
        }
    }
    out
}

#[test]
fn matmul_batched() {
    let a = ops::arange(0.0, 12.0, 1.0, Dtype::Float32).unwrap().reshape(&[2, 2, 3]).unwrap();
    let b = ops::arange(0.0, 12.0, 1.0, Dtype::Float32).unwrap().reshape(&[2, 3, 2]).unwrap();
    let c = a.matmul(&b).unwrap();
    check_f(&c, &[2, 2, 2], &[10.0, 13.0, 28.0, 40.0, 172.0, 193.0, 244.0, 274.0]);
    // broadcasting a single matrix over the batch
    let b0 = b.index(idx![0]).unwrap();
    let c2 = ops::matmul(&a, &b0).unwrap();
    let (av, bv) = (fv(&a), fv(&b0));
    let mut want = matmul_ref(&av[0..6], &bv, 2, 3, 2);
    want.extend(matmul_ref(&av[6..12], &bv, 2, 3, 2));
    check_f(&c2, &[2, 2, 2], &want);
    assert_eq!(&fv(&c2)[0..4], &[10.0, 13.0, 28.0, 40.0]);
    // batch 1 with B0: [[6,7,8],[9,10,11]] @ [[0,1],[2,3],[4,5]]
    assert_eq!(&fv(&c2)[4..], &[46.0, 67.0, 64.0, 94.0]);
    // vector @ matrix (1-D promotion)
    let v = fa(&[1.0, 2.0], &[2]);
    check_f(&v.matmul(&fa(&[1.0, 2.0, 3.0, 4.0], &[2, 2])).unwrap(), &[2], &[7.0, 10.0]);
    assert!(matches!(a.matmul(&a), Err(Error::Mlx(_))));
}

#[test]
fn addmm_outer_einsum_tensordot() {
    let c = fa(&[1.0, 1.0, 1.0, 1.0], &[2, 2]);
    let a = fa(&[1.0, 2.0, 3.0, 4.0], &[2, 2]);
    let b = fa(&[5.0, 6.0, 7.0, 8.0], &[2, 2]);
    check_f(&ops::addmm(&c, &a, &b, 1.0, 1.0).unwrap(), &[2, 2], &[20.0, 23.0, 44.0, 51.0]);
    check_f(&ops::addmm(&c, &a, &b, 2.0, 0.5).unwrap(), &[2, 2], &[38.5, 44.5, 86.5, 100.5]);
    // c broadcasts
    check_f(&ops::addmm(&fa(&[10.0, 20.0], &[2]), &a, &b, 1.0, 1.0).unwrap(), &[2, 2], &[29.0, 42.0, 53.0, 70.0]);

    let o = ops::outer(&fa(&[1.0, 2.0, 3.0], &[3]), &fa(&[4.0, 5.0], &[2])).unwrap();
    check_f(&o, &[3, 2], &[4.0, 5.0, 8.0, 10.0, 12.0, 15.0]);

    check_f(&ops::einsum("ij,jk->ik", &[&a, &b]).unwrap(), &[2, 2], &[19.0, 22.0, 43.0, 50.0]);
    let sq = ops::arange(0.0, 9.0, 1.0, Dtype::Float32).unwrap().reshape(&[3, 3]).unwrap();
    check_f(&ops::einsum("ii->i", &[&sq]).unwrap(), &[3], &[0.0, 4.0, 8.0]);
    check_f(&ops::einsum("ii", &[&sq]).unwrap(), &[], &[12.0]);
    check_f(&ops::einsum("ij->ji", &[&a]).unwrap(), &[2, 2], &[1.0, 3.0, 2.0, 4.0]);
    let x = ops::arange(0.0, 12.0, 1.0, Dtype::Float32).unwrap().reshape(&[2, 2, 3]).unwrap();
    let y = ops::arange(0.0, 12.0, 1.0, Dtype::Float32).unwrap().reshape(&[2, 3, 2]).unwrap();
    check_f(
        &ops::einsum("bij,bjk->bik", &[&x, &y]).unwrap(),
        &[2, 2, 2],
        &[10.0, 13.0, 28.0, 40.0, 172.0, 193.0, 244.0, 274.0],
    );
    assert!(matches!(ops::einsum("ij,jk->ik", &[&a]), Err(Error::Mlx(_))));

    // tensordot over one axis == matmul
    check_f(&ops::tensordot(&a, &b, &[1], &[0]).unwrap(), &[2, 2], &[19.0, 22.0, 43.0, 50.0]);
    // over two axes: full contraction == sum(a * b)
    check_f(&ops::tensordot(&a, &b, &[0, 1], &[0, 1]).unwrap(), &[], &[70.0]);
    // [2,3,4] . [4,3] over (axis 2 of t) x (axis 0 of u)
    let t = ops::arange(0.0, 24.0, 1.0, Dtype::Float32).unwrap().reshape(&[2, 3, 4]).unwrap();
    let u = ops::arange(0.0, 12.0, 1.0, Dtype::Float32).unwrap().reshape(&[4, 3]).unwrap();
    let td = ops::tensordot(&t, &u, &[2], &[0]).unwrap();
    let want = matmul_ref(&fv(&t), &fv(&u), 6, 4, 3);
    check_f(&td, &[2, 3, 3], &want);
    // first row by hand: [0,1,2,3] @ u = [0*0+1*3+2*6+3*9, 1*... ] = [42, 48, 54]
    assert_eq!(&want[0..3], &[42.0, 48.0, 54.0]);
    // contracting axes (1, 2) of t with (1, 0) of u: out[i] = sum_jk t[i,j,k] u[k,j]
    let td2 = ops::tensordot(&t, &u, &[1, 2], &[1, 0]).unwrap();
    let (tv, uv) = (fv(&t), fv(&u));
    let want2: Vec<f32> = (0..2)
        .map(|i| {
            let mut s = 0.0;
            for j in 0..3 {
                for k in 0..4 {
                    s += tv[i * 12 + j * 4 + k] * uv[k * 3 + j];
                }
            }
            s
        })
        .collect();
    check_f(&td2, &[2], &want2);
}
