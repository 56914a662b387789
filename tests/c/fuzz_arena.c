/* A coverage-guided fuzzer over the arena's C API, checked against a model.
 *
 * Each input is one arena's life: a header picks the arena (capacity, a
 * short descriptor table or the default one, private or shared with a second,
 * attached view of it), then every further byte group is one step: allocate,
 * free now, free behind a fake event, complete events in any order, collect,
 * read the stats, lease, detach, adopt, ask for an owner, reclaim. After
 * every step fp_arena_is_valid must hold; whatever the arena says is checked
 * against the model:
 *
 *   - a block lies inside the region, 256-byte aligned, spans what
 *     fp_arena_round says (more only when no descriptor was left to split)
 *     and overlaps no block that is live or still waited on;
 *   - every live block, and every freed one whose event has not completed
 *     (the "GPU" still reads it), keeps the pattern written into it;
 *   - an allocation fails only when no gap between such blocks fits it;
 *   - the stats (blocks and bytes in use, requested, pending, per class,
 *     allocs, failures, fallbacks) agree with the model;
 *   - at the end, with everything freed and every event completed, the whole
 *     capacity is one block again.
 *
 * No GPU: fp_arena_test_free_armed frees a block as if an event had been
 * recorded, and fp_test_event_done answers the arena's event queries from
 * the model, whose "events" complete when the input says so.
 *
 * Built two ways (tests/c/Makefile): with clang -fsanitize=fuzzer it is a
 * libFuzzer target (make fuzz); with -DFUZZ_ARENA_MAIN it has its own main()
 * that replays files and runs pseudo-random inputs (make fuzz-smoke), so any
 * compiler can run it. A broken promise prints what broke and aborts. */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fastpin.h"

/* ---- failing ------------------------------------------------------------ */

static unsigned long step_no; /* the step being run, for messages */

__attribute__((format(printf, 1, 2), noreturn)) static void fail(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "fuzz_arena: step %lu: ", step_no);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, " (last arena message: %s)\n", fp_error_message());
    abort();
}

#define REQUIRE(cond, ...)      \
    do {                        \
        if (!(cond))            \
            fail(__VA_ARGS__);  \
    } while (0)

/* ---- input -------------------------------------------------------------- */

typedef struct {
    const uint8_t *p;
    size_t left;
} input_t;

static uint8_t in_u8(input_t *in)
{
    if (!in->left)
        return 0;
    in->left--;
    return *in->p++;
}

static uint16_t in_u16(input_t *in)
{
    uint16_t lo = in_u8(in);
    return (uint16_t)(lo | (uint16_t)in_u8(in) << 8);
}

/* ---- size classes, independently of arena.c ---------------------------- */

/* 256-byte steps up to 16 granules, then 16 steps per power of two. */
static uint64_t ref_round(uint64_t size)
{
    uint64_t units = size ? (size + FP_GRANULE - 1) / FP_GRANULE : 1;
    if (units < FP_SL_COUNT)
        return units * FP_GRANULE;
    uint64_t top = 1;
    while (top * 2 <= units)
        top *= 2;
    uint64_t step = top / FP_SL_COUNT;
    return (units + step - 1) / step * step * FP_GRANULE;
}

/* ---- patterns ----------------------------------------------------------- */

/* A pattern that differs per 8-byte word and per block, so a stale, moved or
 * overlapping block shows. */
static uint64_t pat_word(uint32_t seed, uint64_t i)
{
    uint64_t x = ((uint64_t)seed << 32 | (uint32_t)i) ^ (i >> 32) * 0xd6e8feb86659fd93ull;
    x ^= x >> 29;
    x *= 0xbf58476d1ce4e5b9ull;
    return x ^ x >> 32;
}

static void pat_fill(char *p, uint64_t n, uint32_t seed)
{
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w = pat_word(seed, i / 8);
        memcpy(p + i, &w, 8);
    }
    if (i < n) {
        uint64_t w = pat_word(seed, i / 8);
        memcpy(p + i, &w, n - i);
    }
}

/* The offset of the first byte that differs from the pattern, or n. */
static uint64_t pat_check(const char *p, uint64_t n, uint32_t seed)
{
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w = pat_word(seed, i / 8);
        if (memcmp(p + i, &w, 8) != 0)
            return i;
    }
    if (i < n) {
        uint64_t w = pat_word(seed, i / 8);
        if (memcmp(p + i, &w, n - i) != 0)
            return i;
    }
    return n;
}

/* ---- the model ---------------------------------------------------------- */

/* What the model knows of a descriptor index. */
enum {
    E_NONE = 0,      /* free, spare, or known to be retired */
    E_RAW,           /* from fp_arena_alloc, ours to free */
    E_LEASE,         /* held by a lease, not detached */
    E_DETACHED_HELD, /* its lease was detached and is still alive */
    E_DETACHED,      /* detached, lease gone: waits for an adopter */
    E_ADOPTED,       /* held by a lease from fp_lease_adopt */
    E_FREED,         /* freed: pending, on the return stack, or retired */
};

typedef struct {
    uint32_t kind;      /* E_* */
    uint32_t seed;      /* pattern written into the first `requested` bytes */
    uint64_t offset;    /* from the start of the data */
    uint64_t size;      /* bytes the block spans */
    uint64_t requested; /* bytes asked for */
    int owner;          /* pid fp_arena_owner must say (0 once adopted) */
    fp_lease_t *lease;  /* E_LEASE, E_DETACHED_HELD, E_ADOPTED */
    int refs;           /* references the model holds on `lease` */
    uint8_t armed;      /* E_FREED behind a fake event */
    uint8_t done;       /* that event completed */
    uint8_t maybe;      /* E_FREED that a partial collect may have retired */
    uint32_t pos;       /* index in model_t.act */
} ent_t;

typedef struct {
    fp_lease_t *lease; /* detached; its block has gone on without it */
    int refs;          /* references the model still holds on it */
} orphan_t;

enum { MAX_ORPHANS = 64 };

typedef struct {
    fp_arena_t *a;        /* the arena, home view */
    fp_arena_t *w;        /* an attached view of it (shared arenas), or NULL */
    uint64_t capacity;    /* bytes, rounded to the granule as the arena does */
    uint32_t max_blocks;  /* descriptors, as the stats say */
    int exact;            /* default descriptor table: blocks never run out */
    int shared;           /* memfd arena */
    int pid;              /* this process: the owner of what it allocates */
    ent_t *ent;           /* per descriptor */
    uint32_t *act;        /* descriptors whose kind is not E_NONE */
    uint32_t nact;        /* entries in act */
    orphan_t orphans[MAX_ORPHANS]; /* detached leases still referenced */
    uint32_t norphans;    /* entries in orphans */
    uint32_t next_seed;   /* pattern of the next block */
    uint64_t allocs, failed, fallbacks; /* what the stats must count */
    uint64_t high_water;  /* the stats' high water last seen: never falls */
} model_t;

static model_t *cur; /* for the fake-event callback */

static const char *kind_name(uint32_t k)
{
    static const char *names[] = {"none", "raw", "lease", "detached-held", "detached",
                                  "adopted", "freed"};
    return k < sizeof names / sizeof names[0] ? names[k] : "?";
}

static void ent_set(model_t *m, uint32_t b, uint32_t kind)
{
    ent_t *e = &m->ent[b];
    if (e->kind == E_NONE && kind != E_NONE) {
        e->pos = m->nact;
        m->act[m->nact++] = b;
    } else if (e->kind != E_NONE && kind == E_NONE) {
        uint32_t last = m->act[--m->nact];
        m->act[e->pos] = last;
        m->ent[last].pos = e->pos;
    }
    e->kind = kind;
}

/* A freed block the arena may retire when it collects through `view`: no
 * event, or, in the creator only, a completed one. */
static int retirable(const model_t *m, const ent_t *e, const fp_arena_t *view)
{
    return e->kind == E_FREED && (!e->armed || (e->done && view == m->a));
}

/* The view collected every pending block it could (collect with all set). */
static void resolve_collect_all(model_t *m, fp_arena_t *view)
{
    for (uint32_t i = 0; i < m->nact;) {
        uint32_t b = m->act[i];
        if (retirable(m, &m->ent[b], view))
            ent_set(m, b, E_NONE); /* the swap puts another at i */
        else
            i++;
    }
}

/* The view collected some pending blocks, maybe (collect with all unset). */
static void mark_partial_collect(model_t *m, fp_arena_t *view)
{
    for (uint32_t i = 0; i < m->nact; i++) {
        ent_t *e = &m->ent[m->act[i]];
        if (retirable(m, e, view))
            e->maybe = 1;
    }
}

/* Picks one descriptor whose kind is in the `kinds` mask (1 << E_*), or
 * FP_NIL; extra filters on a freed block's event. */
enum { ANY_EVENT, UNDONE_EVENT };
static uint32_t pick(model_t *m, uint32_t kinds, int filter, uint32_t k)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < m->nact; i++) {
        ent_t *e = &m->ent[m->act[i]];
        if ((kinds >> e->kind & 1) &&
            (filter != UNDONE_EVENT || (e->armed && !e->done)))
            n++;
    }
    if (!n)
        return FP_NIL;
    k %= n;
    for (uint32_t i = 0; i < m->nact; i++) {
        ent_t *e = &m->ent[m->act[i]];
        if ((kinds >> e->kind & 1) &&
            (filter != UNDONE_EVENT || (e->armed && !e->done)) && k-- == 0)
            return m->act[i];
    }
    return FP_NIL;
}

#define LIVE_KINDS                                                          \
    (1u << E_RAW | 1u << E_LEASE | 1u << E_DETACHED_HELD | 1u << E_DETACHED | \
     1u << E_ADOPTED)

/* Whether a block still holds what was written into it: live, or freed
 * behind an event the "GPU" has not completed. */
static int must_hold(const ent_t *e)
{
    return (LIVE_KINDS >> e->kind & 1) || (e->kind == E_FREED && e->armed && !e->done);
}

/* Whether the arena may still hold a block's bytes: anything not known to be
 * retired. Freed blocks a collect may have retired (`maybe`) count as held, so
 * the gap an allocation is refused against is never overestimated. */
static int occupies(const ent_t *e) { return e->kind != E_NONE; }

static void check_pattern(model_t *m, uint32_t b, const char *why)
{
    ent_t *e = &m->ent[b];
    const char *p = (const char *)fp_arena_base(m->a) + e->offset;
    uint64_t at = pat_check(p, e->requested, e->seed);
    REQUIRE(at == e->requested,
            "%s: block %u (%s, offset %llu, %llu bytes asked) lost its contents at byte %llu",
            why, b, kind_name(e->kind), (unsigned long long)e->offset,
            (unsigned long long)e->requested, (unsigned long long)at);
}

static void check_all_patterns(model_t *m, const char *why)
{
    for (uint32_t i = 0; i < m->nact; i++)
        if (must_hold(&m->ent[m->act[i]]))
            check_pattern(m, m->act[i], why);
}

/* Called by the arena, under its lock, in place of cuEventQuery. */
static int fake_event_done(fp_arena_t *arena, uint32_t b)
{
    model_t *m = cur;
    REQUIRE(m && arena == m->a, "an event was queried through another arena struct");
    REQUIRE(b < m->max_blocks, "an event was queried for block %u, out of range", b);
    ent_t *e = &m->ent[b];
    REQUIRE(e->kind == E_FREED && e->armed,
            "the arena asked for the event of block %u, which the model has as %s%s", b,
            kind_name(e->kind), e->kind == E_FREED ? " without an event" : "");
    return e->done;
}

/* ---- operations --------------------------------------------------------- */

static fp_arena_t *view_of(model_t *m, uint8_t sel)
{
    return m->w && (sel & 1) ? m->w : m->a;
}

static uint64_t take_size(model_t *m, input_t *in)
{
    uint8_t sel = in_u8(in);
    uint64_t c = m->capacity;
    switch (sel % 10) {
    case 0:
        return in_u8(in);
    case 1:
    case 2:
        return in_u16(in) % 4097;
    case 3:
        return in_u16(in) % (c / 8 + 1);
    case 4:
        return c * in_u8(in) / 256;
    case 5: { /* a class boundary, or one byte either side */
        uint64_t r = ref_round((uint64_t)in_u16(in) * (1 + c / 65536));
        return r + (uint64_t)(sel / 10 % 3) - 1;
    }
    case 6:
        return c - in_u16(in) % 1024;
    case 7:
        return c;
    case 8: /* too big, now and then absurdly */
        return sel & 0x80 ? UINT64_MAX - in_u8(in) : c + 1 + in_u8(in);
    default:
        return 0;
    }
}

/* Checks a block the arena handed out and records it. */
static void took(model_t *m, fp_arena_t *view, uint32_t b, void *ptr, uint64_t size,
                 uint32_t kind, fp_lease_t *lease)
{
    REQUIRE(b < m->max_blocks, "allocation returned block %u of %u", b, m->max_blocks);
    ent_t *e = &m->ent[b];
    REQUIRE(e->kind == E_NONE || (e->kind == E_FREED && (e->maybe || retirable(m, e, view))),
            "allocation returned block %u, which the model has as %s%s", b,
            kind_name(e->kind), e->kind == E_FREED && e->armed && !e->done
                                    ? " behind an event still in flight" : "");
    if (e->kind != E_NONE)
        ent_set(m, b, E_NONE); /* it was retired */
    char *base = fp_arena_base(view);
    REQUIRE((char *)ptr >= base && (uint64_t)((char *)ptr - base) < m->capacity,
            "block %u at %p lies outside the region [%p, +%llu)", b, ptr, (void *)base,
            (unsigned long long)m->capacity);
    uint64_t offset = (uint64_t)((char *)ptr - base);
    REQUIRE((uintptr_t)ptr % FP_GRANULE == 0 && offset % FP_GRANULE == 0,
            "block %u at %p is not %u-byte aligned", b, ptr, FP_GRANULE);
    uint64_t rounded = fp_arena_round(size);
    REQUIRE(rounded == ref_round(size), "fp_arena_round(%llu) = %llu, expected %llu",
            (unsigned long long)size, (unsigned long long)rounded,
            (unsigned long long)ref_round(size));
    /* A request that fits the cap but rounds past it takes the whole cap. */
    if (rounded > m->capacity)
        rounded = m->capacity;
    uint64_t span = fp_arena_test_block_size(m->a, b);
    REQUIRE(span == rounded || (!m->exact && span > rounded && span % FP_GRANULE == 0),
            "block %u for %llu bytes spans %llu, fp_arena_round says %llu", b,
            (unsigned long long)size, (unsigned long long)span, (unsigned long long)rounded);
    REQUIRE(offset + span <= m->capacity, "block %u [%llu, +%llu) runs past the capacity %llu",
            b, (unsigned long long)offset, (unsigned long long)span,
            (unsigned long long)m->capacity);
    /* No overlap with what is held; what it overlaps among the freed blocks a
     * collect may have retired was retired. */
    for (uint32_t i = 0; i < m->nact;) {
        uint32_t o = m->act[i];
        ent_t *x = &m->ent[o];
        if (offset < x->offset + x->size && x->offset < offset + span) {
            REQUIRE(x->kind == E_FREED && (x->maybe || retirable(m, x, view)),
                    "block %u [%llu, +%llu) overlaps block %u [%llu, +%llu), %s%s", b,
                    (unsigned long long)offset, (unsigned long long)span, o,
                    (unsigned long long)x->offset, (unsigned long long)x->size,
                    kind_name(x->kind), x->kind == E_FREED && x->armed && !x->done
                                            ? " behind an event still in flight" : "");
            ent_set(m, o, E_NONE);
            continue;
        }
        i++;
    }
    *e = (ent_t){.seed = ++m->next_seed, .offset = offset, .size = span, .requested = size,
                 .owner = m->pid, .lease = lease, .refs = lease ? 1 : 0};
    ent_set(m, b, kind);
    pat_fill(ptr, size, e->seed);
    m->allocs++;
}

/* The largest run of bytes no held block covers. */
static int cmp_u64(const void *x, const void *y)
{
    uint64_t a = *(const uint64_t *)x, b = *(const uint64_t *)y;
    return a < b ? -1 : a > b;
}

static uint64_t largest_gap(model_t *m)
{
    uint64_t *iv = malloc(sizeof *iv * 2 * (m->nact + 1));
    REQUIRE(iv, "out of memory");
    uint32_t n = 0;
    for (uint32_t i = 0; i < m->nact; i++) {
        ent_t *e = &m->ent[m->act[i]];
        if (occupies(e)) {
            iv[2 * n] = e->offset;
            iv[2 * n + 1] = e->size;
            n++;
        }
    }
    qsort(iv, n, 2 * sizeof *iv, cmp_u64);
    uint64_t at = 0, gap = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (iv[2 * i] > at && iv[2 * i] - at > gap)
            gap = iv[2 * i] - at;
        if (iv[2 * i] + iv[2 * i + 1] > at)
            at = iv[2 * i] + iv[2 * i + 1];
    }
    if (m->capacity - at > gap)
        gap = m->capacity - at;
    free(iv);
    return gap;
}

/* An allocation was refused: check that it had to be. */
static void refused(model_t *m, fp_arena_t *view, uint64_t size, int status)
{
    m->failed++;
    if (size > m->capacity) {
        REQUIRE(status == FP_ETOOBIG, "asked for %llu of a %llu-byte arena: status %d",
                (unsigned long long)size, (unsigned long long)m->capacity, status);
        return;
    }
    REQUIRE(status == FP_ENOMEM, "asked for %llu bytes: status %d, expected FP_ENOMEM",
            (unsigned long long)size, status);
    /* The failing path collected everything this view can. */
    resolve_collect_all(m, view);
    uint64_t gap = largest_gap(m);
    uint64_t need = fp_arena_round(size) < m->capacity ? fp_arena_round(size) : m->capacity;
    REQUIRE(gap < need,
            "asked for %llu bytes (%llu rounded): refused, but %llu free bytes lie together",
            (unsigned long long)size, (unsigned long long)fp_arena_round(size),
            (unsigned long long)gap);
}

static void op_alloc(model_t *m, input_t *in, int burst)
{
    fp_arena_t *view = view_of(m, in_u8(in));
    uint64_t size = take_size(m, in);
    int n = burst ? 1 + in_u8(in) % 32 : 1;
    for (int i = 0; i < n; i++) {
        uint32_t b = FP_NIL;
        void *ptr = NULL;
        mark_partial_collect(m, view);
        int status = fp_arena_alloc(view, size, &b, &ptr);
        if (status) {
            refused(m, view, size, status);
            return;
        }
        took(m, view, b, ptr, size, E_RAW, NULL);
    }
}

static void op_lease_alloc(model_t *m, input_t *in)
{
    fp_arena_t *view = view_of(m, in_u8(in));
    uint64_t size = take_size(m, in);
    fp_lease_t *lease = NULL;
    mark_partial_collect(m, view);
    int status = fp_lease_alloc(view, size, &lease);
    if (status) {
        REQUIRE(!lease, "a refused lease came back non-NULL");
        refused(m, view, size, status);
        return;
    }
    REQUIRE(lease->size == size && lease->refcount == 1 && lease->arena == view && !lease->detached,
            "a new lease over block %u does not say what was asked", lease->block);
    took(m, view, lease->block, lease->ptr, size, E_LEASE, lease);
}

/* The block is gone from its holder: freed, with or without an event. */
static void freed(model_t *m, uint32_t b, int armed)
{
    ent_t *e = &m->ent[b];
    e->kind = E_FREED;
    e->armed = (uint8_t)armed;
    e->done = 0;
    e->maybe = 0;
    e->lease = NULL;
    e->refs = 0;
}

static void op_free(model_t *m, input_t *in, int armed)
{
    uint8_t sel = in_u8(in);
    uint32_t b = pick(m, 1u << E_RAW, ANY_EVENT, in_u8(in));
    if (b == FP_NIL)
        return;
    check_pattern(m, b, "before its free");
    fp_arena_t *view = view_of(m, sel);
    if (armed)
        fp_arena_test_free_armed(view, b);
    else /* a stream means nothing without CUDA: no event either way */
        fp_arena_free(view, b, sel & 2 ? (fp_cu_stream_t)&m->pid : NULL);
    freed(m, b, armed);
}

/* Frees every other live raw block in address order (or every third...):
 * holes between blocks that stay. */
static model_t *sort_model;

static int cmp_offset(const void *x, const void *y)
{
    uint64_t a = sort_model->ent[*(const uint32_t *)x].offset;
    uint64_t b = sort_model->ent[*(const uint32_t *)y].offset;
    return a < b ? -1 : a > b;
}

static void op_free_stride(model_t *m, input_t *in)
{
    uint8_t sel = in_u8(in);
    uint32_t stride = 2 + sel % 3, n = 0;
    uint32_t *raw = malloc(sizeof *raw * (m->nact + 1));
    REQUIRE(raw, "out of memory");
    for (uint32_t i = 0; i < m->nact; i++)
        if (m->ent[m->act[i]].kind == E_RAW)
            raw[n++] = m->act[i];
    sort_model = m;
    qsort(raw, n, sizeof *raw, cmp_offset);
    int armed = sel >> 4 & 1;
    fp_arena_t *view = view_of(m, sel >> 5);
    for (uint32_t i = sel >> 6 & 1; i < n; i += stride) {
        check_pattern(m, raw[i], "before its free");
        if (armed)
            fp_arena_test_free_armed(view, raw[i]);
        else
            fp_arena_free(view, raw[i], NULL);
        freed(m, raw[i], armed);
    }
    free(raw);
}

static void op_complete(model_t *m, input_t *in, int all)
{
    uint8_t k = in_u8(in);
    for (;;) {
        uint32_t b = pick(m, 1u << E_FREED, UNDONE_EVENT, k);
        if (b == FP_NIL)
            return;
        /* The "GPU" read the block up to now: it must have held. */
        check_pattern(m, b, "when its event completed");
        m->ent[b].done = 1;
        if (!all)
            return;
    }
}

static void op_collect(model_t *m, input_t *in)
{
    fp_arena_t *view = view_of(m, in_u8(in));
    fp_arena_collect(view);
    resolve_collect_all(m, view);
}

/* Reads the stats (which collects) and checks them against the model. */
static void op_stats(model_t *m, input_t *in)
{
    fp_arena_t *view = view_of(m, in_u8(in));
    fp_arena_stats_t s;
    fp_arena_stats(view, &s);
    resolve_collect_all(m, view);
    uint32_t blocks = 0, pending = 0, maybe = 0;
    uint64_t bytes = 0, requested = 0, bytes_pending = 0;
    uint64_t maybe_bytes = 0, maybe_requested = 0;
    static uint32_t per_class[FP_CLASS_COUNT];
    memset(per_class, 0, sizeof per_class);
    for (uint32_t i = 0; i < m->nact; i++) {
        ent_t *e = &m->ent[m->act[i]];
        if (e->kind == E_FREED && e->maybe) {
            maybe++;
            maybe_bytes += e->size;
            maybe_requested += e->requested;
            continue;
        }
        blocks++;
        bytes += e->size;
        requested += e->requested;
        per_class[fp_arena_class(e->size)]++;
        if (e->kind == E_FREED) {
            pending++;
            bytes_pending += e->size;
        }
    }
#define SAME(field, expected)                                                       \
    REQUIRE((uint64_t)s.field == (uint64_t)(expected), "stats: " #field " is %llu, " \
            "the model says %llu", (unsigned long long)s.field,                      \
            (unsigned long long)(expected))
#define WITHIN(field, lo, extra)                                                     \
    REQUIRE((uint64_t)s.field >= (uint64_t)(lo) &&                                   \
            (uint64_t)s.field <= (uint64_t)(lo) + (uint64_t)(extra),                 \
            "stats: " #field " is %llu, the model says %llu to %llu",                \
            (unsigned long long)s.field, (unsigned long long)(lo),                   \
            (unsigned long long)((lo) + (extra)))
    SAME(capacity, m->capacity);
    SAME(max_blocks, m->max_blocks);
    SAME(registered, 0);
    SAME(shared, m->shared);
    WITHIN(blocks_in_use, blocks, maybe);
    WITHIN(bytes_in_use, bytes, maybe_bytes);
    WITHIN(bytes_requested, requested, maybe_requested);
    WITHIN(blocks_pending, pending, maybe);
    WITHIN(bytes_pending, bytes_pending, maybe_bytes);
    if (!maybe)
        for (uint32_t c = 0; c < FP_CLASS_COUNT; c++)
            REQUIRE(s.class_blocks[c] == per_class[c],
                    "stats: %u blocks in class %u, the model says %u", s.class_blocks[c], c,
                    per_class[c]);
    SAME(allocs, m->allocs);
    SAME(failed, m->failed);
    SAME(waits, 0);
    SAME(fallbacks, m->fallbacks);
    SAME(lock_recoveries, 0);
    SAME(reclaimed, 0);
    SAME(blocks_foreign, 0);
    REQUIRE(s.high_water >= s.bytes_in_use && s.high_water >= m->high_water &&
            s.high_water <= m->capacity,
            "stats: high water %llu with %llu in use, %llu seen before",
            (unsigned long long)s.high_water, (unsigned long long)s.bytes_in_use,
            (unsigned long long)m->high_water);
    m->high_water = s.high_water;
#undef SAME
#undef WITHIN
}

static void orphan(model_t *m, fp_lease_t *lease, int refs)
{
    if (m->norphans == MAX_ORPHANS) {
        while (refs--)
            fp_lease_decref(lease);
        return;
    }
    m->orphans[m->norphans++] = (orphan_t){lease, refs};
}

/* incref, decref, or drop an orphan's reference. */
static void op_lease_ref(model_t *m, input_t *in)
{
    uint8_t sel = in_u8(in);
    uint8_t k = in_u8(in);
    if (sel % 4 == 3) {
        if (!m->norphans)
            return;
        orphan_t *o = &m->orphans[k % m->norphans];
        fp_lease_decref(o->lease); /* detached: frees nothing */
        if (--o->refs == 0)
            *o = m->orphans[--m->norphans];
        return;
    }
    uint32_t b = pick(m, 1u << E_LEASE | 1u << E_DETACHED_HELD | 1u << E_ADOPTED, ANY_EVENT, k);
    if (b == FP_NIL)
        return;
    ent_t *e = &m->ent[b];
    if (sel % 4 == 0 && e->refs < 4) {
        fp_lease_incref(e->lease);
        e->refs++;
        return;
    }
    check_pattern(m, b, "before a lease release");
    fp_lease_t *lease = e->lease;
    int last = --e->refs == 0;
    fp_lease_decref(lease);
    if (!last)
        return;
    if (e->kind == E_DETACHED_HELD) {
        e->kind = E_DETACHED;
        e->lease = NULL;
    } else {
        freed(m, b, 0); /* no CUDA: the lease's consumer is NULL */
    }
}

static void op_detach(model_t *m, input_t *in)
{
    uint32_t b = pick(m, 1u << E_LEASE | 1u << E_DETACHED_HELD | 1u << E_ADOPTED, ANY_EVENT,
                      in_u8(in));
    if (b == FP_NIL)
        return;
    ent_t *e = &m->ent[b];
    int status = fp_lease_detach(e->lease);
    if (e->kind == E_ADOPTED) {
        REQUIRE(status == FP_EINVAL && strstr(fp_error_message(), "adopted"),
                "detaching adopted block %u: status %d", b, status);
        return;
    }
    REQUIRE(status == FP_OK, "detaching block %u (%s): status %d", b, kind_name(e->kind), status);
    e->kind = E_DETACHED_HELD;
}

static void op_adopt(model_t *m, input_t *in)
{
    uint8_t sel = in_u8(in);
    uint8_t k = in_u8(in);
    uint32_t b;
    if (sel % 8 == 0)
        b = (uint32_t)in_u16(in) % (m->max_blocks + 2); /* any index, even out of range */
    else
        b = pick(m, LIVE_KINDS | 1u << E_FREED, ANY_EVENT, k);
    if (b == FP_NIL)
        return;
    ent_t *e = b < m->max_blocks ? &m->ent[b] : NULL;
    uint64_t size = e ? e->requested : 0;
    if (sel & 0x10)
        size += (sel & 0x20) ? 1 : (uint64_t)-1; /* the wrong size */
    fp_arena_t *view = view_of(m, sel >> 6);
    fp_lease_t *lease = NULL;
    int status = fp_lease_adopt(view, b, size, &lease);
    int ok = view == m->a && e && (e->kind == E_RAW || e->kind == E_DETACHED_HELD ||
                                   e->kind == E_DETACHED) && size == e->requested;
    if (!ok) {
        REQUIRE(status == FP_EINVAL && !lease, "adopting block %u (%s, %llu bytes asked) as "
                "%llu bytes through the %s: status %d, expected FP_EINVAL",
                b, e ? kind_name(e->kind) : "out of range",
                (unsigned long long)(e ? e->requested : 0), (unsigned long long)size,
                view == m->a ? "creator" : "attached view", status);
        return;
    }
    REQUIRE(status == FP_OK && lease, "adopting block %u (%s): status %d", b,
            kind_name(e->kind), status);
    REQUIRE(lease->block == b && lease->size == size &&
            lease->ptr == (char *)fp_arena_base(m->a) + e->offset,
            "the lease adopting block %u does not name it", b);
    check_pattern(m, b, "after its adoption");
    if (e->kind == E_DETACHED_HELD)
        orphan(m, e->lease, e->refs);
    e->kind = E_ADOPTED;
    e->lease = lease;
    e->refs = 1;
    e->owner = 0;
}

static void op_owner(model_t *m, input_t *in)
{
    uint32_t b = (uint32_t)in_u16(in) % (m->max_blocks + 2);
    if (in_u8(in) & 1) {
        uint32_t p = pick(m, LIVE_KINDS | 1u << E_FREED, ANY_EVENT, b);
        if (p != FP_NIL)
            b = p;
    }
    pid_t owner = -1;
    int status = fp_arena_owner(m->a, b, &owner);
    ent_t *e = b < m->max_blocks ? &m->ent[b] : NULL;
    if (!e || e->kind == E_NONE) {
        REQUIRE(status == FP_EINVAL, "owner of block %u (%s): status %d", b,
                e ? "free" : "out of range", status);
    } else if (LIVE_KINDS >> e->kind & 1) {
        REQUIRE(status == FP_OK && owner == e->owner, "owner of %s block %u: status %d, pid %d, "
                "expected %d", kind_name(e->kind), b, status, (int)owner, e->owner);
    } else if (e->armed && !e->done) {
        REQUIRE(status == FP_OK, "owner of block %u, freed behind an event in flight: status %d",
                b, status);
    } /* else freed, maybe retired: either answer */
}

static void op_misc(model_t *m, input_t *in)
{
    uint8_t sel = in_u8(in);
    switch (sel % 4) {
    case 0: { /* every owner is this process: nothing to reclaim */
        uint32_t freed = 1;
        REQUIRE(fp_arena_reclaim(view_of(m, sel >> 2), &freed) == FP_OK && freed == 0,
                "reclaim freed a live block");
        break;
    }
    case 1:
        fp_arena_count_fallback(view_of(m, sel >> 2));
        m->fallbacks++;
        break;
    case 2:
        check_all_patterns(m, "in a full check");
        break;
    default:
        REQUIRE(fp_arena_round(sel) == ref_round(sel) &&
                fp_arena_class(fp_arena_round(sel)) == (uint32_t)(fp_arena_round(sel) / FP_GRANULE),
                "size classes below 4 KiB are wrong");
        break;
    }
}

/* ---- one input ---------------------------------------------------------- */

static const uint64_t capacities[] = {4096, 64 << 10, 200 << 10, 1 << 20};

/* The largest size whose rounding stays within `capacity`. */
static uint64_t largest_fit(uint64_t capacity)
{
    uint64_t units = capacity / FP_GRANULE;
    if (units < FP_SL_COUNT)
        return units * FP_GRANULE;
    uint64_t top = 1;
    while (top * 2 <= units)
        top *= 2;
    uint64_t step = top / FP_SL_COUNT;
    return units / step * step * FP_GRANULE;
}

/* Frees everything, completes every event, and checks that the whole
 * capacity is one free block again. */
static void finish(model_t *m)
{
    step_no++;
    for (uint32_t i = 0; i < m->norphans; i++)
        while (m->orphans[i].refs--)
            fp_lease_decref(m->orphans[i].lease);
    m->norphans = 0;
    /* Every holder lets go: detached blocks are adopted first. */
    for (uint32_t i = 0; i < m->nact; i++) {
        uint32_t b = m->act[i];
        ent_t *e = &m->ent[b];
        if (e->kind == E_FREED)
            continue;
        check_pattern(m, b, "at the end");
        if (e->kind == E_DETACHED_HELD) {
            while (e->refs--)
                fp_lease_decref(e->lease);
            e->kind = E_DETACHED;
        }
        if (e->kind == E_DETACHED) {
            fp_lease_t *lease = NULL;
            REQUIRE(fp_lease_adopt(m->a, b, e->requested, &lease) == FP_OK,
                    "adopting detached block %u at the end", b);
            e->kind = E_ADOPTED;
            e->lease = lease;
            e->refs = 1;
        }
        if (e->kind == E_RAW)
            fp_arena_free(m->a, b, NULL);
        else
            while (e->refs--)
                fp_lease_decref(e->lease);
        freed(m, b, 0);
    }
    /* The "GPU" finishes, in the order the blocks sit in the model. */
    for (uint32_t i = 0; i < m->nact; i++) {
        ent_t *e = &m->ent[m->act[i]];
        if (e->armed && !e->done) {
            check_pattern(m, m->act[i], "when its event completed");
            e->done = 1;
        }
    }
    fp_arena_collect(m->a);
    resolve_collect_all(m, m->a);
    REQUIRE(m->nact == 0, "%u blocks freed, events done, are still pending after a collect",
            m->nact);
    fp_arena_stats_t s;
    fp_arena_stats(m->a, &s);
    REQUIRE(s.blocks_in_use == 0 && s.bytes_in_use == 0 && s.bytes_requested == 0 &&
            s.blocks_pending == 0 && s.bytes_pending == 0 && s.allocs == m->allocs,
            "everything freed, yet %u blocks (%llu bytes, %u pending) are in use",
            s.blocks_in_use, (unsigned long long)s.bytes_in_use, s.blocks_pending);
    /* Valid with nothing in use means one free block: no two free blocks
     * may sit side by side. */
    REQUIRE(fp_arena_is_valid(m->a), "fp_arena_is_valid at the end");
    /* And it is handed out whole, from the start of the region. */
    uint64_t whole = largest_fit(m->capacity);
    uint32_t b;
    void *p;
    int status = fp_arena_alloc(m->a, whole, &b, &p);
    REQUIRE(status == FP_OK && p == fp_arena_base(m->a) &&
            fp_arena_test_block_size(m->a, b) >= whole,
            "everything freed, yet %llu bytes of the %llu are not one block: status %d",
            (unsigned long long)whole, (unsigned long long)m->capacity, status);
    if (whole == m->capacity) {
        REQUIRE(fp_arena_test_block_size(m->a, b) == m->capacity, "the whole block is short");
    } else {
        /* The rest: just past it, in one piece as far as classes allow. */
        uint64_t rest = largest_fit(m->capacity - whole);
        uint32_t b2;
        void *p2;
        REQUIRE(rest && fp_arena_alloc(m->a, rest, &b2, &p2) == FP_OK &&
                (char *)p2 == (char *)p + fp_arena_test_block_size(m->a, b),
                "everything freed, yet the %llu bytes past the first %llu are not free",
                (unsigned long long)rest, (unsigned long long)whole);
        fp_arena_free(m->a, b2, NULL);
    }
    fp_arena_free(m->a, b, NULL);
    fp_arena_collect(m->a);
    REQUIRE(fp_arena_is_valid(m->a), "fp_arena_is_valid after the last free");
}

static void run_one(const uint8_t *data, size_t size)
{
    input_t in = {data, size};
    uint8_t h0 = in_u8(&in), h1 = in_u8(&in);
    model_t m = {0};
    m.capacity = capacities[h0 % 4] + (h0 >> 2 & 3) * FP_GRANULE + (h0 >> 4 & 1);
    m.exact = !(h0 & 0x20);
    m.shared = !!(h0 & 0x40);
    m.pid = (int)getpid();
    uint32_t max_blocks = m.exact ? 0 : 2 + h1 % 24;
    int status = fp_arena_create(&m.a, m.capacity, max_blocks,
                                 FP_ARENA_NO_CUDA | (m.shared ? FP_ARENA_SHARED : 0), 0);
    REQUIRE(status == FP_OK, "fp_arena_create of %llu bytes: status %d",
            (unsigned long long)m.capacity, status);
    m.capacity = (m.capacity + FP_GRANULE - 1) / FP_GRANULE * FP_GRANULE;
    REQUIRE(fp_arena_capacity(m.a) == m.capacity, "capacity %llu, expected %llu",
            (unsigned long long)fp_arena_capacity(m.a), (unsigned long long)m.capacity);
    fp_arena_stats_t s;
    fp_arena_stats(m.a, &s);
    m.max_blocks = s.max_blocks;
    /* The default table has a descriptor for every granule and one more:
     * every split finds one. */
    REQUIRE(!m.exact || m.max_blocks > m.capacity / FP_GRANULE,
            "the default table has %u descriptors for %llu granules", m.max_blocks,
            (unsigned long long)(m.capacity / FP_GRANULE));
    if (m.shared) {
        status = fp_arena_attach(&m.w, fp_arena_fd(m.a));
        REQUIRE(status == FP_OK, "fp_arena_attach: status %d", status);
        REQUIRE(fp_arena_attached(m.w) && !fp_arena_attached(m.a) &&
                fp_arena_token(m.w) == fp_arena_token(m.a) &&
                fp_arena_capacity(m.w) == m.capacity && !fp_arena_registered(m.w),
                "the attached view does not match its arena");
    }
    m.ent = calloc(m.max_blocks, sizeof *m.ent);
    m.act = calloc(m.max_blocks, sizeof *m.act);
    REQUIRE(m.ent && m.act, "out of memory");
    cur = &m;
    fp_test_event_done = fake_event_done;

    for (step_no = 0; in.left; step_no++) {
        uint8_t op = in_u8(&in);
        switch (op % 20) {
        case 0: case 1: case 2: case 3:
            op_alloc(&m, &in, 0);
            break;
        case 4:
            op_alloc(&m, &in, 1);
            break;
        case 5: case 6:
            op_free(&m, &in, 0);
            break;
        case 7: case 8:
            op_free(&m, &in, 1);
            break;
        case 9:
            op_free_stride(&m, &in);
            break;
        case 10: case 11:
            op_complete(&m, &in, op & 0x80 ? 1 : 0);
            break;
        case 12:
            op_collect(&m, &in);
            break;
        case 13:
            op_stats(&m, &in);
            break;
        case 14:
            op_lease_alloc(&m, &in);
            break;
        case 15:
            op_lease_ref(&m, &in);
            break;
        case 16:
            op_detach(&m, &in);
            break;
        case 17:
            op_adopt(&m, &in);
            break;
        case 18:
            op_owner(&m, &in);
            break;
        default:
            op_misc(&m, &in);
            break;
        }
        REQUIRE(fp_arena_is_valid(m.a), "fp_arena_is_valid after op %u", op % 20);
    }
    finish(&m);

    fp_test_event_done = NULL;
    cur = NULL;
    if (m.w)
        fp_arena_decref(m.w);
    fp_arena_decref(m.a);
    free(m.ent);
    free(m.act);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    run_one(data, size);
    return 0;
}

/* ---- a driver for compilers without libFuzzer --------------------------- */

#ifdef FUZZ_ARENA_MAIN
#include "fuzz_driver.h"

enum { INPUT_MAX = 4096, MAX_SEEDS = 1024 };

typedef struct {
    uint8_t *data;
    size_t size;
} seed_t;

static seed_t seeds[MAX_SEEDS];
static size_t nseeds;
static unsigned long cases;

static void replay_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        exit(2);
    }
    uint8_t *buf = malloc(INPUT_MAX);
    size_t n = buf ? fread(buf, 1, INPUT_MAX, f) : 0;
    fclose(f);
    if (!buf)
        exit(2);
    run_one(buf, n);
    cases++;
    if (nseeds < MAX_SEEDS)
        seeds[nseeds++] = (seed_t){buf, n};
    else
        free(buf);
}

/* Replays the files and folders named, then runs FUZZ_CASES inputs (default
 * 2000): random bytes, or a replayed input with a few bytes changed. The
 * seed is FUZZ_SEED (default 1). */
int main(int argc, char **argv)
{
    unsigned long n = fuzz_start(argc, argv, replay_file);
    static uint8_t buf[INPUT_MAX];
    for (unsigned long c = 0; c < n; c++) {
        size_t len;
        if (nseeds && rng() % 2) {
            seed_t *s = &seeds[rng() % nseeds];
            len = s->size;
            memcpy(buf, s->data, len);
            for (int k = 1 + (int)(rng() % 8); k-- && len;)
                buf[rng() % len] = (uint8_t)rng();
            if (rng() % 4 == 0 && len < INPUT_MAX) /* a longer tail */
                for (size_t extra = rng() % (INPUT_MAX - len + 1); extra--;)
                    buf[len++] = (uint8_t)rng();
        } else {
            len = 1 + rng() % (rng() % 4 ? 512 : INPUT_MAX);
            for (size_t i = 0; i < len; i++)
                buf[i] = (uint8_t)rng();
        }
        run_one(buf, len);
        cases++;
    }
    for (size_t i = 0; i < nseeds; i++)
        free(seeds[i].data);
    printf("fuzz_arena: %lu cases\n", cases);
    return 0;
}
#endif
