//! The writer thread: the only thread that touches the arena, so the arena needs no lock.
//!
//! One mio event loop serves three sources:
//! - [`WAKER`]: a submitter queued a batch (bounded queue, `max_pending_batches`);
//! - [`LISTENER`]: a control client connects;
//! - a token per control connection: free lines arrive.
//!
//! While idle the loop blocks in `poll`, so a free is applied as soon as its bytes arrive and a
//! client's socket buffer never fills. Before every allocation the writer drains all pending
//! control input (a zero-timeout poll), so space freed a moment ago is reused. A batch that does
//! not fit waits in the same loop, blocked in `poll` until a free arrives or the wait runs out:
//! waiting never spins a core.
//!
//! ```text
//!  submit() --[bounded queue]--> writer --copy--> arena region --result--> handle.wait()
//!                                  ^
//!  trainer --["key", ...]\n--> control socket (read only, never written)
//! ```

use std::collections::HashMap;
use std::io::{ErrorKind, Read};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, TcpStream};
use mio::{Events, Interest, Poll, Token, Waker};

use crate::arena::{Arena, ArenaReport};
use crate::config::Config;
use crate::control::{self, LineBuffer};
use crate::error::{Error, Result};
use crate::memory::{Region, ShmRegion};
use crate::sample::{batch_results, ArenaRef, Published, Sample, SampleResult};
use crate::stats::{bump, Stats, StatsSnapshot};

/// The log target of the per-batch timing line (`SGLANG_SPEC_CAPTURE_TIMING=1`); log filters
/// that show warnings only should still let it through (the CLI's and the Python module's do).
pub const TIMING_TARGET: &str = "capture_arena::timing";

/// The control listener's token.
const LISTENER: Token = Token(0);
/// The submitters' waker token.
const WAKER: Token = Token(1);
/// The first token given to a control connection.
const FIRST_CONN: usize = 2;

/// What a batch's completion receives.
pub type Outcome = Result<Vec<Published>>;

type Done = Box<dyn FnOnce(Outcome) + Send>;

struct Job {
    samples: Vec<Sample>,
    done: Done,
    /// The batch's place among the `max_pending_batches` the writer may hold: given back when
    /// the job is dropped, however that happens (completed, refused, or dropped by a writer
    /// that stopped), so no count is ever lost.
    permit: Permit,
}

/// One held batch; see [`Job::permit`].
struct Permit(Arc<Shared>);

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.release_hold();
    }
}

/// State shared between the writer thread and its handles.
#[derive(Debug, Default)]
struct Shared {
    stats: Stats,
    closing: AtomicBool,
    /// Bumped by the writer after every change of state; waiters sleep on `changed`.
    version: Mutex<u64>,
    changed: Condvar,
    /// Batches submitted and not yet completed (queued or being placed): at most
    /// `max_pending_batches`. Submitters wait on `room`.
    held: Mutex<usize>,
    room: Condvar,
}

impl Shared {
    /// A batch completed: one more may be submitted.
    fn release_hold(&self) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        *held = held.saturating_sub(1);
        self.room.notify_one();
    }

    fn notify(&self) {
        let mut v = self.version.lock().unwrap_or_else(|p| p.into_inner());
        *v += 1;
        self.changed.notify_all();
    }
}

/// A handle on a submitted batch.
#[derive(Debug)]
pub struct BatchHandle {
    rx: Receiver<Outcome>,
    sample_ids: Vec<String>,
}

impl BatchHandle {
    /// Waits until the writer has copied the batch (or failed it).
    ///
    /// # Errors
    /// The batch's error ([`Error::ArenaFull`], [`Error::KeyExists`], ...), or
    /// [`Error::WriterStopped`].
    pub fn wait(self) -> Outcome {
        self.rx.recv().unwrap_or(Err(Error::WriterStopped))
    }

    /// Waits at most `timeout`; `None` if the batch is not done yet.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Outcome> {
        match self.rx.recv_timeout(timeout) {
            Ok(o) => Some(o),
            Err(mpsc::RecvTimeoutError::Timeout) => None,
            Err(mpsc::RecvTimeoutError::Disconnected) => Some(Err(Error::WriterStopped)),
        }
    }

    /// Waits, then returns one result per sample: published, or `{"sample_id", "error"}` for
    /// every sample of a failed batch.
    pub fn wait_results(self) -> Vec<SampleResult> {
        let ids = self.sample_ids.clone();
        match self.wait() {
            Ok(p) => batch_results(&ids, Ok(p)),
            Err(e) => batch_results(&ids, Err(&e)),
        }
    }

    /// The ids of the batch's samples, in order.
    pub fn sample_ids(&self) -> &[String] {
        &self.sample_ids
    }
}

/// The running writer: submit batches, read stats. Dropping it stops the thread (after the
/// batches already queued) and removes the region.
#[derive(Debug)]
pub struct Writer {
    tx: Option<Sender<Job>>,
    waker: Arc<Waker>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    arena_ref: ArenaRef,
    capacity: u64,
    max_pending: usize,
}

impl Writer {
    /// Starts a writer over a new shared-memory region of `config.arena_bytes`, with its control
    /// listener bound.
    ///
    /// # Errors
    /// [`Error::Config`] for invalid settings (the arena size is required), [`Error::Io`] if the
    /// region or the listener cannot be created.
    pub fn start(config: &Config) -> Result<Writer> {
        config.validate()?;
        let bytes = config.required_arena_bytes()?;
        let (listener, control) = control::bind(&config.control_host, config.control_port)?;
        let region = ShmRegion::create(bytes)?;
        Writer::start_with(config, Box::new(region), listener, control)
    }

    /// Starts a writer over a region the caller made (GPU memory, memory registered with a
    /// transfer engine, ...), binding the control listener from `config`.
    ///
    /// # Errors
    /// As [`Writer::start`].
    pub fn start_with_region(config: &Config, region: Box<dyn Region>) -> Result<Writer> {
        config.validate()?;
        let (listener, control) = control::bind(&config.control_host, config.control_port)?;
        Writer::start_with(config, region, listener, control)
    }

    fn start_with(
        config: &Config,
        region: Box<dyn Region>,
        mut listener: TcpListener,
        control: String,
    ) -> Result<Writer> {
        let arena = Arena::new(region, config.alignment, control)?;
        let poll = Poll::new().map_err(|e| Error::io("creating the writer's poll", e))?;
        poll.registry()
            .register(&mut listener, LISTENER, Interest::READABLE)
            .map_err(|e| Error::io("registering the control listener", e))?;
        let waker = Arc::new(
            Waker::new(poll.registry(), WAKER).map_err(|e| Error::io("creating the waker", e))?,
        );
        // Unbounded: the bound is the `held` count, which also counts the batch being placed.
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared::default());
        shared.stats.set_report(&arena.report());
        let arena_ref = arena.arena_ref().clone();
        let capacity = arena.capacity();
        tracing::info!(
            session = %arena_ref.session,
            control = %arena_ref.control,
            capacity,
            "arena ready"
        );
        let mut lp = Loop {
            arena,
            poll,
            listener,
            conns: HashMap::new(),
            next_token: FIRST_CONN,
            rx,
            shared: shared.clone(),
            wait: config.arena_wait,
            timing: config.timing,
            scratch: vec![0; 64 * 1024],
            accept_retry: None,
        };
        let thread = std::thread::Builder::new()
            .name("capture-arena-writer".into())
            .spawn(move || lp.run())
            .map_err(|e| Error::io("spawning the writer thread", e))?;
        Ok(Writer {
            tx: Some(tx),
            waker,
            shared,
            thread: Some(thread),
            arena_ref,
            capacity,
            max_pending: config.max_pending_batches,
        })
    }

    /// Queues a batch, blocking while the queue is full; the returned handle waits for its
    /// results. The samples (and the caller buffers they hold) are dropped once copied.
    ///
    /// # Errors
    /// [`Error::WriterStopped`] if the writer has stopped.
    pub fn submit(&self, samples: Vec<Sample>) -> Result<BatchHandle> {
        let (handle, done) = Self::handle(&samples);
        self.send(samples, done, true)?;
        Ok(handle)
    }

    /// As [`Writer::submit`] but never blocks.
    ///
    /// # Errors
    /// [`Error::QueueFull`] when the writer already holds `max_pending_batches` batches.
    pub fn try_submit(&self, samples: Vec<Sample>) -> Result<BatchHandle> {
        let (handle, done) = Self::handle(&samples);
        self.send(samples, done, false)?;
        Ok(handle)
    }

    /// Queues a batch (blocking while the queue is full) and calls `done` on the writer thread
    /// when it is copied or failed. `done` must be quick (it runs before the next batch) and
    /// must not submit to this writer with blocking submission: only the writer thread makes
    /// room in the queue, so that would deadlock. If the writer stops first, `done` is dropped
    /// without being called.
    ///
    /// # Errors
    /// [`Error::WriterStopped`] if the writer has stopped (`done` is not called then).
    pub fn submit_with(
        &self,
        samples: Vec<Sample>,
        done: impl FnOnce(Outcome) + Send + 'static,
    ) -> Result<()> {
        self.send(samples, Box::new(done), true)
    }

    /// As [`Writer::submit_with`] but never blocks.
    ///
    /// # Errors
    /// [`Error::QueueFull`] when the writer already holds `max_pending_batches` batches (`done`
    /// is dropped, not called, then), [`Error::WriterStopped`].
    pub fn try_submit_with(
        &self,
        samples: Vec<Sample>,
        done: impl FnOnce(Outcome) + Send + 'static,
    ) -> Result<()> {
        self.send(samples, Box::new(done), false)
    }

    /// A handle and the completion that feeds it.
    fn handle(samples: &[Sample]) -> (BatchHandle, Done) {
        let (tx, rx) = mpsc::sync_channel(1);
        let sample_ids = samples.iter().map(|s| s.sample_id.clone()).collect();
        let done: Done = Box::new(move |o| {
            let _ = tx.send(o);
        });
        (BatchHandle { rx, sample_ids }, done)
    }

    fn send(&self, samples: Vec<Sample>, done: Done, block: bool) -> Result<()> {
        let tx = self.tx.as_ref().ok_or(Error::WriterStopped)?;
        let stopped = || self.thread.as_ref().is_none_or(|t| t.is_finished());
        {
            let mut held = self.shared.held.lock().unwrap_or_else(|p| p.into_inner());
            while *held >= self.max_pending {
                if stopped() {
                    return Err(Error::WriterStopped);
                }
                if !block {
                    return Err(Error::QueueFull {
                        capacity: self.max_pending,
                    });
                }
                // Re-check the writer now and then: a stopped writer makes no room.
                held = self
                    .shared
                    .room
                    .wait_timeout(held, Duration::from_millis(100))
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            *held += 1;
        }
        let job = Job {
            samples,
            done,
            permit: Permit(self.shared.clone()),
        };
        // On failure the job comes back inside the error and is dropped: its permit too.
        tx.send(job).map_err(|_| Error::WriterStopped)?;
        self.waker
            .wake()
            .map_err(|e| Error::io("waking the writer", e))
    }

    /// The session and control endpoint results carry.
    pub fn arena_ref(&self) -> &ArenaRef {
        &self.arena_ref
    }

    /// Usable bytes of the arena.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The writer's counters.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot()
    }

    /// Blocks until `pred` holds for the counters or `timeout` passes; returns the last snapshot
    /// and whether `pred` held. Wakes on every change the writer makes (no polling).
    pub fn wait_for(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&StatsSnapshot) -> bool,
    ) -> (StatsSnapshot, bool) {
        let deadline = Instant::now().checked_add(timeout);
        let mut v = self
            .shared
            .version
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        loop {
            let s = self.stats();
            if pred(&s) {
                return (s, true);
            }
            let now = Instant::now();
            let expired = deadline.is_some_and(|d| now >= d);
            if expired || self.thread.as_ref().is_none_or(|t| t.is_finished()) {
                return (s, false);
            }
            // Wake at least every second to notice a writer that stopped.
            let second = Duration::from_secs(1);
            let step = deadline.map_or(second, |d| (d - now).min(second));
            v = self
                .shared
                .changed
                .wait_timeout(v, step)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::SeqCst);
        drop(self.tx.take());
        let _ = self.waker.wake();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("the capture-arena writer thread panicked");
            }
        }
    }
}

struct Conn {
    stream: TcpStream,
    peer: std::net::SocketAddr,
    lines: LineBuffer,
}

/// The writer thread's state; see the module docs.
struct Loop {
    arena: Arena,
    poll: Poll,
    listener: TcpListener,
    conns: HashMap<Token, Conn>,
    next_token: usize,
    rx: Receiver<Job>,
    shared: Arc<Shared>,
    wait: Duration,
    timing: bool,
    scratch: Vec<u8>,
    /// `accept` failed (out of descriptors, ...) with connections possibly still queued: under
    /// edge-triggered polling no new event comes for them, so retry after this delay, which
    /// doubles (up to a second) while the failure lasts.
    accept_retry: Option<Duration>,
}

impl Loop {
    fn run(&mut self) {
        let mut events = Events::with_capacity(256);
        loop {
            self.poll_once(&mut events, None);
            loop {
                match self.rx.try_recv() {
                    Ok(job) => self.publish(job),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        tracing::debug!("writer stopping: every submitter is gone");
                        return;
                    }
                }
            }
        }
    }

    /// One `poll` (blocking up to `timeout`, forever if `None`), then every event handled.
    /// Returns true if control input changed the arena.
    fn poll_once(&mut self, events: &mut Events, timeout: Option<Duration>) -> bool {
        let timeout = match self.accept_retry {
            Some(retry) => Some(timeout.map_or(retry, |t| t.min(retry))),
            None => timeout,
        };
        if let Err(e) = self.poll.poll(events, timeout) {
            if e.kind() != ErrorKind::Interrupted {
                tracing::error!(error = %e, "writer poll failed");
                std::thread::sleep(Duration::from_millis(1));
            }
            return false;
        }
        let mut changed = false;
        let mut control = false;
        if self.accept_retry.is_some() {
            changed |= self.accept();
            control = true;
        }
        for ev in events.iter() {
            match ev.token() {
                LISTENER => changed |= self.accept(),
                WAKER => continue, // the queue is drained by the caller
                token => changed |= self.read_conn(token),
            }
            control = true;
        }
        if control {
            // Counters (frees, bad lines, connections) may have moved: wake `wait_for`.
            self.shared.notify();
        }
        changed
    }

    /// Applies every control line that has arrived, without blocking.
    fn drain_control(&mut self) {
        let mut events = Events::with_capacity(256);
        // Loop while a poll returns a full set of events: more may be pending.
        loop {
            self.poll_once(&mut events, Some(Duration::ZERO));
            if events.iter().count() < events.capacity() {
                break;
            }
        }
    }

    /// Accepts every pending connection. Returns true if their first bytes freed anything.
    fn accept(&mut self) -> bool {
        let mut changed = false;
        loop {
            match self.listener.accept() {
                Ok((mut stream, peer)) => {
                    let token = Token(self.next_token);
                    self.next_token += 1;
                    if let Err(e) =
                        self.poll
                            .registry()
                            .register(&mut stream, token, Interest::READABLE)
                    {
                        tracing::warn!(%peer, error = %e, "cannot register control connection");
                        continue;
                    }
                    bump(&self.shared.stats.control_connections, 1);
                    tracing::debug!(%peer, ?token, "control connection");
                    self.conns.insert(
                        token,
                        Conn {
                            stream,
                            peer,
                            lines: LineBuffer::default(),
                        },
                    );
                    // Data may already be waiting (edge-triggered): read it now.
                    changed |= self.read_conn(token);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    self.accept_retry = None;
                    return changed;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Out of file descriptors and the like: retry on a timer that backs off;
                    // warn once per episode, not on every retry.
                    self.accept_retry = Some(match self.accept_retry {
                        None => {
                            tracing::warn!(error = %e, "accepting a control connection failed; retrying");
                            Duration::from_millis(10)
                        }
                        Some(d) => {
                            tracing::debug!(error = %e, "accepting a control connection still fails");
                            (d * 2).min(Duration::from_secs(1))
                        }
                    });
                    return changed;
                }
            }
        }
    }

    /// Reads a connection until it would block, applying each complete line. Returns true if
    /// anything was freed.
    fn read_conn(&mut self, token: Token) -> bool {
        let Some(conn) = self.conns.get_mut(&token) else {
            return false; // spurious: already closed
        };
        let peer = conn.peer;
        let stats = &self.shared.stats;
        let arena = &mut self.arena;
        let mut freed_any = false;
        let mut on_line = |line: &[u8]| match control::parse_line(line) {
            Ok(Some(keys)) => {
                let (mut objects, mut bytes, mut unknown) = (0, 0, 0);
                for key in keys {
                    match arena.free(&key) {
                        Some(b) => {
                            objects += 1;
                            bytes += b;
                        }
                        None => unknown += 1,
                    }
                }
                if objects > 0 {
                    stats.set_report(&arena.report());
                    freed_any = true;
                }
                bump(&stats.freed_bytes, bytes);
                bump(&stats.unknown_frees, unknown);
                bump(&stats.freed_objects, objects);
            }
            Ok(None) => {}
            Err(why) => {
                bump(&stats.bad_lines, 1);
                let start = String::from_utf8_lossy(&line[..line.len().min(80)]).into_owned();
                tracing::warn!(%peer, %why, bytes = line.len(), ?start, "bad control line ignored");
            }
        };
        let close = loop {
            match conn.stream.read(&mut self.scratch) {
                Ok(0) => {
                    if conn.lines.pending() > 0 {
                        bump(&stats.partial_lines, 1);
                        tracing::warn!(
                            ?token,
                            bytes = conn.lines.pending(),
                            "control connection closed mid-line; partial line discarded"
                        );
                    }
                    break true;
                }
                Ok(n) => {
                    if let Err(o) = conn.lines.push(&self.scratch[..n], &mut on_line) {
                        bump(&stats.oversized_lines, 1);
                        tracing::warn!(
                            ?token,
                            bytes = o.bytes,
                            limit = control::MAX_LINE_BYTES,
                            "control line too long; closing its connection"
                        );
                        break true;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break false,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::debug!(?token, error = %e, "control connection error");
                    break true;
                }
            }
        };
        if close {
            if let Some(mut c) = self.conns.remove(&token) {
                let _ = self.poll.registry().deregister(&mut c.stream);
            }
        }
        freed_any
    }

    fn publish(&mut self, job: Job) {
        let t0 = Instant::now();
        let Job {
            samples,
            done,
            permit,
        } = job;
        let result = self.place(&samples, t0);
        let stats = &self.shared.stats;
        stats.set_report(&self.arena.report());
        let outcome = match result {
            Ok((p, waited, copy)) => {
                bump(&stats.published_batches, 1);
                bump(&stats.published_samples, p.published.len() as u64);
                bump(&stats.published_objects, p.objects);
                bump(&stats.published_bytes, p.bytes);
                bump(&stats.replaced_objects, p.replaced);
                bump(&stats.replaced_bytes, p.replaced_bytes);
                bump(&stats.copy_ns, copy.as_nanos() as u64);
                if self.timing {
                    tracing::info!(
                        target: TIMING_TARGET,
                        samples = p.published.len(),
                        objects = p.objects,
                        bytes = p.bytes,
                        wait_ms = waited.as_secs_f64() * 1e3,
                        copy_ms = copy.as_secs_f64() * 1e3,
                        total_ms = t0.elapsed().as_secs_f64() * 1e3,
                        "capture batch published"
                    );
                }
                Ok(p.published)
            }
            Err(e) => {
                bump(&stats.failed_batches, 1);
                tracing::warn!(samples = samples.len(), error = %e, "capture batch failed");
                Err(e)
            }
        };
        // The caller's buffers go before the caller hears back.
        drop(samples);
        drop(permit);
        done(outcome);
        self.shared.notify();
    }

    /// Places a batch, waiting for frees if it does not fit. Returns the publication, the time
    /// spent waiting and the time of the successful placement (allocation + copy).
    fn place(
        &mut self,
        samples: &[Sample],
        t0: Instant,
    ) -> Result<(crate::arena::Publication, Duration, Duration)> {
        self.drain_control();
        let needed = self.arena.check(samples)?;
        // A wait too long to represent is no deadline at all.
        let deadline = t0.checked_add(self.wait);
        let mut waiting_since: Option<Instant> = None;
        let mut events = Events::with_capacity(256);
        loop {
            let t_copy = Instant::now();
            if let Some(p) = self.arena.publish(samples)? {
                let waited = waiting_since.map_or(Duration::ZERO, |w| t_copy - w);
                if waiting_since.is_some() {
                    bump(&self.shared.stats.waits, 1);
                    bump(&self.shared.stats.wait_ns, waited.as_nanos() as u64);
                }
                return Ok((p, waited, t_copy.elapsed()));
            }
            let now = Instant::now();
            let since = match waiting_since {
                Some(since) => since,
                None => {
                    let free = self.arena.report().free_bytes;
                    tracing::debug!(needed, free, "batch waits for frees");
                    *waiting_since.insert(now)
                }
            };
            let expired = deadline.is_some_and(|d| now >= d);
            if expired || self.shared.closing.load(Ordering::SeqCst) {
                bump(&self.shared.stats.waits, 1);
                bump(&self.shared.stats.wait_ns, (now - since).as_nanos() as u64);
                if self.shared.closing.load(Ordering::SeqCst) {
                    return Err(Error::WriterStopped);
                }
                return Err(full(needed, &self.arena.report(), now - since));
            }
            // Block until control input (or a new submission, or the deadline), then apply
            // everything that has arrived before trying to allocate again.
            self.poll_once(&mut events, deadline.map(|d| d - now));
            self.drain_control();
        }
    }
}

fn full(needed: u64, r: &ArenaReport, waited: Duration) -> Error {
    Error::ArenaFull {
        needed,
        free: r.free_bytes,
        largest_free: r.largest_free,
        resident_objects: r.resident_objects,
        capacity: r.capacity,
        waited,
    }
}
