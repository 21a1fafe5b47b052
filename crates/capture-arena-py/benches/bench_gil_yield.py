"""Whether a thread waiting for the GIL (vLLM's) takes it between two holds of one long
request's token ids, which the vLLM connector's copy thread reads with the GIL (``rows.rs``:
holds of ``--hold`` ids, the GIL let go for 100 µs between them since 2026-12-07).

A step of one request of ``--ids`` ids goes to ``_copy_requests_rows`` as the copy thread hands
it. The last id of the first hold and the first of the second are one object whose value is its
length (``list.__len__``: C, so no thread switch can happen while the extension reads it), and a
thread appends to it whenever it holds the GIL: the two ids differ exactly when that thread took
the GIL at the cut. At Python's 5 ms switch interval a hold longer than it lets the waiter ask
for the GIL, and CPython then hands it over at any release; at a 1 s interval only the release
itself can let the waiter in, which is what a hold shorter than 5 ms (a release build's) relies
on. Each run prints how many of ``--runs`` steps let it in, and the steps' times.

Run:  .venv/bin/python crates/capture-arena-py/benches/bench_gil_yield.py [--runs 10] [--ids 2097152] [--hold 1048576]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch

import capture_arena as ca
from _release import BUILD
from capture_arena._capture_arena import _Landed


class Grows(list):  # type: ignore[type-arg]
    __index__ = list.__len__


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--ids", type=int, default=1 << 21)
    ap.add_argument("--hold", type=int, default=1 << 20)
    ap.add_argument("--intervals", default="0.005,1.0")
    a = ap.parse_args()
    bs, n, hold = 1024, a.ids, a.hold
    blocks = -(-n // bs)
    kv = torch.zeros(blocks, 1, bs, 1, dtype=torch.bfloat16)
    cache = (kv.data_ptr(), kv.numel() * 2, tuple(x * 2 for x in kv.stride()[:3]), bs, 1, 2, kv.shape[0])
    sink = ca.ArenaSink(arena_bytes=max(64 << 20, 16 * n), wait_s=2)
    sink._start(None)
    try:
        with ca.ArenaFeatureStore() as store:
            for interval in (float(x) for x in a.intervals.split(",")):
                took, ms = 0, []
                for run in range(a.runs):
                    grows, stop = Grows([0]), threading.Event()

                    def waiter() -> None:  # vLLM's thread
                        while True:
                            grows.append(0)
                            if stop.is_set():
                                return

                    ((keys, at, row),) = sink._reserve_rows_begin("st", "bfloat16", 1, [(f"r{interval}-{run}", 1, n)], within_s=2).wait_dicts()
                    ids: list[object] = list(range(n))
                    ids[hold - 1] = ids[hold] = grows
                    t = threading.Thread(target=waiter, daemon=True)
                    before = sys.getswitchinterval()
                    sys.setswitchinterval(interval)
                    t.start()
                    t0 = time.perf_counter()
                    why = sink._copy_requests_rows(cache, [(keys, at["token_ids"], ids, n, at["hidden_states"], n * 2, list(range(blocks)))], _Landed(1), 0, hold)
                    ms.append(round((time.perf_counter() - t0) * 1e3, 1))
                    sys.setswitchinterval(before)
                    stop.set()
                    t.join()
                    assert why == [None], why
                    tokens = store.get(row)["token_ids"][0]
                    took += int(tokens[hold]) > int(tokens[hold - 1])
                    store.release(row)
                print(json.dumps({"build": BUILD, "ids": n, "hold": hold, "switch_interval_s": interval, "runs": a.runs, "waiter_took_the_gil_at_the_cut": took, "step_ms": ms}), flush=True)
    finally:
        sink.close()


if __name__ == "__main__":
    main()
