//! Host memory the arena does not own: a transfer engine's registered buffer, any allocation
//! someone else keeps alive. Published under the owner's session (a Mooncake TransferEngine's
//! `<host>:<rpc_port>`), with addresses that are this process's virtual addresses, exactly what
//! the owner's readers take.

use std::fmt;
use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::memory::host::{copy_to_host, SliceCopier};
use crate::memory::{CopyOp, Progress, Region};

/// See the module docs.
pub struct ExternalHostRegion {
    ptr: NonNull<u8>,
    len: u64,
    session: String,
    copier: SliceCopier,
    _owner: Box<dyn Send>,
}

// SAFETY: the region is a loan of memory its constructor's caller promised stays valid and
// written by nobody else while the region lives; only the writer thread (which owns the region)
// writes through the pointer.
unsafe impl Send for ExternalHostRegion {}

impl ExternalHostRegion {
    /// `len` bytes of host memory at `ptr`, advertised as `session` (addresses in results are
    /// `ptr + offset`), kept alive by `owner`, which is dropped with the region.
    ///
    /// # Errors
    /// [`Error::InvalidSession`] for an empty, over-long or unprintable session;
    /// [`Error::Config`] for a null pointer or zero length.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be valid for writes until `owner` is dropped, and nobody else may
    /// write it (or hand out references to it) while the region lives; readers in other
    /// processes (the engine's) only read it.
    pub unsafe fn new(
        ptr: *mut u8,
        len: u64,
        session: String,
        owner: impl Send + 'static,
    ) -> Result<ExternalHostRegion> {
        super::check_session(&session)?;
        let ptr = NonNull::new(ptr).filter(|_| len > 0).ok_or_else(|| {
            Error::config(
                "SGLANG_SPEC_CAPTURE_ARENA_BYTES",
                "an external region needs a non-null pointer and at least one byte",
            )
        })?;
        Ok(ExternalHostRegion {
            ptr,
            len,
            session,
            copier: SliceCopier::default(),
            _owner: Box::new(owner),
        })
    }
}

impl fmt::Debug for ExternalHostRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExternalHostRegion")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("session", &self.session)
            .finish()
    }
}

impl Region for ExternalHostRegion {
    fn len(&self) -> u64 {
        self.len
    }

    fn base_address(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    fn session(&self) -> &str {
        &self.session
    }

    unsafe fn start(&mut self, ops: &[CopyOp<'_>]) -> Result<()> {
        self.copier.start(self.base_address(), self.len, ops)
    }

    fn progress(&mut self, ops: &[CopyOp<'_>], budget: u64) -> Result<Progress> {
        let (base, len) = (self.ptr, self.len);
        self.copier.progress(ops, budget, |op, from, n| {
            let at = op
                .offset
                .checked_add(from)
                .filter(|&o| o.checked_add(n).is_some_and(|e| e <= len))
                .ok_or(Error::OutOfRange {
                    address: (base.as_ptr() as u64).wrapping_add(op.offset),
                    len: n,
                    base: base.as_ptr() as u64,
                    region_len: len,
                })?;
            // SAFETY: [at, at + n) lies inside the region (checked), which the constructor's
            // caller promised is valid for writes and written by nobody else; sources are
            // caller memory outside it.
            unsafe { copy_to_host(op, from, n, base.as_ptr().add(at as usize)) }
        })
    }

    fn abandon(&mut self) {
        self.copier.abandon();
    }

    fn clear(&mut self, offset: u64, len: u64) {
        if super::clear_in_range(offset, len, self.len) {
            // SAFETY: inside the region (checked), which the constructor's caller promised is
            // valid for writes and written by nobody else.
            unsafe { super::host::clear_host(self.ptr.as_ptr().add(offset as usize), len) }
        }
    }

    fn set_word(&mut self, offset: u64, word: u64) {
        let dst = self.ptr.as_ptr().wrapping_add(offset as usize);
        if !(dst as usize).is_multiple_of(8) || !super::clear_in_range(offset, 8, self.len) {
            tracing::error!(offset, "a stamp word outside the region or not aligned");
            return;
        }
        // SAFETY: an aligned word inside the region (checked), which the constructor's caller
        // promised is valid for writes and written by nobody else.
        unsafe { super::host::store_word(dst, word) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::MAX_SESSION_BYTES;
    use crate::tensor::TensorData;

    #[test]
    fn copies_into_someone_elses_memory_and_checks_ranges() {
        let mut mem = vec![0u8; 4096];
        let ptr = mem.as_mut_ptr();
        // SAFETY: `mem` outlives the region (dropped at the end of the test, after it) and
        // nothing else touches it meanwhile.
        let mut r = unsafe { ExternalHostRegion::new(ptr, 4096, "host:1234".into(), ()) }.unwrap();
        assert_eq!((r.len(), r.session()), (4096, "host:1234"));
        assert_eq!(r.base_address(), ptr as u64);
        let data = TensorData::host(vec![7u8; 1000]);
        let ops = [CopyOp {
            offset: 100,
            data: &data,
        }];
        // SAFETY: `data` outlives the loop below, which runs the copy to its end.
        unsafe { r.start(&ops) }.unwrap();
        let mut steps = 0;
        while r.progress(&ops, 256).unwrap() == Progress::Again {
            steps += 1;
        }
        assert_eq!(steps, 3, "1000 bytes in slices of 256");
        let bad = [CopyOp {
            offset: 3500,
            data: &data,
        }];
        assert!(matches!(
            // SAFETY: refused before any copy starts; `bad`'s data outlives the call.
            unsafe { r.start(&bad) },
            Err(Error::OutOfRange { .. })
        ));
        drop(r);
        assert!(mem[100..1100].iter().all(|&b| b == 7));
        assert!(mem[..100].iter().chain(&mem[1100..]).all(|&b| b == 0));
    }

    #[test]
    fn refuses_bad_sessions_and_null_memory() {
        for s in ["", "a\nb", &"x".repeat(MAX_SESSION_BYTES + 1)] {
            // SAFETY: never written (construction fails first).
            let e = unsafe { ExternalHostRegion::new(8 as *mut u8, 1, s.to_owned(), ()) };
            assert!(matches!(e, Err(Error::InvalidSession { .. })), "{s:?}");
        }
        // SAFETY: refused before any use.
        let e = unsafe { ExternalHostRegion::new(std::ptr::null_mut(), 1, "h:1".into(), ()) };
        assert!(matches!(e, Err(Error::Config { .. })));
    }
}
