//! The control token over real loopback sockets: without it (or with a wrong one) nothing a
//! connection sends is applied and the connection is closed; with it frees work; results carry it
//! so a trainer's store presents it by itself; a server without a token treats a token line as one
//! bad line.

mod util;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use capture_arena::client::FeatureStore;
use capture_arena::control::{token_line, tokens_equal};
use capture_arena::{Config, Writer};
use util::*;

const TOKEN: &str = "s3cret-token-0123456789abcdef";

fn writer(token: Option<&str>) -> Writer {
    Writer::start(&Config {
        control_token: token.map(str::to_owned),
        ..config(1 << 20, Duration::from_secs(2))
    })
    .unwrap()
}

/// A writer with the token whose connections must finish a line within 300 ms.
fn writer_timing_lines() -> Writer {
    Writer::start(&Config {
        control_token: Some(TOKEN.into()),
        line_timeout: Duration::from_millis(300),
        ..config(1 << 20, Duration::from_secs(2))
    })
    .unwrap()
}

/// Sends `text` on a new connection and reports whether the server closed it within 2 s, having
/// told it why (`{"error": "unauthorized", ...}`) unless its kernel reset the connection first.
fn send(control: &str, text: &str) -> bool {
    let mut c = TcpStream::connect(control).unwrap();
    c.write_all(text.as_bytes()).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut got = Vec::new();
    let mut b = [0u8; 256];
    loop {
        match c.read(&mut b) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&b[..n]),
            // Closed with unread input, the server's kernel resets the connection.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            // Still open after 2 s (a timeout), or another error: not what the server does.
            Err(_) => return false,
        }
    }
    got.is_empty()
        || matches!(
            capture_arena::control::parse_answer(got.strip_suffix(b"\n").unwrap_or(&got)),
            Some(capture_arena::control::Answer::Unauthorized(_))
        )
}

fn wait_stats(
    w: &Writer,
    pred: impl FnMut(&capture_arena::StatsSnapshot) -> bool,
) -> capture_arena::StatsSnapshot {
    let (s, ok) = w.wait_for(Duration::from_secs(5), pred);
    assert!(ok, "{s:?}");
    s
}

#[test]
fn frees_without_the_token_or_with_a_wrong_one_are_refused_and_close_the_connection() {
    let w = writer(Some(TOKEN));
    let r = publish_one(&w, "a", &[100]);
    assert_eq!(r.arena.token.as_deref(), Some(TOKEN));
    let control = w.arena_ref().control.clone();
    let keys = serde_json::to_string(&keys(std::slice::from_ref(&r))).unwrap();
    // No token: the free line is refused and the connection closed.
    assert!(send(&control, &format!("{keys}\n")), "closed");
    // A wrong token of the right length, then the frees.
    let wrong = format!("{}X", &TOKEN[..TOKEN.len() - 1]);
    assert!(send(&control, &format!("{}\n{keys}\n", token_line(&wrong))));
    // A frees line first, the right token after it: still refused (the token comes first).
    assert!(send(&control, &format!("{keys}\n{}\n", token_line(TOKEN))));
    let s = wait_stats(&w, |s| s.unauthorized_lines >= 3);
    assert_eq!(s.freed_objects, 0);
    assert_eq!(s.resident_objects, 1);
    verify(&r); // the sample is intact
                // Blank lines before the token are fine; then the frees apply.
    let mut c = TcpStream::connect(&control).unwrap();
    write!(c, "\n{}\n{keys}\n", token_line(TOKEN)).unwrap();
    wait_freed(&w, 1);
    assert_eq!(w.stats().unauthorized_lines, 3);
}

#[test]
fn results_carry_the_token_and_a_trainer_frees_with_it_unaided() {
    let w = writer(Some("auto"));
    let r = publish_one(&w, "a", &[4096, 3]);
    let token = r.arena.token.clone().expect("results carry the token");
    assert!(
        !format!("{r:?}").contains(&token),
        "Debug redacts the token"
    );
    assert_eq!(token.len(), 32, "auto: 128 random bits as hex");
    // The result as a trainer gets it (JSON) round-trips with its token.
    let json = serde_json::to_string(&r).unwrap();
    assert!(json.contains(&format!("\"token\":\"{token}\"")));
    let store = FeatureStore::new();
    let got = store.get(&r, None).unwrap();
    assert_eq!(got["t0"].data.len(), 4096);
    store.release(&r).unwrap();
    wait_freed(&w, 2);
    assert_eq!(w.stats().unauthorized_lines, 0);
    // Another arena draws another token.
    let other = writer(Some("auto"));
    assert_ne!(other.arena_ref().token, w.arena_ref().token);
}

#[test]
fn without_a_token_a_token_line_is_one_bad_line_and_frees_go_on() {
    let w = writer(None);
    let r = publish_one(&w, "a", &[10]);
    assert_eq!(r.arena.token, None);
    assert!(!serde_json::to_string(&r).unwrap().contains("token"));
    let keys = serde_json::to_string(&keys(std::slice::from_ref(&r))).unwrap();
    let mut c = TcpStream::connect(&w.arena_ref().control).unwrap();
    write!(c, "{}\n{keys}\n", token_line(TOKEN)).unwrap();
    let s = wait_stats(&w, |s| s.freed_objects == 1);
    assert_eq!((s.bad_lines, s.unauthorized_lines), (1, 0));
}

#[test]
fn bad_tokens_are_refused_by_the_configuration() {
    for bad in [
        "short",
        "has space in it 0123456789",
        "quote\"0123456789abcdef",
        &"x".repeat(257),
    ] {
        let c = Config {
            control_token: Some(bad.to_owned()),
            ..config(1 << 20, Duration::from_secs(1))
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("SGLANG_SPEC_CAPTURE_CONTROL_TOKEN"), "{e}");
    }
    let c = Config::from_lookup(|k| {
        (k == "SGLANG_SPEC_CAPTURE_CONTROL_TOKEN").then(|| "auto".to_owned())
    })
    .unwrap();
    assert_eq!(c.control_token.as_deref(), Some("auto"));
    let secret = Config {
        control_token: Some(TOKEN.into()),
        ..Config::default()
    };
    assert!(
        !format!("{secret:?}").contains(TOKEN),
        "Debug redacts the token"
    );
}

#[test]
fn token_comparison_is_exact() {
    // The comparison reads every byte whatever the first difference (by construction: one
    // OR-fold over all bytes); timing is not measured in tests on this shared machine.
    let a = TOKEN.as_bytes();
    let mut first = a.to_vec();
    first[0] ^= 1;
    let mut last = a.to_vec();
    *last.last_mut().unwrap() ^= 1;
    assert!(tokens_equal(a, a));
    assert!(!tokens_equal(a, &first) && !tokens_equal(a, &last) && !tokens_equal(a, &a[1..]));
}

#[test]
fn before_the_token_a_connection_may_neither_idle_nor_send_a_long_line() {
    let w = writer_timing_lines();
    let control = w.arena_ref().control.clone();
    // Silent: closed after the line timeout (it would otherwise hold a connection slot).
    let mut idle = TcpStream::connect(&control).unwrap();
    assert!(closed_by_server(&mut idle, Duration::from_secs(5)));
    assert!(w.stats().timed_out_lines >= 1);
    // A long line before the token: refused at 512 bytes.
    assert!(send(&control, &"x".repeat(600)));
    let s = wait_stats(&w, |s| s.unauthorized_lines == 1);
    assert_eq!(s.bad_lines, 0);
    // A connection that presented the token is not timed out while idle.
    let mut ok = TcpStream::connect(&control).unwrap();
    writeln!(ok, "{}", token_line(TOKEN)).unwrap();
    std::thread::sleep(Duration::from_millis(800));
    let r = publish_one(&w, "late", &[8]);
    writeln!(ok, "{}", serde_json::to_string(&keys(&[r])).unwrap()).unwrap();
    wait_freed(&w, 1);
}

#[test]
fn blank_lines_before_the_token_do_not_put_off_its_deadline() {
    // Blank lines are allowed before the token, and each one completed a line, which restarted
    // the connection's clock: one every 100 ms kept it open for good without the token, and
    // 1024 such connections would hold every place (trainers refused, no frees, a full arena).
    let w = writer_timing_lines();
    let mut c = TcpStream::connect(&w.arena_ref().control).unwrap();
    let mut blank = c.try_clone().unwrap();
    let t0 = std::time::Instant::now();
    let writer = std::thread::spawn(move || {
        while blank.write_all(b"\n").is_ok() && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    assert!(
        closed_by_server(&mut c, Duration::from_secs(5)),
        "still open after 5 s of blank lines"
    );
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_millis(1500),
        "{took:?}"
    );
    wait_stats(&w, |s| s.timed_out_lines == 1 && s.open_connections == 0);
    writer.join().unwrap();
}

#[test]
fn a_token_and_a_long_line_in_one_write_are_not_starved_by_the_tokens_cap() {
    // Before the token a turn reads at most 513 bytes. A token and a free line of 1 KiB in one
    // write filled that cap within the turn that authorized the connection, which then waited
    // for pool memory it did not need (its own small line holds it) behind connections holding
    // the pool, until their lines timed out (3 s here).
    let w = Writer::start(&Config {
        control_token: Some(TOKEN.into()),
        line_timeout: Duration::from_secs(3),
        control_buffer_bytes: 1 << 20,
        ..config(1 << 20, Duration::from_secs(2))
    })
    .unwrap();
    let control = w.arena_ref().control.clone();
    let r = publish_one(&w, "a", &[100, 50]);
    // Two connections hold the pool with unfinished lines; the second ran out of it, so it is
    // the one that may finish its line.
    let mut holders = Vec::new();
    for bytes in [1_000_000usize, 100_000] {
        let mut c = TcpStream::connect(&control).unwrap();
        // Authorized first (the sync's answer says so), then the unfinished line.
        c.write_all(format!("{}\n{{\"sync\": 1}}\n", token_line(TOKEN)).as_bytes())
            .unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut answer = [0u8; 64];
        let n = c.read(&mut answer).unwrap();
        assert!(
            answer[..n].starts_with(b"{\"synced\""),
            "{:?}",
            &answer[..n]
        );
        c.write_all(b"[\"").unwrap();
        c.write_all(&vec![b'x'; bytes]).unwrap();
        holders.push(c);
    }
    wait_stats(&w, |s| s.control_buffered_bytes >= 1_100_000);
    let keys: Vec<String> = r
        .keys()
        .unwrap()
        .iter()
        .map(|k| k.as_str().to_owned())
        .collect();
    let line = serde_json::json!([keys[0], keys[1], "p".repeat(1000)]).to_string();
    let mut c = TcpStream::connect(&control).unwrap();
    c.write_all(format!("{}\n{line}\n", token_line(TOKEN)).as_bytes())
        .unwrap();
    let (s, ok) = w.wait_for(Duration::from_secs(1), |s| s.freed_objects == 2);
    assert!(
        ok,
        "the frees waited over 1 s behind the pool's holders: {s:?}"
    );
    assert_eq!(s.timed_out_lines, 0, "{s:?}");
    drop(holders);
}

#[test]
fn a_control_client_without_the_token_reports_its_frees_refused_not_sent_and_a_token_gets_them_through(
) {
    use capture_arena::{ControlClient, Key};
    let w = writer(Some(TOKEN));
    let r = publish_one(&w, "a", &[100, 50]);
    let control = w.arena_ref().control.clone();
    let client = ControlClient::new(Duration::from_secs(2));
    let ks: Vec<Key> = r.keys().unwrap();
    client.free(Some(&control), ks.clone()).ok();
    // Refused by the producer: not delivered, so still pending, counted as refused, and a
    // flush says so (not a timeout, not success).
    let err = client.flush_within(Duration::from_secs(3)).unwrap_err();
    assert!(
        matches!(err, capture_arena::Error::Unauthorized { ref reason, pending: 2, .. } if reason.contains("missing token")),
        "{err}"
    );
    assert_eq!((client.pending(), client.refused()), (2, 2));
    let s = w.stats();
    assert_eq!((s.freed_objects, s.resident_objects), (0, 2));
    assert_eq!(w.unauthorized_peers()[0].reason, "missing token");
    // With the token (a later result carries it), the same keys go through and are confirmed.
    client.set_token(&control, Some(TOKEN));
    client.flush_within(Duration::from_secs(40)).unwrap();
    assert_eq!((client.pending(), client.refused()), (0, 0));
    wait_freed(&w, 2);
    assert_eq!(w.stats().free_bytes, w.stats().capacity);
}

#[test]
fn a_free_counts_as_pending_until_the_server_confirms_it() {
    use capture_arena::ControlClient;
    use std::io::BufRead;
    // A server that takes the lines and never answers (a producer without the confirmation,
    // or one that is stuck): the frees are written, but not delivered as far as anyone knows.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = l.local_addr().unwrap().to_string();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (c, _) = l.accept().unwrap();
        let mut answer = c.try_clone().unwrap();
        for line in std::io::BufReader::new(c).lines() {
            let Ok(line) = line else { break };
            if line == r#"{"sync": 0}"# {
                // The connection's first sync is answered (it opens every connection)...
                answer.write_all(b"{\"synced\":0}\n").unwrap();
            }
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let client = ControlClient::new(Duration::from_millis(500));
    client
        .free(Some(&endpoint), vec!["st/a/g1/x".parse().unwrap()])
        .ok();
    assert_eq!(rx.recv().unwrap(), r#"{"sync": 0}"#);
    // ... the one after the keys never is.
    assert_eq!(rx.recv().unwrap(), r#"["st/a/g1/x"]"#);
    assert_eq!(
        rx.recv().unwrap(),
        r#"{"sync": 1}"#,
        "the lines are followed by a sync"
    );
    let err = client.flush_within(Duration::from_millis(300)).unwrap_err();
    assert!(
        matches!(err, capture_arena::Error::FreeNotSent { .. }),
        "{err}"
    );
    assert_eq!(client.pending(), 1, "written is not delivered");
}

/// Accepts connections on a port of its own and passes their bytes to `upstream` both ways; the
/// first connection's bytes wait for `go`. Says on the returned channel when it accepted that
/// first connection.
fn held_relay(
    upstream: String,
    go: std::sync::mpsc::Receiver<()>,
) -> (String, std::sync::mpsc::Receiver<()>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let (accepted, first) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut go = Some(go);
        for c in l.incoming() {
            let Ok(down) = c else { break };
            let hold = go.take();
            if hold.is_some() {
                accepted.send(()).ok();
            }
            let upstream = upstream.clone();
            std::thread::spawn(move || {
                if let Some(go) = hold {
                    go.recv().ok();
                }
                let up = TcpStream::connect(&upstream).unwrap();
                let pipe = |mut from: TcpStream, mut to: TcpStream| {
                    std::thread::spawn(move || {
                        std::io::copy(&mut from, &mut to).ok();
                        to.shutdown(std::net::Shutdown::Write).ok();
                    })
                };
                pipe(down.try_clone().unwrap(), up.try_clone().unwrap());
                pipe(up, down);
            });
        }
    });
    (addr, first)
}

#[test]
fn an_old_results_token_does_not_cost_the_frees_of_the_producer_there_now() {
    // The producer at the endpoint now has TOKEN; an older result carries its predecessor's
    // token (a producer restarted on the same port; here another live writer, so its session
    // cannot be proved gone). Its release sets the endpoint's token to the old one while keys of
    // the producer there now still wait: they must go with their own result's token, not be
    // dropped as another producer's.
    let now = writer(Some(TOKEN));
    let before = writer(Some("auto"));
    let (go, hold) = std::sync::mpsc::channel();
    let (relay, accepted) = held_relay(now.arena_ref().control.clone(), hold);
    let via_relay = |mut r: capture_arena::Published| {
        r.arena.control = relay.clone();
        r
    };
    let first = via_relay(publish_one(&now, "a", &[100]));
    let current = via_relay(publish_one(&now, "b", &[100, 200]));
    let old = via_relay(publish_one(&before, "c", &[100]));
    let store = FeatureStore::new();
    store.release(&first).unwrap();
    // The sender's connection for `first` waits in the relay; meanwhile `current` and then the
    // old result are released.
    accepted.recv().unwrap();
    store.release(&current).unwrap();
    store.release(&old).unwrap();
    go.send(()).unwrap();
    store.flush_within(Duration::from_secs(10)).unwrap();
    let s = wait_stats(&now, |s| s.freed_objects >= 3);
    assert_eq!(
        (s.freed_objects, s.resident_objects),
        (3, 0),
        "every object of the producer there now is freed"
    );
    // The old result's keys are dropped (its producer is not the one there), once.
    assert_eq!(store.health().dropped_frees, 1);
    assert_eq!(before.stats().resident_objects, 1);
    // The old token, refused once, is not taken up again by another old result.
    let unauthorized = now.stats().unauthorized_lines;
    let older = via_relay(publish_one(&before, "d", &[100]));
    store.release(&older).unwrap();
    let later = via_relay(publish_one(&now, "e", &[100]));
    store.release(&later).unwrap();
    store.flush_within(Duration::from_secs(10)).unwrap();
    wait_stats(&now, |s| s.freed_objects == 4);
    assert_eq!(now.stats().unauthorized_lines, unauthorized);
}

#[test]
fn a_token_given_again_by_hand_is_tried_at_once_even_after_it_was_refused() {
    use capture_arena::ControlClient;
    // An operator's client frees by key with the token of a producer that is not up yet (the
    // one on the port has another): refused, again and again, its back-off growing. Once that
    // producer is up, giving the token again sends them at once, not after the back-off.
    const LATER: &str = "token-of-the-next-producer-0123";
    let now = writer(Some(TOKEN));
    let port = control_port(&now);
    let control = now.arena_ref().control.clone();
    let client = ControlClient::new(Duration::from_secs(2));
    client.set_token(&control, Some(LATER));
    client
        .free(Some(&control), vec!["st/a/g1/t0".parse().unwrap()])
        .ok();
    // Refused six times (0.1 + 0.2 + ... + 1.6 s apart): the next try is 3.2 s away.
    let (s, ok) = now.wait_for(Duration::from_secs(20), |s| s.unauthorized_lines >= 6);
    assert!(ok, "{s:?}");
    drop(now);
    let next = Writer::start(&capture_arena::Config {
        control_token: Some(LATER.into()),
        control_port: port,
        ..config(1 << 20, Duration::from_secs(2))
    })
    .unwrap();
    let r = publish_one(&next, "a", &[10]);
    assert_eq!(keys(std::slice::from_ref(&r)), ["st/a/g1/t0"]);
    let t0 = std::time::Instant::now();
    client.set_token(&control, Some(LATER));
    wait_freed(&next, 1);
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "applied {:?} after the token was given again",
        t0.elapsed()
    );
}

#[test]
fn peers_without_the_token_cannot_keep_a_trainer_out_however_fast_they_connect() {
    // Before: with every slot held by connections that had not presented the token, a new one
    // was closed at once until one of them timed out (the line timeout, 30 s here), so a peer
    // connecting faster than that kept every trainer out. Now the oldest of them makes way.
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use capture_arena::ControlClient;
    let w = Writer::start(&Config {
        control_token: Some(TOKEN.into()),
        max_connections: 8,
        line_timeout: Duration::from_secs(30),
        ..config(1 << 20, Duration::from_secs(2))
    })
    .unwrap();
    let r = publish_one(&w, "a", &[100, 50]);
    let control = w.arena_ref().control.clone();
    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let (stop, control) = (stop.clone(), control.clone());
        // Connects as fast as it can and holds every connection the server keeps open.
        std::thread::spawn(move || {
            let mut held: Vec<TcpStream> = Vec::new();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if let Ok(c) = TcpStream::connect(&control) {
                    c.set_nonblocking(true).unwrap();
                    held.push(c);
                    n += 1;
                }
                let mut b = [0u8; 1];
                held.retain(|c| {
                    matches!(c.peek(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
                });
            }
            n
        })
    };
    wait_stats(&w, |s| {
        s.open_connections == 8 && s.control_connections + s.refused_connections > 20
    });
    let client = ControlClient::new(Duration::from_secs(2));
    client.set_token(&control, Some(TOKEN));
    client.free(Some(&control), r.keys().unwrap()).ok();
    let flushed = client.flush_within(Duration::from_secs(10));
    stop.store(true, Ordering::Relaxed);
    let n = flood.join().unwrap();
    flushed.unwrap();
    wait_freed(&w, 2);
    let s = w.stats();
    assert!(
        s.idle_closed > 0 && s.timed_out_lines == 0,
        "{n} connects: {s:?}"
    );
}
