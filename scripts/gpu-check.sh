#!/usr/bin/env bash
# The device checks, in one run on a GPU machine (no network), from artefacts built beforehand
# by scripts/gpu-artefacts.sh (carried as gpu-artefacts/). One global deadline bounds the whole
# run (GPU_CHECK_DEADLINE_S, default 500 s: under the 9 minutes a device command may take, with
# the carry and start-up inside the 15 minutes of device time); every step is bounded by its own
# limit and by what is left of the deadline, and a step with under 10 s left is skipped and says
# so. The most wanted steps run first: the machine, the handle types, the torch round trip across
# processes, vLLM's connector, then the Rust device tests, the demo, the benchmarks, Mooncake, the Python suite.
# Writes the raw output of every step to $OUT (the device tool's output folder) or to
# docs/gpu/<date>/, one file per step, and a summary on stdout. Never stops at a failed step:
# every step's exit status is in summary.txt. scripts/gpu-check-dry.sh runs it in CI against the
# fake driver with a short deadline and GPU_CHECK_DRY=1: every step runs, on a small workload
# (a step skipped there would be one nobody ran before the device does).
# Usage: scripts/gpu-check.sh
#   GPU_CHECK_PYTHON   the Python of the Python steps (default python3)
#   GPU_CHECK_DRY=1    small workloads: demo, benchmarks and a selection of the Python suite
set -uo pipefail
cd "$(dirname "$0")/.."
A=${GPU_ARTEFACTS:-gpu-artefacts}
DEADLINE_S=${GPU_CHECK_DEADLINE_S:-500}
PY=${GPU_CHECK_PYTHON:-python3}
# The workloads: the device run's, or the dry run's (the same steps, small).
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then
  DEMO_ARGS=(--samples 8 --min-len 16 --max-len 64 --hidden 256 --batch 4)
  BENCH_DEVICE_SIZES=1MiB BENCH_HOST_SIZES=1MiB BENCH_REPS=1
  # The slowest tests, and a test stuck past 30 s dumps its threads' stacks: a clean clone's
  # dry run once took this step past its share of the deadline (59 s, 11 s elsewhere).
  SUITE_ARGS=(-k test_device --durations=5 -o faulthandler_timeout=30)
  VLLM_ARGS=(--hidden 256 --requests 8 --blocks 512 --load 1x64,4x100 --slot-load 4x100 --long 512 --budget-s 100)
  # torch and Mooncake's CUDA checks would find the fake libcuda.so.1 and fail slowly there:
  # without a visible device they fail at once, as they must without a GPU.
  NO_GPU=(CUDA_VISIBLE_DEVICES=)
else
  DEMO_ARGS=()
  BENCH_DEVICE_SIZES=16MiB,100MiB,1GiB BENCH_HOST_SIZES=16MiB,100MiB BENCH_REPS=7
  SUITE_ARGS=()
  VLLM_ARGS=(--require-cuda --load 1x2048,8x2048,32x2048,4x16000 --slot-load 32x2048 --long 131072 --budget-s 290)
  NO_GPU=()
fi
case $DEADLINE_S in '' | *[!0-9]*)
  echo "GPU_CHECK_DEADLINE_S=$DEADLINE_S is not a whole number of seconds" >&2
  exit 2
  ;;
esac
dest=${OUT:-docs/gpu}/$(date -u +%F)
mkdir -p "$dest"
summary="$dest/summary.txt"
: > "$summary"
echo "global deadline ${DEADLINE_S} s" | tee -a "$summary"

left() { echo $((DEADLINE_S - SECONDS)); }

step() { # step NAME LIMIT_S CMD...: output to $dest/NAME.txt, status to the summary
  local name=$1 limit=$2
  shift 2
  local l
  l=$(left)
  if [ "$l" -lt 10 ]; then
    printf '%-24s skipped: %ss of the global deadline left\n' "$name" "$l" | tee -a "$summary"
    return 0
  fi
  [ "$limit" -le $((l - 5)) ] || limit=$((l - 5))
  echo "==> $name (${limit}s at most): $*"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$dest/$name.txt" 2>&1
  local rc=$?
  printf '%-24s rc=%-4s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$*" | tee -a "$summary"
  tail -n 25 "$dest/$name.txt"
}

skip() { # skip NAME WHY
  printf '%-24s skipped: %s\n' "$1" "$2" | tee -a "$summary"
}

{ date -u; uname -a; timeout 20 nvidia-smi 2>&1; timeout 20 nvidia-smi topo -m 2>&1;
  echo "IMEX channels:"; ls -la /dev/nvidia-caps-imex-channels 2>&1;
  timeout 60 "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))' 2>&1;
} > "$dest/machine.txt"
head -n 20 "$dest/machine.txt"

# Which handle types this machine supports (fabric needs an IMEX channel).
step device-info 30 "$A/capture-arena" device-info

# Python: install the wheels carried along into a private folder (numpy, ml_dtypes and Mooncake
# only where this Python lacks them), then torch CUDA tensors across two processes.
py=/tmp/capture-arena-py
rm -rf "$py"
step python-install 60 "$PY" -m pip install --no-index --no-deps --find-links "$A/wheels" --target "$py" capture-arena
for m in numpy ml_dtypes mooncake hs_connectors; do
  [ "$m" = mooncake ] && ! ls "$A"/wheels/mooncake_transfer_engine* >/dev/null 2>&1 && continue
  case $m in mooncake) pkg=mooncake-transfer-engine-cuda13 ;; hs_connectors) pkg=hs-connectors ;; *) pkg=$m ;; esac
  "$PY" -c "import $m" 2>/dev/null \
    || step "python-install-$m" 60 "$PY" -m pip install --no-index --no-deps --find-links "$A/wheels" --target "$py" "$pkg"
done
step python-torch 120 env PYTHONPATH="$py" "${NO_GPU[@]}" "$PY" "$A/gpu_torch_check.py"
# vLLM's connector with its cache on the GPU (vLLM's classes stubbed: its CUDA build cannot be
# carried), a host and a device arena, read by speculators' backend in another process.
step python-vllm-stubbed 300 env PYTHONPATH="$py" "${NO_GPU[@]}" "$PY" "$A/gpu_vllm_check.py" "${VLLM_ARGS[@]}"

# The core's device tests against the real driver (the fake driver's knob tests skip).
step rust-device-tests 90 env CAPTURE_ARENA_TEST_REAL_GPU=1 "$A/device-tests" --test-threads=1
# The main job on the GPU: producer and trainer in separate processes.
step demo-device 60 "$A/capture-arena" demo --device --quiet "${DEMO_ARGS[@]}"
# The bandwidth table: d2d_copy (reference), publish_device, read_device (another process),
# end_to_end_device, batch_16x4_device.
step bench-device 150 "$A/capture-arena" bench --device --sizes "$BENCH_DEVICE_SIZES" \
  --json "$dest/bench-device.json"

# The engine placement over NVLink (Mooncake's CUDA wheel, if carried): nvlink_intra between two
# processes on one GPU, a Mooncake-only trainer and ArenaFeatureStore. Mooncake's CUDA wheel finds
# libcudart only once torch has loaded it, so the gate imports both, and says why it failed.
if ! ls "$A"/wheels/mooncake_transfer_engine* >/dev/null 2>&1 \
    && ! "$PY" -c 'import mooncake.engine' >/dev/null 2>&1; then
  skip python-mooncake-nvlink "Mooncake is not carried (build the artefacts with MOONCAKE_CUDA=1)"
elif gate=$(PYTHONPATH="$py" timeout 60 "$PY" -c 'import torch, mooncake.engine' 2>&1); then
  step python-mooncake-nvlink 120 env PYTHONPATH="$py" "${NO_GPU[@]}" "$PY" "$A/gpu_mooncake_check.py"
else
  skip python-mooncake-nvlink "import torch, mooncake.engine failed: $(printf '%s' "$gate" | tail -n 1)"
fi

# Host rows on the same machine, for comparison.
step bench-host 60 "$A/capture-arena" bench --sizes "$BENCH_HOST_SIZES" --reps "$BENCH_REPS" \
  --json "$dest/bench-host.json"

# The Python suite with the machine's torch and its GPU (the CUDA tests skip on the CPU machine),
# if pytest is there. test_sglang_install.py installs SGLang's wheel whole, which this machine
# cannot download; it runs in the test command on the CPU machine.
if "$PY" -c 'import pytest' 2>/dev/null; then
  # SGLang's wheels carried by gpu-artefacts.sh (Python sources only), where there
  cache=()
  [ -d "$A/sglang-wheel" ] && cache=(CAPTURE_ARENA_CACHE="$(cd "$A/sglang-wheel" && pwd)")
  step python-suite 180 env PYTHONPATH="$py" "${cache[@]}" "$PY" -m pytest crates/capture-arena-py/tests -q -rs -p no:cacheprovider \
    --ignore=crates/capture-arena-py/tests/test_sglang_install.py "${SUITE_ARGS[@]}"
else
  skip python-suite "this Python has no pytest"
fi

echo "total ${SECONDS}s of ${DEADLINE_S}s" | tee -a "$summary"
echo
echo "== summary ($dest)"
cat "$summary"
