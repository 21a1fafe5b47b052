//! `capture-arena bench`: memcpy (the limit), publish, read, view and end-to-end bandwidth,
//! measured side by side in one run for each size, with a table, optional JSON and a PNG plot.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::Context;
use capture_arena::client::FeatureStore;
use capture_arena::{Config, Published, Reader, Writer};

use crate::measure::{machine, median, sample, Row, Src};
use crate::workload::{fill, size_arg};

/// Flags of `bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Sizes to measure, comma-separated.
    #[arg(long, value_delimiter = ',', value_parser = size_arg, default_value = "1MiB,16MiB,100MiB,1GiB")]
    pub sizes: Vec<u64>,
    /// Repetitions per measurement for a 100 MiB size (scaled for others; median reported).
    #[arg(long, default_value_t = 15)]
    pub reps: usize,
    /// Write the table as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw bandwidth vs size as a PNG here.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// With --device: the GPU rows (d2d_copy, publish_device, read_device from another
    /// process, end_to_end_device, batch_16x4_device) instead of the host ones.
    #[command(flatten)]
    pub gpu: crate::workload::Gpu,
    /// `nixl`: the NIXL rows (memcpy, nixl_read, nixl_batch_16) read from a producer process
    /// through NIXL, over the UCX transports UCX_TLS names, instead of the shared-memory ones.
    #[arg(long, default_value = "auto", value_parser = ["auto", "nixl"])]
    pub transport: String,
}

/// Views per timed run.
const VIEWS: u32 = 1000;

fn measure(size: u64, reps: usize) -> anyhow::Result<Vec<Row>> {
    let n = usize::try_from(size)?;
    let mut buf = vec![0u8; n];
    fill("bench/src", &mut buf);
    let src = Src(Arc::new(buf));
    let mut dst = vec![1u8; n];
    let gbps = |d: Duration| size as f64 / d.as_secs_f64() / 1e9;

    let arena = 3 * size + (1 << 20);
    let w = Writer::start(&Config {
        arena_bytes: Some(arena),
        ..Config::default()
    })?;
    let mut current = w.submit(vec![sample(0, &src, false)?])?.wait()?.remove(0);
    let reader = Reader::new();
    reader.read(&current, "x", &mut dst)?;
    anyhow::ensure!(
        dst == *src.0,
        "read returned other bytes than were published"
    );
    // Interleaved: each round times every operation once, so a slow moment of this shared
    // machine hits all of them alike and the ratios stay meaningful.
    let mut t: [Vec<Duration>; 4] = Default::default();
    for _ in 0..reps {
        let t0 = Instant::now();
        dst.copy_from_slice(&src.0);
        std::hint::black_box(&dst);
        t[0].push(t0.elapsed());
        let t0 = Instant::now();
        current = w.submit(vec![sample(0, &src, true)?])?.wait()?.remove(0);
        t[1].push(t0.elapsed());
        let t0 = Instant::now();
        reader.read(&current, "x", &mut dst)?;
        t[2].push(t0.elapsed());
    }
    // view is O(1): time a run of them, steady state, so the figure is the view's own cost and
    // not the cache misses left behind by the copies above.
    for _ in 0..reps {
        let t0 = Instant::now();
        for _ in 0..VIEWS {
            // SAFETY: nothing frees or replaces `current` while the view lives (this loop is
            // the only client, and it drops the view before the next iteration).
            let v = unsafe { reader.view(&current, "x") }?;
            std::hint::black_box(v.len());
        }
        t[3].push(t0.elapsed() / VIEWS);
    }
    let [memcpy, publish, read, view] = t.map(median);
    drop(w);

    // End to end: a producer thread publishes distinct samples while a trainer thread reads
    // each one (a second copy) and frees it over the control socket.
    let k = (4 * reps).max(4);
    let w = Writer::start(&Config {
        arena_bytes: Some(arena),
        ..Config::default()
    })?;
    let (tx, rx) = mpsc::channel::<Published>();
    let store = FeatureStore::new();
    store.reader().open(&w.arena_ref().session)?; // map before the clock starts
    let mut out = vec![1u8; n];
    let t0 = Instant::now();
    let trainer = std::thread::spawn(move || -> anyhow::Result<()> {
        for p in rx {
            store.get_into(&p, "x", &mut out)?;
            store.release(&p)?;
        }
        Ok(())
    });
    for i in 0..k {
        let tx = tx.clone();
        w.submit_with(vec![sample(i, &src, false)?], move |o| {
            if let Ok(mut p) = o {
                let _ = tx.send(p.remove(0));
            }
        })?;
    }
    drop(tx);
    trainer
        .join()
        .map_err(|_| anyhow::anyhow!("trainer thread panicked"))??;
    let e2e = t0.elapsed() / k as u32;
    let (s, ok) = w.wait_for(Duration::from_secs(30), |s| s.freed_objects == k as u64);
    anyhow::ensure!(
        ok && s.published_objects == k as u64,
        "end-to-end run lost samples: {s:?}"
    );

    let base = gbps(memcpy);
    Ok([
        ("memcpy", memcpy),
        ("publish", publish),
        ("read", read),
        ("view", view),
        ("end_to_end", e2e),
    ]
    .into_iter()
    .map(|(what, d)| Row {
        what,
        bytes: size,
        gbps: gbps(d),
        ratio_to_memcpy: gbps(d) / base,
        median_us: d.as_secs_f64() * 1e6,
    })
    .collect())
}

fn reps_for(size: u64, reps_100m: usize) -> usize {
    let scaled = (reps_100m as f64 * (100.0 * 1048576.0 / size as f64).sqrt()).round() as usize;
    scaled.clamp(3, 200)
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let machine = machine();
    println!("capture-arena bench on {machine}");
    println!(
        "{:<18} {:>12} {:>12} {:>10} {:>14}",
        "what", "bytes", "GB/s", "x memcpy", "median us"
    );
    if args.gpu.device {
        crate::gpu::Outs::new(args.gpu.gpu)?;
        println!(
            "(device rows: x memcpy is x d2d_copy of the same bytes on GPU {})",
            args.gpu.gpu
        );
    }
    let nixl = args.transport == "nixl";
    if nixl {
        anyhow::ensure!(
            cfg!(feature = "nixl"),
            "--transport nixl needs a build with the nixl feature (cargo build --release -p \
             capture-arena-cli --features nixl)"
        );
        anyhow::ensure!(
            !args.gpu.device,
            "--transport nixl measures host arenas; drop --device"
        );
        println!(
            "(nixl rows: a producer process serves the arena through NIXL over {})",
            crate::workload::ucx_transports()
        );
    }
    let mut rows = Vec::new();
    for &size in &args.sizes {
        let reps = reps_for(size, args.reps);
        let measured = if nixl {
            crate::nixl_bench::bench(size, reps)
        } else if args.gpu.device {
            crate::device::bench(size, reps, args.gpu.gpu)
        } else {
            measure(size, reps)
        };
        for r in measured.with_context(|| format!("measuring {size} bytes"))? {
            println!(
                "{:<18} {:>12} {:>12.2} {:>10.3} {:>14.1}",
                r.what, r.bytes, r.gbps, r.ratio_to_memcpy, r.median_us
            );
            rows.push(r);
        }
    }
    if let Some(p) = &args.json {
        let doc = serde_json::json!({
            "machine": machine,
            "transports": if nixl { crate::workload::ucx_transports() } else { "shm".into() },
            "rows": rows,
        });
        std::fs::write(p, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    if let Some(p) = &args.plot {
        plot(p, &rows, &machine).with_context(|| format!("drawing {}", p.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}

fn plot(path: &std::path::Path, rows: &[Row], machine: &str) -> anyhow::Result<()> {
    use plotters::prelude::*;
    plotters::style::register_font(
        "sans-serif",
        FontStyle::Normal,
        include_bytes!("../assets/DejaVuSans.ttf"),
    )
    .map_err(|_| anyhow::anyhow!("embedded font did not load"))?;
    let root = BitMapBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let shown: Vec<&Row> = rows.iter().filter(|r| r.what != "view").collect();
    let mib = |b: u64| b as f64 / 1048576.0;
    let (xmin, xmax) = shown.iter().fold((f64::MAX, 0f64), |(a, b), r| {
        (a.min(mib(r.bytes)), b.max(mib(r.bytes)))
    });
    let ymax = shown.iter().map(|r| r.gbps).fold(0.0, f64::max) * 1.15;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("capture-arena bandwidth ({machine})"),
            ("sans-serif", 16),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d((xmin * 0.8..xmax * 1.25).log_scale(), 0.0..ymax.max(0.1))?;
    chart
        .configure_mesh()
        .x_desc("MiB per object (log scale)")
        .y_desc("GB/s (median)")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()?;
    let series = [
        "memcpy",
        "publish",
        "read",
        "end_to_end",
        "nixl_read",
        "nixl_batch_16",
    ];
    for (i, what) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let pts: Vec<(f64, f64)> = shown
            .iter()
            .filter(|r| r.what == *what)
            .map(|r| (mib(r.bytes), r.gbps))
            .collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
            .label(*what)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
