//! Validation of a GGUF tensor directory against the file that holds it: every dimension fits
//! MLX's `i32` shapes, sizes are computed in checked 64-bit arithmetic, and each tensor's data is
//! aligned, inside the file, disjoint from the others and where llama.cpp's writer puts it (each
//! tensor right after the previous one, padded to the alignment), so that a size that disagrees
//! with the declared type (float32 data declared float16, say) is caught rather than read as
//! garbage. Also the bounds on counts declared in the header, so that nothing is reserved from a
//! count the file cannot hold.

use super::{GgmlType, TensorInfo};
use crate::{Error, Result};
use std::collections::HashSet;
use std::path::Path;

/// Fewest bytes a tensor directory entry takes: name length, dimension count, type, offset.
pub(super) const MIN_TENSOR_ENTRY: u64 = 8 + 4 + 4 + 8;
/// Fewest bytes a metadata entry takes: key length, value type, a one-byte value.
pub(super) const MIN_KV_ENTRY: u64 = 8 + 4 + 1;
/// Most elements accepted in one metadata array (the largest vocabularies hold ~2.6·10⁵ tokens):
/// with the file-length bound, it caps what one array costs even in a huge sparse file.
pub(super) const MAX_ARRAY_LEN: u64 = 1 << 22;

/// A directory entry as read: name, GGUF dimensions (fastest first), type, offset relative to the
/// start of the data section.
pub(super) struct RawTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    pub rel: u64,
}

/// Fewest bytes one element of a metadata array of value type `ty` takes (`None`: unknown type).
pub(super) fn min_value_size(ty: u32) -> Option<u64> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => return None,
    })
}

/// Checks that `count` entries of at least `min_size` bytes each fit in the `left` bytes of the
/// file that remain.
pub(super) fn check_count(path: &Path, what: &str, count: u64, min_size: u64, left: u64) -> Result<()> {
    if count > left / min_size.max(1) {
        return Err(Error::Corrupt {
            path: path.display().to_string(),
            reason: format!(
                "{what} of {count} cannot fit in the {left} bytes left in the file (each takes at least \
                 {min_size}): truncated or corrupt header"
            ),
        });
    }
    Ok(())
}

/// Size in bytes of a tensor of `dims` (fastest first) of type `ty`, with every dimension checked
/// against `i32::MAX`; `Ok(None)` for a type of unknown layout.
fn tensor_bytes(dims: &[u64], ty: GgmlType) -> std::result::Result<Option<u64>, String> {
    if let Some(&d) = dims.iter().find(|&&d| d > i32::MAX as u64) {
        return Err(format!("dimension {d} of {dims:?} exceeds {} (MLX's limit)", i32::MAX));
    }
    let numel = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).filter(|&n| n <= i64::MAX as u64);
    let numel = numel.ok_or_else(|| format!("dimensions {dims:?} overflow"))?;
    let Some((be, bb)) = ty.block_layout() else { return Ok(None) };
    let ne0 = dims.first().copied();
    if ne0.map_or(be > 1, |ne0| ne0 % be as u64 != 0) {
        return Err(format!("row length {} is not a multiple of the {ty} block size {be}", ne0.unwrap_or(1)));
    }
    (numel / be as u64).checked_mul(bb as u64).map(Some).ok_or_else(|| "size overflows".to_string())
}

/// Turns the raw directory into [`TensorInfo`]s with absolute offsets, checking each entry and
/// the layout of the data section `[data_start, file_len)`.
pub(super) fn build(
    path: &Path,
    raw: Vec<RawTensor>,
    data_start: u64,
    alignment: u64,
    file_len: u64,
) -> Result<Vec<TensorInfo>> {
    let corrupt = |name: &str, reason: String| Error::Corrupt {
        path: path.display().to_string(),
        reason: format!("tensor `{name}`: {reason}"),
    };
    let mut tensors = Vec::with_capacity(raw.len());
    let mut names = HashSet::with_capacity(raw.len());
    // Where llama.cpp's writer puts the next tensor (unknown after a tensor of unknown layout).
    let mut expected = Some(0u64);
    for RawTensor { name, dims, ggml_type, rel } in raw {
        let bad = |reason: String| corrupt(&name, reason);
        let nbytes = tensor_bytes(&dims, ggml_type).map_err(&bad)?;
        if rel % alignment != 0 {
            return Err(bad(format!("data offset {rel} is not a multiple of the alignment {alignment}")));
        }
        let offset = data_start.checked_add(rel).ok_or_else(|| bad("offset overflows".into()))?;
        let end = offset.checked_add(nbytes.unwrap_or(0)).ok_or_else(|| bad("offset overflows".into()))?;
        if end > file_len {
            return Err(bad(format!(
                "data [{offset}, {end}) lies past the end of the file ({file_len} bytes): truncated file?"
            )));
        }
        if !names.insert(name.clone()) {
            return Err(bad("duplicate tensor name".into()));
        }
        if let Some(want) = expected {
            if rel > want {
                return Err(bad(format!(
                    "data offset {rel}, expected {want}: the sizes of the tensors before it disagree with their \
                     declared types"
                )));
            }
        }
        expected = nbytes.map(|n| rel + n.div_ceil(alignment) * alignment);
        let shape = dims.iter().rev().map(|&d| d as usize).collect();
        let nbytes = nbytes.unwrap_or(0) as usize;
        tensors.push(TensorInfo { name, shape, ggml_type, offset, nbytes });
    }
    if let (Some(want), Some(last)) = (expected, tensors.last()) {
        let data_end = data_start.saturating_add(want);
        if file_len > data_end {
            return Err(corrupt(
                &last.name,
                format!(
                    "the file holds {} bytes after the data of the last tensor (ends at byte {data_end}): its size \
                     disagrees with its declared type {}",
                    file_len - data_end,
                    last.ggml_type
                ),
            ));
        }
    }
    check_disjoint(&tensors).map_err(|(a, b)| {
        let (a, b) = (&tensors[a], &tensors[b]);
        corrupt(
            &b.name,
            format!(
                "data [{}, {}) overlaps tensor `{}` at [{}, {})",
                b.offset,
                b.offset + b.nbytes as u64,
                a.name,
                a.offset,
                a.offset + a.nbytes as u64
            ),
        )
    })?;
    Ok(tensors)
}

/// The first pair of tensors (by position in `tensors`) whose non-empty data ranges overlap.
fn check_disjoint(tensors: &[TensorInfo]) -> std::result::Result<(), (usize, usize)> {
    let mut order: Vec<usize> = (0..tensors.len()).filter(|&i| tensors[i].nbytes > 0).collect();
    order.sort_by_key(|&i| tensors[i].offset);
    for pair in order.windows(2) {
        let (a, b) = (&tensors[pair[0]], &tensors[pair[1]]);
        if a.offset + a.nbytes as u64 > b.offset {
            return Err((pair[0], pair[1]));
        }
    }
    Ok(())
}
