//! The CUDA driver entry points capture-arena calls, with results read as integers.
//!
//! cudarc's bindings type every result as its `CUresult` enum, generated from one CUDA version's
//! header: a code that version does not list (a newer driver's, such as CUDA 13's on the GPU
//! machine) would be an invalid enum value, which is undefined behaviour in Rust. Here every
//! function is looked up in the driver library [`super::driver`] loads and returns `c_int`;
//! cudarc is used for the argument types only. Every symbol is looked up when the library is loaded ([`load`]), so a driver
//! that lacks one is refused before anything is called. Before that each function returns
//! `CUDA_ERROR_NOT_INITIALIZED` instead of calling anything.
#![allow(non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};
use std::sync::OnceLock;

use cudarc::driver::sys as cu;

/// `CUDA_SUCCESS`.
pub(crate) const SUCCESS: c_int = 0;
/// `CUDA_ERROR_NOT_INITIALIZED`: what every function returns before the library is loaded.
const NOT_INITIALIZED: c_int = 3;
/// `CUDA_ERROR_NOT_READY`.
pub(crate) const NOT_READY: c_int = 600;

macro_rules! api {
    ($($name:ident($($arg:ident: $ty:ty),* $(,)?);)*) => {
        /// The driver's entry points, looked up once.
        struct Api {
            $($name: unsafe extern "C" fn($($ty),*) -> c_int,)*
        }

        impl Api {
            /// Looks every entry point up in `lib`.
            fn load(lib: &libloading::Library) -> Result<Api, String> {
                Ok(Api {
                    $($name: {
                        // SAFETY: the symbol is the driver's function of this name, whose C
                        // signature these argument types mirror (cudarc's bindings of it); the
                        // result is read as the int the C function returns.
                        let f = unsafe {
                            lib.get::<unsafe extern "C" fn($($ty),*) -> c_int>(
                                stringify!($name).as_bytes(),
                            )
                        }
                        .map_err(|e| format!("{}: {e}", stringify!($name)))?;
                        *f
                    },)*
                })
            }
        }

        $(
            /// The driver function of this name (see the module docs).
            ///
            /// # Safety
            /// As the driver API documents for this function.
            pub(crate) unsafe fn $name($($arg: $ty),*) -> c_int {
                match API.get() {
                    // SAFETY: as the caller promised; the pointer is the loaded driver's.
                    Some(api) => unsafe { (api.$name)($($arg),*) },
                    None => NOT_INITIALIZED,
                }
            }
        )*
    };
}

api! {
    cuInit(flags: c_uint);
    cuDriverGetVersion(version: *mut c_int);
    cuDeviceGetCount(count: *mut c_int);
    cuDeviceGet(device: *mut cu::CUdevice, ordinal: c_int);
    cuDeviceGetAttribute(value: *mut c_int, attribute: cu::CUdevice_attribute, device: cu::CUdevice);
    cuDeviceGetName(name: *mut c_char, len: c_int, device: cu::CUdevice);
    cuDeviceGetUuid_v2(uuid: *mut cu::CUuuid, device: cu::CUdevice);
    cuDeviceCanAccessPeer(can: *mut c_int, device: cu::CUdevice, peer: cu::CUdevice);
    cuDevicePrimaryCtxRetain(ctx: *mut cu::CUcontext, device: cu::CUdevice);
    cuCtxGetCurrent(ctx: *mut cu::CUcontext);
    cuCtxSetCurrent(ctx: cu::CUcontext);
    cuCtxGetDevice(device: *mut cu::CUdevice);
    cuGetErrorName(error: c_int, name: *mut *const c_char);
    cuGetErrorString(error: c_int, text: *mut *const c_char);
    cuMemGetAllocationGranularity(
        granularity: *mut usize,
        prop: *const cu::CUmemAllocationProp,
        option: cu::CUmemAllocationGranularity_flags,
    );
    cuPointerGetAttribute(data: *mut c_void, attribute: cu::CUpointer_attribute, ptr: cu::CUdeviceptr);
    cuStreamGetCtx(stream: cu::CUstream, ctx: *mut cu::CUcontext);
    cuMemCreate(
        handle: *mut cu::CUmemGenericAllocationHandle,
        size: usize,
        prop: *const cu::CUmemAllocationProp,
        flags: c_ulonglong,
    );
    cuMemRelease(handle: cu::CUmemGenericAllocationHandle);
    cuMemExportToShareableHandle(
        out: *mut c_void,
        handle: cu::CUmemGenericAllocationHandle,
        kind: cu::CUmemAllocationHandleType,
        flags: c_ulonglong,
    );
    cuMemImportFromShareableHandle(
        handle: *mut cu::CUmemGenericAllocationHandle,
        os_handle: *mut c_void,
        kind: cu::CUmemAllocationHandleType,
    );
    cuMemAddressReserve(
        ptr: *mut cu::CUdeviceptr,
        size: usize,
        alignment: usize,
        addr: cu::CUdeviceptr,
        flags: c_ulonglong,
    );
    cuMemAddressFree(ptr: cu::CUdeviceptr, size: usize);
    cuMemMap(
        ptr: cu::CUdeviceptr,
        size: usize,
        offset: usize,
        handle: cu::CUmemGenericAllocationHandle,
        flags: c_ulonglong,
    );
    cuMemUnmap(ptr: cu::CUdeviceptr, size: usize);
    cuMemSetAccess(ptr: cu::CUdeviceptr, size: usize, desc: *const cu::CUmemAccessDesc, count: usize);
    cuMemAlloc_v2(ptr: *mut cu::CUdeviceptr, size: usize);
    cuMemFree_v2(ptr: cu::CUdeviceptr);
    cuMemHostRegister_v2(ptr: *mut c_void, len: usize, flags: c_uint);
    cuMemHostUnregister(ptr: *mut c_void);
    cuThreadExchangeStreamCaptureMode(mode: *mut c_int);
    cuMemcpyHtoDAsync_v2(dst: cu::CUdeviceptr, src: *const c_void, n: usize, stream: cu::CUstream);
    cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: cu::CUdeviceptr, n: usize, stream: cu::CUstream);
    cuMemcpyDtoDAsync_v2(dst: cu::CUdeviceptr, src: cu::CUdeviceptr, n: usize, stream: cu::CUstream);
    cuMemcpy2DAsync_v2(copy: *const cu::CUDA_MEMCPY2D, stream: cu::CUstream);
    cuStreamCreate(stream: *mut cu::CUstream, flags: c_uint);
    cuStreamDestroy_v2(stream: cu::CUstream);
    cuStreamSynchronize(stream: cu::CUstream);
    cuStreamWaitEvent(stream: cu::CUstream, event: cu::CUevent, flags: c_uint);
    cuEventCreate(event: *mut cu::CUevent, flags: c_uint);
    cuEventDestroy_v2(event: cu::CUevent);
    cuEventRecord(event: cu::CUevent, stream: cu::CUstream);
    cuEventQuery(event: cu::CUevent);
    cuEventSynchronize(event: cu::CUevent);
    cuLaunchHostFunc(stream: cu::CUstream, f: cu::CUhostFn, data: *mut c_void);
}

/// The entry points, once the library is loaded.
static API: OnceLock<Api> = OnceLock::new();

/// Looks every entry point up in `lib` (which stays loaded for the process's life) and makes
/// them callable.
///
/// # Errors
/// The first symbol the library lacks.
pub(crate) fn load(lib: &libloading::Library) -> Result<(), String> {
    let api = Api::load(lib)?;
    let _ = API.set(api);
    Ok(())
}
