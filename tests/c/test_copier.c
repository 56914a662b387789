/* Tests for the copy engine (copier.c): every byte of every copy, runs from
 * many threads at once, pool lifetimes, fork. Exits non-zero on failure. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "fastpin.h"

#define CHUNK FP_COPIER_CHUNK
#define CHUNK_MIN FP_COPIER_CHUNK_MIN
#define INLINE FP_COPIER_INLINE
#define STREAM FP_COPIER_STREAM
#define GUARD 64 /* bytes checked untouched on each side of a destination */

/* Sanitizers: the same shapes, fewer iterations. Every large free costs
 * tsan a page-in of shadow memory, so it gets the fewest. */
#if defined(__SANITIZE_THREAD__)
#define SLOW 8
#elif defined(__SANITIZE_ADDRESS__)
#define SLOW 4
#else
#define SLOW 1
#endif

static uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* A pattern that differs per byte and per `seed`, so a stale or unwritten
 * byte shows. */
static void fill(unsigned char *p, size_t n, uint64_t seed)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v = mix(seed * 0x100000001b3ull + i);
        memcpy(p + i, &v, 8);
    }
    for (; i < n; i++)
        p[i] = (unsigned char)(mix(seed ^ (i << 20)) | 1);
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (p == NULL) {
        fprintf(stderr, "out of memory (%zu bytes)\n", n);
        exit(2);
    }
    return p;
}

/* One destination with guards on both sides, and its source. */
typedef struct buf_s {
    unsigned char *src_base; /* allocation holding src */
    unsigned char *dst_base; /* allocation holding guard, dst, guard */
    unsigned char *src;      /* src_base + source offset */
    unsigned char *dst;      /* dst_base + GUARD + destination offset */
    size_t size;             /* bytes to copy */
    size_t dst_span;         /* bytes of dst_base */
    unsigned char before[GUARD + 128]; /* dst_base up to dst, as filled */
    unsigned char after[GUARD];        /* dst_base past dst + size */
} buf_t;

static void buf_init(buf_t *b, size_t size, size_t src_off, size_t dst_off,
                     uint64_t seed)
{
    b->size = size;
    b->src_base = xmalloc(size + src_off);
    b->dst_span = GUARD + dst_off + size + GUARD;
    b->dst_base = xmalloc(b->dst_span);
    b->src = b->src_base + src_off;
    b->dst = b->dst_base + GUARD + dst_off;
    fill(b->src, size, seed);
    fill(b->dst_base, b->dst_span, ~seed);
    memcpy(b->before, b->dst_base, GUARD + dst_off);
    memcpy(b->after, b->dst + size, GUARD);
}

/* Every copied byte equals its source; the guards around it still hold what
 * they held before the run. Returns 1 when right. */
static int buf_verify(const buf_t *b, const char *what)
{
    if (b->size > 0 && memcmp(b->dst, b->src, b->size) != 0) {
        size_t i = 0;
        while (b->dst[i] == b->src[i])
            i++;
        fprintf(stderr, "FAIL %s: %zu bytes: first wrong byte at %zu "
                        "(got %02x, want %02x)\n",
                what, b->size, i, b->dst[i], b->src[i]);
        fp_atomic_add_acq_rel(&failures, 1);
        return 0;
    }
    size_t lo = (size_t)(b->dst - b->dst_base);
    int ok = memcmp(b->before, b->dst_base, lo) == 0 &&
             memcmp(b->after, b->dst + b->size, GUARD) == 0;
    if (!ok) {
        fprintf(stderr, "FAIL %s: %zu bytes: wrote outside the destination\n",
                what, b->size);
        fp_atomic_add_acq_rel(&failures, 1);
    }
    return ok;
}

static void buf_free(buf_t *b)
{
    free(b->src_base);
    free(b->dst_base);
}

/* Copies `n` buffers of the given sizes in one run and checks them. */
static void check_run(fp_copier_t *c, const size_t *sizes, size_t n,
                      size_t src_off, size_t dst_off, uint64_t seed,
                      const char *what)
{
    buf_t *bufs = xmalloc(n * sizeof *bufs);
    fp_copy_t *copies = xmalloc(n * sizeof *copies);
    for (size_t i = 0; i < n; i++) {
        buf_init(&bufs[i], sizes[i], (src_off + i) % 61, (dst_off + i) % 67,
                 seed * 1000003u + i);
        copies[i] = (fp_copy_t){bufs[i].dst, bufs[i].src, sizes[i]};
    }
    int rc = fp_copier_run(c, copies, n);
    CHECK(rc == FP_OK, "%s: run returned %d: %s", what, rc,
          fp_error_message());
    for (size_t i = 0; i < n; i++)
        if (!buf_verify(&bufs[i], what))
            break;
    for (size_t i = 0; i < n; i++)
        buf_free(&bufs[i]);
    free(bufs);
    free(copies);
}

static void check_single(fp_copier_t *c, size_t size, size_t src_off,
                         size_t dst_off, uint64_t seed)
{
    char what[128];
    snprintf(what, sizeof what, "threads=%d size=%zu src+%zu dst+%zu",
             fp_copier_threads(c), size, src_off, dst_off);
    check_run(c, &size, 1, src_off, dst_off, seed, what);
}

/* Sizes around every boundary the copier has: the inline threshold, the
 * smallest and the largest chunk, plus a big one. */
static void test_sizes(fp_copier_t *c, uint64_t seed)
{
    const size_t sizes[] = {
        0, 1, 255, 4096, INLINE - 1, INLINE, INLINE + 1,
        CHUNK_MIN - 1, CHUNK_MIN + 1, 3 * CHUNK_MIN + 7,
        CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 1, 5 * CHUNK - 3,
        (size_t)64 << 20,
    };
    const size_t offs[][2] = {{0, 0}, {1, 0}, {0, 3}, {7, 13}, {63, 1}};
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++)
        for (size_t o = 0; o < sizeof offs / sizeof *offs; o++) {
            if (sizes[s] >= ((size_t)64 << 20) && o > 1)
                continue; /* two shapes of the big one are enough */
            check_single(c, sizes[s], offs[o][0], offs[o][1],
                         seed + s * 16 + o);
        }
}

/* Streaming stores: runs around FP_COPIER_STREAM, at every misalignment of
 * the 16-byte stores and with ends shorter than one 64-byte step, runs of
 * tiny entries past it, and the same with streaming off. */
static void test_streaming(fp_copier_t *c, uint64_t seed)
{
    const size_t sizes[] = {STREAM - 1, STREAM, STREAM + 1, STREAM + 63, 3 * STREAM + 5};
    const size_t offs[][2] = {{0, 0}, {0, 1}, {5, 15}, {9, 8}, {60, 63}};
    for (int on = 1; on >= 0; on--) {
        fp_copier_set_streaming(c, on);
        int have = fp_copier_streams(c);
#if defined(__x86_64__)
        CHECK(have == on, "streams() is %d after set_streaming(%d)", have, on);
#else
        CHECK(have == 0, "streams() is %d on a CPU without streaming stores", have);
#endif
        for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++)
            for (size_t o = 0; o < sizeof offs / sizeof *offs; o++)
                check_single(c, sizes[s], offs[o][0], offs[o][1], seed + s * 16 + o);
        enum { N = 70000 };
        size_t *tiny = xmalloc(N * sizeof *tiny);
        /* ~4.5 MB of entries of 0 to 129 bytes, and every 1000th of 4095 to
         * 4097, around the smallest entry that is streamed. */
        for (size_t i = 0; i < N; i++)
            tiny[i] = i % 1000 == 0 ? 4095 + (i / 1000) % 3 : mix(seed + i) % 130;
        char what[96];
        snprintf(what, sizeof what, "threads=%d streaming=%d 70000 tiny",
                 fp_copier_threads(c), have);
        check_run(c, tiny, N, 3, 7, seed + 99, what);
        free(tiny);
    }
    fp_copier_set_streaming(c, 1);
}

/* Many entries in one run: tiny ones (grouped into chunks), tiny ones
 * between large ones, empty ones. */
static void test_many(fp_copier_t *c, uint64_t seed)
{
    enum { N = 10000 };
    size_t *sizes = xmalloc(N * sizeof *sizes);
    char what[96];

    for (size_t i = 0; i < N; i++)
        sizes[i] = 1 + mix(seed + i) % 400; /* ~2 MB: goes to the pool */
    snprintf(what, sizeof what, "threads=%d 10000 tiny",
             fp_copier_threads(c));
    check_run(c, sizes, N, 0, 0, seed, what);

    for (size_t i = 0; i < N; i++)
        sizes[i] = mix(seed + i) % 24; /* some empty, ~115 KB: inline */
    snprintf(what, sizeof what, "threads=%d 10000 tiny, inline",
             fp_copier_threads(c));
    check_run(c, sizes, N, 5, 9, seed + 1, what);

    size_t mixed[] = {0, 3, CHUNK + 5, 0, 0, 1, 17, 3 * CHUNK_MIN, 2,
                      CHUNK - 1, 0, 300000, 1, 0};
    snprintf(what, sizeof what, "threads=%d mixed", fp_copier_threads(c));
    check_run(c, mixed, sizeof mixed / sizeof *mixed, 3, 1, seed + 2, what);

    size_t empties[] = {0, 0, 0};
    check_run(c, empties, 3, 0, 0, seed + 3, "all empty");
    CHECK(fp_copier_run(c, NULL, 0) == FP_OK, "empty run: %s",
          fp_error_message());
    free(sizes);
}

static void test_bad_input(fp_copier_t *c)
{
    unsigned char a[16] = {1, 2, 3}, b[16] = {4, 5, 6};
    fp_copy_t bad = {NULL, a, sizeof a};
    CHECK(fp_copier_run(c, &bad, 1) == FP_EINVAL, "NULL dst accepted");
    CHECK(strstr(fp_error_message(), "NULL") != NULL, "message: %s",
          fp_error_message());
    CHECK(fp_copier_run(c, NULL, 2) == FP_EINVAL, "NULL copies accepted");
    fp_copy_t empty = {NULL, NULL, 0};
    CHECK(fp_copier_run(c, &empty, 1) == FP_OK, "NULL with 0 bytes refused");
    fp_copy_t overflow[2] = {{b, a, SIZE_MAX}, {b, a, 2}};
    CHECK(fp_copier_run(c, overflow, 2) == FP_EINVAL, "overflow accepted");
    CHECK(b[0] == 4, "bad run wrote");
}

/* ---- many callers at once ----------------------------------------------- */

typedef struct caller_s {
    fp_copier_t *copier; /* shared by all callers */
    int id;              /* which caller */
    int iterations;      /* runs to make */
} caller_t;

static void *caller_main(void *arg)
{
    caller_t *t = arg;
    /* Shapes that take every path: inline, one chunk, many chunks, many
     * entries, a mix. */
    static const size_t shapes[][4] = {
        {100, 0, 0, 0},
        {INLINE + 3, 0, 0, 0},
        {CHUNK + 1, 5, 0, 0},
        {3 * CHUNK + 11, 0, 0, 0},
        {CHUNK_MIN, CHUNK_MIN + 1, 77, 1 << 20},
        {0, 1, 0, 400000},
    };
    const size_t nshapes = sizeof shapes / sizeof *shapes;
    for (int it = 0; it < t->iterations; it++) {
        const size_t *sizes = shapes[(size_t)(it + t->id) % nshapes];
        char what[64];
        snprintf(what, sizeof what, "caller %d iteration %d", t->id, it);
        check_run(t->copier, sizes, 4, (size_t)it % 9, (size_t)t->id,
                  ((uint64_t)t->id << 32) + (uint64_t)it, what);
    }
    return NULL;
}

static void test_concurrent(int threads, int callers, int iterations)
{
    fp_copier_t *c;
    int rc = fp_copier_create(&c, threads);
    CHECK(rc == FP_OK, "create(%d): %s", threads, fp_error_message());
    if (rc != FP_OK)
        return;
    pthread_t tid[16];
    caller_t args[16];
    for (int i = 0; i < callers; i++) {
        args[i] = (caller_t){c, i, iterations};
        if (pthread_create(&tid[i], NULL, caller_main, &args[i]) != 0) {
            fprintf(stderr, "FAIL: pthread_create\n");
            exit(2);
        }
    }
    for (int i = 0; i < callers; i++)
        pthread_join(tid[i], NULL);
    fp_copier_destroy(c);
}

/* ---- lifetimes, arguments, fork ---------------------------------------- */

static void test_create_destroy(int loops)
{
    for (int i = 0; i < loops; i++) {
        fp_copier_t *c;
        int threads = 1 + i % 6;
        int rc = fp_copier_create(&c, threads);
        CHECK(rc == FP_OK, "create(%d): %s", threads, fp_error_message());
        if (rc != FP_OK)
            return;
        CHECK(fp_copier_threads(c) == threads, "threads %d != %d",
              fp_copier_threads(c), threads);
        if (i % 3 == 0) {
            size_t size = CHUNK + (size_t)i;
            check_run(c, &size, 1, (size_t)i % 7, 0, (uint64_t)i + 5000,
                      "create/destroy loop");
        }
        fp_copier_destroy(c);
    }
    fp_copier_destroy(NULL);
}

static void test_threads_arg(void)
{
    fp_copier_t *c = (fp_copier_t *)&c; /* must be reset on failure */
    CHECK(fp_copier_create(&c, -1) == FP_EINVAL, "threads=-1 accepted");
    CHECK(c == NULL, "out not cleared on failure");
    CHECK(strstr(fp_error_message(), "-1") != NULL, "message: %s",
          fp_error_message());
    CHECK(fp_copier_create(NULL, 1) == FP_EINVAL, "NULL out accepted");

    int ncpu = fp_cpu_count();
    CHECK(ncpu >= 1, "fp_cpu_count() = %d", ncpu);
    int want = ncpu < FP_COPIER_MAX_DEFAULT ? ncpu : FP_COPIER_MAX_DEFAULT;
    CHECK(fp_copier_create(&c, 0) == FP_OK, "create(0): %s",
          fp_error_message());
    CHECK(fp_copier_threads(c) == want, "threads=0 gave %d, want %d",
          fp_copier_threads(c), want);
    fp_copier_destroy(c);
}

/* With `spin`, the fork comes while the workers spin. */
static void test_fork(uint64_t spin)
{
    fp_copier_t *c;
    if (fp_copier_create(&c, 3) != FP_OK) {
        CHECK(0, "create(3): %s", fp_error_message());
        return;
    }
    fp_copier_set_spin(c, spin);
    size_t size = 3 * CHUNK;
    check_run(c, &size, 1, 0, 0, 99, "before fork");

    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        unsigned char a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[8] = {0};
        fp_copy_t one = {b, a, sizeof a};
        int code = 0;
        if (fp_copier_run(c, &one, 1) != FP_EINVAL)
            code |= 1;
        else if (strstr(fp_error_message(), "copier belongs to process") ==
                 NULL)
            code |= 2;
        if (b[0] != 0)
            code |= 4;
        fp_copier_destroy(c); /* must neither hang nor crash */
#ifndef __SANITIZE_THREAD__ /* tsan refuses new threads after fork */
        fp_copier_t *fresh;
        if (fp_copier_create(&fresh, 2) != FP_OK)
            code |= 8;
        else {
            size_t big = 2 * CHUNK;
            check_run(fresh, &big, 1, 1, 1, 7, "fresh copier in child");
            if (fp_atomic_load_acquire(&failures))
                code |= 16;
            fp_copier_destroy(fresh);
        }
#endif
        if (code)
            fprintf(stderr, "child: %s\n", fp_error_message());
        _exit(code);
    }
    CHECK(pid > 0, "fork failed");
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "child failed: status %#x", status);
    check_run(c, &size, 1, 0, 0, 100, "after fork, parent");
    fp_copier_destroy(c);
}

/* ---- spinning workers (fp_copier_set_spin) ------------------------------ */

#define INLINE_SPIN FP_COPIER_INLINE_SPIN
#define CHUNK_MIN_SPIN FP_COPIER_CHUNK_MIN_SPIN
/* Long enough that workers are still spinning when the next run comes, even
 * under the sanitizers; whether they are is never asserted (timing). */
#define SPIN_NS ((uint64_t)5000000)

/* Sizes just below, at and above every cut-over: the spin-only range's ends,
 * its smallest chunk, the inline threshold, the chunks, streaming. */
static const size_t spin_sizes[] = {
    CHUNK_MIN_SPIN - 1, CHUNK_MIN_SPIN, CHUNK_MIN_SPIN + 1,
    INLINE_SPIN - 1, INLINE_SPIN, INLINE_SPIN + 1, 2 * INLINE_SPIN + 3,
    INLINE - 1, INLINE, INLINE + 1,
    CHUNK_MIN - 1, CHUNK_MIN, CHUNK_MIN + 1,
    CHUNK - 1, CHUNK, CHUNK + 1,
    STREAM - 1, STREAM, STREAM + 1,
};
#define NSPIN_SIZES (sizeof spin_sizes / sizeof *spin_sizes)

static void test_spin_setter(void)
{
    fp_copier_t *c;
    if (fp_copier_create(&c, 3) != FP_OK) {
        CHECK(0, "create(3): %s", fp_error_message());
        return;
    }
    CHECK(fp_copier_spin_ns(c) == 0, "spin starts at %llu, not 0",
          (unsigned long long)fp_copier_spin_ns(c));
    CHECK(fp_copier_set_spin(c, FP_COPIER_SPIN_MAX) == FP_OK, "max refused: %s",
          fp_error_message());
    CHECK(fp_copier_spin_ns(c) == FP_COPIER_SPIN_MAX, "spin not set");
    CHECK(fp_copier_set_spin(c, FP_COPIER_SPIN_MAX + 1) == FP_EINVAL, "past max accepted");
    CHECK(strstr(fp_error_message(), "spin") != NULL, "message: %s", fp_error_message());
    CHECK(fp_copier_spin_ns(c) == FP_COPIER_SPIN_MAX, "a refused value changed spin");
    CHECK(fp_copier_set_spin(NULL, 1) == FP_EINVAL, "NULL copier accepted");
    CHECK(fp_copier_set_spin(c, 0) == FP_OK, "0 refused");
    fp_copier_destroy(c);
}

/* A run larger than FP_COPIER_INLINE (so workers copy, then spin), then at
 * once the run of `size` under test, then both checked. */
static void check_after_warm(fp_copier_t *c, size_t size, size_t off, uint64_t seed,
                             const char *what)
{
    buf_t warm, b;
    buf_init(&warm, 2 * CHUNK + 1, 0, 0, seed ^ 0x5555);
    buf_init(&b, size, off % 61, off % 67, seed);
    fp_copy_t w = {warm.dst, warm.src, warm.size}, one = {b.dst, b.src, b.size};
    int rc = fp_copier_run(c, &w, 1);
    int rc2 = fp_copier_run(c, &one, 1);
    CHECK(rc == FP_OK && rc2 == FP_OK, "%s: runs returned %d, %d: %s", what, rc, rc2,
          fp_error_message());
    buf_verify(&warm, what);
    buf_verify(&b, what);
    buf_free(&warm);
    buf_free(&b);
}

/* Every size around the cut-overs, spin 0 and spin > 0, a run of many small
 * entries in the spin-only range; with spin 0 no worker ever spins and no
 * run is shared with spinners only (today's behaviour exactly). */
static void test_spin_sizes(int threads, uint64_t seed)
{
    fp_copier_t *c;
    if (fp_copier_create(&c, threads) != FP_OK) {
        CHECK(0, "create(%d): %s", threads, fp_error_message());
        return;
    }
    const uint64_t spins[] = {0, SPIN_NS, 20000};
    for (size_t k = 0; k < sizeof spins / sizeof *spins; k++) {
        CHECK(fp_copier_set_spin(c, spins[k]) == FP_OK, "set_spin: %s", fp_error_message());
        for (size_t s = 0; s < NSPIN_SIZES; s++)
            for (size_t o = 0; o < 3; o++) {
                char what[128];
                snprintf(what, sizeof what, "threads=%d spin=%llu size=%zu off=%zu", threads,
                         (unsigned long long)spins[k], spin_sizes[s], o * 7);
                check_after_warm(c, spin_sizes[s], o * 7, seed + k * 1000 + s * 8 + o, what);
            }
        enum { N = 3000 };
        size_t *tiny = xmalloc(N * sizeof *tiny);
        for (size_t i = 0; i < N; i++)
            tiny[i] = mix(seed + i) % 200; /* ~300 KB: the spin-only range */
        size_t big = 2 * CHUNK + 1;
        check_run(c, &big, 1, 0, 0, seed + k, "warm before tiny");
        check_run(c, tiny, N, 1, 2, seed + k + 77, "3000 tiny, spin range");
        free(tiny);
        uint64_t spun, spin_runs;
        fp_copier_test_counts(c, &spun, &spin_runs);
        if (spins[k] == 0)
            CHECK(spun == 0 && spin_runs == 0,
                  "spin 0: %llu chunks taken spinning, %llu spin-only runs",
                  (unsigned long long)spun, (unsigned long long)spin_runs);
        else
            printf("    threads=%d spin=%llu ns: %llu chunks taken spinning, "
                   "%llu spin-only runs so far\n", threads, (unsigned long long)spins[k],
                   (unsigned long long)spun, (unsigned long long)spin_runs);
    }
    fp_copier_destroy(c);
}

static void *spin_caller_main(void *arg)
{
    caller_t *t = arg;
    for (int it = 0; it < t->iterations; it++) {
        size_t sizes[3] = {spin_sizes[(size_t)(it * 5 + t->id) % NSPIN_SIZES],
                           (size_t)(it % 3) * 100, 0};
        if (it % 4 == 0)
            sizes[2] = spin_sizes[(size_t)(it + 3 * t->id) % NSPIN_SIZES];
        char what[64];
        snprintf(what, sizeof what, "spin caller %d iteration %d", t->id, it);
        check_run(t->copier, sizes, 3, (size_t)it % 11, (size_t)t->id,
                  ((uint64_t)t->id << 40) + (uint64_t)it + 17, what);
    }
    return NULL;
}

/* Several callers at once with spinning workers, sizes around every
 * cut-over; one more thread turns spin on and off meanwhile. */
typedef struct spin_toggle_s {
    fp_copier_t *copier; /* the pool */
    int stop;            /* atomic: set by main when the callers are done */
} spin_toggle_t;

static void *spin_toggle_main(void *arg)
{
    spin_toggle_t *t = arg;
    const uint64_t values[] = {SPIN_NS, 0, 1000, 100000, 0, SPIN_NS};
    for (unsigned i = 0; !fp_atomic_load_acquire(&t->stop); i++) {
        fp_copier_set_spin(t->copier, values[i % 6]);
        struct timespec ts = {0, 300000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

static void test_spin_concurrent(int threads, int callers, int iterations, int toggle)
{
    fp_copier_t *c;
    if (fp_copier_create(&c, threads) != FP_OK) {
        CHECK(0, "create(%d): %s", threads, fp_error_message());
        return;
    }
    fp_copier_set_spin(c, SPIN_NS);
    pthread_t tid[16], tog;
    caller_t args[16];
    spin_toggle_t targ = {c, 0};
    if (toggle && pthread_create(&tog, NULL, spin_toggle_main, &targ) != 0)
        exit(2);
    for (int i = 0; i < callers; i++) {
        args[i] = (caller_t){c, i, iterations};
        if (pthread_create(&tid[i], NULL, spin_caller_main, &args[i]) != 0)
            exit(2);
    }
    for (int i = 0; i < callers; i++)
        pthread_join(tid[i], NULL);
    if (toggle) {
        fp_atomic_store_release(&targ.stop, 1);
        pthread_join(tog, NULL);
    }
    fp_copier_destroy(c); /* while workers spin */
}

/* Destroy right after a run, while the workers spin for up to 10 ms: stop
 * must reach them (they see `gen` move) and the joins return. */
static void test_spin_create_destroy(int loops)
{
    double worst = 0;
    for (int i = 0; i < loops; i++) {
        fp_copier_t *c;
        int threads = 2 + i % 5;
        if (fp_copier_create(&c, threads) != FP_OK) {
            CHECK(0, "create(%d): %s", threads, fp_error_message());
            return;
        }
        fp_copier_set_spin(c, i % 4 == 3 ? 0 : FP_COPIER_SPIN_MAX);
        if (i % 2 == 0) {
            size_t size = 2 * CHUNK + (size_t)i;
            check_run(c, &size, 1, (size_t)i % 5, 0, (uint64_t)i + 9000, "spin create/destroy");
        }
        double t0 = now();
        fp_copier_destroy(c);
        if (now() - t0 > worst)
            worst = now() - t0;
    }
    printf("    destroy while spinning (10 ms): slowest of %d took %.2f ms\n", loops,
           worst * 1e3);
}

/* A pool of more threads than the machine has cores, spinning: never more
 * workers spin at once than there are cores besides the caller's (a spinner
 * past that takes a core from a thread with work to do). Every run is large
 * enough to wake every worker, so each copies a chunk and then wants to spin;
 * three callers keep them busy. */
typedef struct spin_cap_caller_s {
    fp_copier_t *copier; /* shared */
    int id;              /* which caller */
    int iterations;      /* runs to make */
    size_t size;         /* bytes a run */
} spin_cap_caller_t;

static void *spin_cap_caller_main(void *arg)
{
    spin_cap_caller_t *t = arg;
    for (int it = 0; it < t->iterations; it++) {
        size_t size = t->size + (size_t)it * 4099;
        char what[64];
        snprintf(what, sizeof what, "spin cap caller %d iteration %d", t->id, it);
        check_run(t->copier, &size, 1, (size_t)it % 13, (size_t)t->id,
                  ((uint64_t)t->id << 36) + (uint64_t)it + 4242, what);
    }
    return NULL;
}

static void test_spin_cap(int iterations)
{
    int cpus = fp_cpu_count();
    int threads = 2 * cpus + 2;
    fp_copier_t *c;
    if (fp_copier_create(&c, threads) != FP_OK) {
        CHECK(0, "create(%d): %s", threads, fp_error_message());
        return;
    }
    CHECK(fp_copier_set_spin(c, SPIN_NS) == FP_OK, "set_spin: %s", fp_error_message());
    pthread_t tid[3];
    spin_cap_caller_t args[3];
    for (int i = 0; i < 3; i++) {
        args[i] = (spin_cap_caller_t){c, i, iterations, (size_t)threads * CHUNK_MIN * 2};
        if (pthread_create(&tid[i], NULL, spin_cap_caller_main, &args[i]) != 0)
            exit(2);
    }
    for (int i = 0; i < 3; i++)
        pthread_join(tid[i], NULL);
    int most = fp_copier_test_max_spinning(c);
    CHECK(most <= cpus - 1, "%d threads on %d CPUs: %d workers spun at once (at most %d may)",
          threads, cpus, most, cpus - 1);
    printf("    %d threads on %d CPUs: at most %d spun at once\n", threads, cpus, most);
    fp_copier_destroy(c);
}

/* ---- run-time tuning (fp_copier_set_tuning) ------------------------------ */

static void test_tuning_setter(void)
{
    fp_copier_t *c;
    if (fp_copier_create(&c, 3) != FP_OK) {
        CHECK(0, "create(3): %s", fp_error_message());
        return;
    }
    fp_copier_tuning_t t, d;
    fp_copier_get_tuning(c, &t);
    fp_copier_tuning_default(&d);
    CHECK(memcmp(&t, &d, sizeof t) == 0, "a new pool's tuning is not the default");
    CHECK(t.inline_max == INLINE && t.inline_spin == INLINE_SPIN && t.stream_min == STREAM &&
              t.chunk_min == CHUNK_MIN && t.chunk_max == CHUNK &&
              t.chunk_min_spin == CHUNK_MIN_SPIN,
          "the defaults are not fastpin.h's");
    fp_copier_tuning_t bad[5];
    for (int i = 0; i < 5; i++)
        bad[i] = d;
    bad[0].chunk_min = FP_COPIER_CHUNK_FLOOR - 1;
    bad[1].chunk_min_spin = d.chunk_max + 1;
    bad[2].chunk_min = d.chunk_max + 1;
    bad[3].inline_max = FP_COPIER_TUNE_MAX + 1;
    bad[4].chunk_max = FP_COPIER_CHUNK_FLOOR - 1;
    const char *names[5] = {"chunk_min", "chunk_max", "chunk_max", "inline_max", "chunk_max"};
    for (int i = 0; i < 5; i++) {
        CHECK(fp_copier_set_tuning(c, &bad[i]) == FP_EINVAL, "bad tuning %d accepted", i);
        CHECK(strstr(fp_error_message(), names[i]) != NULL, "bad tuning %d: message %s", i,
              fp_error_message());
        fp_copier_get_tuning(c, &t);
        CHECK(memcmp(&t, &d, sizeof t) == 0, "bad tuning %d changed the pool's", i);
    }
    fp_copier_tuning_t zero = {0, 0, 0, FP_COPIER_CHUNK_FLOOR, FP_COPIER_CHUNK_FLOOR,
                               FP_COPIER_CHUNK_FLOOR};
    CHECK(fp_copier_set_tuning(c, &zero) == FP_OK, "smallest tuning refused: %s",
          fp_error_message());
    fp_copier_get_tuning(c, &t);
    CHECK(memcmp(&t, &zero, sizeof t) == 0, "tuning not set");
    CHECK(fp_copier_set_tuning(NULL, &d) == FP_EINVAL, "NULL copier accepted");
    CHECK(fp_copier_set_tuning(c, NULL) == FP_EINVAL, "NULL tuning accepted");
    CHECK(fp_copier_spinners(c) == (fp_cpu_count() - 1 < 2 ? fp_cpu_count() - 1 : 2),
          "3 threads on %d CPUs: %d may spin", fp_cpu_count(), fp_copier_spinners(c));
    fp_copier_destroy(c);
}

/* Tunings the measurements try: the pool from the smallest run, the caller
 * alone up to 8 MiB, spin-only sharing from 64 KiB, streaming from every
 * size, the smallest chunks. */
static const fp_copier_tuning_t tunings[] = {
    {0, 0, 0, FP_COPIER_CHUNK_FLOOR, (size_t)64 << 10, FP_COPIER_CHUNK_FLOOR},
    {(size_t)8 << 20, (size_t)64 << 10, (size_t)1 << 20, (size_t)256 << 10, (size_t)4 << 20,
     (size_t)16 << 10},
    {(size_t)2 << 20, (size_t)1 << 20, (size_t)64 << 10, (size_t)128 << 10, (size_t)512 << 10,
     (size_t)32 << 10},
    {(size_t)256 << 10, 0, (size_t)16 << 20, FP_COPIER_CHUNK_FLOOR, FP_COPIER_CHUNK_FLOOR,
     FP_COPIER_CHUNK_FLOOR},
};
#define NTUNINGS (sizeof tunings / sizeof *tunings)

/* Sizes just below, at and above each of the tuning's cut-overs. */
static size_t tuning_sizes(const fp_copier_tuning_t *t, size_t *out)
{
    const size_t cuts[] = {t->inline_max, t->inline_spin, t->stream_min, t->chunk_min,
                           t->chunk_max, t->chunk_min_spin, 2 * t->chunk_max};
    size_t n = 0;
    for (size_t i = 0; i < sizeof cuts / sizeof *cuts; i++)
        for (size_t d = 0; d < 3; d++)
            if (cuts[i] + d >= 1)
                out[n++] = cuts[i] + d - 1;
    return n;
}

static void test_tuning_sizes(int threads, uint64_t seed)
{
    fp_copier_t *c;
    if (fp_copier_create(&c, threads) != FP_OK) {
        CHECK(0, "create(%d): %s", threads, fp_error_message());
        return;
    }
    const uint64_t spins[] = {0, SPIN_NS};
    for (size_t k = 0; k < NTUNINGS; k++)
        for (size_t p = 0; p < 2; p++) {
            CHECK(fp_copier_set_tuning(c, &tunings[k]) == FP_OK, "tuning %zu: %s", k,
                  fp_error_message());
            fp_copier_set_spin(c, spins[p]);
            fp_copier_set_streaming(c, (int)(k + p) % 2 == 0);
            size_t sizes[32];
            size_t n = tuning_sizes(&tunings[k], sizes);
            for (size_t s = 0; s < n; s++) {
                char what[128];
                snprintf(what, sizeof what, "threads=%d tuning %zu spin=%llu size=%zu", threads,
                         k, (unsigned long long)spins[p], sizes[s]);
                check_after_warm(c, sizes[s], s * 5, seed + k * 100 + p * 50 + s, what);
            }
            /* Many entries, the run's total past the chunk sizes. */
            enum { N = 700 };
            size_t many[N];
            for (size_t i = 0; i < N; i++)
                many[i] = mix(seed + k * 7 + p + i) % 3000;
            check_run(c, many, N, 3, 5, seed + k + 333, "700 entries, tuned");
        }
    fp_copier_destroy(c);
}

/* Callers at sizes around every tuning's cut-overs while another thread
 * changes the tuning, the spin and streaming under them. */
typedef struct tune_toggle_s {
    fp_copier_t *copier; /* the pool */
    int stop;            /* atomic: set by main when the callers are done */
} tune_toggle_t;

static void *tune_toggle_main(void *arg)
{
    tune_toggle_t *t = arg;
    fp_copier_tuning_t d;
    fp_copier_tuning_default(&d);
    for (unsigned i = 0; !fp_atomic_load_acquire(&t->stop); i++) {
        fp_copier_set_tuning(t->copier, i % 5 == 4 ? &d : &tunings[i % NTUNINGS]);
        fp_copier_set_spin(t->copier, i % 3 == 0 ? 0 : SPIN_NS);
        fp_copier_set_streaming(t->copier, (int)(i % 2));
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

static void *tune_caller_main(void *arg)
{
    caller_t *t = arg;
    size_t all[NTUNINGS * 32];
    size_t n = 0;
    for (size_t k = 0; k < NTUNINGS; k++)
        n += tuning_sizes(&tunings[k], all + n);
    for (int it = 0; it < t->iterations; it++) {
        size_t sizes[2] = {all[(size_t)(it * 7 + t->id) % n], (size_t)(it % 5) * 333};
        char what[64];
        snprintf(what, sizeof what, "tune caller %d iteration %d", t->id, it);
        check_run(t->copier, sizes, 2, (size_t)it % 11, (size_t)t->id,
                  ((uint64_t)t->id << 44) + (uint64_t)it + 99, what);
    }
    return NULL;
}

static void test_tuning_concurrent(int threads, int callers, int iterations)
{
    fp_copier_t *c;
    if (fp_copier_create(&c, threads) != FP_OK) {
        CHECK(0, "create(%d): %s", threads, fp_error_message());
        return;
    }
    pthread_t tid[16], tog;
    caller_t args[16];
    tune_toggle_t targ = {c, 0};
    if (pthread_create(&tog, NULL, tune_toggle_main, &targ) != 0)
        exit(2);
    for (int i = 0; i < callers; i++) {
        args[i] = (caller_t){c, i, iterations};
        if (pthread_create(&tid[i], NULL, tune_caller_main, &args[i]) != 0)
            exit(2);
    }
    for (int i = 0; i < callers; i++)
        pthread_join(tid[i], NULL);
    fp_atomic_store_release(&targ.stop, 1);
    pthread_join(tog, NULL);
    fp_copier_destroy(c);
}

/* Informational: one 64 MiB copy at several pool sizes. */
static void report_speed(void)
{
    size_t size = (size_t)64 << 20;
    unsigned char *src = xmalloc(size), *dst = xmalloc(size);
    fill(src, size, 1);
    fill(dst, size, 2); /* fault every page in before timing */
    const int counts[] = {1, 2, 0};
    for (size_t k = 0; k < sizeof counts / sizeof *counts; k++) {
        fp_copier_t *c;
        if (fp_copier_create(&c, counts[k]) != FP_OK)
            continue;
        fp_copy_t one = {dst, src, size};
        for (int on = 1; on >= 0; on--) {
            fp_copier_set_streaming(c, on);
            double best = 1e9;
            for (int r = 0; r < 5; r++) {
                double t0 = now();
                fp_copier_run(c, &one, 1);
                double t = now() - t0;
                if (t < best)
                    best = t;
            }
            printf("  64 MiB copy, threads=%d (%d), streaming %d: %.2f ms, %.1f GB/s\n",
                   counts[k], fp_copier_threads(c), fp_copier_streams(c), best * 1e3,
                   (double)size / best / 1e9);
        }
        fp_copier_destroy(c);
    }
    free(src);
    free(dst);
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    double t0 = now();
    printf("test_copier: %d CPUs\n", fp_cpu_count());

    test_threads_arg();

    const int counts[] = {1, 2, 5, 0};
    for (size_t k = 0; k < sizeof counts / sizeof *counts; k++) {
        fp_copier_t *c;
        int rc = fp_copier_create(&c, counts[k]);
        CHECK(rc == FP_OK, "create(%d): %s", counts[k], fp_error_message());
        if (rc != FP_OK)
            continue;
        test_sizes(c, 1000 * k + 1);
        test_streaming(c, 1000 * k + 300);
        test_many(c, 1000 * k + 500);
        test_bad_input(c);
        fp_copier_destroy(c);
        printf("  sizes, streaming, many entries, bad input: threads=%d done (%.1f s)\n",
               counts[k], now() - t0);
    }

    test_concurrent(4, 8, 300 / SLOW);
    test_concurrent(1, 8, 50 / SLOW);
    test_concurrent(0, 8, 100 / SLOW);
    printf("  8 concurrent callers done (%.1f s)\n", now() - t0);

    test_create_destroy(1000 / SLOW);
    printf("  create/destroy loop done (%.1f s)\n", now() - t0);

    test_fork(0);
    test_fork(FP_COPIER_SPIN_MAX);
    printf("  fork done (%.1f s)\n", now() - t0);

    test_spin_setter();
    test_spin_sizes(2, 70001);
    test_spin_sizes(5, 80001);
    printf("  spin sizes done (%.1f s)\n", now() - t0);
    test_spin_concurrent(4, 6, 120 / SLOW, 0);
    test_spin_concurrent(3, 4, 120 / SLOW, 1);
    test_spin_concurrent(0, 4, 60 / SLOW, 1);
    printf("  spin, concurrent callers done (%.1f s)\n", now() - t0);
    test_spin_create_destroy(200 / SLOW);
    printf("  spin create/destroy done (%.1f s)\n", now() - t0);
    test_spin_cap(40 / SLOW);
    printf("  spinners capped by the cores done (%.1f s)\n", now() - t0);
    test_tuning_setter();
    test_tuning_sizes(3, 91001);
    test_tuning_sizes(0, 92001);
    printf("  tuned sizes done (%.1f s)\n", now() - t0);
    test_tuning_concurrent(4, 6, 100 / SLOW);
    test_tuning_concurrent(0, 3, 100 / SLOW);
    printf("  tuning changed under concurrent callers done (%.1f s)\n", now() - t0);

    if (SLOW == 1)
        report_speed();

    if (fp_atomic_load_acquire(&failures)) {
        printf("test_copier: %d FAILED\n", failures);
        return 1;
    }
    printf("test_copier: ok\n");
    return 0;
}
