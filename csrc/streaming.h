/* memcpy with streaming stores, which bypass the cache: for destinations
 * nobody on the CPU reads soon (pinned blocks that DMA reads). Header-only,
 * so benchmarks/copy_kinds.c times the copy pool's own loop.
 *
 * FP_HAVE_STREAMING is 1 where the CPU has them (x86-64: SSE2 is in every
 * one), and fp_copy_streaming is defined only there. */
#ifndef FASTPIN_STREAMING_H
#define FASTPIN_STREAMING_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#define FP_HAVE_STREAMING 1

/* 64 bytes a step once the destination is 16-aligned; the ends by memcpy.
 * The fence orders the weakly ordered stores before whatever the thread
 * does next (the lock that hands the chunk back, the DMA that reads it). */
static inline void fp_copy_streaming(char *dst, const char *src, size_t n)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 64; dst += 64, src += 64, n -= 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    memcpy(dst, src, n);
    _mm_sfence();
}
#else
#define FP_HAVE_STREAMING 0
#endif

#endif /* FASTPIN_STREAMING_H */
