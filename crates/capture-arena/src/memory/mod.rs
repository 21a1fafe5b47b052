//! Regions: the memory an arena places objects in.
//!
//! A [`Region`] is `len` bytes that the writer copies tensors into, plus what a reader needs to
//! find them again: a session string and a base address. The allocator only deals in offsets
//! `[0, len)`; an object at offset `o` is published at address `base_address() + o`, so a reader
//! computes `offset = address - base` and checks `offset + bytes <= len` before touching memory.
//!
//! Today there is one kind, [`ShmRegion`]: host shared memory that readers on the same host map
//! read-only. GPU memory (CUDA virtual memory with fabric or POSIX-fd handles) and memory that a
//! transfer engine allocated or registered are further implementations of the same trait: the
//! allocator, the arena and the writer do not change for them.

pub mod shm;

pub use shm::{ShmRegion, ShmSession, ShmView};

use std::fmt;

use crate::error::Result;
use crate::tensor::TensorData;

/// Memory an arena places objects in. Only the writer thread holds it (`&mut self` for writes).
pub trait Region: Send + fmt::Debug {
    /// Usable bytes, `[0, len)`.
    fn len(&self) -> u64;

    /// True if the region has no bytes (never, for a region an arena accepts).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The address advertised for offset 0: an object at offset `o` has address `base + o`.
    fn base_address(&self) -> u64;

    /// What a reader opens to reach this region (the result's `arena.session`).
    fn session(&self) -> &str;

    /// Copies `data` to `[offset, offset + data.len())`.
    ///
    /// # Errors
    /// If the range is outside the region, the data's kind cannot be copied into this region, or
    /// the copy itself fails (device copies).
    fn write(&mut self, offset: u64, data: &TensorData) -> Result<()>;
}
