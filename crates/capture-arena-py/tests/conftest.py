"""Shared fixtures: sinks with small arenas, closed after each test."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import capture_arena as ca


@pytest.fixture
def make_sink() -> Iterator[Callable[..., ca.ArenaSink]]:
    made: list[ca.ArenaSink] = []

    def make(**kw: Any) -> ca.ArenaSink:
        kw.setdefault("arena_bytes", "16MiB")
        kw.setdefault("wait_s", 5.0)
        s = ca.ArenaSink(**kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def spec(sample_id: str, L: int = 8, *, aux: bool = True, last: bool = True, replace: bool = False) -> dict[str, Any]:
    """A contract spec: aux -> hidden_state, last_hidden -> target, input_ids and loss_mask."""
    features = {}
    if aux:
        features["aux"] = "hidden_state"
    if last:
        features["last_hidden"] = "target"
    return {
        "store_id": "st",
        "sample_id": sample_id,
        "gen": 1,
        "replace": replace,
        "features": features,
        "passthrough": [
            {"name": "input_ids", "data": list(range(L)), "shape": [1, L], "dtype": "int64"},
            {"name": "loss_mask", "data": [1] * L, "shape": [1, L], "dtype": "int64"},
        ],
    }


def hidden(L: int, W: int, seed: int = 0) -> np.ndarray:
    """A bf16 [L, W] tensor with distinct values."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((L, W), dtype=np.float32).astype(ml_dtypes.bfloat16)


def wait_stats(sink: ca.ArenaSink, pred: Callable[[dict[str, int]], bool], timeout: float = 10.0) -> dict[str, int]:
    """Polls the sink's counters until `pred` holds."""
    deadline = time.monotonic() + timeout
    while True:
        s = sink.stats()
        if pred(s) or time.monotonic() > deadline:
            return s
        time.sleep(0.005)
