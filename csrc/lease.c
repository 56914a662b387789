/* Leases: a reference-counted hold on one allocated block, and the hand-over
 * of blocks between processes (a worker detaches what it filled, the creator
 * adopts it). Python objects and DLPack exports each hold a reference; the
 * last release frees the block through the arena's deferred free. */
#include <stdlib.h>

#include "arena_internal.h"

static fp_lease_t *fp_lease_new(fp_arena_t *a, uint32_t b, char *ptr, uint64_t size)
{
    fp_lease_t *lease = malloc(sizeof *lease);
    if (!lease)
        return NULL;
    fp_arena_incref(a);
    lease->refcount = 1;
    lease->detached = 0;
    lease->pid = fp_pid();
    lease->arena = a;
    lease->block = b;
    lease->ptr = ptr;
    lease->size = size;
    /* Any stream of the device may copy from a block the user holds. */
    lease->consumer = fp_arena_cuda(a) ? FP_STREAM_ANY : NULL;
    return lease;
}

/* A lease over block `b`, which the caller owns and nobody else will free:
 * on failure the block goes back to the arena. */
static int fp_lease_wrap(fp_arena_t *a, uint32_t b, char *ptr, uint64_t size,
                         fp_lease_t **out)
{
    *out = fp_lease_new(a, b, ptr, size);
    if (*out)
        return FP_OK;
    fp_arena_free(a, b, NULL);
    return fp_error_set(FP_EOS, "out of host memory");
}

static int fp_lease_alloc_as(fp_arena_t *a, uint64_t size, int wait, fp_lease_t **out)
{
    *out = NULL;
    uint32_t b;
    void *ptr;
    int status = wait ? fp_arena_alloc(a, size, &b, &ptr) : fp_arena_try_alloc(a, size, &b, &ptr);
    if (!status)
        status = fp_lease_wrap(a, b, ptr, size, out);
    if (!status)
        /* Nobody else knows the index yet: no lock needed to mark it held. */
        fp_atomic_store_release(&a->meta->blocks[b].leased, 1);
    return status;
}

int fp_lease_alloc(fp_arena_t *a, uint64_t size, fp_lease_t **out)
{
    return fp_lease_alloc_as(a, size, 1, out);
}

int fp_lease_try_alloc(fp_arena_t *a, uint64_t size, fp_lease_t **out)
{
    return fp_lease_alloc_as(a, size, 0, out);
}

/* Why block `b` cannot be adopted as `size` bytes, as a status; under lock. */
static int fp_lease_adoptable(fp_arena_meta_t *m, uint32_t b, uint64_t size)
{
    fp_block_t *blk = &m->blocks[b];
    if (m->broken)
        return fp_arena_broken_error();
    if (blk->state != FP_BLOCK_USED)
        return fp_error_set(FP_EINVAL, "cannot adopt block %u: it is not allocated (freed, "
                                       "reclaimed, or never handed out)", b);
    if (blk->owner == 0)
        return fp_error_set(FP_EINVAL, "cannot adopt block %u: it was already adopted", b);
    if (fp_atomic_load_acquire(&blk->leased))
        return fp_error_set(FP_EINVAL, "cannot adopt block %u: process %d still holds it "
                                       "(not detached)", b, (int)blk->owner);
    if (blk->requested != size)
        return fp_error_set(FP_EINVAL, "cannot adopt block %u as %llu bytes: it was allocated "
                                       "for %llu", b, (unsigned long long)size,
                            (unsigned long long)blk->requested);
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
    char *ptr = NULL;
    int status = fp_arena_lock(a);
    if (status)
        return status;
    /* A block its owner freed may still sit on the return stack, looking
     * allocated: drain, so it shows as pending. */
    if (!m->broken)
        fp_arena_drain(a);
    status = fp_lease_adoptable(m, b, size);
    if (!status)
        status = fp_arena_arm(a, b, 1);
    if (!status) {
        m->blocks[b].owner = 0;
        ptr = a->data + m->blocks[b].offset;
    }
    FP_ARENA_ASSERT_VALID(a);
    fp_arena_unlock(a);
    if (status)
        return status;
    return fp_lease_wrap(a, b, ptr, size, out); /* ours now, and nobody else will free it */
}

int fp_lease_detach(fp_lease_t *lease)
{
    fp_block_t *blk = &lease->arena->meta->blocks[lease->block];
    if (!fp_same_process(lease->pid))
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
    if (!fp_atomic_load_acquire(&lease->detached) && fp_same_process(lease->pid))
        fp_arena_free(lease->arena, lease->block, lease->consumer);
    fp_arena_decref(lease->arena);
    free(lease);
}
