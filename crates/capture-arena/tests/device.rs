//! The device path (cargo feature `cuda`) against the fake CUDA driver (`fake_cuda/`): host
//! memory stands in for the GPU, everything else is real — the writer's asynchronous copies and
//! completion, handle export and import through the reply path, mappings, the reader. Every
//! test here says `fake_gpu` in its name; `scripts/gpu-check.sh` runs the same paths on a real
//! GPU.
#![cfg(feature = "cuda")]

mod fake_cuda;
mod util;

use std::os::linux::net::SocketAddrExt;

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use capture_arena::memory::cuda::{DeviceBuffer, ExternalDeviceRegion};
use capture_arena::{
    Config, Destination, DeviceSlice, Dtype, Error, FeatureStore, Published, Sample, Tensor,
    TensorData, Writer,
};
use util::pattern;

/// How long a test waits for the writer to place a batch.
const BOUND: Duration = Duration::from_secs(5);

/// The fake's knobs are process-wide: tests that use the driver run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// `CAPTURE_ARENA_TEST_REAL_GPU=1` (scripts/gpu-check.sh): run against the real driver instead
/// of the fake; the tests that need the fake's knobs skip, saying so.
fn real_gpu() -> bool {
    std::env::var_os("CAPTURE_ARENA_TEST_REAL_GPU").is_some_and(|v| v == "1")
}

fn setup() -> MutexGuard<'static, ()> {
    let g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    if !real_gpu() {
        fake_cuda::load(env!("CARGO_TARGET_TMPDIR"));
        // Two GPUs, set before the driver is first used (the count is read once per process).
        fake_cuda::knob("devices", 2);
        for (k, v) in [
            ("copy_us", 0),
            ("fail_copies_after", -1),
            ("fabric_attr", 0),
            ("imex", 0),
            ("gdr_attr", 1),
            ("fault", 0),
            ("odd_error", 0),
            ("host_register", 1),
            ("capturing", 0),
            ("register_us", 0),
            ("d2d_pitch_align", 1),
            ("max_pitch", i32::MAX as i64),
        ] {
            fake_cuda::knob(k, v);
        }
        for (k, v) in [("state", 3), ("status", 0), ("rc", 0), ("zero_uuid", 0)] {
            fake_cuda::nvml_knob(k, v);
        }
    }
    g
}

/// For tests that steer the fake driver: `None` (and a printed reason) on a real GPU.
fn setup_fake(test: &str) -> Option<MutexGuard<'static, ()>> {
    if real_gpu() {
        eprintln!("skipped on a real GPU: {test} steers the fake driver's knobs");
        return None;
    }
    Some(setup())
}

fn device_config(bytes: u64, wait: Duration) -> Config {
    Config {
        gpu_put: Some(true),
        ..util::config(bytes, wait)
    }
}

fn bytes_of(id: &str, name: &str, n: usize) -> Vec<u8> {
    (0..n).map(|j| pattern(id, name, j)).collect()
}

/// A sample of uint8 tensors `t0, t1, ...` in device memory of GPU 0 (with `host_last`, the
/// last one in host memory), filled with [`pattern`].
fn device_sample(id: &str, sizes: &[usize], host_last: bool, replace: bool) -> Sample {
    let mut s = Sample::new("st", id, 1).unwrap().with_replace(replace);
    for (i, &n) in sizes.iter().enumerate() {
        let name = format!("t{i}");
        let bytes = bytes_of(id, &name, n);
        let data = if host_last && i + 1 == sizes.len() {
            TensorData::host(bytes)
        } else {
            let buf = DeviceBuffer::new(0, n as u64).unwrap();
            buf.upload(0, &bytes).unwrap();
            // SAFETY: the buffer is device memory of `n` bytes, owned by the tensor until the
            // writer drops it; nothing else writes it.
            unsafe { TensorData::device(buf.ptr(), n as u64, 0, None, buf) }.unwrap()
        };
        s.push(Tensor::new(name, vec![n as u64], Dtype::Uint8, data).unwrap())
            .unwrap();
    }
    s
}

fn publish(w: &Writer, s: Sample) -> Published {
    w.submit(vec![s]).unwrap().wait().unwrap().remove(0)
}

/// Reads every feature into host buffers and into device buffers, and checks both.
fn read_and_check(store: &FeatureStore, p: &Published) {
    let mut names: Vec<&str> = p.features.keys().map(String::as_str).collect();
    names.sort();
    let lens: Vec<usize> = names
        .iter()
        .map(|n| p.features[*n].shape[0] as usize)
        .collect();
    let mut bufs: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0u8; n]).collect();
    let mut outs: Vec<(&str, &mut [u8])> = names
        .iter()
        .copied()
        .zip(bufs.iter_mut().map(Vec::as_mut_slice))
        .collect();
    store.get_many_into(p, &mut outs).unwrap();
    let dev: Vec<DeviceBuffer> = lens
        .iter()
        .map(|&n| DeviceBuffer::new(0, n as u64).unwrap())
        .collect();
    let mut dests: Vec<(&str, Destination<'_>)> = names
        .iter()
        .zip(&dev)
        // SAFETY: each buffer is device memory of exactly its length, used by nobody else.
        .map(|(n, d)| {
            (
                *n,
                Destination::Device(unsafe { DeviceSlice::new(d.ptr(), d.len(), 0) }),
            )
        })
        .collect();
    store.get_many_to(p, &mut dests).unwrap();
    for ((name, host), d) in names.iter().zip(&bufs).zip(&dev) {
        assert_eq!(
            *host,
            bytes_of(&p.sample_id, name, host.len()),
            "{name} (host)"
        );
        let mut back = vec![0u8; host.len()];
        d.download(0, &mut back).unwrap();
        assert_eq!(back, *host, "{name} (device)");
    }
}

/// Releases `p` through `store`, sends the frees and waits until the arena is empty.
fn release_all(store: &FeatureStore, p: &Published, w: &Writer) {
    store.release(p).unwrap();
    store.flush().unwrap();
    wait_all_free(w);
}

fn wait_all_free(w: &Writer) {
    let (s, ok) = w.wait_for(Duration::from_secs(10), |s| {
        s.resident_objects == 0 && s.free_bytes == s.capacity
    });
    assert!(ok, "arena not fully free: {s:?}");
}

#[test]
fn fake_gpu_device_arena_publishes_device_and_host_sources_and_frees_to_empty() {
    let _g = setup();
    let w = Writer::start(&device_config(8 << 20, Duration::from_secs(1))).unwrap();
    let session = &w.arena_ref().session;
    // The fake has no IMEX channel by default; a real GPU may have one (fabric).
    assert!(
        session.starts_with("cuda://")
            && (session.contains("&handle=fd&")
                || (real_gpu() && session.contains("&handle=fabric&"))),
        "{session}"
    );
    // Rounded up to the allocation granularity: what a one-byte region of the same kind takes
    // (2 MiB on the fake; read from the driver, not assumed, on a real GPU).
    let granularity = {
        use capture_arena::memory::Region;
        let one = capture_arena::memory::cuda::DeviceRegion::create(
            1,
            &capture_arena::memory::cuda::DeviceRegionOptions {
                device: 0,
                handle: Default::default(),
            },
        )
        .unwrap();
        one.len()
    };
    assert!(
        granularity > 1 && granularity <= w.capacity(),
        "{granularity}"
    );
    assert_eq!(w.capacity() % granularity, 0, "granularity {granularity}");
    let store = FeatureStore::new();
    let sizes = [100_000, 1, 4096, 300_000];
    let results: Vec<Published> = (0..3)
        .map(|i| publish(&w, device_sample(&format!("s{i}"), &sizes, i == 1, false)))
        .collect();
    for p in &results {
        assert_eq!(p.arena.session, *session);
        read_and_check(&store, p);
        store.release(p).unwrap();
    }
    store.flush().unwrap();
    wait_all_free(&w);
}

#[test]
fn fake_gpu_frees_are_served_while_device_copies_run() {
    let Some(_g) = setup_fake("fake_gpu_frees_are_served_while_device_copies_run") else {
        return;
    };
    let w = Writer::start(&device_config(8 << 20, Duration::from_secs(5))).unwrap();
    let first = publish(&w, device_sample("a", &[1000], false, false));
    // Every copy now takes 200 ms on the writer's stream: the next batch's six copies run for
    // over a second, during which a free must still be applied.
    fake_cuda::knob("copy_us", 200_000);
    let handle = w
        .submit(vec![device_sample("b", &[1000; 6], false, false)])
        .unwrap();
    util::free(
        &first.arena.control,
        &first
            .keys()
            .unwrap()
            .iter()
            .map(|k| k.to_string())
            .collect::<Vec<_>>(),
    );
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.freed_objects >= 1);
    assert!(ok, "the free was not applied: {s:?}");
    assert_eq!(
        s.published_batches, 1,
        "the free was applied only after the copies finished"
    );
    let b = handle.wait().unwrap().remove(0);
    fake_cuda::knob("copy_us", 0);
    read_and_check(&FeatureStore::new(), &b);
}

#[test]
fn fake_gpu_failed_copy_fails_the_batch_and_gives_its_space_back() {
    let Some(_g) = setup_fake("fake_gpu_failed_copy_fails_the_batch_and_gives_its_space_back")
    else {
        return;
    };
    let w = Writer::start(&device_config(8 << 20, Duration::from_secs(1))).unwrap();
    let batch = vec![device_sample("x", &[1000, 2000, 3000], true, false)];
    // The second copy of the batch fails to enqueue (after the first was enqueued).
    fake_cuda::knob("fail_copies_after", 1);
    let e = w.submit(batch).unwrap().wait().unwrap_err();
    assert!(matches!(e, Error::Device { .. }), "{e}");
    assert!(e.to_string().contains("CUDA_ERROR_INVALID_VALUE"), "{e}");
    let s = w.stats();
    assert_eq!((s.resident_objects, s.free_bytes), (0, s.capacity), "{s:?}");
    fake_cuda::knob("fail_copies_after", -1);
    // Nothing of the failed batch is resident: the same keys publish now.
    let p = publish(&w, device_sample("x", &[1000, 2000, 3000], true, false));
    read_and_check(&FeatureStore::new(), &p);
}

#[test]
fn fake_gpu_arena_full_wait_then_replace_on_the_device() {
    let _g = setup();
    let w = Writer::start(&device_config(4 << 20, Duration::from_millis(300))).unwrap();
    assert_eq!(w.capacity(), 4 << 20);
    let a = publish(&w, device_sample("a", &[3 << 20], false, false));
    let e = w
        .submit(vec![device_sample("b", &[3 << 20], false, false)])
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(matches!(e, Error::ArenaFull { .. }), "{e}");
    // A replace of the resident sample fits in place of the old one.
    let mut s = Sample::new("st", "a", 1).unwrap().with_replace(true);
    let new = vec![0x5au8; 3 << 20];
    let buf = DeviceBuffer::new(0, new.len() as u64).unwrap();
    buf.upload(0, &new).unwrap();
    // SAFETY: as in `device_sample`.
    let data = unsafe { TensorData::device(buf.ptr(), buf.len(), 0, None, buf) }.unwrap();
    s.push(Tensor::new("t0", vec![3 << 20], Dtype::Uint8, data).unwrap())
        .unwrap();
    let r = publish(&w, s);
    assert_eq!(r.features["t0"].address, a.features["t0"].address);
    let mut back = vec![0u8; 3 << 20];
    FeatureStore::new().get_into(&r, "t0", &mut back).unwrap();
    assert!(back == new, "the replaced bytes were not read back");
}

#[test]
fn fake_gpu_fabric_only_when_a_real_export_works() {
    let Some(_g) = setup_fake("fake_gpu_fabric_only_when_a_real_export_works") else {
        return;
    };
    // The device says fabric, but there is no IMEX channel: POSIX fd, and the log says why.
    fake_cuda::knob("fabric_attr", 1);
    let w = Writer::start(&device_config(2 << 20, Duration::from_secs(1))).unwrap();
    assert!(w.arena_ref().session.contains("&handle=fd&"));
    drop(w);
    fake_cuda::knob("imex", 1);
    let w = Writer::start(&device_config(2 << 20, Duration::from_secs(1))).unwrap();
    let session = w.arena_ref().session.clone();
    assert!(session.contains("&handle=fabric&fabric="), "{session}");
    // The handle travels in the session: imported without the reply path.
    let p = publish(&w, device_sample("f", &[5000, 7], true, false));
    let store = FeatureStore::new();
    read_and_check(&store, &p);
    store.release(&p).unwrap();
    store.flush().unwrap();
    wait_all_free(&w);
    // A session whose fabric handle was forged is refused before any read.
    let forged = session.replace("&fabric=46414b45", "&fabric=00000000");
    assert!(FeatureStore::new().reader().open(&forged).is_err());
}

/// Fabric handles only where NVML says the GPU's fabric registration is complete (as NCCL asks),
/// and where this process can import its own fabric export again (an IMEX channel half set up
/// creates and exports, but imports fail, as every reader's would): POSIX fd otherwise.
#[test]
fn fake_gpu_fabric_only_where_nvml_says_registered_and_an_import_works() {
    let Some(_g) =
        setup_fake("fake_gpu_fabric_only_where_nvml_says_registered_and_an_import_works")
    else {
        return;
    };
    fake_cuda::knob("fabric_attr", 1);
    fake_cuda::knob("imex", 1);
    let handle = || {
        let w = Writer::start(&device_config(2 << 20, Duration::from_secs(1))).unwrap();
        let s = w.arena_ref().session.clone();
        if s.contains("&handle=fabric&") {
            "fabric"
        } else {
            assert!(s.contains("&handle=fd&"), "{s}");
            "fd"
        }
    };
    assert_eq!(handle(), "fabric");
    fake_cuda::nvml_knob("state", 2); // IN_PROGRESS
    assert_eq!(handle(), "fd");
    fake_cuda::nvml_knob("state", 3);
    fake_cuda::nvml_knob("status", 9); // COMPLETED, with an error
    assert_eq!(handle(), "fd");
    fake_cuda::nvml_knob("status", 0);
    fake_cuda::knob("imex", 2); // creates and exports, cannot import
    assert_eq!(handle(), "fd");
    fake_cuda::knob("imex", 1);
    assert_eq!(handle(), "fabric");
    fake_cuda::nvml_knob("zero_uuid", 1); // this node's NVLink alone
    assert_eq!(handle(), "fd");
    fake_cuda::nvml_knob("zero_uuid", 0);
    fake_cuda::nvml_knob("rc", 3); // NOT_SUPPORTED: no NVLink fabric
    assert_eq!(handle(), "fd");
    fake_cuda::nvml_knob("rc", 0);
    assert_eq!(handle(), "fabric");
    // Asked for fabric explicitly, a registration in progress is an error that says so.
    fake_cuda::nvml_knob("state", 2);
    let e = Writer::start(&Config {
        handle: capture_arena::config::HandlePreference::Fabric,
        ..device_config(2 << 20, Duration::from_secs(1))
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("IN_PROGRESS"), "{e}");
}

#[test]
fn fake_gpu_reader_checks_ranges_and_notices_a_gone_producer() {
    let _g = setup();
    let w = Writer::start(&device_config(2 << 20, Duration::from_secs(1))).unwrap();
    let p = publish(&w, device_sample("r", &[4096], false, false));
    let store = FeatureStore::new();
    let t = store.reader().open(&p.arena.session).unwrap();
    let end = p.features["t0"].address + w.capacity();
    let mut buf = vec![0u8; 16];
    let e = t
        .read(&mut [capture_arena::ReadOp {
            address: end - 8,
            into: Destination::Host(&mut buf),
        }])
        .unwrap_err();
    assert!(matches!(e, Error::OutOfRange { .. }), "{e}");
    // A session string naming a different arena (another nonce) is refused by the writer.
    let other = {
        let (head, tail) = p.arena.session.split_once('-').unwrap();
        let nonce = &tail[..32];
        let flipped: String = nonce
            .chars()
            .map(|c| if c == '0' { '1' } else { '0' })
            .collect();
        format!("{head}-{flipped}{}", &tail[32..])
    };
    let e = FeatureStore::new().reader().open(&other).unwrap_err();
    assert!(matches!(e, Error::StaleSession { .. }), "{e}");
    drop(w);
    // Within a second of the producer's writer going, reads fail as stale: read until one does
    // (three seconds' checks at most).
    let mut out = vec![0u8; 4096];
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    let e = loop {
        match store.get_into(&p, "t0", &mut out) {
            Err(e) => break e,
            Ok(_) => assert!(std::time::Instant::now() < deadline, "still read after 3 s"),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(matches!(e, Error::StaleSession { .. }), "{e}");
    assert!(capture_arena::transport::is_gone(&p.arena.session));
}

#[test]
fn fake_gpu_external_region_takes_someone_elses_device_memory() {
    let _g = setup();
    let mem = DeviceBuffer::new(0, 1 << 20).unwrap();
    let ptr = mem.ptr();
    let keep = std::sync::Arc::new(mem);
    // SAFETY: the buffer is device memory of 1 MiB, kept alive by the region (owner) and
    // written by nobody else.
    let region = unsafe {
        ExternalDeviceRegion::new(ptr, 1 << 20, 0, "engine-host:12345".into(), keep.clone())
    }
    .unwrap();
    let w = Writer::start_with_region(
        &util::config(1 << 20, Duration::from_secs(1)),
        Box::new(region),
    )
    .unwrap();
    assert_eq!(w.arena_ref().session, "engine-host:12345");
    let p = publish(&w, device_sample("e", &[1000, 333], true, false));
    for (name, f) in &p.features {
        let n = f.shape[0] as usize;
        let mut back = vec![0u8; n];
        keep.download(f.address - ptr, &mut back).unwrap();
        assert_eq!(back, bytes_of("e", name, n), "{name}");
    }
}

#[test]
fn fake_gpu_device_tensors_under_a_host_arena_are_copied_to_host() {
    let _g = setup();
    let w = Writer::start(&util::config(1 << 20, Duration::from_secs(1))).unwrap();
    assert!(w.arena_ref().session.starts_with("shm://"));
    let p = publish(&w, device_sample("h", &[1000, 77], false, false));
    // Read into host and into device buffers from shared memory.
    read_and_check(&FeatureStore::new(), &p);
}

/// Copies between shared memory and the GPU run from pinned memory, on both sides: the writer
/// pins its arena once a device tensor comes, a reader its read-only view (with the read-only
/// flag the driver requires for such a mapping) once it reads into a GPU, each on a thread of its
/// own while the first copies go on pageable; portable, so copies on any GPU's streams count;
/// with this thread's capture mode relaxed, so a graph another thread captures is not broken;
/// both unpinned when they go. Where the device cannot pin, copies stay pageable and correct.
#[test]
fn fake_gpu_host_arenas_are_pinned_for_device_copies() {
    let Some(_g) = setup_fake("fake_gpu_host_arenas_are_pinned_for_device_copies") else {
        return;
    };
    assert_eq!(fake_cuda::pinned_bytes(), 0, "pins left by another test");
    fake_cuda::knob("capturing", 1); // another thread captures a CUDA graph (global mode)
    let pinned_at_least = |n: i64| {
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while fake_cuda::pinned_bytes() < n {
            assert!(
                std::time::Instant::now() < until,
                "not pinned: {} bytes",
                fake_cuda::pinned_bytes()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    {
        let w = Writer::start(&util::config(1 << 20, Duration::from_secs(1))).unwrap();
        let store = FeatureStore::new();
        // The first device tensor starts the pinning; the copies meanwhile are pageable.
        let first = publish(&w, device_sample("pin0", &[1000], false, false));
        pinned_at_least(1 << 20);
        let s = device_sample("pin", &[1000, 77], true, false);
        let pageable = fake_cuda::host_copies(false);
        let p = publish(&w, s);
        assert_eq!(
            fake_cuda::host_copies(false) - pageable,
            0,
            "the writer copied into its pinned arena as pageable memory"
        );
        // A tensor of the other GPU: its copy runs on that GPU's stream, where a pin made in GPU
        // 0's context counts only because it is portable.
        let bytes = bytes_of("gpu1", "t0", 4096);
        let buf = DeviceBuffer::new(1, 4096).unwrap();
        buf.upload(0, &bytes).unwrap();
        let mut s1 = Sample::new("st", "gpu1", 1).unwrap();
        // SAFETY: device memory of GPU 1, 4096 bytes, owned by the tensor until the writer drops it.
        let data = unsafe { TensorData::device(buf.ptr(), 4096, 1, None, buf) }.unwrap();
        s1.push(Tensor::new("t0", vec![4096], Dtype::Uint8, data).unwrap())
            .unwrap();
        let pageable = fake_cuda::host_copies(false);
        let on_gpu1 = publish(&w, s1);
        assert_eq!(
            fake_cuda::host_copies(false) - pageable,
            0,
            "a copy on GPU 1's stream saw the arena as pageable (not portable?)"
        );
        // The reader's first read into a GPU starts its pinning; the next reads are pinned.
        read_and_check(&store, &first);
        pinned_at_least(2 << 20);
        let pageable = fake_cuda::host_copies(false);
        read_and_check(&store, &p);
        // The only pageable copies: the test's own downloads of the two device buffers it read
        // into (read_and_check) into Vecs.
        assert_eq!(
            fake_cuda::host_copies(false) - pageable,
            2,
            "a read from the pinned view ran as pageable memory"
        );
        store.release(&first).unwrap();
        store.release(&on_gpu1).unwrap();
        release_all(&store, &p, &w);
    }
    // The reader's view goes with its last holder: the store's free sender, which holds the
    // reader's session liveness check, ends within about 100 ms of its last send.
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while fake_cuda::pinned_bytes() != 0 {
        assert!(
            std::time::Instant::now() < until,
            "a pin outlived its mapping: {} bytes",
            fake_cuda::pinned_bytes()
        );
        std::thread::sleep(Duration::from_millis(5));
    }

    fake_cuda::knob("host_register", 0);
    let asks = fake_cuda::host_register_asks();
    let w = Writer::start(&util::config(1 << 20, Duration::from_secs(1))).unwrap();
    let store = FeatureStore::new();
    let s = device_sample("pageable", &[1000], false, false);
    let pageable = fake_cuda::host_copies(false);
    let p = publish(&w, s);
    read_and_check(&store, &p);
    // The pinning threads (the arena's, the reader's view) asked and were told no.
    assert!(
        fake_cuda::wait_above(fake_cuda::host_register_asks, asks + 1),
        "no pinning thread asked whether the device can pin"
    );
    let again = publish(&w, device_sample("pageable2", &[1000], false, false));
    assert_eq!(fake_cuda::pinned_bytes(), 0);
    assert!(fake_cuda::host_copies(false) - pageable >= 4);
    store.release(&again).unwrap();
    release_all(&store, &p, &w);
}

#[test]
fn fake_gpu_no_device_is_a_clear_error_not_a_crash() {
    let _g = setup();
    let e = Writer::start(&Config {
        device: Some(64),
        ..device_config(1 << 20, Duration::from_secs(1))
    })
    .unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("device(s)") && text.contains("SGLANG_SPEC_CAPTURE_ARENA_DEVICE"),
        "{text}"
    );
}

#[test]
fn fake_gpu_the_callers_current_context_is_left_as_it_was() {
    let Some(_g) = setup_fake("fake_gpu_the_callers_current_context_is_left_as_it_was") else {
        return;
    };
    let w = Writer::start(&device_config(2 << 20, Duration::from_secs(1))).unwrap();
    let session = w.arena_ref().session.clone();
    // A fresh thread has no current context; publishing and reading must not leave one (torch
    // follows the driver's current context: the caller's device must not change under it).
    std::thread::spawn(move || {
        assert_eq!(fake_cuda::current(), 0);
        let p = publish(&w, device_sample("c", &[4096, 10], true, false));
        assert_eq!(
            fake_cuda::current(),
            0,
            "publishing changed the current context"
        );
        let mut out = vec![0u8; 4096];
        let store = FeatureStore::new();
        store.get_into(&p, "t0", &mut out).unwrap();
        assert_eq!(p.arena.session, session);
        assert_eq!(
            fake_cuda::current(),
            0,
            "reading changed the current context"
        );
    })
    .join()
    .unwrap();
}

#[test]
fn fake_gpu_a_squatter_on_the_reply_endpoint_is_not_believed() {
    let _g = setup();
    // A session naming producer pid 1, whose reply endpoint someone else (this test) bound: the
    // reader checks the peer's pid before reading its answer, so no descriptor is imported.
    let w = Writer::start(&device_config(2 << 20, Duration::from_secs(1))).unwrap();
    let real: capture_arena::memory::cuda::CudaSession = w.arena_ref().session.parse().unwrap();
    let nonce = "ab".repeat(16);
    let squat = format!("{}1-{nonce}", capture_arena::reply::ENDPOINT_PREFIX);
    let forged = capture_arena::memory::cuda::CudaSession {
        pid: 1,
        reply: squat.clone(),
        ..real
    };
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(
        squat.trim_start_matches('@').as_bytes(),
    )
    .unwrap();
    let listener = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
    let text = forged.to_string();
    let answer = text.clone();
    let t = std::thread::spawn(move || {
        use std::io::Write;
        if let Ok((mut c, _)) = listener.accept() {
            let _ = writeln!(c, "{{\"ok\": true, \"len\": {}, \"fds\": 0}}", answer.len());
            let _ = c.write_all(answer.as_bytes());
        }
    });
    let e = FeatureStore::new().reader().open(&text).unwrap_err();
    assert!(matches!(e, Error::StaleSession { .. }), "{e}");
    assert!(e.to_string().contains("not by the producer (pid 1)"), "{e}");
    t.join().unwrap();
}

#[test]
fn fake_gpu_a_device_arena_is_rdma_capable_where_the_device_supports_it() {
    let Some(_g) =
        setup_fake("fake_gpu_a_device_arena_is_rdma_capable_where_the_device_supports_it")
    else {
        return;
    };
    // GPUDirect RDMA on VMM memory supported (H200, GB200): the arena is allocated with
    // gpuDirectRDMACapable, so NIXL can register it with a NIC.
    let (rdma, plain) = (fake_cuda::allocations(true), fake_cuda::allocations(false));
    let w = Writer::start(&device_config(2 << 20, Duration::from_secs(1))).unwrap();
    assert_eq!(fake_cuda::allocations(true), rdma + 1);
    assert_eq!(fake_cuda::allocations(false), plain);
    drop(w);
    // Not supported: the flag is not asked for (the fake, like a driver, refuses it then) and
    // the arena still works.
    fake_cuda::knob("gdr_attr", 0);
    let w = Writer::start(&device_config(2 << 20, Duration::from_secs(1))).unwrap();
    assert_eq!(fake_cuda::allocations(false), plain + 1);
    let p = publish(&w, device_sample("g", &[4096], false, false));
    let store = FeatureStore::new();
    read_and_check(&store, &p);
    store.release(&p).unwrap();
    store.flush().unwrap();
    wait_all_free(&w);
    fake_cuda::knob("gdr_attr", 1);
}

#[test]
fn fake_gpu_a_reader_that_cannot_import_fabric_handles_takes_the_descriptor_on_the_same_node() {
    let Some(_g) = setup_fake(
        "fake_gpu_a_reader_that_cannot_import_fabric_handles_takes_the_descriptor_on_the_same_node",
    ) else {
        return;
    };
    // The producer has an IMEX channel: a fabric arena, exportable as a descriptor too.
    fake_cuda::knob("fabric_attr", 1);
    fake_cuda::knob("imex", 1);
    let w = Writer::start(&device_config(2 << 20, Duration::from_secs(1))).unwrap();
    assert!(w.arena_ref().session.contains("&handle=fabric&"));
    let p = publish(&w, device_sample("x", &[5000, 7], true, false));
    // The trainer's process has none (a container without the channel): importing the fabric
    // handle fails, and on the producer's node the reader takes the descriptor instead.
    fake_cuda::knob("imex", 0);
    let store = FeatureStore::new();
    read_and_check(&store, &p);
    release_all(&store, &p, &w);
}

#[test]
fn fake_gpu_a_gpu_fault_fails_the_batch_instead_of_hanging_the_writer() {
    let Some(_g) = setup_fake("fake_gpu_a_gpu_fault_fails_the_batch_instead_of_hanging_the_writer")
    else {
        return;
    };
    let w = Writer::start(&device_config(8 << 20, Duration::from_secs(5))).unwrap();
    // Each copy takes 300 ms: the batch is on the device when the context error hits. After it
    // the driver runs nothing more and never calls the host function that wakes the writer.
    fake_cuda::knob("copy_us", 300_000);
    let begun = fake_cuda::copies_begun();
    let handle = w
        .submit(vec![device_sample("f", &[1000; 3], false, false)])
        .unwrap();
    assert!(
        fake_cuda::wait_above(fake_cuda::copies_begun, begun),
        "the batch never reached the device"
    );
    fake_cuda::knob("fault", 1);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(handle.wait());
    });
    let got = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the batch never completed: the writer waits forever on a faulted GPU");
    let e = got.unwrap_err();
    assert!(e.to_string().contains("ILLEGAL_ADDRESS"), "{e}");
    fake_cuda::knob("fault", 0);
    fake_cuda::knob("copy_us", 0);
    // The writer lives on, and its space came back.
    let (s, ok) = w.wait_for(Duration::from_secs(5), |s| s.failed_batches >= 1);
    assert!(ok, "{s:?}");
    wait_all_free(&w);
}

#[test]
fn fake_gpu_an_external_region_of_host_memory_is_refused_before_any_copy() {
    let _g = setup();
    // What Mooncake's allocate_managed_buffer returns when an earlier TransferEngine in the
    // process set its allocator up for rdma: malloc'd host memory, not the GPU's.
    let host = vec![0u8; 1 << 20];
    let ptr = host.as_ptr() as u64;
    // SAFETY: the check refuses the range before anything is written to it.
    let e = unsafe { ExternalDeviceRegion::new(ptr, 1 << 20, 0, "engine-host:1".into(), ()) }
        .unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, Error::Device { .. }), "{text}");
    assert!(
        text.contains("not device memory") && text.contains("SGLANG_SPEC_CAPTURE_PLACEMENT=arena"),
        "{text}"
    );
    drop(host);
    // Device memory whose end runs past its allocation is refused too. Far past it (1 TiB): an
    // end just past it may land in another allocation this process still holds (a clean clone
    // on 2026-12-07 found one of GPU 1 there, which is refused with other words).
    let mem = DeviceBuffer::new(0, 1 << 20).unwrap();
    // SAFETY: refused before use.
    let e = unsafe { ExternalDeviceRegion::new(mem.ptr(), 1 << 40, 0, "engine-host:1".into(), ()) }
        .unwrap_err();
    assert!(e.to_string().contains("not device memory"), "{e}");
}

#[test]
fn fake_gpu_an_external_region_is_checked_allocation_by_allocation() {
    let Some(_g) = setup_fake("fake_gpu_an_external_region_is_checked_allocation_by_allocation")
    else {
        return;
    };
    const PIECE: u64 = 2 << 20;
    let region = |pieces: &[Option<i32>], len: u64| {
        let base = fake_cuda::vmm_pieces(pieces);
        // SAFETY: GPU 0's memory where accepted (then never written: dropped at once); refused
        // before use otherwise.
        unsafe { ExternalDeviceRegion::new(base, len, 0, "engine-host:1".into(), ()) }
            .map(drop)
            .map_err(|e| e.to_string())
    };
    // One range mapped from several allocations, one after another (as a pool maps its
    // granules): accepted, and so is a range that ends inside its last one.
    region(&[Some(0), Some(0), Some(0)], 3 * PIECE).unwrap();
    region(&[Some(0), Some(0)], PIECE + 1).unwrap();
    // A hole between two allocations of GPU 0: its first and last byte are GPU 0's, the hole is
    // not device memory (before: accepted, and a copy there would fault on the GPU).
    let e = region(&[Some(0), None, Some(0)], 3 * PIECE).unwrap_err();
    assert!(e.contains("not device memory"), "{e}");
    // An allocation of GPU 1 between two of GPU 0.
    let e = region(&[Some(0), Some(1), Some(0)], 3 * PIECE).unwrap_err();
    assert!(e.contains("memory of GPU 1, not of GPU 0"), "{e}");
    // A driver that does not say where allocations begin and end: the first and last byte
    // alone, as before.
    let before = fake_cuda::knob("range_attrs", 0);
    let accepted = region(&[Some(0), None, Some(0)], 3 * PIECE);
    let refused = region(&[Some(0), Some(0), None], 3 * PIECE);
    fake_cuda::knob("range_attrs", before);
    accepted.unwrap();
    assert!(refused.unwrap_err().contains("not device memory"));
}

#[test]
fn fake_gpu_an_fd_arena_on_a_gpu_this_process_does_not_see_says_what_to_change() {
    let _g = setup();
    let w = Writer::start(&device_config(2 << 20, Duration::from_secs(1))).unwrap();
    let p = publish(&w, device_sample("v", &[4096], false, false));
    // The same session naming a GPU this process does not see (CUDA_VISIBLE_DEVICES hides the
    // producer's): refused with what to change, before any import into another GPU's context.
    let real: capture_arena::memory::cuda::CudaSession = p.arena.session.parse().unwrap();
    let hidden = capture_arena::memory::cuda::CudaSession {
        device_uuid: "0123456789abcdef0123456789abcdef".into(),
        ..real
    };
    let e = FeatureStore::new()
        .reader()
        .open(&hidden.to_string())
        .unwrap_err();
    assert!(matches!(e, Error::Device { .. }), "{e}");
    assert!(
        e.to_string().contains("CUDA_VISIBLE_DEVICES")
            && e.to_string().contains("SGLANG_SPEC_CAPTURE_TRANSPORT=nixl"),
        "{e}"
    );
}

#[test]
fn fake_gpu_a_tensor_on_a_stream_of_another_context_is_waited_for_in_that_context() {
    let Some(_g) = setup_fake(
        "fake_gpu_a_tensor_on_a_stream_of_another_context_is_waited_for_in_that_context",
    ) else {
        return;
    };
    let w = Writer::start(&device_config(2 << 20, Duration::from_secs(1))).unwrap();
    // The producer's stream belongs to a context of its own, not the device's primary one: the
    // event the writer waits on is made in the stream's context (the driver refuses an event and
    // a stream of different contexts).
    let stream = fake_cuda::foreign_stream(0);
    let bytes = bytes_of("o", "t0", 5000);
    let buf = DeviceBuffer::new(0, 5000).unwrap();
    buf.upload(0, &bytes).unwrap();
    // SAFETY: device memory of 5000 bytes owned by the tensor; `stream` is a live stream of
    // device 0.
    let data = unsafe { TensorData::device(buf.ptr(), 5000, 0, Some(stream), buf) }.unwrap();
    let mut s = Sample::new("st", "o", 1).unwrap();
    s.push(Tensor::new("t0", vec![5000], Dtype::Uint8, data).unwrap())
        .unwrap();
    let p = publish(&w, s);
    let store = FeatureStore::new();
    read_and_check(&store, &p);
    release_all(&store, &p, &w);
}

#[test]
fn fake_gpu_a_tensor_of_another_gpus_vmm_pool_is_copied_on_that_gpus_stream() {
    let Some(_g) =
        setup_fake("fake_gpu_a_tensor_of_another_gpus_vmm_pool_is_copied_on_that_gpus_stream")
    else {
        return;
    };
    let w = Writer::start(&device_config(4 << 20, Duration::from_secs(1))).unwrap();
    // A tensor on GPU 1 from a VMM pool (torch's expandable segments): only GPU 1 was granted
    // access to it, so GPU 0's stream cannot read it; the copy runs on a stream of GPU 1, which
    // the arena (on GPU 0, mapped for its peers) lets write.
    let bytes = bytes_of("p", "t0", 70_000);
    let ptr = fake_cuda::vmm_buffer(1, &bytes);
    // SAFETY: 70 000 bytes of GPU 1 memory, never freed (the test's lifetime).
    let data = unsafe { TensorData::device(ptr, 70_000, 1, None, ()) }.unwrap();
    let mut s = device_sample("p", &[4096], true, false);
    s.push(Tensor::new("t1", vec![70_000], Dtype::Uint8, data).unwrap())
        .unwrap();
    let p = publish(&w, s);
    let mut back = vec![0u8; 70_000];
    let store = FeatureStore::new();
    store.get_into(&p, "t1", &mut back).unwrap();
    assert_eq!(back, bytes);
    release_all(&store, &p, &w);
}

#[test]
fn fake_gpu_a_result_code_no_cuda_version_lists_is_an_error_that_names_it() {
    let Some(_g) =
        setup_fake("fake_gpu_a_result_code_no_cuda_version_lists_is_an_error_that_names_it")
    else {
        return;
    };
    // A newer driver's code (the GPU machine runs CUDA 13): read as an integer, never as a
    // value of the bindings' enum (which would be undefined behaviour).
    fake_cuda::knob("odd_error", 987_654);
    let e = Writer::start(&device_config(2 << 20, Duration::from_secs(1))).unwrap_err();
    fake_cuda::knob("odd_error", 0);
    assert!(matches!(e, Error::Device { .. }), "{e}");
    assert!(e.to_string().contains("987654"), "{e}");
}

#[test]
fn fake_gpu_a_read_into_another_gpus_vmm_memory_copies_on_that_gpu() {
    let Some(_g) = setup_fake("fake_gpu_a_read_into_another_gpus_vmm_memory_copies_on_that_gpu")
    else {
        return;
    };
    let w = Writer::start(&device_config(2 << 20, Duration::from_secs(1))).unwrap();
    let p = publish(&w, device_sample("q", &[30_000], false, false));
    // The trainer's output is memory of GPU 1 from a VMM pool (torch's expandable segments):
    // only GPU 1 may write it, so the copy runs on a stream of GPU 1, through the reader's
    // mapping of the arena, which grants GPU 1 access.
    let ptr = fake_cuda::vmm_buffer(1, &[0u8; 30_000]);
    // SAFETY: 30 000 bytes of GPU 1 memory used by nobody else.
    let mut dests = [(
        "t0",
        Destination::Device(unsafe { DeviceSlice::new(ptr, 30_000, 1) }),
    )];
    let store = FeatureStore::new();
    store.get_many_to(&p, &mut dests).unwrap();
    // SAFETY: the fake's device memory is host memory, readable once mapped (it is).
    let back = unsafe { std::slice::from_raw_parts(ptr as *const u8, 30_000) };
    assert_eq!(back, &bytes_of("q", "t0", 30_000)[..]);
    release_all(&store, &p, &w);
}

/// A cache `[blocks, k, bs, row]` of distinct bytes in device memory of GPU 0 (`slot_major`:
/// memory ordered `[blocks, bs, k, row]`, as one of vLLM's layouts is), its bytes and its layout.
fn device_cache(
    blocks: u64,
    k: u64,
    bs: u64,
    row: u64,
    slot_major: bool,
) -> (DeviceBuffer, Vec<u8>, capture_arena::paged::Paged) {
    let len = blocks * k * bs * row;
    let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    let cache = DeviceBuffer::new(0, len).unwrap();
    cache.upload(0, &bytes).unwrap();
    let strides = if slot_major {
        (k * bs * row, row, k * row)
    } else {
        (k * bs * row, bs * row, row)
    };
    let paged = capture_arena::paged::Paged {
        base: cache.ptr(),
        len,
        blocks,
        strides,
        block_size: bs,
        k,
        row_bytes: row,
    };
    (cache, bytes, paged)
}

/// The object `[n, k, row]` a row-by-row reading of `bytes` (laid out as `src`) makes.
fn rows_of(bytes: &[u8], src: &capture_arena::paged::Paged, blocks: &[u64], n: u64) -> Vec<u8> {
    let mut out = Vec::new();
    for i in 0..n {
        let b = blocks[(i / src.block_size) as usize];
        for l in 0..src.k {
            let at = (b * src.strides.0 + l * src.strides.1 + (i % src.block_size) * src.strides.2)
                as usize;
            out.extend_from_slice(&bytes[at..at + src.row_bytes as usize]);
        }
    }
    out
}

#[test]
fn fake_gpu_a_requests_rows_go_straight_from_the_cache_blocks_into_host_and_device_objects() {
    use capture_arena::paged::DeviceCopies;
    let _g = setup();
    let copies = DeviceCopies::new(0).unwrap();
    for slot_major in [false, true] {
        let (_cache, bytes, src) = device_cache(6, 3, 4, 16, slot_major);
        let (blocks, n) = ([2u64, 0, 5], 10u64);
        let len = n * 3 * 16;
        let strips = src.plan(len, &blocks, n).unwrap();
        let mut host = vec![0u8; len as usize];
        let device = DeviceBuffer::new(0, len).unwrap();
        let before = if real_gpu() {
            0
        } else {
            fake_cuda::copies_2d()
        };
        // SAFETY: the plan is checked against both lengths; the cache, the host buffer and the
        // device buffer live until the mark below has been waited for.
        unsafe {
            copies
                .rows(src.base, host.as_mut_ptr() as u64, true, &strips)
                .unwrap();
            copies.rows(src.base, device.ptr(), false, &strips).unwrap();
        }
        copies.mark().unwrap().wait().unwrap();
        let want = rows_of(&bytes, &src, &blocks, n);
        assert_eq!(host, want, "device-to-host, slot-major {slot_major}");
        let mut back = vec![0u8; len as usize];
        device.download(0, &mut back).unwrap();
        assert_eq!(back, want, "device-to-device, slot-major {slot_major}");
        if !real_gpu() {
            // A 2-D copy per block and layer; where a slot holds its layers side by side, a
            // plain copy per block (a run of blocks: one): never a copy per row.
            let per_object = if slot_major { 0 } else { 9 };
            assert_eq!(fake_cuda::copies_2d() - before, 2 * per_object);
        }
    }
}

#[test]
fn fake_gpu_rows_are_copied_only_after_the_writers_event_and_each_request_lands_alone() {
    use capture_arena::paged::{copy_requests_device, DeviceCopies, Landed, Request};
    let Some(_g) = setup_fake("fake_gpu_rows_are_copied_only_after_the_writers_event") else {
        return;
    };
    let (cache, _old, src) = device_cache(4, 2, 4, 8, true);
    // The "drafter" rewrites the cache on a stream of its own, slowly (every copy takes 50 ms,
    // and it writes 8 times, the last time what the rows must be): they are read after it,
    // through its event, never while it runs (the rows' own copies take 50 ms each too).
    fake_cuda::knob("copy_us", 50_000);
    let drafter = DeviceCopies::new(0).unwrap();
    let new: Vec<u8> = (0..src.len).map(|i| (i * 13 % 241) as u8).collect();
    for pass in 0..8u8 {
        let bytes: Vec<u8> = if pass == 7 {
            new.clone()
        } else {
            vec![pass; src.len as usize]
        };
        // SAFETY: the cache is device memory of `src.len` bytes, alive until the end.
        unsafe { drafter.bytes(cache.ptr(), &bytes).unwrap() };
    }
    let written = drafter.mark().unwrap();
    let copies = DeviceCopies::new(0).unwrap();
    let n = 6u64;
    let rows_len = n * 2 * 8;
    let mut words = reserved_arena(1024, &[0, 512], n, rows_len);
    let base = words.as_mut_ptr() as u64;
    let request = |at: u64, keys: &str, blocks: Vec<u64>| Request {
        keys: vec![keys.into()],
        ids_dst: base + at,
        ids_stamp: 1 + at,
        ids: (0..n as i64).map(|i| 100 + i).collect(),
        rows_dst: base + at + 64,
        rows_stamp: 1 + at,
        rows_len,
        block_ids: blocks,
    };
    let requests = vec![
        request(0, "a", vec![3, 1]),
        request(256, "outside", vec![9, 1]), // block 9 is not in the cache
        request(512, "b", vec![0, 2]),
    ];
    let mut finished = Vec::new();
    // SAFETY: the cache lives until the end, the arena stands in for a host arena (alive, not
    // overlapping it), and the event lives until the call returns.
    let why = unsafe {
        copy_requests_device(
            &copies,
            written.handle(),
            &src,
            (base, 1024),
            true,
            None,
            requests,
            |i, landed| finished.push((i, landed)),
        )
    };
    fake_cuda::knob("copy_us", 0);
    let arena = arena_bytes(&words);
    // The bad request fails alone (by its keys), and at once; the good ones land in order, each
    // naming the objects it wrote.
    assert_eq!(
        finished,
        [
            (
                1,
                Landed::FailedKeys(vec!["outside".into()], vec![257, 257])
            ),
            (0, Landed::Written(written_at(base, 0, n, rows_len))),
            (2, Landed::Written(written_at(base, 512, n, rows_len)))
        ]
    );
    assert!(why[0].is_none() && why[2].is_none(), "{why:?}");
    assert!(
        why[1]
            .as_deref()
            .unwrap()
            .contains("block 9 is not in the cache"),
        "{why:?}"
    );
    for (at, blocks) in [(0usize, [3u64, 1]), (512, [0, 2])] {
        let ids: Vec<i64> = arena[at..at + 48]
            .chunks(8)
            .map(|c| i64::from_ne_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(ids, (100..106).collect::<Vec<i64>>());
        let want = rows_of(&new, &src, &blocks, n);
        assert_eq!(
            arena[at + 64..at + 64 + rows_len as usize],
            want[..],
            "the rows as the drafter left them"
        );
    }
    assert!(arena[256..512].iter().all(|&b| b == 0));
}

#[test]
fn fake_gpu_a_device_arenas_destinations_are_checked_against_the_writers_reservations() {
    // A device arena's stamp words are device memory, which the copy does not read: its
    // destinations are checked against the writer's table of the objects being written. A
    // request pointed at another request's rows object (with its own stamp), or carrying a
    // stamp of nothing, fails alone before a byte of it is enqueued; the other request's object
    // holds its own rows. (Without the table, b's rows land in a's object after a's own.) Each
    // copied request finishes the objects it wrote, by stamp and address; one that fails with
    // names the table vouched for fails those, not the keys it carries (e, given c's keys and
    // a block outside the cache, fails its own objects; c lands).
    use capture_arena::paged::{copy_requests_device, DeviceCopies, Landed, Request};
    let Some(_g) = setup_fake("fake_gpu_a_device_arenas_destinations_are_checked") else {
        return;
    };
    let w = Writer::start(&device_config(1 << 20, Duration::from_secs(2))).unwrap();
    let (_cache, bytes, src) = device_cache(4, 2, 4, 8, false);
    let n = 6u64;
    let rows_len = n * 2 * 8;
    let sample = |id: &str| {
        let mut s = Sample::new("st", id, 1).unwrap();
        for (name, dtype, shape, len) in [
            ("token_ids", Dtype::Int64, vec![n], n * 8),
            ("hidden_states", Dtype::Uint8, vec![rows_len], rows_len),
        ] {
            let t = Tensor::new(name, shape, dtype, TensorData::Reserved(len)).unwrap();
            s.push(t).unwrap();
        }
        s
    };
    let ids = ["a", "b", "c", "d", "e"];
    let published: Vec<Published> = w
        .submit_each_within(ids.iter().map(|id| sample(id)).collect(), BOUND)
        .unwrap()
        .into_iter()
        .map(|o| o.unwrap().remove(0))
        .collect();
    assert_eq!(w.reserved_objects().len(), 10);
    let dst = |p: &Published, name: &str| {
        let at = p.writable.as_ref().unwrap()[name];
        (at, p.features[name].stamp.unwrap())
    };
    let keys_of = |i: usize| -> Vec<String> {
        let names = published[i].features.keys();
        names
            .map(|name| format!("st/{}/g1/{name}", ids[i]))
            .collect()
    };
    let request = |i: usize, rows: (u64, u64), blocks: Vec<u64>| {
        let (ids_dst, ids_stamp) = dst(&published[i], "token_ids");
        Request {
            keys: keys_of(i),
            ids_dst,
            ids_stamp,
            ids: (0..n as i64).map(|j| 100 * i as i64 + j).collect(),
            rows_dst: rows.0,
            rows_stamp: rows.1,
            rows_len,
            block_ids: blocks,
        }
    };
    let own = |i: usize| dst(&published[i], "hidden_states");
    let requests = vec![
        request(0, own(0), vec![3, 1]),
        request(1, (own(0).0, own(1).1), vec![0, 2]), // a's rows object, b's own stamp
        request(2, own(2), vec![2, 3]),
        request(3, (own(3).0, 0), vec![1, 0]), // a stamp of nothing (stamps start at 1)
        Request {
            keys: keys_of(2),                 // c's keys
            ..request(4, own(4), vec![9, 0])  // block 9 is not in the cache
        },
    ];
    let copies = DeviceCopies::new(0).unwrap();
    let mut finished = Vec::new();
    // SAFETY: the cache lives until the end; the arena is the writer's device arena, whose
    // reserved objects nothing else writes.
    let why = unsafe {
        copy_requests_device(
            &copies,
            0,
            &src,
            w.local_region(),
            false,
            Some(w.reserved_objects()),
            requests,
            |i, landed| {
                match &landed {
                    Landed::Written(objects) => w.finish_written(*objects, true),
                    Landed::Failed(objects) => w.finish_written(*objects, false),
                    Landed::FailedKeys(keys, stamps) => {
                        w.fail_writes_of(keys.clone(), stamps.clone())
                    }
                }
                let how = match landed {
                    Landed::Written(_) => "written",
                    Landed::Failed(_) => "failed by name",
                    Landed::FailedKeys(..) => "failed by keys",
                };
                finished.push((i, how));
            },
        )
    };
    assert_eq!(
        finished,
        [
            (1, "failed by keys"),
            (3, "failed by keys"),
            (4, "failed by name"),
            (0, "written"),
            (2, "written")
        ]
    );
    assert!(
        why[1]
            .as_deref()
            .unwrap()
            .contains("is not the object reserved with stamp"),
        "{why:?}"
    );
    assert!(
        why[3]
            .as_deref()
            .unwrap()
            .contains("no object reserved with stamp 0"),
        "{why:?}"
    );
    assert!(why[4].as_deref().unwrap().contains("block 9"), "{why:?}");
    let (s, ok) = w.wait_for(Duration::from_secs(10), |s| {
        s.written_objects == 4 && s.failed_writes == 6
    });
    assert!(ok, "{s:?}");
    assert!(w.reserved_objects().is_empty());
    let store = FeatureStore::new();
    for (i, blocks) in [(0usize, [3u64, 1]), (2, [2, 3])] {
        let (mut got_ids, mut got_rows) = (vec![0u8; n as usize * 8], vec![0u8; rows_len as usize]);
        store
            .get_many_into(
                &published[i],
                &mut [
                    ("token_ids", &mut got_ids[..]),
                    ("hidden_states", &mut got_rows[..]),
                ],
            )
            .unwrap();
        let want_ids: Vec<u8> = (0..n as i64)
            .flat_map(|j| (100 * i as i64 + j).to_ne_bytes())
            .collect();
        assert_eq!(got_ids, want_ids);
        assert_eq!(
            got_rows,
            rows_of(&bytes, &src, &blocks, n),
            "request {i}'s rows"
        );
    }
    for i in [1, 3, 4] {
        let mut out = vec![0u8; n as usize * 8];
        let e = store
            .get_many_into(&published[i], &mut [("token_ids", &mut out[..])])
            .unwrap_err();
        assert!(e.to_string().contains("never"), "{e}");
    }
}

#[test]
fn fake_gpu_a_2d_copy_past_the_devices_pitch_limit_goes_row_by_row() {
    use capture_arena::paged::DeviceCopies;
    let Some(_g) = setup_fake("fake_gpu_a_2d_copy_past_the_devices_pitch_limit") else {
        return;
    };
    // A device whose 2-D copies take pitches of at most 32 bytes (a real one: 2^31 - 1, which
    // an object's rows of a long prompt pass as one run of blocks): the strips' 48-byte pitch
    // goes row by row.
    fake_cuda::knob("max_pitch", 32);
    let copies = DeviceCopies::new(0).unwrap();
    let (_cache, src, strips, want) = scattered_request();
    let mut host = vec![0u8; want.len()];
    // SAFETY: the plan is checked against both lengths; both live until the mark is waited for.
    let enqueued = unsafe { copies.rows(src.base, host.as_mut_ptr() as u64, true, &strips) };
    let landed = enqueued.and_then(|()| copies.mark()).and_then(|m| m.wait());
    fake_cuda::knob("max_pitch", i32::MAX as i64);
    landed.unwrap();
    assert_eq!(host, want);
}

/// A host arena of `bytes` for the row copies, 8-byte aligned, with a request's two objects
/// reserved at each of `at` as the writer places them: its `n` token ids there (stamp `1 + at`)
/// and its `rows_len` bytes of rows 64 bytes on (the same stamp), their stamp words pending.
fn reserved_arena(bytes: usize, at: &[u64], n: u64, rows_len: u64) -> Vec<u64> {
    use capture_arena::sample::{stamp_offset, PENDING_BIT};
    let mut words = vec![0u64; bytes / 8];
    for &at in at {
        for word in [at + stamp_offset(n * 8), at + 64 + stamp_offset(rows_len)] {
            words[word as usize / 8] = (1 + at) | PENDING_BIT;
        }
    }
    words
}

/// The objects a request copied into [`reserved_arena`] at `at` names as written: its token
/// ids and its rows, with their stamp (`1 + at`).
fn written_at(base: u64, at: u64, n: u64, rows_len: u64) -> [capture_arena::sample::Written; 2] {
    use capture_arena::sample::Written;
    [
        Written {
            stamp: 1 + at,
            at: base + at,
            len: n * 8,
        },
        Written {
            stamp: 1 + at,
            at: base + at + 64,
            len: rows_len,
        },
    ]
}

/// An arena's bytes, as [`reserved_arena`] holds them.
fn arena_bytes(words: &[u64]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_ne_bytes()).collect()
}

/// The request the pitch tests copy: blocks 2, 0 and 5 of a layer-major cache `[6, 3, 4, 16]`,
/// 10 tokens (a 2-D copy per block and layer, 48-byte rows in the object): the cache, its
/// layout, the plan's strips and the object's bytes they must make.
fn scattered_request() -> (
    DeviceBuffer,
    capture_arena::paged::Paged,
    Vec<capture_arena::paged::Strip>,
    Vec<u8>,
) {
    let (cache, bytes, src) = device_cache(6, 3, 4, 16, false);
    let (blocks, n) = ([2u64, 0, 5], 10u64);
    let strips = src.plan(n * 48, &blocks, n).unwrap();
    let want = rows_of(&bytes, &src, &blocks, n);
    (cache, src, strips, want)
}

#[test]
fn fake_gpu_a_device_to_device_2d_copy_the_driver_refuses_goes_row_by_row() {
    use capture_arena::paged::DeviceCopies;
    let Some(_g) = setup_fake("fake_gpu_a_device_to_device_2d_copy_the_driver_refuses") else {
        return;
    };
    // A driver that takes intra-device 2-D copies only at pitches cuMemAllocPitch would give
    // (multiples of 512 here): the strips' 48-byte object pitch is refused device-to-device,
    // and those rows go one by one, now and for every later request of the stream (the second
    // request's would be taken 2-D, the driver's refusal lifted: they are not); copies into host
    // memory stay 2-D (the restriction is documented for intra-device copies only).
    fake_cuda::knob("d2d_pitch_align", 512);
    let copies = DeviceCopies::new(0).unwrap();
    let (_cache, src, strips, want) = scattered_request();
    let len = want.len() as u64;
    for request in 0..2 {
        let device = DeviceBuffer::new(0, len).unwrap();
        let mut host = vec![0u8; len as usize];
        let before = fake_cuda::copies_2d();
        // SAFETY: the plan is checked against both lengths; the buffers live until the mark
        // is waited for.
        let enqueued = unsafe {
            copies
                .rows(src.base, device.ptr(), false, &strips)
                .and_then(|()| copies.rows(src.base, host.as_mut_ptr() as u64, true, &strips))
        };
        let landed = enqueued.and_then(|()| copies.mark()).and_then(|m| m.wait());
        let two_d = fake_cuda::copies_2d() - before;
        fake_cuda::knob("d2d_pitch_align", 1);
        landed.unwrap();
        let mut back = vec![0u8; len as usize];
        device.download(0, &mut back).unwrap();
        assert_eq!(back, want, "device-to-device, request {request}");
        assert_eq!(host, want, "device-to-host, request {request}");
        assert_eq!(
            two_d, 9,
            "only the 9 device-to-host strips went 2-D (request {request})"
        );
    }
}

#[test]
fn fake_gpu_a_flat_run_of_blocks_is_copied_in_pieces() {
    use capture_arena::paged::{DeviceCopies, COPY_PIECE};
    let Some(_g) = setup_fake("fake_gpu_a_flat_run_of_blocks_is_copied_in_pieces") else {
        return;
    };
    // Slots holding their layer side by side, blocks in order: the request is one flat run of
    // 80 MiB, copied as pieces of at most COPY_PIECE bytes (64 MiB: 2 copies), not as one.
    let (blocks, bs, row) = (20u64, 1024u64, 4096u64);
    let (_cache, bytes, src) = device_cache(blocks, 1, bs, row, true);
    let ids: Vec<u64> = (0..blocks).collect();
    let n = blocks * bs;
    let len = n * row;
    let strips = src.plan(len, &ids, n).unwrap();
    assert_eq!(strips.len(), 1, "one flat run");
    let copies = DeviceCopies::new(0).unwrap();
    let mut host = vec![0u8; len as usize];
    let device = DeviceBuffer::new(0, len).unwrap();
    let before = fake_cuda::copies_begun();
    // SAFETY: the plan is checked against both lengths; both live until the mark is waited for.
    unsafe {
        copies
            .rows(src.base, host.as_mut_ptr() as u64, true, &strips)
            .unwrap();
        copies.rows(src.base, device.ptr(), false, &strips).unwrap();
    }
    copies.mark().unwrap().wait().unwrap();
    assert_eq!(
        fake_cuda::copies_begun() - before,
        2 * len.div_ceil(COPY_PIECE) as i64
    );
    assert!(host == bytes, "device-to-host rows differ");
    let mut back = vec![0u8; len as usize];
    device.download(0, &mut back).unwrap();
    assert!(back == bytes, "device-to-device rows differ");
}

/// A writable reservation of `len` bytes of address space that costs no memory until touched
/// (`MAP_NORESERVE`): a range as large as a production host arena, for the fake to register.
struct Reservation(*mut libc::c_void, usize);

impl Reservation {
    fn new(len: usize) -> Reservation {
        // SAFETY: a fresh anonymous mapping at an address the kernel picks.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(
            p,
            libc::MAP_FAILED,
            "reserving {len} bytes of address space"
        );
        Reservation(p, len)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `new`.
        unsafe { libc::munmap(self.0, self.1) };
    }
}

#[test]
fn fake_gpu_a_host_pin_dropped_while_registering_waits_only_for_the_chunk_under_way() {
    use capture_arena::paged::HostPin;
    let Some(_g) = setup_fake("fake_gpu_a_host_pin_dropped_while_registering") else {
        return;
    };
    // 130 GiB: three registrations (64, 64 and 2 GiB), 0.4 s each here (a real 64 GiB one:
    // about 6 s). Dropped during the first, the pin waits for it and starts no other: before,
    // it waited for all three.
    fake_cuda::knob("register_us", 400_000);
    let r = Reservation::new(130 << 30);
    let before = fake_cuda::registrations();
    // SAFETY: the reservation outlives the pin.
    let pin = unsafe { HostPin::start(0, r.0 as u64, r.1 as u64) };
    assert!(fake_cuda::wait_above(fake_cuda::registrations, before));
    let at_drop = fake_cuda::registrations() - before;
    drop(pin);
    let made = fake_cuda::registrations() - before;
    fake_cuda::knob("register_us", 0);
    assert!(
        made <= at_drop + 1 && made < 3,
        "{made} registrations made, {at_drop} begun when the pin was dropped"
    );
    assert_eq!(fake_cuda::pinned_bytes(), 0, "what was pinned is unpinned");
}

#[test]
fn fake_gpu_a_forked_child_drops_a_registering_host_pin_cleanly() {
    use capture_arena::paged::HostPin;
    let Some(_g) = setup_fake("fake_gpu_a_forked_child_drops_a_registering_host_pin") else {
        return;
    };
    // The child has no registering thread. A drop that joined it (before) found the thread
    // marked gone by glibc's fork handler and then panicked in std's join: its result never
    // came (in a Python child: a panic inside the object's deallocation).
    fake_cuda::knob("register_us", 3_000_000);
    let mut arena = vec![0u8; 1 << 20];
    let before = fake_cuda::registrations();
    // SAFETY: the vector outlives the pin.
    let pin = unsafe { HostPin::start(0, arena.as_mut_ptr() as u64, arena.len() as u64) };
    assert!(fake_cuda::wait_above(fake_cuda::registrations, before));
    // SAFETY: the child only drops the pin and exits, touching no lock another thread may hold
    // (the panic a broken drop raises allocates: glibc's malloc is safe after fork).
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork failed");
    if child == 0 {
        let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(pin)));
        // SAFETY: leaves at once, running nothing of the parent's.
        unsafe { libc::_exit(if dropped.is_ok() { 7 } else { 8 }) };
    }
    // It exits well before the parent's registration ends (3 s).
    let until = std::time::Instant::now() + Duration::from_millis(2500);
    let mut status = 0;
    let exited = loop {
        // SAFETY: waits for our own child without blocking.
        let rc = unsafe { libc::waitpid(child, &mut status, libc::WNOHANG) };
        if rc == child || std::time::Instant::now() > until {
            break rc == child;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    if !exited {
        // SAFETY: our own child, which is hung.
        unsafe {
            libc::kill(child, libc::SIGKILL);
            libc::waitpid(child, &mut status, 0);
        }
    }
    drop(pin);
    fake_cuda::knob("register_us", 0);
    assert!(exited, "the forked child hung dropping the pin");
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 7,
        "the forked child did not drop the pin cleanly: status {status:#x} (8: it panicked)"
    );
    assert_eq!(fake_cuda::pinned_bytes(), 0);
    drop(arena);
}

#[test]
fn fake_gpu_a_forked_child_drops_its_parents_reader_without_calling_the_driver() {
    // The fake driver counts the releases (a real one cannot be asked).
    let Some(_g) = setup_fake("fake_gpu_a_forked_child_drops_its_parents_reader") else {
        return;
    };
    // A trainer that read through CUDA handles forks (a DataLoader's worker), and the child
    // drops the reader it inherited. Before, its cached transports were torn down there: the
    // parent's mappings unmapped and their handles released through a driver that does not
    // survive fork (open, not drop, knew to leak them).
    let w = Writer::start(&device_config(2 << 20, Duration::from_secs(1))).unwrap();
    let p = publish(&w, device_sample("f", &[4096], false, false));
    let reader = capture_arena::client::Reader::new();
    let mut out = vec![0u8; 4096];
    reader.read(&p, "t0", &mut out).unwrap();
    assert_eq!(out, bytes_of("f", "t0", 4096));
    // SAFETY: the child drops the reader and leaves: it frees memory (glibc's malloc is safe
    // after fork) and takes no lock another thread may hold.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork failed");
    if child == 0 {
        let before = fake_cuda::releases();
        drop(reader);
        let released = fake_cuda::releases() != before;
        // SAFETY: leaves at once, running nothing of the parent's.
        unsafe { libc::_exit(if released { 8 } else { 7 }) };
    }
    let mut status = 0;
    // SAFETY: waits for our own child, which ends at once.
    unsafe { libc::waitpid(child, &mut status, 0) };
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 7,
        "the forked child tore down its parent's transports: status {status:#x} (8: it released handles)"
    );
    // The parent's reader reads on, and lets go of its handles when dropped.
    reader.read(&p, "t0", &mut out).unwrap();
    let before = fake_cuda::releases();
    drop(reader);
    assert!(
        fake_cuda::releases() > before,
        "the parent released nothing"
    );
    drop(w);
}

#[test]
fn fake_gpu_a_request_whose_copies_fail_midway_is_given_back_only_after_those_enqueued_land() {
    use capture_arena::paged::{copy_requests_device, DeviceCopies, Landed, Request};
    let Some(_g) = setup_fake("fake_gpu_a_request_whose_copies_fail_midway") else {
        return;
    };
    // Each request: 2 blocks x 2 layers, 4 copies of 20 ms each. The 7th copy fails to enqueue
    // (and every later one): the second request has 2 copies on their way when it fails, the
    // third none. Its space goes back (finished, false) only once those 2 have landed: its
    // object holds at that moment what it holds at the end.
    let (_cache, _bytes, src) = device_cache(4, 2, 4, 8, false);
    let n = 6u64;
    let rows_len = n * 2 * 8;
    let mut words = reserved_arena(1024, &[0, 256, 512], n, rows_len);
    let base = words.as_mut_ptr() as u64;
    let request = |at: u64, keys: &str| Request {
        keys: vec![keys.into()],
        ids_dst: base + at,
        ids_stamp: 1 + at,
        ids: (0..n as i64).collect(),
        rows_dst: base + at + 64,
        rows_stamp: 1 + at,
        rows_len,
        block_ids: vec![3, 1],
    };
    let copies = DeviceCopies::new(0).unwrap();
    fake_cuda::knob("copy_us", 20_000);
    fake_cuda::knob("fail_copies_after", 6);
    let mut finished = Vec::new();
    let at_failure = std::cell::RefCell::new(Vec::new());
    let b_rows = (base + 256 + 64) as usize;
    // SAFETY: the cache and the arena live until the end; the arena stands in for a host arena.
    let why = unsafe {
        copy_requests_device(
            &copies,
            0,
            &src,
            (base, 1024),
            true,
            None,
            vec![request(0, "a"), request(256, "b"), request(512, "c")],
            |i, landed| {
                if matches!(&landed, Landed::FailedKeys(keys, _) if keys[0] == "b") {
                    // SAFETY: the arena's bytes, read as they are when b is given back.
                    let now = std::slice::from_raw_parts(b_rows as *const u8, rows_len as usize);
                    at_failure.borrow_mut().extend_from_slice(now);
                }
                finished.push((i, landed));
            },
        )
    };
    fake_cuda::knob("fail_copies_after", -1);
    fake_cuda::knob("copy_us", 0);
    copies.synchronize().unwrap();
    let arena = arena_bytes(&words);
    assert_eq!(
        finished,
        [
            (1, Landed::FailedKeys(vec!["b".into()], vec![257, 257])),
            (2, Landed::FailedKeys(vec!["c".into()], vec![513, 513])),
            (0, Landed::Written(written_at(base, 0, n, rows_len)))
        ]
    );
    assert!(
        why[0].is_none() && why[1].is_some() && why[2].is_some(),
        "{why:?}"
    );
    let b_now = &arena[256 + 64..256 + 64 + rows_len as usize];
    assert_eq!(
        &at_failure.borrow()[..],
        b_now,
        "a copy landed in the second request's space after it was given back"
    );
    assert!(
        b_now.iter().any(|&x| x != 0),
        "its first copies landed before it was given back"
    );
}
