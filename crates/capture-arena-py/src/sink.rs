//! `_ArenaSink`: the sink an inference server's capture hook calls (wrapped by
//! `capture_arena.ArenaSink`, which turns tensors into uint8 array views first).

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use capture_arena::config::{self, parse_bytes};
use capture_arena::paged::Landed;
use capture_arena::sample::result::MAX_FEATURES;
use capture_arena::sample::{
    batch_results, encode_ints, Captured, PassthroughSpec, SampleResult, SampleSpec, SpecFeatures,
};
use capture_arena::tensor::MAX_RANK;
use capture_arena::writer::Outcome;
use capture_arena::{Config, Dtype, Error, Sample, Sink, Tensor, TensorData};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use pythonize::pythonize;

use crate::array::bytes_of;
use crate::error::{named, to_py, IntoPy};
use crate::held::Held;
use crate::reserve::{PyReserving, GIL_HELD_WAIT};
use crate::results::{outcome_results, results_to_py};

/// Work for the sink's helper thread, the only one of its threads that attaches to Python.
pub(crate) enum Msg {
    /// The owner of bytes the writer has finished copying.
    Release(Py<PyAny>),
    /// A batch is done: complete its future.
    Done {
        future: Py<PyAny>,
        ids: Vec<String>,
        outcome: Outcome,
        refused: Vec<Refused>,
    },
}

/// A sample refused before its batch was queued: its position in the caller's batch and its
/// `{"sample_id", "error"}` row (a Python dict, made with the GIL held).
pub(crate) type Refused = (usize, Py<PyAny>);

/// What a batch's samples became: those to publish, and the rows of those refused.
pub(crate) struct Built {
    pub(crate) samples: Vec<Sample>,
    pub(crate) refused: Vec<Refused>,
}

/// Builds each `(spec, aux, last_hidden, passthrough_bytes)` item of a batch on its own, so a bad
/// request costs only its own row: an item that is already a dict (a row the Python wrapper
/// refused) is kept as it is; an item that fails to build (invalid spec or tensors, a key longer
/// than allowed, a key another sample of the batch has already) becomes
/// `{"sample_id", "error"}`. `key_of` names a sample's objects for the duplicate check (the arena's
/// keys, or the Mooncake store's).
pub(crate) fn build_batch(
    samples: &Bound<'_, PyAny>,
    tx: Option<&Sender<Msg>>,
    aux_ids: &Option<Vec<i64>>,
    key_of: impl Fn(&Sample) -> PyResult<Vec<String>>,
) -> PyResult<Built> {
    let py = samples.py();
    let mut built = Built {
        samples: Vec::new(),
        refused: Vec::new(),
    };
    let mut seen = std::collections::HashSet::new();
    for (i, item) in samples.try_iter()?.enumerate() {
        let item = item?;
        if item.is_instance_of::<PyDict>() {
            built.refused.push((i, item.unbind()));
            continue;
        }
        let made = sample(&item, tx, aux_ids).and_then(|s| {
            let keys = key_of(&s)?;
            if let Some(k) = keys.iter().find(|k| seen.contains(*k)) {
                return Err(named(
                    py,
                    "InvalidSampleError",
                    format!(
                        "sample {:?}: key {k} is also an object of another sample of this \
                         batch (a request sent twice?); this one is refused",
                        s.sample_id()
                    ),
                ));
            }
            seen.extend(keys);
            Ok(s)
        });
        match made {
            Ok(s) => built.samples.push(s),
            Err(e) => built
                .refused
                .push((i, refused_row(&item, &e.value(py).to_string())?)),
        }
    }
    Ok(built)
}

/// `{"sample_id", "error"}` for an item of a batch (its spec's `sample_id` when it has one).
fn refused_row(item: &Bound<'_, PyAny>, error: &str) -> PyResult<Py<PyAny>> {
    let py = item.py();
    let id = item
        .cast::<PyTuple>()
        .ok()
        .and_then(|t| t.get_item(0).ok())
        .and_then(|spec| spec.get_item("sample_id").ok())
        .unwrap_or_else(|| py.None().into_bound(py));
    let row = PyDict::new(py);
    row.set_item("sample_id", id)?;
    row.set_item("error", error)?;
    Ok(row.into_any().unbind())
}

/// A batch's rows in the caller's order: the published (or failed) samples' results with the
/// refused rows put back at their positions.
fn merge_rows<'py>(
    py: Python<'py>,
    results: &[SampleResult],
    refused: Vec<Refused>,
) -> PyResult<Bound<'py, PyAny>> {
    merge_rows_alone(py, results, refused, false)
}

/// Whether a batch's outcome is one a single sample may have caused alone (a key of it already
/// resident, or more bytes than the whole arena holds): the batch is placed whole, so each of
/// its samples then fails; published one by one, only the samples at fault would.
fn fails_alone(outcome: &Outcome, samples: usize) -> bool {
    samples > 1
        && matches!(
            outcome,
            Err(Error::KeyExists { .. }) | Err(Error::BatchTooLarge { .. })
        )
}

/// [`merge_rows`]; with `alone`, each row of the batch (not those refused before it) carries
/// `"_alone": True`, so that the Python sink publishes the batch's samples one by one instead
/// ([`fails_alone`]).
fn merge_rows_alone<'py>(
    py: Python<'py>,
    results: &[SampleResult],
    refused: Vec<Refused>,
    alone: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let list = results_to_py(py, results)?.cast_into::<PyList>()?;
    if alone {
        for row in list.iter() {
            row.set_item("_alone", true)?;
        }
    }
    for (i, row) in refused {
        list.insert(i, row)?;
    }
    Ok(list.into_any())
}

/// The owner of a Python array lent to the writer (the uint8 numpy view whose array interface
/// gave the address and length). Holding it keeps the memory allocated and in place (numpy
/// refuses to resize a referenced array) until the writer drops the tensor after copying it;
/// then the reference goes to the helper thread, so the writer never needs the GIL.
///
/// Without a helper (`tx: None`: a batch planned for the store placement, dropped by Python) the
/// reference is simply dropped.
struct Owner {
    owner: Option<Py<PyAny>>,
    tx: Option<Sender<Msg>>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        let Some(tx) = &self.tx else { return };
        if let Some(o) = self.owner.take() {
            if let Err(mpsc::SendError(Msg::Release(o))) = tx.send(Msg::Release(o)) {
                // The helper is gone (interpreter shutting down): leak the reference rather
                // than touch Python from the writer thread.
                std::mem::forget(o);
            }
        }
    }
}

/// Completes a future with a batch's outcome. The core runs it exactly once for an accepted
/// batch (with `WriterStopped` if the writer stops first) and never for a refused one: then the
/// caller gets the exception and the future is left alone. Sending needs no GIL.
struct Completion {
    future: Py<PyAny>,
    ids: Vec<String>,
    refused: Vec<Refused>,
    tx: Sender<Msg>,
}

impl Completion {
    fn complete(self, outcome: Outcome) {
        let Completion {
            future,
            ids,
            refused,
            tx,
        } = self;
        if let Err(mpsc::SendError(Msg::Done {
            future, refused, ..
        })) = tx.send(Msg::Done {
            future,
            ids,
            outcome,
            refused,
        }) {
            std::mem::forget(future);
            std::mem::forget(refused);
        }
    }
}

/// `(owner, shape, dtype name)` from `capture_arena._tensors.host_bytes` -> a captured tensor.
fn captured(t: &Bound<'_, PyAny>, tx: Option<&Sender<Msg>>, what: &str) -> PyResult<Captured> {
    let (owner, shape, dtype): (Bound<'_, PyAny>, Vec<u64>, String) = t.extract()?;
    let dtype = Dtype::from_name(&dtype).ok_or_else(|| {
        named(
            t.py(),
            "InvalidSampleError",
            format!(
                "{what}: unsupported dtype {dtype:?} (supported: {})",
                Dtype::ALL.map(Dtype::name).join(", ")
            ),
        )
    })?;
    if let Some(dev) = crate::array::device_of(&owner)? {
        let owner = Owner {
            owner: Some(owner.unbind()),
            tx: tx.cloned(),
        };
        // SAFETY: (ptr, len, device) were read from the CUDA tensor itself, which `owner` keeps
        // referenced (so its storage stays allocated) until the writer drops the tensor; the
        // event recorded now on the tensor's current stream orders the writer's copies after
        // the kernels that wrote it. ArenaSink's documented contract: the caller does not write
        // or free the tensor until its batch's results are back.
        let data =
            unsafe { TensorData::device(dev.ptr, dev.len, dev.device, Some(dev.stream), owner) }
                .map_err(|e| named(t.py(), "InvalidSampleError", format!("{what}: {e}")))?;
        return Ok(Captured { shape, dtype, data });
    }
    let (ptr, len) = bytes_of(&owner, false)
        .map_err(|e| named(t.py(), "InvalidSampleError", format!("{what}: {e}")))?;
    let owner = Owner {
        owner: Some(owner.unbind()),
        tx: tx.cloned(),
    };
    // SAFETY: (ptr, len) come from the array interface of `owner`, a C-contiguous uint8 array
    // that `owner` keeps referenced (so allocated and unmoved) until the writer drops the
    // tensor; ArenaSink's documented contract is that the caller neither writes, resizes nor
    // frees the tensor behind it until its batch's results are back, which is after that drop.
    let data = unsafe { TensorData::lent(ptr as *const u8, len, owner) };
    Ok(Captured { shape, dtype, data })
}

/// Passthrough entries of one spec read at most.
const MAX_PASSTHROUGH_READ: usize = 16 * MAX_FEATURES;

/// The spec of one sample, read field by field: a passthrough whose `data` is a list of
/// integers for an integer (or bool) dtype takes the typed path into bytes (`bytes` gets it,
/// its spec entry gets `data: null`) instead of a generic JSON value per element.
fn spec_of(d: &Bound<'_, PyAny>, bytes: &mut HashMap<String, Captured>) -> PyResult<SampleSpec> {
    let py = d.py();
    let bad = |e: String| {
        named(
            py,
            "InvalidSampleError",
            format!("invalid sample spec: {e}"),
        )
    };
    let d = d
        .cast::<PyDict>()
        .map_err(|_| bad("expected a dict".into()))?;
    let get = |k: &str| d.get_item(k);
    let req = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        get(k)?.ok_or_else(|| bad(format!("missing field `{k}`")))
    };
    let text = |k: &str| -> PyResult<String> {
        req(k)?
            .extract()
            .map_err(|_| bad(format!("`{k}` must be a string")))
    };
    let mut passthrough = Vec::new();
    if let Some(list) = get("passthrough")?.filter(|v| !v.is_none()) {
        for p in list
            .try_iter()
            .map_err(|_| bad("`passthrough` must be a list".into()))?
        {
            // Read no further than this (an iterator may not end): past MAX_FEATURES the core
            // refuses the sample, counting what it names.
            if passthrough.len() == MAX_PASSTHROUGH_READ {
                return Err(bad(format!(
                    "more than {MAX_PASSTHROUGH_READ} passthrough tensors (a result names at \
                     most {MAX_FEATURES} features)"
                )));
            }
            let p = p?;
            let p = p
                .cast::<PyDict>()
                .map_err(|_| bad("a passthrough must be a dict".into()))?;
            let field = |k: &str| -> PyResult<Bound<'_, PyAny>> {
                p.get_item(k)?
                    .ok_or_else(|| bad(format!("a passthrough lacks `{k}`")))
            };
            let name: String = field("name")?
                .extract()
                .map_err(|_| bad("passthrough `name` must be a string".into()))?;
            let dtype: String = field("dtype")?
                .extract()
                .map_err(|_| bad(format!("passthrough {name:?}: `dtype` must be a string")))?;
            // Read within bounds: pyo3's `Vec` extraction sizes its buffer by `len()`, which
            // a list subclass may claim to be 2^40.
            let shape: Vec<u64> = crate::value::from_py_within(&field("shape")?, 1, MAX_RANK + 1)
                .map_err(|e| {
                bad(format!(
                    "passthrough {name:?}: `shape` must be a list of at most {MAX_RANK} \
                         integers >= 0 ({e})"
                ))
            })?;
            let elements = shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            let data = p.get_item("data")?;
            let typed = match (&data, Dtype::from_name(&dtype)) {
                // A flat list of Python ints (bools are ints): one typed read per element. An
                // exact list: its length is its own (a subclass's `len()` may say 2^40).
                (Some(v), Some(dt)) if !dt.is_float() => v
                    .cast_exact::<PyList>()
                    .ok()
                    .and_then(|l| l.extract::<Vec<i64>>().ok())
                    .map(|ints| (ints, dt)),
                _ => None,
            };
            let data = match typed {
                Some((ints, dt)) => {
                    let needed = elements;
                    if needed != Some(ints.len() as u64) {
                        return Err(named(
                            py,
                            "InvalidSampleError",
                            format!(
                                "sample {:?}: passthrough {name:?}: data has {} elements but \
                                 shape {shape:?} needs {}",
                                text("sample_id").unwrap_or_default(),
                                ints.len(),
                                needed.map_or("more than 2^64".into(), |n| n.to_string())
                            ),
                        ));
                    }
                    let encoded =
                        crate::exit::detach(py, || encode_ints(&ints, dt)).map_err(|e| {
                            named(
                                py,
                                "InvalidSampleError",
                                format!("passthrough {name:?}: {e}"),
                            )
                        })?;
                    let n = ints.len() as u64;
                    bytes.insert(
                        name.clone(),
                        Captured {
                            shape: vec![n],
                            dtype: dt,
                            data: TensorData::host(encoded),
                        },
                    );
                    serde_json::Value::Null
                }
                None => match data {
                    // Nested as deep as the shape, holding its elements and their lists at
                    // most (the core then checks them against the shape).
                    Some(v) if !v.is_none() => {
                        // The lists and numbers of data nested as the shape says: 1 + d0 +
                        // d0·d1 + ... (a zero dimension included: `[[]]` for `[1, 0]`).
                        let values = shape
                            .iter()
                            .scan(1u64, |at, &d| {
                                *at = at.saturating_mul(d);
                                Some(*at)
                            })
                            .fold(1u64, u64::saturating_add);
                        let values = usize::try_from(values).unwrap_or(usize::MAX);
                        crate::value::from_py_within(&v, shape.len() + 1, values)
                            .map_err(|e| bad(format!("passthrough {name:?}: `data`: {e}")))?
                    }
                    _ => serde_json::Value::Null,
                },
            };
            passthrough.push(PassthroughSpec {
                name,
                data,
                shape,
                dtype,
            });
        }
    }
    let features: SpecFeatures = match get("features")? {
        Some(f) if !f.is_none() => {
            crate::value::from_py(&f).map_err(|e| bad(format!("`features`: {e}")))?
        }
        _ => SpecFeatures::default(),
    };
    Ok(SampleSpec {
        store_id: text("store_id")?,
        sample_id: text("sample_id")?,
        gen: match get("gen")? {
            Some(g) if !g.is_none() => g
                .extract()
                .map_err(|_| bad("`gen` must be an integer >= 1".into()))?,
            _ => 1,
        },
        replace: match get("replace")? {
            Some(r) if !r.is_none() => r
                .extract()
                .map_err(|_| bad("`replace` must be a bool".into()))?,
            _ => false,
        },
        features,
        passthrough,
    })
}

/// One `(spec, aux, last_hidden, passthrough_bytes)` tuple from the Python wrapper.
pub(crate) fn sample(
    item: &Bound<'_, PyAny>,
    tx: Option<&Sender<Msg>>,
    aux_ids: &Option<Vec<i64>>,
) -> PyResult<Sample> {
    let t = item.cast::<PyTuple>()?;
    let mut parts = HashMap::new();
    let spec = spec_of(&t.get_item(0)?, &mut parts)?;
    let id = spec.sample_id.as_str();
    let opt = |i: usize, artifact: &str| -> PyResult<Option<Captured>> {
        let v = t.get_item(i)?;
        if v.is_none() {
            Ok(None)
        } else {
            captured(&v, tx, &format!("sample {id:?} {artifact}")).map(Some)
        }
    };
    let (aux, last) = (opt(1, "aux")?, opt(2, "last_hidden")?);
    let extra = t.get_item(3)?;
    if !extra.is_none() {
        for (k, v) in extra.extract::<HashMap<String, Bound<'_, PyAny>>>()? {
            let c = captured(&v, tx, &format!("sample {id:?} passthrough {k:?}"))?;
            parts.insert(k, c);
        }
    }
    Sample::from_spec_parts(&spec, aux, last, aux_ids.clone(), parts).py_err()
}

/// The helper thread: releases lent arrays and completes futures, attaching to Python once per
/// burst of messages. User callbacks on the futures run here: they should not block.
fn helper(rx: Receiver<Msg>) {
    while let Ok(first) = rx.recv() {
        // The exit hook waits for a burst under way, and after it this thread parks (`exit`).
        crate::exit::attach(|py| {
            let mut next = Some(first);
            while let Some(msg) = next.take() {
                match msg {
                    Msg::Release(o) => drop(o),
                    Msg::Done {
                        future,
                        ids,
                        outcome,
                        refused,
                    } => {
                        let fut = future.bind(py);
                        let alone = fails_alone(&outcome, ids.len());
                        let results = outcome_results(&ids, outcome);
                        let r = match merge_rows_alone(py, &results, refused, alone) {
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

/// Keyword argument -> the environment variable it overrides.
const OVERRIDES: [(&str, &str); 14] = [
    ("arena_bytes", config::ENV_ARENA_BYTES),
    ("control_host", config::ENV_CONTROL_HOST),
    ("control_port", config::ENV_CONTROL_PORT),
    ("alignment", config::ENV_ARENA_ALIGN),
    ("wait_s", config::ENV_ARENA_WAIT_S),
    ("max_pending_batches", config::ENV_MAX_PENDING),
    ("timing", config::ENV_TIMING),
    ("protocol", config::ENV_PROTOCOL),
    ("gpu_put", config::ENV_GPU_PUT),
    ("eager", config::ENV_EAGER),
    ("device", config::ENV_ARENA_DEVICE),
    ("transport", config::ENV_TRANSPORT),
    ("control_token", config::ENV_CONTROL_TOKEN),
    ("placement", config::ENV_PLACEMENT),
];

/// The compiled sink. Use `capture_arena.ArenaSink`.
#[pyclass(
    name = "_ArenaSink",
    module = "capture_arena._capture_arena",
    subclass,
    frozen
)]
pub struct PySink {
    /// `None` once closed. Calls clone the `Arc` and run without the lock, so `close` never
    /// waits for (or fails because of) a call blocked in another thread; the writer stops when
    /// the last clone goes.
    sink: Mutex<Option<Arc<Sink>>>,
    /// Dropped only in the process that made it (see `Drop`).
    tx: ManuallyDrop<Sender<Msg>>,
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

/// A step's landed flags ([`crate::rows::PyLanded`]).
type Flags = std::sync::Arc<[std::sync::atomic::AtomicBool]>;

/// What a step's copy does as request `j` is over: its writes finished or failed (its objects
/// by name, or its keys where no table vouched for the names: [`Landed`]), then its flag in the
/// step's `landed` set (request `j` is flag `first + j`).
fn landing<'a>(
    sink: &'a capture_arena::Sink,
    flags: &'a Flags,
    first: usize,
) -> impl Fn(usize, Landed) + Sync + 'a {
    move |j, landed| {
        match landed {
            Landed::Written(objects) => sink.finish_written(objects, true),
            Landed::Failed(objects) => sink.finish_written(objects, false),
            Landed::FailedKeys(keys, stamps) if stamps.is_empty() => {
                sink.finish_writes(keys, false)
            }
            Landed::FailedKeys(keys, stamps) => sink.fail_writes_of(keys, stamps),
        }
        flags[first + j].store(true, std::sync::atomic::Ordering::Release);
    }
}

impl PySink {
    /// Where a step's `n` requests' rows are copied to (`_copy_requests_rows*`): the step's
    /// flags (checked to hold requests `first..first + n`), the sink, and its arena as this
    /// process maps it.
    fn rows_target(
        &self,
        py: Python<'_>,
        landed: &Bound<'_, crate::rows::PyLanded>,
        first: usize,
        n: usize,
    ) -> PyResult<(Flags, Held, (u64, u64))> {
        let flags = landed.get().0.clone();
        if first.saturating_add(n) > flags.len() {
            return Err(PyValueError::new_err(format!(
                "copying cache rows: requests {first}..{} have no flags (the step has {})",
                first.saturating_add(n),
                flags.len()
            )));
        }
        let sink = self.sink(py)?;
        let arena = sink.local_region().ok_or_else(|| {
            named(
                py,
                "WriterStoppedError",
                "the arena does not exist yet".into(),
            )
        })?;
        Ok((flags, sink, arena))
    }

    fn sink(&self, py: Python<'_>) -> PyResult<Held> {
        if self.pid != std::process::id() {
            return Err(named(
                py,
                "WriterStoppedError",
                format!(
                    "this ArenaSink belongs to process {} (its writer thread did not survive the \
                     fork); create a new sink in process {}",
                    self.pid,
                    std::process::id()
                ),
            ));
        }
        self.sink
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .map(Held::new)
            .ok_or_else(|| named(py, "WriterStoppedError", "the ArenaSink is closed".into()))
    }

    /// Publishes each sample as a batch of its own under one bound ([`Sink::put_each_within`])
    /// and merges the rows with those refused before.
    fn put_each_rows<'py>(
        &self,
        py: Python<'py>,
        sink: &Sink,
        samples: Vec<Sample>,
        refused: Vec<Refused>,
        within_s: f64,
    ) -> PyResult<Bound<'py, PyAny>> {
        if samples.is_empty() {
            return merge_rows(py, &[], refused);
        }
        let ids: Vec<String> = samples.iter().map(|s| s.sample_id().to_owned()).collect();
        let within = bound_of(within_s);
        let results: Vec<SampleResult> =
            match crate::exit::detach(py, || Ok(sink.put_each_within(samples, within))).py_err()? {
                Ok(outcomes) => ids
                    .iter()
                    .zip(outcomes)
                    .flat_map(|(id, o)| outcome_results(std::slice::from_ref(id), o))
                    .collect(),
                Err(e) => batch_results(&ids, Err(&e)),
            };
        merge_rows(py, &results, refused)
    }

    fn samples(&self, sink: &Sink, samples: &Bound<'_, PyAny>) -> PyResult<Built> {
        let aux_ids = sink.config().aux_layer_ids.clone();
        build_batch(samples, Some(&self.tx), &aux_ids, |s| {
            Ok(s.keys().map(|k| k.as_str().to_owned()).collect())
        })
    }
}

#[pymethods]
impl PySink {
    #[new]
    #[pyo3(signature = (*, arena_bytes=None, control_host=None, control_port=None, alignment=None,
                        wait_s=None, max_pending_batches=None, aux_layer_ids=None, timing=None,
                        protocol=None, gpu_put=None, eager=None, device=None, transport=None,
                        control_token=None, placement=None))]
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
        eager: Option<bool>,
        device: Option<i32>,
        transport: Option<String>,
        control_token: Option<String>,
        placement: Option<String>,
    ) -> PyResult<Self> {
        // Variables whose keyword argument is given are not read at all, so a keyword argument
        // can correct a bad environment.
        let given = [
            arena_bytes.is_some(),
            control_host.is_some(),
            control_port.is_some(),
            alignment.is_some(),
            wait_s.is_some(),
            max_pending_batches.is_some(),
            timing.is_some(),
            protocol.is_some(),
            gpu_put.is_some(),
            eager.is_some(),
            device.is_some(),
            transport.is_some(),
            control_token.is_some(),
            placement.is_some(),
        ];
        let skip: Vec<&str> = OVERRIDES
            .iter()
            .zip(given)
            .filter(|(_, g)| *g)
            .map(|((_, var), _)| *var)
            .collect();
        let mut c = Config::from_lookup_unchecked(|k| {
            if skip.contains(&k) {
                None
            } else {
                std::env::var(k).ok()
            }
        })
        .py_err()?;
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
        if let Some(e) = eager {
            c.eager = e;
        }
        if control_token.is_some() {
            c.control_token = control_token;
        }
        if let Some(p) = placement {
            c.placement = config::parse_placement(&p).map_err(|reason| {
                to_py(Error::Config {
                    var: "placement",
                    reason,
                })
            })?;
        }
        if let Some(t) = transport {
            c.transport = t.parse().map_err(|reason| {
                to_py(Error::Config {
                    var: "transport",
                    reason,
                })
            })?;
        }
        if let Some(d) = device {
            if d < 0 {
                return Err(to_py(Error::Config {
                    var: "device",
                    reason: format!("{d} is not a device ordinal (0, 1, ...)"),
                }));
            }
            c.device = Some(d);
        }
        // With `eager`, this creates and pre-faults the arena: without the GIL.
        let sink = Python::attach(|py| crate::exit::detach(py, || Sink::new(c))).py_err()?;
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("capture-arena-py".into())
            .spawn(move || helper(rx))
            .map_err(|e| {
                PyRuntimeError::new_err(format!("spawning the sink's helper thread: {e}"))
            })?;
        Ok(PySink {
            sink: Mutex::new(Some(Arc::new(sink))),
            tx: ManuallyDrop::new(tx),
            pid: std::process::id(),
        })
    }

    /// Queues a batch; `future.set_result(rows)` is called when it is done, one row per item in
    /// order. Items that are dicts are rows already (refused by the caller); items that fail to
    /// build get `{"sample_id", "error"}` rows and cost nothing else; the rest are published as
    /// one batch. With nothing left to publish the future completes now. Blocks (GIL released)
    /// while the writer holds `max_pending_batches` batches, or raises QueueFullError if
    /// `block=False`; raises for a stopped sink or a writer that cannot start (the caller makes
    /// those rows).
    #[pyo3(signature = (samples, future, block=true))]
    fn _submit(
        &self,
        py: Python<'_>,
        samples: &Bound<'_, PyAny>,
        future: Py<PyAny>,
        block: bool,
    ) -> PyResult<()> {
        let sink = self.sink(py)?;
        let Built { samples, refused } = self.samples(&sink, samples)?;
        if samples.is_empty() {
            let rows = merge_rows(py, &[], refused)?;
            future.bind(py).call_method1("set_result", (rows,))?;
            return Ok(());
        }
        let completion = Completion {
            future,
            ids: samples.iter().map(|s| s.sample_id().to_owned()).collect(),
            refused,
            tx: (*self.tx).clone(),
        };
        let done = move |outcome: Outcome| completion.complete(outcome);
        crate::exit::detach(py, || {
            if block {
                sink.submit_with(samples, done)
            } else {
                sink.try_submit_with(samples, done)
            }
        })
        .py_err()
    }

    /// Publishes a batch and waits for its rows (GIL released while the writer starts, places
    /// and copies), one per item as `_submit` gives them. The call holds the sink until its rows
    /// are back, so a `close()` meanwhile lets it finish.
    ///
    /// With `within_s`, a synchronous caller's bound: the batch waits at most that long to
    /// start (for room, earlier batches, frees) and the writer is never started here; a batch
    /// that did not start gets every sample's error row and is never written.
    #[pyo3(signature = (samples, within_s=None))]
    fn _put<'py>(
        &self,
        py: Python<'py>,
        samples: &Bound<'py, PyAny>,
        within_s: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let sink = self.sink(py)?;
        let Built { samples, refused } = self.samples(&sink, samples)?;
        if samples.is_empty() {
            return merge_rows(py, &[], refused);
        }
        let ids: Vec<String> = samples.iter().map(|s| s.sample_id().to_owned()).collect();
        let outcome = match within_s {
            Some(s) => {
                let within = bound_of(s);
                crate::exit::detach(py, || Ok(sink.put_within(samples, within)))
            }
            None => crate::exit::detach(py, || sink.submit(samples).map(|h| h.wait())),
        };
        let outcome = outcome.py_err()?;
        let alone = fails_alone(&outcome, ids.len());
        merge_rows_alone(py, &outcome_results(&ids, outcome), refused, alone)
    }

    /// Publishes each item as a batch of its own and waits for every row (GIL released): the
    /// whole call waits for space at most `within_s`; an item whose turn comes after that is
    /// published if it fits at once and gets its error row at once otherwise. One row per item,
    /// in order; the writer is never started here.
    fn _put_each<'py>(
        &self,
        py: Python<'py>,
        samples: &Bound<'py, PyAny>,
        within_s: f64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let sink = self.sink(py)?;
        let Built { samples, refused } = self.samples(&sink, samples)?;
        self.put_each_rows(py, &sink, samples, refused, within_s)
    }

    /// Reserves each `{"store_id", "sample_id", "gen", "replace", "features": {name: {"shape",
    /// "dtype"}}}` as a sample of its own whose bytes the caller writes itself, and returns for
    /// each at once `(row, writable)`: the result, whose objects' stamp words say "still being
    /// written" until `_finish_writes`, and `{name: address}` where this process writes each
    /// feature; or `({"sample_id", "error"}, None)`. The whole call waits for space at most
    /// `within_s` (as `_put_each`): `_begin_reserving(...).wait(keys, hold_gil_s)` in one.
    #[pyo3(signature = (specs, within_s, keys = false, hold_gil_s = GIL_HELD_WAIT.as_secs_f64()))]
    fn _reserve_each<'py>(
        &self,
        py: Python<'py>,
        specs: &Bound<'py, PyAny>,
        within_s: f64,
        keys: bool,
        hold_gil_s: f64,
    ) -> PyResult<Bound<'py, PyList>> {
        self._begin_reserving(py, specs, within_s)?
            .wait(py, keys, hold_gil_s, false)
    }

    /// Hands the reservations of `_reserve_each` to the writer and returns at once (unless the
    /// writer's queue has no room: then it waits for room, at most `within_s`), for a caller
    /// that collects them later with `.wait()` (vLLM's connector: when a step begins, collected
    /// after the forward, so vLLM's thread never waits for the writer). The space is waited for
    /// at most `within_s` from now.
    fn _begin_reserving(
        &self,
        py: Python<'_>,
        specs: &Bound<'_, PyAny>,
        within_s: f64,
    ) -> PyResult<PyReserving> {
        let within = bound_of(within_s);
        PyReserving::begin(py, self.sink(py)?, specs, within)
    }

    /// `_begin_reserving` for requests of rows, with no spec to read: each `(sample_id, gen,
    /// n)` of `requests` is `{"store_id": store_id, "sample_id", "gen", "features":
    /// {"hidden_states": {"shape": [1, n, width], "dtype": dtype}, "token_ids": {"shape": [1,
    /// n], "dtype": "int64"}}}` (vLLM's connector: a step's finished prompts).
    fn _begin_reserving_rows(
        &self,
        py: Python<'_>,
        store_id: String,
        dtype: &str,
        width: u64,
        requests: Vec<(String, u64, u64)>,
        within_s: f64,
    ) -> PyResult<PyReserving> {
        let dtype = capture_arena::Dtype::from_name(dtype).ok_or_else(|| {
            named(
                py,
                "InvalidSampleError",
                format!("reserving rows: unknown dtype {dtype:?}"),
            )
        })?;
        let rows = crate::reserve::RowsSpec {
            store_id,
            dtype,
            width,
        };
        let within = bound_of(within_s);
        PyReserving::begin_rows(py, self.sink(py)?, &rows, requests, within)
    }

    /// The arena's memory in this process, `(address, bytes)`, or None before it exists.
    fn _local_region(&self, py: Python<'_>) -> PyResult<Option<(u64, u64)>> {
        Ok(self.sink(py)?.local_region())
    }

    /// The caller finished writing these objects' bytes (published by `_reserve_each`): with
    /// `ok`, readers may read them; without, they never will be (readers fail, the space is
    /// freed). Applied at the writer's next turn.
    fn _finish_writes(&self, py: Python<'_>, keys: Vec<String>, ok: bool) -> PyResult<()> {
        let sink = self.sink(py)?;
        sink.finish_writes(keys, ok);
        Ok(())
    }

    /// Fails a request's objects that never will be written, named by its keys and the stamps
    /// it was given: all of them if one of the keys holds an object being written with one of
    /// the stamps, else none (another request's keys). Applied at the writer's next turn.
    fn _fail_writes_of(&self, py: Python<'_>, keys: Vec<String>, stamps: Vec<u64>) -> PyResult<()> {
        let sink = self.sink(py)?;
        sink.fail_writes_of(keys, stamps);
        Ok(())
    }

    /// As `_finish_writes`, each object named by its key and the stamp its result gives: only
    /// the object under that key with that stamp is finished (or failed).
    fn _finish_writes_stamped(
        &self,
        py: Python<'_>,
        objects: Vec<(String, u64)>,
        ok: bool,
    ) -> PyResult<()> {
        let sink = self.sink(py)?;
        sink.finish_writes_stamped(objects, ok);
        Ok(())
    }

    /// Finishes (`ok`) or fails the objects this process wrote, each `(stamp, address, bytes)`
    /// as it checked them before writing (the address in this process's mapping): so it
    /// finishes or fails exactly what it wrote, whatever keys its bookkeeping holds (with `ok`,
    /// an object that does not lie there is failed; without, left to its own writer). Applied
    /// at the writer's next turn.
    fn _finish_written(
        &self,
        py: Python<'_>,
        objects: Vec<(u64, u64, u64)>,
        ok: bool,
    ) -> PyResult<()> {
        let sink = self.sink(py)?;
        let objects = objects
            .into_iter()
            .map(|(stamp, at, len)| capture_arena::sample::Written { stamp, at, len });
        sink.finish_written(objects, ok);
        Ok(())
    }

    /// Why these destinations, each `(stamp, address, bytes)` (the address in this process's
    /// mapping), are not all objects being written, as the writer's table of them says; `None`
    /// if they are. For a device arena, whose stamp words this process cannot read.
    fn _check_reserved_objects(
        &self,
        py: Python<'_>,
        objects: Vec<(u64, u64, u64)>,
    ) -> PyResult<Option<String>> {
        let sink = self.sink(py)?;
        let Some(w) = sink.started() else {
            return Ok(Some("the arena does not exist yet".into()));
        };
        let reserved = w.reserved_objects();
        Ok(objects
            .into_iter()
            .map(|(stamp, at, len)| capture_arena::sample::Written { stamp, at, len })
            .find_map(|o| reserved.check(&o).err()))
    }

    /// Copies a step's requests from a paged cache (`cache`: `(base, bytes, strides, block_size,
    /// k, row_bytes, blocks)`; each `(block, layer, slot)` row `row_bytes` contiguous at `base +
    /// block * strides[0] + layer * strides[1] + slot * strides[2]`, for a block below `blocks`,
    /// all within the `bytes` from `base`) into their reserved objects, one
    /// after another, the GIL held only to read their ids (in holds of at most `ids_per_hold`
    /// ids, each hold's requests then copied without it), and finishes each one's writes as
    /// soon as its bytes have landed, then sets its flag in `landed` (request `j` is flag
    /// `first + j`). Each request is `(keys, (ids_at, ids_stamp), token_ids, n, (rows_at,
    /// rows_stamp), rows_len, block_ids)`: the first `n` of its token ids go to `ids_at` as
    /// int64, its rows `0..n` (token `i` in block `block_ids[i / block_size]`) to `rows_at`,
    /// laid out `[n, k, row]`; each destination must be the object reserved in this sink's
    /// host arena with that stamp, still being written (its stamp word says so). Returns, per
    /// request, None or why it was not copied (its readers fail and its space is freed; a
    /// request that is not such a tuple fails alone). The caller vouches that the cache's
    /// bytes stay valid meanwhile.
    #[pyo3(signature = (cache, requests, landed, first=0, ids_per_hold=crate::rows::IDS_PER_HOLD))]
    fn _copy_requests_rows(
        &self,
        py: Python<'_>,
        cache: crate::rows::PagedArgs,
        requests: Vec<Bound<'_, PyAny>>,
        landed: &Bound<'_, crate::rows::PyLanded>,
        first: usize,
        ids_per_hold: usize,
    ) -> PyResult<Vec<Option<String>>> {
        let (flags, sink, arena) = self.rows_target(py, landed, first, requests.len())?;
        if sink.config().device_publication() {
            return Err(named(
                py,
                "InvalidReadError",
                "copying cache rows: this sink's arena is in device memory".into(),
            ));
        }
        let src = crate::rows::paged(cache);
        let reserved = sink.started().map(capture_arena::Writer::reserved_objects);
        let finish = landing(&sink, &flags, first);
        let mut why = vec![None; requests.len()];
        let mut requests = requests.into_iter().enumerate().peekable();
        // The requests' ids read with the GIL, a hold of them at a time; that hold's requests
        // copied without it. (Should the interpreter exit meanwhile, this thread parks in a
        // release of the GIL, and later holds' requests are never finished: the process ends.)
        while requests.peek().is_some() {
            let mut ready = Vec::new();
            for (j, read) in crate::rows::next_hold(&mut requests, ids_per_hold) {
                match read {
                    Ok(r) => ready.push((j, r)),
                    Err((keys, e)) => {
                        finish(j, Landed::FailedKeys(keys, Vec::new()));
                        why[j] = Some(format!("copying cache rows: {e}"));
                    }
                }
            }
            let (at, ready): (Vec<usize>, Vec<_>) = ready.into_iter().unzip();
            let copied = crate::exit::detach(py, || {
                // SAFETY: the destinations are checked to lie in this sink's own host mapping and
                // to be reserved objects still being written (their stamp words and the writer's
                // table), which only the caller of reserve_each writes; the cache range is the
                // caller's promise (a tensor it holds); an arena never lies inside a cache.
                unsafe {
                    capture_arena::paged::copy_requests(&src, arena, reserved, ready, |i, l| {
                        finish(at[i], l)
                    })
                }
            });
            for (i, w) in copied.into_iter().enumerate() {
                why[at[i]] = w;
            }
        }
        Ok(why)
    }

    /// Starts pinning this sink's host arena for `rows`' device-to-host copies into it: on a
    /// thread of its own, in chunks, while copies go on pageable (`rows.host_pinned()` says when
    /// it is done; `rows.unpin_host()` undoes it, before the arena goes). False if `rows` has
    /// one pinned already. Never on vLLM's thread: made when the copy thread first copies.
    fn _pin_host_arena(
        &self,
        py: Python<'_>,
        rows: &Bound<'_, crate::rows::PyDeviceRows>,
    ) -> PyResult<bool> {
        let sink = self.sink(py)?;
        if sink.config().device_publication() {
            return Err(named(
                py,
                "InvalidReadError",
                "pinning the host arena: this sink's arena is in device memory".into(),
            ));
        }
        let (address, len) = sink.local_region().ok_or_else(|| {
            named(
                py,
                "WriterStoppedError",
                "the arena does not exist yet".into(),
            )
        })?;
        // SAFETY: exactly this sink's own host mapping; the pin keeps `sink`, a hold on its
        // writer, which keeps the mapping until the pin is dropped.
        Ok(unsafe { rows.get().pin(sink, address, len) })
    }

    /// `_copy_requests_rows` from a cache in device memory (its addresses device pointers),
    /// through `rows`' stream, after `after` (a raw event recorded on the stream that wrote the
    /// cache, `torch.cuda.Event.cuda_event`; 0 for none): straight from the cache's blocks into
    /// a host arena (device-to-host) or a device arena (device-to-device), no staging buffer,
    /// the GIL held only to read the requests' ids, as there. Each request's flag is set as its
    /// write is finished, once its copies have landed. A device arena's stamp words are in
    /// device memory: there each destination is checked against the writer's table of the
    /// objects being written instead. The caller vouches that the cache and the event stay
    /// valid meanwhile.
    #[pyo3(signature = (
        rows, cache, requests, landed, after, first=0, ids_per_hold=crate::rows::IDS_PER_HOLD
    ))]
    #[allow(clippy::too_many_arguments)]
    fn _copy_requests_rows_device(
        &self,
        py: Python<'_>,
        rows: &Bound<'_, crate::rows::PyDeviceRows>,
        cache: crate::rows::PagedArgs,
        requests: Vec<Bound<'_, PyAny>>,
        landed: &Bound<'_, crate::rows::PyLanded>,
        after: u64,
        first: usize,
        ids_per_hold: usize,
    ) -> PyResult<Vec<Option<String>>> {
        let (flags, sink, arena) = self.rows_target(py, landed, first, requests.len())?;
        let dst_host = !sink.config().device_publication();
        let src = crate::rows::paged(cache);
        let (held, copies) = (&*sink, &rows.get().0);
        let reserved = held.started().map(capture_arena::Writer::reserved_objects);
        let mut step =
            capture_arena::paged::DeviceStep::new(copies, &src, arena, dst_host, reserved);
        let finish = landing(held, &flags, first);
        let mut requests = requests.into_iter().enumerate().peekable();
        // The requests' ids read with the GIL, a hold of them at a time; that hold's requests
        // added to the step (their ids written or enqueued) without it, and with the last hold
        // the step run.
        loop {
            let hold = crate::rows::next_hold(&mut requests, ids_per_hold);
            let last = requests.peek().is_none();
            let ran = crate::exit::detach(py, || {
                for (_, read) in hold {
                    match read {
                        // SAFETY: the destinations are checked to lie in this sink's own
                        // mapping, which only the caller of reserve_each writes for a reserved
                        // object; the cache's range is the caller's promise (a tensor it holds);
                        // the step is run with the last hold (unless the interpreter exits
                        // meanwhile: then this thread parks, and the process ends).
                        Ok(r) => unsafe { step.add(r) },
                        Err((keys, e)) => step.refuse(keys, e),
                    }
                }
                // SAFETY: as above; the event is the caller's promise (an event it holds).
                last.then(|| unsafe { step.run(after, &finish) })
            });
            if let Some(why) = ran {
                return Ok(why);
            }
        }
    }

    /// Frees `keys` from this process (a capture it drops), without a control connection;
    /// nothing before the writer has started.
    fn _free_local(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<()> {
        let sink = self.sink(py)?;
        sink.free_local(keys);
        Ok(())
    }

    /// Peers whose control connections were closed for the control token, the most recent
    /// first: a list of dicts `peer`, `connections`, `reason`, `last_age_s`.
    fn unauthorized_peers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let peers = self.sink(py)?.unauthorized_peers();
        pythonize(py, &peers).map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// How long a batch waits for frees before it fails (`SGLANG_SPEC_CAPTURE_ARENA_WAIT_S`),
    /// in seconds.
    #[getter]
    fn arena_wait_s(&self, py: Python<'_>) -> PyResult<f64> {
        Ok(self.sink(py)?.config().arena_wait.as_secs_f64())
    }

    /// How long a synchronous caller waits for its batch to start
    /// (`SGLANG_SPEC_CAPTURE_SYNC_WAIT_S`), in seconds.
    #[getter]
    fn sync_wait_s(&self, py: Python<'_>) -> PyResult<f64> {
        Ok(self.sink(py)?.config().sync_wait.as_secs_f64())
    }

    /// Creates the arena and starts the writer now (GIL released), as the first capture would;
    /// nothing if it has started. A device arena whose GPU is not configured goes on `device`.
    #[pyo3(signature = (device=None))]
    fn _start(&self, py: Python<'_>, device: Option<i32>) -> PyResult<()> {
        let sink = self.sink(py)?;
        crate::exit::detach(py, || sink.start_on(device).map(|_| ())).py_err()
    }

    /// The writer's counters as a dict (all zero before the first capture).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        pythonize(py, &self.sink(py)?.stats()).map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// Resident objects per store_id, largest first: a list of dicts `store_id`, `objects`,
    /// `bytes`, `oldest_age_s` (who holds the arena, and since when).
    fn store_usage<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let sink = self.sink(py)?;
        let table = crate::exit::detach(py, || sink.store_usage());
        pythonize(py, &table).map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }

    /// Starts the writer over memory someone else owns and keeps alive (a Mooncake
    /// TransferEngine's registered or managed buffer): `length` bytes at `ptr`, host memory or,
    /// with `device`, memory of that GPU; results carry `session`. `owner` is kept referenced
    /// until the writer stops. Must come before the first capture.
    #[pyo3(signature = (ptr, length, session, owner, device=None))]
    fn _start_with_region(
        &self,
        py: Python<'_>,
        ptr: u64,
        length: u64,
        session: String,
        owner: Py<PyAny>,
        device: Option<i32>,
    ) -> PyResult<()> {
        let sink = self.sink(py)?;
        if ptr == 0 || length == 0 || ptr.checked_add(length).is_none() {
            return Err(to_py(Error::Config {
                var: "arena",
                reason: format!("{length} bytes at {ptr:#x} is not a memory range"),
            }));
        }
        let owner = Owner {
            owner: Some(owner),
            tx: Some((*self.tx).clone()),
        };
        let region: Box<dyn capture_arena::memory::Region> = match device {
            None => {
                let p = usize::try_from(ptr).map_err(|_| {
                    to_py(Error::Config {
                        var: "arena",
                        reason: format!("address {ptr:#x} does not fit this process"),
                    })
                })? as *mut u8;
                // SAFETY: the caller (capture_arena's engine placement) passes a buffer the
                // transfer engine allocated or a numpy array it registered, `length` bytes,
                // kept alive by `owner` until the writer drops the region. Writes into it from
                // elsewhere (a TransferEngine peer's write) would change published bytes but are
                // not undefined behaviour here: the writer only ever copies into it with raw
                // copies and never forms references to it.
                Box::new(
                    unsafe {
                        capture_arena::memory::ExternalHostRegion::new(p, length, session, owner)
                    }
                    .py_err()?,
                )
            }
            // SAFETY: as above, for device memory of GPU `d` (the engine's
            // allocate_managed_buffer on that GPU).
            Some(d) => Box::new(
                unsafe {
                    capture_arena::memory::cuda::ExternalDeviceRegion::new(
                        ptr, length, d, session, owner,
                    )
                }
                .py_err()?,
            ),
        };
        crate::exit::detach(py, || sink.start_with_region(region).map(|_| ())).py_err()
    }

    /// True once the first capture has created the arena.
    #[getter]
    fn started(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.sink(py)?.started().is_some())
    }

    /// The arena's session (what readers open), or None before the first capture.
    #[getter]
    fn session(&self, py: Python<'_>) -> PyResult<Option<String>> {
        Ok(self
            .sink(py)?
            .started()
            .map(|w| w.arena_ref().session.clone()))
    }

    /// The control endpoint `host:port`, or None before the first capture.
    #[getter]
    fn control(&self, py: Python<'_>) -> PyResult<Option<String>> {
        Ok(self
            .sink(py)?
            .started()
            .map(|w| w.arena_ref().control.clone()))
    }

    /// The arena size in bytes (`SGLANG_SPEC_CAPTURE_ARENA_BYTES` / `arena_bytes`), or None.
    #[getter]
    fn arena_bytes(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        Ok(self.sink(py)?.config().arena_bytes)
    }

    /// The configured publication mode: True under `nvlink`/`nvlink_intra` (or `gpu_put=True`):
    /// the arena is device memory.
    #[getter]
    fn device_publication(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.sink(py)?.config().device_publication())
    }

    /// The placement the configuration selects: `"arena"`, `"engine"` or `"store"`.
    #[getter]
    fn placement(&self, py: Python<'_>) -> PyResult<&'static str> {
        Ok(self.sink(py)?.config().placement().name())
    }

    /// `max_pending_batches=` / `SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES`.
    #[getter]
    fn max_pending_batches(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.sink(py)?.config().max_pending_batches)
    }

    /// `eager=` / `SGLANG_SPEC_CAPTURE_ARENA_EAGER`.
    #[getter]
    fn eager(&self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.sink(py)?.config().eager)
    }

    /// The configured arena GPU (`device=` / `SGLANG_SPEC_CAPTURE_ARENA_DEVICE`), or None.
    #[getter]
    fn device(&self, py: Python<'_>) -> PyResult<Option<i32>> {
        Ok(self.sink(py)?.config().device)
    }

    /// `MOONCAKE_PROTOCOL` (or the `protocol=` keyword), or None.
    #[getter]
    fn protocol(&self, py: Python<'_>) -> PyResult<Option<String>> {
        Ok(self.sink(py)?.config().protocol.clone())
    }

    /// Stops the writer and removes the arena once calls in flight in other threads return.
    /// Idempotent; the GIL is released while the writer stops.
    fn close(&self, py: Python<'_>) {
        self.close_sink(py, false);
    }

    /// As `close`, at interpreter exit: a shared-memory arena's name is removed at once even
    /// while a call in flight holds the sink (see [`remove_name_now`]).
    fn _close_at_exit(&self, py: Python<'_>) {
        self.close_sink(py, true);
    }

    /// At interpreter exit, with a thread still writing into the arena (so it is neither
    /// stopped nor unmapped): a shared-memory arena's name is removed (see [`remove_name_now`]),
    /// the sink left as it is.
    fn _remove_name_at_exit(&self) {
        if self.pid != std::process::id() {
            return;
        }
        let guard = self.sink.lock().unwrap_or_else(|p| p.into_inner());
        let memory = guard
            .as_ref()
            .and_then(|s| s.started().map(|w| w.memory_session().to_owned()));
        drop(guard);
        remove_name_now(memory.as_deref());
    }
}

impl PySink {
    fn close_sink(&self, py: Python<'_>, at_exit: bool) {
        if self.pid != std::process::id() {
            return;
        }
        let s = self.sink.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(s) = s {
            // If a call in another thread still holds the sink, the writer stops when that
            // call's hold goes (see `Held`); else here, without the GIL.
            let memory = s.started().map(|w| w.memory_session().to_owned());
            match Arc::into_inner(s) {
                Some(last) => py.detach(move || drop(last)),
                None if at_exit => remove_name_now(memory.as_deref()),
                None => {}
            }
        }
    }
}

/// A shared-memory arena closed at interpreter exit while a call in another thread still holds
/// the sink (or a thread still writes into it): its name is removed now, since that call never
/// lets go (one that comes back during the exit parks for good), and the name would outlive the
/// process in /dev/shm. Its mapping stays valid for the holder, and the memory goes with the
/// process; readers opening the
/// session afterwards get a stale-session error, as after any close (and trainers drop frees
/// for it). Not on an ordinary close: the call in flight may still publish, and its objects be
/// freed. Device and engine memory goes with the process.
fn remove_name_now(memory_session: Option<&str>) {
    let Some(session) =
        memory_session.and_then(|m| m.parse::<capture_arena::memory::ShmSession>().ok())
    else {
        return;
    };
    match capture_arena::memory::shm::remove(&session) {
        Ok(()) => tracing::info!(
            arena = %session.name,
            "exiting while another thread's call holds the sink or writes into its arena: the arena's name is removed now, its memory goes when that call lets go or the process ends"
        ),
        Err(e) => tracing::warn!(arena = %session.name, "removing the arena's name at close: {e}"),
    }
}

impl Drop for PySink {
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            // A forked child: the writer and helper threads and the arena are the parent's.
            // Running their destructors here would join threads that do not exist, unlink the
            // parent's shared memory, or take a channel lock the parent held at the fork.
            let s = self
                .sink
                .get_mut()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            std::mem::forget(s);
            return;
        }
        // SAFETY: `tx` is dropped exactly once, here, and never used afterwards.
        unsafe { ManuallyDrop::drop(&mut self.tx) };
        let s = self
            .sink
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(s) = s {
            // Stopping the writer waits for queued batches: do it without the GIL.
            Python::attach(|py| py.detach(move || drop(s)));
        }
    }
}

/// The same batch through the Rust API, for the Python-overhead benchmark: `n_samples` samples
/// of `n_tensors` bf16 tensors of `tensor_bytes` each, published `reps` times with replace into
/// `sink`'s arena. Returns seconds per batch (submit to results).
#[pyfunction]
#[pyo3(signature = (sink, n_samples, n_tensors, tensor_bytes, reps))]
pub fn _bench_rust_put(
    py: Python<'_>,
    sink: &Bound<'_, PySink>,
    n_samples: usize,
    n_tensors: usize,
    tensor_bytes: usize,
    reps: usize,
) -> PyResult<Vec<f64>> {
    #[derive(Clone)]
    struct Shared(Arc<Vec<u8>>);
    impl AsRef<[u8]> for Shared {
        fn as_ref(&self) -> &[u8] {
            &self.0
        }
    }
    // A benchmark's sizes: within what one sink can take, or refused before anything is made.
    let total = n_samples
        .checked_mul(n_tensors)
        .and_then(|n| n.checked_mul(tensor_bytes));
    if total.is_none_or(|t| t > 1 << 40) || reps > 1 << 20 {
        return Err(PyValueError::new_err(format!(
            "{n_samples} samples x {n_tensors} tensors x {tensor_bytes} bytes, {reps} reps: at \
             most 1 TiB in all and 2^20 reps"
        )));
    }
    let sink = sink.get().sink(py)?;
    crate::exit::detach(py, || -> capture_arena::Result<Vec<f64>> {
        let bufs: Vec<Shared> = (0..n_samples * n_tensors)
            .map(|i| Shared(Arc::new(vec![i as u8; tensor_bytes])))
            .collect();
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps {
            let t0 = Instant::now();
            let mut batch = Vec::with_capacity(n_samples);
            for i in 0..n_samples {
                let mut s = Sample::new("rust-bench", &format!("s{i}"), 1)?.with_replace(true);
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

/// A caller's bound in seconds as a duration: none below zero, and one too large (or not a
/// number) as no bound.
fn bound_of(seconds: f64) -> Duration {
    if seconds.is_nan() {
        return Duration::MAX;
    }
    Duration::try_from_secs_f64(seconds.max(0.0)).unwrap_or(Duration::MAX)
}
