//! [`ReadBuffer`]: host memory that transports which must register memory (NIXL) register once,
//! on the first read into it, instead of on every read.
//!
//! A read into a plain `&mut [u8]` works with every transport; NIXL then registers the slice
//! for that one read and deregisters it after (cheap over TCP and shared memory, a page-pinning
//! system call per read over RDMA). A read into any part of a live `ReadBuffer` uses the
//! registration the buffer keeps until it is dropped, so a trainer that reads into the same
//! buffers sample after sample registers them once.
//!
//! The buffers alive in this process are listed in a registry by address. A transport asks it
//! whether a destination lies inside one ([`ensure_registered`]); a buffer leaves the registry,
//! and its registrations are released, before its memory is freed, so no registration outlives
//! the memory it names; but for an agent stuck in a call that holds the lock a release takes
//! ([`forget_owner`]: a NIXL metadata load in a partition), whose registrations are forgotten,
//! never released: over RDMA their pages stay pinned for the process's life.

use std::alloc::{self, Layout};
use std::any::Any;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::page::page_size;

/// Zeroed, page-aligned host memory for reads, registered once with the transports that need
/// it. Dereferences to `[u8]`; any sub-slice of it is a registered destination.
pub struct ReadBuffer {
    ptr: NonNull<u8>,
    len: usize,
    id: u64,
}

// SAFETY: a ReadBuffer owns its memory exclusively, like a Vec<u8>.
unsafe impl Send for ReadBuffer {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for ReadBuffer {}

/// What the registry knows of one live buffer.
struct Entry {
    id: u64,
    start: u64,
    len: u64,
    /// The process that made the entry: a forked child does not release its parent's
    /// registrations.
    pid: u32,
    /// Registrations by owner (a transport's agent), released with the buffer.
    registrations: Vec<(u64, Box<dyn Any + Send>)>,
}

static REGISTRY: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn registry() -> std::sync::MutexGuard<'static, Vec<Entry>> {
    REGISTRY.lock().unwrap_or_else(|p| p.into_inner())
}

impl ReadBuffer {
    /// `len` zeroed bytes (`len >= 1`).
    ///
    /// # Errors
    /// [`Error::InvalidRead`] for 0 bytes or a size the allocator refuses.
    pub fn new(len: usize) -> Result<ReadBuffer> {
        let refuse = |why: &str| Error::InvalidRead {
            key: "ReadBuffer".into(),
            reason: format!("cannot allocate {len} bytes: {why}"),
        };
        if len == 0 {
            return Err(refuse("a read buffer holds at least one byte"));
        }
        let layout = Layout::from_size_align(len, page_size()).map_err(|_| refuse("too large"))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc::alloc_zeroed(layout) })
            .ok_or_else(|| refuse("out of memory"))?;
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        registry().push(Entry {
            id,
            start: ptr.as_ptr() as u64,
            len: len as u64,
            pid: std::process::id(),
            registrations: Vec::new(),
        });
        Ok(ReadBuffer { ptr, len, id })
    }

    /// Registrations held for this buffer now (one per transport agent that read into it).
    pub fn registrations(&self) -> usize {
        registry()
            .iter()
            .find(|e| e.id == self.id)
            .map_or(0, |e| e.registrations.len())
    }
}

impl Deref for ReadBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` holds `len` initialized (zeroed at allocation) bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for ReadBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for ReadBuffer {
    fn drop(&mut self) {
        let entry = {
            let mut r = registry();
            r.iter()
                .position(|e| e.id == self.id)
                .map(|i| r.swap_remove(i))
        };
        if let Some(e) = entry {
            if e.pid == std::process::id() {
                // Deregisters (outside the registry's lock) before the memory goes.
                drop(e.registrations);
            } else {
                // A forked child: the registrations belong to the parent's agents.
                std::mem::forget(e.registrations);
            }
        }
        // SAFETY: allocated in `new` with this very layout (which was valid then).
        unsafe {
            alloc::dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.len, page_size()),
            )
        };
    }
}

impl fmt::Debug for ReadBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReadBuffer")
            .field("address", &format_args!("{:#x}", self.ptr.as_ptr() as u64))
            .field("len", &self.len)
            .finish()
    }
}

/// For `[addr, addr + len)` inside a live [`ReadBuffer`]: makes sure `owner` holds a
/// registration of that whole buffer, made by `register(start, len)` the first time. Returns
/// false (and registers nothing) when the range is in no read buffer.
///
/// `register` runs outside the registry's lock: registering a slab takes tens of milliseconds
/// (NIXL pins it), and a process forked meanwhile (a DataLoader's worker) would inherit the lock
/// held, and hang at its first read buffer made or dropped. The caller reads into the buffer, so
/// it outlives the call; an owner (an agent) is leased to one thread at a time, so no other
/// thread registers the same pair meanwhile (if one did, the second registration is let go).
///
/// # Errors
/// What `register` returns.
#[cfg_attr(not(feature = "nixl"), allow(dead_code))]
pub(crate) fn ensure_registered(
    addr: u64,
    len: u64,
    owner: u64,
    register: impl FnOnce(u64, u64) -> Result<Box<dyn Any + Send>>,
) -> Result<bool> {
    let pid = std::process::id();
    let (id, start, buf_len) = {
        let r = registry();
        let Some(e) = r.iter().find(|e| {
            e.pid == pid
                && addr >= e.start
                && addr
                    .checked_add(len)
                    .is_some_and(|end| end <= e.start + e.len)
        }) else {
            return Ok(false);
        };
        if e.registrations.iter().any(|(o, _)| *o == owner) {
            return Ok(true);
        }
        (e.id, e.start, e.len)
    };
    let reg = register(start, buf_len)?;
    let extra = {
        let mut r = registry();
        match r.iter_mut().find(|e| e.id == id) {
            Some(e) if !e.registrations.iter().any(|(o, _)| *o == owner) => {
                e.registrations.push((owner, reg));
                None
            }
            _ => Some(reg),
        }
    };
    // Deregistered outside the lock, as a buffer's drop does.
    drop(extra);
    Ok(true)
}

/// Forgets every registration `owner` holds, without releasing any: its agent is stuck in a call
/// that holds the lock a release takes. The registrations stay for the process's life.
#[cfg_attr(not(feature = "nixl"), allow(dead_code))]
pub(crate) fn forget_owner(owner: u64) {
    let forgotten = take_owners(owner);
    std::mem::forget(forgotten);
}

/// Every registration `owner` holds, out of the registry.
fn take_owners(owner: u64) -> Vec<Box<dyn Any + Send>> {
    let mut r = registry();
    let mut out = Vec::new();
    for e in r.iter_mut() {
        let mut i = 0;
        while i < e.registrations.len() {
            if e.registrations[i].0 == owner {
                out.push(e.registrations.swap_remove(i).1);
            } else {
                i += 1;
            }
        }
    }
    out
}

/// Releases every registration `owner` holds (its agent is going away).
#[cfg_attr(not(feature = "nixl"), allow(dead_code))]
pub(crate) fn release_owner(owner: u64) {
    // Released outside the registry's lock (take_owners has let it go).
    drop(take_owners(owner));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_inside_a_live_buffer_are_registered_once_and_released_with_it() {
        let mut b = ReadBuffer::new(10_000).unwrap();
        assert!(b.iter().all(|&x| x == 0));
        assert_eq!(b.as_ptr() as usize % page_size(), 0);
        b[9_999] = 7;
        let start = b.as_ptr() as u64;
        let mut calls = 0;
        for (off, len) in [(0, 10_000), (100, 50), (9_999, 1)] {
            let covered = ensure_registered(start + off, len, 1, |s, l| {
                calls += 1;
                assert_eq!((s, l), (start, 10_000));
                Ok(Box::new(()))
            })
            .unwrap();
            assert!(covered);
        }
        assert_eq!(calls, 1);
        assert_eq!(b.registrations(), 1);
        // The registry is not locked while a registration is made (a fork then would leave
        // the child's registry locked for good).
        let other = ReadBuffer::new(100).unwrap();
        let covered = ensure_registered(other.as_ptr() as u64, 100, 1, |_, _| {
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                drop(registry());
                let _ = tx.send(());
            });
            let took = rx.recv_timeout(std::time::Duration::from_secs(10));
            assert!(took.is_ok(), "registered under the registry's lock");
            Ok(Box::new(()))
        })
        .unwrap();
        assert!(covered);
        assert_eq!(other.registrations(), 1);
        drop(other);
        assert!(!ensure_registered(start + 9_999, 2, 1, |_, _| unreachable!()).unwrap());
        assert!(!ensure_registered(start.wrapping_sub(1), 1, 1, |_, _| unreachable!()).unwrap());
        release_owner(1);
        assert_eq!(b.registrations(), 0);
        // A stuck owner's registrations are forgotten, never released (a release would wait
        // for the stuck call).
        struct Counted(std::sync::Arc<std::sync::atomic::AtomicUsize>);
        impl Drop for Counted {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let released = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let r = released.clone();
        ensure_registered(start, 1, 2, |_, _| Ok(Box::new(Counted(r)))).unwrap();
        assert_eq!(b.registrations(), 1);
        forget_owner(2);
        assert_eq!(b.registrations(), 0);
        assert_eq!(released.load(Ordering::SeqCst), 0);
        drop(b);
        assert!(!ensure_registered(start, 1, 1, |_, _| unreachable!()).unwrap());
        assert!(ReadBuffer::new(0).is_err());
    }
}
