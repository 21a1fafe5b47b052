#!/usr/bin/env bash
# Runs every fuzz target (fuzz/fuzz_targets) for SECONDS each, starting from the committed seeds
# (fuzz/seeds/<target>: example inputs, and every input that once found a bug), with cargo-fuzz
# (libFuzzer). Installs cargo-fuzz into .cache/cargo-fuzz when it is missing. Uses the nightly
# toolchain with AddressSanitizer when one is installed, else the stable one without a sanitizer
# (Rust's own checks still panic on out-of-bounds access and overflow in debug assertions).
# A crash fails the run; its input is in fuzz/artifacts/<target>/ (add it to fuzz/seeds/<target>
# once fixed, with a unit test for the bug).
# Usage: scripts/fuzz.sh [SECONDS per target, default 12] [TARGET ...]
#   FUZZ_FEATURES=nixl  also fuzz the NIXL session parser (needs libclang and g++)
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-12}
shift || true
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
  TARGETS=(control_lines keys sessions samples)
fi

CARGO_FUZZ_VERSION=0.13.2
if ! cargo fuzz --version 2>/dev/null | grep -q "$CARGO_FUZZ_VERSION"; then
  if [ ! -x .cache/cargo-fuzz/bin/cargo-fuzz ]; then
    echo "installing cargo-fuzz $CARGO_FUZZ_VERSION into .cache/cargo-fuzz"
    cargo install -q cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION" --root .cache/cargo-fuzz
  fi
  export PATH="$PWD/.cache/cargo-fuzz/bin:$PATH"
fi

if rustup run nightly rustc --version >/dev/null 2>&1; then
  FUZZ=(cargo +nightly fuzz)
  SANITIZER=address
else
  FUZZ=(cargo fuzz)
  SANITIZER=none
fi
FEATURES=()
if [ -n "${FUZZ_FEATURES:-}" ]; then
  FEATURES=(--features "$FUZZ_FEATURES")
fi
echo "fuzzing ${TARGETS[*]} for ${SECONDS_EACH} s each (sanitizer: $SANITIZER; features: ${FUZZ_FEATURES:-none})"
cd fuzz
"${FUZZ[@]}" build -O -s "$SANITIZER" "${FEATURES[@]}"
for t in "${TARGETS[@]}"; do
  mkdir -p "corpus/$t"
  # corpus/<t> gathers what this machine found (ignored by git); seeds/<t> is only read.
  if ! "${FUZZ[@]}" run -O -s "$SANITIZER" "${FEATURES[@]}" "$t" "corpus/$t" "seeds/$t" -- \
      -max_total_time="$SECONDS_EACH" -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
      >"corpus/$t.log" 2>&1; then
    tail -n 40 "corpus/$t.log"
    echo "fuzz target $t FAILED: the input is in fuzz/artifacts/$t/" >&2
    exit 1
  fi
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "corpus/$t.log" | grep -o '[0-9]*$' || echo '?')
  cov=$(grep -o 'cov: [0-9]*' "corpus/$t.log" | tail -n 1 || true)
  echo "$t: $runs inputs, no crash ($cov, corpus $(ls "corpus/$t" | wc -l))"
done
