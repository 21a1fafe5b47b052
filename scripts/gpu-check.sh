#!/usr/bin/env bash
# The device checks, in one run on a GPU machine (no network), from artefacts built beforehand
# by scripts/gpu-artefacts.sh (carried as gpu-artefacts/). Under 5 minutes on one H200.
# Writes the raw output of every step to $OUT (the device tool's output folder) or to
# docs/gpu/<date>/, one file per step, and a summary on stdout. Never stops at a failed step:
# every step's exit status is in summary.txt.
# Usage: scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
A=${GPU_ARTEFACTS:-gpu-artefacts}
dest=${OUT:-docs/gpu}/$(date -u +%F)
mkdir -p "$dest"
summary="$dest/summary.txt"
: > "$summary"

step() { # step NAME TIMEOUT_S CMD...: output to $dest/NAME.txt, status to the summary
  local name=$1 limit=$2
  shift 2
  echo "==> $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$dest/$name.txt" 2>&1
  local rc=$?
  printf '%-22s rc=%-4s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$*" | tee -a "$summary"
  tail -n 25 "$dest/$name.txt"
}

{ date -u; uname -a; nvidia-smi 2>&1; nvidia-smi topo -m 2>&1;
  echo "IMEX channels:"; ls -la /dev/nvidia-caps-imex-channels 2>&1;
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' 2>&1;
} > "$dest/machine.txt"
head -n 20 "$dest/machine.txt"

# Which handle types this machine supports (fabric needs an IMEX channel).
step device-info 60 "$A/capture-arena" device-info
# The core's device tests against the real driver (the fake driver's knob tests skip).
step rust-device-tests 120 env CAPTURE_ARENA_TEST_REAL_GPU=1 "$A/device-tests" --test-threads=1
# The main job on the GPU: producer and trainer in separate processes.
step demo-device 120 "$A/capture-arena" demo --device --quiet
# The bandwidth table: d2d_copy (reference), publish_device, read_device (another process),
# end_to_end_device, batch_16x4_device.
step bench-device 240 "$A/capture-arena" bench --device --sizes 16MiB,100MiB,1GiB \
  --json "$dest/bench-device.json"
# Host rows on the same machine, for comparison.
step bench-host 120 "$A/capture-arena" bench --sizes 16MiB,100MiB --reps 7 --json "$dest/bench-host.json"

# Python: torch CUDA tensors across two processes. Install the wheels carried along into a
# private folder (numpy and ml_dtypes only if this Python lacks them).
py=/tmp/capture-arena-py
rm -rf "$py"
step python-install 60 python3 -m pip install --no-index --no-deps --find-links "$A/wheels" --target "$py" capture-arena
for m in numpy ml_dtypes mooncake; do
  [ "$m" = mooncake ] && ! ls "$A"/wheels/mooncake_transfer_engine* >/dev/null 2>&1 && continue
  python3 -c "import $m" 2>/dev/null \
    || step "python-install-$m" 60 python3 -m pip install --no-index --no-deps --find-links "$A/wheels" --target "$py" \
         "$( [ "$m" = mooncake ] && echo mooncake-transfer-engine-cuda13 || echo "$m")"
done
step python-torch 180 env PYTHONPATH="$py" python3 "$A/gpu_torch_check.py"
# The engine placement over NVLink (Mooncake's CUDA wheel, if carried): nvlink_intra between two
# processes on one GPU, a Mooncake-only trainer and ArenaFeatureStore.
if PYTHONPATH="$py" python3 -c 'import mooncake.engine' 2>/dev/null; then
  step python-mooncake-nvlink 180 env PYTHONPATH="$py" python3 "$A/gpu_mooncake_check.py"
else
  echo "python-mooncake-nvlink  skipped: Mooncake is not importable (build the artefacts with MOONCAKE_CUDA=1)" | tee -a "$summary"
fi
# The Python suite with the machine's torch and its GPU (the CUDA tests skip on the CPU machine), if pytest
# is there.
if python3 -c 'import pytest' 2>/dev/null; then
  # test_sglang_install.py unpacks SGLang's wheel from the package registry, which this machine
  # cannot reach; it runs in the test command on the CPU machine.
  step python-suite 180 env PYTHONPATH="$py" python3 -m pytest crates/capture-arena-py/tests -q -rs -p no:cacheprovider \
    --ignore=crates/capture-arena-py/tests/test_sglang_install.py
fi

echo
echo "== summary ($dest)"
cat "$summary"
