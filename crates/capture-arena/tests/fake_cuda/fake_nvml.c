/*
 * A fake NVML (libnvidia-ml.so.1) for the device tests: the one question capture-arena asks
 * (nvmlDeviceGetGpuFabricInfoV, whether a GPU's NVLink fabric registration is complete), with
 * the checks the real library makes: nvmlInit_v2 first, a device named by its "GPU-..." UUID, the
 * struct version it was built for. Built and loaded next to the fake driver (fake_cuda/mod.rs).
 *
 * Knob: fake_nvml_knob("state" | "status", value), else FAKE_NVML_STATE (default 3, COMPLETED)
 * and FAKE_NVML_STATUS (default 0).
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
  unsigned int state;
  unsigned int healthMask;
} FabricInfoV2;

static int initialised;
static long knob_state = -2, knob_status = -2;
static long env_long(const char *k, long dflt) {
  const char *v = getenv(k);
  return v && *v ? atol(v) : dflt;
}
long fake_nvml_knob(const char *name, long value) {
  long *k = !strcmp(name, "state") ? &knob_state : !strcmp(name, "status") ? &knob_status : NULL;
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
  long state = __atomic_load_n(&knob_state, __ATOMIC_SEQ_CST);
  long status = __atomic_load_n(&knob_status, __ATOMIC_SEQ_CST);
  for (int i = 0; i < 16; i++) info->clusterUuid[i] = (unsigned char)(0xc0 + i);
  info->status = (nvmlReturn_t)(status == -2 ? env_long("FAKE_NVML_STATUS", 0) : status);
  info->cliqueId = 7;
  info->state = (unsigned int)(state == -2 ? env_long("FAKE_NVML_STATE", 3) : state);
  info->healthMask = 0;
  return SUCCESS;
}
