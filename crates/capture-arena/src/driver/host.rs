//! Host memory pinned for the device: a range of an existing mapping registered with
//! `cuMemHostRegister`, so copies between it and device memory are DMA the copy engine runs on
//! its own, instead of copies the driver stages through its pinned bounce buffers with the CPU,
//! one chunk at a time, before it returns (CUDA Programming Guide, "Page-Locked Host Memory";
//! NCCL registers its `/dev/shm` segments the same way, `shmutils.cc`).

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys as cu;

use super::{api, check, Context};
use crate::error::Result;

/// `CU_MEMHOSTREGISTER_PORTABLE`: pinned for every context of the process, not only the one
/// current at registration (the writer copies from tensors of any GPU).
const PORTABLE: u32 = 0x01;
/// `CU_MEMHOSTREGISTER_READ_ONLY`: the device only reads the range. The driver documents it as
/// required to register memory the CPU maps read-only, which a reader's view of an arena is.
const READ_ONLY: u32 = 0x08;

/// A registered host range, unregistered on drop. Its owner drops it before unmapping the
/// range.
#[derive(Debug)]
pub(crate) struct HostPin {
    ptr: usize,
    len: usize,
    ctx: Arc<Context>,
    /// The registering process: a forked child has no CUDA state to unregister from.
    pid: u32,
}

impl HostPin {
    /// Registers `[ptr, ptr + len)` in `ctx` (portable: every context sees it pinned);
    /// `read_only` for a mapping the CPU may only read. `None` (and the reason) where the device
    /// cannot register host memory of that kind: copies then stay pageable and correct.
    ///
    /// # Safety
    /// The range stays mapped until the returned pin is dropped.
    ///
    /// # Errors
    /// [`crate::Error::Device`] when the driver refuses the registration.
    pub unsafe fn new(
        ctx: &Arc<Context>,
        ptr: *mut u8,
        len: usize,
        read_only: bool,
    ) -> Result<std::result::Result<HostPin, &'static str>> {
        use cu::CUdevice_attribute as A;
        if ctx.attribute(A::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED) == 0 {
            return Ok(Err("the device does not support cuMemHostRegister"));
        }
        if read_only && ctx.attribute(A::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED) == 0
        {
            return Ok(Err(
                "the device cannot register read-only host memory (CU_MEMHOSTREGISTER_READ_ONLY)",
            ));
        }
        let flags = PORTABLE | if read_only { READ_ONLY } else { 0 };
        let _current = ctx.enter()?;
        // SAFETY: the caller keeps the range mapped while the pin lives; registration pins its
        // pages and changes no contents.
        let rc = unsafe { api::cuMemHostRegister_v2(ptr.cast::<c_void>(), len, flags) };
        check(rc, || {
            format!("pinning {len} bytes of the arena's shared memory (cuMemHostRegister)")
        })?;
        Ok(Ok(HostPin {
            ptr: ptr as usize,
            len,
            ctx: ctx.clone(),
            pid: std::process::id(),
        }))
    }

    /// Bytes pinned.
    pub fn len(&self) -> usize {
        self.len
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
        let rc = unsafe { api::cuMemHostUnregister(self.ptr as *mut c_void) };
        if let Err(e) = check(rc, || "cuMemHostUnregister".into()) {
            tracing::warn!(error = %e, bytes = self.len, "unpinning host memory failed");
        }
    }
}
