//! What the host regions share: copying a batch in slices of a byte budget (so the writer
//! serves control input between slices of a huge copy), from any source kind into host memory.

use crate::error::{Error, Result};
use crate::memory::{CopyOp, Progress};

/// The batch in flight of a host region: `(op index, bytes of that op already copied)`.
#[derive(Debug, Default)]
pub(crate) struct SliceCopier {
    cursor: Option<(usize, u64)>,
}

impl SliceCopier {
    /// Checks every copy against a region of `len` bytes advertised at `base`, then starts.
    pub fn start(&mut self, base: u64, len: u64, ops: &[CopyOp<'_>]) -> Result<()> {
        super::check_ops(base, len, ops)?;
        self.cursor = Some((0, 0));
        Ok(())
    }

    /// Copies about `budget` more bytes with `copy(op, from, n)` (bytes `[from, from + n)` of
    /// `op`'s data).
    pub fn progress(
        &mut self,
        ops: &[CopyOp<'_>],
        budget: u64,
        mut copy: impl FnMut(&CopyOp<'_>, u64, u64) -> Result<()>,
    ) -> Result<Progress> {
        let Some((mut i, mut done)) = self.cursor else {
            return Ok(Progress::Done);
        };
        let mut left = budget.max(1);
        while i < ops.len() && left > 0 {
            let op = &ops[i];
            let n = (op.data.len() - done).min(left);
            if let Err(e) = copy(op, done, n) {
                self.cursor = None;
                return Err(e);
            }
            done += n;
            left -= n;
            if done == op.data.len() {
                (i, done) = (i + 1, 0);
            }
        }
        if i == ops.len() {
            self.cursor = None;
            Ok(Progress::Done)
        } else {
            self.cursor = Some((i, done));
            Ok(Progress::Again)
        }
    }

    /// Forgets the batch in flight (host copies are synchronous: nothing runs on).
    pub fn abandon(&mut self) {
        self.cursor = None;
    }
}

/// Copies bytes `[from, from + n)` of `op`'s data to host memory at `dst`: host sources with
/// `memcpy`, device sources (feature `cuda`) device-to-host after their ready event.
///
/// # Safety
/// `dst` must be valid for writes of `n` bytes, written by nobody else meanwhile, and not
/// overlap the source.
pub(crate) unsafe fn copy_to_host(op: &CopyOp<'_>, from: u64, n: u64, dst: *mut u8) -> Result<()> {
    if from.checked_add(n).is_none_or(|e| e > op.data.len()) {
        return Err(Error::InvalidTensor {
            name: format!("{:?}", op.data),
            reason: format!(
                "bytes {from}..{} are outside the tensor",
                from.saturating_add(n)
            ),
        });
    }
    if let Some((src, _)) = op.data.host_source() {
        // SAFETY: the source is valid for reads of `op.data.len()` bytes (one slice taken when
        // the tensor was made) and unchanged while the batch is in flight (owned bytes; lent
        // bytes by `TensorData::lent`'s contract), and [from, from + n) lies inside it
        // (checked); the destination is the caller's promise.
        unsafe { std::ptr::copy_nonoverlapping(src.add(from as usize), dst, n as usize) };
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    if let crate::tensor::TensorData::Device(d) = op.data {
        // SAFETY: as above; the device source is valid for `from + n` bytes (checked) while the
        // batch lives (TensorData::device's contract).
        return unsafe { crate::memory::cuda::device_to_host(d, from, dst, n) };
    }
    Err(Error::InvalidTensor {
        name: format!("{:?}", op.data),
        reason: "this source kind cannot be copied into host memory".into(),
    })
}

/// Stores `word` (little-endian) at `dst` for readers in other processes: a release fence, so
/// that every store this thread made, or saw made, before is seen first, then the word (volatile:
/// never split or elided for an aligned `dst`).
///
/// # Safety
/// `[dst, dst + 8)` must be valid for writes and 8-byte aligned.
pub(crate) unsafe fn store_word(dst: *mut u8, word: u64) {
    std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
    // SAFETY: the caller vouched for an aligned, writable word.
    unsafe { dst.cast::<u64>().write_volatile(word.to_le()) };
    std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
}

/// Zeroes `len` bytes at `dst` for readers in other processes: volatile stores, then a release
/// fence, so that every later store of this thread (a copy placing another object there) is seen
/// after them.
///
/// # Safety
/// `[dst, dst + len)` must be valid for writes.
pub(crate) unsafe fn clear_host(dst: *mut u8, len: u64) {
    for i in 0..len as usize {
        // SAFETY: inside the range the caller vouched for.
        unsafe { dst.add(i).write_volatile(0) };
    }
    std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
}
