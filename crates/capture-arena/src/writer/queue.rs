//! The submitters' side of the writer: a bounded queue of batches, the permits that bound it, and
//! the handles that wait for results.
//!
//! Invariants:
//! - at most `max_pending_batches` batches are held (queued or being placed): a submitter takes
//!   a [`Permit`] before its batch is queued, and the permit goes back when the batch's [`Job`]
//!   is dropped, however that happens, so no count is ever lost;
//! - a batch's completion runs exactly once if the batch was accepted (with
//!   [`Error::WriterStopped`] if the writer stops before finishing it) and never if it was
//!   refused ([`Error::QueueFull`], a stopped writer): a refusal is reported to the submitter
//!   alone;
//! - the writer sleeps in `poll` only after announcing it ([`Shared::sleeping`]), so a submitter
//!   wakes it exactly when needed and skips the wake-up (a system call) while it is busy or
//!   spinning.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use mio::Waker;

use crate::error::{Error, Result};
use crate::sample::{batch_results, Published, Sample, SampleResult};
use crate::stats::Stats;

/// What a batch's completion receives.
pub type Outcome = Result<Vec<Published>>;

/// A batch's completion.
pub(crate) type Done = Box<dyn FnOnce(Outcome) + Send>;

/// How long a waiter spins on its result before sleeping: a small batch completes in a few
/// microseconds, and sleeping costs two wake-ups of tens of microseconds on a virtual machine.
pub(crate) const SPIN: Duration = Duration::from_micros(50);

/// How a submitter waits for room in the queue.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Block {
    /// Not at all: [`Error::QueueFull`].
    No,
    /// As long as it takes.
    Yes,
    /// Until then: [`Error::Timeout`].
    Until(Instant),
}

/// Where a batch submitted with a bound ([`crate::Writer::submit_within`]) is: its submitter
/// waits for it to start copying (or to finish) until its deadline, then gives up; the placer
/// copies a batch only if its submitter has not given up, so a batch given up on is never
/// written.
#[derive(Debug, Default)]
pub(crate) struct Ticket {
    state: Mutex<TicketState>,
    changed: Condvar,
}

/// See [`Ticket`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TicketState {
    /// In the queue, behind other batches.
    #[default]
    Queued,
    /// Taken by the placer, waiting for frees: it needs `.0` bytes, `.1` were free.
    WaitingForSpace(u64, u64),
    /// Its copy started: it will be published (or fail) without waiting any more.
    Started,
    /// Completed (failed before it started).
    Finished,
    /// Its submitter gave up: it must not start.
    Abandoned,
}

impl Ticket {
    fn set(&self, to: TicketState) -> TicketState {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let was = *s;
        if was != TicketState::Abandoned {
            *s = to;
            self.changed.notify_all();
        }
        was
    }

    /// Runs `reserve` (the placer's try) unless the submitter gave up (`None`), holding the
    /// ticket so the submitter cannot give up meanwhile; marks the batch started if `started`
    /// says the try reserved its space.
    pub fn start_with<R>(
        &self,
        reserve: impl FnOnce() -> R,
        started: impl FnOnce(&R) -> bool,
    ) -> Option<R> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if *s == TicketState::Abandoned {
            return None;
        }
        let r = reserve();
        if started(&r) {
            *s = TicketState::Started;
            self.changed.notify_all();
        }
        Some(r)
    }

    /// The placer could not place the batch yet.
    pub fn waiting(&self, needed: u64, free: u64) {
        self.set(TicketState::WaitingForSpace(needed, free));
    }

    /// The batch completed.
    pub fn finished(&self) {
        self.set(TicketState::Finished);
    }

    /// Waits until the batch started or finished, or `deadline`; then gives up and returns the
    /// state it gave up in (`Started`/`Finished`: it did not give up).
    pub fn wait_start(&self, deadline: Instant) -> TicketState {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            match *s {
                TicketState::Started | TicketState::Finished => return *s,
                was => {
                    let now = Instant::now();
                    if now >= deadline {
                        *s = TicketState::Abandoned;
                        return was;
                    }
                    s = self
                        .changed
                        .wait_timeout(s, deadline - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        }
    }
}

/// A queued batch.
pub(crate) struct Job {
    pub samples: Vec<Sample>,
    /// When its submitter stops waiting for it to start (a bound on its wait for space).
    pub deadline: Option<Instant>,
    /// Its submitter's [`Ticket`], if it waits with a bound.
    pub ticket: Option<Arc<Ticket>>,
    /// `None` once called.
    done: Option<Done>,
    /// Given back just before the completion runs (a submitter that hears back may submit
    /// again at once), or when the job is dropped.
    permit: Option<Permit>,
}

impl Job {
    /// Runs the completion (once), after giving the batch's place in the queue back.
    pub fn complete(&mut self, outcome: Outcome) {
        drop(self.permit.take());
        if let Some(done) = self.done.take() {
            done(outcome);
        }
        if let Some(t) = &self.ticket {
            t.finished();
        }
    }

    /// [`Ticket::start_with`] for this batch (`reserve` runs as it is without a ticket).
    pub fn start_with<R>(
        &self,
        reserve: impl FnOnce() -> R,
        started: impl FnOnce(&R) -> bool,
    ) -> Option<R> {
        match &self.ticket {
            None => Some(reserve()),
            Some(t) => t.start_with(reserve, started),
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // Accepted and never completed: the writer stopped first.
        self.complete(Err(Error::WriterStopped));
    }
}

/// One held batch; see the module docs.
struct Permit(Arc<Shared>);

impl Drop for Permit {
    fn drop(&mut self) {
        let mut held = self.0.held.lock().unwrap_or_else(|p| p.into_inner());
        *held = held.saturating_sub(1);
        self.0.room.notify_one();
    }
}

/// State shared between the writer thread and its handles.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    pub stats: Stats,
    /// Set when the owner drops the writer: queued batches are still placed, waits end.
    pub closing: AtomicBool,
    /// Bumped by the writer after every change of state; `wait_for` sleeps on `changed`.
    version: Mutex<u64>,
    changed: Condvar,
    /// Batches submitted and not yet completed: at most `max_pending_batches`.
    held: Mutex<usize>,
    room: Condvar,
    /// Jobs sent and jobs the writer has taken: the queue is non-empty while they differ.
    sent: AtomicU64,
    taken: AtomicU64,
    /// True while the writer is about to block (or blocked) in `poll`.
    sleeping: AtomicBool,
    /// Someone asked for the per-store usage table; the writer answers in `usage`.
    pub usage_wanted: AtomicBool,
    /// The latest per-store usage table and its sequence number.
    pub usage: Mutex<(u64, Vec<crate::arena::StoreUsage>)>,
    /// The session results carry now (set at the start; it changes when a NIXL server process
    /// of the producer's is replaced, noted with the first batch committed after).
    pub session: Mutex<Option<String>>,
    /// Peers whose control connections were closed for the token (the control server notes
    /// them; anyone may read them).
    pub unauthorized: Mutex<crate::report::UnauthorizedPeers>,
    /// Keys this process frees itself ([`crate::Writer::free_local`]), applied at the writer's
    /// next turn.
    pub local_frees: Mutex<Vec<String>>,
    /// Objects whose submitter finished writing them ([`crate::Writer::finish_writes`],
    /// [`crate::Writer::finish_written`]), applied at the writer's next turn.
    pub finished_writes: Mutex<Vec<Finished>>,
}

/// An object whose submitter finished writing it ([`Shared::finished_writes`]).
#[derive(Debug)]
pub enum Finished {
    /// Named by its key, and its stamp where known (then only the object with that stamp):
    /// written (`true`) or never will be.
    Key(String, Option<u64>, bool),
    /// Named by what its writer checked ([`crate::Arena::finish_written`]): written (`true`)
    /// or never will be.
    Written(crate::sample::Written, bool),
    /// A request's objects that never will be written, named by its keys and the stamps it was
    /// given: failed where their sample has an object being written with one of the stamps
    /// (see [`crate::Writer::fail_writes_of`]).
    KeysOf(Vec<String>, Vec<u64>),
}

impl Shared {
    /// Notes the session results carry (after each batch entered: it changes only when a
    /// NIXL server process was replaced).
    pub fn note_session(&self, session: &str) {
        let mut cur = self.session.lock().unwrap_or_else(|p| p.into_inner());
        if cur.as_deref() != Some(session) {
            *cur = Some(session.to_owned());
        }
    }

    /// Wakes `wait_for` callers: counters moved.
    pub fn notify(&self) {
        let mut v = self.version.lock().unwrap_or_else(|p| p.into_inner());
        *v += 1;
        self.changed.notify_all();
    }

    /// True when a job is queued and not yet taken.
    pub fn queued(&self) -> bool {
        self.sent.load(Ordering::SeqCst) != self.taken.load(Ordering::SeqCst)
    }

    /// The writer announces it is about to block; returns false (and stays awake) if a job
    /// arrived meanwhile. Pairs with the check in [`Submitter::send`].
    pub fn try_sleep(&self) -> bool {
        self.sleeping.store(true, Ordering::SeqCst);
        if self.queued() {
            self.sleeping.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// The writer is awake again.
    pub fn awake(&self) {
        self.sleeping.store(false, Ordering::SeqCst);
    }
}

/// The writer's end of the queue.
pub(crate) struct Queue {
    rx: Receiver<Job>,
    shared: Arc<Shared>,
}

/// What [`Queue::next`] found.
pub(crate) enum Next {
    Job(Job),
    Empty,
    /// Every submitter is gone (the writer is being dropped).
    Closed,
}

impl Queue {
    /// The next queued batch, without blocking.
    pub fn next(&self) -> Next {
        match self.rx.try_recv() {
            Ok(job) => {
                self.shared.taken.fetch_add(1, Ordering::SeqCst);
                Next::Job(job)
            }
            Err(TryRecvError::Empty) => Next::Empty,
            Err(TryRecvError::Disconnected) => Next::Closed,
        }
    }
}

/// The submitters' end: a bounded queue in front of the writer.
#[derive(Debug)]
pub(crate) struct Submitter {
    tx: Mutex<Option<Sender<Job>>>,
    waker: Arc<Waker>,
    pub shared: Arc<Shared>,
    max_pending: usize,
}

impl Submitter {
    /// A queue bounded at `max_pending` held batches, waking the writer through `waker`.
    pub fn new(waker: Arc<Waker>, max_pending: usize) -> (Submitter, Queue) {
        // Unbounded channel: the bound is the `held` count, which also counts the batch being
        // placed.
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared::default());
        let queue = Queue {
            rx,
            shared: shared.clone(),
        };
        let submitter = Submitter {
            tx: Mutex::new(Some(tx)),
            waker,
            shared,
            max_pending,
        };
        (submitter, queue)
    }

    /// Asks the writer for a fresh per-store usage table; returns the sequence number the
    /// answer will exceed.
    pub fn request_usage(&self) -> u64 {
        let seq = self
            .shared
            .usage
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0;
        self.shared.usage_wanted.store(true, Ordering::SeqCst);
        let _ = self.waker.wake();
        seq
    }

    /// Stops accepting batches: the writer finishes those queued, then sees the queue closed.
    pub fn close(&self) {
        self.shared.closing.store(true, Ordering::SeqCst);
        drop(self.tx.lock().unwrap_or_else(|p| p.into_inner()).take());
        let _ = self.waker.wake();
    }

    /// Wakes the writer (something other than a batch waits for it).
    pub fn wake(&self) {
        if let Err(e) = self.waker.wake() {
            tracing::warn!(error = %e, "waking the writer failed");
        }
    }

    /// Queues a batch. `stopped` says whether the writer thread has ended (then nothing makes
    /// room). On refusal `done` is dropped without being called.
    ///
    /// # Errors
    /// [`Error::QueueFull`] (only with [`Block::No`]), [`Error::Timeout`] (only with
    /// [`Block::Until`]), [`Error::WriterStopped`].
    pub fn send(
        &self,
        samples: Vec<Sample>,
        done: Done,
        block: Block,
        ticket: Option<Arc<Ticket>>,
        stopped: impl Fn() -> bool,
    ) -> Result<()> {
        let tx = self.sender()?;
        let permit = self.permit(block, &stopped)?;
        let deadline = match block {
            Block::Until(d) => Some(d),
            _ => None,
        };
        let job = Job {
            samples,
            deadline,
            ticket,
            done: Some(done),
            permit: Some(permit),
        };
        self.push(&tx, job, true)
            .map_err(|_refused| Error::WriterStopped)
    }

    /// Queues each sample as a batch of its own, the group counting as one against
    /// `max_pending_batches`, in order, each with `deadline` as its bound on waiting for space
    /// and no ticket: the placer gives each its turn whenever it comes, so a batch whose turn
    /// comes after the deadline is placed if it fits at once and fails at once otherwise.
    /// Returns their handles without waiting for them. `block` says how long to wait for the
    /// group's place in the queue ([`Block::No`] or [`Block::Until`] the deadline); when none
    /// comes, nothing is queued and the samples come back with the error. Once the first is
    /// queued, every later one is too, or (the writer stopped meanwhile) its handle reports
    /// [`Error::WriterStopped`].
    ///
    /// # Errors
    /// As [`Submitter::send`], with the samples.
    pub fn send_each(
        &self,
        samples: Vec<Sample>,
        block: Block,
        deadline: Instant,
        stopped: impl Fn() -> bool,
    ) -> std::result::Result<Vec<BatchHandle>, Box<(Error, Vec<Sample>)>> {
        if samples.is_empty() {
            return Ok(Vec::new());
        }
        let got = self
            .sender()
            .and_then(|tx| Ok((tx, self.permit(block, &stopped)?)));
        let (tx, permit) = match got {
            Ok(got) => got,
            Err(e) => return Err(Box::new((e, samples))),
        };
        let mut permit = Some(permit);
        let n = samples.len();
        let mut handles = Vec::with_capacity(n);
        for (i, s) in samples.into_iter().enumerate() {
            let one = vec![s];
            let (handle, done) = BatchHandle::new(&one);
            handles.push(handle);
            // The last holds the group's permit (the group leaves the count when it completes)
            // and wakes the writer, once for the group: one that sleeps before the last is
            // queued finds every earlier one when it wakes.
            let last = i + 1 == n;
            let p = if last { permit.take() } else { None };
            let job = Job {
                samples: one,
                deadline: Some(deadline),
                ticket: None,
                done: Some(done),
                permit: p,
            };
            if let Err(done) = self.push(&tx, job, last) {
                done(Err(Error::WriterStopped));
            }
        }
        Ok(handles)
    }

    fn sender(&self) -> Result<Sender<Job>> {
        self.tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or(Error::WriterStopped)
    }

    /// One place among the `max_pending` held batches, waiting as `block` says.
    fn permit(&self, block: Block, stopped: &impl Fn() -> bool) -> Result<Permit> {
        let t0 = Instant::now();
        let mut held = self.shared.held.lock().unwrap_or_else(|p| p.into_inner());
        while *held >= self.max_pending {
            if stopped() {
                return Err(Error::WriterStopped);
            }
            // Re-check the writer now and then: a stopped writer makes no room.
            let mut wait = Duration::from_millis(100);
            match block {
                Block::No => {
                    return Err(Error::QueueFull {
                        capacity: self.max_pending,
                    })
                }
                Block::Yes => {}
                Block::Until(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(Error::Timeout {
                            what: "queueing a batch".into(),
                            waited: now - t0,
                            reason: format!(
                                "the writer still held {} earlier batches \
                                 (SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES)",
                                self.max_pending
                            ),
                        });
                    }
                    wait = wait.min(deadline - now);
                }
            }
            held = self
                .shared
                .room
                .wait_timeout(held, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        *held += 1;
        Ok(Permit(self.shared.clone()))
    }

    /// Hands a job to the writer, waking it if it sleeps and `wake` (the last of a group wakes
    /// it for all). On refusal (the writer stopped) its `done` comes back, not called.
    fn push(&self, tx: &Sender<Job>, job: Job, wake: bool) -> std::result::Result<(), Done> {
        if let Err(mpsc::SendError(mut job)) = tx.send(job) {
            // Refused after all: not accepted, so its completion must not run here.
            return match job.done.take() {
                Some(done) => Err(done),
                None => Ok(()),
            };
        }
        self.shared.sent.fetch_add(1, Ordering::SeqCst);
        if wake && self.shared.sleeping.load(Ordering::SeqCst) {
            if let Err(e) = self.waker.wake() {
                // The batch is queued (accepted): the writer finds it at its next wake-up.
                tracing::warn!(error = %e, "waking the writer failed");
            }
        }
        Ok(())
    }
}

/// A handle on a submitted batch.
#[derive(Debug)]
pub struct BatchHandle {
    rx: Receiver<Outcome>,
    sample_ids: Vec<String>,
}

impl BatchHandle {
    /// A handle and the completion that feeds it.
    pub(crate) fn new(samples: &[Sample]) -> (BatchHandle, Done) {
        let (tx, rx) = mpsc::sync_channel(1);
        let sample_ids = samples.iter().map(|s| s.sample_id.clone()).collect();
        let done: Done = Box::new(move |o| {
            let _ = tx.send(o);
        });
        (BatchHandle { rx, sample_ids }, done)
    }

    /// Waits until the writer has copied the batch (or failed it).
    ///
    /// # Errors
    /// The batch's error ([`Error::ArenaFull`], [`Error::KeyExists`], ...), or
    /// [`Error::WriterStopped`].
    pub fn wait(self) -> Outcome {
        let t0 = Instant::now();
        while t0.elapsed() < SPIN {
            match self.rx.try_recv() {
                Ok(o) => return o,
                Err(mpsc::TryRecvError::Disconnected) => return Err(Error::WriterStopped),
                Err(mpsc::TryRecvError::Empty) => std::hint::spin_loop(),
            }
        }
        self.rx.recv().unwrap_or(Err(Error::WriterStopped))
    }

    /// Waits at most `timeout` (the first microseconds spinning, as [`BatchHandle::wait`]: a
    /// batch that completes soon is taken without a wake-up); `None` if the batch is not done
    /// yet.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Outcome> {
        let t0 = Instant::now();
        let spin = SPIN.min(timeout);
        while t0.elapsed() < spin {
            match self.rx.try_recv() {
                Ok(o) => return Some(o),
                Err(mpsc::TryRecvError::Disconnected) => return Some(Err(Error::WriterStopped)),
                Err(mpsc::TryRecvError::Empty) => std::hint::spin_loop(),
            }
        }
        match self.rx.recv_timeout(timeout.saturating_sub(t0.elapsed())) {
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

/// Blocks until `pred` holds for the counters or `timeout` passes; returns whether it held.
pub(crate) fn wait_for(
    shared: &Shared,
    timeout: Duration,
    stopped: impl Fn() -> bool,
    mut pred: impl FnMut() -> bool,
) -> bool {
    let deadline = Instant::now().checked_add(timeout);
    let mut v = shared.version.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        if pred() {
            return true;
        }
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) || stopped() {
            return false;
        }
        // Wake at least every second to notice a writer that stopped.
        let second = Duration::from_secs(1);
        let step = deadline.map_or(second, |d| (d - now).min(second));
        v = shared
            .changed
            .wait_timeout(v, step)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}
