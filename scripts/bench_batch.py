"""Offline batch generation: `rmlx batch` against mlx-lm's `BatchGenerator` (what its
`batch_generate` runs), side by side on the same model folder and prompts (BENCHMARKS.md's batch rows).

Usage (on the GPU machine, after `source .gpu/b/device-setup`):
    python3 scripts/bench_batch.py --rmlx .gpu/bin/rmlx MODELS/qwen3-0.6b \
        [--prompts 64] [--prompt-words 128] [--max-tokens 128] [--batch 32] [--repeats 2] \
        [--variant "one-at-a-time=--prefill-batch 1"]

Prompts: `--prompts` texts of `--prompt-words` words from a fixed seed; each word is one token of
the word-level tokenizer that bench_lora.py writes into random-weight folders, so both tools see the
same token ids. Both generate greedily exactly `--max-tokens` tokens per prompt (end-of-sequence
tokens ignored), at most `--batch` sequences decoded together, each run in a fresh process. The
time is the whole batch, prefill included, after the model is loaded; throughput is generated
tokens per second of it. Runs alternate between the tools; the best of `--repeats` counts.
Peak memory is MLX's peak over the batch. Each `--variant NAME=ARGS` adds an rmlx run with those
extra arguments to every round (an A/B inside one call). Prints one JSON line per run and a summary
line.
"""
import argparse, json, pathlib, random, re, subprocess, sys, tempfile, time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import bench_lora  # noqa: E402  (the word-level tokenizer)


def prompts(n: int, words: int, vocab: int):
    rng = random.Random(0)
    return [" ".join(f"w{rng.randint(1, vocab - 1)}" for _ in range(words)) for _ in range(n)]


def peer(a):
    """mlx-lm's batch generation over the prompts in `a.prompts_file`, timed after loading."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load
    model, tokenizer = load(a.peer)
    texts = [json.loads(l)["prompt"] for l in open(a.prompts_file)]
    ids = [tokenizer.encode(t) for t in texts]
    mx.reset_peak_memory()
    start = time.perf_counter()
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=a.batch, max_tokens=a.max_tokens)
    uids = gen.insert(ids, [a.max_tokens] * len(ids))
    counts = {u: 0 for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            counts[r.uid] += 1
    gen.close()
    secs = time.perf_counter() - start
    generated = sum(counts.values())
    print(json.dumps({"generated": generated, "prompt_tokens": sum(map(len, ids)), "seconds": secs,
                      "tok_s": generated / secs, "peak_gb": mx.get_peak_memory() / 1e9}))


def run_peer(a, model, prompts_file):
    cmd = [sys.executable, __file__, "--peer", str(model), "--prompts-file", str(prompts_file),
           "--max-tokens", str(a.max_tokens), "--batch", str(a.batch)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"mlx-lm failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


STATS = re.compile(r"(\d+) prompts, (\d+) prompt tokens \((\d+) cached\), (\d+) generated in ([\d.]+) s: "
                   r"([\d.]+) generated tokens/s, peak memory ([\d.]+) GB")


def run_rmlx(a, model, prompts_file, extra=()):
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as out_file:
        cmd = [a.rmlx, "batch", "--model", str(model), "--prompts", str(prompts_file), "--max-tokens",
               str(a.max_tokens), "--ignore-eos", "--temp", "0", "--max-batch", str(a.batch), "-o", out_file.name,
               *extra]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"rmlx failed ({out.returncode}): {out.stderr[-2000:]}")
        m = STATS.search(out.stderr)
        if not m:
            raise SystemExit(f"no totals from rmlx batch: {out.stderr[-2000:]}")
        return {"generated": int(m[4]), "prompt_tokens": int(m[2]), "seconds": float(m[5]), "tok_s": float(m[6]),
                "peak_gb": float(m[7])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*")
    ap.add_argument("--rmlx", default="rmlx")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                    help="also run rmlx with these extra arguments, reported as NAME")
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.peer:
        return peer(a)
    for m in map(pathlib.Path, a.models):
        bench_lora.ensure_tokenizer(m)
        vocab = min(bench_lora.WORDS, json.loads((m / "config.json").read_text()).get("vocab_size", bench_lora.WORDS))
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            for p in prompts(a.prompts, a.prompt_words, vocab):
                f.write(json.dumps({"prompt": p}) + "\n")
        tools = [("mlx-lm", run_peer), ("rmlx", run_rmlx)]
        for v in a.variant:
            name, _, args = v.partition("=")
            tools.append((name, lambda a, m, f, extra=tuple(args.split()): run_rmlx(a, m, f, extra)))
        best = {}
        for r in range(a.repeats):
            for tool, fn in tools:
                res = fn(a, m, f.name)
                print(json.dumps({"tool": tool, "model": m.name, "round": r, **res}), flush=True)
                if tool not in best or res["tok_s"] > best[tool]["tok_s"]:
                    best[tool] = res
        summary = {"summary": m.name, "prompts": a.prompts, "prompt_words": a.prompt_words,
                   "max_tokens": a.max_tokens, "batch": a.batch,
                   "mlx_lm_tok_s": round(best["mlx-lm"]["tok_s"]), "rmlx_tok_s": round(best["rmlx"]["tok_s"]),
                   "speedup": round(best["rmlx"]["tok_s"] / best["mlx-lm"]["tok_s"], 3),
                   "mlx_lm_peak_gb": round(best["mlx-lm"]["peak_gb"], 2),
                   "rmlx_peak_gb": round(best["rmlx"]["peak_gb"], 2)}
        for tool, _ in tools[2:]:
            summary[f"{tool}_tok_s"] = round(best[tool]["tok_s"])
            summary[f"{tool}_speedup"] = round(best[tool]["tok_s"] / best["mlx-lm"]["tok_s"], 3)
            summary[f"{tool}_peak_gb"] = round(best[tool]["peak_gb"], 2)
        print(json.dumps(summary), flush=True)

if __name__ == "__main__":
    main()
