"""What the synchronous patches' calls cost SGLang's scheduler thread (issue #28), side by side with
``torch.clone()`` of the same tensors in one run.

The sample: one EAGLE3-8B request of 4096 tokens as the kimi-k3 / online-live patches hand it over
(per-request bf16 CPU tensors ``[4096, 3*4096]`` and ``[4096, 4096]``, 128 MiB; passthrough
``input_ids`` and ``loss_mask`` as lists).

1. ``put_sample`` steady state (the arena exists; each round's sample is freed before the next),
   on the caller's thread, against cloning the two tensors (a copy of the same bytes in the same
   process: what publishing into host memory cannot beat).
2. ``put_sample_live`` steady state (it only queues; the worker publishes and posts the record to
   an intake, here one on loopback that sheds every record, so the sink frees it at once), against
   the same clone.
3. The first ``put_sample`` under SGLang with a synchronous patch: the sink made by
   ``maybe_init_sink``, whose arena (4 GiB) is created in the background as the server starts,
   then ``put_sample`` at once (it waits at most ``SGLANG_SPEC_CAPTURE_SYNC_WAIT_S``, 1 s, for the
   arena); against creating the same arena on the calling thread (what the first capture paid
   before).

Wall time and the calling thread's CPU time (``time.thread_time``) are both reported.

Run:  .venv/bin/python crates/capture-arena-py/benches/bench_put_sample.py [--rounds 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ["SGLANG_SPEC_CAPTURE_PLACEMENT"] = "arena"
os.environ.setdefault("SGLANG_SPEC_CAPTURE_ARENA_BYTES", "4GiB")
os.environ["SGLANG_SPEC_CAPTURE_ARENA_EAGER"] = "1"  # as under a synchronous patch

import torch

import capture_arena as ca
from capture_arena import sglang

H, K, L = 4096, 3, 4096
GIB = 1 << 30


def sample(i: int) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    torch.manual_seed(i)
    aux = torch.empty(L, K * H, dtype=torch.bfloat16).normal_()
    last = torch.empty(L, H, dtype=torch.bfloat16).normal_()
    spec = {
        "store_id": "bench", "sample_id": f"s{i}", "gen": 1, "replace": True,
        "features": {"aux": "hidden_state", "last_hidden": "target"},
        "passthrough": [
            {"name": "input_ids", "data": list(range(L)), "shape": [1, L], "dtype": "int64"},
            {"name": "loss_mask", "data": [1] * L, "shape": [1, L], "dtype": "int64"},
        ],
    }  # fmt: skip
    return spec, aux, last


class ShedIntake:
    """A live intake on loopback that sheds every record (429), after serving the config."""

    def __init__(self) -> None:
        self.records = 0
        intake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send(200, {"store_id": "live", "gen": 1, "features": {"aux": "hidden_state", "last_hidden": "target"},
                                 "passthrough": [{"name": "input_ids", "source": "tokens"}, {"name": "loss_mask", "source": "ones"}],
                                 "max_num_tokens": L})  # fmt: skip

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                intake.records += 1
                self._send(429, {"status": "shed", "detail": "bench"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


class Scheduler:  # what maybe_init_sink reads of its caller: attention-TP rank 0
    ps = SimpleNamespace(attn_tp_rank=0, gpu_id=0)

    def __init__(self, intake_url: str | None = None) -> None:
        args = SimpleNamespace(enable_spec_capture=True, spec_capture_aux_layer_ids=[2, 18, 33], spec_capture_intake_url=intake_url)
        self.sink = sglang.maybe_init_sink(args)


def wait_until(pred: Any, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark condition not reached")
        time.sleep(0.001)


def clone_s(aux: torch.Tensor, last: torch.Tensor) -> float:
    t0 = time.perf_counter()
    copies = (aux.clone(), last.clone())
    t1 = time.perf_counter()
    del copies
    return t1 - t0


def steady(rounds: int) -> dict[str, object]:
    intake = ShedIntake()
    sink = Scheduler(intake.url).sink
    assert sink is not None
    wait_until(lambda: sink.started and sink._live.config is not None)
    store = ca.ArenaFeatureStore()
    put, put_cpu, live, live_cpu, clone = [], [], [], [], []
    for r in range(rounds + 1):
        spec, aux, last = sample(r)
        c = clone_s(aux, last)
        c0, t0 = time.thread_time(), time.perf_counter()
        row = sink.put_sample(spec, aux=aux, last_hidden=last)
        t1, c1 = time.perf_counter(), time.thread_time()
        assert "error" not in row, row
        store.release(row)
        store.flush(30)
        live_spec = sglang.maybe_live_spec(f"rid-{r}")
        assert live_spec is not None
        tokens = list(range(L))
        before = sink.stats()["live_dropped_shed"]
        c2, t2 = time.thread_time(), time.perf_counter()
        sink.put_sample_live(live_spec, aux=aux, last_hidden=last, tokens=tokens)
        t3, c3 = time.perf_counter(), time.thread_time()
        wait_until(lambda: sink.stats()["live_dropped_shed"] == before + 1)  # posted, shed, freed
        if r:  # the first round warms the arena's pages
            clone.append(c)
            put.append(t1 - t0)
            put_cpu.append(c1 - c0)
            live.append(t3 - t2)
            live_cpu.append(c3 - c2)
    sglang.reset_sink()
    med = statistics.median
    return {
        "sample_bytes": L * K * H * 2 + L * H * 2,
        "clone_ms_median": med(clone) * 1e3,
        "put_sample_ms_median": med(put) * 1e3,
        "put_sample_cpu_ms_median": med(put_cpu) * 1e3,
        "put_sample_over_clone_median": med(p / c for p, c in zip(put, clone)),
        "put_sample_live_ms_median": med(live) * 1e3,
        "put_sample_live_cpu_ms_median": med(live_cpu) * 1e3,
        "put_sample_live_over_clone_median": med(x / c for x, c in zip(live, clone)),
        "live_records_posted": intake.records,
    }


def first(rounds: int) -> dict[str, object]:
    first_s, first_cpu, outcomes, create_s = [], [], [], []
    for r in range(rounds):
        time.sleep(1.0)  # the previous arena's pages go back to the kernel first
        spec, aux, last = sample(100 + r)
        sink = Scheduler().sink  # its arena: created in the background, now
        assert sink is not None
        c0, t0 = time.thread_time(), time.perf_counter()
        row = sink.put_sample(spec, aux=aux, last_hidden=last)
        t1, c1 = time.perf_counter(), time.thread_time()
        outcomes.append("published" if "error" not in row else "error row")
        first_s.append(t1 - t0)
        first_cpu.append(c1 - c0)
        sglang.reset_sink()
        time.sleep(1.0)
        other = ca.ArenaSink(arena_bytes=4 * GIB, eager=False)
        t0 = time.perf_counter()
        other._start()
        create_s.append(time.perf_counter() - t0)
        other.close()
    med = statistics.median
    return {
        "first_put_sample_ms_median": med(first_s) * 1e3,
        "first_put_sample_ms_max": max(first_s) * 1e3,
        "first_put_sample_cpu_ms_median": med(first_cpu) * 1e3,
        "first_put_sample_outcomes": outcomes,
        "create_4GiB_on_caller_ms_median": med(create_s) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {"steady_128MiB": steady(args.rounds), "first_capture_4GiB": first(min(args.rounds, 3))}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
