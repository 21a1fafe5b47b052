//! NIXL between real processes on loopback, with the real library: a producer process serves
//! its arena through NIXL and trainer processes read every byte and free it, over `UCX_TLS=tcp`
//! (the cross-host path) and over UCX's default transports (shared memory / CMA on one host);
//! trainers and producers that restart.
//!
//! Needs the NIXL library: `scripts/test.sh` installs the wheel and sets
//! `SGLANG_SPEC_CAPTURE_NIXL_LIB`.
#![cfg(feature = "nixl")]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};

use serde_json::Value;

mod util;

use util::{tiny_producer, EXE, SMALL};

/// `cmd` with NIXL's environment: the arena served through NIXL, and `tls` as UCX_TLS (`None`:
/// UCX's defaults).
fn nixl(mut cmd: Command, tls: Option<&str>) -> Command {
    assert!(
        std::env::var_os("SGLANG_SPEC_CAPTURE_NIXL_LIB").is_some()
            || std::env::var_os("LD_LIBRARY_PATH").is_some(),
        "the NIXL tests need the library: run scripts/test.sh, or set \
         SGLANG_SPEC_CAPTURE_NIXL_LIB to the nixl-cu12 wheel's .nixl_cu12.mesonpy.libs"
    );
    cmd.env("SGLANG_SPEC_CAPTURE_TRANSPORT", "nixl")
        .env("SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S", "20");
    match tls {
        Some(t) => cmd.env("UCX_TLS", t),
        None => cmd.env_remove("UCX_TLS"),
    };
    cmd
}

fn producer(args: &[&str], arena: &str, idle: &str, tls: Option<&str>) -> Child {
    let mut c = Command::new(EXE);
    c.arg("produce")
        .args(args)
        .args(["--arena-bytes", arena, "--idle-timeout", idle, "--quiet"])
        .stdout(Stdio::piped());
    nixl(c, tls).spawn().unwrap()
}

fn trainer(tls: Option<&str>) -> Child {
    let mut c = Command::new(EXE);
    c.args(["consume", "--quiet", "--progress"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    nixl(c, tls).spawn().unwrap()
}

fn json_lines(out: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(out)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .collect()
}

/// The producer's result lines (sent on to `to`) and its final stats line.
fn forward(p: &mut Child, mut to: impl Write) -> (usize, Value) {
    let mut results = 0;
    let mut last = None;
    for line in BufReader::new(p.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        if v.get("stats").is_some() {
            last = Some(v);
        } else {
            let session = v["arena"]["session"].as_str().unwrap();
            assert!(session.starts_with("nixl://"), "{session}");
            writeln!(to, "{line}").unwrap();
            results += 1;
        }
    }
    (results, last.expect("the producer's final stats line"))
}

fn every_byte_moves_and_the_arena_ends_free(tls: Option<&str>) {
    let mut p = producer(SMALL, "2MiB", "30", tls);
    let mut t = trainer(tls);
    let (n, last) = forward(&mut p, t.stdin.take().unwrap());
    let out = t.wait_with_output().unwrap();
    assert!(p.wait().unwrap().success(), "{last}");
    let lines = json_lines(&out.stdout);
    let summary = &lines.last().unwrap()["summary"];
    assert!(out.status.success(), "{summary}");
    assert_eq!(n, 12);
    assert_eq!(summary["samples"], 12);
    assert_eq!(summary["mismatches"], 0);
    assert!(
        summary["bytes"].as_u64().unwrap() > 2 << 20,
        "more than the arena holds"
    );
    let s = &last["stats"];
    assert_eq!(last["ok"], true);
    assert_eq!(s["freed_objects"], s["published_objects"]);
    assert_eq!(s["free_bytes"], s["capacity"]);
    assert_eq!(s["resident_objects"], 0);
}

#[test]
fn over_tcp_every_byte_of_multi_sample_batches_is_read_and_the_arena_ends_free() {
    every_byte_moves_and_the_arena_ends_free(Some("tcp"));
}

#[test]
fn over_the_default_transports_every_byte_is_read_and_the_arena_ends_free() {
    every_byte_moves_and_the_arena_ends_free(None);
}

#[test]
fn a_trainer_killed_mid_run_is_replaced_and_the_new_one_reads_the_rest() {
    let tls = Some("tcp");
    let tiny = [
        "--samples",
        "6",
        "--min-len",
        "64",
        "--max-len",
        "64",
        "--hidden",
        "256",
        "--batch",
        "1",
    ];
    let mut p = producer(&tiny, "4MiB", "30", tls);
    let mut from_p = BufReader::new(p.stdout.take().unwrap()).lines();
    let lines: Vec<String> = from_p.by_ref().take(6).map(Result::unwrap).collect();
    // The first trainer reads and frees three samples, then dies without a goodbye.
    let mut first = trainer(tls);
    let mut to_first = first.stdin.take().unwrap();
    let mut from_first = BufReader::new(first.stdout.take().unwrap());
    for l in &lines[..3] {
        writeln!(to_first, "{l}").unwrap();
        let mut answer = String::new();
        from_first.read_line(&mut answer).unwrap();
        let v: Value = serde_json::from_str(&answer).unwrap();
        assert_eq!(v["ok"], true, "{v}");
    }
    // A trainer's frees go out from a sender of its own, after its answer: the kill waits
    // until the producer has applied all three samples' (killed before, the last one's free is
    // lost with the trainer, and the producer waits for it until its idle timeout).
    let first_result: Value = serde_json::from_str(&lines[0]).unwrap();
    let control = first_result["arena"]["control"]
        .as_str()
        .unwrap()
        .to_owned();
    let objects = first_result["features"].as_object().unwrap().len() as u64;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let out = Command::new(EXE)
            .args(["stats", "--control", &control, "--json"])
            .env_remove("SGLANG_SPEC_CAPTURE_CONTROL_TOKEN")
            .output()
            .unwrap();
        let r: Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let freed = r["stats"]["freed_objects"].as_u64().unwrap_or(0);
        if freed >= 3 * objects {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the first trainer's frees never reached the producer: {freed} of {} objects freed; {}",
            3 * objects,
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    first.kill().unwrap();
    first.wait().unwrap();
    // A new trainer process (a new NIXL agent) reads the rest from the same producer.
    let mut second = trainer(tls);
    {
        let mut to = second.stdin.take().unwrap();
        for l in &lines[3..] {
            writeln!(to, "{l}").unwrap();
        }
    }
    let out = second.wait_with_output().unwrap();
    let lines = json_lines(&out.stdout);
    let summary = &lines.last().unwrap()["summary"];
    assert!(out.status.success(), "{summary}");
    assert_eq!(summary["samples"], 3);
    assert_eq!(summary["mismatches"], 0);
    // Every sample was freed, by one trainer or the other: the producer finishes cleanly.
    let last: Vec<String> = from_p.map(Result::unwrap).collect();
    assert!(p.wait().unwrap().success(), "{last:?}");
}

#[test]
fn results_of_a_restarted_producer_fail_as_stale_and_the_new_ones_are_read() {
    let tls = Some("tcp");
    // Nobody frees: the first producer gives up and exits, taking its agent with it.
    let old = nixl(tiny_producer("2", "0.2"), tls).output().unwrap();
    assert!(!old.status.success());
    let old_results: Vec<String> = String::from_utf8_lossy(&old.stdout)
        .lines()
        .filter(|l| l.contains("nixl://") && l.contains("\"features\""))
        .map(str::to_owned)
        .collect();
    assert_eq!(old_results.len(), 2);
    // The restarted producer; one trainer gets the old results, then the new ones.
    let mut new = nixl(tiny_producer("2", "30"), tls).spawn().unwrap();
    let mut t = trainer(tls);
    let mut to = t.stdin.take().unwrap();
    let t0 = std::time::Instant::now();
    for l in &old_results {
        writeln!(to, "{l}").unwrap();
    }
    let (n, last) = forward(&mut new, &mut to);
    drop(to);
    let out = t.wait_with_output().unwrap();
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(40),
        "stale sessions must fail within the read timeout"
    );
    let lines = json_lines(&out.stdout);
    let summary = &lines.last().unwrap()["summary"];
    assert!(!out.status.success(), "the stale samples are failures");
    assert_eq!(n, 2);
    assert_eq!(summary["mismatches"], 2, "{summary}");
    let err = summary["first_error"].as_str().unwrap();
    assert!(err.contains("stale session"), "{err}");
    // The new producer's samples were read and freed: it finishes cleanly.
    assert!(new.wait().unwrap().success(), "{last}");
    let read_ok = lines.iter().filter(|v| v["ok"] == true).count();
    assert_eq!(read_ok, 2, "{lines:?}");
}

#[test]
fn a_missing_nixl_library_is_an_error_that_names_the_setting() {
    let out = Command::new(EXE)
        .args([
            "produce",
            "--samples",
            "1",
            "--max-len",
            "8",
            "--min-len",
            "8",
        ])
        .args(["--hidden", "64", "--arena-bytes", "1MiB", "--quiet"])
        .env("SGLANG_SPEC_CAPTURE_TRANSPORT", "nixl")
        .env(
            "SGLANG_SPEC_CAPTURE_NIXL_LIB",
            "/nonexistent/libnixl_capi.so",
        )
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("SGLANG_SPEC_CAPTURE_NIXL_LIB") && err.contains("nixl-cu12"),
        "{err}"
    );
}

#[test]
fn a_producer_that_stops_answering_fails_the_read_at_the_timeout_and_reads_resume_after() {
    // UCX over TCP cannot tell a stopped process from a slow one: the read timeout decides.
    // (What stops is the process that serves the READs: the producer's NIXL server.)
    let tls = Some("tcp");
    let two = [
        "--samples",
        "2",
        "--min-len",
        "512",
        "--max-len",
        "512",
        "--hidden",
        "1024",
        "--batch",
        "1",
    ];
    let mut p = producer(&two, "32MiB", "5", tls);
    let mut from_p = BufReader::new(p.stdout.take().unwrap()).lines();
    let lines: Vec<String> = from_p.by_ref().take(2).map(Result::unwrap).collect();
    // The arena is served by the producer's NIXL server process (its child): that one stops.
    let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", p.id())).unwrap();
    let pid = children
        .split_whitespace()
        .next()
        .expect("a NIXL server process")
        .to_owned();
    let signal = |sig: &str| util::signal(sig.trim_start_matches('-'), pid.parse().unwrap());
    let mut c = Command::new(EXE);
    c.args(["consume", "--quiet", "--progress"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    let mut t = nixl(c, tls)
        .env("SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S", "2")
        .spawn()
        .unwrap();
    let mut to = t.stdin.take().unwrap();
    let mut from = BufReader::new(t.stdout.take().unwrap());
    let mut answer = |line: &str| -> Value {
        writeln!(to, "{line}").unwrap();
        let mut a = String::new();
        from.read_line(&mut a).unwrap();
        serde_json::from_str(&a).unwrap()
    };
    signal("-STOP");
    let t0 = std::time::Instant::now();
    let first = answer(&lines[0]);
    let waited = t0.elapsed();
    signal("-CONT");
    assert_eq!(first["ok"], false, "{first}");
    assert!(
        waited >= std::time::Duration::from_secs(2) && waited < std::time::Duration::from_secs(15),
        "failed after {waited:?}"
    );
    // The producer answers again: the same trainer reads its next sample (a new reader agent).
    let second = answer(&lines[1]);
    assert_eq!(second["ok"], true, "{second}");
    drop(to);
    let mut rest = Vec::new();
    std::io::Read::read_to_end(&mut from, &mut rest).unwrap();
    t.wait().unwrap();
    let summary = json_lines(&rest);
    let s = &summary.last().unwrap()["summary"];
    assert_eq!(s["mismatches"], 1, "{s}");
    assert!(
        s["first_error"]
            .as_str()
            .unwrap()
            .contains("did not complete in 2.0 s"),
        "{s}"
    );
    // The stale sample was released all the same, and its frees were sent, not dropped: its
    // producer was alive (stopped), so it ends with every object freed.
    assert_eq!(s["dropped_frees"], 0, "{s}");
    assert_eq!(s["pending_frees"], 0, "{s}");
    let _rest: Vec<String> = from_p.map(Result::unwrap).collect();
    assert!(
        p.wait().unwrap().success(),
        "the producer was left holding objects"
    );
}
