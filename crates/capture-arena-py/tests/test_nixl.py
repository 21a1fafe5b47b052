"""NIXL from Python: a producer process serves its arena through NIXL (``transport="nixl"``) and
a trainer process reads every byte with ``ArenaFeatureStore`` and releases it, over
``UCX_TLS=tcp`` (the cross-host path) and over UCX's default transports; the arena ends free.

Both sides are subprocesses because UCX reads ``UCX_TLS`` once per process. Needs the NIXL
library (scripts/test.sh installs it and sets ``SGLANG_SPEC_CAPTURE_NIXL_LIB``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Optional

import pytest

import capture_arena as ca

pytestmark = pytest.mark.skipif(
    "nixl" not in ca.FEATURES, reason="this build of capture_arena has no nixl feature (scripts/test.sh builds it)"
)

COMMON = r"""
import os
import numpy as np, ml_dtypes
def servers():  # the producer's child processes: its NIXL server
    me, found = os.getpid(), set()
    for t in os.listdir(f"/proc/{me}/task"):
        try:
            found.update(open(f"/proc/{me}/task/{t}/children").read().split())
        except FileNotFoundError:
            pass
    return sorted(found)
def tensors(i):
    rng = np.random.default_rng(i)
    L = 64 + 37 * i
    aux = rng.standard_normal((L, 3 * 256), dtype=np.float32).astype(ml_dtypes.bfloat16)
    last = rng.standard_normal((L, 256), dtype=np.float32).astype(ml_dtypes.bfloat16)
    return L, aux, last
def spec(i, L):
    return {"store_id": "nx", "sample_id": f"s{i}", "gen": 1,
            "features": {"aux": "hidden_state", "last_hidden": "target"},
            "passthrough": [{"name": "input_ids", "data": list(range(L)), "shape": [1, L], "dtype": "int64"}]}
"""

PRODUCER = COMMON + r"""
import json, sys, time
import capture_arena as ca
sink = ca.ArenaSink(arena_bytes="4MiB", transport="nixl", wait_s=20)
batch = []
for i in range(6):
    L, aux, last = tensors(i)
    batch.append((spec(i, L), aux, last))
for r in sink.put_samples(batch[:3]) + sink.put_samples(batch[3:]):
    print(json.dumps(r), flush=True)
deadline = time.monotonic() + 60
while sink.stats()["resident_objects"] and time.monotonic() < deadline:
    time.sleep(0.02)
print(json.dumps({"stats": sink.stats()}), flush=True)
sink.close()
"""

TRAINER = COMMON + r"""
import json, sys
import numpy as np
import capture_arena as ca
store = ca.ArenaFeatureStore()
n = 0
# With an argument: read into views of one ReadBuffer, registered with NIXL once.
rb = ca.ReadBuffer(8 << 20) if len(sys.argv) > 1 else None
for line in sys.stdin:
    r = json.loads(line)
    if "stats" in r:
        continue
    i = int(r["sample_id"][1:])
    L, aux, last = tensors(i)
    out = None
    if rb is not None:
        mem, off = np.asarray(rb), 0
        out = {}
        for name, dt, shape in (("hidden_state", ml_dtypes.bfloat16, (1, L, 3 * 256)), ("target", ml_dtypes.bfloat16, (1, L, 256)), ("input_ids", np.int64, (1, L))):
            nb = int(np.prod(shape)) * np.dtype(dt).itemsize
            out[name] = mem[off : off + nb].view(dt).reshape(shape)
            off += (nb + 4095) // 4096 * 4096
    got = store.get(r, out=out) if out is not None else store.get(r)
    assert np.array_equal(got["hidden_state"].view(np.uint16), aux.reshape(1, L, -1).view(np.uint16)), i
    assert np.array_equal(got["target"].view(np.uint16), last.reshape(1, L, -1).view(np.uint16)), i
    assert got["input_ids"].tolist() == [list(range(L))], i
    assert r["arena"]["session"].startswith("nixl://"), r["arena"]["session"]
    store.release(r)
    n += 1
store.flush()
if rb is not None:
    assert rb.registrations == 1, rb.registrations
print(json.dumps({"read": n}), flush=True)
"""


def env_for(tls: Optional[str]) -> dict[str, str]:
    e = dict(os.environ)
    e.pop("UCX_TLS", None)
    if tls:
        e["UCX_TLS"] = tls
    return e


@pytest.mark.parametrize(
    "tls,read_buffer", [("tcp", False), (None, False), ("tcp", True)], ids=["ucx-tcp", "ucx-default", "ucx-tcp-readbuffer"]
)
def test_a_trainer_process_reads_every_byte_through_nixl_and_the_arena_ends_free(tls: Optional[str], read_buffer: bool) -> None:
    env = env_for(tls)
    producer = subprocess.Popen([sys.executable, "-c", PRODUCER], env=env, stdout=subprocess.PIPE, text=True)
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, *(["readbuffer"] if read_buffer else [])],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert producer.stdout is not None and trainer.stdin is not None
    last = None
    for line in producer.stdout:
        if line.startswith("{"):
            v = json.loads(line)
            if "stats" in v:
                last = v["stats"]
            else:
                trainer.stdin.write(line)
                trainer.stdin.flush()
    trainer.stdin.close()
    assert trainer.stdout is not None
    out = trainer.stdout.read()
    trainer.wait(timeout=120)
    assert producer.wait(timeout=60) == 0
    assert trainer.returncode == 0, out
    assert json.loads(out.strip().splitlines()[-1]) == {"read": 6}
    assert last is not None
    assert last["resident_objects"] == 0 and last["free_bytes"] == last["capacity"], last
    assert last["published_samples"] == 6 and last["freed_objects"] == last["published_objects"]


def test_a_read_buffer_is_a_writable_numpy_view_kept_alive_by_its_arrays() -> None:
    import numpy as np

    rb = ca.ReadBuffer(10_000)
    a = np.asarray(rb)
    assert a.dtype == np.uint8 and a.shape == (10_000,) and not a.any()
    a[9_999] = 7
    del rb
    assert np.asarray(a)[9_999] == 7 and a.base is not None
    with pytest.raises(ca.InvalidReadError):
        ca.ReadBuffer(0)


def test_an_unknown_transport_is_a_config_error() -> None:
    with pytest.raises(ca.ConfigError, match="transport"):
        ca.ArenaSink(arena_bytes="1MiB", transport="carrier-pigeon")


def test_the_producer_outlives_its_nixl_server_process_and_starts_another() -> None:
    """UCX runs in a server process of the producer's (SGLANG_SPEC_CAPTURE_NIXL_SERVER, set by the
    package): when it dies (here SIGKILL, as a UCX abort would end it), the producer lives on,
    says so, publishes, and starts a new server. Samples published before fail as stale (their
    session names the dead agent) and are freed when released; samples published once the new
    server is up read through it; every object is freed."""
    producer = COMMON + r"""
import json, os, sys, time
import capture_arena as ca
sink = ca.ArenaSink(arena_bytes="4MiB", transport="nixl", wait_s=20)
def put(i):
    L, aux, last = tensors(i)
    (r,) = sink.put_samples([(spec(i, L), aux, last)])
    print(json.dumps(r), flush=True)
    return r
first_session = put(0)["arena"]["session"]
put(1)
first = servers()
print(json.dumps({"server": first}), flush=True)
sys.stdin.readline()  # the server was killed
# Publishing goes on; the results committed once a new server is up carry its session.
i, deadline = 2, time.monotonic() + 60
while time.monotonic() < deadline:
    r = put(i)
    i += 1
    if r["arena"]["session"] != first_session:
        break
    time.sleep(0.1)
# What the sink says readers open follows (before: the first session, the dead agent's).
assert sink.session == r["arena"]["session"] != first_session, (sink.session, r["arena"]["session"])
print(json.dumps({"restarted": sorted(set(servers()) - set(first))}), flush=True)
deadline = time.monotonic() + 60
while sink.stats()["resident_objects"] and time.monotonic() < deadline:
    time.sleep(0.02)
print(json.dumps({"stats": sink.stats()}), flush=True)
sink.close()
"""
    trainer = COMMON + r"""
import json, sys
import capture_arena as ca
store = ca.ArenaFeatureStore()
for line in sys.stdin:
    r = json.loads(line)
    try:
        store.get(r)
        print(json.dumps({"ok": True}), flush=True)
    except ca.StaleSessionError as e:
        print(json.dumps({"ok": False, "stale": str(e)[:200]}), flush=True)
    store.release(r)
store.flush(10)
"""
    env = {**env_for("tcp"), "SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S": "5"}
    env.pop("SGLANG_SPEC_CAPTURE_NIXL_SERVER", None)  # the package's default: a server process
    p = subprocess.Popen([sys.executable, "-c", producer], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t = subprocess.Popen([sys.executable, "-c", trainer], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdin is not None and t.stdin is not None and t.stdout is not None

        def read(result: dict[str, Any]) -> dict[str, Any]:
            assert t.stdin is not None and t.stdout is not None
            t.stdin.write(json.dumps(result) + "\n")
            t.stdin.flush()
            return json.loads(t.stdout.readline())

        results = [json.loads(p.stdout.readline()), json.loads(p.stdout.readline())]
        assert read(results[0]) == {"ok": True}
        servers = json.loads(p.stdout.readline())["server"]
        assert len(servers) == 1, servers
        os.kill(int(servers[0]), 9)
        p.stdin.write("\n")
        p.stdin.flush()
        got = read(results[1])  # published before the server died
        assert got["ok"] is False and "stale" in got, got
        # Published while no server ran (stale, and released all the same), then through the
        # new one.
        since = []
        while "restarted" not in (line := json.loads(p.stdout.readline())):
            assert "error" not in line, line  # publishing goes on
            since.append((line["arena"]["session"], read(line)))
        assert len(line["restarted"]) == 1 and line["restarted"] != servers, line
        assert since[-1][0] != results[0]["arena"]["session"], len(since)
        assert since[-1][1] == {"ok": True}, since[-1]
        assert all(got["ok"] is False for _, got in since[:-1]), since
        t.stdin.close()
        assert t.wait(timeout=60) == 0
        stats = json.loads(p.stdout.readline())["stats"]
        assert stats["resident_objects"] == 0 and stats["freed_objects"] == stats["published_objects"], stats
        assert p.wait(timeout=60) == 0
        assert p.stderr is not None
        err = p.stderr.read()
        assert "the NIXL server process ended" in err and "was restarted" in err, err[-2000:]
    finally:
        p.kill()
        t.kill()


def test_a_ctrl_c_to_the_producers_process_group_leaves_its_nixl_server_serving() -> None:
    """A terminal's Ctrl+C reaches the producer's whole process group, its NIXL server too;
    the producer may go on (drain its work) and its trainers read through that server. The
    server ignores SIGINT and serves until its stdin closes (before: Python's handler
    interrupted its read of stdin, and it ended)."""
    producer = COMMON + r"""
import json, os, sys
import capture_arena as ca
sink = ca.ArenaSink(arena_bytes="4MiB", transport="nixl", wait_s=20)
for i, line in enumerate(sys.stdin):  # one sample a line, with the servers running then
    L, aux, last = tensors(i)
    (r,) = sink.put_samples([(spec(i, L), aux, last)])
    print(json.dumps({"result": r, "servers": servers()}), flush=True)
sink.close()
"""
    trainer = COMMON + r"""
import json, sys
import capture_arena as ca
store = ca.ArenaFeatureStore()
for line in sys.stdin:
    r = json.loads(line)
    store.get(r)
    store.release(r)
    print(json.dumps({"ok": True}), flush=True)
store.flush(10)
"""
    env = {**env_for("tcp"), "SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S": "5"}
    env.pop("SGLANG_SPEC_CAPTURE_NIXL_SERVER", None)  # the package's default: a server process
    p = subprocess.Popen([sys.executable, "-c", producer], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    t = subprocess.Popen([sys.executable, "-c", trainer], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdin is not None and p.stdout is not None and t.stdin is not None and t.stdout is not None

        def publish_and_read() -> list[str]:
            assert p.stdin is not None and p.stdout is not None and t.stdin is not None and t.stdout is not None
            p.stdin.write("\n")
            p.stdin.flush()
            got = json.loads(p.stdout.readline())
            t.stdin.write(json.dumps(got["result"]) + "\n")
            t.stdin.flush()
            assert json.loads(t.stdout.readline()) == {"ok": True}
            return list(got["servers"])

        (server,) = publish_and_read()
        os.kill(int(server), signal.SIGINT)
        # Until the signal is no longer pending: handled, or ignored at once.
        deadline = time.monotonic() + 10
        while True:
            try:
                with open(f"/proc/{server}/status") as f:
                    status = dict(line.split(":", 1) for line in f if ":" in line)
            except FileNotFoundError:
                break  # ended
            if not (int(status["SigPnd"], 16) | int(status["ShdPnd"], 16)) & (1 << (signal.SIGINT - 1)):
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.001)
        assert publish_and_read() == [server], "the NIXL server ended at the Ctrl+C (a new one was started)"
    finally:
        p.kill()
        t.kill()


FRESH = COMMON + r"""
import gc, json, sys
import numpy as np
import capture_arena as ca
from capture_arena import _pool
store = ca.ArenaFeatureStore()
results = [json.loads(line) for line in sys.stdin if '"features"' in line]
for _ in range(3):
    for r in results:
        i = int(r["sample_id"][1:])
        L, aux, last = tensors(i)
        got = store.get(r)
        assert np.array_equal(got["hidden_state"].view(np.uint16), aux.reshape(1, L, -1).view(np.uint16)), i
        assert got["input_ids"].tolist() == [list(range(L))], i
        t = store.get(r, ["target"], torch=True)["target"]
        assert t.view(__import__("torch").int16).numpy().tobytes() == last.tobytes(), i
        del got, t
gc.collect()
stats = _pool.POOL.stats()
for r in results:
    store.release(r)
store.flush(10)
print(json.dumps(stats), flush=True)
"""


def test_fresh_outputs_come_from_a_pool_registered_once_and_return_to_it() -> None:
    """``get()`` without ``out=`` over NIXL: the arrays live in the output pool's slabs, which NIXL
    registers once, not for every read; an array's range returns to the pool when it is
    collected."""
    pytest.importorskip("torch", reason="torch is not installed (scripts/test.sh installs it)")
    env = env_for("tcp")
    p = subprocess.Popen([sys.executable, "-c", PRODUCER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        lines = "".join(p.stdout.readline() for _ in range(6))
        out = subprocess.run([sys.executable, "-c", FRESH], env=env, input=lines, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        s = json.loads(out.stdout.splitlines()[-1])
        assert s["slabs"] == 1 and s["registrations"] == 1, s
        assert s["free_bytes"] == s["bytes"], s  # every array collected: every range back
        assert p.wait(timeout=60) == 0
    finally:
        p.kill()


HOLDER = COMMON + r"""
import json, os, sys
import capture_arena as ca
sink = ca.ArenaSink(arena_bytes="4MiB", transport="nixl", wait_s=20)
for i in range(3):
    L, aux, last = tensors(i)
    (r,) = sink.put_samples([(spec(i, L), aux, last)])
    print(json.dumps(r), flush=True)
me = os.getpid()
servers = []
for t in os.listdir(f"/proc/{me}/task"):
    servers += open(f"/proc/{me}/task/{t}/children").read().split()
print(json.dumps({"servers": servers}), flush=True)
sys.stdin.read()
sink.close()
"""

THREADS = COMMON + r"""
import json, os, sys, threading, time
TIMEOUT_S = float(os.environ["SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S"])
import numpy as np
import capture_arena as ca
stuck_result = json.loads(sys.argv[1])
results = [json.loads(line) for line in sys.stdin if '"features"' in line]
store = ca.ArenaFeatureStore()
for r in results + [stuck_result]:  # both producers' sessions opened before one stops
    store.get(r)
print("ready", flush=True)
while open(f"/proc/{sys.argv[2]}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
    time.sleep(0.01)  # the other producer's NIXL server is stopped
out = {"reads": 0, "reads_while_hung": 0, "errors": []}
lock = threading.Lock()
hung = threading.Event()  # the stuck read is called (it blocks in the native read, GIL released)
done = threading.Event()
span = {}
def stuck():
    span["t0"] = time.monotonic()
    hung.set()
    try:
        store.get(stuck_result)
        out["stuck"] = "read"
    except ca.StaleSessionError as e:
        out["stuck"] = f"stale after {time.monotonic() - span['t0']:.1f} s"
        out["stuck_error"] = str(e)
        from capture_arena._engine import QUARANTINE
        out["held"] = len(QUARANTINE)  # its outputs, which a NIC may still write over RDMA
    span["t1"] = time.monotonic()
    done.set()
def reader(k):
    hung.wait()
    while not done.is_set():
        for r in results:
            i = int(r["sample_id"][1:])
            L, aux, last = tensors(i)
            try:
                got = store.get(r)
            except Exception as e:
                with lock:
                    out["errors"].append(f"{type(e).__name__}: {e}"[:300])
                return
            t = time.monotonic()
            assert np.array_equal(got["hidden_state"].view(np.uint16), aux.reshape(1, L, -1).view(np.uint16)), i
            assert got["input_ids"].tolist() == [list(range(L))], i
            with lock:
                out["reads"] += 1
                # Completed in the second half of the hung read's wait (it surely waits by then,
                # and a read queued behind it could only complete after it failed).
                if t > span["t0"] + TIMEOUT_S / 2 and not done.is_set():
                    out["reads_while_hung"] += 1
s = threading.Thread(target=stuck)
s.start()
threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
for t in threads:
    t.start()
for t in threads + [s]:
    t.join()
print(json.dumps(out), flush=True)
"""


def test_reads_from_one_host_run_side_by_side_and_a_hung_one_holds_up_no_other() -> None:
    """Two producers on this host, the NIXL server of one stopped (SIGSTOP) with a read of it in
    flight: four threads of the same trainer process read the other producer all the while,
    every byte checked, and reads complete while the hung one waits (a reader agent per request
    in flight, up to four per host, so the hung request holds up only its own agent); the hung
    read fails as stale after the read timeout. Before, one request per host was in flight: the other reads waited the
    whole timeout behind it and then failed as stale too."""
    env = {**env_for("tcp"), "SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S": "3"}
    env.pop("SGLANG_SPEC_CAPTURE_NIXL_SERVER", None)
    live = subprocess.Popen([sys.executable, "-c", HOLDER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    stopped = subprocess.Popen([sys.executable, "-c", HOLDER], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    servers: list[str] = []
    try:
        assert live.stdout is not None and stopped.stdout is not None
        lines = "".join(live.stdout.readline() for _ in range(3))
        stuck_result = stopped.stdout.readline()
        for _ in range(2):
            stopped.stdout.readline()
        servers = json.loads(stopped.stdout.readline())["servers"]
        assert len(servers) == 1, servers
        t = subprocess.Popen([sys.executable, "-c", THREADS, stuck_result, servers[0]], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert t.stdin is not None and t.stdout is not None
        t.stdin.write(lines)
        t.stdin.close()
        assert t.stdout.readline().strip() == "ready"
        os.kill(int(servers[0]), signal.SIGSTOP)
        out = t.stdout.read()
        assert t.wait(timeout=120) == 0, out[-3000:]
        got = json.loads(out.splitlines()[-1])
        assert got["errors"] == [], got
        assert got["stuck"].startswith("stale after"), got
        # The error names what to change.
        assert "SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S" in got["stuck_error"], got
        # Its outputs (a range of the pool the next read would get) are held, as a timed-out
        # Mooncake read's are (before: back in the pool at once; found by an outside reading).
        assert got["held"] == 1, got["stuck_error"]
        # Reads kept completing while the hung one waited: it held up only its own agent.
        assert got["reads_while_hung"] >= 4, got
    finally:
        for s in servers:
            os.kill(int(s), signal.SIGCONT)
        for p in (live, stopped):
            p.kill()
