//! `ReadBuffer`: host memory that NIXL registers once, for trainers that read large samples
//! sample after sample (the Rust core's `capture_arena::ReadBuffer`).

use capture_arena::ReadBuffer;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::error::IntoPy;

/// `nbytes` zeroed, page-aligned bytes. `numpy.asarray(buf)` is a writable uint8 view of them
/// (the array keeps the buffer alive); any slice of it passed as `out=` to
/// `ArenaFeatureStore.get` is read into without registering memory again. The memory is freed
/// (and its registrations released) when the buffer and every view of it are gone.
#[pyclass(name = "ReadBuffer", module = "capture_arena._capture_arena", frozen)]
pub struct PyReadBuffer {
    buf: ReadBuffer,
}

#[pymethods]
impl PyReadBuffer {
    #[new]
    fn new(nbytes: usize) -> PyResult<Self> {
        Ok(PyReadBuffer {
            buf: ReadBuffer::new(nbytes).py_err()?,
        })
    }

    /// Bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.buf.len()
    }

    /// Registrations held now (1 once a NIXL read has gone into it).
    #[getter]
    fn registrations(&self) -> usize {
        self.buf.registrations()
    }

    /// numpy's array interface: a writable 1-D uint8 view of the whole buffer.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("shape", (self.buf.len(),))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.buf.as_ptr() as usize, false))?;
        d.set_item("version", 3)?;
        Ok(d)
    }

    fn __len__(&self) -> usize {
        self.buf.len()
    }

    fn __repr__(&self) -> String {
        format!("ReadBuffer(nbytes={})", self.buf.len())
    }
}
