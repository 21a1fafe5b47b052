"""capture-arena as SGLang's ``sglang.srt.spec_capture_sink``: the module SpecForge's SGLang patches
add, with the same module-level names and semantics, for every published version of the patch
(v0.5.18, v0.5.20, main-923e4a56, kimi-k3, online-live over v0.5.14).

What the patched scheduler calls, by patch (``python -m capture_arena.sglang check`` says which
one an installation has):

- every patch: ``maybe_init_sink(server_args)`` once per scheduler process (every rank), then
  ``get_sink()`` on attention-TP rank 0 when requests finish;
- asynchronous patches (v0.5.14 since August, v0.5.18, v0.5.20, main, kimi-k3's main):
  ``get_sink().submit_samples(samples)`` per scheduler batch, then ``future.result()``;
  ``gpu_put_enabled()`` per batch (v0.5.20, main);
- synchronous patches (kimi-k3 at f8493a4, v0.5.14 before August, online-live's base):
  ``get_sink().put_sample(spec, aux=, last_hidden=)`` on the scheduler thread, per request;
- online-live: ``maybe_live_spec(rid)`` for every request on every rank, capture on or off, and
  ``get_sink().put_sample_live(spec, aux=, last_hidden=, tokens=)`` for a sampled request.

To put this module behind that import in an SGLang installation with a patch applied::

    python -m capture_arena.sglang install      # [--sglang-dir DIR]; `uninstall`, `check`

What differs from the module it replaces, and why:

- Nothing the scheduler calls raises for a request or the machine (the patches call
  ``submit_samples``, ``put_sample_live``, ``maybe_live_spec`` and ``gpu_put_enabled`` without a
  ``try``, so an exception would end the scheduler process): each sample gets its row, a result
  or ``{"sample_id", "error"}``, and a bad request costs only its own row.
- ``put_sample`` on the scheduler thread never creates the arena or waits out a full arena's
  ``SGLANG_SPEC_CAPTURE_ARENA_WAIT_S``: it waits at most ``SGLANG_SPEC_CAPTURE_SYNC_WAIT_S``
  (1 s) for its sample to start, else that sample's row is an error. Under a synchronous patch
  the arena (or the store connection) is made in the background when the server starts, on the
  capturing rank, so the first captures find it.
- Live capture (:mod:`capture_arena._live`) never makes the scheduler wait on the network.
- The placement follows ``MOONCAKE_PROTOCOL`` / ``SGLANG_SPEC_CAPTURE_PLACEMENT``
  (:func:`capture_arena.placement`): the Mooncake store as before under ``tcp``/``rdma`` (with
  SpecForge's device publication under ``rdma``), an arena in device memory under ``nvlink``.
- Setting errors (a bad variable, ``SGLANG_SPEC_CAPTURE_GPU_PUT`` off with ``nvlink``/``nvlink_intra``,
  ``SGLANG_SPEC_CAPTURE_GPU_PUT=1`` with the store placement but without ``rdma``, a bad intake
  URL) are raised by ``maybe_init_sink``, when the server starts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

from .. import _logs
from .. import _patches, metrics
from .._capture_arena import _env_flag, placement
from .._sink import ArenaSink, new_sink
from .._live import intake_wait_s
from .._store import StoreSink, check_store_gpu_put, store_gpu_put
from ..errors import ConfigError

__all__ = [
    "maybe_init_sink",
    "get_sink",
    "gpu_put_enabled",
    "maybe_live_spec",
    "reset_sink",
    "SpecCaptureSink",
]

logger = _logs.get(__name__)

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
    """``SGLANG_SPEC_CAPTURE_GPU_PUT`` as the core spells flags; ConfigError for another value."""
    return _env_flag("SGLANG_SPEC_CAPTURE_GPU_PUT")


def _device_publication() -> bool:
    """What the environment selects, without raising (a bad setting is raised by
    :func:`maybe_init_sink`, when the server starts)."""
    try:
        where = placement()
    except Exception:
        return False
    if where == "store":
        return store_gpu_put()
    protocol = os.environ.get("MOONCAKE_PROTOCOL", "").strip().lower()
    try:
        return protocol in ("nvlink", "nvlink_intra") or _env_gpu_put() is True
    except ConfigError:
        return False


def gpu_put_enabled() -> bool:
    """True when the scheduler hands the sink device tensors: the placement publishes from GPU
    memory (``nvlink`` always; ``SGLANG_SPEC_CAPTURE_GPU_PUT=1`` for capture-arena's own arena;
    for the Mooncake store SpecForge's rule: on by default under ``MOONCAKE_PROTOCOL=rdma`` when
    torch sees CUDA, ``=1`` on); False when it copies them to the host first. The sink's own
    answer once it exists; never raises (the v0.5.20 scheduler calls it on every batch, on
    every rank, capture on or off)."""
    sink = _SINK
    if sink is not None:
        try:
            return bool(sink.device_publication)
        except Exception:
            return False
    return _device_publication()


_MAX_PENDING = "SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES"


def _check_settings() -> None:
    """Raises ConfigError for settings the server must not start with: the core reads and checks
    every variable (flags spelled its way, ``SGLANG_SPEC_CAPTURE_GPU_PUT`` off under ``nvlink``
    refused); the store placement adds SpecForge's rule."""
    if placement() == "store":
        check_store_gpu_put()
    # SpecForge's asynchronous patch reads this one itself, with int(), at every batch: a value
    # int() refuses (a blank one, which the core takes as unset) would end the scheduler there.
    raw = os.environ.get(_MAX_PENDING)
    if raw is not None:
        try:
            ok = int(raw) >= 1
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(
                f"{_MAX_PENDING}={raw[:40]!r}: SpecForge's patch reads it as an integer at every batch; "
                "set an integer >= 1, or unset it (2)"
            )


def _scheduler_state() -> tuple[Optional[int], Optional[int]]:
    """``(attention-TP rank, GPU)`` of the SGLang scheduler calling :func:`maybe_init_sink`, or
    None where the caller is not one: its ``self.ps.attn_tp_rank`` and ``self.ps.gpu_id``
    (SGLang up to 0.5.20; ``self.gpu_id`` before), else SGLang's process-wide runtime context
    (``get_parallel().attn_tp_rank``, ``get_device().gpu_id``: 0.5.23), read only if SGLang has
    imported it."""
    try:
        frame = sys._getframe(2)
    except ValueError:  # called from the top of the stack: no scheduler above
        frame = None
    for _ in range(4):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        ps = getattr(owner, "ps", None)
        rank = getattr(ps, "attn_tp_rank", None)
        if isinstance(rank, int):
            gpu = getattr(ps, "gpu_id", getattr(owner, "gpu_id", None))
            return rank, gpu if isinstance(gpu, int) else None
        frame = frame.f_back
    ctx = sys.modules.get("sglang.srt.runtime_context")
    try:
        rank = getattr(ctx, "get_parallel")().attn_tp_rank
        gpu = getattr(ctx, "get_device")().gpu_id
    except Exception:
        return None, None
    return (rank if isinstance(rank, int) else None), (gpu if isinstance(gpu, int) else None)


def _patch_variant() -> Any:
    """The SpecForge patch of the SGLang this process runs (read from the patched files once,
    at start), or None where that is not known (no SGLang imported, files unreadable)."""
    srt = sys.modules.get("sglang.srt")
    paths = list(getattr(srt, "__path__", None) or [])
    if not paths:
        return None
    try:
        return _patches.detect(Path(paths[0]))
    except Exception:
        logger.debug("spec capture: could not tell which SpecForge patch this SGLang has", exc_info=True)
        return None


def _eager(variant: Any) -> bool:
    """``SGLANG_SPEC_CAPTURE_ARENA_EAGER``: ``1`` makes the arena when the server starts, ``0``
    at the first capture; unset, when the server starts under a synchronous patch (whose
    scheduler thread would otherwise meet an arena still being made)."""
    v = _env_flag("SGLANG_SPEC_CAPTURE_ARENA_EAGER")
    if v is not None:
        return v
    return bool(getattr(variant, "synchronous", False))


def maybe_init_sink(server_args: Any) -> Optional["ArenaSink | StoreSink"]:
    """Creates this process's sink if ``server_args.enable_spec_capture`` is set (once) and
    returns it; None when capture is off.

    Checks the settings (raising :class:`ConfigError` naming the variables, so a misconfigured
    server does not start). The arena is created (or the Mooncake store connected) on a
    background thread: at the first capture, or now on the capturing rank (attention-TP rank 0,
    read from the calling scheduler; on its GPU for a device arena) under a synchronous patch
    or with ``SGLANG_SPEC_CAPTURE_ARENA_EAGER=1``. ``aux_layer_ids`` come from
    ``server_args.spec_capture_aux_layer_ids``; with ``server_args.spec_capture_intake_url``
    live capture starts (every rank fetches the intake's config in the background, so every
    rank decides alike which requests are captured), sampling
    ``server_args.spec_capture_sample_rate``.
    """
    global _SINK, _METRICS
    if not getattr(server_args, "enable_spec_capture", False):
        return None
    if _SINK is None:
        _check_settings()
        ids = _layer_ids(getattr(server_args, "spec_capture_aux_layer_ids", None))
        intake = getattr(server_args, "spec_capture_intake_url", None)
        rate = getattr(server_args, "spec_capture_sample_rate", 1.0)
        rank, gpu = _scheduler_state()
        variant = _patch_variant()
        # Under the default, only a rank known to capture starts early (an unknown rank could be
        # any of the TP ranks: each would take an arena); SGLANG_SPEC_CAPTURE_ARENA_EAGER=1 also
        # starts where the rank is unknown, as before.
        forced = _env_flag("SGLANG_SPEC_CAPTURE_ARENA_EAGER") is True
        capturing = rank == 0 or (rank is None and forced)
        sink: "ArenaSink | StoreSink"
        if placement() == "store":
            store = StoreSink(aux_layer_ids=ids)
            if capturing and _eager(variant):
                store.start_in_background()
            sink = store
        else:
            arena = ArenaSink(aux_layer_ids=ids, eager=False)
            if capturing and _eager(variant):
                arena.start_in_background(arena.device if arena.device is not None else gpu)
            sink = arena
        # put_sample is called on the scheduler thread: it waits a bounded time.
        sink.sync_bound = sink.sync_wait_s
        if intake:
            try:
                # Under tensor parallelism every rank must decide alike from the first request:
                # the intake's config is fetched before the scheduler serves (bounded).
                tp = getattr(server_args, "tp_size", 1)
                wait = intake_wait_s() if not isinstance(tp, int) or tp > 1 else None
                sink.start_live(intake, 1.0 if rate is None else rate, config_wait_s=wait)
            except Exception:
                sink.close()
                raise
        _SINK = sink
        logger.info(
            "spec capture: capture-arena %s placement, %s publication%s%s",
            sink.placement,
            "device" if gpu_put_enabled() else "host",
            f", SpecForge patch: {variant.name}" if variant is not None else "",
            f", live capture from {sink.intake_url} at rate {sink.sample_rate:g}" if intake else "",
        )
        _METRICS = metrics.register(sink)
    return _SINK


def get_sink() -> Optional["ArenaSink | StoreSink"]:
    """The sink :func:`maybe_init_sink` created, or None."""
    return _SINK


def maybe_live_spec(rid: Any) -> Optional[dict[str, Any]]:
    """The live spec of request ``rid`` when this server captures serving traffic and samples
    it (the online-live patch calls this for every request on every rank, capture on or off,
    without a ``try``): None without a sink, without an intake, before the intake's config is
    known, or when the request is not sampled. Never raises."""
    sink = _SINK
    if sink is None:
        return None
    try:
        return sink.maybe_live_spec(rid)
    except Exception:
        logger.warning("spec capture: maybe_live_spec(%r) failed", rid, exc_info=True)
        return None


def SpecCaptureSink(
    aux_layer_ids: Optional[list[int]] = None, *, intake_url: Optional[str] = None, sample_rate: float = 1.0
) -> "ArenaSink | StoreSink":
    """A sink of the placement the environment selects (the replaced module's class name and
    arguments, for callers that construct one themselves): :func:`capture_arena.new_sink`, with
    live capture on when ``intake_url`` is given."""
    sink = new_sink(aux_layer_ids=list(aux_layer_ids) if aux_layer_ids else None)
    if intake_url:
        try:
            sink.start_live(intake_url, sample_rate)
        except Exception:
            sink.close()
            raise
    return sink


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
