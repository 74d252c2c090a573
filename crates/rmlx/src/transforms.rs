//! Function transforms: derivatives ([`vjp`], [`jvp`], [`grad`], [`value_and_grad`]), vectorisation
//! ([`vmap`]), gradient checkpointing ([`checkpoint`]) and functions with their own derivatives
//! ([`custom_vjp`], [`CustomFunction`]). Compilation lives in [`crate::compile`].
//!
//! Transforms take closures over arrays, `Fn(&[Array]) -> Result<Vec<Array>>`. Arrays a closure
//! captures are constants of the function (they get no gradient). An `Err` returned by the closure
//! — or a panic inside it — comes back as the `Err` of the transform call, unchanged.
//!
//! ```
//! use rmlx::{transforms, Array};
//! // d/dx sum(x^2) = 2x
//! let dsq = transforms::grad(|x: &[Array]| (&x[0] * &x[0])?.sum(rmlx::Axes::All, false), &[0]);
//! let x = Array::from_slice(&[1.0f32, -2.0, 3.0], &[3])?;
//! assert_eq!(dsq(&[x])?[0].to_vec::<f32>()?, vec![2.0, -4.0, 6.0]);
//! # Ok::<(), rmlx::Error>(())
//! ```
//!
//! Closures given to [`grad`], [`vjp`] and friends may borrow anything: they run only during the
//! call. [`checkpoint`], [`custom_vjp`] and [`CustomFunction`] keep their closures inside the graphs
//! they build (a later `vjp` calls them), so those closures must be `'static`: they own what they
//! use, and nothing they reference can be freed under them.

use crate::array::{array_vec, arrays_of, from_array_vec as arrays};
use crate::callback::{self, axes_to_i32, returned, returned_mapped, with_borrowed_fn, DynFn};
use crate::device::current;
use crate::{Array, Error, Result};
use rmlx_sys::cxx::UniquePtr;
use rmlx_sys::tffi;
use rmlx_sys::transforms::{JvpFn, VjpFn, VmapFn};
use std::marker::PhantomData;

fn argnums_i32(argnums: &[usize], n_inputs: usize) -> Result<Vec<i32>> {
    if argnums.is_empty() {
        return Err(Error::InvalidArgument("argnums must name at least one input".into()));
    }
    for (i, &a) in argnums.iter().enumerate() {
        if a >= n_inputs {
            return Err(Error::InvalidArgument(format!("argnum {a} is out of range for {n_inputs} inputs")));
        }
        if argnums[..i].contains(&a) {
            return Err(Error::InvalidArgument(format!("argnum {a} is listed twice")));
        }
    }
    Ok(argnums.iter().map(|&a| a as i32).collect())
}

/// The outputs of `f` at `primals` and the vector-Jacobian products of `cotangents` (one per output)
/// with `f`'s Jacobian: one array per primal, shaped like it.
///
/// ```
/// use rmlx::{transforms, Array};
/// let x = Array::from_slice(&[3.0f32], &[1])?;
/// let (out, vjps) = transforms::vjp(|x: &[Array]| Ok(vec![(&x[0] * &x[0])?]), &[x], &[Array::from_slice(&[1.0f32], &[1])?])?;
/// assert_eq!(out[0].to_vec::<f32>()?, vec![9.0]);
/// assert_eq!(vjps[0].to_vec::<f32>()?, vec![6.0]);
/// # Ok::<(), rmlx::Error>(())
/// ```
pub fn vjp<F>(f: F, primals: &[Array], cotangents: &[Array]) -> Result<(Vec<Array>, Vec<Array>)>
where
    F: Fn(&[Array]) -> Result<Vec<Array>>,
{
    let (p, c) = (array_vec(primals), array_vec(cotangents));
    let out = with_borrowed_fn(&f, |cb| callback::call(|| tffi::vjp(cb, &p, &c, current())))?;
    Ok((arrays(&out.outputs), arrays(&out.products)))
}

/// The outputs of `f` at `primals` and the Jacobian-vector products with `tangents` (one per
/// primal): the directional derivative of every output.
pub fn jvp<F>(f: F, primals: &[Array], tangents: &[Array]) -> Result<(Vec<Array>, Vec<Array>)>
where
    F: Fn(&[Array]) -> Result<Vec<Array>>,
{
    let (p, t) = (array_vec(primals), array_vec(tangents));
    let out = with_borrowed_fn(&f, |cb| callback::call(|| tffi::jvp(cb, &p, &t, current())))?;
    Ok((arrays(&out.outputs), arrays(&out.products)))
}

/// A function returning `f`'s outputs and the gradient of its first output (a scalar, the loss)
/// with respect to the inputs listed in `argnums`, in that order. Further outputs of `f` are
/// auxiliary: returned as they are, not differentiated.
///
/// ```
/// use rmlx::{transforms, Array, Axes};
/// // loss = sum(w * x), aux = mean(x); gradient with respect to w only.
/// let f = |a: &[Array]| -> rmlx::Result<Vec<Array>> {
///     Ok(vec![(&a[0] * &a[1])?.sum(Axes::All, false)?, a[1].mean(Axes::All, false)?])
/// };
/// let vg = transforms::value_and_grad(f, &[0]);
/// let w = Array::from_slice(&[1.0f32, 2.0], &[2])?;
/// let x = Array::from_slice(&[3.0f32, 5.0], &[2])?;
/// let (values, grads) = vg(&[w, x])?;
/// assert_eq!(values[0].item::<f32>()?, 13.0);
/// assert_eq!(values[1].item::<f32>()?, 4.0);
/// assert_eq!(grads[0].to_vec::<f32>()?, vec![3.0, 5.0]);
/// # Ok::<(), rmlx::Error>(())
/// ```
pub fn value_and_grad<F>(f: F, argnums: &[usize]) -> impl Fn(&[Array]) -> Result<(Vec<Array>, Vec<Array>)>
where
    F: Fn(&[Array]) -> Result<Vec<Array>>,
{
    let argnums = argnums.to_vec();
    let checked = move |x: &[Array]| {
        let outs = f(x)?;
        if outs.is_empty() {
            return Err(Error::InvalidArgument("the function being differentiated returned no outputs".into()));
        }
        Ok(outs)
    };
    move |inputs: &[Array]| {
        let nums = argnums_i32(&argnums, inputs.len())?;
        // MLX returns the gradients in ascending argnum order.
        let mut sorted = nums.clone();
        sorted.sort_unstable();
        let v = array_vec(inputs);
        let out = with_borrowed_fn(&checked, |cb| callback::call(|| tffi::value_and_grad(cb, &v, &sorted, current())))?;
        let grads = arrays(&out.products);
        let grads = nums.iter().map(|n| grads[sorted.binary_search(n).expect("sorted argnum")].clone()).collect();
        Ok((arrays(&out.outputs), grads))
    }
}

/// A function returning the gradient of `f` (which returns a scalar) with respect to the inputs
/// listed in `argnums`, one array per listed input.
pub fn grad<F>(f: F, argnums: &[usize]) -> impl Fn(&[Array]) -> Result<Vec<Array>>
where
    F: Fn(&[Array]) -> Result<Array>,
{
    let vg = value_and_grad(move |x: &[Array]| Ok(vec![f(x)?]), argnums);
    move |inputs: &[Array]| Ok(vg(inputs)?.1)
}

/// Vectorises `f` over one axis of its inputs: `in_axes[i]` is the mapped axis of input `i`
/// (`None`: not mapped, the same array for every slice; an empty list maps axis 0 of every input),
/// `out_axes[j]` where the mapped axis goes in output `j` (empty: axis 0 of every output).
///
/// ```
/// use rmlx::{transforms, Array};
/// // A dot product mapped over the rows of `a`, with `b` shared.
/// let rowdot = transforms::vmap(|x: &[Array]| Ok(vec![(&x[0] * &x[1])?.sum(rmlx::Axes::All, false)?]), &[Some(0), None], &[]);
/// let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
/// let b = Array::from_slice(&[10.0f32, 1.0], &[2])?;
/// assert_eq!(rowdot(&[a, b])?[0].to_vec::<f32>()?, vec![12.0, 34.0]);
/// # Ok::<(), rmlx::Error>(())
/// ```
pub fn vmap<F>(f: F, in_axes: &[Option<usize>], out_axes: &[usize]) -> impl Fn(&[Array]) -> Result<Vec<Array>>
where
    F: Fn(&[Array]) -> Result<Vec<Array>>,
{
    let ins = axes_to_i32(in_axes);
    let outs: Vec<i32> = out_axes.iter().map(|&a| a as i32).collect();
    move |inputs: &[Array]| {
        if !ins.is_empty() && ins.len() != inputs.len() {
            return Err(Error::InvalidArgument(format!(
                "vmap was given {} in_axes for {} inputs",
                ins.len(),
                inputs.len()
            )));
        }
        let v = array_vec(inputs);
        let out = with_borrowed_fn(&f, |cb| callback::call(|| tffi::vmap(cb, &v, &ins, &outs, current())))?;
        Ok(arrays(&out))
    }
}

/// A function made by a transform that keeps it: [`checkpoint`], [`custom_vjp`], [`CustomFunction`].
/// Call it like the original.
pub struct Function {
    raw: UniquePtr<tffi::ArrayFunction>,
    /// The closures inside need not be `Send`.
    _not_send: PhantomData<*const ()>,
}

impl Function {
    fn new(raw: UniquePtr<tffi::ArrayFunction>) -> Function {
        Function { raw, _not_send: PhantomData }
    }

    /// Applies the function.
    pub fn call(&self, inputs: &[Array]) -> Result<Vec<Array>> {
        let v = array_vec(inputs);
        let raw = self.raw.as_ref().expect("function handle");
        let out = callback::call(|| tffi::call_function(raw, &v, current()))?;
        Ok(arrays(&out))
    }
}

impl Drop for Function {
    fn drop(&mut self) {
        let raw = std::mem::replace(&mut self.raw, UniquePtr::null());
        crate::lock::locked(move || drop(raw));
    }
}

/// `f` with gradient checkpointing: its intermediate values are not kept for the backward pass but
/// recomputed when a gradient needs them, trading compute for memory.
pub fn checkpoint(f: impl Fn(&[Array]) -> Result<Vec<Array>> + 'static) -> Function {
    let cb = callback::owned_fn(f);
    Function::new(crate::lock::locked(|| tffi::checkpoint(cb)))
}

/// `f` whose vector-Jacobian product is `vjp(primals, cotangents, outputs)` (one result per primal)
/// instead of the one derived from `f`'s ops.
pub fn custom_vjp(
    f: impl Fn(&[Array]) -> Result<Vec<Array>> + 'static,
    vjp: impl Fn(&[Array], &[Array], &[Array]) -> Result<Vec<Array>> + 'static,
) -> Function {
    CustomFunction::new(f).vjp(vjp).build()
}

type VjpClosure = Box<dyn Fn(&[Array], &[Array], &[Array]) -> Result<Vec<Array>>>;
type JvpClosure = Box<dyn Fn(&[Array], &[Array], &[usize]) -> Result<Vec<Array>>>;
type VmapClosure = Box<dyn Fn(&[Array], &[Option<usize>]) -> Result<(Vec<Array>, Vec<Option<usize>>)>>;

/// A function with any of its transforms replaced: `vjp`, `jvp` and `vmap` given here are used
/// instead of those MLX derives from the function's ops (MLX's `custom_function`).
///
/// ```
/// use rmlx::{transforms::{self, CustomFunction}, Array};
/// // y = x^3, with a deliberately scaled gradient to show which rule is used.
/// let f = CustomFunction::new(|x: &[Array]| Ok(vec![(&(&x[0] * &x[0])? * &x[0])?]))
///     .vjp(|primals: &[Array], cotangents: &[Array], _outputs: &[Array]| {
///         Ok(vec![(&(&primals[0] * &primals[0])? * &(&cotangents[0] * 30.0)?)?])
///     })
///     .build();
/// let x = Array::from_slice(&[2.0f32], &[1])?;
/// let (_, g) = transforms::vjp(|a: &[Array]| f.call(a), &[x], &[Array::from_slice(&[1.0f32], &[1])?])?;
/// assert_eq!(g[0].to_vec::<f32>()?, vec![120.0]);
/// # Ok::<(), rmlx::Error>(())
/// ```
pub struct CustomFunction {
    f: Box<DynFn<'static>>,
    vjp: Option<VjpClosure>,
    jvp: Option<JvpClosure>,
    vmap: Option<VmapClosure>,
}

impl CustomFunction {
    /// Starts from `f`.
    pub fn new(f: impl Fn(&[Array]) -> Result<Vec<Array>> + 'static) -> CustomFunction {
        CustomFunction { f: Box::new(f), vjp: None, jvp: None, vmap: None }
    }

    /// The vector-Jacobian product: `(primals, cotangents, outputs) -> one array per primal`.
    pub fn vjp(mut self, vjp: impl Fn(&[Array], &[Array], &[Array]) -> Result<Vec<Array>> + 'static) -> Self {
        self.vjp = Some(Box::new(vjp));
        self
    }

    /// The Jacobian-vector product: `(primals, tangents, argnums) -> one array per output`, where
    /// `tangents[i]` belongs to primal `argnums[i]`.
    pub fn jvp(mut self, jvp: impl Fn(&[Array], &[Array], &[usize]) -> Result<Vec<Array>> + 'static) -> Self {
        self.jvp = Some(Box::new(jvp));
        self
    }

    /// The vectorised function: `(inputs, axes) -> (outputs, output axes)`, where `None` marks an
    /// input (or output) without the mapped axis.
    pub fn vmap(
        mut self,
        vmap: impl Fn(&[Array], &[Option<usize>]) -> Result<(Vec<Array>, Vec<Option<usize>>)> + 'static,
    ) -> Self {
        self.vmap = Some(Box::new(vmap));
        self
    }

    /// The function with these transforms.
    pub fn build(self) -> Function {
        let f = self.f;
        let (has_vjp, has_jvp, has_vmap) = (self.vjp.is_some(), self.jvp.is_some(), self.vmap.is_some());
        let vjp = VjpFn(self.vjp.map(|g| {
            Box::new(move |p: &_, c: &_, o: &_| {
                let (p, c, o) = (arrays_of(p), arrays_of(c), arrays_of(o));
                returned(callback::guard(|| g(&p, &c, &o)))
            }) as _
        }));
        let jvp = JvpFn(self.jvp.map(|g| {
            Box::new(move |p: &_, t: &_, nums: &[i32]| {
                let (p, t) = (arrays_of(p), arrays_of(t));
                let nums: Vec<usize> = nums.iter().map(|&n| n as usize).collect();
                returned(callback::guard(|| g(&p, &t, &nums)))
            }) as _
        }));
        let vmap = VmapFn(self.vmap.map(|g| {
            Box::new(move |x: &_, axes: &[i32]| {
                let (x, axes) = (arrays_of(x), callback::axes_from_i32(axes));
                returned_mapped(callback::guard(|| g(&x, &axes)))
            }) as _
        }));
        let cb = callback::owned_fn(f);
        Function::new(crate::lock::locked(|| {
            tffi::custom_function(cb, Box::new(vjp), has_vjp, Box::new(jvp), has_jvp, Box::new(vmap), has_vmap)
        }))
    }
}
