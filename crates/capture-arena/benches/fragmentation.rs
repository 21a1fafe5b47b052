//! Effective capacity (#12): replays capture-like workloads against the allocator alone and
//! reports how full the arena was when a batch had to wait for frees, per placement policy.
//!
//! Model: batches of 8 samples, each sample 4 objects (aux `[L, k*H]` bf16, last hidden `[L, H]`
//! bf16, `input_ids` and `loss_mask` `[L]` int64), `L` log-uniform. The arena is kept full: a
//! batch is placed whole (all its objects, or none); while it does not fit it *waits*, and
//! trainers free one sample at a time until it fits: the oldest (`W = 1`) or a random one among
//! the oldest `W`. A trainer frees all of a sample's objects together. Each failed attempt is a
//! wait observation: the arena's fullness then, and whether enough bytes were free elsewhere
//! (fragmentation, not size, made it wait). Also reported: the fullness when the wait ended (how
//! far the arena drained before the batch fit). Deterministic seeds; the trainers' choices come
//! from their own generator, so every policy sees the same frees in the same order.
//!
//! The row "youngest-neighbour fit" is `capture_arena::alloc::Allocator::allocate` itself, in
//! the order the writer places a batch; every other policy is simulated here over the
//! allocator's free extents (a linear scan, which only a simulation can afford).
//!
//! `cargo bench -p capture-arena --bench fragmentation` prints the table (BENCHMARKS.md);
//! without `--bench` (as `cargo test --all-targets` runs it) a small smoke run. To narrow a run:
//! `FRAG_POLICY=Youngest,BestFit` (names as in `Policy`), `FRAG_W=1,16`, `FRAG_BATCHES=5000`,
//! `FRAG_RUNS=0` (0: 32 GiB, 1: 64 GiB, 2: the long class); `FRAG_SEED=1` draws other
//! workloads and frees.

use std::collections::{BTreeMap, VecDeque};

use capture_arena::alloc::{Allocator, Extent};

const GIB: u64 = 1 << 30;
const ALIGN: u64 = 256;

/// SplitMix64: a small deterministic generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// A workload: what one sample's objects weigh.
#[derive(Clone, Copy)]
struct Workload {
    name: &'static str,
    hidden: u64,
    k: u64,
    min_len: f64,
    max_len: f64,
    /// A class of very long samples: this fraction of samples has `long_len` tokens.
    long_share: f64,
    long_len: u64,
}

impl Workload {
    fn sample(&self, rng: &mut Rng) -> Vec<u64> {
        let l = if self.long_share > 0.0 && rng.unit() < self.long_share {
            self.long_len
        } else {
            let (a, b) = (self.min_len.ln(), self.max_len.ln());
            (a + (b - a) * rng.unit()).exp() as u64
        };
        vec![
            l * self.k * self.hidden * 2,
            l * self.hidden * 2,
            l * 8,
            l * 8,
        ]
    }
}

/// How a batch's objects are placed.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Policy {
    /// Best fit per object (the smallest free extent that holds it, taking its end), the
    /// batch's objects largest first: the allocator and the writer before #12.
    BestFitLargestFirst,
    /// Best fit per object in the batch's order.
    BestFit,
    /// Roving first fit (next fit) per object: the first free extent at or after where the
    /// last one ended that holds it, wrapping around.
    Roving,
    /// Address-ordered first fit (the lowest free extent that holds it, taking its start),
    /// one extent per sample.
    FirstFitSample,
    /// Best fit, one extent per sample, the batch's samples largest first.
    BestFitSampleLargestFirst,
    /// Best fit, one extent per batch.
    BestFitBatch,
    /// Size classes kept apart, one extent per sample: samples of at least 256 MiB first fit
    /// from the bottom (taking a free extent's start), smaller ones from the top (its end).
    ClassesApart,
    /// Good fit (TLSF's idea): best fit when it leaves at most an eighth of the free extent,
    /// else roving; one extent per sample, largest first.
    GoodFitElseRoving,
    /// Youngest-neighbour fit: `Allocator::allocate` (the allocator since #12), per object in
    /// the batch's order.
    Youngest,
    /// Not implementable, for reference: knows when each sample will be freed, and puts each
    /// object next to the live extent whose sample is freed closest in time to its own (best
    /// fit among equals); per object in the batch's order.
    Clairvoyant,
    /// The ceiling: an allocator that could move objects (a batch fits whenever enough bytes
    /// are free). No allocator that keeps published addresses fixed does better.
    Ideal,
}

/// What a policy places as one piece.
enum Unit {
    Object { largest_first: bool },
    Sample { largest_first: bool },
    Batch,
}

impl Policy {
    const ALL: [Policy; 11] = [
        Policy::BestFitLargestFirst,
        Policy::BestFit,
        Policy::Roving,
        Policy::FirstFitSample,
        Policy::BestFitSampleLargestFirst,
        Policy::BestFitBatch,
        Policy::ClassesApart,
        Policy::GoodFitElseRoving,
        Policy::Youngest,
        Policy::Clairvoyant,
        Policy::Ideal,
    ];

    fn name(self) -> &'static str {
        match self {
            Policy::BestFitLargestFirst => "best fit, largest first (before #12)",
            Policy::BestFit => "best fit, batch order",
            Policy::Roving => "roving first fit (next fit)",
            Policy::FirstFitSample => "first fit, one extent per sample",
            Policy::BestFitSampleLargestFirst => "best fit, one extent per sample, largest first",
            Policy::BestFitBatch => "best fit, one extent per batch",
            Policy::ClassesApart => "size classes apart, one extent per sample",
            Policy::GoodFitElseRoving => "good fit (<= 1/8 left) else roving, per sample",
            Policy::Youngest => "**youngest-neighbour fit (alloc.rs, since #12)**",
            Policy::Clairvoyant => "reference: knows the free order (not implementable)",
            Policy::Ideal => "ceiling: objects could move",
        }
    }

    fn unit(self) -> Unit {
        match self {
            Policy::BestFitLargestFirst => Unit::Object {
                largest_first: true,
            },
            Policy::BestFit
            | Policy::Roving
            | Policy::Youngest
            | Policy::Clairvoyant
            | Policy::Ideal => Unit::Object {
                largest_first: false,
            },
            Policy::FirstFitSample | Policy::ClassesApart => Unit::Sample {
                largest_first: false,
            },
            Policy::BestFitSampleLargestFirst | Policy::GoodFitElseRoving => Unit::Sample {
                largest_first: true,
            },
            Policy::BestFitBatch => Unit::Batch,
        }
    }
}

/// The allocator plus what a policy remembers.
struct Placer {
    alloc: Allocator,
    policy: Policy,
    /// Where roving first fit goes on from.
    rover: u64,
    /// Bytes held, for the ceiling (which places by bytes alone, not through `alloc`).
    ideal_used: u64,
    /// Live extents by offset: (end, the rank of its sample's free), for the clairvoyant.
    live: BTreeMap<u64, (u64, u64)>,
    /// The rank among frees of each sample, by birth, for the clairvoyant.
    deaths: Vec<u64>,
    /// Samples placed so far.
    born: usize,
}

impl Placer {
    /// One piece of `len` bytes for the sample with free rank `rank`.
    fn take(&mut self, len: u64, rank: u64) -> Option<Extent> {
        let need = self.alloc.aligned_len(len)?;
        match self.policy {
            Policy::BestFit
            | Policy::BestFitLargestFirst
            | Policy::BestFitSampleLargestFirst
            | Policy::BestFitBatch => {
                let h = self.best_hole(need)?;
                self.exact(h.end() - need, need)
            }
            Policy::FirstFitSample => {
                let at = self.alloc.free_extents().find(|e| e.len >= need)?.offset;
                self.exact(at, need)
            }
            Policy::ClassesApart if need >= 256 << 20 => {
                let at = self.alloc.free_extents().find(|e| e.len >= need)?.offset;
                self.exact(at, need)
            }
            Policy::ClassesApart => {
                let e = self.alloc.free_extents().filter(|e| e.len >= need).last()?;
                self.exact(e.end() - need, need)
            }
            Policy::Roving => self.roving(need),
            Policy::GoodFitElseRoving => match self.best_hole(need)? {
                h if h.len - need <= h.len / 8 => self.exact(h.end() - need, need),
                _ => self.roving(need),
            },
            Policy::Youngest => self.alloc.allocate(need),
            Policy::Clairvoyant => self.clairvoyant(need, rank),
            Policy::Ideal => unreachable!("the ceiling places by bytes alone"),
        }
    }

    /// The smallest free extent holding `need` (lowest offset among equals).
    fn best_hole(&self, need: u64) -> Option<Extent> {
        self.alloc
            .free_extents()
            .filter(|e| e.len >= need)
            .min_by_key(|e| (e.len, e.offset))
    }

    fn roving(&mut self, need: u64) -> Option<Extent> {
        let rover = self.rover;
        let at = self
            .alloc
            .free_extents()
            .filter(|e| e.end() > rover)
            .map(|e| Extent {
                offset: e.offset.max(rover),
                len: e.end() - e.offset.max(rover),
            })
            .chain(self.alloc.free_extents())
            .find(|e| e.len >= need)?
            .offset;
        let e = self.exact(at, need)?;
        self.rover = e.end() % self.alloc.capacity();
        Some(e)
    }

    fn clairvoyant(&mut self, need: u64, rank: u64) -> Option<Extent> {
        // (distance in free rank, hole length, hole, next to its left neighbour)
        let mut best: Option<(u64, u64, Extent, bool)> = None;
        for h in self.alloc.free_extents().filter(|e| e.len >= need) {
            let left = self
                .live
                .range(..h.offset)
                .next_back()
                .filter(|(_, &(end, _))| end == h.offset)
                .map(|(_, &(_, r))| r);
            let right = self.live.get(&h.end()).map(|&(_, r)| r);
            for (side, r) in [(true, left), (false, right)] {
                let d = r.map_or(u64::MAX, |r| r.abs_diff(rank));
                if best.is_none_or(|(bd, bl, _, _)| (d, h.len) < (bd, bl)) {
                    best = Some((d, h.len, h, side));
                }
            }
        }
        let (_, _, h, left) = best?;
        let e = if left {
            self.exact(h.offset, need)?
        } else {
            self.exact(h.end() - need, need)?
        };
        self.live.insert(e.offset, (e.end(), rank));
        Some(e)
    }

    fn exact(&mut self, offset: u64, len: u64) -> Option<Extent> {
        let e = Extent { offset, len };
        self.alloc.reserve_exact(e).then_some(e)
    }

    fn give_back(&mut self, e: Extent) {
        if self.policy == Policy::Ideal {
            self.ideal_used -= e.len;
        } else {
            self.live.remove(&e.offset);
            assert!(self.alloc.free(e), "a live extent frees");
        }
    }

    fn free_bytes(&self) -> u64 {
        if self.policy == Policy::Ideal {
            self.alloc.capacity() - self.ideal_used
        } else {
            self.alloc.free_bytes()
        }
    }

    /// Takes `lens` as one extent and carves it into one extent per length, in order.
    fn take_together(&mut self, lens: &[u64], rank: u64) -> Option<Vec<Extent>> {
        let whole = self.take(lens.iter().sum(), rank)?;
        assert!(self.alloc.free(whole));
        let mut at = whole.offset;
        Some(
            lens.iter()
                .map(|&len| {
                    let e = Extent { offset: at, len };
                    assert!(self.alloc.reserve_exact(e));
                    at += len;
                    e
                })
                .collect(),
        )
    }

    /// Places a batch whole: each sample's object extents, or `None` (nothing changed).
    fn place(&mut self, batch: &[Vec<u64>]) -> Option<Vec<Vec<Extent>>> {
        let rover = self.rover;
        let lens: Vec<Vec<u64>> = batch
            .iter()
            .map(|objs| {
                objs.iter()
                    .map(|&l| self.alloc.aligned_len(l).unwrap_or(u64::MAX))
                    .collect()
            })
            .collect();
        let rank = |i: usize| self.deaths.get(self.born + i).copied().unwrap_or(u64::MAX);
        let ranks: Vec<u64> = (0..batch.len()).map(rank).collect();
        let mut placed: Vec<Vec<Extent>> = vec![Vec::new(); batch.len()];
        if self.policy == Policy::Ideal {
            let need: u64 = lens.iter().flatten().sum();
            if self.ideal_used + need > self.alloc.capacity() {
                return None;
            }
            self.ideal_used += need;
            self.born += batch.len();
            return Some(
                lens.into_iter()
                    .map(|l| l.into_iter().map(|len| Extent { offset: 0, len }).collect())
                    .collect(),
            );
        }
        let ok = match self.policy.unit() {
            Unit::Object { largest_first } => {
                let mut order: Vec<(usize, u64)> = lens
                    .iter()
                    .enumerate()
                    .flat_map(|(i, objs)| objs.iter().map(move |&l| (i, l)))
                    .collect();
                if largest_first {
                    order.sort_by_key(|&(_, l)| std::cmp::Reverse(l));
                }
                order
                    .into_iter()
                    .all(|(i, l)| match self.take(l, ranks[i]) {
                        Some(e) => {
                            placed[i].push(e);
                            true
                        }
                        None => false,
                    })
            }
            Unit::Sample { largest_first } => {
                let mut order: Vec<usize> = (0..batch.len()).collect();
                if largest_first {
                    order.sort_by_key(|&i| std::cmp::Reverse(lens[i].iter().sum::<u64>()));
                }
                order
                    .into_iter()
                    .all(|i| match self.take_together(&lens[i], ranks[i]) {
                        Some(es) => {
                            placed[i] = es;
                            true
                        }
                        None => false,
                    })
            }
            Unit::Batch => {
                let all: Vec<u64> = lens.iter().flatten().copied().collect();
                match self.take_together(&all, ranks[0]) {
                    Some(es) => {
                        let mut es = es.into_iter();
                        for (i, objs) in lens.iter().enumerate() {
                            placed[i].extend(es.by_ref().take(objs.len()));
                        }
                        true
                    }
                    None => false,
                }
            }
        };
        if ok {
            self.born += batch.len();
            return Some(placed);
        }
        for e in placed.into_iter().flatten() {
            self.give_back(e);
        }
        self.rover = rover; // nothing of the batch stays: neither does its effect on the rover
        None
    }
}

/// What one run measured.
struct Outcome {
    /// Failed attempts to place a batch (after warm-up).
    waits: u64,
    fullness_sum: f64,
    fullness_min: f64,
    /// Of them, with at least the batch's bytes free.
    enough_free: u64,
    /// Batches that waited, and the fullness just before each was placed.
    waited_batches: u64,
    drained_sum: f64,
}

/// The trainers' generator for a run.
fn trainers(window: usize, capacity: u64) -> Rng {
    Rng(0xf4ee ^ window as u64 ^ capacity ^ seed())
}

/// `FRAG_SEED` (default 0) varies every generator, to see how much a figure moves by chance.
fn seed() -> u64 {
    std::env::var("FRAG_SEED")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(0, |s| s.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// The rank among frees of every sample, by birth: the same draws `run` makes, for the
/// clairvoyant. A free takes one of the oldest `window` live samples; which ones are the
/// oldest does not depend on how many younger ones a policy fitted.
fn free_ranks(window: usize, capacity: u64, samples: usize) -> Vec<u64> {
    let mut r = trainers(window, capacity);
    let mut ranks = vec![u64::MAX; samples];
    let mut oldest: VecDeque<usize> = VecDeque::new();
    let mut next = 0;
    for rank in 0..samples as u64 {
        while oldest.len() < window && next < samples {
            oldest.push_back(next);
            next += 1;
        }
        let Some(s) = oldest.remove(r.below(window.min(oldest.len()).max(1))) else {
            break;
        };
        ranks[s] = rank;
    }
    ranks
}

fn run(w: &Workload, capacity: u64, window: usize, policy: Policy, batches: usize) -> Outcome {
    let mut rng = Rng(0x5eed ^ window as u64 ^ capacity ^ seed());
    let mut free_rng = trainers(window, capacity);
    let mut p = Placer {
        alloc: Allocator::new(capacity, ALIGN).expect("a valid arena"),
        policy,
        rover: 0,
        ideal_used: 0,
        live: BTreeMap::new(),
        deaths: if policy == Policy::Clairvoyant {
            free_ranks(window, capacity, batches * 8)
        } else {
            Vec::new()
        },
        born: 0,
    };
    let mut resident: VecDeque<Vec<Extent>> = VecDeque::new();
    let mut out = Outcome {
        waits: 0,
        fullness_sum: 0.0,
        fullness_min: 1.0,
        enough_free: 0,
        waited_batches: 0,
        drained_sum: 0.0,
    };
    // The first tenth fills the arena and is not counted.
    let warm = batches / 10;
    for b in 0..batches {
        let batch: Vec<Vec<u64>> = (0..8).map(|_| w.sample(&mut rng)).collect();
        let need: u64 = batch
            .iter()
            .flatten()
            .map(|&l| p.alloc.aligned_len(l).unwrap_or(u64::MAX))
            .sum();
        assert!(need <= capacity, "a batch larger than the arena");
        let mut waited = false;
        let counted = b >= warm;
        loop {
            if let Some(placed) = p.place(&batch) {
                if waited {
                    out.waited_batches += 1;
                    out.drained_sum += 1.0 - p.free_bytes() as f64 / capacity as f64;
                }
                resident.extend(placed);
                break;
            }
            if counted {
                waited = true;
                let free = p.free_bytes();
                let fullness = 1.0 - free as f64 / capacity as f64;
                out.waits += 1;
                out.fullness_sum += fullness;
                out.fullness_min = out.fullness_min.min(fullness);
                out.enough_free += u64::from(free >= need);
            }
            // A trainer frees one sample: the oldest, or one of the oldest `window`.
            let i = free_rng.below(window.min(resident.len()).max(1));
            let sample = resident
                .remove(i)
                .expect("a batch no larger than the arena fits");
            for e in sample {
                p.give_back(e);
            }
        }
    }
    out
}

/// A comma-separated list from the environment, or `default`.
fn env_list<T: std::str::FromStr>(name: &str, default: Vec<T>) -> Vec<T> {
    match std::env::var(name) {
        Ok(v) => v.split(',').filter_map(|x| x.trim().parse().ok()).collect(),
        Err(_) => default,
    }
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let eagle = Workload {
        name: "EAGLE3-8B (H 4096, k 3, L 512..32768)",
        hidden: 4096,
        k: 3,
        min_len: 512.0,
        max_len: 32768.0,
        long_share: 0.0,
        long_len: 0,
    };
    let kimi = Workload {
        name: "long class (H 7168, k 3, L 512..32768, 5% at L 131072: 7.5 GB per sample)",
        hidden: 7168,
        k: 3,
        min_len: 512.0,
        max_len: 32768.0,
        long_share: 0.05,
        long_len: 131072,
    };
    let all_runs = [(&eagle, 32 * GIB), (&eagle, 64 * GIB), (&kimi, 96 * GIB)];
    let (runs, batches) = if full {
        (env_list("FRAG_RUNS", vec![0, 1, 2]), 20_000)
    } else {
        (vec![0], 300)
    };
    let batches = env_list("FRAG_BATCHES", vec![batches])
        .first()
        .copied()
        .unwrap_or(batches);
    let windows: Vec<usize> = env_list("FRAG_W", vec![1, 4, 16, 64]);
    let names: Vec<String> = env_list("FRAG_POLICY", Vec::new());
    let policies: Vec<Policy> = Policy::ALL
        .into_iter()
        .filter(|p| names.is_empty() || names.contains(&format!("{p:?}")))
        .collect();
    for (w, capacity) in runs.iter().filter_map(|&i| all_runs.get(i)) {
        println!(
            "\n{}; arena {} GiB; {batches} batches of 8 samples",
            w.name,
            capacity / GIB
        );
        println!(
            "cells: mean fullness when a batch waits (min) / waits with enough bytes free / mean \
             fullness when the wait ended"
        );
        let head: Vec<String> = windows.iter().map(|w| format!("W={w}")).collect();
        println!(
            "| policy | {} |\n|---|{}",
            head.join(" | "),
            "---|".repeat(windows.len())
        );
        for &policy in &policies {
            let cells: Vec<String> = windows
                .iter()
                .map(|&window| {
                    let o = run(w, *capacity, window, policy, batches);
                    if o.waits == 0 {
                        return "no waits".into();
                    }
                    format!(
                        "{:.3} ({:.2}) / {:.0}% / {:.3}",
                        o.fullness_sum / o.waits as f64,
                        o.fullness_min,
                        100.0 * o.enough_free as f64 / o.waits as f64,
                        o.drained_sum / o.waited_batches.max(1) as f64
                    )
                })
                .collect();
            println!("| {} | {} |", policy.name(), cells.join(" | "));
        }
    }
}
