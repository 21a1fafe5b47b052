"""ArenaFeatureStore: bit-exact reads from another process, release, health, out=."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import capture_arena as ca
from conftest import hidden, spec, wait_stats

DTYPES = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"]


def random_tensor(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random bit patterns of `dtype` (every bit of floats too: bit-exactness, not values)."""
    rng = np.random.default_rng(seed)
    dt = ca._tensors.numpy_dtype(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def test_every_dtype_round_trips_bit_exact_to_another_process(make_sink):
    sink = make_sink(arena_bytes="8MiB")
    batch, sent = [], []
    for i, dt in enumerate(DTYPES):
        L, W = 5 + i, 3 + 2 * i
        aux, last = random_tensor(dt, (L, W), i), random_tensor(dt, (L, 4), 100 + i)
        batch.append((spec(f"d{i}-{dt}", L), aux, last))
        sent.append({"hidden_state": aux, "target": last,
                     "input_ids": np.arange(L, dtype=np.int64).reshape(1, L),
                     "loss_mask": np.ones((1, L), dtype=np.int64)})
    results = sink.put_samples(batch)
    for r, dt in zip(results, DTYPES):
        assert r["features"]["hidden_state"]["dtype"] == dt
        assert r["features"]["hidden_state"]["shape"][0] == 1
    ctx = mp.get_context("spawn")
    import _reader

    with ctx.Pool(1) as pool:
        got = pool.apply(_reader.read_all, (results,))
    for want, have in zip(sent, got):
        for name, arr in want.items():
            assert have[name] == np.ascontiguousarray(arr).view(np.uint8).tobytes(), name
    s = wait_stats(sink, lambda s: s["resident_objects"] == 0)
    assert s["free_bytes"] == s["capacity"] and s["freed_objects"] == 4 * len(DTYPES)
    assert s["free_extents"] == 1 and s["unknown_frees"] == 0


def test_a_worker_forked_by_multiprocessing_frees_what_it_released_before_it_ends(make_sink):
    """A DataLoader worker started with fork ends in os._exit: atexit never runs there, so the
    exit flush did not either, and a free still queued (the worker's first: its connection not
    made yet) ended with the process (before: its objects stayed resident)."""
    sink = make_sink()
    r = sink.put_sample(spec("forked"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    store = ca.ArenaFeatureStore()  # made before the fork, as a DataLoader's dataset holds it

    def work(store: ca.ArenaFeatureStore) -> None:
        store.get(r)
        store.release(r)

    p = mp.get_context("fork").Process(target=work, args=(store,))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    s = wait_stats(sink, lambda s: s["resident_objects"] == 0)
    assert s["resident_objects"] == 0, s


class _TruncatedUnderTheWorker:
    """A dataset whose worker reads a sample (mapping its arena), then truncates the arena under
    that mapping and reads it again."""

    def __init__(self, result: dict, path: str) -> None:
        self.result, self.path, self.store = result, path, None

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> str:
        if self.store is None:
            self.store = ca.ArenaFeatureStore()
        if i == 0:
            self.store.get(self.result)
            return "read"
        os.truncate(self.path, 0)
        try:
            self.store.get(self.result)
        except ca.StaleSessionError as e:
            return f"stale: {e}"
        return "read without an error"


def test_a_dataloader_worker_survives_its_arena_truncated_under_it(make_sink):
    """torch's DataLoader worker loop installs its own SIGBUS handler over ours, and that one
    kills the worker. The worker's first mapping puts ours back in front: the truncation fails
    the read as a stale session, and the worker lives (before: "DataLoader worker ... is killed
    by signal: Bus error")."""
    from torch.utils.data import DataLoader

    sink = make_sink()
    r = sink.put_sample(spec("truncated"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    name = r["arena"]["session"].removeprefix("shm://").split("?")[0]
    loader = DataLoader(_TruncatedUnderTheWorker(r, f"/dev/shm/{name}"), batch_size=None, num_workers=1,
                        multiprocessing_context="fork", timeout=60)
    got = list(loader)
    assert got[0] == "read" and got[1].startswith("stale: ") and "truncated" in got[1], got


@pytest.mark.parametrize("bad", ["failed", "mistyped"])
def test_a_result_of_megabytes_refused_by_the_core_makes_an_error_of_a_few_hundred_bytes(bad):
    # A failed sample's row quoted its id and error whole, and serde quoted a mistyped value
    # whole (before: 20 MB and 10 MB messages, raised per read and logged by callers).
    big = "x" * 10_000_000
    if bad == "failed":
        result = {"sample_id": big, "error": big}
    else:
        result = {"store_id": "s", "sample_id": "a", "gen": 1, "features": {"f": {}}, "arena": big}
    with pytest.raises(ca.CaptureArenaError) as e:
        ca.ArenaFeatureStore().get(result)
    assert len(str(e.value)) < 2000, len(str(e.value))


def test_a_device_out_of_memory_is_an_arena_os_error_saying_how_much_faked_cuda(make_sink, monkeypatch):
    """Every read error is a CaptureArenaError, yet a device out of memory while its outputs
    were made (or while host outputs were moved there, for store and TransferEngine reads)
    escaped as torch's OutOfMemoryError, which callers catching CaptureArenaError or KeyError
    miss (found by an outside reading). No GPU here: torch's error is raised by stand-ins for the
    allocation and the move."""
    import torch

    from capture_arena import _reader

    sink = make_sink()
    r = sink.put_sample(spec("oom", 8), aux=hidden(8, 12), last_hidden=hidden(8, 4))

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a stand-in)")

    monkeypatch.setattr(_reader, "new_array", out_of_memory)
    with pytest.raises(ca.ArenaOSError, match=r"allocating \w+ on cuda:0 \(\d+ bytes\) failed, out of memory: CUDA out of memory"):
        ca.ArenaFeatureStore().get(r, device="cuda:0")

    class HostTensor:
        nbytes = 4096
        to = staticmethod(out_of_memory)

    with pytest.raises(ca.ArenaOSError, match=r"moving the result's features to cuda:1 \(4096 bytes\) failed, out of memory"):
        _reader._to_device({"h": HostTensor()}, "cuda:1")


def test_get_after_release_raises_key_error(make_sink):
    sink = make_sink()
    r = sink.put_sample(spec("a"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    store = ca.ArenaFeatureStore()
    assert store.get(r)["hidden_state"].dtype == ml_dtypes.bfloat16
    assert store.health() == {
        "resident_samples": 1,
        "resident_bytes": 8 * 12 * 2 + 8 * 4 * 2 + 128,
        "pending_frees": 0,
        "refused_frees": 0,
        "dropped_frees": 0,
        "open_sessions": 1,
        "mooncake_clients": 0,
        "stuck_clients": 0,
    }
    store.release(r)
    with pytest.raises(KeyError, match="already released"):
        store.get(r)
    with pytest.raises(ca.ReleasedError):
        store.get(r, ["target"])
    assert store.health()["resident_samples"] == 0
    wait_stats(sink, lambda s: s["resident_objects"] == 0)


def test_out_reads_into_caller_arrays_without_allocating(make_sink):
    sink = make_sink()
    aux = hidden(8, 12, 3)
    r = sink.put_sample(spec("o"), aux=aux, last_hidden=hidden(8, 4))
    store = ca.ArenaFeatureStore()
    buf = np.zeros((1, 8, 12), dtype=ml_dtypes.bfloat16)
    got = store.get(r, ["hidden_state"], out={"hidden_state": buf})
    assert got["hidden_state"] is buf
    assert (buf[0] == aux).all()
    with pytest.raises(ca.InvalidReadError, match=r"out= array is \[1, 8, 11\] bfloat16"):
        store.get(r, ["hidden_state"], out={"hidden_state": np.zeros((1, 8, 11), dtype=ml_dtypes.bfloat16)})
    # Same byte count, other dtype: refused rather than filled with reinterpreted bytes.
    with pytest.raises(ca.InvalidReadError, match="float32"):
        store.get(r, ["hidden_state"], out={"hidden_state": np.zeros((1, 8, 6), dtype=np.float32)})
    # Two features into one array would alias: refused before any byte is written.
    shared = np.zeros((1, 8), dtype=np.int64)
    with pytest.raises(ca.InvalidReadError, match="share memory"):
        store.get(r, ["input_ids", "loss_mask"], out={"input_ids": shared, "loss_mask": shared})
    # A name asked for twice is read once.
    assert list(store.get(r, ["target", "target"])) == ["target"]
    with pytest.raises(ValueError, match="writable"):
        ro = np.zeros((1, 8, 12), dtype=ml_dtypes.bfloat16)
        ro.flags.writeable = False
        store.get(r, ["hidden_state"], out={"hidden_state": ro})


def test_unknown_features_failed_results_and_forged_addresses(make_sink):
    sink = make_sink()
    r = sink.put_sample(spec("u"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    store = ca.ArenaFeatureStore()
    with pytest.raises(KeyError, match="no feature st/u/g1/nope: the result has hidden_state"):
        store.get(r, ["nope"])
    with pytest.raises(ca.InvalidReadError, match="failed to publish"):
        store.get({"sample_id": "x", "error": "arena full"})
    forged = {**r, "features": {"target": {**r["features"]["target"], "address": 16}}}
    with pytest.raises(ca.InvalidReadError, match="outside the arena"):
        store.get(forged)
    forged = {**r, "features": {"target": {**r["features"]["target"], "address": 12}}}
    with pytest.raises(ca.InvalidReadError, match="8-byte aligned"):
        store.get(forged)
    # A shape far larger than the arena is refused before an array of its size is allocated.
    huge = {**r, "features": {"target": {**r["features"]["target"], "shape": [1, 1 << 40, 4]}}}
    with pytest.raises(ca.InvalidReadError, match="outside the arena"):
        store.get(huge)
    # One that lost its `arena` is refused as such, not taken for a Mooncake store result: its
    # read asked the store (localhost:50051), its release queued a store removal retried for
    # good, and its producer was never told.
    lost = {k: v for k, v in r.items() if k != "arena"}
    for call in (store.get, store.release):
        with pytest.raises(ca.InvalidReadError, match="missing field `arena`"):
            call(lost)
    assert store.health()["pending_frees"] == 0 and store._store_reader is None, store.health()
    # A store-placement result without its gen is invalid, not a KeyError (which a caller
    # skipping released samples takes for one: ReleasedError is a KeyError).
    no_gen = {"store_id": "st", "sample_id": "u", "features": {"target": {"shape": [1, 4], "dtype": "float32"}}}
    for call in (store.get, store.release):
        with pytest.raises(ca.InvalidReadError, match="missing field `gen`"):
            call(no_gen)
    store.release(r)
    store.flush(10)


def test_forged_results_cost_at_most_an_arena_and_objects_that_lie_about_their_size_nothing(make_sink):
    sink = make_sink(arena_bytes="1MiB")
    r = sink.put_sample(spec("f", L=16), aux=hidden(16, 8192), last_hidden=hidden(16, 4))
    store = ca.ArenaFeatureStore()
    # One real 256 KiB object under eight names (each checks out alone, stamps included): the
    # outputs would add up to twice the arena; refused before any is allocated.
    aliased = {**r, "features": {f"x{i}": r["features"]["hidden_state"] for i in range(8)}}
    with pytest.raises(ca.InvalidReadError, match=r"add up to 2097152 bytes, more than the 1048576-byte arena"):
        store.get(aliased)
    # A shape that claims 2^40 dimensions (a range, or any sequence whose len() says so) is
    # refused by its length before a value is read, in reads and releases alike.
    lying = {**r, "features": {"target": {**r["features"]["target"], "shape": range(1 << 40)}}}
    for call in (store.get, store.release):
        with pytest.raises(ca.InvalidReadError, match="1099511627776 items, more than the 65536 values"):
            call(lying)
    # A zero dimension does not make a shape numpy cannot describe a 0-byte tensor.
    zero = {**r, "features": {"target": {**r["features"]["target"], "shape": [0, (1 << 64) - 1]}}}
    with pytest.raises(ca.InvalidReadError, match="overflow"):
        store.get(zero)
    got = store.get(r, ["target"])  # the real result reads on
    assert got["target"].shape == (1, 16, 4)
    # Numpy integers (a result that went through pandas or datasets) are integers.
    f = r["features"]["target"]
    as_numpy = {**r, "gen": np.int64(r["gen"]), "features": {"target": {**f, "address": np.uint64(f["address"]), "shape": [np.int64(d) for d in f["shape"]], "stamp": np.uint64(f["stamp"])}}}
    assert (store.get(as_numpy, ["target"])["target"] == got["target"]).all()
    store.release(r)
    store.flush(10)


def test_forged_engine_results_and_feature_names_are_refused_before_anything_is_made() -> None:
    """A TransferEngine session carries no length, so the bound above (features add up to at
    most the arena) cannot hold there: one object named eight times was allocated for,
    registered and copied eight times. Overlapping features are refused, before an engine is
    made. Names: more than 256 features, an endless ``names`` iterable, or a name that is not a
    string (a Python dict may hold one) built lists of any length, or raised pyo3's TypeError."""
    import itertools

    def feat(address: int, stamp: int) -> dict[str, object]:
        return {"shape": [1, 64], "dtype": "bfloat16", "address": address, "stamp": stamp}

    def result(features: dict[object, object]) -> dict[str, object]:
        return {"sample_id": "s", "store_id": "st", "gen": 1, "aux_layer_ids": None, "features": features,
                "arena": {"session": "127.0.0.1:1", "control": "127.0.0.1:9"}}

    store = ca.ArenaFeatureStore()
    with pytest.raises(ca.InvalidReadError, match=r'cannot read x1: its bytes at 0x100000 overlap those of "x0"'):
        store.get(result({f"x{i}": feat(1 << 20, i + 1) for i in range(8)}))
    with pytest.raises(ca.InvalidReadError, match=r"overlap"):  # by 8 bytes
        store.get(result({"a": feat(1 << 20, 1), "b": feat((1 << 20) + 120, 2)}))
    assert store._engine_reader is None, "an engine was made for a result refused"
    apart = result({f"x{i}": feat((1 << 20) + 256 * i, i + 1) for i in range(257)})
    with pytest.raises(ca.InvalidReadError, match="at most 256 names, not 257 of them"):
        store.get(apart)
    for endless in (itertools.count(), itertools.repeat("a")):
        with pytest.raises(ca.InvalidReadError, match="more than 256 feature names asked for"):
            store.get(result({"a": feat(1 << 20, 1)}), endless)
    with pytest.raises(ca.InvalidReadError, match="strings, not int"):
        store.get(result({1: feat(1 << 20, 1)}))
    assert store._engine_reader is None


def test_a_forged_result_larger_than_the_gpu_is_refused_before_its_outputs_are_allocated_over_nvlink_faked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over NVLink a TransferEngine result is read into fresh CUDA tensors: one claiming 120 GiB
    raised torch's OutOfMemoryError, no error of ours, or took the GPU's memory from training.
    The NVLink reader faked on the CPU (tests/nvlink_fake.py: an 80 GiB GPU)."""
    from nvlink_fake import fake_nvlink

    fake_nvlink(monkeypatch.setattr)
    huge = {"sample_id": "s", "store_id": "st", "gen": 1, "aux_layer_ids": None,
            "features": {"h": {"shape": [1, 60 << 30], "dtype": "bfloat16", "address": 1 << 20, "stamp": 1}},
            "arena": {"session": "127.0.0.1:1", "control": "127.0.0.1:9"}}
    with pytest.raises(ca.InvalidReadError, match=r"need 128849018880 bytes, more than cuda:0's 85899345920"):
        ca.ArenaFeatureStore().get(huge, device="cuda:0")


def _memory_cgroup(limit: int) -> tuple[str, str]:
    """A memory cgroup of its own limited to ``limit`` bytes (v1's memory hierarchy where it is
    mounted, else v2's): its directory and the file that limits it. Skipped, saying why, where
    no cgroup can be made (not root, or cgroupfs mounted read-only: no limited cgroup exists
    there to test)."""
    name = f"capture-arena-test-{os.getpid()}"
    if os.path.exists("/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        where, knob = f"/sys/fs/cgroup/memory/{name}", "memory.limit_in_bytes"
    else:
        try:
            with open("/sys/fs/cgroup/cgroup.subtree_control") as f:
                controllers = f.read().split()
        except OSError:
            controllers = []
        if "memory" not in controllers:
            pytest.skip("no memory cgroup controller is mounted on this machine (neither v1's nor v2's)")
        where, knob = f"/sys/fs/cgroup/{name}", "memory.max"
    try:
        os.mkdir(where)
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup here: {e}")
    with open(os.path.join(where, knob), "w") as f:
        f.write(str(limit))
    return where, knob


_IN_CGROUP = """
import json, os, sys
with open(sys.argv[1], "w") as f:  # into the limited cgroup before capture_arena reads its limit
    f.write(str(os.getpid()))
import numpy as np
import capture_arena as ca
results, out = json.loads(sys.stdin.read()), {}
store = ca.ArenaFeatureStore()
for r in results:
    try:
        got = store.get(r)
        out[r["sample_id"]] = {n: np.ascontiguousarray(a).view(np.uint8).tobytes().hex() for n, a in got.items()}
    except ca.InvalidReadError as e:
        out[r["sample_id"]] = str(e)
    store.release(r)
store.flush(10)
print(json.dumps(out))
"""


def test_a_host_read_in_a_limited_cgroup_is_refused_past_the_cgroups_limit_not_the_hosts(make_sink):
    """A trainer in a container is killed past its cgroup's memory limit, not the host's: a read
    whose outputs need more than the cgroup's limit is refused with an error naming it (a real
    cgroup of 128 MiB, a reader process moved into it); one within it reads exact bytes."""
    limit = 128 << 20
    sink = make_sink(arena_bytes="256MiB")
    big, small = hidden(4096, 20480, 1), hidden(64, 512, 2)  # 160 MiB and 64 KiB of bf16
    results = sink.put_samples([(spec("big", 4096, last=False), big, None), (spec("small", 64, last=False), small, None)])
    need = sum(int(np.prod(f["shape"])) * (2 if f["dtype"] == "bfloat16" else 8) for f in results[0]["features"].values())
    where, _ = _memory_cgroup(limit)
    try:
        child = subprocess.run([sys.executable, "-c", _IN_CGROUP, os.path.join(where, "cgroup.procs")],
                               input=json.dumps(results), capture_output=True, text=True, timeout=120)
    finally:
        os.rmdir(where)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    got = json.loads(child.stdout)
    assert got["big"] == (f"the result's features need {need} bytes, more than this process's cgroup's {limit} bytes of memory: "
                          "read fewer of them (names=), into arrays of your own (out=), or give the process more memory")
    assert bytes.fromhex(got["small"]["hidden_state"]) == small.view(np.uint8).tobytes()
    wait_stats(sink, lambda s: s["resident_objects"] == 0)


def test_a_late_release_of_a_sample_published_again_frees_nothing_of_the_new_one(make_sink):
    # A retried capture publishes the sample again under the same keys (replace=True) while a
    # trainer still holds the first result: releasing that frees nothing of the new one.
    sink = make_sink()
    first = sink.put_sample(spec("r"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    again = sink.put_sample(spec("r", replace=True), aux=hidden(8, 12, 1), last_hidden=hidden(8, 4, 1))
    store = ca.ArenaFeatureStore()
    with pytest.raises(ca.ObjectChangedError):
        store.get(first)
    store.release(first)
    store.flush(10)
    s = sink.stats()
    assert s["stale_frees"] == 4 and s["resident_objects"] == 4, s
    got = store.get(again, ["hidden_state"])
    assert (got["hidden_state"][0] == hidden(8, 12, 1)).all()
    store.release(again)
    s = wait_stats(sink, lambda s: s["resident_objects"] == 0)
    assert s["free_bytes"] == s["capacity"], s


def test_results_of_a_closed_sink_are_stale(make_sink):
    sink = make_sink()
    r = sink.put_sample(spec("s"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    sink.close()
    with pytest.raises(ca.StaleSessionError, match="exited or restarted"):
        ca.ArenaFeatureStore().get(r)


def test_a_store_frees_over_the_control_endpoint_until_every_byte_is_free(make_sink):
    sink = make_sink(arena_bytes="2MiB", wait_s=10.0)
    store = ca.ArenaFeatureStore()
    # 3 x 48 batches of ~100 KiB through a 2 MiB arena: frees must flow back.
    for b in range(3):
        rs = sink.put_samples([(spec(f"b{b}s{i}", 32), hidden(32, 1536), hidden(32, 64)) for i in range(8)])
        for r in rs:
            assert "error" not in r, r
            store.get(r)
            store.release(r)
    s = wait_stats(sink, lambda s: s["freed_objects"] == s["published_objects"])
    assert (s["free_bytes"], s["resident_objects"], s["free_extents"]) == (s["capacity"], 0, 1)
    assert s["control_connections"] == 1, "one persistent connection"


def test_a_control_token_travels_in_the_result_and_release_presents_it(make_sink):
    import socket

    sink = make_sink(control_token="auto")
    r = sink.put_sample(spec("tok"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    token = r["arena"]["token"]
    assert isinstance(token, str) and len(token) == 32
    # A peer without the token (SpecForge's ArenaObjectClient sends none) frees nothing, is told
    # why and cut off, and the producer names it.
    host, port = r["arena"]["control"].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        keys = [f"st/tok/g1/{n}" for n in r["features"]]
        s.sendall((json.dumps(keys) + "\n").encode())
        s.settimeout(2)
        told = b""
        while True:  # to the end: a socket left open fails here with a timeout
            chunk = s.recv(4096)
            if not chunk:
                break
            told += chunk
    assert json.loads(told) == {"error": "unauthorized", "reason": "missing token"}
    wait_stats(sink, lambda s: s["unauthorized_lines"] == 1)
    (peer,) = sink.unauthorized_peers()
    assert (peer["peer"], peer["connections"], peer["reason"]) == ("127.0.0.1", 1, "missing token")
    assert sink.stats()["resident_objects"] == 4
    store = ca.ArenaFeatureStore()
    store.release(r)
    s = wait_stats(sink, lambda s: s["resident_objects"] == 0)
    assert s["freed_objects"] == 4 and s["unauthorized_lines"] == 1
    with pytest.raises(ca.ConfigError, match="SGLANG_SPEC_CAPTURE_CONTROL_TOKEN"):
        ca.ArenaSink(arena_bytes="1MiB", control_token="short", eager=True)


def test_reclaim_frees_a_dead_trainers_samples_by_prefix(make_sink):
    sink = make_sink(control_token="auto")
    rs = sink.put_samples([(spec(f"r{i}"), hidden(8, 12), hidden(8, 4)) for i in range(3)])
    control, token = rs[0]["arena"]["control"], rs[0]["arena"]["token"]
    with pytest.raises(ca.InvalidSampleError):
        ca.ArenaFeatureStore.reclaim(control, prefixes=["st"], token=token)
    ca.ArenaFeatureStore.reclaim(control, prefixes=["st/r0/"], keys=["st/r1/g1/target"], token=token)
    s = wait_stats(sink, lambda s: s["freed_objects"] == 5)
    assert s["resident_objects"] == 7
    ca.ArenaFeatureStore.reclaim(control, prefixes=["st/"], token=token)
    s = wait_stats(sink, lambda s: s["resident_objects"] == 0)
    assert s["free_bytes"] == s["capacity"] and s["unauthorized_lines"] == 0


def test_store_usage_and_prometheus_metrics_say_who_holds_the_arena(make_sink):
    prometheus_client = pytest.importorskip("prometheus_client")
    from capture_arena import metrics

    sink = make_sink()
    assert sink.store_usage() == []
    r = sink.put_sample(spec("m"), aux=hidden(8, 12), last_hidden=hidden(8, 4))
    usage = sink.store_usage()
    assert [(u["store_id"], u["objects"]) for u in usage] == [("st", 4)]
    assert usage[0]["bytes"] == 8 * 12 * 2 + 8 * 4 * 2 + 2 * 8 * 8 and usage[0]["oldest_age_s"] >= 0
    registry = prometheus_client.CollectorRegistry()
    assert metrics.register(sink, registry) is not None
    text = prometheus_client.generate_latest(registry).decode()
    for line in (
        'capture_arena_store_resident_objects{store_id="st"} 4.0',
        "capture_arena_published_samples_total 1.0",
        "capture_arena_resident_objects 4.0",
    ):
        assert line in text, text
    ca.ArenaFeatureStore().release(r)
    wait_stats(sink, lambda s: s["resident_objects"] == 0)
    assert 'store_id="st"' not in prometheus_client.generate_latest(registry).decode()


REPLAY = r"""
import json, sys
import capture_arena as ca
store = ca.ArenaFeatureStore()
outcomes = []
for line in sys.stdin:
    r = json.loads(line)
    try:
        got = store.get(r)
        outcomes.append({"read": {n: a.tobytes().hex()[:64] for n, a in got.items()}})
    except KeyError as e:
        outcomes.append({"refused": type(e).__name__})
print(json.dumps(outcomes))
"""


@pytest.mark.parametrize("transport", ["shm", "nixl"])
def test_a_result_released_elsewhere_is_refused_in_another_process_never_read_as_another_samples(make_sink, transport: str) -> None:
    """Trainer A releases samples; a restarted trainer B (another process) replays their results
    after new samples took the space: every read is refused (the objects' stamps changed), none
    returns a new sample's bytes."""
    if transport == "nixl" and "nixl" not in ca.FEATURES:
        pytest.skip("this build of capture_arena has no nixl feature (scripts/test.sh builds it)")
    kw = {"transport": "nixl"} if transport == "nixl" else {}
    sink = make_sink(arena_bytes="1MiB", **kw)
    L = 200  # 4 features, about 200 KiB a sample: four fill most of the arena
    old = sink.put_samples([(spec(f"old{i}", L), hidden(L, 3 * 128, i), hidden(L, 128, i)) for i in range(4)])
    a = ca.ArenaFeatureStore()
    for r in old:
        a.release(r)
    a.flush(10)
    wait_stats(sink, lambda s: s["resident_objects"] == 0)
    new = sink.put_samples([(spec(f"new{i}", L), hidden(L, 3 * 128, 100 + i), hidden(L, 128, 100 + i)) for i in range(4)])
    reused = {f["address"] for r in new for f in r["features"].values()} & {f["address"] for r in old for f in r["features"].values()}
    assert reused, "the new samples took the old ones' space"
    lines = "".join(json.dumps(r) + "\n" for r in old)
    out = subprocess.run([sys.executable, "-c", REPLAY], input=lines, capture_output=True, text=True, timeout=120, env=os.environ)
    assert out.returncode == 0, out.stderr[-2000:]
    outcomes = json.loads(out.stdout)
    assert outcomes == [{"refused": "ObjectChangedError"}] * 4 or all("refused" in o for o in outcomes), outcomes
    # The new samples read as themselves.
    b = ca.ArenaFeatureStore()
    for i, r in enumerate(new):
        got = b.get(r)
        assert got["hidden_state"].tobytes() == hidden(L, 3 * 128, 100 + i).tobytes()
        b.release(r)
    b.flush(10)


def test_the_output_pool_hands_out_disjoint_ranges_across_threads_and_takes_them_all_back() -> None:
    """Fresh outputs of NIXL and TransferEngine reads: arrays carved from registered slabs. Many
    threads taking and dropping arrays of mixed sizes never share a byte, and every range comes
    back (into coalesced free space) once the arrays are gone."""
    import gc
    import threading

    from capture_arena import _pool

    pool = _pool.OutputPool()
    errors: list[str] = []

    def work(k: int) -> None:
        rng = np.random.default_rng(k)
        held = []
        for i in range(300):
            n = int(rng.integers(1, 1 << 20))
            a = pool.bytes_u8(n)
            if a is None:
                errors.append("no room")
                return
            a.fill(k)
            held.append(a)
            if len(held) > 8:
                b = held.pop(int(rng.integers(0, len(held))))
                if not (b == k).all():
                    errors.append(f"thread {k}: a range was shared")
                del b
        for b in held:
            if not (b == k).all():
                errors.append(f"thread {k}: a range was shared")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.collect()
    s = pool.stats()
    assert not errors, errors[:3]
    assert s["free_bytes"] == s["bytes"] and s["slabs"] >= 1, s
    # Coalesced: a slab-sized array fits again without a new slab.
    assert pool.bytes_u8(_pool.SLAB_BYTES) is not None and pool.stats()["slabs"] == s["slabs"]
