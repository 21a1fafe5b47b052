//! Results handed out before their bytes (what vLLM's connector needs): a batch of reserved
//! tensors is published at once, its objects' stamp words pending; its submitter writes the
//! bytes and finishes the write. Readers wait for the bytes (bounded), never read unwritten or
//! stale ones, and fail with the reason when the write failed; a free meanwhile waits for the
//! write, so nothing is ever written into space placed again.

mod util;

use std::time::{Duration, Instant};

use capture_arena::{
    Dtype, Error, Published, Reader, Sample, Tensor, TensorData, Writer, FAILED_BIT, PENDING_BIT,
};
use util::*;

const BOUND: Duration = Duration::from_secs(5);

/// A sample of one reserved uint8 tensor `t0` of `n` bytes.
fn reserved(id: &str, n: u64) -> Sample {
    let mut s = Sample::new("st", id, 1).unwrap();
    s.push(Tensor::new("t0", vec![n], Dtype::Uint8, TensorData::Reserved(n)).unwrap())
        .unwrap();
    s
}

/// Publishes reserved samples; their results.
fn publish(w: &Writer, samples: Vec<Sample>) -> Vec<Published> {
    w.submit_each_within(samples, BOUND)
        .unwrap()
        .into_iter()
        .map(|o| o.unwrap().remove(0))
        .collect()
}

/// Writes `t0`'s bytes (the pattern) where its result says: the submitter's part.
fn write(p: &Published) {
    let f = &p.features["t0"];
    let n = f.byte_len().unwrap() as usize;
    let bytes: Vec<u8> = (0..n).map(|j| pattern(&p.sample_id, "t0", j)).collect();
    // SAFETY: the object's reserved bytes in this process's own writable mapping of the
    // arena (the writer's), which nobody else writes until the write is finished.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), f.address as *mut u8, n) };
}

/// The stamp word of `t0` as the arena holds it.
fn word(p: &Published) -> u64 {
    let f = &p.features["t0"];
    let at = f.address + f.byte_len().unwrap().div_ceil(8) * 8;
    // SAFETY: the object's aligned stamp word, inside this process's mapping of the arena.
    u64::from_le(unsafe { std::ptr::read_volatile(at as *const u64) })
}

#[test]
fn a_reader_waits_for_bytes_still_being_written_and_reads_them_once_finished() {
    let w = Writer::start(&config(1 << 20, Duration::from_secs(2))).unwrap();
    let p = publish(&w, vec![reserved("a", 10_000)]).remove(0);
    let stamp = p.features["t0"].stamp.unwrap();
    assert_eq!(
        word(&p),
        stamp | PENDING_BIT,
        "pending until the write is finished"
    );
    let (s, _) = w.wait_for(Duration::from_secs(5), |s| s.published_objects == 1);
    assert_eq!((s.resident_objects, s.written_objects), (1, 0));

    // A reader that comes now waits; the bytes land and the write is finished while it does.
    let (started, start) = std::sync::mpsc::channel();
    let reader = std::thread::spawn({
        let p = p.clone();
        move || {
            let mut out = vec![0u8; 10_000];
            started.send(()).unwrap();
            Reader::with_ready_wait(Duration::from_secs(20))
                .read(&p, "t0", &mut out)
                .map(|()| out)
        }
    });
    start.recv().unwrap();
    // Still unwritten while the reader reads: a short read now is refused, not given zeros.
    let mut early = vec![0u8; 10_000];
    let e = Reader::with_ready_wait(Duration::from_millis(50))
        .read(&p, "t0", &mut early)
        .unwrap_err();
    assert!(matches!(e, Error::NotReady { .. }), "{e}");
    write(&p);
    w.finish_writes(keys(std::slice::from_ref(&p)), true);
    let out = reader.join().unwrap().unwrap();
    // The waiting reader got the bytes written, never what was there before.
    let want: Vec<u8> = (0..10_000).map(|j| pattern("a", "t0", j)).collect();
    assert!(
        out == want,
        "the waiting reader read bytes that were not the object's"
    );
    verify(&p);
    assert_eq!(word(&p), stamp);
    let (s, _) = w.wait_for(Duration::from_secs(5), |s| s.written_objects == 1);
    assert_eq!((s.written_objects, s.failed_writes), (1, 0));
}

#[test]
fn a_reader_gives_up_at_its_deadline_saying_why_and_a_failed_write_fails_readers_and_frees_the_space(
) {
    let w = Writer::start(&config(1 << 20, Duration::from_secs(2))).unwrap();
    let p = publish(&w, vec![reserved("b", 4096)]).remove(0);
    let mut out = vec![0u8; 4096];
    let t0 = Instant::now();
    let e = Reader::with_ready_wait(Duration::from_millis(300))
        .read(&p, "t0", &mut out)
        .unwrap_err();
    assert!(t0.elapsed() >= Duration::from_millis(300));
    assert!(matches!(e, Error::NotReady { .. }), "{e}");
    assert!(
        e.to_string().contains("SGLANG_SPEC_CAPTURE_READY_WAIT_S"),
        "{e}"
    );
    // The per-store table of a stats answer lists it while it is being written...
    let control = w.arena_ref().control.clone();
    let table = || {
        capture_arena::client::StatsQuery::connect(&control, None, Duration::from_secs(2))
            .unwrap()
            .ask()
            .unwrap()
            .stores
    };
    assert_eq!(table()[0].objects, 1);
    // The write fails: readers are told so at once, and the space is free again.
    w.finish_writes(keys(std::slice::from_ref(&p)), false);
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.failed_writes == 1);
    assert!(ok, "{s:?}");
    assert_eq!((s.resident_objects, s.free_bytes), (0, s.capacity), "{s:?}");
    // Every byte published is accounted for: resident = published - freed - replaced - expired
    // - failed writes'.
    assert_eq!(s.failed_write_bytes, 4096);
    assert_eq!(
        s.published_bytes
            - s.freed_bytes
            - s.replaced_bytes
            - s.expired_bytes
            - s.failed_write_bytes,
        0,
        "{s:?}"
    );
    // ... and no longer once the table is made again (at most once a second).
    let deadline = Instant::now() + Duration::from_secs(5);
    while !table().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the stats table still lists the failed object"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(word(&p), p.features["t0"].stamp.unwrap() | FAILED_BIT);
    let t0 = Instant::now();
    let e = Reader::new().read(&p, "t0", &mut out).unwrap_err();
    assert!(matches!(e, Error::WriteFailed { .. }), "{e}");
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "failed at once, not at the deadline"
    );
}

#[test]
fn a_free_while_the_bytes_are_written_waits_for_the_write_so_the_space_is_never_placed_twice() {
    // An arena with room for one 600 KiB object.
    let w = Writer::start(&config(1 << 20, Duration::from_secs(30))).unwrap();
    let p = publish(&w, vec![reserved("c", 600 << 10)]).remove(0);
    // The trainer frees it before its bytes are written: the space stays the writer's.
    free(&w.arena_ref().control, &keys(std::slice::from_ref(&p)));
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.freed_objects == 1);
    assert!(ok, "{s:?}");
    assert_eq!(
        s.resident_objects, 1,
        "freed only once its write is finished"
    );
    // A batch that needs that space waits for it.
    let next = w.submit(vec![sample("d", &[600 << 10])]).unwrap();
    let (s, waits) = w.wait_for(Duration::from_secs(5), |s| s.waiting_bytes > 0);
    assert!(
        waits,
        "the batch was placed over bytes still being written: {s:?}"
    );
    assert_eq!(s.published_batches, 1, "{s:?}");
    write(&p); // the submitter finishes writing where it was told
    w.finish_writes(keys(&[p]), true);
    let r = next.wait().unwrap();
    verify(&r[0]);
    let (s, _) = w.wait_for(Duration::from_secs(5), |s| s.published_batches == 2);
    assert_eq!((s.resident_objects, s.written_objects), (1, 1), "{s:?}");
}

#[test]
fn a_batch_may_not_mix_reserved_tensors_with_bytes_to_copy_nor_replace_an_object_being_written() {
    let w = Writer::start(&config(1 << 20, Duration::from_secs(2))).unwrap();
    let mut mixed = reserved("m", 100);
    mixed
        .push(Tensor::new("t1", vec![4], Dtype::Uint8, TensorData::host(vec![1u8; 4])).unwrap())
        .unwrap();
    let e = w.submit(vec![mixed]).unwrap().wait().unwrap_err();
    assert!(e.to_string().contains("mixes reserved tensors"), "{e}");
    let p = publish(&w, vec![reserved("r", 100)]).remove(0);
    let again = reserved("r", 100).with_replace(true);
    let e = w.submit(vec![again]).unwrap().wait().unwrap_err();
    assert!(matches!(e, Error::KeyExists { .. }), "{e}");
    w.finish_writes(keys(&[p]), false);
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.failed_writes == 1);
    assert!(ok && s.resident_objects == 0, "{s:?}");
}

#[test]
fn a_reserved_batch_that_replaces_counts_what_it_replaced() {
    // The stats' rule: resident = published - freed - replaced - expired - failed writes'. A
    // reserved batch with replace took the old objects out and counted none of them replaced
    // (resident read 200 bytes by that rule, 100 in the arena).
    let w = Writer::start(&config(1 << 20, Duration::from_secs(2))).unwrap();
    let first = publish(&w, vec![reserved("r", 100)]).remove(0);
    write(&first);
    w.finish_writes(keys(std::slice::from_ref(&first)), true);
    let (_, ok) = w.wait_for(BOUND, |s| s.written_objects == 1);
    assert!(ok);
    let again = publish(&w, vec![reserved("r", 100).with_replace(true)]).remove(0);
    write(&again);
    w.finish_writes(keys(&[again]), true);
    let (s, ok) = w.wait_for(BOUND, |s| s.written_objects == 2);
    assert!(ok, "{s:?}");
    assert_eq!((s.replaced_objects, s.resident_objects), (1, 1), "{s:?}");
    let objects = s.published_objects
        - s.freed_objects
        - s.replaced_objects
        - s.expired_objects
        - s.failed_writes;
    let bytes = s.published_bytes
        - s.freed_bytes
        - s.replaced_bytes
        - s.expired_bytes
        - s.failed_write_bytes;
    assert_eq!((objects, bytes), (1, 100), "{s:?}");
}

#[test]
fn a_request_failed_by_its_keys_fails_only_the_samples_its_stamps_name() {
    // A paged copy failed by its keys (the table did not vouch for its destinations) fails the
    // objects of the samples it names with one of its own stamps, all of them (one of its
    // stamps may be wrong), and nothing of another sample whose key it was handed (before:
    // every key it held, once one matched: here c's object, under its own copy).
    let w = Writer::start(&config(1 << 20, Duration::from_secs(2))).unwrap();
    let two = |id: &str| {
        let mut s = Sample::new("st", id, 1).unwrap();
        for name in ["t0", "t1"] {
            s.push(Tensor::new(name, vec![64], Dtype::Uint8, TensorData::Reserved(64)).unwrap())
                .unwrap();
        }
        s
    };
    let got = publish(&w, vec![two("c"), two("d")]);
    let (c, d) = (&got[0], &got[1]);
    let key = |p: &Published, name: &str| format!("st/{}/g1/{name}", p.sample_id);
    let stamp = |p: &Published, name: &str| p.features[name].stamp.unwrap();
    // d's two keys and c's t1, with d's t0 stamp and a wrong one.
    w.fail_writes_of(
        vec![key(d, "t0"), key(d, "t1"), key(c, "t1")],
        vec![stamp(d, "t0"), 1],
    );
    // Another's keys with stamps of nothing being written: nothing is failed.
    w.fail_writes_of(vec![key(c, "t0")], vec![stamp(d, "t1") + 1_000_000]);
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.failed_writes == 2);
    assert!(ok, "{s:?}");
    let words = |p: &Published| {
        ["t0", "t1"].map(|name| {
            let f = &p.features[name];
            let at = f.address + f.byte_len().unwrap().div_ceil(8) * 8;
            // SAFETY: the object's aligned stamp word, inside this process's mapping.
            u64::from_le(unsafe { std::ptr::read_volatile(at as *const u64) })
        })
    };
    assert!(
        words(d).iter().all(|w| w & FAILED_BIT != 0),
        "{:?}",
        words(d)
    );
    assert_eq!(
        words(c),
        [stamp(c, "t0") | PENDING_BIT, stamp(c, "t1") | PENDING_BIT]
    );
    w.finish_writes_stamped(
        vec![
            (key(c, "t0"), stamp(c, "t0")),
            (key(c, "t1"), stamp(c, "t1")),
        ],
        true,
    );
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.written_objects == 2);
    assert!(ok && s.failed_writes == 2, "{s:?}");
}
