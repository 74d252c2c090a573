//! Named parameters: every layer and model lists its arrays under the checkpoint's tensor names
//! (`model.layers.3.self_attn.q_proj.weight`), can have them replaced by name, and hands out its
//! linear layers by path so that adapters can be attached to them.
//!
//! Arrays are listed as the layer keeps them, in the checkpoint's orientation (a dense linear
//! weight is `[out, in]`; quantised ones as `weight`/`scales`/`biases`). One exception: Gemma's
//! norms keep `1 + w` ([`super::RmsNorm::plus_one`]).
//!
//! ```
//! use rmlx_lm::nn::{Module, ModuleExt, RmsNorm};
//! use rmlx::Array;
//! let mut norm = RmsNorm::new(Array::from_slice(&[1.0f32, 1.0], &[2])?, 1e-6);
//! assert_eq!(norm.parameter_names("model.norm"), vec!["model.norm.weight"]);
//! let new = Array::from_slice(&[2.0f32, 3.0], &[2])?;
//! norm.update("model.norm", [("model.norm.weight".to_string(), new)].into_iter().collect())?;
//! assert_eq!(norm.parameters("model.norm")[0].1.to_vec::<f32>()?, vec![2.0, 3.0]);
//! # Ok::<(), rmlx_lm::Error>(())
//! ```

use super::Linear;
use crate::{Error, Result};
use rmlx::Array;
use std::collections::HashMap;

/// What a parameter is for. Training and conversion decide by role (which arrays an adapter run
/// trains, which stay in float32, which belong to a packed weight), never by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// A linear layer's weight (dense, or a quantised one's packed values).
    Weight,
    /// A linear layer's bias.
    Bias,
    /// A normalisation's scale.
    Norm,
    /// The token embedding table (dense, or a quantised one's packed values).
    Embedding,
    /// The scales or biases of a quantised weight or embedding.
    Quantization,
    /// A LoRA adapter's down projection `A` (`…lora_a`, `[in, rank]`).
    LoraA,
    /// A LoRA adapter's up projection `B` (`…lora_b`, `[rank, out]`).
    LoraB,
    /// A DoRA adapter's learned magnitude per output row (`…m`, `[out]`, float32).
    DoraMagnitude,
}

impl Role {
    /// Whether the array belongs to an adapter (LoRA factors, DoRA magnitudes).
    pub fn is_adapter(self) -> bool {
        matches!(self, Role::LoraA | Role::LoraB | Role::DoraMagnitude)
    }
}

/// A layer (or a model) with named parameters.
pub trait Module {
    /// Calls `f` with the full name, the role and the array of every parameter, under `prefix`.
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, Role, &Array));

    /// Calls `f` with the full name of every parameter and the array, which `f` may replace (with
    /// one of the same shape: [`ModuleExt::update`] checks that).
    fn visit_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Array));

    /// Calls `f` with the path and every linear layer (projections, MLP, output head), which `f`
    /// may change (attach an adapter to, say). Layers without linears have nothing to visit.
    fn visit_linears(&mut self, _prefix: &str, _f: &mut dyn FnMut(&str, &mut Linear)) {}
}

/// `prefix.name`, or `name` at the root.
pub fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// Conveniences over [`Module`].
pub trait ModuleExt: Module {
    /// `(name, array)` for every parameter (cheap handles, not copies).
    fn parameters(&self, prefix: &str) -> Vec<(String, Array)> {
        let mut out = Vec::new();
        self.visit(prefix, &mut |name, _, a| out.push((name.to_string(), a.clone())));
        out
    }

    /// `(name, role)` of every parameter, in visiting order.
    fn roles(&self, prefix: &str) -> Vec<(String, Role)> {
        let mut out = Vec::new();
        self.visit(prefix, &mut |name, role, _| out.push((name.to_string(), role)));
        out
    }

    /// The names of every parameter, in visiting order.
    fn parameter_names(&self, prefix: &str) -> Vec<String> {
        let mut out = Vec::new();
        self.visit(prefix, &mut |name, _, _| out.push(name.to_string()));
        out
    }

    /// Replaces the parameters named in `new`; every name must exist and keep its shape. Returns
    /// how many were replaced (all of `new`).
    fn update(&mut self, prefix: &str, mut new: HashMap<String, Array>) -> Result<usize> {
        // Check everything first: a failed update changes nothing.
        let mut shapes = HashMap::new();
        self.visit(prefix, &mut |name, _, a| {
            if new.contains_key(name) {
                shapes.insert(name.to_string(), a.shape().to_vec());
            }
        });
        let mut names: Vec<&String> = new.keys().collect();
        names.sort();
        for name in names {
            match shapes.get(name) {
                None => return Err(Error::InvalidParameter(format!("no parameter named `{name}`"))),
                Some(shape) if shape.as_slice() != new[name].shape() => {
                    return Err(Error::ShapeMismatch {
                        name: name.clone(),
                        expected: shape.clone(),
                        found: new[name].shape().to_vec(),
                    })
                }
                Some(_) => {}
            }
        }
        let mut replaced = 0;
        self.visit_mut(prefix, &mut |name, a| {
            if let Some(v) = new.remove(name) {
                *a = v;
                replaced += 1;
            }
        });
        Ok(replaced)
    }
}

impl<M: Module + ?Sized> ModuleExt for M {}

/// Visits a list of modules as `prefix.0`, `prefix.1`, ...
pub(crate) fn visit_list<M: Module>(items: &[M], prefix: &str, f: &mut dyn FnMut(&str, Role, &Array)) {
    for (i, m) in items.iter().enumerate() {
        m.visit(&join(prefix, &i.to_string()), f);
    }
}

/// [`visit_list`], mutably.
pub(crate) fn visit_list_mut<M: Module>(items: &mut [M], prefix: &str, f: &mut dyn FnMut(&str, &mut Array)) {
    for (i, m) in items.iter_mut().enumerate() {
        m.visit_mut(&join(prefix, &i.to_string()), f);
    }
}

/// [`Module::visit_linears`] over a list.
pub(crate) fn visit_list_linears<M: Module>(items: &mut [M], prefix: &str, f: &mut dyn FnMut(&str, &mut Linear)) {
    for (i, m) in items.iter_mut().enumerate() {
        m.visit_linears(&join(prefix, &i.to_string()), f);
    }
}
