"""The store placement against a real ``mooncake_master`` on loopback (started here, stopped after
the module, also when a test fails): one object per tensor, results without addresses, a batched
put, ``replace``, nothing half-published, and ArenaFeatureStore reading both what StoreSink put and
what a plain Mooncake writer put."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

import capture_arena as ca

from mooncake_master import needs_mooncake
from test_device import fake_gpu  # noqa: F401 (a fixture)

pytestmark = needs_mooncake


@pytest.fixture(scope="module")
def master() -> Iterator[dict[str, str]]:
    """A mooncake_master with its HTTP metadata server, on loopback ports of its own."""
    import mooncake_master

    p, env = mooncake_master.start()
    try:
        yield {
            **os.environ,
            **env,
            "MOONCAKE_GLOBAL_SEGMENT_SIZE": "48MiB",
            "MOONCAKE_LOCAL_BUFFER_SIZE": "16MiB",
            "GLOG_minloglevel": "2",
        }
    finally:
        mooncake_master.stop(p)


# A producer process: StoreSink publishes the samples each stdin line describes and prints each
# batch's results as one JSON line; it stays up (its segment holds the objects) until stdin ends.
PRODUCER = r"""
import json, sys, numpy as np, ml_dtypes
import capture_arena as ca
from capture_arena import sglang
from types import SimpleNamespace

def data(seed, shape):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)

sink = sglang.maybe_init_sink(SimpleNamespace(enable_spec_capture=True, spec_capture_aux_layer_ids="2,18,33"))
assert isinstance(sink, ca.StoreSink) and sink.placement == "store"
for line in sys.stdin:
    req = json.loads(line)
    if req.get("exists"):
        from capture_arena._store import connect
        print(json.dumps([int(sink._store.is_exist(k)) for k in req["exists"]]), flush=True)
        continue
    if "answers" in req:  # the store's status lists from now on: "short" (none), "error" (-1 each)
        real = getattr(sink._store, "real", sink._store)
        mode = req["answers"]
        class Answers:
            def __init__(self, real):
                self.real = real
            def __getattr__(self, name):
                return getattr(self.real, name)
            def batch_is_exist(self, keys):
                return [] if mode == "short" else [-1] * len(keys)
            def batch_remove(self, keys, force):
                got = self.real.batch_remove(keys, force)
                return [] if mode == "short" else got
        sink._store = Answers(real) if mode else real
        print(json.dumps({}), flush=True)
        continue
    batch = []
    for s in req["samples"]:
        L = s["L"]
        spec = {"store_id": "st", "sample_id": s["id"], "gen": 1, "replace": s.get("replace", False),
                "features": {"aux": "hidden_state", "last_hidden": "target"},
                "passthrough": [{"name": "input_ids", "data": list(range(L)), "shape": [1, L], "dtype": "int64"}]}
        if s.get("empty"):  # a zero-byte tensor beside them
            spec["passthrough"].append({"name": "loss_mask", "data": [], "shape": [1, 0], "dtype": "int64"})
        batch.append((spec, data(s["seed"], (L, s.get("W", 96))), data(s["seed"] + 1, (L, 32))))
    print(json.dumps(sink.put_samples(batch)), flush=True)
print(json.dumps({"stats": sink.stats()}), flush=True)
sink.close()
"""

READER = r"""
import json, sys, numpy as np, ml_dtypes
import capture_arena as ca

def data(seed, shape):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)

store = ca.ArenaFeatureStore()
for line in sys.stdin:
    r, seed, release = json.loads(line)
    got = store.get(r)
    L = r["features"]["target"]["shape"][1]
    W = r["features"]["hidden_state"]["shape"][2]
    ok = (np.array_equal(got["hidden_state"][0].view(np.uint16), data(seed, (L, W)).view(np.uint16))
          and np.array_equal(got["target"][0].view(np.uint16), data(seed + 1, (L, 32)).view(np.uint16))
          and got["input_ids"][0].tolist() == list(range(L))
          and all(got[n].shape == tuple(f["shape"]) for n, f in r["features"].items()))
    if release:
        store.release(r)
        store.flush(10)  # the removal goes out from a thread of its own: wait for it
        try:
            store.get(r)
            ok = False
        except ca.ReleasedError:
            pass
    print(json.dumps({"ok": bool(ok)}), flush=True)
"""


class Proc:
    def __init__(self, code: str, env: dict[str, str]) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, msg: object) -> object:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(json.dumps(msg) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line, f"the process exited ({self.p.poll()})"
        return json.loads(line)

    def finish(self) -> str:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.close()
        out = self.p.stdout.read()
        assert self.p.wait(timeout=60) == 0, out
        return out

    def kill(self) -> None:
        self.p.kill()
        self.p.wait()


def test_store_placement_round_trip_replace_and_nothing_half_published(master):
    prod, reader = Proc(PRODUCER, master), Proc(READER, master)
    try:
        rs = prod.ask({"samples": [{"id": "a", "L": 64, "seed": 1}, {"id": "b", "L": 200, "seed": 3}]})
        assert isinstance(rs, list) and len(rs) == 2
        for r in rs:
            assert set(r) == {"sample_id", "store_id", "gen", "aux_layer_ids", "features"}, r
            assert r["aux_layer_ids"] == [2, 18, 33]
            assert all(set(f) == {"shape", "dtype"} for f in r["features"].values()), r
        assert rs[0]["features"]["hidden_state"] == {"shape": [1, 64, 96], "dtype": "bfloat16"}
        # Bit-exact from another process; "a" stays, "b" is released (removed from the store).
        assert reader.ask([rs[0], 1, False]) == {"ok": True}
        assert reader.ask([rs[1], 3, True]) == {"ok": True}
        keys_b = [f"st/b/g1/{n}" for n in rs[1]["features"]]
        assert prod.ask({"exists": keys_b}) == [0, 0, 0]
        # The same keys again without replace: refused (Mooncake would keep the old bytes and
        # report success), and the resident sample is untouched.
        dup = prod.ask({"samples": [{"id": "a", "L": 64, "seed": 9}]})
        assert isinstance(dup, list) and "already in the store" in dup[0]["error"], dup
        assert reader.ask([rs[0], 1, False]) == {"ok": True}
        # A store that answers no status, or an error, for whether the keys exist: refused too
        # (before: taken as absent, the put answered success over the old bytes, and the result
        # pointed at the first sample's).
        for mode, why in (("short", "answered 0 statuses for whether 3 keys exist"), ("error", "could not tell whether st/a/g1/hidden_state exists (status -1)")):
            prod.ask({"answers": mode})
            dup = prod.ask({"samples": [{"id": "a", "L": 64, "seed": 9}]})
            assert isinstance(dup, list) and why in dup[0].get("error", ""), dup
        prod.ask({"answers": None})
        assert reader.ask([rs[0], 1, False]) == {"ok": True}
        # replace: new bytes under the same keys (Mooncake keeps old bytes on a re-put).
        again = prod.ask({"samples": [{"id": "a", "L": 64, "seed": 7, "replace": True}]})
        assert isinstance(again, list) and "error" not in again[0], again
        assert reader.ask([again[0], 7, True]) == {"ok": True}
        # A put that does not fit the segments: every key of the batch removed, every sample failed.
        big = prod.ask({"samples": [{"id": f"big{i}", "L": 4096, "W": 3 * 1024, "seed": 10 + i} for i in range(3)]})
        assert isinstance(big, list) and all("error" in r for r in big), big
        assert "none kept" in big[0]["error"] and "refused" in big[0]["error"], big[0]
        big_keys = [f"st/big{i}/g1/{n}" for i in range(3) for n in ("hidden_state", "target", "input_ids")]
        assert prod.ask({"exists": big_keys}) == [0] * len(big_keys)
        reader.finish()
        stats = json.loads(prod.finish().strip().splitlines()[-1])["stats"]
        assert stats["published_batches"] == 2 and stats["failed_batches"] == 4, stats
    finally:
        prod.kill()
        reader.kill()


def test_a_zero_byte_tensor_is_in_the_result_and_reads_as_an_empty_array(master):
    """Mooncake cannot store 0 bytes: such a tensor is left out of the put and the read, yet it is
    in the result and reads as an empty array of its shape; a replace and a release of the sample
    go through (before this test, only documented)."""
    prod, reader = Proc(PRODUCER, master), Proc(READER, master)
    keys = [f"st/z/g1/{n}" for n in ("hidden_state", "target", "input_ids", "loss_mask")]
    try:
        rs = prod.ask({"samples": [{"id": "z", "L": 16, "seed": 5, "empty": True}]})
        assert isinstance(rs, list) and "error" not in rs[0], rs
        assert rs[0]["features"]["loss_mask"] == {"shape": [1, 0], "dtype": "int64"}, rs
        assert prod.ask({"exists": keys}) == [1, 1, 1, 0]
        assert reader.ask([rs[0], 5, False]) == {"ok": True}
        again = prod.ask({"samples": [{"id": "z", "L": 16, "seed": 6, "empty": True, "replace": True}]})
        assert isinstance(again, list) and "error" not in again[0], again
        assert reader.ask([again[0], 6, True]) == {"ok": True}
        assert prod.ask({"exists": keys}) == [0, 0, 0, 0]
        reader.finish()
        stats = json.loads(prod.finish().strip().splitlines()[-1])["stats"]
        assert stats["published_batches"] == 2 and stats["failed_batches"] == 0, stats
    finally:
        prod.kill()
        reader.kill()


# A trainer that releases what it read from an exit hook (as speculators' backend does), on a
# Python where no thread can start by then (3.12 and later: "can't create new thread at
# interpreter shutdown"; this interpreter is made to refuse as they do).
RELEASE_AT_EXIT = r"""
import atexit, json, sys, threading
import capture_arena as ca

store = ca.ArenaFeatureStore()
r = json.loads(sys.argv[1])
store.get(r)

def release_at_exit():  # runs before capture_arena's own exit flush (registered after it)
    def start(self, *a, **k):
        raise RuntimeError("can't create new thread at interpreter shutdown")
    threading.Thread.start = start
    store.release(r)

atexit.register(release_at_exit)
"""


def test_a_release_at_exit_with_no_thread_to_be_had_is_removed_by_the_exit_flush(master):
    # Before: the remover thread's start raised out of release (the keys queued, but nothing
    # to remove them), and the exit flush waited its 5 s, then warned: the objects stayed.
    prod = Proc(PRODUCER, master)
    try:
        (r,) = prod.ask({"samples": [{"id": "exiting", "L": 16, "seed": 1}]})
        assert "error" not in r, r
        out = subprocess.run([sys.executable, "-c", RELEASE_AT_EXIT, json.dumps(r)], capture_output=True, text=True, timeout=120, env=master)
        assert out.returncode == 0 and "still wait" not in out.stderr, out.stderr
        assert prod.ask({"exists": [f"st/exiting/g1/{n}" for n in r["features"]]}) == [0, 0, 0], out.stderr
        prod.finish()
    finally:
        prod.kill()


def test_arena_feature_store_reads_what_a_plain_mooncake_writer_put(master):
    writer = r"""
import json, sys, numpy as np, ml_dtypes
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
import os
s = MooncakeDistributedStore()
assert s.setup("127.0.0.1", os.environ["MOONCAKE_METADATA_SERVER"], 48 << 20, 16 << 20, "tcp", "",
               os.environ["MOONCAKE_MASTER_SERVER_ADDR"]) == 0
cfg = ReplicateConfig(); cfg.replica_num = 1; cfg.with_hard_pin = True
L = 50
rng = np.random.default_rng(5)
t = rng.standard_normal((1, L, 32), dtype=np.float32).astype(ml_dtypes.bfloat16)
ids = np.arange(L, dtype=np.int64).reshape(1, L)
for name, a in (("target", t), ("input_ids", ids)):
    b = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    assert s.register_buffer(b.ctypes.data, b.nbytes) == 0
    assert s.put_from(f"st/plain/g1/{name}", b.ctypes.data, b.nbytes, cfg) == 0
print(json.dumps({"sample_id": "plain", "store_id": "st", "gen": 1, "aux_layer_ids": None,
                  "features": {"target": {"shape": [1, L, 32], "dtype": "bfloat16"},
                               "input_ids": {"shape": [1, L], "dtype": "int64"}}}), flush=True)
sys.stdin.readline()
s.close()
"""
    reader = r"""
import json, sys, numpy as np, ml_dtypes
import capture_arena as ca
r = json.loads(sys.stdin.readline())
store = ca.ArenaFeatureStore()
got = store.get(r)
rng = np.random.default_rng(5)
t = rng.standard_normal((1, 50, 32), dtype=np.float32).astype(ml_dtypes.bfloat16)
assert np.array_equal(got["target"].view(np.uint16), t.view(np.uint16))
assert got["input_ids"][0].tolist() == list(range(50))
try:
    store.get({**r, "features": {"x": {"shape": [1, 2 ** 62], "dtype": "int64"}}})
    raise SystemExit("an overflowing shape was read")
except ca.InvalidReadError:
    pass
store.release(r)
print("ok", flush=True)
"""
    w = subprocess.Popen([sys.executable, "-c", writer], env=master, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert w.stdout is not None and w.stdin is not None
        line = w.stdout.readline()
        assert line.startswith("{"), line
        out = subprocess.run([sys.executable, "-c", reader], env=master, input=line, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr
        w.stdin.write("\n")
        w.stdin.flush()
        assert w.wait(timeout=60) == 0
    finally:
        w.kill()
        w.wait()


def test_the_store_placement_connects_at_the_first_capture_and_says_what_failed(monkeypatch):
    # As the sink it replaces: made without a master (the server boots), connected at the first
    # capture; an unreachable master fails that batch's samples with the reason, nothing raises.
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    monkeypatch.delenv("SGLANG_SPEC_CAPTURE_PLACEMENT", raising=False)
    monkeypatch.setenv("MOONCAKE_MASTER_SERVER_ADDR", "127.0.0.1:1")
    monkeypatch.setenv("MOONCAKE_METADATA_SERVER", "P2PHANDSHAKE")
    assert ca.placement() == "store"
    sink = ca.new_sink()
    assert isinstance(sink, ca.StoreSink) and not sink.started
    import numpy as np

    spec = {"store_id": "st", "sample_id": "x", "gen": 1, "features": {"last_hidden": "target"}}
    rows = sink.submit_samples([(spec, None, np.ones((4, 8), dtype=np.float32))]).result(timeout=120)
    assert set(rows[0]) == {"sample_id", "error"} and "mooncake_master" in rows[0]["error"], rows
    sink.close()


@needs_mooncake
def test_a_forked_child_does_not_make_its_parents_queued_store_removals() -> None:
    # A trainer released a store result while the master is unreachable: its removal waits in
    # the queue. A child forked then (a dataloader worker) inherited the queue and made the
    # parent's removals too (and waited for them at exit). Now it starts with none.
    code = """
import os, sys
import capture_arena as ca
reader = ca.ArenaFeatureStore()
reader.release({"store_id": "st", "sample_id": "x", "gen": 1, "features": {"target": {"shape": [1, 4], "dtype": "float32"}}})
assert reader.health()["pending_frees"] == 1, reader.health()
pid = os.fork()
if pid == 0:
    print("child", reader.health()["pending_frees"], flush=True)
    os._exit(0)
os.waitpid(pid, 0)
print("parent", reader.health()["pending_frees"], flush=True)
os._exit(0)
"""
    env = {**os.environ, "MOONCAKE_MASTER_SERVER_ADDR": "127.0.0.1:1", "MOONCAKE_PROTOCOL": "tcp", "MOONCAKE_METADATA_SERVER": "P2PHANDSHAKE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "child 0" in out.stdout and "parent 1" in out.stdout, out.stdout


def test_invalid_samples_are_refused_before_anything_is_written(master, monkeypatch):
    for k in ("MOONCAKE_MASTER_SERVER_ADDR", "MOONCAKE_PROTOCOL"):
        monkeypatch.setenv(k, master[k])
    sink = ca.StoreSink()
    import numpy as np

    spec = {"store_id": "st", "sample_id": "x", "gen": 1, "features": {"aux": "hidden_state"}}
    row = sink.put_sample(spec, aux=None, last_hidden=np.ones((4, 8), dtype=np.float32))
    assert set(row) == {"sample_id", "error"} and "aux" in row["error"], row
    assert not sink.started, "nothing was connected, let alone written"
    sink.close()


# A producer under the fake CUDA driver: a "device" tensor (memory of the fake's cuMemAlloc,
# host memory standing in for a GPU's) whose final bytes arrive by a slow copy on the producer's
# stream, handed to a StoreSink with device publication as the v0.5.20 patch's GPU put hands a
# CUDA tensor (torch CUDA tensors need a GPU: this stands in for one at the compiled module's
# interface). The sink must register the device range with the store client, wait for the
# producer's work, and put from device memory.
FAKE_GPU_PUT = r"""
import ctypes, json, numpy as np, ml_dtypes
import capture_arena as ca
from capture_arena import _capture_arena, _samples
from capture_arena._tensors import CudaBytes

cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0 and cuda.cuCtxSetCurrent(ctx) == 0
L, W = 64, 96
n = L * W * 2
dev = ctypes.c_uint64()
assert cuda.cuMemAlloc_v2(ctypes.byref(dev), n) == 0
ctypes.memset(dev.value, 0, n)  # what is there before the producer's kernels finish
final = np.random.default_rng(7).standard_normal((L, W), dtype=np.float32).astype(ml_dtypes.bfloat16)
stream = ctypes.c_void_p()
assert cuda.cuStreamCreate(ctypes.byref(stream), 0) == 0
# The producer's work: a copy that lands FAKE_CUDA_COPY_US later, enqueued before the hand-over.
assert cuda.cuMemcpyHtoDAsync_v2(ctypes.c_uint64(dev.value), final.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(n), stream) == 0

class DeviceTensor:  # what the compiled module reads of a torch CUDA tensor
    is_cuda = True
    def is_contiguous(self): return True
    def data_ptr(self): return dev.value
    def numel(self): return L * W
    def element_size(self): return 2
    def get_device(self): return 0

cb = CudaBytes.__new__(CudaBytes)  # as CudaBytes(tensor) makes it, with the fake's stream
object.__setattr__(cb, "tensor", DeviceTensor())
object.__setattr__(cb, "stream", stream.value)
sink = ca.StoreSink(gpu_put=True)
assert sink.device_publication
spec = _samples._coerce_spec({"store_id": "gp", "sample_id": "s0", "features": {"aux": "hidden_state"},
                        "passthrough": [{"name": "input_ids", "data": list(range(L)), "shape": [1, L]}]})
batch, refused = _capture_arena._plan_batch([(spec, (cb, [L, W], "bfloat16"), None, None)], None)
assert refused == [] and [t[7] for t in batch.tensors()] == [0, -1], batch.tensors()
rows = sink._publish(batch, refused)
assert "error" not in rows[0], rows
store = ca.ArenaFeatureStore()
got = store.get(rows[0])
assert np.array_equal(got["hidden_state"][0].view(np.uint16), final.view(np.uint16)), "the put read the bytes before the producer's copy finished"
assert got["input_ids"][0].tolist() == list(range(L))
store.release(rows[0])
store.flush(10)
print("gpu put ok", sink.stats()["published_bytes"])
sink.close()
"""


def test_fake_gpu_device_tensors_are_put_into_the_store_from_device_memory_after_their_writers(
    master: dict[str, str], fake_gpu: dict[str, str]
) -> None:
    env = {**master, **fake_gpu, "FAKE_CUDA_COPY_US": "300000", "MOONCAKE_PROTOCOL": "tcp"}
    out = subprocess.run([sys.executable, "-c", FAKE_GPU_PUT], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "gpu put ok" in out.stdout, out.stdout + out.stderr


def test_a_client_without_hard_pins_gets_soft_pins_as_specforges_patches_fall_back() -> None:
    from capture_arena._store import replicate_config

    class Hard:
        replica_num = 0
        with_hard_pin = False
        with_soft_pin = False

    class SoftOnly:
        replica_num = 0
        with_soft_pin = False

    class Neither:
        replica_num = 0

    mods = {c: type("M", (), {"ReplicateConfig": c}) for c in (Hard, SoftOnly, Neither)}
    hard = replicate_config(mods[Hard])
    assert (hard.replica_num, hard.with_hard_pin, hard.with_soft_pin) == (1, True, False)
    soft = replicate_config(mods[SoftOnly])
    assert (soft.replica_num, soft.with_soft_pin, hasattr(soft, "with_hard_pin")) == (1, True, False)
    neither = replicate_config(mods[Neither])
    assert neither.replica_num == 1 and not hasattr(neither, "with_hard_pin") and not hasattr(neither, "with_soft_pin")
    # Mooncake's own config (0.3.13.post1) has the hard pin.
    from mooncake.store import ReplicateConfig

    assert hasattr(ReplicateConfig(), "with_hard_pin")


def small_store_env(master_env: dict[str, str]) -> dict[str, str]:
    """This environment with a master's variables, and a client's store segment and buffer
    small enough for two cores."""
    return {**os.environ, **master_env, "MOONCAKE_GLOBAL_SEGMENT_SIZE": "16MiB", "MOONCAKE_LOCAL_BUFFER_SIZE": "16MiB", "GLOG_minloglevel": "2"}


def resume_and_stop(master: "subprocess.Popen[bytes]") -> None:
    """A master a test stopped (SIGSTOP) made to answer again, then stopped for good."""
    import signal

    import mooncake_master

    try:
        os.kill(master.pid, signal.SIGCONT)
    except OSError:
        pass
    mooncake_master.stop(master)


def run_beside(code: str, master_pid: int, master_env: dict[str, str]) -> "subprocess.CompletedProcess[str]":
    """``code`` run in a process of its own (argv[1]: the master's pid), its output captured."""
    return subprocess.run([sys.executable, "-c", code, str(master_pid)], env=small_store_env(master_env), capture_output=True, text=True, timeout=300)


def test_a_stalled_master_costs_a_synchronous_caller_its_bound_and_leaves_nothing_behind() -> None:
    """The scheduler thread's put_sample under a synchronous patch, against a mooncake_master
    that stops answering (SIGSTOP) mid-run: the call returns at its bound with error rows, and
    what the worker publishes once the master answers again is removed (never half-kept)."""
    import mooncake_master

    p, env = mooncake_master.start()
    code = r"""
import json, os, signal, sys, time, numpy as np
import capture_arena as ca
sink = ca.StoreSink()
sink.sync_bound = 1.0
def sample(i):
    return ({"store_id": "stall", "sample_id": f"s{i}", "features": {"aux": "h"}}, np.full((64, 32), i, np.float32), None)
assert "error" not in sink.put_sample(sample(0)[0], aux=sample(0)[1]), "connected"
os.kill(int(sys.argv[1]), signal.SIGSTOP)
t0 = time.monotonic()
row = sink.put_samples([sample(1)])[0]
took = time.monotonic() - t0
os.kill(int(sys.argv[1]), signal.SIGCONT)
assert "error" in row and "did not publish this batch within 1 s" in row["error"], row
assert took < 30, took  # the bound (1 s), not the store's own timeouts
sink._pool.submit(lambda: None).result(timeout=120)  # the worker is done with it
with sink._lock:
    exists = [int(sink._store.is_exist("stall/s1/g1/h"))]
print(json.dumps({"exists": exists, "stats": sink.stats()}), flush=True)
sink.close()
"""
    try:
        out = run_beside(code, p.pid, env)
        assert out.returncode == 0, out.stdout + out.stderr
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["exists"] == [0], got
        assert got["stats"]["published_samples"] == 1, got
    finally:
        resume_and_stop(p)


STALLED_SINK_AT_EXIT = r"""
import atexit, json, os, signal, sys, threading, time, numpy as np
futs = []
# Registered before capture_arena's exit hook, so it runs after it: the rows as exit left them.
atexit.register(lambda: print(json.dumps([f.result(timeout=0)[0] if f.done() else None for f in futs]), flush=True))
import capture_arena as ca
sink = ca.StoreSink(max_pending_batches=4)
def sample(i):
    return ({"store_id": "exit", "sample_id": f"s{i}", "features": {"aux": "h"}}, np.full((64, 32), i, np.float32), None)
assert "error" not in sink.put_samples([sample(0)])[0], "connected"
master = int(sys.argv[1])
os.kill(master, signal.SIGSTOP)
futs += [sink.submit_samples([sample(i)], block=False) for i in range(1, 5)]  # behind a stalled master
def resume_once_closing():  # the master answers again once the exit hook stopped the sink
    while not sink._closed:
        time.sleep(0.01)
    os.kill(master, signal.SIGCONT)
threading.Thread(target=resume_once_closing, daemon=True).start()
"""


def test_exit_with_batches_queued_behind_a_stalled_master_makes_only_the_one_in_flight() -> None:
    """The store sink's worker was a one-thread ThreadPoolExecutor, whose thread interpreter
    exit joins after everything queued ran: with the master stalled (SIGSTOP), each queued
    publish waits out Mooncake's RPC timeout (30 s; four here), to be dropped with the process's
    client anyway. Now the exit stops the sink: what is queued runs for QUEUE_WAIT_S (5 s), then
    the batches not begun fail and say so, and the one in flight is waited for (at most
    CLOSE_WAIT_S). (The master answers again once those fail, so that the one in flight ends
    at once.)"""
    import mooncake_master

    p, env = mooncake_master.start()
    try:
        out = run_beside(STALLED_SINK_AT_EXIT, p.pid, env)
        assert out.returncode == 0, out.stderr[-3000:]
        rows = json.loads(out.stdout.strip().splitlines()[-1])
        assert rows[0] is not None, rows  # the one in flight ended (published, or failed, by the master's answer)
        assert all(r is not None and "store sink closed before this batch could start" in r.get("error", "") for r in rows[1:]), rows
    finally:
        resume_and_stop(p)


def test_removals_dropped_past_the_bound_are_logged_with_the_count(monkeypatch, caplog) -> None:
    # Store objects have no lease: a removal dropped past MAX_PENDING_KEYS (the master unreachable
    # meanwhile) leaves its object until the producer's client closes. Before: only counted, in
    # silence; now a warning (at most one a second) says how many and what.
    import logging
    import socket

    from capture_arena import _store
    from capture_arena._samples import Warnings
    from capture_arena._store import StoreReader

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: connecting is refused
    monkeypatch.setenv("MOONCAKE_MASTER_SERVER_ADDR", f"127.0.0.1:{port}")
    monkeypatch.setattr(_store, "_DROPPED", Warnings())  # the rate limit is per process
    reader = StoreReader()
    # One release queues its three keys and trims them to the bound under one lock (the remover
    # thread takes keys only after): two dropped, whatever the thread does.
    reader.MAX_PENDING_KEYS = 1
    feats = {"hidden_state": {"shape": [1, 4, 8], "dtype": "bfloat16"}, "target": {"shape": [1, 4, 8], "dtype": "bfloat16"}, "input_ids": {"shape": [1, 4], "dtype": "int64"}}
    with caplog.at_level(logging.WARNING, logger="capture_arena"):
        reader.release({"sample_id": "s0", "store_id": "st", "gen": 1, "features": feats})
    assert reader.dropped == 2
    dropped = [r.getMessage() for r in caplog.records if "removals from the Mooncake store dropped" in r.getMessage()]
    assert dropped and dropped[0].startswith("2 removals from the Mooncake store dropped, 2 in all (more than 1 waited"), dropped
    assert "first dropped: st/s0/g1/hidden_state" in dropped[0], dropped
    # Its remover would retry the kept key against the closed port for the rest of the session
    # (reading the environment later tests set): the key goes, the reader with it.
    with reader._lock:
        reader._removals.clear()
        while reader._removing:
            reader._changed.wait(1.0)


def test_a_readers_store_client_takes_no_local_buffer_unless_asked(master, monkeypatch) -> None:
    # A reader reads straight into its registered outputs (batch_get_into): Mooncake's local
    # buffer (1 GiB by default, registered, so pinned under RDMA) is never used by it. Before:
    # every reader client took MOONCAKE_LOCAL_BUFFER_SIZE's 1 GiB. The real client, set up
    # against a real master; the subclass only records what setup was asked.
    import mooncake.store

    from capture_arena import _store

    asked = []

    class Recorded(mooncake.store.MooncakeDistributedStore):  # type: ignore[misc]
        def setup(self, *args: object) -> int:
            asked.append(args)
            return int(super().setup(*args))

    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", Recorded)
    for k, v in master.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("MOONCAKE_LOCAL_BUFFER_SIZE")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "16MiB")
    for contribute, local in ((False, 0), (True, 1 << 30)):
        _store.connect(contribute)
        assert asked[-1][2:4] == (16 << 20 if contribute else 0, local), asked[-1]
    monkeypatch.setenv("MOONCAKE_LOCAL_BUFFER_SIZE", "8MiB")
    _store.connect(False)
    assert asked[-1][3] == 8 << 20, asked[-1]


STALLED_AT_EXIT = r"""
import atexit, json, sys, threading
import capture_arena as ca

store = ca.ArenaFeatureStore()
r = json.loads(sys.argv[1])
store.get(r)
print("read", flush=True)
sys.stdin.readline()  # the master is stopped meanwhile

def release_at_exit():  # as speculators' backend does; no thread can start (Python 3.12+)
    def start(self, *a, **k):
        raise RuntimeError("can't create new thread at interpreter shutdown")
    threading.Thread.start = start
    store.release(r)

atexit.register(release_at_exit)
"""


def test_a_release_at_exit_under_a_stalled_master_ends_within_the_exit_flush() -> None:
    # The remover thread starts with the first read, so at exit (no thread to be had) the release
    # is queued to it and the exit flush waits at most SGLANG_SPEC_CAPTURE_EXIT_FLUSH_S. Before:
    # the flush made the removal itself, on the exiting thread, with no deadline: a master that
    # stopped answering held the exit 30 s before the flush could even warn (Mooncake's RPC timeout).
    import signal
    import time

    import mooncake_master

    p, env = mooncake_master.start()
    env = small_store_env(env)
    prod = Proc(PRODUCER, env)
    try:
        (r,) = prod.ask({"samples": [{"id": "stalled", "L": 16, "seed": 1}]})
        assert "error" not in r, r
        trainer = subprocess.Popen(
            [sys.executable, "-c", STALLED_AT_EXIT, json.dumps(r)],
            env={**env, "SGLANG_SPEC_CAPTURE_EXIT_FLUSH_S": "1"}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert trainer.stdout is not None and trainer.stdin is not None
        assert trainer.stdout.readline() == "read\n"
        os.kill(p.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        # The exit flush's warning comes at its bound; Mooncake's own teardown then takes what
        # its HTTP timeouts say (3 s each against the stopped metadata server), not ours to bound.
        assert trainer.stderr is not None
        seen = ""
        for line in trainer.stderr:
            seen += line
            if "frees not sent before exit" in line:
                break
        took = time.monotonic() - t0
        assert "still wait after 1.0 s" in seen, seen[-3000:]
        assert took < 1 + 5, (took, seen[-3000:])  # 30 s before
        trainer.stderr.read()
        assert trainer.wait(timeout=60) == 0
    finally:
        try:
            os.kill(p.pid, signal.SIGCONT)
        except OSError:
            pass
        prod.kill()
        mooncake_master.stop(p)


def test_a_smaller_object_published_again_under_a_results_key_is_named_as_such(master, monkeypatch) -> None:
    # Mooncake's batch_get_into answers the bytes it copied when the object there is smaller than
    # the buffer. Before: "the store or the object's segment cannot be reached"
    # (StaleSessionError), for a producer that is up and an object that is there.
    for k, v in master.items():
        monkeypatch.setenv(k, v)
    sink = ca.StoreSink(aux_layer_ids=[1])
    try:
        spec = {"store_id": "again", "sample_id": "a", "features": {"aux": "hidden_state"}}
        (old,) = sink.put_samples([(spec, np.full((64, 32), 3, np.float32), None)])
        (new,) = sink.put_samples([({**spec, "replace": True}, np.full((16, 32), 4, np.float32), None)])
        assert "error" not in old and "error" not in new, (old, new)
        with ca.ArenaFeatureStore() as store:
            with pytest.raises(ca.InvalidReadError, match=r"holds again/a/g1/hidden_state with 2048 bytes, not the result's 8192: the object was published again"):
                store.get(old)
            assert store.get(new)["hidden_state"].shape == (1, 16, 32)
        # The reader's remover thread (started by its first read) does not keep it: dropped, the
        # reader is collected with its store clients and the thread ends (before: a thread and
        # its clients held for the life of the process, per store ever made).
        import gc
        import threading
        import time
        import weakref

        reader = weakref.ref(store._store_reader)
        del store
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (reader() is not None or any(t.name == "capture-arena-store-remove" for t in threading.enumerate())):
            gc.collect()
            time.sleep(0.05)
        assert reader() is None, gc.get_referrers(reader())
        assert not [t for t in threading.enumerate() if t.name == "capture-arena-store-remove"]
    finally:
        sink.close()


def test_a_stopped_master_fails_a_connect_within_the_probe_and_never_holds_the_gil(monkeypatch) -> None:
    # Mooncake's setup() holds the GIL while it waits on a master that accepts connections but
    # does not answer (SIGSTOP: the kernel still completes the handshake). Before: the TCP probe
    # passed, and the whole process (a trainer's read deadline, SGLang's scheduler) stood still
    # for the 30 s of one setup try. Now the http:// metadata server, served by the master
    # itself, must answer first.
    import signal
    import threading
    import time

    import mooncake_master

    from capture_arena import _store

    p, env = mooncake_master.start()
    try:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        os.kill(p.pid, signal.SIGSTOP)
        ticks: list[float] = []
        stop = threading.Event()

        def tick() -> None:
            while not stop.is_set():
                ticks.append(time.monotonic())
                stop.wait(0.05)

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        t0 = time.monotonic()
        with pytest.raises(ca.ArenaOSError, match="metadata server does not answer"):
            _store.connect(False)
        took = time.monotonic() - t0
        stop.set()
        ticker.join(5)
        gap = max(b - a for a, b in zip(ticks, ticks[1:]))
        assert took < _store.PROBE_TIMEOUT_S + _store.PROBE_ANSWER_S + 1 and gap < 1.0, (took, gap)
    finally:
        os.kill(p.pid, signal.SIGCONT)
        mooncake_master.stop(p)


class _FlakyRemovals:
    """A store client whose next ``fail`` removals raise, as Mooncake's do while the master is
    unreachable (a stand-in for that outage, in this process), and whose puts refuse the last
    key while ``refuse_last`` holds; the rest is the real client's."""

    def __init__(self, real: object, fail: int) -> None:
        self.real, self.fail, self.refuse_last = real, fail, False

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)

    def batch_remove(self, keys: list[str], force: bool) -> object:
        if self.fail:
            self.fail -= 1
            raise RuntimeError("the master cannot be reached (a stand-in)")
        return self.real.batch_remove(keys, force)  # type: ignore[attr-defined]

    def batch_put_from(self, keys: list[str], *args: object) -> list[int]:
        rcs = list(self.real.batch_put_from(keys, *args))  # type: ignore[attr-defined]
        return rcs[:-1] + [-1] if self.refuse_last else rcs


def test_the_sinks_own_removals_that_fail_are_retried_and_never_remove_a_newer_object(master, monkeypatch) -> None:
    """The store sink removes its own objects when a batch fails after its put, and when a live
    capture is dropped. A removal that failed (the master unreachable) left them in the store
    until the sink's client closed: a leak per outage for the life of the server. They are now
    retried after a back-off; and a batch that writes one of their keys again removes it first,
    so no retry removes the newer object."""
    import threading
    import time

    from capture_arena import _store

    for k, v in master.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(_store, "LEFTOVER_BACKOFF_S", (0.05, 0.05), raising=False)
    sink = ca.StoreSink(aux_layer_ids=[1])

    def wait(pred: object, what: str) -> None:
        deadline = time.monotonic() + 10
        while not pred():  # type: ignore[operator]
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {sink.stats()}"
            time.sleep(0.01)

    def sample(sid: str, fill: int, replace: bool = False) -> tuple[dict[str, object], object, object]:
        spec = {"store_id": "left", "sample_id": sid, "replace": replace, "features": {"aux": "hidden_state", "last_hidden": "last"}}
        return spec, np.full((16, 32), fill, np.float32), np.full((16, 8), fill, np.float32)

    try:
        (row,) = sink.put_samples([sample("a", 1)])
        assert "error" not in row, row
        real = sink._store
        exists = lambda k: real.is_exist(k) == 1  # noqa: E731
        # A dropped live capture whose removal fails twice: removed at the third try.
        sink._store = _FlakyRemovals(real, fail=2)
        sink._drop_published(row)
        wait(lambda: sink._store.fail == 0, "two failed tries")
        wait(lambda: not exists("left/a/g1/hidden_state") and not exists("left/a/g1/last"), "the retried removal")
        wait(lambda: sink.stats()["leftover_objects"] == 0, "nothing left to retry")

        # A batch refused after its put, whose cleanup fails: both objects left over; the same
        # sample published again at once is published (its keys removed first), and a retry
        # that comes later removes nothing of it.
        monkeypatch.setattr(_store, "LEFTOVER_BACKOFF_S", (0.5, 0.5), raising=False)
        sink._store.fail, sink._store.refuse_last = 1, True
        (row,) = sink.put_samples([sample("b", 2)])
        assert "could not be removed yet" in row["error"] and "retried" in row["error"], row
        assert sink.stats()["leftover_objects"] == 2 and exists("left/b/g1/hidden_state")
        timer = sink._leftover_timer
        assert isinstance(timer, threading.Timer)
        sink._store.refuse_last = False
        (again,) = sink.put_samples([sample("b", 3)])
        assert "error" not in again, again
        assert sink.stats()["leftover_objects"] == 0
        timer.join(5)
        sink._pool.submit(lambda: None).result(timeout=30)  # the retry it queued, if any, ran
        with ca.ArenaFeatureStore() as store:
            got = store.get(again)
            assert (got["hidden_state"] == 3).all() and (got["last"] == 3).all()

        # Left over again; then published with replace while the removal of them first fails
        # (the batch's own replace removes them): published, and never removed by a retry
        # after (before: kept for the retry, which removed the new objects).
        sink._store.fail, sink._store.refuse_last = 1, True
        (row,) = sink.put_samples([sample("c", 4)])
        assert "retried" in row["error"] and sink.stats()["leftover_objects"] == 2, row
        sink._store.fail, sink._store.refuse_last = 1, False
        (again,) = sink.put_samples([sample("c", 5, replace=True)])
        assert "error" not in again and sink._store.fail == 0, again
        assert sink.stats()["leftover_objects"] == 0
        timer = sink._leftover_timer
        if timer is not None:
            timer.join(5)
        sink._pool.submit(lambda: None).result(timeout=30)
        assert exists("left/c/g1/hidden_state") and exists("left/c/g1/last")
        with ca.ArenaFeatureStore() as store:
            assert (store.get(again)["hidden_state"] == 5).all()
    finally:
        sink.close()
