/* CRC-32 (zlib's: the gzip polynomial, reflected) of a sample's bytes by carry-less multiplication:
 * 64 bytes a step folded in four 128-bit lanes, then reduced to 32 bits (Barrett), the way Intel's
 * "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ" describes. About 4x zlib 1.2's
 * table-driven crc32, whose time was most of the engine's read stage on ImageNet-sized JPEGs.
 * The same value as zlib's crc32(crc, data, size), which it calls for what is under 64 bytes, for
 * the last bytes past a multiple of 16, and on a CPU built for without PCLMULQDQ.
 * Used by decode_engine.c; header-only, as jpeg_restarts.h.
 */
#ifndef CRC32_FOLD_H
#define CRC32_FOLD_H

#include <stddef.h>
#include <stdint.h>
#include <zlib.h>
#if defined(__PCLMUL__) && defined(__SSE4_1__)
#include <immintrin.h>
#endif

static uint32_t crc32_fold(uint32_t crc, const unsigned char *data, size_t size) {
#if defined(__PCLMUL__) && defined(__SSE4_1__)
    if (size >= 64) {
        /* x^(32*k) mod P for the fold distances: 512 +- 64 bits, 128 +- 64, 64; P and its Barrett quotient */
        const __m128i by_64_bytes = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL);
        const __m128i by_16_bytes = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);
        const __m128i by_8_bytes = _mm_set_epi64x(0, 0x163cd6124LL);
        const __m128i polynomial = _mm_set_epi64x(0x1f7011641LL, 0x1db710641LL);
        const __m128i low32 = _mm_set_epi32(0, 0, 0, -1);
        const __m128i *p = (const __m128i *)data;
        __m128i x1 = _mm_xor_si128(_mm_loadu_si128(p), _mm_cvtsi32_si128((int)~crc));
        __m128i x2 = _mm_loadu_si128(p + 1), x3 = _mm_loadu_si128(p + 2), x4 = _mm_loadu_si128(p + 3);
        p += 4;
        size -= 64;
#define FOLD(x, by, next) _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, by, 0x00), \
                                                      _mm_clmulepi64_si128(x, by, 0x11)), next)
        for (; size >= 64; p += 4, size -= 64) {
            x1 = FOLD(x1, by_64_bytes, _mm_loadu_si128(p));
            x2 = FOLD(x2, by_64_bytes, _mm_loadu_si128(p + 1));
            x3 = FOLD(x3, by_64_bytes, _mm_loadu_si128(p + 2));
            x4 = FOLD(x4, by_64_bytes, _mm_loadu_si128(p + 3));
        }
        x1 = FOLD(FOLD(FOLD(x1, by_16_bytes, x2), by_16_bytes, x3), by_16_bytes, x4);
        for (; size >= 16; p++, size -= 16) x1 = FOLD(x1, by_16_bytes, _mm_loadu_si128(p));
#undef FOLD
        x1 = _mm_xor_si128(_mm_clmulepi64_si128(by_16_bytes, x1, 0x01), _mm_srli_si128(x1, 8));
        x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, low32), by_8_bytes, 0x00), _mm_srli_si128(x1, 4));
        __m128i quotient = _mm_clmulepi64_si128(_mm_and_si128(x1, low32), polynomial, 0x10);
        __m128i product = _mm_clmulepi64_si128(_mm_and_si128(quotient, low32), polynomial, 0x00);
        crc = ~(uint32_t)_mm_extract_epi32(_mm_xor_si128(product, x1), 1);
        data = (const unsigned char *)p;
    }
#endif
    return size ? (uint32_t)crc32(crc, data, (uInt)size) : crc;
}

#endif
