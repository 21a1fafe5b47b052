"""capture_arena.sglang: the drop-in sink module for SGLang's capture hooks."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

import capture_arena as ca
from capture_arena import sglang
from conftest import hidden, spec


@pytest.fixture(autouse=True)
def fresh():
    sglang.reset_sink()
    yield
    sglang.reset_sink()


def test_capture_off_means_no_sink():
    assert sglang.maybe_init_sink(SimpleNamespace(enable_spec_capture=False)) is None
    assert sglang.maybe_init_sink(SimpleNamespace()) is None
    assert sglang.get_sink() is None


def test_nvlink_creates_one_lazy_sink_with_the_layer_ids(monkeypatch):
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "nvlink")
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_ARENA_BYTES", "8MiB")
    args = SimpleNamespace(enable_spec_capture=True, spec_capture_aux_layer_ids="2,18,33")
    sink = sglang.maybe_init_sink(args)
    assert sink is not None and sglang.get_sink() is sink and sglang.maybe_init_sink(args) is sink
    assert not sink.started, "nothing allocated until the first capture"
    # nvlink publishes into device memory a TransferEngine allocates: the x86 wheels (and this
    # machine) cannot, and the first capture says so, naming the alternatives (test_engine.py;
    # capture-arena's own device arena: test_device.py::test_fake_gpu_nvlink_forces_a_device_arena).
    assert sink.device_publication and sink.placement == "engine"
    if not os.path.exists("/dev/nvidiactl"):
        row = sink.put_sample(spec("x"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
        assert "SGLANG_SPEC_CAPTURE_PLACEMENT=arena" in row["error"], row


def test_store_protocols_boot_without_a_master_and_connect_at_the_first_capture(monkeypatch):
    # The store placement itself: test_store_placement.py, against a real mooncake_master. As the
    # sink it replaces, a capture server boots without a reachable master; the first capture's
    # samples get error rows saying what failed, and the scheduler goes on.
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    monkeypatch.delenv("SGLANG_SPEC_CAPTURE_PLACEMENT", raising=False)
    monkeypatch.setenv("MOONCAKE_MASTER_SERVER_ADDR", "127.0.0.1:1")
    monkeypatch.setenv("MOONCAKE_METADATA_SERVER", "P2PHANDSHAKE")
    sink = sglang.maybe_init_sink(SimpleNamespace(enable_spec_capture=True))
    assert sink is not None and sink.placement == "store" and not sink.started
    assert sglang.gpu_put_enabled() is False
    rows = sink.submit_samples([(spec("s"), hidden(8, 12), hidden(8, 4))]).result(timeout=120)
    assert len(rows) == 1 and set(rows[0]) == {"sample_id", "error"} and rows[0]["sample_id"] == "s", rows


def test_a_forked_child_cannot_use_the_parents_sink_and_can_make_its_own(monkeypatch):
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_ARENA_BYTES", "8MiB")
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_PLACEMENT", "arena")
    sink = sglang.maybe_init_sink(SimpleNamespace(enable_spec_capture=True))
    assert sink is not None
    sink.put_sample(spec("p"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            if sglang.get_sink() is not None:
                code = 2
            row = sink.put_sample(spec("c"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
            if "belongs to process" not in row.get("error", ""):
                code = 3
            # Re-initialising in the child works (its own sink, arena and metrics).
            mine = sglang.maybe_init_sink(SimpleNamespace(enable_spec_capture=True))
            if mine is None or mine is sink:
                code = 4
            elif "error" in mine.put_sample(spec("c2"), aux=hidden(8, 12), last_hidden=hidden(8, 4)):
                code = 5
            sglang.reset_sink()
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"\x00"
    # The parent's sink and arena are untouched by the child's exit.
    got = sink.put_sample(spec("p2"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    assert ca.ArenaFeatureStore().get(got)["target"].shape == (1, 8, 4)
