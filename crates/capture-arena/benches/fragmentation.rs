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
//! far the arena drained before the batch fit). Deterministic seeds.
//!
//! `cargo bench -p capture-arena --bench fragmentation` prints the table (BENCHMARKS.md);
//! without `--bench` (as `cargo test --all-targets` runs it) a small smoke run.

use std::collections::VecDeque;

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
    /// Today's allocator: per object, the smallest free extent that holds it, taking its end.
    BestFit,
    /// Best fit, the batch's objects largest first.
    BestFitLargestFirst,
    /// Best fit for one extent per sample, its objects carved out of it (freed together).
    BestFitSample,
    /// Address-ordered first fit (the lowest free extent that holds it, taking its start),
    /// one extent per sample.
    FirstFitSample,
    /// Roving first fit (next fit): the first free extent at or after where the last one
    /// ended that holds it, wrapping around; one extent per sample.
    RovingSample,
    /// Roving first fit per object.
    Roving,
    /// Size classes kept apart, one extent per sample: samples of at least 256 MiB first fit
    /// from the bottom (taking a free extent's start), smaller ones from the top (its end).
    ClassesApart,
    /// Best fit, one extent per sample, the batch's samples largest first.
    BestFitSampleLargestFirst,
    /// The ceiling: an allocator that could move objects (a batch fits whenever enough bytes
    /// are free). No allocator that keeps published addresses fixed does better.
    Ideal,
}

impl Policy {
    fn name(self) -> &'static str {
        match self {
            Policy::BestFit => "best-fit (today)",
            Policy::BestFitLargestFirst => "best-fit, largest first",
            Policy::BestFitSample => "best-fit, sample together",
            Policy::FirstFitSample => "first-fit, sample together",
            Policy::RovingSample => "roving, sample together",
            Policy::Roving => "roving, per object",
            Policy::BestFitSampleLargestFirst => "best-fit, sample together, largest first",
            Policy::Ideal => "ceiling: objects could move",
            Policy::ClassesApart => "size classes apart, sample together",
        }
    }

    fn per_sample(self) -> bool {
        matches!(
            self,
            Policy::BestFitSample
                | Policy::FirstFitSample
                | Policy::RovingSample
                | Policy::BestFitSampleLargestFirst
                | Policy::ClassesApart
        )
    }
}

/// The allocator plus what a policy remembers (the rover).
struct Placer {
    alloc: Allocator,
    policy: Policy,
    rover: u64,
    /// Bytes held, for the ceiling (which places by bytes alone, not through `alloc`).
    ideal_used: u64,
}

impl Placer {
    fn take(&mut self, len: u64) -> Option<Extent> {
        let need = self.alloc.aligned_len(len)?;
        match self.policy {
            Policy::BestFit
            | Policy::BestFitLargestFirst
            | Policy::BestFitSample
            | Policy::BestFitSampleLargestFirst => self.alloc.allocate(len),
            Policy::Ideal => unreachable!("the ceiling places by bytes alone"),
            Policy::ClassesApart if need >= 256 << 20 => {
                let at = self.alloc.free_extents().find(|e| e.len >= need)?.offset;
                self.exact(at, need)
            }
            Policy::ClassesApart => {
                let e = self
                    .alloc
                    .free_extents()
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .find(|e| e.len >= need)?;
                self.exact(e.end() - need, need)
            }
            Policy::FirstFitSample => {
                let at = self.alloc.free_extents().find(|e| e.len >= need)?.offset;
                self.exact(at, need)
            }
            Policy::RovingSample | Policy::Roving => {
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
        }
    }

    fn release(&mut self, sample: Vec<Extent>) {
        for e in sample {
            if self.policy == Policy::Ideal {
                self.ideal_used -= e.len;
            } else {
                assert!(self.alloc.free(e), "a live extent frees");
            }
        }
    }

    fn free_bytes(&self) -> u64 {
        if self.policy == Policy::Ideal {
            self.alloc.capacity() - self.ideal_used
        } else {
            self.alloc.free_bytes()
        }
    }

    fn exact(&mut self, offset: u64, len: u64) -> Option<Extent> {
        let e = Extent { offset, len };
        self.alloc.reserve_exact(e).then_some(e)
    }

    /// Places a batch whole: each sample's object extents, or `None` (nothing changed).
    fn place(&mut self, batch: &[Vec<u64>]) -> Option<Vec<Vec<Extent>>> {
        let rover = self.rover;
        let mut placed: Vec<Vec<Extent>> = vec![Vec::new(); batch.len()];
        if self.policy == Policy::Ideal {
            let lens: Vec<Vec<u64>> = batch
                .iter()
                .map(|objs| {
                    objs.iter()
                        .map(|&l| self.alloc.aligned_len(l).unwrap_or(u64::MAX))
                        .collect()
                })
                .collect();
            let need: u64 = lens.iter().flatten().sum();
            if self.ideal_used + need > self.alloc.capacity() {
                return None;
            }
            self.ideal_used += need;
            return Some(
                lens.into_iter()
                    .map(|l| l.into_iter().map(|len| Extent { offset: 0, len }).collect())
                    .collect(),
            );
        }
        let mut samples: Vec<(usize, &Vec<u64>)> = batch.iter().enumerate().collect();
        if self.policy == Policy::BestFitSampleLargestFirst {
            samples.sort_by_key(|(_, objs)| std::cmp::Reverse(objs.iter().sum::<u64>()));
        }
        let ok = if self.policy.per_sample() {
            samples.into_iter().all(|(i, objs)| {
                let lens: Vec<u64> = objs
                    .iter()
                    .map(|&l| self.alloc.aligned_len(l).unwrap_or(u64::MAX))
                    .collect();
                let Some(whole) = self.take(lens.iter().sum()) else {
                    return false;
                };
                // One extent, carved into the sample's objects (each freed on its own later;
                // the allocator coalesces them back).
                self.alloc.free(whole);
                let mut at = whole.offset;
                for l in lens {
                    let e = Extent { offset: at, len: l };
                    assert!(self.alloc.reserve_exact(e));
                    placed[i].push(e);
                    at += l;
                }
                true
            })
        } else {
            let mut order: Vec<(usize, u64)> = batch
                .iter()
                .enumerate()
                .flat_map(|(i, objs)| objs.iter().map(move |&l| (i, l)))
                .collect();
            if self.policy == Policy::BestFitLargestFirst {
                order.sort_by_key(|&(_, l)| std::cmp::Reverse(l));
            }
            order.into_iter().all(|(i, l)| match self.take(l) {
                Some(e) => {
                    placed[i].push(e);
                    true
                }
                None => false,
            })
        };
        if ok {
            return Some(placed);
        }
        for e in placed.into_iter().flatten() {
            assert!(self.alloc.free(e));
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

fn run(w: &Workload, capacity: u64, window: usize, policy: Policy, batches: usize) -> Outcome {
    let mut rng = Rng(0x5eed ^ window as u64 ^ capacity);
    let mut p = Placer {
        alloc: Allocator::new(capacity, ALIGN).expect("a valid arena"),
        policy,
        rover: 0,
        ideal_used: 0,
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
        if need > p.alloc.capacity() {
            continue;
        }
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
            let i = rng.below(window.min(resident.len()).max(1));
            let Some(sample) = resident.remove(i) else {
                break; // nothing left to free: cannot happen for need <= capacity
            };
            p.release(sample);
        }
    }
    out
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
    let (runs, batches): (Vec<(&Workload, u64)>, usize) = if full {
        (
            vec![(&eagle, 32 * GIB), (&eagle, 64 * GIB), (&kimi, 96 * GIB)],
            20_000,
        )
    } else {
        (vec![(&eagle, 32 * GIB)], 300)
    };
    let policies = [
        Policy::BestFit,
        Policy::BestFitLargestFirst,
        Policy::BestFitSample,
        Policy::FirstFitSample,
        Policy::Roving,
        Policy::RovingSample,
        Policy::BestFitSampleLargestFirst,
        Policy::ClassesApart,
        Policy::Ideal,
    ];
    for (w, capacity) in runs {
        println!(
            "\n{}; arena {} GiB; {batches} batches of 8 samples",
            w.name,
            capacity / GIB
        );
        println!(
            "cells: mean fullness when a batch waits (min) / waits with enough bytes free / mean \
             fullness when the wait ended"
        );
        println!("| policy | W=1 | W=4 | W=16 | W=64 |\n|---|---|---|---|---|");
        for policy in policies {
            let cells: Vec<String> = [1, 4, 16, 64]
                .iter()
                .map(|&window| {
                    let o = run(w, capacity, window, policy, batches);
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
