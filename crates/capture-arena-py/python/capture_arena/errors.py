"""Exceptions raised by capture_arena.

Every exception is a :class:`CaptureArenaError` and also the standard exception that fits, so
``except KeyError`` or ``except ValueError`` keep working in code written for the existing sink.
"""

from __future__ import annotations

__all__ = [
    "CaptureArenaError",
    "ConfigError",
    "InvalidSampleError",
    "KeyExistsError",
    "ArenaFullError",
    "QueueFullError",
    "WriterStoppedError",
    "InvalidSessionError",
    "StaleSessionError",
    "InvalidReadError",
    "UnknownFeatureError",
    "ReleasedError",
    "ObjectChangedError",
    "NotReadyError",
    "WriteFailedError",
    "FreeNotSentError",
    "FreeRefusedError",
    "PublishTimeoutError",
    "ArenaOSError",
    "DeviceError",
    "TransportError",
]


class CaptureArenaError(Exception):
    """Base class of every capture_arena error."""


class ConfigError(CaptureArenaError, ValueError):
    """A setting (keyword argument or environment variable) is missing or invalid."""


class InvalidSampleError(CaptureArenaError, ValueError):
    """A sample is inconsistent: a feature requested but not captured, an unsupported dtype,
    data that does not match its shape. Raised before anything is written."""


class KeyExistsError(CaptureArenaError, KeyError):
    """A key is already resident and the sample did not ask for ``replace``."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class ArenaFullError(CaptureArenaError, RuntimeError):
    """A batch did not fit in the arena (in time, or at all)."""


class QueueFullError(CaptureArenaError, RuntimeError):
    """The writer's queue of pending batches is full (``block=False`` only)."""


class WriterStoppedError(CaptureArenaError, RuntimeError):
    """The writer thread has stopped (the sink was closed)."""


class InvalidSessionError(CaptureArenaError, ValueError):
    """A result's session string cannot be read by this build."""


class StaleSessionError(CaptureArenaError, RuntimeError):
    """A result's objects cannot be read: its producer exited or restarted, or it is unreachable
    from here (a read or a connection past ``SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S``). The same on
    every transport (shared memory, CUDA handles, NIXL, a Mooncake TransferEngine, the Mooncake
    store). Releasing such a result is safe: its frees wait until its control endpoint answers,
    and are dropped only once it refuses connections."""


class InvalidReadError(CaptureArenaError, ValueError):
    """A read was refused before touching memory (bad address, wrong buffer size, a failed
    result)."""


class UnknownFeatureError(CaptureArenaError, KeyError):
    """A result has no feature of that name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ReleasedError(CaptureArenaError, KeyError):
    """A sample was read after it was released: by this store (:meth:`ArenaFeatureStore.release`),
    or by anyone else (another trainer, a restarted one, an abort, a prefix free, the lease), which
    the object's stamp shows before or after the copy. Nothing read is returned."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ObjectChangedError(CaptureArenaError, KeyError):
    """An object was freed and its space holds another object now (its stamp is another
    object's): the read returns nothing rather than another sample's bytes."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class NotReadyError(CaptureArenaError, TimeoutError):
    """An object's bytes were still being written when the read's wait for them ended
    (``SGLANG_SPEC_CAPTURE_READY_WAIT_S``): its producer handed out its result before its copy
    completed (vLLM's connector does). Reading again later may succeed."""


class WriteFailedError(CaptureArenaError, RuntimeError):
    """The producer could not write an object's bytes after handing out its result (its copy
    failed: its log says why); its space is free again. Nothing read is returned."""


class FreeNotSentError(CaptureArenaError, ConnectionError):
    """Frees could not reach a control endpoint, or it did not confirm them; they stay pending
    and are retried."""


class FreeRefusedError(FreeNotSentError):
    """A control endpoint refused frees for its control token (a missing or wrong token):
    nothing sent on that connection was applied. They stay pending and are retried; give the
    client the producer's token (a result's ``arena.token``)."""


class PublishTimeoutError(CaptureArenaError, TimeoutError):
    """A synchronous publish did not start within its bound (``SGLANG_SPEC_CAPTURE_SYNC_WAIT_S``):
    the arena was still being created, full, or busy with earlier batches. Nothing of it was
    written, nor will be."""


class ArenaOSError(CaptureArenaError, OSError):
    """An operating-system call failed (shared memory, sockets)."""


class DeviceError(CaptureArenaError, RuntimeError):
    """The GPU path cannot be used or a CUDA call failed: no CUDA driver or device in this
    process, a device index it does not see, an error from the driver. The message says what to
    change."""


class TransportError(CaptureArenaError, RuntimeError):
    """A network transport (NIXL) cannot be used: its library missing
    (``SGLANG_SPEC_CAPTURE_NIXL_LIB``), an agent that cannot be made, memory it cannot register.
    The message says what to change."""
