//! Threads that come back from native code while the interpreter exits.
//!
//! A call that released the GIL (a blocking submit, a read, creating an arena) and returns after
//! the interpreter began finalizing cannot take the GIL back: CPython ends such a thread with
//! `pthread_exit`, whose forced unwind through PyO3's frames aborts the process ("FATAL:
//! exception not rethrown"). So once `capture_arena`'s exit hook has run ([`_exiting`], after it
//! has waited for its own starter threads), every other thread that finishes such a call, and
//! the sink's helper thread, parks for good instead: the process is exiting, and a parked thread
//! costs nothing. The thread that runs the exit hook is never parked.
//!
//! A thread still *inside* native code when the process exits is in danger too: the exit runs
//! the libraries' static destructors under it (NIXL: "pure virtual method called"). So the exit
//! hook waits, up to [`EXIT_WAIT`], for the calls in flight to come back: a call counts until it
//! holds the GIL again, so one that comes back while the hook waits returns normally; one that
//! starts after the hook, or comes back after the hook gave up waiting, parks.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use pyo3::prelude::*;

/// The thread that ran the exit hook, once it has.
static EXITING: OnceLock<ThreadId> = OnceLock::new();

/// Calls of [`detach`] running now (from before the GIL is released to after it is taken back).
static IN_NATIVE: AtomicUsize = AtomicUsize::new(0);

/// The exit hook stopped waiting with calls still in flight: those park when they come back.
static GAVE_UP: AtomicBool = AtomicBool::new(false);

/// How long the exit waits for calls in flight (a blocking submit can wait for arena space for
/// `SGLANG_SPEC_CAPTURE_ARENA_WAIT_S`, a read for its timeout: the exit does not wait that long).
pub const EXIT_WAIT: Duration = Duration::from_secs(5);

/// Marks the interpreter as exiting (called from `capture_arena`'s exit hook, on the thread that
/// runs the exit), then waits (GIL released) up to [`EXIT_WAIT`] for other threads' calls into
/// native code to come back. Returns how many are still in flight.
#[pyfunction]
pub fn _exiting(py: Python<'_>) -> usize {
    let _ = EXITING.set(std::thread::current().id());
    let left = py.detach(|| {
        let deadline = Instant::now() + EXIT_WAIT;
        while IN_NATIVE.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        IN_NATIVE.load(Ordering::SeqCst)
    });
    if left > 0 {
        GAVE_UP.store(true, Ordering::SeqCst);
    }
    left
}

/// In a process just forked: the calls in flight were the parent's threads', which the child
/// does not have, so none is waited for at its exit (called from `capture_arena`'s fork hook).
#[pyfunction]
pub fn _forked_child() {
    IN_NATIVE.store(0, Ordering::SeqCst);
}

/// True once the exit hook has run on another thread.
fn exiting_elsewhere() -> bool {
    EXITING
        .get()
        .is_some_and(|t| *t != std::thread::current().id())
}

fn park_forever() -> ! {
    loop {
        std::thread::park();
    }
}

/// Parks the calling thread for good if the interpreter is exiting and it is not the exiting
/// thread.
pub fn park_if_exiting() {
    if exiting_elsewhere() {
        park_forever();
    }
}

/// A call counted in [`IN_NATIVE`] until [`Counted::release`] or its drop: a call that unwinds
/// (a panic, which PyO3 turns into `PanicException`) is not counted in flight for ever, which
/// would hold the exit hook for all of [`EXIT_WAIT`].
struct Counted(AtomicBool);

impl Counted {
    fn new() -> Self {
        IN_NATIVE.fetch_add(1, Ordering::SeqCst);
        Counted(AtomicBool::new(false))
    }

    fn release(&self) {
        if !self.0.swap(true, Ordering::SeqCst) {
            IN_NATIVE.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.release();
    }
}

/// `py.detach(f)`, safe against the interpreter's exit (see the module docs).
pub fn detach<T, F>(py: Python<'_>, f: F) -> T
where
    F: Send + FnOnce() -> T,
    T: Send,
{
    // Counted before the check, so the exit hook either waits for this call or it parks.
    let counted = Counted::new();
    let held = &counted;
    py.detach(move || {
        if exiting_elsewhere() {
            held.release();
            park_forever();
        }
        let out = f();
        if GAVE_UP.load(Ordering::SeqCst) {
            park_if_exiting();
        }
        out
    })
    // `counted` is dropped here, with the GIL held again.
}

/// `Python::attach(f)` for a thread of ours that Python did not start (the sink's helper), safe
/// against the interpreter's exit: counted as in flight from before it asks for the GIL until it
/// has given it back, so the exit hook waits for it (up to [`EXIT_WAIT`]); once the hook has run
/// the thread parks instead of attaching. Checked only before attaching, a burst that began as
/// the exit hook gave the GIL up ran Python (a TransferEngine's destructor, which gives the GIL
/// up and takes it back) into the interpreter's finalization: "PyGILState_Release: thread state
/// must be current", an abort.
pub fn attach<T>(f: impl for<'py> FnOnce(Python<'py>) -> T) -> T {
    // Counted before the check, so the exit hook either waits for this call or it parks.
    let counted = Counted::new();
    if exiting_elsewhere() {
        counted.release();
        park_forever();
    }
    Python::attach(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call that unwinds (a panic, as PyO3 turns into `PanicException`) leaves the count of
    /// calls in flight as it found it, and a call released early (it parks) is not uncounted
    /// twice: otherwise the exit hook would wait all of [`EXIT_WAIT`] for a call long gone, or
    /// not wait for one still running.
    #[test]
    fn a_call_that_unwinds_or_parks_is_uncounted_exactly_once() {
        let before = IN_NATIVE.load(Ordering::SeqCst);
        let unwound = std::panic::catch_unwind(|| {
            let _counted = Counted::new();
            assert_eq!(IN_NATIVE.load(Ordering::SeqCst), before + 1);
            panic!("a bug of ours in native code");
        });
        assert!(unwound.is_err());
        assert_eq!(IN_NATIVE.load(Ordering::SeqCst), before);

        let outer = Counted::new(); // another call in flight meanwhile
        let parked = Counted::new();
        parked.release();
        drop(parked);
        assert_eq!(IN_NATIVE.load(Ordering::SeqCst), before + 1);
        drop(outer);
        assert_eq!(IN_NATIVE.load(Ordering::SeqCst), before);
    }
}
