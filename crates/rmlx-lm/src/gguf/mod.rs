//! A pure-Rust reader of GGUF files (llama.cpp's single-file checkpoints, versions 2 and 3) that
//! turns their tensors into rmlx [`Weight`](crate::weights::Weight)s.
//!
//! [`GgufFile::open`] memory-maps the file, parses the metadata and the tensor directory and checks
//! that every tensor's data lies inside the file. [`GgufFile::load`] converts one tensor (`to_mlx.rs`):
//!
//! * `F32`, `F16`, `BF16`: a [`Weight::Dense`](crate::weights::Weight::Dense) of that dtype;
//! * `Q4_0`, `Q4_1`, `Q8_0`: a [`Weight::Quantized`](crate::weights::Weight::Quantized) in MLX's
//!   affine format, repacked losslessly (`to_mlx.rs` says how); `Q4_K` and `Q5_K` likewise (4 and 5
//!   bits, groups of 32, float32 scales and biases); `MXFP4` in MLX's `mxfp4` mode;
//! * `Q5_0`, `Q5_1`, `Q8_1`, the other k-quants `Q2_K`, `Q3_K`, `Q6_K`, `Q8_K`, `IQ4_NL`, `IQ4_XS` and the
//!   integer and `F64` types: dequantised on the CPU (ggml's reference formulas) to a float32
//!   [`Weight::Dense`](crate::weights::Weight::Dense).
//!
//! Shapes are row-major: GGUF lists dimensions fastest-first (`[ne0, ne1]`), rmlx gets `[ne1, ne0]`.
//! What llama.cpp's converter did to particular architectures' tensors is undone beside each model
//! ([`crate::models::spec::GgufSpec::fix_up`]).

mod dequant;
mod directory;
mod to_mlx;

use crate::{Error, Result};
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// An integer that is non-negative, as `u64`.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            _ => self.as_i64().and_then(|v| u64::try_from(v).ok()),
        }
    }

    /// An integer that fits `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::U8(v) => Some(v as i64),
            MetaValue::I8(v) => Some(v as i64),
            MetaValue::U16(v) => Some(v as i64),
            MetaValue::I16(v) => Some(v as i64),
            MetaValue::U32(v) => Some(v as i64),
            MetaValue::I32(v) => Some(v as i64),
            MetaValue::U64(v) => i64::try_from(v).ok(),
            MetaValue::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Any number (integer or float), as `f64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            MetaValue::U64(v) => Some(v as f64),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// A boolean.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// A string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// An array's elements.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// An array of strings (`None` if any element is not a string).
    pub fn to_string_vec(&self) -> Option<Vec<String>> {
        self.as_array()?.iter().map(|v| v.as_str().map(str::to_string)).collect()
    }

    /// An array of numbers as `f32` (`None` if any element is not a number).
    pub fn to_f32_vec(&self) -> Option<Vec<f32>> {
        self.as_array()?.iter().map(|v| v.as_f64().map(|x| x as f32)).collect()
    }

    /// An array of integers as `i64` (`None` if any element is not an integer fitting `i64`).
    pub fn to_i64_vec(&self) -> Option<Vec<i64>> {
        self.as_array()?.iter().map(MetaValue::as_i64).collect()
    }
}

macro_rules! ggml_types {
    ($($v:ident = $id:literal, $be:literal, $bb:literal;)*) => {
        /// A ggml tensor type, with ggml's numeric id.
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum GgmlType {
            $($v,)*
            /// Any other id (the i-quants but `IQ4_NL`/`IQ4_XS`, ternary types, future types).
            Other(u32),
        }

        impl GgmlType {
            /// The type of a ggml id.
            pub fn from_id(id: u32) -> GgmlType {
                match id {
                    $($id => GgmlType::$v,)*
                    other => GgmlType::Other(other),
                }
            }

            /// ggml's numeric id.
            pub fn id(self) -> u32 {
                match self {
                    $(GgmlType::$v => $id,)*
                    GgmlType::Other(id) => id,
                }
            }

            /// `(elements, bytes)` of one block, for every type ggml defines (`None` when unknown).
            pub fn block_layout(self) -> Option<(usize, usize)> {
                match self {
                    $(GgmlType::$v => Some(($be, $bb)),)*
                    GgmlType::Other(id) => OTHER_TYPES.iter().find(|t| t.0 == id).map(|t| (t.2, t.3)),
                }
            }

            fn name(self) -> Option<&'static str> {
                match self {
                    $(GgmlType::$v => Some(stringify!($v)),)*
                    GgmlType::Other(id) => OTHER_TYPES.iter().find(|t| t.0 == id).map(|t| t.1),
                }
            }
        }
    };
}

ggml_types! {
    F32 = 0, 1, 4; F16 = 1, 1, 2; Q4_0 = 2, 32, 18; Q4_1 = 3, 32, 20; Q5_0 = 6, 32, 22;
    Q5_1 = 7, 32, 24; Q8_0 = 8, 32, 34; Q8_1 = 9, 32, 36; Q2_K = 10, 256, 84; Q3_K = 11, 256, 110;
    Q4_K = 12, 256, 144; Q5_K = 13, 256, 176; Q6_K = 14, 256, 210; Q8_K = 15, 256, 292;
    IQ4_NL = 20, 32, 18; IQ4_XS = 23, 256, 136; I8 = 24, 1, 1; I16 = 25, 1, 2; I32 = 26, 1, 4;
    I64 = 27, 1, 8; F64 = 28, 1, 8; BF16 = 30, 1, 2; MXFP4 = 39, 32, 17;
}

/// ggml types read but not converted: (id, name, block elements, block bytes).
const OTHER_TYPES: &[(u32, &str, usize, usize)] = &[
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (29, "IQ1_M", 256, 56),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
];

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => write!(f, "{n}"),
            None => write!(f, "unknown ggml type {}", self.id()),
        }
    }
}

/// One tensor of the directory.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// The llama.cpp name (`blk.0.attn_q.weight`, ...).
    pub name: String,
    /// Row-major shape: GGUF's dimensions reversed (`[ne1, ne0]` for a matrix).
    pub shape: Vec<usize>,
    /// The storage type.
    pub ggml_type: GgmlType,
    /// Absolute offset of the data in the file.
    pub offset: u64,
    /// Size of the data in bytes (0 for a type of unknown layout).
    pub nbytes: usize,
}

impl TensorInfo {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// An open GGUF file: the memory map, the metadata and the tensor directory.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    version: u32,
    metadata: BTreeMap<String, MetaValue>,
    tensors: Vec<TensorInfo>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// Deepest nesting of metadata arrays accepted (guards the recursion against hostile files).
const MAX_DEPTH: usize = 8;

/// A bounds-checked little-endian cursor over the header.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn corrupt(&self, reason: String) -> Error {
        Error::Corrupt { path: self.path.display().to_string(), reason }
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let left = (self.buf.len() - self.pos) as u64;
        if n > left {
            return Err(
                self.corrupt(format!("header truncated at byte {} reading {what} ({n} bytes, {left} left)", self.pos))
            );
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.take(N as u64, what)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64(what)?;
        Ok(String::from_utf8_lossy(self.take(n, what)?).into_owned())
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U8(self.array::<1>(key)?[0]),
            1 => MetaValue::I8(self.array::<1>(key)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(key)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(key)?)),
            4 => MetaValue::U32(self.u32(key)?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(key)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(key)?)),
            7 => MetaValue::Bool(self.array::<1>(key)?[0] != 0),
            8 => MetaValue::String(self.string(key)?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(self.corrupt(format!("metadata `{key}`: arrays nested deeper than {MAX_DEPTH}")));
                }
                let ety = self.u32(key)?;
                let n = self.u64(key)?;
                // Each element takes at least `min` bytes: a longer array cannot fit what is left.
                let Some(min) = directory::min_value_size(ety) else {
                    return Err(self.corrupt(format!("metadata `{key}`: unknown array element type {ety}")));
                };
                let left = (self.buf.len() - self.pos) as u64;
                if n > left / min {
                    return Err(self.corrupt(format!("metadata `{key}`: array of {n} elements runs past the end")));
                }
                if n > directory::MAX_ARRAY_LEN {
                    return Err(self.corrupt(format!(
                        "metadata `{key}`: array of {n} elements exceeds the limit of {}",
                        directory::MAX_ARRAY_LEN
                    )));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(ety, key, depth + 1)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::U64(self.u64(key)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(key)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(key)?)),
            other => return Err(self.corrupt(format!("metadata `{key}`: unknown value type {other}"))),
        })
    }
}

impl GgufFile {
    /// Opens and parses a GGUF file (version 2 or 3, little-endian). The tensor data are
    /// aligned to `general.alignment` (default 32). [`Error::Corrupt`] for a bad magic, an
    /// unparsable or truncated header, a count the file cannot hold, a dimension beyond `i32`, or
    /// tensor data that lies (partly) outside the file, is misaligned, overlaps another tensor's or
    /// disagrees with its declared type (see `directory.rs`); [`Error::Config`] for an invalid
    /// `general.alignment`. What it allocates is bounded by the file's length.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only; like every mmap-based loader we rely on the file not being
        // truncated or rewritten while it is open.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let mut c = Cursor { buf: &map, pos: 0, path };
        let magic = c.take(4, "the magic").map_err(|_| c.corrupt("too short for a GGUF header".into()))?;
        if magic != b"GGUF" {
            return Err(c.corrupt(format!("bad magic {magic:02x?} (expected \"GGUF\"): not a GGUF file")));
        }
        let version = c.u32("the version")?;
        if version != 2 && version != 3 {
            let hint = if version.swap_bytes() <= 3 { " (a big-endian file?)" } else { "" };
            return Err(c.corrupt(format!("unsupported GGUF version {version}{hint}; versions 2 and 3 are read")));
        }
        let n_tensors = c.u64("the tensor count")?;
        let n_kv = c.u64("the metadata count")?;
        let left = (map.len() - c.pos) as u64;
        directory::check_count(path, "a metadata count", n_kv, directory::MIN_KV_ENTRY, left)?;
        directory::check_count(path, "a tensor count", n_tensors, directory::MIN_TENSOR_ENTRY, left)?;

        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string("a metadata key")?;
            let ty = c.u32(&key)?;
            let value = c.value(ty, &key, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(c.corrupt(format!("duplicate metadata key `{key}`")));
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() => a,
                _ => {
                    return Err(Error::Config(format!(
                        "{}: general.alignment must be a power of two, found {v:?}",
                        path.display()
                    )))
                }
            },
        };

        let mut raw = Vec::new();
        for _ in 0..n_tensors {
            let name = c.string("a tensor name")?;
            let n_dims = c.u32(&name)?;
            if n_dims > 8 {
                return Err(c.corrupt(format!("tensor `{name}`: {n_dims} dimensions")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64(&name)?);
            }
            let ggml_type = GgmlType::from_id(c.u32(&name)?);
            let rel = c.u64(&name)?;
            raw.push(directory::RawTensor { name, dims, ggml_type, rel });
        }
        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
        let tensors = directory::build(path, raw, data_start, alignment, map.len() as u64)?;
        Ok(GgufFile { path: path.to_path_buf(), map, version, metadata, tensors })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GGUF version (2 or 3).
    #[cfg(test)]
    pub fn version(&self) -> u32 {
        self.version
    }

    /// All metadata, by key.
    pub fn metadata(&self) -> &BTreeMap<String, MetaValue> {
        &self.metadata
    }

    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// The tensor directory, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// A tensor's entry by (llama.cpp) name.
    #[cfg(test)]
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// A tensor's raw bytes as stored.
    pub fn raw_bytes(&self, info: &TensorInfo) -> Result<&[u8]> {
        let start = info.offset as usize;
        match start.checked_add(info.nbytes) {
            Some(end) if info.offset <= usize::MAX as u64 && end <= self.map.len() => Ok(&self.map[start..end]),
            _ => Err(Error::Corrupt {
                path: self.path.display().to_string(),
                reason: format!("tensor `{}`: data lies past the end of the file", info.name),
            }),
        }
    }
}
