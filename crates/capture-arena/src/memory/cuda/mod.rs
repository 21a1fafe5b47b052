//! Device regions: arenas in GPU memory (cargo feature `cuda`).
//!
//! - [`DeviceRegion`]: one allocation on the writer's GPU through CUDA's virtual-memory API
//!   (`cuMemCreate` → `cuMemAddressReserve` → `cuMemMap` → `cuMemSetAccess`), its size rounded
//!   up to the allocation granularity, exportable with a **fabric** handle where the device can
//!   really make one (multi-node NVLink, GB200/GB300 NVL72) and otherwise a **POSIX file
//!   descriptor** (processes on this node, handed over the writer's reply path).
//! - [`ExternalDeviceRegion`]: device memory someone else allocated and keeps alive (a transfer
//!   engine's buffer, a `cudaMalloc`), published under the owner's session.
//!
//! Both copy a batch with asynchronous copies on the writer's own stream: it first waits on
//! each device source's ready event (recorded on the producer's stream when the tensor was
//! handed over), then copies device sources device-to-device and host sources host-to-device,
//! records a completion event and enqueues a host function that wakes the writer. The writer
//! serves control input meanwhile and commits the batch when the event has completed.
//!
//! The session of a [`DeviceRegion`] (see [`CudaSession`]) says how to reach the handle:
//! `cuda://<host>/<pid>-<nonce>?len=..&base=..&dev=<gpu uuid>&handle=fd&reply=@...` or
//! `...&handle=fabric&fabric=<128 hex digits>`.

mod session;

pub use crate::driver::{driver, DeviceBuffer, DriverInfo, HandleType};
pub use session::{CudaSession, MAX_CUDA_SESSION_BYTES};

use std::ffi::c_void;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::driver::{self, context, Allocation, Context, Event, Mapped, Stream};

use crate::error::{Error, Result};
use crate::memory::{CopyOp, Notifier, Progress, Region, Reply};
use crate::tensor::TensorData;

pub use crate::memory::HandlePreference;

/// Why a handle type was chosen, for the log and for `capture-arena` diagnostics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandleChoice {
    /// The type chosen.
    pub handle: HandleType,
    /// Why.
    pub reason: String,
}

/// Decides between fabric and POSIX fd from what the device reports and what a trial of the
/// fabric path returned (`None`: not tried). Pure, so it is tested without a GPU.
pub fn choose_handle(
    preference: HandlePreference,
    fabric_attribute: bool,
    fabric_trial: Option<std::result::Result<String, String>>,
) -> std::result::Result<HandleChoice, String> {
    let fd = |reason: String| {
        Ok(HandleChoice {
            handle: HandleType::PosixFd,
            reason,
        })
    };
    match preference {
        HandlePreference::PosixFd => fd("POSIX fd requested".into()),
        HandlePreference::Auto | HandlePreference::Fabric => {
            if !fabric_attribute {
                if preference == HandlePreference::Fabric {
                    return Err("the device does not report fabric handle support \
                         (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 0)"
                        .into());
                }
                return fd("the device reports no fabric handle support; POSIX fd \
                     (readers on this node only)"
                    .into());
            }
            match fabric_trial {
                Some(Ok(note)) => Ok(HandleChoice {
                    handle: HandleType::Fabric,
                    reason: format!(
                        "the device supports fabric handles, and a fabric allocation was \
                         created, exported and imported again ({note})"
                    ),
                }),
                Some(Err(e)) if preference == HandlePreference::Auto => fd(format!(
                    "the device reports fabric support but the fabric path is not usable \
                     ({e}); POSIX fd (readers on this node only)"
                )),
                Some(Err(e)) => Err(format!("the fabric path is not usable: {e}")),
                None => Err("the fabric path was not tried".into()),
            }
        }
    }
}

/// `n` rounded up to a multiple of `granularity` (a power of two or not), `None` on overflow.
pub fn round_up(n: u64, granularity: u64) -> Option<u64> {
    let g = granularity.max(1);
    n.checked_add(g - 1).map(|v| v / g * g)
}

/// Copies `n` bytes at `from` of a device tensor to host memory at `dst`, after its ready
/// event, and waits for the copy.
///
/// # Safety
/// `dst` valid for writes of `n` bytes; `from + n <= data.len` (the caller checks).
pub(crate) unsafe fn device_to_host(
    data: &crate::tensor::DeviceData,
    from: u64,
    dst: *mut u8,
    n: u64,
) -> Result<()> {
    let s = Stream::new(&context(data.device)?)?;
    if let Some(r) = &data.ready {
        s.wait(&r.0)?;
    }
    // SAFETY: as the caller promised; the tensor's memory is valid (TensorData::device).
    let r = unsafe { s.copy_dtoh(dst, data.ptr + from, n) };
    s.synchronize().and(r)
}

/// Copies `n` host bytes at `src` to device memory at `dst` on device `ordinal`, and waits.
///
/// # Safety
/// `src` valid for reads and `dst` valid device memory for `n` bytes.
pub(crate) unsafe fn host_to_device(
    ordinal: i32,
    dst: u64,
    src: *const u8,
    n: u64,
    after: Option<u64>,
) -> Result<()> {
    let s = Stream::new(&context(ordinal)?)?;
    if let Some(stream) = after {
        // The caller's work on its stream (e.g. a kernel still using the buffer) comes first.
        s.wait(&driver::event_on(ordinal, stream)?)?;
    }
    // SAFETY: as the caller promised.
    let r = unsafe { s.copy_htod(dst, src, n) };
    s.synchronize().and(r)
}

/// Blocks until the work enqueued so far on `stream` (a raw `CUstream` of device `ordinal`; 0
/// is the legacy default stream) is done: a copy made outside CUDA's streams (NIXL's) into a
/// buffer comes after the caller's kernels on it.
#[cfg_attr(not(feature = "nixl"), allow(dead_code))]
pub(crate) fn wait_for_stream(ordinal: i32, stream: u64) -> Result<()> {
    let s = Stream::new(&context(ordinal)?)?;
    s.wait(&driver::event_on(ordinal, stream)?)?;
    s.synchronize()
}

/// The writer's stream and the batch in flight on it.
#[derive(Debug)]
struct Copier {
    ctx: Arc<Context>,
    stream: Stream,
    done: Event,
    /// Boxed so its address stays fixed for the host function that wakes the writer.
    notifier: Option<Box<Notifier>>,
    in_flight: bool,
    /// Recorded on `stream` before a batch's copies from other GPUs, which wait for it (so a
    /// freed object's stamp is cleared before anything else is placed there).
    fence: Event,
    /// Copies from tensors on other GPUs run on a stream of the source's GPU (made on first
    /// use), whose context can read the source (memory of a VMM pool, torch's expandable
    /// segments, is accessible only to the devices it was granted to; the arena is mapped for
    /// every peer); `stream` waits for each one's join event.
    peers: Vec<Peer>,
    /// Whether other GPUs may write the region (capture-arena's own arena, mapped for every
    /// peer); else every copy runs on `stream`.
    peers_write: bool,
}

/// A stream of another GPU that copies that GPU's tensors into the arena.
#[derive(Debug)]
struct Peer {
    ordinal: i32,
    stream: Stream,
    /// Recorded after the batch's copies on `stream`; the writer's stream waits for it.
    joined: Event,
}

/// The host function enqueued after a batch's copies: wakes the writer.
unsafe extern "C" fn wake_writer(data: *mut c_void) {
    // SAFETY: `data` is the Copier's boxed Notifier, which outlives every host function enqueued
    // (the Copier synchronises its stream before it drops the box).
    let n = unsafe { &*(data as *const Notifier) };
    n.notify();
}

impl Copier {
    fn new(ctx: Arc<Context>, peers_write: bool) -> Result<Copier> {
        Ok(Copier {
            peers_write,
            stream: Stream::new(&ctx)?,
            done: Event::new(&ctx)?,
            fence: Event::new(&ctx)?,
            ctx,
            notifier: None,
            in_flight: false,
            peers: Vec::new(),
        })
    }

    /// The stream of GPU `ordinal` for copies from its tensors, made on first use.
    fn peer(&mut self, ordinal: i32) -> Result<usize> {
        if let Some(i) = self.peers.iter().position(|p| p.ordinal == ordinal) {
            return Ok(i);
        }
        let ctx = context(ordinal)?;
        self.peers.push(Peer {
            ordinal,
            stream: Stream::new(&ctx)?,
            joined: Event::new(&ctx)?,
        });
        Ok(self.peers.len() - 1)
    }

    /// Waits for every copy enqueued so far, on every stream (errors logged).
    fn synchronize_all(&self, why: &str) {
        for s in std::iter::once(&self.stream).chain(self.peers.iter().map(|p| &p.stream)) {
            if let Err(e) = s.synchronize() {
                tracing::error!(error = %e, "{why}");
            }
        }
    }

    /// Enqueues every copy of a batch into `[base, base + len)`.
    fn start(&mut self, base: u64, len: u64, ops: &[CopyOp<'_>]) -> Result<()> {
        crate::memory::check_ops(base, len, ops)?;
        let _current = self.ctx.enter()?;
        let enqueued = self.enqueue(base, ops);
        if enqueued.is_err() {
            // Copies already enqueued may still read the sources: finish them before the
            // caller drops the batch.
            self.synchronize_all("waiting for a failed batch's device copies");
            return enqueued;
        }
        self.in_flight = true;
        Ok(())
    }

    fn enqueue(&mut self, base: u64, ops: &[CopyOp<'_>]) -> Result<()> {
        // Host sources first: a copy from pageable host memory may wait for the stream's earlier
        // work, which must not include the producer's kernels (the writer thread would block).
        for op in ops {
            if let Some((src, n)) = op.data.host_source() {
                // SAFETY: the destination lies inside the region (checked in `start`); host
                // sources are valid for reads of `n` bytes and unchanged while the batch lives
                // (TensorData's contract), which the writer keeps until `progress` reports Done
                // or `abandon` synchronised the stream.
                unsafe { self.stream.copy_htod(base + op.offset, src, n as u64)? }
            }
        }
        let mut fenced = false;
        let mut used: Vec<usize> = Vec::new();
        for op in ops {
            if let TensorData::Device(d) = op.data {
                let stream = if d.device == self.ctx.ordinal || !self.peers_write {
                    &self.stream
                } else {
                    if !fenced {
                        self.fence.record(&self.stream)?;
                        fenced = true;
                    }
                    let i = self.peer(d.device)?;
                    if !used.contains(&i) {
                        self.peers[i].stream.wait(&self.fence)?;
                        used.push(i);
                    }
                    &self.peers[i].stream
                };
                if let Some(ready) = &d.ready {
                    stream.wait(&ready.0)?;
                }
                // SAFETY: as above; the source is device memory its constructor's caller
                // promised stays valid and unchanged until the batch's data is dropped; the
                // arena is mapped for every peer of its GPU (`Mapped::new`).
                unsafe { stream.copy_dtod(base + op.offset, d.ptr, d.len)? }
            }
        }
        for &i in &used {
            let peer = &self.peers[i];
            peer.joined.record(&peer.stream)?;
            self.stream.wait(&peer.joined)?;
        }
        self.done.record(&self.stream)?;
        if let Some(n) = &self.notifier {
            let data = (&**n as *const Notifier).cast_mut().cast::<c_void>();
            // SAFETY: the boxed notifier outlives the host function (see `wake_writer`), which
            // makes no CUDA call.
            unsafe { self.stream.host_func(wake_writer, data)? };
        }
        Ok(())
    }

    fn progress(&mut self) -> Result<Progress> {
        if !self.in_flight {
            return Ok(Progress::Done);
        }
        match self.done.query() {
            Ok(true) => {
                self.in_flight = false;
                Ok(Progress::Done)
            }
            Ok(false) => {
                // A fault on another GPU's stream is that context's error: the join it never
                // records would keep `done` waiting. Its event says so.
                match self.peers.iter().find_map(|p| p.joined.query().err()) {
                    Some(e) => {
                        self.synchronize_all("waiting for device copies after a fault");
                        self.in_flight = false;
                        Err(e)
                    }
                    None => Ok(Progress::Waiting),
                }
            }
            Err(e) => {
                self.synchronize_all("waiting for device copies after a fault");
                self.in_flight = false;
                Err(e)
            }
        }
    }

    fn abandon(&mut self) {
        if self.in_flight {
            self.synchronize_all("waiting for abandoned device copies failed");
            self.in_flight = false;
        }
    }

    /// Enqueues zeroes to `[base + offset, + len)` (at most 8 bytes: a stamp) on the copy
    /// stream, ahead of every later copy that may place another object there.
    fn clear(&mut self, base: u64, region_len: u64, offset: u64, len: u64) {
        static ZEROS: [u8; 8] = [0; 8];
        if len > ZEROS.len() as u64 || !crate::memory::clear_in_range(offset, len, region_len) {
            return;
        }
        let enqueued = self.ctx.enter().and_then(|_current| {
            // SAFETY: the destination lies inside the region (checked); the source is static.
            unsafe { self.stream.copy_htod(base + offset, ZEROS.as_ptr(), len) }
        });
        if let Err(e) = enqueued {
            tracing::error!(error = %e, "clearing a freed object's stamp on the device");
        }
    }
}

impl Copier {
    /// Writes `word` at `offset` of `[base, base + region_len)` and waits until it landed (after
    /// the copies enqueued before it: it is a stamp word, written once its object's bytes are).
    fn set_word(&mut self, base: u64, region_len: u64, offset: u64, word: u64) {
        if !offset.is_multiple_of(8) || !crate::memory::clear_in_range(offset, 8, region_len) {
            tracing::error!(offset, "a stamp word outside the arena or not aligned");
            return;
        }
        let bytes = word.to_le_bytes();
        let written = self.ctx.enter().and_then(|_current| {
            // SAFETY: the destination lies inside the region (checked); the source lives until
            // the stream is synchronised below.
            unsafe { self.stream.copy_htod(base + offset, bytes.as_ptr(), 8) }?;
            self.stream.synchronize()
        });
        if let Err(e) = written {
            tracing::error!(error = %e, "writing a stamp word on the device");
        }
    }
}

impl Drop for Copier {
    fn drop(&mut self) {
        // Host functions and copies must finish before the notifier and the memory go.
        self.synchronize_all("waiting for device copies before dropping the region");
    }
}

/// How a [`DeviceRegion`] is made.
#[derive(Debug, Clone, Default)]
pub struct DeviceRegionOptions {
    /// The writer's GPU (ordinal in this process).
    pub device: i32,
    /// Handle type policy.
    pub handle: HandlePreference,
}

/// See the module docs.
#[derive(Debug)]
pub struct DeviceRegion {
    // Field order is drop order: copies finish (copier), then the mapping goes, then the
    // context.
    copier: Copier,
    mapped: Mapped,
    len: u64,
    session: CudaSession,
    text: String,
    choice: HandleChoice,
    /// For POSIX-fd regions: one exported descriptor, duplicated for each reader.
    fd: Option<OwnedFd>,
    ctx: Arc<Context>,
}

impl DeviceRegion {
    /// Allocates at least `len` bytes on `options.device` (rounded up to the granularity).
    ///
    /// # Errors
    /// [`Error::Device`] when no driver or device is usable or an allocation step fails (with
    /// the CUDA error and the size); [`Error::Config`] for a size of 0.
    pub fn create(len: u64, options: &DeviceRegionOptions) -> Result<DeviceRegion> {
        if len == 0 {
            return Err(Error::config(
                "SGLANG_SPEC_CAPTURE_ARENA_BYTES",
                "a device arena needs at least one byte",
            ));
        }
        driver()?;
        let ctx = context(options.device)?;
        let attribute = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED,
        ) == 1;
        // The attribute alone is no proof (no IMEX channel: NOT_PERMITTED): try the real thing,
        // at the real size, and keep it if it works. A fabric arena is exportable as a POSIX
        // descriptor too (as NCCL asks for both), so a reader on this node whose process cannot
        // import the fabric handle (no IMEX channel in its container) gets the descriptor.
        let both = [HandleType::Fabric, HandleType::PosixFd];
        let mut fabric: Option<(Allocation, [u8; 64], u64)> = None;
        // The GPU's registration with its fabric is asked of NVML first, as NCCL does: a fabric
        // handle of a GPU whose registration is not complete does not import anywhere else. The
        // trial then imports its own export again, the step every reader takes (an IMEX channel
        // that lets a process create and export but not import is half set up).
        let trial = if attribute && options.handle != HandlePreference::PosixFd {
            let note = match driver::fabric(&ctx.uuid()?) {
                driver::Fabric::NotReady(why) => Err(why),
                driver::Fabric::Ready { cluster, clique } => Ok(format!(
                    "NVML: fabric registration complete, cluster {cluster}, clique {clique}"
                )),
                driver::Fabric::Unknown(why) => Ok(format!("fabric registration unchecked: {why}")),
            };
            Some(note.and_then(|note| {
                driver::granularity(&ctx, &both)
                    .and_then(|g| {
                        let size = round_up(len, g).ok_or_else(|| too_large(len))?;
                        let a = Allocation::create(&ctx, size, &both)?;
                        let h = a.export_fabric()?;
                        drop(Allocation::import_fabric(&ctx, &h, size)?);
                        fabric = Some((a, h, g));
                        Ok(())
                    })
                    .map(|()| note.clone())
                    .map_err(|e| {
                        format!(
                            "{e}; usually no IMEX channel in /dev/nvidia-caps-imex-channels ({note})"
                        )
                    })
            }))
        } else {
            None
        };
        let choice = choose_handle(options.handle, attribute, trial)
            .map_err(|r| Error::device(format!("device arena on GPU {}", options.device), r))?;
        tracing::info!(
            device = options.device,
            name = %ctx.name(),
            handle = choice.handle.name(),
            reason = %choice.reason,
            "device arena handle type"
        );
        let (allocation, fabric_handle, granularity) = match (choice.handle, fabric) {
            (HandleType::Fabric, Some((a, h, g))) => (a, Some(h), g),
            _ => {
                let g = driver::granularity(&ctx, &[HandleType::PosixFd])?;
                let size = round_up(len, g).ok_or_else(|| too_large(len))?;
                (
                    Allocation::create(&ctx, size, &[HandleType::PosixFd])?,
                    None,
                    g,
                )
            }
        };
        // Every arena is exportable as a descriptor (a fabric one too, see above).
        let fd = Some(allocation.export_fd()?);
        let size = allocation.size;
        // The arena's GPU and every GPU that can reach it: copies from tensors there may run on
        // their copy engines.
        let mapped = Mapped::new(allocation, granularity, &driver::peers_of(options.device)?)?;
        let session = CudaSession {
            host: crate::memory::this_host(),
            pid: std::process::id(),
            nonce: crate::random::nonce()?,
            len: size,
            base: mapped.ptr,
            device_uuid: ctx.uuid()?,
            handle: choice.handle,
            fabric: fabric_handle,
            reply: String::new(),
        };
        Ok(DeviceRegion {
            // Mapped for every peer of its GPU (above): other GPUs' streams may write it.
            copier: Copier::new(ctx.clone(), true)?,
            len: size,
            text: session.to_string(),
            session,
            mapped,
            choice,
            fd,
            ctx,
        })
    }

    /// The handle type chosen and why.
    pub fn handle_choice(&self) -> &HandleChoice {
        &self.choice
    }

    /// The parsed session.
    pub fn cuda_session(&self) -> &CudaSession {
        &self.session
    }

    /// The device address of offset 0.
    pub fn device_ptr(&self) -> u64 {
        self.mapped.ptr
    }
}

fn too_large(len: u64) -> Error {
    Error::config(
        "SGLANG_SPEC_CAPTURE_ARENA_BYTES",
        format!("{len} bytes is too large"),
    )
}

impl Region for DeviceRegion {
    fn len(&self) -> u64 {
        self.len
    }

    fn base_address(&self) -> u64 {
        self.mapped.ptr
    }

    fn session(&self) -> &str {
        &self.text
    }

    fn set_notifier(&mut self, notifier: Notifier) {
        self.copier.notifier = Some(Box::new(notifier));
    }

    fn set_reply_endpoint(&mut self, endpoint: &str) {
        self.session.reply = endpoint.to_owned();
        self.text = self.session.to_string();
    }

    unsafe fn start(&mut self, ops: &[CopyOp<'_>]) -> Result<()> {
        self.copier.start(self.mapped.ptr, self.len, ops)
    }

    fn progress(&mut self, _ops: &[CopyOp<'_>], _budget: u64) -> Result<Progress> {
        self.copier.progress()
    }

    fn abandon(&mut self) {
        self.copier.abandon();
    }

    fn clear(&mut self, offset: u64, len: u64) {
        self.copier.clear(self.mapped.ptr, self.len, offset, len);
    }

    fn set_word(&mut self, offset: u64, word: u64) {
        self.copier
            .set_word(self.mapped.ptr, self.len, offset, word);
    }

    /// `"cuda-fd"`: the arena's POSIX descriptor with the session as its bytes (so the reader
    /// checks it reached the arena it asked for); `"describe"`: the session, size and handle.
    fn reply(&self, what: &str) -> Option<Result<Reply>> {
        match what {
            "cuda-fd" => Some(match &self.fd {
                Some(fd) => fd
                    .try_clone()
                    .map(|fd| Reply {
                        bytes: self.text.clone().into_bytes(),
                        fds: vec![fd],
                    })
                    .map_err(|e| Error::io("duplicating the arena's descriptor", e)),
                None => Err(Error::device(
                    "handing out the arena's descriptor",
                    "this arena has no descriptor",
                )),
            }),
            "describe" => Some(Ok(Reply {
                bytes: serde_json::json!({
                    "session": self.text,
                    "len": self.len,
                    "base": self.mapped.ptr,
                    "device": self.ctx.ordinal,
                    "device_name": self.ctx.name(),
                    "handle": self.choice.handle.name(),
                    "handle_reason": self.choice.reason,
                })
                .to_string()
                .into_bytes(),
                fds: Vec::new(),
            })),
            _ => None,
        }
    }
}

/// Device memory that someone else allocated and keeps alive (a transfer engine's buffer, a
/// `cudaMalloc`), published under a session its owner chose (the engine's, whose readers reach
/// it). The writer copies into it exactly as into its own [`DeviceRegion`].
pub struct ExternalDeviceRegion {
    copier: Copier,
    ptr: u64,
    len: u64,
    session: String,
    _owner: Box<dyn Send>,
}

impl std::fmt::Debug for ExternalDeviceRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExternalDeviceRegion")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("session", &self.session)
            .finish()
    }
}

impl ExternalDeviceRegion {
    /// `len` bytes of device memory at `ptr` on device `ordinal`, advertised as `session`
    /// (addresses in results are `ptr + offset`), kept alive by `owner`, which is dropped after
    /// the last copy.
    ///
    /// # Errors
    /// [`Error::Device`] without a usable driver or device, or when the driver says the range is
    /// not memory of `ordinal` (host memory, say: Mooncake's `allocate_managed_buffer` returns
    /// `malloc` memory when an earlier TransferEngine in the process set its process-wide
    /// allocator up for another protocol).
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be device memory of `ordinal` (or mapped for it), writable, and
    /// valid until `owner` is dropped; nobody else may write it while the writer holds it.
    pub unsafe fn new(
        ptr: u64,
        len: u64,
        ordinal: i32,
        session: String,
        owner: impl Send + 'static,
    ) -> Result<ExternalDeviceRegion> {
        crate::memory::check_session(&session)?;
        let ctx = context(ordinal)?;
        {
            let _current = ctx.enter()?;
            driver::check_device_range(ptr, len, ordinal).map_err(|e| match e {
                Error::Device { what, reason } => Error::Device {
                    what,
                    reason: format!(
                        "{reason}. A device arena taken from elsewhere must be device memory of \
                         its GPU; a Mooncake TransferEngine's allocate_managed_buffer returns \
                         host memory when an earlier TransferEngine in this process was \
                         initialised with another protocol (its allocator is process-wide: \
                         the first initialize() picks it). Set \
                         SGLANG_SPEC_CAPTURE_PLACEMENT=arena for capture-arena's own device arena"
                    ),
                },
                other => other,
            })?;
        }
        Ok(ExternalDeviceRegion {
            // Someone else's mapping, whose access grants are unknown: every copy runs on
            // its GPU's stream.
            copier: Copier::new(ctx, false)?,
            ptr,
            len,
            session,
            _owner: Box::new(owner),
        })
    }
}

impl Region for ExternalDeviceRegion {
    fn len(&self) -> u64 {
        self.len
    }

    fn base_address(&self) -> u64 {
        self.ptr
    }

    fn session(&self) -> &str {
        &self.session
    }

    fn set_notifier(&mut self, notifier: Notifier) {
        self.copier.notifier = Some(Box::new(notifier));
    }

    unsafe fn start(&mut self, ops: &[CopyOp<'_>]) -> Result<()> {
        self.copier.start(self.ptr, self.len, ops)
    }

    fn progress(&mut self, _ops: &[CopyOp<'_>], _budget: u64) -> Result<Progress> {
        self.copier.progress()
    }

    fn abandon(&mut self) {
        self.copier.abandon();
    }

    fn clear(&mut self, offset: u64, len: u64) {
        self.copier.clear(self.ptr, self.len, offset, len);
    }

    fn set_word(&mut self, offset: u64, word: u64) {
        self.copier.set_word(self.ptr, self.len, offset, word);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn granularity_rounding() {
        let g = 2 << 20;
        assert_eq!(round_up(1, g), Some(g));
        assert_eq!(round_up(g, g), Some(g));
        assert_eq!(round_up(g + 1, g), Some(2 * g));
        assert_eq!(round_up(0, g), Some(0));
        assert_eq!(round_up(10, 3), Some(12));
        assert_eq!(round_up(u64::MAX - 1, g), None);
        assert_eq!(round_up(5, 0), Some(5));
    }

    #[test]
    fn handle_choice_needs_attribute_and_a_real_export() {
        use HandlePreference::*;
        let c = choose_handle(Auto, true, Some(Ok("NVML: complete".into()))).unwrap();
        assert_eq!(c.handle, HandleType::Fabric);
        assert!(c.reason.contains("NVML: complete"), "{}", c.reason);
        // The attribute alone is no proof: without an IMEX channel the create fails.
        let c = choose_handle(
            Auto,
            true,
            Some(Err(
                "CUDA_ERROR_NOT_PERMITTED (800); usually no IMEX channel".into(),
            )),
        )
        .unwrap();
        assert_eq!(c.handle, HandleType::PosixFd);
        assert!(c.reason.contains("NOT_PERMITTED") && c.reason.contains("IMEX"));
        let c = choose_handle(Auto, false, None).unwrap();
        assert_eq!(c.handle, HandleType::PosixFd);
        assert!(c.reason.contains("no fabric handle support"));
        assert_eq!(
            choose_handle(PosixFd, true, Some(Ok(String::new())))
                .unwrap()
                .handle,
            HandleType::PosixFd
        );
        assert!(choose_handle(Fabric, false, None).is_err());
        assert!(choose_handle(Fabric, true, Some(Err("x".into()))).is_err());
    }
}
