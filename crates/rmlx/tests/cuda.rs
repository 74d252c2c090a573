//! Kernels of rmlx's own on MLX's CUDA backend (`rmlx::cuda`): where they are unavailable, the
//! error; where MLX's CUDA backend is loaded, that they run as graph nodes over the arrays they are
//! called on (contiguous or not, several kernels in one launch, call after call) and that NVRTC's
//! and the driver's errors come back as `Err`; kernels that start before the kernel before them ends;
//! a graph of launches captured and replayed as one,
//! and (on every backend) the capture refusing graphs of other operations with the reason.

use rmlx::cuda::{self, CudaLaunch, InPlace, KernelArg, KernelNode};
use rmlx::fast::{self, GpuBackend};
use rmlx::{Array, Dtype, Error};

const SOURCE: &str = r#"
extern "C" __global__ void rmlx_test_affine(const float* x, float* y, float a, float b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + b;
}"#;

fn on_cuda() -> bool {
    fast::gpu_backend() == Some(GpuBackend::Cuda)
}

/// `y = a·x + b` over `n` values read from `input` and written to `output`.
fn affine(input: KernelArg, output: u32, a: f32, b: f32, n: u32) -> KernelNode {
    let function = cuda::compile("rmlx_test_affine", SOURCE, None).expect("compiles");
    let args = vec![input, KernelArg::Output(output), KernelArg::F32(a), KernelArg::F32(b), KernelArg::I32(n as i32)];
    KernelNode { function, grid: [n.div_ceil(64), 1, 1], block: [64, 1, 1], shared_bytes: 0, args }
}

#[test]
fn own_kernels_need_mlx_cuda_backend() {
    if on_cuda() {
        assert_eq!(cuda::unavailable(), None, "MLX's CUDA backend is loaded: rmlx's kernels can run");
        return;
    }
    let why = cuda::unavailable().expect("no CUDA backend, so no kernels of rmlx's own");
    assert!(why.contains("no CUDA backend"), "{why}");
    match cuda::compile("rmlx_test_affine", SOURCE, None) {
        Err(Error::Unsupported(m)) => assert!(m.contains("rmlx_test_affine") && m.contains("no CUDA backend"), "{m}"),
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

/// Two kernels in one launch (the second reads the first's output), over a transposed input (made
/// contiguous first), ten calls over one prepared launch and one on another stream, each compared
/// with the values computed here.
#[test]
fn own_kernels_run_in_order_over_any_input_layout() {
    if !on_cuda() {
        eprintln!("skipped: MLX has no CUDA backend here");
        return;
    }
    let n = 6 * 100;
    let first = affine(KernelArg::Input(0), 0, 2.0, 1.0, n);
    let second = affine(KernelArg::Output(0), 1, -0.5, 3.0, n);
    let outputs = [(vec![100, 6], Dtype::Float32), (vec![100, 6], Dtype::Float32)];
    let launch = CudaLaunch::new("rmlx_test_two_affine", &[first, second], &outputs).unwrap();
    let values: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 7.0).collect();
    let x = Array::from_slice(&values, &[6, 100]).unwrap();
    let xt = x.transpose().unwrap();
    let expected_first: Vec<f32> = xt.to_vec::<f32>().unwrap().iter().map(|v| 2.0 * v + 1.0).collect();
    let expected_second: Vec<f32> = expected_first.iter().map(|v| -0.5 * v + 3.0).collect();
    for call in 0..10 {
        let out = launch.call(std::slice::from_ref(&xt)).unwrap();
        assert_eq!(out[0].shape(), [100, 6]);
        assert_eq!(out[0].to_vec::<f32>().unwrap(), expected_first, "call {call}: first kernel");
        assert_eq!(out[1].to_vec::<f32>().unwrap(), expected_second, "call {call}: second kernel");
    }
    // On another stream than the one it was prepared for, the launch is made again for the call.
    let stream = rmlx::Device::gpu().new_stream().unwrap();
    let out = rmlx::with_stream(stream, || launch.call(std::slice::from_ref(&xt))).unwrap();
    assert_eq!(out[1].to_vec::<f32>().unwrap(), expected_second, "another stream");
    match launch.call(&[]) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("reads 1 inputs and 0 values, got 0 and 0"), "{m}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

/// The kernel of the overlap test: `y[i] = x[n - 1 - i] + b`, each value read from another block
/// than the one writing it, after a busy first stretch in the first block (so that later kernels,
/// started early, would read old values if they did not wait).
const OVERLAP_SOURCE: &str = r#"
extern "C" __global__ void rmlx_test_reverse_add(const float* x, float* y, float b, int n) {
    rmlx_wait_previous();
    rmlx_release_next();
    if (blockIdx.x == 0) {
        volatile float spin = 0.0f;
        for (int k = 0; k < 20000; ++k) spin = spin * 0.5f + 1.0f;
    }
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[n - 1 - i] + b;
}"#;

/// Kernels that follow `cuda::OVERLAP` in one launch (2 and 9 nodes, an ordinary kernel among the
/// 9): each output equals the values computed here, call after call; on a GPU of compute
/// capability 9.0 or later the kernels do start early (`overlap_unavailable` is `None`).
#[test]
fn overlapping_kernels_read_what_the_kernel_before_wrote() {
    if !on_cuda() {
        assert!(cuda::overlap_unavailable().is_some(), "no CUDA backend: nothing starts early");
        eprintln!("skipped: MLX has no CUDA backend here");
        return;
    }
    match cuda::overlap_unavailable() {
        None => {}
        Some(why) => assert!(why.contains("compute capability"), "kernels do not start early: {why}"),
    }
    let source = format!("{}{OVERLAP_SOURCE}", cuda::OVERLAP);
    let function = cuda::compile("rmlx_test_reverse_add", &source, None).expect("compiles").overlapping();
    assert!(function.overlaps());
    let n: u32 = 1 << 20;
    let reverse_add = |input: KernelArg, output: u32, b: f32| {
        let args = vec![input, KernelArg::Output(output), KernelArg::F32(b), KernelArg::I32(n as i32)];
        KernelNode { function: function.clone(), grid: [n / 256, 1, 1], block: [256, 1, 1], shared_bytes: 0, args }
    };
    let values: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
    let x = Array::from_slice(&values, &[n as i32]).unwrap();
    for count in [2u32, 9] {
        let nodes: Vec<KernelNode> = (0..count)
            .map(|k| {
                let input = if k == 0 { KernelArg::Input(0) } else { KernelArg::Output(k - 1) };
                if k == 4 {
                    affine(input, k, 1.0, 0.5, n)
                } else {
                    reverse_add(input, k, 1.0 + k as f32)
                }
            })
            .collect();
        let outputs: Vec<_> = (0..count).map(|_| (vec![n as i32], Dtype::Float32)).collect();
        let launch = CudaLaunch::new("rmlx_test_overlap", &nodes, &outputs).unwrap();
        let mut expected = Vec::new();
        let mut current = values.clone();
        for k in 0..count {
            current = if k == 4 {
                current.iter().map(|v| v + 0.5).collect()
            } else {
                current.iter().rev().map(|v| v + 1.0 + k as f32).collect()
            };
            expected.push(current.clone());
        }
        for call in 0..10 {
            let out = launch.call(std::slice::from_ref(&x)).unwrap();
            for (k, want) in expected.iter().enumerate() {
                assert_eq!(&out[k].to_vec::<f32>().unwrap(), want, "{count} nodes, call {call}, node {k}");
            }
        }
    }
}

/// A parameter given per call (`KernelArg::Value`): each call's value reaches its own outputs,
/// calls pending together included; a missing or non-scalar value is an error.
#[test]
fn values_given_per_call_reach_their_call() {
    if !on_cuda() {
        eprintln!("skipped: MLX has no CUDA backend here");
        return;
    }
    let mut node = affine(KernelArg::Input(0), 0, 2.0, 0.0, 4);
    node.args[3] = KernelArg::Value(0);
    let launch = CudaLaunch::new("rmlx_test_value", &[node], &[(vec![4], Dtype::Float32)]).unwrap();
    let x = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[4]).unwrap();
    let outs: Vec<Array> = (0..3)
        .map(|b| launch.call_with(std::slice::from_ref(&x), &[KernelArg::F32(b as f32 * 10.0)]).unwrap().remove(0))
        .collect();
    for (b, out) in outs.iter().enumerate() {
        let want: Vec<f32> = [1.0f32, 2.0, 3.0, 4.0].iter().map(|v| 2.0 * v + b as f32 * 10.0).collect();
        assert_eq!(out.to_vec::<f32>().unwrap(), want, "call {b}");
    }
    match launch.call(std::slice::from_ref(&x)) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("1 values, got 1 and 0"), "{m}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    match launch.call_with(std::slice::from_ref(&x), &[KernelArg::Input(0)]) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("must be a scalar"), "{m}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn compile_errors_come_back_as_errors() {
    if !on_cuda() {
        eprintln!("skipped: MLX has no CUDA backend here");
        return;
    }
    let broken = "extern \"C\" __global__ void rmlx_test_broken(float* y) { y[0] = undeclared_name; }";
    let message = cuda::compile("rmlx_test_broken", broken, None).unwrap_err().to_string();
    assert!(message.contains("NVRTC") && message.contains("undeclared_name"), "{message}");
    let message = cuda::compile("rmlx_test_not_in_source", SOURCE, None).unwrap_err().to_string();
    assert!(message.contains("cuModuleGetFunction(rmlx_test_not_in_source)"), "{message}");
}

/// An output updating an input in place (`CudaLaunch::updating`): the kernel writes only part of
/// it, the rest keeps the input's values. `InPlace::Unshared`: an input still held elsewhere keeps
/// its own values (the kernel updated a copy), one held by nothing else lends its buffer.
/// `InPlace::Owned`: the input's own buffer even while held, so the holder sees the update.
#[test]
fn in_place_outputs_keep_arrays_values_or_update_owned_buffers() {
    if !on_cuda() {
        eprintln!("skipped: MLX has no CUDA backend here");
        return;
    }
    // y[0..4] = 2·x[0..4] + 1 into the buffer of input 0; y[4..] untouched.
    let node = affine(KernelArg::Input(1), 0, 2.0, 1.0, 4);
    let outputs = [(vec![8], Dtype::Float32)];
    let launch =
        CudaLaunch::updating("rmlx_test_in_place", std::slice::from_ref(&node), &outputs, &[(0, 0)], InPlace::Unshared);
    let launch = launch.unwrap();
    let buffer = Array::from_slice(&[9.0f32; 8], &[8]).unwrap();
    let x = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[4]).unwrap();
    let want = [3.0f32, 5.0, 7.0, 9.0, 9.0, 9.0, 9.0, 9.0];
    let held = launch.call(&[buffer.clone(), x.clone()]).unwrap();
    assert_eq!(held[0].to_vec::<f32>().unwrap(), want);
    assert_eq!(buffer.to_vec::<f32>().unwrap(), [9.0f32; 8], "a held input keeps its values");
    let fresh = (Array::from_slice(&[8.0f32; 8], &[8]).unwrap() + 1.0).unwrap();
    let lent = launch.call(&[fresh, x.clone()]).unwrap();
    assert_eq!(lent[0].to_vec::<f32>().unwrap(), want);

    let owned = CudaLaunch::updating("rmlx_test_in_place", &[node], &outputs, &[(0, 0)], InPlace::Owned).unwrap();
    let updated = owned.call(&[buffer.clone(), x]).unwrap();
    assert_eq!(updated[0].to_vec::<f32>().unwrap(), want);
    assert_eq!(buffer.to_vec::<f32>().unwrap(), want, "an owned buffer is updated where it is");
}

const CAPTURE_SOURCE: &str = r#"
extern "C" __global__ void rmlx_test_mul(const float* a, const float* b, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] * b[i];
}
extern "C" __global__ void rmlx_test_accumulate(float* acc, const float* x, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) acc[i] += s * x[i];
}"#;

/// A graph of four launches (an affine map, a reshape, a product with a constant made by an MLX
/// operation, an in-place accumulation into a varying buffer with a per-call value, another affine
/// map) captured from its lazy arrays and replayed over new inputs and values: the results and the
/// accumulated buffer (read through the handle it had) as computed here, call after call; an MLX operation on the varying path
/// refuses the capture; varying arrays of another shape are an error.
#[test]
fn captured_launches_replay_over_new_inputs() {
    if !on_cuda() {
        eprintln!("skipped: MLX has no CUDA backend here");
        return;
    }
    use rmlx::cuda::capture::{capture, Capture};
    let n = 256u32;
    let function = |name| cuda::compile(name, CAPTURE_SOURCE, None).expect("compiles");
    let grid = [n.div_ceil(64), 1, 1];
    let shape = vec![n as i32];
    let first = CudaLaunch::new(
        "rmlx_test_first",
        &[affine(KernelArg::Input(0), 0, 2.0, 1.0, n)],
        &[(shape.clone(), Dtype::Float32)],
    )
    .unwrap();
    let args = vec![KernelArg::Input(0), KernelArg::Input(1), KernelArg::Output(0), KernelArg::I32(n as i32)];
    let mul = KernelNode { function: function("rmlx_test_mul"), grid, block: [64, 1, 1], shared_bytes: 0, args };
    let mul = CudaLaunch::new("rmlx_test_mul", &[mul], &[(shape.clone(), Dtype::Float32)]).unwrap();
    let args = vec![KernelArg::Output(0), KernelArg::Input(1), KernelArg::Value(0), KernelArg::I32(n as i32)];
    let acc = KernelNode { function: function("rmlx_test_accumulate"), grid, block: [64, 1, 1], shared_bytes: 0, args };
    let acc =
        CudaLaunch::updating("rmlx_test_acc", &[acc], &[(shape.clone(), Dtype::Float32)], &[(0, 0)], InPlace::Owned)
            .unwrap();
    let last = CudaLaunch::new(
        "rmlx_test_last",
        &[affine(KernelArg::Input(0), 0, -1.0, 0.5, n)],
        &[(shape.clone(), Dtype::Float32)],
    )
    .unwrap();

    let w0: Vec<f32> = (0..n).map(|i| 1.0 + (i % 7) as f32 * 0.5).collect();
    let w = (&Array::from_slice(&w0, &[n as i32]).unwrap() + 1.0f32).unwrap();
    // The step: result = -(acc + s·(2x + 1)·w) + 0.5, acc updated in place.
    let step = |x: &Array, a: &Array, s: f32| -> (Array, Array) {
        let y = first
            .call(std::slice::from_ref(x))
            .unwrap()
            .remove(0)
            .reshape(&[1, n as i32])
            .unwrap()
            .reshape(&[n as i32])
            .unwrap();
        let z = mul.call(&[y, w.clone()]).unwrap().remove(0);
        let a = acc.call_with(&[a.clone(), z], &[KernelArg::F32(s)]).unwrap().remove(0);
        (last.call(std::slice::from_ref(&a)).unwrap().remove(0), a)
    };
    let expect = |x: &[f32], a: &mut [f32], s: f32| -> Vec<f32> {
        (0..n as usize)
            .map(|i| {
                a[i] += s * ((2.0 * x[i] + 1.0) * (w0[i] + 1.0));
                -a[i] + 0.5
            })
            .collect()
    };
    let xs = |k: u32| -> Vec<f32> { (0..n).map(|i| (i as f32 - 100.0) * 0.125 + k as f32).collect() };
    let mut host_acc = vec![0.0f32; n as usize];
    let mut a = rmlx::ops::zeros(&[n as i32], Dtype::Float32).unwrap();
    a.eval().unwrap();

    // The first call builds the graph, is captured, then evaluated as it is.
    let x = Array::from_slice(&xs(0), &shape).unwrap();
    let (result, a_next) = step(&x, &a, 0.5);
    let Capture::Captured(captured) = capture("rmlx_test_step", &result, &[&x, &a], &[KernelArg::F32(0.5)]).unwrap()
    else {
        panic!("all launches")
    };
    assert_eq!(captured.kernels(), 4);
    assert_eq!(result.to_vec::<f32>().unwrap(), expect(&xs(0), &mut host_acc, 0.5), "the graph as built");
    a = a_next;
    for k in 1..6u32 {
        let s = 0.25 * k as f32;
        let x = Array::from_slice(&xs(k), &shape).unwrap();
        let result = captured.call(&[&x, &a], &[KernelArg::F32(s)]).unwrap();
        assert_eq!(result.to_vec::<f32>().unwrap(), expect(&xs(k), &mut host_acc, s), "replay {k}");
        // Updated in its buffer: the same handle reads the sum.
        assert_eq!(a.to_vec::<f32>().unwrap(), host_acc, "replay {k}: the accumulator");
    }
    // Varying arrays of other shapes are refused.
    let short = rmlx::ops::zeros(&[8], Dtype::Float32).unwrap();
    match captured.call(&[&short, &a], &[KernelArg::F32(1.0)]) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("varying arrays differ"), "{m}"),
        Err(e) => panic!("expected InvalidArgument, got {e:?}"),
        Ok(_) => panic!("expected InvalidArgument, got a replay"),
    }
    // An MLX operation between the varying input and the result: nothing to capture.
    let x = Array::from_slice(&xs(9), &shape).unwrap();
    let y = first.call(&[x.exp().unwrap()]).unwrap().remove(0);
    match capture("rmlx_test_exp", &y, &[&x], &[]).unwrap() {
        Capture::Refused(why) => assert_eq!(why, "a Exp operation reads a varying array"),
        Capture::Captured(_) => panic!("an MLX operation was captured"),
    }
    // A call value that is not among the capture's values: nothing to capture.
    let (result, _) = step(&x, &a, 3.0);
    match capture("rmlx_test_value", &result, &[&x, &a], &[KernelArg::F32(0.5)]).unwrap() {
        Capture::Refused(why) => assert_eq!(why, "rmlx_test_acc takes a call value not among the capture's"),
        Capture::Captured(_) => panic!("a call value was captured"),
    }
}

/// Off MLX's CUDA backend too, the capture reads a graph back and says why it cannot take it: an
/// MLX operation on the varying path, or a result that no launch makes.
#[test]
fn captures_refuse_graphs_that_are_not_launches() {
    use rmlx::cuda::capture::{capture, Capture};
    let x = Array::from_slice(&[1.0f32, 2.0], &[2]).unwrap();
    let y = (&x.exp().unwrap() + 1.0f32).unwrap().reshape(&[1, 2]).unwrap();
    match capture("rmlx_test_mlx", &y, &[&x], &[]).unwrap() {
        Capture::Refused(why) => assert_eq!(why, "a Exp operation reads a varying array"),
        Capture::Captured(_) => panic!("MLX operations were captured"),
    }
    match capture("rmlx_test_varying", &x, &[&x], &[]).unwrap() {
        Capture::Refused(why) => assert_eq!(why, "the result is not a launch's output"),
        Capture::Captured(_) => panic!("a varying array was captured"),
    }
    // A result that depends on no varying array is a constant, not a launch's output.
    let w = Array::from_slice(&[3.0f32], &[1]).unwrap();
    match capture("rmlx_test_constant", &w.exp().unwrap(), &[&x], &[]).unwrap() {
        Capture::Refused(why) => assert_eq!(why, "the result is not a launch's output"),
        Capture::Captured(_) => panic!("a constant was captured"),
    }
    // The graph is left as it was (MLX's exponential may differ from Rust's in the last bit).
    let got = y.to_vec::<f32>().unwrap();
    for (g, want) in got.iter().zip([1.0f32.exp() + 1.0, 2.0f32.exp() + 1.0]) {
        assert!((g - want).abs() <= 1e-5 * want, "{got:?}");
    }
}
