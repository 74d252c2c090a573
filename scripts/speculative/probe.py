"""Where a verification pass's time goes on MLX CUDA: a [1, L] step over a 512-position cache, repeated at the
same offset (trimmed back) and at new offsets, for L = 1..5; qwen3-8b 4-bit through mlx-lm's model."""
import sys, time, pathlib
import mlx.core as mx
from mlx_lm.utils import load_model
from mlx_lm.models.cache import make_prompt_cache
m, _ = load_model(pathlib.Path(sys.argv[1]))
c = make_prompt_cache(m)
mx.eval(m(mx.array([[(i * 7919) % 50000 + 10 for i in range(512)]]), cache=c))
def step(L, trim):
    t = time.perf_counter(); y = m(mx.array([[11] * L]), cache=c); mx.eval(y); dt = (time.perf_counter() - t) * 1000
    if trim:
        for cc in c: cc.trim(L)
    return round(dt, 2)
for L in [1, 2, 3, 5]:
    print("L", L, "same offset:", [step(L, True) for _ in range(5)], "new offsets:", [step(L, False) for _ in range(5)], flush=True)
