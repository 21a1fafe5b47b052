//! Small Python objects (specs, descriptors) read into Rust types through a JSON value.
//!
//! `pythonize::depythonize` first asks every mapping whether it is a dataclass
//! (`getattr(obj, "__dataclass_fields__")`), which on a dict raises and formats an
//! `AttributeError` that is then thrown away: about half of what reserving one request cost on
//! vLLM's thread (four dicts a spec). Plain dicts, lists, tuples, strings, numbers, booleans and
//! None are read here by their exact types, and other strings, integers (numpy's too), mappings
//! and sequences (a `range`, a `MappingProxyType`) by what they are, within the same bounds (a
//! sequence's length is checked before any of it is read, so one that claims 2^40 items costs
//! nothing); anything else (a dataclass, a numpy float) still goes through `depythonize`.

use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyMapping, PySequence, PyString,
    PyTuple,
};
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
    if let Ok(s) = obj.cast::<PyString>() {
        // A subclass of str: its text (never iterated as a sequence of characters).
        return s
            .to_str()
            .map(|s| Value::String(s.to_owned()))
            .map_err(|e| e.to_string());
    }
    // An int subclass, or any integer that says so (`__index__`: numpy's, a result that went
    // through pandas or datasets).
    if !obj.is_instance_of::<PyBool>()
        && (obj.is_instance_of::<PyInt>() || obj.hasattr("__index__").unwrap_or(false))
    {
        if let Ok(u) = obj.extract::<u64>() {
            return Ok(Value::from(u));
        }
        if let Ok(i) = obj.extract::<i64>() {
            return Ok(Value::from(i));
        }
        if obj.is_instance_of::<PyInt>() {
            return Err("an integer out of the 64-bit range".to_owned());
        }
        // Something else with `__index__` (an array): read as what else it is.
    }
    let bytes_like = obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<PyByteArray>();
    if let Ok(m) = obj.cast::<PyMapping>() {
        let items = m.items().map_err(|e| e.to_string())?;
        check_len(items.len(), budget)?;
        let mut map = serde_json::Map::new();
        for item in items.iter() {
            let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) =
                item.extract().map_err(|e: PyErr| e.to_string())?;
            let k = k
                .cast::<PyString>()
                .map_err(|_| "a key is not a string".to_owned())?
                .to_str()
                .map_err(|e| e.to_string())?
                .to_owned();
            map.insert(k, value(&v, depth + 1, budget)?);
        }
        return Ok(Value::Object(map));
    }
    if let (Ok(seq), false) = (obj.cast::<PySequence>(), bytes_like) {
        let n = seq.len().map_err(|e| e.to_string())?;
        check_len(n, budget)?;
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let v = seq.get_item(i).map_err(|e| e.to_string())?;
            out.push(value(&v, depth + 1, budget)?);
        }
        return Ok(Value::Array(out));
    }
    pythonize::depythonize(obj).map_err(|e| e.to_string())
}

/// Refuses a mapping or sequence of `n` items when the values left cannot hold them, before any
/// is read.
fn check_len(n: usize, budget: &usize) -> Result<(), String> {
    if n > *budget {
        return Err(format!(
            "{n} items, more than the {MAX_VALUES} values an object may hold in all"
        ));
    }
    Ok(())
}
