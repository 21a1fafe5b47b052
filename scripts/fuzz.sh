#!/usr/bin/env bash
# Runs every fuzz target (fuzz/fuzz_targets) for SECONDS each, starting from the committed seeds
# (fuzz/seeds/<target>: example inputs, and every input that once found a bug), with libFuzzer,
# the targets built as cargo-fuzz builds them (below) without needing cargo-fuzz. Uses the
# nightly toolchain with AddressSanitizer when one is installed, else the stable one without a
# sanitizer (Rust's own checks still panic on out-of-bounds access, and on overflow: debug
# assertions and overflow checks are on).
# A crash fails the run; its input is in fuzz/artifacts/<target>/ (add it to fuzz/seeds/<target>
# once fixed, with a unit test for the bug).
# Usage: scripts/fuzz.sh [SECONDS per target, default 12] [TARGET ...]
#   FUZZ_FEATURES=nixl  also fuzz the NIXL session parser (needs libclang and g++)
#   FUZZ_STAGE=build|run  only build the targets, or only run what was built
#   FUZZ_JOBS=N  targets run at a time (default: the machine's cores)
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-12}
shift || true
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
  TARGETS=(control_lines keys sessions samples)
fi

# The build cargo-fuzz (0.13) makes, made here with cargo itself, so the test command does not
# build cargo-fuzz first (two minutes on two cores): libFuzzer's coverage instrumentation (the
# flags of cargo-fuzz's src/project.rs), `--cfg fuzzing`, and debug assertions with overflow
# checks on, in an optimised build of the default codegen units (cargo-fuzz forces one, which
# builds slower). `cargo fuzz run <target>` works on the same layout for longer runs.
TRIPLE=$(rustc -vV | sed -n 's/^host: //p')
RUSTFLAGS_FUZZ="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4"
RUSTFLAGS_FUZZ+=" -Cllvm-args=-sanitizer-coverage-inline-8bit-counters"
RUSTFLAGS_FUZZ+=" -Cllvm-args=-sanitizer-coverage-pc-table"
RUSTFLAGS_FUZZ+=" -Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing"
RUSTFLAGS_FUZZ+=" -Cllvm-args=-simplifycfg-branch-fold-threshold=0"
RUSTFLAGS_FUZZ+=" -Cdebug-assertions -Coverflow-checks"
case "$TRIPLE" in *-linux-*) RUSTFLAGS_FUZZ+=" -Cllvm-args=-sanitizer-coverage-stack-depth" ;; esac
if rustup run nightly rustc --version >/dev/null 2>&1; then
  TOOLCHAIN=(+nightly)
  SANITIZER=address
  RUSTFLAGS_FUZZ+=" -Zsanitizer=address"
else
  TOOLCHAIN=()
  SANITIZER=none
fi
FEATURES=()
if [ -n "${FUZZ_FEATURES:-}" ]; then
  FEATURES=(--features "$FUZZ_FEATURES")
fi
[ "${FUZZ_STAGE:-all}" = build ] || echo "fuzzing ${TARGETS[*]} for ${SECONDS_EACH} s each (sanitizer: $SANITIZER; features: ${FUZZ_FEATURES:-none})"
cd fuzz
# FUZZ_STAGE: build, run (what an earlier build made) or both (the default). The test command
# builds in the background while the Python suites run, and runs the targets after them.
STAGE=${FUZZ_STAGE:-all}
if [ "$STAGE" != run ]; then
  # --target: the flags reach the fuzzed code only, not build scripts and proc macros.
  RUSTFLAGS="$RUSTFLAGS_FUZZ" cargo "${TOOLCHAIN[@]}" build -q --release --target "$TRIPLE" \
    --config 'profile.release.debug="line-tables-only"' "${FEATURES[@]}" --bins
fi
[ "$STAGE" != build ] || exit 0
# One target: its log in corpus/<t>.log, its summary (or its failure) on stdout.
run_target() {
  local t=$1
  mkdir -p "corpus/$t" "artifacts/$t"
  # corpus/<t> gathers what this machine found (ignored by git); seeds/<t> is only read.
  if ! "target/$TRIPLE/release/$t" -artifact_prefix="artifacts/$t/" "corpus/$t" "seeds/$t" \
      -max_total_time="$SECONDS_EACH" -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
      >"corpus/$t.log" 2>&1; then
    tail -n 40 "corpus/$t.log"
    echo "fuzz target $t FAILED: the input is in fuzz/artifacts/$t/" >&2
    return 1
  fi
  local runs cov
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "corpus/$t.log" | grep -o '[0-9]*$' || echo '?')
  cov=$(grep -o 'cov: [0-9]*' "corpus/$t.log" | tail -n 1 || true)
  echo "$t: $runs inputs, no crash ($cov, corpus $(ls "corpus/$t" | wc -l))"
}
# FUZZ_JOBS targets at a time (default: one per core; libFuzzer runs one thread per target), so
# each still gets its SECONDS; their summaries print in the targets' order once all are done.
jobs_max=${FUZZ_JOBS:-$(nproc)}
mkdir -p corpus  # each target's summary goes there before the target makes its own folder
declare -A pid=()
for t in "${TARGETS[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
  run_target "$t" >"corpus/$t.out" 2>&1 &
  pid[$t]=$!
done
failed=()
for t in "${TARGETS[@]}"; do
  wait "${pid[$t]}" || failed+=("$t")
  cat "corpus/$t.out"
done
[ ${#failed[@]} = 0 ] || { echo "fuzz targets failed: ${failed[*]}" >&2; exit 1; }
