#!/usr/bin/env bash
# The NIXL library for capture-arena's nixl feature: downloads the nixl-cu12 wheel this build is
# pinned to (without its dependencies: its libraries are self-contained), unpacks it under
# .cache/nixl/ and prints the directory holding libnixl_capi.so, for SGLANG_SPEC_CAPTURE_NIXL_LIB.
# Usage: scripts/nixl-lib.sh [PYTHON]     (PYTHON: a python with pip; default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
WHEEL=nixl_cu12-1.5.1   # pinned with nixl-sys =1.5.2 (Cargo.toml); change both together
DIR=.cache/nixl
LIB="$PWD/$DIR/wheel/.nixl_cu12.mesonpy.libs"
if [ ! -f "$LIB/libnixl_capi.so" ]; then
  mkdir -p "$DIR"
  if ! ls "$DIR"/"$WHEEL"-*.whl >/dev/null 2>&1; then
    echo "downloading ${WHEEL/_/-} (about 70 MB) into $DIR" >&2
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DIR" "nixl-cu12==1.5.1" >&2
  fi
  rm -rf "$DIR/wheel.tmp"
  "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
    "$(ls "$DIR"/"$WHEEL"-*.whl | head -1)" "$DIR/wheel.tmp"
  rm -rf "$DIR/wheel" && mv "$DIR/wheel.tmp" "$DIR/wheel"
fi
echo "$LIB"
