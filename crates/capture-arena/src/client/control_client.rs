//! Frees to control endpoints, per endpoint: one persistent connection, keys waiting to be sent,
//! and a back-off after a failure.
//!
//! Rules (the capture contract's, plus bounds):
//! - a free for endpoint `E` touches `E` alone: an endpoint that is unreachable (a dead host, a
//!   full backlog) never delays frees to another one;
//! - frees never wait on the network in the caller's thread: [`ControlClient::free`] queues the
//!   keys and returns; a sender thread of the endpoint's own (started when keys arrive, gone
//!   when nothing waits) connects and writes, so a blackholed endpoint costs no caller time
//!   and delays no other endpoint. [`ControlClient::flush_within`] waits, as long as its
//!   caller says, for what waits to go out;
//! - a key is delivered once the server confirmed it: every write ends with a sync line, and
//!   the server's answer (lines of one connection are applied in order) confirms every line
//!   before it; until then the key counts as pending ([`ControlClient::pending`],
//!   [`ControlClient::flush_within`]);
//! - a failed send (not written, not confirmed) stays pending and its sender retries it after
//!   a back-off (100 ms, doubling to 30 s) until it goes out, or until the endpoint refuses
//!   connections (its producer is gone);
//! - frees the server refuses for the control token (a missing or wrong token): keys released
//!   from a result with the token refused (they carry its session and its producer's token) are
//!   dropped, since the producer there now is another one (it restarted with another token);
//!   keys of results with another token go again at once with the latest of those (the token
//!   refused came from an old result), and a refused token (the last
//!   [`REMEMBERED_REFUSALS`]) is not taken up again from a result; keys freed
//!   without a result (by key or prefix) stay pending, counted in [`ControlClient::refused`], and
//!   are retried with the back-off; a token set meanwhile ([`ControlClient::set_token`]) ends the
//!   back-off and gets them through. Every new connection confirms a sync line before it
//!   carries keys, so a refusal is read back cleanly (not lost in a reset after a large write);
//! - keys waiting for a producer that is gone are dropped before they are sent (a producer that
//!   is gone has nothing left to free, and a producer restarted on the same port must not
//!   receive frees meant for its predecessor): keys carry their session, and the owner of the
//!   client says which sessions are gone ([`ControlClient::with_liveness`]); an endpoint that
//!   refuses connections is gone too;
//! - a key whose endpoint is unknown ([`ControlClient::free`] with `None`) goes to every endpoint
//!   known now and to every endpoint learned in the next [`UNLOCATED_TTL`];
//! - keys waiting are bounded ([`DEFAULT_MAX_PENDING_KEYS`] for all endpoints together, the same
//!   again for unlocated keys); past the bound the oldest are dropped, counted in
//!   [`ControlClient::dropped`] and warned about;
//! - endpoints whose server closed the connection and that have nothing waiting are forgotten
//!   (at most once a second), so a trainer does not keep a descriptor per producer restart.
//!
//! - an endpoint with a control token (a result's `arena.token`, [`ControlClient::set_token`])
//!   gets it as the first line of every connection; a new token for an endpoint (its producer
//!   restarted on the same port) drops the connection that presented the old one.
//!
//! Several threads may free at once: they queue, and the endpoint's one sender sends what was
//! queued meanwhile.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{ErrorKind, Write};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::control_conn::{
    alive, confirm, connect_conn, free_lines_synced, has_room, write_within, Conn,
};
use super::lock;
use crate::error::{Error, Result};
use crate::key::Key;

/// Keys that may wait to be sent, across endpoints (about 100 bytes each).
pub const DEFAULT_MAX_PENDING_KEYS: usize = 1 << 18;
/// How long a key with no known endpoint is given to endpoints learned later.
pub const UNLOCATED_TTL: Duration = Duration::from_secs(600);
/// The most forgotten endpoints remembered at once (`State::forgotten`).
const MAX_FORGOTTEN: usize = 4096;
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// How long a sender goes on sending keys queued while it was sending before it looks at the
/// endpoint's state again.
const SEND_ON_FOR: Duration = Duration::from_millis(100);
const PRUNE_EVERY: Duration = Duration::from_secs(1);
/// How long an endpoint's sender waits for more work before its thread ends: a trainer that
/// releases samples steadily keeps one thread per endpoint instead of starting one per release.
const LINGER: Duration = Duration::from_secs(2);
/// Sender threads at most (one per endpoint with keys waiting): results naming endpoints
/// without end cost no thread beyond these; past it, an endpoint's keys wait for its next free
/// or flush after a sender has finished.
pub const MAX_SENDERS: usize = 256;

/// Says whether the producer of a session is gone (see [`ControlClient::with_liveness`]).
pub type Liveness = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// Where keys released from a result come from: the session it was published in, its
/// producer's control token (a result's `arena.token`) and each object's stamp.
#[derive(Debug)]
struct Origin {
    session: Arc<str>,
    token: Option<Arc<str>>,
    stamps: HashMap<Box<str>, u64>,
}

/// The stamp a key was released with, if its result gave one.
fn stamp_of((key, origin): &Waiting) -> Option<u64> {
    origin
        .as_ref()
        .and_then(|o| o.stamps.get(key.as_str()).copied())
}

/// A key waiting to be sent, with the result it was released from (if known).
type Waiting = (Key, Option<Arc<Origin>>);

/// Tokens an endpoint refused, remembered so that an old result's token is not taken up again.
const REMEMBERED_REFUSALS: usize = 8;

#[derive(Debug, Default)]
struct Endpoint {
    pending: VecDeque<Waiting>,
    /// The persistent connection; `None` while none is open or while a sender has it.
    conn: Option<Conn>,
    /// A thread is sending to this endpoint: others only queue.
    sending: bool,
    /// This endpoint's sender thread is running (it sends until nothing waits).
    sender: bool,
    /// ... and waits for more work ([`LINGER`]): a free may write inline meanwhile.
    lingering: bool,
    /// Keys a sender took out of `pending` and is writing (still counted in
    /// [`State::pending`] until they are written or dropped).
    in_flight: usize,
    /// The samples (`{store_id}/{sample_id}/`) of those keys, for a flush of some samples.
    in_flight_samples: Vec<Box<str>>,
    /// After a failure: not before `.0`; the next failure waits twice `.1`; the error.
    backoff: Option<(Instant, Duration, ErrorKind, String)>,
    /// Keys written on `conn` (by a free, inline) whose confirmation the sender has not read
    /// yet: still pending.
    unconfirmed: Vec<Waiting>,
    /// The last sync line written to this endpoint.
    sync: u64,
    /// The endpoint's control token, presented first on every new connection.
    token: Option<Arc<str>>,
    /// Tokens the endpoint refused lately (at most [`REMEMBERED_REFUSALS`]): an old result's
    /// token (its producer restarted) does not replace the one that works.
    refused_tokens: VecDeque<Option<Arc<str>>>,
}

impl Endpoint {
    /// Takes what waits for one write; others only queue until [`Endpoint::settle`].
    /// Whether keys wait to be sent, or for their confirmation.
    fn has_keys(&self) -> bool {
        !self.pending.is_empty() || !self.unconfirmed.is_empty()
    }

    fn take(&mut self) -> Vec<Waiting> {
        self.sending = true;
        let waiting: Vec<Waiting> = self.pending.drain(..).collect();
        self.in_flight = waiting.len();
        self.in_flight_samples.clear();
        self.add_in_flight(&waiting);
        waiting
    }

    /// Notes the samples of `keys`, now in flight (one entry per run of keys of one sample).
    fn add_in_flight(&mut self, keys: &[Waiting]) {
        for (key, _) in keys {
            let sample = key.sample_prefix();
            if self.in_flight_samples.last().map(|s| &**s) != Some(sample) {
                self.in_flight_samples.push(sample.into());
            }
        }
    }

    /// Keys of `samples` (`{store_id}/{sample_id}/`) waiting here: queued, written and not
    /// confirmed, or in flight (those counted a sample at a time: a sender holds them).
    fn waiting_of(&self, samples: &std::collections::HashSet<String>) -> usize {
        let of = |w: &Waiting| samples.contains(w.0.sample_prefix());
        self.pending.iter().filter(|w| of(w)).count()
            + self.unconfirmed.iter().filter(|w| of(w)).count()
            + self
                .in_flight_samples
                .iter()
                .filter(|s| samples.contains(&***s))
                .count()
    }

    /// Ends a write: `unsent` goes back in front of anything queued meanwhile.
    fn settle(&mut self, unsent: Vec<Waiting>) {
        debug_assert!(self.unconfirmed.is_empty() || !self.sending);
        self.sending = false;
        self.in_flight = 0;
        self.in_flight_samples.clear();
        for w in unsent.into_iter().rev() {
            self.pending.push_front(w);
        }
    }
}

struct State {
    /// The process the connections belong to; a forked child starts over.
    pid: u32,
    endpoints: BTreeMap<String, Endpoint>,
    /// Keys with no known endpoint, for endpoints learned later (bounded, oldest first).
    unlocated: VecDeque<(Key, Instant)>,
    /// Endpoints forgotten (`prune`) within [`UNLOCATED_TTL`], with when: one learned again is
    /// sent only the unlocated keys that came after (it had the others already: a second send,
    /// without stamps, could free a replacement published under a key since).
    forgotten: BTreeMap<String, Instant>,
    /// Keys waiting across endpoints.
    pending: usize,
    dropped: u64,
    warned_drop: Option<Instant>,
    last_prune: Instant,
    /// Sender threads running (at most [`MAX_SENDERS`]).
    senders: usize,
    /// Endpoints with keys waiting that found every sender thread taken: a sender sleeping
    /// out its own endpoint's back-off (or lingering) serves one of them instead.
    unserved: std::collections::BTreeSet<String>,
}

/// Sends frees to control endpoints. See the module docs.
pub struct ControlClient {
    shared: Arc<Shared>,
}

/// What the client's callers and its sender threads share.
struct Shared {
    state: Mutex<State>,
    /// Signalled whenever a sender finishes a send (for [`ControlClient::flush_within`]).
    sent: Condvar,
    /// Signalled when keys arrive for an endpoint whose sender lingers ([`LINGER`]).
    work: Condvar,
    timeout: Duration,
    max_pending: usize,
    gone: std::sync::OnceLock<Liveness>,
}

impl std::fmt::Debug for ControlClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlClient")
            .field("endpoints", &self.endpoints())
            .field("pending", &self.pending())
            .field("timeout", &self.shared.timeout)
            .finish()
    }
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
        let shared = Shared {
            state: Mutex::new(State {
                pid: std::process::id(),
                endpoints: BTreeMap::new(),
                unlocated: VecDeque::new(),
                forgotten: BTreeMap::new(),
                pending: 0,
                dropped: 0,
                warned_drop: None,
                last_prune: Instant::now(),
                senders: 0,
                unserved: std::collections::BTreeSet::new(),
            }),
            sent: Condvar::new(),
            work: Condvar::new(),
            timeout,
            max_pending: max_pending.max(1),
            gone: std::sync::OnceLock::new(),
        };
        ControlClient {
            shared: Arc::new(shared),
        }
    }

    /// Asks `gone(session)` before sending keys published in `session`: true drops them (their
    /// producer is gone). [`super::FeatureStore`] answers from its reader.
    /// (The first answer set is kept.)
    pub fn with_liveness(self, gone: Liveness) -> ControlClient {
        let _ = self.shared.gone.set(gone);
        self
    }

    /// Remembers an endpoint; recent keys with no known endpoint are queued for it too.
    pub fn learn(&self, endpoint: &str) {
        let mut s = self.shared.state();
        self.shared.endpoint(&mut s, endpoint);
    }

    /// Endpoints known so far.
    pub fn endpoints(&self) -> Vec<String> {
        self.shared.state().endpoints.keys().cloned().collect()
    }

    /// Keys waiting to be sent (to known endpoints, plus unlocated keys while no endpoint is
    /// known).
    pub fn pending(&self) -> usize {
        self.shared.pending()
    }

    /// Keys dropped: too many were waiting, or their producer is gone.
    pub fn dropped(&self) -> u64 {
        self.shared.state().dropped
    }

    /// Keys waiting at endpoints that refused them for the control token (a missing or wrong
    /// token: nothing sent was applied); they are retried with a back-off.
    pub fn refused(&self) -> usize {
        self.shared
            .state()
            .endpoints
            .values()
            .filter(
                |e| matches!(&e.backoff, Some((_, _, k, _)) if *k == ErrorKind::PermissionDenied),
            )
            .map(|e| e.pending.len() + e.in_flight + e.unconfirmed.len())
            .sum()
    }

    /// Sets the control token of `endpoint` (an operator's, say), even one it refused before.
    pub fn set_token(&self, endpoint: &str, token: Option<&str>) {
        self.shared.set_token(endpoint, token, true);
    }

    /// Takes the token of a result for `endpoint` (its `arena.token`), unless the endpoint
    /// refused it lately (an old result's: its producer restarted since).
    pub(crate) fn learn_token(&self, endpoint: &str, token: Option<&str>) {
        self.shared.set_token(endpoint, token, false);
    }

    /// Queues `keys` for `endpoint` and has its sender send them; returns without waiting on
    /// the network. With `None` the keys go to every endpoint known now and learned in the next
    /// [`UNLOCATED_TTL`].
    ///
    /// # Errors
    /// [`Error::FreeNotSent`] if an endpoint of this call is known to be unreachable (its last
    /// send failed and it is in its back-off): its keys wait and its sender retries them. Other
    /// endpoints are not reported.
    pub fn free(&self, endpoint: Option<&str>, keys: impl IntoIterator<Item = Key>) -> Result<()> {
        self.free_in(endpoint, None, None, keys.into_iter().map(|k| (k, None)))
    }

    /// As [`ControlClient::free`], for keys of a result published in `session` by a producer
    /// with the control token `token`, each with its object's stamp: they are dropped rather
    /// than sent if that session's producer is gone by the time they go out, sent with their
    /// own token when the endpoint refuses another one (an old result's token, its producer
    /// since restarted), and applied only to the objects the result named (a key published
    /// again since, replacing it, is not freed), where the server applies stamped frees.
    ///
    /// # Errors
    /// As [`ControlClient::free`].
    pub fn free_in(
        &self,
        endpoint: Option<&str>,
        session: Option<&str>,
        token: Option<&str>,
        keys: impl IntoIterator<Item = (Key, Option<u64>)>,
    ) -> Result<()> {
        let (keys, stamped): (Vec<Key>, Vec<Option<u64>>) = keys.into_iter().unzip();
        let origin = session.map(|session| {
            Arc::new(Origin {
                session: Arc::from(session),
                token: token.map(Arc::from),
                stamps: keys
                    .iter()
                    .zip(&stamped)
                    .filter_map(|(k, s)| s.map(|s| (Box::from(k.as_str()), s)))
                    .collect(),
            })
        });
        let targets = self.shared.queue_frees(endpoint, origin, keys);
        Shared::kick(&self.shared, &targets)
    }

    /// Has every endpoint's sender send what waits for it; returns without waiting.
    ///
    /// # Errors
    /// [`Error::FreeNotSent`] for the first endpoint with keys waiting that is known to be
    /// unreachable (in its back-off).
    pub fn flush(&self) -> Result<()> {
        let all = self.shared.all_endpoints();
        Shared::kick(&self.shared, &all)
    }

    /// As [`ControlClient::flush`], then waits up to `timeout` for every key waiting to go out
    /// (the senders do the network work; this only waits for them).
    ///
    /// # Errors
    /// [`Error::FreeNotSent`] for an endpoint that still has keys waiting after `timeout`.
    pub fn flush_within(&self, timeout: Duration) -> Result<()> {
        self.flush_where(timeout, |e| {
            let n = e.pending.len() + e.in_flight + e.unconfirmed.len();
            (n > 0 || e.sending).then_some(n)
        })
    }

    /// As [`ControlClient::flush_within`], for the keys of `samples` only (each
    /// `{store_id}/{sample_id}/`, encoded as keys carry them): keys of other samples, at an
    /// endpoint that does not answer say, wait on without failing this flush.
    ///
    /// # Errors
    /// [`Error::FreeNotSent`] for an endpoint that still has keys of `samples` waiting after
    /// `timeout` (the count is of keys, those a sender holds counted a sample at a time).
    pub fn flush_samples_within(
        &self,
        samples: &std::collections::HashSet<String>,
        timeout: Duration,
    ) -> Result<()> {
        self.flush_where(timeout, |e| {
            let n = e.waiting_of(samples);
            (n > 0).then_some(n)
        })
    }

    /// Kicks every sender, then waits up to `timeout` until `waiting` (how many keys an
    /// endpoint still has that matter, `None` for none) is `None` at every endpoint.
    fn flush_where(
        &self,
        timeout: Duration,
        waiting: impl Fn(&Endpoint) -> Option<usize>,
    ) -> Result<()> {
        let _ = self.flush();
        let deadline = crate::limits::deadline_in(timeout);
        let mut s = self.shared.state();
        loop {
            let left = s
                .endpoints
                .iter()
                .find_map(|(endpoint, e)| waiting(e).map(|n| (endpoint, e, n)));
            let Some((endpoint, e, n)) = left else {
                return Ok(());
            };
            let now = Instant::now();
            if now >= deadline {
                // "still sending": its sender has the keys (connecting, writing or waiting
                // for the confirmation); else they wait for a sender to take them.
                let why = e.backoff.as_ref().map_or_else(
                    || {
                        let what = if e.sending || !e.unconfirmed.is_empty() {
                            "still sending"
                        } else {
                            "waiting for a sender to take them"
                        };
                        (ErrorKind::TimedOut, what.to_owned())
                    },
                    |(_, _, kind, why)| (*kind, why.clone()),
                );
                return Err(not_sent(
                    endpoint,
                    n,
                    why.0,
                    &why.1,
                    &format!(
                        "after waiting {:.1} s; its sender goes on retrying",
                        timeout.as_secs_f64()
                    ),
                ));
            }
            let wait = (deadline - now).min(Duration::from_millis(100));
            s = self
                .shared
                .sent
                .wait_timeout(s, wait)
                .map_or_else(|p| p.into_inner().0, |(g, _)| g);
        }
    }
}

impl Shared {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        let mut s = lock(&self.state);
        if s.pid != std::process::id() {
            // Forked: the inherited sockets are the parent's; closing our copies leaves its
            // connections open. The keys waiting are the parent's to send.
            s.pid = std::process::id();
            s.endpoints.clear();
            s.unlocated.clear();
            s.forgotten.clear();
            s.pending = 0;
            s.senders = 0;
            s.unserved.clear();
        }
        s
    }

    /// Makes the endpoint's entry (with the recent unlocated keys) if it is new.
    fn endpoint(&self, s: &mut State, endpoint: &str) {
        if s.endpoints.contains_key(endpoint) {
            return;
        }
        let now = Instant::now();
        while s
            .unlocated
            .front()
            .is_some_and(|(_, t)| now - *t > UNLOCATED_TTL)
        {
            s.unlocated.pop_front();
        }
        let since = s.forgotten.remove(endpoint);
        let keys: Vec<Waiting> = s
            .unlocated
            .iter()
            .filter(|(_, t)| since.is_none_or(|f| *t > f))
            .map(|(k, _)| (k.clone(), None))
            .collect();
        s.endpoints.insert(endpoint.to_owned(), Endpoint::default());
        self.queue(s, endpoint, keys);
    }

    /// Queues keys for a known endpoint, dropping the oldest waiting keys past the bound.
    fn queue(&self, s: &mut State, endpoint: &str, keys: impl IntoIterator<Item = Waiting>) {
        let mut added = 0;
        if let Some(e) = s.endpoints.get_mut(endpoint) {
            for k in keys {
                e.pending.push_back(k);
                added += 1;
            }
        }
        s.pending += added;
        let mut dropped = 0;
        while s.pending > self.max_pending {
            // Drop from the endpoint holding the most, counting the keys its sender has in
            // flight: the one least able to take its frees. When those are all in flight, none
            // is dropped until they come back (they are then queued again, and bounded here):
            // another endpoint's frees never pay for them, up to twice the bound; past that,
            // the longest queue pays.
            let heaviest = s
                .endpoints
                .values()
                .max_by_key(|e| e.pending.len() + e.in_flight)
                .is_some_and(|e| !e.pending.is_empty());
            let e = if heaviest {
                s.endpoints
                    .values_mut()
                    .max_by_key(|e| e.pending.len() + e.in_flight)
            } else if s.pending > self.max_pending.saturating_mul(2) {
                s.endpoints.values_mut().max_by_key(|e| e.pending.len())
            } else {
                break;
            };
            let Some(e) = e else {
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

    /// Forgets endpoints with nothing waiting whose server closed the connection, or whose
    /// back-off has ended (at most once a second): an unreachable endpoint whose keys were all
    /// dropped past the bound was otherwise kept for good, one entry for every endpoint results
    /// ever named.
    fn prune(&self, s: &mut State) {
        let now = Instant::now();
        if now - s.last_prune < PRUNE_EVERY {
            return;
        }
        s.last_prune = now;
        s.forgotten.retain(|_, at| now - *at <= UNLOCATED_TTL);
        let mut forgotten = Vec::new();
        s.endpoints.retain(|endpoint, e| {
            let keep = e.sending
                || e.sender
                || !e.pending.is_empty()
                || e.backoff.as_ref().is_some_and(|(until, ..)| *until > now)
                || !e.unconfirmed.is_empty()
                || e.conn.as_ref().is_some_and(|c| alive(&c.stream));
            if !keep {
                tracing::debug!(%endpoint, "forgetting a control endpoint that closed on us");
                forgotten.push(endpoint.clone());
            }
            keep
        });
        for endpoint in forgotten {
            s.forgotten.insert(endpoint, now);
        }
        while s.forgotten.len() > MAX_FORGOTTEN {
            let oldest = s
                .forgotten
                .iter()
                .min_by_key(|(_, at)| **at)
                .map(|(e, _)| e.clone());
            oldest.map(|e| s.forgotten.remove(&e));
        }
    }

    fn pending(&self) -> usize {
        let s = self.state();
        if s.endpoints.is_empty() {
            s.unlocated.len()
        } else {
            s.pending
        }
    }

    fn set_token(&self, endpoint: &str, token: Option<&str>, even_refused: bool) {
        let mut guard = self.state();
        let s = &mut *guard;
        self.endpoint(s, endpoint);
        if let Some(e) = s.endpoints.get_mut(endpoint) {
            if even_refused && e.refused_tokens.iter().any(|t| t.as_deref() == token) {
                // Given again by the caller: tried again now (even the one presented last).
                e.refused_tokens.retain(|t| t.as_deref() != token);
                if e.token.as_deref() == token {
                    e.conn = None;
                    if matches!(&e.backoff, Some((_, _, k, _)) if *k == ErrorKind::PermissionDenied)
                    {
                        e.backoff = None;
                        self.work.notify_all();
                    }
                    return;
                }
            }
            if e.token.as_deref() != token
                && !e.refused_tokens.iter().any(|t| t.as_deref() == token)
            {
                e.token = token.map(Arc::from);
                e.conn = None;
                // Refused for want of a token: try the new one now.
                if matches!(&e.backoff, Some((_, _, k, _)) if *k == ErrorKind::PermissionDenied) {
                    e.backoff = None;
                    self.work.notify_all();
                }
            }
        }
    }

    /// Queues keys (see [`ControlClient::free_in`]); returns the endpoints to kick.
    fn queue_frees(
        &self,
        endpoint: Option<&str>,
        session: Option<Arc<Origin>>,
        keys: impl IntoIterator<Item = Key>,
    ) -> Vec<String> {
        let mut guard = self.state();
        let s = &mut *guard;
        self.prune(s);
        match endpoint {
            Some(e) => {
                self.endpoint(s, e);
                self.queue(s, e, keys.into_iter().map(|k| (k, session.clone())));
                vec![e.to_owned()]
            }
            None => {
                let keys: Vec<Key> = keys.into_iter().collect();
                let now = Instant::now();
                let mut over = 0;
                for k in &keys {
                    s.unlocated.push_back((k.clone(), now));
                    if s.unlocated.len() > self.max_pending {
                        s.unlocated.pop_front();
                        over += 1;
                    }
                }
                self.note_dropped(s, over, "unlocated frees");
                let all: Vec<String> = s.endpoints.keys().cloned().collect();
                for e in &all {
                    let tagged = keys.iter().map(|k| (k.clone(), session.clone()));
                    self.queue(s, e, tagged);
                }
                all
            }
        }
    }

    fn all_endpoints(&self) -> Vec<String> {
        let mut s = self.state();
        self.prune(&mut s);
        s.endpoints.keys().cloned().collect()
    }

    /// Starts the sender of each of `endpoints` that has keys waiting and none running; reports
    /// the first that is in its back-off.
    fn kick(this: &Arc<Shared>, endpoints: &[String]) -> Result<()> {
        for name in endpoints {
            this.try_inline(name);
        }
        let mut first = None;
        let mut start = Vec::new();
        {
            let mut guard = this.state();
            let st = &mut *guard;
            let now = Instant::now();
            for name in endpoints {
                let Some(e) = st.endpoints.get_mut(name) else {
                    continue;
                };
                if !e.has_keys() && e.in_flight == 0 {
                    continue;
                }
                if let Some((at, _, kind, why)) = &e.backoff {
                    if first.is_none() {
                        let wait = at.saturating_duration_since(now);
                        first = Some(not_sent(
                            name,
                            e.pending.len() + e.in_flight,
                            *kind,
                            why,
                            &format!(
                                "its sender retries in {} ms (the keys wait)",
                                wait.as_millis()
                            ),
                        ));
                    }
                }
                if e.sender {
                    // Lingering, or at work: it looks again when woken.
                    this.work.notify_all();
                } else if st.senders < MAX_SENDERS {
                    e.sender = true;
                    st.senders += 1;
                    start.push(name.clone());
                } else {
                    // Every sender is taken (unreachable endpoints backing off hold them): one
                    // of them hands itself over when it next waits.
                    st.unserved.insert(name.clone());
                    this.work.notify_all();
                }
            }
        }
        for name in start {
            let shared = this.clone();
            let spawned = std::thread::Builder::new()
                .name("capture-arena-free".into())
                .spawn({
                    let name = name.clone();
                    move || shared.run_sender(&name)
                });
            if let Err(e) = spawned {
                // The keys wait; the next free or flush tries to start a sender again.
                tracing::warn!(endpoint = %name, error = %e, "cannot start a free sender");
                let mut st = this.state();
                st.senders -= 1;
                if let Some(ep) = st.endpoints.get_mut(&name) {
                    ep.sender = false;
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Writes what waits for `endpoint` at once, on its open connection, when its socket has
    /// room for all of it (so the write cannot wait on the network) and no sender is at work:
    /// a healthy endpoint's frees are on the wire when `free` returns (a trainer killed right
    /// after a release loses nothing). Anything else is left to the sender.
    fn try_inline(&self, endpoint: &str) {
        let (waiting, conn) = {
            let mut s = self.state();
            let Some(e) = s.endpoints.get_mut(endpoint) else {
                return;
            };
            if e.pending.is_empty()
                || (e.sender && !e.lingering)
                || e.sending
                || e.backoff.is_some()
                || !e.unconfirmed.is_empty()
            {
                return;
            }
            let Some(conn) = e.conn.take() else {
                return;
            };
            (e.take(), (conn, e.sync + 1))
        };
        let (conn, sync) = conn;
        let taken = waiting.len();
        let waiting = self.live_keys(waiting);
        let live = waiting.len();
        let keys: Vec<(&Key, Option<u64>)> = waiting.iter().map(|w| (&w.0, stamp_of(w))).collect();
        let wrote = match free_lines_synced(&keys, conn.stamps, sync) {
            // Every key's producer is gone: nothing to write (a bare sync's answer would be
            // left unread on the connection).
            _ if keys.is_empty() => Some(true),
            Ok(buf) if alive(&conn.stream) && has_room(&conn.stream, buf.len()) => {
                Some((&conn.stream).write_all(&buf).is_ok())
            }
            _ => None,
        };
        let mut guard = self.state();
        let s = &mut *guard;
        let Some(e) = s.endpoints.get_mut(endpoint) else {
            return;
        };
        match wrote {
            Some(true) => {
                // Written: pending until the sender reads the confirmation.
                e.settle(Vec::new());
                s.pending -= taken - live;
                e.unconfirmed = waiting;
                e.sync = sync;
                e.conn = Some(conn);
            }
            not_written => {
                // Back in front for the sender; a connection that failed mid-write is dropped
                // (its keys go again on a new one: a free of a freed key is only counted).
                e.settle(waiting);
                s.pending -= taken - live;
                if not_written.is_none() && alive(&conn.stream) {
                    e.conn = Some(conn);
                }
            }
        }
    }

    /// An endpoint's sender: sends until nothing waits (or the endpoint is forgotten), sleeping
    /// out each back-off, and serving meanwhile endpoints that found every sender taken.
    fn run_sender(&self, endpoint: &str) {
        self.send_until_done(endpoint.to_owned());
    }

    /// Of the endpoints that found every sender taken, the first that can be served now (keys
    /// waiting, no sender, no back-off running), taken out of `unserved`; and how soon the
    /// first of the others' back-off ends. Under the state's lock.
    fn servable(s: &mut State) -> (Option<String>, Option<Duration>) {
        let now = Instant::now();
        let mut soonest: Option<Duration> = None;
        let mut found = None;
        s.unserved.retain(|name| {
            let Some(e) = s.endpoints.get(name) else {
                return false; // forgotten since
            };
            if e.sender || !e.has_keys() {
                return false; // served by now, or nothing left to send
            }
            if found.is_some() {
                return true;
            }
            match &e.backoff {
                Some((at, ..)) if *at > now => {
                    let left = *at - now;
                    soonest = Some(soonest.map_or(left, |d| d.min(left)));
                    true
                }
                _ => {
                    found = Some(name.clone());
                    false
                }
            }
        });
        (found, soonest)
    }

    /// Hands this sender thread from `endpoint` (which waits: its back-off runs, or nothing is
    /// queued) to an endpoint that found every sender taken and can be served now, if there is
    /// one: its name (`endpoint` goes back among the unserved if it has keys). Else how soon one
    /// of those can be served. Under the state's lock.
    fn hand_over(s: &mut State, endpoint: &str) -> std::result::Result<String, Option<Duration>> {
        let (next, soonest) = Self::servable(s);
        let Some(next) = next else {
            return Err(soonest);
        };
        if let Some(n) = s.endpoints.get_mut(&next) {
            n.sender = true;
        }
        if let Some(e) = s.endpoints.get_mut(endpoint) {
            e.sender = false;
            e.lingering = false;
            if e.has_keys() {
                s.unserved.insert(endpoint.to_owned()); // its turn comes again
            }
        }
        Ok(next)
    }

    /// This sender thread ends (its endpoint has nothing to send, or is forgotten), unless an
    /// endpoint that found every sender taken can be served now: its name. The thread's place
    /// is given back under the same hold of the lock as the last look, so a `kick` never finds
    /// every place taken by a thread that is ending.
    fn end_or_serve(s: &mut State, endpoint: &str) -> Option<String> {
        if let Ok(next) = Self::hand_over(s, endpoint) {
            return Some(next);
        }
        if let Some(e) = s.endpoints.get_mut(endpoint) {
            e.sender = false;
            e.lingering = false;
        }
        s.senders = s.senders.saturating_sub(1);
        None
    }

    fn send_until_done(&self, mut endpoint: String) {
        loop {
            let _ = self.send(&endpoint);
            self.sent.notify_all();
            let backoff = {
                let mut s = self.state();
                let Some(e) = s.endpoints.get_mut(&endpoint) else {
                    match Self::end_or_serve(&mut s, &endpoint) {
                        Some(next) => {
                            endpoint = next;
                            continue;
                        }
                        None => return,
                    }
                };
                if !e.has_keys() {
                    // Nothing waits: linger a while for more before the thread ends (or serve
                    // an endpoint that found every sender taken and can be served now).
                    let until = Instant::now() + LINGER;
                    e.lingering = true;
                    loop {
                        let now = Instant::now();
                        let idle = s.endpoints.get(&endpoint).is_some_and(|e| !e.has_keys());
                        if !idle || now >= until {
                            break;
                        }
                        let wait = match Self::hand_over(&mut s, &endpoint) {
                            Ok(next) => {
                                endpoint = next;
                                break;
                            }
                            Err(soonest) => soonest.map_or(until - now, |d| d.min(until - now)),
                        };
                        s = self
                            .work
                            .wait_timeout(s, wait)
                            .map_or_else(|p| p.into_inner().0, |(g, _)| g);
                    }
                    let Some(e) = s.endpoints.get_mut(&endpoint) else {
                        continue; // handed over to one forgotten since: the top looks again
                    };
                    if e.sender && e.has_keys() {
                        e.lingering = false;
                        continue; // keys came (or this thread serves another endpoint now)
                    }
                    match Self::end_or_serve(&mut s, &endpoint) {
                        Some(next) => {
                            endpoint = next;
                            continue;
                        }
                        None => return,
                    }
                }
                if e.sending {
                    // A free is writing inline: its keys are back or sent in microseconds.
                    drop(s);
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
                e.backoff.as_ref().map_or(Duration::ZERO, |(at, ..)| {
                    at.saturating_duration_since(Instant::now())
                })
            };
            // Out of the back-off early when woken (keys, a token for a refused endpoint, or
            // an endpoint waiting for a sender: this one's keys wait out the back-off anyway),
            // or to serve an endpoint whose back-off ended meanwhile.
            if !backoff.is_zero() {
                let mut s = self.state();
                let wait = match Self::hand_over(&mut s, &endpoint) {
                    Ok(next) => {
                        endpoint = next;
                        continue;
                    }
                    Err(soonest) => soonest.map_or(backoff, |d| d.min(backoff)),
                };
                let s = self
                    .work
                    .wait_timeout(s, wait)
                    .map_or_else(|p| p.into_inner().0, |(g, _)| g);
                drop(s);
            }
        }
    }

    /// Drops the keys whose producer is gone; returns the rest.
    fn live_keys(&self, keys: Vec<Waiting>) -> Vec<Waiting> {
        let Some(gone) = self.gone.get() else {
            return keys;
        };
        let mut verdicts: HashMap<Arc<str>, bool> = HashMap::new();
        let mut live = Vec::with_capacity(keys.len());
        let mut dropped = 0u64;
        for (k, origin) in keys {
            let is_gone = origin.as_ref().is_some_and(|o| {
                *verdicts
                    .entry(o.session.clone())
                    .or_insert_with(|| gone(&o.session))
            });
            if is_gone {
                dropped += 1;
            } else {
                live.push((k, origin));
            }
        }
        if dropped > 0 {
            tracing::debug!(dropped, "frees for producers that are gone were not sent");
            self.state().dropped += dropped;
        }
        live
    }

    /// Sends what waits for `endpoint`, unless another thread is at it or its back-off runs;
    /// then sends again what was queued meanwhile, for up to [`SEND_ON_FOR`]. Keys a free wrote
    /// inline have their confirmation read first.
    fn send(&self, endpoint: &str) -> Result<()> {
        let started = Instant::now();
        while started.elapsed() < SEND_ON_FOR {
            let (waiting, unconfirmed, conn, token, sync) = {
                let mut guard = self.state();
                let s = &mut *guard;
                let Some(e) = s.endpoints.get_mut(endpoint) else {
                    return Ok(()); // forgotten (its producer is gone)
                };
                if !e.has_keys() || e.sending {
                    return Ok(());
                }
                if let Some((at, _, kind, why)) = &e.backoff {
                    if Instant::now() < *at {
                        let wait = at.saturating_duration_since(Instant::now());
                        return Err(not_sent(
                            endpoint,
                            e.pending.len(),
                            *kind,
                            why,
                            &format!("retrying in {} ms", wait.as_millis()),
                        ));
                    }
                }
                let unconfirmed = std::mem::take(&mut e.unconfirmed);
                let waiting = e.take();
                e.in_flight += unconfirmed.len();
                e.add_in_flight(&unconfirmed);
                (waiting, unconfirmed, e.conn.take(), e.token.clone(), e.sync)
            };
            let taken = waiting.len() + unconfirmed.len();
            // No lock held while confirming, asking about sessions, connecting or writing.
            let mut conn = conn;
            let mut refused = None;
            let keys = if unconfirmed.is_empty() {
                waiting
            } else {
                let confirmed = conn.as_ref().map_or_else(
                    || Err(std::io::Error::from(ErrorKind::NotConnected)),
                    |c| confirm(&c.stream, sync, self.timeout).map(|_| ()),
                );
                match confirmed {
                    Ok(()) => waiting,
                    Err(e) => {
                        // Not confirmed: they go again, on a new connection (a free of a freed
                        // key is only counted), unless the server refused them.
                        conn = None;
                        if e.kind() == ErrorKind::PermissionDenied {
                            refused = Some(e);
                        }
                        unconfirmed.into_iter().chain(waiting).collect()
                    }
                }
            };
            let keys = self.live_keys(keys);
            let next = sync + 1;
            let sent = match refused {
                Some(e) => Err((e, keys)),
                None if keys.is_empty() => Ok(conn), // every key's producer is gone
                None => {
                    let refs: Vec<(&Key, Option<u64>)> =
                        keys.iter().map(|w| (&w.0, stamp_of(w))).collect();
                    self.write(endpoint, conn, token.as_deref(), &refs, next)
                        .map(Some)
                        .map_err(|e| (e, keys))
                }
            };
            let mut guard = self.state();
            let s = &mut *guard;
            let Some(e) = s.endpoints.get_mut(endpoint) else {
                return Ok(());
            };
            e.sync = next;
            match sent {
                Ok(conn) => {
                    e.settle(Vec::new());
                    s.pending -= taken;
                    // A connection that presented a token replaced meanwhile is not kept.
                    if e.token == token {
                        e.conn = conn;
                    }
                    e.backoff = None;
                    // Keys queued while this thread was sending go out now, not at the next
                    // free (which may never come).
                }
                Err((source, back)) if source.kind() == ErrorKind::ConnectionRefused => {
                    e.settle(Vec::new());
                    let dropped = back.len() + e.pending.len();
                    s.pending -= taken + e.pending.len();
                    s.dropped += dropped as u64;
                    s.endpoints.remove(endpoint);
                    tracing::warn!(
                        %endpoint,
                        dropped,
                        "control endpoint refuses connections (its producer is gone); dropping \
                         its frees"
                    );
                    return Ok(());
                }
                Err((source, back)) => {
                    // Refused for the token: keys released from a result whose producer has
                    // the token refused were published by another producer than the one there
                    // now (it restarted with another token): never to be applied, so dropped.
                    // Keys of results with another token go again at once with theirs (the
                    // token presented came from an old result); keys sent without a result (by
                    // key or prefix) wait for a token.
                    let refusal = source.kind() == ErrorKind::PermissionDenied;
                    let (back, foreign): (Vec<Waiting>, Vec<Waiting>) = if refusal {
                        back.into_iter().partition(|(_, origin)| {
                            origin.as_ref().is_none_or(|o| o.token != token)
                        })
                    } else {
                        (back, Vec::new())
                    };
                    let other_token = refusal
                        .then(|| back.iter().rev().find_map(|(_, o)| o.as_ref()))
                        .flatten()
                        .map(|o| o.token.clone());
                    if !foreign.is_empty() {
                        s.dropped += foreign.len() as u64;
                        tracing::warn!(
                            %endpoint,
                            reason = %source,
                            dropped = foreign.len(),
                            "frees of results refused for the control token: the producer there \
                             now is not the one that published them (it restarted with another \
                             token); dropped"
                        );
                    }
                    // Back in front of anything queued meanwhile (those of producers found gone
                    // meanwhile are no longer waiting).
                    s.pending -= taken - back.len();
                    e.settle(back);
                    if refusal {
                        if !e.refused_tokens.contains(&token) {
                            e.refused_tokens.push_back(token.clone());
                            if e.refused_tokens.len() > REMEMBERED_REFUSALS {
                                e.refused_tokens.pop_front();
                            }
                        }
                        if let Some(theirs) = other_token {
                            // The token came from an old result: the keys of the latest result
                            // with another token go with that one now (each token is tried at
                            // most once before its keys are dropped, so this ends).
                            tracing::info!(
                                %endpoint,
                                "the producer refused a token of an older result; sending with \
                                 the token of a later one"
                            );
                            e.refused_tokens.retain(|t| *t != theirs);
                            e.token = theirs;
                            e.conn = None;
                            e.backoff = None;
                            continue;
                        }
                    }
                    let wait = next_backoff(e.backoff.as_ref().map(|(_, d, _, _)| *d));
                    e.backoff = Some((
                        Instant::now() + wait,
                        wait,
                        source.kind(),
                        source.to_string(),
                    ));
                    let pending = e.pending.len();
                    if pending == 0 {
                        // Nothing waits (all dropped): no back-off to report.
                        e.backoff = None;
                        e.conn = None;
                        return Ok(());
                    }
                    if source.kind() == ErrorKind::PermissionDenied {
                        tracing::error!(
                            %endpoint,
                            reason = %source,
                            pending,
                            retry_ms = wait.as_millis() as u64,
                            "the producer refused these frees for its control token: nothing \
                             sent was applied; they wait and are retried. Give this client the \
                             producer's token (a result's arena.token, \
                             SGLANG_SPEC_CAPTURE_CONTROL_TOKEN)"
                        );
                    } else {
                        tracing::warn!(
                            %endpoint,
                            error = %source,
                            pending,
                            retry_ms = wait.as_millis() as u64,
                            "frees not sent; will retry"
                        );
                    }
                    self.queue(s, endpoint, std::iter::empty());
                    return Err(not_sent(
                        endpoint,
                        pending,
                        source.kind(),
                        &source.to_string(),
                        "",
                    ));
                }
            }
        }
        Ok(())
    }

    /// Writes `keys` as free lines and the sync line `sync` on `conn` (or a new connection),
    /// then waits for the server's confirmation; returns the connection.
    fn write(
        &self,
        endpoint: &str,
        conn: Option<Conn>,
        token: Option<&str>,
        keys: &[(&Key, Option<u64>)],
        sync: u64,
    ) -> std::io::Result<Conn> {
        // One deadline over the connect, the write and the confirmation.
        let deadline = crate::limits::deadline_in(self.timeout);
        let left = || {
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(1))
        };
        let conn = match conn {
            Some(c) if alive(&c.stream) => c,
            Some(_) => {
                tracing::debug!(%endpoint, "control connection closed by the server; reconnecting");
                connect_conn(endpoint, token, self.timeout)?
            }
            None => connect_conn(endpoint, token, self.timeout)?,
        };
        // Stamped where this server applies stamped frees (its answers say so).
        let buf = free_lines_synced(keys, conn.stamps, sync)?;
        write_within(&conn.stream, &buf, deadline)?;
        confirm(&conn.stream, sync, left())?;
        // The connection's own timeout again (write_within left what was left of the deadline).
        conn.stream.set_write_timeout(Some(self.timeout))?;
        Ok(conn)
    }
}

/// The error for frees to `endpoint` that wait after a failure of `kind` (`why`): refused for
/// the control token ([`Error::Unauthorized`]) or not sent ([`Error::FreeNotSent`]).
/// The wait before an endpoint is tried again after `prev` (none: its first failure): 100 ms,
/// doubling to 30 s.
fn next_backoff(prev: Option<Duration>) -> Duration {
    prev.map_or(FIRST_BACKOFF, |d| (d * 2).min(MAX_BACKOFF))
}

fn not_sent(endpoint: &str, pending: usize, kind: ErrorKind, why: &str, then: &str) -> Error {
    let sep = if then.is_empty() { "" } else { "; " };
    if kind == ErrorKind::PermissionDenied {
        return Error::Unauthorized {
            endpoint: endpoint.to_owned(),
            pending,
            reason: format!("{why}{sep}{then}"),
        };
    }
    Error::FreeNotSent {
        endpoint: endpoint.to_owned(),
        pending,
        source: std::io::Error::new(kind, format!("{why}{sep}{then}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_is_retried_after_100_ms_doubling_to_30_s() {
        // docs/protocol.md: "a back-off per endpoint (100 ms doubling to 30 s)".
        let mut waits = vec![next_backoff(None)];
        for _ in 0..12 {
            let last = waits[waits.len() - 1];
            waits.push(next_backoff(Some(last)));
        }
        let ms: Vec<u128> = waits.iter().map(Duration::as_millis).collect();
        assert_eq!(
            ms,
            [100, 200, 400, 800, 1600, 3200, 6400, 12800, 25600, 30000, 30000, 30000, 30000]
        );
    }

    #[test]
    fn at_most_262144_keys_wait() {
        // docs/protocol.md: "Pending keys are bounded (262144; ...)".
        assert_eq!(DEFAULT_MAX_PENDING_KEYS, 262_144);
    }
}
