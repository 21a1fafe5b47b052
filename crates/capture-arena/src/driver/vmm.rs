//! Virtual memory: allocations made with `cuMemCreate` (exportable as descriptors or fabric
//! handles, RDMA-capable where the device allows), imports of other processes' allocations,
//! their mappings with access for chosen devices, and what the driver says an address is.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use cudarc::driver::sys as cu;

use super::{api, check, describe, Context};
use crate::error::{Error, Result};

/// The most allocations [`check_device_range`] walks through in one range (2 TiB in 2 MiB
/// mappings): a range of more is refused.
const MAX_PIECES: usize = 1 << 20;

/// Checks that `[ptr, ptr + len)` is device memory of device `ordinal` as the driver sees it,
/// before anything is copied there: every allocation (or mapping) the range spans, one after
/// another, each beginning where the one before ends (no hole between them), of that device.
/// Where the driver does not say where an allocation begins and ends
/// (`CU_POINTER_ATTRIBUTE_RANGE_START_ADDR` and `RANGE_SIZE`), the range's last byte is checked
/// as its first was, and nothing between them.
///
/// # Errors
/// [`Error::Device`] saying what the memory is instead (host memory, another device's, or
/// memory CUDA does not know: a hole between two allocations).
pub(crate) fn check_device_range(ptr: u64, len: u64, ordinal: i32) -> Result<()> {
    let what = || format!("checking {len} bytes at {ptr:#x} are memory of GPU {ordinal}");
    let last = ptr.checked_add(len.max(1) - 1).ok_or_else(|| {
        Error::device(
            what(),
            "the range wraps around the address space".to_string(),
        )
    })?;
    let mut at = ptr;
    for _ in 0..MAX_PIECES {
        check_device_byte(at, ordinal, &what)?;
        let Some(end) = allocation_end(at) else {
            return check_device_byte(last, ordinal, &what);
        };
        if end > last {
            return Ok(());
        }
        at = end; // the next allocation's first byte, or a hole
    }
    Err(Error::device(
        what(),
        format!(
            "the range spans more than {MAX_PIECES} allocations; give the arena one range of \
             device memory"
        ),
    ))
}

/// One past the last byte of the allocation (or mapping) `at` lies in, as the driver says;
/// `None` where it does not, or says something that does not hold `at`.
fn allocation_end(at: u64) -> Option<u64> {
    let mut start: u64 = 0;
    let mut size: usize = 0;
    // SAFETY: RANGE_START_ADDR writes one CUdeviceptr (a u64), RANGE_SIZE one size_t; the
    // driver validates the pointer.
    let (a, b) = unsafe {
        (
            api::cuPointerGetAttribute(
                (&mut start as *mut u64).cast(),
                cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                at,
            ),
            api::cuPointerGetAttribute(
                (&mut size as *mut usize).cast(),
                cu::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                at,
            ),
        )
    };
    let end = start.checked_add(size as u64)?;
    (a == api::SUCCESS && b == api::SUCCESS && start <= at && at < end).then_some(end)
}

/// Checks that the byte at `at` is device memory of device `ordinal`.
fn check_device_byte(at: u64, ordinal: i32, what: &dyn Fn() -> String) -> Result<()> {
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
            format!(
                "the address {at:#x} is host memory (CUDA memory type {kind}), not device memory"
            ),
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
    Ok(())
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
