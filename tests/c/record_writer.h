/* Writes layout records (csrc/fastpin.h's format) for test_record.c and
 * fuzz_record.c, as fastpin/_record.py writes them, and checks what a parsed
 * record promises independently of the parser. */
#ifndef FASTPIN_RECORD_WRITER_H
#define FASTPIN_RECORD_WRITER_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fastpin.h"

enum { RW_ENTRIES = 4096 * FP_RECORD_ENTRY, RW_DIMS = 16384, RW_NODES = 65536 };

typedef struct {
    uint8_t entries[RW_ENTRIES];
    int64_t dims[RW_DIMS];
    uint8_t nodes[RW_NODES];
    uint32_t nleaves, ndims, nnodes, nobjects;
    uint8_t out[FP_RECORD_HEADER + RW_ENTRIES + 8 * RW_DIMS + RW_NODES];
    size_t len;
} rw_t;

static inline void rw_put(uint8_t *p, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static inline void rw_begin(rw_t *w)
{
    w->nleaves = w->ndims = w->nnodes = w->nobjects = 0;
    w->len = 0;
}

/* A leaf entry (its LEAF node is written separately, with rw_node). */
static inline void rw_leaf(rw_t *w, int kind, uint64_t offset, uint32_t itemsize, int ndim,
                    const int64_t *shape, const int64_t *strides, uint32_t object,
                    uint16_t type, uint8_t code, uint8_t bits, uint8_t flags)
{
    uint8_t *e = w->entries + (size_t)w->nleaves++ * FP_RECORD_ENTRY;
    uint64_t numel = 1;
    for (int k = 0; k < ndim; k++)
        numel *= (uint64_t)shape[k];
    memset(e, 0, FP_RECORD_ENTRY);
    rw_put(e, offset, 8);
    rw_put(e + 8, numel * itemsize, 8);
    rw_put(e + 16, itemsize, 4);
    rw_put(e + 20, w->ndims, 4);
    rw_put(e + 24, object, 4);
    rw_put(e + 28, type, 2);
    e[30] = (uint8_t)kind;
    e[31] = (uint8_t)ndim;
    e[32] = code;
    e[33] = bits;
    e[34] = flags;
    for (int k = 0; k < ndim; k++)
        w->dims[w->ndims++] = shape[k];
    for (int k = 0; k < ndim; k++)
        w->dims[w->ndims++] = strides[k];
}

/* A tensor of `ndim` x shape, C-contiguous, of DLPack (code, bits) at offset. */
static inline void rw_tensor(rw_t *w, uint64_t offset, int ndim, const int64_t *shape, uint8_t code,
                      uint8_t bits)
{
    int64_t strides[FP_RECORD_MAX_NDIM];
    for (int k = ndim - 1, step = 1; k >= 0; k--) {
        strides[k] = step;
        step *= shape[k] > 1 ? (int)shape[k] : 1;
    }
    rw_leaf(w, FP_RECORD_TENSOR, offset, (bits + 7u) / 8, ndim, shape, strides,
            FP_RECORD_NONE, 1, code, bits, 0);
}

static inline void rw_node(rw_t *w, int kind, uint32_t count)
{
    w->nodes[w->nnodes++] = (uint8_t)kind;
    if (kind >= FP_RECORD_NODE_LIST) {
        rw_put(w->nodes + w->nnodes, count, 4);
        w->nnodes += 4;
    }
}

/* Assembles the record into w->out (w->len bytes). */
static inline void rw_finish(rw_t *w, uint32_t nobjects)
{
    uint8_t *p = w->out;
    w->nobjects = nobjects;
    memset(p, 0, FP_RECORD_HEADER);
    rw_put(p, FP_RECORD_MAGIC, 4);
    rw_put(p + 4, FP_RECORD_VERSION, 2);
    rw_put(p + 6, FP_RECORD_ENTRY, 2);
    rw_put(p + 8, w->nleaves, 4);
    rw_put(p + 12, w->ndims, 4);
    rw_put(p + 16, w->nnodes, 4);
    rw_put(p + 20, nobjects, 4);
    size_t at = FP_RECORD_HEADER;
    memcpy(p + at, w->entries, (size_t)w->nleaves * FP_RECORD_ENTRY);
    at += (size_t)w->nleaves * FP_RECORD_ENTRY;
    for (uint32_t i = 0; i < w->ndims; i++, at += 8)
        rw_put(p + at, (uint64_t)w->dims[i], 8);
    memcpy(p + at, w->nodes, w->nnodes);
    w->len = at + w->nnodes;
}

/* What a parsed record promises, checked without the parser's own code:
 * every leaf's elements (each corner of its index space) lie inside the
 * block, its bytes are numel x itemsize, indices name what was sent, and
 * the structure holds exactly its leaves and at most its objects. Returns
 * NULL, or what broke. */
static inline const char *rw_promises(const fp_record_t *r, uint64_t block_size)
{
    static char why[256];
    for (uint32_t i = 0; i < r->nleaves; i++) {
        fp_record_leaf_t l;
        fp_record_leaf(r, i, &l);
        if (l.ndim > FP_RECORD_MAX_NDIM)
            return "a leaf with too many dimensions";
        if (l.object != FP_RECORD_NONE && l.object >= r->nobjects)
            return "a leaf names an object not sent";
        if (l.kind != FP_RECORD_TENSOR && l.kind != FP_RECORD_ARRAY)
            return "a leaf of unknown kind";
        long double numel = 1;
        unsigned __int128 last = 0;
        int empty = 0;
        for (int k = 0; k < l.ndim; k++) {
            if (l.shape[k] < 0 || l.strides[k] < 0)
                return "a negative shape or stride";
            numel *= (long double)l.shape[k];
            empty |= l.shape[k] == 0;
            if (l.shape[k] > 0)
                last += (unsigned __int128)(uint64_t)(l.shape[k] - 1) * (uint64_t)l.strides[k];
        }
        if (numel * l.itemsize != (long double)l.nbytes)
            return "nbytes is not numel x itemsize";
        if (l.offset + (unsigned __int128)l.nbytes > block_size)
            return "a leaf's bytes end past the block";
        if (!empty && (unsigned __int128)l.offset + (last + 1) * l.itemsize > block_size) {
            snprintf(why, sizeof why, "leaf %u's last element ends past the block", i);
            return why;
        }
    }
    /* The structure, walked as the binding walks it. */
    size_t at = 0;
    uint64_t leaves = 0, objects = 0, pending = 1;
    int depth = 0;
    uint64_t stack[FP_RECORD_DEPTH + 2];
    stack[0] = 1;
    while (pending) {
        uint32_t n;
        int kind = fp_record_node(r, &at, &n);
        if (kind < 0)
            return "the structure ends early";
        stack[depth]--;
        if (kind == FP_RECORD_NODE_LEAF)
            leaves++;
        else if (kind == FP_RECORD_NODE_OBJECT || kind == FP_RECORD_NODE_ORDINARY)
            objects++;
        else if (kind >= FP_RECORD_NODE_LIST && kind < FP_RECORD_NODE_KINDS) {
            if (kind == FP_RECORD_NODE_DICT)
                objects += n;
            if (depth + 1 > FP_RECORD_DEPTH)
                return "containers nested too deep";
            stack[++depth] = n;
        } else
            return "an unknown node";
        while (depth > 0 && stack[depth] == 0)
            depth--;
        pending = stack[depth];
        if (depth == 0 && stack[0] == 0)
            pending = 0;
    }
    if (at != r->nnodes)
        return "structure bytes left over";
    if (leaves != r->nleaves)
        return "the structure holds another number of leaves";
    if (objects > r->nobjects || objects != r->node_objects)
        return "the structure takes objects not sent";
    return NULL;
}

#endif /* FASTPIN_RECORD_WRITER_H */
