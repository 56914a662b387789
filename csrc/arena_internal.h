/* The arena's insides, shared by the files that make it up (not part of the
 * core's API: fastpin.h is). After mimalloc's prim split:
 *
 *   tlsf.c    the allocator on offsets alone: size classes, free lists,
 *             block take/release over the metadata (fp_arena_meta_t); no
 *             process, no CUDA, no lock
 *   prim.c    the OS layer: mappings, memfd and seals, mbind, getrandom,
 *             prefault, and which process this is
 *   arena.c   one arena in one process (fp_arena_t): create and attach, the
 *             lock, alloc and deferred free, the blocks of other processes,
 *             stats
 *   repair.c  the metadata's invariants: the checker, and the repair after
 *             a process died holding the lock
 *   lease.c   counted holds on blocks, adoption across processes
 *
 * The metadata (lock, bitmaps, list heads, the block descriptor table) sits
 * in the first pages of the mapping and holds only offsets and indices, so
 * the same arena can live in memory shared between processes. CUDA events
 * are per process and live beside it in fp_arena_t.
 *
 * Death under the lock. The lock is robust: a process may die anywhere in a
 * critical section. Updates are ordered so that after any prefix of their
 * stores the physical chain (block 0, then phys_next links, each block's
 * offset) still partitions the region, and a block's state changes only
 * after the fields it vouches for. Sizes, lists, bitmaps and counters follow
 * from the chain and the states, and the next locker rebuilds them
 * (fp_arena_repair). A drain of the return stack keeps a journal in the
 * metadata, so the blocks it holds in hand are not lost. */
#ifndef FASTPIN_ARENA_INTERNAL_H
#define FASTPIN_ARENA_INTERNAL_H

#include <signal.h>

#include "fastpin.h"

#define FP_ARENA_MAGIC 0x3230706e74736166ull /* "fastpn02" */

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
    uint64_t map_size;     /* bytes mapped at meta (0: nothing mapped yet); constant */
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
    return !a->attached && fp_same_process(a->pid);
}

/* CUDA may be used on this arena in this process (never in a forked copy). */
static inline int fp_arena_cuda(const fp_arena_t *a)
{
    return a->registered && fp_same_process(a->pid);
}

/* ---- the allocator on offsets (tlsf.c; all under the arena's lock) ------ */

/* Descriptor 0 becomes the whole region of `capacity` bytes, the rest spare. */
void fp_tlsf_init(fp_arena_meta_t *m, uint64_t capacity, uint32_t max_blocks);
/* Empties every free list and both bitmaps (repair refills them). */
void fp_tlsf_clear_lists(fp_arena_meta_t *m);
/* Puts free block `b` on the list of its class. */
void fp_tlsf_insert(fp_arena_meta_t *m, uint32_t b);
/* Puts descriptor `b` on the spare list. */
void fp_tlsf_spare_put(fp_arena_meta_t *m, uint32_t b);
/* Takes a block of exactly `rounded` bytes (or the whole block when no spare
 * descriptor is left to split it) for `owner`, who asked for `size`; FP_NIL
 * when nothing fits. */
uint32_t fp_tlsf_take(fp_arena_meta_t *m, uint64_t rounded, uint64_t size, pid_t owner);
/* Returns a block to the free lists, merging it with free neighbours; returns
 * the free block that now covers it. */
uint32_t fp_tlsf_release(fp_arena_meta_t *m, uint32_t b);

/* ---- the OS layer (prim.c) -------------------------------------------- */

uint64_t fp_prim_page_size(void);
/* A shared mapping of `size` bytes: behind a new sealed memfd (*fd >= 0) when
 * `with_fd`, else anonymous (*fd = -1). On failure *fd and *out may still
 * hold what was made; the caller's teardown releases them. */
int fp_prim_map_new(uint64_t size, int with_fd, int *fd, void **out);
void fp_prim_unmap(void *p, uint64_t size);
/* Maps `size` bytes of the file behind `fd`, shared. */
int fp_prim_map_fd(int fd, uint64_t size, void **out);
/* The size of the regular file behind `fd`, checked to hold at least
 * `at_least` bytes. */
int fp_prim_fd_size(int fd, uint64_t at_least, uint64_t *size);
/* A descriptor of our own for `fd` (close-on-exec). */
int fp_prim_dup(int fd, int *out);
/* Makes the pages of [p, p + size) prefer NUMA node `node`, before anything
 * touches them; returns 1 when the kernel agreed. */
int fp_prim_bind(void *p, uint64_t size, int node);
/* The NUMA node of the CPU this thread runs on now; -1 if the kernel will not say. */
int fp_prim_current_node(void);
/* A random non-zero 64-bit value, mixed from `salt` and the clock should the
 * kernel refuse. */
uint64_t fp_prim_random(const void *salt);
/* Maps every page of [p, p + size) now, writable; 1 when the kernel did. */
int fp_prim_populate(void *p, uint64_t size);

/* ---- the arena in this process (arena.c) ------------------------------ */

/* fp_prim_populate over [p, p + size) split among up to `threads` threads
 * (the caller one of them), each a whole number of 2 MiB; 1 when every slice
 * was populated. A thread that cannot be made leaves its slice to the caller. */
int fp_populate_parallel(void *p, uint64_t size, int threads);

/* Takes the lock, repairing the metadata first when its last holder died;
 * FP_EOS (the lock cannot be had, and is not held) otherwise. */
int fp_arena_lock(fp_arena_t *a);
void fp_arena_unlock(fp_arena_t *a);
/* The return stack onto the pending list; under lock. */
void fp_arena_drain(fp_arena_t *a);
/* Makes sure a block about to be handed out in home has its event; under lock. */
int fp_arena_arm(fp_arena_t *a, uint32_t b, int home);
/* FP_EINVAL: the metadata is damaged past repair. */
int fp_arena_broken_error(void);

/* ---- invariants and repair (repair.c; under lock) ---------------------- */

/* Rebuilds the metadata after a process died holding the lock. */
void fp_arena_repair(fp_arena_t *a);
/* Checks every invariant; 1 when valid, else 0 with the message set. */
int fp_arena_is_valid_locked(fp_arena_t *a);

#ifdef FP_DEBUG
#include <assert.h>
#define FP_ARENA_ASSERT_VALID(a) assert(fp_arena_is_valid_locked(a))
#else
#define FP_ARENA_ASSERT_VALID(a) ((void)0)
#endif

#endif /* FASTPIN_ARENA_INTERNAL_H */
