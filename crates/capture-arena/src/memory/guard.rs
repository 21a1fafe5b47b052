//! Surviving a shared-memory object truncated under its mappings.
//!
//! Any process of the same user can `ftruncate` an arena's `/dev/shm` object. Every mapping of
//! it then raises `SIGBUS` on the next touch of a page past the new end: without this module,
//! that kills the inference server in the middle of a copy (or a trainer in the middle of a
//! read). Each [`Mapping`](super::Mapping) of shared memory registers its range here; a
//! process-wide `SIGBUS` handler, installed once, recognises a fault inside a registered range,
//! maps private zero pages from the faulting page to the range's end (so the interrupted copy
//! completes, into memory nobody else sees), and marks the range lost. The mapping's owner checks
//! [`Watch::lost`] after every copy and fails it with a clear error: the writer fails the batch
//! (nothing is published from a lost region, and every later batch fails the same way), a reader
//! fails the read as a stale session. A `SIGBUS` anywhere else goes to the handler that was
//! installed before (or the default action: the process dies as it would have).
//!
//! A handler installed after this one (torch's DataLoader workers install their own, Python's
//! `faulthandler.enable()` does) is put behind it again at the next mapping: this one goes back
//! in front and passes every fault outside its ranges on to that handler. One that hands the
//! signal back (restores the handler it replaced, this one, and raises it again, as faulthandler
//! does) is done: the signal goes on to the handler before it, so two handlers never pass a
//! signal back and forth; one that returns without mending a fault (a disabled faulthandler),
//! so that the same thread faults at the same address again at once, is passed over for the
//! one below it.
//!
//! Limits: at most [`SLOTS`] ranges are watched at once (more are mapped unwatched, logged);
//! a handler installed after the last mapping takes precedence until the next one; at most
//! [`RETAKES`] times in a process is the handler put back in front.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::page::{page_size, page_start};

/// Ranges watched at once: a producer's arena, and a trainer's cached sessions (a reader keeps
/// up to 1024, `client::MAX_SESSIONS`, and a trainer may have several readers).
pub const SLOTS: usize = 4096;

/// Set once the slots ran out (said once, as a warning).
static RAN_OUT: AtomicBool = AtomicBool::new(false);

/// A slot being claimed or released (its range is not to be matched yet).
const BUSY: usize = usize::MAX;

/// One watched range. `gen` is a sequence lock: odd while the range is being set or cleared,
/// so the handler never matches a `start` of one registration with the `end` of another.
struct Slot {
    gen: AtomicUsize,
    start: AtomicUsize,
    end: AtomicUsize,
    /// The process that registered it: a forked child does not have the parent's arena mapping
    /// (`MADV_DONTFORK`), and whatever it maps there later is not ours.
    pid: AtomicUsize,
    lost: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Slot = Slot {
    gen: AtomicUsize::new(0),
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    pid: AtomicUsize::new(0),
    lost: AtomicBool::new(false),
};
static WATCHED: [Slot; SLOTS] = [EMPTY; SLOTS];

/// Whether the handler was installed (`false`: installing failed), once.
static INSTALLED: OnceLock<bool> = OnceLock::new();

/// An action ours passed faults outside its ranges on to, and the one before it.
struct Passed {
    action: libc::sigaction,
    below: *mut Passed,
}

/// The action ours passes faults outside its ranges on to (null: none yet): the one it replaced
/// when it was last put in front, above those it replaced before. Each is leaked, so the
/// handler may read it at any time; at most [`RETAKES`] + 1 are made.
static PREVIOUS: AtomicPtr<Passed> = AtomicPtr::new(std::ptr::null_mut());

/// Makes `action` the one ours passes faults on to, above the one it passed them to so far;
/// returns its node. A compare-and-swap: the handler may drop the top node meanwhile.
fn pass_on_to(action: libc::sigaction) -> *mut Passed {
    let top = Box::into_raw(Box::new(Passed {
        action,
        below: std::ptr::null_mut(),
    }));
    loop {
        let below = PREVIOUS.load(Ordering::Acquire);
        // SAFETY: `top` is ours alone until the swap below publishes it.
        unsafe { (*top).below = below };
        if PREVIOUS
            .compare_exchange(below, top, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            return top;
        }
    }
}

/// Drops `node` from the top, if it is still there: ours passes faults to the one below.
fn drop_top(node: *mut Passed) {
    // SAFETY: nodes are leaked, never freed or written once published.
    let below = unsafe { (*node).below };
    let _ = PREVIOUS.compare_exchange(node, below, Ordering::AcqRel, Ordering::Acquire);
}

/// Times a process puts the handler back in front of one installed after it, at most.
pub const RETAKES: usize = 64;

/// Times it did (a forked child counts on from its parent's).
static RETAKEN: AtomicUsize = AtomicUsize::new(0);

/// The process putting the handler in front now (0: none): one at a time, and a fork cannot
/// leave it held (a child sees its parent's pid and takes over).
static RETAKING: AtomicUsize = AtomicUsize::new(0);

/// The thread (its kernel id; 0: none) whose handler is running the one ours replaced: entered
/// again on that thread meanwhile, ours does the default action instead of passing the signal
/// on again. Per thread, so that another thread's fault meanwhile is passed on as usual.
static PASSING_ON: AtomicI64 = AtomicI64::new(0);

/// The thread, address and time (µs, monotonic) of the last fault passed on: the same thread
/// faulting at the same address again within [`AGAIN_WITHIN_US`] means the handler it was passed
/// to returned without mending it (a disabled faulthandler returns at once, and the access
/// faults again at once): that handler is dropped, so the fault goes below it rather than round
/// again for good.
static LAST_PASSED: (AtomicI64, AtomicUsize, AtomicU64) =
    (AtomicI64::new(0), AtomicUsize::new(0), AtomicU64::new(0));

/// See [`LAST_PASSED`]: a retried access faults again within microseconds.
const AGAIN_WITHIN_US: u64 = 50_000;

/// Microseconds on the monotonic clock. Async-signal-safe (`clock_gettime`).
fn now_us() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec, initialised here.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    (t.tv_sec as u64).saturating_mul(1_000_000) + (t.tv_nsec as u64) / 1000
}

/// This thread's kernel id. Async-signal-safe.
fn tid() -> i64 {
    // SAFETY: gettid takes no arguments and cannot fail.
    i64::from(unsafe { libc::syscall(libc::SYS_gettid) } as i32)
}

/// A watched range: lost once a `SIGBUS` in it was caught. Unwatched on drop (before the range is
/// unmapped, by the owner).
#[derive(Debug)]
pub struct Watch {
    slot: usize,
}

impl Watch {
    /// Watches `[start, start + len)`. `None` when every slot is taken or the handler could not
    /// be installed (the range is then mapped unwatched, as before).
    pub fn new(start: usize, len: usize) -> Option<Watch> {
        if !*INSTALLED.get_or_init(install) {
            return None;
        }
        in_front();
        let end = start.checked_add(len)?;
        for (i, s) in WATCHED.iter().enumerate() {
            if s.start
                .compare_exchange(0, BUSY, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                s.gen.fetch_add(1, Ordering::AcqRel); // odd: being set
                s.lost.store(false, Ordering::Relaxed);
                s.end.store(end, Ordering::Relaxed);
                s.pid.store(std::process::id() as usize, Ordering::Relaxed);
                s.start.store(start, Ordering::Release);
                s.gen.fetch_add(1, Ordering::AcqRel); // even: stable
                return Some(Watch { slot: i });
            }
        }
        if !RAN_OUT.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                slots = SLOTS,
                "every SIGBUS watch slot is taken: this and later mappings are unwatched (a \
                 truncation under one kills the process); close readers you no longer use"
            );
        }
        None
    }

    /// True once a fault in the range was caught: the object was truncated under the mapping,
    /// and the bytes from the faulting page on are private zeros, not the object's.
    pub fn lost(&self) -> bool {
        WATCHED[self.slot].lost.load(Ordering::Acquire)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let s = &WATCHED[self.slot];
        s.gen.fetch_add(1, Ordering::AcqRel); // odd: being cleared
        s.end.store(0, Ordering::Relaxed);
        s.start.store(0, Ordering::Release); // the slot is free from here
        s.gen.fetch_add(1, Ordering::AcqRel);
    }
}

/// Our action.
fn ours() -> libc::sigaction {
    // SAFETY: a zeroed sigaction is a valid value to fill in; sigemptyset initialises the mask.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigbus as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut action.sa_mask);
        action
    }
}

/// Whether `action` is ours.
fn is_ours(action: &libc::sigaction) -> bool {
    action.sa_sigaction == on_sigbus as *const () as usize
}

/// The action installed now.
fn current() -> Option<libc::sigaction> {
    // SAFETY: a query (no new action); `now` is written by the kernel.
    unsafe {
        let mut now: libc::sigaction = std::mem::zeroed();
        (libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut now) == 0).then_some(now)
    }
}

/// Whether a `SIGBUS` is pending (raised while the handler runs, so blocked). Async-signal-safe.
fn sigbus_pending() -> bool {
    // SAFETY: sigpending writes the set, which sigemptyset initialised; both are
    // async-signal-safe.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigpending(&mut set) == 0 && libc::sigismember(&set, libc::SIGBUS) == 1
    }
}

/// Installs the handler, keeping the action it replaced; false if installing failed.
fn install() -> bool {
    // Read now, so the handler only loads it (its first call is not async-signal-safe).
    page_size();
    let Some(previous) = current() else {
        tracing::warn!(
            error = %std::io::Error::last_os_error(),
            "could not read the SIGBUS action: a truncated arena will kill this process"
        );
        return false;
    };
    // Before ours is installed, so that it never passes a fault to a stale action.
    let node = pass_on_to(previous);
    if !swap_in(previous, node) {
        tracing::warn!(
            error = %std::io::Error::last_os_error(),
            "could not install the SIGBUS handler: a truncated arena will kill this process"
        );
        return false;
    }
    true
}

/// Installs ours in place of `expected`, whose node is `node`; false (the node dropped again)
/// if installing failed. An action another thread installed in between is passed on to as
/// well, above `expected`.
fn swap_in(expected: libc::sigaction, node: *mut Passed) -> bool {
    // SAFETY: a zeroed sigaction is a valid value for the kernel to write into.
    let mut replaced: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: sigaction with a fully initialised action; `replaced` is written by the kernel.
    if unsafe { libc::sigaction(libc::SIGBUS, &ours(), &mut replaced) } != 0 {
        drop_top(node);
        return false;
    }
    let ours_already = is_ours(&replaced);
    if replaced.sa_sigaction != expected.sa_sigaction && !ours_already {
        pass_on_to(replaced);
    }
    true
}

/// Puts the handler back in front if another was installed after it (torch's DataLoader worker
/// loop installs one): ours then passes the faults outside its ranges on to that one.
fn in_front() {
    if current().is_none_or(|a| is_ours(&a)) {
        return;
    }
    let me = std::process::id() as usize;
    loop {
        let holder = RETAKING.load(Ordering::Acquire);
        if holder == me {
            std::thread::yield_now(); // another thread of ours is at it
            continue;
        }
        // Free, or held by the parent this process was forked from (its thread is not here).
        if RETAKING
            .compare_exchange(holder, me, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            break;
        }
    }
    // Looked at again under the claim: another thread may have put it back meanwhile (taking
    // ours as the one to pass faults on to would loop).
    if let Some(theirs) = current().filter(|a| !is_ours(a)) {
        if RETAKEN.fetch_add(1, Ordering::Relaxed) < RETAKES {
            let node = pass_on_to(theirs);
            if swap_in(theirs, node) {
                tracing::info!(
                    "another SIGBUS handler was installed after capture-arena's: ours is back \
                     in front and passes faults outside arenas on to it"
                );
            }
        } else if RETAKEN.load(Ordering::Relaxed) == RETAKES + 1 {
            tracing::warn!(
                retakes = RETAKES,
                "another SIGBUS handler keeps replacing capture-arena's: it is no longer put \
                 back in front, so while another is installed a truncation under any arena \
                 mapping goes to that handler (and likely kills the process)"
            );
        }
    }
    RETAKING.store(0, Ordering::Release);
}

/// The handler: `errno` as the interrupted code left it is put back when it returns (`mmap`,
/// `sigaction` and a handler the signal is passed on to may change it, and the interrupted code,
/// a `read` that just failed say, reads it next). Saved and restored here, around the work, with
/// no destructor: a handler passed the signal on to may `siglongjmp` out of it.
extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: __errno_location returns this thread's errno, valid for the thread's life.
    let errno = unsafe { *libc::__errno_location() };
    handle_sigbus(sig, info, ctx);
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// The work of [`on_sigbus`]. Async-signal-safe: atomics, `mmap`, `sigaction`, `raise` only.
fn handle_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler.
    let (addr, code) = unsafe { ((*info).si_addr() as usize, (*info).si_code) };
    // A fault (not a signal sent by a process: those have si_code <= 0).
    if code > 0 {
        // SAFETY: getpid is async-signal-safe.
        let pid = unsafe { libc::getpid() } as usize;
        for s in &WATCHED {
            let gen = s.gen.load(Ordering::Acquire);
            let start = s.start.load(Ordering::Acquire);
            let end = s.end.load(Ordering::Acquire);
            let owner = s.pid.load(Ordering::Acquire);
            if gen % 2 == 1
                || start == 0
                || start == BUSY
                || owner != pid
                || s.gen.load(Ordering::Acquire) != gen
            {
                continue; // being changed, free, or another process's
            }
            if (start..end).contains(&addr) {
                // Set before the handler was installed: here a plain atomic load.
                let from = page_start(addr, page_size());
                // Lost before the zero pages go in: a thread that reads them without faulting
                // then sees the mark when it checks after its copy.
                s.lost.store(true, Ordering::SeqCst);
                // SAFETY: replaces [from, end) of a mapping this process owns (registered by its
                // owner, who unregisters before unmapping) with private zero pages, so the
                // faulting access can complete. Nothing else in this process holds those pages.
                let p = unsafe {
                    libc::mmap(
                        from as *mut libc::c_void,
                        end - from,
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE
                            | libc::MAP_ANONYMOUS
                            | libc::MAP_FIXED
                            | libc::MAP_NORESERVE,
                        -1,
                        0,
                    )
                };
                if p != libc::MAP_FAILED {
                    return; // the access is retried, now on the zero pages
                }
            }
        }
    }
    // Not ours: what would have happened without us. Entered again while passing a signal on
    // (the one we passed it to restored us and raised it): the default action.
    let me = tid();
    let passing = PASSING_ON.load(Ordering::Acquire) == me;
    let mut top = PREVIOUS.load(Ordering::Acquire);
    if code > 0 && !passing && !top.is_null() {
        // A fault again where the last one passed on was, on the same thread: the handler it
        // went to returned without mending it. Below it this time.
        let now = now_us();
        let again = LAST_PASSED.0.load(Ordering::Acquire) == me
            && LAST_PASSED.1.load(Ordering::Acquire) == addr
            && now.saturating_sub(LAST_PASSED.2.load(Ordering::Acquire)) < AGAIN_WITHIN_US;
        if again {
            drop_top(top);
            top = PREVIOUS.load(Ordering::Acquire);
        }
        LAST_PASSED.0.store(me, Ordering::Release);
        LAST_PASSED.1.store(addr, Ordering::Release);
        LAST_PASSED.2.store(now, Ordering::Release);
    }
    // SAFETY: PREVIOUS is null or points to a leaked node that is never freed or written.
    let previous = (!passing && !top.is_null()).then(|| unsafe { (*top).action });
    match previous {
        // An ignored SIGBUS sent by a process stays ignored (a fault cannot be ignored).
        Some(prev) if prev.sa_sigaction == libc::SIG_IGN && code <= 0 => {}
        Some(prev) if prev.sa_sigaction != libc::SIG_DFL && prev.sa_sigaction != libc::SIG_IGN => {
            if prev.sa_flags & libc::SA_RESETHAND != 0 {
                // The kernel would have reset the action before running it.
                // SAFETY: sigaction is async-signal-safe; the action is initialised.
                unsafe {
                    let mut dfl: libc::sigaction = std::mem::zeroed();
                    dfl.sa_sigaction = libc::SIG_DFL;
                    libc::sigemptyset(&mut dfl.sa_mask);
                    libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
                }
            }
            PASSING_ON.store(me, Ordering::Release);
            if prev.sa_flags & libc::SA_SIGINFO != 0 {
                // SAFETY: the previous handler was installed with SA_SIGINFO, so this is its type.
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    unsafe { std::mem::transmute(prev.sa_sigaction) };
                f(sig, info, ctx);
            } else {
                // SAFETY: a plain handler's type.
                let f: extern "C" fn(libc::c_int) =
                    unsafe { std::mem::transmute(prev.sa_sigaction) };
                f(sig);
            }
            let _ = PASSING_ON.compare_exchange(me, 0, Ordering::AcqRel, Ordering::Acquire);
            // It handed the signal back to ours: it raised it again (pending until this returns)
            // with ours installed (faulthandler restores the action it replaced, ours, then
            // raises). It is done, and what it replaced ours had replaced before it: passing
            // the signal to it again would loop. (One that handled the fault and returned, with
            // nothing raised, is kept.)
            if current().is_some_and(|a| is_ours(&a)) && sigbus_pending() {
                drop_top(top);
            }
        }
        _ => {
            // The default action: restore it; a fault recurs when the access is retried, a
            // signal sent by a process is raised again.
            // SAFETY: sigaction and raise are async-signal-safe; the action is initialised.
            unsafe {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigemptyset(&mut dfl.sa_mask);
                libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
                if code <= 0 {
                    libc::raise(libc::SIGBUS);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_readers_whole_session_cache_and_more_are_watched() {
        // Before: 256 slots, while a reader caches 1024 sessions: the 257th mapping was made
        // unwatched, and a truncation under it killed the trainer with SIGBUS.
        let n = 1024 + 512; // a reader's whole cache (client::MAX_SESSIONS) and more
        let page = page_size();
        let watches: Vec<Option<Watch>> = (0..n)
            .map(|i| Watch::new(0x7e00_0000_0000 + i * 4 * page, page))
            .collect();
        let watched = watches.iter().filter(|w| w.is_some()).count();
        assert_eq!(watched, n, "{} of {n} ranges unwatched", n - watched);
    }
}
