/*
 * The opt-in approximate path (pg.Model(..., activations="q8")): llama.cpp's arithmetic for 32-blocks.
 *
 * Why: an exact decode expands every weight to fp32 and spends about three floating-point operations per
 * weight (convert, scale, FMA). llama.cpp instead rounds each activation row to 8-bit blocks and multiplies
 * integers: 32 weight bytes by 32 activation bytes in two instructions (AVX2 maddubs + madd; one dpbusd
 * with AVX-512 VNNI or AVX-VNNI), one float scale per block. Faster, but not the fp32 model: the
 * activations are rounded to 8 bits, so the default stays exact and this path is only taken for weights
 * flagged by the caller.
 *
 * Arithmetic (each step as llama.cpp's reference code computes it; the tests rebuild it in numpy and
 * compare bit for bit):
 *   x row, per block of 32: amax = max |x_j|; d = amax / 127; id = d != 0 ? 1 / d : 0;
 *     q_j = roundf(x_j * id) (half away from zero); dx = f16(d); sx = f16((float)sum_j q_j * d)
 *     (quantize_row_q8_0 / q8_1; f16() rounds to nearest even, as the block format stores them).
 *   per output and block b: i_b = sum_j w_j q_j in int32 (w_j the block's integers: Q8_0 q, Q4_0 q - 8,
 *     Q5_0 q - 16; Q4_1 and Q5_1 their unsigned q), then
 *     t_b = (float)i_b * (dw_b * dx_b)  [Q4_1 / Q5_1: t_b = t_b + mw_b * sx_b]
 *     acc = acc + t_b, blocks in order from acc = 0; y = acc (+ bias).
 *   Every float operation is a separate IEEE fp32 operation (contraction into FMA is off in this file),
 *   so the vector build, the portable build and the reference agree exactly. The int32 sums are exact
 *   (|i_b| <= 32 * 128 * 127) and so is their conversion to fp32.
 *
 * Invariance: an output depends on its own x row and the weights only, in an order fixed by k: the same
 * bits alone or in any batch, on any thread count.
 *
 * Formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (llama.cpp pairs the K-quants with 256-element Q8_K activations;
 * those weights stay on the exact path). Layouts as quant_gemm_f32.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma clang fp contract(off)
#endif

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "prefetch.h"

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define Q8_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define Q8_AVX512 1 /* the one-row body at 512 bits (group_avx512), the panels from 8 x rows on */
#ifndef Q8_PANEL_MIN_ROWS
#define Q8_PANEL_MIN_ROWS 8
#endif
#endif
#endif

enum { Q8_Q4_0 = 2, Q8_Q4_1 = 3, Q8_Q5_0 = 6, Q8_Q5_1 = 7, Q8_Q8_0 = 8 };

/* Rows ahead of a group that are asked for while it computes (q8_group). */
#ifndef Q8_PREFETCH_ROWS
#define Q8_PREFETCH_ROWS 32
#endif

/* Block bytes of a format with a q8 kernel; 0 for any other. */
static int64_t q8_block_bytes(int qtype) {
    switch (qtype) {
    case Q8_Q4_0: return 18;
    case Q8_Q4_1: return 20;
    case Q8_Q5_0: return 22;
    case Q8_Q5_1: return 24;
    case Q8_Q8_0: return 34;
    default: return 0;
    }
}

/* roundf for |v| <= 127.5 (the scaled activations): truncate, then step away from zero on a half or more.
 * v - t is exact there. Written out so that the library needs no libm. */
static inline int round_half_away(float v) {
    int t = (int)v;
    const float f = v - (float)t;
    if (f >= 0.5f) ++t;
    else if (f <= -0.5f) --t;
    return t;
}

/* One x row of k values -> k int8 q, k / 32 scales dx, scaled sums sx (see the top) and the blocks' integer
 * sums qsum (sum_j q_j, for the unsigned-byte dot products: the AVX-512 path, Q4_0 / Q5_0 on AVX2). */
static void quantize_row(const float *x, int64_t k, int8_t *q, float *dx, float *sx, int32_t *qsum) {
    for (int64_t b = 0; b < k / 32; ++b, x += 32, q += 32) {
        float amax = 0.f;
        for (int j = 0; j < 32; ++j) {
            const float a = x[j] < 0.f ? -x[j] : x[j];
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        int sum = 0;
        for (int j = 0; j < 32; ++j) {
            q[j] = (int8_t)round_half_away(x[j] * id);
            sum += q[j];
        }
        dx[b] = f16_to_f32(f32_to_f16(d));
        sx[b] = f16_to_f32(f32_to_f16((float)sum * d));
        qsum[b] = sum;
    }
}

#ifndef Q8_AVX2
/* The 32 integers of one weight block (signed formats already offset). */
static void block_ints(int qtype, const uint8_t *block, int *out) {
    if (qtype == Q8_Q8_0) {
        for (int j = 0; j < 32; ++j) out[j] = (int8_t)block[2 + j];
        return;
    }
    const int five = qtype == Q8_Q5_0 || qtype == Q8_Q5_1, affine = qtype == Q8_Q4_1 || qtype == Q8_Q5_1;
    const uint8_t *qs = block + (affine ? 4 : 2) + (five ? 4 : 0);
    uint32_t qh = 0;
    if (five) memcpy(&qh, block + (affine ? 4 : 2), 4);
    const int offset = affine ? 0 : five ? 16 : 8;
    for (int j = 0; j < 16; ++j) {
        out[j] = (int)((qs[j] & 15) | (five ? ((qh >> j) & 1) << 4 : 0)) - offset;
        out[j + 16] = (int)((qs[j] >> 4) | (five ? ((qh >> (j + 16)) & 1) << 4 : 0)) - offset;
    }
}

/* One output of one x row, portably (the vector path does the same per lane). */
static float row_dot_portable(int qtype, const uint8_t *wrow, int64_t bytes, const int8_t *q, const float *dx,
                              const float *sx, int64_t nb) {
    const int affine = qtype == Q8_Q4_1 || qtype == Q8_Q5_1;
    float acc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *block = wrow + b * bytes;
        int w[32], isum = 0;
        block_ints(qtype, block, w);
        for (int j = 0; j < 32; ++j) isum += w[j] * q[32 * b + j];
        const float scale = f16_at(block) * dx[b];
        float t = (float)isum * scale;
        if (affine) {
            const float m = f16_at(block + 2) * sx[b];
            t = t + m;
        }
        acc = acc + t;
    }
    return acc;
}
#endif

#ifdef Q8_AVX2
/* Byte j = 0xFF where bit j of the 32 bits at p is set. */
static inline __m256i bits_to_bytes(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
    const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe); /* every bit but byte j's own */
    return _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1));
}

/* The offset o of a format whose integers are its unsigned q minus o (Q4_0: 8, Q5_0: 16); 0 for the others. */
static inline int offset_of(const int qtype) { return qtype == Q8_Q4_0 ? 8 : qtype == Q8_Q5_0 ? 16 : 0; }

/* A block's 32 quants as bytes, in weight order: Q8_0's signed q, the other formats' unsigned q (before the
 * offset of Q4_0 / Q5_0). */
static inline __m256i block_ubytes(const int qtype, const uint8_t *block) {
    if (qtype == Q8_Q8_0) return _mm256_loadu_si256((const __m256i *)(block + 2));
    const int five = qtype == Q8_Q5_0 || qtype == Q8_Q5_1, affine = qtype == Q8_Q4_1 || qtype == Q8_Q5_1;
    const __m128i qs = _mm_loadu_si128((const __m128i *)(block + (affine ? 4 : 2) + (five ? 4 : 0)));
    const __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), _mm256_set1_epi8(15));
    if (!five) return v;
    return _mm256_or_si256(v, _mm256_and_si256(bits_to_bytes(block + (affine ? 4 : 2)), _mm256_set1_epi8(16)));
}

/* A block's 32 integers as bytes, in weight order: the unsigned q of Q4_1/Q5_1, else the signed values. */
static inline __m256i block_bytes(const int qtype, const uint8_t *block) {
    const __m256i u = block_ubytes(qtype, block);
    return offset_of(qtype) ? _mm256_sub_epi8(u, _mm256_set1_epi8((char)offset_of(qtype))) : u;
}

/* 8 int32 lanes whose sum is sum_j w_j q_j: u unsigned bytes times s signed bytes, four per lane. */
static inline __m256i dot_lanes(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    /* |u * s| <= 128 * 127 per byte, so a pair never saturates the int16 of maddubs */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* 8 int32 lanes whose sum is sum_j u_j q_j, u the block's bytes of block_ubytes: for Q4_0 / Q5_0 that is
 * the block's integer sum plus o * (the x block's sum of q), which the caller takes back out (offset_of):
 * the same int32, without the two sign operations a signed weight byte needs. */
static inline __m256i block_lanes(const int qtype, const uint8_t *block, __m256i q) {
    const __m256i w = block_ubytes(qtype, block);
    if (qtype != Q8_Q8_0) return dot_lanes(w, q);
    return dot_lanes(_mm256_sign_epi8(w, w), _mm256_sign_epi8(q, w)); /* |w| times q with w's sign */
}

/* The row sums of sum_each less o * qsum, o the format's offset (exact: int32). */
static inline __m256i offset_out(const int qtype, __m256i sums, int32_t qsum) {
    if (!offset_of(qtype)) return sums;
    return _mm256_sub_epi32(sums, _mm256_set1_epi32(offset_of(qtype) * qsum));
}

/* Lane r = the sum of v[r]'s eight lanes (exact: int32). */
static inline __m256i sum_each(const __m256i v[8]) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* The block headers of the eight rows as fp32 lanes: *d the f16 at offset of each row and, for an affine
 * format, *m the f16 after it. One 4-byte load per row (every block is longer than 4 bytes), set into
 * lanes from registers: eight 2-byte stores read back as one vector load would stall on store forwarding,
 * once per block, and one 2-byte load per row and f16 costs twice the loads. */
static inline void headers_at(const uint8_t *const rows[8], int64_t offset, int affine, __m256 *d, __m256 *m) {
    uint32_t v[8];
    for (int r = 0; r < 8; ++r) memcpy(&v[r], rows[r] + offset, 4);
    const __m256i words = _mm256_set_epi32((int)v[7], (int)v[6], (int)v[5], (int)v[4], (int)v[3], (int)v[2],
                                           (int)v[1], (int)v[0]);
    const __m256i low = _mm256_and_si256(words, _mm256_set1_epi32(0xffff));
    /* packus: lanes [d0..d3 m0..m3 | d4..d7 m4..m7] (the halves are < 65536: no saturation) */
    const __m256i packed = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(low, affine ? _mm256_srli_epi32(words, 16) : low), 0xd8);
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
    if (affine) *m = _mm256_cvtph_ps(_mm256_extracti128_si256(packed, 1));
}

#ifndef Q8_AVX512
/* Eight weight rows (lane r: row rows[r]) against one quantised x row: the portable arithmetic with the
 * rows in lanes, so each lane's operations are row_dot_portable's, in its order.
 *
 * Two orders of reading the same bytes, same bits. Interleaved (by_rows 0): per block, the eight rows'
 * blocks. By rows (by_rows 1): the integer products of up to Q8_CHUNK blocks row by row first (each row's
 * blocks read in sequence), then reduced and scaled block by block with the headers re-read from L1.
 * Measured from DRAM (1 thread, thread CPU time, AVX2 EPYC at load 9-10): the 49152 x 576 Q8_0 head took
 * 4.6-5.5 ms by rows against 6.9-9.5 interleaved (exact kernel: 5.3-6.6), while a 3072 x 576 Q4_1 layer
 * took 1.13-1.17x as long by rows; so Q8_0 (34-byte blocks) reads by rows and the others interleave. */
#define Q8_CHUNK 32
static inline __attribute__((always_inline)) __m256 rows_dot_avx2(const int qtype, const int by_rows,
                                                                  const uint8_t *const rows[8], int64_t bytes,
                                                                  const int8_t *q, const float *dx,
                                                                  const float *sx, const int32_t *qsum,
                                                                  int64_t nb, const ahead_window *ahead) {
    const int affine = qtype == Q8_Q4_1 || qtype == Q8_Q5_1;
    __m256 acc = _mm256_setzero_ps();
    __m256i lanes[Q8_CHUNK][8];
    const int64_t chunk = by_rows ? Q8_CHUNK : 1;
    for (int64_t b0 = 0; b0 < nb; b0 += chunk) {
        const int64_t cb = nb - b0 < chunk ? nb - b0 : chunk;
        if (by_rows) {
            for (int r = 0; r < 8; ++r) {
                ask_step(ahead, 8 * (b0 / chunk) + r);
                for (int64_t c = 0; c < cb; ++c)
                    lanes[c][r] = block_lanes(qtype, rows[r] + (b0 + c) * bytes,
                                              _mm256_loadu_si256((const __m256i *)(q + 32 * (b0 + c))));
            }
        } else {
            ask_step(ahead, b0);
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(q + 32 * b0));
            for (int r = 0; r < 8; ++r) lanes[0][r] = block_lanes(qtype, rows[r] + b0 * bytes, qv);
        }
        for (int64_t c = 0; c < cb; ++c) {
            const int64_t b = b0 + c;
            __m256 dw, mw = _mm256_setzero_ps();
            headers_at(rows, b * bytes, affine, &dw, &mw);
            const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(dx[b]));
            const __m256i sums = offset_out(qtype, sum_each(lanes[c]), qsum[b]);
            __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(sums), scale);
            if (affine) t = _mm256_add_ps(t, _mm256_mul_ps(mw, _mm256_set1_ps(sx[b])));
            acc = _mm256_add_ps(acc, t);
        }
    }
    return acc;
}

/* The steps of rows_dot_avx2's loop, for its ahead_window: blocks when interleaved, rows of each chunk by
 * rows (Q8_0). */
static inline int64_t steps_of(int qtype, int64_t nb) {
    return qtype == Q8_Q8_0 ? 8 * ((nb + Q8_CHUNK - 1) / Q8_CHUNK) : nb;
}

static void group_avx2(int qtype, const uint8_t *w, int64_t row_bytes, int64_t bytes, int64_t n, int nr,
                       const int8_t *q, const float *dx, const float *sx, const int32_t *qsum, int64_t nb,
                       const ahead_window *ahead, float out[8]) {
    const uint8_t *rows[8];
    for (int r = 0; r < 8; ++r) rows[r] = w + (n + (r < nr ? r : 0)) * row_bytes;
    __m256 acc;
    switch (qtype) {
    case Q8_Q4_0: acc = rows_dot_avx2(Q8_Q4_0, 0, rows, bytes, q, dx, sx, qsum, nb, ahead); break;
    case Q8_Q4_1: acc = rows_dot_avx2(Q8_Q4_1, 0, rows, bytes, q, dx, sx, qsum, nb, ahead); break;
    case Q8_Q5_0: acc = rows_dot_avx2(Q8_Q5_0, 0, rows, bytes, q, dx, sx, qsum, nb, ahead); break;
    case Q8_Q5_1: acc = rows_dot_avx2(Q8_Q5_1, 0, rows, bytes, q, dx, sx, qsum, nb, ahead); break;
    default: acc = rows_dot_avx2(Q8_Q8_0, 1, rows, bytes, q, dx, sx, qsum, nb, ahead); break;
    }
    _mm256_storeu_ps(out, acc);
}
#endif /* the one-row body of AVX2 builds without AVX-512 VNNI */
/* Eight weight rows against several quantised x rows (q, dx, sx: x rows 0 .. m_rows - 1), into acc[m] (lane r:
 * weight row r). Each weight block is widened to bytes (and, for the signed formats, to its magnitudes) and
 * its headers converted once per Q8_MANY_BLOCKS blocks for every x row, where a call of rows_dot_avx2 per x
 * row does it again for each: at 32 rows that repeated work made the q8 path slower than the exact tile.
 * Each output's operations are rows_dot_avx2's, in its order (the blocks in order into one accumulator per
 * x row), so the bits are the same. */
#define Q8_MANY_BLOCKS 8
#define Q8_MANY_ROWS 64 /* x rows per pass of group_many_avx2 (their accumulators on the stack) */
static inline __attribute__((always_inline)) void many_rows_dot_avx2(const int qtype,
                                                                     const uint8_t *const rows[8],
                                                                     int64_t bytes, const int8_t *q,
                                                                     const float *dx, const float *sx,
                                                                     const int32_t *qsum, int64_t m_rows,
                                                                     int64_t k, int64_t nb,
                                                                     const ahead_window *ahead, __m256 *acc) {
    const int affine = qtype == Q8_Q4_1 || qtype == Q8_Q5_1, signed_bytes = qtype == Q8_Q8_0;
    __m256i mag[Q8_MANY_BLOCKS][8], sgn[Q8_MANY_BLOCKS][8];
    __m256 dw[Q8_MANY_BLOCKS], mw[Q8_MANY_BLOCKS];
    for (int64_t m = 0; m < m_rows; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += Q8_MANY_BLOCKS) {
        const int64_t cb = nb - b0 < Q8_MANY_BLOCKS ? nb - b0 : Q8_MANY_BLOCKS;
        for (int64_t c = 0; c < cb; ++c) {
            ask_step(ahead, b0 + c);
            for (int r = 0; r < 8; ++r) {
                const __m256i w = block_ubytes(qtype, rows[r] + (b0 + c) * bytes);
                mag[c][r] = signed_bytes ? _mm256_sign_epi8(w, w) : w, sgn[c][r] = w;
            }
            mw[c] = _mm256_setzero_ps();
            headers_at(rows, (b0 + c) * bytes, affine, &dw[c], &mw[c]);
        }
        for (int64_t m = 0; m < m_rows; ++m) {
            __m256 a = acc[m];
            for (int64_t c = 0; c < cb; ++c) {
                const int64_t b = b0 + c;
                const __m256i qv = _mm256_loadu_si256((const __m256i *)(q + m * k + 32 * b));
                __m256i lanes[8];
                for (int r = 0; r < 8; ++r)
                    lanes[r] = dot_lanes(mag[c][r], signed_bytes ? _mm256_sign_epi8(qv, sgn[c][r]) : qv);
                const __m256 scale = _mm256_mul_ps(dw[c], _mm256_set1_ps(dx[m * nb + b]));
                const __m256i sums = offset_out(qtype, sum_each(lanes), qsum[m * nb + b]);
                __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(sums), scale);
                if (affine) t = _mm256_add_ps(t, _mm256_mul_ps(mw[c], _mm256_set1_ps(sx[m * nb + b])));
                a = _mm256_add_ps(a, t);
            }
            acc[m] = a;
        }
    }
}

/* q8_group's outputs for m_rows > 1 x rows, Q8_MANY_ROWS x rows per pass (the rows ahead asked for along
 * the first pass). */
static void group_many_avx2(int qtype, const uint8_t *w, int64_t row_bytes, int64_t bytes, int64_t n, int nr,
                            int64_t n_end, const int8_t *q, const float *dx, const float *sx,
                            const int32_t *qsum, int64_t m_rows, int64_t k, const float *bias, float *y,
                            int64_t y_stride) {
    const uint8_t *rows[8];
    for (int r = 0; r < 8; ++r) rows[r] = w + (n + (r < nr ? r : 0)) * row_bytes;
    const int64_t nb = k / 32;
    const ahead_window ahead = window_ahead(w, row_bytes, n, n_end, 8, Q8_PREFETCH_ROWS, nb);
    const ahead_window none = {NULL, 0, 0};
    for (int64_t m0 = 0; m0 < m_rows; m0 += Q8_MANY_ROWS) {
        const int64_t mr = m_rows - m0 < Q8_MANY_ROWS ? m_rows - m0 : Q8_MANY_ROWS;
        const int8_t *qm = q + m0 * k;
        const float *dxm = dx + m0 * nb, *sxm = sx + m0 * nb;
        const int32_t *qsm = qsum + m0 * nb;
        const ahead_window *asked = m0 == 0 ? &ahead : &none;
        __m256 acc[Q8_MANY_ROWS];
        switch (qtype) {
        case Q8_Q4_0: many_rows_dot_avx2(Q8_Q4_0, rows, bytes, qm, dxm, sxm, qsm, mr, k, nb, asked, acc); break;
        case Q8_Q4_1: many_rows_dot_avx2(Q8_Q4_1, rows, bytes, qm, dxm, sxm, qsm, mr, k, nb, asked, acc); break;
        case Q8_Q5_0: many_rows_dot_avx2(Q8_Q5_0, rows, bytes, qm, dxm, sxm, qsm, mr, k, nb, asked, acc); break;
        case Q8_Q5_1: many_rows_dot_avx2(Q8_Q5_1, rows, bytes, qm, dxm, sxm, qsm, mr, k, nb, asked, acc); break;
        default: many_rows_dot_avx2(Q8_Q8_0, rows, bytes, qm, dxm, sxm, qsm, mr, k, nb, asked, acc); break;
        }
        for (int64_t m = 0; m < mr; ++m) {
            float out[8];
            _mm256_storeu_ps(out, acc[m]);
            for (int r = 0; r < nr; ++r) y[(m0 + m) * y_stride + n + r] = bias ? out[r] + bias[n + r] : out[r];
        }
    }
}
#endif


/* The quantised form of m_rows x rows of k in one buffer: the scales dx [m_rows, k / 32], the scaled sums
 * sx [m_rows, k / 32], the integer sums qsum [m_rows, k / 32], the bytes q [m_rows, k]; then, in AVX-512
 * builds, the same rows as panels of Q8_PANEL (below) for the many-row body: for panel p, block b and
 * 4-byte group g, the 16 rows' 4 bytes side by side (pq, each q + 128 as an unsigned byte; rows past m_rows
 * zero), and the 16 rows' dx and sx per block (pdx, psx [panels, k / 32, 16]). */
#define Q8_PANEL 16
typedef struct {
    int8_t *q;
    float *dx, *sx;
    int32_t *qsum;
    uint8_t *pq;
    float *pdx, *psx;
    void *ks; /* the K-quants' 256-blocks (quant_q8_k.c), at a 64-byte boundary after the rest */
} q8_rows;

/* quant_q8_k.c: the K-quants against 256-element activation blocks. */
int64_t q8k_block_bytes(int qtype);
int64_t q8k_section_bytes(int64_t m_rows, int64_t k);
void q8k_quantize(const float *x, int64_t m_rows, int64_t k, void *section);
void q8k_group(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n, int nr, int64_t n_end, const void *section,
               int64_t m_rows, int64_t k, const float *bias, float *y, int64_t y_stride);

#ifdef Q8_AVX512
static int64_t panels_of(int64_t m_rows) { return (m_rows + Q8_PANEL - 1) / Q8_PANEL; }
#endif

/* The buffer's layout; with panels, pq starts at a 64-byte boundary (the buffer holds 64 bytes more). */
static q8_rows q8_rows_in(void *buf, int64_t m_rows, int64_t k) {
    float *scales = buf;
    const int64_t nb = k / 32;
    q8_rows r = {(int8_t *)(scales + 3 * m_rows * nb), scales, scales + m_rows * nb,
                 (int32_t *)(scales + 2 * m_rows * nb), NULL, NULL, NULL, NULL};
    uintptr_t end = (uintptr_t)(r.q + m_rows * k);
#ifdef Q8_AVX512
    r.pq = (uint8_t *)((end + 63) / 64 * 64);
    r.pdx = (float *)(r.pq + panels_of(m_rows) * Q8_PANEL * k);
    r.psx = r.pdx + panels_of(m_rows) * nb * Q8_PANEL;
    end = (uintptr_t)(r.psx + panels_of(m_rows) * nb * Q8_PANEL);
#endif
    r.ks = (void *)((end + 63) / 64 * 64);
    return r;
}

/* The bytes quant_q8_quantize needs for m_rows rows of k (k a multiple of 32). */
int64_t quant_q8_buffer_bytes(int64_t m_rows, int64_t k) {
    int64_t bytes = (int64_t)sizeof(float) * 3 * m_rows * (k / 32) + m_rows * k;
#ifdef Q8_AVX512
    const int64_t panels = panels_of(m_rows) * Q8_PANEL;
    bytes += 64 + panels * k + (int64_t)sizeof(float) * 2 * panels * (k / 32);
#endif
    return bytes + 64 + q8k_section_bytes(m_rows, k); /* the K section, sized whatever k is: grows with k */
}

#ifdef Q8_AVX512
/* The panels of the rows already quantised in r (see q8_rows). */
static void fill_panels(const q8_rows *r, int64_t m_rows, int64_t k) {
    const int64_t nb = k / 32, panels = panels_of(m_rows);
    if (m_rows % Q8_PANEL) { /* the last panel's lanes past m_rows */
        memset(r->pq, 0, (size_t)(panels * Q8_PANEL * k));
        memset(r->pdx, 0, sizeof(float) * (size_t)(2 * panels * nb * Q8_PANEL));
    }
    for (int64_t m = 0; m < m_rows; ++m) {
        const int64_t p = m / Q8_PANEL, lane = m % Q8_PANEL;
        uint8_t *panel = r->pq + p * Q8_PANEL * k + lane * 4;
        for (int64_t g = 0; g < k / 4; ++g) { /* group g of the row: 4 bytes at g * 64 + lane * 4 */
            uint32_t v;
            memcpy(&v, r->q + m * k + 4 * g, 4);
            v ^= 0x80808080u;
            memcpy(panel + g * 64, &v, 4);
        }
        for (int64_t b = 0; b < nb; ++b) {
            r->pdx[(p * nb + b) * Q8_PANEL + lane] = r->dx[m * nb + b];
            r->psx[(p * nb + b) * Q8_PANEL + lane] = r->sx[m * nb + b];
        }
    }
}
#endif

#ifdef Q8_AVX512
/* The one-row body at 512 bits: two blocks of a weight row against 64 activation bytes per dpbusd, where
 * the AVX2 body takes one block per 256-bit dpbusd after flipping signs. Each block's integers go in as
 * unsigned bytes (Q8_0's q + 128, Q4_0's and Q5_0's q before their offset of 8 or 16, Q4_1's and Q5_1's q
 * as stored), so no sign trick is needed, and the offset comes back out in integers: sum_j (u_j - o) q_j =
 * sum_j u_j q_j - o * qsum, the same int32 as the portable sum. The two blocks' eight lanes per row are
 * reduced for eight rows at once (three unpack-and-add levels and one lane shuffle), and from there each
 * block's float operations are rows_dot_avx2's in its order: the same bits. */

/* p's 16 (32) bytes, or zeros when the block is not there (the odd last block of a row: nothing past the
 * row is read). */
static inline __m128i bytes16(const uint8_t *p, int there) {
    return there ? _mm_loadu_si128((const __m128i *)p) : _mm_setzero_si128();
}
static inline __m256i bytes32(const uint8_t *p, int there) {
    return there ? _mm256_loadu_si256((const __m256i *)p) : _mm256_setzero_si256();
}
static inline uint64_t bits32(const uint8_t *p, int there) {
    uint32_t v = 0;
    if (there) memcpy(&v, p, 4);
    return v;
}

/* log2 of the offset o the unsigned bytes of pair_bytes carry over the block's integers (0: none). */
static inline int offset_bits(const int qtype) {
    return qtype == Q8_Q8_0 ? 7 : qtype == Q8_Q5_0 ? 4 : qtype == Q8_Q4_0 ? 3 : 0;
}

/* Blocks b (at block) and b + 1 (block + bytes; zeros unless two) of one weight row as 64 unsigned bytes in
 * weight order. Nibbles: the two blocks' 16 bytes go to lanes [b, b, b + 1, b + 1], the second of each pair
 * shifted down by 4, then masked to 4 bits; a Q5 block's 32 fifth bits are the mask of an add of 16. */
static inline __attribute__((always_inline)) __m512i pair_bytes(const int qtype, const uint8_t *block,
                                                                int64_t bytes, const int two) {
    if (qtype == Q8_Q8_0) {
        const __m256i first = _mm256_loadu_si256((const __m256i *)(block + 2));
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(first), bytes32(block + bytes + 2, two), 1);
        return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
    }
    const int five = qtype == Q8_Q5_0 || qtype == Q8_Q5_1, affine = qtype == Q8_Q4_1 || qtype == Q8_Q5_1;
    const int64_t qh = affine ? 4 : 2, qs = qh + (five ? 4 : 0);
    const __m256i pair = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(block + qs))), bytes16(block + bytes + qs, two), 1);
    __m512i v = _mm512_shuffle_i64x2(_mm512_castsi256_si512(pair), _mm512_castsi256_si512(pair), 0x50);
    v = _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xFF00FF00u, v, 4), _mm512_set1_epi8(15));
    if (five) {
        const uint64_t bits = bits32(block + qh, 1) | bits32(block + bytes + qh, two) << 32;
        v = _mm512_mask_add_epi8(v, _cvtu64_mask64(bits), v, _mm512_set1_epi8(16));
    }
    return v;
}

/* v[r]: lanes 0-7 block b of row r, lanes 8-15 block b + 1 -> lane r: row r's sum over block b, lane
 * 8 + r: over block b + 1. */
static inline __m512i pair_sums(const __m512i v[8]) {
    __m512i t[4];
    for (int i = 0; i < 4; ++i)
        t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    /* each 128-bit lane: the four rows' sums over that lane's four int32 */
    const __m512i u0 = _mm512_add_epi32(_mm512_unpacklo_epi64(t[0], t[1]), _mm512_unpackhi_epi64(t[0], t[1]));
    const __m512i u1 = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2], t[3]), _mm512_unpackhi_epi64(t[2], t[3]));
    /* [b rows 0-3, b + 1 rows 0-3, b rows 4-7, b + 1 rows 4-7] */
    const __m512i both = _mm512_add_epi32(_mm512_shuffle_i64x2(u0, u1, 0x88), _mm512_shuffle_i64x2(u0, u1, 0xDD));
    return _mm512_shuffle_i64x2(both, both, 0xD8);
}

/* Lanes 0-7 v[0], lanes 8-15 v[1] (v[0] alone unless two). */
static inline __m512 pair_bcast(const float *v, const int two) {
    const __m512d first = _mm512_castps_pd(_mm512_set1_ps(v[0]));
    return _mm512_castpd_ps(_mm512_insertf64x4(first, _mm256_castps_pd(_mm256_set1_ps(two ? v[1] : 0.f)), 1));
}

/* The first four bytes of block b of the eight rows (lanes 0-7) and of block b + 1 (lanes 8-15; zeros
 * unless two): their f16 d, and m after it for an affine format. Vector loads of four bytes and unpacks:
 * a gather took longer here. */
static inline __attribute__((always_inline)) __m512i header_words(const uint8_t *const rows[8], int64_t offset,
                                                                 int64_t bytes, const int two) {
    __m128i w[16];
    for (int r = 0; r < 8; ++r) {
        w[r] = _mm_loadu_si32(rows[r] + offset);
        w[8 + r] = two ? _mm_loadu_si32(rows[r] + offset + bytes) : _mm_setzero_si128();
    }
    __m128i p[8], quad[4];
    for (int i = 0; i < 8; ++i) p[i] = _mm_unpacklo_epi32(w[2 * i], w[2 * i + 1]);
    for (int i = 0; i < 4; ++i) quad[i] = _mm_unpacklo_epi64(p[2 * i], p[2 * i + 1]);
    const __m256i lo = _mm256_inserti128_si256(_mm256_castsi128_si256(quad[0]), quad[1], 1);
    const __m256i hi = _mm256_inserti128_si256(_mm256_castsi128_si256(quad[2]), quad[3], 1);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* Blocks b and b + 1 (b alone unless two) of the eight rows into acc, rows_dot_avx2's float steps per
 * block with both blocks in one vector (lane r block b, lane 8 + r block b + 1), then added to acc block
 * by block. */
static inline __attribute__((always_inline)) __m256 pair_step(const int qtype, const int two,
                                                              const uint8_t *const rows[8], int64_t bytes,
                                                              const int8_t *q, const float *dx, const float *sx,
                                                              const int32_t *qsum, int64_t b, __m256 acc) {
    const int affine = qtype == Q8_Q4_1 || qtype == Q8_Q5_1;
    const int shift = offset_bits(qtype);
    const __m512i qv = two ? _mm512_loadu_si512((const void *)(q + 32 * b))
                           : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(q + 32 * b)));
    __m512i v[8];
    for (int r = 0; r < 8; ++r)
        v[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), pair_bytes(qtype, rows[r] + b * bytes, bytes, two), qv);
    __m512i isum = pair_sums(v);
    if (shift) { /* minus o * qsum, block by block */
        const __m256i next = _mm256_set1_epi32(two ? qsum[b + 1] : 0);
        const __m512i sums = _mm512_inserti64x4(_mm512_set1_epi32(qsum[b]), next, 1);
        isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(sums, (unsigned)shift));
    }
    const __m512i words = header_words(rows, b * bytes, bytes, two);
    const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
    __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, pair_bcast(dx + b, two)));
    if (affine) {
        const __m512 mw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16)));
        t = _mm512_add_ps(t, _mm512_mul_ps(mw, pair_bcast(sx + b, two)));
    }
    acc = _mm256_add_ps(acc, _mm512_castps512_ps256(t));
    if (two) acc = _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1)));
    return acc;
}

static inline __attribute__((always_inline)) __m256 rows_dot_avx512(const int qtype, const uint8_t *const rows[8],
                                                                    int64_t bytes, const int8_t *q,
                                                                    const float *dx, const float *sx,
                                                                    const int32_t *qsum, int64_t nb,
                                                                    const ahead_window *ahead) {
    __m256 acc = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        ask_step(ahead, b / 2);
        acc = pair_step(qtype, 1, rows, bytes, q, dx, sx, qsum, b, acc);
    }
    if (b < nb) {
        ask_step(ahead, b / 2);
        acc = pair_step(qtype, 0, rows, bytes, q, dx, sx, qsum, b, acc);
    }
    return acc;
}

static void group_avx512(int qtype, const uint8_t *w, int64_t row_bytes, int64_t bytes, int64_t n, int nr,
                         const int8_t *q, const float *dx, const float *sx, const int32_t *qsum, int64_t nb,
                         const ahead_window *ahead, float out[8]) {
    const uint8_t *rows[8];
    for (int r = 0; r < 8; ++r) rows[r] = w + (n + (r < nr ? r : 0)) * row_bytes;
    __m256 acc;
    switch (qtype) {
    case Q8_Q4_0: acc = rows_dot_avx512(Q8_Q4_0, rows, bytes, q, dx, sx, qsum, nb, ahead); break;
    case Q8_Q4_1: acc = rows_dot_avx512(Q8_Q4_1, rows, bytes, q, dx, sx, qsum, nb, ahead); break;
    case Q8_Q5_0: acc = rows_dot_avx512(Q8_Q5_0, rows, bytes, q, dx, sx, qsum, nb, ahead); break;
    case Q8_Q5_1: acc = rows_dot_avx512(Q8_Q5_1, rows, bytes, q, dx, sx, qsum, nb, ahead); break;
    default: acc = rows_dot_avx512(Q8_Q8_0, rows, bytes, q, dx, sx, qsum, nb, ahead); break;
    }
    _mm256_storeu_ps(out, acc);
}
/* The many-row body at 512 bits: x rows in lanes. For 16 x rows (a panel) and one weight block, each of
 * the block's eight 4-byte groups is one dpbusd of the panel's group (16 rows' 4 bytes, q + 128) by the
 * group's 4 weight bytes broadcast to every lane (the signed integers, widened once per block for all the
 * panels), so a block's int32 sum lands in each row's own lane with no reduction across lanes, and the
 * + 128 comes back out as 128 * sum_j w_j. The float steps per lane are the one-row bodies' (scale = dw *
 * dx, t = isum * scale [+ mw * sx], acc + t in block order), so every output has their bits. */
#define Q8_PANEL_CHUNK 32 /* blocks of the eight rows widened at a time (8 KB of bytes) */
#define Q8_PANEL_PASS 8   /* panels per pass: 128 x rows, their accumulators on the stack */

/* The eight rows' blocks b0 .. b0 + cb - 1 as block_bytes gives them (wb: signed bytes in weight order, Q4_1's
 * and Q5_1's unsigned q below 128 as they are, so all are dpbusd's signed operand), with each block's
 * 128 * sum_j w_j (wsum) and its scales (dw, mw) as floats. */
typedef struct {
    int8_t wb[Q8_PANEL_CHUNK][8][32];
    int32_t wsum[Q8_PANEL_CHUNK][8];
    float dw[Q8_PANEL_CHUNK][8], mw[Q8_PANEL_CHUNK][8];
} panel_weights;

static inline __attribute__((always_inline)) void widen_panel_weights(const int qtype,
                                                                     const uint8_t *const rows[8],
                                                                     int64_t bytes, int64_t b0, int64_t cb,
                                                                     const ahead_window *ahead,
                                                                     panel_weights *pw) {
    const int affine = qtype == Q8_Q4_1 || qtype == Q8_Q5_1;
    for (int64_t c = 0; c < cb; ++c) {
        ask_step(ahead, b0 + c);
        for (int r = 0; r < 8; ++r) {
            const uint8_t *block = rows[r] + (b0 + c) * bytes;
            const __m256i v = block_bytes(qtype, block);
            _mm256_storeu_si256((__m256i *)pw->wb[c][r], v);
            /* sum of the 32 signed bytes: their + 128 summed 8 at a time by sad, less 32 * 128 */
            const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(v, _mm256_set1_epi8((char)0x80)),
                                                _mm256_setzero_si256());
            const __m128i half = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1));
            const int64_t sum = _mm_cvtsi128_si64(_mm_add_epi64(half, _mm_unpackhi_epi64(half, half)));
            pw->wsum[c][r] = 128 * (int32_t)(sum - 32 * 128);
            pw->dw[c][r] = f16_at(block);
            pw->mw[c][r] = affine ? f16_at(block + 2) : 0.f;
        }
    }
}

/* The eight rows against panels p0 .. p1 - 1 over blocks b0 .. b0 + cb - 1, into acc[p - p0][r]. */
static inline __attribute__((always_inline)) void panel_blocks(const int affine, const panel_weights *pw,
                                                              const q8_rows *xq, int64_t k, int64_t p0,
                                                              int64_t p1, int64_t b0, int64_t cb,
                                                              __m512 acc[][8]) {
    const int64_t nb = k / 32;
    for (int64_t p = p0; p < p1; ++p) {
        const uint8_t *panel = xq->pq + p * Q8_PANEL * k;
        for (int64_t c = 0; c < cb; ++c) {
            const int64_t b = b0 + c;
            __m512i qv[8];
            for (int g = 0; g < 8; ++g) qv[g] = _mm512_load_si512((const void *)(panel + (8 * b + g) * 64));
            const __m512 dx = _mm512_loadu_ps(xq->pdx + (p * nb + b) * Q8_PANEL);
            const __m512 sx = _mm512_loadu_ps(xq->psx + (p * nb + b) * Q8_PANEL);
            for (int r = 0; r < 8; ++r) {
                const int8_t *wb = pw->wb[c][r];
                __m512i isum = _mm512_setzero_si512();
                for (int g = 0; g < 8; ++g) /* the 4 bytes broadcast by the load (a move through a GPR: 15% slower) */
                    isum = _mm512_dpbusd_epi32(isum, qv[g], _mm512_broadcastd_epi32(_mm_loadu_si32(wb + 4 * g)));
                isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(pw->wsum[c][r]));
                const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(pw->dw[c][r]), dx);
                __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), scale);
                if (affine) t = _mm512_add_ps(t, _mm512_mul_ps(_mm512_set1_ps(pw->mw[c][r]), sx));
                acc[p - p0][r] = _mm512_add_ps(acc[p - p0][r], t);
            }
        }
    }
}

static inline __attribute__((always_inline)) void panels_dot_avx512(const int qtype, const uint8_t *const rows[8],
                                                                    int64_t bytes, int nr, int64_t n,
                                                                    const q8_rows *xq, int64_t m_rows, int64_t k,
                                                                    const ahead_window *ahead, const float *bias,
                                                                    float *y, int64_t y_stride) {
    const int affine = qtype == Q8_Q4_1 || qtype == Q8_Q5_1;
    const int64_t nb = k / 32, panels = panels_of(m_rows);
    const ahead_window none = {NULL, 0, 0};
    panel_weights pw;
    for (int64_t p0 = 0; p0 < panels; p0 += Q8_PANEL_PASS) {
        const int64_t p1 = panels - p0 < Q8_PANEL_PASS ? panels : p0 + Q8_PANEL_PASS;
        __m512 acc[Q8_PANEL_PASS][8];
        for (int64_t p = 0; p < p1 - p0; ++p)
            for (int r = 0; r < 8; ++r) acc[p][r] = _mm512_setzero_ps();
        for (int64_t b0 = 0; b0 < nb; b0 += Q8_PANEL_CHUNK) {
            const int64_t cb = nb - b0 < Q8_PANEL_CHUNK ? nb - b0 : Q8_PANEL_CHUNK;
            widen_panel_weights(qtype, rows, bytes, b0, cb, p0 == 0 ? ahead : &none, &pw);
            panel_blocks(affine, &pw, xq, k, p0, p1, b0, cb, acc);
        }
        for (int64_t p = p0; p < p1; ++p)
            for (int r = 0; r < nr; ++r) {
                float out[Q8_PANEL];
                _mm512_storeu_ps(out, acc[p - p0][r]);
                for (int64_t m = p * Q8_PANEL; m < m_rows && m < (p + 1) * Q8_PANEL; ++m)
                    y[m * y_stride + n + r] = bias ? out[m % Q8_PANEL] + bias[n + r] : out[m % Q8_PANEL];
            }
    }
}

/* q8_group's outputs for m_rows >= Q8_PANEL_MIN_ROWS x rows, from the panels. */
static void group_panels_avx512(int qtype, const uint8_t *w, int64_t row_bytes, int64_t bytes, int64_t n, int nr,
                                int64_t n_end, const q8_rows *xq, int64_t m_rows, int64_t k, const float *bias,
                                float *y, int64_t y_stride) {
    const uint8_t *rows[8];
    for (int r = 0; r < 8; ++r) rows[r] = w + (n + (r < nr ? r : 0)) * row_bytes;
    const ahead_window ahead = window_ahead(w, row_bytes, n, n_end, 8, Q8_PREFETCH_ROWS, k / 32);
    switch (qtype) {
    case Q8_Q4_0: panels_dot_avx512(Q8_Q4_0, rows, bytes, nr, n, xq, m_rows, k, &ahead, bias, y, y_stride); break;
    case Q8_Q4_1: panels_dot_avx512(Q8_Q4_1, rows, bytes, nr, n, xq, m_rows, k, &ahead, bias, y, y_stride); break;
    case Q8_Q5_0: panels_dot_avx512(Q8_Q5_0, rows, bytes, nr, n, xq, m_rows, k, &ahead, bias, y, y_stride); break;
    case Q8_Q5_1: panels_dot_avx512(Q8_Q5_1, rows, bytes, nr, n, xq, m_rows, k, &ahead, bias, y, y_stride); break;
    default: panels_dot_avx512(Q8_Q8_0, rows, bytes, nr, n, xq, m_rows, k, &ahead, bias, y, y_stride); break;
    }
}
#endif

/* The eight rows Q8_PREFETCH_ROWS (below) ahead are asked for while a group computes (prefetch.h: spread over the
 * first x row's loop with AVX2, one burst before the group in the portable build). */
#ifndef Q8_AVX2
static inline void prefetch_rows(const uint8_t *w, int64_t row_bytes, int64_t first, int64_t n_out) {
    const int64_t last = first + 8 < n_out ? first + 8 : n_out;
    if (first >= last) return;
    for (const uint8_t *p = w + first * row_bytes, *end = w + last * row_bytes; p < end; p += 64)
        __builtin_prefetch(p, 0, 1);
}
#endif

/* Outputs n .. n + nr - 1 (nr <= 8) of every x row, from the quantised rows (xq: m_rows rows of k),
 * written at y[m * y_stride + n + r] (bias indexed by n + r); the rows ahead are asked for up to row n_end.
 * An output's operations depend on its own weight row and x row only, not on where its group of eight
 * starts: any split of the outputs gives the same bits. */
static void q8_group(int qtype, const uint8_t *w, int64_t row_bytes, int64_t bytes, int64_t n, int nr,
                     int64_t n_end, const q8_rows *xq, int64_t m_rows, int64_t k, const float *bias, float *y,
                     int64_t y_stride) {
    const int64_t nb = k / 32;
    const int8_t *q = xq->q;
    const float *dx = xq->dx, *sx = xq->sx;
#ifdef Q8_AVX512
    if (m_rows >= Q8_PANEL_MIN_ROWS) {
        group_panels_avx512(qtype, w, row_bytes, bytes, n, nr, n_end, xq, m_rows, k, bias, y, y_stride);
        return;
    }
#endif
#ifdef Q8_AVX2
    if (m_rows > 1) {
        group_many_avx2(qtype, w, row_bytes, bytes, n, nr, n_end, q, dx, sx, xq->qsum, m_rows, k, bias, y,
                        y_stride);
        return;
    }
#ifdef Q8_AVX512
    const ahead_window ahead = window_ahead(w, row_bytes, n, n_end, 8, Q8_PREFETCH_ROWS, (nb + 1) / 2);
#else
    const ahead_window ahead = window_ahead(w, row_bytes, n, n_end, 8, Q8_PREFETCH_ROWS, steps_of(qtype, nb));
#endif
#else
    prefetch_rows(w, row_bytes, n + Q8_PREFETCH_ROWS, n_end);
#endif
    for (int64_t m = 0; m < m_rows; ++m) {
        float out[8];
#if defined(Q8_AVX512)
        group_avx512(qtype, w, row_bytes, bytes, n, nr, q + m * k, dx + m * nb, sx + m * nb, xq->qsum + m * nb, nb,
                     &ahead, out); /* one x row here: more take group_many_avx2 */
#elif defined(Q8_AVX2)
        group_avx2(qtype, w, row_bytes, bytes, n, nr, q + m * k, dx + m * nb, sx + m * nb, xq->qsum + m * nb, nb,
                   &ahead, out); /* one x row here: more take group_many_avx2 */
#else
        for (int r = 0; r < nr; ++r)
            out[r] = row_dot_portable(qtype, w + (n + r) * row_bytes, bytes, q + m * k, dx + m * nb, sx + m * nb,
                                      nb);
#endif
        for (int r = 0; r < nr; ++r) y[m * y_stride + n + r] = bias ? out[r] + bias[n + r] : out[r];
    }
}

/* The parts of the quantised buffer a GEMM reads: the 32-blocks (Q4_0 .. Q8_0) and the 256-blocks (the
 * K-quants). */
enum { Q8_PART_32 = 1, Q8_PART_256 = 2, Q8_PARTS_ALL = 3 };

/* The part qtype's q8 kernel reads (Q8_PART_32 or Q8_PART_256), 0 if it has none; exported for a caller
 * that rounds x once for several formats (decoder_layers.c). */
int quant_q8_part(int qtype) {
    return q8_block_bytes(qtype) ? Q8_PART_32 : q8k_block_bytes(qtype) ? Q8_PART_256 : 0;
}

/* x [m_rows, k] rounded to 8-bit blocks into buf (quant_q8_buffer_bytes(m_rows, k) bytes, float-aligned):
 * the parts asked for (Q8_PART_*; the 256-blocks only where k is a multiple of 256), which every
 * quant_gemm_q8_rows call over this x for a format of those parts reads. The same code as quant_gemm_q8's
 * own, so the same bytes. Returns 0, -1 for k not a multiple of 32. */
int quant_q8_quantize_parts(const float *x, int64_t m_rows, int64_t k, void *buf, int parts) {
    if (k % 32) return -1;
    const q8_rows r = q8_rows_in(buf, m_rows, k);
    const int64_t nb = k / 32;
    if (parts & Q8_PART_32) {
        for (int64_t m = 0; m < m_rows; ++m)
            quantize_row(x + m * k, k, r.q + m * k, r.dx + m * nb, r.sx + m * nb, r.qsum + m * nb);
#ifdef Q8_AVX512
        if (m_rows >= Q8_PANEL_MIN_ROWS) fill_panels(&r, m_rows, k);
#endif
    }
    if ((parts & Q8_PART_256) && k % 256 == 0) q8k_quantize(x, m_rows, k, r.ks);
    return 0;
}

/* Every part (quant_q8_quantize_parts). */
int quant_q8_quantize(const float *x, int64_t m_rows, int64_t k, void *buf) {
    return quant_q8_quantize_parts(x, m_rows, k, buf, Q8_PARTS_ALL);
}

/* Whether qtype has a q8 kernel for rows of k: a 32-block format and k a multiple of 32, or a K-quant and k
 * a multiple of 256. */
static int q8_fits(int qtype, int64_t k) {
    const int part = quant_q8_part(qtype);
    return part == Q8_PART_32 ? k % 32 == 0 : part == Q8_PART_256 ? k % 256 == 0 : 0;
}

/* Outputs n .. n + nr - 1 of every x row, by the format's kernel. */
static void group_of(int qtype, const uint8_t *w, int64_t row_bytes, int64_t n, int nr, int64_t n_end,
                     const q8_rows *r, int64_t m_rows, int64_t k, const float *bias, float *y, int64_t y_stride) {
    if (quant_q8_part(qtype) == Q8_PART_256)
        q8k_group(qtype, w, row_bytes, n, nr, n_end, r->ks, m_rows, k, bias, y, y_stride);
    else
        q8_group(qtype, w, row_bytes, q8_block_bytes(qtype), n, nr, n_end, r, m_rows, k, bias, y, y_stride);
}

/* Outputs n_begin .. n_end - 1 of quant_gemm_q8 on the calling thread alone, from x already quantised into
 * buf by quant_q8_quantize (or quant_q8_quantize_parts with this format's part), written at y[m * y_stride
 * + n] (bias indexed by n too): a slice of the columns for a caller that splits one GEMM over its own
 * threads (decoder_layers.c). Every output is quant_gemm_q8's, so any split gives its bits. Returns 0, -1
 * for a qtype without a q8 kernel for rows of k (checked first: buf NULL with n_begin == n_end only
 * checks). */
int quant_gemm_q8_rows(const void *buf, int64_t m_rows, const uint8_t *w, int64_t row_bytes, int qtype, int64_t k,
                       int64_t n_begin, int64_t n_end, const float *bias, float *y, int64_t y_stride) {
    if (!q8_fits(qtype, k)) return -1;
    if (n_begin >= n_end) return 0;
    const q8_rows r = q8_rows_in((void *)buf, m_rows, k);
    for (int64_t n = n_begin; n < n_end; n += 8) {
        const int nr = n_end - n >= 8 ? 8 : (int)(n_end - n);
        group_of(qtype, w, row_bytes, n, nr, n_end, &r, m_rows, k, bias, y, y_stride);
    }
    return 0;
}

/* y = x @ W^T (+ bias) with x rounded to 8-bit blocks (see the top; the K-quants: quant_q8_k.c). Returns 0,
 * -1 for a qtype without a q8 kernel for rows of k, -2 if the quantised rows could not be allocated. */
int quant_gemm_q8(const float *x, int64_t m_rows, const uint8_t *w, int64_t row_bytes, int qtype, int64_t k,
                  int64_t n_out, const float *bias, float *y, int num_threads) {
    if (!q8_fits(qtype, k)) return -1;
    void *buf = malloc((size_t)quant_q8_buffer_bytes(m_rows, k) + 1);
    if (buf == NULL) return -2;
    quant_q8_quantize_parts(x, m_rows, k, buf, quant_q8_part(qtype));
    const q8_rows r = q8_rows_in(buf, m_rows, k);
    const int64_t groups = (n_out + 7) / 8;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t n = 8 * g;
        const int nr = n_out - n >= 8 ? 8 : (int)(n_out - n);
        group_of(qtype, w, row_bytes, n, nr, n_out, &r, m_rows, k, bias, y, n_out);
    }
    free(buf);
    return 0;
}

/* Whether qtype has a q8 kernel (for the Python side's refusal). */
int quant_q8_supports(int qtype) { return quant_q8_part(qtype) != 0; }

/* The instruction set the integer dot products use: 0 portable, 1 AVX2 maddubs, 2 VNNI dpbusd at 256 bits,
 * 3 the same with the one-row body at 512 bits (AVX-512 VNNI). */
int quant_q8_variant(void) {
#if defined(Q8_AVX512)
    return 3;
#elif defined(Q8_AVX2) && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
    return 2;
#elif defined(Q8_AVX2)
    return 1;
#else
    return 0;
#endif
}
