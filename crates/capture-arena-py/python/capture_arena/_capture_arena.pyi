"""Stubs of the compiled module (capture_arena._capture_arena)."""

from typing import Any, Optional, final

from typing_extensions import disjoint_base

__all__ = ["_ArenaSink", "_Store", "_Batch", "arena_enabled", "placement", "_parse_bytes", "_max_pending_batches", "_plan_batch", "_store_keys", "_bench_rust_put", "__version__", "FEATURES", "ReadBuffer", "_send_frees", "_exiting", "_nixl_serve"]

__version__: str

def arena_enabled() -> bool:
    """True when the environment selects an arena placement (not the Mooncake store)."""

def _bench_rust_put(
    sink: _ArenaSink, n_samples: int, n_tensors: int, tensor_bytes: int, reps: int
) -> list[float]: ...

FEATURES: list[str]

def _nixl_serve(name: str, len: int, agent: str) -> None: ...
def _exiting() -> int:
    """Marks the interpreter as exiting: threads other than this one that come back from native
    code park instead of taking the GIL back; waits up to 5 s for calls in flight. Returns how
    many are still in flight."""

def _send_frees(
    control: str, keys: list[str], prefixes: list[str], token: Optional[str] = None, timeout_s: float = 5.0
) -> None: ...

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
    ) -> "_ArenaSink": ...
    def _submit(self, samples: Any, future: Any, block: bool = True) -> None: ...
    def _put(self, samples: Any) -> list[dict[str, Any]]: ...
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
    def health(self) -> dict[str, int]:
        """{"resident_samples", "resident_bytes", "pending_frees", "dropped_frees", "open_sessions"}."""

def placement() -> str: ...
def _parse_bytes(var: str, value: str) -> int: ...
def _max_pending_batches() -> int: ...
def _plan_batch(samples: Any, aux_layer_ids: Optional[list[int]] = None) -> tuple["_Batch", list[tuple[int, dict[str, Any]]]]: ...
def _store_keys(result: Any, names: list[str]) -> list[tuple[str, int]]: ...

@final
class _Batch:
    def tensors(self) -> list[tuple[int, str, str, list[int], str, int, int]]: ...
    def results(self) -> list[dict[str, Any]]: ...
    def samples(self) -> list[tuple[str, bool, list[str]]]: ...
