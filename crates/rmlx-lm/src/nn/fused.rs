//! The pieces of a decoder block that decoding runs as one CUDA kernel each
//! ([`cuda_qmv::fused_matvec`]): an RMSNorm folded into the product that reads it, a residual
//! added by the product that makes it, and a feed-forward's gate and up projections with their
//! gated activation. A decoding step is bound by the host work MLX does per graph node; each
//! fusion takes one to three nodes out of every layer. Every method composes the same operations
//! where the kernel does not serve (another backend, training, adapters, more than a few rows,
//! `QuantizedMatvec::Mlx`), so a model calls them unconditionally. A post-norm's branch
//! joining the residual ([`RmsNorm::forward_add`]) is one kernel of its own (`cuda_fast::norm_add`).

use super::cuda_fast;
use super::cuda_qmv::{self, Fused, Matrix};
use super::{adapter_bank, gated_activation, GatedMlp, Linear, LinearWeight, QuantizedMatvec, RmsNorm, Stacked};
use crate::Result;
use rmlx::{Array, DeviceType};

impl Linear {
    /// `self(norm(x))`.
    pub fn forward_normed(&self, x: &Array, norm: &RmsNorm) -> Result<Array> {
        if let Some(weight) = self.fusable() {
            let f =
                Fused { norm: Some((norm.weight(), norm.eps())), bias: self.bias.as_ref(), ..Fused::product(weight) };
            if let Some(y) = cuda_qmv::fused_matvec(x, &f)? {
                return Ok(y);
            }
        }
        self.forward(&norm.forward(x)?)
    }

    /// `residual + self(x)`.
    pub fn forward_add(&self, x: &Array, residual: &Array) -> Result<Array> {
        if self.reduce.is_some() {
            return Ok((residual + self.forward_fused(x)?)?);
        }
        if let Some(weight) = self.fusable() {
            let f = Fused { residual: Some(residual), bias: self.bias.as_ref(), ..Fused::product(weight) };
            if let Some(y) = cuda_qmv::fused_matvec(x, &f)? {
                return Ok(y);
            }
        }
        Ok((residual + self.forward(x)?)?)
    }

    /// `self(x)`: through the fused kernel where it serves (a decoding step's product, one
    /// launch a captured step can take), else as [`Linear::forward`].
    pub fn forward_fused(&self, x: &Array) -> Result<Array> {
        if let Some(weight) = self.kernel_weight() {
            let f = Fused { bias: self.bias.as_ref(), ..Fused::product(weight) };
            if let Some(y) = cuda_qmv::fused_matvec(x, &f)? {
                return match &self.reduce {
                    Some(tp) => tp.all_sum(&y),
                    None => Ok(y),
                };
            }
        }
        self.forward(x)
    }

    /// The weight the fused kernel may read for this layer: none with an adapter, under
    /// [`QuantizedMatvec::Mlx`], off the GPU, or for a partial product that is all-summed over
    /// the ranks of a tensor-parallel model (the residual and what follows need the sum).
    fn fusable(&self) -> Option<Matrix<'_>> {
        self.kernel_weight().filter(|_| self.reduce.is_none())
    }

    /// The weight the fused kernel may read for this layer's own product (partial or not).
    fn kernel_weight(&self) -> Option<Matrix<'_>> {
        let plain = self.lora.is_none()
            && self.matvec != QuantizedMatvec::Mlx
            && rmlx::current_device().kind == DeviceType::Gpu
            && !adapter_bank::has_row_adapters(&self.path);
        plain.then_some(match &self.weight {
            LinearWeight::Dense { w, .. } => Matrix::Dense(w),
            LinearWeight::Quantized(q) => Matrix::Quantized(q),
        })
    }
}

impl RmsNorm {
    /// `residual + self(x)` (a post-norm branch joining the residual stream).
    pub fn forward_add(&self, x: &Array, residual: &Array) -> Result<Array> {
        if let Some(y) = cuda_fast::norm_add(x, self.weight(), self.eps(), residual)? {
            return Ok(y);
        }
        Ok((residual + self.forward(x)?)?)
    }
}

impl Stacked {
    /// [`Stacked::forward`] of `norm(x)`.
    pub fn forward_normed(&self, group: &[&Linear], x: &Array, norm: &RmsNorm) -> Result<Option<Array>> {
        self.intact(group).map(|linear| linear.forward_normed(x, norm)).transpose()
    }
}

impl GatedMlp {
    /// `self(norm(x))`.
    pub fn forward_normed(&self, x: &Array, norm: &RmsNorm) -> Result<Array> {
        self.down.forward_fused(&self.activation_normed(x, norm)?)
    }

    /// `x + self(norm(x))`: a pre-norm block's feed-forward half (one node of MLX's graph where
    /// the kernels serve both products).
    pub fn forward_residual(&self, x: &Array, norm: &RmsNorm) -> Result<Array> {
        if let (Some(first), Some(down)) = (self.fused_activation(norm), self.down.fusable()) {
            let second = Fused { residual: Some(x), bias: self.down.bias.as_ref(), ..Fused::product(down) };
            if let Some(y) = cuda_qmv::fused_pair(x, &first, &second)? {
                return Ok(y);
            }
        }
        self.down.forward_add(&self.activation_normed(x, norm)?, x)
    }

    /// `h + self(norm(h))` for `h = x + o_proj(o)`: what follows a pre-norm block's attention,
    /// given its merged heads `o` — one node of MLX's graph where the kernels serve all three
    /// products (the output projection with the residual, then this feed-forward half).
    pub fn forward_after_attention(&self, o: &Array, x: &Array, o_proj: &Linear, norm: &RmsNorm) -> Result<Array> {
        let parts = (o_proj.fusable(), self.fused_activation(norm), self.down.fusable());
        if let (Some(out), Some(activation), Some(down)) = parts {
            let steps = [
                (Fused { residual: Some(x), bias: o_proj.bias.as_ref(), ..Fused::product(out) }, None),
                (activation, None),
                (Fused { bias: self.down.bias.as_ref(), ..Fused::product(down) }, Some(0)),
            ];
            if let Some(y) = cuda_qmv::fused_chain(o, &steps)? {
                return Ok(y);
            }
        }
        let h = o_proj.forward_add(o, x)?;
        self.forward_residual(&h, norm)
    }

    /// `act(gate(norm(x))) · up(norm(x))`.
    fn activation_normed(&self, x: &Array, norm: &RmsNorm) -> Result<Array> {
        if let Some(f) = self.fused_activation(norm) {
            if let Some(y) = cuda_qmv::fused_matvec(x, &f)? {
                return Ok(y);
            }
        }
        let n = norm.forward(x)?;
        Ok(gated_activation(&self.gate.forward(&n)?, &self.up.forward(&n)?, self.gelu)?)
    }

    /// `act(gate(norm(x))) · up(norm(x))` as one fused product, where gate and up can be fused
    /// (no adapters, no biases).
    fn fused_activation<'a>(&'a self, norm: &'a RmsNorm) -> Option<Fused<'a>> {
        let unbiased = self.gate.bias.is_none() && self.up.bias.is_none();
        let (gate, up) = (self.gate.fusable()?, self.up.fusable()?);
        let norm = Some((norm.weight(), norm.eps()));
        unbiased.then_some(Fused { gated: Some((up, self.gelu)), norm, ..Fused::product(gate) })
    }
}
