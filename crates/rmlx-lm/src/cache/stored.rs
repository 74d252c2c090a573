//! Keys or values as a cache keeps them: full-precision rows `[B, H, S, D]`, or rows packed by
//! the cache's quantisation ([`Packed`]: words, scales and biases sharing their first three axes).
//! The batch cache moves positions (axis 2) and sequences (axis 0) around the same way for both.

use super::quantized::{pack, KvQuantization, Packed};
use crate::{Error, Result};
use rmlx::{ops, Array, Dtype};

/// One of a cache's key or value buffers.
#[derive(Clone)]
pub enum Stored {
    Plain(Array),
    Packed(Packed),
}

impl Stored {
    /// `rows: [B, H, L, D]`, packed when `q` is given.
    pub fn new(rows: &Array, q: Option<&KvQuantization>) -> Result<Stored> {
        Ok(match q {
            Some(q) => Stored::Packed(pack(rows, q)?),
            None => Stored::Plain(rows.clone()),
        })
    }

    /// `f` on each array.
    pub fn map(&self, f: impl Fn(&Array) -> Result<Array>) -> Result<Stored> {
        Ok(match self {
            Stored::Plain(a) => Stored::Plain(f(a)?),
            Stored::Packed(p) => Stored::Packed(p.map(f)?),
        })
    }

    /// `f` on each array and the matching one of `other` (stored the same way).
    pub fn zip(&self, other: &Stored, f: impl Fn(&Array, &Array) -> Result<Array>) -> Result<Stored> {
        match (self, other) {
            (Stored::Plain(a), Stored::Plain(b)) => Ok(Stored::Plain(f(a, b)?)),
            (Stored::Packed(a), Stored::Packed(b)) => Ok(Stored::Packed(a.zip(b, f)?)),
            _ => Err(Error::InvalidParameter("a quantised cache met a full-precision one".into())),
        }
    }

    /// Size of axis `axis` (0: sequences, 2: positions).
    pub fn dim(&self, axis: usize) -> i32 {
        match self {
            Stored::Plain(a) => a.shape()[axis],
            Stored::Packed(p) => p.words.shape()[axis],
        }
    }

    /// The arrays.
    pub fn arrays(&self) -> Vec<&Array> {
        match self {
            Stored::Plain(a) => vec![a],
            Stored::Packed(p) => p.arrays().to_vec(),
        }
    }

    /// The arrays, mutably.
    pub fn arrays_mut(&mut self) -> Vec<&mut Array> {
        match self {
            Stored::Plain(a) => vec![a],
            Stored::Packed(p) => p.arrays_mut().into_iter().collect(),
        }
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        self.arrays().iter().map(|a| a.nbytes()).sum()
    }

    /// The quantisation, where packed.
    pub fn quantization(&self) -> Option<KvQuantization> {
        match self {
            Stored::Plain(_) => None,
            Stored::Packed(p) => Some(p.quantization),
        }
    }

    /// `n` zero positions for `rows` sequences, stored like these.
    pub fn zeros(&self, rows: i32, n: i32) -> Result<Stored> {
        self.map(|a| {
            let s = a.shape();
            Ok(ops::zeros(&[rows, s[1], n, s[3]], a.dtype())?)
        })
    }

    /// Stored as `q` packs it (full-precision rows packed; packed ones as they are).
    pub fn packed(&self, q: &KvQuantization) -> Result<Stored> {
        match self {
            Stored::Plain(a) => Ok(Stored::Packed(pack(a, q)?)),
            Stored::Packed(_) => Ok(self.clone()),
        }
    }

    /// The rows at full precision (`dtype` for packed ones).
    pub fn unpacked(&self, dtype: Dtype) -> Result<Array> {
        match self {
            Stored::Plain(a) => Ok(a.clone()),
            Stored::Packed(p) => p.unpack(dtype),
        }
    }
}
