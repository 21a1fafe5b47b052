//! The arena: one region, one allocator, one object table (key -> offset, length, shape, dtype).
//!
//! Batches are placed atomically: every object of every sample, or none. Placing is three steps,
//! so that copies may run asynchronously while the writer serves frees:
//! [`Arena::reserve`] allocates the whole batch (or nothing), the region copies the bytes
//! ([`Arena::copy_ops`]), then [`Arena::commit`] enters the objects in the table (or
//! [`Arena::abort`] gives the space back). Objects of a batch in flight are not in the table, so
//! a free for them is an unknown key, never a free of space still being written. Only the writer
//! thread owns an `Arena`, so nothing here locks.
//!
//! Every object carries a stamp, unique in the arena's life, in the [`STAMP_BYTES`] after its
//! bytes rounded up to 8 ([`stamp_offset`]): space the object's extent reserves, usually inside
//! the alignment's padding. The batch's copies write it after the object's bytes; a free zeroes
//! it before the space can be placed again. Results carry it, so a reader compares it before
//! and after its copy and never returns another object's bytes; the object's bytes stay raw at
//! its address, so readers that know nothing of stamps are unaffected.
//!
//! A batch of reserved tensors ([`TensorData::Reserved`]) is written by its caller, not by the
//! writer: [`Arena::commit_reserved`] enters its objects at once with their stamp word set to the
//! stamp with [`PENDING_BIT`] (their results go out before their bytes), and
//! [`Arena::finish_write`] then writes the stamp itself (the bytes are there) or the stamp with
//! [`FAILED_BIT`] (they never will be: the space is freed). Until then a free of such an object
//! is only noted, and applied once its write is finished, so the caller never writes into space
//! placed again.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::alloc::{Allocator, Extent};
use crate::error::{Error, Result};
use crate::key::Key;
use crate::memory::{CopyOp, Progress, Region};
pub use crate::report::{ArenaReport, StoreUsage};
use crate::sample::{
    check_unique, stamp_offset, ArenaRef, Feature, Published, ReservedObjects, Sample, Written,
    FAILED_BIT, MAX_STAMP, PENDING_BIT, STAMP_BYTES,
};
use crate::tensor::Dtype;
use crate::tensor::TensorData;

/// A resident object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Object {
    /// Where it lives (aligned length).
    pub extent: Extent,
    /// Its true byte length (`shape × item size`).
    pub len: u64,
    /// Its shape.
    pub shape: Vec<u64>,
    /// Its dtype.
    pub dtype: Dtype,
    /// When it was published (entered the table).
    pub published: Instant,
    /// Its stamp (see the module docs).
    pub stamp: u64,
    /// Its bytes are still being written by the caller that reserved it
    /// ([`Arena::commit_reserved`]): its stamp word says so, and a free waits for
    /// [`Arena::finish_write`].
    pub writing: bool,
    /// Freed while still being written: the free takes effect when its write is finished.
    pub free_pending: bool,
}

/// What a successful publication did.
#[derive(Debug)]
pub struct Publication {
    /// One result per sample, in order.
    pub published: Vec<Published>,
    /// Objects published.
    pub objects: u64,
    /// Bytes copied (true tensor bytes).
    pub bytes: u64,
    /// Objects freed because their samples asked for `replace`.
    pub replaced: u64,
    /// Their bytes (tensor bytes, as `bytes`).
    pub replaced_bytes: u64,
}

/// Space set aside for one batch whose bytes are being copied: allocated, not yet in the object
/// table. Give it back to [`Arena::commit`] or [`Arena::abort`].
#[derive(Debug)]
#[must_use = "a reservation holds arena space until committed or aborted"]
pub struct Reservation {
    /// `(sample index, tensor index)` -> its extent and stamp, in the order they were placed.
    placed: Vec<((usize, usize), Extent, u64)>,
    /// Each placed object's stamp as bytes, the source of the copy that writes it.
    stamps: Vec<TensorData>,
    /// Objects freed for samples that asked for `replace`.
    replaced: Vec<(Key, Object)>,
}

/// What [`Arena::free_stamped`] did with a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freed {
    /// Freed (or, still being written, freed once its write ends): the object's bytes.
    Bytes(u64),
    /// Nothing resident under the key (or a repeated free of an object still being written).
    Unknown,
    /// The resident object carries another stamp: left as it is.
    Stale,
}

/// See the module docs.
#[derive(Debug)]
pub struct Arena {
    region: Box<dyn Region>,
    alloc: Allocator,
    /// Ordered by key, so a prefix free is a range scan.
    objects: BTreeMap<Key, Object>,
    arena_ref: ArenaRef,
    /// `SGLANG_SPEC_CAPTURE_OBJECT_TTL_S`: objects not freed this long after publication are
    /// freed by the writer.
    ttl: Option<Duration>,
    /// With a TTL: every published object's key and publication time, oldest first (an entry
    /// whose object was freed or published again since is skipped when it comes up).
    ages: VecDeque<(Instant, Key)>,
    /// The next object's stamp, in `[1, MAX_STAMP]`; it starts at random, so a producer
    /// restarted over the same memory does not repeat its predecessor's stamps.
    next_stamp: u64,
    /// The objects being written ([`Arena::commit_reserved`]), by stamp: what
    /// [`Arena::finish_written`] finishes. Stamps are unique among resident objects.
    writing: Arc<ReservedObjects>,
}

impl Arena {
    /// An empty arena over `region`, every object aligned to `alignment`; `control` is the
    /// endpoint published in results.
    ///
    /// # Errors
    /// [`Error::Config`] for a non-power-of-two alignment, a region smaller than one unit or a
    /// region whose base address is not 8-byte aligned (stamps are read as aligned 8-byte
    /// words); [`Error::Io`] when no random start for the stamps can be drawn.
    pub fn new(region: Box<dyn Region>, alignment: u64, control: String) -> Result<Arena> {
        // Objects start 8-byte aligned at least, so that their stamps are aligned words.
        let alloc = Allocator::new(region.len(), alignment.max(STAMP_BYTES))?;
        if !region.base_address().is_multiple_of(STAMP_BYTES) {
            return Err(Error::config(
                crate::alloc::ENV_ARENA_ALIGN,
                format!(
                    "the region's base address {:#x} is not 8-byte aligned",
                    region.base_address()
                ),
            ));
        }
        let next_stamp = (crate::random::nonce()? as u64) % MAX_STAMP + 1;
        let arena_ref = ArenaRef {
            session: region.session().to_owned(),
            control,
            token: None,
        };
        Ok(Arena {
            region,
            alloc,
            objects: BTreeMap::new(),
            arena_ref,
            ttl: None,
            ages: VecDeque::new(),
            next_stamp,
            writing: Arc::default(),
        })
    }

    fn take_stamp(&mut self) -> u64 {
        let s = self.next_stamp;
        self.next_stamp = if s >= MAX_STAMP { 1 } else { s + 1 };
        s
    }

    /// The objects being written, as the threads that write them check their destinations
    /// against it ([`ReservedObjects::check`]); kept up to date by this arena.
    pub fn reserved_objects(&self) -> Arc<ReservedObjects> {
        self.writing.clone()
    }

    /// Usable bytes.
    pub fn capacity(&self) -> u64 {
        self.alloc.capacity()
    }

    /// The session and control endpoint every result carries.
    pub fn arena_ref(&self) -> &ArenaRef {
        &self.arena_ref
    }

    /// Sets the lease: objects not freed within `ttl` of their publication are freed by
    /// [`Arena::expire`]. `None` (the default): objects stay until freed.
    pub fn set_ttl(&mut self, ttl: Option<Duration>) {
        self.ttl = ttl.filter(|t| !t.is_zero());
    }

    /// When the oldest object's lease ends (`None` without a TTL or objects).
    pub fn next_expiry(&self) -> Option<Instant> {
        let ttl = self.ttl?;
        self.ages.front().and_then(|(t, _)| t.checked_add(ttl))
    }

    /// Drops the lease entries of objects freed (or published again) since, once they outnumber
    /// the resident objects: the queue then holds at most about twice the resident objects,
    /// however many are published and freed within a TTL (amortized O(1) a publication).
    fn compact_ages(&mut self) {
        if self.ages.len() > 2 * self.objects.len() + 64 {
            let objects = &self.objects;
            self.ages
                .retain(|(t, k)| objects.get(k.as_str()).is_some_and(|o| o.published == *t));
        }
    }

    /// Frees objects whose lease ended by `now`, at most `max` of them per call (the writer
    /// calls again on its next turn); returns their count and bytes.
    pub fn expire(&mut self, now: Instant, max: usize) -> (u64, u64) {
        let Some(ttl) = self.ttl else {
            return (0, 0);
        };
        let (mut objects, mut bytes) = (0, 0);
        for _ in 0..max {
            match self.ages.front() {
                Some((t, _)) if t.checked_add(ttl).is_some_and(|end| end <= now) => {}
                _ => break,
            }
            let Some((t, key)) = self.ages.pop_front() else {
                break;
            };
            // Only the very object entered at `t`: not one freed, or published again, since.
            if self
                .objects
                .get(key.as_str())
                .is_some_and(|o| o.published == t)
            {
                if let Some(b) = self.free(key.as_str()) {
                    objects += 1;
                    bytes += b;
                }
            }
        }
        (objects, bytes)
    }

    /// Resident objects per `store_id`, largest first: one pass over the table (which is
    /// ordered by key, so each store's objects are contiguous).
    pub fn store_usage(&self, now: Instant) -> Vec<StoreUsage> {
        let mut out: Vec<StoreUsage> = Vec::new();
        let mut oldest = now;
        for (key, o) in &self.objects {
            if out.last().is_none_or(|u| u.store_id != key.store_id()) {
                if let Some(u) = out.last_mut() {
                    u.oldest_age_s = now.saturating_duration_since(oldest).as_secs_f64();
                }
                oldest = now;
                out.push(StoreUsage {
                    store_id: key.store_id().to_owned(),
                    objects: 0,
                    bytes: 0,
                    oldest_age_s: 0.0,
                });
            }
            if let Some(u) = out.last_mut() {
                u.objects += 1;
                u.bytes += o.len;
            }
            oldest = oldest.min(o.published);
        }
        if let Some(u) = out.last_mut() {
            u.oldest_age_s = now.saturating_duration_since(oldest).as_secs_f64();
        }
        out.sort_by_key(|u| std::cmp::Reverse(u.bytes));
        out
    }

    /// Sets the control token results carry.
    pub fn set_control_token(&mut self, token: Option<String>) {
        self.arena_ref.token = token;
    }

    /// The region.
    pub fn region(&self) -> &dyn Region {
        &*self.region
    }

    /// The region, for copies (the writer drives them).
    pub fn region_mut(&mut self) -> &mut dyn Region {
        &mut *self.region
    }

    /// A resident object by key.
    pub fn object(&self, key: &str) -> Option<&Object> {
        self.objects.get(key)
    }

    /// The address of a resident object.
    pub fn address(&self, key: &str) -> Option<u64> {
        self.objects
            .get(key)
            .map(|o| self.region.base_address() + o.extent.offset)
    }

    /// The stamp of the object resident under `key`, if one is.
    pub fn stamp_of(&self, key: &str) -> Option<u64> {
        self.objects.get(key).map(|o| o.stamp)
    }

    /// Occupancy figures.
    pub fn report(&self) -> ArenaReport {
        let r = self.alloc.report();
        ArenaReport {
            capacity: r.capacity,
            free_bytes: r.free_bytes,
            largest_free: r.largest_free,
            free_extents: r.free_extents,
            resident_objects: self.objects.len() as u64,
            resident_bytes: r.capacity - r.free_bytes,
        }
    }

    /// Bytes the batch takes after alignment, each object's stamp included.
    ///
    /// # Errors
    /// [`Error::BatchTooLarge`] on arithmetic overflow.
    pub fn needed_bytes(&self, samples: &[Sample]) -> Result<u64> {
        samples
            .iter()
            .flat_map(|s| s.tensors.iter())
            .try_fold(0u64, |acc, (_, t)| {
                extent_len(t.byte_len())
                    .and_then(|n| self.alloc.aligned_len(n))
                    .and_then(|l| acc.checked_add(l))
            })
            .ok_or(Error::BatchTooLarge {
                needed: u64::MAX,
                capacity: self.capacity(),
            })
    }

    /// Checks a batch without placing it: unique keys, no resident key without `replace`, and a
    /// total that can fit in the whole arena. Returns the bytes it needs.
    ///
    /// # Errors
    /// [`Error::InvalidSample`] for a key repeated in the batch, [`Error::KeyExists`],
    /// [`Error::BatchTooLarge`].
    pub fn check(&self, samples: &[Sample]) -> Result<u64> {
        check_unique(samples)?;
        for s in samples {
            // An object still being written by its caller cannot be replaced either: its space
            // is the caller's until its write is finished.
            let taken = |k: &&Key| {
                self.objects
                    .get(*k)
                    .is_some_and(|o| !s.replace || o.writing)
            };
            if let Some(k) = s.keys().find(taken) {
                return Err(Error::KeyExists { key: k.to_string() });
            }
        }
        let needed = self.needed_bytes(samples)?;
        if needed > self.capacity() {
            return Err(Error::BatchTooLarge {
                needed,
                capacity: self.capacity(),
            });
        }
        Ok(needed)
    }

    /// Allocates a whole batch: every object of every sample, or none. Objects resident under
    /// the keys of a sample with `replace` are freed first; if the batch then does not fit, they
    /// are put back exactly where they were.
    ///
    /// Returns `Ok(None)` when the batch does not fit now (the arena is unchanged: wait for frees
    /// and try again).
    ///
    /// # Errors
    /// As [`Arena::check`]; the arena is unchanged.
    pub fn reserve(&mut self, samples: &[Sample]) -> Result<Option<Reservation>> {
        self.check(samples)?;
        let mut replaced: Vec<(Key, Object)> = Vec::new();
        for s in samples.iter().filter(|s| s.replace) {
            for k in s.keys() {
                if let Some((k, o)) = self.objects.remove_entry(k) {
                    self.alloc.free(o.extent);
                    replaced.push((k, o));
                }
            }
        }
        // In the batch's order, sample by sample: the allocator places each object next to the
        // one before (youngest-neighbour fit), so a sample's objects, which its trainer frees
        // together, lie together, and samples lie in the order trainers tend to free them.
        let order: Vec<(usize, usize)> = samples
            .iter()
            .enumerate()
            .flat_map(|(si, s)| (0..s.tensors.len()).map(move |ti| (si, ti)))
            .collect();
        let mut placed: Vec<((usize, usize), Extent, u64)> = Vec::with_capacity(order.len());
        for &(si, ti) in &order {
            let len = extent_len(samples[si].tensors[ti].1.byte_len()).unwrap_or(u64::MAX);
            match self.alloc.allocate(len) {
                Some(e) => placed.push(((si, ti), e, 0)),
                None => break,
            }
        }
        if placed.len() == order.len() {
            // The replaced objects' space may be written by this batch: their stamps go first.
            for (_, o) in &replaced {
                self.clear_stamp(o);
            }
            let mut stamps = Vec::with_capacity(placed.len());
            for p in &mut placed {
                p.2 = self.take_stamp();
                stamps.push(TensorData::host(p.2.to_le_bytes().to_vec()));
            }
            return Ok(Some(Reservation {
                placed,
                stamps,
                replaced,
            }));
        }
        for (_, e, _) in placed {
            self.alloc.free(e);
        }
        for (k, o) in replaced {
            let restored = self.alloc.reserve_exact(o.extent);
            debug_assert!(restored, "the space of a replaced object is free again");
            self.objects.insert(k, o);
        }
        Ok(None)
    }

    /// The copies that fill a reservation of `samples`: each object's bytes, then its stamp.
    pub fn copy_ops<'a>(r: &'a Reservation, samples: &'a [Sample]) -> Vec<CopyOp<'a>> {
        r.placed
            .iter()
            .zip(&r.stamps)
            .flat_map(|(&((si, ti), e, _), stamp)| {
                let data = &samples[si].tensors[ti].1.data;
                [
                    CopyOp {
                        offset: e.offset,
                        data,
                    },
                    CopyOp {
                        offset: e.offset + stamp_offset(data.len()),
                        data: stamp,
                    },
                ]
            })
            .collect()
    }

    /// Zeroes a freed object's stamp, before its space can be placed again.
    fn clear_stamp(&mut self, o: &Object) {
        self.region
            .clear(o.extent.offset + stamp_offset(o.len), STAMP_BYTES);
    }

    /// Enters a reserved batch whose bytes have all landed into the object table.
    pub fn commit(&mut self, r: Reservation, samples: &[Sample]) -> Publication {
        self.enter(r, samples, false)
    }

    /// Enters a reserved batch whose bytes its caller writes ([`TensorData::Reserved`]) into
    /// the object table at once, each object's stamp word set to its stamp with
    /// [`PENDING_BIT`] first: readers of its results wait until [`Arena::finish_write`].
    pub fn commit_reserved(&mut self, r: Reservation, samples: &[Sample]) -> Publication {
        for &((si, ti), e, stamp) in &r.placed {
            let len = samples[si].tensors[ti].1.byte_len();
            self.region
                .set_word(e.offset + stamp_offset(len), stamp | PENDING_BIT);
        }
        self.enter(r, samples, true)
    }

    /// The caller finished writing the object under `key` (entered by
    /// [`Arena::commit_reserved`]): its stamp word becomes its stamp (`ok`: readers may read
    /// it), or the stamp with [`FAILED_BIT`] (readers fail) and its space is freed. A free
    /// asked for meanwhile is applied now. `None` for a key that is not being written; else the
    /// tensor bytes a failed write freed (0 for a finished one).
    pub fn finish_write(&mut self, key: &str, ok: bool) -> Option<u64> {
        self.finish_write_if(key, None, ok)
    }

    /// The stamp of the object under `key` if it is being written.
    pub fn writing_stamp(&self, key: &str) -> Option<u64> {
        self.objects.get(key).filter(|o| o.writing).map(|o| o.stamp)
    }

    /// As [`Arena::finish_write`], for the object under `key` only if its stamp is `stamp`
    /// (where given): a late or repeated finish of a result never finishes, nor fails, a newer
    /// object published under the same key since (its write may be under way).
    pub fn finish_write_if(&mut self, key: &str, stamp: Option<u64>, ok: bool) -> Option<u64> {
        let o = self
            .objects
            .get_mut(key)
            .filter(|o| o.writing && stamp.is_none_or(|s| s == o.stamp))?;
        o.writing = false;
        self.writing.lock().remove(&o.stamp);
        let (at, stamp, pending) = (
            o.extent.offset + stamp_offset(o.len),
            o.stamp,
            o.free_pending,
        );
        if ok {
            self.region.set_word(at, stamp);
            if pending {
                self.free(key);
            }
            return Some(0);
        }
        // Its readers must learn the bytes never came: the word stays failed (not zeroed) until
        // another object's copy writes over it, and no stamp ever equals it.
        self.region.set_word(at, stamp | FAILED_BIT);
        let o = self.objects.remove(key)?;
        let freed = self.alloc.free(o.extent);
        debug_assert!(freed, "a resident object's extent is live");
        // A free asked for meanwhile was counted then: these bytes are not counted twice.
        Some(if pending { 0 } else { o.len })
    }

    /// As [`Arena::finish_write`], for the object that `w` names by its stamp, so that a caller
    /// finishes exactly the objects it wrote (or failed to), whatever keys its bookkeeping
    /// holds. With `ok`: finished if it lies where the bytes went (`w.at` in this process's
    /// mapping, `w.len` bytes), failed with an error logged if not (its bytes went elsewhere,
    /// so they never will be there). Without: failed if it lies there, else left as it is with
    /// a warning (the name is not its writer's: another's object, whose own writer finishes
    /// it). `None` for a stamp of no object being written, or a failure left alone; else
    /// whether it was finished, and the bytes a failure freed.
    pub fn finish_written(&mut self, w: Written, ok: bool) -> Option<(bool, u64)> {
        let (key, checked) = self.writing.key_of(&w)?;
        match (&checked, ok) {
            (Err(why), true) => {
                tracing::error!(key = %key, "{why}: it is failed, as its bytes are not there")
            }
            (Err(why), false) => {
                tracing::warn!(key = %key, "{why}: a failure that names it is not its writer's, and is ignored");
                return None;
            }
            (Ok(()), _) => {}
        }
        let ok = ok && checked.is_ok();
        self.finish_write(key.as_str(), ok).map(|freed| (ok, freed))
    }

    fn enter(&mut self, r: Reservation, samples: &[Sample], writing: bool) -> Publication {
        if self.region.renew() {
            self.arena_ref.session = self.region.session().to_owned();
        }
        let base = self.region.base_address();
        let local = self.region.local_base();
        let now = Instant::now();
        let mut published: Vec<Published> = samples
            .iter()
            .map(|s| Published {
                sample_id: s.sample_id.clone(),
                store_id: s.store_id.clone(),
                gen: s.gen,
                aux_layer_ids: s.aux_layer_ids.clone(),
                features: Default::default(),
                arena: self.arena_ref.clone(),
                writable: writing.then(Default::default),
            })
            .collect();
        let mut bytes = 0;
        let mut entries = Vec::with_capacity(if writing { r.placed.len() } else { 0 });
        for &((si, ti), extent, stamp) in &r.placed {
            let (key, t) = &samples[si].tensors[ti];
            bytes += t.byte_len();
            if let Some(w) = &mut published[si].writable {
                w.insert(t.name.clone(), local + extent.offset);
            }
            published[si].features.insert(
                t.name.clone(),
                Feature {
                    shape: t.shape.clone(),
                    dtype: t.dtype,
                    address: base + extent.offset,
                    stamp: Some(stamp),
                },
            );
            self.objects.insert(
                key.clone(),
                Object {
                    extent,
                    len: t.byte_len(),
                    shape: t.shape.clone(),
                    dtype: t.dtype,
                    published: now,
                    stamp,
                    writing,
                    free_pending: false,
                },
            );
            if writing {
                entries.push((stamp, (key.clone(), local + extent.offset, t.byte_len())));
            }
            if self.ttl.is_some() {
                self.ages.push_back((now, key.clone()));
            }
        }
        if !entries.is_empty() {
            // One lock a batch: the copy threads check their destinations under it.
            let mut table = self.writing.lock();
            for (stamp, entry) in entries {
                let before = table.insert(stamp, entry);
                debug_assert!(before.is_none(), "stamps are unique among resident objects");
            }
        }
        self.compact_ages();
        Publication {
            published,
            objects: r.placed.len() as u64,
            bytes,
            replaced: r.replaced.len() as u64,
            replaced_bytes: r.replaced.iter().map(|(_, o)| o.len).sum(),
        }
    }

    /// Gives a reservation's space back after its copy failed. The objects it was replacing
    /// stay freed: the copy may have overwritten their old space (their samples asked to be
    /// replaced anyway). Returns how many there were and their bytes.
    pub fn abort(&mut self, r: Reservation) -> (u64, u64) {
        // Stamps the copy may have written were never handed out: no reader can match them.
        for (_, e, _) in r.placed {
            self.alloc.free(e);
        }
        if !r.replaced.is_empty() {
            tracing::warn!(
                objects = r.replaced.len(),
                "a failed copy leaves the objects it was replacing freed"
            );
        }
        (
            r.replaced.len() as u64,
            r.replaced.iter().map(|(_, o)| o.len).sum(),
        )
    }

    /// Places a whole batch and copies its bytes to completion on this thread: reserve, copy,
    /// commit. `Ok(None)` when it does not fit now (nothing changed).
    ///
    /// # Errors
    /// As [`Arena::check`], plus a failed copy (then as [`Arena::abort`]).
    pub fn publish(&mut self, samples: &[Sample]) -> Result<Option<Publication>> {
        let Some(r) = self.reserve(samples)? else {
            return Ok(None);
        };
        let ops = Arena::copy_ops(&r, samples);
        // SAFETY: `samples`, which the ops' data point into, outlive this call, and the loop
        // below runs the copy until it is done or failed (nothing in flight then) before it
        // returns.
        let copied = unsafe { self.region.start(&ops) }.and_then(|()| loop {
            match self.region.progress(&ops, u64::MAX)? {
                Progress::Done => break Ok(()),
                Progress::Again => {}
                Progress::Waiting => std::thread::sleep(std::time::Duration::from_micros(50)),
            }
        });
        drop(ops);
        match copied {
            Ok(()) => Ok(Some(self.commit(r, samples))),
            Err(e) => {
                self.abort(r);
                Err(e)
            }
        }
    }

    /// Frees the object under `key`. Returns its bytes (`shape × item size`, as published), or
    /// `None` for a key that is not resident (already freed, never published, or in a batch
    /// still being copied): freeing is idempotent. An object its caller is still writing
    /// ([`Arena::commit_reserved`]) is freed once its write is finished; it counts now.
    ///
    /// # Complexity
    /// One search of the table (O(log n) in the resident objects) and O(log n) in the number of
    /// free extents.
    pub fn free(&mut self, key: &str) -> Option<u64> {
        match self.free_stamped(key, None) {
            Freed::Bytes(n) => Some(n),
            Freed::Unknown | Freed::Stale => None,
        }
    }

    /// As [`Arena::free`], and with `stamp` only if the resident object carries it: one of
    /// another stamp (a replacement published under the same key since) is left as it is. One
    /// search of the table: the object is taken out first and put back in the rare cases it
    /// stays (another stamp, or still being written), where a look, then a free, searched it
    /// three times (a line of a million unknown keys held the writer about 0.1 s; BENCHMARKS.md).
    pub fn free_stamped(&mut self, key: &str, stamp: Option<u64>) -> Freed {
        let Some((k, mut o)) = self.objects.remove_entry(key) else {
            return Freed::Unknown;
        };
        if stamp.is_some_and(|s| s != o.stamp) {
            self.objects.insert(k, o);
            return Freed::Stale;
        }
        if o.writing {
            // Its caller still writes there: freed when it is done (Arena::finish_write).
            let first = !o.free_pending;
            o.free_pending = true;
            let len = o.len;
            self.objects.insert(k, o);
            return if first {
                Freed::Bytes(len)
            } else {
                Freed::Unknown
            };
        }
        self.clear_stamp(&o);
        let freed = self.alloc.free(o.extent);
        debug_assert!(freed, "a resident object's extent is live");
        Freed::Bytes(o.len)
    }

    /// Frees every resident object whose key starts with `prefix` (checked by the caller:
    /// [`crate::key::check_prefix`]); returns how many and their bytes. Costs a range scan of
    /// the matching keys only.
    pub fn free_prefix(&mut self, prefix: &str) -> (u64, u64) {
        use std::ops::Bound;
        let keys: Vec<Key> = self
            .objects
            .range::<str, _>((Bound::Included(prefix), Bound::Unbounded))
            .map(|(k, _)| k)
            .take_while(|k| k.as_str().starts_with(prefix))
            .cloned()
            .collect();
        let (mut objects, mut bytes) = (0, 0);
        for k in keys {
            if let Some(b) = self.free(k.as_str()) {
                objects += 1;
                bytes += b;
            }
        }
        (objects, bytes)
    }

    /// Checks the allocator's invariants and that the object table matches it; for tests.
    pub fn check_invariants(&self) {
        let live: Vec<Extent> = self.objects.values().map(|o| o.extent).collect();
        self.alloc.check(&live);
        let writing = self.objects.iter().filter(|(_, o)| o.writing);
        let index = self.writing.lock();
        assert_eq!(writing.clone().count(), index.len());
        let local = self.region.local_base();
        for (k, o) in writing {
            let entry = (k.clone(), local + o.extent.offset, o.len);
            assert_eq!(index.get(&o.stamp), Some(&entry), "the index of {k}");
        }
    }
}

/// Bytes an object of `len` bytes takes before alignment: its bytes, rounded up to 8, and its
/// stamp.
fn extent_len(len: u64) -> Option<u64> {
    stamp_offset(len).checked_add(STAMP_BYTES)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{ShmRegion, ShmSession};
    use crate::tensor::{Tensor, TensorData};
    use crate::transport::{Destination, ReadOp, ShmTransport, Transport};

    fn sample(id: &str, sizes: &[usize], fill: u8, replace: bool) -> Sample {
        let mut s = Sample::new("st", id, 1).unwrap().with_replace(replace);
        for (i, &n) in sizes.iter().enumerate() {
            let t = Tensor::new(
                format!("t{i}"),
                vec![n as u64],
                Dtype::Uint8,
                TensorData::host(vec![fill; n]),
            )
            .unwrap();
            s.push(t).unwrap();
        }
        s
    }

    fn arena(bytes: u64) -> Arena {
        Arena::new(
            Box::new(ShmRegion::create(bytes).unwrap()),
            256,
            "127.0.0.1:1".into(),
        )
        .unwrap()
    }

    /// The 8 bytes at `at` as a reader sees them.
    fn stamp(a: &Arena, at: u64) -> u64 {
        let s: ShmSession = a.arena_ref().session.parse().unwrap();
        let v = ShmTransport::open(&s).unwrap();
        let mut out = [0u8; 8];
        v.read(&mut [ReadOp {
            address: at,
            into: Destination::Host(&mut out),
        }])
        .unwrap();
        u64::from_le_bytes(out)
    }

    fn read(a: &Arena, key: &str) -> Vec<u8> {
        let s: ShmSession = a.arena_ref().session.parse().unwrap();
        let v = ShmTransport::open(&s).unwrap();
        let o = a.object(key).unwrap();
        let mut out = vec![0; o.len as usize];
        v.read(&mut [ReadOp {
            address: a.address(key).unwrap(),
            into: Destination::Host(&mut out),
        }])
        .unwrap();
        out
    }

    #[test]
    fn the_lease_queue_holds_about_the_resident_objects_however_many_were_published_and_freed() {
        // With a TTL every publication queued its lease, and an entry left only once its TTL
        // passed: published and freed at 50k objects/s under a 600 s TTL, 30 million entries
        // (GBs) for a nearly empty arena.
        let mut a = arena(1 << 20);
        a.set_ttl(Some(Duration::from_secs(3600)));
        a.publish(&[sample("kept", &[10], 1, false)])
            .unwrap()
            .unwrap();
        for i in 0..10_000 {
            let id = format!("s{i}");
            a.publish(&[sample(&id, &[10], 1, false)]).unwrap().unwrap();
            assert!(a.free(&format!("st/{id}/g1/t0")).is_some());
        }
        assert!(
            a.ages.len() <= 2 * a.objects.len() + 65,
            "{} lease entries for {} objects",
            a.ages.len(),
            a.objects.len()
        );
        // The object still resident keeps its lease.
        assert_eq!(
            a.expire(Instant::now() + Duration::from_secs(3601), 100),
            (1, 10)
        );
    }

    /// A sample of `n`-byte objects (`t0`, `t1`, ...) whose bytes its submitter writes.
    fn reserved(id: &str, sizes: &[u64]) -> Sample {
        let mut s = Sample::new("st", id, 1).unwrap();
        for (i, &n) in sizes.iter().enumerate() {
            let t = Tensor::new(
                format!("t{i}"),
                vec![n],
                Dtype::Uint8,
                TensorData::Reserved(n),
            )
            .unwrap();
            s.push(t).unwrap();
        }
        s
    }

    #[test]
    fn an_object_freed_or_expired_while_written_stays_in_the_table_until_its_write_is_finished() {
        // A free (or a lease's end) while the object is written waits for the write: the table
        // the writing threads check keeps the object until then, and the finish by name applies
        // the free.
        let mut a = arena(1 << 20);
        a.set_ttl(Some(Duration::from_secs(1)));
        let samples = [reserved("a", &[24]), reserved("b", &[40])];
        let r = a.reserve(&samples).unwrap().unwrap();
        let p = a.commit_reserved(r, &samples);
        let name = |i: usize| {
            let (pb, f) = (&p.published[i], &p.published[i].features["t0"]);
            let at = pb.writable.as_ref().unwrap()["t0"];
            Written {
                stamp: f.stamp.unwrap(),
                at,
                len: f.shape[0],
            }
        };
        let reserved = a.reserved_objects();
        assert_eq!(a.free("st/a/g1/t0"), Some(24));
        assert_eq!(
            a.expire(Instant::now() + Duration::from_secs(2), 10),
            (1, 40)
        );
        assert_eq!(reserved.len(), 2);
        assert_eq!(reserved.check(&name(0)), Ok(()));
        a.check_invariants();
        // Finished: the free asked for meanwhile is applied, and counted once.
        assert_eq!(a.finish_written(name(0), true), Some((true, 0)));
        assert!(a.object("st/a/g1/t0").is_none());
        assert_eq!(a.finish_written(name(1), false), Some((false, 0)));
        assert!(reserved.is_empty());
        assert_eq!(a.report().resident_objects, 0);
        a.check_invariants();
    }

    #[test]
    fn a_write_finished_by_stamp_finishes_only_the_object_written_there() {
        // Two requests' objects reserved; request a's writer finishes what it wrote, named by
        // stamp and address, not by key: a mix-up of keys cannot finish b's objects, and an
        // address that is not the stamp's object fails that object (its bytes are elsewhere).
        let mut a = arena(1 << 20);
        let samples = [
            reserved("a", &[24, 100]),
            reserved("b", &[24, 100]),
            reserved("c", &[8]),
        ];
        let r = a.reserve(&samples).unwrap().unwrap();
        let p = a.commit_reserved(r, &samples);
        let local = a.region().local_base();
        let written = |p: &Published, name: &str| {
            let f = &p.features[name];
            Written {
                stamp: f.stamp.unwrap(),
                at: p.writable.as_ref().unwrap()[name],
                len: f.shape[0],
            }
        };
        let (a0, a1) = (
            written(&p.published[0], "t0"),
            written(&p.published[0], "t1"),
        );
        let b0 = written(&p.published[1], "t0");
        assert_eq!(a0.at, local + a.object("st/a/g1/t0").unwrap().extent.offset);
        a.check_invariants();

        // The table the writing threads check their destinations against holds each object
        // being written, where it lies and its length.
        let reserved = a.reserved_objects();
        assert_eq!(reserved.len(), 5);
        assert_eq!(reserved.check(&a0), Ok(()));
        assert!(reserved.check(&Written { at: b0.at, ..a0 }).is_err());
        assert!(reserved.check(&Written { len: 23, ..a0 }).is_err());

        // a's objects, finished by what was written: finished, stamps readable, b untouched.
        assert_eq!(a.finish_written(a0, true), Some((true, 0)));
        assert_eq!(a.finish_written(a1, true), Some((true, 0)));
        for k in ["st/a/g1/t0", "st/a/g1/t1"] {
            let o = a.object(k).unwrap();
            assert!(!o.writing);
            assert_eq!(
                stamp(&a, a.address(k).unwrap() + stamp_offset(o.len)),
                o.stamp
            );
        }
        assert!(a.object("st/b/g1/t0").unwrap().writing);
        // Finished once: its stamp names no object being written any more.
        assert_eq!(a.finish_written(a0, true), None);
        assert!(reserved.check(&a0).is_err());
        a.check_invariants();

        // b's t0 named by its stamp, but written at a's address: failed and freed.
        let wrong = Written { at: a0.at, ..b0 };
        assert_eq!(a.finish_written(wrong, true), Some((false, 24)));
        assert!(a.object("st/b/g1/t0").is_none());
        assert!(a.object("st/b/g1/t1").unwrap().writing);
        // A failure that names b's t1 elsewhere is not its writer's: left as it is. A stamp of
        // nothing is ignored (stamps start at 1).
        let b1 = written(&p.published[1], "t1");
        let elsewhere = Written { at: a1.at, ..b1 };
        assert_eq!(a.finish_written(elsewhere, false), None);
        assert!(a.object("st/b/g1/t1").unwrap().writing);
        assert_eq!(a.finish_written(Written { stamp: 0, ..b1 }, true), None);
        assert_eq!(a.finish_written(Written { stamp: 0, ..b1 }, false), None);
        a.check_invariants();
        // A length that is not the object's fails a finished write too.
        assert_eq!(
            a.finish_written(Written { len: 99, ..b1 }, true),
            Some((false, 100))
        );
        // A failure by name that lies there fails the object.
        let c0 = written(&p.published[2], "t0");
        assert_eq!(a.finish_written(c0, false), Some((false, 8)));
        assert!(a.object("st/c/g1/t0").is_none());
        assert!(reserved.is_empty());
        assert_eq!(a.report().resident_objects, 2);
        a.check_invariants();
    }

    #[test]
    fn a_stamped_free_frees_only_the_object_of_its_stamp_in_one_search() {
        let mut a = arena(4096);
        let p = a
            .publish(&[sample("s0", &[100, 10], 7, false)])
            .unwrap()
            .unwrap();
        let s0 = p.published[0].features["t0"].stamp.unwrap();
        // Another stamp: left as it is, readable, its stamp word untouched.
        assert_eq!(a.free_stamped("st/s0/g1/t0", Some(s0 ^ 1)), Freed::Stale);
        assert_eq!(a.stamp_of("st/s0/g1/t0"), Some(s0));
        assert_eq!(read(&a, "st/s0/g1/t0"), vec![7; 100]);
        assert_eq!(a.report().resident_objects, 2);
        // Its own stamp: freed, and then unknown.
        assert_eq!(a.free_stamped("st/s0/g1/t0", Some(s0)), Freed::Bytes(100));
        assert_eq!(a.free_stamped("st/s0/g1/t0", Some(s0)), Freed::Unknown);
        assert_eq!(a.free_stamped("", None), Freed::Unknown);
        // No stamp: freed whatever it carries.
        assert_eq!(a.free_stamped("st/s0/g1/t1", None), Freed::Bytes(10));
        let r = a.report();
        assert_eq!((r.resident_objects, r.free_bytes), (0, 4096));
    }

    #[test]
    fn publishes_reads_and_frees() {
        let mut a = arena(4096);
        let p = a
            .publish(&[sample("s0", &[1000, 10], 7, false)])
            .unwrap()
            .unwrap();
        assert_eq!((p.objects, p.bytes, p.replaced), (2, 1010, 0));
        let r = &p.published[0];
        assert_eq!(r.features["t0"].shape, [1000]);
        // In the sample's order: the first at the region's start, the next against its end.
        let base = a.region().base_address();
        assert_eq!(r.features["t0"].address, base);
        assert_eq!(r.features["t1"].address, base + 4096 - 256);
        assert_eq!(read(&a, "st/s0/g1/t0"), vec![7; 1000]);
        assert_eq!(a.report().free_bytes, 4096 - 1024 - 256);
        // Each stamp sits after its object's bytes (rounded up to 8), unique, cleared by a free.
        let (s0, s1) = (r.features["t0"].stamp, r.features["t1"].stamp);
        assert!(
            s0.is_some_and(|s| (1..=MAX_STAMP).contains(&s)) && s1 != s0,
            "{s0:?} {s1:?}"
        );
        assert_eq!(stamp(&a, r.features["t0"].address + 1000), s0.unwrap());
        assert_eq!(stamp(&a, r.features["t1"].address + 16), s1.unwrap());
        assert_eq!(a.free("st/s0/g1/t0"), Some(1000));
        assert_eq!(
            stamp(&a, r.features["t0"].address + 1000),
            0,
            "a free clears the stamp"
        );
        assert_eq!(a.free("st/s0/g1/t0"), None, "idempotent");
        assert_eq!(a.free("st/s0/g1/t1"), Some(10));
        let rep = a.report();
        assert_eq!(
            (rep.free_bytes, rep.free_extents, rep.resident_objects),
            (4096, 1, 0)
        );
    }

    #[test]
    fn batch_is_all_or_nothing() {
        let mut a = arena(4096);
        a.publish(&[sample("a", &[2048], 1, false)])
            .unwrap()
            .unwrap();
        // Two samples, the second does not fit: nothing of the first stays.
        let r = a
            .publish(&[
                sample("b", &[1024], 2, false),
                sample("c", &[2048], 3, false),
            ])
            .unwrap();
        assert!(r.is_none());
        assert_eq!(a.report().resident_objects, 1);
        assert!(a.object("st/b/g1/t0").is_none());
        a.check_invariants();
        // Too big for the whole arena: an error at once.
        let e = a.publish(&[sample("d", &[4097], 1, false)]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::BatchTooLarge {
                    needed: 4352,
                    capacity: 4096
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn duplicate_key_and_replace() {
        let mut a = arena(4096);
        a.publish(&[sample("a", &[1000], 1, false)])
            .unwrap()
            .unwrap();
        let before = a.report();
        let e = a
            .publish(&[sample("b", &[10], 1, false), sample("a", &[10], 2, false)])
            .unwrap_err();
        assert!(
            matches!(&e, Error::KeyExists { key } if key == "st/a/g1/t0"),
            "{e}"
        );
        assert_eq!(a.report(), before, "unchanged");
        let e = a
            .publish(&[sample("b", &[10], 1, false), sample("b", &[10], 2, false)])
            .unwrap_err();
        assert!(e.to_string().contains("appears twice in one batch"), "{e}");
        // Replace: the old object goes, the new one takes its place; one copy only.
        let p = a
            .publish(&[sample("a", &[1000], 9, true)])
            .unwrap()
            .unwrap();
        assert_eq!(p.replaced, 1);
        assert_eq!(a.report().resident_objects, 1);
        assert_eq!(read(&a, "st/a/g1/t0"), vec![9; 1000]);
        // A replace that does not fit restores the old object exactly.
        a.publish(&[sample("x", &[2048], 5, false)])
            .unwrap()
            .unwrap();
        let before = a.report();
        let addr = a.address("st/a/g1/t0");
        assert!(a
            .publish(&[sample("a", &[3000], 4, true)])
            .unwrap()
            .is_none());
        assert_eq!(a.report(), before);
        assert_eq!(a.address("st/a/g1/t0"), addr);
        assert_eq!(read(&a, "st/a/g1/t0"), vec![9; 1000]);
        a.check_invariants();
    }

    #[test]
    fn reuse_after_free_and_coalescing() {
        // Objects of 1016 bytes take 1024 with their stamps.
        let mut a = arena(8192);
        for i in 0..8 {
            a.publish(&[sample(&format!("s{i}"), &[1016], i as u8, false)])
                .unwrap()
                .unwrap();
        }
        assert!(a
            .publish(&[sample("big", &[4088], 1, false)])
            .unwrap()
            .is_none());
        for i in [2, 3, 4, 5] {
            a.free(&format!("st/s{i}/g1/t0")).unwrap();
        }
        // s0 is at 0 and s1..s7 fill down from the top, so s2..s5 are neighbours: coalesced
        // into one 4096-byte hole, and the big one fits exactly there.
        let p = a
            .publish(&[sample("big", &[4088], 1, false)])
            .unwrap()
            .unwrap();
        assert_eq!(
            p.published[0].features["t0"].address,
            a.region().base_address() + 3072
        );
        a.check_invariants();
    }
}
