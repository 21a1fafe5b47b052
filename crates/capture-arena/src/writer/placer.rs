//! The placer: takes queued batches one at a time and moves each through
//! drain → place → wait for space → copy → commit → complete.
//!
//! Invariants:
//! - batches are published in the order they were queued, one at a time;
//! - a batch is in exactly one state: waiting for space (nothing of it allocated), copying (its
//!   space reserved, its objects not yet in the table, so no free can touch them), or finished
//!   (committed or failed, and completed exactly once);
//! - a waiting batch is retried only after frees changed the arena, and fails when its wait
//!   (`SGLANG_SPEC_CAPTURE_ARENA_WAIT_S`) runs out or the writer closes; the writer loop checks
//!   both between every connection's turn, so no peer can stretch the wait;
//! - a batch's sources (the samples) live until its copy is done and are dropped before its
//!   completion runs: a submitter that hears back owns its buffers again;
//! - each step does a bounded amount of work (one slice of a host copy, [`COPY_SLICE`]), so
//!   peers are served while a large batch is copied.

use std::sync::atomic::Ordering::Release;
use std::time::{Duration, Instant};

use crate::arena::{Arena, ArenaReport, Reservation};
use crate::error::{Error, Result};
use crate::memory::Progress;
use crate::stats::bump;
use crate::writer::queue::{Job, Next, Queue, Shared};
use crate::writer::TIMING_TARGET;

/// Bytes of a host copy done per step, after which the writer serves control input again:
/// ~25 ms of copying here. Large, because `memcpy` itself moves huge copies best (glibc switches
/// to streaming stores above ~190 MiB on this machine: 4 MiB slices cost a 1 GiB object a fifth
/// of its bandwidth), and because frees applied during a copy cannot make room any sooner: the
/// next batch is placed only once this one is copied.
pub(crate) const COPY_SLICE: u64 = 256 << 20;
/// How often a batch whose copies run on a device is polled, besides its notifier.
const DEVICE_POLL: Duration = Duration::from_millis(50);

enum State {
    Idle,
    /// Does not fit yet; `stale` once frees changed the arena since the last try.
    Waiting {
        job: Job,
        t0: Instant,
        since: Instant,
        deadline: Option<Instant>,
        needed: u64,
        stale: bool,
    },
    /// Reserved and being copied; `remote` while a device copies (the writer polls it for
    /// `device_spin` (`Config::device_spin`), then the region's notifier wakes the writer, and
    /// it polls every [`DEVICE_POLL`] besides).
    Copying {
        job: Job,
        reservation: Reservation,
        t0: Instant,
        t_copy: Instant,
        waited: Duration,
        remote: bool,
    },
}

/// What one [`Placer::step`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Nothing to do (or nothing changed: a batch still waiting for space).
    Idle,
    /// Work was done (or is in flight).
    Busy,
    /// The queue is closed and drained, nothing in flight: the writer may stop.
    Closed,
}

/// See the module docs.
pub(crate) struct Placer {
    state: State,
    wait: Duration,
    timing: bool,
    /// How long a device batch's completion is polled before the writer sleeps on its notifier.
    device_spin: Duration,
}

impl Placer {
    pub fn new(wait: Duration, timing: bool, device_spin: Duration) -> Placer {
        Placer {
            state: State::Idle,
            wait,
            timing,
            device_spin,
        }
    }

    /// Frees changed the arena: a waiting batch tries again.
    pub fn arena_changed(&mut self) {
        if let State::Waiting { stale, .. } = &mut self.state {
            *stale = true;
        }
    }

    /// True if a step now would do work on this thread (so the loop must not block).
    pub fn has_work(&self, shared: &Shared) -> bool {
        match &self.state {
            // Closing: the next step finds the queue closed (or a last batch).
            State::Idle => {
                shared.queued() || shared.closing.load(std::sync::atomic::Ordering::SeqCst)
            }
            State::Waiting {
                stale, deadline, ..
            } => {
                *stale
                    || deadline.is_some_and(|d| Instant::now() >= d)
                    || shared.closing.load(std::sync::atomic::Ordering::SeqCst)
            }
            State::Copying { remote, t_copy, .. } => !remote || t_copy.elapsed() < self.device_spin,
        }
    }

    /// When the writer must look at the placer again whatever else happens: a waiting batch
    /// gives up; a device copy's completion is polled (its notifier is a host function, which
    /// the driver never calls after a context error: the error is read from the batch's event).
    pub fn deadline(&self) -> Option<Instant> {
        match &self.state {
            State::Waiting { deadline, .. } => *deadline,
            State::Copying { remote: true, .. } => Some(Instant::now() + DEVICE_POLL),
            _ => None,
        }
    }

    /// One bounded step.
    pub fn step(&mut self, arena: &mut Arena, queue: &Queue, shared: &Shared) -> Step {
        let state = std::mem::replace(&mut self.state, State::Idle);
        self.state = match state {
            State::Idle => match queue.next() {
                Next::Job(job) => self.start(job, Instant::now(), None, arena, shared),
                Next::Empty => return Step::Idle,
                Next::Closed => return Step::Closed,
            },
            State::Waiting {
                job,
                t0,
                since,
                deadline,
                needed,
                stale,
            } => {
                let now = Instant::now();
                let closing = shared.closing.load(std::sync::atomic::Ordering::SeqCst);
                // Frees that arrived by the deadline get their try before it fails the batch.
                if closing || (!stale && deadline.is_some_and(|d| now >= d)) {
                    bump(&shared.stats.waits, 1);
                    bump(&shared.stats.wait_ns, (now - since).as_nanos() as u64);
                    let e = if closing {
                        Error::WriterStopped
                    } else if job.ticket.is_some() && deadline == job.deadline {
                        // The submitter's bound ran out, not the arena's wait: the same
                        // timeout its submitter reports if it gives up first.
                        Error::Timeout {
                            what: "publishing a batch".into(),
                            waited: t0.elapsed(),
                            reason: full_within(needed, arena.report().free_bytes),
                        }
                    } else {
                        full(needed, &arena.report(), now - since)
                    };
                    self.finish(job, Err(e), arena, shared);
                    State::Idle
                } else if stale {
                    self.start(job, t0, Some((since, deadline, needed)), arena, shared)
                } else {
                    // Nothing changed: still waiting, no work done.
                    self.state = State::Waiting {
                        job,
                        t0,
                        since,
                        deadline,
                        needed,
                        stale,
                    };
                    return Step::Idle;
                }
            }
            State::Copying {
                mut job,
                reservation,
                t0,
                t_copy,
                waited,
                ..
            } => {
                let ops = Arena::copy_ops(&reservation, &job.samples);
                let progress = arena.region_mut().progress(&ops, COPY_SLICE);
                drop(ops);
                match progress {
                    Ok(Progress::Done) => {
                        let p = arena.commit(reservation, &job.samples);
                        shared.note_session(&arena.arena_ref().session);
                        let stats = &shared.stats;
                        stats.set_report(&arena.report());
                        let copy = t_copy.elapsed();
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
                        drop(std::mem::take(&mut job.samples));
                        job.complete(Ok(p.published));
                        shared.notify();
                        State::Idle
                    }
                    Ok(p) => State::Copying {
                        job,
                        reservation,
                        t0,
                        t_copy,
                        waited,
                        remote: p == Progress::Waiting,
                    },
                    Err(e) => {
                        let (n, bytes) = arena.abort(reservation);
                        bump(&shared.stats.replaced_objects, n);
                        bump(&shared.stats.replaced_bytes, bytes);
                        self.finish(job, Err(e), arena, shared);
                        State::Idle
                    }
                }
            }
        };
        Step::Busy
    }

    /// Checks and reserves a batch; starts its copy if it fits, else waits. `waiting` carries
    /// an earlier wait's start, deadline and size.
    fn start(
        &mut self,
        job: Job,
        t0: Instant,
        waiting: Option<(Instant, Option<Instant>, u64)>,
        arena: &mut Arena,
        shared: &Shared,
    ) -> State {
        let tried = job.start_with(
            || {
                arena
                    .check(&job.samples)
                    .and_then(|needed| arena.reserve(&job.samples).map(|r| (needed, r)))
            },
            |r| matches!(r, Ok((_, Some(_)))),
        );
        let Some(reserved) = tried else {
            // Its submitter stopped waiting before it could start: never written.
            let waited = waiting.map_or(Duration::ZERO, |(since, ..)| since.elapsed());
            let e = Error::Timeout {
                what: "a batch submitted with a bound".into(),
                waited,
                reason: "its submitter stopped waiting before it could be placed".into(),
            };
            self.finish(job, Err(e), arena, shared);
            return State::Idle;
        };
        match reserved {
            Err(e) => {
                self.finish(job, Err(e), arena, shared);
                State::Idle
            }
            Ok((_, Some(reservation))) if is_reserved(&job.samples) => {
                // Its submitter writes the bytes: published now, its objects marked as being
                // written (Arena::commit_reserved), nothing to copy here.
                end_wait(waiting, Instant::now(), shared);
                let p = arena.commit_reserved(reservation, &job.samples);
                shared.note_session(&arena.arena_ref().session);
                let stats = &shared.stats;
                stats.set_report(&arena.report());
                bump(&stats.published_batches, 1);
                bump(&stats.published_samples, p.published.len() as u64);
                bump(&stats.published_objects, p.objects);
                bump(&stats.published_bytes, p.bytes);
                bump(&stats.replaced_objects, p.replaced);
                bump(&stats.replaced_bytes, p.replaced_bytes);
                let mut job = job;
                drop(std::mem::take(&mut job.samples));
                job.complete(Ok(p.published));
                shared.notify();
                State::Idle
            }
            Ok((_, Some(reservation))) => {
                let t_copy = Instant::now();
                let waited = end_wait(waiting, t_copy, shared);
                shared.stats.set_report(&arena.report());
                let ops = Arena::copy_ops(&reservation, &job.samples);
                // SAFETY: the job owns the samples the ops' data point into, and stays in the
                // copying state until the region reports the copy done or failed, or until
                // `Placer::abandon` has abandoned it.
                let started = unsafe { arena.region_mut().start(&ops) };
                drop(ops);
                if let Err(e) = started {
                    // The objects it replaced are gone all the same: counted as replaced.
                    let (n, bytes) = arena.abort(reservation);
                    bump(&shared.stats.replaced_objects, n);
                    bump(&shared.stats.replaced_bytes, bytes);
                    self.finish(job, Err(e), arena, shared);
                    return State::Idle;
                }
                State::Copying {
                    job,
                    reservation,
                    t0,
                    t_copy,
                    waited,
                    remote: false,
                }
            }
            Ok((needed, None)) => {
                let (since, deadline) = match waiting {
                    Some((since, deadline, _)) => (since, deadline),
                    None => {
                        let free = arena.report().free_bytes;
                        tracing::debug!(needed, free, "batch waits for frees");
                        shared.stats.waiting_bytes.store(needed, Release);
                        if let Some(t) = &job.ticket {
                            t.waiting(needed, free);
                        }
                        // A wait too long to represent is no deadline at all; a submitter's
                        // bound shortens it.
                        let own = t0.checked_add(self.wait);
                        let deadline = match (own, job.deadline) {
                            (Some(a), Some(b)) => Some(a.min(b)),
                            (a, b) => a.or(b),
                        };
                        (Instant::now(), deadline)
                    }
                };
                State::Waiting {
                    job,
                    t0,
                    since,
                    deadline,
                    needed,
                    stale: false,
                }
            }
        }
    }

    /// Completes a failed batch.
    fn finish(
        &self,
        mut job: Job,
        outcome: Result<Vec<crate::Published>>,
        arena: &Arena,
        shared: &Shared,
    ) {
        let stats = &shared.stats;
        stats.set_report(&arena.report());
        // One batch waits at a time (the placer's): a failed one is not waiting any more.
        stats.waiting_bytes.store(0, Release);
        if let Err(e) = &outcome {
            bump(&stats.failed_batches, 1);
            if matches!(e, Error::Timeout { .. }) {
                // Its submitter gave up and says so itself (one line per batch is enough).
                tracing::debug!(samples = job.samples.len(), error = %e, "capture batch given up");
            } else {
                tracing::warn!(samples = job.samples.len(), error = %e, "capture batch failed");
            }
        }
        // The caller's buffers go before the caller hears back.
        drop(std::mem::take(&mut job.samples));
        job.complete(outcome);
        shared.notify();
    }

    /// Stops a copy in flight (the writer is going away without finishing it).
    pub fn abandon(&mut self, arena: &mut Arena) {
        if let State::Copying { reservation, .. } = std::mem::replace(&mut self.state, State::Idle)
        {
            arena.region_mut().abandon();
            arena.abort(reservation);
        }
    }
}

/// Ends a batch's wait for space, if it waited (`waiting`: since when), as it is placed at
/// `now`: counted in `waits` and `wait_ns`; returns how long it waited.
fn end_wait(
    waiting: Option<(Instant, Option<Instant>, u64)>,
    now: Instant,
    shared: &Shared,
) -> Duration {
    let Some((since, ..)) = waiting else {
        return Duration::ZERO;
    };
    shared.stats.waiting_bytes.store(0, Release);
    let w = now.saturating_duration_since(since);
    bump(&shared.stats.waits, 1);
    bump(&shared.stats.wait_ns, w.as_nanos() as u64);
    w
}

/// True for a batch whose bytes its submitter writes ([`crate::tensor::TensorData::Reserved`]):
/// all of its tensors are reserved ones (a batch mixing them with bytes to copy is refused
/// before it is queued).
fn is_reserved(samples: &[crate::sample::Sample]) -> bool {
    samples
        .iter()
        .flat_map(|s| s.tensors.iter())
        .all(|(_, t)| t.data.is_reserved())
        && samples.iter().any(|s| !s.tensors.is_empty())
}

/// Why a bounded caller's batch did not start: the arena stayed too full until its bound.
pub(crate) fn full_within(needed: u64, free: u64) -> String {
    format!(
        "the arena was full: the batch needs {needed} bytes and {free} were free (frees did \
         not come in time; SGLANG_SPEC_CAPTURE_ARENA_BYTES sets its size)"
    )
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
