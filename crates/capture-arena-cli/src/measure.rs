//! Measurement helpers every benchmark command shares: a table row, the median, the machine's
//! description, and the one-object samples the rows publish. Below every command.

use std::sync::Arc;
use std::time::Duration;

use capture_arena::{Dtype, Sample, Tensor, TensorData};
use serde::Serialize;

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub what: &'static str,
    pub bytes: u64,
    pub gbps: f64,
    pub ratio_to_memcpy: f64,
    /// Median time of one operation (per object for end_to_end).
    pub median_us: f64,
}

#[derive(Clone)]
pub(crate) struct Src(pub(crate) Arc<Vec<u8>>);
impl AsRef<[u8]> for Src {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

pub(crate) fn sample(id: usize, src: &Src, replace: bool) -> anyhow::Result<Sample> {
    let mut s = Sample::new("bench", &format!("s{id}"), 1)?.with_replace(replace);
    let n = src.0.len() as u64;
    s.push(Tensor::new(
        "x",
        vec![n],
        Dtype::Uint8,
        TensorData::host(src.clone()),
    )?)?;
    Ok(s)
}

pub(crate) fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// The machine, printed next to every table.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cpu}, {cores} cores, Linux {}", kernel.trim())
}
