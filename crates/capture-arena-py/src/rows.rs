//! A step's requests copied from a paged cache into their reserved arena objects in native
//! code, with the GIL released from the first request to the last, each request's write finished
//! as soon as its bytes land: what vLLM's connector does with hidden states on the CPU, whose
//! rows are spread over the cache's blocks. Done in Python (a `copy_` per block, or a native call
//! per request and its finish), each would wait for the GIL behind the engine's own loop, and its
//! trainer with it. Which requests have landed is kept in [`PyLanded`] flags, which vLLM's
//! thread reads (`get_finished`) while the step's later requests are still being copied.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use capture_arena::paged::{DeviceCopies, Paged, Request};
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

/// A request as Python passes it: `(keys, ids_at, token_ids, rows_at, rows_len, block_ids)`.
pub(crate) type RequestArgs = (Vec<String>, u64, Vec<i64>, u64, u64, Vec<u64>);

/// A paged cache as Python passes it: `(base, bytes, strides, block_size, k, row_bytes)`.
pub(crate) type PagedArgs = (u64, u64, (u64, u64, u64), u64, u64, u64);

/// The cache Python describes.
pub(crate) fn paged((base, len, strides, block_size, k, row_bytes): PagedArgs) -> Paged {
    Paged {
        base,
        len,
        strides,
        block_size,
        k,
        row_bytes,
    }
}

/// The request Python describes.
pub(crate) fn request((keys, ids_dst, ids, rows_dst, rows_len, block_ids): RequestArgs) -> Request {
    Request {
        keys,
        ids_dst,
        ids,
        rows_dst,
        rows_len,
        block_ids,
    }
}

/// A stream of its own on the cache's GPU, for a connector's copies from a device cache
/// (`_DeviceRows(ordinal)`; made on the copy thread, never vLLM's).
#[pyclass(name = "_DeviceRows", module = "capture_arena._capture_arena", frozen)]
pub struct PyDeviceRows(pub(crate) DeviceCopies);

#[pymethods]
impl PyDeviceRows {
    #[new]
    fn new(py: Python<'_>, ordinal: i32) -> PyResult<Self> {
        crate::exit::detach(py, || DeviceCopies::new(ordinal))
            .map(PyDeviceRows)
            .map_err(crate::error::to_py)
    }

    /// Waits until every copy enqueued on the stream has finished (before their objects are
    /// given up); never raises: a failed one's error was reported with its request.
    fn synchronize(&self, py: Python<'_>) -> Option<String> {
        crate::exit::detach(py, || self.0.synchronize().err().map(|e| e.to_string()))
    }
}
