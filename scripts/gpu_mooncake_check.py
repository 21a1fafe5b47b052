"""The engine placement over NVLink on one GPU machine (run by scripts/gpu-check.sh when Mooncake's
CUDA wheel was carried along; needs torch with CUDA).

Under ``MOONCAKE_PROTOCOL=nvlink_intra`` a producer process's sink takes its arena from a
TransferEngine (``allocate_managed_buffer``: cudaMalloc + CUDA IPC) and publishes torch CUDA
tensors into it. Two trainer processes read them: one that imports only ``mooncake.engine``,
``torch``, ``json`` and ``socket`` (``transfer_sync_read`` into a registered CUDA buffer, frees
over the control socket), and one with ``capture_arena.ArenaFeatureStore.get(device="cuda:0")``.
Every byte is compared; at the end the producer's arena must be fully free. Then the readiness
rule over NVLink (docs/protocol.md): the producer hands out two results before their bytes
(``reserve_each``, as vLLM's connector does); a trainer (``ArenaFeatureStore``) starts reading
the first, the producer writes it only after, and the trainer must wait for it and read exactly
its bytes; the second's write fails, and the trainer must get ``WriteFailedError``. One JSON line
per check; exit status 0 only if all passed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ENV = {
    **os.environ,
    "MOONCAKE_PROTOCOL": "nvlink_intra",
    "MC_INTRANODE_NVLINK": "true",
    "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
    "SGLANG_SPEC_CAPTURE_ARENA_BYTES": "512MiB",
    "GLOG_minloglevel": "2",
}

COMMON = r"""
import torch
def make(i, L=1024, H=2048):
    g = torch.Generator(device="cuda").manual_seed(i)
    return (torch.randn(L, 3 * H, generator=g, device="cuda").to(torch.bfloat16),
            torch.randn(L, H, generator=g, device="cuda").to(torch.bfloat16))
"""

PRODUCER = COMMON + r"""
import json, sys, time
import capture_arena as ca
sink = ca.new_sink()
assert sink.placement == "engine", sink.placement
def drained():  # waits (at most 120 s) until the trainers freed everything, then says the stats
    deadline = time.time() + 120
    while time.time() < deadline and sink.stats()["resident_objects"]:
        time.sleep(0.05)
    print(json.dumps({"stats": sink.stats()}), flush=True)
for b in range(2):
    batch = []
    for i in range(4 * b, 4 * b + 4):
        aux, last = make(i)
        spec = {"store_id": "gpu", "sample_id": f"s{i}", "gen": 1,
                "features": {"aux": "hidden_state", "last_hidden": "target"}}
        batch.append((spec, aux, last))
    for r in sink.put_samples(batch):
        print(json.dumps(r), flush=True)
drained()
# Two results handed out before their bytes; the first written once the main process says a
# trainer is reading it, the second never.
L, H = 1024, 2048
spec = lambda i: {"store_id": "gpu", "sample_id": f"s{i}", "gen": 1,
                  "features": {"hidden_state": {"shape": [1, L, 3 * H], "dtype": "bfloat16"},
                               "target": {"shape": [1, L, H], "dtype": "bfloat16"}}}
early = sink.reserve_each([spec(8), spec(9)], within_s=10)
for r, _ in early:
    print(json.dumps(r), flush=True)
assert sys.stdin.readline().strip() == "go"  # the trainer found them still being written, and waits
class Raw:
    def __init__(self, address, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}
(r8, at8), (r9, _) = early
for name, t in zip(("hidden_state", "target"), make(8)):
    dst = torch.as_tensor(Raw(at8[name], t.numel() * 2), device="cuda")
    dst.copy_(t.contiguous().view(torch.uint8).reshape(-1))
torch.cuda.synchronize()
sink.finish_writes([r8])
sink.finish_writes([r9], ok=False)
drained()
"""

MOONCAKE_ONLY = COMMON + r"""
import json, socket, sys
from mooncake.engine import TransferEngine
te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "nvlink_intra", "") == 0
ok = True
for line in sys.stdin:
    r = json.loads(line)
    aux, last = make(int(r["sample_id"][1:]))
    for name, want in (("hidden_state", aux), ("target", last)):
        f = r["features"][name]
        n = want.numel() * 2
        buf = torch.empty(n, dtype=torch.uint8, device="cuda")
        assert te.register_memory(buf.data_ptr(), n) == 0
        assert te.transfer_sync_read(r["arena"]["session"], buf.data_ptr(), f["address"], n) == 0
        te.unregister_memory(buf.data_ptr())
        ok = ok and torch.equal(buf, want.contiguous().view(torch.uint8).reshape(-1))
    host, port = r["arena"]["control"].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as c:
        c.sendall((json.dumps([f"gpu/{r['sample_id']}/g1/{n}" for n in r["features"]]) + "\n").encode())
print(json.dumps({"check": "mooncake_only_trainer", "ok": bool(ok)}), flush=True)
"""

ARENA_STORE = COMMON + r"""
import json, sys
import capture_arena as ca
store = ca.ArenaFeatureStore()
ok = True
for line in sys.stdin:
    r = json.loads(line)
    aux, last = make(int(r["sample_id"][1:]))
    got = store.get(r, device="cuda:0")
    ok = ok and got["hidden_state"].is_cuda and torch.equal(got["hidden_state"][0], aux) and torch.equal(got["target"][0], last)
    store.release(r)
store.flush()
print(json.dumps({"check": "arena_feature_store_trainer", "ok": bool(ok)}), flush=True)
"""


EARLY = COMMON + r"""
import json, sys, time
import capture_arena as ca
import capture_arena._engine as engine
# Says when the reader first finds a word saying "still being written" (r8's: the producer
# writes it only after this line).
said, check_words = [], engine._check_words
def first_pending_said(checks, found):
    pending = check_words(checks, found)
    if pending is not None and not said:
        said.append(print(json.dumps({"waiting": True}), flush=True))
    return pending
engine._check_words = first_pending_said
store = ca.ArenaFeatureStore()
torch.cuda.init()
store._engines()._engines.get()  # the engine made before the read, so that its first look is timely
r8, r9 = (json.loads(line) for line in sys.stdin)
t0 = time.monotonic()
got = store.get(r8, device="cuda:0")
waited = time.monotonic() - t0
aux, last = make(8)
exact = torch.equal(got["hidden_state"][0], aux) and torch.equal(got["target"][0], last)
# Asked for host tensors (no device): read on the current GPU, then copied to the host.
host = store.get(r8, torch=True)
on_host = host["hidden_state"].device.type == "cpu" and torch.equal(host["hidden_state"][0], aux.cpu())
store.release(r8)
try:
    store.get(r9, device="cuda:0")
    failed = "read"
except ca.CaptureArenaError as e:
    failed = type(e).__name__
store.flush(10)
print(json.dumps({"check": "nvlink_reader_waits_for_early_results", "ok": bool(exact) and bool(on_host) and bool(said) and failed == "WriteFailedError",
                  "exact": bool(exact), "host_read": bool(on_host), "waited": bool(said), "read_s": round(waited, 3), "failed_write": failed}), flush=True)
"""


def arena_free(prod: "subprocess.Popen[str]", check: str) -> bool:
    """The producer's next stats line says its arena is wholly free (said as ``check``)."""
    assert prod.stdout is not None
    line = prod.stdout.readline()
    st = json.loads(line)["stats"] if line.startswith("{") else None
    free = st is not None and st["resident_objects"] == 0 and st["free_bytes"] == st["capacity"]
    print(json.dumps({"check": check, "ok": free, "stats": st if st is not None else line}), flush=True)
    return free


def main() -> int:
    prod = subprocess.Popen([sys.executable, "-c", PRODUCER], env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert prod.stdin is not None and prod.stdout is not None
    lines = [prod.stdout.readline() for _ in range(8)]
    if not all(line.startswith("{") for line in lines):
        print(json.dumps({"check": "publish", "ok": False, "got": lines}))
        prod.kill()
        return 1
    print(json.dumps({"check": "publish", "ok": True, "session": json.loads(lines[0])["arena"]["session"]}), flush=True)
    failures = 0
    for code, batch in ((MOONCAKE_ONLY, lines[:4]), (ARENA_STORE, lines[4:])):
        t = subprocess.run([sys.executable, "-c", code], env=ENV, input="".join(batch), capture_output=True, text=True, timeout=180)
        out = t.stdout.strip().splitlines()
        ok = t.returncode == 0 and bool(out) and json.loads(out[-1]).get("ok") is True
        failures += not ok
        print(out[-1] if out else json.dumps({"ok": False, "stderr": t.stderr[-2000:]}), flush=True)
    failures += not arena_free(prod, "arena_free_after_frees")
    # The readiness rule over NVLink: a trainer reading results handed out before their bytes.
    early = [prod.stdout.readline() for _ in range(2)]
    reader = subprocess.Popen([sys.executable, "-c", EARLY], env={**ENV, "SGLANG_SPEC_CAPTURE_READY_WAIT_S": "20"},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert reader.stdin is not None and reader.stdout is not None
    try:
        reader.stdin.write("".join(early))
        reader.stdin.close()
        waiting = reader.stdout.readline()  # it found the first still being written
        prod.stdin.write("go\n")
        prod.stdin.flush()
        out = reader.stdout.readline().strip()
        reader.wait(timeout=60)
    except Exception as e:  # a reader or producer that hangs: this check fails, the others stand
        reader.kill()
        prod.kill()
        waiting, out = "", json.dumps({"check": "nvlink_reader_waits_for_early_results", "ok": False, "error": repr(e)})
    ok = waiting.strip() == json.dumps({"waiting": True}) and out.startswith("{") and json.loads(out).get("ok") is True
    failures += not ok
    if not out:  # the reader's error is in its stderr, above
        out = json.dumps({"check": "nvlink_reader_waits_for_early_results", "ok": False, "said": waiting})
    print(out, flush=True)
    failures += not arena_free(prod, "arena_free_after_early_results")
    prod.wait(timeout=60)
    print(json.dumps({"check": "all", "ok": failures == 0}), flush=True)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
