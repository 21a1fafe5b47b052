//! A peer's connection as the control server keeps it (its stream, its unfinished line, whether
//! it presented the token), and the rate limit on warnings about peers.

use std::io::{self, ErrorKind, Read, Write};
use std::time::{Duration, Instant};

use mio::net::{TcpStream, UnixStream};
use mio::Registry;

use crate::control::LineBuffer;

#[derive(Debug)]
pub(super) enum Stream {
    /// A control connection: free lines.
    Tcp(TcpStream),
    /// A reply-path connection: one request line.
    Unix(UnixStream),
}

impl Stream {
    pub(super) fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }

    /// Writes all of `bytes` without blocking; false if the socket would not take them whole.
    pub(super) fn write_now(&self, mut bytes: &[u8]) -> bool {
        while !bytes.is_empty() {
            let r = match self {
                Stream::Tcp(s) => (&*s).write(bytes),
                Stream::Unix(s) => (&*s).write(bytes),
            };
            match r {
                Ok(0) => return false,
                Ok(n) => bytes = &bytes[n..],
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
        true
    }

    /// Whether bytes (or its end) wait to be read that no readiness event announced yet.
    pub(super) fn has_unread(&self) -> bool {
        let mut b = [0u8; 1];
        match self {
            Stream::Tcp(s) => s.peek(&mut b).is_ok(),
            Stream::Unix(_) => false,
        }
    }

    pub(super) fn deregister(&mut self, registry: &Registry) {
        let _ = match self {
            Stream::Tcp(s) => registry.deregister(s),
            Stream::Unix(s) => registry.deregister(s),
        };
    }
}

#[derive(Debug)]
pub(super) struct Conn {
    pub(super) stream: Stream,
    pub(super) peer: String,
    pub(super) lines: LineBuffer,
    /// When the unfinished line in `lines` began (`None` while there is none).
    pub(super) partial_since: Option<Instant>,
    /// In `ready` or `starved` (so never twice in either).
    pub(super) queued: bool,
    /// The server stopped reading it for want of memory and has not read it since: its line
    /// has twice the timeout, and its clock restarts when the server reads it again (not when
    /// memory comes back: others may take that memory before its turn, again and again).
    pub(super) waited: bool,
    /// Presented the control token (or none is needed).
    pub(super) authed: bool,
    /// When this connection was accepted or last sent bytes.
    pub(super) last_read: Instant,
    /// Its `last_read` is in the server's idle queue (it may make way for a new connection).
    pub(super) noted: bool,
    /// It sent a line that freed objects, and a sync line (a client that confirms its frees,
    /// and sends again what a closed connection did not confirm).
    pub(super) sent: (bool, bool),
    /// When this connection's last stats request was answered.
    pub(super) last_stats: Option<Instant>,
}

/// The longest line a connection may send before it presents the control token (a token line
/// is at most ~270 bytes).
pub(super) const AUTH_LINE_BYTES: usize = 512;

/// Kinds of rate-limited warnings.
#[derive(Debug, Clone, Copy)]
pub(super) enum Warn {
    BadLine,
    Unauthorized,
    LongLine,
    Partial,
    TimedOut,
    Refused,
    Accept,
    Reply,
    Stats,
    Idle,
}

/// One warning per kind per second; the rest are counted and reported with the next one.
#[derive(Debug, Default)]
pub(super) struct Warnings {
    next: [Option<Instant>; 10],
    suppressed: [u64; 10],
}

impl Warnings {
    /// Runs `log(suppressed)` if a warning of `kind` may be logged now.
    pub(super) fn warn(&mut self, kind: Warn, log: impl FnOnce(u64)) {
        let i = kind as usize;
        let now = Instant::now();
        if self.next[i].is_some_and(|n| now < n) {
            self.suppressed[i] += 1;
            return;
        }
        log(std::mem::take(&mut self.suppressed[i]));
        self.next[i] = Some(now + Duration::from_secs(1));
    }
}
