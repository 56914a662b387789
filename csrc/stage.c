/* The device half of the copy engine: host-to-device copies on a CUDA stream.
 *
 * A leaf already in page-locked memory is copied straight from where it is.
 * Pageable leaves are staged through arena blocks of at most `chunk` bytes:
 * the pool copies a chunk's pieces into its block, the DMA of that chunk is
 * queued on the stream, and the block is released at once with the stream as
 * its consumer, so it returns to the arena only when its DMA has finished.
 * The next chunk is filled meanwhile, in another block: the copy of chunk k
 * to the GPU runs while chunk k+1 is copied into pinned memory. */
#include <stdlib.h>

#include "fastpin.h"

typedef struct fp_stage_s {
    fp_lease_t *lease;  /* the chunk being filled, or NULL */
    uint64_t used;      /* bytes of it taken by pieces */
    fp_copy_t *host;    /* pieces to copy into it (dst inside the chunk) */
    fp_cu_deviceptr_t *dev; /* where each piece goes on the device */
    size_t pieces;      /* entries in host/dev */
    size_t cap;         /* room in host/dev */
} fp_stage_t;

/* Fills the chunk, queues its DMAs and releases it to the stream. */
static int fp_stage_flush(fp_stage_t *s, fp_copier_t *copier, fp_cu_stream_t stream)
{
    if (!s->lease)
        return FP_OK;
    int status = fp_copier_run(copier, s->host, s->pieces);
    for (size_t i = 0; i < s->pieces && !status; i++)
        FP_CU_CHECK_GOTO(cuMemcpyHtoDAsync(s->dev[i], s->host[i].dst, s->host[i].size, stream),
                         status, release);
release:
    s->lease->consumer = stream;
    fp_lease_decref(s->lease);
    s->lease = NULL;
    s->used = 0;
    s->pieces = 0;
    return status;
}

static int fp_stage_piece(fp_stage_t *s, fp_arena_t *arena, fp_copier_t *copier,
                          fp_cu_stream_t stream, uint64_t chunk, fp_cu_deviceptr_t dst,
                          const char *src, uint64_t size)
{
    if (s->lease && s->used + size > chunk) {
        int status = fp_stage_flush(s, copier, stream);
        if (status)
            return status;
    }
    if (!s->lease) {
        int status = fp_lease_alloc(arena, chunk, &s->lease);
        if (status)
            return status;
    }
    if (s->pieces == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 64;
        fp_copy_t *host = realloc(s->host, cap * sizeof *host);
        if (host)
            s->host = host;
        fp_cu_deviceptr_t *dev = realloc(s->dev, cap * sizeof *dev);
        if (dev)
            s->dev = dev;
        if (!host || !dev)
            return fp_error_set(FP_EOS, "out of host memory");
        s->cap = cap;
    }
    s->host[s->pieces] = (fp_copy_t){.dst = s->lease->ptr + s->used, .src = src, .size = size};
    s->dev[s->pieces++] = dst;
    /* Pieces start on granule boundaries, as DMA prefers. */
    s->used += (size + FP_GRANULE - 1) / FP_GRANULE * FP_GRANULE;
    return FP_OK;
}

/* The default staging chunk: 8 MiB, or a quarter of a small arena, so that
 * several chunks are in flight at once in any arena. */
static uint64_t fp_stage_default_chunk(const fp_arena_t *arena)
{
    uint64_t chunk = fp_arena_capacity(arena) / 4 / FP_GRANULE * FP_GRANULE;
    if (chunk > (8ull << 20))
        chunk = 8ull << 20;
    return chunk < FP_GRANULE ? FP_GRANULE : chunk;
}

/* Queues the copy of one item: straight from a pinned source, else staged. */
static int fp_stage_item(fp_stage_t *s, fp_arena_t *arena, fp_copier_t *copier,
                         fp_cu_stream_t stream, uint64_t chunk, const fp_h2d_t *it)
{
    if (it->pinned) {
        FP_CU_CHECK(cuMemcpyHtoDAsync(it->dst, it->src, it->size, stream));
        return FP_OK;
    }
    int status = FP_OK;
    for (uint64_t off = 0; off < it->size && !status;) {
        uint64_t n = it->size - off < chunk ? it->size - off : chunk;
        status = fp_stage_piece(s, arena, copier, stream, chunk, it->dst + off,
                                (const char *)it->src + off, n);
        off += n;
    }
    return status;
}

int fp_stage_h2d(fp_copier_t *copier, fp_arena_t *arena, fp_cu_context_t ctx,
                 fp_cu_stream_t stream, const fp_h2d_t *items, size_t count, uint64_t chunk)
{
    if (!chunk)
        chunk = fp_stage_default_chunk(arena);
    if (!fp_arena_registered(arena))
        return fp_error_set(FP_EINVAL, "host-to-device copies need an arena registered with CUDA");
    if (chunk < FP_GRANULE || chunk > fp_arena_capacity(arena))
        return fp_error_set(FP_EINVAL, "staging chunk of %llu bytes does not fit the arena (%llu bytes)",
                            (unsigned long long)chunk,
                            (unsigned long long)fp_arena_capacity(arena));
    FP_CUDA_SCOPE(scope, ctx);
    int status = fp_cuda_scope_status(&scope);
    if (status)
        return status;
    fp_stage_t s = {0};
    for (size_t i = 0; i < count && !status; i++)
        status = fp_stage_item(&s, arena, copier, stream, chunk, &items[i]);
    int flushed = fp_stage_flush(&s, copier, stream);
    if (!status)
        status = flushed;
    free(s.host);
    free(s.dev);
    return status;
}
