"""The GIL is released while the sink waits (and copies): other Python threads keep running; and a
process forked while another thread held a reader's lock reads all the same."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Callable

import pytest

import capture_arena as ca
from conftest import hidden, spec


def test_the_gil_is_released_while_a_batch_waits_for_frees(make_sink):
    sink = make_sink(arena_bytes="1MiB", wait_s=20.0)
    first = sink.put_sample(spec("a", 16), aux=hidden(16, 24576), last_hidden=hidden(16, 4))
    done_at: list[float] = []

    def put() -> None:
        r = sink.put_sample(spec("b", 16), aux=hidden(16, 24576), last_hidden=hidden(16, 4))
        done_at.append(time.monotonic())
        assert "error" not in r

    t = threading.Thread(target=put)
    t.start()
    # This thread needs the GIL to count: it only progresses if put() released it.
    count, end = 0, time.monotonic() + 0.3
    while time.monotonic() < end:
        count += 1
    assert count > 10_000, count
    assert t.is_alive(), "still waiting for a free"
    released = time.monotonic()
    ca.ArenaFeatureStore().release(first)
    t.join(timeout=20)
    assert done_at and done_at[0] >= released, "published before the free it waited for"


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


def _progress_and_stall_while(fn: Callable[[], Any]) -> tuple[float, int, float, Any]:
    """Runs ``fn`` on another thread while this one counts: ``(seconds, count, the longest stretch
    this thread could not run, fn's result)``. A GIL held through native work shows as one stall
    as long as that work."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t0 = last = time.monotonic()
    t.start()
    count, stall = 0, 0.0
    while t.is_alive():
        now = time.monotonic()
        stall = max(stall, now - last)
        last = now
        count += 1
    took = time.monotonic() - t0
    t.join()
    return took, count, stall, out[0] if out else None


def _stall_under_half_the_call(fn: Callable[[], Any], undo: Callable[[Any], None]) -> Any:
    """``fn``'s result once this thread's longest stall while it ran was under half of it; up to
    three tries (``undo`` takes a failed try's result back). A GIL held through the native work
    stalls every try; a preemption of this thread by another process (the test command runs
    two test files at once on two cores) does not repeat."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    tries = []
    try:
        for _ in range(3):
            took, _, stall, got = _progress_and_stall_while(fn)
            if stall < 0.5 * took:
                return got
            tries.append((round(took, 4), round(stall, 4)))
            undo(got)
    finally:
        sys.setswitchinterval(switch)
    raise AssertionError(f"this thread stalled for half the call or longer in every try (took, stall): {tries}")


def test_the_gil_is_released_while_an_eager_sink_creates_its_arena_and_a_store_maps_it(make_sink):
    # If the GIL were held while the arena is created (fallocate, pre-fault) or mapped by a
    # reader (pre-fault), this thread's count would stall for that long.
    # Not a rate against a machine-dependent figure: the longest stretch this thread could not
    # run, against the call's own length, in the same run (a GIL held through the native work
    # would be one stall as long as the call). The switch interval is shortened so that ordinary
    # GIL hand-overs (5 ms by default) stay far below half of even a fast host's creation.
    sink = _stall_under_half_the_call(lambda: make_sink(arena_bytes="512MiB", eager=True), lambda s: s.close())
    assert sink.started
    r = sink.put_sample(spec("a", 8), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    # Mapping 512 MiB takes ~50 ms here: too short for a rate (thread start-up and the GIL's 5 ms
    # switch interval weigh on it); a GIL held while mapping would be one stall that long. A new
    # store each try: a store maps a session once.
    _, got = _stall_under_half_the_call(lambda: (lambda store: (store, store.get(r)))(ca.ArenaFeatureStore()), lambda _: None)
    assert (got["hidden_state"][0] == hidden(8, 12)).all()


# Holds `lock` on a thread of its own, then forks (`pid`); `release` lets the lock go.
HOLD_THEN_FORK = r"""
held, release = threading.Event(), threading.Event()

def hold():
    with lock:
        held.set()
        release.wait(60)

threading.Thread(target=hold, daemon=True).start()
held.wait(30)
pid = os.fork()
"""


# A process forked (a dataloader worker) while another thread of its parent held one of the
# readers' locks: making a 256 MiB output pool slab, making a Mooncake reader, holding a
# transfer's outputs; or a sink's: making an engine-placement arena, a capture warning. Nothing releases it in the child, whose first read then waited for good.
FORKED_WHILE_HELD = r"""
import os, signal, sys, threading
import capture_arena as ca
from capture_arena import _engine, _pool, _samples

lock = {"pool": lambda: _pool.POOL._lock, "readers": lambda: ca.ArenaFeatureStore._making,
        "quarantine": lambda: _engine.QUARANTINE._lock, "sink_starting": lambda: ca.ArenaSink._starting,
        "warnings": lambda: _samples._FAILURES._lock}[sys.argv[1]]()
""" + HOLD_THEN_FORK + r"""
if pid == 0:
    signal.alarm(10)  # the child ends at 10 s if it waits for the lock
    assert _pool.POOL.bytes_u8(16) is not None
    ca.ArenaFeatureStore()._stores()
    _engine.QUARANTINE.hold(object())
    with ca.ArenaSink._starting:  # what an engine-placement sink's start takes
        pass
    _samples._FAILURES.warn("forked", "a capture warning in the child")
    os._exit(0)
release.set()
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.mark.parametrize("lock", ["pool", "readers", "quarantine", "sink_starting", "warnings"])
def test_a_child_forked_while_a_readers_lock_was_held_reads_all_the_same(lock: str) -> None:
    out = subprocess.run([sys.executable, "-c", FORKED_WHILE_HELD, lock], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "0", f"the child ended {out.stdout.split()[-1]} (-14: it waited for the lock until its alarm)"


# A process forked while its parent had a sink: a thread of the parent held the sink's starter
# lock, and another was in a call into native code (waiting for arena space). The child's exit
# closed the parent's sink (taking that lock: it hung) and waited 5 s for the parent's call.
FORKED_WITH_A_SINK = r"""
import os, signal, sys, threading, time
import numpy as np
import capture_arena as ca

sink = ca.ArenaSink(arena_bytes="64KiB", wait_s=30)
spec = lambda i: {"store_id": "st", "sample_id": f"s{i}", "features": {"last_hidden": "target"}}
assert "error" not in sink.put_sample(spec(0), last_hidden=np.ones((8, 1024), np.float32))  # 32 KiB
waiting = threading.Thread(target=lambda: sink.put_sample(spec(1), last_hidden=np.ones((12, 1024), np.float32)), daemon=True)
waiting.start()  # 48 KiB: waits for frees, in native code
while sink.stats()["waiting_bytes"] == 0:
    time.sleep(0.01)
lock = sink._early_lock
""" + HOLD_THEN_FORK + r"""
if pid == 0:
    signal.alarm(10)  # ends a child that hangs at its exit
    sys.exit(0)  # the exit hooks run
t0 = time.monotonic()
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status), round(time.monotonic() - t0, 2), flush=True)
release.set()
os._exit(0)
"""


def test_a_forked_childs_exit_closes_none_of_its_parents_sinks() -> None:
    out = subprocess.run([sys.executable, "-c", FORKED_WITH_A_SINK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    code, took = out.stdout.split()
    assert code == "0", f"the child ended {code} (-14: it hung at its exit until its 10 s alarm)"
    assert float(took) < 4.0, f"the child's exit took {took} s (it waited for its parent's call in flight)"


def test_what_a_failed_read_kept_from_being_freed_is_let_go_once_its_time_is_up() -> None:
    """The outputs of a timed-out or late-failed read are held from being freed while a
    transfer may still write into them, for a time; they were let go only by the next hold, so
    the last failed read's outputs (gigabytes maybe) were kept for the process's life."""
    import gc
    import time
    import weakref

    from capture_arena import _engine

    class Outputs:
        pass

    out = Outputs()
    gone = weakref.ref(out)
    _engine.QUARANTINE.hold(out, seconds=0.2)
    del out
    deadline = time.monotonic() + 10
    while gone() is not None:
        assert time.monotonic() < deadline, "still held 10 s after its 0.2 s"
        gc.collect()
        time.sleep(0.05)


def test_a_read_that_cannot_have_its_thread_fails_with_our_error_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Mooncake read runs on a thread of its own (its deadline); where none can be started
    (the process at its thread limit, or exiting) the read raised threading's bare
    RuntimeError, no CaptureArenaError and nothing saying what to change."""
    import threading

    from capture_arena import _engine

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(ca.CaptureArenaError, match="thread limit") as e:
        _engine.run_bounded("capture-arena-engine-read", lambda: None, None, 1.0, lambda: "timed out")
    assert isinstance(e.value, ca.ArenaOSError)


class _Outputs:
    """Stands for a read's outputs (what the quarantine holds), seen through a weak reference."""


def _let_go_within(ref: Any, seconds: float, what: str) -> None:
    import gc

    deadline = time.monotonic() + seconds
    while ref() is not None:
        assert time.monotonic() < deadline, what
        gc.collect()
        time.sleep(0.02)


def _stalled(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, why: str) -> tuple[threading.Event, list[Any]]:
    """Replaces ``module.name`` (what makes a Mooncake client) with a stand-in that records its
    argument, waits for the returned event (at most 30 s), then fails with ``why``; the list
    holds each call's argument."""
    answer = threading.Event()
    calls: list[Any] = []

    def stalled(arg: Any) -> Any:
        calls.append(arg)
        answer.wait(30)
        raise ca.ArenaOSError(why)

    monkeypatch.setattr(module, name, stalled)
    return answer, calls


def _all_at_once(read: Callable[..., None], args: list[tuple[Any, ...]]) -> None:
    """Runs ``read(*a)`` for each of ``args`` on a thread of its own, all at once; returns when
    every one has."""
    readers = [threading.Thread(target=read, args=a) for a in args]
    for t in readers:
        t.start()
    for t in readers:
        t.join()


def test_store_reads_waiting_for_another_threads_connect_give_up_at_their_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three store reads (deadline 0.5 s) while the master does not answer the first one's
    connect: the two waiting for that connect stop waiting at their deadline, as the
    TransferEngine's reads do, and none becomes the next connector for nobody once the connect
    fails (before: their threads waited for it, and then each connected in turn, 2-7 s of
    probes each; found by an outside reading). Mooncake's connect is a stand-in here."""
    import numpy as np

    from capture_arena import _store

    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S", "0.5")
    answer, connects = _stalled(monkeypatch, _store, "connect", "the master did not answer")
    reader = _store.StoreReader()
    errors: list[str] = []

    def read() -> None:
        try:
            reader.read([("st/s/g1/x", 64)], [np.zeros(64, dtype=np.uint8)])
        except ca.StaleSessionError as e:
            errors.append(str(e))

    _all_at_once(read, [(), (), ()])
    assert len(errors) == 3, errors

    def working() -> int:
        return sum(t.name == "capture-arena-store-read" for t in threading.enumerate())

    deadline = time.monotonic() + 10
    while working() > 1:  # the given-up waiters' threads end; the connecting one waits on
        assert time.monotonic() < deadline, f"{working()} store-read threads still wait for another's connect"
        time.sleep(0.01)
    answer.set()
    while working():
        assert time.monotonic() < deadline, "the connecting read's thread never ended"
        time.sleep(0.01)
    assert len(connects) == 1, f"{len(connects)} connects for reads all given up on"


def test_a_read_makes_its_engine_within_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Making a TransferEngine (it may wait on a metadata server) ran on the caller's thread
    before the read's deadline began: a trainer's read waited as long as Mooncake did. Reads
    meanwhile wait for that one make rather than each making an engine (a thread each, and an
    engine each once the server answers). And the outputs of a read given up on while its
    engine was made (no transfer began, none will) are let go once the making ends, not held
    180 s."""
    import weakref

    from capture_arena import _engine

    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S", "0.5")
    answer, makes = _stalled(monkeypatch, _engine, "new_engine", "the metadata server did not answer")
    reader = _engine.EngineReader()
    out = _Outputs()
    gone = weakref.ref(out)
    errors: list[str] = []

    def read(keep: Any) -> None:
        t0 = time.monotonic()
        try:
            reader.read("127.0.0.1:1", [(1 << 20, 1 << 20, 64)], keep=keep)
        except ca.StaleSessionError as e:
            errors.append(f"{time.monotonic() - t0:.2f} s: {e}")

    _all_at_once(read, [(out,), (_Outputs(),), (_Outputs(),)])
    assert len(errors) == 3, errors
    # Past the deadline only by a loaded machine's wake-ups; before, until the make ended (30 s).
    assert all(float(e.split(" s:")[0]) < 5.0 for e in errors), f"a read waited past its deadline: {errors}"
    assert sum("making this process's TransferEngine did not finish within the read's 0.5 s" in e for e in errors) >= 1, errors
    assert len(makes) == 1, f"{len(makes)} engines were being made at once"
    del out
    answer.set()
    _let_go_within(gone, 10.0, "the outputs of a read that began no transfer are still held")


def test_a_read_that_failed_before_any_transfer_holds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that fails after Mooncake's own timeout has its outputs held (the transfer was not
    cancelled). A Mooncake store read whose connect failed that late (its probes take 7 s
    against a stopped master) began no transfer: its outputs were held 120 s all the same."""
    import weakref

    import numpy as np

    from capture_arena import _engine, _store

    monkeypatch.setattr(_engine, "MOONCAKE_MIN_TIMEOUT_S", 0.0)  # every failure counts as that late

    def no_master(self: Any, gone: Any = None) -> Any:
        raise ca.ArenaOSError("the Mooncake master does not answer")

    monkeypatch.setattr(_store.StoreReader, "_client", no_master)
    view = np.zeros(64, dtype=np.uint8)
    gone = weakref.ref(view)
    with pytest.raises(ca.ArenaOSError, match="does not answer"):
        _store.StoreReader().read([("st/s/g1/x", 64)], [view])
    del view
    _let_go_within(gone, 2.0, "the outputs of a store read whose connect failed are held")
    # Held still once a transfer began (the guarded case).
    held = _Outputs()
    kept = weakref.ref(held)

    def transfer_fails() -> None:
        began.set()
        raise ca.StaleSessionError("the transfer failed")

    began = threading.Event()
    with pytest.raises(ca.StaleSessionError):
        _engine.run_bounded("capture-arena-engine-read", transfer_fails, held, 5.0, lambda: "timed out", began=began)
    del held
    import gc

    gc.collect()
    assert kept() is not None, "outputs a transfer may still write were let go"
