//! A step's requests copied from a paged cache into their reserved arena objects in native
//! code, the GIL held only to read their token ids (in holds of [`IDS_PER_HOLD`] ids), each
//! request's write finished as soon as its bytes land: what vLLM's connector does with hidden
//! states, whose rows are spread over the cache's blocks. Done in Python (a `copy_` per block,
//! or a native call per request and its finish), each would wait for the GIL behind the
//! engine's own loop, and its trainer with it. Which requests have landed is kept in
//! [`PyLanded`] flags, which vLLM's thread reads (`get_finished`) while the step's later
//! requests are still being copied.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use capture_arena::paged::{DeviceCopies, HostPin, Paged, Request};

use crate::held::Held;
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

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

    /// As a list's: a negative index counts from the end.
    fn __getitem__(&self, i: isize) -> PyResult<bool> {
        let n = self.0.len();
        let at = if i < 0 {
            n.checked_sub(i.unsigned_abs())
        } else {
            Some(i.unsigned_abs())
        };
        at.and_then(|at| self.0.get(at))
            .map(|f| f.load(Ordering::Acquire))
            .ok_or_else(|| PyIndexError::new_err(format!("request {i} of {n}")))
    }
}

/// A request as Python passes it: `(keys, (ids_at, ids_stamp), token_ids, n, (rows_at,
/// rows_stamp), rows_len, block_ids)`, its token ids the first `n` of `token_ids` (vLLM's own
/// list, not sliced in Python), each destination its reserved object's address and the stamp
/// its reservation's result gives it. Read one request at a time ([`next_hold`]): a request that
/// is not this fails alone.
pub(crate) type RequestArgs<'py> = (
    Vec<String>,
    (u64, u64),
    Bound<'py, PyList>,
    usize,
    (u64, u64),
    u64,
    Bound<'py, PyList>,
);

/// A paged cache as Python passes it: `(base, bytes, strides, block_size, k, row_bytes,
/// blocks)`.
pub(crate) type PagedArgs = (u64, u64, (u64, u64, u64), u64, u64, u64, u64);

/// The cache Python describes.
pub(crate) fn paged((base, len, strides, block_size, k, row_bytes, blocks): PagedArgs) -> Paged {
    Paged {
        base,
        len,
        blocks,
        strides,
        block_size,
        k,
        row_bytes,
    }
}

/// The most token ids the copy thread reads in one hold of the GIL (0.6 to 1.2 ms, at 5 to 9
/// ns an id): a step's requests are read in holds of up to this many ids, each hold's requests then
/// copied (or added to the device step) with the GIL released. One hold for a step of 32
/// prompts of 2048 tokens (65,536 ids), a few for the largest: never a whole long step's ids at
/// once, which vLLM's thread would wait for, nor a hold a request, whose taking back the GIL
/// may each wait for vLLM's thread (up to Python's 5 ms switch interval). A request longer than
/// this is read in holds of this many of its ids, the GIL let go for [`YIELD`] between them (a
/// prompt of a million tokens held it about 5 to 9 ms at once before).
pub(crate) const IDS_PER_HOLD: usize = 1 << 17;

/// How long the GIL is let go between two holds of one request's ids: long enough for a thread
/// that waits for it (vLLM's, woken as it is let go) to take it. Let go and taken straight back,
/// the waiter would lose the race, and each wake restarts its count towards asking for the GIL
/// (Python's switch interval, 5 ms), so it would wait for the whole request all the same.
const YIELD: std::time::Duration = std::time::Duration::from_micros(100);

/// A request read ([`request`]): its index in the step, and the request or why not.
pub(crate) type Read = (usize, Result<Request, (Vec<String>, String)>);

/// The next requests of a step read in one hold of the GIL: at least one, then as many as keep
/// the hold within `ids_per_hold` token ids.
pub(crate) fn next_hold<'py>(
    requests: &mut std::iter::Peekable<impl Iterator<Item = (usize, Bound<'py, PyAny>)>>,
    ids_per_hold: usize,
) -> Vec<Read> {
    let mut hold = Vec::new();
    let mut ids = 0usize;
    while let Some((_, item)) = requests.peek() {
        let more = ids_of(item);
        if !hold.is_empty() && ids.saturating_add(more) > ids_per_hold {
            break;
        }
        let Some((j, item)) = requests.next() else {
            break;
        };
        ids = ids.saturating_add(more);
        hold.push((j, request(&item, ids_per_hold)));
    }
    hold
}

/// How many token ids a request passed as `item` asks to be read (0 if it is not a request).
fn ids_of(item: &Bound<'_, PyAny>) -> usize {
    let n = item.get_item(3).and_then(|n| n.extract::<usize>());
    let ids = item.get_item(2).and_then(|l| l.len());
    match (n, ids) {
        (Ok(n), Ok(len)) => n.min(len),
        _ => 0,
    }
}

/// The request Python describes, its ids read out of their lists (with the GIL, on the copy
/// thread: each microsecond of it is one vLLM's thread may wait for); where it is not a request
/// or its ids cannot be read, its objects' keys (none if even they cannot be read: nothing can
/// then finish them) and why.
/// `ids_per_hold`: how many of its token ids are read in one hold of the GIL (it is let go
/// between them).
pub(crate) fn request(
    item: &Bound<'_, PyAny>,
    ids_per_hold: usize,
) -> Result<Request, (Vec<String>, String)> {
    let (keys, (ids_dst, ids_stamp), ids, n, (rows_dst, rows_stamp), rows_len, block_ids) =
        match item.extract::<RequestArgs<'_>>() {
            Ok(args) => args,
            Err(e) => {
                let keys = item.get_item(0).and_then(|k| k.extract::<Vec<String>>());
                return Err((
                    keys.unwrap_or_default(),
                    format!(
                        "a request is (keys, (ids_at, ids_stamp), token_ids, n, (rows_at, \
                         rows_stamp), rows_len, block_ids), not this: {e}"
                    ),
                ));
            }
        };
    let blocks = first_ints(&block_ids, block_ids.len(), usize::MAX).and_then(|b| {
        b.into_iter()
            .map(|b| {
                u64::try_from(b)
                    .map_err(|_| PyValueError::new_err(format!("block id {b} is negative")))
            })
            .collect::<PyResult<Vec<u64>>>()
    });
    match (first_ints(&ids, n, ids_per_hold), blocks) {
        (Ok(ids), Ok(block_ids)) => Ok(Request {
            keys,
            ids_dst,
            ids_stamp,
            ids,
            rows_dst,
            rows_stamp,
            rows_len,
            block_ids,
        }),
        (Err(e), _) => Err((keys, format!("reading its token ids: {e}"))),
        (_, Err(e)) => Err((keys, format!("reading its block ids: {e}"))),
    }
}

/// The first `n` items of `list` as int64 (all of them if it holds fewer: the request's plan
/// then finds too few rows and fails it alone), read in place as cheaply as the C API allows:
/// about 5 ns an id, against 15 for a sequence's generic extraction (a step of 32 prompts of
/// 2048 tokens held the GIL 1 ms for its ids). The GIL is let go for [`YIELD`] after each
/// `per_hold` of them (vLLM only ever extends a prompt's list, so an item read after that is the
/// one it was; a list cut meanwhile fails the read with an IndexError).
fn first_ints(list: &Bound<'_, PyList>, n: usize, per_hold: usize) -> PyResult<Vec<i64>> {
    let py = list.py();
    let n = n.min(list.len());
    let per_hold = per_hold.max(1);
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        if i > 0 && i % per_hold == 0 {
            crate::exit::detach(py, || std::thread::sleep(YIELD));
        }
        // SAFETY: `list` is a list this call holds a reference to, with the GIL held; the index
        // is checked (NULL and an IndexError past the end). The item is borrowed: it lives while
        // no Python code runs, and none runs before it is read (an exact int converts without
        // any; anything else is read below through a reference of its own).
        let item = unsafe { ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t) };
        if item.is_null() {
            return Err(PyErr::fetch(py));
        }
        // SAFETY: `item` is a live object (above); comparing its type reads its header only.
        let exact = unsafe { ffi::Py_TYPE(item) == std::ptr::addr_of_mut!(ffi::PyLong_Type) };
        let v = if exact {
            // SAFETY: an exact int, live (above): PyLong_AsLongLong runs no Python code for one.
            let v = unsafe { ffi::PyLong_AsLongLong(item) };
            if v == -1 {
                if let Some(e) = PyErr::take(py) {
                    return Err(e); // out of int64's range
                }
            }
            v
        } else {
            // An int subclass, or anything with __index__ (which may run Python code).
            list.get_item(i)?.extract::<i64>()?
        };
        out.push(v);
    }
    Ok(out)
}

/// A stream of its own on the cache's GPU, for a connector's copies from a device cache
/// (`_DeviceRows(ordinal)`; made on the copy thread, never vLLM's), and the host arena it copies
/// into, pinned while it is (`_ArenaSink._pin_host_arena`).
#[pyclass(name = "_DeviceRows", module = "capture_arena._capture_arena", frozen)]
pub struct PyDeviceRows(
    pub(crate) DeviceCopies,
    i32,
    /// The pin, and a hold on the sink whose arena it pins: the arena stays mapped while the
    /// hold lives, and the pin drops first (a tuple drops its fields in order).
    std::sync::Mutex<Option<(HostPin, Held)>>,
);

impl PyDeviceRows {
    /// Starts pinning `sink`'s host arena, `[address, address + len)` as this process maps it,
    /// for these copies; false if one is pinned already. The pin keeps a hold on the sink, so
    /// the arena outlives it however the sink is closed or collected.
    ///
    /// # Safety
    /// `[address, address + len)` is `sink`'s own host mapping.
    pub(crate) unsafe fn pin(&self, sink: Held, address: u64, len: u64) -> bool {
        let mut slot = self.2.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_some() {
            return false;
        }
        // SAFETY: the sink's own mapping, which stays mapped while `sink` (kept beside the pin,
        // and dropped after it) holds its writer.
        *slot = Some((unsafe { HostPin::start(self.1, address, len) }, sink));
        true
    }
}

#[pymethods]
impl PyDeviceRows {
    #[new]
    fn new(py: Python<'_>, ordinal: i32) -> PyResult<Self> {
        crate::exit::detach(py, || DeviceCopies::new(ordinal))
            .map(|c| PyDeviceRows(c, ordinal, std::sync::Mutex::new(None)))
            .map_err(crate::error::to_py)
    }

    /// Whether the host arena is pinned now (false while it is being registered, and where
    /// pinning is off, refused or never asked for).
    fn host_pinned(&self) -> bool {
        let slot = self.2.lock().unwrap_or_else(|p| p.into_inner());
        slot.as_ref().is_some_and(|(pin, _)| pin.pinned())
    }

    /// Unpins the host arena (waiting for a registration still running): before the arena is
    /// unmapped. Nothing if none is pinned.
    fn unpin_host(&self, py: Python<'_>) {
        let pin = self.2.lock().unwrap_or_else(|p| p.into_inner()).take();
        crate::exit::detach(py, || drop(pin));
    }

    /// Waits until every copy enqueued on the stream has finished (before their objects are
    /// given up); never raises: a failed one's error was reported with its request.
    fn synchronize(&self, py: Python<'_>) -> Option<String> {
        crate::exit::detach(py, || self.0.synchronize().err().map(|e| e.to_string()))
    }
}
