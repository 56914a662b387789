/* One core's copy rate by kind of copy, cache-hot (the same source and
 * destination over and over, as benchmarks' pin tables run): glibc memcpy,
 * SSE2, AVX2 and AVX-512 loops with ordinary stores (the wider ones where
 * the CPU has them), and the copy pool's streaming loop.
 *
 *     gcc -O2 -Icsrc -o /tmp/copy_kinds benchmarks/copy_kinds.c && /tmp/copy_kinds
 *
 * Where memcpy picks `rep movsb` for mid sizes, CPUs differ a lot in what
 * that costs; this says what it costs here. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "streaming.h" /* the copy pool's streaming loop */
#include "avx2_copy.h" /* the AVX2 loop, beside this file */

/* The streaming loop's shape with ordinary stores. */
static void sse2_copy(char *dst, const char *src, size_t n)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; dst += 64, src += 64, n -= 64)
        for (int k = 0; k < 64; k += 16)
            _mm_store_si128((__m128i *)(dst + k), _mm_loadu_si128((const __m128i *)(src + k)));
    memcpy(dst, src, n);
}

__attribute__((target("avx512f"))) static void avx512_copy(char *dst, const char *src, size_t n)
{
    for (; n >= 256; dst += 256, src += 256, n -= 256) {
        __m512i a = _mm512_loadu_si512((const void *)src);
        __m512i b = _mm512_loadu_si512((const void *)(src + 64));
        __m512i c = _mm512_loadu_si512((const void *)(src + 128));
        __m512i d = _mm512_loadu_si512((const void *)(src + 192));
        _mm512_storeu_si512((void *)dst, a);
        _mm512_storeu_si512((void *)(dst + 64), b);
        _mm512_storeu_si512((void *)(dst + 128), c);
        _mm512_storeu_si512((void *)(dst + 192), d);
    }
    memcpy(dst, src, n);
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void)
{
    const size_t sizes[] = {64 << 10, 256 << 10, 1 << 20, 2 << 20, 16 << 20, 64 << 20};
    int avx2 = __builtin_cpu_supports("avx2"), avx512 = __builtin_cpu_supports("avx512f");
    printf("%10s %12s %12s %12s %12s %12s  (GB/s, best of 5 x repeats for 50 ms)\n", "bytes",
           "memcpy", "sse2 stores", "sse2 stream", "avx2 stores", "avx512 stores");
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
        size_t n = sizes[k];
        char *src = aligned_alloc(4096, n), *dst = aligned_alloc(4096, n);
        for (size_t i = 0; i < n; i++)
            src[i] = (char)(i * 131 + 7), dst[i] = (char)i;
        double rate[5] = {0};
        for (int kind = 0; kind < 5; kind++) {
            if ((kind == 3 && !avx2) || (kind == 4 && !avx512))
                continue;
            size_t reps = (50u << 20) / n + 1;
            double best = 1e9;
            for (int r = 0; r < 5; r++) {
                double t = now();
                for (size_t i = 0; i < reps; i++) {
                    if (kind == 0)
                        memcpy(dst, src, n);
                    else if (kind == 1)
                        sse2_copy(dst, src, n);
                    else if (kind == 2)
                        fp_copy_streaming(dst, src, n);
                    else if (kind == 3)
                        avx2_copy(dst, src, n);
                    else
                        avx512_copy(dst, src, n);
                    __asm__ volatile("" ::: "memory");
                }
                t = (now() - t) / reps;
                if (t < best)
                    best = t;
            }
            rate[kind] = n / best / 1e9;
            if (memcmp(dst, src, n) != 0)
                return 1;
        }
        printf("%10zu %12.1f %12.1f %12.1f %12.1f %12.1f\n", n, rate[0], rate[1], rate[2],
               rate[3], rate[4]);
        free(src);
        free(dst);
    }
    return 0;
}
