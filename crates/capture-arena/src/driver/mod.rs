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
//! The bottom of the device path: it knows contexts, streams, events, VMM allocations and pinned
//! host ranges, and nothing of arenas, tensors or sessions ([`crate::memory::cuda`] and
//! [`crate::transport`] build on it; a tensor's readiness event, `Ready`, is one of its events).

use std::ffi::{c_int, CStr};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys as cu;

mod api;
mod host;
mod nvml;
mod stream;
mod vmm;

pub(crate) use host::LazyPin;
pub(crate) use nvml::{fabric, Fabric};
pub use stream::DeviceBuffer;
pub(crate) use stream::{event_on, record_ready, Event, Ready, Stream};
pub use vmm::HandleType;
pub(crate) use vmm::{check_device_range, granularity, Allocation, Mapped};

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
pub(super) fn describe(rc: c_int) -> String {
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
    pub(super) device: cu::CUdevice,
    pub(super) ctx: cu::CUcontext,
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
