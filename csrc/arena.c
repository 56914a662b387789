/* One arena in one process: its creation (a region, mapped, its metadata
 * initialised, registered with CUDA once) or its attachment (the same region
 * mapped by another process), the lock, allocation and deferred free, the
 * blocks of other processes, and its stats. The allocator itself works on
 * offsets alone (tlsf.c); the kernel is asked through prim.c.
 *
 * A block a GPU copy may still read is not freed at once: fp_arena_free
 * records its event (a fence over the whole context, fp_cuda_fence, or one
 * stream for blocks only fastpin's copies read) and pushes the block onto a
 * lock-free return stack. The allocator drains that stack into a FIFO
 * pending list and frees each block whose event has completed.
 *
 * Processes. The creator ("home") registers the region and owns the events.
 * Workers attach through the memfd, allocate, fill, and detach blocks; the
 * creator adopts them (lease.c). Every descriptor names the pid that
 * allocated it, so the blocks of a worker that died are found
 * (fp_arena_reclaim). A block freed with an event is "armed": only home can
 * tell when it is done, so other processes leave it pending and never wait
 * for it. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "arena_internal.h"

#define FP_DEFAULT_MAX_BLOCKS 65536u

#ifdef FP_TEST
int fp_test_crash_at;
int (*fp_test_event_done)(fp_arena_t *arena, uint32_t block);
#endif

/* ---- locking ----------------------------------------------------------- */

int fp_arena_lock(fp_arena_t *a)
{
    int rc = pthread_mutex_lock(&a->meta->lock);
    if (rc == EOWNERDEAD) {
        /* A process died holding the lock, maybe halfway through an update:
         * rebuild what follows from the chain and the states, then let the
         * others in. Dying here again just leaves the next locker to repeat
         * it: the repair is idempotent. */
        fp_arena_repair(a);
        a->meta->lock_recoveries++;
        pthread_mutex_consistent(&a->meta->lock);
        return FP_OK;
    }
    /* ENOTRECOVERABLE (a locker that saw its owner die unlocked without
     * making it consistent) or a header someone wrote over: not held. */
    if (rc)
        return fp_error_set(FP_EOS, "the arena's lock cannot be taken: %s", strerror(rc));
    return FP_OK;
}

void fp_arena_unlock(fp_arena_t *a) { pthread_mutex_unlock(&a->meta->lock); }

/* ---- deferred free (under lock) ---------------------------------------- */

static void fp_pending_retire(fp_arena_t *a, uint32_t b)
{
    fp_arena_meta_t *m = a->meta;
    fp_block_t *blk = &m->blocks[b];
    m->bytes_in_use -= blk->size;
    m->bytes_requested -= blk->requested;
    m->bytes_pending -= blk->size;
    m->blocks_in_use--;
    m->blocks_pending--;
    m->class_blocks[blk->cls]--;
    FP_CRASH_POINT();
    fp_tlsf_release(m, b);
}

/* Moves everything on the return stack to the tail of the pending list, in
 * release order (the stack is newest first), so the list's head is the
 * oldest event. The chain taken off the stack is journaled in the metadata
 * before it leaves the stack, and each block is named there while it moves:
 * a drainer that dies loses nothing (fp_arena_repair). */
void fp_arena_drain(fp_arena_t *a)
{
    fp_arena_meta_t *m = a->meta;
    uint32_t head = fp_atomic_load_acquire(&m->returned);
    if (head == FP_NIL)
        return;
    do {
        m->draining = head;
        fp_atomic_signal_fence_seq_cst();
        FP_CRASH_POINT();
    } while (!fp_atomic_cas_weak_acquire(&m->returned, &head, FP_NIL));
    FP_CRASH_POINT();
    /* Each block goes right after the old tail: the newest ends up last. */
    uint32_t anchor = m->pending_tail;
    while (m->draining != FP_NIL) {
        uint32_t b = m->draining;
        fp_block_t *blk = &m->blocks[b];
        m->draining_one = b;
        fp_atomic_signal_fence_seq_cst();
        FP_CRASH_POINT();
        m->draining = blk->next;
        fp_atomic_signal_fence_seq_cst();
        FP_CRASH_POINT();
        blk->state = FP_BLOCK_PENDING;
        FP_CRASH_POINT();
        if (anchor == FP_NIL) {
            blk->next = m->pending_head;
            fp_atomic_store_relaxed(&m->pending_head, b);
        } else {
            blk->next = m->blocks[anchor].next;
            m->blocks[anchor].next = b;
        }
        FP_CRASH_POINT();
        if (m->pending_tail == anchor)
            m->pending_tail = b;
        m->bytes_pending += blk->size;
        m->blocks_pending++;
        fp_atomic_signal_fence_seq_cst();
        FP_CRASH_POINT();
        m->draining_one = FP_NIL;
    }
}

/* Whether the GPU is done with pending block `b`. Only home knows the event
 * of an armed block; elsewhere it stays pending. */
static int fp_event_done(fp_arena_t *a, uint32_t b, int home)
{
    if (!a->meta->blocks[b].armed)
        return 1;
    if (!home)
        return 0;
#ifdef FP_TEST
    /* Fake events (the fuzzer's): the test decides when the "GPU" is done. */
    if (!a->registered && fp_test_event_done)
        return fp_test_event_done(a, b);
#endif
    /* Armed without CUDA happens only through the test hook: nothing waits. */
    if (!a->registered)
        return 1;
    switch (a->meta->blocks[b].armed) {
    case FP_FENCE_DEFERRED: {
        /* Freed during a graph capture: fence now, if the capture is over.
         * Later than the free, so it covers every copy queued before it. */
        uint32_t fence = (uint32_t)fp_cuda_fence(a->ctx, a->events[b], &a->tickets[b]);
        a->meta->blocks[b].armed = fence;
        return fence == FP_FENCE_NONE;
    }
    case FP_FENCE_TICKET:
        return fp_cuda_ticket_done(a->ctx, a->tickets[b]);
    }
    return fp_cuda_event_done(a->events[b]);
}

/* Retires pending blocks whose events completed. With `all` unset it stops at
 * the first one still in flight (events mostly complete in order, and the
 * common path must stay cheap); with `all` set it looks at every one. */
static void fp_pending_collect(fp_arena_t *a, int all)
{
    fp_arena_meta_t *m = a->meta;
    if (m->broken)
        return;
    fp_arena_drain(a);
    if (m->pending_head == FP_NIL)
        return;
    int home = fp_arena_home(a);
    FP_CUDA_SCOPE(scope, home && a->registered ? a->ctx : NULL);
    uint32_t prev = FP_NIL;
    for (uint32_t b = m->pending_head; b != FP_NIL;) {
        uint32_t next = m->blocks[b].next;
        if (fp_event_done(a, b, home)) {
            if (prev == FP_NIL)
                fp_atomic_store_relaxed(&m->pending_head, next);
            else
                m->blocks[prev].next = next;
            if (m->pending_tail == b)
                m->pending_tail = prev;
            FP_CRASH_POINT();
            fp_pending_retire(a, b);
        } else if (!all) {
            break;
        } else {
            prev = b;
        }
        b = next;
    }
}

/* ---- creation, attachment, teardown ------------------------------------ */

/* The per-process half of an arena, nothing mapped yet; NULL when out of
 * memory (the message set). */
static fp_arena_t *fp_arena_new(int flags, int attached)
{
    fp_arena_t *a = calloc(1, sizeof *a);
    if (!a) {
        fp_error_set(FP_EOS, "out of host memory");
        return NULL;
    }
    a->refcount = 1;
    a->flags = flags;
    a->fd = -1;
    a->device = -1;
    a->numa_node = -1;
    a->attached = attached;
    a->pid = fp_pid();
    return a;
}

/* Destroys the events and unregisters the data. At interpreter exit the
 * driver may already be torn down: every call here may fail, and none of the
 * failures matter. */
static void fp_arena_unpin(fp_arena_t *a)
{
    FP_CUDA_SCOPE(scope, a->ctx);
    if (!scope.current)
        return;
    for (uint32_t b = 0; b < a->meta->max_blocks; b++)
        if (a->events[b])
            FP_CU_IGNORE(cuEventDestroy(a->events[b]));
    FP_CU_IGNORE(cuMemHostUnregister(a->data));
}

/* Undoes whatever create or attach did, however far it got. A process that
 * inherited the struct across fork only unmaps and frees. */
static void fp_arena_destroy(fp_arena_t *a)
{
    int here = fp_same_process(a->pid);
    if (a->registered && here) {
        fp_arena_unpin(a);
        fp_cuda_context_release(a->device);
    }
    if (a->meta) {
        /* The lock of a shared arena outlives this mapping: another process
         * may hold it, and glibc's destroy marks it unusable for every one. */
        if (!(a->flags & FP_ARENA_SHARED) && here && a->meta->magic == FP_ARENA_MAGIC)
            pthread_mutex_destroy(&a->meta->lock);
        fp_prim_unmap(a->meta, a->map_size);
    }
    if (a->fd >= 0)
        close(a->fd);
    free(a->events);
    free(a->tickets);
    free(a);
}

/* The end of create and attach: the arena to the caller, or torn down. */
static int fp_arena_finish(fp_arena_t *a, int status, fp_arena_t **out)
{
    if (status)
        fp_arena_destroy(a);
    else
        *out = a;
    return status;
}

static int fp_arena_init_meta(fp_arena_t *a, uint64_t capacity, uint32_t max_blocks,
                              uint64_t data_offset)
{
    fp_arena_meta_t *m = a->meta;
    m->capacity = capacity;
    m->data_offset = data_offset;
    m->map_size = a->map_size;
    m->max_blocks = max_blocks;
    m->token = fp_prim_random(m);
    m->returned = FP_NIL;
    m->draining = m->draining_one = FP_NIL;
    m->pending_head = m->pending_tail = FP_NIL;

    pthread_mutexattr_t attr;
    int rc = pthread_mutexattr_init(&attr);
    if (!rc)
        rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    if (!rc)
        rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    if (!rc)
        rc = pthread_mutex_init(&m->lock, &attr);
    pthread_mutexattr_destroy(&attr);
    if (rc)
        return fp_error_set(FP_EOS, "arena lock: %s", strerror(rc));
    fp_tlsf_init(m, capacity, max_blocks);
    m->magic = FP_ARENA_MAGIC;
    return FP_OK;
}

/* ---- populating in parallel ---------------------------------------------- */

/* Slices are whole multiples of this (a huge page), so each thread's range is
 * page-aligned whatever the base page size. */
#define FP_POPULATE_UNIT ((uint64_t)2 << 20)
#define FP_POPULATE_MAX_THREADS 16

typedef struct {
    char *p;
    uint64_t size;
    int ok;
} fp_populate_slice_t;

static void *fp_populate_slice(void *arg)
{
    fp_populate_slice_t *s = arg;
    s->ok = fp_prim_populate(s->p, s->size);
    return NULL;
}

int fp_populate_parallel(void *p, uint64_t size, int threads)
{
    uint64_t units = (size + FP_POPULATE_UNIT - 1) / FP_POPULATE_UNIT;
    if (threads > FP_POPULATE_MAX_THREADS)
        threads = FP_POPULATE_MAX_THREADS;
    if ((uint64_t)threads > units)
        threads = (int)units;
    if (threads <= 1)
        return size ? fp_prim_populate(p, size) : 1;
    fp_populate_slice_t slices[FP_POPULATE_MAX_THREADS];
    pthread_t tids[FP_POPULATE_MAX_THREADS];
    int started[FP_POPULATE_MAX_THREADS] = {0};
    uint64_t per = units / (uint64_t)threads, extra = units % (uint64_t)threads, off = 0;
    for (int i = 0; i < threads; i++) {
        uint64_t n = (per + ((uint64_t)i < extra)) * FP_POPULATE_UNIT;
        if (n > size - off)
            n = size - off;
        slices[i] = (fp_populate_slice_t){(char *)p + off, n, 0};
        off += n;
    }
    /* The helpers take no signal: they are the caller's, for a moment. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    for (int i = 1; i < threads; i++)
        started[i] = pthread_create(&tids[i], NULL, fp_populate_slice, &slices[i]) == 0;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    fp_populate_slice(&slices[0]);
    int ok = slices[0].ok;
    for (int i = 1; i < threads; i++) {
        if (started[i])
            pthread_join(tids[i], NULL);
        else
            fp_populate_slice(&slices[i]); /* no thread to be had: here, then */
        ok = ok && slices[i].ok;
    }
    return ok;
}

/* Threads to populate `capacity` bytes with before registering: one per 64
 * MiB, at most one per CPU and 8 (zeroing pages saturates memory before
 * that); 1 below 128 MiB, where registration faults the pages itself. */
static int fp_arena_populate_threads(uint64_t capacity)
{
    uint64_t by_size = capacity / ((uint64_t)64 << 20);
    int cpus = fp_cpu_count();
    int n = cpus < 8 ? cpus : 8;
    return by_size < (uint64_t)n ? (int)by_size : n;
}

/* cuMemHostRegister of the whole data, in the arena's context. Registration
 * faults in every page it has not seen, one at a time on this thread (the
 * kernel zeroes each): 0.55-0.65 s a GB on the H100 machine, the first batch's
 * wait in zero-copy mode. Populated first by several threads, the pages exist
 * and registration only pins them (0.28 s a GB there). Where populating is
 * refused (kernels before 5.14), the registration faults whatever is left, as
 * it always did. The helpers place pages where this thread would have: on
 * the arena's node, else this CPU's (preferred); where neither can be said,
 * this thread faults them alone. */
static int fp_arena_page_lock(fp_arena_t *a)
{
    FP_CUDA_SCOPE(scope, a->ctx);
    int status = fp_cuda_scope_status(&scope);
    if (status)
        return status;
    char *data = a->data;
    uint64_t capacity = a->meta->capacity;
    int threads = fp_arena_populate_threads(capacity);
    if (threads > 1 && (a->numa_node >= 0 ||
                        fp_prim_bind(data, capacity, fp_prim_current_node())))
        (void)fp_populate_parallel(data, capacity, threads);
    FP_CU_CHECK(cuMemHostRegister(data, capacity, FP_CU_MEMHOSTREGISTER_PORTABLE));
    return FP_OK;
}

static int fp_arena_register(fp_arena_t *a, int device)
{
    int status = fp_cuda_context_retain(device, &a->ctx);
    if (status)
        return status;
    a->device = device;
    a->events = calloc(a->meta->max_blocks, sizeof *a->events);
    a->tickets = calloc(a->meta->max_blocks, sizeof *a->tickets);
    if (!a->events || !a->tickets)
        status = fp_error_set(FP_EOS, "out of host memory for the event table");
    else
        status = fp_arena_page_lock(a);
    if (status) {
        fp_cuda_context_release(device);
        return status;
    }
    a->registered = 1;
    fp_atomic_store_release(&a->meta->resident, 1u);
    return FP_OK;
}

int fp_arena_create(fp_arena_t **out, uint64_t capacity, uint32_t max_blocks,
                    int flags, int device)
{
    return fp_arena_create_numa(out, capacity, max_blocks, flags, device, -1);
}

/* The descriptor count for an arena of `capacity` bytes (asked: `wanted`). */
static uint32_t fp_arena_max_blocks(uint64_t capacity, uint32_t wanted)
{
    if (wanted == 0) {
        uint64_t by_size = capacity / FP_GRANULE + 1;
        wanted = by_size < FP_DEFAULT_MAX_BLOCKS ? (uint32_t)by_size : FP_DEFAULT_MAX_BLOCKS;
    }
    if (wanted < 2)
        wanted = 2;
    if (wanted == FP_NIL)
        wanted = FP_NIL - 1; /* FP_NIL is never an index */
    return wanted;
}

int fp_arena_create_numa(fp_arena_t **out, uint64_t capacity, uint32_t max_blocks,
                         int flags, int device, int numa_node)
{
    *out = NULL;
    if (capacity == 0 || capacity > FP_MAX_CAPACITY)
        return fp_error_set(FP_EINVAL, "arena capacity must be between 1 byte and %llu bytes, not %llu",
                            (unsigned long long)FP_MAX_CAPACITY,
                            (unsigned long long)capacity);
    capacity = (capacity + FP_GRANULE - 1) / FP_GRANULE * FP_GRANULE;
    max_blocks = fp_arena_max_blocks(capacity, max_blocks);
    uint64_t page = fp_prim_page_size();
    uint64_t meta_size = sizeof(fp_arena_meta_t) + (uint64_t)max_blocks * sizeof(fp_block_t);
    uint64_t data_offset = (meta_size + page - 1) / page * page;
    uint64_t map_size = data_offset + (capacity + page - 1) / page * page;

    fp_arena_t *a = fp_arena_new(flags, 0);
    if (!a)
        return FP_EOS;
    void *p;
    int status = fp_prim_map_new(map_size, flags & FP_ARENA_SHARED, &a->fd, &p);
    if (!status) {
        a->meta = p;
        a->map_size = map_size;
        /* Before init_meta touches a page. Refused: the default policy, -1. */
        if (fp_prim_bind(p, map_size, numa_node))
            a->numa_node = numa_node;
        a->data = (char *)p + data_offset;
        status = fp_arena_init_meta(a, capacity, max_blocks, data_offset);
    }
    if (!status && !(flags & FP_ARENA_NO_CUDA) && fp_cuda_load() == FP_CUDA_READY)
        status = fp_arena_register(a, device);
    return fp_arena_finish(a, status, out);
}

/* Checks the header of a mapping of `map_size` bytes from `fd`. */
static int fp_arena_check_meta(const fp_arena_meta_t *m, uint64_t map_size, int fd)
{
    if (m->magic != FP_ARENA_MAGIC)
        return fp_error_set(FP_EINVAL,
                            "fd %d does not hold a fastpin arena of this version "
                            "(magic %#llx, expected %#llx)",
                            fd, (unsigned long long)m->magic, (unsigned long long)FP_ARENA_MAGIC);
    uint64_t page = fp_prim_page_size();
    uint64_t meta_size = sizeof(fp_arena_meta_t) + (uint64_t)m->max_blocks * sizeof(fp_block_t);
    if (m->map_size != map_size || m->max_blocks < 2 || m->max_blocks == FP_NIL ||
        m->data_offset < meta_size || m->data_offset % page || m->capacity == 0 ||
        m->capacity % FP_GRANULE || m->capacity > FP_MAX_CAPACITY ||
        m->data_offset > map_size || m->capacity > map_size - m->data_offset)
        return fp_error_set(FP_EINVAL,
                            "the arena header in fd %d does not add up: capacity %llu, %u "
                            "descriptors, data at %llu, mapping of %llu bytes, file of %llu bytes",
                            fd, (unsigned long long)m->capacity, m->max_blocks,
                            (unsigned long long)m->data_offset, (unsigned long long)m->map_size,
                            (unsigned long long)map_size);
    return FP_OK;
}

int fp_arena_attach(fp_arena_t **out, int fd)
{
    *out = NULL;
    uint64_t map_size;
    int status = fp_prim_fd_size(fd, sizeof(fp_arena_meta_t), &map_size);
    if (status)
        return status;
    fp_arena_t *a = fp_arena_new(FP_ARENA_SHARED | FP_ARENA_NO_CUDA, 1);
    if (!a)
        return FP_EOS;
    void *p;
    status = fp_prim_map_fd(fd, map_size, &p);
    if (!status) {
        a->meta = p;
        a->map_size = map_size;
        status = fp_arena_check_meta(a->meta, map_size, fd);
    }
    if (!status) {
        a->data = (char *)p + a->meta->data_offset;
        /* Our own descriptor: the caller may close theirs. */
        status = fp_prim_dup(fd, &a->fd);
    }
    return fp_arena_finish(a, status, out);
}

int fp_arena_prefault(fp_arena_t *a)
{
    if (!a->attached || !fp_atomic_load_relaxed(&a->meta->resident))
        return 0;
    /* The pages exist (registration made them resident): nothing is
     * allocated, only this process's page tables filled. */
    return fp_prim_populate(a->data, a->meta->capacity);
}

void fp_arena_incref(fp_arena_t *a) { fp_atomic_add_acq_rel(&a->refcount, 1); }

void fp_arena_decref(fp_arena_t *a)
{
    if (fp_atomic_sub_acq_rel(&a->refcount, 1) == 0)
        fp_arena_destroy(a);
}

/* ---- allocation -------------------------------------------------------- */

int fp_arena_arm(fp_arena_t *a, uint32_t b, int home)
{
    if (!home || !a->registered || a->events[b])
        return FP_OK;
    FP_CUDA_SCOPE(scope, a->ctx);
    int status = fp_cuda_scope_status(&scope);
    if (status)
        return status;
    fp_cu_event_t event = NULL;
    FP_CU_CHECK(cuEventCreate(&event, FP_CU_EVENT_DISABLE_TIMING));
    a->events[b] = event;
    return FP_OK;
}

int fp_arena_broken_error(void)
{
    return fp_error_set(FP_EINVAL, "the arena's metadata was damaged by a process that died "
                                   "holding its lock; make a new arena");
}

/* Why no room can be made for `size` bytes by waiting, as FP_ENOMEM; FP_OK
 * when the oldest pending block's copies can be waited for. Under lock. */
static int fp_arena_why_full(fp_arena_t *a, uint64_t size, int home)
{
    fp_arena_meta_t *m = a->meta;
    if (m->pending_head == FP_NIL)
        return fp_error_set(FP_ENOMEM,
                            "the arena is full: asked for %llu bytes, %llu of its %llu bytes "
                            "are held by %u live blocks",
                            (unsigned long long)size, (unsigned long long)m->bytes_in_use,
                            (unsigned long long)m->capacity, m->blocks_in_use);
    if (!home || !a->registered)
        /* What is left waits on GPU copies only the creator can see end. */
        return fp_error_set(FP_ENOMEM,
                            "the arena is full for this process: asked for %llu bytes, "
                            "%llu of its %llu bytes are held by %u blocks, %u of them "
                            "waiting on GPU copies that only the creating process tracks",
                            (unsigned long long)size, (unsigned long long)m->bytes_in_use,
                            (unsigned long long)m->capacity, m->blocks_in_use,
                            m->blocks_pending);
    uint32_t fence = m->blocks[m->pending_head].armed;
    if (fence == FP_FENCE_DEFERRED || (fence == FP_FENCE_TICKET && fp_cuda_captures()))
        /* Its fence waits for a graph capture to end, and the capturing
         * thread may be this one: do not wait. */
        return fp_error_set(FP_ENOMEM,
                            "the arena is full: asked for %llu bytes, %llu of its %llu bytes "
                            "are held by blocks freed while a CUDA graph capture is under "
                            "way, reusable once it ends",
                            (unsigned long long)size, (unsigned long long)m->bytes_in_use,
                            (unsigned long long)m->capacity);
    return FP_OK;
}

/* Takes a block of `rounded` bytes for a request of `size`, retiring what
 * the GPU is done with; *b stays FP_NIL (and FP_OK) when only waiting on the
 * oldest pending block can make room. Under lock. */
static int fp_arena_try_take(fp_arena_t *a, uint64_t rounded, uint64_t size, int home,
                             int first, uint32_t *b)
{
    fp_arena_meta_t *m = a->meta;
    pid_t self = fp_pid();
    if (first) {
        fp_pending_collect(a, 0);
        *b = fp_tlsf_take(m, rounded, size, self);
        if (*b != FP_NIL)
            return FP_OK;
    }
    fp_pending_collect(a, 1);
    *b = fp_tlsf_take(m, rounded, size, self);
    if (*b != FP_NIL)
        return FP_OK;
    int status = fp_arena_why_full(a, size, home);
    if (status)
        m->failed++;
    return status;
}

/* Waits for the oldest pending block's copies outside the lock, then takes
 * the lock again (not held when that fails). Its event stays valid
 * meanwhile: the block is reused only after home retires it under the lock. */
static int fp_arena_wait_oldest(fp_arena_t *a)
{
    fp_arena_meta_t *m = a->meta;
    uint32_t head = m->pending_head, fence = m->blocks[head].armed;
    fp_cu_event_t ev = a->events[head];
    uint64_t ticket = a->tickets[head];
    m->waits++;
    fp_arena_unlock(a);
    if (fence == FP_FENCE_TICKET) {
        fp_cuda_ticket_wait(a->ctx, ticket);
    } else {
        FP_CUDA_SCOPE(scope, a->ctx);
        if (scope.current)
            FP_CU_IGNORE(cuEventSynchronize(ev));
    }
    return fp_arena_lock(a);
}

/* Block `b`, taken, becomes the caller's: its event made, the counters
 * told. Under lock. */
static int fp_arena_hand_out(fp_arena_t *a, uint32_t b, uint64_t size, int home)
{
    fp_arena_meta_t *m = a->meta;
    int status = fp_arena_arm(a, b, home);
    if (status) {
        fp_tlsf_release(m, b);
        return status;
    }
    fp_block_t *blk = &m->blocks[b];
    FP_CRASH_POINT();
    m->bytes_in_use += blk->size;
    m->bytes_requested += size;
    if (m->bytes_in_use > m->high_water)
        m->high_water = m->bytes_in_use;
    m->blocks_in_use++;
    m->class_blocks[blk->cls]++;
    m->allocs++;
    return FP_OK;
}

static int fp_arena_too_big(fp_arena_t *a, uint64_t size)
{
    int status = fp_arena_lock(a);
    if (status)
        return status;
    a->meta->failed++;
    fp_arena_unlock(a);
    return fp_error_set(FP_ETOOBIG, "asked for %llu bytes, more than the arena's cap of %llu bytes",
                        (unsigned long long)size, (unsigned long long)a->meta->capacity);
}

/* fp_arena_alloc and fp_arena_try_alloc: `wait` says whether to wait for
 * the oldest pending block's copies where only they hold the room. */
static int fp_arena_alloc_as(fp_arena_t *a, uint64_t size, int wait, uint32_t *block, void **ptr)
{
    fp_arena_meta_t *m = a->meta;
    uint64_t rounded = size > m->capacity ? 0 : fp_arena_round(size);
    /* A request that fits the cap but rounds past it (the cap is not a class
     * size) takes the whole arena, when it is all free. */
    if (rounded > m->capacity)
        rounded = m->capacity;
    if (!rounded)
        return fp_arena_too_big(a, size);
    if (!(a->flags & FP_ARENA_SHARED) && !fp_same_process(a->pid))
        /* A forked child maps the creator's pages: its blocks would be
         * lost with it. fastpin.default_arena() makes the child its own. */
        return fp_error_set(FP_EINVAL,
                            "this arena belongs to process %d, which this one was forked "
                            "from; make an arena in this process",
                            (int)a->pid);
    int home = fp_arena_home(a);
    int status = fp_arena_lock(a);
    if (status)
        return status;
    uint32_t b = FP_NIL;
    if (m->broken)
        status = fp_arena_broken_error();
    for (int first = 1; !status; first = 0) {
        status = fp_arena_try_take(a, rounded, size, home, first, &b);
        if (status || b != FP_NIL)
            break;
        if (!wait) {
            status = FP_EBUSY;
            break;
        }
        status = fp_arena_wait_oldest(a);
        if (status)
            return status; /* the lock could not be taken again: not held */
    }
    if (!status)
        status = fp_arena_hand_out(a, b, size, home);
    if (!status) {
        *block = b;
        *ptr = a->data + m->blocks[b].offset;
    }
    FP_ARENA_ASSERT_VALID(a);
    fp_arena_unlock(a);
    return status;
}

int fp_arena_alloc(fp_arena_t *a, uint64_t size, uint32_t *block, void **ptr)
{
    return fp_arena_alloc_as(a, size, 1, block, ptr);
}

int fp_arena_try_alloc(fp_arena_t *a, uint64_t size, uint32_t *block, void **ptr)
{
    return fp_arena_alloc_as(a, size, 0, block, ptr);
}

/* Publishes a block on the return stack; the caller owns it (USED). */
static void fp_return_push(fp_arena_meta_t *m, uint32_t b, uint32_t armed)
{
    m->blocks[b].armed = armed;
    uint32_t head = fp_atomic_load_relaxed(&m->returned);
    do {
        m->blocks[b].next = head;
        FP_CRASH_POINT();
    } while (!fp_atomic_cas_weak_release(&m->returned, &head, b));
}

void fp_arena_free(fp_arena_t *a, uint32_t b, fp_cu_stream_t consumer)
{
    uint32_t armed = FP_FENCE_NONE;
    if (consumer && fp_arena_cuda(a))
        armed = consumer == FP_STREAM_ANY
                    ? (uint32_t)fp_cuda_fence(a->ctx, a->events[b], &a->tickets[b])
                    : (uint32_t)fp_cuda_record(a->ctx, a->events[b], consumer);
    fp_return_push(a->meta, b, armed);
}

int fp_arena_idle(const fp_arena_t *a)
{
    const fp_arena_meta_t *m = a->meta;
    return fp_atomic_load_relaxed(&m->returned) == FP_NIL &&
           fp_atomic_load_relaxed(&m->pending_head) == FP_NIL;
}

int fp_arena_collect(fp_arena_t *a)
{
    if (fp_arena_idle(a))
        return FP_OK;
    int status = fp_arena_lock(a);
    if (status)
        return status;
    fp_pending_collect(a, 1);
    fp_arena_unlock(a);
    return FP_OK;
}

/* ---- other processes --------------------------------------------------- */

enum { FP_RECLAIM_PIDS = 128 }; /* owners judged per call; the rest wait a call */

typedef struct fp_pids_s {
    uint32_t n;
    pid_t pid[FP_RECLAIM_PIDS];
} fp_pids_t;

static int fp_pids_have(const fp_pids_t *p, pid_t pid)
{
    for (uint32_t i = 0; i < p->n; i++)
        if (p->pid[i] == pid)
            return 1;
    return 0;
}

static void fp_pids_add(fp_pids_t *p, pid_t pid)
{
    if (p->n < FP_RECLAIM_PIDS)
        p->pid[p->n++] = pid;
}

/* Whether `pid` is gone for good: no such process, or a child of this one
 * that has exited and waits to be reaped (a zombie still answers kill(), but
 * writes nothing more; DataLoader reaps its workers when it shuts them down,
 * which may come after the epoch's reclaim). WNOWAIT leaves the child to its
 * parent's own wait, as DataLoader's own check of its workers does. */
static int fp_gone(pid_t pid)
{
    if (kill(pid, 0) == -1 && errno == ESRCH)
        return 1;
    siginfo_t info = {0};
    return waitid(P_PID, (id_t)pid, &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid;
}

/* The owners of allocated blocks, other than this process, that are gone
 * (fp_gone). Under lock. */
static void fp_reclaim_judge(fp_arena_meta_t *m, fp_pids_t *dead)
{
    fp_pids_t alive = {0};
    pid_t self = fp_pid();
    for (uint32_t b = m->broken ? FP_NIL : 0; b != FP_NIL; b = m->blocks[b].phys_next) {
        pid_t owner = m->blocks[b].owner;
        if (m->blocks[b].state != FP_BLOCK_USED || owner <= 0 || owner == self ||
            fp_pids_have(dead, owner) || fp_pids_have(&alive, owner))
            continue;
        if (fp_gone(owner))
            fp_pids_add(dead, owner);
        else
            fp_pids_add(&alive, owner);
    }
}

int fp_arena_reclaim(fp_arena_t *a, uint32_t *freed)
{
    fp_arena_meta_t *m = a->meta;
    fp_pids_t dead = {0};
    *freed = 0;
    int status = fp_arena_lock(a);
    if (status)
        return status;
    /* Judge the owners before draining the return stack: a process found
     * dead made its last push before, so the drain takes every block it
     * freed, and what it still holds afterwards nobody will free. */
    fp_reclaim_judge(m, &dead);
    if (dead.n) {
        fp_arena_drain(a);
        for (uint32_t b = 0; b != FP_NIL; b = m->blocks[b].phys_next) {
            fp_block_t *blk = &m->blocks[b];
            if (blk->state != FP_BLOCK_USED || !fp_pids_have(&dead, blk->owner))
                continue;
            m->bytes_in_use -= blk->size;
            m->bytes_requested -= blk->requested;
            m->blocks_in_use--;
            m->class_blocks[blk->cls]--;
            FP_CRASH_POINT();
            /* Merges never reach past the next allocated block: go on from
             * the free block that now covers this one. */
            b = fp_tlsf_release(m, b);
            (*freed)++;
        }
        m->reclaimed += *freed;
    }
    FP_ARENA_ASSERT_VALID(a);
    fp_arena_unlock(a);
    return FP_OK;
}

void fp_arena_count_fallback(fp_arena_t *a) { fp_atomic_add_acq_rel(&a->meta->fallbacks, 1); }

int fp_arena_owner(fp_arena_t *a, uint32_t b, pid_t *owner)
{
    fp_arena_meta_t *m = a->meta;
    if (b >= m->max_blocks)
        return fp_error_set(FP_EINVAL, "block %u is out of range (the arena has %u descriptors)",
                            b, m->max_blocks);
    int status = fp_arena_lock(a);
    if (status)
        return status;
    uint32_t state = m->blocks[b].state;
    if (state == FP_BLOCK_USED || state == FP_BLOCK_PENDING)
        *owner = m->blocks[b].owner;
    else
        status = fp_error_set(FP_EINVAL, "block %u is not allocated", b);
    fp_arena_unlock(a);
    return status;
}

/* ---- queries ----------------------------------------------------------- */

int fp_arena_stats(fp_arena_t *a, fp_arena_stats_t *s)
{
    fp_arena_meta_t *m = a->meta;
    pid_t self = fp_pid();
    int status = fp_arena_lock(a);
    if (status)
        return status;
    fp_pending_collect(a, 1);
    /* Fields the metadata and the stats share, by name, copied as they are. */
#define FP_COPY(field) s->field = m->field;
    FP_COPY(capacity) FP_COPY(bytes_in_use) FP_COPY(bytes_requested) FP_COPY(high_water)
    FP_COPY(bytes_pending) FP_COPY(allocs) FP_COPY(failed) FP_COPY(waits)
    FP_COPY(lock_recoveries) FP_COPY(reclaimed) FP_COPY(blocks_in_use) FP_COPY(blocks_pending)
#undef FP_COPY
    s->blocks_foreign = 0;
    for (uint32_t b = m->broken ? FP_NIL : 0; b != FP_NIL; b = m->blocks[b].phys_next)
        if (m->blocks[b].state == FP_BLOCK_USED && m->blocks[b].owner != 0 &&
            m->blocks[b].owner != self)
            s->blocks_foreign++;
    s->max_blocks = m->max_blocks;
    memcpy(s->class_blocks, m->class_blocks, sizeof s->class_blocks);
    fp_arena_unlock(a);
    s->fallbacks = fp_atomic_load_relaxed(&m->fallbacks);
    s->registered = fp_arena_registered(a);
    s->shared = !!(a->flags & FP_ARENA_SHARED);
    s->numa_node = a->numa_node;
    return FP_OK;
}

uint64_t fp_arena_capacity(const fp_arena_t *a) { return a->meta->capacity; }
int fp_arena_registered(const fp_arena_t *a) { return fp_arena_cuda(a); }
void *fp_arena_base(const fp_arena_t *a) { return a->data; }
fp_cu_context_t fp_arena_context(const fp_arena_t *a) { return fp_arena_cuda(a) ? a->ctx : NULL; }
int fp_arena_fd(const fp_arena_t *a) { return a->fd; }
uint64_t fp_arena_token(const fp_arena_t *a) { return a->meta->token; }
int fp_arena_attached(const fp_arena_t *a) { return a->attached; }
int fp_arena_device(const fp_arena_t *a) { return fp_arena_cuda(a) ? a->device : -1; }

/* ---- test hooks -------------------------------------------------------- */

#ifdef FP_TEST
void fp_arena_test_lock(fp_arena_t *a) { (void)fp_arena_lock(a); }

void fp_arena_test_free_armed(fp_arena_t *a, uint32_t b) { fp_return_push(a->meta, b, 1); }

void fp_arena_test_mark_resident(fp_arena_t *a) { fp_atomic_store_release(&a->meta->resident, 1u); }

uint64_t fp_arena_test_block_size(fp_arena_t *a, uint32_t b)
{
    fp_arena_meta_t *m = a->meta;
    if (b >= m->max_blocks || fp_arena_lock(a))
        return 0;
    uint32_t state = m->blocks[b].state;
    uint64_t size = state == FP_BLOCK_USED || state == FP_BLOCK_PENDING ? m->blocks[b].size : 0;
    fp_arena_unlock(a);
    return size;
}

/* A process that died holding the lock, then a locker that saw it and let
 * go without making the lock consistent: nobody can take it again. */
void fp_arena_test_spoil_lock(fp_arena_t *a)
{
    pid_t child = fork();
    if (child == 0) {
        pthread_mutex_lock(&a->meta->lock);
        _exit(0);
    }
    waitpid(child, NULL, 0);
    if (pthread_mutex_lock(&a->meta->lock) == EOWNERDEAD)
        pthread_mutex_unlock(&a->meta->lock);
}
#endif
