/*
 * IEEE half precision <-> fp32, exactly: GGUF's block scales are f16. Widening is exact (every f16 is an
 * fp32); narrowing rounds to nearest even, as F16C's _cvtss_sh(f, 0) and numpy's astype(float16) do. F16C
 * when the build has it, else the same results in plain C. Shared by the exact kernels (quant_gemm.c) and
 * the 8-bit-activation ones (quant_q8.c).
 */
#ifndef PAGEDGEN_HALF_H
#define PAGEDGEN_HALF_H

#include <stdint.h>
#include <string.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    /* The exact widening: normals rebias the exponent, subnormals are normalised, inf/NaN keep their bits. */
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0 && man == 0) {
        bits = sign;
    } else if (exp == 0) {
        exp = 113;
        while (!(man & 0x400)) man <<= 1, --exp;
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

/* fp32 -> f16, rounding to nearest even (F16C's _cvtss_sh(f, 0), numpy's astype(float16)). */
static inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, 0);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, exp = (x >> 23) & 0xff;
    uint32_t man = x & 0x7fffff;
    if (exp == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
    const int e = (int)exp - 112; /* the f16 exponent field */
    if (e >= 31) return (uint16_t)(sign | 0x7c00);
    if (e <= 0) { /* f16 subnormal (or zero): units of 2^-24 */
        if (e < -10) return (uint16_t)sign;
        man |= 0x800000;
        const int shift = 14 - e;
        uint32_t half = man >> shift;
        const uint32_t rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1))) ++half;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((uint32_t)e << 10) | (man >> 13);
    const uint32_t rem = man & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half; /* a carry rounds up to the next binade/inf */
    return (uint16_t)(sign | half);
#endif
}

#endif
