//! The session string of a device arena: how a reader reaches the allocation's handle.

use std::fmt;
use std::str::FromStr;

use super::driver::HandleType;
use crate::error::{Error, Result};
use crate::memory::SessionParts;
use crate::memory::REPLY_ENDPOINT_PREFIX as ENDPOINT_PREFIX;

/// The longest device session accepted (a fabric one is about 300 bytes).
pub const MAX_CUDA_SESSION_BYTES: usize = 1024;

/// A parsed device session:
/// `cuda://<host>/<pid>-<nonce>?len=<bytes>&base=<hex>&dev=<uuid>&handle=fd&reply=<endpoint>`,
/// or with `handle=fabric&fabric=<128 hex digits>` (the reply endpoint then only serves local
/// readers' liveness checks).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CudaSession {
    /// The producer's host name (POSIX-fd handles reach only processes there).
    pub host: String,
    /// The producer's process id.
    pub pid: u32,
    /// The per-arena nonce.
    pub nonce: u128,
    /// Bytes of the allocation.
    pub len: u64,
    /// The producer's device address of byte 0 (what published addresses are relative to).
    pub base: u64,
    /// The UUID of the GPU the arena lives on (32 hex digits).
    pub device_uuid: String,
    /// How the handle is exported.
    pub handle: HandleType,
    /// The fabric handle, for `handle=fabric`.
    pub fabric: Option<[u8; 64]>,
    /// The writer's local reply endpoint (`@capture-arena-reply-...`).
    pub reply: String,
}

impl fmt::Display for CudaSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "cuda://{}/{}-{:032x}?len={}&base={:#x}&dev={}&handle={}",
            self.host,
            self.pid,
            self.nonce,
            self.len,
            self.base,
            self.device_uuid,
            self.handle.name()
        )?;
        if let Some(h) = &self.fabric {
            f.write_str("&fabric=")?;
            for b in h {
                write!(f, "{b:02x}")?;
            }
        }
        write!(f, "&reply={}", self.reply)
    }
}

fn is_hex(s: &str, n: usize) -> bool {
    s.len() == n && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

impl FromStr for CudaSession {
    type Err = Error;

    /// Parses only the canonical form [`fmt::Display`] writes (so one arena has one session
    /// string), checking every field's syntax and length before anything is allocated for it.
    fn from_str(s: &str) -> Result<CudaSession> {
        let bad = |why: &str| Error::InvalidSession {
            session: s.chars().take(MAX_CUDA_SESSION_BYTES).collect(),
            reason: format!(
                "{why}; expected cuda://<host>/<pid>-<nonce>?len=<bytes>&base=<hex>&dev=<uuid>\
                 &handle=fd|fabric[&fabric=<128 hex>]&reply=@capture-arena-reply-..."
            ),
        };
        if s.len() > MAX_CUDA_SESSION_BYTES {
            return Err(bad("too long"));
        }
        let mut q = SessionParts::split(s, "cuda://").map_err(|why| bad(&why))?;
        let (host, id) = (q.host, q.id);
        let (pid, nonce) = id.split_once('-').ok_or_else(|| bad("no <pid>-<nonce>"))?;
        let pid: u32 = pid
            .parse()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| bad("bad pid"))?;
        if !is_hex(nonce, 32) {
            return Err(bad("the nonce must be 32 lower-case hex digits"));
        }
        let nonce = u128::from_str_radix(nonce, 16).map_err(|_| bad("bad nonce"))?;
        let (len, base) = q.len_and_base().map_err(|why| bad(&why))?;
        let dev = q.next("dev").map_err(|why| bad(&why))?;
        if !is_hex(dev, 32) {
            return Err(bad(
                "dev must be the GPU's UUID as 32 lower-case hex digits",
            ));
        }
        let handle = match q.next("handle").map_err(|why| bad(&why))? {
            "fd" => HandleType::PosixFd,
            "fabric" => HandleType::Fabric,
            _ => return Err(bad("handle must be fd or fabric")),
        };
        let fabric = if handle == HandleType::Fabric {
            let h = q.next("fabric").map_err(|why| bad(&why))?;
            if !is_hex(h, 128) {
                return Err(bad("fabric must be 128 lower-case hex digits"));
            }
            let mut out = [0u8; 64];
            for (i, o) in out.iter_mut().enumerate() {
                *o = u8::from_str_radix(&h[2 * i..2 * i + 2], 16).map_err(|_| bad("bad fabric"))?;
            }
            Some(out)
        } else {
            None
        };
        let reply = q.next("reply").map_err(|why| bad(&why))?;
        // The producer's own endpoint: `@capture-arena-reply-<pid>-<32 hex digits>`.
        let reply_ok = reply
            .strip_prefix(ENDPOINT_PREFIX)
            .and_then(|r| r.strip_prefix(&format!("{pid}-")))
            .is_some_and(|n| is_hex(n, 32));
        if !reply_ok {
            return Err(bad("bad reply endpoint"));
        }
        q.finish().map_err(|why| bad(&why))?;
        let parsed = CudaSession {
            host: host.to_owned(),
            pid,
            nonce,
            len,
            base,
            device_uuid: dev.to_owned(),
            handle,
            fabric,
            reply: reply.to_owned(),
        };
        if parsed.to_string() != s {
            return Err(bad("not in canonical form"));
        }
        Ok(parsed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(handle: HandleType) -> CudaSession {
        CudaSession {
            host: "node-1.example".into(),
            pid: 4242,
            nonce: 0x0123_4567_89ab_cdef_0011_2233_4455_6677,
            len: 1 << 30,
            base: 0x7f00_0000_0000,
            device_uuid: "00112233445566778899aabbccddeeff".into(),
            handle,
            fabric: (handle == HandleType::Fabric).then_some([0xab; 64]),
            reply: format!("{ENDPOINT_PREFIX}4242-{}", "0f".repeat(16)),
        }
    }

    #[test]
    fn round_trips_both_handle_types() {
        for h in [HandleType::PosixFd, HandleType::Fabric] {
            let s = sample(h);
            let text = s.to_string();
            assert!(text.len() <= MAX_CUDA_SESSION_BYTES);
            assert_eq!(text.parse::<CudaSession>().unwrap(), s, "{text}");
        }
    }

    #[test]
    fn refuses_everything_else() {
        let good = sample(HandleType::PosixFd).to_string();
        let fab = sample(HandleType::Fabric).to_string();
        let cases = [
            good.replace("cuda://", "shm://"),
            good.replace("node-1.example", "no de"),
            good.replace("4242-", "0-"),
            good.replace("len=1073741824", "len=0"),
            good.replace("base=0x7f0000000000", "base=0xffffffffffffffff"),
            good.replace("&dev=", "&device="),
            good.replace("handle=fd", "handle=ipc"),
            good.replace("&reply=@capture-arena-reply-", "&reply=@other-"),
            good.replace(
                "&reply=@capture-arena-reply-4242-",
                "&reply=@capture-arena-reply-4243-",
            ),
            format!("{good}&extra=1"),
            good.replace("base=0x7f0000000000", "base=0x07f0000000000"),
            fab.replace(&"ab".repeat(64), &"ab".repeat(63)),
            fab.replace(&"ab".repeat(64), &"AB".repeat(64)),
            "cuda://".to_owned() + &"a".repeat(MAX_CUDA_SESSION_BYTES),
            String::new(),
        ];
        for c in cases {
            assert!(c.parse::<CudaSession>().is_err(), "accepted {c:?}");
        }
    }

    #[test]
    fn host_name_is_plain() {
        assert!(crate::memory::host_ok(&crate::memory::this_host()));
    }
}
