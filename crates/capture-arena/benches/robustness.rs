//! The reliability figures, each measured side by side in one run on this machine:
//! - a one-sample batch's submit → result round trip through the writer (p50, p99);
//! - publication rate while one client floods the control port with valid lines, against the
//!   rate without the flood (interleaved blocks);
//! - free latency of another client under that flood, against the same without it;
//! - the producer's memory growth under 300 idle connections holding unfinished lines;
//! - release latency to a healthy producer while another endpoint is unreachable;
//! - creating (and pre-faulting) a host arena, and mapping it in a reader, per GiB.
//!
//! `cargo bench -p capture-arena --bench robustness` (add `-- --json FILE` for the figures as
//! JSON). `cargo test --benches` runs a short version.

use std::io::Write;
use std::net::TcpStream;
use std::os::fd::FromRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use capture_arena::client::FeatureStore;
use capture_arena::memory::{ShmRegion, ShmSession};
use capture_arena::transport::ShmTransport;
use capture_arena::{Config, Dtype, Key, Published, Sample, Tensor, TensorData, Writer};

#[derive(Clone)]
struct Shared(Arc<Vec<u8>>);
impl AsRef<[u8]> for Shared {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// `samples × tensors` distinct source buffers of `bytes` each (so copies read memory, not a
/// cache-hot buffer).
fn sources(samples: usize, tensors: usize, bytes: usize) -> Vec<Shared> {
    (0..samples * tensors)
        .map(|i| Shared(Arc::new(vec![i as u8; bytes])))
        .collect()
}

fn batch(tag: &str, samples: usize, tensors: usize, src: &[Shared]) -> Vec<Sample> {
    (0..samples)
        .map(|i| {
            let mut s = Sample::new("bench", &format!("{tag}{i}"), 1)
                .unwrap()
                .with_replace(true);
            for t in 0..tensors {
                let src = &src[(i * tensors + t) % src.len()];
                let n = src.0.len() as u64;
                let data = TensorData::host(src.clone());
                s.push(Tensor::new(format!("t{t}"), vec![n], Dtype::Uint8, data).unwrap())
                    .unwrap();
            }
            s
        })
        .collect()
}

fn q(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() - 1) as f64 * p) as usize]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// A client writing valid free lines (for a key that is not resident) as fast as it can.
struct Flood {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl Flood {
    fn start(control: &str) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let mut c = TcpStream::connect(control).unwrap();
        c.set_write_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let thread = std::thread::spawn(move || {
            let buf = b"[\"flood/no-such-sample/g1/x\"]\n".repeat(2048);
            let mut lines = 0u64;
            while !s.load(Ordering::Relaxed) {
                if let Ok(n) = c.write(&buf) {
                    lines += (n / 31) as u64;
                }
            }
            lines
        });
        Flood {
            stop,
            thread: Some(thread),
        }
    }

    fn stop(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().map_or(0, |t| t.join().unwrap_or(0))
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn config(bytes: u64) -> Config {
    Config {
        arena_bytes: Some(bytes),
        ..Config::default()
    }
}

fn round_trip(rounds: usize) -> (Duration, Duration) {
    let w = Writer::start(&config(64 << 20)).unwrap();
    let src = sources(1, 1, 4096);
    let mut lat = Vec::with_capacity(rounds);
    for i in 0..rounds + 100 {
        let b = batch("rt", 1, 1, &src);
        let t0 = Instant::now();
        w.submit(b).unwrap().wait().unwrap();
        if i >= 100 {
            lat.push(t0.elapsed());
        }
    }
    (q(&mut lat, 0.5), q(&mut lat, 0.99))
}

/// Batches per second, flooded and not, in alternating blocks.
fn publish_under_flood(
    blocks: usize,
    per_block: usize,
    samples: usize,
    bytes: usize,
) -> (f64, f64, u64) {
    let w = Writer::start(&config((4 * samples * 4 * bytes) as u64 + (16 << 20))).unwrap();
    let src = sources(samples, 4, bytes);
    w.submit(batch("p", samples, 4, &src))
        .unwrap()
        .wait()
        .unwrap();
    let (mut calm, mut flooded) = (Vec::new(), Vec::new());
    let mut lines = 0;
    for _ in 0..blocks {
        for flood in [false, true] {
            let f = flood.then(|| Flood::start(&w.arena_ref().control));
            if f.is_some() {
                std::thread::sleep(Duration::from_millis(50)); // let the flood get going
            }
            let t0 = Instant::now();
            for _ in 0..per_block {
                w.submit(batch("p", samples, 4, &src))
                    .unwrap()
                    .wait()
                    .unwrap();
            }
            let rate = per_block as f64 / t0.elapsed().as_secs_f64();
            if let Some(f) = f {
                lines += f.stop();
                flooded.push(rate);
            } else {
                calm.push(rate);
            }
        }
    }
    let med = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    (med(calm), med(flooded), lines)
}

/// Free latency (line written → applied) of a second client, with and without a flood.
fn free_latency(frees: usize) -> [(Duration, Duration); 2] {
    let mut out = [(Duration::ZERO, Duration::ZERO); 2];
    for (k, flood) in [false, true].into_iter().enumerate() {
        let w = Writer::start(&config(64 << 20)).unwrap();
        let src = sources(1, 1, 256);
        let rs = w
            .submit(batch("f", frees, 1, &src))
            .unwrap()
            .wait()
            .unwrap();
        let f = flood.then(|| Flood::start(&w.arena_ref().control));
        std::thread::sleep(Duration::from_millis(50));
        let mut c = TcpStream::connect(&w.arena_ref().control).unwrap();
        c.set_nodelay(true).unwrap();
        let mut lat = Vec::with_capacity(frees);
        for (i, r) in rs.iter().enumerate() {
            let line = format!("{}\n", serde_json::to_string(&r.keys().unwrap()).unwrap());
            std::thread::sleep(Duration::from_micros(200));
            let t0 = Instant::now();
            c.write_all(line.as_bytes()).unwrap();
            // Yield, never spin, while waiting (see benches/free_latency.rs).
            while w.stats().freed_objects <= i as u64 {
                std::thread::yield_now();
                assert!(
                    t0.elapsed() < Duration::from_secs(10),
                    "a free never applied"
                );
            }
            lat.push(t0.elapsed());
        }
        drop(f);
        out[k] = (q(&mut lat, 0.5), q(&mut lat, 0.99));
    }
    out
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn idle_partial_lines(conns: usize) -> (f64, u64) {
    let w = Writer::start(&config(1 << 20)).unwrap();
    let partial = vec![b' '; (1 << 20) - 16];
    std::thread::sleep(Duration::from_millis(100));
    let before = rss_kib();
    let held: Vec<TcpStream> = (0..conns)
        .map(|_| {
            let mut c = TcpStream::connect(&w.arena_ref().control).unwrap();
            c.set_write_timeout(Some(Duration::from_millis(50)))
                .unwrap();
            let _ = c.write_all(&partial);
            c
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let grown = rss_kib().saturating_sub(before) as f64 / 1024.0;
    let buffered = w.stats().control_buffered_bytes;
    drop(held);
    (grown, buffered)
}

/// A loopback endpoint whose backlog is full: connects to it hang until their timeout.
fn unreachable() -> (String, Vec<TcpStream>, std::net::TcpListener) {
    // SAFETY: plain FFI creating, binding and listening on a socket we then own.
    let l = unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        let mut a: libc::sockaddr_in = std::mem::zeroed();
        a.sin_family = libc::AF_INET as libc::sa_family_t;
        a.sin_addr.s_addr = u32::from_be_bytes([127, 0, 0, 1]).to_be();
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        libc::bind(fd, (&a as *const libc::sockaddr_in).cast(), len);
        libc::listen(fd, 0);
        std::net::TcpListener::from_raw_fd(fd)
    };
    let addr = l.local_addr().unwrap();
    let held = (0..4)
        .filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_millis(100)).ok())
        .collect();
    (addr.to_string(), held, l)
}

fn release_with_a_dead_endpoint(n: usize) -> (Duration, Duration, Duration) {
    let (dead, _held, _l) = unreachable();
    let store = FeatureStore::new();
    let key: Key = "x/y/g1/z".parse().unwrap();
    let _ = store.control().free(Some(&dead), [key]); // one timeout, then back-off
    let w = Writer::start(&config(64 << 20)).unwrap();
    let src = sources(1, 1, 256);
    let rs: Vec<Published> = w.submit(batch("r", n, 1, &src)).unwrap().wait().unwrap();
    let mut lat = Vec::with_capacity(n);
    for r in &rs {
        let t0 = Instant::now();
        store.release(r).unwrap();
        lat.push(t0.elapsed());
    }
    let max = *lat.iter().max().unwrap();
    (q(&mut lat, 0.5), q(&mut lat, 0.99), max)
}

fn create_per_gib(bytes: u64, reps: usize) -> (f64, f64) {
    let (mut create, mut map) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        let t0 = Instant::now();
        let r = ShmRegion::create(bytes).unwrap();
        create.push(t0.elapsed());
        let s: ShmSession = capture_arena::memory::Region::session(&r).parse().unwrap();
        let t0 = Instant::now();
        let t = ShmTransport::open(&s).unwrap();
        map.push(t0.elapsed());
        drop(t);
        drop(r);
    }
    let gib = bytes as f64 / (1u64 << 30) as f64;
    let per = |mut v: Vec<Duration>| q(&mut v, 0.5).as_secs_f64() / gib;
    (per(create), per(map))
}

fn main() {
    let quick = !std::env::args().any(|a| a == "--bench");
    let json = std::env::args().skip_while(|a| a != "--json").nth(1);
    let s = |full: usize, short: usize| if quick { short } else { full };

    let (rt50, rt99) = round_trip(s(20_000, 200));
    println!(
        "round trip, 1 sample of 4 KiB: p50 {:.1} us, p99 {:.1} us",
        us(rt50),
        us(rt99)
    );

    let (calm, flooded, lines) = publish_under_flood(s(5, 1), s(20, 2), 16, 1 << 20);
    println!(
        "publish 16 x 4 x 1 MiB: {calm:.1} batches/s, under a flood of valid lines {flooded:.1} \
         batches/s ({:.2} x; {lines} flood lines sent)",
        flooded / calm
    );
    let (calm_s, flooded_s, _) = publish_under_flood(s(5, 1), s(400, 20), 1, 4096);
    println!(
        "publish 1 x 4 x 4 KiB: {calm_s:.0} batches/s, under the flood {flooded_s:.0} batches/s \
         ({:.2} x)",
        flooded_s / calm_s
    );

    let [(f50, f99), (ff50, ff99)] = free_latency(s(2000, 50));
    println!(
        "free latency of another client: p50 {:.1} us, p99 {:.1} us; under the flood p50 {:.1} \
         us, p99 {:.1} us",
        us(f50),
        us(f99),
        us(ff50),
        us(ff99)
    );

    let conns = s(300, 20);
    let (grown, buffered) = idle_partial_lines(conns);
    println!(
        "{conns} idle connections with unfinished 1 MiB lines: producer RSS +{grown:.1} MiB \
         ({buffered} bytes buffered)"
    );

    let (r50, r99, rmax) = release_with_a_dead_endpoint(s(500, 20));
    println!(
        "release to a healthy producer while another endpoint is unreachable: p50 {:.1} us, p99 \
         {:.1} us, max {:.1} us",
        us(r50),
        us(r99),
        us(rmax)
    );

    // A short run keeps to 64 MiB: /dev/shm is small in some containers.
    let (create, map) = create_per_gib(s(2 << 30, 64 << 20) as u64, s(3, 1));
    println!(
        "host arena: create + pre-fault {create:.2} s/GiB; a reader's map + pre-fault {map:.3} \
         s/GiB"
    );

    if let Some(path) = json {
        let doc = serde_json::json!({
            "round_trip_p50_us": us(rt50), "round_trip_p99_us": us(rt99),
            "publish_64MiB_batches_per_s": calm, "publish_64MiB_flooded_batches_per_s": flooded,
            "publish_flood_ratio": flooded / calm,
            "publish_small_batches_per_s": calm_s, "publish_small_flooded_batches_per_s": flooded_s,
            "publish_small_flood_ratio": flooded_s / calm_s,
            "free_p50_us": us(f50), "free_p99_us": us(f99),
            "free_flooded_p50_us": us(ff50), "free_flooded_p99_us": us(ff99),
            "idle_partial_rss_mib": grown, "idle_partial_buffered_bytes": buffered,
            "release_dead_endpoint_p50_us": us(r50), "release_dead_endpoint_p99_us": us(r99),
            "release_dead_endpoint_max_us": us(rmax),
            "create_s_per_gib": create, "map_s_per_gib": map,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
    }
}
