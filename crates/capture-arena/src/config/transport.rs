//! How trainers reach an arena: the transport a producer registers its arena with, the NIXL
//! library and server, and the deadline of one read.

use std::time::Duration;

use super::parse::parse_seconds;
use crate::error::{Error, Result};

/// `SGLANG_SPEC_CAPTURE_TRANSPORT`: how readers reach capture-arena's own arena, `auto` or `nixl`.
pub const ENV_TRANSPORT: &str = "SGLANG_SPEC_CAPTURE_TRANSPORT";
pub use crate::memory::{ENV_NIXL_LIB, ENV_NIXL_SERVER};
/// `SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S`: how long one read through a network transport may take.
pub const ENV_READ_TIMEOUT_S: &str = "SGLANG_SPEC_CAPTURE_READ_TIMEOUT_S";
/// Default of [`ENV_READ_TIMEOUT_S`]: room for a several-GiB sample over TCP.
pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(60);

/// How readers reach capture-arena's own arena (the session its results carry).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ArenaTransport {
    /// The region's own: `shm://` (same-host shared memory) for a host arena, `cuda://` (CUDA
    /// handles) for a device arena.
    #[default]
    Auto,
    /// The region registered with a NIXL agent (`nixl://` sessions): readers on any host reach
    /// it through UCX (TCP, shared memory, RDMA, NVLink). Needs the `nixl` feature.
    Nixl,
}

impl std::str::FromStr for ArenaTransport {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<ArenaTransport, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "shm" | "cuda" => Ok(ArenaTransport::Auto),
            "nixl" => Ok(ArenaTransport::Nixl),
            _ => Err(format!("{s:?} is not one of auto, nixl")),
        }
    }
}

/// The read timeout of network transports: [`ENV_READ_TIMEOUT_S`], else
/// [`DEFAULT_READ_TIMEOUT`].
///
/// # Errors
/// [`Error::Config`] for a value that is not a positive number of seconds.
pub fn read_timeout() -> Result<Duration> {
    match std::env::var(ENV_READ_TIMEOUT_S) {
        Ok(v) if !v.trim().is_empty() => parse_seconds(&v)
            .ok()
            .filter(|d| !d.is_zero())
            .ok_or_else(|| {
                Error::config(
                    ENV_READ_TIMEOUT_S,
                    format!("{v:?} is not a number of seconds > 0; default 60"),
                )
            }),
        _ => Ok(DEFAULT_READ_TIMEOUT),
    }
}

/// The UCX TCP segment size capture-arena's CLI and Python package set (`UCX_TCP_TX_SEG_SIZE`,
/// `UCX_TCP_RX_SEG_SIZE`) when unset, before NIXL loads. Over TCP a READ is emulated: the
/// producer's UCX sends the bytes back in segments of this size, and UCX's default (8 KiB) made
/// 64 MiB reads across hosts 0.58 x a Mooncake TransferEngine's; 512 KiB made them 2.3 x
/// (BENCHMARKS.md, `bench_cluster.py`). Both sides of a connection need the same value.
pub const UCX_TCP_SEG_SIZE: &str = "512k";

/// The command of the NIXL server process from [`ENV_NIXL_SERVER`]: `None` for `inline` or
/// unset (an agent in the producer's process; the CLI and the Python package set a server
/// process when it is unset), else the JSON array's strings (at most 64, each at most 4096 bytes).
///
/// # Errors
/// [`Error::Config`] for anything else.
pub fn nixl_server() -> Result<Option<Vec<String>>> {
    match std::env::var(ENV_NIXL_SERVER) {
        Ok(v) => parse_nixl_server(&v),
        Err(_) => Ok(None),
    }
}

fn parse_nixl_server(v: &str) -> Result<Option<Vec<String>>> {
    let t = v.trim();
    if t.is_empty() || t == "inline" {
        return Ok(None);
    }
    let argv: Vec<String> = serde_json::from_str(t).map_err(|e| {
        Error::config(
            ENV_NIXL_SERVER,
            format!("{t:?} is neither `inline` nor a JSON array of strings ({e})"),
        )
    })?;
    if argv.is_empty() || argv.len() > 64 || argv.iter().any(|a| a.is_empty() || a.len() > 4096) {
        return Err(Error::config(
            ENV_NIXL_SERVER,
            "the command must have 1 to 64 non-empty arguments of at most 4096 bytes",
        ));
    }
    Ok(Some(argv))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_nixl_server_command_is_inline_or_a_bounded_json_array_and_errors_name_the_variable() {
        assert_eq!(parse_nixl_server(" inline ").unwrap(), None);
        assert_eq!(parse_nixl_server("").unwrap(), None);
        assert_eq!(
            parse_nixl_server(r#"["python3", "-m", "capture_arena._nixl_serve"]"#).unwrap(),
            Some(vec![
                "python3".into(),
                "-m".into(),
                "capture_arena._nixl_serve".into()
            ])
        );
        let long = format!(r#"["{}"]"#, "x".repeat(4097));
        let many = serde_json::to_string(&vec!["a"; 65]).unwrap();
        for bad in [
            "python3 -m x",
            "[]",
            r#"[""]"#,
            "[1]",
            long.as_str(),
            many.as_str(),
        ] {
            let e = parse_nixl_server(bad).unwrap_err().to_string();
            assert!(e.contains(ENV_NIXL_SERVER), "{bad:?}: {e}");
        }
    }
}
