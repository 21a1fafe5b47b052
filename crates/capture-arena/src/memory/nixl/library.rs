//! The NIXL library and its agents: `libnixl_capi.so` opened and every symbol this crate calls
//! checked before the first call (the stubs of `nixl-sys` abort the process on a missing one),
//! agents with their UCX backend, and a span registered with a new agent.

use std::fmt;
use std::sync::OnceLock;

use nixl_sys::{Agent, AgentConfig, Backend, ThreadSync};

use super::session::Span;
use crate::error::{Error, Result};
use crate::memory::ENV_NIXL_LIB;

/// The progress thread's poll timeout (NIXL rounds it up to whole milliseconds).
const PROGRESS_POLL_US: u64 = 1000;
/// The library the stubs of `nixl-sys` open by name.
const LIBRARY: &str = "libnixl_capi.so";

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

/// A fresh agent name, unique to this process and arena.
pub(super) fn agent_name() -> Result<String> {
    Ok(format!(
        "capture-arena-{}-{:032x}",
        std::process::id(),
        crate::random::nonce()?
    ))
}

/// An agent named `name` with its progress thread, `span` registered with it, and its metadata.
pub(super) fn register(
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
