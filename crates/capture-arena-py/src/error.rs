//! The one place core errors become Python exceptions. The classes live in
//! `capture_arena/errors.py` (so they can subclass both `CaptureArenaError` and the standard
//! exception the contract names); they are looked up once and cached.

use capture_arena::Error;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

fn class<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyType>> {
    let m = ERRORS.get_or_try_init(py, || py.import("capture_arena.errors").map(Bound::unbind))?;
    Ok(m.bind(py).getattr(name)?.cast_into::<PyType>()?)
}

/// Converts a core error into the matching `capture_arena.errors` exception.
pub fn to_py(e: Error) -> PyErr {
    let name = match &e {
        Error::Config { .. } => "ConfigError",
        Error::InvalidKey { .. } | Error::InvalidSample { .. } | Error::InvalidTensor { .. } => {
            "InvalidSampleError"
        }
        Error::KeyExists { .. } => "KeyExistsError",
        Error::BatchTooLarge { .. } | Error::ArenaFull { .. } => "ArenaFullError",
        Error::QueueFull { .. } => "QueueFullError",
        Error::WriterStopped => "WriterStoppedError",
        Error::InvalidSession { .. } => "InvalidSessionError",
        Error::StaleSession { .. } => "StaleSessionError",
        Error::OutOfRange { .. } | Error::InvalidRead { .. } => "InvalidReadError",
        Error::UnknownFeature { .. } => "UnknownFeatureError",
        Error::Released { .. } | Error::Changed { found: 0, .. } => "ReleasedError",
        Error::Changed { .. } => "ObjectChangedError",
        Error::NotReady { .. } => "NotReadyError",
        Error::WriteFailed { .. } => "WriteFailedError",
        Error::FreeNotSent { .. } => "FreeNotSentError",
        Error::Unauthorized { .. } => "FreeRefusedError",
        Error::Timeout { .. } => "PublishTimeoutError",
        Error::Io { .. } => "ArenaOSError",
        Error::Device { .. } => "DeviceError",
        Error::Transport { .. } => "TransportError",
        _ => "CaptureArenaError",
    };
    Python::attach(|py| named(py, name, e.to_string()))
}

/// An exception of `capture_arena.errors` by class name.
pub fn named(py: Python<'_>, name: &str, msg: String) -> PyErr {
    match class(py, name) {
        Ok(cls) => PyErr::from_type(cls, msg),
        Err(lookup) => PyRuntimeError::new_err(format!("{msg} (and {name} is missing: {lookup})")),
    }
}

/// `Result` with the error converted.
pub trait IntoPy<T> {
    /// Converts the error.
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for Result<T, Error> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
