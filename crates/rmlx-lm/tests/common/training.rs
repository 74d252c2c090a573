//! Helpers of the training tests: LoRA factors moved off zero, and two loss-and-gradient steps
//! compared.
#![allow(dead_code)]

/// Replaces every adapter's B of `lm` with small normal values (keys from `seed` on), away from
/// zero, so that every LoRA factor gets a non-zero gradient.
pub fn move_lora_b(lm: &mut rmlx_lm::LoadedModel, trainable: &[String], seed: u64) {
    use rmlx_lm::nn::ModuleExt;
    let current: std::collections::HashMap<String, rmlx::Array> = lm.model.parameters("").into_iter().collect();
    let moved = trainable
        .iter()
        .filter(|n| n.ends_with(".lora_b"))
        .enumerate()
        .map(|(i, n)| {
            let key = rmlx::random::key(seed + i as u64).unwrap();
            (n.clone(), rmlx::random::normal(current[n].shape(), rmlx::Dtype::Float32, 0.0, 0.05, Some(&key)).unwrap())
        })
        .collect();
    lm.model.update("", moved).unwrap();
}

/// Asserts that two loss-and-gradient steps agree: the loss within `loss_rel` (relative), the
/// target count exactly, the same parameters, and every gradient within `grad_rel` of its largest
/// entry in `a` (which must not be zero).
pub fn assert_same_step(
    what: &str,
    a: &rmlx_lm::tuner::LossAndGrad,
    b: &rmlx_lm::tuner::LossAndGrad,
    loss_rel: f32,
    grad_rel: f32,
) {
    let vals = |x: &rmlx::Array| x.astype(rmlx::Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
    let (la, lb) = (a.loss.item::<f32>().unwrap(), b.loss.item::<f32>().unwrap());
    assert!((la - lb).abs() <= loss_rel * la.abs(), "{what}: loss {lb} against {la}");
    assert_eq!(a.ntoks.item::<f32>().unwrap(), b.ntoks.item::<f32>().unwrap(), "{what}: targets");
    assert_eq!(a.grads.len(), b.grads.len(), "{what}: gradients");
    for (name, g) in &a.grads {
        let (x, y) = (vals(g), vals(&b.grads[name]));
        let scale = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(scale > 0.0, "{what}, {name}: no gradient");
        let err = x.iter().zip(&y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(err <= grad_rel * scale, "{what}, {name}: max |Δ| {err} of {scale}");
    }
}
