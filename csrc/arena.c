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
 * records its event (a fence over the whole context, fp_cuda_fence, or one
 * stream for blocks only fastpin's copies read) and pushes the block onto a
 * lock-free return stack. The allocator drains that stack into a FIFO
 * pending list and frees each block whose event has completed.
 *
 * Processes. The creator ("home") registers the region and owns the events.
 * Workers attach through the memfd, allocate, fill, and detach blocks; the
 * creator adopts them. Every descriptor names the pid that allocated it, so
 * the blocks of a worker that died are found (fp_arena_reclaim). A block
 * freed with an event is "armed": only home can tell when it is done, so
 * other processes leave it pending and never wait for it.
 *
 * Death under the lock. The lock is robust: a process may die anywhere in a
 * critical section. Updates are ordered so that after any prefix of their
 * stores the physical chain (block 0, then phys_next links, each block's
 * offset) still partitions the region, and a block's state changes only
 * after the fields it vouches for. Sizes, lists, bitmaps and counters follow
 * from the chain and the states, and the next locker rebuilds them
 * (fp_arena_repair). A drain of the return stack keeps a journal in the
 * metadata, so the blocks it holds in hand are not lost. */
#define _GNU_SOURCE
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "fastpin.h"

#define FP_ARENA_MAGIC 0x3230706e74736166ull /* "fastpn02" */
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
    int32_t owner;      /* pid that allocated it, 0 once adopted; under lock */
    uint32_t armed;     /* FP_FENCE_*: RECORDED (an event at free), TICKET (a
                           context sync at free), DEFERRED (home must still
                           fence it: a graph capture was under way); only home
                           may retire any of them. Written by the freeing
                           thread before it publishes the block, then under
                           lock by home */
    uint32_t leased;    /* atomic; 1 while a lease in the owner holds it (not
                           adoptable), cleared by fp_lease_detach */
} fp_block_t;

typedef struct fp_arena_meta_s {
    uint64_t magic;       /* FP_ARENA_MAGIC once initialised */
    uint64_t capacity;    /* data bytes; constant */
    uint64_t data_offset; /* from the mapping's start to the data; constant */
    uint64_t map_size;    /* whole mapping; constant */
    uint64_t token;       /* random, names the arena in every process; constant */
    uint64_t fallbacks;   /* atomic; batches workers could not place here */
    uint32_t max_blocks;  /* descriptors in blocks[]; constant */
    uint32_t resident;    /* the creator's registration made every page resident:
                             attachers may prefault their mapping for free; set
                             once, before workers start */
    uint32_t returned;    /* return stack head; atomic, pushed without lock */
    pthread_mutex_t lock; /* process-shared, robust; guards all below */
    uint32_t draining;    /* journal: the rest of a chain taken off the return
                             stack and not yet made pending, or FP_NIL */
    uint32_t draining_one; /* journal: the block being made pending, or FP_NIL */
    uint32_t broken;      /* repair found the chain itself damaged: every
                             allocation fails from then on */
    uint32_t spare;       /* head of the spare descriptor list */
    uint32_t pending_head;  /* oldest pending block */
    uint32_t pending_tail;  /* newest pending block */
    uint32_t fl_bitmap;     /* bit f: some list of first level f non-empty */
    uint32_t sl_bitmap[FP_FL_COUNT]; /* bit s: list (f, s) non-empty */
    uint32_t heads[FP_CLASS_COUNT];  /* free list heads */
    uint64_t bytes_in_use, bytes_requested, high_water, bytes_pending;
    uint64_t allocs, failed, waits;
    uint64_t lock_recoveries; /* EOWNERDEAD seen: a process died holding the lock */
    uint64_t reclaimed;       /* blocks of dead processes freed */
    uint32_t blocks_in_use, blocks_pending;
    uint32_t class_blocks[FP_CLASS_COUNT]; /* USED or PENDING, per class */
    fp_block_t blocks[];  /* the descriptor table */
} fp_arena_meta_t;

struct fp_arena_s {
    int refcount;          /* atomic; the last fp_arena_decref unmaps */
    int flags;             /* FP_ARENA_*; constant */
    int fd;                /* memfd for shared arenas, else -1; constant */
    int device;            /* GPU whose context records events; constant */
    int registered;        /* the creator page-locked it with CUDA; constant */
    int attached;          /* mapped by fp_arena_attach; constant */
    int numa_node;         /* node mbind made the mapping prefer, or -1; constant */
    pid_t pid;             /* process that created or attached this struct: a
                              forked child holding a copy is not it; constant */
    fp_arena_meta_t *meta; /* start of the mapping */
    char *data;            /* start of the blocks' memory */
    fp_cu_context_t ctx;   /* retained primary context when registered */
    fp_cu_event_t *events; /* per descriptor, made on first hand-out in home;
                              an entry is touched by whoever owns the block */
    uint64_t *tickets;     /* per descriptor, the fence ticket of a block freed
                              with FP_FENCE_TICKET; written by the freeing
                              thread before it publishes the block */
};

/* Crash points: where the C tests kill a process mid-update, one point at a
 * time, to check that the next locker repairs every state it can leave. */
#ifdef FP_TEST
int fp_test_crash_at;
int (*fp_test_event_done)(fp_arena_t *arena, uint32_t block);
#define FP_CRASH_POINT()                                        \
    do {                                                        \
        if (fp_test_crash_at && --fp_test_crash_at == 0)        \
            raise(SIGKILL);                                     \
    } while (0)
#else
#define FP_CRASH_POINT() ((void)0)
#endif

/* The creating process: the only one that knows the events of armed blocks. */
static inline int fp_arena_home(const fp_arena_t *a)
{
    return !a->attached && a->pid == getpid();
}

/* CUDA may be used on this arena in this process (never in a forked copy). */
static inline int fp_arena_cuda(const fp_arena_t *a)
{
    return a->registered && a->pid == getpid();
}

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

static void fp_arena_repair(fp_arena_t *a);

static void fp_arena_lock(fp_arena_t *a)
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
        rc = 0;
    }
    /* ENOTRECOVERABLE needs an unlock without consistent, which never happens. */
    assert(rc == 0);
    (void)rc;
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
 * descriptor is left to split it) for `owner`, who asked for `size`; FP_NIL
 * when nothing fits. */
static uint32_t fp_block_take(fp_arena_meta_t *m, uint64_t rounded, uint64_t size,
                              pid_t owner)
{
    uint32_t b = fp_list_find(m, rounded);
    /* Only a request clamped to the cap is not a class size: the head of its
     * class's list may then be smaller than it. */
    if (b == FP_NIL || m->blocks[b].size < rounded)
        return FP_NIL;
    fp_list_remove(m, b);
    FP_CRASH_POINT();
    fp_block_t *blk = &m->blocks[b];
    if (blk->size > rounded) {
        uint32_t s = fp_spare_take(m);
        FP_CRASH_POINT();
        if (s != FP_NIL) {
            fp_block_t *rest = &m->blocks[s];
            rest->offset = blk->offset + rounded;
            rest->size = blk->size - rounded;
            rest->phys_prev = b;
            rest->phys_next = blk->phys_next;
            /* rest is complete before the chain reaches it. */
            fp_atomic_signal_fence_seq_cst();
            FP_CRASH_POINT();
            blk->phys_next = s;
            fp_atomic_signal_fence_seq_cst();
            FP_CRASH_POINT();
            if (rest->phys_next != FP_NIL)
                m->blocks[rest->phys_next].phys_prev = s;
            FP_CRASH_POINT();
            blk->size = rounded;
            FP_CRASH_POINT();
            fp_list_insert(m, s);
            FP_CRASH_POINT();
        }
    }
    blk->requested = size;
    blk->cls = fp_arena_class(blk->size);
    blk->owner = owner;
    blk->armed = 0;
    fp_atomic_store_release(&blk->leased, 0);
    /* USED vouches for the fields above: a death before it leaves a free block. */
    fp_atomic_signal_fence_seq_cst();
    FP_CRASH_POINT();
    blk->state = FP_BLOCK_USED;
    FP_CRASH_POINT();
    return b;
}

/* Returns a block to the free lists, merging it with free neighbours; returns
 * the free block that now covers it. Each merge changes the chain by a single
 * store (a link that skips the absorbed block). */
static uint32_t fp_block_release(fp_arena_meta_t *m, uint32_t b)
{
    fp_block_t *blk = &m->blocks[b];
    uint32_t prev = blk->phys_prev, next = blk->phys_next;
    if (next != FP_NIL && m->blocks[next].state == FP_BLOCK_FREE) {
        fp_list_remove(m, next);
        FP_CRASH_POINT();
        blk->size += m->blocks[next].size;
        fp_atomic_signal_fence_seq_cst();
        FP_CRASH_POINT();
        blk->phys_next = m->blocks[next].phys_next;
        fp_atomic_signal_fence_seq_cst();
        FP_CRASH_POINT();
        if (blk->phys_next != FP_NIL)
            m->blocks[blk->phys_next].phys_prev = b;
        FP_CRASH_POINT();
        fp_spare_put(m, next);
        FP_CRASH_POINT();
    }
    if (prev != FP_NIL && m->blocks[prev].state == FP_BLOCK_FREE) {
        fp_list_remove(m, prev);
        FP_CRASH_POINT();
        m->blocks[prev].size += blk->size;
        fp_atomic_signal_fence_seq_cst();
        FP_CRASH_POINT();
        m->blocks[prev].phys_next = blk->phys_next;
        fp_atomic_signal_fence_seq_cst();
        FP_CRASH_POINT();
        if (blk->phys_next != FP_NIL)
            m->blocks[blk->phys_next].phys_prev = prev;
        FP_CRASH_POINT();
        fp_spare_put(m, b);
        FP_CRASH_POINT();
        b = prev;
    }
    fp_list_insert(m, b);
    FP_CRASH_POINT();
    return b;
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
    FP_CRASH_POINT();
    fp_block_release(m, b);
}

/* Moves everything on the return stack to the tail of the pending list, in
 * release order (the stack is newest first), so the list's head is the
 * oldest event. The chain taken off the stack is journaled in the metadata
 * before it leaves the stack, and each block is named there while it moves:
 * a drainer that dies loses nothing (fp_arena_repair). */
static void fp_pending_drain(fp_arena_t *a)
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
            m->pending_head = b;
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
    if (m->broken)
        return;
    fp_pending_drain(a);
    if (m->pending_head == FP_NIL)
        return;
    int home = fp_arena_home(a), cuda = home && a->registered;
    if (cuda)
        FP_CU_IGNORE(cuCtxPushCurrent(a->ctx));
    uint32_t prev = FP_NIL;
    for (uint32_t b = m->pending_head; b != FP_NIL;) {
        uint32_t next = m->blocks[b].next;
        if (fp_event_done(a, b, home)) {
            if (prev == FP_NIL)
                m->pending_head = next;
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
    if (cuda) {
        fp_cu_context_t popped;
        FP_CU_IGNORE(cuCtxPopCurrent(&popped));
    }
}

/* ---- lock recovery (under lock) ---------------------------------------- */

/* Rebuilds the metadata after a process died holding the lock. The chain
 * from block 0 and each block's state are the truth (see the top of the
 * file); the rest is derived again. Blocks a dead drainer held in hand were
 * freed by their owners, so they become pending. Pushers may go on pushing
 * meanwhile: nothing here touches `next` or `armed` of an allocated block. */
static void fp_arena_repair(fp_arena_t *a)
{
    fp_arena_meta_t *m = a->meta;
    uint32_t n = m->max_blocks;

    /* A journal whose head is still on the stack was written, never taken. */
    int taken = m->draining != FP_NIL;
    uint32_t steps = 0;
    for (uint32_t b = fp_atomic_load_acquire(&m->returned); taken && b < n && steps++ < n;
         b = m->blocks[b].next)
        if (b == m->draining)
            taken = 0;
    steps = 0;
    for (uint32_t b = taken ? m->draining : FP_NIL; b < n && steps++ < n; b = m->blocks[b].next)
        if (m->blocks[b].state == FP_BLOCK_USED)
            m->blocks[b].state = FP_BLOCK_PENDING;
    if (m->draining_one < n && m->blocks[m->draining_one].state == FP_BLOCK_USED)
        m->blocks[m->draining_one].state = FP_BLOCK_PENDING;
    FP_CRASH_POINT();
    m->draining = m->draining_one = FP_NIL;

    /* Walk the chain; `prev` marks the descriptors on it (lists are rebuilt
     * below). Offsets must rise by granules up to the capacity. */
    for (uint32_t b = 0; b < n; b++)
        m->blocks[b].prev = 0;
    uint32_t last = FP_NIL;
    for (uint32_t b = 0; b != FP_NIL;) {
        fp_block_t *blk = &m->blocks[b];
        uint32_t next = blk->phys_next;
        uint64_t end = next == FP_NIL ? m->capacity : next < n ? m->blocks[next].offset : 0;
        if ((b == 0 && blk->offset != 0) || end <= blk->offset || end > m->capacity ||
            end % FP_GRANULE || blk->state > FP_BLOCK_PENDING) {
            m->broken = 1;
            return;
        }
        blk->size = end - blk->offset;
        /* The upper part of a split cut short: free space. */
        if (blk->state == FP_BLOCK_SPARE)
            blk->state = FP_BLOCK_FREE;
        if (blk->state == FP_BLOCK_FREE && last != FP_NIL &&
            m->blocks[last].state == FP_BLOCK_FREE) {
            /* Free neighbours (a split or merge cut short): one block. */
            m->blocks[last].phys_next = next;
            m->blocks[last].size += blk->size;
            FP_CRASH_POINT();
        } else {
            blk->prev = 1;
            blk->phys_prev = last;
            last = b;
        }
        b = next;
    }

    m->spare = FP_NIL;
    for (uint32_t b = n; b-- > 0;)
        if (!m->blocks[b].prev)
            fp_spare_put(m, b);
    FP_CRASH_POINT();

    m->fl_bitmap = 0;
    memset(m->sl_bitmap, 0, sizeof m->sl_bitmap);
    for (uint32_t c = 0; c < FP_CLASS_COUNT; c++)
        m->heads[c] = FP_NIL;
    m->pending_head = m->pending_tail = FP_NIL;
    m->bytes_in_use = m->bytes_requested = m->bytes_pending = 0;
    m->blocks_in_use = m->blocks_pending = 0;
    memset(m->class_blocks, 0, sizeof m->class_blocks);
    for (uint32_t b = 0; b != FP_NIL; b = m->blocks[b].phys_next) {
        fp_block_t *blk = &m->blocks[b];
        FP_CRASH_POINT();
        if (blk->state == FP_BLOCK_FREE) {
            fp_list_insert(m, b);
            continue;
        }
        if (blk->cls >= FP_CLASS_COUNT || blk->requested > blk->size) {
            m->broken = 1;
            return;
        }
        if (blk->state == FP_BLOCK_PENDING) {
            blk->next = FP_NIL;
            if (m->pending_tail == FP_NIL)
                m->pending_head = b;
            else
                m->blocks[m->pending_tail].next = b;
            m->pending_tail = b;
            m->bytes_pending += blk->size;
            m->blocks_pending++;
        }
        m->bytes_in_use += blk->size;
        m->bytes_requested += blk->requested;
        m->blocks_in_use++;
        m->class_blocks[blk->cls]++;
    }
    if (m->high_water < m->bytes_in_use)
        m->high_water = m->bytes_in_use;
}

/* ---- creation, attachment ---------------------------------------------- */

static int fp_arena_map(fp_arena_t *a, uint64_t map_size)
{
    int prot = PROT_READ | PROT_WRITE;
    void *p;
    if (a->flags & FP_ARENA_SHARED) {
        a->fd = memfd_create("fastpin-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (a->fd < 0)
            return fp_error_set(FP_EOS, "memfd_create: %s", strerror(errno));
        if (ftruncate(a->fd, (off_t)map_size) != 0)
            return fp_error_set(FP_EOS, "ftruncate of the shared arena to %llu bytes: %s",
                                (unsigned long long)map_size, strerror(errno));
        /* A worker that resized the file would make every mapping fault
         * (SIGBUS) past the new end. Old kernels lack seals: no harm. */
        (void)fcntl(a->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
        p = mmap(NULL, map_size, prot, MAP_SHARED, a->fd, 0);
    } else {
        /* Shared, though no other process attaches: fork() copies every
         * page-locked page of a private mapping into the child at once (the
         * pages cannot be copy-on-write while a device may DMA to them),
         * 0.4 s per GiB and per DataLoader worker on the H200 machine. A
         * shared mapping is not copied: the child maps the same pages, and
         * can still read the batches it inherited. */
        p = mmap(NULL, map_size, prot, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    }
    if (p == MAP_FAILED)
        return fp_error_set(FP_EOS, "mmap of %llu bytes for the arena: %s",
                            (unsigned long long)map_size, strerror(errno));
    a->meta = p;
    return FP_OK;
}

/* The kernel's MPOL_PREFERRED (linux/mempolicy.h), spelled out so the build
 * needs no kernel headers. */
#define FP_MPOL_PREFERRED 1

/* Makes the pages of the fresh mapping prefer `node`, before anything touches
 * them: cuMemHostRegister populates them all, the copy threads fault in the
 * rest. Preferred, not bound: a node short of memory spills to another rather
 * than failing registration or waking the OOM killer. Failure leaves the
 * default policy and numa_node -1; the arena works as before. */
static void fp_arena_bind(fp_arena_t *a, int node, uint64_t map_size)
{
    if (node < 0 || node >= FP_NUMA_MAX_NODES)
        return;
    enum { BITS = 8 * sizeof(unsigned long) };
    unsigned long mask[FP_NUMA_MAX_NODES / BITS] = {0};
    mask[node / BITS] = 1ul << (node % BITS);
    /* maxnode is one more than the bits the kernel reads (it drops one). */
    if (syscall(SYS_mbind, (void *)a->meta, (unsigned long)map_size, FP_MPOL_PREFERRED, mask,
                (unsigned long)FP_NUMA_MAX_NODES + 1, 0u) == 0)
        a->numa_node = node;
}

/* A token no other live arena has: from the kernel, or, should it refuse,
 * mixed from the clock, the pid and an address. */
static uint64_t fp_arena_new_token(const void *salt)
{
    uint64_t t = 0;
    if (getrandom(&t, sizeof t, GRND_NONBLOCK) != (ssize_t)sizeof t) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        t = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ ((uint64_t)getpid() << 40) ^
            (uint64_t)(uintptr_t)salt;
        t *= 0x9e3779b97f4a7c15ull;
    }
    return t ? t : 1;
}

static int fp_arena_init_meta(fp_arena_t *a, uint64_t capacity, uint32_t max_blocks,
                              uint64_t data_offset, uint64_t map_size)
{
    fp_arena_meta_t *m = a->meta;
    m->capacity = capacity;
    m->data_offset = data_offset;
    m->map_size = map_size;
    m->max_blocks = max_blocks;
    m->token = fp_arena_new_token(m);
    m->returned = FP_NIL;
    m->draining = m->draining_one = FP_NIL;
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
    a->tickets = calloc(a->meta->max_blocks, sizeof *a->tickets);
    if (!a->events || !a->tickets) {
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
    fp_atomic_store_release(&a->meta->resident, 1u);
    return FP_OK;
fail:
    fp_cuda_context_release(device);
    return status;
}

int fp_arena_create(fp_arena_t **out, uint64_t capacity, uint32_t max_blocks,
                    int flags, int device)
{
    return fp_arena_create_numa(out, capacity, max_blocks, flags, device, -1);
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
    if (max_blocks == 0) {
        uint64_t by_size = capacity / FP_GRANULE + 1;
        max_blocks = by_size < FP_DEFAULT_MAX_BLOCKS ? (uint32_t)by_size : FP_DEFAULT_MAX_BLOCKS;
    }
    if (max_blocks < 2)
        max_blocks = 2;
    if (max_blocks == FP_NIL)
        max_blocks = FP_NIL - 1; /* FP_NIL is never an index */
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
    a->numa_node = -1;
    a->pid = getpid();
    int status = fp_arena_map(a, map_size);
    if (status)
        goto fail;
    fp_arena_bind(a, numa_node, map_size); /* before init_meta touches a page */
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
    free(a->tickets);
    free(a);
    return status;
}

/* Checks the header of a mapping of `map_size` bytes from `fd`. */
static int fp_arena_check_meta(const fp_arena_meta_t *m, uint64_t map_size, int fd)
{
    if (m->magic != FP_ARENA_MAGIC)
        return fp_error_set(FP_EINVAL,
                            "fd %d does not hold a fastpin arena of this version "
                            "(magic %#llx, expected %#llx)",
                            fd, (unsigned long long)m->magic, (unsigned long long)FP_ARENA_MAGIC);
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
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
    struct stat st;
    if (fstat(fd, &st) != 0)
        return fp_error_set(FP_EOS, "fstat of arena fd %d: %s", fd, strerror(errno));
    if (!S_ISREG(st.st_mode) || (uint64_t)st.st_size < sizeof(fp_arena_meta_t))
        return fp_error_set(FP_EINVAL, "fd %d does not hold a fastpin arena (%s of %lld bytes)",
                            fd, S_ISREG(st.st_mode) ? "a file" : "not a file",
                            (long long)st.st_size);
    uint64_t map_size = (uint64_t)st.st_size;
    fp_arena_t *a = calloc(1, sizeof *a);
    if (!a)
        return fp_error_set(FP_EOS, "out of host memory");
    a->refcount = 1;
    a->flags = FP_ARENA_SHARED | FP_ARENA_NO_CUDA;
    a->fd = -1;
    a->device = -1;
    a->numa_node = -1;
    a->attached = 1;
    a->pid = getpid();
    int status = FP_OK;
    void *p = mmap(NULL, map_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        status = fp_error_set(FP_EOS, "mmap of the arena in fd %d (%llu bytes): %s", fd,
                              (unsigned long long)map_size, strerror(errno));
        goto fail;
    }
    a->meta = p;
    status = fp_arena_check_meta(a->meta, map_size, fd);
    if (status)
        goto fail;
    a->data = (char *)p + a->meta->data_offset;
    /* Our own descriptor: the caller may close theirs. */
    a->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (a->fd < 0) {
        status = fp_error_set(FP_EOS, "dup of arena fd %d: %s", fd, strerror(errno));
        goto fail;
    }
    *out = a;
    return FP_OK;
fail:
    if (a->meta)
        munmap(a->meta, map_size);
    free(a);
    return status;
}

/* The kernel's MADV_POPULATE_WRITE (Linux 5.14), spelled out for older headers. */
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

int fp_arena_prefault(fp_arena_t *a)
{
    if (!a->attached || !fp_atomic_load_relaxed(&a->meta->resident))
        return 0;
    /* One pass of the kernel over the page tables instead of a trap per 4 KiB
     * page the first time this process writes each block: the pages exist
     * (registration made them resident), so nothing is allocated. Old
     * kernels (EINVAL) keep faulting on demand. */
    return madvise(a->data, a->meta->capacity, MADV_POPULATE_WRITE) == 0;
}

void fp_arena_incref(fp_arena_t *a) { fp_atomic_add_acq_rel(&a->refcount, 1); }

void fp_arena_decref(fp_arena_t *a)
{
    if (fp_atomic_sub_acq_rel(&a->refcount, 1) != 0)
        return;
    int here = a->pid == getpid();
    if (a->registered && here) {
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
    /* The lock of a shared arena outlives this mapping: another process may
     * hold it, and glibc's destroy marks it unusable for every process. */
    if (!(a->flags & FP_ARENA_SHARED) && here)
        pthread_mutex_destroy(&a->meta->lock);
    munmap(a->meta, a->meta->map_size);
    if (a->fd >= 0)
        close(a->fd);
    free(a->events);
    free(a->tickets);
    free(a);
}

/* ---- allocation -------------------------------------------------------- */

/* Makes sure a block about to be handed out in home has its event; under lock. */
static int fp_arena_arm(fp_arena_t *a, uint32_t b, int home)
{
    if (!home || !a->registered || a->events[b])
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

static int fp_arena_broken_error(void)
{
    return fp_error_set(FP_EINVAL, "the arena's metadata was damaged by a process that died "
                                   "holding its lock; make a new arena");
}

int fp_arena_alloc(fp_arena_t *a, uint64_t size, uint32_t *block, void **ptr)
{
    fp_arena_meta_t *m = a->meta;
    uint64_t rounded = size > m->capacity ? 0 : fp_arena_round(size);
    /* A request that fits the cap but rounds past it (the cap is not a class
     * size) takes the whole arena, when it is all free. */
    if (rounded > m->capacity)
        rounded = m->capacity;
    if (!rounded) {
        fp_arena_lock(a);
        m->failed++;
        fp_arena_unlock(a);
        return fp_error_set(FP_ETOOBIG,
                            "asked for %llu bytes, more than the arena's cap of %llu bytes",
                            (unsigned long long)size, (unsigned long long)m->capacity);
    }
    pid_t self = getpid();
    if (!(a->flags & FP_ARENA_SHARED) && a->pid != self)
        /* A forked child maps the creator's pages: its blocks would be
         * lost with it. fastpin.default_arena() makes the child its own. */
        return fp_error_set(FP_EINVAL,
                            "this arena belongs to process %d, which this one was forked "
                            "from; make an arena in this process",
                            (int)a->pid);
    int home = !a->attached && a->pid == self;
    int status = FP_OK;
    fp_arena_lock(a);
    if (m->broken) {
        status = fp_arena_broken_error();
        goto done;
    }
    fp_pending_collect(a, 0);
    uint32_t b = fp_block_take(m, rounded, size, self);
    while (b == FP_NIL) {
        fp_pending_collect(a, 1);
        b = fp_block_take(m, rounded, size, self);
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
        if (!home || !a->registered) {
            /* What is left waits on GPU copies only the creator can see end. */
            m->failed++;
            status = fp_error_set(FP_ENOMEM,
                                  "the arena is full for this process: asked for %llu bytes, "
                                  "%llu of its %llu bytes are held by %u blocks, %u of them "
                                  "waiting on GPU copies that only the creating process tracks",
                                  (unsigned long long)size, (unsigned long long)m->bytes_in_use,
                                  (unsigned long long)m->capacity, m->blocks_in_use,
                                  m->blocks_pending);
            goto done;
        }
        uint32_t head = m->pending_head, fence = m->blocks[head].armed;
        if (fence == FP_FENCE_DEFERRED || (fence == FP_FENCE_TICKET && fp_cuda_captures())) {
            /* Its fence waits for a graph capture to end, and the capturing
             * thread may be this one: do not wait. */
            m->failed++;
            status = fp_error_set(FP_ENOMEM,
                                  "the arena is full: asked for %llu bytes, %llu of its %llu bytes "
                                  "are held by blocks freed while a CUDA graph capture is under "
                                  "way, reusable once it ends",
                                  (unsigned long long)size, (unsigned long long)m->bytes_in_use,
                                  (unsigned long long)m->capacity);
            goto done;
        }
        /* Only blocks still read by the GPU stand in the way: wait for the
         * oldest outside the lock. Its event stays valid meanwhile: the
         * block is reused only after home retires it under the lock. */
        fp_cu_event_t ev = a->events[head];
        uint64_t ticket = a->tickets[head];
        m->waits++;
        fp_arena_unlock(a);
        if (fence == FP_FENCE_TICKET) {
            fp_cuda_ticket_wait(a->ctx, ticket);
        } else if (fp_cuda.cuCtxPushCurrent(a->ctx) == FP_CUDA_SUCCESS) {
            FP_CU_IGNORE(cuEventSynchronize(ev));
            fp_cu_context_t popped;
            FP_CU_IGNORE(cuCtxPopCurrent(&popped));
        }
        fp_arena_lock(a);
    }
    status = fp_arena_arm(a, b, home);
    if (status) {
        fp_block_release(m, b);
        goto done;
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
    *block = b;
    *ptr = a->data + blk->offset;
done:
    FP_ARENA_ASSERT_VALID(a);
    fp_arena_unlock(a);
    return status;
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

void fp_arena_collect(fp_arena_t *a)
{
    fp_arena_lock(a);
    fp_pending_collect(a, 1);
    fp_arena_unlock(a);
}

/* ---- other processes --------------------------------------------------- */

enum { FP_RECLAIM_PIDS = 128 }; /* owners judged per call; the rest wait a call */

static int fp_pid_in(const pid_t *pids, uint32_t n, pid_t pid)
{
    for (uint32_t i = 0; i < n; i++)
        if (pids[i] == pid)
            return 1;
    return 0;
}

uint32_t fp_arena_reclaim(fp_arena_t *a)
{
    fp_arena_meta_t *m = a->meta;
    pid_t self = getpid(), dead[FP_RECLAIM_PIDS], alive[FP_RECLAIM_PIDS];
    uint32_t ndead = 0, nalive = 0, freed = 0;
    fp_arena_lock(a);
    /* Judge the owners before draining the return stack: a process found
     * dead made its last push before, so the drain takes every block it
     * freed, and what it still holds afterwards nobody will free. A zombie
     * still answers kill(): its blocks wait until it is reaped. */
    for (uint32_t b = m->broken ? FP_NIL : 0; b != FP_NIL; b = m->blocks[b].phys_next) {
        pid_t owner = m->blocks[b].owner;
        if (m->blocks[b].state != FP_BLOCK_USED || owner <= 0 || owner == self ||
            fp_pid_in(dead, ndead, owner) || fp_pid_in(alive, nalive, owner))
            continue;
        if (kill(owner, 0) == -1 && errno == ESRCH) {
            if (ndead < FP_RECLAIM_PIDS)
                dead[ndead++] = owner;
        } else if (nalive < FP_RECLAIM_PIDS) {
            alive[nalive++] = owner;
        }
    }
    if (ndead) {
        fp_pending_drain(a);
        for (uint32_t b = 0; b != FP_NIL; b = m->blocks[b].phys_next) {
            fp_block_t *blk = &m->blocks[b];
            if (blk->state != FP_BLOCK_USED || !fp_pid_in(dead, ndead, blk->owner))
                continue;
            m->bytes_in_use -= blk->size;
            m->bytes_requested -= blk->requested;
            m->blocks_in_use--;
            m->class_blocks[blk->cls]--;
            FP_CRASH_POINT();
            /* Merges never reach past the next allocated block: go on from
             * the free block that now covers this one. */
            b = fp_block_release(m, b);
            freed++;
        }
        m->reclaimed += freed;
    }
    FP_ARENA_ASSERT_VALID(a);
    fp_arena_unlock(a);
    return freed;
}

void fp_arena_count_fallback(fp_arena_t *a) { fp_atomic_add_acq_rel(&a->meta->fallbacks, 1); }

int fp_arena_owner(fp_arena_t *a, uint32_t b, pid_t *owner)
{
    fp_arena_meta_t *m = a->meta;
    int status = FP_OK;
    if (b >= m->max_blocks)
        return fp_error_set(FP_EINVAL, "block %u is out of range (the arena has %u descriptors)",
                            b, m->max_blocks);
    fp_arena_lock(a);
    uint32_t state = m->blocks[b].state;
    if (state == FP_BLOCK_USED || state == FP_BLOCK_PENDING)
        *owner = m->blocks[b].owner;
    else
        status = fp_error_set(FP_EINVAL, "block %u is not allocated", b);
    fp_arena_unlock(a);
    return status;
}

/* ---- queries ----------------------------------------------------------- */

void fp_arena_stats(fp_arena_t *a, fp_arena_stats_t *s)
{
    fp_arena_meta_t *m = a->meta;
    pid_t self = getpid();
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
    s->lock_recoveries = m->lock_recoveries;
    s->reclaimed = m->reclaimed;
    s->blocks_in_use = m->blocks_in_use;
    s->blocks_pending = m->blocks_pending;
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
}

uint64_t fp_arena_capacity(const fp_arena_t *a) { return a->meta->capacity; }
int fp_arena_registered(const fp_arena_t *a) { return fp_arena_cuda(a); }
void *fp_arena_base(const fp_arena_t *a) { return a->data; }
fp_cu_context_t fp_arena_context(const fp_arena_t *a) { return fp_arena_cuda(a) ? a->ctx : NULL; }
int fp_arena_fd(const fp_arena_t *a) { return a->fd; }
uint64_t fp_arena_token(const fp_arena_t *a) { return a->meta->token; }
int fp_arena_attached(const fp_arena_t *a) { return a->attached; }
int fp_arena_numa_node(const fp_arena_t *a) { return a->numa_node; }
int fp_arena_device(const fp_arena_t *a) { return fp_arena_cuda(a) ? a->device : -1; }

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
    FP_CHECK(!m->broken);
    /* Drains finish inside one critical section (or repair ends them). */
    FP_CHECK(m->draining == FP_NIL && m->draining_one == FP_NIL);
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
            FP_CHECK(blk->cls < FP_CLASS_COUNT && blk->owner >= 0);
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

static fp_lease_t *fp_lease_new(fp_arena_t *a, uint32_t b, char *ptr, uint64_t size)
{
    fp_lease_t *lease = malloc(sizeof *lease);
    if (!lease)
        return NULL;
    fp_arena_incref(a);
    lease->refcount = 1;
    lease->detached = 0;
    lease->pid = getpid();
    lease->arena = a;
    lease->block = b;
    lease->ptr = ptr;
    lease->size = size;
    /* Any stream of the device may copy from a block the user holds. */
    lease->consumer = fp_arena_cuda(a) ? FP_STREAM_ANY : NULL;
    return lease;
}

int fp_lease_alloc(fp_arena_t *a, uint64_t size, fp_lease_t **out)
{
    *out = NULL;
    uint32_t b;
    void *ptr;
    int status = fp_arena_alloc(a, size, &b, &ptr);
    if (status)
        return status;
    fp_lease_t *lease = fp_lease_new(a, b, ptr, size);
    if (!lease) {
        fp_arena_free(a, b, NULL);
        return fp_error_set(FP_EOS, "out of host memory");
    }
    /* Nobody else knows the index yet: no lock needed to mark it held. */
    fp_atomic_store_release(&a->meta->blocks[b].leased, 1);
    *out = lease;
    return FP_OK;
}

int fp_lease_adopt(fp_arena_t *a, uint32_t b, uint64_t size, fp_lease_t **out)
{
    *out = NULL;
    fp_arena_meta_t *m = a->meta;
    if (!fp_arena_home(a))
        return fp_error_set(FP_EINVAL, "blocks are adopted only by the process that created "
                                       "the arena");
    if (b >= m->max_blocks)
        return fp_error_set(FP_EINVAL, "cannot adopt block %u: out of range (the arena has %u "
                                       "descriptors)", b, m->max_blocks);
    int status = FP_OK;
    char *ptr = NULL;
    fp_arena_lock(a);
    fp_block_t *blk = &m->blocks[b];
    /* A block its owner freed may still sit on the return stack, looking
     * allocated: drain, so it shows as pending. */
    if (!m->broken)
        fp_pending_drain(a);
    if (m->broken)
        status = fp_arena_broken_error();
    else if (blk->state != FP_BLOCK_USED)
        status = fp_error_set(FP_EINVAL, "cannot adopt block %u: it is not allocated (freed, "
                                         "reclaimed, or never handed out)", b);
    else if (blk->owner == 0)
        status = fp_error_set(FP_EINVAL, "cannot adopt block %u: it was already adopted", b);
    else if (fp_atomic_load_acquire(&blk->leased))
        status = fp_error_set(FP_EINVAL, "cannot adopt block %u: process %d still holds it "
                                         "(not detached)", b, (int)blk->owner);
    else if (blk->requested != size)
        status = fp_error_set(FP_EINVAL, "cannot adopt block %u as %llu bytes: it was allocated "
                                         "for %llu", b, (unsigned long long)size,
                              (unsigned long long)blk->requested);
    else
        status = fp_arena_arm(a, b, 1);
    if (!status) {
        blk->owner = 0;
        ptr = a->data + blk->offset;
    }
    FP_ARENA_ASSERT_VALID(a);
    fp_arena_unlock(a);
    if (status)
        return status;
    fp_lease_t *lease = fp_lease_new(a, b, ptr, size);
    if (!lease) {
        fp_arena_free(a, b, NULL); /* ours now, and nobody else will free it */
        return fp_error_set(FP_EOS, "out of host memory");
    }
    *out = lease;
    return FP_OK;
}

int fp_lease_detach(fp_lease_t *lease)
{
    fp_block_t *blk = &lease->arena->meta->blocks[lease->block];
    if (lease->pid != getpid())
        return fp_error_set(FP_EINVAL, "block %u belongs to the process this one was forked "
                                       "from: only it can give the block up", lease->block);
    /* Once given up, the block may have been adopted and reused: hands off. */
    if (fp_atomic_load_acquire(&lease->detached))
        return FP_OK;
    /* The owner cannot change while we hold the block: adopt wants it detached. */
    if (blk->owner == 0)
        return fp_error_set(FP_EINVAL, "block %u was adopted: it stays with this process",
                            lease->block);
    fp_atomic_store_release(&lease->detached, 1);
    fp_atomic_store_release(&blk->leased, 0);
    return FP_OK;
}

void fp_lease_incref(fp_lease_t *lease) { fp_atomic_add_acq_rel(&lease->refcount, 1); }

void fp_lease_decref(fp_lease_t *lease)
{
    if (fp_atomic_sub_acq_rel(&lease->refcount, 1) != 0)
        return;
    /* A detached block is its adopter's; a lease copied into a forked child
     * names the parent's block, which the parent frees. */
    if (!fp_atomic_load_acquire(&lease->detached) && lease->pid == getpid())
        fp_arena_free(lease->arena, lease->block, lease->consumer);
    fp_arena_decref(lease->arena);
    free(lease);
}

/* ---- test hooks -------------------------------------------------------- */

#ifdef FP_TEST
void fp_arena_test_lock(fp_arena_t *a) { fp_arena_lock(a); }

void fp_arena_test_free_armed(fp_arena_t *a, uint32_t b) { fp_return_push(a->meta, b, 1); }

void fp_arena_test_mark_resident(fp_arena_t *a) { fp_atomic_store_release(&a->meta->resident, 1u); }

uint64_t fp_arena_test_block_size(fp_arena_t *a, uint32_t b)
{
    fp_arena_meta_t *m = a->meta;
    if (b >= m->max_blocks)
        return 0;
    fp_arena_lock(a);
    uint32_t state = m->blocks[b].state;
    uint64_t size = state == FP_BLOCK_USED || state == FP_BLOCK_PENDING ? m->blocks[b].size : 0;
    fp_arena_unlock(a);
    return size;
}
#endif
