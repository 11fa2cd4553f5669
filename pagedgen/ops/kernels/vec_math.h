/*
 * expf that the compiler can vectorise (glibc's scalar expf is a call per element): Cephes' single
 * precision method, exp(x) = 2^n * exp(r) with |r| <= ln(2) / 2 and a degree-6 polynomial for exp(r).
 * Relative error about 2e-7 (1-2 ulp) for x in [-87.3, 88.7]; inputs are clamped to that range, so
 * exp(-inf) gives 1e-38 instead of 0 (no input of ours is below -87 except in a softmax, where it
 * contributes nothing measurable).
 */
#ifndef PAGEDGEN_VEC_MATH_H
#define PAGEDGEN_VEC_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float vec_expf(float x) {
    /* Plain compares and the 1.5 * 2^23 rounding trick instead of fminf/floorf: those keep NaN and
     * errno semantics that stop GCC from vectorising the loop. */
    x = x < -87.3f ? -87.3f : x;
    x = x > 88.7f ? 88.7f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale); /* a bit cast: compiles to a register move, vectorises */
    return p * scale;
}

#endif
