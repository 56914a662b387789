/* fastpin core: the map of the pieces.
 *
 *   fp_cuda      process-wide table of CUDA driver entry points, loaded at
 *                run time from libcuda.so.1 (cuda.c). No driver: the rest
 *                still works, memory is simply not page-locked.
 *   fp_arena_t   one region of host memory (an anonymous shared mapping, or
 *                a memfd other processes can map), registered with CUDA once
 *                by the process that created it. Shared in both cases so
 *                fork() copies no page-locked page; a forked child may read
 *                a private arena but not allocate in it. Five files, mapped
 *                by arena_internal.h: arena.c (lifecycle, lock, alloc,
 *                deferred free), tlsf.c (the allocator on offsets alone),
 *                repair.c (invariants, crash repair), lease.c (leases,
 *                adoption), prim.c (the OS layer). A shared arena is also
 *                mapped by worker processes, which attach through its memfd,
 *                fill blocks and hand them over: the creator adopts them.
 *                Workers never touch CUDA.
 *     -> size class   two-level segregated fit: 16 classes per power of two,
 *                     so a block wastes at most 1/17 of itself above 4 KiB
 *       -> block      a descriptor in a fixed table: offset and size in the
 *                     region, physical neighbours, list links. Offsets and
 *                     indices only, so the metadata can live in shared memory.
 *   fp_lease_t   a reference-counted hold on one allocated block (lease.c);
 *                Python objects and DLPack exports each hold one. The last release
 *                records the block's free event (a fence over every stream
 *                of its device, or one stream fastpin's own copies use) and
 *                hands the block back through the arena's return stack
 *                (deferred free), unless the block was detached for another
 *                process to adopt.
 *   fp_copier_t  a pool of pthreads that does large memcpy in chunks (copier.c)
 *   fp_team_t    torch's OpenMP team, found at run time, copying a run in
 *                slices (team.c)
 *   fp_stage_h2d host-to-device copies, pageable sources staged through arena
 *                blocks (stage.c)
 *   fp_pid       this process, for every object that must tell whether it is
 *                still in the process that made it (prim.c)
 *   fp_record_t  a zero-copy batch's layout record, checked against its block
 *                before anything is made from it (record.c): what a worker
 *                sends beside the block, read by block_record.c in one call
 *
 * NUMA: an arena may be created with a node, whose memory it prefers
 * (mbind before any page is touched), and the pool's threads may be pinned
 * to a list of CPUs. Which node and which CPUs (those of the GPU's PCI
 * device) is found in Python (fastpin/_numa.py); the core only applies it.
 *
 * Everything here is plain C: only the bindings (module.c, arena_type.c,
 * block_type.c, batch.c, block_record.c) and dlpack.c include Python.h.
 * Functions return an int status (FP_OK on success) and leave a message in
 * a thread-local buffer (fp_error_message()); module.c turns it into an
 * exception.
 */
#ifndef FASTPIN_H
#define FASTPIN_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* ---- status codes ------------------------------------------------------ */

enum {
    FP_OK = 0,
    FP_ENOMEM = 1,  /* the arena has no room now (live blocks fill it) */
    FP_ETOOBIG = 2, /* the request is larger than the arena's cap */
    FP_ECUDA = 3,   /* a driver call failed; message holds the driver's text */
    FP_EOS = 4,     /* an OS call failed; message holds strerror */
    FP_EINVAL = 5,  /* bad argument */
    FP_EBUSY = 6,   /* fp_arena_try_alloc: only waiting would make room (no message) */
};

/* Sets the calling thread's error message and returns `status`. */
int fp_error_set(int status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
const char *fp_error_message(void);

/* ---- this process (prim.c) --------------------------------------------- */

/* getpid(), cached and refreshed in the child of every fork(): cheap enough
 * for every allocation and free. */
pid_t fp_pid(void);
/* Whether `pid` (saved by whatever made an object) is this process: false
 * in a child that inherited the object across fork. */
int fp_same_process(pid_t pid);

/* ---- CUDA driver (cuda.c) ---------------------------------------------- */

/* Opaque driver handles. The struct tags are the driver's own, so the test
 * that compiles against cuda.h can check every prototype below. */
/* cuda.h's CUresult is an enum; its ABI is an int (checked by test_cuda_decls). */
typedef int fp_cu_result_t;
typedef int fp_cu_device_t;
typedef unsigned long long fp_cu_deviceptr_t;
typedef struct CUctx_st *fp_cu_context_t;
typedef struct CUstream_st *fp_cu_stream_t;
typedef struct CUevent_st *fp_cu_event_t;

#define FP_CUDA_SUCCESS 0
#define FP_CUDA_ERROR_NOT_READY 600
#define FP_CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED 900
#define FP_CU_MEMHOSTREGISTER_PORTABLE 0x01
#define FP_CU_STREAM_NON_BLOCKING 0x1
#define FP_CU_EVENT_DISABLE_TIMING 0x2
#define FP_CU_STREAM_LEGACY ((fp_cu_stream_t)0x1)
#define FP_CU_POINTER_ATTRIBUTE_MEMORY_TYPE 2
#define FP_CU_MEMORYTYPE_HOST 0x01

enum {
    FP_CUDA_NO_DRIVER = 0, /* libcuda.so.1 could not be loaded */
    FP_CUDA_NO_DEVICE = 1, /* driver loaded, but cuInit or device query failed */
    FP_CUDA_READY = 2,
};

/* X-macro of the entry points: (name, symbol loaded, parameter list).
 * The symbol is the versioned one cuda.h maps the plain name to. */
#define FP_CUDA_ENTRY_POINTS(X)                                               \
    X(cuInit, "cuInit", (unsigned int flags))                                 \
    X(cuDriverGetVersion, "cuDriverGetVersion", (int *version))               \
    X(cuGetErrorString, "cuGetErrorString",                                   \
      (fp_cu_result_t error, const char **str))                               \
    X(cuGetErrorName, "cuGetErrorName",                                       \
      (fp_cu_result_t error, const char **str))                               \
    X(cuDeviceGetCount, "cuDeviceGetCount", (int *count))                     \
    X(cuDeviceGet, "cuDeviceGet", (fp_cu_device_t * device, int ordinal))     \
    X(cuDeviceGetPCIBusId, "cuDeviceGetPCIBusId",                             \
      (char *bus_id, int len, fp_cu_device_t dev))                            \
    X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain",                   \
      (fp_cu_context_t * ctx, fp_cu_device_t dev))                            \
    X(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2",              \
      (fp_cu_device_t dev))                                                   \
    X(cuCtxPushCurrent, "cuCtxPushCurrent_v2", (fp_cu_context_t ctx))         \
    X(cuCtxPopCurrent, "cuCtxPopCurrent_v2", (fp_cu_context_t * ctx))         \
    X(cuMemHostRegister, "cuMemHostRegister_v2",                              \
      (void *p, size_t bytesize, unsigned int flags))                         \
    X(cuMemHostUnregister, "cuMemHostUnregister", (void *p))                  \
    X(cuStreamCreate, "cuStreamCreate",                                       \
      (fp_cu_stream_t * stream, unsigned int flags))                          \
    X(cuStreamDestroy, "cuStreamDestroy_v2", (fp_cu_stream_t stream))         \
    X(cuStreamSynchronize, "cuStreamSynchronize", (fp_cu_stream_t stream))    \
    X(cuCtxSynchronize, "cuCtxSynchronize", (void))                           \
    X(cuStreamWaitEvent, "cuStreamWaitEvent",                                 \
      (fp_cu_stream_t stream, fp_cu_event_t event, unsigned int flags))       \
    X(cuEventCreate, "cuEventCreate",                                         \
      (fp_cu_event_t * event, unsigned int flags))                            \
    X(cuEventDestroy, "cuEventDestroy_v2", (fp_cu_event_t event))             \
    X(cuEventRecord, "cuEventRecord",                                         \
      (fp_cu_event_t event, fp_cu_stream_t stream))                           \
    X(cuEventQuery, "cuEventQuery", (fp_cu_event_t event))                    \
    X(cuEventSynchronize, "cuEventSynchronize", (fp_cu_event_t event))        \
    X(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2",                              \
      (fp_cu_deviceptr_t dst, const void *src, size_t bytes,                  \
       fp_cu_stream_t stream))                                                \
    X(cuPointerGetAttributes, "cuPointerGetAttributes",                       \
      (unsigned int count, unsigned int *attributes, void **data,             \
       fp_cu_deviceptr_t ptr))                                                \
    X(cuCtxGetCurrent, "cuCtxGetCurrent", (fp_cu_context_t * ctx))            \
    X(cuCtxGetDevice, "cuCtxGetDevice", (fp_cu_device_t * device))

/* Entry points newer drivers have; NULL in the table where the driver lacks
 * them, and the core then does without (see fp_cuda_fence). */
#define FP_CUDA_OPTIONAL_ENTRY_POINTS(X)                                      \
    X(cuCtxRecordEvent, "cuCtxRecordEvent",                                   \
      (fp_cu_context_t ctx, fp_cu_event_t event))

#define FP_CUDA_TYPEDEF(name, sym, params) \
    typedef fp_cu_result_t(*fp_##name##_fn) params;
FP_CUDA_ENTRY_POINTS(FP_CUDA_TYPEDEF)
FP_CUDA_OPTIONAL_ENTRY_POINTS(FP_CUDA_TYPEDEF)
#undef FP_CUDA_TYPEDEF

typedef struct fp_cuda_s {
    int state;          /* FP_CUDA_*; written once by fp_cuda_load */
    int driver_version; /* e.g. 13000; 0 without a driver */
    int device_count;   /* devices cuDeviceGetCount reported */
    char reason[256];   /* why the state is not READY, for users */
#define FP_CUDA_FIELD(name, sym, params) fp_##name##_fn name;
    FP_CUDA_ENTRY_POINTS(FP_CUDA_FIELD)
    FP_CUDA_OPTIONAL_ENTRY_POINTS(FP_CUDA_FIELD)
#undef FP_CUDA_FIELD
} fp_cuda_t;

/* The table; valid after fp_cuda_load() returned, read-only afterwards. */
extern fp_cuda_t fp_cuda;

/* Loads the driver once (later calls return the remembered outcome).
 * FASTPIN_DISABLE_CUDA=1 (or true, yes, on) in the environment forces
 * FP_CUDA_NO_DRIVER. */
int fp_cuda_load(void);

/* Turns a driver result into FP_ECUDA with "<what>: <name>: <driver text>". */
int fp_cuda_error(fp_cu_result_t r, const char *what);

/* Retains the primary context of `ordinal` (shared with PyTorch) and returns
 * it; pair with fp_cuda_context_release. */
int fp_cuda_context_retain(int ordinal, fp_cu_context_t *ctx);
void fp_cuda_context_release(int ordinal);
/* The PCI address ("dddd:bb:dd.f") of device `ordinal` into `bus_id` (`len`
 * bytes, NUL-terminated by the driver); no context is made. */
int fp_cuda_pci_bus_id(int ordinal, char *bus_id, int len);
/* Whether the driver knows `p` as page-locked host memory, allocated or
 * registered through CUDA (what torch's is_pinned() asks); 0 for any other
 * address, or with no driver. A context must be current (FP_CUDA_SCOPE). */
int fp_cuda_is_pinned(const void *p);
/* The ordinal of the device whose context is current in the calling thread
 * (torch's current device, once it set one there), or -1 where none is. */
int fp_cuda_current_device(void);
/* Whether the GPU is past `event` (or can never reach it: a failed context). */
int fp_cuda_event_done(fp_cu_event_t event);

/* Free fences. A block handed to the user may be read by a copy queued on
 * any stream of its device, named or not (a prefetcher's side stream, an
 * ExternalStream), and torch records no event for memory it did not
 * allocate. So a block's free waits for the whole context: the block is
 * reused only once every stream has passed the work queued before the free.
 * Two ways, by driver:
 *   - cuCtxRecordEvent (CUDA 12.5 and later): the block's event is recorded
 *     on the context, one call, and queried like any event.
 *   - older drivers: a ticket. One thread per context (made on first use,
 *     never stopped) runs cuCtxSynchronize whenever tickets are waiting and
 *     then marks every ticket handed out before it began done. Later than an
 *     event, never earlier.
 * A context-wide fence would invalidate a CUDA graph capture under way (the
 * driver refuses cuCtxRecordEvent then; cuCtxSynchronize is not allowed), so
 * captures are announced (fp_cuda_capture_begin/end) and fences wait for
 * them. fp_cuda_fence returns how the block's fence stands
 * (fp_block_t.armed):
 *   FP_FENCE_NONE      nothing recorded, nothing to wait for (the context
 *                      has failed: it runs no copy either)
 *   FP_FENCE_RECORDED  `event` completes after every stream's work so far
 *   FP_FENCE_DEFERRED  a capture is under way: the owner records the fence
 *                      later (fp_cuda_fence again), before reuse
 *   FP_FENCE_TICKET    *ticket is done once fp_cuda_ticket_done says so
 * Any thread, the GIL not needed. FASTPIN_FENCE=sync in the environment
 * takes the ticket path on any driver (for tests). */
enum { FP_FENCE_NONE = 0, FP_FENCE_RECORDED = 1, FP_FENCE_DEFERRED = 2, FP_FENCE_TICKET = 3 };
int fp_cuda_fence(fp_cu_context_t ctx, fp_cu_event_t event, uint64_t *ticket);
/* `event` recorded on one stream of `ctx`: FP_FENCE_RECORDED, or FP_FENCE_NONE
 * when the driver refuses (for blocks only fastpin's own copies read). */
int fp_cuda_record(fp_cu_context_t ctx, fp_cu_event_t event, fp_cu_stream_t stream);
/* Whether every ticket up to `ticket` of `ctx` is done; fp_cuda_ticket_wait
 * blocks until it is (never with the GIL held). */
int fp_cuda_ticket_done(fp_cu_context_t ctx, uint64_t ticket);
void fp_cuda_ticket_wait(fp_cu_context_t ctx, uint64_t ticket);
/* "event" (cuCtxRecordEvent) or "sync" (tickets): how fences are made. */
const char *fp_cuda_fence_kind(void);
/* Brackets a CUDA graph capture in this process (fastpin/_graphs.py calls
 * them around torch's): while one is under way, fences wait. They nest and
 * may come from any thread. */
void fp_cuda_capture_begin(void);
void fp_cuda_capture_end(void);
int fp_cuda_captures(void); /* captures under way now */

/* The check trio (after NCCL's checks.h): return the status, or store it in
 * `status` and jump to `label`, or ignore the result (cleanup paths). The
 * message names the entry point. Every driver call goes through them, or
 * through FP_CU_RESULT, kept to cuda.c, for the few results that are answers
 * rather than errors (an event's NOT_READY, a capture refusing a context
 * event, a push that may fail at exit). */
#define FP_CU_CHECK(call)                                           \
    do {                                                            \
        fp_cu_result_t fp_r_ = fp_cuda.call;                        \
        if (fp_r_ != FP_CUDA_SUCCESS)                               \
            return fp_cuda_error(fp_r_, #call);                     \
    } while (0)
#define FP_CU_CHECK_GOTO(call, status, label)                       \
    do {                                                            \
        fp_cu_result_t fp_r_ = fp_cuda.call;                        \
        if (fp_r_ != FP_CUDA_SUCCESS) {                             \
            (status) = fp_cuda_error(fp_r_, #call);                 \
            goto label;                                             \
        }                                                           \
    } while (0)
#define FP_CU_IGNORE(call) ((void)fp_cuda.call)
#define FP_CU_RESULT(call) (fp_cuda.call)

/* A context current for the rest of the enclosing block: FP_CUDA_SCOPE pushes
 * it unless it is current already, and the block's end pops what it pushed
 * however the block is left (return, break, goto out; never jump into the
 * block past it). A NULL context pushes nothing. `scope.current` says whether
 * the context is current in the block; fp_cuda_scope_status turns a failed
 * push into FP_ECUDA with the driver's message (the push itself sets no
 * message, for the free and teardown paths that only skip). */
typedef struct fp_cuda_scope_s {
    int current;           /* the context is current in the block */
    int pushed;            /* the scope pushed it: the block's end pops it */
    fp_cu_result_t result; /* what the push returned; FP_CUDA_SUCCESS if none */
} fp_cuda_scope_t;
fp_cuda_scope_t fp_cuda_scope_enter(fp_cu_context_t ctx);
void fp_cuda_scope_exit(fp_cuda_scope_t *scope);
int fp_cuda_scope_status(const fp_cuda_scope_t *scope);
#define FP_CUDA_SCOPE(scope, ctx)                                                \
    fp_cuda_scope_t scope __attribute__((cleanup(fp_cuda_scope_exit), unused)) = \
        fp_cuda_scope_enter(ctx)

/* ---- atomics (after mimalloc's atomic.h: the order is in the name) ------ */

#define fp_atomic_load_acquire(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define fp_atomic_load_relaxed(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define fp_atomic_store_release(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define fp_atomic_store_relaxed(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
#define fp_atomic_add_acq_rel(p, v) __atomic_add_fetch((p), (v), __ATOMIC_ACQ_REL)
#define fp_atomic_sub_acq_rel(p, v) __atomic_sub_fetch((p), (v), __ATOMIC_ACQ_REL)
#define fp_atomic_cas_weak_release(p, expected, desired)                  \
    __atomic_compare_exchange_n((p), (expected), (desired), 1,            \
                                __ATOMIC_RELEASE, __ATOMIC_RELAXED)
#define fp_atomic_cas_weak_acquire(p, expected, desired)                  \
    __atomic_compare_exchange_n((p), (expected), (desired), 1,            \
                                __ATOMIC_ACQUIRE, __ATOMIC_ACQUIRE)
/* Keeps the compiler from moving stores across it, as for a signal handler:
 * a process killed between two stores leaves the first and not the second,
 * which is what the arena's lock recovery relies on. */
#define fp_atomic_signal_fence_seq_cst() __atomic_signal_fence(__ATOMIC_SEQ_CST)

/* ---- arena (arena.c; its pieces in arena_internal.h) -------------------- */

#define FP_GRANULE 256u        /* block size and alignment unit, bytes */
#define FP_SL_LOG2 4           /* 16 second-level classes per power of two */
#define FP_SL_COUNT (1u << FP_SL_LOG2)
#define FP_FL_COUNT 32         /* first-level classes: sizes up to 2^43 bytes */
#define FP_MAX_CAPACITY (1ull << 43) /* the largest arena: FP_FL_COUNT classes reach it */
#define FP_CLASS_COUNT (FP_FL_COUNT * FP_SL_COUNT)
#define FP_NIL UINT32_MAX      /* "no block" in index links */

enum {
    FP_ARENA_SHARED = 1 << 0,  /* memfd, MAP_SHARED: usable by forked/spawned workers */
    FP_ARENA_NO_CUDA = 1 << 1, /* never register, even with a GPU present */
};

typedef struct fp_arena_s fp_arena_t;

typedef struct fp_arena_stats_s {
    uint64_t capacity;        /* the cap, bytes */
    uint64_t bytes_in_use;    /* sizes of blocks handed out or pending */
    uint64_t bytes_requested; /* what callers asked for, of bytes_in_use */
    uint64_t high_water;      /* most bytes_in_use ever */
    uint64_t bytes_pending;   /* freed by their owner, waiting on an event */
    uint64_t allocs;          /* successful allocations */
    uint64_t failed;          /* allocations refused (no room or too big) */
    uint64_t waits;           /* allocations that waited on an event */
    uint64_t fallbacks;       /* fp_arena_count_fallback calls, any process */
    uint64_t lock_recoveries; /* times a process died holding the lock */
    uint64_t reclaimed;       /* blocks freed by fp_arena_reclaim */
    uint32_t blocks_in_use;   /* handed out or pending */
    uint32_t blocks_pending;
    uint32_t blocks_foreign;  /* allocated, owned by another live or dead
                                 process (not adopted) */
    uint32_t max_blocks;      /* descriptor table size */
    int registered;           /* 1 when page-locked with CUDA, in this process */
    int shared;               /* 1 for a memfd arena */
    int numa_node;            /* node the memory prefers (mbind succeeded), or -1 */
    uint32_t class_blocks[FP_CLASS_COUNT]; /* blocks in use per size class */
} fp_arena_stats_t;

/* Creates an arena of `capacity` bytes (rounded up to FP_GRANULE) holding at
 * most `max_blocks` blocks at once (0: a default). With a usable GPU (and no
 * FP_ARENA_NO_CUDA), the data is registered once with cuMemHostRegister and
 * `device` names the GPU whose primary context records free events. The
 * caller owns one reference. */
int fp_arena_create(fp_arena_t **out, uint64_t capacity, uint32_t max_blocks,
                    int flags, int device);
/* fp_arena_create, with the mapping's pages preferring NUMA node `numa_node`
 * (MPOL_PREFERRED, set before any page is touched); -1 leaves the kernel's
 * default policy. The kernel refusing (EPERM under seccomp, ENOSYS, EINVAL
 * for a node it does not have) is not an error: the arena is made anyway and
 * its stats say numa_node -1. */
#define FP_NUMA_MAX_NODES 1024 /* nodes an mbind mask can name */
int fp_arena_create_numa(fp_arena_t **out, uint64_t capacity, uint32_t max_blocks,
                         int flags, int device, int numa_node);
/* Maps the shared arena behind memfd `fd` (made by fp_arena_create with
 * FP_ARENA_SHARED, in any process) at an address of this process's choosing,
 * after checking its header. The mapping is never registered with CUDA and
 * keeps its own duplicate of `fd`. The caller owns one reference. */
int fp_arena_attach(fp_arena_t **out, int fd);
/* In a process that attached: maps every page of the data now, when the
 * creator's registration has made them all resident (so this allocates
 * nothing), instead of one fault per page on first write. Returns 1 when it
 * did, 0 when there was nothing to do or the kernel cannot (before 5.14). */
int fp_arena_prefault(fp_arena_t *arena);
void fp_arena_incref(fp_arena_t *arena);
/* Any thread; the last one unmaps. The creator also unregisters from CUDA; a
 * process that attached (or inherited the struct across fork) only unmaps. */
void fp_arena_decref(fp_arena_t *arena);

/* Allocates at least `size` bytes (0 is allowed: one granule), owned by the
 * calling process. In the creator, blocks while the only room is held by
 * blocks whose copy events have not completed; any other process cannot see
 * those events and gets FP_ENOMEM instead (a worker then falls back).
 * Returns FP_ENOMEM when live blocks fill the arena, FP_ETOOBIG when `size`
 * exceeds the cap. Never call with the GIL held. */
int fp_arena_alloc(fp_arena_t *arena, uint64_t size, uint32_t *block,
                   void **ptr);
/* As fp_arena_alloc, but never waits for the GPU: where that is the only way
 * to room, FP_EBUSY (no message set) instead. Takes the arena's lock, held
 * only across bookkeeping, so it may be called with the GIL held. */
int fp_arena_try_alloc(fp_arena_t *arena, uint64_t size, uint32_t *block,
                       void **ptr);

/* Deferred free, callable from any thread, never blocks on the allocator:
 * records the block's event (when CUDA is in use) and pushes the block onto
 * the return stack, which the next allocation drains. `consumer` says what
 * may still read the block: NULL nothing on the GPU; FP_STREAM_ANY any
 * stream of the arena's device (a fence, fp_cuda_fence: what every block
 * the user can see gets); or one stream, for blocks only fastpin's own
 * copies read (staging chunks, a zero-copy block copied whole). */
#define FP_STREAM_ANY ((fp_cu_stream_t)(~(uintptr_t)0))
void fp_arena_free(fp_arena_t *arena, uint32_t block, fp_cu_stream_t consumer);

/* Returns completed blocks to the free lists now (drain + event query). Only
 * the creator can retire blocks freed with an event. Takes no lock when there
 * is nothing to do (fp_arena_idle). */
int fp_arena_collect(fp_arena_t *arena);

/* Whether no block waits to be collected (none returned, none pending), read
 * without the lock: a block freed meanwhile is seen by the next look. */
int fp_arena_idle(const fp_arena_t *arena);

/* Frees every allocated block (not freed by its owner) whose owner is another
 * process that no longer exists: kill(pid, 0) fails with ESRCH, or it is a
 * child of this process that has exited (reaped or not; it is left to be
 * reaped). *freed says how many. */
int fp_arena_reclaim(fp_arena_t *arena, uint32_t *freed);

/* Counts one batch that a worker could not place in the arena; any process,
 * lock-free. */
void fp_arena_count_fallback(fp_arena_t *arena);

/* The pid of the process that allocated `block` (0 once adopted), for an
 * allocated or pending block; FP_EINVAL otherwise. */
int fp_arena_owner(fp_arena_t *arena, uint32_t block, pid_t *owner);

/* Every function that takes the arena's lock (these, alloc, owner, adopt)
 * fails with FP_EOS when the lock cannot be had (a header written over, or a
 * lock left unrecoverable); the death of its holder is repaired instead. */
int fp_arena_stats(fp_arena_t *arena, fp_arena_stats_t *stats);
uint64_t fp_arena_capacity(const fp_arena_t *arena);
int fp_arena_registered(const fp_arena_t *arena);
void *fp_arena_base(const fp_arena_t *arena); /* start of the data */
/* The primary context the arena retained (NULL when not registered). */
fp_cu_context_t fp_arena_context(const fp_arena_t *arena);
int fp_arena_fd(const fp_arena_t *arena);     /* memfd, or -1 if private */
/* Random, set at creation, the same in every process that maps the arena:
 * tells which arena a block index sent by a worker belongs to. */
uint64_t fp_arena_token(const fp_arena_t *arena);
int fp_arena_attached(const fp_arena_t *arena); /* made by fp_arena_attach */
/* The CUDA ordinal whose primary context the arena is registered in and
 * records its events in, or -1 when not registered (in this process). */
int fp_arena_device(const fp_arena_t *arena);

/* Size-class arithmetic (tlsf.c): the size a request is rounded to, the
 * class index (0 .. FP_CLASS_COUNT-1) of a block size, and the smallest block
 * size of a class (what a request rounded into it takes). */
uint64_t fp_arena_round(uint64_t size);
uint32_t fp_arena_class(uint64_t size);
uint64_t fp_arena_class_size(uint32_t cls);

/* Checks every invariant of the metadata (repair.c); returns 1 when valid.
 * Cheap enough for tests, too slow for the hot path (FP_DEBUG builds call it
 * there). */
int fp_arena_is_valid(fp_arena_t *arena);

/* ---- lease: a counted hold on one block (lease.c) ---------------------- */

typedef struct fp_lease_s {
    int refcount;            /* atomic; the last release frees the block */
    int detached;            /* atomic; set by fp_lease_detach: the last
                                release leaves the block to its adopter */
    pid_t pid;               /* process that made the lease: a copy inherited
                                across fork never frees the parent's block */
    fp_arena_t *arena;       /* holds one arena reference */
    uint32_t block;          /* descriptor index in the arena */
    char *ptr;               /* first byte of the block */
    uint64_t size;           /* bytes the caller asked for */
    fp_cu_stream_t consumer; /* what may read the block at free, as for
                                fp_arena_free: FP_STREAM_ANY by default */
} fp_lease_t;

/* Allocates a block and wraps it; the caller owns one reference. */
int fp_lease_alloc(fp_arena_t *arena, uint64_t size, fp_lease_t **out);
/* The same through fp_arena_try_alloc: FP_EBUSY where it would wait. */
int fp_lease_try_alloc(fp_arena_t *arena, uint64_t size, fp_lease_t **out);
/* In the creator: a lease over `block`, allocated (fp_arena_alloc, or a
 * lease since detached) by any process, `size` being what it asked for. The
 * block becomes the creator's (owner 0) and is freed, after the GPU is done
 * with it, when the lease is released. FP_EINVAL with the reason when the
 * block is not there to take: out of range, free or freed, already adopted,
 * still held by a lease, or of another size. */
int fp_lease_adopt(fp_arena_t *arena, uint32_t block, uint64_t size,
                   fp_lease_t **out);
/* Gives the block up for adoption: releasing the lease no longer frees it.
 * Only in the process that allocated it, before it says where the block is. */
int fp_lease_detach(fp_lease_t *lease);
void fp_lease_incref(fp_lease_t *lease);
void fp_lease_decref(fp_lease_t *lease); /* any thread, any time */

#ifdef FP_TEST
/* Hooks for the C tests only (the Python build leaves them out). */
void fp_arena_test_lock(fp_arena_t *arena); /* takes the lock, never gives it back */
/* Says the arena's pages are resident, as registration does, so that
 * attached processes prefault (the test makes the pages exist first). */
void fp_arena_test_mark_resident(fp_arena_t *arena);
/* Frees `block` as if an event had been recorded on it. */
void fp_arena_test_free_armed(fp_arena_t *arena, uint32_t block);
/* Fake events, for machines without a GPU: when set, the creator of an
 * unregistered arena asks it, where it would query CUDA, whether the event of
 * an armed pending block has completed (non-zero: done); unset, such blocks
 * are done at once. Called under the arena's lock: it must not call back. */
extern int (*fp_test_event_done)(fp_arena_t *arena, uint32_t block);
/* The size of allocated or pending `block` (0 for a free or spare one): what
 * a request was rounded to, or more when no descriptor was left to split. */
uint64_t fp_arena_test_block_size(fp_arena_t *arena, uint32_t block);
/* When non-zero, counts down at each crash point of the arena's critical
 * sections; the process SIGKILLs itself where it reaches zero. */
extern int fp_test_crash_at;
/* Leaves the lock unrecoverable (ENOTRECOVERABLE): a holder died, and the
 * next locker let go without making it consistent (forks once to do it). */
void fp_arena_test_spoil_lock(fp_arena_t *arena);
#endif

/* ---- copier (copier.c) ------------------------------------------------- */

typedef struct fp_copier_s fp_copier_t;

typedef struct fp_copy_s {
    void *dst;       /* destination; the run's caller owns it for the run */
    const void *src; /* source; kept alive by the run's caller */
    size_t size;     /* bytes; entries of 0 bytes are skipped */
} fp_copy_t;

/* Makes a pool whose parallelism is `threads`, the calling thread included
 * (1: no pool threads, the caller copies alone; 0: the CPUs this process may
 * use, capped at FP_COPIER_MAX_DEFAULT; negative: FP_EINVAL). *out is NULL on
 * failure. The pool belongs to the process that made it: a run in a forked
 * child returns FP_EINVAL, and destroy there only frees memory. */
#define FP_COPIER_MAX_DEFAULT 16
int fp_copier_create(fp_copier_t **out, int threads);
/* Stops and joins the threads. Not to be called while a run is in flight. */
void fp_copier_destroy(fp_copier_t *copier);
int fp_copier_threads(const fp_copier_t *copier);
/* Pins the pool's threads (not callers, who copy their own share) to the
 * `count` CPUs listed; count 0 gives them the calling thread's affinity back.
 * FP_EINVAL for a CPU number out of range, or when the kernel accepts none of
 * them (all outside this process's cpuset); the threads then keep their old
 * affinity. In a forked child (no threads): FP_EINVAL. */
#define FP_COPIER_MAX_CPU (1 << 20) /* CPU numbers are below this */
int fp_copier_set_affinity(fp_copier_t *copier, const int *cpus, size_t count);
/* Copies every entry, splitting large ones into chunks shared among the
 * pool's threads and the caller; returns when all bytes are copied. Safe to
 * call from many threads at once. Never call with the GIL held. The sizes
 * below are the defaults of the pool's tuning (fp_copier_tuning_t), which
 * fp_copier_set_tuning changes at run time.
 *   - A run of up to FP_COPIER_INLINE bytes is copied by the caller alone:
 *     on a machine of many cores, waking pool threads costs more than a
 *     core's memcpy of a MiB (H200 hosts, one MiB: 71 us with the pool
 *     against 53 alone, and 48 against 33 on another; from 1.5 MiB the pool
 *     was ahead on one of them: benchmarks/pool_sizes.c).
 *   - Chunks are FP_COPIER_CHUNK_MIN to FP_COPIER_CHUNK bytes.
 *   - From FP_COPIER_STREAM bytes (x86-64) the stores bypass the cache (for
 *     the run's pieces of 4 KiB or more; smaller ones go by memcpy): a
 *     destination that large is read by DMA or from memory anyway, and such
 *     stores do not read every line before writing it (a third less memory
 *     traffic). fp_copier_set_streaming(copier, 0) turns them off. The
 *     main process starts them at half the last-level cache instead (cold
 *     copies of 32-128 MiB were slower with them: fastpin/_pin.py); zero-copy
 *     workers, packing side by side, keep this. */
/* (A build may set the two thresholds: benchmarks/pool_sizes.c compares.) */
#ifndef FP_COPIER_INLINE
#define FP_COPIER_INLINE ((size_t)1 << 20)
#endif
#define FP_COPIER_CHUNK_MIN ((size_t)512 << 10)
#define FP_COPIER_CHUNK ((size_t)2 << 20)
#ifndef FP_COPIER_STREAM
#define FP_COPIER_STREAM ((size_t)4 << 20)
#endif
int fp_copier_run(fp_copier_t *copier, const fp_copy_t *copies, size_t count);
/* Where a run's strategy changes, in bytes of the whole run (entries summed).
 * A new pool starts with the defaults above; fp_copier_set_tuning changes
 * them from any thread, from the next run on (each field alone: a run begun
 * meanwhile may see some old and some new). */
typedef struct fp_copier_tuning_s {
    size_t inline_max;     /* runs up to this: the caller alone, or with the
                              workers spinning (FP_COPIER_INLINE) */
    size_t inline_spin;    /* runs up to this: the caller alone even while
                              workers spin (FP_COPIER_INLINE_SPIN) */
    size_t stream_min;     /* runs from this: streaming stores, where on
                              (FP_COPIER_STREAM) */
    size_t chunk_min;      /* smallest chunk of a run past inline_max
                              (FP_COPIER_CHUNK_MIN) */
    size_t chunk_max;      /* largest chunk (FP_COPIER_CHUNK) */
    size_t chunk_min_spin; /* smallest chunk of a run shared with spinners
                              only (FP_COPIER_CHUNK_MIN_SPIN) */
} fp_copier_tuning_t;
#define FP_COPIER_TUNE_MAX ((size_t)1 << 40)   /* no field past this */
#define FP_COPIER_CHUNK_FLOOR ((size_t)4 << 10) /* no chunk field below this */
void fp_copier_tuning_default(fp_copier_tuning_t *t);
/* FP_EINVAL (naming the field) for a field out of range, or a smallest
 * chunk larger than chunk_max. */
int fp_copier_tuning_check(const fp_copier_tuning_t *t);
/* Checks (as above), then sets; the pool keeps its old tuning on error. */
int fp_copier_set_tuning(fp_copier_t *copier, const fp_copier_tuning_t *t);
void fp_copier_get_tuning(const fp_copier_t *copier, fp_copier_tuning_t *t);
/* Whether runs of this pool from stream_min bytes use streaming stores
 * (the default where the CPU has them); set from any thread, taking effect
 * with the next run. */
int fp_copier_streams(const fp_copier_t *copier);
void fp_copier_set_streaming(fp_copier_t *copier, int on);
/* How long, in nanoseconds, a pool thread stays ready after copying a chunk,
 * polling for the next run rather than sleeping until woken (0, the default:
 * it sleeps at once). While some are, runs above FP_COPIER_INLINE_SPIN up to
 * FP_COPIER_INLINE are shared with the spinning threads alone (none is
 * woken), in chunks from FP_COPIER_CHUNK_MIN_SPIN; larger runs wake only the
 * sleepers they need beyond the spinners. The CPU a spinner burns is at most
 * ns per chunk it copied. No more workers spin at once than
 * fp_copier_spinners() says: the CPUs the pool may use (its affinity, where
 * set, and the process's) less one for the caller. Set from any thread,
 * taking effect with each thread's next chunk; FP_EINVAL past
 * FP_COPIER_SPIN_MAX. Not yet a user setting: measurements pick the default
 * and the cut-overs. */
#define FP_COPIER_SPIN_MAX ((uint64_t)10000000) /* 10 ms */
#ifndef FP_COPIER_INLINE_SPIN
#define FP_COPIER_INLINE_SPIN ((size_t)256 << 10)
#endif
#define FP_COPIER_CHUNK_MIN_SPIN ((size_t)64 << 10)
int fp_copier_set_spin(fp_copier_t *copier, uint64_t ns);
uint64_t fp_copier_spin_ns(const fp_copier_t *copier);
/* The most pool threads that may spin at once. */
int fp_copier_spinners(const fp_copier_t *copier);
#ifdef FP_TEST
/* Chunks workers took after spinning (no wake), and runs shared with
 * spinners only, since create: for the C tests. */
void fp_copier_test_counts(fp_copier_t *copier, uint64_t *spun, uint64_t *spin_runs);
/* The most workers that ever spun at once since create. */
int fp_copier_test_max_spinning(fp_copier_t *copier);
#endif
/* The number of CPUs this process may run on (sched_getaffinity). */
int fp_cpu_count(void);

/* ---- torch's OpenMP team (team.c) -------------------------------------- */

/* The OpenMP runtime's entry points that a team copy needs, as found in a
 * loaded library's dependencies; all NULL where none was found. */
typedef struct fp_team_s {
    void (*parallel)(void (*fn)(void *), void *data, unsigned threads,
                     unsigned flags); /* GOMP_parallel */
    int (*thread_num)(void);          /* omp_get_thread_num */
    int (*num_threads)(void);         /* omp_get_num_threads */
    int (*max_threads)(void);         /* omp_get_max_threads: the calling
                                         thread's team size, which torch's
                                         set_num_threads sets */
} fp_team_t;
/* Fills *team from the first loaded object whose file name starts with
 * `owner` ("libtorch_cpu." for torch) and the OpenMP runtime it links;
 * FP_EINVAL (team all NULL) where no such object is loaded or it links no
 * runtime. Loads nothing. */
int fp_team_find(const char *owner, fp_team_t *team);
/* Copies every entry with a team of up to `threads` threads (the caller
 * one of them), each member a contiguous slice of the run's bytes, the
 * entries taken back to back; returns when all are copied. threads < 2, or
 * a team not found: the caller copies alone. Never call with the GIL held
 * (the members run no Python, but the caller waits for them). */
void fp_team_copy(const fp_team_t *team, const fp_copy_t *copies, size_t count, unsigned threads);

/* ---- a zero-copy batch's layout record (record.c) ---------------------
 *
 * What a DataLoader worker sends beside the block it collated into: where
 * every leaf lies in the block and what it is, and the batch's containers,
 * as one compact binary record, which the main process reads in one C call
 * (block_record.c) instead of unpickling an object per leaf. Little-endian,
 * read with memcpy (no alignment assumed), exactly this long:
 *
 *   header   32 bytes: magic "FPR1", version, entry size, leaf count, dims
 *            count, node bytes, object count, 8 reserved zero bytes
 *   leaves   FP_RECORD_ENTRY bytes each: offset and bytes in the block,
 *            element size, index of its shape and strides in the dims, the
 *            object (a NumPy dtype; a torch dtype to view a tensor as) or
 *            FP_RECORD_NONE, kind, ndim, DLPack code / bits / lanes
 *            (tensors) or NumPy type number (arrays), flags
 *   dims     int64 each: every leaf's shape then its strides (elements)
 *   nodes    the structure in preorder: a kind byte (FP_RECORD_NODE_*),
 *            containers followed by a uint32 count; a dict's keys (all
 *            at its node) and the values kept as they are come from the
 *            object list, in order
 *
 * The objects (keys, plain values, leaves that are not in the block, dtype
 * objects) travel beside the record as one Python tuple. fp_record_parse
 * checks everything before anything is built: a record cut short or with
 * any byte changed is refused, or describes only views inside the block. */

#define FP_RECORD_MAGIC 0x31525046u /* "FPR1" */
#define FP_RECORD_VERSION 1
#define FP_RECORD_HEADER 32u
#define FP_RECORD_ENTRY 40u
#define FP_RECORD_MAX_NDIM 64       /* as DLPack exports (FP_DLPACK_MAX_NDIM) */
#define FP_RECORD_DEPTH 512         /* containers nested deeper are refused */
#define FP_RECORD_NONE UINT32_MAX   /* no object */

enum { FP_RECORD_TENSOR = 1, FP_RECORD_ARRAY = 2 };             /* a leaf's kind */
enum { FP_RECORD_REQUIRES_GRAD = 1 };                           /* a leaf's flags */
enum {
    FP_RECORD_NODE_LEAF,     /* the next leaf of the record */
    FP_RECORD_NODE_OBJECT,   /* the next object, as it is */
    FP_RECORD_NODE_ORDINARY, /* the next object: a leaf not in the block */
    FP_RECORD_NODE_LIST,     /* + count: that many nodes */
    FP_RECORD_NODE_TUPLE,    /* + count */
    FP_RECORD_NODE_DICT,     /* + count: that many key objects, then value nodes */
    FP_RECORD_NODE_KINDS
};

typedef struct fp_record_s {
    const uint8_t *entries; /* the leaf entries, in the caller's buffer */
    const uint8_t *dims;    /* the shapes and strides */
    const uint8_t *nodes;   /* the structure */
    uint32_t nleaves;       /* leaf entries (and LEAF nodes) */
    uint32_t ndims;         /* int64s in dims */
    uint32_t nnodes;        /* bytes of nodes */
    uint32_t nobjects;      /* objects the record refers to */
    uint32_t node_objects;  /* of them, taken in order by the nodes (the rest
                               are dtype objects) */
} fp_record_t;

typedef struct fp_record_leaf_s {
    uint64_t offset;   /* first byte in the block */
    uint64_t nbytes;   /* numel x itemsize */
    uint32_t itemsize; /* bytes an element */
    uint32_t object;   /* dtype object index, or FP_RECORD_NONE */
    uint16_t type;     /* tensors: DLPack lanes; arrays: NumPy type number */
    uint8_t kind;      /* FP_RECORD_TENSOR or FP_RECORD_ARRAY */
    uint8_t ndim;
    uint8_t code;      /* tensors: DLPack type code */
    uint8_t bits;      /* tensors: DLPack bits */
    uint8_t flags;     /* FP_RECORD_REQUIRES_GRAD */
    int64_t shape[FP_RECORD_MAX_NDIM];
    int64_t strides[FP_RECORD_MAX_NDIM]; /* elements */
} fp_record_leaf_t;

/* Checks the `len` bytes at `buf` as a record for a block of `block_size`
 * bytes and fills *r; FP_EINVAL saying what is wrong (*r then unusable). */
int fp_record_parse(const void *buf, size_t len, uint64_t block_size, fp_record_t *r);
/* Leaf i (< r->nleaves) of a parsed record. */
void fp_record_leaf(const fp_record_t *r, uint32_t i, fp_record_leaf_t *out);
/* The node at *at in a parsed record: its kind, its count in *count (0 for
 * a non-container); *at moves past it. */
int fp_record_node(const fp_record_t *r, size_t *at, uint32_t *count);

/* ---- host-to-device staging (stage.c) --------------------------------- */

typedef struct fp_h2d_s {
    fp_cu_deviceptr_t dst; /* device address */
    const void *src;       /* host address */
    uint64_t size;         /* bytes */
    int pinned;            /* src is page-locked: copy it directly */
} fp_h2d_t;

/* Queues every copy on `stream` (a stream of `ctx`), staging pageable sources
 * through arena blocks of at most `chunk` bytes (0: 8 MiB, or a quarter of a
 * smaller arena, so that several are in flight), each released to the stream.
 * Returns once every DMA is queued; pageable sources may then be reused,
 * pinned ones only after the stream has passed the copies. Never call with
 * the GIL held. */
int fp_stage_h2d(fp_copier_t *copier, fp_arena_t *arena, fp_cu_context_t ctx,
                 fp_cu_stream_t stream, const fp_h2d_t *items, size_t count,
                 uint64_t chunk);

#endif /* FASTPIN_H */
