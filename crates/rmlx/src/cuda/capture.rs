//! A graph of launches read back once and replayed as one launch.
//!
//! When every operation between some arrays and a result is a [`CudaLaunch`] (a decoding step's
//! layers, say), MLX still makes one node of its graph per launch and the caller builds every
//! array in between, at every call. [`capture`] reads back the lazy graph computing `result` from
//! the arrays that change from call to call (`varying`) before it is evaluated, and merges its
//! launches into one: every kernel in an order the graph allows, the arrays that depend on no
//! varying one (weights) and the launches' intermediate outputs held by the [`Captured`] (the
//! intermediates in scratch buffers of its own, one buffer serving several outputs once their last
//! reader has run) and passed to the kernels by address, the varying arrays as its inputs.
//! [`Captured::call`] then runs the same kernels, with the same arguments but for the new varying
//! arrays and values, as one operation whose only output is the result: the same results bit for
//! bit, without the graph, at the host cost of one operation.
//!
//! A varying array that a launch updates in place ([`InPlace::Owned`](super::InPlace::Owned): a
//! KV cache) stays an input, updated in its buffer, with no new array made for it: its handles
//! see the update. MLX orders the replay after the work that made its inputs, and launches its
//! graph right after the replay's kernels, so that operations added later run after them on the
//! stream; operations already in that graph that read such an array are not waited for (the
//! caller's to avoid: a decoding step's caches are read by nothing else in its evaluation).
//!
//! A reshape is read as its input's buffer. Any other operation that depends on a varying array,
//! an in-place update of an array that is not varying (or not the caller's),
//! or a call value that is not among the capture's `values` makes [`capture`] refuse it (saying
//! which): the caller evaluates its graph as it is.

use super::{value_bits, CudaLaunch};
use crate::array::arrays_of;
use crate::{Array, Dtype, Error, Result};
use rmlx_sys::cuda::cffi;
use std::collections::HashMap;

/// Where an array of the captured graph lives in the merged launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    /// Varying array `i` (or its update in place).
    Varying(usize),
    /// Constant `i`: an array that depends on no varying one.
    Constant(usize),
    /// Intermediate output `i` of a launch.
    Scratch(usize),
}

/// One launch of the captured graph: what it runs and where its inputs and outputs live.
struct Call {
    node: cffi::GraphNode,
    inputs: Vec<Slot>,
    outputs: Vec<Slot>,
}

/// An intermediate output: its size, the call making it and the last call reading it.
struct Scratch {
    bytes: usize,
    made: usize,
    last_read: usize,
}

/// The graph read back from `result` towards the varying arrays.
#[derive(Default)]
struct Walk {
    varying: HashMap<usize, usize>,
    seen: HashMap<usize, Slot>,
    constants: Vec<Array>,
    scratch: Vec<Scratch>,
    calls: Vec<Call>,
    /// Why the graph cannot be captured, once found.
    refusal: String,
}

impl Walk {
    /// The slot of `a`, or `None` where the graph cannot be captured.
    fn visit(&mut self, a: &Array) -> Option<Slot> {
        let id = a.id();
        if let Some(&slot) = self.seen.get(&id) {
            return Some(slot);
        }
        if let Some(&v) = self.varying.get(&id) {
            return Some(Slot::Varying(v));
        }
        let node = crate::lock::locked(|| cffi::graph_node(a.raw()));
        let slot = match node.kind {
            0 => self.constant(a),
            1 => return self.launch(a, node),
            _ => {
                let inputs = crate::lock::locked(|| arrays_of(&cffi::node_inputs(a.raw())));
                let slots: Vec<Slot> = inputs.iter().map(|i| self.visit(i)).collect::<Option<_>>()?;
                match (node.kind, slots.as_slice()) {
                    (_, s) if s.iter().all(|s| matches!(s, Slot::Constant(_))) => self.constant(a),
                    (2, &[inner]) => inner,
                    _ => return self.refuse(format!("a {} operation reads a varying array", node.name)),
                }
            }
        };
        self.seen.insert(id, slot);
        Some(slot)
    }

    fn refuse(&mut self, why: String) -> Option<Slot> {
        if self.refusal.is_empty() {
            self.refusal = why;
        }
        None
    }

    fn constant(&mut self, a: &Array) -> Slot {
        self.constants.push(a.clone());
        Slot::Constant(self.constants.len() - 1)
    }

    /// A launch's output `a`: its inputs first, then every output of the launch.
    fn launch(&mut self, a: &Array, node: cffi::GraphNode) -> Option<Slot> {
        let inputs = crate::lock::locked(|| arrays_of(&cffi::node_inputs(a.raw())));
        let slots: Vec<Slot> = inputs.iter().map(|i| self.visit(i)).collect::<Option<_>>()?;
        if slots.iter().all(|s| matches!(s, Slot::Constant(_))) {
            let slot = self.constant(a);
            self.seen.insert(a.id(), slot);
            return Some(slot);
        }
        let call = self.calls.len();
        for slot in &slots {
            if let Slot::Scratch(s) = *slot {
                self.scratch[s].last_read = call;
            }
        }
        let outputs = crate::lock::locked(|| arrays_of(&cffi::node_outputs(a.raw())));
        let mut out_slots = Vec::with_capacity(outputs.len());
        for (j, out) in outputs.iter().enumerate() {
            let slot = match *node.aliases.get(j)? {
                alias if alias >= 0 => match *slots.get(alias as usize)? {
                    // Only the caller's own arrays may be updated in place.
                    Slot::Varying(v) if node.owned[j] => Slot::Varying(v),
                    _ => return self.refuse(format!("{} updates in place an array not the caller's", node.name)),
                },
                _ => {
                    self.scratch.push(Scratch { bytes: out.nbytes(), made: call, last_read: call });
                    Slot::Scratch(self.scratch.len() - 1)
                }
            };
            self.seen.insert(out.id(), slot);
            out_slots.push(slot);
        }
        let slot = *out_slots.get(node.output as usize)?;
        self.calls.push(Call { node, inputs: slots, outputs: out_slots });
        Some(slot)
    }
}

/// The launches computing an array, merged into one launch that runs again over new varying
/// arrays (see the module docs).
pub struct Captured {
    launch: CudaLaunch,
    /// The constants and scratch buffers whose addresses the kernels take, kept alive.
    _held: Vec<Array>,
    /// Shape and dtype of each varying array, which every call's must match.
    varying: Vec<(Vec<i32>, Dtype)>,
    kernels: usize,
    scratch_bytes: usize,
}

/// What [`capture`] made of a graph: its launches merged, or why they cannot be.
pub enum Capture {
    Captured(Captured),
    /// Why not: the operation that is not a launch, say.
    Refused(String),
}

/// Reads back the graph computing `result` from `varying` (see the module docs) and merges it into
/// one launch named `name`, or says why it cannot (an operation that is not a launch). Every call value of
/// its launches must be one of `values` (scalars, as [`CudaLaunch::call_with`] takes them); a
/// replay's values take their places. The arrays that depend on no varying one are evaluated here;
/// `result` is not.
pub fn capture(name: &str, result: &Array, varying: &[&Array], values: &[super::KernelArg]) -> Result<Capture> {
    let value_bits: Vec<u64> = values.iter().map(|v| value_bits(name, v)).collect::<Result<_>>()?;
    let mut walk = Walk { varying: varying.iter().enumerate().map(|(i, a)| (a.id(), i)).collect(), ..Walk::default() };
    let result_slot = match walk.visit(result) {
        Some(Slot::Scratch(s)) if walk.scratch[s].bytes == result.nbytes() => s,
        Some(_) => return Ok(Capture::Refused("the result is not a launch's output".into())),
        None => return Ok(Capture::Refused(walk.refusal)),
    };
    let (sizes, buffer_of) = allocate(&walk.scratch, result_slot);
    // The constants and scratch buffers, evaluated, are held by the capture and their addresses
    // written into the kernels' arguments.
    let mut fixed = walk.constants;
    let constants = fixed.len();
    for &bytes in &sizes {
        let len = i32::try_from(bytes)
            .map_err(|_| Error::InvalidArgument(format!("capture `{name}`: a scratch buffer of {bytes} bytes")))?;
        fixed.push(crate::ops::zeros(&[len.max(1)], Dtype::Uint8)?);
    }
    crate::eval(&fixed)?;
    let addresses: Vec<u64> = crate::lock::locked(|| {
        fixed.iter().map(|a| cffi::cuda_device_address(a.raw())).collect::<std::result::Result<_, _>>()
    })?;

    let arg_of = |slot: Slot| -> (u8, u32, u64) {
        match slot {
            Slot::Varying(v) => (0, v as u32, 0),
            Slot::Constant(c) => (3, 0, addresses[c]),
            Slot::Scratch(s) if s == result_slot => (1, 0, 0),
            Slot::Scratch(s) => (3, 0, addresses[constants + buffer_of[s]]),
        }
    };
    let (mut nodes, mut args) = (Vec::new(), Vec::new());
    for call in &walk.calls {
        for n in &call.node.nodes {
            let first_arg = args.len() as u32;
            for arg in &call.node.args[n.first_arg as usize..(n.first_arg + n.arg_count) as usize] {
                let (kind, index, bits) = match arg.kind {
                    0 => arg_of(call.inputs[arg.index as usize]),
                    1 => arg_of(call.outputs[arg.index as usize]),
                    4 => {
                        let bits = call.node.values[arg.index as usize];
                        match value_bits.iter().position(|&b| b == bits) {
                            Some(i) => (4, i as u32, 0),
                            None => {
                                let why = format!("{} takes a call value not among the capture's", call.node.name);
                                return Ok(Capture::Refused(why));
                            }
                        }
                    }
                    kind => (kind, 0, arg.bits),
                };
                args.push(cffi::KernelArg { kind, index, bits });
            }
            nodes.push(cffi::KernelNode { first_arg, ..n.clone() });
        }
    }
    let output =
        cffi::LaunchOutput { shape: result.shape().to_vec(), dtype: result.dtype() as u8, alias: -1, owned: false };
    let launch = CudaLaunch::committing(name, nodes, args, vec![output], varying.len(), values.len())?;
    Ok(Capture::Captured(Captured {
        kernels: launch.kernels(),
        launch,
        _held: fixed,
        varying: varying.iter().map(|a| (a.shape().to_vec(), a.dtype())).collect(),
        scratch_bytes: sizes.iter().sum(),
    }))
}

/// Buffers for the intermediate outputs (all but `result`), each reused once the last reader of
/// the output it held has run: the buffers' sizes, and each output's buffer.
fn allocate(scratch: &[Scratch], result: usize) -> (Vec<usize>, Vec<usize>) {
    let calls = scratch.iter().map(|s| s.last_read.max(s.made) + 1).max().unwrap_or(0);
    let (mut sizes, mut buffer_of, mut free) = (Vec::new(), vec![usize::MAX; scratch.len()], Vec::<usize>::new());
    for call in 0..calls {
        for (s, info) in scratch.iter().enumerate() {
            if info.made != call || s == result {
                continue;
            }
            // The smallest free buffer that fits, else a new one.
            let fit = free.iter().enumerate().filter(|(_, &b)| sizes[b] >= info.bytes).min_by_key(|(_, &b)| sizes[b]);
            buffer_of[s] = match fit.map(|(i, _)| i) {
                Some(i) => free.swap_remove(i),
                None => {
                    sizes.push(info.bytes);
                    sizes.len() - 1
                }
            };
        }
        for (s, info) in scratch.iter().enumerate() {
            if info.last_read.max(info.made) == call && s != result {
                free.push(buffer_of[s]);
            }
        }
    }
    (sizes, buffer_of)
}

impl Captured {
    /// The captured kernels over new `varying` arrays (of the captured ones' shapes and dtypes) and
    /// `values` (in [`capture`]'s order), as one operation: its result. The varying arrays that the
    /// kernels update in place are updated in their buffers (see the module docs).
    pub fn call(&self, varying: &[&Array], values: &[super::KernelArg]) -> Result<Array> {
        let fits = varying.len() == self.varying.len()
            && varying.iter().zip(&self.varying).all(|(a, (shape, dtype))| a.shape() == shape && a.dtype() == *dtype);
        if !fits {
            return Err(Error::InvalidArgument(format!(
                "captured launch `{}`: the varying arrays differ from the captured ones",
                self.launch.name
            )));
        }
        let inputs: Vec<Array> = varying.iter().map(|a| (*a).clone()).collect();
        Ok(self.launch.call_with(&inputs, values)?.remove(0))
    }

    /// The kernels a call runs.
    pub fn kernels(&self) -> usize {
        self.kernels
    }

    /// The bytes of the scratch buffers held for intermediate outputs.
    pub fn scratch_bytes(&self) -> usize {
        self.scratch_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(bytes: usize, made: usize, last_read: usize) -> Scratch {
        Scratch { bytes, made, last_read }
    }

    /// Outputs share a buffer only once the earlier one's last reader has run, never with an
    /// input of the call making them, and the result takes none.
    #[test]
    fn buffers_are_reused_after_their_last_reader() {
        // Call 0 makes a (read by 1) and b (read by 2); call 1 makes c (read by 2); call 2 makes
        // d (read by 3) and the result is made by 3.
        let s = [scratch(100, 0, 1), scratch(50, 0, 2), scratch(80, 1, 2), scratch(100, 2, 3), scratch(10, 3, 3)];
        let (sizes, of) = allocate(&s, 4);
        assert_eq!(of[4], usize::MAX, "the result has no buffer");
        assert_ne!(of[0], of[1]);
        assert!(of[2] != of[0] && of[2] != of[1], "c is made while a is still read");
        assert!(of[3] != of[1] && of[3] != of[2], "d is made by the call reading b and c");
        assert_eq!(of[3], of[0], "a's buffer is free again after call 1");
        assert_eq!(sizes, [100, 50, 80]);
        // An output nobody reads frees its buffer after its own call.
        let (sizes, of) = allocate(&[scratch(64, 0, 0), scratch(64, 1, 1)], 9);
        assert_eq!((sizes, of[0] == of[1]), (vec![64], true));
    }
}
