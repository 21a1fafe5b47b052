"""What capture costs SGLang's scheduler thread, measured side by side in one run (issue #19).

1. ``submit_samples`` of one scheduler batch: 16 EAGLE3-8B samples of 4096 tokens, as the patched
   scheduler hands them over (per-request views of batch-level bf16 CPU tensors
   ``[total_tokens, 3*4096]`` and ``[total_tokens, 4096]``, passthrough ``input_ids`` and
   ``loss_mask`` as Python lists), against ``torch.clone()`` of the same 32 tensors. Only the
   call's time counts (the copies happen on the writer thread); each round the batch is then
   waited for and freed. Target: submit <= 1 % of clone.
2. The first capture with a 4 GiB arena: the first ``submit_samples`` call on a fresh sink (the
   arena is created on the starter thread), against creating the same arena on the calling
   thread (``_start``, what the first capture did before). Target: <= 5 ms.

Both are reported as wall time and as the calling thread's CPU time (``time.thread_time``): on a
2-core machine the starter thread's pre-faulting (and the kernel freeing the previous round's
arena) can take both cores, so the caller's wall time includes waiting to be scheduled, which a
scheduler process on a GPU host (dozens of cores) does not see.

Run:  .venv/bin/python crates/capture-arena-py/benches/bench_scheduler.py [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ["SGLANG_SPEC_CAPTURE_PLACEMENT"] = "arena"

import torch

import capture_arena as ca

H, K, L, N = 4096, 3, 4096, 16
GIB = 1 << 30


def scheduler_batch(seed: int) -> tuple[list[tuple[dict, torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """One scheduler batch as the patch builds it: views of two batch-level tensors."""
    torch.manual_seed(seed)
    aux = torch.empty(N * L, K * H, dtype=torch.bfloat16).normal_()
    last = torch.empty(N * L, H, dtype=torch.bfloat16).normal_()
    samples, views = [], []
    for i in range(N):
        a, b = aux[i * L : (i + 1) * L], last[i * L : (i + 1) * L]
        spec = {
            "store_id": "bench", "sample_id": f"s{i}", "gen": 1, "replace": True,
            "features": {"aux": "hidden_state", "last_hidden": "target"},
            "passthrough": [
                {"name": "input_ids", "data": list(range(L)), "shape": [1, L], "dtype": "int64"},
                {"name": "loss_mask", "data": [1] * L, "shape": [1, L], "dtype": "int64"},
            ],
        }
        samples.append((spec, a, b))
        views += [a, b]
    return samples, views


def submit_vs_clone(rounds: int) -> dict[str, object]:
    sink = ca.ArenaSink(arena_bytes=4 * GIB, wait_s=30.0, eager=True)
    store = ca.ArenaFeatureStore()
    samples, views = scheduler_batch(0)
    submit_s, submit_cpu, clone_s = [], [], []
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        copies = [v.clone() for v in views]
        t1 = time.perf_counter()
        del copies
        c2, t2 = time.thread_time(), time.perf_counter()
        fut = sink.submit_samples(samples)
        t3, c3 = time.perf_counter(), time.thread_time()
        rows = fut.result()
        assert all("error" not in x for x in rows), rows[0]
        for x in rows:
            store.release(x)
        store.flush()
        if r:  # the first round warms the arena's pages and the allocator
            clone_s.append(t1 - t0)
            submit_s.append(t3 - t2)
            submit_cpu.append(c3 - c2)
    sink.close()
    ratio = [s / c for s, c in zip(submit_s, clone_s)]
    return {
        "batch_bytes": sum(v.numel() * v.element_size() for v in views),
        "submit_ms_median": statistics.median(submit_s) * 1e3,
        "submit_cpu_ms_median": statistics.median(submit_cpu) * 1e3,
        "clone_ms_median": statistics.median(clone_s) * 1e3,
        "submit_over_clone_median": statistics.median(ratio),
        "submit_over_clone_max": max(ratio),
    }


def first_capture(rounds: int) -> dict[str, object]:
    samples, _ = scheduler_batch(1)
    small = [(dict(samples[0][0], sample_id="first"), samples[0][1][:64], samples[0][2][:64])]
    for s in small:
        s[0]["passthrough"] = [{"name": "input_ids", "data": list(range(64)), "shape": [1, 64], "dtype": "int64"}]
    first_s, first_cpu, create_s = [], [], []
    for _ in range(rounds):
        # Closing a 4 GiB arena leaves the kernel freeing its pages for a moment: let it settle,
        # as a server's first capture does not follow one.
        time.sleep(1.0)
        sink = ca.ArenaSink(arena_bytes=4 * GIB)
        c0, t0 = time.thread_time(), time.perf_counter()
        fut = sink.submit_samples(small)
        t1, c1 = time.perf_counter(), time.thread_time()
        assert "error" not in fut.result()[0]
        sink.close()
        first_s.append(t1 - t0)
        first_cpu.append(c1 - c0)
        sink = ca.ArenaSink(arena_bytes=4 * GIB)
        t0 = time.perf_counter()
        sink._start()
        t1 = time.perf_counter()
        sink.close()
        create_s.append(t1 - t0)
    return {
        "first_submit_ms_median": statistics.median(first_s) * 1e3,
        "first_submit_ms_max": max(first_s) * 1e3,
        "first_submit_cpu_ms_median": statistics.median(first_cpu) * 1e3,
        "first_submit_cpu_ms_max": max(first_cpu) * 1e3,
        "create_on_caller_ms_median": statistics.median(create_s) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {"submit_vs_clone": submit_vs_clone(args.rounds), "first_capture_4GiB": first_capture(args.rounds)}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
