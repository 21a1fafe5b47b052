"""A SpecForge-shaped trainer loop over the arena placement and over the store placement, same
samples, side by side.

A capture server process (SGLang's ``/generate`` reduced to the capture, as in
``tests/test_specforge.py``: each request's capture is published through capture-arena's real sink)
runs once with ``SGLANG_SPEC_CAPTURE_PLACEMENT=arena`` and once with ``=store`` (a
``mooncake_master`` started here). This process is the trainer: SpecForge's own adapter
(``SGLangServerCaptureAdapter``, ``specforge`` 0.2.0 from PyPI, installed with ``--no-deps``) produces refs, and each ref is
read and released the way ``FeatureDataLoader`` does (``get`` then ``release(handle)``), through
``capture_arena.specforge.SpecForgeArenaStore``. Rounds alternate between the two servers.

Figures: samples per second and GB/s of the whole loop (produce refs, which includes the server's
publication, then get, then release), and of the get alone.

Run:  .venv/bin/python crates/capture-arena-py/benches/bench_specforge.py [--tokens 4096] [--hidden 1024] [--batch 4] [--rounds 7] [--json out.json]
(needs torch and the Mooncake wheel; scripts/test.sh installs both)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path[:0] = [str(TESTS)]

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=4096)
ap.add_argument("--hidden", type=int, default=1024)
ap.add_argument("--batch", type=int, default=4)
ap.add_argument("--rounds", type=int, default=7)
ap.add_argument("--json")
ARGS = ap.parse_args()
os.environ.setdefault("GLOG_minloglevel", "2")

from specforge.inference.adapters.server_capture import ServerCaptureSchema, SGLangServerCaptureAdapter  # noqa: E402
from specforge.inference.capture import CaptureConfig  # noqa: E402

import _producer  # noqa: E402  (this directory: reading a child's first JSON line)
from specforge.runtime.contracts import PromptTask, SampleRef  # noqa: E402

import mooncake_master  # noqa: E402  (tests/: starting and stopping a master)

from capture_arena.specforge import SpecForgeArenaStore  # noqa: E402

PRODUCER = r"""
import json, os, sys, threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import SimpleNamespace
import numpy as np, ml_dtypes
from capture_arena import sglang
H = int(os.environ["BENCH_HIDDEN"])
rng = np.random.default_rng(0)
# One tensor pair per sample of a batch (SGLang hands each request its own): the store placement
# registers each source, and overlapping ranges cannot be registered twice.
AUX = [rng.standard_normal((int(os.environ["BENCH_TOKENS"]), 3 * H), dtype=np.float32).astype(ml_dtypes.bfloat16) for _ in range(int(os.environ["BENCH_BATCH"]))]
LAST = [a[:, :H].copy() for a in AUX]
sink = sglang.maybe_init_sink(SimpleNamespace(enable_spec_capture=True, spec_capture_aux_layer_ids="2,5,8"))
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        batch = [(spec, AUX[i][: len(ids)], LAST[i][: len(ids)]) for i, (ids, spec) in enumerate(zip(req["input_ids"], req["spec_capture"]))]
        body = json.dumps([{"meta_info": {"spec_capture": r}} for r in sink.put_samples(batch)]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
srv = HTTPServer(("127.0.0.1", 0), Handler)
print(json.dumps({"port": srv.server_address[1]}), flush=True)
threading.Thread(target=srv.serve_forever, daemon=True).start()
sys.stdin.read()
sink.close()
"""


def start(env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MOONCAKE_", "SGLANG_SPEC_CAPTURE_", "MC_"))}
    e.update(env)
    e.update({"BENCH_TOKENS": str(ARGS.tokens), "BENCH_HIDDEN": str(ARGS.hidden), "BENCH_BATCH": str(ARGS.batch)})
    p = subprocess.Popen([sys.executable, "-c", PRODUCER], env=e, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return p, f"http://127.0.0.1:{_producer.first_json(p, f'the capture server ({env})')['port']}"


def main() -> None:
    master, menv = mooncake_master.start()
    sample_bytes = ARGS.tokens * (4 * ARGS.hidden * 2 + 8)
    servers = {
        "arena": start({"SGLANG_SPEC_CAPTURE_PLACEMENT": "arena", "SGLANG_SPEC_CAPTURE_ARENA_BYTES": str(4 * ARGS.batch * sample_bytes + (64 << 20))}),
        "store": start(
            {
                **menv,
                "SGLANG_SPEC_CAPTURE_PLACEMENT": "store",
                "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(4 * ARGS.batch * sample_bytes + (64 << 20)),
                "MOONCAKE_LOCAL_BUFFER_SIZE": str(64 << 20),
            }
        ),
    }
    # This process reads the store placement through the same master.
    os.environ.update({**menv, "MOONCAKE_LOCAL_BUFFER_SIZE": str(64 << 20), "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0"})
    schema = ServerCaptureSchema(aux_feature="hidden_state", last_hidden_feature="target", passthrough=(("input_ids", "input_ids", ()),))
    capture = CaptureConfig.from_strategy({"hidden_state", "target", "input_ids"}, (2, 5, 8), target_repr="hidden_state", target_hidden_size=ARGS.hidden)
    loops = {}
    for name, (_, url) in servers.items():
        store = SpecForgeArenaStore(store_id=f"bench-{name}")
        adapter = SGLangServerCaptureAdapter(url, store, run_id=name, algorithm="eagle3", schema=schema, timeout_s=120, post_fn=store.post_fn())
        loops[name] = (store, adapter)
    times: dict[str, dict[str, list[float]]] = {n: {"loop": [], "get": []} for n in loops}
    counter = 0
    for r in range(ARGS.rounds + 1):  # the first round warms up (connections, arenas, registrations)
        order = list(loops) if r % 2 == 0 else list(reversed(loops))
        for name in order:
            store, adapter = loops[name]
            tasks = [
                PromptTask(task_id=f"t{counter + i}", run_id=name, source_id="bench", payload={"input_ids": list(range(ARGS.tokens))}, max_length=ARGS.tokens)
                for i in range(ARGS.batch)
            ]
            counter += ARGS.batch
            t0 = time.perf_counter()
            refs = adapter.produce_refs(tasks, capture=capture)
            assert all(isinstance(x, SampleRef) for x in refs), refs
            g = 0.0
            for ref in refs:
                t1 = time.perf_counter()
                tensors, handle = store.get(ref)
                g += time.perf_counter() - t1
                store.release(handle, reason="loaded")
                del tensors
            if r:
                times[name]["loop"].append(time.perf_counter() - t0)
                times[name]["get"].append(g)
    rows = []
    batch_bytes = ARGS.batch * sample_bytes
    print(f"{os.cpu_count()} cores; {ARGS.batch} samples of {ARGS.tokens} tokens, hidden {ARGS.hidden} ({batch_bytes / ARGS.batch / 2**20:.1f} MiB each); median of {ARGS.rounds} rounds")
    for name, t in times.items():
        loop, get = statistics.median(t["loop"]), statistics.median(t["get"])
        rows.append({"placement": name, "loop_s": round(loop, 4), "get_s": round(get, 4), "samples_per_s": round(ARGS.batch / loop, 1), "get_gbps": round(batch_bytes / get / 1e9, 3)})
        print(f"{name:<6} loop {loop * 1e3:8.1f} ms ({ARGS.batch / loop:6.1f} samples/s)   get {get * 1e3:8.1f} ms ({batch_bytes / get / 1e9:5.2f} GB/s)")
    a, s = rows[0], rows[1]
    print(f"arena / store: loop {s['loop_s'] / a['loop_s']:.2f} x, get {s['get_s'] / a['get_s']:.2f} x")
    for store, _ in loops.values():
        store.drain_pending_removals(max_attempts=40)
    for p, _ in servers.values():
        assert p.stdin is not None
        p.stdin.close()
        p.wait(timeout=60)
    mooncake_master.stop(master)
    if ARGS.json:
        pathlib.Path(ARGS.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
