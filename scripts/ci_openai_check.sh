#!/usr/bin/env bash
# Runs OpenAI's official Python client (pinned in scripts/requirements.txt) against `rmlx serve`
# with the default model: scripts/openai_client_check.py. Usage: scripts/ci_openai_check.sh RMLX_BINARY
set -euo pipefail
rmlx="${1:?usage: $0 RMLX_BINARY}"
work="$(mktemp -d)"
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -rf "$work"' EXIT
version="$(sed -n 's/^openai==//p' "$(dirname "$0")/requirements.txt")"
python3 -m pip install --quiet --disable-pip-version-check --target "$work/py" "openai==$version"
"$rmlx" serve --port 0 2>"$work/serve.log" &
server=$!
for _ in $(seq 1 600); do
    addr="$(sed -n 's/^serving .* on \(http:[^ ]*\)$/\1/p' "$work/serve.log")"
    [ -n "$addr" ] && break
    kill -0 "$server" 2>/dev/null || { cat "$work/serve.log" >&2; exit 1; }
    sleep 0.5
done
[ -n "$addr" ] || { echo "rmlx serve did not start" >&2; cat "$work/serve.log" >&2; exit 1; }
PYTHONPATH="$work/py" python3 "$(dirname "$0")/openai_client_check.py" --base-url "$addr/v1"
