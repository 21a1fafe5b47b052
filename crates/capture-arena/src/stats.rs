//! Counters the writer keeps, readable from any thread without touching the arena: plain atomics
//! that only the writer stores. Gauges (free bytes, resident objects) are declared last so a
//! snapshot reads them after the counters.

use std::sync::atomic::{
    AtomicU64,
    Ordering::{Acquire, Relaxed, Release},
};

use serde::{Deserialize, Serialize};

use crate::report::ArenaReport;

macro_rules! stats {
    ($( $(#[$doc:meta])* $field:ident ),* $(,)?) => {
        /// The writer's live counters (see [`StatsSnapshot`] for their meaning).
        #[derive(Debug, Default)]
        pub struct Stats {
            $( pub(crate) $field: AtomicU64, )*
        }

        /// A copy of the writer's counters.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
        pub struct StatsSnapshot {
            $( $(#[$doc])* pub $field: u64, )*
        }

        impl Stats {
            /// Reads every counter.
            pub fn snapshot(&self) -> StatsSnapshot {
                StatsSnapshot { $( $field: self.$field.load(Acquire), )* }
            }
        }
    };
}

stats! {
    /// Batches published.
    published_batches,
    /// Samples published.
    published_samples,
    /// Objects published.
    published_objects,
    /// Tensor bytes published (before alignment).
    published_bytes,
    /// Objects freed through the control endpoint, or by the producer itself
    /// (`local_freed_objects`).
    freed_objects,
    /// Their bytes (tensor bytes, as `published_bytes`).
    freed_bytes,
    /// Objects freed because a sample asked for `replace`.
    replaced_objects,
    /// Their bytes.
    replaced_bytes,
    /// Objects freed by the writer because their lease (`SGLANG_SPEC_CAPTURE_OBJECT_TTL_S`)
    /// ended before a trainer freed them.
    expired_objects,
    /// Their bytes. Resident bytes = published - freed - replaced - expired - failed writes'
    /// (`failed_write_bytes`), once every free of an object being written was applied.
    expired_bytes,
    /// Keys freed that were not resident (already freed or never published).
    unknown_frees,
    /// Stamped frees of a key whose resident object carries another stamp (one published since
    /// under the same key: a late or resent free of the object it replaced): not applied.
    stale_frees,
    /// Control lines that were not a JSON array of strings.
    bad_lines,
    /// Unterminated lines discarded when their connection closed.
    partial_lines,
    /// Connections closed for the control token: a line before the token, a wrong token, or a
    /// long line before it (nothing such a connection sent before its token was applied).
    unauthorized_lines,
    /// Lines over the length limit (their connection was closed).
    oversized_lines,
    /// Control connections accepted.
    control_connections,
    /// Connections closed at once because `max_connections` were open (or descriptors ran out).
    refused_connections,
    /// Connections closed because an unfinished line waited longer than `line_timeout`.
    timed_out_lines,
    /// Control connections closed to let a new one in while every slot was taken: each the
    /// oldest that had not presented the control token (with one set), or the one idle longest
    /// (nothing unfinished, nothing sent for at least `line_timeout`).
    idle_closed,
    /// `accept` failures (out of descriptors, ...); the listener is retried with a back-off.
    accept_errors,
    /// Requests answered on the local reply path.
    reply_requests,
    /// Requests refused on the reply path (another user, a malformed or unknown request).
    reply_refused,
    /// `{"stats": true}` requests answered on the control port (`capture-arena stats`, `top`).
    stats_requests,
    /// `{"sync": n}` requests answered on the control port (clients confirming their frees).
    sync_requests,
    /// Objects freed by the producer's own process (a capture it dropped: a live record the
    /// intake refused, a synchronous caller that stopped waiting).
    local_freed_objects,
    /// Objects whose bytes their submitter wrote itself (reserved tensors, published before
    /// their bytes) and finished: readers may read them.
    written_objects,
    /// Objects whose submitter could not write their bytes: readers fail, their space was freed.
    failed_writes,
    /// Their bytes. Resident bytes = published - freed - replaced - expired - failed writes'.
    failed_write_bytes,
    /// Batches that had to wait for frees.
    waits,
    /// Total time batches waited for frees, in nanoseconds.
    wait_ns,
    /// Batches that failed (nothing of them was written).
    failed_batches,
    /// Time spent placing and copying published batches (excluding waits), in nanoseconds:
    /// `published_bytes / copy_ns` is the writer's publish bandwidth.
    copy_ns,
    /// Usable bytes of the arena (0 until it exists).
    capacity,
    /// Free bytes.
    free_bytes,
    /// The largest free extent.
    largest_free,
    /// Free extents.
    free_extents,
    /// Objects resident.
    resident_objects,
    /// Aligned bytes resident (and of the batch being copied).
    resident_bytes,
    /// Control and reply connections open.
    open_connections,
    /// Bytes of memory held for unfinished control lines, across connections.
    control_buffered_bytes,
    /// Bytes the batch at the head of the queue needs while it waits for frees; 0 when none
    /// waits (a trainer that stopped freeing shows here first).
    waiting_bytes,
}

impl Stats {
    pub(crate) fn set_report(&self, r: &ArenaReport) {
        self.capacity.store(r.capacity, Relaxed);
        self.free_bytes.store(r.free_bytes, Relaxed);
        self.largest_free.store(r.largest_free, Relaxed);
        self.free_extents.store(r.free_extents, Relaxed);
        self.resident_objects.store(r.resident_objects, Relaxed);
        self.resident_bytes.store(r.resident_bytes, Relaxed);
    }
}

/// Adds `n` to a counter (only the writer calls this). The writer updates the gauges first and
/// the counters after them (release), and snapshots read counters before gauges (acquire): a
/// reader that sees a free counted also sees the free space it made.
pub(crate) fn bump(counter: &AtomicU64, n: u64) {
    if n > 0 {
        counter.fetch_add(n, Release);
    }
}
