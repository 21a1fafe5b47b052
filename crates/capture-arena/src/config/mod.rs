//! Configuration in one place: every environment variable of the capture sink, its typed field
//! and its default ([`Config`], here), the one function that decides placement (`placement.rs`),
//! the transports' settings (`transport.rs`) and how values are spelled (`parse.rs`).
//!
//! | variable | field | default |
//! |---|---|---|
//! | `SGLANG_SPEC_CAPTURE_ARENA_BYTES` | `arena_bytes` | none: required when the arena is used |
//! | `SGLANG_SPEC_CAPTURE_ARENA_ALIGN` | `alignment` | 256 |
//! | `SGLANG_SPEC_CAPTURE_ARENA_WAIT_S` | `arena_wait` | 30 s |
//! | `SGLANG_SPEC_CAPTURE_SYNC_WAIT_S` | `sync_wait` | 1 s: how long a synchronous caller (the scheduler thread of a patch that calls `put_sample`) waits for its batch to start; at most 86400 |
//! | `SGLANG_SPEC_CAPTURE_CONTROL_HOST`, else `MOONCAKE_LOCAL_HOSTNAME`'s host (without a port) | `control_host` | 127.0.0.1 |
//! | `SGLANG_SPEC_CAPTURE_CONTROL_PORT` | `control_port` | 0 (ephemeral) |
//! | `SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES` | `max_pending_batches` | 2 |
//! | `SGLANG_SPEC_CAPTURE_TIMING` | `timing` | off |
//! | `MOONCAKE_PROTOCOL` | `protocol` | unset (store placement) |
//! | `SGLANG_SPEC_CAPTURE_PLACEMENT` | `placement` | `auto`: a TransferEngine arena under `nvlink`/`nvlink_intra`, the Mooncake store otherwise |
//! | `SGLANG_SPEC_CAPTURE_GPU_PUT` | `gpu_put` | unset (on under `nvlink`) |
//! | `SGLANG_SPEC_CAPTURE_ARENA_EAGER` | `eager` | off: the arena is created on the first capture |
//! | `SGLANG_SPEC_CAPTURE_CONTROL_MAX_CONNS` | `max_connections` | 1024 |
//! | `SGLANG_SPEC_CAPTURE_CONTROL_BUFFER_BYTES` | `control_buffer_bytes` | 16 MiB |
//! | `SGLANG_SPEC_CAPTURE_CONTROL_LINE_TIMEOUT_S` | `line_timeout` | 10 s |
//! | `SGLANG_SPEC_CAPTURE_ARENA_DEVICE` | `device` | unset: the first device tensor's GPU, else 0 |
//! | `SGLANG_SPEC_CAPTURE_DEVICE_SPIN_S` | `device_spin` | 0.0002 (200 µs): how long the writer polls a device batch's completion before it sleeps until the driver's host function wakes it; 0: never polls; at most 0.01 |
//! | `SGLANG_SPEC_CAPTURE_ARENA_HANDLE` | `handle` | `auto`: fabric where NVML reports the fabric registered and a real export imports again, else POSIX fd |
//! | `SGLANG_SPEC_CAPTURE_OBJECT_TTL_S` | `object_ttl` | unset: objects stay until freed |
//! | `SGLANG_SPEC_CAPTURE_CONTROL_TOKEN` | `control_token` | unset: no token; `auto`: a random token per arena |
//! | `SGLANG_SPEC_CAPTURE_TRANSPORT` | `transport` | `auto`: the region's own (`shm://`, `cuda://`); `nixl` registers it with a NIXL agent |
//! | `SGLANG_SPEC_CAPTURE_NIXL_SERVER` ([`ENV_NIXL_SERVER`], [`nixl_server`]) | - | unset or `inline`: the producer's own NIXL agent serves a host arena (the CLI and the Python package set a server process of the producer's own when unset); a JSON array: that server's command |
//!
//! Read by trainers (readers), not part of [`Config`]:
//!
//! | variable | default |
//! |---|---|
//! | `SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S` ([`read_timeout`]) | 60 s: a read through NIXL that takes longer fails as a stale session |
//! | `SGLANG_SPEC_CAPTURE_NIXL_LIB` | unset: `libnixl_capi.so` from the library search path; else that file, or the directory holding it (producers and readers) |
//! | `SGLANG_SPEC_CAPTURE_PIN_HOST` ([`ENV_PIN_HOST`]; producers too) | on: shared memory is pinned (`cuMemHostRegister`) for copies to and from GPUs; `0` leaves it pageable |
//! | `SGLANG_SPEC_CAPTURE_READY_WAIT_S` | 30 s: how long a read waits for an object whose result was handed out before its bytes were written |

use std::time::Duration;

use crate::alloc::DEFAULT_ALIGNMENT;
use crate::error::{Error, Result};

mod parse;
mod placement;
mod transport;

pub use crate::memory::mapping::ENV_PIN_HOST;
use parse::parse_seconds;
pub use parse::{parse_bytes, parse_flag};
pub use placement::{is_nvlink, parse_placement, placement, Placement, ENV_PLACEMENT};
pub use transport::{
    nixl_server, read_timeout, ArenaTransport, DEFAULT_READ_TIMEOUT, ENV_NIXL_LIB, ENV_NIXL_SERVER,
    ENV_READ_TIMEOUT_S, ENV_TRANSPORT, UCX_TCP_SEG_SIZE,
};

/// `SGLANG_SPEC_CAPTURE_ARENA_BYTES`: arena size; plain bytes or with a `KiB`/`MiB`/`GiB`/`TiB`
/// suffix.
pub const ENV_ARENA_BYTES: &str = "SGLANG_SPEC_CAPTURE_ARENA_BYTES";
/// `SGLANG_SPEC_CAPTURE_ARENA_ALIGN`: alignment of every object, a power of two (named in the
/// allocator's module, whose setting it is).
pub use crate::alloc::ENV_ARENA_ALIGN;
/// `SGLANG_SPEC_CAPTURE_ARENA_WAIT_S`: how long a batch that does not fit waits for frees.
pub const ENV_ARENA_WAIT_S: &str = "SGLANG_SPEC_CAPTURE_ARENA_WAIT_S";
/// `SGLANG_SPEC_CAPTURE_SYNC_WAIT_S`: how long a synchronous caller waits for its batch to
/// start (for the arena to exist, for earlier batches, for frees) before it gets an error row.
pub const ENV_SYNC_WAIT_S: &str = "SGLANG_SPEC_CAPTURE_SYNC_WAIT_S";
/// The default of [`ENV_SYNC_WAIT_S`]: a synchronous caller is SGLang's scheduler thread, and
/// every second it waits is a second no request is served.
pub const DEFAULT_SYNC_WAIT: Duration = Duration::from_secs(1);
/// The longest [`ENV_SYNC_WAIT_S`]: a day, as the Python package's readers of it bound it.
pub const MAX_SYNC_WAIT: Duration = Duration::from_secs(86_400);
/// `SGLANG_SPEC_CAPTURE_CONTROL_HOST`: the host the control endpoint binds and advertises.
pub const ENV_CONTROL_HOST: &str = "SGLANG_SPEC_CAPTURE_CONTROL_HOST";
/// `MOONCAKE_LOCAL_HOSTNAME`: the fallback for the control host.
pub const ENV_LOCAL_HOSTNAME: &str = "MOONCAKE_LOCAL_HOSTNAME";
/// `SGLANG_SPEC_CAPTURE_CONTROL_PORT`: the control port; unset or 0 = ephemeral.
pub const ENV_CONTROL_PORT: &str = "SGLANG_SPEC_CAPTURE_CONTROL_PORT";
/// `SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES`: batches the writer's queue holds (>= 1).
pub const ENV_MAX_PENDING: &str = "SGLANG_SPEC_CAPTURE_MAX_PENDING_BATCHES";
/// `SGLANG_SPEC_CAPTURE_TIMING`: `1` logs one line per batch.
pub const ENV_TIMING: &str = "SGLANG_SPEC_CAPTURE_TIMING";
/// `MOONCAKE_PROTOCOL`: `nvlink`/`nvlink_intra` select a device arena (device publication);
/// see [`placement`].
pub const ENV_PROTOCOL: &str = "MOONCAKE_PROTOCOL";
/// `SGLANG_SPEC_CAPTURE_GPU_PUT`: `1` publish device tensors, `0` from host (an error under
/// `nvlink`).
pub const ENV_GPU_PUT: &str = "SGLANG_SPEC_CAPTURE_GPU_PUT";

/// `SGLANG_SPEC_CAPTURE_ARENA_EAGER`: `1` creates the arena when the sink starts instead of on
/// the first capture.
pub const ENV_EAGER: &str = "SGLANG_SPEC_CAPTURE_ARENA_EAGER";
/// `SGLANG_SPEC_CAPTURE_CONTROL_MAX_CONNS`: control (and reply) connections served at once.
pub const ENV_MAX_CONNS: &str = "SGLANG_SPEC_CAPTURE_CONTROL_MAX_CONNS";
/// `SGLANG_SPEC_CAPTURE_CONTROL_BUFFER_BYTES`: bytes of unfinished lines buffered across all
/// control connections.
pub const ENV_BUFFER_BYTES: &str = "SGLANG_SPEC_CAPTURE_CONTROL_BUFFER_BYTES";
/// `SGLANG_SPEC_CAPTURE_CONTROL_LINE_TIMEOUT_S`: how long a connection may hold an unfinished
/// line before it is closed.
pub const ENV_LINE_TIMEOUT_S: &str = "SGLANG_SPEC_CAPTURE_CONTROL_LINE_TIMEOUT_S";
/// `SGLANG_SPEC_CAPTURE_DEVICE_SPIN_S`: how long the writer polls a device batch's completion.
pub const ENV_DEVICE_SPIN_S: &str = "SGLANG_SPEC_CAPTURE_DEVICE_SPIN_S";

/// The largest alignment: the smallest page size ([`crate::page::MIN_PAGE`]). Addresses are
/// `base + offset` with `base` page-aligned, so every alignment up to it holds on every host,
/// at 4 KiB pages and at Grace's 64 KiB alike; a larger one would hold on some hosts only.
pub const MAX_ALIGNMENT: u64 = crate::page::MIN_PAGE as u64;

/// Default wait for frees.
pub const DEFAULT_ARENA_WAIT: Duration = Duration::from_secs(30);
/// Default writer queue capacity.
pub const DEFAULT_MAX_PENDING_BATCHES: usize = 2;
/// The host a control host variable names: an IPv6 address without its brackets; for
/// `MOONCAKE_LOCAL_HOSTNAME`, which may carry Mooncake's own port (`host:port`, `[v6]:port`),
/// without it. A port in `SGLANG_SPEC_CAPTURE_CONTROL_HOST` is an error naming the port's own
/// variable.
fn host_part<'a>(var: &'static str, h: &'a str) -> Result<&'a str> {
    let digits = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
    let (host, port) = if let Some(rest) = h.strip_prefix('[') {
        match rest.split_once(']') {
            Some((inner, "")) => (inner, None),
            Some((inner, tail)) => match tail.strip_prefix(':') {
                Some(p) if digits(p) => (inner, Some(p)),
                _ => return Err(Error::config(var, format!("{h:?} is not a host"))),
            },
            None => return Err(Error::config(var, format!("{h:?} is not a host"))),
        }
    } else {
        match h.split_once(':') {
            Some((host, p)) if !p.contains(':') && digits(p) => (host, Some(p)),
            _ => (h, None),
        }
    };
    if let Some(p) = port.filter(|_| var != ENV_LOCAL_HOSTNAME) {
        return Err(Error::config(
            var,
            format!(
                "{h:?} is a host and a port: name the host alone, and the port with \
                 {ENV_CONTROL_PORT}={p}"
            ),
        ));
    }
    Ok(host)
}

/// The control host must be one address trainers can reach, never all interfaces: a producer
/// advertises where it listens, and `0.0.0.0:port` is no place to connect to (it would also
/// expose the port on every network of the host).
fn check_control_host(var: &'static str, host: &str) -> Result<()> {
    if host.is_empty() {
        return Err(Error::config(var, "empty host"));
    }
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if bare
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_unspecified())
    {
        return Err(Error::config(
            var,
            format!(
                "{host} is every interface: the control endpoint binds one address, which \
                 results advertise to trainers; name this host's address on the trainers' \
                 network (or set SGLANG_SPEC_CAPTURE_CONTROL_HOST to it)"
            ),
        ));
    }
    Ok(())
}

/// Default control host: loopback, never all interfaces.
pub const DEFAULT_CONTROL_HOST: &str = "127.0.0.1";
/// Default bound on control connections.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Default bound on bytes of unfinished control lines, across connections.
pub const DEFAULT_CONTROL_BUFFER_BYTES: u64 = 16 << 20;
/// Default time a connection may hold an unfinished line.
pub const DEFAULT_LINE_TIMEOUT: Duration = Duration::from_secs(10);
/// The writer polls a device batch's completion event this long after enqueueing its copies,
/// then sleeps until the driver's host function wakes it: a small batch's copies are done within
/// it, and on an H200 machine polling took a 16 MiB publish from 102 to 38 µs (medians)
/// (BENCHMARKS.md, "Device path").
pub const DEFAULT_DEVICE_SPIN: Duration = Duration::from_micros(200);
/// The longest [`Config::device_spin`]: the writer serves nothing else while it polls.
pub const MAX_DEVICE_SPIN: Duration = Duration::from_millis(10);

/// True when this process's environment selects an arena (ours or a TransferEngine's), not the
/// Mooncake store.
pub fn arena_enabled() -> bool {
    Config::from_env().is_ok_and(|c| c.arena_enabled())
}

/// `SGLANG_SPEC_CAPTURE_ARENA_DEVICE`: the GPU (ordinal in this process) a device arena lives on.
pub const ENV_ARENA_DEVICE: &str = "SGLANG_SPEC_CAPTURE_ARENA_DEVICE";
/// `SGLANG_SPEC_CAPTURE_ARENA_HANDLE`: `auto`, `fd` or `fabric`, how a device arena is exported.
pub const ENV_ARENA_HANDLE: &str = "SGLANG_SPEC_CAPTURE_ARENA_HANDLE";

pub use crate::memory::HandlePreference;

/// `SGLANG_SPEC_CAPTURE_OBJECT_TTL_S`: objects not freed this long after publication are freed.
pub const ENV_OBJECT_TTL_S: &str = "SGLANG_SPEC_CAPTURE_OBJECT_TTL_S";
/// `SGLANG_SPEC_CAPTURE_CONTROL_TOKEN`: the control endpoint's shared secret, or `auto`.
pub const ENV_CONTROL_TOKEN: &str = "SGLANG_SPEC_CAPTURE_CONTROL_TOKEN";

/// Every setting, typed. Build it with struct-update syntax over [`Config::default`] or read it
/// from the environment with [`Config::from_env`]; [`Config::validate`] checks it (the writer
/// calls it when it starts).
#[derive(Clone, PartialEq)]
pub struct Config {
    /// Arena size in bytes (`SGLANG_SPEC_CAPTURE_ARENA_BYTES`). Required to start an arena.
    pub arena_bytes: Option<u64>,
    /// Alignment of every object (power of two).
    pub alignment: u64,
    /// How long a batch that does not fit waits for frees before failing.
    pub arena_wait: Duration,
    /// How long a synchronous caller waits for its batch to start ([`ENV_SYNC_WAIT_S`]).
    pub sync_wait: Duration,
    /// Host the control endpoint binds and advertises.
    pub control_host: String,
    /// Control port; 0 = ephemeral.
    pub control_port: u16,
    /// Capacity of the writer's queue of pending batches (>= 1).
    pub max_pending_batches: usize,
    /// Log one line per batch with its timing.
    pub timing: bool,
    /// `MOONCAKE_PROTOCOL`.
    pub protocol: Option<String>,
    /// `SGLANG_SPEC_CAPTURE_GPU_PUT`: `Some(false)` is an error under `nvlink`.
    pub gpu_put: Option<bool>,
    /// Target layers of the aux hidden states, echoed in every result.
    pub aux_layer_ids: Option<Vec<i64>>,
    /// Create the arena when the sink starts (instead of on the first capture, on the
    /// scheduler's thread).
    pub eager: bool,
    /// Control (and reply) connections served at once; more are accepted and closed at once.
    pub max_connections: usize,
    /// Bytes of unfinished lines buffered across all control connections (at least one
    /// maximal line, [`crate::limits::MAX_LINE_BYTES`]).
    pub control_buffer_bytes: u64,
    /// How long a connection may hold an unfinished line before it is closed.
    pub line_timeout: Duration,
    /// The GPU a device arena lives on (`None`: the first device tensor's, else 0).
    pub device: Option<i32>,
    /// How long the writer polls a device batch's completion before sleeping until the
    /// driver's host function wakes it ([`ENV_DEVICE_SPIN_S`]; zero: it never polls).
    pub device_spin: Duration,
    /// How a device arena is exported.
    pub handle: HandlePreference,
    /// `SGLANG_SPEC_CAPTURE_PLACEMENT` (`None`: auto, from the protocol).
    pub placement: Option<Placement>,
    /// `SGLANG_SPEC_CAPTURE_TRANSPORT`: how readers reach capture-arena's own arena.
    pub transport: ArenaTransport,
    /// `SGLANG_SPEC_CAPTURE_CONTROL_TOKEN`: a connection to the control endpoint presents this
    /// token before any free it sends is applied; `auto` draws a random one per arena. Results
    /// carry it (`arena.token`), so trainers need no setup. `None`: the plain protocol.
    pub control_token: Option<String>,
    /// `SGLANG_SPEC_CAPTURE_OBJECT_TTL_S`: a lease; objects not freed within it are freed by
    /// the writer and counted (`expired_objects`). `None`: objects stay until freed, as the
    /// capture contract has it.
    pub object_ttl: Option<Duration>,
}

/// The token is redacted: configurations end up in logs.
impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("arena_bytes", &self.arena_bytes)
            .field("alignment", &self.alignment)
            .field("arena_wait", &self.arena_wait)
            .field("sync_wait", &self.sync_wait)
            .field("control_host", &self.control_host)
            .field("control_port", &self.control_port)
            .field("max_pending_batches", &self.max_pending_batches)
            .field("timing", &self.timing)
            .field("protocol", &self.protocol)
            .field("gpu_put", &self.gpu_put)
            .field("aux_layer_ids", &self.aux_layer_ids)
            .field("eager", &self.eager)
            .field("max_connections", &self.max_connections)
            .field("control_buffer_bytes", &self.control_buffer_bytes)
            .field("line_timeout", &self.line_timeout)
            .field("device_spin", &self.device_spin)
            .field("device", &self.device)
            .field("handle", &self.handle)
            .field("placement", &self.placement)
            .field("transport", &self.transport)
            .field(
                "control_token",
                &self.control_token.as_ref().map(|_| "<redacted>"),
            )
            .field("object_ttl", &self.object_ttl)
            .finish()
    }
}

impl Default for Config {
    fn default() -> Config {
        Config {
            arena_bytes: None,
            alignment: DEFAULT_ALIGNMENT,
            arena_wait: DEFAULT_ARENA_WAIT,
            sync_wait: DEFAULT_SYNC_WAIT,
            control_host: DEFAULT_CONTROL_HOST.to_owned(),
            control_port: 0,
            max_pending_batches: DEFAULT_MAX_PENDING_BATCHES,
            timing: false,
            protocol: None,
            gpu_put: None,
            aux_layer_ids: None,
            eager: false,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            control_buffer_bytes: DEFAULT_CONTROL_BUFFER_BYTES,
            line_timeout: DEFAULT_LINE_TIMEOUT,
            device_spin: DEFAULT_DEVICE_SPIN,
            device: None,
            handle: HandlePreference::Auto,
            placement: None,
            transport: ArenaTransport::Auto,
            control_token: None,
            object_ttl: None,
        }
    }
}

impl Config {
    /// Reads every variable from this process's environment.
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable whose value is invalid.
    pub fn from_env() -> Result<Config> {
        Config::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads every variable through `get` (for tests and embedders without an environment).
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable whose value is invalid.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let c = Config::from_lookup_unchecked(get)?;
        c.validate()?;
        Ok(c)
    }

    /// As [`Config::from_lookup`] but without [`Config::validate`]: for callers that override
    /// fields before validating (the Python keyword arguments).
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable whose value does not parse.
    pub fn from_lookup_unchecked(get: impl Fn(&str) -> Option<String>) -> Result<Config> {
        let get = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let mut c = Config::default();
        if let Some(v) = get(ENV_ARENA_BYTES) {
            c.arena_bytes = Some(parse_bytes(&v).map_err(|r| Error::config(ENV_ARENA_BYTES, r))?);
        }
        if let Some(v) = get(ENV_ARENA_ALIGN) {
            c.alignment = parse_bytes(&v).map_err(|r| Error::config(ENV_ARENA_ALIGN, r))?;
        }
        if let Some(v) = get(ENV_ARENA_WAIT_S) {
            c.arena_wait = parse_seconds(&v).map_err(|r| Error::config(ENV_ARENA_WAIT_S, r))?;
        }
        if let Some(v) = get(ENV_SYNC_WAIT_S) {
            c.sync_wait = parse_seconds(&v).map_err(|r| Error::config(ENV_SYNC_WAIT_S, r))?;
        }
        if let Some(v) = get(ENV_LINE_TIMEOUT_S) {
            c.line_timeout = parse_seconds(&v).map_err(|r| Error::config(ENV_LINE_TIMEOUT_S, r))?;
        }
        if let Some(v) = get(ENV_DEVICE_SPIN_S) {
            c.device_spin = parse_seconds(&v).map_err(|r| Error::config(ENV_DEVICE_SPIN_S, r))?;
        }
        if let Some(v) = get(ENV_MAX_CONNS) {
            c.max_connections = v.trim().parse().map_err(|_| {
                Error::config(ENV_MAX_CONNS, format!("{v:?} is not a whole number >= 1"))
            })?;
        }
        if let Some(v) = get(ENV_BUFFER_BYTES) {
            c.control_buffer_bytes =
                parse_bytes(&v).map_err(|r| Error::config(ENV_BUFFER_BYTES, r))?;
        }
        if let Some(v) = get(ENV_EAGER) {
            c.eager = parse_flag(&v).map_err(|r| Error::config(ENV_EAGER, r))?;
        }
        let named = get(ENV_CONTROL_HOST).map(|h| (ENV_CONTROL_HOST, h));
        if let Some((var, h)) =
            named.or_else(|| get(ENV_LOCAL_HOSTNAME).map(|h| (ENV_LOCAL_HOSTNAME, h)))
        {
            c.control_host = host_part(var, h.trim())?.to_owned();
            check_control_host(var, &c.control_host)?;
        }
        if let Some(v) = get(ENV_CONTROL_PORT) {
            c.control_port = v.trim().parse().map_err(|_| {
                Error::config(
                    ENV_CONTROL_PORT,
                    format!("{v:?} is not a port (0-65535; 0 = ephemeral)"),
                )
            })?;
        }
        if let Some(v) = get(ENV_MAX_PENDING) {
            c.max_pending_batches = v.trim().parse().map_err(|_| {
                Error::config(ENV_MAX_PENDING, format!("{v:?} is not a whole number >= 1"))
            })?;
        }
        if let Some(v) = get(ENV_TIMING) {
            c.timing = parse_flag(&v).map_err(|r| Error::config(ENV_TIMING, r))?;
        }
        c.protocol = get(ENV_PROTOCOL).map(|p| p.trim().to_owned());
        if let Some(v) = get(ENV_ARENA_DEVICE) {
            c.device = Some(v.trim().parse().ok().filter(|d| *d >= 0).ok_or_else(|| {
                Error::config(
                    ENV_ARENA_DEVICE,
                    format!("{v:?} is not a device ordinal (0, 1, ...)"),
                )
            })?);
        }
        if let Some(v) = get(ENV_PLACEMENT) {
            c.placement = parse_placement(&v).map_err(|r| Error::config(ENV_PLACEMENT, r))?;
        }
        if let Some(v) = get(ENV_ARENA_HANDLE) {
            c.handle = v.parse().map_err(|r| Error::config(ENV_ARENA_HANDLE, r))?;
        }
        if let Some(v) = get(ENV_OBJECT_TTL_S) {
            c.object_ttl = Some(parse_seconds(&v).ok().filter(|d| !d.is_zero()).ok_or_else(
                || {
                    Error::config(
                        ENV_OBJECT_TTL_S,
                        format!("{v:?} is not a number of seconds > 0 (unset: no lease)"),
                    )
                },
            )?);
        }
        if let Some(v) = get(ENV_CONTROL_TOKEN) {
            c.control_token = Some(v.trim().to_owned());
        }
        if let Some(v) = get(ENV_TRANSPORT) {
            c.transport = v.parse().map_err(|r| Error::config(ENV_TRANSPORT, r))?;
        }
        if let Some(v) = get(ENV_GPU_PUT) {
            c.gpu_put = Some(parse_flag(&v).map_err(|r| Error::config(ENV_GPU_PUT, r))?);
        }
        Ok(c)
    }

    /// The control token this configuration asks for: `auto` drawn now (128 random bits as 32
    /// hex digits), else the configured one.
    ///
    /// # Errors
    /// [`Error::Io`] if the kernel's random source fails.
    pub fn resolved_control_token(&self) -> Result<Option<String>> {
        match self.control_token.as_deref() {
            Some("auto") => Ok(Some(format!("{:032x}", crate::random::nonce()?))),
            Some(t) => Ok(Some(t.to_owned())),
            None => Ok(None),
        }
    }

    /// The placement `protocol` selects.
    pub fn placement(&self) -> Placement {
        placement(self.protocol.as_deref(), self.placement)
    }

    /// True when `protocol` selects the arena (`nvlink`).
    pub fn arena_enabled(&self) -> bool {
        self.placement() != Placement::Store
    }

    /// True when tensors are published from the device: always under `nvlink`, else as
    /// `gpu_put` says (default host).
    pub fn device_publication(&self) -> bool {
        is_nvlink(self.protocol.as_deref()) || self.gpu_put == Some(true)
    }

    /// The arena size, which has no default so memory is never taken silently.
    ///
    /// # Errors
    /// [`Error::Config`] when `arena_bytes` is unset or zero.
    pub fn required_arena_bytes(&self) -> Result<u64> {
        match self.arena_bytes {
            Some(b) if b > 0 => Ok(b),
            _ => Err(Error::config(
                ENV_ARENA_BYTES,
                "the arena size is required when the arena is used and has no default; set \
                 SGLANG_SPEC_CAPTURE_ARENA_BYTES (e.g. 8GiB) or Config::arena_bytes",
            )),
        }
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable of the first invalid field.
    pub fn validate(&self) -> Result<()> {
        if self.max_pending_batches < 1 {
            return Err(Error::config(
                ENV_MAX_PENDING,
                format!(
                    "{} is < 1: the writer must be able to hold one batch",
                    self.max_pending_batches
                ),
            ));
        }
        if !self.alignment.is_power_of_two() || self.alignment > MAX_ALIGNMENT {
            return Err(Error::config(
                ENV_ARENA_ALIGN,
                format!(
                    "{} is not a power of two up to {MAX_ALIGNMENT} (the page size the region is \
                     mapped with); default {DEFAULT_ALIGNMENT}",
                    self.alignment
                ),
            ));
        }
        if is_nvlink(self.protocol.as_deref()) && self.gpu_put == Some(false) {
            return Err(Error::config(
                ENV_GPU_PUT,
                format!(
                    "MOONCAKE_PROTOCOL={} always publishes from the device; \
                     SGLANG_SPEC_CAPTURE_GPU_PUT off (0, false, no or off) is not supported \
                     with it (unset it or set 1)",
                    self.protocol.as_deref().unwrap_or_default().trim()
                ),
            ));
        }
        check_control_host(ENV_CONTROL_HOST, &self.control_host)?;
        if self.device_spin > MAX_DEVICE_SPIN {
            return Err(Error::config(
                ENV_DEVICE_SPIN_S,
                format!(
                    "{:?} would keep the writer from its control connections that long per \
                     device batch; at most {MAX_DEVICE_SPIN:?} (default {DEFAULT_DEVICE_SPIN:?})",
                    self.device_spin
                ),
            ));
        }
        if self.sync_wait > MAX_SYNC_WAIT {
            return Err(Error::config(
                ENV_SYNC_WAIT_S,
                format!(
                    "{} s: a synchronous caller (SGLang's scheduler thread) would wait that long \
                     for one batch; at most {} (default {})",
                    self.sync_wait.as_secs_f64(),
                    MAX_SYNC_WAIT.as_secs(),
                    DEFAULT_SYNC_WAIT.as_secs()
                ),
            ));
        }
        if self.max_connections < 1 {
            return Err(Error::config(
                ENV_MAX_CONNS,
                "0 connections would let no trainer free anything; at least 1",
            ));
        }
        let min_buffer = crate::limits::MAX_LINE_BYTES as u64;
        if self.control_buffer_bytes < min_buffer {
            return Err(Error::config(
                ENV_BUFFER_BYTES,
                format!(
                    "{} bytes cannot hold one maximal control line ({min_buffer} bytes); \
                     default {DEFAULT_CONTROL_BUFFER_BYTES}",
                    self.control_buffer_bytes
                ),
            ));
        }
        if let Some(t) = &self.control_token {
            if t != "auto" && !crate::limits::is_valid_token(t) {
                return Err(Error::config(
                    ENV_CONTROL_TOKEN,
                    format!(
                        "a token of {} bytes: use `auto` (a random token per arena) or 16 to 256 \
                         characters of A-Z a-z 0-9 . _ ~ + / = -",
                        t.len()
                    ),
                ));
            }
        }
        if self.transport == ArenaTransport::Nixl && !cfg!(feature = "nixl") {
            return Err(Error::config(
                ENV_TRANSPORT,
                "nixl: this build of capture-arena has no nixl feature (rebuild with --features \
                 nixl), or unset it for the region's own transport",
            ));
        }
        if self.line_timeout.is_zero() {
            return Err(Error::config(
                ENV_LINE_TIMEOUT_S,
                "0 s would close every connection mid-line; default 10",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(vars: &[(&str, &str)]) -> Result<Config> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("8GiB"), Ok(8 << 30));
        assert_eq!(parse_bytes(" 512 MiB "), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5gib"), Ok(3 << 29));
        assert!(parse_bytes("8GB").unwrap_err().contains("unknown unit"));
        assert!(parse_bytes("-1").is_err());
        assert!(parse_bytes("99999999999TiB").is_err());
        assert!(parse_bytes("").is_err());
    }

    #[test]
    fn defaults_and_env() {
        let c = cfg(&[]).unwrap();
        assert_eq!(c, Config::default());
        assert_eq!(c.control_host, "127.0.0.1");
        // The documented defaults, as numbers (not the constants compared with themselves): the
        // seed's 30 s wait for frees, a synchronous caller's 1 s, two pending batches.
        assert_eq!(c.arena_wait, Duration::from_secs(30));
        assert_eq!(c.sync_wait, Duration::from_secs(1));
        assert_eq!(c.max_pending_batches, 2);
        // docs/configuration.md's table: alignment 256, 1024 connections, 16 MiB of unfinished lines, 10 s
        // to finish a line, 60 s for a read.
        assert_eq!(c.alignment, 256);
        assert_eq!(c.max_connections, 1024);
        assert_eq!(c.control_buffer_bytes, 16 << 20);
        assert_eq!(c.line_timeout, Duration::from_secs(10));
        assert_eq!(c.device_spin, Duration::from_micros(200));
        assert_eq!(transport::DEFAULT_READ_TIMEOUT, Duration::from_secs(60));
        let e = c.required_arena_bytes().unwrap_err();
        assert!(
            e.to_string().contains("SGLANG_SPEC_CAPTURE_ARENA_BYTES"),
            "{e}"
        );
        let c = cfg(&[
            (ENV_ARENA_BYTES, "2GiB"),
            (ENV_ARENA_WAIT_S, "0.5"),
            (ENV_CONTROL_PORT, "5555"),
            (ENV_MAX_PENDING, "4"),
            (ENV_TIMING, "1"),
            (ENV_LOCAL_HOSTNAME, "10.1.2.3"),
        ])
        .unwrap();
        assert_eq!(c.required_arena_bytes().unwrap(), 2 << 30);
        assert_eq!(c.arena_wait, Duration::from_millis(500));
        assert_eq!(
            (c.control_port, c.max_pending_batches, c.timing),
            (5555, 4, true)
        );
        assert_eq!(c.control_host, "10.1.2.3");
        let c = cfg(&[
            (ENV_CONTROL_HOST, "127.0.0.2"),
            (ENV_LOCAL_HOSTNAME, "10.1.2.3"),
        ])
        .unwrap();
        assert_eq!(c.control_host, "127.0.0.2", "the explicit host wins");
        // Mooncake's hostname may carry its own port: the control host is its host part (before:
        // "10.1.2.3:17812" was taken whole, and binding failed resolving it); an IPv6 address
        // loses its brackets, which binding does not take.
        for (var, given, host) in [
            (ENV_LOCAL_HOSTNAME, "10.1.2.3:17812", "10.1.2.3"),
            (ENV_LOCAL_HOSTNAME, "[fd00::7]:17812", "fd00::7"),
            (ENV_LOCAL_HOSTNAME, "fd00::7", "fd00::7"),
            (ENV_LOCAL_HOSTNAME, "node-3.cluster", "node-3.cluster"),
            (ENV_CONTROL_HOST, "[fd00::7]", "fd00::7"),
        ] {
            assert_eq!(
                cfg(&[(var, given)]).unwrap().control_host,
                host,
                "{var}={given}"
            );
        }
        // Its own variable takes no port: said, with the port's variable.
        let e = cfg(&[(ENV_CONTROL_HOST, "10.1.2.3:5555")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("SGLANG_SPEC_CAPTURE_CONTROL_PORT=5555"), "{e}");
        for bad in ["[fd00::7", "[fd00::7]x"] {
            let e = cfg(&[(ENV_CONTROL_HOST, bad)]).unwrap_err().to_string();
            assert!(e.contains("is not a host"), "{e}");
        }
        // Never all interfaces, whichever variable names it.
        for (var, host) in [
            (ENV_LOCAL_HOSTNAME, "0.0.0.0"),
            (ENV_CONTROL_HOST, "::"),
            (ENV_CONTROL_HOST, "[::]"),
        ] {
            let e = cfg(&[(var, host)]).unwrap_err().to_string();
            assert!(e.contains(var) && e.contains("every interface"), "{e}");
        }
        let bad = Config {
            control_host: "0.0.0.0".into(),
            ..Config::default()
        };
        assert!(
            bad.validate().is_err(),
            "a Config made in code is checked too"
        );
    }

    #[test]
    fn invalid_values_name_their_variable() {
        for (k, v) in [
            (ENV_MAX_PENDING, "0"),
            (ENV_MAX_PENDING, "-1"),
            (ENV_CONTROL_PORT, "70000"),
            (ENV_ARENA_WAIT_S, "soon"),
            (ENV_ARENA_WAIT_S, "-1"),
            (ENV_ARENA_BYTES, "lots"),
            (ENV_ARENA_ALIGN, "3"),
            (ENV_ARENA_ALIGN, "8192"),
            (ENV_TIMING, "maybe"),
            (ENV_MAX_CONNS, "0"),
            (ENV_MAX_CONNS, "many"),
            (ENV_BUFFER_BYTES, "1KiB"),
            (ENV_LINE_TIMEOUT_S, "0"),
            (ENV_LINE_TIMEOUT_S, "-3"),
            (ENV_EAGER, "2"),
            (ENV_DEVICE_SPIN_S, "-0.001"),
            (ENV_DEVICE_SPIN_S, "0.011"),
            (ENV_SYNC_WAIT_S, "86400.001"),
            (ENV_SYNC_WAIT_S, "1e9"),
        ] {
            let e = cfg(&[(k, v)]).unwrap_err();
            assert!(e.to_string().contains(k), "{e} should name {k}");
        }
        // Polling a device batch can be turned off, and lengthened up to 10 ms.
        for (v, want) in [("0", 0), ("0.01", 10_000), ("0.00005", 50)] {
            let c = cfg(&[(ENV_DEVICE_SPIN_S, v)]).unwrap();
            assert_eq!(c.device_spin, Duration::from_micros(want));
        }
        // A synchronous caller waits a day at most, as the Python package reads the variable.
        let c = cfg(&[(ENV_SYNC_WAIT_S, "86400")]).unwrap();
        assert_eq!(c.sync_wait, MAX_SYNC_WAIT);
    }

    #[test]
    fn device_settings() {
        let c = cfg(&[(ENV_ARENA_DEVICE, "3"), (ENV_ARENA_HANDLE, "FD")]).unwrap();
        assert_eq!((c.device, c.handle), (Some(3), HandlePreference::PosixFd));
        let c = cfg(&[(ENV_ARENA_HANDLE, "fabric")]).unwrap();
        assert_eq!((c.device, c.handle), (None, HandlePreference::Fabric));
        for (var, v) in [
            (ENV_ARENA_DEVICE, "-1"),
            (ENV_ARENA_DEVICE, "gpu0"),
            (ENV_ARENA_HANDLE, "ipc"),
        ] {
            let e = cfg(&[(var, v)]).unwrap_err().to_string();
            assert!(e.contains(var), "{e}");
        }
    }

    #[test]
    fn placement_is_decided_in_one_place() {
        use Placement::*;
        // auto: the engine's device arena under NVLink, the store elsewhere.
        assert_eq!(placement(Some("nvlink"), None), Engine);
        assert_eq!(placement(Some(" NVLink_Intra "), None), Engine);
        assert_eq!(placement(Some("tcp"), None), Store);
        assert_eq!(placement(Some("rdma"), None), Store);
        assert_eq!(placement(None, None), Store);
        // An explicit setting wins, under any protocol.
        for p in [Arena, Engine, Store] {
            assert_eq!(placement(Some("tcp"), Some(p)), p);
            assert_eq!(placement(Some("nvlink"), Some(p)), p);
            assert_eq!(parse_placement(p.name()), Ok(Some(p)));
        }
        assert_eq!(parse_placement(" AUTO "), Ok(None));
        let e = cfg(&[(ENV_PLACEMENT, "shm")]).unwrap_err().to_string();
        assert!(
            e.contains(ENV_PLACEMENT) && e.contains("auto, arena, engine, store"),
            "{e}"
        );
        let c = cfg(&[(ENV_PROTOCOL, "tcp"), (ENV_PLACEMENT, "engine")]).unwrap();
        assert!(c.arena_enabled() && !c.device_publication());
        assert_eq!(c.placement(), Engine);
    }

    #[test]
    fn nvlink_selects_an_arena_and_device_publication() {
        let c = cfg(&[(ENV_PROTOCOL, "nvlink")]).unwrap();
        assert!(c.arena_enabled() && c.device_publication());
        let c = cfg(&[(ENV_PROTOCOL, "nvlink_intra"), (ENV_PLACEMENT, "arena")]).unwrap();
        assert!(c.arena_enabled() && c.device_publication());
        let c = cfg(&[(ENV_PROTOCOL, "nvlink"), (ENV_GPU_PUT, "1")]).unwrap();
        assert!(c.device_publication());
        let e = cfg(&[(ENV_PROTOCOL, "nvlink"), (ENV_GPU_PUT, "0")]).unwrap_err();
        assert!(
            e.to_string()
                .contains("SGLANG_SPEC_CAPTURE_GPU_PUT off (0, false, no or off) is not supported"),
            "{e}"
        );
        let c = cfg(&[(ENV_PROTOCOL, "tcp"), (ENV_GPU_PUT, "0")]).unwrap();
        assert!(!c.arena_enabled() && !c.device_publication());
        let typed = Config {
            protocol: Some("nvlink".into()),
            gpu_put: Some(false),
            ..Config::default()
        };
        assert!(
            typed.validate().is_err(),
            "the typed field is checked the same way"
        );
    }
}
