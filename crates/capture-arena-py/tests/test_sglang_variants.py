"""Each published SpecForge patch's calls into the hook module, through the real sglang wheel: the
module is imported the way the patched scheduler imports it, from a copy of the wheel with the
patch's calls added and ``install`` run (``conftest.scheduler_module``), and driven with that
patch's own logic (our code following it) and real torch tensors.

- asynchronous patches (v0.5.18, v0.5.20, main-923e4a56): ``PatchedSchedulerFlow``
  (``test_sglang_flow.py``): one ``submit_samples`` per scheduler batch, no ``try``;
  ``gpu_put_enabled()`` per batch (v0.5.20, main);
- the synchronous patch (kimi-k3 at f8493a4): ``SyncFlow`` below: ``put_sample`` per finished
  request on the scheduler thread, inside a ``try``;
- online-live: ``test_live.py``.

Every bad request costs only its own row, and the scheduler thread never sees an exception.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Optional

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/test.sh installs it)")

import capture_arena as ca  # noqa: E402
from test_sglang_flow import PatchedSchedulerFlow, Req, batch_tensors, expected, read_in_another_process, spec  # noqa: E402


class Scheduler:
    """What ``maybe_init_sink`` reads of its caller: attention-TP rank 0 on GPU 0."""

    ps = SimpleNamespace(attn_tp_rank=0, gpu_id=0)

    def __init__(self, hook: Any) -> None:
        self.sink = hook.maybe_init_sink(SimpleNamespace(enable_spec_capture=True, spec_capture_aux_layer_ids=[2, 18, 33]))


class SyncFlow:
    """The kimi-k3-f8493a4 patch's ``_sink_spec_capture`` on attention-TP rank 0: per finished
    request, ``torch.cat`` of its captured chunks, then ``put_sample`` on the scheduler thread
    inside a ``try`` that makes an exception the request's error row."""

    def __init__(self, hook: Any) -> None:
        self.hook = hook
        self.raised: list[BaseException] = []

    def sink_spec_capture(self, req: Req, aux: Optional[Any], last: Optional[Any]) -> None:
        sink = self.hook.get_sink()
        assert sink is not None
        try:
            req.spec_capture_result = sink.put_sample(req.spec_capture, aux=aux, last_hidden=last)
        except Exception as e:  # the patch's try; capture-arena's put_sample never gets here
            self.raised.append(e)
            req.spec_capture_result = {"sample_id": req.spec_capture.get("sample_id"), "error": str(e)}

    def run(self, reqs: list[Req], aux: Any, last: Any) -> None:
        off = 0
        for r in reqs:
            n = r.extend_len
            self.sink_spec_capture(r, aux[off : off + n].clone(), last[off : off + n].clone())
            off += n


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_PLACEMENT", "arena")
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_ARENA_BYTES", "64MiB")
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_ARENA_WAIT_S", "30")
    for v in ("MOONCAKE_PROTOCOL", "SGLANG_SPEC_CAPTURE_GPU_PUT", "SGLANG_SPEC_CAPTURE_ARENA_EAGER", "SGLANG_SPEC_CAPTURE_SYNC_WAIT_S"):
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def bad_and_good_requests(L: int) -> list[Req]:
    """Good requests around bad ones: a spec without store_id, a passthrough whose data does not
    fit its shape, a non-int gen, a feature asked for but not captured (last_hidden of width 0)."""
    return [
        Req(spec("g0", L), L),
        Req(spec("bad-no-store", L, store_id=None), L),
        Req(spec("bad-shape", L, passthrough=[{"name": "input_ids", "data": [1, 2], "shape": [1, L], "dtype": "int64"}]), L),
        Req(spec("g1", L), L),
        Req(spec("bad-gen", L, gen="x"), L),
        Req(spec("g2", L), L),
    ]


def check_rows(reqs: list[Req], aux: Any, last: Any) -> None:
    for r in reqs:
        res = r.spec_capture_result
        assert res is not None
        assert ("error" in res) == str(r.spec_capture["sample_id"]).startswith("bad"), res
    good = [r.spec_capture_result for r in reqs if "error" not in r.spec_capture_result]
    want = expected(reqs, aux, last)
    for res, got in zip(good, read_in_another_process(good)):  # every byte, then released
        assert got == want[str(res["sample_id"])], res["sample_id"]


@pytest.mark.parametrize(
    "variant,version", [("v0.5.18", "0.5.20"), ("v0.5.20", "0.5.20"), ("main-923e4a56", "0.5.20"), ("main-923e4a56", "0.5.23")]
)
def test_asynchronous_patches_publish_bit_exact_and_a_bad_request_costs_only_its_row(
    scheduler_module: Any, env: pytest.MonkeyPatch, variant: str, version: str
) -> None:
    hook = scheduler_module(variant, version)
    sink = Scheduler(hook).sink
    assert isinstance(sink, ca.ArenaSink) and hook.get_sink() is sink
    # Asynchronous: the arena is made at the first capture (the seed's rule), not at start.
    assert not sink.started
    if variant != "v0.5.18":
        assert hook.gpu_put_enabled() is False  # per batch: host tensors on this machine
    flow = PatchedSchedulerFlow()
    L = 6
    reqs = bad_and_good_requests(L)
    aux, last = batch_tensors([L] * len(reqs), 3 * 16, 16)
    flow.run_batch(reqs, aux, last)
    flow.drain(block=True)
    assert flow.logged_errors == [], "the future never fails for a list of samples"
    check_rows(reqs, aux, last)
    s = sink.stats()
    deadline = time.monotonic() + 30
    while s["resident_objects"] and time.monotonic() < deadline:
        time.sleep(0.01)
        s = sink.stats()
    assert s["free_bytes"] == s["capacity"], s


@pytest.mark.parametrize("version", ["0.5.20", "0.5.23"])
def test_the_synchronous_patch_finds_its_arena_made_at_start_and_a_bad_request_costs_only_its_row(
    scheduler_module: Any, env: pytest.MonkeyPatch, version: str
) -> None:
    hook = scheduler_module("kimi-k3-f8493a4", version)
    sink = Scheduler(hook).sink
    assert isinstance(sink, ca.ArenaSink)
    # A synchronous patch: made in the background when the server starts, on the capturing rank.
    deadline = time.monotonic() + 30
    while not sink.started:
        assert time.monotonic() < deadline, "the arena is made in the background at start"
        time.sleep(0.01)
    flow = SyncFlow(hook)
    L = 6
    reqs = bad_and_good_requests(L)
    aux, last = batch_tensors([L] * len(reqs), 3 * 16, 16)
    flow.run(reqs, aux, last)
    assert flow.raised == [], "put_sample never raises"
    check_rows(reqs, aux, last)


def test_a_full_arena_costs_the_scheduler_thread_its_bound_not_the_arena_wait(scheduler_module: Any, env: pytest.MonkeyPatch) -> None:
    env.setenv("SGLANG_SPEC_CAPTURE_ARENA_BYTES", "1MiB")
    hook = scheduler_module("kimi-k3-f8493a4")
    sink = Scheduler(hook).sink
    flow = SyncFlow(hook)
    L = 256
    aux, last = batch_tensors([L, L], 3 * 256, 256)  # ~0.5 MiB a request: the second does not fit
    first, second = Req(spec("a", L), L), Req(spec("b", L), L)
    flow.sink_spec_capture(first, aux[:L], last[:L])
    assert "error" not in first.spec_capture_result, first.spec_capture_result
    t0 = time.monotonic()
    flow.sink_spec_capture(second, aux[L:], last[L:])
    waited = time.monotonic() - t0
    err = second.spec_capture_result.get("error", "")
    assert "arena was full" in err and "SGLANG_SPEC_CAPTURE_SYNC_WAIT_S" in err, second.spec_capture_result
    # The bound (1 s by default), not SGLANG_SPEC_CAPTURE_ARENA_WAIT_S (30 s here).
    assert sink.sync_wait_s == 1.0 and 1.0 <= waited < 30.0, waited
    assert flow.raised == []
    # Freed: the next capture goes in; the one given up on was never written.
    ca.ArenaFeatureStore().reclaim(sink.control, prefixes=["run0/"], token=first.spec_capture_result["arena"].get("token"))
    deadline = time.monotonic() + 30
    while sink.stats()["resident_objects"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    third = Req(spec("c", L), L)
    flow.sink_spec_capture(third, aux[L:], last[L:])
    assert "error" not in third.spec_capture_result, third.spec_capture_result
    s = sink.stats()
    assert s["published_samples"] == 2 and s["failed_batches"] == 1, s


def test_put_sample_never_makes_the_arena_on_the_scheduler_thread(scheduler_module: Any, env: pytest.MonkeyPatch) -> None:
    # Made at the first capture instead of at start, and a bound of 0: the first put_sample
    # returns at once with its row; the arena is made meanwhile, off the scheduler thread.
    env.setenv("SGLANG_SPEC_CAPTURE_ARENA_EAGER", "0")
    env.setenv("SGLANG_SPEC_CAPTURE_SYNC_WAIT_S", "0")
    hook = scheduler_module("kimi-k3-f8493a4")
    sink = Scheduler(hook).sink
    assert not sink.started
    flow = SyncFlow(hook)
    L = 4
    aux, last = batch_tensors([L], 3 * 16, 16)
    first = Req(spec("first", L), L)
    flow.sink_spec_capture(first, aux, last)
    assert "still being created" in first.spec_capture_result.get("error", ""), first.spec_capture_result
    deadline = time.monotonic() + 30
    while not sink.started:
        assert time.monotonic() < deadline, "made in the background after the first capture"
        time.sleep(0.01)
    sink.sync_bound = 5.0  # a bound of 0 starts nothing: give the next one time to start
    again = Req(spec("again", L), L)
    flow.sink_spec_capture(again, aux, last)
    assert "error" not in again.spec_capture_result, again.spec_capture_result
    read_in_another_process([again.spec_capture_result])


def test_a_failed_start_fails_synchronous_captures_at_once_and_is_retried_later(scheduler_module: Any, env: pytest.MonkeyPatch) -> None:
    import socket

    # The control port is held by another process: the arena cannot be made.
    holder = socket.create_server(("127.0.0.1", 0))
    env.setenv("SGLANG_SPEC_CAPTURE_CONTROL_PORT", str(holder.getsockname()[1]))
    env.setenv("SGLANG_SPEC_CAPTURE_ARENA_EAGER", "0")
    env.setenv("SGLANG_SPEC_CAPTURE_SYNC_WAIT_S", "30")
    hook = scheduler_module("kimi-k3-f8493a4")
    sink = Scheduler(hook).sink
    flow = SyncFlow(hook)
    L = 4
    aux, last = batch_tensors([L], 3 * 16, 16)
    reqs = [Req(spec(f"r{i}", L), L) for i in range(3)]
    t0 = time.monotonic()
    for r in reqs:
        flow.sink_spec_capture(r, aux, last)
    took = time.monotonic() - t0
    for r in reqs:
        assert "creating the capture arena failed" in r.spec_capture_result.get("error", ""), r.spec_capture_result
    # One start was tried (the others fail at once with its reason), and nobody waited out the
    # 30 s bound for an arena that will not come.
    assert sink._starts_done == 1 and took < 30, (sink._starts_done, took)
    holder.close()
    sink._start_failed_at -= 60  # the retry interval (5 s) has passed
    again = Req(spec("again", L), L)
    flow.sink_spec_capture(again, aux, last)
    assert "error" not in again.spec_capture_result, again.spec_capture_result
    read_in_another_process([again.spec_capture_result])
