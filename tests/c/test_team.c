/* Tests for the OpenMP team copy (team.c): finding the runtime through a
 * loaded library, every byte of runs cut across entries and cache lines,
 * teams asked for by many threads at once, and a call inside a parallel
 * region (a team of one). Built with -fopenmp, so this program links GNU
 * libgomp, which stands in for torch's libtorch_cpu as the owner. Exits
 * non-zero on failure. */
#define _GNU_SOURCE
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "fastpin.h"

#define GUARD 64 /* bytes checked untouched after a destination */

static unsigned char pattern(size_t i, uint64_t seed)
{
    uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ seed * 0xbf58476d1ce4e5b9ull;
    return (unsigned char)(x ^ (x >> 29) ^ (x >> 47));
}

static fp_team_t team;

/* One run of `count` entries of the given sizes (back to back in one
 * source, at odd offsets in the destination), copied by a team of
 * `threads`; every byte and the guards after each entry checked. */
static void check_run(const size_t *sizes, size_t count, unsigned threads, uint64_t seed)
{
    size_t total = 0;
    for (size_t i = 0; i < count; i++)
        total += sizes[i];
    size_t room = total + count * (GUARD + 7);
    unsigned char *src = malloc(total + 1), *dst = malloc(room + 1);
    fp_copy_t *copies = calloc(count + 1, sizeof *copies);
    if (!src || !dst || !copies) {
        CHECK(0, "out of memory for %zu bytes", total);
        goto done;
    }
    for (size_t i = 0; i < total; i++)
        src[i] = pattern(i, seed);
    memset(dst, 0xA5, room);
    size_t from = 0, to = 0;
    for (size_t i = 0; i < count; i++) {
        to += (i * 3) % 7; /* destinations not on a cache line */
        copies[i] = (fp_copy_t){.dst = dst + to, .src = src + from, .size = sizes[i]};
        from += sizes[i];
        to += sizes[i] + GUARD;
    }
    fp_team_copy(&team, copies, count, threads);
    from = 0;
    for (size_t i = 0; i < count; i++) {
        const unsigned char *d = copies[i].dst;
        size_t bad = SIZE_MAX;
        for (size_t j = 0; j < sizes[i] && bad == SIZE_MAX; j++)
            if (d[j] != pattern(from + j, seed))
                bad = j;
        CHECK(bad == SIZE_MAX, "entry %zu of %zu (%zu bytes), %u threads: byte %zu wrong", i,
              count, sizes[i], threads, bad);
        for (size_t j = 0; j < GUARD; j++)
            if (d[sizes[i] + j] != 0xA5) {
                CHECK(0, "entry %zu of %zu, %u threads: guard byte %zu written", i, count,
                      threads, j);
                break;
            }
        from += sizes[i];
    }
done:
    free(src);
    free(dst);
    free(copies);
}

static void test_find(void)
{
    fp_team_t none;
    CHECK(fp_team_find("libfastpin-no-such-library", &none) == FP_EINVAL, "found a team");
    CHECK(!none.parallel && !none.max_threads, "entry points left set");
    CHECK(fp_team_find("", &none) == FP_EINVAL, "an empty owner matched");
    /* The C library links no OpenMP runtime. */
    CHECK(fp_team_find("libc.so", &none) == FP_EINVAL, "found a team through libc");
    CHECK(fp_team_find("libgomp", &team) == 0, "libgomp is linked, yet no team");
    CHECK(team.parallel && team.thread_num && team.num_threads && team.max_threads,
          "an entry point missing");
    omp_set_num_threads(3);
    CHECK(team.max_threads() == 3, "omp_get_max_threads through the team: %d",
          team.max_threads());
}

/* Sizes around the cuts: one entry, many small, one spanning cuts, empties. */
static void test_shapes(void)
{
    static const size_t one[][1] = {{0}, {1}, {63}, {64}, {65}, {4095}, {256 << 10},
                                    {(1 << 20) + 17}};
    for (size_t s = 0; s < sizeof one / sizeof one[0]; s++)
        for (unsigned t = 1; t <= 9; t++)
            check_run(one[s], 1, t, s * 16 + t);
    static const size_t many[] = {7, 0, 4096, 1, 65, 0, 100000, 3, 64, 63, 200003, 5};
    for (unsigned t = 1; t <= 9; t++)
        check_run(many, sizeof many / sizeof many[0], t, 1000 + t);
    size_t tiny[40];
    for (size_t i = 0; i < 40; i++)
        tiny[i] = i % 5;
    for (unsigned t = 1; t <= 9; t++)
        check_run(tiny, 40, t, 2000 + t);
    /* No team found: the caller copies alone. */
    fp_team_t saved = team;
    memset(&team, 0, sizeof team);
    check_run(many, sizeof many / sizeof many[0], 8, 3000);
    team = saved;
}

static void *caller(void *arg)
{
    uintptr_t k = (uintptr_t)arg;
    size_t sizes[3] = {(300 << 10) + k * 64 + 1, 0, (k + 1) * 4099};
    for (int i = 0; i < 20; i++)
        check_run(sizes, 3, (unsigned)(2 + (k + i) % 6), k * 100 + i);
    return NULL;
}

/* Several threads start teams at once: each its own pool of threads. */
static void test_many_callers(void)
{
    pthread_t threads[6];
    for (uintptr_t k = 0; k < 6; k++)
        CHECK(pthread_create(&threads[k], NULL, caller, (void *)k) == 0, "pthread_create");
    for (int k = 0; k < 6; k++)
        pthread_join(threads[k], NULL);
}

/* Inside a parallel region the runtime gives a team of one: still every byte. */
static void test_nested(void)
{
    static const size_t sizes[] = {(1 << 20) + 5, 77};
#pragma omp parallel num_threads(2)
    check_run(sizes, 2, 4, 4000 + (uint64_t)omp_get_thread_num());
}

int main(void)
{
    test_find();
    test_shapes();
    test_many_callers();
    test_nested();
    if (failures) {
        fprintf(stderr, "test_team: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_team: ok\n");
    return 0;
}
