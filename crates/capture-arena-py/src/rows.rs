//! A paged cache's rows copied into one reserved arena object in native code, with the GIL
//! released: what vLLM's connector does with a request's hidden states on the CPU, whose rows
//! are spread over the cache's blocks. Done in Python (a `copy_` per block), each block would
//! wait for the GIL behind the engine's own loop.

use pyo3::prelude::*;

use crate::error::named;

/// Where a request's rows are in a paged cache `[blocks, k, block_size, row]` (in bytes, through
/// its strides): each `(block, layer, slot)` row is `row_bytes` contiguous bytes at
/// `base + block * strides.0 + layer * strides.1 + slot * strides.2`, all inside
/// `[base, base + len)`.
pub(crate) struct Paged {
    pub base: u64,
    pub len: u64,
    pub strides: (u64, u64, u64),
    pub block_size: u64,
    pub k: u64,
    pub row_bytes: u64,
}

impl Paged {
    /// The offset from `base` of row `slot` of `layer` in `block`, checked to lie (with its
    /// `row_bytes`) inside the cache; `None` otherwise.
    fn row(&self, block: u64, layer: u64, slot: u64) -> Option<u64> {
        let at = block
            .checked_mul(self.strides.0)?
            .checked_add(layer.checked_mul(self.strides.1)?)?
            .checked_add(slot.checked_mul(self.strides.2)?)?;
        (at.checked_add(self.row_bytes)? <= self.len).then_some(at)
    }
}

/// Copies rows `0..n` of a request (token `i` in block `block_ids[i / block_size]`, slot
/// `i % block_size`) into `dst`, laid out `[n, k, row]`: `dst_len` bytes, exactly
/// `n * k * row_bytes`. Every source row and the destination are checked before anything is
/// copied; the copy runs with the GIL released.
///
/// # Safety
/// `[src.base, src.base + src.len)` must be valid for reads and `[dst, dst + dst_len)` valid for
/// writes until this returns, and they must not overlap; nothing else may write the
/// destination meanwhile.
pub(crate) unsafe fn copy_rows(
    py: Python<'_>,
    dst: u64,
    dst_len: u64,
    src: &Paged,
    block_ids: &[u64],
    n: u64,
) -> PyResult<()> {
    let bad = |why: String| named(py, "InvalidReadError", format!("copying cache rows: {why}"));
    let want = n
        .checked_mul(src.k)
        .and_then(|x| x.checked_mul(src.row_bytes))
        .ok_or_else(|| bad("the rows' size overflows".into()))?;
    if want != dst_len {
        return Err(bad(format!(
            "{n} rows of {} x {} bytes do not fill the {dst_len}-byte object",
            src.k, src.row_bytes
        )));
    }
    if src.block_size == 0 || n > (block_ids.len() as u64).saturating_mul(src.block_size) {
        return Err(bad(format!(
            "{n} rows need more than {} blocks of {}",
            block_ids.len(),
            src.block_size
        )));
    }
    let mut plan = Vec::with_capacity((n * src.k) as usize);
    for i in 0..n {
        let block = block_ids[(i / src.block_size) as usize];
        for layer in 0..src.k {
            let at = src.row(block, layer, i % src.block_size).ok_or_else(|| {
                bad(format!(
                    "row {i} of layer {layer} (block {block}) lies outside the cache"
                ))
            })?;
            plan.push(at);
        }
    }
    let (base, row) = (src.base as usize, src.row_bytes as usize);
    py.detach(|| {
        for (j, at) in plan.into_iter().enumerate() {
            // SAFETY: the source row lies inside the cache range and the destination row inside
            // the object (both checked above); the caller vouched for both ranges and that they
            // do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (base + at as usize) as *const u8,
                    (dst as usize + j * row) as *mut u8,
                    row,
                )
            };
        }
    });
    Ok(())
}
