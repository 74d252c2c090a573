//! Rows of an affine-quantised matrix on the CPU in one primitive: a quantised embedding's lookup.
//!
//! MLX's CPU `dequantize` is the composed fallback of its fast path: per packed value a left
//! shift, a right shift and a new axis, a concatenation, a product with the scales, a sum with
//! the biases, reshapes, after a gather of each of the three arrays: about twenty operations for
//! the one row of a decoding step, each a task on MLX's CPU worker. [`cpu_quantized_rows`] computes
//! the same values (the product and the sum each rounded to the scales' dtype, then cast to the
//! asked dtype, as those operations do) as one operation.

use super::cpu_fast::{round, store, Floats};
use rmlx::custom::{apply, CpuTensor, CpuTensorMut, CustomPrimitive};
use rmlx::fast::TensorSpec;
use rmlx::quantization::{QuantMode, Quantized};
use rmlx::{Array, Dtype, Error, Result};

/// Rows `ids` of `q` dequantised to `dtype`, as one CPU operation; `None` where it does not serve
/// (another device, a traced transform or training, another mode or width, no biases).
pub(crate) fn cpu_quantized_rows(q: &Quantized, ids: &Array, dtype: Dtype) -> Result<Option<Array>> {
    let half_or_float = |d: Dtype| matches!(d, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16);
    let serves = rmlx::current_device().kind == rmlx::DeviceType::Cpu
        && !super::training()
        && !ids.is_tracer()
        && matches!(ids.dtype(), Dtype::Int32 | Dtype::Uint32)
        && q.mode == QuantMode::Affine
        && matches!(q.bits, 2 | 4 | 8)
        && q.weight.ndim() == 2
        && half_or_float(q.scales.dtype())
        && half_or_float(dtype)
        && q.biases.as_ref().is_some_and(|b| b.dtype() == q.scales.dtype());
    let Some(biases) = q.biases.as_ref().filter(|_| serves) else { return Ok(None) };
    let op = QuantizedRows { bits: q.bits as usize, group: q.group_size as usize, dtype };
    let inputs = [ids.clone(), q.weight.clone(), q.scales.clone(), biases.clone()];
    Ok(apply(op, &inputs)?.into_iter().next())
}

/// The primitive: inputs `[ids, packed, scales, biases]`, output `ids.shape + [features]`.
struct QuantizedRows {
    bits: usize,
    group: usize,
    dtype: Dtype,
}

impl CustomPrimitive for QuantizedRows {
    fn name(&self) -> String {
        "CpuQuantizedRows".into()
    }

    fn output_specs(&self, inputs: &[TensorSpec]) -> Result<Vec<TensorSpec>> {
        let (ids, w, s) = (&inputs[0], &inputs[1], &inputs[2]);
        let features = w.shape.get(1).map_or(0, |&n| n as usize * 32 / self.bits);
        let fits = inputs.len() == 4
            && w.shape.len() == 2
            && s.shape.len() == 2
            && inputs[3].shape == s.shape
            && s.shape[0] == w.shape[0]
            && self.group > 0
            && features == s.shape[1] as usize * self.group;
        if !fits {
            return Err(Error::InvalidArgument(format!(
                "quantised rows: packed {:?}, scales {:?}, biases {:?}, {} bits in groups of {}",
                w.shape, s.shape, inputs[3].shape, self.bits, self.group
            )));
        }
        let mut shape = ids.shape.clone();
        shape.push(features as i32);
        Ok(vec![TensorSpec::new(&shape, self.dtype)])
    }

    fn eval_cpu(&self, inputs: &[CpuTensor<'_>], outputs: &mut [CpuTensorMut<'_>]) -> Result<()> {
        let ids: Vec<i64> = match inputs[0].dtype() {
            Dtype::Int32 => inputs[0].as_slice::<i32>()?.iter().map(|&i| i64::from(i)).collect(),
            _ => inputs[0].as_slice::<u32>()?.iter().map(|&i| i64::from(i)).collect(),
        };
        let packed = inputs[1].as_slice::<u32>()?;
        // Only the rows looked up are widened (a vocabulary's scales are megabytes).
        let (scales, biases) = (Floats::of(&inputs[2])?, Floats::of(&inputs[3])?);
        let scale_dtype = inputs[2].dtype();
        let (rows, words) = (inputs[1].shape()[0] as usize, inputs[1].shape()[1] as usize);
        let per_word = 32 / self.bits;
        let features = words * per_word;
        let groups = features / self.group;
        let mask = (1u32 << self.bits) - 1;
        let mut out = vec![0f32; ids.len() * features];
        for (row_out, &id) in out.chunks_exact_mut(features).zip(&ids) {
            let Some(row) = usize::try_from(id).ok().filter(|&r| r < rows) else {
                return Err(Error::InvalidArgument(format!("row {id} of a quantised matrix of {rows} rows")));
            };
            let words = &packed[row * words..(row + 1) * words];
            for (i, v) in row_out.iter_mut().enumerate() {
                *v = ((words[i / per_word] >> (self.bits * (i % per_word))) & mask) as f32;
            }
            let of_row = row * groups..(row + 1) * groups;
            let (row_scales, row_biases) = (scales.widened(of_row.clone()), biases.widened(of_row));
            // `q · scale`, then `+ bias`, each rounded to the scales' dtype (MLX's two operations).
            for (g, part) in row_out.chunks_exact_mut(self.group).enumerate() {
                let s = row_scales[g];
                part.iter_mut().for_each(|v| *v *= s);
                round(part, scale_dtype);
                let b = row_biases[g];
                part.iter_mut().for_each(|v| *v += b);
                round(part, scale_dtype);
            }
        }
        store(&mut outputs[0], &out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmlx::quantization::{dequantize, quantize};

    /// Bit for bit MLX's composed lookup (a gather of each array, then `dequantize`), for 4 and 8
    /// bits, float32 and bfloat16 scales, every output dtype, ids of both integer types and shapes.
    #[test]
    fn rows_equal_the_composed_lookup() {
        rmlx::with_device(rmlx::Device::cpu(), || {
            let values: Vec<f32> = (0..16 * 128).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
            let w = Array::from_slice(&values, &[16, 128]).unwrap();
            for (bits, group) in [(4, 32), (8, 64), (4, 128)] {
                for scale_dtype in [Dtype::Float32, Dtype::Bfloat16] {
                    let q = quantize(&w.astype(scale_dtype).unwrap(), group, bits, QuantMode::Affine).unwrap();
                    for dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
                        for ids in [
                            Array::from_slice(&[3i32, 0, 15, 3], &[2, 2]).unwrap(),
                            Array::from_slice(&[7u32], &[1, 1]).unwrap(),
                        ] {
                            let got = cpu_quantized_rows(&q, &ids, dtype).unwrap().expect("serves");
                            let rows = Quantized {
                                weight: q.weight.take(&ids, Some(0)).unwrap(),
                                scales: q.scales.take(&ids, Some(0)).unwrap(),
                                biases: q.biases.as_ref().map(|b| b.take(&ids, Some(0)).unwrap()),
                                ..q.clone()
                            };
                            let want = dequantize(&rows, Some(dtype)).unwrap();
                            assert_eq!(got.shape(), want.shape());
                            let (g, w) = (got.astype(Dtype::Float32).unwrap(), want.astype(Dtype::Float32).unwrap());
                            assert_eq!(
                                g.to_vec::<f32>().unwrap(),
                                w.to_vec::<f32>().unwrap(),
                                "{bits} bits, groups of {group}, {scale_dtype:?} scales, {dtype:?}"
                            );
                        }
                    }
                }
            }
            let q = quantize(&w, 32, 4, QuantMode::Affine).unwrap();
            let out_of_range = cpu_quantized_rows(&q, &Array::from_slice(&[16i32], &[1]).unwrap(), Dtype::Float32);
            match out_of_range.unwrap().expect("serves").eval() {
                Err(e) => assert!(e.to_string().contains("row 16 of a quantised matrix of 16 rows"), "{e}"),
                Ok(()) => panic!("an id past the rows evaluated"),
            }
        });
    }
}
