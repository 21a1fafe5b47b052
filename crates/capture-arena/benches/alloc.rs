//! Allocate + free with 100k live extents (issue target: median <= 1 us).
//!
//! `cargo bench -p capture-arena --bench alloc`

use capture_arena::alloc::{Allocator, Extent};
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};

const LIVE: usize = 100_000;

/// Sizes drawn from capture-like objects (small passthrough tensors to multi-MiB hidden states),
/// from a fixed xorshift so runs are comparable.
fn sizes(n: usize) -> Vec<u64> {
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            match x % 4 {
                0 => 8 * (512 + x % 3584),        // int64 [1, L]
                1 => 2 * 4096 * (512 + x % 3584), // bf16 [1, L, 4096]
                _ => 1 + x % 65_536,              // assorted small
            }
        })
        .collect()
}

fn churn(c: &mut Criterion) {
    let sz = sizes(LIVE * 2);
    let capacity: u64 = sz[..LIVE]
        .iter()
        .map(|s| s.div_ceil(256) * 256)
        .sum::<u64>()
        * 3;
    let mut a = Allocator::new(capacity, 256).unwrap();
    let mut live: Vec<Extent> = sz[..LIVE].iter().map(|&s| a.allocate(s).unwrap()).collect();
    // Free every third extent so the free space is fragmented into ~33k holes.
    for e in live.iter().step_by(3) {
        a.free(*e);
    }
    for i in (0..LIVE).step_by(3) {
        live[i] = a.allocate(sz[LIVE + i]).unwrap();
    }
    let r = a.report();
    eprintln!(
        "allocator: {} live extents, {} free extents, {:.1} GiB capacity",
        r.live_extents,
        r.free_extents,
        capacity as f64 / (1u64 << 30) as f64
    );
    let mut i = 0usize;
    c.bench_function("alloc+free (100k live extents)", |b| {
        b.iter(|| {
            // Free one live extent and allocate another size: steady-state churn.
            let k = i % LIVE;
            a.free(live[k]);
            live[k] = a
                .allocate(sz[i % sz.len()])
                .expect("capacity is 3x the live bytes");
            i += 1;
        })
    });
    let mut a2 = a.clone();
    c.bench_function("allocate only (100k live extents)", |b| {
        b.iter_batched_ref(
            || (),
            |_| {
                let e = a2.allocate(4096).unwrap();
                a2.free(e);
            },
            BatchSize::SmallInput,
        )
    });
}

criterion_group!(benches, churn);
criterion_main!(benches);
