//! Element-wise math, comparisons, logic, activations and `where`.

use super::wrap;
use crate::device::current;
use crate::{Array, Dtype, Result};
use rmlx_sys::ffi::{self, BinaryOp, UnaryOp};

macro_rules! unary_ops {
    ($($name:ident => $op:ident, $doc:literal;)*) => {
        $(
            #[doc = $doc]
            pub fn $name(a: &Array) -> Result<Array> {
                wrap(|| ffi::unary(UnaryOp::$op, a.raw(), current()))
            }
        )*
        impl Array {
            $(
                #[doc = $doc]
                pub fn $name(&self) -> Result<Array> {
                    $name(self)
                }
            )*
        }
    };
}

unary_ops! {
    abs => Abs, "Absolute value.";
    negative => Negative, "`-a`.";
    sign => Sign, "-1, 0 or 1 by sign.";
    exp => Exp, "`e^a`.";
    expm1 => Expm1, "`e^a - 1`, accurate near 0.";
    log => Log, "Natural logarithm.";
    log1p => Log1p, "`ln(1 + a)`, accurate near 0.";
    log2 => Log2, "Base-2 logarithm.";
    log10 => Log10, "Base-10 logarithm.";
    sqrt => Sqrt, "Square root.";
    rsqrt => Rsqrt, "`1 / sqrt(a)`.";
    square => Square, "`a * a`.";
    reciprocal => Reciprocal, "`1 / a`.";
    sin => Sin, "Sine.";
    cos => Cos, "Cosine.";
    tan => Tan, "Tangent.";
    arcsin => Arcsin, "Inverse sine.";
    arccos => Arccos, "Inverse cosine.";
    arctan => Arctan, "Inverse tangent.";
    sinh => Sinh, "Hyperbolic sine.";
    cosh => Cosh, "Hyperbolic cosine.";
    tanh => Tanh, "Hyperbolic tangent.";
    arcsinh => Arcsinh, "Inverse hyperbolic sine.";
    arccosh => Arccosh, "Inverse hyperbolic cosine.";
    arctanh => Arctanh, "Inverse hyperbolic tangent.";
    sigmoid => Sigmoid, "Logistic sigmoid `1 / (1 + e^-a)`.";
    erf => Erf, "Gauss error function.";
    erfinv => Erfinv, "Inverse of `erf`.";
    floor => Floor, "Round down.";
    ceil => Ceil, "Round up.";
    logical_not => LogicalNot, "Logical not (the result is bool).";
    bitwise_invert => BitwiseInvert, "Bitwise not of an integer array.";
    isnan => IsNan, "Whether each element is NaN.";
    isinf => IsInf, "Whether each element is ±infinity.";
    isfinite => IsFinite, "Whether each element is finite.";
    stop_gradient => StopGradient, "The identity, with no gradient flowing through it.";
    real => Real, "Real part of a complex array.";
    imag => Imag, "Imaginary part of a complex array.";
    conjugate => Conjugate, "Complex conjugate.";
    degrees => Degrees, "Radians to degrees.";
    radians => Radians, "Degrees to radians.";
}

macro_rules! binary_ops {
    ($($name:ident => $op:ident, $doc:literal;)*) => {
        $(
            #[doc = $doc]
            pub fn $name(a: &Array, b: &Array) -> Result<Array> {
                wrap(|| ffi::binary(BinaryOp::$op, a.raw(), b.raw(), current()))
            }
        )*
        impl Array {
            $(
                #[doc = $doc]
                pub fn $name(&self, other: &Array) -> Result<Array> {
                    $name(self, other)
                }
            )*
        }
    };
}

binary_ops! {
    add => Add, "`a + b`, broadcasting.";
    subtract => Subtract, "`a - b`, broadcasting.";
    multiply => Multiply, "`a * b`, broadcasting.";
    divide => Divide, "`a / b` (true division: integers give floats).";
    power => Power, "`a ^ b`.";
    maximum => Maximum, "Element-wise maximum (NaN propagates).";
    minimum => Minimum, "Element-wise minimum (NaN propagates).";
    equal => Equal, "`a == b` (bool).";
    not_equal => NotEqual, "`a != b` (bool).";
    less => Less, "`a < b` (bool).";
    less_equal => LessEqual, "`a <= b` (bool).";
    greater => Greater, "`a > b` (bool).";
    greater_equal => GreaterEqual, "`a >= b` (bool).";
    logical_and => LogicalAnd, "Logical and (bool).";
    logical_or => LogicalOr, "Logical or (bool).";
    bitwise_and => BitwiseAnd, "Bitwise and.";
    bitwise_or => BitwiseOr, "Bitwise or.";
    bitwise_xor => BitwiseXor, "Bitwise xor.";
    left_shift => LeftShift, "`a << b`.";
    right_shift => RightShift, "`a >> b`.";
    arctan2 => Arctan2, "Angle of the point `(b, a)`.";
    logaddexp => LogAddExp, "`ln(e^a + e^b)`, computed stably.";
    matmul => Matmul, "Matrix product with NumPy's rules (batched, 1-D promotion).";
    outer => Outer, "Outer product of two vectors (inputs are flattened).";
    inner => Inner, "Inner product over the last axes.";
}

/// Runs an integer division-like op with zero divisors replaced by 1 and their results by 0 (as
/// NumPy does), because an integer division by zero would trap and kill the process.
fn guarded_int_division(op: BinaryOp, a: &Array, b: &Array) -> Result<Array> {
    let raw = |x: &Array, y: &Array| wrap(|| ffi::binary(op, x.raw(), y.raw(), current()));
    let dtype = crate::ops::result_type(a, b)?;
    if !dtype.is_integer() {
        return raw(a, b);
    }
    let zero = Array::scalar_as(0.0, b.dtype())?;
    let is_zero = equal(b, &zero)?;
    let safe_b = r#where(&is_zero, &Array::scalar_as(1.0, b.dtype())?, b)?;
    r#where(&is_zero, &Array::scalar_as(0.0, dtype)?, &raw(a, &safe_b)?)
}

/// `floor(a / b)`. For integers, division by zero gives 0 (as in NumPy) instead of trapping.
pub fn floor_divide(a: &Array, b: &Array) -> Result<Array> {
    guarded_int_division(BinaryOp::FloorDivide, a, b)
}

/// Remainder with the sign of `b`, as in Python. For integers, `x % 0` gives 0 (as in NumPy).
pub fn remainder(a: &Array, b: &Array) -> Result<Array> {
    guarded_int_division(BinaryOp::Remainder, a, b)
}

/// Rounds to `decimals` decimal places (half to even).
pub fn round(a: &Array, decimals: i32) -> Result<Array> {
    wrap(|| ffi::round(a.raw(), decimals, current()))
}

/// Picks from `x` where `condition` is true and from `y` elsewhere, broadcasting all three.
///
/// ```
/// use rmlx::Array;
/// let c = Array::from_slice(&[true, false, true], &[3])?;
/// let x = Array::from_slice(&[1i32, 2, 3], &[3])?;
/// let y = Array::scalar(0i32);
/// assert_eq!(rmlx::ops::r#where(&c, &x, &y)?.to_vec::<i32>()?, vec![1, 0, 3]);
/// # Ok::<(), rmlx::Error>(())
/// ```
pub fn r#where(condition: &Array, x: &Array, y: &Array) -> Result<Array> {
    wrap(|| ffi::where_(condition.raw(), x.raw(), y.raw(), current()))
}

/// Limits values to `[min, max]`; either bound may be absent.
pub fn clip(a: &Array, min: Option<&Array>, max: Option<&Array>) -> Result<Array> {
    // SAFETY: the pointers come from live arrays or are null, as the shim expects.
    wrap(|| unsafe { ffi::clip(a.raw(), Array::ptr(min), Array::ptr(max), current()) })
}

/// Whether `|a - b| <= atol + rtol * |b|` element-wise.
pub fn isclose(a: &Array, b: &Array, rtol: f64, atol: f64, equal_nan: bool) -> Result<Array> {
    wrap(|| ffi::isclose(a.raw(), b.raw(), rtol, atol, equal_nan, current()))
}

/// Whether two arrays have the same shape and equal values (a bool scalar).
pub fn array_equal(a: &Array, b: &Array, equal_nan: bool) -> Result<Array> {
    wrap(|| ffi::array_equal(a.raw(), b.raw(), equal_nan, current()))
}

/// A scalar of `a`'s dtype (or float32 if `a` is not floating) for mixing into float math.
pub(crate) fn float_scalar(a: &Array, v: f64) -> Result<Array> {
    let dtype = if a.dtype().is_floating() { a.dtype() } else { Dtype::Float32 };
    Array::scalar_as(v, dtype)
}

/// SiLU (swish): `a * sigmoid(a)`.
pub fn silu(a: &Array) -> Result<Array> {
    multiply(a, &sigmoid(a)?)
}

/// ReLU: `max(a, 0)`.
pub fn relu(a: &Array) -> Result<Array> {
    maximum(a, &Array::scalar_as(0.0, a.dtype())?)
}

/// GELU, exact: `a * (1 + erf(a / √2)) / 2`.
pub fn gelu(a: &Array) -> Result<Array> {
    let inner = erf(&multiply(a, &float_scalar(a, std::f64::consts::FRAC_1_SQRT_2)?)?)?;
    let one_plus = add(&inner, &float_scalar(a, 1.0)?)?;
    multiply(&multiply(a, &one_plus)?, &float_scalar(a, 0.5)?)
}

/// GELU, tanh approximation (`gelu_pytorch_tanh`):
/// `0.5 a (1 + tanh(√(2/π) (a + 0.044715 a³)))`.
pub fn gelu_approx(a: &Array) -> Result<Array> {
    let cube = multiply(&multiply(a, a)?, a)?;
    let poly = add(a, &multiply(&cube, &float_scalar(a, 0.044715)?)?)?;
    let t = tanh(&multiply(&poly, &float_scalar(a, (2.0 / std::f64::consts::PI).sqrt())?)?)?;
    multiply(&multiply(a, &add(&t, &float_scalar(a, 1.0)?)?)?, &float_scalar(a, 0.5)?)
}

/// Softplus: `ln(1 + e^a)`, computed stably.
pub fn softplus(a: &Array) -> Result<Array> {
    logaddexp(a, &float_scalar(a, 0.0)?)
}

/// One-hot encoding: an array of shape `indices.shape + [num_classes]` with 1 where the last index
/// equals the value of `indices`, else 0.
///
/// ```
/// use rmlx::{Array, Dtype};
/// let i = Array::from_slice(&[2i32, 0], &[2])?;
/// let h = rmlx::ops::one_hot(&i, 3, Dtype::Float32)?;
/// assert_eq!(h.to_vec::<f32>()?, vec![0.0, 0.0, 1.0, 1.0, 0.0, 0.0]);
/// # Ok::<(), rmlx::Error>(())
/// ```
pub fn one_hot(indices: &Array, num_classes: i32, dtype: Dtype) -> Result<Array> {
    let classes = super::arange(0.0, num_classes as f64, 1.0, indices.dtype())?;
    equal(&super::expand_dims(indices, -1)?, &classes)?.astype(dtype)
}

impl Array {
    /// `floor(self / other)`.
    pub fn floor_divide(&self, other: &Array) -> Result<Array> {
        floor_divide(self, other)
    }
    /// Python-style remainder.
    pub fn remainder(&self, other: &Array) -> Result<Array> {
        remainder(self, other)
    }
    /// Rounds to `decimals` decimal places.
    pub fn round(&self, decimals: i32) -> Result<Array> {
        round(self, decimals)
    }
    /// SiLU.
    pub fn silu(&self) -> Result<Array> {
        silu(self)
    }
    /// Exact GELU.
    pub fn gelu(&self) -> Result<Array> {
        gelu(self)
    }
    /// Limits values to `[min, max]`.
    pub fn clip(&self, min: Option<&Array>, max: Option<&Array>) -> Result<Array> {
        clip(self, min, max)
    }
}
