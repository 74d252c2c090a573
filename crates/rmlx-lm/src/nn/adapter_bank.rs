//! LoRA adapters chosen per row of a batch, for serving several fine-tunes of one base model at
//! once: each row of a forward pass adds the low-rank change of its own adapter (or none), with
//! the base weights shared and untouched.
//!
//! An [`AdapterBank`] holds, for every adapted layer, the factors of all its adapters stacked:
//! `A: [slots, in, r]` and `B: [slots, r, out]` with the scale folded into `B`, smaller ranks
//! padded with zeros and slot 0 all zeros (no adapter). Inside [`with_row_adapters`], every
//! [`super::Linear`] of a model run on this thread gathers its rows' factors and adds
//! `(x A[slot]) B[slot]`; when all rows share one slot it takes that slot's factors directly.
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
use rmlx::{ops, Array};
use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::rc::Rc;

/// One layer's stacked factors.
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
}

impl AdapterBank {
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
        let layers: BTreeSet<&String> = self.slots.iter().flatten().flat_map(|(_, l)| l.keys()).collect();
        let mut stacks = HashMap::new();
        for layer in layers {
            let loras: Vec<Option<&Lora>> =
                self.slots.iter().map(|s| s.as_ref().and_then(|(_, l)| l.get(layer))).collect();
            let first = loras.iter().flatten().next().expect("a layer named by some adapter");
            let (input, output, dtype) = (first.a.shape()[0], first.b.shape()[1], first.a.dtype());
            let rank = loras.iter().flatten().map(|l| l.rank()).max().unwrap_or(1);
            let (mut a_rows, mut b_rows) = (vec![ops::zeros(&[1, input, rank], dtype)?], vec![]);
            b_rows.push(ops::zeros(&[1, rank, output], dtype)?);
            for lora in &loras {
                let (a, b) = match lora {
                    Some(l) => {
                        if l.a.shape()[0] != input || l.b.shape()[1] != output {
                            return Err(Error::InvalidParameter(format!(
                                "the adapters of `{layer}` disagree on its shape: {:?} against {input} → {output}",
                                (l.a.shape(), l.b.shape())
                            )));
                        }
                        let pad = rank - l.rank();
                        let a = with_zeros(&l.a.astype(dtype)?, 1, pad)?;
                        let b = with_zeros(&(&l.b * l.scale)?.astype(dtype)?, 0, pad)?;
                        (a, b)
                    }
                    None => (ops::zeros(&[input, rank], dtype)?, ops::zeros(&[rank, output], dtype)?),
                };
                a_rows.push(a.reshape(&[1, input, rank])?);
                b_rows.push(b.reshape(&[1, rank, output])?);
            }
            let a = ops::concatenate(&a_rows.iter().collect::<Vec<_>>(), 0)?;
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

/// The rows' slots while [`with_row_adapters`] runs.
struct Rows {
    stacks: Rc<HashMap<String, Stack>>,
    /// One slot for every row, or the slots `[B]` as an int32 array.
    choice: Choice,
}

enum Choice {
    All(i32),
    PerRow(Array),
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
    let rows = match slots {
        _ if bank.stacks.is_empty() || slots.iter().all(|&s| s == 0) => None,
        [first, rest @ ..] if rest.iter().all(|s| s == first) => {
            Some(Rows { stacks: bank.stacks.clone(), choice: Choice::All(*first as i32) })
        }
        _ => {
            let ids: Vec<i32> = slots.iter().map(|&s| s as i32).collect();
            let ids = Array::from_slice(&ids, &[ids.len() as i32])?;
            Some(Rows { stacks: bank.stacks.clone(), choice: Choice::PerRow(ids) })
        }
    };
    let _restore = Restore(ROWS.with(|r| r.replace(rows)));
    Ok(f())
}

/// The adapters' change to layer `path`'s output for `x: [B, L, in]`, when rows carry adapters.
pub(super) fn row_adapters(path: &str, x: &Array) -> Result<Option<Array>> {
    ROWS.with(|r| {
        let rows = r.borrow();
        let Some(rows) = rows.as_ref() else { return Ok(None) };
        let Some(stack) = rows.stacks.get(path) else { return Ok(None) };
        let z = match &rows.choice {
            Choice::All(slot) => {
                let pick = |s: &Array| s.slice_axis(0, *slot, slot + 1, 1)?.reshape(&s.shape()[1..]);
                x.matmul(&pick(&stack.a)?.astype(x.dtype())?)?.matmul(&pick(&stack.b)?.astype(x.dtype())?)?
            }
            Choice::PerRow(ids) => {
                // [B, in, r] and [B, r, out]: one matrix pair per row, broadcast over positions.
                let (a, b) = (stack.a.take(ids, Some(0))?, stack.b.take(ids, Some(0))?);
                let (a, b) = (a.astype(x.dtype())?, b.astype(x.dtype())?);
                match x.ndim() {
                    3 => x.matmul(&a)?.matmul(&b)?,
                    n => {
                        return Err(Error::InvalidParameter(format!(
                            "per-row adapters need [B, L, in] inputs, not {n} axes"
                        )))
                    }
                }
            }
        };
        Ok(Some(z))
    })
}
