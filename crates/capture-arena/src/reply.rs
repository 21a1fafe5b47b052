//! The local reply path: a Unix-domain socket, served by the writer's event loop, through which a
//! reader on the same host asks the producer's region for what a transport needs and the one-way
//! control protocol cannot carry: a file descriptor (passed with `SCM_RIGHTS`) or metadata.
//!
//! The socket lives in the abstract namespace (`@capture-arena-reply-<pid>-<nonce>`), so a
//! producer killed outright leaves no file behind. Only processes of the producer's own user are
//! answered (checked with `SO_PEERCRED`); anyone else is closed on.
//!
//! Protocol, one exchange per connection:
//! - the reader writes one request line, the name of what it wants (`fd`, `describe`; at most
//!   [`MAX_REQUEST_BYTES`] bytes), ending in `\n`;
//! - the writer answers with one header line, `{"ok": true, "len": N, "fds": K}\n` (the `K`
//!   descriptors ride on the message that carries it) followed by `N` bytes, or
//!   `{"ok": false, "error": "..."}\n`, and closes the connection.
//!
//! Frees never go this way: they stay one-way lines to the TCP control endpoint.

use std::io::{self, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::memory::Reply;

/// The longest request line.
pub const MAX_REQUEST_BYTES: usize = 256;
/// The longest answer a reader accepts.
pub const MAX_REPLY_BYTES: usize = 1 << 20;
/// The most descriptors one answer carries.
pub const MAX_REPLY_FDS: usize = 8;
/// The prefix of every reply endpoint (named in [`crate::memory`], whose sessions carry it).
pub use crate::memory::REPLY_ENDPOINT_PREFIX as ENDPOINT_PREFIX;

/// The abstract socket address of an endpoint string (`@name`).
pub(crate) fn address(endpoint: &str) -> io::Result<SocketAddr> {
    let name = endpoint.strip_prefix('@').ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("reply endpoint {endpoint:?} is not an abstract socket name (@...)"),
        )
    })?;
    SocketAddr::from_abstract_name(name.as_bytes())
}

/// The user id of the process at the other end of `fd`.
pub(crate) fn peer_uid(fd: RawFd) -> io::Result<u32> {
    peer_cred(fd).map(|(uid, _)| uid)
}

/// The user id and process id at the other end of `fd`.
fn peer_cred(fd: RawFd) -> io::Result<(u32, u32)> {
    // SAFETY: getsockopt fills a zeroed ucred of the size passed.
    unsafe {
        let mut cred: libc::ucred = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        let rc = libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        );
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok((cred.uid, u32::try_from(cred.pid).unwrap_or(0)))
    }
}

/// This process's effective user id.
pub(crate) fn my_uid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

/// Sends `bytes` on a connected Unix socket with `fds` attached, in one `sendmsg`.
///
/// # Errors
/// The `sendmsg` error, or `WriteZero` if only part of `bytes` was taken (answers are small, so
/// a socket that cannot take one at once is given up on).
pub(crate) fn send_with_fds(sock: RawFd, bytes: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let fds = &fds[..fds.len().min(MAX_REPLY_FDS)];
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // Room for MAX_REPLY_FDS descriptors, aligned for cmsghdr.
    let mut cbuf = [0u64; 8];
    // SAFETY: a zeroed msghdr pointing at one iovec over `bytes` (read only by sendmsg) and at a
    // control buffer large enough for the descriptors (CMSG_SPACE of MAX_REPLY_FDS ints is 48
    // bytes < 64), filled through the CMSG macros.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if !fds.is_empty() {
            let payload = std::mem::size_of_val(fds) as u32;
            msg.msg_control = cbuf.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(payload) as usize;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(payload) as usize;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(c),
                payload as usize,
            );
        }
        let n = libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT);
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n as usize != bytes.len() {
            return Err(io::Error::from(io::ErrorKind::WriteZero));
        }
    }
    Ok(())
}

/// Receives up to `buf.len()` bytes and any descriptors attached to them.
fn recv_with_fds(sock: RawFd, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 8];
    // SAFETY: a zeroed msghdr over one iovec of `buf` and a 64-byte control buffer; recvmsg
    // writes at most their lengths. Descriptors received (SCM_RIGHTS) are new descriptors of
    // this process that nothing else owns: each is wrapped in an OwnedFd exactly once.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&cbuf);
        let n = libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC);
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let count =
                    ((*c).cmsg_len - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
        Ok(n as usize)
    }
}

/// False once the producer `pid` (where given) no longer listens on `endpoint`: its writer
/// stopped or its process is gone (abstract sockets vanish with their process). One `connect`,
/// answered by the writer as an empty request; never a wait: a producer that accepts nothing
/// (stopped, its queue of connections full) still listens. A listener of another user (the
/// name is free to bind once its process is gone), or one that was `pid`'s and outlived it (a
/// child it forked holds the socket: credentials are the listener's), is not the producer.
pub fn is_listening(endpoint: &str, pid: Option<u32>) -> bool {
    match connect_within(endpoint, None) {
        Ok(s) => match peer_cred(s.as_raw_fd()) {
            Ok((uid, peer)) => uid == my_uid() && pid.is_none_or(|p| p == peer && alive(p)),
            Err(_) => true, // cannot be told: as listening
        },
        Err(e) => !matches!(
            e.kind(),
            io::ErrorKind::ConnectionRefused
                | io::ErrorKind::NotFound
                | io::ErrorKind::InvalidInput
        ),
    }
}

/// Whether process `pid` exists (a signal could be sent to it, or it is another user's).
fn alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 sends nothing; it only checks that the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Connects to the abstract socket `endpoint` (`@...`) without waiting past `within` (`None`:
/// one try): a blocking connect to a listener whose queue of connections not yet accepted is
/// full (its process stopped or stuck; each probe adds one) waits for good. The stream is
/// blocking again when returned.
fn connect_within(endpoint: &str, within: Option<Duration>) -> io::Result<UnixStream> {
    let addr = address(endpoint)?;
    let name = addr.as_abstract_name().unwrap_or_default();
    // SAFETY: a zeroed sockaddr_un is a valid value; it is filled within its size below.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    if name.len() >= sa.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("reply endpoint {endpoint:?} is too long"),
        ));
    }
    for (slot, &b) in sa.sun_path[1..].iter_mut().zip(name) {
        *slot = b as libc::c_char; // sun_path[0] stays 0: the abstract namespace
    }
    let len = (std::mem::size_of::<libc::sa_family_t>() + 1 + name.len()) as libc::socklen_t;
    // SAFETY: plain FFI creating a socket; the descriptor is owned at once.
    let raw = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a new descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    let deadline = within.map(crate::limits::deadline_in);
    let mut pause = Duration::from_micros(100);
    loop {
        // SAFETY: `sa` is a filled sockaddr_un and `len` covers its family and name only.
        let r = unsafe {
            libc::connect(
                fd.as_raw_fd(),
                (&sa as *const libc::sockaddr_un).cast(),
                len,
            )
        };
        if r == 0 {
            break;
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => {}
            Some(libc::EAGAIN) => {
                let left = deadline.map_or(Duration::ZERO, |d| {
                    d.saturating_duration_since(Instant::now())
                });
                if left.is_zero() {
                    return Err(io::Error::new(
                        io::ErrorKind::WouldBlock,
                        format!(
                            "{endpoint} accepts no connection (its queue is full: the producer \
                             is stopped or stuck){}",
                            within.map_or(String::new(), |w| format!(" within {w:?}"))
                        ),
                    ));
                }
                std::thread::sleep(pause.min(left));
                pause = (pause * 2).min(Duration::from_millis(10));
            }
            _ => return Err(e),
        }
    }
    let s = UnixStream::from(fd);
    s.set_nonblocking(false)?;
    Ok(s)
}

/// Asks the producer behind `endpoint` (`@capture-arena-reply-...`) for `what` and returns its
/// answer: bytes and descriptors. Gives up after `timeout`, in all (a producer that trickles its
/// answer does not stretch it).
///
/// # Errors
/// [`Error::Io`] if the endpoint cannot be reached or answers out of protocol;
/// [`Error::InvalidRead`] if the producer refuses the request.
pub fn request(endpoint: &str, what: &str, timeout: Duration) -> Result<Reply> {
    request_from(endpoint, what, timeout, None)
}

/// As [`request`], answered only by a process of this user and, with `pid`, only by that
/// process (checked with `SO_PEERCRED` before anything is read from it): abstract socket names
/// carry no permissions, so anyone on the host could bind a producer's name.
///
/// # Errors
/// As [`request`]; [`Error::Io`] (`PermissionDenied`) for another user or process.
pub fn request_from(
    endpoint: &str,
    what: &str,
    timeout: Duration,
    pid: Option<u32>,
) -> Result<Reply> {
    let io_err = |e: io::Error| Error::io(format!("asking {endpoint} for {what:?}"), e);
    if what.len() >= MAX_REQUEST_BYTES || what.contains('\n') {
        return Err(io_err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "request too long or multi-line",
        )));
    }
    let deadline = crate::limits::deadline_in(timeout);
    // What is left of the deadline, for the next read or write: never zero (no timeout at all
    // to the socket), an error once it has passed.
    let left = || {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no whole answer within {timeout:?}"),
            ));
        }
        Ok(left)
    };
    let mut s = connect_within(endpoint, Some(timeout)).map_err(io_err)?;
    let (uid, peer) = peer_cred(s.as_raw_fd()).map_err(io_err)?;
    if uid != my_uid() || pid.is_some_and(|p| p != peer) {
        return Err(io_err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the endpoint is served by pid {peer} of uid {uid}, not by the producer{}",
                pid.map(|p| format!(" (pid {p})")).unwrap_or_default()
            ),
        )));
    }
    s.set_write_timeout(Some(left().map_err(io_err)?))
        .map_err(io_err)?;
    std::io::Write::write_all(&mut s, format!("{what}\n").as_bytes()).map_err(io_err)?;
    // The header line, with the descriptors riding on it.
    let mut fds = Vec::new();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let newline = loop {
        s.set_read_timeout(Some(left().map_err(io_err)?))
            .map_err(io_err)?;
        let n = recv_with_fds(s.as_raw_fd(), &mut buf, &mut fds).map_err(io_err)?;
        if n == 0 {
            return Err(io_err(io::Error::from(io::ErrorKind::UnexpectedEof)));
        }
        got.extend_from_slice(&buf[..n]);
        if let Some(i) = got.iter().position(|&b| b == b'\n') {
            break i;
        }
        if got.len() > 4096 || fds.len() > MAX_REPLY_FDS {
            return Err(io_err(io::Error::other("answer header too long")));
        }
    };
    let header: serde_json::Value = serde_json::from_slice(&got[..newline])
        .map_err(|e| io_err(io::Error::other(format!("bad answer header: {e}"))))?;
    if header["ok"] != serde_json::Value::Bool(true) {
        return Err(Error::InvalidRead {
            key: endpoint.to_owned(),
            reason: format!(
                "the producer refused {what:?}: {}",
                header["error"].as_str().unwrap_or("no reason given")
            ),
        });
    }
    let len = header["len"]
        .as_u64()
        .and_then(|l| usize::try_from(l).ok())
        .filter(|&l| l <= MAX_REPLY_BYTES)
        .ok_or_else(|| io_err(io::Error::other("bad answer length")))?;
    let mut bytes = got.split_off(newline + 1);
    if bytes.len() > len {
        return Err(io_err(io::Error::other("answer longer than announced")));
    }
    let mut rest = vec![0u8; len - bytes.len()];
    let mut filled = 0;
    while filled < rest.len() {
        s.set_read_timeout(Some(left().map_err(io_err)?))
            .map_err(io_err)?;
        match s.read(&mut rest[filled..]) {
            Ok(0) => return Err(io_err(io::Error::from(io::ErrorKind::UnexpectedEof))),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err(e)),
        }
    }
    bytes.extend_from_slice(&rest);
    Ok(Reply { bytes, fds })
}

/// The header and body of an answer, ready to send.
pub(crate) fn encode(answer: &Result<Reply>) -> Vec<u8> {
    match answer {
        Ok(r) => {
            let mut out = serde_json::json!({"ok": true, "len": r.bytes.len(), "fds": r.fds.len()})
                .to_string()
                .into_bytes();
            out.push(b'\n');
            out.extend_from_slice(&r.bytes);
            out
        }
        Err(e) => {
            let mut out = serde_json::json!({"ok": false, "error": e.to_string()})
                .to_string()
                .into_bytes();
            out.push(b'\n');
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listener() -> (std::os::unix::net::UnixListener, String) {
        let name = format!(
            "capture-arena-reply-test-{}-{:x}",
            std::process::id(),
            crate::random::nonce().unwrap()
        );
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        (
            std::os::unix::net::UnixListener::bind_addr(&addr).unwrap(),
            format!("@{name}"),
        )
    }

    #[test]
    fn a_listener_is_the_producers_only_if_it_is_the_producer_and_alive() {
        let (l, endpoint) = listener();
        let me = std::process::id();
        assert!(is_listening(&endpoint, None));
        assert!(is_listening(&endpoint, Some(me)));
        // Before: any listener on the name counted, so a producer whose socket outlived it (a
        // forked child holds it) or a name bound again stayed live for good, and its device
        // memory imported. Here the name is this process's, not the producer's.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        assert!(!is_listening(&endpoint, Some(gone)));
        drop(l);
        assert!(!is_listening(&endpoint, Some(me)) && !is_listening(&endpoint, None));
    }
}
