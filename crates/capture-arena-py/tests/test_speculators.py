"""capture_arena.speculators' transfer (speculators' trainer side) against a real arena: results
shaped as capture_arena.vllm publishes them (``hidden_states`` [1, n, k*H], ``token_ids`` [1, n],
the handle their key prefix), read and freed as speculators' dataset does
(speculators/train/data.py: ``get_generated``, then ``delete(handle)``, also when it raised)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hs_connectors")

import capture_arena as ca  # noqa: E402
from capture_arena.speculators import CaptureArenaTransfer  # noqa: E402

K, H = 3, 8


def publish(sink: ca.ArenaSink, sample_id: str, n: int = 5) -> dict[str, Any]:
    """A request's result as vLLM's connector hands it out (rows written, ids 0..n-1)."""
    spec = {
        "store_id": "vllm",
        "sample_id": sample_id,
        "gen": 1,
        "features": {"hidden_states": {"shape": [1, n, K * H], "dtype": "bfloat16"}, "token_ids": {"shape": [1, n], "dtype": "int64"}},
    }
    ((row, at),) = sink.reserve_each([spec], within_s=30)
    assert "error" not in row and at is not None, row
    sink.finish_writes([row])
    return row


def params(row: dict[str, Any], handle: Any = None) -> dict[str, Any]:
    """kv_transfer_params as vLLM's response carries them."""
    return {"capture_arena": row, "handle": f"vllm/{row['sample_id']}/g{row['gen']}/" if handle is None else handle}


def wait_resident(sink: ca.ArenaSink, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while sink.stats()["resident_objects"] != n:
        assert time.monotonic() < deadline, f"resident objects: {sink.stats()['resident_objects']}, expected {n}"
        time.sleep(0.01)


@pytest.fixture
def sink(make_sink: Callable[..., ca.ArenaSink]) -> ca.ArenaSink:
    return make_sink(aux_layer_ids=[1, 2, 4])


def test_a_read_result_is_deleted_by_its_handle(sink: ca.ArenaSink) -> None:
    row = publish(sink, "r1")
    t = CaptureArenaTransfer()
    got = t.get_generated(params(row))
    assert tuple(got["hidden_states"].shape) == (5, K, H) and got["token_ids"].dtype == torch.int64
    wait_resident(sink, 2)
    t.delete(params(row)["handle"])
    t.flush(10)
    wait_resident(sink, 0)


def test_a_handle_that_does_not_name_its_result_is_refused_and_the_result_freed(sink: ca.ArenaSink) -> None:
    """speculators deletes by the handle: one naming other keys would free nothing (before:
    remembered under it, read, and left resident for good when the handle was not a string).
    Its delete of that handle, a list or a dict too, is ignored (before: ``TypeError``, which
    speculators logs as a failed clean-up)."""
    t = CaptureArenaTransfer()
    for i, bad in enumerate(["vllm/someone-else/g1/", 7, ["vllm/r/g1/"], {"h": 1}]):
        row = publish(sink, f"r-bad{i}")
        with pytest.raises(ca.CaptureArenaError, match="does not name its result.*; the result was freed$"):
            t.get_generated(params(row, bad))
        t.delete(bad)  # type: ignore[arg-type]  # what speculators does next (with what it took): frees nothing, raises nothing
        t.flush(10)
        wait_resident(sink, 0)


def test_a_transfer_let_go_with_results_it_read_and_never_deleted_frees_them(sink: ca.ArenaSink) -> None:
    """A dataset (and its transfer) dropped after a read whose delete never came (an exception
    between them, in a notebook or a loader of one's own): its results stayed resident until
    the process ended, and for good if the process ends in ``os._exit``."""
    import gc

    t = CaptureArenaTransfer()
    t.get_generated(params(publish(sink, "r-let-go")))
    wait_resident(sink, 2)
    del t
    gc.collect()
    wait_resident(sink, 0)


def test_a_forked_child_that_lets_its_transfer_go_frees_nothing_its_parent_read(sink: ca.ArenaSink) -> None:
    """A forked process starts with nothing read (what its parent read is the parent's to free).
    The transfer's finalizer held the dict of reads the fork inherited: a child letting its copy
    of the transfer go freed the parent's reads under it."""
    import gc
    import os

    t = CaptureArenaTransfer()
    row = publish(sink, "r-parent")
    t.get_generated(params(row))
    wait_resident(sink, 2)
    pid = os.fork()
    if pid == 0:  # the child: lets its transfer go, and sends whatever that freed
        code = 1
        try:
            store = t._store
            del t
            gc.collect()
            assert store is not None
            store.flush(5)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert sink.stats()["resident_objects"] == 2, "the child freed what its parent read"
    t.delete(params(row)["handle"])
    t.flush(10)
    wait_resident(sink, 0)


def test_token_ids_not_shaped_one_by_n_are_refused_as_the_error_says(sink: ca.ArenaSink) -> None:
    """``token_ids`` of ``[n]`` or ``[n, 1]`` passed: only their count was checked, though the
    error and docs/vllm.md say ``[1, n]``."""
    t = CaptureArenaTransfer()
    row = publish(sink, "r-flat")
    flat = {**row, "features": {**row["features"], "token_ids": {**row["features"]["token_ids"], "shape": [5]}}}
    with pytest.raises(ca.CaptureArenaError, match=r"token_ids \(5,\) torch.int64 are not \[1, 5, k\*H\] with k=3 and \[1, 5\] int64"):
        t.get_generated(params(flat))
    t.delete(params(row)["handle"])
    t.flush(10)
    wait_resident(sink, 0)


def test_a_refused_result_with_an_id_of_megabytes_makes_an_error_of_a_few_hundred_bytes(sink: ca.ArenaSink) -> None:
    """speculators logs the error at each retry: a result whose handle does not name it, with a
    10 MB sample id (before: the message quoted the id whole, twice over with the core's
    error from freeing it)."""
    t = CaptureArenaTransfer()
    row = publish(sink, "r-long")
    forged = {**row, "sample_id": "x" * 10_000_000}
    with pytest.raises(ca.CaptureArenaError, match="does not name its result") as e:
        t.get_generated(params(forged, "vllm/someone-else/g1/"))
    assert len(str(e.value)) < 2000, len(str(e.value))
    t.get_generated(params(row))  # the real one, read and freed as speculators does
    t.delete(params(row)["handle"])
    t.flush(10)
    wait_resident(sink, 0)


def test_a_remembered_result_that_cannot_be_freed_costs_neither_other_reads_nor_their_frees(
    sink: ca.ArenaSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads never deleted are freed past MAX_UNDELETED. One whose free raises (a malformed
    result, remembered before its read failed) made the read that evicted it raise, and the
    results evicted after it stayed resident; now it is logged, alone."""
    import capture_arena.speculators as backend

    monkeypatch.setattr(backend, "MAX_UNDELETED", 1)
    t = CaptureArenaTransfer()
    bad = {k: v for k, v in publish(sink, "r-malformed").items() if k != "arena"}
    with pytest.raises(Exception):
        t.get_generated(params(bad))  # and never deleted
    rows = [publish(sink, f"r-good{i}") for i in range(3)]
    for row in rows:  # each evicts the one before (past MAX_UNDELETED = 1)
        assert tuple(t.get_generated(params(row))["hidden_states"].shape) == (5, K, H)
    t.delete(params(rows[-1])["handle"])
    t.flush(10)
    wait_resident(sink, 2)  # only the malformed one's objects: nothing can free them by its result


READ_AND_EXIT = """
import json, sys
from capture_arena.speculators import CaptureArenaTransfer
t = CaptureArenaTransfer()
got = t.get_generated(json.loads(sys.argv[1]))
print(tuple(got["hidden_states"].shape), flush=True)
raise KeyboardInterrupt  # between speculators' read and its delete (a dataloader worker's Ctrl+C)
"""


def test_what_a_process_read_and_never_deleted_is_freed_when_it_exits(sink: ca.ArenaSink) -> None:
    row = publish(sink, "r-exit")
    out = subprocess.run([sys.executable, "-c", READ_AND_EXIT, json.dumps(params(row))], capture_output=True, text=True, timeout=120)
    assert "(5, 3, 8)" in out.stdout and "KeyboardInterrupt" in out.stderr, out.stderr[-3000:]
    assert "freed 1 results read and never deleted" in out.stderr, out.stderr[-3000:]
    wait_resident(sink, 0)


def test_a_forked_worker_frees_what_it_read_and_never_deleted_and_leaves_its_parents_reads(sink: ca.ArenaSink) -> None:
    """speculators spawns its dataloader workers; a transfer used in workers multiprocessing
    forks (torch's default) keeps the same promise: what the worker read and never deleted is
    freed when it ends (it ends in os._exit, where atexit never runs: before, it stayed
    resident), and what its parent read before the fork stays the parent's."""
    import multiprocessing as mp

    t = CaptureArenaTransfer()
    mine, theirs = publish(sink, "r-parent"), publish(sink, "r-forked")
    t.get_generated(params(mine))

    def work(t: CaptureArenaTransfer) -> None:
        t.get_generated(params(theirs))  # and never deleted: the worker ends

    p = mp.get_context("fork").Process(target=work, args=(t,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    wait_resident(sink, 2)  # the worker's read freed, the parent's not
    t.delete(params(mine)["handle"])
    t.flush(10)
    wait_resident(sink, 0)


class _ReadThenHang(torch.utils.data.Dataset):  # type: ignore[misc]
    """A dataset whose one item reads a capture and then never returns (a worker that does not
    stop: its DataLoader terminates it), as speculators' dataset reads in its workers."""

    def __init__(self, t: CaptureArenaTransfer, kv: Any, ready: Any) -> None:
        self.t, self.kv, self.ready = t, kv, ready

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> Any:
        import time

        self.t.get_generated(self.kv)  # and never deleted
        self.ready.put(True)
        time.sleep(600)


class _HoldTheStoreReadersLock(torch.utils.data.Dataset):  # type: ignore[misc]
    """A worker that read a capture of the store placement and is terminated while its main
    thread holds the lock store readers are made under (as a SIGTERM can find its first store
    read), and never returns."""

    def __init__(self, t: CaptureArenaTransfer, ready: Any) -> None:
        self.t, self.ready = t, ready

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> Any:
        import time

        self.t.setup()
        store_result = {"store_id": "vllm", "sample_id": "s", "gen": 1, "features": {"hidden_states": {"shape": [1, 4], "dtype": "bfloat16"}}}
        self.t._remember("vllm/s/g1/", store_result)  # read, never deleted
        with ca.ArenaFeatureStore._making:
            self.ready.put(True)
            time.sleep(600)


def test_a_worker_terminated_while_holding_a_lock_its_frees_need_still_ends() -> None:
    """SIGTERM's handler freed on the main thread, which the handler had interrupted: where
    that code held a lock the frees take (a store reader's, or the one store readers are made
    under), the handler waited for it for good, and the worker lived on after its loader
    terminated it. The frees now run on a thread of their own, waited for a bounded time."""
    import multiprocessing as mp

    from torch.utils.data import DataLoader
    from torch.utils.data import _utils as loader_utils

    ctx = mp.get_context("fork")
    ready = ctx.Queue()
    loader = DataLoader(_HoldTheStoreReadersLock(CaptureArenaTransfer(), ready), batch_size=None, num_workers=1, multiprocessing_context=ctx)
    it = iter(loader)
    assert ready.get(timeout=120)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(loader_utils, "MP_STATUS_CHECK_INTERVAL", 0.2)
        worker = it._workers[0]
        it._shutdown_workers()
    worker.join(30)
    assert worker.exitcode == 0, worker.exitcode


def _sigterm_action(out: Any) -> None:
    import signal

    out.put("default" if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL else repr(signal.getsignal(signal.SIGTERM)))


def test_a_multiprocessing_child_that_reads_nothing_keeps_sigterms_default_action() -> None:
    """multiprocessing runs its after-fork hooks in every child it forks (a pool's workers):
    SIGTERM's handler went into each, so a ``Pool.terminate()`` of workers that read nothing
    waited for them to get back to Python and flush. It is the processes that read
    (``setup()``, a spawned worker's transfer) that get it."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    out = ctx.Queue()
    p = ctx.Process(target=_sigterm_action, args=(out,))
    p.start()
    got = out.get(timeout=120)
    p.join(60)
    assert got == "default", got


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_worker_terminated_by_its_dataloader_frees_what_it_read(sink: ca.ArenaSink, start: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's DataLoader (speculators' own: spawned workers) terminates (SIGTERM) a worker that
    does not stop in time; SIGTERM's default action and torch's worker handler both skip every
    exit hook, so what the worker read and never deleted stayed resident. The worker's SIGTERM
    now frees it first, then ends the worker with status 0 as torch's handler does. (Before,
    the handler was installed when the worker was made, and torch's worker loop put its own
    over it: resident 1 for good.)"""
    import multiprocessing as mp

    from torch.utils.data import DataLoader
    from torch.utils.data import _utils as loader_utils

    ctx = mp.get_context(start)
    t = CaptureArenaTransfer()
    r = publish(sink, f"r-terminated-{start}")
    ready = ctx.Queue()
    loader = DataLoader(_ReadThenHang(t, params(r), ready), batch_size=None, num_workers=1, multiprocessing_context=ctx, persistent_workers=True)
    it = iter(loader)  # the worker starts on the first item at once
    assert ready.get(timeout=120)
    # The loader's shutdown waits this long for a worker before terminating it (5 s).
    monkeypatch.setattr(loader_utils, "MP_STATUS_CHECK_INTERVAL", 0.2)
    worker = it._workers[0]
    it._shutdown_workers()
    worker.join(60)
    assert worker.exitcode == 0
    wait_resident(sink, 0)


def test_flush_waits_for_the_frees_of_refused_responses_too(sink: ca.ArenaSink, monkeypatch: pytest.MonkeyPatch) -> None:
    """``flush`` says it waits for every free; it flushed the transfer's reader only, not the
    frees of responses speculators' client refused (another reader). Seen with those frees
    held at a control endpoint that does not answer (a listener whose backlog is full): before,
    ``flush`` returned at once."""
    import socket
    from types import SimpleNamespace

    from capture_arena import speculators

    monkeypatch.setattr(speculators, "_REFUSED", None)  # this test's own, let go after it
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(0)
    held = [socket.create_connection(lst.getsockname(), timeout=1)]
    for _ in range(8):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(lst.getsockname())
        held.append(s)
    try:
        row = publish(sink, "r-refused-flush")
        dead = {**row, "arena": {**row["arena"], "control": "%s:%d" % lst.getsockname()}}
        speculators._free_refused(SimpleNamespace(kv_transfer_params=params(dead)))
        with pytest.raises(ca.FreeNotSentError):
            CaptureArenaTransfer().flush(0.5)
    finally:
        for x in held:
            x.close()
        lst.close()
    ca.ArenaFeatureStore().release(row)  # at the real endpoint
    wait_resident(sink, 0)


def test_a_response_speculators_client_refuses_has_its_capture_freed_with_a_stand_in_http_client(sink: ca.ArenaSink) -> None:
    """speculators' client (its real ``generate_hidden_states``) refuses a response whose prompt
    token ids differ from the sample's (a chat template re-rendered otherwise) before the handle
    reaches ``delete``; vLLM published the capture already, and each retry of the sample
    publishes another. Before: all of them resident for good (the arena fills, then every
    request fails). The HTTP client is a stand-in that returns vLLM's response (no server here)."""
    from types import SimpleNamespace

    from openai.types.completion import Completion
    from speculators.data_generation import vllm_client

    CaptureArenaTransfer()  # a transfer in this process wraps speculators' extract_output
    rows = [publish(sink, f"refused{i}") for i in range(2)]
    wait_resident(sink, 4)

    def create(**kwargs: Any) -> Completion:
        return Completion.model_validate({
            "id": "cmpl", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": "", "finish_reason": "length", "prompt_token_ids": [9, 9]}],
            "kv_transfer_params": params(rows.pop(0)),
        })

    client = SimpleNamespace(completions=SimpleNamespace(create=create))
    for _ in range(2):  # the sample, and its retry
        with pytest.raises(vllm_client.InvalidResponseError, match="mismatch"):
            vllm_client.generate_hidden_states(client, "m", {"input_ids": [1, 2]}, timeout=None)
    wait_resident(sink, 0)
