//! Sessions → transports, cached; reads checked before they touch memory.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::lock;
use crate::error::{Error, Result};
use crate::sample::{stamp_offset, Feature, Published, MAX_SESSION_BYTES, STAMP_BYTES};
use crate::transport::{self, read_when_ready, Destination, ReadOp, Transport, View};

/// The most sessions (producers) one reader keeps open at once; opening one more closes the
/// session used least recently (its mapping or connection goes once no view holds it, and a
/// later read opens it again).
pub const MAX_SESSIONS: usize = 1024;
/// How long a read waits for an object whose bytes are still being written (its result was
/// handed out before its copy completed), unless `SGLANG_SPEC_CAPTURE_READY_WAIT_S` says.
pub const DEFAULT_READY_WAIT: Duration = Duration::from_secs(30);
/// The variable that sets [`Reader`]'s wait for objects still being written.
pub const READY_WAIT_ENV: &str = "SGLANG_SPEC_CAPTURE_READY_WAIT_S";
/// How often the cache looks for producers that are gone, at most.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

#[derive(Debug)]
struct Cache {
    /// The process the cached transports belong to; a forked child starts over.
    pid: u32,
    /// Each open session's transport and the tick of the last read that asked for it.
    sessions: HashMap<String, (Arc<dyn Transport>, u64)>,
    /// Counts the asks, to find the session used least recently.
    tick: u64,
    last_sweep: Instant,
}

impl Drop for Cache {
    /// In a forked child the transports are the parent's: leaked, never torn down (a device
    /// mapping's teardown calls a driver that does not survive fork), as `open` does.
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            std::mem::forget(std::mem::take(&mut self.sessions));
        }
    }
}

impl Cache {
    fn new() -> Cache {
        Cache {
            pid: std::process::id(),
            sessions: HashMap::new(),
            tick: 0,
            last_sweep: Instant::now(),
        }
    }
}

/// Forgets the transports of producers that are gone (unless `force`, at most once every
/// [`SWEEP_EVERY`]), so their memory goes back as soon as no view holds it: a trainer must not
/// pin the arenas of every producer that ever restarted. The lock is held only to copy the
/// sessions out and to take the gone ones out: each liveness probe (a file lock, a socket)
/// runs without it, so reads never wait for them, and a fork rarely finds the lock held (a
/// child has no thread to let it go); their teardown (unmap, unregister, NIXL) runs after it.
fn sweep(cache: &Mutex<Cache>, force: bool) {
    let cached: Vec<(String, Arc<dyn Transport>)> = {
        let mut c = lock(cache);
        if c.pid != std::process::id() || !force && c.last_sweep.elapsed() < SWEEP_EVERY {
            return; // a forked child's copy (its next open starts afresh), or swept lately
        }
        c.last_sweep = Instant::now(); // claimed: others meanwhile do not sweep too
        c.sessions
            .iter()
            .map(|(s, (t, _))| (s.clone(), t.clone()))
            .collect()
    };
    let gone: Vec<(String, Arc<dyn Transport>)> =
        cached.into_iter().filter(|(_, t)| !t.is_live()).collect();
    let mut dropped = Vec::new();
    {
        let mut c = lock(cache);
        for (session, t) in &gone {
            // Only the transport probed: one opened again meanwhile stays.
            if c.sessions
                .get(session)
                .is_some_and(|(now, _)| Arc::ptr_eq(now, t))
            {
                tracing::debug!(%session, "dropping the mapping of a producer that is gone");
                dropped.extend(c.sessions.remove(session).map(|(t, _)| t));
            }
        }
    }
    drop(gone);
    drop(dropped); // after the lock
}

/// Opens and caches sessions; reads features. See the module docs.
#[derive(Debug)]
pub struct Reader {
    cache: Arc<Mutex<Cache>>,
    /// The process whose sweeper thread watches this cache (0: none yet).
    sweeper: std::sync::atomic::AtomicU32,
    ready_wait: Duration,
    max_sessions: usize,
}

impl Default for Reader {
    fn default() -> Reader {
        Reader::new()
    }
}

impl Reader {
    /// A reader with no open session, that waits for objects still being written as long as
    /// `SGLANG_SPEC_CAPTURE_READY_WAIT_S` says (30 s when unset or invalid:
    /// an invalid value is logged, naming the variable).
    pub fn new() -> Reader {
        Reader::with_ready_wait(ready_wait_from_env())
    }

    /// A reader that waits at most `ready_wait` for an object whose bytes are still being
    /// written (the readiness rule of docs/protocol.md).
    pub fn with_ready_wait(ready_wait: Duration) -> Reader {
        Reader {
            cache: Arc::new(Mutex::new(Cache::new())),
            sweeper: std::sync::atomic::AtomicU32::new(0),
            ready_wait,
            max_sessions: MAX_SESSIONS,
        }
    }

    /// This reader, keeping at most `max_sessions` sessions open (at least 1; [`MAX_SESSIONS`]
    /// by default): past it, the session used least recently is closed.
    #[must_use]
    pub fn with_max_sessions(mut self, max_sessions: usize) -> Reader {
        self.max_sessions = max_sessions.max(1);
        self
    }

    /// How long a read waits for an object still being written.
    pub fn ready_wait(&self) -> Duration {
        self.ready_wait
    }

    /// The transport for `session`, opened on first use and cached. Each call also drops (at
    /// most once a second) the cached sessions whose producer is gone.
    ///
    /// With [`MAX_SESSIONS`] open, a new one closes the session used least recently (a trainer
    /// outlives any number of producer restarts, even where a producer cannot be proved gone:
    /// NIXL, another host).
    ///
    /// # Errors
    /// As [`transport::open`]: unknown scheme, or a stale session; [`Error::InvalidSession`] for
    /// a session string over [`MAX_SESSION_BYTES`].
    pub fn open(&self, session: &str) -> Result<Arc<dyn Transport>> {
        if session.len() > MAX_SESSION_BYTES {
            return Err(Error::InvalidSession {
                session: session.chars().take(80).collect(),
                reason: format!("longer than {MAX_SESSION_BYTES} bytes"),
            });
        }
        self.start_sweeper();
        sweep(&self.cache, false);
        let cached = {
            let mut c = lock(&self.cache);
            if c.pid != std::process::id() {
                // A forked child: the parent's transports are not this process's to use or tear
                // down (a device mapping's teardown calls a driver that does not survive fork;
                // a NIXL agent's UCX state is the parent's). They are leaked here, never dropped;
                // cuda:// sessions then fail in this process with an error that says so.
                std::mem::forget(std::mem::replace(&mut *c, Cache::new()));
            }
            c.sessions.get(session).map(|(t, _)| t.clone())
        };
        if let Some(t) = cached {
            // Probed without the lock (a file lock or a socket, once a second).
            let live = t.is_live();
            let mut c = lock(&self.cache);
            c.tick += 1;
            let tick = c.tick;
            let same = c
                .sessions
                .get_mut(session)
                .filter(|(now, _)| Arc::ptr_eq(now, &t));
            match same {
                Some((_, used)) if live => {
                    *used = tick;
                    return Ok(t);
                }
                // Gone: taken out, and opened again below (the transport says whether the
                // producer is still there: a NIXL session whose reader agent was retired
                // reopens with a new one).
                Some(_) => drop(c.sessions.remove(session)),
                None => {} // closed or replaced meanwhile: opened below
            }
            drop(c);
            drop(t); // after the lock
        }
        // A new session: often a producer restarted, so look for the ones that are gone now.
        sweep(&self.cache, true);
        // Open without holding the lock (mapping a large region takes a moment).
        let opened = transport::open(session)?;
        let mut dropped: Vec<Arc<dyn Transport>> = Vec::new();
        let mut c = lock(&self.cache);
        c.tick += 1;
        let tick = c.tick;
        let t = match c.sessions.entry(session.to_owned()) {
            std::collections::hash_map::Entry::Occupied(e) => {
                dropped.push(opened); // another thread opened it meanwhile: theirs is kept
                e.get().0.clone()
            }
            std::collections::hash_map::Entry::Vacant(e) => e.insert((opened, tick)).0.clone(),
        };
        while c.sessions.len() > self.max_sessions {
            let Some(oldest) = c
                .sessions
                .iter()
                .filter(|(s, _)| s.as_str() != session)
                .min_by_key(|(_, (_, used))| *used)
                .map(|(s, _)| s.clone())
            else {
                break;
            };
            tracing::debug!(
                session = %oldest,
                max_sessions = self.max_sessions,
                "closing the session read least recently to open another"
            );
            dropped.extend(c.sessions.remove(&oldest).map(|(t, _)| t));
        }
        drop(c);
        drop(dropped);
        Ok(t)
    }

    /// Starts (once per process) the thread that drops the transports of producers that are
    /// gone every [`SWEEP_EVERY`] while this reader lives, so that a trainer that stopped
    /// reading (its producer died: no new results) does not keep the dead arena mapped, its
    /// memory charged to `/dev/shm` where a restarted producer needs it. Without a thread to
    /// be had, `open` still sweeps.
    fn start_sweeper(&self) {
        use std::sync::atomic::Ordering;
        let pid = std::process::id();
        if self.sweeper.swap(pid, Ordering::Relaxed) == pid {
            return;
        }
        let cache = Arc::downgrade(&self.cache);
        let spawned = std::thread::Builder::new()
            .name("capture-arena-reader-sweep".into())
            .spawn(move || loop {
                std::thread::sleep(SWEEP_EVERY);
                let Some(cache) = cache.upgrade() else {
                    return; // the reader was dropped
                };
                sweep(&cache, false);
            });
        if let Err(e) = spawned {
            tracing::debug!(error = %e, "no thread to sweep the reader's sessions; reads do");
            self.sweeper.store(0, Ordering::Relaxed);
        }
    }

    /// True when the producer of `session` is provably gone (from the open session if it is
    /// cached, else from the session string itself): [`Transport::is_gone`], never a read that
    /// merely failed or timed out.
    pub fn is_gone(&self, session: &str) -> bool {
        let cached = lock(&self.cache)
            .sessions
            .get(session)
            .map(|(t, _)| t.clone());
        match cached {
            Some(t) => t.is_gone(),
            None => transport::is_gone(session),
        }
    }

    /// Sessions open now.
    pub fn open_sessions(&self) -> usize {
        lock(&self.cache).sessions.len()
    }

    /// Forgets a cached session (its mapping is released once no view holds it).
    pub fn close(&self, session: &str) {
        let removed = lock(&self.cache).sessions.remove(session);
        drop(removed); // after the lock: a transport's teardown never runs under it
    }

    /// The byte length of feature `name` of `result`, checked against the arena it claims to be
    /// in (so a forged shape or address is refused before anything is allocated for it).
    ///
    /// # Errors
    /// [`Error::UnknownFeature`], [`Error::InvalidRead`] (shape overflows),
    /// [`Error::OutOfRange`], [`Error::StaleSession`].
    pub fn checked_len(&self, result: &Published, name: &str) -> Result<u64> {
        let f = feature(result, name)?;
        let len = byte_len(result, name, f)?;
        self.open(&result.arena.session)?.check(f.address, len)?;
        Ok(len)
    }

    /// Copies feature `name` of `result` into `out`, which must be exactly `shape × item size`
    /// bytes.
    ///
    /// # Errors
    /// [`Error::InvalidRead`] for an unknown name or a buffer of the wrong size,
    /// [`Error::OutOfRange`] for an address outside the arena, [`Error::StaleSession`].
    pub fn read(&self, result: &Published, name: &str, out: &mut [u8]) -> Result<()> {
        self.read_many(result, &mut [(name, out)])
    }

    /// Copies several features of `result` into their buffers (each exactly its feature's
    /// size), in one request to the transport.
    ///
    /// # Errors
    /// As [`Reader::read`], for the first feature at fault; nothing is read then.
    pub fn read_many(&self, result: &Published, outs: &mut [(&str, &mut [u8])]) -> Result<()> {
        let mut dests: Vec<(&str, Destination<'_>)> = outs
            .iter_mut()
            .map(|(n, o)| (*n, Destination::Host(o)))
            .collect();
        self.read_to(result, &mut dests)
    }

    /// Copies several features of `result` into destinations of any kind (host buffers, device
    /// memory: [`Destination`]), each exactly its feature's size, in one request to the
    /// transport.
    ///
    /// # Errors
    /// As [`Reader::read`]; [`Error::InvalidRead`] for a destination kind the transport or this
    /// build cannot write (device memory without the `cuda` feature).
    pub fn read_to(&self, result: &Published, outs: &mut [(&str, Destination<'_>)]) -> Result<()> {
        let mut ops = Vec::with_capacity(outs.len());
        // (where, stamp) of each object whose result carries a stamp, and its name.
        let mut checks: Vec<(u64, u64)> = Vec::new();
        let mut checked: Vec<&str> = Vec::new();
        for (name, out) in outs.iter_mut() {
            let f = feature(result, name)?;
            let len = byte_len(result, name, f)?;
            if out.len() != len {
                return Err(Error::InvalidRead {
                    key: key_of(result, name),
                    reason: format!(
                        "buffer holds {} bytes but shape {:?} of {} is {len} bytes",
                        out.len(),
                        f.shape,
                        f.dtype
                    ),
                });
            }
            let into = match out {
                Destination::Host(b) => Destination::Host(b),
                Destination::Device(d) => Destination::Device(*d),
            };
            if let Some(stamp) = f.stamp {
                checks.push((stamp_at(result, name, f, len)?, stamp));
                checked.push(name);
            }
            ops.push(ReadOp {
                address: f.address,
                into,
            });
        }
        let t = self.open(&result.arena.session)?;
        // Every range inside the arena before anything is read: the objects', then their stamps'.
        for op in &ops {
            t.check(op.address, op.into.len())?;
        }
        for c in &checks {
            t.check(c.0, STAMP_BYTES)?;
        }
        let key = |i: usize| key_of(result, checked[i]);
        // An object still being written (its stamp word pending) is waited for, bounded, and
        // copied only once it is there.
        let since = Instant::now();
        let deadline = since.checked_add(self.ready_wait).unwrap_or(since);
        read_when_ready(&*t, &mut ops, &checks, key, since, deadline)
    }

    /// Borrows feature `name` of `result` in place, without copying (transports that map the
    /// arena: shared memory).
    ///
    /// # Errors
    /// As [`Reader::read`]; [`Error::InvalidRead`] for a transport that does not map.
    /// [`View::check`] after using the bytes tells whether they were the object's (they are not
    /// if the producer's shared memory was truncated under the view).
    ///
    /// # Safety
    /// As [`View::new`]: the object must stay resident (not freed or replaced, by anyone) while
    /// the view lives.
    pub unsafe fn view(&self, result: &Published, name: &str) -> Result<View> {
        let f = feature(result, name)?;
        let len = byte_len(result, name, f)?;
        let t = self.open(&result.arena.session)?;
        // SAFETY: the caller's promise, passed on.
        let v = unsafe { View::new(t, f.address, len) }?;
        let deadline = crate::limits::deadline_in(self.ready_wait);
        match f.stamp {
            Some(stamp) => v.stamped(
                key_of(result, name),
                stamp_at(result, name, f, len)?,
                stamp,
                deadline,
            ),
            None => Ok(v),
        }
    }
}

/// Where feature `name`'s stamp is: an aligned word after its `len` bytes.
pub(crate) fn stamp_at(result: &Published, name: &str, f: &Feature, len: u64) -> Result<u64> {
    f.address
        .checked_add(stamp_offset(len))
        .filter(|a| a % STAMP_BYTES == 0)
        .ok_or_else(|| Error::InvalidRead {
            key: key_of(result, name),
            reason: format!(
                "address {:#x} is not 8-byte aligned (a result of capture-arena's keeps its \
                 objects aligned)",
                f.address
            ),
        })
}

pub(crate) fn byte_len(result: &Published, name: &str, f: &Feature) -> Result<u64> {
    f.byte_len().ok_or_else(|| Error::InvalidRead {
        key: key_of(result, name),
        reason: format!("shape {:?} of {} overflows", f.shape, f.dtype),
    })
}

/// The key of feature `name` of `result`, for error messages.
pub(crate) fn key_of(result: &Published, name: &str) -> String {
    result.key(name).map_or_else(
        |_| format!("{}/{name}", result.sample_path()),
        |k| k.to_string(),
    )
}

pub(crate) fn feature<'a>(result: &'a Published, name: &str) -> Result<&'a Feature> {
    result
        .features
        .get(name)
        .ok_or_else(|| Error::UnknownFeature {
            key: key_of(result, name),
            available: result.features.keys().cloned().collect(),
        })
}

/// `SGLANG_SPEC_CAPTURE_READY_WAIT_S` as a duration: `DEFAULT_READY_WAIT` when unset, or when
/// not a number of seconds in `[0, 86400]` (then logged, naming the variable).
fn ready_wait_from_env() -> Duration {
    let Ok(raw) = std::env::var(READY_WAIT_ENV) else {
        return DEFAULT_READY_WAIT;
    };
    let raw = raw.trim();
    if raw.is_empty() {
        return DEFAULT_READY_WAIT;
    }
    match raw.parse::<f64>() {
        Ok(s) if (0.0..=86_400.0).contains(&s) => Duration::from_secs_f64(s),
        _ => {
            tracing::warn!(
                value = raw,
                "{READY_WAIT_ENV} is not a number of seconds in [0, 86400]; waiting {} s for \
                 objects still being written",
                DEFAULT_READY_WAIT.as_secs()
            );
            DEFAULT_READY_WAIT
        }
    }
}
