/* The CUDA driver, loaded at run time (after NCCL's cudawrap).
 *
 * Nothing here links against CUDA: libcuda.so.1 is opened with dlopen the
 * first time anyone asks, its entry points go into one table, and the outcome
 * (no driver / no device / ready) is remembered with the reason, so the
 * package builds and runs on machines with no GPU. */
#include <ctype.h>
#include <dlfcn.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include "fastpin.h"

fp_cuda_t fp_cuda;

static pthread_once_t fp_cuda_once = PTHREAD_ONCE_INIT;

static void fp_cuda_set_reason(const char *fmt, const char *detail)
{
    snprintf(fp_cuda.reason, sizeof fp_cuda.reason, fmt, detail);
}

static int fp_cuda_count_devices(void)
{
    FP_CU_CHECK(cuInit(0));
    FP_CU_CHECK(cuDeviceGetCount(&fp_cuda.device_count));
    return FP_OK;
}

/* FASTPIN_DISABLE_CUDA is a flag, read as every FASTPIN_* flag is (the Python
 * layer refuses other words at import): unset, empty, 0, false, no or off, in
 * any case and with spaces around it, leave CUDA on; any other word turns it off. */
static int fp_cuda_disabled(void)
{
    static const char *const off[] = {"0", "false", "no", "off"};
    const char *value = getenv("FASTPIN_DISABLE_CUDA");
    if (!value)
        return 0;
    while (isspace((unsigned char)*value))
        value++;
    size_t n = strlen(value);
    while (n && isspace((unsigned char)value[n - 1]))
        n--;
    if (n == 0)
        return 0;
    for (size_t i = 0; i < sizeof off / sizeof off[0]; i++)
        if (strlen(off[i]) == n && strncasecmp(value, off[i], n) == 0)
            return 0;
    return 1;
}

static void fp_cuda_load_once(void)
{
    if (fp_cuda_disabled()) {
        fp_cuda.state = FP_CUDA_NO_DRIVER;
        fp_cuda_set_reason("%s", "disabled by FASTPIN_DISABLE_CUDA");
        return;
    }
    /* RTLD_NOLOAD first: when PyTorch already loaded the driver we share
     * its copy (the same one either way, but this avoids a path search). */
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!lib)
        lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) {
        fp_cuda.state = FP_CUDA_NO_DRIVER;
        fp_cuda_set_reason("no CUDA driver: %s", dlerror());
        return;
    }
#define FP_CUDA_LOAD(name, sym, params)                                     \
    fp_cuda.name = (fp_##name##_fn)dlsym(lib, sym);                         \
    if (!fp_cuda.name) {                                                    \
        fp_cuda.state = FP_CUDA_NO_DRIVER;                                  \
        fp_cuda_set_reason("the CUDA driver lacks %s (too old?)", sym);     \
        return;                                                             \
    }
    FP_CUDA_ENTRY_POINTS(FP_CUDA_LOAD)
#undef FP_CUDA_LOAD
#define FP_CUDA_LOAD_OPTIONAL(name, sym, params) \
    fp_cuda.name = (fp_##name##_fn)dlsym(lib, sym);
    FP_CUDA_OPTIONAL_ENTRY_POINTS(FP_CUDA_LOAD_OPTIONAL)
#undef FP_CUDA_LOAD_OPTIONAL
    const char *fence = getenv("FASTPIN_FENCE");
    if (fence && strcmp(fence, "sync") == 0)
        fp_cuda.cuCtxRecordEvent = NULL; /* tests of the tickets on any driver */

    FP_CU_IGNORE(cuDriverGetVersion(&fp_cuda.driver_version));
    if (fp_cuda_count_devices() != FP_OK) {
        fp_cuda.state = FP_CUDA_NO_DEVICE;
        fp_cuda_set_reason("CUDA driver present but unusable: %s", fp_error_message());
        return;
    }
    if (fp_cuda.device_count == 0) {
        fp_cuda.state = FP_CUDA_NO_DEVICE;
        fp_cuda_set_reason("%s", "CUDA driver present but no device is visible");
        return;
    }
    fp_cuda.state = FP_CUDA_READY;
    fp_cuda_set_reason("%s", "ready");
}

static pid_t fp_cuda_pid; /* process that loaded the table */

static void fp_cuda_load_and_mark(void)
{
    fp_cuda_load_once();
    fp_cuda_pid = fp_pid();
}

int fp_cuda_load(void)
{
    pthread_once(&fp_cuda_once, fp_cuda_load_and_mark);
    /* A child forked after the parent initialised CUDA inherits the table
     * but cannot use the driver: it works on, unpinned. */
    if (fp_cuda.state == FP_CUDA_READY && !fp_same_process(fp_cuda_pid)) {
        fp_cuda.state = FP_CUDA_NO_DEVICE;
        fp_cuda_set_reason("%s", "CUDA cannot be used in a process forked after CUDA was "
                                 "initialised; memory is not page-locked here");
    }
    return fp_cuda.state;
}

int fp_cuda_error(fp_cu_result_t r, const char *what)
{
    const char *name = NULL, *text = NULL;
    if (!fp_cuda.cuGetErrorName || fp_cuda.cuGetErrorName(r, &name) != 0 || !name)
        name = "CUDA_ERROR";
    if (!fp_cuda.cuGetErrorString || fp_cuda.cuGetErrorString(r, &text) != 0 || !text)
        text = "unknown driver error";
    /* The check macros pass the whole call: name the entry point only. */
    int len = (int)strcspn(what, "(");
    return fp_error_set(FP_ECUDA, "%.*s failed: %s (%d): %s", len, what, name, r, text);
}

int fp_cuda_is_pinned(const void *p)
{
    unsigned int attribute = FP_CU_POINTER_ATTRIBUTE_MEMORY_TYPE, type = 0;
    void *data = &type;
    /* The plural query answers type 0 for memory the driver does not know;
     * the singular one fails for it, and that error path cost 1.1 us a call
     * on the H200 host against 0.18 (benchmarks/driver_calls.c). */
    fp_cu_result_t r = FP_CU_RESULT(
        cuPointerGetAttributes(1, &attribute, &data, (fp_cu_deviceptr_t)(uintptr_t)p));
    return r == FP_CUDA_SUCCESS && type == FP_CU_MEMORYTYPE_HOST;
}

int fp_cuda_current_device(void)
{
    fp_cu_context_t ctx = NULL;
    fp_cu_device_t dev;
    if (fp_cuda_load() != FP_CUDA_READY ||
        FP_CU_RESULT(cuCtxGetCurrent(&ctx)) != FP_CUDA_SUCCESS || ctx == NULL ||
        FP_CU_RESULT(cuCtxGetDevice(&dev)) != FP_CUDA_SUCCESS)
        return -1;
    return dev; /* a CUdevice is its ordinal */
}

/* The device of a visible ordinal, the driver loaded. */
static int fp_cuda_device(int ordinal, fp_cu_device_t *dev)
{
    if (fp_cuda_load() != FP_CUDA_READY)
        return fp_error_set(FP_ECUDA, "%s", fp_cuda.reason);
    if (ordinal < 0 || ordinal >= fp_cuda.device_count)
        return fp_error_set(FP_EINVAL, "CUDA device %d does not exist (%d visible)",
                            ordinal, fp_cuda.device_count);
    FP_CU_CHECK(cuDeviceGet(dev, ordinal));
    return FP_OK;
}

int fp_cuda_context_retain(int ordinal, fp_cu_context_t *ctx)
{
    fp_cu_device_t dev;
    int status = fp_cuda_device(ordinal, &dev);
    if (status)
        return status;
    FP_CU_CHECK(cuDevicePrimaryCtxRetain(ctx, dev));
    return FP_OK;
}

void fp_cuda_context_release(int ordinal)
{
    fp_cu_device_t dev;
    if (fp_cuda_device(ordinal, &dev) == FP_OK)
        FP_CU_IGNORE(cuDevicePrimaryCtxRelease(dev));
}

int fp_cuda_pci_bus_id(int ordinal, char *bus_id, int len)
{
    fp_cu_device_t dev;
    int status = fp_cuda_device(ordinal, &dev);
    if (status)
        return status;
    FP_CU_CHECK(cuDeviceGetPCIBusId(bus_id, len, dev));
    return FP_OK;
}

/* ---- the current context ------------------------------------------------ */

fp_cuda_scope_t fp_cuda_scope_enter(fp_cu_context_t ctx)
{
    fp_cuda_scope_t scope = {.current = 0, .pushed = 0, .result = FP_CUDA_SUCCESS};
    fp_cu_context_t current = NULL;
    if (!ctx)
        return scope;
    /* Already current (torch keeps its device's primary context current in
     * the threads that used it): nothing to push, and nothing to pop. The
     * query is a thread-local read (12-15 ns), a push and its pop 50-75. */
    if (FP_CU_RESULT(cuCtxGetCurrent(&current)) == FP_CUDA_SUCCESS && current == ctx) {
        scope.current = 1;
        return scope;
    }
    scope.result = FP_CU_RESULT(cuCtxPushCurrent(ctx));
    scope.pushed = scope.current = scope.result == FP_CUDA_SUCCESS;
    return scope;
}

void fp_cuda_scope_exit(fp_cuda_scope_t *scope)
{
    if (!scope->pushed)
        return;
    fp_cu_context_t popped;
    FP_CU_IGNORE(cuCtxPopCurrent(&popped));
    scope->pushed = 0;
}

int fp_cuda_scope_status(const fp_cuda_scope_t *scope)
{
    if (scope->result == FP_CUDA_SUCCESS)
        return FP_OK;
    return fp_cuda_error(scope->result, "cuCtxPushCurrent");
}

int fp_cuda_event_done(fp_cu_event_t event)
{
    /* Anything but NOT_READY (an error included) means the GPU no longer
     * reads the block: an errored context will never run the copy. */
    return FP_CU_RESULT(cuEventQuery(event)) != FP_CUDA_ERROR_NOT_READY;
}

/* ---- free fences ------------------------------------------------------- */

/* Captures under way in this process. Writers (capture begin/end) are rare;
 * readers are frees, which hold it only across one driver call, so a capture
 * cannot begin between a fence's check and its record. */
static pthread_rwlock_t fp_capture_lock = PTHREAD_RWLOCK_INITIALIZER;
static int fp_capture_count; /* under fp_capture_lock */

void fp_cuda_capture_begin(void)
{
    pthread_rwlock_wrlock(&fp_capture_lock);
    fp_capture_count++;
    pthread_rwlock_unlock(&fp_capture_lock);
}

void fp_cuda_capture_end(void)
{
    pthread_rwlock_wrlock(&fp_capture_lock);
    if (fp_capture_count > 0)
        fp_capture_count--;
    pthread_rwlock_unlock(&fp_capture_lock);
}

int fp_cuda_captures(void)
{
    pthread_rwlock_rdlock(&fp_capture_lock);
    int n = fp_capture_count;
    pthread_rwlock_unlock(&fp_capture_lock);
    return n;
}

/* ---- fences by ticket (drivers without cuCtxRecordEvent) ---------------- */

typedef struct fp_syncer_s {
    fp_cu_context_t ctx; /* the context it synchronises; set once */
    pid_t pid;           /* process whose thread serves it */
    uint64_t requested;  /* under fp_sync_lock: tickets handed out */
    uint64_t completed;  /* under fp_sync_lock: every ticket <= it is done */
} fp_syncer_t;

#define FP_SYNCERS 64 /* contexts, one per device */
static pthread_mutex_t fp_sync_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t fp_sync_work = PTHREAD_COND_INITIALIZER; /* tickets to serve */
static pthread_cond_t fp_sync_done = PTHREAD_COND_INITIALIZER; /* tickets completed */
static fp_syncer_t fp_syncers[FP_SYNCERS];                     /* under fp_sync_lock */

/* Any outcome ends the wait: a failed context runs no copy. */
static void fp_syncer_sync(fp_cu_context_t ctx)
{
    FP_CUDA_SCOPE(scope, ctx);
    if (scope.current)
        FP_CU_IGNORE(cuCtxSynchronize());
}

static void *fp_syncer_main(void *arg)
{
    fp_syncer_t *s = arg;
    pthread_mutex_lock(&fp_sync_lock);
    for (;;) {
        while (s->completed >= s->requested)
            pthread_cond_wait(&fp_sync_work, &fp_sync_lock);
        uint64_t target = s->requested; /* handed out before the sync begins */
        pthread_mutex_unlock(&fp_sync_lock);
        /* Held across the sync, so no capture begins during it (it would be
         * invalidated); a capture_begin waits for it meanwhile. */
        pthread_rwlock_rdlock(&fp_capture_lock);
        int capturing = fp_capture_count;
        if (!capturing)
            fp_syncer_sync(s->ctx);
        pthread_rwlock_unlock(&fp_capture_lock);
        if (capturing) /* not allowed during a capture: look again soon */
            nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
        pthread_mutex_lock(&fp_sync_lock);
        if (!capturing && target > s->completed) {
            s->completed = target;
            pthread_cond_broadcast(&fp_sync_done);
        }
    }
    return NULL;
}

/* The syncer of `ctx` in this process, its thread started; NULL when none
 * can be had (table full, thread refused). Under fp_sync_lock. */
static fp_syncer_t *fp_syncer_of(fp_cu_context_t ctx, int start)
{
    pid_t self = fp_pid();
    fp_syncer_t *free_slot = NULL;
    for (int i = 0; i < FP_SYNCERS; i++) {
        fp_syncer_t *s = &fp_syncers[i];
        if (s->ctx == ctx && s->pid == self)
            return s;
        if (!free_slot && (!s->ctx || s->pid != self))
            free_slot = s; /* unused, or a parent's copy after fork */
    }
    if (!start || !free_slot)
        return NULL;
    *free_slot = (fp_syncer_t){.ctx = ctx, .pid = self};
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int failed = pthread_create(&thread, &attr, fp_syncer_main, free_slot);
    pthread_attr_destroy(&attr);
    if (failed) {
        free_slot->ctx = NULL;
        return NULL;
    }
    return free_slot;
}

static int fp_cuda_ticket(fp_cu_context_t ctx, uint64_t *ticket)
{
    pthread_mutex_lock(&fp_sync_lock);
    fp_syncer_t *s = fp_syncer_of(ctx, 1);
    if (s) {
        *ticket = ++s->requested;
        pthread_cond_broadcast(&fp_sync_work);
    }
    pthread_mutex_unlock(&fp_sync_lock);
    return s != NULL;
}

int fp_cuda_ticket_done(fp_cu_context_t ctx, uint64_t ticket)
{
    pthread_mutex_lock(&fp_sync_lock);
    fp_syncer_t *s = fp_syncer_of(ctx, 0);
    int done = !s || s->completed >= ticket;
    pthread_mutex_unlock(&fp_sync_lock);
    return done;
}

void fp_cuda_ticket_wait(fp_cu_context_t ctx, uint64_t ticket)
{
    pthread_mutex_lock(&fp_sync_lock);
    fp_syncer_t *s = fp_syncer_of(ctx, 0);
    while (s && s->completed < ticket)
        pthread_cond_wait(&fp_sync_done, &fp_sync_lock);
    pthread_mutex_unlock(&fp_sync_lock);
}

/* ---- the fence ---------------------------------------------------------- */

const char *fp_cuda_fence_kind(void) { return fp_cuda.cuCtxRecordEvent ? "event" : "sync"; }

int fp_cuda_record(fp_cu_context_t ctx, fp_cu_event_t event, fp_cu_stream_t stream)
{
    FP_CUDA_SCOPE(scope, ctx);
    if (!scope.current)
        return FP_FENCE_NONE;
    /* Called where a block is freed: no message, the fence says what happened. */
    return FP_CU_RESULT(cuEventRecord(event, stream)) == FP_CUDA_SUCCESS ? FP_FENCE_RECORDED
                                                                          : FP_FENCE_NONE;
}

/* The legacy default stream: torch's default stream and every blocking
 * stream, not the non-blocking ones torch hands out for side streams. The
 * last resort, when neither a context event nor a ticket can be had. */
static int fp_cuda_fence_legacy(fp_cu_context_t ctx, fp_cu_event_t event)
{
    return fp_cuda_record(ctx, event, FP_CU_STREAM_LEGACY);
}

int fp_cuda_fence(fp_cu_context_t ctx, fp_cu_event_t event, uint64_t *ticket)
{
    if (!fp_cuda.cuCtxRecordEvent)
        return fp_cuda_ticket(ctx, ticket) ? FP_FENCE_TICKET : fp_cuda_fence_legacy(ctx, event);
    int fence = FP_FENCE_DEFERRED;
    pthread_rwlock_rdlock(&fp_capture_lock);
    if (!fp_capture_count) {
        /* Takes the context as an argument: nothing to push. */
        fp_cu_result_t r = FP_CU_RESULT(cuCtxRecordEvent(ctx, event));
        if (r == FP_CUDA_SUCCESS)
            fence = FP_FENCE_RECORDED;
        else if (r != FP_CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
            /* A capture fastpin was not told of comes back here, deferred.
             * Any other failure means a failed or torn-down context (at
             * interpreter exit, say), which runs no more copies: the legacy
             * stream's event, if even that can be had, and no thread. */
            fence = fp_cuda_fence_legacy(ctx, event);
    }
    pthread_rwlock_unlock(&fp_capture_lock);
    return fence;
}
