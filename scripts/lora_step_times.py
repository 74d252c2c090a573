#!/usr/bin/env python3
"""Times `rmlx lora` steps of several binaries side by side: each binary first trains --warm
iterations (its kernels compiled into the caches, every batch shape of the data met once), then
--rounds interleaved runs of --iters iterations with RMLX_LOG=debug, whose per-iteration lines
("iteration K: build B ms, encode E ms, wait W ms") give the medians over iterations > --skip.
One JSON line a binary and round. Medians of the step's parts, unlike bench_lora.py's 10-step
windows, are not moved by one first-seen batch shape. Each run is bench_lora.py's command
(`lora_command`: the settings used beside mlx-lm).
Usage: lora_step_times.py --model DIR --data DIR BIN [BIN ...] [--iters 24] [--warm 12] [--rounds 2]"""
import argparse, json, os, re, statistics, subprocess, sys, tempfile

from bench_lora import lora_command

LINE = re.compile(r"iteration (\d+): build ([\d.]+) ms, encode ([\d.]+) ms, wait ([\d.]+) ms")


def run(binary, a, iters, debug):
    with tempfile.TemporaryDirectory() as adapters:
        cmd = lora_command(binary, a.model, a.data, iters, 16, adapters)
        env = dict(os.environ, RMLX_LOG="debug") if debug else None
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
        if out.returncode != 0:
            sys.exit(f"{binary} failed ({out.returncode}): {out.stderr[-1500:]}")
        return [tuple(map(float, m.groups())) for m in LINE.finditer(out.stderr)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binaries", nargs="+")
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--iters", type=int, default=24)
    ap.add_argument("--warm", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=900)
    a = ap.parse_args()
    for b in a.binaries:
        run(b, a, a.warm, False)
        print(json.dumps({"binary": b, "warmed": a.warm}), flush=True)
    for r in range(a.rounds):
        for b in (a.binaries if r % 2 == 0 else a.binaries[::-1]):
            rows = [x for x in run(b, a, a.iters, True) if x[0] > a.skip]
            if not rows:
                sys.exit(f"{b}: no step timings (is RMLX_LOG=debug honoured by this binary?)")
            med = lambda i: round(statistics.median(x[i] for x in rows), 1)
            total = round(statistics.median(x[1] + x[2] + x[3] for x in rows), 1)
            print(json.dumps({"binary": b, "round": r, "steps": len(rows), "step_ms": total,
                              "build_ms": med(1), "encode_ms": med(2), "wait_ms": med(3)}), flush=True)


if __name__ == "__main__":
    main()
