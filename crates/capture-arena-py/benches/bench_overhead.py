"""Python overhead on top of the Rust path, measured side by side in one run.

A batch of 16 samples x 4 tensors of 1 MiB (aux and last_hidden bf16 arrays, input_ids and
loss_mask int64 arrays) published from Python with ``ArenaSink.put_samples`` and with
``ArenaSink.submit_samples(...).result()`` (submit -> results), against the same batch through
the Rust API into the same arena (``_bench_rust_put``: build the samples, submit, wait). Blocks
of each alternate so a slow moment of a shared machine hits all three. Target: Python <= 1.2 x
Rust.

Then the cost of passthrough data given as Python lists (as SGLang's capture hook gives
``input_ids`` and ``loss_mask``) rather than arrays: a sample with two int64 lists of L elements,
published alternately with list and with numpy-array data; (list time - array time) / (2 L) is the
per-element cost of converting a list, with the GIL held (a list can only be read with it).

Run:  .venv/bin/python crates/capture-arena-py/benches/bench_overhead.py [--rounds 10] [--reps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

# numpy's BLAS threads are not used here; keep them from spinning on the two cores we measure.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import ml_dtypes
import numpy as np

import capture_arena as ca
from capture_arena._capture_arena import _bench_rust_put

MIB = 1 << 20
N_SAMPLES, N_TENSORS = 16, 4
ARENA = 256 * MIB  # holds the Python batch and the Rust batch (other keys) at once


def batch() -> list[tuple[dict, np.ndarray, np.ndarray]]:
    out = []
    for i in range(N_SAMPLES):
        n = MIB // 8
        spec = {
            "store_id": "bench", "sample_id": f"s{i}", "gen": 1, "replace": True,
            "features": {"aux": "t0", "last_hidden": "t1"},
            "passthrough": [
                {"name": "t2", "data": np.full((1, n), i, dtype=np.int64), "shape": [1, n], "dtype": "int64"},
                {"name": "t3", "data": np.ones((1, n), dtype=np.int64), "shape": [1, n], "dtype": "int64"},
            ],
        }
        aux = np.full((512, 1024), i, dtype=ml_dtypes.bfloat16)
        last = np.full((512, 1024), -i, dtype=ml_dtypes.bfloat16)
        out.append((spec, aux, last))
    return out


LIST_L = 1 << 18


def list_cost(sink: ca.ArenaSink, rounds: int) -> float:
    """Nanoseconds per element that list data costs beyond array data (medians, alternating)."""
    ids = list(range(LIST_L))
    mask = [1] * LIST_L

    def spec(lists: bool) -> dict:
        def data(v: list[int]) -> object:
            return v if lists else np.asarray(v, dtype=np.int64).reshape(1, -1)

        return {
            "store_id": "bench", "sample_id": "lists", "gen": 1, "replace": True, "features": {},
            "passthrough": [
                {"name": "input_ids", "data": data(ids), "shape": [1, LIST_L], "dtype": "int64"},
                {"name": "loss_mask", "data": data(mask), "shape": [1, LIST_L], "dtype": "int64"},
            ],
        }

    with_lists, with_arrays = spec(True), spec(False)
    t_list: list[float] = []
    t_array: list[float] = []
    for _ in range(max(rounds, 5) * 2):
        for s, out in ((with_lists, t_list), (with_arrays, t_array)):
            t0 = time.perf_counter()
            sink.put_sample(s)
            out.append(time.perf_counter() - t0)
    extra = statistics.median(t_list) - statistics.median(t_array)
    return extra / (2 * LIST_L) * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    samples = batch()
    put_times: list[float] = []
    submit_times: list[float] = []
    rust_times: list[float] = []
    with ca.ArenaSink(arena_bytes=ARENA) as sink:
        sink.put_samples(samples)  # warm: the arena exists, keys are resident (replace from now on)
        _bench_rust_put(sink, N_SAMPLES, N_TENSORS, MIB, 1)
        for _ in range(args.rounds):
            for _ in range(args.reps):
                t0 = time.perf_counter()
                results = sink.put_samples(samples)
                put_times.append(time.perf_counter() - t0)
                assert all("error" not in r for r in results)
            for _ in range(args.reps):
                t0 = time.perf_counter()
                results = sink.submit_samples(samples).result()
                submit_times.append(time.perf_counter() - t0)
                assert all("error" not in r for r in results)
            rust_times += _bench_rust_put(sink, N_SAMPLES, N_TENSORS, MIB, args.reps)
        per_element_ns = list_cost(sink, args.rounds)
    put, submit, rust = (statistics.median(t) for t in (put_times, submit_times, rust_times))
    nbytes = N_SAMPLES * N_TENSORS * MIB
    doc = {
        "batch": f"{N_SAMPLES} samples x {N_TENSORS} tensors x 1 MiB",
        "put_samples_ms": put * 1e3,
        "submit_samples_ms": submit * 1e3,
        "rust_ms": rust * 1e3,
        "rust_gbps": nbytes / rust / 1e9,
        "ratio_put_to_rust": put / rust,
        "ratio_submit_to_rust": submit / rust,
        "samples_each": len(put_times),
        "passthrough_list_ns_per_element": per_element_ns,
    }
    print(
        f"{doc['batch']}: put_samples {put * 1e3:.2f} ms, submit_samples+result {submit * 1e3:.2f} ms, "
        f"Rust API {rust * 1e3:.2f} ms; ratios {put / rust:.3f} and {submit / rust:.3f} "
        f"(medians of {len(put_times)} each; target <= 1.2)"
    )
    print(f"passthrough lists: {per_element_ns:.1f} ns per element beyond array data (L = {LIST_L})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
