//! Time from a client's free line leaving its socket to the space being allocatable again, while
//! the writer is idle (issue target: within 1 ms). Prints p50/p99/max over many frees. Then what
//! one turn of the control server costs publication when its line frees many objects: a
//! `free_prefix` line of 10,000 and 100,000 objects beside a line of keys of 1 MiB; and what the
//! cheapest line to send costs, 1 MiB of keys that name nothing (`""`, 3 bytes each), plain and
//! stamped.
//!
//! `cargo bench -p capture-arena --bench free_latency`

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use capture_arena::{Config, Dtype, Sample, Tensor, TensorData, Writer};

const ROUNDS: usize = 2000;

fn main() {
    // `cargo test --benches` runs this with --bench absent: keep that run short.
    let quick = !std::env::args().any(|a| a == "--bench");
    let rounds = if quick { 20 } else { ROUNDS };
    let w = Writer::start(&Config {
        arena_bytes: Some(1 << 20),
        ..Config::default()
    })
    .unwrap();
    let mut c = TcpStream::connect(&w.arena_ref().control).unwrap();
    c.set_nodelay(true).unwrap();
    let mut lat = Vec::with_capacity(rounds);
    for i in 0..rounds {
        let mut s = Sample::new("bench", &format!("s{i}"), 1).unwrap();
        s.push(
            Tensor::new(
                "x",
                vec![4096],
                Dtype::Uint8,
                TensorData::host(vec![1u8; 4096]),
            )
            .unwrap(),
        )
        .unwrap();
        let p = w.submit(vec![s]).unwrap().wait().unwrap();
        let line = format!(
            "{}\n",
            serde_json::to_string(&p[0].keys().unwrap()).unwrap()
        );
        // Let the writer go idle, blocked in poll.
        std::thread::sleep(Duration::from_micros(500));
        let before = w.stats().freed_objects;
        let t0 = Instant::now();
        c.write_all(line.as_bytes()).unwrap();
        // Yield while waiting, never spin: a spinning waiter can occupy the very CPU the
        // scheduler wakes the writer on (wake-affine), and that measures the scheduler.
        while w.stats().freed_objects == before {
            std::thread::yield_now();
            assert!(t0.elapsed() < Duration::from_secs(5), "free never applied");
        }
        lat.push(t0.elapsed());
    }
    lat.sort();
    let q = |p: f64| lat[((lat.len() - 1) as f64 * p) as usize];
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "free applied while idle ({rounds} frees): p50 {:.1} us, p99 {:.1} us, max {:.1} us",
        us(q(0.5)),
        us(q(0.99)),
        us(*lat.last().unwrap())
    );
    let s = w.stats();
    assert_eq!((s.resident_objects, s.free_extents), (0, 1));
    // Keys that name nothing, as many as a line of 1 MiB holds: the most work per byte a peer
    // can ask of one turn (each key is parsed and looked up).
    let (w_empty, _) = many_objects(if quick { 10 } else { 10_000 });
    let n = ((1usize << 20) - 3) / 3;
    let empty = format!("[{}\"\"]\n", "\"\",".repeat(n - 1));
    let took_empty = time_unknown(&w_empty, &empty, n);
    let m = ((1usize << 20) - 20) / 7;
    let pairs: Vec<(&str, u64)> = vec![("", 1); m];
    let stamped_empty = format!("{}\n", capture_arena::control::stamped_free_line(&pairs));
    let took_stamped_empty = time_unknown(&w_empty, &stamped_empty, m);
    println!(
        "one turn: a line of {} bytes of {n} keys that name nothing {:.1} ms; a free_stamped line of {} bytes of {m} such keys {:.1} ms",
        empty.len(),
        took_empty.as_secs_f64() * 1e3,
        stamped_empty.len(),
        took_stamped_empty.as_secs_f64() * 1e3
    );
    let sizes: &[usize] = if quick { &[1000] } else { &[10_000, 100_000] };
    for &n in sizes {
        let (w, stamped) = many_objects(n);
        let keys: Vec<String> = stamped.into_iter().map(|(k, _)| k).collect();
        let took = time_free(&w, "{\"free_prefix\": \"bench/\"}\n", n);
        let line_keys: Vec<&String> = keys
            .iter()
            .scan(2usize, |len, k| {
                *len += k.len() + 3;
                (*len < 1 << 20).then_some(k)
            })
            .collect();
        let (w2, _) = many_objects(line_keys.len());
        let line = format!("{}\n", serde_json::to_string(&line_keys).unwrap());
        let took_line = time_free(&w2, &line, line_keys.len());
        // Keys with their stamps, as a release sends them (each looked up first), as many as fit
        // in a line.
        let (w3, stamped) = many_objects(line_keys.len());
        let pairs: Vec<(&str, u64)> = stamped
            .iter()
            .scan(20usize, |len, (k, s)| {
                *len += k.len() + 26;
                (*len < 1 << 20).then_some((k.as_str(), *s))
            })
            .collect();
        let line3 = format!("{}\n", capture_arena::control::stamped_free_line(&pairs));
        let took_stamped = time_free(&w3, &line3, pairs.len());
        println!(
            "one turn: a free_prefix line of {n} objects {:.1} ms; a line of keys of {} bytes ({} objects) {:.1} ms; a free_stamped line of {} bytes ({} objects) {:.1} ms",
            took.as_secs_f64() * 1e3,
            line.len(),
            line_keys.len(),
            took_line.as_secs_f64() * 1e3,
            line3.len(),
            pairs.len(),
            took_stamped.as_secs_f64() * 1e3
        );
    }
}

/// From writing `line` to its `n` keys being counted unknown (they name no object).
fn time_unknown(w: &Writer, line: &str, n: usize) -> Duration {
    let before = w.stats().unknown_frees;
    let mut c = TcpStream::connect(&w.arena_ref().control).unwrap();
    c.set_nodelay(true).unwrap();
    let t0 = Instant::now();
    c.write_all(line.as_bytes()).unwrap();
    while w.stats().unknown_frees < before + n as u64 {
        std::thread::yield_now();
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "frees never counted"
        );
    }
    t0.elapsed()
}

/// A writer holding `n` objects of 8 bytes (one a sample), and their keys with their stamps.
fn many_objects(n: usize) -> (Writer, Vec<(String, u64)>) {
    let w = Writer::start(&Config {
        arena_bytes: Some(((n as u64) * 512).max(1 << 20)),
        ..Config::default()
    })
    .unwrap();
    let mut keys = Vec::with_capacity(n);
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let batch = chunk
            .iter()
            .map(|i| {
                let mut s = Sample::new("bench", &format!("sample-{i:08}"), 1).unwrap();
                s.push(
                    Tensor::new(
                        "hidden_states",
                        vec![8],
                        Dtype::Uint8,
                        TensorData::host(vec![1u8; 8]),
                    )
                    .unwrap(),
                )
                .unwrap();
                s
            })
            .collect();
        for p in w.submit(batch).unwrap().wait().unwrap() {
            let stamp = p.features["hidden_states"].stamp.unwrap();
            keys.extend(
                p.keys()
                    .unwrap()
                    .iter()
                    .map(|k| (k.as_str().to_owned(), stamp)),
            );
        }
    }
    (w, keys)
}

/// From writing `line` to its `n` objects being freed.
fn time_free(w: &Writer, line: &str, n: usize) -> Duration {
    let mut c = TcpStream::connect(&w.arena_ref().control).unwrap();
    c.set_nodelay(true).unwrap();
    let t0 = Instant::now();
    c.write_all(line.as_bytes()).unwrap();
    while w.stats().freed_objects < n as u64 {
        std::thread::yield_now();
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "frees never applied"
        );
    }
    t0.elapsed()
}
