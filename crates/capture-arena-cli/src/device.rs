//! The CLI's device commands: `device-info`, and the device rows of `bench` (`--device`).
//! Builds without the `cuda` feature say so when they are used.

use std::process::ExitCode;

#[cfg(not(feature = "cuda"))]
use crate::gpu::Outs;

/// Flags of `device-info`.
#[derive(Debug, Clone, clap::Args)]
pub struct InfoArgs {
    /// The GPU to probe (ordinal).
    #[arg(long, default_value_t = 0)]
    pub gpu: i32,
}

/// `device-info`: the driver, and a 2 MiB device arena made with each handle policy (with why
/// that handle type: NVML's fabric state, the fabric trial).
#[cfg(feature = "cuda")]
pub fn info(args: InfoArgs) -> anyhow::Result<ExitCode> {
    use capture_arena::config::HandlePreference;
    use capture_arena::memory::cuda::{driver, DeviceRegion, DeviceRegionOptions};
    use capture_arena::memory::Region;

    let d = driver()?;
    let mut arenas = serde_json::Map::new();
    for (name, handle) in [
        ("auto", HandlePreference::Auto),
        ("fd", HandlePreference::PosixFd),
        ("fabric", HandlePreference::Fabric),
    ] {
        let options = DeviceRegionOptions {
            device: args.gpu,
            handle,
        };
        let v = match DeviceRegion::create(2 << 20, &options) {
            Ok(r) => {
                let described = r
                    .reply("describe")
                    .and_then(Result::ok)
                    .and_then(|a| serde_json::from_slice::<serde_json::Value>(&a.bytes).ok());
                // Why this handle type (NVML's fabric state, the fabric trial's result).
                let why = r.handle_choice().reason.clone();
                serde_json::json!({"ok": true, "arena": described, "why": why})
            }
            Err(e) => serde_json::json!({"ok": false, "error": e.to_string()}),
        };
        arenas.insert(name.into(), v);
    }
    let out = serde_json::json!({
        "driver": {"library": d.library, "version": d.version, "devices": d.devices},
        "gpu": args.gpu,
        "arenas": arenas,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(ExitCode::SUCCESS)
}

#[cfg(not(feature = "cuda"))]
pub fn info(_args: InfoArgs) -> anyhow::Result<ExitCode> {
    Outs::new(0).map(|_| ExitCode::FAILURE)
}

/// `bench --device`: rows `d2d_copy` (the reference), `publish_device`, `read_device` (a
/// trainer in another process, reading into device memory through the imported handle),
/// `end_to_end_device`, and `batch_16x4_device` (a batch of 16 samples x 4 small tensors: the
/// writer's per-batch overhead), with `batch_1x1_device` (one small tensor: a batch's fixed cost)
/// and `batch_16x4_host` (the same batch of host bytes into a host arena: no CUDA call) beside it.
#[cfg(feature = "cuda")]
pub fn bench(size: u64, reps: usize, gpu: i32) -> anyhow::Result<Vec<crate::measure::Row>> {
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};

    use anyhow::Context;
    use capture_arena::memory::cuda::DeviceBuffer;
    use capture_arena::{Config, Dtype, Sample, Tensor, TensorData, Writer};

    let median = |mut v: Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let mut host = vec![0u8; usize::try_from(size)?];
    crate::workload::fill("bench/src", &mut host);
    let src = std::sync::Arc::new(DeviceBuffer::new(gpu, size)?);
    src.upload(0, &host)?;
    let dst = DeviceBuffer::new(gpu, size)?;
    let tensor = |name: &str, buf: &std::sync::Arc<DeviceBuffer>| -> anyhow::Result<Tensor> {
        // SAFETY: the buffer is device memory of its length on `gpu`, kept alive by the Arc the
        // tensor owns, and not written while any batch that holds it is in flight.
        let data = unsafe { TensorData::device(buf.ptr(), buf.len(), gpu, None, buf.clone()) }?;
        Ok(Tensor::new(name, vec![buf.len()], Dtype::Uint8, data)?)
    };
    // The writer's other variables (SGLANG_SPEC_CAPTURE_DEVICE_SPIN_S, say) apply, so settings
    // can be compared side by side.
    let w = Writer::start(&Config {
        arena_bytes: Some(3 * size + (64 << 20)),
        gpu_put: Some(true),
        device: Some(gpu),
        ..Config::from_env()?
    })?;
    let exe = std::env::current_exe().context("finding the capture-arena executable")?;
    let mut trainer = Command::new(exe)
        .args([
            "consume",
            "--progress",
            "--no-verify",
            "--quiet",
            "--device",
            "--gpu",
        ])
        .arg(gpu.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the trainer process")?;
    let mut to_trainer = trainer.stdin.take().context("trainer stdin")?;
    let mut from_trainer = BufReader::new(trainer.stdout.take().context("trainer stdout")?);
    let mut read_remote = |line: &str| -> anyhow::Result<Duration> {
        writeln!(to_trainer, "{line}")?;
        to_trainer.flush()?;
        let mut answer = String::new();
        from_trainer.read_line(&mut answer)?;
        let v: serde_json::Value = serde_json::from_str(&answer)
            .with_context(|| format!("the trainer answered {answer:?}"))?;
        anyhow::ensure!(
            v["ok"] == serde_json::Value::Bool(true),
            "the trainer failed: {v}"
        );
        Ok(Duration::from_secs_f64(
            v["read_us"].as_f64().unwrap_or(0.0) / 1e6,
        ))
    };
    let mut id = 0usize;
    let mut next = || {
        id += 1;
        Sample::new("bench", &format!("d{size}-{id}"), 1)
    };
    // Warm-up: the trainer imports and maps the arena once.
    let mut s = next()?;
    s.push(tensor("x", &src)?)?;
    let p = w.submit(vec![s])?.wait()?.remove(0);
    read_remote(&serde_json::to_string(&p)?)?;
    let mut t: [Vec<Duration>; 4] = Default::default();
    for _ in 0..reps {
        let t0 = Instant::now();
        dst.copy_from(&src)?;
        t[0].push(t0.elapsed());
        let mut s = next()?;
        s.push(tensor("x", &src)?)?;
        let t0 = Instant::now();
        let p = w.submit(vec![s])?.wait()?.remove(0);
        t[1].push(t0.elapsed());
        let line = serde_json::to_string(&p)?;
        t[2].push(read_remote(&line)?);
        t[3].push(t0.elapsed());
    }
    // The writer's per-batch overhead: 16 samples x 4 tensors of 4 KiB (copies negligible). To
    // tell its parts apart: one sample of one such tensor (the fixed cost of a batch), and the
    // same 16 x 4 of host bytes into a host arena (the writer's own work, no CUDA call).
    let small: Vec<std::sync::Arc<DeviceBuffer>> = (0..4)
        .map(|_| DeviceBuffer::new(gpu, 4096).map(std::sync::Arc::new))
        .collect::<capture_arena::Result<_>>()?;
    let host_w = Writer::start(&Config {
        arena_bytes: Some(64 << 20),
        ..Config::default()
    })?;
    let mut batch_t: [Vec<Duration>; 3] = Default::default();
    for _ in 0..reps.max(5) {
        for (row, (samples, tensors)) in [(16, 4), (1, 1), (16, 4)].into_iter().enumerate() {
            let on_host = row == 2;
            let mut batch = Vec::new();
            for _ in 0..samples {
                let mut s = next()?.with_replace(true);
                for (j, b) in small.iter().take(tensors).enumerate() {
                    s.push(if on_host {
                        Tensor::new(
                            format!("t{j}"),
                            vec![4096],
                            Dtype::Uint8,
                            TensorData::host(vec![7u8; 4096]),
                        )?
                    } else {
                        tensor(&format!("t{j}"), b)?
                    })?;
                }
                batch.push(s);
            }
            let writer = if on_host { &host_w } else { &w };
            let t0 = Instant::now();
            let ps = writer.submit(batch)?.wait()?;
            batch_t[row].push(t0.elapsed());
            let keys: Vec<String> = ps
                .iter()
                .flat_map(|p| p.keys().unwrap_or_default())
                .map(|k| k.to_string())
                .collect();
            let mut c = std::net::TcpStream::connect(&writer.arena_ref().control)?;
            writeln!(c, "{}", serde_json::to_string(&keys)?)?;
        }
    }
    drop(to_trainer);
    let _ = trainer.wait();
    let [d2d, publish, read, e2e] = t.map(median);
    let gbps = |d: Duration| size as f64 / d.as_secs_f64().max(1e-12) / 1e9;
    let base = gbps(d2d);
    let mut rows: Vec<crate::measure::Row> = [
        ("d2d_copy", d2d),
        ("publish_device", publish),
        ("read_device", read),
        ("end_to_end_device", e2e),
    ]
    .into_iter()
    .map(|(what, d)| crate::measure::Row {
        what,
        bytes: size,
        gbps: gbps(d),
        ratio_to_memcpy: gbps(d) / base,
        median_us: d.as_secs_f64() * 1e6,
    })
    .collect();
    for (what, bytes, times) in [
        ("batch_16x4_device", 16 * 4 * 4096u64, &batch_t[0]),
        ("batch_1x1_device", 4096, &batch_t[1]),
        ("batch_16x4_host", 16 * 4 * 4096, &batch_t[2]),
    ] {
        let b = median(times.clone());
        rows.push(crate::measure::Row {
            what,
            bytes,
            gbps: bytes as f64 / b.as_secs_f64().max(1e-12) / 1e9,
            ratio_to_memcpy: 0.0,
            median_us: b.as_secs_f64() * 1e6,
        });
    }
    Ok(rows)
}

#[cfg(not(feature = "cuda"))]
pub fn bench(_size: u64, _reps: usize, _gpu: i32) -> anyhow::Result<Vec<crate::measure::Row>> {
    Outs::new(0).map(|_| Vec::new())
}
