//! The CLI's halves as real processes: a producer process publishes, a trainer process reads
//! every byte and frees, and the arena returns to fully free; the demo itself; stale sessions.

use std::io::Write;
use std::process::{Child, Command, Stdio};

use serde_json::Value;

mod util;

use util::{signal, tiny_producer, within, EXE, SMALL};

/// A producer of the small workload into a 2 MiB arena (smaller than the ~5 MiB it publishes),
/// its results on a pipe.
fn small_producer() -> Child {
    Command::new(EXE)
        .arg("produce")
        .args(SMALL)
        .args(["--arena-bytes", "2MiB", "--idle-timeout", "20", "--quiet"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

/// A trainer (`consume`) fed by the test through a pipe.
fn piped_trainer() -> Child {
    Command::new(EXE)
        .args(["consume", "--quiet"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

fn last_json(out: &[u8], key: &str) -> Value {
    String::from_utf8_lossy(out)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .rfind(|v| v.get(key).is_some())
        .unwrap_or_else(|| panic!("no {key} line in {}", String::from_utf8_lossy(out)))
}

#[test]
fn producer_and_trainer_processes_move_every_byte_and_the_arena_ends_free() {
    // Frees must flow back for the producer to finish.
    let mut producer = small_producer();
    let trainer = Command::new(EXE)
        .args(["consume", "--quiet"])
        .stdin(producer.stdout.take().unwrap())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let t = trainer.wait_with_output().unwrap();
    let p = producer.wait().unwrap();
    let summary = &last_json(&t.stdout, "summary")["summary"];
    assert!(t.status.success(), "{summary}");
    assert!(p.success());
    assert_eq!(summary["samples"], 12);
    assert_eq!(summary["mismatches"], 0);
    assert!(
        summary["bytes"].as_u64().unwrap() > 2 << 20,
        "more data than the arena holds"
    );
}

#[test]
fn producer_reports_its_final_stats_and_the_arena_is_fully_free() {
    // Here the producer's stdout comes back to the test: results go to a consumer by hand.
    let mut producer = small_producer();
    let mut trainer = piped_trainer();
    let mut to_trainer = trainer.stdin.take().unwrap();
    let mut producer_final = None;
    use std::io::BufRead;
    for line in std::io::BufReader::new(producer.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        let v: Value = serde_json::from_str(&line).unwrap();
        if v.get("stats").is_some() {
            producer_final = Some(v);
        } else {
            assert!(v["arena"]["session"]
                .as_str()
                .unwrap()
                .starts_with("shm://"));
            assert_eq!(v["features"]["hidden_state"]["dtype"], "bfloat16");
            writeln!(to_trainer, "{line}").unwrap();
        }
    }
    drop(to_trainer);
    assert!(producer.wait().unwrap().success());
    assert!(trainer.wait().unwrap().success());
    let f = producer_final.expect("final stats line");
    let s = &f["stats"];
    assert_eq!(f["ok"], true);
    assert_eq!(s["published_samples"], 12);
    assert_eq!(s["freed_objects"], s["published_objects"]);
    assert_eq!(s["free_bytes"], s["capacity"]);
    assert_eq!(s["resident_objects"], 0);
    assert_eq!(s["bad_lines"], 0);
}

#[test]
fn results_of_an_exited_producer_are_refused_as_stale() {
    // Nobody frees: the producer gives up after its idle timeout, exits non-zero and removes
    // its arena. Its results, fed to a trainer afterwards, must be refused, not read.
    let producer = tiny_producer("2", "0.2").output().unwrap();
    assert!(
        !producer.status.success(),
        "nobody freed: the producer must fail"
    );
    let f = last_json(&producer.stdout, "stats");
    assert!(
        f["error"].as_str().unwrap().contains("no free arrived"),
        "{f}"
    );
    // A second producer is running now (the "restarted" server).
    let mut restarted = tiny_producer("1", "1").spawn().unwrap();
    let mut trainer = piped_trainer();
    trainer
        .stdin
        .take()
        .unwrap()
        .write_all(&producer.stdout)
        .unwrap();
    let t = trainer.wait_with_output().unwrap();
    assert!(!t.status.success());
    let s = &last_json(&t.stdout, "summary")["summary"];
    assert_eq!(s["mismatches"], 2, "{s}");
    assert!(
        s["first_error"].as_str().unwrap().contains("stale session"),
        "{s}"
    );
    // Let it end by itself (nobody frees its sample: it fails after its idle timeout), so it
    // removes its arena; a killed producer would leave it in /dev/shm.
    assert!(!restarted.wait().unwrap().success());
}

#[test]
fn the_demo_runs_end_to_end_with_a_small_configuration() {
    let text = util::stdout_of_success(Command::new(EXE).arg("demo").args(SMALL).args([
        "--arena-bytes",
        "2MiB",
        "--quiet",
    ]));
    for needle in [
        "12 published, 12 read and verified",
        "arena completely free            ok",
        "publish",
        "read latency / sample",
        "waits for frees",
        "result                           OK",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from\n{text}");
    }
}

#[test]
fn produce_without_an_arena_size_says_what_to_set() {
    let out = Command::new(EXE)
        .args(["produce", "--samples", "1"])
        .env_remove("SGLANG_SPEC_CAPTURE_ARENA_BYTES")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--arena-bytes") && err.contains("SGLANG_SPEC_CAPTURE_ARENA_BYTES"),
        "{err}"
    );
}

#[test]
fn clean_removes_only_the_arenas_no_producer_holds() {
    let dir = std::env::temp_dir().join(format!("capture-arena-clean-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let nonce = "0123456789abcdef0123456789abcdef";
    let stale = dir.join(format!("capture-arena-999999-{nonce}"));
    let held = dir.join(format!("capture-arena-999998-{nonce}"));
    let other = dir.join("not-ours");
    for p in [&stale, &held, &other] {
        std::fs::write(p, b"x").unwrap();
    }
    // A producer holds a shared lock on its arena for its whole life; `flock -s` stands in.
    let mut holder = Command::new("flock")
        .arg("-s")
        .arg(&held)
        .args(["sleep", "5"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Held once an exclusive try fails (flock -n exits 1 while the shared lock is there).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while Command::new("flock")
        .args(["-x", "-n"])
        .arg(&held)
        .arg("true")
        .status()
        .unwrap()
        .success()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "flock never took its lock"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let dry = Command::new(EXE)
        .args(["clean", "--dry-run", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(dry.status.success());
    assert!(String::from_utf8_lossy(&dry.stdout).contains("would remove 1 stale"));
    assert!(stale.exists(), "a dry run removes nothing");
    let out = Command::new(EXE)
        .args(["clean", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("removed 1 stale") && text.contains("held by its producer"),
        "{text}"
    );
    assert!(!stale.exists() && held.exists() && other.exists());
    let _ = holder.kill();
    let _ = holder.wait();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_producer_stopped_by_a_signal_removes_its_arena() {
    // docs/commands.md: SIGTERM, SIGINT and SIGHUP remove the arena, then the process dies by the signal.
    for (name, number) in [("TERM", 15), ("INT", 2), ("HUP", 1)] {
        let mut producer = tiny_producer("1", "60").spawn().unwrap();
        let mut first = String::new();
        use std::io::BufRead;
        std::io::BufReader::new(producer.stdout.take().unwrap())
            .read_line(&mut first)
            .unwrap();
        let v: Value = serde_json::from_str(&first).unwrap();
        let session = v["arena"]["session"].as_str().unwrap().to_owned();
        let shm = session
            .trim_start_matches("shm://")
            .split('?')
            .next()
            .unwrap()
            .to_owned();
        let path = std::path::Path::new("/dev/shm").join(&shm);
        assert!(path.exists(), "{path:?}");
        signal(name, producer.id());
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            producer.wait().unwrap().signal(),
            Some(number),
            "it dies by SIG{name}"
        );
        assert!(!path.exists(), "the arena was not removed on SIG{name}");
    }
}

/// The live children of `pid` (scanning /proc: a zombie counts as gone), with their command lines.
fn children_of(pid: u32) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        // "pid (comm) state ppid ...": comm may hold spaces, so split after its ')'.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.len() > 1 && fields[0] != "Z" && fields[1] == pid.to_string() {
            let cmd = std::fs::read(format!("/proc/{child}/cmdline")).unwrap_or_default();
            out.push((child, String::from_utf8_lossy(&cmd).replace('\0', " ")));
        }
    }
    out
}

/// Whether process `pid` is gone (or a zombie nobody has reaped yet).
fn gone(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
        s.rsplit_once(')')
            .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
    })
}

/// A demo of 1000 tiny samples through a 64 KiB arena (it fills, so its producer waits for
/// frees), its stderr piped, once both children have exec'd (a child between fork and exec
/// still shows the demo's command line); with them, as `(pid, command line)`, producer first.
fn demo_with_children(log: &str) -> (Child, [(u32, String); 2]) {
    let demo = Command::new(EXE)
        .env("RUST_LOG", log)
        .arg("demo")
        .args(["--samples", "1000", "--min-len", "8", "--max-len", "8"])
        .args(["--hidden", "64", "--batch", "1", "--arena-bytes", "64KiB"])
        .args(["--idle-timeout", "60", "--quiet"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut kids = Vec::new();
    let one = |kids: &[(u32, String)], what: &str| {
        let of: Vec<_> = kids.iter().filter(|(_, c)| c.contains(what)).collect();
        (of.len() == 1).then(|| of[0].clone())
    };
    assert!(
        within(30, || {
            kids = children_of(demo.id());
            one(&kids, " produce ").is_some() && one(&kids, " consume ").is_some()
        }),
        "the demo's two children did not start: {kids:?}"
    );
    let producer = one(&kids, " produce ").unwrap();
    let trainer = one(&kids, " consume ").unwrap();
    (demo, [producer, trainer])
}

#[test]
fn a_demo_stopped_by_sigterm_takes_its_producer_and_trainer_and_the_arena_with_it() {
    // `timeout`, a CI job's cancel or a supervisor sends SIGTERM to the demo alone (not its
    // process group, as a terminal's Ctrl-C does). Before, the demo died at once and its
    // children ran on: a producer waiting for frees held its arena for the arena's wait (30 s).
    use std::io::BufRead;
    let (mut demo, kids) = demo_with_children("capture_arena=debug");
    let (producer, trainer) = (kids[0].0, kids[1].0);
    // The trainer stops freeing; the producer fills its arena and waits for frees.
    signal("STOP", trainer);
    let mut log = std::io::BufReader::new(demo.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("batch waits for frees") {
        line.clear();
        assert_ne!(
            log.read_line(&mut line).unwrap(),
            0,
            "the demo's stderr ended"
        );
    }
    let arena = || {
        std::fs::read_dir("/dev/shm")
            .unwrap()
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(&format!("capture-arena-{producer}-"))
            })
            .count()
    };
    assert_eq!(arena(), 1, "the producer's arena");
    signal("TERM", demo.id());
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(demo.wait().unwrap().signal(), Some(15));
    let ended = within(5, || gone(producer));
    signal("CONT", trainer);
    assert!(ended, "the producer outlived the demo by 5 s");
    assert!(
        within(5, || gone(trainer)),
        "the trainer outlived the demo by 5 s"
    );
    assert_eq!(arena(), 0, "the producer's arena outlived it");
}

#[test]
fn a_demo_whose_trainer_is_killed_says_so_and_stops_its_producer() {
    // Before: the producer, waiting for frees, held the demo for the arena's wait (30 s), and
    // the error was the forwarding's "Broken pipe (os error 32)", the trainer not named.
    let (mut demo, kids) = demo_with_children("warn");
    let trainer = kids[1].0;
    let t0 = std::time::Instant::now();
    signal("KILL", trainer);
    let mut err = String::new();
    use std::io::Read;
    demo.stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let code = demo.wait().unwrap().code();
    let took = t0.elapsed();
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("the trainer process failed (signal: 9 (SIGKILL))"),
        "{err}"
    );
    assert!(
        took < std::time::Duration::from_secs(10),
        "the demo took {took:?} to end"
    );
    for (pid, cmd) in &kids {
        assert!(gone(*pid), "{cmd} ({pid}) outlived the demo");
    }
}

#[test]
fn an_operator_reclaims_a_dead_trainers_samples_with_free_prefix() {
    // The trainer died before freeing anything: the producer holds 3 samples.
    let mut producer = tiny_producer("3", "30").spawn().unwrap();
    let mut lines =
        std::io::BufRead::lines(std::io::BufReader::new(producer.stdout.take().unwrap()));
    let first: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    let control = first["arena"]["control"].as_str().unwrap().to_owned();
    let store = first["store_id"].as_str().unwrap().to_owned();
    let rest: Vec<String> = lines.by_ref().take(2).map(Result::unwrap).collect();
    assert_eq!(rest.len(), 2);
    let out = Command::new(EXE)
        .args([
            "free",
            "--control",
            &control,
            "--prefix",
            &format!("{store}/"),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 prefixes"));
    // Everything freed: the producer ends cleanly, its arena fully free.
    let last: Vec<Value> = lines
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str(&l).ok())
        .collect();
    assert!(producer.wait().unwrap().success());
    let s = &last.last().unwrap()["stats"];
    assert_eq!(s["resident_objects"], 0);
    assert_eq!(s["free_bytes"], s["capacity"]);
    // A bad prefix is refused before anything is sent.
    let bad = Command::new(EXE)
        .args(["free", "--control", &control, "--prefix", "no-slash"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("ends with '/'"));
}

#[test]
fn an_operator_sees_who_holds_a_running_producers_arena() {
    // A producer with a token holds 3 unread samples of one store.
    let mut producer = tiny_producer("3", "30")
        .env("SGLANG_SPEC_CAPTURE_CONTROL_TOKEN", "auto")
        .spawn()
        .unwrap();
    let mut lines =
        std::io::BufRead::lines(std::io::BufReader::new(producer.stdout.take().unwrap()));
    let first: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    let control = first["arena"]["control"].as_str().unwrap().to_owned();
    let token = first["arena"]["token"].as_str().unwrap().to_owned();
    let store = first["store_id"].as_str().unwrap().to_owned();
    let rest: Vec<String> = lines.by_ref().take(2).map(Result::unwrap).collect();
    assert_eq!(rest.len(), 2);
    let run = |args: &[&str]| {
        Command::new(EXE)
            .args(args)
            .env_remove("SGLANG_SPEC_CAPTURE_CONTROL_TOKEN")
            .output()
            .unwrap()
    };
    // `stats --json`: the producer's own counters and its table.
    let out = run(&["stats", "--control", &control, "--token", &token, "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["pid"], producer.id());
    assert_eq!(r["stats"]["published_samples"], 3);
    assert_eq!(r["stores"][0]["store_id"], store.as_str());
    assert_eq!(r["stores"][0]["objects"], r["stats"]["resident_objects"]);
    // The table, for people.
    let out = run(&["stats", "--control", &control, "--token", &token]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("largest") && text.contains(&store), "{text}");
    // `top`: frames with rates, then it stops when told.
    let out = run(&[
        "top",
        "--control",
        &control,
        "--token",
        &token,
        "--frames",
        "2",
        "--interval",
        "0.2",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.matches("capture-arena producer").count(), 2, "{text}");
    assert!(text.contains("rates") && text.contains(&store), "{text}");
    // Without the token: refused, with what to pass.
    let out = run(&["stats", "--control", &control]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--token"));
    // Reclaim, and the producer ends cleanly.
    let out = run(&[
        "free",
        "--control",
        &control,
        "--token",
        &token,
        "--prefix",
        &format!("{store}/"),
    ]);
    assert!(out.status.success());
    let last: Vec<Value> = lines
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str(&l).ok())
        .collect();
    assert!(producer.wait().unwrap().success());
    assert_eq!(last.last().unwrap()["stats"]["resident_objects"], 0);
    // A producer that is gone: a clear error, not a hang.
    let out = run(&["stats", "--control", &control, "--timeout", "2"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains(&control));
}
