//! Transports: how a reader reaches the bytes of a published object, chosen from the result's
//! session string. The reader API ([`crate::client`]) does not change with the transport.
//!
//! | scheme | transport | reach |
//! |---|---|---|
//! | `shm://` | [`ShmView`]: the producer's shared memory mapped read-only | same host |
//!
//! Later transports (NIXL over UCX, Mooncake's TransferEngine, CUDA IPC / fabric handles) are
//! further variants of [`Transport`], each opened from its own session scheme.

use std::ops::Deref;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::memory::{ShmSession, ShmView};

/// An open session: one producer's arena, as this process reaches it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Transport {
    /// Same-host shared memory, mapped read-only.
    Shm(Arc<ShmView>),
}

impl Transport {
    /// Opens the arena a session string names.
    ///
    /// # Errors
    /// [`Error::InvalidSession`] for a scheme this build cannot read or a malformed session;
    /// [`Error::StaleSession`] when the producer is gone or restarted.
    pub fn open(session: &str) -> Result<Transport> {
        if session.starts_with("shm://") {
            let s: ShmSession = session.parse()?;
            return Ok(Transport::Shm(Arc::new(ShmView::open(&s)?)));
        }
        Err(Error::InvalidSession {
            session: session.to_owned(),
            reason: "unknown transport; this build reads shm:// sessions (same-host shared memory)"
                .into(),
        })
    }

    /// True while the producer's arena still exists (false once it exited or restarted).
    pub fn is_live(&self) -> bool {
        match self {
            Transport::Shm(v) => v.is_live(),
        }
    }

    /// Checks that `[address, address + len)` lies inside the arena, before anything is
    /// allocated or touched for it.
    ///
    /// # Errors
    /// [`Error::OutOfRange`].
    pub fn check(&self, address: u64, len: u64) -> Result<()> {
        match self {
            Transport::Shm(v) => v.offset_of(address, len).map(|_| ()),
        }
    }

    /// Copies `out.len()` bytes at `address` into `out`.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] if the range is not inside the arena.
    pub fn read(&self, address: u64, out: &mut [u8]) -> Result<()> {
        match self {
            Transport::Shm(v) => v.read(address, out),
        }
    }

    /// Borrows `len` bytes at `address` without copying, for transports that map the arena.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] if the range is not inside the arena.
    pub fn view(&self, address: u64, len: u64) -> Result<View> {
        match self {
            Transport::Shm(v) => {
                v.view(address, len)?;
                Ok(View {
                    map: v.clone(),
                    address,
                    len,
                })
            }
        }
    }
}

/// A zero-copy view of one object's bytes. It keeps the mapping alive; its bytes are what was
/// published until the object is freed.
#[derive(Debug, Clone)]
pub struct View {
    map: Arc<ShmView>,
    address: u64,
    len: u64,
}

impl Deref for View {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // The range was checked against this very mapping when the view was made, and neither
        // changes after: this cannot fail.
        self.map
            .view(self.address, self.len)
            .expect("range checked when the view was made")
    }
}

impl AsRef<[u8]> for View {
    fn as_ref(&self) -> &[u8] {
        self
    }
}
