//! Creating an arena leaves the process's other threads running. Pre-faulting a mapping holds
//! the process's memory-map lock, which every other thread's `mmap` (a thread's stack, an
//! allocator's arena) and page fault also needs; a whole arena pre-faulted at once
//! (`MAP_POPULATE`) stopped them for most of its creation: a vLLM step waited 1.6 s for a thread
//! to start while a 1.7 GB arena was made beside it. Its own test binary: nothing else runs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use capture_arena::memory::ShmRegion;

/// One `mmap` of fresh anonymous memory, a touch of it, and its `munmap`: what starting a
/// thread or growing an allocator costs another thread.
fn map_touch_unmap() -> Duration {
    let t0 = Instant::now();
    let len = 1 << 20;
    // SAFETY: a fresh private anonymous mapping, written within its length, then unmapped.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        p.cast::<u8>().write_volatile(1);
        libc::munmap(p, len);
    }
    t0.elapsed()
}

#[test]
fn creating_an_arena_leaves_the_other_threads_of_its_process_running() {
    let len: u64 = 256 << 20;
    let stop = Arc::new(AtomicBool::new(false));
    let (mapping, running) = std::sync::mpsc::channel();
    let other = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut longest = map_touch_unmap();
            mapping.send(()).unwrap();
            while !stop.load(Ordering::Relaxed) {
                longest = longest.max(map_touch_unmap());
            }
            longest
        })
    };
    running.recv().unwrap(); // the other thread is mapping
    let t0 = Instant::now();
    let region = ShmRegion::create(len).expect("a 256 MiB arena in /dev/shm");
    let took = t0.elapsed();
    stop.store(true, Ordering::Relaxed);
    let longest = other.join().unwrap();
    drop(region);
    eprintln!("creating {len} bytes took {took:?}; the other thread's longest mmap {longest:?}");
    assert!(
        longest * 4 < took,
        "another thread waited {longest:?} of the arena's {took:?} creation"
    );
}
