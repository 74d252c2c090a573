//! `rmlx bench --json` on the default model: the peer benchmark's keys, and the bandwidth floor
//! beside the decode speed with the bytes a token reads counted as `rmlx_lm::roofline` counts them.

use serde_json::Value;
use std::process::{Command, Stdio};

#[test]
fn bench_reports_speed_beside_the_bandwidth_floor() {
    let out = Command::new(env!("CARGO_BIN_EXE_rmlx"))
        .args(["bench", "-p", "16", "-g", "4", "-n", "1", "--json"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["peer"], "rmlx");
    assert_eq!((v["prompt_tokens"].as_u64(), v["gen_tokens"].as_u64()), (Some(16), Some(4)));
    // SmolLM2-135M, dequantised to float32: 30 layers of 3 key/value heads of 64, 1,536 bytes a
    // position and layer; decoding after 16 tokens reads 17 to 20 positions, 18.5 on average.
    assert_eq!(v["kv_bytes_per_token"].as_u64(), Some(30 * 1536 * 74 / 4));
    // 134,515,008 parameters in float32, the tied embedding read whole as the output head.
    assert_eq!(v["weight_bytes_per_token"].as_u64(), Some(134_515_008 * 4));
    let bytes = v["bytes_per_token"].as_f64().unwrap();
    let (bandwidth, floor) = (v["bandwidth_gb_s"].as_f64().unwrap(), v["floor_tok_s"].as_f64().unwrap());
    assert!((floor - bandwidth * 1e9 / bytes).abs() <= 0.1 + floor * 1e-3, "{v}");
    let fraction = v["floor_fraction"].as_f64().unwrap();
    let decode = v["decode_tok_s"].as_f64().unwrap();
    assert!(decode > 0.0 && (fraction - decode / floor).abs() < 1e-3 + fraction * 1e-2, "{v}");
}
