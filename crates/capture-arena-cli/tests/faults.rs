//! Faults and hostile peers against real producer processes: idle connections that hold
//! unfinished lines, floods of garbage, a descriptor limit, forged results, producers killed
//! outright and the children they leave behind.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use capture_arena::config::DEFAULT_CONTROL_BUFFER_BYTES;
use serde_json::Value;

mod util;

use util::{tiny_producer, EXE};

/// [`tiny_producer`] with its stderr as given.
fn producer(samples: &str, idle: &str, stderr: Stdio) -> Command {
    let mut c = tiny_producer(samples, idle);
    c.stderr(stderr);
    c
}

/// Reads the producer's result lines until `n` results; returns them.
fn results(out: &mut BufReader<ChildStdout>, n: usize) -> Vec<String> {
    let mut lines = Vec::new();
    while lines.len() < n {
        let mut l = String::new();
        assert!(
            out.read_line(&mut l).unwrap() > 0,
            "the producer ended early"
        );
        lines.push(l.trim_end().to_owned());
    }
    lines
}

fn field(line: &str, a: &str, b: &str) -> String {
    let v: Value = serde_json::from_str(line).unwrap();
    v[a][b].as_str().unwrap().to_owned()
}

/// The `/dev/shm` path of a session.
fn shm_path(session: &str) -> PathBuf {
    let name = session
        .trim_start_matches("shm://")
        .split('?')
        .next()
        .unwrap();
    PathBuf::from("/dev/shm").join(name)
}

/// Feeds result lines to a trainer (`consume`), which reads, verifies and frees them.
fn consume(lines: &[String]) -> Value {
    let mut t = Command::new(EXE)
        .args(["consume", "--quiet"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = t.stdin.take().unwrap();
    for l in lines {
        writeln!(input, "{l}").unwrap();
    }
    drop(input);
    let out = t.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let summary = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v.get("summary").is_some())
        .unwrap_or_else(|| panic!("no summary in {text}"));
    summary["summary"].clone()
}

/// The producer's final line (after it exits).
fn final_line(mut p: Child, out: BufReader<ChildStdout>) -> Value {
    let v = out
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str::<Value>(&l).ok())
        .find(|v| v.get("stats").is_some())
        .expect("a final stats line");
    let _ = p.wait();
    v
}

/// The producer's counters (`capture-arena stats --json`), asked again until `pred` holds (30 s).
fn wait_stats(control: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = Command::new(EXE)
            .args(["stats", "--json", "--control", control])
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        let s = v.get("stats").cloned().unwrap_or(v);
        if pred(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "condition never held: {s}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap()
}

#[test]
fn idle_connections_holding_unfinished_lines_do_not_grow_the_producer() {
    let mut p = producer("1", "60", Stdio::null()).spawn().unwrap();
    let mut out = BufReader::new(p.stdout.take().unwrap());
    let lines = results(&mut out, 1);
    let control = field(&lines[0], "arena", "control");
    let before = rss_kib(p.id());
    // 300 connections each send 1 MiB - 16 bytes of one line and never finish it.
    let partial = vec![b' '; (1 << 20) - 16];
    let conns: Vec<TcpStream> = (0..300)
        .map(|_| {
            let mut c = TcpStream::connect(&control).unwrap();
            c.set_write_timeout(Some(Duration::from_millis(200)))
                .unwrap();
            let _ = c.write_all(&partial); // the server pushes back once its pool is used
            c
        })
        .collect();
    // Measured once the producer took in all it will: its pool of buffered lines is full (300
    // MiB of unfinished lines were offered) and every connection is open.
    let full = DEFAULT_CONTROL_BUFFER_BYTES - (1 << 20);
    let s = wait_stats(&control, |s| {
        s["open_connections"].as_u64() >= Some(300)
            && s["control_buffered_bytes"].as_u64() >= Some(full)
    });
    // What the producer holds: the pool, a small line (4 KiB) per connection and one maximal
    // line (1 MiB).
    let open = s["open_connections"].as_u64().unwrap_or(0);
    let bound = DEFAULT_CONTROL_BUFFER_BYTES + open * 4096 + (1 << 20);
    assert!(
        s["control_buffered_bytes"].as_u64() <= Some(bound),
        "{bound}: {s}"
    );
    let grown_mib = rss_kib(p.id()).saturating_sub(before) / 1024;
    // The pool (16 MiB), a small line per connection and one maximal line: ~18 MiB.
    assert!(grown_mib <= 64, "the producer grew by {grown_mib} MiB");
    drop(conns);
    // And it still serves a real trainer.
    let s = consume(&lines);
    assert_eq!(s["ok"], true, "{s}");
    let f = final_line(p, out);
    assert_eq!(f["ok"], true, "{f}");
}

#[test]
fn a_flood_of_garbage_is_counted_and_its_warnings_are_rate_limited() {
    let mut p = producer("1", "60", Stdio::piped()).spawn().unwrap();
    let mut err = BufReader::new(p.stderr.take().unwrap());
    let mut out = BufReader::new(p.stdout.take().unwrap());
    let lines = results(&mut out, 1);
    let control = field(&lines[0], "arena", "control");
    let t0 = Instant::now();
    {
        // The flood, then a sync on the same connection: its answer comes once every line
        // before it was handled (counted), so the count below is final, not a guess at timing.
        let mut c = TcpStream::connect(&control).unwrap();
        c.write_all(&b"x\n".repeat(100_000)).unwrap();
        c.write_all(b"{\"sync\": 7}\n").unwrap();
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut answer = String::new();
        BufReader::new(&c).read_line(&mut answer).unwrap();
        assert_eq!(answer.trim(), r#"{"synced":7,"stamps":true}"#, "{answer:?}");
    }
    let s = consume(&lines);
    assert_eq!(s["ok"], true, "{s}");
    let secs = t0.elapsed().as_secs() + 1;
    let f = final_line(p, out);
    assert_eq!(
        f["stats"]["bad_lines"], 100_000,
        "every bad line is counted"
    );
    let mut log = String::new();
    std::io::Read::read_to_string(&mut err, &mut log).unwrap();
    let warnings = log
        .lines()
        .filter(|l| l.contains("bad control line"))
        .count() as u64;
    assert!(
        (1..=secs + 1).contains(&warnings),
        "{warnings} warnings in {secs} s:\n{}",
        &log[..log.len().min(2000)]
    );
    assert!(log.contains("suppressed"), "{log}");
}

#[test]
fn a_producer_out_of_descriptors_refuses_connections_and_recovers() {
    let mut cmd = producer("2", "60", Stdio::piped());
    // SAFETY: setrlimit is async-signal-safe; it only lowers the child's own limit.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 40,
                rlim_max: 40,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut p = cmd.spawn().unwrap();
    let mut err = BufReader::new(p.stderr.take().unwrap());
    let mut out = BufReader::new(p.stdout.take().unwrap());
    let lines = results(&mut out, 2);
    let control = field(&lines[0], "arena", "control");
    // More connections than the producer has descriptors: the excess is closed, not left hanging.
    let conns: Vec<TcpStream> = (0..80)
        .filter_map(|_| TcpStream::connect(&control).ok())
        .collect();
    let mut closed = 0;
    for mut c in conns.iter().skip(40) {
        // Closed: EOF or a reset; still open: the read times out (not counted).
        c.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut b = [0u8; 1];
        match std::io::Read::read(&mut c, &mut b) {
            Ok(0) => closed += 1,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => closed += 1,
            _ => {}
        }
    }
    assert!(
        closed > 0,
        "connections beyond the descriptor limit are closed"
    );
    drop(conns);
    // Once descriptors are free again, a trainer frees everything and the producer ends well.
    let s = consume(&lines);
    assert_eq!(s["ok"], true, "{s}");
    let f = final_line(p, out);
    assert_eq!(f["ok"], true, "{f}");
    assert!(f["stats"]["accept_errors"].as_u64().unwrap() > 0, "{f}");
    let mut log = String::new();
    std::io::Read::read_to_string(&mut err, &mut log).unwrap();
    assert!(log.contains("ulimit -n"), "{log}");
}

#[test]
fn consume_refuses_forged_results_without_allocating_or_crashing() {
    let forged = [
        // A shape of 2^40 bf16 elements (2 TiB) at an address of a session that does not exist.
        r#"{"sample_id":"s","store_id":"a","gen":1,"aux_layer_ids":null,"features":{"x":{"shape":[1099511627776],"dtype":"bfloat16","address":4096}},"arena":{"session":"shm://capture-arena-1-000000000000000000000000000000ff?len=1&base=0x1000","control":"127.0.0.1:9"}}"#.to_owned(),
        // A shape whose size overflows.
        r#"{"sample_id":"s","store_id":"a","gen":1,"aux_layer_ids":null,"features":{"x":{"shape":[4294967296,4294967296,4],"dtype":"int64","address":4096}},"arena":{"session":"shm://x","control":"127.0.0.1:9"}}"#.to_owned(),
        // A line of 2 MiB.
        format!("{{\"pad\": \"{}\"}}", "x".repeat(2 << 20)),
    ];
    let mut c = Command::new(EXE)
        .args(["consume", "--quiet"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = c.stdin.take().unwrap();
    for l in &forged {
        writeln!(input, "{l}").unwrap();
    }
    drop(input);
    let out = c.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "a clean failure, not an abort: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let s = &v["summary"];
    assert_eq!(
        (s["mismatches"].as_u64(), s["bad_lines"].as_u64()),
        (Some(2), Some(1)),
        "{s}"
    );
}

#[test]
fn consume_refuses_features_that_add_up_to_more_than_their_arena() {
    // A live arena, and a result naming the whole of it 256 times: each feature lies inside the
    // arena, together they are 256 arenas (before: consume sized its buffers by them, 16 GiB
    // here). Its address space is capped at 4 GiB, so sizing them fails rather than the host.
    use capture_arena::{Dtype, Sample, SampleResult, Tensor, TensorData};
    let config = capture_arena::Config {
        arena_bytes: Some(64 << 20),
        ..Default::default()
    };
    let w = capture_arena::Writer::start(&config).unwrap();
    let mut sample = Sample::new("st", "real", 1).unwrap();
    let t = Tensor::new("t0", vec![16], Dtype::Uint8, TensorData::host(vec![1; 16])).unwrap();
    sample.push(t).unwrap();
    let results = w.submit(vec![sample]).unwrap().wait_results();
    let SampleResult::Published(p) = &results[0] else {
        panic!("{results:?}")
    };
    let session: capture_arena::memory::ShmSession = p.arena.session.parse().unwrap();
    let mut forged = serde_json::to_value(p).unwrap();
    forged["sample_id"] = "forged".into();
    forged["features"] = (0..256)
        .map(|i| {
            let whole = serde_json::json!({"shape": [session.len], "dtype": "uint8",
                "address": session.base});
            (format!("f{i}"), whole)
        })
        .collect::<serde_json::Map<String, Value>>()
        .into();
    let mut cmd = Command::new(EXE);
    cmd.args(["consume", "--quiet"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: setrlimit is async-signal-safe; it only lowers the child's own limit.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 4 << 30,
                rlim_max: 4 << 30,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut c = cmd.spawn().unwrap();
    let mut input = c.stdin.take().unwrap();
    writeln!(input, "{forged}").unwrap();
    drop(input);
    let out = c.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(text.lines().last().unwrap_or("{}")).unwrap();
    let s = &v["summary"];
    assert_eq!(
        out.status.code(),
        Some(1),
        "a clean failure, not an abort: {s} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        s["first_error"]
            .as_str()
            .is_some_and(|e| e.contains("add up to 17179869184 bytes, more than the 67108864")),
        "{s}"
    );
}

/// A test-only role for this test binary: a producer that creates an arena, forks a child that
/// outlives it, prints `<session> <child pid>` and waits to be killed.
#[test]
fn forking_producer_role() {
    if std::env::var_os("CAPTURE_ARENA_TEST_ROLE").is_none() {
        return; // run as a test: nothing to do
    }
    let w = capture_arena::Writer::start(&capture_arena::Config {
        arena_bytes: Some(1 << 20),
        ..capture_arena::Config::default()
    })
    .unwrap();
    // SAFETY: the child only calls async-signal-safe functions (sleep, _exit).
    let child = unsafe { libc::fork() };
    if child == 0 {
        // SAFETY: as above.
        unsafe {
            libc::sleep(30);
            libc::_exit(0);
        }
    }
    println!("{} {child}", w.arena_ref().session);
    std::io::stdout().flush().unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn a_dead_producers_arena_is_reclaimed_even_while_its_forked_child_lives() {
    let mut p = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "forking_producer_role",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("CAPTURE_ARENA_TEST_ROLE", "1")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(p.stdout.take().unwrap());
    let mut line = String::new();
    // The harness prints the test's name on the same line, before the role's output.
    let at = loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the role printed nothing"
        );
        if let Some(at) = line.find("shm://") {
            break at;
        }
    };
    let mut parts = line[at..].split_whitespace();
    let path = shm_path(parts.next().unwrap());
    let child: i32 = parts.next().unwrap().parse().unwrap();
    assert!(path.exists());
    p.kill().unwrap(); // SIGKILL: no destructor runs, the arena stays in /dev/shm
    p.wait().unwrap();
    assert!(
        std::path::Path::new(&format!("/proc/{child}")).exists(),
        "the forked child lives on"
    );
    // Another test's producer may hold the lock for an instant while it sweeps: ask again. Or
    // its sweep found the arena abandoned first and removed it (sweeps remove nothing else).
    let abandoned = (0..50).any(|_| {
        let a = match capture_arena::memory::shm::is_abandoned(&path) {
            Ok(a) => a,
            Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        };
        if !a {
            std::thread::sleep(Duration::from_millis(10));
        }
        a
    });
    // SAFETY: plain FFI on our grandchild's pid, which we know is alive.
    unsafe { libc::kill(child, libc::SIGKILL) };
    assert!(
        abandoned,
        "the child must not keep its dead parent's arena in use"
    );
    // The next producer on this host removes it by itself.
    let w = capture_arena::Writer::start(&capture_arena::Config {
        arena_bytes: Some(1 << 20),
        ..capture_arena::Config::default()
    })
    .unwrap();
    assert!(
        !path.exists(),
        "{path:?} was not reclaimed by a new producer"
    );
    drop(w);
}

#[test]
fn a_new_producer_removes_the_arenas_of_killed_producers() {
    let mut killed = producer("1", "60", Stdio::null()).spawn().unwrap();
    let mut out = BufReader::new(killed.stdout.take().unwrap());
    let lines = results(&mut out, 1);
    let path = shm_path(&field(&lines[0], "arena", "session"));
    killed.kill().unwrap();
    killed.wait().unwrap();
    // SIGKILL leaves the arena behind (unless a producer of a test running beside this one
    // has already removed it, which is the behaviour under test too).
    let mut next = producer("1", "60", Stdio::null()).spawn().unwrap();
    let mut out2 = BufReader::new(next.stdout.take().unwrap());
    let lines2 = results(&mut out2, 1);
    assert!(
        !path.exists(),
        "{path:?} was not removed by the next producer"
    );
    let s = consume(&lines2);
    assert_eq!(s["ok"], true, "{s}");
    let f = final_line(next, out2);
    assert_eq!(f["ok"], true);
}

#[test]
fn a_reader_lets_go_of_a_producer_killed_outright() {
    let mut p = producer("1", "60", Stdio::null()).spawn().unwrap();
    let mut out = BufReader::new(p.stdout.take().unwrap());
    let lines = results(&mut out, 1);
    let r: capture_arena::Published = serde_json::from_str(&lines[0]).unwrap();
    let reader = capture_arena::Reader::new();
    let n = reader.checked_len(&r, "input_ids").unwrap() as usize;
    reader.read(&r, "input_ids", &mut vec![0u8; n]).unwrap();
    let name = shm_path(&r.arena.session)
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let mapped = || {
        std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .contains(&name)
    };
    assert!(mapped());
    p.kill().unwrap(); // no destructor: the object stays in /dev/shm, its lock goes
    p.wait().unwrap();
    // Readers try the lock once a second: reads go on (the bytes are still there) until one
    // check finds it free. The reader's sweep and the session's check each wait a second, so
    // about two seconds; one CI-like run (2 cores, every test binary's tests in parallel) still
    // read at 3 s, so the deadline only tells "eventually" from "never".
    let deadline = Instant::now() + Duration::from_secs(10);
    let e = loop {
        match reader.read(&r, "input_ids", &mut vec![0u8; n]) {
            Err(e) => break e,
            Ok(_) => assert!(
                Instant::now() < deadline,
                "a dead producer's arena is still read"
            ),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        matches!(e, capture_arena::Error::StaleSession { .. }),
        "{e}"
    );
    assert!(!mapped(), "the reader still maps a dead producer's arena");
    // Leave nothing behind.
    let _ = std::fs::remove_file(shm_path(&r.arena.session));
}

#[test]
fn a_short_soak_balances_its_books() {
    let out = std::process::Command::new(util::EXE)
        .args([
            "soak",
            "--duration",
            "2",
            "--clients",
            "12",
            "--hostile",
            "5",
        ])
        .args(["--sample-bytes", "64KiB", "--arena-bytes", "8MiB"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(last["ok"], true);
    let s = &last["stats"];
    assert!(s["published_samples"].as_u64().unwrap() > 0);
    assert_eq!(s["freed_objects"], s["published_objects"]);
    assert_eq!(s["unknown_frees"], 0);
    // The producer ran in its own process and measured its own memory.
    assert!(last["producer_rss_start"].as_u64().unwrap() > 0);
    assert!(last["producer_rss_series"].as_array().unwrap().len() >= 2);
    assert!(s["bad_lines"].as_u64().unwrap() > 0 && s["unauthorized_lines"].as_u64().unwrap() > 0);
}
