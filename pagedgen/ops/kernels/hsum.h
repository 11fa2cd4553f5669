/*
 * Horizontal sums of fp32 vectors in one fixed tree: the lanes of a 4-lane vector as (a0 + a2) + (a1 + a3),
 * of an 8-lane vector the same after adding lane i and lane i + 4. Written once so that every kernel that
 * reduces a vector of sums (quant_gemm.c, small_gemm.c, quant_q8_k.c) takes the same tree, which their
 * bit-for-bit tests and numpy rebuilds assume. Needs AVX (its files include it in their vector sections).
 */
#ifndef PAGEDGEN_HSUM_H
#define PAGEDGEN_HSUM_H

#include <immintrin.h>

static inline float hsum4_ps(__m128 a) {
    const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

static inline float hsum8_ps(__m256 v) {
    return hsum4_ps(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
}

#endif
