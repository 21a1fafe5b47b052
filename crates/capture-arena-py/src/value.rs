//! Small Python objects (specs, descriptors) read into Rust types through a JSON value.
//!
//! `pythonize::depythonize` first asks every mapping whether it is a dataclass
//! (`getattr(obj, "__dataclass_fields__")`), which on a dict raises and formats an
//! `AttributeError` that is then thrown away: about half of what reserving one request cost on
//! vLLM's thread (four dicts a spec). Plain dicts, lists, tuples, strings, numbers, booleans and
//! None are read here by their exact types; anything else (a dataclass, a numpy integer) still
//! goes through `depythonize`.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde::de::DeserializeOwned;
use serde_json::Value;

/// How deeply nested an object may be (a spec is four levels deep).
const MAX_DEPTH: usize = 32;

/// How many values an object may hold in all (a spec holds about twenty): a list referenced
/// many times is read as often, so shared references cannot make a small object cost more.
const MAX_VALUES: usize = 1 << 16;

/// `obj` as a `T` (the way serde reads the JSON `obj` would be); the reason otherwise.
pub(crate) fn from_py<T: DeserializeOwned>(obj: &Bound<'_, PyAny>) -> Result<T, String> {
    let mut budget = MAX_VALUES;
    serde_json::from_value(value(obj, 0, &mut budget)?).map_err(|e| e.to_string())
}

fn value(obj: &Bound<'_, PyAny>, depth: usize, budget: &mut usize) -> Result<Value, String> {
    if depth > MAX_DEPTH {
        return Err(format!("nested more than {MAX_DEPTH} levels deep"));
    }
    if *budget == 0 {
        return Err(format!("more than {MAX_VALUES} values in all"));
    }
    *budget -= 1;
    if obj.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(s) = obj.cast_exact::<PyString>() {
        return s
            .to_str()
            .map(|s| Value::String(s.to_owned()))
            .map_err(|e| e.to_string());
    }
    if obj.is_exact_instance_of::<PyBool>() {
        return Ok(Value::Bool(obj.is_truthy().map_err(|e| e.to_string())?));
    }
    if obj.is_exact_instance_of::<PyInt>() {
        if let Ok(u) = obj.extract::<u64>() {
            return Ok(Value::from(u));
        }
        return obj
            .extract::<i64>()
            .map(Value::from)
            .map_err(|_| format!("{obj} is out of the 64-bit range"));
    }
    if obj.is_exact_instance_of::<PyFloat>() {
        let f: f64 = obj.extract().map_err(|e: PyErr| e.to_string())?;
        return serde_json::Number::from_f64(f)
            .map(Value::Number)
            .ok_or_else(|| format!("{f} is not a finite number"));
    }
    if let Ok(d) = obj.cast_exact::<PyDict>() {
        let mut map = serde_json::Map::with_capacity(d.len());
        // A snapshot of the items: a value read through depythonize may run code that changes
        // the dict, which pyo3's iterator would panic on.
        let items = d.items();
        for item in items.iter() {
            let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) =
                item.extract().map_err(|e: PyErr| e.to_string())?;
            let k = k
                .cast_exact::<PyString>()
                .map_err(|_| format!("a key is not a string: {k}"))?
                .to_str()
                .map_err(|e| e.to_string())?
                .to_owned();
            map.insert(k, value(&v, depth + 1, budget)?);
        }
        return Ok(Value::Object(map));
    }
    if let Ok(l) = obj.cast_exact::<PyList>() {
        return l.iter().map(|v| value(&v, depth + 1, budget)).collect();
    }
    if let Ok(t) = obj.cast_exact::<PyTuple>() {
        return t.iter().map(|v| value(&v, depth + 1, budget)).collect();
    }
    pythonize::depythonize(obj).map_err(|e| e.to_string())
}
