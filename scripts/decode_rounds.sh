#!/usr/bin/env bash
# Decoding speed of rmlx builds (or --quantized-matvec choices) beside mlx-lm: ROUNDS interleaved
# rounds (the order rotates each round) of every MODE on every model folder, p512 g256 n3, greedy.
# A MODE is `peer` (mlx-lm's peer_bench.py, path in PEER), BINARY or BINARY:MATVEC. One JSON line a
# process, with whether its 3 runs decoded the same ids.
# Usage: PEER=peer_bench.py scripts/decode_rounds.sh ROUNDS "MODE..." MODEL_DIR...
#   e.g. PEER=.gpu/b/peer_bench.py scripts/decode_rounds.sh 3 "peer ./rmlx ./rmlx:mlx" /root/models/qwen3-8b-q4
set -u
rounds=${1:?usage: $0 ROUNDS "MODE..." MODEL_DIR...}; modes=${2:?}; shift 2
line() { python3 -c "
import sys, json
t = sys.stdin.read().strip().splitlines()
d = json.loads(t[-1]) if t else {}
keys = ('decode_tok_s', 'prefill_tok_s', 'peak_gb', 'floor_fraction', 'runs_identical')
print(json.dumps({'round': $1, 'mode': '$2', 'model': '$3', **{k: d.get(k) for k in keys}}), flush=True)"; }
read -r -a list <<< "$modes"
for r in $(seq 1 "$rounds"); do
  for m in "$@"; do
    n=${#list[@]}
    for i in $(seq 0 $((n - 1))); do
      mode=${list[$(((i + r) % n))]}
      if [ "$mode" = peer ]; then
        python3 "${PEER:?set PEER to peer_bench.py}" "$m" -p 512 -g 256 -n 3 2>/dev/null | line "$r" "$mode" "$(basename "$m")"
      else
        bin=${mode%%:*}; matvec=large; [ "$mode" != "$bin" ] && matvec=${mode#*:}
        "$bin" bench --model "$m" -p 512 -g 256 -n 3 --json --quantized-matvec "$matvec" 2>/dev/null |
          line "$r" "$mode" "$(basename "$m")"
      fi
    done
  done
done
