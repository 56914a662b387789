/* A zero-copy batch's layout record: the parser (format in fastpin.h).
 *
 * The record comes from another process (a DataLoader worker), which may
 * have been killed while it wrote, or from a fuzzer: nothing in it is
 * trusted. fp_record_parse reads every byte through bounds-checked helpers
 * and checks every leaf against the block before the binding builds a
 * single view, so the views it makes lie inside the block whatever the
 * bytes say. Plain C: the C tests and the fuzzer run it without Python. */
#include <string.h>

#include "fastpin.h"

static uint16_t fp_rd16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (uint16_t)p[1] << 8);
}

static uint32_t fp_rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t fp_rd64(const uint8_t *p)
{
    return (uint64_t)fp_rd32(p) | (uint64_t)fp_rd32(p + 4) << 32;
}

void fp_record_leaf(const fp_record_t *r, uint32_t i, fp_record_leaf_t *out)
{
    const uint8_t *e = r->entries + (size_t)i * FP_RECORD_ENTRY;
    out->offset = fp_rd64(e);
    out->nbytes = fp_rd64(e + 8);
    out->itemsize = fp_rd32(e + 16);
    uint32_t dims = fp_rd32(e + 20);
    out->object = fp_rd32(e + 24);
    out->type = fp_rd16(e + 28);
    out->kind = e[30];
    out->ndim = e[31];
    out->code = e[32];
    out->bits = e[33];
    out->flags = e[34];
    /* Bytes 35..39 are padding (checked zero by the parser). */
    int ndim = out->ndim <= FP_RECORD_MAX_NDIM ? out->ndim : 0;
    if ((uint64_t)dims + 2 * (uint64_t)ndim > r->ndims)
        ndim = 0; /* only for an unparsed record: the parser refuses it */
    for (int k = 0; k < ndim; k++) {
        out->shape[k] = (int64_t)fp_rd64(r->dims + 8 * ((size_t)dims + (size_t)k));
        out->strides[k] = (int64_t)fp_rd64(r->dims + 8 * ((size_t)dims + (size_t)ndim + k));
    }
}

/* Whether a tensor's DLPack type is one fastpin exports (fastpin/_dtypes.py's
 * table; DLPack's codes): nothing else goes to torch, whose import keeps,
 * and never frees, a tensor it refuses. */
static int fp_record_dtype_ok(unsigned code, unsigned bits, unsigned lanes)
{
    if (code == 17) /* float4_e2m1fn_x2 */
        return bits == 4 && lanes == 2;
    if (lanes != 1)
        return 0;
    switch (code) {
    case 0: /* int */
    case 1: /* uint */
        return bits == 8 || bits == 16 || bits == 32 || bits == 64;
    case 2: /* float */
        return bits == 16 || bits == 32 || bits == 64;
    case 4: /* bfloat */
        return bits == 16;
    case 5: /* complex */
        return bits == 32 || bits == 64 || bits == 128;
    case 6: /* bool */
    case 10: case 11: case 12: case 13: case 14: /* the float8s */
        return bits == 8;
    }
    return 0;
}

/* Whether leaf i is one the binding can make, inside a block of
 * `block_size` bytes; FP_EINVAL saying why not. */
static int fp_record_check_leaf(const fp_record_t *r, uint32_t i, uint64_t block_size)
{
    const uint8_t *e = r->entries + (size_t)i * FP_RECORD_ENTRY;
    fp_record_leaf_t l;
    if (e[31] > FP_RECORD_MAX_NDIM)
        return fp_error_set(FP_EINVAL, "layout record: leaf %u has %u dimensions (at most %d)",
                            i, e[31], FP_RECORD_MAX_NDIM);
    if ((uint64_t)fp_rd32(e + 20) + 2 * (uint64_t)e[31] > r->ndims)
        return fp_error_set(FP_EINVAL, "layout record: leaf %u's shape lies past the dims", i);
    if (e[35] | e[36] | e[37] | e[38] | e[39])
        return fp_error_set(FP_EINVAL, "layout record: leaf %u's padding is not zero", i);
    fp_record_leaf(r, i, &l);
    if (l.kind != FP_RECORD_TENSOR && l.kind != FP_RECORD_ARRAY)
        return fp_error_set(FP_EINVAL, "layout record: leaf %u of unknown kind %u", i, l.kind);
    if (l.flags & ~(unsigned)FP_RECORD_REQUIRES_GRAD)
        return fp_error_set(FP_EINVAL, "layout record: leaf %u has unknown flags 0x%x", i,
                            l.flags);
    if (l.object != FP_RECORD_NONE && l.object >= r->nobjects)
        return fp_error_set(FP_EINVAL, "layout record: leaf %u names object %u of %u", i,
                            l.object, r->nobjects);
    if (l.kind == FP_RECORD_TENSOR) {
        if (!fp_record_dtype_ok(l.code, l.bits, l.type))
            return fp_error_set(FP_EINVAL, "layout record: leaf %u: DLPack type (code %u, %u "
                                "bits, %u lanes) is none fastpin exports", i, l.code, l.bits,
                                l.type);
        if (l.itemsize != ((uint32_t)l.bits * l.type + 7) / 8)
            return fp_error_set(FP_EINVAL, "layout record: leaf %u: %u-byte elements of %u "
                                "bits x %u lanes", i, l.itemsize, l.bits, l.type);
    } else {
        if (l.code || l.bits || (l.object == FP_RECORD_NONE && !l.itemsize))
            return fp_error_set(FP_EINVAL, "layout record: array leaf %u with DLPack fields "
                                "or no dtype", i);
    }
    if (l.offset % FP_GRANULE)
        return fp_error_set(FP_EINVAL, "layout record: leaf %u at offset %llu, not a multiple "
                            "of %u", i, (unsigned long long)l.offset, FP_GRANULE);
    int64_t numel = 1;
    for (int k = 0; k < l.ndim; k++) {
        if (l.shape[k] < 0 || l.strides[k] < 0)
            return fp_error_set(FP_EINVAL, "layout record: leaf %u: negative shape or stride "
                                "(dimension %d)", i, k);
        if (l.itemsize && l.strides[k] > INT64_MAX / l.itemsize)
            return fp_error_set(FP_EINVAL, "layout record: leaf %u: stride %lld elements of "
                                "%u bytes overflows int64", i, (long long)l.strides[k],
                                l.itemsize);
        if (__builtin_mul_overflow(numel, l.shape[k], &numel))
            return fp_error_set(FP_EINVAL, "layout record: leaf %u: its element count "
                                "overflows int64", i);
    }
    uint64_t nbytes;
    if (__builtin_mul_overflow((uint64_t)numel, (uint64_t)l.itemsize, &nbytes) ||
        nbytes != l.nbytes)
        return fp_error_set(FP_EINVAL, "layout record: leaf %u: %llu bytes for %lld elements "
                            "of %u bytes", i, (unsigned long long)l.nbytes, (long long)numel,
                            l.itemsize);
    if (l.offset > block_size || l.nbytes > block_size - l.offset)
        goto past;
    if (numel == 0)
        return FP_OK;
    /* The last element's first byte, then its last: every term is bounded by
     * the block before it is scaled, so nothing wraps. */
    unsigned __int128 last = 0, size = block_size;
    for (int k = 0; k < l.ndim; k++) {
        unsigned __int128 span = (unsigned __int128)(uint64_t)(l.shape[k] - 1) *
                                 (uint64_t)l.strides[k];
        if (span > size || span * l.itemsize > size)
            goto past;
        last += span * l.itemsize;
        if (last > size)
            goto past;
    }
    if ((unsigned __int128)l.offset + last + l.itemsize <= size)
        return FP_OK;
past:
    return fp_error_set(FP_EINVAL, "layout record: leaf %u (offset %llu, %llu bytes) reaches "
                        "past the block of %llu bytes", i, (unsigned long long)l.offset,
                        (unsigned long long)l.nbytes, (unsigned long long)block_size);
}

int fp_record_node(const fp_record_t *r, size_t *at, uint32_t *count)
{
    *count = 0;
    if (*at >= r->nnodes)
        return -1;
    int kind = r->nodes[(*at)++];
    if (kind >= FP_RECORD_NODE_LIST && kind < FP_RECORD_NODE_KINDS) {
        if (r->nnodes - *at < 4)
            return -1;
        *count = fp_rd32(r->nodes + *at);
        *at += 4;
    }
    return kind;
}

typedef struct {
    size_t at;          /* next node byte */
    uint32_t leaves;    /* LEAF nodes read */
    uint32_t objects;   /* objects the nodes took */
} fp_walk_t;

/* One node and what it holds, `depth` containers deep. */
static int fp_record_check_node(const fp_record_t *r, fp_walk_t *w, int depth)
{
    uint32_t n;
    size_t start = w->at;
    int kind = fp_record_node(r, &w->at, &n);
    if (kind < 0)
        return fp_error_set(FP_EINVAL, "layout record: the structure ends at byte %zu of %u",
                            start, r->nnodes);
    switch (kind) {
    case FP_RECORD_NODE_LEAF:
        if (w->leaves++ >= r->nleaves)
            return fp_error_set(FP_EINVAL, "layout record: more leaves in the structure than "
                                "the %u described", r->nleaves);
        return FP_OK;
    case FP_RECORD_NODE_OBJECT:
    case FP_RECORD_NODE_ORDINARY:
        goto object;
    case FP_RECORD_NODE_LIST:
    case FP_RECORD_NODE_TUPLE:
    case FP_RECORD_NODE_DICT:
        break;
    default:
        return fp_error_set(FP_EINVAL, "layout record: unknown node %d at byte %zu", kind,
                            start);
    }
    if (depth >= FP_RECORD_DEPTH)
        return fp_error_set(FP_EINVAL, "layout record: containers nested more than %d deep",
                            FP_RECORD_DEPTH);
    if (kind == FP_RECORD_NODE_DICT) { /* its keys, in order */
        if (n > r->nobjects - w->objects)
            return fp_error_set(FP_EINVAL, "layout record: more objects in the structure than "
                                "the %u sent", r->nobjects);
        w->objects += n;
    }
    /* Every item takes a byte at least: a count past what is left is refused
     * by the item that finds the structure ended. */
    for (uint32_t k = 0; k < n; k++) {
        int status = fp_record_check_node(r, w, depth + 1);
        if (status)
            return status;
    }
    return FP_OK;
object:
    if (w->objects++ >= r->nobjects)
        return fp_error_set(FP_EINVAL, "layout record: more objects in the structure than the "
                            "%u sent", r->nobjects);
    return FP_OK;
}

int fp_record_parse(const void *buf, size_t len, uint64_t block_size, fp_record_t *r)
{
    const uint8_t *p = buf;
    memset(r, 0, sizeof *r);
    if (len < FP_RECORD_HEADER)
        return fp_error_set(FP_EINVAL, "layout record: %zu bytes, shorter than its header "
                            "(truncated?)", len);
    if (fp_rd32(p) != FP_RECORD_MAGIC || fp_rd16(p + 4) != FP_RECORD_VERSION ||
        fp_rd16(p + 6) != FP_RECORD_ENTRY)
        return fp_error_set(FP_EINVAL, "layout record: not a fastpin layout record of version "
                            "%d (magic, version or entry size differ)", FP_RECORD_VERSION);
    r->nleaves = fp_rd32(p + 8);
    r->ndims = fp_rd32(p + 12);
    r->nnodes = fp_rd32(p + 16);
    r->nobjects = fp_rd32(p + 20);
    if (fp_rd64(p + 24))
        return fp_error_set(FP_EINVAL, "layout record: reserved header bytes are not zero");
    uint64_t want = FP_RECORD_HEADER + (uint64_t)r->nleaves * FP_RECORD_ENTRY +
                    (uint64_t)r->ndims * 8 + r->nnodes; /* < 2**40: no wrap */
    if (want != len)
        return fp_error_set(FP_EINVAL, "layout record: %zu bytes where its header says %llu "
                            "(truncated or corrupt)", len, (unsigned long long)want);
    r->entries = p + FP_RECORD_HEADER;
    r->dims = r->entries + (size_t)r->nleaves * FP_RECORD_ENTRY;
    r->nodes = r->dims + (size_t)r->ndims * 8;
    for (uint32_t i = 0; i < r->nleaves; i++) {
        int status = fp_record_check_leaf(r, i, block_size);
        if (status)
            return status;
    }
    fp_walk_t w = {0};
    int status = fp_record_check_node(r, &w, 0);
    if (status)
        return status;
    if (w.at != r->nnodes)
        return fp_error_set(FP_EINVAL, "layout record: %u bytes of structure, %zu read",
                            r->nnodes, w.at);
    if (w.leaves != r->nleaves)
        return fp_error_set(FP_EINVAL, "layout record: %u leaves described, %u in the "
                            "structure", r->nleaves, w.leaves);
    r->node_objects = w.objects;
    return FP_OK;
}
