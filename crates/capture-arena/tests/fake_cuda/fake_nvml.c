/*
 * A fake NVML (libnvidia-ml.so.1) for the device tests: the one question capture-arena asks
 * (nvmlDeviceGetGpuFabricInfoV, whether a GPU's NVLink fabric registration is complete), with
 * the checks the real library makes: nvmlInit_v2 first, a device named by its "GPU-..." UUID, the
 * struct version it was built for. Built and loaded next to the fake driver (fake_cuda/mod.rs).
 *
 * Knob: fake_nvml_knob("state" | "status" | "rc" | "zero_uuid", value), else FAKE_NVML_STATE
 * (default 3, COMPLETED), FAKE_NVML_STATUS (default 0), FAKE_NVML_RC (what
 * nvmlDeviceGetGpuFabricInfoV returns, default 0; 3 is NOT_SUPPORTED, as on a GPU without an
 * NVLink fabric), FAKE_NVML_ZERO_UUID (default 0; 1: a cluster UUID of zeros, as a single node).
 * The state is an unsigned char in nvml.h, followed by padding: the fake writes that byte alone
 * and junk in the padding.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
enum { SUCCESS = 0, UNINITIALIZED = 1, INVALID_ARGUMENT = 2, NOT_FOUND = 6, VERSION_MISMATCH = 25 };

typedef struct {
  unsigned int version;
  unsigned char clusterUuid[16];
  nvmlReturn_t status;
  unsigned int cliqueId;
  unsigned char state;
  unsigned char padding[3];
  unsigned int healthMask;
} FabricInfoV2;

static int initialised;
static long knob_state = -2, knob_status = -2, knob_rc = -2, knob_zero_uuid = -2;
static long env_long(const char *k, long dflt) {
  const char *v = getenv(k);
  return v && *v ? atol(v) : dflt;
}
long fake_nvml_knob(const char *name, long value) {
  long *k = !strcmp(name, "state") ? &knob_state
          : !strcmp(name, "status") ? &knob_status
          : !strcmp(name, "rc") ? &knob_rc
          : !strcmp(name, "zero_uuid") ? &knob_zero_uuid : NULL;
  if (!k) return -3;
  return __atomic_exchange_n(k, value, __ATOMIC_SEQ_CST);
}

nvmlReturn_t nvmlInit_v2(void) { __atomic_store_n(&initialised, 1, __ATOMIC_SEQ_CST); return SUCCESS; }
nvmlReturn_t nvmlShutdown(void) { __atomic_store_n(&initialised, 0, __ATOMIC_SEQ_CST); return SUCCESS; }

/* A device handle is its UUID's last byte + 1 (the fake driver's UUIDs end in the ordinal). */
nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, void **device) {
  if (!__atomic_load_n(&initialised, __ATOMIC_SEQ_CST)) return UNINITIALIZED;
  if (!uuid || !device) return INVALID_ARGUMENT;
  /* GPU-f0f1f2f3-f4f5-f6f7-f8f9-fafbfcfdfeNN */
  if (strlen(uuid) != 40 || strncmp(uuid, "GPU-f0f1f2f3-f4f5-f6f7-f8f9-fafbfcfdfe", 38) != 0) return NOT_FOUND;
  *device = (void *)(uintptr_t)(strtol(uuid + 38, NULL, 16) + 1);
  return SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(void *device, FabricInfoV2 *info) {
  if (!__atomic_load_n(&initialised, __ATOMIC_SEQ_CST)) return UNINITIALIZED;
  if (!device || !info) return INVALID_ARGUMENT;
  if (info->version != (sizeof(FabricInfoV2) | (2u << 24))) return VERSION_MISMATCH;
  long rc = __atomic_load_n(&knob_rc, __ATOMIC_SEQ_CST);
  rc = rc == -2 ? env_long("FAKE_NVML_RC", 0) : rc;
  if (rc) return (nvmlReturn_t)rc;
  long state = __atomic_load_n(&knob_state, __ATOMIC_SEQ_CST);
  long status = __atomic_load_n(&knob_status, __ATOMIC_SEQ_CST);
  long zero = __atomic_load_n(&knob_zero_uuid, __ATOMIC_SEQ_CST);
  zero = zero == -2 ? env_long("FAKE_NVML_ZERO_UUID", 0) : zero;
  for (int i = 0; i < 16; i++) info->clusterUuid[i] = zero ? 0 : (unsigned char)(0xc0 + i);
  info->status = (nvmlReturn_t)(status == -2 ? env_long("FAKE_NVML_STATUS", 0) : status);
  info->cliqueId = 7;
  info->state = (unsigned char)(state == -2 ? env_long("FAKE_NVML_STATE", 3) : state);
  memset(info->padding, 0xa5, sizeof info->padding); /* junk: only the state byte counts */
  info->healthMask = 0;
  return SUCCESS;
}
