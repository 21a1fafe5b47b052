//! `capture-arena consume`: read result lines on stdin, read and verify every byte, free each
//! sample. Other lines that are JSON objects with a `"stats"` key (a producer's final line) are
//! passed over.
//!
//! stdout: with `--progress`, one line per sample `{"sample_id", "bytes", "read_us", "ok"}`;
//! always a final `{"summary": {...}}` line.
//!
//! Input is untrusted: a line longer than [`MAX_RESULT_LINE`] is skipped (counted as bad), and a
//! result is validated, and each feature checked against its arena, before any buffer is sized
//! from it.

use std::io::{BufRead, Read, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use capture_arena::client::FeatureStore;
use capture_arena::{ReadBuffer, SampleResult};
use serde::Serialize;

use crate::workload::{quantile_us, verify, Gpu};

/// Flags of `consume`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub gpu: Gpu,
    /// Skip checking the content pattern (read and free only).
    #[arg(long)]
    pub no_verify: bool,
    /// One JSON line per sample on stdout.
    #[arg(long)]
    pub progress: bool,
    /// No human summary on stderr.
    #[arg(long)]
    pub quiet: bool,
}

/// The longest result line read (a result is about a kilobyte).
pub const MAX_RESULT_LINE: usize = 1 << 20;

/// Reads one line of at most `max` bytes into `buf` (without its newline). `Ok(None)` at the
/// end of input; `Ok(Some(false))` for a line that was too long (the rest of it is skipped).
fn read_line(r: &mut impl BufRead, buf: &mut Vec<u8>, max: usize) -> std::io::Result<Option<bool>> {
    buf.clear();
    let n = r.by_ref().take(max as u64 + 1).read_until(b'\n', buf)?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() == Some(&b'\n') {
        buf.pop();
        return Ok(Some(true));
    }
    if buf.len() <= max {
        return Ok(Some(true)); // the last line, without a newline
    }
    // Too long: skip to the end of the line without keeping it.
    loop {
        let chunk = r.fill_buf()?;
        if chunk.is_empty() {
            break;
        }
        match chunk.iter().position(|&b| b == b'\n') {
            Some(i) => {
                r.consume(i + 1);
                break;
            }
            None => {
                let l = chunk.len();
                r.consume(l);
            }
        }
    }
    buf.clear();
    Ok(Some(false))
}

/// The final line of `consume`.
#[derive(Debug, Default, Serialize)]
pub struct Summary {
    pub samples: u64,
    pub bytes: u64,
    pub read_s: f64,
    /// Seconds spent checking the content pattern (not the data path).
    pub verify_s: f64,
    /// Seconds spent in `release` (sending the frees).
    pub free_s: f64,
    pub free_p50_us: f64,
    pub free_p99_us: f64,
    pub read_gbps: f64,
    pub read_p50_ms: f64,
    pub read_p99_ms: f64,
    pub mismatches: u64,
    pub failed_samples: u64,
    pub bad_lines: u64,
    pub first_error: Option<String>,
    /// Frees still waiting at exit (their endpoint unreachable), and frees dropped (their
    /// producer provably gone, or too many waiting).
    pub pending_frees: u64,
    pub dropped_frees: u64,
    pub ok: bool,
}

/// Host outputs: page-aligned slices of one `ReadBuffer`, so a transport that registers memory
/// (NIXL) registers it once, not on every read; replaced by a larger one (at least double) when a
/// sample needs more.
#[derive(Default)]
struct HostOuts {
    buf: Option<ReadBuffer>,
    spans: Vec<(usize, usize)>,
}

/// Lays out `lens` one after another, each from a page boundary of `page` bytes (this host's page
/// size, 64 KiB on Grace): fills `spans` with `(offset, len)` and returns the bytes needed.
fn spans(lens: &[usize], page: usize, spans: &mut Vec<(usize, usize)>) -> usize {
    spans.clear();
    let mut end = 0usize;
    for &n in lens {
        spans.push((end, n));
        let rounded = capture_arena::page::round_up_to_page(n, page).unwrap_or(usize::MAX);
        end = end.saturating_add(rounded);
    }
    end
}

impl HostOuts {
    fn reserve(&mut self, lens: &[usize]) -> capture_arena::Result<()> {
        let end = spans(lens, capture_arena::page::page_size(), &mut self.spans);
        let have = self.buf.as_ref().map_or(0, |b| b.len());
        if have < end.max(1) {
            self.buf = None; // the old one (and its registrations) goes first
            self.buf = Some(ReadBuffer::new(end.max(1).max(have.saturating_mul(2)))?);
        }
        Ok(())
    }

    fn outs<'a>(&'a mut self, names: &[&'a str]) -> Vec<(&'a str, &'a mut [u8])> {
        let mut rest: &mut [u8] = self.buf.as_deref_mut().unwrap_or_default();
        let mut at = 0;
        let mut outs = Vec::with_capacity(names.len());
        for (name, &(off, n)) in names.iter().zip(&self.spans) {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(off - at);
            let (out, tail) = tail.split_at_mut(n);
            outs.push((*name, out));
            rest = tail;
            at = off + n;
        }
        outs
    }

    fn get(&self, i: usize) -> &[u8] {
        let (off, n) = self.spans[i];
        self.buf.as_deref().map_or(&[][..], |b| &b[off..off + n])
    }
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let store = FeatureStore::new();
    let mut bufs: Vec<Vec<u8>> = Vec::new();
    let mut host = HostOuts::default();
    let mut device = match args.gpu.ordinal() {
        Some(g) => Some(crate::gpu::Outs::new(g)?),
        None => None,
    };
    let mut lat: Vec<Duration> = Vec::new();
    let mut free_lat: Vec<Duration> = Vec::new();
    let mut s = Summary::default();
    let mut out = std::io::stdout().lock();
    let note = |s: &mut Summary, e: String| {
        if !args.quiet {
            eprintln!("consume: {e}");
        }
        s.first_error.get_or_insert(e);
    };
    let mut input = std::io::stdin().lock();
    let mut line = Vec::new();
    while let Some(whole) =
        read_line(&mut input, &mut line, MAX_RESULT_LINE).context("reading stdin")?
    {
        if !whole {
            s.bad_lines += 1;
            note(
                &mut s,
                format!("a line longer than {MAX_RESULT_LINE} bytes was skipped"),
            );
            continue;
        }
        if line.trim_ascii().is_empty() {
            continue;
        }
        let v: serde_json::Value = match serde_json::from_slice(&line) {
            Ok(v) => v,
            Err(e) => {
                s.bad_lines += 1;
                note(&mut s, format!("not JSON: {e}"));
                continue;
            }
        };
        if v.get("stats").is_some() {
            continue;
        }
        let p = match serde_json::from_value::<SampleResult>(v) {
            Ok(SampleResult::Published(p)) => p,
            Ok(SampleResult::Failed(f)) => {
                s.failed_samples += 1;
                note(
                    &mut s,
                    format!("sample {} failed: {}", f.sample_id, f.error),
                );
                continue;
            }
            Err(e) => {
                s.bad_lines += 1;
                note(&mut s, format!("not a result: {e}"));
                continue;
            }
        };
        let t0 = Instant::now();
        // Device buffer allocation and the copy back for the check are not the read.
        let mut extra = Duration::ZERO;
        let names: Vec<&str> = p.features.keys().map(String::as_str).collect();
        // Validated, every feature checked against the arena and all of them against its size,
        // before sizing a buffer; then one request for all of them.
        let read = store
            .checked_lens(&p, &names)
            .and_then(|lens| {
                lens.into_iter()
                    .zip(&names)
                    .map(|(len, n)| {
                        usize::try_from(len).map_err(|_| capture_arena::Error::InvalidRead {
                            key: (*n).to_owned(),
                            reason: format!("{len} bytes do not fit in memory"),
                        })
                    })
                    .collect::<capture_arena::Result<Vec<usize>>>()
            })
            .and_then(|lens| {
                if let Some(dev) = device.as_mut() {
                    bufs.resize_with(lens.len(), Vec::new);
                    for (b, &n) in bufs.iter_mut().zip(&lens) {
                        b.resize(n, 0);
                    }
                    // Into device buffers (allocated before the clock starts counting reads
                    // only once per size), then back to host for the check.
                    let t_alloc = Instant::now();
                    dev.reserve(&lens)?;
                    extra += t_alloc.elapsed();
                    store.get_many_to(&p, &mut dev.destinations(&names))?;
                    if !args.no_verify {
                        let t_down = Instant::now();
                        dev.download(&mut bufs)?;
                        extra += t_down.elapsed();
                    }
                } else {
                    host.reserve(&lens)?;
                    store.get_many_into(&p, &mut host.outs(&names))?;
                }
                Ok(lens.iter().map(|&n| n as u64).sum::<u64>())
            });
        let (bytes, read_err) = match read {
            Ok(b) => (b, None),
            Err(e) => (0, Some(e)),
        };
        let took = t0.elapsed().saturating_sub(extra);
        let mut ok = read_err.is_none();
        // A result refused as invalid names nothing this trainer may free. A stale one is
        // released: its producer may be alive behind a partition (a read that timed out), and
        // the client drops the frees only once the producer is provably gone.
        let stale = matches!(
            read_err,
            Some(
                capture_arena::Error::InvalidRead { .. }
                    | capture_arena::Error::InvalidKey { .. }
                    | capture_arena::Error::OutOfRange { .. }
                    | capture_arena::Error::InvalidSession { .. }
            )
        );
        if let Some(e) = read_err {
            note(&mut s, format!("sample {}: {e}", p.sample_id));
        } else if !args.no_verify {
            let t_verify = Instant::now();
            for (i, name) in names.iter().enumerate() {
                let buf = match &device {
                    Some(_) => bufs[i].as_slice(),
                    None => host.get(i),
                };
                let key = p.key(name).map(|k| k.to_string()).unwrap_or_default();
                if let Some(at) = verify(&key, buf) {
                    ok = false;
                    note(&mut s, format!("{key}: byte {at} differs from the pattern"));
                }
            }
            s.verify_s += t_verify.elapsed().as_secs_f64();
        }
        if !ok {
            s.mismatches += 1;
        }
        if !stale {
            let t_free = Instant::now();
            if let Err(e) = store.release(&p) {
                tracing::warn!(error = %e, "free not sent yet; retrying later");
            }
            let took = t_free.elapsed();
            s.free_s += took.as_secs_f64();
            free_lat.push(took);
        }
        s.samples += 1;
        s.bytes += bytes;
        s.read_s += took.as_secs_f64();
        lat.push(took);
        if args.progress {
            let l = serde_json::json!({"sample_id": p.sample_id, "bytes": bytes,
                                       "read_us": took.as_secs_f64() * 1e6, "ok": ok});
            writeln!(out, "{l}")?;
            out.flush()?;
        }
    }
    // Frees go out from senders of their own: give them a few seconds before exiting.
    if let Err(e) = store.flush_within(Duration::from_secs(5)) {
        tracing::warn!(error = %e, "frees still waiting at exit");
    }
    let health = store.health();
    s.pending_frees = health.pending_frees;
    s.dropped_frees = health.dropped_frees;
    let pending = health.pending_frees;
    if pending > 0 {
        note(&mut s, format!("{pending} frees could not be sent"));
    }
    s.read_p50_ms = quantile_us(&mut lat, 0.5) / 1e3;
    s.read_p99_ms = quantile_us(&mut lat, 0.99) / 1e3;
    s.free_p50_us = quantile_us(&mut free_lat, 0.5);
    s.free_p99_us = quantile_us(&mut free_lat, 0.99);
    s.read_gbps = s.bytes as f64 / s.read_s.max(1e-9) / 1e9;
    s.ok = s.mismatches == 0 && s.failed_samples == 0 && s.bad_lines == 0 && pending == 0;
    writeln!(out, "{}", serde_json::json!({ "summary": &s }))?;
    out.flush()?;
    if !args.quiet {
        eprintln!(
            "consume: {} samples, {:.2} GiB, read {:.2} GB/s, p50 {:.2} ms, p99 {:.2} ms, {} mismatches",
            s.samples,
            s.bytes as f64 / (1u64 << 30) as f64,
            s.read_gbps,
            s.read_p50_ms,
            s.read_p99_ms,
            s.mismatches
        );
    }
    Ok(if s.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_output_starts_on_a_page_at_64k_and_4k() {
        let mut v = Vec::new();
        let lens = [1usize, 65536, 65537, 0, 10];
        assert_eq!(spans(&lens, 64 << 10, &mut v), 5 * 65536);
        assert_eq!(
            v,
            [
                (0, 1),
                (65536, 65536),
                (131072, 65537),
                (262144, 0),
                (262144, 10)
            ]
        );
        assert_eq!(spans(&lens, 4096, &mut v), 4096 + 65536 + 69632 + 4096);
        assert!(v.iter().all(|&(o, _)| o % 4096 == 0));
    }
}
