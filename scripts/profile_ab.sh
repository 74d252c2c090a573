#!/usr/bin/env bash
# A decoding step's profile, two builds (or two --quantized-matvec choices) side by side: ROUNDS
# rounds, each running every MODE on every model folder in one process each, alternating the
# order; one JSON line a process with decode tok/s, build/launch/wait µs a step and the
# operation count (`rmlx bench --profile`, p128 g64). A MODE is BINARY or BINARY:MATVEC.
# Usage: scripts/profile_ab.sh ROUNDS "MODE MODE..." MODEL_DIR...
#   e.g. scripts/profile_ab.sh 2 "./rmlx:large ./rmlx:mlx ./rmlx-branch" /root/models/qwen3-8b-q4
set -u
rounds=${1:?usage: $0 ROUNDS "MODE..." MODEL_DIR...}; modes=${2:?}; shift 2
for r in $(seq 1 "$rounds"); do
  order=$modes
  [ $((r % 2)) -eq 0 ] && order=$(echo "$modes" | tr ' ' '\n' | tac | tr '\n' ' ')
  for m in "$@"; do
    for mode in $order; do
      bin=${mode%%:*}; matvec=large; [ "$mode" != "$bin" ] && matvec=${mode#*:}
      "$bin" bench --model "$m" -p 128 -g 64 -n 1 --json --profile 48 --quantized-matvec "$matvec" 2>/dev/null | tail -1 |
        python3 -c "
import sys, json
text = sys.stdin.read().strip()
d = json.loads(text) if text else {}
p = d.get('profile') or {}
keys = ('build_us', 'launch_us', 'wait_us', 'operations')
print(json.dumps({'round': $r, 'mode': '$mode', 'model': '$(basename "$m")', 'decode_tok_s': d.get('decode_tok_s'), **{k: p.get(k) for k in keys}}), flush=True)"
    done
  done
done
