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
        let (p, _f) = truncated_page();
        // SAFETY: reading a truncated page: its SIGBUS is what this child is for.
        let b = unsafe { std::ptr::read_volatile(p) };
        eprintln!("read {b} past the end of a truncated file: SIGBUS was swallowed");
        std::process::exit(0);
    }
    let (status, err) = child("a_sigbus_elsewhere_still_kills_the_process", "1");
    assert_eq!(status.signal(), Some(libc::SIGBUS), "{status:?}\n{err}");
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

/// The action a handler installed after ours replaced (for the faulthandler-like one).
static mut REPLACED: Option<libc::sigaction> = None;
/// Whether the faulthandler-like handler is still enabled (it disables itself when it fires).
static ENABLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// As torch's DataLoader worker loop's (`torch/csrc/DataLoader.cpp`, `handler_SIGBUS`): says
/// so, restores the default action and kills its own process with the signal.
extern "C" fn like_torch(_: libc::c_int) {
    let msg = b"like torch: unexpected bus error in worker\n";
    // SAFETY: write, sigaction, kill and getpid are async-signal-safe.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
        libc::kill(libc::getpid(), libc::SIGBUS);
    }
}

/// As CPython's faulthandler (`Modules/faulthandler.c`, `faulthandler_fatal_error`): once
/// disabled it returns at once; else it disables itself, says so, restores the action it
/// replaced and raises the signal again.
extern "C" fn like_faulthandler(sig: libc::c_int) {
    if !ENABLED.swap(false, std::sync::atomic::Ordering::SeqCst) {
        return;
    }
    let msg = b"like faulthandler: Fatal Python error: Bus error\n";
    // SAFETY: write, sigaction and raise are async-signal-safe; REPLACED was set before this
    // handler was installed and is not written after.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
        if let Some(a) = *std::ptr::addr_of!(REPLACED) {
            libc::sigaction(libc::SIGBUS, &a, std::ptr::null_mut());
        }
        libc::raise(sig);
    }
}

/// As a disabled faulthandler (or a crash reporter declining a fault): returns, mending nothing.
extern "C" fn returns_at_once(_: libc::c_int) {}

/// The range the guard-like handler looks after (set before it is installed).
static GUARDED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// As another library's guard of its own mappings (as ours): a fault in its page gets a
/// private zero page there and the access goes on; it passes anything else to nobody (dies).
extern "C" fn like_a_guard(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo; mmap and the atomics are async-signal-safe.
    unsafe {
        let addr = (*info).si_addr() as usize;
        let page = GUARDED.load(std::sync::atomic::Ordering::SeqCst);
        if page != 0 && (page..page + 4096).contains(&addr) {
            let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED;
            libc::mmap(
                page as *mut libc::c_void,
                4096,
                libc::PROT_READ,
                flags,
                -1,
                0,
            );
            let msg = b"like a guard: caught\n";
            libc::write(2, msg.as_ptr().cast(), msg.len());
            return;
        }
        libc::_exit(3);
    }
}

/// A page of a shared mapping of an unlinked file in /dev/shm, which is then truncated: reading
/// it raises SIGBUS. The file is returned with it (it must outlive the mapping's use).
fn truncated_page() -> (*const u8, std::fs::File) {
    let f = tempfile_in_shm();
    f.set_len(4096).unwrap();
    // SAFETY: a fresh shared mapping of our own file.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ,
            libc::MAP_SHARED,
            std::os::fd::AsRawFd::as_raw_fd(&f),
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    f.set_len(0).unwrap();
    (p.cast::<u8>().cast_const(), f)
}

/// Runs this test binary's test `name` as a child with `CAPTURE_ARENA_SIGBUS_CHILD=mode`; its
/// status and stderr, or a panic if it has not ended within 20 s (a handler loop spins).
fn child(name: &str, mode: &str) -> (std::process::ExitStatus, String) {
    let mut c = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture"])
        .env("CAPTURE_ARENA_SIGBUS_CHILD", mode)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = c.try_wait().unwrap() {
            remove_arenas_of(c.id());
            let mut err = String::new();
            std::io::Read::read_to_string(&mut c.stderr.take().unwrap(), &mut err).unwrap();
            return (status, err);
        }
        if std::time::Instant::now() > deadline {
            let _ = c.kill();
            let _ = c.wait();
            remove_arenas_of(c.id());
            panic!("the child ({mode}) did not end within 20 s: a SIGBUS handler loops");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Removes what a child that died (by a signal, or `exit` without dropping its writer) left in
/// /dev/shm: its arena, which a later producer's sweep would remove otherwise.
fn remove_arenas_of(pid: u32) {
    let prefix = format!("capture-arena-{pid}-");
    for e in std::fs::read_dir("/dev/shm").unwrap().flatten() {
        if e.file_name().to_string_lossy().starts_with(&prefix) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

#[test]
fn a_handler_installed_after_ours_is_put_behind_it_at_the_next_mapping() {
    // torch's DataLoader workers install their SIGBUS handler over ours: before, a truncation
    // under a worker's arena mapping went to that handler, which kills the worker. Ours goes
    // back in front at the next mapping and passes every other fault on to it.
    const NAME: &str = "a_handler_installed_after_ours_is_put_behind_it_at_the_next_mapping";
    if let Some(mode) = std::env::var_os("CAPTURE_ARENA_SIGBUS_CHILD") {
        let w = Writer::start(&config(1 << 20, Duration::from_secs(1))).unwrap();
        let r = publish_one(&w, "worker", &[8192]);
        // The handler of a DataLoader worker, installed after ours (the producer's mapping).
        // SAFETY: installs a handler that is async-signal-safe; REPLACED is written before.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = match mode.to_str() {
                Some("torch") => like_torch as *const () as usize,
                Some("guard") => like_a_guard as *const () as usize,
                Some("returns") => returns_at_once as *const () as usize,
                _ => like_faulthandler as *const () as usize,
            };
            if mode == "guard" {
                action.sa_flags = libc::SA_SIGINFO;
            }
            libc::sigemptyset(&mut action.sa_mask);
            let mut replaced: libc::sigaction = std::mem::zeroed();
            assert_eq!(libc::sigaction(libc::SIGBUS, &action, &mut replaced), 0);
            *std::ptr::addr_of_mut!(REPLACED) = Some(replaced);
        }
        // The worker's reader maps the arena, which is then truncated under it.
        let reader = Reader::new();
        let mut out = vec![0u8; 8192];
        reader.read(&r, "t0", &mut out).unwrap();
        truncate(&r.arena.session);
        let e = reader.read(&r, "t0", &mut out).unwrap_err();
        assert!(matches!(e, Error::StaleSession { .. }), "{e}");
        eprintln!("the worker lives: {e}");
        if mode == "guard" {
            // A handler that handles its own faults and returns keeps getting them: twice.
            for _ in 0..2 {
                let (p, _f) = truncated_page();
                GUARDED.store(p as usize, std::sync::atomic::Ordering::SeqCst);
                // SAFETY: reading a truncated page: its SIGBUS is what this child is for.
                let b = unsafe { std::ptr::read_volatile(p) };
                assert_eq!(b, 0);
            }
            std::process::exit(0);
        }
        // A fault anywhere else still goes to the worker's handler, and kills it.
        let (p, _f) = truncated_page();
        // SAFETY: reading a truncated page: its SIGBUS is what this child is for.
        let b = unsafe { std::ptr::read_volatile(p) };
        eprintln!("read {b} past the end of a truncated file: SIGBUS was swallowed");
        std::process::exit(0);
    }
    for (mode, said) in [
        ("torch", "like torch: unexpected bus error"),
        ("faulthandler", "like faulthandler: Fatal Python error"),
    ] {
        let (status, err) = child(NAME, mode);
        assert!(
            err.contains("the worker lives"),
            "{mode}: {status:?}\n{err}"
        );
        assert_eq!(
            status.signal(),
            Some(libc::SIGBUS),
            "{mode}: {status:?}\n{err}"
        );
        assert_eq!(err.matches(said).count(), 1, "{mode}: {err}");
    }
    // One that returns without mending a fault outside our ranges (a disabled faulthandler):
    // before, the access faulted again and again, each fault passed to it, for good.
    let (status, err) = child(NAME, "returns");
    assert!(err.contains("the worker lives"), "{status:?}\n{err}");
    assert_eq!(status.signal(), Some(libc::SIGBUS), "{status:?}\n{err}");
    // Another guard that handles its faults and returns is never dropped from the chain.
    let (status, err) = child(NAME, "guard");
    assert!(err.contains("the worker lives"), "{status:?}\n{err}");
    assert_eq!(status.code(), Some(0), "{status:?}\n{err}");
    assert_eq!(err.matches("like a guard: caught").count(), 2, "{err}");
}

/// As a handler that fails a system call (and so sets `errno`) and returns.
extern "C" fn sets_errno(_: libc::c_int) {
    // SAFETY: __errno_location is this thread's errno.
    unsafe { *libc::__errno_location() = libc::EAGAIN };
}

#[test]
fn the_interrupted_code_finds_errno_as_it_left_it_after_ours_passed_a_signal_on() {
    if std::env::var_os("CAPTURE_ARENA_SIGBUS_CHILD").is_some() {
        // A handler installed before ours, which ours passes a SIGBUS outside its ranges to.
        // SAFETY: a plain handler of our own, installed before any thread of ours runs one.
        unsafe {
            let mut a: libc::sigaction = std::mem::zeroed();
            a.sa_sigaction = sets_errno as *const () as usize;
            libc::sigemptyset(&mut a.sa_mask);
            assert_eq!(libc::sigaction(libc::SIGBUS, &a, std::ptr::null_mut()), 0);
        }
        let _w = Writer::start(&config(1 << 20, Duration::from_secs(1))).unwrap();
        // SAFETY: errno is this thread's; raise sends this thread a SIGBUS, which ours hands
        // on to the handler above (it is outside every arena) and returns.
        let after = unsafe {
            *libc::__errno_location() = libc::EINTR;
            assert_eq!(libc::raise(libc::SIGBUS), 0);
            *libc::__errno_location()
        };
        if after != libc::EINTR {
            eprintln!(
                "errno was {} before the signal and {after} after it",
                libc::EINTR
            );
            std::process::exit(1);
        }
        std::process::exit(0);
    }
    let (status, err) = child(
        "the_interrupted_code_finds_errno_as_it_left_it_after_ours_passed_a_signal_on",
        "errno",
    );
    assert!(status.success(), "{status:?}\n{err}");
}
