//! [`Array`]: a handle to a node of MLX's lazy computation graph.

use crate::device::current;
use crate::evaluator;
use crate::lock::{evaluating, locked};
use crate::{Dtype, Element, Error, Result};
use rmlx_sys::cxx::UniquePtr;
use rmlx_sys::ffi;
use std::fmt;

/// An n-dimensional array, lazily computed by MLX.
///
/// Creating an array or applying an op only records work; the values are computed when they are
/// needed ([`Array::to_vec`], [`Array::item`], printing) or when [`Array::eval`] / [`eval`] is
/// called. Dropping an `Array` releases its reference at once; the memory is freed when the last
/// reference (including those held by pending graph nodes) goes away.
///
/// Cloning is cheap: it copies the handle, not the data.
///
/// `Array` is `Send` (it may move to another thread) but not `Sync`: evaluating an array mutates it,
/// so one array must not be used from two threads at the same time. Clone it for each thread instead.
/// Lazy arrays may cross threads too: rmlx records all work on one stream per device shared by every
/// thread, and serialises its calls into MLX (see the crate docs, "Threads").
///
/// ```
/// use rmlx::Array;
/// let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2])?;
/// let b = (&a * 2.0)?.transpose()?;
/// assert_eq!(b.to_vec::<f32>()?, vec![2.0, 6.0, 4.0, 8.0]);
/// # Ok::<(), rmlx::Error>(())
/// ```
pub struct Array {
    raw: UniquePtr<ffi::Array>,
    /// When this handle was made (see `compile::capture_guard`).
    stamp: u64,
}

impl Array {
    pub(crate) fn from_raw(raw: UniquePtr<ffi::Array>) -> Array {
        debug_assert!(!raw.is_null());
        Array { raw, stamp: crate::compile::next_stamp() }
    }

    pub(crate) fn raw(&self) -> &ffi::Array {
        crate::compile::note_use(self.stamp);
        // The pointer is never null: every constructor receives a fresh array from the shim.
        self.raw.as_ref().expect("non-null array handle")
    }

    pub(crate) fn ptr(a: Option<&Array>) -> *const ffi::Array {
        a.map_or(std::ptr::null(), |a| a.raw() as *const ffi::Array)
    }

    /// Copies `data` into a new array of the given shape. `data.len()` must equal the product of
    /// the shape (1 for the empty shape, a scalar).
    pub fn from_slice<T: Element>(data: &[T], shape: &[i32]) -> Result<Array> {
        let n: i64 = shape.iter().map(|&d| d as i64).product();
        if shape.iter().any(|&d| d < 0) || n != data.len() as i64 {
            return Err(Error::InvalidArgument(format!("{} elements cannot fill shape {shape:?}", data.len())));
        }
        // SAFETY: `Element` guarantees a plain, fully initialised layout of `size_of::<T>()` bytes.
        let bytes = unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data)) };
        crate::ops::wrap(|| ffi::array_from_data(bytes, shape, T::DTYPE as u8))
    }

    /// A zero-dimensional array holding `value`.
    pub fn scalar<T: Element>(value: T) -> Array {
        let bytes = unsafe { std::slice::from_raw_parts(&value as *const T as *const u8, std::mem::size_of::<T>()) };
        // Cannot fail short of memory exhaustion: the size always matches the empty shape.
        crate::ops::wrap(|| ffi::array_from_data(bytes, &[], T::DTYPE as u8)).expect("allocating a scalar")
    }

    /// A zero-dimensional array of `dtype` holding `value` converted to it.
    pub fn scalar_as(value: f64, dtype: Dtype) -> Result<Array> {
        crate::ops::wrap(|| ffi::array_from_f64(value, dtype as u8))
    }

    /// A zero-dimensional array of `dtype` holding `value` converted to it (integers wrap).
    pub(crate) fn scalar_from_i64(value: i64, dtype: Dtype) -> Result<Array> {
        crate::ops::wrap(|| ffi::array_from_i64(value, dtype as u8))
    }

    /// The dimensions.
    pub fn shape(&self) -> &[i32] {
        ffi::array_shape(self.raw())
    }

    /// Size of dimension `axis`; negative axes count from the end.
    pub fn dim(&self, axis: i32) -> Result<i32> {
        let nd = self.ndim() as i32;
        let ax = if axis < 0 { axis + nd } else { axis };
        if ax < 0 || ax >= nd {
            return Err(Error::InvalidArgument(format!("axis {axis} out of range for {nd} dimensions")));
        }
        Ok(self.shape()[ax as usize])
    }

    /// Element strides (not bytes) of the evaluated data; meaningful after evaluation.
    pub fn strides(&self) -> &[i64] {
        ffi::array_strides(self.raw())
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.shape().len()
    }

    /// Number of elements.
    pub fn size(&self) -> usize {
        ffi::array_size(self.raw())
    }

    /// The element type.
    pub fn dtype(&self) -> Dtype {
        Dtype::from_code(ffi::array_dtype(self.raw()))
    }

    /// Bytes of the logical array (`size * itemsize`).
    pub fn nbytes(&self) -> usize {
        ffi::array_nbytes(self.raw())
    }

    /// Bytes per element.
    pub fn itemsize(&self) -> usize {
        ffi::array_itemsize(self.raw())
    }

    /// An identifier of the graph node (equal for clones of one array).
    pub fn id(&self) -> usize {
        ffi::array_id(self.raw())
    }

    /// Whether the array has been scheduled or computed.
    pub fn is_evaluated(&self) -> bool {
        ffi::array_is_evaluated(self.raw())
    }

    /// Whether the array is computed and laid out row-major without gaps: its buffer can be read
    /// as it is. `false` for an array not computed yet, whatever its layout will be.
    pub fn is_computed_row_contiguous(&self) -> bool {
        ffi::array_row_contiguous(self.raw())
    }

    /// Whether the array is a tracer of a transform being traced on this thread: an input of the
    /// function being differentiated (or vectorised), or computed from one. A function a transform
    /// keeps ([`crate::transforms::checkpoint`]) must take such arrays as inputs: captured, they are
    /// constants to it, and no gradient flows through them.
    pub fn is_tracer(&self) -> bool {
        locked(|| rmlx_sys::tffi::array_is_tracer(self.raw()))
    }

    /// Computes the array (and what it depends on) and waits for the result.
    pub fn eval(&self) -> Result<()> {
        // An array already scheduled (by `async_eval`) is only waited for, here.
        locked(|| match ffi::array_wait(self.raw()) {
            Ok(true) => Ok(()),
            _ => evaluator::run(|| ffi::array_eval(self.raw())),
        })?;
        crate::custom::check_eval_errors()
    }

    /// The elements in row-major order, whatever the array's memory layout (transposed, broadcast and
    /// sliced views are read correctly). `T` must match the dtype exactly; see [`Array::to_vec_f32`].
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype() {
            return Err(Error::DtypeMismatch { expected: T::DTYPE, found: self.dtype() });
        }
        let mut out = vec![T::default(); self.size()];
        // SAFETY: `out` holds exactly `size * itemsize` initialised bytes and every bit pattern MLX
        // writes for this dtype is a valid `T`.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, std::mem::size_of_val(out.as_slice()))
        };
        locked(|| match ffi::array_copy_ready(self.raw(), bytes) {
            Ok(true) => Ok(()),
            _ => evaluator::run(|| ffi::array_copy_to(self.raw(), bytes)),
        })?;
        crate::custom::check_eval_errors()?;
        Ok(out)
    }

    /// The elements converted to `f32`.
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        self.astype(Dtype::Float32)?.to_vec()
    }

    /// The single element of a one-element array.
    pub fn item<T: Element>(&self) -> Result<T> {
        if self.size() != 1 {
            return Err(Error::InvalidArgument(format!(
                "item() needs an array of one element, this one has shape {:?}",
                self.shape()
            )));
        }
        Ok(self.to_vec::<T>()?[0])
    }

    /// Converts to another dtype.
    pub fn astype(&self, dtype: Dtype) -> Result<Array> {
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        crate::ops::wrap(|| ffi::astype(self.raw(), dtype as u8, current()))
    }

    /// Reinterprets the bytes as another dtype (the last dimension scales with the size ratio).
    pub fn view_as(&self, dtype: Dtype) -> Result<Array> {
        crate::ops::wrap(|| ffi::view(self.raw(), dtype as u8, current()))
    }
}

impl Drop for Array {
    /// Releases the handle under the MLX lock: the last reference frees device memory.
    fn drop(&mut self) {
        let raw = std::mem::replace(&mut self.raw, UniquePtr::null());
        locked(move || drop(raw));
    }
}

impl Clone for Array {
    fn clone(&self) -> Array {
        Array::from_raw(ffi::array_clone(self.raw()))
    }
}

impl fmt::Display for Array {
    /// MLX's own rendering, e.g. `array([1, 2], dtype=int32)`. Evaluates the array.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match evaluating(|| ffi::array_to_string(self.raw())) {
            Ok(s) if crate::custom::check_eval_errors().is_ok() => f.write_str(&s),
            Ok(_) => write!(f, "<array {:?} {}: a primitive's evaluation failed>", self.shape(), self.dtype()),
            Err(e) => write!(f, "<array {:?} {}: {}>", self.shape(), self.dtype(), e.what()),
        }
    }
}

impl fmt::Debug for Array {
    /// Shape and dtype only: formatting with `{:?}` never triggers a computation.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Array").field("shape", &self.shape()).field("dtype", &self.dtype()).finish()
    }
}

/// A temporary `std::vector<array>` built from Rust arrays.
pub(crate) fn array_vec<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> UniquePtr<ffi::ArrayVec> {
    let mut v = ffi::vec_new();
    for a in arrays {
        ffi::vec_push(v.pin_mut(), a.raw());
    }
    v
}

pub(crate) fn from_array_vec(v: &UniquePtr<ffi::ArrayVec>) -> Vec<Array> {
    v.as_ref().map_or_else(Vec::new, arrays_of)
}

/// Rust handles to the arrays of a `std::vector<array>`.
pub(crate) fn arrays_of(v: &ffi::ArrayVec) -> Vec<Array> {
    (0..ffi::vec_len(v)).map(|i| Array::from_raw(ffi::vec_get(v, i))).collect()
}

/// Computes all `arrays` together (sharing common sub-graphs) and waits.
pub fn eval<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> Result<()> {
    let v = array_vec(arrays);
    evaluating(|| ffi::eval(&v))?;
    crate::custom::check_eval_errors()
}

/// The operations still to run to compute `arrays`, counted by MLX's primitive name (a
/// multi-output operation counts once): what an evaluation of them will launch, for finding
/// where a graph's operations come from.
///
/// ```
/// use rmlx::Array;
/// let x = Array::from_slice(&[1.0f32, 2.0], &[2])?;
/// let y = (&x.exp()? + &x.exp()?)?.sum(rmlx::ops::Axes::All, false)?;
/// let census = rmlx::graph_census([&y])?;
/// assert_eq!(census["Exp"], 2);
/// assert_eq!(census["Add"], 1);
/// rmlx::eval([&y])?;
/// assert!(rmlx::graph_census([&y])?.is_empty());
/// # Ok::<(), rmlx::Error>(())
/// ```
pub fn graph_census<'a>(
    arrays: impl IntoIterator<Item = &'a Array>,
) -> Result<std::collections::BTreeMap<String, usize>> {
    let v = array_vec(arrays);
    let text = crate::lock::locked(|| ffi::graph_census(&v))?;
    Ok(text
        .lines()
        .filter_map(|l| l.rsplit_once(' '))
        .map(|(name, n)| (name.to_string(), n.parse().unwrap_or(0)))
        .collect())
}

/// A hash of the operations still to run to produce `arrays`, in the order an evaluation of them
/// will run them: each operation's kind, its outputs' shapes and dtypes and where its inputs come
/// from. MLX's CUDA backend keeps the CUDA graphs it builds under a key of the operations in that
/// order, so a step whose signature repeats reuses them, where the same operations in another order
/// (arrays handed over in a hash map's order, say) instantiate new ones.
///
/// ```
/// use rmlx::Array;
/// let (a, b) = (Array::from_slice(&[1.0f32], &[1])?, Array::from_slice(&[2.0f32], &[1])?);
/// // The same operations on other values of the same shapes: the same signature.
/// let exp_then_sin = |x: &Array, y: &Array| rmlx::ops::concatenate(&[&x.exp()?, &y.sin()?], 0);
/// let one = rmlx::graph_signature([&exp_then_sin(&a, &b)?])?;
/// assert_eq!(one, rmlx::graph_signature([&exp_then_sin(&b, &a)?])?);
/// // The same operations in another order: another signature.
/// let sin_then_exp = rmlx::ops::concatenate(&[&b.sin()?, &a.exp()?], 0)?;
/// assert_ne!(one, rmlx::graph_signature([&sin_then_exp])?);
/// # Ok::<(), rmlx::Error>(())
/// ```
pub fn graph_signature<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> Result<u64> {
    let v = array_vec(arrays);
    Ok(crate::lock::locked(|| ffi::graph_signature(&v))?)
}

/// Schedules the computation of `arrays` and returns at once; reading them later waits as needed.
/// Lets the host build the next graph while the device computes this one.
pub fn async_eval<'a>(arrays: impl IntoIterator<Item = &'a Array>) -> Result<()> {
    let v = array_vec(arrays);
    Ok(evaluating(|| ffi::async_eval(&v))?)
}
