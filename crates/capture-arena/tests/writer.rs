//! The writer thread with real threads, real sockets and real shared memory.

mod util;

use std::time::{Duration, Instant};

use capture_arena::{Config, Error, SampleResult, Sink, Writer};
use util::*;

const KIB: usize = 1024;

#[test]
fn publishes_reads_back_and_frees_to_empty() {
    let w = Writer::start(&config(1 << 20, Duration::from_secs(1))).unwrap();
    let results = w
        .submit(vec![sample("a", &[100 * KIB, 3]), sample("b", &[10 * KIB])])
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(results.len(), 2);
    assert_eq!(results[0].arena, *w.arena_ref());
    assert!(w.arena_ref().control.starts_with("127.0.0.1:"));
    for r in &results {
        verify(r);
    }
    let s = w.stats();
    assert_eq!(
        (
            s.published_batches,
            s.published_samples,
            s.published_objects
        ),
        (1, 2, 3)
    );
    assert_eq!(s.published_bytes, (110 * KIB + 3) as u64);
    free(&w.arena_ref().control, &keys(&results));
    wait_freed(&w, 3);
    let s = w.stats();
    assert_eq!(
        (s.free_bytes, s.free_extents, s.resident_objects),
        (1 << 20, 1, 0)
    );
}

#[test]
fn region_is_created_on_first_capture_and_removed_on_drop() {
    let sink = Sink::new(config(1 << 20, Duration::from_secs(1))).unwrap();
    // Nothing exists until the first capture: no writer, no region, no port.
    assert!(sink.started().is_none());
    assert_eq!(sink.stats().capacity, 0);
    let r = sink
        .submit(vec![sample("a", &[10])])
        .unwrap()
        .wait()
        .unwrap();
    assert!(sink.started().is_some());
    let path = format!(
        "/dev/shm/{}",
        r[0].arena.session.split(['/', '?']).nth(2).unwrap()
    );
    assert!(std::path::Path::new(&path).exists(), "{path}");
    drop(sink);
    assert!(
        !std::path::Path::new(&path).exists(),
        "{path} removed with the arena"
    );
}

#[test]
fn arena_size_is_required() {
    let e = Writer::start(&Config::default()).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Config {
                var: "SGLANG_SPEC_CAPTURE_ARENA_BYTES",
                ..
            }
        ),
        "{e}"
    );
    // A sink without a size is fine until it captures: then it says what to set.
    let sink = Sink::new(Config::default()).unwrap();
    let e = sink.submit(vec![sample("a", &[1])]).unwrap_err();
    assert!(
        e.to_string().contains("SGLANG_SPEC_CAPTURE_ARENA_BYTES"),
        "{e}"
    );
}

#[test]
fn nvlink_rejects_host_publication() {
    let c = Config {
        protocol: Some("nvlink".into()),
        gpu_put: Some(false),
        ..config(1 << 20, Duration::ZERO)
    };
    let e = Sink::new(c).unwrap_err();
    assert!(
        e.to_string().contains("SGLANG_SPEC_CAPTURE_GPU_PUT=0"),
        "{e}"
    );
    let c = Config {
        protocol: Some("nvlink".into()),
        ..config(1 << 20, Duration::ZERO)
    };
    assert!(Sink::new(c.clone()).unwrap().config().device_publication());
    let e = Writer::start(&Config {
        max_pending_batches: 0,
        ..c
    })
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES"),
        "{e}"
    );
}

#[test]
fn a_free_from_another_thread_lets_a_waiting_batch_through() {
    let w = Writer::start(&config(64 * KIB as u64, Duration::from_secs(20))).unwrap();
    let first = w
        .submit(vec![sample("a", &[48 * KIB])])
        .unwrap()
        .wait()
        .unwrap();
    let control = w.arena_ref().control.clone();
    let ks = keys(&first);
    let t0 = Instant::now();
    let freer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        free(&control, &ks);
    });
    let second = w
        .submit(vec![sample("b", &[48 * KIB])])
        .unwrap()
        .wait()
        .unwrap();
    let took = t0.elapsed();
    freer.join().unwrap();
    verify(&second[0]);
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(10),
        "{took:?}"
    );
    let s = w.stats();
    assert_eq!((s.waits, s.freed_objects, s.failed_batches), (1, 1, 0));
    assert!(s.wait_ns >= 250_000_000, "{s:?}");
}

#[test]
fn a_batch_that_never_fits_in_time_fails_with_the_hint_and_leaves_nothing() {
    let w = Writer::start(&config(64 * KIB as u64, Duration::from_millis(200))).unwrap();
    w.submit(vec![sample("a", &[40 * KIB])])
        .unwrap()
        .wait()
        .unwrap();
    let before = w.stats();
    let t0 = Instant::now();
    let results = w
        .submit(vec![sample("b", &[8 * KIB]), sample("c", &[20 * KIB])])
        .unwrap()
        .wait_results();
    assert!(t0.elapsed() >= Duration::from_millis(200));
    assert_eq!(results.len(), 2);
    for (r, id) in results.iter().zip(["b", "c"]) {
        let SampleResult::Failed(f) = r else {
            panic!("{r:?}")
        };
        assert_eq!(f.sample_id, id);
        for needle in [
            "arena full",
            "needs 28672 bytes",
            "24576 of 65536 bytes are free",
            "largest free extent 24576",
            "1 objects resident",
            "SGLANG_SPEC_CAPTURE_ARENA_BYTES",
            "resident watermark",
        ] {
            assert!(f.error.contains(needle), "{:?} lacks {needle:?}", f.error);
        }
    }
    let s = w.stats();
    assert_eq!(
        (s.resident_objects, s.free_bytes),
        (before.resident_objects, before.free_bytes)
    );
    assert_eq!((s.failed_batches, s.waits), (1, 1));
}

#[test]
fn a_batch_larger_than_the_arena_fails_at_once() {
    let w = Writer::start(&config(64 * KIB as u64, Duration::from_secs(30))).unwrap();
    let t0 = Instant::now();
    let e = w
        .submit(vec![sample("a", &[40 * KIB]), sample("b", &[40 * KIB])])
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(
        matches!(
            e,
            Error::BatchTooLarge {
                needed: 81920,
                capacity: 65536
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("SGLANG_SPEC_CAPTURE_ARENA_BYTES"));
    assert_eq!(w.stats().waits, 0);
}

#[test]
fn a_bad_second_sample_fails_the_whole_batch() {
    let w = Writer::start(&config(1 << 20, Duration::from_secs(1))).unwrap();
    w.submit(vec![sample("x", &[10])]).unwrap().wait().unwrap();
    let before = w.stats();
    // The second sample's key is already resident and it does not ask for replace.
    let r = w
        .submit(vec![sample("ok", &[1000]), sample("x", &[10])])
        .unwrap()
        .wait_results();
    assert!(r.iter().all(|r| matches!(r, SampleResult::Failed(f) if f.error.contains("st/x/g1/t0 is already resident"))), "{r:?}");
    let s = w.stats();
    assert_eq!(
        (s.resident_objects, s.free_bytes, s.published_objects),
        (before.resident_objects, before.free_bytes, 1)
    );
    // Nothing of "ok" was written: publishing it now works without replace.
    w.submit(vec![sample("ok", &[1000])])
        .unwrap()
        .wait()
        .unwrap();
}

#[test]
fn replace_on_retry_keeps_the_key_and_leaves_no_second_copy() {
    let w = Writer::start(&config(1 << 20, Duration::from_secs(1))).unwrap();
    w.submit(vec![sample("r", &[1000])])
        .unwrap()
        .wait()
        .unwrap();
    let e = w
        .submit(vec![sample("r", &[1000])])
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(matches!(e, Error::KeyExists { .. }));
    let again = w
        .submit(vec![sample("r", &[1000]).with_replace(true)])
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(again[0].keys().unwrap()[0].as_str(), "st/r/g1/t0");
    verify(&again[0]);
    let s = w.stats();
    assert_eq!(
        (s.resident_objects, s.replaced_objects, s.published_objects),
        (1, 1, 2)
    );
}

#[test]
fn a_full_queue_blocks_or_signals_instead_of_dropping() {
    // max_pending_batches counts every batch the writer holds: queued or being placed.
    let c = Config {
        max_pending_batches: 2,
        ..config(64 * KIB as u64, Duration::from_secs(20))
    };
    let w = Writer::start(&c).unwrap();
    let first = w
        .submit(vec![sample("a", &[60 * KIB])])
        .unwrap()
        .wait()
        .unwrap();
    // The writer takes "b" and waits for space; "c" is queued: two held, so "d" does not fit.
    let hb = w.submit(vec![sample("b", &[60 * KIB])]).unwrap();
    let hc = w.try_submit(vec![sample("c", &[1])]).unwrap();
    let e = w.try_submit(vec![sample("d", &[1])]).unwrap_err();
    assert!(matches!(e, Error::QueueFull { capacity: 2 }), "{e}");
    assert!(e
        .to_string()
        .contains("SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES"));
    // A blocking submit waits for room instead of dropping the batch.
    let control = w.arena_ref().control.clone();
    let ks = keys(&first);
    std::thread::scope(|s| {
        let blocked = s.spawn(|| w.submit(vec![sample("e", &[1])]).unwrap().wait());
        std::thread::sleep(Duration::from_millis(200));
        assert!(!blocked.is_finished(), "no room until a batch completes");
        free(&control, &ks);
        blocked.join().unwrap().unwrap();
    });
    for h in [hb, hc] {
        h.wait().unwrap();
    }
    assert_eq!(w.stats().published_batches, 4);
}

#[test]
fn submitting_after_the_writer_is_gone_errors() {
    let w = Writer::start(&config(1 << 20, Duration::from_secs(1))).unwrap();
    let h = w.submit(vec![sample("a", &[10])]).unwrap();
    drop(w);
    // Queued work is finished before the thread stops.
    assert!(h.wait().is_ok());
}
