//! Bounds every input is checked against before it costs memory, shared by the modules that
//! parse (the control protocol, results, settings) so none imports another for them.

/// The longest line accepted; a longer one closes its connection. One MiB holds 25,574 keys of
/// 41 bytes (`free_latency`'s).
pub const MAX_LINE_BYTES: usize = 1 << 20;

/// The shortest and longest token accepted.
pub const TOKEN_BYTES: std::ops::RangeInclusive<usize> = 16..=256;

/// True for a token this protocol carries: 16 to 256 bytes of `A-Z a-z 0-9 . _ ~ + / = -` (no
/// byte needs escaping in JSON, a URL or a shell).
pub fn is_valid_token(t: &str) -> bool {
    TOKEN_BYTES.contains(&t.len())
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-_~+/=".contains(&b))
}

/// The instant `within` from now; a year from now for a bound too large to add (a caller's
/// timeout of `1e19` seconds is a wait, never an overflow panic).
pub fn deadline_in(within: std::time::Duration) -> std::time::Instant {
    let now = std::time::Instant::now();
    now.checked_add(within)
        .unwrap_or_else(|| now + std::time::Duration::from_secs(86_400 * 365))
}
