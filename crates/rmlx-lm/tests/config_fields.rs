//! Config fields that change the model: which layers slide, per family as transformers decides it,
//! and fields a family does not implement refused by name instead of dropped.

use rmlx_lm::Error;
use rmlx_lm::ModelConfig;
use serde_json::{json, Value};

fn config(model_type: &str, extra: Value) -> rmlx_lm::Result<ModelConfig> {
    let mut c = json!({
        "model_type": model_type, "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256
    });
    for (k, v) in extra.as_object().unwrap() {
        c[k] = v.clone();
    }
    ModelConfig::from_value(c)
}

fn windows(c: &ModelConfig) -> Vec<Option<usize>> {
    (0..c.num_hidden_layers).map(|i| c.layer_window(i)).collect()
}

#[test]
fn which_layers_slide() {
    // Mistral: transformers' default window (4096) when the key is absent; null means none.
    assert_eq!(windows(&config("mistral", json!({})).unwrap()), vec![Some(4096); 4]);
    assert_eq!(windows(&config("mistral", json!({"sliding_window": null})).unwrap()), vec![None; 4]);
    assert_eq!(windows(&config("mistral", json!({"sliding_window": 8})).unwrap()), vec![Some(8); 4]);
    // Gemma 2: every other layer from the first (transformers' default), else as layer_types says;
    // transformers' window of 4096 when the key is absent.
    assert_eq!(windows(&config("gemma2", json!({"sliding_window": 8})).unwrap()), [Some(8), None, Some(8), None]);
    assert_eq!(windows(&config("gemma2", json!({})).unwrap()), [Some(4096), None, Some(4096), None]);
    // Qwen 2/3: only with use_sliding_window, from max_window_layers (default 28) on.
    let qwen = |extra| windows(&config("qwen2", extra).unwrap());
    assert_eq!(qwen(json!({"sliding_window": 8})), vec![None; 4]);
    assert_eq!(qwen(json!({"sliding_window": 8, "use_sliding_window": true})), vec![None; 4]);
    assert_eq!(
        qwen(json!({"sliding_window": 8, "use_sliding_window": true, "max_window_layers": 2})),
        vec![None, None, Some(8), Some(8)]
    );
    let types = json!(["sliding_attention", "full_attention", "sliding_attention", "full_attention"]);
    assert_eq!(
        windows(
            &config("qwen3", json!({"sliding_window": 8, "use_sliding_window": true, "layer_types": types})).unwrap()
        ),
        vec![Some(8), None, Some(8), None]
    );
    // Llama: the layers `layer_types` names (mlx-lm's llama); a bare window is ignored, as by
    // transformers and mlx-lm.
    assert_eq!(
        windows(&config("llama", json!({"sliding_window": 8, "layer_types": types})).unwrap()),
        vec![Some(8), None, Some(8), None]
    );
    assert_eq!(windows(&config("llama", json!({"sliding_window": 8})).unwrap()), vec![None; 4]);
}

#[test]
fn fields_a_family_does_not_implement_are_refused_by_name() {
    let refused = [
        ("llama", json!({"mlp_bias": true}), "mlp_bias"),
        ("qwen2", json!({"partial_rotary_factor": 0.5}), "partial_rotary_factor"),
        ("mistral", json!({"hidden_act": "gelu"}), "hidden_act"),
        ("llama", json!({"final_logit_softcapping": 30.0}), "final_logit_softcapping"),
        ("gemma3_text", json!({"attn_logit_softcapping": 50.0, "sliding_window_pattern": 6}), "attn_logit_softcapping"),
        ("gemma3_text", json!({"hidden_activation": "silu", "sliding_window_pattern": 6}), "hidden_activation"),
        ("gemma3_text", json!({"use_bidirectional_attention": true}), "use_bidirectional_attention"),
    ];
    for (model_type, extra, field) in refused {
        match config(model_type, extra.clone()) {
            Err(Error::Config(m)) => assert!(m.contains(field) && m.contains(model_type), "{m}"),
            other => panic!("{model_type} {extra}: {:?}", other.map(|c| c.model_type)),
        }
    }
    // Neutral values, and the ones a family implements, load.
    let accepted = [
        ("llama", json!({"mlp_bias": false, "partial_rotary_factor": 1.0, "hidden_act": "silu"})),
        ("qwen3", json!({"attn_logit_softcapping": null, "final_logit_softcapping": null})),
        ("gemma3_text", json!({"hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": 30.0})),
        ("gemma2", json!({"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})),
    ];
    for (model_type, extra) in accepted {
        config(model_type, extra.clone()).unwrap_or_else(|e| panic!("{model_type} {extra}: {e}"));
    }
}

/// Phi-3: a window on every layer where the config sets one, half (or any even part) of each head
/// rotated, and LongRoPE's lists checked against the rotated pairs, with transformers' attention
/// factor.
#[test]
fn phi3_windows_partial_rotation_and_longrope() {
    let phi3 = |extra| config("phi3", extra);
    assert_eq!(windows(&phi3(json!({"sliding_window": 2047})).unwrap()), vec![Some(2047); 4]);
    assert_eq!(windows(&phi3(json!({})).unwrap()), vec![None; 4]);
    // head_dim 16: a factor of 0.75 turns 12 features, 0.3 would turn 4.8 -> 4, 0.1 only 1.
    assert_eq!(phi3(json!({"partial_rotary_factor": 0.75})).unwrap().rotary_dims(), 12);
    assert_eq!(phi3(json!({"partial_rotary_factor": 0.3})).unwrap().rotary_dims(), 4);
    for bad in [json!(0.1), json!(1.5)] {
        match phi3(json!({ "partial_rotary_factor": bad })) {
            Err(Error::Config(m)) => assert!(m.contains("partial_rotary_factor"), "{m}"),
            other => panic!("{bad}: {:?}", other.map(|c| c.rotary_dims())),
        }
    }
    let longrope = |long: Value| {
        json!({"partial_rotary_factor": 0.5, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
               "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.0, 1.0, 1.0], "long_factor": long}})
    };
    let cfg = phi3(longrope(json!([1.0, 2.0, 3.0, 4.0]))).unwrap();
    match cfg.rope_scaling().unwrap() {
        Some(rmlx_lm::RopeScaling::LongRope { long_factor, attention_factor }) => {
            assert_eq!(long_factor, [1.0, 2.0, 3.0, 4.0]);
            // √(1 + ln 32 / ln 4096) = √(1 + 5/12)
            assert!((attention_factor - (17.0f32 / 12.0).sqrt()).abs() < 1e-6, "{attention_factor}");
        }
        other => panic!("{other:?}"),
    }
    for (long, why) in [(json!([1.0, 2.0, 3.0]), "4 positive numbers"), (json!([1.0, 2.0, 0.0, 4.0]), "positive")] {
        match phi3(longrope(long.clone())) {
            Err(Error::Config(m)) => assert!(m.contains("long_factor") && m.contains(why), "{m}"),
            other => panic!("{long}: {:?}", other.map(|c| c.rotary_dims())),
        }
    }
}
