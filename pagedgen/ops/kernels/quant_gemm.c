/*
 * GEMM over weights kept in their stored format: GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K,
 * Q6_K blocks, f16 and bf16.
 *
 * Why: a decode step at 1-64 rows is a stream of the weight matrices. Dequantised to fp32 the default
 * model's weights are 538 MB; as Q4_1/Q8_0 blocks they are 85 MB. Here each thread of torch's OpenMP pool
 * streams a contiguous slice of packed weight rows once, expands four rows at a time into an L1-resident
 * fp32 buffer (exactly as gguf-py's dequantizer computes them, see below) and runs every x row against
 * them. Activations and accumulation stay fp32.
 *
 * Exactness: every expanded weight equals gguf.quants.dequantize's float32 bit for bit. Its formulas are a
 * product of an f16 scale (11 significant bits) with a small integer (at most 8 bits), which fp32 holds
 * exactly, plus at most one add (Q4_1/Q5_1's min, Q2_K/Q4_K/Q5_K's block min): one rounding whether or not
 * the compiler fuses them into an FMA. The K-quants first form d * sub-scale (exact: at most 11 + 6 bits),
 * then multiply by q (exact up to 23 bits, so at most one rounding with the min), in gguf-py's order.
 *
 * Invariance: an output's sum is one thread's fixed-order sum whose order depends on k only, never on how
 * many x rows share the call or on the thread count, so a row gets the same bits alone or in any batch.
 *
 * Layouts: x [m_rows, k] fp32, w [n_out, row_bytes] (each row its k / block_elems blocks), y [m_rows,
 * n_out], bias [n_out] or NULL; all contiguous. qtype is the ggml type id.
 *
 * Variants, chosen by the build's -march: AVX-512F (16 lanes), AVX2 + FMA (8 lanes), or portable C that
 * the compiler vectorises. k must be a multiple of the vector width for the vector tile, else the portable
 * dot is used (the choice depends on k only).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>

#include "hsum.h"
#endif

#include "half.h"
#include "prefetch.h"

enum {
    QT_F16 = 1,
    QT_Q4_0 = 2,
    QT_Q4_1 = 3,
    QT_Q5_0 = 6,
    QT_Q5_1 = 7,
    QT_Q8_0 = 8,
    QT_Q2_K = 10,
    QT_Q3_K = 11,
    QT_Q4_K = 12,
    QT_Q5_K = 13,
    QT_Q6_K = 14,
    QT_BF16 = 30
};

/* qtype | QT_Q8_ACTIVATIONS asks quant_gemm_f32 for 8-bit activations (quant_q8.c: approximate, opt-in). */
#define QT_Q8_ACTIVATIONS 0x100
int quant_gemm_q8(const float *x, int64_t m_rows, const uint8_t *w, int64_t row_bytes, int qtype, int64_t k,
                  int64_t n_out, const float *bias, float *y, int num_threads);

#if defined(__AVX512F__)
#define VW 16
typedef __m512 vec;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
/* The sum of the 16 lanes in a fixed tree (GCC's _mm512_reduce_add_ps, written out so that no compiler's
 * own version can change it, and vsum8 below can give the same bits): t_i = v_i + v_{i+8}, u_j = t_j +
 * t_{j+4}, then (u_0 + u_2) + (u_1 + u_3). */
static inline float vsum(vec v) {
    const __m256 t =
        _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    return hsum8_ps(t);
}
/* vsum of a[0] .. a[7] at once, each in vsum's tree, as the lanes 0-7 of the result (AVX-512F alone): 24
 * instructions where eight vsums take 64. */
static inline __attribute__((always_inline)) __m512 vsum8(const vec a[8]) {
    __m512 x[4], y[2];
    for (int p = 0; p < 4; ++p) /* lanes 0-7: t of a[2p], 8-15: t of a[2p + 1] */
        x[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
    for (int q = 0; q < 2; ++q) /* 128-bit lane l: u of a[4q + l] */
        y[q] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * q], x[2 * q + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * q], x[2 * q + 1], 0xDD));
    /* lane l: u_0 + u_2, u_1 + u_3 of a[l], then of a[4 + l] */
    const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x44), _mm512_shuffle_ps(y[0], y[1], 0xEE));
    const __m512 r = _mm512_add_ps(z, _mm512_permute_ps(z, 0xB1)); /* elements 0 and 2 of lane l: a[l], a[4 + l] */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0), r);
}
static inline vec vset1(float f) { return _mm512_set1_ps(f); }
/* 16 bytes -> 16 floats at out (unsigned or signed bytes), times scale plus offset (exact: see the top). */
static inline void bytes16_u(__m128i b, vec scale, vec offset, float *out) {
    _mm512_storeu_ps(out, _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)), offset));
}
static inline void bytes16_i(__m128i b, vec scale, float *out) {
    _mm512_storeu_ps(out, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) /* F16C: the f16 scales */
#define VW 8
typedef __m256 vec;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec v) { return hsum8_ps(v); }
static inline vec vset1(float f) { return _mm256_set1_ps(f); }
static inline void bytes16_u(__m128i b, vec scale, vec offset, float *out) {
    _mm256_storeu_ps(out, _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), offset));
    b = _mm_srli_si128(b, 8);
    _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), offset));
}
static inline void bytes16_i(__m128i b, vec scale, float *out) {
    _mm256_storeu_ps(out, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))));
    b = _mm_srli_si128(b, 8);
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b))));
}
#endif

/* Vector expanders: a block's 16 bytes of nibbles (or 32 int8) widened to fp32 lanes, then the same
 * product (and add) as the scalar formulas below. */
static void expand_q4_0(const uint8_t *row, int64_t k, float *out) {
    for (int64_t b = 0; b < k / 32; ++b, row += 18, out += 32) {
        const float d = f16_at(row);
        const uint8_t *qs = row + 2;
#ifdef VW
        const __m128i q = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
        const vec vd = vset1(d);
        bytes16_i(_mm_sub_epi8(_mm_and_si128(q, mask), eight), vd, out);
        bytes16_i(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), mask), eight), vd, out + 16);
#else
        for (int j = 0; j < 16; ++j) {
            out[j] = d * (float)((int)(qs[j] & 15) - 8);
            out[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
        }
#endif
    }
}

static void expand_q4_1(const uint8_t *row, int64_t k, float *out) {
    for (int64_t b = 0; b < k / 32; ++b, row += 20, out += 32) {
        const float d = f16_at(row), m = f16_at(row + 2);
        const uint8_t *qs = row + 4;
#ifdef VW
        const __m128i q = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(15);
        const vec vd = vset1(d), vm = vset1(m);
        bytes16_u(_mm_and_si128(q, mask), vd, vm, out);
        bytes16_u(_mm_and_si128(_mm_srli_epi16(q, 4), mask), vd, vm, out + 16);
#else
        for (int j = 0; j < 16; ++j) {
            out[j] = d * (float)(qs[j] & 15) + m;
            out[j + 16] = d * (float)(qs[j] >> 4) + m;
        }
#endif
    }
}

static void expand_q8_0(const uint8_t *row, int64_t k, float *out) {
    for (int64_t b = 0; b < k / 32; ++b, row += 34, out += 32) {
        const float d = f16_at(row);
        const int8_t *qs = (const int8_t *)(row + 2);
#ifdef VW
        const vec vd = vset1(d);
        bytes16_i(_mm_loadu_si128((const __m128i *)qs), vd, out);
        bytes16_i(_mm_loadu_si128((const __m128i *)(qs + 16)), vd, out + 16);
#else
        for (int j = 0; j < 32; ++j) out[j] = d * (float)qs[j];
#endif
    }
}

static void expand_q4_k(const uint8_t *row, int64_t k, float *out) {
    for (int64_t b = 0; b < k / 256; ++b, row += 144, out += 256) {
        const float d = f16_at(row), dmin = f16_at(row + 2);
        const uint8_t *s = row + 4, *qs = row + 16;
        float scale[8], min[8];
        for (int j = 0; j < 4; ++j) {
            scale[j] = d * (float)(s[j] & 63);
            min[j] = dmin * (float)(s[j + 4] & 63);
            scale[j + 4] = d * (float)((s[j + 8] & 15) | ((s[j] >> 2) & 0x30));
            min[j + 4] = dmin * (float)((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
        }
        for (int i = 0; i < 4; ++i) { /* 32 bytes -> sub-blocks 2i (low nibbles) and 2i + 1 (high) */
#ifdef VW
            const __m128i mask = _mm_set1_epi8(15);
            for (int l = 0; l < 32; l += 16) {
                const __m128i q = _mm_loadu_si128((const __m128i *)(qs + 32 * i + l));
                bytes16_u(_mm_and_si128(q, mask), vset1(scale[2 * i]), vset1(-min[2 * i]), out + 64 * i + l);
                bytes16_u(_mm_and_si128(_mm_srli_epi16(q, 4), mask), vset1(scale[2 * i + 1]), vset1(-min[2 * i + 1]),
                          out + 64 * i + 32 + l);
            }
            continue;
#endif
            for (int l = 0; l < 32; ++l) {
                out[64 * i + l] = scale[2 * i] * (float)(qs[32 * i + l] & 15) - min[2 * i];
                out[64 * i + 32 + l] = scale[2 * i + 1] * (float)(qs[32 * i + l] >> 4) - min[2 * i + 1];
            }
        }
    }
}

/* The 5-bit formats' fifth bits: 16 bytes whose byte j is 0x10 where bit j of the 16-bit bits is set. */
#ifdef VW
static inline __m128i high_bits16(uint32_t bits) {
    const __m128i first_two = _mm_set_epi8(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m128i spread = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)bits), first_two); /* bytes 0, 1 x 8 */
    const __m128i select = _mm_set1_epi64x((long long)0x8040201008040201ull);
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, select), select), _mm_set1_epi8(0x10));
}

/* 16 bytes of 0x10 (or of `value`) where bit `bit` of each byte of b is set, else 0. */
static inline __m128i bit_of_bytes(__m128i b, int bit, char value) {
    const __m128i select = _mm_set1_epi8((char)(1u << bit));
    return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(b, select), select), _mm_set1_epi8(value));
}
#endif

/* Q5_0: d (f16), 32 fifth bits (u32 little-endian), 16 bytes of nibbles; w = d * (q - 16), exact. */
static void expand_q5_0(const uint8_t *row, int64_t k, float *out) {
    for (int64_t b = 0; b < k / 32; ++b, row += 22, out += 32) {
        const float d = f16_at(row);
        uint32_t qh;
        memcpy(&qh, row + 2, 4);
        const uint8_t *qs = row + 6;
#ifdef VW
        const __m128i q = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(15), bias = _mm_set1_epi8(16);
        const vec vd = vset1(d);
        const __m128i lo = _mm_or_si128(_mm_and_si128(q, mask), high_bits16(qh & 0xffff));
        const __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(q, 4), mask), high_bits16(qh >> 16));
        bytes16_i(_mm_sub_epi8(lo, bias), vd, out);
        bytes16_i(_mm_sub_epi8(hi, bias), vd, out + 16);
#else
        for (int j = 0; j < 16; ++j) {
            out[j] = d * (float)((int)((qs[j] & 15) | (((qh >> j) & 1) << 4)) - 16);
            out[j + 16] = d * (float)((int)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
        }
#endif
    }
}

/* Q5_1: d, m (f16), 32 fifth bits, 16 bytes of nibbles; w = d * q + m (one rounding). */
static void expand_q5_1(const uint8_t *row, int64_t k, float *out) {
    for (int64_t b = 0; b < k / 32; ++b, row += 24, out += 32) {
        const float d = f16_at(row), m = f16_at(row + 2);
        uint32_t qh;
        memcpy(&qh, row + 4, 4);
        const uint8_t *qs = row + 8;
#ifdef VW
        const __m128i q = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(15);
        const vec vd = vset1(d), vm = vset1(m);
        bytes16_u(_mm_or_si128(_mm_and_si128(q, mask), high_bits16(qh & 0xffff)), vd, vm, out);
        bytes16_u(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(q, 4), mask), high_bits16(qh >> 16)), vd, vm, out + 16);
#else
        for (int j = 0; j < 16; ++j) {
            out[j] = d * (float)((qs[j] & 15) | (((qh >> j) & 1) << 4)) + m;
            out[j + 16] = d * (float)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
        }
#endif
    }
}

/* Q2_K: 16 bytes of 4-bit scale/min pairs, 64 bytes of 2-bit q, d, dmin (f16). Output h * 128 + s * 32 + l
 * (half h, shift s, l < 32) is bits 2s of qs[32h + l], in sub-block of 16 number 8h + 2s + l / 16;
 * w = (d * scale) * q - dmin * min. */
static void expand_q2_k(const uint8_t *row, int64_t k, float *out) {
    for (int64_t b = 0; b < k / 256; ++b, row += 84, out += 256) {
        const uint8_t *sc = row, *qs = row + 16;
        const float d = f16_at(row + 80), dmin = f16_at(row + 82);
        float scale[16], min[16];
        for (int i = 0; i < 16; ++i) {
            scale[i] = d * (float)(sc[i] & 15);
            min[i] = dmin * (float)(sc[i] >> 4);
        }
        for (int h = 0; h < 2; ++h) {
            for (int s = 0; s < 4; ++s) {
                const int sub = 8 * h + 2 * s;
                float *o = out + 128 * h + 32 * s;
#ifdef VW
                const __m128i three = _mm_set1_epi8(3);
                for (int l = 0; l < 32; l += 16) {
                    const __m128i q = _mm_loadu_si128((const __m128i *)(qs + 32 * h + l));
                    const __m128i v = _mm_and_si128(_mm_srl_epi16(q, _mm_cvtsi32_si128(2 * s)), three);
                    bytes16_u(v, vset1(scale[sub + l / 16]), vset1(-min[sub + l / 16]), o + l);
                }
                continue;
#endif
                for (int l = 0; l < 32; ++l) {
                    const int q = (qs[32 * h + l] >> (2 * s)) & 3;
                    o[l] = scale[sub + l / 16] * (float)q - min[sub + l / 16];
                }
            }
        }
    }
}

/* Q3_K: 32 bytes of high-bit masks, 64 bytes of 2-bit q, 12 bytes of 6-bit scales, d (f16). Output
 * h * 128 + s * 32 + l takes bits 2s of qs[32h + l] and bit 4h + s of hmask[l] (clear: minus 4); its
 * sub-block of 16 is 8h + 2s + l / 16; w = (d * (scale - 32)) * q, exact. */
static void expand_q3_k(const uint8_t *row, int64_t k, float *out) {
    for (int64_t b = 0; b < k / 256; ++b, row += 110, out += 256) {
        const uint8_t *hmask = row, *qs = row + 32, *sc = row + 96;
        const float d = f16_at(row + 108);
        float scale[16];
        for (int i = 0; i < 16; ++i) {
            const int low = i < 8 ? sc[i] & 15 : sc[i - 8] >> 4, high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
            scale[i] = d * (float)((low | (high << 4)) - 32);
        }
        for (int h = 0; h < 2; ++h) {
            for (int s = 0; s < 4; ++s) {
                const int sub = 8 * h + 2 * s, bit = 4 * h + s;
                float *o = out + 128 * h + 32 * s;
#ifdef VW
                const __m128i three = _mm_set1_epi8(3), four = _mm_set1_epi8(4);
                for (int l = 0; l < 32; l += 16) {
                    const __m128i q = _mm_loadu_si128((const __m128i *)(qs + 32 * h + l));
                    const __m128i hm = _mm_loadu_si128((const __m128i *)(hmask + l));
                    const __m128i low = _mm_and_si128(_mm_srl_epi16(q, _mm_cvtsi32_si128(2 * s)), three);
                    const __m128i v = _mm_sub_epi8(low, _mm_andnot_si128(bit_of_bytes(hm, bit, 4), four));
                    bytes16_i(v, vset1(scale[sub + l / 16]), o + l);
                }
                continue;
#endif
                for (int l = 0; l < 32; ++l) {
                    const int q = ((qs[32 * h + l] >> (2 * s)) & 3) - (((hmask[l] >> bit) & 1) ? 0 : 4);
                    o[l] = scale[sub + l / 16] * (float)q;
                }
            }
        }
    }
}

/* Q5_K: d, dmin (f16), Q4_K's 12 bytes of 6-bit scales and mins, 32 bytes of fifth bits, 128 bytes of
 * nibbles. Sub-block j (32 weights) takes the low (even j) or high (odd j) nibbles of qs[32 (j / 2) + l]
 * and bit j of qh[l]; w = (d * scale) * q - dmin * min. */
static void expand_q5_k(const uint8_t *row, int64_t k, float *out) {
    for (int64_t b = 0; b < k / 256; ++b, row += 176, out += 256) {
        const float d = f16_at(row), dmin = f16_at(row + 2);
        const uint8_t *s = row + 4, *qh = row + 16, *qs = row + 48;
        float scale[8], min[8];
        for (int j = 0; j < 4; ++j) {
            scale[j] = d * (float)(s[j] & 63);
            min[j] = dmin * (float)(s[j + 4] & 63);
            scale[j + 4] = d * (float)((s[j + 8] & 15) | ((s[j] >> 2) & 0x30));
            min[j + 4] = dmin * (float)((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
        }
        for (int j = 0; j < 8; ++j) {
            const uint8_t *q4 = qs + 32 * (j / 2);
            const int shift = 4 * (j & 1);
#ifdef VW
            const __m128i mask = _mm_set1_epi8(15);
            for (int l = 0; l < 32; l += 16) {
                const __m128i q = _mm_loadu_si128((const __m128i *)(q4 + l));
                const __m128i nib = _mm_and_si128(_mm_srl_epi16(q, _mm_cvtsi32_si128(shift)), mask);
                const __m128i high = bit_of_bytes(_mm_loadu_si128((const __m128i *)(qh + l)), j, 0x10);
                bytes16_u(_mm_or_si128(nib, high), vset1(scale[j]), vset1(-min[j]), out + 32 * j + l);
            }
            continue;
#endif
            for (int l = 0; l < 32; ++l) {
                const int q = ((q4[l] >> shift) & 15) | (((qh[l] >> j) & 1) << 4);
                out[32 * j + l] = scale[j] * (float)q - min[j];
            }
        }
    }
}

/* A Q6_K super-block's 16 scales d * sc[i] (d an f16 at byte 208, sc 16 int8 at byte 192): formed here for
 * both expand_q6_k and direct_q6_k_1x8, so the two read the same values. */
static inline void q6_k_scales(const uint8_t *block, float scale[16]) {
    const int8_t *sc = (const int8_t *)(block + 192);
    const float d = f16_at(block + 208);
    for (int i = 0; i < 16; ++i) scale[i] = d * (float)sc[i];
}

#ifdef VW
/* Sixteen Q6_K weights of quarter i (0-3) of a half, minus 32, as bytes: the low (i < 2) or high nibbles of
 * ql with bits 2 i and 2 i + 1 of qh above them. The caller passes ql[l ..] for quarters 0 and 2 and
 * ql[l + 32 ..] for 1 and 3 (expand_q6_k's q1 .. q4). Shared by the expander and the register path. */
static inline __attribute__((always_inline)) __m128i q6_k_quarter(__m128i ql, __m128i qh, const int i) {
    const __m128i low = _mm_set1_epi8(15), high = _mm_set1_epi8(0x30);
    const __m128i nib = _mm_and_si128(i < 2 ? ql : _mm_srli_epi16(ql, 4), low);
    const __m128i top = i == 0   ? _mm_slli_epi16(qh, 4)
                        : i == 1 ? _mm_slli_epi16(qh, 2)
                        : i == 2 ? qh
                                 : _mm_srli_epi16(qh, 2);
    return _mm_sub_epi8(_mm_or_si128(nib, _mm_and_si128(top, high)), _mm_set1_epi8(32));
}
#endif

/* Q6_K: each half of a super-block (128 weights) takes 64 bytes of low nibbles and 32 bytes of 2-bit highs;
 * output l, l + 32, l + 64, l + 96 of the half share ql[l], ql[l + 32] and qh[l] (gguf-py's reshapes, which
 * are llama.cpp's dequantize_row_q6_K). Written as four 32-wide loops the compiler vectorises. */
static void expand_q6_k(const uint8_t *row, int64_t k, float *out) {
    for (int64_t b = 0; b < k / 256; ++b, row += 210) {
        const uint8_t *ql = row, *qh = row + 128;
        float scale[16];
        q6_k_scales(row, scale);
        for (int half = 0; half < 2; ++half, ql += 64, qh += 32, out += 128) {
            const float *s = scale + 8 * half;
#ifdef VW
            for (int l = 0; l < 32; l += 16) {
                const __m128i a = _mm_loadu_si128((const __m128i *)(ql + l));
                const __m128i c = _mm_loadu_si128((const __m128i *)(ql + l + 32));
                const __m128i h = _mm_loadu_si128((const __m128i *)(qh + l));
                const int is = l / 16;
                bytes16_i(q6_k_quarter(a, h, 0), vset1(s[is]), out + l);
                bytes16_i(q6_k_quarter(c, h, 1), vset1(s[is + 2]), out + l + 32);
                bytes16_i(q6_k_quarter(a, h, 2), vset1(s[is + 4]), out + l + 64);
                bytes16_i(q6_k_quarter(c, h, 3), vset1(s[is + 6]), out + l + 96);
            }
            continue;
#endif
            for (int l = 0; l < 32; ++l) {
                const int q1 = (ql[l] & 15) | ((qh[l] & 3) << 4), q2 = (ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4);
                const int q3 = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4), q4 = (ql[l + 32] >> 4) | ((qh[l] >> 6) << 4);
                const int is = l / 16;
                out[l] = s[is] * (float)(q1 - 32);
                out[l + 32] = s[is + 2] * (float)(q2 - 32);
                out[l + 64] = s[is + 4] * (float)(q3 - 32);
                out[l + 96] = s[is + 6] * (float)(q4 - 32);
            }
        }
    }
}

static void expand_f16(const uint8_t *row, int64_t k, float *out) {
    int64_t d = 0;
#if defined(__F16C__)
    for (; d + 8 <= k; d += 8) _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * d))));
#endif
    for (; d < k; ++d) out[d] = f16_at(row + 2 * d);
}

static void expand_bf16(const uint8_t *row, int64_t k, float *out) {
    int64_t d = 0;
#if defined(__AVX512F__)
    for (; d + 16 <= k; d += 16) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + 2 * d)));
        _mm512_storeu_ps(out + d, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
#elif defined(__AVX2__)
    for (; d + 8 <= k; d += 8) {
        const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + 2 * d)));
        _mm256_storeu_ps(out + d, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
#endif
    for (; d < k; ++d) {
        uint16_t h;
        memcpy(&h, row + 2 * d, 2);
        const uint32_t bits = (uint32_t)h << 16;
        memcpy(out + d, &bits, 4);
    }
}

/* Expand one packed row of k weights into out[k]; returns 0, or -1 for an unknown qtype. */
static int expand_row(int qtype, const uint8_t *row, int64_t k, float *out) {
    switch (qtype) {
    case QT_Q4_0: expand_q4_0(row, k, out); return 0;
    case QT_Q4_1: expand_q4_1(row, k, out); return 0;
    case QT_Q5_0: expand_q5_0(row, k, out); return 0;
    case QT_Q5_1: expand_q5_1(row, k, out); return 0;
    case QT_Q8_0: expand_q8_0(row, k, out); return 0;
    case QT_Q2_K: expand_q2_k(row, k, out); return 0;
    case QT_Q3_K: expand_q3_k(row, k, out); return 0;
    case QT_Q4_K: expand_q4_k(row, k, out); return 0;
    case QT_Q5_K: expand_q5_k(row, k, out); return 0;
    case QT_Q6_K: expand_q6_k(row, k, out); return 0;
    case QT_F16: expand_f16(row, k, out); return 0;
    case QT_BF16: expand_bf16(row, k, out); return 0;
    default: return -1;
    }
}

static inline float add_bias(float s, const float *bias, int64_t n) { return bias ? s + bias[n] : s; }

/* The portable dot: one fixed-order (compiler-vectorised) reduction per output. */
static float dot_portable(const float *x, const float *w, int64_t k) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < k; ++d) s += x[d] * w[d];
    return s;
}


#ifdef VW
/* Keep a loaded vector in a register: an empty asm that "changes" it, so the compiler cannot fold its load
 * into each FMA that uses it. Why: with 12 accumulators, 3 x vectors and 1 weight vector the full tile
 * needs all 16 AVX2 registers, and GCC then folds the loads into the FMAs instead: 16 loads per 12 FMAs
 * (x loaded once per weight row), which bound the tile at 2 loads a cycle. Held in registers it is 7 loads
 * per 12 FMAs: 0.76-0.87x the time at 4-64 rows on a 2-core AMD EPYC (AVX2), bit-identical (only the
 * loads move). AVX-512 has 32 registers and needs no hint. */
#if VW == 8
static inline __attribute__((always_inline)) void in_register(vec *v) { __asm__("" : "+x"(*v)); }
static inline __attribute__((always_inline)) void in_register3(vec *a, vec *b, vec *c) {
    __asm__("" : "+x"(*a), "+x"(*b), "+x"(*c));
}

/* vsum of A, B, C and D at once, each in vsum's own tree ((v0+v4)+(v2+v6)) + ((v1+v5)+(v3+v7)), so the bits
 * are vsum's: s[0] = A, s[4] = B, s[1] = C, s[5] = D. 11 instructions for four sums instead of 24; about
 * 5% of a full tile's time at k = 640. */
static inline __attribute__((always_inline)) void vsum4(vec a, vec b, vec c, vec d, float *s) {
    const vec ab = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    const vec cd = _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
    const vec even = _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)); /* a0 a2 c0 c2 | b0 b2 d0 d2 */
    const vec odd = _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 1, 3, 1));  /* a1 a3 c1 c3 | b1 b3 d1 d3 */
    const vec h = _mm256_hadd_ps(even, odd);                              /* a02 c02 a13 c13 | b.. d.. */
    _mm256_storeu_ps(s, _mm256_add_ps(h, _mm256_permute_ps(h, _MM_SHUFFLE(1, 0, 3, 2))));
}
#else
static inline __attribute__((always_inline)) void in_register(vec *v) { (void)v; }
static inline __attribute__((always_inline)) void in_register3(vec *a, vec *b, vec *c) {
    (void)a, (void)b, (void)c;
}
#endif

/* x rows m .. m + mr - 1 (mr <= 3) against the four expanded rows w[4][k]: twelve accumulators, VW k at a
 * time. Each output's chain is the same whatever mr is. k is a multiple of VW. */
static inline __attribute__((always_inline)) void tile_3x4(const float *x, int64_t k, const float *w,
                                                           const float *bias, float *y, int64_t n_out,
                                                           int64_t m, int64_t n, const int mr) {
    const float *x0 = x + m * k, *x1 = mr > 1 ? x0 + k : x0, *x2 = mr > 2 ? x0 + 2 * k : x0;
    const float *w0 = w, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
    vec a00 = vzero(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    vec a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    for (int64_t d = 0; d < k; d += VW) {
        vec v0 = vload(x0 + d), v1 = vload(x1 + d), v2 = vload(x2 + d);
        if (mr == 3) in_register3(&v0, &v1, &v2);
        vec b = vload(w0 + d);
        if (mr == 3) in_register(&b);
        a00 = vfma(v0, b, a00), a10 = vfma(v1, b, a10), a20 = vfma(v2, b, a20);
        b = vload(w1 + d);
        if (mr == 3) in_register(&b);
        a01 = vfma(v0, b, a01), a11 = vfma(v1, b, a11), a21 = vfma(v2, b, a21);
        b = vload(w2 + d);
        if (mr == 3) in_register(&b);
        a02 = vfma(v0, b, a02), a12 = vfma(v1, b, a12), a22 = vfma(v2, b, a22);
        b = vload(w3 + d);
        if (mr == 3) in_register(&b);
        a03 = vfma(v0, b, a03), a13 = vfma(v1, b, a13), a23 = vfma(v2, b, a23);
    }
    const vec acc[3][4] = {{a00, a01, a02, a03}, {a10, a11, a12, a13}, {a20, a21, a22, a23}};
#if VW == 8
    if (mr == 3) {
        for (int r = 0; r < 3; ++r) {
            float s[8];
            vsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], s);
            const float sums[4] = {s[0], s[4], s[1], s[5]};
            for (int c = 0; c < 4; ++c) y[(m + r) * n_out + n + c] = add_bias(sums[c], bias, n + c);
        }
        return;
    }
#endif
    for (int r = 0; r < mr; ++r)
        for (int c = 0; c < 4; ++c) y[(m + r) * n_out + n + c] = add_bias(vsum(acc[r][c]), bias, n + c);
}

#if VW == 16
/* The AVX-512 tile: x rows m .. m + mr - 1 (mr <= 3) against eight expanded rows w[8][k], 24 accumulators
 * in the 32 registers, outputs n .. n + nr - 1 written (the rows past nr are computed, not stored). Each
 * output's chain is tile_3x4's (fma over k in order, then vsum), so the bits are the same; what changes is
 * the traffic: at 32 x rows of k = 640 the x rows (80 KB) do not stay in L1, and eight weight rows per pass
 * over them read x half as often per FMA as four. */
static inline __attribute__((always_inline)) void tile_3x8(const float *x, int64_t k, const float *w,
                                                           const float *bias, float *y, int64_t n_out,
                                                           int64_t m, int64_t n, const int mr, int nr) {
    const float *x0 = x + m * k, *x1 = mr > 1 ? x0 + k : x0, *x2 = mr > 2 ? x0 + 2 * k : x0;
    vec a[3][8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) a[0][c] = vzero(), a[1][c] = vzero(), a[2][c] = vzero();
    for (int64_t d = 0; d < k; d += VW) {
        const vec v0 = vload(x0 + d), v1 = vload(x1 + d), v2 = vload(x2 + d);
#pragma GCC unroll 8
        for (int c = 0; c < 8; ++c) {
            const vec b = vload(w + c * k + d);
            a[0][c] = vfma(v0, b, a[0][c]);
            if (mr > 1) a[1][c] = vfma(v1, b, a[1][c]);
            if (mr > 2) a[2][c] = vfma(v2, b, a[2][c]);
        }
    }
    const __mmask16 stored = (__mmask16)((1u << nr) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(stored, bias + n) : _mm512_setzero_ps();
    for (int r = 0; r < mr; ++r) { /* add_bias's one add per output */
        const __m512 sums = vsum8(a[r]);
        _mm512_mask_storeu_ps(y + (m + r) * n_out + n, stored, bias ? _mm512_add_ps(sums, b) : sums);
    }
}
#endif

/* One expanded row against one x row with the tile's arithmetic (one accumulator chain). */
static inline float dot_vec(const float *x, const float *w, int64_t k) {
    vec a = vzero();
    for (int64_t d = 0; d < k; d += VW) a = vfma(vload(x + d), vload(w + d), a);
    return vsum(a);
}
#endif

/* Rows n .. n + nr - 1 of w, expanded in buf [nr, k], against every x row. */
static void rows_times_x(const float *x, int64_t m_rows, const float *buf, int nr, int64_t k, const float *bias,
                         float *y, int64_t n_out, int64_t n) {
#ifdef VW
#if VW == 16
    if (k % VW == 0 && nr > 4) { /* a group of eight (WHOLE_ROW_GROUP) */
        for (int64_t m = 0; m < m_rows; m += 3) {
            const int mr = m_rows - m >= 3 ? 3 : (int)(m_rows - m);
            if (mr == 3)
                tile_3x8(x, k, buf, bias, y, n_out, m, n, 3, nr);
            else if (mr == 2)
                tile_3x8(x, k, buf, bias, y, n_out, m, n, 2, nr);
            else
                tile_3x8(x, k, buf, bias, y, n_out, m, n, 1, nr);
        }
        return;
    }
#endif
    if (k % VW == 0) {
        if (nr == 4) {
            for (int64_t m = 0; m < m_rows; m += 3) {
                const int mr = m_rows - m >= 3 ? 3 : (int)(m_rows - m);
                if (mr == 3)
                    tile_3x4(x, k, buf, bias, y, n_out, m, n, 3);
                else if (mr == 2)
                    tile_3x4(x, k, buf, bias, y, n_out, m, n, 2);
                else
                    tile_3x4(x, k, buf, bias, y, n_out, m, n, 1);
            }
        } else {
            for (int r = 0; r < nr; ++r)
                for (int64_t m = 0; m < m_rows; ++m)
                    y[m * n_out + n + r] = add_bias(dot_vec(x + m * k, buf + r * k, k), bias, n + r);
        }
        return;
    }
#endif
    for (int r = 0; r < nr; ++r)
        for (int64_t m = 0; m < m_rows; ++m)
            y[m * n_out + n + r] = add_bias(dot_portable(x + m * k, buf + r * k, k), bias, n + r);
}

/* Ask for the packed rows `ahead` rows ahead of the group being expanded: the expansion computes between
 * its loads, so without this a single thread keeps too few cache misses in flight to stream DRAM. */
#define PREFETCH_ROWS 32
static inline void prefetch_ahead(const uint8_t *w, int64_t row_bytes, int64_t n, int64_t n_out, int rows,
                                  int64_t ahead) {
    const int64_t first = n + ahead, last = first + rows < n_out ? first + rows : n_out;
    if (first >= last) return;
    const uint8_t *p = w + first * row_bytes, *end = w + last * row_bytes;
    for (; p < end; p += 64) __builtin_prefetch(p, 0, 1);
}

/* How far ahead the rows are asked for: PREFETCH_ROWS rows, except on the one-row register paths, which ask
 * about DIRECT_PREFETCH_BYTES ahead whatever the row length (at least one group). Measured on Q4_1 (AVX2
 * EPYC, 1 thread, the default model's four layer shapes from DRAM, load 13-17): 32 rows ahead (11.5 KB at
 * k = 576, 30 KB at k = 1536) took 1.07-1.11x the time of 4 KB ahead, and no prefetch 1.33x; 6-12 KB were
 * in between. With the window spread over the loop (ahead_window), 2 KB and 8 KB ahead were within 5% of
 * 4 KB on Q4_1, and 4 KB was as fast as 32 rows or faster on Q5_0, Q5_1, Q4_K and Q5_K (0.92-1.02x). */
#define DIRECT_PREFETCH_BYTES 4096
static inline int64_t prefetch_rows(int register_path, int group, int64_t row_bytes) {
    if (!register_path) return PREFETCH_ROWS;
    return DIRECT_PREFETCH_BYTES / row_bytes > group ? DIRECT_PREFETCH_BYTES / row_bytes : group;
}

/* Whether a call takes direct_q8_0_1x4: Q8_0 at one row on a vector build. */
static inline int q8_0_direct(int qtype, int64_t m_rows, int64_t k) {
#ifdef VW
    return qtype == QT_Q8_0 && m_rows == 1 && k % 32 == 0;
#else
    (void)qtype, (void)m_rows, (void)k;
    return 0;
#endif
}

/* Elements and bytes of one block of qtype (f16/bf16: one value of 2 bytes); 0 for an unknown qtype. */
static int64_t block_elems(int qtype, int64_t *bytes) {
    switch (qtype) {
    case QT_F16: case QT_BF16: *bytes = 2; return 1;
    case QT_Q4_0: *bytes = 18; return 32;
    case QT_Q4_1: *bytes = 20; return 32;
    case QT_Q5_0: *bytes = 22; return 32;
    case QT_Q5_1: *bytes = 24; return 32;
    case QT_Q8_0: *bytes = 34; return 32;
    case QT_Q2_K: *bytes = 84; return 256;
    case QT_Q3_K: *bytes = 110; return 256;
    case QT_Q4_K: *bytes = 144; return 256;
    case QT_Q5_K: *bytes = 176; return 256;
    case QT_Q6_K: *bytes = 210; return 256;
    default: *bytes = 0; return 0;
    }
}

#define CHUNK 256
#define GROUP_MAX 8
/* Weight rows expanded per group on the whole-row path (more than 3 x rows): eight on AVX-512 builds
 * (tile_3x8), four elsewhere (tile_3x4: sixteen registers). */
#if defined(VW) && VW == 16
#define WHOLE_ROW_GROUP 8
#else
#define WHOLE_ROW_GROUP 4
#endif

#ifdef VW
/* The few-rows path (decode): instead of expanding whole rows (4 x k floats: 24 KB at k = 1536, more than
 * half of L1 beside x and the stream), a group's rows are expanded CHUNK weights at a time into a 4-8 KB
 * buffer that stays in L1, and the accumulators stay in registers across chunks. Every output's chain is
 * the tile's: one accumulator, fma(x[d..], w[d..], acc) for d = 0, VW, 2 VW, ... in order, then vsum, so
 * the bits equal the whole-row path's and a row's result does not depend on which path its batch took.
 * One x row runs against eight weight rows (eight independent chains hide the FMA latency), two or three
 * x rows against four. */

static inline __attribute__((always_inline)) void chunk_1x8(const float *x, const float *buf, int64_t len,
                                                            vec acc[8]) {
    vec a0 = acc[0], a1 = acc[1], a2 = acc[2], a3 = acc[3], a4 = acc[4], a5 = acc[5], a6 = acc[6], a7 = acc[7];
    for (int64_t d = 0; d < len; d += VW) {
        const vec v = vload(x + d);
        a0 = vfma(v, vload(buf + d), a0), a1 = vfma(v, vload(buf + CHUNK + d), a1);
        a2 = vfma(v, vload(buf + 2 * CHUNK + d), a2), a3 = vfma(v, vload(buf + 3 * CHUNK + d), a3);
        a4 = vfma(v, vload(buf + 4 * CHUNK + d), a4), a5 = vfma(v, vload(buf + 5 * CHUNK + d), a5);
        a6 = vfma(v, vload(buf + 6 * CHUNK + d), a6), a7 = vfma(v, vload(buf + 7 * CHUNK + d), a7);
    }
    acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3, acc[4] = a4, acc[5] = a5, acc[6] = a6, acc[7] = a7;
}

static inline __attribute__((always_inline)) void chunk_3x4(const float *x, int64_t k, const float *buf,
                                                            int64_t len, vec acc[12], const int mr) {
    const float *x0 = x, *x1 = mr > 1 ? x0 + k : x0, *x2 = mr > 2 ? x0 + 2 * k : x0;
    vec a00 = acc[0], a01 = acc[1], a02 = acc[2], a03 = acc[3], a10 = acc[4], a11 = acc[5], a12 = acc[6];
    vec a13 = acc[7], a20 = acc[8], a21 = acc[9], a22 = acc[10], a23 = acc[11];
    for (int64_t d = 0; d < len; d += VW) {
        const vec v0 = vload(x0 + d), v1 = vload(x1 + d), v2 = vload(x2 + d);
        vec b = vload(buf + d);
        a00 = vfma(v0, b, a00), a10 = vfma(v1, b, a10), a20 = vfma(v2, b, a20);
        b = vload(buf + CHUNK + d);
        a01 = vfma(v0, b, a01), a11 = vfma(v1, b, a11), a21 = vfma(v2, b, a21);
        b = vload(buf + 2 * CHUNK + d);
        a02 = vfma(v0, b, a02), a12 = vfma(v1, b, a12), a22 = vfma(v2, b, a22);
        b = vload(buf + 3 * CHUNK + d);
        a03 = vfma(v0, b, a03), a13 = vfma(v1, b, a13), a23 = vfma(v2, b, a23);
    }
    acc[0] = a00, acc[1] = a01, acc[2] = a02, acc[3] = a03, acc[4] = a10, acc[5] = a11, acc[6] = a12;
    acc[7] = a13, acc[8] = a20, acc[9] = a21, acc[10] = a22, acc[11] = a23;
}

/* One x row against eight weight rows of Q4_0 with no buffer at all: each block's bytes are widened
 * straight into registers (zero-extended to 32-bit lanes, offset, converted, scaled: expand_q4_0's exact
 * arithmetic, so the same weight values) and fed to the same chains as chunk_1x8, in the same order.
 * Saves the expander's stores and the reloads. Rows past nr point at row n (read, never stored).
 * Measured (AVX2, 1 thread, a 49152 x 576 matrix streamed from DRAM): Q4_0 4.19 ms direct against 4.69
 * through the chunk buffer. Q4_1 has its own direct path below (1.7x the chunk buffer's speed once its two
 * scales are converted together); Q8_0 has its own four-row register path (direct_q8_0_1x4), which
 * needs its rows prefetched into L1 to beat the whole-row path from DRAM. */
#if VW == 16
static inline vec q4_0_lanes(const uint8_t *block, int h, int j) {
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + 2 + j)));
    q = h ? _mm512_srli_epi32(q, 4) : _mm512_and_si512(q, _mm512_set1_epi32(15));
    return _mm512_mul_ps(vset1(f16_at(block)),
                         _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(8))));
}
#else
static inline vec q4_0_lanes(const uint8_t *block, int h, int j) {
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block + 2 + j)));
    q = h ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, _mm256_set1_epi32(15));
    return _mm256_mul_ps(vset1(f16_at(block)),
                         _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(8))));
}
#endif

/* Weights 16 h + j .. 16 h + j + VW - 1 of each 32-block: byte j's low nibble is weight j, its high
 * nibble weight j + 16. */
static void direct_q4_0_1x8(const uint8_t *w, int64_t row_bytes, int64_t n, int nr, const float *x, int64_t k,
                            const ahead_window *ahead, vec acc[8]) {
    const uint8_t *rows[8];
    for (int r = 0; r < 8; ++r) rows[r] = w + (n + (r < nr ? r : 0)) * row_bytes;
    vec a0 = vzero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t b = 0; b < k / 32; ++b) {
        ask_step(ahead, b);
        const int64_t off = b * 18;
        for (int h = 0; h < 2; ++h)
            for (int j = 0; j < 16; j += VW) {
                const vec v = vload(x + 32 * b + 16 * h + j);
                a0 = vfma(v, q4_0_lanes(rows[0] + off, h, j), a0);
                a1 = vfma(v, q4_0_lanes(rows[1] + off, h, j), a1);
                a2 = vfma(v, q4_0_lanes(rows[2] + off, h, j), a2);
                a3 = vfma(v, q4_0_lanes(rows[3] + off, h, j), a3);
                a4 = vfma(v, q4_0_lanes(rows[4] + off, h, j), a4);
                a5 = vfma(v, q4_0_lanes(rows[5] + off, h, j), a5);
                a6 = vfma(v, q4_0_lanes(rows[6] + off, h, j), a6);
                a7 = vfma(v, q4_0_lanes(rows[7] + off, h, j), a7);
            }
    }
    acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3, acc[4] = a4, acc[5] = a5, acc[6] = a6, acc[7] = a7;
}

/* A Q4_1 block's d and m (f16) as two broadcast vectors: one 4-byte load, one conversion, two in-lane
 * shuffles (the scales are half of the work per block when each is converted and broadcast alone). */
#if VW == 16
static inline void q4_1_scales(const uint8_t *block, vec *d, vec *m) {
    uint32_t dm;
    memcpy(&dm, block, 4);
    const __m512 both = _mm512_cvtph_ps(_mm256_set1_epi32((int)dm)); /* d, m, d, m, ... */
    *d = _mm512_permute_ps(both, 0x00), *m = _mm512_permute_ps(both, 0x55);
}
#else
static inline void q4_1_scales(const uint8_t *block, vec *d, vec *m) {
    float dm; /* the two f16 as one 4-byte lane, broadcast by a load */
    memcpy(&dm, block, 4);
    const __m256 both = _mm256_cvtph_ps(_mm_castps_si128(_mm_set1_ps(dm))); /* d, m, d, m, ... */
    *d = _mm256_permute_ps(both, 0x00), *m = _mm256_permute_ps(both, 0x55);
}
#endif

/* One x row against eight weight rows of Q4_1, widened straight into registers: each weight is
 * fma(d, q, m) as expand_q4_1 computes it, fed to the chains of chunk_1x8 in the same order (weights 0, VW,
 * 2 VW, ... of the row), so the bits are the chunked path's. Per block and row: one broadcast load of the
 * scales, two byte-to-int32 widenings straight from memory (each int32 lane then holds a whole byte: its low
 * nibble is weight j, its high nibble weight j + 16), and/shift, convert, two FMAs per VW weights; no
 * stores. Rows past nr point at row n (read, never stored). */
static void direct_q4_1_1x8(const uint8_t *w, int64_t row_bytes, int64_t n, int nr, const float *x, int64_t k,
                            const ahead_window *ahead, vec acc[8]) {
    const uint8_t *rows[8];
    for (int r = 0; r < 8; ++r) rows[r] = w + (n + (r < nr ? r : 0)) * row_bytes;
    vec a[8];
    for (int r = 0; r < 8; ++r) a[r] = vzero();
    for (int64_t b = 0; b < k / 32; ++b) {
        ask_step(ahead, b);
        const int64_t off = b * 20;
        const float *xb = x + 32 * b;
#if VW == 16
        const vec x0 = vload(xb), x1 = vload(xb + 16);
        const __m512i low = _mm512_set1_epi32(15);
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) {
            const uint8_t *block = rows[r] + off;
            vec d, m;
            q4_1_scales(block, &d, &m);
            const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + 4)));
            a[r] = vfma(x0, vfma(d, _mm512_cvtepi32_ps(_mm512_and_si512(q, low)), m), a[r]);
            a[r] = vfma(x1, vfma(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), m), a[r]);
        }
#else
        const vec x0 = vload(xb), x1 = vload(xb + 8), x2 = vload(xb + 16), x3 = vload(xb + 24);
        const __m256i low = _mm256_set1_epi32(15);
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) {
            const uint8_t *block = rows[r] + off;
            vec d, m;
            q4_1_scales(block, &d, &m);
            const __m256i q0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block + 4)));
            const __m256i q1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block + 12)));
            a[r] = vfma(x0, vfma(d, _mm256_cvtepi32_ps(_mm256_and_si256(q0, low)), m), a[r]);
            a[r] = vfma(x1, vfma(d, _mm256_cvtepi32_ps(_mm256_and_si256(q1, low)), m), a[r]);
            a[r] = vfma(x2, vfma(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), m), a[r]);
            a[r] = vfma(x3, vfma(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), m), a[r]);
        }
#endif
    }
    for (int r = 0; r < 8; ++r) acc[r] = a[r];
}

/* The 1-row register paths of the other formats, at the build's width (AVX2: 8 lanes, AVX-512: 16). Each
 * computes every weight with its expander's own operations on the same integers, so the values are the
 * expander's bit for bit (the sign of a zero included), and feeds them to the chains of chunk_1x8 in weight
 * order: the bits are the chunked path's. Rows past nr point at row n (read, never stored). The AVX-512
 * bodies hold a 32-weight block in two vectors where AVX2 takes four, and pick a Q5 block's fifth bits with
 * mask registers (its 32-bit qh is the two 16-lane masks) where AVX2 shifts them into sign bits. */

/* A little-endian f16 at p, converted and broadcast to 8 lanes (two bytes read: the Q6_K scale ends its
 * block). */
static inline __m256 f16_bcast8(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _mm256_cvtph_ps(_mm_set1_epi16((short)h));
}

#if VW == 16
/* 16 bytes at p widened to int32 lanes. */
static inline __m512i widen16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
#else
/* 8 bytes at p widened to int32 lanes. */
static inline __m256i widen8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
#endif

/* Q5_0, weights widened to int32 lanes: lane j's nibble from its byte, its fifth bit (bit j of the 32-bit qh)
 * shifted to the sign bit by one variable shift, which picks the block's -16 d or -0 as the FMA's addend:
 * fma(d, nibble, -16 d) = d * (q - 16) exactly, and fma(d, nibble, -0) = d * nibble with its sign of zero,
 * the expander's d * (q - 16) in both cases. */
static void direct_q5_0_1x8(const uint8_t *w, int64_t row_bytes, int64_t n, int nr, const float *x, int64_t k,
                            const ahead_window *ahead, vec acc[8]) {
    const uint8_t *rows[8];
    for (int r = 0; r < 8; ++r) rows[r] = w + (n + (r < nr ? r : 0)) * row_bytes;
    vec a[8];
    for (int r = 0; r < 8; ++r) a[r] = vzero();
    const vec minus16 = vset1(-16.f), minus0 = vset1(-0.f);
#if VW == 16
    const __m512i low = _mm512_set1_epi32(15);
    for (int64_t b = 0; b < k / 32; ++b) {
        ask_step(ahead, b);
        const int64_t off = b * 22;
        const vec x0 = vload(x + 32 * b), x1 = vload(x + 32 * b + 16);
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) {
            const uint8_t *block = rows[r] + off;
            const vec d = vset1(f16_at(block)), nd = _mm512_mul_ps(d, minus16);
            uint32_t bits;
            memcpy(&bits, block + 2, 4);
            const __m512i q = widen16(block + 6);
            const vec add0 = _mm512_mask_blend_ps((__mmask16)bits, nd, minus0);
            const vec add1 = _mm512_mask_blend_ps((__mmask16)(bits >> 16), nd, minus0);
            a[r] = vfma(x0, vfma(d, _mm512_cvtepi32_ps(_mm512_and_si512(q, low)), add0), a[r]);
            a[r] = vfma(x1, vfma(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), add1), a[r]);
        }
    }
#else
    const __m256i low = _mm256_set1_epi32(15);
    const __m256i up0 = _mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24), eight = _mm256_set1_epi32(8);
    const __m256i up1 = _mm256_sub_epi32(up0, eight), up2 = _mm256_sub_epi32(up1, eight);
    const __m256i up3 = _mm256_sub_epi32(up2, eight);
    for (int64_t b = 0; b < k / 32; ++b) {
        ask_step(ahead, b);
        const int64_t off = b * 22;
        const float *xb = x + 32 * b;
        const vec x0 = vload(xb), x1 = vload(xb + 8), x2 = vload(xb + 16), x3 = vload(xb + 24);
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) {
            const uint8_t *block = rows[r] + off;
            const vec d = f16_bcast8(block), nd = _mm256_mul_ps(d, minus16);
            int32_t bits;
            memcpy(&bits, block + 2, 4);
            const __m256i qh = _mm256_set1_epi32(bits);
            const __m256i q0 = widen8(block + 6), q1 = widen8(block + 14);
#define Q5_0_ADDEND(up) _mm256_blendv_ps(nd, minus0, _mm256_castsi256_ps(_mm256_sllv_epi32(qh, up)))
            a[r] = vfma(x0, vfma(d, _mm256_cvtepi32_ps(_mm256_and_si256(q0, low)), Q5_0_ADDEND(up0)), a[r]);
            a[r] = vfma(x1, vfma(d, _mm256_cvtepi32_ps(_mm256_and_si256(q1, low)), Q5_0_ADDEND(up1)), a[r]);
            a[r] = vfma(x2, vfma(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), Q5_0_ADDEND(up2)), a[r]);
            a[r] = vfma(x3, vfma(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), Q5_0_ADDEND(up3)), a[r]);
#undef Q5_0_ADDEND
        }
    }
#endif
    for (int r = 0; r < 8; ++r) acc[r] = a[r];
}

/* Q5_1 in int32 lanes: q = nibble | (bit j of qh) << 4, the fifth bit moved to bit 4 by one variable shift
 * (of qh << 4 for weights 0-7), then fma(d, q, m) as expand_q5_1. */
static void direct_q5_1_1x8(const uint8_t *w, int64_t row_bytes, int64_t n, int nr, const float *x, int64_t k,
                            const ahead_window *ahead, vec acc[8]) {
    const uint8_t *rows[8];
    for (int r = 0; r < 8; ++r) rows[r] = w + (n + (r < nr ? r : 0)) * row_bytes;
    vec a[8];
    for (int r = 0; r < 8; ++r) a[r] = vzero();
#if VW == 16
    const __m512i low = _mm512_set1_epi32(15), fifth = _mm512_set1_epi32(16);
    for (int64_t b = 0; b < k / 32; ++b) {
        ask_step(ahead, b);
        const int64_t off = b * 24;
        const vec x0 = vload(x + 32 * b), x1 = vload(x + 32 * b + 16);
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) {
            const uint8_t *block = rows[r] + off;
            vec d, m;
            q4_1_scales(block, &d, &m);
            uint32_t bits;
            memcpy(&bits, block + 4, 4);
            const __m512i q = widen16(block + 8);
            const __m512i nib0 = _mm512_and_si512(q, low), nib1 = _mm512_srli_epi32(q, 4);
            const __m512i v0 = _mm512_mask_or_epi32(nib0, (__mmask16)bits, nib0, fifth);
            const __m512i v1 = _mm512_mask_or_epi32(nib1, (__mmask16)(bits >> 16), nib1, fifth);
            a[r] = vfma(x0, vfma(d, _mm512_cvtepi32_ps(v0), m), a[r]);
            a[r] = vfma(x1, vfma(d, _mm512_cvtepi32_ps(v1), m), a[r]);
        }
    }
#else
    const __m256i low = _mm256_set1_epi32(15), fifth = _mm256_set1_epi32(16);
    const __m256i down0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i down1 = _mm256_add_epi32(down0, _mm256_set1_epi32(4));
    const __m256i down2 = _mm256_add_epi32(down1, _mm256_set1_epi32(8));
    const __m256i down3 = _mm256_add_epi32(down2, _mm256_set1_epi32(8));
    for (int64_t b = 0; b < k / 32; ++b) {
        ask_step(ahead, b);
        const int64_t off = b * 24;
        const float *xb = x + 32 * b;
        const vec x0 = vload(xb), x1 = vload(xb + 8), x2 = vload(xb + 16), x3 = vload(xb + 24);
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) {
            const uint8_t *block = rows[r] + off;
            vec d, m;
            q4_1_scales(block, &d, &m);
            int32_t bits;
            memcpy(&bits, block + 4, 4);
            const __m256i qh = _mm256_set1_epi32(bits), qh4 = _mm256_slli_epi32(qh, 4);
            const __m256i q0 = widen8(block + 8), q1 = widen8(block + 16);
#define Q5_1_FIFTH(h, down) _mm256_and_si256(_mm256_srlv_epi32(h, down), fifth)
            const __m256i v0 = _mm256_or_si256(_mm256_and_si256(q0, low), Q5_1_FIFTH(qh4, down0));
            const __m256i v1 = _mm256_or_si256(_mm256_and_si256(q1, low), Q5_1_FIFTH(qh, down1));
            const __m256i v2 = _mm256_or_si256(_mm256_srli_epi32(q0, 4), Q5_1_FIFTH(qh, down2));
            const __m256i v3 = _mm256_or_si256(_mm256_srli_epi32(q1, 4), Q5_1_FIFTH(qh, down3));
#undef Q5_1_FIFTH
            a[r] = vfma(x0, vfma(d, _mm256_cvtepi32_ps(v0), m), a[r]);
            a[r] = vfma(x1, vfma(d, _mm256_cvtepi32_ps(v1), m), a[r]);
            a[r] = vfma(x2, vfma(d, _mm256_cvtepi32_ps(v2), m), a[r]);
            a[r] = vfma(x3, vfma(d, _mm256_cvtepi32_ps(v3), m), a[r]);
        }
    }
#endif
    for (int r = 0; r < 8; ++r) acc[r] = a[r];
}

/* Q4_K / Q5_K: a super-block's 8 sub-block scales d * sc and negated mins -(dmin * mn) (each exact, as the
 * expanders form them) into sc[8] and mn[8]. The 12 bytes s hold the 6-bit fields as three 32-bit words:
 * scales 0-3 and mins 0-3 are the low six bits of words 0 and 1, scales 4-7 and mins 4-7 the nibbles of word
 * 2 with bits 6-7 of words 0 and 1 above them. */
static inline void k_scales(const uint8_t *block, float *sc, float *mn) {
    uint32_t s0, s1, s2;
    memcpy(&s0, block + 4, 4), memcpy(&s1, block + 8, 4), memcpy(&s2, block + 12, 4);
    const uint32_t six = 0x3f3f3f3fu, nib = 0x0f0f0f0fu, top = 0x30303030u;
    const uint64_t scales = (uint64_t)(s0 & six) | (uint64_t)((s2 & nib) | ((s0 >> 2) & top)) << 32;
    const uint64_t mins = (uint64_t)(s1 & six) | (uint64_t)(((s2 >> 4) & nib) | ((s1 >> 2) & top)) << 32;
    const __m256 d = f16_bcast8(block), ndmin = _mm256_xor_ps(f16_bcast8(block + 2), _mm256_set1_ps(-0.f));
    const __m256i sq = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)scales));
    const __m256i mq = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mins));
    _mm256_store_ps(sc, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sq)));
    _mm256_store_ps(mn, _mm256_mul_ps(ndmin, _mm256_cvtepi32_ps(mq)));
}

/* Q4_K in int32 lanes: each 8 bytes widened once serve two sub-blocks (low nibbles, then high); every weight
 * is fma(scale, q, -min) as expand_q4_k computes it. */
static void direct_q4_k_1x8(const uint8_t *w, int64_t row_bytes, int64_t n, int nr, const float *x, int64_t k,
                            const ahead_window *ahead, vec acc[8]) {
    const uint8_t *rows[8];
    for (int r = 0; r < 8; ++r) rows[r] = w + (n + (r < nr ? r : 0)) * row_bytes;
    vec a[8];
    for (int r = 0; r < 8; ++r) a[r] = vzero();
#if VW == 16
    const __m512i low = _mm512_set1_epi32(15);
#else
    const __m256i low = _mm256_set1_epi32(15);
#endif
    float sc[8][8] __attribute__((aligned(32))), mn[8][8] __attribute__((aligned(32)));
    for (int64_t b = 0; b < k / 256; ++b) {
        const int64_t off = b * 144;
        for (int r = 0; r < 8; ++r) k_scales(rows[r] + off, sc[r], mn[r]);
        for (int i = 0; i < 4; ++i) {
            ask_step(ahead, 4 * b + i);
            const float *xb = x + 256 * b + 64 * i;
#pragma GCC unroll 8
            for (int r = 0; r < 8; ++r) {
                const uint8_t *q = rows[r] + off + 16 + 32 * i;
#if VW == 16
                const __m512i q0 = widen16(q), q1 = widen16(q + 16);
                vec s = vset1(sc[r][2 * i]), o = vset1(mn[r][2 * i]);
                a[r] = vfma(vload(xb), vfma(s, _mm512_cvtepi32_ps(_mm512_and_si512(q0, low)), o), a[r]);
                a[r] = vfma(vload(xb + 16), vfma(s, _mm512_cvtepi32_ps(_mm512_and_si512(q1, low)), o), a[r]);
                s = vset1(sc[r][2 * i + 1]), o = vset1(mn[r][2 * i + 1]);
                a[r] = vfma(vload(xb + 32), vfma(s, _mm512_cvtepi32_ps(_mm512_srli_epi32(q0, 4)), o), a[r]);
                a[r] = vfma(vload(xb + 48), vfma(s, _mm512_cvtepi32_ps(_mm512_srli_epi32(q1, 4)), o), a[r]);
#else
                const __m256i q0 = widen8(q), q1 = widen8(q + 8), q2 = widen8(q + 16), q3 = widen8(q + 24);
                vec s = vset1(sc[r][2 * i]), o = vset1(mn[r][2 * i]);
                a[r] = vfma(vload(xb), vfma(s, _mm256_cvtepi32_ps(_mm256_and_si256(q0, low)), o), a[r]);
                a[r] = vfma(vload(xb + 8), vfma(s, _mm256_cvtepi32_ps(_mm256_and_si256(q1, low)), o), a[r]);
                a[r] = vfma(vload(xb + 16), vfma(s, _mm256_cvtepi32_ps(_mm256_and_si256(q2, low)), o), a[r]);
                a[r] = vfma(vload(xb + 24), vfma(s, _mm256_cvtepi32_ps(_mm256_and_si256(q3, low)), o), a[r]);
                s = vset1(sc[r][2 * i + 1]), o = vset1(mn[r][2 * i + 1]);
                a[r] = vfma(vload(xb + 32), vfma(s, _mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), o), a[r]);
                a[r] = vfma(vload(xb + 40), vfma(s, _mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), o), a[r]);
                a[r] = vfma(vload(xb + 48), vfma(s, _mm256_cvtepi32_ps(_mm256_srli_epi32(q2, 4)), o), a[r]);
                a[r] = vfma(vload(xb + 56), vfma(s, _mm256_cvtepi32_ps(_mm256_srli_epi32(q3, 4)), o), a[r]);
#endif
            }
        }
    }
    for (int r = 0; r < 8; ++r) acc[r] = a[r];
}

/* 16 weights from 16 unsigned bytes, fma(scale, q, offset) as bytes16_u computes them, into one chain (x at
 * xb). */
static inline __attribute__((always_inline)) vec fma16_u(__m128i q, vec scale, vec offset, const float *xb, vec a) {
#if VW == 16
    return vfma(vload(xb), vfma(scale, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), offset), a);
#else
    a = vfma(vload(xb), vfma(scale, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), offset), a);
    const __m256i upper = _mm256_cvtepu8_epi32(_mm_srli_si128(q, 8));
    return vfma(vload(xb + 8), vfma(scale, _mm256_cvtepi32_ps(upper), offset), a);
#endif
}

/* 16 weights from 16 signed bytes, scale * q as bytes16_i computes them, into one chain (x at xb). */
static inline __attribute__((always_inline)) vec mul16_i(__m128i q, vec scale, const float *xb, vec a) {
#if VW == 16
    return vfma(vload(xb), _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))), a);
#else
    const vec w0 = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    const vec w1 = _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))));
    return vfma(vload(xb + 8), w1, vfma(vload(xb), w0, a));
#endif
}

/* Q5_K, 16 bytes at a time as expand_q5_k forms them (nibbles, bit j of qh moved to bit 4 by a constant
 * shift), widened from the register. */
static void direct_q5_k_1x8(const uint8_t *w, int64_t row_bytes, int64_t n, int nr, const float *x, int64_t k,
                            const ahead_window *ahead, vec acc[8]) {
    const uint8_t *rows[8];
    for (int r = 0; r < 8; ++r) rows[r] = w + (n + (r < nr ? r : 0)) * row_bytes;
    vec a[8];
    for (int r = 0; r < 8; ++r) a[r] = vzero();
    const __m128i mask = _mm_set1_epi8(15), fifth = _mm_set1_epi8(0x10);
    float sc[8][8] __attribute__((aligned(32))), mn[8][8] __attribute__((aligned(32)));
    for (int64_t b = 0; b < k / 256; ++b) {
        const int64_t off = b * 176;
        for (int r = 0; r < 8; ++r) k_scales(rows[r] + off, sc[r], mn[r]);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
            ask_step(ahead, 8 * b + j);
            const float *xb = x + 256 * b + 32 * j;
#pragma GCC unroll 8
            for (int r = 0; r < 8; ++r) {
                const uint8_t *qh = rows[r] + off + 16, *q4 = rows[r] + off + 48 + 32 * (j / 2);
                const vec s = vset1(sc[r][j]), o = vset1(mn[r][j]);
                for (int l = 0; l < 32; l += 16) {
                    const __m128i q = _mm_loadu_si128((const __m128i *)(q4 + l));
                    const __m128i h = _mm_loadu_si128((const __m128i *)(qh + l));
                    const __m128i nib = _mm_and_si128(j & 1 ? _mm_srli_epi16(q, 4) : q, mask);
                    const __m128i bit4 = j < 4 ? _mm_slli_epi16(h, 4 - j) : _mm_srli_epi16(h, j - 4);
                    const __m128i high = _mm_and_si128(bit4, fifth);
                    a[r] = fma16_u(_mm_or_si128(nib, high), s, o, xb + l, a[r]);
                }
            }
        }
    }
    for (int r = 0; r < 8; ++r) acc[r] = a[r];
}

/* Q6_K in registers: each 16 weights formed from their low nibbles and two high bits exactly as expand_q6_k
 * forms them (minus 32, times the exact d * scale), widened from the register and fed to the chains in
 * weight order. A super-block's 16 scales of the eight rows are formed first, as the expander forms them. */
static void direct_q6_k_1x8(const uint8_t *w, int64_t row_bytes, int64_t n, int nr, const float *x, int64_t k,
                            const ahead_window *ahead, vec acc[8]) {
    const uint8_t *rows[8];
    for (int r = 0; r < 8; ++r) rows[r] = w + (n + (r < nr ? r : 0)) * row_bytes;
    vec a[8];
    for (int r = 0; r < 8; ++r) a[r] = vzero();
    float scale[8][16] __attribute__((aligned(32)));
    for (int64_t b = 0; b < k / 256; ++b) {
        const int64_t off = b * 210;
        for (int r = 0; r < 8; ++r) q6_k_scales(rows[r] + off, scale[r]);
        for (int half = 0; half < 2; ++half) {
            ask_step(ahead, 2 * b + half);
            const float *xb = x + 256 * b + 128 * half;
#pragma GCC unroll 8
            for (int r = 0; r < 8; ++r) {
                const uint8_t *ql = rows[r] + off + 64 * half, *qh = rows[r] + off + 128 + 32 * half;
#define Q6_LOAD(p) _mm_loadu_si128((const __m128i *)(p))
                const __m128i a0 = Q6_LOAD(ql), a1 = Q6_LOAD(ql + 16), c0 = Q6_LOAD(ql + 32), c1 = Q6_LOAD(ql + 48);
                const __m128i h0 = Q6_LOAD(qh), h1 = Q6_LOAD(qh + 16);
#undef Q6_LOAD
                /* weights 16 i .. 16 i + 15 of the half: expand_q6_k's q1 (l = 0, 16), q2, q3, q4 */
                const __m128i q[8] = {
                    q6_k_quarter(a0, h0, 0), q6_k_quarter(a1, h1, 0), q6_k_quarter(c0, h0, 1),
                    q6_k_quarter(c1, h1, 1), q6_k_quarter(a0, h0, 2), q6_k_quarter(a1, h1, 2),
                    q6_k_quarter(c0, h0, 3), q6_k_quarter(c1, h1, 3),
                };
                const float *s = scale[r] + 8 * half;
                for (int i = 0; i < 8; ++i) a[r] = mul16_i(q[i], vset1(s[i]), xb + 16 * i, a[r]);
            }
        }
    }
    for (int r = 0; r < 8; ++r) acc[r] = a[r];
}

/* One x row against four Q8_0 rows in registers: each VW weights are widened straight from memory
 * (sign-extended to 32-bit lanes, converted, times the block's d: expand_q8_0's exact product) and fed to
 * the tile's four chains (tile_3x4 at one row) in the same order, so y's bits are the whole-row path's.
 * Saves the expander's stores and the tile's reloads. Rows past nr point at row n (read, never stored).
 * Taken where q8_0_direct says. The four rows are read interleaved, 612-680 bytes apart. Asked for as a
 * burst before each group, the rows needed two bursts to beat the whole-row path from DRAM (4 KB ahead into
 * L1 and 16 KB ahead into L2: 0.75-0.9x its time on a 178 MB head, docs/performance.md, "The head at batch
 * 1"); spread over the blocks (ahead_window), 4 KB ahead alone took 0.75-0.85x the time of those two bursts
 * (49152 x 576, 1 thread). */

/* VW weights of a Q8_0 block from byte j of its quants: d * q as expand_q8_0 computes them. */
static inline vec q8_0_lanes(const uint8_t *q, vec d) {
#if VW == 16
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))));
#else
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q))));
#endif
}

static void direct_q8_0_1x4(const uint8_t *w, int64_t row_bytes, int64_t n, int nr, const float *x, int64_t k,
                            const ahead_window *ahead, const float *bias, float *y) {
    const uint8_t *r0 = w + n * row_bytes, *r1 = nr > 1 ? r0 + row_bytes : r0;
    const uint8_t *r2 = nr > 2 ? r0 + 2 * row_bytes : r0, *r3 = nr > 3 ? r0 + 3 * row_bytes : r0;
    vec a0 = vzero(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t b = 0; b < k / 32; ++b) {
        ask_step(ahead, b);
        const int64_t off = b * 34;
        const vec d0 = vset1(f16_at(r0 + off)), d1 = vset1(f16_at(r1 + off));
        const vec d2 = vset1(f16_at(r2 + off)), d3 = vset1(f16_at(r3 + off));
        for (int j = 0; j < 32; j += VW) {
            const vec v = vload(x + 32 * b + j);
            const int64_t q = off + 2 + j;
            a0 = vfma(v, q8_0_lanes(r0 + q, d0), a0);
            a1 = vfma(v, q8_0_lanes(r1 + q, d1), a1);
            a2 = vfma(v, q8_0_lanes(r2 + q, d2), a2);
            a3 = vfma(v, q8_0_lanes(r3 + q, d3), a3);
        }
    }
    const vec acc[4] = {a0, a1, a2, a3};
    for (int c = 0; c < nr; ++c) y[n + c] = add_bias(vsum(acc[c]), bias, n + c);
}

/* The register path of qtype at one row, or NULL where the chunk buffer is the faster one. */
typedef void (*direct_1x8_fn)(const uint8_t *, int64_t, int64_t, int, const float *, int64_t,
                              const ahead_window *, vec *);
static direct_1x8_fn direct_1x8(int qtype) {
    switch (qtype) {
    case QT_Q4_0: return direct_q4_0_1x8;
    case QT_Q4_1: return direct_q4_1_1x8;
    case QT_Q5_0: return direct_q5_0_1x8;
    case QT_Q5_1: return direct_q5_1_1x8;
    case QT_Q4_K: return direct_q4_k_1x8;
    case QT_Q5_K: return direct_q5_k_1x8;
    case QT_Q6_K: return direct_q6_k_1x8;
    default: return NULL;
    }
}

/* Output rows n .. n + nr - 1 (nr <= group) of every x row (m_rows <= 3; group 8 for one row, else 4). */
static void group_by_chunks(int qtype, const uint8_t *w, int64_t row_bytes, int64_t elems, int64_t bytes,
                            const float *x, int64_t m_rows, int64_t k, int64_t n, int nr, const float *bias,
                            float *y, int64_t n_out, float *buf, const ahead_window *ahead) {
    vec acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = vzero();
    const direct_1x8_fn direct = m_rows == 1 ? direct_1x8(qtype) : NULL;
    if (direct != NULL) {
        direct(w, row_bytes, n, nr, x, k, ahead, acc);
        for (int c = 0; c < nr; ++c) y[n + c] = add_bias(vsum(acc[c]), bias, n + c);
        return;
    }
    for (int64_t c0 = 0; c0 < k; c0 += CHUNK) {
        ask_step(ahead, c0 / CHUNK);
        const int64_t len = k - c0 < CHUNK ? k - c0 : CHUNK;
        for (int r = 0; r < nr; ++r)
            expand_row(qtype, w + (n + r) * row_bytes + c0 / elems * bytes, len, buf + r * CHUNK);
        if (m_rows == 1)
            chunk_1x8(x + c0, buf, len, acc);
        else if (m_rows == 2)
            chunk_3x4(x + c0, k, buf, len, acc, 2);
        else
            chunk_3x4(x + c0, k, buf, len, acc, 3);
    }
    const int width = m_rows == 1 ? 8 : 4;
    for (int r = 0; r < (int)m_rows; ++r)
        for (int c = 0; c < nr; ++c) y[r * n_out + n + c] = add_bias(vsum(acc[r * width + c]), bias, n + c);
}
#endif

/* How quant_gemm_f32 and quant_gemm_rows_f32 compute output rows: one plan and one group routine for both
 * entries, so a path added to one is in the other, and every output takes the same path (the same bits)
 * whichever entry computes it. */
typedef struct {
    int qtype;
    int64_t elems, bytes; /* of one block (block_elems) */
    int by_chunks;        /* the chunk buffer (the 1-row register paths among it) */
    int q8_direct;        /* direct_q8_0_1x4 */
    int register_path;    /* a one-row register path: direct_q8_0_1x4 or direct_1x8's kernel */
    int group;            /* output rows per group: 8 on the 1-row chunked paths, 4 on the others, else
                           * WHOLE_ROW_GROUP */
    int64_t ahead;        /* prefetch distance in rows (prefetch_rows) */
    int64_t steps;        /* loop steps of a group that ask for the rows ahead (ahead_window); 0: one burst */
} gemm_plan;

/* How many steps a group's loop takes, for ahead_window: the blocks of the one-row register paths (Q4_K: its
 * 64-weight pairs of sub-blocks), the chunks of the chunk buffer; 0 on the whole-row path (one burst). */
static int64_t group_steps(const gemm_plan *p, int64_t k) {
    if (p->q8_direct) return k / 32;
#ifdef VW
    if (p->register_path)
        return p->qtype == QT_Q4_K ? k / 64 : p->qtype == QT_Q6_K ? k / 128 : k / 32;
    if (p->by_chunks) return (k + CHUNK - 1) / CHUNK;
#endif
    (void)k;
    return 0;
}

/* 0 for an unknown qtype. */
static int plan_gemm(int qtype, const uint8_t *w, int64_t m_rows, int64_t row_bytes, int64_t k, gemm_plan *p) {
    p->qtype = qtype;
    p->elems = block_elems(qtype, &p->bytes);
    if (p->elems == 0 || expand_row(qtype, w, 0, NULL) != 0) return 0;
    p->by_chunks = 0;
#ifdef VW
    p->by_chunks = m_rows <= 3 && k % VW == 0 && CHUNK % p->elems == 0 && qtype != QT_Q8_0; /* see direct_q4_0_1x8 */
#endif
    p->q8_direct = q8_0_direct(qtype, m_rows, k);
    p->group = p->by_chunks && m_rows == 1 ? 8 : p->by_chunks || p->q8_direct ? 4 : WHOLE_ROW_GROUP;
    p->register_path = p->q8_direct;
#ifdef VW
    p->register_path = p->register_path || (p->by_chunks && m_rows == 1 && direct_1x8(qtype) != NULL);
#endif
    p->ahead = prefetch_rows(p->register_path, p->group, row_bytes);
    p->steps = group_steps(p, k);
    return 1;
}

/* Output rows n .. n + nr - 1 (nr <= p->group) of every x row, written at y[r * y_stride + n]; the prefetch
 * ahead stops at row n_end. buf as quant_gemm_rows_f32's. */
static inline void gemm_group(const gemm_plan *p, const float *x, int64_t m_rows, const uint8_t *w,
                              int64_t row_bytes, int64_t k, int64_t n, int nr, int64_t n_end, const float *bias,
                              float *y, int64_t y_stride, float *buf) {
    if (p->steps == 0) prefetch_ahead(w, row_bytes, n, n_end, p->group, p->ahead);
#ifdef VW
    const ahead_window ahead = window_ahead(w, row_bytes, n, n_end, p->group, p->ahead, p->steps);
#endif
#ifdef VW
    if (p->q8_direct) {
        direct_q8_0_1x4(w, row_bytes, n, nr, x, k, &ahead, bias, y);
        return;
    }
#endif
#ifdef VW
    if (p->by_chunks) {
        group_by_chunks(p->qtype, w, row_bytes, p->elems, p->bytes, x, m_rows, k, n, nr, bias, y, y_stride, buf,
                        &ahead);
        return;
    }
#endif
    for (int r = 0; r < nr; ++r) expand_row(p->qtype, w + (n + r) * row_bytes, k, buf + r * k);
    rows_times_x(x, m_rows, buf, nr, k, bias, y, y_stride, n);
}

/* y = x @ dequant(w).T (+ bias). Returns 0, -1 for an unknown qtype, -2 if a thread's buffer could not be
 * allocated (y is then incomplete). A qtype with QT_Q8_ACTIVATIONS set runs quant_gemm_q8 instead. */
int quant_gemm_f32(const float *x, int64_t m_rows, const uint8_t *w, int64_t row_bytes, int qtype, int64_t k,
                   int64_t n_out, const float *bias, float *y, int num_threads) {
    if (qtype & QT_Q8_ACTIVATIONS)
        return quant_gemm_q8(x, m_rows, w, row_bytes, qtype & ~QT_Q8_ACTIVATIONS, k, n_out, bias, y, num_threads);
    gemm_plan plan;
    if (!plan_gemm(qtype, w, m_rows, row_bytes, k, &plan)) return -1;
    const int group = plan.group;
    const int64_t groups = (n_out + group - 1) / group;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const size_t floats = plan.by_chunks ? (size_t)GROUP_MAX * CHUNK : (size_t)(WHOLE_ROW_GROUP * k);
        float *buf = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        if (buf == NULL) failed = 1;
        else memset(buf, 0, floats * sizeof(float)); /* rows past a short group's end are read, never stored */
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; ++g) {
            if (buf == NULL) continue;
            const int64_t n = group * g;
            const int nr = n_out - n >= group ? group : (int)(n_out - n);
            gemm_group(&plan, x, m_rows, w, row_bytes, k, n, nr, n_out, bias, y, n_out, buf);
        }
        free(buf);
    }
    return failed ? -2 : 0;
}

/* The floats of the buffer one thread of quant_gemm_rows_f32 needs for m_rows rows of in size k. */
int64_t quant_gemm_buffer_floats(int64_t m_rows, int64_t k) {
    const int64_t whole_rows = WHOLE_ROW_GROUP * k; /* also at 1-3 rows where the chunks do not apply */
    return m_rows <= 3 && GROUP_MAX * CHUNK > whole_rows ? GROUP_MAX * CHUNK : whole_rows;
}

/* Outputs n_begin .. n_end - 1 of quant_gemm_f32 on the calling thread alone, written at y[r * y_stride + n]
 * (bias indexed by n too): a slice of the columns for a caller that splits one GEMM over its own threads
 * (decoder_layers.c). Each output is computed exactly as quant_gemm_f32 computes it (its chain depends on k
 * only, not on where a group starts), so any split gives quant_gemm_f32's bits. buf holds
 * quant_gemm_buffer_floats(m_rows, k) floats, zeroed once (rows past a short group are read, never stored).
 * Returns 0, -1 for an unknown qtype. */
int quant_gemm_rows_f32(const float *x, int64_t m_rows, const uint8_t *w, int64_t row_bytes, int qtype, int64_t k,
                        int64_t n_begin, int64_t n_end, const float *bias, float *y, int64_t y_stride, float *buf) {
    gemm_plan plan;
    if (!plan_gemm(qtype, w, m_rows, row_bytes, k, &plan)) return -1;
    for (int64_t n = n_begin; n < n_end; n += plan.group) {
        const int nr = n_end - n >= plan.group ? plan.group : (int)(n_end - n);
        gemm_group(&plan, x, m_rows, w, row_bytes, k, n, nr, n_end, bias, y, y_stride, buf);
    }
    return 0;
}

/* out[i, :] = dequant(w[rows[i], :]) for i < n_rows (rows NULL: rows 0 .. n_rows - 1). Returns 0, -1 for an
 * unknown qtype. The caller has checked the row indices. */
int quant_dequantize_rows(const uint8_t *w, int64_t row_bytes, int qtype, int64_t k, const int64_t *rows,
                          int64_t n_rows, float *out, int num_threads) {
    if (expand_row(qtype, w, 0, NULL) != 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n_rows * k >= 65536)
    for (int64_t i = 0; i < n_rows; ++i) expand_row(qtype, w + (rows ? rows[i] : i) * row_bytes, k, out + i * k);
    return 0;
}
