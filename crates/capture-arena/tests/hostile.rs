//! The control server against peers that flood, hoard connections, hold unfinished lines or
//! never finish them, over real loopback sockets. Nothing a peer does may stop publication, stall
//! other peers, or grow the server without bound.

mod util;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use capture_arena::client::ControlClient;
use capture_arena::{
    Config, Dtype, Error, Key, Published, Sample, SampleResult, Tensor, TensorData, Writer,
};
use util::*;

/// A client writing one line (the caller's) over and over, as fast as it can, until dropped.
struct Flood {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl Flood {
    fn start(control: &str, line: &'static [u8]) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let mut c = TcpStream::connect(control).unwrap();
        c.set_write_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let thread = std::thread::spawn(move || {
            let buf = line.repeat(64 * 1024 / line.len());
            let mut sent = 0u64;
            // Where the next write starts: a short write is continued, never restarted (that
            // would cut a line in two, a bad line of the test's making).
            let mut at = 0;
            while !s.load(Ordering::Relaxed) {
                match c.write(&buf[at..]) {
                    Ok(n) => {
                        sent += n as u64;
                        at = (at + n) % buf.len();
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
                    Err(_) => break,
                }
            }
            sent
        });
        Flood {
            stop,
            thread: Some(thread),
        }
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

#[test]
fn a_flooding_client_does_not_stop_publication_or_the_wait_or_close() {
    let w = Writer::start(&config(64 * 1024, Duration::from_millis(500))).unwrap();
    let flood = Flood::start(&w.arena_ref().control, b"[\"no/such/g1/key\"]\n");
    let (s, on) = w.wait_for(Duration::from_secs(5), |s| s.unknown_frees > 1000);
    assert!(on, "the flood never reached the writer: {s:?}");
    // Batches go through while the flood goes on.
    for i in 0..20 {
        let h = w.submit(vec![sample(&format!("s{i}"), &[1000])]).unwrap();
        match h.wait_timeout(Duration::from_secs(5)) {
            Some(Ok(r)) => verify(&r[0]),
            other => panic!("batch {i} under flood: {:?}", other.map(|o| o.map(|_| ()))),
        }
    }
    // A batch that cannot fit still fails when its wait runs out.
    w.submit(vec![sample("big", &[40 * 1024])])
        .unwrap()
        .wait()
        .unwrap();
    let t0 = Instant::now();
    let h = w.submit(vec![sample("bigger", &[40 * 1024])]).unwrap();
    let e = h
        .wait_timeout(Duration::from_secs(10))
        .expect("the wait for frees ends on time under a flood")
        .unwrap_err();
    assert!(matches!(e, Error::ArenaFull { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    // The flood's lines were applied (as frees of a key that is not resident), not ignored.
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.unknown_frees > 1000);
    assert!(
        ok && s.bad_lines == 0 && s.control_connections == 1,
        "{s:?}"
    );
    // Dropping the writer returns although the flood goes on.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(w);
        let _ = tx.send(());
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the writer stops under a flood");
    drop(flood);
}

#[test]
fn other_clients_are_served_while_one_floods() {
    let (w, ks) = {
        let w = Writer::start(&config(1 << 20, Duration::from_secs(5))).unwrap();
        let r = w
            .submit((0..50).map(|i| sample(&format!("s{i}"), &[100])).collect())
            .unwrap()
            .wait()
            .unwrap();
        let ks = keys(&r);
        (w, ks)
    };
    let _flood = Flood::start(&w.arena_ref().control, b"[\"no/such/g1/key\"]\n");
    let (s, on) = w.wait_for(Duration::from_secs(5), |s| s.unknown_frees > 1000);
    assert!(on, "the flood never reached the writer: {s:?}");
    let mut c = TcpStream::connect(&w.arena_ref().control).unwrap();
    c.set_nodelay(true).unwrap();
    let mut worst = Duration::ZERO;
    for (i, k) in ks.iter().enumerate() {
        let t0 = Instant::now();
        writeln!(c, "{}", serde_json::to_string(&[k]).unwrap()).unwrap();
        let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.freed_objects > i as u64);
        assert!(ok, "free {i} not applied under a flood: {s:?}");
        worst = worst.max(t0.elapsed());
    }
    assert_eq!(w.stats().resident_objects, 0);
    // Each was applied under the flood (the wait above); how fast is the benchmark's to say
    // (`cargo bench -p capture-arena --bench robustness`: p50/p99 under the flood).
    eprintln!("slowest free under the flood: {worst:?}");
}

#[test]
fn connections_above_the_limit_are_refused_and_counted() {
    let c = Config {
        max_connections: 8,
        ..config(1 << 20, Duration::from_secs(1))
    };
    let w = Writer::start(&c).unwrap();
    let r = w.submit(vec![sample("a", &[10])]).unwrap().wait().unwrap();
    let mut held: Vec<TcpStream> = (0..8)
        .map(|_| TcpStream::connect(&w.arena_ref().control).unwrap())
        .collect();
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.open_connections == 8);
    assert!(ok, "{s:?}");
    let mut extra: Vec<TcpStream> = (0..5)
        .map(|_| TcpStream::connect(&w.arena_ref().control).unwrap())
        .collect();
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.refused_connections == 5);
    assert!(ok, "{s:?}");
    assert_eq!(s.open_connections, 8);
    for e in &mut extra {
        assert!(closed_by_server(e, Duration::from_secs(5)), "closed");
    }
    // Remote peers holding every control slot do not stop a local reader's request on the
    // reply path (before: one cap for both, so device readers could not import the arena).
    let described =
        capture_arena::reply::request(w.reply_endpoint(), "describe", Duration::from_secs(5));
    assert!(described.is_ok(), "{described:?}");
    // Once a slot is free, a new connection is served.
    drop(held.pop());
    let (_, ok) = w.wait_for(Duration::from_secs(5), |s| s.open_connections == 7);
    assert!(ok);
    free(&w.arena_ref().control, &keys(&r));
    wait_freed(&w, 1);
}

#[test]
fn idle_peers_holding_every_slot_keep_no_trainer_out_for_longer_than_the_line_timeout() {
    // Without a token nothing closed an idle connection: peers that reach the port held every
    // slot for good, and a trainer's frees were refused for as long as they stayed.
    let c = Config {
        max_connections: 4,
        line_timeout: Duration::from_millis(500),
        ..config(1 << 20, Duration::from_secs(1))
    };
    let w = Writer::start(&c).unwrap();
    let control = w.arena_ref().control;
    let [a, b, bare0, bare] = ["a", "b", "bare0", "bare"].map(|id| publish_one(&w, id, &[10]));
    // A client freeing with bare free lines (as SpecForge's ArenaObjectClient: no sync, so a
    // line written on a connection the server closed is lost) is never made to give way.
    let mut bare_lines = TcpStream::connect(&control).unwrap();
    let line = format!("{}\n", serde_json::to_string(&keys(&[bare0])).unwrap());
    bare_lines.write_all(line.as_bytes()).unwrap();
    wait_freed(&w, 1);
    let idle: Vec<TcpStream> = (0..3)
        .map(|_| TcpStream::connect(&control).unwrap())
        .collect();
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.open_connections == 4);
    assert!(ok, "{s:?}");
    let trainer = capture_arena::ControlClient::new(Duration::from_secs(2));
    trainer.free(Some(&control), a.keys().unwrap()).unwrap();
    trainer.flush_within(Duration::from_secs(10)).unwrap();
    wait_freed(&w, 2);
    let s = w.stats();
    assert_eq!((s.idle_closed, s.open_connections), (1, 4), "{s:?}");
    // Refused until the first peer had been idle for the line timeout (the trainer retried).
    let refused = s.refused_connections;
    // The evicted one was the peer idle longest (the first), not a younger one.
    let mut idle = idle.into_iter();
    assert!(closed_by_server(
        &mut idle.next().unwrap(),
        Duration::from_secs(5)
    ));
    drop(idle);
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.open_connections == 2);
    assert!(ok, "{s:?}");
    // The trainer's own connection, idle longest now, makes way the same: its next free
    // reconnects (itself closing a peer idle long enough) and is applied.
    let others: Vec<TcpStream> = (0..2)
        .map(|_| TcpStream::connect(&control).unwrap())
        .collect();
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.open_connections == 4);
    assert!(ok, "{s:?}");
    // Time is the condition here: every one of them idle for longer than the line timeout.
    std::thread::sleep(Duration::from_millis(600));
    let _newcomer = TcpStream::connect(&control).unwrap();
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.idle_closed == 2);
    assert!(ok, "{s:?}");
    trainer.free(Some(&control), b.keys().unwrap()).unwrap();
    trainer.flush_within(Duration::from_secs(10)).unwrap();
    wait_freed(&w, 3);
    let s = w.stats();
    assert_eq!(
        (s.idle_closed, s.refused_connections),
        (3, refused),
        "{s:?}"
    );
    // The bare-lines client's connection, idle longest of all, was never closed: its next line
    // is applied.
    let line = format!("{}\n", serde_json::to_string(&keys(&[bare])).unwrap());
    bare_lines.write_all(line.as_bytes()).unwrap();
    wait_freed(&w, 4);
    drop(others);
    assert_eq!(w.stats().resident_objects, 0);
}

#[test]
fn blank_bad_or_empty_lines_earn_no_slot_that_a_trainer_cannot_take() {
    // A connection that sent a complete line, any line, was never closed to make room (as a
    // client of bare free lines, whose next line would be lost): peers sending one blank line
    // each held every slot for good, and a trainer's frees were refused. Only a line that
    // freed objects earns that now.
    let c = Config {
        max_connections: 3,
        line_timeout: Duration::from_millis(300),
        ..config(1 << 20, Duration::from_secs(1))
    };
    let w = Writer::start(&c).unwrap();
    let control = w.arena_ref().control;
    let a = publish_one(&w, "a", &[10]);
    let peers: Vec<TcpStream> = [&b"\n"[..], b"[]\n", b"not json\n"]
        .iter()
        .map(|line| {
            let mut p = TcpStream::connect(&control).unwrap();
            p.write_all(line).unwrap();
            p
        })
        .collect();
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| {
        s.open_connections == 3 && s.bad_lines == 1
    });
    assert!(ok, "{s:?}");
    let trainer = capture_arena::ControlClient::new(Duration::from_secs(2));
    trainer.free(Some(&control), a.keys().unwrap()).ok();
    trainer.flush_within(Duration::from_secs(10)).unwrap();
    wait_freed(&w, 1);
    let s = w.stats();
    assert!(s.idle_closed >= 1, "{s:?}");
    drop(peers);
}

#[test]
fn unfinished_lines_are_bounded_in_memory_and_nothing_sent_is_lost() {
    // 4 MiB for unfinished lines in all; twelve clients each send 700 KiB of one long line.
    let c = Config {
        control_buffer_bytes: 4 << 20,
        ..config(4 << 20, Duration::from_secs(1))
    };
    let w = Writer::start(&c).unwrap();
    let r = w
        .submit((0..12).map(|i| sample(&format!("s{i}"), &[10])).collect())
        .unwrap()
        .wait()
        .unwrap();
    let ks = keys(&r);
    // Each client's line frees its own key after ~700 KiB of padding (spaces are valid JSON
    // whitespace), so each line is complete only once all of it has been read.
    let lines: Vec<Vec<u8>> = ks
        .iter()
        .map(|k| {
            let mut l = b"[".to_vec();
            l.extend(std::iter::repeat_n(b' ', 700 * 1024));
            l.extend_from_slice(serde_json::to_string(k).unwrap().as_bytes());
            l.extend_from_slice(b"]");
            l
        })
        .collect();
    // Each client writes its whole line (blocking while the server pushes back), then waits
    // for the go before the final newline.
    let go = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = lines
        .into_iter()
        .map(|l| {
            let mut c = TcpStream::connect(&w.arena_ref().control).unwrap();
            let go = go.clone();
            std::thread::spawn(move || {
                c.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
                c.set_nodelay(true).unwrap();
                // Odd-sized pieces, so the server's reads do not land on neat boundaries.
                for piece in l.chunks(9_973) {
                    c.write_all(piece).unwrap();
                }
                while !go.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(5));
                }
                c.write_all(b"\n").unwrap();
                c
            })
        })
        .collect();
    // The pool fills (the connections offer more than it holds); it never exceeds its bound.
    let (s, full) = w.wait_for(Duration::from_secs(10), |s| {
        s.control_buffered_bytes > 2 << 20
    });
    assert!(full, "{s:?}");
    // The pool, plus each connection's small line, plus one maximal line.
    let bound = (4 << 20) + 12 * 4096 + (1 << 20) + 1;
    assert!(
        s.control_buffered_bytes <= bound && s.control_buffered_bytes > 2 << 20,
        "{} bytes buffered",
        s.control_buffered_bytes
    );
    assert_eq!(s.freed_objects, 0);
    // Finishing the lines frees every key: connections that waited for room are read then.
    go.store(true, Ordering::Relaxed);
    let (s, ok) = w.wait_for(Duration::from_secs(20), |s| s.freed_objects == 12);
    assert!(ok, "{s:?}");
    for c in clients {
        drop(c.join().unwrap());
    }
    assert_eq!(
        (s.oversized_lines, s.bad_lines, s.timed_out_lines),
        (0, 0, 0)
    );
}

/// A trainer whose free line is under way when two stalled peers' long lines take the pool
/// (the second, first to run out, may go on to its line's limit); the trainer's next bytes
/// find no room and wait, unread (the server marks it starved). The writer, a published
/// result, the trainer's connection and the stallers'.
fn a_starved_trainer(line_timeout: Duration) -> (Writer, Published, TcpStream, Vec<TcpStream>) {
    let c = Config {
        control_buffer_bytes: 2 << 20,
        line_timeout,
        ..config(1 << 20, Duration::from_secs(1))
    };
    let w = Writer::start(&c).unwrap();
    let r = publish_one(&w, "v", &[10]);
    let control = w.arena_ref().control.clone();
    let spaces = |n: usize| vec![b' '; n];
    let mut trainer = TcpStream::connect(&control).unwrap();
    trainer.write_all(b"[").unwrap();
    trainer.write_all(&spaces(300 << 10)).unwrap();
    let buffered = |at_least: usize| {
        let (s, ok) = w.wait_for(Duration::from_secs(5), |s| {
            s.control_buffered_bytes >= at_least as u64
        });
        assert!(ok, "{s:?}");
    };
    buffered(300 << 10);
    let mut stallers = Vec::new();
    for n in 1..=2 {
        let mut staller = TcpStream::connect(&control).unwrap();
        staller.write_all(b"[").unwrap();
        staller.write_all(&spaces(900 << 10)).unwrap();
        buffered((300 + n * 900) << 10);
        stallers.push(staller);
    }
    trainer.write_all(&spaces(100 << 10)).unwrap(); // no room: waits, unread
    (w, r, trainer, stallers)
}

#[test]
fn a_connection_the_server_stops_reading_is_not_timed_out_for_anothers_stalled_line() {
    // The trainer's line is older than the stallers', but its wait is the server's: only the
    // stallers are closed at the timeout, and the trainer's line then completes.
    let (w, r, mut trainer, stallers) = a_starved_trainer(Duration::from_secs(1));
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.timed_out_lines >= 1);
    assert!(ok, "{s:?}");
    trainer
        .write_all(format!("{}]\n", serde_json::to_string(&keys(&[r])[0]).unwrap()).as_bytes())
        .unwrap();
    wait_freed(&w, 1);
    for mut s in stallers {
        assert!(closed_by_server(&mut s, Duration::from_secs(5)));
    }
    assert_eq!(
        w.stats().timed_out_lines,
        2,
        "only the stallers' lines timed out"
    );
}

#[test]
fn a_peer_that_always_starts_a_new_line_cannot_keep_a_trainers_frees_waiting_for_ever() {
    // A peer P ran out of the pool (1 MiB, most of it held by a stalled line) and got the
    // privilege of finishing its line; it finishes it and starts another. Twenty-four stallers
    // with lines of 1000 KiB use the pool up, and wait, unread; a trainer's control client, freeing
    // 300 objects (lines of about 64 KiB), waits behind them. P completes a line and starts another every 0.8 s, its memory going down and up.
    // Before: P kept the privilege for good (it ended only with nothing unfinished), and each
    // drop of its memory restarted every waiting connection's clock, so no staller was ever
    // timed out and the trainer's frees never went through (found by an outside reading). Now
    // the privilege ends with the line that earned it, and a waiting line's clock restarts only
    // when it is read: waiting connections are closed within twice the timeout of their last
    // read, and the client, reconnecting as it does, gets its frees applied.
    let c = Config {
        control_buffer_bytes: 1 << 20,
        line_timeout: Duration::from_secs(1),
        ..config(4 << 20, Duration::from_secs(1))
    };
    let w = Writer::start(&c).unwrap();
    let id = |i: usize| format!("{i:0>200}");
    let rs = w
        .submit((0..300).map(|i| sample(&id(i), &[10])).collect())
        .unwrap()
        .wait()
        .unwrap();
    let control = w.arena_ref().control.clone();
    let line_of = |n: usize| {
        let mut l = b"[".to_vec();
        l.extend(vec![b' '; n]);
        l
    };
    let buffered = |at_least: usize| {
        let (s, ok) = w.wait_for(Duration::from_secs(5), |s| {
            s.control_buffered_bytes >= at_least as u64
        });
        assert!(ok, "{s:?}");
    };
    let mut held = TcpStream::connect(&control).unwrap();
    held.write_all(&line_of(600 << 10)).unwrap();
    buffered(600 << 10);
    let mut p = TcpStream::connect(&control).unwrap();
    p.write_all(&line_of(900 << 10)).unwrap(); // past the pool: P's privilege
    buffered(1500 << 10);
    p.write_all(b"\n[").unwrap(); // that line done (a bad line), another begun
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.bad_lines >= 1);
    assert!(ok, "{s:?}");
    let stallers: Vec<TcpStream> = (0..24)
        .map(|_| {
            let mut st = TcpStream::connect(&control).unwrap();
            st.set_write_timeout(Some(Duration::from_millis(50)))
                .unwrap();
            let _ = st.write_all(&line_of(1000 << 10)); // what the socket takes
            st
        })
        .collect();
    buffered((1 << 20) + 24 * 4096); // the pool used up
    let stop = Arc::new(AtomicBool::new(false));
    let pacer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut big = true;
            while !stop.load(Ordering::Relaxed) {
                let mut l = b"\n[".to_vec();
                if big {
                    l.extend(vec![b' '; 5 << 10]);
                }
                if p.write_all(&l).is_err() {
                    break;
                }
                big = !big;
                std::thread::sleep(Duration::from_millis(800)); // the peer's pace
            }
        })
    };
    let client = ControlClient::new(Duration::from_secs(5));
    let freed: Vec<Key> = rs.iter().flat_map(|p| p.keys().unwrap()).collect();
    client.free(Some(&control), freed).unwrap();
    let flushed = client.flush_within(Duration::from_secs(20));
    stop.store(true, Ordering::Relaxed);
    pacer.join().unwrap();
    let s = w.stats();
    assert!(
        flushed.is_ok() && s.freed_objects == 300,
        "the trainer's frees did not go through: {flushed:?} {s:?}"
    );
    drop((held, stallers));
}

#[test]
fn a_line_timeout_too_long_to_double_is_a_long_wait_not_a_panic() {
    // A starved connection's limit is twice the line timeout; the scan that looks at them runs
    // every second. SGLANG_SPEC_CAPTURE_CONTROL_LINE_TIMEOUT_S=1e19 is accepted (a wait, as
    // every huge timeout): doubling it panicked the writer thread at the scan, and every later
    // submit failed (WriterStopped). Two scans' time: publication goes on.
    let (w, _r, _trainer, _stallers) = a_starved_trainer(Duration::from_secs(u64::MAX / 2 + 1));
    let t0 = Instant::now();
    let mut i = 0;
    while t0.elapsed() < Duration::from_millis(2500) {
        publish_one(&w, &format!("after-scan-{i}"), &[10]);
        i += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_connection_holding_an_unfinished_line_is_closed_after_the_timeout() {
    let c = Config {
        line_timeout: Duration::from_millis(300),
        ..config(1 << 20, Duration::from_secs(1))
    };
    let w = Writer::start(&c).unwrap();
    let r = w.submit(vec![sample("a", &[10])]).unwrap().wait().unwrap();
    let mut idle = TcpStream::connect(&w.arena_ref().control).unwrap();
    idle.write_all(b"[\"a/b/g1/").unwrap();
    // A connection without an unfinished line stays open however long it idles.
    let mut quiet = TcpStream::connect(&w.arena_ref().control).unwrap();
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.timed_out_lines == 1);
    assert!(ok, "{s:?}");
    assert!(
        closed_by_server(&mut idle, Duration::from_secs(5)),
        "closed"
    );
    std::thread::sleep(Duration::from_millis(400));
    writeln!(quiet, "{}", serde_json::to_string(&keys(&r)).unwrap()).unwrap();
    wait_freed(&w, 1);
    let s = w.stats();
    assert_eq!((s.timed_out_lines, s.open_connections), (1, 1));
}

#[test]
fn the_reply_path_refuses_garbage_and_long_requests() {
    let w = Writer::start(&config(1 << 20, Duration::from_secs(1))).unwrap();
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(
        w.reply_endpoint().trim_start_matches('@').as_bytes(),
    );
    use std::os::linux::net::SocketAddrExt;
    let addr = addr.unwrap();
    for request in [vec![b'x'; 4096], b"\x00\xff garbage\n".to_vec()] {
        let mut s = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
        let _ = s.write_all(&request); // the server may answer and close before all of it
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        assert!(answer.contains("\"ok\":false"), "{answer}");
    }
    let (st, ok) = w.wait_for(Duration::from_secs(5), |s| s.reply_refused == 2);
    assert!(ok, "{st:?}");
    // Publication is unaffected.
    let r = w.submit(vec![sample("a", &[10])]).unwrap().wait_results();
    assert!(matches!(r[0], SampleResult::Published(_)));
}

/// The abstract socket address of a reply endpoint (`@name`), as `connect` and `bind` take it.
fn abstract_addr(endpoint: &str) -> (libc::sockaddr_un, libc::socklen_t) {
    let name = endpoint.strip_prefix('@').unwrap().as_bytes();
    // SAFETY: a zeroed sockaddr_un is a valid value; it is filled within its size below.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    assert!(name.len() < sa.sun_path.len());
    for (slot, &b) in sa.sun_path[1..].iter_mut().zip(name) {
        *slot = b as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len();
    (sa, len as libc::socklen_t)
}

/// True if this test may give a process away to another user (root), false if it is to be
/// skipped; under `CI=true` a test that cannot run fails instead (CI runs as root).
fn may_change_user(what: &str) -> bool {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{what} needs root (to run a process as another user), and CI=true runs as root"
    );
    println!("skipping {what}: running a process as another user needs root");
    false
}

/// Forks a child that becomes user and group 65534 (`nobody`), with no supplementary groups,
/// and ends with `body`'s value as its exit status. The parent has other threads, so the child
/// makes system calls only, by their raw numbers: no allocation, no lock, no panic.
fn as_nobody(body: impl FnOnce() -> i32) -> libc::pid_t {
    // SAFETY: fork is FFI; the child runs only async-signal-safe system calls and `_exit`.
    unsafe {
        let pid = libc::fork();
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            let nobody = 65534 as libc::c_long;
            let none: *const libc::gid_t = std::ptr::null();
            let became = libc::syscall(libc::SYS_setgroups, 0 as libc::c_long, none) == 0
                && libc::syscall(libc::SYS_setresgid, nobody, nobody, nobody) == 0
                && libc::syscall(libc::SYS_setresuid, nobody, nobody, nobody) == 0;
            libc::_exit(if became { body() } else { 99 });
        }
        pid
    }
}

/// The exit status of the child `pid`, waited for at most 20 s (then killed, and a panic).
fn exit_status(pid: libc::pid_t) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut status = 0;
    loop {
        // SAFETY: waitpid on our own child, writing into a local.
        let got = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if got == pid {
            assert!(
                libc::WIFEXITED(status),
                "the child was ended by a signal: {status}"
            );
            return libc::WEXITSTATUS(status);
        }
        if Instant::now() > deadline {
            // SAFETY: kill and reap our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            panic!("the child did not end within 20 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn the_reply_path_answers_only_its_own_user() {
    if !may_change_user("the reply path's user check") {
        return;
    }
    let w = Writer::start(&config(1 << 20, Duration::from_secs(1))).unwrap();
    let (sa, len) = abstract_addr(w.reply_endpoint());
    // Another user asks for the arena's descriptor: 0 if the server closed on it without a
    // byte (an end or a reset), 1 if it answered, 2 if the connect failed, 3 if the read failed
    // otherwise (5 s at most).
    let child = as_nobody(|| {
        // SAFETY: socket calls on a descriptor of the child's own, over a local buffer; the
        // address was made before the fork.
        unsafe {
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            if fd < 0 || libc::connect(fd, (&sa as *const libc::sockaddr_un).cast(), len) != 0 {
                return 2;
            }
            let tv = libc::timeval {
                tv_sec: 5,
                tv_usec: 0,
            };
            let tv_len = std::mem::size_of::<libc::timeval>() as libc::socklen_t;
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                tv_len,
            );
            let request = b"fd\n";
            libc::write(fd, request.as_ptr().cast(), request.len());
            let mut buf = [0u8; 64];
            match libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) {
                0 => 0,
                n if n > 0 => 1,
                // Closed with our request unread: a reset, as good as an end.
                _ if *libc::__errno_location() == libc::ECONNRESET => 0,
                _ => 3,
            }
        }
    });
    assert_eq!(exit_status(child), 0, "closed on without an answer");
    let (st, ok) = w.wait_for(Duration::from_secs(5), |s| s.reply_refused == 1);
    assert!(ok, "{st:?}");
    // Our own user is answered, but not when the caller names another process as the producer.
    let described =
        capture_arena::reply::request(w.reply_endpoint(), "describe", Duration::from_secs(5));
    assert!(described.is_ok(), "{described:?}");
    let e = capture_arena::reply::request_from(
        w.reply_endpoint(),
        "describe",
        Duration::from_secs(5),
        Some(1),
    )
    .unwrap_err();
    assert!(e.to_string().contains("not by the producer (pid 1)"), "{e}");
}

#[test]
fn a_reader_refuses_a_reply_endpoint_another_user_serves() {
    if !may_change_user("the reader's check of the reply path's user") {
        return;
    }
    // Abstract socket names carry no permissions: another user binds a producer's name and
    // answers every request with an empty success.
    let endpoint = format!("@capture-arena-reply-{}-test-nobody", std::process::id());
    let (sa, len) = abstract_addr(&endpoint);
    let child = as_nobody(|| {
        // SAFETY: socket calls on descriptors of the child's own; the address was made before
        // the fork. The child serves until it is killed.
        unsafe {
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            if fd < 0
                || libc::bind(fd, (&sa as *const libc::sockaddr_un).cast(), len) != 0
                || libc::listen(fd, 16) != 0
            {
                return 2;
            }
            let answer = b"{\"ok\":true,\"len\":0,\"fds\":0}\n";
            loop {
                let c = libc::accept(fd, std::ptr::null_mut(), std::ptr::null_mut());
                if c >= 0 {
                    libc::write(c, answer.as_ptr().cast(), answer.len());
                    libc::close(c);
                }
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    // (No assertion here: the child is killed below whatever happens.)
    while !capture_arena::reply::is_listening(&endpoint, None) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let got = capture_arena::reply::request(&endpoint, "fd", Duration::from_secs(5));
    // SAFETY: kill our own child, reaped below.
    unsafe { libc::kill(child, libc::SIGKILL) };
    let mut status = 0;
    // SAFETY: reap our own child, writing into a local.
    unsafe { libc::waitpid(child, &mut status, 0) };
    let e = got.unwrap_err();
    assert!(
        e.to_string().contains("of uid 65534, not by the producer"),
        "{e}"
    );
}

#[test]
fn a_reply_trickled_a_byte_at_a_time_ends_at_the_callers_deadline() {
    // A process of our own user on a reply endpoint (a stuck or hostile producer) that answers
    // a header announcing 100 bytes and then sends one every 100 ms. Before: the timeout held
    // for each read alone, so the request lasted 10 s and succeeded; with 1 MiB announced, a
    // day.
    use std::os::linux::net::SocketAddrExt;
    let endpoint = format!("@capture-arena-reply-{}-test-trickle", std::process::id());
    let addr =
        std::os::unix::net::SocketAddr::from_abstract_name(&endpoint.as_bytes()[1..]).unwrap();
    let listener = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut request = [0u8; 64];
        let _ = s.read(&mut request);
        let _ = s.write_all(b"{\"ok\":true,\"len\":100,\"fds\":0}\n");
        for _ in 0..100 {
            std::thread::sleep(Duration::from_millis(100));
            if s.write_all(b"x").is_err() {
                return; // the reader gave up
            }
        }
    });
    let t0 = Instant::now();
    let got = capture_arena::reply::request(&endpoint, "describe", Duration::from_secs(1));
    let took = t0.elapsed();
    assert!(got.is_err(), "a whole answer after {took:?}");
    assert!(took < Duration::from_millis(1500), "{took:?}: {got:?}");
    server.join().unwrap();
}

#[test]
fn a_connection_streaming_lines_is_never_idle() {
    // Lines complete all the time, but every write ends mid-line: the connection always holds
    // some unfinished line, never the same one for long.
    let c = Config {
        line_timeout: Duration::from_millis(300),
        ..config(1 << 20, Duration::from_secs(1))
    };
    let w = Writer::start(&c).unwrap();
    let mut conn = TcpStream::connect(&w.arena_ref().control).unwrap();
    conn.set_nodelay(true).unwrap();
    let line = b"[\"no/such/g1/key\"]\n".repeat(50);
    let t0 = Instant::now();
    let mut at = 0;
    while t0.elapsed() < Duration::from_millis(1500) {
        // 97 bytes at a time from an endless stream of lines.
        let piece: Vec<u8> = (0..97).map(|i| line[(at + i) % line.len()]).collect();
        at += 97;
        conn.write_all(&piece).unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    let s = w.stats();
    assert_eq!(s.timed_out_lines, 0, "{s:?}");
    assert!(s.unknown_frees > 100, "{s:?}");
}

#[test]
fn a_connect_flood_does_not_stop_publication() {
    let w = Writer::start(&config(1 << 20, Duration::from_secs(1))).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let control = w.arena_ref().control.clone();
    let flood = std::thread::spawn(move || {
        let mut n = 0u64;
        while !s.load(Ordering::Relaxed) {
            if TcpStream::connect(&control).is_ok() {
                n += 1;
            }
        }
        n
    });
    let (s, on) = w.wait_for(Duration::from_secs(5), |s| s.control_connections > 10);
    assert!(on, "the connect flood never reached the writer: {s:?}");
    for i in 0..50 {
        let h = w.submit(vec![sample(&format!("s{i}"), &[1000])]).unwrap();
        let r = h.wait_timeout(Duration::from_secs(5));
        assert!(matches!(r, Some(Ok(_))), "batch {i} under a connect flood");
    }
    stop.store(true, Ordering::Relaxed);
    let n = flood.join().unwrap();
    assert!(n > 100, "{n} connections");
    let (st, ok) = w.wait_for(Duration::from_secs(5), |st| st.open_connections == 0);
    assert!(ok, "{st:?}");
}

/// A FIFO another local user made in `/dev/shm` under an arena's name, removed when dropped.
struct Fifo(std::path::PathBuf);

impl Fifo {
    fn new() -> Fifo {
        let mut nonce = [0u8; 16];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut nonce))
            .unwrap();
        let hex: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
        let name = format!("capture-arena-1-{hex}");
        let path = std::path::Path::new("/dev/shm").join(&name);
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: plain FFI on a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0, "mkfifo");
        Fifo(path)
    }

    fn name(&self) -> String {
        self.0.file_name().unwrap().to_string_lossy().into_owned()
    }
}

impl Drop for Fifo {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Runs `f` on a thread of its own and gives its answer if it comes within `bound`.
fn within<T: Send + 'static>(bound: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(bound).ok()
}

#[test]
fn a_fifo_under_an_arenas_name_stalls_neither_producer_nor_trainer() {
    // `/dev/shm` is writable by every user: opening a FIFO read-only waits for a writer for
    // good, and the sweep before a producer's arena, `is_gone` and a reader's open each
    // opened such a name.
    let fifo = Fifo::new();
    let bound = Duration::from_secs(10);
    let published = within(bound, || {
        let w = Writer::start(&Config {
            control_token: Some("auto".into()),
            ..config(1 << 20, Duration::from_secs(1))
        })
        .unwrap();
        let p = publish_one(&w, "after-the-fifo", &[1000]);
        (w, p)
    });
    let (_w, p) = published.expect("the producer's start (its sweep) waited on the FIFO");
    verify(&p);

    let mut forged = p.clone();
    forged.arena.session = format!("shm://{}?len=1048576&base=0x7f0000000000", fifo.name());
    assert!(
        forged.arena.token.is_some(),
        "release asks is_gone for a token's result"
    );
    let store = Arc::new(capture_arena::client::FeatureStore::new());
    let (s, f) = (store.clone(), forged.clone());
    let read = within(bound, move || s.get(&f, None).map(|_| ()))
        .expect("a reader's open of the FIFO waited for a writer");
    let e = read.expect_err("a FIFO read as an arena");
    assert!(e.to_string().contains("a FIFO"), "{e}");
    let (s, f) = (store.clone(), forged);
    within(bound, move || s.release(&f).unwrap()).expect("release (is_gone) waited on the FIFO");
    within(bound, move || store.health()).expect("health (is_gone) waited on the FIFO");
}

#[test]
fn a_buffer_that_lends_another_slice_later_is_published_as_it_was_handed_over() {
    // Safe code can lend a short slice when first asked and a long one after. What is
    // validated, placed and copied is the slice lent when the tensor was made: before, later
    // answers were asked again, and a copy sized by one answer could read or write by another
    // (the host copy refused it; a device arena's copy had no such check).
    struct Shifty {
        asked: std::cell::Cell<u32>,
        bytes: Vec<u8>,
    }
    impl AsRef<[u8]> for Shifty {
        fn as_ref(&self) -> &[u8] {
            let n = self.asked.get();
            self.asked.set(n + 1);
            if n == 0 {
                &self.bytes[..16]
            } else {
                &self.bytes
            }
        }
    }
    let bytes: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    let data = TensorData::host(Shifty {
        asked: std::cell::Cell::new(0),
        bytes: bytes.clone(),
    });
    let mut s = Sample::new("st", "shifty", 1).unwrap();
    s.push(Tensor::new("t0", vec![16], Dtype::Uint8, data).unwrap())
        .unwrap();
    let w = Writer::start(&config(1 << 22, Duration::from_secs(2))).unwrap();
    let p = w.submit(vec![s]).unwrap().wait().unwrap().remove(0);
    let mut got = [0u8; 16];
    capture_arena::Reader::new()
        .read(&p, "t0", &mut got)
        .unwrap();
    assert_eq!(got, bytes[..16]);
}
