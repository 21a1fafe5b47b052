//! `_ArenaSink`: the sink an inference server's capture hook calls (wrapped by
//! `capture_arena.ArenaSink`, which turns tensors into byte buffers first).

use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use capture_arena::config::parse_bytes;
use capture_arena::sample::{batch_results, Captured, SampleResult, SampleSpec};
use capture_arena::writer::Outcome;
use capture_arena::{Config, Dtype, Error, Sample, Sink, Tensor, TensorData};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use pythonize::{depythonize, pythonize};

use crate::error::{to_py, IntoPy};

/// Work for the sink's helper thread, the only one of its threads that attaches to Python.
enum Msg {
    /// The owner of bytes the writer has finished copying.
    Release(Py<PyAny>),
    /// A batch is done: complete its future.
    Done {
        future: Py<PyAny>,
        ids: Vec<String>,
        outcome: Outcome,
    },
}

/// Bytes of a Python array lent to the writer: `owner` (a C-contiguous numpy array the Python
/// wrapper made) is kept referenced, so its memory is neither freed nor moved, until the writer
/// drops the tensor after copying it; then `owner` goes to the helper thread, so the writer never
/// needs the GIL.
///
/// Not the buffer protocol: `PyBuffer` is outside the stable ABI before Python 3.11, and this
/// module is built once for CPython >= 3.10.
struct Lent {
    owner: Option<Py<PyAny>>,
    ptr: usize,
    len: usize,
    tx: Sender<Msg>,
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: ptr/len are the data address and byte size numpy reported for the C-contiguous
        // array in `self.owner`, which stays referenced (so allocated and unmoved: numpy refuses
        // to resize a referenced array) until `self` is dropped. Callers promise (ArenaSink docs)
        // not to write the tensor until its batch completes.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if let Some(o) = self.owner.take() {
            if let Err(mpsc::SendError(Msg::Release(o))) = self.tx.send(Msg::Release(o)) {
                // The helper is gone (interpreter shutting down): leak the reference rather
                // than touch Python from the writer thread.
                std::mem::forget(o);
            }
        }
    }
}

/// `(owner, address, nbytes, shape, dtype name)` (from `capture_arena._tensors.host_bytes`) ->
/// a captured tensor.
fn captured(t: &Bound<'_, PyAny>, tx: &Sender<Msg>) -> PyResult<Captured> {
    let (owner, ptr, len, shape, dtype): (Bound<'_, PyAny>, usize, usize, Vec<u64>, String) =
        t.extract()?;
    let dtype = Dtype::from_name(&dtype).ok_or_else(|| {
        to_py(Error::InvalidTensor {
            name: "?".into(),
            reason: format!(
                "unsupported dtype {dtype:?} (supported: {})",
                Dtype::ALL.map(Dtype::name).join(", ")
            ),
        })
    })?;
    if ptr == 0 && len > 0 {
        return Err(PyValueError::new_err("tensor bytes have a null address"));
    }
    let lent = Lent {
        owner: Some(owner.unbind()),
        ptr,
        len,
        tx: tx.clone(),
    };
    Ok(Captured {
        shape,
        dtype,
        data: TensorData::host(lent),
    })
}

/// One `(spec, aux, last_hidden, passthrough_bytes)` tuple from the Python wrapper.
fn sample(
    item: &Bound<'_, PyAny>,
    tx: &Sender<Msg>,
    aux_ids: &Option<Vec<i64>>,
) -> PyResult<Sample> {
    let t = item.cast::<PyTuple>()?;
    let spec: SampleSpec = depythonize(&t.get_item(0)?)
        .map_err(|e| PyValueError::new_err(format!("invalid sample spec: {e}")))?;
    let opt = |i: usize| -> PyResult<Option<Captured>> {
        let v = t.get_item(i)?;
        if v.is_none() {
            Ok(None)
        } else {
            captured(&v, tx).map(Some)
        }
    };
    let (aux, last) = (opt(1)?, opt(2)?);
    let mut parts = HashMap::new();
    let extra = t.get_item(3)?;
    if !extra.is_none() {
        for (k, v) in extra.extract::<HashMap<String, Bound<'_, PyAny>>>()? {
            parts.insert(k, captured(&v, tx)?);
        }
    }
    Sample::from_spec_parts(&spec, aux, last, aux_ids.clone(), parts).py_err()
}

fn results_to_py<'py>(py: Python<'py>, results: &[SampleResult]) -> PyResult<Bound<'py, PyAny>> {
    pythonize(py, results).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

fn outcome_results(ids: &[String], outcome: Outcome) -> Vec<SampleResult> {
    match outcome {
        Ok(p) => batch_results(ids, Ok(p)),
        Err(e) => batch_results(ids, Err(&e)),
    }
}

fn helper(rx: Receiver<Msg>) {
    while let Ok(first) = rx.recv() {
        Python::attach(|py| {
            let mut next = Some(first);
            while let Some(msg) = next.take() {
                match msg {
                    Msg::Release(b) => drop(b),
                    Msg::Done {
                        future,
                        ids,
                        outcome,
                    } => {
                        let fut = future.bind(py);
                        let results = outcome_results(&ids, outcome);
                        let r = match results_to_py(py, &results) {
                            Ok(list) => fut.call_method1("set_result", (list,)),
                            Err(e) => fut.call_method1("set_exception", (e.value(py),)),
                        };
                        // A future the caller cancelled refuses a result: nothing to do.
                        drop(r);
                    }
                }
                next = rx.try_recv().ok();
            }
        });
    }
}

/// The compiled sink. Use `capture_arena.ArenaSink`.
#[pyclass(name = "_ArenaSink", module = "capture_arena._capture_arena", subclass)]
pub struct PySink {
    sink: Option<Sink>,
    tx: Sender<Msg>,
    pid: u32,
}

fn opt_bytes(v: Option<Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
    let Some(v) = v else { return Ok(None) };
    if let Ok(n) = v.extract::<u64>() {
        return Ok(Some(n));
    }
    let s: String = v.extract()?;
    parse_bytes(&s).map(Some).map_err(|reason| {
        to_py(Error::Config {
            var: "arena_bytes",
            reason,
        })
    })
}

impl PySink {
    fn sink(&self) -> PyResult<&Sink> {
        if self.pid != std::process::id() {
            return Err(PyRuntimeError::new_err(format!(
                "this ArenaSink belongs to process {} (its writer thread did not survive the \
                 fork); create a new sink in process {}",
                self.pid,
                std::process::id()
            )));
        }
        self.sink
            .as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("the ArenaSink is closed"))
    }

    fn samples(&self, samples: &Bound<'_, PyAny>) -> PyResult<Vec<Sample>> {
        let aux_ids = self.sink()?.config().aux_layer_ids.clone();
        samples
            .try_iter()?
            .map(|item| sample(&item?, &self.tx, &aux_ids))
            .collect()
    }
}

#[pymethods]
impl PySink {
    #[new]
    #[pyo3(signature = (*, arena_bytes=None, control_host=None, control_port=None, alignment=None,
                        wait_s=None, max_pending_batches=None, aux_layer_ids=None, timing=None,
                        protocol=None, gpu_put=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        arena_bytes: Option<Bound<'_, PyAny>>,
        control_host: Option<String>,
        control_port: Option<u16>,
        alignment: Option<u64>,
        wait_s: Option<f64>,
        max_pending_batches: Option<usize>,
        aux_layer_ids: Option<Vec<i64>>,
        timing: Option<bool>,
        protocol: Option<String>,
        gpu_put: Option<bool>,
    ) -> PyResult<Self> {
        let mut c = Config::from_env().py_err()?;
        if let Some(b) = opt_bytes(arena_bytes)? {
            c.arena_bytes = Some(b);
        }
        if let Some(h) = control_host {
            c.control_host = h;
        }
        if let Some(p) = control_port {
            c.control_port = p;
        }
        if let Some(a) = alignment {
            c.alignment = a;
        }
        if let Some(w) = wait_s {
            c.arena_wait = Duration::try_from_secs_f64(w).map_err(|_| {
                to_py(Error::Config {
                    var: "wait_s",
                    reason: format!("{w} is not a number of seconds >= 0"),
                })
            })?;
        }
        if let Some(m) = max_pending_batches {
            c.max_pending_batches = m;
        }
        if aux_layer_ids.is_some() {
            c.aux_layer_ids = aux_layer_ids;
        }
        if let Some(t) = timing {
            c.timing = t;
        }
        if protocol.is_some() {
            c.protocol = protocol;
        }
        if gpu_put.is_some() {
            c.gpu_put = gpu_put;
        }
        let sink = Sink::new(c).py_err()?;
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("capture-arena-py".into())
            .spawn(move || helper(rx))
            .map_err(|e| {
                PyRuntimeError::new_err(format!("spawning the sink's helper thread: {e}"))
            })?;
        Ok(PySink {
            sink: Some(sink),
            tx,
            pid: std::process::id(),
        })
    }

    /// Queues a batch; `future.set_result(list_of_results)` is called when it is done. Blocks
    /// (GIL released) while the writer's queue is full, or raises QueueFullError if
    /// `block=False`.
    #[pyo3(signature = (samples, future, block=true))]
    fn _submit(
        &self,
        py: Python<'_>,
        samples: &Bound<'_, PyAny>,
        future: Py<PyAny>,
        block: bool,
    ) -> PyResult<()> {
        let batch = self.samples(samples)?;
        let ids: Vec<String> = batch.iter().map(|s| s.sample_id().to_owned()).collect();
        let sink = self.sink()?;
        let tx = self.tx.clone();
        let done = move |outcome: Outcome| {
            let _ = tx.send(Msg::Done {
                future,
                ids,
                outcome,
            });
        };
        py.detach(|| {
            if block {
                sink.submit_with(batch, done)
            } else {
                sink.try_submit_with(batch, done)
            }
        })
        .py_err()
    }

    /// Queues a batch and waits for its results (GIL released throughout).
    fn _put<'py>(
        &self,
        py: Python<'py>,
        samples: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let batch = self.samples(samples)?;
        let ids: Vec<String> = batch.iter().map(|s| s.sample_id().to_owned()).collect();
        let sink = self.sink()?;
        let outcome = py.detach(|| sink.submit(batch).map(|h| h.wait()));
        let results = outcome_results(&ids, outcome.py_err()?);
        results_to_py(py, &results)
    }

    /// The writer's counters as a dict (all zero before the first capture).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        pythonize(py, &self.sink()?.stats()).map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// True once the first capture has created the arena.
    #[getter]
    fn started(&self) -> PyResult<bool> {
        Ok(self.sink()?.started().is_some())
    }

    /// The arena's session (what readers open), or None before the first capture.
    #[getter]
    fn session(&self) -> PyResult<Option<String>> {
        Ok(self
            .sink()?
            .started()
            .map(|w| w.arena_ref().session.clone()))
    }

    /// The control endpoint `host:port`, or None before the first capture.
    #[getter]
    fn control(&self) -> PyResult<Option<String>> {
        Ok(self
            .sink()?
            .started()
            .map(|w| w.arena_ref().control.clone()))
    }

    /// The arena size in bytes (`SGLANG_SPEC_CAPTURE_ARENA_BYTES` / `arena_bytes`), or None.
    #[getter]
    fn arena_bytes(&self) -> PyResult<Option<u64>> {
        Ok(self.sink()?.config().arena_bytes)
    }

    /// True when tensors are published from the device (always under `nvlink`).
    #[getter]
    fn device_publication(&self) -> PyResult<bool> {
        Ok(self.sink()?.config().device_publication())
    }

    /// Stops the writer and removes the arena. Idempotent.
    fn close(&mut self, py: Python<'_>) {
        if self.pid != std::process::id() {
            return;
        }
        if let Some(s) = self.sink.take() {
            py.detach(move || drop(s));
        }
    }
}

impl Drop for PySink {
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            // A forked child: the writer thread and the arena are the parent's. Running their
            // destructors here would join a thread that does not exist and unlink the parent's
            // shared memory.
            if let Some(s) = self.sink.take() {
                std::mem::forget(s);
            }
        }
    }
}

/// The same batch through the Rust API, for the Python-overhead benchmark: `n_samples` samples
/// of `n_tensors` bf16 tensors of `tensor_bytes` each, published `reps` times with replace.
/// Returns seconds per batch (submit to results).
#[pyfunction]
#[pyo3(signature = (n_samples, n_tensors, tensor_bytes, reps, arena_bytes))]
pub fn _bench_rust_put(
    py: Python<'_>,
    n_samples: usize,
    n_tensors: usize,
    tensor_bytes: usize,
    reps: usize,
    arena_bytes: u64,
) -> PyResult<Vec<f64>> {
    #[derive(Clone)]
    struct Shared(Arc<Vec<u8>>);
    impl AsRef<[u8]> for Shared {
        fn as_ref(&self) -> &[u8] {
            &self.0
        }
    }
    py.detach(|| -> capture_arena::Result<Vec<f64>> {
        let sink = Sink::new(Config {
            arena_bytes: Some(arena_bytes),
            ..Config::default()
        })?;
        let bufs: Vec<Shared> = (0..n_samples * n_tensors)
            .map(|i| Shared(Arc::new(vec![i as u8; tensor_bytes])))
            .collect();
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps {
            let t0 = Instant::now();
            let mut batch = Vec::with_capacity(n_samples);
            for i in 0..n_samples {
                let mut s = Sample::new("bench", &format!("s{i}"), 1)?.with_replace(true);
                for j in 0..n_tensors {
                    let data = TensorData::host(bufs[i * n_tensors + j].clone());
                    let shape = vec![1, (tensor_bytes / 2) as u64];
                    s.push(Tensor::new(format!("t{j}"), shape, Dtype::Bfloat16, data)?)?;
                }
                batch.push(s);
            }
            sink.submit(batch)?.wait()?;
            times.push(t0.elapsed().as_secs_f64());
        }
        Ok(times)
    })
    .py_err()
}
