//! Same-host reads: the producer's shared-memory object mapped read-only.

use std::os::fd::{AsFd, OwnedFd};

use crate::error::{Error, Result};
use crate::memory::mapping::{Access, Mapping};
use crate::memory::shm::{self, Header, ShmSession, HEADER_BYTES, SHM_DIR};
use crate::transport::{Destination, ReadOp, Transport};

/// A reader's read-only mapping of a producer's region, checked against its session.
#[derive(Debug)]
pub struct ShmTransport {
    map: Mapping,
    session: ShmSession,
    text: String,
    /// Kept open to tell whether the producer has removed the object (`st_nlink == 0`).
    fd: OwnedFd,
}

impl ShmTransport {
    /// Maps the region a session names, read-only, and checks that it is the same arena: magic,
    /// nonce, length and base address must all match the session. The mapping is pre-faulted,
    /// which takes a moment for a large arena (callers from Python release the GIL around it).
    ///
    /// # Errors
    /// [`Error::StaleSession`] when the object no longer exists or its header does not match;
    /// [`Error::Io`] if mapping fails.
    pub fn open(session: &ShmSession) -> Result<ShmTransport> {
        let stale = |reason: String| Error::StaleSession {
            session: session.to_string(),
            reason,
        };
        let fd = shm::open(&session.name, libc::O_RDONLY, 0)
            .map_err(|e| stale(format!("cannot open {SHM_DIR}/{} ({e})", session.name)))?;
        let (size, _) = shm::fstat(&fd).map_err(|e| Error::io(format!("fstat of {session}"), e))?;
        let want = session.len.saturating_add(HEADER_BYTES);
        if size != want {
            return Err(stale(format!(
                "object is {size} bytes, session says {want}"
            )));
        }
        let bytes = usize::try_from(want).map_err(|_| stale("too large to map".into()))?;
        let map = Mapping::map(
            fd.as_fd(),
            bytes,
            Access::ReadOnly,
            true,
            &session.to_string(),
        )?;
        match Header::read(&map) {
            Some(h) if (h.nonce, h.len, h.base) == (session.nonce, session.len, session.base) => {}
            _ => return Err(stale("header does not match (different arena)".into())),
        }
        Ok(ShmTransport {
            map,
            text: session.to_string(),
            session: session.clone(),
            fd,
        })
    }

    /// The parsed session.
    pub fn shm_session(&self) -> &ShmSession {
        &self.session
    }

    /// The data offset (in the mapping) of `[address, address + n)`, checked.
    fn offset_of(&self, address: u64, n: u64) -> Result<usize> {
        let s = &self.session;
        address
            .checked_sub(s.base)
            .filter(|&o| o.checked_add(n).is_some_and(|e| e <= s.len))
            .map(|o| (o + HEADER_BYTES) as usize)
            .ok_or(Error::OutOfRange {
                address,
                len: n,
                base: s.base,
                region_len: s.len,
            })
    }
}

impl Transport for ShmTransport {
    fn session(&self) -> &str {
        &self.text
    }

    fn is_live(&self) -> bool {
        shm::fstat(&self.fd).is_ok_and(|(_, links)| links > 0)
    }

    fn check(&self, address: u64, len: u64) -> Result<()> {
        self.offset_of(address, len).map(|_| ())
    }

    fn read(&self, reads: &mut [ReadOp<'_>]) -> Result<()> {
        for r in reads.iter() {
            self.offset_of(r.address, r.into.len())?;
        }
        for r in reads.iter_mut() {
            let off = self.offset_of(r.address, r.into.len())?;
            match &mut r.into {
                Destination::Host(out) => self.map.copy_out(off, out)?,
            }
        }
        Ok(())
    }

    fn mapped(&self, address: u64, len: u64) -> Option<Result<(&Mapping, usize)>> {
        Some(self.offset_of(address, len).map(|o| (&self.map, o)))
    }
}
