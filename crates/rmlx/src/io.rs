//! Reading and writing arrays: safetensors (with string metadata), GGUF (with typed metadata) and
//! NumPy `.npy`.
//!
//! Loading is lazy: `load_safetensors` reads the header and returns arrays whose data is read from
//! the file when first evaluated, so a model's weights are only read once used. A safetensors file
//! that is cut short is reported when it is opened (its header's offsets exceed the file).

use crate::array::{array_vec, from_array_vec};
use crate::device::current;
use crate::lock::{evaluating, locked};
use crate::ops::wrap;
use crate::{Array, Error, Result};
use rmlx_sys::ffi;
use std::collections::BTreeMap;
use std::path::Path;

/// The arrays and metadata of a safetensors file.
#[derive(Clone, Debug, Default)]
pub struct Safetensors {
    pub arrays: BTreeMap<String, Array>,
    pub metadata: BTreeMap<String, String>,
}

/// A GGUF metadata value. Numbers (and lists of numbers) come back as arrays.
#[derive(Clone, Debug)]
pub enum GgufValue {
    Array(Array),
    String(String),
    Strings(Vec<String>),
    /// A value MLX does not represent.
    Unsupported,
}

/// The arrays and metadata of a GGUF file.
#[derive(Clone, Debug, Default)]
pub struct Gguf {
    pub arrays: BTreeMap<String, Array>,
    pub metadata: BTreeMap<String, GgufValue>,
}

fn path_str(path: &Path) -> Result<&str> {
    path.to_str().ok_or_else(|| Error::InvalidArgument(format!("path is not UTF-8: {}", path.display())))
}

fn check_readable(path: &Path) -> Result<()> {
    std::fs::metadata(path).map(|_| ()).map_err(|error| Error::Io { path: path.display().to_string(), error })
}

fn arrays_of(names: Vec<String>, arrays: &rmlx_sys::cxx::UniquePtr<ffi::ArrayVec>) -> BTreeMap<String, Array> {
    names.into_iter().zip(from_array_vec(arrays)).collect()
}

/// Opens a safetensors file (lazily: data is read on evaluation).
pub fn load_safetensors(path: impl AsRef<Path>) -> Result<Safetensors> {
    let path = path.as_ref();
    check_readable(path)?;
    let path_s = path_str(path)?;
    let loaded = locked(|| ffi::load_safetensors(path_s, current()))?;
    Ok(Safetensors {
        arrays: arrays_of(loaded.names, &loaded.arrays),
        metadata: loaded.meta_keys.into_iter().zip(loaded.meta_values).collect(),
    })
}

/// Writes arrays and string metadata to a safetensors file.
///
/// ```
/// use rmlx::{io, Array};
/// use std::collections::BTreeMap;
/// let path = std::env::temp_dir().join("rmlx-doc-example.safetensors");
/// let arrays = BTreeMap::from([("w".to_string(), Array::from_slice(&[1.5f32, -2.0], &[2])?)]);
/// let meta = BTreeMap::from([("format".to_string(), "mlx".to_string())]);
/// io::save_safetensors(&path, &arrays, &meta)?;
/// let back = io::load_safetensors(&path)?;
/// assert_eq!(back.arrays["w"].to_vec::<f32>()?, vec![1.5, -2.0]);
/// assert_eq!(back.metadata["format"], "mlx");
/// # Ok::<(), rmlx::Error>(())
/// ```
pub fn save_safetensors(
    path: impl AsRef<Path>,
    arrays: &BTreeMap<String, Array>,
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let names: Vec<String> = arrays.keys().cloned().collect();
    let keys: Vec<String> = metadata.keys().cloned().collect();
    let values: Vec<String> = metadata.values().cloned().collect();
    let (path_s, v) = (path_str(path.as_ref())?, array_vec(arrays.values()));
    Ok(evaluating(|| ffi::save_safetensors(path_s, &names, &v, &keys, &values))?)
}

/// Opens a GGUF file. Tensors of types MLX maps natively (f32, f16, bf16, Q4_0, Q4_1, Q8_0) come
/// back as arrays; quantized ones as their unpacked MLX form (`name`, `name.scales`, `name.biases`).
pub fn load_gguf(path: impl AsRef<Path>) -> Result<Gguf> {
    let path = path.as_ref();
    check_readable(path)?;
    let path_s = path_str(path)?;
    let loaded = locked(|| ffi::load_gguf(path_s, current()))?;
    let meta_arrays = from_array_vec(&loaded.meta_arrays);
    let metadata = loaded
        .gguf_meta
        .into_iter()
        .map(|m| {
            let value = match m.kind {
                1 => GgufValue::Array(meta_arrays[m.array_index].clone()),
                2 => GgufValue::String(m.strings.into_iter().next().unwrap_or_default()),
                3 => GgufValue::Strings(m.strings),
                _ => GgufValue::Unsupported,
            };
            (m.key, value)
        })
        .collect();
    Ok(Gguf { arrays: arrays_of(loaded.names, &loaded.arrays), metadata })
}

/// Writes arrays and metadata to a GGUF file.
pub fn save_gguf(
    path: impl AsRef<Path>,
    arrays: &BTreeMap<String, Array>,
    metadata: &BTreeMap<String, GgufValue>,
) -> Result<()> {
    let names: Vec<String> = arrays.keys().cloned().collect();
    let mut meta_arrays = Vec::new();
    let meta: Vec<ffi::GgufMeta> = metadata
        .iter()
        .map(|(key, value)| {
            let (kind, strings, array_index) = match value {
                GgufValue::Array(a) => {
                    meta_arrays.push(a);
                    (1, vec![], meta_arrays.len() - 1)
                }
                GgufValue::String(s) => (2, vec![s.clone()], 0),
                GgufValue::Strings(v) => (3, v.clone(), 0),
                GgufValue::Unsupported => (0, vec![], 0),
            };
            ffi::GgufMeta { key: key.clone(), kind, strings, array_index }
        })
        .collect();
    let (path_s, v, mv) = (path_str(path.as_ref())?, array_vec(arrays.values()), array_vec(meta_arrays));
    Ok(evaluating(|| ffi::save_gguf(path_s, &names, &v, &meta, &mv))?)
}

/// Reads a NumPy `.npy` file.
pub fn load_npy(path: impl AsRef<Path>) -> Result<Array> {
    let path = path.as_ref();
    check_readable(path)?;
    let path_s = path_str(path)?;
    wrap(|| ffi::load_npy(path_s, current()))
}

/// Writes a NumPy `.npy` file.
pub fn save_npy(path: impl AsRef<Path>, a: &Array) -> Result<()> {
    let path_s = path_str(path.as_ref())?;
    Ok(evaluating(|| ffi::save_npy(path_s, a.raw()))?)
}
