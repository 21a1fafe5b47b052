//! Asking a producer for its counters over its control endpoint (`capture-arena stats`, `top`).

use std::io::{BufRead, ErrorKind};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::control_conn::{check_token, connect, write_within};
use crate::control::StatsReport;
use crate::error::{Error, Result};

/// A connection that asks a producer for its [`StatsReport`] (`capture-arena stats` and `top`):
/// one `{"stats": true}` line, one line back, as often as every
/// [`crate::control::STATS_INTERVAL`].
#[derive(Debug)]
pub struct StatsQuery {
    endpoint: String,
    stream: std::io::BufReader<TcpStream>,
    /// How long one question and its answer may take.
    timeout: Duration,
    /// An earlier ask failed: a late answer may still arrive, so this connection is not used
    /// again.
    broken: bool,
}

impl StatsQuery {
    /// Connects to the control `endpoint` within `timeout` and presents `token` if given.
    ///
    /// # Errors
    /// [`Error::Config`] for a token that is not one; [`Error::Io`] when the endpoint cannot be
    /// reached, or refuses the connection for its control token (a missing or wrong one).
    pub fn connect(endpoint: &str, token: Option<&str>, timeout: Duration) -> Result<StatsQuery> {
        if let Some(t) = token {
            check_token(t)?;
        }
        let stream = connect(endpoint, token, timeout).map_err(|e| {
            let e = if e.kind() == ErrorKind::PermissionDenied {
                std::io::Error::new(
                    ErrorKind::PermissionDenied,
                    format!(
                        "the producer refused the connection ({e}): pass its control token with \
                         --token (SGLANG_SPEC_CAPTURE_CONTROL_TOKEN)"
                    ),
                )
            } else {
                e
            };
            Error::io(format!("connecting to the control endpoint {endpoint}"), e)
        })?;
        stream
            .set_read_timeout(Some(timeout))
            .map_err(|e| Error::io("setting a read timeout", e))?;
        Ok(StatsQuery {
            endpoint: endpoint.to_owned(),
            stream: std::io::BufReader::new(stream),
            timeout,
            broken: false,
        })
    }

    /// Asks once and reads the answer (at most [`crate::control::MAX_STATS_ANSWER_BYTES`]).
    ///
    /// # Errors
    /// [`Error::Io`] when the answer does not come within the timeout (asked again within
    /// [`crate::control::STATS_INTERVAL`], or a producer without stats), the producer closes the
    /// connection (a wrong or missing token), or the answer is not a stats report. After an
    /// error, connect again.
    pub fn ask(&mut self) -> Result<StatsReport> {
        let r = self.ask_once();
        self.broken |= r.is_err();
        r
    }

    fn ask_once(&mut self) -> Result<StatsReport> {
        let ctx = |what: &str| format!("{what} the stats of {}", self.endpoint);
        if self.broken {
            return Err(Error::io(
                ctx("asking for"),
                std::io::Error::other(
                    "an earlier question on this connection failed: connect again",
                ),
            ));
        }
        let mut line = crate::control::STATS_LINE.as_bytes().to_vec();
        line.push(b'\n');
        // One deadline for the question and its whole answer: a socket timeout bounds each
        // read only, and an answer trickled a byte at a time would stretch it without end.
        let deadline = crate::limits::deadline_in(self.timeout);
        write_within(self.stream.get_ref(), &line, deadline)
            .map_err(|e| Error::io(ctx("asking for"), e))?;
        let mut answer = Vec::new();
        let limit = crate::control::MAX_STATS_ANSWER_BYTES;
        let timed_out = || {
            Error::io(
                ctx("reading"),
                std::io::Error::new(
                    ErrorKind::TimedOut,
                    "no whole answer within the timeout: asked again within 100 ms on this \
                     connection, or a producer without stats (older than this client)",
                ),
            )
        };
        while answer.last() != Some(&b'\n') && answer.len() < limit {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(timed_out());
            }
            self.stream
                .get_ref()
                .set_read_timeout(Some(left))
                .map_err(|e| Error::io(ctx("reading"), e))?;
            let got = match self.stream.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(timed_out())
                }
                Err(e) => return Err(Error::io(ctx("reading"), e)),
            };
            if got.is_empty() {
                break; // closed
            }
            let room = limit - answer.len();
            let take = got
                .iter()
                .take(room)
                .position(|&b| b == b'\n')
                .map_or(got.len().min(room), |i| i + 1);
            answer.extend_from_slice(&got[..take]);
            self.stream.consume(take);
        }
        if answer.last() != Some(&b'\n') {
            let why = if answer.is_empty() {
                "the producer closed the connection without an answer: a wrong or missing \
                 --token (SGLANG_SPEC_CAPTURE_CONTROL_TOKEN), or a producer without stats"
                    .to_owned()
            } else {
                format!("the answer was cut off after {} bytes", answer.len())
            };
            return Err(Error::io(
                ctx("reading"),
                std::io::Error::new(ErrorKind::UnexpectedEof, why),
            ));
        }
        if let Some(crate::control::Answer::Unauthorized(reason)) =
            crate::control::parse_answer(&answer)
        {
            return Err(Error::io(
                ctx("reading"),
                std::io::Error::new(
                    ErrorKind::PermissionDenied,
                    format!(
                        "the producer refused the question ({reason}): pass its control token \
                         with --token (SGLANG_SPEC_CAPTURE_CONTROL_TOKEN)"
                    ),
                ),
            ));
        }
        serde_json::from_slice(&answer).map_err(|e| {
            Error::io(
                ctx("parsing"),
                std::io::Error::new(ErrorKind::InvalidData, e.to_string()),
            )
        })
    }
}
