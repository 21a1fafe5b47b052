//! Every memory mapping of the crate, in one type: `mmap`, `munmap`, pre-faulting, the fork
//! policy, and all pointer arithmetic over the mapped bytes. Regions (the producer's) and
//! transports (a reader's) hold a [`Mapping`] and never see a raw pointer.
//!
//! A mapping of shared memory holds bytes that another process may change at any moment (a
//! producer reuses the space of freed objects). So reading is a copy into caller memory
//! ([`Mapping::copy_out`]), which is safe whatever the bytes are, and borrowing the bytes in place
//! ([`Mapping::bytes`]) is `unsafe`: its caller promises that nobody changes them while the
//! borrow lives.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::page::page_size;

/// The most bytes pre-faulted in one call. Each call holds the process's memory-map lock, which
/// every other thread's page fault and `mmap` also needs: a whole arena pre-faulted at once
/// (`MAP_POPULATE`) stopped them all for about a second per GiB (a vLLM step waited 1.6 s for a
/// thread to start while a 1.7 GB arena was created). In chunks they get in between.
const POPULATE_CHUNK: usize = 4 << 20;

/// What this process may do with a mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// A reader's view of another process's memory.
    ReadOnly,
    /// The producer's own region. Not inherited by `fork`ed children (`MADV_DONTFORK`): a child
    /// of the inference server never writes the arena, and must not keep its pages alive after
    /// the server is gone.
    ReadWrite,
}

/// A shared mapping of a whole file or shared-memory object, unmapped on drop.
///
/// Invariant: `ptr` is what `mmap` returned for `len` bytes with `access`, and stays mapped until
/// drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    access: Access,
    /// The process that mapped it: a `ReadWrite` mapping is not inherited by `fork`, so a child
    /// must not unmap whatever it has at that address since.
    pid: u32,
    /// Catches the `SIGBUS` of an object truncated under the mapping (see [`super::guard`]).
    watch: Option<super::guard::Watch>,
    /// Set when the object was found shorter than the mapping by `fstat` ([`Mapping::notice_shrink`]):
    /// device copies into pinned pages never fault, so the `SIGBUS` guard cannot see it.
    shrunk: std::sync::atomic::AtomicBool,
    /// The whole mapping pinned for device copies (feature `cuda`), from the first one on
    /// ([`Mapping::pin_for_device`]); `None` when [`ENV_PIN_HOST`] is `0`.
    #[cfg(feature = "cuda")]
    pin: Option<crate::driver::LazyPin>,
}

/// `0` (or `false`, `no`, `off`) turns pinning off: copies between shared memory and device memory then stay pageable
/// (synchronous, staged by the driver through its own buffers). Default on.
pub const ENV_PIN_HOST: &str = "SGLANG_SPEC_CAPTURE_PIN_HOST";

/// Whether host memory is pinned for device copies ([`ENV_PIN_HOST`] is not off: `0`, `false`,
/// `no` or `off`, as every other flag is spelled; `config::parse_flag`, which this module cannot
/// import).
#[cfg(feature = "cuda")]
pub(crate) fn pinning_on() -> bool {
    !std::env::var(ENV_PIN_HOST).is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "0" | "false" | "no" | "off"
        )
    })
}

/// `(size, link count)` of an open descriptor.
pub(crate) fn fstat(fd: &OwnedFd) -> io::Result<(u64, u64)> {
    // SAFETY: fstat fills a zeroed stat struct for a descriptor we own.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd.as_raw_fd(), &mut st) != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok((st.st_size as u64, st.st_nlink as u64))
    }
}

// SAFETY: the mapping is plain memory owned by this value; every access goes through methods
// that either copy (reads and writes of disjoint caller buffers) or take `&mut self` (writes), so
// moving the owner to another thread moves the only handle.
unsafe impl Send for Mapping {}
// SAFETY: `&self` methods only read the mapping (copies out, or unsafe borrows whose caller
// promises the bytes do not change); writing needs `&mut self`.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` from offset 0, shared. `populate` pre-faults the page tables, a
    /// chunk at a time (4 MiB per call, `MADV_POPULATE_READ`/`_WRITE`, or reading each
    /// page where the kernel predates them), so that other threads of this process go on
    /// meanwhile: for a reader it makes reads run at memcpy speed instead of taking a fault
    /// every few pages. A failure to pre-fault only leaves pages to fault in on first use.
    ///
    /// # Errors
    /// [`Error::Io`] naming `what` if `mmap` fails.
    pub fn map(
        fd: BorrowedFd<'_>,
        len: usize,
        access: Access,
        populate: bool,
        what: &str,
    ) -> Result<Mapping> {
        if len == 0 {
            return Err(Error::io(
                format!("mapping {what}"),
                io::Error::new(io::ErrorKind::InvalidInput, "zero-length mapping"),
            ));
        }
        let prot = match access {
            Access::ReadOnly => libc::PROT_READ,
            Access::ReadWrite => libc::PROT_READ | libc::PROT_WRITE,
        };
        let flags = libc::MAP_SHARED;
        // SAFETY: a fresh shared mapping chosen by the kernel (no address hint), of a descriptor
        // the caller keeps open for the duration of the call.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(Error::io(
                format!("mmap of {len} bytes of {what}"),
                io::Error::last_os_error(),
            ));
        }
        let Some(ptr) = NonNull::new(ptr.cast::<u8>()) else {
            return Err(Error::io(
                format!("mmap of {what}"),
                io::Error::other("mmap returned a null mapping"),
            ));
        };
        let m = Mapping {
            ptr,
            len,
            access,
            pid: std::process::id(),
            watch: super::guard::Watch::new(ptr.as_ptr() as usize, len),
            shrunk: std::sync::atomic::AtomicBool::new(false),
            #[cfg(feature = "cuda")]
            pin: pinning_on().then(|| {
                // SAFETY: exactly the range just mapped; the pin is dropped before it is
                // unmapped (Drop below).
                unsafe {
                    crate::driver::LazyPin::new(ptr.as_ptr(), len, access == Access::ReadOnly)
                }
            }),
        };
        if access == Access::ReadWrite {
            // SAFETY: advice on exactly the range just mapped; it changes no contents.
            if unsafe { libc::madvise(m.ptr.as_ptr().cast(), len, libc::MADV_DONTFORK) } != 0 {
                tracing::debug!(error = %io::Error::last_os_error(), "MADV_DONTFORK refused");
            }
        }
        if populate {
            m.populate();
        }
        Ok(m)
    }

    /// Pre-faults the whole mapping, [`POPULATE_CHUNK`] bytes per call (see [`Mapping::map`]).
    fn populate(&self) {
        let advice = match self.access {
            Access::ReadOnly => libc::MADV_POPULATE_READ,
            Access::ReadWrite => libc::MADV_POPULATE_WRITE,
        };
        let page = page_size();
        let mut at = 0;
        while at < self.len {
            let n = POPULATE_CHUNK.min(self.len - at);
            // SAFETY: `at + n <= len`: a sub-range of this mapping, page-aligned (the chunk is a
            // multiple of the page size); the advice changes no contents.
            let rc = unsafe { libc::madvise(self.ptr.as_ptr().add(at).cast(), n, advice) };
            if rc != 0 {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => continue,
                    Some(libc::EINVAL) => {
                        // A kernel before 5.14: each page read instead (one fault each; a
                        // first write to it takes a minor fault later). Never written: another
                        // process may be writing the same memory.
                        for p in (at..self.len).step_by(page) {
                            // SAFETY: `p < len`, inside this mapping; a volatile read of one
                            // byte of memory that stays mapped while `self` lives.
                            unsafe { std::ptr::read_volatile(self.ptr.as_ptr().add(p)) };
                        }
                    }
                    _ => {
                        tracing::debug!(error = %e, at, "pre-faulting stopped; later pages fault in on first use")
                    }
                }
                return;
            }
            at += n;
        }
    }

    /// Whether the whole mapping is pinned for copies to and from device memory, so that the copy
    /// engine moves the bytes itself instead of the driver staging them with the CPU. The first
    /// call starts pinning it in the background (in device `ordinal`'s context; the pin holds
    /// for every GPU); until that is done, and where pinning is off ([`ENV_PIN_HOST`]`=0`) or
    /// refused, copies are pageable: slower, and correct.
    #[cfg(feature = "cuda")]
    pub(crate) fn pin_for_device(&self, ordinal: i32, what: &str) -> bool {
        self.pin.as_ref().is_some_and(|p| p.pinned(ordinal, what))
    }

    /// Marks the mapping lost when `fd`, the object it maps, is now shorter than the mapping: a
    /// device copy reads or writes pinned pages without a fault, so after a truncation it would
    /// go on with pages the object no longer has, unseen by the `SIGBUS` guard. Call it after
    /// device copies.
    #[cfg(feature = "cuda")]
    pub(crate) fn notice_shrink(&self, fd: &OwnedFd) {
        if fstat(fd).is_ok_and(|(size, _)| size < self.len as u64) {
            self.shrunk
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty mapping (never: `map` refuses those).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The virtual address of byte 0 in this process.
    pub fn address(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// True once the object was found truncated under this mapping (a page past its new end was
    /// touched): the bytes from that page on are private zeros, not the object's, for good.
    pub fn lost(&self) -> bool {
        self.watch.as_ref().is_some_and(|w| w.lost())
            || self.shrunk.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// [`Error::Io`] naming `what` if [`Mapping::lost`].
    pub(crate) fn check_lost(&self, what: &str) -> Result<()> {
        if !self.lost() {
            return Ok(());
        }
        Err(Error::io(
            what,
            io::Error::other(
                "the shared memory object was truncated by another process while mapped (a \
                 process of the same user); its contents are lost",
            ),
        ))
    }

    fn range(&self, offset: usize, n: usize) -> Result<()> {
        match offset.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfRange {
                address: self.address().wrapping_add(offset as u64),
                len: n as u64,
                base: self.address(),
                region_len: self.len as u64,
            }),
        }
    }

    /// Copies `out.len()` bytes at `offset` into `out`.
    ///
    /// The bytes are whatever the mapping holds at the time of the copy; if another process
    /// writes them meanwhile (it may once the object is freed), `out` may mix old and new bytes.
    /// Rust's memory model has no notion of another process writing shared memory; a plain copy
    /// of such bytes into a buffer this process owns is what every shared-memory reader does,
    /// and no reference to the racing bytes is ever formed (unlike [`Mapping::bytes`]).
    ///
    /// # Errors
    /// [`Error::OutOfRange`] if the range is not inside the mapping; [`Error::Io`] if the object
    /// was truncated under the mapping ([`Mapping::lost`]), whatever `out` then holds.
    pub fn copy_out(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        self.range(offset, out.len())?;
        // SAFETY: [offset, offset + out.len()) is inside the mapping (checked), which stays
        // mapped while `&self` lives; `out` is a `&mut` borrow, so it does not overlap memory
        // this mapping hands out (only as copies, or as `&[u8]` under `bytes`' contract).
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        self.check_lost("reading shared memory")
    }

    /// Copies `len` bytes from `src` to `offset`.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] if the range is not inside the mapping; [`Error::Io`] for a
    /// read-only mapping, or one whose object was truncated under it ([`Mapping::lost`]).
    ///
    /// # Safety
    /// `src` must be valid for reads of `len` bytes, and nothing may write those bytes until
    /// this call returns. They must not lie inside this mapping.
    pub unsafe fn copy_in(&mut self, offset: usize, src: *const u8, len: usize) -> Result<()> {
        if self.access != Access::ReadWrite {
            return Err(Error::io(
                "writing a read-only mapping",
                io::Error::from(io::ErrorKind::PermissionDenied),
            ));
        }
        self.range(offset, len)?;
        // SAFETY: the destination range is inside this writable mapping (checked) and `&mut self`
        // makes this the only writer in this process; the source is valid and unchanging and
        // does not overlap it (the caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(src, self.ptr.as_ptr().add(offset), len) };
        self.check_lost("writing shared memory")
    }

    /// The address of `[offset, offset + len)` for a copy the caller makes with another engine
    /// (a device copy), after checking the range. Dereferencing it is the caller's business.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] if the range is not inside the mapping.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn raw_range(&self, offset: usize, len: usize) -> Result<*mut u8> {
        self.range(offset, len)?;
        // SAFETY: offset is inside the mapping (checked), so the result stays in bounds.
        Ok(unsafe { self.ptr.as_ptr().add(offset) })
    }

    /// Borrows `n` bytes at `offset` in place.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] if the range is not inside the mapping.
    ///
    /// # Safety
    /// Nothing may change these bytes while the borrow lives: for another process's memory that
    /// means the caller knows the object there stays resident (not freed, not replaced) until
    /// the slice is dropped.
    pub unsafe fn bytes(&self, offset: usize, n: usize) -> Result<&[u8]> {
        self.range(offset, n)?;
        // SAFETY: the range is inside the mapping (checked), which outlives `&self`; the caller
        // promises the bytes do not change while the slice lives.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), n) })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // Unpinned and unwatched before the range is unmapped (the address may be reused at once).
        #[cfg(feature = "cuda")]
        drop(self.pin.take());
        drop(self.watch.take());
        if self.access == Access::ReadWrite && self.pid != std::process::id() {
            return; // MADV_DONTFORK: not mapped in this (forked) process
        }
        // SAFETY: exactly the range mmap returned; no borrow of it outlives `self` (borrows are
        // tied to `&self`).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn memfd(len: u64) -> std::fs::File {
        let f = tempfile_in_shm();
        f.set_len(len).unwrap();
        f
    }

    fn tempfile_in_shm() -> std::fs::File {
        let path = format!("/dev/shm/capture-arena-test-mapping-{}", std::process::id());
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        f
    }

    #[test]
    #[cfg(feature = "cuda")]
    fn a_shrunk_object_is_noticed_without_a_fault() {
        // A device copy into pinned pages never faults: after a truncation only fstat tells.
        let f = memfd(3 * 4096);
        let r = Mapping::map(f.as_fd(), 3 * 4096, Access::ReadOnly, false, "test").unwrap();
        let fd = OwnedFd::from(f.try_clone().unwrap());
        r.notice_shrink(&fd);
        assert!(!r.lost());
        f.set_len(4096).unwrap();
        r.notice_shrink(&fd);
        assert!(r.lost());
    }

    #[test]
    fn copies_in_and_out_and_checks_ranges() {
        let f = memfd(8192);
        let mut w = Mapping::map(f.as_fd(), 8192, Access::ReadWrite, true, "test").unwrap();
        let r = Mapping::map(f.as_fd(), 8192, Access::ReadOnly, false, "test").unwrap();
        let src = [7u8; 100];
        // SAFETY: a local array, unchanged during the call.
        unsafe { w.copy_in(4000, src.as_ptr(), 100).unwrap() };
        let mut out = [0u8; 100];
        r.copy_out(4000, &mut out).unwrap();
        assert_eq!(out, src);
        assert!(r.copy_out(8100, &mut out).is_err());
        assert!(r.copy_out(usize::MAX, &mut out).is_err());
        // SAFETY: nothing writes the mapping while the slice lives.
        assert_eq!(unsafe { r.bytes(4000, 3) }.unwrap(), &[7, 7, 7]);
        // SAFETY: as above.
        assert!(unsafe { r.bytes(8190, 3) }.is_err());
        let mut ro = r;
        // SAFETY: a local array.
        assert!(unsafe { ro.copy_in(0, src.as_ptr(), 1) }.is_err());
    }
}
