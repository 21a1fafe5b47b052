#!/usr/bin/env bash
# Builds capture-arena for the seed's platform, Grace (GB200/GB300: aarch64-unknown-linux-gnu),
# from an x86-64 Debian 12 machine: the core with its cuda and nixl features, the
# CLI, the Python extension, and an abi3 wheel (target/wheels/capture_arena-*-manylinux*_aarch64.whl).
# Nothing runs: Debian 12's qemu-user (7.2) hangs on any program that starts a thread
# (the reason is in README.md's test section), so the aarch64-specific arithmetic (64 KiB pages) is
# tested on this host with the page size as a parameter (`cargo test -p capture-arena page`).
#
# Installs, when missing: Debian's rustc-web/cargo-web (1.96), whose packages carry the arm64
# standard library (libstd-rust-web-dev:arm64, after `dpkg --add-architecture arm64`), and the
# cross linker and headers (gcc/g++-aarch64-linux-gnu: NIXL's stubs are C++, bindgen parses the
# arm64 libc headers). rustup's own target would need static.rust-lang.org, which CI cannot reach.
# One build serves the wheel and the rest (same features: the Python module turns the core's cuda
# feature on), in target/aarch64 of its own.
# Usage: scripts/aarch64.sh            (release: the wheel to ship)
#        AARCH64_PROFILE=dev scripts/aarch64.sh   (the test command: the same code built, unoptimised)
#        AARCH64_STAGE=install scripts/aarch64.sh (only install the toolchain)
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=aarch64-unknown-linux-gnu
export DEBIAN_FRONTEND=noninteractive
# sudo drops the environment: apt's noninteractive frontend goes through it explicitly.
SUDO=$([ "$(id -u)" = 0 ] || echo "sudo env DEBIAN_FRONTEND=noninteractive")

if [ ! -x /usr/bin/cargo ] || [ ! -d /usr/lib/rustlib/$TARGET/lib ] \
    || ! command -v aarch64-linux-gnu-g++ >/dev/null; then
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    $SUDO dpkg --add-architecture arm64
  fi
  $SUDO apt-get ${APT_LOCK_WAIT:-} update -qq
  $SUDO apt-get ${APT_LOCK_WAIT:-} install -y -qq --no-install-recommends rustc-web cargo-web \
    libstd-rust-web-dev:arm64 gcc-aarch64-linux-gnu g++-aarch64-linux-gnu libc6-dev-arm64-cross
fi
# AARCH64_STAGE=install: only that (the test command installs in the background, builds later).
[ "${AARCH64_STAGE:-all}" != install ] || exit 0
echo "$(/usr/bin/rustc --version) for $TARGET (Debian's rustc-web; the host builds use rustup's)"

# Debian's cargo and rustc, first on PATH for maturin too; the linker and C/C++ compilers of the
# target; bindgen (nixl-sys) parses for the target with the cross headers.
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
ln -s /usr/bin/cargo "$bin/cargo"
ln -s /usr/bin/rustc "$bin/rustc"
# nixl-sys's build script names its compiler itself (cc::Build::compiler("g++")), whatever the
# target: on this PATH g++ is the cross compiler (no build script for the host compiles C++).
ln -s "$(command -v aarch64-linux-gnu-g++)" "$bin/g++"
export PATH="$bin:$PATH" RUSTC=/usr/bin/rustc CARGO=/usr/bin/cargo
export CARGO_TARGET_DIR="$PWD/target/aarch64"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++
export BINDGEN_EXTRA_CLANG_ARGS_aarch64_unknown_linux_gnu="--target=$TARGET --sysroot=/usr/aarch64-linux-gnu"
PROFILE=${AARCH64_PROFILE:-release}
# Less debug information than the workspace's profiles: nothing here is run or profiled.
export CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_DEV_DEBUG=0 CARGO_INCREMENTAL=0
dir=$([ "$PROFILE" = dev ] && echo debug || echo "$PROFILE")

t0=$SECONDS
# The wheel first (abi3: no aarch64 Python needed), then the rest from the same build. An earlier
# run's wheel goes first, so a failed build cannot pass for a built one below.
rm -f target/wheels/capture_arena-*aarch64.whl
.venv/bin/maturin build --profile "$PROFILE" --target "$TARGET" -m crates/capture-arena-py/Cargo.toml \
  --features nixl --out target/wheels -q 2>&1 | grep -v '^$' || true
wheel=$(ls -t target/wheels/capture_arena-*aarch64.whl 2>/dev/null | head -n 1)
[ -n "$wheel" ] || { echo "aarch64: no wheel was built" >&2; exit 1; }
# The core (cuda, nixl) was built for the wheel with these features; the CLI adds its own crate.
cargo build --profile "$PROFILE" --target "$TARGET" -q -p capture-arena --features cuda,nixl --lib
cargo build --profile "$PROFILE" --target "$TARGET" -q -p capture-arena-cli --features nixl --bins
cli="$CARGO_TARGET_DIR/$TARGET/$dir/capture-arena"
# Each artefact is an aarch64 ELF (e_machine 183), the wheel's extension an abi3 one.
python3 - "$wheel" "$cli" <<'EOF'
import sys, zipfile
def machine(head: bytes) -> int:
    assert head[:4] == b"\x7fELF", "not an ELF file"
    return int.from_bytes(head[18:20], "little")
wheel, cli = sys.argv[1:]
z = zipfile.ZipFile(wheel)
so = [n for n in z.namelist() if n.endswith(".so")]
assert so and all(n.endswith(".abi3.so") for n in so), so
for name, head in [(so[0], z.read(so[0])[:20]), (cli, open(cli, "rb").read(20))]:
    assert machine(head) == 183, f"{name} is not an aarch64 executable"
print("aarch64 wheel:", wheel.rsplit("/", 1)[-1], "with", ", ".join(so))
EOF
echo "aarch64 ($PROFILE): core (cuda, nixl), CLI and abi3 wheel built in $((SECONDS - t0)) s"
