//! `capture_arena._capture_arena`: the compiled half of the Python package. Thin by design:
//! arguments are converted here (or, for tensors, in `capture_arena/_samples.py` and
//! `_tensors.py`) and everything else is the Rust core.
//!
//! Threads: the arena's writer thread never touches Python. Each sink owns one helper thread that
//! attaches to the interpreter to complete futures and to release the Python buffers the writer
//! has finished copying. Waits and copies run with the GIL released, but for two short holds
//! (`reserve.rs`: the first 2 ms of a reservation's wait; `rows.rs`: token ids read in bounded
//! runs).

mod array;
mod error;
mod exit;
mod held;
mod plan;
mod readbuf;
mod reserve;
mod results;
mod rows;
mod sink;
mod store;
mod value;

use pyo3::prelude::*;

/// True when the environment selects an arena placement (capture-arena's or a TransferEngine's)
/// rather than the Mooncake store: the Rust core's `arena_enabled()`.
#[pyfunction]
fn arena_enabled() -> bool {
    capture_arena::arena_enabled()
}

/// The placement this process's environment selects (`"arena"`, `"engine"` or `"store"`): the
/// one decision, made by the Rust core's `Config::placement()`.
#[pyfunction]
fn placement() -> PyResult<&'static str> {
    capture_arena::Config::from_env()
        .map(|c| c.placement().name())
        .map_err(error::to_py)
}

/// Bytes in a size setting (`32GiB`, `512MiB`, plain bytes), parsed by the core's one parser;
/// `ConfigError` naming `var` otherwise.
#[pyfunction]
fn _parse_bytes(py: Python<'_>, var: &str, value: &str) -> PyResult<u64> {
    capture_arena::config::parse_bytes(value).map_err(|reason| {
        error::named(
            py,
            "ConfigError",
            format!("invalid configuration {var}: {reason}"),
        )
    })
}

/// An on/off setting from the environment, spelled as the core reads it (`1`/`true`/`yes`/`on`,
/// `0`/`false`/`no`/`off`): `None` when unset or blank; `ConfigError` naming `var` otherwise.
#[pyfunction]
fn _env_flag(py: Python<'_>, var: &str) -> PyResult<Option<bool>> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => {
            capture_arena::config::parse_flag(&v)
                .map(Some)
                .map_err(|reason| {
                    error::named(
                        py,
                        "ConfigError",
                        format!("invalid configuration {var}: {reason}"),
                    )
                })
        }
        _ => Ok(None),
    }
}

/// Serves a producer's arena through NIXL until stdin closes: what
/// `python -m capture_arena._nixl_serve NAME LEN AGENT` runs (the core's
/// `memory::nixl::serve`). The GIL is released meanwhile.
#[cfg(feature = "nixl")]
#[pyfunction]
fn _nixl_serve(py: Python<'_>, name: String, len: u64, agent: String) -> PyResult<()> {
    py.detach(|| capture_arena::memory::nixl::serve(&name, len, &agent))
        .map_err(error::to_py)
}

/// `SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES` as the core reads and checks it.
#[pyfunction]
fn _max_pending_batches() -> PyResult<usize> {
    capture_arena::Config::from_env()
        .map(|c| c.max_pending_batches)
        .map_err(error::to_py)
}

/// Logs go to stderr from whichever thread emits them (the writer thread never takes the GIL, so
/// they cannot go through Python's `logging`). `CAPTURE_ARENA_LOG` (or `RUST_LOG`) sets the
/// filter; by default warnings, plus the per-batch timing line when
/// `SGLANG_SPEC_CAPTURE_TIMING=1`. Nothing is installed if the process already has a subscriber.
fn init_logging() {
    let filter = std::env::var("CAPTURE_ARENA_LOG")
        .or_else(|_| std::env::var("RUST_LOG"))
        .unwrap_or_else(|_| format!("warn,{}=info", capture_arena::writer::TIMING_TARGET));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

#[pymodule]
fn _capture_arena(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    m.add_class::<sink::PySink>()?;
    m.add_class::<store::PyStore>()?;
    m.add_class::<plan::PyBatch>()?;
    m.add_class::<readbuf::PyReadBuffer>()?;
    m.add_class::<reserve::PyReserving>()?;
    m.add_class::<rows::PyLanded>()?;
    m.add_class::<rows::PyDeviceRows>()?;
    m.add_function(wrap_pyfunction!(plan::_plan_batch, m)?)?;
    m.add_function(wrap_pyfunction!(store::_store_keys, m)?)?;
    m.add_function(wrap_pyfunction!(store::_send_frees, m)?)?;
    m.add_function(wrap_pyfunction!(store::_is_valid_token, m)?)?;
    m.add_function(wrap_pyfunction!(store::_result_keys, m)?)?;
    m.add_function(wrap_pyfunction!(store::_result_stamped_keys, m)?)?;
    m.add_function(wrap_pyfunction!(store::_memory_limit, m)?)?;
    m.add_function(wrap_pyfunction!(store::_stats_query, m)?)?;
    m.add_function(wrap_pyfunction!(arena_enabled, m)?)?;
    m.add_function(wrap_pyfunction!(placement, m)?)?;
    m.add_function(wrap_pyfunction!(_parse_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(_env_flag, m)?)?;
    m.add_function(wrap_pyfunction!(_max_pending_batches, m)?)?;
    m.add_function(wrap_pyfunction!(sink::_bench_rust_put, m)?)?;
    m.add_function(wrap_pyfunction!(exit::_exiting, m)?)?;
    m.add_function(wrap_pyfunction!(exit::_forked_child, m)?)?;
    #[cfg(feature = "nixl")]
    m.add_function(wrap_pyfunction!(_nixl_serve, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // One value for the CLI and the package: both set it before NIXL loads.
    m.add("UCX_TCP_SEG_SIZE", capture_arena::config::UCX_TCP_SEG_SIZE)?;
    // The optional transports this build reads and serves.
    let mut features = vec!["cuda"];
    if cfg!(feature = "nixl") {
        features.push("nixl");
    }
    m.add("FEATURES", features)?;
    // Benchmarks refuse to time a debug build (its Rust runs several times slower).
    m.add(
        "_BUILD",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
    )?;
    Ok(())
}
