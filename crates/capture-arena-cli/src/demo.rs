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

use crate::workload::{gib, size_arg, Gpu, Workload};

/// Flags of `demo`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub workload: Workload,
    #[command(flatten)]
    pub gpu: Gpu,
    /// Arena size (default: 2 GiB, or less when the data is small, so that frees must flow back).
    #[arg(long, value_parser = size_arg)]
    pub arena_bytes: Option<u64>,
    /// Fail if frees stop arriving for this many seconds.
    #[arg(long, default_value_t = 60.0)]
    pub idle_timeout: f64,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
    /// How the trainer reaches the arena: `auto` (shared memory, or CUDA handles with --device)
    /// or `nixl` (the arena registered with a NIXL agent, read through UCX as a trainer on
    /// another host would; needs a build with the nixl feature and the NIXL library).
    #[arg(long, default_value = "auto", value_parser = ["auto", "nixl"])]
    pub transport: String,
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

/// Sends child `c` SIGTERM (a producer then removes its arena, where SIGKILL would leave it to
/// the next sweep).
pub(crate) fn terminate(c: &Child) {
    if let Ok(pid) = libc::pid_t::try_from(c.id()) {
        // SAFETY: plain FFI; `pid` is our own child, not yet reaped, so not reused.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        let Some(c) = &mut self.0 else { return };
        // SIGTERM first, so a producer removes its arena; SIGKILL if it does not go.
        terminate(c);
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

/// Has the kernel send `c`'s process SIGTERM when this process ends, however it ends (a SIGTERM
/// from a supervisor or `timeout`, SIGKILL, a crash): [`Reaped`] runs only on a return, and an
/// orphaned producer would hold its arena until its idle timeout.
fn ends_with_us(c: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: pre_exec runs in the forked child before exec; prctl and getppid are
    // async-signal-safe FFI calls that touch no memory of ours.
    unsafe {
        let parent = libc::getpid();
        c.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // This process may have ended before the request was made: then no signal comes.
            if libc::getppid() != parent {
                // No allocation here (between fork and exec): only the errno reaches the parent.
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        })
    }
}

/// A bar over bytes, with the sample count and rate in its message (see [`Progress`]).
fn style() -> ProgressStyle {
    ProgressStyle::with_template(
        "{prefix:>10} [{bar:32}] {bytes:>10}/{total_bytes:<10} {binary_bytes_per_sec:>12} {msg} {elapsed}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ")
}

/// One bar: bytes as its position, samples and samples/s in its message.
#[derive(Clone)]
struct Progress {
    bar: ProgressBar,
    samples: u64,
    total: u64,
    t0: Instant,
}

impl Progress {
    fn new(bars: &MultiProgress, what: &str, bytes: u64, samples: u64) -> Progress {
        let bar = bars.add(
            ProgressBar::new(bytes)
                .with_style(style())
                .with_prefix(what.to_owned()),
        );
        Progress {
            bar,
            samples: 0,
            total: samples,
            t0: Instant::now(),
        }
    }

    fn add(&mut self, bytes: u64) {
        self.samples += 1;
        self.bar.inc(bytes);
        let rate = self.samples as f64 / self.t0.elapsed().as_secs_f64().max(1e-9);
        self.bar.set_message(format!(
            "{:>4}/{} samples {:>6.1}/s",
            self.samples, self.total, rate
        ));
    }
}

/// Bytes of a result line's features.
fn result_bytes(v: &Value) -> u64 {
    let item =
        |d: &str| capture_arena::Dtype::from_name(d).map_or(0, capture_arena::Dtype::item_size);
    v["features"].as_object().map_or(0, |f| {
        f.values()
            .map(|x| {
                let n: u64 = x["shape"]
                    .as_array()
                    .map_or(0, |s| s.iter().map(|d| d.as_u64().unwrap_or(0)).product());
                n * item(x["dtype"].as_str().unwrap_or(""))
            })
            .sum()
    })
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let w = args.workload.resolved()?;
    let total = w.total_bytes();
    let slack = (w.batch as u64) * 4 * capture_arena::config::MAX_ALIGNMENT;
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
    if args.transport == "nixl" && !cfg!(feature = "nixl") {
        bail!("--transport nixl needs a build with the nixl feature (cargo build --release -p capture-arena-cli --features nixl)");
    }
    let exe = std::env::current_exe().context("finding the capture-arena executable")?;
    let mut producer = Command::new(&exe);
    producer
        .env(capture_arena::config::ENV_TRANSPORT, &args.transport)
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
        .args(args.gpu.flags())
        .stdout(Stdio::piped());
    let mut producer = ends_with_us(&mut producer)
        .spawn()
        .map(Reaped::new)
        .context("starting the producer process")?;
    let mut trainer = Command::new(&exe);
    trainer
        .args(["consume", "--progress", "--quiet"])
        .args(args.gpu.flags())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    let mut trainer = ends_with_us(&mut trainer)
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
    let published = Progress::new(&bars, "published", total, n);
    let mut read = Progress::new(&bars, "read", total, n);
    let mut freed = Progress::new(&bars, "freed", total, n);

    // Producer stdout -> trainer stdin, counting results; keep the producer's final line.
    let p_out = producer.get().stdout.take().context("producer stdout")?;
    let mut t_in = trainer.get().stdin.take().context("trainer stdin")?;
    let mut pub_bar = published.clone();
    let forward = std::thread::spawn(move || -> anyhow::Result<Option<Value>> {
        let mut last = None;
        for line in BufReader::new(p_out).lines() {
            let line = line?;
            let v: Value = serde_json::from_str(&line).context("producer wrote a non-JSON line")?;
            if v.get("stats").is_some() {
                last = Some(v);
                continue;
            }
            pub_bar.add(result_bytes(&v));
            t_in.write_all(line.as_bytes())
                .and_then(|()| t_in.write_all(b"\n"))
                .and_then(|()| t_in.flush())
                .context("writing a result to the trainer")?;
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
            let bytes = v["bytes"].as_u64().unwrap_or(0);
            read.add(bytes);
            freed.add(bytes);
            lat_ok &= v["ok"].as_bool().unwrap_or(false);
        }
    }
    // The trainer's output ended: it exited. One that died without its summary (killed, out of
    // memory) frees nothing more, so its producer is stopped (it would wait for frees) and the
    // trainer's own status is the error, not the broken pipe the forwarding then meets.
    let t_status = trainer.wait()?;
    if summary.is_none() && !t_status.success() {
        drop(producer);
        let _ = forward.join();
        bail!(
            "the trainer process failed ({t_status}) after reading {} samples",
            read.samples
        );
    }
    let producer_final = forward
        .join()
        .map_err(|_| anyhow::anyhow!("forwarding thread panicked"))?
        .context("forwarding results from the producer to the trainer")?;
    let p_status = producer.wait()?;
    let elapsed = t0.elapsed();
    for b in [&published, &read, &freed] {
        b.bar.finish();
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
    let session = pf["session"].as_str().unwrap_or("?");
    row(
        "arena",
        if session.starts_with("nixl://") {
            let short: String = session.chars().take(72).collect();
            format!(
                "{} memory served through NIXL ({}): {short}...",
                if args.gpu.device { "device" } else { "host" },
                crate::workload::ucx_transports()
            )
        } else if session.starts_with("cuda://") {
            format!(
                "GPU {} (device memory; trainer reads into device buffers): {session}",
                args.gpu.gpu
            )
        } else {
            format!("host shared memory: {session}")
        },
    );
    // The data path: what capture-arena itself does with the bytes.
    let publish_s = f(&pf, "publish_s");
    let (read_s, free_s) = (f(&sm, "read_s"), f(&sm, "free_s"));
    let gbps = |b: u64, secs: f64| b as f64 / secs.max(1e-9) / 1e9;
    println!("  data path (what capture-arena does):");
    row(
        "  publish",
        format!(
            "{:.2} GB/s  (writer copy into the arena, {publish_s:.2} s)",
            gbps(moved, publish_s)
        ),
    );
    row(
        "  read",
        format!(
            "{:.2} GB/s  (trainer copy out of the arena, {read_s:.2} s)",
            gbps(moved, read_s)
        ),
    );
    row(
        "  free",
        format!(
            "p50 {:.0} us, p99 {:.0} us per sample release ({free_s:.2} s in all)",
            f(&sm, "free_p50_us"),
            f(&sm, "free_p99_us")
        ),
    );
    row(
        "  publish + read + free",
        format!(
            "{:.2} GB/s  ({:.2} s)",
            gbps(moved, publish_s + read_s + free_s),
            publish_s + read_s + free_s
        ),
    );
    // Around it: the demo's own work, and the wall clock.
    let (gen_s, verify_s) = (f(&pf, "generate_s"), f(&sm, "verify_s"));
    println!("  around it (the demo's own work):");
    row(
        "  generate",
        format!(
            "{:.2} GB/s  (producer fills synthetic samples, {gen_s:.2} s)",
            gbps(moved, gen_s)
        ),
    );
    row(
        "  verify",
        format!(
            "{:.2} GB/s  (trainer checks every byte, {verify_s:.2} s)",
            gbps(moved, verify_s)
        ),
    );
    row(
        "  wall clock",
        format!(
            "{:.2} GB/s  (producer start to last free, {:.1} s: process start, generate, \
             publish, read, verify, free and waits, on {} cores)",
            gbps(moved, elapsed.as_secs_f64()),
            elapsed.as_secs_f64(),
            std::thread::available_parallelism().map_or(0, |n| n.get())
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
