"""The benchmarks that time the extension's Rust refuse a debug build (the test command installs
one): its Rust runs several times slower than what users install."""

from __future__ import annotations

import sys

from capture_arena import _capture_arena

BUILD = _capture_arena._BUILD


def require_release(script: str, allow_debug: bool) -> None:
    """Exits naming the build and how to make a release one, unless it is one or ``allow_debug``."""
    if BUILD != "release" and not allow_debug:
        sys.exit(
            f"{script}: capture_arena's extension is a {BUILD} build, whose Rust runs several times slower than "
            "what users install; build and install a release wheel first (.venv/bin/maturin build --release "
            "-m crates/capture-arena-py/Cargo.toml --out target/wheels, then pip install it), or pass --allow-debug-build"
        )
