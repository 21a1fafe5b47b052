//! Tensors as the writer receives them: a name, a shape, a dtype and the caller's bytes, held
//! until the writer has copied them into the arena.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The dtypes of the capture contract, with their item sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// IEEE binary32.
    Float32,
    /// IEEE binary64.
    Float64,
    /// IEEE binary16.
    Float16,
    /// bfloat16 (the hidden states' dtype in practice).
    Bfloat16,
    /// Signed 64-bit integer (`input_ids`, `loss_mask`).
    Int64,
    /// Signed 32-bit integer.
    Int32,
    /// Signed 16-bit integer.
    Int16,
    /// Signed 8-bit integer.
    Int8,
    /// Unsigned 8-bit integer.
    Uint8,
    /// One byte, 0 or 1.
    Bool,
}

impl Dtype {
    /// Every dtype, in the contract's order.
    pub const ALL: [Dtype; 10] = [
        Dtype::Float32,
        Dtype::Float64,
        Dtype::Float16,
        Dtype::Bfloat16,
        Dtype::Int64,
        Dtype::Int32,
        Dtype::Int16,
        Dtype::Int8,
        Dtype::Uint8,
        Dtype::Bool,
    ];

    /// The contract's name (`"bfloat16"`).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Float32 => "float32",
            Dtype::Float64 => "float64",
            Dtype::Float16 => "float16",
            Dtype::Bfloat16 => "bfloat16",
            Dtype::Int64 => "int64",
            Dtype::Int32 => "int32",
            Dtype::Int16 => "int16",
            Dtype::Int8 => "int8",
            Dtype::Uint8 => "uint8",
            Dtype::Bool => "bool",
        }
    }

    /// Looks a dtype up by its contract name.
    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.name() == name)
    }

    /// True for the floating-point dtypes.
    pub fn is_float(self) -> bool {
        matches!(
            self,
            Dtype::Float32 | Dtype::Float64 | Dtype::Float16 | Dtype::Bfloat16
        )
    }

    /// Bytes per element.
    pub fn item_size(self) -> u64 {
        match self {
            Dtype::Float64 | Dtype::Int64 => 8,
            Dtype::Float32 | Dtype::Int32 => 4,
            Dtype::Float16 | Dtype::Bfloat16 | Dtype::Int16 => 2,
            Dtype::Int8 | Dtype::Uint8 | Dtype::Bool => 1,
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The highest rank a tensor may have (captured tensors are 3-D, passthroughs 2-D).
pub const MAX_RANK: usize = 8;

/// Bytes of a tensor of `shape` and `dtype`, or `None` when they, or the product of its non-zero
/// dimensions, pass `i64::MAX` (what numpy and torch can describe: `[0, 2^64 - 1]` is no tensor
/// of 0 bytes, it is refused).
pub fn byte_len(shape: &[u64], dtype: Dtype) -> Option<u64> {
    let nonzero = shape
        .iter()
        .try_fold(dtype.item_size(), |acc, &d| acc.checked_mul(d.max(1)))
        .filter(|&n| i64::try_from(n).is_ok())?;
    Some(if shape.contains(&0) { 0 } else { nonzero })
}

/// Where a tensor's bytes are. The caller's buffer is owned here until the writer has copied it,
/// then dropped on the writer thread.
#[non_exhaustive]
pub enum TensorData {
    /// Host memory owned by the tensor: anything that can lend a byte slice (a `Vec<u8>`, an
    /// `Arc<[u8]>`, a pooled buffer); see [`TensorData::host`].
    Host(HostBytes),
    /// Host memory lent by address by its owner (a Python array), with a promise that nobody
    /// writes or frees it until the writer drops this value. See [`TensorData::lent`].
    Lent(Lent),
    /// Device memory (cargo feature `cuda`): see [`TensorData::device`].
    #[cfg(feature = "cuda")]
    Device(DeviceData),
    /// This many bytes, which the submitter writes itself once their space is reserved: a batch
    /// of such tensors is published at once with its objects marked as being written, and
    /// finished with [`crate::Writer::finish_writes`] (see [`crate::arena`]).
    Reserved(u64),
}

/// Host bytes a tensor owns: the slice its owner lent once, when the tensor was made. Whatever
/// the owner's `AsRef` would answer later, the bytes validated, placed and copied are that slice
/// (an `AsRef` answering a longer slice at the copy than at the validation would otherwise have
/// the copy write past its region).
pub struct HostBytes {
    ptr: *const u8,
    len: usize,
    /// The owner, leaked from its box when the slice was taken (so that moving this value never
    /// asserts unique access to bytes the slice points into) and boxed again only to be dropped.
    owner: *mut (dyn AsRef<[u8]> + Send),
}

// SAFETY: the owner is `Send` and owned by this value alone; the pointer is into memory it
// keeps, only read, by whichever thread holds the value, as the owner's own slice would be.
unsafe impl Send for HostBytes {}

impl HostBytes {
    fn new(owner: Box<dyn AsRef<[u8]> + Send>) -> HostBytes {
        let owner = Box::into_raw(owner);
        // SAFETY: `owner` came from a box just now and is valid; a shared borrow of it.
        let s = unsafe { (*owner).as_ref() };
        HostBytes {
            ptr: s.as_ptr(),
            len: s.len(),
            owner,
        }
    }
}

impl AsRef<[u8]> for HostBytes {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `ptr` and `len` are a slice the owner lent from a shared borrow of itself; the
        // owner stays where it is, alive, and only shared, until `self` is dropped.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for HostBytes {
    fn drop(&mut self) {
        // SAFETY: `owner` came from `Box::into_raw` in `new` and is boxed again once, here.
        drop(unsafe { Box::from_raw(self.owner) });
    }
}

/// Device bytes lent by address; see [`TensorData::device`].
#[cfg(feature = "cuda")]
pub struct DeviceData {
    pub(crate) ptr: u64,
    pub(crate) len: u64,
    pub(crate) device: i32,
    /// Recorded on the producer's stream when the tensor was handed over: the writer's copies
    /// wait for it.
    pub(crate) ready: Option<crate::driver::Ready>,
    _owner: Box<dyn Send>,
}

#[cfg(feature = "cuda")]
impl DeviceData {
    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// The device ordinal (in this process).
    pub fn device(&self) -> i32 {
        self.device
    }

    /// Waits until the work the producer enqueued before handing the tensor over has finished
    /// (its readiness event), at most `timeout`: for publishers that read the bytes with
    /// something other than the writer's streams (the Mooncake store's transfer engine).
    ///
    /// # Errors
    /// [`Error::Device`] when the event reports an error, or `timeout` passes first.
    pub fn wait_ready(&self, timeout: std::time::Duration) -> Result<()> {
        let Some(ready) = &self.ready else {
            return Ok(());
        };
        let deadline = crate::limits::deadline_in(timeout);
        let mut pause = std::time::Duration::from_micros(20);
        while !ready.0.query()? {
            if std::time::Instant::now() >= deadline {
                return Err(Error::device(
                    format!("a tensor of device {}", self.device),
                    format!(
                        "the work that writes it did not finish within {:.0} s",
                        timeout.as_secs_f64()
                    ),
                ));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(std::time::Duration::from_millis(1));
        }
        Ok(())
    }
}

/// Host bytes lent by address; see [`TensorData::lent`].
pub struct Lent {
    ptr: *const u8,
    len: usize,
    /// Keeps the memory allocated and in place; dropped (on the writer thread) after the copy.
    _owner: Box<dyn Send>,
}

// SAFETY: `Lent` is a read-only loan of memory that its constructor's caller promised stays
// valid and unchanged until the value is dropped, wherever that happens; the owner is `Send`.
// Nothing here reads through the pointer except the region's copy (on the writer thread).
unsafe impl Send for Lent {}

impl TensorData {
    /// Wraps a host buffer the tensor owns.
    /// Its slice is taken once, here: what is validated and copied is that slice.
    pub fn host(bytes: impl AsRef<[u8]> + Send + 'static) -> TensorData {
        TensorData::Host(HostBytes::new(Box::new(bytes)))
    }

    /// Host memory lent by address: `len` bytes at `ptr`, kept alive by `owner`, which is
    /// dropped once the writer has copied them (or the batch failed).
    ///
    /// # Safety
    /// From this call until `owner` is dropped, `ptr` must be valid for reads of `len` bytes
    /// (or `len` must be 0), and nothing may write or free that memory. This is the contract
    /// the Python sink states to its callers: a tensor handed to it is not written, resized or
    /// freed until its batch's results are back.
    pub unsafe fn lent(ptr: *const u8, len: usize, owner: impl Send + 'static) -> TensorData {
        TensorData::Lent(Lent {
            ptr,
            len,
            _owner: Box::new(owner),
        })
    }

    /// Device memory lent by address (cargo feature `cuda`): `len` bytes at device address
    /// `ptr` on device `ordinal`, kept alive by `owner`. With `stream` (a raw `CUstream` of this
    /// process; `0` is the legacy default stream), an event is recorded on it now, and the
    /// writer's copies wait for it: the producer's kernels that wrote the tensor and were
    /// enqueued before this call need not have finished. Without it, the bytes must be final
    /// already.
    ///
    /// # Errors
    /// [`Error::Device`] without a usable driver, for a bad ordinal or stream.
    ///
    /// # Safety
    /// From this call until `owner` is dropped (on the writer thread, after the copy), `ptr`
    /// must be valid device memory of at least `len` bytes on `ordinal`, and nothing may write
    /// or free it after the work enqueued on `stream` so far (the caller keeps the tensor and
    /// its storage alive through `owner`). `stream`, if given, must be a stream of this process.
    #[cfg(feature = "cuda")]
    pub unsafe fn device(
        ptr: u64,
        len: u64,
        ordinal: i32,
        stream: Option<u64>,
        owner: impl Send + 'static,
    ) -> Result<TensorData> {
        if len > 0 && ptr == 0 {
            return Err(Error::device(
                "a device tensor",
                "null device pointer for a non-empty tensor",
            ));
        }
        let ready = match stream {
            Some(s) => Some(crate::driver::record_ready(ordinal, s)?),
            None => None,
        };
        Ok(TensorData::Device(DeviceData {
            ptr,
            len,
            device: ordinal,
            ready,
            _owner: Box::new(owner),
        }))
    }

    /// True for device memory.
    pub fn is_device(&self) -> bool {
        #[cfg(feature = "cuda")]
        if let TensorData::Device(_) = self {
            return true;
        }
        false
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        match self {
            TensorData::Host(b) => b.len as u64,
            TensorData::Lent(l) => l.len as u64,
            #[cfg(feature = "cuda")]
            TensorData::Device(d) => d.len,
            TensorData::Reserved(n) => *n,
        }
    }

    /// True for bytes the submitter writes itself ([`TensorData::Reserved`]).
    pub fn is_reserved(&self) -> bool {
        matches!(self, TensorData::Reserved(_))
    }

    /// True if there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The host bytes to copy, as a pointer valid for reads of the returned length and unchanged
    /// while `self` lives (owned bytes by construction; lent bytes by [`TensorData::lent`]'s
    /// contract). Regions copy from it with raw copies, never through a `&[u8]` of lent memory.
    /// The address and length of host bytes (owned or lent), for a copy made by another engine
    /// (a Mooncake store's put); `None` for device memory. The bytes stay valid and unchanged
    /// while `self` lives.
    pub fn host_ptr(&self) -> Option<(*const u8, usize)> {
        self.host_source()
    }

    /// `None` for device memory and reserved bytes.
    pub(crate) fn host_source(&self) -> Option<(*const u8, usize)> {
        match self {
            TensorData::Host(b) => Some((b.ptr, b.len)),
            TensorData::Lent(l) => Some((l.ptr, l.len)),
            #[cfg(feature = "cuda")]
            TensorData::Device(_) => None,
            TensorData::Reserved(_) => None,
        }
    }
}

impl fmt::Debug for TensorData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TensorData::Host(_) => write!(f, "Host({} bytes)", self.len()),
            TensorData::Lent(_) => write!(f, "Lent({} bytes)", self.len()),
            TensorData::Reserved(n) => write!(f, "Reserved({n} bytes)"),
            #[cfg(feature = "cuda")]
            TensorData::Device(d) => {
                write!(
                    f,
                    "Device({} bytes on GPU {} at {:#x})",
                    d.len, d.device, d.ptr
                )
            }
        }
    }
}

/// One named tensor of a sample, validated: `data.len() == shape × item_size`.
#[derive(Debug)]
pub struct Tensor {
    pub(crate) name: String,
    pub(crate) shape: Vec<u64>,
    pub(crate) dtype: Dtype,
    pub(crate) data: TensorData,
}

impl Tensor {
    /// A tensor whose byte length must equal `product(shape) × dtype.item_size()`, of rank at
    /// most [`MAX_RANK`].
    ///
    /// # Errors
    /// [`Error::InvalidTensor`] saying what does not match.
    pub fn new(
        name: impl Into<String>,
        shape: Vec<u64>,
        dtype: Dtype,
        data: TensorData,
    ) -> Result<Tensor> {
        let name = name.into();
        if shape.len() > MAX_RANK {
            let reason = format!("rank {} is above the limit of {MAX_RANK}", shape.len());
            return Err(Error::InvalidTensor { name, reason });
        }
        let Some(want) = byte_len(&shape, dtype) else {
            let reason = format!("shape {shape:?} overflows");
            return Err(Error::InvalidTensor { name, reason });
        };
        if want != data.len() {
            let reason = format!(
                "shape {shape:?} of {dtype} needs {want} bytes, got {}",
                data.len()
            );
            return Err(Error::InvalidTensor { name, reason });
        }
        Ok(Tensor {
            name,
            shape,
            dtype,
            data,
        })
    }

    /// The feature name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The shape.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }
    /// The dtype.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }
    /// Length in bytes.
    pub fn byte_len(&self) -> u64 {
        self.data.len()
    }
    /// The bytes.
    pub fn data(&self) -> &TensorData {
        &self.data
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_names_and_sizes() {
        let sizes: Vec<u64> = Dtype::ALL.iter().map(|d| d.item_size()).collect();
        assert_eq!(sizes, [4, 8, 2, 2, 8, 4, 2, 1, 1, 1]);
        for d in Dtype::ALL {
            assert_eq!(Dtype::from_name(d.name()), Some(d));
            assert_eq!(
                serde_json::to_string(&d).unwrap(),
                format!("\"{}\"", d.name())
            );
        }
        assert_eq!(Dtype::from_name("float8"), None);
    }

    #[test]
    fn byte_lengths_numpy_cannot_describe_are_refused_even_with_a_zero() {
        assert_eq!(byte_len(&[3, 5], Dtype::Bfloat16), Some(30));
        assert_eq!(byte_len(&[0, 7], Dtype::Int64), Some(0));
        assert_eq!(byte_len(&[0, u64::MAX], Dtype::Uint8), None);
        assert_eq!(byte_len(&[1 << 62, 2, 0], Dtype::Uint8), None);
        assert_eq!(byte_len(&[1 << 62], Dtype::Int64), None);
        assert_eq!(
            byte_len(&[(1 << 62) - 1], Dtype::Uint8),
            Some((1 << 62) - 1)
        );
    }

    #[test]
    fn tensor_checks_length() {
        assert!(Tensor::new(
            "x",
            vec![1, 4],
            Dtype::Int64,
            TensorData::host(vec![0u8; 32])
        )
        .is_ok());
        let e = Tensor::new(
            "x",
            vec![1, 4],
            Dtype::Int64,
            TensorData::host(vec![0u8; 31]),
        );
        assert!(e
            .unwrap_err()
            .to_string()
            .contains("needs 32 bytes, got 31"));
        let e = Tensor::new(
            "x",
            vec![u64::MAX, 2],
            Dtype::Int64,
            TensorData::host(vec![]),
        );
        assert!(e.unwrap_err().to_string().contains("overflows"));
    }
}
