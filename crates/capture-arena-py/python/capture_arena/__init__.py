"""capture_arena: the capture server's arena, from Python.

- :class:`ArenaSink` is what an inference server's capture hook calls: it publishes each batch of
  captured samples into the arena and returns one result dict per sample.
- :class:`ArenaFeatureStore` is what a trainer uses, usually in another process: it reads a
  result's tensors and releases them.

Everything runs in the Rust core; this module only re-exports. The package's shape:

- the core: :mod:`._samples` (requests in, result rows out), the sinks (:mod:`._sink`, the
  Mooncake store's in :mod:`._store`), the readers (:mod:`._reader`, :mod:`._engine`,
  :mod:`._store`), :mod:`.errors`, and :mod:`.metrics`;
- the engine adapters over it, siblings that import the core and never each other:
  :mod:`.sglang` (SpecForge's SGLang hook module, with :mod:`._install` its installer and
  :mod:`._live` its live capture), :mod:`.specforge` (SpecForge's trainer stack),
  :mod:`.vllm` (vLLM's hidden-states connector) and :mod:`.speculators` (speculators'
  backend).
"""

from __future__ import annotations

from . import _nixl_env  # noqa: F401  (NIXL's environment, before anything loads NIXL)
from . import errors
from ._capture_arena import FEATURES, UCX_TCP_SEG_SIZE, ReadBuffer, __version__, arena_enabled, placement
from ._live import LiveSink
from ._reader import ArenaFeatureStore
from ._samples import Result, Sample
from ._sink import START_RETRY_S, ArenaSink, new_sink
from ._store import StoreReader, StoreSink, is_store_result
from ._tensors import CudaBytes, HostBytes, host_bytes, new_array, out_bytes
from .errors import *  # noqa: F401,F403

__all__ = [
    "ArenaSink",
    "StoreSink",
    "ArenaFeatureStore",
    "StoreReader",
    "LiveSink",
    "ReadBuffer",
    "FEATURES",
    "UCX_TCP_SEG_SIZE",
    "START_RETRY_S",
    "Result",
    "Sample",
    "CudaBytes",
    "HostBytes",
    "host_bytes",
    "new_array",
    "out_bytes",
    "is_store_result",
    "new_sink",
    "placement",
    "arena_enabled",
    "errors",
    "__version__",
    *errors.__all__,
]
