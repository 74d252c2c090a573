//! Low-rank adapters (LoRA) on linear layers: `y = base(x) + scale · (x A) B`.
//!
//! `A: [in, r]` and `B: [r, out]` in mlx-lm's orientation and names (`<linear>.lora_a`,
//! `<linear>.lora_b`), with `scale` multiplying directly as in mlx-lm. PEFT stores the transposes
//! (`lora_A.weight: [r, in]`, `lora_B.weight: [out, r]`) and scales by `lora_alpha / r`.
//!
//! ```
//! use rmlx_lm::nn::Lora;
//! use rmlx::{Array, Dtype};
//! let lora = Lora::init(4, 3, 2, 20.0, Dtype::Float32, Some(&rmlx::random::key(0)?))?;
//! let bound = 1.0 / 2.0; // 1/√in
//! assert!(lora.a.to_vec::<f32>()?.iter().all(|v| v.abs() <= bound));
//! assert_eq!(lora.b.to_vec::<f32>()?, vec![0.0; 6]); // starts as the identity change
//! # Ok::<(), rmlx_lm::Error>(())
//! ```

use crate::Result;
use rmlx::{ops, random, Array, Dtype};
use std::cell::{Cell, RefCell};

thread_local! {
    static TRAINING: Cell<bool> = const { Cell::new(false) };
    /// Where dropout draws its masks from: `None`, MLX's global key; `Some(key)`, a stream of keys
    /// split from `key` (see [`with_dropout_key`]).
    static DROPOUT_KEY: RefCell<Option<Array>> = const { RefCell::new(None) };
}

/// Whether layers on this thread run in training mode (LoRA dropout active).
pub fn training() -> bool {
    TRAINING.with(Cell::get)
}

/// Runs `f` with this thread's layers in training mode.
pub fn with_training<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            TRAINING.with(|t| t.set(self.0));
        }
    }
    let _restore = Restore(TRAINING.with(|t| t.replace(true)));
    f()
}

/// Runs `f` with LoRA dropout on this thread drawing its masks from `key` (each draw splits it)
/// instead of MLX's global key, so that running `f` again draws the same masks: a checkpointed
/// block recomputed for the backward pass must drop what its forward pass dropped, a resumed run
/// must drop what the uninterrupted one did, and a compiled step takes the key as an input.
pub fn with_dropout_key<T>(key: Array, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<Array>);
    impl Drop for Restore {
        fn drop(&mut self) {
            DROPOUT_KEY.with(|k| k.replace(self.0.take()));
        }
    }
    let _restore = Restore(DROPOUT_KEY.with(|k| k.replace(Some(key))));
    f()
}

/// The key of the next dropout mask: `None` (MLX's global key) outside [`with_dropout_key`].
pub(crate) fn next_dropout_key() -> Result<Option<Array>> {
    DROPOUT_KEY.with(|cell| {
        let mut current = cell.borrow_mut();
        let Some(key) = current.as_ref() else { return Ok(None) };
        let keys = random::split(key, 2)?;
        let row = |i: i32| keys.slice_axis(0, i, i + 1, 1)?.reshape(&[2]);
        *current = Some(row(1)?);
        Ok(Some(row(0)?))
    })
}

/// `x` with inverted dropout of probability `p` in training mode (the kept elements scaled by
/// `1 / (1 - p)`, the masks from [`next_dropout_key`]); `x` itself otherwise.
pub(crate) fn dropout(x: &Array, p: f32) -> Result<Array> {
    if p > 0.0 && training() {
        let draw = random::uniform(0.0, 1.0, x.shape(), Dtype::Float32, next_dropout_key()?.as_ref())?;
        let keep = ops::greater_equal(&draw, &Array::scalar(p))?.astype(x.dtype())?;
        return Ok((x * (keep * (1.0 / (1.0 - p)))?)?);
    }
    Ok(x.clone())
}

/// An adapter's two factors and its scale.
#[derive(Clone)]
pub struct Lora {
    /// `[in, r]`.
    pub a: Array,
    /// `[r, out]`.
    pub b: Array,
    pub scale: f32,
    /// Probability of dropping an input element of the adapter's path, in training mode only
    /// (inverted dropout: the kept ones are scaled by `1 / (1 - p)`).
    pub dropout: f32,
    /// DoRA's learned magnitude per output row, `[out]` float32 (`<linear>.m`); `None`: plain LoRA.
    /// With it, the layer's output rows are rescaled to `m / ‖W + ΔW‖` (before the bias).
    pub magnitude: Option<Array>,
    /// In training on MLX's CUDA backend, run the branch and its gradient as rmlx's own kernels
    /// (`cuda_lora`) instead of composing them (`rmlx lora --lora-kernels`; off by default until
    /// measured faster in normal runs: see BENCHMARKS.md).
    pub kernels: bool,
}

impl Lora {
    /// A fresh adapter as mlx-lm initialises one: `A` uniform in `±1/√in`, `B` zero, so that the
    /// layer's output is unchanged until training moves `B`.
    pub fn init(input: i32, output: i32, rank: i32, scale: f32, dtype: Dtype, key: Option<&Array>) -> Result<Lora> {
        let bound = 1.0 / (input as f32).sqrt();
        Ok(Lora {
            a: random::uniform(-bound, bound, &[input, rank], dtype, key)?,
            b: ops::zeros(&[rank, output], dtype)?,
            scale,
            dropout: 0.0,
            magnitude: None,
            kernels: false,
        })
    }

    /// The rank `r`.
    pub fn rank(&self) -> i32 {
        self.a.shape()[1]
    }

    /// `scale · (dropout(x) A) B`, in `x`'s dtype.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let x = self.dropped(x)?;
        let (a, b) = self.factors(x.dtype())?;
        // As one matrix of rows: MLX would flatten and unflatten around each product otherwise.
        let rows = x.reshape(&[-1, self.a.shape()[0]])?;
        let mut shape = x.shape().to_vec();
        *shape.last_mut().expect("an input has a last axis") = self.b.shape()[1];
        let z = rows.matmul(&a)?.matmul(&b)?.reshape(&shape)?;
        Ok((z * self.scale)?.astype(x.dtype())?)
    }

    /// `y + scale · (dropout(x) A) B`, `y` the base layer's output for `x`. With
    /// [`Lora::kernels`], in training on MLX's CUDA backend, the branch and its gradient are
    /// rmlx's kernels (`cuda_lora`: two operations of MLX's graph instead of six products and
    /// their element-wise work); otherwise, and for what they do not take, [`Lora::forward`]
    /// added to `y`.
    pub fn add_to(&self, y: &Array, x: &Array) -> Result<Array> {
        if self.kernels && training() && y.dtype() == x.dtype() {
            let dropped = self.dropped(x)?;
            let (a, b) = self.factors(x.dtype())?;
            if let Some(sum) = super::cuda_lora::lora_add(y, &dropped, &a, &b, self.scale)? {
                return Ok(sum);
            }
        }
        Ok((y + self.forward(x)?)?)
    }

    /// `x` with this adapter's dropout applied in training (the same draw whichever path uses it).
    fn dropped(&self, x: &Array) -> Result<Array> {
        dropout(x, self.dropout)
    }

    /// The factors in the activations' dtype (the float32 factors cast down, as PEFT under
    /// autocast and QLoRA compute): promoting `x` instead would keep a float32 copy of every
    /// adapted input for the backward pass (1.4 GB at llama3.2-1b's 16 blocks, batch 4 × 416).
    fn factors(&self, dtype: Dtype) -> Result<(Array, Array)> {
        Ok((self.a.astype(dtype)?, self.b.astype(dtype)?))
    }

    /// The change to the base weight, `scale · (A B)ᵀ`, `[out, in]` (what fusing adds).
    pub fn delta(&self) -> Result<Array> {
        Ok((self.a.matmul(&self.b)?.transpose()? * self.scale)?)
    }
}
