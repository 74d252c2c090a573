//! The GGUF reader: metadata, every supported ggml type against gguf-py's dequantisation (fixtures
//! written by `scripts/make_gguf_fixtures.py`), the lossless `Q4_0`/`Q4_1`/`Q8_0` → MLX affine
//! mapping against ggml's formulas (bit-exact), llama's Q/K row un-permutation, and error cases.

use crate::gguf::{GgmlType, GgufFile, MetaValue};
use crate::models::llama::unpermute_llama_rows;
use crate::weights::Weight;
use crate::Error;
use half::{bf16, f16};
use rmlx::quantization::{dequantize, QuantMode, Quantized};
use rmlx::{Array, Dtype};
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf").join(name)
}

/// A fresh scratch directory for one test, removed when dropped.
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scratch(test: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("rmlx-gguf-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

/// The float32 values of a weight. An affine-quantised one is dequantised by MLX with its float16
/// scales and biases widened to float32 first: MLX computes `scale·q + bias` in the scales' dtype,
/// and `d·(q − 8)` needs up to 15 significant bits, more than float16 holds. An MXFP4 one (scales
/// are exponents) as it is.
fn values(w: &Weight) -> Vec<f32> {
    match w {
        Weight::Dense(a) => a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap(),
        Weight::Quantized(q) if q.mode == QuantMode::Mxfp4 => {
            dequantize(q, Some(Dtype::Float32)).unwrap().to_vec::<f32>().unwrap()
        }
        Weight::Quantized(q) => {
            let wide = Quantized {
                scales: q.scales.astype(Dtype::Float32).unwrap(),
                biases: q.biases.as_ref().map(|b| b.astype(Dtype::Float32).unwrap()),
                ..q.clone()
            };
            dequantize(&wide, None).unwrap().to_vec::<f32>().unwrap()
        }
    }
}

fn f16b(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_le_bytes()
}

/// Writes a GGUF file by hand: tensors as (name, GGUF dims fastest-first, type id, bytes).
struct Builder {
    version: u32,
    alignment: usize,
    kv: Vec<u8>,
    n_kv: u64,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

impl Builder {
    fn new() -> Self {
        Builder { version: 3, alignment: 32, kv: Vec::new(), n_kv: 0, tensors: Vec::new() }
    }

    fn string(buf: &mut Vec<u8>, s: &str) {
        buf.extend((s.len() as u64).to_le_bytes());
        buf.extend(s.as_bytes());
    }

    fn kv(mut self, key: &str, ty: u32, value: &[u8]) -> Self {
        Self::string(&mut self.kv, key);
        self.kv.extend(ty.to_le_bytes());
        self.kv.extend(value);
        self.n_kv += 1;
        self
    }

    fn alignment(mut self, a: u32) -> Self {
        self.alignment = a as usize;
        self.kv("general.alignment", 4, &a.to_le_bytes())
    }

    fn tensor(mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> Self {
        self.tensors.push((name.into(), dims.to_vec(), ty, data));
        self
    }

    fn bytes(&self) -> Vec<u8> {
        let align = |n: usize| n.div_ceil(self.alignment) * self.alignment;
        let mut b = b"GGUF".to_vec();
        b.extend(self.version.to_le_bytes());
        b.extend((self.tensors.len() as u64).to_le_bytes());
        b.extend(self.n_kv.to_le_bytes());
        b.extend(&self.kv);
        let mut offset = 0;
        for (name, dims, ty, data) in &self.tensors {
            Self::string(&mut b, name);
            b.extend((dims.len() as u32).to_le_bytes());
            dims.iter().for_each(|d| b.extend(d.to_le_bytes()));
            b.extend(ty.to_le_bytes());
            b.extend((offset as u64).to_le_bytes());
            offset = align(offset + data.len());
        }
        b.resize(align(b.len()), 0);
        for (_, _, _, data) in &self.tensors {
            b.extend(data);
            b.resize(align(b.len()), 0);
        }
        b
    }

    fn write(&self, dir: &std::path::Path, name: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, self.bytes()).unwrap();
        path
    }
}

fn assert_close(name: &str, got: &[f32], want: &[f32], rel: f32) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let tol = rel * w.abs().max(f32::MIN_POSITIVE);
        assert!((g - w).abs() <= tol, "{name}[{i}]: got {g}, want {w}");
    }
}

#[test]
fn every_type_matches_gguf_py() {
    let file = GgufFile::open(fixture("types.gguf")).unwrap();
    let refs = GgufFile::open(fixture("types_ref.gguf")).unwrap();
    assert_eq!(file.version(), 3);
    assert_eq!(file.tensors().len(), refs.tensors().len());
    // The data start and every tensor sit on the file's 64-byte alignment.
    assert!(file.tensors().iter().all(|t| t.offset % 64 == 0));
    let expected_types = [
        ("f32", GgmlType::F32),
        ("f16", GgmlType::F16),
        ("bf16", GgmlType::BF16),
        ("i8", GgmlType::I8),
        ("i16", GgmlType::I16),
        ("i32", GgmlType::I32),
        ("f64", GgmlType::F64),
        ("q4_0", GgmlType::Q4_0),
        ("q4_1", GgmlType::Q4_1),
        ("q5_0", GgmlType::Q5_0),
        ("q5_1", GgmlType::Q5_1),
        ("q8_0", GgmlType::Q8_0),
        ("q8_0_3d", GgmlType::Q8_0),
        ("q2_k", GgmlType::Q2_K),
        ("q3_k", GgmlType::Q3_K),
        ("q4_k", GgmlType::Q4_K),
        ("q5_k", GgmlType::Q5_K),
        ("q6_k", GgmlType::Q6_K),
        ("q8_k", GgmlType::Q8_K),
        ("iq4_xs", GgmlType::IQ4_XS),
        ("iq4_nl", GgmlType::IQ4_NL),
        ("mxfp4", GgmlType::MXFP4),
    ];
    for (name, ty) in expected_types {
        let info = file.tensor(name).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(info.ggml_type, ty, "{name}");
        let r = refs.tensor(name).unwrap();
        assert_eq!(r.ggml_type, GgmlType::F32);
        assert_eq!(info.shape, r.shape, "{name}: row-major shape");
        let w = file.load(info).unwrap();
        assert_eq!(w.shape(), info.shape.iter().map(|&d| d as i32).collect::<Vec<_>>(), "{name}");
        match (&w, ty) {
            (Weight::Quantized(q), GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0) => {
                assert_eq!(
                    (q.group_size, q.bits, q.mode),
                    (32, if ty == GgmlType::Q8_0 { 8 } else { 4 }, QuantMode::Affine)
                );
                assert_eq!(q.weight.dtype(), Dtype::Uint32);
                assert_eq!(q.scales.dtype(), Dtype::Float16);
                assert_eq!(q.biases.as_ref().unwrap().dtype(), Dtype::Float16);
            }
            (Weight::Quantized(q), GgmlType::Q4_K | GgmlType::Q5_K) => {
                let bits = if ty == GgmlType::Q4_K { 4 } else { 5 };
                assert_eq!((q.group_size, q.bits, q.mode), (32, bits, QuantMode::Affine));
                assert_eq!((q.scales.dtype(), q.biases.as_ref().unwrap().dtype()), (Dtype::Float32, Dtype::Float32));
            }
            (Weight::Quantized(q), GgmlType::MXFP4) => {
                assert_eq!((q.group_size, q.bits, q.mode), (32, 4, QuantMode::Mxfp4));
                assert_eq!((q.weight.dtype(), q.scales.dtype()), (Dtype::Uint32, Dtype::Uint8));
                assert!(q.biases.is_none());
            }
            (Weight::Dense(a), GgmlType::F16) => assert_eq!(a.dtype(), Dtype::Float16),
            (Weight::Dense(a), GgmlType::BF16) => assert_eq!(a.dtype(), Dtype::Bfloat16),
            (Weight::Dense(a), _) => assert_eq!(a.dtype(), Dtype::Float32, "{name}"),
            _ => panic!("{name}: unexpected weight kind"),
        }
        let want = values(&refs.load(r).unwrap());
        assert!(want.iter().all(|v| v.is_finite()) && want.iter().any(|&v| v != 0.0), "{name}: reference");
        assert_close(name, &values(&w), &want, 1e-6);
    }
}

#[test]
fn metadata_round_trip() {
    let file = GgufFile::open(fixture("types.gguf")).unwrap();
    let get = |k: &str| file.get(k).unwrap_or_else(|| panic!("{k} missing"));
    assert_eq!(get("general.architecture").as_str(), Some("llama"));
    assert_eq!(get("general.name").as_str(), Some("rmlx GGUF fixture"));
    assert_eq!(get("general.alignment"), &MetaValue::U32(64));
    assert_eq!(get("test.u8"), &MetaValue::U8(200));
    assert_eq!(get("test.i8"), &MetaValue::I8(-100));
    assert_eq!(get("test.u16"), &MetaValue::U16(60000));
    assert_eq!(get("test.i16"), &MetaValue::I16(-30000));
    assert_eq!(get("test.u32").as_u64(), Some(4_000_000_000));
    assert_eq!(get("test.i32").as_i64(), Some(-2_000_000_000));
    assert_eq!(get("test.i32").as_u64(), None);
    assert_eq!(get("test.u64"), &MetaValue::U64((1 << 63) + 5));
    assert_eq!(get("test.u64").as_i64(), None);
    assert_eq!(get("test.i64").as_i64(), Some(-(1 << 62)));
    assert_eq!(get("test.f32"), &MetaValue::F32(0.15625));
    assert_eq!(get("test.f64").as_f64(), Some(-1.0e300));
    assert_eq!(get("test.u16").as_f64(), Some(60000.0));
    assert_eq!(get("test.bool").as_bool(), Some(true));
    assert_eq!(get("test.f32").as_u64(), None);
    assert_eq!(get("test.string").as_str(), Some("héllo, wörld ✓"));
    assert_eq!(get("test.strings").to_string_vec().unwrap(), ["a", "", "<0x0A>", "Ġthe"]);
    assert_eq!(get("test.ints").to_i64_vec().unwrap(), [1, -2, 3]);
    assert_eq!(get("test.ints").to_f32_vec().unwrap(), [1.0, -2.0, 3.0]);
    assert_eq!(get("test.floats").to_f32_vec().unwrap(), [0.5, -1.25, 3.0]);
    assert_eq!(get("test.floats").to_i64_vec(), None);
    assert_eq!(get("test.ints").to_string_vec(), None);
    let nested = get("test.nested").as_array().unwrap();
    assert_eq!(nested.len(), 2);
    assert_eq!(nested[0].to_i64_vec().unwrap(), [1, 2]);
    assert_eq!(nested[1].to_i64_vec().unwrap(), [3]);
    assert!(file.metadata().contains_key("test.bool"));
    assert!(file.get("test.absent").is_none());
}

/// Q4_0 blocks: `d` per block, `nib(k)` the 4-bit code of element k; byte i holds elements i and
/// i + 16.
fn q4_blocks(ds: &[f32], mins: Option<&[f32]>, nib: impl Fn(usize, usize) -> u8) -> Vec<u8> {
    let mut b = Vec::new();
    for (blk, &d) in ds.iter().enumerate() {
        b.extend(f16b(d));
        if let Some(m) = mins {
            b.extend(f16b(m[blk]));
        }
        b.extend((0..16).map(|i| nib(blk, i) | nib(blk, i + 16) << 4));
    }
    b
}

/// A weight's values against ggml's formula, exactly (`==`: `d·(q − 8)` gives −0 where the affine
/// form `d·q − 8d` gives +0; every other value must be bit-identical).
fn assert_exact(w: &Weight, want: &[f32]) {
    let got = values(w);
    assert_eq!(got.len(), want.len());
    for (i, (g, e)) in got.iter().zip(want).enumerate() {
        assert!(g == e, "element {i}: got {g}, want {e}");
    }
}

#[test]
fn q4_0_maps_losslessly_to_affine() {
    // 2 rows × 64 columns = 4 blocks; a subnormal, a negative and an ordinary float16 scale.
    let ds = [0.0123_f32, -3.5, 6.0e-8, 1024.0];
    let nib = |blk: usize, k: usize| ((k * 7 + blk * 3) % 16) as u8;
    let dir = scratch("q4_0");
    let path = Builder::new().tensor("w", &[64, 2], 2, q4_blocks(&ds, None, nib)).write(&dir, "q.gguf");
    let file = GgufFile::open(&path).unwrap();
    let info = file.tensor("w").unwrap();
    assert_eq!((info.shape.clone(), info.nbytes), (vec![2, 64], 4 * 18));
    let w = file.load(info).unwrap();
    let Weight::Quantized(q) = &w else { panic!("Q4_0 should stay quantised") };
    assert_eq!(q.weight.shape(), [2, 8]);
    assert_eq!(q.scales.shape(), [2, 2]);
    // MLX's packing: element j of a word at bits 4j, natural order along the row.
    let words = q.weight.to_vec::<u32>().unwrap();
    let expect_word0 = (0..8).fold(0u32, |acc, j| acc | (nib(0, j) as u32) << (4 * j));
    assert_eq!(words[0], expect_word0);
    let expect_word2 = (0..8).fold(0u32, |acc, j| acc | (nib(0, 16 + j) as u32) << (4 * j));
    assert_eq!(words[2], expect_word2);
    let biases = q.biases.as_ref().unwrap().to_vec::<f16>().unwrap();
    assert_eq!(biases, ds.map(|d| f16::from_f32(-8.0 * f16::from_f32(d).to_f32())));
    let want: Vec<f32> =
        (0..128).map(|e| (nib(e / 32, e % 32) as i32 - 8) as f32 * f16::from_f32(ds[e / 32]).to_f32()).collect();
    assert_exact(&w, &want);
}

#[test]
fn q4_1_maps_losslessly_to_affine() {
    let ds = [0.0371_f32, -0.5, 7.5];
    let ms = [-0.9_f32, 0.013, 100.25];
    let nib = |blk: usize, k: usize| ((k * 5 + blk) % 16) as u8;
    let dir = scratch("q4_1");
    let path = Builder::new().tensor("w", &[96, 1], 3, q4_blocks(&ds, Some(&ms), nib)).write(&dir, "q.gguf");
    let file = GgufFile::open(&path).unwrap();
    let w = file.load(file.tensor("w").unwrap()).unwrap();
    let Weight::Quantized(q) = &w else { panic!("Q4_1 should stay quantised") };
    assert_eq!((q.weight.shape(), q.bits), (&[1, 12][..], 4));
    let h = |x: f32| f16::from_f32(x).to_f32();
    let want: Vec<f32> = (0..96).map(|e| nib(e / 32, e % 32) as f32 * h(ds[e / 32]) + h(ms[e / 32])).collect();
    assert_exact(&w, &want);
}

fn q8_0_blocks(ds: &[f32], q: impl Fn(usize, usize) -> i8) -> Vec<u8> {
    let mut b = Vec::new();
    for (blk, &d) in ds.iter().enumerate() {
        b.extend(f16b(d));
        b.extend((0..32).map(|k| q(blk, k) as u8));
    }
    b
}

#[test]
fn q8_0_maps_losslessly_to_affine() {
    let ds = [0.00731_f32, -0.25, 511.5, 3.0e-7];
    // Covers -128 and 127.
    let qf = |blk: usize, k: usize| ((k * 37 + blk * 11) % 256) as u8 as i8;
    let dir = scratch("q8_0");
    let path = Builder::new().tensor("w", &[32, 2, 2], 8, q8_0_blocks(&ds, qf)).write(&dir, "q.gguf");
    let file = GgufFile::open(&path).unwrap();
    let w = file.load(file.tensor("w").unwrap()).unwrap();
    let Weight::Quantized(q) = &w else { panic!("Q8_0 should stay quantised") };
    assert_eq!((q.weight.shape(), q.scales.shape(), q.bits), (&[2, 2, 8][..], &[2, 2, 1][..], 8));
    let words = q.weight.to_vec::<u32>().unwrap();
    assert_eq!(words[0] & 0xFF, (qf(0, 0) as i32 + 128) as u32);
    assert_eq!(words[0] >> 24, (qf(0, 3) as i32 + 128) as u32);
    let want: Vec<f32> = (0..128).map(|e| qf(e / 32, e % 32) as f32 * f16::from_f32(ds[e / 32]).to_f32()).collect();
    assert_exact(&w, &want);
}

#[test]
fn overflowing_bias_falls_back_to_float32() {
    // -8·d and -128·d overflow float16 (max 65504): the tensor is dequantised instead.
    let dir = scratch("overflow");
    let nib = |_: usize, k: usize| (k % 16) as u8;
    let qf = |_: usize, k: usize| (k as i8) * 4 - 64;
    let path = Builder::new()
        .tensor("q4", &[64, 1], 2, q4_blocks(&[0.5, 9000.0], None, nib))
        .tensor("q8", &[32, 1], 8, q8_0_blocks(&[600.0], qf))
        .write(&dir, "o.gguf");
    let file = GgufFile::open(&path).unwrap();
    let q4 = file.load(file.tensor("q4").unwrap()).unwrap();
    let Weight::Dense(a) = &q4 else { panic!("expected the float32 fallback") };
    assert_eq!((a.dtype(), a.shape()), (Dtype::Float32, &[1, 64][..]));
    let want: Vec<f32> = (0..64).map(|e| ((e % 32 % 16) as f32 - 8.0) * if e < 32 { 0.5 } else { 9000.0 }).collect();
    assert_exact(&q4, &want);
    let q8 = file.load(file.tensor("q8").unwrap()).unwrap();
    assert!(matches!(q8, Weight::Dense(_)));
    assert_exact(&q8, &(0..32).map(|k| qf(0, k) as f32 * 600.0).collect::<Vec<_>>());
}

#[test]
fn float_types_and_unaligned_data() {
    // Alignment 1 leaves the float32 data at an odd offset: read through the copying path.
    let dir = scratch("floats");
    let f32s = [1.5_f32, -2.25, 3.0e-5, 7.0, 0.0, -0.0];
    let f16s = [0.5_f32, -65504.0, 6.0e-8, 2.0];
    let bf16s = [1.0e30_f32, -3.0, 0.0078125, 12.5];
    let path = Builder::new()
        .alignment(1)
        .kv("x", 0, &[7])
        .tensor("a", &[3, 2], 0, f32s.iter().flat_map(|v| v.to_le_bytes()).collect())
        .tensor("b", &[4], 1, f16s.iter().flat_map(|&v| f16b(v)).collect())
        .tensor("c", &[2, 2], 30, bf16s.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect())
        .tensor("d", &[2, 1, 1, 1], 24, vec![0x80, 0x7F])
        .write(&dir, "f.gguf");
    let file = GgufFile::open(&path).unwrap();
    assert!(file.tensors().iter().any(|t| t.offset % 4 != 0), "some data should be unaligned");
    let a = file.load(file.tensor("a").unwrap()).unwrap();
    assert_eq!(a.shape(), [2, 3]);
    assert_eq!(values(&a), f32s);
    let Weight::Dense(b) = file.load(file.tensor("b").unwrap()).unwrap() else { panic!() };
    assert_eq!(b.to_vec::<f16>().unwrap(), f16s.map(f16::from_f32));
    let Weight::Dense(c) = file.load(file.tensor("c").unwrap()).unwrap() else { panic!() };
    assert_eq!((c.dtype(), c.shape()), (Dtype::Bfloat16, &[2, 2][..]));
    assert_eq!(c.to_vec::<bf16>().unwrap(), bf16s.map(bf16::from_f32));
    let d = file.load(file.tensor("d").unwrap()).unwrap();
    assert_eq!((d.shape(), values(&d)), (vec![1, 1, 1, 2], vec![-128.0, 127.0]));
}

#[test]
fn gguf_v2_and_q8_1() {
    let dir = scratch("v2");
    let mut block = f16b(0.125).to_vec();
    block.extend(f16b(99.0)); // s = d·Σq, unused for dequantisation
    block.extend((0..32).map(|k| (k as i8 - 16) as u8));
    let mut b = Builder::new().tensor("w", &[32], 9, block);
    b.version = 2;
    let file = GgufFile::open(b.write(&dir, "v2.gguf")).unwrap();
    assert_eq!(file.version(), 2);
    let w = file.load(&file.tensors()[0]).unwrap();
    assert_exact(&w, &(0..32).map(|k| (k as f32 - 16.0) * 0.125).collect::<Vec<_>>());
}

/// Row ids as a dense `[rows, cols]` float32 matrix: element (r, c) = 10r + c.
fn row_ids(rows: usize, cols: usize) -> Vec<f32> {
    (0..rows * cols).map(|i| (10 * (i / cols) + i % cols) as f32).collect()
}

#[test]
fn unpermute_llama_rows_dense() {
    // llama.cpp stores row h·hd + 2i + t for Hugging Face row h·hd + t·hd/2 + i.
    for (n_head, order) in [(2, [0, 2, 1, 3, 4, 6, 5, 7]), (1, [0, 2, 4, 6, 1, 3, 5, 7]), (4, [0, 1, 2, 3, 4, 5, 6, 7])]
    {
        let a = Array::from_slice(&row_ids(8, 3), &[8, 3]).unwrap();
        let w = unpermute_llama_rows(Weight::Dense(a), n_head).unwrap();
        assert_eq!(w.shape(), [8, 3]);
        let want: Vec<f32> = order.iter().flat_map(|&r| (0..3).map(move |c| (10 * r + c) as f32)).collect();
        assert_eq!(values(&w), want, "n_head {n_head}");
    }
    // A bias vector.
    let b = Array::from_slice(&[0.0f32, 1.0, 2.0, 3.0], &[4]).unwrap();
    assert_eq!(values(&unpermute_llama_rows(Weight::Dense(b), 1).unwrap()), [0.0, 2.0, 1.0, 3.0]);
    let a = Array::from_slice(&row_ids(6, 1), &[6, 1]).unwrap();
    assert!(matches!(unpermute_llama_rows(Weight::Dense(a), 2), Err(Error::Config(_))));
}

#[test]
fn unpermute_llama_rows_quantised() {
    // 8 rows × 64 columns of Q4_0, row r with scale r + 1: permuting the packed weight, scales and
    // biases must equal permuting the dequantised rows.
    let ds: Vec<f32> = (0..16).map(|blk| (blk / 2 + 1) as f32 * if blk % 2 == 0 { 1.0 } else { -0.5 }).collect();
    let nib = |blk: usize, k: usize| ((k + 3 * blk) % 16) as u8;
    let dir = scratch("unpermute_q");
    let path = Builder::new().tensor("w", &[64, 8], 2, q4_blocks(&ds, None, nib)).write(&dir, "q.gguf");
    let file = GgufFile::open(&path).unwrap();
    let w = file.load(file.tensor("w").unwrap()).unwrap();
    let dense = values(&w);
    let u = unpermute_llama_rows(w, 2).unwrap();
    let Weight::Quantized(q) = &u else { panic!("should stay quantised") };
    assert_eq!((q.weight.shape(), q.scales.shape()), (&[8, 8][..], &[8, 2][..]));
    let want: Vec<f32> = [0, 2, 1, 3, 4, 6, 5, 7].iter().flat_map(|&r| dense[r * 64..r * 64 + 64].to_vec()).collect();
    assert_exact(&u, &want);
}

fn corrupt_reason(r: crate::Result<GgufFile>) -> String {
    match r {
        Err(Error::Corrupt { reason, .. }) => reason,
        other => panic!("expected Error::Corrupt, got {other:?}"),
    }
}

#[test]
fn bad_magic_and_version_are_corrupt() {
    let dir = scratch("magic");
    let mut bytes = std::fs::read(fixture("types.gguf")).unwrap();
    bytes[0] = b'X';
    std::fs::write(dir.join("m.gguf"), &bytes).unwrap();
    assert!(corrupt_reason(GgufFile::open(dir.join("m.gguf"))).contains("magic"));
    std::fs::write(dir.join("short.gguf"), b"GG").unwrap();
    corrupt_reason(GgufFile::open(dir.join("short.gguf")));
    let mut b = Builder::new();
    b.version = 1;
    assert!(corrupt_reason(GgufFile::open(b.write(&dir, "v1.gguf"))).contains("version 1"));
    // A header cut inside the metadata.
    let bytes = std::fs::read(fixture("types.gguf")).unwrap();
    std::fs::write(dir.join("h.gguf"), &bytes[..100]).unwrap();
    assert!(corrupt_reason(GgufFile::open(dir.join("h.gguf"))).contains("truncated"));
    assert!(matches!(GgufFile::open(dir.join("absent.gguf")), Err(Error::Io { .. })));
}

#[test]
fn truncated_file_names_the_tensor() {
    let full = GgufFile::open(fixture("types.gguf")).unwrap();
    let last = full.tensors().iter().max_by_key(|t| t.offset).unwrap();
    let end = last.offset as usize + last.nbytes;
    let dir = scratch("truncated");
    let bytes = std::fs::read(fixture("types.gguf")).unwrap();
    std::fs::write(dir.join("t.gguf"), &bytes[..end - 1]).unwrap();
    let reason = corrupt_reason(GgufFile::open(dir.join("t.gguf")));
    assert!(reason.contains(&format!("`{}`", last.name)), "{reason}");
    assert!(reason.contains("past the end"), "{reason}");
    // Exactly the data is enough.
    std::fs::write(dir.join("exact.gguf"), &bytes[..end]).unwrap();
    GgufFile::open(dir.join("exact.gguf")).unwrap();
}

#[test]
fn malformed_directory_entries() {
    let dir = scratch("malformed");
    // Row of 48 elements is not a whole number of Q4_0 blocks.
    let p = Builder::new().tensor("w", &[48, 1], 2, vec![0; 36]).write(&dir, "rows.gguf");
    assert!(corrupt_reason(GgufFile::open(p)).contains("`w`"));
    let p = Builder::new().tensor("scalar", &[], 8, vec![0; 34]).write(&dir, "scalar.gguf");
    assert!(corrupt_reason(GgufFile::open(p)).contains("`scalar`"));
    let p = Builder::new().tensor("one", &[], 0, 2.5f32.to_le_bytes().to_vec()).write(&dir, "one.gguf");
    let file = GgufFile::open(p).unwrap();
    let one = file.load(&file.tensors()[0]).unwrap();
    assert_eq!((one.shape(), values(&one)), (vec![], vec![2.5]));
    let p = Builder::new().alignment(24).write(&dir, "align.gguf");
    assert!(matches!(GgufFile::open(p), Err(Error::Config(m)) if m.contains("alignment")));
    let p = Builder::new().tensor("w", &[1], 0, vec![0; 4]).tensor("w", &[1], 0, vec![0; 4]).write(&dir, "dup.gguf");
    assert!(corrupt_reason(GgufFile::open(p)).contains("duplicate"));
}

#[test]
fn unsupported_types_are_config_errors() {
    let dir = scratch("unknown");
    let path = Builder::new()
        .tensor("mystery", &[4, 2], 99, vec![])
        .tensor("iq2", &[256], 16, vec![0; 66])
        .tensor("ok", &[2], 0, vec![0; 8])
        .write(&dir, "u.gguf");
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.tensor("mystery").unwrap().ggml_type, GgmlType::Other(99));
    assert_eq!(file.tensor("iq2").unwrap().ggml_type, GgmlType::Other(16));
    match file.load(file.tensor("mystery").unwrap()) {
        Err(Error::Config(m)) => assert!(m.contains("`mystery`") && m.contains("99"), "{m}"),
        other => panic!("expected Config, got {other:?}"),
    }
    match file.load(file.tensor("iq2").unwrap()) {
        Err(Error::Config(m)) => assert!(m.contains("`iq2`") && m.contains("IQ2_XXS"), "{m}"),
        other => panic!("expected Config, got {other:?}"),
    }
    assert_eq!(values(&file.load(file.tensor("ok").unwrap()).unwrap()), [0.0, 0.0]);
}

/// Overwrites the data offset of tensor `name` (with `n_dims` dimensions) in a GGUF image.
fn patch_offset(bytes: &mut [u8], name: &str, n_dims: usize, rel: u64) {
    let mut key = (name.len() as u64).to_le_bytes().to_vec();
    key.extend(name.as_bytes());
    let at = bytes.windows(key.len()).position(|w| w == key).expect("tensor entry") + key.len() + 4 + 8 * n_dims + 4;
    bytes[at..at + 8].copy_from_slice(&rel.to_le_bytes());
}

fn open_bytes(dir: &std::path::Path, name: &str, bytes: &[u8]) -> crate::Result<GgufFile> {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    GgufFile::open(p)
}

#[test]
fn absurd_counts_are_bounded_by_the_file() {
    let dir = scratch("counts");
    // A tensor count of 2^64 − 1 in a 24-byte header.
    let mut bytes = Builder::new().bytes();
    bytes[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    let reason = corrupt_reason(open_bytes(&dir, "t.gguf", &bytes));
    assert!(reason.contains("tensor count of 18446744073709551615") && reason.contains("cannot fit"), "{reason}");
    // A metadata count of 2^40.
    let mut bytes = Builder::new().bytes();
    bytes[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let reason = corrupt_reason(open_bytes(&dir, "kv.gguf", &bytes));
    assert!(reason.contains("metadata count of 1099511627776"), "{reason}");
    // A u64 array claiming 2^30 elements (8 GiB) in a file of a few dozen bytes.
    let mut array = 10u32.to_le_bytes().to_vec();
    array.extend((1u64 << 30).to_le_bytes());
    array.extend([0; 16]);
    let bytes = Builder::new().kv("big", 9, &array).bytes();
    let reason = corrupt_reason(open_bytes(&dir, "arr.gguf", &bytes));
    assert!(reason.contains("`big`") && reason.contains("1073741824 elements"), "{reason}");
    // An array of an unknown element type.
    let mut array = 13u32.to_le_bytes().to_vec();
    array.extend(1u64.to_le_bytes());
    let bytes = Builder::new().kv("odd", 9, &array).bytes();
    let reason = corrupt_reason(open_bytes(&dir, "ety.gguf", &bytes));
    assert!(reason.contains("`odd`") && reason.contains("element type 13"), "{reason}");
}

#[test]
fn dimensions_beyond_i32_are_corrupt() {
    let dir = scratch("dims");
    let p = Builder::new().tensor("wide", &[1 << 31, 1], 0, vec![]).write(&dir, "wide.gguf");
    let reason = corrupt_reason(GgufFile::open(p));
    assert!(reason.contains("`wide`") && reason.contains("2147483648") && reason.contains("exceeds"), "{reason}");
    // Dimensions whose product overflows 64 bits.
    let p = Builder::new().tensor("huge", &[1 << 30, 1 << 30, 1 << 30], 0, vec![]).write(&dir, "h.gguf");
    let reason = corrupt_reason(GgufFile::open(p));
    assert!(reason.contains("`huge`") && reason.contains("overflow"), "{reason}");
}

#[test]
fn overlapping_tensors_are_corrupt() {
    let dir = scratch("overlap");
    let f = |v: f32| v.to_le_bytes().repeat(8);
    let mut bytes = Builder::new().tensor("a", &[8], 0, f(1.0)).tensor("b", &[8], 0, f(2.0)).bytes();
    patch_offset(&mut bytes, "b", 1, 0);
    bytes.truncate(bytes.len() - 32);
    let reason = corrupt_reason(open_bytes(&dir, "o.gguf", &bytes));
    assert!(reason.contains("`b`") && reason.contains("overlaps tensor `a`"), "{reason}");
}

#[test]
fn misaligned_offset_is_corrupt() {
    let dir = scratch("misaligned");
    let mut bytes = Builder::new().tensor("a", &[8], 0, vec![0; 32]).bytes();
    patch_offset(&mut bytes, "a", 1, 4);
    let reason = corrupt_reason(open_bytes(&dir, "m.gguf", &bytes));
    assert!(reason.contains("`a`") && reason.contains("offset 4 is not a multiple of the alignment 32"), "{reason}");
}

#[test]
fn data_sizes_that_disagree_with_the_type_are_corrupt() {
    let dir = scratch("mistyped");
    // Float32 data for 16 elements declared float16: the next tensor's offset gives it away.
    let f32s: Vec<u8> = (0..16).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let p = Builder::new().tensor("a", &[16], 1, f32s.clone()).tensor("b", &[8], 0, vec![0; 32]).write(&dir, "2.gguf");
    let reason = corrupt_reason(GgufFile::open(p));
    assert!(reason.contains("`b`") && reason.contains("offset 64, expected 32"), "{reason}");
    // As the last tensor: the bytes left over give it away.
    let p = Builder::new().tensor("a", &[16], 1, f32s).write(&dir, "1.gguf");
    let reason = corrupt_reason(GgufFile::open(p));
    assert!(reason.contains("`a`") && reason.contains("32 bytes after") && reason.contains("F16"), "{reason}");
}

/// The logits of `path`'s model for `fixture`'s prompt against its transformers reference.
fn check_gguf_against(path: &std::path::Path, fixture: &str, model_type: &str) {
    let opts = crate::LoadOptions { dtype: Some(rmlx::Dtype::Float32), ..crate::LoadOptions::default() };
    let lm = crate::loader::load(path, &opts).unwrap();
    assert_eq!(lm.model.config().model_type, model_type);
    let r = super::common::reference(fixture);
    let prompt: Vec<i32> = super::common::ids(&r["prompt_ids"]).iter().map(|&t| t as i32).collect();
    let want = super::common::floats(&r["logits"]);
    let ids = rmlx::Array::from_slice(&prompt, &[1, prompt.len() as i32]).unwrap();
    let mut caches = lm.model.new_caches(None);
    let got =
        lm.model.forward(&ids, &mut caches).unwrap().astype(rmlx::Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
    let on_gpu = rmlx::default_device().kind == rmlx::DeviceType::Gpu;
    let tol = r["tolerance"][if on_gpu { "float32_tf32" } else { "float32" }].as_f64().unwrap() as f32;
    let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert_eq!(got.len(), want.len());
    assert!(d <= tol, "{fixture}: max |Δlogit| {d} > {tol}");
}

/// Mixtral as llama.cpp writes it (a `llama` GGUF with `llama.expert_*` metadata, stacked
/// `ffn_*_exps`, the router `ffn_gate_inp`, query and key rows permuted) loads as Mixtral and gives
/// the `mixtral` fixture's transformers logits.
#[test]
fn mixtral_as_a_llama_gguf_with_experts_matches_transformers() {
    let dir = scratch("mixtral_gguf");
    let path = dir.join("model.gguf");
    super::gguf_model::gguf_mixtral(&path);
    check_gguf_against(&path, "mixtral", "mixtral");
}

/// A `phi3` GGUF (the `phi3` fixture as llama.cpp writes it: fused `attn_qkv` and `ffn_up`, half
/// the head rotated, a window of 8 below the 24-token prompt, LongRoPE's factors as tensors and
/// its attention factor as metadata) loads as Phi-3 and gives the fixture's transformers logits.
#[test]
fn phi3_gguf_matches_transformers() {
    let dir = scratch("phi3_gguf");
    let path = dir.join("model.gguf");
    super::gguf_model::gguf_phi3(&path, true);
    check_gguf_against(&path, "phi3", "phi3");
    // An older converter's file without `rope.scaling.attn_factor`: the factor follows from the
    // contexts (√(1 + ln 4 / ln 256), the same).
    super::gguf_model::gguf_phi3(&path, false);
    check_gguf_against(&path, "phi3", "phi3");
}

/// A `gemma2` GGUF (the `gemma2` fixture as llama.cpp writes it: Gemma's norm names, norms stored
/// as `1 + w`, soft-caps and window as metadata) gives the logits of the fixture's Hugging Face
/// folder read with the query scale llama.cpp takes (the key length, 16: a GGUF has no place for
/// the fixture's `query_pre_attn_scalar` of 24; that folder itself matches transformers in
/// `tests/models.rs`), and differs from the folder as it is.
#[test]
fn gemma2_gguf_matches_its_folder_at_llama_cpps_query_scale() {
    let dir = scratch("gemma2_gguf");
    let path = dir.join("model.gguf");
    super::gguf_model::gguf_gemma2(&path);
    let opts = crate::LoadOptions { dtype: Some(rmlx::Dtype::Float32), ..crate::LoadOptions::default() };
    let gguf = crate::loader::load(&path, &opts).unwrap();
    let cfg = gguf.model.config();
    assert_eq!(cfg.model_type, "gemma2");
    assert_eq!(
        (cfg.query_pre_attn_scalar, cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.sliding_window),
        (Some(16.0), Some(5.0), Some(10.0), Some(8))
    );
    let folder = super::common::fixture_with_tokenizer("gemma2");
    let folder = folder.path();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(folder.join("config.json")).unwrap()).unwrap();
    let prompt: Vec<i32> =
        super::common::ids(&super::common::reference("gemma2")["prompt_ids"]).iter().map(|&t| t as i32).collect();
    let logits = |lm: &crate::LoadedModel| {
        let ids = rmlx::Array::from_slice(&prompt, &[1, prompt.len() as i32]).unwrap();
        let mut caches = lm.model.new_caches(None);
        lm.model.forward(&ids, &mut caches).unwrap().astype(rmlx::Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
    };
    let max_diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
    let got = logits(&gguf);
    for (scalar, same) in [(16, true), (24, false)] {
        config["query_pre_attn_scalar"] = serde_json::json!(scalar);
        std::fs::write(folder.join("config.json"), config.to_string()).unwrap();
        let want = logits(&crate::loader::load(folder, &opts).unwrap());
        let d = max_diff(&got, &want);
        match same {
            true => assert!(d <= 1e-4, "against the folder at scale {scalar}: max |Δlogit| {d}"),
            false => assert!(d > 1e-2, "the query scale changes nothing ({d})"),
        }
    }
}

/// A `gpt-oss` GGUF (the `gpt_oss` fixture as llama.cpp's converter writes transformers' float
/// layout: split and transposed experts with their biases, `attn_sinks.weight`, the router as
/// `ffn_gate_inp`, YaRN and the window as metadata) loads as gpt-oss and gives the fixture's
/// transformers logits.
#[test]
fn gpt_oss_gguf_matches_transformers() {
    let dir = scratch("gpt_oss_gguf");
    let path = dir.join("model.gguf");
    super::gguf_model::gguf_gpt_oss(&path);
    check_gguf_against(&path, "gpt_oss", "gpt_oss");
}

/// A `qwen3moe` GGUF (the `qwen3_moe` fixture as llama.cpp names it: stacked `ffn_*_exps`, the
/// router `ffn_gate_inp`, `qwen3moe.expert_*` metadata) loads as Qwen 3 MoE and gives the
/// fixture's transformers logits; the dense layer routes nothing because the file holds no router
/// for it.
#[test]
fn qwen3moe_gguf_matches_transformers() {
    let dir = scratch("qwen3moe");
    let path = dir.join("model.gguf");
    super::gguf_model::gguf_qwen3_moe(&path);
    check_gguf_against(&path, "qwen3_moe", "qwen3_moe");
}
