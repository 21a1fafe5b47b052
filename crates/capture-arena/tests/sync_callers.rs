//! A synchronous caller (SGLang's scheduler thread under a patch that calls `put_sample`) waits
//! a bounded time for its batch to start: a full arena or earlier batches cost it at most its
//! bound, not the arena's wait for frees, and a batch it gave up on is never written. And the
//! producer frees captures it drops itself, without a control connection.

mod util;

use std::time::{Duration, Instant};

use capture_arena::{Error, Writer};
use util::*;

const BOUND: Duration = Duration::from_millis(300);

#[test]
fn a_full_arena_costs_a_bounded_caller_its_bound_and_the_batch_is_never_written() {
    // An arena of 1 MiB that waits 30 s for frees, as the default does.
    let w = Writer::start(&config(1 << 20, Duration::from_secs(30))).unwrap();
    let first = publish_one(&w, "first", &[700 << 10]);
    let t0 = Instant::now();
    let e = w
        .submit_within(vec![sample("late", &[700 << 10])], BOUND)
        .unwrap_err();
    let took = t0.elapsed();
    assert!(took >= BOUND, "gave up after {took:?}, before its bound");
    assert!(
        took < Duration::from_secs(30),
        "waited out the arena's wait: {took:?}"
    );
    match &e {
        // It says why, and which variable sets the bound.
        Error::Timeout { reason, .. } => assert!(
            reason.contains("arena was full")
                && e.to_string().contains("SGLANG_SPEC_CAPTURE_SYNC_WAIT_S"),
            "{e}"
        ),
        other => panic!("{other}"),
    }
    // It stops holding the writer when its caller gives up (not after the arena's 30 s).
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.failed_batches == 1);
    assert!(ok, "the batch given up on still waits for frees: {s:?}");
    // Room now: the batch given up on must not appear.
    free(&w.arena_ref().control, &keys(&[first]));
    wait_freed(&w, 1);
    let (s, _) = w.wait_for(Duration::from_secs(5), |s| s.failed_batches == 1);
    assert_eq!(
        (s.published_batches, s.resident_objects, s.failed_batches),
        (1, 0, 1),
        "{s:?}"
    );
    // And the next bounded caller publishes.
    let r = w
        .submit_within(vec![sample("next", &[700 << 10])], BOUND)
        .unwrap();
    verify(&r[0]);
}

#[test]
fn a_bounded_caller_behind_a_batch_waiting_for_frees_gives_up_on_time() {
    let w = Writer::start(&config(1 << 20, Duration::from_secs(30))).unwrap();
    let first = publish_one(&w, "first", &[700 << 10]);
    // An unbounded batch waits for frees (30 s) and holds the writer.
    let waiting = w.submit(vec![sample("waits", &[700 << 10])]).unwrap();
    let t0 = Instant::now();
    let e = w
        .submit_within(vec![sample("small", &[1 << 10])], BOUND)
        .unwrap_err();
    assert!(t0.elapsed() >= BOUND && t0.elapsed() < Duration::from_secs(30));
    assert!(
        matches!(e, Error::Timeout { ref reason, .. } if reason.contains("earlier batches")),
        "{e}"
    );
    // Frees let the waiting batch through; the small one, given up on, is skipped.
    free(&w.arena_ref().control, &keys(&[first]));
    let r = waiting.wait().unwrap();
    verify(&r[0]);
    let (s, _) = w.wait_for(Duration::from_secs(5), |s| s.failed_batches == 1);
    assert_eq!((s.published_batches, s.failed_batches), (2, 1), "{s:?}");
    assert_eq!(s.resident_objects, 1);
}

#[test]
fn a_bounded_caller_that_starts_in_time_gets_its_results_and_failures_come_at_once() {
    let w = Writer::start(&config(1 << 20, Duration::from_secs(30))).unwrap();
    let r = w
        .submit_within(vec![sample("a", &[100]), sample("b", &[200])], BOUND)
        .unwrap();
    assert_eq!(r.len(), 2);
    r.iter().for_each(verify);
    // A batch that fails before starting (a key already resident) is reported at once, not at
    // the bound.
    let t0 = Instant::now();
    let e = w.submit_within(vec![sample("a", &[100])], Duration::from_secs(20));
    assert!(matches!(e, Err(Error::KeyExists { .. })), "{e:?}");
    assert!(t0.elapsed() < Duration::from_secs(10));
}

#[test]
fn the_producer_frees_what_it_drops_itself_and_counts_it() {
    let w = Writer::start(&config(1 << 20, Duration::from_secs(2))).unwrap();
    let a = publish_one(&w, "a", &[100, 300]);
    let b = publish_one(&w, "b", &[100]);
    w.free_local(keys(&[a]).into_iter().chain(["st/never/g1/x".to_owned()]));
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.local_freed_objects == 2);
    assert!(ok, "{s:?}");
    assert_eq!(
        (s.freed_objects, s.unknown_frees, s.resident_objects),
        (2, 1, 1)
    );
    verify(&b);
}

#[test]
fn samples_published_each_alone_wait_for_space_at_most_one_bound_in_all_and_fail_alone() {
    // vLLM's step: many requests, each a batch of its own, under one bound. The arena has
    // ~300 KiB left: none of the 40 large samples fits, the small one after them does.
    let w = Writer::start(&config(1 << 20, Duration::from_secs(30))).unwrap();
    let first = publish_one(&w, "first", &[700 << 10]);
    let mut samples: Vec<_> = (0..40)
        .map(|i| sample(&format!("big{i}"), &[400 << 10]))
        .collect();
    samples.push(sample("small", &[1 << 10]));
    let t0 = Instant::now();
    let out = w.submit_each_within(samples, BOUND).unwrap();
    let took = t0.elapsed();
    // One bound for the whole call, not one per sample (40 x 300 ms).
    assert!(
        took >= BOUND && took < BOUND + Duration::from_millis(250),
        "took {took:?} for a bound of {BOUND:?}"
    );
    assert_eq!(out.len(), 41);
    for o in &out[..40] {
        assert!(matches!(o, Err(Error::ArenaFull { .. })), "{o:?}");
    }
    // The small one is published: it fails or succeeds alone.
    let small = out[40].as_ref().unwrap();
    verify(&small[0]);
    free(&w.arena_ref().control, &keys(&[first, small[0].clone()]));
    wait_freed(&w, 2);
    let (s, _) = w.wait_for(Duration::from_secs(5), |s| s.failed_batches == 40);
    assert_eq!(
        (s.published_batches, s.failed_batches, s.resident_objects),
        (2, 40, 0),
        "{s:?}"
    );
}
