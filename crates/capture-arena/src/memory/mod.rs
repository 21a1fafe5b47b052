//! Regions: the memory an arena places objects in.
//!
//! A [`Region`] is `len` bytes that the writer copies batches into, plus what a reader needs to
//! find them again: a session string and a base address. The allocator only deals in offsets
//! `[0, len)`; an object at offset `o` is published at address `base_address() + o`, so a reader
//! computes `offset = address - base` and checks `offset + bytes <= len` before touching memory.
//! A region need not be addressable by this process at all (device memory, memory a transfer
//! engine owns): the writer never dereferences `base_address`.
//!
//! Copies are per batch and may complete later: the writer calls [`Region::start`] with every
//! copy of a batch, then [`Region::progress`] until it reports [`Progress::Done`], serving control
//! input in between; it keeps the batch's sources alive and commits its objects only then. A
//! host region copies in slices of `budget` bytes per call (so peers are served during a very
//! large copy); a device region enqueues asynchronous copies in `start` and wakes the writer through
//! its [`Notifier`] when they finish.
//!
//! | region | memory | readers |
//! |---|---|---|
//! | [`ShmRegion`] | host POSIX shared memory | same host (`shm://` sessions) |
//! | `cuda::DeviceRegion` (feature `cuda`) | GPU memory, CUDA virtual memory with a fabric or POSIX-fd handle | other processes' GPUs (`cuda://` sessions) |
//! | `cuda::ExternalDeviceRegion` (feature `cuda`) | GPU memory another owner allocated (a transfer engine's) | the owner's readers |
//! | `nixl::NixlRegion` (feature `nixl`) | any region above that this process addresses, registered with a NIXL agent | any host, through UCX (`nixl://` sessions) |
//! | [`ExternalHostRegion`] | host memory another owner keeps alive (a transfer engine's registered buffer) | the owner's readers (`<host>:<port>` sessions of a Mooncake TransferEngine) |
//!
//! The allocator, the arena and the writer do not change with the region.

/// `SGLANG_SPEC_CAPTURE_NIXL_LIB`: `libnixl_capi.so`, as a file or the directory holding it.
pub const ENV_NIXL_LIB: &str = "SGLANG_SPEC_CAPTURE_NIXL_LIB";
/// `SGLANG_SPEC_CAPTURE_NIXL_SERVER`: who serves a host arena's NIXL READs: `inline` (an agent
/// in the producer's process), or a JSON array, the command of a server process of its own
/// ([`crate::config::nixl_server`]).
pub const ENV_NIXL_SERVER: &str = "SGLANG_SPEC_CAPTURE_NIXL_SERVER";

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod external;
pub(crate) mod guard;
mod host;
pub mod mapping;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod shm;

pub use external::ExternalHostRegion;
pub use mapping::{Access, Mapping};
pub use shm::{ShmRegion, ShmSession};

use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::sample::MAX_SESSION_BYTES;
use crate::tensor::TensorData;

/// One copy of a batch: `data` to `[offset, offset + data.len())` of the region.
#[derive(Debug, Clone, Copy)]
pub struct CopyOp<'a> {
    /// Offset in the region, inside `[0, len)` with room for the data (the arena checks).
    pub offset: u64,
    /// The source bytes, alive and unchanged until the batch completes or is abandoned.
    pub data: &'a TensorData,
}

/// Checks that every copy of a batch lies inside a region of `len` bytes advertised at `base`,
/// before anything is copied.
///
/// # Errors
/// [`crate::Error::OutOfRange`] for the first copy that does not fit.
pub(crate) fn check_ops(base: u64, len: u64, ops: &[CopyOp<'_>]) -> Result<()> {
    for op in ops {
        if op.offset.checked_add(op.data.len()).is_none_or(|e| e > len) {
            return Err(crate::Error::OutOfRange {
                address: base.wrapping_add(op.offset),
                len: op.data.len(),
                base,
                region_len: len,
            });
        }
    }
    Ok(())
}

/// Wakes the writer's event loop from any thread (a device region's completion callback).
#[derive(Clone)]
pub struct Notifier(pub(crate) Arc<mio::Waker>);

impl Notifier {
    /// Wakes the writer; it then calls [`Region::progress`] again.
    pub fn notify(&self) {
        if let Err(e) = self.0.wake() {
            tracing::warn!(error = %e, "waking the writer failed");
        }
    }
}

impl fmt::Debug for Notifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Notifier")
    }
}

/// The prefix of every reply endpoint (an abstract Unix socket, served by [`crate::reply`]): named
/// here, below the sessions that carry one.
pub const REPLY_ENDPOINT_PREFIX: &str = "@capture-arena-reply-";

/// What the writer's local reply path hands a reader that asks a region for something: bytes
/// (metadata) and descriptors (passed with `SCM_RIGHTS`).
#[derive(Debug, Default)]
pub struct Reply {
    /// The answer's bytes (JSON by convention).
    pub bytes: Vec<u8>,
    /// Descriptors to pass along (duplicates the region keeps no claim on).
    pub fds: Vec<OwnedFd>,
}

/// Where a batch in flight stands after [`Region::progress`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Every byte has landed; nothing is in flight any more.
    Done,
    /// More copying to do on the writer thread: call again soon (after serving control input).
    Again,
    /// Copies run elsewhere (a device); the region's [`Notifier`] wakes the writer when there
    /// is news.
    Waiting,
}

/// Memory an arena places objects in. Only the writer thread holds it (`&mut self` for copies).
pub trait Region: Send + fmt::Debug {
    /// Usable bytes, `[0, len)`.
    fn len(&self) -> u64;

    /// True if the region has no bytes (never, for a region an arena accepts).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The address advertised for offset 0: an object at offset `o` has address `base + o`.
    fn base_address(&self) -> u64;

    /// What a reader opens to reach this region (the result's `arena.session`).
    fn session(&self) -> &str;

    /// The address of offset 0 in this process (where the producer itself may write a
    /// reserved object's bytes): [`Region::base_address`] unless the region is advertised at
    /// other addresses (a NIXL server process's mapping).
    fn local_base(&self) -> u64 {
        self.base_address()
    }

    /// The session of the memory itself: differs from [`Region::session`] for a region that
    /// serves other memory through another transport (a NIXL region over shared memory names
    /// the `shm://` object here), so its owner can still clean it up.
    fn memory_session(&self) -> &str {
        self.session()
    }

    /// True when the region's [`Region::session`] and [`Region::base_address`] changed since
    /// the last call (a NIXL server process that was restarted serves the same memory under a
    /// new agent, mapped at another address). The arena asks before each commit, so a result's
    /// session and addresses always agree.
    fn renew(&mut self) -> bool {
        false
    }

    /// Gives the region the handle that wakes the writer (called once, before any copy).
    fn set_notifier(&mut self, _notifier: Notifier) {}

    /// Tells the region the writer's local reply endpoint (see [`crate::reply`]), before
    /// [`Region::session`] is read: regions whose readers fetch a handle there name it in the
    /// session.
    fn set_reply_endpoint(&mut self, _endpoint: &str) {}

    /// Starts copying one batch. At most one batch is in flight: the writer calls
    /// [`Region::progress`] with the same `ops` until it returns `Ready`.
    ///
    /// # Safety
    /// The memory each op's data names must stay valid and unchanged until
    /// [`Region::progress`] has returned `Done` or an error, or [`Region::abandon`] has
    /// returned: a device region copies from it asynchronously, after this call returns.
    ///
    /// # Errors
    /// If a copy cannot even be started (its data's kind cannot be copied into this region, a
    /// range outside the region); nothing is in flight then.
    unsafe fn start(&mut self, ops: &[CopyOp<'_>]) -> Result<()>;

    /// Advances the batch in flight by about `budget` bytes of work (host copies) or checks
    /// whether it finished (device copies).
    ///
    /// # Errors
    /// A copy failed: nothing is in flight any more, and the batch fails.
    fn progress(&mut self, ops: &[CopyOp<'_>], budget: u64) -> Result<Progress>;

    /// Stops the batch in flight, waiting for copies already issued (so the caller may drop
    /// the sources on return).
    fn abandon(&mut self) {}

    /// Zeroes `[offset, offset + len)` (a freed object's stamp, [`crate::arena`]) so that a
    /// reader that checks it afterwards sees the object gone, before any later copy can reach
    /// that space: host regions write at once, device regions enqueue the write ahead of later
    /// copies. A range outside the region or a failed write is logged, never fatal.
    fn clear(&mut self, offset: u64, len: u64);

    /// Stores the little-endian 8-byte `word` at `offset` (an object's stamp word,
    /// [`crate::arena`]) for readers in other processes, and returns once they can see it: host
    /// regions store at once with release ordering (every store this thread made before, and
    /// what the threads it synchronised with wrote, is seen first); device regions write it and
    /// wait until it landed. A range outside the region or a failed write is logged, never
    /// fatal.
    fn set_word(&mut self, offset: u64, word: u64);

    /// Answers a local reader's request on the reply path (`what` names the request), or
    /// `None` if this region has no such answer.
    fn reply(&self, _what: &str) -> Option<Result<Reply>> {
        None
    }
}

/// A session string `<scheme>://<host>/<id>?<name>=<value>&...` split and checked, its
/// parameters handed out in their one canonical order (shared by the device and NIXL sessions).
#[cfg_attr(not(any(feature = "cuda", feature = "nixl")), allow(dead_code))]
pub(crate) struct SessionParts<'a> {
    /// The producer's host (checked with [`host_ok`]).
    pub(crate) host: &'a str,
    /// What follows the host, before `?`.
    pub(crate) id: &'a str,
    params: std::str::Split<'a, char>,
}

#[cfg_attr(not(any(feature = "cuda", feature = "nixl")), allow(dead_code))]
impl<'a> SessionParts<'a> {
    /// Splits `s`, which must start with `scheme` (`"cuda://"`).
    pub(crate) fn split(s: &'a str, scheme: &str) -> std::result::Result<Self, String> {
        let rest = s
            .strip_prefix(scheme)
            .ok_or_else(|| format!("not {scheme}"))?;
        let (path, query) = rest.split_once('?').ok_or("no parameters")?;
        let (host, id) = path.split_once('/').ok_or("no host")?;
        if !host_ok(host) {
            return Err("bad host name".into());
        }
        Ok(SessionParts {
            host,
            id,
            params: query.split('&'),
        })
    }

    /// The value of the next parameter, which must be `name`.
    pub(crate) fn next(&mut self, name: &str) -> std::result::Result<&'a str, String> {
        self.params
            .next()
            .and_then(|p| p.strip_prefix(name))
            .and_then(|p| p.strip_prefix('='))
            .ok_or_else(|| format!("parameter {name} missing or out of order"))
    }

    /// `len=<bytes>&base=0x<hex>`: a non-empty range whose end does not overflow.
    pub(crate) fn len_and_base(&mut self) -> std::result::Result<(u64, u64), String> {
        let len: u64 = self
            .next("len")?
            .parse()
            .ok()
            .filter(|l| *l > 0)
            .ok_or("bad len")?;
        let base = self
            .next("base")?
            .strip_prefix("0x")
            .and_then(|h| u64::from_str_radix(h, 16).ok())
            .ok_or("bad base")?;
        if base.checked_add(len).is_none() {
            return Err("base + len overflows".into());
        }
        Ok((len, base))
    }

    /// Checks that no parameter is left.
    pub(crate) fn finish(mut self) -> std::result::Result<(), String> {
        match self.params.next() {
            Some(_) => Err("unexpected parameters".into()),
            None => Ok(()),
        }
    }
}

/// How a device arena is exported to readers in other processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HandlePreference {
    /// Fabric when the device reports it and a real create + export succeeds, else POSIX fd.
    #[default]
    Auto,
    /// POSIX file descriptor only (readers on this node).
    PosixFd,
    /// Fabric only (fails where it cannot be made).
    Fabric,
}

impl std::str::FromStr for HandlePreference {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<HandlePreference, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(HandlePreference::Auto),
            "fd" | "posix" | "posix_fd" => Ok(HandlePreference::PosixFd),
            "fabric" => Ok(HandlePreference::Fabric),
            _ => Err(format!("{s:?} is not one of auto, fd, fabric")),
        }
    }
}

/// `offset + len <= region_len`, else logs that the clear was refused (a bug of the caller).
pub(crate) fn clear_in_range(offset: u64, len: u64, region_len: u64) -> bool {
    let ok = offset.checked_add(len).is_some_and(|e| e <= region_len);
    if !ok {
        tracing::error!(
            offset,
            len,
            region_len,
            "a clear outside the region was refused"
        );
    }
    ok
}

/// Checks a session string an owner gives: non-empty, bounded, printable (it goes into every
/// result).
pub(crate) fn check_session(session: &str) -> Result<()> {
    if session.is_empty()
        || session.len() > MAX_SESSION_BYTES
        || session.chars().any(|c| c.is_control())
    {
        return Err(Error::InvalidSession {
            session: session.chars().take(80).collect(),
            reason: format!(
                "an external region's session must be 1 to {MAX_SESSION_BYTES} printable bytes"
            ),
        });
    }
    Ok(())
}

/// True for a plain host name as sessions carry it (letters, digits, `.`, `-`, `_`).
#[cfg_attr(not(any(feature = "cuda", feature = "nixl")), allow(dead_code))]
pub(crate) fn host_ok(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 253
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
}

/// This host's name, as sessions carry it (`localhost` if it cannot be read or is not a plain
/// host name).
#[cfg_attr(not(any(feature = "cuda", feature = "nixl")), allow(dead_code))]
pub(crate) fn this_host() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let name = String::from_utf8_lossy(&buf[..end]).into_owned();
    if rc == 0 && host_ok(&name) {
        name
    } else {
        "localhost".into()
    }
}
