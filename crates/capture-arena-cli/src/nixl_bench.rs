//! `bench --transport nixl`: reads through NIXL from a producer in another process, side by
//! side with memcpy of the same bytes.
//!
//! For each size S a producer child (`capture-arena bench-serve`, hidden) publishes one object
//! of S bytes and one sample of 16 objects of S/16 bytes into an arena served through NIXL.
//! This process, the trainer, then times in interleaved rounds:
//! - `memcpy`: S bytes copied in this process (the bound on one host);
//! - `nixl_read`: the S-byte object read into a [`ReadBuffer`] (registered once);
//! - `nixl_batch_16`: the 16 objects read with one call (one NIXL request) into 16 slices of the
//!   same buffer;
//! - `publish` and `publish_nixl`: S bytes published by a writer in this process into a
//!   shared-memory arena, and into one served through NIXL (its agent's progress thread running):
//!   what serving through NIXL costs publication.
//!
//! Both processes use the UCX transports `UCX_TLS` names (the table says which).

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use capture_arena::config::ArenaTransport;
use capture_arena::{Config, Published, ReadBuffer, Reader, Sample, Writer};

use crate::measure::Row;
use crate::workload::{fill, pattern_tensor, verify};

/// Objects of the batched row.
const PARTS: usize = 16;

/// Flags of the hidden `bench-serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Bytes of the large object (the 16 small ones are a sixteenth each).
    #[arg(long)]
    pub size: u64,
}

fn part_len(size: u64) -> u64 {
    (size / PARTS as u64).max(1)
}

/// The producer child: publishes, prints both results, waits for stdin to close.
pub fn serve(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let n = usize::try_from(args.size)?;
    let part = usize::try_from(part_len(args.size))?;
    let config = Config {
        arena_bytes: Some(
            2 * args.size + (PARTS as u64 + 2) * capture_arena::config::MAX_ALIGNMENT + (1 << 20),
        ),
        ..Config::from_env()?
    };
    let w = Writer::start(&config).context("starting the NIXL arena")?;
    let mut one = Sample::new("bench", "one", 1)?;
    one.push(pattern_tensor("x", "bench/x", n)?)?;
    let mut many = Sample::new("bench", "sixteen", 1)?;
    for i in 0..PARTS {
        many.push(pattern_tensor(
            &format!("t{i}"),
            &format!("bench/t{i}"),
            part,
        )?)?;
    }
    let results = w.submit(vec![one, many])?.wait()?;
    let mut out = std::io::stdout().lock();
    for r in &results {
        serde_json::to_writer(&mut out, r)?;
        out.write_all(b"\n")?;
    }
    out.flush()?;
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line)? > 0 {
        line.clear();
    }
    Ok(ExitCode::SUCCESS)
}

/// The rows for one size; see the module docs.
pub fn bench(size: u64, reps: usize) -> anyhow::Result<Vec<Row>> {
    let n = usize::try_from(size)?;
    let part = usize::try_from(part_len(size))?;
    let exe = std::env::current_exe().context("finding the capture-arena executable")?;
    let mut producer = Command::new(exe)
        .args(["bench-serve", "--size", &size.to_string()])
        .env(capture_arena::config::ENV_TRANSPORT, "nixl")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the producer process")?;
    let mut lines = BufReader::new(producer.stdout.take().context("producer stdout")?).lines();
    // Results are the JSON lines; anything else (a library's log line) goes to stderr.
    let mut next = || -> anyhow::Result<Published> {
        loop {
            let line = lines
                .next()
                .context("the producer exited before publishing (see its error above)")??;
            match serde_json::from_str(&line) {
                Ok(p) => return Ok(p),
                Err(_) => eprintln!("producer: {line}"),
            }
        }
    };
    let (one, many) = (next()?, next()?);
    anyhow::ensure!(
        one.arena.session.starts_with("nixl://"),
        "the producer's arena is not served through NIXL: {}",
        one.arena.session
    );
    let reader = Reader::new();
    let mut buf = ReadBuffer::new(n)?;
    let names: Vec<String> = (0..PARTS).map(|i| format!("t{i}")).collect();
    let read_many = |buf: &mut ReadBuffer| -> capture_arena::Result<()> {
        let mut outs: Vec<(&str, &mut [u8])> = names
            .iter()
            .map(String::as_str)
            .zip(buf[..part * PARTS].chunks_mut(part))
            .collect();
        reader.read_many(&many, &mut outs)
    };
    // Warm-up (connects, registers the buffer) and checks every byte of both.
    reader.read(&one, "x", &mut buf)?;
    anyhow::ensure!(
        verify("bench/x", &buf).is_none(),
        "nixl_read returned other bytes than were published"
    );
    buf.fill(0);
    read_many(&mut buf)?;
    for (i, c) in buf[..part * PARTS].chunks(part).enumerate() {
        anyhow::ensure!(
            verify(&format!("bench/t{i}"), c).is_none(),
            "nixl_batch_16 object {i} differs from what was published"
        );
    }
    let mut src = vec![0u8; n];
    fill("bench/x", &mut src);
    let src = crate::measure::Src(std::sync::Arc::new(src));
    let mut dst = vec![1u8; n];
    let writer = |transport| {
        Writer::start(&Config {
            arena_bytes: Some(3 * size + (1 << 20)),
            transport,
            ..Config::default()
        })
    };
    let shm = writer(ArenaTransport::Auto)?;
    let served = writer(ArenaTransport::Nixl)?;
    let publish = |w: &Writer| -> anyhow::Result<Duration> {
        let s = crate::measure::sample(0, &src, true)?;
        let t0 = Instant::now();
        w.submit(vec![s])?.wait()?;
        Ok(t0.elapsed())
    };
    publish(&shm)?;
    publish(&served)?;
    let mut t: [Vec<Duration>; 5] = Default::default();
    for _ in 0..reps {
        t[3].push(publish(&shm)?);
        t[4].push(publish(&served)?);
        let t0 = Instant::now();
        dst.copy_from_slice(&src.0);
        std::hint::black_box(&dst);
        t[0].push(t0.elapsed());
        let t0 = Instant::now();
        reader.read(&one, "x", &mut buf)?;
        t[1].push(t0.elapsed());
        let t0 = Instant::now();
        read_many(&mut buf)?;
        t[2].push(t0.elapsed());
    }
    drop(producer.stdin.take());
    let _ = producer.wait();
    drop((shm, served));
    let [memcpy, read, batch, publish_shm, publish_nixl] = t.map(crate::measure::median);
    let gbps = |b: u64, d: Duration| b as f64 / d.as_secs_f64().max(1e-12) / 1e9;
    let base = gbps(size, memcpy);
    let batch_bytes = part_len(size) * PARTS as u64;
    Ok([
        ("memcpy", size, memcpy),
        ("nixl_read", size, read),
        ("nixl_batch_16", batch_bytes, batch),
        ("publish", size, publish_shm),
        ("publish_nixl", size, publish_nixl),
    ]
    .into_iter()
    .map(|(what, bytes, d)| Row {
        what,
        bytes,
        gbps: gbps(bytes, d),
        ratio_to_memcpy: gbps(bytes, d) / base,
        median_us: d.as_secs_f64() * 1e6,
    })
    .collect())
}
