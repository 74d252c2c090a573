#!/usr/bin/env bash
# Decoding with rmlx's quantised matrix-vector kernel against MLX's product, beside mlx-lm:
# ROUNDS interleaved rounds (the order rotates each round) of peer_bench.py (mlx-lm) and
# `rmlx bench --quantized-matvec large|mlx`, p512 g256 n3, greedy, on each model folder. One JSON
# line a run, with whether the 3 runs of the process decoded the same ids.
# Usage: scripts/matvec_rounds.sh RMLX_BINARY PEER_BENCH_PY ROUNDS MODEL_DIR...
set -u
bin=${1:?usage: $0 RMLX_BINARY PEER_BENCH_PY ROUNDS MODEL_DIR...}; peer=${2:?}; rounds=${3:?}; shift 3
line() { python3 -c "
import sys, json
t = sys.stdin.read().strip().splitlines()
d = json.loads(t[-1]) if t else {}
keys = ('decode_tok_s', 'prefill_tok_s', 'peak_gb', 'floor_fraction', 'runs_identical')
print(json.dumps({'round': $1, 'who': '$2', 'model': '$3', **{k: d.get(k) for k in keys}}), flush=True)"; }
for r in $(seq 1 "$rounds"); do
  for m in "$@"; do
    case $((r % 3)) in 1) order="peer large mlx";; 2) order="large mlx peer";; 0) order="mlx peer large";; esac
    for who in $order; do
      if [ "$who" = peer ]; then
        python3 "$peer" "$m" -p 512 -g 256 -n 3 2>/dev/null | line "$r" "$who" "$(basename "$m")"
      else
        "$bin" bench --model "$m" -p 512 -g 256 -n 3 --json --quantized-matvec "$who" 2>/dev/null | line "$r" "$who" "$(basename "$m")"
      fi
    done
  done
done
