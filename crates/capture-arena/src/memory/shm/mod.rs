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
//!
//! **Liveness.** The creator holds a shared `flock` on the object for the arena's whole life.
//! An exclusive lock succeeds only once that process is gone ([`is_abandoned`]), which works
//! across PID namespaces. `fork`ed children do not keep the lock (their copy of the descriptor
//! is pointed at `/dev/null` in the child) nor the mapping (`MADV_DONTFORK`), so a dead
//! producer's arena is recognised as abandoned even while its children live on. Every new
//! region first removes the abandoned arenas of producers killed outright
//! ([`remove_abandoned`], in `sweep`), so crashes never accumulate in `/dev/shm`.

use std::ffi::CString;
use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::str::FromStr;

mod sweep;

pub use sweep::{is_abandoned, owner_pid, remove_abandoned, Swept, SweptOutcome};

use crate::error::{Error, Result};
use crate::memory::host::SliceCopier;
pub(crate) use crate::memory::mapping::fstat;
use crate::memory::mapping::{Access, Mapping};
use crate::memory::{CopyOp, Progress, Region, Reply};

const MAGIC: [u8; 8] = *b"CAPARENA";
const VERSION: u32 = 1;
/// Bytes before the data region, part of the format (a reader on any host finds the data
/// there): the smallest page, so data stays aligned up to [`crate::config::MAX_ALIGNMENT`]
/// whatever the host's page size. Every mapping starts at offset 0 of the object, so a 64 KiB
/// page size (Grace) needs no offset in the file to be page-aligned.
pub const HEADER_BYTES: u64 = crate::page::MIN_PAGE as u64;
/// Bytes of the header that carry fields.
const HEADER_FIELDS: usize = 52;
/// The prefix of every arena's shared-memory name (`/dev/shm/capture-arena-*`).
pub const NAME_PREFIX: &str = "capture-arena-";
/// Where POSIX shared-memory objects live.
pub const SHM_DIR: &str = "/dev/shm";
/// Removes the shared-memory object of `session` by name, for a process that is about to exit
/// without running its destructors (a signal handler): the memory goes back once the last
/// mapping closes. Readers that open the session afterwards get a stale-session error.
///
/// # Errors
/// [`Error::Io`] if the object cannot be removed (already gone, not ours).
pub fn remove(session: &ShmSession) -> Result<()> {
    let name = c_name(&session.name)?;
    // SAFETY: plain FFI on a NUL-terminated name.
    if unsafe { libc::shm_unlink(name.as_ptr()) } != 0 {
        return Err(Error::io(
            format!("removing {SHM_DIR}/{}", session.name),
            io::Error::last_os_error(),
        ));
    }
    Ok(())
}

fn c_name(name: &str) -> Result<CString> {
    CString::new(format!("/{name}")).map_err(|_| Error::InvalidSession {
        session: name.escape_debug().to_string(),
        reason: "name contains NUL".into(),
    })
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

/// The longest session string accepted (a real one is under 120 bytes).
pub const MAX_SHM_SESSION_BYTES: usize = 512;

impl FromStr for ShmSession {
    type Err = Error;
    fn from_str(s: &str) -> Result<ShmSession> {
        let bad = |why: &str| Error::InvalidSession {
            session: s.chars().take(MAX_SHM_SESSION_BYTES).collect(),
            reason: format!(
                "{why}; expected shm://{NAME_PREFIX}<pid>-<nonce>?len=<bytes>&base=<hex>"
            ),
        };
        if s.len() > MAX_SHM_SESSION_BYTES {
            return Err(bad("too long"));
        }
        let rest = s
            .strip_prefix("shm://")
            .ok_or_else(|| bad("no shm:// prefix"))?;
        let (name, query) = rest.split_once('?').ok_or_else(|| bad("no ?len=&base="))?;
        if owner_pid(name).is_none() {
            return Err(bad("bad name"));
        }
        let nonce_hex = name.rsplit_once('-').map_or("", |(_, n)| n);
        let nonce = u128::from_str_radix(nonce_hex, 16).map_err(|_| bad("bad nonce"))?;
        let (mut len, mut base) = (None, None);
        for kv in query.split('&') {
            match kv.split_once('=') {
                Some(("len", v)) if len.is_none() => {
                    len = Some(v.parse::<u64>().map_err(|_| bad("bad len"))?)
                }
                Some(("base", v)) if base.is_none() => {
                    base = Some(
                        v.strip_prefix("0x")
                            .and_then(|h| u64::from_str_radix(h, 16).ok())
                            .ok_or_else(|| bad("bad base"))?,
                    )
                }
                _ => return Err(bad("unknown or repeated parameter")),
            }
        }
        let (len, base) = (
            len.ok_or_else(|| bad("no len"))?,
            base.ok_or_else(|| bad("no base"))?,
        );
        if len == 0 || base.checked_add(len).is_none() {
            return Err(bad("len and base do not describe a range of memory"));
        }
        let parsed = ShmSession {
            name: name.to_owned(),
            nonce,
            len,
            base,
        };
        // One arena, one string: readers cache and remember sessions by their string.
        if parsed.to_string() != s {
            return Err(bad("not in canonical form"));
        }
        Ok(parsed)
    }
}

/// The fixed header fields of an arena object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub nonce: u128,
    pub len: u64,
    pub base: u64,
    pub pid: u32,
}

impl Header {
    fn encode(&self) -> [u8; HEADER_FIELDS] {
        let mut h = [0u8; HEADER_FIELDS];
        h[0..8].copy_from_slice(&MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&(HEADER_BYTES as u32).to_le_bytes());
        h[16..32].copy_from_slice(&self.nonce.to_le_bytes());
        h[32..40].copy_from_slice(&self.len.to_le_bytes());
        h[40..48].copy_from_slice(&self.base.to_le_bytes());
        h[48..52].copy_from_slice(&self.pid.to_le_bytes());
        h
    }

    /// Reads the header of a mapped object; `None` if it is not an arena header of this version.
    pub(crate) fn read(m: &Mapping) -> Option<Header> {
        let mut h = [0u8; HEADER_FIELDS];
        m.copy_out(0, &mut h).ok()?;
        let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&h[i..i + 8]);
            u64::from_le_bytes(b)
        };
        let mut n = [0u8; 16];
        n.copy_from_slice(&h[16..32]);
        (h[0..8] == MAGIC && u32_at(8) == VERSION && u64::from(u32_at(12)) == HEADER_BYTES).then(
            || Header {
                nonce: u128::from_le_bytes(n),
                len: u64_at(32),
                base: u64_at(40),
                pid: u32_at(48),
            },
        )
    }
}

/// Opens a shared-memory object by name: a regular file only. `/dev/shm` is writable by every
/// user, so anyone can put a FIFO under an arena's name; opening one without `O_NONBLOCK` would
/// wait for a writer for good (`O_NONBLOCK` changes nothing for a regular file).
///
/// # Errors
/// The open's own error, or [`io::ErrorKind::InvalidInput`] for anything but a regular file.
pub(crate) fn open(name: &str, flags: libc::c_int, mode: libc::mode_t) -> io::Result<OwnedFd> {
    let cname = CString::new(format!("/{name}"))
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "name contains NUL"))?;
    // SAFETY: plain FFI on a NUL-terminated name.
    let raw = unsafe {
        libc::shm_open(
            cname.as_ptr(),
            flags | libc::O_CLOEXEC | libc::O_NONBLOCK,
            mode,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: shm_open returned a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    regular(&fd)?;
    Ok(fd)
}

/// Refuses anything but a regular file (a FIFO, a socket) under an arena's name.
///
/// # Errors
/// [`io::ErrorKind::InvalidInput`] naming the file's type, or fstat's own error.
pub(crate) fn regular(fd: &impl AsRawFd) -> io::Result<()> {
    // SAFETY: fstat fills a zeroed stat struct for a descriptor the caller holds open.
    let st = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd.as_raw_fd(), &mut st) != 0 {
            return Err(io::Error::last_os_error());
        }
        st
    };
    let kind = st.st_mode & libc::S_IFMT;
    if kind == libc::S_IFREG {
        return Ok(());
    }
    let what = match kind {
        libc::S_IFIFO => "a FIFO",
        libc::S_IFSOCK => "a socket",
        libc::S_IFDIR => "a directory",
        libc::S_IFCHR | libc::S_IFBLK => "a device",
        _ => "not a regular file",
    };
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{what}, not an arena (a producer creates a regular file)"),
    ))
}

/// Who owns a shared-memory object and its permission bits: `(uid, mode & 0o777)`.
pub(crate) fn owner_mode(fd: &OwnedFd) -> io::Result<(u32, u32)> {
    // SAFETY: fstat fills a zeroed stat struct for a descriptor we own.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd.as_raw_fd(), &mut st) != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok((st.st_uid, st.st_mode & 0o777))
    }
}

/// Why a reader must not map an object it opened: owned by another user than this process's
/// effective one, or open to other users (a producer creates its arena `0600`; anything else
/// was not made by one).
pub(crate) fn foreign(fd: &OwnedFd) -> Option<String> {
    let (uid, mode) = match owner_mode(fd) {
        Ok(v) => v,
        Err(e) => return Some(format!("cannot stat it ({e})")),
    };
    // SAFETY: geteuid cannot fail.
    let me = unsafe { libc::geteuid() };
    if uid != me {
        Some(format!(
            "it is owned by uid {uid}, not this process's uid {me}: trainers run as the \
             producer's user"
        ))
    } else if mode & 0o077 != 0 {
        Some(format!(
            "its mode is {mode:o}, open to other users; a producer creates 600"
        ))
    } else {
        None
    }
}

/// The producer's shared-memory region. Created with `O_EXCL` (a name is never reused), filled
/// by the writer, unlinked on drop.
#[derive(Debug)]
pub struct ShmRegion {
    map: Mapping,
    len: u64,
    session: String,
    name: String,
    /// Holds the shared `flock` that marks the object as in use (see [`is_abandoned`]).
    lock: OwnedFd,
    /// The process that created it: only that one removes it.
    pid: u32,
    /// The batch in flight.
    copier: SliceCopier,
}

fn shm_free_bytes() -> Option<u64> {
    let path = CString::new(SHM_DIR).ok()?;
    // SAFETY: statvfs fills the zeroed struct; path is NUL-terminated.
    unsafe {
        let mut s: libc::statvfs = std::mem::zeroed();
        (libc::statvfs(path.as_ptr(), &mut s) == 0).then(|| s.f_bavail as u64 * s.f_frsize as u64)
    }
}

/// Removes the arenas of dead producers, logging what it did; never fails (a producer must start
/// even if someone else's leftovers cannot be removed).
fn sweep_before_create() {
    match remove_abandoned(Path::new(SHM_DIR), false) {
        Ok(seen) => {
            for s in seen {
                match s.outcome {
                    SweptOutcome::Removed => tracing::info!(
                        name = %s.name,
                        bytes = s.bytes,
                        pid = s.pid,
                        "removed the arena of a producer that is gone"
                    ),
                    SweptOutcome::Failed(why) => {
                        tracing::debug!(name = %s.name, %why, "left an arena object alone")
                    }
                    SweptOutcome::InUse => {}
                }
            }
        }
        Err(e) => tracing::debug!(error = %e, "could not look for abandoned arenas"),
    }
}

impl ShmRegion {
    /// Creates, reserves and maps a region of `len` data bytes, after removing the arenas of
    /// producers that died without removing theirs. The memory is reserved in full
    /// (`fallocate`) and pre-faulted, so a full `/dev/shm` fails here with a clear error rather
    /// than as a `SIGBUS` in the middle of a copy later. This takes about half a second per GiB.
    ///
    /// # Errors
    /// [`Error::Io`] if the object cannot be created, locked, reserved or mapped;
    /// [`Error::Config`] for a size that cannot be mapped.
    pub fn create(len: u64) -> Result<ShmRegion> {
        sweep_before_create();
        let total = len
            .checked_add(HEADER_BYTES)
            .and_then(|t| usize::try_from(t).ok())
            .filter(|&t| libc::off_t::try_from(t).is_ok())
            .ok_or_else(|| {
                Error::config(
                    "SGLANG_SPEC_CAPTURE_ARENA_BYTES",
                    format!("{len} bytes is too large"),
                )
            })?;
        let nonce = crate::random::nonce()?;
        let pid = std::process::id();
        let name = format!("{NAME_PREFIX}{pid}-{nonce:032x}");
        let fd = open(&name, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600)
            .map_err(|e| Error::io(format!("shm_open {SHM_DIR}/{name}"), e))?;
        // From here on, any failure removes the object again.
        let unlink = |e: Error| {
            if let Ok(c) = c_name(&name) {
                // SAFETY: plain FFI on our own NUL-terminated name.
                unsafe { libc::shm_unlink(c.as_ptr()) };
            }
            e
        };
        // A shared lock held for the arena's life says "in use" to `remove_abandoned`.
        // Blocking: another producer's sweep may hold an exclusive lock on it for an instant.
        loop {
            // SAFETY: plain FFI on our descriptor.
            if unsafe { libc::flock(fd.as_raw_fd(), libc::LOCK_SH) } == 0 {
                break;
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(unlink(Error::io(
                    format!("locking {SHM_DIR}/{name} (flock)"),
                    e,
                )));
            }
        }
        fork_guard::register(fd.as_raw_fd());
        // SAFETY: plain FFI on our descriptor.
        let rc = unsafe { libc::posix_fallocate(fd.as_raw_fd(), 0, total as libc::off_t) };
        if rc != 0 {
            fork_guard::unregister(fd.as_raw_fd());
            let free = shm_free_bytes().map_or("unknown".to_owned(), |f| f.to_string());
            return Err(unlink(Error::io(
                format!(
                    "reserving {total} bytes of shared memory in {SHM_DIR} ({free} bytes free); \
                     lower SGLANG_SPEC_CAPTURE_ARENA_BYTES or enlarge {SHM_DIR} (docker --shm-size)"
                ),
                io::Error::from_raw_os_error(rc),
            )));
        }
        let mut map = match Mapping::map(
            fd.as_fd(),
            total,
            Access::ReadWrite,
            true,
            &format!("{SHM_DIR}/{name}"),
        ) {
            Ok(m) => m,
            Err(e) => {
                fork_guard::unregister(fd.as_raw_fd());
                return Err(unlink(e));
            }
        };
        let base = map.address() + HEADER_BYTES;
        let header = Header {
            nonce,
            len,
            base,
            pid,
        }
        .encode();
        // SAFETY: a local array, unchanged during the call, outside the mapping.
        if let Err(e) = unsafe { map.copy_in(0, header.as_ptr(), header.len()) } {
            fork_guard::unregister(fd.as_raw_fd());
            return Err(unlink(e));
        }
        let session = ShmSession {
            name: name.clone(),
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
            name,
            lock: fd,
            pid,
            copier: SliceCopier::default(),
        })
    }

    /// The object's name in `/dev/shm`.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn copy_one(&mut self, op: &CopyOp<'_>, from: u64, n: u64) -> Result<()> {
        self.lost()?;
        let at = op
            .offset
            .checked_add(from)
            .filter(|&o| o.checked_add(n).is_some_and(|e| e <= self.len))
            .ok_or(Error::OutOfRange {
                address: self.base_address().wrapping_add(op.offset),
                len: n,
                base: self.base_address(),
                region_len: self.len,
            })?;
        let dst = self
            .map
            .raw_range((HEADER_BYTES + at) as usize, n as usize)?;
        #[cfg(feature = "cuda")]
        let device = match op.data {
            crate::tensor::TensorData::Device(d) => {
                self.map
                    .pin_for_device(d.device, "the arena's shared memory");
                true
            }
            _ => false,
        };
        // SAFETY: `dst` is a checked range of this writable mapping, which only the writer
        // thread writes (`&mut self`); caller memory is never inside this process's own arena
        // mapping, so it does not overlap the source.
        unsafe { super::host::copy_to_host(op, from, n, dst) }?;
        #[cfg(feature = "cuda")]
        if device {
            // A device copy into pinned pages does not fault on a truncated object.
            self.map.notice_shrink(&self.lock);
        }
        self.lost()
    }

    /// Fails once the object was truncated under the arena: the batch being copied, and every
    /// later one (the arena's contents are gone; only a restart brings a good one back).
    fn lost(&self) -> Result<()> {
        if !self.map.lost() {
            return Ok(());
        }
        self.map.check_lost(&format!(
            "writing the arena's shared memory /dev/shm/{} (restart the producer: every batch \
             fails until then)",
            self.name
        ))
    }
}

impl Drop for ShmRegion {
    fn drop(&mut self) {
        fork_guard::unregister(self.lock.as_raw_fd());
        if std::process::id() != self.pid {
            return; // a forked child: the object is its parent's
        }
        if let Ok(c) = c_name(&self.name) {
            // SAFETY: plain FFI on our own NUL-terminated name. Readers that still map it keep
            // their mapping; new opens fail, which they report as a stale session.
            unsafe { libc::shm_unlink(c.as_ptr()) };
        }
    }
}

impl Region for ShmRegion {
    fn len(&self) -> u64 {
        self.len
    }

    fn base_address(&self) -> u64 {
        self.map.address() + HEADER_BYTES
    }

    fn session(&self) -> &str {
        &self.session
    }

    unsafe fn start(&mut self, ops: &[CopyOp<'_>]) -> Result<()> {
        self.copier.start(self.base_address(), self.len, ops)
    }

    fn progress(&mut self, ops: &[CopyOp<'_>], budget: u64) -> Result<Progress> {
        let mut copier = std::mem::take(&mut self.copier);
        let r = copier.progress(ops, budget, |op, from, n| self.copy_one(op, from, n));
        self.copier = copier;
        r
    }

    fn abandon(&mut self) {
        self.copier.abandon();
    }

    fn clear(&mut self, offset: u64, len: u64) {
        if !super::clear_in_range(offset, len, self.len) {
            return;
        }
        match self
            .map
            .raw_range((HEADER_BYTES + offset) as usize, len as usize)
        {
            // SAFETY: a checked range of this writable mapping, written by the writer thread
            // only (`&mut self`). A truncated object faults into the guard's zero pages.
            Ok(dst) => unsafe { super::host::clear_host(dst, len) },
            Err(e) => tracing::error!(error = %e, "clearing a stamp"),
        }
    }

    fn set_word(&mut self, offset: u64, word: u64) {
        if !offset.is_multiple_of(8) || !super::clear_in_range(offset, 8, self.len) {
            tracing::error!(offset, "a stamp word outside the arena or not aligned");
            return;
        }
        match self.map.raw_range((HEADER_BYTES + offset) as usize, 8) {
            // SAFETY: a checked, aligned word of this writable mapping (the header keeps the
            // region's offsets 8-byte aligned), written by the writer thread only.
            Ok(dst) => unsafe { super::host::store_word(dst, word) },
            Err(e) => tracing::error!(error = %e, "writing a stamp word"),
        }
    }

    /// `"fd"`: a read-only descriptor of the object; `"describe"`: the session as JSON.
    fn reply(&self, what: &str) -> Option<Result<Reply>> {
        match what {
            "fd" => Some(
                open(&self.name, libc::O_RDONLY, 0)
                    .map(|fd| Reply {
                        bytes: self.session.clone().into_bytes(),
                        fds: vec![fd],
                    })
                    .map_err(|e| Error::io(format!("opening {SHM_DIR}/{}", self.name), e)),
            ),
            "describe" => Some(Ok(Reply {
                bytes: serde_json::json!({
                    "session": self.session,
                    "len": self.len,
                    "base": self.base_address(),
                    "pid": self.pid,
                })
                .to_string()
                .into_bytes(),
                fds: Vec::new(),
            })),
            _ => None,
        }
    }
}

/// Keeps `fork`ed children from holding the arena locks of their parent: after a fork, each
/// registered lock descriptor is pointed at `/dev/null` in the child (the child's copy of the
/// descriptor would otherwise keep the shared lock alive after the parent dies). The handler only
/// makes async-signal-safe calls.
mod fork_guard {
    use std::sync::atomic::{AtomicI32, Ordering};
    use std::sync::Once;

    use super::RawFd;

    /// Arenas whose lock is guarded; a process rarely has more than one or two.
    const SLOTS: usize = 64;
    static FDS: [AtomicI32; SLOTS] = [const { AtomicI32::new(-1) }; SLOTS];
    /// `/dev/null`, opened once, so the child handler needs no descriptor of its own.
    static NULL: AtomicI32 = AtomicI32::new(-1);
    static INSTALL: Once = Once::new();

    extern "C" fn in_child() {
        let null = NULL.load(Ordering::Relaxed);
        if null < 0 {
            return;
        }
        for slot in &FDS {
            let fd = slot.load(Ordering::Relaxed);
            if fd >= 0 {
                // SAFETY: dup3 is async-signal-safe; both descriptors are open in the child
                // (inherited), and replacing `fd` only drops the child's reference to the
                // locked open file description, not the parent's lock.
                unsafe { libc::dup3(null, fd, libc::O_CLOEXEC) };
            }
        }
    }

    pub(super) fn register(fd: RawFd) {
        INSTALL.call_once(|| {
            // SAFETY: plain FFI; the path is NUL-terminated. The descriptor is kept for the
            // process's life.
            let null =
                unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
            NULL.store(null, Ordering::Relaxed);
            // SAFETY: registers a handler that only makes async-signal-safe calls.
            let rc = unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
            if rc != 0 || null < 0 {
                tracing::warn!(rc, null, "forked children will keep arena locks");
            }
        });
        for slot in &FDS {
            if slot
                .compare_exchange(-1, fd, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
        tracing::warn!(
            "more than {SLOTS} arenas in one process: a forked child keeps this one's lock"
        );
    }

    pub(super) fn unregister(fd: RawFd) {
        for slot in &FDS {
            if slot
                .compare_exchange(fd, -1, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::TensorData;

    fn write(r: &mut ShmRegion, offset: u64, data: &TensorData) -> Result<()> {
        let ops = [CopyOp { offset, data }];
        // SAFETY: `data` outlives the loop, which runs the copy to its end.
        unsafe { r.start(&ops) }?;
        while r.progress(&ops, 7)? != Progress::Done {}
        Ok(())
    }

    /// At 4 KiB and Grace's 64 KiB pages: a page-aligned mapping of the object (from offset 0)
    /// puts the data region at an address aligned to every alignment a request may ask for.
    #[test]
    fn data_stays_aligned_to_the_largest_alignment_at_64k_pages() {
        for page in [4096u64, 16 << 10, 64 << 10] {
            for base in [page, 7 * page, 1 << 40] {
                let data = base + HEADER_BYTES;
                for k in [0u64, 1, 3, 1 << 20] {
                    assert_eq!(
                        (data + k * crate::config::MAX_ALIGNMENT) % crate::config::MAX_ALIGNMENT,
                        0
                    );
                }
            }
            assert_eq!(page % crate::config::MAX_ALIGNMENT, 0);
        }
        let r = ShmRegion::create(1 << 20).unwrap();
        assert_eq!(
            r.base_address() % crate::page::page_size() as u64,
            HEADER_BYTES % crate::page::page_size() as u64
        );
    }

    #[test]
    fn create_write_in_slices_and_read_back() {
        let mut r = ShmRegion::create(1 << 20).unwrap();
        let s: ShmSession = r.session().parse().unwrap();
        assert_eq!(s.to_string(), r.session());
        assert_eq!(s.base, r.base_address());
        let path = format!("{SHM_DIR}/{}", s.name);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let data: Vec<u8> = (0..100u8).collect();
        write(&mut r, 4096, &TensorData::host(data.clone())).unwrap();
        let mut out = vec![0u8; 100];
        r.map
            .copy_out(HEADER_BYTES as usize + 4096, &mut out)
            .unwrap();
        assert_eq!(out, data);
        assert!(write(&mut r, (1 << 20) - 99, &TensorData::host(vec![7u8; 100])).is_err());
        let h = Header::read(&r.map).unwrap();
        assert_eq!((h.nonce, h.len, h.base), (s.nonce, s.len, s.base));
        drop(r);
        assert!(!Path::new(&path).exists(), "unlinked on drop");
    }

    #[test]
    fn a_live_region_is_not_abandoned_and_a_dropped_one_is_gone() {
        let r = ShmRegion::create(1 << 16).unwrap();
        let path = Path::new(SHM_DIR).join(r.name());
        assert!(!is_abandoned(&path).unwrap(), "its creator holds the lock");
        let seen = remove_abandoned(Path::new(SHM_DIR), true).unwrap();
        let me = seen.iter().find(|s| s.name == r.name()).unwrap();
        assert_eq!(me.outcome, SweptOutcome::InUse);
        drop(r);
        assert!(is_abandoned(&path).is_err(), "unlinked");
    }

    #[test]
    fn the_reply_path_hands_out_a_read_only_descriptor() {
        let mut r = ShmRegion::create(1 << 16).unwrap();
        write(&mut r, 0, &TensorData::host(vec![9u8; 10])).unwrap();
        let reply = r.reply("fd").unwrap().unwrap();
        assert_eq!(reply.bytes, r.session().as_bytes());
        let m = Mapping::map(
            reply.fds[0].as_fd(),
            4096 + 10,
            Access::ReadOnly,
            false,
            "t",
        )
        .unwrap();
        let mut out = [0u8; 10];
        m.copy_out(HEADER_BYTES as usize, &mut out).unwrap();
        assert_eq!(out, [9u8; 10]);
        assert!(r.reply("nope").is_none());
        let d: serde_json::Value =
            serde_json::from_slice(&r.reply("describe").unwrap().unwrap().bytes).unwrap();
        assert_eq!(d["len"], 1 << 16);
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
        assert_eq!(
            owner_pid("capture-arena-/x-000000000000000000000000000000ff"),
            None
        );
        assert_eq!(owner_pid("other-42-000000000000000000000000000000ff"), None);
    }

    #[test]
    fn sessions_parse_strictly() {
        let n = "capture-arena-1-000000000000000000000000000000ff";
        for bad in [
            "tcp://x".to_owned(),
            "shm://capture-arena-1-00?len=1&base=0x0".into(),
            "shm://capture-arena-1-0000000000000000000000000000000g?len=1&base=0x0".into(),
            format!("shm://{n}?len=1"),
            format!("shm://{n}?len=1&base=12&x=1"),
            format!("shm://{n}?len=1&len=2&base=0x0"),
            format!("shm://{n}?len=0&base=0x1000"),
            format!("shm://{n}?len=2&base=0xffffffffffffffff"),
            format!("shm://../etc/{n}?len=1&base=0x0"),
            format!("shm://{n}?len=1&base=0x0{}", "&".repeat(600)),
            format!("shm://{n}?len=+1&base=0x1000"),
            format!("shm://{n}?len=01&base=0x1000"),
            format!("shm://{n}?len=1&base=0x01000"),
            format!("shm://{n}?len=1&base=0x1A00"),
            format!("shm://{n}?base=0x1000&len=1"),
        ] {
            assert!(bad.parse::<ShmSession>().is_err(), "{bad}");
        }
        let s: ShmSession = format!("shm://{n}?len=1&base=0x1000").parse().unwrap();
        assert_eq!((s.nonce, s.len, s.base), (255, 1, 4096));
    }
}
