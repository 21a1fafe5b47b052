//! `capture-arena consume`: read result lines on stdin, read and verify every byte, free each
//! sample. Other lines that are JSON objects with a `"stats"` key (a producer's final line) are
//! passed over.
//!
//! stdout: with `--progress`, one line per sample `{"sample_id", "bytes", "read_us", "ok"}`;
//! always a final `{"summary": {...}}` line.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use capture_arena::client::Store;
use capture_arena::SampleResult;
use serde::Serialize;

use crate::workload::verify;

/// Flags of `consume`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
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

/// The final line of `consume`.
#[derive(Debug, Default, Serialize)]
pub struct Summary {
    pub samples: u64,
    pub bytes: u64,
    pub read_s: f64,
    pub read_gbps: f64,
    pub read_p50_ms: f64,
    pub read_p99_ms: f64,
    pub mismatches: u64,
    pub failed_samples: u64,
    pub bad_lines: u64,
    pub first_error: Option<String>,
    pub ok: bool,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let store = Store::new();
    let mut bufs: HashMap<String, Vec<u8>> = HashMap::new();
    let mut lat: Vec<Duration> = Vec::new();
    let mut s = Summary::default();
    let mut out = std::io::stdout().lock();
    let note = |s: &mut Summary, e: String| {
        if !args.quiet {
            eprintln!("consume: {e}");
        }
        s.first_error.get_or_insert(e);
    };
    for line in std::io::stdin().lock().lines() {
        let line = line.context("reading stdin")?;
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = match serde_json::from_str(&line) {
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
        let mut bytes = 0u64;
        let mut read_err = None;
        for (name, f) in &p.features {
            let n = f
                .byte_len()
                .and_then(|n| usize::try_from(n).ok())
                .unwrap_or(0);
            let buf = bufs.entry(name.clone()).or_default();
            buf.resize(n, 0);
            if let Err(e) = store.get_into(&p, name, buf) {
                read_err = Some(e);
                break;
            }
            bytes += n as u64;
        }
        let took = t0.elapsed();
        let mut ok = read_err.is_none();
        // A producer that is gone has no objects left to free.
        let stale = matches!(read_err, Some(capture_arena::Error::StaleSession { .. }));
        if let Some(e) = read_err {
            note(&mut s, format!("sample {}: {e}", p.sample_id));
        } else if !args.no_verify {
            for (name, buf) in p.features.keys().map(|n| (n, &bufs[n])) {
                let key = format!("{}/{}/g{}/{name}", p.store_id, p.sample_id, p.gen);
                if let Some(at) = verify(&key, buf) {
                    ok = false;
                    note(&mut s, format!("{key}: byte {at} differs from the pattern"));
                }
            }
        }
        if !ok {
            s.mismatches += 1;
        }
        if stale {
            // nothing to release
        } else if let Err(e) = store.release(&p) {
            tracing::warn!(error = %e, "free not sent yet; retrying later");
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
    for _ in 0..50 {
        if store.flush().is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let pending = store.health().pending_frees;
    if pending > 0 {
        note(&mut s, format!("{pending} frees could not be sent"));
    }
    lat.sort();
    let q = |p: f64| {
        lat.get(((lat.len().max(1) - 1) as f64 * p) as usize)
            .map_or(0.0, |d| d.as_secs_f64() * 1e3)
    };
    s.read_p50_ms = q(0.5);
    s.read_p99_ms = q(0.99);
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
