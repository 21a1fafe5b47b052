//! Host memory pinned for the device: a range of an existing mapping registered with
//! `cuMemHostRegister`, so copies between it and device memory are DMA the copy engine runs on
//! its own, instead of copies the driver stages through its pinned bounce buffers with the CPU,
//! one chunk at a time, before it returns (CUDA Programming Guide, "Page-Locked Host Memory";
//! NCCL registers its `/dev/shm` segments the same way, `shmutils.cc`).
//!
//! Registering costs about 0.1 s per GB (it pins every page; measured on H200 NVL in
//! vllm-project/vllm#51080), so a [`LazyPin`] registers on a thread of its own while copies go
//! on pageable, and in chunks of at most [`MAX_CHUNK`] bytes: one registration of 512 GiB or more
//! fails with an out-of-memory error whatever memory is free (the r580 driver's per-call page
//! table; vLLM #51081, SGLang's HiCache and LMCache register in chunks too). The chunks start
//! at page-aligned addresses (the mapping's start plus multiples of 64 GiB), so no two overlap.
//! Registration is a call CUDA graph capture forbids in its default (global) mode, from any
//! thread while another captures: the registering thread sets its own capture mode to relaxed
//! around it, as NCCL does, so an inference server capturing graphs is never disturbed.
//!
//! Dropping a [`LazyPin`] while it registers stops it before its next chunk and waits only for
//! the one under way (at most [`MAX_CHUNK`], about 6 s), not the whole range (a 1 TiB arena:
//! about 100 s). A forked child that drops one leaves the registering thread alone: it is the
//! parent's, and joining it in the child panics (glibc's fork handler marks it gone, and the
//! result std's join expects never comes).

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys as cu;

use super::{api, check, context, Context};
use crate::error::Result;

/// `CU_MEMHOSTREGISTER_PORTABLE`: pinned for every context of the process, not only the one
/// current at registration (the writer copies from tensors of any GPU).
const PORTABLE: u32 = 0x01;
/// `CU_MEMHOSTREGISTER_READ_ONLY`: the device only reads the range. The driver documents it as
/// required to register memory the CPU maps read-only, which a reader's view of an arena is.
const READ_ONLY: u32 = 0x08;
/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
const CAPTURE_RELAXED: c_int = 2;
/// The most bytes one registration covers.
pub(crate) const MAX_CHUNK: usize = 64 << 30;

/// Runs `f` with this thread's stream-capture mode relaxed, then restores it.
fn relaxed<T>(f: impl FnOnce() -> T) -> T {
    let mut mode = CAPTURE_RELAXED;
    // SAFETY: writes the thread's previous mode into `mode`.
    let rc = unsafe { api::cuThreadExchangeStreamCaptureMode(&mut mode) };
    let out = f();
    if rc == api::SUCCESS {
        // SAFETY: as above; puts the previous mode back.
        unsafe { api::cuThreadExchangeStreamCaptureMode(&mut mode) };
    }
    out
}

/// One registered host range, unregistered on drop. Its owner drops it before unmapping the
/// range.
#[derive(Debug)]
struct HostPin {
    ptr: usize,
    len: usize,
    ctx: Arc<Context>,
    /// The registering process: a forked child has no CUDA state to unregister from.
    pid: u32,
}

impl HostPin {
    /// Registers `[ptr, ptr + len)` in `ctx`, portable; `read_only` for a mapping the CPU may
    /// only read.
    ///
    /// # Safety
    /// The range stays mapped until the returned pin is dropped.
    unsafe fn new(ctx: &Arc<Context>, ptr: usize, len: usize, read_only: bool) -> Result<HostPin> {
        let flags = PORTABLE | if read_only { READ_ONLY } else { 0 };
        let _current = ctx.enter()?;
        // SAFETY: the caller keeps the range mapped while the pin lives; registration pins its
        // pages and changes no contents.
        let rc = relaxed(|| unsafe { api::cuMemHostRegister_v2(ptr as *mut c_void, len, flags) });
        check(rc, || {
            format!("pinning {len} bytes of the arena's shared memory (cuMemHostRegister)")
        })?;
        Ok(HostPin {
            ptr,
            len,
            ctx: ctx.clone(),
            pid: std::process::id(),
        })
    }
}

impl Drop for HostPin {
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            return; // a forked child: CUDA does not survive fork
        }
        let Ok(_current) = self.ctx.enter() else {
            return;
        };
        // SAFETY: the range registered in `new`, still mapped (the owner's promise).
        let rc = relaxed(|| unsafe { api::cuMemHostUnregister(self.ptr as *mut c_void) });
        if let Err(e) = check(rc, || "cuMemHostUnregister".into()) {
            tracing::warn!(error = %e, bytes = self.len, "unpinning host memory failed");
        }
    }
}

/// Where a [`LazyPin`] stands.
#[derive(Debug, Default)]
enum State {
    /// No device copy asked for it yet.
    #[default]
    Unasked,
    /// Registering on its own thread; copies stay pageable meanwhile.
    Pinning(std::thread::JoinHandle<Option<Vec<HostPin>>>),
    /// Registered, chunk by chunk (held to be unregistered when dropped).
    Pinned { _pins: Vec<HostPin> },
    /// Off, unsupported or refused: copies stay pageable.
    Pageable,
}

/// A host range pinned for device copies once one is asked for: registered in the background,
/// unregistered (after any registration still running) when dropped, which its owner does before
/// it unmaps the range.
#[derive(Debug)]
pub(crate) struct LazyPin {
    ptr: usize,
    len: usize,
    read_only: bool,
    /// Set when dropped: the registering thread stops before its next chunk.
    stop: Arc<AtomicBool>,
    /// The process that made it: a forked child has neither the registering thread nor the
    /// registrations.
    pid: u32,
    state: Mutex<State>,
}

impl LazyPin {
    /// A pin of `[ptr, ptr + len)` not asked for yet; `read_only` for a mapping the CPU may only
    /// read.
    ///
    /// # Safety
    /// The range stays mapped until the value is dropped.
    pub unsafe fn new(ptr: *mut u8, len: usize, read_only: bool) -> LazyPin {
        LazyPin {
            ptr: ptr as usize,
            len,
            read_only,
            stop: Arc::new(AtomicBool::new(false)),
            pid: std::process::id(),
            state: Mutex::new(State::Unasked),
        }
    }

    /// Whether the range is pinned now. The first call starts registering it on a thread of its
    /// own (in device `ordinal`'s context; the pin holds for every GPU) and returns false, as do
    /// the calls until that is done: copies meanwhile are pageable, and correct. `what` names
    /// the range in the logs.
    pub fn pinned(&self, ordinal: i32, what: &str) -> bool {
        if self.pid != std::process::id() {
            return false; // a forked child: CUDA does not survive fork, nor the parent's thread
        }
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match &*state {
            State::Pinned { .. } => return true,
            State::Pageable => return false,
            State::Pinning(h) if !h.is_finished() => return false,
            State::Pinning(_) | State::Unasked => {}
        }
        if let State::Pinning(h) = std::mem::take(&mut *state) {
            *state = match h.join() {
                Ok(Some(pins)) => State::Pinned { _pins: pins },
                _ => State::Pageable,
            };
            return matches!(*state, State::Pinned { .. });
        }
        let (ptr, len, read_only) = (self.ptr, self.len, self.read_only);
        let (stop, what) = (self.stop.clone(), what.to_owned());
        let started = std::thread::Builder::new()
            .name("capture-arena-pin".into())
            // SAFETY: the range stays mapped until this value is dropped, and Drop joins this
            // thread first.
            .spawn(move || unsafe { pin_all(ordinal, ptr, len, read_only, &stop, &what) });
        *state = match started {
            Ok(h) => State::Pinning(h),
            Err(e) => {
                tracing::warn!(error = %e, "no thread to pin host memory: device copies stay pageable");
                State::Pageable
            }
        };
        false
    }
}

impl Drop for LazyPin {
    fn drop(&mut self) {
        let state = std::mem::take(self.state.get_mut().unwrap_or_else(|p| p.into_inner()));
        if let State::Pinning(h) = state {
            if self.pid != std::process::id() {
                // A forked child: the thread is the parent's. Joining it here would panic
                // (glibc marks it gone in the child, and its result never comes).
                std::mem::forget(h);
                return;
            }
            self.stop.store(true, Ordering::Relaxed);
            drop(h.join());
        }
    }
}

/// `[ptr, ptr + len)` cut into registrations of at most [`MAX_CHUNK`] bytes, each cut on a
/// boundary of `page` (this host's page size): two registrations never share a page, which the
/// driver refuses (`CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`), whatever the page size (64 KiB
/// on Grace) and even if `ptr` were not page-aligned.
fn chunks(ptr: usize, len: usize, page: usize) -> Vec<(usize, usize)> {
    let end = ptr.saturating_add(len);
    let mut out = Vec::with_capacity(len.div_ceil(MAX_CHUNK));
    let mut at = ptr;
    while at < end {
        let cut = crate::page::page_start(at.saturating_add(MAX_CHUNK), page);
        let next = if cut > at && cut < end { cut } else { end };
        out.push((at, next - at));
        at = next;
    }
    out
}

/// Registers `[ptr, ptr + len)` chunk by chunk, logging the outcome; `None` where the device cannot or will
/// not, and when `stop` was set before the last chunk (the range is going).
///
/// # Safety
/// The range stays mapped until the pins are dropped.
unsafe fn pin_all(
    ordinal: i32,
    ptr: usize,
    len: usize,
    read_only: bool,
    stop: &AtomicBool,
    what: &str,
) -> Option<Vec<HostPin>> {
    use cu::CUdevice_attribute as A;
    let started = std::time::Instant::now();
    let ctx = match context(ordinal) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(what, error = %e, "device copies stay pageable");
            return None;
        }
    };
    if ctx.attribute(A::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED) == 0 {
        tracing::info!(
            what,
            "the device cannot pin host memory: device copies stay pageable"
        );
        return None;
    }
    if read_only && ctx.attribute(A::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED) == 0 {
        tracing::info!(
            what,
            "the device cannot pin read-only host memory: device copies stay pageable"
        );
        return None;
    }
    let ranges = chunks(ptr, len, crate::page::page_size());
    let mut pins = Vec::with_capacity(ranges.len());
    for (at, n) in ranges {
        if stop.load(Ordering::Relaxed) {
            tracing::info!(
                what,
                pinned = pins.len(),
                "pinning stopped: the range is going"
            );
            return None; // the chunks pinned so far are unpinned as `pins` drops
        }
        // SAFETY: a sub-range of the caller's, mapped as long as the pins live.
        match unsafe { HostPin::new(&ctx, at, n, read_only) } {
            Ok(p) => pins.push(p),
            Err(e) => {
                tracing::warn!(
                    what,
                    error = %e,
                    "pinning failed: device copies stay pageable (slower, synchronous); \
                     SGLANG_SPEC_CAPTURE_PIN_HOST=0 skips the attempt"
                );
                return None; // the chunks pinned so far are unpinned as `pins` drops
            }
        }
    }
    tracing::info!(
        what,
        bytes = len,
        chunks = pins.len(),
        ms = started.elapsed().as_millis() as u64,
        "pinned for device copies"
    );
    Some(pins)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Registrations at Grace's 64 KiB pages and at 4 KiB: whole range, at most MAX_CHUNK each,
    /// every cut on a page boundary (no page in two registrations), also from an unaligned start.
    #[test]
    fn registrations_never_share_a_page_at_64k_or_4k() {
        for page in [4096usize, 64 << 10] {
            for (ptr, len) in [
                (1usize << 40, 3 * MAX_CHUNK + 12345),
                ((1 << 40) + 4096, 2 * MAX_CHUNK),
                ((1 << 40) + 100, MAX_CHUNK + 1),
                (1 << 40, 1),
                (1 << 40, 0),
            ] {
                let c = chunks(ptr, len, page);
                assert_eq!(c.iter().map(|&(_, n)| n).sum::<usize>(), len);
                assert!(c.iter().all(|&(_, n)| n > 0 && n <= MAX_CHUNK), "{c:?}");
                for w in c.windows(2) {
                    assert_eq!(w[0].0 + w[0].1, w[1].0, "contiguous");
                    assert_eq!(w[1].0 % page, 0, "cut off a page boundary at {page}: {c:?}");
                }
                if let Some(&(first, _)) = c.first() {
                    assert_eq!(first, ptr);
                }
            }
        }
    }
}
