#!/usr/bin/env bash
# CPU time an idle producer uses in 4 s (utime + stime from /proc/PID/stat, 100 ticks = one
# core-second): with its NIXL agent serving the arena (inline), and with shared memory alone.
# NIXL's progress thread spins a whole core unless the agent sets a poll delay (BENCHMARKS.md).
# Usage: scripts/idle-cpu.sh [CLI]   (default target/debug/capture-arena, built with --features
#        nixl; SGLANG_SPEC_CAPTURE_NIXL_LIB set as scripts/test.sh sets it)
set -euo pipefail
cd "$(dirname "$0")/.."
CLI=${1:-target/debug/capture-arena}
out=$(mktemp)
trap 'rm -f "$out"; [ -n "${pid:-}" ] && kill "$pid" 2>/dev/null || true' EXIT
for t in nixl shm; do
  : >"$out"
  SGLANG_SPEC_CAPTURE_TRANSPORT=$t SGLANG_SPEC_CAPTURE_NIXL_SERVER=inline "$CLI" produce \
    --samples 1 --min-len 16 --max-len 16 --hidden 64 --arena-bytes 16MiB --quiet \
    --idle-timeout 30 >"$out" 2>/dev/null &
  pid=$!
  until [ -s "$out" ]; do
    kill -0 "$pid" 2>/dev/null || { echo "the $t producer exited before publishing" >&2; exit 1; }
    sleep 0.05
  done
  a=$(awk '{print $14 + $15}' "/proc/$pid/stat")
  sleep 4
  b=$(awk '{print $14 + $15}' "/proc/$pid/stat")
  echo "$t: $((b - a)) ticks in 4 s idle ($(((b - a) * 100 / 400)) % of a core)"
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  pid=
done
