//! The gated activation of a feed-forward block, `act(gate) · up`, with SiLU (SwiGLU) or tanh-GELU
//! (GeGLU). On the GPU, outside training, it runs as one compiled kernel, as mlx-lm compiles it:
//! composed, it is 3 graph nodes (SiLU) or 10 (GELU), and a decoding step pays for every node.
//! On the CPU, SwiGLU is one primitive ([`super::cpu_fast::swiglu_activation`]) with the composed
//! graph's arithmetic.

use super::training;
use rmlx::compile::{compile_with, CompileOptions, Compiled};
use rmlx::{ops, Array, DeviceType};
use std::mem::ManuallyDrop;

/// `silu(gate) · up`, or `gelu_approx(gate) · up` with `gelu`.
pub fn gated_activation(gate: &Array, up: &Array, gelu: bool) -> rmlx::Result<Array> {
    let same = gate.shape() == up.shape() && gate.dtype() == up.dtype();
    if !gelu && same && super::cpu_fast::applies(gate) && !up.is_tracer() {
        return super::cpu_fast::swiglu_activation(gate, up);
    }
    let fused = rmlx::current_device().kind == DeviceType::Gpu && !training() && !gate.is_tracer() && !up.is_tracer();
    if !fused {
        return composed(gate, up, gelu);
    }
    let out = match gelu {
        true => GEGLU.with(|f| f.call(&[gate.clone(), up.clone()]))?,
        false => SWIGLU.with(|f| f.call(&[gate.clone(), up.clone()]))?,
    };
    Ok(out.into_iter().next().expect("one output"))
}

fn composed(gate: &Array, up: &Array, gelu: bool) -> rmlx::Result<Array> {
    let g = if gelu { ops::gelu_approx(gate)? } else { ops::silu(gate)? };
    g * up
}

fn compiled(gelu: bool) -> ManuallyDrop<Compiled> {
    let name = if gelu { "GeGLU" } else { "SwiGLU" };
    let options = CompileOptions { shapeless: true, name: Some(name.into()) };
    // Kept for the thread's life: dropping it at thread exit would call into MLX while it may be
    // shutting down.
    ManuallyDrop::new(compile_with(move |x: &[Array]| Ok(vec![composed(&x[0], &x[1], gelu)?]), options))
}

thread_local! {
    static SWIGLU: ManuallyDrop<Compiled> = compiled(false);
    static GEGLU: ManuallyDrop<Compiled> = compiled(true);
}
