//! The CLI's GPU helpers (`--device`): device copies of the synthetic tensors and device buffers
//! to read into, used by the workload and by the commands. Builds without the `cuda` feature
//! say so when `--device` is used.

use capture_arena::TensorData;

#[cfg(feature = "cuda")]
mod imp {
    use capture_arena::memory::cuda::DeviceBuffer;
    use capture_arena::{Destination, DeviceSlice, TensorData};

    /// A device copy of `bytes` on `gpu`, owned by the tensor.
    pub fn upload(bytes: &[u8], gpu: i32) -> anyhow::Result<TensorData> {
        let buf = DeviceBuffer::new(gpu, bytes.len() as u64)?;
        buf.upload(0, bytes)?;
        let (ptr, len) = (buf.ptr(), buf.len());
        // SAFETY: the buffer is device memory of `len` bytes on `gpu`, moved into the tensor as
        // its owner, and written by nobody else until the writer drops it.
        Ok(unsafe { TensorData::device(ptr, len, gpu, None, buf) }?)
    }

    /// Device buffers a trainer reads into, reused while sizes repeat.
    pub struct Outs {
        gpu: i32,
        bufs: Vec<DeviceBuffer>,
    }

    impl Outs {
        pub fn new(gpu: i32) -> anyhow::Result<Outs> {
            capture_arena::memory::cuda::driver()?;
            Ok(Outs {
                gpu,
                bufs: Vec::new(),
            })
        }

        /// One buffer per length, exactly that long.
        pub fn reserve(&mut self, lens: &[usize]) -> capture_arena::Result<()> {
            self.bufs.truncate(lens.len());
            for (i, &n) in lens.iter().enumerate() {
                if self.bufs.get(i).is_some_and(|b| b.len() == n as u64) {
                    continue;
                }
                let b = DeviceBuffer::new(self.gpu, n as u64)?;
                if i < self.bufs.len() {
                    self.bufs[i] = b;
                } else {
                    self.bufs.push(b);
                }
            }
            Ok(())
        }

        pub fn destinations<'a>(&self, names: &[&'a str]) -> Vec<(&'a str, Destination<'static>)> {
            names
                .iter()
                .zip(&self.bufs)
                // SAFETY: each buffer is device memory of exactly its length, owned by self and
                // used by nothing else while the read runs.
                .map(|(n, b)| {
                    (
                        *n,
                        Destination::Device(unsafe {
                            DeviceSlice::new(b.ptr(), b.len(), self.gpu)
                        }),
                    )
                })
                .collect()
        }

        /// Copies every buffer back to host memory (for the pattern check).
        pub fn download(&self, out: &mut [Vec<u8>]) -> capture_arena::Result<()> {
            for (b, o) in self.bufs.iter().zip(out.iter_mut()) {
                b.download(0, o)?;
            }
            Ok(())
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use capture_arena::{Destination, TensorData};

    const NO_CUDA: &str = "--device needs a capture-arena built with the cuda feature \
                           (cargo build --features cuda)";

    pub fn upload(_bytes: &[u8], _gpu: i32) -> anyhow::Result<TensorData> {
        anyhow::bail!(NO_CUDA)
    }

    pub struct Outs;

    impl Outs {
        pub fn new(_gpu: i32) -> anyhow::Result<Outs> {
            anyhow::bail!(NO_CUDA)
        }
        pub fn reserve(&mut self, _lens: &[usize]) -> capture_arena::Result<()> {
            Ok(())
        }
        pub fn destinations<'a>(&self, _names: &[&'a str]) -> Vec<(&'a str, Destination<'static>)> {
            Vec::new()
        }
        pub fn download(&self, _out: &mut [Vec<u8>]) -> capture_arena::Result<()> {
            Ok(())
        }
    }
}

pub use imp::Outs;

/// A device copy of `bytes` on `gpu` (see [`imp::upload`]).
pub fn upload(bytes: &[u8], gpu: i32) -> anyhow::Result<TensorData> {
    imp::upload(bytes, gpu)
}
