//! `+ - * / %` and unary `-` on arrays and scalars. Each returns `Result<Array>`, because MLX may
//! refuse the operands (shapes that do not broadcast, say): `let c = (&a + &b)?;`.
//!
//! Scalars are `f32` and `i32` (so literals like `2.0` and `3` need no suffix). A scalar takes the array's dtype when it can (as Python scalars do in MLX): `f32`
//! scalars take a floating array's dtype and make integer arrays float32; integer scalars take any
//! non-bool array's dtype.

use crate::ops::{self, elementwise::float_scalar};
use crate::{Array, Dtype, Result};
use std::ops::{Add, Div, Mul, Neg, Rem, Sub};

fn int_operand(a: &Array, v: f64) -> Result<Array> {
    let dtype = if a.dtype() == Dtype::Bool { Dtype::Int32 } else { a.dtype() };
    // Through i64, so a negative scalar wraps into an unsigned dtype (as in MLX's Python API)
    // instead of an undefined float-to-unsigned conversion. `v` holds an exact i32.
    Array::scalar_from_i64(v as i64, dtype)
}

macro_rules! binary_operator {
    ($trait:ident, $method:ident, $op:path) => {
        impl $trait<&Array> for &Array {
            type Output = Result<Array>;
            fn $method(self, rhs: &Array) -> Result<Array> {
                $op(self, rhs)
            }
        }
        impl $trait<Array> for Array {
            type Output = Result<Array>;
            fn $method(self, rhs: Array) -> Result<Array> {
                $op(&self, &rhs)
            }
        }
        impl $trait<&Array> for Array {
            type Output = Result<Array>;
            fn $method(self, rhs: &Array) -> Result<Array> {
                $op(&self, rhs)
            }
        }
        impl $trait<Array> for &Array {
            type Output = Result<Array>;
            fn $method(self, rhs: Array) -> Result<Array> {
                $op(self, &rhs)
            }
        }
        binary_operator!(@scalar $trait, $method, $op, f32, float_scalar);
        binary_operator!(@scalar $trait, $method, $op, i32, int_operand);
    };
    (@scalar $trait:ident, $method:ident, $op:path, $t:ty, $conv:ident) => {
        impl $trait<$t> for &Array {
            type Output = Result<Array>;
            fn $method(self, rhs: $t) -> Result<Array> {
                $op(self, &$conv(self, rhs as f64)?)
            }
        }
        impl $trait<$t> for Array {
            type Output = Result<Array>;
            fn $method(self, rhs: $t) -> Result<Array> {
                $op(&self, &$conv(&self, rhs as f64)?)
            }
        }
        impl $trait<&Array> for $t {
            type Output = Result<Array>;
            fn $method(self, rhs: &Array) -> Result<Array> {
                $op(&$conv(rhs, self as f64)?, rhs)
            }
        }
        impl $trait<Array> for $t {
            type Output = Result<Array>;
            fn $method(self, rhs: Array) -> Result<Array> {
                $op(&$conv(&rhs, self as f64)?, &rhs)
            }
        }
    };
}

binary_operator!(Add, add, ops::add);
binary_operator!(Sub, sub, ops::subtract);
binary_operator!(Mul, mul, ops::multiply);
binary_operator!(Div, div, ops::divide);
binary_operator!(Rem, rem, ops::remainder);

impl Neg for &Array {
    type Output = Result<Array>;
    fn neg(self) -> Result<Array> {
        ops::negative(self)
    }
}

impl Neg for Array {
    type Output = Result<Array>;
    fn neg(self) -> Result<Array> {
        ops::negative(&self)
    }
}
