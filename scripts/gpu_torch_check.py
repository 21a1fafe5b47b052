"""The Python device path on a real GPU (run by scripts/gpu-check.sh; needs torch with CUDA).

A producer process publishes torch CUDA tensors (bf16 hidden states made on the GPU by seeded
kernels on the current stream, not synchronised) into a device arena; a trainer process reads
them into CUDA tensors through the imported handle (``get(device="cuda:0")`` and ``out=``),
compares every byte with tensors it regenerates from the same seeds, and frees them. Then:
the producer's arena is completely free; a batch that cannot fit waits for frees (3 s) and fails
whole, an error row per sample; a ``replace`` publishes new bytes at the same addresses and the trainer reads
them. One JSON line per check on stdout; exit status 0 only if all passed.

Usage: python gpu_torch_check.py [--samples N] [--len L] [--hidden H]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import torch

import capture_arena as ca

K = 3  # aux layers


def make(seed: int, length: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    aux = torch.randn(length, K * hidden, generator=g, device="cuda").to(torch.bfloat16)
    last = torch.randn(length, hidden, generator=g, device="cuda").to(torch.bfloat16)
    return aux, last


def spec(sid: str, length: int, replace: bool = False) -> dict[str, Any]:
    return {
        "store_id": "gpu",
        "sample_id": sid,
        "gen": 1,
        "replace": replace,
        "features": {"aux": "hidden_state", "last_hidden": "target"},
        "passthrough": [{"name": "input_ids", "data": list(range(length)), "shape": [1, length], "dtype": "int64"}],
    }


def say(**kv: Any) -> None:
    print(json.dumps(kv), flush=True)


def producer(a: argparse.Namespace) -> int:
    per = a.len * (K + 1) * a.hidden * 2 + a.len * 8
    arena = per * 6  # room for a batch of 4 plus change: later batches wait for frees
    sink = ca.ArenaSink(arena_bytes=arena, gpu_put=True, wait_s=3, device=0)
    for start in range(0, a.samples, 4):
        batch = []
        for i in range(start, min(start + 4, a.samples)):
            aux, last = make(i, a.len, a.hidden)
            batch.append((spec(f"s{i}", a.len), aux, last))
        for r in sink.put_samples(batch):
            print(json.dumps({"result": r, "seed": int(r["sample_id"][1:])}), flush=True)
    sys.stdin.readline()  # the trainer has read and freed everything
    deadline = time.time() + 10
    while time.time() < deadline and sink.stats()["resident_objects"]:
        time.sleep(0.05)
    st = sink.stats()
    print(json.dumps({"phase": "free", "stats": st}), flush=True)
    # Arena full: three samples stay resident, so a batch of four cannot fit until they are
    # freed; it waits (3 s) and fails. Their results go to the trainer afterwards.
    hold = [(spec(f"hold{i}", a.len), *make(3000 + i, a.len, a.hidden)) for i in range(3)]
    for r in sink.put_samples(hold):
        print(json.dumps({"result": r, "seed": 3000 + int(r["sample_id"][4:])}), flush=True)
    big = [(spec(f"big{i}", a.len), *make(1000 + i, a.len, a.hidden)) for i in range(4)]
    t0 = time.time()
    rows = sink.put_samples(big)  # a failed batch is an error row per sample, never an exception
    errors = [r.get("error", "") for r in rows]
    full = {"failed": sum(bool(e) for e in errors), "waited_s": round(time.time() - t0, 2), "message": errors[0][:200]}
    print(json.dumps({"phase": "full", **full, "resident_after": sink.stats()["resident_objects"]}), flush=True)
    # Replace on the device: the same key, new bytes.
    aux, last = make(2000, a.len, a.hidden)
    r1 = sink.put_sample(spec("rep", a.len), aux=aux, last_hidden=last)
    aux, last = make(2001, a.len, a.hidden)
    r2 = sink.put_sample(spec("rep", a.len, replace=True), aux=aux, last_hidden=last)
    print(json.dumps({"result": r2, "seed": 2001, "first_address": r1["features"]["target"]["address"]}), flush=True)
    sys.stdin.readline()
    time.sleep(0.5)
    print(json.dumps({"phase": "end", "stats": sink.stats()}), flush=True)
    sink.close()
    return 0


def trainer(a: argparse.Namespace) -> int:
    store = ca.ArenaFeatureStore()
    for line in sys.stdin:
        msg = json.loads(line)
        r, seed = msg["result"], msg["seed"]
        aux, last = make(seed, a.len, a.hidden)
        t0 = time.perf_counter()
        got = store.get(r, device="cuda:0")
        dt = time.perf_counter() - t0
        ok = torch.equal(got["hidden_state"][0], aux) and torch.equal(got["target"][0], last)
        ok = ok and got["input_ids"].cpu().tolist() == [list(range(a.len))]
        out = {"target": torch.empty(1, a.len, a.hidden, dtype=torch.bfloat16, device="cuda")}
        store.get(r, ["target"], out=out)
        ok = ok and torch.equal(out["target"][0], last)
        store.release(r)
        say(sample=r["sample_id"], ok=bool(ok), read_ms=round(dt * 1e3, 3), session=r["arena"]["session"][:60])
    store.flush()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["main", "producer", "trainer"], default="main")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--len", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=4096)
    a = ap.parse_args()
    if a.role == "producer":
        return producer(a)
    if a.role == "trainer":
        return trainer(a)
    if not torch.cuda.is_available():
        # Without a GPU the producer fails at its first tensor and the trainer would wait for
        # results that never come: say so at once.
        say(check="cuda", ok=False, reason=f"torch {torch.__version__} sees no CUDA device")
        return 1
    flags = ["--samples", str(a.samples), "--len", str(a.len), "--hidden", str(a.hidden)]
    prod = subprocess.Popen([sys.executable, __file__, "--role", "producer", *flags], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    train = subprocess.Popen([sys.executable, __file__, "--role", "trainer", *flags], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert prod.stdin and prod.stdout and train.stdin and train.stdout
    failures = 0

    def forward(line: str) -> None:
        nonlocal failures
        assert train.stdin and train.stdout
        train.stdin.write(line)
        train.stdin.flush()
        ans = json.loads(train.stdout.readline())
        failures += not ans["ok"]
        say(check="read", **ans)

    for _ in range(a.samples):
        forward(prod.stdout.readline())
    prod.stdin.write("\n")
    prod.stdin.flush()
    free = json.loads(prod.stdout.readline())
    st = free["stats"]
    ok = st["resident_objects"] == 0 and st["free_bytes"] == st["capacity"]
    failures += not ok
    say(check="arena_free_after_frees", ok=ok, stats=st)
    held = [prod.stdout.readline() for _ in range(3)]
    full = json.loads(prod.stdout.readline())
    ok = full["failed"] == 4 and "arena full" in full["message"] and full["waited_s"] >= 3
    failures += not ok
    say(check="arena_full_wait", ok=ok, **full)
    for line in held:
        forward(line)
    rep = prod.stdout.readline()
    m = json.loads(rep)
    same = m["result"]["features"]["target"]["address"] == m["first_address"]
    say(check="replace_same_address", ok=same)
    failures += not same
    forward(json.dumps({"result": m["result"], "seed": m["seed"]}) + "\n")
    train.stdin.close()
    train.wait(timeout=60)
    prod.stdin.write("\n")
    prod.stdin.flush()
    end = json.loads(prod.stdout.readline())
    say(check="end", stats=end["stats"])
    prod.wait(timeout=60)
    say(check="all", ok=failures == 0, failures=failures)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
