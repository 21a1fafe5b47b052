"""The engine placement against the real Mooncake TransferEngine (the non-CUDA wheel, over TCP on
loopback): the arena inside a TransferEngine, results with the engine's session and virtual
addresses, a trainer that knows only Mooncake reading and freeing them, and ArenaFeatureStore
reading them too. scripts/test.sh installs Mooncake; a test skips (with its reason) only where it
is not importable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

import capture_arena as ca

from mooncake_master import MOONCAKE_ENGINE as mooncake_engine
from mooncake_master import needs_mooncake

ENV = {
    **os.environ,
    "MOONCAKE_PROTOCOL": "tcp",
    "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    "SGLANG_SPEC_CAPTURE_PLACEMENT": "engine",
    "SGLANG_SPEC_CAPTURE_ARENA_BYTES": "32MiB",
    "GLOG_minloglevel": "2",
}

# The producer: an engine-placement sink publishing a batch of 3 samples whose bytes are a function
# of (sample, feature, index), printing the results, then waiting for every free.
PRODUCER = r"""
import json, sys, time, numpy as np, ml_dtypes
import capture_arena as ca

def data(i, name, shape, dtype):
    n = int(np.prod(shape))
    seed = (i * 1_000_003 + sum(map(ord, name))) & 0xFFFF
    raw = ((np.arange(n * np.dtype(dtype).itemsize, dtype=np.uint64) * 2654435761 + seed) >> 7).astype(np.uint8)
    return raw.view(dtype).reshape(shape)

sink = ca.ArenaSink()
assert sink.placement == "engine", sink.placement
batch = []
for i in range(3):
    L = 64 + 32 * i
    spec = {"store_id": "st", "sample_id": f"s{i}", "gen": 1,
            "features": {"aux": "hidden_state", "last_hidden": "target"},
            "passthrough": [{"name": "input_ids", "data": list(range(L)), "shape": [1, L], "dtype": "int64"}]}
    batch.append((spec, data(i, "hidden_state", (L, 3 * 256), ml_dtypes.bfloat16), data(i, "target", (L, 256), ml_dtypes.bfloat16)))
for r in sink.put_samples(batch):
    print(json.dumps(r), flush=True)
deadline = time.time() + 60
while time.time() < deadline:
    st = sink.stats()
    if st["published_objects"] and st["freed_objects"] == st["published_objects"]:
        break
    time.sleep(0.05)
st = sink.stats()
print(json.dumps({"stats": st}), flush=True)
sys.exit(0 if st["resident_objects"] == 0 and st["free_bytes"] == st["capacity"] else 1)
"""

# A trainer that imports only mooncake.engine, json, socket and numpy: not capture_arena.
MOONCAKE_ONLY_TRAINER = r"""
import json, socket, sys
import numpy as np
from mooncake.engine import TransferEngine

ITEM = {"bfloat16": 2, "int64": 8}

def expected(i, name, nbytes):
    seed = (i * 1_000_003 + sum(map(ord, name))) & 0xFFFF
    return ((np.arange(nbytes, dtype=np.uint64) * 2654435761 + seed) >> 7).astype(np.uint8)

te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
results = [json.loads(l) for l in sys.stdin if l.startswith("{") and "features" in l]
checked = 0
for r in results:
    i = int(r["sample_id"][1:])
    session = r["arena"]["session"]
    for name, f in r["features"].items():
        n = int(np.prod(f["shape"])) * ITEM[f["dtype"]]
        buf = np.zeros(n, dtype=np.uint8)
        assert te.register_memory(buf.ctypes.data, n) == 0
        assert te.transfer_sync_read(session, buf.ctypes.data, f["address"], n) == 0, (name, f)
        te.unregister_memory(buf.ctypes.data)
        if name == "input_ids":
            assert buf.view(np.int64).tolist() == list(range(f["shape"][1])), name
        else:
            assert np.array_equal(buf, expected(i, name, n)), (r["sample_id"], name)
        checked += n
    host, port = r["arena"]["control"].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as c:
        keys = [f"{r['store_id']}/{r['sample_id']}/g{r['gen']}/{name}" for name in r["features"]]
        c.sendall((json.dumps(keys) + "\n").encode())
print(json.dumps({"samples": len(results), "bytes": checked}), flush=True)
"""


def _producer() -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", PRODUCER], env=ENV, stdout=subprocess.PIPE, text=True)


def _results(p: subprocess.Popen[str], n: int) -> list[str]:
    assert p.stdout is not None
    lines = [p.stdout.readline() for _ in range(n)]
    assert all(line.startswith("{") for line in lines), lines
    return lines


@needs_mooncake
def test_a_trainer_that_knows_only_mooncake_reads_and_frees_an_engine_arena():
    p = _producer()
    try:
        lines = _results(p, 3)
        r0 = json.loads(lines[0])
        host, port = r0["arena"]["session"].rsplit(":", 1)
        assert host == "127.0.0.1" and port.isdigit(), r0["arena"]
        t = subprocess.run(
            [sys.executable, "-c", MOONCAKE_ONLY_TRAINER], env=ENV, input="".join(lines), capture_output=True, text=True, timeout=120
        )
        assert t.returncode == 0, t.stdout + t.stderr
        assert json.loads(t.stdout.strip().splitlines()[-1])["samples"] == 3
        assert p.stdout is not None
        final = json.loads(p.stdout.readline())
        assert p.wait(timeout=60) == 0, final
        st = final["stats"]
        assert st["freed_objects"] == st["published_objects"] == 9 and st["free_bytes"] == st["capacity"], st
    finally:
        p.kill()


@needs_mooncake
def test_arena_feature_store_reads_engine_sessions_and_releases_them():
    reader = r"""
import json, sys, time, numpy as np, ml_dtypes
import capture_arena as ca
store = ca.ArenaFeatureStore()
other = ca.ArenaFeatureStore()  # another reader: a restarted trainer replaying results
lines = sys.stdin.readlines()
for k, line in enumerate(lines):
    r = json.loads(line)
    got = store.get(r)
    assert got["hidden_state"].dtype == ml_dtypes.bfloat16 and list(got["hidden_state"].shape) == r["features"]["hidden_state"]["shape"]
    assert got["input_ids"][0].tolist() == list(range(r["features"]["input_ids"]["shape"][1]))
    out = {"target": np.zeros(r["features"]["target"]["shape"], dtype=ml_dtypes.bfloat16)}
    store.get(r, ["target"], out=out)
    assert np.array_equal(out["target"].view(np.uint16), got["target"].view(np.uint16))
    store.release(r)
    try:
        store.get(r)
        raise SystemExit("read after release")
    except ca.ReleasedError:
        pass
    store.flush(10)
    if k == len(lines) - 1:
        break  # the producer exits once this one is freed
    # Once the producer applied the frees, the objects' stamps refuse the other reader's reads;
    # until then the bytes it reads are the sample's.
    deadline = time.monotonic() + 10
    while True:
        try:
            again = other.get(r)
        except KeyError as e:
            assert isinstance(e, ca.ReleasedError), e
            break
        assert all(np.array_equal(again[n].view(np.uint8), got[n].view(np.uint8)) for n in got)
        assert time.monotonic() < deadline, "a freed object still read"
        time.sleep(0.02)
print("ok", flush=True)
"""
    p = _producer()
    try:
        lines = _results(p, 3)
        t = subprocess.run([sys.executable, "-c", reader], env=ENV, input="".join(lines), capture_output=True, text=True, timeout=120)
        assert t.returncode == 0 and "ok" in t.stdout, t.stdout + t.stderr
        assert p.stdout is not None
        final = json.loads(p.stdout.readline())
        assert p.wait(timeout=60) == 0, final
    finally:
        p.kill()


@needs_mooncake
@pytest.mark.parametrize(
    ("protocol", "needle"),
    [("nvlink", "SUPPORT_MNNVL is False"), ("nvlink_intra", "SUPPORT_INTRA_NVLINK is False")],
)
def test_nvlink_without_the_transport_in_this_mooncake_build_is_refused_clearly(protocol, needle):
    if getattr(mooncake_engine, "SUPPORT_MNNVL" if protocol == "nvlink" else "SUPPORT_INTRA_NVLINK", False):
        pytest.skip(f"this Mooncake build has the {protocol} transport (a CUDA build, on a GPU machine)")
    env = {**ENV, "MOONCAKE_PROTOCOL": protocol}
    env.pop("SGLANG_SPEC_CAPTURE_PLACEMENT")  # auto: the engine under NVLink
    code = r"""
import numpy as np, capture_arena as ca
s = ca.ArenaSink()
assert s.placement == "engine" and s.device_publication
row = s.put_sample({"store_id": "st", "sample_id": "x", "gen": 1, "features": {"last_hidden": "target"}},
                   last_hidden=np.ones((4, 8), dtype=np.float32))
if "error" not in row:
    raise SystemExit("published without the transport")
print(row["error"])
assert not s.started
"""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert needle in out.stdout and "SGLANG_SPEC_CAPTURE_PLACEMENT=arena" in out.stdout, out.stdout


def test_the_engine_placement_without_mooncake_says_how_to_install_it():
    code = r"""
import sys
sys.modules["mooncake"] = None  # as if it were not installed
sys.modules["mooncake.engine"] = None
import numpy as np, capture_arena as ca
s = ca.ArenaSink()
row = s.put_sample({"store_id": "st", "sample_id": "x", "gen": 1, "features": {"last_hidden": "target"}},
                   last_hidden=np.ones((4, 8), dtype=np.float32))
if "error" not in row:
    raise SystemExit("published without Mooncake")
print(row["error"])
"""
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "pip install mooncake-transfer-engine" in out.stdout and "SGLANG_SPEC_CAPTURE_PLACEMENT=arena" in out.stdout


def test_placement_names(make_sink, monkeypatch):
    monkeypatch.delenv("SGLANG_SPEC_CAPTURE_PLACEMENT", raising=False)
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    assert make_sink().placement == "store"
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "nvlink_intra")
    assert make_sink().placement == "engine"
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_PLACEMENT", "arena")
    assert make_sink().placement == "arena"
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_PLACEMENT", "shm")
    with pytest.raises(ca.ConfigError, match="auto, arena, engine, store"):
        make_sink()
    time.sleep(0)


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_a_missing_nvlink_transport_is_explained_for_this_architecture(machine: str) -> None:
    """Mooncake's CUDA wheels differ by architecture (x86_64: intra-node NVLink only; aarch64:
    multi-node NVLink only): the hint for a missing transport says what exists there."""
    from capture_arena._engine import missing_transport

    intra = missing_transport("nvlink_intra", machine)
    multi = missing_transport("nvlink", machine)
    for text in (intra, multi):
        assert "SGLANG_SPEC_CAPTURE_PLACEMENT=arena" in text, text
    assert "SUPPORT_INTRA_NVLINK is False" in intra and "SUPPORT_MNNVL is False" in multi
    if machine == "aarch64":
        # No wheel to install has it there: never send the user to -cuda13 for nvlink_intra.
        assert "-cuda13" not in intra and "MOONCAKE_PROTOCOL=nvlink " in intra, intra
        assert "-DUSE_INTRA_NVLINK=ON" in intra, intra
        assert "mooncake-transfer-engine-cuda13" in multi, multi
    else:
        assert "mooncake-transfer-engine-cuda13" in intra, intra
        assert "x86_64 wheels are built without it" in multi and "nvlink_intra" in multi, multi


class _StandInEngine:
    """A stand-in for Mooncake's TransferEngine (no CUDA Mooncake here): records the environment
    Mooncake would read its transport from when it is initialised."""

    seen: list[dict[str, str | None]] = []

    def initialize(self, host: str, metadata: str, protocol: str, devices: str) -> int:
        _StandInEngine.seen.append({k: os.environ.get(k) for k in ("MC_FORCE_MNNVL", "MC_INTRANODE_NVLINK", "MC_FORCE_TCP")})
        return 0

    def get_rpc_port(self) -> int:
        return 4242


def test_the_protocol_forces_mooncakes_transport_with_a_stand_in_mooncake(monkeypatch: pytest.MonkeyPatch) -> None:
    """MOONCAKE_PROTOCOL selects only Mooncake's allocator; its transport comes from the
    environment and the host's devices (on a host with RDMA NICs: RDMA). The engine is made with
    MC_FORCE_MNNVL=true under nvlink, MC_INTRANODE_NVLINK=true under nvlink_intra, MC_FORCE_TCP=1
    under tcp (a value the user set stands), and the placement says which transport it got. A
    stand-in mooncake.engine module, since the CUDA wheels with these transports cannot run
    here."""
    import types

    from capture_arena import _engine

    stand_in = types.SimpleNamespace(SUPPORT_MNNVL=True, SUPPORT_INTRA_NVLINK=True, TransferEngine=_StandInEngine)
    monkeypatch.setitem(sys.modules, "mooncake.engine", stand_in)
    for k in ("MC_FORCE_MNNVL", "MC_INTRANODE_NVLINK", "MC_FORCE_TCP"):
        monkeypatch.setenv(k, "")  # recorded, so what new_engine sets is undone after the test
        monkeypatch.delenv(k)
    _StandInEngine.seen.clear()
    _, session = _engine.new_engine("nvlink")
    assert session.endswith(":4242")
    assert _StandInEngine.seen[-1]["MC_FORCE_MNNVL"] == "true", _StandInEngine.seen
    monkeypatch.setenv("MC_FORCE_MNNVL", "false")  # the user's choice stands
    _engine.new_engine("nvlink")
    assert _StandInEngine.seen[-1]["MC_FORCE_MNNVL"] == "false", _StandInEngine.seen
    monkeypatch.delenv("MC_FORCE_MNNVL")
    _engine.new_engine("nvlink_intra")
    assert _StandInEngine.seen[-1] == {"MC_FORCE_MNNVL": None, "MC_INTRANODE_NVLINK": "true", "MC_FORCE_TCP": None}, _StandInEngine.seen
    # "tcp" is TCP even on a host with RDMA devices, where Mooncake would install RDMA.
    monkeypatch.delenv("MC_INTRANODE_NVLINK")
    _engine.new_engine("tcp")
    assert _StandInEngine.seen[-1]["MC_FORCE_TCP"] == "1", _StandInEngine.seen
    assert _engine.transport_of("tcp", True).startswith("TCP"), _engine.transport_of("tcp", True)
    monkeypatch.delenv("MC_FORCE_TCP")
    assert _engine.transport_of("rdma", True).startswith("RDMA")
    assert "no RDMA device" in _engine.transport_of("rdma", False)


def test_a_small_nvlink_engine_arena_does_not_reserve_mooncakes_2_gib_pool() -> None:
    """Mooncake's allocate_managed_buffer serves buffers of up to 256 MiB from a 2 GiB pool it
    allocates whole (transfer_engine_py.h); an engine arena asks for at least one page more, so a
    small arena costs 256 MiB of device memory and uses all of it; a larger one is its size."""
    from capture_arena._engine import MOONCAKE_MAX_SLAB, managed_bytes

    assert MOONCAKE_MAX_SLAB == 256 << 20
    assert managed_bytes(64 << 20) == (256 << 20) + 4096
    assert managed_bytes(1 << 30) == 1 << 30


class _StandInIntraEngine(_StandInEngine):
    """A stand-in TransferEngine under nvlink_intra: registering local memory fails as Mooncake's
    does for VMM and cudaMallocAsync memory (cudaIpcGetMemHandle), and reads copy host bytes."""

    remote = bytearray(b"\x07" * 64)

    def register_memory(self, addr: int, n: int) -> int:
        return -1

    def unregister_memory(self, addr: int) -> int:
        return 0

    def transfer_sync_read(self, session: str, local: int, remote: int, n: int) -> int:
        import ctypes

        ctypes.memmove(local, bytes(self.remote[remote : remote + n]), n)
        return 0

    def batch_transfer_sync_read(self, session: str, locals_: list[int], remotes: list[int], ns: list[int]) -> int:
        for local, remote, n in zip(locals_, remotes, ns):
            self.transfer_sync_read(session, local, remote, n)
        return 0


def _stand_in_reader(monkeypatch: pytest.MonkeyPatch, engine: type, protocol: str) -> Any:
    """An EngineReader under an NVLink ``protocol`` over a stand-in mooncake.engine module whose
    TransferEngine is ``engine`` (Mooncake's CUDA wheels cannot run here)."""
    import types

    from capture_arena import _engine

    stand_in = types.SimpleNamespace(SUPPORT_MNNVL=True, SUPPORT_INTRA_NVLINK=True, TransferEngine=engine)
    monkeypatch.setitem(sys.modules, "mooncake.engine", stand_in)
    monkeypatch.setenv("MOONCAKE_PROTOCOL", protocol)
    monkeypatch.setenv("MC_FORCE_MNNVL" if protocol == "nvlink" else "MC_INTRANODE_NVLINK", "true")
    return _engine.EngineReader()


def test_an_nvlink_intra_read_registers_no_output_with_a_stand_in_mooncake(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mooncake's intra-node NVLink transport copies straight into the local address: an
    nvlink_intra read registers no output (registering one exports its whole caching-allocator
    segment with cudaIpcGetMemHandle, which fails on torch's expandable segments). A stand-in
    mooncake.engine module whose registration fails as that does; host arrays stand in for the
    CUDA outputs (no GPU here)."""
    import numpy as np

    reader = _stand_in_reader(monkeypatch, _StandInIntraEngine, "nvlink_intra")
    out = np.zeros(16, dtype=np.uint8)
    reader.read("127.0.0.1:4242", [(8, int(out.ctypes.data), 16)], keep=out)
    assert out.tolist() == [7] * 16


class _StandInFabricEngine(_StandInIntraEngine):
    """A stand-in TransferEngine under nvlink (multi-node), registering as Mooncake 3b5a594 does
    for cudaMalloc memory: the transport records nothing, so the unregister fails
    (ERR_ADDRESS_NOT_REGISTERED) and TransferEngineImpl returns before forgetting the range; a
    later registration overlapping it fails (ERR_ADDRESS_OVERLAPPED)."""

    def __init__(self) -> None:
        self.reserved: list[tuple[int, int]] = []

    def register_memory(self, addr: int, n: int) -> int:
        if any(a < addr + n and addr < a + m for a, m in self.reserved):
            return -1
        self.reserved.append((addr, n))
        return 0

    def unregister_memory(self, addr: int) -> int:
        return -1


def test_a_multi_node_nvlink_read_registers_no_output_so_memory_read_into_twice_reads_again_with_a_stand_in_mooncake(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Mooncake's multi-node NVLink transport never looks the local address up: a read under
    nvlink registers no output. Registered, an output's range stayed reserved in the engine
    after the read (its unregister fails for cudaMalloc memory), and the next read into the same
    memory, which torch's caching allocator hands out again, failed. A stand-in mooncake.engine
    module that registers as Mooncake does; a host array stands in for the CUDA output (no GPU
    here)."""
    import numpy as np

    reader = _stand_in_reader(monkeypatch, _StandInFabricEngine, "nvlink")
    out = np.zeros(16, dtype=np.uint8)
    for _ in range(2):
        out[:] = 0
        reader.read("127.0.0.1:4242", [(8, int(out.ctypes.data), 16)], keep=out)
        assert out.tolist() == [7] * 16
    assert reader._engines.get().reserved == []


class _StandInTcpEngine(_StandInIntraEngine):
    """A stand-in TransferEngine over TCP whose object (16 bytes at 0, its stamp word at 16) is
    still being written at the first look, and records what is registered."""

    registered: list[int] = []
    looks = 0

    def register_memory(self, addr: int, n: int) -> int:
        _StandInTcpEngine.registered.append(n)
        return 0

    def transfer_sync_read(self, session: str, local: int, remote: int, n: int) -> int:
        import ctypes

        if (remote, n) == (16, 8):
            _StandInTcpEngine.looks += 1
            word = 5 | (1 << 63) if _StandInTcpEngine.looks == 1 else 5
            ctypes.memmove(local, word.to_bytes(8, "little"), 8)
            return 0
        return super().transfer_sync_read(session, local, remote, n)


def test_a_read_registers_its_outputs_only_once_the_first_look_found_its_objects_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """A result handed out before its bytes (vLLM's connector) is looked at again until they are
    there: each look registered (pinned, over RDMA) and unregistered every output, and a result
    whose stamps are not its objects' pinned them all before it was refused. The outputs are
    registered once the first look found every object written. A stand-in mooncake.engine
    module."""
    import numpy as np

    monkeypatch.setenv("MC_FORCE_TCP", "")  # recorded, so what new_engine sets is undone after the test
    monkeypatch.delenv("MC_FORCE_TCP")
    _StandInTcpEngine.registered, _StandInTcpEngine.looks = [], 0
    reader = _stand_in_reader(monkeypatch, _StandInTcpEngine, "tcp")
    out = np.zeros(16, dtype=np.uint8)
    reader.read("127.0.0.1:4242", [(0, int(out.ctypes.data), 16)], keep=out, stamps=[("st/s/g1/x", 16, 5)])
    assert out.tolist() == [7] * 16
    assert _StandInTcpEngine.looks == 3, _StandInTcpEngine.looks  # pending; there; there after the copy
    assert _StandInTcpEngine.registered == [8, 8, 16], _StandInTcpEngine.registered  # the words twice, the output once


# A producer that publishes sample "r", then (at "go") publishes it again under the same keys
# (replace=True, other bytes), which frees the first objects and places the new ones in their
# space; then it waits for every free.
REPLACING_PRODUCER = r"""
import json, sys, time, numpy as np, ml_dtypes
import capture_arena as ca

sink = ca.ArenaSink()
assert sink.placement == "engine", sink.placement

def put(seed, replace):
    rng = np.random.default_rng(seed)
    spec = {"store_id": "st", "sample_id": "r", "gen": 1, "replace": replace,
            "features": {"aux": "hidden_state", "last_hidden": "target"},
            "passthrough": [{"name": "input_ids", "data": list(range(64)), "shape": [1, 64], "dtype": "int64"}]}
    aux = rng.standard_normal((64, 768), dtype=np.float32).astype(ml_dtypes.bfloat16)
    last = rng.standard_normal((64, 256), dtype=np.float32).astype(ml_dtypes.bfloat16)
    return sink.put_sample(spec, aux=aux, last_hidden=last)

print(json.dumps(put(0, False)), flush=True)
sys.stdin.readline()
print(json.dumps(put(1, True)), flush=True)
deadline = time.time() + 60
while time.time() < deadline and sink.stats()["resident_objects"]:
    time.sleep(0.05)
st = sink.stats()
print(json.dumps({"stats": st}), flush=True)
sys.exit(0 if st["resident_objects"] == 0 and st["free_bytes"] == st["capacity"] else 1)
"""

# The trainer: reads the first result, then (given the second) the first again and the second.
REPLACED_READER = r"""
import json, sys
import numpy as np
import capture_arena as ca

store = ca.ArenaFeatureStore()
first = json.loads(sys.stdin.readline())
before = store.get(first)
print("read", flush=True)
again = json.loads(sys.stdin.readline())
outcome = {}
try:
    got = store.get(first)
    outcome["first"] = "returned " + ("the new bytes" if not np.array_equal(got["hidden_state"].view(np.uint16), before["hidden_state"].view(np.uint16)) else "its own bytes")
except KeyError as e:
    outcome["first"] = f"{type(e).__name__}: {e}"
new = store.get(again)
outcome["again_differs"] = not np.array_equal(new["hidden_state"].view(np.uint16), before["hidden_state"].view(np.uint16))
store.release(first)  # a stale free: frees nothing of the new sample
store.release(again)
store.flush(10)
print(json.dumps(outcome), flush=True)
"""


@needs_mooncake
def test_a_read_through_a_transfer_engine_of_an_object_whose_space_holds_another_now_fails_with_object_changed() -> None:
    """A trainer holds a result; its producer publishes the sample again under the same keys
    (a retried capture), so the first objects are freed and the new ones placed in their space.
    Reading the first result through the TransferEngine raises ObjectChangedError, naming the
    key, rather than returning the new sample's bytes (docs/protocol.md's stamp rule; until
    2026-12-07 tested over shared memory only); the new result reads, and the first result's
    late release frees nothing of it."""
    p = subprocess.Popen([sys.executable, "-c", REPLACING_PRODUCER], env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    t = subprocess.Popen([sys.executable, "-c", REPLACED_READER], env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdin is not None and p.stdout is not None and t.stdin is not None and t.stdout is not None
        (first,) = _results(p, 1)
        t.stdin.write(first)
        t.stdin.flush()
        assert t.stdout.readline() == "read\n"
        p.stdin.write("go\n")
        p.stdin.flush()
        (again,) = _results(p, 1)
        t.stdin.write(again)
        t.stdin.flush()
        line = t.stdout.readline()
        assert line, t.stderr.read() if t.stderr is not None else ""
        outcome = json.loads(line)
        assert outcome["first"].startswith("ObjectChangedError: st/r/g1/") and "holds another object now" in outcome["first"], outcome
        assert outcome["again_differs"] is True, outcome
        assert t.wait(timeout=60) == 0
        final = json.loads(p.stdout.readline())
        assert p.wait(timeout=60) == 0, final
        keys = len(json.loads(first)["features"])  # hidden_state, target, input_ids
        assert final["stats"]["stale_frees"] == keys == 3, final  # the first result's keys: nothing of the new one
    finally:
        p.kill()
        t.kill()


# Reads a result once, then again once told the producer is stopped, interrupted (SIGINT) 0.5 s
# into that read; says how the read ended and what the reader holds, and once told the producer
# runs again, whether the engine the interrupted read was stuck in was let go.
INTERRUPTED_READER = r"""
import json, os, signal, sys, threading, time
import capture_arena as ca

store = ca.ArenaFeatureStore()
r = json.loads(sys.stdin.readline())
store.get(r)
print("read", flush=True)
sys.stdin.readline()
threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
t0 = time.monotonic()
try:
    store.get(r)
    outcome = {"got": "returned"}
except KeyboardInterrupt:
    outcome = {"got": "interrupted"}
except Exception as e:
    outcome = {"got": f"{type(e).__name__}: {e}"[:300]}
outcome["s"] = time.monotonic() - t0
h = store.health()
outcome.update(stuck_clients=h["stuck_clients"], mooncake_clients=h["mooncake_clients"])
print(json.dumps(outcome), flush=True)
sys.stdin.readline()
deadline = time.monotonic() + 60
while store.health()["stuck_clients"] and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps({"stuck_clients": store.health()["stuck_clients"]}), flush=True)
"""


@needs_mooncake
def test_a_read_interrupted_while_its_transfer_is_stuck_sets_its_engine_aside_as_at_its_deadline() -> None:
    """Ctrl+C (SIGINT) in a trainer while its TransferEngine read waits on a stopped producer:
    the KeyboardInterrupt reaches the caller, and the read is given up as at its deadline: its
    engine set aside while the transfer is stuck in it, so the next read uses a new one, and let
    go once the producer answers again (before: the interrupted read's engine stayed the
    reader's current one, its transfer uncounted, and the next read waited behind it; found by
    an outside reading)."""
    import signal

    p = _producer()
    t = subprocess.Popen([sys.executable, "-c", INTERRUPTED_READER], env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert t.stdin is not None and t.stdout is not None
        first = _results(p, 3)[0]
        t.stdin.write(first)
        t.stdin.flush()
        assert t.stdout.readline() == "read\n", t.stderr.read() if t.stderr is not None else ""
        p.send_signal(signal.SIGSTOP)
        t.stdin.write("stopped\n")
        t.stdin.flush()
        outcome = json.loads(t.stdout.readline())
        assert outcome["got"] == "interrupted" and outcome["s"] < 5, outcome
        assert outcome["stuck_clients"] == 1 and outcome["mooncake_clients"] == 1, outcome
        p.send_signal(signal.SIGCONT)
        t.stdin.write("running\n")
        t.stdin.flush()
        assert json.loads(t.stdout.readline()) == {"stuck_clients": 0}
    finally:
        p.send_signal(signal.SIGCONT)
        p.kill()
        t.kill()
