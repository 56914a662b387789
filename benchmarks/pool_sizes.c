/* The copy pool's time for one run by size, against the caller copying alone
 * (a pool of one thread), with the pool's two thresholds as built: where a
 * run stops being copied by the caller alone (past FP_COPIER_INLINE) and where
 * its stores start to bypass the cache (FP_COPIER_STREAM). Build it with
 * other values to compare (bytes):
 *
 *     gcc -O2 -pthread -Icsrc [-DFP_COPIER_INLINE=N] [-DFP_COPIER_STREAM=N] \
 *         -o /tmp/pool_sizes benchmarks/pool_sizes.c csrc/{error,prim,cuda,tlsf,repair,arena,lease,copier,stage}.c -ldl \
 *         && /tmp/pool_sizes
 *
 * Two cases, us per run (median of 200): "hot", the same source and
 * destination every run (the bench's pin tables); "rotating", the run's
 * source and destination taken in turn from 16 pairs (a stream of batches
 * through a few reused blocks, each out of the cache by its next turn). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fastpin.h"

#define RUNS 200
#define PAIRS 16

static double now_us(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median us of RUNS runs of n bytes, over `pairs` source/destination pairs. */
static double time_runs(fp_copier_t *c, char **dst, char **src, int pairs, size_t n)
{
    double v[RUNS];
    for (int r = 0; r < RUNS + pairs; r++) {
        fp_copy_t e = {.dst = dst[r % pairs], .src = src[r % pairs], .size = n};
        double t0 = now_us();
        if (fp_copier_run(c, &e, 1) != FP_OK) {
            fprintf(stderr, "run failed: %s\n", fp_error_message());
            exit(1);
        }
        if (r >= pairs)
            v[r - pairs] = now_us() - t0;
    }
    qsort(v, RUNS, sizeof *v, cmp);
    return v[RUNS / 2];
}

int main(void)
{
    static const size_t sizes[] = {256 << 10, 512 << 10, 1 << 20, 3 << 19, 2 << 20, 3 << 20,
                                   4 << 20, 8 << 20, 16 << 20};
    size_t most = sizes[sizeof sizes / sizeof *sizes - 1];
    char *dst[PAIRS], *src[PAIRS];
    for (int p = 0; p < PAIRS; p++) {
        dst[p] = aligned_alloc(4096, most);
        src[p] = aligned_alloc(4096, most);
        for (size_t i = 0; i < most; i++) {
            src[p][i] = (char)((i * 2654435761u >> 11) + (size_t)p);
            dst[p][i] = (char)i;
        }
    }
    fp_copier_t *pool, *alone;
    if (fp_copier_create(&pool, 0) != FP_OK || fp_copier_create(&alone, 1) != FP_OK) {
        fprintf(stderr, "copier: %s\n", fp_error_message());
        return 1;
    }
    printf("pool of %d threads; inline up to %zu bytes, streaming from %zu bytes (us per run)\n",
           fp_copier_threads(pool), (size_t)FP_COPIER_INLINE, (size_t)FP_COPIER_STREAM);
    printf("%10s %10s %10s %14s %14s\n", "bytes", "hot pool", "hot alone", "rotating pool",
           "rotating alone");
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
        size_t n = sizes[k];
        printf("%10zu %10.1f %10.1f %14.1f %14.1f\n", n, time_runs(pool, dst, src, 1, n),
               time_runs(alone, dst, src, 1, n), time_runs(pool, dst, src, PAIRS, n),
               time_runs(alone, dst, src, PAIRS, n));
    }
    /* The last size copied every pair whole. */
    if (memcmp(dst[0], src[0], most)) {
        fprintf(stderr, "copy mismatch\n");
        return 1;
    }
    fp_copier_destroy(pool);
    fp_copier_destroy(alone);
    return 0;
}
