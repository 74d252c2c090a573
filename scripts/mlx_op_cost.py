"""Host cost of one operation of MLX's CUDA backend, by kind: chains of N operations built, handed to
the device (`mx.async_eval`, which encodes every operation on the host) and waited for, timed
apart. One JSON line a kind: microseconds a chain step to build and to encode (the matmul rows
include the `sum * 0 +` that keeps the chain going; subtract the baseline row). Run on the GPU
machine with MLX's CUDA build: python3 scripts/mlx_op_cost.py"""
import json

import mlx.core as mx

from chain_timing import time_chain

N = 1000
x = mx.random.normal((1664, 1024)).astype(mx.bfloat16)
w = (mx.random.normal((1024, 1024)) * 0.03).astype(mx.bfloat16)
a = (mx.random.normal((1024, 8)) * 0.03).astype(mx.bfloat16)
g = (mx.random.normal((1664, 8)) * 0.03).astype(mx.bfloat16)
mx.eval(x, w, a, g)
kinds = {
    "matmul 1664x1024x1024": lambda y: y @ w,
    "matmul 1664x1024x8 (x@A)": lambda y: y + (y @ a).sum() * 0,
    "matmul weight grad 1024x1664x8 (x^T g)": lambda y: y + (y.T @ g).sum() * 0,
    "add": lambda y: y + 1,
    "sum*0 + add (baseline of the two matmul rows)": lambda y: y + y.sum() * 0,
    "transpose view + add": lambda y: y.T.T + 1,
    "reshape view + add": lambda y: y.reshape(-1).reshape(1664, 1024) + 1,
}
for name, f in kinds.items():
    # Two warm-up chains, then one timed.
    t = time_chain(f, x, N, reps=3, warm=2)
    print(json.dumps({"kind": name, "build_us": round(t["build"], 2), "encode_us_per_chain_step": round(t["launch"], 2),
                      "wait_ms": round(t["wait"] * N / 1e3, 2)}), flush=True)
