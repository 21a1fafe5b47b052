//! `capture-arena soak`: load and abuse for a fixed time, then the books must balance.
//!
//! One writer (in this process, a real control port) publishes batches at full rate; trainer
//! clients (threads, each its own `FeatureStore`) read every byte of every sample and release
//! it; hostile clients meanwhile send garbage, unfinished lines, `[]` floods, wrong tokens and
//! idle connections. At the end (publication stopped, every sample read): every byte free, every
//! published object freed exactly once (`unknown_frees` 0), no sample lost, and the process's RSS
//! growth reported. The arena has a control token (`auto` unless one is configured), as one
//! reachable by others should. Prints a table and one JSON line; exits non-zero if a check fails.

use std::io::Write;
use std::net::TcpStream;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use capture_arena::client::FeatureStore;
use capture_arena::{Config, Dtype, Published, Sample, SampleResult, Tensor, TensorData, Writer};

use crate::workload::{fill, quantile_us, size_arg, verify};

/// Flags of `soak`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Seconds of load.
    #[arg(long, default_value_t = 60.0)]
    pub duration: f64,
    /// Concurrent control clients in all (trainers + hostile).
    #[arg(long, default_value_t = 64)]
    pub clients: usize,
    /// How many of them are hostile.
    #[arg(long, default_value_t = 8)]
    pub hostile: usize,
    /// Samples per batch.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Bytes per sample (4 tensors).
    #[arg(long, value_parser = size_arg, default_value = "256KiB")]
    pub sample_bytes: u64,
    /// Arena size.
    #[arg(long, value_parser = size_arg, default_value = "64MiB")]
    pub arena_bytes: u64,
}

/// This process's private resident memory (`RssAnon`): what a leak grows. (Plain RSS counts
/// every trainer's mapping of the shared arena again.)
fn rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("RssAnon:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

/// One hostile client's loop until `stop`: a different abuse per `kind`. Kinds 0-2 are buggy
/// clients that have the token (so the parser and the line bounds are exercised), 3 guesses it,
/// 4 idles without it.
fn hostile(control: &str, token: Option<&str>, kind: usize, stop: &AtomicBool) -> u64 {
    let mut sent = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut c) = TcpStream::connect(control) else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let _ = c.set_write_timeout(Some(Duration::from_millis(200)));
        if let (Some(t), true) = (token, kind % 5 < 3) {
            let _ = c.write_all(format!("{}\n", capture_arena::control::token_line(t)).as_bytes());
        }
        let payload: Vec<u8> = match kind % 5 {
            0 => b"garbage \x00\xff not json\n".repeat(64),
            1 => b"[]\n".repeat(4096),
            2 => {
                // An unfinished line, then silence until the server gives up on it.
                let _ = c.write_all(b"[\"partial");
                std::thread::sleep(Duration::from_millis(300));
                Vec::new()
            }
            3 => b"{\"token\": \"wrong-token-0123456789\"}\n[\"soak/x/g1/t0\"]\n".to_vec(),
            _ => {
                // Idle: hold a connection slot a while.
                std::thread::sleep(Duration::from_millis(300));
                Vec::new()
            }
        };
        if c.write_all(&payload).is_ok() {
            sent += payload.len() as u64;
        }
    }
    sent
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let duration = Duration::try_from_secs_f64(args.duration)
        .map_err(|_| anyhow::anyhow!("--duration {} is not a number of seconds", args.duration))?;
    anyhow::ensure!(
        args.hostile < args.clients,
        "--hostile {} leaves no trainer among --clients {}",
        args.hostile,
        args.clients
    );
    let per_tensor = usize::try_from(args.sample_bytes / 4)?.max(1);
    let from_env = Config::from_env()?;
    let writer = Writer::start(&Config {
        arena_bytes: Some(args.arena_bytes),
        arena_wait: Duration::from_secs(30),
        // With a token, as a producer reachable by others should run: the hostile clients'
        // frees must be refused, the trainers' (token from the results) applied.
        control_token: from_env.control_token.clone().or(Some("auto".into())),
        ..from_env
    })
    .context("starting the arena")?;
    let control = writer.arena_ref().control.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::sync_channel::<Published>(4 * args.batch);
    let rx = Arc::new(Mutex::new(rx));
    let read_bytes = Arc::new(AtomicU64::new(0));
    let mismatches = Arc::new(AtomicU64::new(0));
    let free_lat = Arc::new(Mutex::new(Vec::<Duration>::new()));

    let trainers: Vec<_> = (0..args.clients - args.hostile)
        .map(|_| {
            let (rx, read_bytes, mismatches, free_lat) = (
                rx.clone(),
                read_bytes.clone(),
                mismatches.clone(),
                free_lat.clone(),
            );
            std::thread::spawn(move || -> anyhow::Result<u64> {
                let store = FeatureStore::new();
                let mut buf = vec![0u8; per_tensor];
                let mut samples = 0;
                loop {
                    let next = rx.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.recv();
                    let Ok(p) = next else { return Ok(samples) };
                    for name in p.features.keys() {
                        store.get_into(&p, name, &mut buf)?;
                        let key = p.key(name)?.to_string();
                        if verify(&key, &buf).is_some() {
                            mismatches.fetch_add(1, Ordering::Relaxed);
                        }
                        read_bytes.fetch_add(buf.len() as u64, Ordering::Relaxed);
                    }
                    let t0 = Instant::now();
                    store.release(&p)?;
                    let took = t0.elapsed();
                    if let Ok(mut l) = free_lat.lock() {
                        l.push(took);
                    }
                    samples += 1;
                }
            })
        })
        .collect();
    let attackers: Vec<_> = (0..args.hostile)
        .map(|k| {
            let (control, stop) = (control.clone(), stop.clone());
            let token = writer.arena_ref().token.clone();
            std::thread::spawn(move || hostile(&control, token.as_deref(), k, &stop))
        })
        .collect();

    // Warm up, then take the RSS baseline.
    let mut next_id = 0u64;
    let mut make_batch = |n: usize| -> anyhow::Result<Vec<Sample>> {
        (0..n)
            .map(|_| {
                next_id += 1;
                let mut s = Sample::new("soak", &format!("s{next_id}"), 1)?;
                for t in 0..4 {
                    let key = format!("soak/s{next_id}/g1/t{t}");
                    let mut data = vec![0u8; per_tensor];
                    fill(&key, &mut data);
                    s.push(Tensor::new(
                        format!("t{t}"),
                        vec![per_tensor as u64],
                        Dtype::Uint8,
                        TensorData::host(data),
                    )?)?;
                }
                Ok(s)
            })
            .collect()
    };
    let mut submit_lat = Vec::new();
    let publish = |batch: Vec<Sample>, lat: &mut Vec<Duration>| -> anyhow::Result<u64> {
        let t0 = Instant::now();
        let results = writer.submit(batch)?.wait_results();
        lat.push(t0.elapsed());
        let mut failed = 0;
        for r in results {
            match r {
                SampleResult::Published(p) => tx.send(p).context("trainers are gone")?,
                SampleResult::Failed(f) => {
                    failed += 1;
                    tracing::warn!(sample = %f.sample_id, error = %f.error, "batch failed");
                }
            }
        }
        Ok(failed)
    };
    let mut failed = 0;
    for _ in 0..4 {
        failed += publish(make_batch(args.batch)?, &mut Vec::new())?;
    }
    let rss0 = rss();
    let t0 = Instant::now();
    let mut batches = 0u64;
    while t0.elapsed() < duration {
        failed += publish(make_batch(args.batch)?, &mut submit_lat)?;
        batches += 1;
    }
    let elapsed = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    drop(tx);
    let mut trained = 0;
    for t in trainers {
        trained += t
            .join()
            .map_err(|_| anyhow::anyhow!("a trainer thread panicked"))??;
    }
    let mut hostile_bytes = 0;
    for a in attackers {
        hostile_bytes += a
            .join()
            .map_err(|_| anyhow::anyhow!("a hostile thread panicked"))?;
    }
    let (s, settled) = writer.wait_for(Duration::from_secs(30), |s| {
        s.resident_objects == 0 && s.freed_objects == s.published_objects
    });
    let rss1 = rss();
    let mut frees = free_lat.lock().map(|l| l.clone()).unwrap_or_default();
    let checks = [
        ("no batch failed", failed == 0),
        (
            "every sample read and verified",
            mismatches.load(Ordering::Relaxed) == 0,
        ),
        (
            "every published sample reached a trainer",
            trained == s.published_samples,
        ),
        (
            "every published object freed exactly once",
            settled && s.unknown_frees == 0,
        ),
        ("arena completely free", s.free_bytes == s.capacity),
    ];
    let ok = checks.iter().all(|(_, pass)| *pass);
    let row = |k: &str, v: String| println!("  {k:<44} {v}");
    println!(
        "capture-arena soak: {:.1} s, {} trainers, {} hostile clients",
        elapsed.as_secs_f64(),
        args.clients - args.hostile,
        args.hostile
    );
    row(
        "published",
        format!(
            "{} batches, {} samples, {} objects, {:.2} GB/s",
            s.published_batches,
            s.published_samples,
            s.published_objects,
            s.published_bytes as f64 / elapsed.as_secs_f64() / 1e9
        ),
    );
    row(
        "submit -> result per batch",
        format!(
            "p50 {:.0} us, p99 {:.0} us",
            quantile_us(&mut submit_lat, 0.5),
            quantile_us(&mut submit_lat, 0.99)
        ),
    );
    row(
        "release per sample (trainer side)",
        format!(
            "p50 {:.0} us, p99 {:.0} us",
            quantile_us(&mut frees, 0.5),
            quantile_us(&mut frees, 0.99)
        ),
    );
    row(
        "hostile input",
        format!(
            "{hostile_bytes} bytes sent; bad lines {}, unauthorized {}, timed out {}, refused \
             connections {}",
            s.bad_lines, s.unauthorized_lines, s.timed_out_lines, s.refused_connections
        ),
    );
    row(
        "private memory (RssAnon) growth over the run",
        format!(
            "{:+.1} MiB ({} -> {} bytes)",
            (rss1 as f64 - rss0 as f64) / 1048576.0,
            rss0,
            rss1
        ),
    );
    for (what, pass) in checks {
        row(what, if pass { "ok".into() } else { "FAILED".into() });
    }
    let line = serde_json::json!({
        "ok": ok,
        "seconds": elapsed.as_secs_f64(),
        "batches": batches,
        "stats": s,
        "submit_p50_us": quantile_us(&mut submit_lat, 0.5),
        "submit_p99_us": quantile_us(&mut submit_lat, 0.99),
        "free_p50_us": quantile_us(&mut frees, 0.5),
        "free_p99_us": quantile_us(&mut frees, 0.99),
        "hostile_bytes": hostile_bytes,
        "rss_growth_bytes": rss1 as i64 - rss0 as i64,
        "read_bytes": read_bytes.load(Ordering::Relaxed),
    });
    println!("{line}");
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
