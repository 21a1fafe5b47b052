//! Reads through NIXL: one-sided READs from an arena another process (on any host) registered
//! with its NIXL agent ([`crate::memory::nixl`]).
//!
//! One reader agent per producer host, made on first use, loads each producer's metadata from
//! its session once; a [`NixlTransport`] per session then turns every call's reads into one NIXL
//! request (one descriptor per object), posts it and waits for it. The reader agent runs no
//! progress thread: the waiting reader drives UCX itself, polling hot for a few microseconds,
//! then yielding, then sleeping in 50 µs steps, so a long read over TCP leaves the core to the
//! producer's progress thread.
//!
//! Destinations are registered with the reader agent: inside a [`super::ReadBuffer`] once per
//! buffer, otherwise for that one read.
//!
//! A producer that is gone, restarted or unreachable: when UCX fails the transfer (a refused or
//! lost connection; NIXL's UCX backend runs in peer error-handling mode), the read fails with
//! [`Error::StaleSession`], the producer is remembered as gone (its sessions then fail at once)
//! and its metadata is dropped once no read of it is in flight. A producer that stops answering
//! without UCX noticing (a stopped process or a partitioned network over TCP, where the emulated
//! READ needs the producer's progress) is cut off by `SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S`: the
//! read fails, and the reader agent is retired with the request still in it: never driven
//! again (over TCP and shared memory nothing is written without that), never destroyed, its
//! registrations kept; the next session opened gets a new agent. One NIXL request is in flight
//! per agent at a time (a read of several objects is one request), so a retired agent has no
//! other reads to finish; reads from producers on different hosts run side by side.
//!
//! Loading a producer's metadata connects to it, which blocks as long as the network says
//! (minutes in a partition): it runs on a thread of its own and the caller waits at most the
//! read timeout, after which the agent is retired the same way. The load holds the agent's NIXL
//! lock meanwhile, and other reads through that agent wait for it: with an agent per producer
//! host, those are only reads from the host that does not answer. UCX opens its TCP devices when
//! an agent is made: an agent made while a NIC had no carrier never uses that NIC, so when an
//! interface comes up that was not usable then (looked at once a second, on opens), a new agent
//! is made and the old one retired. A failed or timed-out read never says the producer is gone
//! ([`Transport::is_gone`] is false): its frees are still sent.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nixl_sys::{MemType, XferDescList, XferOp, XferStatus};

use super::{buffer, Destination, ReadOp, Transport};
use crate::error::{Error, Result};
use crate::memory::nixl::{new_agent, AgentHandle, NixlMem, NixlSession, Span};

/// A reader agent of this process (one per producer host) and the producers whose metadata it
/// holds.
struct ReaderAgent {
    handle: AgentHandle,
    /// The agent's name, kept here: asking NIXL for it takes the agent's lock, which a load
    /// stuck in `connect()` holds.
    name: String,
    /// Identifies this agent's registrations in the read-buffer registry.
    id: u64,
    pid: u32,
    /// Per producer agent whose metadata is loaded.
    remotes: Mutex<HashMap<String, Remote>>,
    /// Set when a read timed out in this agent: it is never driven again.
    retired: AtomicBool,
    /// The network interfaces that could carry traffic when the agent was made (UCX opens
    /// its TCP devices then, and never again).
    links: Vec<String>,
    /// When the host's interfaces were last compared with `links`.
    links_checked: Mutex<Instant>,
    /// Held by the one request in flight in this agent (see the module docs).
    one_request: Mutex<()>,
}

/// Producer agents found gone (the latest [`MAX_GONE`]): their sessions are refused at once
/// instead of each failing on its own.
static GONE: Mutex<std::collections::VecDeque<String>> =
    Mutex::new(std::collections::VecDeque::new());
/// Reader agents retired after a timed-out read, kept forever: destroying one could complete
/// the abandoned request into memory its caller has reused.
static RETIRED: Mutex<Vec<Arc<ReaderAgent>>> = Mutex::new(Vec::new());

/// One producer's metadata loaded into the reader agent.
#[derive(Debug)]
struct Remote {
    /// Open transports; the metadata is dropped with the last one.
    transports: usize,
    /// Reads in flight: the metadata (and with it the connection and the remote keys those
    /// reads use) is never dropped under them.
    in_flight: usize,
    /// A read found the producer gone: drop the metadata when no read is in flight.
    doomed: bool,
    /// Which load this is: a transport counts only in the load it was opened under.
    load: u64,
}

/// How many gone producer agents a reader remembers.
const MAX_GONE: usize = 1024;

impl fmt::Debug for ReaderAgent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReaderAgent")
            .field("agent", &self.name)
            .finish()
    }
}

impl Drop for ReaderAgent {
    fn drop(&mut self) {
        buffer::release_owner(self.id);
    }
}

/// The reader agents of this process, by producer host.
static READERS: Mutex<Option<HashMap<String, Arc<ReaderAgent>>>> = Mutex::new(None);
/// How often, at most, the host's interfaces are looked at.
const LINKS_EVERY: Duration = Duration::from_secs(1);

/// The host's network interfaces that can carry traffic now: up, with a carrier (loopback
/// aside). Read from sysfs; empty where it cannot be read.
fn usable_links() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/sys/class/net") else {
        return Vec::new();
    };
    let mut links: Vec<String> = dir
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let read = |f: &str| std::fs::read_to_string(e.path().join(f)).unwrap_or_default();
            let flags = u32::from_str_radix(read("flags").trim().trim_start_matches("0x"), 16).ok();
            let up = flags.is_some_and(|f| f & 0x1 != 0); // IFF_UP
            let loopback = flags.is_some_and(|f| f & 0x8 != 0); // IFF_LOOPBACK
            (up && !loopback && read("carrier").trim() == "1").then_some(name)
        })
        .collect();
    links.sort();
    links
}

/// True when an interface can carry traffic now that could not when `agent` was made: UCX
/// never opens it in that agent, so a new agent is made (after a cable came back, say).
fn network_grew(agent: &ReaderAgent) -> bool {
    {
        let mut checked = agent
            .links_checked
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if checked.elapsed() < LINKS_EVERY {
            return false;
        }
        *checked = Instant::now();
    }
    let now = usable_links();
    let grew = now.iter().any(|l| !agent.links.contains(l));
    if grew {
        tracing::info!(
            was = ?agent.links,
            now = ?now,
            "network interfaces came up since the NIXL reader agent was made; making a new one"
        );
    }
    grew
}
static NEXT_AGENT: AtomicU64 = AtomicU64::new(1);
static NEXT_LOAD: AtomicU64 = AtomicU64::new(1);

/// The reader agent of this process for the producers on `host`, made on first use (and again
/// in a forked child, which must not touch its parent's UCX state: the parent's agents are leaked
/// there, never dropped). One agent per producer host: a load stuck connecting to one host (a
/// partition) holds that agent's NIXL lock, and only reads from that host wait behind it; reads
/// from different hosts run side by side.
fn reader_agent(host: &str) -> Result<Arc<ReaderAgent>> {
    let mut guard = READERS.lock().unwrap_or_else(|p| p.into_inner());
    let agents = guard.get_or_insert_with(HashMap::new);
    let pid = std::process::id();
    if agents.values().any(|a| a.pid != pid) {
        // A forked child: the parent's agents are not this process's to use or drop.
        for (_, old) in agents.drain() {
            std::mem::forget(old);
        }
    }
    // Agents no transport uses any more (their hosts' producers gone) are dropped.
    agents.retain(|h, a| h == host || Arc::strong_count(a) > 1);
    if let Some(a) = agents.get(host) {
        if !a.retired.load(Ordering::SeqCst) && !network_grew(a) {
            return Ok(a.clone());
        }
        // Retired (never driven again), or made on a network that has grown since: its
        // transports turn stale and reopen on a new agent.
        if let Some(old) = agents.remove(host) {
            // (Not retire_agent: this thread holds READERS.)
            if !old.retired.swap(true, Ordering::SeqCst) {
                RETIRED.lock().unwrap_or_else(|p| p.into_inner()).push(old);
            }
        }
    }
    let name = format!(
        "capture-arena-reader-{pid}-{:032x}",
        crate::memory::shm::random_nonce()?
    );
    let agent = Arc::new(ReaderAgent {
        handle: new_agent(&name, false)?,
        name: name.clone(),
        id: NEXT_AGENT.fetch_add(1, Ordering::Relaxed),
        pid,
        remotes: Mutex::new(HashMap::new()),
        retired: AtomicBool::new(false),
        links: usable_links(),
        links_checked: Mutex::new(Instant::now()),
        one_request: Mutex::new(()),
    });
    agents.insert(host.to_owned(), agent.clone());
    Ok(agent)
}

/// One producer's arena as this process reads it through NIXL.
pub struct NixlTransport {
    session: NixlSession,
    text: String,
    agent: Arc<ReaderAgent>,
    timeout: Duration,
    /// The generation of the metadata load this transport counts in.
    load: u64,
    /// Set once a read failed: the producer is gone or restarted.
    dead: AtomicBool,
    /// Where stamps are read to: registered once, not for every read.
    stamp_words: std::sync::Mutex<Option<super::ReadBuffer>>,
}

/// Stamps one read of [`NixlTransport::stamps`] takes in its registered buffer.
const STAMP_WORDS: usize = crate::sample::MAX_FEATURES;

impl fmt::Debug for NixlTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NixlTransport")
            .field("session", &self.session)
            .field("dead", &self.dead.load(Ordering::Relaxed))
            .finish()
    }
}

/// A registration made for one read, released when the read is over.
type TempRegistration = Box<dyn Any + Send>;

impl NixlTransport {
    /// Loads the producer's metadata (from the session itself) into this process's reader
    /// agent. Nothing is sent yet: the connection is made by the first read.
    ///
    /// # Errors
    /// [`Error::Transport`] when NIXL cannot be loaded or the agent not made;
    /// [`Error::StaleSession`] when NIXL refuses the metadata or cannot reach the producer.
    pub fn open(session: &NixlSession) -> Result<NixlTransport> {
        let timeout = crate::config::read_timeout()?;
        let agent = reader_agent(&session.host)?;
        if GONE
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&session.agent)
        {
            return Err(Error::StaleSession {
                session: session.to_string(),
                reason: "an earlier read found this producer gone (exited, restarted or \
                         unreachable)"
                    .into(),
            });
        }
        let generation = load_bounded(&agent, session, timeout)?;
        Ok(NixlTransport {
            load: generation,
            text: session.to_string(),
            session: session.clone(),
            agent,
            timeout,
            dead: AtomicBool::new(false),
            stamp_words: std::sync::Mutex::new(None),
        })
    }

    /// The parsed session.
    pub fn nixl_session(&self) -> &NixlSession {
        &self.session
    }

    fn stale(&self, reason: String) -> Error {
        Error::StaleSession {
            session: self.text.clone(),
            reason,
        }
    }

    /// Marks the session dead after a failed transfer, remembers the producer as gone and dooms
    /// its metadata (dropped by the last read in flight, [`NixlTransport::end`]).
    fn kill(&self, reason: String) -> Error {
        if !self.dead.swap(true, Ordering::SeqCst) {
            remember_gone(&self.session.agent);
            let mut remotes = self.agent.remotes.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(r) = remotes.get_mut(&self.session.agent) {
                if r.load == self.load {
                    r.doomed = true;
                }
            }
        }
        tracing::warn!(session = %self.session.agent, %reason, "NIXL session is stale");
        self.stale(reason)
    }

    /// Counts a read in flight on this session's metadata; refuses when it was dropped.
    fn begin(&self) -> Result<()> {
        if self.agent.retired.load(Ordering::SeqCst) {
            self.dead.store(true, Ordering::SeqCst);
            return Err(self.stale(
                "this reader's NIXL agent was retired after a timed-out read; open the session \
                 again"
                    .into(),
            ));
        }
        let mut remotes = self.agent.remotes.lock().unwrap_or_else(|p| p.into_inner());
        match remotes.get_mut(&self.session.agent) {
            Some(r) if r.load == self.load && !r.doomed => {
                r.in_flight += 1;
                Ok(())
            }
            _ => {
                self.dead.store(true, Ordering::SeqCst);
                Err(self.stale("an earlier read found the producer gone".into()))
            }
        }
    }

    /// Ends a read counted by [`NixlTransport::begin`] (its request released): the last read
    /// of a doomed producer drops its metadata.
    fn end(&self) {
        let mut remotes = self.agent.remotes.lock().unwrap_or_else(|p| p.into_inner());
        let Some(r) = remotes.get_mut(&self.session.agent) else {
            return;
        };
        if r.load != self.load {
            return;
        }
        r.in_flight -= 1;
        if r.doomed && r.in_flight == 0 {
            remotes.remove(&self.session.agent);
            if let Err(e) = self
                .agent
                .handle
                .agent
                .invalidate_remote_md(&self.session.agent)
            {
                tracing::debug!(error = %e, agent = %self.session.agent, "dropping metadata");
            }
        }
    }

    /// The local descriptor of one destination, registered with the reader agent (once per
    /// read buffer, or for this read into `temps`).
    fn local(&self, into: &mut Destination<'_>, temps: &mut Vec<TempRegistration>) -> Result<Span> {
        let span = match into {
            Destination::Host(b) => Span {
                addr: b.as_mut_ptr() as u64,
                len: b.len() as u64,
                mem: NixlMem::Dram,
                dev: 0,
            },
            Destination::Device(d) => {
                if d.device() < 0 {
                    return Err(Error::InvalidRead {
                        key: self.text.clone(),
                        reason: format!("device ordinal {} is negative", d.device()),
                    });
                }
                wait_for(d)?;
                Span {
                    addr: d.ptr(),
                    len: d.len(),
                    mem: NixlMem::Vram,
                    dev: d.device() as u64,
                }
            }
        };
        let agent = &self.agent.handle.agent;
        let register = |addr: u64, len: u64| -> Result<Box<dyn Any + Send>> {
            let whole = Span { addr, len, ..span };
            agent
                .register_memory(&whole, None)
                .map(|r| Box::new(r) as Box<dyn Any + Send>)
                .map_err(|e| {
                    Error::transport(
                        format!("registering {len} bytes of read destination with NIXL"),
                        e.to_string(),
                    )
                })
        };
        let in_buffer = span.mem == NixlMem::Dram
            && buffer::ensure_registered(span.addr, span.len, self.agent.id, register)?;
        if !in_buffer {
            temps.push(register(span.addr, span.len)?);
        }
        Ok(span)
    }

    /// Makes, posts and waits for one request; the request is released on return.
    fn transfer(
        &self,
        ldesc: &XferDescList<'_>,
        rdesc: &XferDescList<'_>,
        objects: usize,
        bytes: u64,
    ) -> Result<()> {
        let agent = &self.agent.handle.agent;
        let req = agent
            .create_xfer_req(XferOp::Read, ldesc, rdesc, &self.session.agent, None)
            .map_err(|e| {
                // Nothing was sent: this session is refused from now on, but the producer is
                // not marked gone (a forged session with other bounds must not cut a live
                // producer off).
                self.dead.store(true, Ordering::SeqCst);
                self.stale(format!(
                    "NIXL cannot make a read request for {objects} objects ({e}): the producer's \
                     metadata does not cover these addresses"
                ))
            })?;
        match agent.post_xfer_req(&req, None) {
            // A failed post leaves nothing in flight.
            Err(e) => Err(self.kill(format!(
                "posting the NIXL read failed ({e}): the producer is gone or unreachable"
            ))),
            Ok(_) => match self.wait(&req, bytes) {
                Waited::Done => Ok(()),
                Waited::Failed(reason) => Err(self.kill(reason)),
                Waited::TimedOut(reason) => {
                    // Not remembered as gone: a producer that was only slow or stopped for a
                    // while is read again, through a new agent.
                    self.retire();
                    std::mem::forget(req);
                    self.dead.store(true, Ordering::SeqCst);
                    tracing::warn!(session = %self.session.agent, %reason, "NIXL read timed out");
                    Err(self.stale(reason))
                }
            },
        }
    }

    /// Waits for `req`, polling as the module docs say, until it completes, fails or the read
    /// timeout passes.
    fn wait(&self, req: &nixl_sys::XferRequest, bytes: u64) -> Waited {
        let agent = &self.agent.handle.agent;
        let t0 = Instant::now();
        let deadline = t0.checked_add(self.timeout);
        let mut polls = 0u32;
        loop {
            match agent.get_xfer_status(req) {
                Ok(XferStatus::Success) => return Waited::Done,
                Ok(XferStatus::InProgress) => {}
                Err(e) => {
                    return Waited::Failed(format!(
                        "the NIXL read of {bytes} bytes failed after {:.1} s ({e}): the producer \
                         is gone or restarted, or the network between us is down",
                        t0.elapsed().as_secs_f64()
                    ))
                }
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return Waited::TimedOut(format!(
                    "the NIXL read of {bytes} bytes did not complete in {:.1} s: the producer \
                     does not answer (stopped, or unreachable); raise \
                     SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S for slower links",
                    self.timeout.as_secs_f64()
                ));
            }
            polls = polls.saturating_add(1);
            if polls < 64 {
                std::hint::spin_loop();
            } else if now - t0 < Duration::from_millis(1) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Retires this transport's reader agent after a timed-out read (see the module docs).
    fn retire(&self) {
        retire_agent(&self.agent, "a read timed out");
    }
}

/// Retires `agent`: never driven or destroyed again, its transports stale; the next session
/// opened gets a new agent.
fn retire_agent(agent: &Arc<ReaderAgent>, why: &str) {
    if agent.retired.swap(true, Ordering::SeqCst) {
        return;
    }
    RETIRED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(agent.clone());
    let mut guard = READERS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(agents) = guard.as_mut() {
        agents.retain(|_, a| !Arc::ptr_eq(a, agent));
    }
    tracing::warn!(
        agent = %agent.name,
        why,
        "NIXL reader agent retired; later reads use a new one"
    );
}

/// Loads `session`'s metadata into `agent` (once per producer; later opens count in the same
/// load), on a thread of its own: NIXL connects to the producer while loading, which blocks
/// for as long as the network says (minutes in a partition). The caller waits at most
/// `timeout`; past it the agent is retired (the load holds NIXL's lock for that agent) and the
/// session is stale for now, not gone.
fn load_bounded(agent: &Arc<ReaderAgent>, session: &NixlSession, timeout: Duration) -> Result<u64> {
    let (tx, rx) = std::sync::mpsc::channel();
    let (a, sess) = (agent.clone(), session.clone());
    let spawned = std::thread::Builder::new()
        .name("capture-arena-nixl-load".into())
        .spawn(move || {
            let _ = tx.send(load_metadata(&a, &sess));
        });
    if let Err(e) = spawned {
        return Err(Error::transport(
            "starting a thread to load a producer's NIXL metadata",
            e.to_string(),
        ));
    }
    match rx.recv_timeout(timeout) {
        Ok(r) => r,
        Err(_) => {
            retire_agent(agent, "loading a producer's metadata timed out");
            Err(Error::StaleSession {
                session: session.to_string(),
                reason: format!(
                    "connecting to the producer's NIXL agent did not finish in {:.1} s: it is \
                     unreachable from here now (a partition, a host down); raise \
                     SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S for slower links",
                    timeout.as_secs_f64()
                ),
            })
        }
    }
}

/// Loads `session`'s metadata into `agent` unless it is loaded; counts one more transport in
/// that load and returns its generation.
fn load_metadata(agent: &ReaderAgent, session: &NixlSession) -> Result<u64> {
    let mut remotes = agent.remotes.lock().unwrap_or_else(|p| p.into_inner());
    if !remotes.contains_key(&session.agent) {
        let loaded = agent
            .handle
            .agent
            .load_remote_md(&session.metadata)
            .map_err(|e| Error::StaleSession {
                session: session.to_string(),
                reason: format!(
                    "NIXL cannot load the producer's metadata or connect to its agent ({e}): \
                     the producer is gone or restarted, or unreachable from here"
                ),
            });
        match loaded {
            Ok(name) if name == session.agent => {}
            other => {
                // Not remembered as gone: a load fails at once (a refused connection, or
                // metadata NIXL cannot parse), so a retry costs little, and a forged result
                // cannot make a live producer look gone.
                remotes.remove(&session.agent);
                if let Ok(name) = &other {
                    let _ = agent.handle.agent.invalidate_remote_md(name);
                }
                return Err(other.err().unwrap_or_else(|| Error::InvalidSession {
                    session: session.to_string(),
                    reason: "the metadata names another agent".into(),
                }));
            }
        }
        remotes.insert(
            session.agent.clone(),
            Remote {
                transports: 0,
                in_flight: 0,
                doomed: false,
                load: NEXT_LOAD.fetch_add(1, Ordering::Relaxed),
            },
        );
    }
    let Some(entry) = remotes.get_mut(&session.agent) else {
        return Err(Error::transport("loading NIXL metadata", "entry vanished"));
    };
    entry.transports += 1;
    Ok(entry.load)
}

/// How a wait for a request ended.
enum Waited {
    Done,
    Failed(String),
    TimedOut(String),
}

/// Remembers that producer agent `name` is gone (the latest [`MAX_GONE`] are kept).
fn remember_gone(name: &str) {
    let mut gone = GONE.lock().unwrap_or_else(|p| p.into_inner());
    if !gone.iter().any(|g| g == name) {
        if gone.len() >= MAX_GONE {
            gone.pop_front();
        }
        gone.push_back(name.to_owned());
    }
}

/// Waits for the caller's stream of a device destination (NIXL's copy is outside CUDA streams).
fn wait_for(d: &super::DeviceSlice) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Some(stream) = d.waits_for() {
        return crate::memory::cuda::wait_for_stream(d.device(), stream);
    }
    #[cfg(not(feature = "cuda"))]
    if d.waits_for().is_some() {
        return Err(Error::InvalidRead {
            key: "a device destination".into(),
            reason: "waiting for its stream needs a build with the cuda feature".into(),
        });
    }
    Ok(())
}

impl Drop for NixlTransport {
    fn drop(&mut self) {
        if self.agent.retired.load(Ordering::SeqCst) {
            return; // a retired agent is never called again
        }
        let mut remotes = self.agent.remotes.lock().unwrap_or_else(|p| p.into_inner());
        let Some(r) = remotes.get_mut(&self.session.agent) else {
            return;
        };
        if r.load != self.load {
            return; // dropped and loaded again since: not the load this transport counts in
        }
        r.transports -= 1;
        if r.transports == 0 && r.in_flight == 0 {
            remotes.remove(&self.session.agent);
            if self.agent.pid == std::process::id() {
                let _ = self
                    .agent
                    .handle
                    .agent
                    .invalidate_remote_md(&self.session.agent);
            }
        }
    }
}

impl Transport for NixlTransport {
    fn session(&self) -> &str {
        &self.text
    }

    fn is_live(&self) -> bool {
        !self.dead.load(Ordering::SeqCst) && !self.agent.retired.load(Ordering::SeqCst)
    }

    /// Never provable through NIXL: a failed or timed-out transfer looks the same whether the
    /// producer exited or the network between us is down. The control endpoint tells
    /// (connections refused, or a restarted producer's new token).
    fn is_gone(&self) -> bool {
        false
    }

    fn capacity(&self) -> u64 {
        self.session.len
    }

    fn check(&self, address: u64, len: u64) -> Result<()> {
        super::offset_in(self.session.base, self.session.len, address, len).map(|_| ())
    }

    /// One more READ, into a buffer of this transport's registered once: after the data's
    /// request completed, so a stamp that still matches proves the bytes were the object's.
    fn stamps(&self, at: &[u64]) -> Result<Vec<u64>> {
        const W: usize = crate::sample::STAMP_BYTES as usize;
        let mut guard = self.stamp_words.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            *guard = Some(super::ReadBuffer::new(STAMP_WORDS * W)?);
        }
        let Some(words) = guard.as_mut().filter(|_| at.len() <= STAMP_WORDS) else {
            return Err(Error::InvalidRead {
                key: self.text.clone(),
                reason: format!("{} stamps in one read (at most {STAMP_WORDS})", at.len()),
            });
        };
        super::read_words(self, at, &mut words[..at.len() * W])
    }

    fn read(&self, reads: &mut [ReadOp<'_>]) -> Result<()> {
        for r in reads.iter() {
            self.check(r.address, r.into.len())?;
        }
        if !self.is_live() {
            return Err(self.stale("an earlier read found the producer gone".into()));
        }
        if self.agent.pid != std::process::id() {
            return Err(self.stale("opened by the parent of this forked process".into()));
        }
        let mem: MemType = self.session.mem.mem_type();
        let mut temps: Vec<TempRegistration> = Vec::new();
        let mut local_mem = None;
        let mut local = Vec::with_capacity(reads.len());
        let mut bytes = 0u64;
        for r in reads.iter_mut() {
            if r.into.is_empty() {
                continue;
            }
            let span = self.local(&mut r.into, &mut temps)?;
            if local_mem.is_some_and(|m| m != span.mem) {
                return Err(Error::InvalidRead {
                    key: self.text.clone(),
                    reason: "one NIXL read goes either to host or to device memory, not both; \
                             split the request"
                        .into(),
                });
            }
            local_mem = Some(span.mem);
            bytes += span.len;
            local.push((span, r.address));
        }
        let Some(local_mem) = local_mem else {
            return Ok(());
        };
        let what =
            |e: nixl_sys::NixlError| Error::transport("describing a NIXL read", e.to_string());
        let mut ldesc = XferDescList::new(local_mem.mem_type()).map_err(what)?;
        let mut rdesc = XferDescList::new(mem).map_err(what)?;
        for (span, address) in &local {
            ldesc.add_desc(span.addr as usize, span.len as usize, span.dev);
            rdesc.add_desc(
                *address as usize,
                span.len as usize,
                u64::from(self.session.dev),
            );
        }
        let _one = self
            .agent
            .one_request
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        self.begin()?;
        let r = self.transfer(&ldesc, &rdesc, local.len(), bytes);
        if self.agent.retired.load(Ordering::SeqCst) {
            // Timed out: the request may still complete into these destinations if the agent
            // were ever driven again; it never is, and its registrations stay.
            std::mem::forget(temps);
            return r;
        }
        self.end();
        // Only now, with the request released, may the temporary registrations go.
        drop(temps);
        r
    }
}
