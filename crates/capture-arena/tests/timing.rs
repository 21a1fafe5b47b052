//! `SGLANG_SPEC_CAPTURE_TIMING=1` logs one line per batch. Its own test binary: it installs a
//! global log subscriber that captures the writer thread's lines.

mod util;

use std::io::Write;
use std::sync::{Arc, Mutex};

use capture_arena::{Config, Writer};

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn timing_logs_one_line_per_batch() {
    let out = Captured::default();
    let sink = out.clone();
    tracing_subscriber::fmt()
        .with_writer(move || sink.clone())
        .with_ansi(false)
        .init();
    let c = Config::from_lookup(|k| match k {
        "SGLANG_SPEC_CAPTURE_TIMING" => Some("1".into()),
        "SGLANG_SPEC_CAPTURE_ARENA_BYTES" => Some("1MiB".into()),
        _ => None,
    })
    .unwrap();
    assert!(c.timing);
    let w = Writer::start(&c).unwrap();
    for i in 0..3 {
        w.submit(vec![util::sample(&format!("s{i}"), &[1000, 24])])
            .unwrap()
            .wait()
            .unwrap();
    }
    drop(w);
    let log = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("capture batch published"))
        .collect();
    assert_eq!(lines.len(), 3, "{log}");
    for needle in [
        "samples=1",
        "objects=2",
        "bytes=1024",
        "wait_ms=",
        "copy_ms=",
        "total_ms=",
    ] {
        assert!(lines[0].contains(needle), "{} lacks {needle}", lines[0]);
    }
}
