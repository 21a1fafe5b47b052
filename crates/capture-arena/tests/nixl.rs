//! NIXL in one process against the real library: a writer whose arena is served through NIXL
//! and a reader reaching it through its own agent (UCX over shared memory or TCP on loopback,
//! as `UCX_TLS` says). The two-process tests (`UCX_TLS=tcp` and the default transports) are the
//! CLI's `tests/nixl.rs`.
//!
//! Needs the NIXL library: `scripts/test.sh` installs the wheel and sets
//! `SGLANG_SPEC_CAPTURE_NIXL_LIB`; without it these tests fail saying so.
#![cfg(feature = "nixl")]

mod util;

use std::time::Duration;

use capture_arena::client::Reader;
use capture_arena::config::ArenaTransport;
use capture_arena::{Error, ReadBuffer, Writer};
use util::*;

fn writer(bytes: u64) -> Writer {
    capture_arena::memory::nixl::library().unwrap_or_else(|e| {
        panic!("{e}\n(the NIXL tests need the library; scripts/test.sh installs it)")
    });
    let c = capture_arena::Config {
        transport: ArenaTransport::Nixl,
        ..config(bytes, Duration::from_secs(2))
    };
    Writer::start(&c).unwrap()
}

#[test]
fn every_byte_of_a_multi_sample_batch_is_read_and_frees_empty_the_arena() {
    let w = writer(4 << 20);
    let results = w
        .submit(vec![
            sample("a", &[100_000, 3, 70_001]),
            sample("b", &[1, 262_144]),
            sample("c", &[4096; 5]),
        ])
        .unwrap()
        .wait()
        .unwrap();
    for r in &results {
        assert!(
            r.arena.session.starts_with("nixl://"),
            "{}",
            r.arena.session
        );
        verify(r);
    }
    let keys = keys(&results);
    free(&w.arena_ref().control, &keys);
    wait_freed(&w, keys.len() as u64);
    let s = w.stats();
    assert_eq!(s.free_bytes, s.capacity);
    assert_eq!(s.resident_objects, 0);
}

#[test]
fn sixteen_objects_are_read_in_one_request_into_one_registered_buffer() {
    let w = writer(8 << 20);
    let sizes = [65_536usize; 16];
    let r = publish_one(&w, "many", &sizes);
    let reader = Reader::new();
    let mut buf = ReadBuffer::new(16 * 65_536).unwrap();
    for round in 0..3 {
        let mut outs: Vec<(String, &mut [u8])> = buf
            .chunks_mut(65_536)
            .enumerate()
            .map(|(i, c)| (format!("t{i}"), c))
            .collect();
        let mut named: Vec<(&str, &mut [u8])> = outs
            .iter_mut()
            .map(|(n, c)| (n.as_str(), &mut **c))
            .collect();
        reader.read_many(&r, &mut named).unwrap();
        for (i, c) in buf.chunks(65_536).enumerate() {
            let name = format!("t{i}");
            assert!(
                c.iter()
                    .enumerate()
                    .all(|(j, b)| *b == pattern("many", &name, j)),
                "round {round} object {i}"
            );
        }
        // Registered on the first read, reused after.
        assert_eq!(buf.registrations(), 1);
        buf.fill(0);
    }
    drop(buf);
}

#[test]
fn a_range_outside_the_arena_is_refused_before_any_read_and_the_session_stays_usable() {
    let w = writer(1 << 20);
    let good = publish_one(&w, "a", &[100]);
    let reader = Reader::new();
    let mut forged = good.clone();
    let f = forged.features.get_mut("t0").unwrap();
    f.address += 1 << 20;
    let mut out = vec![0u8; 100];
    match reader.read(&forged, "t0", &mut out) {
        Err(Error::OutOfRange { .. }) => {}
        other => panic!("expected OutOfRange, got {other:?}"),
    }
    assert!(out.iter().all(|b| *b == 0), "nothing was written");
    let mut forged = good.clone();
    forged.features.get_mut("t0").unwrap().shape = vec![(1 << 20) + 1];
    let mut big = vec![0u8; (1 << 20) + 1];
    assert!(matches!(
        reader.read(&forged, "t0", &mut big),
        Err(Error::OutOfRange { .. })
    ));
    let t = reader.open(&good.arena.session).unwrap();
    assert!(t.is_live());
    assert!(t.check(good.features["t0"].address, 100).is_ok());
    verify(&good);
    reader.read(&good, "t0", &mut out).unwrap();
    assert_eq!(out[7], pattern("a", "t0", 7));
}

#[test]
fn a_session_claiming_more_than_its_producer_registered_is_refused_before_any_allocation() {
    // A forged result: a live producer's session with a larger arena claimed, and a feature of
    // 1 GiB inside the claim. Only NIXL knows what the producer registered.
    let w = writer(1 << 20);
    let good = publish_one(&w, "a", &[100]);
    let claimed = 8u64 << 30;
    let mut forged = good.clone();
    forged.arena.session = good.arena.session.replace(
        &format!("?len={}&", 1u64 << 20),
        &format!("?len={claimed}&"),
    );
    assert_ne!(forged.arena.session, good.arena.session);
    forged.features.get_mut("t0").unwrap().shape = vec![1 << 30];
    let reader = Reader::new();
    let e = reader.open(&forged.arena.session).unwrap_err();
    assert!(
        matches!(&e, Error::StaleSession { reason, .. } if reason.contains(&format!("{claimed} bytes"))),
        "{e}"
    );
    let store = capture_arena::client::FeatureStore::new();
    assert!(matches!(
        store.get(&forged, None).unwrap_err(),
        Error::StaleSession { .. }
    ));
    // The producer is not taken for gone, nor its session spoilt.
    assert!(reader.open(&good.arena.session).unwrap().is_live());
    verify(&good);
}

#[test]
fn one_reader_reads_shared_memory_and_nixl_sessions_at_once() {
    let nixl = writer(1 << 20);
    let shm = Writer::start(&config(1 << 20, Duration::from_secs(2))).unwrap();
    let a = publish_one(&nixl, "n", &[5000]);
    let b = publish_one(&shm, "s", &[5000]);
    assert!(b.arena.session.starts_with("shm://"));
    let reader = Reader::new();
    for _ in 0..2 {
        for r in [&a, &b] {
            let mut out = vec![0u8; 5000];
            reader.read(r, "t0", &mut out).unwrap();
            assert_eq!(out[4999], pattern(&r.sample_id, "t0", 4999));
        }
    }
    assert_eq!(reader.open_sessions(), 2);
}

#[test]
fn a_stopped_producer_is_a_stale_session_not_a_hang() {
    let w = writer(1 << 20);
    let r = publish_one(&w, "gone", &[4096]);
    let reader = Reader::new();
    let mut out = vec![0u8; 4096];
    reader.read(&r, "t0", &mut out).unwrap();
    drop(w);
    let t0 = std::time::Instant::now();
    let e = reader.read(&r, "t0", &mut out).unwrap_err();
    assert!(matches!(e, Error::StaleSession { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(15));
    // Stays refused, at once.
    let e = reader.read(&r, "t0", &mut out).unwrap_err();
    assert!(matches!(e, Error::StaleSession { .. }), "{e}");
}

#[test]
fn metadata_of_another_agent_or_corrupted_is_refused_cleanly() {
    let w = writer(1 << 20);
    let r = publish_one(&w, "a", &[16]);
    let s: capture_arena::memory::nixl::NixlSession = r.arena.session.parse().unwrap();
    // Another agent's name over this metadata: refused before NIXL sees it.
    let renamed = capture_arena::memory::nixl::NixlSession {
        agent: format!("capture-arena-1-{:032x}", 5u128),
        ..s.clone()
    };
    let e = Reader::new().open(&renamed.to_string()).unwrap_err();
    assert!(matches!(e, Error::InvalidSession { .. }), "{e}");
    // The right name, a corrupted body: NIXL refuses it, and the read fails cleanly.
    let mut md = s.metadata.clone();
    let n = md.len();
    md[n - n / 3] ^= 0xff;
    md.truncate(n - 7);
    let corrupted = capture_arena::memory::nixl::NixlSession {
        metadata: md,
        ..s.clone()
    };
    let e = Reader::new().open(&corrupted.to_string()).unwrap_err();
    assert!(matches!(e, Error::StaleSession { .. }), "{e}");
    // The producer is untouched.
    verify(&r);
}
