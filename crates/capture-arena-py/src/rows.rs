//! A step's requests copied from a paged cache into their reserved arena objects in native
//! code, with the GIL released from the first request to the last, each request's write finished
//! as soon as its bytes land: what vLLM's connector does with hidden states on the CPU, whose
//! rows are spread over the cache's blocks. Done in Python (a `copy_` per block, or a native call
//! per request and its finish), each would wait for the GIL behind the engine's own loop, and its
//! trainer with it. Which requests have landed is kept in [`PyLanded`] flags, which vLLM's
//! thread reads (`get_finished`) while the step's later requests are still being copied.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;

/// The most requests one set of flags holds (a step of vLLM holds far fewer).
pub(crate) const MAX_LANDED: usize = 1 << 20;

/// Whether each of a step's requests has landed: set by the native copy as soon as that
/// request's write is finished (its readers may read it, or fail), read by vLLM's thread without
/// the copy thread or its GIL. `_Landed(n)`; `flags[i]` is request `i`'s.
#[pyclass(name = "_Landed", module = "capture_arena._capture_arena", frozen)]
pub struct PyLanded(pub(crate) Arc<[AtomicBool]>);

#[pymethods]
impl PyLanded {
    #[new]
    fn new(n: usize) -> PyResult<Self> {
        if n > MAX_LANDED {
            return Err(PyValueError::new_err(format!(
                "_Landed({n}): at most {MAX_LANDED} requests a step"
            )));
        }
        Ok(PyLanded((0..n).map(|_| AtomicBool::new(false)).collect()))
    }

    fn __len__(&self) -> usize {
        self.0.len()
    }

    fn __getitem__(&self, i: usize) -> PyResult<bool> {
        self.0
            .get(i)
            .map(|f| f.load(Ordering::Acquire))
            .ok_or_else(|| PyIndexError::new_err(format!("request {i} of {}", self.0.len())))
    }
}

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

/// A request as Python passes it: `(keys, ids_at, token_ids, rows_at, rows_len, block_ids)`.
pub(crate) type RequestArgs = (Vec<String>, u64, Vec<i64>, u64, u64, Vec<u64>);

/// A paged cache as Python passes it: `(base, bytes, strides, block_size, k, row_bytes)`.
pub(crate) type PagedArgs = (u64, u64, (u64, u64, u64), u64, u64, u64);

impl From<PagedArgs> for Paged {
    fn from((base, len, strides, block_size, k, row_bytes): PagedArgs) -> Self {
        Paged {
            base,
            len,
            strides,
            block_size,
            k,
            row_bytes,
        }
    }
}

impl From<RequestArgs> for Request {
    fn from((keys, ids_dst, ids, rows_dst, rows_len, block_ids): RequestArgs) -> Self {
        Request {
            keys,
            ids_dst,
            ids,
            rows_dst,
            rows_len,
            block_ids,
        }
    }
}

/// One request's copy ([`copy_requests`]): its token ids and rows, where they go, and its
/// objects' keys (finished when it is done).
pub(crate) struct Request {
    pub keys: Vec<String>,
    pub ids_dst: u64,
    pub ids: Vec<i64>,
    pub rows_dst: u64,
    pub rows_len: u64,
    pub block_ids: Vec<u64>,
}

/// The offsets (from `src.base`) of rows `0..n` of a request, token `i` in block
/// `block_ids[i / block_size]`, slot `i % block_size`, in the destination's order `[n, k]`,
/// each checked to lie inside the cache; and that they fill exactly `dst_len` bytes.
fn plan(src: &Paged, dst_len: u64, block_ids: &[u64], n: u64) -> Result<Vec<u64>, String> {
    let want = n
        .checked_mul(src.k)
        .and_then(|x| x.checked_mul(src.row_bytes))
        .ok_or_else(|| "the rows' size overflows".to_owned())?;
    if want != dst_len {
        return Err(format!(
            "{n} rows of {} x {} bytes do not fill the {dst_len}-byte object",
            src.k, src.row_bytes
        ));
    }
    if src.block_size == 0 || n > (block_ids.len() as u64).saturating_mul(src.block_size) {
        return Err(format!(
            "{n} rows need more than {} blocks of {}",
            block_ids.len(),
            src.block_size
        ));
    }
    let mut plan = Vec::with_capacity((n * src.k) as usize);
    for i in 0..n {
        let block = block_ids[(i / src.block_size) as usize];
        for layer in 0..src.k {
            let at = src.row(block, layer, i % src.block_size).ok_or_else(|| {
                format!("row {i} of layer {layer} (block {block}) lies outside the cache")
            })?;
            plan.push(at);
        }
    }
    Ok(plan)
}

/// Whether `[at, at + len)` lies inside `[base, base + size)`.
fn inside((base, size): (u64, u64), at: u64, len: u64) -> bool {
    at >= base && at.checked_add(len).is_some_and(|end| end <= base + size)
}

/// Copies each request's token ids and rows into its reserved objects, which must lie in
/// `arena` (`(address, bytes)` as this process maps it), and calls `finished(i, keys, ok)` as
/// soon as request `i`'s bytes have landed (or never will): its readers need not wait for the
/// others.
/// Returns, per request, `None` or why it was not copied (checked before any of its bytes are:
/// a destination outside the arena, rows outside the cache, sizes that do not match). Runs
/// without the GIL (the caller releases it).
///
/// # Safety
/// `[src.base, src.base + src.len)` must be valid for reads until this returns, and `arena`
/// valid for writes; they must not overlap; nothing else may write the requests' objects
/// meanwhile.
pub(crate) unsafe fn copy_requests(
    src: &Paged,
    arena: (u64, u64),
    requests: Vec<Request>,
    mut finished: impl FnMut(usize, Vec<String>, bool),
) -> Vec<Option<String>> {
    let mut out = Vec::with_capacity(requests.len());
    for (i, r) in requests.into_iter().enumerate() {
        let ids_len = (r.ids.len() as u64) * 8;
        let checked =
            if !inside(arena, r.ids_dst, ids_len) || !inside(arena, r.rows_dst, r.rows_len) {
                Err(format!(
                    "[{:#x}, +{ids_len}) or [{:#x}, +{}) is not in this sink's host arena",
                    r.ids_dst, r.rows_dst, r.rows_len
                ))
            } else {
                plan(src, r.rows_len, &r.block_ids, r.ids.len() as u64)
            };
        match checked {
            Ok(rows) => {
                // SAFETY: the destinations lie inside the arena and the rows inside the cache
                // (checked above); the caller vouched for both ranges and that nothing else
                // writes these objects.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        r.ids.as_ptr() as *const u8,
                        r.ids_dst as usize as *mut u8,
                        ids_len as usize,
                    );
                    copy_planned(src, r.rows_dst, rows);
                }
                finished(i, r.keys, true);
                out.push(None);
            }
            Err(why) => {
                finished(i, r.keys, false);
                out.push(Some(format!("copying cache rows: {why}")));
            }
        }
    }
    out
}

/// Copies the planned rows, `src.row_bytes` each, one after another into `dst`.
///
/// # Safety
/// Every planned row lies inside the cache and `dst` holds them all (checked by [`plan`] and
/// the caller); the ranges are valid and do not overlap.
unsafe fn copy_planned(src: &Paged, dst: u64, rows: Vec<u64>) {
    let (base, row) = (src.base as usize, src.row_bytes as usize);
    for (j, at) in rows.into_iter().enumerate() {
        // SAFETY: the caller's promise (above).
        unsafe {
            std::ptr::copy_nonoverlapping(
                (base + at as usize) as *const u8,
                (dst as usize + j * row) as *mut u8,
                row,
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache `[blocks, k, block_size, row]` of distinct bytes, and its layout.
    fn cache(blocks: u64, k: u64, bs: u64, row: u64) -> (Vec<u8>, Paged) {
        let len = blocks * k * bs * row;
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let src = Paged {
            base: bytes.as_ptr() as u64,
            len,
            strides: (k * bs * row, bs * row, row),
            block_size: bs,
            k,
            row_bytes: row,
        };
        (bytes, src)
    }

    #[test]
    fn each_request_is_copied_and_finished_in_order_and_a_bad_one_costs_only_itself() {
        let (k, bs, row) = (2u64, 4u64, 8u64);
        let (bytes, src) = cache(4, k, bs, row);
        let mut arena = vec![0u8; 4096];
        let base = arena.as_mut_ptr() as u64;
        let n = 6u64; // blocks [2, 0]: rows 0..4 from block 2, 4..6 from block 0
        let rows_len = n * k * row;
        let good = |at: u64, keys: &str| Request {
            keys: vec![keys.into()],
            ids_dst: base + at,
            ids: (0..n as i64).map(|i| 100 + i).collect(),
            rows_dst: base + at + 64,
            rows_len,
            block_ids: vec![2, 0],
        };
        let mut outside = good(1024, "outside");
        outside.rows_dst = base + 4096 - 8; // past the arena's end
        let mut beyond = good(2048, "beyond");
        beyond.block_ids = vec![2, 9]; // block 9 is not in the cache
        let requests = vec![good(0, "a"), outside, beyond, good(3072, "b")];
        let mut finished = Vec::new();
        // SAFETY: both buffers live until the call returns and do not overlap.
        let why = unsafe {
            copy_requests(&src, (base, 4096), requests, |i, keys, ok| {
                finished.push((i, keys[0].clone(), ok))
            })
        };
        assert_eq!(
            finished,
            [
                (0, "a".into(), true),
                (1, "outside".into(), false),
                (2, "beyond".into(), false),
                (3, "b".into(), true)
            ]
        );
        assert!(why[0].is_none() && why[3].is_none());
        assert!(
            why[1]
                .as_deref()
                .unwrap()
                .contains("not in this sink's host arena"),
            "{why:?}"
        );
        assert!(
            why[2]
                .as_deref()
                .unwrap()
                .contains("(block 9) lies outside the cache"),
            "{why:?}"
        );
        for at in [0usize, 3072] {
            let ids: Vec<i64> = arena[at..at + 48]
                .chunks(8)
                .map(|c| i64::from_ne_bytes(c.try_into().unwrap()))
                .collect();
            assert_eq!(ids, (100..106).collect::<Vec<i64>>());
            for i in 0..n {
                let block = [2u64, 0][(i / bs) as usize];
                for layer in 0..k {
                    let from = (block * k * bs * row + layer * bs * row + (i % bs) * row) as usize;
                    let to = at + 64 + ((i * k + layer) * row) as usize;
                    assert_eq!(
                        arena[to..to + row as usize],
                        bytes[from..from + row as usize],
                        "row {i} layer {layer}"
                    );
                }
            }
        }
        assert!(
            arena[1024..2048].iter().all(|&b| b == 0) && arena[2048..3072].iter().all(|&b| b == 0)
        );
    }

    #[test]
    fn rows_that_do_not_fill_the_object_are_refused() {
        let (_bytes, src) = cache(2, 2, 4, 8);
        assert!(plan(&src, 2 * 2 * 8 + 1, &[0], 2)
            .unwrap_err()
            .contains("do not fill"));
        assert!(plan(&src, 5 * 2 * 8, &[0], 5)
            .unwrap_err()
            .contains("need more than 1 blocks of 4"));
    }
}
