//! `rmlx bench --json` on the default model: the peer benchmark's keys, the bandwidth floor
//! beside the decode speed with the bytes a token reads counted as `rmlx_lm::roofline` counts them,
//! and the profile of a decoding step (`--profile`).

use serde_json::Value;
use std::process::{Command, Stdio};

#[test]
fn bench_reports_speed_beside_the_bandwidth_floor() {
    let out = Command::new(env!("CARGO_BIN_EXE_rmlx"))
        .args(["bench", "-p", "16", "-g", "4", "-n", "1", "--json", "--profile", "2"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["peer"], "rmlx");
    assert_eq!((v["prompt_tokens"].as_u64(), v["gen_tokens"].as_u64()), (Some(16), Some(4)));
    // SmolLM2-135M in float32: 30 layers of 3 key/value heads of 64, 1,536 bytes a position and
    // layer; decoding after 16 tokens reads 17 to 20 positions, 18.5 on average.
    assert_eq!(v["kv_bytes_per_token"].as_u64(), Some(30 * 1536 * 74 / 4));
    // 134,515,008 parameters, kept quantised on the CPU as MLX affine matrices with a float32
    // scale and bias per group of 32 values (2 bits a value more): the tied embedding (Q8_0 in
    // the file, 49,152 × 576, read whole as the output head) in 8 bits, the other matrices
    // (Q4_1) in 4; the 61 norm weights (35,136) in float32.
    let (embedding, norms) = (49_152 * 576u64, 35_136u64);
    let matrices = 134_515_008 - embedding - norms;
    assert_eq!(v["weight_bytes_per_token"].as_u64(), Some((embedding * 10 + matrices * 6) / 8 + norms * 4));
    // The model as loaded holds its quantised weights (0.115 GB) and little else; the runs add the
    // cache and the activations.
    let (loaded, peak) = (v["loaded_gb"].as_f64().unwrap(), v["peak_gb"].as_f64().unwrap());
    assert!((0.115..0.125).contains(&loaded) && loaded < peak, "{v}");
    // MLX's CUDA graph size applies to its CUDA build only.
    assert_eq!(v["cuda_graph_ops"], Value::Null, "{v}");
    let bytes = v["bytes_per_token"].as_f64().unwrap();
    let (bandwidth, floor) = (v["bandwidth_gb_s"].as_f64().unwrap(), v["floor_tok_s"].as_f64().unwrap());
    // The bandwidth is printed to 0.1 GB/s and the floor to 0.1 tok/s: within those roundings.
    assert!((floor - bandwidth * 1e9 / bytes).abs() <= 0.05e9 / bytes + 0.05 + 1e-6, "{v}");
    let fraction = v["floor_fraction"].as_f64().unwrap();
    let decode = v["decode_tok_s"].as_f64().unwrap();
    assert!(decode > 0.0 && (fraction - decode / floor).abs() < 1e-3 + fraction * 1e-2, "{v}");
    // The greedy ids of the first run: those of the layer-by-layer path before the q/k/v products
    // were stacked and the blocks took 2-D rows.
    assert_eq!(v["token_ids"], serde_json::json!([260, 905, 506, 768]), "{v}");
    // The profile of a step: its three parts, and its operations counted by kind. On the CPU the
    // quantised weights stay packed and every layer's step is the fused one (`nn::cpu_layer`): two
    // primitives, the first writing the cache in place; the embedding's row, the final norm and the
    // output head (the tied 8-bit embedding, float form: the activations stay float32) come once.
    // Nothing is composed from MLX's products, softmax, slice updates or dequantisation.
    let p = &v["profile"];
    assert_eq!(p["steps"].as_u64(), Some(2), "{p}");
    for part in ["build_us", "launch_us", "wait_us"] {
        assert!(p[part].as_f64().is_some_and(|t| t >= 0.0), "{part}: {p}");
    }
    let kinds = p["operations_by_kind"].as_object().unwrap();
    assert_eq!(kinds.values().map(|n| n.as_u64().unwrap()).sum::<u64>(), p["operations"].as_u64().unwrap());
    assert_eq!(kinds["CpuAttentionInputs"].as_u64(), Some(30), "{p}");
    assert_eq!(kinds["CpuAttentionOutputMlp"].as_u64(), Some(30), "{p}");
    assert!(!kinds.contains_key("SliceUpdate"), "the cache written in place: {p}");
    assert_eq!(kinds["CpuQuantizedRows"].as_u64(), Some(1), "{p}");
    assert!(!kinds.contains_key("LeftShift") && !kinds.contains_key("RightShift"), "{p}");
    assert_eq!(kinds["CpuRmsNorm"].as_u64(), Some(1), "{p}");
    assert_eq!(kinds["CpuAffineQmm8x32"].as_u64(), Some(1), "{p}");
    assert!(!kinds.contains_key("Matmul"), "{p}");
    assert!(!kinds.contains_key("Softmax") && !kinds.contains_key("Sin"), "nothing composed: {p}");
}

/// `--profile-drafts K`: a speculative verification pass (the last token and K drafts, taken back
/// after) timed beside the step. The fused CPU step takes up to 8 positions, so the pass is two
/// fused primitives a layer, as the step is: no slice updates, no composed attention.
#[test]
fn bench_profiles_a_verification_pass() {
    let out = Command::new(env!("CARGO_BIN_EXE_rmlx"))
        .args(["bench", "-p", "16", "-g", "4", "-n", "1", "--json", "--profile", "2", "--profile-drafts", "2"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let (step, pass) = (&v["profile"], &v["profile_verify"]);
    assert_eq!((pass["drafts"].as_u64(), pass["steps"].as_u64()), (Some(2), Some(2)), "{pass}");
    let kinds = pass["operations_by_kind"].as_object().unwrap();
    assert_eq!(kinds["CpuAttentionInputs"].as_u64(), Some(30), "30 layers: {pass}");
    assert_eq!(kinds["CpuAttentionOutputMlp"].as_u64(), Some(30), "{pass}");
    assert!(!kinds.contains_key("SliceUpdate") && !kinds.contains_key("CpuCacheAttention"), "{pass}");
    let (ops, step_ops) = (pass["operations"].as_u64().unwrap(), step["operations"].as_u64().unwrap());
    assert!((step_ops..step_ops + 10).contains(&ops), "about a step's operations: {v}");
    // Without --profile there is nothing to add the passes to.
    let out = Command::new(env!("CARGO_BIN_EXE_rmlx"))
        .args(["bench", "-p", "16", "-g", "4", "--profile-drafts", "2"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--profile"));
}

/// `--dequantize`: the float32 weights BLAS multiplies, the same greedy ids, and a step composed of
/// MLX's products and rmlx's single-purpose CPU primitives.
#[test]
fn bench_of_the_dequantised_model() {
    let out = Command::new(env!("CARGO_BIN_EXE_rmlx"))
        .args(["bench", "-p", "16", "-g", "4", "-n", "1", "--json", "--profile", "1", "--dequantize"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    // 134,515,008 parameters in float32, the tied embedding read whole as the output head.
    assert_eq!(v["weight_bytes_per_token"].as_u64(), Some(134_515_008 * 4));
    assert!(v["loaded_gb"].as_f64().is_some_and(|g| (0.538..0.56).contains(&g)), "{v}");
    assert_eq!(v["token_ids"], serde_json::json!([260, 905, 506, 768]), "{v}");
    // Every layer runs 5 products (q, k and v stacked into one, split once), 2 norms, 2 rotations,
    // one attention and one SwiGLU as rmlx's own CPU primitives (`nn::cpu_fast`), and writes its
    // keys and values into the cache; the final norm and the output head come once. The blocks work
    // on 2-D rows, so only the head's product (over `[B, L, hidden]`) is flattened.
    let kinds = v["profile"]["operations_by_kind"].as_object().unwrap();
    assert_eq!(kinds["Matmul"].as_u64(), Some(30 * 5 + 1), "{kinds:?}");
    assert_eq!(kinds["Split"].as_u64(), Some(30), "{kinds:?}");
    assert_eq!(kinds["Flatten"].as_u64(), Some(1), "{kinds:?}");
    assert_eq!(kinds["CpuRmsNorm"].as_u64(), Some(30 * 2 + 1), "{kinds:?}");
    assert_eq!(kinds["CpuRope"].as_u64(), Some(30 * 2), "{kinds:?}");
    assert_eq!(kinds["CpuCacheAttention"].as_u64(), Some(30), "{kinds:?}");
    assert_eq!(kinds["CpuSwiGlu"].as_u64(), Some(30), "{kinds:?}");
    assert_eq!(kinds["SliceUpdate"].as_u64(), Some(30 * 2), "{kinds:?}");
    assert!(!kinds.contains_key("Softmax") && !kinds.contains_key("Sigmoid"), "nothing composed: {kinds:?}");
}

/// `rmlx bench-kernels --json`: one line a shape with the bytes a product reads (packed 4-bit
/// values, a bfloat16 scale and bias per group of 64) and both rates beside the copy bandwidth; on
/// the CPU rmlx's kernel does not serve, and the rmlx rate is a quantised layer's product.
#[test]
fn bench_kernels_reports_each_shape_and_refuses_bad_ones() {
    let out = Command::new(env!("CARGO_BIN_EXE_rmlx"))
        .args(["bench-kernels", "--shapes", "64x256, 8x128", "--rows", "3", "--json"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<Value> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2);
    for (v, (o, i)) in lines.iter().zip([(64u64, 256u64), (8, 128)]) {
        assert_eq!(v["shape"], serde_json::json!([o, i]), "{v}");
        assert_eq!(
            (v["bits"].as_u64(), v["group_size"].as_u64(), v["dtype"].as_str()),
            (Some(4), Some(64), Some("bfloat16"))
        );
        assert_eq!(v["rows"].as_u64(), Some(3), "{v}");
        assert_eq!(v["weight_bytes"].as_u64(), Some(o * i / 2 + 2 * 2 * o * i / 64), "{v}");
        for key in ["copy_gbs", "rmlx_gbs", "mlx_gbs"] {
            let x = v[key].as_f64().unwrap();
            assert!(x.is_finite() && x > 0.0, "{key}: {v}");
        }
        let fraction = v["rmlx_gbs"].as_f64().unwrap() / v["copy_gbs"].as_f64().unwrap();
        assert!((v["rmlx_fraction"].as_f64().unwrap() - fraction).abs() < 1e-9, "{v}");
    }
    for (args, message) in [
        (&["bench-kernels", "--shapes", "64x100"][..], "not a multiple of the group size 64"),
        (&["bench-kernels", "--shapes", "64by256"][..], "is not OUTPUTxINPUT"),
        (&["bench-kernels", "--bits", "3"][..], "--bits must be 4 or 8"),
        (&["bench-kernels", "--dtype", "int8"][..], "--dtype: unknown dtype `int8`"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_rmlx")).args(args).stdin(Stdio::null()).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}
