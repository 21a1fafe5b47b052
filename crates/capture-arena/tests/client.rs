//! The trainer side against a real writer: reads, views, validation, stale sessions, frees.

mod util;

use std::time::Duration;

use capture_arena::client::{ControlClient, Reader, Store};
use capture_arena::{Config, Error, Writer};
use util::*;

fn writer() -> Writer {
    Writer::start(&config(1 << 20, Duration::from_secs(2))).unwrap()
}

#[test]
fn read_view_and_get_return_the_published_bytes() {
    let w = writer();
    let r = &w
        .submit(vec![sample("a", &[5000, 17])])
        .unwrap()
        .wait()
        .unwrap()[0];
    let reader = Reader::new();
    let mut out = vec![0u8; 5000];
    reader.read(r, "t0", &mut out).unwrap();
    assert!(out
        .iter()
        .enumerate()
        .all(|(j, b)| *b == pattern("a", "t0", j)));
    let v = reader.view(r, "t1").unwrap();
    assert_eq!(v.len(), 17);
    assert!(v
        .iter()
        .enumerate()
        .all(|(j, b)| *b == pattern("a", "t1", j)));
    let store = Store::new();
    let got = store.get(r, None).unwrap();
    assert_eq!(got["t0"].data, out);
    assert_eq!(got["t1"].shape, [17]);
    assert_eq!(store.health().resident_samples, 1);
    assert_eq!(store.health().resident_bytes, 5017);
}

#[test]
fn bad_addresses_and_lengths_are_refused_before_touching_memory() {
    let w = writer();
    let good = w
        .submit(vec![sample("a", &[100])])
        .unwrap()
        .wait()
        .unwrap()
        .remove(0);
    let reader = Reader::new();
    let mut out = vec![0u8; 99];
    let e = reader.read(&good, "t0", &mut out).unwrap_err();
    assert!(
        e.to_string()
            .contains("buffer holds 99 bytes but shape [100] of uint8 is 100 bytes"),
        "{e}"
    );
    let e = reader.read(&good, "nope", &mut out).unwrap_err();
    assert!(
        e.to_string()
            .contains("no feature st/a/g1/nope: the result has t0"),
        "{e}"
    );
    let mut forged = good.clone();
    forged.features.get_mut("t0").unwrap().address = good.features["t0"].address + (1 << 20);
    let e = reader.read(&forged, "t0", &mut [0u8; 100]).unwrap_err();
    assert!(matches!(e, Error::OutOfRange { len: 100, .. }), "{e}");
    forged.features.get_mut("t0").unwrap().address = 12;
    assert!(matches!(
        reader.view(&forged, "t0").unwrap_err(),
        Error::OutOfRange { .. }
    ));
    // A shape that claims more bytes than the arena holds past the address.
    let mut big = good.clone();
    big.features.get_mut("t0").unwrap().shape = vec![1 << 21];
    assert!(matches!(
        reader.view(&big, "t0").unwrap_err(),
        Error::OutOfRange { .. }
    ));
    big.features.get_mut("t0").unwrap().shape = vec![u64::MAX, 4];
    assert!(reader
        .view(&big, "t0")
        .unwrap_err()
        .to_string()
        .contains("overflows"));
    let mut odd = good.clone();
    odd.arena.session = "nixl://somewhere".into();
    assert!(matches!(
        Reader::new().view(&odd, "t0").unwrap_err(),
        Error::InvalidSession { .. }
    ));
}

#[test]
fn a_restarted_producer_gives_a_stale_session_error() {
    let old = {
        let w = writer();
        w.submit(vec![sample("a", &[100])])
            .unwrap()
            .wait()
            .unwrap()
            .remove(0)
    };
    let _new = writer();
    let e = Reader::new().view(&old, "t0").unwrap_err();
    assert!(matches!(e, Error::StaleSession { .. }), "{e}");
    assert!(e.to_string().contains("exited or restarted"), "{e}");
}

#[test]
fn a_cached_session_turns_stale_when_its_producer_goes() {
    let reader = Reader::new();
    let w = writer();
    let r = w
        .submit(vec![sample("a", &[100])])
        .unwrap()
        .wait()
        .unwrap()
        .remove(0);
    reader.read(&r, "t0", &mut [0u8; 100]).unwrap(); // mapped and cached
    drop(w);
    let e = reader.read(&r, "t0", &mut [0u8; 100]).unwrap_err();
    assert!(matches!(e, Error::StaleSession { .. }), "{e}");
    // A result whose shape claims more than the arena holds is refused before allocating.
    let w = writer();
    let mut r = w
        .submit(vec![sample("b", &[100])])
        .unwrap()
        .wait()
        .unwrap()
        .remove(0);
    r.features.get_mut("t0").unwrap().shape = vec![1 << 40];
    let e = Store::new().get(&r, None).unwrap_err();
    assert!(matches!(e, Error::OutOfRange { .. }), "{e}");
}

#[test]
fn get_after_release_fails_and_release_frees_everything() {
    let w = writer();
    let rs = w
        .submit(vec![sample("a", &[100, 200]), sample("b", &[300])])
        .unwrap()
        .wait()
        .unwrap();
    let store = Store::new();
    for r in &rs {
        store.get(r, None).unwrap();
        store.release(r).unwrap();
        let e = store.get(r, None).unwrap_err();
        assert!(e.to_string().contains("already released"), "{e}");
        assert!(store.get_into(r, "t0", &mut [0u8; 100]).is_err());
    }
    wait_freed(&w, 3);
    let s = w.stats();
    assert_eq!(
        (s.resident_objects, s.free_bytes, s.unknown_frees),
        (0, s.capacity, 0)
    );
    assert_eq!(store.health(), Default::default());
    // Control connections are persistent: one for all three releases.
    assert_eq!(s.control_connections, 1);
}

#[test]
fn frees_reconnect_after_the_endpoint_drops_the_connection() {
    let store = Store::new();
    let first = writer();
    let port: u16 = first
        .arena_ref()
        .control
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let r1 = first
        .submit(vec![sample("a", &[10])])
        .unwrap()
        .wait()
        .unwrap()
        .remove(0);
    store.release(&r1).unwrap();
    wait_freed(&first, 1);
    // The producer restarts on the same control port: the old connection is dead.
    drop(first);
    let c = Config {
        control_port: port,
        ..config(1 << 20, Duration::from_secs(2))
    };
    let second = Writer::start(&c).unwrap();
    let r2 = second
        .submit(vec![sample("b", &[10])])
        .unwrap()
        .wait()
        .unwrap()
        .remove(0);
    store.release(&r2).unwrap();
    wait_freed(&second, 1);
    assert_eq!(store.health().pending_frees, 0);
}

#[test]
fn unsent_frees_stay_pending_and_unknown_endpoints_get_every_key() {
    // An endpoint that cannot be reached now (here: its name does not resolve) keeps its keys.
    let c = ControlClient::new(Duration::from_secs(1));
    let e = c
        .free(Some("no-such-host.invalid:9"), ["x/y/g1/z"])
        .unwrap_err();
    assert!(matches!(e, Error::FreeNotSent { pending: 1, .. }), "{e}");
    assert_eq!(c.pending(), 1);
    assert!(c.flush().is_err(), "still unreachable");
    assert_eq!(c.pending(), 1, "kept for the next try");

    // An endpoint that refuses connections has no producer any more: its frees are dropped,
    // and they do not make frees to other endpoints fail.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let c = ControlClient::new(Duration::from_secs(1));
    c.free(Some(&dead), ["x/y/g1/z"]).unwrap();
    assert_eq!(c.pending(), 0);

    // Keys freed before any endpoint is known go to the first one learned.
    let w = writer();
    let r = w
        .submit(vec![sample("early", &[10])])
        .unwrap()
        .wait()
        .unwrap();
    let c = ControlClient::default();
    c.free(None, keys(&r)).unwrap();
    assert_eq!(c.pending(), 1);
    c.learn(&w.arena_ref().control);
    c.flush().unwrap();
    wait_freed(&w, 1);

    let (a, b) = (writer(), writer());
    let ra = a.submit(vec![sample("a", &[10])]).unwrap().wait().unwrap();
    let rb = b.submit(vec![sample("b", &[10])]).unwrap().wait().unwrap();
    let c = ControlClient::default();
    c.learn(&a.arena_ref().control);
    c.learn(&b.arena_ref().control);
    let mut ks = keys(&ra);
    ks.extend(keys(&rb));
    c.free(None, ks).unwrap();
    for w in [&a, &b] {
        wait_freed(w, 1);
        let (s, ok) = w.wait_for(Duration::from_secs(10), |s| s.unknown_frees == 1);
        assert!(ok, "{s:?}");
        assert_eq!(s.resident_objects, 0);
    }
}
