"""The documented defaults on the Python side (README's guides, docs/), as the numbers they give.

Each check reads the value the package actually uses with the variable unset (not a constant
compared with itself); the Rust side's defaults are checked in `config` and `control_client`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import capture_arena as ca
from capture_arena import _live, _pool, _reader, _store, metrics


@pytest.fixture
def unset(monkeypatch):
    def _unset(*names: str) -> None:
        for n in names:
            monkeypatch.delenv(n, raising=False)

    return _unset


def test_exit_flush_waits_5_s_and_a_bad_value_is_named(unset, monkeypatch, caplog):
    unset("SGLANG_SPEC_CAPTURE_EXIT_FLUSH_S")
    assert _reader._exit_flush_s() == 5.0
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_EXIT_FLUSH_S", "0.25")
    assert _reader._exit_flush_s() == 0.25
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_EXIT_FLUSH_S", "soon")
    with caplog.at_level("WARNING", logger="capture_arena"):
        assert _reader._exit_flush_s() == 5.0
    assert "SGLANG_SPEC_CAPTURE_EXIT_FLUSH_S='soon'" in caplog.text


def test_read_pool_is_4_gib_and_0_turns_it_off(unset, monkeypatch):
    unset("SGLANG_SPEC_CAPTURE_READ_POOL_BYTES")
    assert _pool._limit() == 4 << 30
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_READ_POOL_BYTES", "0")
    assert _pool._limit() == 0
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_READ_POOL_BYTES", "lots")
    with pytest.raises(ca.ConfigError, match="SGLANG_SPEC_CAPTURE_READ_POOL_BYTES"):
        _pool._limit()


def test_live_queue_holds_64_captures(unset, monkeypatch):
    unset(_live.QUEUE_ENV)
    assert _live._queue_size() == 64
    monkeypatch.setenv(_live.QUEUE_ENV, "0")
    with pytest.raises(ca.ConfigError, match="SPEC_CAPTURE_LIVE_QUEUE"):
        _live._queue_size()


def test_metrics_are_written_every_5_s(unset, monkeypatch, caplog):
    unset(metrics.INTERVAL_ENV)
    assert metrics._interval() == 5.0
    monkeypatch.setenv(metrics.INTERVAL_ENV, "never")
    with caplog.at_level("WARNING"):
        assert metrics._interval() == 5.0
    assert metrics.INTERVAL_ENV in caplog.text


def test_the_store_reader_keeps_at_most_262144_pending_keys():
    # docs/protocol.md: "Pending keys are bounded (262144; the oldest are dropped ...)".
    assert (_store.StoreReader.MAX_PENDING_KEYS, _store.StoreReader.MAX_RELEASED) == (262144, 262144)


@pytest.mark.skipif("nixl" not in ca.FEATURES, reason="a build without the nixl feature sets no UCX variable")
def test_ucx_tcp_segments_are_512k_when_unset_and_a_users_value_stays():
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_TCP_")}
    code = "import os, json, capture_arena; print(json.dumps([os.environ.get('UCX_TCP_TX_SEG_SIZE'), os.environ.get('UCX_TCP_RX_SEG_SIZE')]))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == ["512k", "512k"]
    env["UCX_TCP_TX_SEG_SIZE"] = "64k"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == ["64k", "512k"]


def test_ucx_infiniband_is_left_alone_where_the_machine_cannot_be_told_and_import_never_fails(unset, monkeypatch):
    """``UCX_MODULES=^ib`` is set where the machine has no InfiniBand device. A ``/sys`` this
    process may not list made ``import capture_arena`` raise PermissionError; now UCX is left as
    it is there."""
    from capture_arena import _nixl_env

    if "nixl" not in ca.FEATURES:
        pytest.skip("a build without the nixl feature sets no UCX defaults")
    unset("UCX_MODULES")
    real_isdir, real_listdir = os.path.isdir, os.listdir

    def listdir(path):
        if str(path) == "/sys/class/infiniband":
            raise PermissionError(13, "Permission denied", path)
        return real_listdir(path)

    monkeypatch.setattr(os.path, "isdir", lambda p: True if str(p) == "/sys/class/infiniband" else real_isdir(p))
    monkeypatch.setattr(os, "listdir", listdir)
    _nixl_env._nixl_defaults()
    assert "UCX_MODULES" not in os.environ
