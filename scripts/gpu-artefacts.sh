#!/usr/bin/env bash
# Builds, on this (CPU) machine, everything scripts/gpu-check.sh runs on the GPU machine, which
# has no network: the release CLI, the Rust device tests (run there against the real driver),
# the Python module as an abi3 wheel, and numpy/ml_dtypes wheels for its Python 3.12. Output in
# gpu-artefacts/ (git-ignored), kept under the 64 MiB a device run may carry.
# Usage: scripts/gpu-artefacts.sh   then: run scripts/gpu-check.sh there with carry=["gpu-artefacts"]
#        MOONCAKE_CUDA=1 scripts/gpu-artefacts.sh   adds Mooncake's CUDA wheel (the nvlink_intra
#        check) in place of the numpy wheel
set -euo pipefail
cd "$(dirname "$0")/.."
out=gpu-artefacts
rm -rf "$out"
mkdir -p "$out/wheels"

echo "==> release CLI (cuda feature on by default)"
cargo build --release -p capture-arena-cli
cp target/release/capture-arena "$out/"

echo "==> Rust device tests (release, cuda feature)"
exe=$(cargo test --release -p capture-arena --features cuda --test device --no-run \
        --message-format=json 2>/dev/null \
      | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "device":
        print(m["executable"])')
cp "$exe" "$out/device-tests"
strip "$out/capture-arena" "$out/device-tests"

echo "==> Python wheel (abi3, runs on the GPU machine's Python 3.12)"
.venv/bin/python -m pip install -q -c scripts/constraints.txt maturin
.venv/bin/python -m maturin build -q --release -m crates/capture-arena-py/Cargo.toml -o "$out/wheels"
platforms="--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64"
if [ "${MOONCAKE_CUDA:-0}" = 1 ]; then
  # Mooncake's CUDA 13 wheel (47 MiB) for the nvlink_intra check: it fits the 64 MiB only without
  # the numpy wheel, so the GPU machine's Python must have numpy then.
  echo "==> Mooncake's CUDA wheel (MOONCAKE_CUDA=1) and ml_dtypes for Python 3.12"
  # shellcheck disable=SC2086
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 $platforms \
    -d "$out/wheels" mooncake-transfer-engine-cuda13==0.3.14 ml_dtypes
else
  # numpy is on the GPU machine's image (KINDS.md); ml_dtypes is carried in case it is not.
  echo "==> ml_dtypes wheel for Python 3.12 (installed there only if missing)"
  # shellcheck disable=SC2086
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 $platforms \
    -d "$out/wheels" ml_dtypes
  # The Python suite's SGLang tests unpack SGLang's wheels, which the GPU machine cannot download:
  # carried without their extension modules (the tests read only Python sources), for the
  # versions that fit.
  echo "==> SGLang's wheels, Python sources only (the suite's SGLang tests there)"
  mkdir -p "$out/sglang-wheel"
  for v in ${SGLANG_VERSIONS:-0.5.20 0.5.23}; do
    .venv/bin/python -m pip download -q --no-deps --disable-pip-version-check --only-binary=:all: --implementation cp \
      --python-version 3.11 --abi cp311 --platform manylinux_2_34_x86_64 "sglang==$v" -d "$out/sglang-full"
    .venv/bin/python - "$out"/sglang-full/sglang-"$v"-*.whl "$out/sglang-wheel" <<'PY'
import os, sys, zipfile
src, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(src) as a, zipfile.ZipFile(os.path.join(dest, os.path.basename(src)), "w", zipfile.ZIP_DEFLATED) as b:
    for i in a.infolist():
        if not i.filename.endswith(".so"):
            b.writestr(i, a.read(i))
PY
  done
  rm -rf "$out/sglang-full"
fi
echo "==> hs_connectors (speculators' backends: the vLLM check's trainer reads through it)"
.venv/bin/python -m pip download -q --no-deps -d "$out/wheels" hs-connectors==0.9.0
cp scripts/gpu_torch_check.py scripts/gpu_mooncake_check.py scripts/gpu_vllm_check.py "$out/"
du -sh "$out" && ls -la "$out" "$out/wheels"
size=$(du -sm "$out" | cut -f1)
[ "$size" -lt 64 ] || { echo "gpu-artefacts is ${size} MiB: over the 64 MiB a device run carries" >&2; exit 1; }
