//! The CUDA driver, loaded at run time: every `unsafe` FFI call of the device path lives here,
//! each wrapped so that it returns [`Error::Device`] instead of a code, and nothing here panics.
//!
//! [`driver`] opens the library (cudarc's candidates, in cudarc's order), looks up every entry
//! point (`api`, which reads results as integers: cudarc's enum cannot hold a code its
//! CUDA version does not list) and calls `cuInit`. Only after that has succeeded does any other
//! function here call the driver; cudarc provides the types. A build with the `cuda` feature
//! therefore starts on a machine without a GPU or driver and fails only when a device arena or a
//! device read is asked for.
//!
//! The bottom of the device path: it knows contexts, streams, events and VMM allocations, and
//! nothing of arenas, tensors or sessions ([`crate::memory::cuda`] and [`crate::transport`] build
//! on it; a tensor's readiness event, `Ready`, is one of its events).

use std::ffi::{c_int, c_void, CStr};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys as cu;

mod api;

use crate::error::{Error, Result};

/// What the probe found: the driver's version and the devices this process sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverInfo {
    /// The library file that was loaded.
    pub library: String,
    /// `cuDriverGetVersion` (12080 for 12.8).
    pub version: i32,
    /// Devices visible to this process.
    pub devices: i32,
    /// The process that initialised the driver (a forked child must not use it).
    pub pid: u32,
}

/// Opens and initialises the driver once per process; every later call returns the same answer.
///
/// # Errors
/// [`Error::Device`] naming the library candidates tried, the missing symbol or `cuInit`'s code,
/// with what to do about it.
pub fn driver() -> Result<&'static DriverInfo> {
    let info = DRIVER
        .get_or_init(load)
        .as_ref()
        .map_err(|reason| Error::device("loading the CUDA driver", reason.clone()))?;
    if info.pid != std::process::id() {
        return Err(Error::device(
            "using CUDA in a forked process",
            format!(
                "this process (pid {}) was forked from pid {}, which had initialised CUDA, and \
                 CUDA does not survive fork(): read cuda:// sessions in processes started with \
                 the spawn start method (torch DataLoader: multiprocessing_context=\"spawn\"), \
                 or open them only after the fork in a parent that never used CUDA",
                std::process::id(),
                info.pid
            ),
        ));
    }
    Ok(info)
}

/// The driver, once loaded (see [`driver`]).
static DRIVER: OnceLock<std::result::Result<DriverInfo, String>> = OnceLock::new();

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
    if let Err(missing) = api::load(&lib) {
        return Err(format!(
            "{library} lacks {missing}: the driver is too old for capture-arena (CUDA 12.3 or \
             newer is needed)"
        ));
    }
    // Keep the library loaded for the process's life (cudarc holds its own handle too).
    std::mem::forget(lib);
    // SAFETY: the library and every symbol used by this module were found above.
    let rc = unsafe { api::cuInit(0) };
    if rc != api::SUCCESS {
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
        api::cuDriverGetVersion(&mut version);
        api::cuDeviceGetCount(&mut devices);
    }
    Ok(DriverInfo {
        library,
        version,
        devices,
        pid: std::process::id(),
    })
}

/// `CUDA_ERROR_NOT_PERMITTED (800): operation not permitted`.
fn describe(rc: c_int) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: only called once the driver is loaded (from `check` or `load` after the symbol
    // check); both calls write a pointer to a static string or leave it null.
    unsafe {
        api::cuGetErrorName(rc, &mut name);
        api::cuGetErrorString(rc, &mut text);
    }
    let s = |p: *const std::ffi::c_char| {
        if p.is_null() {
            "unknown".to_owned()
        } else {
            // SAFETY: the driver returns NUL-terminated static strings.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    format!("{} ({rc}): {}", s(name), s(text))
}

/// Turns a driver code into a result.
pub(crate) fn check(rc: c_int, what: impl FnOnce() -> String) -> Result<()> {
    if rc == api::SUCCESS {
        Ok(())
    } else {
        Err(Error::device(what(), describe(rc)))
    }
}

/// A device's primary context, retained once per process and never released (as the CUDA
/// runtime does): streams, events and mappings made in it stay valid whatever else the process
/// retains or releases. Get one with [`context`].
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

/// The primary context of device `ordinal`, retained on first use for the process's life.
///
/// # Errors
/// [`Error::Device`] without a driver, for an ordinal this process does not see, or when the
/// retain fails.
pub(crate) fn context(ordinal: i32) -> Result<Arc<Context>> {
    static CONTEXTS: Mutex<Vec<Arc<Context>>> = Mutex::new(Vec::new());
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
    let mut all = CONTEXTS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(c) = all.iter().find(|c| c.ordinal == ordinal) {
        return Ok(c.clone());
    }
    let device = device_handle(ordinal)?;
    let mut ctx = std::ptr::null_mut();
    // SAFETY: the driver is initialised; writes one handle. Never released (see the type).
    let rc = unsafe { api::cuDevicePrimaryCtxRetain(&mut ctx, device) };
    check(rc, || {
        format!("retaining the primary context of device {ordinal}")
    })?;
    let c = Arc::new(Context {
        device,
        ctx,
        ordinal,
    });
    all.push(c.clone());
    Ok(c)
}

/// The driver's handle of device `ordinal`.
fn device_handle(ordinal: i32) -> Result<cu::CUdevice> {
    let mut device = 0;
    // SAFETY: the driver is initialised (callers went through `driver()`); writes one int.
    let rc = unsafe { api::cuDeviceGet(&mut device, ordinal) };
    check(rc, || format!("cuDeviceGet({ordinal})"))?;
    Ok(device)
}

/// The context that was current on this thread before [`Context::enter`]; restored on drop, so
/// capture-arena never changes the current device under the caller (torch follows it).
#[must_use = "the context is current only while this guard lives"]
pub(crate) struct Current {
    previous: cu::CUcontext,
    changed: bool,
}

impl Drop for Current {
    fn drop(&mut self) {
        if self.changed {
            // SAFETY: restores the handle cuCtxGetCurrent returned (null or a live context).
            unsafe {
                api::cuCtxSetCurrent(self.previous);
            }
        }
    }
}

impl Context {
    /// Makes this context current on the calling thread until the guard is dropped.
    pub fn enter(&self) -> Result<Current> {
        let mut previous = std::ptr::null_mut();
        // SAFETY: writes one handle (null when no context is current).
        let rc = unsafe { api::cuCtxGetCurrent(&mut previous) };
        check(rc, || "cuCtxGetCurrent".into())?;
        if previous == self.ctx {
            return Ok(Current {
                previous,
                changed: false,
            });
        }
        // SAFETY: `ctx` is a retained primary context, valid for the process's life.
        let rc = unsafe { api::cuCtxSetCurrent(self.ctx) };
        check(rc, || {
            format!("making device {}'s context current", self.ordinal)
        })?;
        Ok(Current {
            previous,
            changed: true,
        })
    }

    /// An integer attribute of the device (0 when the driver does not know it).
    pub fn attribute(&self, attr: cu::CUdevice_attribute) -> i32 {
        let mut v: c_int = 0;
        // SAFETY: writes one int; an unknown attribute returns an error and leaves 0.
        let rc = unsafe { api::cuDeviceGetAttribute(&mut v, attr, self.device) };
        if rc == api::SUCCESS {
            v
        } else {
            0
        }
    }

    /// The device's name (`NVIDIA H200`).
    pub fn name(&self) -> String {
        let mut buf = [0 as std::ffi::c_char; 128];
        // SAFETY: the driver writes at most `len` bytes, NUL-terminated.
        let rc = unsafe { api::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as c_int, self.device) };
        if rc != api::SUCCESS || !buf.contains(&0) {
            return "unknown".into();
        }
        // SAFETY: NUL-terminated within the buffer (checked above).
        unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    /// The device's UUID as 32 hex digits: the same GPU has the same UUID in every process,
    /// whatever its ordinal there.
    pub fn uuid(&self) -> Result<String> {
        uuid_of(self.device, self.ordinal)
    }
}

fn uuid_of(device: cu::CUdevice, ordinal: i32) -> Result<String> {
    let mut u = cu::CUuuid_st { bytes: [0; 16] };
    // SAFETY: writes 16 bytes.
    let rc = unsafe { api::cuDeviceGetUuid_v2(&mut u, device) };
    check(rc, || format!("cuDeviceGetUuid_v2({ordinal})"))?;
    Ok(u.bytes
        .iter()
        .map(|b| format!("{:02x}", *b as u8))
        .collect())
}

/// Checks that `[ptr, ptr + len)` is device memory of device `ordinal` as the driver sees it
/// (its first and last byte: memory type and device), before anything is copied there.
///
/// # Errors
/// [`Error::Device`] saying what the memory is instead (host memory, another device's, or
/// memory CUDA does not know).
pub(crate) fn check_device_range(ptr: u64, len: u64, ordinal: i32) -> Result<()> {
    let what = || format!("checking {len} bytes at {ptr:#x} are memory of GPU {ordinal}");
    let last = ptr.checked_add(len.max(1) - 1).ok_or_else(|| {
        Error::device(
            what(),
            "the range wraps around the address space".to_string(),
        )
    })?;
    for at in [ptr, last] {
        let mut kind: u32 = 0;
        // SAFETY: MEMORY_TYPE writes one unsigned int; the driver validates the pointer.
        let rc = unsafe {
            api::cuPointerGetAttribute(
                (&mut kind as *mut u32).cast(),
                cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                at,
            )
        };
        if rc != api::SUCCESS {
            return Err(Error::device(
                what(),
                format!(
                    "CUDA does not know the address {at:#x} ({}): it is plain host memory, not \
                     device memory",
                    describe(rc)
                ),
            ));
        }
        if kind != cu::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Err(Error::device(
                what(),
                format!("the address {at:#x} is host memory (CUDA memory type {kind}), not device memory"),
            ));
        }
        let mut device: c_int = -1;
        // SAFETY: DEVICE_ORDINAL writes one int.
        let rc = unsafe {
            api::cuPointerGetAttribute(
                (&mut device as *mut c_int).cast(),
                cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                at,
            )
        };
        check(rc, what)?;
        if device != ordinal {
            return Err(Error::device(
                what(),
                format!("the address {at:#x} is memory of GPU {device}, not of GPU {ordinal}"),
            ));
        }
    }
    Ok(())
}

/// The ordinal of the device whose context is current on the calling thread (torch's current
/// device on its threads), if any.
pub(crate) fn current_ordinal() -> Result<Option<i32>> {
    driver()?;
    let mut ctx = std::ptr::null_mut();
    // SAFETY: writes one handle (null when no context is current).
    let rc = unsafe { api::cuCtxGetCurrent(&mut ctx) };
    check(rc, || "cuCtxGetCurrent".into())?;
    if ctx.is_null() {
        return Ok(None);
    }
    let mut device = 0;
    // SAFETY: a context is current; writes one device handle.
    let rc = unsafe { api::cuCtxGetDevice(&mut device) };
    check(rc, || "cuCtxGetDevice".into())?;
    // The ordinal whose handle this is (handles are ordinals in practice; looked up to be sure).
    let info = driver()?;
    for ordinal in 0..info.devices {
        if device_handle(ordinal)? == device {
            return Ok(Some(ordinal));
        }
    }
    Ok(None)
}

/// True when device `from` can access memory of device `to` directly (peer access).
pub(crate) fn can_access_peer(from: i32, to: i32) -> bool {
    let (Ok(a), Ok(b)) = (device_handle(from), device_handle(to)) else {
        return false;
    };
    let mut v: c_int = 0;
    // SAFETY: writes one int.
    let rc = unsafe { api::cuDeviceCanAccessPeer(&mut v, a, b) };
    rc == api::SUCCESS && v == 1
}

/// The index of the device whose UUID is `uuid` in this process, if it sees it.
pub(crate) fn ordinal_of(uuid: &str) -> Result<Option<i32>> {
    let info = driver()?;
    for ordinal in 0..info.devices {
        if uuid_of(device_handle(ordinal)?, ordinal)? == uuid {
            return Ok(Some(ordinal));
        }
    }
    Ok(None)
}

/// The devices of this process that can access device `home`'s memory (peer access), `home`
/// first: those a mapping of an allocation on `home` grants access to.
pub(crate) fn peers_of(home: i32) -> Result<Vec<i32>> {
    let info = driver()?;
    let mut out = vec![home];
    out.extend((0..info.devices).filter(|&d| d != home && can_access_peer(d, home)));
    Ok(out)
}

/// The allocation properties of pinned device memory on `ctx`'s device exportable as every
/// type in `handles`: RDMA-capable where the device supports GPUDirect RDMA on VMM memory (as
/// NCCL, Mooncake and NIXL make theirs), so that a NIC can register the arena (NIXL over
/// IB/RoCE, and always on GB200); the flag is not asked for where the device does not support it.
fn prop(ctx: &Context, handles: &[HandleType]) -> cu::CUmemAllocationProp {
    let rdma = ctx.attribute(
        cu::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
    ) == 1;
    cu::CUmemAllocationProp {
        type_: cu::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        // A bit set (cudarc's type is a transparent integer, so it holds POSIX_FD | FABRIC).
        requestedHandleTypes: cu::CUmemAllocationHandleType(
            handles.iter().fold(0, |m, h| m | h.raw().0),
        ),
        location: cu::CUmemLocation {
            type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ctx.ordinal,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: cu::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: u8::from(rdma),
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

/// `cuMemGetAllocationGranularity(MINIMUM)` for pinned memory on `ctx`'s device exportable as
/// `handles`.
pub(crate) fn granularity(ctx: &Context, handles: &[HandleType]) -> Result<u64> {
    let p = prop(ctx, handles);
    let mut g = 0usize;
    let flag = cu::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM;
    // SAFETY: reads `p`, writes one usize.
    let rc = unsafe { api::cuMemGetAllocationGranularity(&mut g, &p, flag) };
    check(rc, || {
        format!("allocation granularity of device {}", ctx.ordinal)
    })?;
    Ok((g as u64).max(1))
}

/// A physical allocation (`cuMemCreate` or an import), released on drop.
#[derive(Debug)]
pub(crate) struct Allocation {
    handle: cu::CUmemGenericAllocationHandle,
    /// Bytes (a multiple of the granularity).
    pub size: u64,
    ctx: Arc<Context>,
}

impl Allocation {
    /// `cuMemCreate` of `size` bytes (a multiple of the granularity) on the context's device,
    /// exportable as every type in `handles`.
    pub fn create(ctx: &Arc<Context>, size: u64, handles: &[HandleType]) -> Result<Allocation> {
        let _current = ctx.enter()?;
        let p = prop(ctx, handles);
        let mut h = 0;
        // SAFETY: reads `p`, writes one handle.
        let rc = unsafe { api::cuMemCreate(&mut h, size as usize, &p, 0) };
        check(rc, || {
            format!(
                "cuMemCreate of {size} bytes on device {} with {} handles",
                ctx.ordinal,
                handles
                    .iter()
                    .map(|h| h.name())
                    .collect::<Vec<_>>()
                    .join(" + ")
            )
        })?;
        Ok(Allocation {
            handle: h,
            size,
            ctx: ctx.clone(),
        })
    }

    /// Exports a POSIX descriptor for this allocation (each call a new descriptor).
    pub fn export_fd(&self) -> Result<std::os::fd::OwnedFd> {
        use std::os::fd::FromRawFd;
        let mut fd: c_int = -1;
        let kind = HandleType::PosixFd.raw();
        // SAFETY: for POSIX_FILE_DESCRIPTOR the driver writes one int.
        let rc = unsafe {
            api::cuMemExportToShareableHandle((&mut fd as *mut c_int).cast(), self.handle, kind, 0)
        };
        check(rc, || "exporting the arena as a POSIX descriptor".into())?;
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
        let out = (&mut h as *mut cu::CUmemFabricHandle_st).cast();
        let kind = HandleType::Fabric.raw();
        // SAFETY: for FABRIC the driver writes one 64-byte CUmemFabricHandle at `out`.
        let rc = unsafe { api::cuMemExportToShareableHandle(out, self.handle, kind, 0) };
        check(rc, || "exporting the arena as a fabric handle".into())?;
        Ok(h.data)
    }

    /// Imports an allocation another process exported as a POSIX descriptor (the descriptor
    /// stays the caller's).
    pub fn import_fd(
        ctx: &Arc<Context>,
        fd: std::os::fd::BorrowedFd<'_>,
        size: u64,
    ) -> Result<Self> {
        use std::os::fd::AsRawFd;
        let _current = ctx.enter()?;
        let mut h = 0;
        // The driver's convention: the descriptor's value passed as a pointer-sized integer.
        let os = fd.as_raw_fd() as usize as *mut c_void;
        let kind = HandleType::PosixFd.raw();
        // SAFETY: `os` is a descriptor open in this process for the call's duration; writes
        // one handle.
        let rc = unsafe { api::cuMemImportFromShareableHandle(&mut h, os, kind) };
        check(rc, || "importing the producer's arena descriptor".into())?;
        Ok(Allocation {
            handle: h,
            size,
            ctx: ctx.clone(),
        })
    }

    /// Imports an allocation by its fabric handle.
    pub fn import_fabric(ctx: &Arc<Context>, handle: &[u8; 64], size: u64) -> Result<Self> {
        let _current = ctx.enter()?;
        let mut data = cu::CUmemFabricHandle_st { data: *handle };
        let os = (&mut data as *mut cu::CUmemFabricHandle_st).cast();
        let mut h = 0;
        // SAFETY: for FABRIC the os handle points at the 64-byte handle; writes one handle.
        let rc =
            unsafe { api::cuMemImportFromShareableHandle(&mut h, os, HandleType::Fabric.raw()) };
        check(rc, || {
            "importing the producer's arena by fabric handle (is this process in the \
             producer's IMEX domain?)"
                .into()
        })?;
        Ok(Allocation {
            handle: h,
            size,
            ctx: ctx.clone(),
        })
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        let _current = self.ctx.enter();
        // SAFETY: releases the handle created or imported in this value; a mapping of it holds
        // its own reference, so the memory stays until that is unmapped too.
        unsafe {
            api::cuMemRelease(self.handle);
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
    /// allocation there and gives read-write access to the devices `access` (ordinals).
    pub fn new(allocation: Allocation, align: u64, access: &[i32]) -> Result<Mapped> {
        let _current = allocation.ctx.enter()?;
        let size = allocation.size;
        let mut ptr = 0;
        // SAFETY: writes one address; the range is ours until cuMemAddressFree in drop.
        let rc = unsafe { api::cuMemAddressReserve(&mut ptr, size as usize, align as usize, 0, 0) };
        check(rc, || {
            format!("reserving {size} bytes of device address space")
        })?;
        let mut m = Mapped {
            ptr,
            size,
            mapped: false,
            allocation,
        };
        // SAFETY: maps the whole allocation at the start of the range reserved above.
        let rc = unsafe { api::cuMemMap(ptr, size as usize, 0, m.allocation.handle, 0) };
        check(rc, || format!("mapping {size} bytes of device memory"))?;
        m.mapped = true;
        let descs: Vec<cu::CUmemAccessDesc> = access
            .iter()
            .map(|&ordinal| cu::CUmemAccessDesc {
                location: cu::CUmemLocation {
                    type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: ordinal,
                },
                flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            })
            .collect();
        // SAFETY: the range is mapped; reads `descs.len()` descriptors.
        let rc = unsafe { api::cuMemSetAccess(ptr, size as usize, descs.as_ptr(), descs.len()) };
        check(rc, || {
            format!("granting devices {access:?} access to the arena")
        })?;
        Ok(m)
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        let _current = self.allocation.ctx.enter();
        // SAFETY: unmaps what `new` mapped and frees the range it reserved; no copy uses them
        // any more (owners synchronise their streams before dropping a mapping).
        unsafe {
            if self.mapped {
                api::cuMemUnmap(self.ptr, self.size as usize);
            }
            api::cuMemAddressFree(self.ptr, self.size as usize);
        }
    }
}

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
        let _current = ctx.enter()?;
        let mut e = std::ptr::null_mut();
        // SAFETY: writes one handle. 2 = CU_EVENT_DISABLE_TIMING.
        let rc = unsafe { api::cuEventCreate(&mut e, 2) };
        check(rc, || "cuEventCreate".into())?;
        Ok(Event {
            raw: e,
            ctx: ctx.clone(),
        })
    }

    /// Records the event on `stream`, a raw `CUstream` of this process (a caller's stream, on
    /// the event's device).
    pub fn record_raw(&self, stream: cu::CUstream) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: the stream handle is passed to the driver, which validates it.
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
    // SAFETY: the driver validates the stream handle; writes one context handle.
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
