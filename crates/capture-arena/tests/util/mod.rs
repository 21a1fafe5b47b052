//! Helpers shared by the integration tests: configs, samples, a control client, read-back.
#![allow(dead_code)]

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use capture_arena::{Config, Dtype, Published, Reader, Sample, Tensor, TensorData, Writer};

mod unreachable;
#[allow(unused_imports)] // not every test binary uses it
pub use unreachable::unreachable_endpoint;

/// A config with an arena of `bytes` and a short wait for frees.
pub fn config(bytes: u64, wait: Duration) -> Config {
    Config {
        arena_bytes: Some(bytes),
        arena_wait: wait,
        ..Config::default()
    }
}

/// The byte at `i` of the tensor `name` of sample `id` (a pattern a reader can check).
pub fn pattern(id: &str, name: &str, i: usize) -> u8 {
    let h = id
        .bytes()
        .chain(name.bytes())
        .fold(0u8, |a, b| a.wrapping_mul(31).wrapping_add(b));
    h.wrapping_add(i as u8).wrapping_mul(7)
}

/// A sample of uint8 tensors `t0, t1, ...` of the given sizes, filled with [`pattern`].
pub fn sample(id: &str, sizes: &[usize]) -> Sample {
    sample_in("st", id, sizes)
}

/// As [`sample`], in store `store`.
pub fn sample_in(store: &str, id: &str, sizes: &[usize]) -> Sample {
    let mut s = Sample::new(store, id, 1).unwrap();
    for (i, &n) in sizes.iter().enumerate() {
        let name = format!("t{i}");
        let data: Vec<u8> = (0..n).map(|j| pattern(id, &name, j)).collect();
        s.push(Tensor::new(name, vec![n as u64], Dtype::Uint8, TensorData::host(data)).unwrap())
            .unwrap();
    }
    s
}

/// Reads every feature of a result back through a read-only mapping and checks the pattern.
pub fn verify(p: &Published) {
    let reader = Reader::new();
    for (name, f) in &p.features {
        let n = f.byte_len().unwrap() as usize;
        let mut out = vec![0u8; n];
        reader.read(p, name, &mut out).unwrap();
        for (j, b) in out.iter().enumerate() {
            assert_eq!(
                *b,
                pattern(&p.sample_id, name, j),
                "{}/{name} byte {j}",
                p.sample_id
            );
        }
    }
}

/// Sends one free line with `keys` on a new connection and closes it.
pub fn free(control: &str, keys: &[String]) {
    let mut c = TcpStream::connect(control).unwrap();
    writeln!(c, "{}", serde_json::to_string(keys).unwrap()).unwrap();
}

/// Publishes one sample of uint8 tensors of the given sizes (see [`sample`]) and returns its
/// result.
pub fn publish_one(w: &Writer, id: &str, sizes: &[usize]) -> Published {
    w.submit(vec![sample(id, sizes)])
        .unwrap()
        .wait()
        .unwrap()
        .remove(0)
}

/// The port of a writer's control endpoint.
pub fn control_port(w: &Writer) -> u16 {
    w.arena_ref()
        .control
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// Every key of a batch's results.
pub fn keys(results: &[Published]) -> Vec<String> {
    results
        .iter()
        .flat_map(|p| p.keys().unwrap())
        .map(|k| k.to_string())
        .collect()
}

/// Waits (up to 10 s) until the writer reports `n` objects freed.
pub fn wait_freed(w: &Writer, n: u64) {
    let (s, ok) = w.wait_for(Duration::from_secs(10), |s| s.freed_objects >= n);
    assert!(ok, "only {} of {n} frees applied: {s:?}", s.freed_objects);
}

/// Polls `f` (up to 5 s) until it returns `want`; returns its last value. A free counts as
/// pending until its sender has seen the write succeed, which may be after the producer has
/// already applied it.
pub fn settled(want: u64, f: impl Fn() -> u64) -> u64 {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let v = f();
        if v == want || std::time::Instant::now() > deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// True when the server closed `s` within `within`: the read ends (EOF) or the connection was
/// reset (closed with our bytes unread). False when it is still open: the read times out. Any
/// bytes the server writes before closing (an `unauthorized` line) are read past.
pub fn closed_by_server(s: &mut TcpStream, within: Duration) -> bool {
    use std::io::{ErrorKind, Read};
    s.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 512];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return e.kind() == ErrorKind::ConnectionReset,
        }
    }
}

/// Plays a producer's part on a connection a client just made: reads up to its first sync line
/// (`{"sync": 0}`, after its token if it has one) and confirms it, as every new connection of
/// the control client asks. The caller plays the rest (a slow reader, a trickled answer).
pub fn answer_first_sync(c: &mut TcpStream) {
    use std::io::Read;
    let mut seen = Vec::new();
    let mut byte = [0u8; 1];
    while !String::from_utf8_lossy(&seen).contains("\"sync\": 0}") {
        c.read_exact(&mut byte).unwrap();
        seen.push(byte[0]);
    }
    c.write_all(&capture_arena::control::synced_line(0))
        .unwrap();
}
