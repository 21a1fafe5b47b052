//! `capture-arena demo`: the main job. Starts a producer process whose arena is smaller than the
//! data it publishes and a trainer process that reads, verifies and frees every sample; results
//! flow from one to the other through this process (a stand-in for the inference server's HTTP
//! response). Ends with a table and a check that the arena is completely free.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::Instant;

use anyhow::{bail, Context};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use serde_json::Value;

use crate::workload::{gib, size_arg, Workload};

/// Flags of `demo`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub workload: Workload,
    /// Arena size (default: 2 GiB, or less when the data is small, so that frees must flow back).
    #[arg(long, value_parser = size_arg)]
    pub arena_bytes: Option<u64>,
    /// Fail if frees stop arriving for this many seconds.
    #[arg(long, default_value_t = 60.0)]
    pub idle_timeout: f64,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
}

/// A child process that is stopped (SIGTERM, then SIGKILL after 5 s) and reaped if the demo
/// returns early (an error), so a failed run leaves no producer holding its arena.
struct Reaped(Option<Child>);

impl Reaped {
    fn new(c: Child) -> Reaped {
        Reaped(Some(c))
    }

    fn get(&mut self) -> &mut Child {
        self.0.as_mut().expect("present until wait")
    }

    fn wait(mut self) -> std::io::Result<std::process::ExitStatus> {
        let mut c = self.0.take().expect("present until wait");
        c.wait()
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        let Some(c) = &mut self.0 else { return };
        // SIGTERM first, so a producer removes its arena; SIGKILL if it does not go.
        if let Ok(pid) = libc::pid_t::try_from(c.id()) {
            // SAFETY: plain FFI; `pid` is our own child, not yet reaped, so not reused.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        for _ in 0..50 {
            if matches!(c.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let _ = c.kill();
        let _ = c.wait();
    }
}

fn style() -> ProgressStyle {
    ProgressStyle::with_template("{msg:>10} [{bar:40}] {pos}/{len} {per_sec:>12} {elapsed}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ")
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let w = args.workload.resolved()?;
    let total = w.total_bytes();
    let slack = (w.batch as u64) * 4 * 4096;
    let arena = args
        .arena_bytes
        .unwrap_or_else(|| (2u64 << 30).min(total / 2).max(w.max_batch_bytes() + slack));
    if arena >= total {
        eprintln!(
            "note: the arena ({}) holds all the data ({}); frees need not flow back for this run",
            gib(arena),
            gib(total)
        );
    }
    let exe = std::env::current_exe().context("finding the capture-arena executable")?;
    let mut producer = Command::new(&exe)
        .arg("produce")
        .args(["--samples", &w.samples.to_string()])
        .args([
            "--min-len",
            &w.min_len.to_string(),
            "--max-len",
            &w.max_len.to_string(),
        ])
        .args([
            "--hidden",
            &w.hidden.to_string(),
            "--aux-layers",
            &w.aux_layers.to_string(),
        ])
        .args([
            "--batch",
            &w.batch.to_string(),
            "--seed",
            &w.seed.to_string(),
        ])
        .args([
            "--store-id",
            &w.store_id,
            "--arena-bytes",
            &arena.to_string(),
        ])
        .args(["--idle-timeout", &args.idle_timeout.to_string(), "--quiet"])
        .stdout(Stdio::piped())
        .spawn()
        .map(Reaped::new)
        .context("starting the producer process")?;
    let mut trainer = Command::new(&exe)
        .args(["consume", "--progress", "--quiet"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .map(Reaped::new)
        .context("starting the trainer process")?;
    let t0 = Instant::now();
    let bars = if args.quiet {
        MultiProgress::with_draw_target(indicatif::ProgressDrawTarget::hidden())
    } else {
        MultiProgress::new()
    };
    let n = w.samples as u64;
    let published = bars.add(
        ProgressBar::new(n)
            .with_style(style())
            .with_message("published"),
    );
    let read = bars.add(ProgressBar::new(n).with_style(style()).with_message("read"));
    let freed = bars.add(
        ProgressBar::new(n)
            .with_style(style())
            .with_message("freed"),
    );

    // Producer stdout -> trainer stdin, counting results; keep the producer's final line.
    let p_out = producer.get().stdout.take().context("producer stdout")?;
    let mut t_in = trainer.get().stdin.take().context("trainer stdin")?;
    let pub_bar = published.clone();
    let forward = std::thread::spawn(move || -> anyhow::Result<Option<Value>> {
        let mut last = None;
        for line in BufReader::new(p_out).lines() {
            let line = line?;
            let v: Value = serde_json::from_str(&line).context("producer wrote a non-JSON line")?;
            if v.get("stats").is_some() {
                last = Some(v);
                continue;
            }
            pub_bar.inc(1);
            t_in.write_all(line.as_bytes())?;
            t_in.write_all(b"\n")?;
            t_in.flush()?;
        }
        drop(t_in);
        Ok(last)
    });

    let mut summary = None;
    let mut lat_ok = true;
    let t_out = trainer.get().stdout.take().context("trainer stdout")?;
    for line in BufReader::new(t_out).lines() {
        let v: Value = serde_json::from_str(&line?).context("trainer wrote a non-JSON line")?;
        if let Some(s) = v.get("summary") {
            summary = Some(s.clone());
        } else {
            read.inc(1);
            freed.inc(1);
            lat_ok &= v["ok"].as_bool().unwrap_or(false);
        }
    }
    let producer_final = forward
        .join()
        .map_err(|_| anyhow::anyhow!("forwarding thread panicked"))??;
    let p_status = producer.wait()?;
    let t_status = trainer.wait()?;
    let elapsed = t0.elapsed();
    for b in [&published, &read, &freed] {
        b.finish();
    }
    drop(bars);

    let Some(pf) = producer_final else {
        bail!("the producer exited ({p_status}) without its final stats line")
    };
    let Some(sm) = summary else {
        bail!("the trainer exited ({t_status}) without its summary")
    };
    let st = &pf["stats"];
    let u = |v: &Value, k: &str| v[k].as_u64().unwrap_or(0);
    let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(0.0);
    let capacity = u(st, "capacity");
    let free_end = u(st, "free_bytes");
    let checks = [
        (
            "producer exited cleanly",
            p_status.success() && pf["ok"].as_bool() == Some(true),
        ),
        (
            "trainer exited cleanly",
            t_status.success() && sm["ok"].as_bool() == Some(true),
        ),
        ("every sample published", u(st, "published_samples") == n),
        (
            "every sample read and verified",
            u(&sm, "samples") == n && u(&sm, "mismatches") == 0 && lat_ok,
        ),
        (
            "every object freed",
            u(st, "freed_objects") == u(st, "published_objects"),
        ),
        (
            "arena completely free",
            free_end == capacity && u(st, "resident_objects") == 0,
        ),
    ];
    let moved = u(&sm, "bytes");
    println!();
    println!(
        "capture-arena demo: {} samples, {} through a {} arena",
        n,
        gib(moved),
        gib(capacity)
    );
    let row = |k: &str, v: String| println!("  {k:<32} {v}");
    row(
        "samples",
        format!(
            "{} published, {} read and verified",
            u(st, "published_samples"),
            u(&sm, "samples")
        ),
    );
    row("moved", gib(moved));
    row(
        "publish",
        format!(
            "{:.2} GB/s  (writer copy into the arena)",
            f(&pf, "publish_gbps")
        ),
    );
    row(
        "read",
        format!(
            "{:.2} GB/s  (trainer copy out of the arena)",
            f(&sm, "read_gbps")
        ),
    );
    row(
        "end to end",
        format!(
            "{:.2} GB/s  (producer start to last free, {:.1} s)",
            moved as f64 / elapsed.as_secs_f64() / 1e9,
            elapsed.as_secs_f64()
        ),
    );
    row(
        "read latency / sample",
        format!(
            "p50 {:.2} ms, p99 {:.2} ms",
            f(&sm, "read_p50_ms"),
            f(&sm, "read_p99_ms")
        ),
    );
    row(
        "waits for frees",
        format!(
            "{} batches, {:.2} s in all",
            u(st, "waits"),
            u(st, "wait_ns") as f64 / 1e9
        ),
    );
    row(
        "arena free at the end",
        format!("{free_end} of {capacity} bytes"),
    );
    let mut ok = true;
    for (what, pass) in checks {
        ok &= pass;
        row(what, if pass { "ok".into() } else { "FAILED".into() });
    }
    if let Some(e) = pf["error"].as_str().or(sm["first_error"].as_str()) {
        row("first error", e.to_owned());
    }
    row("result", if ok { "OK".into() } else { "FAILED".into() });
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
