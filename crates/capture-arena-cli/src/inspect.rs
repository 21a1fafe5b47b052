//! `capture-arena stats` and `capture-arena top`: ask a running producer, over its control
//! endpoint, who holds its arena (`{"stats": true}`, see `capture_arena::control`).
//!
//! `stats` prints one report (or its JSON); `top` redraws a live view every `--interval`:
//! occupancy, the largest free extent, rates since the last frame, the peer counters and the
//! per-`store_id` table.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use capture_arena::client::StatsQuery;
use capture_arena::control::{StatsReport, STATS_INTERVAL};

/// Where the producer is (shared by `stats`, `top` and `free`).
#[derive(Debug, Clone, clap::Args)]
pub struct Target {
    /// The producer's control endpoint, HOST:PORT (a result's `arena.control`).
    #[arg(long)]
    pub control: String,
    /// The control token, when the producer has one (a result's `arena.token`).
    #[arg(
        long,
        env = "SGLANG_SPEC_CAPTURE_CONTROL_TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
    /// Seconds to wait for the connection (and each answer).
    #[arg(long, default_value_t = 5.0)]
    pub timeout: f64,
}

impl Target {
    /// The timeout and the token, checked.
    pub fn checked(&self) -> anyhow::Result<(Duration, Option<&str>)> {
        let timeout = Duration::try_from_secs_f64(self.timeout).map_err(|_| {
            anyhow::anyhow!("--timeout {} is not a number of seconds", self.timeout)
        })?;
        anyhow::ensure!(
            self.token.as_deref() != Some("auto"),
            "the token is `auto` (a producer's setting, maybe from \
             SGLANG_SPEC_CAPTURE_CONTROL_TOKEN in this shell): pass the producer's token, a \
             result's arena.token, with --token"
        );
        Ok((timeout, self.token.as_deref()))
    }

    fn connect(&self) -> anyhow::Result<StatsQuery> {
        let (timeout, token) = self.checked()?;
        StatsQuery::connect(&self.control, token, timeout)
            .with_context(|| format!("asking {} for its stats", self.control))
    }
}

/// Flags of `stats`.
#[derive(Debug, Clone, clap::Args)]
pub struct StatsArgs {
    #[command(flatten)]
    pub target: Target,
    /// Print the producer's answer as one JSON line instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Flags of `top`.
#[derive(Debug, Clone, clap::Args)]
pub struct TopArgs {
    #[command(flatten)]
    pub target: Target,
    /// Seconds between frames (at least 0.1).
    #[arg(long, default_value_t = 1.0)]
    pub interval: f64,
    /// Stop after this many frames (default: until interrupted).
    #[arg(long)]
    pub frames: Option<u64>,
}

pub fn stats(args: StatsArgs) -> anyhow::Result<ExitCode> {
    let report = args.target.connect()?.ask()?;
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{}", serde_json::to_string(&report)?)?;
    } else {
        out.write_all(render(&args.target.control, &report, None).as_bytes())?;
    }
    Ok(ExitCode::SUCCESS)
}

pub fn top(args: TopArgs) -> anyhow::Result<ExitCode> {
    let interval = Duration::try_from_secs_f64(args.interval)
        .ok()
        .filter(|d| *d >= STATS_INTERVAL)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "--interval {} is not a number of seconds >= {}",
                args.interval,
                STATS_INTERVAL.as_secs_f64()
            )
        })?;
    let mut query = args.target.connect()?;
    let tty = std::io::stdout().is_terminal();
    let mut last: Option<(Instant, StatsReport)> = None;
    let mut frame = 0u64;
    loop {
        let report = query.ask().with_context(|| {
            format!(
                "the producer at {} stopped answering (gone, or restarted)",
                args.target.control
            )
        })?;
        let now = Instant::now();
        let since = last.as_ref().map(|(t, r)| (now.duration_since(*t), r));
        let mut text = render(&args.target.control, &report, since);
        if tty {
            // Home, clear: redraw in place.
            text.insert_str(0, "\x1b[H\x1b[2J");
        } else {
            text.push('\n');
        }
        let mut out = std::io::stdout().lock();
        out.write_all(text.as_bytes())?;
        out.flush()?;
        drop(out);
        last = Some((now, report));
        frame += 1;
        if args.frames.is_some_and(|n| frame >= n) {
            return Ok(ExitCode::SUCCESS);
        }
        std::thread::sleep(interval.saturating_sub(now.elapsed()));
    }
}

/// Bytes for people: B, KiB, MiB, GiB, TiB.
fn human(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// `text` from the server as the terminal gets it: control characters escaped (`\u{1b}`), so a
/// server's string cannot move the cursor or recolour the operator's terminal (a real one never
/// sends them: keys escape control characters).
fn printable(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// One frame: `since` is the time since the previous report and that report, for rates.
fn render(control: &str, r: &StatsReport, since: Option<(Duration, &StatsReport)>) -> String {
    let s = &r.stats;
    let mut o = String::new();
    let used = s.capacity.saturating_sub(s.free_bytes);
    let fill = if s.capacity > 0 {
        used as f64 / s.capacity as f64
    } else {
        0.0
    };
    let bar_len = 40;
    let full = ((fill * bar_len as f64).round() as usize).min(bar_len);
    let _ = writeln!(o, "capture-arena producer {} (pid {})", control, r.pid);
    let _ = writeln!(
        o,
        "arena     [{}{}] {:5.1}%  {} of {} used, {} objects",
        "#".repeat(full),
        " ".repeat(bar_len - full),
        fill * 100.0,
        human(used),
        human(s.capacity),
        s.resident_objects
    );
    let _ = writeln!(
        o,
        "free      {} in {} extent{}, the largest {}{}",
        human(s.free_bytes),
        s.free_extents,
        if s.free_extents == 1 { "" } else { "s" },
        human(s.largest_free),
        if s.free_bytes > 0 && s.largest_free.saturating_mul(2) < s.free_bytes {
            " (fragmented: less than half the free bytes in one piece)"
        } else {
            ""
        }
    );
    match since {
        Some((dt, p)) if !dt.is_zero() => {
            let p = &p.stats;
            let per_s =
                |now: u64, before: u64| now.saturating_sub(before) as f64 / dt.as_secs_f64();
            let waited = s.wait_ns.saturating_sub(p.wait_ns) as f64 / dt.as_nanos() as f64;
            let _ = writeln!(
                o,
                "rates     publish {:.1} batches/s, {}/s; free {:.0} objects/s, {}/s; waiting \
                 for frees {:.0}% of the time",
                per_s(s.published_batches, p.published_batches),
                human(per_s(s.published_bytes, p.published_bytes) as u64),
                per_s(s.freed_objects, p.freed_objects),
                human(per_s(s.freed_bytes, p.freed_bytes) as u64),
                (waited * 100.0).min(100.0),
            );
        }
        _ => {
            let _ = writeln!(
                o,
                "totals    published {} batches, {} samples, {}; freed {} objects, {}",
                s.published_batches,
                s.published_samples,
                human(s.published_bytes),
                s.freed_objects,
                human(s.freed_bytes)
            );
        }
    }
    let _ = writeln!(
        o,
        "batches   waits {} ({:.1} s in all), failed {}; leases expired {} objects",
        s.waits,
        s.wait_ns as f64 / 1e9,
        s.failed_batches,
        s.expired_objects
    );
    let _ = writeln!(
        o,
        "peers     {} connections open, {} accepted, {} refused, {} idle closed; bad lines {}, \
         unknown frees {}, unauthorized {}, oversized {}, timed out {}",
        s.open_connections,
        s.control_connections,
        s.refused_connections,
        s.idle_closed,
        s.bad_lines,
        s.unknown_frees,
        s.unauthorized_lines,
        s.oversized_lines,
        s.timed_out_lines
    );
    let _ = writeln!(o);
    let _ = writeln!(
        o,
        "{:<32} {:>10} {:>12} {:>7} {:>12}",
        "store_id", "objects", "bytes", "share", "oldest"
    );
    for u in &r.stores {
        let share = if used > 0 {
            u.bytes as f64 / used as f64 * 100.0
        } else {
            0.0
        };
        let store_id = printable(&u.store_id);
        let mut id: String = store_id.chars().take(32).collect();
        if id.len() < store_id.len() {
            id.pop();
            id.push('~');
        }
        let _ = writeln!(
            o,
            "{id:<32} {:>10} {:>12} {:>6.1}% {:>11.1}s",
            u.objects,
            human(u.bytes),
            share,
            u.oldest_age_s
        );
    }
    if r.stores.is_empty() {
        let _ = writeln!(o, "(no resident objects)");
    }
    if r.stores_total > r.stores.len() as u64 {
        let _ = writeln!(
            o,
            "... and {} more store_ids",
            r.stores_total - r.stores.len() as u64
        );
    }
    if !r.unauthorized_peers.is_empty() {
        // Readers whose frees were refused: their objects stay until freed with the token.
        let _ = writeln!(
            o,
            "frees refused for the control token (readers without it, e.g. SpecForge's \
             ArenaObjectClient):"
        );
        let _ = writeln!(
            o,
            "{:<40} {:>11} {:<14} {:>8}",
            "peer", "connections", "reason", "last"
        );
        for p in &r.unauthorized_peers {
            let _ = writeln!(
                o,
                "{:<40} {:>11} {:<14} {:>7.1}s",
                printable(&p.peer),
                p.connections,
                printable(&p.reason),
                p.last_age_s
            );
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_servers_numbers_and_strings_cannot_break_the_frame_or_the_terminal() {
        use capture_arena::report::{StoreUsage, UnauthorizedPeer};
        let report = StatsReport {
            stats: capture_arena::stats::StatsSnapshot {
                capacity: 100,
                free_bytes: 50,
                largest_free: u64::MAX,
                ..Default::default()
            },
            stores: vec![StoreUsage {
                store_id: "st\u{1b}[2J".into(),
                objects: 1,
                bytes: 1,
                oldest_age_s: 1.0,
            }],
            stores_total: 1,
            pid: 7,
            unauthorized_peers: vec![UnauthorizedPeer {
                peer: "\u{9b}31m".into(),
                connections: 1,
                reason: "x\u{7}".into(),
                last_age_s: 0.0,
            }],
        };
        let frame = render("127.0.0.1:1", &report, None);
        assert!(
            !frame.chars().any(|c| c.is_control() && c != '\n'),
            "{frame:?}"
        );
        assert!(frame.contains("st\\u{1b}[2J"), "{frame}");
    }

    #[test]
    fn bytes_read_as_people_write_them() {
        assert_eq!(human(0), "0 B");
        assert_eq!(human(1023), "1023 B");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(3 << 30), "3.0 GiB");
    }
}
