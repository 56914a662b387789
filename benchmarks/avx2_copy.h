/* An AVX2 copy loop of ordinary stores (128 bytes a step, the rest by
 * memcpy), for the benchmarks that weigh it against glibc's memcpy and the
 * copy pool's loops: benchmarks/copy_kinds.c and benchmarks/team_copy.c.
 * Call it only where __builtin_cpu_supports("avx2"). */
#ifndef FASTPIN_BENCH_AVX2_COPY_H
#define FASTPIN_BENCH_AVX2_COPY_H

#include <immintrin.h>
#include <stddef.h>
#include <string.h>

__attribute__((target("avx2"))) static inline void avx2_copy(char *dst, const char *src, size_t n)
{
    for (; n >= 128; dst += 128, src += 128, n -= 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)src);
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + 96));
        _mm256_storeu_si256((__m256i *)dst, a);
        _mm256_storeu_si256((__m256i *)(dst + 32), b);
        _mm256_storeu_si256((__m256i *)(dst + 64), c);
        _mm256_storeu_si256((__m256i *)(dst + 96), d);
    }
    memcpy(dst, src, n);
}

#endif /* FASTPIN_BENCH_AVX2_COPY_H */
