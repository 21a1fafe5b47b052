"""A process whose first capture failed still exits normally: no SIGABRT, and the failure was
reported (a result row, an exception, or the logged "N of M captured samples failed").

Each failure path of a first capture runs in fresh processes, several times each: the aborts
this guards against are races between the interpreter's exit and a thread that is inside the
module's native code (GIL released) at that moment:

- the thread comes back to a finalizing interpreter, which ends it with ``pthread_exit``; the
  forced unwind reaches PyO3's ``catch_unwind`` and glibc aborts: "FATAL: exception not
  rethrown";
- the thread is still inside NIXL while ``exit()`` runs the libraries' static destructors:
  "pure virtual method called / terminate called without an active exception" (NIXL's TOML
  configuration node, read while the UCX plugin loads, was destroyed under it).

Before the exit hook waited for the starter thread, the ``nowait``/``again`` paths below (a
batch left to the daemon ``capture-arena-start`` thread) aborted in 5-95 % of the runs (it
depends on timing), or never reported the failure. The ``daemon`` paths (a caller's daemon thread capturing when the
process exits) abort in most runs until no call of the module is left in native code at exit.

``MooncakeDistributedStore.setup`` holds the GIL while it retries an unreachable master (about
4.4 s a try, 20 tries by default: the whole process stands still); the store placement tries a
plain connection first and fails the batch at once, so only the direct case waits here
(``MC_STORE_CLIENT_SETUP_RETRIES=1``: one try). All processes run concurrently: the whole file
takes about 35 s on 2 cores (40 processes); each path runs at least twice where it once raced
in a fraction of the runs.
``CAPTURE_ARENA_EXIT_RUNS=<factor>`` multiplies the runs for a longer hunt.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Optional

import pytest

import capture_arena as ca

from mooncake_master import MISSING as MOONCAKE_MISSING
from mooncake_master import MOONCAKE_ENGINE

SCALE = float(os.environ.get("CAPTURE_ARENA_EXIT_RUNS", "1") or 1)

# The process under test. argv[1]: how the first capture is made, then the process exits
# normally (it never calls close(): interpreter exit does).
#   wait    put_samples, prints the row (the failure)
#   nowait  submit_samples, exits without waiting for the future
#   again   put_samples (failed), then submit_samples of a second batch, not waited for
#   eager   capture_arena.sglang.maybe_init_sink with SGLANG_SPEC_CAPTURE_ARENA_EAGER=1 (the
#           arena is started in the background), exits at once
#   daemon  a daemon thread of the caller's captures in a loop; the main thread exits once the
#           first capture has failed
#   direct  mooncake.store.MooncakeDistributedStore().setup(...) failing, nothing else
# EXIT_TEST_HOLD_PORT=1: the control port is one this process holds already.
CHILD = r"""
import os, socket, sys, threading, time
import numpy as np
import ml_dtypes

how = sys.argv[1]
if os.environ.get("EXIT_TEST_HOLD_PORT"):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    os.environ["SGLANG_SPEC_CAPTURE_CONTROL_PORT"] = str(held.getsockname()[1])

def report(what):
    print("REPORTED:", what, flush=True)

def raised(what):  # a call that must not raise did: the test fails on this line
    print("RAISED:", what, flush=True)

if how == "direct":
    import mooncake.store
    store = mooncake.store.MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", os.environ["MOONCAKE_MASTER_SERVER_ADDR"])
    report(f"MooncakeDistributedStore.setup returned {rc}")
    print("EXITING", flush=True)
    sys.exit(0)

import capture_arena as ca

def batch(i):
    rng = np.random.default_rng(i)
    L = 8
    spec = {"store_id": "ex", "sample_id": f"s{i}", "gen": 1, "replace": True,
            "features": {"aux": "hidden_state", "last_hidden": "target"},
            "passthrough": [{"name": "input_ids", "data": list(range(L)), "shape": [1, L], "dtype": "int64"}]}
    aux = rng.standard_normal((L, 64), dtype=np.float32).astype(ml_dtypes.bfloat16)
    last = rng.standard_normal((L, 32), dtype=np.float32).astype(ml_dtypes.bfloat16)
    return [(spec, aux, last)]

try:
    if how == "eager":
        from types import SimpleNamespace
        from capture_arena import sglang
        sink = sglang.maybe_init_sink(SimpleNamespace(enable_spec_capture=True, spec_capture_aux_layer_ids=None))
    else:
        sink = ca.new_sink()
except Exception as e:
    raised(f"creating the sink raised {type(e).__name__}: {e}")
    print("EXITING", flush=True)
    sys.exit(0)

try:
    if how == "daemon":
        first = threading.Event()
        def capture():
            i = 0
            while True:
                try:
                    sink.put_samples(batch(i))
                except Exception as e:
                    raised(f"put_samples raised {type(e).__name__}: {e}")
                first.set()
                i += 1
        threading.Thread(target=capture, daemon=True).start()
        first.wait(60)  # the first capture failed (and was logged); the thread is at the next one
        time.sleep(0.05)
    elif how == "nowait":
        sink.submit_samples(batch(0))
    elif how in ("wait", "again"):
        rows = sink.put_samples(batch(0))
        report(rows[0].get("error", f"no error: {rows[0]!r:.200}"))
        if how == "again":
            sink.submit_samples(batch(1))
except Exception as e:
    raised(f"capturing raised {type(e).__name__}: {e}")
print("EXITING", flush=True)
"""


@dataclass(frozen=True)
class Case:
    """One failure path: its environment, how the capture is made, how many runs, and the text
    that shows the failure was reported."""

    name: str
    how: str
    runs: int
    expect: str
    env: dict[str, str] = field(default_factory=dict)
    needs: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.name}-{self.how}"


STORE = {"MOONCAKE_PROTOCOL": "tcp", "MOONCAKE_MASTER_SERVER_ADDR": "127.0.0.1:1"}
ENGINE = {"SGLANG_SPEC_CAPTURE_PLACEMENT": "engine", "MOONCAKE_PROTOCOL": "tcp", "SGLANG_SPEC_CAPTURE_ARENA_BYTES": "8MiB"}
ARENA = {"SGLANG_SPEC_CAPTURE_PLACEMENT": "arena", "SGLANG_SPEC_CAPTURE_ARENA_BYTES": "8MiB"}
HOLD = {"EXIT_TEST_HOLD_PORT": "1"}
NO_NIXL_LIB = {**ARENA, "SGLANG_SPEC_CAPTURE_TRANSPORT": "nixl", "SGLANG_SPEC_CAPTURE_NIXL_LIB": "/nonexistent/libnixl_capi.so"}
# The real NIXL library, whose UCX backend then fails: the agent exists, its backend does not.
NIXL_UCX_FAILS = {**ARENA, "SGLANG_SPEC_CAPTURE_TRANSPORT": "nixl", "UCX_TLS": "no-such-transport"}
BOUND = "binding the control endpoint"

CASES = [
    # (a) the store placement, no mooncake_master there
    Case("store-no-master", "wait", 2, "the Mooncake store is not reachable", STORE, ("mooncake",)),
    Case("store-no-master", "nowait", 2, "the Mooncake store is not reachable", STORE, ("mooncake",)),
    Case("store-no-master", "again", 1, "the Mooncake store is not reachable", STORE, ("mooncake",)),
    Case("store-client-direct", "direct", 1, "MooncakeDistributedStore.setup returned", STORE, ("mooncake",)),
    # (b) the engine placement: TransferEngine.initialize fails; or it works and the control bind fails
    Case("engine-no-metadata", "wait", 1, "TransferEngine.initialize", {**ENGINE, "MOONCAKE_TE_METADATA_SERVER": "http://127.0.0.1:1/metadata"}, ("mooncake",)),
    Case("engine-no-metadata", "nowait", 2, "TransferEngine.initialize", {**ENGINE, "MOONCAKE_TE_METADATA_SERVER": "http://127.0.0.1:1/metadata"}, ("mooncake",)),
    Case("engine-no-metadata", "again", 2, "TransferEngine.initialize", {**ENGINE, "MOONCAKE_TE_METADATA_SERVER": "http://127.0.0.1:1/metadata"}, ("mooncake",)),
    Case("engine-port-held", "again", 2, BOUND, {**ENGINE, **HOLD}, ("mooncake",)),
    # (c) capture-arena's own arena: no size; the control port taken
    Case("arena-no-size", "wait", 1, "SGLANG_SPEC_CAPTURE_ARENA_BYTES", {"SGLANG_SPEC_CAPTURE_PLACEMENT": "arena"}),
    Case("arena-no-size", "nowait", 1, "SGLANG_SPEC_CAPTURE_ARENA_BYTES", {"SGLANG_SPEC_CAPTURE_PLACEMENT": "arena"}),
    Case("arena-port-held", "wait", 1, BOUND, {**ARENA, **HOLD}),
    Case("arena-port-held", "nowait", 3, BOUND, {**ARENA, **HOLD}),
    Case("arena-port-held", "again", 3, BOUND, {**ARENA, **HOLD}),
    Case("arena-port-held", "eager", 2, BOUND, {**ARENA, **HOLD, "SGLANG_SPEC_CAPTURE_ARENA_EAGER": "1"}),
    # (d) NIXL: the library missing; the library there and its UCX backend failing
    Case("nixl-lib-missing", "wait", 1, "loading the NIXL library", NO_NIXL_LIB, ("nixl",)),
    Case("nixl-lib-missing", "nowait", 2, "loading the NIXL library", NO_NIXL_LIB, ("nixl",)),
    Case("nixl-lib-missing", "again", 2, "loading the NIXL library", NO_NIXL_LIB, ("nixl",)),
    Case("nixl-ucx-fails", "nowait", 3, "NIXL agent", NIXL_UCX_FAILS, ("nixl", "nixl-lib")),
    Case("nixl-ucx-fails", "again", 3, "NIXL agent", NIXL_UCX_FAILS, ("nixl", "nixl-lib")),
    # A caller's daemon thread capturing (each capture retries the start) when the process exits.
    Case("arena-port-held", "daemon", 2, BOUND, {**ARENA, **HOLD}),
    Case("nixl-ucx-fails", "daemon", 3, "NIXL agent", NIXL_UCX_FAILS, ("nixl", "nixl-lib")),
]

NIXL_LIB = os.environ.get("SGLANG_SPEC_CAPTURE_NIXL_LIB", "")  # set by scripts/test.sh, or found on import


def _missing(case: Case) -> Optional[str]:
    """Why this case cannot run here, or None."""
    if "mooncake" in case.needs and MOONCAKE_ENGINE is None:
        return MOONCAKE_MISSING
    if "nixl" in case.needs and "nixl" not in ca.FEATURES:
        return "this build of capture_arena has no nixl feature (scripts/test.sh builds it)"
    if "nixl-lib" in case.needs and not NIXL_LIB:
        return "no NIXL library here (SGLANG_SPEC_CAPTURE_NIXL_LIB; scripts/test.sh sets it)"
    return None


def _env(case: Case) -> dict[str, str]:
    """This process's environment without any capture or Mooncake setting, then the case's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_SPEC_CAPTURE_", "MOONCAKE_", "MC_", "UCX_TLS"))}
    env.update(
        GLOG_minloglevel="2",
        MC_STORE_CLIENT_SETUP_RETRIES="1",  # one 4.4 s attempt instead of 20
        PYTHONFAULTHANDLER="1",  # an abort prints every thread's Python stack
    )
    if "nixl-lib" in case.needs:
        env["SGLANG_SPEC_CAPTURE_NIXL_LIB"] = NIXL_LIB
    env.update(case.env)
    return env


@dataclass
class Run:
    returncode: Optional[int]  # None: timed out
    output: str


def _run(case: Case) -> Run:
    try:
        p = subprocess.run(
            [sys.executable, "-c", CHILD, case.how], env=_env(case), capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired as e:
        parts = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr)]
        return Run(None, "".join(parts))
    return Run(p.returncode, p.stdout + p.stderr)


def _runs(case: Case) -> int:
    return max(1, round(case.runs * SCALE))


@pytest.fixture(scope="module")
def results(request: pytest.FixtureRequest) -> Iterator[dict[str, list[Run]]]:
    """Every selected case's runs, all at once (the store's runs first: they mostly wait)."""
    selected = {
        item.callspec.params["case"].id  # type: ignore[attr-defined]
        for item in request.session.items
        if getattr(item, "module", None) is sys.modules[__name__] and "case" in getattr(getattr(item, "callspec", None), "params", {})
    }
    todo = [c for c in CASES if c.id in selected and _missing(c) is None]
    todo.sort(key=lambda c: not c.name.startswith("store"))
    out: dict[str, list[Run]] = {c.id: [] for c in todo}
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        jobs = [(c, pool.submit(_run, c)) for c in todo for _ in range(_runs(c))]
        for c, job in jobs:
            out[c.id].append(job.result())
    yield out


def _status(rc: Optional[int]) -> str:
    if rc is None:
        return "timeout"
    if rc < 0:
        return signal.Signals(-rc).name
    return str(rc)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_exit_after_failed_first_capture(case: Case, results: dict[str, list[Run]]) -> None:
    why = _missing(case)
    if why is not None:
        pytest.skip(why)
    runs = results[case.id]
    statuses = [_status(r.returncode) for r in runs]
    bad = [r for r in runs if r.returncode != 0]
    assert not bad, (
        f"{len(bad)} of {len(runs)} runs did not exit normally (exit statuses: {statuses}); "
        f"the first one's output ends:\n{bad[0].output[-3000:]}"
    )
    # Nothing a capture or a sink's creation does may raise: each failure is the sample's row
    # (or the log's line), never an exception in the caller.
    threw = [r for r in runs if "RAISED:" in r.output]
    assert not threw, f"{len(threw)} of {len(runs)} runs raised; the first one's output:\n{threw[0].output[-3000:]}"
    unreported = [r for r in runs if case.expect not in r.output or "EXITING" not in r.output]
    assert not unreported, (
        f"{len(unreported)} of {len(runs)} runs did not report the failure ({case.expect!r}) or did not get to "
        f"the end; the first one's output:\n{unreported[0].output[-3000:]}"
    )
