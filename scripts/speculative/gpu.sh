#!/usr/bin/env bash
# Speculative decoding on the GPU machine (BENCHMARKS.md, "Where a verification pass goes on the
# GPU"): random-weight qwen3-8b and qwen3-0.6b (4-bit copies too), then one line a measurement:
# verification passes beside decoding steps (bench --profile-drafts), products of 1-12 rows
# (bench-kernels --rows), `generate --draft-model`, the engine (`batch`) plain and speculating,
# and mlx-lm's speculative decoding. Usage, after `source .gpu/b/device-setup`:
#   bash scripts/speculative/gpu.sh RMLX_BINARY
set -u
RMLX=${1:?the rmlx binary}
HERE=$(dirname "$0")
M=/root/models
[ -d $M/qwen3-8b-q4 ] || python3 .gpu/b/make_model.py qwen3-0.6b qwen3-8b --q4 > /tmp/make.log 2>&1 || { tail -3 /tmp/make.log; exit 1; }
python3 "$HERE/tok.py" $M/qwen3-0.6b-q4 $M/qwen3-8b-q4 $M/qwen3-8b > /dev/null
for K in 0 1 2 4 7; do
  for model in $M/qwen3-8b-q4 $M/qwen3-8b; do
    extra=""; [ $K = 0 ] || extra="--profile-drafts $K"
    timeout 150 $RMLX bench --model $model -p 512 -g 16 -n 1 --profile 16 $extra --json 2>/dev/null | python3 -c "
import json,sys; d=json.load(sys.stdin); p=d['profile_verify'] or d['profile']
print(json.dumps(dict(model=d['model'], drafts=$K, us=p['build_us']+p['launch_us']+p['wait_us'], operations=p['operations'])))"
  done
done
for R in 1 2 3 4 8 12; do
  timeout 100 $RMLX bench-kernels --rows $R --shapes 4096x4096,1024x4096,12288x4096,4096x12288,151936x4096 --json 2>/dev/null \
    | python3 -c "import json,sys; print(json.dumps([dict(rows=$R, shape=r['shape'], rmlx=round(r['rmlx_gbs']), mlx=round(r['mlx_gbs'])) for r in map(json.loads, sys.stdin)]))"
done
python3 - <<'PY'
import json
for n in (1, 2, 4):
    with open(f"/tmp/p{n}.jsonl", "w") as f:
        for r in range(n):
            f.write(json.dumps({"prompt": " ".join(f"t{(i*7919 + r*31)%50000+10}" for i in range(128))}) + "\n")
PY
batch() { timeout 150 $RMLX batch --model $M/qwen3-8b-q4 --prompts /tmp/p$1.jsonl --ignore-eos --temp 0 "${@:2}" 2>&1 >/dev/null | grep "generated tokens/s" | sed "s|^|batch $1 [${*:2}]: |"; }
batch 1 --max-tokens 8  # kernels compiled before the timed runs
for n in 1 2 4; do batch $n --max-tokens 64; batch $n --max-tokens 64 --draft-model $M/qwen3-0.6b-q4 --num-draft-tokens 2; done
PROMPT=$(python3 -c "print(' '.join(f't{(i*7919)%50000+10}' for i in range(512)))")
for extra in "" "--draft-model $M/qwen3-0.6b-q4 --num-draft-tokens 1" "--draft-model $M/qwen3-0.6b-q4 --num-draft-tokens 2" "--draft-model $M/qwen3-0.6b-q4 --num-draft-tokens 4"; do
  timeout 150 $RMLX generate --model $M/qwen3-8b-q4 --raw --json -m 256 --prompt "$PROMPT" $extra 2>/dev/null \
    | python3 -c "import json,sys; d=json.load(sys.stdin); print(json.dumps(dict(generate='$extra', tok_s=d['generation_tps'], passes=d.get('model_passes'))))"
done
timeout 200 python3 "$HERE/peer_spec.py" $M/qwen3-8b-q4 $M/qwen3-0.6b-q4 -k 2
