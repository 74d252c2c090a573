use rmlx::Dtype;
use rmlx_lm::{config::ModelConfig, models, nn::Builder, weights::{Weight, Weights}};
fn main() {
    let name = std::env::args().nth(1).unwrap();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(&name);
    let cfg = ModelConfig::from_json(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let mut w = Weights::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            for (n, a) in rmlx::io::load_safetensors(&p).unwrap().arrays { w.insert(n, Weight::Dense(a)); }
        }
    }
    let mut b = Builder::new(w, Dtype::Float32, false);
    let m = models::build(&cfg, &mut b).unwrap();
    let r: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let ids: Vec<i32> = r["prompt_ids"].as_array().unwrap().iter().map(|x| x.as_i64().unwrap() as i32).collect();
    let exp: Vec<f32> = r["logits"].as_array().unwrap().iter().flat_map(|row| row.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32)).collect();
    let mut c = m.new_caches(None);
    let l = m.forward(&rmlx::Array::from_slice(&ids, &[1, ids.len() as i32]).unwrap(), &mut c).unwrap().to_vec::<f32>().unwrap();
    let d = l.iter().zip(&exp).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let mut c = m.new_caches(None);
    let mut step = Vec::new();
    for &t in &ids { step.extend(m.forward(&rmlx::Array::from_slice(&[t], &[1, 1]).unwrap(), &mut c).unwrap().to_vec::<f32>().unwrap()); }
    let d2 = step.iter().zip(&exp).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    println!("{name}: prefill max diff {d}, stepwise {d2}, tol {}", r["tolerance"]);
}
