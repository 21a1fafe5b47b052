"""The GIL that the vLLM connector's copy thread holds for a step: reading each request's token
ids out of vLLM's list (Python ints, so with the GIL) and handing the requests to the native
copy, whose copying itself runs with the GIL released. Every microsecond of it is one that
vLLM's thread, which needs the GIL for every line of its loop, may wait for.

Each step of ``N`` prompts of ``L`` tokens is handed to ``_copy_requests_rows`` as the
connector's copy thread hands it (``_Rows._copy_native``), with destinations outside the arena,
so that every request is refused before any byte is copied: the call's time is then the GIL-held
part alone. Since 2026-12-05 the extension reads the first ``n`` ids of vLLM's list in place,
in holds of at most 2^17 ids, each hold's requests copied with the GIL released before the next
is read; before, the connector sliced each list in Python and the extension read every
request's ids through PyO3's sequence extraction before the first copy. Run it with each build
on ``PYTHONPATH``, alternating: it hands a build the requests as that build takes them.

Run:  .venv/bin/python crates/capture-arena-py/benches/bench_copy_gil.py [--loads 32x2048,8x2048,4x16000,32x16000]
      [--steps 41] [--json out.json]
Times a release build of the extension only (``--allow-debug-build`` to time another).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from _release import BUILD, require_release
import capture_arena as ca
from capture_arena._capture_arena import _Landed

BLOCK = 16


def step(sink: Any, reqs: int, n: int, sliced: bool) -> float:
    """One step's GIL-held part: slicing (the build before) and reading its requests."""
    ids = [[(i * 7919 + j) % 150000 for j in range(n)] for i in range(reqs)]  # vLLM's lists of ints
    blocks = [list(range(i * -(-n // BLOCK), (i + 1) * -(-n // BLOCK))) for i in range(reqs)]
    cache = (4096, 4096, (0, 0, 0), BLOCK, 3, 32, 1)  # never read: every request is refused first
    t = time.perf_counter()
    if sliced:  # (keys, (ids_at, stamp), token_ids[:n], n, (rows_at, stamp), rows_len, block_ids)
        todo: list[Any] = [([], (0, 0), x[:n], n, (0, 0), 0, b) for x, b in zip(ids, blocks)]
    else:  # (keys, (ids_at, stamp), token_ids, n, (rows_at, stamp), rows_len, block_ids)
        todo = [([], (0, 0), x, n, (0, 0), 0, b) for x, b in zip(ids, blocks)]
    why = sink._copy_requests_rows(cache, todo, _Landed(reqs), 0)
    dt = time.perf_counter() - t
    assert all(w is not None and "is not in this sink's" in w for w in why), why[:1]
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loads", default="32x2048,8x2048,4x16000,32x16000")
    ap.add_argument("--steps", type=int, default=41)
    ap.add_argument("--json")
    ap.add_argument("--allow-debug-build", action="store_true")
    a = ap.parse_args()
    require_release("bench_copy_gil.py", a.allow_debug_build)
    sink = ca.ArenaSink(arena_bytes=1 << 20, wait_s=2, aux_layer_ids=[1, 2, 3])
    sink._start(None)
    out = []
    try:
        try:  # which requests this build takes
            step(sink, 1, 16, sliced=False)
            sliced = False
        except (TypeError, ValueError):  # tuples of 6
            sliced = True
        for spec in a.loads.split(","):
            reqs, n = (int(x) for x in spec.split("x"))
            got = sorted(step(sink, reqs, n, sliced) for _ in range(a.steps))
            row = {
                "build": BUILD,
                "ids": "sliced, all read first" if sliced else "read in place, in holds",
                "requests": reqs,
                "tokens": n,
                "gil_ms_per_step_median": round(got[len(got) // 2] * 1e3, 3),
                "gil_ms_per_step_p90": round(got[len(got) * 9 // 10] * 1e3, 3),
                "ns_per_id": round(got[len(got) // 2] / (reqs * n) * 1e9, 2),
            }
            print(json.dumps(row), flush=True)
            out.append(row)
    finally:
        sink.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
