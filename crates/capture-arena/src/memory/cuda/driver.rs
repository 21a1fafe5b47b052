//! The CUDA driver, through `cudarc`'s sys layer loaded at run time: every `unsafe` FFI call of
//! the device path lives here, each wrapped so that it returns [`Error::Device`] instead of a
//! code, and nothing here panics.
//!
//! cudarc panics on the first call when `libcuda` or one of its symbols is missing; [`driver`]
//! therefore opens the library itself first (the same candidates, in the same order, so it finds
//! the same file), checks every symbol in [`SYMBOLS`] and calls `cuInit`. Only after that has
//! succeeded does any other function here call into cudarc. A build with the `cuda` feature
//! therefore starts on a machine without a GPU or driver and fails only when a device arena or
//! a device read is asked for.

use std::ffi::{c_int, c_void, CStr};
use std::sync::OnceLock;

use cudarc::driver::sys as cu;

use crate::error::{Error, Result};

/// Every driver entry point this module calls. Checked before the first call.
pub(crate) const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDeviceGetName",
    "cuDeviceGetUuid",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuMemGetAllocationGranularity",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuLaunchHostFunc",
];

/// What the probe found: the driver's version and the devices this process sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverInfo {
    /// The library file that was loaded.
    pub library: String,
    /// `cuDriverGetVersion` (12080 for 12.8).
    pub version: i32,
    /// Devices visible to this process.
    pub devices: i32,
}

/// Opens and initialises the driver once per process; every later call returns the same answer.
///
/// # Errors
/// [`Error::Device`] naming the library candidates tried, the missing symbol or `cuInit`'s code,
/// with what to do about it.
pub fn driver() -> Result<&'static DriverInfo> {
    static DRIVER: OnceLock<std::result::Result<DriverInfo, String>> = OnceLock::new();
    DRIVER
        .get_or_init(load)
        .as_ref()
        .map_err(|reason| Error::device("loading the CUDA driver", reason.clone()))
}

fn load() -> std::result::Result<DriverInfo, String> {
    let mut candidates: Vec<String> = Vec::new();
    for c in cudarc::get_lib_name_candidates("cuda") {
        if !candidates.contains(&c) {
            candidates.push(c);
        }
    }
    // The same search cudarc's `culib()` makes, so the library checked here is the one it uses.
    let found = candidates.iter().find_map(|name| {
        // SAFETY: loading a shared library runs its initialisers; the CUDA driver's are what any
        // CUDA program runs. Nothing is called through it here.
        unsafe { libloading::Library::new(name) }
            .ok()
            .map(|lib| (name.clone(), lib))
    });
    let Some((library, lib)) = found else {
        return Err(format!(
            "no CUDA driver library in this process's search path (tried {}); install the \
             NVIDIA driver, or run where a GPU is visible (the host arena needs neither: unset \
             SGLANG_SPEC_CAPTURE_GPU_PUT and use a protocol other than nvlink)",
            candidates.join(", ")
        ));
    };
    for sym in SYMBOLS {
        // SAFETY: only looks the symbol up; the pointer is not called or kept.
        let got = unsafe { lib.get::<*const c_void>(sym.as_bytes()) };
        if got.is_err() {
            return Err(format!(
                "{library} has no symbol {sym}: the driver is too old for capture-arena \
                 (CUDA 12.3 or newer is needed)"
            ));
        }
    }
    // Keep the library loaded for the process's life (cudarc holds its own handle too).
    std::mem::forget(lib);
    // SAFETY: the library and every symbol used by this module were found above.
    let rc = unsafe { cu::cuInit(0) };
    if rc != cu::CUresult::CUDA_SUCCESS {
        return Err(format!(
            "cuInit failed with {}: no usable GPU or driver (check nvidia-smi, \
             CUDA_VISIBLE_DEVICES and the container's device access)",
            describe(rc)
        ));
    }
    let mut version = 0;
    let mut devices = 0;
    // SAFETY: the driver is initialised; both write one int.
    unsafe {
        cu::cuDriverGetVersion(&mut version);
        cu::cuDeviceGetCount(&mut devices);
    }
    Ok(DriverInfo {
        library,
        version,
        devices,
    })
}

/// `CUDA_ERROR_NOT_PERMITTED (800): operation not permitted`.
fn describe(rc: cu::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: only called once the driver is loaded (from `check` or `load` after the symbol
    // check); both calls write a pointer to a static string or leave it null.
    unsafe {
        cu::cuGetErrorName(rc, &mut name);
        cu::cuGetErrorString(rc, &mut text);
    }
    let s = |p: *const std::ffi::c_char| {
        if p.is_null() {
            "unknown".to_owned()
        } else {
            // SAFETY: the driver returns NUL-terminated static strings.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    format!("{} ({}): {}", s(name), rc as u32, s(text))
}

/// Turns a driver code into a result.
pub(crate) fn check(rc: cu::CUresult, what: impl FnOnce() -> String) -> Result<()> {
    if rc == cu::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::device(what(), describe(rc)))
    }
}

/// A device's primary context, retained for this value's life. Every call that needs a current
/// context binds it first (cheap), so any thread may use it.
#[derive(Debug)]
pub(crate) struct Context {
    device: cu::CUdevice,
    ctx: cu::CUcontext,
    /// The device ordinal in this process.
    pub ordinal: i32,
}

// SAFETY: a CUDA context may be made current on any thread; the handle is only passed to the
// driver, which synchronises internally.
unsafe impl Send for Context {}
// SAFETY: as above; no method mutates `self`.
unsafe impl Sync for Context {}

impl Context {
    /// Retains the primary context of device `ordinal`.
    pub fn new(ordinal: i32) -> Result<Context> {
        let info = driver()?;
        if ordinal < 0 || ordinal >= info.devices {
            return Err(Error::device(
                format!("opening CUDA device {ordinal}"),
                format!(
                    "this process sees {} device(s) (CUDA_VISIBLE_DEVICES decides which); set \
                     SGLANG_SPEC_CAPTURE_ARENA_DEVICE to one of them",
                    info.devices
                ),
            ));
        }
        let mut device = 0;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: the driver is loaded and initialised; both calls write one handle.
        unsafe {
            check(cu::cuDeviceGet(&mut device, ordinal), || {
                format!("cuDeviceGet({ordinal})")
            })?;
            check(cu::cuDevicePrimaryCtxRetain(&mut ctx, device), || {
                format!("retaining the primary context of device {ordinal}")
            })?;
        }
        let c = Context {
            device,
            ctx,
            ordinal,
        };
        c.bind()?;
        Ok(c)
    }

    /// Makes this context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: `ctx` is a retained primary context, valid until drop.
        check(unsafe { cu::cuCtxSetCurrent(self.ctx) }, || {
            format!("making device {}'s context current", self.ordinal)
        })
    }

    /// An integer attribute of the device (0 when the driver does not know it).
    pub fn attribute(&self, attr: cu::CUdevice_attribute) -> i32 {
        let mut v: c_int = 0;
        // SAFETY: writes one int; an unknown attribute returns an error and leaves 0.
        let rc = unsafe { cu::cuDeviceGetAttribute(&mut v, attr, self.device) };
        if rc == cu::CUresult::CUDA_SUCCESS {
            v
        } else {
            0
        }
    }

    /// The device's name (`NVIDIA H200`).
    pub fn name(&self) -> String {
        let mut buf = [0 as std::ffi::c_char; 128];
        // SAFETY: the driver writes at most `len` bytes, NUL-terminated.
        let rc = unsafe { cu::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as c_int, self.device) };
        if rc != cu::CUresult::CUDA_SUCCESS {
            return "unknown".into();
        }
        // SAFETY: NUL-terminated within the buffer (the driver's contract; the last byte is 0).
        unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    /// The device's UUID as 32 hex digits: the same GPU has the same UUID in every process,
    /// whatever its ordinal there.
    pub fn uuid(&self) -> Result<String> {
        let mut u = cu::CUuuid_st { bytes: [0; 16] };
        // SAFETY: writes 16 bytes.
        check(unsafe { cu::cuDeviceGetUuid(&mut u, self.device) }, || {
            format!("cuDeviceGetUuid({})", self.ordinal)
        })?;
        Ok(u.bytes
            .iter()
            .map(|b| format!("{:02x}", *b as u8))
            .collect())
    }

    /// True when this device can access memory of `other` directly (peer access).
    pub fn can_access_peer(&self, other: &Context) -> bool {
        let mut v: c_int = 0;
        // SAFETY: writes one int.
        let rc = unsafe { cu::cuDeviceCanAccessPeer(&mut v, self.device, other.device) };
        rc == cu::CUresult::CUDA_SUCCESS && v == 1
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: releases the retain taken in `new`.
        unsafe {
            cu::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}

/// The index of the device whose UUID is `uuid` in this process, if it sees it.
pub(crate) fn ordinal_of(uuid: &str) -> Result<Option<i32>> {
    let info = driver()?;
    for ordinal in 0..info.devices {
        let mut device = 0;
        let mut u = cu::CUuuid_st { bytes: [0; 16] };
        // SAFETY: the driver is initialised; each call writes one handle or 16 bytes.
        unsafe {
            check(cu::cuDeviceGet(&mut device, ordinal), || {
                format!("cuDeviceGet({ordinal})")
            })?;
            check(cu::cuDeviceGetUuid(&mut u, device), || {
                format!("cuDeviceGetUuid({ordinal})")
            })?;
        }
        let hex: String = u
            .bytes
            .iter()
            .map(|b| format!("{:02x}", *b as u8))
            .collect();
        if hex == uuid {
            return Ok(Some(ordinal));
        }
    }
    Ok(None)
}

/// The allocation properties of pinned device memory on `ordinal` exportable as `handle`.
fn prop(ordinal: i32, handle: HandleType) -> cu::CUmemAllocationProp {
    cu::CUmemAllocationProp {
        type_: cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: handle.raw(),
        location: cu::CUmemLocation {
            type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: cu::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// How a device allocation is exported to other processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HandleType {
    /// `CU_MEM_HANDLE_TYPE_FABRIC`: a 64-byte handle importable by any process in the same
    /// NVLink (IMEX) domain, on this node or another (GB200/GB300 NVL72).
    Fabric,
    /// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: a descriptor passed to processes on this node.
    PosixFd,
}

impl HandleType {
    fn raw(self) -> cu::CUmemAllocationHandleType {
        match self {
            HandleType::Fabric => cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
            HandleType::PosixFd => {
                cu::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            }
        }
    }

    /// The session's name for it.
    pub fn name(self) -> &'static str {
        match self {
            HandleType::Fabric => "fabric",
            HandleType::PosixFd => "fd",
        }
    }
}

/// `cuMemGetAllocationGranularity(MINIMUM)` for pinned memory on `ordinal` with `handle`.
pub(crate) fn granularity(ctx: &Context, handle: HandleType) -> Result<u64> {
    let p = prop(ctx.ordinal, handle);
    let mut g = 0usize;
    // SAFETY: reads `p`, writes one usize.
    check(
        unsafe {
            cu::cuMemGetAllocationGranularity(
                &mut g,
                &p,
                cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        },
        || format!("allocation granularity of device {}", ctx.ordinal),
    )?;
    Ok((g as u64).max(1))
}

/// A physical allocation (`cuMemCreate` or an import), released on drop.
#[derive(Debug)]
pub(crate) struct Allocation {
    handle: cu::CUmemGenericAllocationHandle,
    /// Bytes (a multiple of the granularity).
    pub size: u64,
}

impl Allocation {
    /// `cuMemCreate` of `size` bytes (a multiple of the granularity) on the context's device.
    pub fn create(ctx: &Context, size: u64, handle: HandleType) -> Result<Allocation> {
        ctx.bind()?;
        let p = prop(ctx.ordinal, handle);
        let mut h = 0;
        // SAFETY: reads `p`, writes one handle.
        check(
            unsafe { cu::cuMemCreate(&mut h, size as usize, &p, 0) },
            || {
                format!(
                    "cuMemCreate of {size} bytes on device {} with {} handles",
                    ctx.ordinal,
                    handle.name()
                )
            },
        )?;
        Ok(Allocation { handle: h, size })
    }

    /// Exports a POSIX descriptor for this allocation (each call a new descriptor).
    pub fn export_fd(&self) -> Result<std::os::fd::OwnedFd> {
        use std::os::fd::FromRawFd;
        let mut fd: c_int = -1;
        // SAFETY: for POSIX_FILE_DESCRIPTOR the driver writes one int.
        check(
            unsafe {
                cu::cuMemExportToShareableHandle(
                    (&mut fd as *mut c_int).cast(),
                    self.handle,
                    HandleType::PosixFd.raw(),
                    0,
                )
            },
            || "exporting the arena as a POSIX descriptor".into(),
        )?;
        if fd < 0 {
            return Err(Error::device(
                "exporting the arena as a POSIX descriptor",
                format!("the driver returned descriptor {fd}"),
            ));
        }
        // SAFETY: the driver created this descriptor for us; nothing else owns it.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }

    /// Exports the 64-byte fabric handle.
    pub fn export_fabric(&self) -> Result<[u8; 64]> {
        let mut h = cu::CUmemFabricHandle_st { data: [0; 64] };
        // SAFETY: for FABRIC the driver writes one 64-byte CUmemFabricHandle.
        check(
            unsafe {
                cu::cuMemExportToShareableHandle(
                    (&mut h as *mut cu::CUmemFabricHandle_st).cast(),
                    self.handle,
                    HandleType::Fabric.raw(),
                    0,
                )
            },
            || "exporting the arena as a fabric handle".into(),
        )?;
        Ok(h.data)
    }

    /// Imports an allocation another process exported as a POSIX descriptor (the descriptor
    /// stays the caller's).
    pub fn import_fd(ctx: &Context, fd: std::os::fd::BorrowedFd<'_>, size: u64) -> Result<Self> {
        use std::os::fd::AsRawFd;
        ctx.bind()?;
        let mut h = 0;
        // SAFETY: for POSIX_FILE_DESCRIPTOR the os handle is the descriptor's value passed as a
        // pointer-sized integer (the driver's documented convention); it writes one handle.
        check(
            unsafe {
                cu::cuMemImportFromShareableHandle(
                    &mut h,
                    fd.as_raw_fd() as usize as *mut c_void,
                    HandleType::PosixFd.raw(),
                )
            },
            || "importing the producer's arena descriptor".into(),
        )?;
        Ok(Allocation { handle: h, size })
    }

    /// Imports an allocation by its fabric handle.
    pub fn import_fabric(ctx: &Context, handle: &[u8; 64], size: u64) -> Result<Self> {
        ctx.bind()?;
        let mut data = cu::CUmemFabricHandle_st { data: *handle };
        let mut h = 0;
        // SAFETY: for FABRIC the os handle points at the 64-byte handle; writes one handle.
        check(
            unsafe {
                cu::cuMemImportFromShareableHandle(
                    &mut h,
                    (&mut data as *mut cu::CUmemFabricHandle_st).cast(),
                    HandleType::Fabric.raw(),
                )
            },
            || {
                "importing the producer's arena by fabric handle (is this process in the producer's IMEX domain?)".into()
            },
        )?;
        Ok(Allocation { handle: h, size })
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // SAFETY: releases the handle created or imported in this value; mappings of it hold
        // their own reference, so the memory stays until they are unmapped too.
        unsafe {
            cu::cuMemRelease(self.handle);
        }
    }
}

/// An allocation mapped at a reserved virtual range with read-write access for some devices:
/// unmapped and the range freed on drop (the reverse of the order it was built in).
#[derive(Debug)]
pub(crate) struct Mapped {
    /// The first byte's device address.
    pub ptr: u64,
    /// Bytes mapped.
    pub size: u64,
    mapped: bool,
    /// Keeps the physical memory until after the unmap.
    pub allocation: Allocation,
}

impl Mapped {
    /// Reserves `allocation.size` bytes of address space aligned to `align`, maps the whole
    /// allocation there and gives read-write access to `access` (the device it lives on first).
    pub fn new(allocation: Allocation, align: u64, access: &[&Context]) -> Result<Mapped> {
        let size = allocation.size;
        let mut ptr = 0;
        // SAFETY: writes one address; the range is ours until cuMemAddressFree in drop.
        check(
            unsafe { cu::cuMemAddressReserve(&mut ptr, size as usize, align as usize, 0, 0) },
            || format!("reserving {size} bytes of device address space"),
        )?;
        let mut m = Mapped {
            ptr,
            size,
            mapped: false,
            allocation,
        };
        // SAFETY: maps the whole allocation at the start of the range reserved above.
        check(
            unsafe { cu::cuMemMap(ptr, size as usize, 0, m.allocation.handle, 0) },
            || format!("mapping {size} bytes of device memory"),
        )?;
        m.mapped = true;
        let descs: Vec<cu::CUmemAccessDesc> = access
            .iter()
            .map(|c| cu::CUmemAccessDesc {
                location: cu::CUmemLocation {
                    type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: c.ordinal,
                },
                flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            })
            .collect();
        // SAFETY: the range is mapped; reads `descs.len()` descriptors.
        check(
            unsafe { cu::cuMemSetAccess(ptr, size as usize, descs.as_ptr(), descs.len()) },
            || {
                let who: Vec<String> = access.iter().map(|c| c.ordinal.to_string()).collect();
                format!("granting devices [{}] access to the arena", who.join(", "))
            },
        )?;
        Ok(m)
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: unmaps what `new` mapped and frees the range it reserved; no copy uses them
        // any more (owners synchronise their streams before dropping a mapping).
        unsafe {
            if self.mapped {
                cu::cuMemUnmap(self.ptr, self.size as usize);
            }
            cu::cuMemAddressFree(self.ptr, self.size as usize);
        }
    }
}

/// A non-blocking stream of one context.
#[derive(Debug)]
pub(crate) struct Stream(pub cu::CUstream);

// SAFETY: streams may be used from any thread with their context bound.
unsafe impl Send for Stream {}
// SAFETY: as above; the driver serialises work on one stream.
unsafe impl Sync for Stream {}

impl Stream {
    /// A new stream that does not synchronise with the legacy default stream.
    pub fn new(ctx: &Context) -> Result<Stream> {
        ctx.bind()?;
        let mut s = std::ptr::null_mut();
        // SAFETY: writes one handle. 1 = CU_STREAM_NON_BLOCKING.
        check(unsafe { cu::cuStreamCreate(&mut s, 1) }, || {
            "cuStreamCreate".into()
        })?;
        Ok(Stream(s))
    }

    /// Blocks until all work on the stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a valid stream.
        check(unsafe { cu::cuStreamSynchronize(self.0) }, || {
            "cuStreamSynchronize".into()
        })
    }

    /// Makes later work on this stream wait for `event`.
    pub fn wait(&self, event: cu::CUevent) -> Result<()> {
        // SAFETY: the caller passes an event of this process (recorded or not).
        check(unsafe { cu::cuStreamWaitEvent(self.0, event, 0) }, || {
            "waiting on the producer's event".into()
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
        // SAFETY: as the caller promised.
        check(
            unsafe { cu::cuLaunchHostFunc(self.0, Some(f), data) },
            || "cuLaunchHostFunc".into(),
        )
    }

    /// Enqueues a copy of `len` bytes between device addresses.
    ///
    /// # Safety
    /// Both ranges must be valid device memory (or mapped ranges) for the copy's duration.
    pub unsafe fn copy_dtod(&self, dst: u64, src: u64, len: u64) -> Result<()> {
        // SAFETY: as the caller promised.
        check(
            unsafe { cu::cuMemcpyDtoDAsync_v2(dst, src, len as usize, self.0) },
            || format!("device-to-device copy of {len} bytes"),
        )
    }

    /// Enqueues a copy of `len` host bytes at `src` to device address `dst`.
    ///
    /// # Safety
    /// `src` valid for reads of `len` bytes and `dst` valid device memory until the copy ends.
    pub unsafe fn copy_htod(&self, dst: u64, src: *const u8, len: u64) -> Result<()> {
        // SAFETY: as the caller promised.
        check(
            unsafe { cu::cuMemcpyHtoDAsync_v2(dst, src.cast(), len as usize, self.0) },
            || format!("host-to-device copy of {len} bytes"),
        )
    }

    /// Enqueues a copy of `len` device bytes at `src` to host memory at `dst`.
    ///
    /// # Safety
    /// `dst` valid for writes of `len` bytes and `src` valid device memory until the copy ends.
    pub unsafe fn copy_dtoh(&self, dst: *mut u8, src: u64, len: u64) -> Result<()> {
        // SAFETY: as the caller promised.
        check(
            unsafe { cu::cuMemcpyDtoHAsync_v2(dst.cast(), src, len as usize, self.0) },
            || format!("device-to-host copy of {len} bytes"),
        )
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: destroys the stream created in `new` (pending work still completes).
        unsafe {
            cu::cuStreamDestroy_v2(self.0);
        }
    }
}

/// An event without timing (cheapest to record and query).
#[derive(Debug)]
pub(crate) struct Event(pub cu::CUevent);

// SAFETY: events may be recorded and queried from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// A new event (CU_EVENT_DISABLE_TIMING).
    pub fn new(ctx: &Context) -> Result<Event> {
        ctx.bind()?;
        let mut e = std::ptr::null_mut();
        // SAFETY: writes one handle. 2 = CU_EVENT_DISABLE_TIMING.
        check(unsafe { cu::cuEventCreate(&mut e, 2) }, || {
            "cuEventCreate".into()
        })?;
        Ok(Event(e))
    }

    /// Records the event on `stream` (a raw stream of this process: the producer's).
    pub fn record_raw(&self, stream: cu::CUstream) -> Result<()> {
        // SAFETY: the caller's stream handle is passed to the driver, which validates it.
        check(unsafe { cu::cuEventRecord(self.0, stream) }, || {
            "recording an event on the producer's stream".into()
        })
    }

    /// `Ok(true)` once all work before the event's record has finished.
    pub fn query(&self) -> Result<bool> {
        // SAFETY: a valid event.
        let rc = unsafe { cu::cuEventQuery(self.0) };
        if rc == cu::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check(rc, || "a device copy failed (cuEventQuery)".into()).map(|()| true)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: destroys the event created in `new`.
        unsafe {
            cu::cuEventDestroy_v2(self.0);
        }
    }
}

/// Device memory from `cuMemAlloc` (benchmarks, tests, the CLI's device buffers).
#[derive(Debug)]
pub struct DeviceBuffer {
    ptr: u64,
    len: u64,
    ctx: std::sync::Arc<Context>,
}

impl DeviceBuffer {
    /// Allocates `len` bytes on device `ordinal`.
    ///
    /// # Errors
    /// [`Error::Device`].
    pub fn new(ordinal: i32, len: u64) -> Result<DeviceBuffer> {
        let ctx = std::sync::Arc::new(Context::new(ordinal)?);
        let mut ptr = 0;
        // SAFETY: writes one device address.
        check(
            unsafe { cu::cuMemAlloc_v2(&mut ptr, len.max(1) as usize) },
            || format!("cuMemAlloc of {len} bytes on device {ordinal}"),
        )?;
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
    pub fn device(&self) -> i32 {
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
        unsafe { s.copy_htod(self.ptr + offset, src.as_ptr(), src.len() as u64)? };
        s.synchronize()
    }

    /// Copies the buffer's bytes at `offset` into `dst` (synchronously).
    ///
    /// # Errors
    /// [`Error::InvalidRead`] if it does not fit, [`Error::Device`].
    pub fn download(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.range(offset, dst.len() as u64)?;
        let s = Stream::new(&self.ctx)?;
        // SAFETY: as in `upload`, for writes into `dst`.
        unsafe { s.copy_dtoh(dst.as_mut_ptr(), self.ptr + offset, dst.len() as u64)? };
        s.synchronize()
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
        unsafe { s.copy_dtod(self.ptr, src.ptr, src.len)? };
        s.synchronize()
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
        if self.ctx.bind().is_ok() {
            // SAFETY: frees the allocation made in `new`; callers finish their copies first.
            unsafe {
                cu::cuMemFree_v2(self.ptr);
            }
        }
    }
}
