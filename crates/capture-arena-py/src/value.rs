//! Small Python objects (specs, descriptors) read into Rust types through a JSON value.
//!
//! `pythonize::depythonize` first asks every mapping whether it is a dataclass
//! (`getattr(obj, "__dataclass_fields__")`), which on a dict raises and formats an
//! `AttributeError` that is then thrown away: about half of what reserving one request cost on
//! vLLM's thread (four dicts a spec). Plain dicts, lists, tuples, strings, numbers, booleans and
//! None are read here by their exact types, and other strings, integers (numpy's too), mappings
//! and sequences (a `range`, a `MappingProxyType`) by what they are, within the same bounds (a
//! sequence's length is checked before any of it is read, so one that claims 2^40 items costs
//! nothing), sets as sequences, dataclasses by their fields, and any other number (a numpy
//! float) by `float()`; anything else is refused. Every level counts against the same depth and
//! value bounds (`pythonize::depythonize`, used before for the rest, has neither: a list nested
//! 300,000 deep overflowed the stack).

use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyFrozenSet, PyInt, PyList, PyMapping,
    PySequence, PySet, PyString, PyTuple,
};
use serde::de::DeserializeOwned;
use serde_json::Value;

/// How deeply nested an object may be (a spec is four levels deep).
const MAX_DEPTH: usize = 32;

/// How many values an object may hold in all (a spec holds about twenty): a list referenced
/// many times is read as often, so shared references cannot make a small object cost more.
const MAX_VALUES: usize = 1 << 16;

/// Items made room for before they are read, at most: a length within a large bound (a
/// passthrough's shape) may still be one a sequence claims without having the items.
const PREALLOCATED: usize = 1 << 16;

/// `obj` as a `T` (the way serde reads the JSON `obj` would be); the reason otherwise.
pub(crate) fn from_py<T: DeserializeOwned>(obj: &Bound<'_, PyAny>) -> Result<T, String> {
    from_py_within(obj, MAX_DEPTH, MAX_VALUES)
}

/// As [`from_py`], with `obj` nested at most `depth` levels deep and holding at most `values`
/// values in all (containers included).
pub(crate) fn from_py_within<T: DeserializeOwned>(
    obj: &Bound<'_, PyAny>,
    depth: usize,
    values: usize,
) -> Result<T, String> {
    let mut r = Reading {
        max_depth: depth,
        max_values: values,
        budget: values,
    };
    // serde quotes a value of the wrong type whole ("invalid type: string \"...\""): bounded, so
    // that a 100 MB id makes an error of a few hundred bytes.
    serde_json::from_value(r.value(obj, 0)?).map_err(|e| excerpt(&e.to_string(), MAX_ERROR_CHARS))
}

/// The characters of outside input an error message quotes, at most.
pub(crate) const MAX_ERROR_CHARS: usize = 500;

/// `text` as an error message may quote it: at most `max` characters, the rest counted.
pub(crate) fn excerpt(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        None => text.to_owned(),
        Some((cut, _)) => {
            let rest = text[cut..].chars().count();
            format!("{}... ({rest} more characters)", &text[..cut])
        }
    }
}

/// The bounds of one reading, and the values left.
struct Reading {
    max_depth: usize,
    max_values: usize,
    budget: usize,
}

impl Reading {
    fn value(&mut self, obj: &Bound<'_, PyAny>, depth: usize) -> Result<Value, String> {
        if depth > self.max_depth {
            return Err(format!("nested more than {} levels deep", self.max_depth));
        }
        if self.budget == 0 {
            return Err(format!("more than {} values in all", self.max_values));
        }
        self.budget -= 1;
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
            // Counted before the snapshot below is made of it.
            self.check_len(d.len())?;
            let mut map = serde_json::Map::new();
            // A snapshot of the items: reading a value may run code (a dataclass's property, a
            // number's `__float__`) that changes the dict, which pyo3's iterator would panic on.
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
                map.insert(k, self.value(&v, depth + 1)?);
            }
            return Ok(Value::Object(map));
        }
        if let Ok(l) = obj.cast_exact::<PyList>() {
            return l.iter().map(|v| self.value(&v, depth + 1)).collect();
        }
        if let Ok(t) = obj.cast_exact::<PyTuple>() {
            return t.iter().map(|v| self.value(&v, depth + 1)).collect();
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
            // Its length before its items are made, and theirs (a mapping may say less).
            self.check_len(m.len().map_err(|e| e.to_string())?)?;
            let items = m.items().map_err(|e| e.to_string())?;
            self.check_len(items.len())?;
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
                map.insert(k, self.value(&v, depth + 1)?);
            }
            return Ok(Value::Object(map));
        }
        if let (Ok(seq), false) = (obj.cast::<PySequence>(), bytes_like) {
            let n = seq.len().map_err(|e| e.to_string())?;
            self.check_len(n)?;
            let mut out = Vec::with_capacity(n.min(PREALLOCATED));
            for i in 0..n {
                let v = seq.get_item(i).map_err(|e| e.to_string())?;
                out.push(self.value(&v, depth + 1)?);
            }
            return Ok(Value::Array(out));
        }
        if obj.is_instance_of::<PySet>() || obj.is_instance_of::<PyFrozenSet>() {
            let n = obj.len().map_err(|e| e.to_string())?;
            self.check_len(n)?;
            let mut out = Vec::with_capacity(n.min(PREALLOCATED));
            for v in obj.try_iter().map_err(|e| e.to_string())? {
                let v = v.map_err(|e| e.to_string())?;
                out.push(self.value(&v, depth + 1)?);
                if out.len() > n {
                    return Err("a set that grew while it was read".to_owned());
                }
            }
            return Ok(Value::Array(out));
        }
        let py = obj.py();
        if let Ok(fields) = obj.getattr(pyo3::intern!(py, "__dataclass_fields__")) {
            // A dataclass instance: its fields by name, as pythonize reads them.
            let fields = fields
                .cast_exact::<PyDict>()
                .map_err(|_| "a dataclass whose fields are not a dict".to_owned())?;
            self.check_len(fields.len())?;
            let mut map = serde_json::Map::with_capacity(fields.len());
            for k in fields.keys() {
                let name = k
                    .cast_exact::<PyString>()
                    .map_err(|_| "a dataclass field name is not a string".to_owned())?
                    .to_str()
                    .map_err(|e| e.to_string())?
                    .to_owned();
                let v = obj.getattr(name.as_str()).map_err(|e| e.to_string())?;
                map.insert(name, self.value(&v, depth + 1)?);
            }
            return Ok(Value::Object(map));
        }
        let sized = obj.hasattr(pyo3::intern!(py, "__len__")).unwrap_or(true);
        if !sized && obj.hasattr(pyo3::intern!(py, "__float__")).unwrap_or(false) {
            // Another number (a numpy float; not an array, whose `float()` takes one element).
            let f: f64 = obj.extract().map_err(|e: PyErr| e.to_string())?;
            return serde_json::Number::from_f64(f)
                .map(Value::Number)
                .ok_or_else(|| format!("{f} is not a finite number"));
        }
        let kind = obj
            .get_type()
            .name()
            .map_or_else(|_| "?".to_owned(), |n| n.to_string());
        Err(format!(
            "a {kind} cannot be read (expected None, a string, a number, a boolean, a list, a \
         tuple, a set, a dict or a dataclass)"
        ))
    }

    /// Refuses a mapping or sequence of `n` items when the values left cannot hold them, before any
    /// is read.
    fn check_len(&self, n: usize) -> Result<(), String> {
        if n > self.budget {
            return Err(format!(
                "{n} items, more than the {} values an object may hold in all",
                self.max_values
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::excerpt;

    #[test]
    fn an_excerpt_keeps_what_fits_and_counts_the_rest_by_characters() {
        assert_eq!(excerpt("abc", 3), "abc");
        assert_eq!(excerpt("abcd", 3), "abc... (1 more characters)");
        // Multi-byte characters are never cut in half.
        assert_eq!(excerpt("ééé", 2), "éé... (1 more characters)");
        let big = "x".repeat(10_000_000);
        assert_eq!(
            excerpt(&big, 500).len(),
            500 + "... (9999500 more characters)".len()
        );
    }
}
