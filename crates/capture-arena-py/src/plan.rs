//! `_plan_batch`: a batch validated and built exactly as the arena path builds it, handed back to
//! Python for another publisher (the Mooncake store placement): keys, shapes, dtypes and the
//! address of every tensor's host bytes, which stay valid while the `_Batch` lives.

use std::collections::BTreeMap;
use std::sync::Mutex;

use std::time::{Duration, Instant};

use capture_arena::{Error, Sample, TensorData};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pythonize::pythonize;

use crate::error::to_py;

/// A planned batch. See the module docs.
#[pyclass(name = "_Batch", module = "capture_arena._capture_arena", frozen)]
pub struct PyBatch {
    samples: Mutex<Vec<Sample>>,
}

/// One object: `(sample index, name, key, shape, dtype, address, byte length, device)`; the
/// device is -1 for host memory, else the GPU whose memory the address is in.
type Planned = (usize, String, String, Vec<u64>, String, u64, u64, i32);

#[pymethods]
impl PyBatch {
    /// Every object of the batch, in sample order.
    fn tensors(&self) -> PyResult<Vec<Planned>> {
        let samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::new();
        for (i, s) in samples.iter().enumerate() {
            for (_, t) in s.tensors() {
                let key = store_key(s, t.name())?;
                let (ptr, len, device) = match t.data() {
                    TensorData::Device(d) => (d.ptr(), t.data().len(), d.device()),
                    data => data
                        .host_ptr()
                        .map(|(p, n)| (p as u64, n as u64, -1))
                        .ok_or_else(|| {
                            to_py(Error::InvalidTensor {
                                name: t.name().to_owned(),
                                reason: "this memory cannot be published into the Mooncake store"
                                    .into(),
                            })
                        })?,
                };
                out.push((
                    i,
                    t.name().to_owned(),
                    key,
                    t.shape().to_vec(),
                    t.dtype().name().to_owned(),
                    ptr,
                    len,
                    device,
                ));
            }
        }
        Ok(out)
    }

    /// The store placement's results: `{"sample_id", "store_id", "gen", "aux_layer_ids",
    /// "features": {name: {"shape", "dtype"}}}` (no arena, no address), one per sample.
    fn results<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        let results: Vec<serde_json::Value> = samples
            .iter()
            .map(|s| {
                let features: BTreeMap<&str, serde_json::Value> = s
                    .tensors()
                    .map(|(_, t)| {
                        (
                            t.name(),
                            serde_json::json!({"shape": t.shape(), "dtype": t.dtype().name()}),
                        )
                    })
                    .collect();
                serde_json::json!({
                    "sample_id": s.sample_id(),
                    "store_id": s.store_id(),
                    "gen": s.gen(),
                    "aux_layer_ids": s.aux_layer_ids(),
                    "features": features,
                })
            })
            .collect();
        pythonize(py, &results).map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// Waits (GIL released) until the device tensors' writers have finished: the work enqueued
    /// on each tensor's stream before it was handed over, at most `timeout_s` in all.
    #[pyo3(signature = (timeout_s))]
    fn wait_ready(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let timeout = Duration::try_from_secs_f64(timeout_s.max(0.0)).unwrap_or(Duration::MAX);
        let deadline = capture_arena::writer::deadline_in(timeout);
        let samples = &self.samples;
        crate::exit::detach(py, || {
            let samples = samples.lock().unwrap_or_else(|p| p.into_inner());
            for s in samples.iter() {
                for (_, t) in s.tensors() {
                    if let TensorData::Device(d) = t.data() {
                        d.wait_ready(deadline.saturating_duration_since(Instant::now()))?;
                    }
                }
            }
            Ok(())
        })
        .map_err(to_py)
    }

    /// `(sample_id, replace, keys)` per sample.
    fn samples(&self) -> PyResult<Vec<(String, bool, Vec<String>)>> {
        let samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        samples
            .iter()
            .map(|s| {
                let keys = s
                    .tensors()
                    .map(|(_, t)| store_key(s, t.name()))
                    .collect::<PyResult<Vec<String>>>()?;
                Ok((s.sample_id().to_owned(), s.replace(), keys))
            })
            .collect()
    }
}

/// The store's key of one of `s`'s tensors: Mooncake's raw layout (`capture_arena::key::store_key`).
fn store_key(s: &Sample, name: &str) -> PyResult<String> {
    capture_arena::key::store_key(s.store_id(), s.sample_id(), s.gen(), name).map_err(to_py)
}

/// Validates and builds each sample of a batch of converted items (as `ArenaSink` does) without
/// publishing it: `(batch, refused)`, where `refused` holds `(position, {"sample_id", "error"})`
/// for each item that a publication would refuse before writing (and each item that was a row
/// already); the batch holds the others. Duplicates are judged by the store's keys.
#[pyfunction]
#[pyo3(signature = (samples, aux_layer_ids=None))]
pub fn _plan_batch(
    samples: &Bound<'_, PyAny>,
    aux_layer_ids: Option<Vec<i64>>,
) -> PyResult<(PyBatch, Vec<crate::sink::Refused>)> {
    let built = crate::sink::build_batch(samples, None, &aux_layer_ids, |s| {
        s.tensors().map(|(_, t)| store_key(s, t.name())).collect()
    })?;
    Ok((
        PyBatch {
            samples: Mutex::new(built.samples),
        },
        built.refused,
    ))
}
