//! The trainer side: read published features by (session, address) and free them.
//!
//! - [`Reader`] opens sessions (cached, and dropped once their producer is gone) and reads
//!   features into caller buffers, validating every address and length against the arena and
//!   against `shape × dtype` before touching memory.
//! - [`ControlClient`] sends frees without waiting on the network in its caller's thread: a
//!   sender thread per control endpoint with one persistent connection, retries with a back-off
//!   per endpoint (an unreachable endpoint never delays frees to another one), and a bounded
//!   number of keys waiting.
//!   Its connections (token first, free lines under the server's limit, socket probes) are
//!   `control_conn`'s, as is [`send_frees`], the one-shot send of operators.
//! - [`StatsQuery`] asks a producer for its counters (`capture-arena stats`, `top`).
//! - [`FeatureStore`] is what a trainer holds: `get` a result's tensors, `release` it, with
//!   use-after-release protection.

mod control_client;
mod control_conn;
mod feature_store;
mod reader;
mod stats_query;

pub use control_client::{
    ControlClient, Liveness, DEFAULT_MAX_PENDING_KEYS, MAX_SENDERS, UNLOCATED_TTL,
};
pub use control_conn::{send_frees, MAX_RESOLUTIONS};
pub use feature_store::{FeatureStore, Health, OwnedTensor, RELEASED_MEMORY};
pub use reader::{Reader, MAX_SESSIONS};
pub use stats_query::StatsQuery;

use std::sync::{Mutex, MutexGuard};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
