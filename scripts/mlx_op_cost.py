"""Host cost of one operation of MLX's CUDA backend, by kind: chains of N operations built, handed to
the device (`mx.async_eval`, which encodes every operation on the host) and waited for, timed
apart. One JSON line a kind: microseconds a chain step to build and to encode (the matmul rows
include the `sum * 0 +` that keeps the chain going; subtract the baseline row). Run on the GPU
machine with MLX's CUDA build: python3 scripts/mlx_op_cost.py"""
import time, json, mlx.core as mx
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
    for rep in range(3):
        t0 = time.perf_counter()
        y = x
        for _ in range(N):
            y = f(y)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
    print(json.dumps({"kind": name, "build_us": round((t1 - t0) / N * 1e6, 2), "encode_us_per_chain_step": round((t2 - t1) / N * 1e6, 2),
                      "wait_ms": round((t3 - t2) * 1e3, 2)}), flush=True)
