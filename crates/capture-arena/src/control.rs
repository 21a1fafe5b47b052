//! The control protocol: clients free objects by writing lines to a TCP endpoint, each line a JSON
//! array of key strings followed by `\n`. Frees are one-way: the server never answers them.
//!
//! This module holds the parts that do not depend on the event loop: binding the listener, the
//! per-connection line buffer and the line parser. The writer's loop (in `writer`) drives them.
//!
//! Rules:
//! - a line is everything up to `\n` (a trailing `\r` and surrounding whitespace are ignored;
//!   blank lines are skipped);
//! - a line that is not a JSON array of strings is counted as bad and logged; other lines and
//!   connections go on;
//! - a line longer than [`MAX_LINE_BYTES`] closes its connection;
//! - bytes after the last `\n` of a closed connection are a partial line: discarded and counted.
//!
//! - with a control token ([`crate::config::Config::control_token`]), a connection's first
//!   non-blank line must be `{"token": "<token>"}` (at most 512 bytes, within the line timeout);
//!   until it is, no line is applied, and any other line closes the connection (counted in
//!   `unauthorized_lines`). A server without a token counts a token
//!   line as one bad line and goes on, so a client may always send it. Frees stay one-way.
//!
//! - an extension for operators and restarted trainers: a line `{"free_prefix": "<prefix>"}`
//!   frees every resident object whose key starts with the prefix (`{store_id}/`,
//!   `{store_id}/{sample_id}/` or `{store_id}/{sample_id}/g{gen}/`, see
//!   [`crate::key::check_prefix`]); JSON-array lines are unchanged, and a server without the
//!   extension counts such a line as one bad line.
//!
//! - a query for operators (`capture-arena stats`/`top`): a line `{"stats": true}` is answered
//!   with one line on the same connection, a [`StatsReport`] as JSON: the writer's counters as
//!   they are after the lines sent before it, and the per-`store_id` table (the
//!   [`STATS_STORES`] largest), remade at most once per [`STATS_TABLE_INTERVAL`] while objects
//!   come and go (so at most that old; its ages are current). It needs the token like a free. A
//!   connection is answered at most once per [`STATS_INTERVAL`], and the server answers at most
//!   [`STATS_ANSWERS_PER_SECOND`] requests a second in all; a request beyond either is counted as
//!   a bad line and not answered.
//!
//! - a delivery confirmation for clients: a line `{"sync": n}` (n an integer) is answered with
//!   `{"synced": n}` on the same connection once every line the connection sent before it was
//!   applied (lines of one connection are applied in order). A turn answers only its last sync
//!   line. It needs the token like a free.
//! - a connection closed for the control token is told why before it is closed, in one line
//!   `{"error": "unauthorized", "reason": ...}` (best effort: a client that never reads, such as
//!   SpecForge's `ArenaObjectClient`, is not held up by it). The server counts such peers by
//!   address ([`crate::report::UnauthorizedPeer`], in the stats answer).
//!
//! These answers (stats, sync, unauthorized) are the only bytes a server ever writes.
//!
//! The limits a server puts on its peers (connections, buffered bytes, idle partial lines, a
//! budget per connection per turn) live with the event loop in `writer::control_server`.

use std::borrow::Cow;
use std::net::{SocketAddr, ToSocketAddrs};

use crate::error::{Error, Result};
pub use crate::limits::{is_valid_token, MAX_LINE_BYTES, TOKEN_BYTES};
use crate::report::StoreUsage;
use crate::stats::StatsSnapshot;

/// Parses one line (without its `\n`). `Ok(None)` for a blank line. Keys without JSON escapes
/// are borrowed from the line (no allocation per key).
///
/// # Errors
/// A description of why the line is not a JSON array of strings.
pub fn parse_line(line: &[u8]) -> Result<Option<Vec<Cow<'_, str>>>, String> {
    let line = line.trim_ascii();
    if line.is_empty() {
        return Ok(None);
    }
    if line == b"[]" {
        return Ok(Some(Vec::new()));
    }
    // `Cow` borrows only through a field marked `borrow`, not as an element of a `Vec`.
    #[derive(serde::Deserialize)]
    struct Text<'a>(#[serde(borrow)] Cow<'a, str>);
    serde_json::from_slice::<Vec<Text<'_>>>(line)
        .map(|k| Some(k.into_iter().map(|t| t.0).collect()))
        .map_err(|e| e.to_string())
}

/// The line that presents `token` (without its `\n`).
pub fn token_line(token: &str) -> String {
    serde_json::json!({ "token": token }).to_string()
}

/// The line that frees every object under `prefix` (without its `\n`).
pub fn prefix_line(prefix: &str) -> String {
    serde_json::json!({ "free_prefix": prefix }).to_string()
}

/// The line that asks for a [`StatsReport`] (without its `\n`).
pub const STATS_LINE: &str = r#"{"stats": true}"#;

/// The line that asks for a delivery confirmation `n` (without its `\n`).
pub fn sync_line(n: u64) -> String {
    format!(r#"{{"sync": {n}}}"#)
}

/// The answer to [`sync_line`] (with its `\n`): every line sent before it was applied. It says
/// that this server applies [`stamped_free_line`]s (`"stamps": true`); a client that ignores
/// the field is unaffected.
pub fn synced_line(n: u64) -> Vec<u8> {
    format!("{{\"synced\":{n},\"stamps\":true}}\n").into_bytes()
}

/// The line that frees each key only if its resident object still carries the stamp given
/// with it (the object a result named, not one published since under the same key), without
/// its `\n`: `{"free_stamped": [["<key>", <stamp>], ...]}`. Send it only to a server whose
/// sync answer says `"stamps": true`; a server without the extension counts it as one bad line.
pub fn stamped_free_line(entries: &[(&str, u64)]) -> String {
    serde_json::json!({ "free_stamped": entries }).to_string()
}

/// Why a connection was closed for the control token (the `reason` of its last answer).
pub const MISSING_TOKEN: &str = "missing token";
/// See [`MISSING_TOKEN`].
pub const WRONG_TOKEN: &str = "wrong token";

/// The line a connection closed for the control token gets (with its `\n`).
pub fn unauthorized_line(reason: &str) -> Vec<u8> {
    let mut v = serde_json::json!({ "error": "unauthorized", "reason": reason })
        .to_string()
        .into_bytes();
    v.push(b'\n');
    v
}

/// What a client reads back after a [`sync_line`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// `{"synced": n}`: every line sent before sync `n` was applied; `true` when the server
    /// says it applies [`stamped_free_line`]s.
    Synced(u64, bool),
    /// `{"error": "unauthorized", "reason": ...}`: the connection was closed for the control
    /// token; nothing it sent was applied.
    Unauthorized(String),
}

/// The longest answer line a client reads back after a [`sync_line`].
pub const MAX_SYNC_ANSWER_BYTES: usize = 4096;

/// Parses one answer line (without its `\n`); `None` for anything else.
pub fn parse_answer(line: &[u8]) -> Option<Answer> {
    #[derive(serde::Deserialize)]
    struct Fields {
        synced: Option<u64>,
        #[serde(default)]
        stamps: bool,
        error: Option<String>,
        reason: Option<String>,
    }
    match serde_json::from_slice::<Fields>(line.trim_ascii()).ok()? {
        Fields {
            synced: Some(n),
            stamps,
            error: None,
            ..
        } => Some(Answer::Synced(n, stamps)),
        Fields {
            synced: None,
            error: Some(e),
            reason,
            ..
        } if e == "unauthorized" => Some(Answer::Unauthorized(
            reason.unwrap_or_else(|| "unauthorized".into()),
        )),
        _ => None,
    }
}

/// The most `store_id`s a [`StatsReport`] lists (the largest holders first).
pub const STATS_STORES: usize = 64;

/// A connection is answered at most once per this interval.
pub const STATS_INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);

/// The per-store table costs the writer a pass over its object table: it is remade at most
/// this often.
pub const STATS_TABLE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// Stats answers a server gives per second, over all connections.
pub const STATS_ANSWERS_PER_SECOND: u32 = 1000;

/// The longest answer a client reads (an answer is a few KiB: [`STATS_STORES`] rows of keys
/// that are at most [`crate::key::MAX_KEY_BYTES`] long).
pub const MAX_STATS_ANSWER_BYTES: usize = 1 << 20;

/// The answer to [`STATS_LINE`]: who holds the arena, with the writer's counters.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StatsReport {
    /// The writer's counters and gauges.
    pub stats: StatsSnapshot,
    /// Resident objects per `store_id`, largest first, at most [`STATS_STORES`].
    pub stores: Vec<StoreUsage>,
    /// How many `store_id`s hold objects (`stores` may list fewer).
    pub stores_total: u64,
    /// The producer's process id.
    pub pid: u32,
    /// Peers whose connections were closed for the control token, most recent first (at most
    /// [`crate::report::MAX_UNAUTHORIZED_PEERS`]): readers that free without the token.
    #[serde(default)]
    pub unauthorized_peers: Vec<crate::report::UnauthorizedPeer>,
}

/// A control line that is a JSON object rather than a list of keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ObjectLine {
    /// `{"token": "<token>"}`: presents the control token.
    Token(String),
    /// `{"free_prefix": "<prefix>"}`: frees everything under the prefix (not checked here).
    FreePrefix(String),
    /// `{"stats": true}`: asks for a [`StatsReport`].
    Stats,
    /// `{"sync": n}`: asks for `{"synced": n}` once the lines before it are applied.
    Sync(u64),
    /// `{"free_stamped": [["<key>", <stamp>], ...]}`: frees each key whose resident object
    /// carries that stamp ([`stamped_free_line`]; keys not checked here).
    FreeStamped(Vec<(String, u64)>),
}

/// The object line `line` is, if it is one: a JSON object with exactly one of the fields
/// `token` and `free_prefix` (a string), `stats` (`true`), `sync` (an integer) and
/// `free_stamped` (a list of `[key, stamp]` pairs).
pub fn parse_object_line(line: &[u8]) -> Option<ObjectLine> {
    let line = line.trim_ascii();
    if !line.starts_with(b"{") {
        return None;
    }
    // A field given as null is not absent: `{"sync": 1, "stats": null}` has two fields, a bad
    // line like any other with more than one.
    fn given<'de, D: serde::Deserializer<'de>, T: serde::Deserialize<'de>>(
        d: D,
    ) -> std::result::Result<Option<T>, D::Error> {
        T::deserialize(d).map(Some)
    }
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Fields {
        #[serde(default, deserialize_with = "given")]
        token: Option<String>,
        #[serde(default, deserialize_with = "given")]
        free_prefix: Option<String>,
        #[serde(default, deserialize_with = "given")]
        stats: Option<bool>,
        #[serde(default, deserialize_with = "given")]
        sync: Option<u64>,
        #[serde(default, deserialize_with = "given")]
        free_stamped: Option<Vec<(String, u64)>>,
    }
    let f = serde_json::from_slice::<Fields>(line).ok()?;
    if let Some(entries) = f.free_stamped {
        let alone = f.token.is_none() && f.free_prefix.is_none() && f.stats.is_none();
        return (alone && f.sync.is_none()).then_some(ObjectLine::FreeStamped(entries));
    }
    match f {
        Fields {
            token: Some(t),
            free_prefix: None,
            stats: None,
            sync: None,
            ..
        } => Some(ObjectLine::Token(t)),
        Fields {
            token: None,
            free_prefix: Some(p),
            stats: None,
            sync: None,
            ..
        } => Some(ObjectLine::FreePrefix(p)),
        Fields {
            token: None,
            free_prefix: None,
            stats: Some(true),
            sync: None,
            ..
        } => Some(ObjectLine::Stats),
        Fields {
            token: None,
            free_prefix: None,
            stats: None,
            sync: Some(n),
            ..
        } => Some(ObjectLine::Sync(n)),
        _ => None,
    }
}

/// Compares two tokens in time that depends on their lengths only, not on where they differ.
pub fn tokens_equal(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// Above this capacity, a line buffer gives its memory back once its line is complete, so a
/// connection that once sent one long line does not keep a megabyte for the rest of its life.
const KEEP_CAPACITY: usize = 4 * 1024;

/// Splits a byte stream into lines, buffering a partial last line.
#[derive(Debug, Default)]
pub struct LineBuffer {
    buf: Vec<u8>,
}

/// A line grew past [`MAX_LINE_BYTES`] without a `\n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Oversized {
    /// Bytes buffered when the limit was hit.
    pub bytes: usize,
}

impl LineBuffer {
    /// Feeds `data`, calling `on_line` for each complete line in order.
    ///
    /// # Errors
    /// [`Oversized`] when the unterminated tail exceeds [`MAX_LINE_BYTES`]; the connection should
    /// be closed (the lines completed before it were still delivered).
    pub fn push(&mut self, data: &[u8], on_line: impl FnMut(&[u8])) -> Result<(), Oversized> {
        self.push_capped(data, usize::MAX, on_line)
    }

    /// As [`LineBuffer::push`], growing the buffer's memory to at most `max_held` bytes (or what
    /// the unfinished line needs, if more): a server that bounds the bytes it buffers reads at
    /// most `max_held - pending()` bytes and keeps [`LineBuffer::held`] within its bound.
    ///
    /// # Errors
    /// As [`LineBuffer::push`].
    pub fn push_capped(
        &mut self,
        data: &[u8],
        max_held: usize,
        mut on_line: impl FnMut(&[u8]),
    ) -> Result<(), Oversized> {
        let mut rest = data;
        // Complete the buffered partial line first.
        if !self.buf.is_empty() {
            match memchr(rest) {
                Some(i) => {
                    self.append(&rest[..i], max_held);
                    if self.buf.len() > MAX_LINE_BYTES {
                        return Err(Oversized {
                            bytes: self.buf.len(),
                        });
                    }
                    on_line(&self.buf);
                    self.buf.clear();
                    if self.buf.capacity() > KEEP_CAPACITY {
                        self.buf = Vec::new();
                    }
                    rest = &rest[i + 1..];
                }
                None => {
                    self.append(rest, max_held);
                    return self.check();
                }
            }
        }
        // Whole lines straight from the read buffer, no copy.
        while let Some(i) = memchr(rest) {
            if i > MAX_LINE_BYTES {
                return Err(Oversized { bytes: i });
            }
            on_line(&rest[..i]);
            rest = &rest[i + 1..];
        }
        self.append(rest, max_held);
        self.check()
    }

    /// Appends, growing capacity by doubling but not past `max_held` (unless the data needs it).
    fn append(&mut self, data: &[u8], max_held: usize) {
        let need = self.buf.len() + data.len();
        if need > self.buf.capacity() {
            let target = (self.buf.capacity() * 2).max(256).min(max_held).max(need);
            self.buf.reserve_exact(target - self.buf.len());
        }
        self.buf.extend_from_slice(data);
    }

    fn check(&self) -> Result<(), Oversized> {
        if self.buf.len() > MAX_LINE_BYTES {
            Err(Oversized {
                bytes: self.buf.len(),
            })
        } else {
            Ok(())
        }
    }

    /// Bytes of an unterminated line buffered (a partial line if the connection now closes).
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// Bytes of memory the buffer holds (its capacity).
    pub fn held(&self) -> usize {
        self.buf.capacity()
    }
}

fn memchr(b: &[u8]) -> Option<usize> {
    b.iter().position(|&c| c == b'\n')
}

/// Binds the control listener on `host:port` (port 0 = ephemeral) and returns it with the
/// endpoint to advertise (`host:actual_port`; IPv6 in brackets).
///
/// # Errors
/// [`Error::Io`] naming the host and port if the name does not resolve or binding fails.
pub fn bind(host: &str, port: u16) -> Result<(mio::net::TcpListener, String)> {
    let addr: SocketAddr = (host, port)
        .to_socket_addrs()
        .map_err(|e| {
            Error::io(
                format!("resolving control host {host:?} (SGLANG_SPEC_CAPTURE_CONTROL_HOST)"),
                e,
            )
        })?
        .next()
        .ok_or_else(|| {
            Error::io(
                format!("control host {host:?} resolves to no address"),
                std::io::Error::from(std::io::ErrorKind::AddrNotAvailable),
            )
        })?;
    let listener = mio::net::TcpListener::bind(addr).map_err(|e| {
        Error::io(
            format!(
                "binding the control endpoint {addr} (SGLANG_SPEC_CAPTURE_CONTROL_HOST / \
                 SGLANG_SPEC_CAPTURE_CONTROL_PORT; 0 = ephemeral)"
            ),
            e,
        )
    })?;
    let port = listener
        .local_addr()
        .map_err(|e| Error::io("control listener address", e))?
        .port();
    let advertised = if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    Ok((listener, advertised))
}

#[cfg(test)]
mod tests {

    #[test]
    fn object_lines_have_exactly_one_known_field() {
        assert_eq!(
            parse_object_line(token_line("abc").as_bytes()),
            Some(ObjectLine::Token("abc".into()))
        );
        assert_eq!(
            parse_object_line(format!("  {}\r", prefix_line("st/")).as_bytes()),
            Some(ObjectLine::FreePrefix("st/".into()))
        );
        assert_eq!(
            parse_object_line(STATS_LINE.as_bytes()),
            Some(ObjectLine::Stats)
        );
        assert_eq!(
            parse_object_line(sync_line(7).as_bytes()),
            Some(ObjectLine::Sync(7))
        );
        assert_eq!(
            parse_answer(&synced_line(7)),
            Some(Answer::Synced(7, true)),
            "the server's answer is what a client parses, and says it applies stamped frees"
        );
        assert_eq!(
            parse_answer(br#"{"synced": 7}"#),
            Some(Answer::Synced(7, false)),
            "a server without the extension"
        );
        assert_eq!(
            parse_object_line(
                stamped_free_line(&[("st/a/g1/x", 7), ("st/b/g1/\"y", 1)]).as_bytes()
            ),
            Some(ObjectLine::FreeStamped(vec![
                ("st/a/g1/x".into(), 7),
                ("st/b/g1/\"y".into(), 1)
            ]))
        );
        assert_eq!(
            parse_answer(&unauthorized_line(MISSING_TOKEN)),
            Some(Answer::Unauthorized(MISSING_TOKEN.into()))
        );
        for other in [&br#"{"stats": {}}"#[..], br#"{"error": "x"}"#, b"[]", b"{"] {
            assert_eq!(parse_answer(other), None);
        }
        for bad in [
            &br#"{"sync": -1}"#[..],
            br#"{"sync": 1, "stats": true}"#,
            &br#"{"token": "a", "free_prefix": "st/"}"#[..],
            br#"{"token": 1}"#,
            br#"{"stats": false}"#,
            br#"{"stats": "yes"}"#,
            br#"{"stats": true, "token": "a"}"#,
            br#"{"tokens": "a"}"#,
            br#"{"free_stamped": [["st/a/g1/x", 1]], "sync": 1}"#,
            br#"{"free_stamped": [["st/a/g1/x"]]}"#,
            br#"{"free_stamped": [["st/a/g1/x", -1]]}"#,
            br#"{"free_stamped": ["st/a/g1/x"]}"#,
            br#"{"sync": 1, "stats": null}"#,
            br#"{"free_stamped": [["st/a/g1/x", 1]], "token": null}"#,
            br#"{"token": null}"#,
            br#"{}"#,
            br#"["st/a/g1/x"]"#,
            b"{",
        ] {
            assert_eq!(
                parse_object_line(bad),
                None,
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(is_valid_token("0123456789abcdef") && !is_valid_token("0123456789abcde"));
        assert!(!is_valid_token("0123456789abcdef\n") && !is_valid_token(&"a".repeat(257)));
    }

    use super::*;
    use proptest::prelude::*;

    fn lines(chunks: &[&[u8]]) -> (Vec<Vec<u8>>, usize) {
        let mut b = LineBuffer::default();
        let mut out = Vec::new();
        for c in chunks {
            b.push(c, |l| out.push(l.to_vec())).unwrap();
        }
        (out, b.pending())
    }

    #[test]
    fn splits_across_and_within_reads() {
        let (l, p) = lines(&[b"[\"a\",", b"\"b\"]\n[\"c\"]\n[", b"\"d\"]\n[\"e"]);
        assert_eq!(
            l,
            [
                b"[\"a\",\"b\"]".to_vec(),
                b"[\"c\"]".to_vec(),
                b"[\"d\"]".to_vec()
            ]
        );
        assert_eq!(p, 3, "partial last line stays buffered");
    }

    #[test]
    fn parses_lines() {
        assert_eq!(
            parse_line(b" [\"a\", \"b\"] \r"),
            Ok(Some(vec!["a".into(), "b".into()]))
        );
        assert!(matches!(
            parse_line(b"[\"a\"]").unwrap().unwrap()[0],
            Cow::Borrowed("a")
        ));
        assert_eq!(
            parse_line(b"[\"a\\\"b\"]"),
            Ok(Some(vec!["a\"b".into()])),
            "escaped keys are unescaped"
        );
        assert_eq!(parse_line(b"[]"), Ok(Some(vec![])));
        assert_eq!(parse_line(b" [ ] "), Ok(Some(vec![])));
        assert_eq!(parse_line(b"  "), Ok(None));
        for bad in [
            &b"nope"[..],
            b"{\"a\": 1}",
            b"[1, 2]",
            b"[\"a\"",
            b"\"a\"",
            b"[\"\xff\"]",
        ] {
            assert!(
                parse_line(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn oversized_lines_are_refused() {
        let mut b = LineBuffer::default();
        let big = vec![b'x'; MAX_LINE_BYTES + 1];
        assert!(b.push(&big, |_| {}).is_err());
        let mut b = LineBuffer::default();
        b.push(&big[..MAX_LINE_BYTES], |_| {}).unwrap();
        assert!(b.push(b"yy\n", |_| {}).is_err(), "split across reads too");
        let mut b = LineBuffer::default();
        let mut ok = big[..MAX_LINE_BYTES].to_vec();
        ok.push(b'\n');
        let mut n = 0;
        b.push(&ok, |_| n += 1).unwrap();
        assert_eq!(n, 1, "exactly the limit is fine");
    }

    #[test]
    fn a_long_line_gives_its_memory_back() {
        let mut b = LineBuffer::default();
        let big = vec![b'x'; 512 * 1024];
        b.push(&big, |_| {}).unwrap();
        assert!(b.held() >= big.len());
        b.push(b"\n", |_| {}).unwrap();
        assert_eq!((b.pending(), b.held()), (0, 0));
    }

    #[test]
    fn binds_loopback_ephemeral() {
        let (l, adv) = bind("127.0.0.1", 0).unwrap();
        let port = l.local_addr().unwrap().port();
        assert_eq!(adv, format!("127.0.0.1:{port}"));
        assert!(bind("no-such-host.invalid", 0).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..8)) {
            let mut b = LineBuffer::default();
            for c in &chunks {
                let _ = b.push(c, |l| { let _ = parse_line(l); });
            }
        }

        #[test]
        fn any_split_gives_the_same_lines(keys in proptest::collection::vec("[a-z0-9/:]{1,12}", 1..20),
                                           cuts in proptest::collection::vec(any::<usize>(), 0..6)) {
            let mut stream = Vec::new();
            for k in &keys {
                stream.extend_from_slice(serde_json::to_string(&vec![k]).unwrap().as_bytes());
                stream.push(b'\n');
            }
            let mut at: Vec<usize> = cuts.iter().map(|c| c % (stream.len() + 1)).collect();
            at.sort_unstable();
            let mut b = LineBuffer::default();
            let mut got = Vec::new();
            let mut prev = 0;
            for a in at.into_iter().chain([stream.len()]) {
                b.push(&stream[prev..a], |l| got.extend(parse_line(l).unwrap().unwrap().into_iter().map(|k| k.into_owned()))).unwrap();
                prev = a;
            }
            prop_assert_eq!(got, keys);
            prop_assert_eq!(b.pending(), 0);
        }
    }
}
