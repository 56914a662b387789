/* The allocator on offsets alone: a two-level segregated-fit allocator (TLSF)
 * over the metadata of one arena. It knows no process, no CUDA and no lock;
 * every function here runs under the arena's lock (arena.c).
 *
 * Sizes are rounded up to a class boundary: 256-byte steps below 4 KiB, then
 * 16 classes per power of two, so a block above 4 KiB wastes less than 1/17
 * (5.9%) of itself. A free block of size S sits on the list of the class S
 * falls in; a rounded request R is a class's lower bound, so any block on a
 * list of class >= class(R) fits, and two bitmaps find one in O(1). Freed
 * blocks merge with free neighbours in address order, also O(1).
 *
 * Every store that changes the physical chain is ordered for death under the
 * lock (see arena_internal.h): the crash points mark where a test kills the
 * process, and fp_arena_repair rebuilds what each one leaves. */
#include <string.h>

#include "arena_internal.h"

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

uint64_t fp_arena_class_size(uint32_t cls)
{
    if (cls < FP_SL_COUNT)
        return (uint64_t)cls * FP_GRANULE;
    return (uint64_t)(FP_SL_COUNT + cls % FP_SL_COUNT) * FP_GRANULE << (cls / FP_SL_COUNT - 1);
}

/* ---- free lists -------------------------------------------------------- */

void fp_tlsf_insert(fp_arena_meta_t *m, uint32_t b)
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

static void fp_tlsf_remove(fp_arena_meta_t *m, uint32_t b)
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
static uint32_t fp_tlsf_find(fp_arena_meta_t *m, uint64_t rounded)
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

void fp_tlsf_clear_lists(fp_arena_meta_t *m)
{
    m->fl_bitmap = 0;
    memset(m->sl_bitmap, 0, sizeof m->sl_bitmap);
    for (uint32_t c = 0; c < FP_CLASS_COUNT; c++)
        m->heads[c] = FP_NIL;
}

static uint32_t fp_tlsf_spare_take(fp_arena_meta_t *m)
{
    uint32_t b = m->spare;
    if (b != FP_NIL)
        m->spare = m->blocks[b].next;
    return b;
}

void fp_tlsf_spare_put(fp_arena_meta_t *m, uint32_t b)
{
    m->blocks[b].state = FP_BLOCK_SPARE;
    m->blocks[b].next = m->spare;
    m->spare = b;
}

void fp_tlsf_init(fp_arena_meta_t *m, uint64_t capacity, uint32_t max_blocks)
{
    fp_tlsf_clear_lists(m);
    /* Descriptor 0 is the whole region; the rest are spare. Block 0 stays
     * the lowest block forever: merges keep the lower descriptor. */
    m->spare = FP_NIL;
    for (uint32_t b = max_blocks; b-- > 1;)
        fp_tlsf_spare_put(m, b);
    m->blocks[0] = (fp_block_t){.offset = 0, .size = capacity,
                                .phys_prev = FP_NIL, .phys_next = FP_NIL};
    fp_tlsf_insert(m, 0);
}

/* ---- blocks ------------------------------------------------------------ */

/* Cuts free block `b` (off its list) down to `rounded` bytes, the rest going
 * to spare descriptor `s` on its own list. */
static void fp_tlsf_split(fp_arena_meta_t *m, uint32_t b, uint32_t s, uint64_t rounded)
{
    fp_block_t *blk = &m->blocks[b], *rest = &m->blocks[s];
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
    fp_tlsf_insert(m, s);
    FP_CRASH_POINT();
}

uint32_t fp_tlsf_take(fp_arena_meta_t *m, uint64_t rounded, uint64_t size, pid_t owner)
{
    uint32_t b = fp_tlsf_find(m, rounded);
    /* Only a request clamped to the cap is not a class size: the head of its
     * class's list may then be smaller than it. */
    if (b == FP_NIL || m->blocks[b].size < rounded)
        return FP_NIL;
    fp_tlsf_remove(m, b);
    FP_CRASH_POINT();
    fp_block_t *blk = &m->blocks[b];
    if (blk->size > rounded) {
        uint32_t s = fp_tlsf_spare_take(m);
        FP_CRASH_POINT();
        if (s != FP_NIL)
            fp_tlsf_split(m, b, s, rounded);
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

/* Block `upper`, just above free block `lower` in address order, joins it:
 * `lower` grows over it and the chain skips it by a single store; `upper`'s
 * descriptor goes spare. */
static void fp_tlsf_absorb(fp_arena_meta_t *m, uint32_t lower, uint32_t upper)
{
    fp_block_t *lo = &m->blocks[lower], *up = &m->blocks[upper];
    lo->size += up->size;
    fp_atomic_signal_fence_seq_cst();
    FP_CRASH_POINT();
    lo->phys_next = up->phys_next;
    fp_atomic_signal_fence_seq_cst();
    FP_CRASH_POINT();
    if (lo->phys_next != FP_NIL)
        m->blocks[lo->phys_next].phys_prev = lower;
    FP_CRASH_POINT();
    fp_tlsf_spare_put(m, upper);
    FP_CRASH_POINT();
}

/* Each merge changes the chain by a single store (a link that skips the
 * absorbed block). */
uint32_t fp_tlsf_release(fp_arena_meta_t *m, uint32_t b)
{
    fp_block_t *blk = &m->blocks[b];
    uint32_t prev = blk->phys_prev, next = blk->phys_next;
    if (next != FP_NIL && m->blocks[next].state == FP_BLOCK_FREE) {
        fp_tlsf_remove(m, next);
        FP_CRASH_POINT();
        fp_tlsf_absorb(m, b, next);
    }
    if (prev != FP_NIL && m->blocks[prev].state == FP_BLOCK_FREE) {
        fp_tlsf_remove(m, prev);
        FP_CRASH_POINT();
        fp_tlsf_absorb(m, prev, b);
        b = prev;
    }
    fp_tlsf_insert(m, b);
    FP_CRASH_POINT();
    return b;
}
