#!/usr/bin/env bash
# The checks that need the GPU machine, in one run (the device tool's `run`):
#   scripts/gpu-check.sh            with the prebuilt artefacts in .gpu/ (see below) and $OUT set
# It records the machine, runs the Python suite against the machine's torch (CUDA build: the
# torch and device-tensor tests run there, and skip here), and runs the host-path benchmarks and
# the seed scenario on a server-class host. There is no GPU arena yet (roadmap: the `cuda`
# feature); when it lands, its tests and benchmarks go here.
#
# Prepare here (x86-64, glibc >= 2.34 there):
#   mkdir -p .gpu && strip -o .gpu/capture-arena target/release/capture-arena
#   .venv/bin/maturin build --release -m crates/capture-arena-py/Cargo.toml -o .gpu
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
{
  nvidia-smi -L; nproc; free -g; df -h /dev/shm; uname -r; ldd --version | head -1
  python3 --version; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

python3 -m pip install -q --no-deps --no-compile --target /tmp/site .gpu/capture_arena-*.whl
export PYTHONPATH=/tmp/site
python3 -m pytest crates/capture-arena-py/tests -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest.txt" | tail -15

.gpu/capture-arena bench --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.txt"
.gpu/capture-arena demo --seed-scenario --quiet 2>&1 | tee "$OUT/demo-seed.txt"
