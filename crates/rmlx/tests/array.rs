#![allow(clippy::excessive_precision, clippy::approx_constant, clippy::bool_assert_comparison)]
//! Integration tests of `Array`: creation, metadata, reading values back (also from non-contiguous
//! views), dtype conversions, errors, formatting, operators and evaluation.

use rmlx::ops::{self, Idx};
use rmlx::{bf16, f16, idx, Array, Complex32, Dtype, Element, Error, Result};

fn arange_i32(n: i32, shape: &[i32]) -> Result<Array> {
    ops::arange(0.0, n as f64, 1.0, Dtype::Int32)?.reshape(shape)
}

/// Creates a [2, 2] array of `data`, checks the metadata and that the values come back unchanged.
fn round_trip<T: Element + PartialEq + std::fmt::Debug>(data: [T; 4], dtype: Dtype, itemsize: usize) -> Result<()> {
    let a = Array::from_slice(&data, &[2, 2])?;
    assert_eq!(a.dtype(), dtype);
    assert_eq!(a.shape(), &[2, 2]);
    assert_eq!(a.ndim(), 2);
    assert_eq!(a.size(), 4);
    assert_eq!(a.itemsize(), itemsize);
    assert_eq!(a.nbytes(), 4 * itemsize);
    assert_eq!(dtype.size(), itemsize);
    assert_eq!(a.to_vec::<T>()?, data.to_vec());
    Ok(())
}

// ---- creation and round trips -------------------------------------------------------------------

#[test]
fn from_slice_round_trips_every_dtype() -> Result<()> {
    round_trip([true, false, false, true], Dtype::Bool, 1)?;
    round_trip([0u8, 1, 127, 255], Dtype::Uint8, 1)?;
    round_trip([0u16, 1, 40000, u16::MAX], Dtype::Uint16, 2)?;
    round_trip([0u32, 1, 3_000_000_000, u32::MAX], Dtype::Uint32, 4)?;
    round_trip([0u64, 1, 1 << 40, u64::MAX], Dtype::Uint64, 8)?;
    round_trip([i8::MIN, -1, 0, i8::MAX], Dtype::Int8, 1)?;
    round_trip([i16::MIN, -1, 0, i16::MAX], Dtype::Int16, 2)?;
    round_trip([i32::MIN, -1, 0, i32::MAX], Dtype::Int32, 4)?;
    round_trip([i64::MIN, -1, 1 << 50, i64::MAX], Dtype::Int64, 8)?;
    round_trip([f16::from_f32(1.5), f16::from_f32(-0.25), f16::MAX, f16::from_f32(1.0009765625)], Dtype::Float16, 2)?;
    round_trip([bf16::from_f32(1.5), bf16::from_f32(-0.25), bf16::MAX, bf16::from_f32(3.0e38)], Dtype::Bfloat16, 2)?;
    round_trip([1.5f32, -0.1, f32::MAX, f32::MIN_POSITIVE], Dtype::Float32, 4)?;
    round_trip([0.1f64, -1e300, f64::MAX, std::f64::consts::PI], Dtype::Float64, 8)?;
    round_trip(
        [Complex32::new(1.0, -2.0), Complex32::new(0.5, 0.25), Complex32::new(-3.0, 0.0), Complex32::new(0.0, 7.0)],
        Dtype::Complex64,
        8,
    )?;
    Ok(())
}

#[test]
fn float_special_values_round_trip_bit_exactly() -> Result<()> {
    let data = [f32::INFINITY, f32::NEG_INFINITY, -0.0, f32::from_bits(1)];
    let back = Array::from_slice(&data, &[4])?.to_vec::<f32>()?;
    let bits: Vec<u32> = back.iter().map(|v| v.to_bits()).collect();
    assert_eq!(bits, data.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    let nan = Array::from_slice(&[f32::NAN], &[1])?.item::<f32>()?;
    assert!(nan.is_nan());
    Ok(())
}

#[test]
fn float64_computes_on_cpu() -> Result<()> {
    // MLX computes float64 only on the CPU; on a GPU default device it is an error.
    rmlx::with_device(rmlx::Device::cpu(), float64_sum)?;
    if rmlx::Device::gpu().is_available() {
        let on_gpu = rmlx::with_device(rmlx::Device::gpu(), float64_sum);
        assert!(matches!(on_gpu, Err(rmlx::Error::Mlx(m)) if m.contains("float64 is not supported on the GPU")));
    }
    Ok(())
}

fn float64_sum() -> Result<()> {
    let a = Array::from_slice(&[0.1f64, 0.2], &[2])?;
    let s = (&a + 1e-12f32)?; // f32 scalar takes the float64 dtype of the array
    assert_eq!(s.dtype(), Dtype::Float64);
    let sum = a.sum(rmlx::Axes::All, false)?;
    assert_eq!(sum.dtype(), Dtype::Float64);
    assert_eq!(sum.item::<f64>()?, 0.1f64 + 0.2f64);
    Ok(())
}

#[test]
fn empty_and_scalar_shapes() -> Result<()> {
    let e = Array::from_slice::<f32>(&[], &[0, 3])?;
    assert_eq!(e.shape(), &[0, 3]);
    assert_eq!(e.size(), 0);
    assert_eq!(e.nbytes(), 0);
    assert_eq!(e.to_vec::<f32>()?, Vec::<f32>::new());

    let s = Array::from_slice(&[42i32], &[])?;
    assert_eq!(s.ndim(), 0);
    assert_eq!(s.shape(), &[] as &[i32]);
    assert_eq!(s.size(), 1);
    assert_eq!(s.item::<i32>()?, 42);
    Ok(())
}

#[test]
fn scalar_and_scalar_as() -> Result<()> {
    let s = Array::scalar(2.5f32);
    assert_eq!(s.shape(), &[] as &[i32]);
    assert_eq!(s.ndim(), 0);
    assert_eq!(s.size(), 1);
    assert_eq!(s.dtype(), Dtype::Float32);
    assert_eq!(s.item::<f32>()?, 2.5);

    assert_eq!(Array::scalar(true).item::<bool>()?, true);
    assert_eq!(Array::scalar(-7i64).item::<i64>()?, -7);
    assert_eq!(Array::scalar(u16::MAX).item::<u16>()?, u16::MAX);
    assert_eq!(Array::scalar(Complex32::new(1.0, 2.0)).item::<Complex32>()?, Complex32::new(1.0, 2.0));
    assert_eq!(Array::scalar(bf16::from_f32(0.5)).dtype(), Dtype::Bfloat16);

    let h = Array::scalar_as(1.0 / 3.0, Dtype::Float16)?;
    assert_eq!(h.dtype(), Dtype::Float16);
    assert_eq!(h.item::<f16>()?, f16::from_f64(1.0 / 3.0));
    let i = Array::scalar_as(3.9, Dtype::Int32)?;
    assert_eq!(i.dtype(), Dtype::Int32);
    assert_eq!(i.item::<i32>()?, 3);
    let u = Array::scalar_as(200.0, Dtype::Uint8)?;
    assert_eq!(u.item::<u8>()?, 200);
    let b = Array::scalar_as(2.0, Dtype::Bool)?;
    assert_eq!(b.item::<bool>()?, true);
    let d = Array::scalar_as(0.1, Dtype::Float64)?;
    assert_eq!(d.item::<f64>()?, 0.1);
    Ok(())
}

#[test]
fn metadata_and_dim() -> Result<()> {
    let a = Array::from_slice(&[0i16; 24], &[2, 3, 4])?;
    assert_eq!(a.shape(), &[2, 3, 4]);
    assert_eq!(a.ndim(), 3);
    assert_eq!(a.size(), 24);
    assert_eq!(a.dtype(), Dtype::Int16);
    assert_eq!(a.itemsize(), 2);
    assert_eq!(a.nbytes(), 48);
    assert_eq!(a.dim(0)?, 2);
    assert_eq!(a.dim(2)?, 4);
    assert_eq!(a.dim(-1)?, 4);
    assert_eq!(a.dim(-3)?, 2);
    assert!(matches!(a.dim(3), Err(Error::InvalidArgument(_))));
    assert!(matches!(a.dim(-4), Err(Error::InvalidArgument(_))));
    Ok(())
}

// ---- non-contiguous views -----------------------------------------------------------------------

#[test]
fn to_vec_of_transpose() -> Result<()> {
    let a = arange_i32(6, &[2, 3])?;
    let t = a.transpose()?;
    assert_eq!(t.shape(), &[3, 2]);
    assert_eq!(t.to_vec::<i32>()?, vec![0, 3, 1, 4, 2, 5]);
    // Evaluated transpose is a strided view; reading it again gives the same order.
    t.eval()?;
    assert_eq!(t.to_vec::<i32>()?, vec![0, 3, 1, 4, 2, 5]);
    // A float transpose too.
    let f = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2])?.transpose()?;
    assert_eq!(f.to_vec::<f32>()?, vec![1.0, 3.0, 5.0, 2.0, 4.0, 6.0]);
    Ok(())
}

#[test]
fn to_vec_of_broadcast() -> Result<()> {
    let row = Array::from_slice(&[1i32, 2, 3], &[3])?;
    assert_eq!(row.broadcast_to(&[2, 3])?.to_vec::<i32>()?, vec![1, 2, 3, 1, 2, 3]);
    let col = Array::from_slice(&[1i32, 2, 3], &[3, 1])?;
    let b = col.broadcast_to(&[3, 2])?;
    assert_eq!(b.shape(), &[3, 2]);
    assert_eq!(b.to_vec::<i32>()?, vec![1, 1, 2, 2, 3, 3]);
    let s = Array::scalar(7u8).broadcast_to(&[2, 2])?;
    assert_eq!(s.to_vec::<u8>()?, vec![7; 4]);
    Ok(())
}

#[test]
fn to_vec_of_strided_slices() -> Result<()> {
    let a = arange_i32(12, &[3, 4])?;
    // a[:, ::2]
    assert_eq!(a.index(idx![.., Idx::step(None, None, 2)])?.to_vec::<i32>()?, vec![0, 2, 4, 6, 8, 10]);
    // a[1:, 1::2]
    let s = a.index(idx![1.., Idx::step(Some(1), None, 2)])?;
    assert_eq!(s.shape(), &[2, 2]);
    assert_eq!(s.to_vec::<i32>()?, vec![5, 7, 9, 11]);
    // a[::2, 1:3]
    assert_eq!(a.index(idx![Idx::step(None, None, 2), 1..3])?.to_vec::<i32>()?, vec![1, 2, 9, 10]);
    // a[:, 2]
    assert_eq!(a.index(idx![.., 2])?.to_vec::<i32>()?, vec![2, 6, 10]);
    // slice_axis(1, 0, 4, 3) = a[:, 0:4:3]
    assert_eq!(a.slice_axis(1, 0, 4, 3)?.to_vec::<i32>()?, vec![0, 3, 4, 7, 8, 11]);
    Ok(())
}

#[test]
fn to_vec_of_negative_step_index() -> Result<()> {
    let v = ops::arange(0.0, 6.0, 1.0, Dtype::Int32)?;
    assert_eq!(v.index(idx![Idx::step(None, None, -1)])?.to_vec::<i32>()?, vec![5, 4, 3, 2, 1, 0]);
    assert_eq!(v.index(idx![Idx::step(Some(4), Some(0), -2)])?.to_vec::<i32>()?, vec![4, 2]);
    let a = arange_i32(12, &[3, 4])?;
    // a[::-1, ::-2]
    let r = a.index(idx![Idx::step(None, None, -1), Idx::step(None, None, -2)])?;
    assert_eq!(r.shape(), &[3, 2]);
    assert_eq!(r.to_vec::<i32>()?, vec![11, 9, 7, 5, 3, 1]);
    Ok(())
}

#[test]
fn to_vec_of_swapaxes_3d() -> Result<()> {
    let a = arange_i32(24, &[2, 3, 4])?;
    let s = a.swapaxes(0, 2)?;
    assert_eq!(s.shape(), &[4, 3, 2]);
    let mut expected = Vec::new();
    for i in 0..4 {
        for j in 0..3 {
            for k in 0..2 {
                expected.push(k * 12 + j * 4 + i);
            }
        }
    }
    assert_eq!(s.to_vec::<i32>()?, expected);
    assert_eq!(&expected[..6], &[0, 12, 4, 16, 8, 20]);

    let p = a.transpose_axes(&[1, 0, 2])?;
    let mut expected = Vec::new();
    for j in 0..3 {
        for i in 0..2 {
            for k in 0..4 {
                expected.push(i * 12 + j * 4 + k);
            }
        }
    }
    assert_eq!(p.to_vec::<i32>()?, expected);
    // A view of a view: swapaxes, then a slice.
    let v = s.index(idx![1.., 0])?; // s[1:, 0, :] -> shape [3, 2]; s[i,0,k] = k*12 + i
    assert_eq!(v.to_vec::<i32>()?, vec![1, 13, 2, 14, 3, 15]);
    Ok(())
}

// ---- dtype conversions --------------------------------------------------------------------------

#[test]
fn f32_to_bf16_and_back_rounds_to_nearest_even() -> Result<()> {
    let vals = [1.0f32, 1.0009765625, 1.0 / 3.0, 1.00390625, 1.01171875, -2.7182817, 65504.0, 3.0e-39];
    let a = Array::from_slice(&vals, &[vals.len() as i32])?;
    let b = a.astype(Dtype::Bfloat16)?;
    assert_eq!(b.dtype(), Dtype::Bfloat16);
    let back = b.astype(Dtype::Float32)?.to_vec::<f32>()?;
    let expected: Vec<f32> = vals.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    assert_eq!(back, expected);
    // Known values: bf16 has 8 significant bits.
    assert_eq!(back[1], 1.0); // 1 + 2^-10 is below half an ulp (2^-8)
    assert_eq!(back[2], 0.333984375);
    assert_eq!(back[3], 1.0); // 1 + 2^-8: a tie, to even
    assert_eq!(back[4], 1.015625); // 1 + 3*2^-8: a tie, to even (up)
    assert_eq!(b.to_vec::<bf16>()?, vals.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>());
    Ok(())
}

#[test]
fn f32_to_f16_and_back_rounds_to_nearest_even() -> Result<()> {
    let vals = [1.0f32, 1.0009765625, 1.0 / 3.0, 1.00048828125, 1.00146484375, 0.1, 65504.0, 1.0e5, 1.0e-8];
    let a = Array::from_slice(&vals, &[vals.len() as i32])?;
    let h = a.astype(Dtype::Float16)?;
    assert_eq!(h.dtype(), Dtype::Float16);
    let back = h.astype(Dtype::Float32)?.to_vec::<f32>()?;
    let expected: Vec<f32> = vals.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
    assert_eq!(back, expected);
    assert_eq!(back[1], 1.0009765625); // exact in f16 (1 + 2^-10)
    assert_eq!(back[2], 0.333251953125);
    assert_eq!(back[3], 1.0); // 1 + 2^-11: a tie, to even
    assert_eq!(back[4], 1.001953125); // 1 + 3*2^-11: a tie, to even (up)
    assert_eq!(back[5], 0.0999755859375);
    assert_eq!(back[6], 65504.0);
    assert_eq!(back[7], f32::INFINITY); // overflow
    assert_eq!(back[8], 0.0); // below half the smallest subnormal
    Ok(())
}

#[test]
fn astype_float_to_int_truncates_toward_zero() -> Result<()> {
    let a = Array::from_slice(&[1.7f32, -1.7, 2.5, -0.5, 0.99, -3.0], &[6])?;
    assert_eq!(a.astype(Dtype::Int32)?.to_vec::<i32>()?, vec![1, -1, 2, 0, 0, -3]);
    assert_eq!(a.astype(Dtype::Int64)?.to_vec::<i64>()?, vec![1, -1, 2, 0, 0, -3]);
    assert_eq!(a.astype(Dtype::Int8)?.to_vec::<i8>()?, vec![1, -1, 2, 0, 0, -3]);
    let b = Array::from_slice(&[0.0f32, 0.5, -2.0], &[3])?;
    assert_eq!(b.astype(Dtype::Bool)?.to_vec::<bool>()?, vec![false, true, true]);
    let i = Array::from_slice(&[-1i32, 0, 3], &[3])?;
    assert_eq!(i.astype(Dtype::Float32)?.to_vec::<f32>()?, vec![-1.0, 0.0, 3.0]);
    assert_eq!(i.astype(Dtype::Bool)?.to_vec::<bool>()?, vec![true, false, true]);
    assert_eq!(
        i.astype(Dtype::Complex64)?.to_vec::<Complex32>()?,
        vec![Complex32::new(-1.0, 0.0), Complex32::new(0.0, 0.0), Complex32::new(3.0, 0.0)]
    );
    // Same dtype: the same array.
    assert_eq!(i.astype(Dtype::Int32)?.id(), i.id());
    Ok(())
}

#[test]
fn view_as_reinterprets_bits() -> Result<()> {
    let a = Array::from_slice(&[1.0f32, -2.0], &[2])?;
    let u = a.view_as(Dtype::Uint32)?;
    assert_eq!(u.dtype(), Dtype::Uint32);
    assert_eq!(u.to_vec::<u32>()?, vec![0x3f80_0000, 0xc000_0000]);
    // Smaller type: the last dimension grows (little-endian halves).
    let h = Array::from_slice(&[1.0f32], &[1])?.view_as(Dtype::Uint16)?;
    assert_eq!(h.shape(), &[2]);
    assert_eq!(h.to_vec::<u16>()?, vec![0x0000, 0x3f80]);
    // Larger type: the last dimension shrinks.
    let w = Array::from_slice(&[0x0000u16, 0x3f80, 0x0000, 0x4000], &[4])?.view_as(Dtype::Float32)?;
    assert_eq!(w.shape(), &[2]);
    assert_eq!(w.to_vec::<f32>()?, vec![1.0, 2.0]);
    Ok(())
}

// ---- errors -------------------------------------------------------------------------------------

#[test]
fn item_needs_exactly_one_element() -> Result<()> {
    let a = Array::from_slice(&[1.0f32, 2.0], &[2])?;
    let err = a.item::<f32>().unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    let e = Array::from_slice::<f32>(&[], &[0])?;
    assert!(matches!(e.item::<f32>(), Err(Error::InvalidArgument(_))));
    // One element in any shape is fine.
    assert_eq!(Array::from_slice(&[5i32], &[1, 1, 1])?.item::<i32>()?, 5);
    Ok(())
}

#[test]
fn to_vec_with_wrong_type_is_dtype_mismatch() -> Result<()> {
    let a = Array::from_slice(&[1i32, 2], &[2])?;
    match a.to_vec::<f32>() {
        Err(Error::DtypeMismatch { expected, found }) => {
            assert_eq!(expected, Dtype::Float32);
            assert_eq!(found, Dtype::Int32);
        }
        other => panic!("expected DtypeMismatch, got {other:?}"),
    }
    match Array::scalar(3i32).item::<i64>() {
        Err(Error::DtypeMismatch { expected, found }) => {
            assert_eq!((expected, found), (Dtype::Int64, Dtype::Int32));
        }
        other => panic!("expected DtypeMismatch, got {other:?}"),
    }
    let msg = a.to_vec::<u32>().unwrap_err().to_string();
    assert_eq!(msg, "dtype mismatch: expected uint32, found int32");
    // to_vec_f32 converts instead.
    assert_eq!(a.to_vec_f32()?, vec![1.0, 2.0]);
    Ok(())
}

#[test]
fn from_slice_with_wrong_length_is_invalid_argument() {
    let err = Array::from_slice(&[1.0f32, 2.0, 3.0], &[2, 2]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    assert!(Array::from_slice(&[1i32], &[]).is_ok());
    assert!(matches!(Array::from_slice(&[1i32, 2], &[]), Err(Error::InvalidArgument(_))));
    assert!(matches!(Array::from_slice::<i32>(&[], &[-1]), Err(Error::InvalidArgument(_))));
}

#[test]
fn reshape_to_wrong_size_is_mlx_error() -> Result<()> {
    let a = arange_i32(6, &[6])?;
    match a.reshape(&[4]) {
        Err(Error::Mlx(msg)) => assert!(msg.contains("Cannot reshape array of size 6"), "{msg}"),
        other => panic!("expected Error::Mlx, got {other:?}"),
    }
    let err = a.reshape(&[4, -1]).unwrap_err();
    assert!(err.mlx_message().is_some(), "{err:?}");
    assert_eq!(a.reshape(&[3, -1])?.shape(), &[3, 2]);
    Ok(())
}

// ---- formatting, identity, evaluation -----------------------------------------------------------

#[test]
fn display_matches_mlx() -> Result<()> {
    let a = arange_i32(6, &[2, 3])?;
    assert_eq!(a.to_string(), "array([[0, 1, 2],\n       [3, 4, 5]], dtype=int32)");
    assert_eq!(Array::from_slice(&[1i32, 2], &[2])?.to_string(), "array([1, 2], dtype=int32)");
    assert_eq!(Array::scalar(7i32).to_string(), "array(7, dtype=int32)");
    assert_eq!(Array::from_slice(&[true, false], &[2])?.to_string(), "array([true, false], dtype=bool)");
    Ok(())
}

#[test]
fn debug_does_not_evaluate() -> Result<()> {
    let a = arange_i32(6, &[2, 3])?;
    let b = (&a + 1)?;
    assert!(!b.is_evaluated());
    assert_eq!(format!("{b:?}"), "Array { shape: [2, 3], dtype: Int32 }");
    assert!(!b.is_evaluated());
    // Display does evaluate.
    let _ = b.to_string();
    assert!(b.is_evaluated());
    Ok(())
}

#[test]
fn clone_shares_id_and_data() -> Result<()> {
    let a = (arange_i32(4, &[4])? * 2)?;
    let c = a.clone();
    assert_eq!(a.id(), c.id());
    assert!(!c.is_evaluated());
    a.eval()?;
    assert!(c.is_evaluated(), "a clone is the same graph node");
    assert_eq!(c.to_vec::<i32>()?, vec![0, 2, 4, 6]);
    let other = (&a * 1)?;
    assert_ne!(other.id(), a.id());
    Ok(())
}

#[test]
fn eval_and_async_eval_several_arrays() -> Result<()> {
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3])?;
    assert!(a.is_evaluated(), "data arrays are available at once");
    let x = (&a * 2.0)?;
    let y = (&x + 1.0)?;
    let z = (&a - 1.0)?;
    assert!(!x.is_evaluated() && !y.is_evaluated() && !z.is_evaluated());
    rmlx::eval([&y, &z])?;
    assert!(y.is_evaluated() && z.is_evaluated());
    assert_eq!(y.to_vec::<f32>()?, vec![3.0, 5.0, 7.0]);
    assert_eq!(z.to_vec::<f32>()?, vec![0.0, 1.0, 2.0]);

    let p = (&a * &a)?;
    let q = a.sum(rmlx::Axes::All, false)?;
    assert!(!p.is_evaluated() && !q.is_evaluated());
    rmlx::async_eval([&p, &q])?;
    assert!(p.is_evaluated() && q.is_evaluated(), "scheduled counts as evaluated");
    assert_eq!(p.to_vec::<f32>()?, vec![1.0, 4.0, 9.0]);
    assert_eq!(q.item::<f32>()?, 6.0);

    rmlx::eval(std::iter::empty::<&Array>())?;
    let w = (&a + 0.5)?;
    w.eval()?;
    assert!(w.is_evaluated());
    assert_eq!(w.to_vec::<f32>()?, vec![1.5, 2.5, 3.5]);
    Ok(())
}

// ---- operators ----------------------------------------------------------------------------------

#[test]
fn array_array_operators() -> Result<()> {
    let a = Array::from_slice(&[6.0f32, -4.0, 7.5, 1.0], &[4])?;
    let b = Array::from_slice(&[2.0f32, 8.0, -2.5, 4.0], &[4])?;
    assert_eq!((&a + &b)?.to_vec::<f32>()?, vec![8.0, 4.0, 5.0, 5.0]);
    assert_eq!((&a - &b)?.to_vec::<f32>()?, vec![4.0, -12.0, 10.0, -3.0]);
    assert_eq!((&a * &b)?.to_vec::<f32>()?, vec![12.0, -32.0, -18.75, 4.0]);
    assert_eq!((&a / &b)?.to_vec::<f32>()?, vec![3.0, -0.5, -3.0, 0.25]);
    // % has the sign of the divisor (Python semantics).
    assert_eq!((&a % &b)?.to_vec::<f32>()?, vec![0.0, 4.0, -0.0, 1.0]);
    assert_eq!((-&a)?.to_vec::<f32>()?, vec![-6.0, 4.0, -7.5, -1.0]);
    // Owned operands.
    assert_eq!((a.clone() - b.clone())?.to_vec::<f32>()?, vec![4.0, -12.0, 10.0, -3.0]);
    assert_eq!((a.clone() * &b)?.to_vec::<f32>()?, vec![12.0, -32.0, -18.75, 4.0]);
    assert_eq!((&a + b.clone())?.to_vec::<f32>()?, vec![8.0, 4.0, 5.0, 5.0]);
    assert_eq!((-a.clone())?.to_vec::<f32>()?, vec![-6.0, 4.0, -7.5, -1.0]);

    let i = Array::from_slice(&[7i32, -7, 7, -7], &[4])?;
    let j = Array::from_slice(&[3i32, 3, -3, -3], &[4])?;
    assert_eq!((&i % &j)?.to_vec::<i32>()?, vec![1, 2, -2, -1]);
    let q = (&i / &j)?; // true division
    assert_eq!(q.dtype(), Dtype::Float32);
    assert_eq!(q.to_vec::<f32>()?, vec![7.0 / 3.0, -7.0 / 3.0, -7.0 / 3.0, 7.0 / 3.0]);
    Ok(())
}

#[test]
fn operators_broadcast() -> Result<()> {
    let a = arange_i32(6, &[2, 3])?;
    let row = Array::from_slice(&[10i32, 20, 30], &[3])?;
    let col = Array::from_slice(&[100i32, 200], &[2, 1])?;
    assert_eq!((&a + &row)?.to_vec::<i32>()?, vec![10, 21, 32, 13, 24, 35]);
    let s = (&a + &col)?;
    assert_eq!(s.shape(), &[2, 3]);
    assert_eq!(s.to_vec::<i32>()?, vec![100, 101, 102, 203, 204, 205]);
    Ok(())
}

#[test]
fn operator_broadcast_error_is_err() -> Result<()> {
    let a = Array::from_slice(&[1.0f32, 2.0], &[2])?;
    let b = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3])?;
    let err = (&a + &b).unwrap_err();
    assert!(matches!(err, Error::Mlx(_)), "{err:?}");
    assert!(matches!(&a * &b, Err(Error::Mlx(_))));
    assert!(matches!(a.clone() - b.clone(), Err(Error::Mlx(_))));
    assert!(matches!(&a / &b, Err(Error::Mlx(_))));
    assert!(matches!(&a % &b, Err(Error::Mlx(_))));
    Ok(())
}

#[test]
fn scalar_operators_on_both_sides() -> Result<()> {
    let a = Array::from_slice(&[1.0f32, 2.0, 4.0], &[3])?;
    assert_eq!((&a + 1.0)?.to_vec::<f32>()?, vec![2.0, 3.0, 5.0]);
    assert_eq!((1.0 + &a)?.to_vec::<f32>()?, vec![2.0, 3.0, 5.0]);
    assert_eq!((&a - 1.0)?.to_vec::<f32>()?, vec![0.0, 1.0, 3.0]);
    assert_eq!((10.0 - &a)?.to_vec::<f32>()?, vec![9.0, 8.0, 6.0]);
    assert_eq!((&a * 0.5)?.to_vec::<f32>()?, vec![0.5, 1.0, 2.0]);
    assert_eq!((3.0 * &a)?.to_vec::<f32>()?, vec![3.0, 6.0, 12.0]);
    assert_eq!((&a / 4.0)?.to_vec::<f32>()?, vec![0.25, 0.5, 1.0]);
    assert_eq!((8.0 / &a)?.to_vec::<f32>()?, vec![8.0, 4.0, 2.0]);
    assert_eq!((&a % 1.5)?.to_vec::<f32>()?, vec![1.0, 0.5, 1.0]);
    assert_eq!((5.0 % &a)?.to_vec::<f32>()?, vec![0.0, 1.0, 1.0]);
    // i32 scalars with a float array take the float dtype.
    let r = (&a * 2)?;
    assert_eq!(r.dtype(), Dtype::Float32);
    assert_eq!(r.to_vec::<f32>()?, vec![2.0, 4.0, 8.0]);
    assert_eq!((2 - &a)?.to_vec::<f32>()?, vec![1.0, 0.0, -2.0]);
    // Owned arrays with scalars.
    assert_eq!((a.clone() + 1)?.to_vec::<f32>()?, vec![2.0, 3.0, 5.0]);
    assert_eq!((1 + a.clone())?.to_vec::<f32>()?, vec![2.0, 3.0, 5.0]);
    assert_eq!((a.clone() / 2.0)?.to_vec::<f32>()?, vec![0.5, 1.0, 2.0]);
    assert_eq!((2.0 / a.clone())?.to_vec::<f32>()?, vec![2.0, 1.0, 0.5]);

    let i = Array::from_slice(&[7i32, -7, 2], &[3])?;
    assert_eq!((&i + 3)?.to_vec::<i32>()?, vec![10, -4, 5]);
    assert_eq!((3 - &i)?.to_vec::<i32>()?, vec![-4, 10, 1]);
    assert_eq!((&i * -2)?.to_vec::<i32>()?, vec![-14, 14, -4]);
    assert_eq!((&i % 3)?.to_vec::<i32>()?, vec![1, 2, 2]);
    assert_eq!((&i % -3)?.to_vec::<i32>()?, vec![-2, -1, -1]);
    assert_eq!((10 % &i)?.to_vec::<i32>()?, vec![3, -4, 0]);
    let d = (&i / 2)?;
    assert_eq!(d.dtype(), Dtype::Float32);
    assert_eq!(d.to_vec::<f32>()?, vec![3.5, -3.5, 1.0]);
    Ok(())
}

#[test]
fn weak_scalar_typing() -> Result<()> {
    // A float scalar keeps a half-precision array's dtype.
    let b = Array::from_slice(&[bf16::from_f32(1.5), bf16::from_f32(-3.0)], &[2])?;
    let r = (&b * 2.0)?;
    assert_eq!(r.dtype(), Dtype::Bfloat16);
    assert_eq!(r.to_vec::<bf16>()?, vec![bf16::from_f32(3.0), bf16::from_f32(-6.0)]);
    assert_eq!((2.0 * &b)?.dtype(), Dtype::Bfloat16);
    assert_eq!((&b + 1)?.dtype(), Dtype::Bfloat16);
    let h = Array::from_slice(&[f16::from_f32(0.5)], &[1])?;
    let hr = (&h + 0.25)?;
    assert_eq!(hr.dtype(), Dtype::Float16);
    assert_eq!(hr.item::<f16>()?, f16::from_f32(0.75));

    // A float scalar makes an integer array float32.
    let i = Array::from_slice(&[1i32, 2], &[2])?;
    let f = (&i + 1.5)?;
    assert_eq!(f.dtype(), Dtype::Float32);
    assert_eq!(f.to_vec::<f32>()?, vec![2.5, 3.5]);
    assert_eq!((1.5 * &i)?.dtype(), Dtype::Float32);

    // An integer scalar keeps an integer array's dtype.
    let k = (&i + 3)?;
    assert_eq!(k.dtype(), Dtype::Int32);
    assert_eq!(k.to_vec::<i32>()?, vec![4, 5]);
    let u = Array::from_slice(&[250u8, 1], &[2])?;
    let uk = (&u + 3)?;
    assert_eq!(uk.dtype(), Dtype::Uint8);
    assert_eq!(uk.to_vec::<u8>()?, vec![253, 4]);
    let l = Array::from_slice(&[1i64 << 40], &[1])?;
    assert_eq!((&l * 2)?.to_vec::<i64>()?, vec![1i64 << 41]);

    // bool arrays with an integer scalar become int32.
    let t = Array::from_slice(&[true, false], &[2])?;
    let tb = (&t + 1)?;
    assert_eq!(tb.dtype(), Dtype::Int32);
    assert_eq!(tb.to_vec::<i32>()?, vec![2, 1]);
    Ok(())
}

#[test]
fn integer_arithmetic_wraps() -> Result<()> {
    let a = Array::from_slice(&[i32::MAX, i32::MIN], &[2])?;
    assert_eq!((&a + 1)?.to_vec::<i32>()?, vec![i32::MIN, i32::MIN + 1]);
    let u = Array::from_slice(&[0u8, 200], &[2])?;
    let v = Array::from_slice(&[1u8, 100], &[2])?;
    assert_eq!((&u - &v)?.to_vec::<u8>()?, vec![255, 100]);
    Ok(())
}

#[test]
fn negative_int_scalar_with_unsigned_array_wraps() -> Result<()> {
    // As in MLX's Python API, the scalar is converted to the array's dtype (wrapping), so the result
    // is the modular sum: 5 + (-1) = 4 in uint8.
    let u = Array::from_slice(&[5u8, 0], &[2])?;
    let r = (&u + -1)?;
    assert_eq!(r.dtype(), Dtype::Uint8);
    assert_eq!(r.to_vec::<u8>()?, vec![4, 255]);
    let w = Array::from_slice(&[10u32], &[1])?;
    assert_eq!((&w * -1)?.to_vec::<u32>()?, vec![10u32.wrapping_neg()]);
    Ok(())
}
