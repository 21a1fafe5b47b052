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
        with pytest.raises(ca.ConfigError, match="SGLANG_SPEC_CAPTURE_PLACEMENT=arena"):
            sink.put_sample(spec("x"), aux=hidden(8, 12), last_hidden=hidden(8, 4))


def test_store_protocols_get_the_store_sink_which_needs_its_master(monkeypatch):
    # The store placement itself: test_store_placement.py, against a real mooncake_master.
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    monkeypatch.delenv("SGLANG_SPEC_CAPTURE_PLACEMENT", raising=False)
    monkeypatch.delenv("MOONCAKE_MASTER_SERVER_ADDR", raising=False)
    with pytest.raises(ca.ConfigError, match="needs MOONCAKE_MASTER_SERVER_ADDR"):
        sglang.maybe_init_sink(SimpleNamespace(enable_spec_capture=True))
    assert sglang.get_sink() is None


def test_a_forked_child_cannot_use_the_parents_sink(monkeypatch):
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
            try:
                sink.put_sample(spec("c"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
                code = 3
            except RuntimeError as e:
                if "belongs to process" not in str(e):
                    code = 4
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"\x00"
    # The parent's sink and arena are untouched by the child's exit.
    got = sink.put_sample(spec("p2"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    assert ca.ArenaFeatureStore().get(got)["target"].shape == (1, 8, 4)
