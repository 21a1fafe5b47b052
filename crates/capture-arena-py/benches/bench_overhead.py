"""Python overhead on top of the Rust path, measured side by side in one run.

A batch of 16 samples x 4 tensors of 1 MiB (aux and last_hidden bf16 arrays, input_ids and
loss_mask int64 arrays) published with ``ArenaSink.put_samples`` (submit -> results), against the
same batch through the Rust API (``_bench_rust_put``: build the samples, submit, wait). Blocks of
each alternate so a slow moment of a shared machine hits both. Target: Python <= 1.2 x Rust.

Run:  .venv/bin/python crates/capture-arena-py/benches/bench_overhead.py [--rounds 5] [--reps 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import ml_dtypes
import numpy as np

import capture_arena as ca
from capture_arena._capture_arena import _bench_rust_put

MIB = 1 << 20
N_SAMPLES, N_TENSORS = 16, 4
ARENA = 256 * MIB


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    samples = batch()
    py_times: list[float] = []
    rust_times: list[float] = []
    with ca.ArenaSink(arena_bytes=ARENA) as sink:
        sink.put_samples(samples)  # warm: the arena exists, keys are resident (replace from now on)
        _bench_rust_put(N_SAMPLES, N_TENSORS, MIB, 1, ARENA)
        for _ in range(args.rounds):
            for _ in range(args.reps):
                t0 = time.perf_counter()
                results = sink.put_samples(samples)
                py_times.append(time.perf_counter() - t0)
                assert all("error" not in r for r in results)
            rust_times += _bench_rust_put(N_SAMPLES, N_TENSORS, MIB, args.reps, ARENA)
    py, rust = statistics.median(py_times), statistics.median(rust_times)
    gib = N_SAMPLES * N_TENSORS * MIB / (1 << 30)
    doc = {
        "batch": f"{N_SAMPLES} samples x {N_TENSORS} tensors x 1 MiB",
        "python_ms": py * 1e3,
        "rust_ms": rust * 1e3,
        "python_gbps": gib * (1 << 30) / py / 1e9,
        "rust_gbps": gib * (1 << 30) / rust / 1e9,
        "ratio_python_to_rust": py / rust,
        "samples_each": len(py_times),
    }
    print(f"{doc['batch']}: Python put_samples {doc['python_ms']:.2f} ms, Rust API {doc['rust_ms']:.2f} ms, "
          f"ratio {doc['ratio_python_to_rust']:.3f} (medians of {len(py_times)} each; target <= 1.2)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
