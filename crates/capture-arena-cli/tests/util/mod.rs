//! Helpers shared by the process-level tests.
#![allow(dead_code)]

use std::process::{Command, Stdio};

/// A small workload: 12 samples, L in [16, 256], H = 256, k = 3 (at most ~0.8 MiB a sample).
pub const SMALL: &[&str] = &[
    "--samples",
    "12",
    "--min-len",
    "16",
    "--max-len",
    "256",
    "--hidden",
    "256",
    "--aux-layers",
    "3",
    "--batch",
    "3",
];

/// The `capture-arena` binary under test.
pub const EXE: &str = env!("CARGO_BIN_EXE_capture-arena");

/// A producer of `samples` tiny samples (L = 8, H = 64, one per batch) into a 1 MiB arena that
/// gives up `idle` seconds after the last free; its results on a pipe.
pub fn tiny_producer(samples: &str, idle: &str) -> Command {
    let mut c = Command::new(EXE);
    c.arg("produce")
        .args([
            "--samples",
            samples,
            "--min-len",
            "8",
            "--max-len",
            "8",
            "--hidden",
            "64",
        ])
        .args([
            "--batch",
            "1",
            "--arena-bytes",
            "1MiB",
            "--idle-timeout",
            idle,
            "--quiet",
        ])
        .stdout(Stdio::piped());
    c
}

/// Sends process `pid` signal `sig` (`TERM`, `KILL`, `STOP`, ...) with the shell's own `kill`: a
/// minimal Debian has no kill program (procps).
pub fn signal(sig: &str, pid: u32) {
    let status = Command::new("sh")
        .args(["-c", &format!("kill -{sig} {pid}")])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{sig} {pid}");
}

/// Polls `cond` every 20 ms until it holds or `secs` pass; whether it held.
pub fn within(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while !cond() {
        if std::time::Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    true
}

/// Runs `c` to completion, asserts it succeeded (showing its stdout and stderr if not), and
/// returns its stdout.
pub fn stdout_of_success(c: &mut Command) -> String {
    let out = c.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}
