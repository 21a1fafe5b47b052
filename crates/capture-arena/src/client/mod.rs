//! The trainer side: read published features by (session, address) and free them.
//!
//! - [`Reader`] opens sessions (cached, and dropped once their producer is gone) and reads
//!   features into caller buffers, validating every address and length against the arena and
//!   against `shape × dtype` before touching memory.
//! - [`ControlClient`] sends frees without waiting on the network in its caller's thread: a
//!   sender thread per control endpoint with one persistent connection, retries with a back-off
//!   per endpoint (an unreachable endpoint never delays frees to another one), and a bounded
//!   number of keys waiting.
//! - [`FeatureStore`] is what a trainer holds: `get` a result's tensors, `release` it, with
//!   use-after-release protection.

mod control_client;
mod feature_store;
mod reader;

pub use control_client::{
    send_frees, ControlClient, Liveness, StatsQuery, DEFAULT_MAX_PENDING_KEYS, MAX_SENDERS,
    UNLOCATED_TTL,
};
pub use feature_store::{FeatureStore, Health, OwnedTensor, RELEASED_MEMORY};
pub use reader::{Reader, MAX_SESSIONS};

use std::sync::{Mutex, MutexGuard};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
