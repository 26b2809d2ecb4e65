/* A minimal NVTX v3 injection library: records every domain range push/pop to a log file.
 *
 * Loaded by the NVTX runtime through NVTX_INJECTION64_PATH, exactly as Nsight Systems is,
 * so a test can prove that pptrace.region really emits NVTX ranges on a machine without a
 * GPU. The ABI structs and callback ids are copied from the NVTX v3 headers
 * (nvtxDetail/nvtxTypes.h, nvToolsExt.h) so that no CUDA headers are needed to build it.
 *
 * Log lines (NVTX_RECORDER_OUT, "%p" replaced by the pid):
 *   push <tid> <depth> <domain> <category-name> <message>
 *   pop  <tid> <depth> <domain>
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef void (*NvtxFunctionPointer)(void);
/* an array of pointers to the runtime's function-pointer slots */
typedef NvtxFunctionPointer **NvtxFunctionTable;
typedef struct {
    size_t struct_size;
    int (*GetModuleFunctionTable)(int module, NvtxFunctionTable *out_table, unsigned int *out_size);
} NvtxExportTableCallbacks;
typedef const void *(*NvtxGetExportTableFunc)(uint32_t exportTableId);

enum { ETID_CALLBACKS = 1, MODULE_CORE2 = 5 };
enum {
    CBID_DomainRangePushEx = 4,
    CBID_DomainRangePop = 5,
    CBID_DomainNameCategoryA = 8,
    CBID_DomainRegisterStringA = 10,
    CBID_DomainCreateA = 12,
    CBID_Initialize = 15,
};
enum { MESSAGE_ASCII = 1, MESSAGE_REGISTERED = 3 };

typedef struct {
    uint16_t version;
    uint16_t size;
    uint32_t category;
    int32_t colorType;
    uint32_t color;
    int32_t payloadType;
    int32_t reserved0;
    union { uint64_t u; int64_t i; double d; } payload;
    int32_t messageType;
    union { const char *ascii; const void *unicode; const void *registered; } message;
} EventAttributes;

typedef struct { char name[128]; char categories[64][64]; } Domain;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static FILE *out;
static __thread int depth;

static void open_log(void) {
    const char *pattern = getenv("NVTX_RECORDER_OUT");
    char path[4096];
    if (!pattern) pattern = "nvtx_record.%p.log";
    const char *pid = strstr(pattern, "%p");
    if (pid) snprintf(path, sizeof path, "%.*s%d%s", (int)(pid - pattern), pattern, (int)getpid(), pid + 2);
    else snprintf(path, sizeof path, "%s", pattern);
    out = fopen(path, "w");
}

static void logf_line(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#include <stdarg.h>
static void logf_line(const char *fmt, ...) {
    va_list ap;
    pthread_mutex_lock(&lock);
    if (out) {
        va_start(ap, fmt);
        vfprintf(out, fmt, ap);
        va_end(ap);
        fflush(out); /* a crashing process must not lose what was recorded */
    }
    pthread_mutex_unlock(&lock);
}

static long tid(void) { return (long)syscall(SYS_gettid); }

static void *DomainCreateA(const char *name) {
    Domain *d = calloc(1, sizeof *d);
    snprintf(d->name, sizeof d->name, "%s", name ? name : "(default)");
    return d;
}

static const void *DomainRegisterStringA(void *domain, const char *s) {
    (void)domain;
    return strdup(s ? s : "");
}

static void DomainNameCategoryA(void *domain, uint32_t category, const char *name) {
    Domain *d = domain;
    if (d && category < 64) snprintf(d->categories[category], 64, "%s", name);
}

static int DomainRangePushEx(void *domain, const EventAttributes *a) {
    Domain *d = domain;
    const char *msg = "";
    if (a->messageType == MESSAGE_ASCII || a->messageType == MESSAGE_REGISTERED) msg = a->message.ascii;
    const char *cat = (d && a->category < 64 && d->categories[a->category][0]) ? d->categories[a->category] : "-";
    logf_line("push %ld %d %s %s %s\n", tid(), depth, d ? d->name : "(default)", cat, msg ? msg : "");
    return depth++;
}

static int DomainRangePop(void *domain) {
    Domain *d = domain;
    --depth;
    logf_line("pop %ld %d %s\n", tid(), depth, d ? d->name : "(default)");
    return depth;
}

static void Initialize(const void *reserved) { (void)reserved; }

int InitializeInjectionNvtx2(NvtxGetExportTableFunc getExportTable) {
    const NvtxExportTableCallbacks *callbacks = getExportTable(ETID_CALLBACKS);
    NvtxFunctionTable table = 0;
    unsigned int size = 0;
    if (!callbacks || !callbacks->GetModuleFunctionTable(MODULE_CORE2, &table, &size) || size <= CBID_Initialize)
        return 0;
    open_log();
    *table[CBID_DomainCreateA] = (NvtxFunctionPointer)DomainCreateA;
    *table[CBID_DomainRegisterStringA] = (NvtxFunctionPointer)DomainRegisterStringA;
    *table[CBID_DomainNameCategoryA] = (NvtxFunctionPointer)DomainNameCategoryA;
    *table[CBID_DomainRangePushEx] = (NvtxFunctionPointer)DomainRangePushEx;
    *table[CBID_DomainRangePop] = (NvtxFunctionPointer)DomainRangePop;
    *table[CBID_Initialize] = (NvtxFunctionPointer)Initialize;
    return 1;
}
