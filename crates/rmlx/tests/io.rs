//! Integration tests of `rmlx::io`: safetensors, GGUF and `.npy` round trips and error reporting.

use rmlx::io::{self, GgufValue};
use rmlx::{bf16, f16, ops, Array, Dtype, Error};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A unique path in the temporary directory (unique per process and per call); removed on drop.
struct TempFile(PathBuf);

impl TempFile {
    fn new(ext: &str) -> TempFile {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        TempFile(std::env::temp_dir().join(format!("rmlx-io-test-{}-{n}-{nanos}.{ext}", std::process::id())))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn sample_arrays() -> BTreeMap<String, Array> {
    let h: Vec<f16> = [0.5f32, -1.25, 65504.0, 0.0].iter().map(|&x| f16::from_f32(x)).collect();
    let b: Vec<bf16> = [1.0f32, -3.5, 1e30, 0.0078125, 2.0, -0.0].iter().map(|&x| bf16::from_f32(x)).collect();
    BTreeMap::from([
        (
            "f32".to_string(),
            Array::from_slice(&[1.5f32, -2.0, 3.25, f32::MAX, f32::MIN_POSITIVE, -0.0], &[2, 3]).unwrap(),
        ),
        ("f16".to_string(), Array::from_slice(&h, &[4]).unwrap()),
        ("bf16".to_string(), Array::from_slice(&b, &[3, 1, 2]).unwrap()),
        ("i32".to_string(), Array::from_slice(&[i32::MIN, -1, 0, 1, i32::MAX, 42], &[6]).unwrap()),
        ("u8".to_string(), Array::from_slice(&[0u8, 1, 127, 128, 255, 7, 9, 11], &[2, 2, 2]).unwrap()),
        ("bool".to_string(), Array::from_slice(&[true, false, false, true, true], &[5]).unwrap()),
        ("scalar".to_string(), Array::scalar(7.75f32)),
    ])
}

fn check_sample_arrays(back: &BTreeMap<String, Array>) {
    let orig = sample_arrays();
    assert_eq!(back.keys().collect::<Vec<_>>(), orig.keys().collect::<Vec<_>>());
    for (name, a) in &orig {
        let b = &back[name];
        assert_eq!(b.shape(), a.shape(), "shape of {name}");
        assert_eq!(b.dtype(), a.dtype(), "dtype of {name}");
    }
    assert_eq!(back["f32"].to_vec::<f32>().unwrap(), orig["f32"].to_vec::<f32>().unwrap());
    assert_eq!(back["f32"].to_vec::<f32>().unwrap()[5].to_bits(), (-0.0f32).to_bits());
    assert_eq!(back["f16"].to_vec::<f16>().unwrap(), orig["f16"].to_vec::<f16>().unwrap());
    assert_eq!(back["bf16"].to_vec::<bf16>().unwrap(), orig["bf16"].to_vec::<bf16>().unwrap());
    assert_eq!(back["i32"].to_vec::<i32>().unwrap(), vec![i32::MIN, -1, 0, 1, i32::MAX, 42]);
    assert_eq!(back["u8"].to_vec::<u8>().unwrap(), vec![0, 1, 127, 128, 255, 7, 9, 11]);
    assert_eq!(back["bool"].to_vec::<bool>().unwrap(), vec![true, false, false, true, true]);
    assert_eq!(back["scalar"].ndim(), 0);
    assert_eq!(back["scalar"].item::<f32>().unwrap(), 7.75);
}

#[test]
fn safetensors_round_trip_with_metadata() {
    let path = TempFile::new("safetensors");
    let arrays = sample_arrays();
    let meta = BTreeMap::from([
        ("format".to_string(), "mlx".to_string()),
        ("note".to_string(), "héllo, \"quoted\" {json} ✓".to_string()),
        ("empty".to_string(), String::new()),
    ]);
    io::save_safetensors(&path.0, &arrays, &meta).unwrap();
    let back = io::load_safetensors(&path.0).unwrap();
    check_sample_arrays(&back.arrays);
    assert_eq!(back.metadata, meta);
}

#[test]
fn safetensors_loading_is_lazy() {
    let path = TempFile::new("safetensors");
    let arrays = BTreeMap::from([
        ("a".to_string(), Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]).unwrap()),
        ("b".to_string(), Array::from_slice(&[4i32, 5], &[2]).unwrap()),
    ]);
    io::save_safetensors(&path.0, &arrays, &BTreeMap::new()).unwrap();
    let back = io::load_safetensors(&path.0).unwrap();
    assert!(back.metadata.is_empty());
    // Shapes and dtypes come from the header; the data is not read yet.
    assert_eq!(back.arrays["a"].shape(), &[3]);
    assert_eq!(back.arrays["b"].dtype(), Dtype::Int32);
    assert!(!back.arrays["a"].is_evaluated());
    assert!(!back.arrays["b"].is_evaluated());
    back.arrays["a"].eval().unwrap();
    assert!(back.arrays["a"].is_evaluated());
    assert!(!back.arrays["b"].is_evaluated());
    assert_eq!(back.arrays["a"].to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
    assert_eq!(back.arrays["b"].to_vec::<i32>().unwrap(), vec![4, 5]);
}

#[test]
fn truncated_safetensors_is_an_error() {
    let path = TempFile::new("safetensors");
    let data: Vec<f32> = (0..1024).map(|i| i as f32).collect();
    let arrays = BTreeMap::from([("weight".to_string(), Array::from_slice(&data, &[32, 32]).unwrap())]);
    io::save_safetensors(&path.0, &arrays, &BTreeMap::new()).unwrap();
    let len = std::fs::metadata(&path.0).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&path.0).unwrap();
    f.set_len(len - 100).unwrap();
    drop(f);

    // The error may be found when the header is checked or when the data is read; either way it
    // must be an `Error::Mlx` and not a crash or silently wrong data.
    let result = io::load_safetensors(&path.0).and_then(|st| {
        let w = &st.arrays["weight"];
        w.eval()?;
        w.to_vec::<f32>()
    });
    match result {
        Err(Error::Mlx(msg)) => assert!(
            msg.contains("weight") || msg.contains("exceeding the size of the file"),
            "unexpected message: {msg}"
        ),
        other => panic!("expected Err(Error::Mlx(..)), got {other:?}"),
    }
}

#[test]
fn garbage_safetensors_is_an_error() {
    let path = TempFile::new("safetensors");
    std::fs::write(&path.0, b"this is definitely not a safetensors file, just some text bytes").unwrap();
    let result = io::load_safetensors(&path.0).and_then(|st| {
        for a in st.arrays.values() {
            a.eval()?;
        }
        Ok(st.arrays.len())
    });
    assert!(matches!(result, Err(Error::Mlx(_))), "got {result:?}");

    // An empty file too.
    let empty = TempFile::new("safetensors");
    std::fs::write(&empty.0, b"").unwrap();
    assert!(io::load_safetensors(&empty.0).is_err());
}

#[test]
fn missing_files_are_io_errors() {
    let path = TempFile::new("safetensors");
    assert!(!path.0.exists());
    match io::load_safetensors(&path.0) {
        Err(Error::Io { path: p, error: source }) => {
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
            assert!(p.contains("rmlx-io-test-"), "path in error: {p}");
        }
        other => panic!("expected Error::Io, got {other:?}"),
    }
    assert!(matches!(io::load_gguf(&path.0), Err(Error::Io { .. })));
    assert!(matches!(io::load_npy(&path.0), Err(Error::Io { .. })));
    // The reason is in the message once: it is not also the error's source, which a report
    // that prints the whole chain (anyhow's `{:#}`) would print a second time.
    let e = io::load_safetensors(&path.0).unwrap_err();
    assert!(std::error::Error::source(&e).is_none());
    assert_eq!(e.to_string().matches("(os error 2)").count(), 1, "{e}");
}

#[test]
fn gguf_round_trip_with_metadata() {
    let path = TempFile::new("gguf");
    let w: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 2.0).collect();
    let h: Vec<f16> = [1.0f32, -0.5, 0.25, 1024.0].iter().map(|&x| f16::from_f32(x)).collect();
    let arrays = BTreeMap::from([
        ("blk.0.weight".to_string(), Array::from_slice(&w, &[3, 4]).unwrap()),
        ("blk.0.bias".to_string(), Array::from_slice(&h, &[4]).unwrap()),
    ]);
    let meta = BTreeMap::from([
        ("general.name".to_string(), GgufValue::String("tiny-model".to_string())),
        ("tokenizer.tokens".to_string(), GgufValue::Strings(vec!["<s>".into(), "hello".into(), "wörld".into()])),
        ("model.context_length".to_string(), GgufValue::Array(Array::scalar(4096i32))),
        ("model.layers".to_string(), GgufValue::Array(Array::from_slice(&[1i32, 2, 3, 5, 8], &[5]).unwrap())),
    ]);
    io::save_gguf(&path.0, &arrays, &meta).unwrap();
    let back = io::load_gguf(&path.0).unwrap();

    assert_eq!(back.arrays.keys().collect::<Vec<_>>(), vec!["blk.0.bias", "blk.0.weight"]);
    let bw = &back.arrays["blk.0.weight"];
    assert_eq!(bw.shape(), &[3, 4]);
    assert_eq!(bw.dtype(), Dtype::Float32);
    assert_eq!(bw.to_vec::<f32>().unwrap(), w);
    let bb = &back.arrays["blk.0.bias"];
    assert_eq!(bb.shape(), &[4]);
    assert_eq!(bb.dtype(), Dtype::Float16);
    assert_eq!(bb.to_vec::<f16>().unwrap(), h);

    match &back.metadata["general.name"] {
        GgufValue::String(s) => assert_eq!(s, "tiny-model"),
        other => panic!("general.name came back as {other:?}"),
    }
    match &back.metadata["tokenizer.tokens"] {
        GgufValue::Strings(v) => assert_eq!(v, &["<s>", "hello", "wörld"]),
        other => panic!("tokenizer.tokens came back as {other:?}"),
    }
    match &back.metadata["model.context_length"] {
        GgufValue::Array(a) => {
            assert_eq!(a.ndim(), 0);
            assert_eq!(a.dtype(), Dtype::Int32);
            assert_eq!(a.item::<i32>().unwrap(), 4096);
        }
        other => panic!("model.context_length came back as {other:?}"),
    }
    match &back.metadata["model.layers"] {
        GgufValue::Array(a) => {
            assert_eq!(a.shape(), &[5]);
            assert_eq!(a.dtype(), Dtype::Int32);
            assert_eq!(a.to_vec::<i32>().unwrap(), vec![1, 2, 3, 5, 8]);
        }
        other => panic!("model.layers came back as {other:?}"),
    }
    // Nothing but what was written (MLX adds no keys of its own).
    for key in meta.keys() {
        assert!(back.metadata.contains_key(key), "missing {key}");
    }
}

#[test]
fn npy_round_trip() {
    let path = TempFile::new("npy");
    let a = Array::from_slice(&[1i32, -2, 3, -4, 5, -6], &[2, 3]).unwrap();
    io::save_npy(&path.0, &a).unwrap();
    let back = io::load_npy(&path.0).unwrap();
    assert_eq!(back.shape(), &[2, 3]);
    assert_eq!(back.dtype(), Dtype::Int32);
    assert_eq!(back.to_vec::<i32>().unwrap(), vec![1, -2, 3, -4, 5, -6]);

    // A transposed (non-contiguous) view is written in logical order.
    let t_path = TempFile::new("npy");
    let x = ops::arange(0.0, 12.0, 1.0, Dtype::Float32).unwrap().reshape(&[3, 4]).unwrap();
    let xt = x.transpose().unwrap();
    io::save_npy(&t_path.0, &xt).unwrap();
    let back_t = io::load_npy(&t_path.0).unwrap();
    assert_eq!(back_t.shape(), &[4, 3]);
    assert_eq!(back_t.dtype(), Dtype::Float32);
    assert_eq!(back_t.to_vec::<f32>().unwrap(), vec![0.0, 4.0, 8.0, 1.0, 5.0, 9.0, 2.0, 6.0, 10.0, 3.0, 7.0, 11.0]);

    // Other dtypes and a scalar.
    let s_path = TempFile::new("npy");
    io::save_npy(&s_path.0, &Array::scalar(2.5f32)).unwrap();
    let s = io::load_npy(&s_path.0).unwrap();
    assert_eq!(s.ndim(), 0);
    assert_eq!(s.item::<f32>().unwrap(), 2.5);

    let h_path = TempFile::new("npy");
    let h: Vec<f16> = [0.5f32, 1.5, -2.0].iter().map(|&v| f16::from_f32(v)).collect();
    io::save_npy(&h_path.0, &Array::from_slice(&h, &[3]).unwrap()).unwrap();
    let hb = io::load_npy(&h_path.0).unwrap();
    assert_eq!(hb.dtype(), Dtype::Float16);
    assert_eq!(hb.to_vec::<f16>().unwrap(), h);
}
