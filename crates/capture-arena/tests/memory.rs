//! What a long-lived trainer keeps in memory, measured with a counting allocator (its own test
//! binary, one test, so no other test's allocations are counted).

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicIsize, Ordering};

use capture_arena::client::FeatureStore;
use capture_arena::sample::{ArenaRef, Feature, Published};
use capture_arena::Dtype;

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// A result as a trainer receives it: long ids, four features, a control endpoint that refuses
/// connections (its producer is gone: frees to it are dropped at once).
fn result(i: usize, control: &str) -> Published {
    let features = ["hidden_state", "target", "input_ids", "loss_mask"]
        .into_iter()
        .map(|n| {
            (
                n.to_owned(),
                Feature {
                    shape: vec![1, 8],
                    dtype: Dtype::Int64,
                    address: 4096,
                    stamp: None,
                },
            )
        })
        .collect::<BTreeMap<_, _>>();
    Published {
        sample_id: format!("{i:08}-{}", "r".repeat(500)),
        store_id: "s".repeat(200),
        gen: 1,
        aux_layer_ids: None,
        features,
        arena: ArenaRef {
            session: format!(
                "shm://capture-arena-1-{:032x}?len=1048576&base=0x7f0000000000",
                i % 7
            ),
            control: control.to_owned(),
            token: None,
        },
        writable: None,
    }
}

#[test]
fn remembering_released_samples_costs_a_fixed_few_bytes_each() {
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let store = FeatureStore::new();
    // Warm up (the first release creates the tables and the endpoint entry).
    for i in 0..1000 {
        store.release(&result(i, &dead)).unwrap();
    }
    const N: usize = 20_000;
    let results: Vec<Published> = (1000..1000 + N).map(|i| result(i, &dead)).collect();
    let before = LIVE.load(Ordering::Relaxed);
    for r in &results {
        store.release(r).unwrap();
    }
    let grown = LIVE.load(Ordering::Relaxed) - before;
    // Each release is remembered as a 128-bit hash (16 bytes in a set and 16 in a queue, plus
    // the set's spare capacity), not by its ~800 bytes of strings.
    let per = grown as f64 / N as f64;
    assert!(per < 100.0, "{per:.0} bytes per released sample");
    assert!(store.get(&results[0], None).is_err(), "still remembered");
    // Its sender drops them (a free counts as pending until its sender has seen to it).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while store.health().pending_frees > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(
        store.health().pending_frees,
        0,
        "a gone producer's frees are dropped"
    );
}
