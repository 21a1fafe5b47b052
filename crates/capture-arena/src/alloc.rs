//! Best-fit extent allocator over one region `[0, capacity)`. Offsets only: it never touches the
//! memory it manages, so it serves shared memory, GPU memory and memory registered with a transfer
//! engine alike.
//!
//! ```text
//!  offset 0                                                         capacity
//!  |--live--|....free....|--live--|--live--|.........free..........|
//!            \_ by_offset[o] = len, by_size contains (len, o)
//! ```
//!
//! Free extents live in two ordered indexes: by offset (to find both neighbours when an extent is
//! freed, so free space is always fully coalesced) and by `(len, offset)` packed into one `u128`
//! (best fit: the smallest free extent that holds the request, lowest offset among equals). An
//! allocation takes the *end* of the chosen extent, so the remainder keeps its offset and its
//! by-offset entry is updated in place. Every operation is four to seven B-tree operations:
//! O(log n) in the number of free extents.

use std::collections::{BTreeMap, BTreeSet};

use crate::error::{Error, Result};

/// Default alignment of every extent: 256 bytes, so device copies into the arena stay aligned.
pub const DEFAULT_ALIGNMENT: u64 = 256;

/// An allocated range `[offset, offset + len)`; `len` is already rounded up to the alignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Extent {
    /// First byte, a multiple of the allocator's alignment.
    pub offset: u64,
    /// Length in bytes, a non-zero multiple of the allocator's alignment.
    pub len: u64,
}

impl Extent {
    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// Free-space figures, cheap to take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Report {
    /// Usable bytes (capacity rounded down to the alignment).
    pub capacity: u64,
    /// Bytes not allocated.
    pub free_bytes: u64,
    /// The largest single free extent: the biggest allocation that can succeed now.
    pub largest_free: u64,
    /// Number of free extents (1 when everything is free).
    pub free_extents: u64,
    /// Number of live (allocated) extents.
    pub live_extents: u64,
}

/// The allocator. See the module docs for the structure.
///
/// Invariants (checked by [`Allocator::check`] in tests):
/// - `by_offset` and `by_size` hold the same extents;
/// - free extents are disjoint, non-empty, aligned, inside `[0, capacity)`, and no two touch
///   (they are coalesced);
/// - `free_bytes` is the sum of free extent lengths; `live` counts allocated extents.
///
/// The allocator does not keep a table of live extents (it would cost a hash-table miss on every
/// operation): the caller keeps the [`Extent`]s it was given, as the arena's object table does.
#[derive(Debug, Clone)]
pub struct Allocator {
    capacity: u64,
    alignment: u64,
    by_offset: BTreeMap<u64, u64>,
    by_size: BTreeSet<u128>,
    live: u64,
    free_bytes: u64,
}

impl Allocator {
    /// An allocator over `[0, capacity)` with every extent aligned to `alignment`.
    /// A capacity that is not a multiple of the alignment is rounded down.
    ///
    /// # Errors
    /// [`Error::Config`] if `alignment` is not a power of two or the rounded capacity is zero.
    pub fn new(capacity: u64, alignment: u64) -> Result<Allocator> {
        if !alignment.is_power_of_two() {
            return Err(Error::config(
                "SGLANG_SPEC_CAPTURE_ARENA_ALIGN",
                format!("{alignment} is not a power of two (default {DEFAULT_ALIGNMENT})"),
            ));
        }
        let usable = capacity & !(alignment - 1);
        if usable == 0 {
            return Err(Error::config(
                "SGLANG_SPEC_CAPTURE_ARENA_BYTES",
                format!(
                    "{capacity} bytes do not hold one {alignment}-byte aligned extent; set at \
                     least {alignment}"
                ),
            ));
        }
        let capacity = usable;
        let mut a = Allocator {
            capacity,
            alignment,
            by_offset: BTreeMap::new(),
            by_size: BTreeSet::new(),
            live: 0,
            free_bytes: 0,
        };
        a.insert_free(0, capacity);
        Ok(a)
    }

    /// Usable bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The alignment of every offset and length.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// The length an allocation of `len` bytes really takes: rounded up to the alignment, at least
    /// one alignment unit (so every object, even an empty one, has its own address). `None` on
    /// overflow.
    pub fn aligned_len(&self, len: u64) -> Option<u64> {
        let a = self.alignment - 1;
        len.max(1).checked_add(a).map(|l| l & !a)
    }

    /// Allocates `len` bytes from the smallest free extent that holds them (the lowest-offset one
    /// among equals), taking that extent's end. Returns `None` when no free extent is large
    /// enough (nothing changes then).
    ///
    /// # Complexity
    /// O(log n) in the number of free extents.
    pub fn allocate(&mut self, len: u64) -> Option<Extent> {
        let need = self.aligned_len(len)?;
        let &k = self.by_size.range(size_key(need, 0)..).next()?;
        let (size, offset) = unkey(k);
        self.by_size.remove(&k);
        if size == need {
            self.by_offset.remove(&offset);
        } else {
            let rest = size - need;
            if let Some(l) = self.by_offset.get_mut(&offset) {
                *l = rest;
            }
            self.by_size.insert(size_key(rest, offset));
        }
        self.free_bytes -= need;
        self.live += 1;
        Some(Extent {
            offset: offset + size - need,
            len: need,
        })
    }

    /// Takes exactly `extent`, which must lie inside one free extent. Used to put back the
    /// objects a failed `replace` batch had freed. Returns false (and changes nothing) if any
    /// byte of it is not free.
    ///
    /// # Complexity
    /// O(log n).
    pub fn reserve_exact(&mut self, extent: Extent) -> bool {
        let Some((&off, &size)) = self.by_offset.range(..=extent.offset).next_back() else {
            return false;
        };
        if extent.len == 0 || extent.end() > off + size {
            return false;
        }
        self.remove_free(off, size);
        if extent.offset > off {
            self.insert_free(off, extent.offset - off);
        }
        if off + size > extent.end() {
            self.insert_free(extent.end(), off + size - extent.end());
        }
        self.live += 1;
        true
    }

    /// Returns a live extent to the free space, merging it with free neighbours on both sides.
    ///
    /// `extent` must be one that [`Allocator::allocate`] or [`Allocator::reserve_exact`]
    /// returned and that has not been freed since. A double free (or any extent that overlaps free
    /// space, or lies outside the region) is detected, changes nothing and returns false. Freeing
    /// a made-up extent that covers only live space cannot be detected: the caller owns that
    /// bookkeeping (the arena's object table holds each object's exact extent). Either way the
    /// allocator's own metadata stays consistent and no memory is touched.
    ///
    /// # Complexity
    /// O(log n).
    pub fn free(&mut self, extent: Extent) -> bool {
        let (start, end) = (extent.offset, extent.offset.wrapping_add(extent.len));
        if extent.len == 0 || end < start || end > self.capacity || start % self.alignment != 0 {
            return false;
        }
        let prev = self
            .by_offset
            .range(..=start)
            .next_back()
            .map(|(&o, &l)| (o, l));
        let next = self.by_offset.range(start..).next().map(|(&o, &l)| (o, l));
        if prev.is_some_and(|(o, l)| o + l > start) || next.is_some_and(|(o, _)| o < end) {
            return false; // overlaps free space: a double free
        }
        match (
            prev.filter(|&(o, l)| o + l == start),
            next.filter(|&(o, _)| o == end),
        ) {
            (Some((po, pl)), next) => {
                // Grow the left neighbour in place (its offset, the by-offset key, stays).
                self.by_size.remove(&size_key(pl, po));
                let mut len = pl + extent.len;
                if let Some((no, nl)) = next {
                    self.by_offset.remove(&no);
                    self.by_size.remove(&size_key(nl, no));
                    len += nl;
                }
                if let Some(l) = self.by_offset.get_mut(&po) {
                    *l = len;
                }
                self.by_size.insert(size_key(len, po));
            }
            (None, Some((no, nl))) => {
                self.by_offset.remove(&no);
                self.by_size.remove(&size_key(nl, no));
                self.by_offset.insert(start, extent.len + nl);
                self.by_size.insert(size_key(extent.len + nl, start));
            }
            (None, None) => {
                self.by_offset.insert(start, extent.len);
                self.by_size.insert(size_key(extent.len, start));
            }
        }
        self.free_bytes += extent.len;
        self.live -= 1;
        true
    }

    /// Free bytes.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// The largest free extent (0 when full).
    pub fn largest_free(&self) -> u64 {
        self.by_size.last().map_or(0, |&k| unkey(k).0)
    }

    /// Free-space figures.
    pub fn report(&self) -> Report {
        Report {
            capacity: self.capacity,
            free_bytes: self.free_bytes,
            largest_free: self.largest_free(),
            free_extents: self.by_offset.len() as u64,
            live_extents: self.live,
        }
    }

    /// The free extents in offset order.
    pub fn free_extents(&self) -> impl Iterator<Item = Extent> + '_ {
        self.by_offset
            .iter()
            .map(|(&offset, &len)| Extent { offset, len })
    }

    /// Checks every invariant listed on the type, given the caller's live extents; panics with a
    /// description on the first broken one. O(n log n); for tests.
    pub fn check(&self, live: &[Extent]) {
        assert_eq!(
            self.by_offset.len(),
            self.by_size.len(),
            "index sizes differ"
        );
        assert_eq!(self.live, live.len() as u64, "live extent count");
        let mut tiles: Vec<(u64, u64, bool)> = Vec::new();
        let mut sum = 0;
        for (&o, &l) in &self.by_offset {
            assert!(
                self.by_size.contains(&size_key(l, o)),
                "free {o}+{l} missing by size"
            );
            tiles.push((o, l, true));
            sum += l;
        }
        assert_eq!(sum, self.free_bytes, "free byte count");
        tiles.extend(live.iter().map(|e| (e.offset, e.len, false)));
        tiles.sort_unstable();
        let mut at = 0;
        let mut prev_free = false;
        for (o, l, is_free) in tiles {
            assert_eq!(o, at, "gap or overlap at {at}");
            assert!(l > 0 && o % self.alignment == 0 && l % self.alignment == 0);
            assert!(!(prev_free && is_free), "uncoalesced free extents at {o}");
            prev_free = is_free;
            at = o + l;
        }
        assert_eq!(at, self.capacity, "extents do not cover the capacity");
    }

    fn insert_free(&mut self, offset: u64, len: u64) {
        self.by_offset.insert(offset, len);
        self.by_size.insert(size_key(len, offset));
        self.free_bytes += len;
    }

    fn remove_free(&mut self, offset: u64, len: u64) {
        self.by_offset.remove(&offset);
        self.by_size.remove(&size_key(len, offset));
        self.free_bytes -= len;
    }
}

/// `(len, offset)` as one integer, ordered by length, then offset.
fn size_key(len: u64, offset: u64) -> u128 {
    (u128::from(len) << 64) | u128::from(offset)
}

fn unkey(k: u128) -> (u64, u64) {
    ((k >> 64) as u64, k as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ext(offset: u64, len: u64) -> Extent {
        Extent { offset, len }
    }

    #[test]
    fn rejects_bad_geometry() {
        assert!(Allocator::new(1024, 3).is_err());
        assert!(Allocator::new(255, 256).is_err());
        assert_eq!(Allocator::new(1000, 256).unwrap().capacity(), 768);
    }

    #[test]
    fn exact_offsets_and_coalescing() {
        let mut a = Allocator::new(4096, 256).unwrap();
        // Each allocation takes the end of the (only) free extent.
        let x = a.allocate(1).unwrap();
        let y = a.allocate(256).unwrap();
        let z = a.allocate(257).unwrap();
        assert_eq!((x, y, z), (ext(3840, 256), ext(3584, 256), ext(3072, 512)));
        assert_eq!(
            a.allocate(0),
            Some(ext(2816, 256)),
            "empty objects take one unit"
        );
        assert!(a.free(ext(2816, 256)));
        // Free the middle, then the right: they coalesce, and the left neighbour stays live.
        assert!(a.free(y));
        assert!(a.free(x));
        assert_eq!(
            a.free_extents().collect::<Vec<_>>(),
            [ext(0, 3072), ext(3584, 512)]
        );
        // Best fit: a 512-byte request takes the 512-byte hole, not the big extent.
        assert_eq!(a.allocate(400), Some(ext(3584, 512)));
        assert!(a.free(ext(3584, 512)));
        // Free the last live extent: both neighbours merge into one extent of the capacity.
        assert!(a.free(z));
        assert_eq!(a.free_extents().collect::<Vec<_>>(), [ext(0, 4096)]);
        a.check(&[]);
        // The whole region is allocatable at offset 0: zero fragmentation left.
        assert_eq!(a.allocate(4096), Some(ext(0, 4096)));
        assert_eq!(a.allocate(1), None);
    }

    #[test]
    fn best_fit_prefers_the_lowest_offset_among_equal_holes() {
        let mut a = Allocator::new(8 * 256, 256).unwrap();
        let e: Vec<Extent> = (0..8).map(|_| a.allocate(256).unwrap()).collect();
        // e[i] is at (7 - i) * 256. Open holes at offsets 256 and 1280, both one unit.
        assert!(a.free(e[6]) && a.free(e[2]));
        assert_eq!(a.allocate(1), Some(ext(256, 256)));
        assert_eq!(a.allocate(1), Some(ext(1280, 256)));
        assert_eq!(a.allocate(1), None);
    }

    #[test]
    fn double_free_is_refused_and_harmless() {
        let mut a = Allocator::new(1024, 256).unwrap();
        let x = a.allocate(256).unwrap(); // 768
        let y = a.allocate(256).unwrap(); // 512
        assert!(a.free(x));
        assert!(!a.free(x));
        assert!(!a.free(ext(0, 256)), "never allocated (free space)");
        assert!(!a.free(ext(256, 512)), "overlaps free space");
        assert!(!a.free(ext(1024, 256)), "outside the region");
        assert!(!a.free(ext(1, 256)), "misaligned");
        a.check(&[y]);
        assert_eq!(a.report().live_extents, 1);
        assert!(a.free(y));
        assert_eq!(a.report().free_extents, 1);
    }

    #[test]
    fn reserve_exact_restores_a_freed_extent() {
        let mut a = Allocator::new(4096, 256).unwrap();
        let x = a.allocate(512).unwrap(); // 3584
        let y = a.allocate(512).unwrap(); // 3072
        assert!(a.free(y));
        assert!(!a.reserve_exact(ext(3328, 512)), "overlaps live x");
        assert!(a.reserve_exact(y));
        a.check(&[x, y]);
        assert!(a.free(x) && a.free(y));
        assert!(a.reserve_exact(ext(1024, 256)));
        a.check(&[ext(1024, 256)]);
        assert_eq!(a.report().free_extents, 2);
    }

    #[test]
    fn reports() {
        let mut a = Allocator::new(1 << 20, 256).unwrap();
        let xs: Vec<_> = (0..10).map(|_| a.allocate(1000).unwrap()).collect();
        for x in xs.iter().step_by(2) {
            a.free(*x);
        }
        let r = a.report();
        assert_eq!(r.live_extents, 5);
        assert_eq!(r.free_extents, 6);
        assert_eq!(r.largest_free, (1 << 20) - 10 * 1024);
        assert_eq!(r.free_bytes, (1 << 20) - 5 * 1024);
    }

    /// The trivial model: a map of live ranges; every check is a linear scan.
    #[derive(Default)]
    struct Shadow {
        live: BTreeMap<u64, u64>,
    }
    impl Shadow {
        fn add(&mut self, e: Extent, cap: u64) {
            assert!(e.end() <= cap, "{e:?} out of bounds");
            if let Some((&o, &l)) = self.live.range(..e.end()).next_back() {
                assert!(o + l <= e.offset, "{e:?} overlaps {o}+{l}");
            }
            self.live.insert(e.offset, e.len);
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64),
        Free(usize),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        proptest::collection::vec(
            prop_oneof![
                3 => (0u64..5000).prop_map(Op::Alloc),
                2 => any::<usize>().prop_map(Op::Free),
            ],
            1..300,
        )
    }

    proptest! {
        #[test]
        fn matches_model(ops in ops(), align_log in 0u32..10) {
            let align = 1u64 << align_log;
            let cap = 64 * 1024;
            let mut a = Allocator::new(cap, align).unwrap();
            let mut shadow = Shadow::default();
            let mut held: Vec<Extent> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(n) => match a.allocate(n) {
                        Some(e) => {
                            prop_assert!(e.len >= n && e.offset % align == 0);
                            shadow.add(e, cap);
                            held.push(e);
                        }
                        None => prop_assert!(a.largest_free() < a.aligned_len(n).unwrap()),
                    },
                    Op::Free(i) if !held.is_empty() => {
                        let e = held.swap_remove(i % held.len());
                        prop_assert!(a.free(e));
                        shadow.live.remove(&e.offset);
                    }
                    Op::Free(_) => {}
                }
                a.check(&held);
            }
            for e in held.drain(..) {
                prop_assert!(a.free(e));
            }
            prop_assert_eq!(a.free_extents().collect::<Vec<_>>(), vec![ext(0, cap)]);
        }
    }
}
