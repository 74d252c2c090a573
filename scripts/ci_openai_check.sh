#!/usr/bin/env bash
# Runs OpenAI's official Python client (pinned in scripts/requirements.txt) against `rmlx serve`
# with the default model: scripts/openai_client_check.py. Usage: scripts/ci_openai_check.sh RMLX_BINARY
set -euo pipefail
rmlx="${1:?usage: $0 RMLX_BINARY}"
work="$(mktemp -d)"
server=""; thinker=""
trap 'kill $server $thinker 2>/dev/null || true; wait $server $thinker 2>/dev/null || true; rm -rf "$work"' EXIT
version="$(sed -n 's/^openai==//p' "$(dirname "$0")/requirements.txt")"
python3 -m pip install --quiet --disable-pip-version-check --target "$work/py" "openai==$version"
# Starts `rmlx serve "$@"` on a free port; sets $addr, and $server/$thinker to the pids.
start() {
    local log="$work/serve-$1.log"; shift
    "$rmlx" serve --port 0 "$@" 2>"$log" &
    pid=$!
    addr=""
    for _ in $(seq 1 600); do
        addr="$(sed -n 's/^serving .* on \(http:[^ ]*\)$/\1/p' "$log")"
        [ -n "$addr" ] && return 0
        kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; exit 1; }
        sleep 0.5
    done
    echo "rmlx serve did not start" >&2; cat "$log" >&2; exit 1
}
start default
server=$pid
plain="$addr"
# The default model with Qwen 3's chat template (from the tokenizer goldens): thinking markup.
python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["templates"]["qwen3"], end="")' \
    "$(dirname "$0")/../crates/rmlx-lm/tests/fixtures/tokenizers/goldens.json" > "$work/qwen3.jinja"
start thinking --chat-template "$work/qwen3.jinja"
thinker=$pid
PYTHONPATH="$work/py" python3 "$(dirname "$0")/openai_client_check.py" --base-url "$plain/v1" --thinking-base-url "$addr/v1"
