//! A checkpoint's tensors by name, before they are built into a model: dense arrays, or MLX affine
//! quantised matrices (packed weight, scales, biases). Loaders fill it, models take from it.

use crate::{Error, Result};
use rmlx::quantization::Quantized;
use rmlx::Array;
use std::collections::HashMap;

/// One tensor of a checkpoint.
#[derive(Clone, Debug)]
pub enum Weight {
    /// A plain array (any float dtype; converted to the compute dtype when a layer is built).
    Dense(Array),
    /// An MLX affine-quantised matrix `[out, in]` stored as packed `uint32` plus per-group scales and
    /// biases.
    Quantized(Quantized),
}

impl Weight {
    /// The logical shape: for a quantised matrix, `[out, in]` of the unpacked values.
    pub fn shape(&self) -> Vec<i32> {
        match self {
            Weight::Dense(a) => a.shape().to_vec(),
            Weight::Quantized(q) => {
                let mut s = q.weight.shape().to_vec();
                if let Some(last) = s.last_mut() {
                    // In 64 bits: a packed width beyond 2^26 would overflow i32 before the division.
                    let unpacked = *last as i64 * 32 / q.bits.max(1) as i64;
                    *last = i32::try_from(unpacked).unwrap_or(i32::MAX);
                }
                s
            }
        }
    }
}

/// The tensors of a checkpoint, by (Hugging Face) name.
#[derive(Default)]
pub struct Weights {
    map: HashMap<String, Weight>,
    /// Where the safetensors tensors lie in their files, by name.
    sources: HashMap<String, TensorSource>,
}

impl Weights {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a tensor.
    pub fn insert(&mut self, name: impl Into<String>, w: Weight) {
        self.map.insert(name.into(), w);
    }

    /// Whether a tensor is present.
    pub fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    /// The tensor names, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.map.keys().map(String::as_str)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Removes and returns a tensor; [`Error::MissingTensor`] names it when absent.
    pub fn take(&mut self, name: &str) -> Result<Weight> {
        self.map.remove(name).ok_or_else(|| Error::MissingTensor(name.to_string()))
    }

    /// Removes and returns a tensor if present.
    pub fn take_opt(&mut self, name: &str) -> Option<Weight> {
        self.map.remove(name)
    }

    /// Borrows a tensor if present.
    pub fn get(&self, name: &str) -> Option<&Weight> {
        self.map.get(name)
    }
}

/// Where a tensor lies in a safetensors file: what a rank of a tensor-parallel model reads its
/// part of, instead of the whole tensor ([`read_part`]).
#[derive(Clone, Debug)]
pub struct TensorSource {
    pub path: std::sync::Arc<std::path::PathBuf>,
    /// Byte offset of the tensor's first element in the file.
    pub offset: u64,
    /// The safetensors dtype (`BF16`, `U32`, ...).
    pub dtype: &'static str,
    pub shape: Vec<i32>,
}

impl Weights {
    /// Records where the tensor `name` lies in its file.
    pub fn set_source(&mut self, name: impl Into<String>, source: TensorSource) {
        self.sources.insert(name.into(), source);
    }

    /// Where the checkpoint's tensor `name` lies, while it is the checkpoint's (a renamed tensor
    /// keeps its source; a rewritten one has none).
    pub fn source(&self, name: &str) -> Option<&TensorSource> {
        self.sources.get(name)
    }

    /// Moves the source of `from` to `to` (a tensor renamed as it is).
    pub fn rename_source(&mut self, from: &str, to: &str) {
        if let Some(s) = self.sources.remove(from) {
            self.sources.insert(to.to_string(), s);
        }
    }

    /// Forgets the source of `name` (a tensor put there that is not the file's).
    pub fn forget_source(&mut self, name: &str) {
        self.sources.remove(name);
    }
}

/// The elements `start .. start + len` along `axis` of the tensor at `source`, read from its file
/// alone: one read per contiguous run (a run of rows, or one row's columns per row), straight
/// into the array's elements. `None` for a dtype this reader does not take, or on a big-endian
/// machine (the caller slices the whole tensor instead).
pub fn read_part(source: &TensorSource, axis: usize, start: i32, len: i32) -> Result<Option<Array>> {
    let shape = &source.shape;
    if axis >= shape.len() || start < 0 || len <= 0 || start + len > shape[axis] {
        return Err(Error::Config(format!("reading elements {start}..{} of axis {axis} of {shape:?}", start + len)));
    }
    if cfg!(target_endian = "big") {
        return Ok(None);
    }
    let mut part = shape.clone();
    part[axis] = len;
    let (s, a) = (source, axis);
    Ok(Some(match source.dtype {
        "F32" => read_runs::<f32>(s, a, start, &part)?,
        "U32" => read_runs::<u32>(s, a, start, &part)?,
        "I32" => read_runs::<i32>(s, a, start, &part)?,
        "BF16" => read_runs::<half::bf16>(s, a, start, &part)?,
        "F16" => read_runs::<half::f16>(s, a, start, &part)?,
        "U16" => read_runs::<u16>(s, a, start, &part)?,
        "U8" => read_runs::<u8>(s, a, start, &part)?,
        "I8" => read_runs::<i8>(s, a, start, &part)?,
        _ => return Ok(None),
    }))
}

/// [`read_part`] for elements of type `T` (the file's, little-endian as this machine).
fn read_runs<T: rmlx::Element>(source: &TensorSource, axis: usize, start: i32, part: &[i32]) -> Result<Array> {
    use std::os::unix::fs::FileExt;
    let size = std::mem::size_of::<T>();
    let shape = &source.shape;
    // `outer` runs, each `len · inner` elements of a block of `shape[axis] · inner`.
    let outer: usize = shape[..axis].iter().map(|&d| d as usize).product();
    let inner: usize = shape[axis + 1..].iter().map(|&d| d as usize).product();
    let (whole, run) = (shape[axis] as usize * inner * size, part[axis] as usize * inner * size);
    let mut values = vec![T::default(); outer * run / size];
    // SAFETY: `values` is `outer · run` bytes of plain numbers (every bit pattern is a value).
    let bytes = unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr() as *mut u8, outer * run) };
    let path = source.path.as_ref();
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    for (o, chunk) in bytes.chunks_mut(run).enumerate() {
        let at = source.offset + (o * whole + start as usize * inner * size) as u64;
        file.read_exact_at(chunk, at).map_err(|e| Error::io(path, e))?;
    }
    Ok(Array::from_slice(&values, part)?)
}

#[cfg(test)]
mod tests {
    use super::{read_part, TensorSource};
    use rmlx::{Array, Dtype};
    use std::collections::BTreeMap;

    /// Every part along every axis of a `[3, 4, 5]` tensor, read from its file, is the slice of
    /// the tensor, in float32, bfloat16 and uint32.
    #[test]
    fn parts_read_from_the_file_are_the_slices() {
        let dir = std::env::temp_dir().join(format!("rmlx-read-part-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let values: Vec<f32> = (0..60).map(|i| i as f32 * 0.5 - 7.0).collect();
        let t = Array::from_slice(&values, &[3, 4, 5]).unwrap();
        let arrays: BTreeMap<String, Array> = [
            ("f".to_string(), t.clone()),
            ("b".to_string(), t.astype(Dtype::Bfloat16).unwrap()),
            ("u".to_string(), (t + 8.0).unwrap().astype(Dtype::Uint32).unwrap()),
        ]
        .into();
        let path = dir.join("t.safetensors");
        rmlx::io::save_safetensors(&path, &arrays, &BTreeMap::new()).unwrap();
        let header = crate::safetensors_header::check_file(&path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let data = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap());
        let path = std::sync::Arc::new(path);
        for entry in header {
            let source = TensorSource {
                path: path.clone(),
                offset: data + entry.data_offsets.0,
                dtype: entry.dtype,
                shape: entry.shape.clone(),
            };
            let whole = &arrays[&entry.name];
            for (axis, start, len) in [(0, 1, 2), (1, 0, 2), (1, 2, 2), (2, 1, 3), (2, 4, 1), (0, 0, 3)] {
                let got = read_part(&source, axis, start, len).unwrap().expect("a dtype it reads");
                let want = whole.slice_axis(axis as i32, start, start + len, 1).unwrap();
                assert_eq!((got.shape(), got.dtype()), (want.shape(), want.dtype()), "{}", entry.name);
                let (g, w) = (got.astype(Dtype::Float32).unwrap(), want.astype(Dtype::Float32).unwrap());
                assert_eq!(
                    g.to_vec::<f32>().unwrap(),
                    w.to_vec::<f32>().unwrap(),
                    "{} {axis} {start} {len}",
                    entry.name
                );
            }
            assert!(read_part(&source, 2, 3, 3).is_err(), "past the end");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
