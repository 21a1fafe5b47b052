"""NIXL reads against Mooncake's TransferEngine reads of the same bytes, side by side.

Two producer processes publish the same object (16 MiB, 100 MiB by default) with capture-arena:
one into an arena served through NIXL (``transport="nixl"``), one into a TransferEngine host arena
(the engine placement over ``MOONCAKE_PROTOCOL=tcp``). This process, as the trainer, reads it in
interleaved rounds (the order rotates each round, so a slow moment of this shared machine hits
all of them alike):

- ``nixl``: ``ArenaFeatureStore.get(result, out=...)`` of the NIXL result, over the UCX
  transports ``--ucx-tls`` names (``tcp``: the cross-host path; ``default``: UCX picks, cma or
  shared memory on one host);
- ``nixl_readbuffer``: the same into a view of a ``capture_arena.ReadBuffer``, registered with
  NIXL once (``nixl`` registers the numpy output for each read);
- ``nixl_fresh``: ``ArenaFeatureStore.get(result)`` without ``out=``: fresh arrays from the
  output pool, whose slabs NIXL registers once (target #21: >= 0.9 x ``nixl_readbuffer``);
- ``te_reference``: Mooncake's ``TransferEngine.transfer_sync_read`` of the engine result's bytes
  over TCP into a buffer registered once (what a Mooncake-only trainer does);
- ``memcpy``: ``numpy.copyto`` of the same bytes in this process.

Targets (#10): nixl over ``UCX_TLS=tcp`` >= 1.0 x te_reference; nixl over the default
transports >= 0.45 x memcpy.

Run:  .venv/bin/python crates/capture-arena-py/benches/bench_nixl.py [--ucx-tls tcp|default] [--sizes 16,100] [--rounds 9] [--json out.json]
(needs capture_arena built with the nixl feature, SGLANG_SPEC_CAPTURE_NIXL_LIB or the nixl-cu12
wheel installed, and the Mooncake wheel; scripts/test.sh installs all three)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--ucx-tls", default="tcp", help="UCX_TLS for both NIXL agents, or 'default'")
ap.add_argument("--sizes", default="16,100", help="MiB, comma-separated")
ap.add_argument("--rounds", type=int, default=9)
ap.add_argument("--json")
ARGS = ap.parse_args()
# Before anything loads UCX: it reads UCX_TLS once per process.
os.environ.pop("UCX_TLS", None)
if ARGS.ucx_tls != "default":
    os.environ["UCX_TLS"] = ARGS.ucx_tls
os.environ.setdefault("GLOG_minloglevel", "2")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

import numpy as np  # noqa: E402

import capture_arena as ca  # noqa: E402

import _producer  # noqa: E402  (this directory: the producer process)


def main() -> None:
    assert "nixl" in ca.FEATURES, "capture_arena was built without the nixl feature"
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    tls = os.environ.get("UCX_TLS", "default")
    print(f"nixl over UCX_TLS={tls}; te_reference over Mooncake tcp; {os.cpu_count()} cores")
    rows = []
    for mib in [int(x) for x in ARGS.sizes.split(",")]:
        n = mib << 20
        nixl_p, nixl_r = _producer.start({"SGLANG_SPEC_CAPTURE_PLACEMENT": "arena", "SGLANG_SPEC_CAPTURE_TRANSPORT": "nixl"}, n)
        eng_p, eng_r = _producer.start({"SGLANG_SPEC_CAPTURE_PLACEMENT": "engine", "MOONCAKE_PROTOCOL": "tcp"}, n)
        assert nixl_r["arena"]["session"].startswith("nixl://")
        store = ca.ArenaFeatureStore()
        out = {"x": np.empty(n, dtype=np.uint8)}
        rb = ca.ReadBuffer(n)
        out_rb = {"x": np.asarray(rb)}
        ref = np.empty(n, dtype=np.uint8)
        assert te.register_memory(int(ref.ctypes.data), n) == 0
        src = (np.arange(n, dtype=np.uint64) % 251).astype(np.uint8)
        session, address = eng_r["arena"]["session"], eng_r["features"]["x"]["address"]
        ops = {
            "nixl": lambda: store.get(nixl_r, out=out),
            "nixl_readbuffer": lambda: store.get(nixl_r, out=out_rb),
            "nixl_fresh": lambda: store.get(nixl_r),
            "te_reference": lambda: te.transfer_sync_read(session, int(ref.ctypes.data), address, n),
            "memcpy": lambda: np.copyto(out["x"], src),
        }
        for what in ("nixl", "nixl_readbuffer", "nixl_fresh", "te_reference"):  # warm-up (connects, registers) and checks
            ops[what]()
        assert np.array_equal(out["x"], src) and np.array_equal(ref, src) and np.array_equal(out_rb["x"], src)
        times: dict[str, list[float]] = {k: [] for k in ops}
        names = list(ops)
        for r in range(ARGS.rounds):
            for what in names[r % len(names) :] + names[: r % len(names)]:
                t0 = time.perf_counter()
                ops[what]()
                times[what].append(time.perf_counter() - t0)
        store.get(nixl_r, out=out)
        assert np.array_equal(out["x"], src)
        med = {k: statistics.median(v) for k, v in times.items()}
        for what, t in med.items():
            rows.append({"what": what, "mib": mib, "ucx_tls": tls, "median_ms": round(t * 1e3, 3), "gbps": round(n / t / 1e9, 3)})
            print(f"{what:<14} {mib:>5} MiB {t * 1e3:>10.2f} ms {n / t / 1e9:>8.2f} GB/s")
        print(
            f"   nixl / te_reference (bandwidth) = {med['te_reference'] / med['nixl']:.2f}   "
            f"nixl_readbuffer / te_reference = {med['te_reference'] / med['nixl_readbuffer']:.2f}   "
            f"nixl / memcpy = {med['memcpy'] / med['nixl']:.2f}   "
            f"nixl_fresh / nixl_readbuffer = {med['nixl_readbuffer'] / med['nixl_fresh']:.2f}   "
            f"nixl_readbuffer / memcpy = {med['memcpy'] / med['nixl_readbuffer']:.2f}"
        )
        te.unregister_memory(int(ref.ctypes.data))
        for p in (nixl_p, eng_p):
            _producer.stop(p)
    if ARGS.json:
        pathlib.Path(ARGS.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
