//! Optimisers and schedules against MLX's formulas evaluated here in f64, step by step, and an
//! exact resume from saved state.

use rmlx::Array;
use rmlx_lm::tuner::optim::{Optimizer, OptimizerKind, Schedule};
use std::collections::HashMap;

const P0: [f64; 3] = [0.5, -1.0, 2.0];
const GRADS: [[f64; 3]; 3] = [[0.1, -0.2, 0.3], [0.05, 0.4, -0.1], [-0.3, 0.1, 0.2]];

fn map(v: &[f64]) -> HashMap<String, Array> {
    let f: Vec<f32> = v.iter().map(|&x| x as f32).collect();
    [("w".to_string(), Array::from_slice(&f, &[3]).unwrap())].into_iter().collect()
}

/// Runs `opt` over the three gradients and returns the parameters after each step.
fn run(opt: &mut Optimizer) -> Vec<Vec<f64>> {
    let mut p = map(&P0);
    let mut out = Vec::new();
    for g in GRADS {
        p = opt.update(&p, &map(&g)).unwrap();
        out.push(p["w"].to_vec::<f32>().unwrap().iter().map(|&x| x as f64).collect());
    }
    out
}

fn close(got: &[Vec<f64>], want: &[Vec<f64>], what: &str) {
    for (s, (g, w)) in got.iter().zip(want).enumerate() {
        for (a, b) in g.iter().zip(w) {
            assert!((a - b).abs() < 2e-6 * (1.0 + b.abs()), "{what} step {}: {a} against {b}", s + 1);
        }
    }
}

/// MLX's Adam(W) in f64.
fn adam_reference(lr: impl Fn(usize) -> f64, wd: f64, bias_correction: bool) -> Vec<Vec<f64>> {
    let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8f64);
    let (mut p, mut m, mut v) = (P0.to_vec(), vec![0.0; 3], vec![0.0; 3]);
    let mut out = Vec::new();
    for (s, g) in GRADS.iter().enumerate() {
        let lr = lr(s);
        let step = (s + 1) as i32;
        for i in 0..3 {
            let q = p[i] * (1.0 - lr * wd);
            m[i] = b1 * m[i] + (1.0 - b1) * g[i];
            v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
            p[i] = if bias_correction {
                let c1 = lr / (1.0 - b1.powi(step));
                let c2 = 1.0 / (1.0 - b2.powi(step)).sqrt();
                q - c1 * m[i] / (v[i].sqrt() * c2 + eps)
            } else {
                q - lr * m[i] / (v[i].sqrt() + eps)
            };
        }
        out.push(p.clone());
    }
    out
}

#[test]
fn adam_and_adamw_follow_mlx() {
    close(
        &run(&mut Optimizer::new(OptimizerKind::adam(), Schedule::Constant(0.01))),
        &adam_reference(|_| 0.01, 0.0, false),
        "adam",
    );
    let bc = OptimizerKind::Adam { betas: (0.9, 0.999), eps: 1e-8, bias_correction: true };
    close(
        &run(&mut Optimizer::new(bc, Schedule::Constant(0.01))),
        &adam_reference(|_| 0.01, 0.0, true),
        "adam, bias correction",
    );
    close(
        &run(&mut Optimizer::new(OptimizerKind::adamw(), Schedule::Constant(0.01))),
        &adam_reference(|_| 0.01, 0.01, false),
        "adamw",
    );
    // The schedule is read at the step count before each update.
    let sched = Schedule::Linear { init: 0.0, end: 0.03, steps: 3 };
    close(
        &run(&mut Optimizer::new(OptimizerKind::adam(), sched)),
        &adam_reference(|s| 0.01 * s as f64, 0.0, false),
        "adam, scheduled",
    );
}

/// The compiled (fused) Adam update, which rmlx uses on GPUs, against the same references.
#[test]
fn compiled_adam_and_adamw_follow_mlx() {
    let compiled = |kind: OptimizerKind, schedule: Schedule| {
        let mut opt = Optimizer::new(kind, schedule);
        opt.set_compiled(true);
        opt
    };
    close(
        &run(&mut compiled(OptimizerKind::adam(), Schedule::Constant(0.01))),
        &adam_reference(|_| 0.01, 0.0, false),
        "adam",
    );
    let bc = OptimizerKind::AdamW { betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.01, bias_correction: true };
    let sched = Schedule::Linear { init: 0.0, end: 0.03, steps: 3 };
    close(
        &run(&mut compiled(bc, sched)),
        &adam_reference(|s| 0.01 * s as f64, 0.01, true),
        "adamw, bias correction, scheduled",
    );
}

#[test]
fn sgd_variants_follow_mlx() {
    let lr = 0.1f64;
    let reference = |momentum: f64, wd: f64, dampening: f64, nesterov: bool| {
        let (mut p, mut v) = (P0.to_vec(), vec![0.0; 3]);
        let mut out = Vec::new();
        for g in GRADS {
            for i in 0..3 {
                let g = g[i] + wd * p[i];
                let update = if momentum <= 0.0 {
                    g
                } else {
                    v[i] = momentum * v[i] + if dampening > 0.0 { (1.0 - dampening) * g } else { g };
                    if nesterov {
                        g + momentum * v[i]
                    } else {
                        v[i]
                    }
                };
                p[i] -= lr * update;
            }
            out.push(p.clone());
        }
        out
    };
    for (momentum, wd, dampening, nesterov) in
        [(0.0, 0.0, 0.0, false), (0.9, 0.0, 0.0, false), (0.9, 0.01, 0.0, true), (0.5, 0.0, 0.3, false)]
    {
        let kind = OptimizerKind::Sgd {
            momentum: momentum as f32,
            weight_decay: wd as f32,
            dampening: dampening as f32,
            nesterov,
        };
        close(
            &run(&mut Optimizer::new(kind, Schedule::Constant(lr as f32))),
            &reference(momentum, wd, dampening, nesterov),
            &format!("sgd {momentum} {wd} {dampening} {nesterov}"),
        );
    }
}

#[test]
fn schedules_follow_mlx() {
    let cos = Schedule::from_config("cosine_decay", &[1e-3, 100.0, 1e-5], 0, 0.0).unwrap();
    for step in [0u64, 1, 50, 99, 100, 250] {
        let s = step.min(100) as f64;
        let want = 1e-5 + 0.5 * (1.0 + (std::f64::consts::PI * s / 100.0).cos()) * (1e-3 - 1e-5);
        assert!((cos.at(step) as f64 - want).abs() < 1e-9, "cosine at {step}");
    }
    // mlx-lm's warm-up: linear from warmup_init to the initial rate over `warmup` steps, joined at
    // warmup + 1, after which the main schedule starts from its own step 0.
    let warm = Schedule::from_config("cosine_decay", &[1e-3, 100.0], 10, 1e-4).unwrap();
    let at: Vec<f32> = [0u64, 5, 10, 11, 12].iter().map(|&s| warm.at(s)).collect();
    let want = [
        1e-4,
        1e-4 + 0.5 * (1e-3 - 1e-4),
        1e-3,
        1e-3,
        (0.5 * (1.0 + (std::f64::consts::PI / 100.0).cos()) * 1e-3) as f32,
    ];
    for (a, w) in at.iter().zip(want) {
        assert!((a - w).abs() < 1e-9, "{at:?} against {want:?}");
    }
    assert_eq!(Schedule::from_config("step_decay", &[1.0, 0.5, 10.0], 0, 0.0).unwrap().at(25), 0.25);
    assert!((Schedule::from_config("exponential_decay", &[1.0, 0.9], 0, 0.0).unwrap().at(2) - 0.81).abs() < 1e-6);
    assert!(Schedule::from_config("cosine_decay", &[1e-3], 0, 0.0).is_err(), "missing decay_steps");
    assert!(Schedule::from_config("cosine_decay", &[1e-3, 0.5], 0, 0.0).is_err(), "fractional decay_steps");
    assert!(Schedule::from_config("triangle", &[1e-3], 0, 0.0).is_err());
}

#[test]
fn resuming_from_saved_state_continues_exactly() {
    let mut whole = Optimizer::new(OptimizerKind::adamw(), Schedule::Constant(0.01));
    let straight = run(&mut whole);
    // Two steps, save, restore into a fresh optimiser, one more step.
    let mut first = Optimizer::new(OptimizerKind::adamw(), Schedule::Constant(0.01));
    let mut p = map(&P0);
    for g in &GRADS[..2] {
        p = first.update(&p, &map(g)).unwrap();
    }
    let (state, step) = first.state_arrays();
    assert_eq!((state.keys().cloned().collect::<Vec<_>>(), step), (vec!["w.m".to_string(), "w.v".to_string()], 2));
    let mut resumed = Optimizer::new(OptimizerKind::adamw(), Schedule::Constant(0.01));
    resumed.load_state(&state, step).unwrap();
    let p = resumed.update(&p, &map(&GRADS[2])).unwrap();
    let last: Vec<f64> = p["w"].to_vec::<f32>().unwrap().iter().map(|&x| x as f64).collect();
    assert_eq!(last, straight[2], "bit-identical to the uninterrupted run");
    assert!(resumed.update(&p, &[("x".to_string(), p["w"].clone())].into_iter().collect()).is_err());
    // Adam's state does not fit SGD with momentum.
    let mut sgd = Optimizer::new(
        OptimizerKind::Sgd { momentum: 0.9, weight_decay: 0.0, dampening: 0.0, nesterov: false },
        Schedule::Constant(0.1),
    );
    assert!(sgd.load_state(&state, step).is_err());
}

mod adafactor {
    //! Adafactor against MLX's own `optimizers.Adafactor`: `scripts/make_tuner_optim_goldens.py`
    //! wrote, with mlx 0.32.4, the parameters after each of four updates of a 2-D, a 3-D (both with
    //! factored second moments) and a 1-D parameter, and the state after the last, for MLX's
    //! defaults and for non-default settings.

    use rmlx::{Array, Dtype};
    use rmlx_lm::tuner::optim::{Adafactor, Optimizer, OptimizerKind, Schedule};
    use serde_json::Value;
    use std::collections::{BTreeMap, HashMap};
    use std::path::Path;

    fn goldens() -> Value {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tuner/optim_goldens.json");
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    fn floats(v: &Value) -> Vec<f32> {
        v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
    }

    /// The golden file's named arrays (`params` or one step's gradients) in `dtype`.
    fn arrays(doc: &Value, values: &Value, dtype: Dtype) -> HashMap<String, Array> {
        let shapes = doc["shapes"].as_object().unwrap();
        values
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| {
                let shape: Vec<i32> =
                    shapes[k].as_array().unwrap().iter().map(|d| d.as_i64().unwrap() as i32).collect();
                (k.clone(), Array::from_slice(&floats(v), &shape).unwrap().astype(dtype).unwrap())
            })
            .collect()
    }

    /// The case's `mlx.optimizers.Adafactor(learning_rate=..., **config)`, as rmlx builds it.
    fn optimizer(case: &Value) -> Optimizer {
        let c = &case["config"];
        let num = |k: &str, d: f64| c.get(k).map_or(d, |v| v.as_f64().unwrap());
        let flag = |k: &str, d: bool| c.get(k).map_or(d, |v| v.as_bool().unwrap());
        let d = Adafactor::default();
        let eps = c.get("eps").map_or(d.eps, |e| (e[0].as_f64().unwrap(), e[1].as_f64().unwrap()));
        let kind = OptimizerKind::Adafactor(Adafactor {
            eps,
            clip_threshold: num("clip_threshold", d.clip_threshold),
            decay_rate: num("decay_rate", d.decay_rate),
            beta_1: c.get("beta_1").map(|v| v.as_f64().unwrap()),
            weight_decay: num("weight_decay", d.weight_decay),
            scale_parameter: flag("scale_parameter", d.scale_parameter),
            relative_step: flag("relative_step", d.relative_step),
            warmup_init: flag("warmup_init", d.warmup_init),
        });
        if c.as_object().unwrap().is_empty() {
            assert_eq!(kind, OptimizerKind::adafactor(), "MLX's defaults");
        }
        let lr = &case["learning_rate"];
        let schedule = match lr.as_array() {
            Some(a) => Schedule::Linear {
                init: a[0].as_f64().unwrap() as f32,
                end: a[1].as_f64().unwrap() as f32,
                steps: a[2].as_u64().unwrap(),
            },
            None => Schedule::Constant(lr.as_f64().unwrap() as f32),
        };
        Optimizer::new(kind, schedule)
    }

    fn values(a: &Array) -> Vec<f32> {
        a.astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap()
    }

    /// Every element of `got` within `rtol` of `want`'s (relative to the element, with a floor of
    /// `rtol` times the array's largest magnitude for elements near zero).
    fn close(got: &[f32], want: &[f32], rtol: f64, what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: sizes");
        let scale = want.iter().fold(0f64, |m, w| m.max((*w as f64).abs()));
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let (g, w) = (*g as f64, *w as f64);
            assert!((g - w).abs() <= rtol * w.abs().max(1e-3 * scale), "{what}[{i}]: {g} against MLX's {w}");
        }
    }

    /// The relative tolerance for a case's dtype: f32 rounding, or one bfloat16 unit.
    fn rtol(case: &Value) -> (Dtype, f64) {
        match case["dtype"].as_str().unwrap() {
            "float32" => (Dtype::Float32, 1e-6),
            "bfloat16" => (Dtype::Bfloat16, 1.0 / 128.0),
            other => panic!("dtype {other}"),
        }
    }

    fn step_all(
        doc: &Value,
        opt: &mut Optimizer,
        p: HashMap<String, Array>,
        grads: &[Value],
        dtype: Dtype,
    ) -> HashMap<String, Array> {
        grads.iter().fold(p, |p, g| opt.update(&p, &arrays(doc, g, dtype)).unwrap())
    }

    #[test]
    fn updates_and_state_follow_mlx() {
        let doc = goldens();
        let grads = doc["grads"].as_array().unwrap();
        for case in doc["cases"].as_array().unwrap() {
            let name = case["name"].as_str().unwrap();
            let (dtype, rtol) = rtol(case);
            let mut opt = optimizer(case);
            let mut p = arrays(&doc, &doc["params"], dtype);
            for (s, (g, want)) in grads.iter().zip(case["steps"].as_array().unwrap()).enumerate() {
                p = opt.update(&p, &arrays(&doc, g, dtype)).unwrap();
                for (k, a) in &p {
                    assert_eq!(a.dtype(), dtype, "{name}: {k} keeps its dtype");
                    close(&values(a), &floats(&want[k]), rtol, &format!("{name}, step {}, {k}", s + 1));
                }
            }
            let (state, step) = opt.state_arrays();
            assert_eq!(step, 4);
            let want = case["state"].as_object().unwrap();
            assert_eq!(
                state.keys().collect::<Vec<_>>(),
                want.keys().collect::<std::collections::BTreeSet<_>>().into_iter().collect::<Vec<_>>(),
                "{name}: state names"
            );
            for (k, a) in &state {
                close(&values(a), &floats(&want[k]), rtol, &format!("{name}, state {k}"));
            }
        }
    }

    #[test]
    fn resuming_from_saved_state_continues_exactly() {
        let doc = goldens();
        let grads = doc["grads"].as_array().unwrap();
        let cases = doc["cases"].as_array().unwrap();
        // Both moments, factored and whole, and a scheduled learning rate read at the step count.
        for case in cases.iter().filter(|c| c["dtype"] == "float32" && c["config"].get("beta_1").is_some()) {
            let name = case["name"].as_str().unwrap();
            let p0 = arrays(&doc, &doc["params"], Dtype::Float32);
            let straight = step_all(&doc, &mut optimizer(case), p0.clone(), grads, Dtype::Float32);
            let mut first = optimizer(case);
            let p = step_all(&doc, &mut first, p0, &grads[..2], Dtype::Float32);
            let (state, step) = first.state_arrays();
            assert_eq!(step, 2);
            assert!(
                state.contains_key("w.exp_avg_sq_row")
                    && state.contains_key("b.exp_avg_sq")
                    && state.contains_key("u.exp_avg")
            );
            // Through a file, as the trainer's checkpoints keep it.
            let file = std::env::temp_dir().join(format!("rmlx-adafactor-state-{}.safetensors", std::process::id()));
            rmlx::io::save_safetensors(&file, &state, &BTreeMap::new()).unwrap();
            let saved = rmlx::io::load_safetensors(&file).unwrap().arrays;
            let _ = std::fs::remove_file(&file);
            let mut resumed = optimizer(case);
            resumed.load_state(&saved, step).unwrap();
            assert_eq!(resumed.learning_rate(), first.learning_rate());
            let p = step_all(&doc, &mut resumed, p, &grads[2..], Dtype::Float32);
            for (k, a) in &p {
                assert_eq!(values(a), values(&straight[k]), "{name}: {k} bit-identical to the uninterrupted run");
            }
        }
    }

    #[test]
    fn state_of_other_settings_is_refused() {
        let doc = goldens();
        let grads = doc["grads"].as_array().unwrap();
        let mut with_moment = Optimizer::new(
            OptimizerKind::Adafactor(Adafactor { beta_1: Some(0.9), ..Adafactor::default() }),
            Schedule::Constant(1e-5),
        );
        let p =
            step_all(&doc, &mut with_moment, arrays(&doc, &doc["params"], Dtype::Float32), &grads[..1], Dtype::Float32);
        let (state, step) = with_moment.state_arrays();
        // A first moment that this optimizer does not keep, and Adam's state.
        let err =
            Optimizer::new(OptimizerKind::adafactor(), Schedule::Constant(1e-5)).load_state(&state, step).unwrap_err();
        assert!(err.to_string().contains("exp_avg, exp_avg_sq"), "{err}");
        let mut adam = Optimizer::new(OptimizerKind::adam(), Schedule::Constant(1e-5));
        adam.update(&p, &arrays(&doc, &grads[1], Dtype::Float32)).unwrap();
        let (adam_state, _) = adam.state_arrays();
        assert!(Optimizer::new(OptimizerKind::adafactor(), Schedule::Constant(1e-5))
            .load_state(&adam_state, 1)
            .is_err());
        assert!(Optimizer::new(OptimizerKind::adam(), Schedule::Constant(1e-5)).load_state(&state, 1).is_err());
        // The factored state of the matrix `w` saved under the vector `b`'s name fits no update of `b`.
        let swapped: BTreeMap<String, Array> = state
            .iter()
            .filter(|(k, _)| k.starts_with("w."))
            .map(|(k, a)| (k.replacen("w.", "b.", 1), a.clone()))
            .collect();
        let mut opt = Optimizer::new(
            OptimizerKind::Adafactor(Adafactor { beta_1: Some(0.9), ..Adafactor::default() }),
            Schedule::Constant(1e-5),
        );
        opt.load_state(&swapped, 1).unwrap();
        let b: HashMap<String, Array> = [("b".to_string(), p["b"].clone())].into_iter().collect();
        let err = opt.update(&b, &b).unwrap_err();
        assert!(err.to_string().contains("`b` lacks `exp_avg_sq`"), "{err}");
    }
}
