//! The control server: the writer loop's side that faces peers. It accepts TCP control
//! connections (free lines) and local reply-path connections, reads them within budgets, applies
//! frees to the arena, and enforces every bound a hostile or broken peer could otherwise break.
//!
//! Invariants:
//! - **Budget.** One turn reads at most [`TURN_BYTES`] from one connection. A connection that may
//!   have more to read (readiness is edge-triggered: no new event will come for bytes already
//!   announced) waits at the back of `ready`, a FIFO rotation, so every readable connection gets
//!   a turn before any gets a second; the writer loop gives the placer a step between turns.
//! - **Connections.** At most `max_connections` control connections are open, and as many
//!   reply-path ones (counted apart: remote peers holding every control slot cannot stop a local
//!   reader's request). With every control slot taken, a new connection closes the oldest that
//!   has not presented the token (with one set), else the one idle longest (nothing
//!   unfinished, nothing sent for at least `line_timeout`, and either no object freed or its
//!   frees confirmed by sync lines: a client reconnects when it next frees, and every line it
//!   sent was applied), else it is closed at once; each counted. So idle peers hold a slot for
//!   `line_timeout` at most while others wait for one; with a token, peers without it hold
//!   none a new connection needs. Out of descriptors (`EMFILE`), a spare descriptor
//!   is given up to accept and close the waiting connections, and accepting is retried with a
//!   back-off.
//! - **Memory.** Every connection may hold an unfinished line of up to [`SMALL_LINE`] bytes
//!   whatever the others hold (so short lines always flow); longer ones draw on a pool of
//!   `control_buffer_bytes` shared by all; when the pool is used up, one connection at a time
//!   (the first to run out) may still grow its line to [`MAX_LINE_BYTES`], so some line can
//!   always be completed; its privilege ends with that line, and passes to the connection that
//!   has waited longest. A line longer than that closes its connection. A connection that may
//!   not buffer more waits in `starved`, unread (TCP pushes back on its sender), until memory is
//!   given back: nothing it sent is dropped. In all, unfinished lines hold at most
//!   `control_buffer_bytes + max_connections × TURN_BYTES + MAX_LINE_BYTES` bytes (a
//!   connection whose privilege ended keeps what its last turn read of its next line).
//! - **Time.** A connection whose unfinished line has been unfinished for longer than
//!   `line_timeout` is closed (and counted): a peer cannot hold memory or a slot by never
//!   finishing a line. The clock of a line starts when it starts (a connection streaming many
//!   lines is never idle); a connection the server, not the peer, stopped reading (a starved one)
//!   has twice the time (the lines it waits for, younger, are closed first), and its clock
//!   restarts when the server reads it again.
//! - **Answers.** The server writes only to answer a `{"stats": true}` line: at most once per
//!   connection per [`control::STATS_INTERVAL`] and [`control::STATS_ANSWERS_PER_SECOND`] in
//!   all, with the per-store table (a walk of the object table) remade at most once per
//!   [`control::STATS_TABLE_INTERVAL`], in one non-blocking write: a peer that does not read its
//!   answers is closed, never waited for.
//! - **Logs.** Every peer event is counted in the stats; warnings about peers are rate-limited to
//!   one per kind per second, with the number suppressed.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::{self, ErrorKind};
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use mio::net::{TcpListener, UnixListener};
use mio::{Interest, Registry, Token};

mod answers;
mod conn;

use crate::arena::Arena;
use crate::control::{self, LineBuffer, MAX_LINE_BYTES};
use crate::error::{Error, Result};
use crate::reply;
use crate::report::UnauthorizedPeers;
use crate::stats::{bump, Stats};
use answers::{apply_line, stats_answer, StoreTable};
use conn::{Conn, Stream, Warn, Warnings, AUTH_LINE_BYTES};

/// The control listener's token.
pub(crate) const LISTENER: Token = Token(0);
/// The submitters' (and regions') waker token.
pub(crate) const WAKER: Token = Token(1);
/// The reply-path listener's token.
pub(crate) const REPLY: Token = Token(2);
/// The first token given to a connection.
const FIRST_CONN: usize = 3;

/// An unfinished line this long is held for any connection, outside the shared pool.
pub(crate) const SMALL_LINE: usize = 4 * 1024;

/// Bytes read from one connection per turn. 16 KiB of the shortest valid lines (`[]`) take
/// about 0.1 ms to apply.
pub(crate) const TURN_BYTES: usize = 8 * 1024;
/// Idle connections looked at, at most, to find one that may make way for a new connection.
const IDLE_LOOKS: usize = 64;
/// Connections accepted from one listener per turn.
const ACCEPTS_PER_TURN: usize = 64;
/// The longest back-off between attempts to accept while descriptors are exhausted.
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

/// The bounds the server puts on its peers (from the [`crate::Config`]).
#[derive(Debug, Clone)]
pub(crate) struct Limits {
    pub max_connections: usize,
    pub buffer_bytes: usize,
    pub line_timeout: Duration,
    /// The control token a connection presents before its frees are applied.
    pub token: Option<String>,
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct ControlServer {
    listener: TcpListener,
    reply: UnixListener,
    reply_endpoint: String,
    conns: HashMap<Token, Conn>,
    ready: VecDeque<Token>,
    starved: VecDeque<Token>,
    next_token: usize,
    scratch: Vec<u8>,
    /// Sum of `lines.held()` over control connections.
    buffered: usize,
    /// Sum of what each holds beyond [`SMALL_LINE`]: the shared pool in use.
    pooled: usize,
    /// The connection that may grow its line past an exhausted pool.
    privileged: Option<Token>,
    limits: Limits,
    /// The listeners may have connections waiting (their budget ran out, or a retry is due).
    accept_tcp: bool,
    accept_reply: bool,
    /// Accepting failed (descriptors exhausted): retry at `.0`, then wait twice `.1`.
    backoff: Option<(Instant, Duration)>,
    /// A descriptor kept in reserve so that, out of descriptors, waiting connections can still
    /// be accepted and closed instead of hanging.
    spare: Option<File>,
    /// Connections with an unfinished line.
    partials: usize,
    /// Reply-path connections among `conns` (capped apart from the control connections, so
    /// that remote peers holding every control slot cannot stop local readers' requests).
    replies: usize,
    /// When `tick` next looks for unfinished lines that are too old.
    next_scan: Option<Instant>,
    /// Control connections that may make way for a new one, by the time they last sent bytes
    /// (or were accepted), oldest first: `(token, last_read)`, pushed when a connection is left
    /// with nothing unfinished and has freed nothing, or confirms its frees with sync lines (a
    /// client that frees with bare lines, as SpecForge's `ArenaObjectClient`, would lose the
    /// line it writes next on a closed connection; blank or bad lines earn no such exemption). An entry whose connection read since (its
    /// `last_read` differs), has an unfinished line or is gone is stale, and dropped.
    idle: VecDeque<(Token, Instant)>,
    /// With a token: control connections in the order they were accepted, to make way for a
    /// new one (the oldest first) while they have not presented it. An entry whose connection
    /// presented it or is gone is stale, and dropped.
    unauthed: VecDeque<Token>,
    warnings: Warnings,
    /// The per-store table of the last stats answer.
    store_table: Option<StoreTable>,
    /// Stats answers given in the current second (which began at `.0`).
    stats_answers: (Instant, u32),
}

fn spare() -> Option<File> {
    File::open("/dev/null").ok()
}

impl ControlServer {
    /// A server over a bound control listener, with a reply listener made here; registers both.
    ///
    /// # Errors
    /// [`Error::Io`] if the reply socket cannot be bound or registration fails.
    pub fn new(mut listener: TcpListener, registry: &Registry, limits: Limits) -> Result<Self> {
        registry
            .register(&mut listener, LISTENER, Interest::READABLE)
            .map_err(|e| Error::io("registering the control listener", e))?;
        let (mut reply, reply_endpoint) = bind_reply()?;
        registry
            .register(&mut reply, REPLY, Interest::READABLE)
            .map_err(|e| Error::io("registering the reply listener", e))?;
        Ok(ControlServer {
            listener,
            reply,
            reply_endpoint,
            conns: HashMap::new(),
            replies: 0,
            ready: VecDeque::new(),
            starved: VecDeque::new(),
            next_token: FIRST_CONN,
            scratch: vec![0; TURN_BYTES],
            buffered: 0,
            pooled: 0,
            privileged: None,
            limits,
            accept_tcp: true,
            accept_reply: true,
            backoff: None,
            spare: spare(),
            partials: 0,
            next_scan: None,
            idle: VecDeque::new(),
            unauthed: VecDeque::new(),
            warnings: Warnings::default(),
            store_table: None,
            stats_answers: (Instant::now(), 0),
        })
    }

    /// The reply path's endpoint (`@capture-arena-reply-...`).
    pub fn reply_endpoint(&self) -> &str {
        &self.reply_endpoint
    }

    /// Notes a readiness event.
    pub fn on_event(&mut self, token: Token) {
        match token {
            LISTENER => self.accept_tcp = true,
            REPLY => self.accept_reply = true,
            t => {
                if let Some(c) = self.conns.get_mut(&t) {
                    if !c.queued {
                        c.queued = true;
                        self.ready.push_back(t);
                    }
                }
            }
        }
    }

    /// Connections waiting for a turn.
    pub fn ready_len(&self) -> usize {
        self.ready.len()
    }

    /// True when there is something to do without waiting for an event.
    pub fn has_work(&self) -> bool {
        !self.ready.is_empty() || ((self.accept_tcp || self.accept_reply) && self.backoff.is_none())
    }

    /// The next time [`ControlServer::tick`] has something to do, if any.
    pub fn next_timer(&self) -> Option<Instant> {
        let retry = self.backoff.map(|(at, _)| at);
        let lines = (self.partials > 0).then(|| {
            self.next_scan.unwrap_or_else(|| {
                Instant::now() + (self.limits.line_timeout / 4).min(Duration::from_secs(1))
            })
        });
        match (retry, lines) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Timers: a due accept retry, and connections whose unfinished line is too old. Returns
    /// true if it closed any.
    pub fn tick(&mut self, registry: &Registry, stats: &Stats) -> bool {
        let now = Instant::now();
        if self.backoff.is_some_and(|(at, _)| now >= at) {
            // Edge-triggered: no new event comes for connections already waiting; look again.
            self.accept_tcp = true;
            self.accept_reply = true;
        }
        if self.spare.is_none() {
            self.spare = spare();
        }
        if self.partials == 0 || self.next_scan.is_some_and(|t| now < t) {
            return false;
        }
        let timeout = self.limits.line_timeout;
        self.next_scan = Some(now + (timeout / 4).min(Duration::from_secs(1)));
        // One the server stopped reading waits for others' lines (whose clocks run, so they are
        // closed first): twice the time, then it is closed all the same, so peers that starve
        // each other cannot hold the pool for long.
        let late = |c: &Conn| {
            let limit = if c.waited {
                timeout.saturating_mul(2)
            } else {
                timeout
            };
            c.partial_since.is_some_and(|t| now - t >= limit)
        };
        let old: Vec<Token> = self
            .conns
            .iter()
            .filter(|(_, c)| late(c))
            .map(|(t, _)| *t)
            .collect();
        let mut closed = false;
        for t in old {
            // Looked at again: closing one before may have given this one memory, restarting
            // its clock.
            if !self.conns.get(&t).is_some_and(&late) {
                continue;
            }
            closed = true;
            bump(&stats.timed_out_lines, 1);
            if let Some(c) = self.conns.get(&t) {
                let (peer, bytes) = (c.peer.clone(), c.lines.pending());
                self.warnings.warn(Warn::TimedOut, |suppressed| {
                    tracing::warn!(
                        %peer,
                        bytes,
                        timeout_s = timeout.as_secs_f64(),
                        suppressed,
                        "control connection held an unfinished line (or did not present the \
                         control token) too long; closed (SGLANG_SPEC_CAPTURE_CONTROL_LINE_TIMEOUT_S)"
                    )
                });
            }
            self.close(t, registry, stats, false);
        }
        closed
    }

    /// Accepts waiting connections, at most [`ACCEPTS_PER_TURN`] per listener. Returns true
    /// if it accepted or refused any.
    pub fn accept(&mut self, registry: &Registry, stats: &Stats) -> bool {
        if self.backoff.is_some_and(|(at, _)| Instant::now() < at) {
            return false;
        }
        let mut changed = false;
        if self.accept_tcp {
            let (more, any) = self.accept_from(false, registry, stats);
            (self.accept_tcp, changed) = (more, changed | any);
        }
        if self.accept_reply {
            let (more, any) = self.accept_from(true, registry, stats);
            (self.accept_reply, changed) = (more, changed | any);
        }
        changed
    }

    /// Returns whether the listener may have more connections waiting, and whether any was
    /// admitted, refused or failed.
    fn accept_from(&mut self, reply: bool, registry: &Registry, stats: &Stats) -> (bool, bool) {
        let mut any = false;
        for _ in 0..ACCEPTS_PER_TURN {
            let accepted = if reply {
                self.reply
                    .accept()
                    .map(|(s, _)| (Stream::Unix(s), "local".to_owned()))
            } else {
                self.listener
                    .accept()
                    .map(|(s, a)| (Stream::Tcp(s), a.to_string()))
            };
            match accepted {
                Ok((stream, peer)) => {
                    self.backoff = None;
                    self.admit(stream, peer, registry, stats);
                    any = true;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    self.backoff = None;
                    return (false, any);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    self.accept_failed(e, reply, stats);
                    return (true, true);
                }
            }
        }
        (true, any)
    }

    /// Out of descriptors (or another accept error): close the waiting connections with the
    /// spare descriptor's slot, so their peers learn at once, and retry later.
    fn accept_failed(&mut self, e: io::Error, reply: bool, stats: &Stats) {
        bump(&stats.accept_errors, 1);
        let emfile = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
        if emfile && self.spare.take().is_some() {
            // A bounded number per turn: a connect flood must not hold the writer here.
            for _ in 0..ACCEPTS_PER_TURN {
                let r = if reply {
                    self.reply.accept().map(drop)
                } else {
                    self.listener.accept().map(drop)
                };
                match r {
                    Ok(()) => bump(&stats.refused_connections, 1),
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
            // Reopened here or, if descriptors are still short, by a later tick.
            self.spare = spare();
        }
        let wait = self.backoff.map_or(Duration::from_millis(10), |(_, d)| {
            (d * 2).min(MAX_ACCEPT_BACKOFF)
        });
        self.backoff = Some((Instant::now() + wait, wait));
        let open = self.conns.len();
        self.warnings.warn(Warn::Accept, |suppressed| {
            tracing::warn!(
                error = %e,
                open,
                retry_ms = wait.as_millis() as u64,
                suppressed,
                "accepting a connection failed; waiting connections were closed, retrying \
                 (raise the descriptor limit, ulimit -n, or lower \
                 SGLANG_SPEC_CAPTURE_CONTROL_MAX_CONNS)"
            )
        });
    }

    fn admit(&mut self, mut stream: Stream, peer: String, registry: &Registry, stats: &Stats) {
        let of_kind = match stream {
            Stream::Tcp(_) => self.conns.len() - self.replies,
            Stream::Unix(_) => self.replies,
        };
        let full = of_kind >= self.limits.max_connections;
        if full && !(matches!(stream, Stream::Tcp(_)) && self.make_room(registry, stats)) {
            bump(&stats.refused_connections, 1);
            let max = self.limits.max_connections;
            self.warnings.warn(Warn::Refused, |suppressed| {
                tracing::warn!(
                    %peer,
                    max,
                    suppressed,
                    "connection refused: too many open (SGLANG_SPEC_CAPTURE_CONTROL_MAX_CONNS)"
                )
            });
            return; // dropping the stream closes it
        }
        if let Stream::Unix(s) = &stream {
            // The reply path hands out descriptors: only to processes of our own user.
            let uid = reply::peer_uid(s.as_raw_fd());
            if uid.as_ref().ok() != Some(&reply::my_uid()) {
                bump(&stats.reply_refused, 1);
                self.warnings.warn(Warn::Reply, |suppressed| {
                    tracing::warn!(?uid, suppressed, "reply request from another user refused")
                });
                return;
            }
        }
        let token = Token(self.next_token);
        self.next_token += 1;
        let registered = match &mut stream {
            Stream::Tcp(s) => registry.register(s, token, Interest::READABLE),
            Stream::Unix(s) => registry.register(s, token, Interest::READABLE),
        };
        if let Err(e) = registered {
            tracing::warn!(%peer, error = %e, "cannot register a connection");
            return;
        }
        let reply = matches!(stream, Stream::Unix(_));
        // A reply connection must send its request promptly, and a control connection its
        // token when one is needed: time them from the start.
        let timed = reply || self.limits.token.is_some();
        let now = Instant::now();
        if !timed {
            self.note_idle(token, now);
        }
        let noted = !timed;
        if timed {
            self.partials += 1;
        }
        if reply {
            self.replies += 1;
        } else {
            bump(&stats.control_connections, 1);
            if self.limits.token.is_some() {
                self.unauthed.push_back(token);
                if self.unauthed.len() > 2 * self.conns.len() + 64 {
                    let conns = &self.conns;
                    self.unauthed
                        .retain(|t| *t == token || conns.get(t).is_some_and(|c| !c.authed));
                }
            }
        }
        tracing::debug!(%peer, ?token, reply, "connection");
        self.conns.insert(
            token,
            Conn {
                stream,
                peer,
                lines: LineBuffer::default(),
                partial_since: timed.then_some(now),
                queued: true,
                waited: false,
                authed: self.limits.token.is_none(),
                last_read: now,
                noted,
                sent: (false, false),
                last_stats: None,
            },
        );
        // Data may already be waiting (edge-triggered): give it a turn.
        self.ready.push_back(token);
    }

    /// Gives the next ready connection one turn. `None` when no connection is ready; else
    /// whether frees changed the arena.
    pub fn serve_one(
        &mut self,
        registry: &Registry,
        arena: &mut Arena,
        stats: &Stats,
        peers: &Mutex<UnauthorizedPeers>,
    ) -> Option<bool> {
        let token = self.ready.pop_front()?;
        let Some(conn) = self.conns.get_mut(&token) else {
            return Some(false); // closed meanwhile
        };
        conn.queued = false;
        if matches!(conn.stream, Stream::Unix(_)) {
            self.serve_reply(token, registry, arena, stats);
            return Some(false);
        }
        let held_before = conn.lines.held();
        let excess_before = held_before.saturating_sub(SMALL_LINE);
        // Timed: an unfinished line, or a connection that has not presented the token yet.
        let had_partial = conn.partial_since.is_some();
        // What this connection may hold: its own small line, plus what the pool has left
        // beside everyone else's excess; all of a maximal line if it is the privileged one.
        let pool_left = self
            .limits
            .buffer_bytes
            .saturating_sub(self.pooled - excess_before);
        let mut max_held = if self.privileged == Some(token) {
            MAX_LINE_BYTES + 1
        } else {
            SMALL_LINE.saturating_add(pool_left).min(MAX_LINE_BYTES + 1)
        };
        if !conn.authed {
            // Before the token, one short line at most, and no share of the pool.
            max_held = max_held.min(AUTH_LINE_BYTES + 1);
        }
        if conn.authed && max_held <= conn.lines.pending() && self.privileged.is_none() {
            // The pool is used up: this one may still finish its line.
            self.privileged = Some(token);
            max_held = MAX_LINE_BYTES + 1;
        }
        let mut turn = TURN_BYTES;
        let mut freed_any = false;
        let mut completed = 0usize;
        let mut warnings = std::mem::take(&mut self.warnings);
        let peer = conn.peer.clone();
        let secret = self.limits.token.clone();
        let mut refused: Option<&'static str> = None;
        let mut stats_asked = 0u64;
        let mut synced: Option<u64> = None;
        let authed_before = conn.authed;
        let mut outcome = loop {
            let room = max_held.saturating_sub(conn.lines.pending()).min(turn);
            if room == 0 {
                // Authorized during this turn: its cap was the token's, not its share (its own
                // small line, the pool): another turn, never a wait for memory it does not need.
                break if turn == 0 || conn.authed != authed_before {
                    Turn::More
                } else {
                    Turn::Starved
                };
            }
            match conn.stream.read(&mut self.scratch[..room]) {
                Ok(0) => break Turn::Eof,
                Ok(n) => {
                    turn -= n;
                    let authed = &mut conn.authed;
                    let mut on_line = |line: &[u8]| {
                        completed += 1;
                        if refused.is_some() {
                            return;
                        }
                        let object = control::parse_object_line(line);
                        if let Some(expected) = secret.as_deref() {
                            match &object {
                                Some(control::ObjectLine::Token(t)) => {
                                    // A right token authorizes the connection (again: a no-op);
                                    // a wrong one closes it.
                                    if control::tokens_equal(t.as_bytes(), expected.as_bytes()) {
                                        *authed = true;
                                    } else {
                                        refused = Some(control::WRONG_TOKEN);
                                    }
                                    return;
                                }
                                _ if !*authed && !line.trim_ascii().is_empty() => {
                                    refused = Some(control::MISSING_TOKEN);
                                    return;
                                }
                                _ => {}
                            }
                        }
                        match object {
                            // Answered at the end of the turn, after its frees.
                            Some(control::ObjectLine::Stats) => stats_asked += 1,
                            Some(control::ObjectLine::Sync(n)) => synced = Some(n),
                            _ => {
                                freed_any |=
                                    apply_line(line, object, &peer, arena, stats, &mut warnings)
                            }
                        }
                    };
                    let pushed = conn
                        .lines
                        .push_capped(&self.scratch[..n], max_held, &mut on_line);
                    if refused.is_none() && !conn.authed && conn.lines.pending() > AUTH_LINE_BYTES {
                        refused = Some(control::MISSING_TOKEN);
                    }
                    if let Some(reason) = refused {
                        refuse(&conn.stream, &peer, reason, stats, peers, &mut warnings);
                        break Turn::Close;
                    }
                    if let Err(o) = pushed {
                        bump(&stats.oversized_lines, 1);
                        warnings.warn(Warn::LongLine, |suppressed| {
                            tracing::warn!(
                                %peer,
                                bytes = o.bytes,
                                limit = MAX_LINE_BYTES,
                                suppressed,
                                "control line too long; closing its connection"
                            )
                        });
                        break Turn::Close;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break Turn::Drained,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // The peer's end, abrupt (a reset: a killed process, SO_LINGER 0): as an end of
                // the stream, so an unfinished last line is counted (partial_lines).
                Err(e) if e.kind() == ErrorKind::ConnectionReset => break Turn::Eof,
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "control connection error");
                    break Turn::Close;
                }
            }
        };
        if turn < TURN_BYTES {
            conn.last_read = Instant::now();
            conn.noted = false;
            if std::mem::take(&mut conn.waited) && had_partial {
                // Read again after a wait that was the server's: its line's clock restarts.
                conn.partial_since = Some(conn.last_read);
            }
        }
        conn.sent.0 |= freed_any;
        conn.sent.1 |= synced.is_some();
        if let Some(n) = synced.filter(|_| !matches!(outcome, Turn::Close)) {
            // After the turn's frees: every line before the sync was applied. One answer a
            // turn (the last sync), so a peer gets at most as many bytes as it sends.
            bump(&stats.sync_requests, 1);
            if !conn.stream.write_now(&control::synced_line(n)) {
                tracing::debug!(%peer, "sync answer not taken whole; closing");
                outcome = Turn::Close;
            }
        }
        if stats_asked > 0 && !matches!(outcome, Turn::Close) {
            // After the turn's frees, so an answer reflects every line sent before its request.
            let now = Instant::now();
            if now.saturating_duration_since(self.stats_answers.0) >= Duration::from_secs(1) {
                self.stats_answers = (now, 0);
            }
            let due = conn
                .last_stats
                .is_none_or(|t| now.saturating_duration_since(t) >= control::STATS_INTERVAL)
                && self.stats_answers.1 < control::STATS_ANSWERS_PER_SECOND;
            let extra = stats_asked - u64::from(due);
            if extra > 0 {
                bump(&stats.bad_lines, extra);
                warnings.warn(Warn::Stats, |suppressed| {
                    tracing::warn!(
                        %peer,
                        extra,
                        suppressed,
                        "stats asked more often than every {:?} (or more than {} a second in \
                         all): not answered (counted in bad_lines)",
                        control::STATS_INTERVAL,
                        control::STATS_ANSWERS_PER_SECOND
                    )
                });
            }
            if due {
                conn.last_stats = Some(now);
                self.stats_answers.1 += 1;
                bump(&stats.stats_requests, 1);
                let unauthorized = lock(peers).rows(now);
                let answer = stats_answer(&mut self.store_table, arena, stats, unauthorized, now);
                if !conn.stream.write_now(&answer) {
                    tracing::debug!(%peer, "stats answer not taken whole; closing");
                    outcome = Turn::Close;
                }
            }
        }
        self.warnings = warnings;
        let held_after = conn.lines.held();
        let pending = conn.lines.pending();
        self.buffered = self.buffered - held_before + held_after;
        self.pooled = self.pooled - excess_before + held_after.saturating_sub(SMALL_LINE);
        // Privilege is for the line that ran out of room: it ends with that line (a peer that
        // always starts another line before its last ends would otherwise keep it for good,
        // and every other line over the pool's share would wait for ever).
        let unprivileged = (pending == 0 || completed > 0) && self.privileged == Some(token);
        if unprivileged {
            self.privileged = None;
        }
        match (had_partial, pending > 0 || !conn.authed) {
            (false, true) => {
                conn.partial_since = Some(Instant::now());
                self.partials += 1;
            }
            (true, false) => {
                conn.partial_since = None;
                self.partials -= 1;
            }
            // A new unfinished line: its clock starts now. Not before the token: lines that
            // authorize nothing (blank ones) never put off the deadline for presenting it.
            (true, true) if completed > 0 && conn.authed => {
                conn.partial_since = Some(Instant::now())
            }
            _ => {}
        }
        // Left with nothing unfinished and not in the idle queue: idle from now on, until it
        // sends again (a turn that read nothing restarts its clock, keeping the queue in order).
        let idle = matches!(outcome, Turn::Drained)
            && conn.partial_since.is_none()
            && !conn.noted
            && (!conn.sent.0 || conn.sent.1);
        let idle = idle.then(|| {
            if turn == TURN_BYTES {
                conn.last_read = Instant::now();
            }
            conn.noted = true;
            conn.last_read
        });
        match outcome {
            Turn::Drained => {}
            Turn::More => {
                conn.queued = true;
                self.ready.push_back(token);
            }
            // (Not the one whose privilege just ended: it waits behind those already waiting.)
            Turn::Starved if self.privileged.is_none() && conn.authed && !unprivileged => {
                // The pool ran out during this turn: this one may still finish its line, so
                // some line can always complete.
                self.privileged = Some(token);
                conn.queued = true;
                self.ready.push_back(token);
            }
            Turn::Starved => {
                conn.queued = true;
                conn.waited = true;
                self.starved.push_back(token);
            }
            Turn::Eof => self.close(token, registry, stats, true),
            Turn::Close => self.close(token, registry, stats, false),
        }
        if let Some(at) = idle {
            self.note_idle(token, at);
        }
        if held_after < held_before || unprivileged {
            self.unstarve();
        }
        Some(freed_any)
    }

    /// Notes that control connection `token` is idle since `at` (see `idle`).
    fn note_idle(&mut self, token: Token, at: Instant) {
        self.idle.push_back((token, at));
        if self.idle.len() > 2 * self.conns.len() + 64 {
            let conns = &self.conns;
            self.idle
                .retain(|(t, at)| conns.get(t).is_some_and(|c| c.last_read == *at));
        }
    }

    /// With every control slot taken: makes room for a new control connection by closing the
    /// oldest that has not presented the token (with one set: it has sent nothing that counts,
    /// and a client that presents it next sends again what a closed connection did not
    /// confirm), else the one idle longest (`close_idle`). True if it closed one.
    fn make_room(&mut self, registry: &Registry, stats: &Stats) -> bool {
        self.close_unauthed(registry, stats) || self.close_idle(registry, stats)
    }

    /// Closes the oldest control connection that has not presented the token, unless bytes
    /// wait to be read from it (its token, maybe). True if it closed one.
    fn close_unauthed(&mut self, registry: &Registry, stats: &Stats) -> bool {
        let (mut i, mut looked) = (0, 0);
        while i < self.unauthed.len() && looked < IDLE_LOOKS {
            let t = self.unauthed[i];
            let Some(c) = self.conns.get(&t).filter(|c| !c.authed) else {
                self.unauthed.remove(i); // stale
                continue;
            };
            looked += 1;
            if c.queued || c.stream.has_unread() {
                i += 1; // about to be read: its token may be there (kept, for a later look)
                continue;
            }
            self.unauthed.remove(i);
            self.make_way(t, None, registry, stats);
            return true;
        }
        false
    }

    /// With every control slot taken: closes the control connection idle longest among those
    /// in the idle queue, if it has been idle (nothing unfinished, nothing sent, nothing
    /// waiting to be read) for at least the line timeout. True if it closed one.
    fn close_idle(&mut self, registry: &Registry, stats: &Stats) -> bool {
        let now = Instant::now();
        let (mut i, mut looked) = (0, 0);
        while i < self.idle.len() && looked < IDLE_LOOKS {
            let (t, at) = self.idle[i];
            let Some(c) = self
                .conns
                .get(&t)
                .filter(|c| c.last_read == at && c.partial_since.is_none())
            else {
                self.idle.remove(i); // stale
                continue;
            };
            let for_ = now.saturating_duration_since(at);
            if for_ < self.limits.line_timeout {
                return false; // in order: none after it has been idle longer
            }
            looked += 1;
            if c.queued || c.stream.has_unread() {
                i += 1; // about to be read: not idle (kept, for a later look)
                continue;
            }
            self.idle.remove(i);
            self.make_way(t, Some(for_), registry, stats);
            return true;
        }
        false
    }

    /// Closes control connection `t` to let a new one in (counted in `idle_closed`): one idle
    /// for `idle_for`, or (`None`) one that has not presented the token.
    fn make_way(
        &mut self,
        t: Token,
        idle_for: Option<Duration>,
        registry: &Registry,
        stats: &Stats,
    ) {
        bump(&stats.idle_closed, 1);
        let peer = self
            .conns
            .get(&t)
            .map(|c| c.peer.clone())
            .unwrap_or_default();
        let max = self.limits.max_connections;
        self.warnings.warn(Warn::Idle, |suppressed| match idle_for {
            Some(idle) => tracing::warn!(
                %peer,
                idle_s = idle.as_secs_f64(),
                max,
                suppressed,
                "every control slot is taken: closed the connection idle longest to let a new \
                 one in (its client reconnects when it next frees; raise \
                 SGLANG_SPEC_CAPTURE_CONTROL_MAX_CONNS if trainers need more)"
            ),
            None => tracing::warn!(
                %peer,
                max,
                suppressed,
                "every control slot is taken: closed the oldest connection that has not presented \
                 the control token to let a new one in (counted in idle_closed; raise \
                 SGLANG_SPEC_CAPTURE_CONTROL_MAX_CONNS if trainers need more)"
            ),
        });
        self.close(t, registry, stats, false);
    }

    /// Memory was given back: connections waiting for room get a turn again, the longest
    /// waiting first. Their lines' clocks restart once they are read (`Conn::waited`).
    fn unstarve(&mut self) {
        self.ready.extend(self.starved.drain(..));
    }

    /// Reads a reply connection's request; answers and closes once it is complete.
    fn serve_reply(&mut self, token: Token, registry: &Registry, arena: &Arena, stats: &Stats) {
        let Some(conn) = self.conns.get_mut(&token) else {
            return;
        };
        let mut buf = [0u8; reply::MAX_REQUEST_BYTES];
        let mut request = None;
        let done = loop {
            let room = reply::MAX_REQUEST_BYTES.saturating_sub(conn.lines.pending());
            if room == 0 {
                break true; // too long: refused below
            }
            match conn.stream.read(&mut buf[..room]) {
                Ok(0) => break true,
                Ok(n) => {
                    let _ = conn.lines.push(&buf[..n], |l| {
                        if request.is_none() {
                            request = Some(String::from_utf8_lossy(l).trim().to_owned());
                        }
                    });
                    if request.is_some() {
                        break true;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break false,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => break true,
            }
        };
        if !done {
            return; // the rest of the request comes with the next event
        }
        let answer = match &request {
            Some(what) => match arena.region().reply(what) {
                Some(a) => a,
                None => Err(Error::InvalidRead {
                    key: what.chars().take(64).collect(),
                    reason: "this arena's region has no such answer".into(),
                }),
            },
            None => Err(Error::InvalidRead {
                key: "request".into(),
                reason: format!("no request line within {} bytes", reply::MAX_REQUEST_BYTES),
            }),
        };
        if answer.is_ok() {
            bump(&stats.reply_requests, 1);
        } else {
            bump(&stats.reply_refused, 1);
        }
        if let Stream::Unix(s) = &conn.stream {
            let fds: Vec<_> = answer
                .as_ref()
                .map(|r| r.fds.iter().map(|f| f.as_raw_fd()).collect())
                .unwrap_or_default();
            if let Err(e) = reply::send_with_fds(s.as_raw_fd(), &reply::encode(&answer), &fds) {
                tracing::debug!(error = %e, "could not send a reply");
            }
        }
        // The answer's descriptors (our duplicates) close here, after sending.
        drop(answer);
        self.close(token, registry, stats, false);
    }

    fn close(&mut self, token: Token, registry: &Registry, stats: &Stats, eof: bool) {
        let Some(mut c) = self.conns.remove(&token) else {
            return;
        };
        let pending = c.lines.pending();
        if eof && pending > 0 && matches!(c.stream, Stream::Tcp(_)) {
            bump(&stats.partial_lines, 1);
            let peer = c.peer.clone();
            self.warnings.warn(Warn::Partial, |suppressed| {
                tracing::warn!(
                    %peer,
                    bytes = pending,
                    suppressed,
                    "control connection closed mid-line; partial line discarded"
                )
            });
        }
        if c.partial_since.is_some() {
            self.partials -= 1;
        }
        if matches!(c.stream, Stream::Unix(_)) {
            self.replies -= 1;
        }
        // Reply connections' few request bytes are not counted in `buffered`.
        let held = match c.stream {
            Stream::Tcp(_) => c.lines.held(),
            Stream::Unix(_) => 0,
        };
        self.buffered -= held;
        self.pooled -= held.saturating_sub(SMALL_LINE);
        if self.privileged == Some(token) {
            self.privileged = None;
            self.unstarve();
        }
        c.stream.deregister(registry);
        // A queued token of a closed connection is skipped when it comes up.
        if held > 0 {
            self.unstarve();
        }
    }

    /// Publishes the gauges (open connections, buffered bytes).
    pub fn publish_gauges(&self, stats: &Stats) {
        use std::sync::atomic::Ordering::Relaxed;
        stats
            .open_connections
            .store(self.conns.len() as u64, Relaxed);
        stats
            .control_buffered_bytes
            .store(self.buffered as u64, Relaxed);
    }
}

/// How a connection's turn ended.
enum Turn {
    /// Read until it would block: wait for its next event.
    Drained,
    /// Used its whole budget: more may be waiting.
    More,
    /// No room to buffer more: wait until memory is given back.
    Starved,
    /// The peer closed.
    Eof,
    /// Close it (an error, a line too long).
    Close,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Closes out a connection for the control token: tells it why (best effort: a client that
/// never reads is not held up), counts it and its peer's address, and warns with the likely
/// cause.
fn refuse(
    stream: &Stream,
    peer: &str,
    reason: &'static str,
    stats: &Stats,
    peers: &Mutex<UnauthorizedPeers>,
    warnings: &mut Warnings,
) {
    // Counted before the peer hears: whoever it tells sees the count.
    bump(&stats.unauthorized_lines, 1);
    let connections = lock(peers).note(peer, reason, Instant::now());
    let _ = stream.write_now(&control::unauthorized_line(reason));
    warnings.warn(Warn::Unauthorized, |suppressed| {
        if reason == control::MISSING_TOKEN {
            tracing::warn!(
                %peer,
                connections,
                suppressed,
                "a control connection sent frees without the control token and was closed: \
                 nothing it sent was applied, so those objects stay resident until freed with \
                 the token (or until SGLANG_SPEC_CAPTURE_OBJECT_TTL_S, if set). A reader that \
                 sends no token cannot free here (SpecForge's ArenaObjectClient is one): give \
                 it the token (a result's arena.token), or unset \
                 SGLANG_SPEC_CAPTURE_CONTROL_TOKEN (counted in unauthorized_lines; `capture-arena \
                 stats` lists such peers)"
            )
        } else {
            tracing::warn!(
                %peer,
                connections,
                suppressed,
                "a control connection presented a wrong control token and was closed: nothing \
                 it sent was applied (a trainer holding the token of this producer's previous \
                 run? counted in unauthorized_lines)"
            )
        }
    });
}

/// Binds the reply path's listener on a fresh abstract name.
fn bind_reply() -> Result<(UnixListener, String)> {
    let endpoint = format!(
        "{}{}-{:032x}",
        reply::ENDPOINT_PREFIX,
        std::process::id(),
        crate::random::nonce()?
    );
    let name = endpoint.trim_start_matches('@');
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(|e| Error::io("naming the reply socket", e))?;
    let std = std::os::unix::net::UnixListener::bind_addr(&addr)
        .map_err(|e| Error::io(format!("binding the reply socket {endpoint}"), e))?;
    std.set_nonblocking(true)
        .map_err(|e| Error::io("making the reply socket non-blocking", e))?;
    Ok((UnixListener::from_std(std), endpoint))
}
