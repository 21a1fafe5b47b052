//! Builds and loads the fake CUDA driver (`fake_cuda.c`): host memory standing in for a GPU,
//! for tests of the device path on machines without one. Every test that uses it says `fake_gpu`
//! in its name. Shared by the core's and the CLI's tests (`#[path]`).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The C source, next to this file.
const SOURCE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../capture-arena/tests/fake_cuda/fake_cuda.c"
);

/// The fake NVML's C source (`libnvidia-ml.so.1`), next to the driver's.
const NVML_SOURCE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../capture-arena/tests/fake_cuda/fake_nvml.c"
);

/// Compiles `source` into `<dir>/<soname>`.
fn compile(dir: &Path, soname: &str, source: &str) {
    let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-shared", "-fPIC", "-O2", "-Wall"])
        .arg(format!("-Wl,-soname,{soname}"))
        .arg("-o")
        .arg(dir.join(soname))
        .arg(source)
        .arg("-lpthread")
        .status()
        .expect("running the C compiler (cc) for the fake CUDA driver");
    assert!(status.success(), "compiling {source} failed");
}

/// Compiles the fake driver (`libcuda.so.1`) and the fake NVML (`libnvidia-ml.so.1`) once per
/// test binary into `<dir>` and returns `<dir>` (put it on `LD_LIBRARY_PATH` of a child process).
pub fn dir(target_tmp: &str) -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(target_tmp).join(format!("fake-cuda-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("creating the fake driver's folder");
        compile(&dir, "libcuda.so.1", SOURCE);
        compile(&dir, "libnvidia-ml.so.1", NVML_SOURCE);
        dir
    })
}

/// Loads the fake driver and the fake NVML into this process under their sonames, so the
/// lookups by soname (`libcuda.so.1`, `libnvidia-ml.so.1`) find them. Call before anything
/// touches the driver.
pub fn load(target_tmp: &str) {
    static LOADED: OnceLock<()> = OnceLock::new();
    LOADED.get_or_init(|| {
        for soname in ["libcuda.so.1", "libnvidia-ml.so.1"] {
            let path = dir(target_tmp).join(soname);
            let c = std::ffi::CString::new(path.to_string_lossy().as_bytes()).unwrap();
            // SAFETY: loads our own test library; it has no initialisers.
            let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
            assert!(!h.is_null(), "dlopen of the fake {soname} failed");
        }
    });
}

/// A function of the loaded fakes (`load`), looked up in the global scope.
fn sym(name: &str) -> *mut std::ffi::c_void {
    let c = std::ffi::CString::new(name).unwrap();
    // SAFETY: looks a symbol up among the libraries loaded with RTLD_GLOBAL.
    let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c.as_ptr()) };
    assert!(!f.is_null(), "the fakes are not loaded (no {name})");
    f
}

/// Sets knob `name` through the fake's setter `setter`; returns the old value.
fn set_knob(setter: &str, name: &str, value: i64) -> i64 {
    let c = std::ffi::CString::new(name).unwrap();
    // SAFETY: both fakes' setters have this signature (fake_cuda.c, fake_nvml.c); the name is
    // NUL-terminated.
    unsafe {
        let f: extern "C" fn(*const std::ffi::c_char, std::ffi::c_long) -> std::ffi::c_long =
            std::mem::transmute(sym(setter));
        f(c.as_ptr(), value as std::ffi::c_long) as i64
    }
}

/// Sets a knob of the loaded fake NVML (`state`, `status`, `rc`, `zero_uuid`); returns the old
/// value.
pub fn nvml_knob(name: &str, value: i64) -> i64 {
    set_knob("fake_nvml_knob", name, value)
}

/// Sets a knob of the loaded fake driver (`copy_us`, `fail_copies_after`, `fabric_attr`,
/// `imex`, ...: fake_cuda.c lists them); returns the old value.
pub fn knob(name: &str, value: i64) -> i64 {
    set_knob("fake_cuda_knob", name, value)
}

/// The calling thread's current context in the fake driver (null when none).
pub fn current() -> usize {
    // SAFETY: the fake's function of this signature (fake_cuda.c).
    let f: extern "C" fn() -> *mut std::ffi::c_void =
        unsafe { std::mem::transmute(sym("fake_cuda_current")) };
    f() as usize
}

/// Calls the fake's counter `name`, which takes one int.
fn count(name: &str, which: impl Into<std::ffi::c_int>) -> i64 {
    // SAFETY: the fake's counters have this signature (fake_cuda.c).
    let f: extern "C" fn(std::ffi::c_int) -> std::ffi::c_long =
        unsafe { std::mem::transmute(sym(name)) };
    f(which.into()) as i64
}

/// How many allocations the fake made with `gpuDirectRDMACapable` set (`rdma`), or without.
pub fn allocations(rdma: bool) -> i64 {
    count("fake_cuda_allocations", rdma)
}

/// How many copies between host and device memory the fake enqueued whose host end was pinned
/// (`cuMemHostRegister`, for the copy's context), or pageable.
pub fn host_copies(pinned: bool) -> i64 {
    count("fake_cuda_host_copies", pinned)
}

/// 2-D copies (`cuMemcpy2DAsync`) the fake has enqueued.
pub fn copies_2d() -> i64 {
    count("fake_cuda_copies_2d", false)
}

/// Copies the fake has begun running on a stream (each sleeps `copy_us` first).
pub fn copies_begun() -> i64 {
    count("fake_cuda_events", false)
}

/// Times anyone asked whether the device can pin host memory: a pinning thread's first step.
pub fn host_register_asks() -> i64 {
    count("fake_cuda_events", true)
}

/// Registrations (`cuMemHostRegister`) begun: each takes `register_us`.
pub fn registrations() -> i64 {
    count("fake_cuda_events", 2)
}

/// Allocation handles released (`cuMemRelease`).
pub fn releases() -> i64 {
    count("fake_cuda_events", 3)
}

/// Waits up to 5 s for `what` to exceed `than`; false if it never did.
pub fn wait_above(what: fn() -> i64, than: i64) -> bool {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while what() <= than {
        if std::time::Instant::now() > until {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    true
}

/// Bytes of host memory registered with the fake now.
pub fn pinned_bytes() -> i64 {
    // SAFETY: the fake's function of this signature (fake_cuda.c).
    let f: extern "C" fn() -> std::ffi::c_long =
        unsafe { std::mem::transmute(sym("fake_cuda_pinned_bytes")) };
    f() as i64
}

/// A stream of a context of the caller's own on `device` (not the device's primary context, as a
/// library with its own contexts makes them); the calling thread's current context is left as
/// it was (none).
pub fn foreign_stream(device: i32) -> u64 {
    type CtxCreate = extern "C" fn(*mut *mut std::ffi::c_void, u32, i32) -> i32;
    type StreamCreate = extern "C" fn(*mut *mut std::ffi::c_void, u32) -> i32;
    type SetCurrent = extern "C" fn(*mut std::ffi::c_void) -> i32;
    // SAFETY: the fake's functions have these signatures (fake_cuda.c).
    unsafe {
        let create: CtxCreate = std::mem::transmute(sym("cuCtxCreate_v2"));
        let stream: StreamCreate = std::mem::transmute(sym("cuStreamCreate"));
        let set: SetCurrent = std::mem::transmute(sym("cuCtxSetCurrent"));
        let mut ctx = std::ptr::null_mut();
        assert_eq!(create(&mut ctx, 0, device), 0);
        let mut s = std::ptr::null_mut();
        assert_eq!(stream(&mut s, 1), 0);
        assert_eq!(set(std::ptr::null_mut()), 0);
        s as u64
    }
}

/// One reserved range of 2 MiB pieces, each `Some(device)` mapped from an allocation of its own
/// on that device (access granted to it), each `None` left unmapped: a hole. Returns the range's
/// address (never freed: a test's lifetime).
pub fn vmm_pieces(pieces: &[Option<i32>]) -> u64 {
    let sized: Vec<(Option<i32>, usize)> = pieces.iter().map(|&d| (d, 2 << 20)).collect();
    vmm_range(&sized)
}

/// Device memory of GPU `device` made as a VMM pool makes it (torch's expandable segments,
/// cudaMallocAsync): `cuMemCreate` + map, with access granted to `device` alone; `bytes` copied
/// in. Returns its address (never freed: a test's lifetime).
pub fn vmm_buffer(device: i32, bytes: &[u8]) -> u64 {
    let size = bytes.len().div_ceil(2 << 20).max(1) * (2 << 20);
    let ptr = vmm_range(&[(Some(device), size)]);
    // SAFETY: the mapping is host memory of `size` bytes once access is granted (the fake's),
    // so the bytes are written directly.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr as *mut u8, bytes.len()) };
    ptr
}

/// One reserved range of pieces `(device, bytes)` (bytes a multiple of 2 MiB), one after
/// another: each `Some(device)` `cuMemCreate`d on that device and mapped, access granted to it
/// alone; each `None` left unmapped. Returns the range's address.
fn vmm_range(pieces: &[(Option<i32>, usize)]) -> u64 {
    #[repr(C)]
    struct Prop {
        type_: i32,
        handle_types: i32,
        loc_type: i32,
        loc_id: i32,
        win32: *mut std::ffi::c_void,
        flags: [u8; 8],
    }
    #[repr(C)]
    struct Access {
        loc_type: i32,
        loc_id: i32,
        flags: i32,
    }
    type SetCurrent = extern "C" fn(*mut std::ffi::c_void) -> i32;
    type Create = extern "C" fn(*mut u64, usize, *const Prop, u64) -> i32;
    type Reserve = extern "C" fn(*mut u64, usize, usize, u64, u64) -> i32;
    type Map = extern "C" fn(u64, usize, usize, u64, u64) -> i32;
    type SetAccess = extern "C" fn(u64, usize, *const Access, usize) -> i32;
    // SAFETY: the fake's functions have these signatures (fake_cuda.c).
    unsafe {
        let set: SetCurrent = std::mem::transmute(sym("cuCtxSetCurrent"));
        let create: Create = std::mem::transmute(sym("cuMemCreate"));
        let reserve: Reserve = std::mem::transmute(sym("cuMemAddressReserve"));
        let map: Map = std::mem::transmute(sym("cuMemMap"));
        let access: SetAccess = std::mem::transmute(sym("cuMemSetAccess"));
        let mut base = 0;
        let total = pieces.iter().map(|p| p.1).sum();
        assert_eq!(reserve(&mut base, total, 0, 0, 0), 0);
        let mut at = base;
        for &(device, size) in pieces {
            if let Some(device) = device {
                assert_eq!(set((device as isize + 1) as *mut std::ffi::c_void), 0);
                let prop = Prop {
                    type_: 1,
                    handle_types: 1,
                    loc_type: 1,
                    loc_id: device,
                    win32: std::ptr::null_mut(),
                    flags: [0; 8],
                };
                let mut h = 0;
                assert_eq!(create(&mut h, size, &prop, 0), 0);
                assert_eq!(map(at, size, 0, h, 0), 0);
                let grant = Access {
                    loc_type: 1,
                    loc_id: device,
                    flags: 3,
                };
                assert_eq!(access(at, size, &grant, 1), 0);
            }
            at += size as u64;
        }
        assert_eq!(set(std::ptr::null_mut()), 0);
        base
    }
}
