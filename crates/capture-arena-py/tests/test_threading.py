"""The GIL is released while the sink waits (and copies): other Python threads keep running."""

from __future__ import annotations

import threading
import time

import capture_arena as ca
from conftest import hidden, spec


def test_the_gil_is_released_while_a_batch_waits_for_frees(make_sink):
    sink = make_sink(arena_bytes="1MiB", wait_s=20.0)
    first = sink.put_sample(spec("a", 16), aux=hidden(16, 24576), last_hidden=hidden(16, 4))
    took: list[float] = []

    def put() -> None:
        t0 = time.monotonic()
        r = sink.put_sample(spec("b", 16), aux=hidden(16, 24576), last_hidden=hidden(16, 4))
        took.append(time.monotonic() - t0)
        assert "error" not in r

    t = threading.Thread(target=put)
    t.start()
    # This thread needs the GIL to count: it only progresses if put() released it.
    count, end = 0, time.monotonic() + 0.3
    while time.monotonic() < end:
        count += 1
    assert count > 10_000, count
    assert t.is_alive(), "still waiting for a free"
    ca.ArenaFeatureStore().release(first)
    t.join(timeout=20)
    assert took and took[0] >= 0.3


def test_many_python_threads_submit_concurrently(make_sink):
    sink = make_sink(arena_bytes="32MiB")
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for i in range(10):
                r = sink.put_sample(spec(f"w{k}-{i}"), aux=hidden(8, 12, k), last_hidden=hidden(8, 4, i))
                assert "error" not in r
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sink.stats()["published_samples"] == 80
