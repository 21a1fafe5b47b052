"""The shared-memory read from Python with no Mooncake in the picture: one producer process
publishes one object (``--mib``, default 100) into a shared-memory arena; this process reads it
with ``ArenaFeatureStore.get(result, out=...)`` and, interleaved, copies the same number of bytes
with ``numpy.copyto`` (between anonymous arrays). Prints the medians of 3 blocks of 7.

Run:  .venv/bin/python crates/capture-arena-py/benches/bench_shm_read.py [--mib 100]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import capture_arena as ca

PRODUCER = r"""
import json, sys, numpy as np
import capture_arena as ca
n = int(sys.argv[1])
sink = ca.ArenaSink(arena_bytes=n + (4 << 20))
data = (np.arange(n, dtype=np.uint64) % 251).astype(np.uint8)
spec = {"store_id": "bench", "sample_id": "x", "gen": 1, "features": {},
        "passthrough": [{"name": "x", "data": data, "shape": [n], "dtype": "uint8"}]}
print(json.dumps(sink.put_sample(spec)), flush=True)
sys.stdin.readline()
sink.close()
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=100)
    a = ap.parse_args()
    n = a.mib << 20
    env = {**os.environ, "SGLANG_SPEC_CAPTURE_PLACEMENT": "arena"}
    p = subprocess.Popen([sys.executable, "-c", PRODUCER, str(n)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdin is not None
    r = json.loads(p.stdout.readline())
    store = ca.ArenaFeatureStore()
    out = {"x": np.empty(n, dtype=np.uint8)}
    src = np.ones(n, dtype=np.uint8)
    store.get(r, out=out)  # maps the arena
    for _ in range(3):
        get, cp = [], []
        for _ in range(7):
            t0 = time.perf_counter()
            store.get(r, out=out)
            get.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            np.copyto(out["x"], src)
            cp.append(time.perf_counter() - t0)
        g, c = statistics.median(get), statistics.median(cp)
        print(f"{a.mib} MiB: get {g * 1e3:.2f} ms ({n / g / 1e9:.2f} GB/s), memcpy {c * 1e3:.2f} ms ({n / c / 1e9:.2f} GB/s), get / memcpy {g / c:.2f}")
    p.stdin.write("\n")
    p.stdin.flush()
    p.wait()


if __name__ == "__main__":
    main()
