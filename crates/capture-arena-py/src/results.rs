//! Results as Python sees them.

use capture_arena::sample::{batch_results, SampleResult};
use capture_arena::writer::Outcome;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pythonize::pythonize;

/// The results as a list of dicts.
pub(crate) fn results_to_py<'py>(
    py: Python<'py>,
    results: &[SampleResult],
) -> PyResult<Bound<'py, PyAny>> {
    pythonize(py, results).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// One result per sample of a batch with this outcome.
pub(crate) fn outcome_results(ids: &[String], outcome: Outcome) -> Vec<SampleResult> {
    match outcome {
        Ok(p) => batch_results(ids, Ok(p)),
        Err(e) => batch_results(ids, Err(&e)),
    }
}
