//! Adafactor (Shazeer & Stern, 2018) exactly as MLX's `optimizers.Adafactor` computes it: the
//! second moment of a parameter with two or more dimensions is kept factored, as running means of
//! the squared gradient over its last axis (`exp_avg_sq_row`) and its second-to-last axis
//! (`exp_avg_sq_col`); a vector keeps it whole (`exp_avg_sq`). The update is clipped to an RMS of
//! `clip_threshold`, scaled by the step size, and averaged into a first moment (`exp_avg`) when
//! `beta_1` is set.
//!
//! The step size ignores the scheduled learning rate unless `relative_step` is off: it is then
//! `min(1e-2, 1/√step)` (`min(1e-6 · step, 1/√step)` with `warmup_init`), times
//! `max(eps.1, RMS(parameter))` when `scale_parameter` is on. The second moment's decay is
//! `1 − step^decay_rate`, so the first update sees only its own gradient.

use super::Slots;
use crate::{Error, Result};
use rmlx::ops::{self, Axes};
use rmlx::Array;

/// Adafactor's settings; [`Default`] gives MLX's defaults. The numbers are kept as `f64`, as
/// Python keeps them: MLX rounds them to the parameter's dtype only where they meet an array
/// (after computing `1 − beta_1`, say).
#[derive(Clone, Debug, PartialEq)]
pub struct Adafactor {
    /// `(ε₁, ε₂)`: ε₁ is added to the squared gradient, ε₂ is the least parameter RMS that
    /// `scale_parameter` scales by.
    pub eps: (f64, f64),
    /// The RMS the update is clipped to before scaling.
    pub clip_threshold: f64,
    /// The second moment decays by `1 − step^decay_rate`.
    pub decay_rate: f64,
    /// The first moment's coefficient; `None` keeps no first moment.
    pub beta_1: Option<f64>,
    /// Decoupled weight decay, scaled by the step size.
    pub weight_decay: f64,
    /// Scales the step size by `max(ε₂, RMS(parameter))`.
    pub scale_parameter: bool,
    /// Computes the step size from the step count, ignoring the learning rate.
    pub relative_step: bool,
    /// With `relative_step`, grows the step size as `1e-6 · step` instead of starting at `1e-2`.
    pub warmup_init: bool,
}

impl Default for Adafactor {
    fn default() -> Self {
        Adafactor {
            eps: (1e-30, 1e-3),
            clip_threshold: 1.0,
            decay_rate: -0.8,
            beta_1: None,
            weight_decay: 0.0,
            scale_parameter: true,
            relative_step: true,
            warmup_init: false,
        }
    }
}

/// The names of the state arrays that a parameter of `ndim` dimensions keeps.
pub(super) fn slot_names(cfg: &Adafactor, ndim: usize) -> Vec<&'static str> {
    let mut names = if ndim >= 2 { vec!["exp_avg_sq_row", "exp_avg_sq_col"] } else { vec!["exp_avg_sq"] };
    if cfg.beta_1.is_some() {
        names.push("exp_avg");
    }
    names
}

/// A zero-dimensional `v` in `like`'s dtype: a Python scalar meeting an MLX array.
fn weak(v: f64, like: &Array) -> Result<Array> {
    Ok(Array::scalar_as(v, like.dtype())?)
}

fn rms(a: &Array) -> Result<Array> {
    Ok(ops::square(a)?.mean(Axes::All, false)?.sqrt()?)
}

/// The state array `key` of parameter `name`: zeros of `shape` the first time (when `state` is
/// empty), else the saved one, which must have that shape.
fn slot(name: &str, state: &Slots, key: &'static str, shape: &[i32], like: &Array) -> Result<Array> {
    if state.is_empty() {
        return Ok(ops::zeros(shape, like.dtype())?);
    }
    match state.get(key) {
        Some(a) if a.shape() == shape => Ok(a.clone()),
        Some(a) => Err(Error::InvalidParameter(format!(
            "the optimizer state `{name}.{key}` has shape {:?} where the parameter needs {shape:?}",
            a.shape()
        ))),
        None => Err(Error::InvalidParameter(format!(
            "the optimizer state of `{name}` lacks `{key}` (saved for a parameter of another shape?)"
        ))),
    }
}

impl Adafactor {
    /// The new value of parameter `name` (`p`, gradient `g`) at `step` (counted from 1), with the
    /// scheduled learning rate `lr` (used only without `relative_step`). `state` holds the
    /// parameter's state, empty before its first update, and is replaced by the new one.
    pub(super) fn apply(
        &self,
        name: &str,
        p: &Array,
        g: &Array,
        lr: f32,
        step: u64,
        state: &mut Slots,
    ) -> Result<Array> {
        let shape = p.shape().to_vec();
        let factored = g.ndim() >= 2;
        let step_f = step as f32;
        // The step size, in f32 as MLX computes it from its uint64 step count, then in p's dtype.
        let relative = if self.relative_step {
            let min_step = if self.warmup_init { 1e-6 * step_f } else { 1e-2 };
            min_step.min(1.0 / step_f.sqrt())
        } else {
            lr
        };
        let relative = weak(relative as f64, p)?;
        let lr =
            if self.scale_parameter { (ops::maximum(&weak(self.eps.1, p)?, &rms(p)?)? * &relative)? } else { relative };
        let beta_2 = (1.0 - weak(step_f.powf(self.decay_rate as f32) as f64, p)?)?;
        let keep = (1.0 - &beta_2)?;
        let squared = (ops::square(g)? + weak(self.eps.0, g)?)?;
        let mut new_state = Slots::new();
        let update = if factored {
            let n = shape.len();
            let row_shape = &shape[..n - 1];
            let col_shape: Vec<i32> = shape[..n - 2].iter().chain(&shape[n - 1..]).copied().collect();
            let row = slot(name, state, "exp_avg_sq_row", row_shape, p)?;
            let col = slot(name, state, "exp_avg_sq_col", &col_shape, p)?;
            let row = ((&beta_2 * &row)? + (&keep * squared.mean(-1, false)?)?)?;
            let col = ((&beta_2 * &col)? + (&keep * squared.mean(-2, false)?)?)?;
            let r_factor = ops::rsqrt(&(&row / row.mean(-1, true)?)?)?;
            let c_factor = ops::rsqrt(&col)?;
            let approx = (r_factor.expand_dims(-1)? * c_factor.expand_dims(-2)?)?;
            new_state.insert("exp_avg_sq_row", row);
            new_state.insert("exp_avg_sq_col", col);
            (approx * g)?
        } else {
            let v = slot(name, state, "exp_avg_sq", &shape, p)?;
            let v = ((&beta_2 * &v)? + (&keep * &squared)?)?;
            let update = (ops::rsqrt(&v)? * g)?;
            new_state.insert("exp_avg_sq", v);
            update
        };
        let clip = ops::maximum(&weak(1.0, &update)?, &(rms(&update)? / weak(self.clip_threshold, &update)?)?)?;
        let mut update = (&lr * (update / clip)?)?;
        if let Some(beta_1) = self.beta_1 {
            let m = slot(name, state, "exp_avg", &shape, p)?;
            let m = ((weak(beta_1, &m)? * &m)? + (weak(1.0 - beta_1, &update)? * &update)?)?;
            new_state.insert("exp_avg", m.clone());
            update = m;
        }
        let p =
            if self.weight_decay != 0.0 { (p + (p * (weak(-self.weight_decay, &lr)? * &lr)?)?)? } else { p.clone() };
        *state = new_state;
        Ok((p - update)?)
    }
}
