/*
 * The K-quants (Q4_K, Q5_K, Q6_K) on the opt-in approximate path (activations="q8"), against 256-element
 * 8-bit activation blocks, as llama.cpp pairs them (its block_q8_K).
 *
 * Why: a Q4_K_M or Q5_K_M file keeps its down projections (and, where rows are a multiple of 256, more) in
 * K-quants. Left exact, they were the part of a q8 step that still expanded every weight to fp32. Here each
 * 32-weight slice is one maddubs against the activation bytes and one madd with its scale, as llama.cpp
 * computes, so those GEMMs run at about the integer rate of the 32-block formats (quant_q8.c).
 *
 * Arithmetic (the tests rebuild it in numpy and compare bit for bit):
 *   x row, per block of 256 (llama.cpp's quantize_row_q8_K_ref): max = the x_j of largest |x_j| (the first
 *     such); if it is 0, d = 0 and every q_j = 0; else iscale = -127 / max, q_j = min(127, rint(iscale * x_j))
 *     (rint: half to even) and d = 1 / iscale. Sums of the q_j: b16 per 16 values, b32 per 32.
 *   per output and superblock s, with u_j the weight's unsigned quants (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63)
 *     and c_j the integer scale of the sub-block j lies in (6-bit per 32 for Q4_K / Q5_K, int8 per 16 for
 *     Q6_K): eight int32 lanes P_i = sum over the block's 8 slices v of sum_{j = 4i .. 4i + 3}
 *     c_{32v + j} * u_{32v + j} * q_{32v + j} (the lanes of madd(maddubs(u, q), c)). Q6_K's offset of 32 is
 *     taken out in integers: P_i -= 32 * (c_{2i} * b16_{2i} + c_{2i + 1} * b16_{2i + 1}) (its sixteen scales
 *     and 16-sums). Then, in fp32: L_i = L_i + (float)P_i * (dw * d), lanes from 0.
 *     Q4_K / Q5_K also have mins m_t (6-bit per 32): four int32 lanes C_i = m_{2i} * b32_{2i} + m_{2i + 1} *
 *     b32_{2i + 1}, and M_i = M_i + (float)C_i * (dminw * d).
 *   y = hsum(L) - hsum(M) (Q6_K: hsum(L)), hsum adding lanes i and i + 4 (L only), then i and i + 2, then
 *     the two left; + bias.
 *   Every float operation is a separate IEEE fp32 operation (no contraction), the integers are exact
 *   (|P_i| < 2^26), so the AVX2, VNNI and portable builds agree bit for bit. llama.cpp's float order
 *   differs (its lanes, its mins per block), so greedy tokens can still part from its own near ties.
 *
 * Invariance: an output depends on its own weight row and x row only, in an order fixed by k: the same bits
 * alone or in any batch, on any thread count, in any column slice.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma clang fp contract(off)
#endif

#include <stdint.h>
#include <string.h>

#include "half.h"
#include "prefetch.h"

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>

#include "hsum.h"
#define Q8K_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define Q8K_AVX512 1 /* two slices per 512-bit maddubs on the x-row side (block_rows_avx2) */
#endif
#endif

enum { Q8K_Q4_K = 12, Q8K_Q5_K = 13, Q8K_Q6_K = 14 };
#define QK 256
#define Q8K_PASS_ROWS 64    /* x rows per pass over a weight row (their accumulators on the stack) */
#define Q8K_PREFETCH_ROWS 32 /* weight rows ahead asked for while a group computes */

/* Block bytes of a K-quant with a q8 kernel; 0 for any other format. */
int64_t q8k_block_bytes(int qtype) {
    switch (qtype) {
    case Q8K_Q4_K: return 144;
    case Q8K_Q5_K: return 176;
    case Q8K_Q6_K: return 210;
    default: return 0;
    }
}

/* The section of the quantised buffer that holds m_rows x rows of k as 256-blocks: d [m, k / 256], the
 * 16-sums b16 [m, k / 16], the 32-sums b32 [m, k / 32], the bytes q [m, k]. Sized as if k were rounded up to a
 * multiple of 256, so that the size grows with k (a caller sizes one buffer by its widest k). */
typedef struct {
    float *d;
    int16_t *b16, *b32;
    int8_t *q;
} q8k_rows;

static q8k_rows q8k_rows_in(void *section, int64_t m_rows, int64_t k) {
    const int64_t kk = (k + QK - 1) / QK * QK;
    q8k_rows r;
    r.d = section;
    r.b16 = (int16_t *)(r.d + m_rows * (kk / QK));
    r.b32 = r.b16 + m_rows * (kk / 16);
    r.q = (int8_t *)(r.b32 + m_rows * (kk / 32));
    return r;
}

int64_t q8k_section_bytes(int64_t m_rows, int64_t k) {
    const int64_t kk = (k + QK - 1) / QK * QK;
    return m_rows * ((int64_t)sizeof(float) * (kk / QK) + 2 * (kk / 16) + 2 * (kk / 32) + kk);
}

/* rint for |v| < 2^22, as llama.cpp's nearest_int: adding 1.5 * 2^23 leaves the rounded integer in the low
 * mantissa bits (round half to even, the default rounding mode). */
static inline int nearest_int(float v) {
    const float shifted = v + 12582912.f;
    int32_t bits;
    memcpy(&bits, &shifted, 4);
    return (bits & 0x007fffff) - 0x00400000;
}

/* One x row of k (a multiple of 256) as llama.cpp's quantize_row_q8_K_ref writes it (see the top). */
static void quantize_row_k(const float *x, int64_t k, int8_t *q, float *d, int16_t *b16, int16_t *b32) {
    for (int64_t s = 0; s < k / QK; ++s, x += QK, q += QK) {
        float max = 0.f, amax = 0.f;
        for (int j = 0; j < QK; ++j) {
            const float a = x[j] < 0.f ? -x[j] : x[j];
            if (a > amax) amax = a, max = x[j];
        }
        if (amax == 0.f) {
            d[s] = 0.f;
            memset(q, 0, QK);
        } else {
            const float iscale = -127.f / max;
            for (int j = 0; j < QK; ++j) {
                const int v = nearest_int(iscale * x[j]);
                q[j] = (int8_t)(v < 127 ? v : 127);
            }
            d[s] = 1.f / iscale;
        }
        for (int g = 0; g < QK / 16; ++g) {
            int sum = 0;
            for (int j = 0; j < 16; ++j) sum += q[16 * g + j];
            b16[16 * s + g] = (int16_t)sum;
        }
        for (int t = 0; t < QK / 32; ++t) b32[8 * s + t] = (int16_t)(b16[16 * s + 2 * t] + b16[16 * s + 2 * t + 1]);
    }
}

/* x [m_rows, k] (k a multiple of 256) into the section (q8k_section_bytes(m_rows, k) bytes). */
void q8k_quantize(const float *x, int64_t m_rows, int64_t k, void *section) {
    const q8k_rows r = q8k_rows_in(section, m_rows, k);
    for (int64_t m = 0; m < m_rows; ++m)
        quantize_row_k(x + m * k, k, r.q + m * k, r.d + m * (k / QK), r.b16 + m * (k / 16), r.b32 + m * (k / 32));
}

/* A Q4_K / Q5_K block's eight 6-bit scales (bytes 0-7 of u) and eight 6-bit mins (bytes 8-15): llama.cpp's
 * get_scale_min_k4, four words at a time. */
static inline void scales_mins_k4(const uint8_t *packed, uint32_t u[4]) {
    uint32_t w[3];
    memcpy(w, packed, 12);
    const uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
    u[0] = w[0] & m1;
    u[1] = (w[2] & m2) | (((w[0] >> 6) & m3) << 4);
    u[2] = w[1] & m1;
    u[3] = ((w[2] >> 4) & m2) | (((w[1] >> 6) & m3) << 4);
}

/* The fp32 steps after a block's integers, per x row: the L and M lanes, and the final sums. */
static inline float hsum8(const float v[8]) {
    const float a0 = v[0] + v[4], a1 = v[1] + v[5], a2 = v[2] + v[6], a3 = v[3] + v[7];
    return (a0 + a2) + (a1 + a3);
}
static inline float hsum4(const float v[4]) { return (v[0] + v[2]) + (v[1] + v[3]); }

#ifndef Q8K_AVX2
/* A block's 256 unsigned quants in element order, each element's integer scale, and (Q4_K / Q5_K) its
 * eight mins, d and dmin. */
typedef struct {
    uint8_t u[QK];
    int16_t c[QK];
    int16_t mins[8];
    float d, dmin;
} k_block;

static void unpack_portable(const int qtype, const uint8_t *block, k_block *b) {
    if (qtype == Q8K_Q6_K) {
        const uint8_t *ql = block, *qh = block + 128;
        const int8_t *sc = (const int8_t *)(block + 192);
        for (int n = 0; n < 2; ++n)
            for (int l = 0; l < 32; ++l) {
                const uint8_t *lo = ql + 64 * n, h = qh[32 * n + l];
                b->u[128 * n + l] = (uint8_t)((lo[l] & 15) | (h & 3) << 4);
                b->u[128 * n + l + 32] = (uint8_t)((lo[l + 32] & 15) | ((h >> 2) & 3) << 4);
                b->u[128 * n + l + 64] = (uint8_t)((lo[l] >> 4) | ((h >> 4) & 3) << 4);
                b->u[128 * n + l + 96] = (uint8_t)((lo[l + 32] >> 4) | ((h >> 6) & 3) << 4);
            }
        for (int j = 0; j < QK; ++j) b->c[j] = sc[j / 16];
        b->d = f16_at(block + 208), b->dmin = 0.f;
        return;
    }
    uint32_t packed[4];
    scales_mins_k4(block + 4, packed);
    uint8_t scales[8], mins[8];
    memcpy(scales, packed, 8);
    memcpy(mins, packed + 2, 8);
    const int five = qtype == Q8K_Q5_K;
    const uint8_t *qh = block + 16, *qs = block + (five ? 48 : 16);
    for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
            const uint8_t byte = qs[32 * c + l];
            const int high0 = five ? ((qh[l] >> (2 * c)) & 1) << 4 : 0;
            const int high1 = five ? ((qh[l] >> (2 * c + 1)) & 1) << 4 : 0;
            b->u[64 * c + l] = (uint8_t)((byte & 15) | high0);
            b->u[64 * c + 32 + l] = (uint8_t)((byte >> 4) | high1);
        }
    for (int j = 0; j < QK; ++j) b->c[j] = scales[j / 32];
    for (int t = 0; t < 8; ++t) b->mins[t] = mins[t];
    b->d = f16_at(block), b->dmin = f16_at(block + 2);
}

/* One output: weight row wrow (nsb blocks) against x row m of r. */
static float row_dot_portable(const int qtype, const uint8_t *wrow, int64_t bytes, const q8k_rows *r, int64_t m,
                              int64_t k) {
    const int64_t nsb = k / QK;
    float L[8] = {0}, M[4] = {0};
    for (int64_t s = 0; s < nsb; ++s) {
        k_block b;
        unpack_portable(qtype, wrow + s * bytes, &b);
        const int8_t *q = r->q + m * k + QK * s;
        const int16_t *b16 = r->b16 + m * (k / 16) + 16 * s, *b32 = r->b32 + m * (k / 32) + 8 * s;
        int32_t P[8] = {0};
        for (int j = 0; j < QK; ++j) P[(j % 32) / 4] += (int32_t)b.c[j] * b.u[j] * q[j];
        const float dx = r->d[m * nsb + s];
        if (qtype == Q8K_Q6_K) {
            const int8_t *sc = (const int8_t *)(wrow + s * bytes + 192);
            for (int i = 0; i < 8; ++i) P[i] -= 32 * (sc[2 * i] * b16[2 * i] + sc[2 * i + 1] * b16[2 * i + 1]);
        } else {
            const float dm = b.dmin * dx;
            for (int i = 0; i < 4; ++i) {
                const int32_t C = b.mins[2 * i] * b32[2 * i] + b.mins[2 * i + 1] * b32[2 * i + 1];
                M[i] = M[i] + (float)C * dm;
            }
        }
        const float dd = b.d * dx;
        for (int i = 0; i < 8; ++i) L[i] = L[i] + (float)P[i] * dd;
    }
    return qtype == Q8K_Q6_K ? hsum8(L) : hsum8(L) - hsum4(M);
}
#endif

#ifdef Q8K_AVX2
/* A block widened once for every x row: its 256 unsigned quants as eight vectors of 32 in element order,
 * each vector's scales as int16 in maddubs's pair order, and the integer scales of the correction (Q6_K:
 * its sixteen scales; Q4_K / Q5_K: the eight mins in the low half), d and dmin. */
typedef struct {
    __m256i u[8], c[8], corr;
#ifdef Q8K_AVX512
    __m512i u2[4], c2[4]; /* slices 2i and 2i + 1 in one vector each */
#endif
    float d, dmin;
} k_block;

#ifdef Q8K_AVX512
static inline __attribute__((always_inline)) void pair_slices(k_block *b) {
    for (int i = 0; i < 4; ++i) {
        b->u2[i] = _mm512_inserti64x4(_mm512_castsi256_si512(b->u[2 * i]), b->u[2 * i + 1], 1);
        b->c2[i] = _mm512_inserti64x4(_mm512_castsi256_si512(b->c[2 * i]), b->c[2 * i + 1], 1);
    }
}
#endif

static inline __attribute__((always_inline)) void unpack_avx2(const int qtype, const uint8_t *block, k_block *b) {
    const __m256i low4 = _mm256_set1_epi8(15);
    if (qtype == Q8K_Q6_K) {
        const __m256i two = _mm256_set1_epi8(3);
        for (int n = 0; n < 2; ++n) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * n));
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(block + 64 * n));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(block + 64 * n + 32));
            const __m256i h0 = _mm256_slli_epi16(_mm256_and_si256(h, two), 4);
            const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), two), 4);
            const __m256i h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), two), 4);
            const __m256i h3 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), two), 4);
            b->u[4 * n] = _mm256_or_si256(_mm256_and_si256(l0, low4), h0);
            b->u[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(l1, low4), h1);
            b->u[4 * n + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), h2);
            b->u[4 * n + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4), h3);
        }
        const int8_t *sc = (const int8_t *)(block + 192);
        for (int v = 0; v < 8; ++v)
            b->c[v] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * v + 1]), _mm_set1_epi16(sc[2 * v]));
        b->corr = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        b->d = f16_at(block + 208), b->dmin = 0.f;
        return;
    }
    uint32_t packed[4];
    scales_mins_k4(block + 4, packed);
    /* 16 int16: the scales, then the mins; each scale to every int16 of its vector by a shuffle from
     * registers (bytes read back from a store of the words would stall on store forwarding) */
    const __m256i both =
        _mm256_cvtepu8_epi16(_mm_set_epi32((int)packed[3], (int)packed[2], (int)packed[1], (int)packed[0]));
    const __m256i scales = _mm256_permute4x64_epi64(both, 0x44);
    for (int v = 0; v < 8; ++v)
        b->c[v] = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(0x0100 + 0x0202 * v)));
    b->corr = _mm256_castsi128_si256(_mm256_extracti128_si256(both, 1));
    const int five = qtype == Q8K_Q5_K;
    const uint8_t *qs = block + (five ? 48 : 16);
    const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(block + 16)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        if (five) { /* bit 2c (2c + 1) of each qh byte is the fifth bit of the low (high) nibble's value */
            const __m256i one = _mm256_set1_epi8(1);
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
        }
        b->u[2 * c] = lo, b->u[2 * c + 1] = hi;
    }
    b->d = f16_at(block), b->dmin = f16_at(block + 2);
}

/* acc + madd(p, c): one dpwssd where the CPU has VNNI, the same int32. */
static inline __m256i madd_add(__m256i acc, __m256i p, __m256i c) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, p, c);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, p, c);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, c));
#endif
}

#ifdef Q8K_AVX512
static inline __m512i madd_add512(__m512i acc, __m512i p, __m512i c) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, p, c);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p, c));
#endif
}
#endif


/* The eight int32 lanes P of a block against 256 activation bytes q: madd(maddubs(u, q), c) per slice of
 * 32, in two chains (the same sums). */
static inline __attribute__((always_inline)) __m256i slices_256(const k_block *b, const int8_t *q) {
    __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
    for (int v = 0; v < 8; v += 2) {
        even = madd_add(even, _mm256_maddubs_epi16(b->u[v], _mm256_loadu_si256((const __m256i *)(q + 32 * v))),
                        b->c[v]);
        odd = madd_add(odd, _mm256_maddubs_epi16(b->u[v + 1], _mm256_loadu_si256((const __m256i *)(q + 32 * v + 32))),
                       b->c[v + 1]);
    }
    return _mm256_add_epi32(even, odd);
}

#ifdef Q8K_AVX512
/* The same lanes two slices per vector (b's pairs), the halves added at the end. */
static inline __attribute__((always_inline)) __m256i slices_512(const k_block *b, const int8_t *q) {
    __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
    for (int i = 0; i < 4; i += 2) {
        even = madd_add512(even, _mm512_maddubs_epi16(b->u2[i], _mm512_loadu_si512((const void *)(q + 64 * i))),
                           b->c2[i]);
        odd = madd_add512(odd, _mm512_maddubs_epi16(b->u2[i + 1], _mm512_loadu_si512((const void *)(q + 64 * i + 64))),
                          b->c2[i + 1]);
    }
    const __m512i both = _mm512_add_epi32(even, odd);
    return _mm256_add_epi32(_mm512_castsi512_si256(both), _mm512_extracti64x4_epi64(both, 1));
}
#endif

/* One widened block against x rows m0 .. m0 + mr - 1 (block s of each), into their lanes L and M; wide:
 * two slices per 512-bit maddubs (AVX-512 builds; the pairs made once per block pay off from two x rows on,
 * and the integer lanes are the same either way). */
static inline __attribute__((always_inline)) void block_rows_avx2(const int qtype, const int wide, const k_block *b,
                                                                  const q8k_rows *r, int64_t k, int64_t s,
                                                                  int64_t m0, int64_t mr, __m256 *L, __m128 *M) {
    const int64_t nsb = k / QK;
    for (int64_t i = 0; i < mr; ++i) {
        const int64_t m = m0 + i;
        const int8_t *q = r->q + m * k + QK * s;
#ifdef Q8K_AVX512
        __m256i p = wide ? slices_512(b, q) : slices_256(b, q);
#else
        (void)wide;
        __m256i p = slices_256(b, q);
#endif
        const float dx = r->d[m * nsb + s];
        if (qtype == Q8K_Q6_K) {
            const __m256i b16 = _mm256_loadu_si256((const __m256i *)(r->b16 + m * (k / 16) + 16 * s));
            p = _mm256_sub_epi32(p, _mm256_slli_epi32(_mm256_madd_epi16(b->corr, b16), 5));
        } else {
            const __m128i b32 = _mm_loadu_si128((const __m128i *)(r->b32 + m * (k / 32) + 8 * s));
            const __m128i C = _mm_madd_epi16(_mm256_castsi256_si128(b->corr), b32);
            M[i] = _mm_add_ps(M[i], _mm_mul_ps(_mm_cvtepi32_ps(C), _mm_set1_ps(b->dmin * dx)));
        }
        L[i] = _mm256_add_ps(L[i], _mm256_mul_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(b->d * dx)));
    }
}

/* One weight row against x rows m0 .. m0 + mr - 1: outputs into out[i]; each block widened once for all of
 * them, the rows ahead asked for at steps first_step .. (when ahead is not NULL). */
static inline __attribute__((always_inline)) void row_avx2(const int qtype, const int wide, const uint8_t *wrow,
                                                           int64_t bytes, const q8k_rows *r, int64_t k, int64_t m0,
                                                           int64_t mr, const ahead_window *ahead,
                                                           int64_t first_step, float *out) {
    __m256 L[Q8K_PASS_ROWS];
    __m128 M[Q8K_PASS_ROWS];
    for (int64_t i = 0; i < mr; ++i) L[i] = _mm256_setzero_ps(), M[i] = _mm_setzero_ps();
    for (int64_t s = 0; s < k / QK; ++s) {
        if (ahead) ask_step(ahead, first_step + s);
        k_block b;
        unpack_avx2(qtype, wrow + s * bytes, &b);
#ifdef Q8K_AVX512
        if (wide) pair_slices(&b);
#endif
        block_rows_avx2(qtype, wide, &b, r, k, s, m0, mr, L, M);
    }
    for (int64_t i = 0; i < mr; ++i)
        out[i] = qtype == Q8K_Q6_K ? hsum8_ps(L[i]) : hsum8_ps(L[i]) - hsum4_ps(M[i]);
}
#endif

/* Outputs n .. n + nr - 1 (nr <= 8) of every x row from the section (x quantised by q8k_quantize), written at
 * y[m * y_stride + n + j] (+ bias[n + j]); the rows up to n_end are asked for ahead. */
void q8k_group(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n, int nr, int64_t n_end, const void *section,
               int64_t m_rows, int64_t k, const float *bias, float *y, int64_t y_stride) {
    const int64_t bytes = q8k_block_bytes(qtype), nsb = k / QK;
    const q8k_rows r = q8k_rows_in((void *)section, m_rows, k);
#ifdef Q8K_AVX2
    const ahead_window ahead = window_ahead(w, row_bytes, n, n_end, 8, Q8K_PREFETCH_ROWS, nr * nsb);
    for (int64_t m0 = 0; m0 < m_rows; m0 += Q8K_PASS_ROWS) {
        const int64_t mr = m_rows - m0 < Q8K_PASS_ROWS ? m_rows - m0 : Q8K_PASS_ROWS;
        for (int j = 0; j < nr; ++j) {
            float out[Q8K_PASS_ROWS];
            const uint8_t *wrow = w + (n + j) * row_bytes;
            const ahead_window *asked = m0 == 0 ? &ahead : NULL;
#ifdef Q8K_AVX512
            const int wide = mr > 1;
#else
            const int wide = 0; /* no 512-bit side: one body per format */
#endif
            const int q = qtype == Q8K_Q4_K ? 0 : qtype == Q8K_Q5_K ? 1 : 2;
            switch (2 * q + wide) { /* each format and width its own body */
            case 0: row_avx2(Q8K_Q4_K, 0, wrow, bytes, &r, k, m0, mr, asked, j * nsb, out); break;
            case 1: row_avx2(Q8K_Q4_K, 1, wrow, bytes, &r, k, m0, mr, asked, j * nsb, out); break;
            case 2: row_avx2(Q8K_Q5_K, 0, wrow, bytes, &r, k, m0, mr, asked, j * nsb, out); break;
            case 3: row_avx2(Q8K_Q5_K, 1, wrow, bytes, &r, k, m0, mr, asked, j * nsb, out); break;
            case 4: row_avx2(Q8K_Q6_K, 0, wrow, bytes, &r, k, m0, mr, asked, j * nsb, out); break;
            default: row_avx2(Q8K_Q6_K, 1, wrow, bytes, &r, k, m0, mr, asked, j * nsb, out); break;
            }
            for (int64_t i = 0; i < mr; ++i)
                y[(m0 + i) * y_stride + n + j] = bias ? out[i] + bias[n + j] : out[i];
        }
    }
#else
    (void)n_end, (void)nsb;
    for (int64_t m = 0; m < m_rows; ++m)
        for (int j = 0; j < nr; ++j) {
            const float v = row_dot_portable(qtype, w + (n + j) * row_bytes, bytes, &r, m, k);
            y[m * y_stride + n + j] = bias ? v + bias[n + j] : v;
        }
#endif
}
