"""Stubs of the compiled module (capture_arena._capture_arena)."""

from typing import Any, Literal, Optional, final, overload

from typing_extensions import disjoint_base

__all__ = ["_ArenaSink", "_Landed", "_DeviceRows", "_Reserving", "_Store", "_Batch", "arena_enabled", "placement", "_parse_bytes", "_env_flag", "_max_pending_batches", "_plan_batch", "_store_keys", "_result_keys", "_result_stamped_keys", "_memory_limit", "_stats_query", "_bench_rust_put", "__version__", "FEATURES", "UCX_TCP_SEG_SIZE", "ReadBuffer", "_send_frees", "_is_valid_token", "_exiting", "_forked_child", "_nixl_serve", "_BUILD"]

__version__: str
#: UCX's TCP segment size the package and the CLI set when unset (``UCX_TCP_TX_SEG_SIZE``, ``UCX_TCP_RX_SEG_SIZE``).
UCX_TCP_SEG_SIZE: str

def arena_enabled() -> bool:
    """True when the environment selects an arena placement (not the Mooncake store)."""

def _bench_rust_put(
    sink: _ArenaSink, n_samples: int, n_tensors: int, tensor_bytes: int, reps: int
) -> list[float]: ...

FEATURES: list[str]
#: "release" or "debug" (cfg!(debug_assertions)): how the extension was compiled.
_BUILD: str

def _nixl_serve(name: str, len: int, agent: str) -> None: ...
def _exiting() -> int:
    """Marks the interpreter as exiting: threads other than this one that come back from native
    code park instead of taking the GIL back; waits up to 5 s for calls in flight. Returns how
    many are still in flight."""

def _forked_child() -> None:
    """In a process just forked: the calls in flight were the parent's threads', which this
    process does not have; none is waited for at its exit."""

def _is_valid_token(token: str) -> bool: ...
def _send_frees(
    control: str, keys: list[str], prefixes: list[str], token: Optional[str] = None, timeout_s: float = 5.0
) -> None: ...

@final
class _Landed:
    """Whether each of a step's requests has landed: set in native code as each one's write is
    finished (`_ArenaSink._copy_requests_rows`)."""

    def __new__(cls, n: int) -> "_Landed": ...
    def __len__(self) -> int: ...
    def __getitem__(self, i: int, /) -> bool: ...

@final
class _DeviceRows:
    """A stream of its own on the cache's GPU, for a connector's copies from a device cache
    (`_ArenaSink._copy_requests_rows_device`)."""

    def __new__(cls, ordinal: int) -> "_DeviceRows": ...
    def synchronize(self) -> Optional[str]:
        """Waits until every copy enqueued on the stream has finished; why one failed, or None."""
    def host_pinned(self) -> bool:
        """Whether the host arena (`_ArenaSink._pin_host_arena`) is pinned now."""
    def unpin_host(self) -> None:
        """Unpins the host arena, after a registration in progress: before the arena goes."""

@final
class _Reserving:
    """Reservations handed to the writer (`_ArenaSink._begin_reserving`), collected once with
    `wait`. Dropped uncollected, its objects are failed and freed as they are placed: nothing
    stays reserved that nobody will write."""

    @overload
    def wait(
        self, keys: Literal[False] = False, hold_gil_s: float = ..., dicts: bool = False
    ) -> list[tuple[dict[str, Any], Optional[dict[str, int]]]]: ...
    @overload
    def wait(
        self, keys: Literal[True], hold_gil_s: float = ..., dicts: Literal[False] = False
    ) -> list[tuple[Optional[list[str]], Optional[dict[str, tuple[int, int]]], bytes]]: ...
    @overload
    def wait(
        self, keys: Literal[True], hold_gil_s: float = ..., *, dicts: Literal[True]
    ) -> list[tuple[Optional[list[str]], Optional[dict[str, tuple[int, int]]], dict[str, Any]]]: ...

@disjoint_base
class _ArenaSink:
    def __new__(
        cls,
        *,
        arena_bytes: Optional[int | str] = None,
        control_host: Optional[str] = None,
        control_port: Optional[int] = None,
        alignment: Optional[int] = None,
        wait_s: Optional[float] = None,
        max_pending_batches: Optional[int] = None,
        aux_layer_ids: Optional[list[int]] = None,
        timing: Optional[bool] = None,
        protocol: Optional[str] = None,
        gpu_put: Optional[bool] = None,
        eager: Optional[bool] = None,
        device: Optional[int] = None,
        transport: Optional[str] = None,
        control_token: Optional[str] = None,
        placement: Optional[str] = None,
    ) -> "_ArenaSink": ...
    def _submit(self, samples: Any, future: Any, block: bool = True) -> None: ...
    def _put(self, samples: Any, within_s: Optional[float] = None) -> list[dict[str, Any]]: ...
    def _put_each(self, samples: Any, within_s: float) -> list[dict[str, Any]]: ...
    @overload
    def _reserve_each(
        self, specs: Any, within_s: float, keys: Literal[False] = False, hold_gil_s: float = ...
    ) -> list[tuple[dict[str, Any], Optional[dict[str, int]]]]: ...
    @overload
    def _reserve_each(
        self, specs: Any, within_s: float, keys: Literal[True], hold_gil_s: float = ...
    ) -> list[tuple[Optional[list[str]], Optional[dict[str, tuple[int, int]]], bytes]]: ...
    def _begin_reserving(self, specs: Any, within_s: float) -> "_Reserving": ...
    def _begin_reserving_rows(
        self, store_id: str, dtype: str, width: int, requests: list[tuple[str, int, int]], within_s: float
    ) -> "_Reserving": ...
    def _local_region(self) -> Optional[tuple[int, int]]: ...
    def _copy_requests_rows(
        self,
        cache: tuple[int, int, tuple[int, int, int], int, int, int, int],
        requests: list[tuple[list[str], tuple[int, int], list[int], int, tuple[int, int], int, list[int]]],
        landed: _Landed,
        first: int = 0,
        ids_per_hold: int = ...,
    ) -> list[Optional[str]]: ...
    def _pin_host_arena(self, rows: _DeviceRows) -> bool:
        """Starts pinning this sink's host arena for `rows`' copies, in the background; False
        if `rows` has one pinned already."""
    def _copy_requests_rows_device(
        self,
        rows: _DeviceRows,
        cache: tuple[int, int, tuple[int, int, int], int, int, int, int],
        requests: list[tuple[list[str], tuple[int, int], list[int], int, tuple[int, int], int, list[int]]],
        landed: _Landed,
        after: int,
        first: int = 0,
        ids_per_hold: int = ...,
    ) -> list[Optional[str]]: ...
    def _finish_writes(self, keys: list[str], ok: bool) -> None: ...
    def _finish_writes_stamped(self, objects: list[tuple[str, int]], ok: bool) -> None: ...
    def _fail_writes_of(self, keys: list[str], stamps: list[int]) -> None: ...
    def _finish_written(self, objects: list[tuple[int, int, int]], ok: bool) -> None: ...
    def _check_reserved_objects(self, objects: list[tuple[int, int, int]]) -> Optional[str]: ...
    def _free_local(self, keys: list[str]) -> None: ...
    def unauthorized_peers(self) -> list[dict[str, Any]]:
        """Peers whose control connections were closed for the control token, the most recent
        first: a list of dicts `peer`, `connections`, `reason`, `last_age_s`."""
    @property
    def arena_wait_s(self) -> float: ...
    @property
    def sync_wait_s(self) -> float: ...
    def _start(self, device: Optional[int] = None) -> None: ...
    def stats(self) -> dict[str, int]:
        """The writer's counters (all zero before the first capture)."""
    def store_usage(self) -> list[dict[str, Any]]:
        """Resident objects per store_id, largest first (who holds the arena, since when)."""
    @property
    def started(self) -> bool: ...
    @property
    def session(self) -> Optional[str]: ...
    @property
    def control(self) -> Optional[str]: ...
    @property
    def arena_bytes(self) -> Optional[int]: ...
    @property
    def device_publication(self) -> bool: ...
    @property
    def placement(self) -> str: ...
    @property
    def max_pending_batches(self) -> int: ...
    @property
    def eager(self) -> bool: ...
    @property
    def device(self) -> Optional[int]: ...
    @property
    def protocol(self) -> Optional[str]: ...
    def _start_with_region(self, ptr: int, length: int, session: str, owner: Any, device: Optional[int] = None) -> None: ...
    def close(self) -> None:
        """Stops the writer and removes the arena. Idempotent."""
    def _close_at_exit(self) -> None:
        """As ``close``; a shared-memory arena's name goes at once even under a call in flight."""
    def _remove_name_at_exit(self) -> None:
        """At exit, with a thread still writing into the arena: its shared-memory name goes,
        the sink is left as it is."""

@final
class ReadBuffer:
    """Host memory that NIXL registers once: ``numpy.asarray(buf)`` is a writable uint8 view;
    slices of it passed as ``out=`` are read into without registering memory again."""
    def __new__(cls, nbytes: int) -> "ReadBuffer": ...
    @property
    def nbytes(self) -> int: ...
    @property
    def registrations(self) -> int: ...
    @property
    def __array_interface__(self) -> dict[str, Any]: ...
    def __len__(self) -> int: ...

@disjoint_base
class _Store:
    def __new__(cls) -> "_Store": ...
    def _read_into(self, result: Any, targets: list[tuple[str, Any]]) -> None: ...
    def _check(self, result: Any, names: Optional[list[str]] = None) -> None: ...
    def _validate(self, result: Any, names: list[str]) -> list[int]: ...
    def release(self, result: Any) -> None:
        """Frees every object of `result` (queued for its endpoint's sender: never waits on the
        network); later reads of it raise ReleasedError."""
    def flush(self, timeout_s: float = 0.0) -> None:
        """Has the free senders send what waits, then waits up to `timeout_s` for it to go out."""
    def flush_samples(self, store_id: str, sample_ids: list[str], timeout_s: float) -> None:
        """As `flush`, for the frees of `sample_ids` of `store_id` only."""
    def health(self) -> dict[str, int]:
        """{"resident_samples", "resident_bytes", "pending_frees", "refused_frees", "dropped_frees", "open_sessions"}."""

def placement() -> str: ...
def _parse_bytes(var: str, value: str) -> int: ...
def _env_flag(var: str) -> Optional[bool]: ...
def _max_pending_batches() -> int: ...
def _plan_batch(samples: Any, aux_layer_ids: Optional[list[int]] = None) -> tuple["_Batch", list[tuple[int, dict[str, Any]]]]: ...
def _store_keys(result: Any, names: list[str]) -> list[tuple[str, int]]: ...
def _result_keys(result: Any, store: bool = False) -> list[str]: ...
def _result_stamped_keys(result: Any) -> list[tuple[str, Optional[int]]]: ...
def _memory_limit() -> tuple[int, str]: ...
def _stats_query(control: str, token: Optional[str] = None, timeout_s: float = 2.0) -> dict[str, Any]: ...

@final
class _Batch:
    def tensors(self) -> list[tuple[int, str, str, list[int], str, int, int, int]]: ...
    def wait_ready(self, timeout_s: float) -> None: ...
    def results(self) -> list[dict[str, Any]]: ...
    def samples(self) -> list[tuple[str, bool, list[str]]]: ...
