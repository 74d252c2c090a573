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

use super::{Linear, SwitchLinear};
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

    /// Calls `f` with the path and every layer of stacked experts (a mixture of experts'
    /// `switch_mlp.{gate,up,down}_proj`), which `f` may change (attach an adapter to).
    fn visit_switches(&mut self, _prefix: &str, _f: &mut dyn FnMut(&str, &mut SwitchLinear)) {}
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

/// A list of modules, visited as `prefix.0`, `prefix.1`, … (a model's blocks).
impl<M: Module> Module for Vec<M> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, Role, &Array)) {
        for (i, m) in self.iter().enumerate() {
            m.visit(&join(prefix, &i.to_string()), f);
        }
    }

    fn visit_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Array)) {
        for (i, m) in self.iter_mut().enumerate() {
            m.visit_mut(&join(prefix, &i.to_string()), f);
        }
    }

    fn visit_linears(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Linear)) {
        for (i, m) in self.iter_mut().enumerate() {
            m.visit_linears(&join(prefix, &i.to_string()), f);
        }
    }

    fn visit_switches(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut SwitchLinear)) {
        for (i, m) in self.iter_mut().enumerate() {
            m.visit_switches(&join(prefix, &i.to_string()), f);
        }
    }
}

/// A module a checkpoint may leave out (Qwen 3's q/k norms, an untied output head): visited when
/// present.
impl<M: Module> Module for Option<M> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, Role, &Array)) {
        if let Some(m) = self {
            m.visit(prefix, f);
        }
    }

    fn visit_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Array)) {
        if let Some(m) = self {
            m.visit_mut(prefix, f);
        }
    }

    fn visit_linears(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Linear)) {
        if let Some(m) = self {
            m.visit_linears(prefix, f);
        }
    }

    fn visit_switches(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut SwitchLinear)) {
        if let Some(m) = self {
            m.visit_switches(prefix, f);
        }
    }
}

/// Implements [`Module`] for a struct from one list of its fields that hold parameters, each under
/// the name its tensors have in checkpoints (the field's own name unless one is given):
/// [`Module::visit`], [`Module::visit_mut`] and [`Module::visit_linears`] all walk that list, so
/// the names the three see cannot drift apart. A field is a module, an `Option` of one (visited
/// when present) or a `Vec` of them (`name.0`, `name.1`, …). With `on_change`, the closure runs on
/// the struct before each walk that may change it (a model forgetting its captured step). A
/// generic struct names its one type parameter and bound first (`<B: DecoderBlock> Decoder<B>`).
///
/// ```ignore
/// module_fields!(GatedMlp { gate: "gate_proj", up: "up_proj", down: "down_proj" });
/// module_fields!(Model { embed_tokens: "model.embed_tokens", layers: BLOCKS, norm: "model.norm", lm_head },
///                on_change: |m: &mut Model| m.steps.forget());
/// ```
macro_rules! module_fields {
    (@impl [$($generics:tt)*] $ty:ty { $($field:ident $(: $name:expr)?),* } $(, on_change: $changed:expr)?) => {
        impl<$($generics)*> $crate::nn::Module for $ty {
            fn visit(&self, p: &str, f: &mut dyn FnMut(&str, $crate::nn::Role, &rmlx::Array)) {
                $($crate::nn::Module::visit(
                    &self.$field, &$crate::nn::join(p, $crate::nn::module_fields!(@name $field $($name)?)), f);)*
            }

            fn visit_mut(&mut self, p: &str, f: &mut dyn FnMut(&str, &mut rmlx::Array)) {
                $(($changed)(&mut *self);)?
                $($crate::nn::Module::visit_mut(
                    &mut self.$field, &$crate::nn::join(p, $crate::nn::module_fields!(@name $field $($name)?)), f);)*
            }

            fn visit_linears(&mut self, p: &str, f: &mut dyn FnMut(&str, &mut $crate::nn::Linear)) {
                $(($changed)(&mut *self);)?
                $($crate::nn::Module::visit_linears(
                    &mut self.$field, &$crate::nn::join(p, $crate::nn::module_fields!(@name $field $($name)?)), f);)*
            }

            fn visit_switches(&mut self, p: &str, f: &mut dyn FnMut(&str, &mut $crate::nn::SwitchLinear)) {
                $(($changed)(&mut *self);)?
                $($crate::nn::Module::visit_switches(
                    &mut self.$field, &$crate::nn::join(p, $crate::nn::module_fields!(@name $field $($name)?)), f);)*
            }
        }
    };
    (<$g:ident: $bound:path> $ty:ty { $($field:ident $(: $name:expr)?),* $(,)? } $(, on_change: $changed:expr)? $(,)?) => {
        $crate::nn::module_fields!(@impl [$g: $bound] $ty { $($field $(: $name)?),* } $(, on_change: $changed)?);
    };
    (@name $field:ident $name:expr) => {
        $name
    };
    (@name $field:ident) => {
        stringify!($field)
    };
    ($ty:ty { $($field:ident $(: $name:expr)?),* $(,)? } $(, on_change: $changed:expr)? $(,)?) => {
        $crate::nn::module_fields!(@impl [] $ty { $($field $(: $name)?),* } $(, on_change: $changed)?);
    };
}
pub(crate) use module_fields;

#[cfg(test)]
mod tests {
    use super::{Module, ModuleExt};
    use crate::nn::RmsNorm;
    use rmlx::Array;

    struct Toy {
        norms: Vec<RmsNorm>,
        extra: Option<RmsNorm>,
        missing: Option<RmsNorm>,
        last: RmsNorm,
        changed: usize,
    }

    module_fields!(Toy { norms: "model.norms", extra, missing, last: "final" }, on_change: |t: &mut Toy| t.changed += 1);

    fn norm(v: f32) -> RmsNorm {
        RmsNorm::new(Array::from_slice(&[v, v], &[2]).unwrap(), 1e-6)
    }

    #[test]
    fn module_fields_walks_lists_options_and_renamed_fields_alike() {
        let mut toy = Toy {
            norms: vec![norm(1.0), norm(2.0)],
            extra: Some(norm(3.0)),
            missing: None,
            last: norm(4.0),
            changed: 0,
        };
        let want = ["p.model.norms.0.weight", "p.model.norms.1.weight", "p.extra.weight", "p.final.weight"];
        assert_eq!(toy.parameter_names("p"), want);
        let mut mutated = Vec::new();
        toy.visit_mut("p", &mut |n, a| {
            mutated.push(n.to_string());
            *a = Array::from_slice(&[9.0f32, 9.0], &[2]).unwrap();
        });
        assert_eq!(mutated, want);
        assert_eq!(toy.parameters("")[2].1.to_vec::<f32>().unwrap(), [9.0, 9.0]);
        let mut linears = 0;
        toy.visit_linears("p", &mut |_, _| linears += 1);
        assert_eq!((linears, toy.changed), (0, 2), "norms hold no linear; both mutable walks ran on_change");
    }
}
