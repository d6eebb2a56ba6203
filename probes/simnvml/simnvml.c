/*
 * simnvml.c: a SIMULATED libnvidia-ml.so.1 for machines without an NVIDIA GPU.
 *
 * The unmodified pynvml (nvidia-ml-py) loads this library in place of the real NVML.
 * Device state follows the ranksight state files (see ranksight/simgpu.py and
 * docs/probes-gpu-host.md):
 *
 *     $RANKSIGHT_SIMNVML_DIR/gpu-<i>.state     one key=value per line, integers only
 *                                             (name= and uuid= are text), XIDs as
 *                                             repeated xid=<code>:<unix_ms> lines
 *
 * Device count = number of consecutive gpu-0.state, gpu-1.state, ... files, looked up on
 * every nvmlDeviceGetCount call.  Each query re-reads a device's file only when its
 * (inode, size, mtime) changed, so sampling costs one stat() per call.
 *
 * Every name and version string says "Simulated".  Functions this file does not define
 * are missing symbols, so pynvml raises NVMLError_FunctionNotFound, exactly as with an
 * older real driver; queries a simulated device cannot answer return
 * NVML_ERROR_NOT_SUPPORTED.  No RANKSIGHT_SIMNVML_DIR (or not a directory) makes
 * nvmlInit fail with NVML_ERROR_DRIVER_NOT_LOADED.
 *
 * Two extensions outside the NVML API (names start with "simnvml"):
 *   simnvmlIsSimulated()                      returns 1; lets a caller prove which library it got
 *   simnvmlEventSetLastTimeMs(set, &ms)       unix ms of the XID line last delivered by the set
 */

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---- NVML types (ABI-compatible with nvml.h) ---------------------------------------- */

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999
};

#define NVML_TEMPERATURE_GPU 0
#define NVML_CLOCK_GRAPHICS 0
#define NVML_CLOCK_SM 1
#define NVML_CLOCK_MEM 2
#define NVML_MEMORY_ERROR_TYPE_CORRECTED 0
#define NVML_MEMORY_ERROR_TYPE_UNCORRECTED 1
#define NVML_VOLATILE_ECC 0
#define NVML_AGGREGATE_ECC 1
#define NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS 0
#define NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR 1
#define NVML_PCIE_UTIL_TX_BYTES 0
#define NVML_PCIE_UTIL_RX_BYTES 1
#define NVML_VALUE_TYPE_UNSIGNED_LONG_LONG 3
#define NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX 138
#define NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX 139
#define nvmlEventTypeXidCriticalError 0x0000000000000008ULL
#define nvmlMemory_v2 0x02000028U

#define NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE 32
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE 16

typedef struct {
    char busIdLegacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
} nvmlPciInfo_t;

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    long long sllVal;
    int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

/* ---- simulated device state --------------------------------------------------------- */

#define MAX_DEVICES 64
#define NAME_LEN 96

typedef struct {
    int code;
    unsigned long long ms;
} xid_t;

/* Optional keys (absent -> the query is NOT_SUPPORTED, as on a device without the feature). */
enum {
    OPT_PCIE_TX, OPT_PCIE_RX, OPT_NVLINK_TX, OPT_NVLINK_RX,
    OPT_REMAP_CORR, OPT_REMAP_UNC, OPT_REMAP_PENDING, OPT_REMAP_FAILURE, OPT_COUNT
};

typedef struct device {
    int index;
    /* cache key of the parsed file */
    int loaded;
    ino_t ino;
    off_t size;
    struct timespec mtime;
    /* parsed state (defaults mirror ranksight.simgpu.SimGpuState) */
    char name[NAME_LEN];
    char uuid[NAME_LEN];
    unsigned long long util_gpu, util_mem, mem_used, mem_total, power_mw, power_limit_mw, temp_c;
    unsigned long long sm_clock_mhz, mem_clock_mhz, max_sm_clock_mhz, max_mem_clock_mhz;
    unsigned long long throttle_reasons, ecc_sbe, ecc_dbe, retired_pages;
    unsigned long long opt[OPT_COUNT];
    int has_opt[OPT_COUNT];
    xid_t *xids;
    size_t n_xids, cap_xids;
} device_t;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_init_count = 0;
static char g_dir[PATH_MAX];
static device_t g_devices[MAX_DEVICES];

static const char *const OPT_KEYS[OPT_COUNT] = {
    "pcie_tx_kbs", "pcie_rx_kbs", "nvlink_tx_kib", "nvlink_rx_kib",
    "remapped_corr", "remapped_unc", "remapped_pending", "remapped_failure",
};

static void state_path(int index, char *out, size_t len)
{
    snprintf(out, len, "%s/gpu-%d.state", g_dir, index);
}

static void set_defaults(device_t *d)
{
    snprintf(d->name, sizeof d->name, "RankSight Simulated GPU (CPU host)");
    snprintf(d->uuid, sizeof d->uuid, "GPU-00000000-sim0-0000-0000-000000000000");
    d->util_gpu = 0;
    d->util_mem = 0;
    d->mem_used = 0;
    d->mem_total = 80ULL * 1024 * 1024 * 1024;
    d->power_mw = 70000;
    d->power_limit_mw = 700000;
    d->temp_c = 35;
    d->sm_clock_mhz = 1980;
    d->mem_clock_mhz = 2619;
    d->max_sm_clock_mhz = 1980;
    d->max_mem_clock_mhz = 2619;
    d->throttle_reasons = 0;
    d->ecc_sbe = 0;
    d->ecc_dbe = 0;
    d->retired_pages = 0;
    memset(d->opt, 0, sizeof d->opt);
    memset(d->has_opt, 0, sizeof d->has_opt);
    d->n_xids = 0;
}

static int parse_ull(const char *s, unsigned long long *out)
{
    char *end;
    errno = 0;
    while (*s == ' ' || *s == '\t') s++;
    if (*s == '-' || *s == '\0') return 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s) return 0;
    while (*end == ' ' || *end == '\t' || *end == '\r') end++;
    if (*end != '\0') return 0;
    *out = v;
    return 1;
}

static void add_xid(device_t *d, int code, unsigned long long ms)
{
    if (d->n_xids == d->cap_xids) {
        size_t cap = d->cap_xids ? d->cap_xids * 2 : 16;
        xid_t *p = realloc(d->xids, cap * sizeof *p);
        if (!p) return; /* out of memory: drop the line rather than crash */
        d->xids = p;
        d->cap_xids = cap;
    }
    d->xids[d->n_xids].code = code;
    d->xids[d->n_xids].ms = ms;
    d->n_xids++;
}

static void copy_text(char *dst, size_t len, const char *src)
{
    size_t n = strcspn(src, "\r");
    while (n > 0 && (src[n - 1] == ' ' || src[n - 1] == '\t')) n--;
    while (*src == ' ' || *src == '\t') { src++; if (n) n--; }
    if (n >= len) n = len - 1;
    memcpy(dst, src, n);
    dst[n] = '\0';
}

static void parse_line(device_t *d, char *line)
{
    char *eq = strchr(line, '=');
    if (!eq) return;
    *eq = '\0';
    char *key = line, *val = eq + 1;
    while (*key == ' ' || *key == '\t') key++;
    size_t kl = strlen(key);
    while (kl > 0 && (key[kl - 1] == ' ' || key[kl - 1] == '\t')) key[--kl] = '\0';

    if (strcmp(key, "name") == 0) { copy_text(d->name, sizeof d->name, val); return; }
    if (strcmp(key, "uuid") == 0) { copy_text(d->uuid, sizeof d->uuid, val); return; }
    if (strcmp(key, "xid") == 0) {
        char *colon = strchr(val, ':');
        unsigned long long code, ms = 0;
        if (colon) *colon = '\0';
        if (!parse_ull(val, &code) || code > INT_MAX) return;
        if (colon && !parse_ull(colon + 1, &ms)) return;
        add_xid(d, (int)code, ms);
        return;
    }
    unsigned long long v;
    if (!parse_ull(val, &v)) return; /* malformed value: keep the default, like the Python reader */
#define K(field) if (strcmp(key, #field) == 0) { d->field = v; return; }
    K(util_gpu) K(util_mem) K(mem_used) K(mem_total) K(power_mw) K(power_limit_mw) K(temp_c)
    K(sm_clock_mhz) K(mem_clock_mhz) K(max_sm_clock_mhz) K(max_mem_clock_mhz)
    K(throttle_reasons) K(ecc_sbe) K(ecc_dbe) K(retired_pages)
#undef K
    for (int i = 0; i < OPT_COUNT; i++) {
        if (strcmp(key, OPT_KEYS[i]) == 0) { d->opt[i] = v; d->has_opt[i] = 1; return; }
    }
}

/* Re-read device `index` if its file changed. Returns NVML_SUCCESS, or GPU_IS_LOST when the
 * file is gone. Caller holds g_lock. */
static nvmlReturn_t refresh(device_t *d)
{
    char path[PATH_MAX + 32];
    struct stat st;
    state_path(d->index, path, sizeof path);
    if (stat(path, &st) != 0) return NVML_ERROR_GPU_IS_LOST;
    if (d->loaded && st.st_ino == d->ino && st.st_size == d->size &&
        st.st_mtim.tv_sec == d->mtime.tv_sec && st.st_mtim.tv_nsec == d->mtime.tv_nsec)
        return NVML_SUCCESS;

    FILE *f = fopen(path, "r");
    if (!f) return d->loaded ? NVML_SUCCESS : NVML_ERROR_GPU_IS_LOST;
    set_defaults(d);
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    while ((n = getline(&line, &cap, f)) >= 0) {
        if (n > 0 && line[n - 1] == '\n') line[n - 1] = '\0';
        parse_line(d, line);
    }
    free(line);
    /* Use the fstat of what we actually read, so a file replaced mid-read is re-read next time. */
    if (fstat(fileno(f), &st) == 0) {
        d->ino = st.st_ino;
        d->size = st.st_size;
        d->mtime = st.st_mtim;
    }
    fclose(f);
    d->loaded = 1;
    return NVML_SUCCESS;
}

static unsigned int count_devices(void)
{
    char path[PATH_MAX + 32];
    struct stat st;
    unsigned int n = 0;
    while (n < MAX_DEVICES) {
        state_path((int)n, path, sizeof path);
        if (stat(path, &st) != 0) break;
        n++;
    }
    return n;
}

/* Validate a handle and refresh its device. Takes g_lock; on success the caller must unlock. */
static nvmlReturn_t lock_device(void *handle, device_t **out)
{
    pthread_mutex_lock(&g_lock);
    if (g_init_count == 0) { pthread_mutex_unlock(&g_lock); return NVML_ERROR_UNINITIALIZED; }
    device_t *d = (device_t *)handle;
    if (d < g_devices || d >= g_devices + MAX_DEVICES ||
        (size_t)((char *)d - (char *)g_devices) % sizeof(device_t) != 0) {
        pthread_mutex_unlock(&g_lock);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    nvmlReturn_t r = refresh(d);
    if (r != NVML_SUCCESS) { pthread_mutex_unlock(&g_lock); return r; }
    *out = d;
    return NVML_SUCCESS;
}

#define WITH_DEVICE(handle, d)                              \
    device_t *d;                                            \
    do {                                                    \
        nvmlReturn_t r_ = lock_device((handle), &d);        \
        if (r_ != NVML_SUCCESS) return r_;                  \
    } while (0)
#define DONE(ret) do { pthread_mutex_unlock(&g_lock); return (ret); } while (0)

static nvmlReturn_t copy_string(const char *src, char *buf, unsigned int len)
{
    if (!buf) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buf, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

/* ---- init / errors / system ----------------------------------------------------------- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    const char *dir = getenv("RANKSIGHT_SIMNVML_DIR");
    struct stat st;
    if (!dir || !*dir || stat(dir, &st) != 0 || !S_ISDIR(st.st_mode) || strlen(dir) >= PATH_MAX)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    pthread_mutex_lock(&g_lock);
    if (g_init_count == 0 || strcmp(g_dir, dir) != 0) {
        snprintf(g_dir, sizeof g_dir, "%s", dir);
        for (int i = 0; i < MAX_DEVICES; i++) {
            g_devices[i].index = i;
            g_devices[i].loaded = 0;
        }
    }
    g_init_count++;
    pthread_mutex_unlock(&g_lock);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&g_lock);
    if (g_init_count == 0) DONE(NVML_ERROR_UNINITIALIZED);
    g_init_count--;
    DONE(NVML_SUCCESS);
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

int simnvmlIsSimulated(void) { return 1; }

static nvmlReturn_t require_init(void)
{
    pthread_mutex_lock(&g_lock);
    int ok = g_init_count > 0;
    pthread_mutex_unlock(&g_lock);
    return ok ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    nvmlReturn_t r = require_init();
    return r != NVML_SUCCESS ? r : copy_string("0.0.0-ranksight-simulated", version, length);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    nvmlReturn_t r = require_init();
    return r != NVML_SUCCESS ? r : copy_string("0.0.0-ranksight-simulated", version, length);
}

/* ---- devices ---------------------------------------------------------------------------- */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&g_lock);
    if (g_init_count == 0) DONE(NVML_ERROR_UNINITIALIZED);
    *count = count_devices();
    DONE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device)
{
    if (!device) return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&g_lock);
    if (g_init_count == 0) DONE(NVML_ERROR_UNINITIALIZED);
    if (index >= count_devices()) DONE(NVML_ERROR_INVALID_ARGUMENT);
    *device = &g_devices[index];
    DONE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, void **device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

nvmlReturn_t nvmlDeviceGetIndex(void *device, unsigned int *index)
{
    WITH_DEVICE(device, d);
    if (!index) DONE(NVML_ERROR_INVALID_ARGUMENT);
    *index = (unsigned int)d->index;
    DONE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetName(void *device, char *name, unsigned int length)
{
    WITH_DEVICE(device, d);
    DONE(copy_string(d->name, name, length));
}

nvmlReturn_t nvmlDeviceGetUUID(void *device, char *uuid, unsigned int length)
{
    WITH_DEVICE(device, d);
    DONE(copy_string(d->uuid, uuid, length));
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(void *device, nvmlPciInfo_t *pci)
{
    WITH_DEVICE(device, d);
    if (!pci) DONE(NVML_ERROR_INVALID_ARGUMENT);
    memset(pci, 0, sizeof *pci);
    pci->domain = 0;
    pci->bus = 0x18 + (unsigned int)d->index; /* synthesized: one bus per simulated device */
    pci->device = 0;
    pci->pciDeviceId = 0x233010DEU;           /* H100 SXM5 device id | NVIDIA vendor id */
    pci->pciSubSystemId = 0x16C110DEU;
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", pci->bus);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", pci->bus);
    DONE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v2(void *device, nvmlPciInfo_t *pci) { return nvmlDeviceGetPciInfo_v3(device, pci); }
nvmlReturn_t nvmlDeviceGetPciInfo(void *device, nvmlPciInfo_t *pci) { return nvmlDeviceGetPciInfo_v3(device, pci); }

nvmlReturn_t nvmlDeviceGetUtilizationRates(void *device, nvmlUtilization_t *util)
{
    WITH_DEVICE(device, d);
    if (!util) DONE(NVML_ERROR_INVALID_ARGUMENT);
    util->gpu = (unsigned int)(d->util_gpu > 100 ? 100 : d->util_gpu);
    util->memory = (unsigned int)(d->util_mem > 100 ? 100 : d->util_mem);
    DONE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(void *device, nvmlMemory_t *mem)
{
    WITH_DEVICE(device, d);
    if (!mem) DONE(NVML_ERROR_INVALID_ARGUMENT);
    unsigned long long used = d->mem_used > d->mem_total ? d->mem_total : d->mem_used;
    mem->total = d->mem_total;
    mem->used = used;
    mem->free = d->mem_total - used;
    DONE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(void *device, nvmlMemory_v2_t *mem)
{
    WITH_DEVICE(device, d);
    if (!mem) DONE(NVML_ERROR_INVALID_ARGUMENT);
    if (mem->version != nvmlMemory_v2) DONE(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    unsigned long long used = d->mem_used > d->mem_total ? d->mem_total : d->mem_used;
    mem->total = d->mem_total;
    mem->reserved = 0;
    mem->used = used;
    mem->free = d->mem_total - used;
    DONE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPowerUsage(void *device, unsigned int *power)
{
    WITH_DEVICE(device, d);
    if (!power) DONE(NVML_ERROR_INVALID_ARGUMENT);
    *power = (unsigned int)d->power_mw;
    DONE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(void *device, unsigned int *limit)
{
    WITH_DEVICE(device, d);
    if (!limit) DONE(NVML_ERROR_INVALID_ARGUMENT);
    *limit = (unsigned int)d->power_limit_mw;
    DONE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPowerManagementLimit(void *device, unsigned int *limit)
{
    return nvmlDeviceGetEnforcedPowerLimit(device, limit);
}

nvmlReturn_t nvmlDeviceGetTemperature(void *device, int sensor, unsigned int *temp)
{
    WITH_DEVICE(device, d);
    if (!temp) DONE(NVML_ERROR_INVALID_ARGUMENT);
    if (sensor != NVML_TEMPERATURE_GPU) DONE(NVML_ERROR_INVALID_ARGUMENT);
    *temp = (unsigned int)d->temp_c;
    DONE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetClockInfo(void *device, int type, unsigned int *clock)
{
    WITH_DEVICE(device, d);
    if (!clock) DONE(NVML_ERROR_INVALID_ARGUMENT);
    switch (type) {
    case NVML_CLOCK_GRAPHICS:
    case NVML_CLOCK_SM: *clock = (unsigned int)d->sm_clock_mhz; DONE(NVML_SUCCESS);
    case NVML_CLOCK_MEM: *clock = (unsigned int)d->mem_clock_mhz; DONE(NVML_SUCCESS);
    default: DONE(NVML_ERROR_NOT_SUPPORTED); /* video clock: not simulated */
    }
}

nvmlReturn_t nvmlDeviceGetMaxClockInfo(void *device, int type, unsigned int *clock)
{
    WITH_DEVICE(device, d);
    if (!clock) DONE(NVML_ERROR_INVALID_ARGUMENT);
    switch (type) {
    case NVML_CLOCK_GRAPHICS:
    case NVML_CLOCK_SM: *clock = (unsigned int)d->max_sm_clock_mhz; DONE(NVML_SUCCESS);
    case NVML_CLOCK_MEM: *clock = (unsigned int)d->max_mem_clock_mhz; DONE(NVML_SUCCESS);
    default: DONE(NVML_ERROR_NOT_SUPPORTED);
    }
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(void *device, unsigned long long *reasons)
{
    WITH_DEVICE(device, d);
    if (!reasons) DONE(NVML_ERROR_INVALID_ARGUMENT);
    *reasons = d->throttle_reasons;
    DONE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(void *device, unsigned long long *reasons)
{
    return nvmlDeviceGetCurrentClocksEventReasons(device, reasons);
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(void *device, int errorType, int counterType, unsigned long long *count)
{
    WITH_DEVICE(device, d);
    if (!count) DONE(NVML_ERROR_INVALID_ARGUMENT);
    if (counterType != NVML_VOLATILE_ECC && counterType != NVML_AGGREGATE_ECC) DONE(NVML_ERROR_INVALID_ARGUMENT);
    /* The state file holds counts since the (simulated) driver loaded: volatile == aggregate. */
    if (errorType == NVML_MEMORY_ERROR_TYPE_CORRECTED) *count = d->ecc_sbe;
    else if (errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED) *count = d->ecc_dbe;
    else DONE(NVML_ERROR_INVALID_ARGUMENT);
    DONE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetRetiredPages(void *device, int cause, unsigned int *pageCount, unsigned long long *addresses)
{
    WITH_DEVICE(device, d);
    if (!pageCount) DONE(NVML_ERROR_INVALID_ARGUMENT);
    unsigned int n;
    /* All simulated retired pages are attributed to double-bit errors. */
    if (cause == NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR) n = (unsigned int)d->retired_pages;
    else if (cause == NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS) n = 0;
    else DONE(NVML_ERROR_INVALID_ARGUMENT);
    if (!addresses || *pageCount < n) {
        *pageCount = n;
        DONE(n == 0 ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (unsigned int i = 0; i < n; i++)
        addresses[i] = 0x100000ULL * (unsigned long long)(i + 1); /* synthetic page addresses */
    *pageCount = n;
    DONE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetRemappedRows(void *device, unsigned int *corrRows, unsigned int *uncRows,
                                       unsigned int *isPending, unsigned int *failureOccurred)
{
    WITH_DEVICE(device, d);
    if (!corrRows || !uncRows || !isPending || !failureOccurred) DONE(NVML_ERROR_INVALID_ARGUMENT);
    if (!d->has_opt[OPT_REMAP_CORR] && !d->has_opt[OPT_REMAP_UNC]) DONE(NVML_ERROR_NOT_SUPPORTED);
    *corrRows = (unsigned int)d->opt[OPT_REMAP_CORR];
    *uncRows = (unsigned int)d->opt[OPT_REMAP_UNC];
    *isPending = d->opt[OPT_REMAP_PENDING] ? 1 : 0;
    *failureOccurred = d->opt[OPT_REMAP_FAILURE] ? 1 : 0;
    DONE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetPcieThroughput(void *device, int counter, unsigned int *value)
{
    WITH_DEVICE(device, d);
    if (!value) DONE(NVML_ERROR_INVALID_ARGUMENT);
    int opt;
    if (counter == NVML_PCIE_UTIL_TX_BYTES) opt = OPT_PCIE_TX;
    else if (counter == NVML_PCIE_UTIL_RX_BYTES) opt = OPT_PCIE_RX;
    else DONE(NVML_ERROR_INVALID_ARGUMENT);
    if (!d->has_opt[opt]) DONE(NVML_ERROR_NOT_SUPPORTED);
    *value = (unsigned int)d->opt[opt]; /* KB/s, as NVML reports it */
    DONE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetFieldValues(void *device, int valuesCount, nvmlFieldValue_t *values)
{
    WITH_DEVICE(device, d);
    if (!values || valuesCount < 0) DONE(NVML_ERROR_INVALID_ARGUMENT);
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    long long ts = (long long)now.tv_sec * 1000000LL + now.tv_nsec / 1000;
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *v = &values[i];
        int opt = -1;
        v->timestamp = ts;
        v->latencyUsec = 0;
        v->valueType = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
        v->value.ullVal = 0;
        if (v->fieldId == NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX) opt = OPT_NVLINK_TX;
        else if (v->fieldId == NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX) opt = OPT_NVLINK_RX;
        /* Only the aggregate over all links (scopeId UINT_MAX) is simulated. */
        if (opt < 0 || v->scopeId != UINT_MAX || !d->has_opt[opt]) {
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            continue;
        }
        v->nvmlReturn = NVML_SUCCESS;
        v->value.ullVal = d->opt[opt]; /* cumulative KiB */
    }
    DONE(NVML_SUCCESS);
}

/* ---- events ----------------------------------------------------------------------------- */

typedef struct {
    void *device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

typedef struct event_set {
    unsigned long long magic;
    unsigned long long types[MAX_DEVICES]; /* registered event types per device */
    xid_t *seen[MAX_DEVICES];              /* (code, ms) pairs already delivered per device */
    size_t n_seen[MAX_DEVICES], cap_seen[MAX_DEVICES];
    unsigned long long last_ms;
} event_set_t;

#define EVENT_SET_MAGIC 0x73696d6e766d6c31ULL /* "simnvml1" */

static int valid_set(event_set_t *s) { return s && s->magic == EVENT_SET_MAGIC; }

nvmlReturn_t nvmlEventSetCreate(event_set_t **set)
{
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = require_init();
    if (r != NVML_SUCCESS) return r;
    event_set_t *s = calloc(1, sizeof *s);
    if (!s) return NVML_ERROR_MEMORY;
    s->magic = EVENT_SET_MAGIC;
    *set = s;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetFree(event_set_t *set)
{
    if (!valid_set(set)) return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&g_lock);
    set->magic = 0;
    for (int i = 0; i < MAX_DEVICES; i++) free(set->seen[i]);
    free(set);
    DONE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(void *device, unsigned long long *eventTypes)
{
    WITH_DEVICE(device, d);
    (void)d;
    if (!eventTypes) DONE(NVML_ERROR_INVALID_ARGUMENT);
    *eventTypes = nvmlEventTypeXidCriticalError;
    DONE(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceRegisterEvents(void *device, unsigned long long eventTypes, event_set_t *set)
{
    WITH_DEVICE(device, d);
    if (!valid_set(set)) DONE(NVML_ERROR_INVALID_ARGUMENT);
    if (eventTypes & ~nvmlEventTypeXidCriticalError) DONE(NVML_ERROR_NOT_SUPPORTED);
    set->types[d->index] |= eventTypes;
    DONE(NVML_SUCCESS);
}

static int already_seen(event_set_t *s, int dev, const xid_t *x)
{
    for (size_t i = 0; i < s->n_seen[dev]; i++)
        if (s->seen[dev][i].code == x->code && s->seen[dev][i].ms == x->ms) return 1;
    return 0;
}

static int mark_seen(event_set_t *s, int dev, const xid_t *x)
{
    if (s->n_seen[dev] == s->cap_seen[dev]) {
        size_t cap = s->cap_seen[dev] ? s->cap_seen[dev] * 2 : 16;
        xid_t *p = realloc(s->seen[dev], cap * sizeof *p);
        if (!p) return 0;
        s->seen[dev] = p;
        s->cap_seen[dev] = cap;
    }
    s->seen[dev][s->n_seen[dev]++] = *x;
    return 1;
}

/* Deliver the next undelivered XID line of any registered device. Caller holds g_lock. */
static int next_event(event_set_t *s, nvmlEventData_t *data)
{
    for (int dev = 0; dev < MAX_DEVICES; dev++) {
        if (!(s->types[dev] & nvmlEventTypeXidCriticalError)) continue;
        device_t *d = &g_devices[dev];
        if (refresh(d) != NVML_SUCCESS) continue;
        for (size_t i = 0; i < d->n_xids; i++) {
            if (already_seen(s, dev, &d->xids[i])) continue;
            if (!mark_seen(s, dev, &d->xids[i])) return 0;
            memset(data, 0, sizeof *data);
            data->device = d;
            data->eventType = nvmlEventTypeXidCriticalError;
            data->eventData = (unsigned long long)d->xids[i].code;
            s->last_ms = d->xids[i].ms;
            return 1;
        }
    }
    return 0;
}

nvmlReturn_t nvmlEventSetWait_v2(event_set_t *set, nvmlEventData_t *data, unsigned int timeoutms)
{
    if (!data || !valid_set(set)) return NVML_ERROR_INVALID_ARGUMENT;
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        pthread_mutex_lock(&g_lock);
        if (g_init_count == 0) DONE(NVML_ERROR_UNINITIALIZED);
        if (next_event(set, data)) DONE(NVML_SUCCESS);
        pthread_mutex_unlock(&g_lock);
        clock_gettime(CLOCK_MONOTONIC, &now);
        long long waited = (now.tv_sec - start.tv_sec) * 1000LL + (now.tv_nsec - start.tv_nsec) / 1000000LL;
        if (waited >= (long long)timeoutms) return NVML_ERROR_TIMEOUT;
        long long left = (long long)timeoutms - waited;
        struct timespec nap = {0, (left < 20 ? left : 20) * 1000000L};
        nanosleep(&nap, NULL);
    }
}

nvmlReturn_t nvmlEventSetWait(event_set_t *set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return nvmlEventSetWait_v2(set, data, timeoutms);
}

nvmlReturn_t simnvmlEventSetLastTimeMs(event_set_t *set, unsigned long long *ms)
{
    if (!ms || !valid_set(set)) return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&g_lock);
    *ms = set->last_ms;
    DONE(NVML_SUCCESS);
}
