"""Reader threads over NIXL: how much one trainer process gains from reading with several threads.

A producer process publishes one object of ``--mib`` MiB (``_producer.py``, NIXL over
``UCX_TLS=tcp``), and this process reads it with ``ArenaFeatureStore.get(result, out=...)``
(each thread into a ``ReadBuffer`` of its own, registered once per reader agent) for
``--seconds`` per configuration, configurations interleaved over ``--rounds`` rounds:

- ``1 thread``, ``4 threads`` of this process (up to four requests in flight per producer host,
  each in a reader agent of its own);
- ``2 processes``: two trainer processes of one thread each, side by side (what two independent
  UCX workers reach on this machine: the reference for what the threads could gain here).

Reported: median throughput per configuration and the ratio to one thread; the CPU time the
producer and this process took per GB read (from ``/proc``), which says what bounds it on this
machine. Target (#21): 4 threads >= 1.5 x one thread, or what bounds it.

Run:  .venv/bin/python crates/capture-arena-py/benches/bench_threads.py [--mib 16] [--seconds 2] [--rounds 5] [--json out.json]
(needs the nixl feature and SGLANG_SPEC_CAPTURE_NIXL_LIB; scripts/test.sh installs both)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time

ap = argparse.ArgumentParser()
ap.add_argument("--mib", type=int, default=16)
ap.add_argument("--seconds", type=float, default=2.0)
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--json")
ARGS = ap.parse_args()
os.environ["UCX_TLS"] = "tcp"  # before anything loads UCX

import numpy as np  # noqa: E402

import capture_arena as ca  # noqa: E402

import _producer  # noqa: E402  (this directory: the producer process)

ENV = {"SGLANG_SPEC_CAPTURE_PLACEMENT": "arena", "SGLANG_SPEC_CAPTURE_TRANSPORT": "nixl"}
HZ = os.sysconf("SC_CLK_TCK")

# One thread reading for a while in a process of its own; prints bytes read.
SOLO = r"""
import json, sys, time
import numpy as np
import capture_arena as ca
r, seconds, start = json.loads(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
store = ca.ArenaFeatureStore()
n = r["features"]["x"]["shape"][0]
rb = ca.ReadBuffer(n)
out = {"x": np.asarray(rb)}
store.get(r, out=out)
while time.time() < start:
    time.sleep(0.001)
end, got = time.time() + seconds, 0
while time.time() < end:
    store.get(r, out=out)
    got += n
print(got, flush=True)
"""


def cpu_seconds(pid: int | str) -> float:
    """User + system CPU time of process `pid` and all its threads (children not included)."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / HZ


def tree_cpu(pid: int) -> float:
    """CPU time of `pid` and its live child processes (the producer's NIXL server)."""
    total = cpu_seconds(pid)
    for t in os.listdir(f"/proc/{pid}/task"):
        for c in open(f"/proc/{pid}/task/{t}/children").read().split():
            total += cpu_seconds(c)
    return total


def threads(store: ca.ArenaFeatureStore, r: dict, outs: list[dict], seconds: float) -> int:
    """Reads `r` from len(outs) threads for `seconds`; returns bytes read."""
    n = r["features"]["x"]["shape"][0]
    got = [0] * len(outs)
    end = time.perf_counter() + seconds

    def run(k: int) -> None:
        while time.perf_counter() < end:
            store.get(r, out=outs[k])
            got[k] += n

    ts = [threading.Thread(target=run, args=(k,)) for k in range(len(outs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(got)


def processes(r: dict, k: int, seconds: float) -> int:
    start = time.time() + 3.0  # every process connected and warm by then
    ps = [
        subprocess.Popen([sys.executable, "-c", SOLO, json.dumps(r), str(seconds), str(start)], stdout=subprocess.PIPE, text=True)
        for _ in range(k)
    ]
    total = 0
    for p in ps:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        total += int(out.split()[-1])
    return total


def main() -> None:
    n = ARGS.mib << 20
    p, r = _producer.start(ENV, n)
    try:
        store = ca.ArenaFeatureStore()
        bufs = [ca.ReadBuffer(n) for _ in range(4)]
        outs = [{"x": np.asarray(b)} for b in bufs]
        src = (np.arange(n, dtype=np.uint64) % 251).astype(np.uint8)
        threads(store, r, outs, 0.5)  # warm-up: every agent made, connected, registered
        for o in outs:
            assert np.array_equal(o["x"], src)
        configs = {
            "1 thread": lambda: threads(store, r, outs[:1], ARGS.seconds),
            "4 threads": lambda: threads(store, r, outs, ARGS.seconds),
            "2 processes": lambda: processes(r, 2, ARGS.seconds),
        }
        rate: dict[str, list[float]] = {k: [] for k in configs}
        cpu: dict[str, list[tuple[float, float]]] = {k: [] for k in configs}
        names = list(configs)
        for i in range(ARGS.rounds):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                c0 = (tree_cpu(p.pid), cpu_seconds(os.getpid()))
                t0 = time.perf_counter()
                got = configs[name]()
                took = ARGS.seconds if name == "2 processes" else time.perf_counter() - t0
                c1 = (tree_cpu(p.pid), cpu_seconds(os.getpid()))
                rate[name].append(got / took / 1e9)
                cpu[name].append(((c1[0] - c0[0]) / (got / 1e9), (c1[1] - c0[1]) / (got / 1e9)))
        base = statistics.median(rate["1 thread"])
        print(f"{os.cpu_count()} cores; {ARGS.mib} MiB reads over NIXL (UCX_TLS=tcp), {ARGS.seconds} s x {ARGS.rounds} rounds, interleaved")
        rows = []
        for name in names:
            med = statistics.median(rate[name])
            pc = statistics.median(c[0] for c in cpu[name])
            rc = statistics.median(c[1] for c in cpu[name])
            rc_text = "(in its processes)" if name == "2 processes" else f"{rc:.2f} s/GB"
            print(f"  {name:12} {med:6.2f} GB/s  {med / base:4.2f} x one thread   producer CPU {pc:.2f} s/GB, reader {rc_text}")
            rows.append({"config": name, "gb_s": med, "ratio": med / base, "producer_cpu_s_per_gb": pc, "reader_cpu_s_per_gb": rc})
        if ARGS.json:
            pathlib.Path(ARGS.json).write_text(json.dumps(rows, indent=1))
    finally:
        _producer.stop(p)


if __name__ == "__main__":
    main()
