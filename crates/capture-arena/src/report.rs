//! What the writer reports about its arena: occupancy ([`ArenaReport`]) and the trainer
//! stores holding it ([`StoreUsage`]). Plain data, below everything that fills it (the arena)
//! or sends it (stats, the control protocol).

/// Resident objects of one `store_id` (one trainer store): who holds the arena, since when.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StoreUsage {
    /// The trainer store namespace.
    pub store_id: String,
    /// Resident objects.
    pub objects: u64,
    /// Their bytes (tensor bytes).
    pub bytes: u64,
    /// Seconds since the oldest of them was published.
    pub oldest_age_s: f64,
}

/// Peers [`UnauthorizedPeers`] remembers at most (the least recent is forgotten).
pub const MAX_UNAUTHORIZED_PEERS: usize = 32;

/// A peer whose control connections were closed for the control token: a reader freeing
/// without the token (SpecForge's `ArenaObjectClient` sends none), whose frees were not applied.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct UnauthorizedPeer {
    /// The peer's address, without the port (each of its connections has its own).
    pub peer: String,
    /// Its connections closed for the token.
    pub connections: u64,
    /// Why the last one was closed: `missing token` (a line before any token line) or `wrong
    /// token`.
    pub reason: String,
    /// Seconds since the last one.
    pub last_age_s: f64,
}

/// The peers whose connections were closed for the control token, the most recent first, at
/// most [`MAX_UNAUTHORIZED_PEERS`].
#[derive(Debug, Default)]
pub struct UnauthorizedPeers {
    peers: Vec<(String, u64, &'static str, std::time::Instant)>,
}

impl UnauthorizedPeers {
    /// Counts a connection from `peer` (`ip:port` or `[ip]:port`) closed for `reason`; returns
    /// how many of that address's connections were.
    pub fn note(&mut self, peer: &str, reason: &'static str, now: std::time::Instant) -> u64 {
        let addr = peer
            .parse::<std::net::SocketAddr>()
            .map_or_else(|_| peer.to_owned(), |a| a.ip().to_string());
        let count = match self.peers.iter().position(|p| p.0 == addr) {
            Some(i) => {
                let mut p = self.peers.remove(i);
                p.1 += 1;
                (p.2, p.3) = (reason, now);
                let n = p.1;
                self.peers.insert(0, p);
                n
            }
            None => {
                self.peers.insert(0, (addr, 1, reason, now));
                self.peers.truncate(MAX_UNAUTHORIZED_PEERS);
                1
            }
        };
        count
    }

    /// The table as it is at `now`.
    pub fn rows(&self, now: std::time::Instant) -> Vec<UnauthorizedPeer> {
        self.peers
            .iter()
            .map(|(peer, connections, reason, at)| UnauthorizedPeer {
                peer: peer.clone(),
                connections: *connections,
                reason: (*reason).to_owned(),
                last_age_s: now.saturating_duration_since(*at).as_secs_f64(),
            })
            .collect()
    }
}

/// The arena's occupancy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ArenaReport {
    /// Usable bytes.
    pub capacity: u64,
    /// Bytes not allocated.
    pub free_bytes: u64,
    /// The largest free extent.
    pub largest_free: u64,
    /// Free extents (1 when empty).
    pub free_extents: u64,
    /// Objects resident.
    pub resident_objects: u64,
    /// Bytes of resident objects and of the batch in flight (aligned).
    pub resident_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unauthorized_peers_are_counted_by_address_most_recent_first_and_bounded() {
        let mut t = UnauthorizedPeers::default();
        let now = std::time::Instant::now();
        assert_eq!(t.note("10.0.0.1:5000", "missing token", now), 1);
        assert_eq!(t.note("[::1]:7", "wrong token", now), 1);
        // Another connection (another port) of the first address: the same row, now first.
        assert_eq!(t.note("10.0.0.1:5001", "wrong token", now), 2);
        let rows = t.rows(now);
        assert_eq!(
            rows.iter()
                .map(|r| (r.peer.as_str(), r.connections, r.reason.as_str()))
                .collect::<Vec<_>>(),
            [("10.0.0.1", 2, "wrong token"), ("::1", 1, "wrong token")]
        );
        for i in 0..2 * MAX_UNAUTHORIZED_PEERS {
            t.note(&format!("10.1.0.{i}:1"), "missing token", now);
        }
        let rows = t.rows(now);
        assert_eq!(rows.len(), MAX_UNAUTHORIZED_PEERS);
        assert_eq!(
            rows[0].peer,
            format!("10.1.0.{}", 2 * MAX_UNAUTHORIZED_PEERS - 1)
        );
    }
}
