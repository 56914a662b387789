/* What the arena's metadata must satisfy, checked (fp_arena_is_valid) and,
 * after a process died holding the lock, restored (fp_arena_repair).
 *
 * The truth after a death is the physical chain from block 0 and each
 * block's state (see arena_internal.h); sizes, lists, bitmaps and counters
 * are derived from them again, in steps that may each be cut short by a
 * second death: the next locker then repairs from the start, and every step
 * gives the same result when run again. */
#include <string.h>

#include "arena_internal.h"

/* ---- repair ------------------------------------------------------------ */

/* Blocks a dead drainer held in hand were freed by their owners: they become
 * pending. A journal whose head is still on the return stack was written but
 * never taken, and names blocks that are still on the stack. */
static void fp_repair_journal(fp_arena_meta_t *m)
{
    uint32_t n = m->max_blocks;
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
}

/* Walks the chain, setting each block's size from its neighbour's offset and
 * joining free neighbours (a split or merge cut short); `prev` marks the
 * descriptors left on it (the lists are rebuilt later). Offsets must rise by
 * granules up to the capacity: 0 when they do not (the chain is broken). */
static int fp_repair_chain(fp_arena_meta_t *m)
{
    uint32_t n = m->max_blocks;
    for (uint32_t b = 0; b < n; b++)
        m->blocks[b].prev = 0;
    uint32_t last = FP_NIL;
    for (uint32_t b = 0; b != FP_NIL;) {
        fp_block_t *blk = &m->blocks[b];
        uint32_t next = blk->phys_next;
        uint64_t end = next == FP_NIL ? m->capacity : next < n ? m->blocks[next].offset : 0;
        if ((b == 0 && blk->offset != 0) || end <= blk->offset || end > m->capacity ||
            end % FP_GRANULE || blk->state > FP_BLOCK_PENDING)
            return 0;
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
    return 1;
}

/* Every descriptor off the chain is spare. */
static void fp_repair_spares(fp_arena_meta_t *m)
{
    m->spare = FP_NIL;
    for (uint32_t b = m->max_blocks; b-- > 0;)
        if (!m->blocks[b].prev)
            fp_tlsf_spare_put(m, b);
    FP_CRASH_POINT();
}

/* The free lists, the pending list and the counters, from the chain: 0 when
 * an allocated block's fields do not add up (the metadata is broken). */
static int fp_repair_lists(fp_arena_meta_t *m)
{
    fp_tlsf_clear_lists(m);
    fp_atomic_store_relaxed(&m->pending_head, FP_NIL);
    m->pending_tail = FP_NIL;
    m->bytes_in_use = m->bytes_requested = m->bytes_pending = 0;
    m->blocks_in_use = m->blocks_pending = 0;
    memset(m->class_blocks, 0, sizeof m->class_blocks);
    for (uint32_t b = 0; b != FP_NIL; b = m->blocks[b].phys_next) {
        fp_block_t *blk = &m->blocks[b];
        FP_CRASH_POINT();
        if (blk->state == FP_BLOCK_FREE) {
            fp_tlsf_insert(m, b);
            continue;
        }
        if (blk->cls >= FP_CLASS_COUNT || blk->requested > blk->size)
            return 0;
        if (blk->state == FP_BLOCK_PENDING) {
            blk->next = FP_NIL;
            if (m->pending_tail == FP_NIL)
                fp_atomic_store_relaxed(&m->pending_head, b);
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
    return 1;
}

/* Pushers may go on pushing meanwhile: nothing here touches `next` or
 * `armed` of an allocated block. */
void fp_arena_repair(fp_arena_t *a)
{
    fp_arena_meta_t *m = a->meta;
    fp_repair_journal(m);
    if (!fp_repair_chain(m)) {
        m->broken = 1;
        return;
    }
    fp_repair_spares(m);
    if (!fp_repair_lists(m))
        m->broken = 1;
}

/* ---- invariants -------------------------------------------------------- */

#define FP_CHECK(cond)                                                   \
    do {                                                                 \
        if (!(cond)) {                                                   \
            fp_error_set(FP_EINVAL, "arena invariant broken: %s", #cond); \
            return 0;                                                    \
        }                                                                \
    } while (0)

/* What the address-ordered chain adds up to. */
typedef struct fp_tally_s {
    uint64_t in_use, requested, pending_bytes;
    uint32_t nblocks, nfree, nused, npending;
    uint32_t per_class[FP_CLASS_COUNT];
} fp_tally_t;

/* The chain covers the region exactly once, and its blocks add up to the
 * counters. */
static int fp_valid_chain(const fp_arena_meta_t *m, fp_tally_t *t)
{
    uint64_t offset = 0;
    for (uint32_t b = 0, prev = FP_NIL; b != FP_NIL; prev = b, b = m->blocks[b].phys_next) {
        const fp_block_t *blk = &m->blocks[b];
        FP_CHECK(++t->nblocks <= m->max_blocks);
        FP_CHECK(blk->phys_prev == prev);
        FP_CHECK(blk->offset == offset);
        FP_CHECK(blk->size > 0 && blk->size % FP_GRANULE == 0);
        FP_CHECK(blk->state != FP_BLOCK_SPARE);
        if (blk->state == FP_BLOCK_FREE) {
            t->nfree++;
            FP_CHECK(prev == FP_NIL || m->blocks[prev].state != FP_BLOCK_FREE);
        } else {
            t->nused++;
            t->in_use += blk->size;
            t->requested += blk->requested;
            FP_CHECK(blk->requested <= blk->size);
            FP_CHECK(blk->cls < FP_CLASS_COUNT && blk->owner >= 0);
            t->per_class[blk->cls]++;
            if (blk->state == FP_BLOCK_PENDING) {
                t->npending++;
                t->pending_bytes += blk->size;
            }
        }
        offset += blk->size;
    }
    FP_CHECK(offset == m->capacity);
    FP_CHECK(t->in_use == m->bytes_in_use && t->requested == m->bytes_requested);
    FP_CHECK(t->nused == m->blocks_in_use && t->npending == m->blocks_pending);
    FP_CHECK(t->pending_bytes == m->bytes_pending);
    FP_CHECK(memcmp(t->per_class, m->class_blocks, sizeof t->per_class) == 0);
    FP_CHECK(m->high_water >= m->bytes_in_use);
    return 1;
}

/* Every free block is on the list of its class, and the bitmaps say which
 * lists are non-empty; the pending and spare lists hold what they should. */
static int fp_valid_lists(const fp_arena_meta_t *m, const fp_tally_t *t)
{
    uint32_t listed = 0;
    for (uint32_t c = 0; c < FP_CLASS_COUNT; c++) {
        uint32_t fl = c / FP_SL_COUNT, sl = c % FP_SL_COUNT;
        FP_CHECK(!!(m->sl_bitmap[fl] & (1u << sl)) == (m->heads[c] != FP_NIL));
        FP_CHECK(!!(m->fl_bitmap & (1u << fl)) == (m->sl_bitmap[fl] != 0));
        for (uint32_t b = m->heads[c], prev = FP_NIL; b != FP_NIL; prev = b, b = m->blocks[b].next) {
            FP_CHECK(++listed <= t->nfree);
            FP_CHECK(m->blocks[b].state == FP_BLOCK_FREE);
            FP_CHECK(m->blocks[b].prev == prev);
            FP_CHECK(fp_arena_class(m->blocks[b].size) == c);
        }
    }
    FP_CHECK(listed == t->nfree);
    uint32_t pending = 0;
    for (uint32_t b = m->pending_head; b != FP_NIL; b = m->blocks[b].next) {
        FP_CHECK(++pending <= t->npending);
        FP_CHECK(m->blocks[b].state == FP_BLOCK_PENDING);
        if (m->blocks[b].next == FP_NIL)
            FP_CHECK(m->pending_tail == b);
    }
    FP_CHECK(pending == t->npending);
    uint32_t spare = 0;
    for (uint32_t b = m->spare; b != FP_NIL; b = m->blocks[b].next) {
        FP_CHECK(++spare <= m->max_blocks);
        FP_CHECK(m->blocks[b].state == FP_BLOCK_SPARE);
    }
    FP_CHECK(spare + t->nblocks == m->max_blocks);
    return 1;
}

int fp_arena_is_valid_locked(fp_arena_t *a)
{
    fp_arena_meta_t *m = a->meta;
    FP_CHECK(m->magic == FP_ARENA_MAGIC);
    FP_CHECK(!m->broken);
    /* Drains finish inside one critical section (or repair ends them). */
    FP_CHECK(m->draining == FP_NIL && m->draining_one == FP_NIL);
    fp_tally_t t = {0};
    return fp_valid_chain(m, &t) && fp_valid_lists(m, &t);
}

int fp_arena_is_valid(fp_arena_t *a)
{
    if (fp_arena_lock(a))
        return 0;
    int ok = fp_arena_is_valid_locked(a);
    fp_arena_unlock(a);
    return ok;
}
