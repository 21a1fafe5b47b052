//! One connection to a control endpoint, as every trainer-side sender makes it: connecting within
//! a deadline and presenting the token first, keys as free lines under the server's line limit,
//! the delivery confirmation after them (a sync line and its answer: lines of one connection are
//! applied in order, so the answer means every line before it was), probes of the socket
//! (closed? room to write without blocking?), and a one-shot send for operators
//! ([`send_frees`]).

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::control::{Answer, MAX_LINE_BYTES, MAX_SYNC_ANSWER_BYTES};
use crate::error::{Error, Result};
use crate::key::Key;

/// Bytes per free line the client writes: well under the server's [`MAX_LINE_BYTES`], and any
/// valid key fits.
const LINE_BYTES: usize = 64 * 1024;

/// Connects within `timeout` (one deadline over the name's resolution and every address it
/// resolves to: [`resolve_within`]), presents `token` first when there is one, and
/// has the server confirm a first sync line (sync 0) before anything else is sent: a server
/// that wants another token refuses the connection there, and says so, before keys are written
/// (a refusal after a large write could be lost in the reset its unread bytes cause).
///
/// # Errors
/// As [`confirm`] (`PermissionDenied` for a refused token), or the connection's error.
pub(super) fn connect(
    endpoint: &str,
    token: Option<&str>,
    timeout: Duration,
) -> std::io::Result<TcpStream> {
    connect_conn(endpoint, token, timeout).map(|c| c.stream)
}

/// A connection to a control endpoint, and whether its server applies stamped frees (its first
/// sync answer said `"stamps": true`).
#[derive(Debug)]
pub(super) struct Conn {
    pub(super) stream: TcpStream,
    pub(super) stamps: bool,
}

/// [`connect`], keeping what the server's first answer said of stamped frees.
pub(super) fn connect_conn(
    endpoint: &str,
    token: Option<&str>,
    timeout: Duration,
) -> std::io::Result<Conn> {
    let deadline = crate::limits::deadline_in(timeout);
    let addrs = resolve_within(endpoint, timeout)?;
    let left = deadline.saturating_duration_since(Instant::now());
    connect_to(&addrs, token, left.max(Duration::from_millis(1)))
}

/// Name resolutions running at once, at most: one abandoned at its deadline holds its thread
/// until the system resolver gives up (its own timeouts, seconds).
pub const MAX_RESOLUTIONS: usize = 64;
/// The resolutions running (low 32 bits) and the process they run in (high 32 bits): a forked
/// child has none of its parent's threads, so it starts at 0. One atomic word, no lock a fork
/// could leave held.
static RESOLUTIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Takes a place among the [`MAX_RESOLUTIONS`]; false when none is left.
fn take_resolution() -> bool {
    use std::sync::atomic::Ordering;
    let pid = u64::from(std::process::id()) << 32;
    RESOLUTIONS
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| {
            let running = if w & !0xffff_ffff == pid {
                w & 0xffff_ffff
            } else {
                0
            };
            (running < MAX_RESOLUTIONS as u64).then_some(pid | (running + 1))
        })
        .is_ok()
}

/// Gives back a place [`take_resolution`] took (in this process).
fn give_resolution() {
    use std::sync::atomic::Ordering;
    let pid = u64::from(std::process::id()) << 32;
    let _ = RESOLUTIONS.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| {
        (w & !0xffff_ffff == pid && w & 0xffff_ffff > 0).then_some(w - 1)
    });
}

/// The addresses of `endpoint` (`host:port`), resolved within `timeout`. An address needs no
/// resolution; a name is resolved on a thread of its own, because the system resolver
/// (`getaddrinfo`) takes as long as its configuration says (10 s and more per name when the
/// name server does not answer) and cannot be interrupted. A resolution past the deadline is
/// abandoned (its thread ends when the resolver does); at most [`MAX_RESOLUTIONS`] run at once.
///
/// # Errors
/// `TimedOut` past the deadline; `WouldBlock` while [`MAX_RESOLUTIONS`] are running (abandoned
/// ones still waiting for the resolver); the resolver's error.
pub(crate) fn resolve_within(
    endpoint: &str,
    timeout: Duration,
) -> std::io::Result<Vec<std::net::SocketAddr>> {
    if let Ok(addr) = endpoint.parse::<std::net::SocketAddr>() {
        return Ok(vec![addr]);
    }
    if !take_resolution() {
        return Err(std::io::Error::new(
            ErrorKind::WouldBlock,
            format!(
                "resolving {endpoint}: {MAX_RESOLUTIONS} name resolutions are running already \
                 (the system resolver's name server does not answer?)"
            ),
        ));
    }
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let name = endpoint.to_owned();
    let spawned = std::thread::Builder::new()
        .name("capture-arena-resolve".into())
        .spawn(move || {
            let got = name.to_socket_addrs().map(Iterator::collect::<Vec<_>>);
            give_resolution();
            // Nobody reads it once the caller's deadline passed.
            let _ = tx.send(got);
        });
    if let Err(e) = spawned {
        give_resolution();
        return Err(e);
    }
    match rx.recv_timeout(timeout) {
        Ok(got) => got,
        Err(_) => Err(std::io::Error::new(
            ErrorKind::TimedOut,
            format!(
                "resolving {endpoint} took longer than {timeout:?} (the system resolver's \
                     name server does not answer?); use an address, or fix the resolver"
            ),
        )),
    }
}

/// [`connect`] to these addresses in turn, all within `timeout`, each with an equal share of
/// what is left (before: each address had the whole timeout, so a name with n unanswering
/// addresses cost n times it).
fn connect_to(
    addrs: &[std::net::SocketAddr],
    token: Option<&str>,
    timeout: Duration,
) -> std::io::Result<Conn> {
    let deadline = crate::limits::deadline_in(timeout);
    let mut last = std::io::Error::new(ErrorKind::AddrNotAvailable, "no address");
    // The last failure other than a refusal: a refusal proves the producer gone (its frees
    // are dropped) only when every address refused.
    let mut other: Option<std::io::Error> = None;
    for (i, addr) in addrs.iter().enumerate() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                ErrorKind::TimedOut,
                format!("no address answered within {timeout:?} (last: {last})"),
            ));
        }
        // An equal share of what is left for each address still to try (all of it for the
        // last): one that never answers leaves the next its turn.
        let share = left / u32::try_from(addrs.len() - i).unwrap_or(u32::MAX);
        match TcpStream::connect_timeout(addr, share.max(Duration::from_millis(1))) {
            Ok(s) => {
                s.set_nodelay(true)?;
                let mut first = Vec::with_capacity(320);
                if let Some(t) = token {
                    first.extend_from_slice(crate::control::token_line(t).as_bytes());
                    first.push(b'\n');
                }
                first.extend_from_slice(crate::control::sync_line(0).as_bytes());
                first.push(b'\n');
                write_within(&s, &first, deadline)?;
                let left = deadline
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1));
                let stamps = confirm(&s, 0, left)?;
                s.set_write_timeout(Some(timeout))?;
                return Ok(Conn { stream: s, stamps });
            }
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => last = e,
            Err(e) => other = Some(e),
        }
    }
    Err(other.unwrap_or(last))
}

/// `keys` as free lines, each well under the server's line limit; with `stamps` (the server
/// applies stamped frees), the keys given with their object's stamp go as stamped free lines.
pub(super) fn free_lines_stamped(
    keys: &[(&Key, Option<u64>)],
    stamps: bool,
) -> std::io::Result<Vec<u8>> {
    if !stamps {
        let plain: Vec<&Key> = keys.iter().map(|(k, _)| *k).collect();
        return free_lines(&plain);
    }
    let plain: Vec<&Key> = keys
        .iter()
        .filter(|(_, s)| s.is_none())
        .map(|(k, _)| *k)
        .collect();
    let mut buf = free_lines(&plain)?;
    let mut line: Vec<(&str, u64)> = Vec::new();
    let mut bytes = 0;
    for (k, s) in keys {
        let Some(s) = s else { continue };
        // A key escapes to at most 6 bytes a byte in JSON, plus its stamp and punctuation.
        let more = k.as_str().len() * 6 + 32;
        if !line.is_empty() && bytes + more > LINE_BYTES {
            buf.extend_from_slice(crate::control::stamped_free_line(&line).as_bytes());
            buf.push(b'\n');
            line.clear();
            bytes = 0;
        }
        line.push((k.as_str(), *s));
        bytes += more;
    }
    if !line.is_empty() {
        buf.extend_from_slice(crate::control::stamped_free_line(&line).as_bytes());
        buf.push(b'\n');
    }
    debug_assert!(buf.split(|&b| b == b'\n').all(|l| l.len() < MAX_LINE_BYTES));
    Ok(buf)
}

/// `keys` as free lines, each well under the server's line limit.
pub(super) fn free_lines(keys: &[&Key]) -> std::io::Result<Vec<u8>> {
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
    Ok(buf)
}

/// `keys` as free lines ([`free_lines_stamped`]) followed by the sync line `sync` (see
/// [`confirm`]).
pub(super) fn free_lines_synced(
    keys: &[(&Key, Option<u64>)],
    stamps: bool,
    sync: u64,
) -> std::io::Result<Vec<u8>> {
    let mut buf = free_lines_stamped(keys, stamps)?;
    buf.extend_from_slice(crate::control::sync_line(sync).as_bytes());
    buf.push(b'\n');
    Ok(buf)
}

/// Writes all of `buf` to `s` by `deadline`: a socket's write timeout bounds each `write`, not
/// the whole (a peer that reads a little now and then would stretch a `write_all` without
/// end), so each write gets what is left.
pub(super) fn write_within(s: &TcpStream, buf: &[u8], deadline: Instant) -> std::io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                ErrorKind::TimedOut,
                format!(
                    "the control endpoint took {at} of {} bytes by the deadline (it reads too slowly)",
                    buf.len()
                ),
            ));
        }
        s.set_write_timeout(Some(left))?;
        match (&*s).write(&buf[at..]) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(k) => at += k,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads the server's answers on `s` until the one to sync line `n` (`{"synced": m}`, `m >= n`),
/// within `timeout`: then every line written before it was applied. True when the answer says
/// the server applies stamped frees.
///
/// # Errors
/// `PermissionDenied` with the server's reason when it closed the connection for the control
/// token (nothing sent on it was applied); `UnexpectedEof` when it closed without answering;
/// `TimedOut`; `InvalidData` for an answer longer than [`MAX_SYNC_ANSWER_BYTES`].
pub(super) fn confirm(s: &TcpStream, n: u64, timeout: Duration) -> std::io::Result<bool> {
    let deadline = crate::limits::deadline_in(timeout);
    let mut buf: Vec<u8> = Vec::with_capacity(64);
    let mut chunk = [0u8; 512];
    loop {
        while let Some(i) = buf.iter().position(|&b| b == b'\n') {
            match crate::control::parse_answer(&buf[..i]) {
                Some(Answer::Synced(m, stamps)) if m >= n => return Ok(stamps),
                Some(Answer::Unauthorized(reason)) => {
                    return Err(std::io::Error::new(ErrorKind::PermissionDenied, reason))
                }
                // An earlier sync's answer (or one this client never asks for).
                _ => {}
            }
            buf.drain(..=i);
        }
        if buf.len() > MAX_SYNC_ANSWER_BYTES {
            return Err(std::io::Error::new(
                ErrorKind::InvalidData,
                format!("the control endpoint answered a line over {MAX_SYNC_ANSWER_BYTES} bytes"),
            ));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                ErrorKind::TimedOut,
                format!(
                    "the control endpoint did not confirm the frees within {:.1} s",
                    timeout.as_secs_f64()
                ),
            ));
        }
        s.set_read_timeout(Some(left))?;
        match (&*s).read(&mut chunk) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    ErrorKind::UnexpectedEof,
                    "the control endpoint closed the connection before confirming the frees",
                ))
            }
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => return Err(e),
        }
    }
}

/// Sends frees to `endpoint` once, on a new connection, and closes it: `token` first when there
/// is one, then `keys`, then a prefix line for each of `prefixes` (see [`crate::control`]), then
/// a sync line whose answer confirms they were applied. For operators and restarted trainers
/// reclaiming what a dead trainer held; trainers use [`super::ControlClient`].
///
/// # Errors
/// [`Error::InvalidKey`] for a prefix that is not `{store_id}/`, `{store_id}/{sample_id}/` or
/// `{store_id}/{sample_id}/g{gen}/`, and [`Error::Config`] for a token that is not one,
/// before anything is sent; [`Error::Unauthorized`] when the endpoint refused them for the
/// control token; [`Error::FreeNotSent`] when the endpoint cannot be reached, written or heard
/// back from within `timeout`.
pub fn send_frees(
    endpoint: &str,
    token: Option<&str>,
    keys: &[Key],
    prefixes: &[String],
    timeout: Duration,
) -> Result<()> {
    // From the call on: making the lines of many keys (seconds for millions, on a busy host)
    // is part of the call its caller bounded.
    let deadline = crate::limits::deadline_in(timeout);
    for p in prefixes {
        crate::key::check_prefix(p)?;
    }
    if let Some(t) = token {
        check_token(t)?;
    }
    let not_sent = |source: std::io::Error| {
        let pending = keys.len() + prefixes.len();
        if source.kind() == ErrorKind::PermissionDenied {
            return Error::Unauthorized {
                endpoint: endpoint.to_owned(),
                pending,
                reason: source.to_string(),
            };
        }
        Error::FreeNotSent {
            endpoint: endpoint.to_owned(),
            pending,
            source,
        }
    };
    let refs: Vec<&Key> = keys.iter().collect();
    let mut buf = free_lines(&refs).map_err(not_sent)?;
    for p in prefixes {
        buf.extend_from_slice(crate::control::prefix_line(p).as_bytes());
        buf.push(b'\n');
    }
    buf.extend_from_slice(crate::control::sync_line(1).as_bytes());
    buf.push(b'\n');
    let left = deadline.saturating_duration_since(Instant::now());
    let stream = connect(endpoint, token, left.max(Duration::from_millis(1))).map_err(not_sent)?;
    write_within(&stream, &buf, deadline).map_err(not_sent)?;
    let left = deadline.saturating_duration_since(Instant::now());
    let confirmed = confirm(&stream, 1, left.max(Duration::from_millis(1)));
    let _ = stream.shutdown(std::net::Shutdown::Both);
    confirmed.map(|_| ()).map_err(not_sent)
}

/// Checks a token a caller passes before it is sent.
pub(super) fn check_token(t: &str) -> Result<()> {
    if crate::limits::is_valid_token(t) {
        return Ok(());
    }
    Err(Error::Config {
        var: crate::config::ENV_CONTROL_TOKEN,
        reason: "not a control token (16 to 256 characters of A-Z a-z 0-9 . _ ~ + / = -)".into(),
    })
}

/// True when `s`'s send queue has room for `n` more bytes with a wide margin (a quarter of the
/// send buffer, which also pays the kernel's per-buffer overhead), so writing them cannot block.
pub(super) fn has_room(s: &TcpStream, n: usize) -> bool {
    use std::os::fd::AsRawFd;
    let fd = s.as_raw_fd();
    let mut queued: libc::c_int = 0;
    let mut sndbuf: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: FFI on a socket this client owns; each call writes one c_int into a local whose
    // size it is given.
    let ok = unsafe {
        libc::ioctl(fd, libc::TIOCOUTQ, &mut queued as *mut libc::c_int) == 0
            && libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                (&mut sndbuf as *mut libc::c_int).cast(),
                &mut len,
            ) == 0
    };
    ok && queued >= 0 && sndbuf > 0 && (queued as usize).saturating_add(n) <= sndbuf as usize / 4
}

/// The server writes only to answer a stats or sync request, and a `ControlClient` never sends
/// the first and reads every answer to the second before it looks here, so a readable control
/// socket is a closed (or broken) one.
pub(super) fn alive(s: &TcpStream) -> bool {
    if s.set_nonblocking(true).is_err() {
        return false;
    }
    let mut b = [0u8; 1];
    let r = (&*s).read(&mut b);
    let ok = s.set_nonblocking(false).is_ok();
    ok && matches!(r, Err(ref e) if e.kind() == ErrorKind::WouldBlock)
}

#[cfg(test)]
#[path = "../../tests/util/unreachable.rs"]
mod unreachable;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::control_conn::unreachable;

    #[test]
    fn every_address_of_a_name_shares_one_deadline() {
        // Two addresses whose accept queue is full (the kernel drops their SYNs): 0.5 s in
        // all, not 0.5 s each.
        let (endpoint, _held, _listener) = unreachable::unreachable_endpoint();
        let addr: std::net::SocketAddr = endpoint.parse().unwrap();
        let t0 = Instant::now();
        let e = connect_to(&[addr, addr], None, Duration::from_millis(500)).unwrap_err();
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(500) && took < Duration::from_millis(900),
            "{took:?}: {e}"
        );
        // One that never answers leaves the next address its turn.
        let w = crate::Writer::start(&crate::Config {
            arena_bytes: Some(1 << 20),
            ..crate::Config::default()
        })
        .unwrap();
        let live: std::net::SocketAddr = w.arena_ref().control.parse().unwrap();
        connect_to(&[addr, live], None, Duration::from_millis(500)).unwrap();
        // One that does not answer and one that refuses: not a refusal (that would prove the
        // producer gone and drop its frees; the first may be the live producer, loaded).
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let e = connect_to(&[addr, closed], None, Duration::from_millis(500)).unwrap_err();
        assert_ne!(e.kind(), ErrorKind::ConnectionRefused, "{e}");
        let e = connect_to(&[closed, closed], None, Duration::from_millis(500)).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ConnectionRefused, "{e}");
    }
}
