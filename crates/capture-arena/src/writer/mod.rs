//! The writer thread: the only thread that touches the arena, so the arena needs no lock.
//!
//! One mio event loop ties three parts, each in its own module with its invariants:
//! - `queue`: the submitters' side — a bounded queue of batches, permits, batch handles;
//! - `control_server`: the peers' side — control and reply connections, read within budgets,
//!   with bounds on connections, buffered bytes and time;
//! - `placer`: the arena's side — drain → place → wait for space → copy → commit → complete.
//!
//! Each turn of the loop waits for events (not at all if there is work), accepts connections,
//! then gives every ready connection one budgeted turn with a placer step between turns, so a
//! peer that writes as fast as it can neither starves publication nor other peers, and a batch's
//! wait for frees ends on time. After a batch completes, the loop stays awake for a few tens of
//! microseconds before sleeping in `poll`, so the next batch of a busy submitter needs no
//! wake-up; a submitter wakes the loop only when it sleeps.
//!
//! ```text
//!  submit() --[bounded queue]--> placer --copy--> region --result--> handle.wait()
//!                                  ^ frees
//!  trainer --["key", ...]\n--> control server (read only, never written)
//!  local reader --"fd"\n--> reply path --> answer (+ descriptors)
//! ```

mod control_server;
mod placer;
mod queue;

pub use queue::{BatchHandle, Outcome};

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::{Events, Poll, Waker};

use crate::arena::Arena;
use crate::config::Config;
use crate::control;
use crate::error::{Error, Result};
use crate::memory::{Notifier, Region, ShmRegion};
use crate::sample::{ArenaRef, ReservedObjects, Sample, Written};
use crate::stats::StatsSnapshot;
use control_server::{ControlServer, Limits, WAKER};
use placer::{Placer, Step};
use queue::{Block, Finished, Queue, Submitter, Ticket, TicketState, SPIN};

/// The log target of the per-batch timing line (`SGLANG_SPEC_CAPTURE_TIMING=1`); log filters
/// that show warnings only should still let it through (the CLI's and the Python module's do).
pub const TIMING_TARGET: &str = "capture_arena::timing";

/// The running writer: submit batches, read stats. Dropping it stops the thread (after the
/// batches already queued) and removes the region.
#[derive(Debug)]
pub struct Writer {
    submitter: Submitter,
    thread: Option<JoinHandle<()>>,
    arena_ref: ArenaRef,
    memory_session: String,
    reply_endpoint: String,
    capacity: u64,
    local_base: u64,
    reserved: Arc<ReservedObjects>,
}

impl Writer {
    /// Starts a writer over a new region of `config.arena_bytes`, with its control listener
    /// bound: device memory on `config.device` when [`Config::device_publication`] (under
    /// `nvlink`, or `SGLANG_SPEC_CAPTURE_GPU_PUT=1`), else host shared memory.
    ///
    /// # Errors
    /// [`Error::Config`] for invalid settings (the arena size is required; the engine placement,
    /// whose memory only its TransferEngine can give), [`Error::Io`] if the region or the
    /// listener cannot be created, [`Error::Device`] if device publication is asked for without
    /// a usable GPU (or in a build without the `cuda` feature).
    pub fn start(config: &Config) -> Result<Writer> {
        config.validate()?;
        if config.placement() == crate::config::Placement::Engine {
            return Err(Error::config(
                crate::config::ENV_PLACEMENT,
                "the engine placement takes its memory from a Mooncake TransferEngine, which the \
                 Python package creates (capture_arena.ArenaSink); from Rust, pass the engine's \
                 memory to Sink::start_with_region or Writer::start_with_region, or set \
                 SGLANG_SPEC_CAPTURE_PLACEMENT=arena for capture-arena's own arena",
            ));
        }
        let bytes = config.required_arena_bytes()?;
        let region = new_region(config, bytes)?;
        let (listener, control) = control::bind(&config.control_host, config.control_port)?;
        Writer::start_with(config, region, listener, control)
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
        mut region: Box<dyn Region>,
        listener: mio::net::TcpListener,
        control: String,
    ) -> Result<Writer> {
        let poll = Poll::new().map_err(|e| Error::io("creating the writer's poll", e))?;
        let waker = Arc::new(
            Waker::new(poll.registry(), WAKER).map_err(|e| Error::io("creating the waker", e))?,
        );
        region.set_notifier(Notifier(waker.clone()));
        let token = config.resolved_control_token()?;
        let limits = Limits {
            max_connections: config.max_connections,
            buffer_bytes: usize::try_from(config.control_buffer_bytes).unwrap_or(usize::MAX),
            line_timeout: config.line_timeout,
            token: token.clone(),
        };
        let server = ControlServer::new(listener, poll.registry(), limits)?;
        let reply_endpoint = server.reply_endpoint().to_owned();
        region.set_reply_endpoint(&reply_endpoint);
        let memory_session = region.memory_session().to_owned();
        let local_base = region.local_base();
        let mut arena = Arena::new(region, config.alignment, control)?;
        arena.set_control_token(token);
        arena.set_ttl(config.object_ttl);
        let (submitter, queue) = Submitter::new(waker, config.max_pending_batches);
        let shared = submitter.shared.clone();
        shared.stats.set_report(&arena.report());
        let arena_ref = arena.arena_ref().clone();
        shared.note_session(&arena_ref.session);
        let capacity = arena.capacity();
        let reserved = arena.reserved_objects();
        tracing::info!(
            session = %arena_ref.session,
            control = %arena_ref.control,
            reply = %reply_endpoint,
            capacity,
            "arena ready"
        );
        let mut lp = Loop {
            arena,
            poll,
            server,
            placer: Placer::new(config.arena_wait, config.timing, config.device_spin),
            queue,
            shared,
        };
        let thread = std::thread::Builder::new()
            .name("capture-arena-writer".into())
            .spawn(move || lp.run())
            .map_err(|e| Error::io("spawning the writer thread", e))?;
        Ok(Writer {
            submitter,
            thread: Some(thread),
            arena_ref,
            memory_session,
            reply_endpoint,
            capacity,
            local_base,
            reserved,
        })
    }

    /// The objects being written by their submitters
    /// ([`TensorData::Reserved`](crate::tensor::TensorData::Reserved)), by stamp: where each
    /// lies in this process and its length, kept up to date by the writer. A submitter checks each destination against it
    /// before it writes a byte ([`ReservedObjects::check`]).
    pub fn reserved_objects(&self) -> &ReservedObjects {
        &self.reserved
    }

    /// The arena's memory in this process: its address here and its usable bytes (host memory,
    /// or device memory of a device arena).
    pub fn local_region(&self) -> (u64, u64) {
        (self.local_base, self.capacity)
    }

    fn stopped(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Queues a batch, blocking while the queue is full; the returned handle waits for its
    /// results. The samples (and the caller buffers they hold) are dropped once copied.
    ///
    /// # Errors
    /// [`Error::WriterStopped`] if the writer has stopped.
    pub fn submit(&self, samples: Vec<Sample>) -> Result<BatchHandle> {
        let (handle, done) = BatchHandle::new(&samples);
        self.submitter
            .send(samples, done, Block::Yes, None, || self.stopped())?;
        Ok(handle)
    }

    /// As [`Writer::submit`] but never blocks.
    ///
    /// # Errors
    /// [`Error::QueueFull`] when the writer already holds `max_pending_batches` batches.
    pub fn try_submit(&self, samples: Vec<Sample>) -> Result<BatchHandle> {
        let (handle, done) = BatchHandle::new(&samples);
        self.submitter
            .send(samples, done, Block::No, None, || self.stopped())?;
        Ok(handle)
    }

    /// Queues a batch (blocking while the queue is full) and calls `done` when it is copied or
    /// failed: exactly once for an accepted batch (with [`Error::WriterStopped`] if the writer
    /// stops before finishing it), never for a refused one. `done` runs on the writer thread (or
    /// the thread that drops the writer): it must be quick and must not submit to this writer
    /// with blocking submission (only the writer thread makes room in the queue).
    ///
    /// # Errors
    /// [`Error::WriterStopped`] if the writer has stopped (`done` is dropped, not called).
    pub fn submit_with(
        &self,
        samples: Vec<Sample>,
        done: impl FnOnce(Outcome) + Send + 'static,
    ) -> Result<()> {
        self.submitter
            .send(samples, Box::new(done), Block::Yes, None, || self.stopped())
    }

    /// As [`Writer::submit_with`] but never blocks.
    ///
    /// # Errors
    /// [`Error::QueueFull`] when the writer already holds `max_pending_batches` batches,
    /// [`Error::WriterStopped`]; `done` is dropped, not called, then.
    pub fn try_submit_with(
        &self,
        samples: Vec<Sample>,
        done: impl FnOnce(Outcome) + Send + 'static,
    ) -> Result<()> {
        self.submitter
            .send(samples, Box::new(done), Block::No, None, || self.stopped())
    }

    /// Publishes a batch for a caller that may wait at most `within` for it to start: for room
    /// in the queue, behind earlier batches, and for frees (its wait for space is at most
    /// `within`, not `SGLANG_SPEC_CAPTURE_ARENA_WAIT_S`). Once its copy has started it is
    /// waited for to the end (the copy of the caller's own bytes). A batch that did not start
    /// in time is never written: the placer skips it.
    ///
    /// # Errors
    /// [`Error::Timeout`] saying what it waited for (nothing was written), else as
    /// [`BatchHandle::wait`].
    pub fn submit_within(
        &self,
        samples: Vec<Sample>,
        within: Duration,
    ) -> Result<Vec<crate::Published>> {
        let t0 = Instant::now();
        let Some(deadline) = t0.checked_add(within) else {
            return self.submit(samples)?.wait();
        };
        let ticket = Arc::new(Ticket::default());
        let (handle, done) = BatchHandle::new(&samples);
        self.submitter.send(
            samples,
            done,
            Block::Until(deadline),
            Some(ticket.clone()),
            || self.stopped(),
        )?;
        let reason = match ticket.wait_start(deadline) {
            TicketState::Started | TicketState::Finished => return handle.wait(),
            TicketState::WaitingForSpace(needed, free) => placer::full_within(needed, free),
            _ => "earlier batches still held the writer (a batch waiting for frees, or a \
                  large copy)"
                .to_owned(),
        };
        Err(Error::Timeout {
            what: "publishing a batch".into(),
            waited: t0.elapsed(),
            reason,
        })
    }

    /// Publishes each sample as a batch of its own (it is published whole or fails alone),
    /// handed to the writer at once, for a caller whose whole call waits for space at most
    /// `within`: the samples wait for frees, in order, until that one deadline; a sample whose
    /// turn comes after it is placed if it fits at once and fails at once otherwise, so the
    /// call takes `within` plus its own copies, however many samples it has. Unlike
    /// [`Writer::submit_within`] there is no ticket: a sample is never given up for batches
    /// queued ahead of it by other callers, whose placing and copies it waits for (the callers
    /// this is for, the vLLM connector's step, are a writer's only submitter).
    ///
    /// # Errors
    /// Only when nothing could be queued ([`Error::Timeout`] for a writer still holding other
    /// callers' batches at the deadline, [`Error::WriterStopped`]); otherwise one outcome per
    /// sample, in order.
    pub fn submit_each_within(
        &self,
        samples: Vec<Sample>,
        within: Duration,
    ) -> Result<Vec<Outcome>> {
        let handles = self
            .submit_each(samples, deadline_in(within), true)
            .map_err(|e| e.0)?;
        Ok(handles.into_iter().map(BatchHandle::wait).collect())
    }

    /// [`Writer::submit_each_within`] with its deadline, returning the samples' handles as
    /// soon as they are queued, for a caller that waits for them its own way. With
    /// `wait_for_queue` false a writer already holding `max_pending_batches` batches refuses at
    /// once ([`Error::QueueFull`]), so the call never blocks.
    ///
    /// # Errors
    /// When nothing was queued, with the samples back: [`Error::QueueFull`] (without
    /// `wait_for_queue`), [`Error::Timeout`] for a writer still holding other callers' batches
    /// at the deadline, [`Error::WriterStopped`].
    pub fn submit_each(
        &self,
        samples: Vec<Sample>,
        deadline: Instant,
        wait_for_queue: bool,
    ) -> std::result::Result<Vec<BatchHandle>, Box<(Error, Vec<Sample>)>> {
        let block = if wait_for_queue {
            Block::Until(deadline)
        } else {
            Block::No
        };
        self.submitter
            .send_each(samples, block, deadline, || self.stopped())
    }

    /// Frees `keys` from this process, without a control connection (a capture the producer
    /// itself drops): applied at the writer's next turn, counted in `freed_objects` and
    /// `local_freed_objects`. Keys not resident are counted in `unknown_frees`.
    pub fn free_local(&self, keys: impl IntoIterator<Item = String>) {
        let mut q = self
            .submitter
            .shared
            .local_frees
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let before = q.len();
        q.extend(keys);
        let added = q.len() > before;
        drop(q);
        if added {
            self.submitter.wake();
        }
    }

    /// Finishes the writes of objects published from reserved tensors
    /// ([`TensorData::Reserved`](crate::tensor::TensorData::Reserved)), whose submitter wrote
    /// their bytes itself: with `ok`, every byte of each is in place (and visible to other
    /// processes: a device copy has completed), and readers may read them; without, they never
    /// will be, readers fail and their space is freed. A free asked for while an object was
    /// written is applied now. Applied at the writer's next turn, counted in `written_objects`
    /// and `failed_writes`; keys not being written are ignored.
    pub fn finish_writes(&self, keys: impl IntoIterator<Item = String>, ok: bool) {
        self.finished(keys.into_iter().map(|k| Finished::Key(k, None, ok)));
    }

    /// Fails a request's objects that never will be written, named by its `keys` and the
    /// `stamps` it was given: those of every sample under whose key lies an object being
    /// written with one of the stamps (the request's own, even where another of its stamps is
    /// wrong); none of another sample (keys mixed up with another request's: its objects stay
    /// for their own copy). Applied at the writer's next turn, counted in `failed_writes`.
    pub fn fail_writes_of(&self, keys: Vec<String>, stamps: Vec<u64>) {
        self.finished(std::iter::once(Finished::KeysOf(keys, stamps)));
    }

    /// [`Writer::finish_writes`] for objects named by their key and the stamp their result
    /// gives: each acts only on the object under its key with that stamp, so a late or repeated
    /// finish of a result never finishes (or fails) a newer object published under its key.
    pub fn finish_writes_stamped(
        &self,
        objects: impl IntoIterator<Item = (String, u64)>,
        ok: bool,
    ) {
        self.finished(
            objects
                .into_iter()
                .map(|(k, stamp)| Finished::Key(k, Some(stamp), ok)),
        );
    }

    /// [`Writer::finish_writes`] for objects named by what their submitter checked before
    /// writing ([`Arena::finish_written`]): each one's stamp, where its bytes went and how many.
    /// So a submitter finishes (`ok`) or fails exactly the objects it wrote, whatever keys its
    /// bookkeeping holds: with `ok`, an object that does not lie where its bytes went is failed;
    /// without, one that does not lie there is left to its own writer. Applied at the writer's
    /// next turn, counted as [`Writer::finish_writes`]; stamps of no object being written are
    /// ignored.
    pub fn finish_written(&self, objects: impl IntoIterator<Item = Written>, ok: bool) {
        self.finished(objects.into_iter().map(|w| Finished::Written(w, ok)));
    }

    fn finished(&self, done: impl Iterator<Item = Finished>) {
        let mut q = self
            .submitter
            .shared
            .finished_writes
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let before = q.len();
        q.extend(done);
        let added = q.len() > before;
        drop(q);
        if added {
            self.submitter.wake();
        }
    }

    /// Peers whose control connections were closed for the control token, the most recent
    /// first: readers that free without it (their frees were not applied).
    pub fn unauthorized_peers(&self) -> Vec<crate::report::UnauthorizedPeer> {
        self.submitter
            .shared
            .unauthorized
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .rows(Instant::now())
    }

    /// The session and control endpoint results carry now (the session changes when a NIXL
    /// server process of the producer's is replaced: the results committed after carry the new
    /// one).
    pub fn arena_ref(&self) -> ArenaRef {
        let mut r = self.arena_ref.clone();
        if let Some(s) = self
            .submitter
            .shared
            .session
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            r.session.clone_from(s);
        }
        r
    }

    /// Resident objects per `store_id` (largest first) with the age of each store's oldest:
    /// who holds the arena, and since when. The writer computes it on request (one pass over
    /// its table); `None` if it does not answer within a second (stopped).
    pub fn store_usage(&self) -> Option<Vec<crate::arena::StoreUsage>> {
        let seq = self.submitter.request_usage();
        let usage = || {
            self.submitter
                .shared
                .usage
                .lock()
                .unwrap_or_else(|p| p.into_inner())
        };
        let ok = queue::wait_for(
            &self.submitter.shared,
            Duration::from_secs(1),
            || self.stopped(),
            || usage().0 > seq,
        );
        ok.then(|| usage().1.clone())
    }

    /// The session of the arena's memory itself: the `shm://` object behind a `nixl://` session
    /// (what to remove if the process is stopped by a signal), else the result's session.
    pub fn memory_session(&self) -> &str {
        &self.memory_session
    }

    /// The local reply path's endpoint (`@capture-arena-reply-<pid>-<nonce>`): see
    /// [`crate::reply`].
    pub fn reply_endpoint(&self) -> &str {
        &self.reply_endpoint
    }

    /// Usable bytes of the arena.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The writer's counters.
    pub fn stats(&self) -> StatsSnapshot {
        self.submitter.shared.stats.snapshot()
    }

    /// Blocks until `pred` holds for the counters or `timeout` passes; returns the last snapshot
    /// and whether `pred` held. Wakes on every change the writer makes (no polling).
    pub fn wait_for(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&StatsSnapshot) -> bool,
    ) -> (StatsSnapshot, bool) {
        let ok = queue::wait_for(
            &self.submitter.shared,
            timeout,
            || self.stopped(),
            || pred(&self.stats()),
        );
        (self.stats(), ok)
    }
}

/// Objects a lease frees per turn of the writer's loop, at most.
const EXPIRE_PER_TURN: usize = 4096;

/// The region [`Writer::start`] makes for `config`: host or device memory, registered with a
/// NIXL agent when `SGLANG_SPEC_CAPTURE_TRANSPORT=nixl`.
fn new_region(config: &Config, bytes: u64) -> Result<Box<dyn Region>> {
    let region = own_region(config, bytes)?;
    if config.transport != crate::config::ArenaTransport::Nixl {
        return Ok(region);
    }
    #[cfg(feature = "nixl")]
    {
        use crate::memory::nixl::{NixlMem, NixlRegion};
        let t0 = Instant::now();
        let (mem, dev) = if config.device_publication() {
            (NixlMem::Vram, config.device.unwrap_or(0).max(0) as u32)
        } else {
            (NixlMem::Dram, 0)
        };
        let server = match mem {
            NixlMem::Dram => crate::config::nixl_server()?,
            // A device arena is served in-process (its server would import the handle).
            NixlMem::Vram => None,
        };
        let region = match server {
            Some(command) => NixlRegion::served(region, &command, &config.control_host)?,
            None => NixlRegion::new(region, mem, dev, &config.control_host)?,
        };
        tracing::info!(
            agent = %region.agent_name(),
            server_pid = ?region.server_pid(),
            ms = t0.elapsed().as_secs_f64() * 1e3,
            "arena served through NIXL"
        );
        Ok(Box::new(region))
    }
    #[cfg(not(feature = "nixl"))]
    Err(Error::config(
        crate::config::ENV_TRANSPORT,
        "nixl needs a build of capture-arena with the nixl feature",
    ))
}

/// capture-arena's own memory for `config`: a device region or host shared memory.
fn own_region(config: &Config, bytes: u64) -> Result<Box<dyn Region>> {
    let t0 = Instant::now();
    if config.device_publication() {
        #[cfg(feature = "cuda")]
        {
            let options = crate::memory::cuda::DeviceRegionOptions {
                device: config.device.unwrap_or(0),
                handle: config.handle,
            };
            let region = crate::memory::cuda::DeviceRegion::create(bytes, &options)?;
            tracing::info!(
                bytes = region.len(),
                device = options.device,
                handle = region.handle_choice().handle.name(),
                ms = t0.elapsed().as_secs_f64() * 1e3,
                "device arena created"
            );
            return Ok(Box::new(region));
        }
        #[cfg(not(feature = "cuda"))]
        return Err(Error::device(
            "creating a device arena",
            "this build of capture-arena has no cuda feature; rebuild with --features cuda, \
             or publish from host memory (unset SGLANG_SPEC_CAPTURE_GPU_PUT and \
             MOONCAKE_PROTOCOL=nvlink)",
        ));
    }
    let region = ShmRegion::create(bytes)?;
    tracing::info!(
        bytes,
        ms = t0.elapsed().as_secs_f64() * 1e3,
        "shared-memory arena created and pre-faulted"
    );
    Ok(Box::new(region))
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.submitter.close();
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("the capture-arena writer thread panicked");
            }
        }
    }
}

/// The writer thread's state; see the module docs. Dropping it (the loop ended, or the thread
/// unwinds) stops a copy in flight before its sources go.
struct Loop {
    arena: Arena,
    poll: Poll,
    server: ControlServer,
    placer: Placer,
    queue: Queue,
    shared: Arc<queue::Shared>,
}

impl Drop for Loop {
    fn drop(&mut self) {
        self.placer.abandon(&mut self.arena);
    }
}

impl Loop {
    fn run(&mut self) {
        let mut events = Events::with_capacity(256);
        let mut hot_until = Instant::now();
        loop {
            self.wait(&mut events, hot_until);
            for ev in events.iter() {
                if ev.token() != WAKER {
                    self.server.on_event(ev.token());
                }
            }
            self.answer_usage();
            let mut peers = self.expire() | self.free_local() | self.finish_writes();
            let registry = self.poll.registry();
            peers |= self.server.tick(registry, &self.shared.stats);
            peers |= self.server.accept(registry, &self.shared.stats);
            // One round: every connection ready now gets one turn, the placer a step between
            // turns; connections with more to read wait for the next round, after the next poll
            // has brought in everyone else's events.
            let mut step = self.placer.step(&mut self.arena, &self.queue, &self.shared);
            let mut busy = step == Step::Busy;
            let round = self.server.ready_len();
            let mut turns = 0;
            while turns < round {
                let registry = self.poll.registry();
                let Some(freed) = self.server.serve_one(
                    registry,
                    &mut self.arena,
                    &self.shared.stats,
                    &self.shared.unauthorized,
                ) else {
                    break;
                };
                if freed {
                    self.placer.arena_changed();
                }
                turns += 1;
                if self.placer.has_work(&self.shared) {
                    step = self.placer.step(&mut self.arena, &self.queue, &self.shared);
                    busy |= step == Step::Busy;
                }
            }
            if turns > 0 || peers {
                self.server.publish_gauges(&self.shared.stats);
                // Counters (frees, bad lines, connections) may have moved: wake `wait_for`.
                self.shared.notify();
            }
            if self.placer.has_work(&self.shared) {
                step = self.placer.step(&mut self.arena, &self.queue, &self.shared);
                busy |= step == Step::Busy;
            }
            if busy {
                hot_until = Instant::now() + SPIN;
            }
            if step == Step::Closed {
                tracing::debug!("writer stopping: every submitter is gone");
                return;
            }
        }
    }

    /// Waits for events: not at all while there is work; after recent activity, spins briefly
    /// for a new batch before sleeping; then sleeps in `poll` until an event, a timer or a
    /// waiting batch's deadline.
    /// Answers a request for the per-store usage table.
    fn answer_usage(&mut self) {
        if !self
            .shared
            .usage_wanted
            .swap(false, std::sync::atomic::Ordering::SeqCst)
        {
            return;
        }
        let table = self.arena.store_usage(Instant::now());
        {
            let mut u = self.shared.usage.lock().unwrap_or_else(|p| p.into_inner());
            u.0 += 1;
            u.1 = table;
        }
        self.shared.notify();
    }

    /// Applies the frees this process asked for ([`Writer::free_local`]); true if any.
    fn free_local(&mut self) -> bool {
        let keys = std::mem::take(
            &mut *self
                .shared
                .local_frees
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        if keys.is_empty() {
            return false;
        }
        let (mut objects, mut bytes) = (0, 0);
        for k in &keys {
            if let Some(b) = self.arena.free(k) {
                objects += 1;
                bytes += b;
            }
        }
        let stats = &self.shared.stats;
        if objects > 0 {
            stats.set_report(&self.arena.report());
            self.placer.arena_changed();
        }
        crate::stats::bump(&stats.unknown_frees, keys.len() as u64 - objects);
        crate::stats::bump(&stats.freed_bytes, bytes);
        crate::stats::bump(&stats.local_freed_objects, objects);
        crate::stats::bump(&stats.freed_objects, objects);
        true
    }

    /// Applies the finished writes this process reported ([`Writer::finish_writes`]); true if
    /// any.
    fn finish_writes(&mut self) -> bool {
        let done = std::mem::take(
            &mut *self
                .shared
                .finished_writes
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        if done.is_empty() {
            return false;
        }
        let (mut written, mut failed, mut failed_bytes) = (0, 0, 0);
        for d in done {
            let finished = match d {
                Finished::Key(k, stamp, ok) => vec![self
                    .arena
                    .finish_write_if(&k, stamp, ok)
                    .map(|freed| (ok, freed))],
                Finished::Written(w, ok) => vec![self.arena.finish_written(w, ok)],
                Finished::KeysOf(keys, stamps) => {
                    // The samples whose objects the request names with its own stamps: its
                    // keys of those samples are its own (one of its stamps may be wrong), any
                    // other key another request's.
                    let own: Vec<&str> = keys
                        .iter()
                        .filter(|k| {
                            self.arena
                                .writing_stamp(k)
                                .is_some_and(|s| stamps.contains(&s))
                        })
                        .map(|k| sample_of(k))
                        .collect();
                    keys.iter()
                        .filter(|k| own.contains(&sample_of(k)))
                        .map(|k| {
                            self.arena
                                .finish_write(k, false)
                                .map(|freed| (false, freed))
                        })
                        .collect()
                }
            };
            for f in finished {
                match f {
                    Some((true, _)) => written += 1,
                    Some((false, freed)) => {
                        failed += 1;
                        failed_bytes += freed;
                    }
                    None => {}
                }
            }
        }
        let stats = &self.shared.stats;
        // Failed writes, and frees asked for while objects were written, made room.
        stats.set_report(&self.arena.report());
        self.placer.arena_changed();
        crate::stats::bump(&stats.written_objects, written);
        crate::stats::bump(&stats.failed_writes, failed);
        crate::stats::bump(&stats.failed_write_bytes, failed_bytes);
        if failed > 0 {
            tracing::warn!(
                objects = failed,
                "objects published before their bytes were never written: their readers fail, \
                 their space is free again (counted in failed_writes)"
            );
        }
        true
    }

    /// Frees objects whose lease ended (a bounded number per turn); true if any.
    fn expire(&mut self) -> bool {
        if self.arena.next_expiry().is_none_or(|t| t > Instant::now()) {
            return false;
        }
        let (objects, bytes) = self.arena.expire(Instant::now(), EXPIRE_PER_TURN);
        if objects == 0 {
            return false;
        }
        let stats = &self.shared.stats;
        stats.set_report(&self.arena.report());
        crate::stats::bump(&stats.expired_bytes, bytes);
        crate::stats::bump(&stats.expired_objects, objects);
        self.placer.arena_changed();
        tracing::warn!(
            objects,
            bytes,
            "objects not freed within SGLANG_SPEC_CAPTURE_OBJECT_TTL_S were freed (counted in \
             expired_objects)"
        );
        true
    }

    fn wait(&mut self, events: &mut Events, hot_until: Instant) {
        let work = self.server.has_work() || self.placer.has_work(&self.shared);
        let timeout = if work {
            Some(Duration::ZERO)
        } else {
            while Instant::now() < hot_until && !self.shared.queued() {
                std::hint::spin_loop();
            }
            if self.shared.queued() || !self.shared.try_sleep() {
                Some(Duration::ZERO)
            } else {
                let now = Instant::now();
                [
                    self.server.next_timer(),
                    self.placer.deadline(),
                    self.arena.next_expiry(),
                ]
                .into_iter()
                .flatten()
                .min()
                .map(|t| t.saturating_duration_since(now))
            }
        };
        if let Err(e) = self.poll.poll(events, timeout) {
            events.clear();
            if e.kind() != std::io::ErrorKind::Interrupted {
                tracing::error!(error = %e, "writer poll failed");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        self.shared.awake();
    }
}

pub use crate::limits::deadline_in;

/// The sample part of an object key (`{store_id}/{sample_id}/g{gen}`): all but its name.
fn sample_of(key: &str) -> &str {
    key.rsplit_once('/').map_or(key, |(sample, _)| sample)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{Dtype, Tensor, TensorData};

    fn one(id: &str, bytes: usize) -> Vec<Sample> {
        let mut s = Sample::new("st", id, 1).unwrap();
        let data = TensorData::host(vec![7u8; bytes]);
        s.push(Tensor::new("t", vec![bytes as u64], Dtype::Uint8, data).unwrap())
            .unwrap();
        vec![s]
    }

    /// The placer's side of the race `submit_within` has with it: when the submitter's bound
    /// runs out while the batch waits for frees and the placer gets there first (the submitter
    /// here never gives up), the batch fails with the same timeout, not "arena full".
    #[test]
    fn a_bounded_batch_the_placer_gives_up_on_fails_with_the_callers_timeout() {
        let config = Config {
            arena_bytes: Some(1 << 20),
            arena_wait: Duration::from_secs(30),
            ..Config::default()
        };
        let w = Writer::start(&config).unwrap();
        w.submit(one("first", 700 << 10)).unwrap().wait().unwrap();
        let deadline = Instant::now() + Duration::from_millis(100);
        let (handle, done) = BatchHandle::new(&one("late", 700 << 10));
        w.submitter
            .send(
                one("late", 700 << 10),
                done,
                Block::Until(deadline),
                Some(Arc::new(Ticket::default())),
                || w.stopped(),
            )
            .unwrap();
        match handle.wait() {
            Err(Error::Timeout { reason, .. }) => assert!(reason.contains("arena was full")),
            other => panic!("{other:?}"),
        }
    }
}
