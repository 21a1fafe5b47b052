//! The control port's input path: bytes from a socket, in chunks the way the server reads them,
//! through the line buffer and every line parser. Checks that lines come out exactly as they
//! went in, that the buffer never holds more than the server allowed it, and that every key a
//! line frees parses back to itself.
#![no_main]

use capture_arena::control::{self, LineBuffer, ObjectLine, MAX_LINE_BYTES};
use capture_arena::Key;
use libfuzzer_sys::fuzz_target;

/// What every connection may hold whatever the pool holds (the server's `SMALL_LINE`, which is
/// also what a line buffer keeps after a line completes).
const SMALL_LINE: usize = 4 * 1024;

fuzz_target!(|data: &[u8]| {
    let Some((&seed, input)) = data.split_first() else {
        return;
    };
    if seed == 0xff {
        return longer_than_a_line(input);
    }
    // The seed picks how the bytes arrive and how much the server lets the buffer hold: its
    // own small line (4 KiB) plus some share of the pool, or a whole line (the privileged one).
    let step = usize::from(seed % 61) + 1;
    let mut max_held =
        [SMALL_LINE, SMALL_LINE + 300, 64 * 1024, MAX_LINE_BYTES + 1][usize::from(seed >> 6)];
    let mut lines = LineBuffer::default();
    let mut got: Vec<Vec<u8>> = Vec::new();
    let mut rest = input;
    let mut oversized = false;
    while !rest.is_empty() {
        // As the server: read at most what the buffer may still hold; with no room left, the
        // pool is used up and this connection becomes the one that may finish its line.
        if lines.pending() >= max_held {
            max_held = MAX_LINE_BYTES + 1;
        }
        let room = (max_held - lines.pending()).min(step);
        let (chunk, tail) = rest.split_at(room.min(rest.len()));
        rest = tail;
        let pushed = lines.push_capped(chunk, max_held, |l| {
            check_line(l);
            got.push(l.to_vec());
        });
        if pushed.is_err() {
            oversized = true;
            break;
        }
        assert!(lines.pending() <= MAX_LINE_BYTES);
        // Within what the server allowed, or the small line every connection may keep.
        assert!(
            lines.held() <= max_held.max(SMALL_LINE),
            "held {} pending {} max {max_held}",
            lines.held(),
            lines.pending()
        );
    }
    if !oversized {
        // Every complete line came out, in order, and the partial tail is what is pending.
        let mut want: Vec<&[u8]> = input.split(|&b| b == b'\n').collect();
        let tail = want.pop().unwrap_or_default();
        assert_eq!(got.len(), want.len());
        assert!(got.iter().zip(&want).all(|(g, w)| g == w));
        assert_eq!(lines.pending(), tail.len());
    }
});

/// A line longer than the limit (the input without its newlines, repeated), in 64 KiB reads by
/// the privileged connection: refused once it passes the limit, never buffered beyond it.
fn longer_than_a_line(input: &[u8]) {
    let unit: Vec<u8> = input.iter().copied().filter(|&b| b != b'\n').collect();
    if unit.is_empty() {
        return;
    }
    let mut lines = LineBuffer::default();
    let mut fed = 0;
    while fed <= MAX_LINE_BYTES {
        let chunk: Vec<u8> = unit.iter().copied().cycle().take(64 * 1024).collect();
        fed += chunk.len();
        let pushed = lines.push_capped(&chunk, MAX_LINE_BYTES + 1, |_| {
            panic!("no line ends in input without newlines")
        });
        if fed > MAX_LINE_BYTES {
            assert!(pushed.is_err(), "a line of {fed} bytes was accepted");
            return;
        }
        assert!(pushed.is_ok() && lines.pending() == fed);
    }
}

/// What the server does with a line, minus the arena: every parser, and what it promises.
fn check_line(line: &[u8]) {
    match control::parse_object_line(line) {
        Some(ObjectLine::Token(t)) => {
            let _ = control::tokens_equal(t.as_bytes(), b"0123456789abcdef");
            let _ = control::is_valid_token(&t);
        }
        Some(ObjectLine::FreePrefix(p)) => {
            if capture_arena::key::check_prefix(&p).is_ok() {
                assert!(p.ends_with('/'));
            }
        }
        Some(ObjectLine::Sync(n)) => {
            // The answer a client parses back names the same sync.
            let answer = control::synced_line(n);
            assert_eq!(
                control::parse_answer(&answer[..answer.len() - 1]),
                Some(control::Answer::Synced(n, true))
            );
        }
        Some(ObjectLine::FreeStamped(entries)) => {
            // The line a client writes for them parses back to them.
            let pairs: Vec<(&str, u64)> = entries.iter().map(|(k, s)| (k.as_str(), *s)).collect();
            let again = control::stamped_free_line(&pairs);
            assert_eq!(
                control::parse_object_line(again.as_bytes()),
                Some(ObjectLine::FreeStamped(entries.clone()))
            );
        }
        Some(ObjectLine::Stats) | None => {}
    }
    // Anything a server could be sent, read as an answer, never panics.
    let _ = control::parse_answer(line);
    if let Ok(Some(keys)) = control::parse_line(line) {
        for k in keys {
            if let Ok(key) = k.parse::<Key>() {
                assert_eq!(key.as_str(), k);
            }
        }
    }
}
