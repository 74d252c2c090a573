"""Host cost of MLX operations, timed over chains: `f` applied N times from `x`, built, handed to the
device (`mx.async_eval`, which encodes every operation on the host) and waited for, each phase
timed apart. Shared by mlx_op_cost.py and custom_kernel_cost.py."""
import time

import mlx.core as mx


def time_chain(f, x, n, reps, warm):
    """Per-node microseconds of the chain `f(f(...f(x)))` (n applications): `build` (making it),
    `launch` (`mx.async_eval`), `wait` (then `mx.eval`) and `total` (launch + wait), each the
    median (the upper one of an even count) of the `reps - warm` repetitions after `warm` warm-up
    ones."""
    rows = []
    for rep in range(reps):
        t0 = time.perf_counter()
        y = x
        for _ in range(n):
            y = f(y)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        if rep >= warm:
            rows.append({"build": t1 - t0, "launch": t2 - t1, "wait": t3 - t2, "total": t3 - t1})
    return {k: sorted(r[k] for r in rows)[len(rows) // 2] / n * 1e6 for k in rows[0]}
