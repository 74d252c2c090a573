# Host time a graph node costs on MLX's CUDA backend: a built-in Add against custom kernels of 1
# or 10 inputs, a short or a 9 KB source, 1 or 12 template arguments, and one called through
# mx.compile. Each variant evaluates chains of N nodes; "build" is making the chain, "launch"
# mx.async_eval (MLX encoding every node), "launch+wait" until the result is there; medians of
# 10 repetitions after 3 warm-up ones, per node.
# Usage (on the GPU machine, with MLX's CUDA build importable): python3 scripts/custom_kernel_cost.py
import mlx.core as mx

from chain_timing import time_chain

N = 300
x = mx.ones((1, 4096), dtype=mx.bfloat16)
extra = [mx.full((16,), float(i), dtype=mx.bfloat16) for i in range(9)]
mx.eval(x, *extra)
body = """
    auto i = cg::this_grid().thread_rank();
    if (i < 4096) { y[i] = x[i] + static_cast<T>(1.0f); }
"""
pad = "\n".join("    // " + "p" * 90 for _ in range(95))
k1 = mx.fast.cuda_kernel("ck1", ["x"], ["y"], body)
k10 = mx.fast.cuda_kernel("ck10", ["x"] + [f"e{i}" for i in range(9)], ["y"], body)
kbig = mx.fast.cuda_kernel("ckbig", ["x"], ["y"], pad + body)
def call(k, ins, tmpl):
    return k(inputs=ins, template=tmpl, grid=(4096, 1, 1), threadgroup=(256, 1, 1),
             output_shapes=[(1, 4096)], output_dtypes=[mx.bfloat16])[0]
t1 = [("T", mx.bfloat16)]
t12 = [("T", mx.bfloat16)] + [(f"A{i}", i + 3) for i in range(11)]
variants = {
    "builtin add": lambda y: y + 1,
    "custom, 1 input": lambda y: call(k1, [y], t1),
    "custom, 10 inputs": lambda y: call(k10, [y] + extra, t1),
    "custom, 9 KB source": lambda y: call(kbig, [y], t1),
    "custom, 12 template args": lambda y: call(k1, [y], t12),
    "compiled custom, 1 input": mx.compile(lambda y: call(k1, [y], t1)),
}
for label, f in variants.items():
    t = time_chain(f, x, N, reps=13, warm=3)
    print(f"{label:28s} build {t['build']:5.2f} µs/node, launch {t['launch']:5.2f}, launch+wait {t['total']:5.2f}", flush=True)
