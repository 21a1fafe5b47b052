"""capture-arena as SGLang's ``sglang.srt.spec_capture_sink``: the module SpecForge's SGLang patch
adds, with the same module-level names and semantics, for every published version of the patch.

The patched scheduler calls ``maybe_init_sink(server_args)`` once per scheduler process (every
rank), ``gpu_put_enabled()`` per batch (v0.5.20), and ``get_sink().submit_samples(samples)`` per
scheduler batch on attention-TP rank 0, then ``future.result()``. To put this module behind that
import in an SGLang installation with the patch applied::

    python -m capture_arena.sglang install      # [--sglang-dir DIR]; `uninstall`, `check`

What differs from the module it replaces, and why:

- ``submit_samples`` never raises (the patch calls it without a ``try``, so an exception would end
  the scheduler process): each sample gets its row, a result or ``{"sample_id", "error"}``, and a
  bad request costs only its own row. The future never fails for a list of samples.
- The placement follows ``MOONCAKE_PROTOCOL`` / ``SGLANG_SPEC_CAPTURE_PLACEMENT``
  (:func:`capture_arena.placement`): the Mooncake store as before under ``tcp``/``rdma``, an arena
  in device memory under ``nvlink``.
- Setting errors (a bad variable, ``SGLANG_SPEC_CAPTURE_GPU_PUT=0`` with ``nvlink``) are raised by
  ``maybe_init_sink``, when the server starts; nothing is allocated or connected there. The arena
  is created (or the store connected) at the first capture, on a background thread.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Optional

from . import ArenaSink, ConfigError, StoreSink, metrics, new_sink, placement

__all__ = ["maybe_init_sink", "get_sink", "gpu_put_enabled", "reset_sink", "SpecCaptureSink"]

logger = logging.getLogger(__name__)

_SINK: Optional["ArenaSink | StoreSink"] = None
_METRICS: Any = None
_PID = os.getpid()


def _layer_ids(v: Any) -> Optional[list[int]]:
    if v is None:
        return None
    if isinstance(v, str):
        v = v.replace(",", " ").split()
    try:
        return [int(x) for x in v]
    except (TypeError, ValueError):
        raise ConfigError(f"--spec-capture-aux-layer-ids must be integers, not {v!r:.80}") from None


def _env_gpu_put() -> Optional[bool]:
    v = os.environ.get("SGLANG_SPEC_CAPTURE_GPU_PUT", "").strip()
    return None if v == "" else v == "1"


def _device_publication() -> bool:
    """What the environment selects, without raising (a bad setting is raised by
    :func:`maybe_init_sink`, when the server starts)."""
    try:
        where = placement()
    except Exception:
        return False
    if where == "store":
        return False
    protocol = os.environ.get("MOONCAKE_PROTOCOL", "").strip().lower()
    return protocol in ("nvlink", "nvlink_intra") or _env_gpu_put() is True


def gpu_put_enabled() -> bool:
    """True when the scheduler hands the sink device tensors (the placement publishes from GPU
    memory: ``nvlink`` always, ``SGLANG_SPEC_CAPTURE_GPU_PUT=1`` for capture-arena's own arena);
    False when it copies them to the host first (the store placement, host arenas). The sink's
    own answer once it exists; never raises (the v0.5.20 scheduler calls it on every batch, on
    every rank, capture on or off)."""
    sink = _SINK
    if sink is not None:
        try:
            return bool(sink.device_publication)
        except Exception:
            return False
    return _device_publication()


def _check_settings() -> None:
    """Raises ConfigError for settings the server must not start with."""
    where = placement()
    protocol = os.environ.get("MOONCAKE_PROTOCOL", "").strip().lower()
    gpu_put = _env_gpu_put()
    if protocol in ("nvlink", "nvlink_intra") and gpu_put is False:
        raise ConfigError(
            f"MOONCAKE_PROTOCOL={protocol} always publishes from device memory, but SGLANG_SPEC_CAPTURE_GPU_PUT=0 "
            "asks for host publication: unset SGLANG_SPEC_CAPTURE_GPU_PUT, or choose MOONCAKE_PROTOCOL=tcp/rdma"
        )
    if where == "store" and gpu_put is True:
        raise ConfigError(
            "SGLANG_SPEC_CAPTURE_GPU_PUT=1 asks for device publication, but the store placement "
            f"(MOONCAKE_PROTOCOL={protocol or 'unset'}) publishes host memory here: unset SGLANG_SPEC_CAPTURE_GPU_PUT, "
            "or set SGLANG_SPEC_CAPTURE_PLACEMENT=arena (a device arena) or MOONCAKE_PROTOCOL=nvlink"
        )


def _scheduler_state() -> tuple[Optional[int], Optional[int]]:
    """``(attention-TP rank, GPU)`` of the SGLang scheduler calling :func:`maybe_init_sink`
    (its ``self.ps.attn_tp_rank`` and ``self.gpu_id``), or None where the caller is not one."""
    try:
        frame = sys._getframe(2)
    except ValueError:  # called from the top of the stack: no scheduler above
        return None, None
    for _ in range(4):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        ps = getattr(owner, "ps", None)
        rank = getattr(ps, "attn_tp_rank", None)
        if isinstance(rank, int):
            gpu = getattr(owner, "gpu_id", None)
            return rank, gpu if isinstance(gpu, int) else None
        frame = frame.f_back  # type: ignore[assignment]
    return None, None


def maybe_init_sink(server_args: Any) -> Optional["ArenaSink | StoreSink"]:
    """Creates this process's sink if ``server_args.enable_spec_capture`` is set (once) and
    returns it; None when capture is off.

    Checks the settings (raising :class:`ConfigError` naming the variables, so a misconfigured
    server does not start) but allocates and connects nothing: the arena is created, or the
    Mooncake store connected, at the first capture on a background thread. With
    ``SGLANG_SPEC_CAPTURE_ARENA_EAGER=1`` the arena is created in the background now instead,
    on the rank that captures only (attention-TP rank 0, read from the calling scheduler), on
    that rank's GPU for a device arena. The placement is the environment's
    (:func:`capture_arena.placement`); ``aux_layer_ids`` come from
    ``server_args.spec_capture_aux_layer_ids``.
    """
    global _SINK, _METRICS
    if not getattr(server_args, "enable_spec_capture", False):
        return None
    if _SINK is None:
        _check_settings()
        ids = _layer_ids(getattr(server_args, "spec_capture_aux_layer_ids", None))
        rank, gpu = _scheduler_state()
        if placement() == "store":
            sink: "ArenaSink | StoreSink" = new_sink(aux_layer_ids=ids)
        else:
            eager = os.environ.get("SGLANG_SPEC_CAPTURE_ARENA_EAGER", "").strip() == "1"
            arena = ArenaSink(aux_layer_ids=ids, eager=False)
            if eager and rank in (None, 0):
                arena.start_in_background(arena.device if arena.device is not None else gpu)
            sink = arena
        _SINK = sink
        logger.info(
            "spec capture: capture-arena %s placement, %s publication",
            sink.placement,
            "device" if gpu_put_enabled() else "host",
        )
        _METRICS = metrics.register(sink)
    return _SINK


def get_sink() -> Optional["ArenaSink | StoreSink"]:
    """The sink :func:`maybe_init_sink` created, or None."""
    return _SINK


def SpecCaptureSink(aux_layer_ids: Optional[list[int]] = None) -> "ArenaSink | StoreSink":
    """A sink of the placement the environment selects (the replaced module's class name, for
    callers that construct one themselves): :func:`capture_arena.new_sink`."""
    return new_sink(aux_layer_ids=list(aux_layer_ids) if aux_layer_ids else None)


def reset_sink() -> None:
    """Forgets the sink (closing it) and its metrics. A forked child forgets the parent's
    automatically: the writer thread does not survive a fork, and the parent's arena stays the
    parent's."""
    global _SINK, _METRICS
    if _METRICS is not None:
        metrics.unregister(_METRICS)
        _METRICS = None
    if _SINK is not None and os.getpid() == _PID:
        _SINK.close()
    _SINK = None


def _after_fork_in_child() -> None:
    global _SINK, _METRICS, _PID
    _SINK = None  # the parent's; its destructor leaves the parent's arena alone
    _METRICS = None  # metrics forgets the parent's registration itself
    _PID = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)

if __name__ == "__main__":
    from . import _install

    raise SystemExit(_install.main())
