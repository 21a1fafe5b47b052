"""ArenaSink: the contract's request in, the contract's results out, errors before writing."""

from __future__ import annotations

import concurrent.futures
import gc
import re
import os
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import capture_arena as ca
from capture_arena._samples import _convert
from conftest import hidden, spec, wait_stats


def test_nothing_is_allocated_until_the_first_capture(make_sink):
    sink = make_sink()
    assert not sink.started
    assert sink.session is None and sink.control is None
    assert sink.stats()["capacity"] == 0
    r = sink.put_sample(spec("a"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    assert sink.started
    assert r["arena"] == {"session": sink.session, "control": sink.control}
    assert sink.stats()["capacity"] == 16 << 20


def test_results_follow_the_contract(make_sink):
    sink = make_sink(aux_layer_ids=[2, 18, 33])
    r = sink.put_sample(spec("run0:t17", 8), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    assert set(r) == {"sample_id", "store_id", "gen", "aux_layer_ids", "features", "arena"}
    assert (r["sample_id"], r["store_id"], r["gen"], r["aux_layer_ids"]) == ("run0:t17", "st", 1, [2, 18, 33])
    f = r["features"]
    assert f["hidden_state"]["shape"] == [1, 8, 12] and f["hidden_state"]["dtype"] == "bfloat16"
    assert f["target"]["shape"] == [1, 8, 4]
    assert f["input_ids"] == {"shape": [1, 8], "dtype": "int64", "address": f["input_ids"]["address"], "stamp": f["input_ids"]["stamp"]}
    # Each object's stamp: unique, an integer exact in any JSON reader (< 2**53).
    stamps = [x["stamp"] for x in f.values()]
    assert len(set(stamps)) == len(stamps) and all(isinstance(x, int) and 0 < x < 2**53 for x in stamps)
    assert r["arena"]["session"].startswith("shm://capture-arena-")
    assert r["arena"]["control"].startswith("127.0.0.1:")


def test_the_sglang_sinks_results_come_only_after_their_bytes_so_readers_without_the_readiness_rule_read_as_before(make_sink):
    """Only vLLM's connector hands results out before their bytes (docs/protocol.md, the
    readiness rule). SGLang's sink, by either path its patches take, returns a result only once
    every object is written: each stamp word (the 8 bytes after the object, rounded up to 8)
    already holds its stamp, never pending or failed, so a reader that ignores the rule
    (SpecForge's ArenaObjectClient) reads them as it always did."""
    import ctypes

    sink = make_sink()
    put = sink.put_sample(spec("put", 8), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    (submitted,) = sink.submit_samples([(spec("submitted", 8), hidden(8, 12), hidden(8, 4))]).result(10)
    size = {"bfloat16": 2, "int64": 8}
    for r in (put, submitted):
        assert "error" not in r, r
        for name, f in r["features"].items():
            nbytes = int(np.prod(f["shape"])) * size[f["dtype"]]
            word = ctypes.c_uint64.from_address(f["address"] + -(-nbytes // 8) * 8).value
            assert word == f["stamp"], (r["sample_id"], name, hex(word), f["stamp"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"aux": None, "last_hidden": hidden(8, 4)}, "aux requested"),
        ({"aux": hidden(8, 12), "last_hidden": None}, "last_hidden requested"),
    ],
)
def test_requested_but_not_captured_is_refused_before_writing(make_sink, kwargs, message):
    sink = make_sink()
    sink.put_sample(spec("warm"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    before = sink.stats()
    refused(sink.put_sample(spec("x"), **kwargs), message, "x")
    assert sink.stats() == before


def test_bad_passthrough_is_refused_before_writing(make_sink):
    sink = make_sink()
    bad_dtype = spec("x", aux=False, last=False)
    bad_dtype["passthrough"][0]["dtype"] = "complex64"
    refused(sink.put_sample(bad_dtype), "unsupported dtype", "x")
    refused(sink.put_sample(spec("c"), aux=np.zeros((8, 12), dtype=np.complex64), last_hidden=hidden(8, 4)), "unsupported dtype")
    assert not sink.started, "nothing was written, not even the arena"
    bad_len = spec("y", aux=False, last=False)
    bad_len["passthrough"][1]["data"] = [1, 2, 3]
    refused(sink.put_sample(bad_len), "data has 3 elements but shape", "y")
    bad_array = spec("z", aux=False, last=False)
    bad_array["passthrough"][0]["data"] = np.zeros((1, 7), dtype=np.int64)
    refused(sink.put_sample(bad_array), "spec declares", "z")
    assert sink.stats()["resident_objects"] == 0


def test_a_sample_naming_more_features_than_a_result_may_is_refused_alone(make_sink):
    # 300 passthroughs were published (301 objects), and then no reader could read or release
    # the result (readers refuse more than 256 features): it stayed until its prefix was freed.
    # A shape of more dimensions than a tensor may have is refused the same way, before its
    # dimensions are converted.
    sink = make_sink()
    many = spec("many", aux=False, last=False)
    many["passthrough"] = [{"name": f"p{i}", "dtype": "int64", "shape": [1], "data": [i]} for i in range(300)]
    deep = spec("deep", aux=False, last=False)
    deep["passthrough"][0]["shape"] = [1] * 1_000_000
    rows = sink.put_samples([(many, None, None), (deep, None, None), (spec("fine"), hidden(8, 12), hidden(8, 4))])
    refused(rows[0], r"300 features \(300 passthrough\), more than the 256 a result may name", "many")
    refused(rows[1], "at most 8 integers", "deep")
    assert "error" not in rows[2], rows[2]
    assert sink.stats()["resident_objects"] == len(rows[2]["features"])  # the good sample's only


@pytest.mark.parametrize("how", ["submit_samples", "put_samples", "put_samples_bounded"])
def test_a_sample_whose_key_is_resident_or_that_outgrows_the_arena_fails_alone(make_sink, how):
    # A batch is placed whole, and the writer refuses a batch with a resident key (a request
    # sent again, without replace) or more bytes than the whole arena: every other request of
    # the batch failed with it. Now the batch is published again one sample at a time, and only
    # the sample at fault fails.
    sink = make_sink(arena_bytes="1MiB")
    assert "error" not in sink.put_sample(spec("again"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    huge = (spec("huge", 4096), hidden(4096, 128), hidden(4096, 4))  # 1 MiB of aux alone

    def publish(batch):
        if how == "submit_samples":
            return sink.submit_samples(batch).result(30)
        return sink.put_samples(batch, within_s=5.0 if how == "put_samples_bounded" else None)

    for batch, at_fault, why in [
        ([(spec("again"), hidden(8, 12), hidden(8, 4)), (spec("mate1"), hidden(8, 12), hidden(8, 4))], 0, "already resident"),
        ([huge, (spec("mate2"), hidden(8, 12), hidden(8, 4))], 0, "the whole arena holds"),
    ]:
        rows = publish(batch)
        refused(rows[at_fault], why, batch[at_fault][0]["sample_id"])
        mate = rows[1 - at_fault]
        assert "error" not in mate and "_alone" not in mate, mate
    assert sink.stats()["resident_objects"] == 3 * 4  # again, mate1, mate2


def test_batches_queued_behind_a_failed_arena_creation_fail_at_once_with_its_reason(make_sink):
    # The arena cannot be made (simulated: its creation fails, once every batch is queued).
    # Three batches queued for it: the first pays the try; before, each of the others paid one
    # more (a slow try holds every batch behind it), now they get its reason at once.
    import threading
    import time

    sink = make_sink(max_pending_batches=4)  # room for the three to queue
    tries, gate = [], threading.Event()

    def failing_start(*a):
        tries.append(time.monotonic())
        gate.wait(10)  # held until every batch is queued
        raise RuntimeError("simulated: cannot map the arena")

    sink._start = failing_start
    futs = [sink.submit_samples([(spec(f"q{i}"), hidden(8, 12), hidden(8, 4))]) for i in range(3)]
    gate.set()
    rows = [f.result(30)[0] for f in futs]
    for i, r in enumerate(rows):
        refused(r, "simulated: cannot map the arena", f"q{i}")
    assert len(tries) == 1, f"{len(tries)} tries to make the arena for 3 batches"


def test_passthrough_arrays_travel_as_bytes(make_sink):
    sink = make_sink()
    s = spec("arr", aux=False, last=False)
    s["passthrough"][0]["data"] = np.arange(8, dtype=np.int64).reshape(1, 8)
    r = sink.put_sample(s)
    got = ca.ArenaFeatureStore().get(r)
    assert got["input_ids"].tolist() == [list(range(8))]


def test_replace_on_retry_keeps_g1_and_leaves_no_second_copy(make_sink):
    sink = make_sink()
    first = sink.put_sample(spec("r"), aux=hidden(8, 12, 1), last_hidden=hidden(8, 4, 1))
    # Without replace the batch fails (every sample gets an error result) and nothing changes.
    dup = sink.put_sample(spec("r"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    assert set(dup) == {"sample_id", "error"} and "already resident" in dup["error"]
    again = sink.put_sample(spec("r", replace=True), aux=hidden(8, 12, 2), last_hidden=hidden(8, 4, 2))
    assert again["gen"] == 1 and set(again["features"]) == set(first["features"])
    s = sink.stats()
    assert s["resident_objects"] == 4 and s["replaced_objects"] == 4
    got = ca.ArenaFeatureStore().get(again)
    assert (got["hidden_state"][0] == hidden(8, 12, 2)).all()


def test_a_failed_batch_gives_every_sample_an_error_and_leaves_the_arena_as_before(make_sink):
    sink = make_sink(arena_bytes="1MiB", wait_s=0.2)
    sink.put_sample(spec("big", 16), aux=hidden(16, 16384), last_hidden=hidden(16, 4))  # 512 KiB
    before = sink.stats()
    batch = [(spec(f"b{i}", 16), hidden(16, 8192), hidden(16, 4)) for i in range(3)]  # 3 x 256 KiB
    results = sink.put_samples(batch)
    assert [r["sample_id"] for r in results] == ["b0", "b1", "b2"]
    for r in results:
        assert set(r) == {"sample_id", "error"}
        assert "arena full" in r["error"] and "SGLANG_SPEC_CAPTURE_ARENA_BYTES" in r["error"]
    after = sink.stats()
    assert (after["resident_objects"], after["free_bytes"]) == (before["resident_objects"], before["free_bytes"])
    assert after["failed_batches"] == 1
    fut = sink.submit_samples(batch)
    assert all("error" in r for r in fut.result(timeout=10))


def test_submit_samples_returns_a_future(make_sink):
    sink = make_sink()
    fut = sink.submit_samples([(spec(f"f{i}"), hidden(8, 12), hidden(8, 4)) for i in range(4)])
    assert isinstance(fut, concurrent.futures.Future)
    results = fut.result(timeout=10)
    assert [r["sample_id"] for r in results] == ["f0", "f1", "f2", "f3"]


def test_a_full_queue_blocks_or_signals_instead_of_dropping(make_sink):
    # max_pending_batches counts every batch the writer holds, queued or being placed.
    sink = make_sink(arena_bytes="1MiB", wait_s=20.0, max_pending_batches=2)
    first = sink.put_sample(spec("a", 16), aux=hidden(16, 24576), last_hidden=hidden(16, 4))
    # "b" waits for space (the arena is full), "c" is queued behind it: two held.
    fb = sink.submit_samples([(spec("b", 16), hidden(16, 24576), hidden(16, 4))])
    fc = sink.submit_samples([(spec("c", 4), hidden(4, 4), hidden(4, 4))])
    with pytest.raises(ca.QueueFullError, match="SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES"):
        sink.submit_samples([(spec("d", 4), hidden(4, 4), hidden(4, 4))], block=False)
    # A refused batch is refused only: the future it came with is never completed.
    refused: concurrent.futures.Future[list[dict]] = concurrent.futures.Future()
    refused.set_running_or_notify_cancel()
    with pytest.raises(ca.QueueFullError):
        sink._submit(_convert([(spec("d", 4), hidden(4, 4), hidden(4, 4))]), refused, False)
    # A blocking submit waits (GIL released) until there is room, and is not dropped.
    done = threading.Event()

    def blocked() -> None:
        sink.submit_samples([(spec("e", 4), hidden(4, 4), hidden(4, 4))]).result(timeout=20)
        done.set()

    t = threading.Thread(target=blocked)
    t.start()
    assert not done.wait(0.3), "no room until a batch completes"
    ca.ArenaFeatureStore().release(first)
    for f in (fb, fc):
        assert "error" not in f.result(timeout=20)[0]
    t.join(timeout=20)
    assert done.is_set()
    assert sink.stats()["published_batches"] == 4
    assert not refused.done(), refused.exception() if refused.done() else None


def test_stats_and_arena_enabled(make_sink, monkeypatch):
    monkeypatch.delenv("MOONCAKE_PROTOCOL", raising=False)
    assert ca.arena_enabled() is False
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "nvlink")
    assert ca.arena_enabled() is True
    sink = make_sink()
    assert sink.device_publication
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_GPU_PUT", "0")
    with pytest.raises(ca.ConfigError, match="SGLANG_SPEC_CAPTURE_GPU_PUT off"):
        ca.ArenaSink(arena_bytes=1 << 20)
    keys = set(sink.stats())
    assert {"published_objects", "freed_objects", "free_bytes", "capacity", "bad_lines", "waits"} <= keys


def test_configuration_errors_name_what_to_set(monkeypatch):
    monkeypatch.delenv("SGLANG_SPEC_CAPTURE_ARENA_BYTES", raising=False)
    sink = ca.ArenaSink()
    refused(sink.put_sample(spec("x", aux=False, last=False)), "SGLANG_SPEC_CAPTURE_ARENA_BYTES", "x")
    with pytest.raises(ca.ConfigError, match="SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES"):
        ca.ArenaSink(arena_bytes=1 << 20, max_pending_batches=0)
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_ARENA_BYTES", "lots")
    with pytest.raises(ca.ConfigError, match="SGLANG_SPEC_CAPTURE_ARENA_BYTES"):
        ca.ArenaSink()
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_ARENA_BYTES", "2MiB")
    assert ca.ArenaSink.from_env().arena_bytes == 2 << 20


def test_non_contiguous_input_is_made_contiguous(make_sink):
    sink = make_sink()
    base = hidden(12, 8)
    aux = base.T  # [8, 12], not contiguous
    assert not aux.flags.c_contiguous
    r = sink.put_sample(spec("nc"), aux=aux, last_hidden=hidden(8, 4))
    got = ca.ArenaFeatureStore().get(r, ["hidden_state"])
    assert (got["hidden_state"][0] == aux).all()


def test_closed_sink_refuses_work(make_sink):
    sink = make_sink()
    sink.put_sample(spec("w"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    sink.close()
    sink.close()
    refused(sink.put_sample(spec("x"), aux=hidden(8, 12), last_hidden=hidden(8, 4)), "closed", "x")


def test_submitted_tensors_stay_alive_until_copied(make_sink):
    sink = make_sink(arena_bytes="8MiB")
    want = [(hidden(64, 96, 10 + i), hidden(64, 32, 20 + i)) for i in range(4)]
    # Temporaries: only the sink holds them once this call returns.
    fut = sink.submit_samples([(spec(f"k{i}", 64), a.copy(), l.copy()) for i, (a, l) in enumerate(want)])
    gc.collect()
    filler = [np.full(64 * 96, 0x7F, dtype=np.uint16) for _ in range(64)]  # reuse freed memory
    results = fut.result(timeout=10)
    store = ca.ArenaFeatureStore()
    for r, (a, l) in zip(results, want):
        got = store.get(r)
        assert got["hidden_state"][0].tobytes() == a.tobytes()
        assert got["target"][0].tobytes() == l.tobytes()
    del filler


def test_a_sample_failing_conversion_costs_only_its_row_and_lets_go(make_sink):
    sink = make_sink()
    sink.put_sample(spec("warm"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    ok = hidden(8, 12)
    ref = weakref.ref(ok)
    bad = np.zeros((8, 4), dtype=np.int32)  # an int32 last hidden with an aux of bf16 and 8 rows: fine
    bad_rows = np.zeros((7, 4), dtype=ml_dtypes.bfloat16)  # 7 tokens where aux has 8
    rows = sink.put_samples([(spec("k0"), ok, hidden(8, 4)), (spec("k1"), hidden(8, 12), bad_rows), (spec("k2"), hidden(8, 12), bad)])
    assert "error" not in rows[0] and "error" not in rows[2], rows
    refused(rows[1], "aux has 8 tokens", "k1")
    assert sink.stats()["published_samples"] == 3
    store = ca.ArenaFeatureStore()
    for r in (rows[0], rows[2]):
        store.release(r)
    store.flush()
    del ok
    deadline = time.monotonic() + 5
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert ref() is None, "the first sample's array was released"


def test_close_while_another_thread_waits(make_sink):
    sink = make_sink(arena_bytes="1MiB", wait_s=20.0)
    first = sink.put_sample(spec("a", 16), aux=hidden(16, 24576), last_hidden=hidden(16, 4))
    out: list[dict] = []
    t = threading.Thread(target=lambda: out.append(sink.put_sample(spec("b", 16), aux=hidden(16, 24576), last_hidden=hidden(16, 4))))
    t.start()
    deadline = time.monotonic() + 10
    while sink.stats()["waiting_bytes"] == 0:  # "b" waits for the free of "a"
        assert time.monotonic() < deadline, sink.stats()
        time.sleep(0.01)
    sink.close()  # does not fail because of the call in flight
    with pytest.raises(ca.WriterStoppedError, match="closed"):
        sink.stats()
    ca.ArenaFeatureStore().release(first)
    t.join(timeout=20)
    assert out and "error" not in out[0], out


def test_keyword_arguments_override_a_bad_environment(monkeypatch):
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES", "0")
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_ARENA_BYTES", "lots")
    with ca.ArenaSink(arena_bytes="1MiB", max_pending_batches=4) as sink:
        assert sink.arena_bytes == 1 << 20
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "nvlink")
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_GPU_PUT", "0")
    with ca.ArenaSink(arena_bytes="1MiB", max_pending_batches=4, protocol="tcp") as sink:
        assert not sink.device_publication


def test_non_native_byte_order_is_converted(make_sink):
    sink = make_sink()
    aux = np.arange(8 * 12, dtype=">f4").reshape(8, 12)
    r = sink.put_sample(spec("be", aux=True, last=False), aux=aux)
    got = ca.ArenaFeatureStore().get(r, ["hidden_state"])["hidden_state"]
    assert got.dtype == np.float32 and (got[0] == aux).all()


def test_timing_and_warnings_are_logged_to_stderr():
    # A fresh interpreter: the log filter is read when the module is first imported.
    code = (
        "import capture_arena as ca, numpy as np\n"
        "s = ca.ArenaSink(arena_bytes='1MiB')\n"
        "spec = {'store_id': 'a', 'sample_id': 's', 'passthrough': "
        "[{'name': 'x', 'data': [1, 2], 'shape': [2], 'dtype': 'int64'}]}\n"
        "s.put_sample(spec)\n"
        "import socket; host, port = s.control.rsplit(':', 1)\n"
        "c = socket.create_connection((host, int(port)))\n"
        "c.sendall(b'not json\\n'); c.close()\n"
        "import time\n"
        "while s.stats()['bad_lines'] == 0: time.sleep(0.01)\n"
        "s.close()\n"
    )
    err = _stderr_of(code, SGLANG_SPEC_CAPTURE_TIMING="1")
    assert "capture batch published" in err and "samples=1" in err, err
    assert "bad control line ignored" in err, err


def _stderr_of(code: str, **env: str) -> str:
    """What `code` writes to stderr in a fresh interpreter (the log filter is read when the
    module is first imported), with the log variables unset but for `env`; it must succeed."""
    full = {k: v for k, v in os.environ.items() if k not in ("RUST_LOG", "CAPTURE_ARENA_LOG")}
    out = subprocess.run([sys.executable, "-c", code], env={**full, **env}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stderr


def test_a_token_is_never_logged() -> None:
    """docs/protocol.md: a token line sent to a server without a token is logged without its content; a
    wrong token (server with one) is refused, likewise unlogged. Checked at the most verbose
    log level, with the reply read back first so the server has handled each line."""
    secret = "s3cr3t-" + "9" * 24
    code = (
        "import capture_arena as ca, socket, json, sys\n"
        f"secret = {secret!r}\n"
        "for token in (None, 'the-real-one-of-this-arena'):\n"
        "    s = ca.ArenaSink(arena_bytes='1MiB', control_token=token)\n"
        "    spec = {'store_id': 'a', 'sample_id': 's', 'passthrough': "
        "[{'name': 'x', 'data': [1, 2], 'shape': [2], 'dtype': 'int64'}]}\n"
        "    s.put_sample(spec)\n"
        "    host, port = s.control.rsplit(':', 1)\n"
        "    c = socket.create_connection((host, int(port)), timeout=10)\n"
        "    c.sendall(json.dumps({'token': secret}).encode() + b'\\n' + b'{\"sync\": 1}\\n')\n"
        "    answer = c.makefile().readline()\n"
        "    print('answer', answer.strip(), file=sys.stderr)\n"
        "    c.close(); s.close()\n"
    )
    err = _stderr_of(code, CAPTURE_ARENA_LOG="trace")
    # Both lines were handled: a sync answer without a token, the refusal with one.
    assert '"synced":1' in err and '"unauthorized"' in err, err
    assert secret not in err, err


@pytest.mark.parametrize(
    "dtype, data, want",
    [
        ("int64", [0, -1, 2**62], np.array([0, -1, 2**62], dtype=np.int64)),
        ("int32", [1, -2, 3], np.array([1, -2, 3], dtype=np.int32)),
        ("uint8", [0, 255, 7], np.array([0, 255, 7], dtype=np.uint8)),
        ("bool", [True, False, 1], np.array([True, False, True])),
        ("int64", [[1, 2, 3]], np.array([1, 2, 3], dtype=np.int64)),  # nested: generic path
        ("float32", [0.5, 1, -2.0], np.array([0.5, 1, -2.0], dtype=np.float32)),
    ],
)
def test_passthrough_lists_of_every_kind_round_trip(make_sink, dtype, data, want):
    sink = make_sink()
    s = {"store_id": "st", "sample_id": f"pt-{dtype}-{len(str(data))}", "features": {},
         "passthrough": [{"name": "x", "data": data, "shape": [1, 3], "dtype": dtype}]}
    got = ca.ArenaFeatureStore().get(sink.put_sample(s))["x"]
    assert got.dtype == want.dtype and (got.reshape(-1) == want).all()


@pytest.mark.parametrize(
    "dtype, data, message",
    [
        ("uint8", [1, 256, 3], "element 1: 256 out of range for uint8"),
        ("bool", [0, 2, 1], "not a bool"),
        ("int64", [1, 2**63, 3], "out of range"),
        ("int64", [1, "two", 3], "not a number"),
    ],
)
def test_bad_passthrough_values_are_refused_before_writing(make_sink, dtype, data, message):
    sink = make_sink()
    s = {"store_id": "st", "sample_id": "bad", "features": {},
         "passthrough": [{"name": "x", "data": data, "shape": [1, 3], "dtype": dtype}]}
    refused(sink.put_sample(s), message, "bad")
    assert sink.stats()["resident_objects"] == 0


def test_an_eager_sink_creates_its_arena_at_once(make_sink, monkeypatch):
    sink = make_sink(eager=True)
    assert sink.started and sink.session is not None
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_ARENA_EAGER", "1")
    from_env = make_sink()
    assert from_env.started
    # Eager without a size fails when the sink is made, saying what to set.
    monkeypatch.delenv("SGLANG_SPEC_CAPTURE_ARENA_BYTES", raising=False)
    with pytest.raises(ca.ConfigError, match="SGLANG_SPEC_CAPTURE_ARENA_BYTES"):
        ca.ArenaSink(eager=True)


def refused(row: dict, pattern: str, sample_id: object = None) -> None:
    """A sample's row says it was refused, matching `pattern` (submit_samples never raises)."""
    assert set(row) == {"sample_id", "error"}, row
    assert re.search(pattern, row["error"]), row["error"]
    if sample_id is not None:
        assert row["sample_id"] == sample_id, row


def test_a_request_sent_twice_in_one_batch_costs_only_the_second_row(make_sink):
    sink = make_sink()
    rows = sink.put_samples([(spec("twice"), hidden(8, 12, 1), hidden(8, 4)), (spec("twice"), hidden(8, 12, 2), hidden(8, 4))])
    assert "error" not in rows[0], rows[0]
    refused(rows[1], "also an object of another sample of this batch", "twice")
    got = ca.ArenaFeatureStore().get(rows[0])
    assert (got["hidden_state"][0] == hidden(8, 12, 1)).all()


def test_no_thread_for_the_starter_fails_the_batch_and_a_later_one_starts_the_arena(make_sink, monkeypatch):
    # A process at its thread limit (or exiting on Python 3.12+) cannot start the starter thread.
    # Before: submit_samples raised RuntimeError into the scheduler, and the sink kept the thread
    # that never ran as its starter: every later batch queued behind it for good.
    sink = make_sink()
    real = threading.Thread.start

    def refuse(self: threading.Thread, *a: object, **k: object) -> None:
        if self.name == "capture-arena-start":
            raise RuntimeError("can't start new thread")
        real(self, *a, **k)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    rows = sink.submit_samples([(spec("a"), hidden(8, 12), hidden(8, 4))]).result(timeout=30)
    assert "no thread to create it on: can't start new thread" in rows[0]["error"], rows
    sink.sync_bound = 1.0  # as SGLang's scheduler thread calls it: failed at once, never raised
    sink._start_failed_at -= 60  # past the retry interval: this call tries, and gets no thread either
    r = sink.put_sample(spec("b"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    assert "no thread to create it on" in r["error"] and not sink.started, r
    sink.sync_bound = None
    monkeypatch.setattr(threading.Thread, "start", real)
    sink._start_failed_at -= 60  # START_RETRY_S has passed
    rows = sink.submit_samples([(spec("c"), hidden(8, 12), hidden(8, 4))]).result(timeout=30)
    assert "error" not in rows[0] and sink.started, rows


def test_a_failed_start_is_tried_again_only_after_the_retry_interval(make_sink, monkeypatch):
    # Each try can allocate and pre-fault the whole arena before what fails (here the control
    # port, held by another socket, as a second rank with a fixed port meets it). Before: every
    # asynchronous batch that found the queue drained tried again: four batches, four tries.
    import socket

    holder = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_CONTROL_PORT", str(holder.getsockname()[1]))
    sink = make_sink()
    tries = []
    ensure = sink._ensure_started

    def counted(*a: object, **k: object) -> None:
        tries.append(1)
        ensure(*a, **k)

    sink._ensure_started = counted
    for i in range(4):
        rows = sink.submit_samples([(spec(f"r{i}"), hidden(8, 12), hidden(8, 4))]).result(timeout=30)
        assert "error" in rows[0], rows
    assert len(tries) == 1 and "creating the capture arena failed" in rows[0]["error"], (tries, rows)
    holder.close()
    sink._start_failed_at -= 60  # START_RETRY_S has passed
    rows = sink.submit_samples([(spec("ok"), hidden(8, 12), hidden(8, 4))]).result(timeout=30)
    assert "error" not in rows[0] and len(tries) == 2, (tries, rows)


def test_a_start_tried_again_by_a_caller_with_no_tensor_makes_the_arena_on_the_gpu_first_asked_for(make_sink):
    # vLLM's connector starts the arena on the cache's GPU (start_in_background(index)), and a
    # try after a failed start comes from a reservation of rows, which carries no tensor. Before:
    # that try asked for no GPU, so a device arena went to GPU 0 (another worker's), and the
    # connector copied into it as if it were on the cache's GPU.
    sink = make_sink()
    asked = []
    ensure = sink._ensure_started

    def first_fails(items: object = None, device: object = None) -> None:
        asked.append(device)
        if len(asked) == 1:
            raise RuntimeError("out of memory (the first try)")
        ensure(items, None)  # this machine has no GPU: the host arena the test can make

    sink._ensure_started = first_fails
    sink.start_in_background(3)
    wait = time.monotonic() + 30
    while sink._start_error is None or sink._starter is not None:  # failed, and its thread done with it
        assert time.monotonic() < wait, "the first start never failed"
        time.sleep(0.01)
    sink._start_failed_at -= 60  # START_RETRY_S has passed
    rows = sink._reserve_rows_begin("st", "bfloat16", 8, [("r", 1, 4)], within_s=20).wait_dicts()
    assert rows[0][0] is not None and sink.started, rows
    assert asked == [3, 3], asked
    sink.finish_writes([rows[0][2]], ok=False)  # never written: its space goes back


def test_an_unsupported_torch_dtype_is_refused_before_any_copy_and_a_memmap_is_published(make_sink, monkeypatch, tmp_path):
    # Before: a non-contiguous (or, for a host placement, CUDA) tensor of an unsupported dtype
    # was copied whole (.contiguous(), .cpu()) on the caller's thread before its dtype was
    # refused; and an np.memmap was refused as "expected a numpy.ndarray of bytes, got memmap".
    torch = pytest.importorskip("torch")
    sink = make_sink()
    copies = []
    contiguous = torch.Tensor.contiguous

    def counted(self, *a, **k):  # the real method, counted
        copies.append(self.dtype)
        return contiguous(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "contiguous", counted)
    wide = torch.zeros((12, 8), dtype=torch.float8_e4m3fn).t()  # [8, 12], not contiguous
    r = sink.put_sample(spec("f8"), aux=wide, last_hidden=hidden(8, 4))
    assert "aux: unsupported dtype 'float8_e4m3fn'" in r["error"], r
    assert copies == [], copies
    mm = np.memmap(tmp_path / "last.bin", dtype=np.float32, mode="w+", shape=(8, 4))
    mm[:] = np.arange(32, dtype=np.float32).reshape(8, 4)
    r = sink.put_sample(spec("mm", last=True, aux=False), last_hidden=mm)
    assert "error" not in r, r
    got = ca.ArenaFeatureStore().get(r)
    assert np.array_equal(got["target"][0], np.arange(32, dtype=np.float32).reshape(8, 4))


EXIT_BEHIND_A_FULL_ARENA = r"""
import sys, time, numpy as np
import capture_arena as ca
sink = ca.ArenaSink(arena_bytes="64KiB", wait_s=30, max_pending_batches=3)
spec = lambda i: {"store_id": "st", "sample_id": f"s{i}", "features": {"last_hidden": "target"}}
# All through the starter thread (the lock held but while the caller waits for room, so the
# starter cannot empty its queue before the last comes): the first fills the arena, the second
# waits for frees in the writer (30 s), the next two fill the writer's queue, and the fifth
# holds the starter in its submit.
with sink._early_lock:
    futs = [sink.submit_samples([(spec(i), None, np.ones((12, 1024), np.float32))]) for i in range(5)]  # 48 KiB each
deadline = time.monotonic() + 20
while not (sink.stats()["waiting_bytes"] and len(sink._early) == 1):
    assert time.monotonic() < deadline, "the starter never got held"
    time.sleep(0.01)
assert sink._starter is not None and sink._starter.is_alive()
print(sink.session, flush=True)
print("exiting", flush=True)
sys.exit(0)
"""


def test_exit_does_not_wait_out_a_starter_held_behind_a_full_arena() -> None:
    # Before: the exit hook joined the starter thread without a bound: 30 s here (the arena's
    # wait for frees of the batch ahead). Now at most STARTER_EXIT_WAIT_S (2 s), then the exit
    # hook's own wait for calls in flight (5 s), and the call that comes back later parks.
    from capture_arena import _sink

    p = subprocess.Popen([sys.executable, "-c", EXIT_BEHIND_A_FULL_ARENA], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    session = p.stdout.readline().strip()
    name = "/dev/shm/" + session.removeprefix("shm://").split("?")[0]
    assert session.startswith("shm://") and os.path.exists(name), session
    assert p.stdout.readline() == "exiting\n"
    t0 = time.monotonic()
    _, err = p.communicate(timeout=120)
    took = time.monotonic() - t0
    assert p.returncode == 0 and "FATAL" not in err, err[-3000:]
    assert took < _sink.STARTER_EXIT_WAIT_S + 5 + 3, (took, err[-3000:])
    # The parked call holds the sink for good: the arena's name went at close even so (before:
    # left in /dev/shm until another producer's start swept it).
    leftover = os.path.exists(name)
    if leftover:
        os.unlink(name)
    assert not leftover, name


def test_a_start_asked_for_alone_takes_no_batchs_place_while_the_arena_is_made() -> None:
    """SGLANG_SPEC_CAPTURE_ARENA_EAGER=1 starts the arena in the background so that the
    scheduler pays nothing; but the start itself counted against max_pending_batches while the
    arena was made (about 0.5 s a GiB), so the scheduler's first batch blocked on it (with 1),
    or was refused without blocking (found by an outside reading). The arena's making is held
    here by a stand-in for its slowness."""
    sink = ca.ArenaSink(arena_bytes="64KiB", max_pending_batches=1)
    making, go = threading.Event(), threading.Event()
    real = sink._start_one

    def slow_start(items: Any, fut: Any, device: Any) -> None:
        if fut is None:
            making.set()
            go.wait(30)
        real(items, fut, device)

    sink._start_one = slow_start  # type: ignore[method-assign]
    try:
        sink.start_in_background()
        assert making.wait(10), "the starter began"
        fut = sink.submit_samples([(spec("early", 4, aux=False), None, hidden(4, 4))], block=False)
        go.set()
        (row,) = fut.result(timeout=30)
        assert "error" not in row, row
    finally:
        go.set()
        sink.close()


def test_a_sink_closed_by_another_thread_during_a_submit_gives_its_rows_never_a_raise() -> None:
    """Another thread's close() between submit_samples' look at the sink and its hand-over to
    the starter made the hand-over's getters raise WriterStoppedError into the caller (found by
    an outside reading); the batch gets its rows instead. The close's moment is a stand-in: the
    hand-over raises as those getters do then."""
    sink = ca.ArenaSink(arena_bytes="64KiB")

    def closed_meanwhile(entry: Any, device: Any) -> bool:
        raise ca.WriterStoppedError("the ArenaSink is closed")

    sink._hand_to_starter = closed_meanwhile  # type: ignore[method-assign]
    try:
        (row,) = sink.submit_samples([(spec("late", 4, aux=False), None, hidden(4, 4))]).result(timeout=10)
        assert "closed" in row["error"], row
    finally:
        sink.close()


EXIT_UNDER_A_WRITE = r"""
import sys, threading, numpy as np
import capture_arena as ca
sink = ca.ArenaSink(arena_bytes="64KiB")
row = sink.put_sample({"store_id": "st", "sample_id": "s", "features": {"last_hidden": "target"}}, last_hidden=np.ones((4, 8), np.float32))
assert "error" not in row, row
# A thread writing into the arena that does not stop (vLLM's copier, stuck): it holds the sink.
stuck = threading.Event()
threading.Thread(target=lambda held=sink: stuck.wait(), daemon=True).start()
sink.on_close(lambda: False)
print(sink.session, flush=True)
sys.exit(0)
"""


def test_an_arena_left_mapped_under_a_write_that_did_not_stop_loses_its_name_at_exit() -> None:
    # Before: once a writing thread's stop failed, the exit hook returned before anything else,
    # and the arena's name stayed in /dev/shm after the process, holding all its memory (found
    # by an outside reading).
    out = subprocess.run([sys.executable, "-c", EXIT_UNDER_A_WRITE], capture_output=True, text=True, timeout=120)
    session = out.stdout.strip()
    assert out.returncode == 0 and session.startswith("shm://"), out.stdout + out.stderr[-3000:]
    assert "a thread still writes into the capture arena" in out.stderr, out.stderr[-3000:]
    name = "/dev/shm/" + session.removeprefix("shm://").split("?")[0]
    leftover = os.path.exists(name)
    if leftover:
        os.unlink(name)
    assert not leftover, name


class _Claims(list):
    """A list whose ``len()`` claims 2^40 items."""

    def __len__(self) -> int:
        return 1 << 40


def test_values_that_would_cost_the_process_are_refused_alone(make_sink):
    """Each of these killed the process: a passthrough list nested 300,000 deep overflowed the
    stack (read with pythonize, which has no depth bound), and so did a result's frozenset nested
    100,000 deep; a list subclass claiming 2^40 items had 8 TiB allocated for it (pyo3 sizes a
    Vec by ``len()``). Each now fails its own sample, or its own call."""
    sink = make_sink()
    nested: object = 0
    for _ in range(300_000):
        nested = [nested]
    deep = spec("deep", aux=False, last=False)
    deep["passthrough"] = [{"name": "p", "dtype": "float32", "shape": [1], "data": nested}]
    claims = spec("claims", aux=False, last=False)
    claims["passthrough"] = [{"name": "p", "dtype": "int64", "shape": [3], "data": _Claims([1, 2, 3])}]
    # Its shape allows 2^40 items: room is made for the items as they come, not for its claim.
    claims_big = spec("claims-big", aux=False, last=False)
    claims_big["passthrough"] = [{"name": "p", "dtype": "int8", "shape": [1 << 40], "data": _Claims([1, 2, 3])}]
    # Bounded by its shape's own count of lists and numbers: a zero dimension still holds its list.
    empty = spec("empty", aux=False, last=False)
    empty["passthrough"] = [{"name": "p", "dtype": "float32", "shape": [1, 0], "data": [[]]}]
    assert "error" not in sink.put_sample(empty), "an empty [1, 0] passthrough publishes"
    rows = sink.put_samples([(deep, None, None), (claims, None, None), (claims_big, None, None),
                             (spec("fine"), hidden(8, 12), hidden(8, 4))])
    refused(rows[0], r"nested more than 2 levels deep|more than 2 values in all", "deep")
    refused(rows[1], "1099511627776 items, more than the 4 values", "claims")
    refused(rows[2], "passthrough", "claims-big")
    rows = rows[1:]
    assert "error" not in rows[2], rows[2]
    assert sink.stats()["resident_objects"] == len(rows[2]["features"]) + 1  # and the empty one's
    inner: object = frozenset()
    for _ in range(100_000):
        inner = frozenset([inner])
    forged = dict(rows[2], features={"x": dict(rows[2]["features"]["hidden_state"], shape=inner)})
    with pytest.raises(ca.CaptureArenaError, match="nested more than 32 levels deep"):
        ca.ArenaFeatureStore().release(forged)


def test_a_refused_sample_id_of_megabytes_makes_a_log_line_of_a_few_kilobytes(make_sink, caplog, monkeypatch):
    """The batch's failure warning quoted the first failed sample's id whole: a 5 MB id made a
    5 MB log line (on the scheduler thread, under a synchronous patch)."""
    import logging

    from capture_arena import _samples

    monkeypatch.setattr(_samples, "_FAILURES", _samples.Warnings())  # none earlier holds this one back
    sink = make_sink()
    huge = spec("x" * (5 << 20))
    with caplog.at_level(logging.WARNING, logger="capture_arena"):
        rows = sink.put_samples([(huge, hidden(8, 12), hidden(8, 4))])
    assert "error" in rows[0] and rows[0]["sample_id"] == huge["sample_id"]
    said = [r.getMessage() for r in caplog.records if "captured samples failed" in r.getMessage()]
    assert said and max(map(len, said)) < 4000, [len(m) for m in said]


def test_log_arguments_are_cut_before_they_are_rendered_and_never_lose_their_record(caplog):
    """capture_arena's loggers (capture_arena._logs): a 10 MB string quoted with %r costs a few
    kilobytes, not the string again several times over (escaped whole, then cut); an argument
    whose repr raises or recurses is named, the record kept; numpy's scalars stay numbers for
    %d; a traceback's exception line stays one line, escaped."""
    import logging
    import tracemalloc

    from capture_arena import _logs

    class Unshowable:
        def __repr__(self) -> str:
            raise ValueError("no")

    class Recursing:
        def __repr__(self) -> str:
            return repr(self)

    log = _logs.get("capture_arena.test")
    big = "\x00" * 10_000_000
    with caplog.at_level(logging.DEBUG, logger="capture_arena"):
        tracemalloc.start()
        try:
            log.warning("big %r", big)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        log.warning("odd %r %r, count %d", Unshowable(), Recursing(), np.int64(7))
        try:
            raise ValueError("bad\nforged line \ud800")
        except ValueError:
            log.warning("failed", exc_info=True)
    big_line, odd, failed = (r for r in caplog.records if r.name == "capture_arena.test")
    big_line, odd = big_line.getMessage(), odd.getMessage()
    assert peak < 1 << 20 and len(big_line) < 10_000 and big_line.endswith("(9998000 more characters)"), (peak, big_line[-60:])
    assert big_line.count("more characters") == 1, big_line[-60:]  # its rendering is not cut (and counted) again
    assert odd == "odd <Unshowable that cannot be shown> <Recursing nested too deeply to show>, count 7", odd
    # The traceback's exception line: one line, escaped, writable as UTF-8.
    assert failed.exc_text is not None and failed.exc_text.endswith("ValueError: bad\\nforged line \\ud800"), failed.exc_text
    failed.exc_text.encode("utf-8")


class _FakedPanic(BaseException):
    """Stands in for pyo3's PanicException, which derives from BaseException only: no Rust panic
    can be provoked on purpose, so the extension's call raises this instead."""


def _panics_once(sink, name, monkeypatch):
    real = getattr(sink, name)
    calls = []

    def call(*a, **k):
        if not calls:
            calls.append(1)
            raise _FakedPanic("the extension panicked")
        return real(*a, **k)

    monkeypatch.setattr(sink, name, call)


def test_a_panic_of_the_extension_faked_costs_only_its_batch(make_sink, monkeypatch):
    """Every boundary caught Exception only: a panic of the extension (a BaseException) raised
    into the scheduler's loop from submit_samples or put_samples, and on the starter thread it
    ended the thread with the batch still queued, so every later batch (and the patch's
    drain) waited for good. Each now gets its batch's rows; the next batch publishes."""
    early = make_sink()  # not started: its batches go through the starter thread
    _panics_once(early, "_submit", monkeypatch)
    first = early.submit_samples([(spec("e1"), hidden(8, 12), hidden(8, 4))]).result(timeout=30)
    assert "panicked" in first[0]["error"], first
    second = early.submit_samples([(spec("e2"), hidden(8, 12), hidden(8, 4))]).result(timeout=30)
    assert "error" not in second[0], second
    started = make_sink(eager=True)
    _panics_once(started, "_submit", monkeypatch)
    rows = started.submit_samples([(spec("s1"), hidden(8, 12), hidden(8, 4))]).result(timeout=30)
    assert "panicked" in rows[0]["error"], rows
    _panics_once(started, "_put", monkeypatch)
    rows = started.put_samples([(spec("s2"), hidden(8, 12), hidden(8, 4))], within_s=5)
    assert "panicked" in rows[0]["error"], rows
    assert "error" not in started.put_samples([(spec("s3"), hidden(8, 12), hidden(8, 4))], within_s=5)[0]


# The SystemExit ends the starter thread, as it should; Python's own thread hook ignores it.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_starter_thread_interrupted_fails_its_batch_and_hands_on_the_rest(make_sink, monkeypatch):
    """A SystemExit on the starter thread (an interrupt, passed on as such) ended it with its
    batch's future never completed, and the batches behind it had no starter until another
    came. Its batch now gets rows saying so; the next starts a new thread and publishes."""
    sink = make_sink()
    real, calls = sink._ensure_started, []

    def interrupted_once(*a, **k):
        if not calls:
            calls.append(1)
            raise SystemExit("interrupted")
        return real(*a, **k)

    monkeypatch.setattr(sink, "_ensure_started", interrupted_once)
    first = sink.submit_samples([(spec("i1"), hidden(8, 12), hidden(8, 4))])
    assert "interrupted" in first.result(timeout=30)[0]["error"]
    second = sink.submit_samples([(spec("i2"), hidden(8, 12), hidden(8, 4))]).result(timeout=30)
    assert "error" not in second[0], second
