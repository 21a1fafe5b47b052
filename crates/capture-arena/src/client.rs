//! The trainer side: read published features by (session, address) and free them.
//!
//! - [`Reader`] opens sessions (cached) and reads or views features, validating every address and
//!   length against the arena and against `shape × dtype` before touching memory.
//! - [`ControlClient`] sends frees: one persistent connection per control endpoint, batched lines,
//!   reconnecting on the next call after an error; unsent keys stay pending and are retried.
//! - [`Store`] is what a trainer holds: `get` a result's tensors, `release` it, with
//!   use-after-release protection.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use crate::control::MAX_LINE_BYTES;
use crate::error::{Error, Result};
use crate::sample::{Feature, Published};
use crate::tensor::Dtype;
use crate::transport::{Transport, View};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Opens and caches sessions; reads and views features.
#[derive(Debug, Default)]
pub struct Reader {
    sessions: Mutex<HashMap<String, Transport>>,
}

impl Reader {
    /// A reader with no open session.
    pub fn new() -> Reader {
        Reader::default()
    }

    /// The transport for `session`, opened on first use and cached.
    ///
    /// # Errors
    /// As [`Transport::open`]: unknown scheme, or a stale session.
    pub fn open(&self, session: &str) -> Result<Transport> {
        let cached = lock(&self.sessions).get(session).cloned();
        if let Some(t) = cached {
            if t.is_live() {
                return Ok(t);
            }
            // The producer exited or restarted since we mapped it: forget the mapping (its
            // memory goes once no view holds it) and say so.
            lock(&self.sessions).remove(session);
            return Err(Error::StaleSession {
                session: session.to_owned(),
                reason: "the producer removed its arena after this reader opened it".into(),
            });
        }
        // Open without holding the lock (mapping a large region can take a moment).
        let t = Transport::open(session)?;
        Ok(lock(&self.sessions)
            .entry(session.to_owned())
            .or_insert(t)
            .clone())
    }

    /// Forgets a cached session (its mapping is released once no view holds it).
    pub fn close(&self, session: &str) {
        lock(&self.sessions).remove(session);
    }

    fn byte_len(result: &Published, name: &str, f: &Feature) -> Result<u64> {
        f.byte_len().ok_or_else(|| Error::InvalidRead {
            key: key_of(result, name),
            reason: format!("shape {:?} of {} overflows", f.shape, f.dtype),
        })
    }

    /// The byte length of feature `name` of `result`, checked against the arena it claims to be
    /// in (so a forged shape or address is refused before anything is allocated for it).
    ///
    /// # Errors
    /// [`Error::UnknownFeature`], [`Error::InvalidRead`] (shape overflows),
    /// [`Error::OutOfRange`], [`Error::StaleSession`].
    pub fn checked_len(&self, result: &Published, name: &str) -> Result<u64> {
        let f = feature(result, name)?;
        let len = Reader::byte_len(result, name, f)?;
        self.open(&result.arena.session)?.check(f.address, len)?;
        Ok(len)
    }

    /// Copies feature `name` of `result` into `out`, which must be exactly `shape × item size`
    /// bytes.
    ///
    /// # Errors
    /// [`Error::InvalidRead`] for an unknown name or a buffer of the wrong size,
    /// [`Error::OutOfRange`] for an address outside the arena, [`Error::StaleSession`].
    pub fn read(&self, result: &Published, name: &str, out: &mut [u8]) -> Result<()> {
        let f = feature(result, name)?;
        let len = Reader::byte_len(result, name, f)?;
        if out.len() as u64 != len {
            return Err(Error::InvalidRead {
                key: key_of(result, name),
                reason: format!(
                    "buffer holds {} bytes but shape {:?} of {} is {len} bytes",
                    out.len(),
                    f.shape,
                    f.dtype
                ),
            });
        }
        self.open(&result.arena.session)?.read(f.address, out)
    }

    /// Borrows feature `name` of `result` without copying.
    ///
    /// # Errors
    /// As [`Reader::read`].
    pub fn view(&self, result: &Published, name: &str) -> Result<View> {
        let f = feature(result, name)?;
        let len = Reader::byte_len(result, name, f)?;
        self.open(&result.arena.session)?.view(f.address, len)
    }
}

/// The key of feature `name` of `result` (built only for error messages).
fn key_of(result: &Published, name: &str) -> String {
    format!(
        "{}/{}/g{}/{name}",
        result.store_id, result.sample_id, result.gen
    )
}

fn feature<'a>(result: &'a Published, name: &str) -> Result<&'a Feature> {
    result
        .features
        .get(name)
        .ok_or_else(|| Error::UnknownFeature {
            key: key_of(result, name),
            available: result.features.keys().cloned().collect(),
        })
}

/// Keys per free line: well under [`MAX_LINE_BYTES`] for any sane key length.
const KEYS_PER_LINE: usize = 1024;

/// Sends frees to control endpoints. See the module docs.
#[derive(Debug)]
pub struct ControlClient {
    /// Connections of process `.0`; a forked child starts over with its own.
    conns: Mutex<(u32, HashMap<String, TcpStream>)>,
    pending: Mutex<Pending>,
    timeout: Duration,
}

impl Pending {
    /// The queue of `endpoint`; a new endpoint takes over the keys that had no endpoint.
    fn endpoint(&mut self, endpoint: &str) -> &mut Vec<String> {
        if !self.by_endpoint.contains_key(endpoint) {
            let unrouted = std::mem::take(&mut self.unrouted);
            self.by_endpoint.insert(endpoint.to_owned(), unrouted);
        }
        self.by_endpoint.entry(endpoint.to_owned()).or_default()
    }
}

#[derive(Debug, Default)]
struct Pending {
    /// Keys not yet sent, per known endpoint, in order.
    by_endpoint: BTreeMap<String, Vec<String>>,
    /// Keys with no endpoint while none was known: they go to the first endpoint learned.
    unrouted: Vec<String>,
}

impl Default for ControlClient {
    fn default() -> ControlClient {
        ControlClient::new(Duration::from_secs(5))
    }
}

impl ControlClient {
    /// A client whose connects and writes give up after `timeout`.
    pub fn new(timeout: Duration) -> ControlClient {
        ControlClient {
            conns: Mutex::new((std::process::id(), HashMap::new())),
            pending: Mutex::new(Pending::default()),
            timeout,
        }
    }

    /// Remembers an endpoint, so keys with no known endpoint reach it too.
    pub fn learn(&self, endpoint: &str) {
        lock(&self.pending).endpoint(endpoint);
    }

    /// Endpoints known so far.
    pub fn endpoints(&self) -> Vec<String> {
        lock(&self.pending).by_endpoint.keys().cloned().collect()
    }

    /// Keys waiting to be sent.
    pub fn pending(&self) -> usize {
        let p = lock(&self.pending);
        p.unrouted.len() + p.by_endpoint.values().map(Vec::len).sum::<usize>()
    }

    /// Queues `keys` for `endpoint` (or, if `None`, for every known endpoint; with none known
    /// yet, for the first one learned) and sends everything pending.
    ///
    /// An endpoint that refuses connections has no producer behind it any more: its keys are
    /// dropped (with a warning), since frees to an arena that is gone have nothing to free.
    ///
    /// # Errors
    /// [`Error::FreeNotSent`] if an endpoint this call queued keys for could not be reached;
    /// its keys stay pending and the next call retries them on a new connection. Failures of
    /// other endpoints are logged and retried, not reported here.
    pub fn free<I, S>(&self, endpoint: Option<&str>, keys: I) -> Result<()>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let touched: Vec<String> = {
            let mut p = lock(&self.pending);
            match endpoint {
                Some(e) => {
                    p.endpoint(e).extend(keys.into_iter().map(Into::into));
                    vec![e.to_owned()]
                }
                None if p.by_endpoint.is_empty() => {
                    p.unrouted.extend(keys.into_iter().map(Into::into));
                    vec![]
                }
                None => {
                    let keys: Vec<String> = keys.into_iter().map(Into::into).collect();
                    for v in p.by_endpoint.values_mut() {
                        v.extend(keys.iter().cloned());
                    }
                    p.by_endpoint.keys().cloned().collect()
                }
            }
        };
        self.send_pending(Some(&touched))
    }

    /// Sends every pending key.
    ///
    /// # Errors
    /// [`Error::FreeNotSent`] for the first endpoint that could not be reached.
    pub fn flush(&self) -> Result<()> {
        self.send_pending(None)
    }

    fn send_pending(&self, report: Option<&[String]>) -> Result<()> {
        let batches: Vec<(String, Vec<String>)> = lock(&self.pending)
            .by_endpoint
            .iter_mut()
            .filter(|(_, v)| !v.is_empty())
            .map(|(e, v)| (e.clone(), std::mem::take(v)))
            .collect();
        let mut first_err = None;
        for (endpoint, keys) in batches {
            let Err(source) = self.send(&endpoint, &keys) else {
                continue;
            };
            if source.kind() == ErrorKind::ConnectionRefused {
                tracing::warn!(
                    %endpoint,
                    dropped = keys.len(),
                    "control endpoint refuses connections (its producer is gone); dropping its frees"
                );
                continue;
            }
            let mut p = lock(&self.pending);
            let slot = p.by_endpoint.entry(endpoint.clone()).or_default();
            // Put them back in front of anything queued meanwhile.
            let newer = std::mem::replace(slot, keys);
            slot.extend(newer);
            let pending = slot.len();
            tracing::warn!(%endpoint, error = %source, pending, "frees not sent; will retry");
            let reported = report.is_none_or(|r| r.contains(&endpoint));
            if reported && first_err.is_none() {
                first_err = Some(Error::FreeNotSent {
                    endpoint,
                    pending,
                    source,
                });
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    fn send(&self, endpoint: &str, keys: &[String]) -> std::io::Result<()> {
        let mut buf = Vec::new();
        for chunk in keys.chunks(KEYS_PER_LINE) {
            let line = serde_json::to_vec(chunk).map_err(std::io::Error::other)?;
            if line.len() >= MAX_LINE_BYTES {
                // Absurdly long keys: fall back to one key per line.
                for k in chunk {
                    serde_json::to_writer(&mut buf, &[k]).map_err(std::io::Error::other)?;
                    buf.push(b'\n');
                }
            } else {
                buf.extend_from_slice(&line);
                buf.push(b'\n');
            }
        }
        // Take the connection out so no lock is held while connecting or writing.
        let cached = {
            let mut guard = lock(&self.conns);
            let pid = std::process::id();
            if guard.0 != pid {
                // Forked: the inherited sockets are the parent's; closing our copies leaves
                // its connections open.
                *guard = (pid, HashMap::new());
            }
            guard.1.remove(endpoint)
        };
        let mut stream = match cached {
            Some(c) if alive(&c) => c,
            Some(_) => {
                tracing::debug!(%endpoint, "control connection closed by the server; reconnecting");
                self.connect(endpoint)?
            }
            None => self.connect(endpoint)?,
        };
        stream.write_all(&buf)?;
        lock(&self.conns).1.insert(endpoint.to_owned(), stream);
        Ok(())
    }

    fn connect(&self, endpoint: &str) -> std::io::Result<TcpStream> {
        let mut last = std::io::Error::new(ErrorKind::AddrNotAvailable, "no address");
        for addr in endpoint.to_socket_addrs()? {
            match TcpStream::connect_timeout(&addr, self.timeout) {
                Ok(s) => {
                    s.set_write_timeout(Some(self.timeout))?;
                    s.set_nodelay(true)?;
                    return Ok(s);
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }
}

/// The server never writes, so a readable control socket is a closed (or broken) one.
fn alive(s: &TcpStream) -> bool {
    if s.set_nonblocking(true).is_err() {
        return false;
    }
    let mut b = [0u8; 1];
    let r = (&*s).read(&mut b);
    let ok = s.set_nonblocking(false).is_ok();
    ok && matches!(r, Err(ref e) if e.kind() == ErrorKind::WouldBlock)
}

/// A tensor copied out of the arena.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnedTensor {
    /// Shape.
    pub shape: Vec<u64>,
    /// Element type.
    pub dtype: Dtype,
    /// Row-major bytes.
    pub data: Vec<u8>,
}

/// Health figures of a [`Store`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Health {
    /// Samples read (`get`) and not yet released.
    pub resident_samples: u64,
    /// Their bytes.
    pub resident_bytes: u64,
    /// Keys whose free has not been sent yet.
    pub pending_frees: u64,
}

/// How many released samples a store remembers for use-after-release errors.
pub const RELEASED_MEMORY: usize = 1 << 20;

/// The trainer-facing store: read a result's tensors, release them.
///
/// A released sample is remembered by (session, store id, sample id, gen), for the last
/// [`RELEASED_MEMORY`] releases: reading it again is an error even though its bytes may still be
/// in the region. A sample published again under the same key (a retry with `replace`) is
/// therefore refused by a store that released the first one; a new `gen` is the contract's way
/// to publish a sample again.
#[derive(Debug, Default)]
pub struct Store {
    reader: Reader,
    control: ControlClient,
    state: Mutex<StoreState>,
}

#[derive(Debug, Default)]
struct StoreState {
    /// Sample -> feature -> bytes read (a feature read twice counts once).
    resident: HashMap<String, HashMap<String, u64>>,
    released: HashSet<String>,
    released_order: VecDeque<String>,
}

fn sample_key(r: &Published) -> String {
    format!(
        "{}\n{}/{}/g{}",
        r.arena.session, r.store_id, r.sample_id, r.gen
    )
}

impl Store {
    /// An empty store.
    pub fn new() -> Store {
        Store::default()
    }

    /// The reader underneath (for zero-copy views).
    pub fn reader(&self) -> &Reader {
        &self.reader
    }

    /// The control client underneath.
    pub fn control(&self) -> &ControlClient {
        &self.control
    }

    /// Fails with [`Error::Released`] if `r` was released by this store.
    ///
    /// # Errors
    /// As described.
    pub fn check(&self, r: &Published) -> Result<()> {
        if lock(&self.state).released.contains(&sample_key(r)) {
            return Err(Error::Released {
                sample: format!("{}/{}/g{}", r.store_id, r.sample_id, r.gen),
            });
        }
        Ok(())
    }

    /// Copies every feature of `result` (or those in `names`) out of the arena.
    ///
    /// # Errors
    /// [`Error::InvalidRead`] after `release` or for an unknown name; as [`Reader::read`].
    pub fn get(
        &self,
        result: &Published,
        names: Option<&[&str]>,
    ) -> Result<BTreeMap<String, OwnedTensor>> {
        self.check(result)?;
        self.control.learn(&result.arena.control);
        let wanted: Vec<&str> = match names {
            Some(n) => n.to_vec(),
            None => result.features.keys().map(String::as_str).collect(),
        };
        let mut out = BTreeMap::new();
        for name in wanted {
            let f = feature(result, name)?;
            let len = self.reader.checked_len(result, name)?;
            let len = usize::try_from(len).map_err(|_| Error::InvalidRead {
                key: key_of(result, name),
                reason: format!("{len} bytes do not fit in memory"),
            })?;
            let mut data = vec![0u8; len];
            self.reader.read(result, name, &mut data)?;
            out.insert(
                name.to_owned(),
                OwnedTensor {
                    shape: f.shape.clone(),
                    dtype: f.dtype,
                    data,
                },
            );
        }
        self.note_resident(result, out.iter().map(|(n, t)| (n.as_str(), t.data.len())));
        Ok(out)
    }

    /// Copies several features of `result` into caller buffers (each exactly its feature's
    /// size), counting the sample as resident until it is released.
    ///
    /// # Errors
    /// As [`Store::get_into`].
    pub fn get_many_into(&self, result: &Published, outs: &mut [(&str, &mut [u8])]) -> Result<()> {
        self.check(result)?;
        self.control.learn(&result.arena.control);
        for (name, out) in outs.iter_mut() {
            self.reader.read(result, name, out)?;
        }
        self.note_resident(result, outs.iter().map(|(n, o)| (*n, o.len())));
        Ok(())
    }

    fn note_resident<'a>(&self, result: &Published, read: impl Iterator<Item = (&'a str, usize)>) {
        let mut st = lock(&self.state);
        let features = st.resident.entry(sample_key(result)).or_default();
        for (name, len) in read {
            features.insert(name.to_owned(), len as u64);
        }
    }

    /// Copies feature `name` of `result` into `out` (exactly its size).
    ///
    /// # Errors
    /// As [`Store::get`] and [`Reader::read`].
    pub fn get_into(&self, result: &Published, name: &str, out: &mut [u8]) -> Result<()> {
        self.check(result)?;
        self.control.learn(&result.arena.control);
        self.reader.read(result, name, out)
    }

    /// Frees every object of `result` over its control endpoint; later `get`s of it fail.
    ///
    /// # Errors
    /// [`Error::FreeNotSent`] if the endpoint cannot be reached now: the sample is released all
    /// the same and its keys stay pending, retried by the next `release` or `flush`.
    pub fn release(&self, result: &Published) -> Result<()> {
        let sk = sample_key(result);
        {
            let mut st = lock(&self.state);
            st.resident.remove(&sk);
            if st.released.insert(sk.clone()) {
                st.released_order.push_back(sk);
                if st.released_order.len() > RELEASED_MEMORY {
                    if let Some(old) = st.released_order.pop_front() {
                        st.released.remove(&old);
                    }
                }
            }
        }
        self.control
            .free(Some(&result.arena.control), result.keys())
    }

    /// Retries frees that could not be sent.
    ///
    /// # Errors
    /// As [`ControlClient::flush`].
    pub fn flush(&self) -> Result<()> {
        self.control.flush()
    }

    /// Resident samples and bytes, and frees not yet sent.
    pub fn health(&self) -> Health {
        let st = lock(&self.state);
        Health {
            resident_samples: st.resident.len() as u64,
            resident_bytes: st.resident.values().flat_map(|f| f.values()).sum(),
            pending_frees: self.control.pending() as u64,
        }
    }
}
