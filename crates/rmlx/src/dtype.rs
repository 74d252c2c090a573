//! Element types: [`Dtype`] and the Rust types that map onto it ([`Element`]).

use half::{bf16, f16};
use num_complex::Complex32;
use std::fmt;

/// The element type of an [`Array`](crate::Array). The discriminants are MLX's `Dtype::Val` codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Dtype {
    Bool = 0,
    Uint8 = 1,
    Uint16 = 2,
    Uint32 = 3,
    Uint64 = 4,
    Int8 = 5,
    Int16 = 6,
    Int32 = 7,
    Int64 = 8,
    Float16 = 9,
    Float32 = 10,
    /// Only the CPU device computes in float64.
    Float64 = 11,
    Bfloat16 = 12,
    Complex64 = 13,
}

impl Dtype {
    pub(crate) fn from_code(code: u8) -> Dtype {
        use Dtype::*;
        const ALL: [Dtype; 14] = [
            Bool, Uint8, Uint16, Uint32, Uint64, Int8, Int16, Int32, Int64, Float16, Float32, Float64, Bfloat16,
            Complex64,
        ];
        ALL[code as usize]
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        use Dtype::*;
        match self {
            Bool | Uint8 | Int8 => 1,
            Uint16 | Int16 | Float16 | Bfloat16 => 2,
            Uint32 | Int32 | Float32 => 4,
            Uint64 | Int64 | Float64 | Complex64 => 8,
        }
    }

    /// Floating point (real or complex).
    pub fn is_floating(self) -> bool {
        matches!(self, Dtype::Float16 | Dtype::Float32 | Dtype::Float64 | Dtype::Bfloat16 | Dtype::Complex64)
    }

    /// Signed or unsigned integer (not bool).
    pub fn is_integer(self) -> bool {
        !self.is_floating() && self != Dtype::Bool
    }

    /// The name MLX and NumPy use (`float32`, `bfloat16`, …).
    pub fn name(self) -> &'static str {
        use Dtype::*;
        match self {
            Bool => "bool",
            Uint8 => "uint8",
            Uint16 => "uint16",
            Uint32 => "uint32",
            Uint64 => "uint64",
            Int8 => "int8",
            Int16 => "int16",
            Int32 => "int32",
            Int64 => "int64",
            Float16 => "float16",
            Float32 => "float32",
            Float64 => "float64",
            Bfloat16 => "bfloat16",
            Complex64 => "complex64",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Dtype {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Dtype> {
        (0..14u8)
            .map(Dtype::from_code)
            .find(|d| d.name() == s)
            .ok_or_else(|| crate::Error::InvalidArgument(format!("unknown dtype `{s}`")))
    }
}

/// A Rust type whose values can be stored in an [`Array`](crate::Array) without conversion.
///
/// # Safety
/// `DTYPE` must have the same size and bit layout as `Self`.
pub unsafe trait Element: Copy + Default + Send + Sync + 'static {
    /// The matching MLX dtype.
    const DTYPE: Dtype;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => { $(unsafe impl Element for $t { const DTYPE: Dtype = Dtype::$d; })* };
}
element!(bool => Bool, u8 => Uint8, u16 => Uint16, u32 => Uint32, u64 => Uint64, i8 => Int8, i16 => Int16,
         i32 => Int32, i64 => Int64, f16 => Float16, f32 => Float32, f64 => Float64, bf16 => Bfloat16,
         Complex32 => Complex64);
