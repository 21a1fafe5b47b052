"""What checking objects' stamps costs a read, side by side with the check off.

For each transport (``shm``: shared memory on this host; ``nixl``: NIXL over ``UCX_TLS=tcp``, into
a ``ReadBuffer`` registered once; ``engine``: a Mooncake TransferEngine arena over TCP) and each size,
a producer process publishes one object (``_producer.py``), and this process reads it with
``ArenaFeatureStore.get(result, out=...)`` in interleaved rounds, alternately:

- ``stamped``: the result as published (the reader checks the object's stamp before and after the
  copy; before 2026-12-05 only after it, except on shared memory);
- ``bare``: the same result with its ``stamp`` field removed (no check: what readers did before).

The cost is ``stamped / bare - 1`` of the median read time. Targets (#21): <= 2 % at 1 MiB and
<= 0.5 % at 16 MiB.

Run:  .venv/bin/python crates/capture-arena-py/benches/bench_stamps.py [--sizes 1,16,100] [--rounds 31] [--transports shm,nixl,engine] [--json out.json]
(nixl needs the nixl feature and SGLANG_SPEC_CAPTURE_NIXL_LIB; engine needs the Mooncake wheel;
scripts/test.sh installs both)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import statistics
import time

ap = argparse.ArgumentParser()
ap.add_argument("--sizes", default="1,16,100", help="MiB, comma-separated")
ap.add_argument("--rounds", type=int, default=31)
ap.add_argument("--transports", default="shm,nixl,engine")
ap.add_argument("--json")
ARGS = ap.parse_args()
os.environ["UCX_TLS"] = "tcp"  # before anything loads UCX
os.environ.setdefault("GLOG_minloglevel", "2")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

import numpy as np  # noqa: E402

import capture_arena as ca  # noqa: E402

import _producer  # noqa: E402  (this directory: the producer process)

ENVS = {
    "shm": {"SGLANG_SPEC_CAPTURE_PLACEMENT": "arena"},
    "nixl": {"SGLANG_SPEC_CAPTURE_PLACEMENT": "arena", "SGLANG_SPEC_CAPTURE_TRANSPORT": "nixl"},
    "engine": {"SGLANG_SPEC_CAPTURE_PLACEMENT": "engine", "MOONCAKE_PROTOCOL": "tcp"},
}


def main() -> None:
    rows = []
    print(f"{os.cpu_count()} cores; median of {ARGS.rounds} reads each, interleaved")
    for transport in ARGS.transports.split(","):
        for mib in [int(x) for x in ARGS.sizes.split(",")]:
            n = mib << 20
            p, stamped = _producer.start(ENVS[transport], n)
            assert "stamp" in stamped["features"]["x"], stamped
            bare = copy.deepcopy(stamped)
            del bare["features"]["x"]["stamp"]
            store = ca.ArenaFeatureStore()
            if transport == "nixl":
                rb = ca.ReadBuffer(n)
                out = {"x": np.asarray(rb)}
            else:
                out = {"x": np.empty(n, dtype=np.uint8)}
            src = (np.arange(n, dtype=np.uint64) % 251).astype(np.uint8)
            ops = {"stamped": lambda: store.get(stamped, out=out), "bare": lambda: store.get(bare, out=out)}
            for op in ops.values():  # warm-up: connect, register, fault in
                op()
                op()
            assert np.array_equal(out["x"], src)
            times: dict[str, list[float]] = {k: [] for k in ops}
            names = list(ops)
            for r in range(ARGS.rounds):
                for what in names[r % 2 :] + names[: r % 2]:
                    t0 = time.perf_counter()
                    ops[what]()
                    times[what].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            cost = med["stamped"] / med["bare"] - 1
            rows.append(
                {
                    "transport": transport,
                    "mib": mib,
                    "stamped_ms": round(med["stamped"] * 1e3, 4),
                    "bare_ms": round(med["bare"] * 1e3, 4),
                    "cost_pct": round(cost * 100, 2),
                }
            )
            print(
                f"{transport:<7} {mib:>4} MiB  stamped {med['stamped'] * 1e3:>9.3f} ms  bare {med['bare'] * 1e3:>9.3f} ms"
                f"  cost {cost * 100:+6.2f} %"
            )
            _producer.stop(p)
    if ARGS.json:
        pathlib.Path(ARGS.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
