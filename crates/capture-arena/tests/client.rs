//! The trainer side against a real writer: reads, views, validation, stale sessions, frees,
//! producers that go away, endpoints that cannot be reached.

mod util;

use std::time::{Duration, Instant};

use capture_arena::client::{ControlClient, FeatureStore, Reader};
use capture_arena::{Config, Error, Key, Published, Writer};
use util::*;

fn key(s: &str) -> Key {
    s.parse().unwrap()
}

fn keyed(v: Vec<String>) -> Vec<Key> {
    v.iter().map(|s| key(s)).collect()
}

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
    // SAFETY: nothing frees or replaces the sample while the view lives.
    let v = unsafe { reader.view(r, "t1") }.unwrap();
    assert_eq!(v.len(), 17);
    assert!(v
        .iter()
        .enumerate()
        .all(|(j, b)| *b == pattern("a", "t1", j)));
    let store = FeatureStore::new();
    let got = store.get(r, None).unwrap();
    assert_eq!(got["t0"].data, out);
    assert_eq!(got["t1"].shape, [17]);
    assert_eq!(store.health().resident_samples, 1);
    assert_eq!(store.health().resident_bytes, 5017);
}

#[test]
fn bad_addresses_and_lengths_are_refused_before_touching_memory() {
    let w = writer();
    let good = publish_one(&w, "a", &[100]);
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
        reader.checked_len(&forged, "t0").unwrap_err(),
        Error::OutOfRange { .. }
    ));
    // A shape that claims more bytes than the arena holds past the address.
    let mut big = good.clone();
    big.features.get_mut("t0").unwrap().shape = vec![1 << 21];
    assert!(matches!(
        reader.checked_len(&big, "t0").unwrap_err(),
        Error::OutOfRange { .. }
    ));
    big.features.get_mut("t0").unwrap().shape = vec![u64::MAX, 4];
    assert!(reader
        .checked_len(&big, "t0")
        .unwrap_err()
        .to_string()
        .contains("overflows"));
    // A length within 8 bytes of 2^64: refused as no tensor numpy or torch can describe, before
    // its stamp's place (past the end of the address space) is computed (before: an overflow, a
    // panic in debug builds, where the bindings' tests run).
    assert!(good.features["t0"].stamp.is_some());
    big.features.get_mut("t0").unwrap().shape = vec![u64::MAX];
    let e = big.validate().unwrap_err();
    assert!(e.to_string().contains("overflows"), "{e}");
    assert!(reader.checked_len(&big, "t0").is_err());
    let mut odd = good.clone();
    odd.arena.session = "nixl://somewhere".into();
    assert!(matches!(
        Reader::new().checked_len(&odd, "t0").unwrap_err(),
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
    let e = Reader::new().checked_len(&old, "t0").unwrap_err();
    assert!(matches!(e, Error::StaleSession { .. }), "{e}");
    assert!(e.to_string().contains("exited or restarted"), "{e}");
}

#[test]
fn samples_of_a_producer_that_is_gone_no_longer_count_as_resident() {
    let store = FeatureStore::new();
    let w = writer();
    let r = publish_one(&w, "a", &[100]);
    store.get(&r, None).unwrap();
    assert_eq!(store.health().resident_samples, 1);
    drop(w);
    assert_eq!(store.health().resident_samples, 0);
}

#[test]
fn a_cached_session_turns_stale_when_its_producer_goes() {
    let reader = Reader::new();
    let w = writer();
    let r = publish_one(&w, "a", &[100]);
    reader.read(&r, "t0", &mut [0u8; 100]).unwrap(); // mapped and cached
    drop(w);
    let e = reader.read(&r, "t0", &mut [0u8; 100]).unwrap_err();
    assert!(matches!(e, Error::StaleSession { .. }), "{e}");
    // A result whose shape claims more than the arena holds is refused before allocating.
    let w = writer();
    let mut r = publish_one(&w, "b", &[100]);
    r.features.get_mut("t0").unwrap().shape = vec![1 << 40];
    let e = FeatureStore::new().get(&r, None).unwrap_err();
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
    let store = FeatureStore::new();
    for r in &rs {
        store.get(r, None).unwrap();
        store.release(r).unwrap();
        let e = store.get(r, None).unwrap_err();
        assert!(e.to_string().contains("already released"), "{e}");
        assert!(store.get_into(r, "t0", &mut [0u8; 100]).is_err());
    }
    wait_freed(&w, 3);
    settled(0, || store.health().pending_frees);
    let s = w.stats();
    assert_eq!(
        (s.resident_objects, s.free_bytes, s.unknown_frees),
        (0, s.capacity, 0)
    );
    let h = store.health();
    assert_eq!(
        (
            h.resident_samples,
            h.resident_bytes,
            h.pending_frees,
            h.dropped_frees
        ),
        (0, 0, 0, 0)
    );
    assert_eq!(h.open_sessions, 1);
    // Control connections are persistent: one for all three releases.
    assert_eq!(s.control_connections, 1);
}

#[test]
fn a_late_release_of_a_replaced_sample_never_frees_its_replacement() {
    // The producer published sample a again under the same keys (`replace`, as a retried
    // capture does) while a trainer still held the first result: that release frees nothing
    // now (each key goes with its object's stamp), and the replacement reads on.
    let w = writer();
    let first = publish_one(&w, "a", &[100, 200]);
    let again = w
        .submit(vec![sample("a", &[100, 200]).with_replace(true)])
        .unwrap()
        .wait()
        .unwrap()
        .remove(0);
    assert_eq!(w.stats().replaced_objects, 2);
    let store = FeatureStore::new();
    store.release(&first).unwrap();
    store.flush_within(Duration::from_secs(10)).unwrap();
    let s = w.stats();
    assert_eq!(
        (s.stale_frees, s.freed_objects, s.resident_objects),
        (2, 0, 2),
        "{s:?}"
    );
    verify(&again);
    store.get(&again, None).unwrap();
    // Its own release frees it.
    store.release(&again).unwrap();
    wait_freed(&w, 2);
    assert_eq!(w.stats().free_bytes, w.stats().capacity);
}

#[test]
fn frees_reconnect_after_the_endpoint_drops_the_connection() {
    let store = FeatureStore::new();
    let first = writer();
    let port: u16 = control_port(&first);
    let r1 = publish_one(&first, "a", &[10]);
    store.release(&r1).unwrap();
    wait_freed(&first, 1);
    // The producer restarts on the same control port: the old connection is dead.
    drop(first);
    let c = Config {
        control_port: port,
        ..config(1 << 20, Duration::from_secs(2))
    };
    let second = Writer::start(&c).unwrap();
    let r2 = publish_one(&second, "b", &[10]);
    store.release(&r2).unwrap();
    wait_freed(&second, 1);
    assert_eq!(settled(0, || store.health().pending_frees), 0);
}

#[test]
fn unsent_frees_stay_pending_and_unknown_endpoints_get_every_key() {
    // An endpoint that cannot be reached now (here: its name does not resolve) keeps its keys;
    // the free returns at once (its sender tries) and a flush says what still waits.
    let c = ControlClient::new(Duration::from_secs(1));
    c.free(Some("no-such-host.invalid:9"), [key("x/y/g1/z")])
        .unwrap();
    let e = c.flush_within(Duration::from_secs(2)).unwrap_err();
    assert!(matches!(e, Error::FreeNotSent { pending: 1, .. }), "{e}");
    assert_eq!(c.pending(), 1, "kept for the next try");
    // Once its name failed to resolve (the resolver may take its time while other tests look
    // up hundreds of such names), it is in its back-off, and a flush says so.
    let deadline = Instant::now() + Duration::from_secs(30);
    while c.flush().is_ok() {
        assert!(Instant::now() < deadline, "never in its back-off");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(c.pending(), 1, "kept for the next try");

    // An endpoint that refuses connections has no producer any more: its frees are dropped,
    // and they do not make frees to other endpoints fail.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let c = ControlClient::new(Duration::from_secs(1));
    c.free(Some(&dead), [key("x/y/g1/z")]).unwrap();
    c.flush_within(Duration::from_secs(5)).unwrap();
    assert_eq!(c.pending(), 0);
    assert_eq!(c.dropped(), 1);

    // Keys freed before any endpoint is known go to the first one learned.
    let w = writer();
    let r = w
        .submit(vec![sample("early", &[10])])
        .unwrap()
        .wait()
        .unwrap();
    let c = ControlClient::default();
    c.free(None, keyed(keys(&r))).unwrap();
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
    c.free(None, keyed(ks)).unwrap();
    for w in [&a, &b] {
        wait_freed(w, 1);
        let (s, ok) = w.wait_for(Duration::from_secs(10), |s| s.unknown_frees == 1);
        assert!(ok, "{s:?}");
        assert_eq!(s.resident_objects, 0);
    }
}

#[test]
fn an_unreachable_endpoint_never_delays_frees_to_another() {
    let (dead, _held, _l) = unreachable_endpoint();
    let store = FeatureStore::new();
    // A free to the dead endpoint costs its caller nothing: it returns while its sender is
    // still connecting (the connect waits out its timeout, 5 s by default: had the free waited
    // for it, the endpoint would be in its back-off now, not still sending)...
    store
        .control()
        .free(Some(&dead), [key("x/y/g1/z")])
        .unwrap();
    let e = store.control().flush_within(Duration::ZERO).unwrap_err();
    assert!(
        ["still sending", "waiting for a sender"]
            .iter()
            .any(|m| e.to_string().contains(m)),
        "{e}"
    );
    // ... then backs off, and a free to it says so at once, keys kept.
    let e = store
        .control()
        .flush_within(Duration::from_secs(10))
        .unwrap_err();
    assert!(matches!(e, Error::FreeNotSent { pending: 1, .. }), "{e}");
    let e = store
        .control()
        .free(Some(&dead), [key("x/y/g1/w")])
        .unwrap_err();
    // In its back-off: said at once, without a connect (the error comes from the back-off).
    assert!(e.to_string().contains("retries in"), "{e}");
    assert_eq!(store.health().pending_frees, 2);
    // Releases to a healthy producer never wait for the dead one.
    let w = writer();
    let rs = w
        .submit((0..20).map(|i| sample(&format!("s{i}"), &[10])).collect())
        .unwrap()
        .wait()
        .unwrap();
    for r in &rs {
        let t0 = Instant::now();
        store.release(r).unwrap();
        // Waiting for the dead endpoint would cost its connect timeout (5 s, the default).
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "a release took {:?}",
            t0.elapsed()
        );
    }
    wait_freed(&w, 20);
    assert_eq!(
        settled(2, || store.health().pending_frees),
        2,
        "the dead endpoint's keys wait"
    );
}

/// Waits until the sender of an endpoint that does not answer has taken its keys (it is
/// connecting: "still sending"), not only queued them ("waiting for a sender").
fn until_in_flight(c: &ControlClient) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !c
        .flush_within(Duration::ZERO)
        .is_err_and(|e| e.to_string().contains("still sending"))
    {
        assert!(
            Instant::now() < deadline,
            "the dead endpoint's sender never took its keys"
        );
        std::thread::yield_now();
    }
}

#[test]
fn a_flush_of_some_samples_waits_for_their_keys_not_for_a_dead_endpoints() {
    // SpecForge drains an optimizer window's samples (`drain_sample_removals`): a host that
    // does not answer, holding keys of older samples, made every such drain fail.
    let (dead, _held, _l) = unreachable_endpoint();
    let store = FeatureStore::new();
    store
        .control()
        .free(Some(&dead), [key("st/old/g1/x"), key("st/old/g1/y")])
        .unwrap();
    // While its sender holds them (connecting), they still count for their sample.
    until_in_flight(store.control());
    let e = store
        .flush_samples_within("st", &["a", "old"], Duration::ZERO)
        .unwrap_err();
    assert!(matches!(e, Error::FreeNotSent { pending: 1, .. }), "{e}");
    let w = writer();
    let rs = w
        .submit(vec![sample("a", &[10, 20]), sample("b", &[10])])
        .unwrap()
        .wait()
        .unwrap();
    for r in &rs {
        store.release(r).unwrap();
    }
    store
        .flush_samples_within("st", &["a", "b"], Duration::from_secs(5))
        .unwrap();
    assert_eq!(
        w.stats().freed_objects,
        3,
        "flushed before the producer applied them"
    );
    // The dead endpoint's keys: in its back-off now, or still connecting.
    let e = store
        .flush_samples_within("st", &["old"], Duration::from_millis(200))
        .unwrap_err();
    assert!(matches!(e, Error::FreeNotSent { .. }), "{e}");
    assert!(store.flush_within(Duration::from_millis(200)).is_err());
    assert_eq!(store.health().pending_frees, 2);
}

#[test]
fn a_dead_endpoints_keys_in_flight_never_cost_another_endpoint_its_frees() {
    // The bound on waiting frees dropped from the longest queue. The dead endpoint's keys had
    // gone to its sender (in flight, connecting for up to the timeout), so its queue was empty
    // and the longest was the healthy endpoint's: its free was dropped at once, and its object
    // stayed resident. The dead endpoint pays, once its keys come back.
    let (dead, _held, _l) = unreachable_endpoint();
    // The dead endpoint's connect (its keys in flight) must outlast the healthy endpoint's
    // whole free, a producer's start included (well under a second; 5 s leaves a loaded
    // runner room).
    let c = ControlClient::with_limit(Duration::from_secs(5), 100);
    let _ = c.free(Some(&dead), (0..100).map(|i| key(&format!("s/a{i}/g1/x"))));
    // In flight means its sender took them ("still sending"), not only that they are queued
    // ("waiting for a sender"): a clean clone and CI once read the latter as in flight, and a
    // sender not yet at work by the healthy free had the dead endpoint's queue pay one key.
    until_in_flight(&c);
    let w = writer();
    let r = publish_one(&w, "healthy", &[10]);
    c.free(Some(&w.arena_ref().control), r.keys().unwrap())
        .unwrap();
    wait_freed(&w, 1);
    assert_eq!(
        c.dropped(),
        0,
        "a key was dropped while the dead one's were in flight"
    );
    // Back from the failed connect, the dead endpoint's keys wait again, all of them (the
    // healthy key is gone, so they are within the bound).
    let e = c.flush_within(Duration::from_secs(8)).unwrap_err();
    assert!(matches!(e, Error::FreeNotSent { .. }), "{e}");
    assert_eq!((c.pending(), c.dropped()), (100, 0));
}

#[test]
fn a_producer_that_accepts_nothing_holds_up_no_liveness_probe_or_request() {
    // A stopped producer's reply socket: each liveness probe (a reader makes one a second for
    // each session it caches) stays in its queue, and once the queue is full a blocking
    // connect waits for good, inside the reader's cache lock (before: the third probe here
    // never returned).
    use std::os::fd::FromRawFd;
    let name = format!("capture-arena-test-stopped-{}", std::process::id());
    let endpoint = format!("@{name}");
    // SAFETY: plain FFI: a socket bound to an abstract name, listening with a queue of one,
    // owned by the test from here.
    let _listener = unsafe {
        let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0);
        let mut sa: libc::sockaddr_un = std::mem::zeroed();
        sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (slot, &b) in sa.sun_path[1..].iter_mut().zip(name.as_bytes()) {
            *slot = b as libc::c_char;
        }
        let len = (std::mem::size_of::<libc::sa_family_t>() + 1 + name.len()) as libc::socklen_t;
        assert_eq!(
            libc::bind(fd, (&sa as *const libc::sockaddr_un).cast(), len),
            0
        );
        assert_eq!(libc::listen(fd, 0), 0);
        std::os::fd::OwnedFd::from_raw_fd(fd)
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let probe = endpoint.clone();
    std::thread::spawn(move || {
        for _ in 0..4 {
            let _ = tx.send(capture_arena::reply::is_listening(&probe, None));
        }
        let t0 = Instant::now();
        let asked = capture_arena::reply::request(&probe, "describe", Duration::from_millis(300));
        let _ = tx.send(asked.is_err() && t0.elapsed() < Duration::from_secs(2));
    });
    for i in 0..5 {
        let got = rx.recv_timeout(Duration::from_secs(5));
        assert_eq!(
            got,
            Ok(true),
            "answer {i}: a stopped producer's socket held it up"
        );
    }
}

#[test]
fn more_unreachable_endpoints_than_senders_cost_no_cpu_while_they_back_off() {
    // Names without a port fail at once, so every endpoint is soon in its back-off with more
    // of them than sender threads: the senders hand endpoints over only when one can be tried,
    // and otherwise wait (a review found them handing endpoints back and forth without a
    // pause, both cores busy).
    let c = ControlClient::new(Duration::from_secs(1));
    let n = capture_arena::client::MAX_SENDERS + 44;
    for i in 0..n {
        let _ = c.free(Some(&format!("no-port-{i}")), [key("x/y/g1/z")]);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !matches!(c.flush(), Err(Error::FreeNotSent { .. })) {
        assert!(Instant::now() < deadline, "never in their back-off");
        std::thread::sleep(Duration::from_millis(10));
    }
    let senders_cpu = || -> u64 {
        // Clock ticks (10 ms) of the free senders' threads only: this binary's other tests
        // run beside this one.
        let mut ticks = 0;
        for t in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
            let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
                continue; // a thread that ended
            };
            let Some((name, rest)) = stat.split_once(" (").and_then(|(_, r)| r.rsplit_once(')'))
            else {
                continue;
            };
            if name.starts_with("capture-arena-f") {
                let f: Vec<&str> = rest.split_whitespace().collect();
                ticks += f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
            }
        }
        ticks
    };
    let (before, t0) = (senders_cpu(), Instant::now());
    std::thread::sleep(Duration::from_secs(1)); // the window measured
    let used = (senders_cpu() - before) as f64 / 100.0;
    assert!(
        used < 0.3,
        "the senders used {used:.2} s of CPU in {:?}",
        t0.elapsed()
    );
    assert_eq!(c.pending(), n, "every key still waits");
}

#[test]
fn an_endpoint_whose_frees_were_all_dropped_is_forgotten_once_its_back_off_ends() {
    // Names without a port fail at once. "gone-b" goes into its back-off with one key; a key
    // for "gone-a" then passes the bound of one, and of two equally long queues the later name's
    // loses its key. Before, "gone-b", with nothing left to send, stayed known for good while it
    // had a back-off: one entry for every endpoint results ever named.
    let c = ControlClient::with_limit(Duration::from_secs(1), 1);
    let _ = c.free(Some("gone-b"), [key("x/y/g1/z")]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !matches!(c.flush(), Err(Error::FreeNotSent { .. })) {
        assert!(Instant::now() < deadline, "never in its back-off");
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = c.free(Some("gone-a"), [key("x/y/g1/z")]);
    assert_eq!(c.dropped(), 1);
    while c.endpoints() != ["gone-a"] {
        assert!(
            Instant::now() < deadline,
            "still known after 10 s: {:?}",
            c.endpoints()
        );
        let _ = c.flush(); // prunes (at most once a second)
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(c.pending(), 1);
}

#[test]
fn waiting_frees_are_bounded_and_drops_are_counted() {
    let (dead, _held, _l) = unreachable_endpoint();
    let c = ControlClient::with_limit(Duration::from_millis(200), 100);
    let many = |n: usize, tag: &str| -> Vec<Key> {
        (0..n).map(|i| key(&format!("s/{tag}{i}/g1/x"))).collect()
    };
    c.free(Some(&dead), many(80, "a")).unwrap();
    let _ = c.free(Some(&dead), many(80, "b"));
    assert!(c.flush_within(Duration::from_secs(2)).is_err());
    assert_eq!(c.pending(), 100);
    assert_eq!(c.dropped(), 60);
}

#[test]
fn unlocated_keys_reach_endpoints_learned_later() {
    let (a, b) = (writer(), writer());
    let ra = a.submit(vec![sample("a", &[10])]).unwrap().wait().unwrap();
    let rb = b.submit(vec![sample("b", &[10])]).unwrap().wait().unwrap();
    let c = ControlClient::default();
    c.learn(&a.arena_ref().control);
    let mut ks = keyed(keys(&ra));
    ks.extend(keyed(keys(&rb)));
    // Neither key's endpoint is known: both go to `a` now and to `b` once it is learned.
    c.free(None, ks).unwrap();
    wait_freed(&a, 1);
    c.learn(&b.arena_ref().control);
    c.flush().unwrap();
    wait_freed(&b, 1);
    for w in [&a, &b] {
        assert_eq!(w.stats().resident_objects, 0);
    }
}

#[test]
fn unlocated_keys_go_once_to_an_endpoint_forgotten_and_learned_again() {
    // Before: an endpoint the client forgot (its connection closed) and learned again was sent
    // every unlocated key of the last 10 minutes again, without stamps: here the key was queued
    // again, to free the object published under it since.
    let a = Writer::start(&capture_arena::Config {
        max_connections: 1,
        line_timeout: Duration::from_millis(200),
        ..config(1 << 20, Duration::from_secs(2))
    })
    .unwrap();
    let control = a.arena_ref().control.clone();
    let first = a.submit(vec![sample("k", &[10])]).unwrap().wait().unwrap();
    let c = ControlClient::default();
    c.learn(&control);
    c.free(None, keyed(keys(&first))).unwrap();
    c.flush().unwrap();
    wait_freed(&a, 1);
    let again = a.submit(vec![sample("k", &[10])]).unwrap().wait().unwrap();
    assert_eq!(keys(&again).len(), 1);
    // The client's connection, idle and its frees confirmed, makes way for another one; the
    // client forgets the endpoint once it sees it closed.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut others = Vec::new();
    while a.stats().idle_closed == 0 {
        assert!(Instant::now() < deadline, "{:?}", a.stats());
        others.push(std::net::TcpStream::connect(&control).unwrap());
        std::thread::sleep(Duration::from_millis(50));
    }
    while c.endpoints().contains(&control) {
        assert!(
            Instant::now() < deadline,
            "the client never forgot the endpoint"
        );
        c.flush().unwrap();
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(others);
    while a.stats().open_connections > 0 {
        assert!(Instant::now() < deadline, "{:?}", a.stats());
        std::thread::sleep(Duration::from_millis(10));
    }
    c.learn(&control);
    assert_eq!(
        c.pending(),
        0,
        "the key was queued again for the endpoint learned again"
    );
    c.flush_within(Duration::from_secs(10)).unwrap();
    let s = a.stats();
    assert_eq!((s.resident_objects, s.freed_objects), (1, 1), "{s:?}");
}

/// The mappings of this process whose path names `name`.
fn mappings(name: &str) -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains(name))
        .count()
}

fn mapped(name: &str) -> bool {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .any(|l| l.contains(name))
}

#[test]
fn a_reader_drops_the_mappings_of_producers_that_are_gone() {
    let reader = Reader::new();
    let mut names = Vec::new();
    for round in 0..3 {
        let w = writer();
        let r = publish_one(&w, &format!("r{round}"), &[100]);
        reader.read(&r, "t0", &mut [0u8; 100]).unwrap();
        let name = r.arena.session.split(['/', '?']).nth(2).unwrap().to_owned();
        assert!(mapped(&name));
        names.push(name);
        // The producer restarts: a new session, the old one gone.
    }
    let w = writer();
    let r = publish_one(&w, "last", &[100]);
    reader.read(&r, "t0", &mut [0u8; 100]).unwrap();
    for n in &names {
        assert!(!mapped(n), "{n} is still mapped by the reader");
    }
    assert_eq!(reader.open_sessions(), 1);
}

#[test]
fn past_its_session_cap_a_reader_closes_the_session_read_least_recently() {
    // Producers that cannot be proved gone (NIXL, another host) are never swept: a trainer that
    // outlives more of them than its cap must still open new ones. Live writers here.
    let reader = Reader::new().with_max_sessions(2);
    let ws: Vec<Writer> = (0..3).map(|_| writer()).collect();
    let rs: Vec<Published> = ws
        .iter()
        .enumerate()
        .map(|(i, w)| publish_one(w, &format!("s{i}"), &[100]))
        .collect();
    let name = |r: &Published| r.arena.session.split(['/', '?']).nth(2).unwrap().to_owned();
    let mut buf = [0u8; 100];
    reader.read(&rs[0], "t0", &mut buf).unwrap();
    reader.read(&rs[1], "t0", &mut buf).unwrap();
    let first = reader.open(&rs[0].arena.session).unwrap();
    // The writers map their arenas in this process too: the reader's mapping is one more.
    let (by_writer, by_both) = (mappings(&name(&rs[2])), mappings(&name(&rs[1])));
    assert!(by_both > by_writer);
    // s0 was read last: opening s2 closes s1.
    reader.read(&rs[2], "t0", &mut buf).unwrap();
    assert_eq!(reader.open_sessions(), 2);
    assert_eq!(
        mappings(&name(&rs[1])),
        by_writer,
        "the session read least recently is closed"
    );
    assert_eq!(mappings(&name(&rs[0])), by_both);
    assert_eq!(mappings(&name(&rs[2])), by_both);
    assert!(std::sync::Arc::ptr_eq(
        &first,
        &reader.open(&rs[0].arena.session).unwrap()
    ));
    drop(first);
    // A closed session opens again at its next read (closing s2 now: s0 was used since).
    reader.read(&rs[1], "t0", &mut buf).unwrap();
    verify(&rs[1]);
    assert_eq!(reader.open_sessions(), 2);
    assert_eq!(mappings(&name(&rs[2])), by_writer);
    assert_eq!(mappings(&name(&rs[0])), by_both);
}

#[test]
fn released_samples_are_remembered_in_bounded_memory() {
    // Remembering a release costs a fixed 16 bytes whatever the ids (the result is what a
    // trainer was handed: here with 900-byte sample ids).
    let w = writer();
    let store = FeatureStore::new();
    let long = "x".repeat(900);
    let mut r = publish_one(&w, &long, &[10]);
    store.release(&r).unwrap();
    assert!(matches!(
        store.get(&r, None).unwrap_err(),
        Error::Released { .. }
    ));
    r.gen = 2;
    assert!(
        !matches!(store.get(&r, None), Err(Error::Released { .. })),
        "another generation is another sample"
    );
}

#[test]
fn the_reply_path_hands_a_local_reader_the_region() {
    let w = writer();
    let r = publish_one(&w, "a", &[1000]);
    let reply =
        capture_arena::reply::request(w.reply_endpoint(), "fd", Duration::from_secs(5)).unwrap();
    assert_eq!(reply.bytes, r.arena.session.as_bytes());
    assert_eq!(reply.fds.len(), 1);
    // The descriptor maps the same bytes the result names.
    let session: capture_arena::memory::ShmSession = r.arena.session.parse().unwrap();
    let len = (session.len + capture_arena::memory::shm::HEADER_BYTES) as usize;
    let m = capture_arena::memory::Mapping::map(
        std::os::fd::AsFd::as_fd(&reply.fds[0]),
        len,
        capture_arena::memory::Access::ReadOnly,
        false,
        "test",
    )
    .unwrap();
    let offset = r.features["t0"].address - session.base + capture_arena::memory::shm::HEADER_BYTES;
    let mut out = vec![0u8; 1000];
    m.copy_out(offset as usize, &mut out).unwrap();
    assert!(out
        .iter()
        .enumerate()
        .all(|(j, b)| *b == pattern("a", "t0", j)));
    let d = capture_arena::reply::request(w.reply_endpoint(), "describe", Duration::from_secs(5))
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&d.bytes).unwrap();
    assert_eq!(v["session"], r.arena.session.as_str());
    let e = capture_arena::reply::request(w.reply_endpoint(), "secrets", Duration::from_secs(5))
        .unwrap_err();
    assert!(e.to_string().contains("refused"), "{e}");
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| {
        s.reply_requests == 2 && s.reply_refused == 1
    });
    assert!(ok, "{s:?}");
}

#[test]
fn concurrent_releases_to_one_endpoint_all_go_out_without_a_flush() {
    let w = writer();
    let rs = w
        .submit((0..400).map(|i| sample(&format!("c{i}"), &[10])).collect())
        .unwrap()
        .wait()
        .unwrap();
    let store = FeatureStore::new();
    std::thread::scope(|s| {
        for chunk in rs.chunks(50) {
            let store = &store;
            s.spawn(move || {
                for r in chunk {
                    store.release(r).unwrap();
                }
            });
        }
    });
    // No flush: every key queued while another thread was sending went out with that send.
    wait_freed(&w, 400);
    assert_eq!(settled(0, || store.health().pending_frees), 0);
}

#[test]
fn frees_meant_for_a_producer_that_is_gone_never_reach_its_successor_on_the_same_port() {
    let store = FeatureStore::new();
    let old = writer();
    let port: u16 = control_port(&old);
    let r_old = publish_one(&old, "same", &[10]);
    drop(old);
    // The producer restarts on the same port and publishes a sample under the same key.
    let c = Config {
        control_port: port,
        ..config(1 << 20, Duration::from_secs(2))
    };
    let new = Writer::start(&c).unwrap();
    let r_new = publish_one(&new, "same", &[10]);
    assert_eq!(r_old.keys().unwrap(), r_new.keys().unwrap());
    // Releasing the old result must not free the new object.
    store.release(&r_old).unwrap();
    // The free is dropped, not sent (the result's session is not the producer's there): once
    // the store counts it dropped, nothing of it can reach the new producer.
    let deadline = Instant::now() + Duration::from_secs(10);
    while store.health().dropped_frees == 0 {
        assert!(Instant::now() < deadline, "{:?}", store.health());
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(store.health().dropped_frees, 1);
    let s = new.stats();
    assert_eq!((s.freed_objects, s.resident_objects), (0, 1), "{s:?}");
    store.release(&r_new).unwrap();
    wait_freed(&new, 1);
}

#[test]
fn reading_the_same_arena_through_another_spelling_of_its_session_is_refused() {
    let w = writer();
    let mut r = publish_one(&w, "a", &[10]);
    let reader = Reader::new();
    reader.read(&r, "t0", &mut [0u8; 10]).unwrap();
    r.arena.session = r.arena.session.replace("len=", "len=+");
    assert!(matches!(
        reader.read(&r, "t0", &mut [0u8; 10]).unwrap_err(),
        Error::InvalidSession { .. }
    ));
    assert_eq!(reader.open_sessions(), 1);
}

#[test]
fn a_reader_refuses_an_arena_open_to_others_or_owned_by_another_user() {
    use std::os::unix::fs::PermissionsExt;
    let w = writer();
    let r = publish_one(&w, "a", &[16]);
    let session: capture_arena::memory::ShmSession = r.arena.session.parse().unwrap();
    let path = std::path::Path::new("/dev/shm").join(&session.name);
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o600
    );
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut out = [0u8; 16];
    let e = Reader::new().read(&r, "t0", &mut out).unwrap_err();
    assert!(
        matches!(e, Error::InvalidSession { .. }) && e.to_string().contains("mode is 644"),
        "{e}"
    );
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    Reader::new().read(&r, "t0", &mut out).unwrap();
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        // Only root can give the object away, which is what a test needs here.
        std::os::unix::fs::chown(&path, Some(65534), None).unwrap();
        let e = Reader::new().read(&r, "t0", &mut out).unwrap_err();
        assert!(e.to_string().contains("owned by uid 65534"), "{e}");
        std::os::unix::fs::chown(&path, Some(0), None).unwrap();
    } else {
        println!("skipping the other-owner case: giving a file away needs root");
    }
}

/// Threads of this process now.
fn threads() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn results_naming_endpoints_without_end_cost_a_bounded_number_of_sender_threads() {
    let c = ControlClient::new(Duration::from_secs(1));
    let before = threads();
    let n = capture_arena::client::MAX_SENDERS + 100;
    for i in 0..n {
        let _ = c.free(
            Some(&format!("no-such-host-{i}.invalid:9")),
            [key("x/y/g1/z")],
        );
    }
    assert!(c.flush_within(Duration::from_secs(1)).is_err());
    let during = threads();
    // The senders, and the name resolutions they wait for (each within its sender's deadline).
    let most = capture_arena::client::MAX_SENDERS + capture_arena::client::MAX_RESOLUTIONS;
    assert!(
        during <= before + most + 8,
        "{during} threads for {n} endpoints (from {before})"
    );
    assert_eq!(c.pending(), n, "every key still waits");
    // A healthy producer's free finds every sender taken by those endpoints, sleeping out
    // their back-offs: one of them hands itself over (before: no sender ever started for it,
    // and its object stayed resident).
    let w = writer();
    let r = publish_one(&w, "healthy", &[10]);
    c.free(Some(&w.arena_ref().control), r.keys().unwrap())
        .unwrap();
    let (s, ok) = w.wait_for(Duration::from_secs(30), |s| s.freed_objects == 1);
    assert!(ok, "the healthy producer's free never went out: {s:?}");
    assert!(threads() <= before + most + 8, "a sender thread was added");
}

#[test]
fn a_result_freed_through_another_reader_is_an_error_never_another_samples_bytes() {
    // The arena holds four 4 KiB objects: a fifth needs freed space.
    let w = Writer::start(&config(16 << 10, Duration::from_secs(5))).unwrap();
    let old: Vec<Published> = (0..4)
        .map(|i| publish_one(&w, &format!("old{i}"), &[4000]))
        .collect();
    let (a, b) = (FeatureStore::new(), FeatureStore::new());
    let mut buf = vec![0u8; 4000];
    b.reader().read(&old[0], "t0", &mut buf).unwrap();
    // SAFETY: the bytes are only looked at after `check` (below), which tells whether they were
    // the object's; nobody frees it while the view is made.
    let view = unsafe { b.reader().view(&old[0], "t0") }.unwrap();
    // Trainer A releases every old sample; trainer B, which never saw that, still has them.
    for r in &old {
        a.release(r).unwrap();
    }
    wait_freed(&w, 4);
    // Freed, not yet reused: the stamp is zero.
    let e = b.reader().read(&old[0], "t0", &mut buf).unwrap_err();
    assert!(matches!(e, Error::Changed { found: 0, .. }), "{e}");
    assert!(e.to_string().contains("was freed"), "{e}");
    assert!(matches!(view.check(), Err(Error::Changed { .. })));
    // New samples take the space: B's replay of the old results fails on every one of them,
    // and never returns a new sample's bytes.
    let new: Vec<Published> = (0..4)
        .map(|i| publish_one(&w, &format!("new{i}"), &[4000]))
        .collect();
    assert!(new.iter().any(|n| old
        .iter()
        .any(|o| o.features["t0"].address == n.features["t0"].address)));
    for r in &old {
        let e = b.reader().read(r, "t0", &mut buf).unwrap_err();
        assert!(matches!(e, Error::Changed { .. }), "{e}");
    }
    for r in &new {
        verify(r);
    }
    // A result without stamps (another producer's, or the store placement's) reads unchecked.
    let mut bare = new[0].clone();
    bare.features.get_mut("t0").unwrap().stamp = None;
    b.reader().read(&bare, "t0", &mut buf).unwrap();
    // A forged stamp is refused before anything is read.
    let mut forged = new[0].clone();
    forged.features.get_mut("t0").unwrap().stamp = Some(0);
    assert!(b.get(&forged, None).is_err());
}

#[test]
fn a_producer_that_reads_a_little_now_and_then_cannot_stretch_send_frees_past_its_timeout() {
    // A socket's write timeout bounds each write, not a whole write_all: a producer that takes
    // 64 KiB every 0.3 s (its pool full, say) kept send_frees of a few MB going for many times
    // its timeout. The fake producer answers the connection's first sync, then trickles.
    use std::io::Read;
    use std::os::fd::AsRawFd;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let small: libc::c_int = 64 << 10;
    // SAFETY: setsockopt on a socket this test owns, with a c_int of the right size; accepted
    // connections inherit the small receive buffer.
    let rc = unsafe {
        libc::setsockopt(
            listener.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&small as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0);
    let endpoint = listener.local_addr().unwrap().to_string();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let halt = stop.clone();
    let producer = std::thread::spawn(move || {
        let (mut c, _) = listener.accept().unwrap();
        answer_first_sync(&mut c);
        let mut chunk = vec![0u8; 64 << 10];
        c.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        while !halt.load(std::sync::atomic::Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(300));
            if matches!(c.read(&mut chunk), Ok(0)) {
                break;
            }
        }
    });
    // 24 MB: more than a sender's socket buffers hold even where tcp_wmem's maximum is 16 MiB.
    let keys: Vec<Key> = (0..100_000)
        .map(|i| Key::new("st", &format!("{i:0>200}"), 1, "hidden_states").unwrap())
        .collect();
    let t0 = Instant::now();
    let e = capture_arena::client::send_frees(&endpoint, None, &keys, &[], Duration::from_secs(1))
        .unwrap_err();
    let took = t0.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(
        took < Duration::from_secs(3), // its 1 s, making the 24 MB of lines within it
        "send_frees with a 1 s timeout took {took:?}: {e}"
    );
    assert!(matches!(e, Error::FreeNotSent { .. }), "{e}");
    producer.join().unwrap();
}

#[test]
fn a_reader_that_stopped_reading_lets_go_of_a_producer_that_is_gone() {
    // A trainer whose producer died gets no new results and stops reading: its cache was swept
    // only by its next open, so the dead arena stayed mapped, its pages charged to /dev/shm
    // where the restarted producer needs them. Dropped within a few sweeps (1 s each) now.
    let w = Writer::start(&config(1 << 20, Duration::from_secs(1))).unwrap();
    let p = publish_one(&w, "mapped", &[1000]);
    let reader = Reader::new();
    let n = reader.checked_len(&p, "t0").unwrap() as usize;
    reader.read(&p, "t0", &mut vec![0u8; n]).unwrap();
    let name = p.arena.session["shm://".len()..]
        .split('?')
        .next()
        .unwrap()
        .to_owned();
    let mapped = || {
        std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .contains(&name)
    };
    assert!(mapped());
    drop(w); // the producer removes its arena: gone
    let deadline = Instant::now() + Duration::from_secs(10);
    while mapped() {
        assert!(
            Instant::now() < deadline,
            "still mapped 10 s after its producer went"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(reader.open_sessions(), 0);
}
