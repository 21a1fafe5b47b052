//! Frees to control endpoints, per endpoint: one persistent connection, keys waiting to be sent,
//! and a back-off after a failure.
//!
//! Rules (the capture contract's, plus bounds):
//! - a free for endpoint `E` touches `E` alone: an endpoint that is unreachable (a dead host, a
//!   full backlog) never delays frees to another one;
//! - a failed send stays pending and is retried: by the next free to the same endpoint or by
//!   [`ControlClient::flush`], but not before its back-off (100 ms, doubling to 30 s) has
//!   passed, so an endpoint that times out costs its caller one timeout, not one per free;
//! - an endpoint that refuses connections has no producer any more: its keys are dropped (a
//!   producer that is gone has nothing left to free) and the endpoint forgotten;
//! - a key whose endpoint is unknown ([`ControlClient::free`] with `None`) goes to every endpoint
//!   known now and to every endpoint learned later;
//! - keys waiting are bounded ([`DEFAULT_MAX_PENDING_KEYS`] for all endpoints together, the
//!   same again for unlocated keys); past the bound the oldest are dropped, counted in
//!   [`ControlClient::dropped`] and warned about.

use std::collections::{BTreeMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::lock;
use crate::control::MAX_LINE_BYTES;
use crate::error::{Error, Result};
use crate::key::Key;

/// Keys that may wait to be sent, across endpoints (about 100 bytes each).
pub const DEFAULT_MAX_PENDING_KEYS: usize = 1 << 18;
/// Bytes per free line the client writes: well under the server's [`MAX_LINE_BYTES`], and any
/// valid key fits.
const LINE_BYTES: usize = 64 * 1024;
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

#[derive(Debug, Default)]
struct Endpoint {
    pending: VecDeque<Key>,
    /// The persistent connection; `None` while none is open or while a sender has it.
    conn: Option<TcpStream>,
    /// A thread is sending to this endpoint: others only queue.
    sending: bool,
    /// After a failure: not before `.0`; the next failure waits twice `.1`; the error.
    backoff: Option<(Instant, Duration, ErrorKind, String)>,
}

#[derive(Debug)]
struct State {
    /// The process the connections belong to; a forked child starts over.
    pid: u32,
    endpoints: BTreeMap<String, Endpoint>,
    /// Keys with no known endpoint, for every endpoint learned later (bounded, oldest first).
    unlocated: VecDeque<Key>,
    /// Keys waiting across endpoints.
    pending: usize,
    dropped: u64,
    warned_drop: Option<Instant>,
}

/// Sends frees to control endpoints. See the module docs.
#[derive(Debug)]
pub struct ControlClient {
    state: Mutex<State>,
    timeout: Duration,
    max_pending: usize,
}

impl Default for ControlClient {
    fn default() -> ControlClient {
        ControlClient::new(Duration::from_secs(5))
    }
}

impl ControlClient {
    /// A client whose connects and writes give up after `timeout`.
    pub fn new(timeout: Duration) -> ControlClient {
        ControlClient::with_limit(timeout, DEFAULT_MAX_PENDING_KEYS)
    }

    /// A client that keeps at most `max_pending` keys waiting (and as many unlocated ones).
    pub fn with_limit(timeout: Duration, max_pending: usize) -> ControlClient {
        ControlClient {
            state: Mutex::new(State {
                pid: std::process::id(),
                endpoints: BTreeMap::new(),
                unlocated: VecDeque::new(),
                pending: 0,
                dropped: 0,
                warned_drop: None,
            }),
            timeout,
            max_pending: max_pending.max(1),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        let mut s = lock(&self.state);
        if s.pid != std::process::id() {
            // Forked: the inherited sockets are the parent's; closing our copies leaves its
            // connections open. The keys waiting are the parent's to send.
            s.pid = std::process::id();
            s.endpoints.clear();
            s.unlocated.clear();
            s.pending = 0;
        }
        s
    }

    /// Remembers an endpoint; keys with no known endpoint are queued for it too.
    pub fn learn(&self, endpoint: &str) {
        let mut s = self.state();
        self.endpoint(&mut s, endpoint);
    }

    /// The endpoint's entry, made (with the unlocated keys) if new.
    fn endpoint<'a>(&self, s: &'a mut State, endpoint: &str) -> &'a mut Endpoint {
        if !s.endpoints.contains_key(endpoint) {
            let keys: Vec<Key> = s.unlocated.iter().cloned().collect();
            s.endpoints.insert(endpoint.to_owned(), Endpoint::default());
            self.queue(s, endpoint, keys);
        }
        s.endpoints.entry(endpoint.to_owned()).or_default()
    }

    /// Queues keys for a known endpoint, dropping the oldest waiting keys past the bound.
    fn queue(&self, s: &mut State, endpoint: &str, keys: impl IntoIterator<Item = Key>) {
        let mut dropped = 0;
        let mut added = 0;
        if let Some(e) = s.endpoints.get_mut(endpoint) {
            for k in keys {
                e.pending.push_back(k);
                added += 1;
            }
        }
        s.pending += added;
        while s.pending > self.max_pending {
            // Drop from the longest queue: the endpoint least able to take its frees.
            let Some(e) = s.endpoints.values_mut().max_by_key(|e| e.pending.len()) else {
                break;
            };
            if e.pending.pop_front().is_none() {
                break;
            }
            s.pending -= 1;
            dropped += 1;
        }
        self.note_dropped(s, dropped, "waiting frees");
    }

    fn note_dropped(&self, s: &mut State, n: u64, what: &str) {
        if n == 0 {
            return;
        }
        s.dropped += n;
        let now = Instant::now();
        if s.warned_drop
            .is_none_or(|t| now - t >= Duration::from_secs(1))
        {
            s.warned_drop = Some(now);
            tracing::warn!(
                dropped = n,
                dropped_total = s.dropped,
                limit = self.max_pending,
                "too many {what}: the oldest were dropped (an endpoint has been unreachable for \
                 long; its objects stay resident until their producer exits)"
            );
        }
    }

    /// Endpoints known so far.
    pub fn endpoints(&self) -> Vec<String> {
        self.state().endpoints.keys().cloned().collect()
    }

    /// Keys waiting to be sent (to known endpoints, plus unlocated keys while no endpoint is
    /// known).
    pub fn pending(&self) -> usize {
        let s = self.state();
        if s.endpoints.is_empty() {
            s.unlocated.len()
        } else {
            s.pending
        }
    }

    /// Keys dropped because too many were waiting.
    pub fn dropped(&self) -> u64 {
        self.state().dropped
    }

    /// Queues `keys` for `endpoint` and sends what waits for it. With `None` the keys go to
    /// every endpoint known, now and learned later.
    ///
    /// # Errors
    /// [`Error::FreeNotSent`] if an endpoint of this call could not be sent to (now, or not
    /// yet: it is in its back-off); its keys stay pending and are retried later. Other
    /// endpoints are neither tried nor reported.
    pub fn free(&self, endpoint: Option<&str>, keys: impl IntoIterator<Item = Key>) -> Result<()> {
        let targets: Vec<String> = {
            let mut s = self.state();
            match endpoint {
                Some(e) => {
                    self.endpoint(&mut s, e);
                    self.queue(&mut s, e, keys);
                    vec![e.to_owned()]
                }
                None => {
                    let keys: Vec<Key> = keys.into_iter().collect();
                    let mut over = 0;
                    for k in &keys {
                        s.unlocated.push_back(k.clone());
                        if s.unlocated.len() > self.max_pending {
                            s.unlocated.pop_front();
                            over += 1;
                        }
                    }
                    self.note_dropped(&mut s, over, "unlocated frees");
                    let all: Vec<String> = s.endpoints.keys().cloned().collect();
                    for e in &all {
                        self.queue(&mut s, e, keys.iter().cloned());
                    }
                    all
                }
            }
        };
        let mut first = None;
        for e in targets {
            if let Err(err) = self.send(&e) {
                first.get_or_insert(err);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Sends every pending key whose endpoint is not in its back-off.
    ///
    /// # Errors
    /// [`Error::FreeNotSent`] for the first endpoint that still has keys pending.
    pub fn flush(&self) -> Result<()> {
        let all: Vec<String> = self.state().endpoints.keys().cloned().collect();
        let mut first = None;
        for e in all {
            if let Err(err) = self.send(&e) {
                first.get_or_insert(err);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Sends what waits for `endpoint`, unless another thread is at it or its back-off runs.
    fn send(&self, endpoint: &str) -> Result<()> {
        let (keys, conn) = {
            let mut guard = self.state();
            let s = &mut *guard;
            let Some(e) = s.endpoints.get_mut(endpoint) else {
                return Ok(()); // forgotten (its producer is gone)
            };
            if e.pending.is_empty() || e.sending {
                return Ok(());
            }
            if let Some((at, _, kind, why)) = &e.backoff {
                if Instant::now() < *at {
                    let pending = e.pending.len();
                    let wait = at.saturating_duration_since(Instant::now());
                    return Err(Error::FreeNotSent {
                        endpoint: endpoint.to_owned(),
                        pending,
                        source: std::io::Error::new(
                            *kind,
                            format!("{why}; retrying in {} ms", wait.as_millis()),
                        ),
                    });
                }
            }
            e.sending = true;
            let keys: Vec<Key> = e.pending.drain(..).collect();
            s.pending -= keys.len();
            (keys, e.conn.take())
        };
        // No lock held while connecting or writing.
        let sent = self.write(endpoint, conn, &keys);
        let mut guard = self.state();
        let s = &mut *guard;
        let Some(e) = s.endpoints.get_mut(endpoint) else {
            return Ok(());
        };
        e.sending = false;
        match sent {
            Ok(conn) => {
                e.conn = Some(conn);
                e.backoff = None;
                Ok(())
            }
            Err(source) if source.kind() == ErrorKind::ConnectionRefused => {
                let dropped = keys.len() + e.pending.len();
                s.pending -= e.pending.len();
                s.endpoints.remove(endpoint);
                tracing::warn!(
                    %endpoint,
                    dropped,
                    "control endpoint refuses connections (its producer is gone); dropping its \
                     frees"
                );
                Ok(())
            }
            Err(source) => {
                // Back in front of anything queued meanwhile.
                let n = keys.len();
                for k in keys.into_iter().rev() {
                    e.pending.push_front(k);
                }
                let wait = e
                    .backoff
                    .as_ref()
                    .map_or(FIRST_BACKOFF, |(_, d, _, _)| (*d * 2).min(MAX_BACKOFF));
                e.backoff = Some((
                    Instant::now() + wait,
                    wait,
                    source.kind(),
                    source.to_string(),
                ));
                let pending = e.pending.len();
                s.pending += n;
                tracing::warn!(
                    %endpoint,
                    error = %source,
                    pending,
                    retry_ms = wait.as_millis() as u64,
                    "frees not sent; will retry"
                );
                self.queue(s, endpoint, std::iter::empty());
                Err(Error::FreeNotSent {
                    endpoint: endpoint.to_owned(),
                    pending,
                    source,
                })
            }
        }
    }

    /// Writes `keys` as free lines on `conn` (or a new connection); returns the connection.
    fn write(
        &self,
        endpoint: &str,
        conn: Option<TcpStream>,
        keys: &[Key],
    ) -> std::io::Result<TcpStream> {
        let mut buf = Vec::with_capacity(keys.len() * 64);
        let mut line = Vec::with_capacity(LINE_BYTES);
        for k in keys {
            let json = serde_json::to_vec(k.as_str()).map_err(std::io::Error::other)?;
            if !line.is_empty() && line.len() + json.len() + 2 > LINE_BYTES {
                buf.extend_from_slice(&line);
                buf.extend_from_slice(b"]\n");
                line.clear();
            }
            line.push(if line.is_empty() { b'[' } else { b',' });
            line.extend_from_slice(&json);
        }
        if !line.is_empty() {
            buf.extend_from_slice(&line);
            buf.extend_from_slice(b"]\n");
        }
        debug_assert!(buf.split(|&b| b == b'\n').all(|l| l.len() < MAX_LINE_BYTES));
        let mut stream = match conn {
            Some(c) if alive(&c) => c,
            Some(_) => {
                tracing::debug!(%endpoint, "control connection closed by the server; reconnecting");
                self.connect(endpoint)?
            }
            None => self.connect(endpoint)?,
        };
        stream.write_all(&buf)?;
        Ok(stream)
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
