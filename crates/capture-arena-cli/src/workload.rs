//! Synthetic capture-shaped samples and the content pattern a consumer verifies.
//!
//! # The content pattern
//! Byte `i` of the object with key `k` is byte `i % 8` (little-endian) of
//! `word(i / 8) = h XOR (w << 32 | w)` with `w = i / 8`, where `h` is the 64-bit FNV-1a hash of
//! the key's UTF-8 bytes. Any reader can check it from the key alone; a misplaced, shifted or
//! swapped object fails. (Shifts and XORs only, so filling and checking run at memory speed.)

use std::sync::{Arc, Mutex};

use capture_arena::config::parse_bytes;
use capture_arena::{Dtype, Key, Sample, Tensor, TensorData};

/// 64-bit FNV-1a of the key.
pub fn key_hash(key: &str) -> u64 {
    key.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[inline]
fn word(h: u64, w: u64) -> u64 {
    h ^ (w << 32 | w)
}

/// Fills `buf` with the pattern of `key`.
pub fn fill(key: &str, buf: &mut [u8]) {
    let h = key_hash(key);
    let mut chunks = buf.chunks_exact_mut(8);
    for (w, c) in (&mut chunks).enumerate() {
        c.copy_from_slice(&word(h, w as u64).to_le_bytes());
    }
    let n = (buf.len() / 8) as u64;
    let tail = buf.chunks_exact_mut(8).into_remainder();
    tail.copy_from_slice(&word(h, n).to_le_bytes()[..tail.len()]);
}

/// A uint8 tensor `name` of `len` bytes holding the pattern of `key` (see [`fill`]).
pub fn pattern_tensor(name: &str, key: &str, len: usize) -> capture_arena::Result<Tensor> {
    let mut data = vec![0u8; len];
    fill(key, &mut data);
    Tensor::new(name, vec![len as u64], Dtype::Uint8, TensorData::host(data))
}

/// The offset of the first byte of `buf` that breaks the pattern of `key`, if any.
pub fn verify(key: &str, buf: &[u8]) -> Option<usize> {
    let h = key_hash(key);
    let chunks = buf.chunks_exact(8);
    let tail = chunks.remainder();
    // Branch-free accumulate (vectorises); locate the byte only on failure.
    let diff = chunks.enumerate().fold(0u64, |acc, (w, c)| {
        let got = u64::from_le_bytes(c.try_into().unwrap_or([0; 8]));
        acc | (got ^ word(h, w as u64))
    });
    let n = (buf.len() / 8) as u64;
    if diff == 0 && tail == &word(h, n).to_le_bytes()[..tail.len()] {
        return None;
    }
    let mut want = vec![0u8; buf.len()];
    fill(key, &mut want);
    buf.iter().zip(&want).position(|(a, b)| a != b)
}

/// Buffers the writer hands back when it drops a tensor it has copied, so the producer reuses
/// memory that is already faulted in instead of taking fresh pages for every sample.
#[derive(Debug, Clone, Default)]
pub struct Pool(Arc<Mutex<Vec<Vec<u8>>>>);

/// The most buffers a pool keeps.
const POOL_MAX: usize = 256;

impl Pool {
    /// A buffer of exactly `n` bytes (contents unspecified).
    fn take(&self, n: usize) -> Vec<u8> {
        let mut pool = self.0.lock().unwrap_or_else(|p| p.into_inner());
        // The smallest buffer that holds n bytes, else the largest one (it grows once).
        let pick = pool
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= n)
            .min_by_key(|(_, b)| b.capacity())
            .or_else(|| pool.iter().enumerate().max_by_key(|(_, b)| b.capacity()))
            .map(|(i, _)| i);
        let mut b = pick.map(|i| pool.swap_remove(i)).unwrap_or_default();
        drop(pool);
        // Grow to exactly n (no doubling), then resize within capacity.
        b.reserve_exact(n.saturating_sub(b.len()));
        b.resize(n, 0);
        b
    }
}

/// A pooled buffer: back to its pool on drop.
#[derive(Debug)]
pub struct Pooled {
    buf: Vec<u8>,
    pool: Pool,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let mut p = self.pool.0.lock().unwrap_or_else(|p| p.into_inner());
        if p.len() < POOL_MAX {
            p.push(std::mem::take(&mut self.buf));
        }
    }
}

/// Where the data lives (shared by `demo`, `produce`, `consume`, `bench`).
#[derive(Debug, Clone, Copy, Default, clap::Args)]
pub struct Gpu {
    /// Use GPU memory: publish device tensors into a device arena (CUDA virtual memory,
    /// exported to the trainer by handle), and read into device buffers.
    #[arg(long)]
    pub device: bool,
    /// The GPU for --device (ordinal in this process).
    #[arg(long, default_value_t = 0)]
    pub gpu: i32,
}

impl Gpu {
    /// The GPU ordinal with `--device`, else `None`.
    pub fn ordinal(&self) -> Option<i32> {
        self.device.then_some(self.gpu)
    }

    /// The flags that pass this on to a child process.
    pub fn flags(&self) -> Vec<String> {
        if self.device {
            vec!["--device".into(), "--gpu".into(), self.gpu.to_string()]
        } else {
            Vec::new()
        }
    }
}

/// The most samples one workload may have (`--samples`).
pub const MAX_SAMPLES: usize = 1 << 24;

/// The shape of the synthetic workload (shared by `demo` and `produce`).
#[derive(Debug, Clone, clap::Args)]
pub struct Workload {
    /// Samples to publish.
    #[arg(long, default_value_t = 128)]
    pub samples: usize,
    /// Shortest sequence length L.
    #[arg(long, default_value_t = 512)]
    pub min_len: u64,
    /// Longest sequence length L.
    #[arg(long, default_value_t = 4096)]
    pub max_len: u64,
    /// Hidden size H of the target model.
    #[arg(long, default_value_t = 4096)]
    pub hidden: u64,
    /// Aux layers k (aux hidden states are [1, L, k*H]).
    #[arg(long, default_value_t = 3)]
    pub aux_layers: u64,
    /// Samples per batch (a prefill batch).
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Seed for the sequence lengths.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Trainer store namespace in the keys.
    #[arg(long, default_value = "demo")]
    pub store_id: String,
    /// The seed PR's hardware run: 64 samples of ~100 MiB (6.47 GiB), L = 3310, H = 4096, k = 3.
    #[arg(long)]
    pub seed_scenario: bool,
}

impl Workload {
    /// Applies `--seed-scenario` and checks the numbers.
    pub fn resolved(&self) -> anyhow::Result<Workload> {
        let mut w = self.clone();
        if w.seed_scenario {
            w.samples = 64;
            w.min_len = 3310;
            w.max_len = 3310;
            w.hidden = 4096;
            w.aux_layers = 3;
        }
        anyhow::ensure!(
            w.min_len >= 1 && w.min_len <= w.max_len,
            "need 1 <= --min-len <= --max-len"
        );
        anyhow::ensure!(
            w.batch >= 1 && w.hidden >= 1,
            "--batch and --hidden must be >= 1"
        );
        anyhow::ensure!(
            w.samples <= MAX_SAMPLES,
            "--samples {} is more than {MAX_SAMPLES}: run several producers, or a soak",
            w.samples
        );
        anyhow::ensure!(
            w.batch <= MAX_SAMPLES,
            "--batch {} is more than {MAX_SAMPLES}",
            w.batch
        );
        // Every size below is then computed without overflow.
        let total = w
            .token_bytes()
            .and_then(|x| x.checked_mul(w.max_len))
            .and_then(|x| x.checked_mul(w.samples as u64));
        anyhow::ensure!(
            total.is_some(),
            "--samples {} x --max-len {} x ((--aux-layers {} + 1) x --hidden {} x 2 + 16) bytes \
             does not fit in 64 bits: lower them",
            w.samples,
            w.max_len,
            w.aux_layers,
            w.hidden
        );
        Ok(w)
    }

    /// Sequence length of sample `i` (deterministic from the seed).
    pub fn len_of(&self, i: usize) -> u64 {
        let mut x = self
            .seed
            .wrapping_add(i as u64)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^= x >> 31;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^= x >> 29;
        self.min_len + x % (self.max_len - self.min_len + 1)
    }

    /// Bytes a token takes in a sample: aux and last hidden state in bf16, and the int64 id and
    /// loss-mask entry; `None` past 64 bits (a workload [`Workload::resolved`] refuses).
    fn token_bytes(&self) -> Option<u64> {
        self.aux_layers
            .checked_add(1)
            .and_then(|k| k.checked_mul(self.hidden))
            .and_then(|x| x.checked_mul(2))
            .and_then(|x| x.checked_add(16))
    }

    /// Bytes of sample `i`.
    pub fn bytes_of(&self, i: usize) -> u64 {
        self.len_of(i)
            .saturating_mul(self.token_bytes().unwrap_or(u64::MAX))
    }

    /// Total bytes of the workload.
    pub fn total_bytes(&self) -> u64 {
        (0..self.samples).map(|i| self.bytes_of(i)).sum()
    }

    /// Bytes of the largest batch.
    pub fn max_batch_bytes(&self) -> u64 {
        (0..self.samples)
            .step_by(self.batch)
            .map(|s| {
                (s..(s + self.batch).min(self.samples))
                    .map(|i| self.bytes_of(i))
                    .sum()
            })
            .max()
            .unwrap_or(0)
    }

    /// Sample id of sample `i`.
    pub fn sample_id(&self, i: usize) -> String {
        format!("run0:t{i}")
    }

    /// Builds sample `i` with every tensor filled with its key's pattern: aux `[1, L, k*H]` and
    /// last hidden `[1, L, H]` in bf16, `input_ids` and `loss_mask` `[1, L]` int64.
    ///
    /// With `gpu`, every tensor is uploaded to device memory of that GPU first.
    pub fn sample(&self, i: usize, pool: &Pool, gpu: Option<i32>) -> anyhow::Result<Sample> {
        let l = self.len_of(i);
        let id = self.sample_id(i);
        let mut s = Sample::new(&self.store_id, &id, 1)?;
        let tensors = [
            (
                "hidden_state",
                vec![1, l, self.aux_layers * self.hidden],
                Dtype::Bfloat16,
            ),
            ("target", vec![1, l, self.hidden], Dtype::Bfloat16),
            ("input_ids", vec![1, l], Dtype::Int64),
            ("loss_mask", vec![1, l], Dtype::Int64),
        ];
        for (name, shape, dtype) in tensors {
            if name == "hidden_state" && self.aux_layers == 0 {
                continue;
            }
            let n = capture_arena::tensor::byte_len(&shape, dtype)
                .ok_or_else(|| anyhow::anyhow!("shape {shape:?} overflows"))?;
            let mut buf = pool.take(usize::try_from(n)?);
            fill(Key::new(&self.store_id, &id, 1, name)?.as_str(), &mut buf);
            let data = match gpu {
                Some(g) => crate::gpu::upload(&buf, g)?,
                None => TensorData::host(Pooled {
                    buf,
                    pool: pool.clone(),
                }),
            };
            s.push(Tensor::new(name, shape, dtype, data)?)?;
        }
        Ok(s)
    }
}

/// Parses a size flag (`2GiB`, `512MiB`, `1048576`).
/// The `p` quantile (0..=1) of `v` in microseconds, sorting `v` (0 when empty).
pub fn quantile_us(v: &mut [std::time::Duration], p: f64) -> f64 {
    v.sort();
    v.get(((v.len().max(1) - 1) as f64 * p) as usize)
        .map_or(0.0, |d| d.as_secs_f64() * 1e6)
}

/// The UCX transports NIXL may use here, as the tables name them.
pub fn ucx_transports() -> String {
    match std::env::var("UCX_TLS") {
        Ok(v) if !v.trim().is_empty() => format!("UCX_TLS={v}"),
        _ => "UCX default transports (cma or shared memory on one host; tcp, rdma across hosts)"
            .into(),
    }
}

/// `UCX_MODULES=^ib` unless set, on a machine without InfiniBand devices: UCX's InfiniBand
/// module (with the libnl the NIXL wheel bundles) crashes at exit where there is no such device.
/// And UCX's TCP segments at [`capture_arena::config::UCX_TCP_SEG_SIZE`] unless set (both
/// directions: a READ over TCP is sent back in segments of that size; BENCHMARKS.md).
/// Called first thing in `main`, while the process has one thread; children inherit it.
#[cfg(feature = "nixl")]
pub fn ucx_defaults() {
    let has_ib = std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some());
    if std::env::var_os("UCX_MODULES").is_none() && !has_ib {
        std::env::set_var("UCX_MODULES", "^ib");
    }
    for var in ["UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"] {
        if std::env::var_os(var).is_none() {
            std::env::set_var(var, capture_arena::config::UCX_TCP_SEG_SIZE);
        }
    }
    // A host arena's NIXL READs are served by a process of its own: this executable's
    // `nixl-serve` (UCX can abort the process it runs in; the producer is not that process).
    let var = capture_arena::config::ENV_NIXL_SERVER;
    if std::env::var_os(var).is_none() {
        if let Ok(exe) = std::env::current_exe() {
            let argv = [exe.to_string_lossy().into_owned(), "nixl-serve".to_owned()];
            if let Ok(json) = serde_json::to_string(&argv) {
                std::env::set_var(var, json);
            }
        }
    }
}

/// `capture-arena nixl-serve NAME LEN AGENT` (see [`capture_arena::memory::nixl::serve`]).
#[cfg(feature = "nixl")]
#[derive(Debug, clap::Args)]
pub struct NixlServeArgs {
    /// The arena's shared-memory name.
    name: String,
    /// Its data bytes.
    len: u64,
    /// The agent's name.
    agent: String,
}

#[cfg(feature = "nixl")]
pub fn nixl_serve(a: NixlServeArgs) -> anyhow::Result<std::process::ExitCode> {
    capture_arena::memory::nixl::serve(&a.name, a.len, &a.agent)?;
    Ok(std::process::ExitCode::SUCCESS)
}

pub fn size_arg(s: &str) -> Result<u64, String> {
    parse_bytes(s)
}

/// Formats bytes as GiB with two decimals.
pub fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pattern_is_the_documented_one() {
        // The content pattern of docs/commands.md, from its published constants: 64-bit FNV-1a (offset basis
        // 0xcbf29ce484222325, prime 0x100000001b3) has these known answers...
        assert_eq!(key_hash(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(key_hash("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(key_hash("foobar"), 0x8594_4171_f739_67e8);
        // ...and byte i of key "a" is byte i % 8 (little-endian) of h XOR (w << 32 | w), w = i / 8
        // (computed by an independent implementation).
        let mut b = [0u8; 12];
        fill("a", &mut b);
        assert_eq!(b, [140, 236, 1, 134, 76, 220, 99, 175, 141, 236, 1, 134]);
    }

    #[test]
    fn pattern_round_trips_and_catches_shifts() {
        for n in [0, 1, 7, 8, 9, 1000] {
            let mut b = vec![0u8; n];
            fill("a/b/g1/c", &mut b);
            assert_eq!(verify("a/b/g1/c", &b), None);
            if n > 0 {
                assert!(
                    verify("a/b/g1/d", &b).is_some(),
                    "another key's pattern differs"
                );
            }
        }
        let mut b = vec![0u8; 64];
        fill("k", &mut b);
        b[37] ^= 1;
        assert_eq!(verify("k", &b), Some(37));
        // Documented formula, first word.
        let mut one = [0u8; 8];
        fill("k", &mut one);
        assert_eq!(u64::from_le_bytes(one), key_hash("k"));
        let mut two = [0u8; 16];
        fill("k", &mut two);
        assert_eq!(
            u64::from_le_bytes(two[8..].try_into().unwrap()),
            key_hash("k") ^ (1 << 32 | 1)
        );
    }

    #[test]
    fn lengths_stay_in_range_and_seed_scenario_matches_the_seed() {
        let w = Workload {
            samples: 1000,
            min_len: 512,
            max_len: 4096,
            hidden: 4096,
            aux_layers: 3,
            batch: 8,
            seed: 1,
            store_id: "d".into(),
            seed_scenario: false,
        };
        assert!((0..1000).all(|i| (512..=4096).contains(&w.len_of(i))));
        let s = Workload {
            seed_scenario: true,
            ..w.clone()
        }
        .resolved()
        .unwrap();
        let total = s.total_bytes() as f64 / (1u64 << 30) as f64;
        assert!((total - 6.47).abs() < 0.01, "{total}");
        // The largest batch, against every index collected and chunked (as it was computed).
        for batch in [8, 7] {
            let by_hand = (0..1000)
                .collect::<Vec<usize>>()
                .chunks(batch)
                .map(|c| c.iter().map(|&i| w.bytes_of(i)).sum::<u64>())
                .max();
            let wb = Workload { batch, ..w.clone() };
            assert_eq!(Some(wb.max_batch_bytes()), by_hand, "batch {batch}");
        }
    }

    #[test]
    fn workloads_whose_sizes_overflow_or_that_are_too_many_are_refused_with_the_flags_named() {
        // Before: --hidden 2^62 overflowed bytes_of (a panic in a debug build, a wrong arena size
        // in a release one), and --samples 10^10 collected every index (80 GB) to size a batch.
        let w = Workload {
            samples: 128,
            min_len: 512,
            max_len: 4096,
            hidden: 1 << 62,
            aux_layers: 3,
            batch: 8,
            seed: 1,
            store_id: "d".into(),
            seed_scenario: false,
        };
        let e = w.resolved().unwrap_err().to_string();
        assert!(
            e.contains("--hidden 4611686018427387904") && e.contains("does not fit in 64 bits"),
            "{e}"
        );
        let e = Workload {
            hidden: 4096,
            samples: MAX_SAMPLES + 1,
            ..w.clone()
        }
        .resolved()
        .unwrap_err()
        .to_string();
        assert!(e.contains(&format!("--samples {}", MAX_SAMPLES + 1)), "{e}");
        let e = Workload {
            hidden: 4096,
            batch: 1 << 62,
            ..w
        }
        .resolved()
        .unwrap_err()
        .to_string();
        assert!(e.contains("--batch 4611686018427387904"), "{e}");
    }
}
