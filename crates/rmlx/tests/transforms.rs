//! Behaviour of the transform API: `vmap`, `checkpoint`, custom derivatives, how closures' errors and
//! panics come back, `compile` and its trace cache, execution modes and custom GPU kernels.
//! (Numerical correctness of derivatives is in `gradients.rs`.)

// One-element input lists are written `&[x.clone()]` throughout: clearer here than `slice::from_ref`.
#![allow(clippy::cloned_ref_to_slice_refs)]

use rmlx::compile::{self, compile, compile_with, CompileOptions};
use rmlx::custom::{apply, CpuTensor, CpuTensorMut, CustomPrimitive};
use rmlx::fast::{self, GpuBackend, KernelLaunch, TemplateArg, TensorSpec};
use rmlx::transforms::{self, checkpoint, custom_vjp, CustomFunction};
use rmlx::{idx, ops, with_execution_mode, Array, Axes, Device, Dtype, Error, Executable, ExecutionMode, Result};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::{Arc, Mutex};

// -------------------------------------------------------------------------------------------------
// helpers

fn arr(v: &[f32], shape: &[i32]) -> Array {
    Array::from_slice(v, shape).unwrap()
}

/// `n` values `start, start + step, ...` of `shape` (float32).
fn ramp(shape: &[i32], start: f32, step: f32) -> Array {
    let n: i32 = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| start + step * i as f32).collect();
    arr(&v, shape)
}

fn vals(a: &Array) -> Vec<f32> {
    a.to_vec_f32().unwrap()
}

/// Same shape and `|a - b| <= tol · max(1, |b|)` element-wise.
fn assert_close(a: &Array, b: &Array, tol: f32, what: &str) {
    assert_eq!(a.shape(), b.shape(), "{what}: shape");
    for (i, (x, y)) in vals(a).iter().zip(vals(b)).enumerate() {
        assert!((x - y).abs() <= tol * y.abs().max(1.0), "{what}: element {i}: {x} vs {y}");
    }
}

/// The closure error used throughout: it must come back exactly.
fn fails(_: &[Array]) -> Result<Vec<Array>> {
    Err(Error::InvalidArgument("x".into()))
}

fn panics(_: &[Array]) -> Result<Vec<Array>> {
    panic!("kaboom {}", 42)
}

fn is_x<T: std::fmt::Debug>(r: Result<T>, what: &str) {
    match r {
        Err(Error::InvalidArgument(m)) if m == "x" => {}
        other => panic!("{what}: expected Err(InvalidArgument(\"x\")), got {other:?}"),
    }
}

fn is_kaboom<T: std::fmt::Debug>(r: Result<T>, what: &str) {
    match r {
        Err(Error::Callback(m)) if m.contains("kaboom 42") => {}
        other => panic!("{what}: expected Err(Callback(\"...kaboom 42...\")), got {other:?}"),
    }
}

/// A chain of element-wise ops.
fn chain(a: &[Array]) -> Result<Vec<Array>> {
    let x = &a[0];
    let y = ((x * 1.5)? + 0.25)?.tanh()?;
    let z = (&y * &(x * -0.5)?.exp()?)?;
    let w = ((&z - x)? * &y.sigmoid()?)?;
    Ok(vec![(w + (x * x)?)?])
}

/// A reduction and a matrix product: `[relu(x @ w).sum(1), mean(x) + max(w)]`.
fn reduce_matmul(a: &[Array]) -> Result<Vec<Array>> {
    let (x, w) = (&a[0], &a[1]);
    let r = ops::relu(&x.matmul(w)?)?.sum(1, false)?;
    Ok(vec![r, (x.mean(Axes::All, false)? + w.max(Axes::All, false)?)?])
}

fn sum_of(a: Result<Vec<Array>>) -> Result<Array> {
    a?.remove(0).sum(Axes::All, false)
}

// -------------------------------------------------------------------------------------------------
// vmap

#[test]
fn vmap_in_axes_match_loop() {
    let x = ramp(&[3, 4], 0.0, 1.0); // mapped over axis 0: 3 slices of [4]
    let y = ramp(&[4, 3], 1.0, 0.5); // mapped over axis 1: 3 slices of [4]
    let z = arr(&[1.0, 2.0, 3.0], &[3]); // not mapped
    let f = |a: &[Array]| Ok(vec![((&a[0] * &a[1])? + a[2].sum(Axes::All, false)?)?]);
    let mapped = transforms::vmap(f, &[Some(0), Some(1), None], &[])(&[x.clone(), y.clone(), z.clone()]).unwrap();
    assert_eq!(mapped.len(), 1);
    let slices: Vec<Array> = (0..3)
        .map(|i| f(&[x.index(idx![i]).unwrap(), y.index(idx![.., i]).unwrap(), z.clone()]).unwrap().remove(0))
        .collect();
    let looped = ops::stack(&slices.iter().collect::<Vec<_>>(), 0).unwrap();
    assert_close(&mapped[0], &looped, 0.0, "vmap vs loop");
    assert_eq!(mapped[0].shape(), &[3, 4]);

    // out_axes: the mapped axis goes last.
    let moved = transforms::vmap(f, &[Some(0), Some(1), None], &[1])(&[x.clone(), y.clone(), z.clone()]).unwrap();
    assert_close(&moved[0], &looped.transpose().unwrap(), 0.0, "out_axes [1]");
}

#[test]
fn vmap_two_outputs_with_their_own_out_axes() {
    let x = ramp(&[3, 4], -1.0, 0.25);
    let w = ramp(&[3, 2], 0.5, 0.5);
    let f = |a: &[Array]| Ok(vec![(&a[0] * 2.0)?, ops::outer(&a[0], &a[1])?]);
    // Empty in_axes: axis 0 of every input.
    let out = transforms::vmap(f, &[], &[0, 1])(&[x.clone(), w.clone()]).unwrap();
    assert_eq!(out.len(), 2);
    assert_eq!(out[0].shape(), &[3, 4]);
    assert_eq!(out[1].shape(), &[4, 3, 2]);
    for i in 0..3 {
        let want = f(&[x.index(idx![i]).unwrap(), w.index(idx![i]).unwrap()]).unwrap();
        assert_close(&out[0].index(idx![i]).unwrap(), &want[0], 0.0, "output 0");
        assert_close(&out[1].index(idx![.., i]).unwrap(), &want[1], 0.0, "output 1");
    }
}

#[test]
fn vmap_argument_errors() {
    let x = ramp(&[3, 4], 0.0, 1.0);
    let f = |a: &[Array]| Ok(vec![(&a[0] + &a[1])?]);
    match transforms::vmap(f, &[Some(0)], &[])(&[x.clone(), x.clone()]) {
        Err(Error::InvalidArgument(_)) => {}
        other => panic!("in_axes of the wrong length: {other:?}"),
    }
    // An axis the input does not have is MLX's error, not a crash.
    match transforms::vmap(f, &[Some(0), Some(5)], &[])(&[x.clone(), x.clone()]) {
        Err(Error::Mlx(_)) => {}
        other => panic!("in_axes out of range: {other:?}"),
    }
    // Mapped inputs of different sizes along their axes.
    let y = ramp(&[2, 4], 0.0, 1.0);
    assert!(matches!(transforms::vmap(f, &[Some(0), Some(0)], &[])(&[x, y]), Err(Error::Mlx(_))));
}

// -------------------------------------------------------------------------------------------------
// checkpoint

fn ckpt_body(a: &[Array]) -> Result<Vec<Array>> {
    let h = a[0].matmul(&a[1])?.tanh()?;
    Ok(vec![((&h * &h)?.sum(Axes::All, false)? + (&a[0] * 0.5)?.sum(Axes::All, false)?)?])
}

#[test]
fn checkpoint_same_value_and_gradient() {
    let calls = Rc::new(Cell::new(0usize));
    let counter = calls.clone();
    let ck = checkpoint(move |a: &[Array]| {
        counter.set(counter.get() + 1);
        ckpt_body(a)
    });
    let inputs = [ramp(&[2, 3], -0.5, 0.2), ramp(&[3, 4], 0.3, -0.1)];

    let v = ck.call(&inputs).unwrap();
    assert_close(&v[0], &ckpt_body(&inputs).unwrap()[0], 0.0, "value");
    assert_eq!(calls.get(), 1);

    calls.set(0);
    let g = transforms::grad(|a: &[Array]| sum_of(ck.call(a)), &[0, 1])(&inputs).unwrap();
    let want = transforms::grad(|a: &[Array]| sum_of(ckpt_body(a)), &[0, 1])(&inputs).unwrap();
    for i in 0..2 {
        assert_close(&g[i], &want[i], 1e-6, "gradient");
    }
    // The forward pass, and the recomputation for the backward pass.
    assert!(calls.get() >= 2, "the checkpointed function ran {} times", calls.get());
}

// -------------------------------------------------------------------------------------------------
// custom derivatives

fn cube(a: &[Array]) -> Result<Vec<Array>> {
    Ok(vec![((&a[0] * &a[0])? * &a[0])?])
}

/// 3x² · scale.
fn three_x2(x: &Array, scale: f32) -> Result<Array> {
    &(x * x)? * (3.0 * scale)
}

#[test]
fn custom_vjp_rule_is_used_and_others_are_derived() {
    let seen_outputs = Rc::new(RefCell::new(Vec::new()));
    let seen = seen_outputs.clone();
    // A deliberately wrong (10×) vjp.
    let f = custom_vjp(cube, move |p: &[Array], c: &[Array], o: &[Array]| {
        seen.borrow_mut().extend(o.iter().cloned());
        Ok(vec![(three_x2(&p[0], 10.0)? * &c[0])?])
    });
    let x = arr(&[-1.0, 0.5, 2.0], &[3]);
    assert_close(&f.call(&[x.clone()]).unwrap()[0], &cube(&[x.clone()]).unwrap()[0], 0.0, "value");

    let g = transforms::grad(|a: &[Array]| sum_of(f.call(a)), &[0])(&[x.clone()]).unwrap();
    assert_close(&g[0], &three_x2(&x, 10.0).unwrap(), 1e-6, "the custom vjp");
    // The rule received the function's outputs.
    let seen = seen_outputs.borrow();
    assert_eq!(seen.len(), 1);
    assert_close(&seen[0], &cube(&[x.clone()]).unwrap()[0], 0.0, "outputs given to the vjp");

    // No jvp or vmap given: derived from the function.
    let t = arr(&[1.0, 2.0, -1.0], &[3]);
    let (_, jv) = transforms::jvp(|a: &[Array]| f.call(a), &[x.clone()], &[t.clone()]).unwrap();
    assert_close(&jv[0], &(three_x2(&x, 1.0).unwrap() * &t).unwrap(), 1e-6, "derived jvp");
    let m = ramp(&[2, 3], -1.0, 0.5);
    let vm = transforms::vmap(|a: &[Array]| f.call(a), &[Some(0)], &[])(&[m.clone()]).unwrap();
    assert_close(&vm[0], &cube(&[m]).unwrap()[0], 1e-6, "derived vmap");
}

#[test]
fn custom_function_jvp_and_vmap_overrides() {
    // jvp 7·t instead of 3x²·t; vmap returns 100·x³; no vjp.
    let f = CustomFunction::new(cube)
        .jvp(|_p: &[Array], t: &[Array], argnums: &[usize]| {
            assert_eq!(argnums, &[0]);
            Ok(vec![(&t[0] * 7.0)?])
        })
        .vmap(|x: &[Array], axes: &[Option<usize>]| Ok((vec![(&cube(x)?[0] * 100.0)?], vec![axes[0]])))
        .build();
    let x = arr(&[-1.0, 0.5, 2.0], &[3]);
    let t = arr(&[1.0, 2.0, -1.0], &[3]);
    let (out, jv) = transforms::jvp(|a: &[Array]| f.call(a), &[x.clone()], &[t.clone()]).unwrap();
    assert_close(&out[0], &cube(&[x.clone()]).unwrap()[0], 0.0, "jvp's output");
    assert_close(&jv[0], &(&t * 7.0).unwrap(), 0.0, "the custom jvp");

    let m = ramp(&[2, 3], -1.0, 0.5);
    let vm = transforms::vmap(|a: &[Array]| f.call(a), &[Some(0)], &[])(&[m.clone()]).unwrap();
    assert_close(&vm[0], &(&cube(&[m.clone()]).unwrap()[0] * 100.0).unwrap(), 1e-6, "the custom vmap");
    // Called directly, the function is itself.
    assert_close(&f.call(&[m.clone()]).unwrap()[0], &cube(&[m]).unwrap()[0], 0.0, "plain call");

    // No vjp given: derived.
    let g = transforms::grad(|a: &[Array]| sum_of(f.call(a)), &[0])(&[x.clone()]).unwrap();
    assert_close(&g[0], &three_x2(&x, 1.0).unwrap(), 1e-6, "derived vjp");
}

/// A custom primitive's transforms, where the primitive does not implement them: `Unsupported`.
#[test]
fn custom_primitive_without_vjp_is_unsupported() {
    let x = arr(&[1.0, 2.0], &[2]);
    let r = transforms::grad(|a: &[Array]| apply(Doubles, a)?[0].sum(Axes::All, false), &[0])(&[x.clone()]);
    assert!(matches!(r, Err(Error::Unsupported(ref m)) if m.contains("Doubles")), "{r:?}");
    let r = transforms::vmap(|a: &[Array]| apply(Doubles, a), &[Some(0)], &[])(&[x.clone()]);
    assert!(matches!(r, Err(Error::Unsupported(_))), "{r:?}");
    assert_eq!(vals(&apply(Doubles, &[x]).unwrap()[0]), vec![2.0, 4.0]);
}

/// A custom primitive reads its inputs row-major whatever their layout: a computed transposed
/// view, a lazy one and a slice are made contiguous; a computed contiguous array is read in place
/// (`is_computed_row_contiguous`), and one not yet computed is not taken for contiguous.
#[test]
fn custom_primitive_inputs_are_read_row_major() {
    let x = arr(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    let lazy = (&x * 1.0f32).unwrap();
    assert!(!lazy.is_computed_row_contiguous(), "not computed yet");
    assert_eq!(vals(&apply(Doubles, &[lazy]).unwrap()[0]), vec![2.0, 4.0, 6.0, 8.0, 10.0, 12.0]);
    rmlx::eval([&x]).unwrap();
    assert!(x.is_computed_row_contiguous());
    assert_eq!(vals(&apply(Doubles, &[x.clone()]).unwrap()[0]), vec![2.0, 4.0, 6.0, 8.0, 10.0, 12.0]);
    let t = x.transpose().unwrap();
    assert!(!t.is_computed_row_contiguous(), "not computed yet");
    assert_eq!(vals(&apply(Doubles, &[t.clone()]).unwrap()[0]), vec![2.0, 8.0, 4.0, 10.0, 6.0, 12.0]);
    rmlx::eval([&t]).unwrap();
    assert!(!t.is_computed_row_contiguous(), "a computed transposed view");
    assert_eq!(vals(&apply(Doubles, &[t]).unwrap()[0]), vec![2.0, 8.0, 4.0, 10.0, 6.0, 12.0]);
    let column = rmlx::ops::slice(&x, &[0, 1], &[2, 2], &[1, 1]).unwrap();
    rmlx::eval([&column]).unwrap();
    assert_eq!(vals(&apply(Doubles, &[column]).unwrap()[0]), vec![4.0, 10.0]);
    // Views computed only inside the graph reach the primitive with their strides.
    let lazy = (&x * 1.0f32).unwrap();
    let every_other = rmlx::ops::slice(&lazy, &[0, 0], &[2, 3], &[1, 2]).unwrap();
    assert_eq!(vals(&apply(Doubles, &[every_other]).unwrap()[0]), vec![2.0, 6.0, 8.0, 12.0]);
    let row = rmlx::ops::slice(&(&x * 1.0f32).unwrap(), &[1, 0], &[2, 3], &[1, 1]).unwrap();
    let repeated = row.broadcast_to(&[2, 3]).unwrap();
    assert_eq!(vals(&apply(Doubles, &[repeated]).unwrap()[0]), vec![8.0, 10.0, 12.0, 8.0, 10.0, 12.0]);
    let backwards = rmlx::ops::slice(&lazy.transpose().unwrap(), &[2, 0], &[-4, 2], &[-1, 1]).unwrap();
    assert_eq!(vals(&apply(Doubles, &[backwards]).unwrap()[0]), vec![6.0, 12.0, 4.0, 10.0, 2.0, 8.0]);
}

/// y = 2x, CPU only, no transforms.
struct Doubles;

impl CustomPrimitive for Doubles {
    fn name(&self) -> String {
        "Doubles".into()
    }
    fn output_specs(&self, inputs: &[TensorSpec]) -> Result<Vec<TensorSpec>> {
        Ok(vec![inputs[0].clone()])
    }
    fn eval_cpu(&self, inputs: &[CpuTensor<'_>], outputs: &mut [CpuTensorMut<'_>]) -> Result<()> {
        let x = inputs[0].as_slice::<f32>()?;
        outputs[0].as_mut_slice::<f32>()?.iter_mut().zip(x).for_each(|(y, x)| *y = 2.0 * x);
        Ok(())
    }
}

// -------------------------------------------------------------------------------------------------
// errors and panics inside closures

#[test]
fn closure_errors_come_back_unchanged() {
    let x = arr(&[1.0, 2.0, 3.0], &[3]);
    let xs = [x.clone()];
    is_x(transforms::grad(|a: &[Array]| sum_of(fails(a)), &[0])(&xs), "grad");
    is_x(transforms::value_and_grad(fails, &[0])(&xs), "value_and_grad");
    is_x(transforms::vjp(fails, &xs, &xs), "vjp");
    is_x(transforms::jvp(fails, &xs, &xs), "jvp");
    is_x(transforms::vmap(fails, &[], &[])(&xs), "vmap");
    is_x(checkpoint(fails).call(&xs), "checkpoint");
    is_x(transforms::grad(|a: &[Array]| sum_of(checkpoint(fails).call(a)), &[0])(&xs), "grad of checkpoint");
    is_x(compile(fails).call(&xs), "compiled");
    is_x(CustomFunction::new(fails).build().call(&xs), "custom function");
    // Nested: the error crosses two transforms.
    is_x(transforms::grad(|a: &[Array]| sum_of(transforms::vmap(fails, &[], &[])(a)), &[0])(&xs), "grad of vmap");
    // A failing custom rule.
    let f = custom_vjp(cube, |_: &[Array], _: &[Array], _: &[Array]| Err(Error::InvalidArgument("x".into())));
    is_x(transforms::grad(|a: &[Array]| sum_of(f.call(a)), &[0])(&xs), "custom vjp rule");
    for mode in [ExecutionMode::Lazy, ExecutionMode::Eager, ExecutionMode::Compiled] {
        is_x(Executable::new(fails).run_with_mode(mode, &xs), &format!("Executable in {mode:?}"));
    }
}

#[test]
fn closure_panics_become_callback_errors() {
    let x = arr(&[1.0, 2.0, 3.0], &[3]);
    let xs = [x.clone()];
    is_kaboom(transforms::grad(|a: &[Array]| sum_of(panics(a)), &[0])(&xs), "grad");
    is_kaboom(transforms::value_and_grad(panics, &[0])(&xs), "value_and_grad");
    is_kaboom(transforms::vjp(panics, &xs, &xs), "vjp");
    is_kaboom(transforms::jvp(panics, &xs, &xs), "jvp");
    is_kaboom(transforms::vmap(panics, &[], &[])(&xs), "vmap");
    is_kaboom(checkpoint(panics).call(&xs), "checkpoint");
    is_kaboom(compile(panics).call(&xs), "compiled");
    is_kaboom(CustomFunction::new(panics).build().call(&xs), "custom function");
    let f = custom_vjp(cube, |_: &[Array], _: &[Array], _: &[Array]| panic!("kaboom {}", 42));
    is_kaboom(transforms::grad(|a: &[Array]| sum_of(f.call(a)), &[0])(&xs), "custom vjp rule");
    for mode in [ExecutionMode::Lazy, ExecutionMode::Eager, ExecutionMode::Compiled] {
        is_kaboom(Executable::new(panics).run_with_mode(mode, &xs), &format!("Executable in {mode:?}"));
    }
    // Everything still works afterwards.
    let g = transforms::grad(|a: &[Array]| sum_of(cube(a)), &[0])(&xs).unwrap();
    assert_eq!(vals(&g[0]), vec![3.0, 12.0, 27.0]);
}

#[test]
fn argnums_and_loss_shape_errors() {
    let x = arr(&[1.0, 2.0, 3.0], &[3]);
    let loss = |a: &[Array]| sum_of(cube(a));
    let invalid = |r: Result<Vec<Array>>, what: &str| match r {
        Err(Error::InvalidArgument(_)) => {}
        other => panic!("{what}: {other:?}"),
    };
    invalid(transforms::grad(loss, &[])(&[x.clone()]), "empty argnums");
    invalid(transforms::grad(loss, &[1])(&[x.clone()]), "argnum out of range");
    invalid(transforms::value_and_grad(cube, &[])(&[x.clone()]).map(|r| r.1), "value_and_grad, empty argnums");
    invalid(
        transforms::value_and_grad(cube, &[0, 2])(&[x.clone(), x.clone()]).map(|r| r.1),
        "value_and_grad, out of range",
    );
    // A repeated argnum is refused (by MLX).
    assert!(transforms::grad(loss, &[0, 0])(&[x.clone()]).is_err());
    // The loss must be a scalar.
    let r = transforms::grad(|a: &[Array]| &a[0] * 2.0, &[0])(&[x.clone()]);
    assert!(matches!(r, Err(Error::Mlx(_))), "non-scalar loss: {r:?}");
    let r = transforms::value_and_grad(|a: &[Array]| Ok(vec![(&a[0] * 2.0)?]), &[0])(&[x.clone()]);
    assert!(matches!(r, Err(Error::Mlx(_))), "non-scalar loss in value_and_grad: {r:?}");
}

/// `value_and_grad` differentiates the first output (the loss); a function with no outputs has no
/// loss and is an error (MLX alone would return zero gradients).
#[test]
fn value_and_grad_without_outputs_is_an_error() {
    let r = transforms::value_and_grad(|_: &[Array]| Ok(vec![]), &[0])(&[arr(&[1.0, 2.0], &[2])]);
    assert!(r.is_err(), "no outputs: {r:?}");
}

// -------------------------------------------------------------------------------------------------
// compile

/// Makes rmlx bind this thread's MLX default streams (its first op with a stream does), so that
/// trace counts are not disturbed by `compile_first_call_on_a_fresh_thread_traces_once`'s bug.
fn bind_thread() {
    ops::zeros(&[1], Dtype::Float32).unwrap().eval().unwrap();
}

/// MLX keys compiled traces by the thread's default stream; rmlx binds its shared streams as the
/// thread's defaults before compiling or calling a compiled function, so even when a thread's first
/// op runs inside the first trace, the second call replays it.
#[test]
fn compile_first_call_on_a_fresh_thread_traces_once() {
    std::thread::spawn(|| {
        let c = compile(chain);
        let x = arr(&[1.0, 2.0, 3.0], &[3]); // no stream involved yet
        c.call(&[x.clone()]).unwrap();
        c.call(&[x]).unwrap();
        assert_eq!(c.trace_count(), 1);
    })
    .join()
    .unwrap();
}

#[test]
fn compiled_matches_uncompiled() {
    bind_thread();
    let x = ramp(&[4, 8], -2.0, 0.13);
    let c = compile(chain);
    assert_close(&c.call(&[x.clone()]).unwrap()[0], &chain(&[x.clone()]).unwrap()[0], 1e-6, "element-wise chain");
    assert_close(&c.call(&[x.clone()]).unwrap()[0], &chain(&[x.clone()]).unwrap()[0], 1e-6, "replayed");

    let c = compile(reduce_matmul);
    let (a, w) = (ramp(&[3, 5], -1.0, 0.15), ramp(&[5, 4], 0.7, -0.09));
    let got = c.call(&[a.clone(), w.clone()]).unwrap();
    let want = reduce_matmul(&[a, w]).unwrap();
    assert_eq!(got.len(), 2);
    assert_close(&got[0], &want[0], 1e-6, "relu(x @ w).sum(1)");
    assert_close(&got[1], &want[1], 1e-6, "mean + max");
}

#[test]
fn compile_traces_once_per_shape() {
    bind_thread();
    let c = compile(chain);
    assert_eq!(c.trace_count(), 0);
    for k in 0..3 {
        let x = ramp(&[16], k as f32, 0.1);
        assert_close(&c.call(&[x.clone()]).unwrap()[0], &chain(&[x]).unwrap()[0], 1e-6, "same shape");
    }
    assert_eq!(c.trace_count(), 1);
    let y = ramp(&[17], 0.0, 0.1);
    assert_close(&c.call(&[y.clone()]).unwrap()[0], &chain(&[y.clone()]).unwrap()[0], 1e-6, "new shape");
    assert_eq!(c.trace_count(), 2);
    // Both traces are kept.
    c.call(&[ramp(&[16], 0.0, 1.0)]).unwrap();
    c.call(&[y]).unwrap();
    assert_eq!(c.trace_count(), 2);
    // A new dtype is a new trace too.
    c.call(&[ramp(&[16], 0.0, 1.0).astype(Dtype::Float16).unwrap()]).unwrap();
    assert_eq!(c.trace_count(), 3);
}

#[test]
fn shapeless_compile_traces_once_per_rank() {
    bind_thread();
    let c = compile_with(chain, CompileOptions { shapeless: true, ..Default::default() });
    for n in [4, 7, 100, 1] {
        let x = ramp(&[n], -1.0, 0.05);
        assert_close(&c.call(&[x.clone()]).unwrap()[0], &chain(&[x]).unwrap()[0], 1e-6, &format!("size {n}"));
    }
    assert_eq!(c.trace_count(), 1);
    let m = ramp(&[3, 5], -1.0, 0.05);
    assert_close(&c.call(&[m.clone()]).unwrap()[0], &chain(&[m]).unwrap()[0], 1e-6, "rank 2");
    assert_eq!(c.trace_count(), 2);
    let m = ramp(&[6, 2], 1.0, -0.05);
    assert_close(&c.call(&[m.clone()]).unwrap()[0], &chain(&[m]).unwrap()[0], 1e-6, "rank 2, other shape");
    assert_eq!(c.trace_count(), 2);
}

#[test]
fn clearing_the_cache_retraces() {
    bind_thread();
    let c = compile(chain);
    let x = ramp(&[8], 0.0, 0.3);
    let want = chain(&[x.clone()]).unwrap().remove(0);
    c.call(&[x.clone()]).unwrap();
    c.call(&[x.clone()]).unwrap();
    assert_eq!(c.trace_count(), 1);
    c.clear();
    assert_close(&c.call(&[x.clone()]).unwrap()[0], &want, 1e-6, "after clear()");
    assert_eq!(c.trace_count(), 2);
    compile::clear_cache();
    assert_close(&c.call(&[x.clone()]).unwrap()[0], &want, 1e-6, "after clear_cache()");
    assert_eq!(c.trace_count(), 3);
    c.call(&[x]).unwrap();
    assert_eq!(c.trace_count(), 3);
}

#[test]
fn dropping_and_recreating_compiled_functions() {
    bind_thread();
    let x = ramp(&[5], 1.0, 1.0);
    for k in 1..=4 {
        // Each new function may get the address (and cache key) of the dropped one: it must not
        // replay the old trace.
        let c = compile_with(
            move |a: &[Array]| Ok(vec![(&a[0] * k as f32)?]),
            CompileOptions { name: Some(format!("times{k}")), ..Default::default() },
        );
        assert_eq!(
            vals(&c.call(&[x.clone()]).unwrap()[0]),
            vec![k as f32, 2.0 * k as f32, 3.0 * k as f32, 4.0 * k as f32, 5.0 * k as f32]
        );
        assert_eq!(c.trace_count(), 1);
    }
    // Two alive at once keep their own traces.
    let double = compile(|a: &[Array]| Ok(vec![(&a[0] * 2.0)?]));
    let triple = compile(|a: &[Array]| Ok(vec![(&a[0] * 3.0)?]));
    for _ in 0..2 {
        assert_eq!(vals(&double.call(&[x.clone()]).unwrap()[0])[0], 2.0);
        assert_eq!(vals(&triple.call(&[x.clone()]).unwrap()[0])[0], 3.0);
    }
}

#[test]
fn compiled_function_capturing_an_array_fails() {
    bind_thread();
    let w = Arc::new(Mutex::new(arr(&[2.0, 2.0], &[2])));
    let inner = w.clone();
    let c = compile_with(
        move |a: &[Array]| {
            let w = inner.lock().unwrap();
            Ok(vec![(&a[0] * &*w)?])
        },
        CompileOptions { name: Some("captures".into()), ..Default::default() },
    );
    let x = arr(&[1.0, 3.0], &[2]);
    for attempt in 0..3 {
        match c.call(&[x.clone()]) {
            Err(Error::CapturedArray(name)) => assert_eq!(name, "captures"),
            other => panic!("call {attempt}: expected CapturedArray, got {other:?}"),
        }
    }
    // Changing the captured value does not make it work either.
    *w.lock().unwrap() = arr(&[5.0, 5.0], &[2]);
    assert!(matches!(c.call(&[x.clone()]), Err(Error::CapturedArray(_))));
    // Uncompiled, the same closure is fine.
    let exe = Executable::new(move |a: &[Array]| {
        let w = w.lock().unwrap();
        Ok(vec![(&a[0] * &*w)?])
    });
    assert_eq!(vals(&exe.run_with_mode(ExecutionMode::Lazy, &[x.clone()]).unwrap()[0]), vec![5.0, 15.0]);
    assert!(matches!(exe.run_with_mode(ExecutionMode::Compiled, &[x]), Err(Error::CapturedArray(_))));
}

#[test]
fn arrays_made_inside_a_compiled_function_are_fine() {
    bind_thread();
    let c = compile(|a: &[Array]| {
        let scale = Array::from_slice(&[1.0f32, 2.0, 3.0], &[3])?;
        let zero = ops::zeros(&[3], Dtype::Float32)?;
        let one = ops::ones(&[3], Dtype::Float32)?;
        Ok(vec![(((&a[0] * &scale)? + &zero)? + &one)?])
    });
    assert_eq!(vals(&c.call(&[arr(&[1.0, 1.0, 1.0], &[3])]).unwrap()[0]), vec![2.0, 3.0, 4.0]);
    assert_eq!(vals(&c.call(&[arr(&[2.0, 0.0, -1.0], &[3])]).unwrap()[0]), vec![3.0, 1.0, -2.0]);
    assert_eq!(c.trace_count(), 1);
}

/// The gradient of a compiled function: MLX differentiates through the compiled graph.
#[test]
fn grad_of_compiled_function() {
    bind_thread();
    let c = compile(chain);
    let x = ramp(&[6], -1.5, 0.5);
    let got = transforms::grad(|a: &[Array]| sum_of(c.call(a)), &[0])(&[x.clone()]);
    let want = transforms::grad(|a: &[Array]| sum_of(chain(a)), &[0])(&[x.clone()]).unwrap();
    match got {
        Ok(g) => assert_close(&g[0], &want[0], 1e-5, "grad of compiled"),
        Err(e) => panic!("grad of a compiled function failed: {e}"),
    }
    // And jvp / vmap of it.
    let t = ops::ones(&[6], Dtype::Float32).unwrap();
    let (_, jv) = transforms::jvp(|a: &[Array]| c.call(a), &[x.clone()], &[t.clone()]).unwrap();
    assert_close(&jv[0], &want[0], 1e-5, "jvp of compiled (element-wise: the gradient)");
    let m = ramp(&[2, 6], -1.0, 0.2);
    let vm = transforms::vmap(|a: &[Array]| c.call(a), &[Some(0)], &[])(&[m.clone()]).unwrap();
    assert_close(&vm[0], &chain(&[m]).unwrap()[0], 1e-6, "vmap of compiled");
}

/// Compiling a function that takes a gradient.
#[test]
fn compiled_gradient() {
    bind_thread();
    let c = compile(|a: &[Array]| transforms::grad(|b: &[Array]| sum_of(reduce_matmul(b)), &[0, 1])(a));
    let (x, w) = (ramp(&[3, 5], -1.0, 0.15), ramp(&[5, 4], 0.7, -0.09));
    let want = transforms::grad(|b: &[Array]| sum_of(reduce_matmul(b)), &[0, 1])(&[x.clone(), w.clone()]).unwrap();
    for _ in 0..2 {
        let got = c.call(&[x.clone(), w.clone()]).unwrap();
        assert_close(&got[0], &want[0], 1e-5, "d/dx");
        assert_close(&got[1], &want[1], 1e-5, "d/dw");
    }
    assert_eq!(c.trace_count(), 1);
}

// -------------------------------------------------------------------------------------------------
// execution modes

/// A primitive whose CPU evaluation always fails.
struct FailingPrimitive;

impl CustomPrimitive for FailingPrimitive {
    fn name(&self) -> String {
        "FailingPrimitive".into()
    }
    fn output_specs(&self, inputs: &[TensorSpec]) -> Result<Vec<TensorSpec>> {
        Ok(vec![inputs[0].clone()])
    }
    fn eval_cpu(&self, _inputs: &[CpuTensor<'_>], _outputs: &mut [CpuTensorMut<'_>]) -> Result<()> {
        Err(Error::InvalidArgument("eval boom".into()))
    }
}

fn is_eval_failure<T: std::fmt::Debug>(r: Result<T>, what: &str) {
    match r {
        Err(Error::PrimitiveEval(m)) if m.contains("FailingPrimitive") && m.contains("eval boom") => {}
        other => panic!("{what}: expected PrimitiveEval naming the primitive, got {other:?}"),
    }
}

#[test]
fn lazy_mode_reports_primitive_failure_at_evaluation() {
    with_execution_mode(ExecutionMode::Lazy, || {
        let a = arr(&[1.0, 2.0, 3.0], &[3]);
        let b = (&a * 2.0).unwrap();
        let c = apply(FailingPrimitive, &[b.clone()]).unwrap().remove(0);
        let d = (&c + 1.0).unwrap();
        let e = d.exp().unwrap().sum(Axes::All, false).unwrap();
        assert!(!b.is_evaluated() && !e.is_evaluated(), "lazy: nothing evaluated yet");
        is_eval_failure(e.to_vec::<f32>(), "to_vec");

        let f = (&apply(FailingPrimitive, &[a.clone()]).unwrap()[0] * 3.0).unwrap();
        is_eval_failure(f.eval(), "eval");
        let g = apply(FailingPrimitive, &[a.clone()]).unwrap().remove(0);
        is_eval_failure(rmlx::eval([&g, &a]), "rmlx::eval");
        // Nothing left over for the next evaluation.
        assert_eq!(vals(&(&a + 1.0).unwrap()), vec![2.0, 3.0, 4.0]);
    });
}

/// A primitive's CPU failure is reported to the thread that scheduled the evaluation: after an
/// `async_eval`, an unrelated evaluation on another thread is not affected, and reading the failed
/// array on this thread reports the failure.
#[test]
fn primitive_failure_goes_to_the_evaluation_that_ran_it() {
    let bad = apply(FailingPrimitive, &[arr(&[1.0, 2.0], &[2])]).unwrap().remove(0);
    rmlx::async_eval([&bad]).unwrap();
    rmlx::synchronize().unwrap(); // the primitive has run (and failed)
    let unrelated = std::thread::spawn(|| (&arr(&[1.0], &[1]) + 1.0).unwrap().eval()).join().unwrap();
    assert!(unrelated.is_ok(), "an unrelated evaluation on another thread got {unrelated:?}");
    is_eval_failure(bad.to_vec::<f32>(), "reading the failed array");
}

#[test]
fn eager_mode_reports_primitive_failure_at_the_op() {
    with_execution_mode(ExecutionMode::Eager, || {
        assert_eq!(rmlx::execution_mode(), ExecutionMode::Eager);
        let a = arr(&[1.0, 2.0, 3.0], &[3]);
        let b = (&a * 2.0).unwrap();
        assert!(b.is_evaluated(), "eager: evaluated when built");
        let c = (&b + 1.0).unwrap().exp().unwrap();
        assert!(c.is_evaluated());
        match apply(FailingPrimitive, &[c.clone()]) {
            Err(Error::Eager { op, message }) => {
                assert_eq!(op, "FailingPrimitive");
                assert!(message.contains("eval boom"), "{message}");
            }
            other => panic!("expected Err(Eager), got {other:?}"),
        }
        assert!(b.is_evaluated() && c.is_evaluated());
        assert_eq!(vals(&b), vec![2.0, 4.0, 6.0]);
        // Later ops are fine.
        assert_eq!(vals(&(&b - 1.0).unwrap()), vec![1.0, 3.0, 5.0]);
    });
    assert_eq!(rmlx::execution_mode(), ExecutionMode::Lazy, "the override ends with the closure");
}

#[test]
fn eager_mode_evaluates_every_op() {
    let (lazy, lazy_eval) = with_execution_mode(ExecutionMode::Lazy, || {
        let y = chain(&[ramp(&[2, 3], -1.0, 0.4)]).unwrap().remove(0);
        (y.is_evaluated(), vals(&y))
    });
    assert!(!lazy);
    with_execution_mode(ExecutionMode::Eager, || {
        let x = ramp(&[2, 3], -1.0, 0.4);
        let t = x.tanh().unwrap();
        let s = t.sum(1, false).unwrap();
        let m = x.matmul(&x.transpose().unwrap()).unwrap();
        for a in [&t, &s, &m] {
            assert!(a.is_evaluated());
        }
        assert_close(
            &s,
            &with_execution_mode(ExecutionMode::Lazy, || x.tanh().unwrap().sum(1, false).unwrap()),
            1e-7,
            "sum",
        );
        let y = chain(&[x.clone()]).unwrap().remove(0);
        assert!(y.is_evaluated());
        assert_eq!(vals(&y), lazy_eval);
        // An error found while building is still the op's own error.
        assert!(matches!(x.matmul(&x), Err(Error::Mlx(_))));
        // Inside transforms ops stay lazy (tracers cannot be evaluated), and the result is right.
        let g = transforms::grad(|a: &[Array]| sum_of(chain(a)), &[0])(&[x.clone()]).unwrap();
        let want = with_execution_mode(ExecutionMode::Lazy, || {
            transforms::grad(|a: &[Array]| sum_of(chain(a)), &[0])(&[x.clone()]).unwrap()
        });
        assert_close(&g[0], &want[0], 1e-6, "grad in eager mode");
        let vm = transforms::vmap(chain, &[Some(0)], &[])(&[x.clone()]).unwrap();
        assert_close(&vm[0], &chain(&[x.clone()]).unwrap()[0], 1e-6, "vmap in eager mode");
        // A compiled function runs op by op.
        let c = compile(chain);
        assert_close(&c.call(&[x.clone()]).unwrap()[0], &y, 0.0, "compiled in eager mode");
        assert_eq!(c.trace_count(), 0);
    });
}

#[test]
fn executable_in_every_mode() {
    bind_thread();
    let exe = Executable::new(reduce_matmul);
    let inputs = [ramp(&[3, 5], -1.0, 0.15), ramp(&[5, 4], 0.7, -0.09)];
    let want = reduce_matmul(&inputs).unwrap();
    let mut counts = Vec::new();
    for mode in [
        ExecutionMode::Lazy,
        ExecutionMode::Eager,
        ExecutionMode::Compiled,
        ExecutionMode::Compiled,
        ExecutionMode::Lazy,
    ] {
        let out = exe.run_with_mode(mode, &inputs).unwrap();
        assert!(out.iter().all(Array::is_evaluated), "{mode:?}: outputs evaluated");
        for (o, w) in out.iter().zip(&want) {
            assert_close(o, w, 1e-6, &format!("{mode:?}"));
        }
        counts.push(exe.trace_count());
    }
    assert_eq!(counts, vec![0, 0, 1, 1, 1]);
    // `run` follows the thread's mode, or the executable's own.
    with_execution_mode(ExecutionMode::Eager, || exe.run(&inputs).unwrap());
    assert_eq!(exe.trace_count(), 1);
    let fixed = Executable::new(reduce_matmul).with_mode(ExecutionMode::Compiled);
    with_execution_mode(ExecutionMode::Lazy, || fixed.run(&inputs).unwrap());
    assert_eq!(fixed.trace_count(), 1);
    let fresh = Executable::new(reduce_matmul);
    with_execution_mode(ExecutionMode::Compiled, || fresh.run(&inputs).unwrap());
    with_execution_mode(ExecutionMode::Compiled, || {
        fresh.run(&[ramp(&[2, 5], 0.0, 0.1), ramp(&[5, 4], 0.0, 0.1)]).unwrap()
    });
    assert_eq!(fresh.trace_count(), 2);
}

#[test]
fn execution_mode_from_str() {
    assert_eq!("eager".parse::<ExecutionMode>().unwrap(), ExecutionMode::Eager);
    assert_eq!("lazy".parse::<ExecutionMode>().unwrap(), ExecutionMode::Lazy);
    assert_eq!("compiled".parse::<ExecutionMode>().unwrap(), ExecutionMode::Compiled);
    assert_eq!(" Compiled ".parse::<ExecutionMode>().unwrap(), ExecutionMode::Compiled);
    assert_eq!("EAGER".parse::<ExecutionMode>().unwrap(), ExecutionMode::Eager);
    for bad in ["", "fast", "eagerly", "compile"] {
        assert!(matches!(bad.parse::<ExecutionMode>(), Err(Error::InvalidArgument(_))), "{bad:?}");
    }
    assert_eq!(ExecutionMode::default(), ExecutionMode::Lazy);
}

/// Set by the parent test in the child process it starts.
const CHILD: &str = "RMLX_TRANSFORMS_TEST_CHILD";

/// Runs this test binary again with only `test` and `RMLX_MODE=mode`, and checks that it passed.
fn run_child(test: &str, mode: &str) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env("RMLX_MODE", mode)
        .env(CHILD, mode)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child with RMLX_MODE={mode} failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("1 passed"), "the child did not run the test:\n{stdout}");
}

#[test]
fn rmlx_mode_environment_variable() {
    match std::env::var(CHILD).ok().as_deref() {
        None => {
            run_child("rmlx_mode_environment_variable", "eager");
            run_child("rmlx_mode_environment_variable", "Compiled");
            run_child("rmlx_mode_environment_variable", "bogus");
        }
        Some("eager") => {
            assert_eq!(rmlx::execution_mode(), ExecutionMode::Eager);
            let y = (&arr(&[1.0, 2.0], &[2]) * 2.0).unwrap();
            assert!(y.is_evaluated(), "eager from the environment evaluates ops");
            // A thread's override still wins.
            assert_eq!(with_execution_mode(ExecutionMode::Lazy, rmlx::execution_mode), ExecutionMode::Lazy);
            // Other threads see it too.
            assert_eq!(std::thread::spawn(rmlx::execution_mode).join().unwrap(), ExecutionMode::Eager);
        }
        Some("Compiled") => {
            assert_eq!(rmlx::execution_mode(), ExecutionMode::Compiled);
            let exe = Executable::new(chain);
            exe.run(&[ramp(&[4], 0.0, 1.0)]).unwrap();
            assert_eq!(exe.trace_count(), 1);
            rmlx::set_execution_mode(ExecutionMode::Lazy);
            assert_eq!(rmlx::execution_mode(), ExecutionMode::Lazy, "set_execution_mode overrides RMLX_MODE");
        }
        // An unknown value is ignored (with a warning): lazy.
        Some(_) => assert_eq!(rmlx::execution_mode(), ExecutionMode::Lazy),
    }
}

// -------------------------------------------------------------------------------------------------
// custom GPU kernels

#[test]
fn gpu_kernels_without_their_backend_are_unsupported() {
    let backend = fast::gpu_backend();
    if !Device::gpu().is_available() {
        assert_eq!(backend, None, "no GPU device, so no GPU backend");
    }
    let x = arr(&[1.0, 2.0, 3.0], &[3]);
    let launch = KernelLaunch::new([3, 1, 1], [32, 1, 1]).output(&[3], Dtype::Float32);
    let cuda = fast::cuda_kernel("rmlx_test_unsupported_cuda", &["x"], &["y"], "y[0] = x[0];");
    let metal = fast::metal_kernel("rmlx_test_unsupported_metal", &["x"], &["y"], "y[0] = x[0];");
    assert_eq!(cuda.backend(), GpuBackend::Cuda);
    assert_eq!(metal.backend(), GpuBackend::Metal);
    let have = match backend {
        None => "no GPU backend",
        Some(GpuBackend::Cuda) => "the Cuda backend",
        Some(GpuBackend::Metal) => "the Metal backend",
    };
    for (kernel, name) in [(&cuda, "Cuda"), (&metal, "Metal")] {
        if backend == Some(kernel.backend()) {
            continue;
        }
        match kernel.call(&[x.clone()], &launch) {
            Err(Error::Unsupported(m)) => {
                assert!(m.contains(name), "the message names the kernel's backend: {m}");
                assert!(m.contains(have), "the message says what this MLX has ({have}): {m}");
            }
            other => panic!("{name} kernel: expected Unsupported, got {other:?}"),
        }
        assert!(
            matches!(kernel.prepare(&[x.clone()], &launch), Err(Error::Unsupported(_))),
            "{name} kernel: preparing it is unsupported too"
        );
    }
}

/// A prepared CUDA kernel computes what the kernel called each time computes, call after call
/// (each call a new graph node over the same primitive), and refuses inputs of other shapes or
/// dtypes and another stream; runs only where MLX has its CUDA backend.
#[test]
fn prepared_cuda_kernel_repeats_the_kernel() {
    if fast::gpu_backend() != Some(GpuBackend::Cuda) {
        eprintln!("skipped: MLX has no CUDA backend here");
        return;
    }
    let kernel = fast::cuda_kernel(
        "rmlx_test_prepared_axpb",
        &["x", "b"],
        &["y"],
        r#"
        const int i = static_cast<int>(cg::this_grid().thread_rank());
        if (i < N) {
            y[i] = static_cast<T>(A) * x[i] + b[0];
        }"#,
    );
    let launch = KernelLaunch::new([5, 1, 1], [32, 1, 1])
        .output(&[5], Dtype::Float32)
        .template("T", TemplateArg::Dtype(Dtype::Float32))
        .template("N", TemplateArg::Int(5))
        .template("A", TemplateArg::Int(3));
    rmlx::with_device(Device::gpu(), || {
        let b = arr(&[0.5], &[1]);
        let prepared = kernel.prepare(&[arr(&[0.0; 5], &[5]), b.clone()], &launch).unwrap();
        for step in 0..4 {
            let x = arr(&[step as f32, 1.0, -2.0, 4.0, 0.25], &[5]);
            let want: Vec<f32> = x.to_vec::<f32>().unwrap().iter().map(|v| 3.0 * v + 0.5).collect();
            let called = kernel.call(&[x.clone(), b.clone()], &launch).unwrap().remove(0);
            let got = prepared.call(&[x, b.clone()]).unwrap().remove(0);
            assert_eq!(got.to_vec::<f32>().unwrap(), want, "step {step}");
            assert_eq!(called.to_vec::<f32>().unwrap(), want, "step {step}");
        }
        let wrong_shape = prepared.call(&[arr(&[1.0; 4], &[4]), b.clone()]);
        assert!(matches!(wrong_shape, Err(Error::InvalidArgument(_))), "{wrong_shape:?}");
        let wrong_dtype = prepared.call(&[arr(&[1.0; 5], &[5]).astype(Dtype::Float16).unwrap(), b.clone()]);
        assert!(matches!(wrong_dtype, Err(Error::InvalidArgument(_))), "{wrong_dtype:?}");
        let other = Device::gpu().new_stream().unwrap();
        let elsewhere = rmlx::with_stream(other, || prepared.call(&[arr(&[1.0; 5], &[5]), b.clone()]));
        assert!(matches!(elsewhere, Err(Error::InvalidArgument(_))), "{elsewhere:?}");
    });
}

#[test]
fn cuda_kernel_argument_errors() {
    if fast::gpu_backend() != Some(GpuBackend::Cuda) {
        eprintln!("skipped: MLX has no CUDA backend here");
        return;
    }
    let k = fast::cuda_kernel("rmlx_test_arg_errors", &["x"], &["y", "z"], "");
    let x = arr(&[1.0], &[1]);
    let one_output = KernelLaunch::new([1, 1, 1], [1, 1, 1]).output(&[1], Dtype::Float32);
    assert!(matches!(k.call(&[x.clone()], &one_output), Err(Error::InvalidArgument(_))));
    let two = one_output.output(&[1], Dtype::Float32);
    assert!(matches!(k.call(&[x.clone(), x], &two), Err(Error::InvalidArgument(_))));
}

/// A real CUDA kernel; runs only where MLX has its CUDA backend.
///
/// `y = x² + b` and `z = 2x` element-wise over a transposed (not row-contiguous) `x`, read through
/// `x_shape`/`x_strides`/`x_ndim` (so `ensure_row_contiguous(false)`), plus `s = init + Σx` by
/// `atomicAdd` into an output that `init_value` fills first. `N` (element count) and `T` (the
/// element type) are template arguments; the grid is not a multiple of the block, so the tail is
/// guarded. MLX writes the signature
/// `(const float* x, Shape x_shape, Strides x_strides, int x_ndim, const float* b, float* y, float* z, float* s)`.
#[test]
fn cuda_kernel_runs_on_cuda() {
    if fast::gpu_backend() != Some(GpuBackend::Cuda) {
        eprintln!("skipped: MLX has no CUDA backend here");
        return;
    }
    const SOURCE: &str = r#"
        const long long i = static_cast<long long>(cg::this_grid().thread_rank());
        if (i >= N) {
            return;
        }
        long long loc = 0;
        long long rest = i;
        for (int d = x_ndim - 1; d >= 0; --d) {
            loc += (rest % x_shape[d]) * x_strides[d];
            rest /= x_shape[d];
        }
        const T v = x[loc];
        y[i] = v * v + b[0];
        z[i] = static_cast<T>(2) * v;
        atomicAdd(&s[0], v);
    "#;
    let kernel = fast::cuda_kernel("rmlx_test_square_add_strided", &["x", "b"], &["y", "z", "s"], SOURCE)
        .ensure_row_contiguous(false);

    let run = |rows: i32, cols: i32, init: f32| {
        // x is the transpose of a row-major [cols, rows] array: shape [rows, cols], strides [1, rows].
        let n = rows * cols;
        let base = ramp(&[cols, rows], -3.0, 0.25);
        let x = base.transpose().unwrap();
        let b = arr(&[0.5], &[1]);
        let launch = KernelLaunch::new([n, 1, 1], [32, 1, 1])
            .output(&[rows, cols], Dtype::Float32)
            .output(&[rows, cols], Dtype::Float32)
            .output(&[1], Dtype::Float32)
            .template("N", TemplateArg::Int(n))
            .template("T", TemplateArg::Dtype(Dtype::Float32))
            .init_value(init);
        let out = kernel.call(&[x.clone(), b], &launch).unwrap();
        assert_eq!(out.len(), 3);
        let xv = vals(&x); // row-major values of the transposed view
        let y_want: Vec<f32> = xv.iter().map(|v| v * v + 0.5).collect();
        let z_want: Vec<f32> = xv.iter().map(|v| 2.0 * v).collect();
        assert_eq!(out[0].shape(), &[rows, cols]);
        assert_eq!(vals(&out[0]), y_want, "y = x² + b");
        assert_eq!(vals(&out[1]), z_want, "z = 2x");
        let s_want = init + xv.iter().sum::<f32>();
        let s = vals(&out[2])[0];
        assert!((s - s_want).abs() <= 1e-4 * s_want.abs().max(1.0), "s = init + Σx: {s} vs {s_want}");
    };
    run(8, 5, 0.5); // 40 threads: two blocks of 32, the second partly idle
    run(3, 4, -2.0); // another N: another instantiation of the same kernel
    run(8, 5, 1.5); // the first instantiation again, from MLX's cache
}

/// Writes `value` (input 1, one float) at position `at` of the buffer (input 0), in place.
struct WriteAt {
    at: usize,
    mode: rmlx::custom::InPlace,
}

impl CustomPrimitive for WriteAt {
    fn name(&self) -> String {
        "WriteAt".into()
    }
    fn output_specs(&self, inputs: &[TensorSpec]) -> Result<Vec<TensorSpec>> {
        Ok(vec![inputs[0].clone()])
    }
    fn in_place(&self) -> (Vec<(usize, usize)>, rmlx::custom::InPlace) {
        (vec![(0, 0)], self.mode)
    }
    fn eval_cpu(&self, inputs: &[CpuTensor<'_>], outputs: &mut [CpuTensorMut<'_>]) -> Result<()> {
        assert!(inputs[0].as_slice::<f32>()?.is_empty(), "an input taken over reads as empty");
        let value = inputs[1].as_slice::<f32>()?[0];
        outputs[0].as_mut_slice::<f32>()?[self.at] = value;
        Ok(())
    }
}

/// Outputs that update an input in place on the CPU: they start as the input's contents; with
/// `Owned` the input's own buffer is written (an array still holding it sees the write), with
/// `Unshared` a held input is copied first and keeps its values; a mismatched pair is an error.
#[test]
fn custom_outputs_update_their_inputs_in_place() {
    use rmlx::custom::InPlace;
    rmlx::with_device(Device::cpu(), || {
        for mode in [InPlace::Unshared, InPlace::Owned] {
            let buffer = arr(&[1.0, 2.0, 3.0, 4.0], &[4]);
            buffer.eval().unwrap();
            let first = &apply(WriteAt { at: 1, mode }, &[buffer.clone(), arr(&[20.0], &[1])]).unwrap()[0];
            let second = &apply(WriteAt { at: 3, mode }, &[first.clone(), arr(&[40.0], &[1])]).unwrap()[0];
            assert_eq!(vals(second), [1.0, 20.0, 3.0, 40.0], "{mode:?}: both writes, the rest kept");
            let held = match mode {
                InPlace::Owned => vec![1.0, 20.0, 3.0, 40.0],
                InPlace::Unshared => vec![1.0, 2.0, 3.0, 4.0],
            };
            assert_eq!(vals(&buffer), held, "{mode:?}: the array still holding the first buffer");
        }
    });
    struct Mismatched;
    impl CustomPrimitive for Mismatched {
        fn name(&self) -> String {
            "Mismatched".into()
        }
        fn output_specs(&self, _inputs: &[TensorSpec]) -> Result<Vec<TensorSpec>> {
            Ok(vec![TensorSpec::new(&[2], Dtype::Float32)])
        }
        fn in_place(&self) -> (Vec<(usize, usize)>, rmlx::custom::InPlace) {
            (vec![(0, 0)], rmlx::custom::InPlace::Owned)
        }
        fn eval_cpu(&self, _inputs: &[CpuTensor<'_>], _outputs: &mut [CpuTensorMut<'_>]) -> Result<()> {
            Ok(())
        }
    }
    match apply(Mismatched, &[arr(&[1.0, 2.0, 3.0], &[3])]) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("another shape or dtype"), "{m}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}
