//! `_Store`: the trainer side (wrapped by `capture_arena.ArenaFeatureStore`, which allocates the
//! output arrays).

use capture_arena::client::FeatureStore;
use capture_arena::{Destination, DeviceSlice, Error, Published};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pythonize::pythonize;

use crate::array::{bytes_of, device_of, disjoint};
use crate::error::{to_py, IntoPy};
use crate::value::{excerpt, MAX_ERROR_CHARS};

/// Sample ids one `flush_samples` call takes, at most (an optimizer window is far fewer).
const MAX_FLUSH_SAMPLES: usize = 1 << 20;

/// A published result from its dict; a failed one (`{"sample_id", "error"}`) is refused with its
/// error.
fn published(result: &Bound<'_, PyAny>) -> PyResult<Published> {
    if let Ok(err) = result.get_item("error") {
        // Both from the result: quoted within bounds.
        let id = result
            .get_item("sample_id")
            .map(|v| excerpt(&v.to_string(), 200))
            .unwrap_or_default();
        let err = excerpt(&err.to_string(), MAX_ERROR_CHARS);
        return Err(to_py(Error::InvalidRead {
            key: id,
            reason: format!("this sample failed to publish: {err}"),
        }));
    }
    crate::value::from_py(result).map_err(|e| {
        to_py(Error::InvalidRead {
            key: "result".into(),
            reason: format!("not a published-sample result: {e}"),
        })
    })
}

/// One output: name, address, length, and for a CUDA tensor its device and current stream.
type Target = (String, usize, usize, Option<(i32, u64)>);

/// The compiled store. Use `capture_arena.ArenaFeatureStore`.
#[pyclass(name = "_Store", module = "capture_arena._capture_arena", subclass)]
pub struct PyStore {
    store: FeatureStore,
}

#[pymethods]
impl PyStore {
    #[new]
    fn new() -> Self {
        PyStore {
            store: FeatureStore::new(),
        }
    }

    /// Copies features of `result` into caller memory: `targets` is a list of `(name, bytes)`
    /// where `bytes` is a writable C-contiguous uint8 numpy view of the output array. The copy
    /// runs with the GIL released.
    fn _read_into(
        &self,
        py: Python<'_>,
        result: &Bound<'_, PyAny>,
        targets: Vec<(String, Bound<'_, PyAny>)>,
    ) -> PyResult<()> {
        let p = published(result)?;
        let mut ptrs: Vec<Target> = Vec::with_capacity(targets.len());
        for (name, owner) in &targets {
            if let Some(d) = device_of(owner)? {
                let too_big = |_| {
                    to_py(Error::InvalidRead {
                        key: name.clone(),
                        reason: "the tensor does not fit this process's address space".into(),
                    })
                };
                let ptr = usize::try_from(d.ptr).map_err(too_big)?;
                let len = usize::try_from(d.len).map_err(too_big)?;
                ptrs.push((name.clone(), ptr, len, Some((d.device, d.stream))));
            } else {
                let (ptr, len) = bytes_of(owner, true)?;
                ptrs.push((name.clone(), ptr, len, None));
            }
        }
        let ranges: Vec<(usize, usize)> = ptrs.iter().map(|&(_, p, l, _)| (p, l)).collect();
        disjoint(py, &ranges)?;
        crate::exit::detach(py, || {
            let mut outs: Vec<(&str, Destination<'_>)> = ptrs
                .iter()
                .map(|(n, ptr, len, device)| {
                    let into = match device {
                        // SAFETY: (ptr, len, device) were read from a contiguous CUDA tensor in
                        // `targets`, which this call keeps referenced until it returns; the
                        // copy waits for the work already queued on the tensor's stream (torch's
                        // current stream of its device, read with it: a live stream of this
                        // process), and the read synchronises its copies before returning.
                        Some((d, stream)) => Destination::Device(unsafe {
                            DeviceSlice::new(*ptr as u64, *len as u64, *d).after(*stream)
                        }),
                        None if *len == 0 => Destination::Host(&mut []),
                        // SAFETY: (ptr, len) come from the array interface of a writable,
                        // C-contiguous uint8 array in `targets`, which this call keeps
                        // referenced until it returns. A numpy array's own buffer stays put
                        // while referenced; a view of another owner's storage (a torch CPU
                        // tensor's `.numpy()`) stays put by `get`'s documented contract (no
                        // thread resizes or frees an `out=` while it reads, docs/python.md).
                        // The ranges were checked pairwise disjoint above: no two slices alias.
                        None => Destination::Host(unsafe {
                            std::slice::from_raw_parts_mut(*ptr as *mut u8, *len)
                        }),
                    };
                    (n.as_str(), into)
                })
                .collect();
            self.store.get_many_to(&p, &mut outs)
        })
        .py_err()?;
        drop(targets);
        Ok(())
    }

    /// Frees every object of `result` over its control endpoint; later reads of it raise
    /// `ReleasedError` (a `KeyError`).
    fn release(&self, py: Python<'_>, result: &Bound<'_, PyAny>) -> PyResult<()> {
        let p = published(result)?;
        crate::exit::detach(py, || self.store.release(&p)).py_err()
    }

    /// Validates `result`, raises `ReleasedError` if it was released, and checks each of
    /// `names` against the arena (unknown name, shape or address outside it) before anything
    /// is allocated. Opening (mapping and pre-faulting) a new arena runs without the GIL.
    #[pyo3(signature = (result, names=None))]
    fn _check(
        &self,
        py: Python<'_>,
        result: &Bound<'_, PyAny>,
        names: Option<Vec<String>>,
    ) -> PyResult<()> {
        let p = published(result)?;
        let names = names.unwrap_or_default();
        crate::exit::detach(py, || {
            self.store.check(&p)?;
            let mut total = 0u64;
            for name in &names {
                total = total.saturating_add(self.store.reader().checked_len(&p, name)?);
            }
            // A real result's objects are disjoint: together they fit in the arena, so a forged
            // one (a feature under many names) cannot make the caller allocate more than that.
            let capacity = self.store.reader().open(&p.arena.session)?.capacity();
            if total > capacity {
                return Err(Error::InvalidRead {
                    key: p.sample_path(),
                    reason: format!(
                        "its features add up to {total} bytes, more than the {capacity}-byte \
                         arena holds"
                    ),
                });
            }
            Ok(())
        })
        .py_err()
    }

    /// Validates `result` (and that it was not released) and returns the byte length of each of
    /// `names`, without opening its session: for sessions read outside the compiled readers (a
    /// Mooncake TransferEngine's).
    fn _validate(
        &self,
        py: Python<'_>,
        result: &Bound<'_, PyAny>,
        names: Vec<String>,
    ) -> PyResult<Vec<u64>> {
        let p = published(result)?;
        crate::exit::detach(py, || {
            self.store.check(&p)?;
            let lens = names
                .iter()
                .map(|n| {
                    let f = p.features.get(n).ok_or_else(|| Error::UnknownFeature {
                        key: n.clone(),
                        available: p.features.keys().cloned().collect(),
                    })?;
                    f.byte_len().ok_or_else(|| Error::InvalidRead {
                        key: n.clone(),
                        reason: format!("shape {:?} overflows", f.shape),
                    })
                })
                .collect::<capture_arena::Result<Vec<u64>>>()?;
            objects_disjoint(&p, &names, &lens)?;
            Ok(lens)
        })
        .py_err()
    }

    /// Has the free senders send what waits, then waits up to `timeout_s` for all of it to go
    /// out (0: returns at once). Raises `FreeNotSentError` for an endpoint still waiting: known
    /// unreachable (in its back-off), or not done within `timeout_s`.
    #[pyo3(signature = (timeout_s=0.0))]
    fn flush(&self, py: Python<'_>, timeout_s: f64) -> PyResult<()> {
        let timeout = if timeout_s.is_finite() && timeout_s > 0.0 {
            std::time::Duration::from_secs_f64(timeout_s.min(3600.0))
        } else {
            std::time::Duration::ZERO
        };
        crate::exit::detach(py, || {
            if timeout.is_zero() {
                self.store.flush()
            } else {
                self.store.flush_within(timeout)
            }
        })
        .py_err()
    }

    /// As `flush`, for the frees of `sample_ids` of `store_id` only: frees of other samples
    /// (at an endpoint that does not answer, say) wait on without raising here.
    #[pyo3(signature = (store_id, sample_ids, timeout_s))]
    fn flush_samples(
        &self,
        py: Python<'_>,
        store_id: &str,
        sample_ids: Vec<String>,
        timeout_s: f64,
    ) -> PyResult<()> {
        if sample_ids.len() > MAX_FLUSH_SAMPLES {
            return Err(PyValueError::new_err(format!(
                "flush_samples: {} sample ids, more than the {MAX_FLUSH_SAMPLES} one call takes: flush in parts",
                sample_ids.len()
            )));
        }
        let timeout = if timeout_s.is_finite() && timeout_s > 0.0 {
            std::time::Duration::from_secs_f64(timeout_s.min(3600.0))
        } else {
            std::time::Duration::ZERO
        };
        let ids: Vec<&str> = sample_ids.iter().map(String::as_str).collect();
        crate::exit::detach(py, || {
            self.store.flush_samples_within(store_id, &ids, timeout)
        })
        .py_err()
    }

    /// `{"resident_samples", "resident_bytes", "pending_frees", "refused_frees",
    /// "dropped_frees", "open_sessions"}`.
    fn health<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let h = crate::exit::detach(py, || self.store.health());
        let d = serde_json::json!({
            "resident_samples": h.resident_samples,
            "resident_bytes": h.resident_bytes,
            "pending_frees": h.pending_frees,
            "refused_frees": h.refused_frees,
            "dropped_frees": h.dropped_frees,
            "open_sessions": h.open_sessions,
        });
        pythonize(py, &d).map_err(|e| PyRuntimeError::new_err(e.to_string()))
    }
}

/// A store-placement result as a reader takes it: ids and, per feature, shape and dtype.
#[derive(serde::Deserialize)]
struct StoreResult {
    store_id: String,
    sample_id: String,
    gen: u64,
    features: std::collections::BTreeMap<String, StoreFeature>,
}

#[derive(serde::Deserialize)]
struct StoreFeature {
    shape: Vec<u64>,
    dtype: capture_arena::Dtype,
    /// An arena result's: the stamp its object was published with.
    #[serde(default)]
    stamp: Option<u64>,
}

/// `(key, bytes)` of each of `names` in a store-placement result, validated first: ids (as key
/// parts), at most `MAX_FEATURES` features, ranks, dtypes, sizes that overflow, unknown names.
#[pyfunction]
pub fn _store_keys(result: &Bound<'_, PyAny>, names: Vec<String>) -> PyResult<Vec<(String, u64)>> {
    let bad = |reason: String| {
        to_py(Error::InvalidRead {
            key: "result".into(),
            reason,
        })
    };
    let r: StoreResult = crate::value::from_py(result)
        .map_err(|e| bad(format!("not a store-placement result: {e}")))?;
    if r.features.len() > capture_arena::sample::MAX_FEATURES {
        return Err(bad(format!(
            "{} features, more than the {} a result may have",
            r.features.len(),
            capture_arena::sample::MAX_FEATURES
        )));
    }
    names
        .iter()
        .map(|name| {
            let f = r.features.get(name).ok_or_else(|| {
                to_py(Error::UnknownFeature {
                    key: name.clone(),
                    available: r.features.keys().cloned().collect(),
                })
            })?;
            let key =
                capture_arena::key::store_key(&r.store_id, &r.sample_id, r.gen, name).py_err()?;
            if f.shape.len() > capture_arena::tensor::MAX_RANK {
                return Err(bad(format!("{key}: rank {} is too high", f.shape.len())));
            }
            let n = capture_arena::tensor::byte_len(&f.shape, f.dtype)
                .ok_or_else(|| bad(format!("{key}: shape {:?} overflows", f.shape)))?;
            Ok((key, n))
        })
        .collect()
}

/// The object keys of a result's features, each with its stamp where the result gives one
/// (arena results do), validated as by [`_result_keys`].
#[pyfunction]
pub fn _result_stamped_keys(result: &Bound<'_, PyAny>) -> PyResult<Vec<(String, Option<u64>)>> {
    let r = result_of(result)?;
    // Keys come in the features' (sorted) order, as the map holds them.
    Ok(keys_of(&r, false)?
        .into_iter()
        .zip(r.features.values().map(|f| f.stamp))
        .collect())
}

/// The object keys of a result's features (`{store_id}/{sample_id}/g{gen}/{name}`, parts
/// escaped as the arena escapes them; the Mooncake store's keys with `store=True`), validated.
#[pyfunction]
#[pyo3(signature = (result, store=false))]
pub fn _result_keys(result: &Bound<'_, PyAny>, store: bool) -> PyResult<Vec<String>> {
    keys_of(&result_of(result)?, store)
}

/// A result read from Python, with at most `MAX_FEATURES` features.
fn result_of(result: &Bound<'_, PyAny>) -> PyResult<StoreResult> {
    let r: StoreResult = crate::value::from_py(result).map_err(|e| {
        to_py(Error::InvalidRead {
            key: "result".into(),
            reason: format!("not a result: {e}"),
        })
    })?;
    if r.features.len() > capture_arena::sample::MAX_FEATURES {
        return Err(to_py(Error::InvalidRead {
            key: "result".into(),
            reason: format!("{} features, more than a result may have", r.features.len()),
        }));
    }
    Ok(r)
}

/// The keys of `r`'s features, validated as key parts (the store's keys with `store`).
fn keys_of(r: &StoreResult, store: bool) -> PyResult<Vec<String>> {
    r.features
        .keys()
        .map(|name| {
            if store {
                capture_arena::key::store_key(&r.store_id, &r.sample_id, r.gen, name).py_err()
            } else {
                capture_arena::Key::new(&r.store_id, &r.sample_id, r.gen, name)
                    .map(|k| k.as_str().to_owned())
                    .py_err()
            }
        })
        .collect()
}

/// The most memory this process may use, and whose limit it is (the core's
/// `limits::memory_limit`: the host's, or its cgroup's where lower; read once).
#[pyfunction]
pub fn _memory_limit() -> (u64, &'static str) {
    capture_arena::limits::memory_limit()
}

/// Asks a control endpoint for its stats answer once (the Rust core's `client::StatsQuery`),
/// with the GIL released: `{"stats", "stores", "stores_total", "pid", "unauthorized_peers"}`.
#[pyfunction]
#[pyo3(signature = (control, token=None, timeout_s=2.0))]
pub fn _stats_query<'py>(
    py: Python<'py>,
    control: String,
    token: Option<String>,
    timeout_s: f64,
) -> PyResult<Bound<'py, PyAny>> {
    let timeout = std::time::Duration::try_from_secs_f64(timeout_s.max(0.001))
        .unwrap_or(std::time::Duration::MAX);
    let report = crate::exit::detach(py, || {
        capture_arena::client::StatsQuery::connect(&control, token.as_deref(), timeout)?.ask()
    })
    .py_err()?;
    pythonize(py, &report).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// Whether `token` is a control token (the core's `limits::is_valid_token`): what a client may
/// present.
#[pyfunction]
pub fn _is_valid_token(token: &str) -> bool {
    capture_arena::limits::is_valid_token(token)
}

/// Frees keys and everything under prefixes at a control endpoint, once (the Rust core's
/// `client::send_frees`), with the GIL released.
#[pyfunction]
#[pyo3(signature = (control, keys, prefixes, token=None, timeout_s=5.0))]
pub fn _send_frees(
    py: Python<'_>,
    control: String,
    keys: Vec<String>,
    prefixes: Vec<String>,
    token: Option<String>,
    timeout_s: f64,
) -> PyResult<()> {
    let keys = keys
        .iter()
        .map(|k| k.parse::<capture_arena::Key>())
        .collect::<capture_arena::Result<Vec<_>>>()
        .py_err()?;
    let timeout = std::time::Duration::try_from_secs_f64(timeout_s).map_err(|_| {
        to_py(Error::InvalidRead {
            key: control.clone(),
            reason: format!("timeout_s {timeout_s} is not a number of seconds >= 0"),
        })
    })?;
    crate::exit::detach(py, || {
        capture_arena::client::send_frees(&control, token.as_deref(), &keys, &prefixes, timeout)
    })
    .py_err()
}

/// Refuses a result whose features `names` (of `lens` bytes) overlap: real objects are
/// disjoint, and a session that carries no length (a TransferEngine's) bounds nothing else, so
/// one object named many times would be allocated for, registered and copied as many times.
fn objects_disjoint(p: &Published, names: &[String], lens: &[u64]) -> capture_arena::Result<()> {
    let mut spans: std::collections::BTreeMap<&str, (u64, u64)> = std::collections::BTreeMap::new();
    for (name, &len) in names.iter().zip(lens) {
        if let Some(f) = p.features.get(name).filter(|_| len > 0) {
            spans.insert(name, (f.address, len));
        }
    }
    let mut by_address: Vec<(u64, u64, &str)> =
        spans.into_iter().map(|(n, (a, l))| (a, l, n)).collect();
    by_address.sort_unstable();
    for w in by_address.windows(2) {
        let ((a, l, first), (b, _, second)) = (w[0], w[1]);
        if a.saturating_add(l) > b {
            return Err(Error::InvalidRead {
                key: second.to_owned(),
                reason: format!(
                    "its bytes at {b:#x} overlap those of {first:?} ({a:#x}, {l} bytes): a result's \
                     objects are disjoint, so this result is not one a producer made"
                ),
            });
        }
    }
    Ok(())
}
