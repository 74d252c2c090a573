#!/usr/bin/env bash
# Prompt lookup on an edit task (BENCHMARKS.md, "Speculative decoding"): the default model copies
# a paragraph, fixing its spelling; plain decoding beside --prompt-lookup with 4, 7 and 8 drafts,
# interleaved rounds, one JSON line a run (decode tok/s, drafts kept, model passes).
# Usage: bash scripts/speculative/cpu_edit.sh RMLX_BINARY [ROUNDS]
set -u
RMLX=${1:?the rmlx binary}
ROUNDS=${2:-3}
EDIT="Copy the following text exactly, fixing only the spelling mistakes. The old lighthouse stood on the edge of the clif, its light sweeping acros the dark water every night. Sailors trusted it more then any map, becuase it had never once failed them. When the storm came in the winter of that year, the keeper climbed the stairs with a lantern and kept the flame burning untill morning. By dawn the sea was calm again, and every boat had come home safly."
for round in $(seq "$ROUNDS"); do
  for k in 0 4 7 8; do
    extra=""; [ "$k" = 0 ] || extra="--prompt-lookup --num-draft-tokens $k"
    "$RMLX" generate --prompt "$EDIT" -m 120 --json $extra 2>/dev/null | python3 -c "
import json, sys
d = json.load(sys.stdin)
print(json.dumps(dict(round=$round, drafts=$k, tok_s=round(d['generation_tps'], 1), tokens=d.get('generation_tokens'),
    drafted=d.get('draft_tokens'), kept=d.get('accepted_draft_tokens'), passes=d.get('model_passes'))))"
  done
done
