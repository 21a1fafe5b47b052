"""Reading published objects through every placement, against Mooncake's own reads, side by side.

Three producer processes publish the same object (1 MiB, 16 MiB, 100 MiB of bytes) with
capture-arena: into a TransferEngine host arena (the engine placement, over TCP), into the
shared-memory arena, and into the Mooncake store (the store placement). This process, as the
trainer, then reads it in interleaved rounds (so a slow moment of this shared machine hits all of
them alike; the order rotates each round):

- ``engine``: ``ArenaFeatureStore.get(result, out=...)`` of the engine placement's result;
- ``te_reference``: Mooncake's own ``TransferEngine.transfer_sync_read`` of the same bytes (same
  session, same address) into a buffer registered once: what a Mooncake-only trainer does;
- ``shm``: ``ArenaFeatureStore.get(result, out=...)`` of the shared-memory result;
- ``store``: ``ArenaFeatureStore.get(result, out=...)`` of the store placement's result;
- ``store_reference``: Mooncake's own ``get_into`` of the same object (the store placement's key),
  into a buffer registered once: what a Mooncake-only trainer does;
- ``memcpy``: ``numpy.copyto`` of the same bytes in this process (what bounds ``shm``).

Targets (#9): engine ≤ 1.1 × te_reference; te_reference ≥ 5 × shm (the shared-memory reader is at
least 5× faster than Mooncake's TCP read).

Run:  .venv/bin/python crates/capture-arena-py/benches/bench_mooncake.py [--sizes 1,16,100] [--rounds 7] [--json out.json]
(starts its own mooncake_master on loopback and stops it at the end)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("GLOG_minloglevel", "2")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

import numpy as np

import capture_arena as ca

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "tests"))
import mooncake_master  # noqa: E402  (the tests' helper: start/stop a master on loopback)

import _producer  # noqa: E402  (this directory: the producer process)


def producer(placement: str, n: int, env: dict[str, str]) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    return _producer.start({**env, "SGLANG_SPEC_CAPTURE_PLACEMENT": placement, "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(2 * n + (64 << 20))}, n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,16,100", help="MiB, comma-separated")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args()
    master, env = mooncake_master.start()
    os.environ.update(env)
    from mooncake.engine import TransferEngine
    from mooncake.store import MooncakeDistributedStore

    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    plain = MooncakeDistributedStore()  # a reader: it contributes no memory
    assert plain.setup("127.0.0.1", env["MOONCAKE_METADATA_SERVER"], 0, 64 << 20, "tcp", "", env["MOONCAKE_MASTER_SERVER_ADDR"]) == 0
    rows = []
    try:
        for mib in [int(x) for x in a.sizes.split(",")]:
            n = mib << 20
            procs = {p: producer(p, n, env) for p in ("engine", "arena", "store")}
            results = {p: r for p, (_, r) in procs.items()}
            store = ca.ArenaFeatureStore()
            out = {"x": np.empty(n, dtype=np.uint8)}
            ref = np.empty(n, dtype=np.uint8)
            assert te.register_memory(int(ref.ctypes.data), n) == 0
            assert plain.register_buffer(int(ref.ctypes.data), n) == 0
            src = (np.arange(n, dtype=np.uint64) % 251).astype(np.uint8)
            store_key = f"bench/x{n}/g1/x"
            eng = results["engine"]
            session, address = eng["arena"]["session"], eng["features"]["x"]["address"]
            ops = {
                "engine": lambda: store.get(results["engine"], out=out),
                "te_reference": lambda: te.transfer_sync_read(session, int(ref.ctypes.data), address, n),
                "shm": lambda: store.get(results["arena"], out=out),
                "store": lambda: store.get(results["store"], out=out),
                "store_reference": lambda: plain.get_into(store_key, int(ref.ctypes.data), n),
                "memcpy": lambda: np.copyto(out["x"], src),
            }
            times: dict[str, list[float]] = {k: [] for k in ops}
            for what, op in ops.items():  # warm-up (maps, connects, registers staging)
                op()
                if what in ("engine", "shm", "store"):
                    assert np.array_equal(out["x"], src), what
            names = list(ops)
            for r in range(a.rounds):
                # Rotated each round, so no operation always follows the same other one.
                for what in names[r % len(names) :] + names[: r % len(names)]:
                    op = ops[what]
                    t0 = time.perf_counter()
                    op()
                    times[what].append(time.perf_counter() - t0)
            assert np.array_equal(ref, src)
            med = {k: statistics.median(v) for k, v in times.items()}
            for what, t in med.items():
                rows.append({"what": what, "mib": mib, "median_ms": round(t * 1e3, 3), "gbps": round(n / t / 1e9, 3)})
                print(f"{what:<16} {mib:>5} MiB {t * 1e3:>10.2f} ms {n / t / 1e9:>8.2f} GB/s")
            print(
                f"   engine / te_reference = {med['engine'] / med['te_reference']:.3f}   "
                f"te_reference / shm = {med['te_reference'] / med['shm']:.1f}   "
                f"store / store_reference = {med['store'] / med['store_reference']:.3f}   "
                f"shm / memcpy = {med['shm'] / med['memcpy']:.2f}"
            )
            te.unregister_memory(int(ref.ctypes.data))
            plain.unregister_buffer(int(ref.ctypes.data))
            for p, _ in procs.values():
                _producer.stop(p)
    finally:
        plain.close()
        mooncake_master.stop(master)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
