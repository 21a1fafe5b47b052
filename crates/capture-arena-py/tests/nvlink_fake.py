"""MOONCAKE_PROTOCOL=nvlink's TransferEngine reader, faked on the CPU for the tests (nothing here
has a GPU, and Mooncake's NVLink transports need one): ``ArenaFeatureStore`` takes that protocol's
path (outputs on a GPU, one transfer an object, the stamp words into a tensor beside them, no
local registration) over a real TCP TransferEngine, CPU tensors standing for the CUDA ones it
reads into. Used in a test's own process (``monkeypatch.setattr``) and in a reader process it
starts (plain ``setattr``)."""

from __future__ import annotations

import types
from typing import Any, Callable


#: The memory of the faked GPU (an H100's 80 GiB).
FAKE_GPU_BYTES = 80 << 30


def fake_nvlink(patch: Callable[[Any, str, Any], None]) -> list[str]:
    """Patches the reader's NVLink path in with ``patch(owner, name, value)``; returns the list the
    device of every output made from then on is appended to."""
    import torch

    import capture_arena._engine as engine
    import capture_arena._reader as store_module

    tcp, made, init, on = engine.new_engine, store_module.new_array, engine.EngineReader.__init__, []

    def nvlink_reader(self: Any) -> None:
        init(self)
        self._protocol = "nvlink"

    def device_array(shape: list[int], dtype: str, as_torch: bool, device: Any = None) -> Any:
        on.append(str(device))
        if not str(device).startswith("cuda"):
            return made(shape, dtype, as_torch, device)
        arr, _ = made(shape, dtype, True, "cpu")
        return arr, types.SimpleNamespace(tensor=arr)  # what a CudaBytes holds

    patch(engine, "new_engine", lambda protocol: tcp("tcp"))
    patch(engine.EngineReader, "__init__", nvlink_reader)
    patch(store_module, "new_array", device_array)
    patch(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(synchronize=lambda: None))
    patch(torch.cuda, "mem_get_info", lambda device=None: (FAKE_GPU_BYTES, FAKE_GPU_BYTES))
    return on
