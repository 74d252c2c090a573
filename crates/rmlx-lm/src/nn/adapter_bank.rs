//! LoRA adapters chosen per row of a batch, for serving several fine-tunes of one base model at
//! once: each row of a forward pass adds the low-rank change of its own adapter (or none), with
//! the base weights shared and untouched.
//!
//! An [`AdapterBank`] holds, for every adapted layer, the factors of all its adapters side by
//! side: `A: [in, slots·R]` and `B: [slots·R, out]`, with the scale folded into `B`, every rank
//! padded with zeros to the largest `R`, and zeros where an adapter leaves the layer alone. Inside
//! [`with_row_adapters`], every [`super::Linear`] of a model run on this thread adds
//! `((x A) ⊙ m) B`, where the mask `m: [B, 1, slots·R]` (made once per forward pass) keeps each
//! row's own slot's `R` columns: two plain matmuls and a product per layer, for any mix of rows.
//!
//! ```
//! use rmlx::{Array, Dtype};
//! use rmlx_lm::nn::{AdapterBank, Lora};
//! use std::collections::HashMap;
//! let lora = Lora::init(4, 3, 2, 1.0, Dtype::Float32, Some(&rmlx::random::key(0)?))?;
//! let mut bank = AdapterBank::default();
//! let slot = bank.insert("tuned", HashMap::from([("model.layers.0.mlp.up_proj".to_string(), lora)]))?;
//! assert_eq!((slot, bank.slot("tuned"), bank.names()), (1, Some(1), vec!["tuned".to_string()]));
//! assert!(bank.insert("tuned", HashMap::new()).is_err()); // names are unique
//! bank.remove("tuned")?;
//! assert!(bank.is_empty());
//! # Ok::<(), rmlx_lm::Error>(())
//! ```

use super::Lora;
use crate::{Error, Result};
use rmlx::{ops, Array, Dtype};
use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::rc::Rc;

/// One layer's factors, side by side: `a: [in, slots·R]`, `b: [slots·R, out]`.
#[derive(Clone)]
struct Stack {
    a: Array,
    b: Array,
}

/// Named adapters, each in a slot (1, 2, …) that stays its own until it is removed.
#[derive(Default)]
pub struct AdapterBank {
    /// Slot `i + 1`: the adapter's name and its layers' factors (`None`: a free slot).
    slots: Vec<Option<(String, HashMap<String, Lora>)>>,
    stacks: Rc<HashMap<String, Stack>>,
    /// The largest rank: each slot's width in the stacks.
    rank: i32,
    /// The dtype the stacks are kept in (`None`: the factors' own).
    dtype: Option<Dtype>,
}

impl AdapterBank {
    /// An empty bank keeping its factors in `dtype` (the model's compute dtype, so that no cast
    /// runs per layer and step).
    pub fn new(dtype: Dtype) -> AdapterBank {
        AdapterBank { dtype: Some(dtype), ..AdapterBank::default() }
    }

    /// Adds an adapter (layer name → factors, as [`super::Linear::lora`] holds them) and returns
    /// its slot. DoRA adapters are refused: their output scaling is per weight, not per row.
    pub fn insert(&mut self, name: &str, layers: HashMap<String, Lora>) -> Result<usize> {
        if self.slot(name).is_some() {
            return Err(Error::InvalidParameter(format!("an adapter named `{name}` is loaded already")));
        }
        if layers.values().any(|l| l.magnitude.is_some()) {
            return Err(Error::InvalidParameter(format!(
                "`{name}` is a DoRA adapter: it cannot be chosen per request (fuse it into the model instead)"
            )));
        }
        let entry = Some((name.to_string(), layers));
        let slot = match self.slots.iter().position(Option::is_none) {
            Some(free) => {
                self.slots[free] = entry;
                free + 1
            }
            None => {
                self.slots.push(entry);
                self.slots.len()
            }
        };
        self.restack()?;
        Ok(slot)
    }

    /// Removes the adapter named `name`; its slot may be reused by a later [`AdapterBank::insert`].
    pub fn remove(&mut self, name: &str) -> Result<()> {
        let slot = self.slot(name).ok_or_else(|| Error::InvalidParameter(format!("no adapter named `{name}`")))?;
        self.slots[slot - 1] = None;
        while matches!(self.slots.last(), Some(None)) {
            self.slots.pop();
        }
        self.restack()
    }

    /// The slot of the adapter named `name`.
    pub fn slot(&self, name: &str) -> Option<usize> {
        self.slots.iter().position(|s| s.as_ref().is_some_and(|(n, _)| n == name)).map(|i| i + 1)
    }

    /// The adapters' names, in slot order.
    pub fn names(&self) -> Vec<String> {
        self.slots.iter().flatten().map(|(n, _)| n.clone()).collect()
    }

    /// Whether no adapter is loaded.
    pub fn is_empty(&self) -> bool {
        self.slots.iter().all(Option::is_none)
    }

    /// Rebuilds every layer's stacks from the slots.
    fn restack(&mut self) -> Result<()> {
        let adapters = || self.slots.iter().flatten().flat_map(|(_, l)| l.values());
        self.rank = adapters().map(Lora::rank).max().unwrap_or(0);
        let layers: BTreeSet<&String> = self.slots.iter().flatten().flat_map(|(_, l)| l.keys()).collect();
        let mut stacks = HashMap::new();
        for layer in layers {
            let loras: Vec<Option<&Lora>> =
                self.slots.iter().map(|s| s.as_ref().and_then(|(_, l)| l.get(layer))).collect();
            let first = loras.iter().flatten().next().expect("a layer named by some adapter");
            let (input, output) = (first.a.shape()[0], first.b.shape()[1]);
            let dtype = self.dtype.unwrap_or(first.a.dtype());
            let (mut a_cols, mut b_rows) = (Vec::new(), Vec::new());
            for lora in &loras {
                let (a, b) = match lora {
                    Some(l) => {
                        if l.a.shape()[0] != input || l.b.shape()[1] != output {
                            return Err(Error::InvalidParameter(format!(
                                "the adapters of `{layer}` disagree on its shape: {:?} against {input} → {output}",
                                (l.a.shape(), l.b.shape())
                            )));
                        }
                        let pad = self.rank - l.rank();
                        let a = with_zeros(&l.a.astype(dtype)?, 1, pad)?;
                        let b = with_zeros(&(&l.b * l.scale)?.astype(dtype)?, 0, pad)?;
                        (a, b)
                    }
                    None => (ops::zeros(&[input, self.rank], dtype)?, ops::zeros(&[self.rank, output], dtype)?),
                };
                a_cols.push(a);
                b_rows.push(b);
            }
            let a = ops::concatenate(&a_cols.iter().collect::<Vec<_>>(), 1)?;
            let b = ops::concatenate(&b_rows.iter().collect::<Vec<_>>(), 0)?;
            rmlx::eval([&a, &b])?;
            stacks.insert(layer.clone(), Stack { a, b });
        }
        self.stacks = Rc::new(stacks);
        Ok(())
    }
}

/// `a` with `n` rows (axis 0) or columns (axis 1) of zeros added: a smaller rank padded.
fn with_zeros(a: &Array, axis: i32, n: i32) -> Result<Array> {
    if n == 0 {
        return Ok(a.clone());
    }
    let mut shape = a.shape().to_vec();
    shape[axis as usize] = n;
    Ok(ops::concatenate(&[a, &ops::zeros(&shape, a.dtype())?], axis)?)
}

/// The rows' adapters while [`with_row_adapters`] runs.
struct Rows {
    stacks: Rc<HashMap<String, Stack>>,
    /// `[B, 1, slots·R]`: 1 on each row's own slot's columns.
    mask: Array,
}

thread_local! {
    static ROWS: RefCell<Option<Rows>> = const { RefCell::new(None) };
}

/// Runs `f` with row `i` of every batch that a model computes on this thread using the adapter in
/// slot `slots[i]` of `bank` (0: none). A model run over one sequence takes `slots` of length 1.
pub fn with_row_adapters<T>(bank: &AdapterBank, slots: &[usize], f: impl FnOnce() -> T) -> Result<T> {
    struct Restore(Option<Rows>);
    impl Drop for Restore {
        fn drop(&mut self) {
            ROWS.with(|r| r.replace(self.0.take()));
        }
    }
    if let Some(slot) = slots.iter().find(|&&s| s > bank.slots.len() || (s > 0 && bank.slots[s - 1].is_none())) {
        return Err(Error::InvalidParameter(format!("no adapter in slot {slot}")));
    }
    let rows = if bank.stacks.is_empty() || slots.iter().all(|&s| s == 0) {
        None
    } else {
        let (width, rank) = (bank.slots.len() * bank.rank as usize, bank.rank as usize);
        let mut mask = vec![0f32; slots.len() * width];
        for (row, &slot) in slots.iter().enumerate().filter(|(_, &s)| s > 0) {
            let start = row * width + (slot - 1) * rank;
            mask[start..start + rank].fill(1.0);
        }
        let mask = Array::from_slice(&mask, &[slots.len() as i32, 1, width as i32])?;
        let dtype = bank.stacks.values().next().map_or(Dtype::Float32, |s| s.a.dtype());
        Some(Rows { stacks: bank.stacks.clone(), mask: mask.astype(dtype)? })
    };
    let _restore = Restore(ROWS.with(|r| r.replace(rows)));
    Ok(f())
}

/// Whether rows carry adapters for any layer now.
pub(super) fn rows_have_adapters() -> bool {
    ROWS.with(|r| r.borrow().is_some())
}

/// Whether rows carry adapters for layer `path` now.
pub(super) fn has_row_adapters(path: &str) -> bool {
    ROWS.with(|r| r.borrow().as_ref().is_some_and(|rows| rows.stacks.contains_key(path)))
}

/// The adapters' change to layer `path`'s output for `x` (`[B, L, in]`, or its rows `[B·L, in]`),
/// when rows carry adapters.
pub(super) fn row_adapters(path: &str, x: &Array) -> Result<Option<Array>> {
    ROWS.with(|r| {
        let rows = r.borrow();
        let Some(rows) = rows.as_ref() else { return Ok(None) };
        let Some(stack) = rows.stacks.get(path) else { return Ok(None) };
        let batch = rows.mask.shape()[0];
        let s = x.shape();
        let fits = match s.len() {
            3 => s[0] == batch,
            2 => s[0] % batch == 0,
            _ => false,
        };
        if !fits {
            return Err(Error::InvalidParameter(format!(
                "per-row adapters for {batch} sequences need [{batch}, L, in] inputs or their rows, not {s:?}"
            )));
        }
        let x3 = if s.len() == 2 { x.reshape(&[batch, s[0] / batch, s[1]])? } else { x.clone() };
        let z = (x3.matmul(&stack.a.astype(x.dtype())?)? * rows.mask.astype(x.dtype())?)?;
        let y = z.matmul(&stack.b.astype(x.dtype())?)?;
        Ok(Some(if s.len() == 2 { y.reshape(&[s[0], y.shape()[2]])? } else { y }))
    })
}
