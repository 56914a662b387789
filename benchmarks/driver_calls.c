/* What the driver calls on pin_memory's per-batch path cost here, and whether
 * the kind of page-locked memory changes what a memcpy into it costs: the
 * pieces of a small fastpin.pin_memory call that Python cannot time.
 *
 *     gcc -O2 -I$CUDA_HOME/include -o /tmp/driver_calls benchmarks/driver_calls.c -ldl \
 *         && /tmp/driver_calls
 *
 * Driver calls (ns, median of 64 rounds of 1,000): the current context read,
 * a push and pop of it, the pointer query fastpin's pinned check makes (of
 * pageable, cuMemHostAlloc'd and registered memory), the free fence
 * (cuCtxRecordEvent), an event recorded on the legacy stream, and the query
 * of a completed event.
 * memcpy (us, median of 64 rounds, cache-hot: the same source and
 * destination each time) into malloc'd memory, into cuMemHostAlloc'd memory
 * (what torch's pinned allocator hands out), and into a MAP_SHARED anonymous
 * mapping registered with cuMemHostRegister (what fastpin's arena is). */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define ROUNDS 64
#define CALLS 1000

/* The entry points, by the names the driver exports (cuda.h maps some to _v2). */
#define DRIVER(X)                                                          \
    X(cuInit, "cuInit")                                                    \
    X(cuDeviceGet, "cuDeviceGet")                                          \
    X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain")                \
    X(cuCtxSetCurrent, "cuCtxSetCurrent")                                  \
    X(cuCtxGetCurrent, "cuCtxGetCurrent")                                  \
    X(cuCtxPushCurrent, "cuCtxPushCurrent_v2")                             \
    X(cuCtxPopCurrent, "cuCtxPopCurrent_v2")                               \
    X(cuPointerGetAttribute, "cuPointerGetAttribute")                      \
    X(cuPointerGetAttributes, "cuPointerGetAttributes")                    \
    X(cuMemHostGetFlags, "cuMemHostGetFlags")                              \
    X(cuMemHostAlloc, "cuMemHostAlloc")                                    \
    X(cuMemHostRegister, "cuMemHostRegister_v2")                           \
    X(cuEventCreate, "cuEventCreate")                                      \
    X(cuEventRecord, "cuEventRecord")                                      \
    X(cuEventQuery, "cuEventQuery")                                        \
    X(cuEventSynchronize, "cuEventSynchronize")                            \
    X(cuCtxRecordEvent, "cuCtxRecordEvent")

#define DECLARE(name, symbol) static __typeof__(&name) p_##name;
DRIVER(DECLARE)

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, n, sizeof *v, cmp);
    return v[n / 2];
}

static CUcontext ctx;
static CUevent event;
static void *pageable, *hostalloc, *registered;

static void get_current(void)
{
    CUcontext c;
    p_cuCtxGetCurrent(&c);
}

static void push_pop(void)
{
    CUcontext c;
    p_cuCtxPushCurrent(ctx);
    p_cuCtxPopCurrent(&c);
}

static void query(void *ptr)
{
    unsigned int type = 0;
    p_cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)ptr);
}

static void query_pageable(void) { query(pageable); }
/* Other ways to ask the same of pageable memory. */
static void query_pageable_plural(void)
{
    CUpointer_attribute attr = CU_POINTER_ATTRIBUTE_MEMORY_TYPE;
    unsigned int type = 0;
    void *data = &type;
    p_cuPointerGetAttributes(1, &attr, &data, (CUdeviceptr)(uintptr_t)pageable);
}
static void query_pageable_context(void)
{
    CUcontext c = NULL;
    p_cuPointerGetAttribute(&c, CU_POINTER_ATTRIBUTE_CONTEXT, (CUdeviceptr)(uintptr_t)pageable);
}
static void host_flags_pageable(void)
{
    unsigned int flags = 0;
    p_cuMemHostGetFlags(&flags, pageable);
}
static void host_flags_hostalloc(void)
{
    unsigned int flags = 0;
    p_cuMemHostGetFlags(&flags, hostalloc);
}
static void query_hostalloc(void) { query(hostalloc); }
static void query_registered(void) { query(registered); }
static void ctx_record(void) { p_cuCtxRecordEvent(ctx, event); }
static void legacy_record(void) { p_cuEventRecord(event, CU_STREAM_LEGACY); }
static void event_query(void) { p_cuEventQuery(event); }

static void time_call(const char *name, void (*fn)(void))
{
    double v[ROUNDS];
    for (int r = 0; r < ROUNDS; r++) {
        double t0 = now_ns();
        for (int i = 0; i < CALLS; i++)
            fn();
        v[r] = (now_ns() - t0) / CALLS;
    }
    p_cuEventSynchronize(event);
    printf("  %-44s %8.0f ns\n", name, median(v, ROUNDS));
}

static double time_copy(void *dst, const void *src, size_t n)
{
    double v[ROUNDS];
    memcpy(dst, src, n);
    for (int r = 0; r < ROUNDS; r++) {
        double t0 = now_ns();
        memcpy(dst, src, n);
        v[r] = now_ns() - t0;
        __asm__ volatile("" : : "r"(dst) : "memory");
    }
    return median(v, ROUNDS) / 1e3;
}

int main(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) {
        printf("no driver: %s\n", dlerror());
        return 0;
    }
#define LOAD(name, symbol) p_##name = (__typeof__(p_##name))dlsym(lib, symbol);
    DRIVER(LOAD)
    CUdevice dev;
    if (p_cuInit(0) || p_cuDeviceGet(&dev, 0) || p_cuDevicePrimaryCtxRetain(&ctx, dev) ||
        p_cuCtxSetCurrent(ctx)) {
        printf("no device\n");
        return 0;
    }
    size_t big = (size_t)4 << 20;
    pageable = malloc(big);
    memset(pageable, 1, big);
    if (p_cuMemHostAlloc(&hostalloc, big, 0)) {
        printf("cuMemHostAlloc failed\n");
        return 1;
    }
    registered = mmap(NULL, big, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    memset(registered, 1, big);
    if (registered == MAP_FAILED || p_cuMemHostRegister(registered, big, CU_MEMHOSTREGISTER_PORTABLE)) {
        printf("cuMemHostRegister failed\n");
        return 1;
    }
    p_cuEventCreate(&event, CU_EVENT_DISABLE_TIMING);

    printf("driver calls, ns each (median of %d rounds of %d)\n", ROUNDS, CALLS);
    time_call("cuCtxGetCurrent", get_current);
    time_call("cuCtxPushCurrent + cuCtxPopCurrent", push_pop);
    time_call("cuPointerGetAttribute(MEMORY_TYPE), pageable", query_pageable);
    time_call("cuPointerGetAttributes(1: MEMORY_TYPE), pageable", query_pageable_plural);
    time_call("cuPointerGetAttribute(CONTEXT), pageable", query_pageable_context);
    time_call("cuMemHostGetFlags, pageable", host_flags_pageable);
    time_call("cuMemHostGetFlags, cuMemHostAlloc'd", host_flags_hostalloc);
    time_call("cuPointerGetAttribute, cuMemHostAlloc'd", query_hostalloc);
    time_call("cuPointerGetAttribute, registered", query_registered);
    if (p_cuCtxRecordEvent)
        time_call("cuCtxRecordEvent", ctx_record);
    time_call("cuEventRecord on the legacy stream", legacy_record);
    time_call("cuEventQuery (done)", event_query);

    char *src = malloc(big);
    for (size_t i = 0; i < big; i++)
        src[i] = (char)(i * 2654435761u >> 13);
    printf("\nmemcpy, us (median of %d, cache-hot)\n", ROUNDS);
    printf("  %8s %10s %12s %12s\n", "bytes", "malloc", "HostAlloc", "registered");
    size_t sizes[] = {(size_t)64 << 10, (size_t)256 << 10, (size_t)1 << 20, (size_t)3 << 19,
                      (size_t)2 << 20, (size_t)4 << 20};
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
        size_t n = sizes[k];
        printf("  %8zu %10.2f %12.2f %12.2f\n", n, time_copy(pageable, src, n),
               time_copy(hostalloc, src, n), time_copy(registered, src, n));
    }
    return 0;
}
