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
