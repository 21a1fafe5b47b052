//! The `nixl://` session: what a result carries so that a reader on any host reaches the arena
//! (the producer's agent, its metadata, the registered span), parsed only in its canonical form,
//! every field checked before anything is allocated for it.

use std::fmt;
use std::str::FromStr;

use base64::Engine as _;
use nixl_sys::{MemType, MemoryRegion, NixlDescriptor};

use crate::error::{Error, Result};
use crate::memory::SessionParts;

/// The longest NIXL session accepted: room for the metadata of a host with several RDMA NICs
/// (one NIC over TCP and shared memory is about 480 bytes of metadata, 650 in the session).
pub const MAX_NIXL_SESSION_BYTES: usize = 8192;
/// The longest metadata accepted in a session, decoded.
pub(super) const MAX_METADATA_BYTES: usize = 6000;
/// How the serialized metadata of an agent starts: NIXL's serializer tag, then the agent's name
/// as `Agent`, a little-endian u64 length, the bytes and `|`.
pub(super) const METADATA_PREFIX: &[u8] = b"nixlSerDes|Agent";

/// The memory kind of a NIXL region, as its session names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NixlMem {
    /// Host memory.
    Dram,
    /// GPU memory (device `dev` of the session).
    Vram,
}

impl NixlMem {
    pub(super) fn name(self) -> &'static str {
        match self {
            NixlMem::Dram => "dram",
            NixlMem::Vram => "vram",
        }
    }

    pub(crate) fn mem_type(self) -> MemType {
        match self {
            NixlMem::Dram => MemType::Dram,
            NixlMem::Vram => MemType::Vram,
        }
    }
}

/// One span of memory to register or transfer: what NIXL's descriptor traits ask for.
#[derive(Debug)]
pub(crate) struct Span {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) mem: NixlMem,
    pub(crate) dev: u64,
}

impl MemoryRegion for Span {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as usize as *const u8
    }
    fn size(&self) -> usize {
        self.len as usize
    }
}

impl NixlDescriptor for Span {
    fn mem_type(&self) -> MemType {
        self.mem.mem_type()
    }
    fn device_id(&self) -> u64 {
        self.dev
    }
}

/// A parsed NIXL session:
/// `nixl://<host>/<agent>?len=<bytes>&base=<hex>&mem=dram|vram&dev=<n>&md=<base64url>`.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct NixlSession {
    /// The producer's host (for messages; the metadata holds the addresses UCX connects to).
    pub host: String,
    /// The producer's agent name: `capture-arena-<pid>-<32 hex digits>`.
    pub agent: String,
    /// The producer's address of byte 0 (published addresses are `base + offset`).
    pub base: u64,
    /// Bytes of the arena.
    pub len: u64,
    /// Host or device memory.
    pub mem: NixlMem,
    /// The device id registered (the GPU ordinal for VRAM, 0 for host memory).
    pub dev: u32,
    /// The agent's metadata (`get_local_md`), decoded.
    pub metadata: Vec<u8>,
}

impl fmt::Debug for NixlSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NixlSession")
            .field("host", &self.host)
            .field("agent", &self.agent)
            .field("base", &format_args!("{:#x}", self.base))
            .field("len", &self.len)
            .field("mem", &self.mem)
            .field("dev", &self.dev)
            .field("metadata_bytes", &self.metadata.len())
            .finish()
    }
}

pub(super) fn b64() -> base64::engine::GeneralPurpose {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
}

impl fmt::Display for NixlSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "nixl://{}/{}?len={}&base={:#x}&mem={}&dev={}&md={}",
            self.host,
            self.agent,
            self.len,
            self.base,
            self.mem.name(),
            self.dev,
            b64().encode(&self.metadata)
        )
    }
}

/// True for an agent name this crate makes: `capture-arena-<pid>-<32 lower-case hex digits>`.
pub(super) fn agent_ok(name: &str) -> bool {
    name.strip_prefix("capture-arena-")
        .and_then(|r| r.split_once('-'))
        .is_some_and(|(pid, nonce)| {
            !pid.is_empty()
                && pid.len() <= 10
                && pid.bytes().all(|b| b.is_ascii_digit())
                && nonce.len() == 32
                && nonce
                    .bytes()
                    .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        })
}

/// True when serialized metadata names `agent` as its agent (checked before NIXL parses it, so
/// metadata of another agent, or bytes that are not metadata at all, never reach it).
pub(super) fn metadata_names(metadata: &[u8], agent: &str) -> bool {
    let Some(rest) = metadata.strip_prefix(METADATA_PREFIX) else {
        return false;
    };
    let Some((len, rest)) = rest.split_first_chunk::<8>() else {
        return false;
    };
    u64::from_le_bytes(*len) == agent.len() as u64
        && rest
            .strip_prefix(agent.as_bytes())
            .is_some_and(|r| r.first() == Some(&b'|'))
}

impl FromStr for NixlSession {
    type Err = Error;

    /// Parses only the canonical form [`fmt::Display`] writes, checking every field (and that
    /// the metadata names the session's agent) before anything is allocated for it.
    fn from_str(s: &str) -> Result<NixlSession> {
        let bad = |why: &str| Error::InvalidSession {
            session: s.chars().take(256).collect(),
            reason: format!(
                "{why}; expected nixl://<host>/capture-arena-<pid>-<nonce>?len=<bytes>&base=<hex>\
                 &mem=dram|vram&dev=<n>&md=<base64url>"
            ),
        };
        if s.len() > MAX_NIXL_SESSION_BYTES {
            return Err(bad(&format!("longer than {MAX_NIXL_SESSION_BYTES} bytes")));
        }
        let mut q = SessionParts::split(s, "nixl://").map_err(|why| bad(&why))?;
        let (host, agent) = (q.host, q.id);
        if !agent_ok(agent) {
            return Err(bad("bad agent name"));
        }
        let (len, base) = q.len_and_base().map_err(|why| bad(&why))?;
        let mem = match q.next("mem").map_err(|why| bad(&why))? {
            "dram" => NixlMem::Dram,
            "vram" => NixlMem::Vram,
            _ => return Err(bad("mem must be dram or vram")),
        };
        let dev: u32 = q
            .next("dev")
            .map_err(|why| bad(&why))?
            .parse()
            .map_err(|_| bad("bad dev"))?;
        let md = q.next("md").map_err(|why| bad(&why))?;
        if md.len() > MAX_METADATA_BYTES.div_ceil(3) * 4 {
            return Err(bad("metadata too long"));
        }
        let metadata = b64().decode(md).map_err(|_| bad("md is not base64url"))?;
        if metadata.len() > MAX_METADATA_BYTES || !metadata_names(&metadata, agent) {
            return Err(bad("md is not the metadata of this agent"));
        }
        q.finish().map_err(|why| bad(&why))?;
        let parsed = NixlSession {
            host: host.to_owned(),
            agent: agent.to_owned(),
            base,
            len,
            mem,
            dev,
            metadata,
        };
        if parsed.to_string() != s {
            return Err(bad("not in canonical form"));
        }
        Ok(parsed)
    }
}

/// The session text of `span` served by agent `name` on `host`, checked against the bounds a
/// reader enforces.
pub(super) fn describe(name: &str, span: &Span, metadata: Vec<u8>, host: &str) -> Result<String> {
    let session = NixlSession {
        host: host.to_owned(),
        agent: name.to_owned(),
        base: span.addr,
        len: span.len,
        mem: span.mem,
        dev: span.dev as u32,
        metadata,
    };
    let text = session.to_string();
    if text.len() > MAX_NIXL_SESSION_BYTES || session.metadata.len() > MAX_METADATA_BYTES {
        return Err(Error::transport(
            "describing the NIXL arena",
            format!(
                "the session would be {} bytes (at most {MAX_NIXL_SESSION_BYTES}) with {} \
                 bytes of agent metadata (at most {MAX_METADATA_BYTES}); limit the UCX \
                 devices (UCX_NET_DEVICES, UCX_TLS) or shorten \
                 SGLANG_SPEC_CAPTURE_CONTROL_HOST",
                text.len(),
                session.metadata.len()
            ),
        ));
    }
    if !metadata_names(&session.metadata, &session.agent) {
        return Err(Error::transport(
            "describing the NIXL arena",
            "the agent's metadata does not start as NIXL 1.5 writes it (another NIXL version?)",
        ));
    }
    tracing::info!(
        agent = %session.agent,
        bytes = span.len,
        metadata_bytes = session.metadata.len(),
        "arena registered with NIXL"
    );
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata(agent: &str) -> Vec<u8> {
        let mut m = METADATA_PREFIX.to_vec();
        m.extend_from_slice(&(agent.len() as u64).to_le_bytes());
        m.extend_from_slice(agent.as_bytes());
        m.extend_from_slice(b"|Conns\x08\x00rest of it");
        m
    }

    fn session() -> NixlSession {
        let agent = format!("capture-arena-42-{:032x}", 7u128);
        NixlSession {
            host: "node-1".into(),
            metadata: metadata(&agent),
            agent,
            base: 0x7f00_0000_1000,
            len: 1 << 20,
            mem: NixlMem::Dram,
            dev: 0,
        }
    }

    #[test]
    fn sessions_round_trip_in_canonical_form_only() {
        let s = session();
        let text = s.to_string();
        assert!(
            text.starts_with("nixl://node-1/capture-arena-42-"),
            "{text}"
        );
        assert_eq!(text.parse::<NixlSession>().unwrap(), s);
        let vram = NixlSession {
            mem: NixlMem::Vram,
            dev: 3,
            ..s.clone()
        };
        assert_eq!(vram.to_string().parse::<NixlSession>().unwrap(), vram);
        for bad in [
            text.replace("base=0x", "base="),
            text.replace("len=1048576", "len=0"),
            text.replace("mem=dram", "mem=disk"),
            text.replace("dev=0", "dev=-1"),
            text.replace("node-1", "node 1"),
            text.replace("capture-arena-42-", "other-42-"),
            format!("{text}&x=1"),
            format!("{text}="),
            text.replace("nixl://", "shm://"),
            text.replace("&md=", "&md=!"),
            format!(
                "{}&md={}",
                text.split("&md=").next().unwrap(),
                "A".repeat(9000)
            ),
        ] {
            assert!(bad.parse::<NixlSession>().is_err(), "accepted {bad}");
        }
    }

    #[test]
    fn metadata_of_another_agent_is_refused_before_nixl_sees_it() {
        let s = session();
        let other = format!("capture-arena-42-{:032x}", 8u128);
        let forged = NixlSession {
            metadata: metadata(&other),
            ..s.clone()
        };
        assert!(forged.to_string().parse::<NixlSession>().is_err());
        assert!(metadata_names(&s.metadata, &s.agent));
        assert!(!metadata_names(&s.metadata[..20], &s.agent));
        assert!(!metadata_names(b"", &s.agent));
        let mut long = s.metadata.clone();
        long[16] = 0xff;
        assert!(!metadata_names(&long, &s.agent));
    }

    #[test]
    fn base_plus_len_may_not_overflow() {
        let s = NixlSession {
            base: u64::MAX - 10,
            ..session()
        };
        assert!(s.to_string().parse::<NixlSession>().is_err());
    }
}
