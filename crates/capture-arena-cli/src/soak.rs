//! `capture-arena soak`: load and abuse for a fixed time, then the books must balance.
//!
//! The producer runs in its own process (`soak-producer`, a child of this one, with a real
//! control port): it publishes batches at full rate, writes each result to its stdout, and
//! measures its own private memory. Here, trainer clients (threads, each its own
//! `FeatureStore`) read every byte of every sample and release it; hostile clients meanwhile
//! send garbage, unfinished lines, `[]` floods, wrong tokens, stats floods and idle
//! connections. At the end (publication stopped, every sample read): every byte free, every
//! published object freed exactly once (`unknown_frees` 0), no sample lost, and the producer's
//! memory growth reported. The arena has a control token (`auto` unless one is configured), as
//! one reachable by others should. Prints a table and one JSON line; exits non-zero if a check
//! fails.

use std::io::{BufRead, Write};
use std::net::TcpStream;
use std::process::{ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use capture_arena::client::FeatureStore;
use capture_arena::{Config, Published, Sample, SampleResult, StatsSnapshot, Writer};
use serde::{Deserialize, Serialize};

use crate::workload::{pattern_tensor, quantile_us, size_arg, verify};

/// The producer's private memory may grow this much after its warm-up: the control server's
/// line pool (16 MiB by default) and per-connection lines that hostile clients fill, with room.
const MAX_PRODUCER_GROWTH: i64 = 32 << 20;

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
    #[command(flatten)]
    pub load: Load,
}

/// What the producer publishes (passed on to `soak-producer`).
#[derive(Debug, Clone, clap::Args)]
pub struct Load {
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

/// Flags of `soak-producer` (internal: the producer half of `soak`).
#[derive(Debug, Clone, clap::Args)]
pub struct ProducerArgs {
    /// Seconds of publication.
    #[arg(long)]
    pub duration: f64,
    #[command(flatten)]
    pub load: Load,
}

/// The producer's last line: what it measured of itself.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ProducerEnd {
    stats: StatsSnapshot,
    /// Every published object freed, the arena free, within the wait after publication.
    settled: bool,
    batches: u64,
    failed: u64,
    seconds: f64,
    submit_p50_us: f64,
    submit_p99_us: f64,
    /// `RssAnon` after the warm-up, at the end, and its peak in between (bytes).
    rss_start: u64,
    rss_end: u64,
    rss_peak: u64,
    /// `(seconds since the warm-up, RssAnon)`, sampled through the run.
    rss_series: Vec<(f64, u64)>,
}

/// A fixed-size uniform sample of latencies (reservoir sampling), allocated and touched before
/// the memory baseline, so a run of hours neither grows the process nor distorts what it
/// measures.
struct Latencies {
    kept: Vec<Duration>,
    seen: u64,
    rng: u64,
}

impl Latencies {
    const KEEP: usize = 100_000;

    fn new() -> Latencies {
        Latencies {
            // Not zero: written now (zeroed memory could stay untouched until the run).
            kept: vec![Duration::from_nanos(1); Self::KEEP],
            seen: 0,
            rng: 0x9e37_79b9_7f4a_7c15,
        }
    }

    fn push(&mut self, d: Duration) {
        let slot = if (self.seen as usize) < Self::KEEP {
            Some(self.seen as usize)
        } else {
            // xorshift64: keep the new one with probability KEEP / seen.
            self.rng ^= self.rng << 13;
            self.rng ^= self.rng >> 7;
            self.rng ^= self.rng << 17;
            let j = self.rng % (self.seen + 1);
            (j < Self::KEEP as u64).then_some(j as usize)
        };
        if let Some(i) = slot {
            self.kept[i] = d;
        }
        self.seen += 1;
    }

    fn quantile_us(&self, q: f64) -> f64 {
        let n = (self.seen as usize).min(Self::KEEP);
        let mut v = self.kept[..n].to_vec();
        quantile_us(&mut v, q)
    }
}

/// This process's private resident memory (`RssAnon`): what a leak grows. (Plain RSS counts
/// the pages of the shared arena too.)
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

/// One hostile client's loop until `stop`: a different abuse per `kind`. Kinds 0-2 and 5 are
/// buggy clients that have the token (so the parser, the line bounds and the stats answers are
/// exercised), 3 guesses it, 4 idles without it.
fn hostile(control: &str, token: Option<&str>, kind: usize, stop: &AtomicBool) -> u64 {
    let mut sent = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut c) = TcpStream::connect(control) else {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let _ = c.set_write_timeout(Some(Duration::from_millis(200)));
        if let (Some(t), true) = (token, kind % 6 < 3 || kind % 6 == 5) {
            let _ = c.write_all(format!("{}\n", capture_arena::control::token_line(t)).as_bytes());
        }
        let payload: Vec<u8> = match kind % 6 {
            0 => b"garbage \x00\xff not json\n".repeat(64),
            1 => b"[]\n".repeat(4096),
            2 => {
                // An unfinished line, then silence until the server gives up on it.
                let _ = c.write_all(b"[\"partial");
                std::thread::sleep(Duration::from_millis(300));
                Vec::new()
            }
            3 => b"{\"token\": \"wrong-token-0123456789\"}\n[\"soak/x/g1/t0\"]\n".to_vec(),
            5 => {
                // Stats asked far more often than answered, answers never read.
                format!("{}\n", capture_arena::control::STATS_LINE)
                    .repeat(256)
                    .into_bytes()
            }
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
    anyhow::ensure!(
        Duration::try_from_secs_f64(args.duration).is_ok(),
        "--duration {} is not a number of seconds",
        args.duration
    );
    anyhow::ensure!(
        args.hostile < args.clients,
        "--hostile {} leaves no trainer among --clients {}",
        args.hostile,
        args.clients
    );
    let per_tensor = usize::try_from(args.load.sample_bytes / 4)?.max(1);
    let exe = std::env::current_exe().context("finding this executable")?;
    let mut child = std::process::Command::new(exe)
        .args(["soak-producer", "--duration", &args.duration.to_string()])
        .args(["--batch", &args.load.batch.to_string()])
        .args(["--sample-bytes", &args.load.sample_bytes.to_string()])
        .args(["--arena-bytes", &args.load.arena_bytes.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the producer process")?;
    let producer_pid = child.id();
    let stdout = child.stdout.take().context("the producer's stdout")?;
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::sync_channel::<Published>(4 * args.load.batch);
    let rx = Arc::new(Mutex::new(rx));
    let read_bytes = Arc::new(AtomicU64::new(0));
    let mismatches = Arc::new(AtomicU64::new(0));
    let free_lat = Arc::new(Mutex::new(Latencies::new()));

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

    // The producer's results go to the trainers; its first one starts the hostile clients (it
    // names the control endpoint and its token); its last line is what it measured.
    let mut attackers = Vec::new();
    let mut end: Option<ProducerEnd> = None;
    let mut failed_results = 0u64;
    let dispatch = || -> anyhow::Result<()> {
        for line in std::io::BufReader::new(stdout).lines() {
            let line = line.context("reading the producer's results")?;
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                if let Some(e) = v.get("soak_producer") {
                    end = Some(serde_json::from_value(e.clone())?);
                    continue;
                }
            }
            let p = match serde_json::from_str::<SampleResult>(&line)
                .with_context(|| format!("a result line from the producer: {line:.200}"))?
            {
                SampleResult::Published(p) => p,
                SampleResult::Failed(_) => {
                    failed_results += 1;
                    continue;
                }
            };
            if attackers.is_empty() {
                attackers = (0..args.hostile)
                    .map(|k| {
                        let (control, stop) = (p.arena.control.clone(), stop.clone());
                        let token = p.arena.token.clone();
                        std::thread::spawn(move || hostile(&control, token.as_deref(), k, &stop))
                    })
                    .collect();
            }
            // A send fails only when every trainer has stopped: their error is reported below.
            if tx.send(p).is_err() {
                anyhow::bail!("every trainer stopped");
            }
        }
        Ok(())
    };
    let dispatched = dispatch();
    stop.store(true, Ordering::Relaxed);
    drop(tx);
    if dispatched.is_err() {
        // Nobody reads its results or frees its samples any more: do not wait for it.
        crate::demo::terminate(&child);
    }
    let status = child.wait().context("waiting for the producer")?;
    let mut trained = 0;
    for t in trainers {
        trained += t
            .join()
            .map_err(|_| anyhow::anyhow!("a trainer thread panicked"))?
            .context("a trainer failed")?;
    }
    dispatched?;
    let mut hostile_bytes = 0;
    for a in attackers {
        hostile_bytes += a
            .join()
            .map_err(|_| anyhow::anyhow!("a hostile thread panicked"))?;
    }
    let end = end.with_context(|| {
        format!("the producer (pid {producer_pid}) ended without its report: {status}")
    })?;
    let s = end.stats;
    let (free_p50, free_p99) = free_lat
        .lock()
        .map(|l| (l.quantile_us(0.5), l.quantile_us(0.99)))
        .unwrap_or_default();
    let growth = end.rss_end as i64 - end.rss_start as i64;
    let checks = [
        ("producer exited cleanly", status.success()),
        ("no batch failed", end.failed == 0 && failed_results == 0),
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
            end.settled && s.unknown_frees == 0 && s.freed_objects == s.published_objects,
        ),
        ("arena completely free", s.free_bytes == s.capacity),
        (
            "producer memory flat (grew < 32 MiB after warm-up)",
            growth < MAX_PRODUCER_GROWTH,
        ),
    ];
    let ok = checks.iter().all(|(_, pass)| *pass);
    let mib = |b: i64| b as f64 / 1048576.0;
    let row = |k: &str, v: String| println!("  {k:<44} {v}");
    println!(
        "capture-arena soak: {:.1} s, {} trainers, {} hostile clients, producer pid {}",
        end.seconds,
        args.clients - args.hostile,
        args.hostile,
        producer_pid
    );
    row(
        "published",
        format!(
            "{} batches, {} samples, {} objects, {:.2} GB/s",
            s.published_batches,
            s.published_samples,
            s.published_objects,
            s.published_bytes as f64 / end.seconds / 1e9
        ),
    );
    row(
        "submit -> result per batch (producer)",
        format!(
            "p50 {:.0} us, p99 {:.0} us",
            end.submit_p50_us, end.submit_p99_us
        ),
    );
    row(
        "release per sample (trainer side)",
        format!("p50 {free_p50:.0} us, p99 {free_p99:.0} us",),
    );
    row(
        "hostile input",
        format!(
            "{hostile_bytes} bytes sent; bad lines {}, unauthorized {}, timed out {}, refused \
             connections {}, stats answered {}",
            s.bad_lines,
            s.unauthorized_lines,
            s.timed_out_lines,
            s.refused_connections,
            s.stats_requests
        ),
    );
    row(
        "producer private memory (RssAnon)",
        format!(
            "{:+.1} MiB from warm-up to end ({} -> {} bytes), peak {:+.1} MiB",
            mib(growth),
            end.rss_start,
            end.rss_end,
            mib(end.rss_peak as i64 - end.rss_start as i64)
        ),
    );
    for (what, pass) in checks {
        row(what, if pass { "ok".into() } else { "FAILED".into() });
    }
    let line = serde_json::json!({
        "ok": ok,
        "seconds": end.seconds,
        "batches": end.batches,
        "stats": s,
        "submit_p50_us": end.submit_p50_us,
        "submit_p99_us": end.submit_p99_us,
        "free_p50_us": free_p50,
        "free_p99_us": free_p99,
        "hostile_bytes": hostile_bytes,
        "producer_rss_start": end.rss_start,
        "producer_rss_end": end.rss_end,
        "producer_rss_peak": end.rss_peak,
        "producer_rss_growth_bytes": growth,
        "producer_rss_series": end.rss_series,
        "read_bytes": read_bytes.load(Ordering::Relaxed),
    });
    println!("{line}");
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The producer half: publishes for `duration`, then waits for every free.
pub fn serve(args: ProducerArgs) -> anyhow::Result<ExitCode> {
    let duration = Duration::try_from_secs_f64(args.duration)
        .map_err(|_| anyhow::anyhow!("--duration {} is not a number of seconds", args.duration))?;
    let load = args.load;
    let per_tensor = usize::try_from(load.sample_bytes / 4)?.max(1);
    let from_env = Config::from_env()?;
    let writer = Writer::start(&Config {
        arena_bytes: Some(load.arena_bytes),
        arena_wait: Duration::from_secs(30),
        // With a token, as a producer reachable by others should run: the hostile clients'
        // frees must be refused, the trainers' (token from the results) applied.
        control_token: from_env.control_token.clone().or(Some("auto".into())),
        ..from_env
    })
    .context("starting the arena")?;
    crate::produce::remove_arena_on_signal(writer.memory_session())?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let mut next_id = 0u64;
    let mut make_batch = |n: usize| -> anyhow::Result<Vec<Sample>> {
        (0..n)
            .map(|_| {
                next_id += 1;
                let mut s = Sample::new("soak", &format!("s{next_id}"), 1)?;
                for t in 0..4 {
                    let key = format!("soak/s{next_id}/g1/t{t}");
                    s.push(pattern_tensor(&format!("t{t}"), &key, per_tensor)?)?;
                }
                Ok(s)
            })
            .collect()
    };
    let mut publish = |batch: Vec<Sample>, lat: &mut Latencies| -> anyhow::Result<u64> {
        let t0 = Instant::now();
        let results = writer.submit(batch)?.wait_results();
        lat.push(t0.elapsed());
        let mut failed = 0;
        for r in results {
            if let SampleResult::Failed(f) = &r {
                failed += 1;
                tracing::warn!(sample = %f.sample_id, error = %f.error, "batch failed");
            }
            serde_json::to_writer(&mut out, &r)?;
            out.write_all(b"\n")?;
        }
        out.flush().context("the soak's trainers are gone")?;
        Ok(failed)
    };
    // Warm up, then take the memory baseline (with the latency sample already allocated).
    let mut failed = 0;
    let mut submit_lat = Latencies::new();
    let mut warm = Latencies::new();
    for _ in 0..4 {
        failed += publish(make_batch(load.batch)?, &mut warm)?;
    }
    drop(warm);
    let rss_start = rss();
    let mut rss_peak = rss_start;
    let mut rss_series = vec![(0.0, rss_start)];
    // About 200 samples of the memory over the run, at most one a second.
    let every = (duration / 200).max(Duration::from_secs(1));
    let mut next_sample = every;
    let t0 = Instant::now();
    let mut batches = 0u64;
    while t0.elapsed() < duration {
        failed += publish(make_batch(load.batch)?, &mut submit_lat)?;
        batches += 1;
        if t0.elapsed() >= next_sample {
            let now = rss();
            rss_peak = rss_peak.max(now);
            rss_series.push((t0.elapsed().as_secs_f64(), now));
            next_sample += every;
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    // Every result is written: the trainers read and free them all.
    let (stats, settled) = writer.wait_for(Duration::from_secs(60), |s| {
        s.resident_objects == 0 && s.freed_objects == s.published_objects
    });
    let rss_end = rss();
    rss_peak = rss_peak.max(rss_end);
    rss_series.push((t0.elapsed().as_secs_f64(), rss_end));
    let end = ProducerEnd {
        stats,
        settled,
        batches,
        failed,
        seconds,
        submit_p50_us: submit_lat.quantile_us(0.5),
        submit_p99_us: submit_lat.quantile_us(0.99),
        rss_start,
        rss_end,
        rss_peak,
        rss_series,
    };
    serde_json::to_writer(&mut out, &serde_json::json!({ "soak_producer": end }))?;
    out.write_all(b"\n")?;
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}
