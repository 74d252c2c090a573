#!/usr/bin/env bash
# The engine (`rmlx batch`, the same engine as `serve`) of two rmlx binaries side by side on the
# GPU machine: 1 and 4 prompts plain, 1 prompt with a 0.6B draft, then `generate` for the same
# prompt (BENCHMARKS.md, "A sequence alone in the engine"). Needs the models of gpu.sh.
# Usage, after `source .gpu/b/device-setup`: bash scripts/speculative/engine_ab.sh OLD_RMLX NEW_RMLX
set -u
OLD=${1:?the binary before}
NEW=${2:?the binary after}
M=/root/models
[ -d $M/qwen3-8b-q4 ] || python3 .gpu/b/make_model.py qwen3-0.6b qwen3-8b --q4 > /tmp/make.log 2>&1 || { tail -3 /tmp/make.log; exit 1; }
python3 - <<'PY'
import json
for n in (1, 4):
    with open(f"/tmp/p{n}.jsonl", "w") as f:
        for r in range(n):
            f.write(json.dumps({"prompt": " ".join(f"t{(i*7919 + r*31)%50000+10}" for i in range(128))}) + "\n")
PY
batch() {
  local b=$1 n=$2; shift 2
  timeout 120 "$b" batch --model $M/qwen3-8b-q4 --prompts /tmp/p$n.jsonl --ignore-eos --temp 0 "$@" 2>&1 >/dev/null \
    | grep "generated tokens/s" | sed "s|^|$(basename "$b") batch $n [$*]: |"
}
D="--draft-model $M/qwen3-0.6b-q4 --num-draft-tokens"
for b in "$OLD" "$NEW"; do batch "$b" 1 --max-tokens 8; batch "$b" 1 --max-tokens 8 $D 2; done  # kernels compiled
for round in 1 2; do
  for b in "$OLD" "$NEW"; do
    batch "$b" 1 --max-tokens 256
    batch "$b" 4 --max-tokens 128
    batch "$b" 1 --max-tokens 128 $D 2
  done
done
P=$(python3 -c "print(' '.join(f't{(i*7919)%50000+10}' for i in range(128)))")
timeout 100 "$NEW" generate --model $M/qwen3-8b-q4 --raw --json -m 256 --prompt "$P" 2>/dev/null \
  | python3 -c "import json,sys; d=json.load(sys.stdin); print('generate 256:', round(d['generation_tps'], 1))"
