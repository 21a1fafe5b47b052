"""capture_arena.metrics as SGLang serves it.

With ``--enable-metrics``, SGLang sets ``PROMETHEUS_MULTIPROC_DIR`` before it starts its scheduler
processes with multiprocessing's 'spawn'. Its HTTP process then serves ``/metrics`` from a fresh
registry that holds only a multiprocess collector::

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    Mount("/metrics", make_asgi_app(registry=registry))

This is ``add_prometheus_middleware`` in ``sglang/srt/utils/common.py`` of SGLang 0.5.18 and
0.5.20. :func:`scrape_like_sglang` rebuilds that registry and renders it with
``generate_latest``, which is what ``make_asgi_app`` serves. The capturing side runs in a
'spawn' child, as a scheduler does. SGLang itself is not needed.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import struct
import time
from typing import Any

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

import capture_arena as ca  # noqa: E402
from capture_arena import metrics  # noqa: E402
from conftest import hidden, spec  # noqa: E402

INTERVAL_S = 0.2
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape_like_sglang() -> Samples:
    """``/metrics`` exactly as SGLang builds it (see the module docs), parsed."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    for tries in range(5):
        try:
            text = generate_latest(registry).decode()
            break
        except struct.error:
            # prometheus_client's own race (mmap_dict.py): a process creating its .db file
            # leaves it empty until it sizes it, and a scrape in between fails to unpack its
            # header. SGLang's /metrics answers that scrape with an error; its next one reads.
            if tries == 4:
                raise
            time.sleep(0.01)
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def store_bytes(samples: Samples, store_id: str) -> float | None:
    return samples.get(("capture_arena_store_resident_bytes", (("store_id", store_id),)))


def poll(pred: Any, timeout: float = 10.0) -> Samples:
    """Scrapes until ``pred(samples)`` holds; returns the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        got = scrape_like_sglang()
        if pred(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


@pytest.fixture
def multiproc_env(tmp_path, monkeypatch):
    """What ``--enable-metrics`` gives the scheduler processes (spawned children inherit it)."""
    d = tmp_path / "prometheus"
    d.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(d))
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_PLACEMENT", "arena")
    monkeypatch.setenv(metrics.INTERVAL_ENV, str(INTERVAL_S))
    return d


# ---- spawned children ("schedulers") ------------------------------------------------------------


def _scheduler(out: Any, release: Any, done: Any) -> None:
    sink = ca.ArenaSink(arena_bytes="16MiB", control_port=0, wait_s=5.0)
    handle = metrics.register(sink)
    results = [sink.put_sample(spec(f"s{i}"), aux=hidden(8, 12), last_hidden=hidden(8, 4)) for i in range(3)]
    time.sleep(3 * INTERVAL_S)
    out.put(("published", type(handle).__name__, len(results)))
    release.wait(30)
    store = ca.ArenaFeatureStore()
    for r in results:
        store.release(r)
    out.put(("released",))
    done.wait(30)
    metrics.unregister(handle)
    sink.close()
    out.put(("closed",))


def _idle_rank(out: Any, done: Any) -> None:
    """A tensor-parallel rank that never captures: its sink is registered but never starts."""
    sink = ca.ArenaSink(arena_bytes="16MiB", control_port=0)
    handle = metrics.register(sink)
    out.put(("registered", handle.active))
    done.wait(30)
    metrics.unregister(handle)
    sink.close()


class FakeSink:
    """A sink with many stores (more than the label bound)."""

    def stats(self) -> dict[str, int]:
        return {"published_samples": 7, "resident_bytes": 300}

    def store_usage(self) -> list[dict[str, Any]]:
        return [{"store_id": f"big-{i}", "objects": 1, "bytes": 1, "oldest_age_s": float(i)} for i in range(300)]


def _wait(pred: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _lifecycle(out: Any) -> None:
    got: dict[str, Any] = {}
    sink = ca.ArenaSink(arena_bytes="16MiB", control_port=0)
    h1 = metrics.register(sink)
    got["twice_same"] = metrics.register(sink) is h1
    got["kind"] = type(h1).__name__
    metrics.unregister(h1)
    metrics.unregister(h1)
    metrics.unregister(None)
    got["stopped_on_unregister"] = not h1.thread.is_alive() and not h1.active

    h2 = metrics.register(sink)
    got["new_after_unregister"] = h2 is not h1 and h2 is not None and h2.active
    # A forked child, while h2's thread is running: it forgets h2 and registers a new sink.
    time.sleep(INTERVAL_S)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ok = not h2.active
            child_sink = ca.ArenaSink(arena_bytes="16MiB", control_port=0)
            child_sink.put_sample(spec("child"), aux=hidden(8, 12), last_hidden=hidden(8, 4))  # started: it has levels
            h = metrics.register(child_sink)
            ok = ok and h is not None and h is not h2 and h.thread.is_alive()
            # The child's values go to its own file (prometheus_client's files are per pid).
            mine = os.path.join(os.environ["PROMETHEUS_MULTIPROC_DIR"], f"gauge_mostrecent_{os.getpid()}.db")
            ok = ok and _wait(lambda: os.path.exists(mine), 10 * INTERVAL_S)
            metrics.unregister(h2)
            metrics.unregister(h)
            child_sink.close()
            code = 0 if ok else 2
        finally:
            os._exit(code)
    got["fork_child_exit"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    got["parent_still_active"] = h2.active and h2.thread.is_alive()

    # A closed sink stops the thread.
    sink.close()
    got["stopped_on_close"] = _wait(lambda: not h2.thread.is_alive(), 10 * INTERVAL_S)

    # A sink that is garbage-collected stops the thread (the thread holds only a weak reference).
    other = ca.ArenaSink(arena_bytes="16MiB", control_port=0)
    h3 = metrics.register(other)
    del other
    gc.collect()
    got["stopped_on_gc"] = _wait(lambda: not h3.thread.is_alive(), 10 * INTERVAL_S)

    # More stores than the label bound: the rest are summed into "_other".
    fake = FakeSink()
    h4 = metrics.register(fake)
    out.put(got)
    out.get(timeout=30)  # the parent has scraped
    metrics.unregister(h4)


def _spawn(target: Any, *args: Any) -> Any:
    p = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    p.start()
    return p


# ---- tests --------------------------------------------------------------------------------------


def test_a_spawned_scheduler_shows_its_sink_on_sglangs_metrics(multiproc_env):
    ctx = mp.get_context("spawn")
    out, release, done = ctx.Queue(), ctx.Event(), ctx.Event()
    p = _spawn(_scheduler, out, release, done)
    try:
        assert out.get(timeout=30) == ("published", "MultiprocessExporter", 3)
        # The exporter thread writes each interval: scraped until its values are there.
        got = poll(lambda s: s.get(("capture_arena_store_resident_objects", (("store_id", "st"),))) == 12)
        assert got[("capture_arena_published_samples_total", ())] == 3
        assert got[("capture_arena_resident_objects", ())] == 12
        assert got[("capture_arena_capacity", ())] == 16 << 20
        assert (store_bytes(got, "st") or 0) > 0
        assert got[("capture_arena_store_resident_objects", (("store_id", "st"),))] == 12

        release.set()
        assert out.get(timeout=30) == ("released",)
        got = poll(lambda s: store_bytes(s, "st") == 0 and s.get(("capture_arena_freed_objects_total", ())) == 12)
        assert store_bytes(got, "st") == 0, got
        assert got[("capture_arena_freed_objects_total", ())] == 12
        # Refreshes add only what changed: the total is still the sink's.
        assert got[("capture_arena_published_samples_total", ())] == 3
        assert got[("capture_arena_resident_objects", ())] == 0

        done.set()
        assert out.get(timeout=30) == ("closed",)
        p.join(30)
        assert p.exitcode == 0
        got = scrape_like_sglang()
        assert got[("capture_arena_published_samples_total", ())] == 3  # counters stay
        assert got[("capture_arena_capacity", ())] == 0  # a closed sink's levels drop to 0
    finally:
        if p.is_alive():
            p.kill()


def test_a_rank_that_never_captures_leaves_the_capturing_ranks_levels_alone(multiproc_env):
    # Under tensor parallelism every rank registers; the ones that never capture have a sink
    # that never starts. Before: they wrote their zeros as the most recent levels every
    # interval, and most scrapes showed capacity 0.
    ctx = mp.get_context("spawn")
    out, release, done, idle_out, idle_done = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Event()
    p = _spawn(_scheduler, out, release, done)
    q = None
    try:
        assert out.get(timeout=30)[0] == "published"
        q = _spawn(_idle_rank, idle_out, idle_done)
        assert idle_out.get(timeout=30) == ("registered", True)
        seen = []
        deadline = time.monotonic() + 8 * INTERVAL_S  # both write several times meanwhile
        while time.monotonic() < deadline:
            seen.append(scrape_like_sglang().get(("capture_arena_capacity", ())))
            time.sleep(INTERVAL_S / 4)
        assert set(seen) == {16 << 20}, seen
    finally:
        release.set()
        done.set()
        idle_done.set()
        for proc in (p, q):
            if proc is not None:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()


def test_register_unregister_lifecycle_and_the_store_label_bound(multiproc_env):
    out = mp.get_context("spawn").Queue()
    p = _spawn(_lifecycle, out)
    try:
        got = out.get(timeout=30)
        assert got == {
            "twice_same": True,
            "kind": "MultiprocessExporter",
            "stopped_on_unregister": True,
            "new_after_unregister": True,
            "fork_child_exit": 0,
            "parent_still_active": True,
            "stopped_on_close": True,
            "stopped_on_gc": True,
        }
        # The fake sink's exporter writes within an interval: scraped until its values are there.
        samples = poll(lambda s: store_bytes(s, "_other") is not None)
        labels = {dict(k[1])["store_id"] for k in samples if k[0] == "capture_arena_store_resident_bytes"}
        big = {x for x in labels if x.startswith("big-")}
        assert len(big) == metrics.MAX_STORE_LABELS and "_other" in labels
        assert store_bytes(samples, "_other") == 300 - metrics.MAX_STORE_LABELS
        assert samples[("capture_arena_store_oldest_age_seconds", (("store_id", "_other"),))] == 299
        out.put("scraped")
        p.join(30)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()


def _registry_text() -> str:
    return prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()


def test_without_the_multiprocess_dir_the_collector_goes_to_the_registry(make_sink, monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert "capture_arena_" not in _registry_text()
    sink = make_sink()
    sink.put_sample(spec("a"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    h = metrics.register(sink)
    assert isinstance(h, metrics.ArenaCollector)
    assert metrics.register(sink) is h  # once per sink, no Duplicated timeseries
    text = _registry_text()
    assert "capture_arena_published_samples_total 1.0" in text
    assert 'capture_arena_store_resident_objects{store_id="st"} 4.0' in text
    metrics.unregister(h)
    metrics.unregister(h)
    assert "capture_arena_" not in _registry_text()


def test_the_collector_names_the_largest_stores_and_a_closed_sink_fails_no_scrape(make_sink, monkeypatch):
    # Store ids come from clients: 40 of them made 40 series per metric, each scrape; and once
    # the sink closed, its collector raised WriterStoppedError, failing the whole scrape of the
    # registry it is in (SGLang's /metrics).
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    sink = make_sink()
    rows = sink.put_samples([({**spec(f"s{i}"), "store_id": f"store{i:02d}"}, hidden(8, 12), hidden(8, 4)) for i in range(40)])
    assert all("error" not in r for r in rows), rows
    h = metrics.register(sink)
    try:
        text = _registry_text()
        named = {line.split('"')[1] for line in text.splitlines() if line.startswith("capture_arena_store_resident_objects{")}
        assert len(named) == metrics.MAX_STORE_SERIES + 1 and "_other" in named, named
        assert 'capture_arena_store_resident_objects{store_id="_other"} 32.0' in text, text  # 8 stores x 4 objects
        sink.close()
        assert "capture_arena_" not in _registry_text()  # and no exception
    finally:
        metrics.unregister(h)


def test_a_forked_child_registers_its_own_sink(make_sink, monkeypatch):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    sink = make_sink()
    sink.put_sample(spec("p"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    h = metrics.register(sink)
    assert h is not None
    try:
        pid = os.fork()
        if pid == 0:  # child: the parent's collector is gone from REGISTRY here
            code = 1
            try:
                ok = not h.active and "capture_arena_" not in _registry_text()
                child_sink = ca.ArenaSink(arena_bytes="16MiB", control_port=0)
                for i in range(2):
                    child_sink.put_sample(spec(f"c{i}"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
                h2 = metrics.register(child_sink)
                ok = ok and isinstance(h2, metrics.ArenaCollector) and h2 is not h
                ok = ok and "capture_arena_published_samples_total 2.0" in _registry_text()
                metrics.unregister(h)
                metrics.unregister(h2)
                child_sink.close()
                code = 0 if ok else 2
            finally:
                os._exit(code)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert h.active
        assert "capture_arena_published_samples_total 1.0" in _registry_text()
    finally:
        metrics.unregister(h)


def test_a_bad_interval_warns_and_uses_the_default(monkeypatch, caplog):
    for bad in ("soon", "0", "-1", "nan", "inf"):
        monkeypatch.setenv(metrics.INTERVAL_ENV, bad)
        with caplog.at_level(logging.WARNING, logger="capture_arena"):
            caplog.clear()
            assert metrics._interval() == metrics.DEFAULT_INTERVAL_S
        assert metrics.INTERVAL_ENV in caplog.text
    monkeypatch.setenv(metrics.INTERVAL_ENV, "0.5")
    assert metrics._interval() == 0.5


def test_without_prometheus_client_register_returns_none(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_prometheus(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "prometheus_client" or name.startswith("prometheus_client."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_prometheus)
    assert metrics.register(FakeSink()) is None
    metrics.unregister(None)
