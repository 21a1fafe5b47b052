//! Host shared memory: one POSIX shared-memory object per arena, mode 0600, named with the owner's
//! pid and a random 128-bit nonce, unlinked when the arena is dropped.
//!
//! Layout of the object: a [`HEADER_BYTES`] header, then the data region.
//!
//! ```text
//! 0       8        12         16        32       40       48       52
//! | magic | version | hdr_len | nonce   | len    | base   | pid    | ... | data (len bytes) |
//! ```
//!
//! The session string names the object and repeats its nonce, length and base address:
//! `shm://capture-arena-<pid>-<nonce hex>?len=<bytes>&base=<hex address>`. A reader opens the
//! object read-only and checks the header against the session: a restarted producer has a new
//! nonce (so a new name), and a result from the old one is refused as stale instead of reading
//! someone else's bytes.

use std::ffi::CString;
use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::memory::Region;
use crate::tensor::TensorData;

const MAGIC: [u8; 8] = *b"CAPARENA";
const VERSION: u32 = 1;
/// Bytes before the data region: one page, so data stays aligned up to 4096.
pub const HEADER_BYTES: u64 = 4096;
/// The prefix of every arena's shared-memory name (`/dev/shm/capture-arena-*`).
pub const NAME_PREFIX: &str = "capture-arena-";

/// The pid in an arena's shared-memory name (`capture-arena-<pid>-<nonce>`), or `None` for
/// any other name.
pub fn owner_pid(name: &str) -> Option<u32> {
    let (pid, nonce) = name.strip_prefix(NAME_PREFIX)?.split_once('-')?;
    (nonce.len() == 32 && nonce.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| pid.parse().ok())
        .flatten()
}

/// True when no producer holds the arena object at `path`: its creator keeps a shared `flock` on
/// it for the arena's whole life, so an exclusive lock succeeds only once that process is gone.
/// This works across PID namespaces, unlike the pid in the name.
///
/// # Errors
/// If the object cannot be opened.
pub fn is_abandoned(path: &std::path::Path) -> io::Result<bool> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)?;
    // SAFETY: plain FFI on a descriptor `f` owns; the lock goes with it when `f` closes.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.kind() == io::ErrorKind::WouldBlock {
        Ok(false)
    } else {
        Err(e)
    }
}

/// Removes the shared-memory object of `session` by name, for a process that is about to exit
/// without running its destructors (a signal handler): the memory goes back once the last
/// mapping closes. Readers that open the session afterwards get a stale-session error.
///
/// # Errors
/// [`Error::Io`] if the object cannot be removed (already gone, not ours).
pub fn remove(session: &ShmSession) -> Result<()> {
    let name = CString::new(format!("/{}", session.name)).map_err(|_| Error::InvalidSession {
        session: session.to_string(),
        reason: "name contains NUL".into(),
    })?;
    // SAFETY: plain FFI on a NUL-terminated name.
    if unsafe { libc::shm_unlink(name.as_ptr()) } != 0 {
        return Err(Error::io(
            format!("removing /dev/shm/{}", session.name),
            io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// A parsed shared-memory session string.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ShmSession {
    /// The POSIX shm name without the leading `/`: `capture-arena-<pid>-<nonce hex>`.
    pub name: String,
    /// The per-arena nonce, also the last part of the name.
    pub nonce: u128,
    /// Data bytes.
    pub len: u64,
    /// Address of data offset 0 (the producer's virtual address of the mapping's data).
    pub base: u64,
}

impl fmt::Display for ShmSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "shm://{}?len={}&base={:#x}",
            self.name, self.len, self.base
        )
    }
}

impl FromStr for ShmSession {
    type Err = Error;
    fn from_str(s: &str) -> Result<ShmSession> {
        let bad = |why: &str| Error::InvalidSession {
            session: s.to_owned(),
            reason: format!(
                "{why}; expected shm://{NAME_PREFIX}<pid>-<nonce>?len=<bytes>&base=<hex>"
            ),
        };
        let rest = s
            .strip_prefix("shm://")
            .ok_or_else(|| bad("no shm:// prefix"))?;
        let (name, query) = rest.split_once('?').ok_or_else(|| bad("no ?len=&base="))?;
        let nonce_hex = name
            .strip_prefix(NAME_PREFIX)
            .and_then(|n| n.rsplit_once('-'))
            .map(|(_, nonce)| nonce)
            .filter(|n| n.len() == 32)
            .ok_or_else(|| bad("bad name"))?;
        let nonce = u128::from_str_radix(nonce_hex, 16).map_err(|_| bad("bad nonce"))?;
        let (mut len, mut base) = (None, None);
        for kv in query.split('&') {
            match kv.split_once('=') {
                Some(("len", v)) => len = v.parse::<u64>().ok(),
                Some(("base", v)) => {
                    base = v
                        .strip_prefix("0x")
                        .and_then(|h| u64::from_str_radix(h, 16).ok())
                }
                _ => return Err(bad("unknown parameter")),
            }
        }
        Ok(ShmSession {
            name: name.to_owned(),
            nonce,
            len: len.ok_or_else(|| bad("bad len"))?,
            base: base.ok_or_else(|| bad("bad base"))?,
        })
    }
}

/// A read-write mapping of a shm object (the producer's).
#[derive(Debug)]
struct Mapping {
    ptr: *mut u8,
    bytes: usize,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/bytes are exactly what mmap returned and nothing uses the mapping after
        // drop (all views borrow the owner).
        unsafe { libc::munmap(self.ptr.cast(), self.bytes) };
    }
}

/// The producer's shared-memory region. Created with `O_EXCL` (a name is never reused), filled
/// by the writer, unlinked on drop.
#[derive(Debug)]
pub struct ShmRegion {
    map: Mapping,
    len: u64,
    session: String,
    shm_name: CString,
    /// Holds the shared `flock` that marks the object as in use (see [`is_abandoned`]).
    _lock: OwnedFd,
}

// SAFETY: the mapping is plain memory owned by this value; moving it to another thread moves the
// only handle through which this process writes it.
unsafe impl Send for ShmRegion {}

fn random_nonce() -> Result<u128> {
    let mut buf = [0u8; 16];
    let mut got = 0;
    while got < buf.len() {
        // SAFETY: writes at most buf.len() - got bytes into the tail of buf.
        let n = unsafe { libc::getrandom(buf[got..].as_mut_ptr().cast(), buf.len() - got, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::io("getrandom for the arena nonce", e));
        }
        got += n as usize;
    }
    Ok(u128::from_le_bytes(buf))
}

fn shm_free_bytes() -> Option<u64> {
    let path = CString::new("/dev/shm").ok()?;
    // SAFETY: statvfs fills the zeroed struct; path is NUL-terminated.
    unsafe {
        let mut s: libc::statvfs = std::mem::zeroed();
        (libc::statvfs(path.as_ptr(), &mut s) == 0).then(|| s.f_bavail as u64 * s.f_frsize as u64)
    }
}

impl ShmRegion {
    /// Creates, reserves and maps a region of `len` data bytes. The memory is reserved in full
    /// (`fallocate`) and pre-faulted, so a full `/dev/shm` fails here with a clear error rather
    /// than as a `SIGBUS` in the middle of a copy later.
    ///
    /// # Errors
    /// [`Error::Io`] if the object cannot be created, reserved or mapped.
    pub fn create(len: u64) -> Result<ShmRegion> {
        let nonce = random_nonce()?;
        let name = format!("{NAME_PREFIX}{}-{nonce:032x}", std::process::id());
        let shm_name = CString::new(format!("/{name}")).expect("no NUL in a formatted name");
        let total = len
            .checked_add(HEADER_BYTES)
            .and_then(|t| usize::try_from(t).ok())
            .ok_or_else(|| {
                Error::config(
                    "SGLANG_SPEC_CAPTURE_ARENA_BYTES",
                    format!("{len} bytes is too large"),
                )
            })?;
        // SAFETY: plain FFI; shm_name is NUL-terminated.
        let raw = unsafe {
            libc::shm_open(
                shm_name.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
                0o600,
            )
        };
        if raw < 0 {
            return Err(Error::io(
                format!("shm_open /dev/shm/{name}"),
                io::Error::last_os_error(),
            ));
        }
        // SAFETY: shm_open returned a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let unlink = || {
            // SAFETY: plain FFI on our own NUL-terminated name.
            unsafe { libc::shm_unlink(shm_name.as_ptr()) };
        };
        // A shared lock held for the arena's life says "in use" to `capture-arena clean`, also
        // across PID namespaces (where the pid in the name means nothing).
        // SAFETY: plain FFI on our descriptor.
        unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_SH) };
        // SAFETY: plain FFI on our descriptor.
        let rc = unsafe { libc::posix_fallocate(fd.as_raw_fd(), 0, total as libc::off_t) };
        if rc != 0 {
            unlink();
            let free = shm_free_bytes().map_or("unknown".to_owned(), |f| f.to_string());
            return Err(Error::io(
                format!(
                    "reserving {total} bytes of shared memory in /dev/shm ({free} bytes free); \
                     lower SGLANG_SPEC_CAPTURE_ARENA_BYTES or enlarge /dev/shm (docker --shm-size)"
                ),
                io::Error::from_raw_os_error(rc),
            ));
        }
        // SAFETY: a fresh shared mapping of the whole object; the kernel picks the address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            let e = io::Error::last_os_error();
            unlink();
            return Err(Error::io(
                format!("mmap of {total} bytes of /dev/shm/{name}"),
                e,
            ));
        }
        let map = Mapping {
            ptr: ptr.cast(),
            bytes: total,
        };
        let base = map.ptr as u64 + HEADER_BYTES;
        let mut header = [0u8; 52];
        header[0..8].copy_from_slice(&MAGIC);
        header[8..12].copy_from_slice(&VERSION.to_le_bytes());
        header[12..16].copy_from_slice(&(HEADER_BYTES as u32).to_le_bytes());
        header[16..32].copy_from_slice(&nonce.to_le_bytes());
        header[32..40].copy_from_slice(&len.to_le_bytes());
        header[40..48].copy_from_slice(&base.to_le_bytes());
        header[48..52].copy_from_slice(&std::process::id().to_le_bytes());
        // SAFETY: the mapping is at least HEADER_BYTES > 52 bytes long and writable.
        unsafe { std::ptr::copy_nonoverlapping(header.as_ptr(), map.ptr, header.len()) };
        let session = ShmSession {
            name,
            nonce,
            len,
            base,
        }
        .to_string();
        tracing::debug!(%session, "created shared-memory region");
        Ok(ShmRegion {
            map,
            len,
            session,
            shm_name,
            _lock: fd,
        })
    }
}

impl Drop for ShmRegion {
    fn drop(&mut self) {
        // SAFETY: plain FFI on our own NUL-terminated name. Readers that still map it keep their
        // mapping; new opens fail, which they report as a stale session.
        unsafe { libc::shm_unlink(self.shm_name.as_ptr()) };
    }
}

/// `(size, link count)` of an open descriptor.
fn fstat(fd: &OwnedFd) -> io::Result<(u64, u64)> {
    // SAFETY: fstat fills a zeroed stat struct for a descriptor we own.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd.as_raw_fd(), &mut st) != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok((st.st_size as u64, st.st_nlink as u64))
    }
}

fn check_range(offset: u64, n: u64, base: u64, len: u64) -> Result<usize> {
    match offset.checked_add(n) {
        Some(end) if end <= len => Ok(offset as usize),
        _ => Err(Error::OutOfRange {
            address: base.wrapping_add(offset),
            len: n,
            base,
            region_len: len,
        }),
    }
}

impl Region for ShmRegion {
    fn len(&self) -> u64 {
        self.len
    }

    fn base_address(&self) -> u64 {
        self.map.ptr as u64 + HEADER_BYTES
    }

    fn session(&self) -> &str {
        &self.session
    }

    fn write(&mut self, offset: u64, data: &TensorData) -> Result<()> {
        match data {
            TensorData::Host(b) => {
                let src: &[u8] = (**b).as_ref();
                let at = check_range(offset, src.len() as u64, self.base_address(), self.len)?;
                // SAFETY: [HEADER + at, HEADER + at + src.len()) lies inside the mapping (checked
                // above); the source is a separate buffer owned by the caller, so they do not
                // overlap; only this thread writes the mapping.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.as_ptr(),
                        self.map.ptr.add(HEADER_BYTES as usize + at),
                        src.len(),
                    )
                };
                Ok(())
            }
        }
    }
}

/// A reader's read-only mapping of a producer's region, checked against its session.
#[derive(Debug)]
pub struct ShmView {
    ptr: *const u8,
    bytes: usize,
    session: ShmSession,
    /// Kept open to tell whether the producer has removed the object (`st_nlink == 0`).
    fd: OwnedFd,
}

// SAFETY: the mapping is read-only for this process and lives until drop; sharing the pointer
// across threads only shares reads.
unsafe impl Send for ShmView {}
// SAFETY: as above; no method mutates through the pointer.
unsafe impl Sync for ShmView {}

impl Drop for ShmView {
    fn drop(&mut self) {
        // SAFETY: ptr/bytes are exactly what mmap returned; borrows of it end before drop.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.bytes) };
    }
}

impl ShmView {
    /// Maps the region a session names, read-only, and checks that it is the same arena: magic,
    /// nonce, length and base address must all match the session.
    ///
    /// # Errors
    /// [`Error::StaleSession`] when the object no longer exists or its header does not match;
    /// [`Error::Io`] if mapping fails.
    pub fn open(session: &ShmSession) -> Result<ShmView> {
        let stale = |reason: String| Error::StaleSession {
            session: session.to_string(),
            reason,
        };
        let cname = CString::new(format!("/{}", session.name))
            .map_err(|_| stale("name contains NUL".into()))?;
        // SAFETY: plain FFI on a NUL-terminated name.
        let raw = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC, 0) };
        if raw < 0 {
            return Err(stale(format!(
                "cannot open /dev/shm/{} ({})",
                session.name,
                io::Error::last_os_error()
            )));
        }
        // SAFETY: shm_open returned a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let (size, _) = fstat(&fd).map_err(|e| Error::io(format!("fstat of {session}"), e))?;
        let want = session.len.saturating_add(HEADER_BYTES);
        if size != want {
            return Err(stale(format!(
                "object is {size} bytes, session says {want}"
            )));
        }
        // SAFETY: a fresh read-only shared mapping of the whole object.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                want as usize,
                libc::PROT_READ,
                // Populate the page tables now (the pages exist: the producer reserved them), so
                // reads run at memcpy speed instead of taking a fault every few pages.
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::io(
                format!("mmap of {}", session),
                io::Error::last_os_error(),
            ));
        }
        let view = ShmView {
            ptr: ptr as *const u8,
            bytes: want as usize,
            session: session.clone(),
            fd,
        };
        let mut h = [0u8; 52];
        // SAFETY: the mapping is at least HEADER_BYTES long.
        unsafe { std::ptr::copy_nonoverlapping(view.ptr, h.as_mut_ptr(), h.len()) };
        let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
        if h[0..8] != MAGIC
            || u32::from_le_bytes(h[8..12].try_into().expect("4 bytes")) != VERSION
            || u128::from_le_bytes(h[16..32].try_into().expect("16 bytes")) != session.nonce
            || u64_at(32) != session.len
            || u64_at(40) != session.base
        {
            return Err(stale("header does not match (different arena)".into()));
        }
        Ok(view)
    }

    /// The session this view was opened with.
    pub fn session(&self) -> &ShmSession {
        &self.session
    }

    /// True while the producer's object still exists. Once the producer has exited (or
    /// restarted) the object is unlinked: this mapping still holds the old pages, but nothing
    /// published from now on lands in them, so readers must treat the session as stale.
    pub fn is_live(&self) -> bool {
        fstat(&self.fd).is_ok_and(|(_, links)| links > 0)
    }

    /// Converts an address and length into a checked offset.
    ///
    /// # Errors
    /// If `[address, address + n)` is not inside `[base, base + len)`.
    pub fn offset_of(&self, address: u64, n: u64) -> Result<u64> {
        let s = &self.session;
        address
            .checked_sub(s.base)
            .filter(|&o| o.checked_add(n).is_some_and(|e| e <= s.len))
            .ok_or(Error::OutOfRange {
                address,
                len: n,
                base: s.base,
                region_len: s.len,
            })
    }

    /// Copies `out.len()` bytes at `address` into `out`.
    ///
    /// # Errors
    /// If the range is outside the region.
    pub fn read(&self, address: u64, out: &mut [u8]) -> Result<()> {
        let off = self.offset_of(address, out.len() as u64)?;
        // SAFETY: the range lies inside this read-only mapping (checked), which lives as long as
        // &self; `out` is a distinct buffer of this process, so they do not overlap. The bytes
        // are what was published while the object is resident; after it is freed or replaced the
        // producer (another process) may overwrite them, and this copy then returns whatever
        // bytes are there: the caller's bookkeeping (Store) prevents reads after release.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.add(HEADER_BYTES as usize + off as usize),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    /// Borrows `n` bytes at `address` without copying.
    ///
    /// The slice stays mapped as long as the view. Its bytes are what was published only while
    /// the object is resident: once it is freed (or replaced by a retry with `replace`), the
    /// producer process may write new objects there, and a slice still held then sees them
    /// change. Drop views before releasing their sample.
    ///
    /// # Errors
    /// If the range is outside the region.
    pub fn view(&self, address: u64, n: u64) -> Result<&[u8]> {
        let off = self.offset_of(address, n)?;
        // SAFETY: the range lies inside the read-only mapping (checked), which lives as long as
        // &self, so the pointer stays valid for the slice's lifetime. Another process may write
        // the pages after the object is freed (see the method docs); this process never does.
        Ok(unsafe {
            std::slice::from_raw_parts(
                self.ptr.add(HEADER_BYTES as usize + off as usize),
                n as usize,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_write_open_read() {
        let mut r = ShmRegion::create(1 << 20).unwrap();
        let s: ShmSession = r.session().parse().unwrap();
        assert_eq!(s.to_string(), r.session());
        assert_eq!(s.base, r.base_address());
        let path = format!("/dev/shm/{}", s.name);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        r.write(4096, &TensorData::host(vec![7u8; 100])).unwrap();
        assert!(r
            .write((1 << 20) - 99, &TensorData::host(vec![7u8; 100]))
            .is_err());
        let v = ShmView::open(&s).unwrap();
        let mut out = [0u8; 100];
        v.read(s.base + 4096, &mut out).unwrap();
        assert_eq!(out, [7u8; 100]);
        assert_eq!(v.view(s.base + 4096, 3).unwrap(), &[7, 7, 7]);
        assert!(v.read(s.base - 1, &mut out).is_err());
        assert!(v.view(s.base + (1 << 20) - 2, 3).is_err());
        assert!(v.view(u64::MAX, 3).is_err());
        // A session with another nonce (a restarted producer) is refused.
        let other = ShmSession {
            nonce: s.nonce ^ 1,
            ..s.clone()
        };
        assert!(ShmView::open(&other).is_err());
        drop(r);
        assert!(!std::path::Path::new(&path).exists(), "unlinked on drop");
        assert!(ShmView::open(&s)
            .unwrap_err()
            .to_string()
            .contains("stale session"));
    }

    #[test]
    fn a_live_region_is_not_abandoned_and_a_dropped_one_is_gone() {
        let r = ShmRegion::create(1 << 16).unwrap();
        let s: ShmSession = r.session().parse().unwrap();
        let path = std::path::Path::new("/dev/shm").join(&s.name);
        assert!(!is_abandoned(&path).unwrap(), "its creator holds the lock");
        // A reader's open (no lock) does not make it look abandoned or in use.
        let _v = ShmView::open(&s).unwrap();
        assert!(!is_abandoned(&path).unwrap());
        drop(r);
        assert!(is_abandoned(&path).is_err(), "unlinked");
    }

    #[test]
    fn owner_pids() {
        assert_eq!(
            owner_pid("capture-arena-42-000000000000000000000000000000ff"),
            Some(42)
        );
        assert_eq!(owner_pid("capture-arena-42-00ff"), None);
        assert_eq!(
            owner_pid("capture-arena-x-000000000000000000000000000000ff"),
            None
        );
        assert_eq!(owner_pid("other-42-000000000000000000000000000000ff"), None);
    }

    #[test]
    fn sessions_parse_strictly() {
        for bad in [
            "tcp://x",
            "shm://capture-arena-1-00?len=1&base=0x0",
            "shm://capture-arena-1-0000000000000000000000000000000g?len=1&base=0x0",
            "shm://capture-arena-1-00000000000000000000000000000000?len=1",
            "shm://capture-arena-1-00000000000000000000000000000000?len=1&base=12&x=1",
        ] {
            assert!(bad.parse::<ShmSession>().is_err(), "{bad}");
        }
        let ok = "shm://capture-arena-1-000000000000000000000000000000ff?len=1&base=0x1000";
        let s: ShmSession = ok.parse().unwrap();
        assert_eq!((s.nonce, s.len, s.base), (255, 1, 4096));
    }
}
