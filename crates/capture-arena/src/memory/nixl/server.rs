//! The NIXL server process: a process of its own that maps the producer's shared memory and runs
//! the agent (UCX may abort the process it runs in, and that must not be the inference server),
//! how the producer starts, watches and restarts it, and what it runs ([`serve`]).

use std::sync::Arc;

use base64::Engine as _;

use super::library::{agent_name, register};
use super::session::{b64, describe, NixlMem, Span};
use crate::error::{Error, Result};

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

/// A NIXL server process and its successors: how to start one, and the one running now.
pub(super) struct Server {
    command: Vec<String>,
    shm: crate::memory::ShmSession,
    /// The host named in sessions.
    host: String,
    state: std::sync::Mutex<ServerState>,
}

pub(super) struct ServerState {
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
    /// Starts the first server for the shared memory `shm` (`command` followed by the object's
    /// name, its data bytes and the agent's name), and a thread that reaps it and starts a
    /// successor when one ends unasked ([`Server::watch`]). Returns the server, its agent's name,
    /// the base it mapped the arena at, and the session.
    pub(super) fn start(
        command: Vec<String>,
        shm: crate::memory::ShmSession,
        host: String,
    ) -> Result<(Arc<Server>, String, u64, String)> {
        let server = Arc::new(Server {
            command,
            shm,
            host,
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
        if let Err(e) = watching {
            // Without its watcher the server would never be reaped nor restarted: it is
            // stopped, and the start fails.
            server.stop();
            return Err(Error::transport(
                "watching the NIXL server process",
                e.to_string(),
            ));
        }
        Ok((server, agent, base, session))
    }

    /// Ends the running server (closing its stdin ends it; its watcher reaps it) and starts no
    /// other.
    pub(super) fn stop(&self) {
        let mut s = self.state();
        s.stopping = true;
        drop(s.to_server.take());
    }

    /// The running server's pid.
    pub(super) fn pid(&self) -> u32 {
        self.state().pid
    }

    /// A restarted server's agent, base and session, once: for [`crate::memory::Region::renew`].
    pub(super) fn take_fresh(&self) -> Option<(String, u64, String)> {
        self.state().fresh.take()
    }

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
            return Err(Error::config(
                crate::memory::ENV_NIXL_SERVER,
                "an empty command",
            ));
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
    if !shm_name.starts_with(crate::memory::shm::NAME_PREFIX) || shm_name.contains('/') {
        return Err(Error::config(
            crate::memory::ENV_NIXL_SERVER,
            format!("{shm_name:?} is not an arena's name"),
        ));
    }
    let fd = crate::memory::shm::open(shm_name, libc::O_RDWR, 0)
        .map_err(|e| Error::io(format!("opening the arena {shm_name}"), e))?;
    let total = len
        .checked_add(crate::memory::shm::HEADER_BYTES)
        .and_then(|t| usize::try_from(t).ok())
        .ok_or_else(|| Error::config(crate::memory::ENV_NIXL_SERVER, "arena too large"))?;
    let (size, _) = crate::memory::shm::fstat(&fd)
        .map_err(|e| Error::io(format!("stat of the arena {shm_name}"), e))?;
    if size < total as u64 {
        return Err(Error::io(
            format!("the arena {shm_name}"),
            std::io::Error::other(format!("{size} bytes, {total} expected")),
        ));
    }
    // Pre-faulted: otherwise every page's first READ takes a fault in this process while the
    // producer publishes (measured: the producer's publish rate during reads fell to 0.3 x).
    let map = crate::memory::Mapping::map(
        fd.as_fd(),
        total,
        crate::memory::Access::ReadWrite,
        true,
        "the arena for NIXL",
    )?;
    let span = Span {
        addr: map.address() + crate::memory::shm::HEADER_BYTES,
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
    // Serve until the parent closes the pipe: not until a Ctrl+C, which the terminal sends to
    // the producer's whole process group (the producer may drain its work meanwhile, and its
    // trainers read through this server). A signal handled in this process (Python installs one
    // for SIGINT) interrupts the read: read again.
    // SAFETY: setting a signal's disposition to "ignore", before any other thread of ours
    // relies on it.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
    }
    let mut sink = [0u8; 64];
    let mut stdin = std::io::stdin().lock();
    loop {
        match stdin.read(&mut sink) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    drop(registration);
    drop(agent);
    drop(map);
    Ok(())
}
