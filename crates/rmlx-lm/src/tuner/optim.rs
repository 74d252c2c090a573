//! Optimisers and learning-rate schedules with MLX's semantics (`mlx.optimizers`), as mlx-lm's
//! trainer uses them: SGD (momentum, dampening, Nesterov, weight decay), Adam (no bias correction
//! unless asked, as in MLX), AdamW (decoupled weight decay, 0.01 by default) and Adafactor
//! (factored second moments, relative step sizes: see [`Adafactor`]). State is kept per parameter
//! name, so it can be saved and restored with the adapter for an exact resume.
//!
//! The schedule is read at the step count before each update; the update then counts the step
//! (bias correction sees 1 on the first update), as MLX does.
//!
//! ```
//! use rmlx_lm::tuner::optim::{Optimizer, OptimizerKind, Schedule};
//! use rmlx::Array;
//! let mut opt = Optimizer::new(OptimizerKind::adam(), Schedule::Constant(0.1));
//! let p = [("w".to_string(), Array::from_slice(&[1.0f32], &[1])?)].into_iter().collect();
//! let g = [("w".to_string(), Array::from_slice(&[2.0f32], &[1])?)].into_iter().collect();
//! let new = opt.update(&p, &g)?;
//! // m = 0.2, v = 0.004: w = 1 - 0.1 * 0.2 / (√0.004 + 1e-8)
//! let w = new["w"].item::<f32>()?;
//! assert!((w - (1.0 - 0.1 * 0.2 / 0.004f32.sqrt())).abs() < 1e-4); // f32 rounding of 1 - β₂
//! # Ok::<(), rmlx_lm::Error>(())
//! ```

use crate::{Error, Result};
use rmlx::compile::{compile_with, CompileOptions, Compiled};
use rmlx::{ops, Array, Dtype};
use std::collections::{BTreeMap, HashMap};

mod adafactor;
pub use adafactor::Adafactor;

/// One parameter's state arrays by name (`m`, `v`, `momentum`, `exp_avg_sq_row`, ...).
type Slots = BTreeMap<&'static str, Array>;

/// Every state name an optimizer keeps, to read saved state back.
const SLOT_NAMES: [&str; 7] = ["m", "v", "momentum", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq", "exp_avg"];

/// A learning rate as a function of the step count (MLX's `optimizers.schedulers`).
#[derive(Clone, Debug, PartialEq)]
pub enum Schedule {
    Constant(f32),
    /// `end + ½ (1 + cos(π min(step, decay_steps) / decay_steps)) (init − end)`.
    CosineDecay {
        init: f32,
        decay_steps: u64,
        end: f32,
    },
    /// From `init` to `end` over `steps`, then `end`.
    Linear {
        init: f32,
        end: f32,
        steps: u64,
    },
    /// `init · rate^step`.
    Exponential {
        init: f32,
        rate: f32,
    },
    /// `init · rate^(step / step_size)` (integer division).
    StepDecay {
        init: f32,
        rate: f32,
        step_size: u64,
    },
    /// `first` before `boundary`, then `then` counted from the boundary.
    Join {
        first: Box<Schedule>,
        boundary: u64,
        then: Box<Schedule>,
    },
}

impl Schedule {
    /// The learning rate at `step`.
    pub fn at(&self, step: u64) -> f32 {
        match self {
            Schedule::Constant(lr) => *lr,
            Schedule::CosineDecay { init, decay_steps, end } => {
                let s = step.min(*decay_steps) as f64;
                let decay = 0.5 * (1.0 + (std::f64::consts::PI / *decay_steps as f64 * s).cos());
                (*end as f64 + decay * (*init as f64 - *end as f64)) as f32
            }
            Schedule::Linear { init, end, steps } => {
                let s = step.min(*steps) as f64;
                (s * ((*end as f64 - *init as f64) / *steps as f64) + *init as f64) as f32
            }
            Schedule::Exponential { init, rate } => init * rate.powf(step as f32),
            Schedule::StepDecay { init, rate, step_size } => init * rate.powi((step / step_size) as i32),
            Schedule::Join { first, boundary, then } => {
                if step < *boundary {
                    first.at(step)
                } else {
                    then.at(step - boundary)
                }
            }
        }
    }

    /// mlx-lm's `lr_schedule {name, arguments, warmup, warmup_init}`: the named MLX schedule,
    /// preceded by a linear warm-up from `warmup_init` to its initial rate over `warmup` steps.
    pub fn from_config(name: &str, arguments: &[f64], warmup: u64, warmup_init: f32) -> Result<Schedule> {
        let arg = |i: usize| arguments.get(i).copied();
        let need = |i: usize| {
            arg(i).ok_or_else(|| {
                Error::InvalidParameter(format!("lr_schedule `{name}` needs at least {} arguments", i + 1))
            })
        };
        let steps = |v: f64, what: &str| -> Result<u64> {
            if v >= 1.0 && v.fract() == 0.0 {
                Ok(v as u64)
            } else {
                Err(Error::InvalidParameter(format!(
                    "lr_schedule `{name}`: {what} must be a positive integer, got {v}"
                )))
            }
        };
        let main = match name {
            "cosine_decay" => Schedule::CosineDecay {
                init: need(0)? as f32,
                decay_steps: steps(need(1)?, "decay_steps")?,
                end: arg(2).unwrap_or(0.0) as f32,
            },
            "linear_schedule" => {
                Schedule::Linear { init: need(0)? as f32, end: need(1)? as f32, steps: steps(need(2)?, "steps")? }
            }
            "exponential_decay" => Schedule::Exponential { init: need(0)? as f32, rate: need(1)? as f32 },
            "step_decay" => Schedule::StepDecay {
                init: need(0)? as f32,
                rate: need(1)? as f32,
                step_size: steps(need(2)?, "step_size")?,
            },
            other => {
                return Err(Error::InvalidParameter(format!(
                    "unknown lr_schedule `{other}` (cosine_decay, linear_schedule, exponential_decay, step_decay)"
                )))
            }
        };
        if warmup == 0 {
            return Ok(main);
        }
        let warm = Schedule::Linear { init: warmup_init, end: need(0)? as f32, steps: warmup };
        Ok(Schedule::Join { first: Box::new(warm), boundary: warmup + 1, then: Box::new(main) })
    }
}

/// Which update rule, with its settings (MLX's defaults from the constructors below).
#[derive(Clone, Debug, PartialEq)]
pub enum OptimizerKind {
    Sgd { momentum: f32, weight_decay: f32, dampening: f32, nesterov: bool },
    Adam { betas: (f32, f32), eps: f32, bias_correction: bool },
    AdamW { betas: (f32, f32), eps: f32, weight_decay: f32, bias_correction: bool },
    Adafactor(Adafactor),
}

impl OptimizerKind {
    pub fn sgd() -> Self {
        OptimizerKind::Sgd { momentum: 0.0, weight_decay: 0.0, dampening: 0.0, nesterov: false }
    }
    pub fn adam() -> Self {
        OptimizerKind::Adam { betas: (0.9, 0.999), eps: 1e-8, bias_correction: false }
    }
    pub fn adamw() -> Self {
        OptimizerKind::AdamW { betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.01, bias_correction: false }
    }
    /// MLX's defaults: relative step sizes scaled by the parameter's RMS, no first moment.
    pub fn adafactor() -> Self {
        OptimizerKind::Adafactor(Adafactor::default())
    }
}

/// An optimiser with its per-parameter state and step count.
pub struct Optimizer {
    kind: OptimizerKind,
    schedule: Schedule,
    step: u64,
    /// `m`/`v` (Adam), `momentum` (SGD with momentum) or Adafactor's moments per parameter name.
    state: HashMap<String, Slots>,
    /// Adam's update of one parameter as one compiled (fused) function, when compiling; one per
    /// dtype of the compute copy it also writes ([`Optimizer::update_with_copies`]).
    fused_adam: Option<HashMap<Option<Dtype>, Compiled>>,
}

impl Optimizer {
    /// An optimizer whose Adam/AdamW updates are compiled on a GPU (one fused kernel per
    /// parameter instead of a dozen small ones) and run op by op on the CPU, where compiling
    /// would need a C++ compiler at run time. [`Optimizer::set_compiled`] overrides this.
    pub fn new(kind: OptimizerKind, schedule: Schedule) -> Self {
        let mut opt = Optimizer { kind, schedule, step: 0, state: HashMap::new(), fused_adam: None };
        opt.set_compiled(rmlx::current_device().kind == rmlx::DeviceType::Gpu);
        opt
    }

    /// Compiles (or stops compiling) the Adam/AdamW update. Both give the same values up to
    /// floating-point contraction in the fused kernel.
    pub fn set_compiled(&mut self, compiled: bool) {
        self.fused_adam = match (&self.kind, compiled) {
            (&OptimizerKind::Adam { .. } | &OptimizerKind::AdamW { .. }, true) => Some(HashMap::new()),
            _ => None,
        };
    }

    /// Updates done so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The learning rate the next update uses.
    pub fn learning_rate(&self) -> f32 {
        self.schedule.at(self.step)
    }

    /// The new value of every parameter that has a gradient (lazy arrays). Parameters without a
    /// gradient are an error: training updates exactly the trainable set.
    pub fn update(
        &mut self,
        params: &HashMap<String, Array>,
        grads: &HashMap<String, Array>,
    ) -> Result<HashMap<String, Array>> {
        Ok(self.update_with_copies(params, grads, None)?.0)
    }

    /// [`Optimizer::update`], also returning each new value cast to `copy` (mixed precision: the
    /// parameters and the optimizer's state stay in their own dtype, a float32 master, while the
    /// forward and backward passes read the copy, in the activations' dtype, and give gradients in
    /// it). A parameter already in `copy`'s dtype is its own copy. Compiled Adam writes the copy
    /// from the same fused kernel as the update, so the casts cost no operation of their own.
    /// Gradients in another dtype than their parameter are cast to the parameter's first.
    pub fn update_with_copies(
        &mut self,
        params: &HashMap<String, Array>,
        grads: &HashMap<String, Array>,
        copy: Option<Dtype>,
    ) -> Result<(HashMap<String, Array>, HashMap<String, Array>)> {
        let lr = self.schedule.at(self.step);
        self.step += 1;
        let step = self.step;
        let mut out = HashMap::with_capacity(grads.len());
        let mut copies = HashMap::new();
        for (name, g) in grads {
            let p = params
                .get(name)
                .ok_or_else(|| Error::InvalidParameter(format!("a gradient for `{name}`, which is no parameter")))?;
            let copy = copy.filter(|&d| d != p.dtype());
            // Adam casts inside its (fused) update; the others here.
            let is_adam = matches!(self.kind, OptimizerKind::Adam { .. } | OptimizerKind::AdamW { .. });
            let g = if g.dtype() != p.dtype() && !is_adam { &g.astype(p.dtype())? } else { g };
            let new = match &self.kind {
                &OptimizerKind::Sgd { momentum, weight_decay, dampening, nesterov } => {
                    let g = if weight_decay != 0.0 { (g + (p * weight_decay)?)? } else { g.clone() };
                    if momentum <= 0.0 {
                        (p - (&g * lr)?)?
                    } else {
                        let [v0] = self.slots(name, ["momentum"], p)?;
                        let v = if dampening > 0.0 {
                            ((&v0 * momentum)? + (&g * (1.0 - dampening))?)?
                        } else {
                            ((&v0 * momentum)? + &g)?
                        };
                        let update = if nesterov { (&g + (&v * momentum)?)? } else { v.clone() };
                        self.state.insert(name.clone(), [("momentum", v)].into());
                        (p - (update * lr)?)?
                    }
                }
                &OptimizerKind::Adam { betas, eps, bias_correction } => {
                    let (new, copied) = self.adam(name, p, g, lr, step, betas, eps, bias_correction, copy)?;
                    copies.extend(copied.map(|c| (name.clone(), c)));
                    new
                }
                &OptimizerKind::AdamW { betas, eps, weight_decay, bias_correction } => {
                    let decayed = (p * (1.0 - lr * weight_decay))?;
                    let (new, copied) = self.adam(name, &decayed, g, lr, step, betas, eps, bias_correction, copy)?;
                    copies.extend(copied.map(|c| (name.clone(), c)));
                    new
                }
                OptimizerKind::Adafactor(cfg) => {
                    let state = self.state.entry(name.clone()).or_default();
                    cfg.apply(name, p, g, lr, step, state)?
                }
            };
            if !copies.contains_key(name) {
                let c = match copy {
                    Some(d) => new.astype(d)?,
                    None => new.clone(),
                };
                copies.insert(name.clone(), c);
            }
            out.insert(name.clone(), new);
        }
        Ok((out, copies))
    }

    #[allow(clippy::too_many_arguments)]
    fn adam(
        &mut self,
        name: &str,
        p: &Array,
        g: &Array,
        lr: f32,
        step: u64,
        betas: (f32, f32),
        eps: f32,
        bias_correction: bool,
        copy: Option<Dtype>,
    ) -> Result<(Array, Option<Array>)> {
        let (b1, b2) = betas;
        let [m0, v0] = self.slots(name, ["m", "v"], p)?;
        // The step's numbers as 0-d arrays in the parameter's dtype (for the compiled update: no
        // new trace per step, and no promotion of a bfloat16 parameter).
        let (c1, c2) = if bias_correction {
            (lr / (1.0 - b1.powi(step as i32)), 1.0 / (1.0 - b2.powi(step as i32)).sqrt())
        } else {
            (lr, 1.0)
        };
        let scalar = |v: f32| Array::scalar_as(v as f64, p.dtype());
        let inputs = [p.clone(), g.clone(), m0, v0, scalar(c1)?, scalar(c2)?];
        let mut out = match &mut self.fused_adam {
            Some(fused) => fused.entry(copy).or_insert_with(|| fused_adam(betas, eps, copy)).call(&inputs)?,
            None => adam_update(&inputs, betas, eps, copy)?,
        };
        let copied = if copy.is_some() { out.pop() } else { None };
        let [new, m, v]: [Array; 3] =
            out.try_into().map_err(|_| Error::InvalidParameter("Adam: three outputs".into()))?;
        self.state.insert(name.to_string(), [("m", m), ("v", v)].into());
        Ok((new, copied))
    }

    /// The state arrays `keys` of `name`, zeros like `p` the first time.
    fn slots<const N: usize>(&self, name: &str, keys: [&'static str; N], p: &Array) -> Result<[Array; N]> {
        let saved = self.state.get(name);
        let mut out = Vec::with_capacity(N);
        for key in keys {
            out.push(match saved.and_then(|s| s.get(key)) {
                Some(a) => a.clone(),
                None => ops::zeros_like(p)?,
            });
        }
        Ok(out.try_into().unwrap_or_else(|_| unreachable!("one array per key")))
    }

    /// The state as named arrays (`<param>.m` and `<param>.v` for Adam, `<param>.momentum` for
    /// SGD, `<param>.exp_avg_sq_row`, `.exp_avg_sq_col`, `.exp_avg_sq` and `.exp_avg` for
    /// Adafactor, as MLX names them) plus the step count, for a checkpoint that resumes exactly.
    pub fn state_arrays(&self) -> (BTreeMap<String, Array>, u64) {
        let mut out = BTreeMap::new();
        for (name, s) in &self.state {
            for (suffix, a) in s {
                out.insert(format!("{name}.{suffix}"), a.clone());
            }
        }
        (out, self.step)
    }

    /// Whether `saved` (a parameter's state names, sorted) is what this optimizer keeps for a
    /// parameter.
    fn fits(&self, saved: &[&str]) -> bool {
        let kept = match &self.kind {
            OptimizerKind::Adam { .. } | OptimizerKind::AdamW { .. } => vec![vec!["m", "v"]],
            OptimizerKind::Sgd { .. } => vec![vec!["momentum"]],
            OptimizerKind::Adafactor(cfg) => vec![adafactor::slot_names(cfg, 1), adafactor::slot_names(cfg, 2)],
        };
        kept.into_iter().any(|mut w| {
            w.sort_unstable();
            w == saved
        })
    }

    /// Restores what [`Optimizer::state_arrays`] gave.
    pub fn load_state(&mut self, arrays: &BTreeMap<String, Array>, step: u64) -> Result<()> {
        let mut state: HashMap<String, Slots> = HashMap::new();
        for (key, a) in arrays {
            let (name, suffix) =
                key.rsplit_once('.').ok_or_else(|| Error::InvalidParameter(format!("optimizer state `{key}`")))?;
            let suffix = SLOT_NAMES
                .into_iter()
                .find(|s| *s == suffix)
                .ok_or_else(|| Error::InvalidParameter(format!("unknown optimizer state `{key}`")))?;
            state.entry(name.to_string()).or_default().insert(suffix, a.clone());
        }
        let mut names: Vec<&String> = state.keys().collect();
        names.sort();
        for name in names {
            let saved: Vec<&str> = state[name].keys().copied().collect();
            if !self.fits(&saved) {
                return Err(Error::InvalidParameter(format!(
                    "the saved optimizer state of `{name}` ({}) is not what this optimizer keeps: was it saved by another optimizer, or with other settings?",
                    saved.join(", ")
                )));
            }
        }
        self.state = state;
        self.step = step;
        Ok(())
    }
}

/// `(p, g, m, v, c1, c2) → (p − (m'·c1) / (√v'·c2 + eps), m', v')` with `m' = β₁m + (1−β₁)g` and
/// `v' = β₂v + (1−β₂)g²`: Adam's update of one parameter (`c1 = lr`, `c2 = 1` without bias
/// correction), run op by op or compiled by [`fused_adam`]. `g` is first cast to `p`'s dtype; with
/// `copy`, the new value cast to it is a fourth output.
fn adam_update(x: &[Array], (b1, b2): (f32, f32), eps: f32, copy: Option<Dtype>) -> rmlx::Result<Vec<Array>> {
    let (p, m0, v0, c1, c2) = (&x[0], &x[2], &x[3], &x[4], &x[5]);
    let g = &x[1].astype(p.dtype())?;
    let m = ((m0 * b1)? + (g * (1.0 - b1))?)?;
    let v = ((v0 * b2)? + (ops::square(g)? * (1.0 - b2))?)?;
    let new = (p - ((&m * c1)? / ((v.sqrt()? * c2)? + eps)?)?)?;
    let copied = copy.map(|d| new.astype(d)).transpose()?;
    Ok([new, m, v].into_iter().chain(copied).collect())
}

/// [`adam_update`] compiled, traced once per parameter shape: one fused kernel per parameter. (A
/// shapeless trace broadcasts its scalars at run time, and MLX then splits the update into three
/// kernels: `g(1−β₁)`, `g²(1−β₂)` and the rest.)
fn fused_adam(betas: (f32, f32), eps: f32, copy: Option<Dtype>) -> Compiled {
    compile_with(
        move |x: &[Array]| adam_update(x, betas, eps, copy),
        CompileOptions { shapeless: false, name: Some("adam update".into()) },
    )
}
