//! Transports: how a reader reaches the bytes of published objects, chosen from the result's
//! session string. The reader API ([`crate::client`]) does not change with the transport.
//!
//! A [`Transport`] reads objects into caller-provided buffers ([`ReadOp`]), several per call, so
//! transports that batch requests (NIXL, a transfer engine) or write into registered or device
//! memory are further implementations; [`open`] picks one by the session's scheme.
//!
//! | scheme | transport | reach |
//! |---|---|---|
//! | `shm://` | [`ShmTransport`]: the producer's shared memory mapped read-only | same host |
//! | `cuda://` | `CudaTransport` (feature `cuda`): the producer's GPU allocation imported by POSIX fd or fabric handle | other processes' GPUs: this node (fd), the NVLink domain (fabric) |
//! | `nixl://` | `NixlTransport` (feature `nixl`): one-sided READs through NIXL's UCX backend | any host (TCP, RDMA), this host (shared memory, CMA), GPUs (CUDA IPC, NVLink) |
//!
//! Reads into a [`ReadBuffer`] let transports that register memory (NIXL) register it once.

mod buffer;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod shm;

pub use buffer::ReadBuffer;
#[cfg(feature = "cuda")]
pub use cuda::CudaTransport;
#[cfg(feature = "nixl")]
pub use nixl::NixlTransport;
pub use shm::ShmTransport;

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::memory::Mapping;
use crate::sample::{StampWord, STAMP_BYTES};

/// Where one read lands.
#[derive(Debug)]
#[non_exhaustive]
pub enum Destination<'a> {
    /// Host memory of this process.
    Host(&'a mut [u8]),
    /// Device memory of this process (written by builds with the `cuda` feature).
    Device(DeviceSlice),
}

/// `len` bytes of device memory at `ptr` on device `device` of this process: a destination
/// made only by the unsafe [`DeviceSlice::new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSlice {
    ptr: u64,
    len: u64,
    device: i32,
    after: Option<u64>,
}

impl DeviceSlice {
    /// A destination of `len` bytes at device address `ptr` on device ordinal `device`.
    ///
    /// # Safety
    /// The range must be device memory of this process, writable, valid and not used by anyone
    /// else until the read that writes it has returned.
    pub unsafe fn new(ptr: u64, len: u64, device: i32) -> DeviceSlice {
        DeviceSlice {
            ptr,
            len,
            device,
            after: None,
        }
    }

    /// The read's copy into this destination waits for the work enqueued so far on `stream`, a
    /// raw `CUstream` of this process on the destination's device (`0`: the legacy default
    /// stream): a kernel still using the buffer (or writing it, such as a `zero_()`) finishes
    /// first. The read itself is complete when it returns, whatever the stream.
    ///
    /// # Safety
    /// `stream` must be `0` or a live `CUstream` of this process on the destination's device,
    /// alive until the read that writes this destination has returned: the driver dereferences
    /// the handle without checking it.
    pub unsafe fn after(mut self, stream: u64) -> DeviceSlice {
        self.after = Some(stream);
        self
    }

    /// The stream the copy waits for, if any.
    pub fn waits_for(&self) -> Option<u64> {
        self.after
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for zero bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device ordinal.
    pub fn device(&self) -> i32 {
        self.device
    }
}

impl Destination<'_> {
    /// Bytes this destination takes.
    pub fn len(&self) -> u64 {
        match self {
            Destination::Host(b) => b.len() as u64,
            Destination::Device(d) => d.len,
        }
    }

    /// True for an empty destination.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One read: `into.len()` bytes at `address` of the arena.
#[derive(Debug)]
pub struct ReadOp<'a> {
    /// The published address of the first byte.
    pub address: u64,
    /// Where the bytes go.
    pub into: Destination<'a>,
}

/// An open session: one producer's arena, as this process reaches it.
pub trait Transport: Send + Sync + fmt::Debug {
    /// The session string it was opened from.
    fn session(&self) -> &str;

    /// True while the producer's arena still exists (false once it exited or restarted). Cheap
    /// enough to ask before every read.
    fn is_live(&self) -> bool;

    /// True only when the producer is provably gone, so that its frees can be dropped. A
    /// transport that is merely unusable (a read timed out across a partition) is not live but
    /// not gone either: its producer may still hold the objects. Local transports can tell (the
    /// arena's file or its owner is gone); the default is `!is_live()`.
    fn is_gone(&self) -> bool {
        !self.is_live()
    }

    /// Bytes of the arena (its data region).
    fn capacity(&self) -> u64;

    /// Checks that `[address, address + len)` lies inside the arena, before anything is
    /// allocated or touched for it.
    ///
    /// # Errors
    /// [`Error::OutOfRange`].
    fn check(&self, address: u64, len: u64) -> Result<()>;

    /// Performs every read, in any order; on error some destinations may be partly written.
    ///
    /// # Errors
    /// [`Error::OutOfRange`] for a range outside the arena (checked for every read before any is
    /// issued), [`Error::InvalidRead`] for a destination this transport cannot write,
    /// transport failures.
    fn read(&self, reads: &mut [ReadOp<'_>]) -> Result<()>;

    /// For transports that map the arena into this process: the mapping and the offset in it of
    /// `address`, after checking `[address, address + len)`. `None` otherwise.
    fn mapped(&self, _address: u64, _len: u64) -> Option<Result<(&Mapping, usize)>> {
        None
    }

    /// The objects' stamps at `at` (each an 8-byte aligned word inside the arena, which the
    /// caller checked), as the arena holds them now: read after every read issued before this
    /// call has completed. By default, one more [`Transport::read`].
    ///
    /// # Errors
    /// As [`Transport::read`].
    fn stamps(&self, at: &[u64]) -> Result<Vec<u64>> {
        read_words(self, at, &mut vec![0u8; at.len() * STAMP_BYTES as usize])
    }

    /// True when [`Transport::stamps`] costs about nothing (the arena is mapped here): readers
    /// then check the stamps before copying too, not only after.
    fn stamps_are_cheap(&self) -> bool {
        false
    }
}

/// Reads the words at `at` with one [`Transport::read`] into `words` (8 bytes each, at least
/// `at.len()` of them) and returns them.
///
/// # Errors
/// As [`Transport::read`].
pub(crate) fn read_words<T: Transport + ?Sized>(
    t: &T,
    at: &[u64],
    words: &mut [u8],
) -> Result<Vec<u64>> {
    const W: usize = STAMP_BYTES as usize;
    let mut ops: Vec<ReadOp<'_>> = at
        .iter()
        .zip(words.chunks_exact_mut(W))
        .map(|(&address, w)| ReadOp {
            address,
            into: Destination::Host(w),
        })
        .collect();
    t.read(&mut ops)?;
    drop(ops);
    Ok(words
        .chunks_exact(W)
        .take(at.len())
        .map(|w| {
            let mut b = [0u8; W];
            b.copy_from_slice(w);
            u64::from_le_bytes(b)
        })
        .collect())
}

/// Compares the objects' stamp words at `checks` (`(where, the result's stamp)`) with their
/// results' (the readiness rule of docs/protocol.md): `Ok(None)` when every object is there;
/// `Ok(Some(i))` when object `i` is still being written (its stamp with [`PENDING_BIT`]).
///
/// # Errors
/// [`Error::Changed`] for an object freed (0) or replaced (another stamp);
/// [`Error::WriteFailed`] for one whose copy failed; as [`Transport::stamps`].
pub(crate) fn verify_stamps(
    t: &dyn Transport,
    checks: &[(u64, u64)],
    key_of: impl Fn(usize) -> String,
) -> Result<Option<usize>> {
    if checks.is_empty() {
        return Ok(None);
    }
    let at: Vec<u64> = checks.iter().map(|c| c.0).collect();
    let found = t.stamps(&at)?;
    let mut pending = None;
    for (i, (&(_, stamp), found)) in checks.iter().zip(found).enumerate() {
        match StampWord::of(found, stamp) {
            StampWord::Ready => {}
            StampWord::Pending => pending = pending.or(Some(i)),
            StampWord::Failed => return Err(Error::WriteFailed { key: key_of(i) }),
            StampWord::Gone => {
                return Err(Error::Changed {
                    key: key_of(i),
                    stamp,
                    found,
                })
            }
        }
    }
    Ok(pending)
}

/// The longest pause between two looks at a stamp word still pending where a look costs
/// nothing (a mapped arena): the most a reader arrives late for bytes just written.
pub(crate) const CHEAP_POLL_MAX: Duration = Duration::from_millis(1);
/// The same where a look is a copy across a network: it is made again at most this often.
pub(crate) const COPY_POLL_MAX: Duration = Duration::from_millis(10);

/// Waits until no object at `checks` is still being written ([`verify_stamps`]), polling with
/// a back-off from 50 µs to [`CHEAP_POLL_MAX`] (a mapped arena's words cost nothing to read),
/// until `deadline` (then [`Error::NotReady`], `since` being when the read began).
///
/// # Errors
/// As [`verify_stamps`]; [`Error::NotReady`].
pub(crate) fn wait_ready(
    t: &dyn Transport,
    checks: &[(u64, u64)],
    key_of: impl Fn(usize) -> String,
    since: Instant,
    deadline: Instant,
) -> Result<()> {
    let mut pause = Duration::from_micros(50);
    while let Some(i) = verify_stamps(t, checks, &key_of)? {
        pause_or_give_up(&mut pause, CHEAP_POLL_MAX, since, deadline, || key_of(i))?;
    }
    Ok(())
}

/// Copies `ops` once no object at `checks` is still being written, and returns only bytes that
/// were the objects' (the readiness rule of docs/protocol.md): every word is looked at before
/// the copy and again after it. The look before is what makes a copy valid: a word still
/// pending then may turn ready while the copy reads unwritten bytes, or just after it, and the
/// look after alone cannot tell those bytes from the written ones. The look after catches an
/// object freed or replaced during the copy. Where looks cost nothing (a mapped arena) the
/// look before polls from 50 µs to [`CHEAP_POLL_MAX`]; elsewhere each look is a small copy of
/// the words, made again at most every [`COPY_POLL_MAX`]. Until `deadline`, then
/// [`Error::NotReady`] (`since` being when the read began).
///
/// # Errors
/// As [`verify_stamps`] and [`Transport::read`]; [`Error::NotReady`].
pub(crate) fn read_when_ready(
    t: &dyn Transport,
    ops: &mut [ReadOp<'_>],
    checks: &[(u64, u64)],
    key_of: impl Fn(usize) -> String,
    since: Instant,
    deadline: Instant,
) -> Result<()> {
    let most = if t.stamps_are_cheap() {
        CHEAP_POLL_MAX
    } else {
        COPY_POLL_MAX
    };
    let mut pause = Duration::from_micros(50);
    loop {
        if let Some(i) = verify_stamps(t, checks, &key_of)? {
            pause_or_give_up(&mut pause, most, since, deadline, || key_of(i))?;
            continue;
        }
        t.read(ops)?;
        // A word never turns pending again once it held the stamp: after the look before, this
        // finds the stamp, or fails for an object freed, replaced or failed meanwhile.
        if let Some(i) = verify_stamps(t, checks, &key_of)? {
            return Err(Error::InvalidRead {
                key: key_of(i),
                reason: "its stamp word turned back to \"being written\" during the read: the \
                         producer does not follow the readiness rule of docs/protocol.md"
                    .into(),
            });
        }
        return Ok(());
    }
}

/// Sleeps the next back-off step (doubling up to `most`, never past `deadline`), or
/// [`Error::NotReady`] for `key()` once `deadline` has passed.
pub(crate) fn pause_or_give_up(
    pause: &mut Duration,
    most: Duration,
    since: Instant,
    deadline: Instant,
    key: impl FnOnce() -> String,
) -> Result<()> {
    let now = Instant::now();
    if now >= deadline {
        return Err(Error::NotReady {
            key: key(),
            waited: now - since,
        });
    }
    std::thread::sleep((*pause).min(deadline - now));
    *pause = (*pause * 2).min(most);
    Ok(())
}

/// The offset of `[address, address + n)` in an arena of `len` bytes advertised at `base`,
/// checked before anything is touched for it.
///
/// # Errors
/// [`Error::OutOfRange`].
pub(crate) fn offset_in(base: u64, len: u64, address: u64, n: u64) -> Result<u64> {
    address
        .checked_sub(base)
        .filter(|&o| o.checked_add(n).is_some_and(|e| e <= len))
        .ok_or(Error::OutOfRange {
            address,
            len: n,
            base,
            region_len: len,
        })
}

/// True when the producer of `session` is known to be gone, without opening the session
/// (`false` when that cannot be told: another scheme, another host).
pub fn is_gone(session: &str) -> bool {
    if session.starts_with("shm://") {
        return session
            .parse::<crate::memory::ShmSession>()
            .is_ok_and(|s| shm::is_gone(&s));
    }
    #[cfg(feature = "cuda")]
    if session.starts_with("cuda://") {
        return session
            .parse::<crate::memory::cuda::CudaSession>()
            .is_ok_and(|s| cuda::is_gone(&s));
    }
    false
}

/// Opens the arena a session string names.
///
/// # Errors
/// [`Error::InvalidSession`] for a scheme this build cannot read or a malformed session;
/// [`Error::StaleSession`] when the producer is gone or restarted.
pub fn open(session: &str) -> Result<Arc<dyn Transport>> {
    if session.starts_with("shm://") {
        return Ok(Arc::new(ShmTransport::open(&session.parse()?)?));
    }
    if session.starts_with("cuda://") {
        #[cfg(feature = "cuda")]
        return Ok(Arc::new(CudaTransport::open(&session.parse()?)?));
        #[cfg(not(feature = "cuda"))]
        return Err(Error::InvalidSession {
            session: session.chars().take(256).collect(),
            reason: "a device arena; this build cannot read it (build capture-arena with the \
                     cuda feature)"
                .into(),
        });
    }
    if session.starts_with("nixl://") {
        #[cfg(feature = "nixl")]
        return Ok(Arc::new(NixlTransport::open(&session.parse()?)?));
        #[cfg(not(feature = "nixl"))]
        return Err(Error::InvalidSession {
            session: session.chars().take(256).collect(),
            reason: "an arena served through NIXL; this build cannot read it (build \
                     capture-arena with the nixl feature)"
                .into(),
        });
    }
    let mut known = vec!["shm:// (same-host shared memory)"];
    if cfg!(feature = "cuda") {
        known.push("cuda:// (device arenas)");
    }
    if cfg!(feature = "nixl") {
        known.push("nixl:// (NIXL, any host)");
    }
    Err(Error::InvalidSession {
        session: session.chars().take(256).collect(),
        reason: format!(
            "unknown transport; this build reads {} sessions",
            known.join(", ")
        ),
    })
}

/// A zero-copy view of one object's bytes in a mapped arena. It keeps the mapping alive.
///
/// Made only by the unsafe [`View::new`], whose caller promises the bytes stay as published
/// while the view lives.
pub struct View {
    transport: Arc<dyn Transport>,
    address: u64,
    len: u64,
    /// `(key, where, stamp)` when the result carries the object's stamp.
    stamp: Option<(String, u64, u64)>,
}

impl View {
    /// A view of `len` bytes at `address`.
    ///
    /// # Errors
    /// [`Error::OutOfRange`]; [`Error::InvalidRead`] if the transport does not map the arena
    /// into this process (read into a buffer instead).
    ///
    /// # Safety
    /// The object there must stay resident, neither freed nor replaced by anyone (this trainer,
    /// another trainer, a retry with `replace`), until the view is dropped: the producer reuses
    /// freed space, and another process writing the bytes under a live `&[u8]` breaks Rust's
    /// aliasing rules.
    pub unsafe fn new(transport: Arc<dyn Transport>, address: u64, len: u64) -> Result<View> {
        match transport.mapped(address, len) {
            Some(r) => r.map(|_| ())?,
            None => {
                return Err(Error::InvalidRead {
                    key: transport.session().to_owned(),
                    reason: "this transport does not map the arena; read into a buffer".into(),
                })
            }
        }
        Ok(View {
            transport,
            address,
            len,
            stamp: None,
        })
    }

    /// Checks the object's stamp now (it must be `stamp` at `at`, an aligned word inside the
    /// arena), waiting until `deadline` while its bytes are still being written, and again in
    /// [`View::check`].
    ///
    /// # Errors
    /// [`Error::Changed`] when the object was freed, [`Error::WriteFailed`],
    /// [`Error::NotReady`]; as [`Transport::check`].
    pub(crate) fn stamped(
        mut self,
        key: String,
        at: u64,
        stamp: u64,
        deadline: Instant,
    ) -> Result<View> {
        self.transport.check(at, STAMP_BYTES)?;
        let checks = [(at, stamp)];
        wait_ready(
            &*self.transport,
            &checks,
            |_| key.clone(),
            Instant::now(),
            deadline,
        )?;
        self.stamp = Some((key, at, stamp));
        Ok(self)
    }
}

impl View {
    /// Whether the bytes seen through this view were the object's: fails once the object was
    /// freed (its stamp changed: another reader released it, its lease ended), or the
    /// producer's shared memory was truncated under the mapping (by another process of its
    /// user), after which the view shows zeros. Call it after using the bytes, as a copy checks
    /// after copying.
    ///
    /// # Errors
    /// [`Error::Changed`] if the object was freed; [`Error::StaleSession`] if the memory was
    /// truncated.
    pub fn check(&self) -> Result<()> {
        if let Some((key, at, stamp)) = &self.stamp {
            // Ready when the view was made, so it cannot be pending again: only freed.
            if verify_stamps(&*self.transport, &[(*at, *stamp)], |_| key.clone())?.is_some() {
                return Err(Error::NotReady {
                    key: key.clone(),
                    waited: Duration::ZERO,
                });
            }
        }
        match self.transport.mapped(self.address, self.len) {
            Some(Ok((map, _))) if map.lost() => Err(Error::StaleSession {
                session: self.transport.session().to_owned(),
                reason: "its shared memory was truncated by another process while this view \
                         showed it; the bytes seen may be zeros"
                    .into(),
            }),
            _ => Ok(()),
        }
    }
}

impl Deref for View {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        let Some(Ok((map, offset))) = self.transport.mapped(self.address, self.len) else {
            // Checked against this very mapping when the view was made; it does not change.
            unreachable!("a view's range was checked when it was made");
        };
        // SAFETY: the range is inside the mapping, which `self.transport` keeps alive; the
        // creator of the view promised (View::new) that the bytes do not change while it lives.
        unsafe { map.bytes(offset, self.len as usize) }.unwrap_or_default()
    }
}

impl AsRef<[u8]> for View {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl fmt::Debug for View {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("View")
            .field("session", &self.transport.session())
            .field("address", &self.address)
            .field("len", &self.len)
            .field("stamp", &self.stamp.as_ref().map(|c| c.2))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::PENDING_BIT;
    use std::sync::Mutex;

    /// An arena of 16 bytes at 0 and its stamp word at 16, whose producer finishes the object
    /// (bytes 0xab, the word its stamp) right after `finish_after` reads of the arena.
    #[derive(Debug)]
    struct Finishing {
        mem: Mutex<(Vec<u8>, usize)>,
        finish_after: usize,
    }

    const STAMP: u64 = 7;

    impl Finishing {
        fn new(finish_after: usize) -> Finishing {
            let mut mem = vec![0u8; 24];
            mem[16..].copy_from_slice(&(STAMP | PENDING_BIT).to_le_bytes());
            Finishing {
                mem: Mutex::new((mem, 0)),
                finish_after,
            }
        }
    }

    impl Transport for Finishing {
        fn session(&self) -> &str {
            "test://finishing"
        }
        fn is_live(&self) -> bool {
            true
        }
        fn capacity(&self) -> u64 {
            24
        }
        fn check(&self, address: u64, len: u64) -> Result<()> {
            offset_in(0, 24, address, len).map(drop)
        }
        fn read(&self, reads: &mut [ReadOp<'_>]) -> Result<()> {
            let mut g = self.mem.lock().unwrap();
            for r in reads.iter_mut() {
                let Destination::Host(b) = &mut r.into else {
                    panic!("host reads only")
                };
                let a = r.address as usize;
                b.copy_from_slice(&g.0[a..a + b.len()]);
            }
            g.1 += 1;
            if g.1 == self.finish_after {
                g.0[..16].fill(0xab);
                g.0[16..].copy_from_slice(&STAMP.to_le_bytes());
            }
            Ok(())
        }
    }

    fn read(t: &Finishing, wait: Duration) -> Result<Vec<u8>> {
        let mut out = vec![0u8; 16];
        let mut ops = [ReadOp {
            address: 0,
            into: Destination::Host(&mut out),
        }];
        let since = Instant::now();
        read_when_ready(
            t,
            &mut ops,
            &[(16, STAMP)],
            |_| "st/a/g1/h".into(),
            since,
            since + wait,
        )?;
        Ok(out)
    }

    #[test]
    fn bytes_copied_before_the_word_turned_ready_are_never_returned() {
        // The producer finishes right after whichever read comes first: a reader that copies
        // first and looks after would find the stamp and return the zeros it copied.
        let t = Finishing::new(1);
        assert_eq!(read(&t, Duration::from_secs(5)).unwrap(), vec![0xab; 16]);
        // Finished later: the reader looks, waits, looks again, then copies.
        let t = Finishing::new(3);
        assert_eq!(read(&t, Duration::from_secs(5)).unwrap(), vec![0xab; 16]);
        assert!(
            t.mem.lock().unwrap().1 >= 5,
            "looked before and after the copy"
        );
        // Never finished: NotReady at the deadline, naming the object.
        let t = Finishing::new(usize::MAX);
        match read(&t, Duration::from_millis(20)) {
            Err(Error::NotReady { key, waited }) => {
                assert_eq!(key, "st/a/g1/h");
                assert!(waited >= Duration::from_millis(20), "{waited:?}");
            }
            other => panic!("{other:?}"),
        }
    }
}
