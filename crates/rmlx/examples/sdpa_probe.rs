//! Runs one scaled-dot-product-attention call: `sdpa_probe B HQ HKV L S D none|causal|array|bool DTYPE`.
//! Prints the max |difference| from the composed reference; used to map backend support.
use rmlx::fast::{scaled_dot_product_attention, AttentionMask};
use rmlx::{ops, random, Array, Dtype};
fn main() -> rmlx::Result<()> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let n = |i: usize| a[i].parse::<i32>().unwrap();
    let (b, hq, hkv, l, s, d) = (n(0), n(1), n(2), n(3), n(4), n(5));
    let dtype: Dtype = a[7].parse()?;
    let k0 = random::key(0)?;
    let q = random::normal(&[b, hq, l, d], dtype, 0.0, 1.0, Some(&k0))?;
    let k = random::normal(&[b, hkv, s, d], dtype, 0.0, 1.0, Some(&random::key(1)?))?;
    let v = random::normal(&[b, hkv, s, d], dtype, 0.0, 1.0, Some(&random::key(2)?))?;
    let scale = 1.0 / (d as f32).sqrt();
    let causal = ops::tri(l, s, s - l, Dtype::Bool)?;
    let additive = ops::r#where(&causal, &Array::scalar_as(0.0, dtype)?, &Array::scalar_as(-1e9, dtype)?)?;
    let mask = match a[6].as_str() {
        "causal" => AttentionMask::Causal,
        "array" => AttentionMask::Array(&additive),
        "bool" => AttentionMask::Array(&causal),
        _ => AttentionMask::None,
    };
    let y = scaled_dot_product_attention(&q, &k, &v, scale, mask)?;
    // Reference: repeat KV heads, softmax(q kᵀ s + m) v in float32.
    let rep = hq / hkv;
    let kr = ops::repeat(&k, rep, Some(1))?.astype(Dtype::Float32)?;
    let vr = ops::repeat(&v, rep, Some(1))?.astype(Dtype::Float32)?;
    let mut scores = (q.astype(Dtype::Float32)?.matmul(&kr.swapaxes(-1, -2)?)? * scale)?;
    if a[6] != "none" {
        scores = ops::r#where(&causal, &scores, &Array::scalar(-1e9f32))?;
    }
    let want = ops::softmax(&scores, -1, true)?.matmul(&vr)?;
    let err = (&y.astype(Dtype::Float32)? - &want)?.abs()?.max(rmlx::Axes::All, false)?.item::<f32>()?;
    println!("{} ok err={err:.2e}", a.join(" "));
    Ok(())
}
