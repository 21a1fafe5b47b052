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
