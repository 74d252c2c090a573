#!/usr/bin/env python3
"""mlx-lm's side of the quantised key/value cache benchmark: peer_bench.py's protocol (prompt ids
``(i * 7919) % 50000 + 10``, greedy, one warm-up) at a long context, with mlx-lm's ``kv_bits``,
``kv_group_size`` and ``quantized_kv_start``. Prints one JSON line (peer_bench.py's keys, plus
``kv_bits``), to set beside ``rmlx bench --json --kv-bits …`` run in the same device call.

    python3 scripts/kv_peer_bench.py MODEL_DIR -p 32768 -g 64 [--kv-bits 8 --kv-group-size 64 --quantized-kv-start 0]
"""
import argparse, json, pathlib, statistics, time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model

ap = argparse.ArgumentParser()
ap.add_argument("model"); ap.add_argument("-p", type=int, default=8192)
ap.add_argument("-g", type=int, default=64); ap.add_argument("-n", type=int, default=1)
ap.add_argument("--kv-bits", type=int, default=None); ap.add_argument("--kv-group-size", type=int, default=64)
ap.add_argument("--quantized-kv-start", type=int, default=5000)
a = ap.parse_args()
model, _ = load_model(pathlib.Path(a.model))
prompt = mx.array([(i * 7919) % 50000 + 10 for i in range(a.p)])
kv = dict(kv_bits=a.kv_bits, kv_group_size=a.kv_group_size, quantized_kv_start=a.quantized_kv_start)


def run(n_gen):
    t0 = time.perf_counter(); first = None; n = 0
    for _ in zip(range(n_gen), generate_step(prompt, model, max_tokens=n_gen, **kv)):
        if first is None:
            first = time.perf_counter()
        n += 1
    return first - t0, (n - 1) / (time.perf_counter() - first)


run(8)
mx.reset_peak_memory()
ttft, dec = zip(*[run(a.g) for _ in range(a.n)])
t = statistics.median(ttft)
print(json.dumps(dict(peer="mlx-lm", model=pathlib.Path(a.model).name, prompt_tokens=a.p, gen_tokens=a.g,
      kv_bits=a.kv_bits, ttft_ms=round(1000 * t, 2), prefill_tok_s=round(a.p / t, 1),
      decode_tok_s=round(statistics.median(dec), 1), peak_gb=round(mx.get_peak_memory() / 1e9, 3))), flush=True)
