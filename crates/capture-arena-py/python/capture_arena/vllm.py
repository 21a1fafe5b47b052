"""capture-arena as vLLM's hidden-states connector (vLLM >= 0.18, the v1 engine).

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
  requests finish their prompt in this step, with their blocks and prompt tokens.
- The worker's connector copies those rows out of the cache-only layer in :meth:`wait_for_save`,
  the first hook after the drafter has written them (``get_finished`` runs before it, and would
  read the previous step's rows), and publishes them as one batch. Only tensor-parallel rank 0
  writes. The result goes to the scheduler process over a local socket before the step ends.
- :meth:`request_finished` (scheduler process, same step) returns it. It frees the KV blocks at
  once (nothing is copied later), so the engine never holds blocks for the trainer.

Per request, ``kv_transfer_params`` is ``{"capture_arena": result, "handle": key_prefix}``:
``result`` is the wire contract's (``features.hidden_states``: ``[1, n, k*H]`` in the model's
dtype; ``features.token_ids``: ``[1, n]`` int64, a passthrough; ``aux_layer_ids``: the layers in
the order stored, ascending) or, for a request that could not be published, ``{"sample_id",
"error"}``, and no handle. A full arena (bounded by ``SGLANG_SPEC_CAPTURE_SYNC_WAIT_S``, 1 s: the
engine step is never held for the arena's 30 s), a request longer than the arena, or a failed
copy costs only that request its error; nothing raises into vLLM's engine loop.

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
import json
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from ._capture_arena import _result_keys
from ._live import sync_wait_s
from ._sink import ArenaSink

__all__ = ["CaptureArenaConnector", "DEFAULT_ARENA_BYTES", "STORE_ID"]

log = logging.getLogger("capture_arena.vllm")

#: The arena's size when neither ``arena_bytes`` nor ``SGLANG_SPEC_CAPTURE_ARENA_BYTES`` is set.
DEFAULT_ARENA_BYTES = 1 << 30
#: The ``store_id`` of every key when ``kv_connector_extra_config`` names none.
STORE_ID = "vllm"
#: Results the scheduler process keeps for requests it has not finished yet (oldest dropped).
MAX_WAITING_RESULTS = 65536
#: The longest result line the scheduler process reads from the worker.
MAX_LINE = 1 << 20
#: The least time a request of a step is given once the step's bound is spent (by a request
#: before it that waited for frees): enough for the writer to place it if it fits.
MIN_TRY_S = 0.05
#: Connections the scheduler process accepts from workers at once.
MAX_WORKERS = 16


@dataclass
class _Save:
    req_id: str
    block_ids: list[int]
    token_ids: list[int]


@dataclass
class CaptureArenaMetadata(KVConnectorMetadata):
    """What the scheduler process tells the worker each step: the requests whose prompt
    finishes in it."""

    saves: list[_Save] = field(default_factory=list)


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


class CaptureArenaConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector for capture-arena (see the module's description)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if getattr(vllm_config, "speculative_config", None) is None or vllm_config.speculative_config.method != "extract_hidden_states":
            raise ValueError(
                "capture_arena.vllm needs vLLM's extract_hidden_states method: add --speculative-config "
                "'{\"method\": \"extract_hidden_states\", \"num_speculative_tokens\": 1, \"draft_model_config\": "
                "{\"hf_config\": {\"eagle_aux_hidden_state_layer_ids\": [...]}}}'"
            )
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self._store_id = str(extra.get("store_id", STORE_ID))
        self._arena_bytes = extra.get("arena_bytes")
        self._channel = _channel(vllm_config)
        self._bound = sync_wait_s()
        self._aux_layer_ids = _aux_layer_ids(vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            self._group, self._block_size = _hidden_group(kv_cache_config)
            self._requests: dict[str, Any] = {}
            self._announced: set[str] = set()
            self._results: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
            #: Requests answered with an error because their result was late: freed on arrival.
            self._given_up: collections.OrderedDict[str, bool] = collections.OrderedDict()
            self._cond = threading.Condition()
            self._listener = _Listener(self._channel, self._deliver)
        else:
            self._sink: Optional[ArenaSink] = None
            self._kv: Optional[torch.Tensor] = None
            self._conn: Optional[socket.socket] = None

    # -- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = request

    def build_connector_meta(self, scheduler_output: Any) -> CaptureArenaMetadata:
        """The requests whose last prompt token is computed in this step (each once, even after
        a preemption recomputes it), with the blocks that hold their rows."""
        meta = CaptureArenaMetadata()
        for rid, scheduled in scheduler_output.num_scheduled_tokens.items():
            req = self._requests.get(rid)
            if req is None or rid in self._announced:
                continue
            before, n = int(req.num_computed_tokens), int(req.num_prompt_tokens)
            if not before < n <= before + int(scheduled):
                continue
            manager = self._kv_cache_manager
            if manager is None:  # bound by the scheduler before its first step
                continue
            blocks = list(manager.get_block_ids(rid)[self._group])
            need = -(-n // self._block_size)
            if len(blocks) < need or req.prompt_token_ids is None:
                continue  # not the layout this connector knows (prompt embeddings): no capture
            meta.saves.append(_Save(rid, blocks[:need], list(req.prompt_token_ids)))
            self._announced.add(rid)
        return meta

    def _deliver(self, req_id: str, row: dict[str, Any]) -> Optional[list[str]]:
        """Keeps a result for :meth:`request_finished`; returns the keys the worker must free
        when its request was already answered with an error."""
        with self._cond:
            late = self._given_up.pop(req_id, False)
            if not late:
                self._results[req_id] = row
                while len(self._results) > MAX_WAITING_RESULTS:
                    dropped, _ = self._results.popitem(last=False)
                    log.warning("capture_arena.vllm: dropped the result of %s, never finished by the engine", dropped)
                self._cond.notify_all()
        if late and "error" not in row:
            # Its request was answered with an error already: nobody will read or free it. The
            # worker frees it (it holds the control token, which may be a random `auto` one).
            log.warning("capture_arena.vllm: the result of %s came after its request was answered; the worker frees it", req_id)
            return _result_keys(row)
        return None

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """The request's arena result for its ``kv_transfer_params``; its blocks are freed at
        once (``False``): the rows were copied in the step that computed them."""
        rid = request.request_id
        self._requests.pop(rid, None)
        if rid not in self._announced:
            return False, {"capture_arena": {"sample_id": rid, "error": "no hidden states: the request ended before its prompt was computed"}}
        self._announced.discard(rid)
        deadline = time.monotonic() + self._bound
        with self._cond:
            while rid not in self._results:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            row = self._results.pop(rid, None)
        if row is None:
            with self._cond:
                self._given_up[rid] = True
                while len(self._given_up) > MAX_WAITING_RESULTS:
                    self._given_up.popitem(last=False)
            row = {
                "sample_id": rid,
                "error": f"the worker sent no result within {self._bound:g} s (SGLANG_SPEC_CAPTURE_SYNC_WAIT_S); "
                "see the worker's log",
            }
        params: dict[str, Any] = {"capture_arena": row}
        if "error" not in row:
            params["handle"] = f"{row['store_id']}/{row['sample_id']}/g{row['gen']}/"
        return False, params

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
        # A device arena (SGLANG_SPEC_CAPTURE_GPU_PUT=1) lives on the cache's GPU unless
        # SGLANG_SPEC_CAPTURE_ARENA_DEVICE says otherwise.
        self._sink.start_in_background(kv.device.index if kv.is_cuda else None)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        """Publishes the requests whose prompt finished in this step (the drafter has written
        their rows), as one batch, and sends each result to the scheduler process. Never
        raises: a request that cannot be published gets its error row."""
        if self._sink is None or self._kv is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        saves = getattr(meta, "saves", None)
        if not saves:
            return
        # Each request is a batch of its own (a batch is published whole or not at all, and one
        # request's size must not cost the others theirs); together they wait at most the bound.
        deadline = time.monotonic() + self._bound
        out = []
        for s in saves:
            try:
                left = max(MIN_TRY_S, deadline - time.monotonic())
                (row,) = self._sink.put_samples([self._sample(s)], within_s=left)
            except Exception as e:  # a bug of ours or a broken cache: the request's error, never vLLM's
                log.exception("capture_arena.vllm: publishing request %s failed", s.req_id)
                row = {"sample_id": s.req_id, "error": f"publish failed: {e}"}
            out.append((s.req_id, row))
        self._send(out)

    def _sample(self, s: _Save) -> tuple[dict[str, Any], torch.Tensor, None]:
        """One request's rows ``[1, n, k*H]`` copied out of the cache (position i is slot
        ``block_ids[i // block_size] * block_size + i % block_size``) with its token ids."""
        assert self._kv is not None
        kv = self._kv
        bs = kv.shape[2]
        n = len(s.token_ids)
        pos = torch.arange(n, device=kv.device)
        blocks = torch.tensor(s.block_ids, dtype=torch.long, device=kv.device)[pos // bs]
        rows = kv[blocks, :, pos % bs]  # [n, k, H]: the two indexed dimensions come first
        aux = rows.reshape(n, rows.shape[1] * rows.shape[2])  # stored as [1, n, k*H]
        spec = {
            "store_id": self._store_id,
            "sample_id": s.req_id,
            "features": {"aux": "hidden_states"},
            "passthrough": [{"name": "token_ids", "data": np.asarray(s.token_ids, dtype=np.int64), "shape": [1, n]}],
        }
        return spec, aux, None

    def _send(self, rows: list[tuple[str, dict[str, Any]]]) -> None:
        data = b"".join(json.dumps({"req_id": rid, "row": row}, separators=(",", ":")).encode() + b"\n" for rid, row in rows)
        for attempt in (0, 1):
            try:
                if self._conn is None:
                    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    c.settimeout(self._bound + 1.0)
                    c.connect(self._channel)
                    uid = _peer_uid(c)
                    if uid != os.getuid():  # an abstract name anyone could have bound
                        c.close()
                        raise OSError(f"the result channel's listener runs as uid {uid}, not {os.getuid()}")
                    self._conn = c
                    threading.Thread(target=self._read_frees, args=(c,), name="capture-arena-vllm-frees", daemon=True).start()
                self._conn.sendall(data)
                return
            except OSError as e:
                if self._conn is not None:
                    try:  # wakes the frees reader blocked on it, before the descriptor goes
                        self._conn.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    self._conn.close()
                    self._conn = None
                if attempt:
                    log.error("capture_arena.vllm: could not hand %d results to the scheduler process: %s", len(rows), e)
                    self._free_rows([r for _, r in rows])

    def _read_frees(self, conn: socket.socket) -> None:
        """The worker's end of the channel's way back: ``{"free": [key, ...]}`` lines for results
        that came after their request was answered. Bounded lines; a bad one closes the
        connection (the next step opens another)."""
        try:
            for keys in _lines(conn, lambda m: m["free"]):
                if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                    raise ValueError('a free line is {"free": [str, ...]}')
                if keys and self._sink is not None:
                    self._sink._free_local(keys)
        except OSError as e:  # closed by _send after a failed send, or the scheduler process ended
            log.debug("capture_arena.vllm: the result channel closed: %s", e)
        except Exception as e:
            log.error("capture_arena.vllm: stopped reading frees from the scheduler process: %s", e)

    def _free_rows(self, rows: list[dict[str, Any]]) -> None:
        """Frees what was published for requests whose result cannot reach their client."""
        if self._sink is not None:
            for r in rows:
                if "error" not in r:
                    self._sink._drop_published(r)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        return None, None

    def shutdown(self) -> None:
        if getattr(self, "_sink", None) is not None:
            self._sink.close()  # type: ignore[union-attr]
        if getattr(self, "_listener", None) is not None:
            self._listener.close()


def _peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED)."""
    return int(struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1])


def _lines(conn: socket.socket, field: Any) -> Any:
    """Yields ``field(message)`` for each JSON line read from ``conn`` until it closes; a line
    over :data:`MAX_LINE` bytes raises ValueError before it is buffered further."""
    buf = b""
    while True:
        try:
            chunk = conn.recv(1 << 16)
        except socket.timeout:
            continue  # an idle channel: results come only when prompts finish
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield field(json.loads(line))
        if len(buf) > MAX_LINE:
            raise ValueError(f"a line over {MAX_LINE} bytes")


class _Listener:
    """The scheduler process's end of the result channel: accepts the worker's connections
    (same user only), reads bounded JSON lines, and hands each ``(req_id, row)`` on. A bad line
    closes only its connection."""

    def __init__(self, name: str, deliver: Any) -> None:
        self._deliver = deliver
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(name)
        self._sock.listen(MAX_WORKERS)
        self._open = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="capture-arena-vllm", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            uid = _peer_uid(conn)
            with self._lock:
                full = self._open >= MAX_WORKERS
                if not full and uid == os.getuid():
                    self._open += 1
            if uid != os.getuid() or full:
                log.warning("capture_arena.vllm: refused a result connection (uid %d, %d open)", uid, self._open)
                conn.close()
                continue
            threading.Thread(target=self._read, args=(conn,), name="capture-arena-vllm-read", daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        try:
            for rid, row in _lines(conn, lambda m: (m["req_id"], m["row"])):
                if not isinstance(rid, str) or not isinstance(row, dict):
                    raise ValueError("a result line is {\"req_id\": str, \"row\": dict}")
                free = self._deliver(rid, row)
                if free:
                    conn.sendall(json.dumps({"free": free}, separators=(",", ":")).encode() + b"\n")
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.error("capture_arena.vllm: closed a result connection: %s", e)
        finally:
            conn.close()
            with self._lock:
                self._open -= 1

    def close(self) -> None:
        """Stops listening: the name is free again and the accepting thread ends (closing alone
        would leave both while that thread waits in accept)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
