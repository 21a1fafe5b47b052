//! A one-sample batch's round trip through the writer thread (submit → result), p50 and p99,
//! for a 4 KiB and a 1 MiB tensor published again and again with `replace`.
//!
//! `cargo run --release -p capture-arena --example round_trip`
//!
//! It uses only API that older commits have too, so the same file measures them side by side.

use std::sync::Arc;
use std::time::Instant;

use capture_arena::{Config, Dtype, Sample, Tensor, TensorData, Writer};

#[derive(Clone)]
struct Shared(Arc<Vec<u8>>);

impl AsRef<[u8]> for Shared {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

fn main() -> Result<(), capture_arena::Error> {
    let w = Writer::start(&Config {
        arena_bytes: Some(64 << 20),
        ..Config::default()
    })?;
    for (size, rounds) in [(4096usize, 10_000), (1 << 20, 2_000)] {
        let buf = Shared(Arc::new(vec![1u8; size]));
        let mut lat = Vec::with_capacity(rounds);
        for i in 0..rounds + 100 {
            let mut s = Sample::new("rt", "s", 1)?.with_replace(true);
            let data = TensorData::host(buf.clone());
            s.push(Tensor::new("x", vec![size as u64], Dtype::Uint8, data)?)?;
            let t0 = Instant::now();
            w.submit(vec![s])?.wait()?;
            if i >= 100 {
                lat.push(t0.elapsed());
            }
        }
        lat.sort();
        let q = |p: f64| lat[((lat.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e6;
        println!(
            "{size:>8} bytes: p50 {:.1} us, p99 {:.1} us",
            q(0.5),
            q(0.99)
        );
    }
    Ok(())
}
