//! Reads from device arenas (`cuda://` sessions, cargo feature `cuda`): the producer's
//! allocation imported into this process through its handle, mapped once per session, and
//! copied from with the driver's copy engines into host or device buffers.
//!
//! - `handle=fd`: the reader asks the producer's writer for the descriptor over the local reply
//!   path ([`crate::reply`]; same host, same user), checks that the answer names the very
//!   session it asked for, and imports it. A reader on another host gets a clear error.
//! - `handle=fabric`: the 64-byte handle is in the session; any process in the producer's
//!   NVLink (IMEX) domain imports it, on this node or another.
//!
//! Liveness: an imported allocation stays valid after its producer exits (the import holds a
//! reference), so reading it would return bytes nobody owns any more. A reader on the producer's
//! host therefore checks, at most once a second, that the producer's reply endpoint is still
//! bound (it vanishes with the writer or the process) and refuses stale sessions. From another
//! host (fabric) that cannot be told, and the session counts as live.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::driver::{self, context, Allocation, Context, Mapped, Stream};
use crate::error::{Error, Result};
use crate::memory::cuda::{CudaSession, HandleType};
use crate::transport::{Destination, ReadOp, Transport};

/// How long a reader waits for the producer's answer with the descriptor.
const HANDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the producer's reply endpoint is probed.
const LIVENESS_EVERY: Duration = Duration::from_secs(1);

/// An imported, mapped device arena. See the module docs.
#[derive(Debug)]
pub struct CudaTransport {
    // Field order is drop order: the streams' copies are synchronous, the mapping goes before
    // the contexts.
    /// The reader device's stream (host destinations and its own memory), then one stream per
    /// other GPU a destination was on, made on first use.
    streams: Mutex<Vec<Stream>>,
    /// The GPUs of this process the mapping grants access to: those a destination may be on.
    access: Vec<i32>,
    mapped: Mapped,
    session: CudaSession,
    text: String,
    local: bool,
    live: Mutex<(Instant, bool)>,
    /// The context copies run in.
    ctx: Arc<Context>,
}

/// True when the producer of a device session on this host is gone (its reply endpoint is no
/// longer bound); `false` for another host's session (cannot be told).
pub(crate) fn is_gone(session: &CudaSession) -> bool {
    session.host == crate::memory::this_host()
        && !crate::reply::is_listening(&session.reply, Some(session.pid))
}

impl CudaTransport {
    /// Imports and maps the arena `session` names.
    ///
    /// # Errors
    /// [`Error::Device`] without a driver or when importing or mapping fails;
    /// [`Error::StaleSession`] when the producer is gone or answers for another arena;
    /// [`Error::InvalidSession`] for a POSIX-fd session of another host.
    pub fn open(session: &CudaSession) -> Result<CudaTransport> {
        let text = session.to_string();
        driver::driver()?;
        let me = crate::memory::this_host();
        let local = session.host == me;
        let stale = |reason: String| Error::StaleSession {
            session: text.clone(),
            reason,
        };
        // The arena's GPU if this process sees it (same node).
        let home = driver::ordinal_of(&session.device_uuid)?;
        if home.is_none() && local && session.handle == HandleType::PosixFd {
            // A descriptor import names the producer's GPU, which this process cannot reach
            // then (importing into another GPU's context fails with an opaque driver error).
            return Err(Error::Device {
                what: format!("importing the arena of {text}"),
                reason: format!(
                    "its GPU (UUID {}) is on this node but not visible to this process \
                     (CUDA_VISIBLE_DEVICES={}): make it visible to the trainer (list it in \
                     CUDA_VISIBLE_DEVICES, or leave that unset), or have the producer serve \
                     its arena over NIXL (SGLANG_SPEC_CAPTURE_TRANSPORT=nixl)",
                    session.device_uuid,
                    std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into())
                ),
            });
        }
        // Import and map in the reader's GPU (the calling thread's current device: torch's;
        // else 0), so a trainer does not make a context on every producer GPU it reads, with
        // access for it and every GPU that can reach the arena's. Where the reader's GPU cannot
        // reach the arena's (no peer access), the arena's GPU does the copies.
        let reader = driver::current_ordinal()?.unwrap_or(0);
        let (ctx, access) = match home {
            Some(h) => {
                let mut peers = driver::peers_of(h)?;
                if peers.contains(&reader) {
                    peers.retain(|&d| d != reader);
                    peers.insert(0, reader);
                    (context(reader)?, peers)
                } else {
                    (context(h)?, peers)
                }
            }
            // From another node (fabric): the reader's GPU.
            None => (context(reader)?, vec![reader]),
        };
        // The descriptor, from the producer's writer over the local reply path.
        let import_fd = || -> Result<Allocation> {
            if !local {
                return Err(Error::InvalidSession {
                    session: text.clone(),
                    reason: format!(
                        "the arena is exported as a POSIX descriptor, which reaches only \
                         processes on its host {}; this is {me} (fabric handles or NIXL \
                         reach other hosts)",
                        session.host
                    ),
                });
            }
            // Only the producer process itself may answer (abstract socket names are open to
            // anyone on the host): its pid and our user, checked with SO_PEERCRED.
            let reply = crate::reply::request_from(
                &session.reply,
                "cuda-fd",
                HANDLE_TIMEOUT,
                Some(session.pid),
            )
            .map_err(|e| stale(format!("its writer did not hand over the arena ({e})")))?;
            if reply.bytes != text.as_bytes() {
                return Err(stale(
                    "the writer answered for a different arena (it restarted)".into(),
                ));
            }
            let Some(fd) = reply.fds.first() else {
                return Err(stale("the writer's answer carried no descriptor".into()));
            };
            use std::os::fd::AsFd;
            Allocation::import_fd(&ctx, fd.as_fd(), session.len)
        };
        let (allocation, imported_as) = match session.handle {
            HandleType::PosixFd => (import_fd()?, HandleType::PosixFd),
            HandleType::Fabric => {
                let Some(h) = &session.fabric else {
                    return Err(Error::InvalidSession {
                        session: text,
                        reason: "a fabric session without its handle".into(),
                    });
                };
                match Allocation::import_fabric(&ctx, h, session.len) {
                    Ok(a) => (a, HandleType::Fabric),
                    // On the producer's node a process that cannot import fabric handles (no
                    // IMEX channel in its container, IMEX half set up) takes the descriptor the
                    // arena is exportable as too.
                    Err(by_fabric) if local => {
                        tracing::info!(
                            error = %by_fabric,
                            "importing a fabric arena by its handle failed; asking its writer \
                             for the descriptor instead (same node)"
                        );
                        let a = import_fd().map_err(|by_fd| {
                            Error::device(
                                "importing the producer's arena",
                                format!(
                                    "by its fabric handle: {by_fabric}; by descriptor over the \
                                     reply path: {by_fd}"
                                ),
                            )
                        })?;
                        (a, HandleType::PosixFd)
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        let g = driver::granularity(&ctx, &[imported_as])?;
        let mapped = Mapped::new(allocation, g, &access)?;
        let stream = Stream::new(&ctx)?;
        Ok(CudaTransport {
            streams: Mutex::new(vec![stream]),
            access,
            mapped,
            session: session.clone(),
            text,
            local,
            live: Mutex::new((Instant::now(), true)),
            ctx,
        })
    }

    /// The parsed session.
    pub fn cuda_session(&self) -> &CudaSession {
        &self.session
    }

    /// The offset of `[address, address + n)` in the arena, checked.
    fn offset_of(&self, address: u64, n: u64) -> Result<u64> {
        super::offset_in(self.session.base, self.session.len, address, n)
    }
}

impl Transport for CudaTransport {
    fn session(&self) -> &str {
        &self.text
    }

    fn is_live(&self) -> bool {
        if !self.local {
            return true;
        }
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        if live.1 && live.0.elapsed() >= LIVENESS_EVERY {
            *live = (
                Instant::now(),
                crate::reply::is_listening(&self.session.reply, Some(self.session.pid)),
            );
        }
        live.1
    }

    fn capacity(&self) -> u64 {
        self.session.len
    }

    fn check(&self, address: u64, len: u64) -> Result<()> {
        self.offset_of(address, len).map(|_| ())
    }

    /// Each copy runs on a stream of its destination's GPU (a host destination: the reader's
    /// GPU), whose context can write that memory (a VMM pool's grants name only its GPU); the
    /// arena is mapped for every one of them. A destination on a GPU that cannot reach the
    /// arena's is refused.
    fn read(&self, reads: &mut [ReadOp<'_>]) -> Result<()> {
        let mut offsets = Vec::with_capacity(reads.len());
        for r in reads.iter() {
            offsets.push(self.offset_of(r.address, r.into.len())?);
            if let Destination::Device(d) = &r.into {
                if !self.access.contains(&d.device()) {
                    return Err(Error::InvalidRead {
                        key: self.text.clone(),
                        reason: format!(
                            "the destination is on GPU {}, which cannot reach the arena's GPU \
                             (no peer access); read into memory of GPU {} or into host memory",
                            d.device(),
                            self.access
                                .iter()
                                .map(|d| d.to_string())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    });
                }
            }
        }
        let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        // The stream of each read, made on first use for a GPU.
        let mut which = Vec::with_capacity(reads.len());
        for r in reads.iter() {
            let device = match &r.into {
                Destination::Device(d) => d.device(),
                Destination::Host(_) => self.ctx.ordinal,
            };
            let i = match streams.iter().position(|s| s.ordinal() == device) {
                Some(i) => i,
                None => {
                    streams.push(Stream::new(&driver::context(device)?)?);
                    streams.len() - 1
                }
            };
            which.push(i);
        }
        // Destinations whose owner still has work queued on its stream wait for it.
        for (r, &i) in reads.iter().zip(&which) {
            if let Destination::Device(d) = &r.into {
                if let Some(after) = d.waits_for() {
                    streams[i].wait(&driver::event_on(d.device(), after)?)?;
                }
            }
        }
        let mut result = Ok(());
        let mut used: Vec<usize> = Vec::new();
        for ((r, off), &i) in reads.iter_mut().zip(offsets).zip(&which) {
            let stream = &streams[i];
            if !used.contains(&i) {
                used.push(i);
            }
            let src = self.mapped.ptr + off;
            let n = r.into.len();
            let enqueued = match &mut r.into {
                // SAFETY: the source range lies inside the mapping (checked), which lives as
                // long as self; `out` is borrowed mutably until the streams are synchronised
                // below, before this function returns.
                Destination::Host(out) => unsafe { stream.copy_dtoh(out.as_mut_ptr(), src, n) },
                // SAFETY: as above; the destination is device memory its DeviceSlice's creator
                // vouched for until this read returns, on a GPU the mapping grants access to.
                Destination::Device(d) => unsafe { stream.copy_dtod(d.ptr(), src, n) },
            };
            if let Err(e) = enqueued {
                result = Err(e);
                break;
            }
        }
        // Always wait: copies already enqueued write the caller's buffers.
        for &i in &used {
            let synced = streams[i].synchronize();
            if result.is_ok() {
                result = synced;
            }
        }
        result
    }
}
