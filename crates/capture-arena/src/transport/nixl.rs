//! Reads through NIXL: one-sided READs from an arena another process (on any host) registered
//! with its NIXL agent ([`crate::memory::nixl`]).
//!
//! Up to [`AGENTS_PER_HOST`] reader agents per producer host, made as reads need them; a
//! [`NixlTransport`] per session turns every call's reads into one NIXL request (one descriptor
//! per object) on an agent it leases for that request alone, loading the producer's metadata
//! (from the session) into that agent the first time it uses it. Threads reading the same
//! producers lease different agents, so up to [`AGENTS_PER_HOST`] requests per producer host are
//! in flight at once, each in an agent of its own (a further thread waits for an agent, within
//! its read timeout). Reader agents run no progress thread: the waiting reader drives UCX itself,
//! polling hot for a few microseconds, then yielding, then sleeping in 50 µs steps (times the
//! readers waiting at once, so that the process polls no more often with more threads), so a long
//! read over TCP leaves the core to the producer's progress thread.
//!
//! Opening a session reads the first and last word of the arena it claims: NIXL refuses a
//! request outside the producer's registered memory, so a forged length is refused before a
//! reader allocates anything by it.
//!
//! Destinations are registered with the agent that reads into them: inside a
//! [`super::ReadBuffer`] once per buffer and agent, otherwise for that one read.
//!
//! A producer that is gone, restarted or unreachable: when UCX fails the transfer (a refused or
//! lost connection; NIXL's UCX backend runs in peer error-handling mode), the read fails with
//! [`Error::StaleSession`], the producer is remembered as gone (its sessions then fail at once)
//! and its metadata is dropped once no read of it is in flight. A producer that stops answering
//! without UCX noticing (a stopped process or a partitioned network over TCP, where the emulated
//! READ needs the producer's progress) is cut off by `SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S`: the
//! read fails, and its agent is retired with the request still in it: never driven again (over
//! TCP and shared memory nothing is written without that), never destroyed, its registrations
//! kept; later reads use the host's other agents or a new one. Because an agent carries one
//! request at a time, a retired agent has no other reads to finish, and the other agents' reads
//! go on.
//!
//! Loading a producer's metadata connects to it, which blocks as long as the network says
//! (minutes in a partition): it runs on a thread of its own and the caller waits at most what is
//! left of its read timeout, after which that agent is retired the same way (the load holds the
//! agent's NIXL lock meanwhile; no other thread uses a leased agent) until the load ends, when
//! it is destroyed (it holds no request). At most [`MAX_STUCK_LOADS`] such loads per producer
//! at once: past them, reads from it fail at once until one ends, so a partition costs a
//! bounded number of threads, agents and sockets however many reads are tried meanwhile. UCX opens its TCP devices
//! when an agent is made: an agent made while a NIC had no carrier never uses that NIC, so when
//! an interface comes up that was not usable then (looked at once a second, when an agent is
//! leased), the agent is retired and a new one made. A failed or timed-out read never says the
//! producer is gone ([`Transport::is_gone`] is false): its frees are still sent.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use nixl_sys::{MemType, XferDescList, XferOp, XferStatus};

use super::{buffer, Destination, ReadOp, Transport};
use crate::error::{Error, Result};
use crate::memory::nixl::{new_agent, AgentHandle, NixlMem, NixlSession, Span};

/// A reader agent of this process (up to [`AGENTS_PER_HOST`] per producer host) and the producers whose metadata it
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
    /// Leased to a thread for one request ([`Lease`]); changed only under [`READERS`].
    busy: AtomicBool,
}

/// Producer agents found gone (the latest [`MAX_GONE`]), with when: for [`GONE_FOR`] their
/// sessions are refused at once instead of each failing on its own.
static GONE: Mutex<std::collections::VecDeque<(String, Instant)>> =
    Mutex::new(std::collections::VecDeque::new());
/// How long a producer agent found gone is refused without a try. A failed transfer looks the
/// same whether the producer exited or its connection broke (a reset, a partition UCX reported
/// as an error): past this, the next open tries it again, so a live producer is read again
/// once the network is back, and a gone one fails again at once (refused).
pub const GONE_FOR: Duration = Duration::from_secs(10);
/// Reader agents retired after a timed-out read, kept forever: destroying one could complete
/// the abandoned request into memory its caller has reused. Those retired while a load of
/// metadata ran in them hold no request, and are let go once that load ends ([`STUCK_LOADS`]).
static RETIRED: Mutex<Vec<Arc<ReaderAgent>>> = Mutex::new(Vec::new());

/// Loads of a producer's metadata under way, or stuck past their caller's read timeout (blocked
/// in `connect()`: a partition, a host down), as (producer agent, the id of the agent the load
/// runs in). At most [`MAX_STUCK_LOADS`] per producer: past it, its loads fail at once until
/// one of them ends. An agent whose load outlived its caller is retired, and let go (destroyed)
/// once the load ends: it was leased for the load alone, so it has no request in flight.
static STUCK_LOADS: Mutex<StuckLoads> = Mutex::new(StuckLoads {
    pid: 0,
    loads: Vec::new(),
});

/// [`STUCK_LOADS`]' table, of the process `pid`: a forked child starts with none (the loads
/// are its parent's, whose threads it does not have, so none of them would ever end there).
#[derive(Debug)]
struct StuckLoads {
    pid: u32,
    loads: Vec<(String, u64)>,
}
/// The most loads of one producer's metadata at once, under way or stuck past their read
/// timeout (blocked in `connect()`); past it, reads from that producer fail at once until one
/// ends. Each costs a thread, its reader agent and the agent's UCX sockets until its connect
/// ends. (Under way, they are at most [`AGENTS_PER_HOST`] anyway: one per agent.)
pub const MAX_STUCK_LOADS: usize = AGENTS_PER_HOST;

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

/// The reader agents of this process, by producer host ([`AGENTS_PER_HOST`] at most each).
static READERS: Mutex<Option<Readers>> = Mutex::new(None);
/// Signalled (under [`READERS`]) when a lease ends.
static HANDED_BACK: Condvar = Condvar::new();
/// The most reader agents per producer host, and so the most requests in flight to one host.
pub const AGENTS_PER_HOST: usize = 4;

/// See [`READERS`].
struct Readers {
    /// The process the agents belong to: a forked child must not touch its parent's UCX state.
    pid: u32,
    hosts: HashMap<String, Vec<Arc<ReaderAgent>>>,
}

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

/// A reader agent that one thread uses, alone, for one request (and the metadata load and
/// registrations it needs); handed back when dropped.
struct Lease(Arc<ReaderAgent>);

impl std::ops::Deref for Lease {
    type Target = Arc<ReaderAgent>;
    fn deref(&self) -> &Arc<ReaderAgent> {
        &self.0
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let _readers = READERS.lock().unwrap_or_else(|p| p.into_inner());
        self.0.busy.store(false, Ordering::SeqCst);
        HANDED_BACK.notify_all();
    }
}

/// Leases a reader agent for the producers on `host`: a free one, those in `loaded` (holding
/// the producer's metadata already) first; else a new one while the host has fewer than
/// [`AGENTS_PER_HOST`]; else waits for one to be handed back until `until`. An agent made on a
/// network that has grown since is retired instead of leased (UCX would never use the new
/// interface through it). In a forked child the parent's agents are leaked there, never used
/// or dropped.
fn lease(host: &str, loaded: &[u64], until: Option<Instant>) -> Result<Lease> {
    let mut guard = READERS.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        let pid = std::process::id();
        let readers = guard.get_or_insert_with(|| Readers {
            pid,
            hosts: HashMap::new(),
        });
        if readers.pid != pid {
            for (_, agents) in readers.hosts.drain() {
                for old in agents {
                    std::mem::forget(old);
                }
            }
            readers.pid = pid;
        }
        // Hosts whose agents no transport uses any more (their producers gone) are dropped.
        readers
            .hosts
            .retain(|h, agents| h == host || agents.iter().any(|a| Arc::strong_count(a) > 1));
        let agents = readers.hosts.entry(host.to_owned()).or_default();
        agents.retain(|a| !a.retired.load(Ordering::SeqCst));
        let mut free: Vec<&Arc<ReaderAgent>> = agents
            .iter()
            .filter(|a| !a.busy.load(Ordering::SeqCst))
            .collect();
        free.sort_by_key(|a| !loaded.contains(&a.id));
        for a in free {
            if network_grew(a) {
                // (Not retire_agent: this thread holds READERS.)
                a.retired.store(true, Ordering::SeqCst);
                RETIRED
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(a.clone());
                continue;
            }
            a.busy.store(true, Ordering::SeqCst);
            return Ok(Lease(a.clone()));
        }
        agents.retain(|a| !a.retired.load(Ordering::SeqCst));
        if agents.len() < AGENTS_PER_HOST {
            let agent = make_agent(pid)?;
            agent.busy.store(true, Ordering::SeqCst);
            agents.push(agent.clone());
            return Ok(Lease(agent));
        }
        let left = match until {
            Some(t) => t.saturating_duration_since(Instant::now()),
            None => Duration::from_secs(3600),
        };
        if left.is_zero() {
            return Err(Error::StaleSession {
                session: format!("nixl://{host}"),
                reason: format!(
                    "all {AGENTS_PER_HOST} NIXL reader agents for producer host {host} stayed \
                     busy for the whole read timeout (reads from that host do not complete); \
                     raise SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S for slower links"
                ),
            });
        }
        guard = HANDED_BACK
            .wait_timeout(guard, left)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// A new reader agent of process `pid`.
fn make_agent(pid: u32) -> Result<Arc<ReaderAgent>> {
    let name = format!(
        "capture-arena-reader-{pid}-{:032x}",
        crate::random::nonce()?
    );
    Ok(Arc::new(ReaderAgent {
        handle: new_agent(&name, false)?,
        name,
        id: NEXT_AGENT.fetch_add(1, Ordering::Relaxed),
        pid,
        remotes: Mutex::new(HashMap::new()),
        retired: AtomicBool::new(false),
        links: usable_links(),
        links_checked: Mutex::new(Instant::now()),
        busy: AtomicBool::new(false),
    }))
}

/// One producer's arena as this process reads it through NIXL.
pub struct NixlTransport {
    session: NixlSession,
    text: String,
    timeout: Duration,
    /// The reader agents this session's metadata is loaded into, with the load it counts in
    /// in each.
    loads: Mutex<Vec<(Arc<ReaderAgent>, u64)>>,
    /// Set once a read failed or timed out: the producer is gone, restarted or unreachable for
    /// now (the reader's cache opens the session again).
    dead: AtomicBool,
    /// Buffers stamps are read to, registered once each, one per thread reading stamps at once.
    stamp_words: Mutex<Vec<super::ReadBuffer>>,
    /// Requests of this session left in flight in a retired agent (reads that timed out): a
    /// buffer one may still be aimed at is never used again.
    abandoned: std::sync::atomic::AtomicU64,
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
    /// Loads the producer's metadata (from the session itself) into one of this process's
    /// reader agents for its host, within the read timeout. Nothing is sent yet: the
    /// connection is made by the first read.
    ///
    /// # Errors
    /// [`Error::Transport`] when NIXL cannot be loaded or the agent not made;
    /// [`Error::StaleSession`] when NIXL refuses the metadata or cannot reach the producer.
    pub fn open(session: &NixlSession) -> Result<NixlTransport> {
        let timeout = crate::config::read_timeout()?;
        if found_gone(&session.agent, Instant::now()) {
            return Err(Error::StaleSession {
                session: session.to_string(),
                reason: "an earlier read found this producer gone (exited, restarted or \
                         unreachable)"
                    .into(),
            });
        }
        let t = NixlTransport {
            text: session.to_string(),
            session: session.clone(),
            timeout,
            loads: Mutex::new(Vec::new()),
            dead: AtomicBool::new(false),
            stamp_words: Mutex::new(Vec::new()),
            abandoned: std::sync::atomic::AtomicU64::new(0),
        };
        let until = Instant::now().checked_add(timeout);
        let agent = lease(&session.host, &[], until)?;
        t.loaded_in(&agent, until)?;
        drop(agent);
        t.prove_bounds()?;
        Ok(t)
    }

    /// Reads the first and the last word of the arena the session claims. NIXL refuses a
    /// request for memory the producer did not register, so a session that claims more than
    /// its producer's arena (a forged `len` or `base`) is refused here, before a reader
    /// allocates anything by its length.
    fn prove_bounds(&self) -> Result<()> {
        let (base, len) = (self.session.base, self.session.len);
        let Some(last) = len
            .checked_sub(crate::sample::STAMP_BYTES)
            .and_then(|l| base.checked_add(l))
        else {
            return Ok(()); // under a word: nothing to prove by length
        };
        self.stamps(&[base, last]).map(|_| ()).map_err(|e| match e {
            Error::StaleSession { session, reason } => Error::StaleSession {
                session,
                reason: format!(
                    "reading the bounds it claims ({len} bytes at {base:#x}) failed: {reason}"
                ),
            },
            e => e,
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

    /// The ids of the agents holding this session's metadata.
    fn loaded_ids(&self) -> Vec<u64> {
        let loads = self.loads.lock().unwrap_or_else(|p| p.into_inner());
        loads.iter().map(|(a, _)| a.id).collect()
    }

    /// The load of this session's metadata in `agent`, loaded now (bounded by `until`) when it
    /// is not.
    fn loaded_in(&self, agent: &Lease, until: Option<Instant>) -> Result<u64> {
        {
            let loads = self.loads.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((_, load)) = loads.iter().find(|(a, _)| Arc::ptr_eq(a, agent)) {
                return Ok(*load);
            }
        }
        let load = load_bounded(agent, &self.session, until, self.timeout)?;
        self.loads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(((*agent).clone(), load));
        Ok(load)
    }

    /// Marks the session dead after a failed transfer, remembers the producer as gone and dooms
    /// its metadata in every agent (dropped by the last read in flight, [`NixlTransport::end`],
    /// or with the last transport).
    fn kill(&self, reason: String) -> Error {
        if !self.dead.swap(true, Ordering::SeqCst) {
            remember_gone(&self.session.agent);
            let loads = self.loads.lock().unwrap_or_else(|p| p.into_inner());
            for (agent, load) in loads.iter() {
                let mut remotes = agent.remotes.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(r) = remotes.get_mut(&self.session.agent) {
                    if r.load == *load {
                        r.doomed = true;
                    }
                }
            }
        }
        tracing::warn!(session = %self.session.agent, %reason, "NIXL session is stale");
        self.stale(reason)
    }

    /// Counts a read in flight on this session's metadata in `agent`; refuses when it was
    /// dropped.
    fn begin(&self, agent: &ReaderAgent, load: u64) -> Result<()> {
        let mut remotes = agent.remotes.lock().unwrap_or_else(|p| p.into_inner());
        match remotes.get_mut(&self.session.agent) {
            Some(r) if r.load == load && !r.doomed => {
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
    fn end(&self, agent: &ReaderAgent, load: u64) {
        let mut remotes = agent.remotes.lock().unwrap_or_else(|p| p.into_inner());
        let Some(r) = remotes.get_mut(&self.session.agent) else {
            return;
        };
        if r.load != load {
            return;
        }
        r.in_flight -= 1;
        if r.doomed && r.in_flight == 0 {
            remotes.remove(&self.session.agent);
            if let Err(e) = agent.handle.agent.invalidate_remote_md(&self.session.agent) {
                tracing::debug!(error = %e, agent = %self.session.agent, "dropping metadata");
            }
        }
    }

    /// The local descriptor of one destination, registered with `agent` (once per read buffer
    /// and agent, or for this read into `temps`).
    fn local(
        &self,
        agent: &ReaderAgent,
        into: &mut Destination<'_>,
        temps: &mut Vec<TempRegistration>,
    ) -> Result<Span> {
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
        let nixl = &agent.handle.agent;
        let register = |addr: u64, len: u64| -> Result<Box<dyn Any + Send>> {
            let whole = Span { addr, len, ..span };
            nixl.register_memory(&whole, None)
                .map(|r| Box::new(r) as Box<dyn Any + Send>)
                .map_err(|e| {
                    Error::transport(
                        format!("registering {len} bytes of read destination with NIXL"),
                        e.to_string(),
                    )
                })
        };
        let in_buffer = span.mem == NixlMem::Dram
            && buffer::ensure_registered(span.addr, span.len, agent.id, register)?;
        if !in_buffer {
            temps.push(register(span.addr, span.len)?);
        }
        Ok(span)
    }

    /// Makes, posts and waits (until `until`) for one request in `agent`; the request is
    /// released on return.
    fn transfer(
        &self,
        agent: &Arc<ReaderAgent>,
        descs: (&XferDescList<'_>, &XferDescList<'_>),
        objects: usize,
        bytes: u64,
        until: Option<Instant>,
    ) -> Result<()> {
        let nixl = &agent.handle.agent;
        let req = nixl
            .create_xfer_req(XferOp::Read, descs.0, descs.1, &self.session.agent, None)
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
        match nixl.post_xfer_req(&req, None) {
            // A failed post leaves nothing in flight.
            Err(e) => Err(self.kill(format!(
                "posting the NIXL read failed ({e}): the producer is gone or unreachable"
            ))),
            Ok(_) => match self.wait(agent, &req, bytes, until) {
                Waited::Done => Ok(()),
                Waited::Failed(reason) => Err(self.kill(reason)),
                Waited::TimedOut(reason) => {
                    // Not remembered as gone: a producer that was only slow or stopped for a
                    // while is read again, through another agent.
                    self.abandoned.fetch_add(1, Ordering::SeqCst);
                    retire_agent(agent, "a read timed out");
                    std::mem::forget(req);
                    self.dead.store(true, Ordering::SeqCst);
                    tracing::warn!(session = %self.session.agent, %reason, "NIXL read timed out");
                    Err(self.stale(reason))
                }
            },
        }
    }

    /// Waits for `req`, polling as the module docs say, until it completes, fails or `until`
    /// passes.
    fn wait(
        &self,
        agent: &ReaderAgent,
        req: &nixl_sys::XferRequest,
        bytes: u64,
        until: Option<Instant>,
    ) -> Waited {
        let nixl = &agent.handle.agent;
        let t0 = Instant::now();
        let mut polls = 0u32;
        let _waiting = Waiting::enter();
        loop {
            match nixl.get_xfer_status(req) {
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
            if until.is_some_and(|d| now >= d) {
                return Waited::TimedOut(format!(
                    "the NIXL read of {bytes} bytes did not complete in {:.1} s (the read \
                     timeout): the producer does not answer (stopped, or unreachable); raise \
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
                // Each waiter sleeps longer the more wait at once, so that the process's polls
                // (each one progresses UCX) cost what one reader's do, whatever the threads.
                let waiting = WAITING.load(Ordering::Relaxed).clamp(1, AGENTS_PER_HOST) as u64;
                std::thread::sleep(Duration::from_micros(POLL_SLEEP_US * waiting));
            }
        }
    }
}

/// Retires `agent`: never driven or destroyed again, its transports' loads in it unused; later
/// reads use the host's other agents or a new one.
fn retire_agent(agent: &Arc<ReaderAgent>, why: &str) {
    if agent.retired.swap(true, Ordering::SeqCst) {
        return;
    }
    RETIRED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(agent.clone());
    let mut guard = READERS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(readers) = guard.as_mut() {
        for agents in readers.hosts.values_mut() {
            agents.retain(|a| !Arc::ptr_eq(a, agent));
        }
    }
    tracing::warn!(
        agent = %agent.name,
        why,
        "NIXL reader agent retired; later reads use another"
    );
}

/// Loads `session`'s metadata into `agent` (once per producer and agent; later opens count in
/// the same load), on a thread of its own: NIXL connects to the producer while loading, which
/// blocks for as long as the network says (minutes in a partition). The caller waits until
/// `until` at most; past it the agent is retired (the load holds NIXL's lock for that agent) and
/// the session is stale for now, not gone.
fn load_bounded(
    agent: &Arc<ReaderAgent>,
    session: &NixlSession,
    until: Option<Instant>,
    timeout: Duration,
) -> Result<u64> {
    {
        // Counted and entered under one lock: concurrent reads cannot pass the bound together.
        let mut loads = lock_stuck();
        let n = loads
            .iter()
            .filter(|(producer, _)| *producer == session.agent)
            .count();
        if n >= MAX_STUCK_LOADS {
            return Err(Error::StaleSession {
                session: session.to_string(),
                reason: format!(
                    "{n} connections to the producer's NIXL agent are under way or still stuck past \
                     their read timeout (a partition, a host down): it is unreachable from here \
                     now, and reads from it fail at once until one of them ends"
                ),
            });
        }
        loads.push((session.agent.clone(), agent.id));
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let (a, sess) = (agent.clone(), session.clone());
    // The load's end and its caller's timeout each set their flag under the table's lock and
    // then read the other's: whichever comes second lets the retired agent go.
    let finished = Arc::new(AtomicBool::new(false));
    let abandoned = Arc::new(AtomicBool::new(false));
    let (done, left) = (finished.clone(), abandoned.clone());
    let spawned = std::thread::Builder::new()
        .name("capture-arena-nixl-load".into())
        .spawn(move || {
            let _ = tx.send(load_metadata(&a, &sess));
            let mut loads = lock_stuck();
            done.store(true, Ordering::SeqCst);
            loads.retain(|(_, id)| *id != a.id);
            drop(loads);
            if left.load(Ordering::SeqCst) {
                let_go(&a, "its stuck load of a producer's metadata ended");
            }
        });
    if let Err(e) = spawned {
        lock_stuck().retain(|(_, id)| *id != agent.id);
        return Err(Error::transport(
            "starting a thread to load a producer's NIXL metadata",
            e.to_string(),
        ));
    }
    let received = match until {
        Some(t) => rx.recv_timeout(t.saturating_duration_since(Instant::now())),
        None => rx
            .recv()
            .map_err(|_| std::sync::mpsc::RecvTimeoutError::Disconnected),
    };
    match received {
        Ok(r) => r,
        Err(_) => {
            retire_agent(agent, "loading a producer's metadata timed out");
            // The stuck load holds the agent's lock (nixl-sys takes it for the whole call), and
            // releasing a registration takes it too: a read buffer dropped later would wait for
            // the load (minutes in a partition). No request of this agent is in flight (it was
            // leased for the load), so its registrations are let go of without a release.
            buffer::forget_owner(agent.id);
            let loads = lock_stuck();
            abandoned.store(true, Ordering::SeqCst);
            let over = finished.load(Ordering::SeqCst);
            drop(loads);
            if over {
                let_go(
                    agent,
                    "its load of a producer's metadata ended just past the timeout",
                );
            }
            Err(Error::StaleSession {
                session: session.to_string(),
                reason: format!(
                    "connecting to the producer's NIXL agent did not finish within the read \
                     timeout ({:.1} s): it is unreachable from here now (a partition, a host \
                     down); raise SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S for slower links",
                    timeout.as_secs_f64()
                ),
            })
        }
    }
}

fn lock_stuck() -> std::sync::MutexGuard<'static, StuckLoads> {
    let mut table = STUCK_LOADS.lock().unwrap_or_else(|p| p.into_inner());
    let pid = std::process::id();
    if table.pid != pid {
        table.pid = pid;
        table.loads.clear();
    }
    table
}

impl std::ops::Deref for StuckLoads {
    type Target = Vec<(String, u64)>;
    fn deref(&self) -> &Self::Target {
        &self.loads
    }
}

impl std::ops::DerefMut for StuckLoads {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.loads
    }
}

/// Takes `agent`, retired while a load of metadata ran in it and with no request in flight,
/// out of the agents kept for good: it is destroyed with its last reference.
fn let_go(agent: &Arc<ReaderAgent>, why: &str) {
    RETIRED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|r| !Arc::ptr_eq(r, agent));
    tracing::info!(agent = %agent.name, why, "retired NIXL reader agent let go");
}

/// Loads `session`'s metadata into `agent` unless it is loaded; counts one more transport in
/// that load and returns its generation. The caller leases `agent`, so no other load into it
/// runs meanwhile; the remotes' lock is not held while NIXL connects.
fn load_metadata(agent: &ReaderAgent, session: &NixlSession) -> Result<u64> {
    let loaded = agent
        .remotes
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains_key(&session.agent);
    if !loaded {
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
                if let Ok(name) = &other {
                    let _ = agent.handle.agent.invalidate_remote_md(name);
                }
                return Err(other.err().unwrap_or_else(|| Error::InvalidSession {
                    session: session.to_string(),
                    reason: "the metadata names another agent".into(),
                }));
            }
        }
    }
    let mut remotes = agent.remotes.lock().unwrap_or_else(|p| p.into_inner());
    let entry = remotes
        .entry(session.agent.clone())
        .or_insert_with(|| Remote {
            transports: 0,
            in_flight: 0,
            doomed: false,
            load: NEXT_LOAD.fetch_add(1, Ordering::Relaxed),
        });
    entry.transports += 1;
    Ok(entry.load)
}

/// How long a reader waiting alone sleeps between polls once its read took a millisecond.
const POLL_SLEEP_US: u64 = 50;
/// Readers of this process waiting for a request now.
static WAITING: AtomicUsize = AtomicUsize::new(0);

/// Counts a reader in [`WAITING`] while it lives.
struct Waiting;

impl Waiting {
    fn enter() -> Waiting {
        WAITING.fetch_add(1, Ordering::Relaxed);
        Waiting
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        WAITING.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How a wait for a request ended.
enum Waited {
    Done,
    Failed(String),
    TimedOut(String),
}

/// Remembers that producer agent `name` was found gone now (the latest [`MAX_GONE`] are kept).
fn remember_gone(name: &str) {
    let mut gone = GONE.lock().unwrap_or_else(|p| p.into_inner());
    gone.retain(|(g, _)| g != name);
    if gone.len() >= MAX_GONE {
        gone.pop_front();
    }
    gone.push_back((name.to_owned(), Instant::now()));
}

/// Whether producer agent `name` was found gone less than [`GONE_FOR`] before `now`.
fn found_gone(name: &str, now: Instant) -> bool {
    let gone = GONE.lock().unwrap_or_else(|p| p.into_inner());
    gone.iter()
        .any(|(g, at)| g == name && now.saturating_duration_since(*at) < GONE_FOR)
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
        let loads = std::mem::take(&mut *self.loads.lock().unwrap_or_else(|p| p.into_inner()));
        for (agent, load) in loads {
            if agent.retired.load(Ordering::SeqCst) {
                continue; // a retired agent is never called again
            }
            let mut remotes = agent.remotes.lock().unwrap_or_else(|p| p.into_inner());
            let Some(r) = remotes.get_mut(&self.session.agent) else {
                continue;
            };
            if r.load != load {
                continue; // dropped and loaded again since: not the load this transport counts in
            }
            r.transports -= 1;
            if r.transports == 0 && r.in_flight == 0 {
                remotes.remove(&self.session.agent);
                if agent.pid == std::process::id() {
                    let _ = agent.handle.agent.invalidate_remote_md(&self.session.agent);
                }
            }
        }
    }
}

impl Transport for NixlTransport {
    fn session(&self) -> &str {
        &self.text
    }

    fn is_live(&self) -> bool {
        !self.dead.load(Ordering::SeqCst)
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

    /// One more READ, into a buffer registered once: after the data's request completed, so a
    /// stamp that still matches proves the bytes were the object's.
    fn stamps(&self, at: &[u64]) -> Result<Vec<u64>> {
        const W: usize = crate::sample::STAMP_BYTES as usize;
        if at.len() > STAMP_WORDS {
            return Err(Error::InvalidRead {
                key: self.text.clone(),
                reason: format!("{} stamps in one read (at most {STAMP_WORDS})", at.len()),
            });
        }
        let spare = self
            .stamp_words
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop();
        let mut words = match spare {
            Some(w) => w,
            None => super::ReadBuffer::new(STAMP_WORDS * W)?,
        };
        let abandoned = self.abandoned.load(Ordering::SeqCst);
        let read = super::read_words(self, at, &mut words[..at.len() * W]);
        if read.is_err() && self.abandoned.load(Ordering::SeqCst) != abandoned {
            // A read that timed out meanwhile (this one, maybe) may have left a request aimed at
            // this buffer in a retired agent: it is never used, freed or deregistered again.
            std::mem::forget(words);
        } else {
            // Done with, or failed with nothing left in flight (the session dead already, no
            // request made): used again.
            self.stamp_words
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(words);
        }
        read
    }

    fn read(&self, reads: &mut [ReadOp<'_>]) -> Result<()> {
        for r in reads.iter() {
            self.check(r.address, r.into.len())?;
        }
        if !self.is_live() {
            return Err(self.stale("an earlier read found the producer gone".into()));
        }
        if reads.iter().all(|r| r.into.is_empty()) {
            return Ok(());
        }
        let until = Instant::now().checked_add(self.timeout);
        let agent = lease(&self.session.host, &self.loaded_ids(), until)?;
        if agent.pid != std::process::id() {
            return Err(self.stale("opened by the parent of this forked process".into()));
        }
        let load = self.loaded_in(&agent, until)?;
        let mem: MemType = self.session.mem.mem_type();
        let mut temps: Vec<TempRegistration> = Vec::new();
        let mut local_mem = None;
        let mut local = Vec::with_capacity(reads.len());
        let mut bytes = 0u64;
        for r in reads.iter_mut() {
            if r.into.is_empty() {
                continue;
            }
            let span = self.local(&agent, &mut r.into, &mut temps)?;
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
        self.begin(&agent, load)?;
        let r = self.transfer(&agent, (&ldesc, &rdesc), local.len(), bytes, until);
        if agent.retired.load(Ordering::SeqCst) {
            // Timed out: the request may still complete into these destinations if the agent
            // were ever driven again; it never is, and its registrations stay.
            std::mem::forget(temps);
            return r;
        }
        self.end(&agent, load);
        // Only now, with the request released, may the temporary registrations go.
        drop(temps);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_producer_found_gone_is_refused_for_a_while_then_tried_again() {
        // Before: remembered for good, so a live producer whose connection broke once (a reset,
        // a partition UCX reported as an error) was never read again.
        let name = "capture-arena-0-found-gone-in-a-test";
        remember_gone(name);
        let now = Instant::now();
        assert!(found_gone(name, now));
        assert!(found_gone(name, now + GONE_FOR - Duration::from_millis(10)));
        assert!(!found_gone(
            name,
            now + GONE_FOR + Duration::from_millis(10)
        ));
        assert!(!found_gone("capture-arena-0-never-gone", now));
    }

    #[test]
    fn a_forked_child_counts_none_of_its_parents_stuck_loads() {
        // Before: a child forked while loads were stuck (a DataLoader's worker, during a
        // partition) counted its parent's, whose threads it has not, so they never ended there,
        // and it failed every read of that producer as "still stuck" for its life.
        let me = std::process::id();
        lock_stuck().push(("capture-arena-0-partitioned".into(), u64::MAX));
        STUCK_LOADS.lock().unwrap_or_else(|p| p.into_inner()).pid = me.wrapping_add(1); // as the child sees it
        assert!(lock_stuck().iter().all(|(_, id)| *id != u64::MAX));
        assert_eq!(
            STUCK_LOADS.lock().unwrap_or_else(|p| p.into_inner()).pid,
            me
        );
    }
}
