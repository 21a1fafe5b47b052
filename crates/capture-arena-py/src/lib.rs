//! `capture_arena._capture_arena`: the compiled half of the Python package. Thin by design:
//! arguments are converted here (or, for tensors, in `capture_arena/__init__.py`) and everything
//! else is the Rust core.
//!
//! Threads: the arena's writer thread never touches Python. Each sink owns one helper thread that
//! attaches to the interpreter to complete futures and to release the Python buffers the writer
//! has finished copying. Every wait and every copy runs with the GIL released.

mod array;
mod error;
mod sink;
mod store;

use pyo3::prelude::*;

/// True when `MOONCAKE_PROTOCOL` selects the arena placement (`nvlink`): the same decision as
/// the Rust core's `arena_enabled()`.
#[pyfunction]
fn arena_enabled() -> bool {
    capture_arena::arena_enabled()
}

#[pymodule]
fn _capture_arena(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<sink::PySink>()?;
    m.add_class::<store::PyStore>()?;
    m.add_function(wrap_pyfunction!(arena_enabled, m)?)?;
    m.add_function(wrap_pyfunction!(sink::_bench_rust_put, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
