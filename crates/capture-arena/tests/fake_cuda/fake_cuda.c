/*
 * A fake CUDA driver (libcuda.so.1) for tests on machines without a GPU.
 *
 * It implements exactly the driver entry points capture-arena's `cuda` feature calls, with host
 * memory standing in for device memory: a "device allocation" is a memfd, its POSIX-fd export a
 * duplicate of it, its fabric handle the exporter's pid and descriptor (imported through
 * /proc/<pid>/fd, so it works across processes of one user), a virtual address reservation an
 * inaccessible anonymous mapping, cuMemMap a MAP_FIXED shared mapping of the memfd, streams
 * worker threads that run copies, event records and host functions in order. So the device
 * path's logic (asynchronous completion, handle export and import across processes, mapping
 * lifetimes, error handling) runs for real; only the GPU is fake. Never install it anywhere a
 * real driver should be found: tests load it by path.
 *
 * Knobs: environment variables give the defaults; a test in the same process changes them with
 * fake_cuda_knob("copy_us" | "fail_copies_after" | "fabric_attr" | "imex" | "gdr_attr" | ..., value):
 *   FAKE_CUDA_DEVICES=N        devices visible (default 1)
 *   FAKE_CUDA_FABRIC_ATTR=1    report fabric handle support
 *   FAKE_CUDA_IMEX=1           let fabric allocations, exports and imports succeed (else
 *                              NOT_PERMITTED, as without an IMEX channel in that process; 2:
 *                              allocations and exports succeed, imports do not)
 *   FAKE_CUDA_GDR_ATTR=0       report no GPUDirect RDMA on VMM memory (default 1, as an H200): an
 *                              allocation asking for gpuDirectRDMACapable then fails (NOT_SUPPORTED)
 *   FAKE_CUDA_COPY_US=N        every copy takes at least N microseconds on its stream
 *   FAKE_CUDA_FAIL_COPIES_AFTER=N  copies after the N-th fail to enqueue (INVALID_VALUE)
 *   FAKE_CUDA_MAX_PITCH=N      the largest pitch a 2-D copy takes (attribute 11; default 2^31 - 1, an H100's)
 *   FAKE_CUDA_HOST_REGISTER=0  report no cuMemHostRegister support (attribute 99; default 1)
 *   FAKE_CUDA_REGISTER_US=N    every cuMemHostRegister takes N microseconds (a real one: about 0.1 s
 *                              per GB, as it pins every page)
 *   FAKE_CUDA_D2D_PITCH_ALIGN=N  a device-to-device 2-D copy refuses pitches that are not multiples
 *                              of N (INVALID_VALUE): the driver documents that intra-device 2-D
 *                              copies "may fail for pitches not computed by cuMemAllocPitch"
 *   FAKE_CUDA_CAPTURING=1      another thread is capturing a CUDA graph in global mode: calls
 *                              capture forbids (cuMemHostRegister, cuMemHostUnregister) fail with
 *                              CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED unless the calling thread's
 *                              capture mode is relaxed (cuThreadExchangeStreamCaptureMode)
 *   FAKE_CUDA_NO_DEVICE=1      cuInit fails with CUDA_ERROR_NO_DEVICE
 *   FAKE_CUDA_ODD_ERROR=N      cuStreamCreate returns N, a code no CUDA header lists
 *   FAKE_CUDA_FAULT=1          the next op a stream runs raises a sticky context error
 *                              (ILLEGAL_ADDRESS): nothing more runs, host functions are not
 *                              called, queries, synchronisations and enqueues return the error
 *                              (the knob resets it: fake_cuda_knob("fault", 0))
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void (*CUhostFn)(void *);

enum {
  OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NO_DEVICE = 100, INVALID_DEVICE = 101, INVALID_CONTEXT = 201,
  INVALID_HANDLE = 400, NOT_READY = 600, ILLEGAL_ADDRESS = 700, HOST_MEMORY_ALREADY_REGISTERED = 712,
  HOST_MEMORY_NOT_REGISTERED = 713, NOT_PERMITTED = 800, NOT_SUPPORTED = 801,
  STREAM_CAPTURE_UNSUPPORTED = 900
};

static int env_int(const char *k, int dflt) {
  const char *v = getenv(k);
  return v && *v ? atoi(v) : dflt;
}

static long knob_devices = -2;
static long knob_odd_error = -2; /* a result code no CUDA version lists, from cuStreamCreate */ /* set before the driver is first used: cuDeviceGetCount is read once */
static int devices(void) {
  long v = __atomic_load_n(&knob_devices, __ATOMIC_SEQ_CST);
  return v == -2 ? env_int("FAKE_CUDA_DEVICES", 1) : (int)v;
}

/* Knobs: -2 = not set by fake_cuda_knob, use the environment. */
static long knob_copy_us = -2, knob_fail_after = -2, knob_fabric_attr = -2, knob_imex = -2, knob_gdr_attr = -2,
  knob_fault = -2, knob_host_register = -2, knob_capturing = -2, knob_max_pitch = -2, knob_register_us = -2,
  knob_d2d_pitch_align = -2, knob_range_attrs = -2;
static long copies;
/* A context error (FAKE_CUDA_FAULT / the "fault" knob, set when a stream next runs an op): sticky,
 * as on a real GPU after an illegal address. */
static int sticky;
static long knob(long *k, const char *env, long dflt) {
  long v = __atomic_load_n(k, __ATOMIC_SEQ_CST);
  return v == -2 ? env_int(env, (int)dflt) : v;
}
long fake_cuda_knob(const char *name, long value) {
  long *k = !strcmp(name, "copy_us") ? &knob_copy_us
          : !strcmp(name, "fail_copies_after") ? &knob_fail_after
          : !strcmp(name, "fabric_attr") ? &knob_fabric_attr
          : !strcmp(name, "imex") ? &knob_imex
          : !strcmp(name, "gdr_attr") ? &knob_gdr_attr
          : !strcmp(name, "fault") ? &knob_fault
          : !strcmp(name, "host_register") ? &knob_host_register
          : !strcmp(name, "capturing") ? &knob_capturing
          : !strcmp(name, "max_pitch") ? &knob_max_pitch
          : !strcmp(name, "register_us") ? &knob_register_us
          : !strcmp(name, "d2d_pitch_align") ? &knob_d2d_pitch_align
          : !strcmp(name, "range_attrs") ? &knob_range_attrs /* RANGE_START_ADDR and RANGE_SIZE answered */
          : !strcmp(name, "devices") ? &knob_devices
          : !strcmp(name, "odd_error") ? &knob_odd_error : NULL;
  if (!k) return -3;
  if (k == &knob_fail_after) __atomic_store_n(&copies, 0, __ATOMIC_SEQ_CST);
  if (k == &knob_fault && value == 0) __atomic_store_n(&sticky, 0, __ATOMIC_SEQ_CST);
  return __atomic_exchange_n(k, value, __ATOMIC_SEQ_CST);
}
static int imex(void) { return (int)knob(&knob_imex, "FAKE_CUDA_IMEX", 0); }

CUresult cuInit(unsigned flags) { (void)flags; return env_int("FAKE_CUDA_NO_DEVICE", 0) ? NO_DEVICE : OK; }
CUresult cuDriverGetVersion(int *v) { *v = 12080; return OK; }
CUresult cuDeviceGetCount(int *n) { *n = devices(); return OK; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
  if (ordinal < 0 || ordinal >= devices()) return INVALID_DEVICE;
  *d = ordinal;
  return OK;
}
/* Events a test waits for instead of sleeping: copies begun on a stream (0), questions whether
 * the device can pin host memory (1: what a pinning thread asks first), and registrations begun
 * (2: calls of cuMemHostRegister that passed its checks). */
static long copies_begun, register_asks, registrations, releases;
long fake_cuda_events(int which) {
  return __atomic_load_n(which == 3 ? &releases : which == 2 ? &registrations : which ? &register_asks : &copies_begun, __ATOMIC_SEQ_CST);
}
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
  (void)d;
  if (attr == 99) __atomic_add_fetch(&register_asks, 1, __ATOMIC_SEQ_CST);
  if (attr == 128) *v = (int)knob(&knob_fabric_attr, "FAKE_CUDA_FABRIC_ATTR", 0);
  else if (attr == 103) *v = 1;
  else if (attr == 99) *v = (int)knob(&knob_host_register, "FAKE_CUDA_HOST_REGISTER", 1);
  else if (attr == 113) *v = 1; /* read-only host registration */
  else if (attr == 110) *v = (int)knob(&knob_gdr_attr, "FAKE_CUDA_GDR_ATTR", 1); /* GPUDirect RDMA on VMM */
  else if (attr == 11) *v = (int)knob(&knob_max_pitch, "FAKE_CUDA_MAX_PITCH", 2147483647); /* MAX_PITCH */
  else *v = 0;
  return OK;
}
CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
  snprintf(name, (size_t)len, "Fake CUDA device %d (host memory)", d);
  return OK;
}
CUresult cuDeviceGetUuid(unsigned char *uuid, CUdevice d) {
  for (int i = 0; i < 16; i++) uuid[i] = (unsigned char)(0xf0 + i);
  uuid[15] = (unsigned char)d;
  return OK;
}
CUresult cuDeviceCanAccessPeer(int *v, CUdevice a, CUdevice b) { (void)a; (void)b; *v = 1; return OK; }
CUresult cuDeviceGetUuid_v2(unsigned char *uuid, CUdevice d) { return cuDeviceGetUuid(uuid, d); }
CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice d) { *ctx = (void *)(intptr_t)(d + 1); return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { (void)d; return OK; }
/* The calling thread's current context, as the real driver keeps it: calls that create things
 * need one (INVALID_CONTEXT otherwise), so the tests catch a missing bind. */
static __thread void *current;
CUresult cuCtxSetCurrent(void *ctx) { current = ctx; return OK; }
/* Contexts besides the primary ones ((device + 1)): (k << 16) + device + 1, made current. */
static long created_contexts;
CUresult cuCtxCreate_v2(void **pctx, unsigned flags, CUdevice d) {
  (void)flags;
  if (d < 0 || d >= devices()) return INVALID_DEVICE;
  long k = __atomic_add_fetch(&created_contexts, 1, __ATOMIC_SEQ_CST);
  *pctx = (void *)(intptr_t)((k << 16) + d + 1);
  current = *pctx;
  return OK;
}
CUresult cuCtxGetCurrent(void **ctx) { *ctx = current; return OK; }
void *fake_cuda_current(void) { return current; }
#define NEED_CONTEXT() do { if (!current) return INVALID_CONTEXT; } while (0)

static const char *names[][2] = {
  {"CUDA_SUCCESS", "no error"},
  {"CUDA_ERROR_INVALID_VALUE", "invalid argument"},
  {"CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
  {"CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
  {"CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
  {"CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
  {"CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
  {"CUDA_ERROR_NOT_READY", "device not ready"},
  {"CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
  {"CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
  {"CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
};
static int name_index(CUresult e) {
  switch (e) {
    case OK: return 0; case INVALID_VALUE: return 1; case OUT_OF_MEMORY: return 2;
    case NO_DEVICE: return 3; case INVALID_DEVICE: return 4; case INVALID_HANDLE: return 5;
    case NOT_READY: return 7; case NOT_PERMITTED: return 8; case NOT_SUPPORTED: return 9;
    case INVALID_CONTEXT: return 6; case ILLEGAL_ADDRESS: return 10;
    default: return -1;
  }
}
CUresult cuGetErrorName(CUresult e, const char **s) {
  int i = name_index(e);
  if (i < 0) return INVALID_VALUE;
  *s = names[i][0];
  return OK;
}
CUresult cuGetErrorString(CUresult e, const char **s) {
  int i = name_index(e);
  if (i < 0) return INVALID_VALUE;
  *s = names[i][1];
  return OK;
}

/* ---- virtual memory ---- */
/* CUmemAllocationProp as the driver lays it out (allocFlags after the win32 pointer). */
typedef struct {
  int type; int handle_types; int loc_type; int loc_id; void *win32;
  unsigned char compression; unsigned char gdr; unsigned short usage; unsigned char reserved[4];
} Prop;
/* Allocations made with gpuDirectRDMACapable, and without (for the tests to read). */
static long rdma_allocations, plain_allocations;
long fake_cuda_allocations(int rdma) { return __atomic_load_n(rdma ? &rdma_allocations : &plain_allocations, __ATOMIC_SEQ_CST); }
enum { FABRIC = 8, POSIX_FD = 1 };

static size_t granule(void) { return (size_t)env_int("FAKE_CUDA_GRANULARITY", 2 << 20); }
CUresult cuMemGetAllocationGranularity(size_t *g, const Prop *p, int option) {
  (void)p; (void)option;
  *g = granule();
  return OK;
}
/* An allocation handle is its memfd + 1; the handle types it may be exported as, by memfd (an
 * export of a type the allocation was not created with fails, as on a real driver). */
#define MAX_FDS 65536
static int handle_types[MAX_FDS];
static int handle_device[MAX_FDS];

/* Device memory as the driver knows it, for cuPointerGetAttribute: cuMemAlloc allocations and
 * cuMemMap mappings, with their device. */
#define MAX_RANGES 4096
static struct { uintptr_t start; size_t size; int dev; unsigned access; } ranges[MAX_RANGES];
static pthread_mutex_t ranges_mu = PTHREAD_MUTEX_INITIALIZER;
/* access: the devices that may touch the range (bit per device): a cuMemMap mapping has none
 * until cuMemSetAccess grants them; cuMemAlloc memory any (the driver stages copies between
 * devices without peer access). */
static void range_add(uintptr_t start, size_t size, int dev, unsigned access) {
  pthread_mutex_lock(&ranges_mu);
  for (int i = 0; i < MAX_RANGES; i++)
    if (!ranges[i].size) {
      ranges[i].start = start; ranges[i].size = size; ranges[i].dev = dev; ranges[i].access = access;
      break;
    }
  pthread_mutex_unlock(&ranges_mu);
}
static void range_grant(uintptr_t start, unsigned access) {
  pthread_mutex_lock(&ranges_mu);
  for (int i = 0; i < MAX_RANGES; i++)
    if (ranges[i].size && ranges[i].start == start) ranges[i].access |= access;
  pthread_mutex_unlock(&ranges_mu);
}
/* True unless `p` lies in device memory that device `dev` was not granted access to. */
static int accessible(uintptr_t p, int dev) {
  int ok = 1;
  pthread_mutex_lock(&ranges_mu);
  for (int i = 0; i < MAX_RANGES; i++)
    if (ranges[i].size && p >= ranges[i].start && p - ranges[i].start < ranges[i].size) {
      ok = (ranges[i].access >> dev) & 1;
      break;
    }
  pthread_mutex_unlock(&ranges_mu);
  return ok;
}
static void range_remove(uintptr_t start) {
  pthread_mutex_lock(&ranges_mu);
  for (int i = 0; i < MAX_RANGES; i++)
    if (ranges[i].size && ranges[i].start == start) ranges[i].size = 0;
  pthread_mutex_unlock(&ranges_mu);
}
static int range_device(uintptr_t p) {
  int dev = -1;
  pthread_mutex_lock(&ranges_mu);
  for (int i = 0; i < MAX_RANGES; i++)
    if (ranges[i].size && p >= ranges[i].start && p - ranges[i].start < ranges[i].size) { dev = ranges[i].dev; break; }
  pthread_mutex_unlock(&ranges_mu);
  return dev;
}
static int current_device(void) { return current ? (int)(((intptr_t)current - 1) & 0xffff) : 0; }
CUresult cuCtxGetDevice(CUdevice *d) { NEED_CONTEXT(); *d = current_device(); return OK; }
enum { MEMORYTYPE_DEVICE = 2, ATTR_MEMORY_TYPE = 2, ATTR_DEVICE_ORDINAL = 9, ATTR_RANGE_START_ADDR = 11, ATTR_RANGE_SIZE = 12 };
CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr ptr) {
  int dev = range_device((uintptr_t)ptr);
  if (dev < 0) return INVALID_VALUE; /* memory CUDA does not know (plain host memory) */
  if (attr == ATTR_MEMORY_TYPE) { *(unsigned *)data = MEMORYTYPE_DEVICE; return OK; }
  if (attr == ATTR_DEVICE_ORDINAL) { *(int *)data = dev; return OK; }
  if ((attr == ATTR_RANGE_START_ADDR || attr == ATTR_RANGE_SIZE) && knob(&knob_range_attrs, "FAKE_CUDA_RANGE_ATTRS", 1)) {
    /* The allocation (cuMemAlloc) or mapping (cuMemMap) the address lies in. */
    CUresult rc = INVALID_VALUE;
    pthread_mutex_lock(&ranges_mu);
    for (int i = 0; i < MAX_RANGES; i++)
      if (ranges[i].size && (uintptr_t)ptr >= ranges[i].start && (uintptr_t)ptr - ranges[i].start < ranges[i].size) {
        if (attr == ATTR_RANGE_START_ADDR) *(CUdeviceptr *)data = (CUdeviceptr)ranges[i].start;
        else *(size_t *)data = ranges[i].size;
        rc = OK;
        break;
      }
    pthread_mutex_unlock(&ranges_mu);
    return rc;
  }
  return NOT_SUPPORTED;
}
CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const Prop *p, unsigned long long flags) {
  (void)flags;
  NEED_CONTEXT();
  if (p->loc_id < 0 || p->loc_id >= devices()) return INVALID_DEVICE;
  if ((p->handle_types & FABRIC) && !imex()) return NOT_PERMITTED;
  if (size == 0 || size % granule()) return INVALID_VALUE;
  /* The RDMA flag only where the device supports GPUDirect RDMA on VMM memory (NCCL, Mooncake and
   * NIXL all ask the attribute first). */
  if (p->gdr && !knob(&knob_gdr_attr, "FAKE_CUDA_GDR_ATTR", 1)) return NOT_SUPPORTED;
  __atomic_add_fetch(p->gdr ? &rdma_allocations : &plain_allocations, 1, __ATOMIC_SEQ_CST);
  int fd = memfd_create("fake-cuda-allocation", MFD_CLOEXEC);
  if (fd < 0) return OUT_OF_MEMORY;
  if (ftruncate(fd, (off_t)size) != 0 || fd >= MAX_FDS) { close(fd); return OUT_OF_MEMORY; }
  handle_types[fd] = p->handle_types;
  handle_device[fd] = p->loc_id;
  *h = (CUmemGenericAllocationHandle)fd + 1;
  return OK;
}
/* Counted (fake_cuda_events(3)): a forked child must release none of its parent's handles. */
CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
  __atomic_add_fetch(&releases, 1, __ATOMIC_SEQ_CST);
  return close((int)h - 1) == 0 ? OK : INVALID_HANDLE;
}

typedef struct { char magic[8]; int pid; int fd; char pad[48]; } FabricHandle;
CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type, unsigned long long flags) {
  (void)flags;
  int fd = (int)h - 1;
  if (fd < 0 || fd >= MAX_FDS) return INVALID_HANDLE;
  if (!(handle_types[fd] & type)) return INVALID_VALUE;
  if (type == POSIX_FD) {
    int d = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (d < 0) return INVALID_HANDLE;
    *(int *)out = d;
    return OK;
  }
  if (type == FABRIC) {
    if (!imex()) return NOT_PERMITTED;
    FabricHandle f;
    memset(&f, 0, sizeof f);
    memcpy(f.magic, "FAKEFAB", 8);
    f.pid = getpid();
    f.fd = fd;
    memcpy(out, &f, sizeof f);
    return OK;
  }
  return NOT_SUPPORTED;
}
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os, int type) {
  int fd = -1;
  NEED_CONTEXT();
  if (type == POSIX_FD) {
    fd = fcntl((int)(intptr_t)os, F_DUPFD_CLOEXEC, 0);
  } else if (type == FABRIC) {
    /* Importing a fabric handle needs an IMEX channel in the importing process too (imex = 2:
     * half set up, creates and exports work, imports do not). */
    if (imex() != 1) return NOT_PERMITTED;
    FabricHandle f;
    memcpy(&f, os, sizeof f);
    if (memcmp(f.magic, "FAKEFAB", 8) != 0) return INVALID_VALUE;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", f.pid, f.fd);
    fd = open(path, O_RDWR | O_CLOEXEC);
  } else {
    return NOT_SUPPORTED;
  }
  if (fd < 0) return INVALID_VALUE;
  if (fd >= MAX_FDS) { close(fd); return OUT_OF_MEMORY; }
  handle_types[fd] = type;
  handle_device[fd] = current_device(); /* the fake has one memory: the importer's device */
  *h = (CUmemGenericAllocationHandle)fd + 1;
  return OK;
}
CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
  (void)addr; (void)flags;
  if (align == 0) align = granule();
  char *p = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return OUT_OF_MEMORY;
  uintptr_t a = ((uintptr_t)p + align - 1) / align * align;
  if (a > (uintptr_t)p) munmap(p, a - (uintptr_t)p);
  size_t tail = (uintptr_t)p + size + align - (a + size);
  if (tail) munmap((char *)a + size, tail);
  *ptr = (CUdeviceptr)a;
  return OK;
}
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) { return munmap((void *)(uintptr_t)ptr, size) == 0 ? OK : INVALID_VALUE; }
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags) {
  (void)flags;
  int fd = (int)h - 1;
  if (fd < 0 || fd >= MAX_FDS) return INVALID_HANDLE;
  void *p = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, fd, (off_t)offset);
  if (p == MAP_FAILED) return INVALID_VALUE;
  range_add((uintptr_t)ptr, size, handle_device[fd], 0);
  return OK;
}
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  range_remove((uintptr_t)ptr);
  void *p = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? INVALID_VALUE : OK;
}
typedef struct { int loc_type; int loc_id; int flags; } AccessDesc;
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const AccessDesc *d, size_t count) {
  unsigned access = 0;
  for (size_t i = 0; i < count; i++) {
    if (d[i].loc_id < 0 || d[i].loc_id >= devices()) return INVALID_DEVICE;
    access |= 1u << d[i].loc_id;
  }
  if (mprotect((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE) != 0) return INVALID_VALUE;
  range_grant((uintptr_t)ptr, access);
  return OK;
}
#define ALLOC_HEADER 4096
CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t size) {
  NEED_CONTEXT();
  char *p = mmap(NULL, size + ALLOC_HEADER, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return OUT_OF_MEMORY;
  *(size_t *)p = size;
  *ptr = (CUdeviceptr)(uintptr_t)(p + ALLOC_HEADER);
  range_add((uintptr_t)*ptr, size, current_device(), ~0u);
  return OK;
}
CUresult cuMemFree_v2(CUdeviceptr ptr) {
  range_remove((uintptr_t)ptr);
  char *p = (char *)(uintptr_t)ptr - ALLOC_HEADER;
  return munmap(p, *(size_t *)p + ALLOC_HEADER) == 0 ? OK : INVALID_VALUE;
}

/* ---- streams and events ---- */
typedef struct Event { pthread_mutex_t mu; pthread_cond_t cv; long pending; void *ctx; } Event;
enum { OP_COPY, OP_RECORD, OP_WAIT, OP_HOST };
/* A copy of h rows of n bytes, sp and dp bytes apart at the source and the destination (h 1: a
 * plain copy). */
typedef struct Op { int kind; void *dst; const void *src; size_t n, h, sp, dp; void *staged; Event *ev; CUhostFn fn; void *data; struct Op *next; } Op;
typedef struct Stream {
  pthread_mutex_t mu; pthread_cond_t cv; Op *head, *tail; int busy, stop; pthread_t thread;
  void *ctx; /* the context it was created in */
} Stream;

static void event_done(Event *e) {
  pthread_mutex_lock(&e->mu);
  e->pending--;
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->mu);
}
static void event_wait(Event *e) {
  pthread_mutex_lock(&e->mu);
  while (e->pending > 0) pthread_cond_wait(&e->cv, &e->mu);
  pthread_mutex_unlock(&e->mu);
}
static void *worker(void *arg) {
  Stream *s = arg;
  pthread_mutex_lock(&s->mu);
  for (;;) {
    while (!s->head && !s->stop) pthread_cond_wait(&s->cv, &s->mu);
    if (!s->head && s->stop) break;
    Op *op = s->head;
    s->head = op->next;
    if (!s->head) s->tail = NULL;
    s->busy = 1;
    pthread_mutex_unlock(&s->mu);
    if (knob(&knob_fault, "FAKE_CUDA_FAULT", 0) && !__atomic_load_n(&sticky, __ATOMIC_SEQ_CST))
      __atomic_store_n(&sticky, ILLEGAL_ADDRESS, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&sticky, __ATOMIC_SEQ_CST)) {
      /* After a context error nothing more runs: no copy, no host function (the driver's
       * documented behaviour); events never complete, and queries report the error. */
      if (op->kind == OP_RECORD) event_done(op->ev);
      free(op->staged);
      free(op);
      pthread_mutex_lock(&s->mu);
      s->busy = 0;
      pthread_cond_broadcast(&s->cv);
      continue;
    }
    switch (op->kind) {
      case OP_COPY: {
        __atomic_add_fetch(&copies_begun, 1, __ATOMIC_SEQ_CST);
        long delay = knob(&knob_copy_us, "FAKE_CUDA_COPY_US", 0);
        if (delay > 0) usleep((useconds_t)delay);
        for (size_t r = 0; r < (op->h ? op->h : 1); r++)
          memcpy((char *)op->dst + r * op->dp, (const char *)op->src + r * op->sp, op->n);
        break;
      }
      case OP_RECORD: event_done(op->ev); break;
      case OP_WAIT: event_wait(op->ev); break;
      case OP_HOST: op->fn(op->data); break;
    }
    free(op->staged);
    free(op);
    pthread_mutex_lock(&s->mu);
    s->busy = 0;
    pthread_cond_broadcast(&s->cv);
  }
  pthread_mutex_unlock(&s->mu);
  return NULL;
}
/* Work goes onto a stream only with a context current, and only with the stream's own: the
 * driver validates streams, events and pointers against the calling thread's context. */
#define NEED_STREAM_CONTEXT(s) do { NEED_CONTEXT(); if ((s) && (s)->ctx != current) return INVALID_CONTEXT; } while (0)
static CUresult push(Stream *s, Op o) {
  if (!s) return INVALID_HANDLE; /* the legacy default stream is not modelled */
  NEED_STREAM_CONTEXT(s);
  int e = __atomic_load_n(&sticky, __ATOMIC_SEQ_CST);
  if (e) return e;
  Op *op = malloc(sizeof *op);
  if (!op) return OUT_OF_MEMORY;
  *op = o;
  op->next = NULL;
  pthread_mutex_lock(&s->mu);
  if (s->tail) s->tail->next = op; else s->head = op;
  s->tail = op;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  return OK;
}
CUresult cuStreamCreate(Stream **out, unsigned flags) {
  (void)flags;
  NEED_CONTEXT();
  long odd = knob(&knob_odd_error, "FAKE_CUDA_ODD_ERROR", 0);
  if (odd) return (CUresult)odd;
  Stream *s = calloc(1, sizeof *s);
  if (!s) return OUT_OF_MEMORY;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  s->ctx = current;
  if (pthread_create(&s->thread, NULL, worker, s) != 0) { free(s); return OUT_OF_MEMORY; }
  *out = s;
  return OK;
}
CUresult cuStreamGetCtx(Stream *s, void **pctx) {
  *pctx = s ? s->ctx : current;
  return OK;
}
CUresult cuStreamSynchronize(Stream *s) {
  if (!s) return OK;
  NEED_STREAM_CONTEXT(s);
  pthread_mutex_lock(&s->mu);
  while (s->head || s->busy) pthread_cond_wait(&s->cv, &s->mu);
  pthread_mutex_unlock(&s->mu);
  return __atomic_load_n(&sticky, __ATOMIC_SEQ_CST);
}
CUresult cuStreamDestroy_v2(Stream *s) {
  if (!s) return INVALID_HANDLE;
  cuStreamSynchronize(s);
  pthread_mutex_lock(&s->mu);
  s->stop = 1;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  pthread_join(s->thread, NULL);
  free(s);
  return OK;
}
CUresult cuEventCreate(Event **out, unsigned flags) {
  (void)flags;
  NEED_CONTEXT();
  Event *e = calloc(1, sizeof *e);
  if (!e) return OUT_OF_MEMORY;
  pthread_mutex_init(&e->mu, NULL);
  pthread_cond_init(&e->cv, NULL);
  e->ctx = current;
  *out = e;
  return OK;
}
CUresult cuEventDestroy_v2(Event *e) { if (!e) return INVALID_HANDLE; event_wait(e); free(e); return OK; }
CUresult cuEventRecord(Event *e, Stream *s) {
  if (!e) return INVALID_HANDLE;
  if (!s) return OK; /* nothing runs on the fake default stream: complete at once */
  if (e->ctx != s->ctx) return INVALID_HANDLE; /* event and stream of one context (driver docs) */
  pthread_mutex_lock(&e->mu);
  e->pending++;
  pthread_mutex_unlock(&e->mu);
  Op o = {.kind = OP_RECORD, .ev = e};
  CUresult rc = push(s, o);
  /* Not queued (a sticky error, a bad stream): nothing will complete it, and a later destroy or
   * wait must not wait for it. */
  if (rc != OK) event_done(e);
  return rc;
}
CUresult cuEventQuery(Event *e) {
  if (!e) return INVALID_HANDLE;
  NEED_CONTEXT();
  int err = __atomic_load_n(&sticky, __ATOMIC_SEQ_CST);
  if (err) return err;
  pthread_mutex_lock(&e->mu);
  long p = e->pending;
  pthread_mutex_unlock(&e->mu);
  return p > 0 ? NOT_READY : OK;
}
CUresult cuEventSynchronize(Event *e) {
  if (!e) return INVALID_HANDLE;
  NEED_CONTEXT();
  int err = __atomic_load_n(&sticky, __ATOMIC_SEQ_CST);
  if (err) return err; /* after a context error the event never completes: report it */
  event_wait(e);
  return __atomic_load_n(&sticky, __ATOMIC_SEQ_CST);
}
CUresult cuStreamWaitEvent(Stream *s, Event *e, unsigned flags) {
  (void)flags;
  if (!e) return INVALID_HANDLE;
  Op o = {.kind = OP_WAIT, .ev = e};
  return push(s, o);
}
CUresult cuLaunchHostFunc(Stream *s, CUhostFn fn, void *data) {
  Op o = {.kind = OP_HOST, .fn = fn, .data = data};
  return push(s, o);
}
/* Host memory registered with cuMemHostRegister (pinned), and the host ends of copies counted by
 * whether they were pinned (for the tests to read). */
#define MAX_PINS 256
/* A registration without PORTABLE is pinned only for the context current when it was made. */
static struct { uintptr_t start; size_t size; int portable; void *ctx; } pins[MAX_PINS];
/* The calling thread's stream-capture mode (0 global, 1 thread local, 2 relaxed). */
static __thread int capture_mode;
CUresult cuThreadExchangeStreamCaptureMode(int *mode) {
  if (!mode || *mode < 0 || *mode > 2) return INVALID_VALUE;
  int old = capture_mode;
  capture_mode = *mode;
  *mode = old;
  return OK;
}
/* A call that graph capture forbids, made while another thread captures in global mode. */
static int capture_forbids(void) {
  return knob(&knob_capturing, "FAKE_CUDA_CAPTURING", 0) && capture_mode != 2;
}
static long pinned_copies, pageable_copies;
long fake_cuda_host_copies(int pinned) {
  return __atomic_load_n(pinned ? &pinned_copies : &pageable_copies, __ATOMIC_SEQ_CST);
}
long fake_cuda_pinned_bytes(void) {
  long n = 0;
  pthread_mutex_lock(&ranges_mu);
  for (int i = 0; i < MAX_PINS; i++) n += (long)pins[i].size;
  pthread_mutex_unlock(&ranges_mu);
  return n;
}
static int pinned(uintptr_t p, size_t n, void *ctx) {
  int ok = 0;
  pthread_mutex_lock(&ranges_mu);
  for (int i = 0; i < MAX_PINS; i++)
    if (pins[i].size && p >= pins[i].start && p - pins[i].start + n <= pins[i].size &&
        (pins[i].portable || pins[i].ctx == ctx)) { ok = 1; break; }
  pthread_mutex_unlock(&ranges_mu);
  return ok;
}
/* Whether every page of [p, p + n) is mapped writable, from /proc/self/maps. */
static int writable(uintptr_t p, size_t n) {
  FILE *f = fopen("/proc/self/maps", "r");
  if (!f) return 0;
  char line[512];
  uintptr_t at = p, end = p + n;
  while (at < end && fgets(line, sizeof line, f)) {
    unsigned long lo, hi; char perms[5];
    if (sscanf(line, "%lx-%lx %4s", &lo, &hi, perms) != 3) continue;
    if (at >= lo && at < hi) {
      if (perms[1] != 'w') break;
      at = hi;
    }
  }
  fclose(f);
  return at >= end;
}
enum { HOST_REGISTER_PORTABLE = 1, HOST_REGISTER_READ_ONLY = 8 };
/* As the driver documents: a current context; memory the CPU maps read-only needs the READ_ONLY
 * flag; a range overlapping a registered one is refused. */
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned flags) {
  NEED_CONTEXT();
  if (capture_forbids()) return STREAM_CAPTURE_UNSUPPORTED;
  if (!p || !n) return INVALID_VALUE;
  if (!knob(&knob_host_register, "FAKE_CUDA_HOST_REGISTER", 1)) return NOT_SUPPORTED;
  if (!(flags & HOST_REGISTER_READ_ONLY) && !writable((uintptr_t)p, n)) return INVALID_VALUE;
  __atomic_add_fetch(&registrations, 1, __ATOMIC_SEQ_CST);
  long us = knob(&knob_register_us, "FAKE_CUDA_REGISTER_US", 0);
  if (us > 0) usleep((useconds_t)us);
  uintptr_t a = (uintptr_t)p;
  CUresult rc = OUT_OF_MEMORY;
  pthread_mutex_lock(&ranges_mu);
  for (int i = 0; i < MAX_PINS; i++)
    if (pins[i].size && a < pins[i].start + pins[i].size && pins[i].start < a + n) { rc = HOST_MEMORY_ALREADY_REGISTERED; goto out; }
  for (int i = 0; i < MAX_PINS; i++)
    if (!pins[i].size) {
      pins[i].start = a; pins[i].size = n; pins[i].portable = flags & HOST_REGISTER_PORTABLE; pins[i].ctx = current;
      rc = OK;
      break;
    }
out:
  pthread_mutex_unlock(&ranges_mu);
  return rc;
}
CUresult cuMemHostUnregister(void *p) {
  NEED_CONTEXT();
  if (capture_forbids()) return STREAM_CAPTURE_UNSUPPORTED;
  CUresult rc = HOST_MEMORY_NOT_REGISTERED;
  pthread_mutex_lock(&ranges_mu);
  for (int i = 0; i < MAX_PINS; i++)
    if (pins[i].size && pins[i].start == (uintptr_t)p) { pins[i].size = 0; rc = OK; break; }
  pthread_mutex_unlock(&ranges_mu);
  return rc;
}
static CUresult copy(void *dst, const void *src, size_t n, Stream *s, const void *host) {
  /* A copy runs on its stream's device, which must have access to both ends (a VMM mapping of
   * another device's memory needs a grant; see range_add). */
  if (s && n) {
    int dev = (int)(((intptr_t)s->ctx - 1) & 0xffff);
    if (!accessible((uintptr_t)dst, dev) || !accessible((uintptr_t)src, dev) ||
        !accessible((uintptr_t)dst + n - 1, dev) || !accessible((uintptr_t)src + n - 1, dev))
      return INVALID_VALUE;
  }
  long limit = knob(&knob_fail_after, "FAKE_CUDA_FAIL_COPIES_AFTER", -1);
  if (limit >= 0 && __atomic_add_fetch(&copies, 1, __ATOMIC_SEQ_CST) > limit) return INVALID_VALUE;
  if (host && n)
    __atomic_add_fetch(pinned((uintptr_t)host, n, s ? s->ctx : current) ? &pinned_copies : &pageable_copies, 1,
                       __ATOMIC_SEQ_CST);
  Op o = {.kind = OP_COPY, .dst = dst, .src = src, .n = n};
  /* From pageable host memory the driver stages the bytes before it returns (the caller may
   * reuse its buffer at once); from pinned memory it reads them when the copy runs. */
  if (host && host == src && n && !pinned((uintptr_t)host, n, s ? s->ctx : current)) {
    o.staged = malloc(n);
    if (!o.staged) return OUT_OF_MEMORY;
    memcpy(o.staged, src, n);
    o.src = o.staged;
  }
  CUresult rc = push(s, o);
  if (rc != OK) free(o.staged);
  return rc;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, Stream *s) {
  return copy((void *)(uintptr_t)dst, src, n, s, src);
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, Stream *s) {
  return copy(dst, (const void *)(uintptr_t)src, n, s, dst);
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, Stream *s) {
  return copy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n, s, NULL);
}
/* The driver's CUDA_MEMCPY2D (cuda.h), and its 2-D copy: host (1) or device (2) memory at each
 * end (arrays are not modelled); each pitch at least the width, as the driver requires. */
typedef struct {
  size_t srcXInBytes, srcY; int srcMemoryType; const void *srcHost; CUdeviceptr srcDevice; void *srcArray; size_t srcPitch;
  size_t dstXInBytes, dstY; int dstMemoryType; void *dstHost; CUdeviceptr dstDevice; void *dstArray; size_t dstPitch;
  size_t WidthInBytes, Height;
} Memcpy2D;
static long copies_2d;
/* 2-D copies enqueued (the argument is unused: the tests' counters take one). */
long fake_cuda_copies_2d(int unused) { (void)unused; return __atomic_load_n(&copies_2d, __ATOMIC_SEQ_CST); }
CUresult cuMemcpy2DAsync_v2(const Memcpy2D *c, Stream *s) {
  if (!c) return INVALID_VALUE;
  if (c->srcMemoryType < 1 || c->srcMemoryType > 2 || c->dstMemoryType < 1 || c->dstMemoryType > 2) return INVALID_VALUE;
  if (c->srcPitch < c->WidthInBytes || c->dstPitch < c->WidthInBytes) return INVALID_VALUE;
  long max_pitch = knob(&knob_max_pitch, "FAKE_CUDA_MAX_PITCH", 2147483647);
  if ((long)c->srcPitch > max_pitch || (long)c->dstPitch > max_pitch) return INVALID_VALUE; /* CU_DEVICE_ATTRIBUTE_MAX_PITCH */
  long align = knob(&knob_d2d_pitch_align, "FAKE_CUDA_D2D_PITCH_ALIGN", 1);
  if (c->srcMemoryType == 2 && c->dstMemoryType == 2 && c->Height > 1 && align > 1 &&
      (c->srcPitch % (size_t)align || c->dstPitch % (size_t)align))
    return INVALID_VALUE;
  if (!c->WidthInBytes || !c->Height) return OK;
  const char *src = c->srcMemoryType == 1 ? (const char *)c->srcHost : (const char *)(uintptr_t)c->srcDevice;
  char *dst = c->dstMemoryType == 1 ? (char *)c->dstHost : (char *)(uintptr_t)c->dstDevice;
  src += c->srcY * c->srcPitch + c->srcXInBytes;
  dst += c->dstY * c->dstPitch + c->dstXInBytes;
  size_t last = c->Height - 1;
  if (s) {
    int dev = (int)(((intptr_t)s->ctx - 1) & 0xffff);
    if (!accessible((uintptr_t)src, dev) || !accessible((uintptr_t)dst, dev) ||
        !accessible((uintptr_t)src + last * c->srcPitch + c->WidthInBytes - 1, dev) ||
        !accessible((uintptr_t)dst + last * c->dstPitch + c->WidthInBytes - 1, dev))
      return INVALID_VALUE;
  }
  long limit = knob(&knob_fail_after, "FAKE_CUDA_FAIL_COPIES_AFTER", -1);
  if (limit >= 0 && __atomic_add_fetch(&copies, 1, __ATOMIC_SEQ_CST) > limit) return INVALID_VALUE;
  const void *host = c->dstMemoryType == 1 ? (const void *)dst : c->srcMemoryType == 1 ? (const void *)src : NULL;
  if (host)
    __atomic_add_fetch(pinned((uintptr_t)host, last * (c->dstMemoryType == 1 ? c->dstPitch : c->srcPitch) + c->WidthInBytes,
                              s ? s->ctx : current) ? &pinned_copies : &pageable_copies, 1, __ATOMIC_SEQ_CST);
  __atomic_add_fetch(&copies_2d, 1, __ATOMIC_SEQ_CST);
  Op o = {.kind = OP_COPY, .dst = dst, .src = src, .n = c->WidthInBytes, .h = c->Height, .sp = c->srcPitch, .dp = c->dstPitch};
  return push(s, o);
}
