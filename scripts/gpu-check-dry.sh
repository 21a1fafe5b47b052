#!/usr/bin/env bash
# A dry run of scripts/gpu-check.sh on a machine without a GPU, in the test command: the debug
# CLI and the core's device tests stand in for the carried artefacts, the fake driver
# (crates/capture-arena/tests/fake_cuda) for libcuda.so.1, the wheel the test command built
# (target/wheels, if there) for the carried ones, .venv's Python, small workloads
# (GPU_CHECK_DRY=1) and a short global deadline for the device run's. Fails unless the script
# finishes inside its deadline, runs every step (none skipped for want of time: a step skipped
# here is a step nobody ran before the device does), and every step passes (rc=0) but those
# named in NEEDS_GPU below with the reason they cannot pass without one: those still have to run
# and report their exit status. A failing step's output is printed.
# Usage: scripts/gpu-check-dry.sh [DEADLINE_S]   (default 60)
set -euo pipefail
cd "$(dirname "$0")/.."
deadline=${1:-60}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

exe() { # exe CARGO_ARGS...: the path of the executable cargo builds
  cargo "$@" --message-format=json 2>/dev/null | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])' | tail -n 1
}
mkdir -p "$tmp/artefacts/wheels" "$tmp/driver" "$tmp/out"
# The workspace's own build (GPU_DRY_FEATURES: the features the test command builds it with), so
# nothing is compiled again: the CLI, and the core's device tests (the cuda feature is on in every
# workspace build, through the CLI and the Python module).
features=${GPU_DRY_FEATURES:-}
cp "$(exe build --workspace ${features:+--features "$features"} --bin capture-arena)" "$tmp/artefacts/capture-arena"
device_tests=$(cargo test --workspace ${features:+--features "$features"} --test device --no-run \
    --message-format=json 2>/dev/null | python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") \
            and m["target"]["src_path"].endswith("crates/capture-arena/tests/device.rs"):
        print(m["executable"])')
cp "$device_tests" "$tmp/artefacts/device-tests"
cp scripts/gpu_torch_check.py scripts/gpu_mooncake_check.py scripts/gpu_vllm_check.py "$tmp/artefacts/"
cp target/wheels/capture_arena-*x86_64.whl "$tmp/artefacts/wheels/" 2>/dev/null || true
"${CC:-cc}" -shared -fPIC -O2 -Wl,-soname,libcuda.so.1 -o "$tmp/driver/libcuda.so.1" \
  crates/capture-arena/tests/fake_cuda/fake_cuda.c -lpthread

t0=$SECONDS
GPU_ARTEFACTS="$tmp/artefacts" OUT="$tmp/out" GPU_CHECK_DEADLINE_S=$deadline GPU_CHECK_DRY=1 \
  GPU_CHECK_PYTHON="$PWD/.venv/bin/python" \
  LD_LIBRARY_PATH="$tmp/driver${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  scripts/gpu-check.sh > "$tmp/stdout.txt" 2>&1
took=$((SECONDS - t0))
summary=$(cat "$tmp"/out/*/summary.txt)
echo "$summary"
fail() { echo "gpu-check dry run: $*" >&2; tail -n 40 "$tmp/stdout.txt" >&2; exit 1; }
[ "$took" -le $((deadline + 5)) ] || fail "took ${took}s, over its ${deadline}s deadline"
for s in device-info python-install python-torch python-vllm-stubbed rust-device-tests demo-device bench-device \
  python-mooncake-nvlink bench-host python-suite; do
  grep -Eq "^$s +(rc=|skipped: )" <<< "$summary" || fail "step $s is not in the summary"
done
! grep -q "skipped: " <<< "$summary" || fail "steps were skipped"
grep -Eq '^python-install +rc=0 ' <<< "$summary" || ! ls "$tmp"/artefacts/wheels/*.whl >/dev/null 2>&1 \
  || fail "the carried wheel did not install"
# Steps that cannot pass without a GPU, and why; every other step must pass here.
declare -A NEEDS_GPU=(
  [python-torch]="torch's CUDA round trip allocates CUDA tensors, which the fake driver cannot back (torch loads its own CUDA runtime)"
  [python-mooncake-nvlink]="Mooncake's TransferEngine over NVLink registers CUDA memory through its own CUDA runtime"
)
failed=()
while read -r name rc _; do
  rc=${rc#rc=}
  [ "$rc" = 0 ] && continue
  if [ -n "${NEEDS_GPU[$name]:-}" ]; then
    echo "gpu-check dry run: $name rc=$rc, expected without a GPU: ${NEEDS_GPU[$name]}"
    continue
  fi
  failed+=("$name")
  echo "== $name rc=$rc: its output's end" >&2
  tail -n 40 "$tmp"/out/*/"$name.txt" >&2
done < <(grep -E '^[a-z0-9-]+ +rc=' <<< "$summary")
[ ${#failed[@]} = 0 ] || fail "steps failed that must pass without a GPU: ${failed[*]}"
grep -q "total " <<< "$summary" || fail "the summary has no total"
echo "gpu-check dry run: every step ran, ${took}s of a ${deadline}s deadline"
