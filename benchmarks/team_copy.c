/* Can a team of spinning pthreads copy a mid-size batch faster than an
 * OpenMP team does (torch's copy_ runs on one: a static split of the bytes,
 * one slice a thread)? The same copy of SIZE bytes, by:
 *
 *   caller   memcpy in the calling thread alone
 *   omp      `omp parallel` over T slices, as at::parallel_for splits a copy
 *            (libgomp's threads wait for the next region spinning, then asleep)
 *   static   T-1 pthreads spinning on a run counter, thread k copying slice k
 *            every time (so a slice stays in the same core's cache), the caller
 *            slice 0, then polling until all are done
 *   dynamic  the same threads claiming 64 KiB chunks by an atomic add (as the
 *            lock-free team tried in the copy pool did)
 *
 * Each team copies its slices by glibc's memcpy, and again (`_avx`) by an
 * AVX2 loop of ordinary stores, as torch's copy kernel is (glibc picks
 * `rep movsb` for mid sizes, whose speed differs by CPU and by whether the
 * source is in cache).
 *
 * cache-hot (the same source every call, as the pin tables' hot rows) and
 * cache-cold (sources rotating over 1 GiB, past any last-level cache, as a
 * batch fresh from a worker). The destination is one buffer throughout (a
 * freed pinned block is taken again at once). Median us of a call, GB/s, and
 * CPU-ms (every thread) per GB copied.
 *
 *     gcc -O2 -fopenmp -pthread -o /tmp/team_copy benchmarks/team_copy.c
 *     /tmp/team_copy [threads (default: CPUs)] [calls (default: 400)]
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "avx2_copy.h" /* the AVX2 loop, beside this file */

#define MAX_THREADS 256
#define CHUNK (64u << 10)
#define RING (1ull << 30)

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double cpu_s(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
}

/* Slice k of T over n bytes, 4 KiB-aligned bounds (the last takes the rest). */
static void slice(size_t n, int T, int k, size_t *from, size_t *len)
{
    size_t per = ((n + T - 1) / T + 4095) & ~(size_t)4095;
    size_t a = per * k < n ? per * k : n, b = per * (k + 1) < n ? per * (k + 1) : n;
    *from = a;
    *len = b - a;
}

/* ---- the spinning team ---- */
typedef struct {
    _Alignas(64) uint64_t seq; /* the run number; workers start run seq */
    int dynamic, stop, T;
    char *dst;
    const char *src;
    size_t n;
    _Alignas(64) size_t next; /* dynamic: next chunk */
    _Alignas(64) int done;    /* slices or chunks copied */
} team_t;

static team_t team;

/* The teams' copy: memcpy, or avx2_copy. */
static void *(*slice_copy)(void *, const void *, size_t) = memcpy;

static void *avx2_slice(void *dst, const void *src, size_t n)
{
    avx2_copy(dst, src, n);
    return dst;
}

static void team_chunks(team_t *t, size_t chunks)
{
    for (;;) {
        size_t i = __atomic_fetch_add(&t->next, 1, __ATOMIC_RELAXED);
        if (i >= chunks)
            return;
        size_t from = i * CHUNK, len = t->n - from < CHUNK ? t->n - from : CHUNK;
        slice_copy(t->dst + from, t->src + from, len);
        __atomic_fetch_add(&t->done, 1, __ATOMIC_RELEASE);
    }
}

static void *team_main(void *arg)
{
    int k = (int)(intptr_t)arg;
    uint64_t seen = 0;
    for (;;) {
        uint64_t seq;
        while ((seq = __atomic_load_n(&team.seq, __ATOMIC_ACQUIRE)) == seen)
            _mm_pause();
        seen = seq;
        if (team.stop)
            return NULL;
        if (team.dynamic) {
            team_chunks(&team, (team.n + CHUNK - 1) / CHUNK);
        } else {
            size_t from, len;
            slice(team.n, team.T, k, &from, &len);
            slice_copy(team.dst + from, team.src + from, len);
            __atomic_fetch_add(&team.done, 1, __ATOMIC_RELEASE);
        }
    }
}

static void team_copy(char *dst, const char *src, size_t n)
{
    team.dst = dst;
    team.src = src;
    team.n = n;
    __atomic_store_n(&team.next, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&team.done, 0, __ATOMIC_RELAXED);
    __atomic_fetch_add(&team.seq, 1, __ATOMIC_RELEASE);
    int want;
    if (team.dynamic) {
        size_t chunks = (n + CHUNK - 1) / CHUNK;
        team_chunks(&team, chunks);
        want = (int)chunks;
    } else {
        size_t from, len;
        slice(n, team.T, 0, &from, &len);
        slice_copy(dst + from, src + from, len);
        want = team.T - 1;
    }
    /* Every chunk claimed is counted once copied: a dynamic worker still
     * between its last claim and seeing none left claims from the next run
     * (the same size), copying that run's source. */
    while (__atomic_load_n(&team.done, __ATOMIC_ACQUIRE) < want)
        _mm_pause();
}

static pthread_t threads[MAX_THREADS];

static void team_start(int T, int dynamic)
{
    team.T = T;
    team.dynamic = dynamic;
    team.stop = 0;
    for (int k = 1; k < T; k++)
        pthread_create(&threads[k], NULL, team_main, (void *)(intptr_t)k);
}

static void team_end(void)
{
    team.stop = 1;
    __atomic_fetch_add(&team.seq, 1, __ATOMIC_RELEASE);
    for (int k = 1; k < team.T; k++)
        pthread_join(threads[k], NULL);
}

/* ---- the OpenMP team ---- */
static int omp_T;

/* As at::parallel_for: at most one thread per 32 Ki elements (bytes here). */
static void omp_copy(char *dst, const char *src, size_t n)
{
    size_t most = (n + 32767) / 32768;
#pragma omp parallel num_threads(most < (size_t)omp_T ? (int)most : omp_T)
    {
        size_t from, len;
        slice(n, omp_get_num_threads(), omp_get_thread_num(), &from, &len);
        slice_copy(dst + from, src + from, len);
    }
}

static void caller_copy(char *dst, const char *src, size_t n)
{
    memcpy(dst, src, n);
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void run(const char *mode, void (*copy)(char *, const char *, size_t), char *dst,
                const char *ring, size_t n, int cold, int calls)
{
    double *t = malloc(sizeof *t * calls);
    size_t slots = RING / n, at = 0;
    const char *src = ring;
    for (int i = 0; i < calls / 4; i++) /* warm-up */
        copy(dst, ring + (cold ? (at++ % slots) * n : 0), n);
    double c0 = cpu_s();
    for (int i = 0; i < calls; i++) {
        src = ring + (cold ? (at++ % slots) * n : 0);
        double a = now_s();
        copy(dst, src, n);
        t[i] = now_s() - a;
    }
    double cpu = cpu_s() - c0;
    qsort(t, calls, sizeof *t, cmp);
    double med = t[calls / 2];
    printf("| %zuK | %s | %s | %.2f | %.1f | %.1f |%s\n", n >> 10, cold ? "cold" : "hot", mode,
           med * 1e6, n / med / 1e9, cpu / ((double)n * calls / 1e9) * 1e3,
           memcmp(dst, src, n) ? " WRONG DATA" : "");
    free(t);
}

int main(int argc, char **argv)
{
    int T = argc > 1 ? atoi(argv[1]) : (int)sysconf(_SC_NPROCESSORS_ONLN);
    int calls = argc > 2 ? atoi(argv[2]) : 400;
    if (T < 1 || T > MAX_THREADS || calls < 8) {
        fprintf(stderr, "usage: %s [threads 1-%d] [calls >= 8]\n", argv[0], MAX_THREADS);
        return 2;
    }
    omp_T = T;
    int avx2 = __builtin_cpu_supports("avx2") != 0;
    size_t sizes[] = {256u << 10, 1u << 20, 2u << 20, 4u << 20, 8u << 20, 16u << 20};
    char *ring = aligned_alloc(4096, RING), *dst = aligned_alloc(4096, 16u << 20);
    for (size_t i = 0; i < RING; i += 8)
        *(uint64_t *)(ring + i) = i * 0x9E3779B97F4A7C15ull;
    memset(dst, 1, 16u << 20);
    printf("%d threads, %d calls a row\n\n", T, calls);
    printf("| size | src | mode | median us | GB/s | CPU ms/GB |\n|---:|---|---|---:|---:|---:|\n");
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++)
        for (int cold = 0; cold < 2; cold++) {
            size_t n = sizes[s];
            run("caller", caller_copy, dst, ring, n, cold, calls);
            for (int k = 0; k < 1 + avx2; k++) {
                slice_copy = k ? avx2_slice : memcpy;
                run(k ? "omp_avx" : "omp", omp_copy, dst, ring, n, cold, calls);
                usleep(20000); /* libgomp's threads stop spinning and sleep */
                team_start(T, 0);
                run(k ? "static_avx" : "static", team_copy, dst, ring, n, cold, calls);
                team_end();
            }
            slice_copy = memcpy;
            team_start(T, 1);
            run("dynamic", team_copy, dst, ring, n, cold, calls);
            team_end();
        }
    free(ring);
    free(dst);
    return 0;
}
