//! What the control server does with a line: the frees it applies to the arena, and the answer
//! to a stats request (the counters, and the per-store table remade at most once per interval).

use std::time::Instant;

use super::conn::{Warn, Warnings};
use crate::arena::{Arena, Freed};
use crate::control;
use crate::stats::{bump, Stats};

/// The per-store table of the last stats answer, for the next ones.
#[derive(Debug)]
pub(super) struct StoreTable {
    at: Instant,
    /// `(published, freed + replaced + expired, resident)` objects when it was made: unchanged
    /// means the same objects are resident (the table's own count moves with the removals no
    /// counter names: a failed write, a free applied once its write finished).
    version: (u64, u64, u64),
    stores: Vec<crate::arena::StoreUsage>,
    total: u64,
}

/// The answer to a stats request (with its `\n`): the counters as they are now; the per-store
/// table as it is now if it was last made over [`control::STATS_TABLE_INTERVAL`] ago, else the
/// last one (its ages moved on), so walking the object table costs the writer at most one pass
/// per interval, however many ask.
pub(super) fn stats_answer(
    cache: &mut Option<StoreTable>,
    arena: &Arena,
    stats: &Stats,
    unauthorized_peers: Vec<crate::report::UnauthorizedPeer>,
    now: Instant,
) -> Vec<u8> {
    let snapshot = stats.snapshot();
    let version = (
        snapshot.published_objects,
        snapshot.freed_objects + snapshot.replaced_objects + snapshot.expired_objects,
        arena.report().resident_objects,
    );
    let reuse = cache.as_ref().is_some_and(|t| {
        t.version == version || now.saturating_duration_since(t.at) < control::STATS_TABLE_INTERVAL
    });
    if !reuse {
        let usage = arena.store_usage(now);
        let total = usage.len() as u64;
        // The largest holders, within a few KiB (a store_id may be up to 1 KiB long): the
        // answer fits the socket's buffer in one write.
        let mut room = STATS_ROWS_BYTES;
        let stores = usage
            .into_iter()
            .take(control::STATS_STORES)
            .take_while(|u| {
                // As JSON: escaping may make an id longer than its bytes.
                let id = serde_json::to_string(&u.store_id).map_or(usize::MAX, |j| j.len());
                room = room.saturating_sub(id.saturating_add(80));
                room > 0
            })
            .collect();
        *cache = Some(StoreTable {
            at: now,
            version,
            stores,
            total,
        });
    }
    let (stores, stores_total) = cache
        .as_ref()
        .map(|t| {
            // Ages move on with the clock (the same objects are still the oldest when the
            // version is unchanged).
            let later = now.saturating_duration_since(t.at).as_secs_f64();
            let rows = t.stores.iter().map(|u| crate::arena::StoreUsage {
                oldest_age_s: u.oldest_age_s + later,
                ..u.clone()
            });
            (rows.collect::<Vec<_>>(), t.total)
        })
        .unwrap_or_default();
    let report = control::StatsReport {
        stats: snapshot,
        stores,
        stores_total,
        pid: std::process::id(),
        unauthorized_peers,
    };
    let mut bytes = serde_json::to_vec(&report).unwrap_or_else(|_| b"{}".to_vec());
    bytes.push(b'\n');
    bytes
}

/// Bytes of `stores` rows in a stats answer, at most.
const STATS_ROWS_BYTES: usize = 8 * 1024;

/// Applies one line (`object`: what [`control::parse_object_line`] made of it): frees its keys.
/// Returns true if anything was freed.
/// Frees each key (given with a stamp: only if its resident object carries it) and counts what
/// was freed, unknown and stale; true if anything was freed.
fn free_keys<'a>(
    arena: &mut Arena,
    stats: &Stats,
    keys: impl Iterator<Item = (&'a str, Option<u64>)>,
) -> bool {
    let (mut objects, mut bytes, mut unknown, mut stale) = (0, 0, 0, 0);
    for (key, stamp) in keys {
        match arena.free_stamped(key, stamp) {
            Freed::Bytes(b) => {
                objects += 1;
                bytes += b;
            }
            Freed::Unknown => unknown += 1,
            Freed::Stale => stale += 1,
        }
    }
    if objects > 0 {
        // The occupancy first, then the counters: whoever sees a free counted (a `wait_for` on
        // `freed_objects`) sees the arena with it applied.
        stats.set_report(&arena.report());
    }
    bump(&stats.freed_bytes, bytes);
    bump(&stats.unknown_frees, unknown);
    bump(&stats.stale_frees, stale);
    bump(&stats.freed_objects, objects);
    objects > 0
}

pub(super) fn apply_line(
    line: &[u8],
    object: Option<control::ObjectLine>,
    peer: &str,
    arena: &mut Arena,
    stats: &Stats,
    warnings: &mut Warnings,
) -> bool {
    if let Some(control::ObjectLine::Token(_)) = object {
        // A server without a token: one bad line, and nothing of it in the log.
        bump(&stats.bad_lines, 1);
        warnings.warn(Warn::BadLine, |suppressed| {
            tracing::warn!(
                %peer,
                suppressed,
                "token line ignored: this server has no control token (counted in bad_lines)"
            )
        });
        return false;
    }
    if let Some(control::ObjectLine::FreePrefix(prefix)) = object {
        return match crate::key::check_prefix(&prefix) {
            Ok(()) => {
                let (objects, bytes) = arena.free_prefix(&prefix);
                if objects > 0 {
                    stats.set_report(&arena.report());
                } else {
                    bump(&stats.unknown_frees, 1);
                }
                bump(&stats.freed_bytes, bytes);
                bump(&stats.freed_objects, objects);
                if objects > 0 {
                    tracing::info!(%peer, %prefix, objects, bytes, "prefix freed");
                }
                objects > 0
            }
            Err(e) => {
                bump(&stats.bad_lines, 1);
                warnings.warn(Warn::BadLine, |suppressed| {
                    tracing::warn!(%peer, error = %e, suppressed, "bad prefix free ignored (counted in bad_lines)")
                });
                false
            }
        };
    }
    if let Some(control::ObjectLine::FreeStamped(entries)) = object {
        // Each key only if its object is the one the result named: a late or resent free of an
        // object since replaced under the same key never frees the replacement.
        return free_keys(
            arena,
            stats,
            entries.iter().map(|(k, s)| (k.as_str(), Some(*s))),
        );
    }
    match control::parse_line(line) {
        Ok(Some(keys)) => free_keys(arena, stats, keys.iter().map(|k| (k.as_ref(), None))),
        Ok(None) => false,
        Err(why) => {
            bump(&stats.bad_lines, 1);
            warnings.warn(Warn::BadLine, |suppressed| {
                let start = String::from_utf8_lossy(&line[..line.len().min(80)]).into_owned();
                tracing::warn!(
                    %peer,
                    %why,
                    bytes = line.len(),
                    ?start,
                    suppressed,
                    "bad control line ignored (counted in bad_lines)"
                )
            });
            false
        }
    }
}
