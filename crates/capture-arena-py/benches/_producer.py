"""The benchmarks' producer process: publishes one object of n bytes (``x``, ``i % 251``) with
``capture_arena.new_sink()`` (the placement and transport its environment selects), prints the
result, and keeps the arena until a line arrives on its stdin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

SCRIPT = r"""
import json, sys, numpy as np
import capture_arena as ca
n = int(sys.argv[1])
sink = ca.new_sink()
data = (np.arange(n, dtype=np.uint64) % 251).astype(np.uint8)
spec = {"store_id": "bench", "sample_id": f"x{n}", "gen": 1, "features": {},
        "passthrough": [{"name": "x", "data": data, "shape": [n], "dtype": "uint8"}]}
print(json.dumps(sink.put_sample(spec)), flush=True)
sys.stdin.readline()
sink.close()
"""


def start(env: dict[str, str], n: int) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Starts a producer of n bytes with `env` added to this process's environment (and an arena
    of n + 4 MiB); returns it and its result. Lines that are not JSON (a library's log) are
    skipped."""
    e = {**os.environ, "SGLANG_SPEC_CAPTURE_ARENA_BYTES": str(n + (4 << 20)), **env}
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, str(n)], env=e, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return p, first_json(p, f"the producer ({env})")


def first_json(p: subprocess.Popen[str], what: str) -> dict[str, Any]:
    """The first line of `p`'s stdout that is JSON (lines that are not, a library's log, are
    skipped); RuntimeError naming `what` if `p` exits first."""
    assert p.stdout is not None
    while True:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"{what} exited without a result")
        if line.startswith("{"):
            return json.loads(line)  # type: ignore[no-any-return]


def stop(p: subprocess.Popen[str]) -> None:
    """Lets a producer close its sink and exit."""
    assert p.stdin is not None
    p.stdin.write("\n")
    p.stdin.flush()
    p.wait(timeout=60)
