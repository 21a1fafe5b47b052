//! NVML, loaded at run time for the one question the CUDA driver cannot answer: has this GPU
//! finished registering with its NVLink fabric? Fabric handles of a GPU whose registration is
//! not complete (fabric manager or IMEX still starting, or failed) do not import in other
//! processes. NCCL (`ncclMnnvlCheck`), NVSHMEM and vLLM ask `nvmlDeviceGetGpuFabricInfoV` before
//! they export memory by fabric handle, and want state COMPLETED, status SUCCESS and a non-zero
//! cluster UUID; so does the device arena's handle choice.

use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::sync::OnceLock;

/// What NVML says of a GPU's fabric.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fabric {
    /// Registered: fabric handles may be used (the cluster UUID in hex, the clique).
    Ready { cluster: String, clique: u32 },
    /// Not registered, or NVML says no: why.
    NotReady(String),
    /// NVML could not be asked (no library, an older one): why. The caller's own trial decides.
    Unknown(String),
}

/// `nvmlGpuFabricInfo_v2_t` (nvml.h, CUDA 12.4 and later; NCCL's `nvmlwrap.h` copies it).
#[repr(C)]
#[derive(Default)]
struct FabricInfoV2 {
    version: c_uint,
    cluster_uuid: [u8; 16],
    status: c_int,
    clique_id: c_uint,
    /// `nvmlGpuFabricState_t`: an `unsigned char` in some headers, so only the low byte counts.
    state: c_uint,
    health_mask: c_uint,
}

/// `nvmlGpuFabricInfo_v2`: the struct's size with the version in the top byte.
const FABRIC_INFO_V2: c_uint = std::mem::size_of::<FabricInfoV2>() as c_uint | (2 << 24);
/// `NVML_GPU_FABRIC_STATE_COMPLETED`.
const STATE_COMPLETED: c_uint = 3;
/// `NVML_ERROR_NOT_SUPPORTED`.
const NOT_SUPPORTED: c_int = 3;

type GetHandleByUuid = unsafe extern "C" fn(*const c_char, *mut *mut c_void) -> c_int;
type GetFabricInfoV = unsafe extern "C" fn(*mut c_void, *mut FabricInfoV2) -> c_int;

struct Nvml {
    by_uuid: GetHandleByUuid,
    fabric_info: GetFabricInfoV,
    /// Keeps the library loaded (it is never unloaded: NVML is initialised for the process).
    _lib: libloading::Library,
}

/// Loads `libnvidia-ml.so.1` and initialises it, once per process.
fn nvml() -> Result<&'static Nvml, String> {
    static NVML: OnceLock<Result<Nvml, String>> = OnceLock::new();
    NVML.get_or_init(|| {
        // SAFETY: loading the NVIDIA management library runs its initialisers, which have no
        // preconditions.
        let lib = unsafe { libloading::Library::new("libnvidia-ml.so.1") }
            .map_err(|e| format!("libnvidia-ml.so.1 not loaded ({e})"))?;
        // SAFETY: these symbols are NVML's functions of these C signatures (nvml.h).
        let (init, by_uuid, fabric_info) = unsafe {
            let init = *lib
                .get::<unsafe extern "C" fn() -> c_int>(b"nvmlInit_v2")
                .map_err(|e| format!("nvmlInit_v2: {e}"))?;
            let by_uuid = *lib
                .get::<GetHandleByUuid>(b"nvmlDeviceGetHandleByUUID")
                .map_err(|e| format!("nvmlDeviceGetHandleByUUID: {e}"))?;
            let fabric_info = *lib
                .get::<GetFabricInfoV>(b"nvmlDeviceGetGpuFabricInfoV")
                .map_err(|e| format!("nvmlDeviceGetGpuFabricInfoV (NVML older than 550): {e}"))?;
            (init, by_uuid, fabric_info)
        };
        // SAFETY: no arguments; safe to call more than once per process.
        let rc = unsafe { init() };
        if rc != 0 {
            return Err(format!("nvmlInit_v2 returned {rc}"));
        }
        Ok(Nvml {
            by_uuid,
            fabric_info,
            _lib: lib,
        })
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// NVML's name of the GPU whose UUID is `hex` (32 hex digits, as [`super::Context::uuid`]):
/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
fn nvml_uuid(hex: &str) -> Option<String> {
    if hex.len() != 32 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    Some(format!(
        "GPU-{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    ))
}

/// The fabric registration of the GPU whose UUID is `uuid_hex`.
pub(crate) fn fabric(uuid_hex: &str) -> Fabric {
    let nvml = match nvml() {
        Ok(n) => n,
        Err(e) => return Fabric::Unknown(e),
    };
    let Some(name) = nvml_uuid(uuid_hex).and_then(|n| CString::new(n).ok()) else {
        return Fabric::Unknown(format!("{uuid_hex:?} is not a GPU UUID"));
    };
    let mut device = std::ptr::null_mut();
    // SAFETY: a NUL-terminated UUID string; writes one handle.
    let rc = unsafe { (nvml.by_uuid)(name.as_ptr(), &mut device) };
    if rc != 0 {
        return Fabric::Unknown(format!("nvmlDeviceGetHandleByUUID({name:?}) returned {rc}"));
    }
    let mut info = FabricInfoV2 {
        version: FABRIC_INFO_V2,
        ..FabricInfoV2::default()
    };
    // SAFETY: a device handle NVML returned; writes at most the versioned struct.
    let rc = unsafe { (nvml.fabric_info)(device, &mut info) };
    if rc == NOT_SUPPORTED {
        return Fabric::NotReady("NVML: the GPU is not on an NVLink fabric".into());
    }
    if rc != 0 {
        return Fabric::Unknown(format!("nvmlDeviceGetGpuFabricInfoV returned {rc}"));
    }
    let state = info.state & 0xff;
    let cluster: String = info
        .cluster_uuid
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if state == STATE_COMPLETED && info.status == 0 && info.cluster_uuid == [0; 16] {
        return Fabric::NotReady(
            "NVML: the GPU's fabric registration is complete but names no cluster (a cluster \
             UUID of zeros: this node's NVLink alone, no multi-node fabric); fabric handles \
             would reach no other node"
                .into(),
        );
    }
    if state != STATE_COMPLETED || info.status != 0 {
        let name = match state {
            0 => "NOT_SUPPORTED",
            1 => "NOT_STARTED",
            2 => "IN_PROGRESS",
            3 => "COMPLETED",
            _ => "unknown",
        };
        return Fabric::NotReady(format!(
            "NVML: the GPU's fabric registration is {name} (state {state}, status {}, cluster \
             {cluster}); fabric handles need it COMPLETED with status 0 (check the fabric \
             manager and nvidia-imex on this node)",
            info.status
        ));
    }
    Fabric::Ready {
        cluster,
        clique: info.clique_id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_struct_version_is_nvml_s() {
        // nvml.h: #define nvmlGpuFabricInfo_v2 0x02000024 (36 bytes).
        assert_eq!(FABRIC_INFO_V2, 0x0200_0024);
    }

    #[test]
    fn uuids_are_spelled_as_nvml_spells_them() {
        assert_eq!(
            nvml_uuid("f0f1f2f3f4f5f6f7f8f9fafbfcfdfe00").as_deref(),
            Some("GPU-f0f1f2f3-f4f5-f6f7-f8f9-fafbfcfdfe00")
        );
        assert_eq!(nvml_uuid("xyz"), None);
        assert_eq!(nvml_uuid(&"g".repeat(32)), None);
    }
}
