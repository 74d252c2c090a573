"""mlx-lm's speculative decoding beside its plain decoding, same prompt ids as rmlx's run (i*7919 % 50000 + 10),
greedy; one warm-up each. Prints one JSON line per setting."""
import argparse, json, time, pathlib
import mlx.core as mx
from mlx_lm.utils import load_model
from mlx_lm.generate import generate_step, speculative_generate_step
ap = argparse.ArgumentParser()
ap.add_argument("model"); ap.add_argument("draft"); ap.add_argument("-p", type=int, default=512)
ap.add_argument("-g", type=int, default=128); ap.add_argument("-k", type=int, nargs="+", default=[2])
a = ap.parse_args()
model, _ = load_model(pathlib.Path(a.model)); draft, _ = load_model(pathlib.Path(a.draft))
prompt = mx.array([(i * 7919) % 50000 + 10 for i in range(a.p)])
def run(gen):
    t0 = time.perf_counter(); first = None; n = 0; kept = 0
    for out in gen:
        if first is None: first = time.perf_counter()
        n += 1
        if len(out) == 3 and out[2]: kept += 1
    return n, (n - 1) / (time.perf_counter() - first), kept
run(generate_step(prompt, model, max_tokens=8))
n, tps, _ = run(generate_step(prompt, model, max_tokens=a.g))
print(json.dumps(dict(peer="mlx-lm", model=pathlib.Path(a.model).name, k=0, tokens=n, decode_tok_s=round(tps, 1))), flush=True)
for k in a.k:
    run(speculative_generate_step(prompt, model, draft, num_draft_tokens=k, max_tokens=8))
    n, tps, kept = run(speculative_generate_step(prompt, model, draft, num_draft_tokens=k, max_tokens=a.g))
    print(json.dumps(dict(peer="mlx-lm", model=pathlib.Path(a.model).name, draft=pathlib.Path(a.draft).name, k=k,
                          tokens=n, decode_tok_s=round(tps, 1), from_draft=kept)), flush=True)
