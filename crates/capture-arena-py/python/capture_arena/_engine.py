"""The engine placement: the arena inside a Mooncake TransferEngine, and reads through one.

Producer side (:class:`EngineArena`): the sink creates a ``TransferEngine`` from the ``MOONCAKE_*``
variables (``MOONCAKE_LOCAL_HOSTNAME``, ``MOONCAKE_PROTOCOL``, ``MOONCAKE_RDMA_DEVICES``; the
handshake is ``P2PHANDSHAKE`` unless ``MOONCAKE_TE_METADATA_SERVER`` names a metadata server) on
its first capture, and
takes the arena from it: under ``nvlink``/``nvlink_intra`` device memory from
``allocate_managed_buffer`` on the writer's GPU, under other protocols a host buffer registered
with the engine. The writer publishes into that memory; results carry the engine's session
(``<host>:<rpc_port>``) and addresses that are the engine's virtual addresses, which is exactly
what ``TransferEngine.transfer_sync_read(session, local, address, length)`` takes. A trainer that
knows only Mooncake reads them that way and frees over ``arena.control``.

Trainer side (:class:`EngineReader`): :class:`capture_arena.ArenaFeatureStore` reads results of
such sessions with its own engine, into the output arrays (registered with the engine for the
read), one batched read per sample (one read per object under multi-node NVLink, where Mooncake
documents batch transfers as unreliable).
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import os
import platform
import threading
import time
import weakref
from typing import Any, Callable, Optional, Sequence

import numpy as np

from . import _logs
from . import _pool
from .errors import (
    ArenaOSError,
    ConfigError,
    InvalidReadError,
    NotReadyError,
    ObjectChangedError,
    ReleasedError,
    StaleSessionError,
    WriteFailedError,
)

INSTALL_HINT = (
    "pip install mooncake-transfer-engine (CUDA 12), mooncake-transfer-engine-cuda13 (CUDA 13) "
    "or mooncake-transfer-engine-non-cuda (hosts without a GPU), and the libraries it loads "
    "(Debian: apt-get install libibverbs1 libnl-3-200 libnl-route-3-200 libnuma1 libcurl4)"
)


def _mooncake() -> Any:
    """``mooncake.engine``, or a ConfigError that says how to install it."""
    try:
        me = importlib.import_module("mooncake.engine")
    except ImportError as e:
        raise ConfigError(
            f"the engine placement needs Mooncake's TransferEngine, which is not importable ({e}): "
            f"{INSTALL_HINT}; or set SGLANG_SPEC_CAPTURE_PLACEMENT=arena for capture-arena's own arena"
        ) from None
    return me


def protocol_of(protocol: Optional[str]) -> str:
    """The engine's protocol: ``MOONCAKE_PROTOCOL`` lower-cased, ``tcp`` when unset."""
    p = (protocol or "").strip().lower()
    return p or "tcp"


def is_nvlink(protocol: str) -> bool:
    return protocol in ("nvlink", "nvlink_intra")


def missing_transport(protocol: str, machine: str) -> str:
    """Why an NVLink ``protocol`` is missing from this Mooncake build and what to do, for this
    ``machine`` (``platform.machine()``). Mooncake's CUDA wheels differ by architecture: the
    x86_64 ones (CUDA 12 and -cuda13) are built with intra-node NVLink and without multi-node
    NVLink, the aarch64 ones (GB200/GB300 trays) with multi-node NVLink only; the -non-cuda
    wheels with neither."""
    arm = machine.lower() in ("aarch64", "arm64")
    own = (
        "or set SGLANG_SPEC_CAPTURE_PLACEMENT=arena for capture-arena's own device arena (cuda:// "
        "sessions, read with capture_arena)"
    )
    if protocol == "nvlink":
        if arm:
            why = (
                "this is not one of Mooncake's aarch64 CUDA wheels, which have it: install "
                "mooncake-transfer-engine (CUDA 12) or mooncake-transfer-engine-cuda13 (CUDA 13), "
                "not -non-cuda"
            )
        else:
            why = (
                "the x86_64 wheels are built without it. On one node use MOONCAKE_PROTOCOL=nvlink_intra "
                "(with Mooncake's CUDA wheel), or build Mooncake with -DUSE_MNNVL=ON"
            )
        return (
            "MOONCAKE_PROTOCOL=nvlink needs a Mooncake build with multi-node NVLink "
            f"(mooncake.engine.SUPPORT_MNNVL is False here: {why}); {own}"
        )
    if arm:
        why = (
            "Mooncake's aarch64 CUDA wheels are built with multi-node NVLink only. Use "
            "MOONCAKE_PROTOCOL=nvlink (fabric handles, which need an IMEX channel on this node too), or build "
            "Mooncake with -DUSE_INTRA_NVLINK=ON"
        )
    else:
        why = "install mooncake-transfer-engine (CUDA 12) or mooncake-transfer-engine-cuda13 (CUDA 13), not -non-cuda"
    return (
        "MOONCAKE_PROTOCOL=nvlink_intra needs a Mooncake build with intra-node NVLink "
        f"(mooncake.engine.SUPPORT_INTRA_NVLINK is False here: {why}); {own}"
    )


def has_rdma_device() -> bool:
    """True when this host shows an RDMA device (``/sys/class/infiniband``), as Mooncake's
    topology discovery would find one."""
    try:
        return any(True for _ in os.scandir("/sys/class/infiniband"))
    except OSError:
        return False


def transport_of(protocol: str, rdma_device: bool) -> str:
    """Which transport Mooncake's engine installs for ``protocol`` here, from the environment as
    new_engine leaves it (Mooncake chooses from the environment and the host's devices, not from
    the protocol string): what the placement logs."""
    env = os.environ
    if env.get("MC_FORCE_TCP") is not None:
        return f"TCP (MOONCAKE_PROTOCOL={protocol}, MC_FORCE_TCP={env['MC_FORCE_TCP']!r})"
    if protocol == "nvlink_intra" and env.get("MC_INTRANODE_NVLINK") is not None:
        return "intra-node NVLink (MC_INTRANODE_NVLINK)"
    if protocol == "nvlink" and env.get("MC_FORCE_MNNVL") is not None:
        return "multi-node NVLink (MC_FORCE_MNNVL)"
    if rdma_device or env.get("MC_FORCE_HCA") is not None:
        return f"RDMA (MOONCAKE_PROTOCOL={protocol}; this host has RDMA devices)"
    return f"TCP (MOONCAKE_PROTOCOL={protocol}, but this host has no RDMA device: Mooncake falls back to TCP)"


#: Mooncake's Python allocator (``allocate_managed_buffer``) serves buffers of up to this many
#: bytes from slabs of a 2 GiB buffer it allocates and registers whole (``kDefaultBufferCapacity``,
#: ``kSlabSizeKB`` in transfer_engine_py.h); a larger buffer gets an allocation of exactly its size.
MOONCAKE_MAX_SLAB = 256 << 20


def managed_bytes(nbytes: int) -> int:
    """The size to ask ``allocate_managed_buffer`` for an arena of ``nbytes``: at least one page
    over Mooncake's largest slab, so that a small arena costs 256 MiB of device memory, not the
    2 GiB pool Mooncake would reserve for it; the arena then uses all of it."""
    return max(int(nbytes), MOONCAKE_MAX_SLAB + 4096)


def new_engine(protocol: str) -> tuple[Any, str]:
    """A TransferEngine initialised from the ``MOONCAKE_*`` variables, and its session name.

    Refuses, before Mooncake is touched, an NVLink protocol that this Mooncake build lacks
    (``SUPPORT_MNNVL`` / ``SUPPORT_INTRA_NVLINK``): the x86_64 wheels have no multi-node NVLink.
    """
    me = _mooncake()
    if protocol == "nvlink":
        if not getattr(me, "SUPPORT_MNNVL", False):
            raise ConfigError(missing_transport(protocol, platform.machine()))
        # The protocol string selects only Mooncake's allocator; its transport comes from the
        # environment, and on a host with RDMA NICs (every GB200 tray) it would be RDMA unless
        # multi-node NVLink is forced (Mooncake tests only that the variable is set). Set in
        # producer and readers alike; a value the user set stands.
        os.environ.setdefault("MC_FORCE_MNNVL", "true")
    if protocol == "nvlink_intra":
        if not getattr(me, "SUPPORT_INTRA_NVLINK", False):
            raise ConfigError(missing_transport(protocol, platform.machine()))
        # Mooncake picks its transport from the environment: this selects intra-node NVLink.
        os.environ.setdefault("MC_INTRANODE_NVLINK", "true")
    if protocol == "tcp":
        # Mooncake installs RDMA on any host with an RDMA device unless MC_FORCE_TCP is set (any
        # value): "tcp" means TCP (MC_FORCE_TCP set by the user stands).
        os.environ.setdefault("MC_FORCE_TCP", "1")
    _logs.get("capture_arena").info("TransferEngine: %s", transport_of(protocol, has_rdma_device()))
    host = os.environ.get("MOONCAKE_LOCAL_HOSTNAME", "").strip() or "127.0.0.1"
    # P2PHANDSHAKE names each engine `<host>:<rpc_port>`, which is the session results carry.
    # MOONCAKE_METADATA_SERVER (the store's) is not used: with it every engine on a host
    # registers under the bare host name, and a second one fails to initialise (-1, measured with
    # 0.3.13.post1). MOONCAKE_TE_METADATA_SERVER selects a metadata server for the engine anyway.
    metadata = os.environ.get("MOONCAKE_TE_METADATA_SERVER", "").strip() or "P2PHANDSHAKE"
    devices = os.environ.get("MOONCAKE_RDMA_DEVICES", "").strip()
    te = me.TransferEngine()
    rc = te.initialize(host, metadata, protocol, devices)
    if rc != 0:
        raise ArenaOSError(
            f"TransferEngine.initialize({host!r}, {metadata!r}, {protocol!r}, {devices!r}) returned {rc}; "
            "check MOONCAKE_LOCAL_HOSTNAME, MOONCAKE_TE_METADATA_SERVER and MOONCAKE_RDMA_DEVICES"
        )
    return te, f"{host}:{te.get_rpc_port()}"


class _on_device:
    """``torch.cuda.device(d)`` when torch is there (the previous device restored on exit)."""

    def __init__(self, device: Any) -> None:
        self._ctx: Any = None
        try:
            self._ctx = importlib.import_module("torch").cuda.device(device)
        except ImportError:
            pass

    def __enter__(self) -> None:
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


class EngineArena:
    """The arena's memory, taken from a TransferEngine and kept alive (with the engine) until the
    writer drops it."""

    def __init__(self, nbytes: int, protocol: str, device: Optional[int]) -> None:
        self.engine, self.session = new_engine(protocol)
        self.nbytes = int(nbytes)
        self.device: Optional[int] = None
        self.ptr = 0
        # What __del__ gives back: set only once it is really held.
        self._host: Optional[np.ndarray[Any, Any]] = None
        self._managed = 0
        if is_nvlink(protocol):
            # Device memory on the writer's GPU (fabric under nvlink, cudaMalloc + IPC under
            # nvlink_intra): allocated by the engine, so it is exported to its readers. The
            # caller's current device is left as it was.
            self.device = 0 if device is None else int(device)
            wanted = self.nbytes
            self.nbytes = managed_bytes(wanted)
            if self.nbytes != wanted:
                _logs.get("capture_arena").info(
                    "engine arena: %d bytes asked for, %d allocated (Mooncake serves buffers of up to "
                    "256 MiB from a 2 GiB pool it reserves whole; a larger one gets exactly its size)",
                    wanted,
                    self.nbytes,
                )
            with _on_device(self.device):
                ptr = int(self.engine.allocate_managed_buffer(self.nbytes))
            if ptr == 0:
                raise ArenaOSError(
                    f"TransferEngine.allocate_managed_buffer({self.nbytes}) failed on GPU {self.device} "
                    "(out of device memory? lower SGLANG_SPEC_CAPTURE_ARENA_BYTES)"
                )
            self.ptr = self._managed = ptr
        else:
            buf = np.empty(self.nbytes, dtype=np.uint8)
            buf[:: 1 << 12] = 0  # fault every page in now, not during the first copies
            rc = self.engine.register_memory(int(buf.ctypes.data), self.nbytes)
            if rc != 0:
                raise ArenaOSError(f"TransferEngine.register_memory of the {self.nbytes}-byte arena returned {rc}")
            self._host = buf
            self.ptr = int(buf.ctypes.data)

    def __del__(self) -> None:
        try:
            if self._host is not None:
                self.engine.unregister_memory(int(self._host.ctypes.data))
            elif self._managed:
                self.engine.free_managed_buffer(self._managed, self.nbytes)
        except Exception:  # interpreter shutdown: the process frees it all
            pass


def read_timeout_s() -> float:
    """``SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S`` (default 60): how long one read may take."""
    raw = os.environ.get("SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S", "").strip()
    try:
        v = float(raw) if raw else 60.0
    except ValueError:
        v = -1.0
    if not (0.0 < v <= 86400.0):
        raise ConfigError(f"SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S={raw!r} is not a number of seconds > 0; default 60")
    return v


def unreachable_backoff_s() -> float:
    """``SGLANG_SPEC_CAPTURE_UNREACHABLE_BACKOFF_S`` (default 10; 0: off): how long reads from
    a producer fail at once after one timed out (at its deadline, or Mooncake's own)."""
    return _seconds_in_a_day("SGLANG_SPEC_CAPTURE_UNREACHABLE_BACKOFF_S", 10.0)


def _seconds_in_a_day(name: str, default: float) -> float:
    """Seconds in [0, 86400] from the variable ``name`` (``default`` unset), or ConfigError."""
    raw = os.environ.get(name, "").strip()
    try:
        v = float(raw) if raw else default
    except ValueError:
        v = -1.0
    if not (0.0 <= v <= 86400.0):
        raise ConfigError(f"{name}={raw!r} is not a number of seconds in [0, 86400]; default {default:g}")
    return v


#: The most producers a reader remembers as unreachable at once (the oldest forgotten first).
MAX_UNREACHABLE = 4096


def _check_words(checks: Sequence[tuple[str, int, int]], found: Sequence[int]) -> Optional[str]:
    """The readiness rule (docs/protocol.md) for ``(key, address, stamp)`` checks against the
    words read: the key of an object still being written, or None when all are there; raises
    for a freed, replaced or never written one."""
    pending = None
    for (key, _, stamp), word in zip(checks, found):
        if word == stamp:
            continue
        if word == stamp | PENDING_BIT:
            pending = pending or key
        elif word == stamp | FAILED_BIT:
            raise WriteFailedError(
                f"{key} was never written: the producer's copy of it failed after its result was handed out (its log "
                "says why), and its space is free again"
            )
        elif word == 0:
            raise ReleasedError(
                f"{key} was freed before or while it was read (another reader released it, it was aborted, "
                "or its lease ended): nothing read is returned"
            )
        else:
            raise ObjectChangedError(
                f"{key} was freed and its space holds another object now (stamp {word}, the result's "
                f"{stamp}): nothing read is returned"
            )
    return pending


def ready_wait_s() -> float:
    """``SGLANG_SPEC_CAPTURE_READY_WAIT_S`` (default 30): how long a read waits for objects whose
    bytes are still being written (the readiness rule of docs/protocol.md)."""
    return _seconds_in_a_day("SGLANG_SPEC_CAPTURE_READY_WAIT_S", 30.0)


#: The stamp word's marks (docs/protocol.md): still being written, never written.
PENDING_BIT = 1 << 63
FAILED_BIT = 1 << 62


# How long the outputs of a failed or abandoned read are kept from being freed: Mooncake's own
# timeout gives up on a transfer without cancelling it, so bytes may still land for a while.
QUARANTINE_S = 120.0
# Mooncake's sync reads give up after MC_TRANSFER_TIMEOUT (30 s by default, at least 5 s):
# a read that failed sooner failed outright (nothing left in flight).
MOONCAKE_MIN_TIMEOUT_S = 5.0


class _Quarantine:
    """Outputs a transfer may still write into, held until they are safe to free: for
    ``seconds``, then let go by a timer (not only by the next hold: the last failed read's
    outputs, gigabytes maybe, were otherwise kept for the process's life)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[tuple[float, Any]] = []
        #: When the one pending timer fires (None: none pending).
        self._timer_at: Optional[float] = None

    def hold(self, what: Any, seconds: float = QUARANTINE_S) -> None:
        now = time.monotonic()
        with self._lock:
            self._held.append((now + seconds, what))
        self.expire()

    def expire(self) -> None:
        """Lets go of what was held long enough (outside the lock: an output's destructor may
        run), and has one timer pending for the next to go, whatever the number held."""
        now = time.monotonic()
        with self._lock:
            gone = [h for h in self._held if h[0] <= now]
            self._held = [h for h in self._held if h[0] > now]
            nxt = min((h[0] for h in self._held), default=None)
            if nxt is not None and (self._timer_at is None or self._timer_at <= now or nxt < self._timer_at):
                timer = threading.Timer(max(nxt - now, 0.0), self._fired)
                timer.daemon = True
                try:
                    timer.start()
                    self._timer_at = nxt
                except RuntimeError:  # no thread to be had (interpreter exit): the next hold expires them
                    pass
        del gone

    def _fired(self) -> None:
        """The pending timer's end (a timed wait may end a little early: the next one is set
        from here whatever the time)."""
        with self._lock:
            self._timer_at = None
        self.expire()

    def let_go(self, what: Any) -> None:
        """Lets go of ``what`` now: the read that wrote into it ended without a transfer begun."""
        with self._lock:
            gone = [h for h in self._held if h[1] is what]
            self._held = [h for h in self._held if h[1] is not what]
        del gone  # outside the lock: an output's destructor may run

    def __len__(self) -> int:
        self.expire()
        with self._lock:
            return len(self._held)


QUARANTINE = _Quarantine()


def run_bounded(
    name: str,
    work: Callable[[], None],
    keep: Any,
    timeout: float,
    timed_out: Callable[[], str],
    gone: Optional[threading.Event] = None,
    late: Optional[Callable[[], None]] = None,
    began: Optional[threading.Event] = None,
) -> None:
    """Runs ``work`` on a thread of its own (named ``name``) and waits at most ``timeout``
    seconds: what a Mooncake read does under the read deadline. ``keep`` owns the memory the
    work writes: held from being freed when the work may still write it (past the deadline, or
    failed after Mooncake's own timeout). Past the deadline ``gone`` is set (the work starts
    nothing more) and ``timed_out()`` (which sets aside what the work holds) says why, raised
    as :class:`StaleSessionError`; the work's own error is raised as it is. ``late()`` is
    called on the work's thread when work the caller gave up on ends after all (never before
    ``timed_out()`` has returned). ``began``, where given, is set by the work (after it saw
    ``gone`` clear, under the same lock) before its first transfer: work that ended without it
    (a connect that failed, or was given up on before any transfer) wrote nothing, and ``keep``
    is not held for it (before: 120 s after a slow failed connect, 180 s after a timeout)."""
    done = threading.Event()
    outcome: list[BaseException] = []
    t0 = time.monotonic()
    lock = threading.Lock()
    state = {"ended": False, "given_up": False}

    def run() -> None:
        try:
            work()
        except BaseException as e:  # handed to the caller
            outcome.append(e)
            if time.monotonic() - t0 >= MOONCAKE_MIN_TIMEOUT_S and (began is None or began.is_set()):
                # Mooncake's own timeout ended it: the transfer was not cancelled.
                QUARANTINE.hold(keep)
        finally:
            with lock:
                state["ended"] = True
                given_up = state["given_up"]
            done.set()
            if given_up and began is not None and not began.is_set():
                QUARANTINE.let_go(keep)  # given up on before any transfer began: none will
            if given_up:
                # Nobody reads it: its traceback (which holds this frame, and so the list) would
                # keep the work's objects, a Mooncake client among them, until a full collection.
                outcome.clear()
            if given_up and late is not None:
                try:
                    late()
                except Exception:  # what it tidies stays as it was: never an error of ours here
                    _logs.get("capture_arena").exception("after a read that ended past its deadline")

    try:
        threading.Thread(target=run, name=name, daemon=True).start()
    except RuntimeError as e:  # no thread to be had: nothing started, nothing written
        raise ArenaOSError(
            f"cannot start a thread for a read ({e}): this process is at its thread limit (ulimit -u, the cgroup's "
            "pids.max) or exiting; the read has a deadline only on a thread of its own"
        ) from None
    def give_up() -> Optional[str]:
        with lock:  # the work ends now or after: ``late`` then comes after ``timed_out``
            if state["ended"]:
                return None
            state["given_up"] = True
            if gone is not None:
                gone.set()
            QUARANTINE.hold(keep, QUARANTINE_S + timeout)
            return timed_out()

    try:
        in_time = done.wait(timeout)
    except BaseException:
        # Interrupted while waiting (KeyboardInterrupt, a signal handler's exception): the
        # work goes on without a caller, so it is given up as at the deadline (its client set
        # aside if it stays stuck, its outputs held), then the interruption goes on up.
        try:
            give_up()
        except Exception:
            _logs.get("capture_arena").exception("giving up a read that was interrupted")
        raise
    if not in_time:
        why = give_up()
        if why is not None:
            raise StaleSessionError(why)
        done.wait()  # it ended just as the deadline came: as if in time
    if outcome:
        raise outcome[0]


def max_stuck_clients() -> int:
    """``SGLANG_SPEC_CAPTURE_MAX_STUCK_CLIENTS`` (default 8): how many Mooncake clients
    (TransferEngines, store clients) of one reader may have reads stuck in them past their
    deadline at once (each holds threads and sockets); past it a read fails at once, until one of
    those reads returns."""
    raw = os.environ.get("SGLANG_SPEC_CAPTURE_MAX_STUCK_CLIENTS", "").strip()
    try:
        v = int(raw) if raw else 8
    except ValueError:
        v = 0
    if not 1 <= v <= 1024:
        raise ConfigError(f"SGLANG_SPEC_CAPTURE_MAX_STUCK_CLIENTS={raw!r} is not a whole number in [1, 1024]; default 8")
    return v


class _Clients:
    """The Mooncake client a reader uses (a TransferEngine or a store client), made on first
    use. One with a read that ran past its deadline is set aside (that read may hold its lock)
    and kept (Mooncake may still complete the transfer) until every such read of it has
    returned (Mooncake's own timeout, ``MC_TRANSFER_TIMEOUT``), then let go: destroyed, its
    threads and port with it (a store client's close holds the GIL about 0.7 s: Mooncake's,
    measured once per such client). Not used again: its connection to the peer that stalled stays
    broken (measured: a read through it after the network healed timed out). At most
    :func:`max_stuck_clients` are stuck at once; past that a read fails at once. So a long
    partition costs a client per read only while Mooncake holds them (before: one more for
    each read that timed out, for good)."""

    def __init__(self, make: Callable[[], Any], what: str) -> None:
        self._make = make
        self._what = what
        self._lock = threading.Lock()
        self._current: Optional[Any] = None
        #: Set-aside clients with reads stuck in them: id -> (client, reads).
        self._stuck: dict[int, tuple[Any, int]] = {}
        #: Set while one thread makes a client: the others wait for it rather than make more
        #: (a make that hangs, a metadata server that does not answer, would otherwise cost a
        #: thread and, once it answers, a client for every read tried meanwhile).
        self._making: Optional[threading.Event] = None

    def get(self, gone: Optional[threading.Event] = None) -> Any:
        """The client reads use now, made if there is none (one thread makes it; the others
        wait for that, each until ``gone`` is set: its read was given up on)."""
        while True:
            with self._lock:
                if self._current is not None:
                    return self._current
                cap = max_stuck_clients()
                if len(self._stuck) >= cap:
                    raise StaleSessionError(
                        f"{len(self._stuck)} {self._what}s of this process have reads stuck in them past their deadline (the "
                        "network to their peers is down, or Mooncake hangs): no new one is made until one of those reads "
                        f"returns (SGLANG_SPEC_CAPTURE_MAX_STUCK_CLIENTS={cap}); read again later, or raise "
                        "SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S towards Mooncake's own MC_TRANSFER_TIMEOUT (30 s)"
                    )
                making = self._making
                if making is None:
                    made_here = self._making = threading.Event()
            if making is None:
                break
            while not making.wait(0.05):  # another thread makes one
                if gone is not None and gone.is_set():
                    raise StaleSessionError(f"given up on while another thread made this process's {self._what}")
        try:
            made = self._make()  # outside the lock: it may connect over the network
        except BaseException:
            with self._lock:
                self._making = None
            made_here.set()  # a waiter makes one itself now
            raise
        with self._lock:
            # No other thread made one meanwhile: they waited for this make.
            self._making = None
            self._current = made
        made_here.set()
        return made

    def set_aside(self, client: Any) -> None:
        """A read in ``client`` ran past its deadline: later reads use another."""
        with self._lock:
            if self._current is client:
                self._current = None
            held, n = self._stuck.get(id(client), (client, 0))
            self._stuck[id(client)] = (held, n + 1)

    def returned(self, client: Any) -> bool:
        """One of its stuck reads has returned; whether that was the last, so that ``client``
        is let go (the caller drops its own references too)."""
        with self._lock:
            held, n = self._stuck.get(id(client), (client, 1))
            if n > 1:
                self._stuck[id(client)] = (held, n - 1)
                return False
            self._stuck.pop(id(client), None)
            return True

    def counts(self) -> tuple[int, int]:
        """How many clients there are, and how many of them have reads stuck in them."""
        with self._lock:
            return (self._current is not None) + len(self._stuck), len(self._stuck)

    def after_fork_in_child(self, leftovers: list[Any]) -> None:
        """The parent's clients go to ``leftovers`` (never destroyed: their destructors would
        act on the parent's connections and threads); the child starts afresh."""
        if self._current is not None:
            leftovers.append(self._current)
        leftovers.extend(c for c, _ in self._stuck.values())
        self._lock = threading.Lock()
        self._current, self._stuck, self._making = None, {}, None


class EngineReader:
    """Reads objects of TransferEngine sessions into caller arrays, with one engine per process
    (created on first use from the ``MOONCAKE_*`` variables; ``tcp`` when no protocol is set).

    Every read has a deadline (``SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S``, default 60 s): the engine
    works on a thread of its own (Mooncake connects and transfers for as long as the network
    says, and its sync calls poll a core meanwhile) and the caller waits at most that long. A
    read that fails or times out raises :class:`StaleSessionError`, as on every transport; its
    outputs are held from being freed for ``QUARANTINE_S`` when the transfer may still be in
    flight (Mooncake does not cancel a transfer it gave up on). After a timeout the engine, whose
    lock the stuck transfer may hold, is set aside and another reads from then on; once the
    stuck transfer returns (Mooncake's own timeout), the engine is destroyed (see
    :class:`_Clients`: at most ``SGLANG_SPEC_CAPTURE_MAX_STUCK_CLIENTS`` engines stuck at once).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._protocol = protocol_of(os.environ.get("MOONCAKE_PROTOCOL"))
        self._engines = _Clients(lambda: new_engine(self._protocol)[0], "TransferEngine")
        # Output pool slabs registered with each engine (held, so its id is not reused).
        self._slabs: dict[int, tuple[Any, set[tuple[int, int]]]] = {}
        #: Sessions whose last read timed out: until when their reads fail at once (a lock of
        #: its own: the engine's is held while a pool slab registers).
        self._unreachable: "collections.OrderedDict[str, float]" = collections.OrderedDict()
        self._unreachable_lock = threading.Lock()
        _READERS.add(self)

    def _check_reachable(self, session: str) -> None:
        """Fails a read at once while ``session`` is backed off: a read from it timed out
        within the last ``SGLANG_SPEC_CAPTURE_UNREACHABLE_BACKOFF_S``. Each read from a
        partitioned producer would hold a reading thread (and, in Mooncake, the engine its
        reads share with every other producer's) for the whole timeout."""
        with self._unreachable_lock:
            until = self._unreachable.get(session)
        left = (until or 0.0) - time.monotonic()
        if left > 0:
            raise StaleSessionError(
                f"reads from {session} fail at once for {left:.1f} s more: the last one timed out (the producer is "
                "unreachable from here, a partition or a host down); SGLANG_SPEC_CAPTURE_UNREACHABLE_BACKOFF_S="
                f"{unreachable_backoff_s():g} sets how long, 0 turns this off"
            )

    def _mark(self, session: str, backoff: float) -> None:
        """Records how a read from ``session`` ended: timed out (backed off ``backoff`` seconds
        from now), or not (0)."""
        with self._unreachable_lock:
            self._unreachable.pop(session, None)
            if backoff > 0:
                self._unreachable[session] = time.monotonic() + backoff
                while len(self._unreachable) > MAX_UNREACHABLE:
                    self._unreachable.popitem(last=False)

    @property
    def nvlink(self) -> bool:
        """True when this process reads over NVLink (``MOONCAKE_PROTOCOL=nvlink*``): into device
        memory."""
        return is_nvlink(self._protocol)

    def _returned(self, te: Any) -> None:
        """A read stuck in ``te`` returned: let go once it was the last."""
        if self._engines.returned(te):
            with self._lock:
                self._slabs.pop(id(te), None)

    def clients(self) -> tuple[int, int]:
        """How many engines this reader holds, and how many have reads stuck in them."""
        return self._engines.counts()

    def _after_fork_in_child(self) -> None:
        """A forked child keeps the parent's engines referenced (their destructors would act on
        the parent's connections and threads) and starts afresh with a new lock."""
        self._engines.after_fork_in_child(_FORKED_LEFTOVERS)
        self._lock = threading.Lock()
        self._unreachable_lock = threading.Lock()

    def read(
        self,
        session: str,
        targets: list[tuple[int, int, int]],
        keep: Any = None,
        stamps: Sequence[tuple[str, int, int]] = (),
        words_device: Any = None,
    ) -> None:
        """Reads each ``(remote address, local address, length)`` of ``session`` straight into
        memory of this process (the outputs: host arrays, registered for the read and
        unregistered after, a few microseconds each over TCP, measured; or CUDA tensors over
        NVLink, whose transports need no local registration).
        ``keep`` owns that memory: it is held past a failed or abandoned read (see the class).
        ``stamps``: ``(key, remote address, stamp)`` of each object's stamp, read before the
        copy and once it has completed: an object still being written is waited for, and one
        whose word differs raises :class:`ReleasedError` (0: freed) or
        :class:`ObjectChangedError`, so unwritten or another object's bytes are never returned.
        Over NVLink, whose transports move device memory, the words are read into a small
        tensor on ``words_device`` (the outputs' GPU; without one, no stamp is looked at) and
        copied to the host from there: Mooncake reports a transfer done only once its copy
        has finished on the device."""
        timeout = read_timeout_s()
        targets = [t for t in targets if t[2] > 0]
        if not targets:
            return
        backoff = unreachable_backoff_s()  # read before anything: a bad value fails this call alone
        self._check_reachable(session)
        # The engine, got (or made: it may reach a metadata server) on the work's thread, under
        # the read's deadline; kept for every look of this read.
        used: list[Any] = []
        guard = threading.Lock()
        began = threading.Event()
        #: When the first transfer could begin: time spent making the engine is no fault of the
        #: producer's, and never backs it off.
        began_at: list[Optional[float]] = [None]
        attempt = [0.0]  # when the current look or copy was started

        def transfer_ran(at_least: float) -> bool:
            """Whether this attempt's transfers have run ``at_least`` seconds."""
            with guard:
                at = began_at[0]
            return at is not None and time.monotonic() - max(at, attempt[0]) >= at_least

        def timed_out() -> str:
            with guard:
                te = used[0] if used else None
            if te is None:  # still making the engine: no fault of the producer's
                return (
                    f"making this process's TransferEngine did not finish within the read's {timeout:.1f} s (Mooncake "
                    "waits on its metadata server, MOONCAKE_TE_METADATA_SERVER); raise SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S "
                    "if it is only slow"
                )
            self._engines.set_aside(te)
            if transfer_ran(min(timeout, MOONCAKE_MIN_TIMEOUT_S)):
                self._mark(session, backoff)
            _logs.get("capture_arena").warning(
                "TransferEngine read from %s timed out after %.1f s; later reads use a new engine", session, timeout
            )
            return (
                f"the TransferEngine read of {len(targets)} objects ({sum(t[2] for t in targets)} bytes) from "
                f"{session} did not finish in {timeout:.1f} s: the producer is unreachable from here (a partition, "
                "a host down) or stopped; raise SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S for slower links"
            )

        checks = list(stamps)
        # Over NVLink the words land in device memory (the outputs' GPU), read back from there;
        # the reading thread works on that GPU (Mooncake syncs the current device's work before
        # it copies, and a thread starts on GPU 0).
        device = words_device if self.nvlink else None
        if self.nvlink and checks and device is None:
            raise InvalidReadError("over NVLink the stamp words are read into device memory: pass words_device (the outputs' GPU)")
        cuda = device is not None and getattr(device, "type", None) == "cuda"
        words = _Words(len(checks), device)  # reused by every look: each has completed when its read returns
        gone = threading.Event()  # set when the caller stops waiting: no later transfer starts
        pending: list[Optional[str]] = [None]

        def work() -> None:
            with _on_device(device) if cuda else contextlib.nullcontext():
                with guard:
                    te = used[0] if used else None
                if te is None:
                    te = self._engines.get(gone)
                with guard:
                    if gone.is_set():  # given up on while the engine was made: nothing is read
                        return
                    if not used:
                        used.append(te)
                    began.set()
                    began_at[0] = time.monotonic()
                pending[0] = self._read_in(te, session, targets, checks, words, gone)

        def late() -> None:
            if used:
                self._returned(used[0])

        # Each look and copy is bounded by the read's deadline; an object still being written
        # (its stamp word pending) is looked at again, and copied once it is there, for at most
        # SGLANG_SPEC_CAPTURE_READY_WAIT_S in all.
        ready = ready_wait_s() if checks else 0.0
        since, pause = time.monotonic(), 50e-6
        while True:
            pending[0] = None
            attempt[0] = time.monotonic()
            try:
                run_bounded("capture-arena-engine-read", work, (keep, words), timeout, timed_out, gone, late, began)
            except StaleSessionError:
                if transfer_ran(min(timeout, MOONCAKE_MIN_TIMEOUT_S)):  # Mooncake's own timeout, or ours
                    self._mark(session, backoff)
                raise
            self._mark(session, 0.0)
            if pending[0] is None:
                return
            waited = time.monotonic() - since
            if waited >= ready:
                raise NotReadyError(
                    f"{pending[0]} was still being written after {waited:.3f} s: its producer handed out its result before "
                    "its copy completed and has not finished it (read again later, or wait longer: "
                    "SGLANG_SPEC_CAPTURE_READY_WAIT_S)"
                )
            time.sleep(min(pause, ready - waited))
            pause = min(pause * 2, 0.01)

    def _read_in(
        self,
        te: Any,
        session: str,
        targets: list[tuple[int, int, int]],
        checks: list[tuple[str, int, int]],
        words: "_Words",
        gone: threading.Event,
    ) -> Optional[str]:
        """A look at the stamps, then one copy of every target and another look: the key of an
        object still being written at the first look (nothing copied; look again later), or
        None when every byte read is the objects'. Once ``gone`` is set (the caller gave up at
        its deadline) no further transfer starts, so no later one writes into its outputs."""

        def transfer(what: list[tuple[int, int, int]]) -> None:
            if gone.is_set():
                raise StaleSessionError("the read was given up at its deadline")
            self._transfer(te, session, what)

        registered: list[int] = []

        def register(regions: list[tuple[int, int]]) -> None:
            if self.nvlink:
                # Mooncake's NVLink transports copy (cudaMemcpyAsync on a stream of their own)
                # from the producer's mapped buffer straight into the local address, which they
                # never look up: the local side needs no registration (Mooncake 3b5a594,
                # nvlink_transport.cpp and intranode_nvlink_transport.cpp: only the remote address
                # is relocated). Registering it does harm. Intra-node, it exports a whole
                # caching-allocator segment with cudaIpcGetMemHandle, which fails on VMM and
                # cudaMallocAsync memory (and registrations are kept by the segment's base, so
                # unregistering one output could drop another's). Multi-node, it exports a fabric
                # handle, which fails on PyTorch's expandable segments (cuMemCreate without one);
                # for cudaMalloc memory it records nothing, so the unregister fails, the range
                # stays reserved in the engine, and the next read into the same memory (the
                # caching allocator hands it out again) fails as an overlapping registration.
                return
            for local, n in regions:
                slab = _pool.POOL.slab_of(local, n)
                if slab is not None:
                    # A pooled output: its slab is registered with this engine once, and stays.
                    with self._lock:
                        done = self._slabs.setdefault(id(te), (te, set()))[1]
                        if slab not in done:
                            rc = te.register_memory(slab[0], slab[1])
                            if rc != 0:
                                raise ArenaOSError(f"TransferEngine.register_memory of a {slab[1]}-byte output pool slab returned {rc}")
                            done.add(slab)
                    continue
                rc = te.register_memory(local, n)
                if rc != 0:
                    raise ArenaOSError(f"TransferEngine.register_memory of a {n}-byte output returned {rc}")
                registered.append(local)

        try:
            # The words before the copy, then after it (the readiness rule of docs/protocol.md).
            # Before: a copy counts only if every object was there when it began (a word still
            # pending may turn ready while, or just after, the copy reads unwritten bytes, and a
            # look after alone would take those bytes for the written ones). After: the object
            # was not freed or replaced meanwhile (a word never turns pending again). The outputs
            # are registered only once the first look found every object there: an object still
            # being written, or a result whose stamps are not its objects', pins nothing.
            looks = [(at, words.address + 8 * i, 8) for i, (_, at, _) in enumerate(checks)]
            if checks:
                register([(words.address, words.nbytes)])
                transfer(looks)
                pending = _check_words(checks, words.values())
                if pending is not None:
                    return pending
            register([(local, n) for _, local, n in targets])
            transfer(targets)
            if not checks:
                return None
            transfer(looks)
            pending = _check_words(checks, words.values())
            if pending is not None:
                raise ArenaOSError(
                    f"{pending}'s stamp word turned back to 'being written' during the read: its producer does not "
                    "follow the readiness rule of docs/protocol.md"
                )
            return None
        finally:
            for local in registered:
                te.unregister_memory(local)

    def _transfer(self, te: Any, session: str, targets: list[tuple[int, int, int]]) -> None:
        gone = (
            "the producer is gone or restarted, unreachable from here, or the address range is not one it "
            "published"
        )
        if self._protocol == "nvlink" or len(targets) == 1:
            # Mooncake documents batch transfers as unreliable over multi-node NVLink (and one
            # object needs no batch).
            for remote, local, n in targets:
                rc = te.transfer_sync_read(session, local, remote, n)
                if rc != 0:
                    raise StaleSessionError(f"TransferEngine read of {n} bytes at {remote:#x} from {session} returned {rc}: {gone}")
            return
        rc = te.batch_transfer_sync_read(session, [t[1] for t in targets], [t[0] for t in targets], [t[2] for t in targets])
        if rc != 0:
            raise StaleSessionError(f"TransferEngine batch read of {len(targets)} objects from {session} returned {rc}: {gone}")


class _Words:
    """Where a read's looks at the stamp words land: a host array, or over NVLink (``device``) a
    tensor on the outputs' GPU, copied to the host to be compared. Mooncake copies on a stream of
    its own, ordered with nothing of torch's: the tensor is allocated without a kernel
    (``torch.empty``), and its stream is synchronized first, so that no kernel queued there
    before (one still using this memory for the tensor it held before) writes into it after."""

    __slots__ = ("_buf", "address", "nbytes")

    def __init__(self, n: int, device: Any = None) -> None:
        n = max(n, 1)
        if device is None:
            self._buf: Any = np.zeros(n, dtype=np.uint64)
            self.address = int(self._buf.ctypes.data)
        else:
            try:
                import torch

                self._buf = torch.empty(n, dtype=torch.int64, device=device)
                if self._buf.is_cuda:
                    torch.cuda.current_stream(self._buf.device).synchronize()
            except Exception as e:  # out of device memory, a CUDA error: a CaptureArenaError
                raise ArenaOSError(f"could not make room for {n} stamp words on {device}: {e}") from e
            self.address = int(self._buf.data_ptr())
        self.nbytes = 8 * n

    def values(self) -> list[int]:
        """The words as unsigned integers (a device buffer copied to the host: Mooncake's
        transfer has completed on the device when its read returns)."""
        if isinstance(self._buf, np.ndarray):
            return list(self._buf.tolist())
        try:
            found = self._buf.cpu().tolist()
        except Exception as e:  # a CUDA error: a CaptureArenaError
            raise ArenaOSError(f"copying the stamp words from {self._buf.device} to the host failed: {e}") from e
        return [int(w) & _U64 for w in found]


_U64 = (1 << 64) - 1


# Clients of Mooncake that a forked child must not destroy: the parent's.
_FORKED_LEFTOVERS: list[Any] = []
_READERS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    QUARANTINE._lock = threading.Lock()  # the fork may have come while another thread held it
    QUARANTINE._timer_at = None  # the parent's timer thread is not here
    for r in list(_READERS):
        r._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
