//! Validation of a safetensors file's header before MLX reads it. MLX trusts the header: a
//! dimension of `2^32 + 384` is read as 384, and offsets that disagree with the shapes or the file
//! size go unnoticed. [`check_file`] accepts a file only when the header length is sane and inside
//! the file, the header is a JSON object, every dtype is known, every dimension fits `i32`, each
//! tensor's byte length is exactly `elements × dtype size` (checked 64-bit arithmetic), and the
//! tensors tile the data section exactly: from its start, without gaps or overlaps, to the end of
//! the file. What it reads is bounded by the header length, itself bounded by the file size.

use crate::{Error, Result};
use serde_json::{Map, Value};
use std::path::Path;

/// Longest header accepted (the limit of the reference implementation).
pub const MAX_HEADER_LEN: u64 = 100 << 20;

/// Most dimensions accepted for one tensor.
const MAX_DIMS: usize = 16;

/// The safetensors dtypes: size in bytes, and whether MLX loads them as what they are.
const DTYPES: &[(&str, u64, bool)] = &[
    ("BOOL", 1, true),
    ("U8", 1, true),
    ("I8", 1, true),
    // MLX refuses F8_E5M2 and reads F8_E4M3 as raw uint8 codes, not as numbers.
    ("F8_E5M2", 1, false),
    ("F8_E4M3", 1, false),
    ("I16", 2, true),
    ("U16", 2, true),
    ("F16", 2, true),
    ("BF16", 2, true),
    ("I32", 4, true),
    ("U32", 4, true),
    ("F32", 4, true),
    ("I64", 8, true),
    ("U64", 8, true),
    // MLX refuses F64.
    ("F64", 8, false),
    ("C64", 8, true),
];

/// One tensor of a validated header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// The tensor's name.
    pub name: String,
    /// The safetensors dtype (`F32`, `BF16`, ...).
    pub dtype: &'static str,
    /// The shape; every dimension fits `i32`.
    pub shape: Vec<i32>,
    /// `[begin, end)` within the data section.
    pub data_offsets: (u64, u64),
}

/// Reads and validates the header of the safetensors file at `path`; the tensors come back in
/// data order. [`Error::Corrupt`] names the file and the problem.
pub fn check_file(path: &Path) -> Result<Vec<TensorEntry>> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let file_len = f.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut prefix = [0u8; 8];
    if file_len < 8 {
        return Err(corrupt(path, format!("{file_len} bytes is shorter than a safetensors header")));
    }
    f.read_exact(&mut prefix).map_err(|e| Error::io(path, e))?;
    let header_len = check_header_len(path, u64::from_le_bytes(prefix), file_len)?;
    let mut bytes = prefix.to_vec();
    bytes.resize(8 + header_len as usize, 0);
    f.read_exact(&mut bytes[8..]).map_err(|e| Error::io(path, e))?;
    parse(path, &bytes, file_len)
}

/// Validates a safetensors header: `bytes` holds the start of the file (at least the 8-byte length
/// and the header), `file_len` is the size of the whole file. `path` only names the file in errors.
pub fn parse(path: &Path, bytes: &[u8], file_len: u64) -> Result<Vec<TensorEntry>> {
    let Some(prefix) = bytes.get(..8) else {
        return Err(corrupt(path, format!("{} bytes is shorter than a safetensors header", bytes.len())));
    };
    let header_len = check_header_len(path, u64::from_le_bytes(prefix.try_into().expect("8 bytes")), file_len)?;
    let end = 8 + header_len as usize;
    let header = bytes.get(8..end).ok_or_else(|| corrupt(path, "the header is cut short".into()))?;
    let map: Map<String, Value> =
        serde_json::from_slice(header).map_err(|e| corrupt(path, format!("the header is not a JSON object: {e}")))?;
    let data_len = file_len - 8 - header_len;
    let mut tensors = Vec::with_capacity(map.len());
    for (name, info) in &map {
        if name == "__metadata__" {
            // MLX writes `null` when a file has no metadata.
            if !info.is_null() && !info.as_object().is_some_and(|m| m.values().all(Value::is_string)) {
                return Err(corrupt(path, "`__metadata__` must map names to strings".into()));
            }
            continue;
        }
        let (t, loadable) = entry(name, info).map_err(|reason| corrupt(path, format!("tensor `{name}`: {reason}")))?;
        if !loadable {
            return Err(Error::Config(format!(
                "{}: tensor `{name}` has dtype {}, which MLX cannot load",
                path.display(),
                t.dtype
            )));
        }
        if t.data_offsets.1 > data_len {
            return Err(corrupt(
                path,
                format!(
                    "tensor `{name}` ends at byte {} of a {data_len}-byte data section (truncated file?)",
                    t.data_offsets.1
                ),
            ));
        }
        tensors.push(t);
    }
    tensors.sort_by_key(|t| t.data_offsets);
    let mut at = 0u64;
    let mut previous: Option<&str> = None;
    for t in &tensors {
        let (begin, end) = t.data_offsets;
        if begin != at {
            let after = previous.map_or("the start of the data".to_string(), |p| format!("tensor `{p}`"));
            let what = if begin < at { "overlaps" } else { "leaves a gap after" };
            return Err(corrupt(
                path,
                format!("tensor `{}` at [{begin}, {end}) {what} {after}, which ends at {at}", t.name),
            ));
        }
        at = end;
        previous = Some(&t.name);
    }
    if at != data_len {
        return Err(corrupt(
            path,
            format!("the tensors end at byte {at} of a {data_len}-byte data section: the header disagrees with the file size"),
        ));
    }
    Ok(tensors)
}

fn corrupt(path: &Path, reason: String) -> Error {
    Error::Corrupt { path: path.display().to_string(), reason }
}

fn check_header_len(path: &Path, header_len: u64, file_len: u64) -> Result<u64> {
    if header_len > MAX_HEADER_LEN {
        return Err(corrupt(path, format!("header length {header_len} exceeds the limit of {MAX_HEADER_LEN} bytes")));
    }
    if header_len > file_len.saturating_sub(8) {
        return Err(corrupt(path, format!("header length {header_len} exceeds the file size {file_len}")));
    }
    Ok(header_len)
}

/// One tensor's entry, checked on its own, and whether MLX can load its dtype.
fn entry(name: &str, info: &Value) -> std::result::Result<(TensorEntry, bool), String> {
    let info = info.as_object().ok_or("the entry is not a JSON object")?;
    let dtype_name = info.get("dtype").and_then(Value::as_str).ok_or("no `dtype` string")?;
    let &(dtype, size, loadable) =
        DTYPES.iter().find(|(n, _, _)| *n == dtype_name).ok_or_else(|| format!("unknown dtype `{dtype_name}`"))?;
    let dims = info.get("shape").and_then(Value::as_array).ok_or("no `shape` list")?;
    if dims.len() > MAX_DIMS {
        return Err(format!("{} dimensions (at most {MAX_DIMS})", dims.len()));
    }
    let mut shape = Vec::with_capacity(dims.len().min(64));
    let mut numel = 1u64;
    for d in dims {
        let d = d.as_u64().ok_or_else(|| format!("shape {dims:?} holds a value that is not a size"))?;
        let d = i32::try_from(d).map_err(|_| format!("dimension {d} exceeds {} (MLX's limit)", i32::MAX))?;
        numel = numel.checked_mul(d as u64).ok_or_else(|| format!("shape {dims:?} overflows"))?;
        shape.push(d);
    }
    let nbytes = numel.checked_mul(size).ok_or_else(|| format!("shape {dims:?} overflows"))?;
    let offsets = info.get("data_offsets").and_then(Value::as_array).ok_or("no `data_offsets` pair")?;
    let (begin, end) = match offsets.as_slice() {
        [b, e] => (b.as_u64(), e.as_u64()),
        _ => (None, None),
    };
    let (Some(begin), Some(end)) = (begin, end) else {
        return Err(format!("`data_offsets` {offsets:?} is not a pair of sizes"));
    };
    if end < begin || end - begin != nbytes {
        return Err(format!(
            "data_offsets [{begin}, {end}) hold {} bytes but shape {shape:?} of {dtype} needs {nbytes}",
            end as i128 - begin as i128
        ));
    }
    Ok((TensorEntry { name: name.to_string(), dtype, shape, data_offsets: (begin, end) }, loadable))
}
