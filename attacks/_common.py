"""What every attack shares: a live producer (an ArenaSink with a real control port), samples
to aim at, and the checks that it survived: its counters, a legitimate free still applied, its
memory."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import capture_arena as ca


def spec(sample_id: str, L: int = 8) -> dict[str, Any]:
    return {
        "store_id": "victim",
        "sample_id": sample_id,
        "gen": 1,
        "features": {"aux": "hidden_state", "last_hidden": "target"},
        "passthrough": [{"name": "input_ids", "data": list(range(L)), "shape": [1, L], "dtype": "int64"}],
    }


def publish(sink: ca.ArenaSink, sample_id: str, L: int = 8) -> dict[str, Any]:
    aux = np.ones((L, 12), dtype=ml_dtypes.bfloat16)
    last = np.ones((L, 4), dtype=ml_dtypes.bfloat16)
    return sink.put_sample(spec(sample_id, L), aux=aux, last_hidden=last)


def address(result: dict[str, Any]) -> tuple[str, int]:
    host, port = result["arena"]["control"].rsplit(":", 1)
    return host, int(port)


def wait_stats(sink: ca.ArenaSink, pred: Callable[[dict[str, int]], bool], timeout: float = 20.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        s = sink.stats()
        if pred(s):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; stats {s}")
        time.sleep(0.01)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def legit_free_still_works(sink: ca.ArenaSink, result: dict[str, Any]) -> None:
    """The sample survived (a trainer reads it) and a trainer's release is applied."""
    store = ca.ArenaFeatureStore()
    got = store.get(result)
    assert got["input_ids"].tolist() == [list(range(result["features"]["input_ids"]["shape"][1]))]
    before = sink.stats()["freed_objects"]
    store.release(result)
    wait_stats(sink, lambda s: s["freed_objects"] >= before + len(result["features"]))


def connect(result: dict[str, Any]) -> socket.socket:
    return socket.create_connection(address(result), timeout=5)


@pytest.fixture
def sink() -> Iterator[ca.ArenaSink]:
    s = ca.ArenaSink(arena_bytes="16MiB", wait_s=2.0)
    yield s
    s.close()
