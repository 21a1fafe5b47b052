"""Drop-in sink module for SGLang's capture patch.

The scheduler hooks call ``maybe_init_sink(server_args)`` once and ``get_sink()`` per capture;
switching them to capture-arena is changing one import::

    from capture_arena.sglang import get_sink, maybe_init_sink

Capture is enabled by ``server_args.enable_spec_capture``; ``aux_layer_ids`` come from
``server_args.spec_capture_aux_layer_ids``. Nothing is allocated until the first capture.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from . import ArenaSink, StoreSink, metrics, new_sink

__all__ = ["maybe_init_sink", "get_sink", "reset_sink"]

_SINK: Optional["ArenaSink | StoreSink"] = None
_COLLECTOR: Optional[metrics.ArenaCollector] = None


def _layer_ids(v: Any) -> Optional[list[int]]:
    if v is None:
        return None
    if isinstance(v, str):
        v = v.replace(",", " ").split()
    return [int(x) for x in v]


def maybe_init_sink(server_args: Any) -> Optional["ArenaSink | StoreSink"]:
    """Creates the process's sink if ``server_args.enable_spec_capture`` is set (once), and
    returns it; returns None when capture is off.

    The placement is the environment's (:func:`capture_arena.placement`): a TransferEngine arena
    under ``MOONCAKE_PROTOCOL=nvlink``/``nvlink_intra``, the Mooncake store under other
    protocols, or what ``SGLANG_SPEC_CAPTURE_PLACEMENT`` says. Every placement serves the same
    calls (:func:`capture_arena.new_sink`).
    """
    global _SINK
    if not getattr(server_args, "enable_spec_capture", False):
        return None
    if _SINK is None:
        ids = _layer_ids(getattr(server_args, "spec_capture_aux_layer_ids", None))
        _SINK = new_sink(aux_layer_ids=ids)
        # The server's metrics endpoint shows the arena (when prometheus_client is installed).
        global _COLLECTOR
        _COLLECTOR = metrics.register(_SINK)
    return _SINK


def get_sink() -> Optional["ArenaSink | StoreSink"]:
    """The sink :func:`maybe_init_sink` created, or None."""
    return _SINK


def reset_sink() -> None:
    """Forgets the sink (closing it). A forked child does this automatically: the writer thread
    does not survive a fork."""
    global _SINK, _COLLECTOR
    if _COLLECTOR is not None:
        import prometheus_client

        prometheus_client.REGISTRY.unregister(_COLLECTOR)
        _COLLECTOR = None
    if _SINK is not None and os.getpid() == _PID:
        _SINK.close()
    _SINK = None


_PID = os.getpid()


def _after_fork_in_child() -> None:
    global _SINK, _PID
    _SINK = None  # the parent's; its destructor leaves the parent's arena alone
    _PID = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)
