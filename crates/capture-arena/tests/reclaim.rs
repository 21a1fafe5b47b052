//! Reclaiming what a dead trainer held, over real sockets: prefix frees (`{store_id}/`,
//! `{store_id}/{sample_id}/`) free exactly the objects under the prefix, need the token when
//! one is set, and leave plain free lines as they are.

mod util;

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use capture_arena::client::send_frees;
use capture_arena::control::prefix_line;
use capture_arena::{Config, Key, Writer};
use util::*;

#[test]
fn a_prefix_frees_exactly_what_is_under_it() {
    let w = Writer::start(&config(1 << 20, Duration::from_secs(2))).unwrap();
    let rs = w
        .submit(vec![
            sample_in("st", "a", &[100, 10]),
            sample_in("st", "b", &[100]),
            sample_in("st2", "a", &[100]),
        ])
        .unwrap()
        .wait()
        .unwrap();
    let control = w.arena_ref().control.clone();
    let mut c = TcpStream::connect(&control).unwrap();
    // One sample, then a whole store: `st/` does not reach `st2/`.
    writeln!(c, "{}", prefix_line("st/a/")).unwrap();
    wait_freed(&w, 2);
    assert_eq!(w.stats().resident_objects, 2);
    writeln!(c, "{}", prefix_line("st/")).unwrap();
    wait_freed(&w, 3);
    assert_eq!(w.stats().resident_objects, 1);
    verify(&rs[2]);
    // Bad prefixes are bad lines; a prefix that matches nothing is an unknown free; plain
    // lines still work after them.
    for bad in ["st", "st//", "st/a/b/c/", "st/a/g0/", "st/a/gx/", ""] {
        writeln!(c, "{}", prefix_line(bad)).unwrap();
    }
    writeln!(c, "{}", prefix_line("nobody/")).unwrap();
    writeln!(c, "{}", serde_json::to_string(&keys(&rs[2..])).unwrap()).unwrap();
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.freed_objects == 4);
    assert!(ok, "{s:?}");
    assert_eq!((s.bad_lines, s.unknown_frees), (6, 1));
    assert_eq!(s.free_bytes, s.capacity);
}

#[test]
fn send_frees_reclaims_with_the_token_and_refuses_bad_prefixes_before_sending() {
    let w = Writer::start(&Config {
        control_token: Some("auto".into()),
        ..config(1 << 20, Duration::from_secs(2))
    })
    .unwrap();
    let r = w
        .submit(vec![
            sample_in("run", "x", &[64, 64]),
            sample_in("run", "y", &[64]),
        ])
        .unwrap()
        .wait()
        .unwrap();
    let control = w.arena_ref().control.clone();
    let token = r[0].arena.token.clone().unwrap();
    let t = Duration::from_secs(2);
    assert!(send_frees(&control, Some(&token), &[], &["run".into()], t).is_err());
    // Without the token: refused, nothing freed, and the sender is told (not "sent").
    match send_frees(&control, None, &[], &["run/".into()], t) {
        Err(capture_arena::Error::Unauthorized { reason, .. }) => {
            assert!(reason.contains("missing token"), "{reason}")
        }
        other => panic!("a refused free must not be reported sent: {other:?}"),
    }
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.unauthorized_lines == 1);
    assert!(ok && s.resident_objects == 3, "{s:?}");
    // The producer counts the refused peer by address, with the reason.
    let peers = w.unauthorized_peers();
    assert_eq!(peers.len(), 1, "{peers:?}");
    assert_eq!(
        (
            peers[0].peer.as_str(),
            peers[0].connections,
            peers[0].reason.as_str()
        ),
        ("127.0.0.1", 1, "missing token")
    );
    // A wrong token too.
    let wrong = "w".repeat(32);
    assert!(matches!(
        send_frees(&control, Some(&wrong), &[], &["run/".into()], t),
        Err(capture_arena::Error::Unauthorized { ref reason, .. }) if reason.contains("wrong token")
    ));
    let peers = w.unauthorized_peers();
    assert_eq!(
        (peers[0].connections, peers[0].reason.as_str()),
        (2, "wrong token")
    );
    // With it: one key and one prefix.
    let key: Key = "run/y/g1/t0".parse().unwrap();
    send_frees(&control, Some(&token), &[key], &["run/x/".into()], t).unwrap();
    wait_freed(&w, 3);
    let s = w.stats();
    assert_eq!((s.resident_objects, s.free_bytes), (0, s.capacity));
}

#[test]
fn with_a_lease_objects_nobody_frees_are_freed_by_the_writer_and_counted() {
    let w = Writer::start(&Config {
        object_ttl: Some(Duration::from_millis(300)),
        ..config(1 << 20, Duration::from_secs(2))
    })
    .unwrap();
    let t0 = std::time::Instant::now();
    let a = publish_one(&w, "a", &[100, 200]);
    // One object freed in time; the other is left, as by a trainer that died.
    let mut c = TcpStream::connect(&w.arena_ref().control).unwrap();
    writeln!(c, "{}", serde_json::to_string(&["st/a/g1/t0"]).unwrap()).unwrap();
    wait_freed(&w, 1);
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.expired_objects == 1);
    assert!(ok, "{s:?}");
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "not before the lease ends"
    );
    assert_eq!((s.expired_bytes, s.resident_objects), (200, 0));
    assert_eq!(s.free_bytes, s.capacity);
    // A late free of the expired object is an unknown free, nothing more.
    writeln!(c, "{}", serde_json::to_string(&keys(&[a])).unwrap()).unwrap();
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.unknown_frees == 2);
    assert!(ok, "{s:?}");
    // A sample published again under the same key gets its own lease.
    let b = publish_one(&w, "a", &[100]);
    verify(&b);
    let bad =
        Config::from_lookup(|k| (k == "SGLANG_SPEC_CAPTURE_OBJECT_TTL_S").then(|| "0".to_owned()));
    assert!(bad
        .unwrap_err()
        .to_string()
        .contains("SGLANG_SPEC_CAPTURE_OBJECT_TTL_S"));
}

#[test]
fn the_writer_says_which_store_holds_the_arena_and_since_when() {
    let w = Writer::start(&config(1 << 20, Duration::from_secs(2))).unwrap();
    assert_eq!(w.store_usage().unwrap(), vec![]);
    w.submit(vec![
        sample_in("big", "a", &[1000, 1000]),
        sample_in("small", "a", &[10]),
    ])
    .unwrap()
    .wait()
    .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    w.submit(vec![sample_in("big", "b", &[500])])
        .unwrap()
        .wait()
        .unwrap();
    let u = w.store_usage().unwrap();
    assert_eq!(u.len(), 2);
    assert_eq!(
        (u[0].store_id.as_str(), u[0].objects, u[0].bytes),
        ("big", 3, 2500)
    );
    assert_eq!(
        (u[1].store_id.as_str(), u[1].objects, u[1].bytes),
        ("small", 1, 10)
    );
    assert!(
        u[0].oldest_age_s >= 0.05,
        "the oldest of the store counts: {u:?}"
    );
    let mut c = TcpStream::connect(&w.arena_ref().control).unwrap();
    writeln!(c, "{}", prefix_line("big/")).unwrap();
    wait_freed(&w, 3);
    let u = w.store_usage().unwrap();
    assert_eq!(
        u.iter().map(|s| s.store_id.as_str()).collect::<Vec<_>>(),
        ["small"]
    );
}

#[test]
fn a_timeout_too_long_to_add_to_now_is_a_long_wait_not_a_panic() {
    // `_send_frees(timeout_s=1e19)` from Python: `Instant::now() + timeout` overflowed and
    // panicked (a PanicException, which `except Exception` does not catch).
    let w = Writer::start(&config(1 << 20, Duration::from_secs(2))).unwrap();
    let r = publish_one(&w, "x", &[64]);
    let key: Key = keys(&[r])[0].parse().unwrap();
    let control = w.arena_ref().control.clone();
    send_frees(&control, None, &[key], &[], Duration::from_secs_f64(1e19)).unwrap();
    wait_freed(&w, 1);
}
