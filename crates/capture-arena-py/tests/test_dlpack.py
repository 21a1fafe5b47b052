"""Tensors through DLPack and the buffer protocol; torch when it is installed."""

from __future__ import annotations

import numpy as np
import pytest

import capture_arena as ca
from conftest import hidden, spec


class DLPackOnly:
    """An object that offers DLPack and nothing else (as jax or cupy arrays do)."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def __dlpack__(self, **kw):  # type: ignore[no-untyped-def]
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):  # type: ignore[no-untyped-def]
        return self._a.__dlpack_device__()


def test_dlpack_and_buffer_protocol_inputs(make_sink):
    sink = make_sink()
    aux = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    last = np.arange(8 * 4, dtype=np.float16).reshape(8, 4)
    r = sink.put_sample(spec("dl"), aux=DLPackOnly(aux), last_hidden=memoryview(last))
    assert r["features"]["hidden_state"]["dtype"] == "float32"
    assert r["features"]["target"]["dtype"] == "float16"
    got = ca.ArenaFeatureStore().get(r)
    assert (got["hidden_state"][0] == aux).all() and (got["target"][0] == last).all()


def test_torch_tensors_round_trip():
    torch = pytest.importorskip("torch", reason="torch is not installed here; the numpy paths cover the same code")
    with ca.ArenaSink(arena_bytes="16MiB") as sink:
        aux = torch.randn(8, 12, dtype=torch.bfloat16)
        last = torch.randn(4, 8, dtype=torch.bfloat16).t()  # non-contiguous
        r = sink.put_sample(spec("t"), aux=aux, last_hidden=last)
        assert r["features"]["hidden_state"]["dtype"] == "bfloat16"
        got = ca.ArenaFeatureStore().get(r, torch=True)
        assert got["hidden_state"].dtype == torch.bfloat16
        assert torch.equal(got["hidden_state"][0], aux) and torch.equal(got["target"][0], last)
        out = {"target": torch.empty(1, 8, 4, dtype=torch.bfloat16)}
        ca.ArenaFeatureStore().get(r, ["target"], out=out)
        assert torch.equal(out["target"][0], last)


def test_cuda_tensors_under_a_host_arena_are_copied_to_host_and_read_into_cuda():
    """On a GPU machine: CUDA tensors handed to a host arena are copied device-to-host (after
    the event recorded on their stream), and read back into CUDA tensors (host-to-device)."""
    torch = pytest.importorskip("torch", reason="torch is not installed here")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here: this checks the GPU-machine path")
    with ca.ArenaSink(arena_bytes="16MiB") as sink:
        aux = torch.randn(8, 12, dtype=torch.bfloat16, device="cuda")
        last = torch.randn(8, 4, dtype=torch.bfloat16, device="cuda")
        r = sink.put_sample(spec("gpu"), aux=aux, last_hidden=last)
        assert r["arena"]["session"].startswith("shm://")
        store = ca.ArenaFeatureStore()
        got = store.get(r, ["hidden_state", "target"], device="cuda:0")
        assert got["hidden_state"].is_cuda and torch.equal(got["hidden_state"][0], aux)
        assert torch.equal(store.get(r, ["target"], torch=True)["target"][0], last.cpu())
        out = {"target": torch.empty(1, 8, 4, dtype=torch.bfloat16, device="cuda")}
        store.get(r, ["target"], out=out)
        assert torch.equal(out["target"][0], last)
