//! Random bits from the kernel, for names, tokens and stamps no other process guesses or reuses.

use std::io;

use crate::error::{Error, Result};

/// 128 random bits from the kernel, for names no other process guesses or reuses.
pub(crate) fn nonce() -> Result<u128> {
    let mut buf = [0u8; 16];
    let mut got = 0;
    while got < buf.len() {
        // SAFETY: writes at most buf.len() - got bytes into the tail of buf.
        let n = unsafe { libc::getrandom(buf[got..].as_mut_ptr().cast(), buf.len() - got, 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::io("getrandom for the arena nonce", e));
        }
        got += n as usize;
    }
    Ok(u128::from_le_bytes(buf))
}
