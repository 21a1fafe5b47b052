//! Extent allocator over one region `[0, capacity)`, placing by **youngest-neighbour fit**.
//! Offsets only: it never touches the memory it manages, so it serves shared memory, GPU memory
//! and memory registered with a transfer engine alike.
//!
//! ```text
//!  offset 0                                                              capacity
//!  |--A(3)--|......free......|--B(7)--|--C(8)--|.......free........|--D(2)--|
//!            age max(3, 7)=7                    age max(8, 2) = 8
//!  allocate(n): the free extent of the greatest age that holds n (here the second), taking
//!  its side next to the younger neighbour:  |--C(8)--|--E(9)--|....free....|--D(2)--|
//! ```
//!
//! Every live extent carries a stamp, the allocation's sequence number; a free extent's *age* is
//! the stamp of its younger live neighbour (the region's edges count as the oldest). An
//! allocation takes the *youngest* free extent that holds it (greatest age; among equal ages the
//! higher offset), and within it the end next to that younger neighbour, so the remainder stays
//! next to the older one. The exception is a free extent that touches the region's edge: the
//! allocation goes against the edge, since a remainder left there could never grow (an edge is
//! never freed). So in an empty region the first allocation takes offset 0 and the next ones
//! fill down from the top; once the region is full, allocations run round it as a ring.
//!
//! Why: trainers free samples roughly in the order they were published, out of order only
//! within a window. Objects placed next to the youngest ones form runs of objects published
//! together, which are freed together, so a free opens space next to other frees and the
//! allocator's exact coalescing makes large extents of them; a remainder waits next to the
//! older neighbour, which goes first. Best fit, the policy before, drops a young object into
//! whatever hole is tightest, usually among old objects; when those are freed, the young one
//! splits the space they leave. `cargo bench -p capture-arena --bench fragmentation` compares
//! the policies (BENCHMARKS.md, "Effective capacity").
//!
//! Indexes: free extents by offset (both neighbours of a freed extent, so free space is always
//! fully coalesced; each free extent also records its neighbours' stamps), the same extents in
//! a treap ordered by `(age, offset)` whose nodes know their subtree's longest extent
//! (`by_age`: the youngest fit is one walk from the root), and live extents by offset (their
//! stamps, and an exact check that a freed extent is one that was handed out). Every operation
//! is a handful of O(log n) steps (expected, for the treap).

mod by_age;

use std::collections::BTreeMap;

use self::by_age::ByAge;
use crate::error::{Error, Result};

/// Default alignment of every extent: 256 bytes, so device copies into the arena stay aligned.
pub const DEFAULT_ALIGNMENT: u64 = 256;
/// `SGLANG_SPEC_CAPTURE_ARENA_ALIGN`: the setting of the alignment, a power of two (read by
/// [`crate::config`]; named here, where errors about the alignment say what to change).
pub const ENV_ARENA_ALIGN: &str = "SGLANG_SPEC_CAPTURE_ARENA_ALIGN";

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

/// A free extent: its length and the stamps of its live neighbours (0: the region's edge).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Free {
    len: u64,
    left: u64,
    right: u64,
}

impl Free {
    /// The stamp of the younger neighbour.
    fn age(&self) -> u64 {
        self.left.max(self.right)
    }

    /// Whether an allocation from this extent takes its start: the left neighbour is the
    /// younger, or the region's start. A remainder must not be left against an edge, which is
    /// never freed, but next to a live extent, which will be; so for the side an edge counts
    /// as the youngest neighbour (for the extent's age it counts as the oldest).
    fn at_start(&self) -> bool {
        let side = |stamp: u64| if stamp == 0 { u64::MAX } else { stamp };
        side(self.left) >= side(self.right)
    }
}

/// A live extent: its length and the sequence number of the allocation that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Live {
    len: u64,
    stamp: u64,
}

/// The allocator. See the module docs for the policy and the structure.
///
/// Invariants (checked by [`Allocator::check`] in tests):
/// - `free` and `by_age` hold the same extents, keyed by each one's age and offset;
/// - free extents are disjoint, non-empty, aligned, inside `[0, capacity)`, and no two touch
///   (they are coalesced); with the live extents they tile the region;
/// - a free extent's `left`/`right` are the stamps of the live extents touching it (0 at the
///   region's edges); stamps are unique and at most `clock`;
/// - `free_bytes` is the sum of free extent lengths.
#[derive(Debug, Clone)]
pub struct Allocator {
    capacity: u64,
    alignment: u64,
    free: BTreeMap<u64, Free>,
    by_age: ByAge,
    live: BTreeMap<u64, Live>,
    /// The stamp of the latest allocation.
    clock: u64,
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
        let mut a = Allocator {
            capacity: usable,
            alignment,
            free: BTreeMap::new(),
            by_age: ByAge::new(),
            live: BTreeMap::new(),
            clock: 0,
            free_bytes: 0,
        };
        a.insert_free(
            0,
            Free {
                len: usable,
                left: 0,
                right: 0,
            },
        );
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

    /// Allocates `len` bytes by youngest-neighbour fit (module docs): from the free extent next
    /// to the most recently allocated live extent among those that hold `len`, on that
    /// neighbour's side. Returns `None` when no free extent is large enough (nothing changes
    /// then).
    ///
    /// # Complexity
    /// O(log n) in the number of extents (expected, for the treap).
    pub fn allocate(&mut self, len: u64) -> Option<Extent> {
        let need = self.aligned_len(len)?;
        let (key, _) = self.by_age.youngest_fit(need)?;
        let offset = key as u64;
        let f = *self.free.get(&offset)?;
        self.clock += 1;
        let stamp = self.clock;
        self.remove_free(offset, f);
        let rest = f.len - need;
        let at = if f.at_start() {
            if rest > 0 {
                self.insert_free(
                    offset + need,
                    Free {
                        len: rest,
                        left: stamp,
                        right: f.right,
                    },
                );
            }
            offset
        } else {
            if rest > 0 {
                self.insert_free(
                    offset,
                    Free {
                        len: rest,
                        left: f.left,
                        right: stamp,
                    },
                );
            }
            offset + rest
        };
        self.live.insert(at, Live { len: need, stamp });
        Some(Extent {
            offset: at,
            len: need,
        })
    }

    /// Takes exactly `extent`, which must be aligned and lie inside one free extent. Used to put
    /// back the objects a failed `replace` batch had freed (they get a new stamp: placement
    /// treats them as just allocated). Returns false (and changes nothing) if any byte of it is
    /// not free.
    ///
    /// # Complexity
    /// O(log n).
    pub fn reserve_exact(&mut self, extent: Extent) -> bool {
        let a = self.alignment - 1;
        let Some(end) = extent.offset.checked_add(extent.len) else {
            return false;
        };
        if extent.len == 0 || extent.offset & a != 0 || extent.len & a != 0 {
            return false;
        }
        let Some((&off, &f)) = self.free.range(..=extent.offset).next_back() else {
            return false;
        };
        if end > off + f.len {
            return false;
        }
        self.clock += 1;
        let stamp = self.clock;
        self.remove_free(off, f);
        if extent.offset > off {
            self.insert_free(
                off,
                Free {
                    len: extent.offset - off,
                    left: f.left,
                    right: stamp,
                },
            );
        }
        if off + f.len > end {
            self.insert_free(
                end,
                Free {
                    len: off + f.len - end,
                    left: stamp,
                    right: f.right,
                },
            );
        }
        self.live.insert(
            extent.offset,
            Live {
                len: extent.len,
                stamp,
            },
        );
        true
    }

    /// Returns a live extent to the free space, merging it with free neighbours on both sides.
    ///
    /// `extent` must be exactly one that [`Allocator::allocate`] or
    /// [`Allocator::reserve_exact`] returned and that has not been freed since. Anything else
    /// (a double free, a made-up or partial extent, one outside the region) is refused: it
    /// changes nothing and returns false.
    ///
    /// # Complexity
    /// O(log n).
    pub fn free(&mut self, extent: Extent) -> bool {
        if self.live.get(&extent.offset).map(|l| l.len) != Some(extent.len) {
            return false;
        }
        self.live.remove(&extent.offset);
        let (mut start, mut end) = (extent.offset, extent.end());
        let left_free = self
            .free
            .range(..start)
            .next_back()
            .filter(|&(&o, f)| o + f.len == start)
            .map(|(&o, &f)| (o, f));
        let left = match left_free {
            Some((o, f)) => {
                self.remove_free(o, f);
                start = o;
                f.left
            }
            None => self.stamp_ending_at(start),
        };
        let right = match self.free.get(&end).copied() {
            Some(f) => {
                self.remove_free(end, f);
                end += f.len;
                f.right
            }
            None => self.live.get(&end).map_or(0, |l| l.stamp),
        };
        self.insert_free(
            start,
            Free {
                len: end - start,
                left,
                right,
            },
        );
        true
    }

    /// Free bytes.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// The largest free extent (0 when full).
    pub fn largest_free(&self) -> u64 {
        self.by_age.longest()
    }

    /// Free-space figures.
    pub fn report(&self) -> Report {
        Report {
            capacity: self.capacity,
            free_bytes: self.free_bytes,
            largest_free: self.largest_free(),
            free_extents: self.free.len() as u64,
            live_extents: self.live.len() as u64,
        }
    }

    /// The free extents in offset order.
    pub fn free_extents(&self) -> impl Iterator<Item = Extent> + '_ {
        self.free
            .iter()
            .map(|(&offset, f)| Extent { offset, len: f.len })
    }

    /// Checks every invariant listed on the type, given the caller's live extents; panics with a
    /// description on the first broken one. O(n log n); for tests.
    pub fn check(&self, live: &[Extent]) {
        self.by_age.check();
        let mut want: Vec<(u128, u64)> = self
            .free
            .iter()
            .map(|(&o, f)| (by_age::key(f.age(), o), f.len))
            .collect();
        want.sort_unstable();
        assert_eq!(
            self.by_age.entries(),
            want,
            "the indexes of free extents differ"
        );
        let mut given: Vec<(u64, u64)> = live.iter().map(|e| (e.offset, e.len)).collect();
        given.sort_unstable();
        let mine: Vec<(u64, u64)> = self.live.iter().map(|(&o, l)| (o, l.len)).collect();
        assert_eq!(mine, given, "live extents differ from the caller's");
        let mut stamps: Vec<u64> = self.live.values().map(|l| l.stamp).collect();
        stamps.sort_unstable();
        stamps.dedup();
        assert_eq!(stamps.len(), self.live.len(), "stamps are not unique");
        assert!(
            stamps.last().is_none_or(|&s| s <= self.clock),
            "stamp ahead of the clock"
        );
        let mut sum = 0;
        for (&o, f) in &self.free {
            sum += f.len;
            assert_eq!(
                f.left,
                self.stamp_ending_at(o),
                "left stamp of free {o}+{}",
                f.len
            );
            let right = self.live.get(&(o + f.len)).map_or(0, |l| l.stamp);
            assert_eq!(f.right, right, "right stamp of free {o}+{}", f.len);
        }
        assert_eq!(sum, self.free_bytes, "free byte count");
        let mut tiles: Vec<(u64, u64, bool)> =
            self.free.iter().map(|(&o, f)| (o, f.len, true)).collect();
        tiles.extend(self.live.iter().map(|(&o, l)| (o, l.len, false)));
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

    /// The stamp of the live extent ending at `offset`; 0 if none does.
    fn stamp_ending_at(&self, offset: u64) -> u64 {
        self.live
            .range(..offset)
            .next_back()
            .filter(|&(&o, l)| o + l.len == offset)
            .map_or(0, |(_, l)| l.stamp)
    }

    fn insert_free(&mut self, offset: u64, f: Free) {
        self.free.insert(offset, f);
        self.by_age.insert(by_age::key(f.age(), offset), f.len);
        self.free_bytes += f.len;
    }

    fn remove_free(&mut self, offset: u64, f: Free) {
        self.free.remove(&offset);
        self.by_age.remove(by_age::key(f.age(), offset));
        self.free_bytes -= f.len;
    }
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
        // An empty region: the first allocation at 0, the next ones down from the top (against
        // the edge), each next to the one before.
        let x = a.allocate(1).unwrap();
        let y = a.allocate(256).unwrap();
        let z = a.allocate(257).unwrap();
        assert_eq!((x, y, z), (ext(0, 256), ext(3840, 256), ext(3328, 512)));
        assert_eq!(
            a.allocate(0),
            Some(ext(3072, 256)),
            "empty objects take one unit"
        );
        assert!(a.free(ext(3072, 256)));
        // Free y, then x: z stays live between two free extents.
        assert!(a.free(y));
        assert!(a.free(x));
        assert_eq!(
            a.free_extents().collect::<Vec<_>>(),
            [ext(0, 3328), ext(3840, 256)]
        );
        // Both touch z, the youngest; the higher one is too short, so the lower one, against
        // the region's start.
        assert_eq!(a.allocate(400), Some(ext(0, 512)));
        assert!(a.free(ext(0, 512)));
        // Free the last live extent: everything merges into one extent of the capacity.
        assert!(a.free(z));
        assert_eq!(a.free_extents().collect::<Vec<_>>(), [ext(0, 4096)]);
        a.check(&[]);
        // The whole region is allocatable at offset 0: zero fragmentation left.
        assert_eq!(a.allocate(4096), Some(ext(0, 4096)));
        assert_eq!(a.allocate(1), None);
    }

    #[test]
    fn the_youngest_neighbour_wins_and_the_remainder_stays_with_the_older() {
        let mut a = Allocator::new(10 * 256, 256).unwrap();
        let e: Vec<Extent> = (0..10).map(|_| a.allocate(256).unwrap()).collect();
        assert_eq!(
            (e[0], e[1], e[9]),
            (ext(0, 256), ext(2304, 256), ext(256, 256))
        );
        // A hole among old objects (e2, e3: between e4 and e1) and a smaller one among young
        // objects (e7: between e8 and e6).
        assert!(a.free(e[2]) && a.free(e[3]) && a.free(e[7]));
        assert_eq!(
            a.allocate(1),
            Some(e[7]),
            "next to the young, not the best fit"
        );
        // The old hole: the request goes next to e4, the younger side; what is left stays
        // next to e1, which trainers free first.
        assert_eq!(a.allocate(1), Some(e[3]));
        assert_eq!(a.free_extents().collect::<Vec<_>>(), [e[2]]);
        assert_eq!(a.allocate(257), None, "one unit is free");
    }

    #[test]
    fn double_and_made_up_frees_are_refused_and_harmless() {
        let mut a = Allocator::new(1024, 256).unwrap();
        let x = a.allocate(256).unwrap(); // 0
        let y = a.allocate(256).unwrap(); // 768
        assert!(a.free(x));
        assert!(!a.free(x));
        assert!(!a.free(ext(256, 256)), "never allocated (free space)");
        assert!(!a.free(ext(512, 512)), "overlaps free space");
        assert!(!a.free(ext(1024, 256)), "outside the region");
        assert!(!a.free(ext(769, 256)), "misaligned");
        assert!(!a.free(ext(768, 0)), "empty");
        let z = a.allocate(512).unwrap();
        assert_eq!(z, ext(0, 512));
        assert!(!a.free(ext(0, 256)), "part of a live extent");
        assert!(!a.free(ext(0, 1024)), "live and free space as one");
        assert!(!a.free(ext(u64::MAX - 255, 256)), "overflowing");
        a.check(&[y, z]);
        assert_eq!(a.report().live_extents, 2);
        assert!(a.free(y) && a.free(z));
        assert_eq!(a.report().free_extents, 1);
    }

    #[test]
    fn reserve_exact_restores_a_freed_extent() {
        let mut a = Allocator::new(4096, 256).unwrap();
        let x = a.allocate(512).unwrap(); // 0
        let y = a.allocate(512).unwrap(); // 3584
        assert!(a.free(y));
        assert!(!a.reserve_exact(ext(256, 512)), "overlaps live x");
        assert!(!a.reserve_exact(ext(600, 256)), "misaligned");
        assert!(!a.reserve_exact(ext(3840, 512)), "past the end");
        assert!(!a.reserve_exact(ext(u64::MAX - 255, 512)), "overflowing");
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
        // x0 at 0, x1..x9 down from the top.
        let xs: Vec<_> = (0..10).map(|_| a.allocate(1000).unwrap()).collect();
        for x in xs.iter().step_by(2) {
            a.free(*x);
        }
        let r = a.report();
        assert_eq!(r.live_extents, 5);
        assert_eq!(r.free_extents, 5, "x0 joined the free middle");
        assert_eq!(r.largest_free, (1 << 20) - 9 * 1024);
        assert_eq!(r.free_bytes, (1 << 20) - 5 * 1024);
    }

    /// The trivial model: live ranges with their stamps; every decision is a linear scan.
    #[derive(Default)]
    struct Shadow {
        live: BTreeMap<u64, (u64, u64)>,
        clock: u64,
    }

    impl Shadow {
        /// The free gaps: (offset, len, left neighbour's stamp, right neighbour's stamp).
        fn gaps(&self, cap: u64) -> Vec<(u64, u64, u64, u64)> {
            let (mut out, mut at, mut prev) = (Vec::new(), 0, 0);
            for (&o, &(l, s)) in &self.live {
                if o > at {
                    out.push((at, o - at, prev, s));
                }
                (at, prev) = (o + l, s);
            }
            if at < cap {
                out.push((at, cap - at, prev, 0));
            }
            out
        }

        /// Where youngest-neighbour fit puts `need` bytes, straight from its definition.
        fn place(&self, need: u64, cap: u64) -> Option<Extent> {
            let (o, l, left, right) = self
                .gaps(cap)
                .into_iter()
                .filter(|g| g.1 >= need)
                .max_by_key(|g| (g.2.max(g.3), g.0))?;
            let side = |s: u64| if s == 0 { u64::MAX } else { s };
            let at = if side(left) >= side(right) {
                o
            } else {
                o + l - need
            };
            Some(ext(at, need))
        }

        fn is_free(&self, e: Extent, cap: u64) -> bool {
            self.gaps(cap)
                .iter()
                .any(|g| g.0 <= e.offset && e.end() <= g.0 + g.1)
        }

        fn add(&mut self, e: Extent) {
            self.clock += 1;
            self.live.insert(e.offset, (e.len, self.clock));
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u64),
        Free(usize),
        /// Free an extent again that was freed before (refused unless it is live again).
        Refree(usize),
        /// Take back a freed extent, as a failed `replace` does.
        Restore(usize),
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        proptest::collection::vec(
            prop_oneof![
                6 => (0u64..5000).prop_map(Op::Alloc),
                4 => any::<usize>().prop_map(Op::Free),
                1 => any::<usize>().prop_map(Op::Refree),
                1 => any::<usize>().prop_map(Op::Restore),
            ],
            1..300,
        )
    }

    proptest! {
        /// Every decision against the model: the exact extent each allocation gets, which
        /// frees and restores are accepted, and the invariants after every step.
        #[test]
        fn matches_model(ops in ops(), align_log in 0u32..10) {
            let align = 1u64 << align_log;
            let cap = 64 * 1024;
            let mut a = Allocator::new(cap, align).unwrap();
            let mut shadow = Shadow::default();
            let mut held: Vec<Extent> = Vec::new();
            let mut freed: Vec<Extent> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc(n) => {
                        let need = a.aligned_len(n).unwrap();
                        let got = a.allocate(n);
                        prop_assert_eq!(got, shadow.place(need, cap));
                        if let Some(e) = got {
                            shadow.add(e);
                            held.push(e);
                        } else {
                            prop_assert!(a.largest_free() < need);
                        }
                    }
                    Op::Free(i) if !held.is_empty() => {
                        let e = held.swap_remove(i % held.len());
                        prop_assert!(a.free(e));
                        shadow.live.remove(&e.offset);
                        freed.push(e);
                    }
                    Op::Refree(i) if !freed.is_empty() => {
                        let e = freed[i % freed.len()];
                        let live = shadow.live.get(&e.offset).map(|l| l.0) == Some(e.len);
                        prop_assert_eq!(a.free(e), live);
                        if live {
                            shadow.live.remove(&e.offset);
                            held.retain(|h| *h != e);
                        }
                    }
                    Op::Restore(i) if !freed.is_empty() => {
                        let e = freed.swap_remove(i % freed.len());
                        let ok = shadow.is_free(e, cap);
                        prop_assert_eq!(a.reserve_exact(e), ok);
                        if ok {
                            shadow.add(e);
                            held.push(e);
                        }
                    }
                    Op::Free(_) | Op::Refree(_) | Op::Restore(_) => {}
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
