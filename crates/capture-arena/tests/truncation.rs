//! An arena's shared-memory object truncated under its mappings by another process of the same
//! user (the one thing its owner and mode checks cannot stop): the producer fails the batch it
//! was copying and every later one with an error saying so, and lives; a reader fails the read
//! as a stale session, and lives; a `SIGBUS` anywhere else still does what it did before.

mod util;

use std::fs::OpenOptions;
use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use capture_arena::memory::ShmSession;
use capture_arena::{Error, Reader, Writer};
use util::*;

fn truncate(session: &str) {
    let s: ShmSession = session.parse().unwrap();
    let path = format!("/dev/shm/{}", s.name);
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(0)
        .unwrap();
}

#[test]
fn a_producer_whose_arena_is_truncated_fails_its_batches_and_lives() {
    let w = Writer::start(&config(1 << 20, Duration::from_secs(1))).unwrap();
    let first = publish_one(&w, "before", &[4096, 100]);
    verify(&first);
    truncate(&first.arena.session);
    for id in ["during", "after"] {
        let e = w
            .submit(vec![sample(id, &[64 * 1024])])
            .unwrap()
            .wait()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("truncated by another process") && e.contains("restart the producer"),
            "{e}"
        );
    }
    // Nothing of them is resident; the writer still serves frees and stats.
    let s = w.stats();
    assert_eq!((s.failed_batches, s.resident_objects), (2, 2), "{s:?}");
    free(&first.arena.control, &keys(std::slice::from_ref(&first)));
    wait_freed(&w, 2);
}

#[test]
fn a_reader_of_a_truncated_arena_gets_a_stale_session_and_lives() {
    let w = Writer::start(&config(1 << 20, Duration::from_secs(1))).unwrap();
    let r = publish_one(&w, "read", &[8192]);
    let reader = Reader::new();
    let mut out = vec![0u8; 8192];
    reader.read(&r, "t0", &mut out).unwrap();
    // SAFETY: nothing frees or replaces this sample while the view lives.
    let view = unsafe { reader.view(&r, "t0") }.unwrap();
    view.check().unwrap();
    truncate(&r.arena.session);
    // The view now shows zeros, and says so when checked.
    let nonzero = view.iter().position(|&b| b != 0);
    assert_eq!(nonzero, None, "{:?}", view.check());
    assert!(matches!(view.check(), Err(Error::StaleSession { .. })));
    let e = reader.read(&r, "t0", &mut out).unwrap_err();
    assert!(matches!(e, Error::StaleSession { .. }), "{e}");
    assert!(e.to_string().contains("truncated"), "{e}");
    // And again: the session stays refused, nothing crashes.
    assert!(reader.read(&r, "t0", &mut out).is_err());
}

#[test]
fn a_sigbus_elsewhere_still_kills_the_process() {
    if std::env::var_os("CAPTURE_ARENA_SIGBUS_CHILD").is_some() {
        // The child: an arena (so the handler is installed), then a fault outside it.
        let _w = Writer::start(&config(1 << 20, Duration::from_secs(1))).unwrap();
        let f = tempfile_in_shm();
        f.set_len(4096).unwrap();
        // SAFETY: a fresh shared mapping of our own file; reading its first byte after the
        // file is truncated raises SIGBUS, which is what this child is for.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(&f),
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            f.set_len(0).unwrap();
            let b = std::ptr::read_volatile(p.cast::<u8>());
            eprintln!("read {b} past the end of a truncated file: SIGBUS was swallowed");
        }
        std::process::exit(0);
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_sigbus_elsewhere_still_kills_the_process",
            "--nocapture",
        ])
        .env("CAPTURE_ARENA_SIGBUS_CHILD", "1")
        .output()
        .unwrap();
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGBUS),
        "{:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A file in /dev/shm, already unlinked.
fn tempfile_in_shm() -> std::fs::File {
    let path = format!("/dev/shm/capture-arena-test-sigbus-{}", std::process::id());
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    f
}
