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

use std::fmt;
use std::mem::ManuallyDrop;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};

use base64::Engine as _;
use nixl_sys::{Agent, AgentConfig, Backend, MemType, MemoryRegion, NixlDescriptor, ThreadSync};

use super::ENV_NIXL_LIB;
use super::{CopyOp, Notifier, Progress, Region, Reply};
use crate::error::{Error, Result};
use crate::memory::{host_ok, SessionParts};

/// The longest NIXL session accepted: room for the metadata of a host with several RDMA NICs
/// (one NIC over TCP and shared memory is about 480 bytes of metadata, 650 in the session).
pub const MAX_NIXL_SESSION_BYTES: usize = 8192;
/// The longest metadata accepted in a session, decoded.
const MAX_METADATA_BYTES: usize = 6000;
/// The progress thread's poll timeout (NIXL rounds it up to whole milliseconds).
const PROGRESS_POLL_US: u64 = 1000;
/// The library the stubs of `nixl-sys` open by name.
const LIBRARY: &str = "libnixl_capi.so";
/// How the serialized metadata of an agent starts: NIXL's serializer tag, then the agent's name
/// as `Agent`, a little-endian u64 length, the bytes and `|`.
const METADATA_PREFIX: &[u8] = b"nixlSerDes|Agent";

/// Every function of the C API that this crate's calls into `nixl-sys` reach. Checked before
/// the first call: a missing one would abort the process inside the stubs.
const SYMBOLS: &[&str] = &[
    "nixl_capi_is_stub",
    "nixl_capi_create_configured_agent",
    "nixl_capi_destroy_agent",
    "nixl_capi_get_plugin_params",
    "nixl_capi_destroy_mem_list",
    "nixl_capi_destroy_params",
    "nixl_capi_create_backend",
    "nixl_capi_destroy_backend",
    "nixl_capi_create_opt_args",
    "nixl_capi_destroy_opt_args",
    "nixl_capi_create_reg_dlist",
    "nixl_capi_destroy_reg_dlist",
    "nixl_capi_reg_dlist_add_desc",
    "nixl_capi_reg_dlist_clear",
    "nixl_capi_register_mem",
    "nixl_capi_deregister_mem",
    "nixl_capi_get_local_md",
    "nixl_capi_load_remote_md",
    "nixl_capi_invalidate_remote_md",
    "nixl_capi_create_xfer_dlist",
    "nixl_capi_destroy_xfer_dlist",
    "nixl_capi_xfer_dlist_add_desc",
    "nixl_capi_xfer_dlist_clear",
    "nixl_capi_create_xfer_req",
    "nixl_capi_post_xfer_req",
    "nixl_capi_get_xfer_status",
    "nixl_capi_release_xfer_req",
    "nixl_capi_destroy_xfer_req",
];

/// Opens the NIXL library once per process and checks its symbols; every later call returns
/// the first answer.
///
/// # Errors
/// [`Error::Transport`] saying what is missing and what to set.
pub fn library() -> Result<()> {
    static LOADED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(load)
        .clone()
        .map_err(|reason| Error::transport("loading the NIXL library", reason))
}

fn load() -> std::result::Result<(), String> {
    let configured = std::env::var(ENV_NIXL_LIB)
        .ok()
        .filter(|v| !v.trim().is_empty());
    let path = match &configured {
        Some(p) if std::path::Path::new(p).is_dir() => {
            format!("{}/{LIBRARY}", p.trim_end_matches('/'))
        }
        Some(p) => p.clone(),
        None => LIBRARY.to_owned(),
    };
    let flags = libc::RTLD_NOW | libc::RTLD_GLOBAL;
    // SAFETY: loading NIXL runs its initializers (C++ static constructors of the library and its
    // bundled UCX), which is what using NIXL at all requires; nothing else is called here.
    let lib = unsafe { libloading::os::unix::Library::open(Some(&path), flags) }.map_err(|e| {
        format!(
            "cannot open {path} ({e:?}); install the nixl-cu12==1.5.1 wheel and set {ENV_NIXL_LIB} \
             to its .nixl_cu12.mesonpy.libs directory (or add that directory to LD_LIBRARY_PATH)"
        )
    })?;
    for name in SYMBOLS {
        // SAFETY: only the symbol's presence is checked; the pointer is never called here.
        if let Err(e) = unsafe { lib.get::<*const ()>(name.as_bytes()) } {
            return Err(format!(
                "{path} lacks {name} ({e}): not the NIXL 1.5 C API this build was made for \
                 (nixl-sys 1.5.2 with the nixl-cu12==1.5.1 wheel)"
            ));
        }
    }
    // The stubs of nixl-sys open the library by its name: that must find the one just checked
    // (its soname is libnixl_capi.so), not another copy, or nothing.
    // SAFETY: RTLD_NOLOAD only looks the name up among the libraries already loaded.
    let by_name = unsafe {
        libloading::os::unix::Library::open(Some(LIBRARY), libc::RTLD_NOW | libc::RTLD_NOLOAD)
    };
    let ours = lib.into_raw();
    if !by_name.is_ok_and(|l| l.into_raw() == ours) {
        return Err(format!(
            "{path} does not answer to the name {LIBRARY} (its soname differs), so NIXL's stubs \
             would load another library or none; point {ENV_NIXL_LIB} at the nixl-cu12 wheel's \
             libnixl_capi.so"
        ));
    }
    // Both handles stay open (never closed) for the life of the process.
    if nixl_sys::is_stub() {
        return Err(format!(
            "{path} is a stub build of NIXL, without transports"
        ));
    }
    tracing::debug!(%path, "NIXL library loaded");
    Ok(())
}

/// A NIXL agent with its UCX backend: kept together so the backend lives as long as the agent.
pub(crate) struct AgentHandle {
    pub(crate) agent: Agent,
    _backend: Backend,
}

impl fmt::Debug for AgentHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentHandle")
            .field("name", &self.agent.name())
            .finish()
    }
}

/// Creates an agent named `name` with the UCX backend. `progress_thread`: NIXL's own thread
/// drives UCX (a producer needs it, or remote reads wait for a call into the agent).
pub(crate) fn new_agent(name: &str, progress_thread: bool) -> Result<AgentHandle> {
    library()?;
    let what = || format!("creating NIXL agent {name}");
    let config = AgentConfig {
        enable_prog_thread: progress_thread,
        // NIXL's default (0) spins the progress thread on a whole core even when idle; with a
        // delay it sleeps in poll() on UCX's event descriptor and wakes on traffic (measured
        // on 2 cores: ~100 % -> ~4 % of a core idle, reads no slower; BENCHMARKS.md).
        pthr_delay_us: PROGRESS_POLL_US,
        enable_listen_thread: false,
        thread_sync: ThreadSync::Strict,
        ..AgentConfig::default()
    };
    let agent = Agent::new_configured(name, &config)
        .map_err(|e| Error::transport(what(), e.to_string()))?;
    let (_mems, params) = agent.get_plugin_params("UCX").map_err(|e| {
        Error::transport(
            what(),
            format!(
                "no UCX plugin ({e}); the plugins directory next to libnixl.so must hold \
                 libplugin_UCX.so (or set NIXL_PLUGIN_DIR)"
            ),
        )
    })?;
    let backend = agent
        .create_backend("UCX", &params)
        .map_err(|e| Error::transport(what(), format!("creating the UCX backend: {e}")))?;
    Ok(AgentHandle {
        agent,
        _backend: backend,
    })
}

/// The memory kind of a NIXL region, as its session names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NixlMem {
    /// Host memory.
    Dram,
    /// GPU memory (device `dev` of the session).
    Vram,
}

impl NixlMem {
    fn name(self) -> &'static str {
        match self {
            NixlMem::Dram => "dram",
            NixlMem::Vram => "vram",
        }
    }

    pub(crate) fn mem_type(self) -> MemType {
        match self {
            NixlMem::Dram => MemType::Dram,
            NixlMem::Vram => MemType::Vram,
        }
    }
}

/// One span of memory to register or transfer: what NIXL's descriptor traits ask for.
#[derive(Debug)]
pub(crate) struct Span {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) mem: NixlMem,
    pub(crate) dev: u64,
}

impl MemoryRegion for Span {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as usize as *const u8
    }
    fn size(&self) -> usize {
        self.len as usize
    }
}

impl NixlDescriptor for Span {
    fn mem_type(&self) -> MemType {
        self.mem.mem_type()
    }
    fn device_id(&self) -> u64 {
        self.dev
    }
}

/// A parsed NIXL session:
/// `nixl://<host>/<agent>?len=<bytes>&base=<hex>&mem=dram|vram&dev=<n>&md=<base64url>`.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct NixlSession {
    /// The producer's host (for messages; the metadata holds the addresses UCX connects to).
    pub host: String,
    /// The producer's agent name: `capture-arena-<pid>-<32 hex digits>`.
    pub agent: String,
    /// The producer's address of byte 0 (published addresses are `base + offset`).
    pub base: u64,
    /// Bytes of the arena.
    pub len: u64,
    /// Host or device memory.
    pub mem: NixlMem,
    /// The device id registered (the GPU ordinal for VRAM, 0 for host memory).
    pub dev: u32,
    /// The agent's metadata (`get_local_md`), decoded.
    pub metadata: Vec<u8>,
}

impl fmt::Debug for NixlSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NixlSession")
            .field("host", &self.host)
            .field("agent", &self.agent)
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .field("mem", &self.mem)
            .field("dev", &self.dev)
            .field("metadata_bytes", &self.metadata.len())
            .finish()
    }
}

fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
}

impl fmt::Display for NixlSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "nixl://{}/{}?len={}&base={:#x}&mem={}&dev={}&md={}",
            self.host,
            self.agent,
            self.len,
            self.base,
            self.mem.name(),
            self.dev,
            b64().encode(&self.metadata)
        )
    }
}

/// True for an agent name this crate makes: `capture-arena-<pid>-<32 lower-case hex digits>`.
fn agent_ok(name: &str) -> bool {
    name.strip_prefix("capture-arena-")
        .and_then(|r| r.split_once('-'))
        .is_some_and(|(pid, nonce)| {
            !pid.is_empty()
                && pid.len() <= 10
                && pid.bytes().all(|b| b.is_ascii_digit())
                && nonce.len() == 32
                && nonce
                    .bytes()
                    .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        })
}

/// True when serialized metadata names `agent` as its agent (checked before NIXL parses it, so
/// metadata of another agent, or bytes that are not metadata at all, never reach it).
pub(crate) fn metadata_names(metadata: &[u8], agent: &str) -> bool {
    let Some(rest) = metadata.strip_prefix(METADATA_PREFIX) else {
        return false;
    };
    let Some((len, rest)) = rest.split_first_chunk::<8>() else {
        return false;
    };
    u64::from_le_bytes(*len) == agent.len() as u64
        && rest
            .strip_prefix(agent.as_bytes())
            .is_some_and(|r| r.first() == Some(&b'|'))
}

impl FromStr for NixlSession {
    type Err = Error;

    /// Parses only the canonical form [`fmt::Display`] writes, checking every field (and that
    /// the metadata names the session's agent) before anything is allocated for it.
    fn from_str(s: &str) -> Result<NixlSession> {
        let bad = |why: &str| Error::InvalidSession {
            session: s.chars().take(256).collect(),
            reason: format!(
                "{why}; expected nixl://<host>/capture-arena-<pid>-<nonce>?len=<bytes>&base=<hex>\
                 &mem=dram|vram&dev=<n>&md=<base64url>"
            ),
        };
        if s.len() > MAX_NIXL_SESSION_BYTES {
            return Err(bad(&format!("longer than {MAX_NIXL_SESSION_BYTES} bytes")));
        }
        let mut q = SessionParts::split(s, "nixl://").map_err(|why| bad(&why))?;
        let (host, agent) = (q.host, q.id);
        if !agent_ok(agent) {
            return Err(bad("bad agent name"));
        }
        let (len, base) = q.len_and_base().map_err(|why| bad(&why))?;
        let mem = match q.next("mem").map_err(|why| bad(&why))? {
            "dram" => NixlMem::Dram,
            "vram" => NixlMem::Vram,
            _ => return Err(bad("mem must be dram or vram")),
        };
        let dev: u32 = q
            .next("dev")
            .map_err(|why| bad(&why))?
            .parse()
            .map_err(|_| bad("bad dev"))?;
        let md = q.next("md").map_err(|why| bad(&why))?;
        if md.len() > MAX_METADATA_BYTES.div_ceil(3) * 4 {
            return Err(bad("metadata too long"));
        }
        let metadata = b64().decode(md).map_err(|_| bad("md is not base64url"))?;
        if metadata.len() > MAX_METADATA_BYTES || !metadata_names(&metadata, agent) {
            return Err(bad("md is not the metadata of this agent"));
        }
        q.finish().map_err(|why| bad(&why))?;
        let parsed = NixlSession {
            host: host.to_owned(),
            agent: agent.to_owned(),
            base,
            len,
            mem,
            dev,
            metadata,
        };
        if parsed.to_string() != s {
            return Err(bad("not in canonical form"));
        }
        Ok(parsed)
    }
}

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

/// A NIXL server process and its successors: how to start one, and the one running now.
struct Server {
    command: Vec<String>,
    shm: super::ShmSession,
    /// The host named in sessions.
    host: String,
    state: std::sync::Mutex<ServerState>,
}

struct ServerState {
    /// The running server's stdin: it exits when this closes (the region dropped, or this
    /// process gone: the write end is ours alone).
    to_server: Option<std::process::ChildStdin>,
    pid: u32,
    /// Set when the region is dropped: a server that ends then is no news, and none is started.
    stopping: bool,
    /// A restarted server's agent, base and session, until the writer takes them
    /// ([`Region::renew`]).
    fresh: Option<(String, u64, String)>,
}

impl Server {
    fn state(&self) -> std::sync::MutexGuard<'_, ServerState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Starts a server with a new agent; returns it, its stdin, its agent's name, base and
    /// session. A server that does not describe its agent within [`SERVER_START`] is killed.
    fn launch(
        &self,
    ) -> Result<(
        std::process::Child,
        std::process::ChildStdin,
        String,
        u64,
        String,
    )> {
        use std::io::BufRead;
        let name = agent_name()?;
        let command = &self.command;
        let what = || format!("starting the NIXL server process {command:?}");
        let Some((program, args)) = command.split_first() else {
            return Err(Error::config(super::ENV_NIXL_SERVER, "an empty command"));
        };
        let mut child = std::process::Command::new(program)
            .args(args)
            .args([&self.shm.name, &self.shm.len.to_string(), &name])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .map_err(|e| Error::transport(what(), e.to_string()))?;
        let fail = |mut child: std::process::Child, e: Error| {
            let _ = child.kill();
            let _ = child.wait();
            Err(e)
        };
        let (Some(to_server), Some(from_server)) = (child.stdin.take(), child.stdout.take()) else {
            return fail(child, Error::transport(what(), "no pipes"));
        };
        // Its description, read on a thread so that a server that hangs costs SERVER_START at
        // most. Other lines (UCX logs to stdout) are logged, then everything else is drained
        // until it ends.
        let (tx, rx) = std::sync::mpsc::channel();
        let reading = std::thread::Builder::new()
            .name("capture-arena-nixl-server-out".into())
            .spawn(move || {
                let mut from = std::io::BufReader::new(from_server);
                let mut tx = Some(tx);
                let mut line = Vec::new();
                loop {
                    line.clear();
                    let read = std::io::Read::take(&mut from, MAX_SERVER_LINE)
                        .read_until(b'\n', &mut line);
                    if !matches!(read, Ok(n) if n > 0) {
                        return; // its end (tx dropped: the description never came)
                    }
                    let text = String::from_utf8_lossy(&line);
                    match text.strip_prefix(SERVER_MARKER) {
                        Some(json) if tx.is_some() => {
                            if let Some(tx) = tx.take() {
                                let _ = tx.send(json.trim().to_owned());
                            }
                        }
                        _ => tracing::info!(
                            target: "capture_arena::nixl_server",
                            "{}",
                            text.trim_end()
                        ),
                    }
                }
            });
        if let Err(e) = reading {
            return fail(child, Error::transport(what(), e.to_string()));
        }
        let line = match rx.recv_timeout(SERVER_START) {
            Ok(line) => line,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                let e = "it ended without describing its agent (it says why on stderr)";
                return fail(child, Error::transport(what(), e));
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                let e = format!(
                    "it did not describe its agent within {} s",
                    SERVER_START.as_secs()
                );
                return fail(child, Error::transport(what(), e));
            }
        };
        let described = serde_json::from_str::<ServerLine>(&line)
            .map_err(|e| format!("its description is not one: {e}"))
            .and_then(|d| {
                let metadata = b64()
                    .decode(d.metadata.as_bytes())
                    .map_err(|e| format!("its metadata: {e}"))?;
                Ok((d.base, metadata))
            });
        let (base, metadata) = match described {
            Ok(d) => d,
            Err(e) => return fail(child, Error::transport(what(), e)),
        };
        let span = Span {
            addr: base,
            len: self.shm.len,
            mem: NixlMem::Dram,
            dev: 0,
        };
        match describe(&name, &span, metadata, &self.host) {
            Ok(session) => Ok((child, to_server, name, base, session)),
            Err(e) => fail(child, e),
        }
    }

    /// Reaps the server `child` (and each successor): one that ends unasked is logged and
    /// started again, with a back-off from [`RESTART_FIRST`] to [`RESTART_MAX`] while starts
    /// fail. Runs until the region is dropped.
    fn watch(self: Arc<Server>, mut child: std::process::Child) {
        loop {
            let pid = child.id();
            let status = child.wait();
            if self.state().stopping {
                tracing::debug!(pid, ?status, "NIXL server process ended");
                return;
            }
            tracing::error!(
                pid,
                ?status,
                "the NIXL server process ended: trainers' reads of samples published so far \
                 fail as stale (and are freed when released); publishing goes on; a new server \
                 is started and serves the samples published after it"
            );
            let mut backoff = RESTART_FIRST;
            child = loop {
                let until = std::time::Instant::now() + backoff;
                while std::time::Instant::now() < until {
                    if self.state().stopping {
                        return;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                match self.launch() {
                    Ok((child, to_server, agent, base, session)) => {
                        let mut s = self.state();
                        if s.stopping {
                            drop(s);
                            drop(to_server);
                            let mut child = child;
                            let _ = child.wait();
                            return;
                        }
                        s.to_server = Some(to_server);
                        s.pid = child.id();
                        tracing::warn!(
                            pid = child.id(),
                            %agent,
                            "the NIXL server process was restarted"
                        );
                        s.fresh = Some((agent, base, session));
                        break child;
                    }
                    Err(e) => {
                        backoff = (backoff * 2).min(RESTART_MAX);
                        tracing::error!(
                            error = %e,
                            retry_in_s = backoff.as_secs(),
                            "the NIXL server process could not be restarted"
                        );
                    }
                }
            };
        }
    }
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
            Serving::Process(server) => {
                let mut s = server.state();
                s.stopping = true;
                drop(s.to_server.take());
            }
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
        let server = Arc::new(Server {
            command: command.to_vec(),
            shm,
            host: session_host(host),
            state: std::sync::Mutex::new(ServerState {
                to_server: None,
                pid: 0,
                stopping: false,
                fresh: None,
            }),
        });
        let (child, to_server, agent, base, session) = server.launch()?;
        {
            let mut s = server.state();
            s.to_server = Some(to_server);
            s.pid = child.id();
        }
        let watcher = server.clone();
        let watching = std::thread::Builder::new()
            .name("capture-arena-nixl-server".into())
            .spawn(move || watcher.watch(child));
        let region = NixlRegion {
            serving: Serving::Process(server),
            pid: std::process::id(),
            agent_name: agent,
            base,
            session,
            inner,
        };
        // Without its watcher the server would never be reaped nor restarted: the region is
        // dropped (which ends the server) and this call fails.
        watching
            .map_err(|e| Error::transport("watching the NIXL server process", e.to_string()))?;
        Ok(region)
    }

    /// The agent's name.
    pub fn agent_name(&self) -> String {
        self.agent_name.clone()
    }

    /// The server process's pid, when a server process serves this region.
    pub fn server_pid(&self) -> Option<u32> {
        match &self.serving {
            Serving::InProcess { .. } => None,
            Serving::Process(server) => Some(server.state().pid),
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

/// The session text of `span` served by agent `name` on `host`, checked against the bounds a
/// reader enforces.
fn describe(name: &str, span: &Span, metadata: Vec<u8>, host: &str) -> Result<String> {
    let session = NixlSession {
        host: host.to_owned(),
        agent: name.to_owned(),
        base: span.addr,
        len: span.len,
        mem: span.mem,
        dev: span.dev as u32,
        metadata,
    };
    let text = session.to_string();
    if text.len() > MAX_NIXL_SESSION_BYTES || session.metadata.len() > MAX_METADATA_BYTES {
        return Err(Error::transport(
            "describing the NIXL arena",
            format!(
                "the session would be {} bytes (at most {MAX_NIXL_SESSION_BYTES}) with {} \
                 bytes of agent metadata (at most {MAX_METADATA_BYTES}); limit the UCX \
                 devices (UCX_NET_DEVICES, UCX_TLS) or shorten \
                 SGLANG_SPEC_CAPTURE_CONTROL_HOST",
                text.len(),
                session.metadata.len()
            ),
        ));
    }
    if !metadata_names(&session.metadata, &session.agent) {
        return Err(Error::transport(
            "describing the NIXL arena",
            "the agent's metadata does not start as NIXL 1.5 writes it (another NIXL version?)",
        ));
    }
    tracing::info!(
        agent = %session.agent,
        bytes = span.len,
        metadata_bytes = session.metadata.len(),
        "arena registered with NIXL"
    );
    Ok(text)
}

/// How long a NIXL server process may take to describe its agent (registering a large arena
/// with RDMA devices pins it, which takes a while).
pub const SERVER_START: std::time::Duration = std::time::Duration::from_secs(120);
/// How long after a server ends unasked the next one starts; doubled after each failed start.
pub const RESTART_FIRST: std::time::Duration = std::time::Duration::from_secs(1);
/// The longest wait between failed starts.
pub const RESTART_MAX: std::time::Duration = std::time::Duration::from_secs(60);
/// The longest line a server may write (longer ones are read in pieces).
const MAX_SERVER_LINE: u64 = 64 * 1024;
/// What starts a server's description line: its stdout also carries UCX's logs.
const SERVER_MARKER: &str = "capture-arena-nixl-server ";

/// What a NIXL server process says first: where it mapped the arena and its agent's metadata.
#[derive(serde::Serialize, serde::Deserialize)]
struct ServerLine {
    base: u64,
    metadata: String,
}

/// A fresh agent name, unique to this process and arena.
fn agent_name() -> Result<String> {
    Ok(format!(
        "capture-arena-{}-{:032x}",
        std::process::id(),
        crate::random::nonce()?
    ))
}

/// An agent named `name` with its progress thread, `span` registered with it, and its metadata.
fn register(
    name: &str,
    span: &Span,
) -> Result<(AgentHandle, nixl_sys::RegistrationHandle, Vec<u8>)> {
    let agent = new_agent(name, true)?;
    let registration = agent.agent.register_memory(span, None).map_err(|e| {
        Error::transport(
            format!(
                "registering the arena ({} bytes, {}) with NIXL",
                span.len,
                span.mem.name()
            ),
            e.to_string(),
        )
    })?;
    let metadata = agent
        .agent
        .get_local_md()
        .map_err(|e| Error::transport("reading the NIXL agent's metadata", e.to_string()))?;
    Ok((agent, registration, metadata))
}

/// What a NIXL server process runs (`capture-arena nixl-serve`, or
/// `python -m capture_arena._nixl_serve`): maps the arena `shm_name` (`len` data bytes) that
/// its parent created, registers its data with a new agent named `agent` whose progress thread
/// serves READs, writes one line `capture-arena-nixl-server {"base", "metadata"}` on stdout
/// (where UCX may log too), and serves until its stdin closes (its parent dropped the region,
/// or is gone: the pipe's write end is the parent's alone). Not `PR_SET_PDEATHSIG`: that fires when the parent *thread* that started it
/// ends, and arenas are created on threads that end.
///
/// # Errors
/// [`Error::Io`] when the arena cannot be opened or mapped; [`Error::Transport`] from NIXL.
pub fn serve(shm_name: &str, len: u64, agent: &str) -> Result<()> {
    use std::io::{Read, Write};
    use std::os::fd::AsFd;
    if !shm_name.starts_with(super::shm::NAME_PREFIX) || shm_name.contains('/') {
        return Err(Error::config(
            super::ENV_NIXL_SERVER,
            format!("{shm_name:?} is not an arena's name"),
        ));
    }
    let fd = super::shm::open(shm_name, libc::O_RDWR, 0)
        .map_err(|e| Error::io(format!("opening the arena {shm_name}"), e))?;
    let total = len
        .checked_add(super::shm::HEADER_BYTES)
        .and_then(|t| usize::try_from(t).ok())
        .ok_or_else(|| Error::config(super::ENV_NIXL_SERVER, "arena too large"))?;
    let (size, _) = super::shm::fstat(&fd)
        .map_err(|e| Error::io(format!("stat of the arena {shm_name}"), e))?;
    if size < total as u64 {
        return Err(Error::io(
            format!("the arena {shm_name}"),
            std::io::Error::other(format!("{size} bytes, {total} expected")),
        ));
    }
    // Pre-faulted: otherwise every page's first READ takes a fault in this process while the
    // producer publishes (measured: the producer's publish rate during reads fell to 0.3 x).
    let map = super::Mapping::map(
        fd.as_fd(),
        total,
        super::Access::ReadWrite,
        true,
        "the arena for NIXL",
    )?;
    let span = Span {
        addr: map.address() + super::shm::HEADER_BYTES,
        len,
        mem: NixlMem::Dram,
        dev: 0,
    };
    let (agent, registration, metadata) = register(agent, &span)?;
    let line = serde_json::to_string(&ServerLine {
        base: span.addr,
        metadata: b64().encode(&metadata),
    })
    .map_err(|e| Error::transport("describing the agent", e.to_string()))?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{SERVER_MARKER}{line}")
        .and_then(|()| out.flush())
        .map_err(|e| Error::io("writing the agent's description", e))?;
    drop(out);
    tracing::info!(agent = %agent.agent.name(), bytes = len, "serving the arena through NIXL");
    // Serve until the parent closes the pipe.
    let mut sink = [0u8; 64];
    let mut stdin = std::io::stdin().lock();
    while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
    drop(registration);
    drop(agent);
    drop(map);
    Ok(())
}

impl Region for NixlRegion {
    fn len(&self) -> u64 {
        self.inner.len()
    }

    fn base_address(&self) -> u64 {
        self.base
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
        let Some((agent, base, session)) = server.state().fresh.take() else {
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

    fn start(&mut self, ops: &[CopyOp<'_>]) -> Result<()> {
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

    fn reply(&self, what: &str) -> Option<Result<Reply>> {
        self.inner.reply(what)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata(agent: &str) -> Vec<u8> {
        let mut m = METADATA_PREFIX.to_vec();
        m.extend_from_slice(&(agent.len() as u64).to_le_bytes());
        m.extend_from_slice(agent.as_bytes());
        m.extend_from_slice(b"|Conns\x08\x00rest of it");
        m
    }

    fn session() -> NixlSession {
        let agent = format!("capture-arena-42-{:032x}", 7u128);
        NixlSession {
            host: "node-1".into(),
            metadata: metadata(&agent),
            agent,
            base: 0x7f00_0000_1000,
            len: 1 << 20,
            mem: NixlMem::Dram,
            dev: 0,
        }
    }

    #[test]
    fn sessions_round_trip_in_canonical_form_only() {
        let s = session();
        let text = s.to_string();
        assert!(
            text.starts_with("nixl://node-1/capture-arena-42-"),
            "{text}"
        );
        assert_eq!(text.parse::<NixlSession>().unwrap(), s);
        let vram = NixlSession {
            mem: NixlMem::Vram,
            dev: 3,
            ..s.clone()
        };
        assert_eq!(vram.to_string().parse::<NixlSession>().unwrap(), vram);
        for bad in [
            text.replace("base=0x", "base="),
            text.replace("len=1048576", "len=0"),
            text.replace("mem=dram", "mem=disk"),
            text.replace("dev=0", "dev=-1"),
            text.replace("node-1", "node 1"),
            text.replace("capture-arena-42-", "other-42-"),
            format!("{text}&x=1"),
            format!("{text}="),
            text.replace("nixl://", "shm://"),
            text.replace("&md=", "&md=!"),
            format!(
                "{}&md={}",
                text.split("&md=").next().unwrap(),
                "A".repeat(9000)
            ),
        ] {
            assert!(bad.parse::<NixlSession>().is_err(), "accepted {bad}");
        }
    }

    #[test]
    fn metadata_of_another_agent_is_refused_before_nixl_sees_it() {
        let s = session();
        let other = format!("capture-arena-42-{:032x}", 8u128);
        let forged = NixlSession {
            metadata: metadata(&other),
            ..s.clone()
        };
        assert!(forged.to_string().parse::<NixlSession>().is_err());
        assert!(metadata_names(&s.metadata, &s.agent));
        assert!(!metadata_names(&s.metadata[..20], &s.agent));
        assert!(!metadata_names(b"", &s.agent));
        let mut long = s.metadata.clone();
        long[16] = 0xff;
        assert!(!metadata_names(&long, &s.agent));
    }

    #[test]
    fn base_plus_len_may_not_overflow() {
        let s = NixlSession {
            base: u64::MAX - 10,
            ..session()
        };
        assert!(s.to_string().parse::<NixlSession>().is_err());
    }
}
