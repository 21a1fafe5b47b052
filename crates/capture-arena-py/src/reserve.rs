//! Reservations: objects published before their bytes, which the caller writes itself and then
//! finishes (`_finish_writes`). vLLM's connector reserves a step's requests when the step begins
//! (`_begin_reserving`) and collects them after the forward (`_Reserving.wait`), so that
//! vLLM's thread never waits for the writer; `_reserve_each` does both in one call.

use std::time::{Duration, Instant};

use capture_arena::sample::SampleResult;
use capture_arena::writer::{deadline_in, Outcome};
use capture_arena::{BatchHandle, Dtype, Error, Sample, Sink, Tensor, TensorData};
use pyo3::exceptions::PyRuntimeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};

use crate::error::{named, to_py};
use crate::held::Held;
use crate::results::{outcome_results, results_to_py};

/// How long a caller collecting reservations (no bytes to copy) waits for the writer with the
/// GIL held: a step's reservations take well under it. Released, the GIL can take Python's
/// whole switch interval (5 ms) to come back to vLLM's thread while another thread runs Python.
pub(crate) const GIL_HELD_WAIT: Duration = Duration::from_millis(2);

/// What `_reserve_each` takes for each sample: its ids and each feature's shape and
/// dtype; the bytes are the caller's to write.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ReserveSpec {
    store_id: String,
    sample_id: String,
    #[serde(default = "first_gen")]
    gen: u64,
    #[serde(default)]
    replace: bool,
    features: std::collections::BTreeMap<String, ReserveFeature>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ReserveFeature {
    shape: Vec<u64>,
    dtype: String,
}

fn first_gen() -> u64 {
    1
}

/// A sample of reserved tensors ([`TensorData::Reserved`]) from a [`ReserveSpec`].
fn reserved_sample(item: &Bound<'_, PyAny>, aux_ids: &Option<Vec<i64>>) -> PyResult<Sample> {
    let py = item.py();
    let spec: ReserveSpec = crate::value::from_py(item).map_err(|e| {
        named(
            py,
            "InvalidSampleError",
            format!(
                "a reservation is {{\"store_id\", \"sample_id\", \"gen\", \"replace\", \
                 \"features\": {{name: {{\"shape\", \"dtype\"}}}}}}: {e}"
            ),
        )
    })?;
    if spec.features.is_empty() || spec.features.len() > capture_arena::sample::MAX_FEATURES {
        return Err(named(
            py,
            "InvalidSampleError",
            format!(
                "sample {:?}: a reservation has 1 to {} features, not {}",
                spec.sample_id,
                capture_arena::sample::MAX_FEATURES,
                spec.features.len()
            ),
        ));
    }
    let mut s = Sample::new(&spec.store_id, &spec.sample_id, spec.gen)
        .map_err(to_py)?
        .with_replace(spec.replace)
        .with_aux_layer_ids(aux_ids.clone());
    for (name, f) in spec.features {
        let dtype = Dtype::from_name(&f.dtype).ok_or_else(|| {
            named(
                py,
                "InvalidSampleError",
                format!("feature {name:?}: unknown dtype {:?}", f.dtype),
            )
        })?;
        let len = f
            .shape
            .iter()
            .try_fold(dtype.item_size(), |a, &d| a.checked_mul(d))
            .ok_or_else(|| {
                named(
                    py,
                    "InvalidSampleError",
                    format!("feature {name:?}: shape {:?} overflows", f.shape),
                )
            })?;
        s.push(Tensor::new(name, f.shape, dtype, TensorData::Reserved(len)).map_err(to_py)?)
            .map_err(to_py)?;
    }
    Ok(s)
}

/// A spec refused before the writer: its position, its `sample_id` (any object) and why.
type RefusedSpec = (usize, Py<PyAny>, String);

/// Reservations handed to the writer (`_ArenaSink._begin_reserving`), collected once with
/// `wait`. Dropped uncollected, its objects are failed and freed as they are placed: nothing
/// stays reserved that nobody will write.
#[pyclass(name = "_Reserving", module = "capture_arena._capture_arena")]
pub(crate) struct PyReserving {
    state: std::sync::Mutex<Option<Reserving>>,
}

struct Reserving {
    sink: Held,
    /// The queued samples' ids, in order.
    ids: Vec<String>,
    /// Their handles, or why none was queued.
    queued: capture_arena::Result<Vec<BatchHandle>>,
    refused: Vec<RefusedSpec>,
    deadline: Instant,
}

impl PyReserving {
    /// Reads `specs` and queues each valid one as a batch of its own, waiting for space until
    /// `within` from now; waits (GIL released) only for room in the writer's queue.
    pub(crate) fn begin(
        py: Python<'_>,
        sink: Held,
        specs: &Bound<'_, PyAny>,
        within: Duration,
    ) -> PyResult<Self> {
        let aux_ids = sink.config().aux_layer_ids.clone();
        let mut samples = Vec::new();
        let mut refused = Vec::new();
        for (i, item) in specs.try_iter()?.enumerate() {
            let item = item?;
            match reserved_sample(&item, &aux_ids) {
                Ok(s) => samples.push(s),
                Err(e) => {
                    let id = item
                        .get_item("sample_id")
                        .map(Bound::unbind)
                        .unwrap_or_else(|_| py.None());
                    refused.push((i, id, e.value(py).to_string()));
                }
            }
        }
        Self::queue(py, sink, samples, refused, within)
    }

    /// [`PyReserving::begin`] for requests of rows (`_begin_reserving_rows`): each `(sample_id,
    /// gen, n)` is `hidden_states` `[1, n, width]` of `dtype` and `token_ids` `[1, n]` int64,
    /// built here with no spec to read.
    pub(crate) fn begin_rows(
        py: Python<'_>,
        sink: Held,
        rows: &RowsSpec,
        requests: Vec<(String, u64, u64)>,
        within: Duration,
    ) -> PyResult<Self> {
        let aux_ids = sink.config().aux_layer_ids.clone();
        let mut samples = Vec::with_capacity(requests.len());
        let mut refused = Vec::new();
        for (i, (sample_id, gen, n)) in requests.into_iter().enumerate() {
            match rows.sample(&sample_id, gen, n, &aux_ids) {
                Ok(s) => samples.push(s),
                Err(e) => refused.push((
                    i,
                    pyo3::types::PyString::new(py, &sample_id)
                        .into_any()
                        .unbind(),
                    e.to_string(),
                )),
            }
        }
        Self::queue(py, sink, samples, refused, within)
    }

    fn queue(
        py: Python<'_>,
        sink: Held,
        samples: Vec<Sample>,
        refused: Vec<RefusedSpec>,
        within: Duration,
    ) -> PyResult<Self> {
        let ids = samples.iter().map(|s| s.sample_id().to_owned()).collect();
        let deadline = deadline_in(within);
        let queued = if samples.is_empty() {
            Ok(Vec::new())
        } else {
            queue_each(py, &sink, samples, deadline)
        };
        Ok(Self {
            state: std::sync::Mutex::new(Some(Reserving {
                sink,
                ids,
                queued,
                refused,
                deadline,
            })),
        })
    }
}

/// The requests of `_begin_reserving_rows`: their `store_id`, and the dtype and width of their
/// rows.
pub(crate) struct RowsSpec {
    pub store_id: String,
    pub dtype: Dtype,
    pub width: u64,
}

impl RowsSpec {
    /// A request of `n` rows as a sample of two reserved tensors.
    fn sample(
        &self,
        sample_id: &str,
        gen: u64,
        n: u64,
        aux_ids: &Option<Vec<i64>>,
    ) -> capture_arena::Result<Sample> {
        let overflow = || Error::InvalidSample {
            sample_id: sample_id.to_owned(),
            reason: format!("{n} rows of {} elements overflow", self.width),
        };
        let rows = n
            .checked_mul(self.width)
            .and_then(|e| e.checked_mul(self.dtype.item_size()))
            .ok_or_else(overflow)?;
        let ids = n.checked_mul(8).ok_or_else(overflow)?;
        let mut s =
            Sample::new(&self.store_id, sample_id, gen)?.with_aux_layer_ids(aux_ids.clone());
        s.push(Tensor::new(
            "hidden_states",
            vec![1, n, self.width],
            self.dtype,
            TensorData::Reserved(rows),
        )?)?;
        s.push(Tensor::new(
            "token_ids",
            vec![1, n],
            Dtype::Int64,
            TensorData::Reserved(ids),
        )?)?;
        Ok(s)
    }
}

#[pymethods]
impl PyReserving {
    /// Each spec's reservation, in order, waiting for the writer (with the GIL held for at most
    /// `hold_gil_s`, without it beyond) until the space is there or the deadline passed:
    /// `(row, writable)` (`writable`: `{name: address}` where this process writes each object),
    /// or with `keys` `(keys, writable, json)` (the objects' keys, None for a row with an error,
    /// `writable` as `{name: (address, stamp)}`, and the row's JSON text; with `dicts` too, the
    /// row as a dict instead of its text). Once only.
    #[pyo3(signature = (keys = false, hold_gil_s = GIL_HELD_WAIT.as_secs_f64(), dicts = false))]
    pub(crate) fn wait<'py>(
        &self,
        py: Python<'py>,
        keys: bool,
        hold_gil_s: f64,
        dicts: bool,
    ) -> PyResult<Bound<'py, PyList>> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.as_ref().is_some_and(|r| r.sink.inherited()) {
            // A forked child: the writer that would answer is the parent's.
            return Err(named(
                py,
                "WriterStoppedError",
                "these reservations belong to the process that forked this one (its writer \
                 thread did not survive the fork); reserve in this process with a sink of its own"
                    .into(),
            ));
        }
        let taken = state.take();
        drop(state);
        let r = taken
            .ok_or_else(|| PyRuntimeError::new_err("these reservations were collected already"))?;
        let hold = Duration::try_from_secs_f64(hold_gil_s.max(0.0)).unwrap_or(GIL_HELD_WAIT);
        let form = match (keys, dicts) {
            (false, _) => Form::Rows,
            (true, false) => Form::KeysJson,
            (true, true) => Form::KeysDicts,
        };
        r.collect(py, form, hold)
    }
}

/// How [`PyReserving::wait`] hands each reservation back.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Form {
    /// `(row, writable)`.
    Rows,
    /// `(keys, writable, json)`.
    KeysJson,
    /// `(keys, writable, row)`: what a caller in this process keeps, without a JSON text to
    /// parse (the row built here costs about a third of `json.loads` of its text).
    KeysDicts,
}

impl Drop for PyReserving {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = state.take() {
            if r.sink.inherited() {
                // A forked child: the handles wait on the parent's writer, which is not here.
                std::mem::forget(r);
                return;
            }
            r.abandon();
        }
    }
}

impl Reserving {
    fn collect<'py>(
        self,
        py: Python<'py>,
        form: Form,
        hold: Duration,
    ) -> PyResult<Bound<'py, PyList>> {
        let Reserving {
            sink,
            ids,
            queued,
            refused,
            deadline,
        } = self;
        let made: Vec<(
            SampleResult,
            Option<std::collections::BTreeMap<String, u64>>,
        )> = match queued.map(|h| wait_outcomes(py, h, deadline, hold)) {
            Ok(outcomes) => ids
                .iter()
                .zip(outcomes)
                .flat_map(|(id, o)| outcome_results(std::slice::from_ref(id), o))
                .map(|r| match r {
                    SampleResult::Published(mut p) => {
                        let w = p.writable.take();
                        (SampleResult::Published(p), w)
                    }
                    failed => (failed, None),
                })
                .collect(),
            Err(e) => capture_arena::sample::batch_results(&ids, Err(&e))
                .into_iter()
                .map(|r| (r, None))
                .collect(),
        };
        rows_out(py, &sink, &made, refused, form).inspect_err(|_| {
            // Nobody learns these objects' keys: nothing will ever be written into them.
            let reserved = made
                .iter()
                .filter(|(_, w)| w.is_some())
                .flat_map(|(r, _)| published_keys(r).unwrap_or_default());
            sink.finish_writes(reserved, false);
        })
    }

    /// Uncollected: fails and frees every object as it is placed, on a thread of its own (the
    /// placing may wait for space until the deadline).
    fn abandon(self) {
        let Reserving {
            sink: mut held,
            queued,
            ..
        } = self;
        // Nothing queued: the hold goes as any other (the writer stops without the GIL if it is
        // the last).
        let Ok(handles) = queued else { return };
        let Some(sink) = held.0.take() else { return };
        let fail = move || {
            let mut n = 0;
            for h in handles {
                for p in h.wait().unwrap_or_default() {
                    let keys = published_keys(&SampleResult::Published(p)).unwrap_or_default();
                    n += keys.len();
                    sink.finish_writes(keys, false);
                }
            }
            if n > 0 {
                tracing::warn!(
                    objects = n,
                    "reservations dropped uncollected: failed and freed"
                );
            }
        };
        let spawned = std::thread::Builder::new()
            .name("capture-arena-drop".into())
            .spawn(fail);
        if let Err(e) = spawned {
            tracing::error!(error = %e, "no thread to fail uncollected reservations: they stay reserved");
        }
    }
}

/// Queues each sample as a batch of its own; waits (GIL released) only for room in the queue.
fn queue_each(
    py: Python<'_>,
    sink: &Sink,
    samples: Vec<Sample>,
    deadline: Instant,
) -> capture_arena::Result<Vec<BatchHandle>> {
    match sink.put_each_handles(samples, deadline, false) {
        Ok(h) => Ok(h),
        Err(refused) => match *refused {
            (Error::QueueFull { .. }, samples) => crate::exit::detach(py, || {
                sink.put_each_handles(samples, deadline, true)
                    .map_err(|e| e.0)
            }),
            (e, _) => Err(e),
        },
    }
}

/// The handles' outcomes. The writer places reservations in microseconds and completes them in
/// order, so the last is waited for first (one wake-up for the lot) with the GIL held for at
/// most `hold`; the GIL is released only for a writer that takes longer (a full arena waiting
/// for frees, at most until `deadline`).
fn wait_outcomes(
    py: Python<'_>,
    handles: Vec<BatchHandle>,
    deadline: Instant,
    hold: Duration,
) -> Vec<Outcome> {
    let mut outcomes: Vec<Option<Outcome>> = std::iter::repeat_with(|| None)
        .take(handles.len())
        .collect();
    if let (Some(h), Some(o)) = (handles.last(), outcomes.last_mut()) {
        *o = h.wait_timeout(hold.min(deadline.saturating_duration_since(Instant::now())));
    }
    for (h, o) in handles.iter().zip(outcomes.iter_mut()) {
        if o.is_none() {
            *o = h.wait_timeout(Duration::ZERO);
        }
    }
    if outcomes.iter().all(Option::is_some) {
        return outcomes.into_iter().flatten().collect();
    }
    crate::exit::detach(py, move || {
        handles
            .into_iter()
            .zip(outcomes)
            .map(|(h, o)| o.unwrap_or_else(|| h.wait()))
            .collect()
    })
}

/// A published result's object keys (None for a failed one).
fn published_keys(r: &SampleResult) -> Option<Vec<String>> {
    match r {
        SampleResult::Published(p) => p
            .keys()
            .ok()
            .map(|ks| ks.iter().map(|k| k.as_str().to_owned()).collect()),
        SampleResult::Failed(_) => None,
    }
}

/// The rows in the specs' order: `(row, writable)`, or with `keys` `(keys, writable, json)`.
fn rows_out<'py>(
    py: Python<'py>,
    sink: &Sink,
    made: &[(
        SampleResult,
        Option<std::collections::BTreeMap<String, u64>>,
    )],
    refused: Vec<RefusedSpec>,
    form: Form,
) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    let mut refused = refused.into_iter().peekable();
    let mut made = made.iter();
    for i in 0.. {
        let item = if refused.peek().is_some_and(|(at, _, _)| *at == i) {
            let Some((_, id, error)) = refused.next() else {
                break;
            };
            if form == Form::KeysDicts {
                let row = PyDict::new(py);
                row.set_item(intern!(py, "sample_id"), id)?;
                row.set_item(intern!(py, "error"), error)?;
                PyTuple::new(py, [py.None(), py.None(), row.into_any().unbind()])?
            } else if form == Form::KeysJson {
                let text = refused_json(id.bind(py), &error);
                PyTuple::new(
                    py,
                    [
                        py.None(),
                        py.None(),
                        PyBytes::new(py, &text).into_any().unbind(),
                    ],
                )?
            } else {
                let row = PyDict::new(py);
                row.set_item("sample_id", id)?;
                row.set_item("error", error)?;
                PyTuple::new(py, [row.into_any().unbind(), py.None()])?
            }
        } else if let Some((r, w)) = made.next() {
            let place = match &w {
                Some(w) => {
                    let d = PyDict::new(py);
                    for (name, at) in w {
                        if form == Form::Rows {
                            d.set_item(name, at)?;
                        } else {
                            // The internal forms: with the object's stamp, which the native
                            // row copy checks against the object's stamp word before it writes.
                            d.set_item(name, (at, stamp_of(r, name)))?;
                        }
                    }
                    d.into_any().unbind()
                }
                None => py.None(),
            };
            if form == Form::KeysDicts {
                let names = keys_to_py(py, if w.is_some() { published_keys(r) } else { None })?;
                PyTuple::new(py, [names, place, row_to_py(py, r)?.into_any().unbind()])?
            } else if form == Form::KeysJson {
                let (names, text) = keys_and_json(sink, r, w.is_some());
                let names = keys_to_py(py, names)?;
                PyTuple::new(
                    py,
                    [names, place, PyBytes::new(py, &text).into_any().unbind()],
                )?
            } else {
                let row = results_to_py(py, std::slice::from_ref(r))?.get_item(0)?;
                PyTuple::new(py, [row.unbind(), place])?
            }
        } else {
            break;
        };
        out.append(item)?;
    }
    Ok(out)
}

/// The stamp of a published result's feature `name` (0 where it has none).
fn stamp_of(r: &SampleResult, name: &str) -> u64 {
    match r {
        SampleResult::Published(p) => p.features.get(name).and_then(|f| f.stamp).unwrap_or(0),
        SampleResult::Failed(_) => 0,
    }
}

/// A reserved sample's object keys (None for a failed one) and its row's JSON text. A row that
/// cannot be encoded (no result type today has such a field) fails its objects here, freeing
/// them, and becomes an error row: nothing stays reserved that its caller cannot name.
fn keys_and_json(sink: &Sink, r: &SampleResult, reserved: bool) -> (Option<Vec<String>>, Vec<u8>) {
    let names = if reserved { published_keys(r) } else { None };
    match serde_json::to_vec(r) {
        Ok(text) => (names, text),
        Err(e) => {
            let id = match r {
                SampleResult::Published(p) => p.sample_id.clone(),
                SampleResult::Failed(f) => f.sample_id.clone(),
            };
            if let Some(names) = names {
                sink.finish_writes(names, false);
            }
            let error = format!("encoding the result failed: {e}");
            let text = serde_json::to_vec(&serde_json::json!({"sample_id": id, "error": error}))
                .unwrap_or_default();
            (None, text)
        }
    }
}

/// A reservation's object keys as a list, or None for a row with an error.
fn keys_to_py(py: Python<'_>, keys: Option<Vec<String>>) -> PyResult<Py<PyAny>> {
    Ok(match keys {
        Some(k) => PyList::new(py, k)?.into_any().unbind(),
        None => py.None(),
    })
}

/// A result as a dict, as `pythonize` (or `json.loads` of its JSON text) would make it, built
/// with interned keys and no serializer: the shape of [`SampleResult`] (fields absent when
/// serde skips them).
fn row_to_py<'py>(py: Python<'py>, r: &SampleResult) -> PyResult<Bound<'py, PyDict>> {
    let row = PyDict::new(py);
    match r {
        SampleResult::Failed(f) => {
            row.set_item(intern!(py, "sample_id"), &f.sample_id)?;
            row.set_item(intern!(py, "error"), &f.error)?;
        }
        SampleResult::Published(p) => {
            row.set_item(intern!(py, "sample_id"), &p.sample_id)?;
            row.set_item(intern!(py, "store_id"), &p.store_id)?;
            row.set_item(intern!(py, "gen"), p.gen)?;
            row.set_item(intern!(py, "aux_layer_ids"), p.aux_layer_ids.as_deref())?;
            let features = PyDict::new(py);
            for (name, f) in &p.features {
                let d = PyDict::new(py);
                d.set_item(intern!(py, "shape"), PyList::new(py, &f.shape)?)?;
                d.set_item(intern!(py, "dtype"), f.dtype.name())?;
                d.set_item(intern!(py, "address"), f.address)?;
                if let Some(stamp) = f.stamp {
                    d.set_item(intern!(py, "stamp"), stamp)?;
                }
                features.set_item(name, d)?;
            }
            row.set_item(intern!(py, "features"), features)?;
            let arena = PyDict::new(py);
            arena.set_item(intern!(py, "session"), &p.arena.session)?;
            arena.set_item(intern!(py, "control"), &p.arena.control)?;
            if let Some(token) = &p.arena.token {
                arena.set_item(intern!(py, "token"), token)?;
            }
            row.set_item(intern!(py, "arena"), arena)?;
        }
    }
    Ok(row)
}

/// `{"sample_id", "error"}` as JSON for a spec refused before the writer (its `sample_id` if it
/// is a string, else null).
fn refused_json(id: &Bound<'_, PyAny>, error: &str) -> Vec<u8> {
    let id: Option<String> = id.extract().ok();
    serde_json::to_vec(&serde_json::json!({"sample_id": id, "error": error})).unwrap_or_default()
}
