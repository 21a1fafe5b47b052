"""capture_arena.specforge driven by SpecForge's own trainer stack: ``specforge`` 0.2.0 from PyPI,
installed without its declared dependencies (they pin torch 2.11 and sglang 0.5.14; the modules
used here import only torch, which the test command installs): the adapter
(``SGLangServerCaptureAdapter``), the capture contract (``verify_capture_specs``), the
``FeatureStore`` ABC, ``FeatureDataLoader``, ``ref_to_dict``/``ref_from_dict`` and, for the store
placement side by side, ``MooncakeFeatureStore``. The tests name them "specforge". What stands
in: the SGLang server, here a producer process whose ``/generate`` publishes each request's
capture through capture-arena's real sink (as ``capture_arena.sglang`` does inside SGLang's
scheduler) and answers SGLang's row shape (``meta_info["spec_capture"]``). Everything else is
real: HTTP, the arena, the control port, trainers in other processes.

Where 0.2.0 differs from SpecForge's main (the commit these tests were first written against,
a6b6b023): its adapter asks for ``max_new_tokens: 0`` (main: 1), which the producer here ignores
(it captures the prompt either way); its ``MooncakeFeatureStore`` sets a soft pin where the
client has no hard pin, and its removals retry 40 x 0.5 s (main: 8 x 0.25 s); neither is on a
path these tests take.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/test.sh installs it)")

pytest.importorskip("specforge", reason="specforge is not installed (scripts/test.sh installs specforge==0.2.0)")

from specforge.inference.adapters.server_capture import (  # noqa: E402
    ServerCaptureFailure,
    ServerCaptureSchema,
    SGLangServerCaptureAdapter,
)
from specforge.inference.capture import CaptureConfig  # noqa: E402
from specforge.runtime.contracts import PromptTask, SampleRef  # noqa: E402
from specforge.runtime.data_plane.ref_serialization import ref_to_dict  # noqa: E402

import capture_arena as ca  # noqa: E402
from mooncake_master import needs_mooncake  # noqa: E402
from capture_arena.specforge import SpecForgeArenaStore  # noqa: E402

H = 64  # hidden size; aux is 3 layers wide
AUX_LAYERS = (2, 5, 8)

COMMON = r"""
import zlib, numpy as np, ml_dtypes
H, K = 64, 3
def data(sample_id, shape, salt):
    rng = np.random.default_rng(zlib.crc32(f"{sample_id}/{salt}".encode()))
    return rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)
"""

# The capture server: SGLang's /generate reduced to the capture (see the module docs). POST
# /mode {"drop": true} makes it publish and then close the connection without an answer (a
# response lost after the server wrote); GET /stats answers the sink's stats and control endpoint.
PRODUCER = COMMON + r"""
import json, sys, threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import SimpleNamespace
import capture_arena as ca
from capture_arena import sglang
sink = sglang.maybe_init_sink(SimpleNamespace(enable_spec_capture=True, spec_capture_aux_layer_ids="2,5,8"))
# A server that captures on the request's thread, as a synchronous patch does: its arena (or
# store connection) exists before the first request (SGLang makes it in the background at start).
if isinstance(sink, ca.ArenaSink):
    sink._ensure_started()
mode = {"drop": False}
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def answer(self, obj):
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self.answer({"stats": sink.stats(), "control": getattr(sink, "control", None)})
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/mode":
            mode.update(req)
            return self.answer({})
        if self.path == "/exists":  # the store placement: are these keys still in the store?
            return self.answer([int(sink._store.is_exist(k)) for k in req["keys"]])
        batch = [(spec, data(spec["sample_id"], (len(ids), K * H), "aux"), data(spec["sample_id"], (len(ids), H), "last"))
                 for ids, spec in zip(req["input_ids"], req["spec_capture"])]
        rows = [{"meta_info": {"spec_capture": r}} for r in sink.put_samples(batch)]
        if mode["drop"]:
            self.close_connection = True
            return
        self.answer(rows)
srv = HTTPServer(("127.0.0.1", 0), Handler)
print(json.dumps({"port": srv.server_address[1]}), flush=True)
threading.Thread(target=srv.serve_forever, daemon=True).start()
sys.stdin.read()
srv.shutdown()
sink.close()
"""

# A trainer process: SpecForge's FeatureDataLoader over a SpecForgeArenaStore of its own, fed the
# refs as SpecForge serializes them; checks every byte, replays one released ref, drains.
LOADER = COMMON + r"""
import json, sys, torch
from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
from specforge.runtime.data_plane.ref_serialization import ref_from_dict
from capture_arena.specforge import SpecForgeArenaStore
refs = [ref_from_dict(json.loads(line)) for line in sys.stdin]
store = SpecForgeArenaStore(store_id=sys.argv[1])
loader = FeatureDataLoader(store, refs=refs, batch_size=1, strategy="eagle3")
checked = 0
for batch in loader:
    (sid,) = batch.sample_ids
    t = batch.tensors
    L = t["input_ids"].shape[-1]
    assert t["input_ids"].flatten().tolist() == list(range(L)), sid
    for name, salt, width in (("hidden_state", "aux", K * H), ("target", "last", H)):
        got = t[name].contiguous().view(torch.int16).numpy().tobytes()
        assert tuple(t[name].shape) == (1, 1, L, width) and got == data(sid, (L, width), salt).tobytes(), (sid, name)
    checked += 1
try:
    store.get(refs[0])
    replay = "read"
except KeyError as e:
    replay = type(e).__name__
store.drain_pending_removals(max_attempts=20)
print(json.dumps({"checked": checked, "replay": replay, "health": store.health()}), flush=True)
"""


class Producer:
    """The capture server process (see PRODUCER)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", PRODUCER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.p.stdout is not None
        self.url = f"http://127.0.0.1:{json.loads(self.p.stdout.readline())['port']}"

    def get(self) -> dict[str, Any]:
        import urllib.request

        with urllib.request.urlopen(self.url + "/stats", timeout=10) as r:
            return json.loads(r.read())

    def post(self, path: str, body: Any) -> Any:
        import urllib.request

        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def mode(self, **kw: Any) -> None:
        self.post("/mode", kw)

    def wait_free(self, timeout: float = 20.0) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        while True:
            s = self.get()["stats"]
            if s.get("resident_objects", 0) == 0 or time.monotonic() > deadline:
                return s
            time.sleep(0.05)

    def close(self) -> None:
        if self.p.stdin:
            self.p.stdin.close()
        try:
            self.p.wait(timeout=30)
        finally:
            self.p.kill()


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("MOONCAKE_", "SGLANG_SPEC_CAPTURE_", "MC_"))}


@pytest.fixture
def producer(request: pytest.FixtureRequest) -> Iterator[Producer]:
    env = clean_env()
    env.update({"SGLANG_SPEC_CAPTURE_PLACEMENT": "arena", "SGLANG_SPEC_CAPTURE_ARENA_BYTES": "16MiB", "SGLANG_SPEC_CAPTURE_ARENA_WAIT_S": "10"})
    transport = getattr(request, "param", "shm")
    if transport == "nixl":
        if "nixl" not in ca.FEATURES:
            pytest.skip("this build of capture_arena has no nixl feature (scripts/test.sh builds it)")
        env.update({"SGLANG_SPEC_CAPTURE_TRANSPORT": "nixl", "UCX_TLS": "tcp"})
        if "SGLANG_SPEC_CAPTURE_NIXL_LIB" in os.environ:
            env["SGLANG_SPEC_CAPTURE_NIXL_LIB"] = os.environ["SGLANG_SPEC_CAPTURE_NIXL_LIB"]
    p = Producer(env)
    try:
        yield p
    finally:
        p.close()


def schema() -> ServerCaptureSchema:
    return ServerCaptureSchema(aux_feature="hidden_state", last_hidden_feature="target", passthrough=(("input_ids", "input_ids", ()),))


def capture(hidden: int = H) -> CaptureConfig:
    return CaptureConfig.from_strategy({"hidden_state", "target", "input_ids"}, AUX_LAYERS, target_repr="hidden_state", target_hidden_size=hidden)


def tasks(n: int, tag: str = "t") -> list[PromptTask]:
    return [
        PromptTask(task_id=f"{tag}{i}", run_id="run", source_id="src", payload={"input_ids": list(range(40 + 17 * i))}, max_length=4096)
        for i in range(n)
    ]


def adapter(producer: Producer, store: SpecForgeArenaStore) -> SGLangServerCaptureAdapter:
    return SGLangServerCaptureAdapter(producer.url, store, run_id="run", algorithm="eagle3", schema=schema(), timeout_s=30, post_fn=store.post_fn())


@pytest.mark.parametrize("producer", ["shm", "nixl"], indirect=True)
def test_specforge_adapter_and_loader_read_every_arena_sample_in_another_process_and_free_it(producer: Producer) -> None:
    store = SpecForgeArenaStore(store_id="run1")
    refs = adapter(producer, store).produce_refs(tasks(6), capture=capture())
    assert all(isinstance(r, SampleRef) for r in refs), refs
    # The refs carry the results through SpecForge's own serialization.
    lines = "".join(json.dumps(ref_to_dict(r)) + "\n" for r in refs)
    sessions = {r.metadata["capture_arena"]["arena"]["session"].split("://")[0] for r in refs}
    assert sessions <= {"shm", "nixl"} and len(sessions) == 1, sessions
    env = {**os.environ, "UCX_TLS": "tcp"}
    out = subprocess.run([sys.executable, "-c", LOADER, "run1"], input=lines, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["checked"] == 6 and got["replay"] == "ReleasedError", got
    assert got["health"]["release_pending"] == 0 and got["health"]["dropped_frees"] == 0, got
    stats = producer.wait_free()
    assert stats["resident_objects"] == 0 and stats["freed_objects"] == stats["published_objects"] == 18, stats
    h = store.health()
    assert h["resident_samples"] == 6 and h["provisional_external"] == 0 and h["backend"] == "capture-arena", h


@needs_mooncake
def test_specforge_adapter_and_loader_read_and_free_store_placement_samples() -> None:
    """The same trainer stack over the store placement (the Mooncake store, a real master): read
    through capture-arena's store reader, removed from the store on release."""
    import mooncake_master

    master, menv = mooncake_master.start()
    env = {**clean_env(), **menv, "MOONCAKE_GLOBAL_SEGMENT_SIZE": "48MiB", "MOONCAKE_LOCAL_BUFFER_SIZE": "16MiB", "GLOG_minloglevel": "2"}
    prod = Producer({**env, "SGLANG_SPEC_CAPTURE_PLACEMENT": "store"})
    try:
        store = SpecForgeArenaStore(store_id="st1")
        refs = adapter(prod, store).produce_refs(tasks(4, "st"), capture=capture())
        assert all(isinstance(r, SampleRef) for r in refs), refs
        keys = [f"st1/{r.sample_id}/g1/{n}" for r in refs for n in ("hidden_state", "target", "input_ids")]
        assert prod.post("/exists", {"keys": keys}) == [1] * 12
        lines = "".join(json.dumps(ref_to_dict(r)) + "\n" for r in refs)
        out = subprocess.run(
            [sys.executable, "-c", LOADER, "st1"], input=lines, env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.splitlines()[-1])
        assert got["checked"] == 4 and got["replay"] == "ReleasedError" and got["health"]["release_pending"] == 0, got
        assert prod.post("/exists", {"keys": keys}) == [0] * 12
    finally:
        prod.close()
        mooncake_master.stop(master)


def test_specforge_adapter_frees_what_fails_its_contract_and_what_lost_its_response(producer: Producer) -> None:
    store = SpecForgeArenaStore(store_id="run2")
    ad = adapter(producer, store)
    # The contract check fails every sample (the trainer expects another hidden size): the
    # adapter adopts and aborts each, and each leaves the arena.
    out = ad.produce_refs(tasks(3, "bad"), capture=capture(hidden=H * 2))
    assert all(isinstance(r, ServerCaptureFailure) and not r.retryable for r in out), out
    assert producer.wait_free()["resident_objects"] == 0
    # A response lost after the server published: the adapter raises, and SpecForge's cleanup
    # (discard_external_attempts) frees the attempts by prefix at the endpoint learned above.
    producer.mode(drop=True)
    with pytest.raises(Exception):
        ad.produce_refs(tasks(2, "lost"), capture=capture())
    producer.mode(drop=False)
    assert producer.get()["stats"]["resident_objects"] == 6
    assert store.health()["provisional_external"] == 2
    assert store.discard_external_attempts() == 2
    store.drain_pending_removals()
    assert producer.wait_free()["resident_objects"] == 0
    assert store.health()["provisional_external"] == 0
    # The same with a store that never saw a result: it needs the endpoint given.
    fresh = SpecForgeArenaStore(store_id="run2")
    fresh_ad = adapter(producer, fresh)
    producer.mode(drop=True)
    with pytest.raises(Exception):
        fresh_ad.produce_refs(tasks(1, "lost2"), capture=capture())
    producer.mode(drop=False)
    with pytest.raises(RuntimeError, match="controls="):
        fresh.discard_external_attempts()
    control = producer.get()["control"]
    told = SpecForgeArenaStore(store_id="run2", controls=[control])
    told.track_external_attempt("run:lost20", generation=1, feature_names=["hidden_state", "target", "input_ids"])
    assert told.discard_external_attempts() == 1
    told.drain_pending_removals()
    assert producer.wait_free()["resident_objects"] == 0


def test_specforge_lifecycle_abort_gc_and_release_each_free_the_sample(producer: Producer) -> None:
    store = SpecForgeArenaStore(store_id="run3", max_hold_age_s=60.0)
    refs = adapter(producer, store).produce_refs(tasks(4, "life"), capture=capture())
    assert producer.get()["stats"]["resident_objects"] == 12
    # release: the last lease of the generation frees it; a second read is refused.
    tensors, handle = store.get(refs[0])
    _, handle2 = store.get(refs[0])
    store.release(handle)
    assert store.health()["active_leases"] == 1
    store.release(handle2)
    with pytest.raises(KeyError):
        store.get(refs[0])
    # abort of a sample this process tracks.
    store.abort(refs[1].sample_id, reason="test")
    # abort of a sample a restarted controller never saw: by prefix at the endpoint it is given.
    restarted = SpecForgeArenaStore(store_id="run3", controls=[producer.get()["control"]])
    restarted.abort(refs[2].sample_id, reason="reconciled-released")
    restarted.drain_pending_removals()
    # gc: held past max-hold and not leased.
    assert store.gc()["force_freed"] == 0
    freed = store.gc(now=time.monotonic() + 3600)
    assert freed["force_freed"] == 2, freed  # refs[2] (freed elsewhere) and refs[3]
    store.drain_pending_removals()
    stats = producer.wait_free()
    assert stats["resident_objects"] == 0 and stats["freed_objects"] == stats["published_objects"], stats
    h = store.health()
    assert h["resident_samples"] == 0 and h["active_leases"] == 0 and h["force_freed_total"] == 2, h


@pytest.fixture
def dead() -> Iterator[str]:
    """A control endpoint that does not answer: a listener whose backlog is full, so connections
    to it hang (SYN unanswered), as to a host that is down."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(0)
    held = []
    for _ in range(8):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(lst.getsockname())
        held.append(s)
    yield "%s:%d" % lst.getsockname()
    for s in held:
        s.close()
    lst.close()


def test_specforge_drain_is_bounded_when_an_endpoint_does_not_answer(producer: Producer, dead: str) -> None:
    store = SpecForgeArenaStore(store_id="run4", controls=[dead])
    t0 = time.monotonic()
    store.abort("run:never-seen", reason="test")  # queued: never waits on the network
    # Waiting on the network would cost a connect to the full backlog: the 5 s connect timeout.
    assert time.monotonic() - t0 < 5.0
    with pytest.raises(RuntimeError, match="could not deliver 1 frees"):
        store.drain_pending_removals(max_attempts=3, retry_interval_s=0.2)
    assert time.monotonic() - t0 < 20
    assert store.health()["release_pending"] == 1


def test_a_ref_without_a_capture_arena_result_is_refused_with_what_to_do() -> None:
    store = SpecForgeArenaStore(store_id="run5")
    ref = SampleRef(
        sample_id="run:x", run_id="run", source_task_id="x", feature_store_uri="mooncake://run5/run:x",
        feature_keys={"target": "run:x/target"}, feature_specs={}, strategy="eagle3", metadata={"generation": 1},
    )
    with pytest.raises(ValueError, match="post_fn=store.post_fn"):
        store.adopt(ref)
    with pytest.raises(KeyError):
        store.get(ref)
    with pytest.raises(NotImplementedError):
        store.put({}, sample_id="x", metadata={})
    # A result of another sample in the ref is refused, never read.
    other = dict(ref.metadata, capture_arena={"store_id": "run5", "sample_id": "run:y", "gen": 1, "features": {"target": {}}})
    ref2 = SampleRef(**{**ref.__dict__, "metadata": other})
    with pytest.raises(KeyError, match="carries the result of"):
        store.get(ref2)
    assert isinstance(store, __import__("specforge.runtime.data_plane.feature_store", fromlist=["FeatureStore"]).FeatureStore)
    assert ca.ArenaFeatureStore  # the package itself never imports SpecForge


@pytest.mark.parametrize(
    "shape", [[2**63 - 1] * 40000, [2**62, 4], ["9" * 5000], [1.5, 2], None, [-1]], ids=["40000_huge_dims", "overflowing", "string", "float", "none", "negative"]
)
def test_a_record_whose_feature_shape_is_not_one_is_refused_at_adopt_before_any_arithmetic(shape: Any) -> None:
    # A record's shapes were multiplied out before anything checked them, under the store's
    # lock: 52,000 dimensions of 2**63 - 1 (1 MiB of record) held it 7 s, and a string or
    # None raised out of adopt with the sample half tracked. Now such a result is refused.
    # (40,000: a record over MAX_RESULT_BYTES, 1 MiB as JSON, is not even recorded.)
    store = SpecForgeArenaStore(store_id="run9")
    result = {"store_id": "run9", "sample_id": "run:s", "gen": 1, "features": {"target": {"shape": shape, "dtype": "bfloat16", "address": 0}}}
    store.record_result(result)
    ref = SampleRef(
        sample_id="run:s", run_id="run", source_task_id="s", feature_store_uri="mooncake://run9/run:s",
        feature_keys={"target": "run:s/target"}, feature_specs={}, strategy="eagle3", metadata={"generation": 1},
    )  # fmt: skip
    with pytest.raises(KeyError, match="has no shape of at most 8 dimensions"):
        store.adopt(ref)
    assert store.health()["resident_samples"] == 0


def test_what_results_may_cost_a_store_is_bounded_before_they_are_recorded(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Results are outside input (a /generate response, a live record). A 2 MB sample id, a
    result of 2 MiB, an id of 1025 bytes, 257 features, a control endpoint longer than the core
    takes (300 bytes) and a token of a lone surrogate cost only themselves: the first four are
    not recorded (the log says why, and their endpoint is learned so that abort frees them by
    prefix), the long endpoint is not learned, the token is not taken, and no call raises. What
    is recorded is bounded in bytes in all (MAX_RECORDED_BYTES, 3 MiB here): the oldest go
    beyond it. Before: all recorded whole (65,536 results of any size), the endpoint learned,
    and the token raised UnicodeEncodeError out of record_result."""
    from capture_arena import specforge as sf

    monkeypatch.setattr(sf, "MAX_RECORDED_BYTES", 3 << 20)
    monkeypatch.setattr(sf, "_REFUSED", sf.Warnings())  # none earlier holds this one back
    store = SpecForgeArenaStore(store_id="run11")

    def result(sid: str, control: str = "127.0.0.1:9", **more: Any) -> dict[str, Any]:
        return {"store_id": "run11", "sample_id": sid, "gen": 1, "arena": {"session": "shm://x", "control": control},
                "features": {"target": {"shape": [1, 2], "dtype": "int64", "address": 4096, "stamp": 7}}, **more}  # fmt: skip

    with caplog.at_level(logging.WARNING, logger="capture_arena"):
        store.record_result(result("x" * (2 << 20)))
    assert any("was not recorded (its sample_id is 2097152 bytes, over the 1024" in r.getMessage() for r in caplog.records), caplog.text[-2000:]
    store.record_result(result("padded", padding="p" * (2 << 20)))
    store.record_result(result("y" * 1025))
    store.record_result({**result("wide"), "features": {f"f{i}": {} for i in range(257)}})
    store.record_result(result("long-endpoint", "h" * 300 + ":1"))
    store.record_result({**result("bad-token"), "arena": {"session": "shm://x", "control": "127.0.0.1:10", "token": "\ud800"}})
    h = store.health()
    assert h["tracked_results"] == 2 and h["control_endpoints"] == 2, h  # long-endpoint and bad-token; :9 and :10
    assert store._endpoints["127.0.0.1:10"] is None  # learned, its token not
    for i in range(6):  # 900 KB each: three fit in 3 MiB
        store.record_result(result(f"big{i}", padding="p" * 900_000))
    assert store._recorded.bytes <= 3 << 20 and list(store._recorded) == [(f"big{i}", 1) for i in (3, 4, 5)], (store._recorded.bytes, list(store._recorded))


def test_a_response_of_refused_results_neither_goes_past_its_request_nor_evicts_the_endpoints_a_caller_named() -> None:
    """A response's refused results (this store's, not recordable) each taught the store their
    endpoint with no bound: one response of 5,000 named as many endpoints and pushed out the
    oldest 4,096 known, the ones given as controls= first, so that aborts and discards went to
    junk endpoints (found by an outside reading). Now a response counts as many results as its
    request asked for, refused ones too, and named endpoints are never pushed out."""
    from capture_arena import specforge as sf

    store = SpecForgeArenaStore(store_id="run12", controls=["10.9.9.9:7000"])
    junk = [{"store_id": "run12", "sample_id": f"s{i}", "arena": {"control": f"10.0.{i // 250}.{i % 250}:1"}, "features": {}} for i in range(5000)]
    store._record([{"meta_info": {"spec_capture": junk}}], {"spec_capture": [{"sample_id": "s0"}]})
    assert list(store._endpoints) == ["10.9.9.9:7000", "10.0.0.0:1"], list(store._endpoints)[:4]
    for i in range(sf.MAX_ENDPOINTS + 10):
        store._learn(f"10.1.{i // 250}.{i % 250}:1", None)
    assert len(store._endpoints) == sf.MAX_ENDPOINTS and "10.9.9.9:7000" in store._endpoints


def test_the_default_post_ends_at_its_timeout_however_slowly_the_server_answers() -> None:
    # SpecForge's post to the capture server (/generate), made by post_fn when it is given no
    # post of its own. urlopen bounds each read, not the call: a server sending its answer a
    # byte every 0.2 s held the trainer for good. Now the call ends at its timeout.
    from intake import call_within, stalling_server

    port, stop = stalling_server("body")
    post = SpecForgeArenaStore(store_id="run10").post_fn()
    err, took = call_within(lambda: post(f"http://127.0.0.1:{port}/generate", json_body={"text": "x"}, timeout=1.0), 10, stop)
    assert isinstance(err, TimeoutError) and "within 1 s" in str(err), err
    assert 1.0 <= took < 5.0, took  # never ended before: room for a loaded machine's late wake-ups


def test_the_default_posts_failure_to_connect_says_why_in_its_message() -> None:
    # SpecForge reports a failed post by str(exc): the reason it did not connect (refused,
    # timed out, a name that does not resolve) was in __cause__ only, and the message said just
    # "connecting to http://...".
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    post = SpecForgeArenaStore(store_id="run10").post_fn()
    with pytest.raises(OSError, match="Connection refused"):
        post(f"http://127.0.0.1:{port}/generate", json_body={"text": "x"}, timeout=2.0)


def test_post_fn_never_raises_for_what_it_cannot_use_and_records_only_this_stores_results() -> None:
    """A response the store cannot use costs only the samples in it: post_fn hands it back
    unchanged, records nothing from it, and those samples' adopt() says what to do."""
    store = SpecForgeArenaStore(store_id="run6")
    good = {"store_id": "run6", "sample_id": "run:ok", "gen": 1, "features": {"target": {"shape": [1, 2], "dtype": "int64", "address": 4096, "stamp": 7}},
            "arena": {"session": "shm://x", "control": "127.0.0.1:9"}}
    deep: Any = []
    for _ in range(5000):
        deep = [deep]
    responses = [
        None,
        "not rows",
        [{"meta_info": "not a dict"}],
        [{"meta_info": {"spec_capture": {"error": "arena full", "sample_id": "run:e"}}}],
        [{"meta_info": {"spec_capture": {**good, "store_id": "another"}}}],
        [{"meta_info": {"spec_capture": {**good, "gen": "x"}}}],
        deep,
        [{"meta_info": {"spec_capture": [good, good, good]}}],  # more results than asked for
    ]
    body = {"spec_capture": [{"sample_id": "run:ok"}]}
    for rows in responses:
        post = store.post_fn(lambda url, json_body, timeout, rows=rows: rows)
        assert post("http://x/generate", json_body=body, timeout=1.0) is rows
    h = store.health()
    assert h["control_endpoints"] == 1 and h["resident_samples"] == 0, h
    # Only the one result of this store that the request asked for was recorded.
    ref = SampleRef(
        sample_id="run:ok", run_id="run", source_task_id="ok", feature_store_uri="mooncake://run6/run:ok",
        feature_keys={"target": "run:ok/target"}, feature_specs={}, strategy="eagle3", metadata={"generation": 1},
    )
    store.adopt(ref)
    assert ref.metadata["capture_arena"]["sample_id"] == "run:ok"
    bad = SampleRef(**{**ref.__dict__, "sample_id": "run:e", "metadata": {"generation": 1}})
    with pytest.raises(ValueError, match="post_fn"):
        store.adopt(bad)


def _published(sink: ca.ArenaSink, store_id: str, n: int, tag: str) -> list[dict[str, Any]]:
    import numpy as np

    rows = sink.put_samples(
        [({"store_id": store_id, "sample_id": f"{tag}{i}", "features": {"aux": "h"}}, np.full((4, 8), i, np.float32), None) for i in range(n)]
    )
    assert all("error" not in r for r in rows), rows
    return rows


def _adopted(store: SpecForgeArenaStore, rows: list[dict[str, Any]]) -> list[SampleRef]:
    refs = []
    for r in rows:
        ref = SampleRef(
            sample_id=r["sample_id"], run_id="run", source_task_id=r["sample_id"], feature_store_uri=f"mooncake://{r['store_id']}/{r['sample_id']}",
            feature_keys={"h": f"{r['sample_id']}/h"}, feature_specs={}, strategy="eagle3", metadata={"generation": 1},
        )  # fmt: skip
        store.record_result(r)
        store.adopt(ref)
        refs.append(ref)
    return refs


def test_a_reader_that_reads_a_newer_generation_of_a_sample_it_tracks_frees_both(make_sink: Any) -> None:
    """A trainer's store (it adopts nothing: it tracks what it reads) that read g1 of a sample,
    then g2 of it (re-captured), tracked g1 alone: releasing g2 freed nothing, and g2's objects
    stayed resident for good (found by an outside reading). The newer generation supersedes the
    one tracked now, as an adopt's does."""
    import numpy as np

    sink = make_sink()
    rows = sink.put_samples(
        [({"store_id": "gens", "sample_id": "s", "gen": g, "features": {"aux": "h"}}, np.full((4, 8), g, np.float32), None) for g in (1, 2)]
    )
    assert all("error" not in r for r in rows), rows
    trainer = SpecForgeArenaStore(store_id="gens")
    handles = []
    for r in rows:
        ref = SampleRef(
            sample_id="s", run_id="run", source_task_id="s", feature_store_uri="mooncake://gens/s",
            feature_keys={"h": "s/h"}, feature_specs={}, strategy="eagle3", metadata={"generation": r["gen"], "capture_arena": r},
        )  # fmt: skip
        got, handle = trainer.get(ref)
        assert float(got["h"][0, 0, 0]) == r["gen"]
        handles.append(handle)
    for handle in reversed(handles):
        trainer.release(handle)
    trainer.drain_pending_removals(max_attempts=40)
    deadline = time.monotonic() + 10
    while sink.stats()["resident_objects"] != 0:
        assert time.monotonic() < deadline, sink.stats()
        time.sleep(0.01)


def test_a_controller_without_the_producers_token_is_told_its_frees_were_refused(make_sink: Any) -> None:
    """abort() of samples a controller never saw goes by prefix; a producer with a control token
    refuses a controller that has none: drain and health say so instead of reporting success, and
    the token (learned later) gets the frees through."""
    sink = make_sink(control_token="auto")
    rows = _published(sink, "tok", 3, "s")
    token = rows[0]["arena"]["token"]
    controller = SpecForgeArenaStore(store_id="tok", controls=[sink.control])  # no token
    for r in rows:
        controller.abort(r["sample_id"], reason="reconciled")
    # The first try came back refused (refused ones count as such between their back-off's
    # tries): the drain's error can say why whatever its few short waits (3 x 0.2 s) cover.
    deadline = time.monotonic() + 10
    while (h := controller.health())["refused_frees"] != 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="missing token") as e:
        controller.drain_pending_removals(max_attempts=3, retry_interval_s=0.2)
    assert "could not deliver 3 frees" in str(e.value)
    while (h := controller.health())["refused_frees"] != 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert h["release_pending"] == 3 and h["refused_frees"] == 3 and h["dropped_frees"] == 0, h
    assert sink.stats()["resident_objects"] == 3, "nothing was freed"
    assert sink.unauthorized_peers()[0]["reason"] == "missing token"
    # A result carrying the token teaches it to the controller: the refused frees go through.
    controller.record_result(_published(sink, "tok", 1, "late")[0])
    controller.drain_pending_removals(max_attempts=40, retry_interval_s=0.5)
    h = controller.health()
    assert h["release_pending"] == 0 and h["refused_frees"] == 0, h
    deadline = time.monotonic() + 10
    while sink.stats()["resident_objects"] != 1:  # the late one is still held
        assert time.monotonic() < deadline, sink.stats()
        time.sleep(0.01)
    assert token == controller._endpoints[sink.control]


def test_a_bad_endpoint_token_or_gen_in_a_result_costs_only_its_own_frees(make_sink: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Results are outside input: one naming an endpoint no socket can take (a lone surrogate and
    a line of its own), one with a token that is not one for a real producer's endpoint, one with
    an infinite gen. The prefix sender drops the bad endpoint's frees alone and lives on; the real
    endpoint keeps its token; the record is ignored. The log names the bad endpoint escaped: a
    UTF-8 handler can write it, and it forges no line."""
    caplog.set_level(logging.DEBUG, logger="capture_arena")
    sink = make_sink(control_token="auto")
    rows = _published(sink, "bad", 3, "s")
    controller = SpecForgeArenaStore(store_id="bad", controls=[sink.control])
    controller.record_result(rows[0])  # the producer's token, learned
    forged = {**rows[0], "sample_id": "forged"}
    controller.record_result({**forged, "arena": {**rows[0]["arena"], "control": "\ud800\nforged line:1"}})
    controller.record_result({**forged, "sample_id": "f2", "arena": {**rows[0]["arena"], "token": "x"}})
    controller.record_result({**forged, "sample_id": "f3", "gen": float("inf")})  # ignored, never raised
    controller.abort("s1", reason="reconciled")  # never recorded: by prefix, at both endpoints
    controller.drain_pending_removals(max_attempts=20, retry_interval_s=0.2)
    controller.abort("s2", reason="reconciled")  # the sender still runs
    controller.drain_pending_removals(max_attempts=20, retry_interval_s=0.2)
    h = controller.health()
    assert h["release_pending"] == 0 and h["dropped_frees"] == 2 and h["refused_frees"] == 0, h
    deadline = time.monotonic() + 10
    while sink.stats()["resident_objects"] != 1:  # s0 is still held
        assert time.monotonic() < deadline, sink.stats()
        time.sleep(0.01)
    assert sink.stats()["unauthorized_lines"] == 0
    said = [r.getMessage() for r in caplog.records if r.name.startswith("capture_arena")]
    assert any("\\ud800\\nforged line:1" in m for m in said), said
    for m in said:
        m.encode("utf-8")  # a lone surrogate would raise here, as in a UTF-8 file handler
        assert "\n" not in m, m


def test_a_controller_without_the_token_connects_at_the_rate_its_back_off_allows_through_specforges_drains(make_sink: Any) -> None:
    """SpecForge's abort-and-drain against a token-protected producer, from a controller given
    its control endpoint but no token: every try is refused, and each is a connection the
    producer's writer thread serves. The tries follow one back-off per endpoint (100 ms doubling),
    whatever the drains ask: before, each drain's short waits reset it, and one abort and drain
    made 9,013 to 19,464 refused connections in a few seconds."""
    import math

    from specforge.runtime.data_plane.feature_store import drain_feature_store_removals, drain_feature_store_sample_removals

    sink = make_sink(control_token="auto")
    rows = _published(sink, "rate", 3, "s")
    controller = SpecForgeArenaStore(store_id="rate", controls=[sink.control])  # no token
    before = sink.stats()["unauthorized_lines"]
    t0 = time.monotonic()
    ids = [r["sample_id"] for r in rows]
    for sid in ids:
        controller.abort(sid, reason="reconciled")
    deadline = time.monotonic() + 10  # refused once (the back-off, not this wait, paces the tries)
    while controller.health()["refused_frees"] == 0:
        assert time.monotonic() < deadline, "the producer never refused the frees"
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="missing token"):
        drain_feature_store_sample_removals(controller, ids)  # SpecForge's 8 x 0.25 s
    with pytest.raises(RuntimeError, match="missing token"):
        drain_feature_store_removals(controller, max_attempts=4, retry_interval_s=0.25)
    took = time.monotonic() - t0
    refused = sink.stats()["unauthorized_lines"] - before
    # Tries at 0, 0.1, 0.3, 0.7, 1.5, 3.1 s...: 1 + log2(T / 0.1 s + 1) in T seconds, all three
    # prefixes in each (one connection), and one residency question (every 10 s at most).
    bound = 1 + int(math.log2(took / 0.1 + 1)) + 1
    assert 1 <= refused <= bound, f"{refused} refused connections in {took:.1f} s (bound {bound})"
    assert sink.stats()["resident_objects"] == 3
    # The token, learned from a result, gets them through at once.
    controller.record_result(_published(sink, "rate", 1, "late")[0])
    drain_feature_store_removals(controller, max_attempts=40, retry_interval_s=0.25)
    deadline = time.monotonic() + 10
    while sink.stats()["resident_objects"] != 1:
        assert time.monotonic() < deadline, sink.stats()
        time.sleep(0.01)


def test_a_controllers_memory_forgets_samples_freed_elsewhere_and_stays_within_its_bounds(make_sink: Any) -> None:
    sink = make_sink()
    controller = SpecForgeArenaStore(store_id="mem")
    refs = _adopted(controller, _published(sink, "mem", 12, "a"))
    assert controller.health()["tracked_results"] == 12
    # Trainers in other stores (processes) read and free every one of them.
    from specforge.runtime.data_plane.ref_serialization import ref_from_dict

    trainer = SpecForgeArenaStore(store_id="mem")
    for ref in refs:
        _, handle = trainer.get(ref_from_dict(ref_to_dict(ref)))
        trainer.release(handle)
    trainer.drain_pending_removals(max_attempts=40)
    assert sink.stats()["resident_objects"] == 0
    # The controller learns it from the producer: gc() asks it (in the background, at most every
    # 10 s: each call here is "10 s later") which of this store's samples it still holds.
    deadline = time.monotonic() + 20
    later = 0.0
    while controller.health()["tracked_results"]:
        assert time.monotonic() < deadline, controller.health()
        later += 10.0
        controller.gc(now=time.monotonic() + later)
        time.sleep(0.05)
    assert controller.health()["forgotten_total"] == 12
    # Still resident samples are kept; a read that finds one freed elsewhere forgets it.
    kept = _adopted(controller, _published(sink, "mem", 2, "b"))
    controller.gc(now=time.monotonic() + later + 60)
    h = controller.health()
    assert h["tracked_results"] == 2, h
    gone = kept[0]
    _, handle = trainer.get(ref_from_dict(ref_to_dict(gone)))
    trainer.release(handle)
    trainer.drain_pending_removals(max_attempts=40)
    with pytest.raises(KeyError):
        controller.get(gone)
    assert controller.health()["tracked_results"] == 1
    # A bound on count: the oldest beyond it are forgotten, not freed.
    small = SpecForgeArenaStore(store_id="mem", max_tracked=3)
    _adopted(small, _published(sink, "mem", 5, "c"))
    assert small.health()["tracked_results"] == 3 and small.health()["forgotten_total"] == 2
    assert sink.stats()["resident_objects"] == 1 + 5, "forgetting frees nothing"
    ca.ArenaFeatureStore.reclaim(sink.control, prefixes=["mem/"])


def test_a_controller_forgets_results_older_than_forget_after_s_and_frees_nothing(make_sink: Any) -> None:
    """``forget_after_s`` (24 h by default, never less than ``max_hold_age_s``): a tracked result
    older than it is forgotten, not freed, and one just younger is kept. Documented in the
    module and docs/specforge.md, and held by no test before (HARDENING's list)."""
    sink = make_sink()
    assert SpecForgeArenaStore(store_id="x").forget_after_s == 24 * 3600
    assert SpecForgeArenaStore(store_id="x", forget_after_s=10, max_hold_age_s=100).forget_after_s == 100
    clock = [1000.0]
    store = SpecForgeArenaStore(store_id="age", clock=lambda: clock[0], forget_after_s=60)
    _adopted(store, _published(sink, "age", 2, "old"))
    clock[0] += 30
    _adopted(store, _published(sink, "age", 1, "young"))
    store.gc(now=1000.0 + 60)  # the old ones are exactly 60 s old: kept
    assert store.health()["tracked_results"] == 3, store.health()
    store.gc(now=1000.0 + 60.5)
    h = store.health()
    assert h["tracked_results"] == 1 and h["forgotten_total"] == 2, h
    # Forgetting frees nothing: nothing forced out, nothing queued to be sent.
    assert h["force_freed_total"] == 0 and h["release_pending"] == 0 and sink.stats()["resident_objects"] == 3, h
    ca.ArenaFeatureStore.reclaim(sink.control, prefixes=["age/"])


def test_abort_at_the_optimizer_boundary_of_samples_released_already_sends_nothing(producer: Producer, dead: str) -> None:
    """SpecForge's DP acknowledgement aborts every sample of an optimizer window, then drains
    them (``drain_feature_store_sample_removals``); most were released by the loader already.
    Before, each such abort went by prefix to every known endpoint: with one endpoint that does
    not answer, every drain raised, and SpecForge ends the run on it."""
    from specforge.runtime.data_plane.feature_store import drain_feature_store_sample_removals

    store = SpecForgeArenaStore(store_id="run9", controls=[dead])
    refs = adapter(producer, store).produce_refs(tasks(2, "ack"), capture=capture())
    for ref in refs:
        _, handle = store.get(ref)
        store.release(handle)
    ids = [r.sample_id for r in refs]
    for sid in ids:
        store.abort(sid, reason="optimizer-boundary-durable-ack")
    drain_feature_store_sample_removals(store, ids)  # SpecForge's own bounds (8 x 0.25 s)
    stats = producer.wait_free()
    assert stats["resident_objects"] == 0, stats
    assert store.health()["release_pending"] == 0, store.health()


def test_a_windows_drain_waits_for_its_own_samples_frees_never_for_a_dead_hosts(producer: Producer, dead: str) -> None:
    """SpecForge drains an optimizer window's samples (``drain_feature_store_sample_removals``),
    as its Mooncake store does: the named samples alone. Ours drained every free: a host down
    for good (its connect hangs) holding an older sample's prefix frees made every window's
    drain raise, and SpecForge ends the run on it. The window's own frees are still waited for
    (released just before the drain: applied when it returns), and a drain of a sample whose
    frees wait at the dead host still raises, naming it."""
    from specforge.runtime.data_plane.feature_store import drain_feature_store_sample_removals

    store = SpecForgeArenaStore(store_id="run10", controls=[dead])
    store.abort("run:gone", reason="reconciled")  # never seen here: by prefix at the dead host
    refs = adapter(producer, store).produce_refs(tasks(3, "win"), capture=capture())
    ids = [r.sample_id for r in refs]
    for ref in refs:
        _, handle = store.get(ref)
        store.release(handle)
        store.abort(ref.sample_id, reason="optimizer-boundary-durable-ack")
    assert drain_feature_store_sample_removals(store, ids)["removed"] == 3  # SpecForge's bounds: 8 x 0.25 s
    assert producer.get()["stats"]["resident_objects"] == 0
    with pytest.raises(RuntimeError, match=rf"could not deliver the frees of 1 samples \(first: run:gone\) after 2 attempts: their prefix frees wait for {dead} \(1 in all\)"):
        drain_feature_store_sample_removals(store, ["run:gone"], max_attempts=2, retry_interval_s=0.1)
    with pytest.raises(RuntimeError, match="could not deliver 1 frees"):
        store.drain_pending_removals(max_attempts=2, retry_interval_s=0.1)


def test_a_capture_retried_on_another_server_leaves_nothing_on_the_first(make_sink: Any) -> None:
    """SpecForge retries a failed capture with the same generation (``replace``) on whichever
    server takes the task; each capture-arena server has an arena of its own. A first attempt
    whose response was recorded (then the batch failed) and one whose response was lost both
    left their objects on the first server for good: the second result overwrote the first's
    record, and the adopt of the retry forgot the attempt."""
    a, b = make_sink(), make_sink()
    store = SpecForgeArenaStore(store_id="retry")  # the servers' endpoints are learned from results
    names = ["h"]

    def attempt(sink: ca.ArenaSink, tag: str) -> dict[str, Any]:  # sample f"{tag}0"
        store.track_external_attempt(f"{tag}0", generation=1, feature_names=names)
        (row,) = _published(sink, "retry", 1, tag)
        post = store.post_fn(lambda url, json_body, timeout: [{"meta_info": {"spec_capture": [row]}}])
        post("http://server/generate", json_body={"spec_capture": [{"sample_id": row["sample_id"]}]}, timeout=1.0)
        return row

    attempt(a, "recorded")  # recorded, then the batch failed: never adopted
    attempt(b, "recorded")
    store.track_external_attempt("lost0", generation=1, feature_names=names)
    _published(a, "retry", 1, "lost")  # published on a, its response lost: never recorded
    attempt(b, "lost")
    for sid in ("recorded0", "lost0"):
        ref = SampleRef(
            sample_id=sid, run_id="run", source_task_id=sid, feature_store_uri=f"mooncake://retry/{sid}",
            feature_keys={"h": f"{sid}/h"}, feature_specs={}, strategy="eagle3", metadata={"generation": 1},
        )  # fmt: skip
        store.adopt(ref)
        _, handle = store.get(ref)
        store.release(handle)
    store.drain_pending_removals(max_attempts=40, retry_interval_s=0.25)
    for name, sink in (("a", a), ("b", b)):
        deadline = time.monotonic() + 10
        while sink.stats()["resident_objects"] != 0:
            assert time.monotonic() < deadline, f"left on {name}: {sink.stats()['resident_objects']} objects"
            time.sleep(0.01)


def test_a_host_that_does_not_answer_holds_up_no_other_endpoints_prefix_frees(make_sink: Any, dead: str) -> None:
    """Prefix frees went out from one thread, one endpoint at a time in the order learned: a
    host that does not answer (its connect hangs 5 s), learned first, held every other
    endpoint's frees behind each of its tries, and a drain at every optimizer step tried it
    again each time."""
    sink = make_sink()
    rows = _published(sink, "hold", 2, "s")
    store = SpecForgeArenaStore(store_id="hold", controls=[dead, sink.control])
    t0 = time.monotonic()
    for r in rows:
        store.abort(r["sample_id"], reason="reconciled")  # never seen here: by prefix at both
    while sink.stats()["resident_objects"] != 0:
        assert time.monotonic() - t0 < 3.0, f"the live endpoint's frees waited behind the dead one's connect: {sink.stats()['resident_objects']} left"
        time.sleep(0.01)
    # The live endpoint's two are counted pending until its sender is back from the send.
    while store.health()["release_pending"] != 2:  # the dead host's, still trying
        assert time.monotonic() - t0 < 3.0, store.health()
        time.sleep(0.01)


def test_a_panic_sending_one_prefix_costs_that_prefix_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A panic in native code reaches Python as a BaseException (pyo3's PanicException). One
    while sending a batch of prefixes has each sent alone to find the bad one; before, a second
    panic there killed the sender thread, the prefixes after it were lost without a count, the
    sender stayed counted (after four, none started again) and drains waited for good."""
    from capture_arena import specforge as sf

    class Panic(BaseException):
        pass

    sent: list[str] = []

    def send(control: str, keys: Any, prefixes: list[str], token: Any, timeout: float) -> None:
        if any(p.startswith("st/bad") for p in prefixes):
            raise Panic("a panic in native code")
        sent.extend(prefixes)

    monkeypatch.setattr(sf, "_send_frees", send)
    prefixes = sf._Prefixes()
    for round in range(6):  # more rounds than senders: each one must still be sent
        for p in ("st/a/", f"st/bad{round}/", "st/b/"):
            prefixes.add("127.0.0.1:9", None, p)
        assert prefixes.wait(10.0), f"round {round}: {prefixes.pending} frees never went out"
    assert prefixes.dropped == 6 and sent.count("st/a/") == 6 and sent.count("st/b/") == 6, (prefixes.dropped, sent)


def test_a_forked_child_gets_the_stores_lock_anew_and_none_of_its_parents_prefix_frees(dead: str) -> None:
    """A DataLoader's worker forked while another thread held the store's lock (the residency
    pass holds it over up to 65,536 samples) inherited it held for good: its first get, release
    or abort hung. It also kept the parent's queued prefix frees, which its own first sender
    sent again, maybe much later: an abort's prefix covers every generation, so a late copy can
    free a newer capture of the sample."""
    store = SpecForgeArenaStore(store_id="fork", controls=[dead])
    store.abort("a", reason="test")  # by prefix at the dead endpoint: its sender hangs in connect
    t0 = time.monotonic()
    while store._prefixes._sending != 1:
        assert time.monotonic() - t0 < 5.0, store.health()
        time.sleep(0.01)
    store.abort("b", reason="test")  # queued behind it
    assert store._prefixes.pending == 2
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with store._lock:
            held.set()
            done.wait()

    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    pid = os.fork()
    if pid == 0:  # the child: 0 if it took the lock and has nothing queued
        code = 5
        try:
            signal.alarm(10)  # a lock held for good ends the child by SIGALRM
            with store._lock:
                code = 0 if store._prefixes.pending == 0 else 3
            store.abort("c", reason="test")  # takes the lock again, queues anew
            code = code or (0 if store._prefixes.pending == 1 else 4)
        finally:
            os._exit(code)
    done.set()
    t.join()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status), f"the child hung on the store's lock (status {status})"
    assert os.WEXITSTATUS(status) == 0, "the child kept its parent's prefix frees" if os.WEXITSTATUS(status) == 3 else status
