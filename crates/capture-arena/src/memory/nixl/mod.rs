//! NIXL: an arena registered with a NIXL agent, so readers on any host read its objects with
//! one-sided READs through UCX (TCP, shared memory, RDMA, CUDA IPC, NVLink).
//!
//! [`NixlRegion`] wraps a region this process can address (host shared memory, or a device
//! region registered as VRAM): the writer copies into the inner region as before, and the whole
//! region is registered once, when the arena starts. The agent's progress thread serves remote
//! reads; the writer never calls NIXL after that.
//!
//! The agent runs in this process ([`NixlRegion::new`]) or, for host shared memory, in a server
//! process of its own that maps the same object ([`NixlRegion::served`], [`serve`]): UCX can
//! abort the process it runs in (over TCP the serving side emulates READs, and an error there is
//! fatal), and that process must not be the inference server.
//!
//! The session carries the agent's metadata ([`NixlSession`]): a reader on another host needs
//! nothing but the result to connect. The metadata names the agent, its UCX worker's addresses
//! and the registration's remote keys; it is fixed for the agent's life, because the region is
//! registered once. A server process that ends unasked is started again with a new agent, and
//! results committed after that carry its session ([`Region::renew`]).
//!
//! The library is loaded at run time (`nixl-sys` with `stub-api`): [`library`] opens
//! `libnixl_capi.so` (from `SGLANG_SPEC_CAPTURE_NIXL_LIB`, else the library search path) and
//! checks every symbol this crate calls *before* the first call, because the stubs abort the
//! process when the library or a symbol is missing.
//!
//! Its rooms: `library` (the library checked and loaded; agents and registration), `session`
//! (the `nixl://` session, its bounds and parser), `server` (the server process: started,
//! watched, restarted, and what it runs); this file holds the region itself.

use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::Arc;

use super::{CopyOp, Notifier, Progress, Region, Reply};
use crate::error::{Error, Result};
use crate::memory::host_ok;

mod library;
mod server;
mod session;

pub use library::library;
use library::{agent_name, register};
pub(crate) use library::{new_agent, AgentHandle};
use server::Server;
pub use server::{serve, RESTART_FIRST, RESTART_MAX, SERVER_START};
use session::describe;
pub(crate) use session::Span;
pub use session::{NixlMem, NixlSession, MAX_NIXL_SESSION_BYTES};

/// A region registered with a NIXL agent: the inner region does the copies; readers reach it
/// through the agent. See the module docs.
pub struct NixlRegion {
    serving: Serving,
    /// The process that made the agent (or started the server).
    pid: u32,
    agent_name: String,
    /// The address readers read offset 0 at: this process's, or the server's.
    base: u64,
    session: String,
    inner: Box<dyn Region>,
}

/// Who serves the readers' READs.
enum Serving {
    /// An agent in this process. Dropped by hand (Drop below): the registration, then the
    /// agent, then (as a field) the memory; in a forked child neither NIXL object is touched.
    InProcess {
        registration: ManuallyDrop<nixl_sys::RegistrationHandle>,
        agent: ManuallyDrop<AgentHandle>,
    },
    /// A server process of its own over the same shared memory ([`serve`]), restarted when it
    /// ends unasked ([`Server::watch`]).
    Process(Arc<Server>),
}

impl Drop for NixlRegion {
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            // A forked child: the agent's threads are not here and the arena's mapping is not
            // inherited (MADV_DONTFORK); the parent's NIXL state is left alone.
            return;
        }
        match &mut self.serving {
            Serving::InProcess {
                registration,
                agent,
            } => {
                // SAFETY: each field is dropped exactly once, here, and not used after.
                unsafe {
                    ManuallyDrop::drop(registration);
                    ManuallyDrop::drop(agent);
                }
            }
            // Closing the pipe ends the server; its watcher thread reaps it.
            Serving::Process(server) => server.stop(),
        }
    }
}

impl fmt::Debug for NixlRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NixlRegion")
            .field("agent", &self.agent_name)
            .field("server_pid", &self.server_pid())
            .field("inner", &self.inner)
            .finish()
    }
}

impl NixlRegion {
    /// Registers `inner` (memory this process can address: `mem` host memory, or device `dev`'s
    /// memory for VRAM) with a new agent whose progress thread serves remote reads. `host` is
    /// named in the session.
    ///
    /// # Errors
    /// [`Error::Transport`] when the library, the agent or the registration fails.
    pub fn new(inner: Box<dyn Region>, mem: NixlMem, dev: u32, host: &str) -> Result<NixlRegion> {
        let name = agent_name()?;
        let span = Span {
            addr: inner.base_address(),
            len: inner.len(),
            mem,
            dev: u64::from(dev),
        };
        let (agent, registration, metadata) = register(&name, &span)?;
        let session = describe(&name, &span, metadata, &session_host(host))?;
        Ok(NixlRegion {
            serving: Serving::InProcess {
                registration: ManuallyDrop::new(registration),
                agent: ManuallyDrop::new(agent),
            },
            pid: std::process::id(),
            agent_name: name,
            base: span.addr,
            session,
            inner,
        })
    }

    /// Registers `inner`, host shared memory ([`super::ShmRegion`]), with an agent in a server
    /// process of its own, started as `command` followed by the object's name, its data bytes
    /// and the agent's name ([`serve`] is what that process runs). UCX then runs in that
    /// process alone: a peer or a network fault that makes UCX abort (over TCP a READ is
    /// emulated by the serving side's UCX thread, which aborts on an error it cannot hand to
    /// anyone) ends the server, not this process.
    ///
    /// A server that ends unasked is logged and started again (a new agent, mapping the same
    /// memory at another address): samples published before then fail as stale for their
    /// trainers (their metadata names the old agent) and are freed when released; publishing
    /// goes on, and results committed once the new server is up carry its session
    /// ([`Region::renew`]).
    ///
    /// # Errors
    /// [`Error::Transport`] when the server cannot be started or does not describe its agent
    /// within [`SERVER_START`]; [`Error::Config`] for a region that is not shared memory.
    pub fn served(inner: Box<dyn Region>, command: &[String], host: &str) -> Result<NixlRegion> {
        let shm: super::ShmSession = inner.memory_session().parse().map_err(|_| {
            Error::config(
                super::ENV_NIXL_SERVER,
                "a NIXL server process serves host shared memory only (set it to `inline` for \
                 a device arena)",
            )
        })?;
        let (server, agent, base, session) =
            Server::start(command.to_vec(), shm, session_host(host))?;
        Ok(NixlRegion {
            serving: Serving::Process(server),
            pid: std::process::id(),
            agent_name: agent,
            base,
            session,
            inner,
        })
    }

    /// The agent's name.
    pub fn agent_name(&self) -> String {
        self.agent_name.clone()
    }

    /// The server process's pid, when a server process serves this region.
    pub fn server_pid(&self) -> Option<u32> {
        match &self.serving {
            Serving::InProcess { .. } => None,
            Serving::Process(server) => Some(server.pid()),
        }
    }
}

/// `host`, or this host's name when `host` cannot be named in a session.
fn session_host(host: &str) -> String {
    if host_ok(host) {
        host.to_owned()
    } else {
        crate::memory::this_host()
    }
}

impl Region for NixlRegion {
    fn len(&self) -> u64 {
        self.inner.len()
    }

    fn base_address(&self) -> u64 {
        self.base
    }

    fn local_base(&self) -> u64 {
        self.inner.local_base()
    }

    fn session(&self) -> &str {
        &self.session
    }

    fn memory_session(&self) -> &str {
        self.inner.memory_session()
    }

    fn renew(&mut self) -> bool {
        let Serving::Process(server) = &self.serving else {
            return false;
        };
        let Some((agent, base, session)) = server.take_fresh() else {
            return false;
        };
        (self.agent_name, self.base, self.session) = (agent, base, session);
        true
    }

    fn set_notifier(&mut self, notifier: Notifier) {
        self.inner.set_notifier(notifier);
    }

    fn set_reply_endpoint(&mut self, endpoint: &str) {
        self.inner.set_reply_endpoint(endpoint);
    }

    unsafe fn start(&mut self, ops: &[CopyOp<'_>]) -> Result<()> {
        self.inner.start(ops)
    }

    fn progress(&mut self, ops: &[CopyOp<'_>], budget: u64) -> Result<Progress> {
        self.inner.progress(ops, budget)
    }

    fn abandon(&mut self) {
        self.inner.abandon();
    }

    fn clear(&mut self, offset: u64, len: u64) {
        self.inner.clear(offset, len);
    }

    fn set_word(&mut self, offset: u64, word: u64) {
        self.inner.set_word(offset, word);
    }

    fn reply(&self, what: &str) -> Option<Result<Reply>> {
        self.inner.reply(what)
    }
}
