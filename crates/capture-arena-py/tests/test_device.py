"""The device path from Python: device arenas (``gpu_put=True`` / ``MOONCAKE_PROTOCOL=nvlink``)
and reads from ``cuda://`` sessions.

This machine has no GPU. ``fake_gpu`` tests run the real code against the fake CUDA driver
(``crates/capture-arena/tests/fake_cuda/fake_cuda.c``: host memory standing in for device
memory), in subprocesses that load it through ``LD_LIBRARY_PATH``; torch CUDA tensors need a real
GPU and run in ``scripts/gpu-check.sh``.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

import capture_arena as ca
from conftest import hidden, spec

FAKE = pathlib.Path(__file__).parents[2] / "capture-arena" / "tests" / "fake_cuda" / "fake_cuda.c"
HAS_DRIVER = os.path.exists("/dev/nvidiactl")


def _loadable(name: str) -> bool:
    import ctypes

    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


#: A CUDA driver library loads here: the real one, or the fake one the GPU check's dry run puts
#: on LD_LIBRARY_PATH.
ANY_DRIVER = HAS_DRIVER or _loadable("libcuda.so.1")


@pytest.fixture(scope="module")
def fake_gpu(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        pytest.skip("no C compiler to build the fake driver")
    d = tmp_path_factory.mktemp("fake-cuda")
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1", "-o", str(d / "libcuda.so.1"), str(FAKE), "-lpthread"],
        check=True,
    )
    return {**os.environ, "LD_LIBRARY_PATH": str(d)}


def run(code: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def run_trainer(producer: subprocess.Popen[str], trainer: str, env: dict[str, str], lines: int = 1) -> str:
    """Hands the producer's first `lines` lines (its results) to a `trainer` process, which
    must print "trainer ok"; returns the trainer's stdout. The producer keeps running."""
    assert producer.stdout is not None
    got = [producer.stdout.readline() for _ in range(lines)]
    assert all(line.startswith("{") for line in got), got
    t = subprocess.run([sys.executable, "-c", trainer], env=env, input="".join(got), capture_output=True, text=True, timeout=120)
    assert t.returncode == 0 and "trainer ok" in t.stdout, t.stdout + t.stderr
    return t.stdout


def produce_then_train(producer: list[str], trainer: str, env: dict[str, str], lines: int = 1) -> None:
    """Runs a producer (``python -c`` with these arguments), hands its first `lines` results to
    a trainer process (:func:`run_trainer`), then tells the producer (a line on its stdin) that
    the trainer is done: it must print "producer ok"."""
    p = subprocess.Popen([sys.executable, "-c", *producer], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdin is not None
        run_trainer(p, trainer, env, lines)
        p.stdin.write("\n")
        p.stdin.flush()
        rest = p.stdout.read()
        assert p.wait(timeout=60) == 0 and "producer ok" in rest, rest
    finally:
        p.kill()


@pytest.mark.skipif(ANY_DRIVER, reason="a CUDA driver library (libcuda.so.1) loads here, a real one or the dry run's fake; the test needs none")
def test_device_publication_without_a_driver_fails_the_batch_saying_what_to_change(make_sink):
    sink = make_sink(gpu_put=True)
    assert sink.device_publication and not sink.started
    row = sink.put_sample(spec("a"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    assert set(row) == {"sample_id", "error"} and "no CUDA driver library" in row["error"], row
    assert "SGLANG_SPEC_CAPTURE_GPU_PUT" in row["error"]
    assert not sink.started
    # The driver is looked for again at the next capture (the sink stays usable).
    again = sink.put_sample(spec("b"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    assert "no CUDA driver library" in again["error"]


def test_bad_device_keyword_is_a_config_error():
    with pytest.raises(ca.ConfigError, match="device ordinal"):
        ca.ArenaSink(arena_bytes=1 << 20, device=-1)


def test_fake_gpu_host_arrays_into_a_device_arena_read_by_another_process(fake_gpu):
    """Host arrays under a device arena are copied host-to-device; a trainer process imports the
    arena by its POSIX descriptor (over the writer's reply path) and reads every byte back."""
    producer = r'''
import json, sys, numpy as np, ml_dtypes
import capture_arena as ca
sink = ca.ArenaSink(arena_bytes=8 << 20, gpu_put=True, wait_s=2)
rng = np.random.default_rng(7)
aux = rng.standard_normal((64, 96)).astype(ml_dtypes.bfloat16)
last = rng.standard_normal((64, 32)).astype(ml_dtypes.bfloat16)
spec = {"sample_id": "d0", "store_id": "st", "gen": 1,
        "features": {"aux": "hidden_state", "last_hidden": "target"},
        "passthrough": [{"name": "input_ids", "data": list(range(64)), "shape": [1, 64], "dtype": "int64"}]}
r = sink.put_sample(spec, aux=aux, last_hidden=last)
assert r["arena"]["session"].startswith("cuda://"), r
print(json.dumps(r), flush=True)
sys.stdin.readline()  # until the trainer is done
import time
deadline = time.monotonic() + 10  # frees are one-way: wait until the writer has applied them
while sink.stats()["resident_objects"] and time.monotonic() < deadline:
    time.sleep(0.01)
assert sink.stats()["resident_objects"] == 0, sink.stats()
print("producer ok", flush=True)
'''
    trainer = r'''
import json, sys, numpy as np, ml_dtypes
import capture_arena as ca
r = json.loads(sys.stdin.readline())
with ca.ArenaFeatureStore() as store:
    got = store.get(r)
    rng = np.random.default_rng(7)
    aux = rng.standard_normal((64, 96)).astype(ml_dtypes.bfloat16)
    last = rng.standard_normal((64, 32)).astype(ml_dtypes.bfloat16)
    assert np.array_equal(got["hidden_state"].view(np.uint16)[0], aux.view(np.uint16))
    assert np.array_equal(got["target"].view(np.uint16)[0], last.view(np.uint16))
    assert got["input_ids"].tolist() == [list(range(64))]
    out = {"target": np.zeros((1, 64, 32), dtype=ml_dtypes.bfloat16)}
    store.get(r, ["target"], out=out)
    assert np.array_equal(out["target"].view(np.uint16)[0], last.view(np.uint16))
    store.release(r)
print("trainer ok", flush=True)
'''
    produce_then_train([producer], trainer, fake_gpu)


def test_fake_gpu_a_forked_child_is_refused_cuda_sessions_and_leaves_the_parents_alone(fake_gpu):
    """CUDA does not survive fork(): a DataLoader worker forked from a trainer that read a
    cuda:// session must not use or tear down the parent's driver state. Reading in the child
    fails at once with a DeviceError that says to use the spawn start method (before: the
    child read through the parent's contexts and mappings as if they were its own, which the
    fake allows and a real driver fails or crashes on); the parent reads on after the child
    exits."""
    producer = r'''
import json, sys, numpy as np
import capture_arena as ca
sink = ca.ArenaSink(arena_bytes=8 << 20, gpu_put=True, wait_s=2)
spec = {"sample_id": "f0", "store_id": "st", "gen": 1, "features": {},
        "passthrough": [{"name": "input_ids", "data": list(range(4096)), "shape": [1, 4096], "dtype": "int64"}]}
print(json.dumps(sink.put_sample(spec)), flush=True)
sys.stdin.readline()
'''
    trainer = r'''
import json, os, sys
import capture_arena as ca
r = json.loads(sys.stdin.readline())
store = ca.ArenaFeatureStore()
assert store.get(r)["input_ids"].tolist() == [list(range(4096))]  # the driver is initialised
pid = os.fork()
if pid == 0:
    try:
        store.get(r)
        os._exit(3)
    except ca.DeviceError as e:
        ok = "fork" in str(e) and "spawn" in str(e)
        print("child:", str(e)[:400], flush=True)
        os._exit(0 if ok else 4)
    except BaseException as e:
        print("child:", type(e).__name__, str(e)[:400], flush=True)
        os._exit(5)
_, status = os.waitpid(pid, 0)
assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
assert store.get(r)["input_ids"].tolist() == [list(range(4096))]  # the parent's mapping lives
store.release(r)
print("trainer ok", flush=True)
'''
    p = subprocess.Popen([sys.executable, "-c", producer], env=fake_gpu, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        out = run_trainer(p, trainer, fake_gpu)
        assert "forked from pid" in out, out
    finally:
        p.kill()


def test_fake_gpu_nvlink_forces_a_device_arena(fake_gpu):
    # capture-arena's own device arena under nvlink (the default there is the TransferEngine's:
    # test_engine.py).
    env = {
        **fake_gpu,
        "MOONCAKE_PROTOCOL": "nvlink",
        "SGLANG_SPEC_CAPTURE_ARENA_BYTES": "4MiB",
        "SGLANG_SPEC_CAPTURE_PLACEMENT": "arena",
    }
    out = run(
        r'''
from types import SimpleNamespace
from capture_arena import sglang
s = sglang.maybe_init_sink(SimpleNamespace(enable_spec_capture=True, spec_capture_aux_layer_ids="2,18,33"))
assert s is not None and s.device_publication
import numpy as np
r = s.put_sample({"sample_id": "n", "store_id": "st", "gen": 1, "features": {"last_hidden": "target"}},
                 aux=None, last_hidden=np.ones((4, 8), dtype=np.float32))
assert r["aux_layer_ids"] == [2, 18, 33], r
print(r["arena"]["session"][:7])
''',
        env,
    )
    assert out.strip() == "cuda://"


def test_a_cuda_dlpack_object_without_torch_is_refused_before_anything_is_written() -> None:
    # In a process where torch cannot be imported (it is installed here: an import of it fails
    # there as it would where it is not), so the test runs in every configuration.
    out = run(
        r'''
import sys
sys.modules["torch"] = None  # `import torch` raises ImportError from here on
import capture_arena as ca
import numpy as np

class CudaArray:
    """A DLPack look-alike that says it lives on CUDA device 0."""
    shape = (8, 12)
    def __dlpack_device__(self):
        return (2, 0)
    def __dlpack__(self, **kw):
        raise AssertionError("must not be exported")

sink = ca.ArenaSink(arena_bytes="1MiB")
spec = {"store_id": "st", "sample_id": "dl", "features": {"aux": "hidden_state", "last_hidden": "target"}}
row = sink.put_sample(spec, aux=CudaArray(), last_hidden=np.zeros((8, 4), np.float32))
# The sample's own error row (a sink never raises for a sample), before anything was written.
assert set(row) == {"sample_id", "error"} and "needs torch" in row["error"], row
assert not sink.started
print("refused")
''',
        dict(os.environ),
    )
    assert out.strip() == "refused"


@pytest.mark.skipif(HAS_DRIVER, reason="needs the fake driver's two GPUs: on the GPU machine the child finds the real libcuda.so.1 (one GPU) before it")
def test_fake_gpu_an_eager_device_arena_goes_to_the_capturing_schedulers_gpu(fake_gpu):
    # Under SGLang, SGLANG_SPEC_CAPTURE_ARENA_EAGER=1 creates the arena in the background on
    # attention-TP rank 0 only, on that scheduler's GPU (self.gpu_id), not on GPU 0.
    env = {
        **fake_gpu,
        "FAKE_CUDA_DEVICES": "2",
        "MOONCAKE_PROTOCOL": "nvlink",
        "SGLANG_SPEC_CAPTURE_ARENA_BYTES": "4MiB",
        "SGLANG_SPEC_CAPTURE_PLACEMENT": "arena",
        "SGLANG_SPEC_CAPTURE_ARENA_EAGER": "1",
    }
    out = run(
        r'''
import time
from types import SimpleNamespace
from capture_arena import sglang

class Scheduler:  # what maybe_init_sink reads of its caller
    def __init__(self, rank, gpu):
        self.ps = SimpleNamespace(attn_tp_rank=rank)
        self.gpu_id = gpu
        self.sink = sglang.maybe_init_sink(SimpleNamespace(enable_spec_capture=True))

def started(s):
    deadline = time.monotonic() + 30
    while not s.started and time.monotonic() < deadline:
        time.sleep(0.01)
    return s.started

def dev(s):
    return s.session.split("dev=")[1].split("&")[0]

other = Scheduler(1, 1).sink
time.sleep(0.3)
assert not other.started, "rank 1 never captures: no arena"
sglang.reset_sink()
on1 = Scheduler(0, 1).sink
assert started(on1)
dev1 = dev(on1)
sglang.reset_sink()
on0 = Scheduler(0, 0).sink
assert started(on0)
print(dev1 != dev(on0))
''',
        env,
    )
    assert out.strip() == "True"


DEVICE_ROWS_PRODUCER = r'''
import ctypes, json, sys, time
import numpy as np
import capture_arena as ca
from capture_arena._capture_arena import _DeviceRows, _Landed

# A cache-only layer in "device" memory (the fake's: host memory): [8 blocks, 3 layers, 4 slots,
# 16] bf16 through its logical view, its memory ordered [blocks, slots, layers, 16] (one of
# vLLM's layouts), bytes from a seeded generator the trainer makes again.
BLOCKS, K, BS, H = 8, 3, 4, 16
cu = ctypes.CDLL("libcuda.so.1")
ctx, ptr = ctypes.c_void_p(), ctypes.c_uint64()
assert cu.cuInit(0) == 0 and cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0 and cu.cuCtxSetCurrent(ctx) == 0
cache = np.random.default_rng(3).integers(0, 1 << 16, size=BLOCKS * BS * K * H, dtype=np.uint16)
assert cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(cache.nbytes)) == 0
ctypes.memmove(ptr.value, cache.ctypes.data, cache.nbytes)
layout = (ptr.value, cache.nbytes, (BS * K * H * 2, H * 2, K * H * 2), BS, K, H * 2, BLOCKS)

device_arena = sys.argv[1] == "device"
sink = ca.ArenaSink(arena_bytes=1 << 20, gpu_put=device_arena, wait_s=2, aux_layer_ids=[1, 2, 3])
sink._start(0 if device_arena else None)
# Block 9 is not in the cache; "bad"'s token ids cannot be read.
requests = [("a", 1, 10, [5, 2, 7]), ("b", 1, 4, [1]), ("far", 1, 4, [9]), ("bad", 1, 4, [3])]
rows = sink._reserve_rows_begin("st", "bfloat16", K * H, [(i, g, n) for i, g, n, _ in requests], within_s=2).wait_dicts()
landed, seen = _Landed(len(requests)), []

class Id:  # read through __index__ (Python code) as the extension reads "b"'s ids
    def __index__(self):
        # "a" was added by then, in the hold before: its ids written into a host arena. A
        # device arena's are enqueued: not looked at.
        a = rows[0][1]["token_ids"][0]  # (address, stamp)
        seen.append(device_arena or np.frombuffer(ctypes.string_at(a, 80), dtype=np.int64).tolist() == list(range(100, 110)))
        return 100

ids = {"a": list(range(100, 110)), "b": [Id(), 101, 102, 103], "far": list(range(100, 104)), "bad": ["x"] * 4}
copies = [(keys, at["token_ids"], ids[i], n, at["hidden_states"], n * K * H * 2, blocks)
          for (keys, at, _), (i, _, n, blocks) in zip(rows, requests)]
# Holds of 4 ids: "a" (10) read alone, then "b" with "far".
why = sink._copy_requests_rows_device(_DeviceRows(0), layout, copies, landed, 0, 0, 4)
assert why[0] is None and why[1] is None and "block 9 is not in the cache, which has 8 blocks" in why[2], why
assert "reading its token ids" in why[3] and seen == [True], (why, seen)
assert [landed[i] for i in range(4)] == [True, True, True, True]
for (_, _, row), (_, _, _, blocks) in zip(rows[:2], requests):
    print(json.dumps({"row": row, "blocks": blocks}), flush=True)
sys.stdin.readline()  # until the trainer is done
deadline = time.monotonic() + 10
while sink.stats()["resident_objects"] and time.monotonic() < deadline:
    time.sleep(0.01)
s = sink.stats()
assert s["resident_objects"] == 0 and s["failed_writes"] == 4 and s["written_objects"] == 4, s
print("producer ok", flush=True)
'''

DEVICE_ROWS_TRAINER = r'''
import json, sys
import numpy as np
import capture_arena as ca

BLOCKS, K, BS, H = 8, 3, 4, 16
cache = np.random.default_rng(3).integers(0, 1 << 16, size=BLOCKS * BS * K * H, dtype=np.uint16).reshape(BLOCKS, BS, K, H)
with ca.ArenaFeatureStore() as store:
    for line in sys.stdin:
        got = json.loads(line)
        row, blocks = got["row"], got["blocks"]
        n = row["features"]["token_ids"]["shape"][1]
        want = np.concatenate([cache[b] for b in blocks])[:n].reshape(1, n, K * H)
        t = store.get(row)
        assert np.array_equal(t["hidden_states"].view(np.uint16), want), row["sample_id"]
        assert t["token_ids"].tolist() == [list(range(100, 100 + n))]
        store.release(row)
print("trainer ok", flush=True)
'''


@pytest.mark.parametrize("arena", ["host", "device"])
def test_fake_gpu_a_connectors_rows_go_straight_from_a_device_caches_blocks_into_the_arena(fake_gpu, arena):
    """vLLM's connector with a cache in device memory: each request's rows are copied by the
    native path (2-D copies on a stream of its own, the GIL held only for the ids, no staging
    buffer) from the cache's blocks into its reserved objects, in a host arena (device-to-host) or a device
    arena (device-to-device); a trainer process reads every byte; a request whose blocks lie
    outside the cache, or whose token ids cannot be read, fails alone and its space is freed.
    The requests' ids are read (with the GIL) in holds, each hold's requests added to the step
    (the GIL released) before the next is read."""
    produce_then_train([DEVICE_ROWS_PRODUCER, arena], DEVICE_ROWS_TRAINER, fake_gpu, lines=2)


PIN_HOST_ARENA = r'''
import ctypes, json, os, sys, time
import numpy as np
import capture_arena as ca
from capture_arena._capture_arena import _DeviceRows, _Landed

cu = ctypes.CDLL("libcuda.so.1")
cu.fake_cuda_pinned_bytes.restype = cu.fake_cuda_host_copies.restype = ctypes.c_long
ctx, ptr = ctypes.c_void_p(), ctypes.c_uint64()
assert cu.cuInit(0) == 0 and cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0 and cu.cuCtxSetCurrent(ctx) == 0
# A cache [4 blocks, 2 layers, 4 slots, 16] bf16 laid out layer by layer: a 2-D copy per block
# and layer.
BLOCKS, K, BS, H = 4, 2, 4, 16
cache = np.arange(BLOCKS * K * BS * H, dtype=np.uint16)
assert cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(cache.nbytes)) == 0
ctypes.memmove(ptr.value, cache.ctypes.data, cache.nbytes)
layout = (ptr.value, cache.nbytes, (K * BS * H * 2, BS * H * 2, H * 2), BS, K, H * 2, BLOCKS)
sink = ca.ArenaSink(arena_bytes=1 << 20, wait_s=2)
sink._start(None)
base, size = sink.local_region

def step(tag):
    rows = sink._reserve_rows_begin("st", "bfloat16", K * H, [(tag, 1, 8)], within_s=2).wait_dicts()
    (keys, at, row), = rows
    landed = _Landed(1)
    why = sink._copy_requests_rows_device(dr, layout, [(keys, at["token_ids"], list(range(8)), 8, at["hidden_states"], 8 * K * H * 2, [3, 1])], landed, 0)
    assert why == [None] and landed[0], why
    sink._drop_published(row)

dr = _DeviceRows(0)
out = {"before": dr.host_pinned()}
pageable = cu.fake_cuda_host_copies(0)
step("pageable")
out["pageable_copies"] = cu.fake_cuda_host_copies(0) - pageable
out["started"] = sink._pin_host_arena(dr)
out["again"] = sink._pin_host_arena(dr)  # one pin a stream
deadline = time.monotonic() + 20
while os.environ["SGLANG_SPEC_CAPTURE_PIN_HOST"] == "1" and not dr.host_pinned() and time.monotonic() < deadline:
    time.sleep(0.01)  # registering in the background (off: nothing to wait for)
out["pinned"] = dr.host_pinned()
out["pinned_bytes"] = cu.fake_cuda_pinned_bytes() == size  # the arena, exactly (nothing else pins here)
pinned = cu.fake_cuda_host_copies(1)
step("pinned")
out["pinned_copies"] = cu.fake_cuda_host_copies(1) - pinned
dr.unpin_host()
out["after"] = dr.host_pinned()
out["left_pinned"] = cu.fake_cuda_pinned_bytes()
try:
    ca.ArenaSink(arena_bytes=1 << 20, gpu_put=True)._pin_host_arena(dr)
except ca.InvalidReadError as e:
    out["device_arena"] = str(e)
sink.close()
print(json.dumps(out))
'''


@pytest.mark.parametrize("pin", ["1", "0", "off"])
def test_the_vllm_connectors_host_arena_is_pinned_in_the_background_and_unpinned_fake_driver(fake_gpu: dict[str, str], pin: str) -> None:
    """The native device path's host arena (vLLM's connector): pinned by the core's lazy pin on
    a thread of its own (copies before that are pageable, and correct), the 2-D copies after it
    into pinned pages, unpinned before the arena goes; once per stream; refused for a device
    arena; off under SGLANG_SPEC_CAPTURE_PIN_HOST=0, and =off as every flag is spelled (before:
    only 0 turned it off). Before: torch's cudaHostRegister, one call
    for the whole arena on the copy thread, which the first step's copies waited for. The fake
    driver counts the host ends of copies by whether they were pinned."""
    env = {**fake_gpu, "SGLANG_SPEC_CAPTURE_PIN_HOST": pin}
    got = json.loads(run(PIN_HOST_ARENA, env).strip().splitlines()[-1])
    assert got["before"] is False and got["pageable_copies"] > 0 and got["after"] is False and got["left_pinned"] == 0, got
    assert got["started"] is True and got["again"] is False, got
    assert "arena is in device memory" in got["device_arena"], got
    if pin == "1":
        assert got["pinned"] and got["pinned_bytes"] and got["pinned_copies"] > 0, got
    else:
        assert not got["pinned"] and got["pinned_copies"] == 0, got
