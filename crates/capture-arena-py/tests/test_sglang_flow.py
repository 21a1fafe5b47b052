"""capture_arena.sglang driven through the patched SGLang scheduler's capture flow, with real torch
tensors and a trainer in another process.

SGLang's scheduler is not run here (it needs a GPU and a model). ``PatchedSchedulerFlow`` is our
own code following the logic of SpecForge's published patches (patches/sglang/v0.5.18 and v0.5.20
spec-capture.patch, ``SchedulerBatchResultProcessor``): batch-level bf16/f32 CPU tensors
``[total_tokens, W]`` sliced per request, chunks concatenated, one ``submit_samples`` per scheduler
batch with no ``try`` around it, the bounded pending list with its blocking drain
(``SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES``), ``future.result()`` inside a ``try`` that turns an
exception into one error row per request, and one row per request streamed back.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/test.sh installs it)")

import capture_arena as ca  # noqa: E402
from capture_arena import sglang  # noqa: E402


class Req:
    """The scheduler's request, reduced to what the capture hooks touch."""

    def __init__(self, spec_capture: Optional[dict[str, Any]], extend_len: int) -> None:
        self.spec_capture = spec_capture
        self.extend_len = extend_len
        self.spec_capture_aux: list[Any] = []
        self.spec_capture_last_hidden: list[Any] = []
        self.spec_capture_result: Optional[dict[str, Any]] = None


class PatchedSchedulerFlow:
    """The patch's capture flow on attention-TP rank 0 (see the module docs)."""

    def __init__(self) -> None:
        self.batches: list[tuple[list[Any], Any]] = []
        self.streamed: list[Req] = []
        self.logged_errors: list[str] = []

    # _append_spec_capture_states: per-request views of the batch capture.
    def append_states(self, reqs: list[Req], aux: Optional[Any], last: Optional[Any]) -> None:
        offset = 0
        for req in reqs:
            start, end = offset, offset + req.extend_len
            offset = end
            features = dict((req.spec_capture or {}).get("features") or {})
            for artifact, captured, chunks in (("aux", aux, req.spec_capture_aux), ("last_hidden", last, req.spec_capture_last_hidden)):
                if artifact in features and captured is not None:
                    chunks.append(captured[start:end])

    @staticmethod
    def coalesce(chunks: list[Any]) -> Optional[Any]:
        if not chunks:
            return None
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=0)

    # _sink_spec_capture + _queue_spec_captures: one submit per scheduler batch, no try.
    def queue(self, reqs: list[Req]) -> None:
        pending = []
        for req in reqs:
            aux = self.coalesce(req.spec_capture_aux)
            last = self.coalesce(req.spec_capture_last_hidden)
            req.spec_capture_aux, req.spec_capture_last_hidden = [], []
            pending.append((req, req.spec_capture, aux, last))
        sink = sglang.get_sink()
        assert sink is not None
        samples = [(spec, aux, last) for _, spec, aux, last in pending]
        self.batches.append((pending, sink.submit_samples(samples)))
        max_pending = int(os.environ.get("SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES", "2"))
        if len(self.batches) >= max_pending:
            self.drain(block=True, max_batches=1)

    # drain_spec_captures + _complete_spec_capture_batch.
    def drain(self, *, block: bool = False, max_batches: Optional[int] = None) -> int:
        done = 0
        while self.batches:
            if max_batches is not None and done >= max_batches:
                break
            pending, future = self.batches[0]
            if not block and not future.done():
                break
            self.batches.pop(0)
            try:
                results = future.result()
                if len(results) != len(pending):
                    raise RuntimeError(f"spec-capture sink returned {len(results)} results for {len(pending)} samples")
            except Exception as e:
                self.logged_errors.append(str(e))
                for req, spec, _, _ in pending:
                    req.spec_capture_result = {"sample_id": spec.get("sample_id"), "error": str(e)}
            else:
                for (req, _, _, _), result in zip(pending, results):
                    req.spec_capture_result = result
            self.streamed.extend(req for req, _, _, _ in pending)
            done += 1
        return done

    def run_batch(self, reqs: list[Req], aux: Optional[Any], last: Optional[Any], chunks: int = 1) -> None:
        """A prefill batch: the batch-level tensors (optionally arriving in `chunks` prefill chunks
        per request, as chunked prefill would), then the hand-off to the sink."""
        if chunks == 1:
            self.append_states(reqs, aux, last)
        else:
            # Each request's rows in `chunks` pieces, each piece a view of a batch tensor of its own.
            for c in range(chunks):
                offset = 0
                for req in reqs:
                    n = req.extend_len
                    lo, hi = c * n // chunks, (c + 1) * n // chunks
                    feats = dict((req.spec_capture or {}).get("features") or {})
                    if aux is not None and "aux" in feats:
                        req.spec_capture_aux.append(aux[offset + lo : offset + hi].clone())
                    if last is not None and "last_hidden" in feats:
                        req.spec_capture_last_hidden.append(last[offset + lo : offset + hi].clone())
                    offset += n
        self.queue(reqs)


def spec(sample_id: Any, L: int, **kw: Any) -> dict[str, Any]:
    s: dict[str, Any] = {
        "store_id": "run0",
        "sample_id": sample_id,
        "gen": 1,
        "replace": False,
        "features": {"aux": "hidden_state", "last_hidden": "target"},
        "passthrough": [
            {"name": "input_ids", "data": list(range(L)), "shape": [1, L], "dtype": "int64"},
            {"name": "loss_mask", "data": [1] * L, "shape": [1, L], "dtype": "int64"},
        ],
    }
    s.update(kw)
    return s


def batch_tensors(lens: list[int], W: int, H: int, dtype: Any = None, seed: int = 0) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    dt = dtype or torch.bfloat16
    return torch.randn(n, W, generator=g).to(dt), torch.randn(n, H, generator=g).to(dt)


def expected(reqs: list[Req], aux: Any, last: Any) -> dict[str, dict[str, bytes]]:
    """What each published request's features must read back as, by sample_id."""
    out = {}
    off = 0
    for r in reqs:
        a, b = aux[off : off + r.extend_len], last[off : off + r.extend_len]
        off += r.extend_len
        res = r.spec_capture_result
        if res is None or "error" in res:
            continue
        want = {"hidden_state": a.contiguous(), "target": b.contiguous()}
        for p in r.spec_capture["passthrough"]:
            d = p["data"]
            t = d if isinstance(d, torch.Tensor) else torch.tensor(d, dtype=getattr(torch, p.get("dtype") or "int64"))
            want[p["name"]] = t.to(getattr(torch, p.get("dtype") or "int64")).contiguous()
        out[str(res["sample_id"])] = {k: v.reshape(-1).view(torch.uint8).numpy().tobytes() for k, v in want.items()}
    return out


def read_in_another_process(results: list[dict[str, Any]]) -> list[dict[str, bytes]]:
    from _reader import read_all

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        got: list[dict[str, bytes]] = pool.apply(read_all, (results,))
    return got


@pytest.fixture
def arena_env(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_PLACEMENT", "arena")
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_ARENA_BYTES", "64MiB")
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_ARENA_WAIT_S", "5")
    for v in ("MOONCAKE_PROTOCOL", "SGLANG_SPEC_CAPTURE_GPU_PUT", "SGLANG_SPEC_CAPTURE_CONTROL_PORT", "SGLANG_SPEC_CAPTURE_ARENA_EAGER"):
        monkeypatch.delenv(v, raising=False)
    sglang.reset_sink()
    yield monkeypatch
    sglang.reset_sink()


def server_args() -> SimpleNamespace:
    return SimpleNamespace(enable_spec_capture=True, spec_capture_aux_layer_ids=[2, 18, 33])


def publish_and_verify(flow: PatchedSchedulerFlow, reqs: list[Req], aux: Any, last: Any, chunks: int = 1) -> list[dict[str, Any]]:
    flow.run_batch(reqs, aux, last, chunks)
    flow.drain(block=True)
    good = [r.spec_capture_result for r in reqs if r.spec_capture_result and "error" not in r.spec_capture_result]
    want = expected(reqs, aux, last)
    got = read_in_another_process(good)  # reads every byte, then releases each
    for res, g in zip(good, got):
        assert g == want[str(res["sample_id"])], res["sample_id"]
    return good


def test_every_tensor_kind_is_published_bit_exact_through_the_patch_flow(arena_env):
    sink = sglang.maybe_init_sink(server_args())
    assert sink is not None and sglang.get_sink() is sink
    assert sglang.gpu_put_enabled() is False
    flow = PatchedSchedulerFlow()
    # bf16 and f32, several requests per batch, one of them L = 0.
    for dtype in (torch.bfloat16, torch.float32):
        lens = [5, 0, 17, 3]
        aux, last = batch_tensors(lens, 24, 8, dtype)
        reqs = [Req(spec(f"{dtype}-{i}", L), L) for i, L in enumerate(lens)]
        good = publish_and_verify(flow, reqs, aux, last)
        assert len(good) == 4 and good[0]["aux_layer_ids"] == [2, 18, 33]
        assert good[1]["features"]["hidden_state"]["shape"] == [1, 0, 24]
    # Chunked prefill: chunks concatenated by the flow.
    lens = [9, 6]
    aux, last = batch_tensors(lens, 24, 8, seed=1)
    publish_and_verify(flow, [Req(spec(f"chunked-{i}", L), L) for i, L in enumerate(lens)], aux, last, chunks=3)
    # Strided, transposed and expanded views, requires_grad, passthrough tensors.
    L = 7
    base = torch.randn(24, L).to(torch.bfloat16)
    views = {
        "transposed": (base.t(), torch.randn(8, L).to(torch.bfloat16).t()),
        "strided": (torch.randn(L, 48).to(torch.bfloat16)[:, ::2], torch.randn(L, 16).to(torch.bfloat16)[:, ::2]),
        "expanded": (torch.randn(1, 24).to(torch.bfloat16).expand(L, 24), torch.randn(1, 8).to(torch.bfloat16).expand(L, 8)),
        "grad": (torch.randn(L, 24, requires_grad=True), torch.randn(L, 8, requires_grad=True)),
    }
    for name, (a, b) in views.items():
        s = spec(name, L)
        s["passthrough"] = [
            {"name": "input_ids", "data": torch.arange(L, dtype=torch.int64).reshape(1, L), "shape": [1, L], "dtype": "int64"},
            {"name": "loss_mask", "data": torch.ones(1, L, dtype=torch.int32), "shape": [1, L], "dtype": "int64"},
        ]
        req = Req(s, L)
        req.spec_capture_aux, req.spec_capture_last_hidden = [a], [b]
        flow.queue([req])
        flow.drain(block=True)
        res = req.spec_capture_result
        assert res is not None and "error" not in res, res
        got = read_in_another_process([res])[0]
        assert got["hidden_state"] == a.detach().contiguous().view(torch.uint8).numpy().tobytes(), name
        assert got["target"] == b.detach().contiguous().view(torch.uint8).numpy().tobytes(), name
        assert got["loss_mask"] == torch.ones(1, L, dtype=torch.int64).numpy().tobytes()
    st = sink.stats()
    assert st["resident_objects"] == 0 and st["free_bytes"] == st["capacity"], st


BAD = {
    # What a client can put in a request body that the sink cannot publish: the request's own row.
    "aux requested, not captured": lambda L: (spec("noaux", L), None),
    "data/shape mismatch": lambda L: (
        spec("mismatch", L, passthrough=[{"name": "input_ids", "data": [1, 2, 3], "shape": [1, L], "dtype": "int64"}]),
        "",
    ),
    "key over 1024 bytes": lambda L: (spec("x" * 1100, L), ""),
    "unsupported dtype": lambda L: (spec("dt", L, passthrough=[{"name": "p", "data": [1], "shape": [1], "dtype": "complex64"}]), ""),
    "no store_id": lambda L: ({k: v for k, v in spec("nostore", L).items() if k != "store_id"}, ""),
    "gen not a number": lambda L: (spec("gen", L, gen="one"), ""),
    "passthrough not a list": lambda L: (spec("pt", L, passthrough=5), ""),
}

LENIENT = {
    # What the sink being replaced accepts, and so does this one (coerced as it does).
    "replace: 0": lambda L: spec("r0", L, replace=0),
    "int sample_id": lambda L: spec(12345, L),
    'gen: "1"': lambda L: spec("g", L, gen="1"),
    "passthrough without dtype": lambda L: spec(
        "nodtype", L, passthrough=[{"name": "input_ids", "data": list(range(L)), "shape": [1, L]}]
    ),
    "int32 tensor declared int64": lambda L: spec(
        "i32", L, passthrough=[{"name": "input_ids", "data": torch.arange(L, dtype=torch.int32), "shape": [1, L], "dtype": "int64"}]
    ),
    "/ in store_id": lambda L: spec("slash", L, store_id="runs/2026-12-01"),
    "/ in sample_id": lambda L: spec("a/b/g1", L),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_request_costs_only_its_own_row_and_the_next_batch_succeeds(arena_env, case):
    sglang.maybe_init_sink(server_args())
    flow = PatchedSchedulerFlow()
    L = 6
    bad_spec, aux_marker = BAD[case](L)
    lens = [L, L, L]
    aux, last = batch_tensors(lens, 24, 8)
    reqs = [Req(spec("good-before", L), L), Req(bad_spec, L), Req(spec("good-after", L), L)]
    if aux_marker is None:  # the server captured no aux for this request
        flow.append_states(reqs[:1], aux[:L], last[:L])
        reqs[1].spec_capture_last_hidden.append(last[L : 2 * L])
        flow.append_states(reqs[2:], aux[2 * L :], last[2 * L :])
        flow.queue(reqs)
    else:
        flow.run_batch(reqs, aux, last)
    flow.drain(block=True)
    assert flow.logged_errors == [], "the future must not fail: the scheduler would fail every request of the batch"
    rows = [r.spec_capture_result for r in reqs]
    assert all(r is not None for r in rows)
    assert "error" not in rows[0] and "error" not in rows[2], rows
    assert "error" in rows[1] and rows[1]["error"], rows[1]
    assert len(flow.streamed) == 3
    read_in_another_process([rows[0], rows[2]])
    # The next batch goes on.
    nxt = [Req(spec("next", L), L)]
    a2, l2 = batch_tensors([L], 24, 8, seed=3)
    good = publish_and_verify(flow, nxt, a2, l2)
    assert len(good) == 1
    st = sglang.get_sink().stats()  # type: ignore[union-attr]
    assert st["resident_objects"] == 0, st


def test_items_that_are_not_samples_get_rows_too(arena_env):
    # What SGLang's own code would not pass on (it reads spec_capture as a dict), straight to the
    # sink: still rows, never an exception.
    sink = sglang.maybe_init_sink(server_args())
    assert sink is not None
    L = 3
    aux, last = batch_tensors([L], 24, 8)
    rows = sink.submit_samples([("spec", aux, last), (spec("ok", L), aux, last), (None, None, None), (1, 2)]).result(timeout=30)
    assert [("error" in r) for r in rows] == [True, False, True, True], rows
    assert rows[1]["sample_id"] == "ok"
    fut = sink.submit_samples(5)  # type: ignore[arg-type]
    assert isinstance(fut.exception(timeout=5), ca.InvalidSampleError)
    read_in_another_process([rows[1]])


@pytest.mark.parametrize("case", sorted(LENIENT))
def test_what_the_original_sink_accepts_is_published(arena_env, case):
    sglang.maybe_init_sink(server_args())
    flow = PatchedSchedulerFlow()
    L = 5
    s = LENIENT[case](L)
    aux, last = batch_tensors([L], 24, 8)
    req = Req(s, L)
    flow.run_batch([req], aux, last)
    flow.drain(block=True)
    res = req.spec_capture_result
    assert res is not None and "error" not in res, res
    assert res["sample_id"] == str(s["sample_id"]) and res["store_id"] == str(s["store_id"]) and res["gen"] == 1
    got = read_in_another_process([res])[0]
    assert got["hidden_state"] == aux.view(torch.uint8).numpy().tobytes()
    assert got["input_ids"] == np.arange(L, dtype=np.int64).tobytes()


def test_a_prefix_free_of_one_store_never_reaches_a_store_whose_id_extends_it(arena_env):
    sink = sglang.maybe_init_sink(server_args())
    flow = PatchedSchedulerFlow()
    L = 4
    aux, last = batch_tensors([L, L, L], 24, 8)
    reqs = [Req(spec("1", L, store_id="run"), L), Req(spec("x", L, store_id="run/1"), L), Req(spec("1/x", L, store_id="run"), L)]
    flow.run_batch(reqs, aux, last)
    flow.drain(block=True)
    rows = [r.spec_capture_result for r in reqs]
    assert all(r and "error" not in r for r in rows), rows
    per_sample = len(rows[0]["features"])
    control = rows[0]["arena"]["control"]
    # Frees of store "run"'s sample "1", then of all of store "run/1", as prefixes.
    ca.ArenaFeatureStore.reclaim(control, prefixes=["run/1/"])
    st = _wait(sink, lambda s: s["freed_objects"] >= per_sample)
    assert st["freed_objects"] == per_sample and st["resident_objects"] == 2 * per_sample, st
    ca.ArenaFeatureStore.reclaim(control, prefixes=["run%2F1/"])
    st = _wait(sink, lambda s: s["freed_objects"] >= 2 * per_sample)
    assert st["freed_objects"] == 2 * per_sample, st
    # What is left is store "run"'s sample "1/x", readable and intact.
    got = read_in_another_process([rows[2]])[0]
    assert got["hidden_state"] == aux[2 * L :].view(torch.uint8).numpy().tobytes()


def _wait(sink: Any, pred: Any, timeout: float = 10.0) -> dict[str, int]:
    import time

    deadline = time.monotonic() + timeout
    while True:
        st: dict[str, int] = sink.stats()
        if pred(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.01)


def test_a_failed_first_capture_leaves_the_sink_usable(arena_env):
    # A fixed control port that another process holds: the first capture cannot create the arena.
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    arena_env.setenv("SGLANG_SPEC_CAPTURE_CONTROL_PORT", str(holder.getsockname()[1]))
    sink = sglang.maybe_init_sink(server_args())
    assert sink is not None
    flow = PatchedSchedulerFlow()
    L = 4
    aux, last = batch_tensors([L, L], 24, 8)
    reqs = [Req(spec("a", L), L), Req(spec("b", L), L)]
    flow.run_batch(reqs, aux, last)
    flow.drain(block=True)
    assert flow.logged_errors == []
    for r in reqs:
        assert r.spec_capture_result and "error" in r.spec_capture_result, r.spec_capture_result
        assert str(holder.getsockname()[1]) in r.spec_capture_result["error"] or "ddress" in r.spec_capture_result["error"]
    holder.close()
    sink._start_failed_at -= 60  # the retry interval (START_RETRY_S, 5 s) has passed
    good = publish_and_verify(flow, [Req(spec("c", L), L)], aux[:L], last[:L])
    assert len(good) == 1


def test_the_first_capture_does_not_create_the_arena_on_the_scheduler_thread(arena_env):
    import threading

    arena_env.setenv("SGLANG_SPEC_CAPTURE_ARENA_BYTES", "256MiB")
    sink = sglang.maybe_init_sink(server_args())
    assert sink is not None and not sink.started
    # Which thread creates the arena: recorded where it is made (the compiled _start).
    creators: list[str] = []
    start = ca.ArenaSink._start

    def recording_start(self: Any, device: Any = None) -> None:
        creators.append(threading.current_thread().name)
        start(self, device)

    arena_env.setattr(ca.ArenaSink, "_start", recording_start)
    L = 4
    aux, last = batch_tensors([L], 24, 8)
    fut = sink.submit_samples([(spec("first", L), aux, last)])
    res = fut.result(timeout=60)[0]
    assert "error" not in res, res
    assert sink.started
    assert creators == ["capture-arena-start"], f"the arena was created on {creators}, not the starter thread"
    assert threading.current_thread().name not in creators
    read_in_another_process([res])


def test_a_rank_that_never_captures_never_allocates_even_when_eager(arena_env):
    arena_env.setenv("SGLANG_SPEC_CAPTURE_ARENA_EAGER", "1")

    class Scheduler:  # what maybe_init_sink reads of its caller: self.ps.attn_tp_rank, self.gpu_id
        def __init__(self, rank: int) -> None:
            self.ps = SimpleNamespace(attn_tp_rank=rank)
            self.gpu_id = rank
            self.sink = sglang.maybe_init_sink(server_args())

    def start_asked(s: Any) -> bool:  # start_in_background queues a start before it returns
        return s._starter is not None or s._starts_done > 0 or s.started

    s1 = Scheduler(1).sink
    assert s1 is not None
    assert not start_asked(s1), "rank 1 never captures: no arena, not even one being made"
    sglang.reset_sink()
    s0 = Scheduler(0).sink
    assert s0 is not None
    assert start_asked(s0), "the start is asked for before maybe_init_sink returns"
    assert _wait_started(s0), "rank 0 creates its arena in the background"
    assert s1._starter is None and s1._starts_done == 0, "and rank 1 (closed by reset_sink) never made one"


def _wait_started(sink: Any, timeout: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while not sink.started and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(sink.started)


def test_gpu_put_enabled_follows_the_placement_and_nvlink_with_gpu_put_0_is_refused(arena_env):
    arena_env.delenv("SGLANG_SPEC_CAPTURE_PLACEMENT")
    arena_env.setenv("MOONCAKE_PROTOCOL", "nvlink")
    assert sglang.gpu_put_enabled() is True
    arena_env.setenv("SGLANG_SPEC_CAPTURE_GPU_PUT", "0")
    assert sglang.gpu_put_enabled() in (True, False)  # never raises, on any rank
    with pytest.raises(ca.ConfigError, match="SGLANG_SPEC_CAPTURE_GPU_PUT off") as e:
        sglang.maybe_init_sink(server_args())
    assert "MOONCAKE_PROTOCOL=nvlink always publishes from the device" in str(e.value)
    # Spelled as the core reads flags: "off" is 0 (before: anything but "1" was off, so "true"
    # under nvlink was refused as if it asked for host publication).
    arena_env.setenv("SGLANG_SPEC_CAPTURE_GPU_PUT", " Off ")
    with pytest.raises(ca.ConfigError, match="SGLANG_SPEC_CAPTURE_GPU_PUT off"):
        sglang.maybe_init_sink(server_args())
    # A value that is no flag stops the server with the variable named (before: taken as off).
    arena_env.setenv("SGLANG_SPEC_CAPTURE_GPU_PUT", "maybe")
    assert sglang.gpu_put_enabled() in (True, False)
    with pytest.raises(ca.ConfigError, match=r"SGLANG_SPEC_CAPTURE_GPU_PUT: \"maybe\" is not a flag"):
        sglang.maybe_init_sink(server_args())
    arena_env.setenv("SGLANG_SPEC_CAPTURE_GPU_PUT", "true")
    assert sglang.gpu_put_enabled() is True
    arena_env.delenv("SGLANG_SPEC_CAPTURE_GPU_PUT")
    arena_env.setenv("MOONCAKE_PROTOCOL", "tcp")
    assert sglang.gpu_put_enabled() is False
    arena_env.setenv("SGLANG_SPEC_CAPTURE_GPU_PUT", "1")
    # SpecForge's rule for the store: device publication needs RDMA.
    with pytest.raises(ca.ConfigError, match="needs MOONCAKE_PROTOCOL=rdma"):
        sglang.maybe_init_sink(server_args())
    arena_env.setenv("MOONCAKE_PROTOCOL", "rdma")
    assert sglang.gpu_put_enabled() is True
    arena_env.delenv("SGLANG_SPEC_CAPTURE_GPU_PUT")
    # Unset under rdma: on where torch sees CUDA (not on this machine), as upstream.
    assert sglang.gpu_put_enabled() is torch.cuda.is_available()
    arena_env.setenv("SGLANG_SPEC_CAPTURE_GPU_PUT", "0")
    assert sglang.gpu_put_enabled() is False
    arena_env.setenv("SGLANG_SPEC_CAPTURE_GPU_PUT", "yes")
    assert sglang.gpu_put_enabled() is True
    arena_env.setenv("SGLANG_SPEC_CAPTURE_GPU_PUT", "on")
    arena_env.setenv("MOONCAKE_PROTOCOL", "tcp")
    arena_env.setenv("SGLANG_SPEC_CAPTURE_PLACEMENT", "arena")
    assert sglang.gpu_put_enabled() is True
    sink = sglang.maybe_init_sink(server_args())
    assert sink is not None and sink.device_publication and sglang.gpu_put_enabled() is True


def test_exiting_while_the_first_capture_creates_the_arena_does_not_abort(arena_env):
    # The interpreter exits while the starter thread is still creating (pre-faulting) the arena:
    # the exit waits for it, fails what waited behind it, and removes the arena.
    import subprocess
    import sys

    code = r"""
import torch
from types import SimpleNamespace
from capture_arena import sglang
sink = sglang.maybe_init_sink(SimpleNamespace(enable_spec_capture=True, spec_capture_aux_layer_ids=None))
s = {"store_id": "st", "sample_id": "x", "gen": 1, "features": {"last_hidden": "target"}}
futs = [sink.submit_samples([(dict(s, sample_id=f"x{i}"), None, torch.zeros(4, 8))]) for i in range(2)]
print(sink.started, flush=True)
"""
    env = {**os.environ, "SGLANG_SPEC_CAPTURE_ARENA_BYTES": "1GiB"}
    pids = set()
    for _ in range(3):
        child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        pids.add(child.pid)
        try:
            _, err = child.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            child.kill()  # not left holding its 1 GiB arena beside the next test file
            child.communicate()
            raise
        assert child.returncode == 0, (child.returncode, err[-2000:])
    # Theirs only (an arena's name starts with its creator's pid): other tests may run beside.
    leftovers = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"capture-arena-{pid}-") for pid in pids)]
    assert leftovers == [], leftovers


def test_a_pending_batches_value_the_patch_cannot_read_stops_the_server_at_start(arena_env):
    """SpecForge's asynchronous patch reads SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES with int() at
    every batch. A blank value, which the core takes as unset, passed the start and then raised
    ValueError in the scheduler's loop at the first capture, ending the server."""
    for bad in ("", " ", "two", "0"):
        arena_env.setenv("SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES", bad)
        with pytest.raises(ca.ConfigError, match="SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES"):
            sglang.maybe_init_sink(server_args())
    arena_env.setenv("SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES", "3")
    assert sglang.maybe_init_sink(server_args()) is not None
