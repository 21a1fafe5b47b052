//! `capture-arena produce`: run an arena, publish synthetic samples, serve frees until every
//! object is freed.
//!
//! stdout: one result JSON per line (flushed per line), then one final line
//! `{"stats": {...}, "ok": bool, "error": null | "...", "elapsed_s": f, "publish_gbps": f,
//! "publish_s": f, "generate_s": f, ...}` (`generate_s`: filling the synthetic samples, which is
//! not part of the data path).

use std::collections::VecDeque;
use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use capture_arena::{BatchHandle, Config, SampleResult, Writer};
use indicatif::{ProgressBar, ProgressStyle};

use crate::workload::{gib, size_arg, Gpu, Pool, Workload};

/// Flags of `produce`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub workload: Workload,
    #[command(flatten)]
    pub gpu: Gpu,
    /// Arena size, e.g. 2GiB (default: $SGLANG_SPEC_CAPTURE_ARENA_BYTES). Other settings come
    /// from the SGLANG_SPEC_CAPTURE_* variables.
    #[arg(long, value_parser = size_arg)]
    pub arena_bytes: Option<u64>,
    /// Fail if, once everything is published, no free arrives for this many seconds.
    #[arg(long, default_value_t = 60.0)]
    pub idle_timeout: f64,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

fn bar(quiet: bool, n: u64, what: &str) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(n).with_message(what.to_owned());
    b.set_style(
        ProgressStyle::with_template("{msg:>10} [{bar:40}] {pos}/{len} {per_sec}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    b
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let w = args.workload.resolved()?;
    let idle = Duration::try_from_secs_f64(args.idle_timeout).map_err(|_| {
        anyhow::anyhow!(
            "--idle-timeout {} is not a number of seconds >= 0",
            args.idle_timeout
        )
    })?;
    let mut config = Config::from_env()?;
    if let Some(b) = args.arena_bytes {
        config.arena_bytes = Some(b);
    }
    if let Some(g) = args.gpu.ordinal() {
        config.gpu_put = Some(true);
        config.device = Some(g);
    }
    let capacity = config
        .required_arena_bytes()
        .context("pass --arena-bytes or set SGLANG_SPEC_CAPTURE_ARENA_BYTES")?;
    let need = w.max_batch_bytes() + (w.batch as u64) * 4 * config.alignment;
    anyhow::ensure!(
        need <= capacity,
        "the largest batch needs {need} bytes but the arena holds {capacity}; raise --arena-bytes \
         (SGLANG_SPEC_CAPTURE_ARENA_BYTES) or lower --batch / --max-len"
    );
    let writer = Writer::start(&config).with_context(|| {
        format!(
            "starting the arena ({capacity} bytes: --arena-bytes, else \
             SGLANG_SPEC_CAPTURE_ARENA_BYTES; where memory is short, the largest batch needs \
             {need}, so a smaller arena needs a smaller --batch or --max-len too)"
        )
    })?;
    remove_arena_on_signal(writer.memory_session())?;
    tracing::info!(
        samples = w.samples,
        total = %gib(w.total_bytes()),
        arena = %gib(capacity),
        "producing"
    );
    let t0 = Instant::now();
    let published = bar(args.quiet, w.samples as u64, "published");
    let mut out = std::io::stdout().lock();
    let mut error: Option<String> = None;
    let mut inflight: VecDeque<BatchHandle> = VecDeque::new();
    let mut emit = |h: BatchHandle, error: &mut Option<String>| -> anyhow::Result<()> {
        for r in h.wait_results() {
            if let SampleResult::Failed(f) = &r {
                error.get_or_insert_with(|| f.error.clone());
            }
            serde_json::to_writer(&mut out, &r)?;
            out.write_all(b"\n")?;
            out.flush().context("writing results to stdout")?;
            published.inc(1);
        }
        Ok(())
    };
    let ids: Vec<usize> = (0..w.samples).collect();
    let pool = Pool::default();
    let mut generate = Duration::ZERO;
    for chunk in ids.chunks(w.batch) {
        if error.is_some() {
            break;
        }
        let t_gen = Instant::now();
        let samples = chunk
            .iter()
            .map(|&i| w.sample(i, &pool, args.gpu.ordinal()))
            .collect::<anyhow::Result<Vec<_>>>()?;
        generate += t_gen.elapsed();
        inflight.push_back(writer.submit(samples)?);
        while inflight.len() > config.max_pending_batches {
            if let Some(h) = inflight.pop_front() {
                emit(h, &mut error)?;
            }
        }
    }
    while let Some(h) = inflight.pop_front() {
        emit(h, &mut error)?;
    }
    published.finish_and_clear();
    // Serve frees until every published object is freed, or none arrives for idle_timeout.
    let freed = bar(args.quiet, writer.stats().published_objects, "freed");
    let mut last = u64::MAX;
    let stats = loop {
        let (s, _) = writer.wait_for(idle, |s| {
            s.freed_objects >= s.published_objects || s.freed_objects != last
        });
        freed.set_position(s.freed_objects);
        if s.freed_objects >= s.published_objects {
            break s;
        }
        if s.freed_objects == last {
            error.get_or_insert_with(|| {
                format!(
                    "no free arrived for {:.0} s with {} of {} objects still resident; is a \
                     trainer reading and freeing? (--idle-timeout)",
                    idle.as_secs_f64(),
                    s.resident_objects,
                    s.published_objects
                )
            });
            break s;
        }
        last = s.freed_objects;
    };
    freed.finish_and_clear();
    let ok = error.is_none() && stats.free_bytes == stats.capacity;
    let line = serde_json::json!({
        "stats": stats,
        "ok": ok,
        "error": error,
        "elapsed_s": t0.elapsed().as_secs_f64(),
        "publish_gbps": stats.published_bytes as f64 / (stats.copy_ns.max(1) as f64),
        "publish_s": stats.copy_ns as f64 / 1e9,
        "generate_s": generate.as_secs_f64(),
        "capacity": capacity,
        "session": writer.arena_ref().session,
        "control": writer.arena_ref().control,
    });
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()?;
    if let Some(e) = &error {
        eprintln!("produce failed: {e}");
    }
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// On SIGINT, SIGTERM or SIGHUP, remove the arena's shared memory and exit: a producer stopped by
/// Ctrl-C or by its supervisor must not leave `arena_bytes` of `/dev/shm` behind.
pub(crate) fn remove_arena_on_signal(session: &str) -> anyhow::Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    // Device memory goes with the process; only shared memory outlives it. Decided before any
    // handler is installed: signal-hook leaves a signal ignored once its handler is dropped.
    let Ok(session) = session.parse::<capture_arena::memory::ShmSession>() else {
        return Ok(());
    };
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
        .context("installing signal handlers")?;
    std::thread::Builder::new()
        .name("produce-signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                if let Err(e) = capture_arena::memory::shm::remove(&session) {
                    eprintln!("produce: {e}");
                }
                eprintln!("produce: stopped by signal {sig}; arena removed");
                // Die by the signal itself, so a shell running us in a loop sees it.
                let _ = signal_hook::low_level::emulate_default_handler(sig);
                std::process::exit(128 + sig);
            }
        })
        .context("starting the signal thread")?;
    Ok(())
}
