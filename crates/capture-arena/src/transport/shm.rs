//! Same-host reads: the producer's shared-memory object mapped read-only.
//!
//! Liveness: the producer removes its object when it exits normally (`st_nlink` drops to 0,
//! checked on every read). A producer killed outright cannot, so at most once a second a reader
//! also tries the lock its producer holds for the arena's life
//! ([`crate::memory::shm::is_abandoned`]): once it can be taken, the producer is gone, and the
//! reader drops its mapping. (It leaves the object for the next producer, or `capture-arena
//! clean`, to remove.)

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::memory::mapping::{Access, Mapping};
use crate::memory::shm::{self, Header, ShmSession, HEADER_BYTES, SHM_DIR};
use crate::sample::STAMP_BYTES;
use crate::transport::{Destination, ReadOp, Transport};

/// A reader's read-only mapping of a producer's region, checked against its session.
#[derive(Debug)]
pub struct ShmTransport {
    map: Mapping,
    session: ShmSession,
    text: String,
    /// Kept open to tell whether the producer has removed the object (`st_nlink == 0`).
    fd: OwnedFd,
    /// When the producer's lock was last tried, and whether it was still held.
    lock_check: Mutex<(Instant, bool)>,
}

/// How often a reader tries a producer's lock.
const LOCK_CHECK_EVERY: Duration = Duration::from_secs(1);

/// True when the object of `session` is gone or no producer holds it.
pub(crate) fn is_gone(session: &ShmSession) -> bool {
    let path = Path::new(SHM_DIR).join(&session.name);
    match shm::is_abandoned(&path) {
        Ok(abandoned) => abandoned,
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    }
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
        if let Some(why) = shm::foreign(&fd) {
            return Err(Error::InvalidSession {
                session: session.to_string(),
                reason: format!("refusing to map {SHM_DIR}/{}: {why}", session.name),
            });
        }
        // A producer holds a lock on its arena for its life, and hands out results only once
        // it holds it: an object whose lock is free is a dead producer's (killed outright, so
        // nobody removed it), never read again.
        if shm::is_abandoned(&Path::new(SHM_DIR).join(&session.name)).unwrap_or(false) {
            return Err(stale(
                "its producer is gone (the lock it holds on its arena for its life is free: \
                 killed outright); the object stays until a producer or `capture-arena clean` \
                 removes it"
                    .into(),
            ));
        }
        let (size, _) = shm::fstat(&fd).map_err(|e| Error::io(format!("fstat of {session}"), e))?;
        let want = session.len.saturating_add(HEADER_BYTES);
        if size != want {
            return Err(stale(format!(
                "object is {size} bytes, session says {want} (truncated by another process, or \
                 another arena under the same name)"
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
            lock_check: Mutex::new((Instant::now(), true)),
        })
    }

    /// The parsed session.
    pub fn shm_session(&self) -> &ShmSession {
        &self.session
    }

    /// The data offset (in the mapping) of `[address, address + n)`, checked.
    fn offset_of(&self, address: u64, n: u64) -> Result<usize> {
        let s = &self.session;
        super::offset_in(s.base, s.len, address, n).map(|o| (o + HEADER_BYTES) as usize)
    }
}

impl ShmTransport {
    /// Copies `[off, off + d.len)` of the mapping into device memory (feature `cuda`).
    fn upload(&self, off: usize, d: crate::transport::DeviceSlice) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            let src = self.map.raw_range(off, d.len() as usize)?;
            self.map
                .pin_for_device(d.device(), "the producer's shared memory");
            // SAFETY: `src` is a checked range of this read-only mapping (kept alive by self);
            // the destination is device memory the DeviceSlice's creator vouched for.
            let copied = unsafe {
                crate::memory::cuda::host_to_device(
                    d.device(),
                    d.ptr(),
                    src,
                    d.len(),
                    d.waits_for(),
                )
            };
            // A device copy from pinned pages does not fault on a truncated object: read()
            // reports the mapping lost.
            self.map.notice_shrink(&self.fd);
            copied
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = off;
            Err(Error::InvalidRead {
                key: self.text.clone(),
                reason: format!(
                    "a device destination ({} bytes on GPU {}) needs a build with the cuda \
                     feature",
                    d.len(),
                    d.device()
                ),
            })
        }
    }
}

impl ShmTransport {
    /// The object was truncated under this mapping: the bytes read may be zeros.
    fn truncated(&self) -> Error {
        Error::StaleSession {
            session: self.text.clone(),
            reason: "its shared memory was truncated by another process while this reader \
                     mapped it; the contents are lost"
                .into(),
        }
    }
}

impl Transport for ShmTransport {
    fn session(&self) -> &str {
        &self.text
    }

    fn is_live(&self) -> bool {
        if self.map.lost() {
            return false;
        }
        if !shm::fstat(&self.fd).is_ok_and(|(_, links)| links > 0) {
            return false;
        }
        let mut check = self.lock_check.lock().unwrap_or_else(|p| p.into_inner());
        if check.0.elapsed() >= LOCK_CHECK_EVERY {
            *check = (Instant::now(), !is_gone(&self.session));
        }
        check.1
    }

    fn capacity(&self) -> u64 {
        self.session.len
    }

    fn check(&self, address: u64, len: u64) -> Result<()> {
        self.offset_of(address, len).map(|_| ())
    }

    fn read(&self, reads: &mut [ReadOp<'_>]) -> Result<()> {
        for r in reads.iter() {
            self.offset_of(r.address, r.into.len())?;
        }
        let mut copied = Ok(());
        for r in reads.iter_mut() {
            let off = self.offset_of(r.address, r.into.len())?;
            copied = match &mut r.into {
                Destination::Host(out) => self.map.copy_out(off, out),
                Destination::Device(d) => self.upload(off, *d),
            };
            if copied.is_err() {
                break;
            }
        }
        if self.map.lost() {
            // The object was truncated under this mapping: the bytes read may be zeros.
            return Err(self.truncated());
        }
        copied
    }

    fn mapped(&self, address: u64, len: u64) -> Option<Result<(&Mapping, usize)>> {
        Some(self.offset_of(address, len).map(|o| (&self.map, o)))
    }

    /// Aligned 8-byte loads from the mapping, between two acquire fences: every byte copied
    /// before this call was loaded before the stamps are (the writer zeroes a stamp, then
    /// fences, before it places anything in that space), and every byte copied after it is
    /// loaded after them (the writer stores the stamp after the object's bytes, with release
    /// order). x86 keeps loads in order anyway; aarch64 (GH200) does not.
    fn stamps(&self, at: &[u64]) -> Result<Vec<u64>> {
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        let mut out = Vec::with_capacity(at.len());
        for &a in at {
            let off = self.offset_of(a, STAMP_BYTES)?;
            let p = self.map.raw_range(off, STAMP_BYTES as usize)?;
            if !(p as usize).is_multiple_of(STAMP_BYTES as usize) {
                return Err(Error::InvalidRead {
                    key: self.text.clone(),
                    reason: format!("a stamp at {a:#x} is not 8-byte aligned"),
                });
            }
            // SAFETY: an aligned word inside this mapping (checked), which stays mapped while
            // `self` lives; another process writes it, hence the volatile load of a whole word.
            out.push(u64::from_le(unsafe { (p as *const u64).read_volatile() }));
        }
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        if self.map.lost() {
            return Err(self.truncated());
        }
        Ok(out)
    }

    fn stamps_are_cheap(&self) -> bool {
        true
    }
}
