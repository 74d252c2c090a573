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
    close(&run(&mut Optimizer::new(OptimizerKind::adam(), Schedule::Constant(0.01))), &adam_reference(|_| 0.01, 0.0, false), "adam");
    let bc = OptimizerKind::Adam { betas: (0.9, 0.999), eps: 1e-8, bias_correction: true };
    close(&run(&mut Optimizer::new(bc, Schedule::Constant(0.01))), &adam_reference(|_| 0.01, 0.0, true), "adam, bias correction");
    close(&run(&mut Optimizer::new(OptimizerKind::adamw(), Schedule::Constant(0.01))), &adam_reference(|_| 0.01, 0.01, false), "adamw");
    // The schedule is read at the step count before each update.
    let sched = Schedule::Linear { init: 0.0, end: 0.03, steps: 3 };
    close(&run(&mut Optimizer::new(OptimizerKind::adam(), sched)), &adam_reference(|s| 0.01 * s as f64, 0.0, false), "adam, scheduled");
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
                    if nesterov { g + momentum * v[i] } else { v[i] }
                };
                p[i] -= lr * update;
            }
            out.push(p.clone());
        }
        out
    };
    for (momentum, wd, dampening, nesterov) in [(0.0, 0.0, 0.0, false), (0.9, 0.0, 0.0, false), (0.9, 0.01, 0.0, true), (0.5, 0.0, 0.3, false)] {
        let kind = OptimizerKind::Sgd { momentum: momentum as f32, weight_decay: wd as f32, dampening: dampening as f32, nesterov };
        close(&run(&mut Optimizer::new(kind, Schedule::Constant(lr as f32))), &reference(momentum, wd, dampening, nesterov), &format!("sgd {momentum} {wd} {dampening} {nesterov}"));
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
    let want = [1e-4, 1e-4 + 0.5 * (1e-3 - 1e-4), 1e-3, 1e-3, (0.5 * (1.0 + (std::f64::consts::PI / 100.0).cos()) * 1e-3) as f32];
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
    let mut sgd = Optimizer::new(OptimizerKind::Sgd { momentum: 0.9, weight_decay: 0.0, dampening: 0.0, nesterov: false }, Schedule::Constant(0.1));
    assert!(sgd.load_state(&state, step).is_err());
}
