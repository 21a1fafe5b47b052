"""Across hosts, side by side in one run (issue #20): hosts made of network and UTS namespaces
(tests/cluster.py: veth pairs on one bridge), UCX forced to TCP, Mooncake over TCP.

1. Cross-host reads of 64 MiB samples (aux [L, 3H] + last [L, H] bf16, L = 4096, H = 2048) per
   transport: NIXL, a Mooncake TransferEngine arena (engine placement), and NIXL with the trainer
   on the producer's host. Median per-sample read after a first warm-up read; outputs are
   allocated once (NIXL: views of one ReadBuffer, registered once).
2. Two producers x three trainers (every trainer reads from both): aggregate read throughput of
   16 MiB samples, and each producer's publish cost (median ``put_samples`` of one sample) while
   the trainers read, against the same producers publishing while nobody reads.
3. Faults: how long a trainer takes to see each (a read or a release), and the producer's
   publish cost during it against before it.

Needs root (network namespaces). Run:
    .venv/bin/python crates/capture-arena-py/benches/bench_cluster.py [--rounds 6] [--only SECTION] [--json out.json]
UCX's segment size and the NIXL server come from the environment (UCX_TCP_TX_SEG_SIZE,
UCX_TCP_RX_SEG_SIZE, SGLANG_SPEC_CAPTURE_NIXL_SERVER=inline), as for any producer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from cluster import Cluster, unavailable  # noqa: E402
from test_cluster import PUBLISHER as PRODUCER  # noqa: E402
from test_cluster import TRAINER_END, Proc, Publisher, env_on  # noqa: E402

MIB = 1 << 20

# Reads each result into outputs allocated once (views of one ReadBuffer) and releases it;
# "_noread" only releases. One outcome line per result.
TRAINER = r"""
import json, sys, time
import numpy as np, ml_dtypes
import capture_arena as ca
store = ca.ArenaFeatureStore()
rb, outs = None, {}
def out_for(r):
    global rb
    feats = r["features"]
    need = sum((int(np.prod(f["shape"])) * 2 + 4095) // 4096 * 4096 for f in feats.values())
    if rb is None or len(rb) < need:
        rb = ca.ReadBuffer(need)
    mem, off, out = np.asarray(rb), 0, {}
    for name, f in feats.items():
        nb = int(np.prod(f["shape"])) * 2
        out[name] = mem[off:off + nb].view(ml_dtypes.bfloat16).reshape(f["shape"])
        off += (nb + 4095) // 4096 * 4096
    return out
for line in sys.stdin:
    r = json.loads(line)
    noread = r.pop("_noread", False)
    r.pop("_put_s", None)
    out = {"sample_id": r["sample_id"], "ok": True, "error": None, "read_s": 0.0, "bytes": 0}
    t0 = time.perf_counter()
    if not noread:
        try:
            got = store.get(r, out=out_for(r))
            out["bytes"] = sum(int(a.nbytes) for a in got.values())
        except ca.CaptureArenaError as e:
            out["ok"], out["error"] = False, type(e).__name__
    out["read_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    store.release(r)
    out["release_s"] = time.perf_counter() - t1
    print(json.dumps(out), flush=True)
""" + TRAINER_END


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def transports(rounds: int) -> dict[str, Any]:
    shape, n = "4096x2048", rounds + 1
    out: dict[str, Any] = {}
    cases = [
        ("nixl", "t1", {}),
        ("engine", "t1", {"SGLANG_SPEC_CAPTURE_PLACEMENT": "engine", "SGLANG_SPEC_CAPTURE_TRANSPORT": "auto", "MOONCAKE_PROTOCOL": "tcp"}),
        ("nixl same host", "p1", {}),
    ]
    with Cluster(["p1", "t1"]) as c:
        for name, where, extra in cases:
            arena = f"{64 * (n + 1)}MiB"
            p = Publisher(c, "p1", PRODUCER, [], env_on(c, "p1", SGLANG_SPEC_CAPTURE_ARENA_BYTES=arena, **extra))
            rs = p.publish(n, shape)
            t = Proc(c, where, TRAINER, [], env_on(c, where, SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S="60", **extra))
            times = []
            for k, r in enumerate(rs):
                got = t.send(r)
                assert got["ok"], got
                if k:
                    times.append(got["read_s"])
            t.finish()
            st = p.end()
            assert st["resident_objects"] == 0, st
            size = rs[0]["features"]
            nbytes = sum(int(f["shape"][1]) * int(f["shape"][2]) * 2 for f in size.values())
            out[name] = {"median_s": med(times), "MB_s": nbytes / med(times) / 1e6, "bytes": nbytes, "reads": len(times)}
            print(f"  {name:16s} {out[name]['MB_s']:8.0f} MB/s  (median {out[name]['median_s'] * 1e3:.1f} ms of {len(times)})", flush=True)
    return out


def two_by_three(samples: int) -> dict[str, Any]:
    shape = "1024x2048"  # 16 MiB
    with Cluster(["p1", "p2", "t1", "t2", "t3"]) as c:
        arena = f"{16 * (2 * samples + 6)}MiB"
        prods = {h: Publisher(c, h, PRODUCER, [], env_on(c, h, SGLANG_SPEC_CAPTURE_ARENA_BYTES=arena)) for h in ("p1", "p2")}
        trainers = [Proc(c, t, TRAINER, [], env_on(c, t, SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S="60")) for t in ("t1", "t2", "t3")]
        # Every trainer connects to both producers first (a first read sets up the connection).
        warm = {h: prods[h].publish(3, shape) for h in prods}
        for j, tr in enumerate(trainers):
            for h in prods:
                assert tr.send(warm[h][j])["ok"]
        # Publishing while nobody reads (each producer in turn, so they do not share cores).
        quiet = {h: prods[h].publish(samples, shape) for h in prods}
        quiet_put = med([r["_put_s"] for h in quiet for r in quiet[h]])
        # The trainers read those, every trainer from both producers, while the producers
        # publish as many again.
        import threading

        busy: dict[str, list[dict[str, Any]]] = {}

        def publish(h: str) -> None:
            busy[h] = prods[h].publish(samples, shape)

        work: list[list[dict[str, Any]]] = [[], [], []]
        for k, h in enumerate(prods):
            for i, r in enumerate(quiet[h]):
                work[(i + k) % 3].append(r)
        got_bytes = [0, 0, 0]

        def read(j: int) -> None:
            for r in work[j]:
                g = trainers[j].send(r)
                assert g["ok"], g
                got_bytes[j] += g["bytes"]

        t0 = time.perf_counter()
        threads = [threading.Thread(target=read, args=(j,)) for j in range(3)]
        threads += [threading.Thread(target=publish, args=(h,)) for h in prods]
        for th in threads:
            th.start()
        for th in threads[:3]:
            th.join()
        wall = time.perf_counter() - t0
        for th in threads[3:]:
            th.join()
        busy_put = med([r["_put_s"] for h in busy for r in busy[h][: samples // 2]])
        # The rest are freed without reading.
        for k, h in enumerate(prods):
            for i, r in enumerate(busy[h]):
                trainers[(i + k) % 3].send({**r, "_noread": True})
        for tr in trainers:
            tr.finish()
        for p in prods.values():
            st = p.end()
            assert st["resident_objects"] == 0 and st["unknown_frees"] == 0, st
    agg = sum(got_bytes) / wall / 1e6
    out = {
        "aggregate_MB_s": agg,
        "read_wall_s": wall,
        "put_quiet_ms": quiet_put * 1e3,
        "put_while_read_ms": busy_put * 1e3,
        "publish_rate_ratio": quiet_put / busy_put,
    }
    print(
        f"  2x3: {agg:.0f} MB/s aggregate ({sum(got_bytes) / MIB:.0f} MiB in {wall:.2f} s); publish {quiet_put * 1e3:.2f} ms "
        f"quiet vs {busy_put * 1e3:.2f} ms while read: {out['publish_rate_ratio']:.2f} x the rate",
        flush=True,
    )
    return out


def faults() -> dict[str, Any]:
    shape = "512x512"  # 2 MiB
    out: dict[str, Any] = {}
    with Cluster(["p1", "p2", "t1"]) as c:
        p = Publisher(c, "p1", PRODUCER, [], env_on(c, "p1", SGLANG_SPEC_CAPTURE_ARENA_BYTES="256MiB"))
        t = Proc(c, "t1", TRAINER, [], env_on(c, "t1"))
        base = p.publish(20, shape)
        base_put = med([r["_put_s"] for r in base])
        for r in base[:2]:
            assert t.send(r)["ok"]

        def during(fault: str, cut: Any, heal: Any, r: dict[str, Any]) -> None:
            cut()
            seen = t.send(r)
            puts = p.publish(10, shape)
            heal()
            put = med([x["_put_s"] for x in puts])
            out[fault] = {"seen_s": seen["read_s"], "error": seen["error"], "release_s": seen["release_s"], "put_ratio": base_put / put}
            print(
                f"  {fault:22s} seen in {seen['read_s']:.2f} s ({seen['error']}), release {seen['release_s'] * 1e6:.0f} us, "
                f"publish {out[fault]['put_ratio']:.2f} x the rate before",
                flush=True,
            )
            time.sleep(1.2)
            for x in puts:
                t.send({**x, "_noread": True})

        during("partition", lambda: c.partition("p1"), lambda: c.heal("p1"), base[2])
        during("trainer cable pulled", lambda: c.pull_cable("t1"), lambda: c.plug_cable("t1"), base[3])
        for r in base[4:]:
            t.send(r)
        t.finish()
        st = p.end()
        assert st["resident_objects"] == 0, st
        # A killed producer, on another host.
        p2 = Publisher(c, "p2", PRODUCER, [], env_on(c, "p2", SGLANG_SPEC_CAPTURE_ARENA_BYTES="64MiB"))
        rs = p2.publish(2, shape)
        t = Proc(c, "t1", TRAINER, [], env_on(c, "t1"))
        assert t.send(rs[0])["ok"]
        c.killed(p2.p)
        seen = t.send(rs[1])
        out["producer killed"] = {"seen_s": seen["read_s"], "error": seen["error"], "release_s": seen["release_s"]}
        print(f"  {'producer killed':22s} seen in {seen['read_s']:.3f} s ({seen['error']}), release {seen['release_s'] * 1e6:.0f} us", flush=True)
        t.finish()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--samples", type=int, default=12, help="16 MiB samples per producer in the 2x3 run")
    ap.add_argument("--only", choices=["transports", "2x3", "faults"], help="run one section")
    ap.add_argument("--json")
    a = ap.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"cannot build a cluster here: {why}")
    res = {}
    if a.only in (None, "transports"):
        print("1. cross-host reads of 64 MiB samples", flush=True)
        res["transports"] = transports(a.rounds)
        tr = res["transports"]
        print(
            f"  NIXL / TransferEngine: {tr['nixl']['MB_s'] / tr['engine']['MB_s']:.2f} x; "
            f"NIXL across hosts / same host: {tr['nixl']['MB_s'] / tr['nixl same host']['MB_s']:.2f} x",
            flush=True,
        )
    if a.only in (None, "2x3"):
        print("2. two producers x three trainers", flush=True)
        res["2x3"] = two_by_three(a.samples)
    if a.only in (None, "faults"):
        print("3. faults", flush=True)
        res["faults"] = faults()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
