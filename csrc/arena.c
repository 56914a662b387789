/* The pinned arena: one region, registered with CUDA once, carved by a
 * two-level segregated-fit allocator (TLSF).
 *
 * Sizes are rounded up to a class boundary: 256-byte steps below 4 KiB, then
 * 16 classes per power of two, so a block above 4 KiB wastes less than 1/17
 * (5.9%) of itself. A free block of size S sits on the list of the class S
 * falls in; a rounded request R is a class's lower bound, so any block on a
 * list of class >= class(R) fits, and two bitmaps find one in O(1). Freed
 * blocks merge with free neighbours in address order, also O(1).
 *
 * The metadata (lock, bitmaps, list heads, the block descriptor table) sits
 * in the first pages of the mapping and holds only offsets and indices, so
 * the same arena can live in memory shared between processes. CUDA events
 * are per process and live beside it in fp_arena_t.
 *
 * A block a GPU copy may still read is not freed at once: fp_arena_free
 * records an event on the consumer stream and pushes the block onto a
 * lock-free return stack. The allocator drains that stack into a FIFO
 * pending list and frees each block whose event has completed. */
#define _GNU_SOURCE
#include <assert.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fastpin.h"

#define FP_ARENA_MAGIC 0x3130706e74736166ull /* "fastpn01" */
#define FP_MAX_CAPACITY (1ull << 43)          /* FP_FL_COUNT classes reach this */
#define FP_DEFAULT_MAX_BLOCKS 65536u

enum {
    FP_BLOCK_SPARE = 0, /* descriptor not in use; on the spare list */
    FP_BLOCK_FREE,      /* on the free list of its class */
    FP_BLOCK_USED,      /* handed out (or on the return stack) */
    FP_BLOCK_PENDING,   /* released, waiting on its event */
};

typedef struct fp_block_s {
    uint64_t offset;    /* from the start of the data; under lock */
    uint64_t size;      /* bytes, a multiple of FP_GRANULE; under lock */
    uint64_t requested; /* bytes the caller asked for, while USED/PENDING */
    uint32_t phys_prev; /* block just below in address order, or FP_NIL */
    uint32_t phys_next; /* block just above, or FP_NIL */
    uint32_t next;      /* link: free, pending or spare list (under lock), or
                           the return stack (written by fp_arena_free, which
                           owns a USED block, before it publishes it) */
    uint32_t prev;      /* back link on the free list; under lock */
    uint32_t state;     /* FP_BLOCK_*; under lock */
    uint32_t cls;       /* class of the request, for stats; under lock */
} fp_block_t;

typedef struct fp_arena_meta_s {
    uint64_t magic;       /* FP_ARENA_MAGIC once initialised */
    uint64_t capacity;    /* data bytes; constant */
    uint64_t data_offset; /* from the mapping's start to the data; constant */
    uint64_t map_size;    /* whole mapping; constant */
    uint32_t max_blocks;  /* descriptors in blocks[]; constant */
    uint32_t returned;    /* return stack head; atomic, pushed without lock */
    pthread_mutex_t lock; /* process-shared, robust; guards all below */
    uint32_t spare;       /* head of the spare descriptor list */
    uint32_t pending_head;  /* oldest pending block */
    uint32_t pending_tail;  /* newest pending block */
    uint32_t fl_bitmap;     /* bit f: some list of first level f non-empty */
    uint32_t sl_bitmap[FP_FL_COUNT]; /* bit s: list (f, s) non-empty */
    uint32_t heads[FP_CLASS_COUNT];  /* free list heads */
    uint64_t bytes_in_use, bytes_requested, high_water, bytes_pending;
    uint64_t allocs, failed, waits;
    uint32_t blocks_in_use, blocks_pending;
    uint32_t class_blocks[FP_CLASS_COUNT]; /* USED or PENDING, per class */
    fp_block_t blocks[];  /* the descriptor table */
} fp_arena_meta_t;

struct fp_arena_s {
    int refcount;          /* atomic; the last fp_arena_decref unmaps */
    int flags;             /* FP_ARENA_*; constant */
    int fd;                /* memfd for shared arenas, else -1; constant */
    int device;            /* GPU whose context records events; constant */
    int registered;        /* page-locked with CUDA; constant */
    fp_arena_meta_t *meta; /* start of the mapping */
    char *data;            /* start of the blocks' memory */
    fp_cu_context_t ctx;   /* retained primary context when registered */
    fp_cu_event_t *events; /* per descriptor, made on first hand-out; an
                              entry is touched by whoever owns the block */
    uint8_t *armed;        /* per descriptor: 1 when an event was recorded
                              at free; written by the freeing thread */
};

/* ---- size classes ------------------------------------------------------ */

static inline int fp_msb64(uint64_t x) { return 63 - __builtin_clzll(x); }

uint64_t fp_arena_round(uint64_t size)
{
    uint64_t units = size ? (size + FP_GRANULE - 1) / FP_GRANULE : 1;
    if (units >= FP_SL_COUNT) {
        uint64_t step = (1ull << (fp_msb64(units) - FP_SL_LOG2)) - 1;
        units = (units + step) & ~step;
    }
    return units * FP_GRANULE;
}

uint32_t fp_arena_class(uint64_t size)
{
    uint64_t units = size / FP_GRANULE;
    if (units < FP_SL_COUNT)
        return (uint32_t)units;
    int m = fp_msb64(units);
    uint32_t fl = (uint32_t)(m - FP_SL_LOG2 + 1);
    uint32_t sl = (uint32_t)(units >> (m - FP_SL_LOG2)) - FP_SL_COUNT;
    return fl * FP_SL_COUNT + sl;
}

/* ---- locking ----------------------------------------------------------- */

static void fp_arena_lock(fp_arena_t *a)
{
    /* A process that died holding the lock leaves EOWNERDEAD: the critical
     * sections below never leave the lists half-linked across a store that
     * could be interrupted by anything but death, so mark it consistent. */
    if (pthread_mutex_lock(&a->meta->lock) == EOWNERDEAD)
        pthread_mutex_consistent(&a->meta->lock);
}

static void fp_arena_unlock(fp_arena_t *a) { pthread_mutex_unlock(&a->meta->lock); }

#ifdef FP_DEBUG
#define FP_ARENA_ASSERT_VALID(a) assert(fp_arena_is_valid_locked(a))
static int fp_arena_is_valid_locked(fp_arena_t *a);
#else
#define FP_ARENA_ASSERT_VALID(a) ((void)0)
#endif

/* ---- free lists (all under lock) --------------------------------------- */

static void fp_list_insert(fp_arena_meta_t *m, uint32_t b)
{
    fp_block_t *blk = &m->blocks[b];
    uint32_t c = fp_arena_class(blk->size);
    blk->state = FP_BLOCK_FREE;
    blk->prev = FP_NIL;
    blk->next = m->heads[c];
    if (blk->next != FP_NIL)
        m->blocks[blk->next].prev = b;
    m->heads[c] = b;
    m->fl_bitmap |= 1u << (c / FP_SL_COUNT);
    m->sl_bitmap[c / FP_SL_COUNT] |= 1u << (c % FP_SL_COUNT);
}

static void fp_list_remove(fp_arena_meta_t *m, uint32_t b)
{
    fp_block_t *blk = &m->blocks[b];
    uint32_t c = fp_arena_class(blk->size);
    if (blk->prev != FP_NIL)
        m->blocks[blk->prev].next = blk->next;
    else
        m->heads[c] = blk->next;
    if (blk->next != FP_NIL)
        m->blocks[blk->next].prev = blk->prev;
    if (m->heads[c] == FP_NIL) {
        uint32_t fl = c / FP_SL_COUNT;
        m->sl_bitmap[fl] &= ~(1u << (c % FP_SL_COUNT));
        if (!m->sl_bitmap[fl])
            m->fl_bitmap &= ~(1u << fl);
    }
}

/* Finds a free block of at least `rounded` bytes (a class boundary). */
static uint32_t fp_list_find(fp_arena_meta_t *m, uint64_t rounded)
{
    uint32_t c = fp_arena_class(rounded);
    uint32_t fl = c / FP_SL_COUNT, sl = c % FP_SL_COUNT;
    uint32_t sl_map = m->sl_bitmap[fl] & (~0u << sl);
    if (!sl_map) {
        uint32_t fl_map = fl + 1 < FP_FL_COUNT ? m->fl_bitmap & (~0u << (fl + 1)) : 0;
        if (!fl_map)
            return FP_NIL;
        fl = (uint32_t)__builtin_ctz(fl_map);
        sl_map = m->sl_bitmap[fl];
    }
    return m->heads[fl * FP_SL_COUNT + (uint32_t)__builtin_ctz(sl_map)];
}

static uint32_t fp_spare_take(fp_arena_meta_t *m)
{
    uint32_t b = m->spare;
    if (b != FP_NIL)
        m->spare = m->blocks[b].next;
    return b;
}

static void fp_spare_put(fp_arena_meta_t *m, uint32_t b)
{
    m->blocks[b].state = FP_BLOCK_SPARE;
    m->blocks[b].next = m->spare;
    m->spare = b;
}

/* Takes a block of exactly `rounded` bytes (or the whole block when no spare
 * descriptor is left to split it); FP_NIL when nothing fits. */
static uint32_t fp_block_take(fp_arena_meta_t *m, uint64_t rounded)
{
    uint32_t b = fp_list_find(m, rounded);
    if (b == FP_NIL)
        return FP_NIL;
    fp_list_remove(m, b);
    fp_block_t *blk = &m->blocks[b];
    if (blk->size > rounded) {
        uint32_t s = fp_spare_take(m);
        if (s != FP_NIL) {
            fp_block_t *rest = &m->blocks[s];
            rest->offset = blk->offset + rounded;
            rest->size = blk->size - rounded;
            rest->phys_prev = b;
            rest->phys_next = blk->phys_next;
            if (rest->phys_next != FP_NIL)
                m->blocks[rest->phys_next].phys_prev = s;
            blk->phys_next = s;
            blk->size = rounded;
            fp_list_insert(m, s);
        }
    }
    blk->state = FP_BLOCK_USED;
    return b;
}

/* Returns a block to the free lists, merging it with free neighbours. */
static void fp_block_release(fp_arena_meta_t *m, uint32_t b)
{
    fp_block_t *blk = &m->blocks[b];
    uint32_t prev = blk->phys_prev, next = blk->phys_next;
    if (next != FP_NIL && m->blocks[next].state == FP_BLOCK_FREE) {
        fp_list_remove(m, next);
        blk->size += m->blocks[next].size;
        blk->phys_next = m->blocks[next].phys_next;
        if (blk->phys_next != FP_NIL)
            m->blocks[blk->phys_next].phys_prev = b;
        fp_spare_put(m, next);
    }
    if (prev != FP_NIL && m->blocks[prev].state == FP_BLOCK_FREE) {
        fp_list_remove(m, prev);
        m->blocks[prev].size += blk->size;
        m->blocks[prev].phys_next = blk->phys_next;
        if (blk->phys_next != FP_NIL)
            m->blocks[blk->phys_next].phys_prev = prev;
        fp_spare_put(m, b);
        b = prev;
    }
    fp_list_insert(m, b);
}

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
    fp_block_release(m, b);
}

/* Moves everything on the return stack to the tail of the pending list. */
static void fp_pending_drain(fp_arena_t *a)
{
    fp_arena_meta_t *m = a->meta;
    if (fp_atomic_load_relaxed(&m->returned) == FP_NIL)
        return;
    uint32_t b = fp_atomic_exchange_acq_rel(&m->returned, FP_NIL);
    /* The stack is newest first; reverse it so the pending list stays in
     * release order and its head is the oldest event. */
    uint32_t reversed = FP_NIL;
    while (b != FP_NIL) {
        uint32_t next = m->blocks[b].next;
        m->blocks[b].next = reversed;
        reversed = b;
        b = next;
    }
    for (b = reversed; b != FP_NIL;) {
        uint32_t next = m->blocks[b].next;
        fp_block_t *blk = &m->blocks[b];
        blk->state = FP_BLOCK_PENDING;
        blk->next = FP_NIL;
        if (m->pending_tail == FP_NIL)
            m->pending_head = b;
        else
            m->blocks[m->pending_tail].next = b;
        m->pending_tail = b;
        m->bytes_pending += blk->size;
        m->blocks_pending++;
        b = next;
    }
}

static int fp_event_done(fp_arena_t *a, uint32_t b)
{
    if (!a->armed || !a->armed[b])
        return 1;
    /* Anything but NOT_READY (an error included) means the GPU no longer
     * reads the block: an errored context will never run the copy. */
    return fp_cuda.cuEventQuery(a->events[b]) != FP_CUDA_ERROR_NOT_READY;
}

/* Retires pending blocks whose events completed. With `all` unset it stops at
 * the first one still in flight (events mostly complete in order, and the
 * common path must stay cheap); with `all` set it looks at every one. */
static void fp_pending_collect(fp_arena_t *a, int all)
{
    fp_arena_meta_t *m = a->meta;
    fp_pending_drain(a);
    if (m->pending_head == FP_NIL)
        return;
    if (a->registered)
        FP_CU_IGNORE(cuCtxPushCurrent(a->ctx));
    uint32_t prev = FP_NIL;
    for (uint32_t b = m->pending_head; b != FP_NIL;) {
        uint32_t next = m->blocks[b].next;
        if (fp_event_done(a, b)) {
            if (prev == FP_NIL)
                m->pending_head = next;
            else
                m->blocks[prev].next = next;
            if (m->pending_tail == b)
                m->pending_tail = prev;
            fp_pending_retire(a, b);
        } else if (!all) {
            break;
        } else {
            prev = b;
        }
        b = next;
    }
    if (a->registered) {
        fp_cu_context_t popped;
        FP_CU_IGNORE(cuCtxPopCurrent(&popped));
    }
}

/* ---- public API -------------------------------------------------------- */

static int fp_arena_map(fp_arena_t *a, uint64_t map_size)
{
    int prot = PROT_READ | PROT_WRITE;
    void *p;
    if (a->flags & FP_ARENA_SHARED) {
        a->fd = memfd_create("fastpin-arena", MFD_CLOEXEC);
        if (a->fd < 0)
            return fp_error_set(FP_EOS, "memfd_create: %s", strerror(errno));
        if (ftruncate(a->fd, (off_t)map_size) != 0)
            return fp_error_set(FP_EOS, "ftruncate of the shared arena to %llu bytes: %s",
                                (unsigned long long)map_size, strerror(errno));
        p = mmap(NULL, map_size, prot, MAP_SHARED, a->fd, 0);
    } else {
        p = mmap(NULL, map_size, prot, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    if (p == MAP_FAILED)
        return fp_error_set(FP_EOS, "mmap of %llu bytes for the arena: %s",
                            (unsigned long long)map_size, strerror(errno));
    a->meta = p;
    return FP_OK;
}

static int fp_arena_init_meta(fp_arena_t *a, uint64_t capacity, uint32_t max_blocks,
                              uint64_t data_offset, uint64_t map_size)
{
    fp_arena_meta_t *m = a->meta;
    m->capacity = capacity;
    m->data_offset = data_offset;
    m->map_size = map_size;
    m->max_blocks = max_blocks;
    m->returned = FP_NIL;
    m->pending_head = m->pending_tail = FP_NIL;
    for (uint32_t c = 0; c < FP_CLASS_COUNT; c++)
        m->heads[c] = FP_NIL;

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

    /* Descriptor 0 is the whole region; the rest are spare. Block 0 stays
     * the lowest block forever: merges keep the lower descriptor. */
    m->spare = FP_NIL;
    for (uint32_t b = max_blocks; b-- > 1;)
        fp_spare_put(m, b);
    m->blocks[0] = (fp_block_t){.offset = 0, .size = capacity,
                                .phys_prev = FP_NIL, .phys_next = FP_NIL};
    fp_list_insert(m, 0);
    m->magic = FP_ARENA_MAGIC;
    return FP_OK;
}

static int fp_arena_register(fp_arena_t *a, int device)
{
    int status = fp_cuda_context_retain(device, &a->ctx);
    if (status)
        return status;
    a->device = device;
    a->events = calloc(a->meta->max_blocks, sizeof *a->events);
    a->armed = calloc(a->meta->max_blocks, 1);
    if (!a->events || !a->armed) {
        fp_cuda_context_release(device);
        return fp_error_set(FP_EOS, "out of host memory for the event table");
    }
    FP_CU_CHECK_GOTO(cuCtxPushCurrent(a->ctx), status, fail);
    fp_cu_result_t r = fp_cuda.cuMemHostRegister(a->data, a->meta->capacity,
                                                 FP_CU_MEMHOSTREGISTER_PORTABLE);
    fp_cu_context_t popped;
    FP_CU_IGNORE(cuCtxPopCurrent(&popped));
    if (r != FP_CUDA_SUCCESS) {
        status = fp_cuda_error(r, "cuMemHostRegister of the arena");
        goto fail;
    }
    a->registered = 1;
    return FP_OK;
fail:
    fp_cuda_context_release(device);
    return status;
}

int fp_arena_create(fp_arena_t **out, uint64_t capacity, uint32_t max_blocks,
                    int flags, int device)
{
    *out = NULL;
    if (capacity == 0 || capacity > FP_MAX_CAPACITY)
        return fp_error_set(FP_EINVAL, "arena capacity must be between 1 byte and %llu bytes, not %llu",
                            (unsigned long long)FP_MAX_CAPACITY,
                            (unsigned long long)capacity);
    capacity = (capacity + FP_GRANULE - 1) / FP_GRANULE * FP_GRANULE;
    if (max_blocks == 0) {
        uint64_t by_size = capacity / FP_GRANULE + 1;
        max_blocks = by_size < FP_DEFAULT_MAX_BLOCKS ? (uint32_t)by_size : FP_DEFAULT_MAX_BLOCKS;
    }
    if (max_blocks < 2)
        max_blocks = 2;
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t meta_size = sizeof(fp_arena_meta_t) + (uint64_t)max_blocks * sizeof(fp_block_t);
    uint64_t data_offset = (meta_size + page - 1) / page * page;
    uint64_t map_size = data_offset + (capacity + page - 1) / page * page;

    fp_arena_t *a = calloc(1, sizeof *a);
    if (!a)
        return fp_error_set(FP_EOS, "out of host memory");
    a->refcount = 1;
    a->flags = flags;
    a->fd = -1;
    a->device = -1;
    int status = fp_arena_map(a, map_size);
    if (status)
        goto fail;
    a->data = (char *)a->meta + data_offset;
    status = fp_arena_init_meta(a, capacity, max_blocks, data_offset, map_size);
    if (status)
        goto fail;
    if (!(flags & FP_ARENA_NO_CUDA) && fp_cuda_load() == FP_CUDA_READY) {
        status = fp_arena_register(a, device);
        if (status)
            goto fail;
    }
    *out = a;
    return FP_OK;
fail:
    if (a->meta)
        munmap(a->meta, map_size);
    if (a->fd >= 0)
        close(a->fd);
    free(a->events);
    free(a->armed);
    free(a);
    return status;
}

void fp_arena_incref(fp_arena_t *a) { fp_atomic_add_acq_rel(&a->refcount, 1); }

void fp_arena_decref(fp_arena_t *a)
{
    if (fp_atomic_sub_acq_rel(&a->refcount, 1) != 0)
        return;
    if (a->registered) {
        /* At interpreter exit the driver may already be torn down: every
         * call here may fail, and none of the failures matter. */
        if (fp_cuda.cuCtxPushCurrent(a->ctx) == FP_CUDA_SUCCESS) {
            for (uint32_t b = 0; b < a->meta->max_blocks; b++)
                if (a->events[b])
                    FP_CU_IGNORE(cuEventDestroy(a->events[b]));
            FP_CU_IGNORE(cuMemHostUnregister(a->data));
            fp_cu_context_t popped;
            FP_CU_IGNORE(cuCtxPopCurrent(&popped));
        }
        fp_cuda_context_release(a->device);
    }
    pthread_mutex_destroy(&a->meta->lock);
    munmap(a->meta, a->meta->map_size);
    if (a->fd >= 0)
        close(a->fd);
    free(a->events);
    free(a->armed);
    free(a);
}

/* Makes sure a block about to be handed out has its event; under lock. */
static int fp_arena_arm(fp_arena_t *a, uint32_t b)
{
    if (!a->registered || a->events[b])
        return FP_OK;
    int status = FP_OK;
    FP_CU_CHECK(cuCtxPushCurrent(a->ctx));
    fp_cu_result_t r = fp_cuda.cuEventCreate(&a->events[b], FP_CU_EVENT_DISABLE_TIMING);
    if (r != FP_CUDA_SUCCESS) {
        a->events[b] = NULL;
        status = fp_cuda_error(r, "cuEventCreate");
    }
    fp_cu_context_t popped;
    FP_CU_IGNORE(cuCtxPopCurrent(&popped));
    return status;
}

int fp_arena_alloc(fp_arena_t *a, uint64_t size, uint32_t *block, void **ptr)
{
    fp_arena_meta_t *m = a->meta;
    uint64_t rounded = size > m->capacity ? 0 : fp_arena_round(size);
    if (!rounded || rounded > m->capacity) {
        fp_arena_lock(a);
        m->failed++;
        fp_arena_unlock(a);
        return fp_error_set(FP_ETOOBIG,
                            "asked for %llu bytes, more than the arena's cap of %llu bytes",
                            (unsigned long long)size, (unsigned long long)m->capacity);
    }
    int status = FP_OK;
    fp_arena_lock(a);
    fp_pending_collect(a, 0);
    uint32_t b = fp_block_take(m, rounded);
    while (b == FP_NIL) {
        fp_pending_collect(a, 1);
        b = fp_block_take(m, rounded);
        if (b != FP_NIL)
            break;
        if (m->pending_head == FP_NIL) {
            m->failed++;
            status = fp_error_set(FP_ENOMEM,
                                  "the arena is full: asked for %llu bytes, %llu of its %llu bytes "
                                  "are held by %u live blocks",
                                  (unsigned long long)size, (unsigned long long)m->bytes_in_use,
                                  (unsigned long long)m->capacity, m->blocks_in_use);
            goto done;
        }
        /* Only blocks still read by the GPU stand in the way: wait for the
         * oldest outside the lock. Its event stays valid meanwhile: the
         * block is reused only after someone retires it under the lock. */
        fp_cu_event_t ev = a->events[m->pending_head];
        m->waits++;
        fp_arena_unlock(a);
        if (fp_cuda.cuCtxPushCurrent(a->ctx) == FP_CUDA_SUCCESS) {
            FP_CU_IGNORE(cuEventSynchronize(ev));
            fp_cu_context_t popped;
            FP_CU_IGNORE(cuCtxPopCurrent(&popped));
        }
        fp_arena_lock(a);
    }
    status = fp_arena_arm(a, b);
    if (status) {
        fp_block_release(m, b);
        goto done;
    }
    fp_block_t *blk = &m->blocks[b];
    blk->requested = size;
    blk->cls = fp_arena_class(blk->size);
    m->bytes_in_use += blk->size;
    m->bytes_requested += size;
    if (m->bytes_in_use > m->high_water)
        m->high_water = m->bytes_in_use;
    m->blocks_in_use++;
    m->class_blocks[blk->cls]++;
    m->allocs++;
    *block = b;
    *ptr = a->data + blk->offset;
done:
    FP_ARENA_ASSERT_VALID(a);
    fp_arena_unlock(a);
    return status;
}

void fp_arena_free(fp_arena_t *a, uint32_t b, fp_cu_stream_t consumer)
{
    fp_arena_meta_t *m = a->meta;
    if (a->registered) {
        int armed = 0;
        if (consumer && fp_cuda.cuCtxPushCurrent(a->ctx) == FP_CUDA_SUCCESS) {
            armed = fp_cuda.cuEventRecord(a->events[b], consumer) == FP_CUDA_SUCCESS;
            fp_cu_context_t popped;
            FP_CU_IGNORE(cuCtxPopCurrent(&popped));
        }
        a->armed[b] = (uint8_t)armed;
    }
    uint32_t head = fp_atomic_load_relaxed(&m->returned);
    do {
        m->blocks[b].next = head;
    } while (!fp_atomic_cas_weak_release(&m->returned, &head, b));
}

void fp_arena_collect(fp_arena_t *a)
{
    fp_arena_lock(a);
    fp_pending_collect(a, 1);
    fp_arena_unlock(a);
}

void fp_arena_stats(fp_arena_t *a, fp_arena_stats_t *s)
{
    fp_arena_meta_t *m = a->meta;
    fp_arena_lock(a);
    fp_pending_collect(a, 1);
    s->capacity = m->capacity;
    s->bytes_in_use = m->bytes_in_use;
    s->bytes_requested = m->bytes_requested;
    s->high_water = m->high_water;
    s->bytes_pending = m->bytes_pending;
    s->allocs = m->allocs;
    s->failed = m->failed;
    s->waits = m->waits;
    s->blocks_in_use = m->blocks_in_use;
    s->blocks_pending = m->blocks_pending;
    s->max_blocks = m->max_blocks;
    memcpy(s->class_blocks, m->class_blocks, sizeof s->class_blocks);
    fp_arena_unlock(a);
    s->registered = a->registered;
}

uint64_t fp_arena_capacity(const fp_arena_t *a) { return a->meta->capacity; }
int fp_arena_registered(const fp_arena_t *a) { return a->registered; }
void *fp_arena_base(const fp_arena_t *a) { return a->data; }
fp_cu_context_t fp_arena_context(const fp_arena_t *a) { return a->registered ? a->ctx : NULL; }
int fp_arena_fd(const fp_arena_t *a) { return a->fd; }

/* ---- invariants -------------------------------------------------------- */

#define FP_CHECK(cond)                                                   \
    do {                                                                 \
        if (!(cond)) {                                                   \
            fp_error_set(FP_EINVAL, "arena invariant broken: %s", #cond); \
            return 0;                                                    \
        }                                                                \
    } while (0)

static int fp_arena_is_valid_locked(fp_arena_t *a)
{
    fp_arena_meta_t *m = a->meta;
    uint64_t offset = 0, in_use = 0, requested = 0, pending_bytes = 0;
    uint32_t nblocks = 0, nfree = 0, nused = 0, npending = 0;
    uint32_t per_class[FP_CLASS_COUNT] = {0};
    FP_CHECK(m->magic == FP_ARENA_MAGIC);
    /* The address-ordered chain covers the region exactly once. */
    for (uint32_t b = 0, prev = FP_NIL; b != FP_NIL; prev = b, b = m->blocks[b].phys_next) {
        fp_block_t *blk = &m->blocks[b];
        FP_CHECK(++nblocks <= m->max_blocks);
        FP_CHECK(blk->phys_prev == prev);
        FP_CHECK(blk->offset == offset);
        FP_CHECK(blk->size > 0 && blk->size % FP_GRANULE == 0);
        FP_CHECK(blk->state != FP_BLOCK_SPARE);
        if (blk->state == FP_BLOCK_FREE) {
            nfree++;
            FP_CHECK(prev == FP_NIL || m->blocks[prev].state != FP_BLOCK_FREE);
        } else {
            nused++;
            in_use += blk->size;
            requested += blk->requested;
            FP_CHECK(blk->requested <= blk->size);
            per_class[blk->cls]++;
            if (blk->state == FP_BLOCK_PENDING) {
                npending++;
                pending_bytes += blk->size;
            }
        }
        offset += blk->size;
    }
    FP_CHECK(offset == m->capacity);
    FP_CHECK(in_use == m->bytes_in_use && requested == m->bytes_requested);
    FP_CHECK(nused == m->blocks_in_use && npending == m->blocks_pending);
    FP_CHECK(pending_bytes == m->bytes_pending);
    FP_CHECK(memcmp(per_class, m->class_blocks, sizeof per_class) == 0);
    FP_CHECK(m->high_water >= m->bytes_in_use);
    /* Every free block is on the list of its class, and the bitmaps say
     * which lists are non-empty. */
    uint32_t listed = 0;
    for (uint32_t c = 0; c < FP_CLASS_COUNT; c++) {
        uint32_t fl = c / FP_SL_COUNT, sl = c % FP_SL_COUNT;
        FP_CHECK(!!(m->sl_bitmap[fl] & (1u << sl)) == (m->heads[c] != FP_NIL));
        FP_CHECK(!!(m->fl_bitmap & (1u << fl)) == (m->sl_bitmap[fl] != 0));
        for (uint32_t b = m->heads[c], prev = FP_NIL; b != FP_NIL; prev = b, b = m->blocks[b].next) {
            FP_CHECK(++listed <= nfree);
            FP_CHECK(m->blocks[b].state == FP_BLOCK_FREE);
            FP_CHECK(m->blocks[b].prev == prev);
            FP_CHECK(fp_arena_class(m->blocks[b].size) == c);
        }
    }
    FP_CHECK(listed == nfree);
    uint32_t pending = 0;
    for (uint32_t b = m->pending_head, last = FP_NIL; b != FP_NIL; last = b, b = m->blocks[b].next) {
        FP_CHECK(++pending <= npending);
        FP_CHECK(m->blocks[b].state == FP_BLOCK_PENDING);
        if (m->blocks[b].next == FP_NIL)
            FP_CHECK(m->pending_tail == b);
        (void)last;
    }
    FP_CHECK(pending == npending);
    uint32_t spare = 0;
    for (uint32_t b = m->spare; b != FP_NIL; b = m->blocks[b].next) {
        FP_CHECK(++spare <= m->max_blocks);
        FP_CHECK(m->blocks[b].state == FP_BLOCK_SPARE);
    }
    FP_CHECK(spare + nblocks == m->max_blocks);
    return 1;
}

int fp_arena_is_valid(fp_arena_t *a)
{
    fp_arena_lock(a);
    int ok = fp_arena_is_valid_locked(a);
    fp_arena_unlock(a);
    return ok;
}

/* ---- leases ------------------------------------------------------------ */

int fp_lease_alloc(fp_arena_t *a, uint64_t size, fp_lease_t **out)
{
    fp_lease_t *lease = malloc(sizeof *lease);
    if (!lease)
        return fp_error_set(FP_EOS, "out of host memory");
    void *ptr;
    int status = fp_arena_alloc(a, size, &lease->block, &ptr);
    if (status) {
        free(lease);
        return status;
    }
    fp_arena_incref(a);
    lease->refcount = 1;
    lease->arena = a;
    lease->ptr = ptr;
    lease->size = size;
    /* The legacy default stream waits for all work on blocking streams,
     * PyTorch's default stream included: a safe default consumer. */
    lease->consumer = a->registered ? FP_CU_STREAM_LEGACY : NULL;
    *out = lease;
    return FP_OK;
}

void fp_lease_incref(fp_lease_t *lease) { fp_atomic_add_acq_rel(&lease->refcount, 1); }

void fp_lease_decref(fp_lease_t *lease)
{
    if (fp_atomic_sub_acq_rel(&lease->refcount, 1) != 0)
        return;
    fp_arena_free(lease->arena, lease->block, lease->consumer);
    fp_arena_decref(lease->arena);
    free(lease);
}
