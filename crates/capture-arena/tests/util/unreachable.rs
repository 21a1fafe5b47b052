//! A TCP endpoint on loopback that never completes a connection, shared by the integration
//! tests (`util`) and the client's unit tests (included by path).

use std::net::TcpStream;
use std::time::Duration;

/// A listener with a full backlog that never accepts: connects to it hang until their timeout
/// (a dead host, as seen from a trainer). Returns the address and what keeps the backlog full.
pub fn unreachable_endpoint() -> (String, Vec<TcpStream>, std::net::TcpListener) {
    use std::os::fd::FromRawFd;
    // SAFETY: plain FFI creating, binding and listening on a socket we then own.
    let listener = unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0);
        let mut a: libc::sockaddr_in = std::mem::zeroed();
        a.sin_family = libc::AF_INET as libc::sa_family_t;
        a.sin_addr.s_addr = u32::from_be_bytes([127, 0, 0, 1]).to_be();
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        assert_eq!(
            libc::bind(fd, (&a as *const libc::sockaddr_in).cast(), len),
            0
        );
        assert_eq!(libc::listen(fd, 0), 0);
        std::net::TcpListener::from_raw_fd(fd)
    };
    let addr = listener.local_addr().unwrap();
    let held: Vec<TcpStream> = (0..4)
        .filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok())
        .collect();
    assert!(
        TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err(),
        "the backlog is full"
    );
    (addr.to_string(), held, listener)
}
