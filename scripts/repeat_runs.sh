#!/usr/bin/env bash
# Runs a command N times and counts its exit statuses: how a workaround is proven under
# repetition before it ships (a crash in 1 run of 10 passes a test suite run once).
# Usage: scripts/repeat_runs.sh N COMMAND [ARGS...]   (prints "status count" lines; exit 1 unless all 0)
set -u
n=${1:?usage: $0 N COMMAND [ARGS...]}; shift
declare -A counts
for _ in $(seq 1 "$n"); do
  "$@" >/dev/null 2>&1
  s=$?
  counts[$s]=$(( ${counts[$s]:-0} + 1 ))
done
bad=0
for s in "${!counts[@]}"; do
  echo "exit $s: ${counts[$s]} of $n"
  [ "$s" -ne 0 ] && bad=1
done
exit $bad
