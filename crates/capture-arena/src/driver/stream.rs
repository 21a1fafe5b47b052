//! Streams and events of a context (each operation entered in its own context), the events a
//! writer waits on (made in the context of the caller's stream), a tensor's readiness event, and
//! device buffers of the CLI and the tests.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys as cu;

use super::{api, check, context, Context};
use crate::error::{Error, Result};

/// A non-blocking stream of one context. Every operation on it runs with its own context
/// current (entered for the call, the caller's restored after), as cudarc's safe layer does:
/// the driver validates streams, events and pointers against the current context, which on a
/// Python thread is torch's.
#[derive(Debug)]
pub(crate) struct Stream {
    pub raw: cu::CUstream,
    ctx: Arc<Context>,
}

// SAFETY: streams may be used from any thread; the driver serialises work on one stream.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// The device ordinal of its context.
    pub fn ordinal(&self) -> i32 {
        self.ctx.ordinal
    }

    /// A new stream that does not synchronise with the legacy default stream.
    pub fn new(ctx: &Arc<Context>) -> Result<Stream> {
        let _current = ctx.enter()?;
        let mut s = std::ptr::null_mut();
        // SAFETY: writes one handle. 1 = CU_STREAM_NON_BLOCKING.
        let rc = unsafe { api::cuStreamCreate(&mut s, 1) };
        check(rc, || "cuStreamCreate".into())?;
        Ok(Stream {
            raw: s,
            ctx: ctx.clone(),
        })
    }

    /// Blocks until all work on the stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: a valid stream.
        let rc = unsafe { api::cuStreamSynchronize(self.raw) };
        check(rc, || "cuStreamSynchronize".into())
    }

    /// Makes later work on this stream wait for `event` (of any context of this process).
    pub fn wait(&self, event: &Event) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: both handles are valid (the event outlives this call).
        let rc = unsafe { api::cuStreamWaitEvent(self.raw, event.raw, 0) };
        check(rc, || "waiting on the producer's event".into())
    }

    /// Makes later work on this stream wait for `event`, a raw event handle of this process
    /// (another library's: a `cudaEvent_t` is a `CUevent`).
    ///
    /// # Safety
    /// `event` must be a valid event until this returns.
    pub unsafe fn wait_raw(&self, event: u64) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: the caller's promise; the driver validates the handle's context.
        let rc = unsafe { api::cuStreamWaitEvent(self.raw, event as usize as cu::CUevent, 0) };
        check(rc, || "waiting on the caller's event".into())
    }

    /// The context the stream belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Enqueues a 2-D copy: `height` rows of `width` bytes from device address `src` (rows
    /// `src_pitch` apart) to `dst` (rows `dst_pitch` apart), host memory when `dst_host`, else
    /// device memory (nothing for an empty copy).
    ///
    /// # Safety
    /// Both ranges must be valid for the copy's duration (host memory for writes when
    /// `dst_host`), and each pitch at least `width`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn copy_2d(
        &self,
        src: u64,
        src_pitch: u64,
        dst: u64,
        dst_pitch: u64,
        dst_host: bool,
        width: u64,
        height: u64,
    ) -> Result<()> {
        if width == 0 || height == 0 {
            return Ok(());
        }
        let _current = self.ctx.enter()?;
        let copy = cu::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: cu::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            srcPitch: src_pitch as usize,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: if dst_host {
                cu::CUmemorytype::CU_MEMORYTYPE_HOST
            } else {
                cu::CUmemorytype::CU_MEMORYTYPE_DEVICE
            },
            dstHost: if dst_host {
                dst as usize as *mut c_void
            } else {
                std::ptr::null_mut()
            },
            dstDevice: if dst_host { 0 } else { dst },
            dstArray: std::ptr::null_mut(),
            dstPitch: dst_pitch as usize,
            WidthInBytes: width as usize,
            Height: height as usize,
        };
        // SAFETY: the caller's promise; the descriptor lives for the call (the driver reads it
        // before returning).
        let rc = unsafe { api::cuMemcpy2DAsync_v2(&copy, self.raw) };
        check(rc, || {
            format!("copying {height} rows of {width} bytes from the cache (cuMemcpy2DAsync)")
        })
    }

    /// Enqueues `f(data)` on a driver thread once all earlier work on the stream has finished.
    ///
    /// # Safety
    /// `data` must stay valid until `f` has run, and `f` must not call CUDA.
    pub unsafe fn host_func(
        &self,
        f: unsafe extern "C" fn(*mut c_void),
        data: *mut c_void,
    ) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: as the caller promised.
        let rc = unsafe { api::cuLaunchHostFunc(self.raw, Some(f), data) };
        check(rc, || "cuLaunchHostFunc".into())
    }

    /// Enqueues a copy of `len` bytes between device addresses (nothing for 0 bytes).
    ///
    /// # Safety
    /// Both ranges must be valid device memory (or mapped ranges) for the copy's duration.
    pub unsafe fn copy_dtod(&self, dst: u64, src: u64, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let _current = self.ctx.enter()?;
        // SAFETY: as the caller promised.
        let rc = unsafe { api::cuMemcpyDtoDAsync_v2(dst, src, len as usize, self.raw) };
        check(rc, || format!("device-to-device copy of {len} bytes"))
    }

    /// Enqueues a copy of `len` host bytes at `src` to device address `dst` (nothing for 0
    /// bytes).
    ///
    /// # Safety
    /// `src` valid for reads of `len` bytes and `dst` valid device memory until the copy ends.
    pub unsafe fn copy_htod(&self, dst: u64, src: *const u8, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let _current = self.ctx.enter()?;
        // SAFETY: as the caller promised.
        let rc = unsafe { api::cuMemcpyHtoDAsync_v2(dst, src.cast(), len as usize, self.raw) };
        check(rc, || format!("host-to-device copy of {len} bytes"))
    }

    /// Enqueues a copy of `len` device bytes at `src` to host memory at `dst` (nothing for 0
    /// bytes).
    ///
    /// # Safety
    /// `dst` valid for writes of `len` bytes and `src` valid device memory until the copy ends.
    pub unsafe fn copy_dtoh(&self, dst: *mut u8, src: u64, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let _current = self.ctx.enter()?;
        // SAFETY: as the caller promised.
        let rc = unsafe { api::cuMemcpyDtoHAsync_v2(dst.cast(), src, len as usize, self.raw) };
        check(rc, || format!("device-to-host copy of {len} bytes"))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _current = self.ctx.enter();
        // SAFETY: destroys the stream created in `new` (pending work still completes).
        unsafe {
            api::cuStreamDestroy_v2(self.raw);
        }
    }
}

/// An event without timing (cheapest to record and query).
#[derive(Debug)]
pub(crate) struct Event {
    raw: cu::CUevent,
    ctx: Arc<Context>,
}

// SAFETY: events may be recorded and queried from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// A new event (CU_EVENT_DISABLE_TIMING).
    pub fn new(ctx: &Arc<Context>) -> Result<Event> {
        Event::with_flags(ctx, 2)
    }

    /// A new event with `cuEventCreate`'s `flags`.
    fn with_flags(ctx: &Arc<Context>, flags: u32) -> Result<Event> {
        let _current = ctx.enter()?;
        let mut e = std::ptr::null_mut();
        // SAFETY: writes one handle.
        let rc = unsafe { api::cuEventCreate(&mut e, flags) };
        check(rc, || "cuEventCreate".into())?;
        Ok(Event {
            raw: e,
            ctx: ctx.clone(),
        })
    }

    /// A new event whose [`Event::synchronize`] puts the waiting thread to sleep
    /// (CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING) instead of spinning a core.
    pub fn new_blocking(ctx: &Arc<Context>) -> Result<Event> {
        Event::with_flags(ctx, 1 | 2)
    }

    /// The raw handle, for a stream of another owner to wait on ([`Stream::wait_raw`]).
    pub fn handle(&self) -> u64 {
        self.raw as usize as u64
    }

    /// Waits until all work before the event's record has finished.
    pub fn synchronize(&self) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: a valid event.
        let rc = unsafe { api::cuEventSynchronize(self.raw) };
        check(rc, || "a device copy failed (cuEventSynchronize)".into())
    }

    /// Records the event on `stream`, a raw `CUstream` of this process (a caller's stream, on
    /// the event's device).
    pub fn record_raw(&self, stream: cu::CUstream) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: `stream` is a live CUstream of this process on this device: one of ours, or a
        // caller's given through the unsafe `DeviceSlice::after` or the device copies' `after`,
        // whose contracts say so (the driver does not check a handle).
        let rc = unsafe { api::cuEventRecord(self.raw, stream) };
        check(rc, || "recording an event on the caller's stream".into())
    }

    /// Records the event on one of our streams.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        self.record_raw(stream.raw)
    }

    /// `Ok(true)` once all work before the event's record has finished.
    pub fn query(&self) -> Result<bool> {
        let _current = self.ctx.enter()?;
        // SAFETY: a valid event.
        let rc = unsafe { api::cuEventQuery(self.raw) };
        if rc == api::NOT_READY {
            return Ok(false);
        }
        check(rc, || "a device copy failed (cuEventQuery)".into()).map(|()| true)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _current = self.ctx.enter();
        // SAFETY: destroys the event created in `new`.
        unsafe {
            api::cuEventDestroy_v2(self.raw);
        }
    }
}

/// Records an event on a caller's raw stream of device `ordinal`, now.
pub(crate) fn event_on(ordinal: i32, stream: u64) -> Result<Event> {
    let primary = context(ordinal)?;
    let raw = stream as usize as cu::CUstream;
    let ctx = if stream == 0 {
        primary
    } else {
        stream_context(&primary, raw)?
    };
    let e = Event::new(&ctx)?;
    e.record_raw(raw)?;
    Ok(e)
}

/// The context a caller's `stream` belongs to (`cuStreamGetCtx`): an event recorded on it must
/// be made in that same context. `primary` when it is the device's primary context (torch's
/// streams); else a handle of the stream's own context, not retained (it lives at least as long
/// as the caller's stream, which outlives the event recorded on it).
fn stream_context(primary: &Arc<Context>, stream: cu::CUstream) -> Result<Arc<Context>> {
    let _current = primary.enter()?;
    let mut ctx = std::ptr::null_mut();
    // SAFETY: `stream` is a live stream handle of this device: the driver does not check one,
    // so callers pass only handles a framework gave (the Python package's `CudaBytes` reads
    // torch's current stream when it is made, and cannot be changed after); writes one context
    // handle.
    let rc = unsafe { api::cuStreamGetCtx(stream, &mut ctx) };
    check(rc, || {
        format!(
            "finding the context of the caller's stream on GPU {}",
            primary.ordinal
        )
    })?;
    if ctx.is_null() || ctx == primary.ctx {
        return Ok(primary.clone());
    }
    Ok(Arc::new(Context {
        device: primary.device,
        ctx,
        ordinal: primary.ordinal,
    }))
}

/// Device memory from `cuMemAlloc` (benchmarks, tests, the CLI's device buffers).
#[derive(Debug)]
pub struct DeviceBuffer {
    ptr: u64,
    len: u64,
    ctx: Arc<Context>,
}

impl DeviceBuffer {
    /// Allocates `len` bytes on device `ordinal`.
    ///
    /// # Errors
    /// [`Error::Device`].
    pub fn new(ordinal: i32, len: u64) -> Result<DeviceBuffer> {
        let ctx = context(ordinal)?;
        let _current = ctx.enter()?;
        let mut ptr = 0;
        // SAFETY: writes one device address.
        let rc = unsafe { api::cuMemAlloc_v2(&mut ptr, len.max(1) as usize) };
        check(rc, || {
            format!("cuMemAlloc of {len} bytes on device {ordinal}")
        })?;
        drop(_current);
        Ok(DeviceBuffer { ptr, len, ctx })
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ctx.ordinal
    }

    /// Copies `src` into the buffer at `offset` (synchronously).
    ///
    /// # Errors
    /// [`Error::InvalidRead`] if it does not fit, [`Error::Device`].
    pub fn upload(&self, offset: u64, src: &[u8]) -> Result<()> {
        self.range(offset, src.len() as u64)?;
        let s = Stream::new(&self.ctx)?;
        // SAFETY: the range lies inside this allocation (checked); `src` lives until the
        // stream is synchronised below.
        let r = unsafe { s.copy_htod(self.ptr + offset, src.as_ptr(), src.len() as u64) };
        s.synchronize().and(r)
    }

    /// Copies the buffer's bytes at `offset` into `dst` (synchronously).
    ///
    /// # Errors
    /// [`Error::InvalidRead`] if it does not fit, [`Error::Device`].
    pub fn download(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.range(offset, dst.len() as u64)?;
        let s = Stream::new(&self.ctx)?;
        // SAFETY: as in `upload`, for writes into `dst`.
        let r = unsafe { s.copy_dtoh(dst.as_mut_ptr(), self.ptr + offset, dst.len() as u64) };
        s.synchronize().and(r)
    }

    /// Copies all of `src` (same length) into this buffer, device to device, and waits: the
    /// plain device copy that benchmarks compare with.
    ///
    /// # Errors
    /// [`Error::InvalidRead`] for a length mismatch, [`Error::Device`].
    pub fn copy_from(&self, src: &DeviceBuffer) -> Result<()> {
        self.range(0, src.len)?;
        let s = Stream::new(&self.ctx)?;
        // SAFETY: both are live allocations of at least `src.len` bytes (checked).
        let r = unsafe { s.copy_dtod(self.ptr, src.ptr, src.len) };
        s.synchronize().and(r)
    }

    fn range(&self, offset: u64, n: u64) -> Result<()> {
        if offset.checked_add(n).is_none_or(|e| e > self.len) {
            return Err(Error::InvalidRead {
                key: format!("device buffer of {} bytes", self.len),
                reason: format!("{n} bytes at offset {offset} do not fit"),
            });
        }
        Ok(())
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _current = self.ctx.enter();
        // SAFETY: frees the allocation made in `new`; callers finish their copies first.
        unsafe {
            api::cuMemFree_v2(self.ptr);
        }
    }
}

/// The readiness event of a device tensor.
#[derive(Debug)]
pub(crate) struct Ready(pub(crate) Event);

/// Records an event on `stream` (a raw `CUstream` of this process; 0 is the legacy default
/// stream) on device `ordinal`, now: the writer's copies of a tensor wait for it.
pub(crate) fn record_ready(ordinal: i32, stream: u64) -> Result<Ready> {
    event_on(ordinal, stream).map(Ready)
}
