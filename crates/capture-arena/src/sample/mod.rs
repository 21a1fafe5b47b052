//! Samples in and results out: the capture contract's request (`spec`) and the validated
//! [`Sample`] the writer publishes (here), the per-sample result JSON ([`result`], whose
//! types are re-exported here), and the objects whose submitters write their bytes themselves
//! ([`reserved`]).

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::key::{self, Key};
use crate::tensor::{byte_len, Dtype, Tensor, TensorData};

pub mod reserved;
pub mod result;

pub use reserved::{ReservedObjects, Written};
pub use result::{
    batch_results, stamp_offset, ArenaRef, Failed, Feature, Published, SampleResult, StampWord,
    FAILED_BIT, MAX_ENDPOINT_BYTES, MAX_FEATURES, MAX_SESSION_BYTES, MAX_STAMP, PENDING_BIT,
    STAMP_BYTES,
};

/// The per-sample request of the capture contract, as the inference server sends it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleSpec {
    /// Trainer store namespace.
    pub store_id: String,
    /// Unique per sample.
    pub sample_id: String,
    /// Generation; server capture always uses 1.
    #[serde(default = "one")]
    pub gen: u64,
    /// True on a retry: existing objects under the same keys are freed first.
    #[serde(default)]
    pub replace: bool,
    /// Which captured artifacts to store, under which feature name.
    #[serde(default)]
    pub features: SpecFeatures,
    /// Tensors built from the request itself (`input_ids`, `loss_mask`).
    #[serde(default)]
    pub passthrough: Vec<PassthroughSpec>,
}

fn one() -> u64 {
    1
}

/// Artifact -> feature name. Either may be absent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SpecFeatures {
    /// Feature name for the aux hidden states (`[L, k*H]`, stored as `[1, L, k*H]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aux: Option<String>,
    /// Feature name for the last hidden state (`[L, H]`, stored as `[1, L, H]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_hidden: Option<String>,
}

/// A tensor carried in the request: flat (or nested) list of numbers, shape and dtype name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PassthroughSpec {
    /// Feature name.
    pub name: String,
    /// The values, row-major; nested lists are flattened. May be null when the bytes come
    /// separately (see [`Sample::from_spec_parts`]).
    #[serde(default)]
    pub data: Value,
    /// The declared shape.
    pub shape: Vec<u64>,
    /// A contract dtype name.
    pub dtype: String,
}

/// A tensor captured by the server (`aux` or `last_hidden`), without the leading batch dimension.
#[derive(Debug)]
pub struct Captured {
    /// `[L, W]` as captured.
    pub shape: Vec<u64>,
    /// Element type.
    pub dtype: Dtype,
    /// The bytes.
    pub data: TensorData,
}

/// One sample ready to publish: validated keys, unique names, lengths matching shapes.
#[derive(Debug)]
pub struct Sample {
    pub(crate) store_id: String,
    pub(crate) sample_id: String,
    pub(crate) gen: u64,
    pub(crate) replace: bool,
    pub(crate) aux_layer_ids: Option<Vec<i64>>,
    pub(crate) tensors: Vec<(Key, Tensor)>,
}

impl Sample {
    /// An empty sample. Its ids are checked here (as parts of a key).
    ///
    /// # Errors
    /// [`Error::InvalidKey`] for an empty id, a `/` or control character in it, or `gen < 1`.
    pub fn new(store_id: &str, sample_id: &str, gen: u64) -> Result<Sample> {
        key::check_sample(store_id, sample_id, gen)?;
        Ok(Sample {
            store_id: store_id.to_owned(),
            sample_id: sample_id.to_owned(),
            gen,
            replace: false,
            aux_layer_ids: None,
            tensors: Vec::new(),
        })
    }

    /// Frees objects already resident under this sample's keys before publishing (a retry).
    pub fn with_replace(mut self, replace: bool) -> Sample {
        self.replace = replace;
        self
    }

    /// The target layers the aux hidden states came from, echoed in the result.
    pub fn with_aux_layer_ids(mut self, ids: Option<Vec<i64>>) -> Sample {
        self.aux_layer_ids = ids;
        self
    }

    /// Adds a tensor.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] for a bad name, [`Error::InvalidSample`] for a duplicate name or
    /// one tensor more than a result may name ([`MAX_FEATURES`]: every reader refuses a result
    /// with more, so its objects could never be read or released).
    pub fn push(&mut self, tensor: Tensor) -> Result<()> {
        if self.tensors.len() >= MAX_FEATURES {
            return Err(Error::sample(
                &self.sample_id,
                format!(
                    "more than {MAX_FEATURES} tensors (a result names at most {MAX_FEATURES} \
                     features; readers refuse more): publish fewer passthrough tensors"
                ),
            ));
        }
        let key = Key::new(&self.store_id, &self.sample_id, self.gen, &tensor.name)?;
        if self.tensors.iter().any(|(k, _)| k == &key) {
            return Err(Error::sample(
                &self.sample_id,
                format!("feature {:?} appears twice", tensor.name),
            ));
        }
        self.tensors.push((key, tensor));
        Ok(())
    }

    /// Builds a sample from the contract's request and the captured tensors, checking everything
    /// before anything is written.
    ///
    /// # Errors
    /// [`Error::InvalidSample`] when `aux` (or `last_hidden`) is requested but not captured, a
    /// captured tensor is not `[L, width]`, `aux` and `last_hidden` disagree on `L`, a
    /// passthrough dtype is outside the contract, or data does not match its shape;
    /// [`Error::InvalidKey`] for bad ids or names.
    pub fn from_spec(
        spec: &SampleSpec,
        aux: Option<Captured>,
        last_hidden: Option<Captured>,
        aux_layer_ids: Option<Vec<i64>>,
    ) -> Result<Sample> {
        Sample::from_spec_parts(spec, aux, last_hidden, aux_layer_ids, HashMap::new())
    }

    /// As [`Sample::from_spec`], with the bytes of some passthrough tensors given directly
    /// (`name -> bytes`, e.g. an array the server already holds) instead of as JSON numbers in
    /// their `data`. Such bytes must have the declared dtype and as many elements as the declared
    /// shape.
    ///
    /// # Errors
    /// As [`Sample::from_spec`], plus a dtype or element count that differs from the declaration,
    /// or bytes for a name that is not a passthrough of the spec.
    pub fn from_spec_parts(
        spec: &SampleSpec,
        aux: Option<Captured>,
        last_hidden: Option<Captured>,
        aux_layer_ids: Option<Vec<i64>>,
        mut passthrough_bytes: HashMap<String, Captured>,
    ) -> Result<Sample> {
        let mut s = Sample::new(&spec.store_id, &spec.sample_id, spec.gen)?
            .with_replace(spec.replace)
            .with_aux_layer_ids(aux_layer_ids);
        let id = spec.sample_id.as_str();
        check_captured(id, &aux, &last_hidden)?;
        for (artifact, name, captured) in [
            ("aux", &spec.features.aux, aux),
            ("last_hidden", &spec.features.last_hidden, last_hidden),
        ] {
            let Some(name) = name else { continue };
            let Some(c) = captured else {
                return Err(Error::sample(
                    id,
                    format!("{artifact} requested as feature {name:?} but not captured"),
                ));
            };
            let mut shape = Vec::with_capacity(c.shape.len() + 1);
            shape.push(1);
            shape.extend_from_slice(&c.shape);
            s.push(
                Tensor::new(name.clone(), shape, c.dtype, c.data)
                    .map_err(|e| Error::sample(id, e.to_string()))?,
            )?;
        }
        for p in &spec.passthrough {
            let dtype = Dtype::from_name(&p.dtype).ok_or_else(|| {
                Error::sample(
                    id,
                    format!(
                        "passthrough {:?}: unsupported dtype {:?} (supported: {})",
                        p.name,
                        p.dtype,
                        Dtype::ALL.map(Dtype::name).join(", ")
                    ),
                )
            })?;
            let data = match passthrough_bytes.remove(&p.name) {
                Some(c) => {
                    let count =
                        |shape: &[u64]| shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
                    if c.dtype != dtype || count(&c.shape) != count(&p.shape) {
                        return Err(Error::sample(
                            id,
                            format!(
                                "passthrough {:?}: data is {:?} of {} but the spec declares {:?} of {}",
                                p.name, c.shape, c.dtype, p.shape, p.dtype
                            ),
                        ));
                    }
                    c.data
                }
                None => TensorData::host(
                    encode_values(&p.data, &p.shape, dtype)
                        .map_err(|r| Error::sample(id, format!("passthrough {:?}: {r}", p.name)))?,
                ),
            };
            s.push(
                Tensor::new(p.name.clone(), p.shape.clone(), dtype, data)
                    .map_err(|e| Error::sample(id, e.to_string()))?,
            )?;
        }
        if let Some(name) = passthrough_bytes.keys().next() {
            return Err(Error::sample(
                id,
                format!("bytes given for {name:?}, which is not a passthrough of this spec"),
            ));
        }
        Ok(s)
    }

    /// The sample id.
    pub fn sample_id(&self) -> &str {
        &self.sample_id
    }

    /// The store id.
    pub fn store_id(&self) -> &str {
        &self.store_id
    }

    /// The generation.
    pub fn gen(&self) -> u64 {
        self.gen
    }

    /// True if objects already resident under its keys are to be replaced.
    pub fn replace(&self) -> bool {
        self.replace
    }

    /// The target layers echoed in the result.
    pub fn aux_layer_ids(&self) -> Option<&[i64]> {
        self.aux_layer_ids.as_deref()
    }

    /// Its objects: key and tensor, in the order they were added.
    pub fn tensors(&self) -> impl Iterator<Item = (&Key, &Tensor)> {
        self.tensors.iter().map(|(k, t)| (k, t))
    }

    /// The keys of this sample's objects.
    pub fn keys(&self) -> impl Iterator<Item = &Key> {
        self.tensors.iter().map(|(k, _)| k)
    }

    /// Total tensor bytes (before alignment).
    pub fn byte_len(&self) -> u64 {
        self.tensors.iter().map(|(_, t)| t.byte_len()).sum()
    }
}

/// Checks that captured tensors are `[L, width]` and agree on `L` (they come from one prefill).
fn check_captured(id: &str, aux: &Option<Captured>, last: &Option<Captured>) -> Result<()> {
    for (artifact, c, want) in [("aux", aux, "[L, k*H]"), ("last_hidden", last, "[L, H]")] {
        if let Some(c) = c {
            if c.shape.len() != 2 {
                return Err(Error::sample(
                    id,
                    format!(
                        "{artifact} must be {want} (2-D, stored as [1, ...]) but has shape {:?}",
                        c.shape
                    ),
                ));
            }
        }
    }
    if let (Some(a), Some(l)) = (aux, last) {
        if a.shape[0] != l.shape[0] {
            return Err(Error::sample(
                id,
                format!(
                    "aux has {} tokens ({:?}) but last_hidden has {} ({:?}); both come from one \
                     prefill",
                    a.shape[0], a.shape, l.shape[0], l.shape
                ),
            ));
        }
    }
    Ok(())
}

/// Encodes integers as little-endian bytes of `dtype` (an integer or bool dtype), checking each
/// value's range: the typed path for passthrough lists that callers already hold as integers.
///
/// # Errors
/// The first value out of range for `dtype` (with its index), or a float `dtype`.
pub fn encode_ints(values: &[i64], dtype: Dtype) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(values.len() * dtype.item_size() as usize);
    macro_rules! each {
        ($t:ty) => {{
            for (i, &v) in values.iter().enumerate() {
                let x = <$t>::try_from(v)
                    .map_err(|_| format!("element {i}: {v} out of range for {dtype}"))?;
                out.extend_from_slice(&x.to_le_bytes());
            }
        }};
    }
    match dtype {
        Dtype::Int64 => {
            for v in values {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        Dtype::Int32 => each!(i32),
        Dtype::Int16 => each!(i16),
        Dtype::Int8 => each!(i8),
        Dtype::Uint8 => each!(u8),
        Dtype::Bool => {
            for (i, &v) in values.iter().enumerate() {
                match v {
                    0 | 1 => out.push(v as u8),
                    _ => return Err(format!("element {i}: {v} is not a bool (0/1/true/false)")),
                }
            }
        }
        Dtype::Float32 | Dtype::Float64 | Dtype::Float16 | Dtype::Bfloat16 => {
            return Err(format!("{dtype} is not an integer dtype"))
        }
    }
    Ok(out)
}

/// Encodes JSON numbers (a flat or nested list) into little-endian bytes of `dtype`, checking the
/// count against `shape`.
fn encode_values(data: &Value, shape: &[u64], dtype: Dtype) -> Result<Vec<u8>, String> {
    let want = byte_len(shape, dtype).ok_or_else(|| format!("shape {shape:?} overflows"))?;
    // Count first: a shape that claims far more than the data provides fails here, before any
    // allocation of its size.
    let elements = count_leaves(data);
    let needed = want / dtype.item_size();
    if elements != needed {
        return Err(format!(
            "data has {elements} elements but shape {shape:?} needs {needed}"
        ));
    }
    let mut out = Vec::with_capacity(usize::try_from(want).map_err(|_| "too large")?);
    let mut stack = vec![data];
    let mut count = 0u64;
    // Depth-first, left to right: push children reversed.
    while let Some(v) = stack.pop() {
        match v {
            Value::Array(items) => stack.extend(items.iter().rev()),
            v => {
                encode_one(v, dtype, &mut out).map_err(|r| format!("element {count}: {r}"))?;
                count += 1;
            }
        }
    }
    debug_assert_eq!(out.len() as u64, want);
    Ok(out)
}

/// Numbers in a (nested) JSON list; a scalar counts as one.
fn count_leaves(v: &Value) -> u64 {
    let mut n = 0;
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        match v {
            Value::Array(items) => stack.extend(items.iter()),
            _ => n += 1,
        }
    }
    n
}

fn encode_one(v: &Value, dtype: Dtype, out: &mut Vec<u8>) -> Result<(), String> {
    let int = || -> Result<i128, String> {
        match v {
            Value::Bool(b) => Ok(i128::from(*b)),
            Value::Number(n) => n
                .as_i64()
                .map(i128::from)
                .or_else(|| n.as_u64().map(i128::from))
                .ok_or_else(|| format!("{n} is not an integer")),
            other => Err(format!("{other} is not a number")),
        }
    };
    let float = || -> Result<f64, String> {
        match v {
            Value::Bool(b) => Ok(f64::from(u8::from(*b))),
            Value::Number(n) => n.as_f64().ok_or_else(|| format!("{n} is not a number")),
            other => Err(format!("{other} is not a number")),
        }
    };
    macro_rules! int_as {
        ($t:ty) => {{
            let i = int()?;
            let x = <$t>::try_from(i).map_err(|_| format!("{i} out of range for {dtype}"))?;
            out.extend_from_slice(&x.to_le_bytes());
        }};
    }
    match dtype {
        Dtype::Int64 => int_as!(i64),
        Dtype::Int32 => int_as!(i32),
        Dtype::Int16 => int_as!(i16),
        Dtype::Int8 => int_as!(i8),
        Dtype::Uint8 => int_as!(u8),
        Dtype::Bool => match int()? {
            b @ (0 | 1) => out.push(b as u8),
            i => return Err(format!("{i} is not a bool (0/1/true/false)")),
        },
        Dtype::Float64 => out.extend_from_slice(&float()?.to_le_bytes()),
        Dtype::Float32 => out.extend_from_slice(&(float()? as f32).to_le_bytes()),
        Dtype::Float16 => out.extend_from_slice(&half::f16::from_f64(float()?).to_le_bytes()),
        Dtype::Bfloat16 => out.extend_from_slice(&half::bf16::from_f64(float()?).to_le_bytes()),
    }
    Ok(())
}

/// Checks that no key repeats across the samples of a batch.
///
/// # Errors
/// [`Error::InvalidSample`] naming the repeated key.
pub fn check_unique(samples: &[Sample]) -> Result<()> {
    // A batch is written by the writer or, for reserved tensors, by its submitter: not both.
    let tensors = || {
        samples
            .iter()
            .flat_map(|s| s.tensors.iter().map(move |(_, t)| (s, t)))
    };
    let any_reserved = tensors().any(|(_, t)| t.data.is_reserved());
    if let Some((s, _)) = tensors().find(|(_, t)| any_reserved && !t.data.is_reserved()) {
        return Err(Error::sample(
            &s.sample_id,
            "a batch mixes reserved tensors (written by their submitter) with bytes to copy",
        ));
    }
    let mut seen = HashSet::new();
    for s in samples {
        for k in s.keys() {
            if !seen.insert(k) {
                return Err(Error::sample(
                    &s.sample_id,
                    format!("key {k} appears twice in one batch"),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::collections::BTreeMap;

    fn spec(v: Value) -> SampleSpec {
        serde_json::from_value(v).unwrap()
    }

    fn cap(l: u64, w: u64) -> Captured {
        Captured {
            shape: vec![l, w],
            dtype: Dtype::Bfloat16,
            data: TensorData::host(vec![0u8; (l * w * 2) as usize]),
        }
    }

    #[test]
    fn builds_from_contract_spec() {
        let sp = spec(json!({"store_id": "a1", "sample_id": "run0:t17",
            "features": {"aux": "hidden_state", "last_hidden": "target"},
            "passthrough": [{"name": "input_ids", "data": [1, 2, 3], "shape": [1, 3], "dtype": "int64"},
                            {"name": "loss_mask", "data": [[0, 1, 1]], "shape": [1, 3], "dtype": "int64"}]}));
        assert_eq!((sp.gen, sp.replace), (1, false));
        let s = Sample::from_spec(
            &sp,
            Some(cap(3, 12)),
            Some(cap(3, 4)),
            Some(vec![2, 18, 33]),
        )
        .unwrap();
        let shapes: Vec<_> = s
            .tensors
            .iter()
            .map(|(k, t)| (k.to_string(), t.shape.clone()))
            .collect();
        assert_eq!(
            shapes,
            [
                ("a1/run0:t17/g1/hidden_state".to_string(), vec![1, 3, 12]),
                ("a1/run0:t17/g1/target".to_string(), vec![1, 3, 4]),
                ("a1/run0:t17/g1/input_ids".to_string(), vec![1, 3]),
                ("a1/run0:t17/g1/loss_mask".to_string(), vec![1, 3]),
            ]
        );
        let TensorData::Host(b) = &s.tensors[2].1.data else {
            panic!("passthrough lists become owned bytes")
        };
        assert_eq!(
            &b.as_ref()[..16],
            &[1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]
        );
    }

    #[test]
    fn a_sample_takes_at_most_as_many_tensors_as_a_result_may_name() {
        let mut s = Sample::new("st", "s", 1).unwrap();
        let tensor = |i: usize| {
            Tensor::new(
                format!("t{i}"),
                vec![1],
                Dtype::Uint8,
                TensorData::host(vec![0u8]),
            )
            .unwrap()
        };
        for i in 0..MAX_FEATURES {
            s.push(tensor(i)).unwrap();
        }
        let e = s.push(tensor(MAX_FEATURES)).unwrap_err();
        assert!(
            matches!(e, Error::InvalidSample { .. }) && e.to_string().contains("more than 256"),
            "{e}"
        );
        assert_eq!(s.tensors.len(), MAX_FEATURES);
    }

    #[test]
    fn captured_tensors_must_be_two_dimensional_and_agree_on_length() {
        let sp = spec(json!({"store_id": "a", "sample_id": "s",
            "features": {"aux": "h", "last_hidden": "t"}}));
        let three_d = Captured {
            shape: vec![2, 3, 4],
            dtype: Dtype::Bfloat16,
            data: TensorData::host(vec![0u8; 48]),
        };
        let e = Sample::from_spec(&sp, Some(three_d), Some(cap(2, 4)), None).unwrap_err();
        assert!(e.to_string().contains("aux must be [L, k*H] (2-D"), "{e}");
        let one_d = Captured {
            shape: vec![8],
            dtype: Dtype::Bfloat16,
            data: TensorData::host(vec![0u8; 16]),
        };
        let e = Sample::from_spec(&sp, Some(cap(2, 4)), Some(one_d), None).unwrap_err();
        assert!(e.to_string().contains("last_hidden must be [L, H]"), "{e}");
        let e = Sample::from_spec(&sp, Some(cap(3, 12)), Some(cap(2, 4)), None).unwrap_err();
        assert!(e.to_string().contains("aux has 3 tokens"), "{e}");
        assert!(Sample::from_spec(&sp, Some(cap(2, 12)), Some(cap(2, 4)), None).is_ok());
    }

    #[test]
    fn integer_lists_take_the_typed_path() {
        assert_eq!(
            encode_ints(&[1, -1], Dtype::Int16).unwrap(),
            [1, 0, 0xff, 0xff]
        );
        assert_eq!(encode_ints(&[0, 1], Dtype::Bool).unwrap(), [0, 1]);
        let e = encode_ints(&[1, 300], Dtype::Uint8).unwrap_err();
        assert!(e.contains("element 1: 300 out of range for uint8"), "{e}");
        assert!(encode_ints(&[2], Dtype::Bool).is_err());
        assert!(encode_ints(&[2], Dtype::Float32).is_err());
        let big: Vec<i64> = (0..1000).collect();
        let b = encode_ints(&big, Dtype::Int64).unwrap();
        assert_eq!(&b[8..16], &1i64.to_le_bytes());
    }

    /// A result of sample `a/s/g1` with one `[1, 3]` int64 feature `name` at 4096.
    fn one_feature(name: &str) -> Published {
        Published {
            sample_id: "s".into(),
            store_id: "a".into(),
            gen: 1,
            aux_layer_ids: None,
            features: BTreeMap::from([(
                name.to_string(),
                Feature {
                    shape: vec![1, 3],
                    dtype: Dtype::Int64,
                    address: 4096,
                    stamp: None,
                },
            )]),
            arena: ArenaRef {
                session: "shm://x".into(),
                control: "127.0.0.1:1".into(),
                token: None,
            },
            writable: None,
        }
    }

    #[test]
    fn results_from_outside_are_validated() {
        let mut p = one_feature("x");
        p.validate().unwrap();
        assert_eq!(p.keys().unwrap()[0].as_str(), "a/s/g1/x");
        p.features.get_mut("x").unwrap().shape = vec![1; 9];
        assert!(p.validate().unwrap_err().to_string().contains("rank 9"));
        p.features.get_mut("x").unwrap().shape = vec![u64::MAX, 2];
        assert!(p.validate().unwrap_err().to_string().contains("overflows"));
        p.features.get_mut("x").unwrap().shape = vec![1];
        p.sample_id = "x".repeat(2000);
        assert!(p.validate().is_err(), "a key too long to free is refused");
        p.sample_id = "s".into();
        p.arena.session = "s".repeat(MAX_SESSION_BYTES + 1);
        assert!(p.validate().is_err());
    }

    #[test]
    fn contract_errors() {
        let base = json!({"store_id": "a", "sample_id": "s", "features": {"aux": "h"}});
        let e = Sample::from_spec(&spec(base.clone()), None, None, None).unwrap_err();
        assert!(
            e.to_string()
                .contains("aux requested as feature \"h\" but not captured"),
            "{e}"
        );
        let e = Sample::from_spec(
            &spec(json!({"store_id": "a", "sample_id": "s", "features": {"last_hidden": "t"}})),
            Some(cap(1, 1)),
            None,
            None,
        )
        .unwrap_err();
        assert!(e.to_string().contains("last_hidden requested"), "{e}");
        let pt = |data: Value, shape: Value, dtype: &str| {
            spec(json!({"store_id": "a", "sample_id": "s",
                "passthrough": [{"name": "x", "data": data, "shape": shape, "dtype": dtype}]}))
        };
        for (sp, msg) in [
            (pt(json!([1]), json!([1]), "complex64"), "unsupported dtype"),
            (
                pt(json!([1, 2]), json!([1, 3]), "int64"),
                "data has 2 elements but shape [1, 3] needs 3",
            ),
            (pt(json!([300]), json!([1]), "uint8"), "out of range"),
            (pt(json!([1.5]), json!([1]), "int32"), "not an integer"),
            (pt(json!(["x"]), json!([1]), "float32"), "not a number"),
            (pt(json!([2]), json!([1]), "bool"), "not a bool"),
        ] {
            let e = Sample::from_spec(&sp, None, None, None).unwrap_err();
            assert!(e.to_string().contains(msg), "{e} should contain {msg}");
        }
        // A captured tensor whose bytes do not match its shape.
        let bad = Captured {
            shape: vec![2, 2],
            dtype: Dtype::Bfloat16,
            data: TensorData::host(vec![0u8; 7]),
        };
        assert!(Sample::from_spec(&spec(base), Some(bad), None, None).is_err());
    }

    #[test]
    fn passthrough_bytes_replace_json_data() {
        let sp = spec(json!({"store_id": "a", "sample_id": "s",
            "passthrough": [{"name": "ids", "data": null, "shape": [1, 2], "dtype": "int64"}]}));
        let bytes = |dtype, n: usize| Captured {
            shape: vec![2],
            dtype,
            data: TensorData::host(vec![7u8; n]),
        };
        let parts = |c| HashMap::from([("ids".to_string(), c)]);
        let s =
            Sample::from_spec_parts(&sp, None, None, None, parts(bytes(Dtype::Int64, 16))).unwrap();
        assert_eq!(s.tensors[0].1.shape, [1, 2]);
        let e = Sample::from_spec_parts(&sp, None, None, None, parts(bytes(Dtype::Int32, 8)))
            .unwrap_err();
        assert!(
            e.to_string().contains("spec declares [1, 2] of int64"),
            "{e}"
        );
        let e = Sample::from_spec_parts(&sp, None, None, None, parts(bytes(Dtype::Int64, 15)))
            .unwrap_err();
        assert!(e.to_string().contains("needs 16 bytes, got 15"), "{e}");
        let with_data = spec(json!({"store_id": "a", "sample_id": "s",
            "passthrough": [{"name": "ids", "data": [1, 2], "shape": [1, 2], "dtype": "int64"}]}));
        let stray = HashMap::from([("other".to_string(), bytes(Dtype::Int64, 16))]);
        let e = Sample::from_spec_parts(&with_data, None, None, None, stray).unwrap_err();
        assert!(e.to_string().contains("not a passthrough"), "{e}");
        let e = Sample::from_spec(&sp, None, None, None).unwrap_err();
        assert!(
            e.to_string()
                .contains("data has 1 elements but shape [1, 2] needs 2"),
            "{e}"
        );
    }

    #[test]
    fn encodes_every_dtype() {
        let d = json!([0, 1, true]);
        for dt in Dtype::ALL {
            let b = encode_values(&d, &[3], dt).unwrap();
            assert_eq!(b.len() as u64, 3 * dt.item_size());
        }
        assert_eq!(
            encode_values(&json!([1.0]), &[1], Dtype::Bfloat16).unwrap(),
            [0x80, 0x3f]
        );
        assert_eq!(
            encode_values(&json!([1.0]), &[1], Dtype::Float16).unwrap(),
            [0x00, 0x3c]
        );
        assert_eq!(
            encode_values(&json!([-1]), &[1], Dtype::Int16).unwrap(),
            [0xff, 0xff]
        );
    }

    #[test]
    fn results_serialise_as_the_contract() {
        let p = one_feature("input_ids");
        let v = serde_json::to_value(SampleResult::Published(p.clone())).unwrap();
        assert_eq!(
            v,
            json!({"sample_id": "s", "store_id": "a", "gen": 1, "aux_layer_ids": null,
                   "features": {"input_ids": {"shape": [1, 3], "dtype": "int64", "address": 4096}},
                   "arena": {"session": "shm://x", "control": "127.0.0.1:1"}})
        );
        let back: SampleResult = serde_json::from_value(v).unwrap();
        assert_eq!(back, SampleResult::Published(p));
        let f: SampleResult =
            serde_json::from_value(json!({"sample_id": "s", "error": "x"})).unwrap();
        assert!(matches!(f, SampleResult::Failed(_)));
    }
}
