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
    assert_eq!(results[0].arena, w.arena_ref());
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
        e.to_string()
            .contains("SGLANG_SPEC_CAPTURE_GPU_PUT off (0, false, no or off)"),
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
    let second = w.submit(vec![sample("b", &[48 * KIB])]).unwrap();
    // The free comes from another thread once the batch is seen waiting for it.
    let (s, waiting) = w.wait_for(Duration::from_secs(10), |s| s.waiting_bytes > 0);
    assert!(waiting, "the batch never waited: {s:?}");
    // What it needs (its 48 KiB, aligned, with its stamp) is more than is free.
    assert!(
        s.waiting_bytes >= (48 * KIB) as u64 && s.waiting_bytes > s.free_bytes,
        "{s:?}"
    );
    std::thread::spawn(move || free(&control, &ks))
        .join()
        .unwrap();
    let second = second.wait().unwrap();
    verify(&second[0]);
    let s = w.stats();
    assert_eq!(
        (s.waits, s.freed_objects, s.failed_batches, s.waiting_bytes),
        (1, 1, 0, 0)
    );
    assert!(s.wait_ns > 0, "{s:?}");
}

#[test]
fn a_batch_that_never_fits_in_time_fails_with_the_hint_and_leaves_nothing() {
    let w = Writer::start(&config(64 * KIB as u64, Duration::from_millis(200))).unwrap();
    w.submit(vec![sample("a", &[40 * KIB - STAMP])])
        .unwrap()
        .wait()
        .unwrap();
    let before = w.stats();
    let t0 = Instant::now();
    let results = w
        .submit(vec![
            sample("b", &[8 * KIB - STAMP]),
            sample("c", &[20 * KIB - STAMP]),
        ])
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
            "too small",
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
fn a_full_error_tells_fragmented_from_too_small() {
    // Four 16 KiB objects (with their stamps) fill 64 KiB; freeing the 1st and 3rd leaves 32 KiB free in two
    // pieces that do not touch: a 24 KiB object fits in neither.
    let w = Writer::start(&config(64 * KIB as u64, Duration::from_millis(200))).unwrap();
    let rs: Vec<_> = ["a", "b", "c", "d"]
        .iter()
        .map(|id| publish_one(&w, id, &[16 * KIB - STAMP]))
        .collect();
    free(&rs[0].arena.control, &keys(&[rs[0].clone(), rs[2].clone()]));
    wait_freed(&w, 2);
    let e = w
        .submit(vec![sample("big", &[24 * KIB - STAMP])])
        .unwrap()
        .wait()
        .unwrap_err()
        .to_string();
    for needle in [
        "32768 of 65536 bytes are free",
        "largest free extent 16384",
        "fragmented",
    ] {
        assert!(e.contains(needle), "{e:?} lacks {needle:?}");
    }
}

#[test]
fn a_batch_larger_than_the_arena_fails_at_once() {
    let w = Writer::start(&config(64 * KIB as u64, Duration::from_secs(30))).unwrap();
    let t0 = Instant::now();
    let e = w
        .submit(vec![
            sample("a", &[40 * KIB - STAMP]),
            sample("b", &[40 * KIB - STAMP]),
        ])
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
    let old = w
        .submit(vec![sample("r", &[1000])])
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
    // The replaced copy's result is refused (its stamp zeroed, or its space now the new
    // copy's, with another stamp), never read as the new one.
    let mut buf = vec![0u8; 1000];
    let e = capture_arena::Reader::new()
        .read(&old[0], "t0", &mut buf)
        .unwrap_err();
    assert!(matches!(e, Error::Changed { .. }), "{e}");
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
        // "b" still waits for the free below, so "e" cannot have been taken yet.
        let (st, _) = w.wait_for(Duration::from_secs(5), |s| s.waiting_bytes > 0);
        assert!(
            !blocked.is_finished(),
            "no room until a batch completes: {st:?}"
        );
        free(&control, &ks);
        blocked.join().unwrap().unwrap();
    });
    for h in [hb, hc] {
        h.wait().unwrap();
    }
    assert_eq!(w.stats().published_batches, 4);
}

#[test]
fn dropping_the_writer_finishes_queued_batches() {
    let w = Writer::start(&config(1 << 20, Duration::from_secs(1))).unwrap();
    let h = w.submit(vec![sample("a", &[10])]).unwrap();
    drop(w);
    // Queued work is finished before the thread stops.
    assert!(h.wait().is_ok());
}

#[test]
fn a_completion_runs_once_for_an_accepted_batch_and_never_for_a_refused_one() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let c = Config {
        max_pending_batches: 1,
        ..config(64 * KIB as u64, Duration::from_secs(20))
    };
    let w = Writer::start(&c).unwrap();
    let first = w
        .submit(vec![sample("a", &[60 * KIB])])
        .unwrap()
        .wait()
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = |calls: &Arc<AtomicUsize>| {
        let c = calls.clone();
        move |_: capture_arena::writer::Outcome| {
            c.fetch_add(1, Ordering::SeqCst);
        }
    };
    // Accepted, and waits for space.
    w.try_submit_with(vec![sample("b", &[60 * KIB])], counted(&calls))
        .unwrap();
    // Refused: the queue holds one batch.
    let e = w
        .try_submit_with(vec![sample("c", &[1])], counted(&calls))
        .unwrap_err();
    assert!(matches!(e, Error::QueueFull { .. }), "{e}");
    // The accepted one completes once, when the writer stops (it never got space).
    drop(w);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    drop(first);
}

/// Bytes of an object's stamp: an object of `n * KIB - STAMP` bytes takes `n` KiB in the arena.
const STAMP: usize = capture_arena::sample::STAMP_BYTES as usize;

/// A device stand-in (there is no GPU here): a region whose copies complete on another thread
/// once the test opens `gate`, which then wakes the writer through its notifier, as a CUDA host
/// callback would.
mod fake_device {
    use std::sync::{Arc, Condvar, Mutex};

    use capture_arena::memory::{CopyOp, Notifier, Progress, Region};

    #[derive(Debug)]
    pub struct FakeDevice {
        pub bytes: Arc<Mutex<Vec<u8>>>,
        notifier: Option<Notifier>,
        /// `Some(false)` while a copy is in flight, `Some(true)` once it completed.
        pub done: Arc<Mutex<Option<bool>>>,
        /// Copies complete only once this is true.
        pub gate: Arc<(Mutex<bool>, Condvar)>,
    }

    impl FakeDevice {
        pub fn new() -> FakeDevice {
            FakeDevice {
                bytes: Arc::new(Mutex::new(vec![0u8; 1 << 20])),
                notifier: None,
                done: Arc::new(Mutex::new(None)),
                gate: Arc::new((Mutex::new(false), Condvar::new())),
            }
        }
    }

    impl Region for FakeDevice {
        fn len(&self) -> u64 {
            1 << 20
        }
        fn base_address(&self) -> u64 {
            0x1000_0000
        }
        fn session(&self) -> &str {
            "fake-device://test"
        }
        fn set_notifier(&mut self, n: Notifier) {
            self.notifier = Some(n);
        }
        fn set_word(&mut self, offset: u64, word: u64) {
            let mut b = self.bytes.lock().unwrap();
            b[offset as usize..offset as usize + 8].copy_from_slice(&word.to_le_bytes());
        }
        unsafe fn start(&mut self, ops: &[CopyOp<'_>]) -> capture_arena::Result<()> {
            // "Complete" on another thread, once the gate opens.
            let mut staged = Vec::new();
            for op in ops {
                staged.push((op.offset, op.data.len()));
            }
            let (done, n, bytes, gate) = (
                self.done.clone(),
                self.notifier.clone().expect("notifier set before copies"),
                self.bytes.clone(),
                self.gate.clone(),
            );
            *done.lock().unwrap() = Some(false);
            std::thread::spawn(move || {
                let (open, cv) = &*gate;
                drop(cv.wait_while(open.lock().unwrap(), |o| !*o).unwrap());
                let mut b = bytes.lock().unwrap();
                for (off, len) in staged {
                    b[off as usize..(off + len) as usize].fill(7);
                }
                *done.lock().unwrap() = Some(true);
                n.notify();
            });
            Ok(())
        }
        fn progress(
            &mut self,
            _ops: &[CopyOp<'_>],
            _budget: u64,
        ) -> capture_arena::Result<Progress> {
            match *self.done.lock().unwrap() {
                Some(true) => Ok(Progress::Done),
                _ => Ok(Progress::Waiting),
            }
        }
        fn clear(&mut self, offset: u64, len: u64) {
            self.bytes.lock().unwrap()[offset as usize..(offset + len) as usize].fill(0);
        }
    }
}

#[test]
fn a_region_that_completes_later_is_committed_only_then_and_frees_flow_meanwhile_with_a_fake_device(
) {
    let region = fake_device::FakeDevice::new();
    let (bytes, done, gate) = (
        region.bytes.clone(),
        region.done.clone(),
        region.gate.clone(),
    );
    {
        // The first batch's copy completes at once.
        *gate.0.lock().unwrap() = true;
    }
    let w = Writer::start_with_region(&config(1 << 20, Duration::from_secs(5)), Box::new(region))
        .unwrap();
    let first = w
        .submit(vec![sample("a", &[1000])])
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(first[0].arena.session, "fake-device://test");
    // While the second batch's copy is in flight (held there until the gate opens), a free of the
    // first is applied.
    *gate.0.lock().unwrap() = false;
    let h = w.submit(vec![sample("b", &[2000])]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while *done.lock().unwrap() != Some(false) {
        assert!(Instant::now() < deadline, "the second copy never started");
        std::thread::yield_now();
    }
    free(&w.arena_ref().control, &keys(&first));
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.freed_objects == 1);
    assert!(ok, "{s:?}");
    assert_eq!(
        s.published_batches, 1,
        "the free was applied while the batch's copy was in flight (not committed yet)"
    );
    *gate.0.lock().unwrap() = true;
    gate.1.notify_all();
    let second = h.wait().unwrap();
    let off = (second[0].features["t0"].address - 0x1000_0000) as usize;
    assert!(bytes.lock().unwrap()[off..off + 2000]
        .iter()
        .all(|&b| b == 7));
    assert_eq!(w.stats().published_batches, 2);
}

/// Device publication on a machine without a CUDA driver (or in a build without the `cuda`
/// feature) fails when the arena is asked for, with an error that says what to change, and
/// never panics.
#[test]
fn device_publication_without_a_cuda_driver_is_a_clear_error() {
    let c = Config {
        gpu_put: Some(true),
        ..config(1 << 20, Duration::ZERO)
    };
    // The sink is made (lazily) without touching the driver.
    let sink = Sink::new(c.clone()).unwrap();
    #[cfg(feature = "cuda")]
    if let Ok(info) = capture_arena::memory::cuda::driver() {
        eprintln!(
            "skipped: a CUDA driver is present ({}, {} devices); this test needs a machine \
             without one",
            info.library, info.devices
        );
        return;
    }
    let e = sink.writer().unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, capture_arena::Error::Device { .. }), "{text}");
    if cfg!(feature = "cuda") {
        assert!(
            text.contains("no CUDA driver library") && text.contains("SGLANG_SPEC_CAPTURE_GPU_PUT"),
            "{text}"
        );
    } else {
        assert!(text.contains("--features cuda"), "{text}");
    }
    assert!(Writer::start(&c).is_err());
}

/// The engine placement's path: the writer publishes into memory someone else owns (here a
/// leaked buffer standing in for a TransferEngine's registered one), under that owner's session,
/// at addresses that are this process's virtual addresses.
#[test]
fn a_sink_publishes_into_memory_someone_else_owns() {
    let mem: &'static mut [u8] = Box::leak(vec![0u8; 1 << 20].into_boxed_slice());
    let ptr = mem.as_mut_ptr();
    let sink = Sink::new(config(1 << 20, Duration::from_secs(1))).unwrap();
    // SAFETY: the leaked buffer lives for the process and nothing else touches it while the
    // writer holds it; this test reads it only after the batch completed.
    let region = unsafe {
        capture_arena::memory::ExternalHostRegion::new(ptr, 1 << 20, "127.0.0.1:15051".into(), ())
    }
    .unwrap();
    let w = sink.start_with_region(Box::new(region)).unwrap();
    assert_eq!(w.arena_ref().session, "127.0.0.1:15051");
    let r = sink
        .submit(vec![sample("x", &[1000, 3])])
        .unwrap()
        .wait()
        .unwrap()
        .remove(0);
    for (name, f) in &r.features {
        let n = f.shape[0] as usize;
        let at = (f.address - ptr as u64) as usize;
        assert!(at + n <= 1 << 20);
        // SAFETY: inside the leaked buffer; the writer wrote it before answering and writes it
        // again only for later batches (there are none).
        let got = unsafe { std::slice::from_raw_parts(ptr.add(at), n) };
        let want: Vec<u8> = (0..n).map(|j| util::pattern("x", name, j)).collect();
        assert_eq!(got, &want[..], "{name}");
    }
    // Only before the first capture.
    // SAFETY: refused before use.
    let again = unsafe {
        capture_arena::memory::ExternalHostRegion::new(ptr, 1 << 20, "other:1".into(), ())
    }
    .unwrap();
    let e = sink.start_with_region(Box::new(again)).unwrap_err();
    assert!(e.to_string().contains("started already"), "{e}");
}

#[test]
fn the_engine_placement_needs_memory_from_its_engine() {
    let c = Config {
        placement: Some(capture_arena::Placement::Engine),
        ..config(1 << 20, Duration::ZERO)
    };
    let e = Writer::start(&c).unwrap_err().to_string();
    assert!(
        e.contains("SGLANG_SPEC_CAPTURE_PLACEMENT") && e.contains("start_with_region"),
        "{e}"
    );
    // A sink with it starts nothing eagerly: its arena comes with start_with_region.
    let sink = Sink::new(Config { eager: true, ..c }).unwrap();
    assert!(sink.started().is_none());
}

#[test]
fn a_restarted_producer_does_not_repeat_its_predecessors_stamps() {
    // docs/placements.md, "Stamps": a producer's stamps start at random, so a trainer holding a
    // result of a producer restarted over the same memory (an engine or device arena may come
    // back at the same addresses) never finds that result's stamp on the new producer's objects.
    // Two producers in turn publish the same sample into arenas of the same size.
    let first_stamp = || {
        let w = Writer::start(&config(1 << 20, Duration::from_secs(1))).unwrap();
        let r = w.submit(vec![sample("a", &[100])]).unwrap().wait().unwrap();
        r[0].features["t0"].stamp.unwrap()
    };
    let (before, after) = (first_stamp(), first_stamp());
    assert_ne!(
        before, after,
        "the restarted producer's first stamp is its predecessor's"
    );
    assert!(before >= 1 && after >= 1);
}
