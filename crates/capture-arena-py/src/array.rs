//! Raw bytes of numpy arrays, found through the array interface on the Rust side: the address
//! and length are read from the very object that is then kept referenced, never taken on trust
//! from the caller. (Not the buffer protocol: `PyBuffer` is outside the stable ABI before
//! Python 3.11, and this module is built once for CPython >= 3.10.)

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyDict;

static NDARRAY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

use crate::error::named;

/// `(address, byte length)` of a C-contiguous 1-d uint8 numpy array (the Python wrapper makes
/// one as a view of every tensor; torch tensors through `.view(torch.uint8).numpy()`).
///
/// # Errors
/// `InvalidSampleError` (or `InvalidReadError` when `writable`) if `obj` is not such an array,
/// or if it is read-only and `writable` is asked.
pub fn bytes_of(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<(usize, usize)> {
    let err = |msg: String| {
        named(
            obj.py(),
            if writable {
                "InvalidReadError"
            } else {
                "InvalidSampleError"
            },
            msg,
        )
    };
    // Exactly a numpy array (not a subclass or a look-alike that could report any address).
    let py = obj.py();
    let ndarray = NDARRAY.get_or_try_init(py, || {
        py.import("numpy")?.getattr("ndarray").map(Bound::unbind)
    })?;
    if !obj.get_type().is(ndarray.bind(py)) {
        return Err(err(format!(
            "expected a numpy.ndarray of bytes, got {}",
            obj.get_type()
                .name()
                .map_or_else(|_| "?".into(), |n| n.to_string())
        )));
    }
    let ai = obj
        .getattr("__array_interface__")
        .map_err(|_| err("expected a numpy array of bytes (no __array_interface__)".into()))?;
    let ai = ai.cast::<PyDict>()?;
    let item = |k: &str| {
        ai.get_item(k)?
            .ok_or_else(|| err(format!("__array_interface__ has no {k:?}")))
    };
    let typestr: String = item("typestr")?.extract()?;
    if typestr != "|u1" {
        return Err(err(format!(
            "expected uint8 bytes, got typestr {typestr:?}"
        )));
    }
    if !item("strides")?.is_none() {
        return Err(err("expected C-contiguous bytes".into()));
    }
    let shape: Vec<usize> = item("shape")?.extract()?;
    let len = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| err(format!("shape {shape:?} overflows")))?;
    let (ptr, readonly): (usize, bool) = item("data")?.extract()?;
    if writable && readonly {
        return Err(err("the output array is read-only".into()));
    }
    if ptr == 0 && len > 0 {
        return Err(err("the array has no data address".into()));
    }
    Ok((ptr, len))
}

/// Fails if any two non-empty ranges overlap (two `&mut` slices over the same bytes would be
/// undefined behaviour).
pub fn disjoint(py: Python<'_>, ranges: &[(usize, usize)]) -> PyResult<()> {
    let mut r: Vec<(usize, usize)> = ranges.iter().copied().filter(|&(_, l)| l > 0).collect();
    r.sort_unstable();
    for w in r.windows(2) {
        if w[0].0.saturating_add(w[0].1) > w[1].0 {
            return Err(named(
                py,
                "InvalidReadError",
                "two output arrays share memory; give each feature its own array".into(),
            ));
        }
    }
    Ok(())
}

static CUDA_BYTES: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// A contiguous CUDA tensor, as read from the tensor itself.
pub struct DeviceBytes {
    /// Device address of the first byte.
    pub ptr: u64,
    /// Bytes.
    pub len: u64,
    /// Device ordinal in this process.
    pub device: i32,
    /// The raw `CUstream` its producer's work is on (0: the legacy default stream).
    pub stream: u64,
}

/// For a `capture_arena._tensors.CudaBytes` (exactly that class): the tensor's address, length
/// and device, read from the CUDA tensor it holds (never taken from the caller), and the stream
/// `CudaBytes` read from torch when it was made (it cannot be set after); `None` for anything
/// else.
///
/// # Errors
/// `InvalidSampleError` if the tensor is not a contiguous CUDA tensor or its numbers do not fit.
pub fn device_of(obj: &Bound<'_, PyAny>) -> PyResult<Option<DeviceBytes>> {
    let py = obj.py();
    let cls = CUDA_BYTES.get_or_try_init(py, || {
        py.import("capture_arena._tensors")?
            .getattr("CudaBytes")
            .map(Bound::unbind)
    })?;
    if !obj.get_type().is(cls.bind(py)) {
        return Ok(None);
    }
    let err = |msg: String| named(py, "InvalidSampleError", msg);
    let t = obj.getattr("tensor")?;
    if !t.getattr("is_cuda")?.extract::<bool>()? {
        return Err(err("expected a CUDA tensor".into()));
    }
    if !t.call_method0("is_contiguous")?.extract::<bool>()? {
        return Err(err("expected a contiguous CUDA tensor".into()));
    }
    let ptr: u64 = t.call_method0("data_ptr")?.extract()?;
    let numel: u64 = t.call_method0("numel")?.extract()?;
    let item: u64 = t.call_method0("element_size")?.extract()?;
    let len = numel
        .checked_mul(item)
        .ok_or_else(|| err(format!("{numel} elements of {item} bytes overflow")))?;
    let device: i32 = t.call_method0("get_device")?.extract()?;
    if device < 0 {
        return Err(err(format!("tensor reports device {device}")));
    }
    let stream: u64 = obj.getattr("stream")?.extract()?;
    if ptr == 0 && len > 0 {
        return Err(err("the tensor has no data address".into()));
    }
    Ok(Some(DeviceBytes {
        ptr,
        len,
        device,
        stream,
    }))
}
