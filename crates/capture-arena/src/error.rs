//! The one error type of the core crate.

use std::fmt;
use std::time::Duration;

/// Everything that can go wrong in capture-arena. Each variant carries what a user needs to act:
/// what failed, the numbers involved and, where there is one, the setting to change.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A key (or one of its parts) breaks the `{store_id}/{sample_id}/g{gen}/{name}` rules.
    InvalidKey {
        /// The offending key or part, escaped.
        key: String,
        /// Which rule it breaks.
        reason: String,
    },
    /// A configuration value (environment variable or builder field) is missing or invalid.
    Config {
        /// The environment variable (or builder field) at fault.
        var: &'static str,
        /// What is wrong and what to set instead.
        reason: String,
    },
    /// A sample's request is inconsistent: a feature requested but not captured, an unsupported
    /// dtype, data that does not match its shape, a duplicate name.
    InvalidSample {
        /// The sample at fault.
        sample_id: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A tensor's bytes do not match its shape and dtype.
    InvalidTensor {
        /// The tensor's name.
        name: String,
        /// What does not match.
        reason: String,
    },
    /// A key is already resident and the sample did not ask for `replace`.
    KeyExists {
        /// The resident key.
        key: String,
    },
    /// The batch can never fit: it needs more than the whole arena.
    BatchTooLarge {
        /// Bytes the batch needs (after alignment).
        needed: u64,
        /// The arena's capacity.
        capacity: u64,
    },
    /// The batch did not fit before the wait for frees ran out.
    ArenaFull {
        /// Bytes the batch needs (after alignment).
        needed: u64,
        /// Free bytes at the end of the wait.
        free: u64,
        /// The largest free extent at the end of the wait.
        largest_free: u64,
        /// Objects still resident.
        resident_objects: u64,
        /// The arena's capacity.
        capacity: u64,
        /// How long the batch waited.
        waited: Duration,
    },
    /// The writer's queue of pending batches is full (only from non-blocking submission).
    QueueFull {
        /// The queue's capacity (`SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES`).
        capacity: usize,
    },
    /// The writer thread has stopped; nothing more can be published.
    WriterStopped,
    /// A session string cannot be parsed.
    InvalidSession {
        /// The session string.
        session: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A session names an arena that no longer exists or is a different one (the producer
    /// exited or restarted): reading it would return someone else's bytes.
    StaleSession {
        /// The session string.
        session: String,
        /// What did not match.
        reason: String,
    },
    /// An address range falls outside the arena it claims to be in.
    OutOfRange {
        /// First byte asked for.
        address: u64,
        /// Bytes asked for.
        len: u64,
        /// The arena's base address.
        base: u64,
        /// The arena's length.
        region_len: u64,
    },
    /// A result names no feature of that name.
    UnknownFeature {
        /// The key asked for.
        key: String,
        /// The features the result has.
        available: Vec<String>,
    },
    /// A sample was read after its release: its objects were freed and the space may hold other
    /// samples now.
    Released {
        /// `{store_id}/{sample_id}/g{gen}`.
        sample: String,
    },
    /// An object's stamp did not match its result's before or after a read: the object was
    /// freed (another reader released it, an abort or a prefix free, its lease ended) or freed
    /// and its space placed again. Nothing read is returned (a destination's bytes are then
    /// undefined).
    Changed {
        /// The object's key.
        key: String,
        /// The result's stamp.
        stamp: u64,
        /// What the arena held: 0 once freed.
        found: u64,
    },
    /// An object's bytes were still being written when the reader's wait for them ended (its
    /// result was handed out before its copy completed: the readiness rule of docs/protocol.md).
    NotReady {
        /// The object's key.
        key: String,
        /// How long the reader waited.
        waited: Duration,
    },
    /// The producer could not write an object's bytes (its copy failed after its result was
    /// handed out); its space is free again.
    WriteFailed {
        /// The object's key.
        key: String,
    },
    /// A read was refused before touching memory: a buffer of the wrong size, a shape that
    /// overflows.
    InvalidRead {
        /// The key (or session) concerned.
        key: String,
        /// Why.
        reason: String,
    },
    /// Frees could not be sent to a control endpoint; they stay pending and are retried on the
    /// next call (frees are idempotent).
    FreeNotSent {
        /// The control endpoint.
        endpoint: String,
        /// Keys still pending for it.
        pending: usize,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The GPU path cannot be used or a CUDA call failed: no driver in this process, no such
    /// device, a build without the `cuda` feature, an error code from the driver.
    Device {
        /// What we were doing (the CUDA call, the device).
        what: String,
        /// Why it failed and what to change.
        reason: String,
    },
    /// A network transport (NIXL) cannot be used or a transfer failed: the library missing,
    /// an agent that cannot be created, a registration refused.
    Transport {
        /// What we were doing.
        what: String,
        /// Why it failed and what to change.
        reason: String,
    },
    /// A call bounded in time gave up: a synchronous publish that could not start within its
    /// bound (nothing of it was written, nor will be).
    Timeout {
        /// What gave up.
        what: String,
        /// How long it waited.
        waited: Duration,
        /// What it waited for.
        reason: String,
    },
    /// A control endpoint refused frees for the control token (a missing or wrong token);
    /// nothing sent on that connection was applied. Frees sent without a result (by key or
    /// prefix) stay pending and are retried; see [`crate::ControlClient`].
    Unauthorized {
        /// The control endpoint.
        endpoint: String,
        /// Keys still pending for it.
        pending: usize,
        /// The server's reason (`missing token`, `wrong token`).
        reason: String,
    },
    /// An operating-system call failed.
    Io {
        /// What we were doing.
        what: String,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Error {
        Error::Io {
            what: what.into(),
            source,
        }
    }

    pub(crate) fn config(var: &'static str, reason: impl Into<String>) -> Error {
        Error::Config {
            var,
            reason: reason.into(),
        }
    }

    pub(crate) fn device(what: impl Into<String>, reason: impl Into<String>) -> Error {
        Error::Device {
            what: what.into(),
            reason: reason.into(),
        }
    }

    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    pub(crate) fn transport(what: impl Into<String>, reason: impl Into<String>) -> Error {
        Error::Transport {
            what: what.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn sample(sample_id: &str, reason: impl Into<String>) -> Error {
        Error::InvalidSample {
            sample_id: sample_id.to_owned(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidKey { key, reason } => write!(f, "invalid key {key:?}: {reason}"),
            Error::Config { var, reason } => write!(f, "invalid configuration {var}: {reason}"),
            Error::InvalidSample { sample_id, reason } => {
                write!(f, "sample {sample_id:?}: {reason}")
            }
            Error::InvalidTensor { name, reason } => write!(f, "tensor {name:?}: {reason}"),
            Error::KeyExists { key } => write!(
                f,
                "key {key} is already resident; free it first or publish with \"replace\": true"
            ),
            Error::BatchTooLarge { needed, capacity } => write!(
                f,
                "batch needs {needed} bytes but the whole arena holds {capacity} bytes; \
                 raise SGLANG_SPEC_CAPTURE_ARENA_BYTES above {needed} or send smaller batches"
            ),
            Error::ArenaFull {
                needed,
                free,
                largest_free,
                resident_objects,
                capacity,
                waited,
            } => write!(
                f,
                "arena full: batch needs {needed} bytes, {free} of {capacity} bytes are free \
                 (largest free extent {largest_free} bytes) with {resident_objects} objects \
                 resident after waiting {:.1} s for frees ({}); raise \
                 SGLANG_SPEC_CAPTURE_ARENA_BYTES or lower the producer's resident watermark \
                 (fewer unfreed samples in flight), or check that trainers free what they read \
                 (SGLANG_SPEC_CAPTURE_ARENA_WAIT_S sets the wait)",
                waited.as_secs_f64(),
                if free >= needed {
                    "fragmented: enough bytes are free, but not in pieces the batch's objects fit"
                } else {
                    "too small: fewer bytes are free than the batch needs"
                }
            ),
            Error::QueueFull { capacity } => write!(
                f,
                "the writer already holds {capacity} pending batches; wait, or raise \
                 SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES"
            ),
            Error::WriterStopped => write!(f, "the arena's writer thread has stopped"),
            Error::InvalidSession { session, reason } => {
                write!(f, "invalid session {session:?}: {reason}")
            }
            Error::StaleSession { session, reason } => write!(
                f,
                "stale session {session}: {reason}; the producer that published this result has \
                 exited or restarted, so its objects are gone"
            ),
            Error::OutOfRange {
                address,
                len,
                base,
                region_len,
            } => write!(
                f,
                "address range {address:#x}+{len} lies outside the arena [{base:#x}, {:#x})",
                base.saturating_add(*region_len)
            ),
            Error::UnknownFeature { key, available } => write!(
                f,
                "no feature {key}: the result has {}",
                available.join(", ")
            ),
            Error::Released { sample } => write!(
                f,
                "sample {sample} was already released: its objects were freed and the space may \
                 hold other samples now"
            ),
            Error::Changed { key, found: 0, .. } => write!(
                f,
                "{key} was freed before or while it was read (another reader released it, it \
                 was aborted, or its lease ended): nothing read is returned"
            ),
            Error::Changed { key, stamp, found } => write!(
                f,
                "{key} was freed and its space holds another object now (stamp {found}, the \
                 result's {stamp}): nothing read is returned"
            ),
            Error::NotReady { key, waited } => write!(
                f,
                "{key} was still being written after {:.3} s: its producer handed out its result \
                 before its copy completed and has not finished it (read again later, or wait \
                 longer: SGLANG_SPEC_CAPTURE_READY_WAIT_S)",
                waited.as_secs_f64()
            ),
            Error::WriteFailed { key } => write!(
                f,
                "{key} was never written: the producer's copy of it failed after its result was \
                 handed out (its log says why), and its space is free again"
            ),
            Error::InvalidRead { key, reason } => write!(f, "cannot read {key}: {reason}"),
            Error::FreeNotSent {
                endpoint,
                pending,
                source,
            } => write!(
                f,
                "could not send frees to control endpoint {endpoint} ({source}); {pending} keys \
                 stay pending and are retried on the next free or flush"
            ),
            Error::Timeout {
                what,
                waited,
                reason,
            } => write!(
                f,
                "{what} gave up after {:.2} s: {reason}; nothing of it was written \
                 (SGLANG_SPEC_CAPTURE_SYNC_WAIT_S bounds how long a synchronous caller waits)",
                waited.as_secs_f64()
            ),
            Error::Unauthorized {
                endpoint,
                pending,
                reason,
            } => write!(
                f,
                "control endpoint {endpoint} refused frees ({reason}): nothing sent on that \
                 connection was applied; {pending} keys wait for a token. Give this client the \
                 producer's control token (a result's arena.token, \
                 SGLANG_SPEC_CAPTURE_CONTROL_TOKEN)"
            ),
            Error::Device { what, reason } => write!(f, "{what}: {reason}"),
            Error::Transport { what, reason } => write!(f, "{what}: {reason}"),
            Error::Io { what, source } => write!(f, "{what}: {source}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } | Error::FreeNotSent { source, .. } => Some(source),
            _ => None,
        }
    }
}
